"""Running an experiments binary from another one (sweep.py, bench_async.py): the command
line with --config.* overrides, the environment that imports this repository, and a run whose
output is streamed with a prefix and kept in the run's log.txt; and the number format of the
binaries' reports (`fixed_or_sci`); what every result.json records about how it was made
(`provenance`, `write_result`). No absl flags are defined here, so binaries can share it."""
from __future__ import annotations

import copy
import ctypes
import hashlib
import json
import logging as py_logging
import logging.handlers
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.fields import is_seed_field


def fixed_or_sci(x: float, decimals: int, significant: int = 1) -> str:
  """`x` with `decimals` decimals where they show at least `significant` significant digits,
  else 3 significant digits in e-notation: a tiny model's figures (kilobytes, microseconds)
  and the LLaMA presets' (gigabytes, seconds) share one column."""
  small = 0 < abs(x) < 10.0 ** (significant - 1 - decimals)
  return f"{x:.2e}" if small else f"{x:.{decimals}f}"


def format_value(v: Any, element: bool = False) -> str:
  """A value as ml_collections parses it on the command line: a field's own string or bool
  as is, a tuple as a Python literal (ml_collections reads it with ast.literal_eval: its
  strings quoted, its bools True/False; unquoted, ('a.py', 'b.py') reached the run as the
  one string '(a.py,b.py)')."""
  if isinstance(v, (list, tuple)):
    return "(" + ",".join(format_value(x, True) for x in v) + ("," if len(v) == 1 else "") + ")"
  if element and isinstance(v, (str, bool)):
    return repr(v)
  if isinstance(v, bool):
    return "true" if v else "false"
  return str(v)


def caller_path(config: str) -> str:
  """`FILE[:variant]` with FILE made absolute when it is a file relative to this process's
  directory (the runs start in the repository root: run_streamed); otherwise as given (a
  configs/X.py of the repository)."""
  path, sep, variant = config.partition(":")
  if os.path.isfile(config):  # a ':' in the file's own name
    return os.path.abspath(config)
  return os.path.abspath(path) + sep + variant if os.path.isfile(path) else config


_TILDE_VALUE = re.compile(r"^(--?[\w.\-]+=)(~(?:/.*)?)$", re.DOTALL)


def home_expanded(argv: list[str]) -> list[str]:
  """`argv` with each `--name=~` or `--name=~/...` (or `-name=`) value's `~` made the home
  directory (config_files.parse_flags, the sweep's own --config.* flags and its runs' command
  lines, so the sweep records what its runs get; not a --flagfile's lines). The
  shell expands `~` only at the start of a word, so `--workdir=~/runs/a` reached the binary as
  typed: the run went into a directory named `~` under the current one, while its log line read
  like the home directory (and `rm -rf ~` is the obvious way to clean that up)."""
  out = list(argv[:1])
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":  # what follows is not flags
      return out + list(argv[i:])
    m = _TILDE_VALUE.match(arg)
    out.append(m.group(1) + os.path.expanduser(m.group(2)) if m else arg)
  return out


def build_command(binary: str, config: str, run_dir: str, overrides: dict,
                  passthrough: Sequence[str]) -> list[str]:
  """The run's command line. Paths the caller gave relative to its own directory (the config
  file, the run directory) are made absolute: the run starts in the repository root, where they
  named another file or put the results where the caller did not look."""
  cmd = [sys.executable, "-m", f"experiments.{binary}", f"--config={caller_path(config)}",
         f"--workdir={os.path.abspath(run_dir)}"]
  cmd += [f"--config.{k}={format_value(v)}" for k, v in overrides.items() if k != "name"]
  return home_expanded(cmd + list(passthrough))


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Set in a run's environment by run_streamed: its parent keeps the run's whole output in the
# run's log.txt, so the run does not write one of its own (RunLog).
LOG_KEPT_ENV = "RLHFUSE_LOG_KEPT_BY_PARENT"


