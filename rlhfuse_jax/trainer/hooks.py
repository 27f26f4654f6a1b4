"""What `PPOTrainer.run` does around its iterations, as hooks: the stop flag (SIGTERM/SIGINT),
the checkpoints (resume, fallback, save) and the metrics log (docs/usage.md "Faults and
resuming"); the Hugging Face export after the last iteration (checkpoint.export_hf) is
trainer/hf_export.py's HFExport.

A hook has `begin(start)`, `after(step, metrics, stopping)` and `end(failing)`; run() calls
them in order around each iteration, and `end` in a finally clause (`failing`: an exception is
on its way out). The checkpoint hook also answers
the questions asked before anything is built: where to resume, and whether this config may.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import signal
import threading
import time
from typing import Any, Callable, Mapping, Optional

import jax
from absl import logging

from rlhfuse_jax import checkpointing
from rlhfuse_jax import metrics as metrics_lib
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.generation import multihost
from rlhfuse_jax.parallel import distributed
from rlhfuse_jax.trainer import async_ppo as async_lib
from rlhfuse_jax.trainer import config as config_lib
from rlhfuse_jax.trainer import inputs as inputs_lib
from rlhfuse_jax.trainer import plan_file as plan_file_lib
from rlhfuse_jax.trainer.config import TrainConfig


class Hook:
  def begin(self, start: int) -> None:
    pass

  def after(self, step: int, metrics: dict, stopping: bool) -> None:
    pass

  def end(self, failing: bool) -> None:
    pass


class StoppedBeforeTraining(BaseException):
  """SIGTERM/SIGINT came before the training loop installed its own handlers (StopFlag): while
  the run set up, restored its checkpoint or compiled. No iteration ran since the last
  checkpoint, so there is nothing to save and nothing is lost; train_ppo exits 75 (re-run to
  resume), as a stop during training does. A BaseException, as KeyboardInterrupt is, so that
  no `except Exception` on its way (a restore's fallback) takes it for an error of its own.
  `alone`: a second signal to one process of several, which stops without the others."""

  def __init__(self, signum: int, alone: bool = False):
    super().__init__(signum)
    self.alone = alone
    self.signum = signum


# began: set by StopFlag.begin (the set-up is over); pending: a signal that came during the
# set-up of a run of several processes, which stops them together where they next agree
# (agree_setup_signal).
_LOOP = {"began": False, "pending": 0}


def stop_signals() -> tuple:
  """The signals that stop a run cleanly (finish the iteration, save, exit 75): SIGTERM,
  SIGINT, and SIGHUP (a closed terminal, a dropped ssh session: it killed the run without
  saving) unless it is ignored (nohup, or a launcher that ignores it: the run goes on, as
  asked)."""
  hup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
  return (signal.SIGTERM, signal.SIGINT) + hup


@contextlib.contextmanager
def stop_before_training():
  """Within: SIGTERM/SIGINT (and SIGHUP: stop_signals) raise StoppedBeforeTraining until the
  loop begins; then StopFlag's
  handlers take over (finish the iteration, save), and once they are given back (the run's
  last moments: result.json, a failed save's exit) a signal does what it did before (SIGINT:
  KeyboardInterrupt; SIGTERM: the default, death). Python runs the handler once the main
  thread is back in the interpreter: a signal during an XLA compile takes effect when the
  compile returns. Off the main thread nothing is installed.

  With several processes (jax.distributed initialised) the first signal is only recorded: a
  process that left alone would leave the others waiting in a collective for it (a signal
  reaches the processes at different points of their set-up), so all go on to the next point
  where they agree (agree_setup_signal) and stop there together, each with the stopped
  status. A second signal stops this process at once, but for a SIGTERM or SIGHUP after a
  SIGINT: a launcher passing on the Ctrl-C its processes got too."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  _LOOP.update(began=False, pending=0)

  def handle(signum, frame):
    if not _LOOP["began"]:
      first = not _LOOP["pending"]
      if (not first and _LOOP["pending"] == signal.SIGINT and signum != signal.SIGINT
          and jax.distributed.is_initialized()):
        # The SIGTERM a launcher passes on after a Ctrl-C that reached every process too
        # (launch/local_multiprocess.sh): the same stop, not a second signal. It stopped each
        # process alone, or, raised inside jax's gc callback, printed a dropped traceback.
        return
      # Recorded before raising too: Python may run this handler inside a gc callback or a
      # __del__ (jax frees arrays there), where the raised exception is printed and dropped;
      # the next agreement point (agree_setup_signal) then stops the run. (A SIGTERM right
      # after the workdir lock once went unnoticed on a loaded machine: the run trained on.)
      _LOOP["pending"] = _LOOP["pending"] or signum
      if first and jax.distributed.is_initialized():
        logging.warning("signal %d during set-up: stopping with the other processes where "
                        "they next agree (again: stop this process now)", signum)
        return
      raise StoppedBeforeTraining(signum, alone=not first and jax.distributed.is_initialized())
    if signum == signal.SIGINT:
      raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)

  old = {sig: signal.signal(sig, handle) for sig in stop_signals()}
  try:
    yield
  finally:
    for sig, handler in old.items():
      signal.signal(sig, handler)
    _LOOP["pending"] = 0  # a later run's StopFlag has no set-up signal of this one's


