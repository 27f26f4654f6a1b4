"""Length distributions for synthetic tasks: uniform, or a clipped log-normal long tail.

Real RLHF response lengths are long-tailed (most responses short, a few near the generation
limit); that tail is what inter-stage fusion exploits. A synthetic task whose target length is
drawn from a clipped log-normal makes a trained policy's response lengths long-tailed in the same
way, on a model small enough for CPU.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

LENGTH_DISTS = ("uniform", "lognormal")


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
  """Integer lengths in [min_len, max_len].

  Attributes:
    kind: 'uniform' (every length equally likely) or 'lognormal'
      (round(exp(N(mu, sigma^2))) clipped to [min_len, max_len]; the median is about exp(mu) and
      the 99th percentile about exp(mu + 2.33 sigma), clipping piles the excess onto max_len).
    min_len: smallest length.
    max_len: largest length.
    mu: log-normal location (log of the median length).
    sigma: log-normal scale (larger = longer tail).
  """
  kind: str = "uniform"
  min_len: int = 1
  max_len: int = 8
  mu: float = 1.5
  sigma: float = 0.8

  def __post_init__(self):
    if self.kind not in LENGTH_DISTS:
      raise ValueError(f"length_dist={self.kind!r}: expected one of {LENGTH_DISTS}")
    if self.min_len < 1:
      raise ValueError(f"min_len={self.min_len}: expected >= 1")
    if self.max_len < self.min_len:
      raise ValueError(f"max_len={self.max_len} must be >= min_len={self.min_len}")
    if not (self.sigma > 0 and math.isfinite(self.sigma)):
      raise ValueError(f"sigma={self.sigma}: expected a finite value > 0")
    if not math.isfinite(self.mu):
      raise ValueError(f"mu={self.mu}: expected a finite value")

  def sample(self, rng: np.random.Generator, num: int) -> np.ndarray:
    """`num` lengths.  # [num] int64"""
    if self.kind == "uniform":
      return rng.integers(self.min_len, self.max_len + 1, size=num)
    raw = rng.lognormal(self.mu, self.sigma, size=num)  # [num] float
    return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)