# Libraries whose ERROR records come with tracebacks of their own threads: orbax logs one
# (~35 lines) per thread of a failed checkpoint save (4-5 threads for one save on a full disk,
# measured: ~320 lines above the run's one-line error naming the cause).
LIBRARY_TRACEBACKS = ("orbax", "tensorstore")


class _LogFile(py_logging.FileHandler):
  """log.txt's handler. A write that fails (the workdir's disk is full: a checkpoint save
  failing for it comes next) is said once on stderr and the file is left alone from then on;
  logging's own handling printed a ~40-line "--- Logging error ---" traceback per record."""

  failed: Optional[str] = None  # why the file is no longer written

  def handleError(self, record: py_logging.LogRecord) -> None:
    error = sys.exc_info()[1]
    if not isinstance(error, OSError):  # a record that does not format: logging's own report
      super().handleError(record)
      return
    if self.failed is None:
      self.failed = f"{type(error).__name__}: {error}"
      sys.stderr.write(f"{self.baseFilename}: cannot write ({self.failed}); the rest of this "
                       f"run's log is on stderr only\n")

  def emit(self, record: py_logging.LogRecord) -> None:
    if self.failed is None:
      super().emit(record)


class _LibraryTracebacksElsewhere(py_logging.Formatter):
  """The stderr formatter of a run that keeps a log file: a library's record (LIBRARY_TRACEBACKS)
  prints its message on stderr and its traceback only into the file, which has written it
  first (RunLog puts its handler ahead of absl's); once the file cannot be written, stderr
  keeps the whole record. Formats a copy: the file's handler formatted the record itself."""

  def __init__(self, inner: py_logging.Formatter, file: _LogFile):
    super().__init__()
    self.inner, self._file = inner, file
    self._markers = tuple(f"/{p}/" for p in LIBRARY_TRACEBACKS)

  def format(self, record: py_logging.LogRecord) -> str:
    if (self._file.failed is None and (record.exc_info or record.exc_text) and
        any(m in record.pathname for m in self._markers)):
      record = copy.copy(record)
      record.msg, record.args = (f"{record.getMessage()} (traceback: "
                                 f"{self._file.baseFilename})"), ()
      record.exc_info = record.exc_text = record.stack_info = None
    return self.inner.format(record)