def setup_signal_pending() -> bool:
  """Whether a stop signal came during set-up and waits, only recorded, for the next agreement
  point (agree_setup_signal; several processes only: one process's first signal raises at
  once). For a wait that would hold the set-up long before reaching one (the workdir lock's
  wait for a holder on another host, WorkdirLock's `stop`)."""
  return bool(_LOOP["pending"]) and not _LOOP["began"]


def agree_setup_signal() -> None:
  """Raises StoppedBeforeTraining on every process when a signal came during set-up on any of
  them (recorded by stop_before_training): one tiny collective, at points of the set-up every
  process reaches in the same order (after the workdir lock, after reading the checkpoints,
  around the restore, when the loop begins), so a preempted run stops soon after the signal,
  all processes alike."""
  signum = (distributed.max_over_processes(_LOOP["pending"]) if jax.process_count() > 1 else
            _LOOP["pending"])
  _LOOP["pending"] = 0
  if signum:
    raise StoppedBeforeTraining(signum)


class StopFlag(Hook):
  """Set by SIGTERM/SIGINT/SIGHUP (stop_signals); the loop checks it after each iteration,
  saves and exits cleanly. A second SIGINT (Ctrl-C twice) interrupts at once, without
  saving."""

  def __init__(self):
    self.set = False
    self.signal: Optional[int] = None
    self.ending = False  # set by the loop once its iterations are over
    self._old = {}

  def begin(self, start: int) -> None:
    if threading.current_thread() is not threading.main_thread():
      # Python installs signal handlers from the main thread only (a trainer driven from a
      # worker or notebook thread): run without them rather than fail.
      logging.warning("PPOTrainer.run() is not on the main thread: SIGTERM/SIGINT will not "
                      "save a checkpoint before exiting (checkpoint.every still does)")
      return
    for sig in stop_signals():
      self._old[sig] = signal.signal(sig, self._handle)
    _LOOP["began"] = True  # after the handlers: no signal falls between the two
    # A signal that came during set-up on any process (stop_before_training) stops them all
    # here, before anything of an iteration is written; the same answer on every process.
    try:
      agree_setup_signal()
    except StoppedBeforeTraining:
      self.end(failing=True)  # hands the handlers back, as the loop's end would
      raise

  def _handle(self, signum, frame):
    if self.set and signum == signal.SIGINT:
      raise KeyboardInterrupt
    # Set before logging: a second signal can arrive while this handler logs (Ctrl-C twice,
    # quickly), and Python runs its handler inside this one. Set after, it saw no first signal,
    # logged again into the stream this one was writing (a reentrant write, which logging
    # reported as a traceback) and never interrupted: the run went on to save.
    if self.set:  # a SIGTERM/SIGHUP after the first signal: already stopping
      return
    self.signal, self.set = signum, True
    if self.ending:
      logging.warning("signal %d: the run is ending; waiting for its last checkpoint to be "
                      "saved (Ctrl-C again: stop now without it)", signum)
    else:
      logging.warning("signal %d: finishing this iteration, saving a checkpoint, then exiting "
                      "(Ctrl-C again: stop now without saving)", signum)

  def agreed(self) -> bool:
    """Whether to stop after this iteration, the same answer on every process: a signal that
    reached only some processes (or reached them on both sides of an iteration's end) stops
    them all after the same iteration, so all join the save (its collectives, and the next
    iteration's, would otherwise wait forever for the processes that went on or stopped).
    Every process calls it once per iteration; one tiny collective when there are several."""
    signum = distributed.max_over_processes(self.signal if self.set else 0)  # snapshot first
    if signum and not self.set:
      logging.warning("signal %d reached another process: finishing this iteration, saving a "
                      "checkpoint, then exiting", signum)
      self.set, self.signal = True, signum
    return bool(signum)

  def end(self, failing: bool) -> None:
    for sig, old in self._old.items():
      signal.signal(sig, old)


