"""experiments/runner.run_streamed under a Ctrl-C: no line of the run is lost."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from experiments import runner
from tests.xla_env import RESET_SIGINT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What each parent below starts with: the run (it says "ready", then on SIGINT its closing
# line 0.3 s later and exits 130); log.txt's write of that line made 0.5 s late (a loaded
# machine's scheduling: the caller must still find it in the file once run_streamed or
# _stop_runs returns); `when_ready(fn)`: fn called in a thread once the run has said "ready"
# (a file it makes then: log.txt may be unwritable).
_COMMON = r"""
import json, os, signal, sys, threading, time
from experiments import runner
work = sys.argv[1]
# (its words split in its source, which log.txt's header line repeats)
CHILD = ("import os, sys, time\n"
         "print('rea' 'dy', flush=True)\n"
         "open(os.environ['RUN_UP'], 'w').close()\n"
         "try:\n"
         "  time.sleep(60)\n"
         "except KeyboardInterrupt:\n"
         "  time.sleep(0.3)\n"
         "  print('clos' 'ing line', flush=True)\n"
         "  sys.exit(130)\n")
assert "ready" not in CHILD and "closing" not in CHILD


class SlowLog:
  def __init__(self, f):
    self.f = f

  def write(self, text):
    if "closing" in text:
      time.sleep(0.5)
    return self.f.write(text)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.f.close()


real_open = open
runner.open = lambda *a, **k: SlowLog(real_open(*a, **k))


os.environ["RUN_UP"] = os.path.join(work, "run_up")  # the run's sign (runner.repo_env passes it)


def when_ready(fn):
  def wait():
    deadline = time.time() + 60
    while not os.path.exists(os.environ["RUN_UP"]):  # (made just before its try: block)
      assert time.time() < deadline
      time.sleep(0.05)
    fn()
  threading.Thread(target=wait, daemon=True).start()


def streamed(started=None):
  out = {}
  try:
    out["rc"] = runner.run_streamed([sys.executable, "-c", CHILD], work, "r",
                                    runner.repo_env(), started=started)
  except runner.RunInterrupted as e:
    out["interrupted"] = e.returncode
  return out
"""

# A second thread that the SIGINT reaches (as the kernel may pick any thread of a process for
# a Ctrl-C), then the run's own SIGINT.
_OTHER_THREAD = _COMMON + r"""
hold = threading.Event()
other = threading.Thread(target=hold.wait, daemon=True)
other.start()


def started(proc):
  def interrupt():
    signal.pthread_kill(other.ident, signal.SIGINT)  # this process's Ctrl-C, on another thread
    proc.send_signal(signal.SIGINT)  # the run's
  when_ready(interrupt)
print(json.dumps(streamed(started)))
"""

# The Ctrl-C comes while `started` runs (before the output's copy has begun): `started` is
# called again, and the run is waited for and its output copied all the same.
_IN_STARTED = _COMMON + r"""
calls = []


def started(proc):
  calls.append(1)
  if len(calls) == 1:
    when_ready(lambda: proc.send_signal(signal.SIGINT))
    raise KeyboardInterrupt
