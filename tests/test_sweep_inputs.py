"""experiments/sweep.py on what a researcher's sweep directory holds: a finished one-shot run is
kept only while the files its config names are unchanged, one directory holds one sweep, a
training run's wall_s spans its starts, twin and None entries are named before anything runs,
and summary.md leaves the columns every run shares out of its table. (The sweep's functions run
in a subprocess: binaries define absl flags, which two of them cannot share in one process.)"""
import json
import os
import subprocess
import sys

from configs import ppo_tiny

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
  return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")


def _sweep_config(path, defaults: str, entries: str):
  """A sweep config file at `path`: get_config() returns ConfigDict(`defaults`), get_sweep()
  the list `entries` (each Python source)."""
  path.write_text("import ml_collections\n\n\ndef get_config():\n"
                  f"  return ml_collections.ConfigDict({defaults})\n\n\n"
                  f"def get_sweep():\n  return {entries}\n")
  return path


def _run(args, timeout=240):
  return subprocess.run([sys.executable, "-m"] + args, cwd=REPO, env=_env(),
                        capture_output=True, text=True, timeout=timeout)


def test_a_kept_plan_search_runs_again_once_its_train_config_file_changed(tmp_path):
  """The kept run's inputs: an edited (untracked) train_config kept the plans searched for the
  model before the edit, "finished earlier with this config at this commit"."""
  model = tmp_path / "model.py"
  model.write_text((open(os.path.join(REPO, "configs", "ppo_tiny.py")).read()))
  (tmp_path / "s.py").write_text(
      "import importlib.util\n"
      f"_spec = importlib.util.spec_from_file_location('b', {REPO!r} + '/configs/plan_search.py')\n"
      "_base = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(_base)\n"
      "def get_config(arg='train'):\n"
      f"  c = _base.get_config(arg); c.train_config = {str(model)!r}; return c\n"
      "def get_sweep(arg='train'):\n  return [{'name': 'n8', 'num_devices': 8}]\n")

  def sweep(config=f"{tmp_path / 's.py'}:train"):
    return _run(["experiments.sweep", f"--config={config}", "--binary=plan_search",
                 f"--workdir={tmp_path / 'sw'}"])
  first = sweep()
  assert first.returncode == 0, first.stderr[-3000:]
  recorded = json.loads((tmp_path / "sw" / "n8" / "sweep_inputs.json").read_text())
  assert list(recorded) == [str(model)]
  model.write_text(model.read_text() + "\n# another model\n")
  again = sweep()
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"{model} changed since it finished: running it again" in again.stderr
  assert "finished earlier with this config" not in again.stderr
  # No variant is get_config()'s default, 'train': the same sweep (it was refused as another).
  same = sweep(str(tmp_path / "s.py"))
  assert same.returncode == 0 and "finished earlier with this config" in same.stderr, \
      same.stderr[-3000:]
  # Another sweep (another file) in this directory is refused before anything runs.
  (tmp_path / "s2.py").write_text((tmp_path / "s.py").read_text())
  other = sweep(f"{tmp_path / 's2.py'}:train")
  assert other.returncode == 1 and "holds a sweep of experiments.plan_search over" in \
      other.stderr and "give it a directory of its own" in other.stderr, other.stderr[-3000:]


_CHECKS = """
import json, os, sys, types
from experiments import sweep
work = sys.argv[1]
out = {}
# input_files: absolute, repository-relative and FILE:variant paths; directories not read
os.makedirs(os.path.join(work, "ckpt"))
with open(os.path.join(work, "f.json"), "w") as f:
  f.write("{}")
found = sweep.input_files({"a": os.path.join(work, "f.json"),
                           "b": {"c": "configs/ppo_tiny.py:grpo"},
                           "d": os.path.join(work, "ckpt"), "e": "auto", "n": 3})
out["inputs"] = sorted(found)
# the wall_s of a training run spans its starts (only while a saved checkpoint is there: v's
# earlier start failed before its first save, and this one starts over)
sweep.wd.write_json(os.path.join(work, "summary.json"), [
    {"run": n, "status": "stopped (exit 75; re-run to resume)", "wall_s": 20.0} for n in "tuv"])
os.makedirs(os.path.join(work, "t", "checkpoints", "4"))
os.makedirs(os.path.join(work, "v", "checkpoints"))
sweep.run_streamed = lambda cmd, run_dir, name, env, started=None, prefix=None: 0
rows, _ = sweep._run_locked("train_ppo", "c.py", work, [], False, sweep._Signals(),
                            [(0, "t", {}), (1, "u", {}), (2, "v", {})], lambda rows: None)
out["wall_s"] = [r["wall_s"] for r in rows]
# None entries refused, twins named
mod = types.SimpleNamespace(get_sweep=lambda: [{"name": "a", "data.prompts_file": None}])
try:
  sweep._sweep_of(mod, None, "s.py")
except ValueError as e:
  out["none"] = str(e)
out["twins"] = sweep.warn_twins({"a": {"seed": 0}, "b": {"seed": 0}, "c": {"seed": 1},
                                 "d": {"seed": 1}}, [["c", "d"]])
# the sweep's identity: the same file through a symbolic link is the same sweep
os.makedirs(os.path.join(work, "real"))
os.symlink(os.path.join(work, "real"), os.path.join(work, "linked"))
with open(os.path.join(work, "real", "s.py"), "w") as f:
  f.write("")
out["ident"] = [sweep.sweep_identity(os.path.join(work, d, "s.py") + ":v", "b")
                for d in ("real", "linked")]
out["repo_ident"] = sweep.sweep_identity("configs/ppo_tiny.py", "train_ppo")
# summary.md: the columns every row shares go below the table
sweep.write_summary(work, [{"run": "a", "status": "ok", "k": 1, "same": "x", "r": 0.5},
                           {"run": "b", "status": "ok", "k": 2, "same": "x", "r": 0.7}])
out["md"] = open(os.path.join(work, "summary.md")).read()
# rows of earlier starts made without this start's --config.k flag: said, once per field
mixed = [{"run": "a", "k": 1}, {"run": "b"}, {"run": "c", "k": 1}]
out["mixed"] = [sweep.warn_mixed_flags(mixed, ["k"]), sweep.warn_mixed_flags(mixed, ["k"], ["k"]),
                sweep.warn_mixed_flags(mixed[::2], ["k"])]
print(json.dumps(out))
"""


