"""The histogram of response lengths a run has generated, kept across iterations.

The Rt choice (rt.py) draws batches of lengths from it to simulate candidate thresholds; the
engine adds each batch's lengths after generating it (docs/architecture.md §2, "Rt").
"""
from __future__ import annotations

import numpy as np


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

  def load_dict(self, d: dict) -> int:
    """Replaces the counts by those of `to_dict`'s output; lengths beyond max_len (a run
    resumed with fewer max_new_tokens) are dropped. Returns how many were dropped."""
    bins, counts = np.asarray(d["bins"], np.int64), np.asarray(d["counts"], np.int64)
    if bins.shape != counts.shape or bins.ndim != 1 or np.any(bins < 0) or np.any(counts < 0):
      raise ValueError(f"a length histogram needs bins and counts of one length, >= 0; got {d}")
    keep = bins <= self.max_len
    self.counts = np.zeros(self.max_len + 1, np.int64)
    np.add.at(self.counts, bins[keep], counts[keep])
    return int(counts[~keep].sum())
