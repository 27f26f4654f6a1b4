"""Cheap tests proposed by a twelfth mutation audit, of the experiments binaries' computing
helpers (bench_async, bench_decode, bench_generation, bench_pipeline, calibrate_sim,
schedule_search, plan_search, runner, sweep): each one fails under a plausible bug in a figure
these binaries write into result.json or a summary table that the rest of the suite lets
through (the audit report names the mutation each kills). They call the helpers on hand-made
inputs with hand-computed answers (a timer or an executor faked where the helper times
something); nothing trains.

A binary that defines absl flags (bench_async, bench_decode, bench_pipeline, calibrate_sim,
schedule_search, plan_search, sweep) is imported in a subprocess, as the other tests of
experiments/ do: two of them in one process define --config twice. bench_generation and runner
are imported here, as test_bench_generation.py and test_config_files.py do."""
import functools
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
bar, parallel = (sys.argv[3:5] + ["0.75", "1"][len(sys.argv[3:5]):])
# config_flags reads the --config.* overrides from sys.argv when the binary defines --config.
sys.argv = ["bench_async", "--config=configs/bench_async.py", f"--workdir={workdir}",
            "--config.staleness=(0,1)", "--config.seeds=(0,1)", "--config.window=0.25",
            "--config.skip=0", f"--config.min_gain_ratio={bar}", f"--config.parallel={parallel}",
            "--config.num_iterations=4", f"--config.runs={runs}"]
from absl import flags
from experiments import bench_async as b
# reward gain and step times of each run (config stem, staleness, seed): 4 iterations, window
# 0.25 (one iteration each end), skip 0, so the median step is over the first three.
plan = {("ppo_tiny", 0, 0): (0.25, [1.0, 2.0, 4.0]), ("ppo_tiny", 0, 1): (0.75, [2.0, 4.0, 8.0]),
        ("ppo_tiny", 1, 0): (0.375, [1.0, 1.0, 1.0]), ("ppo_tiny", 1, 1): (0.375, [2.0, 2.0, 2.0]),
        ("grpo_tiny", 0, 0): (0.0, [1.0, 1.0, 1.0]), ("grpo_tiny", 0, 1): (0.0, [1.0, 1.0, 1.0]),
        ("grpo_tiny", 1, 0): (0.5, [1.0, 1.0, 1.0]), ("grpo_tiny", 1, 1): (0.5, [1.0, 1.0, 1.0])}

