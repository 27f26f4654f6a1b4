"""Per-iteration metrics: `metrics.jsonl` (one JSON object per step) and TensorBoard events.

TensorBoard events go through tensorboardX (a maintained writer without a TensorFlow dependency;
clu's writer would pull TensorFlow in): its record writer and protos, written in the caller's
thread (`_Events`). Non-scalar values (curves, lists) go to JSONL only.
"""
from __future__ import annotations

import itertools
import math
import os
import time
from typing import Any, Mapping, Optional

from rlhfuse_jax import workdir as wd


_EVENT_FILES = itertools.count(1)  # numbers this process's event files' names


class _Events:
  """A TensorBoard event file written and flushed in the caller's thread, with tensorboardX's
  own EventsWriter and protos (what its SummaryWriter writes, its file name with the pid and a
  count added, and its purge marker). Not SummaryWriter itself: it queues events to a thread
  that flushes every flush_secs, and its flush() does not drain that queue, so the events of
  the last steps before a kill -9 were lost although a checkpoint covered them (the resume
  does not run those steps again)."""

  def __init__(self, logdir: str, purge_step: Optional[int]):
    from tensorboardX.event_file_writer import EventsWriter  # lazily: optional at library level
    from tensorboardX.proto.event_pb2 import Event, SessionLog
    from tensorboardX.summary import scalar
    self._event, self._scalar = Event, scalar
    os.makedirs(logdir, exist_ok=True)
    # EventsWriter names its file by the whole second and the host, and opens it "wb": a second
    # writer in the same second (a resume in the same process, the finished-run re-run's purge
    # marker) truncated the first one's file, losing its events. The pid and a per-process
    # count make the name unique, as TensorFlow's own writer does.
    self._writer = EventsWriter(os.path.join(logdir, "events"),
                                filename_suffix=f".{os.getpid()}.{next(_EVENT_FILES)}")
    if purge_step is not None:  # TensorBoard hides older events of steps >= purge_step
      self._writer.write_event(Event(step=purge_step, file_version="brain.Event:2"))
      self._writer.write_event(Event(step=purge_step,
                                     session_log=SessionLog(status=SessionLog.START)))
      self._writer.flush()

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    for tag, v in values.items():
      self._writer.write_event(self._event(wall_time=time.time(), step=step,
                                           summary=self._scalar(tag, v)))
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


class MetricWriter:
  """Appends metrics to workdir/metrics.jsonl and workdir/tb/ (TensorBoard)."""

  def __init__(self, workdir: str, tensorboard: bool = True, enabled: bool = True,
               purge_step: Optional[int] = None):
    """enabled=False (processes other than 0 of a multi-host run) makes every call a no-op.
    purge_step: TensorBoard hides the events of steps >= purge_step written before (a resumed
    run passes its first step; `truncate_after` does the same for metrics.jsonl)."""
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.enabled = enabled
    self._tb = None
    if tensorboard and enabled:
      self._tb = _Events(os.path.join(workdir, "tb"), purge_step)

  def truncate_after(self, step: int) -> list[int]:
    """Drops lines with step > `step` (written after the checkpoint a resumed run starts from),
    so that a resumed run never repeats a step in metrics.jsonl. Returns the steps 1..`step`
    that have no row (a torn or removed line the checkpoint covers: they are not run again), []
    on processes other than 0."""
    if not self.enabled:
      return []
    have = set(wd.keep_jsonl_through(self.path, step, rows=False))
    return [s for s in range(1, step + 1) if s not in have]

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    record = {"step": int(step), **metrics}
    wd.append_jsonl(self.path, record)
    if self._tb is not None:  # on disk with the JSONL row (_Events)
      self._tb.scalars(step, {k: v for k, v in metrics.items() if isinstance(v, (int, float))
                              and not isinstance(v, bool) and math.isfinite(v)})

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


