"""The PPO/GRPO training loop: serial stages generation, inference, training
(docs/architecture.md §1).

Plain Python around jitted steps. Every source of randomness is derived from (seed, iteration):
generation keys, mini-batch shuffles; the prompt stream's position is checkpointed. A run stopped
and resumed therefore produces the same parameters and metrics as one that never stopped.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from rlhfuse_jax import checkpointing
from rlhfuse_jax import metrics as metrics_lib
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.data import prompts as prompts_lib
from rlhfuse_jax.data import tasks as tasks_lib
from rlhfuse_jax.data.tokenizer import HFTokenizer, Tokenizer
from rlhfuse_jax.generation import engine
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.inference import scoring
from rlhfuse_jax.models import hf_loader, llama, sequences
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.perf import accounting
from rlhfuse_jax.pipeline import stages as stages_lib
from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.rl import minibatch as mb_lib
from rlhfuse_jax.rl import optim
from rlhfuse_jax.sim import hardware
from rlhfuse_jax.trainer import fused_stage, pipelined, ppo
from rlhfuse_jax.trainer import config as config_lib
from rlhfuse_jax.trainer.config import TrainConfig

# Metrics that measure time; everything else is a deterministic function of (config, seed).
TIMING_PREFIXES = ("timing_s/", "perf/")
# Exit status of train_ppo after a SIGTERM/SIGINT stop that saved a checkpoint (EX_TEMPFAIL):
# a scheduler can tell "preempted, re-run to resume" from completion (0) and failure (1).
EXIT_STOPPED_BY_SIGNAL = 75


def _finite_mean(values) -> float:
  v = np.asarray(values, np.float64)
  v = v[np.isfinite(v)]
  return float(v.mean()) if v.size else float("nan")


class NonFiniteError(FloatingPointError):
  """A loss, gradient norm, metric or parameter of an iteration was NaN or Inf (config.guard)."""


def _all_finite(tree) -> jax.Array:
  """One on-device bool: every element of every leaf is finite."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


_all_finite_jit = jax.jit(_all_finite)


@dataclasses.dataclass
class StageOutputs:
  """What generation + inference hand to training (host numpy arrays)."""
  rollout: engine.Rollout
  batch: scoring.ScoringBatch  # tokens [B, P+T] etc.
  ref_logp: np.ndarray  # [B, T] reference log-probs
  values: np.ndarray  # [B, T] critic values (zeros without a critic)
  scores: np.ndarray  # [B] sequence rewards
  metrics: dict  # timings (timing_s/generate, timing_s/inference) and stage-specific metrics


def _update_kind(update) -> str:
  name = getattr(update, "schedule_name", None)
  return {pipelined.FUSED: "fused pipelined training (searched actor/critic schedule)",
          pipelined.SERIAL: "pipelined training (serial 1F1B)"}.get(name, "training")