class HangWatchdog(Hook):
  """config.guard.iteration_timeout_s: ends this process when an iteration has not finished in
  time. Armed at `begin` (so the first iteration's compile counts), re-armed after each
  iteration, disarmed at the very end (the last save's wait included). When it fires it logs
  what it waited for, writes every Python thread's stack to stderr (faulthandler: where the
  process hangs, or which collective it waits in) and exits EXIT_PEER_LOST (69) with
  os._exit: a thread blocked in a collective or a C call cannot be interrupted, and a requeue
  rule treats a hang like a lost peer (resume from the last checkpoint). 0: does nothing.

  The timer is a Python thread, which needs the GIL: a hang in C code that holds it (a regular
  expression backtracking for ever in an answer extractor) would keep it from running. So
  faulthandler's own watchdog, a C thread, backs it up `grace_s` later: it writes the stacks
  and ends the process with status 1."""

  def __init__(self, timeout_s: float, num_iterations: int, grace_s: float = 30.0):
    self.timeout_s, self.num_iterations = float(timeout_s), num_iterations
    self.grace_s = float(grace_s)
    self._timer: Optional[threading.Timer] = None
    self.waiting_for = ""  # what the armed timer waits for, in its message

  def _arm(self, what: str) -> None:
    self._disarm()
    if self.timeout_s <= 0:
      return
    self.waiting_for = what
    self._timer = threading.Timer(self.timeout_s, self._expire)
    self._timer.daemon = True
    self._timer.start()
    faulthandler.dump_traceback_later(self.timeout_s + self.grace_s, exit=True)

  def _disarm(self) -> None:
    if self._timer is not None:
      self._timer.cancel()
      self._timer = None
      faulthandler.cancel_dump_traceback_later()

  def _expire(self) -> None:
    procs = jax.process_count()
    who = (f"process {jax.process_index()} of {procs}: " if procs > 1 else "")
    msg = (f"{who}{self.waiting_for} did not finish within "
           f"config.guard.iteration_timeout_s={self.timeout_s:g}s: this process hangs (a "
           "reward function, a read that never returns)"
           + (" or waits in a collective for another process that hangs" if procs > 1 else "")
           + "; every thread's stack follows on stderr; re-run to resume from the last "
           f"checkpoint; exiting ({multihost.EXIT_PEER_LOST})")
    multihost.exit_now(msg, stacks=True)

  def begin(self, start: int) -> None:
    self._arm(f"iteration {start + 1} (with its compiles; with async PPO, the batches "
              "generated ahead of it)")

  def after(self, step: int, metrics: dict, stopping: bool) -> None:
    # Its after runs before the other hooks': their logging and save count towards the next.
    last = stopping or step >= self.num_iterations
    self._arm(f"iteration {step}'s logging, checkpoint save and (checkpoint.export_hf) export"
              if last else
              f"iteration {step}'s logging and checkpoint save, then iteration {step + 1},")

  def end(self, failing: bool) -> None:
    self._disarm()


def warn_missing_rows(path: str, missing: list[int], start: int) -> None:
  """Warns that metrics.jsonl (`path`) has no row for the steps `missing`
  (MetricWriter.truncate_after's answer) up to the checkpoint at `start`."""
  if missing:
    shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
    logging.warning("%s has no row for %d iteration(s) the checkpoint at iteration %d covers "
                    "(%s): a torn or removed line; those iterations are not run again, so "
                    "their metrics stay missing", path, len(missing), start, shown)


class LogWriteError(checkpointing.SaveError):
  """A record of the run other than a checkpoint could not be written (a full disk): a row of
  metrics.jsonl or samples.jsonl, TensorBoard's events, a start's config.json (config.K.json),
  the HF export (checkpoint.export_hf), train_ppo's result.json. The run stops as on a failed
  checkpoint save, a kind of which it is (train_ppo: exit 3, the path and the checkpoint kept in
  one line): a full disk exited 1 here and 3 at a save, two meanings of one fault for a
  scheduler. What the checkpoints cover stays: the logs are only appended to, and a torn row
  after the latest checkpoint is dropped at the next start with the other rows that checkpoint
  does not cover; the others are written whole or not at all, and written again by a re-run."""


@contextlib.contextmanager
def writing(path: str):
  """Re-raises an OSError of a write of the run's records as LogWriteError naming the file
  (`path` where the error names none: TensorBoard's writes, an fsync). A read of an input
  within is the caller's to name as one (hf_export.ExportInputError; a JSONL log's,
  workdir.ReadError: "reading metrics.jsonl failed", exit 1), not a failed write."""
  try:
    yield
  except OSError as e:
    raise LogWriteError(f"writing {e.filename or path} failed: {wd.os_error_text(e)}") from e


class MetricsLog(Hook):
  """metrics.jsonl + TensorBoard events (process 0), and a progress line every log_every.

  Exactly once: at begin, rows and events after the restored step are dropped; they belong to
  a trajectory that was not kept (a crash after them, before their checkpoint)."""

  def __init__(self, workdir: str, cfg: TrainConfig, summary: Callable[[dict], str],
               started: Optional[float] = None):
    """`started`: the time the progress line's `elapsed` counts from (default: begin)."""
    self.workdir, self.cfg, self.summary, self.started = workdir, cfg, summary, started
    self.events = os.path.join(workdir, "tb")  # (what a failed write of TensorBoard's names)
    self.writer: Optional[metrics_lib.MetricWriter] = None

  def begin(self, start: int) -> None:
    self.progress = metrics_lib.ProgressReporter(self.cfg.num_iterations, start, self.started)
    with writing(self.events):
      self.writer = metrics_lib.MetricWriter(self.workdir, enabled=jax.process_index() == 0,
                                             purge_step=start + 1)
      warn_missing_rows(self.writer.path, self.writer.truncate_after(start), start)

  def after(self, step: int, metrics: dict, stopping: bool) -> None:
    with writing(self.events):
      self.writer.write(step, metrics)
    self.progress.tick(step)  # the ETA's pace starts after the first iteration, logged or not
    # (and the iteration a signal stops after: where the run stands, whatever log_every is)
    if step % self.cfg.log_every == 0 or step == self.cfg.num_iterations or stopping:
      logging.info(self.progress.line(step, metrics, keys=("reward/mean", "val/reward_mean",
                                                           "kl/ref_mean", "response_length/mean"),
                                      extra=self.summary(metrics)))

  def end(self, failing: bool) -> None:
    if self.writer is not None:
      with writing(self.events):
        self.writer.close()