def fake_run(cmd, run_dir, name, env, started=None, prefix=None):
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
  assert got["result"]["step_times_comparable"] is True
  # No bar (the timing variant's min_gain_ratio=0): no verdict, where it said FAIL; runs side by
  # side: their step times are said not to be comparable.
  timed = _python(_ASYNC_MAIN, str(tmp_path / "timed"),
                  "('configs/ppo_tiny.py','configs/grpo_tiny.py')", "0", "2")
  assert timed["result"]["all_gains_ok"] is None
  assert timed["result"]["runs"]["configs/grpo_tiny.py"]["s1"]["gain_ok"] is None
  assert timed["result"]["step_times_comparable"] is False


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
fmha = 'stablehlo.custom_call @__cudnn$fmhaSoftmax(%q, %k, %v)'
out["attention"] = [bd.attention_in(text, configured) for text, configured in (
    (fmha, "auto"), ("stablehlo.dot_general", "auto"), ("stablehlo.dot_general", "cudnn"),
    ("stablehlo.dot_general", "pallas"), ("stablehlo.dot_general", "reference"),
    ("stablehlo.dot_general", "blockwise"))]
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
  # (and the timed micro-batch: 2 rows of 8 + 16 tokens, which scales the times to others)
  assert tpu["ops"]["train_stage"] == {"actor_fwd_s": 0.5, "critic_fwd_s": 0.5,
                                       "bwd_over_fwd": pytest.approx(3.0), "tokens": 48,
                                       "seq_len": 24}
  # Fake CPU devices share one processor; a TPU's chips do not.
  assert tpu["devices_share_compute"] is False and cpu["devices_share_compute"] is True
  assert tpu["model_params"] == 1234 and tpu["instance_devices"] == 1
  assert "train_stage" not in cpu["ops"] and "train_stage omitted" in cpu["notes"]
  assert [p["ours_over_peer"] for p in got["peer"]["per_batch"]] == [2.0, 0.5]
  # The attention an update's program holds (result.json said only "auto"): cuDNN's fused
  # attention where its custom call is in the program, else the fallback of what was asked.
  assert got["attention"] == ["cudnn", "blockwise", "blockwise", "blockwise", "reference",
                              "blockwise"]


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
          "gen/decode_rounds", "gen/instance_chunks", "gen/unfinished_curve",
          "fusion/inference_overlap_frac", "gen/instance_busy_frac")
  metrics = {k: float(i) for i, k in enumerate(keys)}
  metrics.update({"cpu_s": 6.0, "gen/migrated_samples": 10, "gen/migrated_samples_cross_host": 3,
                  "gen/migration_copied_bytes": 1000, "gen/migration_cross_host_bytes": 400,
                  "timing_s/gen_plus_inf": 6.0, "timing_s/generate": 3.75,
                  "timing_s/inference": 2.25})
  # The timeline is process 0's own, by its clock: another process scored 0.5 s longer after a
  # generation that ended 0.25 s later on the earliest process's clock (the metrics).
  timeline = types.SimpleNamespace(gen_plus_inf_s=5.0, gen_end_s=3.5, instance_busy_frac=0.5,
                                   inference_overlap_frac=0.25)
  out = types.SimpleNamespace(metrics=metrics, timeline=timeline, rt=0.2, consolidations=[],
                              overlap_figures=[[1, 0.5, 2.0], [0, 0.0, 1.0]])
  s = bg.summarize(out, wall_s=3.0)
  assert s["gen_plus_inf_s"] == 6.0 and s["gen_s"] == 3.75 and s["wall_s"] == 3.0
  assert s["inference_exposed_s"] == 2.25
  assert s["cpu_util"] == pytest.approx(6.0 / (3.0 * 4))
  assert s["same_host_migrated_samples"] == 7 and s["cross_host_migrated_samples"] == 3
  assert s["same_host_migrated_bytes"] == 600 and s["cross_host_migrated_bytes"] == 400
  for field, key in (("same_host_migration_s", "gen/migration_same_host_s"),
                     ("cross_host_migration_s", "gen/migration_cross_host_s"),
                     ("migrated_kv_bytes", "gen/migrated_kv_bytes"),
                     ("weight_load_s", "fusion/weight_load_s"),
                     ("actor_to_instances_s", "timing_s/actor_to_instances"),
                     # every process's instances, as the trainer logs them (the timeline's
                     # own, 0.5 and 0.25 here, are process 0's)
                     ("instance_busy_frac", "gen/instance_busy_frac"),
                     ("inference_overlap_frac", "fusion/inference_overlap_frac")):
    assert s[field] == metrics[key], field
  assert s["inference_overlap_by_process"] == out.overlap_figures


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


# experiments/bench_pipeline.py --------------------------------------------------------------------

