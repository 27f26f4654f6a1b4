"""Smoke tests of the experiments binaries: schedule_search, sweep, bench_async's workdir
check, and the errors that name a bad config field."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from rlhfuse_jax import workdir as wdlib
from rlhfuse_jax.pipeline import search
from tests.test_workdir import _hold_as
from tests.xla_env import RESET_SIGINT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
  # Prepend, keep the rest: packages installed with --target are found through PYTHONPATH.
  return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run(args, cwd=REPO, timeout=240):
  return subprocess.run([sys.executable, "-m"] + args, cwd=cwd, env=_env(), capture_output=True,
                        text=True, timeout=timeout)


# The start of a sweep config file whose runs are schedule_search's: its config as `_base`.
SCHEDULE_SEARCH_BASE = (
    "import importlib.util\n"
    f"_spec = importlib.util.spec_from_file_location('base', {REPO!r} + "
    "'/configs/schedule_search.py')\n"
    "_base = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(_base)\n")


def test_schedule_search_with_max_evaluations_reproduces_its_schedule(tmp_path):
  """A timed search ends on the clock (two 4 s runs of e0: 714 and 712, seed 0 recorded both
  times); config.max_evaluations, which the library had, was no field of the binary's config:
  with it, the same seed gives the same schedule."""
  orders = []
  for name in ("a", "b"):
    out = _run(["experiments.schedule_search", "--config=configs/schedule_search.py",
                f"--workdir={tmp_path / name}", "--config.max_evaluations=5000"])
    assert out.returncode == 0, out.stderr[-3000:]
    # e0 (the default instance) stays above its bound: the whole count is searched
    assert re.search(r"search done: [0-9.]+s, 50\d\d evaluations", out.stderr), \
        out.stderr[-3000:]
    orders.append(json.loads((tmp_path / name / "schedule.json").read_text())["devices"])
  assert orders[0] == orders[1]
  bad = _run(["experiments.schedule_search", "--config=configs/schedule_search.py",
              f"--workdir={tmp_path / 'c'}", "--config.max_evaluations=-1"])
  assert bad.returncode == 1 and "config.max_evaluations=-1: expected >= 0" in bad.stderr, \
      bad.stderr[-3000:]


def test_schedule_search_binary_writes_results(tmp_path):
  out = _run(["experiments.schedule_search", "--config=configs/schedule_search.py",
              f"--workdir={tmp_path}", "--config.time_budget_s=1.0", "--config.actor_pp=4",
              "--config.critic_pp=2", "--config.actor_microbatches=4",
              "--config.critic_microbatches=4", "--config.actor_fwd=2", "--config.critic_fwd=1"])
  assert out.returncode == 0, out.stderr[-3000:]
  for f in ("config.json", "result.json", "schedule.json", "gantt.png", "gantt.json"):
    assert os.path.getsize(tmp_path / f) > 0, f
  # gantt.png's title is kept (gantt.json): the figure redraws from the workdir, byte for byte
  from rlhfuse_jax.pipeline import gantt
  title = json.loads((tmp_path / "gantt.json").read_text())["title"]
  assert title.startswith("fused schedule of Pa/Pc=4/2 Ma/Mc=4/4: makespan "), title
  png = (tmp_path / "gantt.png").read_bytes()
  os.remove(tmp_path / "gantt.png")
  gantt.redraw(str(tmp_path))
  assert (tmp_path / "gantt.png").read_bytes() == png
  result = json.loads((tmp_path / "result.json").read_text())
  for key in ("serial_1f1b", "greedy", "searched", "lower_bound", "lower_bound_simple",
              "gap_to_lower_bound", "bubble", "peak_memory", "search_s", "evaluations",
              "unconstrained"):
    assert key in result, key
  assert set(result["peak_memory"]) == {"serial", "searched", "budget"}
  assert all(len(v) == 4 for v in result["peak_memory"].values())
  assert all(s <= b for s, b in zip(result["peak_memory"]["searched"],
                                    result["peak_memory"]["budget"]))
  assert result["lower_bound"] <= result["searched"] <= result["greedy"] <= result["serial_1f1b"]
  # How, when and on what it was made (experiments/runner.provenance).
  made = result["provenance"]
  assert made["command"].startswith("python -m experiments.schedule_search --config="), made
  assert made["date"][:4].isdigit() and made["host_cores"] == os.cpu_count()
  assert made["started"] <= made["date"]  # read at the start (config_files.run)
  head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                        capture_output=True, text=True)
  if head.returncode == 0:  # a git checkout (CI's fresh clone is one)
    assert made["git_commit"].startswith(head.stdout.strip()[:7]), made
  else:
    assert made["git_commit"] is None, made
  assert result["unconstrained"]["makespan"] <= result["searched"]
  sched = json.loads((tmp_path / "schedule.json").read_text())
  assert len(sched["devices"]) == 4 and sched["makespan"] == result["searched"]
  # Backward defaults to 2x forward: the serial 1F1B is (4+4-1)*6 + (2+4-1)*3.
  assert result["serial_1f1b"] == 7 * 6 + 5 * 3
  n = result["devices_at_budget"]
  assert f"({n} device{'' if n == 1 else 's'} at it)" in out.stderr, out.stderr[-2000:]
  # The kernels' compile (minutes on a first run of a checkout) is announced before it starts.
  announced = out.stderr.find(f"loading the search's numba kernels ({search.KERNELS_NOTE}) ...")
  assert 0 <= announced < out.stderr.find("numba kernels ready in"), out.stderr[-2000:]


def test_schedule_search_summary_says_device_or_devices():
  """The closing log line (it said '1 devices at it'; and it gave neither the serial 1F1B
  makespan the search is measured against nor how train_ppo runs the schedule). In a
  subprocess: importing the binary defines its absl flags, which bench_generation's (imported
  by other tests) would collide with."""
  code = ("from experiments.schedule_search import summary\n"
          "r = dict(searched=44.0, lower_bound=42.0, gap_to_lower_bound=44 / 42 - 1,\n"
          "         peak_max=44.0, memory_budget_mode='uniform', budget_max=44.0,\n"
          "         within_budget=True, serial_1f1b=55.0)\n"
          "for n in (1, 3):\n"
          "  print(summary({**r, 'devices_at_budget': n}, '/tmp/w'))\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  start = ("searched 44 time units (LB 42, gap 4.76%; serial 1F1B 55, 1.25x the searched), "
           "peak 44 of the uniform budget 44 ")
  end = (", within budget: True; wrote /tmp/w (a run of this shape trains it, each task one "
         "tick: train_ppo --config.pipeline.schedule_file=/tmp/w/schedule.json; "
         "docs/schedules.md says which durations to search it on)")
  assert out.stdout.splitlines() == [start + "(1 device at it)" + end,
                                     start + "(3 devices at it)" + end]


def test_sweep_runs_each_entry_and_reports_failures(tmp_path):
  cfg = tmp_path / "tiny_sweep.py"
  cfg.write_text(
      SCHEDULE_SEARCH_BASE +
      "def get_config():\n"
      "  c = _base.get_config(); c.actor_microbatches = 2; c.critic_microbatches = 2\n"
      # One search process: each run spawned a second worker (~2.7 s CPU; 4 runs search).
      "  c.workers = 1\n"
      "  return c\n"
      "def get_sweep():\n"
      "  return [{'name': 'ok4', 'actor_pp': 4, 'critic_pp': 2},\n"
      "          {'actor_pp': 6, 'critic_pp': 4}]\n")

  def sweep(*flags, budget="0.2"):  # this sweep on tmp_path/sw, the search's budget its flag
    return _run(["experiments.sweep", f"--config={cfg}", "--binary=schedule_search",
                 f"--workdir={tmp_path / 'sw'}", f"--config.time_budget_s={budget}", *flags])
  out = sweep()
  # Every run ran; the failed one makes the sweep's exit status non-zero, named in its log.
  assert out.returncode == 1, out.stderr[-3000:]
  assert "1 of 2 runs failed: run001" in out.stderr
  rows = json.loads((tmp_path / "sw" / "summary.json").read_text())
  assert [r["run"] for r in rows] == ["ok4", "run001"]
  assert rows[0]["status"] == "ok" and rows[0]["actor_pp"] == 4
  assert rows[0]["bubble/searched"] >= 0 and "peak_memory/budget" not in rows[0]
  # The sweep's own flags are in every row, as the runs got them (typed, as their configs).
  assert [r["time_budget_s"] for r in rows] == [0.2, 0.2]
  assert rows[1]["status"].startswith("failed")
  assert "searched" not in rows[1]
  # The summary says why (it said only "failed (exit 1)"): the run's own error line.
  assert rows[1]["error"].startswith("ValueError: config.actor_pp=6 must be divisible by "
                                     "critic_pp=4")
  assert "error" not in rows[0]
  md = (tmp_path / "sw" / "summary.md").read_text()
  assert "| run |" in md and "failed" in md and "ok4" in md
  # The failing run's error names the fields (logged in its run directory).
  log = (tmp_path / "sw" / "run001" / "log.txt").read_text()
  assert "actor_pp=6 must be divisible by critic_pp=4" in log
  assert "[1/2 ok4] " in out.stdout  # its place in the sweep and its name
  # The same command again keeps the finished run (it searched again, its outputs moved
  # aside, and its time-bound figures could change) and runs the failed one; --rerun runs it.
  again = sweep()
  assert again.returncode == 1 and "ok4: finished earlier with this config at this commit; " \
      "kept" in again.stderr, again.stderr[-3000:]
  assert "run001: failed" in again.stderr and "ok4] " not in again.stdout, again.stderr[-3000:]
  kept = json.loads((tmp_path / "sw" / "summary.json").read_text())[0]
  assert kept == {**rows[0], "status": "ok (kept: finished earlier)"}
  assert not (tmp_path / "sw" / "ok4" / "previous").exists()
  # The row is read from the result in the run's directory, not copied from the summary.
  result_path = tmp_path / "sw" / "ok4" / "result.json"
  result = json.loads(result_path.read_text())
  result_path.write_text(json.dumps({**result, "searched": 74.0}))
  again = sweep("--only=ok4")
  assert json.loads((tmp_path / "sw" / "summary.json").read_text())[0]["searched"] == 74.0
  # Made by other code (another commit, other uncommitted changes): run again; so is a run
  # whose config differs (here the sweep's own flag).
  result_path.write_text(json.dumps({**result, "provenance": {
      **result["provenance"], "git_changes": "0123456789ab"}}))
  again = sweep("--only=ok4")
  assert "[1/1 ok4] " in again.stdout and (tmp_path / "sw" / "ok4" / "previous" / "1").exists()
  changed = sweep("--only=ok4", budget="0.1")
  assert changed.returncode == 0 and "[1/1 ok4] " in changed.stdout, changed.stderr[-3000:]
  rerun = sweep("--rerun", "--only=ok4", budget="0.1")
  assert rerun.returncode == 0 and "[1/1 ok4] " in rerun.stdout, rerun.stderr[-3000:]
  assert (tmp_path / "sw" / "ok4" / "previous" / "3" / "result.json").exists()
  summary = (tmp_path / "sw" / "summary.json").read_text()
  # A dry run prints the commands and writes nothing: the finished sweep's summary stays.
  dry = _run(["experiments.sweep", f"--config={cfg}", "--binary=schedule_search",
              f"--workdir={tmp_path / 'sw'}", "--dry_run"])
  assert dry.returncode == 0 and "ok4" in dry.stderr, dry.stderr[-3000:]
  assert (tmp_path / "sw" / "summary.json").read_text() == summary
  # A mistyped binary is refused before anything runs.
  bad = _run(["experiments.sweep", f"--config={cfg}", "--binary=schedule_serch",
              f"--workdir={tmp_path / 'sw2'}"])
  assert bad.returncode != 0 and ("--binary='schedule_serch': no experiments/schedule_serch.py; "
                                  "did you mean 'schedule_search'?") in bad.stderr, bad.stderr
  assert not os.path.exists(tmp_path / "sw2")
  # So is a misspelled override (each run would start, import jax and fail on it).
  typo = _run(["experiments.sweep", f"--config={cfg}", "--binary=schedule_search",
               f"--workdir={tmp_path / 'sw3'}", "--config.time_budgt_s=0.5"])
  assert typo.returncode != 0 and ("the sweep's flag: --config.time_budgt_s: " in typo.stderr and
                                   "did you mean 'time_budget_s'?" in typo.stderr), typo.stderr
  assert not os.path.exists(tmp_path / "sw3")


def test_a_second_sweep_on_a_workdir_in_use_is_refused_before_any_run(tmp_path):
  """One sweep per workdir: two at once each found the other's run holding its directory,
  counted it failed (exit 1) and wrote a summary calling runs failed that the other finished."""
  cfg = tmp_path / "tiny_sweep.py"
  cfg.write_text(SCHEDULE_SEARCH_BASE + "def get_config():\n  return _base.get_config()\n"
                 "def get_sweep():\n  return [{'name': 'a'}, {'name': 'b'}]\n")
  (tmp_path / "sw").mkdir()
  holder = wdlib.WorkdirLock(str(tmp_path / "sw"))  # a sweep in progress
  try:
    out = _run(["experiments.sweep", f"--config={cfg}", "--binary=schedule_search",
                f"--workdir={tmp_path / 'sw'}", "--config.time_budget_s=0.5"])
  finally:
    holder.release()
  assert out.returncode == 1, out.stderr[-3000:]
  assert f"workdir {tmp_path / 'sw'} is in use by another run (pid {os.getpid()}" in out.stderr
  assert "Traceback" not in out.stderr
  # No run started, no summary; the refusal's traceback went to the temp directory, not into
  # the workdir of the sweep that holds it.
  assert sorted(os.listdir(tmp_path / "sw")) == [".lock"]
  # A sweep on another host (or a crashed node's lock on a shared filesystem, which a sweep
  # requeued after exit 75 meets): waited for up to --lock_wait_s, then refused with the flag.
  (tmp_path / "sw2").mkdir()
  other = _hold_as(str(tmp_path / "sw2"), "pid 7 on node-that-crashed (start 11)")
  try:
    out = _run(["experiments.sweep", f"--config={cfg}", "--binary=schedule_search",
                f"--workdir={tmp_path / 'sw2'}", "--config.time_budget_s=0.5",
                "--lock_wait_s=1"])
  finally:
    other.close()
  assert out.returncode == 1, out.stderr[-3000:]
  assert re.search(r"is in use by another run \(pid 7 on node-that-crashed \(start 11\)\).*"
                   r"; waited [12] s \(--lock_wait_s=1: how long a start waits", out.stderr), (
                       out.stderr[-3000:])
  assert sorted(os.listdir(tmp_path / "sw2")) == [".lock"]
  # A SIGTERM during the wait (a scheduler's stop) ends it at once with exit 75, which a
  # requeue rule acts on: the handler that records it for the run in progress kept the sweep
  # waiting out --lock_wait_s, then exiting 1.
  other = _hold_as(str(tmp_path / "sw2"), "pid 7 on node-that-crashed (start 11)")
  log = tmp_path / "sweep_wait.log"
  try:
    with open(log, "w") as err:
      proc = subprocess.Popen(
          [sys.executable, "-m", "experiments.sweep", f"--config={cfg}",
           "--binary=schedule_search", f"--workdir={tmp_path / 'sw2'}", "--lock_wait_s=120"],
          cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + 120
    while "waiting up to" not in log.read_text():
      assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
      time.sleep(0.2)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 75, log.read_text()[-3000:]
    assert time.time() - t0 < 15
  finally:
    if proc.poll() is None:
      proc.kill()
    other.close()
  text = log.read_text()
  assert re.search(r"stopped after waiting [0-9]+ s for the lock of .*: nothing ran; the same "
                   r"command starts the sweep again", text), text[-3000:]
  assert sorted(os.listdir(tmp_path / "sw2")) == [".lock"]
  nan = _run(["experiments.sweep", f"--config={cfg}", "--binary=schedule_search",
              f"--workdir={tmp_path / 'sw3'}", "--lock_wait_s=nan"])
  assert nan.returncode != 0 and "expected a finite number of seconds >= 0" in nan.stderr, (
      nan.stderr[-3000:])


def test_sweep_takes_a_config_variant(tmp_path):
  """FILE.py:variant: every run gets the variant, and get_sweep(variant) when it takes one.
  (A subprocess: binaries define absl flags, which two of them cannot share in one process.)"""
  cfg = tmp_path / "v.py"
  cfg.write_text("def get_sweep(arg='a'):\n  return [{'name': 'run_' + arg}]\n")
  for spec, name in ((f"{cfg}:b", "run_b"), (str(cfg), "run_a")):
    out = _run(["experiments.sweep", f"--config={spec}", "--binary=schedule_search",
                f"--workdir={tmp_path / 'w'}", "--dry_run"])
    assert out.returncode == 0, out.stderr[-3000:]
    # A command to paste.
    assert f"{name}: python -m experiments.schedule_search --config={spec} " in out.stderr, (
        out.stderr)
  # A variant every run would refuse (its get_config() takes none) is refused by the sweep.
  (tmp_path / "p.py").write_text("def get_config():\n  return {}\n"
                                 "def get_sweep(arg='a'):\n  return [{'name': 'run_' + arg}]\n")
  out = _run(["experiments.sweep", f"--config={tmp_path / 'p.py'}:b", "--binary=schedule_search",
              f"--workdir={tmp_path / 'w'}", "--dry_run"])
  assert out.returncode != 0 and "p.py's get_config() takes no variant (':b')" in out.stderr, (
      out.stderr[-2000:])
  assert "run_b: python" not in out.stderr
  # An entry that replaces a value the variant sets is warned of: ppo_tiny.py:grpo's sweep over
  # estimators ran GAE and REINFORCE++ with GRPO's batch, never GRPO. Its sweep is now seeds.
  # Runs named after the variant (wn.py) are still the same entries: warned of too.
  for name, sweep in (("w", "[{'name': 'r', 'x': 3, 'y': 1}, {'name': 's', 'x': 2}]"),
                      ("wn", "[{'name': 'r_' + arg, 'x': 3}]")):
    (tmp_path / f"{name}.py").write_text(
        "import ml_collections\ndef get_config(arg='a'):\n"
        "  return ml_collections.ConfigDict({'x': 1 if arg == 'a' else 2, 'y': 0})\n"
        f"def get_sweep(arg='a'):\n  return {sweep}\n")
    out = _run(["experiments.sweep", f"--config={tmp_path / f'{name}.py'}:b",
                "--binary=schedule_search", f"--workdir={tmp_path / name}", "--dry_run"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert (f"get_sweep()'s entries set x, which --config={tmp_path / f'{name}.py'}:b sets "
            "itself: each run gets the entry's value, not the variant's (x=2)") in out.stderr, (
                out.stderr)
  # absl's other forms of an override, which every binary takes, reach each run as
  # --config.FIELD=VALUE: --noconfig.FIELD ended in "Unknown command line flag", and
  # "--config.FIELD VALUE" in "unexpected arguments".
  (tmp_path / "f.py").write_text(
      "import ml_collections\ndef get_config():\n"
      "  return ml_collections.ConfigDict({'flag': True, 'seed': 0, 'lr': 0.0})\n"
      "def get_sweep():\n  return [{'name': 'r'}]\n")
  out = _run(["experiments.sweep", f"--config={tmp_path / 'f.py'}", "--binary=schedule_search",
              f"--workdir={tmp_path / 'f'}", "--dry_run", "--noconfig.flag", "--config.seed",
              "5", "--config.lr", "-1e-3"])
  assert out.returncode == 0, out.stderr[-2000:]
  assert "--config.flag=false --config.seed=5 --config.lr=-1e-3" in out.stderr, out.stderr
  out = _run(["experiments.sweep", "--config=configs/ppo_tiny.py:grpo", "--binary=train_ppo",
              f"--workdir={tmp_path / 'g'}", "--dry_run"])
  assert out.returncode == 0 and "sets itself" not in out.stderr, out.stderr[-2000:]
  # A sweep written for its variant sets the variant's fields on purpose: fused's fusion
  # ablation turns off the fusions the variant turns on, and was warned of.
  fused = _run(["experiments.sweep", "--config=configs/ppo_tiny.py:fused", "--binary=train_ppo",
                f"--workdir={tmp_path / 'fu'}", "--dry_run"])
  assert fused.returncode == 0 and "sets itself" not in fused.stderr, fused.stderr[-2000:]
  commands = [line for line in out.stderr.splitlines() if "python -m experiments" in line]
  assert len(commands) == 2 and all("--config.algo.estimator=grpo" in c for c in commands)
  # A training run's workdir is not a sweep's (its summary and run folders went in beside).
  (tmp_path / "train" / "checkpoints").mkdir(parents=True)
  out = _run(["experiments.sweep", "--config=configs/ppo_tiny.py", "--binary=train_ppo",
              f"--workdir={tmp_path / 'train'}", "--dry_run"])
  assert out.returncode == 1 and "holds a training run (checkpoints); give experiments.sweep" \
      in out.stderr, out.stderr[-2000:]


def test_sweep_paths_are_the_callers_and_run_names_are_unique(tmp_path):
  """Runs start in the repository root: a relative --config or --workdir named another file
  there, or put the results where the sweep did not look (it reported "ok (no result.json)").
  Two entries of one name shared a directory."""
  (tmp_path / "s.py").write_text("def get_sweep():\n  return [{'name': 'a'}, {'x': 1}]\n")
  out = _run(["experiments.sweep", "--config=s.py:v", "--binary=schedule_search",
              "--workdir=sw", "--dry_run"], cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  assert (f"a: python -m experiments.schedule_search --config={tmp_path}/s.py:v "
          f"--workdir={tmp_path}/sw/a") in out.stderr, out.stderr
  assert f"--workdir={tmp_path}/sw/run001" in out.stderr
  # --only: a subset by name, each in its directory of the whole sweep; an unknown name refused.
  out = _run(["experiments.sweep", "--config=s.py:v", "--binary=schedule_search",
              "--workdir=sw", "--dry_run", "--only=run001"], cwd=tmp_path)
  assert out.returncode == 0 and f"--workdir={tmp_path}/sw/run001" in out.stderr, out.stderr
  assert f"--workdir={tmp_path}/sw/a " not in out.stderr
  out = _run(["experiments.sweep", "--config=s.py:v", "--binary=schedule_search",
              "--workdir=sw", "--dry_run", "--only=b"], cwd=tmp_path)
  assert out.returncode != 0 and "--only=b: no run named ['b'] in this sweep; its runs are " \
      "['a', 'run001']" in out.stderr, out.stderr[-2000:]
  (tmp_path / "d.py").write_text("def get_sweep():\n  return [{'name': 'a'}, {'name': 'a'}]\n")
  out = _run(["experiments.sweep", "--config=d.py", "--binary=schedule_search",
              "--workdir=sw", "--dry_run"], cwd=tmp_path)
  assert out.returncode != 0
  assert "get_sweep()[0] and [1] are both named 'a'" in out.stderr, out.stderr[-3000:]


# get_sweep() bodies the sweep refuses in one line naming what it expected, each loaded by
# sweep.load_sweep (in a subprocess: importing experiments.sweep defines its absl flags).
_BAD_SWEEPS = {
    "none": "  pass\n",  # a forgotten return: a TypeError's traceback
    "dict": "  return {'lr': 1}\n",  # was "get_sweep()[0] is str; expected a dict"
    "empty": "  return []\n",  # was exit 0 and an empty summary table
    "int_key": "  return [{1: 2}]\n",  # an AttributeError's traceback
    "comma": "  return [{'name': 'pp=4,seed=1'}]\n",  # --only could not select it
    "space": "  return [{'name': ' a'}]\n",
    "summary": "  return [{'name': 'summary.json'}, {'name': 'b'}]\n",  # IsADirectoryError
    "generator": "  return ({'name': n} for n in 'ab')\n",  # taken, as it always was
}
_LOAD_SWEEPS = """
import json, sys
from experiments import sweep
out = {}
for path in sys.argv[1:]:
  try:
    sweep.load_sweep(path)
    out[path] = None
  except ValueError as e:
    out[path] = str(e)