class _StopFlag:
  """Set by SIGTERM/SIGINT; the loop checks it after each iteration, saves and exits cleanly.
  A second SIGINT (Ctrl-C twice) interrupts at once, without saving."""

  def __init__(self):
    self.set = False
    self.signal: Optional[int] = None
    self._old = {}

  def install(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._old[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    if self.set and signum == signal.SIGINT:
      raise KeyboardInterrupt
    logging.warning("signal %d: finishing this iteration, saving a checkpoint, then exiting "
                    "(Ctrl-C again: stop now without saving)", signum)
    self.set, self.signal = True, signum

  def uninstall(self):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def build_task_and_tokenizer(cfg: TrainConfig):
  d = cfg.data
  task = tasks_lib.make_task(d.task, length_dist=d.length_dist, length_min=d.length_min,
                             length_max=d.length_max, length_mu=d.length_mu,
                             length_sigma=d.length_sigma)
  tokenizer: Tokenizer = task.tokenizer
  if cfg.init.tokenizer:
    tokenizer = HFTokenizer.from_file(cfg.init.tokenizer)
  return task, tokenizer


def load_prompt_records(cfg: TrainConfig, task) -> list[dict]:
  if cfg.data.prompts_file:
    return prompts_lib.load_jsonl_prompts(cfg.data.prompts_file)
  return task.make_prompts(cfg.data.num_prompts, np.random.default_rng([cfg.seed, 17]))


class PPOTrainer:
  """Owns the models, optimizers, data stream and checkpoints of one run in `workdir`."""

  def __init__(self, cfg: TrainConfig, workdir: str, mesh: Optional[jax.sharding.Mesh] = None):
    self.workdir = workdir
    os.makedirs(workdir, exist_ok=True)
    # One run per workdir (process 0 holds it for all processes of a multi-host run), from
    # here until run() ends, or until this constructor fails.
    self._lock = wd.WorkdirLock(workdir) if jax.process_index() == 0 else None
    try:
      self._setup(cfg, mesh)
    except BaseException:
      if self._lock is not None:
        self._lock.release()
      raise

  def _setup(self, cfg: TrainConfig, mesh: Optional[jax.sharding.Mesh]) -> None:
    workdir = self.workdir
    self.checkpointer = checkpointing.Checkpointer(workdir, keep=cfg.checkpoint.keep)
    self.stopped_by_signal: Optional[int] = None  # the signal that stopped run(), if any
    self.writer = None
    self._set_aside: list[int] = []  # checkpoints set aside as damaged in this start
    # What to resume, checked before anything is built or compiled: the newest readable
    # checkpoint's side-car, its seed and its config fingerprint against this config.
    self._fingerprint = cfg.fingerprint()
    self.resume_step, meta = self._resume_point(cfg)
    # The LR schedule's horizon is fixed by the first start and kept in the checkpoints.
    self.schedule_iterations = (cfg.optim.schedule_iterations or (meta or {}).get(
        "schedule_iterations") or cfg.num_iterations)
    # A finished run (the same command again) builds nothing: no model, no mesh, no compile
    # (a fused run compiles for a minute); run() then says "nothing to do" at once.
    self.finished_at = (self.resume_step if self.resume_step is not None and
                        self.resume_step >= cfg.num_iterations else None)
    if self.finished_at is not None:
      self.cfg = cfg
      return
    self.task, self.tokenizer = build_task_and_tokenizer(cfg)
    cfg = cfg.with_vocab(self.tokenizer.vocab_size)
    self.cfg = cfg
    self.mesh = mesh if mesh is not None else mesh_lib.make_mesh(cfg.mesh)
    self._check_batch_fits_mesh()
    self.use_critic = adv_lib.needs_critic(cfg.algo.estimator)
    t0 = time.time()
    logging.info("setup: task %r, mesh %s; initialising the models and the update ...",
                 cfg.data.task, dict(self.mesh.shape))
    self.dataset = prompts_lib.PromptDataset(
        load_prompt_records(cfg, self.task), self.tokenizer,
        batch_size=cfg.rollout.prompts_per_iteration, max_prompt_len=cfg.data.max_prompt_len,
        seed=cfg.seed, padding="right")
    self.reward_fn = None if cfg.reward.kind == "model" else (
        (lambda recs, ids, lens, tok: self.task.batch_rewards(recs, ids, lens))
        if cfg.reward.function == "task" else tasks_lib.get_reward_function(cfg.reward.function))
    self._init_models()
    logging.info("setup: models and update ready in %.1fs", time.time() - t0)
    self.sampling = SamplingConfig(
        temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens, eos_id=self.tokenizer.eos_id,
        pad_id=self.tokenizer.pad_id, chunk_size=cfg.rollout.chunk_size)
    self.scorer = scoring.Scorer(self.mesh)
    # Inter-stage fusion (docs/architecture.md §2): generation instances + streaming inference
    # replace the serial generator and scorer calls of generate_and_infer; same outputs, overlapped.
    self.fused = fused_stage.FusedStage(self) if cfg.fusion.inter_stage else None
    self.generator = None if self.fused else engine.Generator(
        cfg.model, self.sampling, batch_size=cfg.rollout.batch_size,
        prompt_len=cfg.data.max_prompt_len, mesh=self.mesh, params=self.model_shapes("actor"))
    self._compiled_update = False  # the first update call (compiles) is timed and logged

  # ---------------------------------------------------------------- setup
  def _check_batch_fits_mesh(self):
    cfg, mult = self.cfg, mesh_lib.batch_size_multiple(self.mesh)
    for name, value in (("rollout.prompts_per_iteration*samples_per_prompt",
                         cfg.rollout.batch_size), ("algo.minibatch_size", cfg.algo.minibatch_size)):
      if value % mult:
        raise ValueError(f"config.{name}={value} must be a multiple of the data-parallel size "
                         f"{mult} (mesh data*fsdp = {dict(self.mesh.shape)})")

  def _init_models(self):
    cfg = self.cfg
    key = jax.random.key(cfg.seed)
    if cfg.init.actor_checkpoint:
      actor_cfg = hf_loader.load_hf_config(cfg.init.actor_checkpoint)
      actor_params = hf_loader.load_hf_params(cfg.init.actor_checkpoint, actor_cfg)
      self.cfg = cfg = dataclasses.replace(cfg, model=actor_cfg)
    else:
      actor_params, _ = llama.init_params(cfg.model, jax.random.fold_in(key, 1))
    actor_specs = llama.logical_specs(cfg.model)
    actor_params = mesh_lib.shard_params(actor_params, actor_specs, self.mesh)
    # Where generation and inference take whole models (the trainer's own layout when unpipelined).
    self._whole = {"actor": mesh_lib.abstract(actor_params)}
    # The reference is the frozen initial actor: a copy, since the actor's buffers are donated.
    self.ref_params = jax.tree_util.tree_map(jnp.copy, actor_params)
    updates_per_iter = cfg.algo.epochs * (cfg.rollout.batch_size // cfg.algo.minibatch_size)
    total = self.schedule_iterations * updates_per_iter
    warmup = min(cfg.optim.warmup_steps, total - 1)
    # docs/architecture.md §3: with a pipeline axis both models train through the pipeline and are
    # held stage-stacked (pipelined.PipelinedUpdate.to_staged), each stage device its own layers.
    self.pipelined = self.mesh.shape["stage"] > 1
    decay_mask = ({"weight_decay_mask": stages_lib.staged_decay_mask} if self.pipelined else {})
    self.actor_tx, self.actor_lr = optim.make_optimizer(
        cfg.optim.actor_lr, warmup, total, cfg.optim.min_lr_ratio, cfg.optim.weight_decay,
        cfg.optim.grad_clip, return_schedule=True, **decay_mask)
    critic_params, self.critic_tx = None, None
    guard = self._guard_tx
    self.actor_tx = guard(self.actor_tx)
    if self.use_critic:
      if cfg.init.critic_checkpoint:
        critic_cfg = hf_loader.load_hf_config(cfg.init.critic_checkpoint).replace(head="scalar")
        critic_params = hf_loader.load_hf_params(cfg.init.critic_checkpoint, critic_cfg,
                                                 head="scalar", rng=jax.random.fold_in(key, 2))
        self.cfg = cfg = dataclasses.replace(cfg, critic_model=critic_cfg)
      else:
        critic_params, _ = llama.init_params(cfg.critic_model, jax.random.fold_in(key, 2))
      critic_params = mesh_lib.shard_params(critic_params, llama.logical_specs(cfg.critic_model),
                                            self.mesh)
      self._whole["critic"] = mesh_lib.abstract(critic_params)
      self.critic_tx = guard(optim.make_optimizer(
          cfg.optim.critic_lr, warmup, total, cfg.optim.min_lr_ratio, cfg.optim.weight_decay,
          cfg.optim.grad_clip, **decay_mask))
    self.reward_params, self.reward_cfg = None, None
    if cfg.reward.kind == "model":
      self.reward_cfg = hf_loader.load_hf_config(cfg.reward.model_checkpoint).replace(
          head="scalar")
      params = hf_loader.load_hf_params(cfg.reward.model_checkpoint, self.reward_cfg,
                                        head="scalar", rng=jax.random.fold_in(key, 3))
      self.reward_params = mesh_lib.shard_params(params, llama.logical_specs(self.reward_cfg),
                                                 self.mesh)
    # Log-probs use the sampling temperature, as generation's behaviour log-probs do (rollouts
    # always sample: rollout.temperature > 0), so the first epoch's PPO ratio is exactly 1.
    update_args = (cfg.model, cfg.critic_model, cfg.algo, cfg.rollout.temperature,
                   self.actor_tx, self.critic_tx)
    if self.pipelined:
      self.update = pipelined.make_pipelined_update_fn(*update_args, mesh=self.mesh, config=cfg,
                                                       workdir=self.workdir)
      actor_params = self.update.to_staged("actor", actor_params)
      if critic_params is not None:
        critic_params = self.update.to_staged("critic", critic_params)
    else:
      self.update = ppo.make_update_fn(*update_args, mesh=self.mesh)
    self.actor = ppo.ModelState(actor_params, mesh_lib.commit_to_mesh(
        self.actor_tx.init(actor_params), self.mesh))
    self.critic = None
    if critic_params is not None:
      self.critic = ppo.ModelState(critic_params, mesh_lib.commit_to_mesh(
          self.critic_tx.init(critic_params), self.mesh))
    self._reshard = {"timing_s/reshard": 0.0, "perf/reshard_bytes": 0}

  def _guard_tx(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """guard.on_nonfinite="skip_update": an optimizer step with non-finite gradients leaves
    params and optimizer state as they were (optax.apply_if_finite); the count of such steps
    is in the state (guard/skipped_updates)."""
    g = self.cfg.guard
    if g.on_nonfinite != "skip_update":
      return tx
    return optax.apply_if_finite(tx, max_consecutive_errors=g.max_consecutive_skips)

  def model_shapes(self, model: str) -> Any:
    """ShapeDtypeStructs of model_params(model), placed: what compiling generation needs."""
    return self._whole[model]

  def model_params(self, model: str) -> Any:
    """The whole parameters of "actor" / "critic", placed as generation and inference take
    them. A pipelined run holds its models stage-stacked: this reshards them (gathers each
    stage's layers; docs/architecture.md §3), and the iteration's metrics report the time and
    the bytes the most loaded device receives (timing_s/reshard, perf/reshard_bytes)."""
    state = self.actor if model == "actor" else self.critic
    if not self.pipelined:
      return state.params
    shardings = jax.tree.map(lambda x: x.sharding, self._whole[model])
    convert = self.update.whole_fn(model, state.params, shardings)
    t0 = time.time()  # the transfer alone: the conversion was compiled ahead of time
    whole = convert(state.params)
    jax.block_until_ready(whole)
    self._reshard["timing_s/reshard"] += time.time() - t0
    self._reshard["perf/reshard_bytes"] += self.update.reshard_bytes(model, state.params, whole)
    return whole

  def _state(self) -> dict:
    state = {"actor": self.actor}
    if self.critic is not None:
      state["critic"] = self.critic
    return state

  def _resume_point(self, cfg: TrainConfig) -> tuple[Optional[int], Optional[dict]]:
    """(step, side-car) of the newest checkpoint whose side-car reads, or (None, None). An
    unreadable one is set aside with a warning (config.checkpoint.fallback) or is an error.
    The seed and the config fingerprint must match this run's: a resumed run computes what
    the uninterrupted one would have, or it does not start."""
    for step in self.checkpointer.all_steps():
      try:
        meta = self.checkpointer.restore_meta(step)
        if not isinstance(meta, dict) or "iteration" not in meta or "data" not in meta:
          raise ValueError(f"side-car has keys {sorted(meta) if isinstance(meta, dict) else meta}"
                           ", expected iteration, seed, data")
      except Exception as e:  # noqa: BLE001 any damage: orbax, JSON, missing files
        self._damaged(cfg, step, e)
        continue
      self._check_resume(meta, cfg)
      return step, meta
    return None, None

  def _damaged(self, cfg: TrainConfig, step: int, error: BaseException) -> None:
    """A checkpoint that cannot be read: set it aside and go on (fallback), or stop.

    At most one checkpoint is set aside per start, and only in a single-process run: a second
    unreadable one in a row points at something systematic (disk, memory, another version of
    the code), and in a multi-host run every process would have to agree on the move. A run
    whose only checkpoint was set aside stops once instead of silently starting over."""
    what = f"checkpoint {step} in {self.checkpointer.directory} cannot be read " \
           f"({type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]})"
    if isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in str(error):
      raise error  # out of memory is not damage
    if not cfg.checkpoint.fallback:
      raise ValueError(f"{what}; config.checkpoint.fallback=False, so the run stops (set it "
                       "True to resume from the newest intact checkpoint)") from error
    if jax.process_count() > 1:
      raise ValueError(f"{what}; a multi-process run does not fall back by itself: move that "
                       "checkpoint out of the checkpoints directory and re-run") from error
    if self._set_aside:
      raise ValueError(f"{what}; checkpoint {self._set_aside[0]} was already set aside in this "
                       "start, and two unreadable checkpoints in a row look systematic (disk, "
                       "memory, code version): stopping instead of going further back") from error
    moved = self.checkpointer.set_aside(step)
    self._set_aside.append(step)
    logging.warning("%s; moved it to %s (kept, not deleted) and trying the one before", what,
                    moved)
    if not self.checkpointer.all_steps():
      raise ValueError(f"{what}; it was the only checkpoint, now in {moved}: re-run to start "
                       "over from iteration 0, or put it back once repaired") from error

  def _check_resume(self, meta: dict, cfg: TrainConfig) -> None:
    if meta.get("seed") != cfg.seed:
      raise ValueError(f"config.seed={cfg.seed} differs from the checkpoint's seed "
                       f"{meta.get('seed')} in {self.checkpointer.directory}; use a new workdir")
    saved = meta.get("config")
    if saved is None:  # checkpoints written before fingerprints existed
      logging.warning("checkpoint %s has no config fingerprint: resuming unchecked",
                      meta.get("iteration"))
      return
    changes = config_lib.fingerprint_changes(saved, self._fingerprint)
    if changes:
      raise ValueError(
          f"this config differs from the one that wrote the checkpoints in "
          f"{self.checkpointer.directory} (iteration {meta.get('iteration')}) in fields that "
          f"change the run: " + "; ".join(changes) + ". Resume with the original values, or "
          f"start a new --workdir (fields a resume may change: "
          f"{', '.join(sorted(config_lib.RESUMABLE_FIELDS))})")

  def _restore(self) -> int:
    """Restores the newest intact checkpoint; returns the iteration to start at (0: none)."""
    while self.resume_step is not None:
      step = self.resume_step
      try:
        state, meta = self.checkpointer.restore(step, self._state())
        break
      except Exception as e:  # noqa: BLE001 orbax raises many types for damaged files
        try:
          mismatch = self.checkpointer.layout_mismatch(step, self._state())
        except Exception:  # noqa: BLE001 the metadata is damaged too
          mismatch = None
        if mismatch is not None:
          # Written for another layout (pipeline split, code version): not damage, so not
          # set aside; say what differs.
          raise self._layout_error(step, e, mismatch) from e
        self._damaged(self.cfg, step, e)
        self.resume_step, _ = self._resume_point(self.cfg)
    else:
      return 0
    self.actor = state["actor"]
    self.critic = state.get("critic")
    # The reference is not saved: it is the initial actor, rebuilt from the seed or checkpoint
    # in _init_models exactly as in the first run.
    self.dataset.load_state_dict(meta["data"])
    logging.info("resumed from checkpoint at iteration %d", step)
    return step

  def _layout_error(self, step: int, e: BaseException, mismatch: str) -> ValueError:
    layout = ("stage-stacked for mesh.stage=%d, pipeline.critic_pp=%d" % (
        self.mesh.shape["stage"], self.update.executor.program.problem.critic_pp)
              if self.pipelined else "whole models (mesh.stage=1)")
    return ValueError(
        f"checkpoint {step} in {self.checkpointer.directory} does not fit this run's state "
        f"({layout}; {mismatch}): a run resumes only with the pipeline layout that saved it "
        f"(mesh.stage, pipeline.critic_pp) and a code version with the same parameter tree. "
        f"Orbax says: {(str(e).splitlines() or [repr(e)])[0]}")

  def _save(self, iteration: int):
    meta = {"iteration": iteration, "seed": self.cfg.seed, "data": self.dataset.state_dict(),
            "config": self._fingerprint, "schedule_iterations": self.schedule_iterations}
    self.checkpointer.save(iteration, self._state(), meta)

  # ---------------------------------------------------------------- one iteration
  def _rollout_batch(self, iteration: int):
    cfg = self.cfg
    batch = self.dataset.next_batch()
    n = cfg.rollout.samples_per_prompt
    # Samples of one prompt are consecutive: GRPO/RLOO groups are rows [g*n, (g+1)*n).
    records = [r for r in batch.records for _ in range(n)]
    prompt_tokens = np.repeat(batch.tokens, n, axis=0)  # [B*n, P]
    prompt_lens = np.repeat(batch.lengths, n, axis=0)  # [B*n]
    uids = iteration * cfg.rollout.batch_size + np.arange(cfg.rollout.batch_size)
    return records, prompt_tokens, prompt_lens, uids

  def _scores(self, records, rollout, batch: scoring.ScoringBatch) -> np.ndarray:
    if self.reward_fn is not None:
      return np.asarray(self.reward_fn(records, rollout.response_tokens, rollout.response_lens,
                                       self.tokenizer), np.float32)
    return self.scorer.reward_scores(self.reward_cfg, self.reward_params, batch)

  def generate_and_infer(self, records, prompt_tokens, prompt_lens, uids, gen_key
                         ) -> "StageOutputs":
    """Stages 1-2 (docs/architecture.md §1): generation, then reference/critic/reward inference.

    This is the serial baseline. The inter-stage fusion replaces exactly this method: it must
    return the same StageOutputs (same tokens and scores) with generation and inference
    overlapped.
    """
    if self.fused is not None:
      return StageOutputs(**self.fused(records, prompt_tokens, prompt_lens, uids, gen_key))
    cfg = self.cfg
    t0 = time.time()
    rollout = self.generator.generate(self.model_params("actor"), prompt_tokens, prompt_lens,
                                      gen_key, uids=uids)
    t_gen = time.time() - t0
    t0 = time.time()
    batch = scoring.ScoringBatch.from_rollout(rollout, self.tokenizer.pad_id)
    ref_logp = self.scorer.ref_logprobs(cfg.model, self.ref_params, batch,
                                        self.sampling.logprob_temperature)
    values = (self.scorer.values(cfg.critic_model, self.model_params("critic"), batch)
              if self.use_critic else np.zeros(rollout.logprobs.shape, np.float32))
    scores = self._scores(records, rollout, batch)
    return StageOutputs(rollout=rollout, batch=batch, ref_logp=ref_logp, values=values,
                        scores=scores, metrics={"timing_s/generate": t_gen,
                                                "timing_s/inference": time.time() - t0})

  def iteration(self, iteration: int) -> dict:
    cfg = self.cfg
    t_step = time.time()
    self._reshard = {"timing_s/reshard": 0.0, "perf/reshard_bytes": 0}
    records, prompt_tokens, prompt_lens, uids = self._rollout_batch(iteration)
    gen_key = jax.random.fold_in(jax.random.key(cfg.seed), iteration)
    t0 = time.time()
    stage_out = self.generate_and_infer(records, prompt_tokens, prompt_lens, uids, gen_key)
    # The previous iteration's checkpoint was written while this one generated; a failed save
    # stops the run here, before training past what it can keep.
    self.checkpointer.wait()
    rollout, ref_logp, values = stage_out.rollout, stage_out.ref_logp, stage_out.values
    scores = stage_out.scores
    max_new = cfg.rollout.max_new_tokens
    mask = np.asarray(sequences.response_mask(rollout.response_lens, max_new))  # [B, T] float32
    tokens = stage_out.batch.tokens  # [B, P+T] contiguous prompt+response
    put = lambda x: mesh_lib.put(x, mesh_lib.batch_sharding(self.mesh, np.ndim(x)))
    adv, ret, stats = ppo.rollout_statistics(
        cfg.algo, cfg.rollout.samples_per_prompt, put(scores), put(mask),
        put(rollout.logprobs.astype(np.float32)), put(ref_logp), put(values))
    jax.block_until_ready(adv)
    t_gen_inf = time.time() - t0
    if not self._compiled_update:  # this process's first iteration compiles as it goes: say so
      logging.info("iteration %d: generation + inference took %.1fs (first call: compiles "
                   "included); compiling the %s update ...", iteration + 1, t_gen_inf,
                   _update_kind(self.update))

    t0 = time.time()
    data = {"tokens": tokens, "prompt_lens": prompt_lens, "mask": mask,
            "old_logp": rollout.logprobs.astype(np.float32), "ref_logp": ref_logp,
            "advantages": mesh_lib.to_host(adv), "returns": mesh_lib.to_host(ret),
            "old_values": values}
    token_counts = prompt_lens + rollout.response_lens
    shards = mesh_lib.batch_size_multiple(self.mesh) if cfg.algo.balance_tokens else 1
    train_metrics = []
    for epoch in range(cfg.algo.epochs):
      rng = np.random.default_rng([cfg.seed, iteration, epoch])
      for idx in mb_lib.minibatch_indices(len(uids), cfg.algo.minibatch_size, rng,
                                          token_counts=token_counts, num_data_shards=shards):
        mb = {k: put(v[idx]) for k, v in data.items()}
        self.actor, self.critic, m = self.update(self.actor, self.critic, mb)
        train_metrics.append(m)
        if not self._compiled_update:
          jax.block_until_ready(m)
          self._compiled_update = True
          logging.info("training: update compiled and run once in %.1fs", time.time() - t0)
    train_metrics = mesh_lib.to_host(train_metrics)
    t_train = time.time() - t0
    self._check_finite(iteration, train_metrics)

    # Means over the finite values: under guard.on_nonfinite="skip_update" a skipped step's
    # loss is NaN (None if every step of the iteration was skipped).
    out = {k: _finite_mean([m[k] for m in train_metrics]) for k in train_metrics[0]}
    out.update({k: float(v) for k, v in mesh_lib.to_host(stats).items()})
    out.update(getattr(self.update, "schedule_metrics", {}))  # pipelined: the schedule's figures
    if not self.use_critic:
      for k in list(out):
        if k.startswith("critic/"):
          del out[k]
    resp_lens = rollout.response_lens
    out.update({
        "reward/mean": float(np.mean(scores)),
        "reward/std": float(np.std(scores)),
        "response_length/mean": float(np.mean(resp_lens)),
        "response_length/max": int(np.max(resp_lens)),
        "response_length/clip_ratio": float(np.mean(resp_lens >= max_new)),
        # Per-sample lengths (JSONL only): the simulator's empirical length distribution.
        "gen/response_lengths": [int(x) for x in resp_lens],
        "actor/lr": float(self.actor_lr(len(train_metrics) * (iteration + 1) - 1)),
    })
    if self.cfg.guard.on_nonfinite == "skip_update":
      out["guard/skipped_updates"] = int(sum(
          int(mesh_lib.to_host(st.opt_state.total_notfinite)) for st in self._state().values()))
    if self.cfg.guard.on_nonfinite == "stop":
      bad = [k for k, v in out.items() if isinstance(v, float) and not np.isfinite(v)]
      if bad:
        raise self._nonfinite(iteration, f"metric(s) {', '.join(bad)} = "
                              f"{[out[k] for k in bad]}")
    t_total = time.time() - t_step
    n_tokens = int(np.sum(token_counts))
    out.update(stage_out.metrics)
    if self.pipelined:  # the stage-stacked weights gathered for generation and inference
      out.update(self._reshard)
    out.update({
        "timing_s/train": t_train, "timing_s/gen_plus_inf": t_gen_inf, "timing_s/step": t_total,
        "perf/tokens_per_s": n_tokens / t_total,
        **self._train_flops_metrics(t_train, tokens.shape[1] - max_new, max_new),
        "perf/response_tokens": int(np.sum(resp_lens)),
    })
    self.last_rollout = rollout
    return out

  def _check_finite(self, iteration: int, train_metrics: list[dict]) -> None:
    """config.guard: losses and gradient norms of every update ("stop" only: skipped steps are
    NaN by design under "skip_update"), then the parameters themselves (both modes), with one
    on-device reduction per model."""
    if self.cfg.guard.on_nonfinite == "stop":
      for i, m in enumerate(train_metrics):
        bad = {k: float(v) for k, v in m.items() if not np.all(np.isfinite(v))}
        if bad:
          raise self._nonfinite(iteration, f"update {i + 1}/{len(train_metrics)}: {bad}")
    for name, st in self._state().items():
      if not bool(_all_finite_jit(st.params)):
        raise self._nonfinite(iteration, f"{name} parameters hold NaN/Inf after its updates")

  def _nonfinite(self, iteration: int, what: str) -> NonFiniteError:
    last = self.checkpointer.latest_step()
    return NonFiniteError(
        f"iteration {iteration + 1}: non-finite values: {what}. Nothing of this iteration was "
        f"written or saved; the last checkpoint ({'none' if last is None else last}) is kept. "
        f"Lower optim.actor_lr / optim.critic_lr or optim.grad_clip, check the inputs, or set "
        f"guard.on_nonfinite='skip_update' to skip such optimizer steps")

  def _train_flops_metrics(self, t_train: float, prompt_len: int, max_new: int) -> dict:
    """Training FLOP/s (padded shapes, as executed) and MFU where the device's peak is known."""
    cfg = self.cfg
    flops = cfg.algo.epochs * accounting.ppo_update_flops(
        cfg.model, cfg.critic_model if self.use_critic else None, cfg.rollout.batch_size,
        prompt_len, max_new)
    out = {"perf/train_flops_per_s": flops / t_train}
    hw = hardware.hardware_for_device_kind(self.mesh.devices.flat[0].device_kind)
    if hw is not None:
      out["perf/mfu"] = flops / t_train / (hw.peak_flops * self.mesh.devices.size)
    return out

  # ---------------------------------------------------------------- the loop
  def run(self, stop_after: Optional[int] = None) -> list[dict]:
    """Runs (or resumes) to cfg.num_iterations; returns this call's per-iteration metrics.

    stop_after: stop early after this iteration as a SIGTERM would (save, return); used to test
    that an interrupted run resumes exactly.
    """
    cfg = self.cfg
    try:
      if self.finished_at is not None:
        logging.info("workdir already has %d iterations (num_iterations=%d): nothing to do",
                     self.finished_at, cfg.num_iterations)
        return []
      start = self._restore()
      if start >= cfg.num_iterations:
        logging.info("workdir already has %d iterations (num_iterations=%d): nothing to do",
                     start, cfg.num_iterations)
        return []
      # Exactly once: rows and TensorBoard events after the restored step belong to a
      # trajectory that was not kept (a crash after them, before their checkpoint).
      self.writer = metrics_lib.MetricWriter(self.workdir, enabled=jax.process_index() == 0,
                                             purge_step=start + 1)
      self.writer.truncate_after(start)
      return self._loop(start, stop_after)
    finally:
      if self._lock is not None:
        self._lock.release()

  def _loop(self, start: int, stop_after: Optional[int]) -> list[dict]:
    cfg = self.cfg
    stop = _StopFlag()
    stop.install()
    progress = metrics_lib.ProgressReporter(cfg.num_iterations, start)
    history = []
    try:
      for it in range(start, cfg.num_iterations):
        m = self.iteration(it)
        step = it + 1
        self.writer.write(step, m)
        history.append({"step": step, **m})
        if step % cfg.log_every == 0 or step == cfg.num_iterations:
          logging.info(progress.line(step, m, keys=("reward/mean", "kl/ref_mean",
                                                    "response_length/mean"),
                                     extra=fused_stage.progress_summary(m)))
        stopping = stop.set or step == stop_after
        if step % cfg.checkpoint.every == 0 or step == cfg.num_iterations or stopping:
          self._save(step)
        if stopping:
          # A signal during the last iteration stops nothing: the run is complete.
          self.stopped_by_signal = stop.signal if step < cfg.num_iterations else None
          logging.warning("stopped after iteration %d; re-run the same command to resume", step)
          break
    finally:
      stop.uninstall()
      self.writer.close()
      try:
        self.checkpointer.wait()
      except checkpointing.SaveError:
        if sys.exc_info()[0] is None:
          raise
        # Another error is already on its way out: report this one without hiding it.
        logging.exception("the last checkpoint save failed too")
    return history
