"""A one-shot binary checks its config before it moves the earlier run's outputs aside: a typo
left the workdir holding only the failed run's config.json, the good result buried in
previous/<n> (one more per typo). (Binaries run as subprocesses: their absl flags.)"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("binary, flags, message", [
    ("bench_attention", ["--config.lengths=abc"], "config.lengths='abc': expected comma"),
    ("bench_attention", ["--config.model.num_heads=3"], "config.model: "),
    ("bench_pipeline", ["--config.critic_pp=3"], "critic_pp"),
    ("bench_pipeline", ["--config.data=4"], "config.data=4 x config.actor_pp=4 = 16 devices, but "
                                             "jax sees 8"),
    ("bench_pipeline", ["--config.bwd_ratio=-1.0"],
     "config.bwd_ratio=-1.0 must be a finite number > 0"),
    ("reproduce_ablations", ["--config=configs/ablations.py", "--config.calibration=BAD"],
     "calibration"),
    ("bench_pipeline", ["--config.actor.num_layers=3"], "config.actor.num_layers=3 must be "
                                                        "divisible by its pipeline stages=4"),
])
def test_a_bad_value_leaves_the_earlier_outputs_in_place(tmp_path, binary, flags, message):
  work = tmp_path / "w"
  work.mkdir()
  earlier = json.dumps({"provenance": {"command": f"python -m experiments.{binary}"}})
  (work / "result.json").write_text(earlier)
  (tmp_path / "bad.json").write_text('{"format": "rlhfuse_jax.sim.calibration/v1", "ops": 3}')
  flags = [f.replace("BAD", str(tmp_path / "bad.json")) for f in flags]
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  config = [] if any(f.startswith("--config=") for f in flags) else [
      f"--config=configs/{binary}.py"]
  out = subprocess.run([sys.executable, "-m", f"experiments.{binary}", *config,
                        f"--workdir={work}", *flags],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
  assert out.returncode == 1 and message in out.stderr, out.stderr[-3000:]
  assert (work / "result.json").read_text() == earlier
  assert not (work / "previous").exists(), os.listdir(work)