_PIPELINE_CALIBRATION = """
import json
import numpy as np
import jax
from configs import bench_pipeline as config_file
from experiments import bench_pipeline as bp
from rlhfuse_jax.parallel.mesh import MeshConfig, make_mesh
from rlhfuse_jax.pipeline import program as prog, schedules
from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF

c = config_file.get_config()  # actor_pp 4, critic_pp 2, data 2
c.calib_ticks, c.repeats = 4, 3
cfg = bp.BenchPipelineConfig.from_config_dict(c)
problem = cfg.problem()
STEP, TICK = 0.25, 0.01  # the fake executor's fixed costs per step and per tick
COST = {AF: 1e-3, AB: 3e-3, CF: 5e-4, CB: 2e-3}  # per task, times (1 + its stage)

def task_cost(row, device):
  if row[prog.MODEL] == prog.IDLE:
    return 0.0
  actor = row[prog.MODEL] == prog.ACTOR
  kind = (AB if row[prog.BACKWARD] else AF) if actor else (CB if row[prog.BACKWARD] else CF)
  stage = device if actor else problem.critic_stage(device)
  return COST[kind] * (1 + stage)

def fake_stepper(cfg_, template, table, shape, mesh, params, batch):
  # One core: every task of a tick runs after the other, on each data copy.
  copies = mesh.shape["data"]
  work = sum(task_cost(table[d, t], d) for d in range(table.shape[0])
             for t in range(table.shape[1]))
  seconds = STEP + table.shape[1] * TICK + copies * work
  return lambda: seconds

bp._stepper = fake_stepper
mesh = make_mesh(MeshConfig(data=cfg.data, stage=cfg.actor_pp), jax.devices()[:8])
programs = [prog.build_program(problem, schedules.serial_order(problem), barrier=True)]
batch = {"tokens": np.zeros((cfg.minibatch_size, 4), np.int32)}
cal, check = bp.measure_calibration(cfg, problem, programs, mesh, None, batch)
print(json.dumps({"cal": cal, "check": check}))
"""


def test_bench_pipeline_calibration_recovers_a_fake_executors_costs():
  """measure_calibration against a fake executor whose step takes 0.25 s + 10 ms per tick +
  its tasks' costs (known per kind and stage, run one after the other): the tick and step
  overheads come out of the two idle tables, each task's cost per stage out of the one-device
  tables (the critic's stages on the devices that hold them), the train-stage means and
  bwd_over_fwd from those, and the all-busy check adds the data copies' actor backwards."""
  got = _python(_PIPELINE_CALIBRATION, timeout=240)
  ops = got["cal"]["ops"]
  assert ops["pipeline_executor"]["tick_overhead_s"] == pytest.approx(0.01)
  assert ops["pipeline_executor"]["step_overhead_s"] == pytest.approx(0.25)
  ts = ops["train_stage"]
  assert ts["actor_fwd_per_stage_s"] == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3])
  assert ts["actor_bwd_per_stage_s"] == pytest.approx([3e-3, 6e-3, 9e-3, 12e-3])
  assert ts["critic_fwd_per_stage_s"] == pytest.approx([5e-4, 1e-3])
  assert ts["critic_bwd_per_stage_s"] == pytest.approx([2e-3, 4e-3])
  assert ts["actor_fwd_s"] == pytest.approx(2.5e-3) and ts["actor_bwd_s"] == pytest.approx(7.5e-3)
  assert ts["critic_fwd_s"] == pytest.approx(7.5e-4) and ts["critic_bwd_s"] == pytest.approx(3e-3)
  assert ts["bwd_over_fwd"] == pytest.approx((7.5e-3 + 3e-3) / (2.5e-3 + 7.5e-4))
  check = got["check"]
  work = 2 * (3e-3 + 6e-3 + 9e-3 + 12e-3)  # both data copies' actor backwards, every stage
  assert check["task_work_per_tick_s"] == pytest.approx(work)
  assert check["added_per_tick_s"] == pytest.approx(work)  # the fake runs them one at a time
  assert check["effective_parallel_tasks"] == pytest.approx(1.0)
  cores = check["host_cores"]
  assert got["cal"]["parallel_tasks"] == cores and got["cal"]["devices_share_compute"] is True
  assert check["predicted_added_per_tick_s"] == pytest.approx(max(12e-3, work / cores))