class SamplesLog(Hook):
  """WORKDIR/samples.jsonl (process 0, config.log_samples): one row per sample that `take()`
  hands over after an iteration ({step, sample, prompt, target (the ground truth, where the
  prompt's record has one), response, reward, reward_terms, response_length}: loop.sample_rows).
  Exactly once, as MetricsLog: at begin, rows after the restored step are dropped."""

  def __init__(self, workdir: str, take: Callable[[], Optional[list]]):
    self.path, self.take = os.path.join(workdir, "samples.jsonl"), take
    self.enabled = False

  def begin(self, start: int) -> None:
    self.enabled = jax.process_index() == 0
    if self.enabled and os.path.exists(self.path):
      with writing(self.path):
        wd.keep_jsonl_through(self.path, start, rows=False)

  def after(self, step: int, metrics: dict, stopping: bool) -> None:
    rows = self.take()
    if rows and self.enabled:
      with writing(self.path):
        for row in rows:
          wd.append_jsonl(self.path, {"step": step, **row})


# config.json, config.K.json (a start resumed at K), config.K.N.json (its N-th start at K).
_CONFIG_RECORD = re.compile(r"config(?:\.(\d+)(?:\.(\d+))?)?\.json")


def config_record_of(workdir: str, iteration: Any) -> tuple[Optional[dict], str]:
  """(config.json of the start that wrote checkpoint `iteration`, its path): the newest
  config.K.json (a start resumed at K) with K below it, else config.json; (None, '') when
  none reads. Of several starts at one K (config.K.json, then config.K.1.json, ... as
  workdir.write_config_history names them), the last."""
  found = []
  for name in os.listdir(workdir) if os.path.isdir(workdir) else ():
    m = _CONFIG_RECORD.fullmatch(name)
    if m and (m.group(1) is None or not isinstance(iteration, int) or
              int(m.group(1)) < iteration):
      found.append((int(m.group(1) or -1), int(m.group(2) or 0), name))
  for _, _, name in sorted(found, reverse=True):
    path = os.path.join(workdir, name)
    try:
      with open(path, encoding="utf-8") as f:
        record = json.load(f)
    except (OSError, ValueError):
      continue
    if isinstance(record, dict):
      return record, path
  return None, ""


def start_points(workdir: str) -> list[int]:
  """The iterations the run's starts began at, ascending: 0 (config.json's) and every K of a
  config.K.json (a start that resumed at K)."""
  points = {0}
  for name in os.listdir(workdir) if os.path.isdir(workdir) else ():
    m = _CONFIG_RECORD.fullmatch(name)
    if m and m.group(1) is not None:
      points.add(int(m.group(1)))
  return sorted(points)


