"""Decoder annealing: anneal the inputs of a memory-safe list scheduler instead of orders.

State: a per-device split of the memory budget into (actor, critic) in-flight caps and a priority
per task; a list scheduler (schedules.list_schedule) decodes it into an order. Every decoded
schedule is within budget and deadlock-free by construction (per-model caps whose weighted sum
fits the budget), and one move changes many positions at once. Used by search.py as one source
of starting points.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from rlhfuse_jax.pipeline import schedules
from rlhfuse_jax.pipeline.evaluate import Evaluator
from rlhfuse_jax.pipeline.graph import PipelineProblem


def decoder_anneal(problem: PipelineProblem, rng: np.random.Generator, clock,
                   until: float, restarts: int = 200) -> tuple[Optional[np.ndarray], int]:
  """Annealing over the inputs of a memory-safe list scheduler instead of over orders.

  State: a per-device split of the budget into (actor cap, critic cap) in-flight micro-batches
  (so every decoded schedule is within budget and deadlock-free by construction) and a priority
  per task. Moves: shift one device's split by one micro-batch, shift the priority of one kind on
  one device, or of a run of micro-batches. Returns the best decoded order and the number of
  decodes (each counted in clock.evaluations; the phase ends when clock.used() reaches
  `until`). Complements order annealing: a move here changes many positions at once, in a way
  that keeps memory within budget.
  """
  n = problem.num_devices
  mmax = max(problem.actor_microbatches, problem.critic_microbatches)
  am, cm = problem.actor_mem, problem.critic_mem
  budget = problem.budget()
  scale = float(problem.durations().max())
  counts = problem.kind_counts()
  max_a = np.minimum(np.maximum(1, np.floor((budget - cm) / max(am, 1e-12))),
                     problem.actor_microbatches).astype(np.int64)
  tails = schedules.task_tails(problem)
  ev = Evaluator(problem)
  no_cap = np.full(n, np.inf)
  caps = np.empty((n, 2), dtype=np.int64)

  def decode(cap_a, prio):
    caps[:, 0] = cap_a
    caps[:, 1] = np.clip(np.floor((budget - cap_a * am) / max(cm, 1e-12)), 1,
                         problem.critic_microbatches)
    if np.any(caps[:, 0] * am + caps[:, 1] * cm > budget + 1e-9):
      return None, np.inf
    order = schedules.list_schedule(problem, prio, caps, no_cap, 0.0)
    if order is None:
      return None, np.inf
    _, mk, sf = ev.timing(order)
    return order, mk + 1e-3 * sf / n

  best_order, best_cost, state, decodes = None, np.inf, None, 0
  for _ in range(restarts):
    if clock.used() >= until and state is not None:
      break
    frac = rng.uniform(0, 1, size=n) if rng.random() < 0.5 else np.full(n, rng.uniform(0, 1))
    cap_a = np.clip(np.round(1 + frac * (max_a - 1)), 1, max_a).astype(np.int64)
    prio = np.ascontiguousarray(np.repeat(tails.T[:, :, None], mmax, axis=2))  # [4, N, mmax]
    prio[1] += rng.uniform(-3, 3) * scale
    prio[3] += rng.uniform(-3, 3) * scale
    prio[:2] += rng.uniform(-2, 2) * scale
    prio += rng.uniform(0, 0.5 * scale, size=prio.shape)
    order, cost = decode(cap_a, prio)
    decodes += 1
    clock.evaluations += 1
    if cost < best_cost:
      best_order, best_cost, state = order, cost, (cap_a.copy(), prio.copy())
  if state is None:
    return None, decodes
  cap_a, prio = state
  cur = best_cost
  temp0 = 0.5 * float(problem.durations().min())
  u_start = clock.used()
  span = max(until - u_start, 1e-9)
  while clock.used() < until:
    temp = temp0 * 0.02 ** min(1.0, (clock.used() - u_start) / span)
    r = rng.random()
    new_cap, new_prio = cap_a, prio
    if r < 0.3:
      d = rng.integers(n)
      new_cap = cap_a.copy()
      new_cap[d] = np.clip(new_cap[d] + rng.choice([-1, 1]), 1, max_a[d])
    else:
      new_prio = prio.copy()
      k, d = rng.integers(4), rng.integers(n)
      if r < 0.6:
        new_prio[k, d, :] += rng.normal(0, 0.5 * scale)
      else:
        m = rng.integers(counts[k])
        new_prio[k, d, m:m + rng.integers(1, 6)] += rng.normal(0, scale)
    order, cost = decode(new_cap, new_prio)
    decodes += 1
    clock.evaluations += 1
    if cost <= cur or rng.random() < math.exp(-(cost - cur) / temp):
      cap_a, prio, cur = new_cap, new_prio, cost
      if cost < best_cost:
        best_order, best_cost = order, cost
  return best_order, decodes