_PIPELINE_HELPERS = """
import json
import numpy as np
from experiments import bench_pipeline as bp
from rlhfuse_jax.pipeline import program as prog
from rlhfuse_jax.pipeline.graph import AB, CB, PipelineProblem

out = {}
got = [np.array([1.0, -3.0]), np.array([3.0]), np.zeros(2)]
want = [np.array([1.0, -4.0]), np.array([2.0]), np.zeros(2)]
out["grad"] = bp.grad_error(got, want)
# actor_pp 4, critic_pp 2: device 3 holds critic stage 0 of replica 1 (reversed placement)
problem = PipelineProblem(4, 2, 8, 4, 1.0, 1.0)
shape = prog.ProgramShape(ticks=6, stash_sizes=(3, 2), inbox_sizes=(5, 5, 5, 4))
for name, device, kind in (("critic", 3, CB), ("actor", 3, AB)):
  table = bp._task_table(problem, 6, device, kind, shape)
  out[name] = {"others_idle": bool((np.delete(table, device, axis=0) == 0).all()),
               "rows": table[device].tolist()}
out["idle"] = bool((bp._task_table(problem, 6, 0, None, shape) == 0).all())
calls = iter([1.0, 1.5, 2.0, 2.25, 3.0, 3.75])
a = lambda: next(calls)
out["paired"] = bp._paired(a, a, 3)  # pairs (1, 1.5), (2, 2.25), (3, 3.75)
print(json.dumps(out))
"""


def test_bench_pipeline_grad_error_task_tables_and_paired_medians():
  """grad_error: the worst leaf's max |g - r| over its own max |r| (a zero leaf counts 0) and
  the global relative L2 error; _task_table: the busy device's fields at every tick (its
  model, direction, first/last stage, micro-batch of its replica, the model's stash ring and the
  kind's inbox ring), every other device idle; _paired: the median of the pairs' differences
  and of their first times."""
  got = _python(_PIPELINE_HELPERS)
  assert got["grad"]["max_leaf_rel"] == pytest.approx(0.5)  # 1/2 on the second leaf, 1/4 first
  assert got["grad"]["global_rel_l2"] == pytest.approx((2 / 21) ** 0.5)
  assert got["critic"]["others_idle"] and got["actor"]["others_idle"] and got["idle"]
  # device 3, critic backward: critic stage 0 of 2 (first), replica 1: micro-batches 4 + t % 4
  crit = [[2, 1, 1, 0, 4 + t % 4, t % 2, t % 4, 0, 0, 0, 0] for t in range(6)]
  assert got["critic"]["rows"] == crit
  # device 3, actor backward: actor stage 3 of 4 (last), micro-batches t % 8
  act = [[1, 1, 0, 1, t % 8, t % 3, t % 5, 0, 0, 0, 0] for t in range(6)]
  assert got["actor"]["rows"] == act
  assert got["paired"] == [pytest.approx(0.5), pytest.approx(2.0)]


# experiments/runner.py ----------------------------------------------------------------------------

@pytest.mark.parametrize("x, decimals, significant, text", [
    (1234.5678, 2, 1, "1234.57"), (0.05, 2, 1, "0.05"),
    (0.01, 2, 1, "0.01"),  # exactly one significant digit at 2 decimals: still fixed
    (0.0099, 2, 1, "9.90e-03"), (-0.005, 2, 1, "-5.00e-03"),
    (0.0, 2, 1, "0.00"),  # zero has no significant digit to lose
    (0.05, 2, 2, "5.00e-02"), (0.5, 2, 2, "0.50"), (0.0004, 3, 1, "4.00e-04")])
def test_fixed_or_sci_switches_to_e_notation_below_the_significant_digits(x, decimals,
                                                                          significant, text):
  from experiments import runner
  assert runner.fixed_or_sci(x, decimals, significant) == text


def test_smooth_is_a_trailing_mean_over_at_most_width_points():
  from experiments import runner
  got = runner.smooth([1.0, 2.0, 3.0, 4.0, 6.0], 2)
  assert got.tolist() == [1.0, 1.5, 2.5, 3.5, 5.0]
  assert runner.smooth([4.0, 0.0, 2.0], 5).tolist() == [4.0, 2.0, 2.0]  # what there is
  assert runner.smooth([4.0, 0.0, 2.0], 1).tolist() == [4.0, 0.0, 2.0]