class Checkpoints(Hook):
  """Resume point, restore with fallback, and saves every checkpoint.every iterations (and at
  the end, and when stopping). `state_fn()` gives the state to save, `meta_fn()` the side-car's
  run-specific entries (the prompt stream's position, the LR schedule's horizon)."""

  def __init__(self, workdir: str, cfg: TrainConfig, fingerprint: dict,
               ran_before: Optional[Mapping[str, Any]] = None):
    self.workdir, self.cfg, self.fingerprint = workdir, cfg, fingerprint
    # {field: the value a checkpoint written before the field existed ran with}, where this
    # run computes otherwise at its default (config_lib.fingerprint_changes' `absent`)
    self.ran_before = dict(ran_before or {})
    # What the files the run reads by path hold as it starts (trainer/inputs.py): saved with
    # every checkpoint, compared on resume.
    self.inputs = inputs_lib.fingerprints(cfg)
    self.eval = inputs_lib.eval_settings(cfg)  # the validation pass's (a resume says changes)
    self.checkpointer = checkpointing.Checkpointer(workdir, keep=cfg.checkpoint.keep)
    self._set_aside: list[int] = []  # checkpoints set aside as damaged in this start
    self.state_fn: Callable[[], dict] = dict
    self.meta_fn: Callable[[], dict] = dict

  def set_val_pool(self, size: int) -> None:
    """The held-out pool's size before data.val_max_prompts (known once the prompts are
    loaded), saved with the validation settings from the next checkpoint on."""
    self.eval[inputs_lib.VAL_POOL] = int(size)

  # ------------------------------------------------------------ before anything is built
  def resume_point(self) -> tuple[Optional[int], Optional[dict]]:
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
        self._damaged(step, e)
        continue
      if meta["iteration"] != step:
        # The run resumes at the directory's number with the side-car's data position and LR
        # horizon: a checkpoint put back under another number (from damaged_checkpoints/, as
        # the error that set it aside suggests) resumed another iteration's stream, silently.
        raise ValueError(
            f"checkpoint {step} in {self.checkpointer.directory} holds the side-car of "
            f"iteration {meta['iteration']} (put back under another number?): rename its "
            f"directory to {meta['iteration']}, or move it out of the checkpoints directory")
      self._check_resume(meta)
      return step, meta
    return None, None

  def _damaged(self, step: int, error: BaseException) -> None:
    """A checkpoint that cannot be read: set it aside and go on (fallback), or stop.

    At most one checkpoint is set aside per start, and only in a single-process run: a second
    unreadable one in a row points at something systematic (disk, memory, another version of
    the code), and in a multi-host run every process would have to agree on the move. A run
    whose only checkpoint was set aside stops once instead of silently starting over."""
    what = f"checkpoint {step} in {self.checkpointer.directory} cannot be read " \
           f"({checkpointing.error_line(error)})"
    if isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in str(error):
      raise error  # out of memory is not damage
    aside = self.checkpointer.set_aside_command(step)
    if not self.cfg.checkpoint.fallback:
      raise ValueError(f"{what}; config.checkpoint.fallback=False, so the run stops (set it "
                       "True to resume from the newest intact checkpoint, or set it aside and "
                       f"re-run: {aside})") from error
    if jax.process_count() > 1:
      raise ValueError(f"{what}; a multi-process run does not fall back by itself: set it aside "
                       f"(kept, as one process would) and re-run: {aside}") from error
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

  def _check_resume(self, meta: dict) -> None:
    if meta.get("seed") != self.cfg.seed:
      raise ValueError(f"config.seed={self.cfg.seed} differs from the checkpoint's seed "
                       f"{meta.get('seed')} in {self.checkpointer.directory}: resume with "
                       f"--config.seed={meta.get('seed')}, or start a new --workdir")
    saved = meta.get("config")
    if saved is None:  # checkpoints written before fingerprints existed
      logging.warning("checkpoint %s has no config fingerprint: resuming unchecked",
                      meta.get("iteration"))
      return
    inputs_lib.warn_eval_changes(meta.get("eval"), inputs_lib.eval_settings(self.cfg),
                                 meta.get("iteration"))
    changes, content = inputs_lib.resume_changes(
        config_lib.fingerprint_changes(saved, self.fingerprint, self.ran_before),
        meta.get("inputs"),
        self.inputs, meta.get("iteration"))
    if content:
      raise ValueError(
          f"files this run reads changed since the checkpoints in {self.checkpointer.directory} "
          f"(iteration {meta.get('iteration')}) were written: " + "; ".join(content) + ". Put "
          "the files the run started with back (another path to the same files is accepted), "
          "or start a new --workdir (from these files: they are its config.init.*, data.* and "
          "pipeline.schedule_file)")
    allowed = self.cfg.checkpoint.resume_changes_set
    # Async PPO's batches in flight without the reference log-probs a KL term now reads:
    # refused before the change is logged as applied (trainer/loop.py checks the restored
    # batches again: an older checkpoint may be restored than this one). Known limit: a damaged
    # newest checkpoint lacking them is refused even where the older one the fallback would
    # restore holds them (kl_coef changed twice, then a damaged save: resume with kl_coef=0)
    lacking = (async_lib.lacking_reference(meta.get("in_flight"))
               if self.cfg.algo.uses_reference else [])
    if lacking:
      raise ValueError(async_lib.reference_refusal(meta.get("iteration"), lacking,
                                                   self.cfg.algo.kl_coef,
                                                   self.cfg.async_ppo.staleness))
    passed, changes = config_lib.split_resume_changes(changes, allowed)
    for change in passed:
      # schedule_iterations 0 means the horizon the checkpoints keep (the first start's
      # num_iterations, or the value a resume set since): say which ("0 -> 16" read as a
      # schedule that had none; "16 -> 0" as a return to the first start's horizon, while the
      # LR went on along the 16 iterations' cosine)
      kept = meta.get("schedule_iterations")
      span = metrics_lib.count(kept, "iteration")
      horizon = ""
      if kept and change.startswith("optim.schedule_iterations: 0 ->"):
        # (the checkpoints', not always the first start's: a resume may have set it since)
        horizon = f" (0 there: the checkpoints' horizon, {span})"
      elif kept and change.startswith("optim.schedule_iterations:") and change.endswith("-> 0"):
        horizon = (f" (0 keeps the checkpoints' horizon, {span}: the LR schedule "
                   "stays as it was; set the number of iterations it should span instead)")
      logging.warning("resuming iteration %s with a changed %s%s (config.checkpoint."
                      "resume_changes)", meta.get("iteration"), change, horizon)
    if changes:
      raise ValueError(
          f"this config differs from the one that wrote the checkpoints in "
          f"{self.checkpointer.directory} (iteration {meta.get('iteration')}) in fields that "
          f"change the run: " + "; ".join(changes) + ". " +
          self._plan_file_note(changes, meta.get("iteration"), saved) +
          config_lib.resume_advice(changes, allowed) + " (fields a resume may change freely: "
          f"{', '.join(sorted(config_lib.RESUMABLE_FIELDS))}; named in "
          f"config.checkpoint.resume_changes: {', '.join(sorted(config_lib.RESUME_CHANGEABLE))})")

  def _plan_file_note(self, changes: list[str], iteration: Any = None,
                      saved: Optional[Mapping[str, Any]] = None) -> str:
    """What a refused resume adds when fields it lists are ones a plan file set, then or now
    (the user never wrote async_ppo.generation_devices): that the checkpoints were written
    without a plan file, or with one this start does not give (and where its content is), or
    which fields the file's new content changed (one the old file set and the new one does
    not, an "async" entry dropped, among them). Fields the file sets alike then and now,
    changed on the command line, are not blamed on it; nor is a field the checkpoints hold
    another value of than the old file set (`saved`: their fingerprint; a config's own
    micro-batching, kept over the file's)."""
    path = getattr(getattr(self.cfg, "plan", None), "file", "")
    try:
      now = plan_file_lib.plan_file_settings(plan_file_lib.load_plan_file(path), path) if (
          path) else {}
    except ValueError:
      return ""
    record, where = self._config_record(iteration)
    content = record.get("plan_file_content") if record is not None else None
    then_path = ((record.get("plan") or {}).get("file", "") if record is not None else "")
    try:
      then = plan_file_lib.plan_file_settings(content, then_path) if content else {}
    except (ValueError, KeyError, TypeError, AttributeError):
      then = {}
    key = lambda n: tuple(n.split(".", 1))
    names = [c.split(":")[0] for c in changes]
    if record is not None and path and content is None:  # written without a plan file
      ours = [n for n in names if key(n) in now and self.fingerprint.get(n) == now[key(n)][0]]
      return (f"{', '.join(ours)} {'is' if len(ours) == 1 else 'are'} set by config.plan.file="
              f"{path!r}, and the checkpoints were written without a plan file ({where}): "
              "resume without it. ") if ours else ""
    # A field one of the two files set, to values that differ (a field only one sets: None for
    # the other); one this start's file set must have its value here (not the command line's).
    ours = [n for n in names if (key(n) in now or key(n) in then) and
            now.get(key(n), (None,))[0] != then.get(key(n), (None,))[0] and
            (key(n) not in now or self.fingerprint.get(n) == now[key(n)][0]) and
            (key(n) not in then or saved is None or saved.get(n) == then[key(n)][0])]
    if not ours:
      return ""
    verb = "is" if len(ours) == 1 else "are"
    saved = where or os.path.join(self.workdir, "config.json")
    if not path:
      return (f"{', '.join(ours)} {verb} set by the plan file the checkpoints were written with "
              f"(config.plan.file={then_path!r}), which this start does not give: its content "
              f"is saved in {saved} under \"plan_file_content\"; to resume, set "
              "config.plan.file to it (or to a file of that content). ")
    by = (f"config.plan.file={path!r}, whose content differs from" if all(
        key(n) in now for n in ours) else f"config.plan.file={path!r} or by")
    return (f"{', '.join(ours)} {verb} set by {by} the plan file the checkpoints were written "
            f"with: that one is saved in {saved} under \"plan_file_content\"; to resume, "
            "write it to a file and set config.plan.file to it. ")

  def _config_record(self, iteration: Any) -> tuple[Optional[dict], str]:
    return config_record_of(self.workdir, iteration)

  # ------------------------------------------------------------ restore and save
  def restore(self, step: Optional[int], template: dict, layout: str
              ) -> tuple[int, Optional[dict], Optional[dict]]:
    """(iteration to start at, restored state, side-car) from the newest intact checkpoint at
    or before `step` (the resume point); (0, None, None) when there is none. `layout` names
    the state's layout in the error for a checkpoint written for another one."""
    while step is not None:
      try:
        state, meta = self.checkpointer.restore(step, template)
        checkpointing.verify(step, state, meta)  # damage inside a chunk reads without an error
        logging.info("resumed from checkpoint at iteration %d", step)
        return step, state, meta
      except Exception as e:  # noqa: BLE001 orbax raises many types for damaged files
        try:
          mismatch = self.checkpointer.layout_mismatch(step, template)
        except Exception:  # noqa: BLE001 the metadata is damaged too
          mismatch = None
        if mismatch is not None:
          # Written for another layout (pipeline split, code version): not damage, so not
          # set aside; say what differs.
          raise ValueError(
              f"checkpoint {step} in {self.checkpointer.directory} does not fit this run's "
              f"state ({layout}; {mismatch}): a run resumes only with the pipeline layout that "
              f"saved it (mesh.stage, pipeline.critic_pp) and a code version with the same "
              f"parameter tree. Orbax says: {(str(e).splitlines() or [repr(e)])[0]}") from e
        self._damaged(step, e)
        step, _ = self.resume_point()
    return 0, None, None

  def read_exactly(self, step: int, template: dict, layout: str) -> tuple[dict, dict]:
    """(state, side-car) of checkpoint `step` itself, checked (its checksums): no fallback to an
    older one, nothing set aside; a ValueError says what failed (another layout, or damage)."""
    try:
      state, meta = self.checkpointer.restore(step, template)
      checkpointing.verify(step, state, meta)
      return state, meta
    except Exception as e:  # noqa: BLE001 orbax raises many types for damaged files
      try:
        mismatch = self.checkpointer.layout_mismatch(step, template)
      except Exception:  # noqa: BLE001 the metadata is damaged too
        mismatch = None
      what = (f"does not fit this run's state ({layout}; {mismatch})" if mismatch else
              "cannot be read (damaged?)")
      raise ValueError(f"checkpoint {step} in {self.checkpointer.directory} {what}: "
                       f"{checkpointing.error_line(e)}") from e

  def after(self, step: int, metrics: dict, stopping: bool) -> None:
    if step % self.cfg.checkpoint.every == 0 or step == self.cfg.num_iterations or stopping:
      state = self.state_fn()
      meta = {"iteration": step, "seed": self.cfg.seed, "config": self.fingerprint,
              "inputs": self.inputs, "eval": self.eval, **self.meta_fn(),
              "checksums": checkpointing.checksums(state)}
      self.checkpointer.save(step, state, meta)

  def trim(self) -> None:
    """Keeps the newest checkpoint.keep checkpoints (checkpointing.Checkpointer.trim), saying
    which it removed: called once the start's checkpoint is chosen (and restored), so the
    removed ones are older than it."""
    removed = self.checkpointer.trim()  # (all beyond the newest keep: it held keep + those)
    held = self.checkpointer.keep + len(removed)
    if removed and jax.process_index() == 0:
      logging.warning("%s held %d checkpoints, more than checkpoint.keep=%d (a run killed "
                      "between a save and the removal of the oldest, or a lowered keep): "
                      "removed checkpoint%s %s", self.checkpointer.directory, held,
                      self.cfg.checkpoint.keep, "s" if len(removed) > 1 else "",
                      ", ".join(map(str, removed)))

  def wait(self) -> None:
    """Blocks until the last save is on disk; raises checkpointing.SaveError if it failed."""
    self.checkpointer.wait()

  def latest_step(self) -> Optional[int]:
    return self.checkpointer.latest_step()

  def end(self, failing: bool) -> None:
    try:
      self.checkpointer.wait()
    except checkpointing.SaveError:
      if not failing:
        raise
      # Another error is already on its way out: report this one without hiding it.
      logging.exception("the last checkpoint save failed too")