class RunLog:
  """A run's log in its workdir: log.txt (process i > 0 of a multi-host run: log.proc<i>.txt),
  appended to under a header line per start, holding what the run logged (absl's and the
  libraries' records, as on stderr) from the start of main, and the traceback of an error that
  ended it (`exception`). Records before `keep_in` (the workdir lock held) are buffered: a
  start refused for a workdir another run holds writes nothing there. Nothing at all when a
  parent (sweep, bench_async: run_streamed) keeps the run's whole output in its log.txt. Once
  the file is written, orbax's and tensorstore's tracebacks go there alone (stderr gets their
  message line)."""

  def __init__(self):
    self.path: Optional[str] = None
    self.where = "kept by the caller"  # where the log goes, said when the workdir is locked
    self._started = time.strftime('%Y-%m-%d %H:%M:%S')
    self._file: Optional[_LogFile] = None
    self._stderr_formatter: Optional[py_logging.Formatter] = None  # absl's, while replaced
    self._kept_by_parent = bool(os.environ.get(LOG_KEPT_ENV))
    self._buffer = py_logging.handlers.MemoryHandler(capacity=100_000,
                                                     flushLevel=py_logging.CRITICAL + 10)
    if not self._kept_by_parent:
      py_logging.getLogger().addHandler(self._buffer)

  def keep_in(self, workdir: str, process_index: int = 0) -> Optional[str]:
    """Starts writing to the workdir's log (the buffered records first); returns its path."""
    if self._kept_by_parent or self._file is not None:
      return self.path
    from absl import logging as absl_logging  # the format of absl's stderr lines
    name = "log.txt" if process_index == 0 else f"log.proc{process_index}.txt"
    path = os.path.join(workdir, name)
    try:
      self._file = _LogFile(path, mode="a", encoding="utf-8")
    except OSError as e:  # a full disk (no room for a new file): as a write that fails, said once
      # (it ended the run, exit 1 with a traceback; a full disk stops it at the run's own next
      # write instead: exit 3, the checkpoint kept in one line)
      sys.stderr.write(f"{path}: cannot write ({type(e).__name__}: {e}); this run's log is on "
                       "stderr only\n")
      py_logging.getLogger().removeHandler(self._buffer)  # (stderr had its records)
      self.where = "stderr only"
      return None
    self.path = self.where = path
    self._file.setFormatter(absl_logging.PythonFormatter())
    for f in absl_logging.get_absl_handler().filters:  # what stderr leaves out (libraries' INFO)
      self._file.addFilter(f)
    self._file.stream.write(f"=== {self._started}: {command_line()}\n")
    root = py_logging.getLogger()
    self._buffer.setTarget(self._file)
    self._buffer.flush()
    root.removeHandler(self._buffer)
    root.handlers.insert(0, self._file)  # ahead of absl's stderr handler: written first
    stderr = absl_logging.get_absl_handler().python_handler
    self._stderr_formatter = stderr.formatter
    stderr.setFormatter(_LibraryTracebacksElsewhere(stderr.formatter, self._file))
    return self.path

  def exception(self, message: str) -> None:
    """The exception being handled, with its traceback, into the log file only (stderr gets
    Python's own print of it)."""
    if self._file is not None:
      record = py_logging.getLogger("absl").makeRecord(
          "absl", py_logging.ERROR, __file__, 0, message, (), sys.exc_info())
      self._file.handle(record)

  def close(self) -> None:
    if self._stderr_formatter is not None:
      from absl import logging as absl_logging
      absl_logging.get_absl_handler().python_handler.setFormatter(self._stderr_formatter)
      self._stderr_formatter = None
    root = py_logging.getLogger()
    for handler in (self._buffer, self._file):
      if handler is not None:
        root.removeHandler(handler)
        try:
          handler.close()
        except OSError:  # its flush on a full disk (said once already): the run's exit goes on
          pass


