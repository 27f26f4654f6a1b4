"""Stage 3 of a PPO iteration behind one interface: the optimizer step of actor and critic, plain
(trainer/ppo.py) or through the pipeline executor (trainer/pipelined.py, mesh.stage > 1;
docs/architecture.md §3).

`make_update(cfg, mesh, ...)` builds the optimizers and returns an `Update`; the trainer never
asks which kind it got. An Update also owns the layout it trains a model in: `init_state` takes
whole parameters (as built or loaded) to that layout with a fresh optimizer state, and `whole`
gives generation and inference the whole parameters back (for a pipelined update a resharding
of the stage-stacked state, whose time and bytes `take_reshard_metrics` reports).
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional

import jax
import optax
from absl import logging

from rlhfuse_jax import metrics as metrics_lib
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.pipeline import stages as stages_lib
from rlhfuse_jax.rl import optim
from rlhfuse_jax.trainer import pipelined, ppo
from rlhfuse_jax.trainer.config import GuardConfig, OptimConfig, TrainConfig
from rlhfuse_jax.trainer.ppo import ModelState


def guard_tx(guard: GuardConfig, tx: optax.GradientTransformation
             ) -> optax.GradientTransformation:
  """guard.on_nonfinite="skip_update": an optimizer step with non-finite gradients leaves
  params and optimizer state as they were (optax.apply_if_finite); the count of such steps
  is in the state (guard/skipped_updates)."""
  if guard.on_nonfinite != "skip_update":
    return tx
  return optax.apply_if_finite(tx, max_consecutive_errors=guard.max_consecutive_skips)


def skipped_updates(state: ModelState) -> jax.Array:
  """Optimizer steps skipped so far (guard.on_nonfinite="skip_update" states only)."""
  opt = state.opt_state
  if isinstance(opt, optim.MasterState):  # the guard runs inside the float32 copy's step
    opt = opt.inner
  return opt.total_notfinite


def optimizer_state_shardings(tx: optax.GradientTransformation, params: Any,
                              mesh: jax.sharding.Mesh, zero1: bool = False) -> Any:
  """Shardings of `tx.init(params)` for placed `params` (arrays or ShapeDtypeStructs): leaves
  that mirror a parameter (moments, float32_master's copy) are placed like it, or with `zero1`
  split further over the axes it is replicated over (mesh.zero1_sharding); the rest (step
  counts) replicated on `mesh`."""
  place = mesh_lib.zero1_sharding if zero1 else (lambda sharding, shape: sharding)
  return optax.tree_map_params(
      tx, lambda s, p: place(p.sharding, s.shape), jax.eval_shape(tx.init, params), params,
      transform_non_params=lambda _: mesh_lib.replicated(mesh))


def init_optimizer_state(tx: optax.GradientTransformation, params: Any,
                         mesh: jax.sharding.Mesh, zero1: bool = False) -> Any:
  """`tx.init(params)` for placed `params`, built in place: each leaf straight on its devices
  as optimizer_state_shardings gives them (with `zero1` each device only its slice; step
  counts replicated on `mesh`, as the jitted update returns them, so its second call reuses the
  first's executable), and as fresh buffers (the update donates the state and the parameters
  separately: a float32 copy must not alias float32 weights)."""
  shardings = optimizer_state_shardings(tx, params, mesh, zero1)
  return jax.jit(tx.init, out_shardings=shardings)(params)


_NO_RESHARD = {"timing_s/reshard": 0.0, "perf/reshard_bytes": 0}


class Update:
  """update(actor, critic, mb) -> (actor, critic, metrics): one optimizer step of each model.

  `description` names it in logs; `schedule_metrics` (pipelined: the schedule's name, ticks,
  bubble) join each iteration's metrics; `actor_lr` and `critic_lr` (None without a critic)
  are the models' learning-rate schedules.
  """

  def __init__(self, fn: Callable, *, txs: dict, actor_lr: Callable,
               critic_lr: Optional[Callable] = None,
               pipelined_update: Optional[pipelined.PipelinedUpdate] = None,
               zero1: bool = False):
    self._fn, self._txs, self.actor_lr, self.critic_lr = fn, txs, actor_lr, critic_lr
    self._zero1 = zero1
    self._pipelined = pipelined_update
    self._whole_shapes: dict = {}  # model -> whole parameters' ShapeDtypeStructs, placed
    self._reshard = dict(_NO_RESHARD)
    names = {pipelined.FUSED: "fused pipelined training (searched actor/critic schedule)",
             pipelined.SERIAL: "pipelined training (serial 1F1B)"}
    self.schedule_name = getattr(pipelined_update, "schedule_name", None)
    self.description = names.get(self.schedule_name, "training")
    self.schedule_metrics = dict(getattr(pipelined_update, "schedule_metrics", {}))

  @property
  def executor(self):
    """The pipeline executor (pipelined updates only; tests and tools read its program)."""
    return self._pipelined.executor

  @property
  def is_pipelined(self) -> bool:
    return self._pipelined is not None

  def __call__(self, actor: ModelState, critic: Optional[ModelState], mb):
    return self._fn(actor, critic, mb)

  def lower(self, actor, critic, mb):
    """The jitted update lowered for states and batch (arrays or placed ShapeDtypeStructs)."""
    return self._fn.lower(actor, critic, mb)

  def init_state(self, model: str, params: Any, mesh: jax.sharding.Mesh) -> ModelState:
    """Whole, placed parameters of "actor" / "critic" -> the state this update trains (stage-
    stacked for a pipelined update), with a fresh optimizer state on the same devices."""
    self._whole_shapes[model] = mesh_lib.abstract(params)
    if self._pipelined is not None:
      params = self._pipelined.to_staged(model, params)
    return ModelState(params, init_optimizer_state(self._txs[model], params, mesh, self._zero1))

  def whole_shapes(self, model: str) -> Any:
    """ShapeDtypeStructs of `whole(model, ...)`, placed: what compiling generation needs."""
    return self._whole_shapes[model]

  def whole(self, model: str, state: ModelState, moving: bool = False) -> Any:
    """The whole parameters of "actor" / "critic", placed as generation and inference take
    them. A pipelined state is resharded (each stage's layers gathered; docs/architecture.md
    §3); the state's own arrays are left untouched.

    `moving`: for a caller that moves them on at once (onto generation instances, another
    device group, host memory): the layer stack of a scanned model then stays split over the
    stages, [L, ...] with each stage device holding its own stage's layers (a reshape, no
    gather), and the move reshards from there (mesh_lib.put). Gathered, the whole actor or
    critic (/ fsdp x tensor) sat on every training device beside the training state until the
    move was done: 13.5 GB per device for a 7B actor on 8 stages (configs/plan_check.py
    7b_host8)."""
    if self._pipelined is None:
      return state.params
    shapes = self._whole_shapes[model]
    shardings = (moving_shardings(shapes) if moving
                 else jax.tree.map(lambda x: x.sharding, shapes))
    convert = self._pipelined.whole_fn(model, state.params, shardings)
    t0 = time.time()  # the transfer alone: the conversion was compiled ahead of time
    whole = convert(state.params)
    jax.block_until_ready(whole)
    self._reshard["timing_s/reshard"] += time.time() - t0
    self._reshard["perf/reshard_bytes"] += self._pipelined.reshard_bytes(model, state.params,
                                                                         whole)
    return whole

  def take_reshard_metrics(self) -> dict:
    """Time and bytes (most loaded device) of the `whole` calls since the last take; empty for
    a plain update, which never reshards."""
    out, self._reshard = self._reshard, dict(_NO_RESHARD)
    return out if self._pipelined is not None else {}


def moving_shardings(whole: Any) -> Any:
  """Update.whole's shardings with `moving`, for `whole` (whole_shapes: placed structs): a
  scanned model's layer stacks split over `stage` (_split_over_stages), the rest as placed.
  experiments/plan_programs.py compiles the same hand-over from them."""
  shardings = jax.tree.map(lambda x: x.sharding, whole)
  if "block" in shardings.get("layers", {}):  # scan_layers: leaves [L, ...]
    shardings = {**shardings, "layers": {"block": jax.tree.map(
        _split_over_stages, whole["layers"]["block"])}}
  return shardings


def _split_over_stages(leaf: jax.ShapeDtypeStruct) -> jax.sharding.NamedSharding:
  """A whole layer stack's sharding (leaf [L, ...], placed) with its layer dimension split over
  `stage`: each stage device keeps the layers of stage-axis position s (the actor's: a
  reshape of what its state holds there, nothing moves; the critic's rows are stored in
  reverse, or over critic_pp < pp stages, so its layers move between the stage devices, 1/pp
  of them each, no gather). Left whole where the stages do not split L evenly (a critic whose
  layers pp does not divide)."""
  sharding, spec = leaf.sharding, tuple(leaf.sharding.spec)
  if (spec and spec[0] is not None) or leaf.shape[0] % sharding.mesh.shape["stage"]:
    return sharding
  return jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec("stage", *spec[1:]))


def make_update(cfg: TrainConfig, mesh: jax.sharding.Mesh, *, use_critic: bool,
                schedule_iterations: int, workdir: str = "") -> Update:
  """The optimizers (AdamW with warmup + cosine over `schedule_iterations` iterations' steps,
  config.guard's skipping) and the update they step: pipelined when mesh.stage > 1.

  `cfg` is the resolved config (trainer/build.py): its model sections are the models'."""
  updates_per_iter = cfg.algo.epochs * (cfg.rollout.batch_size // cfg.algo.minibatch_size)
  total = schedule_iterations * updates_per_iter
  warmup = min(cfg.optim.warmup_steps, total - 1)
  if cfg.optim.warmup_steps >= total:
    count = metrics_lib.count
    logging.warning("config.optim.warmup_steps=%d covers all %s of the schedule (%s x %s): the "
                    "learning rate rises until the last step and never decays; lower "
                    "optim.warmup_steps or raise optim.schedule_iterations",
                    cfg.optim.warmup_steps, count(total, "optimizer step"),
                    count(schedule_iterations, "iteration"), count(updates_per_iter, "update"))
  o = cfg.optim
  if mesh.shape["stage"] > 1:
    # A pipelined model is held stage-stacked: its weight-decay mask is that tree's.
    txs, lrs = _optimizers(o, cfg.guard, warmup, total, use_critic,
                           stages_lib.staged_decay_mask)
    inner = pipelined.make_pipelined_update_fn(*_update_args(cfg), txs["actor"],
                                               txs.get("critic"), mesh=mesh, config=cfg,
                                               workdir=workdir)
    return Update(inner, txs=txs, actor_lr=lrs["actor"], critic_lr=lrs.get("critic"),
                  pipelined_update=inner, zero1=o.zero1)
  fn, txs, lrs = _plain_update(*_update_args(cfg), o, cfg.guard, warmup, total, use_critic,
                               mesh)
  return Update(fn, txs=txs, actor_lr=lrs["actor"], critic_lr=lrs.get("critic"), zero1=o.zero1)


def _update_args(cfg: TrainConfig) -> tuple:
  # Log-probs use the sampling temperature, as generation's behaviour log-probs do (rollouts
  # always sample: rollout.temperature > 0), both over the whole vocabulary (before top-k /
  # top-p), so the first epoch's PPO ratio is 1 up to the rounding between generation's
  # program and the update's (~1e-6 in float32; in bfloat16 up to a few 1e-1 per token, so
  # there algo.old_logp recomputes them with the training forward: docs/architecture.md §1).
  return cfg.model, cfg.critic_model, cfg.algo, cfg.rollout.temperature


def _optimizers(o: OptimConfig, guard: GuardConfig, warmup: int, total: int, use_critic: bool,
                decay_mask: Any = None) -> tuple[dict, dict]:
  """({"actor": tx[, "critic": tx]}, the same models' learning-rate schedules)."""
  master = optim.float32_master if o.master_weights else (lambda tx: tx)
  mask = {} if decay_mask is None else {"weight_decay_mask": decay_mask}
  actor_tx, actor_lr = optim.make_optimizer(o.actor_lr, warmup, total, o.min_lr_ratio,
                                            o.weight_decay, o.grad_clip, return_schedule=True,
                                            **mask)
  # The guard inside the float32 copy's step: its skipped step returns float32 zeros, as the
  # copy's step does (outside, it returned zeros in the weights' 16-bit dtype: a jax.lax.cond
  # whose branches differ in type).
  txs, lrs = {"actor": master(guard_tx(guard, actor_tx))}, {"actor": actor_lr}
  if use_critic:
    critic_tx, lrs["critic"] = optim.make_optimizer(
        o.critic_lr, warmup, total, o.min_lr_ratio, o.weight_decay, o.grad_clip,
        return_schedule=True, **mask)
    txs["critic"] = master(guard_tx(guard, critic_tx))
  return txs, lrs


@functools.lru_cache(maxsize=16)
def _plain_update(actor_cfg, critic_cfg, algo, temperature: float, o: OptimConfig,
                  guard: GuardConfig, warmup: int, total: int, use_critic: bool,
                  mesh: jax.sharding.Mesh) -> tuple[ppo.StatePreservingJit, dict, dict]:
  """The plain update with its optimizers, one per models, algorithm, optimizer and mesh in a
  process, as generation's programs are (generation/instances.py): a second trainer of the
  same run (a resume, a test's reference run) neither traces nor lowers it again (~2 s of a
  tiny model's CPU each; the persistent compilation cache only spares the compile). Like any
  jitted function, it keeps what it traced: code patched later in the process is not seen."""
  txs, lrs = _optimizers(o, guard, warmup, total, use_critic)
  fn = ppo.make_update_fn(actor_cfg, critic_cfg, algo, temperature, txs["actor"],
                          txs.get("critic"), mesh=mesh)
  return fn, txs, lrs
