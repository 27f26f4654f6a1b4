"""The jitted math of one PPO iteration: advantages over the rollout, and one optimizer update.

Inputs are device arrays, batch-major and sharded over the data axes (the stage outputs of
docs/architecture.md §1):

  tokens        [batch, prompt_bucket + max_new]  contiguous prompt+response (models/sequences.py)
  prompt_lens   [batch]
  mask          [batch, max_new]  1.0 on real response tokens (EOS included)
  old_logp      [batch, max_new]  behaviour log-probs recorded by generation (async PPO's
                                  decoupled objective: the proximal policy's, async_ppo.py)
  ref_logp      [batch, max_new]  reference-model log-probs (None when algo.kl_coef=0: nothing
                                  reads them, AlgoConfig.uses_reference)
  values        [batch, max_new]  critic values of the batch (zeros without a critic; async
                                  PPO: the current critic's, PPOTrainer._current_values)
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfuse_jax.models import llama
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.pipeline import stages
from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.rl import kl as kl_lib
from rlhfuse_jax.rl import masked, objective, optim
from rlhfuse_jax.rl.objective import LossConfig
from rlhfuse_jax.trainer.config import AlgoConfig


@flax.struct.dataclass
class ModelState:
  """Trainable model: params and optimizer state (the optimizer itself is static)."""
  params: Any
  opt_state: Any


def advantages_and_returns(algo: AlgoConfig, group_size: int, scores, mask, old_logp, ref_logp,
                           values):
  """Returns (advantages, returns, token_rewards, kl) each [batch, max_new] (float32); kl is
  zeros without reference log-probs (ref_logp None: algo.kl_coef=0, which weighs it by 0)."""
  if ref_logp is None:
    kl = jnp.zeros(mask.shape, jnp.float32)
  else:
    # mask= selects (jnp.where): a product would let a non-finite log-prob on padding through
    # as nan * 0 = nan, into the summed KL and every advantage of its group.
    kl = kl_lib.kl_estimate(old_logp, ref_logp, algo.kl_estimator, mask=mask)  # [batch, max_new]
  kl_coef = algo.kl_coef if algo.kl_in_reward else 0.0
  token_rewards = adv_lib.token_level_rewards(scores, kl, mask, kl_coef)
  if kl_coef > 0 and adv_lib.reads_scores(algo.estimator):
    # An estimator of sequence scores (the group estimators) takes one number per sample: with
    # the KL in the reward that is the sum of the token rewards, score and KL penalty (verl's
    # GRPO/RLOO on token_level_rewards). The bare scores would drop the KL, as the loss holds
    # none here either.
    scores = scores - kl_coef * jnp.sum(kl, axis=-1)
  adv, ret = adv_lib.compute_advantages(
      algo.estimator, scores=scores, token_rewards=token_rewards, values=values, mask=mask,
      gamma=algo.gamma, lam=algo.lam, group_size=group_size)
  if algo.whiten_advantages and adv_lib.needs_critic(algo.estimator):  # a critic's baseline
    adv = masked.masked_whiten(adv, mask)
  return adv * mask, ret * mask, token_rewards, kl


def loss_config(algo: AlgoConfig, temperature: float) -> LossConfig:
  """The PPO objective's settings from the run's AlgoConfig, for the plain and the pipelined
  update alike (the KL is a loss term only when it is not in the reward)."""
  return LossConfig(clip_eps=algo.clip_eps, clip_eps_high=algo.clip_eps_high or None,
                    clip_ratio_c=algo.clip_ratio_c or None, loss_agg=algo.loss_agg,
                    entropy_coef=algo.entropy_coef,
                    kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef,
                    kl_estimator=algo.kl_estimator, value_clip_eps=algo.value_clip_eps or None,
                    vf_coef=algo.vf_coef, temperature=temperature)


def actor_metrics(loss_cfg: LossConfig, m) -> dict:
  """The actor's metrics as the run logs them: every key of objective.ACTOR_METRICS but the
  total loss (kl_loss only when the KL is a loss term), so a metric added to the objective is
  logged by every update path."""
  return {f"actor/{k}": m[k] for k in objective.ACTOR_METRICS
          if k != "actor_loss" and (k != "kl_loss" or loss_cfg.kl_coef > 0)}


def critic_metrics(m) -> dict:
  """The critic's metrics as the run logs them: objective.CRITIC_METRICS but the total loss."""
  return {f"critic/{k}": m[k] for k in objective.CRITIC_METRICS if k != "critic_loss"}


