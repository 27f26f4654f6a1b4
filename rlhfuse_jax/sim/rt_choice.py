"""Choosing the consolidation threshold Rt by offline simulation (DESIGN §2, "Choosing Rt").

Too early a consolidation over-packs the kept instances and slows the tail; too late wastes the
devices the tail holds. The engine keeps a histogram of the response lengths it has generated
(across iterations) and, before each batch, simulates that batch with each candidate Rt using
`generation_sim.simulate_generation` (the same code the simulator runs, with the shared
consolidation policy) and keeps the Rt with the smallest simulated generation+inference time.

Cost model: the simulator's `CostModel` with a calibration measured on the engine's own
executables (generation/measure.py): decode step time vs occupied slots, prefill and inference
micro-batch time, migration time per moved sample and frozen-weight load bandwidth, and whether
the devices share one processor (fake CPU devices). Every op the generation simulation uses is
calibrated, so the hardware preset the CostModel is built with is never consulted.

Plain numpy (no jax), like the rest of sim/.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from rlhfuse_jax.sim import calibration as cal_lib
from rlhfuse_jax.sim.cost_model import CostModel
from rlhfuse_jax.sim.generation_sim import GenSetup, simulate_generation
from rlhfuse_jax.sim.hardware import get_hardware
from rlhfuse_jax.sim.shapes import ModelShape

DEFAULT_CANDIDATES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)
# The paper's observation (about 20 % of the samples remaining is often a good point): used
# while no length has been observed yet.
PRIOR_RT = 0.2


class LengthHistogram:
  """Counts of response lengths 1..max_len seen so far (kept across iterations)."""

  def __init__(self, max_len: int):
    if max_len < 1:
      raise ValueError(f"LengthHistogram max_len={max_len} must be >= 1")
    self.max_len = max_len
    self.counts = np.zeros(max_len + 1, np.int64)  # [max_len + 1]; index = length

  @property
  def total(self) -> int:
    return int(self.counts.sum())

  def add(self, lengths) -> None:
    x = np.asarray(lengths, np.int64).ravel()
    if x.size and (x.min() < 1 or x.max() > self.max_len):
      raise ValueError(f"lengths must be in [1, {self.max_len}]; got [{x.min()}, {x.max()}]")
    np.add.at(self.counts, x, 1)

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` lengths drawn from the histogram. int64 [n]."""
    if self.total == 0:
      raise ValueError("the length histogram is empty")
    return rng.choice(np.arange(self.max_len + 1), size=n, p=self.counts / self.total)

  def to_dict(self) -> dict:
    nz = np.flatnonzero(self.counts)
    return {"bins": nz.tolist(), "counts": self.counts[nz].tolist()}


@dataclasses.dataclass(frozen=True)
class RtChoice:
  rt: float
  reason: str
  simulated_s: dict  # {candidate Rt: mean simulated gen+inf seconds}


def choose_rt(history: LengthHistogram, calibration: dict, actor: ModelShape,
              frozen: Sequence[ModelShape], setup: GenSetup, prompt_lens,
              candidates: Sequence[float] = DEFAULT_CANDIDATES, draws: int = 4,
              seed: int = 0) -> RtChoice:
  """The candidate Rt with the smallest mean simulated gen+inf time.

  history: observed response lengths; calibration: a calibration-file dict (sim/calibration.py);
  setup: the engine's layout (threshold is replaced by each candidate, streaming on);
  prompt_lens: [B] of the batch to generate; draws: batches of lengths drawn from the history
  per candidate (the same draws for every candidate, so they are compared on equal terms).
  """
  if history.total == 0:
    return RtChoice(PRIOR_RT, "no lengths observed yet: the prior Rt", {})
  if not candidates:
    raise ValueError("rt candidates must not be empty")
  for c in candidates:
    if not 0.0 <= c <= 1.0:
      raise ValueError(f"rt candidate {c} must be in [0, 1]")
  cost = CostModel(get_hardware("h100_sxm"), calibration=cal_lib.from_dict(calibration,
                                                                            "measured"))
  prompt_lens = np.asarray(prompt_lens, np.int64)  # [B]
  rng = np.random.default_rng(seed)
  batches = [np.clip(history.sample(rng, prompt_lens.size), 1, setup.max_new_tokens)
             for _ in range(draws)]
  times = {}
  for rt in candidates:
    s = dataclasses.replace(setup, threshold=float(rt), stream_inference=True)
    times[float(rt)] = float(np.mean([
        simulate_generation(cost, actor, frozen, s, prompt_lens, lens).gen_plus_inf_s
        for lens in batches]))
  best = min(times, key=lambda r: (times[r], r))
  return RtChoice(best, f"simulated over {history.total} observed lengths, {draws} draws", times)


def resolve_threshold(value, field: str = "fusion.migration_threshold") -> Optional[float]:
  """A fixed Rt as float, or None for 'auto'; raises with the field name otherwise."""
  if isinstance(value, str):
    if value == "auto":
      return None
    try:
      value = float(value)
    except ValueError:
      raise ValueError(f"config.{field}={value!r}: expected a number in [0, 1] or 'auto'") \
          from None
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
    raise ValueError(f"config.{field}={value!r}: expected a number in [0, 1] or 'auto'")
  return float(value)
