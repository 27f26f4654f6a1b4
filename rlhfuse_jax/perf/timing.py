"""Wall-clock timing of jitted work for the benchmarks (experiments/bench_*.py)."""
from __future__ import annotations

import time
from typing import Any, Callable

import jax


def timed(fn: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
  """Seconds of each of `repeats` calls of fn() after `warmup` untimed ones, each waiting for
  its device work (jax.block_until_ready) before the clock stops."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - t0)
  return out
