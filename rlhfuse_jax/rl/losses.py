"""PPO losses on per-token arrays: clipped policy loss, clipped value loss, KL loss (the
token log-probs and entropies they start from: models/sequences.py).

Conventions: `[batch, resp_len]` arrays aligned to response tokens, `mask` 1.0 on real tokens.
Padding contributes exactly nothing: per-token losses are selected with `jnp.where` before any
reduction, so padding gets zero gradient even where its inputs are inf/nan.

Loss aggregation (how per-token losses become one scalar) matters for long-tailed lengths:
- 'token-mean': sum over all valid tokens / number of valid tokens (long responses weigh more).
- 'seq-mean-token-sum': mean over sequences of the per-sequence token sum.
- 'seq-mean-token-mean': mean over sequences of the per-sequence token mean (original GRPO).
- 'seq-mean-token-sum-norm': mean over sequences of token sum / a constant horizon (Dr. GRPO;
  the horizon defaults to resp_len). Unlike verl's mode of the same name we also divide by the
  number of sequences, so the scale does not grow with the mini-batch size.
`num_tokens` / `num_seqs` override the denominators, e.g. with the counts of the whole
mini-batch when it is split into micro-batches whose gradients are summed.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from rlhfuse_jax.rl import kl as kl_lib
from rlhfuse_jax.rl import masked

Metrics = Dict[str, jax.Array]


def _token_mean(loss, mask, num_tokens, num_seqs, horizon):
  del num_seqs, horizon
  denom = jnp.sum(mask) if num_tokens is None else num_tokens
  return masked.masked_sum(loss, mask) / jnp.maximum(denom, 1.0)


def _seq_denominator(mask, num_seqs):
  return mask.shape[0] if num_seqs is None else num_seqs


def _seq_mean_token_sum(loss, mask, num_tokens, num_seqs, horizon):
  del num_tokens, horizon
  return jnp.sum(masked.masked_sum(loss, mask, axis=-1)) / _seq_denominator(mask, num_seqs)


def _seq_mean_token_mean(loss, mask, num_tokens, num_seqs, horizon):
  del num_tokens, horizon
  return jnp.sum(masked.masked_mean(loss, mask, axis=-1)) / _seq_denominator(mask, num_seqs)


def _seq_mean_token_sum_norm(loss, mask, num_tokens, num_seqs, horizon):
  del num_tokens
  horizon = mask.shape[-1] if horizon is None else horizon
  seq_sums = masked.masked_sum(loss, mask, axis=-1) / horizon  # [batch]
  return jnp.sum(seq_sums) / _seq_denominator(mask, num_seqs)


LOSS_AGGREGATIONS: Dict[str, Callable[..., jax.Array]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def check_loss_agg(loss_agg: str) -> None:
  """Raises a ValueError naming the known modes if `loss_agg` is not one of them."""
  if loss_agg not in LOSS_AGGREGATIONS:
    raise ValueError(f"Unknown loss_agg={loss_agg!r}; known modes: {sorted(LOSS_AGGREGATIONS)}")


def aggregate_loss(loss: jax.Array, mask: jax.Array, loss_agg: str = "token-mean", *,
                   num_tokens: Optional[jax.Array] = None, num_seqs: Optional[jax.Array] = None,
                   horizon: Optional[float] = None) -> jax.Array:
  """Reduces a per-token loss `[batch, resp_len]` to a scalar with mode `loss_agg`."""
  check_loss_agg(loss_agg)
  return LOSS_AGGREGATIONS[loss_agg](loss.astype(jnp.float32), mask.astype(jnp.float32),
                                     num_tokens, num_seqs, horizon)


def policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
                clip_eps_low: float, clip_eps_high: Optional[float] = None,
                loss_agg: str = "token-mean", clip_ratio_c: Optional[float] = None,
                **agg_kwargs) -> Tuple[jax.Array, Metrics]:
  """PPO clipped-ratio policy loss (Schulman et al., 2017) with optional asymmetric and dual clip.

  ratio = exp(logp - old_logp); per token  max(-A * ratio, -A * clip(ratio, 1 - eps_low,
  1 + eps_high)). `clip_eps_high` defaults to `clip_eps_low` (set it higher for DAPO's
  clip-higher). `clip_ratio_c` (> 1) is dual-clip PPO (Ye et al., 2020): for A < 0 the loss is
  also capped at -A * clip_ratio_c, so a huge ratio on a bad token cannot blow up the update.

  Returns (loss, metrics) with metrics 'pg_loss' (the loss), 'pg_clipfrac' (fraction of valid
  tokens where the clipped term is active), 'pg_clipfrac_lower' (fraction where the dual clip
  is active; 0 without it) and 'ppo_kl' (mean of old_logp - logp, an estimate of KL(old||new)).
  """
  check_loss_agg(loss_agg)
  if clip_eps_high is None:
    clip_eps_high = clip_eps_low
  if clip_ratio_c is not None and clip_ratio_c <= 1.0:
    raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1.0 (dual-clip lower bound)")
  valid = mask > 0
  mask = mask.astype(jnp.float32)
  adv = jnp.where(valid, advantages.astype(jnp.float32), 0.0)
  log_ratio = logp.astype(jnp.float32) - old_logp.astype(jnp.float32)  # [batch, resp_len]
  bound = kl_lib.MAX_LOG_RATIO
  log_ratio = jnp.where(valid, jnp.clip(log_ratio, -bound, bound), 0.0)
  ratio = jnp.exp(log_ratio)

  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
  per_token = jnp.maximum(unclipped, clipped)
  clipfrac = masked.masked_mean((clipped > unclipped).astype(jnp.float32), mask)
  if clip_ratio_c is not None:
    cap = -adv * clip_ratio_c
    dual = jnp.minimum(per_token, cap)
    lower_active = (adv < 0) & (cap < per_token)
    per_token = jnp.where(adv < 0, dual, per_token)
    clipfrac_lower = masked.masked_mean(lower_active.astype(jnp.float32), mask)
  else:
    clipfrac_lower = jnp.zeros((), jnp.float32)

  loss = aggregate_loss(per_token, mask, loss_agg, **agg_kwargs)
  metrics = {
      "pg_loss": loss,
      "pg_clipfrac": clipfrac,
      "pg_clipfrac_lower": clipfrac_lower,
      "ppo_kl": masked.masked_mean(-log_ratio, mask),
  }
  return loss, metrics


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array,
               clip_eps: Optional[float], loss_agg: str = "token-mean",
               **agg_kwargs) -> Tuple[jax.Array, Metrics]:
  """Clipped value loss: 0.5 * agg(max((V - R)^2, (V_old + clip(V - V_old, +-eps) - R)^2)).

  `clip_eps=None` disables clipping. Returns (loss, {'vf_loss', 'vf_clipfrac'}), where
  vf_clipfrac is the fraction of valid tokens where the clipped error is the larger one.
  """
  check_loss_agg(loss_agg)
  valid = mask > 0
  mask = mask.astype(jnp.float32)
  values = jnp.where(valid, values.astype(jnp.float32), 0.0)
  old_values = jnp.where(valid, old_values.astype(jnp.float32), 0.0)
  returns = jnp.where(valid, returns.astype(jnp.float32), 0.0)
  err_unclipped = jnp.square(values - returns)  # [batch, resp_len]
  if clip_eps is None:
    per_token = err_unclipped
    clipfrac = jnp.zeros((), jnp.float32)
  else:
    delta = values - old_values
    clipped_values = old_values + jnp.clip(delta, -clip_eps, clip_eps)
    err_clipped = jnp.square(clipped_values - returns)
    per_token = jnp.maximum(err_unclipped, err_clipped)
    # Counted only where the clip is active: inside the range V_old + (V - V_old) is V only up to
    # float rounding, and comparing the two errors alone counted that rounding as clipping.
    active = (jnp.abs(delta) > clip_eps) & (err_clipped > err_unclipped)
    clipfrac = masked.masked_mean(active.astype(jnp.float32), mask)
  loss = 0.5 * aggregate_loss(per_token, mask, loss_agg, **agg_kwargs)
  return loss, {"vf_loss": loss, "vf_clipfrac": clipfrac}


def kl_loss(logp: jax.Array, ref_logp: jax.Array, mask: jax.Array, kind: str = "k3",
            loss_agg: str = "token-mean", **agg_kwargs) -> jax.Array:
  """KL-to-reference as a loss term (GRPO style) instead of a reward penalty."""
  kl = kl_lib.kl_estimate(logp, ref_logp, kind, mask=mask)  # [batch, resp_len]
  return aggregate_loss(kl, mask, loss_agg, **agg_kwargs)
