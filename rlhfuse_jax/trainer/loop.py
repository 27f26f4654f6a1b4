"""The PPO/GRPO training loop: serial stages generation, inference, training
(docs/architecture.md §1).

Plain Python around jitted steps, assembled from parts that each own one thing: the run's models
and config (trainer/build.py, checked by trainer/validate.py), stages 1-2 (a RolloutStage,
trainer/rollout.py), stage 3 (an Update, trainer/update.py), and the checkpoints, metrics log,
stop flag and HF export as hooks on run() (trainer/hooks.py, trainer/hf_export.py).

Every source of randomness is derived from (seed, iteration): generation keys, mini-batch
shuffles; the prompt stream's position is checkpointed. (The initial actor and critic come
from fold_in(key(seed), 1) and 2, which are also iterations 1's and 2's generation keys; each
is split differently below, and changing it would change every documented trajectory.) A run
stopped and resumed therefore produces the same parameters and metrics as one that never
stopped (with fusion.migration_threshold="auto", the fusion decision metrics aside:
docs/architecture.md §2, "Invariant").

With config.async_ppo.staleness k >= 1 an iteration trains on the batch generated k iterations
earlier while it generates the batch k iterations ahead, in one thread and in the schedule's
order (trainer/async_ppo.py; docs/architecture.md §4); the batches in flight are checkpointed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import Any, Callable, Collection, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rlhfuse_jax import checkpointing
from rlhfuse_jax import metrics as metrics_lib
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.data import rewards as rewards_lib
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.inference import scoring
from rlhfuse_jax.models import hf_config, sequences
from rlhfuse_jax.parallel import distributed
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.perf import accounting
from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.rl import minibatch as mb_lib
from rlhfuse_jax.sim import hardware
from rlhfuse_jax.models import llama
from rlhfuse_jax.trainer import async_ppo as async_lib
from rlhfuse_jax.trainer import build, evaluation, hf_export, hooks, ppo
from rlhfuse_jax.trainer import inputs as inputs_lib
from rlhfuse_jax.trainer import plan_file as plan_file_lib
from rlhfuse_jax.trainer import rollout as rollout_lib
from rlhfuse_jax.trainer import update as update_lib
from rlhfuse_jax.trainer.config import TrainConfig
from rlhfuse_jax.trainer.validate import validate

# Metrics that measure time. Everything else is a deterministic function of (config, seed),
# except the fused rollout's own wall-clock readings, kept under their subsystem's names:
# gen/unfinished_curve (its x axis is seconds), gen/*_s, gen/instance_busy_frac, fusion/*_s,
# fusion/inference_overlap_frac and fusion/loaded_before_gen_end (generation/fused.py), and with
# fusion.migration_threshold="auto" the decisions made from measured costs (docs/architecture.md
# §2, "Invariant").
TIMING_PREFIXES = ("timing_s/", "perf/")
# Exit status of train_ppo after a SIGTERM/SIGINT stop that saved a checkpoint (EX_TEMPFAIL):
# a scheduler can tell "preempted, re-run to resume" from completion (0) and failure (1).
EXIT_STOPPED_BY_SIGNAL = 75


def _response_mask(gen: async_lib.Generated, max_new_tokens: int) -> np.ndarray:
  """[B, T] 1.0 on the rollout's response tokens (EOS included), 0.0 on padding, on the host."""
  return sequences.response_mask(gen.response_lens, max_new_tokens, xp=np)


def reward_square_limit(num_samples: int, max_new_tokens: int) -> float:
  """The reward magnitude beyond which the float32 sum of squares the critic's loss takes (each
  response token's return is about its sample's reward) can overflow: sqrt(3.4e38 / (samples x
  tokens)), 1.9e18 for 16 samples of 6 tokens, 1.3e17 for 1024 of 16. The critic-free
  estimators that do not normalise (Dr. GRPO, RLOO) pass advantages of the rewards' size to
  the policy gradient, whose norm's sum of squares overflows alike; GRPO and REINFORCE++
  normalise (scaled, finite at 1e30), and are held to the same limit: a reward that large is
  a reward function's mistake, not a scale to train at."""
  return float(np.sqrt(np.finfo(np.float32).max / max(num_samples * max_new_tokens, 1)))


class NonFiniteError(FloatingPointError):
  """A loss, gradient norm, metric or parameter of an iteration was NaN or Inf (config.guard)."""


@jax.jit
def _all_finite(tree) -> jax.Array:
  """One on-device bool: every element of every leaf is finite."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _rows(tree: dict, idx: jax.Array) -> dict:
  """The rows `idx` [m] of each [B, ...] leaf of `tree` (device arrays): a mini-batch gathered
  where the rollout's results already are."""
  return jax.tree.map(lambda x: x[idx], tree)


def _finite_mean(values) -> float:
  v = np.asarray(values, np.float64)
  v = v[np.isfinite(v)]
  return float(v.mean()) if v.size else float("nan")


def _spec_axes(tree: Any) -> set[str]:
  """The mesh axes any leaf of `tree` is split over."""
  return {a for x in jax.tree.leaves(tree)
          if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)
          for e in x.sharding.spec if e is not None for a in ((e,) if isinstance(e, str) else e)}


def _zero1_label(state: Any) -> str:
  """What optim.zero1 split, read from the placement: the axes the optimizer state is split
  over beyond the weights' (data, a critic's replicas), or that it found none (data 1 and no
  replicas: only leaves that fsdp, tensor or the stages leave whole, such as norm gains, are
  split further, if the mesh has those axes)."""
  extra = sorted(_spec_axes(state.opt_state) - _spec_axes(state.params))
  if extra:
    return f"split over {', '.join(extra)} (zero1)"
  return "zero1: no data copies or replicas to split over"


def sample_rows(gen: async_lib.Generated, tokenizer: Any, k: int,
                reward_label: str = "function") -> list[dict]:
  """The batch's first `k` samples as text (config.log_samples): each prompt as its tokens
  decode, special tokens shown (the chat template as the model read it), its ground truth
  ('target', where its record has one), each response as the reward functions read it (up to
  its EOS, rewards_lib.decode_responses), its reward, the reward's unweighted terms
  ('reward_terms': {"function" or "model", "format"}; a reward of one term, `reward_label`
  (config.reward.kind), holds the reward itself) and its length in tokens (EOS included)."""
  k = min(k, len(gen.scores))
  responses = rewards_lib.decode_responses(gen.response_tokens[:k], gen.response_lens[:k],
                                           tokenizer)
  rows = []
  for b in range(k):
    row = {"sample": b, "prompt": tokenizer.decode(gen.tokens[b, :gen.prompt_lens[b]].tolist(),
                                                   skip_special_tokens=False)}
    if gen.targets is not None and gen.targets[b] is not None:
      row["target"] = gen.targets[b]
    terms = ({label: float(v[b]) for label, v in gen.reward_terms.items()} if gen.reward_terms
             else {reward_label: float(gen.scores[b])})
    row.update({"response": responses[b], "reward": float(gen.scores[b]),
                "reward_terms": terms, "response_length": int(gen.response_lens[b])})
    rows.append(row)
  return rows


def clipped_scores(scores: np.ndarray, bounds: Optional[tuple[float, float]]
                   ) -> tuple[np.ndarray, dict]:
  """(scores [B] float32 clamped to `bounds` (config.reward.clip_bounds), {"reward/clipped_frac":
  the share of samples clamped}): OpenRLHF's --reward_clip_range, applied to the rewards before
  the KL penalty and any group baseline (trainer/ppo.advantages_and_returns), so every
  estimator trains on them. None: the scores as they are, no metric. A NaN reward stays NaN (the
  guard names it) and is not counted."""
  if bounds is None:
    return scores, {}
  scores = np.asarray(scores, np.float32)
  low, high = np.float32(bounds[0]), np.float32(bounds[1])
  outside = (scores < low) | (scores > high)  # [B]
  return np.clip(scores, low, high), {"reward/clipped_frac": float(np.mean(outside))}


def ran_before_fields(cfg: TrainConfig) -> dict[str, Any]:
  """{field: the value a run had before the field existed} for the fields added since whose
  default changes what this run computes: a checkpoint written before one of them is compared
  with that value, not the default (hooks.Checkpoints). reward.model_normalize (2026-12-07):
  a reward model's scores were raw; "auto" now normalises them by the mean and std that
  OpenRLHF's reward-model trainer writes into its config.json, which a resume of such a run
  would have switched to mid-run without a word ("off" itself is how such a run continues)."""
  out = {}
  if build.reward_normalization(cfg) is not None or cfg.reward.model_normalize == "off":
    out["reward.model_normalize"] = "off"
  return out