def enable_compilation_cache(setting: str, workdir: str) -> Optional[str]:
  """Points jax's persistent compilation cache at `setting` (config.compilation_cache_dir; "":
  WORKDIR/cache/xla, "none": off) unless the caller set one (JAX_COMPILATION_CACHE_DIR), and
  caches every program, however fast it compiled (jax's default skips those under 1 s: most of
  a small run's). Must run before the first compile: jax decides once per process whether it
  uses a cache. Returns the directory in use, or None. Off GPUs the cache's keys do not hold
  its path, so a moved workdir (or a copy) loads its programs; on GPUs jax's autotuning cache
  puts the path into them (docs/usage.md "Faults and resuming").

  A restart then loads what the earlier start compiled (the tiny fused main job on the 2-core
  CPU machine: 81.5 s to its third iteration, 25.0 s restarted). jax writes the cache from
  process 0 only; every process reads it (on 2 CPU processes the other's programs had other
  keys: at a restart only process 0's loaded, docs/usage.md "Faults and resuming")."""
  current = jax.config.jax_compilation_cache_dir
  if current:
    logging.info("XLA compilation cache: %s (set by the caller)", current)
    count_cache_events()
    return current
  if setting == "none":
    return None
  count_cache_events()
  path = setting or os.path.join(workdir, "cache", "xla")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  if (jax.default_backend() != "gpu" and
      "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES" not in os.environ):
    # jax (0.10) points XLA's GPU autotuning cache at PATH/xla_gpu_per_fusion_autotune_cache_dir
    # and that path enters every program's cache key: a workdir moved or copied elsewhere (a
    # node's scratch) loaded none of its programs. On CPU and TPU that cache does nothing.
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
  drop_damaged_cache_entries(path)
  logging.info("XLA compilation cache: %s (a restart loads the programs compiled before; "
               "config.compilation_cache_dir='none' turns it off)", path)
  return path


