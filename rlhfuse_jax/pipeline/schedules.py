"""Constructive schedules: 1F1B per model, serial, greedy gap filling, and list scheduling.

All return a per-device kind order, int8 [N, T] (graph.py), that evaluate.py times.

- 1F1B on stage s of a P-stage pipeline with M micro-batches: min(P-s, M) forwards, then
  alternating backward/forward, then the remaining backwards. It holds at most min(P-s, M)
  micro-batches, which defines the default memory budget.
- Serial: each device runs the actor's 1F1B, then the critic's; the critic is released only when
  the whole actor pipeline has finished (a barrier), so its makespan is the sum of the two 1F1B
  makespans, T_serial of docs/architecture.md §3.
- Greedy fused: one model keeps its 1F1B timing; the other model's tasks, in their own 1F1B order,
  go into the earliest gaps that fit them (or after the fixed model ends). Both models keep their
  1F1B order per device, so each holds at most its 1F1B peak and the sum stays within the default
  budget. The better of (actor fixed, critic fixed) is the greedy schedule; it is never worse than
  serial (every task can at worst start where serial would have started it).
- List scheduling (numba): repeatedly start, among the next task of each kind on each device, the
  one that can start soonest; ties go to the highest priority (longest remaining path, with
  biases towards backwards or one model, and optional noise). Per-model caps on in-flight
  forwards and a combined memory cap per device make variants; a variant that stalls (caps that
  block each other) is reported as failed, never returned.
"""
from __future__ import annotations

import numba
import numpy as np

from rlhfuse_jax.pipeline import kernel_cache
from rlhfuse_jax.pipeline.evaluate import Evaluator, evaluate
from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF, PipelineProblem


def one_f_one_b_sequence(num_stages: int, stage: int, microbatches: int, fwd: int,
                         bwd: int) -> list[int]:
  """1F1B kind sequence of one stage (fwd/bwd are the kind codes of the model)."""
  warm = min(num_stages - stage, microbatches)
  seq = [fwd] * warm
  for _ in range(microbatches - warm):
    seq += [bwd, fwd]
  return seq + [bwd] * warm


def _model_sequences(problem: PipelineProblem, d: int) -> tuple[list[int], list[int]]:
  actor = one_f_one_b_sequence(problem.actor_pp, problem.actor_stage(d),
                               problem.actor_microbatches, AF, AB)
  critic = one_f_one_b_sequence(problem.critic_pp, problem.critic_stage(d),
                                problem.critic_microbatches, CF, CB)
  return actor, critic


def serial_order(problem: PipelineProblem) -> np.ndarray:
  """Actor 1F1B then critic 1F1B on every device; time it with `serial_release`."""
  rows = [a + c for a, c in (_model_sequences(problem, d) for d in range(problem.num_devices))]
  return np.array(rows, dtype=np.int8)  # [N, T]


def sequential_order(problem: PipelineProblem) -> np.ndarray:
  """Actor then critic with one micro-batch in flight (F, B, F, B, ...) on every device. It holds
  max(actor_mem, critic_mem) at most, which every schedule holds at some point (each device runs
  a forward of both models), so it fits every budget any schedule fits: the search's start of
  last resort under an explicit budget below the two models' sum."""
  n = problem.num_devices
  row = [AF, AB] * problem.actor_microbatches + [CF, CB] * problem.critic_microbatches
  return np.array([row] * n, dtype=np.int8)  # [N, T]


def serial_release(problem: PipelineProblem) -> tuple[float, float]:
  """Release times (actor, critic) of the serial baseline: the critic waits for the actor."""
  return 0.0, model_makespan(problem, "actor")


def model_makespan(problem: PipelineProblem, model: str) -> float:
  """Makespan of one model's 1F1B on its own (the other model is never released)."""
  order = one_f_one_b_order(problem, model)
  ev = Evaluator(problem)
  ev.timing(order, (0.0, np.inf) if model == "actor" else (np.inf, 0.0))
  cols = 2 * (problem.actor_microbatches if model == "actor" else problem.critic_microbatches)
  return float(ev.ends[:, :cols].max())


