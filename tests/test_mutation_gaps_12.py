"""Cheap tests proposed by a twelfth mutation audit, of the experiments binaries' computing
helpers (bench_async, bench_decode, bench_generation, bench_pipeline, calibrate_sim,
schedule_search, runner, sweep): each one fails under a plausible bug in a figure these binaries
write into result.json or a summary table that the rest of the suite lets through (the audit
report names the mutation each kills). They call the helpers on hand-made inputs with
hand-computed answers; nothing trains and nothing is timed.

A binary that defines absl flags (bench_async, bench_decode, bench_pipeline, schedule_search,
sweep) is imported in a subprocess, as the other tests of experiments/ do: two of them in one
process define --config twice. bench_generation and runner are imported here, as
test_bench_generation.py and test_config_files.py do."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, *args: str, timeout: int = 120) -> dict:
  """Runs `code` in a fresh interpreter from the repository root; returns the JSON object its
  last stdout line prints."""
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


# experiments/bench_async.py -----------------------------------------------------------------------

_ASYNC_SUMMARIZE = """
import json
from experiments import bench_async as b
steps = [10.0, 9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 100.0, 200.0, 300.0]
rows = [{"reward/mean": 0.1 * i, "timing_s/step": s, "async/behaviour_weight_mean": 0.5 + i}
        for i, s in enumerate(steps)]
rows[3]["perf/async_overlap_frac"] = 0.5
rows[6]["perf/async_overlap_frac"] = 0.75
print(json.dumps({str(k): b.summarize(rows, 0.28, 2, k) for k in (0, 2)}))
"""


def test_bench_async_summary_windows_rounds_and_drops_the_last_iterations():
  """summarize on ten iterations (window 0.28: round(2.8) = 3 iterations each end; skip 2):
  the gain is the last window's mean reward minus the first's; the median step time leaves out
  the first `skip` iterations and the last max(1, staleness), which generate nothing ahead
  (staleness 0 still drops one); the overlap is the mean over the iterations that logged it."""
  got = _python(_ASYNC_SUMMARIZE)
  for k, s in got.items():
    assert s["iterations"] == 10
    assert s["reward_first"] == pytest.approx(0.1) and s["reward_last"] == pytest.approx(0.8)
    assert s["reward_gain"] == pytest.approx(0.7)
    assert s["overlap_frac"] == pytest.approx(0.625)
    assert s["behaviour_weight_mean"] == pytest.approx(5.0)  # mean of 0.5 + 0..9
  # staleness 0: iterations 2..8 (1, 2, 3, 4, 5, 100, 200); staleness 2: 2..7
  assert got["0"]["median_step_s"] == 4.0 and got["2"]["median_step_s"] == 3.5


_ASYNC_MAIN = """
import json, os, re, sys
workdir, runs = sys.argv[1:3]
# config_flags reads the --config.* overrides from sys.argv when the binary defines --config.
sys.argv = ["bench_async", "--config=configs/bench_async.py", f"--workdir={workdir}",
            "--config.staleness=(0,1)", "--config.seeds=(0,1)", "--config.window=0.25",
            "--config.skip=0", "--config.min_gain_ratio=0.75", "--config.parallel=1",
            "--config.num_iterations=4", f"--config.runs={runs}"]
from absl import flags
from experiments import bench_async as b
# reward gain and step times of each run (config stem, staleness, seed): 4 iterations, window
# 0.25 (one iteration each end), skip 0, so the median step is over the first three.
plan = {("ppo_tiny", 0, 0): (0.25, [1.0, 2.0, 4.0]), ("ppo_tiny", 0, 1): (0.75, [2.0, 4.0, 8.0]),
        ("ppo_tiny", 1, 0): (0.375, [1.0, 1.0, 1.0]), ("ppo_tiny", 1, 1): (0.375, [2.0, 2.0, 2.0]),
        ("grpo_tiny", 0, 0): (0.0, [1.0, 1.0, 1.0]), ("grpo_tiny", 0, 1): (0.0, [1.0, 1.0, 1.0]),
        ("grpo_tiny", 1, 0): (0.5, [1.0, 1.0, 1.0]), ("grpo_tiny", 1, 1): (0.5, [1.0, 1.0, 1.0])}

