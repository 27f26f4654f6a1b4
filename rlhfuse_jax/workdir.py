"""Side effects at the edge: writing what a binary produces into its workdir.

Every binary writes its config, a `metrics.jsonl` or a `result.json`, and figures.
Writes are atomic (write to a temporary file in the same directory, then `os.replace`), so a
killed process never leaves a half-written file behind.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Optional

import numpy as np
from absl import logging

# Files we write get the mode a plain open() would give them (mkstemp's are 0600).
_UMASK = os.umask(0)
os.umask(_UMASK)
PLAIN_FILE_MODE = 0o666 & ~_UMASK


def _to_jsonable(x: Any) -> Any:
  """Converts numpy / jax scalars and arrays (and nested containers) into plain JSON values."""
  if isinstance(x, Mapping):
    return {str(k): _to_jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_to_jsonable(v) for v in x]
  if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
    return _to_jsonable(np.asarray(x).tolist())  # a non-finite entry still becomes valid JSON
  if isinstance(x, float) and (np.isnan(x) or np.isinf(x)):
    return None if np.isnan(x) else (1e308 if x > 0 else -1e308)
  return x


def as_json(x: Any) -> Any:
  """`x` as it reads back from the JSON these functions write (tuples as lists, numpy values
  as Python ones): what to compare with a file written earlier."""
  return json.loads(json.dumps(_to_jsonable(x)))


TMP_PREFIX = ".tmp_"  # temp files beside their target (atomic_write_bytes, save_hf_checkpoint)


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to `path` atomically and durably: a same-directory temp file, fsynced, renamed
  over `path` (os.replace), then the directory fsynced, so that the new name, not only the data,
  survives a power loss (before, one right after the rename could bring the old file back,
  or none: a config.json beside a checkpoint orbax had synced since)."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  with _naming(path):
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=TMP_PREFIX, suffix=os.path.basename(path))
  try:
    with _naming(path), os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, PLAIN_FILE_MODE)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  with _naming(path):
    fsync_directory(directory)


def fsync_directory(path: str) -> None:
  """fsyncs the directory `path`: the names created, renamed or removed in it are on disk (a
  file's own fsync covers its data, not its name in the directory). A filesystem that cannot
  sync a directory (EINVAL: some network and FUSE filesystems) is left as it is."""
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  except OSError as e:
    if e.errno != errno.EINVAL:
      raise
  finally:
    os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
  """Writes `text` (UTF-8) to `path` atomically."""
  atomic_write_bytes(path, text.encode("utf-8"))


def _is_number(x: Any) -> bool:
  return x is None or isinstance(x, (int, float))  # (bool too: an int)


def dumps_json(obj: Any, level: int = 0) -> str:
  """`obj` (plain JSON values) as json.dumps(obj, indent=2) writes it, except that a list of
  numbers (None and booleans among them) stays on one line: indented, a result's 2,400-point
  curves took a line per float (157 kB for 95 kB of numbers)."""
  inner, outer = "  " * (level + 1), "  " * level
  if isinstance(obj, dict) and obj:
    return "{\n" + ",\n".join(f"{inner}{json.dumps(k)}: {dumps_json(v, level + 1)}"
                               for k, v in obj.items()) + f"\n{outer}}}"
  if isinstance(obj, list) and not all(_is_number(v) for v in obj):
    return "[\n" + ",\n".join(inner + dumps_json(v, level + 1) for v in obj) + f"\n{outer}]"
  return json.dumps(obj)


def write_json(path: str, obj: Any) -> None:
  """Writes `obj` as indented JSON (dumps_json: a list of numbers on one line), atomically."""
  atomic_write_text(path, dumps_json(_to_jsonable(obj)) + "\n")


def check_local_path(workdir: str, field: str = "--workdir") -> None:
  """Refuses a URI (gs://, s3://, ...) for a workdir: runs write with the filesystem (locks,
  atomic renames, orbax on a path), so such a string would become a local directory "gs:" on
  each host, and no host would hold a whole checkpoint."""
  if "://" in workdir:
    raise ValueError(
        f"{field}={workdir!r}: a URI, but workdirs are filesystem paths (a lock, atomic renames, "
        "checkpoints by path); give a directory every host sees, e.g. the bucket mounted with "
        "Cloud Storage FUSE (gcsfuse) or an NFS share")


def write_config(workdir: str, config: Any) -> None:
  """Writes a config (an ml_collections ConfigDict or a mapping) to workdir/config.json."""
  check_local_path(workdir)
  as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  write_json(os.path.join(workdir, "config.json"), as_dict)


def write_config_history(workdir: str, config: Any, start_step: int) -> str:
  """Records the config of one start of a resumable run without overwriting an earlier one:
  config.json for the first start, config.<start_step>.json for a start that resumes at
  start_step (config.<start_step>.<n>.json if that start happened before). Returns the path."""
  check_local_path(workdir)
  as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  first = os.path.join(workdir, "config.json")
  path = first if not os.path.exists(first) else os.path.join(workdir, f"config.{start_step}.json")
  n = 1
  while path != first and os.path.exists(path):
    path = os.path.join(workdir, f"config.{start_step}.{n}.json")
    n += 1
  write_json(path, as_dict)
  return path


# What a run writes that a fresh start (no checkpoint to resume) would overwrite or truncate.
RUN_OUTPUTS = ("metrics.jsonl", "samples.jsonl", "result.json", "tb", "hf_export")


def _move_to_previous(workdir: str, names: list[str]) -> str:
  """Moves workdir/<name> for each of `names` into a new workdir/previous/<n>/; returns it."""
  n = 1
  while os.path.exists(os.path.join(workdir, "previous", str(n))):
    n += 1
  dest = os.path.join(workdir, "previous", str(n))
  os.makedirs(dest)
  for name in names:
    os.replace(os.path.join(workdir, name), os.path.join(dest, name))
  return dest


def written_by(result: Any) -> Optional[str]:
  """The experiments binary (NAME of `python -m experiments.NAME`) whose command line a
  result's provenance records, or None (no provenance, another command, not a JSON object)."""
  prov = result.get("provenance") if isinstance(result, dict) else None
  command = str((prov if isinstance(prov, dict) else {}).get("command") or "")
  found = re.search(r"-m experiments\.(\w+)", command)
  return found.group(1) if found else None


def read_result(workdir: str, binary: str) -> dict:
  """workdir/result.json of experiments.`binary`, refused (a ValueError naming the file) when
  another experiments binary wrote it: what a redraw of a kept result reads."""
  path = os.path.join(workdir, "result.json")
  result = read_json_object(path)
  wrote = written_by(result)
  if wrote not in (None, binary):
    raise ValueError(f"{path}: written by experiments.{wrote}, not experiments.{binary}")
  return result


def workdir_writer(workdir: str) -> Optional[str]:
  """written_by of workdir/result.json; None without one, or when it does not read (a run's
  own torn result, rewritten at its end)."""
  path = os.path.join(workdir, "result.json")
  try:
    with open(path, encoding="utf-8") as f:
      return written_by(json.load(f))
  except (OSError, ValueError):
    return None


def refuse_foreign_result(workdir: str, binary: str, shown: str = "") -> None:
  """ForeignWorkdirError when workdir/result.json was written by another experiments binary
  than `binary` (its provenance), or workdir holds a sweep (its summary.json) and `binary` is
  not experiments.sweep, naming this one as `shown` (default experiments.<binary>): train_ppo,
  the sweep and the one-shot binaries each went on beside the other's outputs."""
  other = workdir_writer(workdir)
  if other is None and binary != "sweep" and os.path.exists(
      os.path.join(workdir, "summary.json")):
    other, what = "sweep", "summary.json"
  else:
    what = "result.json"
  if other is not None and other != binary:
    raise ForeignWorkdirError(f"--workdir={workdir!r} holds the outputs of experiments.{other} "
                              f"(its {what}); give {shown or 'experiments.' + binary} a "
                              "directory of its own")


def _running_binary() -> Optional[str]:
  """NAME when this process runs `python -m experiments.NAME`, else None."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  name = getattr(spec, "name", "") or ""
  return name.split(".", 1)[1] if name.startswith("experiments.") else None


def refuse_others_workdir(workdir: str) -> None:
  """start_outputs' refusals, for a one-shot binary that writes into `workdir` without moving
  anything (schedule_lp_check --verify's verify.json): a URI, a train_ppo or sweep workdir
  (checkpoints/, .lock), another one-shot binary's (its result.json's provenance)."""
  check_local_path(workdir)
  for marker, what in (("checkpoints", "a training run"), (".lock", "a training run or sweep")):
    if os.path.exists(os.path.join(workdir, marker)):
      raise ForeignWorkdirError(f"--workdir={workdir!r} holds {what} ({marker}); give "
                                "this binary a directory of its own")
  me = _running_binary()
  if me is not None:
    refuse_foreign_result(workdir, me)


def start_outputs(workdir: str, config: Any, outputs: tuple[str, ...],
                  inputs: tuple[Optional[str], ...] = ()) -> Optional[str]:
  """A one-shot binary's start on `workdir`: the files an earlier run of it left there (the
  `outputs` names or glob patterns, and config.json / traceback.txt) move into
  workdir/previous/<n>/, so no stale result, schedule, certificate or plot sits beside this
  run's and nothing is lost; then config.json is written. Anything else in the workdir (a
  user's notes, a log a `tee` writes, the sweep's log.txt) stays. One of this run's `inputs`
  among them (the schedule it goes on from) stays too, and a copy goes with the earlier run.
  A train_ppo workdir (checkpoints/, its .lock) is refused, and so is another one-shot binary's
  (its result.json's provenance names it): its reports and figures, which this binary does not
  move, stayed beside this run's result. Returns where the earlier outputs went, or None."""
  refuse_others_workdir(workdir)
  os.makedirs(workdir, exist_ok=True)
  roots = {os.path.abspath(workdir), os.path.realpath(workdir)}
  held = set()  # top-level entries holding an input (as given, or where a link points)
  for path in filter(None, inputs):
    for full in {os.path.abspath(path), os.path.realpath(path)}:
      for root in roots:
        rel = os.path.relpath(full, root)
        if rel != os.curdir and rel != os.pardir and not rel.startswith(os.pardir + os.sep):
          held.add(rel.split(os.sep)[0])
  patterns = ("config.json", "traceback.txt", *outputs)
  names = sorted(n for n in os.listdir(workdir)
                 if any(fnmatch.fnmatchcase(n, p) for p in patterns))
  dest = None
  if names:
    dest = _move_to_previous(workdir, [n for n in names if n not in held])
    for n in names:
      if n in held and os.path.isfile(os.path.join(workdir, n)):
        shutil.copy2(os.path.join(workdir, n), os.path.join(dest, n))
    logging.info("moved the earlier run's outputs in %s (%s) to %s", workdir,
                 ", ".join(names), dest)
  MOVED_ASIDE[:] = [dest] if dest else []
  write_config(workdir, config)
  return dest


# Where this process's start_outputs put the earlier outputs (said when the run is interrupted).
MOVED_ASIDE: list[str] = []


def set_aside_earlier_start(workdir: str) -> Optional[str]:
  """Moves the outputs of an earlier start that left no checkpoint (RUN_OUTPUTS and its
  config*.json) into workdir/previous/<n>/, so a fresh start neither truncates them nor leaves
  the earlier config.json describing it. Returns that directory, or None if there was nothing.
  A config*.json that no run wrote (a model's: the workdir is a Hugging Face model directory,
  maybe the run's own checkpoint) is ForeignWorkdirError, before anything moves: until
  2026-12-06 it moved aside like a run's, and the model directory lost its config.json."""
  configs = refuse_foreign_configs(workdir)
  names = [n for n in RUN_OUTPUTS if os.path.exists(os.path.join(workdir, n))] + configs
  return _move_to_previous(workdir, names) if names else None


def refuse_foreign_configs(workdir: str) -> list[str]:
  """The names of workdir's config*.json files (sorted; none if workdir is not a directory);
  ForeignWorkdirError when one of them no run wrote (_not_a_run_config): the workdir is then
  a model's directory, not a run's (train_ppo checks this before it writes anything there)."""
  configs = sorted(n for n in os.listdir(workdir) if n.startswith("config") and
                   n.endswith(".json")) if os.path.isdir(workdir) else []
  for name in configs:
    what = _not_a_run_config(os.path.join(workdir, name))
    if what:
      raise ForeignWorkdirError(
          f"--workdir={workdir!r} holds {name}, {what}: not a run's workdir (a run writes its "
          "own config.json there); give the run a directory of its own (nothing in this one "
          "was changed)")
  return configs


# Keys every Hugging Face model's config.json has (transformers' PretrainedConfig.to_dict writes
# model_type; save_pretrained adds architectures); a run's config (write_config) has the
# config's sections instead.
HF_CONFIG_KEYS = ("model_type", "architectures")


def _not_a_run_config(path: str) -> Optional[str]:
  """What the config*.json at `path` is when no run wrote it (the runs write JSON objects,
  atomically): 'a model's config (model_type ...)' or 'not a JSON object'; None otherwise."""
  try:
    obj = read_json_object(path)
  except ValueError:
    return "not a JSON object"
  keys = [k for k in HF_CONFIG_KEYS if k in obj]
  if keys:
    return f"a model's config ({keys[0]} {obj[keys[0]]!r})"
  return None


class ForeignWorkdirError(ValueError):
  """The workdir holds another binary's outputs (a one-shot binary given a training run's, or
  train_ppo another binary's): refused, and the refusal's traceback is kept out of it."""


class WorkdirInUseError(RuntimeError):
  """Another run holds the workdir's lock (a RuntimeError, as it always was; the binaries
  report it as one line, like bad input)."""


class LockWaitStopped(Exception):
  """WorkdirLock's wait for a holder on another host ended by its `stop` callback (a signal
  to stop came meanwhile): nothing was locked or written."""


class MainProcessError(RuntimeError):
  """What process i > 0 of a multi-process run raises when process 0 failed a step only it
  takes (parallel/distributed.run_on_main_process: the workdir lock, moving an earlier start's
  outputs aside, a shared cache). The cause and its traceback are process 0's; the binaries
  report this as one line naming process 0's log (it was a traceback on every other process,
  ending in a RuntimeError, beside process 0's one-line error)."""


def lock_token(workdir: str) -> int:
  """The start token of the run that holds (or last held) `workdir`'s lock (WorkdirLock), as
  this host reads it: -1 when there is none (no lock file, another format)."""
  try:
    with open(os.path.join(workdir, ".lock")) as f:
      m = re.search(r"\(start (\d+)\)", f.read())
  except OSError:
    return -1
  return int(m.group(1)) if m else -1


# NFSv4's default lease: a Linux NFS server drops a client's locks one lease after the client
# last renewed it (nfsd's nfsd4_lease, 90 s; its laundromat runs once a lease, so it can take up
# to about two leases).
NFS_LEASE_S = 90
_LOCK_HOLDER = re.compile(r"^pid (\d+) on (\S+) \(start \d+\)")


def lock_holder_host(holder: str) -> Optional[str]:
  """The host a `.lock` line ("pid N on HOST (start T)", WorkdirLock's) names; None for any
  other text."""
  m = _LOCK_HOLDER.match(holder)
  return m.group(2) if m else None


class WorkdirLock:
  """An exclusive lock on a workdir for the life of a run (fcntl.flock on workdir/.lock, which
  holds the holder's pid and host). A second run on the same workdir fails at once, naming the
  holder, instead of interleaving its metrics and checkpoints with the first. The kernel drops
  the lock when the holder exits, however it exits (kill -9 included).

  A holder on another host can be a dead one: on a shared filesystem the lock of a host that
  crashed lasts until the server's lease on that host ends (NFS_LEASE_S), and a job requeued
  onto another node right after the crash found its workdir "in use" and ended. `wait_s`: how
  long to wait for a holder on another host (polling, a log line every 30 s); a holder on this
  host is alive (its kernel would have dropped the lock) and fails at once. `wait_field`: the
  config field that sets wait_s, named in the refusal. `stop`: asked at every poll of the wait;
  True ends it with LockWaitStopped (a caller whose signal handler only records a SIGTERM kept
  waiting the whole wait_s, and its scheduler's SIGKILL came first)."""

  def __init__(self, workdir: str, wait_s: float = 0.0, wait_field: Optional[str] = None,
               stop: Optional[Callable[[], bool]] = None):
    self._f: Optional[Any] = None  # set first: __del__ runs even when open() below fails
    if not (isinstance(wait_s, (int, float)) and not isinstance(wait_s, bool) and
            0 <= wait_s < float("inf")):
      # (nan waited for ever: `waited >= nan` is never true)
      raise ValueError(f"{wait_field or 'wait_s'}={wait_s!r}: expected a finite number of "
                       "seconds >= 0")
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, ".lock")
    self._f = open(self.path, "a+")
    start, logged = time.monotonic(), None
    try:
      while True:
        try:
          fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
          break
        except OSError as e:
          # (after a holder was seen, any error is that holder's: never go on unlocked beside it)
          if logged is None and e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            # A filesystem without flock (some network mounts): run unlocked rather than never.
            logging.warning("cannot lock %s (%s): running without the one-run-per-workdir lock",
                            self.path, e)
            self._f.close()
            self._f = None
            return
        self._f.seek(0)
        holder = (self._f.read().strip().splitlines() or ["unknown"])[0]
        host = lock_holder_host(holder)
        waited = time.monotonic() - start
        elsewhere = host is not None and host != socket.gethostname()
        # (asked before the refusal: a signal in the last poll's interval is a stop too)
        if elsewhere and wait_s > 0 and stop is not None and stop():
          raise LockWaitStopped(f"stopped after waiting {waited:.0f} s for the lock of "
                                f"{workdir}, held by {holder}")
        if not elsewhere or waited >= wait_s:
          raise WorkdirInUseError(self._refusal(workdir, holder, host, waited, wait_s,
                                                wait_field)) from None
        if logged is None or waited - logged >= 30:
          logged = waited
          logging.warning("workdir %s is locked by %s, on another host; waiting up to %.0f s "
                          "more for it (a crashed host's lock lasts until the shared "
                          "filesystem's lease on it ends)", workdir, holder, wait_s - waited)
        time.sleep(min(2.0, max(wait_s - waited, 0.0)))
    except BaseException:
      # Nothing locked: no open file behind a refusal, a stop, or an error in `stop` or the wait.
      self._f.close()
      self._f = None
      raise
    if logged is not None:
      logging.info("workdir %s: locked after waiting %.0f s for the run on another host",
                   workdir, time.monotonic() - start)
    # A random token beside the holder: the processes of a multi-host run each read it back
    # (lock_token) to find a workdir that is not one directory on every host.
    self.token = random.SystemRandom().randrange(1, 2**31 - 1)
    self._f.seek(0)
    self._f.truncate()
    self._f.write(f"pid {os.getpid()} on {socket.gethostname()} (start {self.token})\n"
                  "# the lock of the run above while it lives (flock), free once it ends: do not "
                  "delete this file\n")
    self._f.flush()
    os.fsync(self._f.fileno())

  @staticmethod
  def _refusal(workdir: str, holder: str, host: Optional[str], waited: float, wait_s: float,
               wait_field: Optional[str]) -> str:
    msg = (f"workdir {workdir} is in use by another run ({holder}); wait for it to finish or "
           "stop it, or use another --workdir")
    if host is not None and host != socket.gethostname():
      msg += (f". If {host} is down (a crashed node), a shared filesystem keeps its lock until "
              f"the server's lease on it ends (NFSv4: {NFS_LEASE_S} s by default)")
      msg += (f"; waited {waited:.0f} s" if wait_s > 0 else "")
      if wait_field:
        msg += f" ({wait_field}={wait_s:g}: how long a start waits for that)"
      if waited >= 2 * NFS_LEASE_S:
        msg += (f". That is longer than two such leases: the run on {host} is most likely alive; "
                "check it, or wait longer if your server's lease is longer")
    return msg

  def held(self) -> bool:
    """Whether `path` is still the file this run locked: one deleted or replaced (taken for a
    stale pid file) lets another start lock a new one and write here beside this run."""
    if self._f is None:
      return True  # unlocked (no flock on this filesystem): nothing to lose
    try:
      now, ours = os.stat(self.path), os.fstat(self._f.fileno())
    except FileNotFoundError:
      return False
    return (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino)

  def moved_to(self) -> Optional[str]:
    """Where the locked file's directory is now when the workdir was moved or renamed while
    the run held it (Linux: the open file's /proc entry follows a rename); None when it was
    deleted, is unknown, or did not move (its lock file alone renamed)."""
    if self._f is None:
      return None
    try:
      now = os.readlink(f"/proc/self/fd/{self._f.fileno()}")
    except OSError:
      return None
    if (now.endswith(" (deleted)") or now == os.path.realpath(self.path) or
        os.path.basename(now) != os.path.basename(self.path)):
      return None  # (a .lock renamed inside the workdir: replaced, not moved)
    return os.path.dirname(now)

  def release(self) -> None:
    if self._f is not None:
      fcntl.flock(self._f, fcntl.LOCK_UN)
      self._f.close()
      self._f = None

  def __del__(self):
    self.release()