class PPOTrainer:
  """One run in `workdir`: builds its parts from the config, then iterates (run)."""

  def __init__(self, cfg: TrainConfig, workdir: str, mesh: Optional[jax.sharding.Mesh] = None,
               on_locked: Optional[Callable[[], Any]] = None,
               export_step: Optional[int] = None, given: Collection[str] = ()):
    """on_locked: called once the workdir is this run's (locked, the same on every process),
    before the set-up reads it (train_ppo starts WORKDIR/log.txt there). export_step: build the
    run to export its kept checkpoint of that iteration (export_checkpoint), not to train: no
    resume point is read or checked, no prompt is loaded or tokenised, nothing of the run is
    written. given: the fields the command line set (train_ppo's --config.* flags), for
    validate's warnings."""
    self._export_step = export_step
    self._given = tuple(given)
    self._export_inputs: dict = {}  # the exported checkpoint's input fingerprints
    # What the caller records of this start (its code and machine: train_ppo gives runner's
    # provenance), kept in each checkpoint's side-car as the last entry of `trained_by`.
    self.start_record: dict = {}
    self._recorded_starts: Optional[list] = None  # the resume point's trained_by
    self._earlier_starts: list = []  # the entries of the starts before this one
    self._start: Optional[int] = None  # the iteration this start began at (run())
    self._stepped_to: Optional[int] = None  # the iteration the state in memory is at
    self._built_at = time.time()  # the progress line's elapsed counts from here (setup too)
    # When this start began (train_ppo: its process's start), for trained_by's wall_s: the
    # seconds each start took up to its last save, which a sweep sums as the run's time (its
    # own clock missed a start killed with it, and counted starts that trained nothing).
    self.started_at = self._built_at
    self._samples: Optional[list] = None  # config.log_samples: this iteration's, as text
    self.workdir = workdir
    wd.check_local_path(workdir)
    os.makedirs(workdir, exist_ok=True)
    # One run per workdir (process 0 holds it for all processes of a multi-host run), from
    # here until run() ends, or until this constructor fails. Every process learns process 0's
    # verdict, so a refused multi-host start ends on all of them at once.
    self._lock, self._ran = None, False
    try:
      self._lock = distributed.run_on_main_process(
          lambda: self._lock_workdir(workdir, cfg.lock_wait_s),
          f"workdir {workdir} could not be locked by process 0 (another run holds it, or the "
          "lock file cannot be written: process 0's log says which); use another --workdir")
      # A stop that ended process 0's wait for the lock (its _lock None) stops every process
      # here, together (hooks.StoppedBeforeTraining: exit 75, nothing written).
      hooks.agree_setup_signal()
      assert self._lock is not None or jax.process_index() != 0
      # Every process reads back the token process 0 just wrote there: a workdir that is not
      # one directory on every host (a node-local disk) trained, then hung for ever at the
      # first checkpoint save, where orbax waits for every host's part.
      distributed.check_same_over_processes(
          (distributed.checksum(workdir),), f"the --workdir path (a checksum; "
          f"this process's: {workdir})", ": every process must be given the same workdir")
      distributed.check_same_over_processes(
          (wd.lock_token(workdir),), f"the workdir {workdir} (the start token process 0 wrote "
          "to its .lock; -1: not there)", ": the workdir must be one directory every host "
          "sees, at the same path (a shared filesystem: NFS, Lustre, a mounted bucket)")
      if on_locked is not None:
        on_locked()
      with hf_config.reads_once():  # each checkpoint's config.json read once, not per question
        self._setup(cfg, mesh)
    except BaseException:
      # A config error found after the checkpoint manager opened: close it here, or orbax's
      # cleanup thread can race the interpreter's shutdown and print its own traceback last.
      checkpoints = getattr(self, "checkpoints", None)
      if checkpoints is not None:
        try:
          checkpoints.checkpointer.close()
        except Exception:  # pylint: disable=broad-except
          logging.exception("closing the checkpoint manager after a failed start")
      if self._lock is not None:
        self._lock.release()
      raise

  @staticmethod
  def _lock_workdir(workdir: str, wait_s: float) -> Optional[wd.WorkdirLock]:
    """The workdir's lock (process 0 alone takes it), waiting up to `wait_s` for a holder on
    another host; None when a stop signal ended that wait. With several processes the first
    signal during set-up is only recorded (hooks.stop_before_training), and the wait went on
    for all of lock_wait_s (240 s) after a scheduler's SIGTERM, whose SIGKILL came first; one
    process alone raises at once from its signal handler."""
    try:
      return wd.WorkdirLock(workdir, wait_s, "config.lock_wait_s",
                            stop=hooks.setup_signal_pending)
    except wd.LockWaitStopped as e:
      logging.warning("%s", e)
      return None

  def _read_start(self, cfg: TrainConfig) -> None:
    """What to resume, checked before anything is built or compiled: the newest readable
    checkpoint's side-car, its seed and its config fingerprint against this config; whether
    the run is finished, and whether its HF export is still to be written."""
    if self._export_step is not None:  # that checkpoint's side-car alone, set aside nothing
      checkpointer = self.checkpoints.checkpointer
      try:
        meta = checkpointer.restore_meta(self._export_step)
      except Exception as e:  # noqa: BLE001 orbax raises many types for damaged files
        # (a checkpoint without its meta/ was orbax's KeyError in a 55-line traceback)
        raise ValueError(
            f"checkpoint {self._export_step} in {checkpointer.directory} cannot be read "
            f"(damaged?): {checkpointing.error_line(e)}; export another kept step (--step)"
        ) from None
      self.resume_step = self._export_step
      # (init.critic_checkpoint's config.json, which an export of the critic writes beside its
      # weights: export_checkpoint)
      self._export_inputs = meta.get("inputs") or {}
      changed = inputs_lib.export_changes(meta.get("inputs"), self.checkpoints.inputs)
      if changed:
        raise ValueError(
            f"checkpoint {self._export_step} in {checkpointer.directory} was trained with other "
            "files than the run's inputs hold now (" + "; ".join(changed) + "): the export "
            "copies them beside the weights (tokenizer, chat template, generation config), so "
            "it would not be the model the run trained. Put the files the run read back")
      if meta.get("iteration") != self._export_step:  # the export would be marked with it
        raise ValueError(
            f"checkpoint {self._export_step} in {self.checkpoints.checkpointer.directory} holds "
            f"iteration {meta.get('iteration')} (put back under another number?): rename its "
            f"directory to {meta.get('iteration')}")
      self.schedule_iterations = (cfg.optim.schedule_iterations or
                                  meta.get("schedule_iterations") or cfg.num_iterations)
      self.finished_at, self.export_only = None, False
      return
    self.resume_step, meta = self.checkpoints.resume_point()
    self._recorded_starts = (meta or {}).get("trained_by")
    # The LR schedule's horizon is fixed by the first start and kept in the checkpoints.
    self.schedule_iterations = (cfg.optim.schedule_iterations or (meta or {}).get(
        "schedule_iterations") or cfg.num_iterations)
    # A finished run (the same command again) builds nothing: no model, no mesh, no compile
    # (a fused run compiles for a minute); run() then says "nothing to do" at once.
    self.finished_at = (self.resume_step if self.resume_step is not None and
                        self.resume_step >= cfg.num_iterations else None)
    if (self.resume_step is not None and self.finished_at is None and
        cfg.num_iterations > self.schedule_iterations):
      logging.warning(
          "iterations %d-%d run at the LR schedule's floor (optim.min_lr_ratio=%g of the peak): "
          "the cosine spans %d iterations, fixed by the first start. To stretch it instead: "
          "--config.optim.schedule_iterations=%d "
          "--config.checkpoint.resume_changes=optim.schedule_iterations",
          max(self.resume_step, self.schedule_iterations) + 1, cfg.num_iterations,
          cfg.optim.min_lr_ratio, self.schedule_iterations, cfg.num_iterations)
    # ... unless its HF export is missing or older than its last checkpoint (the export failed
    # or was killed, or checkpoint.export_hf was turned on or the run extended since): then the
    # model is built, the last checkpoint restored and exported, and no iteration runs.
    self.export_only = (self.finished_at is not None and
                        hf_export.export_pending(self.workdir, cfg, self.finished_at))

  def _setup(self, cfg: TrainConfig, mesh: Optional[jax.sharding.Mesh]) -> None:
    """Builds what the run needs, in the order it needs it (each step a method saying why);
    a finished run builds nothing, an export only the models."""
    self.stopped_by_signal: Optional[int] = None  # the signal that stopped run(), if any
    self.trained_to: Optional[int] = None  # the iteration run() left the state at
    self.checkpoints = hooks.Checkpoints(self.workdir, cfg, cfg.fingerprint(),
                                         ran_before_fields(cfg))
    self.cfg = cfg
    self._agree_start(cfg)
    if self.export_only:
      logging.warning("the run is finished at iteration %d but %s does not hold its actor: "
                      "building the model to export it", self.finished_at,
                      os.path.join(self.workdir, hf_export.HF_EXPORT_DIR))
      self.finished_at = None
    if self.finished_at is not None:
      return
    self.task, self.tokenizer = build.build_task_and_tokenizer(cfg)
    # An export reads no weights of the run's HF checkpoints, nor opens their safetensors (they
    # may have been moved away after training; their config.json and tokenizer files are read)
    weights = self._export_step is None
    # A resume reads the critic's config.json alone: the checkpoint holds its weights (the
    # actor's are the KL reference's, read at every start). A resume read the whole critic only
    # to overwrite it, and failed once its safetensors had been moved away.
    critic_restored = self.resume_step is not None
    self.cfg = cfg = build.resolve_config(cfg, self.tokenizer, weights=weights,
                                          critic_weights=weights and not critic_restored)
    self._note_plan_workload(cfg, weights)
    self._make_meshes(cfg, mesh)
    self._check_config(cfg, weights)
    if cfg.plan.file:  # what the file changed is otherwise visible only in config.json
      logging.info("setup: %s", plan_file_lib.plan_file_summary(cfg.plan.file, cfg))
    t0 = time.time()
    logging.info("setup: %s, mesh %s%s; initialising the models and the update ...",
                 f"prompts {cfg.data.prompts_file!r}" if cfg.data.prompts_file else
                 f"task {cfg.data.task!r}", dict(self.mesh.shape), (
                     f" (training group), generation group of {self.gen_mesh.devices.size} "
                     f"devices" if self.disjoint else ""))
    if self._export_step is None:
      self._build_prompts(cfg)
    else:  # an export restores the models alone: no prompt is read, rendered or tokenised
      self.dataset = self.held_out = None
    self.use_critic = adv_lib.needs_critic(cfg.algo.estimator)
    models = build.build_models(cfg, self.mesh, restored=self._export_step is not None,
                                critic_restored=critic_restored)
    self.update = update_lib.make_update(cfg, self.mesh, use_critic=self.use_critic,
                                         schedule_iterations=self.schedule_iterations,
                                         workdir=self.workdir)
    self.actor = self.update.init_state("actor", models.actor, self.mesh)
    self.critic = (self.update.init_state("critic", models.critic, self.mesh)
                   if self.use_critic else None)
    models.actor = models.critic = None  # the update's states hold them now (staged: a copy)
    self._log_state_bytes(cfg)
    if self._export_step is not None:
      # All an export restores into (_state: the models, async PPO's empty batch slots): no
      # rollout stage, whose generation instances a fused run compiles for a minute.
      self.in_flight = {}
      logging.info("setup: models and update ready in %.1fs", time.time() - t0)
      return
    self._offload = {"timing_s/optimizer_offload": 0.0, "perf/optimizer_offload_bytes": 0}
    # The fused stage (and plan.generation='instances', its machinery) keeps the frozen models
    # in host memory (§2).
    if cfg.fusion.inter_stage or cfg.plan.generation == "instances":
      models.frozen_to_host()
    elif self.moves_weights:  # the serial stage scores on the generation group's mesh
      models.frozen_to_mesh(cfg, self.gen_mesh)
    logging.info("setup: models and update ready in %.1fs", time.time() - t0)
    self._make_rollout_stage(cfg, models)
    self.checkpoints.state_fn = self._state
    self.checkpoints.meta_fn = self._meta
    self._compiled_update = False  # the first update call (compiles) is timed and logged
    self._row_takers: dict = {}  # _rows jitted per (key, ndim) set: each mini-batch's gather
    self._make_rescorers(cfg)

  def _agree_start(self, cfg: TrainConfig) -> None:
    """Reads where the run starts (_read_start) on every process and stops all of them unless
    they agree; a fresh start then sets aside an earlier start's outputs."""
    # Every process reads the workdir itself: a host whose view of the shared filesystem
    # differs (a stale directory listing, a workdir not on the shared mount) would restore
    # another checkpoint, or none, and the run would go on from a mix of states; and a read
    # that fails on that host alone would leave the others waiting for it. So every process
    # compares what it read (or that it failed: -2) before anything else.
    failed = None
    try:
      self.checkpoints.checkpointer.raise_if_unwritable()  # process 0's probe: all stop
      self._read_start(cfg)
    except Exception as e:  # pylint: disable=broad-except  raised below, after the comparison
      failed = e
    distributed.check_same_over_processes(
        (-2, 0) if failed is not None else
        (-1 if self.resume_step is None else self.resume_step, self.export_only),
        f"where to start in {self.workdir} (checkpoint step, -1: none, -2: reading the "
        "checkpoints failed, that process's log says why; export only)",
        ": each reads the workdir's checkpoints itself, so their hosts see different files "
        "there; check that it is on a filesystem every host shares, as the same path",
        failed=failed)
    hooks.agree_setup_signal()  # a signal so far, on any process: all stop here
    if self.resume_step is None:  # (agreed above: every process is here, or none)
      # A start that left no checkpoint (stopped early, failed) left its metrics and config:
      # kept aside rather than truncated by this fresh start. Process 0 moves them; if that
      # fails (permissions, a full disk) every process stops, not process 0 alone.
      kept = distributed.run_on_main_process(
          lambda: wd.set_aside_earlier_start(self.workdir),
          f"process 0 could not set aside the earlier start's outputs in {self.workdir} (its "
          "log says why)")
      if kept:
        logging.warning("workdir %s holds an earlier start's outputs but no checkpoint: they "
                        "are kept in %s; this run starts at iteration 0", self.workdir, kept)

  def _note_plan_workload(self, cfg: TrainConfig, weights: bool) -> None:
    """Logs how the workload plan.file was searched for differs from this run's (a warning
    where it matters), before any check can stop the run."""
    if not cfg.plan.file:
      return
    # (its prompts file compared by the digest the resume check took: not read again)
    note = plan_file_lib.plan_workload_note(cfg.plan.file, cfg,
                                            build.reward_model_config(cfg, weights),
                                            self.checkpoints.inputs)
    if note:
      (logging.warning if note[0] else logging.info)("%s", note[1])

  def _check_config(self, cfg: TrainConfig, weights: bool) -> None:
    """Raises for a config the meshes cannot run (validate; an error caused by plan.file says
    so) or optimizer offload without host memory."""
    try:
      validate(cfg, self.mesh, generation_devices=self.gen_mesh.devices.size, weights=weights,
               given=self._given)
    except ValueError as e:  # a value the plan file set, not the user: the error says so
      said = plan_file_lib.attribute_to_plan(str(e), cfg.plan.file)
      if said != str(e):
        raise ValueError(said) from None
      raise
    if cfg.optim.offload_during_rollout and not mesh_lib.has_host_memory(self.mesh):
      local = mesh_lib.first_local_device(self.mesh)
      raise ValueError(
          f"config.optim.offload_during_rollout=True: expected devices with host memory (jax "
          f"memory kind {mesh_lib.HOST_MEMORY!r}); the {local.platform} devices here have "
          f"{[m.kind for m in local.addressable_memories()]}")

  def _make_rollout_stage(self, cfg: TrainConfig, models) -> None:
    """The sampling settings and the rollout stage, which owns the frozen models from here,
    and async PPO's (empty) in-flight batches."""
    self.sampling = SamplingConfig(
        temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens, eos_id=self.tokenizer.eos_id,
        extra_eos_ids=tuple(self.tokenizer.extra_eos_ids), pad_id=self.tokenizer.pad_id,
        chunk_size=cfg.rollout.chunk_size, steps_per_check=cfg.rollout.steps_per_check)
    if self.sampling.extra_eos_ids:
      logging.info("setup: responses end on any of the token ids %s (EOS %d, then the others "
                   "the model directory's generation_config.json names, or without one its "
                   "config.json)", list(self.sampling.stop_ids), self.sampling.eos_id)
    # The stage owns the frozen models from here (a fused stage moves them to host memory).
    # Async PPO scores values with the current critic on the training devices instead (a
    # batch's values must be those of the critic it trains against: _current_values), so its
    # stage has no critic and the critic never moves to the generation group.
    self.stage_critic = self.use_critic and not cfg.async_ppo.staleness
    self.rollout = rollout_lib.make_rollout_stage(
        cfg, self.sampling, self.gen_mesh, reference=models.reference,
        rewards=build.build_rewards(cfg, self.task, self.tokenizer, models, self.gen_mesh),
        pad_id=self.tokenizer.pad_id, actor_shapes=self._generation_shapes("actor"),
        critic_shapes=self._generation_shapes("critic") if self.stage_critic else None)
    # Async PPO: the generated batches the next iterations train on (in order), saved with
    # each checkpoint (trainer/async_ppo.py).
    self.in_flight: dict[int, async_lib.Generated] = {}
    self._weights_to_generation_s = 0.0

  def _make_rescorers(self, cfg: TrainConfig) -> None:
    """The scorers that score batches again on the training side: async PPO's rescoring and
    the update's old log-probs, in mini-batch or log-prob-row sized pieces."""
    # Async PPO scores each batch again on the training devices (the current actor's log-probs,
    # the current critic's values), in mini-batch sized pieces: on the training mesh, or its
    # folded form when the serial rollout runs there.
    on_folded = (self.folded and
                 cfg.algo.minibatch_size % mesh_lib.batch_size_multiple(self.gen_mesh) == 0)
    self._rescore_params = self._to_generation if on_folded else self.model_params
    self._rescorer = scoring.Scorer(self.gen_mesh if on_folded else self.mesh,
                                    micro_batch_size=cfg.algo.minibatch_size)
    # algo.old_logp: the update's old log-probs from the training forward (synchronous runs;
    # asynchronously the generating policy is gone, config.py), resolved and sized by
    # AlgoConfig (experiments/plan_check compiles this pass, and async PPO's proximal one, from
    # the same answers: its `actor_logp` program).
    pipelined = self.update.is_pipelined
    self._recompute_old_logp = cfg.algo.recomputes_old_logp(cfg.async_ppo.staleness, pipelined,
                                                            cfg.model)
    rows = cfg.algo.logprob_rows(self._recompute_old_logp, pipelined,
                                 mesh_lib.batch_size_multiple(self._rescorer.mesh))
    self._old_logp_scorer = (self._rescorer if rows == self._rescorer.micro_batch_size else
                             scoring.Scorer(self._rescorer.mesh, micro_batch_size=rows))

  def _build_prompts(self, cfg: TrainConfig) -> None:
    """The training prompt stream and the held-out evaluation (None without held-out prompts
    or with eval_every=0), every prompt rendered and tokenised (build.build_datasets)."""
    self.dataset, held_out, pool = build.build_datasets_and_pool(cfg, self.task, self.tokenizer)
    # Saved with the validation settings: a resume judges a changed data.val_max_prompts by the
    # prompts it selects, min(pool, val_max_prompts) (trainer/inputs.py, warn_eval_changes).
    self.checkpoints.set_val_pool(pool)
    if cfg.data.prompts_file:  # how far num_iterations takes the run through the data
      n, per = len(self.dataset.records), cfg.rollout.prompts_per_iteration
      # (a count of 1 read "1 held-out ones ... every 1 iterations")
      count = metrics_lib.count
      held = ""
      if held_out is not None:
        # The file named: a preset's val_file kept beside the user's prompts_file (with the
        # same keys) validated on the preset's own problems without a word.
        source = f" from {cfg.data.val_file}" if cfg.data.val_file else ""
        when = (": never, eval_every=0" if not cfg.eval_every else " every iteration"
                if cfg.eval_every == 1 else f" every {cfg.eval_every} iterations")
        held = f" ({count(len(held_out.records), 'held-out one')}{source} " \
               f"validated{when})"
      passes = f"{cfg.num_iterations * per / n:.3g}"
      logging.info("setup: %s%s, %d per iteration: %s %s %s over them (each pass in a new "
                   "seeded order)", count(n, "training prompt"), held, per,
                   count(cfg.num_iterations, "iteration is", "iterations are"), passes,
                   "pass" if passes == "1" else "passes")
    self.held_out = (evaluation.HeldOutEval(held_out, cfg.rollout.batch_size, cfg.seed)
                     if held_out is not None and cfg.eval_every else None)

  def _log_state_bytes(self, cfg: TrainConfig) -> None:
    """Logs what one device holds of each trained model: weights and optimizer state (the
    figures plan_check's train_step arguments predict; docs/usage.md "Memory at scale")."""
    device = mesh_lib.first_local_device(self.mesh)
    held = lambda tree: metrics_lib.size(sum(s.data.nbytes for x in jax.tree.leaves(tree)
                                             for s in x.addressable_shards
                                             if s.device == device))
    for name in ("actor", "critic"):
      state = getattr(self, name)
      if state is not None:
        layout = ", ".join(filter(None, ("a float32 copy" if cfg.optim.master_weights else "",
                                         _zero1_label(state) if cfg.optim.zero1 else "")))
        logging.info("setup: %s on %s: weights %s, optimizer state %s%s", name,
                     device, held(state.params), held(state.opt_state),
                     f" ({layout})" if layout else "")

  def _make_meshes(self, cfg: TrainConfig, mesh: Optional[jax.sharding.Mesh]) -> None:
    """The training mesh (config.mesh) and the generation group's (config.async_ppo): one mesh
    for both unless async_ppo.generation_devices > 0."""
    self._gen_shardings: dict = {}  # model -> its whole parameters' shardings on gen_mesh
    self.disjoint = cfg.async_ppo.generation_devices > 0
    if mesh is not None and self.disjoint:
      raise ValueError(f"config.async_ppo.generation_devices={cfg.async_ppo.generation_devices}"
                       ": the trainer splits the devices itself; pass no mesh")
    if mesh is not None:
      self.mesh = self.gen_mesh = mesh
    else:
      self.mesh, self.gen_mesh = async_lib.meshes(cfg, jax.devices())
    # A serial or planned rollout on a pipelined training mesh generates and scores on the same
    # devices with `stage` folded into `data`: the batch splits over every device instead of
    # each stage device running the whole of it again (the whole models' weights are placed
    # alike on both: mesh.fold_stage). Kept as is when the batch does not split that finely.
    # (The fused and instances stages build their own instance meshes from the devices.)
    folded_mesh = mesh_lib.fold_stage(self.mesh)
    if (folded_mesh is not self.mesh and not self.disjoint and
        rollout_lib.stage_kind(cfg) in ("serial", "planned")):
      if cfg.rollout.batch_size % mesh_lib.batch_size_multiple(folded_mesh) == 0:
        self.gen_mesh = folded_mesh
      else:
        logging.warning(
            "the rollout batch %d does not split over data x fsdp x stage = %d devices: "
            "generation and inference run whole on each of the %d stage devices",
            cfg.rollout.batch_size, mesh_lib.batch_size_multiple(folded_mesh),
            self.mesh.shape["stage"])
    # Whether the rollout's whole models live on another mesh than the update's (placed there
    # by their logical axes each time the stage asks for them): the generation group's, or the
    # training devices folded.
    self.moves_weights = self.gen_mesh is not self.mesh
    self.folded = self.moves_weights and not self.disjoint

  def _model_cfg(self, model: str):
    return self.cfg.model if model == "actor" else self.cfg.critic_model

  def _generation_shapes(self, model: str) -> Any:
    """The whole parameters' ShapeDtypeStructs as generation and inference take them: on the
    training mesh, or laid out by their logical axes on the generation group's."""
    shapes = self.update.whole_shapes(model)
    if not self.moves_weights:
      return shapes
    return mesh_lib.abstract(shapes, self._generation_shardings(model))

  def _generation_shardings(self, model: str) -> Any:
    """The whole parameters' shardings on the generation group's mesh, by their logical axes
    (made once per model: logical_specs traces the model)."""
    if model not in self._gen_shardings:
      self._gen_shardings[model] = mesh_lib.param_shardings(
          self.update.whole_shapes(model), llama.logical_specs(self._model_cfg(model)),
          self.gen_mesh)
    return self._gen_shardings[model]

  def _to_generation(self, model: str, copy: bool = False) -> Any:
    """The current whole parameters of `model` where generation and inference run (timed in
    timing_s/weights_to_generation). copy=True: buffers of their own, which survive the next
    update (it donates the state's) and so stay the policy that generated an in-flight batch."""
    # (a pipelined state's reshard: timing_s/reshard, not here). Onto another device group
    # (async PPO's) the layers are not gathered first; onto the training devices folded, the
    # gathered layout is the folded one's (relabelled below, nothing moves).
    whole = self.model_params(model, moving=self.moves_weights and not self.folded)
    t0 = time.perf_counter()
    if self.moves_weights:
      whole = mesh_lib.put(whole, self._generation_shardings(model))
    elif copy and not self.update.is_pipelined:  # a pipelined `whole` is a new array already
      whole = jax.tree.map(jnp.copy, whole)
    if self.moves_weights or copy:
      jax.block_until_ready(whole)
      self._weights_to_generation_s += time.perf_counter() - t0
    return whole

  def _generation_params(self) -> Callable[[str], Any]:
    """params(model) for the rollout stage, each model placed when the stage asks for it (a
    serial stage never holds the whole actor and critic at once). A stage that moves them onto
    instances of its own (FusedStage.moves_params) takes them as Update.whole's `moving`."""
    if self.moves_weights:
      return self._to_generation
    if getattr(self.rollout, "moves_params", False):
      return functools.partial(self.model_params, moving=True)
    return self.model_params

  def _snapshot(self) -> Callable[[str], Any]:
    """The current policy (and critic) copied for generation now, before the next update."""
    names = ("actor", "critic") if self.stage_critic else ("actor",)
    return {name: self._to_generation(name, copy=True) for name in names}.get

  def model_params(self, model: str, moving: bool = False):
    """The whole parameters of "actor" / "critic", placed as generation and inference take
    them (a pipelined run's stage-stacked state resharded; trainer/update.py); `moving`: for a
    caller that moves them on at once (Update.whole: a pipelined model's layers not gathered
    first)."""
    return self.update.whole(model, self.actor if model == "actor" else self.critic, moving)

  @contextlib.contextmanager
  def _optimizer_offloaded(self):
    """optim.offload_during_rollout: both models' optimizer states in the host memory beside
    their devices for the body (a rollout), back exactly where they were after it, also when
    the body or a move raises. Timed, both ways, in timing_s/optimizer_offload;
    perf/optimizer_offload_bytes is one device's share of what moves."""
    if not self.cfg.optim.offload_during_rollout:
      yield
      return
    placed: dict = {}
    try:
      self._move_optimizer_states(placed)
      yield
    finally:
      self._move_optimizer_states(placed, back=True)

  def _move_optimizer_states(self, placed: dict, back: bool = False) -> None:
    """Moves the optimizer states into host memory, recording each model's shardings in
    `placed` as it goes (back=False), or the models in `placed` back to them (back=True). A
    method, not the context manager's body: a local left there holding a state's device arrays
    would keep them in device memory for the whole rollout."""
    t0 = time.perf_counter()
    if back:
      for name, shardings in placed.items():
        state = getattr(self, name)
        setattr(self, name, state.replace(
            opt_state=mesh_lib.from_host_memory(state.opt_state, shardings)))
    else:
      device, share = mesh_lib.first_local_device(self.mesh), 0
      for name, state in self._model_states().items():
        moved, shardings = mesh_lib.to_host_memory(state.opt_state)
        setattr(self, name, state.replace(opt_state=moved))
        placed[name] = shardings
        share += sum(s.data.nbytes for x in jax.tree.leaves(moved) for s in x.addressable_shards
                     if s.device == device)
      self._offload["perf/optimizer_offload_bytes"] = share
    jax.block_until_ready([getattr(self, name).opt_state for name in placed])
    self._offload["timing_s/optimizer_offload"] += time.perf_counter() - t0

  def _take_offload_metrics(self) -> dict:
    """The optimizer states' moves since the last take (empty without the offload)."""
    if not self.cfg.optim.offload_during_rollout:
      return {}
    out, self._offload = self._offload, dict.fromkeys(self._offload, 0)
    return out

  def _model_states(self) -> dict:
    return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

  def _state(self) -> dict:
    """What a checkpoint holds: the model states and, for async PPO, the batches in flight."""
    state = self._model_states()
    k = self.cfg.async_ppo.staleness
    if k:  # k slots of batches in flight, in order (empty ones near the end stay zeros)
      batches = sorted(self.in_flight.values(), key=lambda g: g.iteration)
      state["in_flight"] = {str(i): batches[i].arrays() if i < len(batches)
                            else async_lib.template(self.cfg) for i in range(k)}
    return state

  def _meta(self) -> dict:
    meta = {"data": self.dataset.state_dict(), "schedule_iterations": self.schedule_iterations,
            "devices": self._devices(), "zero1": bool(self.cfg.optim.zero1),
            "trained_by": self.trained_by()}
    if self.cfg.async_ppo.staleness:
      meta["in_flight"] = [g.side_car() for g in sorted(self.in_flight.values(),
                                                        key=lambda g: g.iteration)]
    generator = rollout_lib.fused_generator(self.rollout)
    if generator is not None:  # the "auto" Rt's length histogram
      meta["rt"] = generator.rt_state()
    return meta

  def _starts_before(self, start: int) -> list:
    """trained_by's entries for iterations 1..start: the resume point's, cut at `start` (a
    fallback to an older checkpoint); one without a record (saved before starts were recorded)
    stands as {from 0, to start} with nothing known of it. Warns when this start's code is not
    the code (or the jax) that trained the restored iterations last."""
    recorded = self._recorded_starts
    if start == 0:
      return []
    if not isinstance(recorded, list):
      return [{"from": 0, "to": start}]
    earlier = [{**e, "to": min(e.get("to", start), start)} for e in recorded
               if isinstance(e, dict) and e.get("from", 0) < start]
    before = earlier[-1] if earlier else {}
    code = [(r.get("git_commit"), r.get("git_changes")) for r in (before, self.start_record)]
    if (start < self.cfg.num_iterations and code[0][0] and code[1][0] and code[0] != code[1]):
      logging.warning(
          "resuming checkpoint %d, whose iterations %d-%d were trained at commit %s%s, with "
          "commit %s%s: the iterations from %d on come from other code (result.json's "
          "trained_by lists each start's code and machine)", start, before["from"] + 1,
          before["to"], code[0][0], f" (changes {code[0][1]})" if code[0][1] else "",
          code[1][0], f" (changes {code[1][1]})" if code[1][1] else "", start + 1)
    versions = [r.get("jax") for r in (before, self.start_record)]
    if start < self.cfg.num_iterations and all(versions) and versions[0] != versions[1]:
      # Another jax (its XLA) compiles the same program into other fused kernels and reduction
      # orders: the run continues, ~1e-7 apart from the uninterrupted run's metrics at once
      # (measured 0.10.2 -> 0.11.2 and 0.12.1, tiny run, 2026-12-06), and drifts from there.
      logging.warning(
          "resuming checkpoint %d, whose iterations %d-%d were trained with jax %s, with jax "
          "%s: the run continues, but not bitwise as it would have with jax %s (XLA compiles "
          "the programs differently)", start, before["from"] + 1, before["to"], versions[0],
          versions[1], versions[0])
    return earlier

  def trained_by(self) -> list[dict]:
    """Which start trained which iterations of the state: [{from, to, and what the start
    recorded (start_record: commit, machine, ...)}], oldest first; the running start's entry
    once it has trained an iteration, with `wall_s`, its seconds from its beginning
    (started_at) to now (a save, result.json)."""
    if self._start is None or self._stepped_to <= self._start:
      return list(self._earlier_starts)
    return [*self._earlier_starts,
            {"from": self._start, "to": self._stepped_to, **self.start_record,
             "wall_s": round(time.time() - self.started_at, 2)}]

  def _devices(self) -> dict:
    """The layout this run computes on, which its config may leave to the device count
    (mesh.data=-1: all of them): the training mesh, the generation devices, the processes."""
    return {"mesh": {k: int(v) for k, v in self.mesh.shape.items()},
            "generation_devices": int(self.gen_mesh.devices.size),
            "processes": jax.process_count()}

  def _layout(self) -> str:
    """The state's layout, for the error of a checkpoint written for another one."""
    return ("stage-stacked for mesh.stage=%d, pipeline.critic_pp=%d" % (
        self.mesh.shape["stage"], self.update.executor.program.problem.critic_pp)
            if self.update.is_pipelined else "whole models (mesh.stage=1)")

  def _restore(self) -> int:
    """Restores the newest intact checkpoint; returns the iteration to start at (0: none)."""
    start, state, meta = self.checkpoints.restore(self.resume_step, self._state(),
                                                  self._layout())
    saved, now = (meta or {}).get("devices"), self._devices()
    if saved is not None and saved != now:
      # Allowed (a preempted job may come back on other machines), but not the uninterrupted
      # run's trajectory: reductions split differently round differently, and whatever the
      # config sizes from the device count (instances, groups, mini-batch shards) changes.
      logging.warning("resuming checkpoint %d, saved on %s, on %s: the run continues, but not "
                      "exactly as it would have on the devices that saved it", start, saved, now)
    saved_cfg = (meta or {}).get("config")
    if (isinstance(saved_cfg, dict) and "algo.old_logp" not in saved_cfg and
        self._recompute_old_logp and start < self.cfg.num_iterations):
      # The field counts as unchanged at its default ("auto"), but for a 16-bit actor "auto"
      # is new behaviour: say so (2026-12-06).
      logging.warning("resuming checkpoint %d, written before algo.old_logp existed: its "
                      "iterations took PPO's old log-probs from the decode, and from iteration "
                      "%d on the actor's training forward recomputes them (algo.old_logp="
                      "'auto' with a 16-bit actor), so the run does not continue as that code "
                      "would have; --config.algo.old_logp=generation continues as it did",
                      start, start + 1)
    saved_zero1 = (meta or {}).get("zero1")
    if saved_zero1 is not None and saved_zero1 != self.cfg.optim.zero1:
      # Allowed (RESUMABLE_FIELDS): the state is restored into the other placement.
      logging.warning("resuming checkpoint %d, saved with optim.zero1=%s, with optim.zero1=%s: "
                      "the optimizer state is placed anew and the run continues, equal to the "
                      "uninterrupted run up to float rounding (the gradient norm sums in another "
                      "order), not bitwise", start, saved_zero1, self.cfg.optim.zero1)
    if state is not None:
      # The reference is not saved: it is the initial actor, rebuilt from the seed or the
      # checkpoint exactly as in the first run.
      self.actor, self.critic = state["actor"], state.get("critic")
      self.dataset.load_state_dict(meta["data"])
      # Async PPO: the batches that were in flight, generated by the policies before this one.
      self.in_flight = {}
      for i, side_car in enumerate(meta.get("in_flight", [])):
        g = async_lib.Generated.restore(state["in_flight"][str(i)], side_car)
        self.in_flight[g.iteration] = g
      self._match_reference(start)
      generator = rollout_lib.fused_generator(self.rollout)
      if "rt" in meta and generator is not None:
        generator.load_rt_state(meta["rt"])
    elif self.resume_step is not None and self.use_critic and self.cfg.init.critic_checkpoint:
      # No checkpoint restored (Checkpoints.restore's fresh start) where one was to be: the
      # critic the set-up built from the seed (a resume reads no critic weights) is replaced
      # by init.critic_checkpoint's weights, as a first start loads them; never trained from
      # random weights.
      logging.warning("no checkpoint was restored: loading the critic's initial weights from "
                      "config.init.critic_checkpoint=%r", self.cfg.init.critic_checkpoint)
      self.critic = None  # (its buffers freed before the load)
      self.critic = self.update.init_state(
          "critic", build.build_critic(self.cfg, self.mesh), self.mesh)
    return start

  def export_checkpoint(self, out_dir: str, model: str = "actor",
                        critic_family: str = "auto") -> str:
    """The `model` ("actor", or "critic" of a run that trains one) of checkpoint `export_step`
    (the constructor's) as a HF checkpoint in `out_dir` (hf_export.export_hf: written beside
    it, renamed into place whole), the actor in the family config.checkpoint.export_hf names,
    the critic in `critic_family` ('auto': its init.critic_checkpoint's, else the one its shape
    implies). The checkpoint is read and checked (its checksums), never set aside: one that
    cannot be read is an error. Returns the family written."""
    cfg = self.cfg
    if model == "critic":
      if not self.use_critic:
        raise ValueError(f"the run trained no critic (config.algo.estimator="
                         f"{cfg.algo.estimator!r} needs none): only its actor exports")
      cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
          cfg.checkpoint, export_hf=critic_family or "auto"))
      try:  # a family that cannot express the critic: before the checkpoint is read
        hf_export.check_family(cfg, model)
      except ValueError as e:
        raise ValueError(f"critic_family={critic_family!r}: {e}") from None
      field = "init.critic_checkpoint"
      if inputs_lib.config_changed(self._export_inputs.get(field),
                                   self.checkpoints.inputs.get(field)):
        # Its architecture (rope_theta, rms_norm_eps) is the export's config.json: another one
        # there shipped the trained weights as another model (the actor's is refused likewise).
        raise ValueError(
            f"config.{field}={cfg.init.critic_checkpoint!r}: config.json changed since "
            f"checkpoint {self._export_step} was written; the critic's export writes its "
            "architecture beside the weights, so it would not be the model the run trained. "
            "Put the file the run read back")
    else:
      hf_export.check_model_name(model)
    step = self._export_step
    state, _ = self.checkpoints.read_exactly(step, self._state(), self._layout())
    params = self.update.whole(model, state[model])
    with hooks.writing(out_dir):  # a full disk: LogWriteError (export_hf: exit 3) naming it
      family = hf_export.export_hf(params, cfg, out_dir, step, self.tokenizer, self.workdir,
                                   model=model, inputs=self._export_inputs)
    logging.info("exported the %s of iteration %d as a HF %s checkpoint: %s", model, step,
                 family, out_dir)
    return family

  def _match_reference(self, start: int) -> None:
    """Async PPO resumed with another algo.kl_coef (checkpoint.resume_changes): batches in flight
    generated with kl_coef=0 hold no reference log-probs, which a kl_coef > 0 reads (refused:
    nothing here scores them afterwards); batches that hold them lose them under kl_coef=0, so
    every iteration of the run logs the same metrics (no kl/*)."""
    uses = self.cfg.algo.uses_reference
    lacking = sorted(j + 1 for j, g in self.in_flight.items() if g.ref_logp is None)
    if uses and lacking:
      raise ValueError(async_lib.reference_refusal(start, lacking, self.cfg.algo.kl_coef,
                                                   self.cfg.async_ppo.staleness))
    if not uses:
      for g in self.in_flight.values():
        g.ref_logp = None

  # ---------------------------------------------------------------- one iteration
  def _prompts(self, iteration: int) -> rollout_lib.Prompts:
    """The next prompts, each repeated samples_per_prompt times on consecutive rows (GRPO/RLOO
    groups are rows [g*n, (g+1)*n))."""
    batch, n = self.dataset.next_batch(), self.cfg.rollout.samples_per_prompt
    size = self.cfg.rollout.batch_size
    return rollout_lib.Prompts(
        records=[r for r in batch.records for _ in range(n)],
        tokens=np.repeat(batch.tokens, n, axis=0), lens=np.repeat(batch.lengths, n, axis=0),
        uids=iteration * size + np.arange(size))

  def _put(self, x):
    return mesh_lib.put(x, mesh_lib.batch_sharding(self.mesh, np.ndim(x)))

  def _generate(self, iteration: int, params: Callable[[str], Any], version: int
                ) -> async_lib.Generated:
    """Stages 1-2 for `iteration`: its prompts (the next of the stream), its key, the policy of
    update `version` (`params`, where the rollout stage runs)."""
    prompts = self._prompts(iteration)
    key = jax.random.fold_in(jax.random.key(self.cfg.seed), iteration)
    try:
      out = self.rollout(params, prompts, key)
    except rewards_lib.RewardFunctionError as e:
      self._reward_failed(e, f"iteration {iteration + 1}")
      raise
    return async_lib.Generated.from_stage(iteration, version, out, prompts.records)

  def _reward_failed(self, e: rewards_lib.RewardFunctionError, where: str,
                     way_past: str = "") -> None:
    """The reward function's error (it names the function and the sample, not when) with
    when, and what a re-run will do: in a long run, that nothing of the iteration was kept."""
    last = self.checkpoints.latest_step()
    e.args = (f"{where}: {e}. Nothing of this iteration was written or saved; " + (
        "no checkpoint came before it: the same command starts over" if last is None else
        f"the last checkpoint ({last}) is kept: the same command resumes from it") +
              " once the function is fixed" + way_past,) + e.args[1:]

  def _advantages(self, gen: async_lib.Generated):
    """(training data, rollout statistics) of the rollout: the data on the devices, each array
    put there once (the statistics' inputs among them), for every mini-batch to gather its
    rows from (_minibatch)."""
    mask = _response_mask(gen, self.cfg.rollout.max_new_tokens)  # [B, T]
    data = {k: self._put(v) for k, v in (
        ("tokens", gen.tokens), ("prompt_lens", gen.prompt_lens), ("mask", mask),
        ("old_logp", gen.logprobs), ("old_values", gen.values))}
    # No reference log-probs (algo.kl_coef=0): the statistics leave out kl/*, the update its KL.
    if gen.ref_logp is not None:
      data["ref_logp"] = self._put(gen.ref_logp)
    scores, clip_stats = clipped_scores(gen.scores, self.cfg.reward.clip_bounds)
    adv, ret, stats = ppo.rollout_statistics(
        self.cfg.algo, self.cfg.rollout.samples_per_prompt, self._put(scores),
        data["mask"], data["old_logp"], data.get("ref_logp"), data["old_values"])
    # Only the statistics are read: the advantages and returns stay on the devices too. Read
    # with them, they came back to the host and went out again, piece by piece, once per
    # mini-batch, as did every other array here.
    stats = {**mesh_lib.to_host(stats), **clip_stats}
    data.update(advantages=adv, returns=ret)
    return data, stats

  def _current_values(self, gen: async_lib.Generated) -> async_lib.Generated:
    """Async PPO: the batch with the current critic's values (GAE's baseline and the value
    clip's anchor, as in the synchronous loop), scored on the training devices. The stale
    critic's values would anchor the clip where the critic no longer is: its clipped branch
    wins and the critic stops learning on those tokens. (experiments/plan_check compiles this
    pass, Scorer.lower_values: its `critic_values` program.)"""
    if not self.use_critic:
      return gen
    values = self._rescorer.values(self.cfg.critic_model, self._rescore_params("critic"),
                                   gen.scoring_batch())
    return dataclasses.replace(gen, values=np.asarray(values, np.float32))

  def _recompute_logp(self, iteration: int, gen: async_lib.Generated
                      ) -> tuple[async_lib.Generated, dict]:
    """algo.old_logp "recompute": the batch with the actor's log-probs from the training
    forward in place of the decode's (the ratio's denominator and the KL penalty's policy side:
    the first mini-batch's ratio is then 1 up to the update's own rounding), and the mean and
    largest gap between the two per response token (what the decode's log-probs would have
    put into the ratio before any update)."""
    t0 = time.perf_counter()
    inside = _response_mask(gen, self.cfg.rollout.max_new_tokens) > 0
    logp = self._actor_logprobs(iteration, gen, inside, self._old_logp_scorer,
                                "recomputed log-probs (algo.old_logp)")
    gap = np.abs(logp.astype(np.float64) - gen.logprobs)[inside]
    m = {"actor/old_logp_gap_mean": float(gap.mean()) if gap.size else 0.0,
         "actor/old_logp_gap_max": float(gap.max()) if gap.size else 0.0,
         "timing_s/old_logp": time.perf_counter() - t0}
    return dataclasses.replace(gen, logprobs=np.where(inside, logp, gen.logprobs)), m

  def _off_policy(self, iteration: int, gen: async_lib.Generated, data: dict
                  ) -> tuple[dict, dict]:
    """Async PPO: the batch's lag behind the current policy and, for the decoupled objective,
    its training data (trainer/async_ppo.py). One forward pass of the current actor (the
    proximal policy) gives both."""
    a = self.cfg.async_ppo
    mask = _response_mask(gen, self.cfg.rollout.max_new_tokens)  # [B, T] (data's is on device)
    prox = self._actor_logprobs(iteration, gen, mask > 0, self._rescorer,
                                "proximal log-probs (the current actor's)")
    weights, m = async_lib.behaviour_weights(prox, gen.logprobs, mask, a.behaviour_weight_cap)
    m["async/staleness"] = iteration - gen.version
    m["async/policy_version"] = gen.version
    if a.objective == "decoupled":  # weighted on the host (numpy's rounding, as before)
      data = async_lib.decoupled({**data, "advantages": mesh_lib.to_host(data["advantages"])},
                                 prox, weights)
    else:  # nothing is dropped: the weights only measure the lag
      m.pop("async/behaviour_dropped_frac")
    return data, m

  def _dispatch_training(self, iteration: int, data: dict, token_counts: np.ndarray) -> list:
    """algo.epochs passes of optimizer steps over token-balanced mini-batches, dispatched (jax
    runs them asynchronously); their metrics on device. The first call compiles, and waits."""
    cfg, t0 = self.cfg, time.time()
    shards = mesh_lib.batch_size_multiple(self.mesh) if cfg.algo.balance_tokens else 1
    train_metrics = []
    for epoch in range(cfg.algo.epochs):
      rng = np.random.default_rng([cfg.seed, iteration, epoch])
      for idx in mb_lib.minibatch_indices(len(token_counts), cfg.algo.minibatch_size, rng,
                                          token_counts=token_counts, num_data_shards=shards):
        mb = self._minibatch(data, idx)
        self.actor, self.critic, m = self.update(self.actor, self.critic, mb)
        train_metrics.append(m)
        if not self._compiled_update:
          jax.block_until_ready(m)
          self._compiled_update = True
          logging.info("training: update compiled and run once in %.1fs%s", time.time() - t0,
                       hooks.cache_note())
    return train_metrics

  def _minibatch(self, data: dict, idx: np.ndarray) -> dict:
    """Rows `idx` [m] of `data`, batch-sharded: device arrays gathered on the devices, all in
    one program; host arrays (the decoupled objective's) sliced and put."""
    on_device = {k: v for k, v in data.items() if isinstance(v, jax.Array)}
    mb = {k: self._put(v[idx]) for k, v in data.items() if k not in on_device}
    if on_device:
      key = tuple((k, v.ndim) for k, v in on_device.items())
      if key not in self._row_takers:
        self._row_takers[key] = jax.jit(_rows, out_shardings={
            k: mesh_lib.batch_sharding(self.mesh, n) for k, n in key})
      idx = mesh_lib.put(idx.astype(np.int32), mesh_lib.replicated(self.mesh))
      mb.update(self._row_takers[key](on_device, idx))
    return {k: mb[k] for k in data}  # data's order, as before

  def iteration(self, iteration: int) -> dict:
    """One iteration: synchronous (async_ppo.staleness = 0: generate, then train), or train on
    the batch generated earlier while the batch of iteration + staleness is generated."""
    cfg, t_step = self.cfg, time.time()
    k = cfg.async_ppo.staleness
    self.update.take_reshard_metrics()  # this iteration's gathers only
    self._weights_to_generation_s = 0.0
    t0 = time.time()
    if k == 0:
      with self._optimizer_offloaded():
        gen = self._generate(iteration, self._generation_params(), version=iteration)
      # The previous iteration's checkpoint was written while this one generated; a failed
      # save stops the run here, before training past what it can keep.
      self.checkpoints.wait()
    else:
      gen = self._current_values(self.in_flight.pop(iteration))
    self._check_rollout_finite(iteration, gen)
    async_m: dict = {}
    if self._recompute_old_logp:
      gen, async_m = self._recompute_logp(iteration, gen)
    data, stats = self._advantages(gen)
    if k:
      data, async_m = self._off_policy(iteration, gen, data)
    t_gen_inf = time.time() - t0
    if not self._compiled_update:  # this process's first iteration compiles as it goes: say so
      logging.info("iteration %d: generation + inference took %.1fs (first call: compiles "
                   "included); compiling the %s update ...", iteration + 1, t_gen_inf,
                   self.update.description)
    ahead = iteration + k  # async: the batch generated while this iteration trains
    # Its policy is the current one, copied before the update donates the state's buffers.
    snapshot = self._snapshot() if k and ahead < cfg.num_iterations else None
    t0 = time.time()
    token_counts = gen.prompt_lens + gen.response_lens
    t_dispatch = time.perf_counter()
    dispatched = self._dispatch_training(iteration, data, token_counts)
    overlapped = snapshot is not None
    if overlapped:
      clock = async_lib.TrainingClock((self.actor, self.critic, dispatched), t_dispatch)
      g0 = time.perf_counter()
      self.in_flight[ahead] = self._generate(ahead, snapshot, version=iteration)
      g1 = time.perf_counter()
      del snapshot
      self.checkpoints.wait()
      t_train = clock.join()
      async_m.update(async_lib.overlap_metrics((clock.start, clock.start + t_train), (g0, g1)))
      async_m["timing_s/generate_ahead"] = g1 - g0
    # One read for the updates' metrics and config.guard's per-model checks of their results,
    # dispatched first (one host round trip per iteration, not one per model and check).
    train_metrics, checks = mesh_lib.to_host(
        (dispatched, self._state_checks(iteration, len(dispatched))))
    if not overlapped:
      t_train = time.time() - t0
    if k and not overlapped:  # after the clock: the save's wait is not training time
      self.checkpoints.wait()
    self._check_finite(iteration, train_metrics, checks["finite"], gen.scores)
    m = self._metrics(iteration, gen, train_metrics, stats, checks)
    step = iteration + 1
    if cfg.log_samples and (step % cfg.log_every == 0 or step == cfg.num_iterations):
      self._samples = sample_rows(gen, self.tokenizer, cfg.log_samples, cfg.reward.kind)
    t_total = time.time() - t_step
    m.update(gen.metrics)
    m.update(async_m)
    m.update(self.update.take_reshard_metrics())  # pipelined: the weights gathered for stage 1-2
    if self.moves_weights or k:
      m["timing_s/weights_to_generation"] = self._weights_to_generation_s
    m.update(self._take_offload_metrics())
    # timing_s/gen_plus_inf: the loop's whole rollout phase (docs/architecture.md §1), replacing
    # the fused engine's own figure of that name (its generation and inference alone; with
    # async PPO this phase also holds the rescoring, not the generation of another iteration).
    m.update({"timing_s/train": t_train, "timing_s/gen_plus_inf": t_gen_inf,
              "timing_s/step": t_total, "perf/tokens_per_s": int(np.sum(token_counts)) / t_total,
              **self._train_flops_metrics(t_train, gen),
              "perf/response_tokens": int(np.sum(gen.response_lens))})
    return m

  def _truncated(self, gen: async_lib.Generated) -> np.ndarray:
    """[B] bool: responses the token budget cut off (full length and not ended by EOS; one that
    emits EOS as its last allowed token ended on its own)."""
    lens, max_new = gen.response_lens, self.cfg.rollout.max_new_tokens
    last = gen.response_tokens[np.arange(len(lens)), np.clip(lens - 1, 0, None)]
    return (lens >= max_new) & ~self.sampling.is_stop(last)

  def _state_checks(self, iteration: int, updates: int) -> dict:
    """On device, dispatched, not read, after the iteration's `updates` optimizer steps:
    {"finite": {model: every parameter finite}} and, under guard.on_nonfinite="skip_update",
    {"skipped": {model: optimizer steps skipped so far}}, else {"lr": _lrs(...)} (no step
    skipped: each model's LR is known before the read)."""
    states = self._model_states()
    out = {"finite": {name: _all_finite(st.params) for name, st in states.items()}}
    if self.cfg.guard.on_nonfinite == "skip_update":
      out["skipped"] = {name: update_lib.skipped_updates(st) for name, st in states.items()}
    else:
      out["lr"] = self._lrs(iteration, updates, {})
    return out

  def _lrs(self, iteration: int, updates: int, skipped: dict) -> dict:
    """{model: its LR at its last applied step} (on device: the schedule's value; `updates`
    optimizer steps an iteration, `skipped`: {model: steps skipped so far}, on the host). A
    skipped step does not advance its schedule."""
    out = {}
    for name, lr in (("actor", self.update.actor_lr),
                     ("critic", self.update.critic_lr if self.use_critic else None)):
      if lr is not None:
        applied = updates * (iteration + 1) - skipped.get(name, 0)
        out[name] = lr(max(applied - 1, 0))
    return out

  def _metrics(self, iteration: int, gen: async_lib.Generated, train_metrics: list[dict],
               stats: dict, checks: dict) -> dict:
    """The iteration's deterministic metrics (docs/architecture.md §1); `checks`: the host
    values of _state_checks() (its "skipped" and "lr" read here)."""
    # Means over the finite values: under guard.on_nonfinite="skip_update" a skipped step's
    # loss is NaN (None if every step of the iteration was skipped).
    m = {k: _finite_mean([t[k] for t in train_metrics]) for k in train_metrics[0]}
    m.update({k: float(v) for k, v in stats.items()})
    m.update(self.update.schedule_metrics)  # pipelined: the schedule's figures
    if not self.use_critic:
      m = {k: v for k, v in m.items() if not k.startswith("critic/")}
    scores, lens = gen.scores, gen.response_lens
    m.update({
        # The std in float64: a float32 square of a reward beyond 1.8e19 overflows (and numpy
        # warns) where the rollout check names the rewards' scale instead.
        "reward/mean": float(np.mean(scores)),
        "reward/std": float(np.std(np.asarray(scores, np.float64))),
        "response_length/mean": float(np.mean(lens)), "response_length/max": int(np.max(lens)),
        "response_length/clip_ratio": float(np.mean(self._truncated(gen))),
        # Per-sample lengths (JSONL only): the simulator's empirical length distribution.
        "gen/response_lengths": [int(x) for x in lens],
    })
    guard = self.cfg.guard.on_nonfinite
    skipped = {name: int(v) for name, v in checks.get("skipped", {}).items()}
    if skipped:
      m["guard/skipped_updates"] = sum(skipped.values())
    # Each model's LR at its last applied step; with skipped steps known only now, read here.
    lrs = checks.get("lr")
    if lrs is None:
      lrs = mesh_lib.to_host(self._lrs(iteration, len(train_metrics), skipped))
    m.update({f"{name}/lr": float(v) for name, v in lrs.items()})
    bad = [k for k, v in m.items() if isinstance(v, float) and not np.isfinite(v)]
    if guard == "stop" and bad:
      raise self._nonfinite(iteration, f"metric(s) {', '.join(bad)} = {[m[k] for k in bad]}",
                            scores=scores)
    return m

  def _check_finite(self, iteration: int, train_metrics: list[dict], finite: dict,
                    scores) -> None:
    """config.guard: losses and gradient norms of every update ("stop" only: skipped steps are
    NaN by design under "skip_update"), then the parameters themselves (both modes), with one
    on-device reduction per model (`finite`: their host values, _state_checks()["finite"]);
    `scores`: the batch's rewards (the error reads their scale)."""
    if self.cfg.guard.on_nonfinite == "stop":
      for i, m in enumerate(train_metrics):
        bad = {k: float(v) for k, v in m.items() if not np.all(np.isfinite(v))}
        if bad:
          raise self._nonfinite(iteration, f"update {i + 1}/{len(train_metrics)}: {bad}",
                                scores=scores)
    for name, ok in finite.items():
      if not bool(ok):
        raise self._nonfinite(iteration, f"{name} parameters hold NaN/Inf after its updates",
                              scores=scores)

  def _check_rollout_finite(self, iteration: int, gen: async_lib.Generated) -> None:
    """config.guard "stop": the rollout's rewards, and its log-probs and values inside the
    responses, before anything trains on them. A reward model's NaN (or an overflow in its
    forward) was found only as NaN losses, with advice to lower the learning rate; this names
    what is not finite and the first sample. ("skip_update" lets such a batch reach the update,
    whose steps it then skips.)"""
    if self.cfg.guard.on_nonfinite != "stop":
      return
    inside = _response_mask(gen, self.cfg.rollout.max_new_tokens) > 0
    reward = (f"the reward model ({self.cfg.reward.model_checkpoint})"
              if self.cfg.reward.kind == "model" else "the reward")
    parts = [("reward", gen.scores, np.ones(gen.scores.shape, bool), reward),
             ("behaviour log-probs", gen.logprobs, inside, "the actor (its sampling)")]
    if gen.ref_logp is not None:
      parts.append(("reference log-probs", gen.ref_logp, inside, "the reference model"))
    if self.use_critic:
      parts.append(("critic values", gen.values, inside, "the critic"))
    self._raise_if_nonfinite(iteration, parts)
    # Finite rewards too large to square: the critic's loss overflows, or the gradient norm of
    # an estimator that does not normalise (reward_square_limit): stop here, before any update.
    # Those config.reward.clip_range clamps are what trains.
    limit = reward_square_limit(len(gen.scores), self.cfg.rollout.max_new_tokens)
    trained = clipped_scores(gen.scores, self.cfg.reward.clip_bounds)[0]
    if np.any(np.abs(np.asarray(trained, np.float64)) > limit):
      raise self._nonfinite(iteration, "the rollout's rewards overflow float32 once squared, "
                            "before any update", scores=gen.scores)

  def _actor_logprobs(self, iteration: int, gen: async_lib.Generated, inside: np.ndarray,
                      scorer: scoring.Scorer, what: str) -> np.ndarray:
    """[B, T] float32 log-probs of the batch's responses under the current actor (async PPO's
    proximal policy, algo.old_logp's recomputation), by `scorer` on the training devices;
    with config.guard "stop", refused where not finite `inside` the responses (they weigh
    every token of the update), naming them `what`."""
    logp = np.asarray(scorer.logprobs(self.cfg.model, self._rescore_params("actor"),
                                      gen.scoring_batch(), self.cfg.rollout.temperature),
                      np.float32)
    if self.cfg.guard.on_nonfinite == "stop":
      self._raise_if_nonfinite(iteration, [(what, logp, inside,
                                            "the actor (its forward on the batch)")])
    return logp

  def _raise_if_nonfinite(self, iteration: int, parts: list) -> None:
    """parts: (what, values, where they count, what computed them: what the error says to
    check). Raises the guard's error naming each part that is not finite where it counts, with
    its count and first sample."""
    bad, sources = [], []
    for name, values, where, source in parts:
      wrong = ~np.isfinite(values) & where
      samples = np.flatnonzero(wrong.reshape(len(wrong), -1).any(axis=-1))
      if samples.size:
        b = int(samples[0])
        first = float(np.ravel(values[b])[np.ravel(wrong[b])][0])
        bad.append(f"{name} of {samples.size} of {len(wrong)} samples (first: sample {b}, "
                   f"{first})")
        sources.append(source)
    if bad:
      raise self._nonfinite(iteration, "the rollout's " + "; ".join(bad) + ", before any update",
                            rollout_source=", ".join(sources))

  def _nonfinite(self, iteration: int, what: str, rollout_source: Optional[str] = None,
                 scores=None) -> NonFiniteError:
    """The guard's error; `rollout_source`: the rollout itself was not finite (its source
    named), so the advice is to check the inputs, not to lower the learning rate; `scores`:
    the batch's rewards, named instead of the learning rate when their squares overflow: as
    config.reward.clip_range clamps them, what trains (rewards of 1e30 clamped to 10 were named
    as the cause of an update's NaN, and a clamp too wide to help was advised again)."""
    if scores is not None:
      scores = clipped_scores(scores, self.cfg.reward.clip_bounds)[0]
    last = self.checkpoints.latest_step()
    guard = self.cfg.guard
    # With no checkpoint a re-run starts over: skip_update needs no new --workdir then.
    new_workdir = ("" if last is None else
                   " (in a new --workdir: it changes the saved optimizer state)")
    advice = (f"set guard.on_nonfinite='skip_update' to skip such optimizer steps{new_workdir}"
              if guard.on_nonfinite != "skip_update" else
              f"raise guard.max_consecutive_skips={guard.max_consecutive_skips} (after that many "
              "skipped steps in a row the non-finite update is applied)")
    kept = (f"iteration {iteration + 1}: non-finite values: {what}. Nothing of this iteration "
            f"was written or saved; " + ("no checkpoint came before it" if last is None else
                                         f"the last checkpoint ({last}) is kept"))
    if rollout_source is not None:
      # Async PPO: the batch was generated an iteration or more ago, and a checkpoint saved
      # since holds it in flight (trainer/async_ppo.py), to be trained on again when resumed.
      replay = (" (async PPO: the last checkpoint may hold this batch in flight, and resuming "
                "it trains on the batch again)" if self.cfg.async_ppo.staleness else "")
      return NonFiniteError(
          f"{kept}{replay}. No update ran on it: check {rollout_source} and the models' dtypes "
          f"(model.dtype: a bfloat16 forward can overflow), or {advice}")
    limit = (reward_square_limit(len(scores), self.cfg.rollout.max_new_tokens)
             if scores is not None else 0.0)
    huge = (np.flatnonzero(np.abs(np.asarray(scores, np.float64)) > limit)
            if scores is not None else [])
    if len(huge):
      # Finite rewards whose squares overflow float32 (reward_square_limit): the advice to
      # lower the learning rate would not help.
      i = int(huge[0])
      clip = self.cfg.reward.clip_range
      bound = (f"narrow config.reward.clip_range={clip!r}" if clip else
               "bound it with config.reward.clip_range (e.g. '-10,10')")
      return NonFiniteError(
          f"{kept}. The batch's rewards{' (clamped by reward.clip_range)' if clip else ''} "
          f"are too large for float32 arithmetic: {len(huge)} of "
          f"{len(scores)} exceed {limit:.2g} in magnitude (first: sample {i}, "
          f"{float(scores[i]):.3g}), and their squares (the critic's loss, the gradient norm "
          f"of an estimator that does not normalise) overflow; scale the reward "
          f"(config.reward.function / reward.format_weight) into a smaller range, or {bound}, "
          f"rather than the learning rate")
    if last is None:  # nothing to resume: a re-run starts over, with any values
      return NonFiniteError(
          f"{kept}: re-run with a lower optim.actor_lr / optim.critic_lr or optim.grad_clip (it "
          f"starts over; no checkpoint.resume_changes needed), check the inputs, or {advice}")
    return NonFiniteError(
        f"{kept}, but resuming it with this config repeats the same steps. Lower optim.actor_lr / "
        f"optim.critic_lr or optim.grad_clip and resume naming them in "
        f"config.checkpoint.resume_changes (e.g. 'optim.actor_lr'), check the inputs, or "
        f"{advice}")

  def _train_flops_metrics(self, t_train: float, gen: async_lib.Generated) -> dict:
    """The update's model FLOPs per second, counted at each sample's own prompt and response
    lengths (perf/accounting.py: the useful work; the program runs every row at the padded
    max_prompt_len + max_new_tokens, so padding shows as a lower rate, never a higher one),
    the useful share of the padded count, and MFU where the device's bf16 peak is known and
    the model computes in a 16-bit type (a float32 model's matmuls have another peak)."""
    cfg = self.cfg
    critic = cfg.critic_model if self.use_critic else None
    useful = cfg.algo.epochs * float(np.sum(accounting.ppo_update_flops(
        cfg.model, critic, 1, gen.prompt_lens.astype(np.float64),
        gen.response_lens.astype(np.float64))))
    max_new = cfg.rollout.max_new_tokens
    padded = cfg.algo.epochs * accounting.ppo_update_flops(
        cfg.model, critic, len(gen.response_lens), gen.tokens.shape[1] - max_new, max_new)
    out = {"perf/train_flops_per_s": useful / t_train, "perf/train_useful_frac": useful / padded}
    hw = hardware.hardware_for_device_kind(self.mesh.devices.flat[0].device_kind)
    if hw is not None and cfg.model.dtype == "bfloat16":  # (float16 training is refused)
      out["perf/mfu"] = useful / t_train / (hw.peak_flops * self.mesh.devices.size)
    return out

  # ---------------------------------------------------------------- the loop
  def run(self, stop_after: Optional[int] = None, keep_lock: bool = False,
          config_record: Optional[Any] = None, keep_history: bool = True) -> list[dict]:
    """Runs (or resumes) to cfg.num_iterations; returns this call's per-iteration metrics
    (keep_history=False: an empty list, and none kept in memory: a row is 2-4 kB with the
    per-sample lengths, 200-400 MB over 100k iterations; metrics.jsonl has them all).

    config_record: when this start trains, recorded as workdir.write_config_history names it,
    by the iteration it really starts at (an older checkpoint than resume_step when the newest
    cannot be restored).

    stop_after: stop early after this iteration as a SIGTERM would (save, return); used to test
    that an interrupted run resumes exactly. keep_lock: hold the workdir lock after returning,
    until release_lock() (a caller that still writes into the workdir: train_ppo's result.json,
    which another start in between could race on metrics.jsonl); released on an error anyway.

    Once per trainer: its resume point, workdir lock and prompt stream belong to that one run
    (a second call would restore the old resume point over the trained state and rewrite
    metrics.jsonl). To continue, build a new PPOTrainer on the workdir: it resumes.
    """
    if self._ran:
      raise RuntimeError("PPOTrainer.run() was already called on this trainer; build a new "
                         f"PPOTrainer(cfg, {self.workdir!r}) to resume from its checkpoints")
    self._ran = True
    try:
      hooks.agree_setup_signal()  # set-up points every process reaches: a signal stops all
      start = self.finished_at if self.finished_at is not None else self._restore()
      self.checkpoints.trim()  # (one a kill left beyond checkpoint.keep: older than `start`)
      # The iteration the run's state is at: its result's (metrics.jsonl may lack rows).
      self.trained_to = self._stepped_to = self._start = start
      self._earlier_starts = self._starts_before(start)
      hooks.agree_setup_signal()  # (before anything is written for this start)
      if (config_record is not None and start < self.cfg.num_iterations and
          jax.process_index() == 0):
        with hooks.writing(os.path.join(self.workdir, "config.json")):  # (a full disk: exit 3)
          wd.write_config_history(self.workdir, config_record, start)
      if self.export_only and start < self.cfg.num_iterations:
        logging.warning("the newest checkpoint could not be restored: training iterations "
                        "%d-%d again from checkpoint %d, then exporting", start + 1,
                        self.cfg.num_iterations, start)
      if start >= self.cfg.num_iterations:
        # Rows after the checkpoint (an extension that died before its next save) belong to
        # no kept state: dropped, as every other start does (hooks.MetricsLog.begin and
        # SamplesLog.begin), from metrics.jsonl, samples.jsonl and from TensorBoard (a purge
        # marker, written only when such rows exist: a finished run re-run leaves tb/ as it
        # was).
        main = jax.process_index() == 0
        later = main and any(  # (a step that is no number: truncate_after names its row)
            isinstance(r.get("step"), (int, float)) and r["step"] > start
            for r in wd.read_jsonl(os.path.join(self.workdir, "metrics.jsonl")))
        # (a full disk: exit 3 naming the file, as at MetricsLog.begin; TensorBoard's names none)
        with hooks.writing(os.path.join(self.workdir, "tb")):
          writer = metrics_lib.MetricWriter(self.workdir, tensorboard=later, enabled=main,
                                            purge_step=start + 1)
          try:
            hooks.warn_missing_rows(writer.path, writer.truncate_after(start), start)
          finally:
            writer.close()
        hooks.SamplesLog(self.workdir, lambda: None).begin(start)  # its rows after `start`
        if self.export_only:
          hf_export.HFExport(self.workdir, self.cfg, lambda: self.model_params("actor"),
                             self.tokenizer, self.checkpoints.inputs).export(start)
        logging.info("workdir already has %d iterations (num_iterations=%d): nothing to train%s",
                     start, self.cfg.num_iterations,
                     "; its checkpoints and metrics stay at iteration %d (a shorter run of this "
                     "config needs a new --workdir)" % start
                     if start > self.cfg.num_iterations else "")
        out = []
      else:
        out = self._loop(start, stop_after, keep_history)
    except BaseException as e:
      if isinstance(e, checkpointing.SaveError):  # a failed save, or write of the metrics
        # A save into a workdir moved away fails with orbax's long NOT_FOUND: say why, first.
        # (a LogWriteError names its file: a metrics row, config.json, the export, ...)
        moved = self._moved("writing one of its records failed"
                            if isinstance(e, hooks.LogWriteError)
                            else "the checkpoint save in progress failed")
        e.args = (f"{moved}. ({e})",) if moved else (f"{e}{self.kept_after_failed_write()}",)
      elif isinstance(e, (hf_export.ExportInputError, wd.ReadError)):
        # (the run's tokenizer gone since; metrics.jsonl unreadable where a start drops its
        # rows after the checkpoint: read before anything is written, so nothing is lost)
        e.args = (f"{e}{self.kept_after_failed_write()}",)
      self.release_lock()
      raise
    if not keep_lock:
      self.release_lock()
    return out

  def kept_after_failed_write(self) -> str:
    """What a run stopped by a failed write (a checkpoint save, a metrics row, config.json, the
    HF export, train_ppo's result.json: SaveError) keeps, said after its error: the end hooks
    have waited for the save before it, so the newest finished checkpoint is the one the same
    command resumes from; a finished run's re-run trains nothing and writes result.json and
    the export (export_pending) again."""
    try:
      latest = self.checkpoints.checkpointer.latest_step()
    except Exception:  # noqa: BLE001 (the checkpoints directory itself unreadable: say nothing)
      return ""
    if latest is None:
      return ("; no checkpoint was saved yet: once the cause is fixed, the same command starts "
              "the run over")
    if latest >= self.cfg.num_iterations:
      return (f"; the run is finished and nothing of it is lost: checkpoint {latest} and the "
              "metrics through it are intact, and the same command, re-run once the cause is "
              "fixed, trains nothing and writes result.json and the HF export (where asked) "
              "again")
    return (f"; nothing saved before is lost: checkpoint {latest} and the metrics through it are "
            "intact, and the same command resumes from it once the cause is fixed")

  def _take_samples(self) -> Optional[list]:
    samples, self._samples = self._samples, None
    return samples

  def _check_lock(self, step: int) -> None:
    """Stops every process before iteration `step` writes anything when the workdir's lock file
    is no longer this run's (wd.WorkdirLock.held; process 0 holds it, all agree)."""
    lost = self._lock is not None and not self._lock.held()
    if distributed.max_over_processes(int(lost)):
      moved = self._moved(f"stopping before iteration {step} writes its metrics or checkpoint")
      if moved:
        raise wd.WorkdirInUseError(moved)
      raise wd.WorkdirInUseError(
          f"{os.path.join(self.workdir, '.lock')} was deleted or replaced while this run held it "
          f"(it is the live run's lock, not a stale pid file): another start may be writing in "
          f"{self.workdir} now; stopping before iteration {step} writes its metrics or "
          f"checkpoint. Check what else runs there; this run's checkpoints so far are kept")

  def _moved(self, doing: str) -> Optional[str]:
    """What to tell the user when the workdir was moved (or deleted) while this run held it
    (its lock is gone from the workdir's path and the workdir with it, or the lock file's
    /proc entry is elsewhere); `doing`: what the run does about it. None: not moved. A process
    without the lock (not process 0, which holds it) sees only that the workdir is gone."""
    if self._lock is not None and self._lock.held():
      return None
    moved = self._lock.moved_to() if self._lock is not None else None
    if not moved and os.path.isdir(self.workdir):
      return None  # only .lock was deleted or replaced
    where = ("" if self._lock is not None or jax.process_index() == 0 else
             " (process 0's log names where)")
    return (f"the workdir {self.workdir} was " +
            (f"moved to {moved}" if moved else "moved, renamed or deleted") +
            f"{where} while this run wrote in it: {doing}. Its checkpoints so far went with it: "
            f"resume with --workdir={moved or '<its new path>'} (the iterations after its last "
            "checkpoint run again); to move a run, stop it first (Ctrl-C saves)")

  def release_lock(self) -> None:
    """Releases the workdir lock (idempotent; run() does it unless keep_lock)."""
    if self._lock is not None:
      self._lock.release()
      self._lock = None

  def _fill_in_flight(self, start: int) -> None:
    """Async PPO: the batches of iterations start .. start + staleness - 1 that no checkpoint
    brought, generated now by the current policy (at start 0, the initial one: versions
    max(0, i - staleness) = 0)."""
    k, n = self.cfg.async_ppo.staleness, self.cfg.num_iterations
    missing = [j for j in range(start, min(start + k, n)) if j not in self.in_flight]
    if not missing:
      return
    if start > 0:
      logging.warning(
          "resuming at iteration %d: the checkpoint holds no batch in flight for iteration(s) "
          "%s (it ended the run at a smaller num_iterations); generating them with the restored "
          "policy, so from here the run differs from one that had this num_iterations from the "
          "start", start + 1, [j + 1 for j in missing])  # 1-based, as every line of the log
    logging.info("async PPO: generating the first %d batch(es) before training (staleness %d)",
                 len(missing), k)
    params = self._generation_params()
    for j in missing:
      self.in_flight[j] = self._generate(j, params, version=start)

  def _loop(self, start: int, stop_after: Optional[int], keep_history: bool) -> list[dict]:
    stop = hooks.StopFlag()
    # The watchdog first: it guards the others' begin (a collective) and, ending last, the last
    # save's wait.
    run_hooks = [hooks.HangWatchdog(self.cfg.guard.iteration_timeout_s,
                                   self.cfg.num_iterations), stop,
                 hooks.MetricsLog(self.workdir, self.cfg, rollout_lib.progress_summary,
                                  self._built_at),
                 hooks.SamplesLog(self.workdir, self._take_samples),
                 self.checkpoints,
                 hf_export.HFExport(self.workdir, self.cfg, lambda: self.model_params("actor"),
                                    self.tokenizer, self.checkpoints.inputs)]
    history, failing = [], True
    try:
      hooks.run_hooks(run_hooks, "begin", start)
      self._fill_in_flight(start)
      for it in range(start, self.cfg.num_iterations):
        m = self.iteration(it)
        step = self._stepped_to = it + 1
        if self.held_out is not None and (step % self.cfg.eval_every == 0 or
                                          step == self.cfg.num_iterations):
          # The weights moved to the generation group once for the whole pass.
          params = self._snapshot() if self.disjoint else self._generation_params()
          with self._optimizer_offloaded():
            try:
              m.update(self.held_out(self.rollout, params, it))
            except rewards_lib.RewardFunctionError as e:
              self._reward_failed(
                  e, f"iteration {step}, the validation pass on the held-out prompts",
                  " (or with --config.eval_every=0, which a resume may change: the held-out "
                  "pass off)")
              raise
          if self.cfg.optim.offload_during_rollout:  # the pass's moves join the step's time
            m["timing_s/optimizer_offload"] += self._take_offload_metrics()[
                "timing_s/optimizer_offload"]
        if keep_history:
          history.append({"step": step, **m})
        self._check_lock(step)
        stopping = stop.agreed() or step == stop_after
        hooks.run_hooks(run_hooks, "after", step, m, stopping)
        self.trained_to = step
        if stopping:
          # A signal during the last iteration stops nothing: the run is complete.
          self.stopped_by_signal = stop.signal if step < self.cfg.num_iterations else None
          logging.warning("stopped after iteration %d; re-run the same command to resume", step)
          break
      failing = False
    finally:
      stop.ending = True
      hooks.run_hooks(run_hooks, "end", failing)
    return history