def fake_run(cmd, run_dir, name, env, started=None):
  stem, k, seed = re.fullmatch(r"(.*)_s(\\d+)_seed(\\d+)", name).groups()
  gain, steps = plan[stem, int(k), int(seed)]
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    for i, reward in enumerate([0.0, 0.0, 0.0, gain]):
      f.write(json.dumps({"step": i + 1, "reward/mean": reward,
                          "timing_s/step": (steps + [50.0])[i]}) + "\\n")
  return 0

b.runner.run_streamed = fake_run
flags.FLAGS(sys.argv)
rc = b.main(["bench_async"])
with open(os.path.join(workdir, "result.json")) as f:
  print(json.dumps({"rc": rc, "result": json.load(f)}))
"""


def test_bench_async_ratios_are_over_the_seeds_mean_synchronous_run(tmp_path):
  """main's figures (its train_ppo runs faked): each staleness's figures are the seeds' means;
  gain_ratio and step_time_ratio are the asynchronous run's over the synchronous one's; a gain
  ratio equal to the bar passes; a synchronous run that did not learn gives no ratio and fails
  the acceptance, whatever the asynchronous run gained."""
  alone = _python(_ASYNC_MAIN, str(tmp_path / "ppo"), "('configs/ppo_tiny.py',)")
  assert alone["result"]["all_gains_ok"] is True  # (the synchronous rows have no gain_ok)
  got = _python(_ASYNC_MAIN, str(tmp_path / "both"),
                "('configs/ppo_tiny.py','configs/grpo_tiny.py')")
  assert got["rc"] == 0
  runs = got["result"]["runs"]
  sync, fast = runs["configs/ppo_tiny.py"]["s0"], runs["configs/ppo_tiny.py"]["s1"]
  assert sync["reward_gain"] == 0.5 and sync["reward_gain_per_seed"] == [0.25, 0.75]
  assert sync["median_step_s"] == 3.0  # medians 2 and 4
  assert fast["reward_gain"] == 0.375 and fast["median_step_s"] == 1.5
  assert fast["gain_ratio"] == 0.75 and fast["step_time_ratio"] == 0.5
  assert fast["gain_ok"] is True  # at the bar, not above it
  flat = runs["configs/grpo_tiny.py"]
  assert flat["s0"]["reward_gain"] == 0.0 and flat["s1"]["reward_gain"] == 0.5
  assert flat["s1"]["gain_ratio"] is None and flat["s1"]["gain_ok"] is False
  assert got["result"]["failed_runs"] == [] and got["result"]["all_gains_ok"] is False


# experiments/bench_decode.py ----------------------------------------------------------------------

_DECODE_FIGURES = """
import json, sys, types
from experiments import bench_decode as bd

def result(platform):
  return {
      "device": {"platform": platform, "device_kind": "X"},
      "model": {"num_params": 1234},
      "decode": {"prompt_len": 8, "cache_len": 24, "per_batch": [
          {"batch": 1, "step_s": 0.5, "prefill_s": 2.0, "decode_s": 7.5, "prefill_flops": 8e3,
           "achieved_bw_bytes_per_s": 300.0, "mean_live_len": 16.0, "decode_steps": 15},
          {"batch": 4, "step_s": 1.0, "prefill_s": 4.0, "decode_s": 15.0, "prefill_flops": 32e3,
           "achieved_bw_bytes_per_s": 600.0, "mean_live_len": 16.0, "decode_steps": 15}]},
      "train": {"batch": 2, "prompt_len": 8, "response_len": 16, "step_s": 4.0,
                "flops": 1200.0, "achieved_flops_per_s": 300.0, "flops_6nd": 1600.0,
                "actor_fwd_s": 0.5, "critic_fwd_s": 0.5}}