def _gap_fill(problem: PipelineProblem, fixed: str) -> np.ndarray:
  """Keeps `fixed`'s 1F1B timing; puts the other model's 1F1B-ordered tasks into gaps."""
  n = problem.num_devices
  seqs = [_model_sequences(problem, d) for d in range(n)]
  fixed_idx = 0 if fixed == "actor" else 1
  # Time the fixed model alone: put it first on every device, the other model after a barrier.
  rows = [s[fixed_idx] + s[1 - fixed_idx] for s in seqs]
  order = np.array(rows, dtype=np.int8)
  release = (0.0, np.inf) if fixed == "actor" else (np.inf, 0.0)
  ev = Evaluator(problem)
  ev.timing(order, release)  # the unreleased model ends at infinity; the fixed one is timed
  nf = len(seqs[0][fixed_idx])
  durs = problem.durations()
  busy = []  # per device: sorted (start, end) of the fixed model's tasks
  for d in range(n):
    ends = ev.ends[d, :nf].copy()
    starts = ends - durs[order[d, :nf].astype(np.int64)]
    busy.append(list(zip(starts.tolist(), ends.tolist())))
  # Place the other model's tasks in their 1F1B order, each in the earliest gap that fits.
  other = [s[1 - fixed_idx] for s in seqs]
  placed_end = {}  # (kind, device, micro) -> end
  ptr = [0] * n
  cnt = [[0] * 4 for _ in range(n)]
  last_end = [0.0] * n
  gap_ptr = [0] * n
  placed = [[] for _ in range(n)]  # (start, kind)
  lat = problem.transfer_latency
  pc = problem.critic_pp
  remaining = sum(len(o) for o in other)
  while remaining:
    progress = False
    for d in range(n):
      while ptr[d] < len(other[d]):
        k = other[d][ptr[d]]
        m = cnt[d][k]
        dep_key, cross = None, True
        if k == AF:
          dep_key = (AF, d - 1, m) if d > 0 else None
        elif k == AB:
          dep_key, cross = ((AB, d + 1, m), True) if d < n - 1 else ((AF, d, m), False)
        elif k == CF:
          dep_key = (CF, d + 1, m) if problem.critic_stage(d) > 0 else None
        else:
          dep_key, cross = (((CB, d - 1, m), True) if problem.critic_stage(d) < pc - 1
                            else ((CF, d, m), False))
        if dep_key is not None and dep_key not in placed_end:
          break
        ready = 0.0 if dep_key is None else placed_end[dep_key] + (lat if cross else 0.0)
        t0 = max(ready, last_end[d])
        dur = durs[k]
        # Earliest start >= t0 whose interval avoids the fixed tasks (busy is sorted).
        g = gap_ptr[d]
        while g < len(busy[d]) and busy[d][g][1] <= t0:
          g += 1
        gap_ptr[d] = g
        start = t0
        while g < len(busy[d]) and busy[d][g][0] < start + dur - 1e-12:
          start = max(start, busy[d][g][1])
          g += 1
        placed_end[(k, d, m)] = start + dur
        placed[d].append((start, k))
        last_end[d] = start + dur
        cnt[d][k] += 1
        ptr[d] += 1
        remaining -= 1
        progress = True
    if not progress:
      raise RuntimeError("gap filling stalled; the 1F1B order of one model cannot deadlock")
  out = np.empty_like(order)
  for d in range(n):
    items = [(s, 0, k) for (s, _), k in zip(busy[d], order[d, :nf].tolist())]
    items += [(s, 1, k) for s, k in placed[d]]
    items.sort()
    out[d] = [k for _, _, k in items]
  return out


def greedy_order(problem: PipelineProblem) -> np.ndarray:
  """The better (lexicographic objective) of the two gap-filling greedy schedules."""
  cands = [_gap_fill(problem, "actor"), _gap_fill(problem, "critic")]
  keys = [evaluate(problem, c).objective() for c in cands]
  return cands[0] if keys[0] <= keys[1] else cands[1]


def one_f_one_b_order(problem: PipelineProblem, model: str) -> np.ndarray:
  """One model's 1F1B with the other model's tasks after it: the per-model 1F1B schedule."""
  if model == "actor":
    return serial_order(problem)
  if model == "critic":
    rows = [c + a for a, c in (_model_sequences(problem, d) for d in range(problem.num_devices))]
    return np.array(rows, dtype=np.int8)
  raise ValueError(f"model={model!r}; expected 'actor' or 'critic'")


def task_tails(problem: PipelineProblem) -> np.ndarray:
  """Remaining path length from the start of each kind's task on each device, [N, 4]."""
  n, lat = problem.num_devices, problem.transfer_latency
  pa, pc = problem.actor_pp, problem.critic_pp
  fa, ba, fc, bc = problem.durations()
  tails = np.zeros((n, 4))
  for d in range(n):
    a, c = problem.actor_stage(d), problem.critic_stage(d)
    tails[d, AF] = fa * (pa - a) + ba * pa + lat * (2 * pa - 2 - a)
    tails[d, AB] = ba * (a + 1) + lat * a
    tails[d, CF] = fc * (pc - c) + bc * pc + lat * (2 * pc - 2 - c)
    tails[d, CB] = bc * (c + 1) + lat * c
  return tails


