"""Validation path: predictions of the benches from a calibration (the lockstep tick model for
bench_pipeline), calibration files, and the report lines."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rlhfuse_jax.pipeline import program as prog
from rlhfuse_jax.pipeline import schedules
from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF, PipelineProblem
from rlhfuse_jax.policy import calibration
from rlhfuse_jax.sim import lockstep, validation

CAL = {"format": calibration.FORMAT, "device": "2-core CPU, 8 fake devices",
       "devices_share_compute": True,
       "ops": {"decode_step": {"occupied_slots": [1, 8], "seconds": [0.002, 0.002]},
               "prefill": {"tokens_per_s": 20000.0},
               "inference": {"tokens_per_s": 10000.0},
               "migration": {"bytes_per_s": 1e9},
               "weight_load": {"bytes_per_s": 1e9},
               "train_stage": {"actor_fwd_s": 0.004, "critic_fwd_s": 0.002}}}
MODEL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
         "num_heads": 4, "num_kv_heads": 2}


def write_gen_bench(path, measured=(1.0, 0.8), drop=()):
  cfg = {"model": MODEL, "fusion": {"num_instances": 4, "slots": 4, "chunk_size": 4,
                                    "migration_threshold": 0.25},
         "rollout": {"max_new_tokens": 40}}
  res = {"prompt_lens": [8] * 16, "response_lens": [3, 5, 40, 7, 2, 9, 30, 4] * 2,
         "baseline": {"gen_plus_inf_s": measured[0]}, "fused": {"gen_plus_inf_s": measured[1]}}
  for k in drop:
    res.pop(k, None)
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(cfg))
  (path / "result.json").write_text(json.dumps(res))


def test_predicts_generation_bench_and_reports_error(tmp_path):
  write_gen_bench(tmp_path / "gen")
  cal = calibration.from_dict(CAL, "cal.json")
  spec, meas = validation.gen_bench_from_workdir(str(tmp_path / "gen"))
  assert spec.num_instances == 4 and spec.threshold == 0.25 and len(spec.response_lens) == 16
  pred = validation.predict_bench_generation(cal, spec)
  assert pred["fused"]["gen_plus_inf_s"] > 0 and pred["baseline"]["gen_plus_inf_s"] > 0
  assert pred["ratio_fused_over_baseline"] == pytest.approx(
      pred["fused"]["gen_plus_inf_s"] / pred["baseline"]["gen_plus_inf_s"])
  lines = validation.validation_lines(cal, str(tmp_path / "gen"), "")
  text = "\n".join(lines)
  assert "| ratio fused / baseline |" in text and "%" in text
  assert "bench_pipeline**: no workdir given" in text


def test_generation_prediction_loads_the_bench_s_frozen_models(tmp_path):
  """The bench loads its inference models' weights from host memory onto each instance freed
  for inference, inside its measured time: the prediction charges them at the calibration's
  measured weight_load rate, for the models config.json says the bench ran."""
  write_gen_bench(tmp_path / "gen")
  spec, _ = validation.gen_bench_from_workdir(str(tmp_path / "gen"))
  assert len(spec.frozen) == 3 and spec.offload_frozen  # no flags: reference, critic, reward
  cfg = json.loads((tmp_path / "gen" / "config.json").read_text())
  (tmp_path / "gen" / "config.json").write_text(json.dumps({**cfg, "critic": False}))
  spec, _ = validation.gen_bench_from_workdir(str(tmp_path / "gen"))
  assert [f.head for f in spec.frozen] == ["lm", "scalar"]
  slow = {**CAL, "ops": {**CAL["ops"], "weight_load": {"bytes_per_s": 1e5}}}
  fast, slow = (validation.predict_bench_generation(calibration.from_dict(c, "c.json"), spec)
                for c in (CAL, slow))
  # in CAL's unit (no byte_unit: bf16, 2 bytes a parameter), one device per instance
  weights = sum(2 * f.num_params() for f in spec.frozen)
  assert (slow["baseline"]["gen_plus_inf_s"] - fast["baseline"]["gen_plus_inf_s"]
          >= weights / 1e5 - weights / 1e9 - 1e-9)
  lacking = {**CAL, "ops": {k: v for k, v in CAL["ops"].items() if k != "weight_load"}}
  with pytest.raises(ValueError, match=r"lacks measured ops \['weight_load'\]"):
    validation.predict_bench_generation(calibration.from_dict(lacking, "c.json"), spec)


def test_generation_prediction_reads_a_calibration_in_either_byte_unit(tmp_path):
  """A bench of float32 models (config.json's model dtypes; ModelConfig's default where absent)
  is predicted alike from a calibration counting the bytes its copies moved (byte_unit
  "stored": 4 a parameter and KV element, what measure_costs and calibrate_sim write) and from
  the same measurement counted at bf16's 2 (a file without byte_unit, every earlier one): the
  bench's shapes are sized at the dtypes it ran, the bf16 file's sizes converted."""
  for model, item in ((MODEL, 4), ({**MODEL, "dtype": "bfloat16", "param_dtype": "bfloat16"},
                                   2)):
    write_gen_bench(tmp_path / "gen")
    cfg = json.loads((tmp_path / "gen" / "config.json").read_text())
    (tmp_path / "gen" / "config.json").write_text(json.dumps({**cfg, "model": model}))
    spec, _ = validation.gen_bench_from_workdir(str(tmp_path / "gen"))
    assert (spec.shape.weight_itemsize, spec.shape.kv_itemsize) == (item, item)
    bf16 = {**CAL, "ops": {**CAL["ops"], "weight_load": {"bytes_per_s": 2e5},
                           "migration": {"bytes_per_s": 2e4}}}
    stored = {**CAL, "byte_unit": "stored",
              "ops": {**CAL["ops"], "weight_load": {"bytes_per_s": item / 2 * 2e5},
                      "migration": {"bytes_per_s": item / 2 * 2e4}}}
    a, b = (validation.predict_bench_generation(calibration.from_dict(c, "c.json"), spec)
            for c in (bf16, stored))
    for mode in ("baseline", "fused"):
      assert a[mode]["gen_plus_inf_s"] == pytest.approx(b[mode]["gen_plus_inf_s"]), model
    assert b["fused"]["gen_plus_inf_s"] > validation.predict_bench_generation(
        calibration.from_dict(CAL, "c.json"), spec)["fused"]["gen_plus_inf_s"]  # charged


def test_a_bench_run_without_consolidation_is_predicted_without_one(tmp_path, monkeypatch):
  """fusion.max_consolidations = 0 (the tail decodes where it is) is a setting, not a missing
  key: it was read, and simulated, as the default 1."""
  write_gen_bench(tmp_path / "gen")
  cal = calibration.from_dict(CAL, "cal.json")
  one, _ = validation.gen_bench_from_workdir(str(tmp_path / "gen"))
  cfg = json.loads((tmp_path / "gen" / "config.json").read_text())
  cfg["fusion"]["max_consolidations"] = 0
  (tmp_path / "gen" / "config.json").write_text(json.dumps(cfg))
  zero, _ = validation.gen_bench_from_workdir(str(tmp_path / "gen"))
  assert (one.max_consolidations, zero.max_consolidations) == (1, 0)
  simulated = []
  real = validation.gen_lib.simulate_generation
  monkeypatch.setattr(validation.gen_lib, "simulate_generation",
                      lambda cost, shape, frozen, setup, *a: simulated.append(setup) or real(
                          cost, shape, frozen, setup, *a))
  validation.predict_bench_generation(cal, zero)
  assert [s.max_consolidations for s in simulated] == [0, 0]
  with pytest.raises(ValueError, match=r"generation.max_consolidations=-1 must be >= 0"):
    validation.gen_lib.GenSetup(num_instances=1, slots=1, max_consolidations=-1)


def test_a_bench_scoring_on_pipelines_of_instances_is_predicted_with_them(tmp_path,
                                                                          monkeypatch):
  """bench_generation's generation.inference_pp reaches the simulation (GenSetup.inference_pp):
  a bench that scored on pipelines of 2 instances was predicted as if each freed instance
  loaded and ran the whole models."""
  write_gen_bench(tmp_path / "gen")
  cfg = json.loads((tmp_path / "gen" / "config.json").read_text())
  cfg["fusion"]["inference_pp"] = 2
  (tmp_path / "gen" / "config.json").write_text(json.dumps(cfg))
  spec, _ = validation.gen_bench_from_workdir(str(tmp_path / "gen"))
  assert spec.inference_pp == 2
  simulated = []
  real = validation.gen_lib.simulate_generation
  monkeypatch.setattr(validation.gen_lib, "simulate_generation",
                      lambda cost, shape, frozen, setup, *a: simulated.append(setup) or real(
                          cost, shape, frozen, setup, *a))
  validation.predict_bench_generation(calibration.from_dict(CAL, "cal.json"), spec)
  assert [s.inference_pp for s in simulated] == [2, 2]


def test_missing_inputs_are_said_plainly(tmp_path):
  cal = calibration.from_dict(CAL, "cal.json")
  lines, rows, skipped = validation.validate(cal, str(tmp_path / "nope"), "")
  assert "does not exist; nothing compared" in "\n".join(lines) and rows == []
  # Only the bench given a workdir is reported as not compared (reproduce_ablations warns).
  assert skipped == [("bench_generation", f"{tmp_path}/nope/result.json does not exist; "
                      "nothing compared.")]
  write_gen_bench(tmp_path / "gen", drop=("response_lens",))
  text = "\n".join(validation.validation_lines(cal, str(tmp_path / "gen"), ""))
  assert "could not compare" in text and "response_lens" in text
  text = "\n".join(validation.validation_lines(None, str(tmp_path / "gen"), ""))
  assert "no calibration" in text
  partial = calibration.from_dict({**CAL, "ops": {"prefill": {"tokens_per_s": 1.0}}}, "p.json")
  write_gen_bench(tmp_path / "gen2")
  text = "\n".join(validation.validation_lines(partial, str(tmp_path / "gen2"), ""))
  assert "lacks measured ops" in text


# Two devices, Ma = Mc = 1. Actor stage d on device d; critic reversed (stage 0 on device 1).
# This fused order runs two tasks at every tick: ticks (AF0, CF0), (CF1, AF1), (CB1, AB1),
# (AB0, CB0) with program.py's leveling. The serial order with its barrier runs one per tick.
TWO = PipelineProblem(actor_pp=2, critic_pp=2, actor_microbatches=1, critic_microbatches=1,
                      actor_fwd=1.0, critic_fwd=1.0)
FUSED = np.array([[AF, CF, CB, AB], [CF, AF, AB, CB]], np.int8)


def test_tick_model_one_device():
  p = PipelineProblem(actor_pp=1, critic_pp=1, actor_microbatches=1, critic_microbatches=1,
                      actor_fwd=1.0, critic_fwd=3.0, actor_bwd=2.0, critic_bwd=4.0)
  order = np.array([[AF, AB, CF, CB]], np.int8)
  times = lockstep.StageTimes.uniform(p)
  np.testing.assert_allclose(lockstep.tick_tasks(p, order, times), [[1], [2], [3], [4]])
  # One task per tick: its own length (+ 0.5 per tick, + 0.25 per step) whatever the cores.
  for cores in (None, 1, 2):
    got = lockstep.step_seconds(p, order, times, tick_overhead_s=0.5, step_overhead_s=0.25,
                                parallel_tasks=cores)
    assert got["step_s"] == pytest.approx(10 + 4 * 0.5 + 0.25) and got["ticks"] == 4
  # Two data copies of that device on one core: every tick runs its task twice.
  got = lockstep.step_seconds(p, order, times, parallel_tasks=1, data_replicas=2)
  assert got["step_s"] == pytest.approx(20.0)


def test_tick_model_two_devices_shared_vs_dedicated():
  times = lockstep.StageTimes.uniform(TWO)  # F = 1, B = 2 on every stage
  np.testing.assert_allclose(lockstep.tick_tasks(TWO, FUSED, times),
                             [[1, 1], [1, 1], [2, 2], [2, 2]])
  serial = schedules.serial_order(TWO)
  ser = lockstep.tick_tasks(TWO, serial, times, barrier=True)
  assert ser.shape == (8, 2) and np.all((ser > 0).sum(axis=1) == 1)  # one task per tick

  def step(order, barrier, cores, reps=1):
    return lockstep.step_seconds(TWO, order, times, barrier=barrier, tick_overhead_s=0.1,
                                 parallel_tasks=cores, data_replicas=reps)["step_s"]
  # Dedicated devices: each fused tick lasts its longest task: 1 + 1 + 2 + 2.
  assert step(FUSED, False, None) == pytest.approx(6 + 0.4)
  # One core: a tick's two tasks run one after the other, so fusion saves only overhead.
  assert step(FUSED, False, 1) == pytest.approx(12 + 0.4)
  # Two cores: the two tasks of a tick run at once, as on dedicated devices.
  assert step(FUSED, False, 2) == pytest.approx(6 + 0.4)
  # Two cores but two data copies: four tasks per tick on two cores.
  assert step(FUSED, False, 2, reps=2) == pytest.approx(12 + 0.4)
  for cores in (None, 1, 2):
    assert step(serial, True, cores) == pytest.approx(12 + 0.8)
  with pytest.raises(ValueError, match="parallel_tasks=0"):
    step(FUSED, False, 0)
  # Per-stage times: the longest task of a tick is the slower stage's.
  slow = lockstep.StageTimes(actor_fwd=(1, 3), actor_bwd=(2, 2), critic_fwd=(1, 1),
                             critic_bwd=(2, 2))
  assert lockstep.step_seconds(TWO, FUSED, slow)["step_s"] == pytest.approx(1 + 3 + 2 + 2)
  with pytest.raises(ValueError, match="actor_pp=2"):
    lockstep.step_seconds(TWO, FUSED, lockstep.StageTimes((1,), (2,), (1,), (2,)))


PIPE_CAL = {"format": calibration.FORMAT, "device": "fabricated", "devices_share_compute": True,
            "parallel_tasks": 2,
            "ops": {"train_stage": {"actor_fwd_s": 0.001, "critic_fwd_s": 0.001,
                                    "actor_bwd_s": 0.002, "critic_bwd_s": 0.002,
                                    "bwd_over_fwd": 2.0,
                                    "actor_fwd_per_stage_s": [0.001, 0.001],
                                    "actor_bwd_per_stage_s": [0.002, 0.002],
                                    "critic_fwd_per_stage_s": [0.001, 0.001],
                                    "critic_bwd_per_stage_s": [0.002, 0.002]},
                    "pipeline_executor": {"tick_overhead_s": 0.0005, "step_overhead_s": 0.01}}}


def test_calibration_new_keys_round_trip_old_files_load_unknown_rejected(tmp_path):
  path = tmp_path / "cal.json"
  path.write_text(json.dumps(PIPE_CAL))
  cal = calibration.load(str(path))
  assert cal.parallel_tasks == 2 and cal.pipeline_executor.step_overhead_s == 0.01
  assert calibration.from_dict(calibration.to_dict(cal), str(path)) == cal
  fwd, bwd = cal.train_stage.stage_times("critic", 2)
  np.testing.assert_allclose(bwd, [0.002, 0.002])
  with pytest.raises(ValueError, match="critic_fwd_per_stage_s has 2 stages.*4 critic"):
    cal.train_stage.stage_times("critic", 4)
  # A file from before these keys: backward = bwd_over_fwd x forward, one task at a time.
  old = calibration.from_dict(CAL, "old.json")
  assert old.parallel_tasks is None and old.pipeline_executor is None
  fwd, bwd = old.train_stage.stage_times("actor", 3)
  np.testing.assert_allclose(fwd, [0.004] * 3)
  np.testing.assert_allclose(bwd, [0.008] * 3)
  assert calibration.from_dict(calibration.to_dict(old), "old.json") == old
  bad = json.loads(json.dumps(PIPE_CAL))
  bad["ops"]["train_stage"]["actor_bwd"] = 0.002
  with pytest.raises(ValueError, match="unknown keys \\['actor_bwd'\\]"):
    calibration.from_dict(bad, "bad.json")
  bad = {**PIPE_CAL, "ops": {"pipeline_executor": {"tick_s": 0.1}}}
  with pytest.raises(ValueError, match="unknown keys"):
    calibration.from_dict(bad, "bad.json")
  with pytest.raises(ValueError, match="parallel_tasks=0"):
    calibration.from_dict({**PIPE_CAL, "parallel_tasks": 0}, "bad.json")
  bad = json.loads(json.dumps(PIPE_CAL))
  bad["ops"]["train_stage"]["actor_fwd_per_stage_s"] = []
  with pytest.raises(ValueError, match="non-empty list"):
    calibration.from_dict(bad, "bad.json")


def write_pipe_bench(path, measured=(0.05, 0.04), with_schedules=True, with_cal=True):
  """A bench_pipeline workdir as the bench writes it, for the two-device problem above."""
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps({"actor_pp": 2, "critic_pp": 2}))
  res = {"schedules": {"serial_1f1b": {"step_s": measured[0]},
                       "searched": {"step_s": measured[1]}},
         "serial_step_s": measured[0], "fused_step_s": measured[1]}
  (path / "result.json").write_text(json.dumps(res))
  if with_schedules:
    (path / "schedules.json").write_text(json.dumps({
        "problem": TWO.to_dict(), "data_replicas": 1, "serial": "serial_1f1b",
        "fused": "searched",
        "schedules": {"serial_1f1b": {"order": schedules.serial_order(TWO).tolist(),
                                      "barrier": True},
                      "searched": {"order": FUSED.tolist(), "barrier": False}}}))
  if with_cal:
    (path / "calibration.json").write_text(json.dumps(PIPE_CAL))


def test_parallel_tasks_without_a_shared_processor_is_refused():
  """parallel_tasks (the cores of one shared processor) is read only with
  devices_share_compute: without it the simulators took the devices as dedicated and the cores
  given were dropped, silently."""
  with pytest.raises(ValueError, match="parallel_tasks=2 is read only with "
                                       "devices_share_compute: true"):
    calibration.from_dict({**PIPE_CAL, "devices_share_compute": False}, "bad.json")
  no_share = {k: v for k, v in PIPE_CAL.items() if k != "devices_share_compute"}
  with pytest.raises(ValueError, match="parallel_tasks=2 is read only"):
    calibration.from_dict(no_share, "bad.json")
  assert calibration.from_dict(PIPE_CAL, "ok.json").parallel_tasks == 2


def test_bench_pipeline_writes_what_the_validator_reads(tmp_path):
  """The real writer against the reader (the test above uses a hand-written workdir, so the two
  could drift): a tiny bench_pipeline run (2 stages, 2 + 2 micro-batches, ~20 s) is read back by
  the validator, which rebuilds every schedule the bench ran with the bench's own tick counts
  and step times, and predicts them."""
  from tests.test_pipeline_experiments import _run
  wd = tmp_path / "bp"
  out = _run(["experiments.bench_pipeline", "--config=configs/bench_pipeline.py",
              f"--workdir={wd}", "--config.actor_pp=2", "--config.critic_pp=2", "--config.data=1",
              "--config.actor_microbatches=2", "--config.critic_microbatches=2",
              "--config.minibatch_size=4", "--config.actor.num_layers=2",
              "--config.critic.num_layers=2", "--config.search_time_s=0.5", "--config.warmup=0",
              "--config.repeats=1", "--config.calib_ticks=8"])
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads((wd / "result.json").read_text())
  bench = validation.pipeline_bench_from_workdir(str(wd))
  assert bench.problem == PipelineProblem(**res["problem"])
  assert (bench.problem.actor_pp, bench.problem.critic_pp, bench.data_replicas) == (2, 2, 1)
  assert set(bench.orders) == set(res["schedules"]) >= {bench.serial, bench.fused}
  for name, (order, barrier) in bench.orders.items():
    assert barrier == res["schedules"][name]["barrier"]
    ticks = prog.build_program(bench.problem, order, barrier=barrier).ticks
    assert ticks == res["schedules"][name]["ticks"], name
  assert bench.measured[bench.serial] == res["serial_step_s"] > 0
  assert bench.measured[bench.fused] == res["fused_step_s"] > 0
  # One repeat: the paired ratio is that round's fused over serial step; a schedule's bubble is
  # the idle share of a device's ticks.
  assert res["paired_ratio_fused_over_serial"] == pytest.approx(
      res["fused_step_s"] / res["serial_step_s"])
  for name, r in res["schedules"].items():
    assert r["bubble_ticks"] == pytest.approx(1 - bench.problem.tasks_per_device / r["ticks"])
  text = "\n".join(validation.validation_lines(None, "", str(wd)))
  assert f"calibration `{wd / 'calibration.json'}`" in text  # the bench's own calibration
  for name in (bench.serial, bench.fused):
    kind = "serial" if name == bench.serial else "fused"
    assert f"| {kind} step s ({name}, {res['schedules'][name]['ticks']} ticks) |" in text


def test_validator_reads_pipeline_workdir_with_its_own_calibration(tmp_path):
  write_pipe_bench(tmp_path / "bp")
  bench = validation.pipeline_bench_from_workdir(str(tmp_path / "bp"))
  assert bench.fused == "searched" and bench.measured == {"serial_1f1b": 0.05, "searched": 0.04}
  cal = calibration.load(str(tmp_path / "bp" / "calibration.json"))
  pred = validation.predict_bench_pipeline(cal, bench.problem, bench.orders["searched"][0],
                                           bench.orders["serial_1f1b"][0])
  # Hand-computed (ms): serial 8 ticks of one task (1+1+2+2 per model) + 8 x 0.5 + 10;
  # fused 4 ticks of two tasks on 2 cores: 1+1+2+2 + 4 x 0.5 + 10.
  assert pred["serial_s"] == pytest.approx(0.012 + 0.004 + 0.01)
  assert pred["fused_s"] == pytest.approx(0.006 + 0.002 + 0.01)
  assert pred["dedicated"]["fused_s"] == pytest.approx(pred["fused_s"])
  # No calibration given: the bench's own calibration.json is used.
  text = "\n".join(validation.validation_lines(None, "", str(tmp_path / "bp")))
  assert f"calibration `{tmp_path / 'bp' / 'calibration.json'}`" in text
  assert "| serial step s (serial_1f1b, 8 ticks) | 0.026 | 0.05 | -48.0% |" in text
  assert "| fused step s (searched, 4 ticks) | 0.018 | 0.04 | -55.0% |" in text
  ratio = f"| ratio fused / serial | {0.018 / 0.026:.4g} | 0.8 | {_pct(0.018 / 0.026, 0.8)} |"
  assert ratio in text
  assert "on dedicated devices (prediction only, no measurement)" in text
  # One core: the fused ticks' two tasks run one after the other.
  one_core = calibration.from_dict({**PIPE_CAL, "parallel_tasks": 1}, "one.json")
  pred1 = validation.predict_bench_pipeline(one_core, bench.problem,
                                            bench.orders["searched"][0])
  assert pred1["fused_s"] == pytest.approx(0.012 + 0.002 + 0.01)
  assert pred1["dedicated"]["fused_s"] == pytest.approx(pred["fused_s"])
  # A bench that timed the schedules in rounds reports the median paired ratio: that is measured.
  res = json.loads((tmp_path / "bp" / "result.json").read_text())
  res["paired_ratio_fused_over_serial"] = 0.75
  res["tick_model_check"] = {"added_per_tick_s": 0.004, "predicted_added_per_tick_s": 0.002,
                             "effective_parallel_tasks": 1.0, "host_cores": 2}
  (tmp_path / "bp" / "result.json").write_text(json.dumps(res))
  text = "\n".join(validation.validation_lines(None, "", str(tmp_path / "bp")))
  assert (f"| ratio fused / serial (measured: median of paired rounds) | {0.018 / 0.026:.4g} | "
          f"0.75 | {_pct(0.018 / 0.026, 0.75)} |") in text
  assert "1.00 tasks effectively ran at once where the model assumes 2" in text


def _pct(p, m):
  return f"{(p - m) / m * 100:+.1f}%"


def test_validator_pipeline_missing_inputs(tmp_path):
  write_pipe_bench(tmp_path / "old", with_schedules=False)
  text = "\n".join(validation.validation_lines(None, "", str(tmp_path / "old")))
  assert "could not compare" in text and "schedules.json does not exist" in text
  write_pipe_bench(tmp_path / "nocal", with_cal=False)
  text = "\n".join(validation.validation_lines(None, "", str(tmp_path / "nocal")))
  assert "no calibration" in text and "nocal/calibration.json" in text
  # An explicit calibration wins over the workdir's; one without the executor op says so.
  text = "\n".join(validation.validation_lines(calibration.from_dict(CAL, "gen.json"), "",
                                               str(tmp_path / "nocal")))
  assert "lacks the measured op 'pipeline_executor'" in text


def test_generation_bench_uses_its_own_calibration_by_default(tmp_path):
  write_gen_bench(tmp_path / "gen")
  (tmp_path / "gen" / "calibration.json").write_text(json.dumps(CAL))
  text = "\n".join(validation.validation_lines(None, str(tmp_path / "gen"), ""))
  assert "| ratio fused / baseline |" in text and "gen/calibration.json" in text


def test_sim_validation_imports_no_jax():
  code = ("import sys; import rlhfuse_jax.sim.validation, rlhfuse_jax.sim.lockstep; "
          "print(any(m == 'jax' or m.startswith('jax.') for m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       check=True)
  assert out.stdout.strip() == "False"


def write_decode_bench(path, preset="h100_sxm"):
  # A bench_decode result.json as an H100 run writes it (values invented; the shape is 1 layer).
  os.makedirs(path, exist_ok=True)
  result = {
      "device": {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3",
                 "hardware_preset": preset},
      "model": {"vocab_size": 1000, "hidden_size": 512, "intermediate_size": 1024,
                "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 0,
                "tie_embeddings": False, "qkv_bias": False, "max_seq_len": 128},
      "decode": {"cache_len": 2, "per_batch": [
          {"batch": 1, "step_s": 2e-6, "bw_fraction": 0.3},
          {"batch": 1000, "step_s": 1e-3, "bw_fraction": 0.1}]},
      "train": {"batch": 2, "prompt_len": 4, "response_len": 4, "step_s": 1e-4,
                "actor_fwd_s": 1e-5, "critic_fwd_s": 1e-5, "mfu": 0.2},
  }
  with open(os.path.join(path, "result.json"), "w") as f:
    json.dump(result, f)


def test_decode_bench_predicted_from_the_datasheet_by_hand(tmp_path):
  write_decode_bench(str(tmp_path))
  with open(tmp_path / "result.json") as f:
    pred = validation.predict_bench_decode(json.load(f))
  # Hand count: layer matmul params 512*128*(4+2*2) + 4*128*512 + 3*512*1024 = 2,359,296;
  # params = layer + 2*512 (norms) + embed 512,000 + lm head 512,000 + final norm 512.
  params = 2_359_296 + 1024 + 512_000 + 512_000 + 512
  matmul = 2_359_296 + 512_000
  kv_per_token = 2 * 1 * 2 * 128 * 2
  peak, bw = 989.4e12, 3.35e12  # h100_sxm; efficiencies: decode 0.45 MFU, 0.7 of bandwidth
  for b in (1, 1000):
    nbytes = 2 * params + b * 2 * kv_per_token
    flops = 2 * matmul * b + 4 * 1 * 4 * 128 * (b * 2)
    want = max(flops / (peak * 0.45), nbytes / (bw * 0.7))
    assert pred["decode_step_s"][b] == pytest.approx(want, rel=1e-12)
  # batch 1 is bandwidth bound, batch 1000 compute bound (so both branches are checked)
  assert 2 * params / (bw * 0.7) > 2 * matmul / (peak * 0.45)
  assert pred["decode_step_s"][1000] == pytest.approx(
      (2 * matmul * 1000 + 4 * 4 * 128 * 2000) / (peak * 0.45), rel=1e-12)
  # update: 3 forwards per model (bwd_over_fwd 2) + AdamW (28 bytes per param at 0.7 of bw)
  critic_params = params - 512_000 + 513
  opt = 28 * (params + critic_params) / (bw * 0.7)
  assert pred["update_s"] == pytest.approx(3 * (pred["actor_fwd_s"] + pred["critic_fwd_s"]) + opt,
                                           rel=1e-12)
  lines = "\n".join(validation.validation_lines(None, "", "", str(tmp_path)))
  assert "| decode step, batch 1 (s) |" in lines and "h100_sxm" in lines


def test_decode_bench_without_a_preset_is_said_plainly(tmp_path):
  write_decode_bench(str(tmp_path), preset=None)
  lines = "\n".join(validation.validation_lines(None, "", "", str(tmp_path)))
  assert "bench_decode**: could not compare" in lines and "matched no hardware preset" in lines


def test_a_calibration_path_that_is_a_directory_names_its_field_and_the_file_inside(tmp_path):
  """calibrate_sim's workdir given for its calibration.json: an IsADirectoryError naming
  neither the field nor the file meant."""
  (tmp_path / "calibration.json").write_text("{}")
  with pytest.raises(ValueError, match=(
      r"^config\.calibration='.*': calibration file '.*' is a directory; expected a JSON file "
      r"\(calibrate_sim writes WORKDIR/calibration\.json: .*calibration\.json\)$")):
    calibration.load(str(tmp_path), "config.calibration")
  with pytest.raises(FileNotFoundError, match=r"^config\.calibration='nowhere\.json': "):
    calibration.load("nowhere.json", "config.calibration")
