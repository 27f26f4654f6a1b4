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


def time_in_rotation(steps: dict[str, Callable[[], Any]], repeats: int,
                     alternate: bool = False) -> dict[str, list[float]]:
  """name -> wall seconds of `repeats` calls of its step, taken in rounds of one call per step
  (each waiting for its device work): on a host shared with other work, load that drifts over
  the run then weighs on every step alike instead of on whichever ran during it. `alternate`
  reverses the order every other round (two steps: neither always runs first)."""
  runs: dict[str, list[float]] = {name: [] for name in steps}
  order = list(steps)
  for r in range(repeats):
    for name in (order[::-1] if alternate and r % 2 else order):
      t0 = time.perf_counter()
      jax.block_until_ready(steps[name]())
      runs[name].append(time.perf_counter() - t0)
  return runs
