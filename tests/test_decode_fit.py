"""sim/decode_fit.py: the decode step's fixed costs and efficiencies, fitted to measured steps."""
import dataclasses
import json
import os

import pytest

from rlhfuse_jax.policy import calibration
from rlhfuse_jax.sim import decode_fit, validation
from rlhfuse_jax.sim.cost_model import CostModel, decode_step_work
from rlhfuse_jax.sim.hardware import HARDWARE
from rlhfuse_jax.sim.shapes import get_shape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100_BENCH = os.path.join(REPO, "experiments", "results", "h100_bench_decode_1b")
HW = HARDWARE["h100_sxm"]


def _points(truth, shapes_batches):
  """Exact steps of the fitted model with parameters `truth` (no noise)."""
  out = []
  for shape, batch, live in shapes_batches:
    p = decode_fit.DecodePoint("synthetic", shape, batch, batch * live, 1.0)
    out.append(dataclasses.replace(p, measured_s=decode_fit.predict(truth, HW, p)))
  return out


def test_fit_recovers_the_parameters_that_made_the_steps():
  truth = calibration.DecodeFit(step_s=2e-4, layer_s=6e-5, mfu=0.05, bw_eff=0.7)
  big, half = get_shape("llama-7b"), dataclasses.replace(get_shape("llama-7b"), num_layers=16)
  pts = _points(truth, [(big, 1, 500), (big, 16, 500), (big, 256, 500), (half, 1, 500),
                        (half, 16, 500), (half, 256, 500)])
  assert max(p.work[0] / (HW.peak_flops * truth.mfu) > p.work[1] / (HW.hbm_bw * truth.bw_eff)
             for p in pts)  # some steps are compute-bound, so mfu is determined
  got = decode_fit.fit(pts, HW)
  assert got.step_s == pytest.approx(truth.step_s, rel=1e-3)
  assert got.layer_s == pytest.approx(truth.layer_s, rel=1e-3)
  assert got.mfu == pytest.approx(truth.mfu, rel=1e-3) and got.bw_eff == 0.7
  # Every point is predicted by the others too: two compute-bound steps, two depths.
  for p, lo in zip(pts, decode_fit.leave_one_out(pts, HW)):
    assert lo == pytest.approx(p.measured_s, rel=1e-3)


def test_a_point_alone_deciding_mfu_falls_back_to_the_assumed_mfu_when_left_out():
  truth = calibration.DecodeFit(step_s=0.0, layer_s=6e-5, mfu=0.05, bw_eff=0.7)
  shape = get_shape("llama-7b")
  pts = _points(truth, [(shape, 1, 500), (shape, 4, 500), (shape, 512, 500),
                        (dataclasses.replace(shape, num_layers=16), 1, 500)])
  loo = decode_fit.leave_one_out(pts, HW)
  assert loo[2] < 0.5 * pts[2].measured_s  # mfu 0.45 assumed: far too fast
  with pytest.raises(ValueError, match="at least 3 measured steps"):
    decode_fit.fit(pts[:2], HW)
  # The 16-layer step is the only one of its depth: without it the rest cannot tell step_s
  # from layer_s, so it gets no leave-one-out prediction, and one depth alone is refused.
  assert loo[3] is None and all(lo is not None for lo in loo[:3])
  with pytest.raises(ValueError, match="two model depths.*got 32 layers only"):
    decode_fit.fit(pts[:3], HW)


