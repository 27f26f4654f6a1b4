"""experiments/bench_attention.py on its tiny default: it runs, the two variants compute the
same gradients, and the default positions' program does less attention work."""
import json
import os
import subprocess
import sys

from tests.xla_env import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_run_reports_both_variants(tmp_path):
  """Both programs' timings, dot FLOPs and gradients per length, and a bad length refused."""
  # One CPU device, as a user's run, with the suite's codegen flags (they change machine code,
  # not the HLO whose dot FLOPs are counted): without them the four gradient programs compiled
  # in 39 s of the suite's 24 min. No warm-up step (--config.warmup=0): one repeat is timed.
  env = subprocess_env(None, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.bench_attention", "--config=configs/bench_attention.py",
       "--config.repeats=1", "--config.warmup=0", f"--workdir={tmp_path}"], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(tmp_path / "result.json") as f:
    result = json.load(f)
  assert result["device"]["platform"] == "cpu" and result["block"] == 512
  rows = result["per_length"]
  assert [r["length"] for r in rows] == [1024, 1536]
  for r in rows:
    assert r["causal_s"] > 0 and r["every_tile_s"] > 0
    assert r["speedup"] == r["every_tile_s"] / r["causal_s"]  # one repeat: the pair's ratio
    assert r["causal_runs_s"] == [r["causal_s"]] and r["speedup_runs"] == [r["speedup"]]
    assert r["max_grad_rel_diff"] < 1e-5  # rounding: the same gradient
  # 2 and 3 query blocks: 1 and 3 tiles above the diagonal skipped per layer, each 7 dots
  # (forward 2, backward 5), and one more per layer: the skipping program's first query block
  # reads one key block, a loop XLA inlines, sharing its score dot between forward and
  # backward. So 8 and 22 dots per layer saved.
  saved = [r["every_tile_dot_flops"] - r["causal_dot_flops"] for r in rows]
  assert saved[0] > 0 and 2.5 * saved[0] < saved[1] <= 3 * saved[0]
  assert "L=1536" in proc.stderr
  bad = subprocess.run(
      [sys.executable, "-m", "experiments.bench_attention", "--config=configs/bench_attention.py",
       "--config.lengths=0,2", f"--workdir={tmp_path / 'bad'}"], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=300)
  assert bad.returncode != 0 and "config.lengths='0,2': expected comma-separated" in bad.stderr