grad_norm = optim.global_norm  # the gradients' global norm, summed in float32


class StatePreservingJit:
  """jax.jit of update(actor, critic, mb) -> (actor, critic, metrics), built at the first call
  (or lower) with the states' shardings, when they are known: `make(shardings)` returns the
  update (shardings: the (actor, critic) states' tree of shardings, None where a leaf has none;
  the pipelined update constrains its gradients to them, the plain one its accumulated sums),
  and out_shardings = those shardings, so the states come back placed exactly as they went in.
  Left to itself XLA names a trivially sharded output freely (P('tensor', 'fsdp') for
  P('fsdp', 'tensor') when those axes have size 1), and the next call, on those outputs,
  misses the compile cache and compiles the update a second time. States placed otherwise get
  their own jitted update (one per placement: the plain update is shared by every trainer of
  the same models and optimizer in a process, see trainer/update.py)."""

  def __init__(self, make: Callable[[Any], Callable], **jit_kwargs):
    self._make, self._jit_kwargs = make, jit_kwargs
    self._jitted: dict = {}  # the states' (tree structure, shardings) -> jitted update

  def jitted(self, actor, critic) -> Callable:
    shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), (actor, critic))
    leaves, treedef = jax.tree.flatten(shardings, is_leaf=lambda x: x is None)
    key = (treedef, tuple(leaves))
    if key not in self._jitted:
      kwargs = dict(self._jit_kwargs)
      # The arrays' own shardings: a state that is None (no critic: grpo, rloo, ...) has no
      # arrays, and its None in `leaves` left out_shardings unset, so the actor came back
      # renamed and the second mini-batch compiled the update again.
      placed = [getattr(x, "sharding", None) for x in jax.tree.leaves((actor, critic))]
      if placed and all(isinstance(x, jax.sharding.Sharding) for x in placed):
        first = placed[0]
        # Metrics are scalars: replicated over the states' mesh (or on their one device).
        metrics = (jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
                   if isinstance(first, jax.sharding.NamedSharding) else first)
        kwargs["out_shardings"] = (*shardings, metrics)
      # else: host (numpy) states, nothing to preserve.
      self._jitted[key] = jax.jit(self._make(shardings), **kwargs)
    return self._jitted[key]

  def __call__(self, actor, critic, mb):
    return self.jitted(actor, critic)(actor, critic, mb)

  def lower(self, actor, critic, mb):
    """Lowered for states and batch given as arrays or placed jax.ShapeDtypeStructs."""
    return self.jitted(actor, critic).lower(actor, critic, mb)


def micro_batches(mb: dict, shards: int, count: int, mesh: Optional[Mesh] = None) -> dict:
  """Each [B, ...] field of a mini-batch as [count, B / count, ...]: micro-batch j takes rows
  [j*r, (j+1)*r) of every batch shard's block of B / shards rows (r = B / (shards * count)), so
  each row stays on the devices it was on (no data moves; the constraint says so to GSPMD)."""
  def split(x):
    b = x.shape[0]
    r = b // (shards * count)
    y = x.reshape(shards, count, r, *x.shape[1:]).swapaxes(0, 1)
    y = y.reshape(count, shards * r, *x.shape[1:])  # [count, B / count, ...]
    if mesh is None:
      return y
    return jax.lax.with_sharding_constraint(
        y, NamedSharding(mesh, PartitionSpec(None, mesh_lib.BATCH_AXES)))
  return jax.tree.map(split, mb)