@pytest.mark.parametrize("key, seed", [
    ("seed", True), ("pipeline.search_seed", True), ("data.seed", True), ("seeds", False),
    ("reseed", False), ("seed_count", False), ("algo.seedless", False)])
def test_is_seed_field_takes_seed_and_underscore_seed_names_only(key, seed):
  from experiments import runner
  assert runner.is_seed_field(key) is seed


# experiments/schedule_search.py -------------------------------------------------------------------

_SCHEDULE_SEARCH = """
import json, sys, types
from configs import schedule_search as config_file
from experiments import schedule_search as ss
from rlhfuse_jax.pipeline import schedules

workdir, which, budget = sys.argv[1], sys.argv[2], float(sys.argv[3])
c = config_file.get_config()
c.actor_pp, c.critic_pp, c.actor_microbatches, c.critic_microbatches = 4, 2, 4, 4
c.actor_fwd, c.critic_fwd, c.memory_budget, c.workers = 2.0, 1.0, budget, 1

def fake_search(problem, cfg, log=None):  # the search "finds" a known order
  order = getattr(schedules, f"{which}_order")(problem)
  return types.SimpleNamespace(best=order, best_unconstrained=order, search_s=0.5,
                               evaluations=100)

ss.search.search, ss.search.warmup = fake_search, lambda: 0.0
print(json.dumps(ss.run(c, workdir)))
"""


def test_schedule_search_result_figures_of_a_known_searched_order(tmp_path):
  """run's figures with the search faked to return a known order: the greedy order on the
  uniform budget reaches the tight bound (at_lower_bound, gap 0); the serial order without its
  barrier, within an explicit budget of 8, is above it by searched / bound - 1, and its
  devices at the budget are those whose peak equals it (one: the actor's first stage holds all
  four micro-batches), a peak one below it not; evaluations per second over the search's
  seconds."""
  at = _python(_SCHEDULE_SEARCH, str(tmp_path / "a"), "greedy", "-1")
  assert at["searched"] == at["greedy"] == at["lower_bound"] == 42.0
  assert at["at_lower_bound"] is True and at["gap_to_lower_bound"] == 0.0
  assert at["memory_budget_mode"] == "uniform" and at["evaluations_per_s"] == 200.0
  # device 0 at the budget of 9; device 1's peak of 8, one below it, is not
  assert at["peak_memory"]["searched"] == [9.0, 8.0, 5.0, 3.0] and at["budget_max"] == 9.0
  assert at["devices_at_budget"] == 1 and at["peak_max"] == 9.0
  above = _python(_SCHEDULE_SEARCH, str(tmp_path / "b"), "serial", "8")
  assert above["memory_budget_mode"] == "explicit" and above["budget_max"] == 8.0
  assert above["searched"] > above["lower_bound"] == 42.0 and above["at_lower_bound"] is False
  assert above["gap_to_lower_bound"] == pytest.approx(above["searched"] / 42.0 - 1.0)
  peaks, budget = above["peak_memory"]["searched"], above["peak_memory"]["budget"]
  assert peaks == [8.0, 6.0, 4.0, 2.0] and budget == [8.0] * 4
  assert above["devices_at_budget"] == 1 and above["peak_max"] == 8.0
  assert above["within_budget"] is True


# experiments/plan_search.py -----------------------------------------------------------------------