RECENT_ENTRY_S = 5.0  # (jax writes an entry in one write_bytes call: milliseconds)


def drop_damaged_cache_entries(path: str) -> list[str]:
  """Removes (and returns) the entries of jax's compilation cache at `path` that do not
  decompress: jax writes an entry in place, not by a rename, and never rewrites one that
  exists, so an entry cut short (a kill -9 or a full disk while it was written) failed every
  later start's read ("Error reading persistent compilation cache entry ... truncated
  stream") and its program, the update's most often, was compiled again each time. Removed,
  the next compile writes it whole. Needs jax's own decompression (a private function, the
  format's only reader): where a jax version lacks it, nothing is checked. Process 0 checks
  (the one that writes the cache), and not an entry written in the last RECENT_ENTRY_S: another
  run sharing the cache (a sweep's) may be writing it."""
  if jax.process_index() != 0:
    return []
  try:
    from jax._src import compilation_cache  # pylint: disable=import-outside-toplevel
    decompress = compilation_cache.decompress_executable
  except (ImportError, AttributeError):
    return []
  dropped = []
  for name in sorted(os.listdir(path)) if os.path.isdir(path) else ():
    entry = os.path.join(path, name)
    if not name.endswith("-cache") or not os.path.isfile(entry):
      continue
    try:
      if time.time() - os.path.getmtime(entry) < RECENT_ENTRY_S:
        continue
      with open(entry, "rb") as f:
        decompress(f.read())
    except OSError:
      continue  # (unreadable here: jax's own read says so)
    except Exception:  # noqa: BLE001 zlib.error, zstd's ZstdError: a damaged entry
      try:
        os.remove(entry)
      except FileNotFoundError:  # (another process of the run removed it first)
        pass
      dropped.append(name)
  if dropped:
    logging.warning("removed %d damaged compilation cache entr%s from %s (cut short while jax "
                    "wrote %s: a kill or a full disk); %s compiled again and written whole: %s",
                    len(dropped), "y" if len(dropped) == 1 else "ies", path,
                    "it" if len(dropped) == 1 else "them",
                    "its program is" if len(dropped) == 1 else "their programs are",
                    ", ".join(dropped))
  return dropped