def microbatch_count(algo: AlgoConfig, rows: int, shards: int) -> int:
  """Micro-batches of the plain update's gradient accumulation for a mini-batch of `rows` rows
  over `shards` batch shards: 1 when algo.microbatch_size is 0 (the whole shard at once)."""
  per_shard = rows // shards
  if algo.microbatch_size == 0 or algo.microbatch_size >= per_shard:
    return 1
  if per_shard % algo.microbatch_size:
    raise ValueError(f"config.algo.microbatch_size={algo.microbatch_size} must divide the "
                     f"mini-batch rows per data shard (algo.minibatch_size={rows} / mesh "
                     f"data*fsdp={shards} = {per_shard})")
  return per_shard // algo.microbatch_size


def _accumulated(loss_fn: Callable, cfg: ModelConfig, loss_cfg: LossConfig, params: Any,
                 sharding: Any, mb: dict, count: int, shards: int, mesh: Optional[Mesh]):
  """(metrics, grads) of loss_fn over the mini-batch, `count` micro-batches at a time in a scan:
  each micro-batch's loss is its share under the mini-batch's normalisers (rl/objective.py), so
  the summed gradients and metrics are the mini-batch's; the activations live for one
  micro-batch. Gradients add up in float32 (placed as the parameters) and come back in the
  parameters' dtypes."""
  num_tokens, num_seqs = stages.normalisers(mb)
  grad_fn = jax.value_and_grad(loss_fn, argnums=2, has_aux=True)

  def constrain(tree):
    if sharding is None:
      return tree
    return jax.tree.map(lambda x, s: x if s is None else jax.lax.with_sharding_constraint(x, s),
                        tree, sharding)

  def body(carry, micro):
    grads, metrics = carry
    (_, m), g = grad_fn(cfg, loss_cfg, params, micro, num_tokens, num_seqs)
    grads = constrain(jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g))
    return (grads, jax.tree.map(jnp.add, metrics, m)), None

  micro = micro_batches(mb, shards, count, mesh)
  first = jax.tree.map(lambda x: x[0], micro)
  metric_shapes = jax.eval_shape(lambda p, b: grad_fn(cfg, loss_cfg, p, b, num_tokens,
                                                      num_seqs)[0][1], params, first)
  zeros = (constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)),
           jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes))
  (grads, metrics), _ = jax.lax.scan(body, zeros, micro)
  return metrics, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def _accumulated_once(loss_fn: Callable, cfg: ModelConfig, loss_cfg: LossConfig, params: Any,
                      sharding: Any, mb: dict, count: int, shards: int, mesh: Mesh):
  """`_accumulated` with algo.gradient_sync="once": the parameters gathered over fsdp once (kept
  split over tensor), each data shard's gradients summed over its micro-batches in float32
  where they were computed (jax.vmap over the shards with the batch axes as its SPMD axes: the
  weights' gathers and the gradients' reductions leave the loop; the tensor-parallel
  collectives and, as GSPMD partitions it, the embedding lookup's stay), and the per-shard
  sums reduced to the parameters' placement once. The same sums as `_accumulated` in another
  order."""
  num_tokens, num_seqs = stages.normalisers(mb)
  axes = mesh_lib.BATCH_AXES
  gathered = jax.tree.map(lambda s: _without_axes(s, axes), sharding)
  params = jax.tree.map(jax.lax.with_sharding_constraint, params, gathered)
  # [S, ...]: one float32 sum per data shard, on that shard's devices.
  sums_sh = jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(axes, *s.spec)), gathered)

  def shard_rows(x):  # [B/count, ...] -> [S, rows per shard, ...], rows staying in place
    y = x.reshape(shards, x.shape[0] // shards, *x.shape[1:])
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, PartitionSpec(axes)))
  micro = jax.tree.map(jax.vmap(shard_rows), micro_batches(mb, shards, count, mesh))

  def one_shard(p, rows):
    with llama.no_activation_constraints():
      (_, m), g = jax.value_and_grad(loss_fn, argnums=2, has_aux=True)(
          cfg, loss_cfg, p, rows, num_tokens, num_seqs)
    return m, g
  per_shard = jax.vmap(one_shard, in_axes=(None, 0), spmd_axis_name=axes)

  def body(carry, rows):
    sums, metrics = carry
    m, g = per_shard(params, rows)
    sums = jax.tree.map(lambda a, b, s: jax.lax.with_sharding_constraint(
        a + b.astype(jnp.float32), s), sums, g, sums_sh)
    return (sums, jax.tree.map(lambda a, b: a + jnp.sum(b, 0), metrics, m)), None

  first = jax.tree.map(lambda x: x[0], micro)
  metric_shapes = jax.eval_shape(lambda p, r: per_shard(p, r)[0], params, first)
  zeros = (jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(
      jnp.zeros((shards, *p.shape), jnp.float32), s), params, sums_sh),
           jax.tree.map(lambda s: jnp.zeros(s.shape[1:], s.dtype), metric_shapes))
  (sums, metrics), _ = jax.lax.scan(body, zeros, micro)
  grads = jax.tree.map(lambda a, p, s: jax.lax.with_sharding_constraint(
      jnp.sum(a, 0), s).astype(p.dtype), sums, params, sharding)
  return metrics, grads