def test_the_h100_bench_is_fitted_within_15_percent(tmp_path):
  """The measured H100 steps (1.1B model at 22 and 11 layers, batch 1/16/128) with 3
  parameters: every step within 15 % (the uncalibrated roofline is 53-80 % off). The fit is
  written as a calibration file that prices the same steps."""
  out = str(tmp_path / "fit.json")
  lines, rows, _ = validation.validate(None, "", "", H100_BENCH,
                                    decode_extra=("result_11_layers.json",), decode_fit_out=out)
  fitted = [r for r in rows if r["prediction"] == "fitted"]
  cal = calibration.load(out)
  assert cal.device == "NVIDIA H100 80GB HBM3" and 4e-5 < cal.decode_fit.layer_s < 8e-5
  for p in decode_fit.points_from_results(
      [(n, json.load(open(os.path.join(H100_BENCH, n))))
       for n in ("result.json", "result_11_layers.json")]):
    want = [r["predicted"] for r in fitted if r["quantity"] == p.label and r["source"] == p.source]
    assert want == [pytest.approx(decode_fit.predict(cal.decode_fit, HW, p), rel=1e-9)]
  assert len(fitted) == 5 and {r["source"] for r in fitted} == {"result.json",
                                                                 "result_11_layers.json"}
  for r in fitted:
    assert abs(r["error"]) <= 0.15, r
    assert r["error"] == pytest.approx(r["predicted"] / r["measured"] - 1)
    assert r["uncalibrated"] < 0.5 * r["measured"]
  unc = [r for r in rows if r["prediction"] == "uncalibrated" and "decode" in r["quantity"]]
  assert len(unc) == 3 and all(r["error"] < -0.5 for r in unc)
  text = "\n".join(lines)
  assert "fitted decode model" in text and "leave-one-out" in text


def test_the_cost_model_prices_any_shape_with_a_fitted_calibration():
  fit = calibration.DecodeFit(step_s=1e-4, layer_s=5e-5, mfu=0.04, bw_eff=0.7)
  cal = calibration.Calibration(device="test", decode_fit=fit)
  shape = get_shape("llama-13b")
  flops, nbytes = decode_step_work(shape, 64, 64 * 700)
  want = 1e-4 + shape.num_layers * 5e-5 + max(flops / (HW.peak_flops * 0.04),
                                              nbytes / (HW.hbm_bw * 0.7))
  fitted = CostModel(HW, calibration=cal)
  assert float(fitted.decode_step_s(shape, 1, 64, 64 * 700)) == pytest.approx(want, rel=1e-12)
  # The engine's other forward passes pay the same fixed costs once per pass; their compute
  # stays at prefill_mfu.
  fixed = 1e-4 + shape.num_layers * 5e-5
  plain = CostModel(HW)
  assert fitted.prefill_s(shape, 2, [300, 500]) == pytest.approx(
      plain.prefill_s(shape, 2, [300, 500]) + fixed, rel=1e-12)
  assert fitted.inference_s([shape, shape], 2, [800]) == pytest.approx(
      plain.inference_s([shape, shape], 2, [800]) + 2 * fixed, rel=1e-12)


def test_calibration_files_carry_the_fit_and_reject_bad_values(tmp_path):
  fit = calibration.DecodeFit(step_s=0.0, layer_s=5e-5, mfu=0.04, bw_eff=0.7)
  cal = calibration.Calibration(device="test", decode_fit=fit)
  back = calibration.from_dict(json.loads(json.dumps(calibration.to_dict(cal))))
  assert back.decode_fit == fit
  bad = calibration.to_dict(cal)
  bad["ops"]["decode_fit"]["mfu"] = 1.5
  with pytest.raises(ValueError, match=r"ops.decode_fit: mfu=1.5 must be a fraction"):
    calibration.from_dict(bad, "x.json")
  del bad["ops"]["decode_fit"]["mfu"]
  with pytest.raises(ValueError, match=r"missing keys \['mfu'\]"):
    calibration.from_dict(bad, "x.json")


def test_one_depth_gets_no_fit_but_its_uncalibrated_rows(tmp_path):
  """One result file of 3 batches (bench_decode's default), one model depth: the per-step and
  per-layer costs cannot be told apart, so no model is fitted (until 2026-12-05 an arbitrary
  split of them was, pricing other depths 14-21 % off); the uncalibrated comparison stays."""
  import shutil
  shutil.copy(os.path.join(H100_BENCH, "result.json"), tmp_path / "result.json")
  lines, rows, _ = validation.validate(None, "", "", str(tmp_path))
  assert not [r for r in rows if r["prediction"] == "fitted"]
  assert len([r for r in rows if r["bench"] == "bench_decode"]) >= 3
  text = "\n".join(lines)
  assert "No fitted decode model" in text and "two model depths" in text