def test_inputs_wall_time_twins_nones_and_shared_columns(tmp_path):
  proc = subprocess.run([sys.executable, "-c", _CHECKS, str(tmp_path)], cwd=REPO, env=_env(),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.splitlines()[-1])
  assert out["inputs"] == sorted([str(tmp_path / "f.json"), "configs/ppo_tiny.py"])
  t, u, v = out["wall_s"]
  assert t >= 20.0 and u < 20.0 and v < 20.0  # u's checkpoints are gone, v saved none
  assert "get_sweep()[0] (a): 'data.prompts_file' is None" in out["none"]
  assert out["twins"] == [["a", "b"]]  # c, d: already named (the sweep's own flag)
  a, b = out["ident"]
  assert a == b and a["config"].endswith("s.py:v")
  assert out["repo_ident"] == {"config": "configs/ppo_tiny.py", "binary": "train_ppo"}
  lines = out["md"].splitlines()
  assert lines[0] == "| run | status | k | r |"
  assert lines[-1] == "The same in every run: same = x."
  # (a seeds group dropped from the seeds table without a word: gae_s0 re-run with a
  # --config.compilation_cache_dir flag its twin gae_s1 was not run with)
  assert out["mixed"] == [["k"], [], []]
  assert "the summary's runs were made with different k: 1 in a, c; null in b" in proc.stderr


_RESTARTS = """
import json, os, sys, time
from absl import logging
from experiments import sweep
logging.set_verbosity(logging.INFO)
work = sys.argv[1]
earlier = [{"run": r, "status": "ok", "wall_s": 20.0, "iterations": 4} for r in ("done", "more")]
sweep.wd.write_json(os.path.join(work, "summary.json"), earlier)
for name, reached in (("done", 4), ("more", 6)):  # "more": re-run with num_iterations=6
  os.makedirs(os.path.join(work, name, "checkpoints", "4"))  # a saved checkpoint
  sweep.wd.write_json(os.path.join(work, name, "result.json"),
                      {"status": "done", "iterations": reached, "num_iterations": reached})

def fake_run(cmd, run_dir, name, env, started=None, prefix=None):  # a start that takes 0.3 s
  time.sleep(0.3)
  if name == "more":  # it trains to 6 and saves there
    os.makedirs(os.path.join(run_dir, "checkpoints", "6"))
  return 0
sweep.run_streamed = fake_run
rows, _ = sweep._run_locked("train_ppo", "c.py", work, [], False, sweep._Signals(),
                            [(0, "done", {}), (1, "more", {})], lambda rows: None)
print(json.dumps([r["wall_s"] for r in rows]))
"""