out = streamed(started)
out["started_calls"] = len(calls)
print(json.dumps(out))
"""

# config_files._stop_runs (an interrupted binary's way out, then exit_now) waits for a run
# that run_streamed copies in a worker thread (bench_async's): for its exit and its last line.
_STOP_RUNS = _COMMON + r"""
from experiments import config_files
ready = threading.Event()
worker = threading.Thread(target=streamed, daemon=True)
worker.start()
when_ready(ready.set)
ready.wait(60)
config_files._stop_runs(signal.SIGINT)
log = real_open(os.path.join(work, "log.txt")).read()
print(json.dumps({"log_has_it": log.endswith("\nready\nclosing line\n")}))
"""


def _parent(script, work, **kw):
  return subprocess.run([*RESET_SIGINT, sys.executable, "-c", script, str(work)], cwd=REPO,
                        env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                        timeout=120, **kw)


def test_a_ctrl_c_on_another_thread_keeps_the_runs_closing_line(tmp_path):
  """A Ctrl-C that reached another of the caller's threads left its main thread reading the
  run's output; the KeyboardInterrupt then came with the next line (the run's own closing
  "interrupted: stopped before it finished"), and that line was missing from log.txt (a flaky
  CI failure of test_sigterm_to_the_sweep_stops_its_run_and_the_sweep, reproduced 4 times in 6
  this way). The output is copied by a thread of its own now, and run_streamed returns once
  that thread has written the last line, however late (here 0.5 s): waited for with
  Thread.join, a Ctrl-C inside the join marked the thread stopped and the caller left early."""
  proc = _parent(_OTHER_THREAD, tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.splitlines()[-1]) == {"interrupted": 130}
  log = (tmp_path / "log.txt").read_text()
  assert log.endswith("\nready\nclosing line\n"), log[-300:]
  assert "[r] closing line" in proc.stdout
  assert "interrupted: waiting for r to end" in proc.stderr


def test_a_ctrl_c_while_the_run_starts_still_waits_for_it_and_its_output(tmp_path):
  """A Ctrl-C before the wait began (here in `started`, the sweep's hook) escaped as a bare
  KeyboardInterrupt: the run was dropped from runner.LIVE while it went on, its output unread
  and its log.txt unwritten. Now `started` is called again, and the run is waited for and
  logged as after any Ctrl-C."""
  proc = _parent(_IN_STARTED, tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.splitlines()[-1]) == {"interrupted": 130, "started_calls": 2}
  log = (tmp_path / "log.txt").read_text()
  assert log.endswith("\nready\nclosing line\n"), log[-300:]


def test_a_failed_log_and_a_ctrl_c_end_as_the_ctrl_c(tmp_path):
  """log.txt unwritable (a full disk) and a Ctrl-C: RunInterrupted (the sweep's row and its
  exit 130), the write error logged; the OSError came out instead, and the sweep had no row,
  no summary and a traceback."""
  (tmp_path / "log.txt").symlink_to("/dev/full")
  proc = _parent(_IN_STARTED, tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.splitlines()[-1]) == {"interrupted": 130, "started_calls": 2}
  assert "r: writing " in proc.stderr and "No space left on device" in proc.stderr


def test_stop_runs_waits_for_a_runs_last_line(tmp_path):
  """config_files._stop_runs, an interrupted binary's last step before exit_now, waited for its
  runs to exit but not for their output's copy: exit_now then cut log.txt short of the run's
  last line (bench_async's runs, copied in worker threads)."""
  proc = _parent(_STOP_RUNS, tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.splitlines()[-1]) == {"log_has_it": True}


def test_a_log_that_cannot_be_written_fails_after_the_run_ends(tmp_path):
  """An error writing log.txt (here a full disk: /dev/full) is raised once the run has ended,
  and the run is not left blocked on a pipe nobody reads: it says 200 000 lines (many pipe
  buffers) and ends."""
  (tmp_path / "log.txt").symlink_to("/dev/full")
  run = "import sys\nfor i in range(200000): print(i)\nopen(sys.argv[1], 'w').close()\n"
  script = ("import sys\n"
            "from experiments import runner\n"
            "try:\n"
            f"  runner.run_streamed([sys.executable, '-c', {run!r}, sys.argv[1] + '/done'],\n"
            "                      sys.argv[1], 'r', runner.repo_env())\n"
            "except OSError as e:\n"
            "  print('raised:', e.strerror)\n")
  proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO,
                        env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.splitlines()[-1] == "raised: No space left on device"
  assert (tmp_path / "done").exists()  # the run's last act, after its 200 000 lines


# A parent that starts a run through run_streamed and waits; the run says its pid, and on
# SIGTERM (train_ppo's save-and-exit-75 signal) leaves a mark and exits 75.
_ORPHAN_PARENT = r"""
import os, sys
from experiments import runner
work = sys.argv[1]
CHILD = ("import os, signal, sys, time\n"
         "from experiments import runner\n"
         "runner.die_with_parent()  # as config_files.run does first in every binary\n"
         "def term(*_):\n"
         "  open(sys.argv[1] + '/terminated', 'w').close()\n"
         "  os._exit(75)\n"
         "signal.signal(signal.SIGTERM, term)\n"
         "with open(sys.argv[1] + '/child.tmp', 'w') as f:\n"
         "  f.write(str(os.getpid()))\n"
         "os.rename(sys.argv[1] + '/child.tmp', sys.argv[1] + '/child')\n"
         "time.sleep(60)\n")
runner.run_streamed([sys.executable, "-c", CHILD, work], work, "r", runner.repo_env())
"""


def _running(pid: int) -> bool:
  """Whether `pid` runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_a_run_ends_when_its_parent_is_killed_with_sigkill(tmp_path):
  """kill -9 of a sweep (the OOM killer's) left its train_ppo run going alone, holding its
  workdir (an immediate re-run failed that run with WorkdirInUseError) and writing its log
  nowhere. The run now gets SIGTERM when its parent dies (train_ppo saves and exits 75)."""
  parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT, str(tmp_path)], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
  child_file = tmp_path / "child"
  deadline = time.time() + 60
  while not child_file.exists():
    assert time.time() < deadline and parent.poll() is None, "the run never started"
    time.sleep(0.05)
  child = int(child_file.read_text())
  parent.send_signal(signal.SIGKILL)
  parent.wait(timeout=30)
  deadline = time.time() + 20
  while _running(child) and time.time() < deadline:
    time.sleep(0.05)
  if _running(child):
    os.kill(child, signal.SIGKILL)  # (this test's own child: not left behind)
    raise AssertionError("the run outlived its parent's kill -9")
  assert (tmp_path / "terminated").exists()  # it got SIGTERM: train_ppo's save-and-exit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_a_binary_whose_starter_is_gone_ends_at_once(tmp_path):
  """Every binary takes run_streamed's PARENT_ENV first thing (config_files.run): one whose
  named starter is not its parent (died before it got there) ends as on SIGTERM, in one line;
  the variable is not left for the processes it starts."""
  env = {**runner.repo_env(), runner.PARENT_ENV: "1"}  # pid 1 never started this one
  out = subprocess.run([sys.executable, "-m", "experiments.train_ppo",
                        "--config=configs/ppo_tiny.py", f"--workdir={tmp_path / 'w'}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 143, out.stderr[-3000:]
  assert "SIGTERM: stopped before it finished" in out.stderr, out.stderr[-3000:]
  assert not (tmp_path / "w" / "checkpoints").exists()
  script = ("import os\nfrom experiments import runner\nrunner.die_with_parent()\n"
            "print(runner.PARENT_ENV in os.environ)\n")
  kept = subprocess.run([sys.executable, "-c", script], cwd=REPO,
                        env={**runner.repo_env(), runner.PARENT_ENV: str(os.getpid())},
                        capture_output=True, text=True, timeout=60)
  assert kept.returncode == 0 and kept.stdout.strip() == "False", kept.stderr[-3000:]