# jax's events for a program loaded from the persistent cache and one it missed, so compiled. Only
# process 0 writes a compiled one, and not one that uses host callbacks or whose write failed
# (jax's "Error writing persistent compilation cache entry" warning): no event says it was
# written, so the note says compiled, not written.
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "loaded",
                 "/jax/compilation_cache/cache_misses": "compiled"}
_cache_counts = {"loaded": 0, "compiled": 0, "listening": False}


def _count_cache_event(event: str, **kwargs) -> None:
  del kwargs
  name = _CACHE_EVENTS.get(event)
  if name:
    _cache_counts[name] += 1


def count_cache_events() -> None:
  """Counts, from now on, the programs this process loads from jax's persistent compilation
  cache and those it compiles because the cache lacked them (once per process), for
  cache_note."""
  if not _cache_counts["listening"]:
    jax.monitoring.register_event_listener(_count_cache_event)
    _cache_counts["listening"] = True


def cache_note() -> str:
  """What the compilation cache did so far, for the first update's log line: a restart that
  loads its programs only showed in shorter times, nothing said the cache was used (or that
  it was not, a cache directory on another filesystem per host). "" when not counting."""
  if not _cache_counts["listening"]:
    return ""
  return (f" (compilation cache so far: {_cache_counts['loaded']} programs loaded, "
          f"{_cache_counts['compiled']} compiled)")


def run_hooks(hooks: list, method: str, *args: Any) -> None:
  """Calls `method` on every hook in order; "end" in the reverse order, as nested with-blocks
  unwind: what began first ends last (the stop flag, first to begin, keeps its signal handlers
  until the last save has committed: a SIGTERM during that wait killed the run and lost the
  checkpoint). For "end" every hook runs even if one raises (a failed metrics close must not
  skip the wait for the last save), then the first error is raised, unless the run is already
  failing (`end(failing=True)`): then the error on its way out stays the one raised and the
  hooks' are logged (a full disk failed the save, then the TensorBoard close; the close's
  OSError replaced the SaveError, and the run exited 1 instead of 3)."""
  if method != "end":
    for h in hooks:
      getattr(h, method)(*args)
    return
  first = None
  for h in reversed(hooks):
    try:
      h.end(*args)
    except BaseException as e:  # noqa: BLE001 re-raised below
      if first is None:
        first = e
      else:
        logging.exception("another end hook failed too")
  if first is not None:
    if args and args[0]:
      logging.error("an end hook failed while the run was already failing (that error follows): "
                    "%s: %s", type(first).__name__, first, exc_info=first)
      return
    raise first
