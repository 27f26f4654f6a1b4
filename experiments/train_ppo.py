r"""PPO / GRPO training binary.

  python -m experiments.train_ppo --config=configs/ppo_tiny.py --workdir=/tmp/ppo_tiny

Writes into the workdir: config.json (the config of the first start as given, before a plan
file or a checkpoint's config.json fills in fields; a start that
resumes at iteration k adds config.k.json), metrics.jsonl (one object per iteration), with
config.log_samples samples.jsonl (the batch's first samples as text), tb/
(TensorBoard events), checkpoints/ (orbax; the latest is resumed automatically, so re-running
with a larger --config.num_iterations continues the run, past the first start's horizon on the
LR schedule's floor unless optim.schedule_iterations is raised with it), result.json
(final summary), cache/ (searched pipeline schedules, and jax's compilation cache in
cache/xla: config.compilation_cache_dir) and, with checkpoint.export_hf, hf_export/ (the final
actor as a Hugging Face checkpoint). A resume whose config differs in a field that changes the
run is refused, listing the fields. One run per workdir (a lock names the holder).

Exit status: 0 done; 75 stopped by SIGTERM/SIGINT after saving a checkpoint (re-run to resume);
1 an error (the message names the field, file or iteration); 3 writing the run's progress failed
(a checkpoint save, a row of metrics.jsonl or samples.jsonl, config.json, result.json, the HF
export; e.g. a full disk); 69 the run cannot go on, nothing saved since the last checkpoint
(re-run to resume): a collective lost another process of a multi-process run, or an iteration
outlasted guard.iteration_timeout_s (docs/usage.md); 130 a second Ctrl-C stopped it without
saving (re-run to resume from the last checkpoint).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import statistics
import sys
from typing import Any, Collection

import jax
from absl import flags, logging
from ml_collections import config_flags

from experiments import config_files
from experiments import runner
from rlhfuse_jax import checkpointing
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.generation import multihost
from rlhfuse_jax.parallel import distributed
from rlhfuse_jax.trainer import build
from rlhfuse_jax.trainer import config as config_lib
from rlhfuse_jax.trainer import plan_file as plan_file_lib
from rlhfuse_jax.trainer import hf_export, hooks
from rlhfuse_jax.trainer.config import TrainConfig
from rlhfuse_jax.trainer.loop import EXIT_STOPPED_BY_SIGNAL, PPOTrainer, TIMING_PREFIXES

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd process

EXIT_SAVE_FAILED = checkpointing.EXIT_SAVE_FAILED  # a save, or another record (LogWriteError)

# What result.json's trained_by (and each checkpoint) keeps of the start that trained each
# span of iterations: provenance() is the last start's alone, and a finished run re-run (or
# resumed at another commit) relabelled iterations another commit had trained.
TRAINED_BY_FIELDS = ("started", "git_commit", "git_changes", "command", "host", "host_cpu",
                     "jax", "platform", "device_kind", "num_devices", "num_processes")

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and results.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize (multi-host; see launch/).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", "",
                                   "host:port of process 0; empty: auto-detect (SLURM, TPU).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "0: auto-detect.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
flags.mark_flags_as_required(["config", "workdir"])
distributed.check_start_flags()


def _median(values: list) -> float | None:
  """statistics.median of the values that are not None; None when there are none."""
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def _finite_mean(values: list) -> float | None:
  """The mean of the values that are finite numbers (a non-finite metric is null in
  metrics.jsonl); None when there are none."""
  values = [v for v in values if v is not None and math.isfinite(v)]
  return sum(values) / len(values) if values else None


def summarize(history: list[dict], num_iterations: int,
              trained_to: int | None = None, first_of_start: Collection[int] = (1,)) -> dict:
  """Whether the run is done or stopped early (a signal: re-run to resume), reward of the first
  and last 10% of iterations (the mean of their finite rewards: an iteration whose reward was
  NaN, its updates skipped under guard.on_nonfinite='skip_update', is left out and counted in
  reward_nonfinite_iterations), the throughput (median over the iterations of timing_s/step and
  perf/tokens_per_s, without the iterations in `first_of_start`, each start's first, which
  compiles, unless nothing else is left: a median of the few iterations of a short run took
  them in and halved its tokens/s; a sweep's summary puts them beside the reward, where
  wall_s, compiles included, was the only time) and the final iteration's scalar metrics (its
  timings and per-sample lists are in metrics.jsonl).

  `trained_to`: the iteration the run's state is at (its checkpoint), which gives the status
  and the iteration count; metrics.jsonl may lack rows (a torn or removed line), counted in
  metrics_missing_iterations. None: the last row's step."""
  step = history[-1]["step"] if history else 0
  if trained_to is None:
    trained_to = step
  rows = {h.get("step") for h in history}
  missing = sum(1 for i in range(1, trained_to + 1) if i not in rows)
  status = {"status": "done" if trained_to >= num_iterations else "stopped",
            "iterations": trained_to, "num_iterations": num_iterations,
            **({"metrics_missing_iterations": missing} if missing else {})}
  if not history:
    return status
  k = max(1, len(history) // 10)
  first = _finite_mean([h.get("reward/mean") for h in history[:k]])
  last = _finite_mean([h.get("reward/mean") for h in history[-k:]])
  nonfinite = sum(1 for h in history if _finite_mean([h.get("reward/mean")]) is None)
  timed = [h for h in history if h.get("step") not in first_of_start] or history
  return {**status, "reward_first_10pct": first,
          "reward_last_10pct": last,
          "reward_gain": None if first is None or last is None else last - first,
          **({"reward_nonfinite_iterations": nonfinite} if nonfinite else {}),
          "median_step_s": _median([h.get("timing_s/step") for h in timed]),
          "median_tokens_per_s": _median([h.get("perf/tokens_per_s") for h in timed]),
          "final": {k: v for k, v in history[-1].items()
                    if not k.startswith(TIMING_PREFIXES) and not isinstance(v, list)}}


def closing_line(result: dict, path: str) -> str:
  """The run's last log line: done or where it stopped, result.json's path and its headline
  figures (the reward over the first and last 10 % of iterations, the median step time and
  tokens/s), so a run's outcome reads without opening the file."""
  head = ("done" if result["status"] == "done" else
          f"stopped at iteration {result['iterations']} of {result['num_iterations']}")
  said = []
  first, last = result.get("reward_first_10pct"), result.get("reward_last_10pct")
  if first is not None and last is not None:
    said.append(f"reward/mean {first:.4g} -> {last:.4g} (first -> last 10 % of iterations)")
  step, tps = result.get("median_step_s"), result.get("median_tokens_per_s")
  if step is not None and tps is not None:
    said.append(f"median {step:.3g} s and {tps:.4g} tokens/s an iteration")
  return f"{head}: {path}" + (f" ({'; '.join(said)})" if said else "")


# What summarize reads of a row other than the last (which gives result.json's `final` whole).
SUMMARY_FIELDS = ("step", "reward/mean", "timing_s/step", "perf/tokens_per_s")


def read_history(path: str) -> list[dict]:
  """metrics.jsonl's rows for summarize: each but the last cut to SUMMARY_FIELDS as it is read.
  Whole, a row with its per-sample lists is ~8 KiB as Python objects (2.5 kB in the file, the
  tiny fused run): ~1 GB read at the end of a 100k-iteration run, on top of the trainer's."""
  rows: list[dict] = []
  for row in wd.iter_jsonl(path):
    if rows:
      rows[-1] = {k: rows[-1][k] for k in SUMMARY_FIELDS if k in rows[-1]}
    rows.append(row)
  return rows


def _resolves(mesh: Any, num_devices: int) -> bool:
  """Whether config.mesh splits `num_devices` devices."""
  try:
    mesh.resolve(num_devices)
  except ValueError:
    return False
  return True


def check_device_count(cfg: TrainConfig, num_devices: int, platform: str,
                       processes: int = 1) -> None:
  """A clear error when the mesh (and an asynchronous run's generation group) needs more devices
  than jax sees (e.g. mesh.stage=4 on the one CPU device a plain `python` gets), naming a plan
  file that set them (a plan searched for more devices than this run has)."""
  sizes = dataclasses.asdict(cfg.mesh)
  gen = cfg.async_ppo.generation_devices
  need = cfg.min_devices
  planned = plan_file_lib.plan_devices(plan_file_lib.load_plan_file(cfg.plan.file)) if (
      cfg.plan.file) else None
  if cfg.plan.file:  # a config's own fsdp that outgrows both the plan's and this run's devices
    why = plan_file_lib.plan_fsdp_error(sizes, cfg.plan.file, num_devices - gen)
    if why:
      raise ValueError(why)
  if need > num_devices:
    what = f"config.mesh={sizes}" + (f" + config.async_ppo.generation_devices={gen}" if gen
                                     else "")
    if cfg.plan.file:
      what += f" (set by config.plan.file={cfg.plan.file!r}" + (
          f", a plan searched for {planned} devices" if planned else "") + ")"
    hint = ""
    want = max(need, planned or 0)  # a plan's own count: fewer run it on another layout
    if platform == "cpu" and processes > 1:  # the launcher sets each process's count
      hint = (f"; {processes} processes need at least {-(-want // processes)} CPU devices each "
              f"(launch/local_multiprocess.sh N D: D)")
    elif platform == "cpu":
      hint = (f"; on a CPU host add fake devices before jax starts: "
              f"XLA_FLAGS=--xla_force_host_platform_device_count={want}")
      if -1 in sizes.values() and not gen and not planned:  # (ppo_tiny:fused runs on 8)
        axis = next(k for k, v in sizes.items() if v == -1)
        hint += (f", or a multiple of it (mesh.{axis}=-1 takes what the other axes leave: "
                 f"{2 * need} devices give it 2)")
    raise ValueError(f"{what} needs at least {need} devices, but jax sees {num_devices} "
                     f"({platform}){hint}")
  fitting = ""
  if gen:  # the values of generation_devices this run could take instead, for the errors below
    # (also dividing the rollout batch, which validate checks next: a value this suggested was
    # refused there)
    batch = cfg.rollout.batch_size
    fits = [g for g in range(processes, num_devices, processes)
            if _resolves(cfg.mesh, num_devices - g) and batch % g == 0]
    each = f", multiples of the {processes} processes" if processes > 1 else ""
    fitting = (f"; values of generation_devices whose training group (of {num_devices} "
               f"devices) config.mesh splits and that divide the rollout batch of {batch}"
               f"{each}: {fits}" if fits else
               f"; no generation_devices leaves a training group (of {num_devices} devices) "
               f"that config.mesh splits and divides the rollout batch of {batch}: change "
               "config.mesh, or set 0")
  if gen and gen % processes:  # (split_devices refuses it too, after the compiles of set-up)
    raise ValueError(f"config.async_ppo.generation_devices={gen}: expected a multiple of the "
                     f"{processes} processes (each gives g / {processes} of its own "
                     f"devices){fitting}")
  try:  # the axes' product, before the workdir is made (a bad value leaves none behind)
    cfg.mesh.resolve(num_devices - gen)
  except ValueError as e:
    # A plan file sets mesh.tensor and mesh.stage (and the split): the user never wrote them.
    raise ValueError(f"config.{e}" + (f" (the training group: the devices left by config."
                                      f"async_ppo.generation_devices={gen}{fitting})"
                                      if gen else "")
                     + (f" (its tensor and stage set by config.plan.file={cfg.plan.file!r}" + (
                         f", a plan searched for {planned} devices" if planned else "") + ")"
                        if cfg.plan.file else "")) from None
  if planned and planned != num_devices:  # it runs, but not as the search timed and sized it
    logging.warning("config.plan.file=%r was searched for %d devices and this run has %d: its "
                    "predicted times and memory check are for %d (plan_search --config."
                    "num_devices=%d searches for this run's)", cfg.plan.file, planned,
                    num_devices, planned, num_devices)


def check_same_run_everywhere(config: Any) -> None:
  """A ValueError on every process unless all run the same config (the ConfigDict after the
  command line's overrides) from the same git commit: each process computes "its" share of
  one global batch from the config and the code, so two processes with another seed (or a
  worker of a TPU pod on another checkout) trained side by side on different batches, each
  logging its own rewards, without an error."""
  as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  as_json = json.dumps(as_dict, sort_keys=True, default=str)
  code = runner.start_code()  # the commit, and the uncommitted changes' hash
  try:
    distributed.check_same_over_processes(
        tuple(distributed.checksum(x) for x in (as_json, code)),
        "the run (a checksum of the config as given, one of the git commit and uncommitted "
        "changes)",
        f": every process must run the same command (config file and --config.* flags) on the "
        f"same checkout; this process ran {runner.command_line()} at commit {code}")
  except ValueError as e:  # on every process alike: each names its own values of the fields
    raise ValueError(f"{e}{distributed.differing_fields(_flat(as_dict))}") from None


def _flat(tree: dict, prefix: str = "") -> dict:
  """A nested config dict as {"section.field": value}."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def check_own_workdir(workdir: str) -> None:
  """A ValueError when `workdir` holds another binary's outputs (its result.json's provenance
  names experiments.<other>): the run moved that binary's config.json and result.json to
  previous/<n> and trained beside the rest of them (a schedule_search's schedule.json and
  gantt.png). The one-shot binaries refuse a training workdir the same way. A model's
  directory (its config.json: a Hugging Face checkpoint, maybe the run's own) is refused too,
  before the run writes anything there (wd.refuse_foreign_configs)."""
  wd.refuse_foreign_result(workdir, "train_ppo", shown="train_ppo")
  wd.refuse_foreign_configs(workdir)


def check_compilation_cache_dir(setting: str) -> None:
  """A ValueError naming config.compilation_cache_dir when jax cannot write its cache there (a
  file, a path under a file, a read-only place): jax warned at every compile ("Error reading
  persistent compilation cache entry ... File exists") and the run went on without a cache. A
  cache the caller set (JAX_COMPILATION_CACHE_DIR) wins, and then the setting is not read."""
  if setting in ("", "none") or jax.config.jax_compilation_cache_dir:
    return
  why = config_files.unwritable(setting)
  if why:
    raise ValueError(f"config.compilation_cache_dir={setting!r}: {why}; expected a directory "
                     "this process can create and write, '' (WORKDIR/cache/xla) or 'none'")


def _start_and_train(run_log: runner.RunLog) -> tuple[TrainConfig, PPOTrainer]:
  """Joins the processes of a multi-host run, checks the config and the devices, and runs the
  trainer (which keeps the workdir lock until the caller has written result.json); the run's
  log goes into the workdir once the lock is held."""
  if _DISTRIBUTED.value:
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    check_same_run_everywhere(_CONFIG.value)
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  cfg = TrainConfig.from_config_dict(_CONFIG.value, given=overrides)
  check_device_count(cfg, jax.device_count(), jax.default_backend(), jax.process_count())
  build.check_reward_functions(cfg)  # an unknown or ill-fitting one: before the workdir is made
  build.check_shape_overrides(cfg, overrides)
  check_compilation_cache_dir(cfg.compilation_cache_dir)
  workdir = _WORKDIR.value
  wd.check_local_path(workdir)
  check_own_workdir(workdir)
  os.makedirs(workdir, exist_ok=True)
  hooks.enable_compilation_cache(cfg.compilation_cache_dir, workdir)  # before anything compiles
  try:
    # Checks the lock and any checkpoint against this config; the log goes into the workdir
    # once it is this run's (a refused resume's error is in it too). Inside the try: set-up
    # runs collectives too (fused generation's first exchange, Exchange.warm_up, waits for
    # every process's compiles), and a peer lost there exited 1 or, on process 0, was aborted
    # by jax (134) during its grace before exiting, where the same loss mid-run exits 69.
    trainer = PPOTrainer(cfg, workdir, given=overrides, on_locked=lambda: logging.info(
        "log: %s", run_log.keep_in(workdir, jax.process_index()) or run_log.where))
    # The lock stays held while result.json is written: another start on this workdir in
    # between could change metrics.jsonl while it is summarised.
    # result.json is summarised from metrics.jsonl: no per-iteration rows kept in memory
    # This start's code and machine, kept with the iterations it trains (trained_by).
    trainer.start_record = {k: v for k, v in runner.provenance().items()
                            if k in TRAINED_BY_FIELDS}
    trainer.started_at = runner.start_time() or trainer.started_at  # (set-up and imports too)
    trainer.run(keep_lock=True, config_record=config_lib.config_record(_CONFIG.value, cfg),
                keep_history=False)
  except (checkpointing.SaveError, multihost.PeerLostError) as e:
    # A failed save: orbax's threads would hold the process for minutes. A peer lost in fused
    # generation's exchange: the watchdog's status (a hung peer) for a dead one too, and no wait
    # at exit for a process that will not come. Stop now.
    logging.error("%s", e)
    config_files.exit_now(EXIT_SAVE_FAILED if isinstance(e, checkpointing.SaveError)
                          else multihost.EXIT_PEER_LOST)
  except (jax.errors.JaxRuntimeError, ValueError) as e:
    multihost.exit_if_peer_lost(e)  # a training collective whose peer died: 69, at once
    raise
  return cfg, trainer


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  run_log = runner.RunLog()
  try:
    _main(run_log)
  except SystemExit:
    raise
  except KeyboardInterrupt:  # a second Ctrl-C (or one once the loop has ended): stop now
    # A third Ctrl-C (a user pressing it repeatedly) would interrupt this exit's own logging,
    # with a traceback in place of the one line below: the process is ending, ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_log.exception("the run ended with KeyboardInterrupt")
    logging.error("interrupted by Ctrl-C (a second one, or one after the last iteration): "
                  "stopped at once without saving what was in progress; the checkpoints saved "
                  "before are intact (an unfinished save is cleared on the next start): re-run "
                  "to resume from the latest, or to write result.json (traceback: %s)",
                  os.path.join(_WORKDIR.value, "log.txt"))
    run_log.close()
    # Now, not through the interpreter's shutdown: there an async checkpoint save still in
    # flight failed in orbax's threads with ~80 lines of "cannot schedule new futures after
    # shutdown". Its temporary directory is cleared on the next start; metrics.jsonl has
    # every finished iteration (written as each ends).
    config_files.exit_now(EXIT_INTERRUPTED)
  except BaseException as e:  # into WORKDIR/log.txt too; stderr gets Python's print
    run_log.exception(f"the run ended with {type(e).__name__}: {e}")
    raise
  finally:
    run_log.close()


def _main(run_log: runner.RunLog) -> None:
  try:
    # Until the loop installs its own handlers, SIGTERM (a preemption while a large model loads
    # or compiles) and Ctrl-C end the start with the stopped status too, not 143.
    with hooks.stop_before_training():
      cfg, trainer = _start_and_train(run_log)
  except hooks.StoppedBeforeTraining as e:
    logging.warning("exit %d: signal %d came before training began (set-up, checkpoint restore "
                    "or the first compiles); no iteration ran since the last checkpoint, so "
                    "nothing is lost; re-run to resume", EXIT_STOPPED_BY_SIGNAL, e.signum)
    # The others did not stop with it: jax's exit barrier would wait for them. One process
    # alone: Python's shutdown, with a compile or restore cut short in XLA's threads, ended
    # in a segmentation fault (status 139, read as a crash) in 6 of 15 SIGTERMs in set-up.
    if e.alone or jax.process_count() == 1:
      config_files.exit_now(EXIT_STOPPED_BY_SIGNAL)
    sys.exit(EXIT_STOPPED_BY_SIGNAL)
  workdir = _WORKDIR.value
  main_process = distributed.is_main_process()
  if main_process:
    # The summary covers the whole run (also iterations done before a resume).
    history = read_history(os.path.join(workdir, "metrics.jsonl"))
    result = summarize(history, cfg.num_iterations, trainer.trained_to,
                       {k + 1 for k in hooks.start_points(workdir)})
    result["trained_by"] = trainer.trained_by()
    export = os.path.join(workdir, hf_export.HF_EXPORT_DIR)
    if cfg.checkpoint.export_hf and os.path.isdir(export):
      result["hf_export"] = export
    try:
      with hooks.writing(os.path.join(workdir, "result.json")):
        runner.write_result(workdir, result)
    except hooks.LogWriteError as e:  # a full disk: exit 3 in one line, as a failed save
      trainer.release_lock()
      logging.error("%s%s", e, trainer.kept_after_failed_write())
      sys.exit(EXIT_SAVE_FAILED)
    runner.clear_earlier_traceback(workdir)
    logging.info("%s", closing_line(result, os.path.join(workdir, "result.json")))
  trainer.release_lock()
  if trainer.stopped_by_signal is not None:
    logging.warning("exit %d: stopped by signal %d after saving; re-run to resume",
                    EXIT_STOPPED_BY_SIGNAL, trainer.stopped_by_signal)
    sys.exit(EXIT_STOPPED_BY_SIGNAL)


if __name__ == "__main__":
  config_files.run(main)