def _without_axes(sharding: NamedSharding, axes: tuple[str, ...]) -> NamedSharding:
  """`sharding` with the mesh axes `axes` taken out of its spec (those dims whole there)."""
  def keep(entry):
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      return entry
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    left = tuple(a for a in names if a not in axes)
    return None if not left else left[0] if len(left) == 1 else left
  return NamedSharding(sharding.mesh, PartitionSpec(*(keep(e) for e in sharding.spec)))


def make_update_fn(actor_cfg: ModelConfig, critic_cfg: ModelConfig, algo: AlgoConfig,
                   temperature: float, actor_tx: optax.GradientTransformation,
                   critic_tx: optax.GradientTransformation | None, mesh: Optional[Mesh] = None):
  """Returns update(actor, critic, mb) -> (actor, critic, metrics), one optimizer step each.

  The actor and critic states are donated: their buffers are reused for the new state, so an
  update holds one copy of params and optimizer state, not two; the new states keep the old
  ones' placement (StatePreservingJit). With the `mesh` the states and mini-batch live on, the
  models keep every activation split over the batch axes (llama.shard_activations): each device
  computes its own rows only, none repeated over fsdp.

  algo.microbatch_size > 0 accumulates the gradients over micro-batches of that many rows per
  data shard (`_accumulated`): the same update up to float rounding, with one micro-batch's
  activations in memory instead of the whole mini-batch's (docs/usage.md "Memory at scale");
  algo.gradient_sync="once" gathers the weights and reduces the gradients once per step instead
  of once per micro-batch (`_accumulated_once`; docs/usage.md "Communication at scale").
  """
  loss_cfg = loss_config(algo, temperature)
  shards = 1 if mesh is None else mesh_lib.batch_size_multiple(mesh)

  def make(shardings):
    actor_sh, critic_sh = shardings if shardings is not None else (None, None)

    def update(actor: ModelState, critic: ModelState | None, mb):
      # Active while jit traces the losses and their gradients (a no-op without a mesh).
      with llama.shard_activations(mesh, mesh_lib.LOGICAL_RULES):
        return _update(actor, critic, mb)

    def value_and_grads(loss_fn, cfg, params, sharding, mb):
      count = microbatch_count(algo, mb["mask"].shape[0], shards)
      param_sh = _param_shardings(sharding)
      if count == 1:
        (_, m), g = jax.value_and_grad(loss_fn, argnums=2, has_aux=True)(cfg, loss_cfg, params,
                                                                          mb)
        # Reduced to the parameters' placement in their dtype: with the optimizer state split
        # further (optim.zero1) XLA otherwise reduced them in the optimizer's float32, over
        # other groups (plan_check, 7B on 32 devices: 0.81 -> 2.66 s of collectives).
        if param_sh is not None:
          g = jax.tree.map(jax.lax.with_sharding_constraint, g, param_sh)
        return m, g
      if algo.gradient_sync == "once" and mesh is not None and param_sh is not None:
        return _accumulated_once(loss_fn, cfg, loss_cfg, params, param_sh, mb, count, shards,
                                 mesh)
      return _accumulated(loss_fn, cfg, loss_cfg, params, param_sh, mb, count, shards, mesh)

    def _update(actor: ModelState, critic: ModelState | None, mb):
      am, ag = value_and_grads(stages.actor_loss, actor_cfg, actor.params, actor_sh, mb)
      updates, opt = actor_tx.update(ag, actor.opt_state, actor.params)
      actor = ModelState(optax.apply_updates(actor.params, updates), opt)
      metrics = actor_metrics(loss_cfg, am)
      metrics["actor/grad_norm"] = grad_norm(ag)
      if critic is not None:
        cm, cg = value_and_grads(stages.critic_loss, critic_cfg, critic.params, critic_sh, mb)
        updates, copt = critic_tx.update(cg, critic.opt_state, critic.params)
        critic = ModelState(optax.apply_updates(critic.params, updates), copt)
        metrics.update(critic_metrics(cm))
        metrics["critic/grad_norm"] = grad_norm(cg)
      return actor, critic, metrics

    return update

  return StatePreservingJit(make, donate_argnums=(0, 1))