def test_a_finished_training_run_started_again_keeps_its_wall_time(tmp_path):
  """A sweep run again over finished train_ppo runs (to refresh its summary) restarts each, and
  each finds nothing to train: their wall_s grew by a start's set-up on every re-run (15.1 s,
  then 16.7 s, then 18.5 s for a run that trained once). A start that trains more adds its
  time."""
  proc = subprocess.run([sys.executable, "-c", _RESTARTS, str(tmp_path)], cwd=REPO, env=_env(),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  done, more = json.loads(proc.stdout.splitlines()[-1])
  assert done == 20.0
  assert more >= 20.3
  assert "(wall_s 20.0s over its starts)" in proc.stderr, proc.stderr[-3000:]


_STOPPED_EARLY = """
import json, os, sys
from experiments import sweep
from rlhfuse_jax import workdir as wd
work, cfg = sys.argv[1], sys.argv[2]
calls = []
commit, changes = sweep.code_state()

# a one-shot binary's run, finished
def fake_run(cmd, run_dir, name, env, started=None, prefix=None):
  calls.append(name)
  os.makedirs(run_dir, exist_ok=True)
  x = int([a for a in cmd if a.startswith("--config.x=")][0].split("=")[1])
  wd.write_json(os.path.join(run_dir, "config.json"), {"x": x})
  wd.write_json(os.path.join(run_dir, "result.json"), {"value": 10 * x, "provenance": {
      "command": "python -m experiments.plan_search", "git_commit": commit,
      **({"git_changes": changes} if changes else {})}})
  return 75 if name == "a" and len(calls) == 1 and os.path.exists(
      os.path.join(work, "a", "stop")) else 0
sweep.run_streamed = fake_run
out = {}
sweep.run_sweep(cfg, "plan_search", work, [])
out["first"] = list(calls)
calls.clear()
open(os.path.join(work, "a", "stop"), "w").close()
# Run again (--rerun), stopped after its first run (exit 75).
out["second_complete"] = sweep.run_sweep(cfg, "plan_search", work, [], rerun=True)[1]
out["after_stop"] = {r["run"]: r["status"] for r in json.load(
    open(os.path.join(work, "summary.json")))}
calls.clear()
os.remove(os.path.join(work, "a", "stop"))
sweep.run_sweep(cfg, "plan_search", work, [])
out["third"] = list(calls)
print(json.dumps(out))
"""


def test_a_sweep_stopped_early_keeps_the_rows_of_the_runs_it_did_not_reach(tmp_path):
  """A start stopped after its first run (exit 75) wrote a summary of that run alone: the rows of
  runs that had finished before were lost, and the next start ran them again."""
  (tmp_path / "s.py").write_text(
      "import ml_collections\n"
      "def get_config():\n  c = ml_collections.ConfigDict(); c.x = 0; return c\n"
      "def get_sweep():\n  return [{'name': n, 'x': i} for i, n in enumerate('abc')]\n")
  proc = subprocess.run([sys.executable, "-c", _STOPPED_EARLY, str(tmp_path / "sw"),
                         str(tmp_path / "s.py")], cwd=REPO, env=_env(), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.splitlines()[-1])
  assert out["first"] == ["a", "b", "c"] and out["second_complete"] is False
  assert out["after_stop"] == {"a": "stopped (exit 75; re-run to resume)", "b": "ok",
                               "c": "ok"}
  assert out["third"] == ["a"]  # b and c are kept: they finished with this config and code


def test_a_plan_that_does_not_fit_is_a_finding_of_a_plan_check_sweep(tmp_path):
  """plan_check exits 4 (EXIT_DOES_NOT_FIT) for a plan that does not fit, with result.json
  written (it exited 0 beside "verdict: DOES NOT FIT": a script could not tell). A sweep over
  plans takes that status as the run's finding (VERDICT_EXITS): the row is "ok (does not fit)"
  with its figures, the sweep exits 0, and a re-run keeps it (a failed run, "failed (exit 4)"
  without figures and a sweep exiting 1, would run again). The tiny plan on a 1 MB device."""
  (tmp_path / "small.json").write_text(json.dumps({"base": "h100_sxm", "hbm_bytes": 1e6}))
  (tmp_path / "s.py").write_text(
      "import importlib.util\n"
      f"_spec = importlib.util.spec_from_file_location('b', {REPO!r} + '/configs/plan_check.py')\n"
      "_base = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(_base)\n"
      "def get_config(arg='tiny'):\n  return _base.get_config(arg)\n"
      "def get_sweep(arg='tiny'):\n"
      f"  return [{{'name': 'small', 'hardware': {str(tmp_path / 'small.json')!r}}}]\n")

  def sweep():
    return _run(["experiments.sweep", f"--config={tmp_path / 's.py'}:tiny",
                 "--binary=plan_check", f"--workdir={tmp_path / 'sw'}"])
  first = sweep()
  assert first.returncode == 0, first.stderr[-3000:]
  log = (tmp_path / "sw" / "small" / "log.txt").read_text()
  assert "verdict: DOES NOT FIT: train_step" in log, log[-3000:]
  assert ("exit status 4: train_step, decode, prefill, inference, migrate, placement not "
          "fitting") in log, log[-3000:]
  (row,) = json.loads((tmp_path / "sw" / "summary.json").read_text())
  assert row["status"] == "ok (does not fit)", row
  assert row["programs/train_step/fits"] is False and row["programs/train_step/peak_bytes"] > 1e6
  again = sweep()
  assert again.returncode == 0, again.stderr[-3000:]
  assert "small: finished earlier with this config at this commit; kept" in again.stderr, (
      again.stderr[-3000:])
  # The kept row still says what the plan's run found (it read "ok (kept: finished earlier)",
  # like a plan that fits: the verdict was left to the programs/*/fits columns).
  (row,) = json.loads((tmp_path / "sw" / "summary.json").read_text())
  assert row["status"] == "ok (does not fit; kept: finished earlier)", row


# A sweep of 12 entries, its runs faked: r2 fails, r5 is stopped by a signal (exit 75), which
# ends the sweep there; then curves_figure of 12 single runs.
_MANY = """
import json, os, sys
from experiments import sweep
work, cfg = sys.argv[1], sys.argv[2]


def fake_run(cmd, run_dir, name, env, started=None, prefix=None):
  os.makedirs(run_dir, exist_ok=True)
  if name == "r2":
    return 1
  if name == "r5":  # stopped after iteration 2 of 3, as train_ppo writes it
    with open(os.path.join(run_dir, "result.json"), "w") as f:
      json.dump({"status": "stopped", "iterations": 2, "num_iterations": 3}, f)
    return 75
  with open(os.path.join(run_dir, "result.json"), "w") as f:
    json.dump({"status": "done", "iterations": 3}, f)
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    for step in range(1, 4):
      f.write(json.dumps({"step": step, "reward/mean": step * int(name[1:])}) + "\\n")
  return 0
sweep.run_streamed = fake_run
sweep.check_train_configs = lambda runs, configs, passthrough: {}  # (no TrainConfig)
rows, complete = sweep.run_sweep(cfg, "train_ppo", work, [])
out = {"complete": complete, "md": open(os.path.join(work, "summary.md")).read(),
       "stopped": [r for r in rows if r["run"] == "r5"][0]}
import numpy as np
lines = {m: [(f"run{k}", [1, 2, 3], np.arange(3.0) * k, np.arange(3.0) * k, np.arange(3.0) * k)
             for k in range(12) if not (m == "kl/ref_mean" and k == 0)]
         for m in ("reward/mean", "kl/ref_mean")}
fig = sweep.curves_figure(lines, 1)
out["styles"] = [{l.get_label(): [l.get_color(), l.get_linestyle()] for l in ax.get_lines()}
                 for ax in fig.axes]
out["legends"] = [len(fig.legends), [ax.get_legend() is not None for ax in fig.axes]]
print(json.dumps(out))
"""


def test_a_long_sweep_says_how_far_it_got_and_draws_every_run_apart(tmp_path):
  """summary.md of a sweep of 12 stopped after 6 opens with where it stands (6 of 12 have a
  row, by how they ended, the failed one and the 6 not run yet by name, the summed wall time):
  its table alone left the missing runs unsaid; the stopped run's row says how far it got (its
  result.json's iterations; it was blank). curves.png keeps one color and dash per run
  in every panel, none shared by two of 12 runs (matplotlib's cycle has 10 colors; a run
  missing from a panel shifted the others' colors there), its legend below the panels."""
  cfg = _sweep_config(tmp_path / "many.py", "{'seed': 0, 'lr': 0.0}",
                      "[{'name': f'r{k}', 'lr': float(k)} for k in range(12)]")
  proc = subprocess.run([sys.executable, "-c", _MANY, str(tmp_path / "sw"), str(cfg)],
                        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.splitlines()[-1])
  assert not out["complete"]
  first = out["md"].splitlines()[0]
  assert first.startswith("6 of 12 runs have a row (4 ok, 1 failed, 1 stopped); failed: r2; "
                          "not run yet: r6, r7, r8, r9, r10, r11; wall time "), first
  assert first.endswith("s (the rows' wall_s summed)."), first
  assert "| run |" in out["md"].splitlines()[2]
  # the stopped run's row: how far it got, from the result.json it wrote as it stopped
  stopped = out["stopped"]
  assert stopped["status"] == "stopped (exit 75; re-run to resume)"
  assert (stopped["iterations"], stopped["num_iterations"]) == (2, 3)
  assert stopped["result/status"] == "stopped"
  reward, kl = out["styles"]
  assert len({tuple(s) for s in reward.values()}) == 12
  assert all(kl[label] == reward[label] for label in kl) and len(kl) == 11
  assert out["legends"] == [1, [False, False]]


_HOURS = """
import os, sys
from absl import logging
from experiments import sweep
logging.set_verbosity(logging.INFO)
work, cfg = sys.argv[1], sys.argv[2]
now = [1000.0]
sweep.time.time = lambda: now[0]


def fake_run(cmd, run_dir, name, env, started=None, prefix=None):
  os.makedirs(run_dir, exist_ok=True)
  now[0] += {"short": 12.34, "long": 3725.2}[name]
  return 0
sweep.run_streamed = fake_run
sweep.check_train_configs = lambda runs, configs, passthrough: {}  # (no TrainConfig)
sweep.run_sweep(cfg, "train_ppo", work, [])
"""


def test_a_sweep_logs_a_runs_time_in_hours_past_an_hour(tmp_path):
  """The sweep's line after each run gives its time as 12.3s, or past a minute in minutes and
  hours (a run of hours read "ok in 3725.2s"); summary.md's status line sums them."""
  cfg = _sweep_config(tmp_path / "two.py", "{'lr': 0.0}",
                      "[{'name': 'short', 'lr': 1.0}, {'name': 'long', 'lr': 2.0}]")
  proc = subprocess.run([sys.executable, "-c", _HOURS, str(tmp_path / "sw"), str(cfg)],
                        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "[1/2] short: ok (no result.json / metrics.jsonl) in 12.3s" in proc.stderr
  assert "[2/2] long: ok (no result.json / metrics.jsonl) in 1h02m05s" in proc.stderr
  first = (tmp_path / "sw" / "summary.md").read_text().splitlines()[0]
  assert first == ("2 of 2 runs have a row (2 ok); wall time 1h02m18s (the rows' wall_s "
                   "summed)."), first


# A train_ppo sweep of 2 learning rates x 2 seeds, its runs faked: each writes a result.json of
# train_ppo's keys, with its last iteration's metrics under final/; lr 2 with seed 1 fails.
_WIDE = """
import json, os, sys
from experiments import sweep
work, cfg = sys.argv[1], sys.argv[2]
now = [1000.0]
sweep.time.time = lambda: now[0]
FINAL = ["actor/entropy", "actor/grad_norm", "actor/pg_loss", "critic/vf_loss", "kl/ref_mean",
         "reward/mean", "reward/std", "response_length/mean", "returns/mean"]


def fake_run(cmd, run_dir, name, env, started=None, prefix=None):
  flag = {a.split("=")[0][len("--config."):]: float(a.split("=")[1]) for a in cmd
          if a.startswith("--config.")}
  lr, seed = flag["lr"], flag["seed"]
  os.makedirs(run_dir, exist_ok=True)
  if (lr, seed) == (2, 1):
    with open(os.path.join(run_dir, "log.txt"), "w") as f:
      f.write("ValueError: config.lr=2.0 diverged\\n")
    return 1
  x = lr + seed / 10
  now[0] += 10 * x  # its wall_s
  with open(os.path.join(run_dir, "result.json"), "w") as f:
    json.dump({"status": "done", "iterations": 3, "num_iterations": 3,
               "reward_first_10pct": 0.0, "reward_last_10pct": x, "reward_gain": x,
               "median_step_s": 0.1 * x, "median_tokens_per_s": 100 * x,
               "final": {"step": 3, **{k: x + i for i, k in enumerate(FINAL)}}}, f)
  return 0
sweep.run_streamed = fake_run
sweep.check_train_configs = lambda runs, configs, passthrough: {}  # (no TrainConfig)
sweep.run_sweep(cfg, "train_ppo", work, [])
"""


def test_a_training_sweeps_summary_shows_its_headline_and_names_the_rest(tmp_path):
  """summary.md of a train_ppo sweep: its table is the run, the fields its command set, its
  status and the headline results (reward, KL, response length, throughput, wall time; a
  failed run's error), and a line below names the other columns; summary.json and summary.csv
  have them all. The seeds table shows the same results' mean ± std. (A 16-run sweep's table
  had ~38 columns, 24 of them final/*: unreadable.)"""
  import csv
  cfg = _sweep_config(tmp_path / "wide.py", "{'lr': 0.0, 'seed': 0}",
                      "[{'name': f'lr{lr}_s{s}', 'lr': lr, 'seed': s}"
                      " for lr in (1.0, 2.0) for s in (0, 1)]")
  proc = subprocess.run([sys.executable, "-c", _WIDE, str(tmp_path / "sw"), str(cfg)],
                        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  md = (tmp_path / "sw" / "summary.md").read_text()
  lines = md.splitlines()
  assert lines[2] == ("| run | lr | seed | status | iterations | reward_last_10pct | "
                      "reward_gain | final/reward/mean | final/kl/ref_mean | "
                      "final/response_length/mean | median_tokens_per_s | median_step_s | "
                      "wall_s | error |"), lines[2]
  assert lines[4] == ("| lr1.0_s0 | 1 | 0 | ok | 3 | 1 | 1 | 6 | 5 | 8 | 100 | 0.1 | 10 |  |")
  assert lines[7] == ("| lr2.0_s1 | 2 | 1 | failed (exit 1) |  |  |  |  |  |  |  |  | 0 | "
                      "ValueError: config.lr=2.0 diverged |"), lines[7]
  rows = json.loads((tmp_path / "sw" / "summary.json").read_text())
  shown = set(lines[2].strip("| ").split(" | "))
  rest = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in shown]
  assert "final/actor/entropy" in rest and "reward_first_10pct" in rest
  assert f"Further columns, in summary.json and summary.csv ({len(rest)}): " + ", ".join(
      rest) + "." in lines
  with open(tmp_path / "sw" / "summary.csv", newline="") as f:
    table = list(csv.DictReader(f))
  assert [r["run"] for r in table] == [r["run"] for r in rows]
  for got, want in zip(table, rows):
    assert set(got) >= set(want)
    assert all(got[k] == str(v) for k, v in want.items()), (got, want)
  seeds = md.split("Across seeds")[1].splitlines()
  head = next(s for s in seeds if s.startswith("| "))
  assert head == ("| lr | seeds | runs | reward_last_10pct | reward_gain | final/reward/mean | "
                  "final/kl/ref_mean | final/response_length/mean | median_tokens_per_s | "
                  "median_step_s |"), head
  assert "| 1 | 2 | lr1.0_s0,lr1.0_s1 | 1.05 ± 0.07071 |" in md
  assert any(s.startswith("Further results, as COLUMN/mean and COLUMN/std in "
                          "summary_seeds.json (") and "final/actor/entropy" in s for s in seeds)


# A sweep of two runs whose commands print a line (the real run_streamed streams them).
_PREFIXED = """
import sys
from experiments import sweep
work, cfg = sys.argv[1], sys.argv[2]
sweep.build_command = lambda binary, config, run_dir, overrides, passthrough: [
    sys.executable, "-c", f"print('lr is {overrides['lr']}')"]
sweep.run_sweep(cfg, "schedule_search", work, [])
"""


def test_a_sweeps_console_says_which_run_of_it_said_each_line(tmp_path):
  """Each line a run prints reaches the sweep's console as [i/N run] LINE, as the sweep's own
  lines name it ([i/N] run: ...): runs interleaved in a log (two sweeps', a grep's) said whose
  line it was and how far their sweep had got. log.txt keeps the run's lines as they were."""
  cfg = _sweep_config(tmp_path / "two.py", "{'lr': 0.0}",
                      "[{'name': 'lo', 'lr': 1.0}, {'name': 'hi', 'lr': 2.0}]")
  proc = subprocess.run([sys.executable, "-c", _PREFIXED, str(tmp_path / "sw"), str(cfg)],
                        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.splitlines() == ["[1/2 lo] lr is 1.0", "[2/2 hi] lr is 2.0"], proc.stdout
  log = (tmp_path / "sw" / "hi" / "log.txt").read_text().splitlines()
  assert log[1:] == ["lr is 2.0"], log


# A sweep of three runs, faked: the second is stopped by a Ctrl-C (it saved: exit 75); main
# then exits 130.
_CTRL_C = """
import os, sys
from absl import flags, logging
from experiments import runner, sweep
logging.set_verbosity(logging.INFO)
work, cfg = sys.argv[1], sys.argv[2]


def fake_run(cmd, run_dir, name, env, started=None, prefix=None):
  os.makedirs(run_dir, exist_ok=True)
  if name == "b":
    raise runner.RunInterrupted(75)
  return 0
sweep.run_streamed = fake_run
sys.argv = [os.path.join(runner.REPO_ROOT, "experiments", "sweep.py"), f"--config={cfg}",
            "--binary=train_ppo", f"--workdir={work}"]
flags.FLAGS(sys.argv)
try:
  sweep.check_train_configs = lambda runs, configs, passthrough: {}  # (no TrainConfig)
  sweep.main(["sweep"])
except SystemExit as e:
  print("exit", e.code)
"""


def test_a_sweep_stopped_by_ctrl_c_says_where_it_stands_and_how_to_continue(tmp_path):
  """Ctrl-C (exit 130) logs the line on where the sweep stands that its end logs (it ended on
  a note alone: no word of how many runs had a row, nor which were left), and the command that
  continues it."""
  cfg = _sweep_config(tmp_path / "three.py", "{'lr': 0.0}",
                      "[{'name': n, 'lr': float(k)} for k, n in enumerate('abc')]")
  work = tmp_path / "sw"
  proc = subprocess.run([sys.executable, "-c", _CTRL_C, str(work), str(cfg)],
                        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
  assert proc.stdout.splitlines()[-1:] == ["exit 130"], proc.stdout + proc.stderr[-3000:]
  status = "2 of 3 runs have a row (1 ok, 1 stopped); not run yet: c; wall time "
  assert f"sweep: {status}" in proc.stderr, proc.stderr[-3000:]
  assert (work / "summary.md").read_text().startswith(status)
  assert (f"interrupted: {work}/summary.md has the runs so far; to continue, run the same "
          "command again (train_ppo runs resume from their checkpoints, and other binaries' "
          f"finished runs are kept): python -m experiments.sweep --config={cfg} "
          f"--binary=train_ppo --workdir={work}\n") in proc.stderr, proc.stderr[-3000:]


_STOPPED_IN_SET_UP = """
import json, os, sys
from experiments import sweep
run_dir = sys.argv[1]
os.makedirs(run_dir)
with open(os.path.join(run_dir, "result.json"), "w") as f:  # the finished first start's
  json.dump({"status": "done", "iterations": 3, "num_iterations": 3}, f)
set_up = sweep._ended({"run": "r"}, 75, run_dir, 1.0, 0)
with open(os.path.join(run_dir, "result.json"), "w") as f:  # a stop in training writes its own
  json.dump({"status": "stopped", "iterations": 5, "num_iterations": 9}, f)
print(json.dumps([set_up, sweep._ended({"run": "r"}, 75, run_dir, 1.0, 0)]))
"""


def test_a_run_stopped_in_its_set_up_does_not_take_an_earlier_starts_result(tmp_path):
  """A finished run re-run with more iterations and stopped (exit 75) before training wrote no
  result.json: its row took the first start's ("done", 3 iterations) beside "stopped". Only a
  result.json of a stop ("stopped") says how far the run got."""
  proc = subprocess.run([sys.executable, "-c", _STOPPED_IN_SET_UP, str(tmp_path / "r")],
                        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  set_up, in_training = json.loads(proc.stdout.splitlines()[-1])
  assert set_up["status"].startswith("stopped (exit 75") and "iterations" not in set_up, set_up
  assert (in_training["iterations"], in_training["result/status"]) == (5, "stopped")


def test_a_run_with_one_logged_iteration_is_drawn_as_a_point(tmp_path):
  """curves.png: a run that logged one iteration (one that failed early, or a sweep of one
  iteration) is a marker; drawn as a one-point line it was invisible, though the legend named
  it, and its seeds' band had no width. Longer runs stay plain lines."""
  script = """
import json
import numpy as np
from experiments import sweep
one = np.array([1.0])
lines = {"reward/mean": [("short (failed)", [1], one, one, one),
                         ("long", [1, 2], np.arange(2.0), np.arange(2.0), np.arange(2.0))],
         "kl/ref_mean": [("seeds", [3], one, one - 0.5, one + 1.0)]}
fig = sweep.curves_figure(lines, 1)
kl = fig.axes[1]
print(json.dumps({l.get_label(): l.get_marker() for l in fig.axes[0].get_lines()}))
print(json.dumps([list(kl.get_xlim()), [list(map(list, c.get_segments()[0]))
                                         for c in kl.collections]]))
"""
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  markers = json.loads(proc.stdout.splitlines()[-2])
  assert markers == {"short (failed)": "o", "long": "None"}, markers
  # Every run of one iteration (3): the axis spans 2-4, not 2.945-3.050; seeds' band at that
  # iteration drawn as an error bar from their lowest to their highest (0.5-2.0).
  xlim, bars = json.loads(proc.stdout.splitlines()[-1])
  assert xlim == [2.0, 4.0] and bars == [[[3.0, 0.5], [3.0, 2.0]]], (xlim, bars)


def test_a_run_trained_past_the_sweep_s_num_iterations_says_so(tmp_path):
  """A sweep re-run with fewer iterations: each finished run trains nothing and its row showed
  'ok' with iterations 10 of num_iterations 5, its rewards and rates of all 10, beside runs of
  5. Its status now says so, and what runs the shorter one."""
  run = tmp_path / "r"
  run.mkdir()
  (run / "result.json").write_text(json.dumps({"status": "done", "iterations": 10,
                                               "num_iterations": 5, "reward_last_10pct": 0.5}))
  script = f"""
import json
from experiments import sweep
row = sweep._ended({{"run": "r"}}, 0, {str(run)!r}, 103.0, 0)
# (a re-run that trained nothing keeps its earlier wall_s: sweep.run_sweep)
print(json.dumps([row, sweep.nothing_trained({{"status": "ok", "wall_s": 100.0,
                                               "iterations": 10}}, row)]))
"""
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  row, nothing = json.loads(proc.stdout.splitlines()[-1])
  assert row["status"] == ("ok (trained to 10 earlier, past num_iterations=5: its figures are of "
                           "all of them; a new --workdir runs the shorter one)"), row
  assert nothing  # its wall_s stays the training's, not grown by this start's set-up
  assert (row["iterations"], row["num_iterations"]) == (10, 5)


_SWEEP_FIXES = """
import json, os, signal, subprocess, sys, time
from experiments import sweep
work = sys.argv[1]
out = {}
# A signal that came before the run's start (while its inputs were hashed) reaches it at once.
s = sweep._Signals()
s.signum = signal.SIGTERM
proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
t0 = time.time()
s.started(proc)
out["pending"] = [proc.wait(timeout=30), time.time() - t0 < 20]
# wall_s: a start that saved no checkpoint (a refused resume, exit 1), then one that found
# nothing to train, add nothing to the 20 s of the start that trained.
sweep.wd.write_json(os.path.join(work, "summary.json"),
                    [{"run": "r", "status": "ok", "wall_s": 20.0, "iterations": 2}])
os.makedirs(os.path.join(work, "r", "checkpoints", "2"))
walls = []
for rc in (1, 0):
  sweep.run_streamed = lambda cmd, run_dir, name, env, started=None, prefix=None, rc=rc: (
      time.sleep(0.2), rc)[1]
  rows, _ = sweep._run_locked("train_ppo", "c.py", work, [], False, sweep._Signals(),
                              [(0, "r", {})], lambda rows: sweep.wd.write_json(
                                  os.path.join(work, "summary.json"), rows))
  walls.append(rows[0]["wall_s"])
out["walls"] = walls
# A field only some entries set sits among the run's fields, before status and the results.
sweep.write_summary(work, [{"run": "a", "seed": 0, "status": "ok", "wall_s": 1.0},
                           {"run": "b", "algo.minibatch_size": 5, "seed": 1, "status": "ok",
                            "wall_s": 2.0}])
out["header"] = open(os.path.join(work, "summary.md")).read().splitlines()[0]
out["killed"] = [sweep.killed_by(-9), sweep.killed_by(143), sweep.killed_by(1),
                 sweep.killed_by(0)]
# FILE.py and FILE.py:DEFAULT are one sweep; another variant is not.
sweep.wd.write_json(os.path.join(work, "sweep.json"),
                    {"config": "configs/ppo_tiny.py", "binary": "train_ppo", "flags": ["k"]})
sweep.refuse_another_sweep(work, {"config": "configs/ppo_tiny.py:ppo", "binary": "train_ppo"},
                           "ppo")
try:
  sweep.refuse_another_sweep(work, {"config": "configs/ppo_tiny.py:grpo",
                                    "binary": "train_ppo"}, "ppo")
  out["other"] = None
except sweep.wd.ForeignWorkdirError as e:
  out["other"] = str(e)
from experiments import config_files
from configs import ppo_tiny
out["default"] = config_files.default_variant(ppo_tiny)
# An earlier start's flag field: this start's runs show the value their config has.
out["flags"] = sweep.earlier_flags(work)
out["row"] = sweep.run_row("a", {"seed": 1}, [], {"seed": 1, "k": 2, "j": 3}, ["k"])
print(json.dumps(out))
"""


def test_sweep_signals_wall_time_columns_kills_variants_and_earlier_flags(tmp_path):
  """A SIGTERM between two runs of a sweep (while the next one's inputs were hashed) went to
  the finished run: the next started and ran to its end. A resumed training run's wall_s added
  the starts that saved nothing (a resume refused for a changed field: 2.9 s; the next start,
  which found nothing to train: 2.2 s). summary.md put a field only some entries set past the
  results. A run killed by SIGKILL had an empty error. FILE.py and FILE.py:DEFAULT were two
  sweeps. The flags of earlier starts were forgotten: their runs and this start's were averaged
  as seeds of one setting (sweep.json now records them; test_a_sweep_started_again_without_a_
  flag_groups_its_runs_apart runs it)."""
  proc = subprocess.run([sys.executable, "-c", _SWEEP_FIXES, str(tmp_path)], cwd=REPO,
                        env=_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.splitlines()[-1])
  assert out["pending"] == [-15, True]
  assert out["walls"] == [20.0, 20.0]
  assert out["header"] == "| run | algo.minibatch_size | seed | status | wall_s |", out["header"]
  assert out["killed"] == [
      "killed by signal 9 (SIGKILL; the kernel's OOM killer sends it when memory runs out: see "
      "dmesg)", "killed by signal 15 (SIGTERM)", "", ""]
  assert out["other"] and "configs/ppo_tiny.py:grpo" in out["other"]
  assert out["default"] == "ppo"
  assert out["flags"] == ["k"]
  assert out["row"] == {"run": "a", "seed": 1, "k": 2}


_FLAGS_FORGOTTEN = """
import json, os, sys
from absl import logging
from experiments import sweep
logging.set_verbosity(logging.INFO)
work, config = sys.argv[1], sys.argv[2]
sweep.run_streamed = lambda cmd, run_dir, name, env, started=None, prefix=None: (
    sweep.wd.write_json(os.path.join(run_dir, "result.json"), {"score": 1.0}), 0)[1]
for passthrough, only in ((["--config.workers=1"], None), ([], ["s0"])):
  rows, _ = sweep._run_sweep(config, "schedule_search", work, passthrough, False,
                             sweep._Signals(), only=only)
print(json.dumps({"summary": json.load(open(os.path.join(work, "summary.json"))),
                  "seeds": os.path.exists(os.path.join(work, "summary_seeds.json"))}))
"""


def test_a_sweep_started_again_without_a_flag_groups_its_runs_apart(tmp_path):
  """Seeds s0, s1 run with --config.workers=1, then s0 alone without the flag (workers=2, the
  config's): the seeds table averaged the two as one setting ("workers 1.5 ± 0.7") without a
  word. The earlier start's flag is recorded (sweep.json); s0's row shows its workers, the two
  are no seeds group, and the sweep says why."""
  config = _sweep_config(tmp_path / "s.py", "{'seed': 0, 'workers': 2}",
                         "[{'name': 's0', 'seed': 0}, {'name': 's1', 'seed': 1}]")
  proc = subprocess.run([sys.executable, "-c", _FLAGS_FORGOTTEN, str(tmp_path / "sw"),
                         str(config)], cwd=REPO, env=_env(), capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.splitlines()[-1])
  assert [(r["run"], r["workers"]) for r in out["summary"]] == [("s0", 2), ("s1", 1)]
  assert not out["seeds"]
  assert "the summary's runs were made with different workers: 2 in s0; 1 in s1" in proc.stderr


_RECORDED_WALL = """
import json, os, sys, time
from experiments import sweep
work = sys.argv[1]
# No summary row (the sweep was killed with kill -9), a saved checkpoint, and the run's
# result.json: two starts that trained, 30 s and 50 s by the run's own record.
starts = [{"from": 0, "to": 2, "wall_s": 30.0}, {"from": 2, "to": 4, "wall_s": 50.0}]
for name in ("refused", "trains"):
  os.makedirs(os.path.join(work, name, "checkpoints", "4"))
  sweep.wd.write_json(os.path.join(work, name, "result.json"),
                      {"status": "stopped", "iterations": 4, "trained_by": starts})

def fake_run(cmd, run_dir, name, env, started=None, prefix=None):
  time.sleep(0.2)
  if name == "refused":  # (WorkdirInUseError: the killed sweep's run still held it)
    return 1
  os.makedirs(os.path.join(run_dir, "checkpoints", "6"))
  sweep.wd.write_json(os.path.join(run_dir, "result.json"), {
      "status": "done", "iterations": 6, "num_iterations": 6,
      "trained_by": starts + [{"from": 4, "to": 6, "wall_s": 12.0}]})
  return 0
sweep.run_streamed = fake_run
rows, _ = sweep._run_locked("train_ppo", "c.py", work, [], False, sweep._Signals(),
                            [(0, "refused", {}), (1, "trains", {})], lambda rows: None)
print(json.dumps([r["wall_s"] for r in rows]))
"""


def test_a_training_runs_wall_time_is_what_its_starts_that_trained_recorded(tmp_path):
  """A re-run after the sweep was killed (no summary row yet): a start refused for the workdir
  the killed sweep's run still held showed its own 2.43 s as the run's wall_s (or 0), a
  400-iteration run's; a start killed with its process group lost its training time. The run's
  result.json records each start that trained with its seconds (trained_by's wall_s): summed."""
  proc = subprocess.run([sys.executable, "-c", _RECORDED_WALL, str(tmp_path)], cwd=REPO,
                        env=_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.splitlines()[-1]) == [80.0, 92.0]


def test_a_run_name_too_long_or_with_a_control_character_is_refused_before_any_run(tmp_path):
  """A 300-character name passed --dry_run and the name check, then the sweep crashed mid-way
  on its directory (OSError: File name too long) after the earlier runs had trained. Refused
  before anything runs, as is a tab; 255 bytes (NAME_MAX) still pass."""
  script = """
import json, types
from experiments import sweep
out = []
for name in ("a" * 300, "é" * 128, "a\\tb", "a" * 255):
  try:
    sweep._sweep_of(types.SimpleNamespace(get_sweep=lambda: [{"name": name}]), None, "s.py")
    out.append(None)
  except ValueError as e:
    out.append(str(e))
print(json.dumps(out))
"""
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  long, wide, tab, most = json.loads(proc.stdout.splitlines()[-1])
  assert long == (f"get_sweep()[0]['name']={'a' * 40!r}... is 300 bytes long; expected at most "
                  "255 (a directory name's limit, NAME_MAX)")
  assert wide and "is 256 bytes long" in wide  # (bytes, not characters)
  assert tab == ("get_sweep()[0]['name']='a\\tb': expected a directory name without control "
                 "characters (it has '\\t')")
  assert most is None


def _tiny_train_sweep(tmp_path, entries: str):
  """A train_ppo sweep config over configs/ppo_tiny.py's get_config() with `entries`."""
  path = tmp_path / "s.py"
  path.write_text("import importlib.util\n"
                  f"_spec = importlib.util.spec_from_file_location('b', {REPO!r} + "
                  "'/configs/ppo_tiny.py')\n"
                  "_base = importlib.util.module_from_spec(_spec)\n"
                  "_spec.loader.exec_module(_base)\n"
                  "get_config = _base.get_config\n"
                  f"def get_sweep():\n  return {entries}\n")
  return path


def _checkpointed_run(tmp_path, setup: str, drop=()) -> None:
  """tmp_path/sw/a as a finished train_ppo run leaves it: a checkpoint dir (iteration 4) and the
  config.json of configs/ppo_tiny.py's config at seed 0 after `setup` (statements on `c`),
  without the dotted fields `drop` (a record written before they existed)."""
  run = tmp_path / "sw" / "a"
  (run / "checkpoints" / "4").mkdir(parents=True)
  # In this process: a config file defines no absl flags (a subprocess cost ~2 s of CPU each).
  c = ppo_tiny.get_config()
  c.seed = 0
  exec(setup, {"c": c})  # pylint: disable=exec-used
  record = json.loads(json.dumps(c.to_dict()))
  for field in drop:
    section, key = field.split(".")
    record[section].pop(key)
  (run / "config.json").write_text(json.dumps(record))


def _dry_run_sweep(config, tmp_path, *flags):
  """experiments.sweep --dry_run of train_ppo sweep `config` in tmp_path/sw, with `flags`."""
  return _run(["experiments.sweep", f"--config={config}", "--binary=train_ppo",
               f"--workdir={tmp_path / 'sw'}", "--dry_run", *flags])


def test_a_train_ppo_runs_invalid_config_fails_the_sweep_before_any_run(tmp_path):
  """algo.minibatch_size=5 (no divisor of the batch) failed its run after the earlier runs had
  trained: the sweep checks every run's config as train_ppo does, before anything runs."""
  config = _tiny_train_sweep(tmp_path, "[{'name': 'a', 'seed': 0}, "
                                       "{'name': 'b', 'algo.minibatch_size': 5}]")
  proc = _dry_run_sweep(config, tmp_path)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert ("get_sweep()[1] (b): config.algo.minibatch_size=5: expected a divisor of the rollout "
          "batch") in proc.stderr, proc.stderr[-3000:]
  assert not (tmp_path / "sw" / "a").exists()


def test_a_train_ppo_runs_unknown_reward_function_fails_the_sweep_before_any_run(tmp_path):
  """reward.function='target_mach' (misspelt) passed the sweep's check of each run's config,
  which train_ppo refuses only as that run starts, after the earlier runs had trained: the
  sweep resolves every run's reward functions as train_ppo does at its start."""
  config = _tiny_train_sweep(tmp_path, "[{'name': 'a', 'seed': 0}, "
                                       "{'name': 'b', 'reward.function': 'target_mach'}]")
  proc = _dry_run_sweep(config, tmp_path)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert ("get_sweep()[1] (b): config.reward.function='target_mach': unknown reward function "
          "'target_mach'; known: [") in proc.stderr, proc.stderr[-3000:]
  assert "a: python" not in proc.stderr  # refused before any run's command


def test_a_finished_sweep_re_run_with_a_changed_value_is_refused_before_any_run(tmp_path):
  """A finished train_ppo sweep re-run with another optim.actor_lr launched every run, each
  failed ("add --config.checkpoint.resume_changes=..."), and the failed rows replaced the
  finished ones. Refused before anything runs, naming the run and the field; the flag the runs'
  own refusal asks for lets it through."""
  config = _tiny_train_sweep(tmp_path, "[{'name': 'a', 'seed': 0}]")
  _checkpointed_run(tmp_path, "c.optim.actor_lr = 0.01\n")
  refused = _dry_run_sweep(config, tmp_path)
  assert refused.returncode == 1, refused.stderr[-3000:]
  assert ("get_sweep()[0] (a): its checkpoints (iteration 4; " in refused.stderr and
          "were trained with other values: optim.actor_lr: 0.01 -> 0.003" in refused.stderr and
          "--config.checkpoint.resume_changes=optim.actor_lr" in refused.stderr), \
      refused.stderr[-3000:]
  allowed = _dry_run_sweep(config, tmp_path, "--config.checkpoint.resume_changes=optim.actor_lr")
  assert allowed.returncode == 0, allowed.stderr[-3000:]


def test_the_changed_checkpoint_check_reads_a_relative_plan_file_from_the_repository(tmp_path):
  """A run's config with a relative plan.file (read from the repository root, where the runs
  start): the checkpoints' config was rebuilt from the caller's directory, failed to read the
  plan there, and the run was let through to fail as it started."""
  plan = tmp_path / "plan.json"
  plan.write_text(json.dumps({
      "generation": {"mode": "instances", "tp": 1, "pp": 1, "groups": 1, "slots": 0},
      "inference": {"tp": 1, "pp": 1},
      "training": {"placement": "colocated", "tp": 1, "actor_pp": 1, "critic_pp": 1},
      "predicted": {"iteration_s": 1.0}, "summary": "test plan"}))
  rel = os.path.relpath(plan, REPO)
  config = _tiny_train_sweep(tmp_path, f"[{{'name': 'a', 'seed': 0, 'plan.file': {rel!r}}}]")
  _checkpointed_run(tmp_path, f"c.optim.actor_lr = 0.01\nc.plan.file = {rel!r}\n")
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  refused = subprocess.run(
      [sys.executable, "-m", "experiments.sweep", f"--config={config}", "--binary=train_ppo",
       f"--workdir={tmp_path / 'sw'}", "--dry_run"], cwd=elsewhere,
      env={**_env(), "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=240)
  assert refused.returncode == 1, refused.stderr[-3000:]
  assert "optim.actor_lr: 0.01 -> 0.003" in refused.stderr, refused.stderr[-3000:]


_FAILED_AFTER_FINISHED = """
import json, os, sys
from experiments import sweep
work = sys.argv[1]
sweep.wd.write_json(os.path.join(work, "summary.json"), [
    {"run": "r", "status": "ok", "reward_last_10pct": 0.5, "iterations": 4, "wall_s": 20.0}])
os.makedirs(os.path.join(work, "r", "checkpoints", "4"))

def fake_run(cmd, run_dir, name, env, started=None, prefix=None):
  with open(os.path.join(run_dir, "log.txt"), "a") as f:
    f.write("=== start\\nE1206 train_ppo.py:1] ValueError: this config differs\\n")
  return 1
sweep.run_streamed = fake_run
rows, _ = sweep._run_locked("train_ppo", "c.py", work, [], False, sweep._Signals(),
                            [(0, "r", {})], lambda rows: None)
print(json.dumps(rows[0]))
"""


def test_a_failed_start_keeps_the_finished_runs_row_and_says_so(tmp_path):
  """A finished run started again and failed (a changed value its checkpoints refuse): the
  failed row replaced the finished one in the summary, its figures gone. They are kept now,
  the status failed (the sweep exits 1) and saying whose the figures are."""
  proc = subprocess.run([sys.executable, "-c", _FAILED_AFTER_FINISHED, str(tmp_path)],
                        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  row = json.loads(proc.stdout.splitlines()[-1])
  assert row == {"run": "r", "status": "failed (exit 1; the figures are of its earlier finished "
                 "start)", "reward_last_10pct": 0.5, "iterations": 4, "wall_s": 20.0,
                 "error": "ValueError: this config differs"}, row
  assert "r finished earlier; this start of it failed (ValueError: this config differs)" in \
      proc.stderr


_CHANGED_NOTHING_TRAINED = """
import json, os, sys
from configs import ppo_tiny
from experiments import sweep
work, config = sys.argv[1], sys.argv[2]
run = os.path.join(work, "a")
os.makedirs(os.path.join(run, "checkpoints", "4"))
c = ppo_tiny.get_config()
c.seed = 0
sweep.wd.write_json(os.path.join(run, "config.json"), c.to_dict())  # the finished run's
sweep.wd.write_json(os.path.join(run, "result.json"),
                    {"status": "done", "iterations": 4, "num_iterations": 4})
sweep.run_streamed = lambda cmd, run_dir, name, env, started=None, prefix=None: 0  # no training
rows, _ = sweep._run_sweep(config, "train_ppo", work, [
    "--config.checkpoint.resume_changes=optim.actor_lr", "--config.optim.actor_lr=0.01"], False,
                           sweep._Signals())
print(json.dumps(rows[0]))
"""


def test_a_changed_field_that_trained_nothing_says_so_in_the_row(tmp_path):
  """A finished run started again with --config.checkpoint.resume_changes=optim.actor_lr
  --config.optim.actor_lr=0.01 trains nothing, and its row read "ok" beside actor_lr 0.01 as
  if that had trained."""
  config = _tiny_train_sweep(tmp_path, "[{'name': 'a', 'seed': 0}]")
  proc = subprocess.run([sys.executable, "-c", _CHANGED_NOTHING_TRAINED, str(tmp_path / "sw"),
                         str(config)], cwd=REPO, env=_env(), capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  row = json.loads(proc.stdout.splitlines()[-1])
  assert row["optim.actor_lr"] == 0.01
  assert row["status"] == ("ok (finished earlier; the changed optim.actor_lr trained no "
                           "iteration)"), row


def test_a_sweep_compares_a_checkpoint_from_before_model_normalize_with_its_raw_scores(tmp_path):
  """A run's config.json from before reward.model_normalize (its reward model scored raw):
  train_ppo compares it with 'off' (loop.ran_before_fields) and refuses the default 'auto' with
  a reward model holding OpenRLHF's mean and std; the sweep's own check filled in the default,
  found no change and launched the run to fail as it started. Refused before anything runs;
  --config.reward.model_normalize=off (how such a run continues) passes."""
  import shutil
  rm = tmp_path / "rm"
  shutil.copytree(os.path.join(REPO, "tests", "fixtures", "tiny_qwen2"), rm)
  hf = json.loads((rm / "config.json").read_text())
  hf.update(architectures=["RewardModel"], value_head_prefix="value_head", mean=2.5, std=0.5)
  (rm / "config.json").write_text(json.dumps(hf))
  config = _tiny_train_sweep(tmp_path, "[{'name': 'a', 'seed': 0, 'reward.kind': 'model', "
                                       f"'reward.model_checkpoint': {str(rm)!r}}}]")
  _checkpointed_run(tmp_path, f"c.reward.kind = 'model'\nc.reward.model_checkpoint = {str(rm)!r}\n",
                    drop=["reward.model_normalize"])
  refused = _dry_run_sweep(config, tmp_path)
  assert refused.returncode == 1, refused.stderr[-3000:]
  assert ("get_sweep()[0] (a): its checkpoints (iteration 4; " in refused.stderr and
          "reward.model_normalize: (absent: ran as 'off') -> 'auto'" in refused.stderr), \
      refused.stderr[-3000:]
  off = _dry_run_sweep(config, tmp_path, "--config.reward.model_normalize=off")
  assert off.returncode == 0, off.stderr[-3000:]


def test_a_sweep_resumes_a_checkpoint_from_before_clip_range_and_names_a_new_clamp(tmp_path):
  """A run's config.json from before reward.clip_range ran unclamped, the default: the sweep
  lets it through at the default, refuses a clamp as that change before anything runs, and
  passes it once checkpoint.resume_changes names the field (as train_ppo's own check)."""
  config = _tiny_train_sweep(tmp_path, "[{'name': 'a', 'seed': 0}]")
  _checkpointed_run(tmp_path, "", drop=["reward.clip_range"])
  same = _dry_run_sweep(config, tmp_path)
  assert same.returncode == 0, same.stderr[-3000:]
  refused = _dry_run_sweep(config, tmp_path, "--config.reward.clip_range=-10,10")
  assert refused.returncode == 1, refused.stderr[-3000:]
  assert ("get_sweep()[0] (a): its checkpoints (iteration 4; " in refused.stderr and
          "reward.clip_range: '' -> '-10.0,10.0'" in refused.stderr and
          "--config.checkpoint.resume_changes=reward.clip_range" in refused.stderr), \
      refused.stderr[-3000:]
  named = _dry_run_sweep(config, tmp_path, "--config.reward.clip_range=-10,10",
                         "--config.checkpoint.resume_changes=reward.clip_range")
  assert named.returncode == 0, named.stderr[-3000:]