def os_error_text(e: OSError) -> str:
  """`OSError: [Errno 28] No space left on device`: the error's type and cause without the file
  it names (the caller's message names the file itself)."""
  cause = f"[Errno {e.errno}] {e.strerror}" if e.errno and e.strerror else str(e)
  return f"{type(e).__name__}: {cause}"


def read_failed(e: OSError, path: str) -> str:
  """How the one line of a failed read of the run's records or inputs begins (ReadError,
  trainer/inputs.py, hf_export.ExportInputError): `reading FILE failed: OSError: ...`, FILE the
  one the error names, else `path`."""
  return f"reading {e.filename or path} failed: {os_error_text(e)}"


@contextlib.contextmanager
def _naming(path: str):
  """Re-raises an OSError that names no file (a write's or fsync's ENOSPC) or a temp file as
  one on `path`: the one-line error of a full disk said only "No space left on device"."""
  try:
    yield
  except OSError as e:
    if e.errno is not None and (e.filename is None or
                                os.path.basename(str(e.filename)).startswith(TMP_PREFIX)):
      raise type(e)(e.errno, e.strerror, path) from e
    raise


def append_jsonl(path: str, record: Mapping[str, Any]) -> None:
  """Appends one JSON object as one line (flushed and fsynced: a crash loses at most this line).
  The line written to an empty file (the one that creates it, or follows a first line whose
  write failed) fsyncs its directory too, so that the file's name survives a power loss with
  its rows (until 2026-12-07 the first row of metrics.jsonl could be synced and its directory
  entry not); later lines do not (an fsync more per row, for a name on disk)."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  with _naming(path), open(path, "a") as f:
    first = f.tell() == 0  # (append mode opens at the end)
    f.write(json.dumps(_to_jsonable(record)) + "\n")
    f.flush()
    os.fsync(f.fileno())
  if first:
    with _naming(path):
      fsync_directory(directory)


def _unique_keys(pairs: list) -> dict:
  out = {}
  for key, value in pairs:
    if key in out:
      raise ValueError(f"the key {key!r} appears twice in one object; keep one")
    out[key] = value
  return out


def load_json(f: Any) -> Any:
  """json.load, but an object with a key given twice is a ValueError naming the key: Python's
  json keeps the last silently, so an edited file's first setting would be ignored."""
  return json.load(f, object_pairs_hook=_unique_keys)


