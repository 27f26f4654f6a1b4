"""bench_generation end to end on its tiny config: identical outputs, result.json fields, one
timeline per mode, a calibration file the simulator loads and predicts the bench with."""
import json
import os

from configs import bench_generation as bench_config
from experiments import bench_generation
from rlhfuse_jax.policy import calibration
from rlhfuse_jax.sim import validation


def test_tiny_bench(tmp_path):
  c = bench_config.get_config("tiny")
  c.generation.migration_threshold = "0.75"  # fixed (as --config... would), so the simulator
  # can rebuild the bench from config.json
  c.lengths.median = 8.0  # a tail long enough that live samples sit on both instances at Rt
  workdir = str(tmp_path)
  result = bench_generation.run_and_write(c, workdir)
  # The fused run really migrated a sample's KV cache, and its outputs are still identical.
  assert result["fused"]["migrated_samples"] > 0 and result["fused"]["consolidation_step"] > 0
  assert result["identical_outputs"] is True and result["identity"]["tokens_equal"]
  with open(os.path.join(workdir, "result.json")) as f:
    stored = json.load(f)
  for mode in ("baseline", "fused"):
    for key in ("gen_plus_inf_s", "wall_s", "instance_busy_frac"):
      assert stored[mode][key] > 0, (mode, key)
    assert os.path.getsize(os.path.join(workdir, f"timeline_{mode}.png")) > 10_000
  for key in ("consolidation_step", "migrated_samples", "migrated_kv_bytes"):
    assert key in stored["fused"]
  assert stored["ratio"] == stored["fused"]["gen_plus_inf_s"] / stored["baseline"][
      "gen_plus_inf_s"]
  assert stored["migration_threshold"] == 0.75 and len(stored["response_lens"]) == 8
  cal = calibration.load(os.path.join(workdir, "calibration.json"))
  assert cal.devices_share_compute and cal.migration is not None
  spec, measured = validation.gen_bench_from_workdir(workdir)
  assert spec.num_instances == 2 and spec.slots == 4
  predicted = validation.predict_bench_generation(cal, spec)
  assert predicted["fused"]["gen_plus_inf_s"] > 0 and measured["fused"] > 0