class ProgressReporter:
  """One progress line per iteration: step/total, chosen metrics, throughput, elapsed time and
  ETA.

  `elapsed` counts from `t0` (the trainer passes the time it was built: setup, restore and the
  first iteration's compilation included; default now). The ETA uses the pace after the first
  iteration of this run, which includes XLA compilation: `tick` it after every iteration, logged
  or not (with log_every=10 the first line, at iteration 10, showed ETA=? and paced the rest
  from there, so a run logging every 100 iterations had no ETA until its 200th).
  """

  def __init__(self, total: int, start_step: int = 0, t0: Optional[float] = None):
    self.total = total
    self.start_step = start_step
    self.t0 = time.time() if t0 is None else t0
    self._t_first: Optional[float] = None  # end of the first (compiling) iteration

  def tick(self, step: int) -> None:
    """Iteration `step` has ended: the first one of this run is where the ETA's pace starts."""
    if self._t_first is None:
      self._t_first, self._first_step = time.time(), step

  def line(self, step: int, metrics: Mapping[str, Any], keys=("reward/mean",),
           extra: str = "") -> str:
    """`extra`: a phrase appended at the end (e.g. what inter-stage fusion did)."""
    now = time.time()
    self.tick(step)
    paced = step - self._first_step
    # (the run's last iteration has nothing left, also when it is this run's first)
    eta = ((now - self._t_first) / paced * (self.total - step) if paced else
           0.0 if step >= self.total else None)
    parts = [f"iter {step}/{self.total}"]
    for k in keys:
      if k in metrics and metrics[k] is not None:
        parts.append(f"{k}={metrics[k]:.4g}")
    tps: Optional[float] = metrics.get("perf/tokens_per_s")
    if tps is not None:
      parts.append(f"tok/s={tps:.0f}")
    parts.append(f"elapsed={duration(now - self.t0)} ETA={'?' if eta is None else duration(eta)}")
    if extra:
      parts.append(extra)
    return " ".join(parts)


def duration(seconds: float, short: bool = False) -> str:
  """0m05s, 59m59s, then 1h00m00s, 26h03m07s: a run of hours showed `elapsed=612m03s
  ETA=1437m22s`, minutes the reader had to divide by 60. `short`: under a minute as 12.3s."""
  if short and seconds < 59.95:
    return f"{seconds:.1f}s"
  seconds = int(round(seconds) if short else seconds)
  hours, rest = divmod(seconds, 3600)
  if hours:
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s"
  return f"{seconds // 60}m{seconds % 60:02d}s"


def count(n: int, one: str, many: str = "") -> str:
  """'1 iteration', '2 iterations': `n` and its noun, `one` for 1 and otherwise `many` (default
  `one` + 's'); the log lines read '1 iterations' and '1 held-out ones'."""
  return f"{n} {one if n == 1 else many or one + 's'}"


def size(nbytes: float) -> str:
  """Bytes in the SI unit that reads best, to 3 significant digits: 999 B, 41 kB, 308 kB,
  1.5 GB. A toy model's weights logged in GB read '0.0003075 GB'; a multi-GB figure in MB
  '2.5e+03 MB'."""
  rounded = float(f"{nbytes:.3g}")  # first, so that 999,999 bytes is 1 MB, not 1e+03 kB
  for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(rounded) >= scale:
      return f"{rounded / scale:.3g} {unit}"
  return f"{rounded:g} B"


class _DropLibraryInfo:
  """logging.Filter: drops INFO/DEBUG records emitted from the named packages' source files
  (a package folder, or a file path inside one)."""

  def __init__(self, packages):
    self._markers = tuple(f"/{p}" if p.endswith(".py") else f"/{p}/" for p in packages)

  def filter(self, record) -> bool:
    import logging as py_logging  # absl logs through the standard library's logging
    return record.levelno >= py_logging.WARNING or not any(
        m in record.pathname for m in self._markers)


# orbax logs ~30 INFO lines per checkpoint save; jax's backend probe an INFO line for every
# platform it does not find ("Unable to initialize backend 'tpu'": every run on CPU or GPU;
# a missing GPU still gets jax's own WARNING).
LIBRARY_INFO = ("orbax", "tensorstore", "etils", "jax/_src/xla_bridge.py")


def quiet_library_logs(packages=LIBRARY_INFO) -> None:
  """Keeps our INFO progress lines readable: the libraries' INFO lines are dropped, their
  warnings kept. Once per process (experiments/config_files.run calls it)."""
  from absl import logging as absl_logging
  handler = absl_logging.get_absl_handler()
  if not any(isinstance(f, _DropLibraryInfo) for f in handler.filters):
    handler.addFilter(_DropLibraryInfo(packages))