def read_json_object(path: str, error: type = ValueError, invalid: str = "not valid JSON"
                     ) -> dict:
  """The JSON object in the file at `path`; `error` (a ValueError) naming the file otherwise:
  '{path}: {invalid} ({cause})' when it cannot be read or parsed, '{path}: expected a JSON
  object, got {type}' when it holds something else."""
  try:
    with open(path, encoding="utf-8") as f:
      obj = load_json(f)
  except (OSError, ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, not UTF-8
    raise error(f"{path}: {invalid} ({e})") from e
  if not isinstance(obj, dict):
    raise error(f"{path}: expected a JSON object, got {type(obj).__name__}")
  return obj


def keep_jsonl_through(path: str, step: int, rows: bool = True) -> list:
  """Rewrites the JSONL file at `path` (append_jsonl's, rows with a "step") without the rows of
  steps after `step`, atomically; returns the rows kept (rows=False: their steps alone, for a
  caller that needs no more: a row of metrics.jsonl held as a dict is ~8 KiB, ~1 GB over a
  100k-iteration run, at every start). A resumed run's logs (metrics.jsonl, samples.jsonl) so
  never repeat a step written after the checkpoint it resumed from. A file with nothing to drop
  (every line a row kept, a newline at its end: no torn last line) is left as it is: rewritten,
  every start of a long run wrote its whole log again (hundreds of MB)."""
  kept, dropped = [], False
  for _, row in _jsonl_rows(path):
    if row is None:  # a blank line or a torn last one
      dropped = True
      continue
    # A step that is not a number (a hand-edited row) failed in the comparison below with a
    # TypeError that named neither the file nor the row.
    if not isinstance(row.get("step", 0), (int, float)) or isinstance(row.get("step"), bool):
      raise ValueError(f"{path}: a row with step={row['step']!r}: expected an integer step "
                       "(the iteration it was written after); fix or remove that row")
    if row.get("step", 0) > step:
      dropped = True
      continue
    kept.append(row if rows else row.get("step"))
  if dropped:  # a second pass: the kept lines as they were written
    atomic_write_bytes(path, b"".join(line.rstrip(b"\r\n") + b"\n"
                                      for line, row in _jsonl_rows(path)
                                      if row is not None and row.get("step", 0) <= step))
  return kept


class ReadError(ValueError):
  """A file of the run's records that could not be read (a JSONL log: no permission, an I/O
  error, a directory in its place), or of its inputs (trainer/inputs.py hashes them at every
  start), named: a file to put right (config_files.run: exit 1, one line), not a traceback.
  Not an OSError, so that hooks.writing around a read before a write (a start dropping
  metrics.jsonl's rows after its checkpoint) does not report it as a failed write ("writing
  metrics.jsonl failed", exit 3: a full disk, where nothing was written)."""


def _jsonl_rows(path: str):
  """(line, row) for each line of a JSONL file written by `append_jsonl`, streamed: row None for
  a blank line and for a torn last line (crash mid-write), which also ends the file. Any other
  line that is not a JSON object (malformed, not UTF-8, an array or a number) is a ValueError
  naming the file and the line; a failed open or read, ReadError naming the file."""
  if not os.path.exists(path):
    return
  try:
    yield from _jsonl_lines(path)
  except OSError as e:  # (a generator's own: a consumer's errors never come back into it)
    raise ReadError(read_failed(e, path)) from e


def _jsonl_lines(path: str):
  """_jsonl_rows' rows, its OSErrors as they are."""
  with open(path, "rb") as f:
    line, i = f.readline(), 0
    while line:
      following, i = f.readline(), i + 1
      if not line.strip():
        yield line, None
        line = following
        continue
      try:
        row = json.loads(line.decode("utf-8"))
      except ValueError:  # JSONDecodeError, UnicodeDecodeError
        if not following:  # only the last line can be torn
          yield line, None
          return
        raise ValueError(f"{path}:{i}: malformed JSON line") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path}:{i}: expected a JSON object per line, got "
                         f"{type(row).__name__}")
      if not line.endswith(b"\n"):  # complete, but the file ends without its newline
        yield line, row
        yield b"", None  # (rewritten with it: the next append starts a line of its own)
        return
      yield line, row
      line = following


def iter_jsonl(path: str):
  """read_jsonl's rows one at a time (a long run's metrics.jsonl need not be held whole)."""
  for _, row in _jsonl_rows(path):
    if row is not None:
      yield row


def read_jsonl(path: str) -> list[dict]:
  """Reads a JSONL file written by `append_jsonl`; a torn last line (crash mid-write) is dropped.
  Any other line that is not a JSON object (malformed, not UTF-8, an array or a number) is a
  ValueError naming the file and the line: the callers read rows as objects."""
  return list(iter_jsonl(path))
