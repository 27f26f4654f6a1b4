"""The PPO objective of the actor and the critic: the one definition every update uses.

The plain update (trainer/ppo.py, whole mini-batch) and the pipeline's last stages
(pipeline/stages.py, one micro-batch at a time) both compute log-probs or values with the model
and hand them here. Given the mini-batch's normalisers (`num_tokens`, `num_seqs`), a
micro-batch's loss and metrics are its exact shares: summed over the micro-batches they give
the mini-batch's loss, gradient and metrics. Without normalisers the inputs are the whole
mini-batch and the values are the mini-batch's.

Inputs are arrays only (no model): logp / entropy / values [B, T] float32 and the batch dict
mask, old_logp, advantages, ref_logp (KL loss on), old_values, returns, each [B, T].
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from rlhfuse_jax.rl import kl as kl_lib
from rlhfuse_jax.rl import losses, masked

ACTOR_METRICS = ("actor_loss", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl",
                 "entropy", "kl_loss")
CRITIC_METRICS = ("critic_loss", "vf_loss", "vf_clipfrac")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The PPO actor and critic losses (the trainer maps its AlgoConfig here: ppo.loss_config)."""
  clip_eps: float = 0.2                   # PPO ratio clip
  clip_eps_high: Optional[float] = None   # None: clip_eps (set higher for clip-higher)
  clip_ratio_c: Optional[float] = None    # dual-clip cap for A < 0 (> 1); None: off
  loss_agg: str = "token-mean"            # actor loss aggregation (rl/losses.py)
  entropy_coef: float = 0.0               # loss -= entropy_coef * mean entropy
  kl_coef: float = 0.0                    # loss += kl_coef * KL-to-reference loss (0: off)
  kl_estimator: str = "k1"
  kl_loss_agg: str = "token-mean"         # aggregation of the KL term (the trainer's: token-mean)
  value_clip_eps: Optional[float] = 0.2   # None: unclipped value loss
  vf_coef: float = 0.5                    # critic loss = vf_coef * value loss (token-mean)
  temperature: float = 1.0                # sampling temperature of the behaviour log-probs

  def __post_init__(self):
    losses.check_loss_agg(self.loss_agg)
    losses.check_loss_agg(self.kl_loss_agg)
    if not 0 < self.clip_eps < 1:  # 1 - clip_eps is the ratio's lower clip
      raise ValueError(f"loss.clip_eps={self.clip_eps} must be in (0, 1)")
    if self.clip_eps_high is not None and not self.clip_eps_high > 0:
      raise ValueError(f"loss.clip_eps_high={self.clip_eps_high} must be > 0 (None: clip_eps)")
    if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
      raise ValueError(f"loss.clip_ratio_c={self.clip_ratio_c} must be > 1 (None: off)")
    # (negative, jnp.clip's bounds crossed and every value change clipped to the one bound:
    # a wrong value loss, silently)
    if self.value_clip_eps is not None and not self.value_clip_eps > 0:
      raise ValueError(f"loss.value_clip_eps={self.value_clip_eps} must be > 0 (None: "
                       "unclipped)")
    # (NaN passed a "< 0" test: every loss and gradient NaN; inf made them inf or NaN)
    for name in ("kl_coef", "entropy_coef", "vf_coef"):
      if not 0 <= getattr(self, name) < math.inf:
        raise ValueError(f"loss.{name}={getattr(self, name)} must be finite and >= 0")
    if not 0 < self.temperature < math.inf:
      raise ValueError(f"loss.temperature={self.temperature} must be finite and > 0")
    kl_lib.get_kl_estimator(self.kl_estimator)  # raises naming the known estimators


def _share(mask: jax.Array, num_tokens: Optional[jax.Array]):
  """(fraction of the mini-batch's tokens in this batch, the token normaliser)."""
  if num_tokens is None:
    return 1.0, jnp.maximum(jnp.sum(mask), 1.0)
  denom = jnp.where(num_tokens > 0, num_tokens, 1.0)
  return jnp.sum(mask) / denom, denom


def actor_objective(cfg: LossConfig, logp: jax.Array, entropy: jax.Array,
                    batch: Dict[str, jax.Array], num_tokens: Optional[jax.Array] = None,
                    num_seqs: Optional[jax.Array] = None
                    ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
  """PPO clipped loss - entropy_coef * entropy (+ kl_coef * KL-to-reference loss).

  Returns (loss, metrics keyed by ACTOR_METRICS). metrics' fractions and means are shares of
  the mini-batch (see the module docstring); without normalisers they are this batch's own.
  """
  mask = batch["mask"].astype(jnp.float32)
  agg = {} if num_tokens is None else {"num_tokens": num_tokens, "num_seqs": num_seqs}
  pg, m = losses.policy_loss(logp, batch["old_logp"], batch["advantages"], mask, cfg.clip_eps,
                             cfg.clip_eps_high, loss_agg=cfg.loss_agg,
                             clip_ratio_c=cfg.clip_ratio_c, **agg)
  share, denom = _share(mask, num_tokens)
  ent = (masked.masked_mean(entropy, mask) if num_tokens is None
         else masked.masked_sum(entropy, mask) / denom)
  loss = pg - cfg.entropy_coef * ent
  kl = jnp.zeros((), jnp.float32)
  if cfg.kl_coef > 0:
    kl = losses.kl_loss(logp, batch["ref_logp"], mask, cfg.kl_estimator, cfg.kl_loss_agg, **agg)
    loss = loss + cfg.kl_coef * kl
  return loss, {"actor_loss": loss, "pg_loss": pg, "pg_clipfrac": m["pg_clipfrac"] * share,
                "pg_clipfrac_lower": m["pg_clipfrac_lower"] * share,
                "ppo_kl": m["ppo_kl"] * share, "entropy": ent, "kl_loss": kl}


def critic_objective(cfg: LossConfig, values: jax.Array, batch: Dict[str, jax.Array],
                     num_tokens: Optional[jax.Array] = None
                     ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
  """vf_coef * clipped value loss (a token mean); metrics keyed by CRITIC_METRICS."""
  mask = batch["mask"].astype(jnp.float32)
  agg = {} if num_tokens is None else {"num_tokens": num_tokens}
  vf, m = losses.value_loss(values, batch["old_values"], batch["returns"], mask,
                            cfg.value_clip_eps, loss_agg="token-mean", **agg)
  share, _ = _share(mask, num_tokens)
  loss = cfg.vf_coef * vf
  return loss, {"critic_loss": loss, "vf_loss": vf, "vf_clipfrac": m["vf_clipfrac"] * share}
