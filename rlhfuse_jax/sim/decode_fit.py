"""The decode step's fixed costs and efficiencies, fitted to measured steps (docs/simulator.md).

The uncalibrated cost model prices a decode step by the roofline alone (bytes at 70 % of the HBM
bandwidth). Measured on one H100 (experiments/results/h100_bench_decode_1b) our step is flat
from batch 1 to 16 and halves with half the layers: a fixed cost per layer dominates small
batches. The model fitted here:

  t = step_s + L x layer_s + max(FLOPs / (peak x mfu), bytes / (hbm_bw x bw_eff))

with FLOPs and bytes of the step from cost_model.decode_step_work. Three parameters are fitted
(least squares on the relative error): step_s (per-step host cost), layer_s (per-layer fixed
cost) and mfu (where the step is compute-bound); bw_eff stays the cost model's cited
decode_bw_eff, because at small batches the bytes term and L x layer_s are nearly collinear
(both scale with the layers) and the points cannot tell them apart. Two depths (bench_decode run
again with half the layers) separate step_s from layer_s.

Leave-one-out: each point predicted by a fit to the others, by the same procedure (the same
starts: the cost model's assumed efficiencies and no fixed costs first), so a point that alone
decides a parameter (the only compute-bound one decides mfu) shows what the rest cannot say
about it: there mfu stays the cost model's assumption.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from scipy import optimize

from rlhfuse_jax.policy.calibration import DecodeFit
from rlhfuse_jax.sim.cost_model import Efficiency, decode_step_work
from rlhfuse_jax.sim.hardware import Hardware
from rlhfuse_jax.sim.shapes import ModelShape

# What a bench_decode result's model (its ModelConfig's fields) gives the simulator's shape:
# every ModelShape field but the two this module sets (a new one is read without a list to keep).
_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelShape)
                      if f.name not in ("name", "head"))
_BOUNDS = ([0.0, 0.0, 1e-4], [1e-2, 1e-3, 1.0])  # step_s, layer_s (s), mfu
_MFU_STARTS = (0.2, 0.1, 0.05, 0.02, 0.01, 0.005)


@dataclasses.dataclass(frozen=True)
class DecodePoint:
  """One measured decode step (bench_decode: one batch of one result file)."""
  source: str
  shape: ModelShape
  batch: int
  context_tokens: float  # KV tokens the step reads, all rows together
  measured_s: float

  @property
  def layers(self) -> int:
    return self.shape.num_layers

  @property
  def work(self) -> tuple[float, float]:
    """(FLOPs, bytes) of the step (cost_model.decode_step_work)."""
    return decode_step_work(self.shape, self.batch, self.context_tokens)

  @property
  def label(self) -> str:
    return f"decode step, {self.layers} layers, batch {self.batch} (s)"


def bench_shape(result: dict) -> ModelShape:
  """The simulator's shape of a bench_decode result's model."""
  m = result["model"]
  return ModelShape(name="bench_decode", head="lm",
                    **{f: m[f] for f in _MODEL_FIELDS if f in m})


def points_from_results(results: Sequence[tuple[str, dict]]) -> list[DecodePoint]:
  """Every decode row of these (source, bench_decode result.json) pairs. A step reads the live
  KV prefix (mean_live_len; results without it come from the engine that read the whole cache)."""
  out = []
  for source, result in results:
    shape = bench_shape(result)
    cache = result["decode"]["cache_len"]
    for r in result["decode"]["per_batch"]:
      b = int(r["batch"])
      out.append(DecodePoint(source, shape, b, float(b * r.get("mean_live_len", cache)),
                             float(r["step_s"])))
  return out


def predict(fit: DecodeFit, hw: Hardware, p: DecodePoint) -> float:
  flops, nbytes = p.work
  return float(fit.step_s + p.layers * fit.layer_s +
               max(flops / (hw.peak_flops * fit.mfu), nbytes / (hw.hbm_bw * fit.bw_eff)))


def fit(points: Sequence[DecodePoint], hw: Hardware,
        efficiency: Efficiency = Efficiency()) -> DecodeFit:
  """step_s, layer_s and mfu by least squares on the relative error (module docstring)."""
  if len(points) < 3:
    raise ValueError(f"a decode fit needs at least 3 measured steps (3 parameters), got "
                     f"{len(points)}")
  depths = sorted({p.layers for p in points})
  if len(depths) < 2:
    # At one depth step_s and L x layer_s are the same constant: the split the solver returns
    # is arbitrary, and prices other depths 14-21 % apart (a review, 2026-12-05).
    raise ValueError(f"a decode fit needs steps of at least two model depths, to tell the "
                     f"per-step cost from the per-layer one; got {depths[0]} layers only "
                     "(run bench_decode again with half the layers, "
                     "config.validate.bench_decode_extra)")
  bw_eff = efficiency.decode_bw_eff

  def residuals(x):
    f = DecodeFit(step_s=x[0], layer_s=x[1], mfu=x[2], bw_eff=bw_eff)
    return [predict(f, hw, p) / p.measured_s - 1.0 for p in points]
  # The max() leaves mfu without a gradient wherever the compute term does not bind, so the fit
  # starts from several mfu values: the cost model's own first (where no point is compute-bound,
  # it stays), then lower ones; a later start must be strictly better to win.
  best = None
  for mfu0 in (efficiency.decode_mfu,) + _MFU_STARTS:
    r = optimize.least_squares(residuals, [0.0, 0.0, mfu0], bounds=_BOUNDS)
    if best is None or r.cost < best.cost - 1e-6:  # half the sum of squared relative errors
      best = r
  x = best.x
  return DecodeFit(step_s=float(x[0]), layer_s=float(x[1]), mfu=float(x[2]), bw_eff=bw_eff)


def leave_one_out(points: Sequence[DecodePoint], hw: Hardware,
                  efficiency: Efficiency = Efficiency()) -> list[Optional[float]]:
  """Each point's prediction by a fit to all the others (module docstring); None where the
  others are too few to fit (3 parameters) or all of one depth (fit)."""
  out = []
  for i, p in enumerate(points):
    rest = [q for j, q in enumerate(points) if j != i]
    if len(rest) < 3 or len({q.layers for q in rest}) < 2:
      out.append(None)
    else:
      out.append(predict(fit(rest, hw, efficiency), hw, p))
  return out