def _param_shardings(state_sharding: Any) -> Any:
  """The params' NamedShardings from a ModelState's tree of shardings (None: unknown)."""
  if state_sharding is None:
    return None
  params = state_sharding.params
  leaves = jax.tree.leaves(params, is_leaf=lambda x: x is None)
  if not leaves or not all(isinstance(s, NamedSharding) for s in leaves):
    return None
  return params


@functools.partial(jax.jit, static_argnames=("algo", "group_size"))
def rollout_statistics(algo: AlgoConfig, group_size: int, scores, mask, old_logp, ref_logp,
                       values):
  """Advantages/returns for the whole rollout plus the iteration's reward/KL metrics.

  kl/ref_* estimate KL(behaviour policy || reference) with k3 whatever algo.kl_estimator is
  (unbiased and >= 0; k1 is unbiased but a batch's mean can be negative, k2 and abs are not
  estimates of the KL), so runs that differ in the estimator log the same quantity; the
  configured estimator's own token mean of the behaviour log-probs, which the reward's penalty
  weighs (the KL loss takes the current ones), is kl/penalty_token_mean when it is not k3 and
  kl_coef > 0. Without reference log-probs (ref_logp None: kl_coef=0, the reference not run)
  no kl/* metric is logged."""
  adv, ret, token_rewards, kl = advantages_and_returns(algo, group_size, scores, mask, old_logp,
                                                       ref_logp, values)
  metrics = {}
  if ref_logp is not None:
    kl3 = (kl if algo.kl_estimator == "k3" else
           kl_lib.kl_estimate(old_logp, ref_logp, "k3", mask=mask))
    metrics["kl/ref_mean"] = jnp.mean(jnp.sum(kl3, axis=1))
    metrics["kl/ref_token_mean"] = masked.masked_mean(kl3, mask)
  metrics.update({
      "reward/token_reward_mean": jnp.mean(jnp.sum(token_rewards, axis=1)),
      "advantages/mean": masked.masked_mean(adv, mask),
      "returns/mean": masked.masked_mean(ret, mask),
      "critic/vf_explained_var": masked.explained_variance(values, ret, mask),
      "critic/values_mean": masked.masked_mean(values, mask),
  })
  if algo.kl_estimator != "k3" and algo.kl_coef > 0:
    metrics["kl/penalty_token_mean"] = masked.masked_mean(kl, mask)
  if group_size > 1:
    # The share of prompts whose n samples' rewards all tie: no reward signal (the group
    # estimators give them advantages of 0 with the KL as a loss term, reinforce_baseline one
    # value shifted by its batch whitening; their tokens still count in a token-mean), what
    # DAPO's dynamic sampling would replace (not implemented here).
    grouped = scores.reshape(-1, group_size)
    metrics["reward/tied_group_frac"] = jnp.mean(
        jnp.all(grouped == grouped[:, :1], axis=-1).astype(jnp.float32))
  return adv, ret, metrics
