"""Host-side mini-batch planning: shuffling, and token-balanced data-parallel shards.

A training step over a mini-batch sharded on the data axis takes as long as its slowest shard,
and with long-tailed response lengths a plain split can put most long responses on one shard.
Static shapes require every shard to get the SAME NUMBER of samples, so balancing is a partition
with a cardinality constraint: split n samples into k parts of n/k samples each, with token sums
as equal as possible.

`balanced_partition` does it with LPT (longest first, each to the lightest part that still has
room) followed by a local search that swaps one sample between the heaviest part and a lighter
one while that lowers the heaviest part. `minibatch_indices` shuffles once per epoch, cuts
mini-batches, and orders each mini-batch so that its contiguous split into `num_data_shards`
pieces (how a batch sharded on the data axis is laid out) is balanced.

What it buys depends on the step: the trainer's update runs static padded shapes (every shard
computes all of its rows' positions), so there balancing changes neither the step time nor the
result (the losses sum over the whole mini-batch); it pays where shards skip padding.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np


def _check_divides(total: int, total_name: str, parts: int, parts_name: str) -> None:
  if parts <= 0:
    raise ValueError(f"{parts_name}={parts} must be positive")
  if total % parts:
    raise ValueError(f"{total_name}={total} must be divisible by {parts_name}={parts} "
                     "(every part needs the same number of samples for static shapes)")


def contiguous_partition(num_samples: int, num_parts: int) -> List[np.ndarray]:
  """The naive split: part i holds samples [i*n/k, (i+1)*n/k). The baseline for balancing."""
  _check_divides(num_samples, "num_samples", num_parts, "num_parts")
  return list(np.split(np.arange(num_samples), num_parts))


def partition_imbalance(token_counts: np.ndarray, parts: List[np.ndarray]) -> float:
  """max part token sum / mean part token sum (1.0 = perfectly balanced; the step-time factor)."""
  sums = np.array([np.sum(token_counts[p]) for p in parts], dtype=np.float64)
  mean = sums.mean()
  return float(sums.max() / mean) if mean > 0 else 1.0


def _improve_by_swaps(counts: np.ndarray, parts: List[List[int]], sums: np.ndarray,
                      max_swaps: int) -> None:
  """Swaps single items out of the heaviest part while that strictly lowers it (in place)."""
  for _ in range(max_swaps):
    heavy = int(np.argmax(sums))
    swapped = False
    heavy_items = np.asarray(parts[heavy])
    for light in np.argsort(sums, kind="stable"):
      if light == heavy:
        continue
      gap = sums[heavy] - sums[light]
      if gap <= 0:
        break
      light_items = np.asarray(parts[light])
      # diff[i, j]: how much the heavy part sheds by swapping heavy item i with light item j.
      diff = counts[heavy_items][:, None] - counts[light_items][None, :]
      # 0 < diff < gap lowers the heavy part and keeps the light one below the old maximum;
      # diff closest to gap / 2 balances the pair best.
      ok = (diff > 0) & (diff < gap)
      if not ok.any():
        continue
      score = np.where(ok, np.abs(diff - gap / 2.0), np.inf)
      i, j = np.unravel_index(int(np.argmin(score)), score.shape)
      a, b = parts[heavy][i], parts[light][j]
      parts[heavy][i], parts[light][j] = b, a
      d = counts[a] - counts[b]
      sums[heavy] -= d
      sums[light] += d
      swapped = True
      break
    if not swapped:
      return


def balanced_partition(token_counts: np.ndarray, num_parts: int,
                       max_swaps: Optional[int] = None) -> List[np.ndarray]:
  """Splits sample indices into `num_parts` equal-size parts with balanced token sums.

  Args:
    token_counts: `[num_samples]` tokens per sample (e.g. prompt + response length).
    num_parts: number of parts; must divide num_samples.
    max_swaps: cap on local-search swaps (default 4 * num_samples).
  Returns:
    `num_parts` int64 index arrays of num_samples / num_parts indices each, sorted ascending;
    together a permutation of range(num_samples). Deterministic for a given input.
  """
  counts = np.asarray(token_counts)
  if counts.ndim != 1:
    raise ValueError(f"token_counts must be 1-D [num_samples], got shape {counts.shape}")
  n = counts.shape[0]
  _check_divides(n, "num_samples (len(token_counts))", num_parts, "num_parts")
  counts = counts.astype(np.float64)
  per_part = n // num_parts
  parts: List[List[int]] = [[] for _ in range(num_parts)]
  sums = np.zeros(num_parts, dtype=np.float64)
  sizes = np.zeros(num_parts, dtype=np.int64)
  for idx in np.argsort(-counts, kind="stable"):
    # Lightest part that still has room; full parts are excluded by an infinite sum.
    part = int(np.argmin(np.where(sizes < per_part, sums, np.inf)))
    parts[part].append(int(idx))
    sums[part] += counts[idx]
    sizes[part] += 1
  _improve_by_swaps(counts, parts, sums, 4 * n if max_swaps is None else max_swaps)
  return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def minibatch_indices(num_samples: int, minibatch_size: int,
                      epoch_rng: np.random.Generator,
                      token_counts: Optional[np.ndarray] = None,
                      num_data_shards: int = 1) -> List[np.ndarray]:
  """Index arrays of the mini-batches of one epoch: every sample exactly once.

  The samples are shuffled with `epoch_rng` and cut into mini-batches of `minibatch_size`.
  With `token_counts` and `num_data_shards > 1`, each mini-batch is reordered so that its
  contiguous split into `num_data_shards` equal pieces (shard i gets rows
  [i*m/s, (i+1)*m/s) under a data-axis sharding) has balanced token sums.

  Returns:
    num_samples / minibatch_size int64 arrays of length minibatch_size.
  """
  _check_divides(num_samples, "num_samples", minibatch_size, "minibatch_size")
  _check_divides(minibatch_size, "minibatch_size", num_data_shards, "num_data_shards")
  if token_counts is not None and np.shape(token_counts) != (num_samples,):
    raise ValueError(f"token_counts must have shape ({num_samples},) = (num_samples,), got "
                     f"{np.shape(token_counts)}")
  perm = epoch_rng.permutation(num_samples).astype(np.int64)
  minibatches = np.split(perm, num_samples // minibatch_size)
  if token_counts is None or num_data_shards == 1:
    return minibatches
  counts = np.asarray(token_counts)
  balanced = []
  for mb in minibatches:
    shards = balanced_partition(counts[mb], num_data_shards)
    balanced.append(np.concatenate([mb[s] for s in shards]))
  return balanced