@numba.njit(cache=True, nogil=True)
def list_schedule_kernel(params, prio, caps, mem_cap, deltas, window, reserve, order):
  """Builds an order (written into `order` int8 [N, T]) by list scheduling; True if no stall.

  prio: f8 [4, N, max(Ma, Mc)] priority of each task (kind, device, micro-batch); larger first.
  caps: i8 [N, 2] max in-flight micro-batches per device for (actor, critic).
  mem_cap: f8 [N] cap on held memory.
  window: a device may idle up to `window` time units to start a higher-priority task.
  reserve: admit a forward only if one forward of the other model still fits when that model
  holds nothing on the device (makes the combined memory cap deadlock-free).
  """
  n, t = order.shape
  pc = int(params[1])
  ma = int(params[2])
  mc = int(params[3])
  lat = params[8]
  dur = np.array([params[4], params[5], params[6], params[7]])
  count = np.array([ma, ma, mc, mc])
  mmax = max(ma, mc)
  endk = np.full((4, n, mmax), -1.0)
  cnt = np.zeros((n, 4), dtype=np.int64)
  free = np.zeros(n)
  infl = np.zeros((n, 2), dtype=np.int64)
  mem = np.zeros(n)
  est = np.full((n, 4), np.inf)
  for step in range(n * t):
    best_t = np.inf
    for d in range(n):
      c = pc - 1 - d % pc
      for k in range(4):
        est[d, k] = np.inf
        m = cnt[d, k]
        if m >= count[k]:
          continue
        if k % 2 == 0:
          # Keep room for one forward of the other model while it holds nothing here: the
          # earliest in-flight micro-batch of each model can then always advance (no deadlock).
          o = 1 - k // 2
          need = mem[d] + deltas[k]
          if reserve and infl[d, o] == 0 and cnt[d, 2 * o] < count[2 * o]:
            need += deltas[2 * o]
          if infl[d, k // 2] >= caps[d, k // 2] or need > mem_cap[d] + 1e-9:
            continue
        ready = 0.0
        if k == 0:
          if d > 0:
            e = endk[0, d - 1, m]
            if e < 0.0:
              continue
            ready = e + lat
        elif k == 1:
          if d < n - 1:
            e = endk[1, d + 1, m]
            if e < 0.0:
              continue
            ready = e + lat
          else:
            e = endk[0, d, m]
            if e < 0.0:
              continue
            ready = e
        elif k == 2:
          if c > 0:
            e = endk[2, d + 1, m]
            if e < 0.0:
              continue
            ready = e + lat
        else:
          if c < pc - 1:
            e = endk[3, d - 1, m]
            if e < 0.0:
              continue
            ready = e + lat
          else:
            e = endk[2, d, m]
            if e < 0.0:
              continue
            ready = e
        s = max(free[d], ready)
        est[d, k] = s
        if s < best_t:
          best_t = s
    if best_t == np.inf:
      return False
    # Among tasks that can start by best_t + window, on any device whose start is that early,
    # take the highest priority; prefer the earliest start on ties.
    bd = -1
    bk = -1
    bp = -np.inf
    bs = np.inf
    for d in range(n):
      for k in range(4):
        s = est[d, k]
        if s <= best_t + window + 1e-9:
          p = prio[k, d, cnt[d, k]]
          if p > bp + 1e-12 or (abs(p - bp) <= 1e-12 and s < bs):
            bp = p
            bs = s
            bd = d
            bk = k
    d = bd
    k = bk
    m = cnt[d, k]
    en = est[d, k] + dur[k]
    endk[k, d, m] = en
    free[d] = en
    order[d, cnt[d].sum()] = k
    cnt[d, k] = m + 1
    mem[d] += deltas[k]
    if k % 2 == 0:
      infl[d, k // 2] += 1
    else:
      infl[d, k // 2] -= 1
  return True


def list_schedule(problem: PipelineProblem, prio: np.ndarray, caps: np.ndarray,
                  mem_cap: np.ndarray, window: float = 0.0, reserve: bool = False):
  """One list-scheduling variant; returns the order [N, T] or None if it stalled.

  prio: [N, 4] per device and kind, or [4, N, max(Ma, Mc)] per task (larger runs first).
  """
  order = np.zeros((problem.num_devices, problem.tasks_per_device), dtype=np.int8)
  prio = np.asarray(prio, np.float64)
  if prio.ndim == 2:  # [N, 4] per device and kind -> per task
    mmax = max(problem.actor_microbatches, problem.critic_microbatches)
    prio = np.ascontiguousarray(np.broadcast_to(prio.T[:, :, None], (4, prio.shape[0], mmax)))
  ok = list_schedule_kernel(problem.params(), prio,
                            np.asarray(caps, np.int64), np.asarray(mem_cap, np.float64),
                            problem.mem_deltas(), float(window), bool(reserve), order)
  return order if ok else None


def one_f_one_b_caps(problem: PipelineProblem) -> np.ndarray:
  """Per-device (actor, critic) in-flight caps of the two 1F1B schedules, [N, 2]."""
  n = problem.num_devices
  return np.array([[min(problem.actor_pp - problem.actor_stage(d), problem.actor_microbatches),
                    min(problem.critic_pp - problem.critic_stage(d),
                        problem.critic_microbatches)] for d in range(n)], dtype=np.int64)


kernel_cache.tie(globals())  # before any kernel runs: the cache key covers every kernel file