_PLAN_REPORT = """
import json
from experiments import plan_search as ps

def plan(summary, iteration_s, **extra):
  return {"summary": summary, "predicted": {"reshard_s": 0.5, "gen_s": 1.0, "inf_s": 0.25,
                                             "train_s": 2.0, "iteration_s": iteration_s},
          **extra}

best = plan("best", 4.0)
res = {"evaluated": 7, "rejected": {"gen tp8": "why", "inference tp8": "why"},
       "synchronous_search_s": 1.5, "search_s": 3.0,
       "best": best, "top": [best, plan("second", 5.0)],
       "uniform": {"layout": {"tp": 2, "pp": 1, "dp": 4}, **plan("u", 3.0)},
       "stages": {"generation": [["g1", 1.0]]},
       "refused": {"a": 1, "b": 7, "c": 3, "d": 2, "e": 5, "f": 4},
       "async": {"staleness": 1, "search_s": 1.5,
                 "top": [plan("async", 2.5, **{"async": {"colocated": True}})],
                 "splits": [{"generation_devices": 4, "training_devices": 4, "iteration_s": 2.5,
                             "bound": "train"},
                            {"generation_devices": 6, "training_devices": 2}]}}
setting = {"label": "x", "num_devices": 8, "hardware": "h100_sxm", "train_config": "cfg.py",
           "global_batch": 8, "minibatch": 4, "epochs": 1, "max_new_tokens": 16,
           "lengths": {"response_lengths_from": "targets"}}
print(json.dumps(ps.report(res, {}, setting)))
"""


def test_plan_search_report_ranks_refusals_and_compares_the_uniform_layout():
  """plan_search.md's computed lines: the refusals' total and the five most frequent, most
  frequent first; the uniform layout's time over the best combination's when it is faster; a
  colocated asynchronous plan on all devices; only the splits that fit, counted."""
  lines = _python(_PLAN_REPORT)
  text = "\n".join(lines)
  assert "restricted to plans the trainer runs." in text
  assert "22 synchronous combinations skipped (the trainer would not run them, or a stage does " \
      "not fit beside the training state), the most often for:" in text
  refusals = [line for line in lines if line.startswith("- ") and " x " in line]
  assert refusals == ["- 7 x b", "- 5 x e", "- 4 x f", "- 3 x c", "- 2 x d"]
  assert "The uniform layout is predicted faster than every per-stage combination (0.750x the " \
         "best's time)" in text
  assert "| 1 | async | all / all (colocated, serial) |" in text
  assert "Splits tried: 2, 1 fit" in text and "- 4 / 4: 2.50 (train)" in text
  assert "6 / 2" not in text


def test_plan_search_report_counts_distinct_rejected_plans():
  """The headline's rejected count is the search's distinct plans (rejected_plans), not the
  `rejected` dict's keys (one per inference plan's frozen weights a plan was tried beside); a
  result without it (from before) counts the keys."""
  code = _PLAN_REPORT.replace("print(", "res['rejected_plans'] = 1\nprint(")
  assert "(7 feasible stage plans, 1 rejected for memory or divisibility)" in "\n".join(
      _python(code))
  assert "(7 feasible stage plans, 2 rejected for memory or divisibility)" in "\n".join(
      _python(_PLAN_REPORT))


def test_plan_search_report_ends_with_the_constants_the_times_rest_on():
  """plan_search.md named only the hardware preset: not its figures, nor the assumed MFU and
  bandwidth efficiencies every predicted time scales with."""
  code = _PLAN_REPORT.replace(
      "print(json.dumps(ps.report(res, {}, setting)))",
      "import dataclasses\n"
      "from rlhfuse_jax.sim import cost_model, hardware\n"
      "hw = hardware.get_hardware('h100_sxm').to_dict()\n"
      "eff = dataclasses.asdict(cost_model.Efficiency(train_mfu=0.4))\n"
      "print(json.dumps(ps.report(res, {}, setting, (hw, eff))))")
  lines = _python(code)
  head = lines.index("## Inputs (every time above follows from these and the workload)")
  rows = [line for line in lines[head:] if line.startswith("| ")]
  assert "| peak_flops | 989.4 TFLOP/s |" in rows and "| hbm_bw | 3350 GB/s |" in rows
  assert any(r.startswith("| train_mfu | 0.4 | config | ") for r in rows)
  assert any(r.startswith("| decode_bw_eff | 0.7 | default | ") for r in rows)
  assert "## Inputs" not in "\n".join(_python(_PLAN_REPORT))  # without constants: none


