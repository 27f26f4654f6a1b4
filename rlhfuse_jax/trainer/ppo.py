"""The jitted math of one PPO iteration: advantages over the rollout, and one optimizer update.

Inputs are device arrays laid out per docs/architecture.md §1, batch-major and sharded over the data
axes:

  tokens        [batch, prompt_bucket + max_new]  contiguous prompt+response (models/sequences.py)
  prompt_lens   [batch]
  mask          [batch, max_new]  1.0 on real response tokens (EOS included)
  old_logp      [batch, max_new]  behaviour log-probs recorded by generation
  ref_logp      [batch, max_new]  reference-model log-probs
  values        [batch, max_new]  critic values at generation time (zeros without a critic)
  scores        [batch]           sequence rewards (verifier or reward model)

Sharded and single-device runs execute the same programs; only the placement differs.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from rlhfuse_jax.models import llama
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.pipeline import stages
from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.rl import kl as kl_lib
from rlhfuse_jax.rl import masked
from rlhfuse_jax.rl.objective import LossConfig
from rlhfuse_jax.trainer.config import AlgoConfig


@flax.struct.dataclass
class ModelState:
  """Trainable model: params and optimizer state (the optimizer itself is static)."""
  params: Any
  opt_state: Any


GROUP_ESTIMATORS = ("grpo", "rloo")  # advantages from one score per sample, compared in groups


def advantages_and_returns(algo: AlgoConfig, group_size: int, scores, mask, old_logp, ref_logp,
                           values):
  """Returns (advantages, returns, token_rewards, kl) each [batch, max_new] (float32)."""
  kl = kl_lib.kl_estimate(old_logp, ref_logp, algo.kl_estimator) * mask  # [batch, max_new]
  kl_coef = algo.kl_coef if algo.kl_in_reward else 0.0
  token_rewards = adv_lib.token_level_rewards(scores, kl, mask, kl_coef)
  if kl_coef > 0 and algo.estimator in GROUP_ESTIMATORS:
    # The group estimators compare one number per sample: with the KL in the reward that is the
    # sum of the token rewards, score and KL penalty (verl's GRPO/RLOO on token_level_rewards).
    # Comparing the bare scores would drop the KL, as the loss holds none here either.
    scores = scores - kl_coef * jnp.sum(kl, axis=-1)
  adv, ret = adv_lib.compute_advantages(
      algo.estimator, scores=scores, token_rewards=token_rewards, values=values, mask=mask,
      gamma=algo.gamma, lam=algo.lam, group_size=group_size)
  if algo.whiten_advantages and algo.estimator == "gae":
    adv = masked.masked_whiten(adv, mask)
  return adv * mask, ret * mask, token_rewards, kl


def loss_config(algo: AlgoConfig, temperature: float) -> LossConfig:
  """The PPO objective's settings from the run's AlgoConfig, for the plain and the pipelined
  update alike (the KL is a loss term only when it is not in the reward)."""
  return LossConfig(clip_eps=algo.clip_eps, loss_agg=algo.loss_agg,
                    entropy_coef=algo.entropy_coef,
                    kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef,
                    kl_estimator=algo.kl_estimator, value_clip_eps=algo.value_clip_eps or None,
                    vf_coef=algo.vf_coef, temperature=temperature)


def actor_metrics(loss_cfg: LossConfig, m) -> dict:
  """The actor's metrics as the run logs them (kl_loss only when the KL is a loss term)."""
  keys = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy") + (
      ("kl_loss",) if loss_cfg.kl_coef > 0 else ())
  return {f"actor/{k}": m[k] for k in keys}