out = {}
r = bd.add_fractions(result("tpu"), peak_flops=1000.0, peak_bw=1200.0)
out["bw"] = [row["bw_fraction"] for row in r["decode"]["per_batch"]]
out["prefill_mfu"] = [row["prefill_mfu"] for row in r["decode"]["per_batch"]]
out["mfu"], out["mfu_6nd"] = r["train"]["mfu"], r["train"]["mfu_6nd"]
out["tpu_cal"] = bd.calibration_file(r)
even = result("cpu")
even["train"]["step_s"] = 1.0  # the update no longer than its two forwards
out["cpu_cal"] = bd.calibration_file(even)
bd.measure_peer = lambda cfg, batch: {"batch": batch, "tokens_per_s": 50.0 * batch}
sys.modules["torch"] = types.ModuleType("torch")
sys.modules["transformers"] = types.ModuleType("transformers")
rows = [{"batch": 1, "tokens_per_s": 100.0}, {"batch": 4, "tokens_per_s": 100.0}]
out["peer"] = bd.peer_baselines(types.SimpleNamespace(peer="hf"), rows)
print(json.dumps(out))
"""


def test_bench_decode_fractions_calibration_and_peer_ratio_of_a_made_up_result():
  """bench_decode's figures on a made-up result with known peaks (the suite's CPU has none, so
  the bench's own run reports every fraction as None): bandwidth over the HBM peak, prefill MFU
  from the prefill's FLOPs and seconds, the update's MFU and its 6ND variant; the calibration
  file's prefill rate from the largest batch, its share flag from the platform, no train stage
  when the update took no longer than the forwards; ours over the HF peer's tokens/s."""
  got = _python(_DECODE_FIGURES)
  assert got["bw"] == pytest.approx([0.25, 0.5])
  assert got["prefill_mfu"] == pytest.approx([4.0, 8.0])  # 8e3 / 2 / 1e3, 32e3 / 4 / 1e3
  assert got["mfu"] == pytest.approx(0.3) and got["mfu_6nd"] == pytest.approx(0.4)
  tpu, cpu = got["tpu_cal"], got["cpu_cal"]
  assert tpu["ops"]["decode_step"] == {"occupied_slots": [1, 4], "seconds": [0.5, 1.0]}
  assert tpu["ops"]["prefill"]["tokens_per_s"] == pytest.approx(4 * 8 / 4.0)
  assert tpu["ops"]["train_stage"] == {"actor_fwd_s": 0.5, "critic_fwd_s": 0.5,
                                       "bwd_over_fwd": pytest.approx(3.0)}
  # Fake CPU devices share one processor; a TPU's chips do not.
  assert tpu["devices_share_compute"] is False and cpu["devices_share_compute"] is True
  assert tpu["model_params"] == 1234 and tpu["instance_devices"] == 1
  assert "train_stage" not in cpu["ops"] and "train_stage omitted" in cpu["notes"]
  assert [p["ours_over_peer"] for p in got["peer"]["per_batch"]] == [2.0, 0.5]


# experiments/bench_generation.py ------------------------------------------------------------------

def _outputs(**changes):
  out = {"response_tokens": np.array([[5, 6, 0], [7, 0, 0]]), "response_lens": np.array([2, 1]),
         "logprobs": np.array([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]]),
         "ref_logp": np.array([[-1.5, -2.5, 0.0], [-1.0, 0.0, 0.0]]),
         "rewards": np.array([0.25, -0.75])}
  for name, value in changes.items():
    out[name] = np.asarray(value)
  return out


def test_bench_generation_compare_keeps_the_largest_absolute_difference_and_the_lengths():
  """compare: the worst |difference| of each output (a negative one counts by its size), one
  exactly at LOGPROB_ATOL still identical, a larger one in any inference output not; a row
  length that differs while the tokens agree (its padding) makes the outputs differ."""
  from experiments import bench_generation as bg
  base, atol = _outputs(), bg.LOGPROB_ATOL
  same = bg.compare(base, _outputs())
  assert same["identical"] and same["tokens_equal"]
  assert set(same) == {"tokens_equal", "logprobs_max_abs_diff", "ref_logp_max_abs_diff",
                       "rewards_max_abs_diff", "identical"}  # no values: none compared
  higher = base["logprobs"].copy()
  higher[1, 0] += 0.25  # above the first run's: first - second is negative
  got = bg.compare(base, _outputs(logprobs=higher))
  assert got["logprobs_max_abs_diff"] == pytest.approx(0.25) and not got["identical"]
  edge = bg.compare({**base, "rewards": np.array([0.0, 0.0])},
                    {**base, "rewards": np.array([atol, -atol])})
  assert edge["rewards_max_abs_diff"] == atol and edge["identical"]
  far = bg.compare(base, _outputs(rewards=[0.25, -0.75 + 4 * atol]))
  assert far["rewards_max_abs_diff"] == pytest.approx(4 * atol) and not far["identical"]
  assert far["tokens_equal"] and far["logprobs_max_abs_diff"] == 0.0
  lens = bg.compare(base, _outputs(response_lens=[2, 2]))
  assert not lens["tokens_equal"] and not lens["identical"]