# experiments/calibrate_sim.py ---------------------------------------------------------------------

_CALIBRATE = """
import json
import jax
from configs import calibrate_sim as config_file
from experiments import calibrate_sim as cs

def half_second(fn, repeats, setup=None):  # every timed op "takes" 0.5 s (run once: the code
  jax.block_until_ready(fn() if setup is None else fn(setup()))  # still runs)
  return 0.5

cs.median_s = half_second
c = config_file.get_config()
c.max_new_tokens, c.chunk_size, c.occupancies, c.repeats = 16, 32, "8,1,8", 1  # -> [1, 8]
print(json.dumps(cs.measure(c)))
"""


@functools.lru_cache(maxsize=None)
def _calibrated() -> dict:
  """calibrate_sim's measure (_CALIBRATE), run once for the tests below (not to be mutated)."""
  return _python(_CALIBRATE, timeout=240)


def test_calibrate_sim_rates_count_the_work_of_each_timed_op():
  """measure with every timed op taking 0.5 s (its timer faked), on the config's float32
  model: prefill is 8 slots x 16 prompt tokens, inference 8 samples x (16 + 16) tokens, a
  decode step the chunk's time over the 15 steps it runs, a migration 4 rows x 32 positions of
  K and V (2 layers x 2 KV heads x 16 dims; the K rows copied twice, not once) at the float32
  cache's 4 bytes, the weight_load the two models' float32 bytes: each rate the work over
  0.5 s, in the bytes copied (byte_unit "stored"). Occupancies given out of order and twice
  ("8,1,8") are measured in order, once each (the calibration was refused after the whole
  measurement)."""
  got = _calibrated()
  ops = got["ops"]
  assert got["byte_unit"] == "stored"
  assert ops["prefill"]["tokens_per_s"] == pytest.approx(8 * 16 / 0.5)
  assert ops["inference"]["tokens_per_s"] == pytest.approx(8 * 32 / 0.5)
  assert ops["decode_step"] == {"occupied_slots": [1, 8],
                                "seconds": [pytest.approx(0.5 / 15)] * 2}
  assert ops["migration"]["bytes_per_s"] == pytest.approx(4 * 32 * (2 * 2 * 2 * 16 * 4) / 0.5)
  assert got["devices_share_compute"] is True and got["instance_devices"] == 1
  # The reference (the actor's shape) and the reward model (the critic's) loaded from host:
  # without weight_load the file could not predict bench_generation.
  from configs import calibrate_sim as config_file
  from rlhfuse_jax.models import llama
  actor = llama.ModelConfig(**config_file.get_config().model.to_dict())
  critic = actor.replace(head="scalar")
  assert got["model_params"] == actor.num_params()
  assert ops["weight_load"]["bytes_per_s"] == pytest.approx(
      4 * (actor.num_params() + critic.num_params()) / 0.5)