def repo_env(**extra: str) -> dict:
  """This environment with the repository importable (and `extra` variables set)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.update(extra)
  return env


class RunInterrupted(KeyboardInterrupt):
  """A KeyboardInterrupt that came while run_streamed's run went on; raised once the run has
  ended, with its exit status."""

  def __init__(self, returncode: int):
    super().__init__(returncode)
    self.returncode = returncode


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Set by run_streamed to its process's pid: the binary it starts dies with it (die_with_parent).
PARENT_ENV = "RLHFUSE_DIE_WITH_PARENT"


def die_with_parent() -> None:
  """Called first in every binary (config_files.run): where the process that started this one
  through run_streamed named itself in PARENT_ENV, this one receives SIGTERM when that process
  dies (Linux's prctl(PR_SET_PDEATHSIG); elsewhere, or without libc's prctl, nothing). A sweep
  killed with kill -9 (the OOM killer's) left its run going alone: its output, which reaches
  log.txt only through the sweep, was lost, and it held its workdir, so an immediate re-run
  failed that run with WorkdirInUseError. SIGTERM is what train_ppo saves on and exits 75.
  Set here, not in a preexec_fn: that makes subprocess fork with Python's fork hooks, and jax,
  imported in the sweep, warned of a likely deadlock at every run's start. The variable is
  removed, so the processes this one starts (a launcher's) do not take it for theirs. The
  signal comes when the thread that started the process ends (prctl(2)): run_streamed's
  thread waits for its run."""
  parent = os.environ.pop(PARENT_ENV, None)
  if parent is None or not sys.platform.startswith("linux"):
    return
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return
  prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
  if str(os.getppid()) != parent:  # it died before prctl ran: no signal will come
    os.kill(os.getpid(), signal.SIGTERM)


def run_streamed(cmd: Sequence[str], run_dir: str, name: str, env: dict,
                 started: Optional[Callable[[subprocess.Popen], None]] = None,
                 prefix: Optional[str] = None) -> int:
  """Runs `cmd` from the repository root, its output streamed with a [name] prefix ([prefix]
  when given: the sweep's "3/16 e2", its place in the sweep as its own lines say it) and
  appended to run_dir/log.txt after a header line (a re-run, e.g. a resumed sweep, keeps the
  earlier runs' logs); returns its exit status. `started` gets the process once it runs (a
  caller that passes signals on; called again if a Ctrl-C cut it short, so it must be
  idempotent). A KeyboardInterrupt (Ctrl-C, which reaches the run too: it shares this
  process's group) waits for the run to end and its output to be copied, then raises
  RunInterrupted with its exit status (a caller called a run that had finished
  "interrupted"). The run's stdin is /dev/null: one that read it (a leftover breakpoint())
  waited forever for a terminal it could not read. An error writing log.txt (a full disk) is
  raised once the run has ended (logged, where a Ctrl-C came too); the run's output is drained
  meanwhile, so that it neither blocks nor dies of a broken pipe."""
  proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace",
                          cwd=REPO_ROOT,
                          env={**env, LOG_KEPT_ENV: "1", PARENT_ENV: str(os.getpid())})
  copied = threading.Event()
  with _LIVE_LOCK:
    LIVE[proc] = copied
  try:
    return _stream(proc, cmd, run_dir, name, started, prefix or name, copied)
  finally:
    if proc.poll() is not None:  # one still going (an error here): config_files waits for it
      with _LIVE_LOCK:
        LIVE.pop(proc, None)


# The runs run_streamed has going, from any thread (bench_async runs several at once), each
# with the Event its output's copy sets when done: an interrupted binary passes SIGTERM on to
# them and waits for them and their output (config_files.run); they were left running alone,
# unlogged, holding their workdirs, and a run's last lines were lost when the binary exited
# as the run did.
LIVE: dict = {}
# Re-entrant: the SIGTERM handler (config_files) reads LIVE in the main thread, which may hold
# the lock when the signal comes (run_streamed called there).
_LIVE_LOCK = threading.RLock()


def live_runs() -> list:
  with _LIVE_LOCK:
    return list(LIVE)


def wait_output(proc, timeout_s: float) -> bool:
  """Waits up to timeout_s for run_streamed's copy of `proc`'s output to log.txt to end (a run
  that has exited: its last lines); whether it has."""
  with _LIVE_LOCK:
    copied = LIVE.get(proc)
  return copied is None or copied.wait(timeout_s)


def _stream(proc, cmd: Sequence[str], run_dir: str, name: str,
            started: Optional[Callable[[subprocess.Popen], None]], prefix: str,
            copied: threading.Event) -> int:
  header = f"=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd[1:])}\n"
  failed: list = []

  def copy_output():
    echo = True
    try:
      os.makedirs(run_dir, exist_ok=True)
      # Line-buffered: `tail -f log.txt` follows the run as it goes (it saw nothing until the
      # end).
      with open(os.path.join(run_dir, "log.txt"), "a", buffering=1) as log_file:
        log_file.write(header)
        for line in proc.stdout:
          log_file.write(line)
          if echo:
            try:
              print(f"[{prefix}] {line}", end="", flush=True)
            except (OSError, ValueError):  # this process's stdout gone: log.txt keeps the lines
              echo = False
    except BaseException as e:  # noqa: BLE001 re-raised by the main thread below
      failed.append(e)
      try:  # drained, so that the run neither blocks on a full pipe nor dies of a broken one
        for _ in proc.stdout:
          pass
      except (OSError, ValueError):
        pass
    finally:
      copied.set()

  interrupted = []

  def note_interrupt():
    # The run got the Ctrl-C too: it finishes its iteration and saves (a second one stops it
    # at once); keep its last lines. (A SIGINT sent to this process alone does not reach the
    # run: SIGTERM is the signal this process passes on, sweep._Signals.)
    if not interrupted:
      from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
      absl_logging.warning("interrupted: waiting for %s to end (the Ctrl-C reached it too; a "
                           "SIGINT sent to this process alone did not: SIGTERM to this "
                           "process stops the run)", name)
    interrupted.append(True)

  # The output is copied (and log.txt opened) by a thread of its own: the KeyboardInterrupt
  # of a Ctrl-C comes in the main thread, and there it could come between reading a line and
  # writing it, losing the line. When the signal reached another of this process's threads,
  # the main thread's read went on, and the interrupt came with the next line: the run's own
  # "interrupted: stopped before it finished", lost from its log.txt (a flaky CI failure,
  # 2026-12-05). Its end is an Event's, not the thread's: a KeyboardInterrupt inside
  # Thread.join marks the thread stopped while it still runs (CPython 3.11's
  # _wait_for_tstate_lock), and the caller went on to exit before the last line was written.
  copier = threading.Thread(target=copy_output, name=f"output of {name}", daemon=True)
  while True:  # a Ctrl-C here too: the run is not left unread and unwaited for
    try:
      if started is not None:
        started(proc)
      break
    except KeyboardInterrupt:
      note_interrupt()
  try:
    copier.start()
  except KeyboardInterrupt:  # (start's wait for the thread to run, which it does)
    note_interrupt()
  while True:
    try:
      while not copied.wait(0.2):  # bounded: a Ctrl-C is seen within it, whichever thread got it
        pass
      rc = proc.wait()
      break
    except KeyboardInterrupt:
      note_interrupt()
  if interrupted:
    if failed:  # the Ctrl-C's way out (the caller's summary and 130), the error said first
      from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
      absl_logging.error("%s: writing %s failed: %s", name, os.path.join(run_dir, "log.txt"),
                         failed[0])
    raise RunInterrupted(rc)
  if failed:
    raise failed[0]
  return rc


def merge_rows(workdir: str, rows: list[dict], names: Sequence[str]) -> list[dict]:
  """This start's `rows` and, for the runs of the sweep (`names`, in its order) that it did not
  run (`--only`, or a start stopped before their turn), their rows of the earlier summary.json:
  re-running one entry keeps the others' results in the summary."""
  try:
    with open(os.path.join(workdir, "summary.json")) as f:
      earlier = json.load(f)
  except (OSError, ValueError):  # none yet, or unreadable: this start's rows alone
    earlier = []
  old = {r.get("run"): r for r in earlier if isinstance(r, dict)} if isinstance(
      earlier, list) else {}
  new = {r["run"]: r for r in rows}
  return [new.get(n) or old[n] for n in names if n in new or n in old]


# CPU features that change the machine code XLA:CPU emits for this host, and with it float
# rounding (vector widths change reduction orders; FMA contracts multiply-adds): two hosts both
# named "AMD EPYC" gave the same tiny PPO run 0.71 and 0.43 after 200 iterations, at the same
# commit (docs/results.md), and the model name alone could not tell them apart.
CODEGEN_CPU_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                     "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve")


def host_cpu(cpuinfo: str = "/proc/cpuinfo") -> str:
  """The host processor: its model name, and on Linux its family/model/stepping and the
  instruction sets that change XLA:CPU's code (CODEGEN_CPU_FLAGS), e.g. "AMD EPYC (family 25
  model 1 stepping 1; avx avx2 fma)"; elsewhere what `platform` knows."""
  fields: dict[str, str] = {}
  try:
    with open(cpuinfo) as f:
      for line in f:
        if not line.strip():
          break  # the first processor's block: every core of a host is the same model
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
  except OSError:
    pass
  name = fields.get("model name")
  if not name:
    return platform.processor() or platform.machine()
  ident = " ".join(f"{k} {fields[k]}" for k in ("cpu family", "model", "stepping")
                   if fields.get(k)).replace("cpu family", "family")
  present = set(fields.get("flags", fields.get("Features", "")).split())
  isa = " ".join(f for f in CODEGEN_CPU_FLAGS if f in present)
  detail = "; ".join(x for x in (ident, isa) if x)
  return f"{name} ({detail})" if detail else name


def git_commit() -> Optional[str]:
  """This repository's commit (12 hex digits; `-dirty` with uncommitted changes to tracked
  files), or None outside a git checkout."""
  def git(*args):
    return subprocess.run(["git", "-C", REPO_ROOT, *args], capture_output=True, text=True,
                          timeout=10)
  try:
    head, status = git("rev-parse", "--short=12", "HEAD"), git("status", "--porcelain",
                                                                "--untracked-files=no")
  except (OSError, subprocess.SubprocessError):
    return None
  if head.returncode != 0 or not head.stdout.strip():
    return None
  return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def git_changes() -> Optional[str]:
  """A short hash of the uncommitted changes to tracked files (`git diff HEAD`), None for a
  clean checkout or outside one: what tells two "-dirty" runs of one commit apart (a sweep
  keeps a finished run only if its code is this checkout's)."""
  try:
    diff = subprocess.run(["git", "-C", REPO_ROOT, "diff", "HEAD", "--binary"],
                          capture_output=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  if diff.returncode != 0 or not diff.stdout:
    return None
  return hashlib.sha1(diff.stdout).hexdigest()[:12]


def code_state() -> tuple[Optional[str], Optional[str]]:
  """(git_commit, git_changes) of this checkout, as provenance records them."""
  return git_commit(), git_changes()


_START: dict = {}  # the run's start, as note_start read it


def note_start() -> None:
  """Reads the date, git commit and command line at the start of a run (config_files.run
  calls it): a long run's result records the code it started from, even if the checkout
  changed under it."""
  _START.clear()
  commit, changes = code_state()
  _START.update(started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), git_commit=commit,
                git_changes=changes, start_time=time.time())


def start_time() -> Optional[float]:
  """The time.time() of this run's start as note_start read it; None before."""
  return _START.get("start_time")


def clear_earlier_traceback(workdir: str) -> None:
  """Removes workdir/traceback.txt when an earlier start wrote it (a run that failed, was
  corrected and has now finished or stopped): it sat beside the results as if this run had
  failed. Nothing is lost: train_ppo's log.txt keeps every start's traceback."""
  path = os.path.join(workdir, "traceback.txt")
  try:
    if os.path.getmtime(path) < _START.get("start_time", 0.0):
      os.remove(path)
  except OSError:
    pass


def start_code() -> str:
  """The code this run started from, as processes that must run the same code compare it: the
  git commit ("?" outside a checkout) and a hash of its uncommitted changes, if any (two
  checkouts of one commit, edited apart, both read "<commit>-dirty")."""
  commit, changes = _START.get("git_commit") or "?", _START.get("git_changes")
  return f"{commit} (uncommitted changes {changes})" if changes else commit


def command_line() -> str:
  """This process's command line as a shell would take it back (quoted where needed), an
  experiments binary written as `python -m experiments.NAME`."""
  prog = os.path.relpath(os.path.abspath(sys.argv[0]), REPO_ROOT) if sys.argv else ""
  head = (["python", "-m", prog[:-3].replace(os.sep, ".")]
          if prog.startswith("experiments" + os.sep) and prog.endswith(".py") else
          ["python", *sys.argv[:1]])
  return shlex.join(head + sys.argv[1:])


def seed_groups(rows: Sequence[dict], override_keys: Sequence[str]) -> list[tuple[dict, list]]:
  """The sweep's finished runs ("ok" status) that differ only in their seed fields
  (is_seed_field), grouped: (the group's values of the other overridden fields, its rows) for
  each group of at least two runs with different seeds, in the order of their first run. None
  of `override_keys` a seed field: no groups. Runs that got the same seeds (the sweep's own
  --config.seed overrides every entry's) are no group: their spread would be the runs'
  nondeterminism, not the seeds'."""
  seeds = [k for k in override_keys if is_seed_field(k)]
  if not seeds:
    return []
  others = [k for k in override_keys if k not in seeds]
  groups: dict = {}
  for row in rows:
    if str(row.get("status", "")).startswith("ok"):
      key = json.dumps([row.get(k) for k in others], default=str)
      groups.setdefault(key, ({k: row[k] for k in others if k in row}, []))[1].append(row)
  distinct = lambda members: len({json.dumps([r.get(k) for k in seeds], default=str)
                                  for r in members}) == len(members)
  return [g for g in groups.values() if len(g[1]) >= 2 and distinct(g[1])]


def across_seeds(rows: Sequence[dict], override_keys: Sequence[str]) -> list[dict]:
  """One row per seed group (seed_groups): its other overrides, `seeds` (how many), `runs`
  (their names) and, for every numeric column that every run of the group has and that differs
  between runs of some group (the rest are settings the per-run rows show), `COL/mean` and
  `COL/std` (sample standard deviation, n - 1)."""
  import math  # pylint: disable=import-outside-toplevel
  import statistics  # pylint: disable=import-outside-toplevel

  def number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)
  groups = seed_groups(rows, override_keys)
  # wall_s: the time of the sweep's starts of the run (a training run's summed over its
  # resumes; a one-shot run's last start), not a result of it
  # result/KEY: a result.json's echo of an overridden field (schedule_search's seed), which
  # the seeds table showed as a result ("result/seed 1 ± 1")
  skip = set(override_keys) | {f"result/{k}" for k in override_keys} | {"run", "status",
                                                                        "wall_s"}
  columns = list(dict.fromkeys(k for _, members in groups for r in members for k in r
                               if k not in skip))
  varying = [c for c in columns if any(
      all(number(r.get(c)) for r in members) and len({r[c] for r in members}) > 1
      for _, members in groups)]
  out = []
  for values, members in groups:
    row = {**values, "seeds": len(members), "runs": ",".join(str(r["run"]) for r in members)}
    for c in varying:
      xs = [r.get(c) for r in members]
      if all(number(x) for x in xs):
        finite = all(math.isfinite(x) for x in xs)
        row[f"{c}/mean"] = statistics.fmean(xs) if finite else float("nan")
        row[f"{c}/std"] = statistics.stdev(xs) if finite else float("nan")
    out.append(row)
  return out


def smooth(x, width: int):
  """Trailing moving average of the 1-d array `x` (the first points average what there is)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  x = np.asarray(x, np.float64)
  c = np.cumsum(np.insert(x, 0, 0.0))
  idx = np.arange(1, len(x) + 1)
  lo = np.maximum(idx - width, 0)
  return (c[idx] - c[lo]) / (idx - lo)


def provenance() -> dict:
  """When, from which code, by which command and on what a result was made: the date it was
  written and (through config_files.run) the run's start, the git commit at the start (`-dirty`
  with uncommitted changes, and then `git_changes`, a hash of them), the command line, the
  host (processor, cores, Python) and, when the binary used jax, its version and devices."""
  commit, changes = (_START["git_commit"], _START.get("git_changes")) if _START else code_state()
  out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": commit,
         "command": command_line(), "host": platform.node(),
         "host_cpu": host_cpu(), "host_cores": os.cpu_count(),
         "python": platform.python_version()}
  if changes:
    out["git_changes"] = changes
  if _START:
    out["started"] = _START["started"]
  jax = sys.modules.get("jax")
  if jax is not None:
    devices = jax.devices()
    out.update(jax=jax.__version__, platform=devices[0].platform,
               device_kind=devices[0].device_kind, num_devices=len(devices),
               num_processes=jax.process_count())
  return out


def write_result(workdir: str, result: dict, name: str = "result.json",
                 ran_on: Optional[dict] = None) -> str:
  """Writes `result` with its `provenance` to workdir/name (atomically); returns the path.
  `ran_on`: provenance fields that say where the measured work ran, for a binary whose runs
  are other processes (bench_async's train_ppo runs, each with its own device count): they
  replace this process's own jax devices."""
  path = os.path.join(workdir, name)
  wd.write_json(path, {**result, "provenance": {**provenance(), **(ran_on or {})}})
  return path


if __name__ == "__main__":
  raise SystemExit("experiments/runner.py is a library of the binaries, not one "
                   "(docs/usage.md lists them)")