def test_bench_generation_summary_derives_exposed_inference_cpu_share_and_same_host_moves(
    monkeypatch):
  """summarize's derived figures: inference exposed after generation ended, the CPU share of
  wall x cores, and the same-host migrations as all of them less the cross-host ones."""
  import types
  from experiments import bench_generation as bg
  monkeypatch.setattr(bg.os, "cpu_count", lambda: 4)
  keys = ("gen/consolidation_step", "gen/migrated_samples", "gen/migrated_kv_bytes",
          "gen/migration_copied_bytes", "gen/migration_s", "gen/migrated_samples_cross_host",
          "gen/migration_cross_host_bytes", "gen/migration_same_host_s",
          "gen/migration_cross_host_s", "gen/migration_cross_host_compile_s",
          "fusion/weight_load_s", "fusion/weight_load_bytes", "timing_s/actor_to_instances",
          "gen/decode_rounds", "gen/instance_chunks", "gen/unfinished_curve")
  metrics = {k: float(i) for i, k in enumerate(keys)}
  metrics.update({"cpu_s": 6.0, "gen/migrated_samples": 10, "gen/migrated_samples_cross_host": 3,
                  "gen/migration_copied_bytes": 1000, "gen/migration_cross_host_bytes": 400})
  timeline = types.SimpleNamespace(gen_plus_inf_s=5.0, gen_end_s=3.5, instance_busy_frac=0.5,
                                   inference_overlap_frac=0.25)
  out = types.SimpleNamespace(metrics=metrics, timeline=timeline, rt=0.2, consolidations=[])
  s = bg.summarize(out, wall_s=3.0)
  assert s["gen_plus_inf_s"] == 5.0 and s["gen_s"] == 3.5 and s["wall_s"] == 3.0
  assert s["inference_exposed_s"] == 1.5
  assert s["cpu_util"] == pytest.approx(6.0 / (3.0 * 4))
  assert s["same_host_migrated_samples"] == 7 and s["cross_host_migrated_samples"] == 3
  assert s["same_host_migrated_bytes"] == 600 and s["cross_host_migrated_bytes"] == 400
  for field, key in (("same_host_migration_s", "gen/migration_same_host_s"),
                     ("cross_host_migration_s", "gen/migration_cross_host_s"),
                     ("migrated_kv_bytes", "gen/migrated_kv_bytes"),
                     ("weight_load_s", "fusion/weight_load_s"),
                     ("actor_to_instances_s", "timing_s/actor_to_instances")):
    assert s[field] == metrics[key], field


def test_bench_generation_median_run_is_the_upper_median_by_wall_time():
  from experiments import bench_generation as bg
  runs = [("c", 3.0), ("a", 1.0), ("b", 2.0), ("d", 4.0)]
  assert bg._median_run(runs) == ("c", 3.0)  # pylint: disable=protected-access
  assert bg._median_run(runs[:3]) == ("b", 2.0)  # pylint: disable=protected-access


def test_bench_generation_batch_is_right_padded_to_each_prompts_length_over_the_whole_range():
  """make_batch (the default config: 64 prompts of 4..16 tokens): each prompt's tokens are
  non-zero up to its length and the pad 0 after it; the lengths reach both ends of
  [prompt_min_len, prompt_len]; the budgets lie in [lengths.min_len, max_new_tokens]."""
  from configs import bench_generation as bench_config
  from experiments import bench_generation as bg
  c = bench_config.get_config()
  tokens, plens, budgets, _ = bg.make_batch(c, 0)
  g = c.generation
  assert tokens.shape == (c.batch_size, g.prompt_len) and plens.shape == budgets.shape
  real = np.arange(g.prompt_len)[None, :] < plens[:, None]
  assert (tokens[real] > 0).all() and (tokens[~real] == 0).all()
  assert plens.min() == g.prompt_min_len and plens.max() == g.prompt_len
  assert budgets.min() >= c.lengths.min_len and budgets.max() <= g.max_new_tokens