def test_a_float32_reader_of_calibrate_sims_file_charges_the_measured_time():
  """plan_search:train sizes a float32 run's models at their own bytes (sim_plan.workload:
  from_model_config dtypes=True, 4 a parameter and KV element); simulated so, calibrate_sim's
  file (its float32 models) times each instance's load of the two models at the measured
  0.5 s, and a migration at 0.5 s per 4 x 32 KV positions. Its rates counted bf16's 2 bytes an
  element, so both were charged twice that. A file without byte_unit (every earlier one) still
  counts 2 bytes a parameter or KV element, whatever the reader's dtype."""
  from configs import calibrate_sim as config_file
  from rlhfuse_jax.models import llama
  from rlhfuse_jax.policy import calibration
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.generation_sim import GenSetup, simulate_generation
  from rlhfuse_jax.sim.hardware import get_hardware
  from rlhfuse_jax.sim.shapes import from_model_config
  got = _calibrated()
  actor = llama.ModelConfig(**config_file.get_config().model.to_dict())
  models = (actor, actor.replace(head="scalar"))
  old = {k: v for k, v in got.items() if k != "byte_unit"}  # as written until 2026-12-04
  old["ops"] = {**got["ops"],
                "weight_load": {"bytes_per_s": 2 * sum(m.num_params() for m in models) / 0.5},
                "migration": {"bytes_per_s": 4 * 32 * (2 * 2 * 2 * 16 * 2) / 0.5}}
  setup = GenSetup(num_instances=2, slots=2, chunk_steps=4, max_new_tokens=30, threshold=0.5,
                   stream_inference=True, offload_frozen=True)
  for cal, dtypes in ((got, (True,)), (old, (True, False))):
    cost = CostModel(get_hardware("h100_sxm"), calibration=calibration.from_dict(cal))
    for d in dtypes:
      shapes = [from_model_config(m, dtypes=d) for m in models]
      res = simulate_generation(cost, shapes[0], shapes, setup, np.array([8] * 4),
                                np.array([30, 30, 2, 2]))
      where = (cal.get("byte_unit"), d)
      loads = [e - s for _, s, e, kind in res.segments if kind == "load"]
      assert loads and loads == pytest.approx([0.5] * len(loads)), where
      c, = res.consolidations
      positions = c["moved_bytes"] / shapes[0].kv_bytes_per_token()
      assert c["migration_s"] == pytest.approx(0.5 * positions / (4 * 32)), where


# experiments/sweep.py -----------------------------------------------------------------------------

_CURVES = """
import json, os, sys
from experiments import sweep
from rlhfuse_jax import workdir as wdlib

work = sys.argv[1]
rows = [{"run": f"s{i}", "status": "ok", "lr": 1.0, "seed": i} for i in range(3)]
rows.append({"run": "other", "status": "ok", "lr": 2.0, "seed": 0})
with open(os.path.join(work, "summary.json"), "w") as f:
  json.dump(rows, f)
for i, factor in enumerate((1, 2, 6)):  # reward factor x step; seed 2 did not log step 40
  for step in range(1, 41 if i < 2 else 40):
    wdlib.append_jsonl(os.path.join(work, f"s{i}", "metrics.jsonl"),
                       {"step": step, "reward/mean": float(factor * step)})
for step in range(1, 41):
  wdlib.append_jsonl(os.path.join(work, "other", "metrics.jsonl"),
                     {"step": step, "reward/mean": 0.5})
lines, width = sweep.curve_lines(work, ["lr", "seed"])
print(json.dumps({"width": width, "lines": [[label, steps, list(mean), list(low), list(high)]
                                            for label, steps, mean, low, high in
                                            lines["reward/mean"]]}))
"""


def test_sweep_curves_are_the_seeds_mean_over_their_common_steps_smoothed_over_a_twentieth(
    tmp_path):
  """curve_lines: three seeds of one setting (reward 1, 2 and 6 x step) are one line, their mean
  at the steps all three logged (1..39: the third stopped early), low and high the extremes,
  each run smoothed by a trailing mean over a twentieth of the longest run (40 steps: 2); the
  other setting's single run is a line of its own."""
  got = _python(_CURVES, str(tmp_path))
  assert got["width"] == 2
  (label, steps, mean, low, high), (other, other_steps, flat, _, _) = got["lines"]
  assert label == "s0+s1+s2 (3 seeds)" and steps == list(range(1, 40))
  # trailing mean of 2 of c * step: c * (step - 0.5) (the first step alone: c)
  trail = np.array([1.0] + [s - 0.5 for s in range(2, 40)])
  np.testing.assert_allclose(mean, 3 * trail)  # the mean factor (the median's would be 2)
  np.testing.assert_allclose(low, trail)
  np.testing.assert_allclose(high, 6 * trail)
  assert other == "other" and other_steps == list(range(1, 41)) and flat == [0.5] * 40
