"""Validation path: predictions of the benches from a calibration, and the report lines."""
import json

import pytest

from rlhfuse_jax.pipeline.graph import PipelineProblem
from rlhfuse_jax.sim import calibration, validation

CAL = {"format": calibration.FORMAT, "device": "2-core CPU, 8 fake devices",
       "devices_share_compute": True,
       "ops": {"decode_step": {"occupied_slots": [1, 8], "seconds": [0.002, 0.002]},
               "prefill": {"tokens_per_s": 20000.0},
               "inference": {"tokens_per_s": 10000.0},
               "migration": {"bytes_per_s": 1e9},
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


def test_missing_inputs_are_said_plainly(tmp_path):
  cal = calibration.from_dict(CAL, "cal.json")
  text = "\n".join(validation.validation_lines(cal, str(tmp_path / "nope"), ""))
  assert "does not exist; nothing compared" in text
  write_gen_bench(tmp_path / "gen", drop=("response_lens",))
  text = "\n".join(validation.validation_lines(cal, str(tmp_path / "gen"), ""))
  assert "could not compare" in text and "response_lens" in text
  text = "\n".join(validation.validation_lines(None, str(tmp_path / "gen"), ""))
  assert "no calibration" in text
  partial = calibration.from_dict({**CAL, "ops": {"prefill": {"tokens_per_s": 1.0}}}, "p.json")
  write_gen_bench(tmp_path / "gen2")
  text = "\n".join(validation.validation_lines(partial, str(tmp_path / "gen2"), ""))
  assert "lacks measured ops" in text


def test_pipeline_prediction():
  problem = PipelineProblem(actor_pp=4, critic_pp=2, actor_microbatches=4, critic_microbatches=2,
                            actor_fwd=1.0, critic_fwd=1.0)
  shared = calibration.from_dict(CAL, "cal.json")
  pred = validation.predict_bench_pipeline(shared, problem)
  # One processor: both schedules cost the total work of all devices.
  total = 4 * (4 * 3 * 0.004 + 2 * 3 * 0.002)
  assert pred["serial_s"] == pytest.approx(total) and pred["ratio_fused_over_serial"] == 1.0
  parallel = calibration.from_dict({**CAL, "devices_share_compute": False}, "cal.json")
  pred = validation.predict_bench_pipeline(parallel, problem)
  assert pred["fused_s"] < pred["serial_s"]
