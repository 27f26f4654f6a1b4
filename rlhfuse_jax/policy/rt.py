"""Choosing the consolidation threshold Rt by offline simulation (docs/architecture.md §2).

Too early a consolidation over-packs the kept instances and slows the tail; too late wastes the
devices the tail holds. The engine keeps a histogram of the response lengths it has generated
(across iterations, lengths.py) and, before a batch, simulates that batch with each candidate Rt
and keeps the Rt with the smallest simulated generation+inference time; the engine simulates
again only once the histogram has grown by a quarter, and the batches in between keep the last
choice (generation/fused.RESIMULATE_GROWTH).

The simulation itself is a parameter, `simulate(rt, prompt_lens, response_lens) -> seconds`:
this module decides, it does not model. The model the trainer plugs in is the simulator's
generation simulation with costs measured on the engine's own executables
(sim/rt_model.py, built for an engine by trainer/rt_auto.py), so the engine never imports the
simulator and the simulator never imports the engine.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np

from rlhfuse_jax.policy.lengths import LengthHistogram

# simulate(rt, prompt_lens [B], response_lens [B]) -> simulated generation+inference seconds.
Simulate = Callable[[float, np.ndarray, np.ndarray], float]

DEFAULT_CANDIDATES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)
# The paper's observation (about 20 % of the samples remaining is often a good point): used
# while no length has been observed yet.
PRIOR_RT = 0.2


@dataclasses.dataclass(frozen=True)
class RtChoice:
  rt: float
  reason: str
  simulated_s: dict  # {candidate Rt: mean simulated gen+inf seconds}


def choose_rt(history: LengthHistogram, simulate: Simulate, prompt_lens, max_new_tokens: int,
              candidates: Sequence[float] = DEFAULT_CANDIDATES, draws: int = 4,
              seed: int = 0) -> RtChoice:
  """The candidate Rt with the smallest mean simulated gen+inf time.

  history: observed response lengths; simulate: the model of one batch (module docstring);
  prompt_lens: [B] of the batch to generate; max_new_tokens: the lengths drawn are clipped to it;
  draws: batches of lengths drawn from the history per candidate (the same draws for every
  candidate, so they are compared on equal terms).
  """
  if history.total == 0:
    return RtChoice(PRIOR_RT, "no lengths observed yet: the prior Rt", {})
  if not candidates:
    raise ValueError("rt candidates must not be empty")
  for c in candidates:
    if not 0.0 <= c <= 1.0:
      raise ValueError(f"rt candidate {c} must be in [0, 1]")
  prompt_lens = np.asarray(prompt_lens, np.int64)  # [B]
  rng = np.random.default_rng(seed)
  batches = [np.clip(history.sample(rng, prompt_lens.size), 1, max_new_tokens)
             for _ in range(draws)]  # draws x [B]
  times = {float(rt): float(np.mean([simulate(float(rt), prompt_lens, lens)
                                     for lens in batches]))
           for rt in candidates}
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