class StatePreservingJit:
  """jax.jit of update(actor, critic, mb) -> (actor, critic, metrics), built at the first call
  (or lower), when the states' shardings are known: `make(shardings)` returns the update
  (shardings: the (actor, critic) states' tree of shardings, None where a leaf has none; the
  pipelined update constrains its gradients to them), and out_shardings = those shardings, so
  the states come back placed exactly as they went in. Left to itself XLA names a trivially
  sharded output freely (P('tensor', 'fsdp') for P('fsdp', 'tensor') when those axes have
  size 1), and the next call, on those outputs, misses the compile cache and compiles the
  update a second time."""

  def __init__(self, make: Callable[[Any], Callable], **jit_kwargs):
    self._make, self._jit_kwargs = make, jit_kwargs
    self._jitted: Optional[Callable] = None

  def jitted(self, actor, critic) -> Callable:
    if self._jitted is None:
      shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), (actor, critic))
      leaves = jax.tree.leaves((actor, critic))
      kwargs = dict(self._jit_kwargs)
      if all(isinstance(getattr(x, "sharding", None), jax.sharding.Sharding) for x in leaves):
        first = leaves[0].sharding
        # Metrics are scalars: replicated over the states' mesh (or on their one device).
        metrics = (jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
                   if isinstance(first, jax.sharding.NamedSharding) else first)
        kwargs["out_shardings"] = (*shardings, metrics)
      # else: host (numpy) states, nothing to preserve.
      self._jitted = jax.jit(self._make(shardings), **kwargs)
    return self._jitted

  def __call__(self, actor, critic, mb):
    return self.jitted(actor, critic)(actor, critic, mb)

  def lower(self, actor, critic, mb):
    """Lowered for states and batch given as arrays or placed jax.ShapeDtypeStructs."""
    return self.jitted(actor, critic).lower(actor, critic, mb)


def make_update_fn(actor_cfg: ModelConfig, critic_cfg: ModelConfig, algo: AlgoConfig,
                   temperature: float, actor_tx: optax.GradientTransformation,
                   critic_tx: optax.GradientTransformation | None, mesh: Optional[Mesh] = None):
  """Returns update(actor, critic, mb) -> (actor, critic, metrics), one optimizer step each.

  The actor and critic states are donated: their buffers are reused for the new state, so an
  update holds one copy of params and optimizer state, not two; the new states keep the old
  ones' placement (StatePreservingJit). With the `mesh` the states and mini-batch live on, the
  models keep every activation split over the batch axes (llama.shard_activations): each device
  computes its own rows only, none repeated over fsdp.
  """
  loss_cfg = loss_config(algo, temperature)

  def update(actor: ModelState, critic: ModelState | None, mb):
    # Active while jit traces the losses and their gradients (a no-op without a mesh).
    with llama.shard_activations(mesh, mesh_lib.LOGICAL_RULES):
      return _update(actor, critic, mb)

  def _update(actor: ModelState, critic: ModelState | None, mb):
    (_, am), ag = jax.value_and_grad(stages.actor_loss, argnums=2, has_aux=True)(
        actor_cfg, loss_cfg, actor.params, mb)
    updates, opt = actor_tx.update(ag, actor.opt_state, actor.params)
    actor = ModelState(optax.apply_updates(actor.params, updates), opt)
    metrics = actor_metrics(loss_cfg, am)
    metrics["actor/grad_norm"] = optax.global_norm(ag)
    if critic is not None:
      (_, cm), cg = jax.value_and_grad(stages.critic_loss, argnums=2, has_aux=True)(
          critic_cfg, loss_cfg, critic.params, mb)
      updates, copt = critic_tx.update(cg, critic.opt_state, critic.params)
      critic = ModelState(optax.apply_updates(critic.params, updates), copt)
      metrics.update({f"critic/{k}": cm[k] for k in ("vf_loss", "vf_clipfrac")})
      metrics["critic/grad_norm"] = optax.global_norm(cg)
    return actor, critic, metrics

  return StatePreservingJit(lambda shardings: update, donate_argnums=(0, 1))


@functools.partial(jax.jit, static_argnames=("algo", "group_size"))
def rollout_statistics(algo: AlgoConfig, group_size: int, scores, mask, old_logp, ref_logp,
                       values):
  """Advantages/returns for the whole rollout plus the iteration's reward/KL metrics."""
  adv, ret, token_rewards, kl = advantages_and_returns(algo, group_size, scores, mask, old_logp,
                                                       ref_logp, values)
  seq_kl = jnp.sum(kl, axis=1)  # [batch]
  metrics = {
      "kl/ref_mean": jnp.mean(seq_kl),
      "kl/ref_token_mean": masked.masked_mean(kl, mask),
      "reward/token_reward_mean": jnp.mean(jnp.sum(token_rewards, axis=1)),
      "advantages/mean": masked.masked_mean(adv, mask),
      "returns/mean": masked.masked_mean(ret, mask),
      "critic/vf_explained_var": masked.explained_variance(values, ret, mask),
      "critic/values_mean": masked.masked_mean(values, mask),
  }
  return adv, ret, metrics