runs = sweep.select([{'name': 'a'}], None)
try:
  sweep.select([{'name': 'a'}], [])
except ValueError as e:
  out["only"] = str(e)
# the recorded config as its run gets it: ~ expanded (the run's config.json held the path)
got = sweep.check_values('configs/plan_search.py', [(0, 'a', {'calibration': '~/cal.json'})],
                         ['--config.hardware=~/hw.json'])['a']
out["tilde"] = [got['calibration'], got['hardware']]
print(json.dumps(out))
"""


def test_a_sweep_refuses_what_get_sweep_cannot_mean(tmp_path):
  """get_sweep() returning None, a dict or no runs, an entry with a non-text key, and run names
  --only cannot select (a comma: absl splits the list there) or that are the sweep's own files
  (the summary then failed on the run's directory, the later runs never ran) are refused in one
  line; so is an empty --only= (an unset shell variable), which ran every entry."""
  paths = []
  for name, body in _BAD_SWEEPS.items():
    (tmp_path / f"{name}.py").write_text("def get_sweep():\n" + body)
    paths.append(str(tmp_path / f"{name}.py"))
  out = subprocess.run([sys.executable, "-c", _LOAD_SWEEPS, *paths], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  said = {name: got[str(tmp_path / f"{name}.py")] for name in _BAD_SWEEPS}
  assert said["none"].endswith("get_sweep() returned NoneType; expected a list of dicts, one "
                               "per run (field: value overrides, and an optional 'name')")
  assert said["dict"].endswith("get_sweep() returned dict; expected a list of dicts, one per "
                               "run (field: value overrides, and an optional 'name')")
  assert said["empty"].endswith("get_sweep() returned no runs; expected a list of dicts, one "
                                "per run")
  assert said["int_key"] == ("get_sweep()[0] has the key 1; expected field names as text "
                             "('algo.lr', 'name')")
  for name, run in (("comma", "pp=4,seed=1"), ("space", " a"), ("summary", "summary.json")):
    assert said[name].startswith(f"get_sweep()[0]['name']={run!r}: expected a directory name"), \
        said[name]
  assert "'summary.json', 'summary.csv'" in said["summary"]
  assert said["generator"] is None
  assert got["only"] == ("--only=: no run named; expected run names (e.g. --only=a), or leave "
                         "--only out to run them all")
  assert got["tilde"] == [os.path.expanduser("~/cal.json"), os.path.expanduser("~/hw.json")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_to_the_sweep_stops_its_run_and_the_sweep(tmp_path, sig):
  """SIGTERM to the sweep's process alone (a `kill`): the run in progress gets it, the summary
  has that run, no further run starts, and the sweep exits 75 (the same command resumes). It
  died at once, without a summary, and its run went on alone. SIGINT to the process group (a
  terminal's Ctrl-C): both get it, the sweep waits for its run to end and exits 130, the row
  saying how the run ended (it said "interrupted" of any run, one that had finished too)."""
  (tmp_path / "s.py").write_text(
      SCHEDULE_SEARCH_BASE +
      "get_config = _base.get_config\n"
      "def get_sweep():\n  return [{'name': 'long'}, {'name': 'never'}]\n")
  with subprocess.Popen(
      [*RESET_SIGINT, sys.executable, "-m", "experiments.sweep",
       f"--config={tmp_path / 's.py'}", "--binary=schedule_search",
       f"--workdir={tmp_path / 'sw'}", "--config.time_budget_s=120"], cwd=REPO, env=_env(),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      start_new_session=True) as sweep:  # a group of its own, as a terminal's job
    try:
      log = tmp_path / "sw" / "long" / "log.txt"
      deadline = time.time() + 120
      while not (log.exists() and "phase 1/2" in log.read_text()):  # searching
        assert sweep.poll() is None and time.time() < deadline
        time.sleep(0.1)
      if sig == signal.SIGTERM:
        sweep.send_signal(sig)  # to the sweep's process alone (a `kill`)
      else:
        os.killpg(sweep.pid, sig)  # to its group, as Ctrl-C at a terminal
      _, err = sweep.communicate(timeout=60)
    finally:
      sweep.kill()
  rows = json.loads((tmp_path / "sw" / "summary.json").read_text())
  assert [r["run"] for r in rows] == ["long"]
  if sig == signal.SIGTERM:
    assert sweep.returncode == 75, err[-3000:]
    assert "stopped after 1 run(s)" in err
    assert rows[0]["status"] == "stopped (exit 143: signal 15)", rows
  else:  # schedule_search ends with one line and 130 (config_files.run), not a traceback
    assert sweep.returncode == 130, err[-3000:]
    assert rows[0]["status"] == "interrupted (exit 130)", rows
    log = (tmp_path / "sw" / "long" / "log.txt").read_text()
    # (its line; a worker process the search was starting as the Ctrl-C came may print its own)
    assert "interrupted: stopped before it finished" in log, log
    assert rows[0]["wall_s"] < 60
  assert not (tmp_path / "sw" / "never").exists()
  # schedule_search's worker processes ended with it (they held the output the sweep reads).
  assert "2 of 2 workers" not in (tmp_path / "sw" / "long" / "log.txt").read_text()


def test_bench_async_refuses_a_workdir_of_another_config(tmp_path):
  """Its runs are train_ppo workdirs that a re-run resumes or reads back: under another config
  they would be reported as this config's (an earlier num_iterations, other timings). A bad
  value is refused before anything starts (it used to start every run, which failed, and then
  locked the workdir to the bad value)."""
  (tmp_path / "config.json").write_text(json.dumps({"num_iterations": 4, "window": 0.1}))
  (tmp_path / "ppo_tiny_s0_seed0").mkdir()
  (tmp_path / "ppo_tiny_s0_seed0" / "metrics.jsonl").write_text('{"step": 1}\n')  # trained
  out = _run(["experiments.bench_async", "--config=configs/bench_async.py",
              f"--workdir={tmp_path}", "--config.num_iterations=2"])
  assert out.returncode != 0
  assert "holds bench_async runs of another config (" in out.stderr, out.stderr[-3000:]
  assert "num_iterations: 4 -> 2" in out.stderr and "use a new workdir" in out.stderr
  assert "window" not in out.stderr.split("another config (")[1]  # analysis only: may change
  # Nothing ran (the refusal's traceback is kept beside the outputs).
  assert sorted(os.listdir(tmp_path)) == ["config.json", "ppo_tiny_s0_seed0", "traceback.txt"]
  bad = _run(["experiments.bench_async", "--config=configs/bench_async.py",
              f"--workdir={tmp_path / 'new'}", "--config.num_iterations=-5"])
  assert bad.returncode == 1 and "config.num_iterations=-5: expected an integer >= 0" in \
      bad.stderr, bad.stderr[-3000:]
  # An objective every run would refuse after starting jax (18 launches), refused first.
  bad = _run(["experiments.bench_async", "--config=configs/bench_async.py",
              f"--workdir={tmp_path / 'new'}", "--config.objective=foo"])
  assert bad.returncode == 1 and "config.objective='foo': expected one of" in bad.stderr, \
      bad.stderr[-3000:]
  # Another binary's workdir: its config.json and result.json were replaced without a word.
  other = tmp_path / "plan"
  other.mkdir()
  (other / "result.json").write_text(json.dumps(
      {"provenance": {"command": "python -m experiments.plan_check --config=x"}}))
  bad = _run(["experiments.bench_async", "--config=configs/bench_async.py",
              f"--workdir={other}"])
  assert bad.returncode == 1 and "holds the outputs of experiments.plan_check" in bad.stderr, \
      bad.stderr[-3000:]
  assert set(os.listdir(other)) <= {"result.json", "traceback.txt"}  # nothing written over
  assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("args, message", [
    # a run config whose mesh needs more devices than each run gets: every run failed after jax
    # started, advising an XLA_FLAGS that the bench replaces
    (["experiments.bench_async", "--config=configs/bench_async.py",
      "--config.runs=('configs/ppo_tiny.py:fused',)"],
     "config.host_devices=1: expected at least the 4 devices config.runs entry "
     "'configs/ppo_tiny.py:fused' needs"),
    # a workload field a train config replaces: it was ignored, silently
    (["experiments.plan_search", "--config=configs/plan_search.py:train",
      "--config.response.median=512", "--config.pairs=llama-7b/llama-7b"],
     "--config.pairs: not read with config.train_config='configs/ppo_tiny.py'"),
    (["experiments.calibrate_sim", "--config=configs/calibrate_sim.py",
      "--config.occupancies=a"], "config.occupancies='a': expected comma-separated slot counts"),
    (["experiments.schedule_search"], "--config is required; e.g. python -m "
                                      "experiments.schedule_search --config="),
    # a negative seed: numpy's default_rng refused it after the earlier outputs moved aside
    (["experiments.calibrate_sim", "--config=configs/calibrate_sim.py", "--config.seed=-1"],
     "config.seed=-1: expected an integer >= 0"),
    (["experiments.bench_attention", "--config=configs/bench_attention.py", "--config.seed=-1"],
     "config.seed=-1: expected an integer >= 0"),
    (["experiments.bench_generation", "--config=configs/bench_generation.py:tiny",
      "--config.generation.max_new_tokens=0"],
     "config.generation.max_new_tokens=0: expected an integer >= 1"),
    # (refused by the executor only at the first compile, ~30 s in, the earlier outputs moved)
    (["experiments.bench_pipeline", "--config=configs/bench_pipeline.py",
      "--config.actor_microbatches=3"],
     "config.actor_microbatches=3 must divide the 16 rows of a data replica"),
    (["experiments.reproduce_ablations", "--config=configs/ablations.py:quick",
      "--config.validate.bench_generation_workdir=/nonexistent/bg"],
     "config.validate.bench_generation_workdir='/nonexistent/bg': no result.json there"),
    # a training config's field under plan_check: named as the flag the user typed
    (["experiments.plan_check", "--config=configs/plan_check.py:tiny",
      "--run_config=configs/ppo_tiny.py", "--run_config.algo.minibatch_size=5"],
     "--run_config (config.<field> is --run_config.<field> here): config.algo.minibatch_size=5"),
    (["experiments.plan_check", "--config=configs/plan_check.py:tiny",
      "--run_config=configs/ppo_hf.py:ppo_gpu", "--run_config.init.actor_checkpoint=/nonexistent"],
     "FileNotFoundError: --run_config (config.<field> is --run_config.<field> here): "
     "config.init.actor_checkpoint='/nonexistent': /nonexistent/config.json not found"),
    # a plan field the run set (it named config.gen_slots alone, a field the user never set)
    (["experiments.plan_check", "--config=configs/plan_check.py:tiny",
      "--run_config=configs/ppo_tiny.py", "--run_config.mesh.data=3"],
     "--run_config: the plan of the run as its trainer runs it is refused: config.gen_slots=64: "
     "expected a multiple of dp*fsdp*pp=3"),
    # below one forward of each model: refused before the search's kernels compile
    (["experiments.schedule_search", "--config=configs/schedule_search.py",
      "--config.memory_budget=1"],
     "config.memory_budget=1: expected at least max(actor_mem, critic_mem) = 5"),
    # the problem's and the search's own checks, named as --config.<field> (without "config.")
    (["experiments.schedule_search", "--config=configs/schedule_search.py",
      "--config.critic_pp=3"], "ValueError: config.actor_pp=8 must be divisible by critic_pp=3"),
    (["experiments.schedule_search", "--config=configs/schedule_search.py",
      "--config.workers=0"], "ValueError: config.workers=0 must be an integer >= 1"),
])
def test_binaries_name_the_bad_field(tmp_path, args, message):
  out = _run(args + [f"--workdir={tmp_path}"])
  assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]


# bench_pipeline's refusals that its main's first two calls raise (BenchPipelineConfig.
# from_config_dict, check_run), all in one process (a start of the binary is 2 s each; a bad
# actor_microbatches above goes through its command line).
_BENCH_PIPELINE_CHECKS = """
import json, sys
from configs import bench_pipeline as cb
from experiments import bench_pipeline as bp
said = []
for overrides in json.loads(sys.argv[1]):
  c = cb.get_config()
  for field, value in overrides.items():
    section, _, name = field.rpartition(".")
    (c[section] if section else c)[name] = value
  try:
    bp.check_run(bp.BenchPipelineConfig.from_config_dict(c))
    said.append(None)
  except ValueError as e:
    said.append(str(e))
print(json.dumps(said))
"""


def test_bench_pipeline_names_the_bad_field():
  cases = [
      ({"seed": -1}, "config.seed=-1 must be >= 0"),
      # (was "model.max_seq_len=-12 must be a positive integer", a field it does not have)
      ({"prompt_len": -20}, "config.prompt_len=-20 must be >= 1"),
      # each named a field this config does not have (model.*, loss.*; "None: unclipped")
      ({"critic.vocab_size": 0}, "config.critic: model.vocab_size=0 must be a positive"),
      ({"clip_eps": -1}, "config.clip_eps=-1.0 must be in (0, 1)"),
      ({"value_clip_eps": -1}, "config.value_clip_eps=-1.0: expected >= 0 (0: unclipped)"),
      # (refused by the executor only at the first compile, ~30 s in, the earlier outputs moved)
      ({"critic_microbatches": 3}, "config.critic_microbatches=3 x the critic's 2 replicas")]
  out = subprocess.run([sys.executable, "-c", _BENCH_PIPELINE_CHECKS,
                        json.dumps([overrides for overrides, _ in cases])], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  said = json.loads(out.stdout.strip().splitlines()[-1])
  for (overrides, message), line in zip(cases, said, strict=True):
    assert line is not None and message in line, (overrides, line)


# reproduce_ablations' refusals that AblationConfig.from_config_dict raises, the first thing its
# main does (a bad validate.bench_generation_workdir above is one of its main's own, and shows
# its refusals reach the command line): in-process, without a 2 s start of the binary for each.
@pytest.mark.parametrize("overrides, message", [
    ({"max_new_tokens": "abc"},
     "config.max_new_tokens='abc': expected comma-separated positive integers"),
    # a setting twice: simulated twice, the second replacing the first in every table
    ({"max_new_tokens": "512,512"},
     "config.max_new_tokens names 512 more than once: each setting once, expected"),
    ({"shapes": "mine"}, "config.shapes: 'mine' must be 'NAME=path/to/config.json'"),
    ({"pairs": "llama3-8b/llama-7b"},
     "unknown model shape 'llama3-8b'; known: ['llama-13b', 'llama-33b', 'llama-65b', "
     "'llama-7b'] (a model of your own: config.shapes='NAME=path/to/config.json')"),
    # prompt and response lengths share LengthSpec's messages: the section is named
    ({"prompt.median": -5}, "config.prompt: lengths: lognormal needs median=-5.0 > 0"),
    ({"response.kind": "empirical", "response.path": "/nonexistent/l.npy"},
     "config.response.path='/nonexistent/l.npy': no such file"),
])
def test_reproduce_ablations_names_the_bad_field(overrides, message):
  from configs import ablations as ablations_config
  from rlhfuse_jax.sim import ablations
  c = ablations_config.get_config("quick")
  for field, value in overrides.items():
    section, _, name = field.rpartition(".")
    (c[section] if section else c)[name] = value
  with pytest.raises(ValueError) as e:
    ablations.AblationConfig.from_config_dict(c)
  assert message in str(e.value)


def test_a_bad_calibrate_sim_value_leaves_the_earlier_calibration_in_place(tmp_path):
  """calibrate_sim checks its fields before it moves the earlier run's calibration.json to
  previous/<n> (a typo left the workdir without one, which a bench workdir's validation reads)."""
  (tmp_path / "calibration.json").write_text('{"earlier": 1}')
  out = _run(["experiments.calibrate_sim", "--config=configs/calibrate_sim.py",
              f"--workdir={tmp_path}", "--config.migrate_rows=1000"])
  assert out.returncode == 1 and "config.migrate_rows=1000: expected at most slots=8" in \
      out.stderr, out.stderr[-3000:]
  assert (tmp_path / "calibration.json").read_text() == '{"earlier": 1}'
  assert not (tmp_path / "previous").exists()


def test_calibrate_sim_feeds_plan_search_on_the_machine_it_measured(tmp_path):
  """docs/simulator.md's chain for "your machine": calibrate_sim, then plan_search with its
  calibration. Its model had no config.json (the simulator accepts a calibration only for the
  model it timed, and a user had to write one by hand), and the refusals said what was wrong,
  not what to give instead. calibrate_sim writes model/config.json; plan_search takes it."""
  cal = tmp_path / "cal"
  out = _run(["experiments.calibrate_sim", "--config=configs/calibrate_sim.py",
              f"--workdir={cal}", "--config.repeats=1", "--config.occupancies=1,8"])
  assert out.returncode == 0, out.stderr[-3000:]
  spec = json.loads((cal / "model" / "config.json").read_text())
  assert (spec["hidden_size"], spec["num_hidden_layers"], spec["vocab_size"]) == (64, 2, 256)
  assert f"--config.shapes=mine={cal}/model" in out.stderr
  host = tmp_path / "host.json"
  host.write_text(json.dumps({"base": "h100_sxm", "name": "host", "peak_flops": 1e11,
                              "hbm_bw": 2e10, "hbm_bytes": 3e9, "collective_protocols": None}))
  search = ["experiments.plan_search", "--config=configs/plan_search.py",
            f"--config.calibration={cal}/calibration.json", "--config.num_devices=8",
            "--config.global_batch=64", "--config.minibatch=16", "--config.max_new_tokens=64",
            "--config.prompt.max_len=16", "--config.systems="]
  out = _run(search + [f"--workdir={tmp_path / 'h100'}"])  # the preset: refused, and how
  assert out.returncode == 1, out.stderr[-3000:]
  assert ("it cannot time config.hardware='h100_sxm''s devices; to simulate the machine it "
          "measured, describe that machine in a hardware file (--config.hardware=FILE.json"
          ) in out.stderr, out.stderr[-3000:]
  out = _run(search + [f"--workdir={tmp_path / 'big'}", f"--config.hardware={host}"])
  assert out.returncode == 1, out.stderr[-3000:]  # LLaMA-1 65B/33B: not the model it timed
  assert ("simulate that model (calibrate_sim writes its config.json to <its workdir>/model: "
          "--config.shapes=NAME=<its workdir>/model") in out.stderr, out.stderr[-3000:]
  # As documented (configs/calibrate_sim.py, docs/simulator.md): with the default systems'
  # comparison. Its decode table times the 1-device instances it measured: the systems
  # generate at that width, their other degrees ruled out (a tp=2 generation failed the whole
  # comparison until 2026-12-06, and before that the run, the searched plan lost with it).
  out = _run(search[:-1] + [f"--workdir={tmp_path / 'ps'}", f"--config.hardware={host}",
                            f"--config.shapes=mine={cal}/model", "--config.pairs=mine/mine"])
  assert out.returncode == 0, out.stderr[-3000:]
  assert "the systems' comparison failed" not in out.stderr, out.stderr[-3000:]
  result = json.loads((tmp_path / "ps" / "result.json").read_text())
  assert result["systems"] and "systems_error" not in result, result
  assert all(row["iteration_s"] > 0 for row in result["systems"].values()), result["systems"]
  assert (tmp_path / "ps" / "plan.json").exists()
  md = (tmp_path / "ps" / "plan_search.md").read_text()
  assert (f"**Calibration** `{cal}/calibration.json` (cpu x8 (cpu), measured by experiments/"
          "calibrate_sim.py") in md
  assert ("measured, in place of the formulas: decode_step, prefill, inference, migration, "
          "weight_load; not measured") in md


def test_train_ppo_refuses_another_binarys_workdir_and_refusals_leave_its_files(tmp_path):
  """train_ppo on a workdir holding another binary's outputs is refused (it moved their
  config.json and result.json to previous/1 and trained beside the rest), as a one-shot binary
  on a training workdir is; neither refusal overwrites the workdir's own traceback.txt."""
  other = tmp_path / "ss"
  other.mkdir()
  (other / "result.json").write_text(json.dumps(
      {"provenance": {"command": "python -m experiments.schedule_search --workdir=ss"}}))
  (other / "traceback.txt").write_text("mine")
  before = sorted(os.listdir(other))
  out = _run(["experiments.train_ppo", "--config=configs/ppo_tiny.py", f"--workdir={other}",
              "--config.num_iterations=1"])
  assert out.returncode == 1, out.stderr[-3000:]
  assert (f"--workdir='{other}' holds the outputs of experiments.schedule_search (its "
          "result.json); give train_ppo a directory of its own") in out.stderr
  assert sorted(os.listdir(other)) == before and (other / "traceback.txt").read_text() == "mine"
  train = tmp_path / "train"
  (train / "checkpoints").mkdir(parents=True)
  (train / "traceback.txt").write_text("mine")
  out = _run(["experiments.calibrate_sim", "--config=configs/calibrate_sim.py",
              f"--workdir={train}"])
  assert out.returncode == 1 and "holds a training run (checkpoints)" in out.stderr
  assert (train / "traceback.txt").read_text() == "mine"


def test_train_ppo_expands_a_tilde_and_refuses_a_model_directory_as_its_workdir(tmp_path):
  """`--workdir=~/model` reaches the binary as typed (the shell expands `~` only at a word's
  start): the run went into a directory named `~` under the current one. A Hugging Face model's
  directory given as the workdir lost its config.json (moved to previous/1 as an earlier
  start's, the training config written in its place: the directory no longer loaded as a
  model). Now `~` is the home directory, and the model's directory is refused untouched."""
  import shutil
  model = tmp_path / "model"
  shutil.copytree(os.path.join(REPO, "configs", "data", "tiny_llama3_chat"), model)
  before = {n: (model / n).read_bytes() for n in os.listdir(model)}
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  out = subprocess.run(
      [sys.executable, "-m", "experiments.train_ppo", f"--config={REPO}/configs/ppo_tiny.py",
       "--workdir=~/model", "--config.num_iterations=1"],
      cwd=cwd, env=dict(_env(), HOME=str(tmp_path)), capture_output=True, text=True,
      timeout=240)
  assert out.returncode == 1, out.stderr[-3000:]
  assert (f"--workdir='{model}' holds config.json, a model's config (model_type 'llama'): not a "
          "run's workdir") in out.stderr, out.stderr[-3000:]
  assert {n: (model / n).read_bytes() for n in os.listdir(model)} == before
  assert os.listdir(cwd) == []


def test_a_validation_workdir_of_another_binary_is_refused_before_the_simulation(tmp_path):
  """reproduce_ablations' validate.<bench>_workdir must hold that bench's result.json: another
  binary's (a train_ppo run's) was taken for it and, after the whole simulation, skipped with a
  warning or a bare KeyError ("could not compare: 'device'"), exit 0."""
  (tmp_path / "train").mkdir()
  (tmp_path / "train" / "result.json").write_text(json.dumps(
      {"status": "done", "provenance": {"command": "python -m experiments.train_ppo "
                                                   "--config=configs/ppo_tiny.py --workdir=x"}}))
  for bench in ("bench_generation", "bench_decode"):
    out = _run(["experiments.reproduce_ablations", "--config=configs/ablations.py:quick",
                f"--config.validate.{bench}_workdir={tmp_path / 'train'}",
                f"--workdir={tmp_path / 'out'}"])
    assert out.returncode == 1, out.stderr[-3000:]
    assert (f"config.validate.{bench}_workdir='{tmp_path / 'train'}': its result.json was "
            f"written by experiments.train_ppo, not experiments.{bench}") in out.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_bench_async_keeps_what_the_other_runs_measured_when_one_fails(tmp_path):
  """A run that fails is named in result.json (and the exit status), not a lost result. A run
  config whose variant does not load is refused before any run starts (each run started and
  failed on it)."""
  out = _run(["experiments.bench_async", "--config=configs/bench_async.py",
              f"--workdir={tmp_path / 'bogus'}", "--config.runs=('configs/ppo_tiny.py:bogus',)",
              "--config.staleness=(0,1)", "--config.seeds=(0,)"])
  assert out.returncode == 1 and ("config.runs entry 'configs/ppo_tiny.py:bogus': ValueError: "
                                  in out.stderr), out.stderr[-3000:]
  assert not (tmp_path / "bogus").exists()
  bad = tmp_path / "bad.py"  # loads; train_ppo refuses it at its start
  bad.write_text("from configs import ppo_tiny\n\ndef get_config():\n  c = ppo_tiny.get_config()\n"
                 "  c.algo.minibatch_size = 7\n  return c\n")
  out = _run(["experiments.bench_async", "--config=configs/bench_async.py",
              f"--workdir={tmp_path / 'wd'}", f"--config.runs=('{bad}',)",
              "--config.staleness=(0,1)", "--config.seeds=(0,)"])
  assert out.returncode == 1, out.stderr[-3000:]
  result = json.loads((tmp_path / "wd" / "result.json").read_text())
  names = ["bad_s0_seed0", "bad_s1_seed0"]
  assert result["failed_runs"] == names and result["all_gains_ok"] is False
  assert result["runs"][str(bad)] == {"failed_runs": names}
  assert "2 run(s) failed" in out.stderr
  # The runs' devices (config.host_devices, 1), not the parent's own (8 under the tests'
  # XLA_FLAGS).
  assert (result["provenance"]["num_devices"], result["machine"]["host_devices"]) == (1, 1)
  assert result["provenance"]["devices_of"].startswith("each train_ppo run")
  assert (result["provenance"]["platform"], result["provenance"]["device_kind"],
          result["provenance"]["num_processes"]) == ("cpu", "cpu", 1)
  # The counts the runs started with, for a later reuse.
  recorded = json.loads((tmp_path / "wd" / "config.json").read_text())
  assert list(recorded["resolved_num_iterations"]) == [str(bad)]


def test_bench_async_reuses_runs_of_their_configs_own_iteration_count(tmp_path):
  """num_iterations 0 (each run config's own: 400 for ppo_tiny) and 400 given explicitly train
  the same runs: the workdir is reused, not refused (its finished runs would be lost to a new
  one). 399 is refused. (A subprocess: the binary defines absl flags.)"""
  (tmp_path / "ppo_tiny_s0_seed0").mkdir()
  (tmp_path / "ppo_tiny_s0_seed0" / "metrics.jsonl").write_text('{"step": 1}\n')  # trained
  runs = ["configs/ppo_tiny.py"]
  (tmp_path / "config.json").write_text(json.dumps({"num_iterations": 0, "runs": runs}))
  code = f"""
from experiments import bench_async as b
for n in (400, 399):
  try:
    b.check_reuse({str(tmp_path / "config.json")!r}, {{"num_iterations": n, "runs": {runs!r}}})
    print(n, "reused")
  except ValueError as e:
    print(n, "refused:", e)
"""
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  assert lines[0] == "400 reused", out.stdout
  assert lines[1].startswith("399 refused:") and "num_iterations: 0 -> 399" in lines[1], lines
  # Since 2026-11-30 the workdir records the counts its runs started with: a config file whose
  # count changed since (the runs trained 300) no longer makes 0 and 400 look the same.
  (tmp_path / "config.json").write_text(json.dumps({
      "num_iterations": 0, "runs": runs, "resolved_num_iterations": {runs[0]: 300}}))
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=120)
  assert out.stdout.splitlines()[0].startswith("400 refused:"), out.stdout + out.stderr[-2000:]


def test_bench_async_refuses_repeated_entries_that_would_share_a_run_directory():
  """A repeated seed, staleness or run config (one file named two ways) made two jobs of one
  train_ppo workdir: run at once, the second was refused by the first's lock; one after the
  other, the first's run was read back as a second seed. (A subprocess: the binary defines
  absl flags.)"""
  code = """
from configs import bench_async as cb
from experiments import bench_async as b
for field, value in (("seeds", (0, 1, 0)), ("staleness", (0, 1, 1)),
                     ("runs", ("configs/ppo_tiny.py", "./configs/ppo_tiny.py")), ("seeds", (0, 1)),
                     ("seeds", (0, -1)), ("skip", -1), ("min_gain_ratio", float("nan"))):
  c = cb.get_config()
  c[field] = value
  try:
    b.check_config(c)
    print("accepted")
  except ValueError as e:
    print(e)
"""
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  expected = "expected distinct entries (each run gets a directory of its own"
  assert lines[0].startswith("config.seeds=(0, 1, 0): " + expected), lines
  assert lines[0].endswith(": 0 repeated"), lines
  assert lines[1].startswith("config.staleness=(0, 1, 1): " + expected), lines
  assert lines[2].startswith("config.runs=") and lines[2].endswith(": ppo_tiny repeated"), lines
  assert lines[3] == "accepted", lines
  # A seed train_ppo refuses: each run given it started jax to say so (6 per seed here).
  assert lines[4] == ("config.seeds=(0, -1): expected one or more integers in [0, 2**32) (each "
                      "run's config.seed)"), lines
  # sliced from the end, after every run had trained: the last iterations' median, or all's
  assert lines[5] == ("config.skip=-1: expected an integer >= 0 (iterations left out of the "
                      "median step time)"), lines
  # every run compared False against NaN: FAIL, after all of them had trained
  assert lines[6] == "config.min_gain_ratio=nan: expected a finite number >= 0", lines


def test_bench_async_plots_reward_by_iteration_and_by_wall_time(tmp_path):
  """curves.png: the seeds' mean reward per iteration (top row) and against the summed wall
  time of the iterations (bottom row), a column per run config. (A subprocess: the binary
  defines absl flags.)"""
  code = f"""
from experiments import bench_async as b
row = lambda reward, step_s: {{"reward/mean": reward, "timing_s/step": step_s}}
runs = [[row(0.1, 2.0), row(0.3, 1.0)], [row(0.3, 4.0), row(0.5, 1.0)]]
c = b.curve(runs)
print(c["reward"].tolist(), c["elapsed_s"].tolist())
# The first iteration compiles (9 s): with skip=1 it counts at the median of the others.
slow = [[row(0.1, 9.0), row(0.3, 1.0), row(0.5, 3.0)]]
print(b.curve(slow, skip=1)["elapsed_s"].tolist())
b.plot({{"a.py": {{0: c, 1: c}}, "b.py": {{0: c}}}}, {str(tmp_path / "curves.png")!r}, 1)
"""
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["[0.2,", "0.4]", "[3.0,", "4.0]", "[2.0,", "3.0,", "6.0]"]
  import matplotlib.image
  height, width = matplotlib.image.imread(str(tmp_path / "curves.png")).shape[:2]
  assert (height, width) == (864, 1320)  # 2 rows x 2 columns of panels at 120 dpi


def test_bench_async_plot_says_whether_the_compiling_iterations_were_left_out(tmp_path):
  """The wall-time axis said the first config.skip iterations were counted at the median step
  also for runs of no more iterations than that, which `curve` leaves as they are (a 3-iteration
  run's 17 s of compiles, under a label that said they were out); a run of one iteration is a
  point, drawn with a marker (a line of one point is not drawn)."""
  code = f"""
import json
import matplotlib.figure
from experiments import bench_async as b
seen = []
matplotlib.figure.Figure.savefig = lambda fig, path, **kw: seen.append(
    [[ax.get_xlabel(), [l.get_marker() for l in ax.get_lines()]] for ax in fig.axes])
row = lambda reward, step_s: {{"reward/mean": reward, "timing_s/step": step_s}}
for n in (4, 2, 1):
  c = b.curve([[row(0.1 * i, 1.0) for i in range(n)]], skip=3)
  b.plot({{"a.py": {{0: c}}}}, {str(tmp_path / "c.png")!r}, 1, skip=3)
print(json.dumps(seen))
"""
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  four, two, one = json.loads(out.stdout.splitlines()[-1])
  assert four[1][0].endswith("(the first 3 iterations, which compile, counted at the median "
                             "step)"), four
  assert two[1][0].endswith("(compiles included: runs of 2 iterations, config.skip=3)"), two
  assert [ax[1] for ax in one] == [["o"], ["o"]] and [ax[1] for ax in two] == [["None"]] * 2


def test_sweep_refuses_a_value_of_the_wrong_type_before_any_run(tmp_path):
  """A value its field's type does not take (an entry's, or the sweep's own flag) is named with
  its run before anything runs: each run used to start, import jax and fail on it."""
  cfg = tmp_path / "typed.py"
  cfg.write_text(SCHEDULE_SEARCH_BASE + "def get_config():\n  return _base.get_config()\n"
                 "def get_sweep():\n  return [{'name': 'a', 'actor_pp': 2},\n"
                 "          {'name': 'b', 'actor_pp': 'four'}]\n")
  out = _run(["experiments.sweep", f"--config={cfg}", "--binary=schedule_search",
              f"--workdir={tmp_path / 'sw'}", "--dry_run"])
  assert out.returncode != 0, out.stderr[-3000:]
  assert ("get_sweep()[1] (b): --config.actor_pp='four': expected an integer (the field is an "
          "int)" in out.stderr), out.stderr[-3000:]
  assert "a: python" not in out.stderr  # refused before any run's command
  cfg.write_text(SCHEDULE_SEARCH_BASE + "def get_config():\n  return _base.get_config()\n"
                 "def get_sweep():\n  return [{'name': 'a', 'actor_pp': 2}]\n")
  out = _run(["experiments.sweep", f"--config={cfg}", "--binary=schedule_search",
              f"--workdir={tmp_path / 'sw'}", "--config.time_budget_s=soon"])
  assert out.returncode != 0, out.stderr[-3000:]
  assert ("the sweep's flag: --config.time_budget_s='soon': expected a number (the field is a "
          "float)" in out.stderr), out.stderr[-3000:]
  # A section given as a dict (an entry's, or the sweep's own flag) would be replaced whole: its
  # other fields lose the file's values.
  for name, entry, flag, said in (
      ("nested", ", 'optim': {'lr': 0.5}", [], "get_sweep()[0]: --config.optim: replaces the "
       "section 'optim' whole: its fields not given (warmup) would lose the values"),
      ("flagged", "", ["--config.optim={'lr': 0.5}"], "the sweep's flag: --config.optim: "
       "replaces the section 'optim' whole")):
    (tmp_path / f"{name}.py").write_text(
        "import ml_collections\ndef get_config():\n"
        "  return ml_collections.ConfigDict({'optim': {'lr': 1.0, 'warmup': 5}})\n"
        f"def get_sweep():\n  return [{{'name': 'a'{entry}}}]\n")
    out = _run(["experiments.sweep", f"--config={tmp_path / f'{name}.py'}",
                "--binary=schedule_search", f"--workdir={tmp_path / name}", "--dry_run", *flag])
    assert out.returncode != 0 and said in out.stderr, out.stderr[-3000:]
  assert not os.path.exists(tmp_path / "sw")
  # On a finished sweep's workdir, the mistake's traceback goes to the temp directory, not
  # among the results (it was WORKDIR/traceback.txt).
  (tmp_path / "sw").mkdir()
  (tmp_path / "sw" / "summary.json").write_text("[]")
  out = _run(["experiments.sweep", f"--config={cfg}", "--binary=schedule_search",
              f"--workdir={tmp_path / 'sw'}", "--config.time_budget_s=soon"])
  assert out.returncode != 0 and "(where it was raised: " in out.stderr, out.stderr[-3000:]
  assert os.listdir(tmp_path / "sw") == ["summary.json"]
  # Values of the right types pass (the run's command is printed).
  out = _run(["experiments.sweep", f"--config={cfg}", "--binary=schedule_search",
              f"--workdir={tmp_path / 'sw'}", "--dry_run", "--config.time_budget_s=1"])
  assert out.returncode == 0 and "a: python" in out.stderr, out.stderr[-3000:]


def test_a_one_shot_binary_refuses_another_ones_workdir(tmp_path):
  """plan_search run in a reproduce_ablations workdir moved that run's config.json and
  result.json to previous/ and left its ablations.md and figures beside the new result. A
  one-shot binary now refuses a workdir whose result.json another binary wrote, as train_ppo
  does, and leaves it as it was. (Its own earlier outputs it still moves aside: schedule_search
  run again on its workdir in test_sweep_runs_each_entry_and_reports_failures, ok4's
  previous/1 to 3, and on a result.json of its own in
  test_sigterm_ends_a_one_shot_binary_in_one_line_and_bench_async_passes_it_on.)"""
  other = tmp_path / "abl"
  other.mkdir()
  (other / "result.json").write_text(json.dumps(
      {"rows": [], "provenance": {"command": "python -m experiments.reproduce_ablations "
                                             "--config=configs/ablations.py --workdir=abl"}}))
  (other / "ablations.md").write_text("# the earlier report\n")
  before = sorted(os.listdir(other))
  out = _run(["experiments.schedule_search", "--config=configs/schedule_search.py",
              f"--workdir={other}", "--config.time_budget_s=0.2"])
  assert out.returncode != 0, out.stderr[-2000:]
  assert (f"--workdir={str(other)!r} holds the outputs of experiments.reproduce_ablations (its "
          "result.json); give experiments.schedule_search a directory of its own") in out.stderr
  assert sorted(os.listdir(other)) == before and "Traceback" not in out.stderr


# The sweep's helpers, run in a subprocess: importing experiments.sweep defines its absl flags,
# which a binary another test of this worker imported (bench_generation) defines too.
_SWEEP_HELPERS = """
import json, os, sys
from experiments import sweep
from rlhfuse_jax import workdir as wdlib
work = sys.argv[1]
out = {}
out["row"] = sweep.run_row("bad_mb", {"name": "bad_mb", "algo.minibatch_size": 5, "seed": 1},
                           ["--config.algo.minibatch_size=8", "--config.num_iterations=5"])
run = os.path.join(work, "r")
os.makedirs(run)
reason = "ValueError: no plan fits: " + "; ".join(f"tp{i}|pp{i}: too big" for i in range(80))
with open(os.path.join(run, "log.txt"), "w") as f:
  f.write("I1130 noise\\n" + reason + "\\n")
out["line_whole"] = sweep.failure_line(run) == reason and len(reason) > 1000
killed = os.path.join(work, "killed")  # an earlier start's error, then a start killed silently
os.makedirs(killed)
with open(os.path.join(killed, "log.txt"), "w") as f:
  f.write("=== 2026-12-01 10:00:00: -m experiments.x\\nValueError: config.a=6 bad\\n"
          "=== 2026-12-01 11:00:00: -m experiments.x\\nI1201 step 1\\n")
out["killed"] = sweep.failure_line(killed)
out["cell"] = sweep._fmt_cell(reason)
out["numbers"] = [sweep._fmt_cell(v) for v in (7863.4, 12170.6, 0.012345, -3.5e4, 2e20)]
curves = os.path.join(work, "curves")
os.makedirs(curves)
with open(os.path.join(curves, "summary.json"), "w") as f:
  json.dump([{"run": "a"}, {"run": "b"}, {"run": "c"}], f)
for name, slope in (("a", 0.01), ("b", 0.02)):
  for step in range(1, 41):
    wdlib.append_jsonl(os.path.join(curves, name, "metrics.jsonl"),
                       {"step": step, "reward/mean": slope * step, "kl/ref_mean": 0.1})
out["curves"] = sweep.plot_curves(curves)
none = os.path.join(work, "none")
os.makedirs(none)
with open(os.path.join(none, "summary.json"), "w") as f:
  json.dump([{"run": "s"}], f)
out["no_curves"] = sweep.plot_curves(none)
print(json.dumps(out))
"""


def test_sweep_rows_errors_and_curves(tmp_path):
  """A summary row shows the values its run got (the sweep's own --config.* flags come after an
  entry's and win: the row showed the entry's minibatch_size 5 for a run given 8, and no sweep
  flag at all). A simulator's long error is whole in summary.json (cut at 500 characters, the
  deciding reason was lost) and shortened in summary.md, '|' escaped. The training runs'
  reward, KL and length by iteration go to curves.png (comparing runs took a script of one's
  own); a sweep of binaries without metrics.jsonl draws nothing. A failed run's error is its
  last start's (log.txt keeps every start)."""
  out = subprocess.run([sys.executable, "-c", _SWEEP_HELPERS, str(tmp_path)], cwd=REPO,
                       env=_env(), capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["row"] == {"run": "bad_mb", "algo.minibatch_size": "8", "seed": 1,
                        "num_iterations": "5"}
  assert got["line_whole"]
  assert got["killed"] is None  # (it showed the earlier start's "ValueError: config.a=6 bad")
  assert len(got["cell"]) < 400 and got["cell"].endswith("... (summary.json)")
  assert "tp0\\|pp0" in got["cell"]
  # one column, one notation: from 1e4 on the whole number, not 1.217e+04 under 7863
  assert got["numbers"] == ["7863", "12171", "0.01235", "-35000", "2e+20"]
  assert got["curves"] == str(tmp_path / "curves" / "curves.png")
  with open(got["curves"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert got["no_curves"] is None and not (tmp_path / "none" / "curves.png").exists()


# A sweep of 2 learning rates x 3 seeds whose runs are faked: each writes a result.json and a
# metrics.jsonl from its own flags; lr=2 with seed 2 fails.
_SEED_SWEEP = """
import json, os, shutil, sys
from experiments import sweep
work, cfg = sys.argv[1], sys.argv[2]


def fake_run(cmd, run_dir, name, env, started=None, prefix=None):
  flag = {a.split("=")[0][len("--config."):]: float(a.split("=")[1]) for a in cmd
          if a.startswith("--config.")}
  lr, seed = flag["lr"], flag["seed"]
  if (lr, seed) == (2, 2):
    return 1
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "result.json"), "w") as f:
    json.dump({"reward_last_10pct": lr * 10 + seed / 10, "iterations": 10, "lr_seen": lr}, f)
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    for step in range(1, 11):
      f.write(json.dumps({"step": step, "reward/mean": lr * step + seed}) + "\\n")
  return 0
sweep.run_streamed = fake_run
# (a stand-in config, no TrainConfig: the check of each run's config as train_ppo's is skipped)
sweep.check_train_configs = lambda runs, configs, passthrough: {}
rows, complete = sweep.run_sweep(cfg, "train_ppo", work, ["--config.steps=10"])
lines, width = sweep.curve_lines(work, ["lr", "seed", "steps"])
out = {"lines": {m: [(l, s, list(a), list(lo), list(hi)) for l, s, a, lo, hi in v]
                 for m, v in lines.items()}, "width": width}
# One group beside a single run: the group is named by its runs (nothing tells groups apart).
one = os.path.join(work, "one")
os.makedirs(one)
rows1 = [{"run": n, "status": st, "lr": lr, "seed": sd} for n, lr, sd, st in
         (("a", 1.0, 0, "ok"), ("b", 1.0, 1, "ok"), ("c", 2.0, 0, "failed (exit 1)"))]
for r in rows1:
  os.makedirs(os.path.join(one, r["run"]))
  with open(os.path.join(one, r["run"], "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 1, "reward/mean": 0.5}) + "\\n")
with open(os.path.join(one, "summary.json"), "w") as f:
  json.dump(rows1, f)
out["one_group"] = [l[0] for l in sweep.curve_lines(one, ["lr", "seed"])[0]["reward/mean"]]
# The sweep's own --config.seed replaces every entry's: runs of a setting become one run.
runs = sweep.select(sweep.load_sweep(cfg), None)
out["shadowed"] = sweep.warn_shadowed(runs, ["--config.seed=5"])
out["not_shadowed"] = sweep.warn_shadowed(runs, ["--config.steps=10"])
# A summary that no longer has seed groups removes the earlier summary_seeds.json.
shutil.copy(os.path.join(work, "summary_seeds.json"), os.path.join(one, "summary_seeds.json"))
sweep.write_summary(one, rows1, ["lr"])
out["stale_kept"] = os.path.exists(os.path.join(one, "summary_seeds.json"))
print(json.dumps(out))
"""


def test_a_sweep_over_seeds_reports_each_settings_mean_and_spread(tmp_path):
  """Runs that differ only in a seed field: summary_seeds.json and a second table of
  summary.md give each setting's mean ± sample std of every result that varies over its
  finished runs (a failed seed left out), and curves.png draws each setting as its seeds' mean
  in a band from the lowest to the highest. (A seeds x settings sweep left the reader to
  average rows by hand and drew one line per seed.)"""
  import numpy as np
  cfg = tmp_path / "seeds.py"
  cfg.write_text("import ml_collections\n\n\ndef get_config():\n"
                 "  return ml_collections.ConfigDict({'lr': 1.0, 'seed': 0, 'steps': 1})\n\n\n"
                 "def get_sweep():\n"
                 "  return [{'name': f'lr{lr}_s{s}', 'lr': lr, 'seed': s}\n"
                 "          for lr in (1.0, 2.0) for s in (0, 1, 2)]\n")
  out = subprocess.run([sys.executable, "-c", _SEED_SWEEP, str(tmp_path / "sw"), str(cfg)],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  groups = json.loads((tmp_path / "sw" / "summary_seeds.json").read_text())
  assert [(g["lr"], g["seeds"], g["runs"]) for g in groups] == [
      (1.0, 3, "lr1.0_s0,lr1.0_s1,lr1.0_s2"), (2.0, 2, "lr2.0_s0,lr2.0_s1")]
  for g, finals in zip(groups, ([10.0, 10.1, 10.2], [20.0, 20.1])):
    assert g["reward_last_10pct/mean"] == pytest.approx(np.mean(finals))
    assert g["reward_last_10pct/std"] == pytest.approx(np.std(finals, ddof=1))
  # constant within every group (settings, not results): left to the per-run table
  assert not any(k.startswith(("iterations", "lr_seen")) for g in groups for k in g)
  assert all(g["steps"] == 10 for g in groups)  # the sweep's own flag, as its runs got it
  md = (tmp_path / "sw" / "summary.md").read_text()
  head, _, *cells = md.split("Across seeds")[1].strip().splitlines()[2:]
  def split(line):
    return [c.strip() for c in line.strip("|").split("|")]
  table = [dict(zip(split(head), split(row))) for row in cells]
  assert [(r["lr"], r["seeds"], r["reward_last_10pct"]) for r in table] == [
      ("1", "3", "10.1 ± 0.1"), ("2", "2", "20.05 ± 0.07071")]
  lines = json.loads(out.stdout.strip().splitlines()[-1])["lines"]["reward/mean"]
  # labelled by what tells the settings apart (not the sweep's flag that all runs got)
  assert [line[0] for line in lines] == ["lr=1.0 (3 seeds)", "lr=2.0 (2 seeds)"]
  label, steps, mean, low, high = lines[1]
  assert steps == list(range(1, 11))
  np.testing.assert_allclose(mean, [2 * s + 0.5 for s in steps])  # seeds 0 and 1
  np.testing.assert_allclose(low, [2 * s for s in steps])
  np.testing.assert_allclose(high, [2 * s + 1 for s in steps])
  with open(tmp_path / "sw" / "curves.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  got = json.loads(out.stdout.strip().splitlines()[-1])
  # (a run that failed this time is drawn as far as its metrics go, marked)
  assert got["one_group"] == ["a+b (2 seeds)", "c (failed)"] and got["stale_kept"] is False
  assert got["shadowed"] == [["seed"], [["lr1.0_s0", "lr1.0_s1", "lr1.0_s2"],
                                        ["lr2.0_s0", "lr2.0_s1", "lr2.0_s2"]]]
  assert got["not_shadowed"] == [[], []]
  # Runs that all got the sweep's own --config.seed are no group (their spread is not the
  # seeds'), and a finished run alone is none either.
  from experiments import runner
  same = [{"run": n, "status": "ok", "lr": 1.0, "seed": "3", "r": x} for n, x in
          (("s0", 0.1), ("s1", 0.2))]
  assert runner.seed_groups(same, ["lr", "seed"]) == []
  # wall_s is the time of the sweep's starts of a run, not a result: not summarised
  # nor is a result.json's echo of an overridden field (result/seed: schedule_search's)
  two = [{**same[0], "seed": 0, "wall_s": 17.0, "result/seed": 0},
         {**same[1], "seed": 1, "wall_s": 1.4, "result/seed": 1}]
  assert [sorted(g) for g in runner.across_seeds(two, ["lr", "seed"])] == [
      ["lr", "r/mean", "r/std", "runs", "seeds"]]
  assert runner.seed_groups(same[:1] + [{**same[1], "seed": "4", "status": "failed (exit 1)"}],
                            ["lr", "seed"]) == []


def _wait_for(path, text, proc, timeout=180):
  deadline = time.time() + timeout
  while not (os.path.exists(path) and text in open(path, errors="replace").read()):
    assert proc.poll() is None and time.time() < deadline, proc.poll()
    time.sleep(0.2)


def test_sigterm_ends_a_one_shot_binary_in_one_line_and_bench_async_passes_it_on(tmp_path):
  """SIGTERM to a binary without handlers of its own killed it silently (143), its earlier
  outputs already moved aside; bench_async died alone, its train_ppo run left training with
  parent 1, unlogged, holding its workdir. Now: one line naming where the earlier outputs went;
  bench_async passes SIGTERM on, waits for its runs to save and exits 75 (the same command
  resumes them)."""
  work = tmp_path / "ss"
  work.mkdir()
  (work / "result.json").write_text(json.dumps(
      {"provenance": {"command": "python -m experiments.schedule_search"}}))
  with subprocess.Popen([sys.executable, "-m", "experiments.schedule_search",
                         "--config=configs/schedule_search.py", f"--workdir={work}",
                         "--config.time_budget_s=120"], cwd=REPO, env=_env(),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
    try:
      lines = []
      for line in proc.stdout:  # until the search runs
        lines.append(line)
        if "phase 1/2" in line:
          break
      proc.send_signal(signal.SIGTERM)
      out = "".join(lines) + proc.communicate(timeout=60)[0]
    finally:
      proc.kill()
  assert proc.returncode == 143, out[-3000:]
  assert (f"SIGTERM: stopped before it finished; nothing more is written (the earlier run's "
          f"outputs are in {work / 'previous' / '1'})") in out and "Traceback" not in out, out
  run = tmp_path / "ba"
  # Its run: ppo_tiny at tests/test_trainer.tiny_config's shapes (its first iteration, which
  # the signal waits for, compiles and runs sooner), under ppo_tiny's name.
  (tmp_path / "ppo_tiny.py").write_text(
      "import importlib.util\n"
      f"_spec = importlib.util.spec_from_file_location('base', {REPO!r} + '/configs/ppo_tiny.py')\n"
      "_base = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(_base)\n"
      "def get_config(arg='ppo'):\n"
      "  c = _base.get_config(arg)\n"
      "  c.model.num_layers = c.critic_model.num_layers = 1\n"
      "  c.model.hidden_size = c.critic_model.hidden_size = 32\n"
      "  c.model.intermediate_size = c.critic_model.intermediate_size = 64\n"
      "  c.rollout.prompts_per_iteration = 16; c.rollout.max_new_tokens = 6\n"
      "  c.rollout.chunk_size = 3; c.algo.minibatch_size = 8; c.data.num_prompts = 64\n"
      "  return c\n")
  with subprocess.Popen([sys.executable, "-m", "experiments.bench_async",
                         "--config=configs/bench_async.py", f"--workdir={run}",
                         f"--config.runs={tmp_path / 'ppo_tiny.py'}", "--config.staleness=0,1",
                         "--config.seeds=0,", "--config.num_iterations=400",
                         "--config.parallel=1"], cwd=REPO, env=_env(),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        start_new_session=True) as proc:
    try:
      # Its first iteration done (a metrics.jsonl row): training. (It waited for the progress
      # line, "iter ", which comes every tenth of the run: 40 iterations.)
      _wait_for(run / "ppo_tiny_s0_seed0" / "metrics.jsonl", '"step": ', proc)
      proc.send_signal(signal.SIGTERM)
      out = proc.communicate(timeout=120)[0]
    finally:
      try:  # its whole group: a failure before the signal left its train_ppo run training
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  assert proc.returncode == 75, out[-3000:]
  assert "its 1 run(s) saved and ended (the same command resumes them)" in out, out[-3000:]
  assert "ppo_tiny_s0_seed0 stopped after saving (exit 75)" in out, out[-3000:]
  # The run saved and ended with it: no process of it is left.
  assert os.path.isdir(run / "ppo_tiny_s0_seed0" / "checkpoints")
  ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
  assert str(run) not in ps, ps
