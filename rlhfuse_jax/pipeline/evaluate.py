"""Evaluating a fused schedule: list-scheduling timing, deadlock detection, memory, objective.

A candidate schedule is a per-device sequence of task kinds, `order` int8 [N, T] (see graph.py:
AF=0, AB=1, CF=2, CB=3, micro-batches of one kind in increasing order). Timing is list
scheduling: a task starts at max(end of its dependency (+ transfer latency across devices), end
of the previous task on its device, release time of its model). If at some point no device can
start its next task the order has a cyclic wait: a deadlock, and the schedule is invalid.

Peak memory depends only on each device's order, not on the timing (a backward earlier in the
order ends before any later forward starts): the running maximum of the prefix sums of +mem per
forward and -mem per backward. It is checked for every candidate at O(T) cost.

Objective (lexicographic, smaller is better): (budget overflow, makespan, max per-device peak,
sum of per-device peaks, sum of per-device finish times). A schedule within budget has overflow
0, so among feasible schedules the makespan decides, then the peaks and finish times
(docs/architecture.md §3, "Evaluation").

The kernels are numba-compiled: one evaluation of the largest reference instance (16 devices x
256 tasks) costs tens of microseconds, which the search needs (~10^5 evaluations in 20 s).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numba
import numpy as np

from rlhfuse_jax.pipeline import kernel_cache
from rlhfuse_jax.pipeline.graph import PipelineProblem, validate_order

# Index of each constant in PipelineProblem.params().
_PA, _PC, _MA, _MC, _FA, _BA, _FC, _BC, _LAT = range(9)


@numba.njit(cache=True, nogil=True)
def simulate_kernel(order, params, release, ends, work_f, work_i, work_p):
  """List-schedules `order` (int8 [N, T]); writes task end times into `ends` f8 [N, T].

  work_f: f8 [4, N, max(Ma, Mc)] scratch for end times per (kind, device, micro-batch).
  work_i: i8 [N, 5] scratch: next position per device and per-kind counters.
  work_p: i8 [4, N, max(Ma, Mc)] receives the position of each (kind, device, micro-batch).
  Returns (ok, makespan, sum of per-device finish times). ok False means deadlock.
  """
  n, t = order.shape
  pc = int(params[_PC])
  lat = params[_LAT]
  dur = np.empty(4)
  dur[0] = params[_FA]
  dur[1] = params[_BA]
  dur[2] = params[_FC]
  dur[3] = params[_BC]
  work_f[:] = -1.0
  work_i[:] = 0
  free = np.zeros(n)
  done = 0
  total = n * t
  sweep = 0
  while done < total:
    progress = False
    # Alternate sweep direction: actor forwards flow up the devices, critic forwards down.
    for dd in range(n):
      d = dd if sweep % 2 == 0 else n - 1 - dd
      while work_i[d, 0] < t:
        p = work_i[d, 0]
        k = order[d, p]
        m = work_i[d, 1 + k]
        dep = 0.0
        # The placement rule is spelled out here (and in schedules.list_schedule_kernel and
        # search.critical_path) on purpose: one shared njit helper returning the predecessor
        # made this kernel 7-10% slower on e9 (41-43 vs 38-39 us per evaluation, idle core).
        if k == 0:  # actor forward: after the previous stage's forward
          if d > 0:
            e = work_f[0, d - 1, m]
            if e < 0.0:
              break
            dep = e + lat
        elif k == 1:  # actor backward: after the next stage's backward (or own forward)
          if d < n - 1:
            e = work_f[1, d + 1, m]
            if e < 0.0:
              break
            dep = e + lat
          else:
            e = work_f[0, d, m]
            if e < 0.0:
              break
            dep = e
        else:
          c = pc - 1 - d % pc
          if k == 2:  # critic forward: previous critic stage lives on device d + 1
            if c > 0:
              e = work_f[2, d + 1, m]
              if e < 0.0:
                break
              dep = e + lat
          else:  # critic backward: next critic stage lives on device d - 1
            if c < pc - 1:
              e = work_f[3, d - 1, m]
              if e < 0.0:
                break
              dep = e + lat
            else:
              e = work_f[2, d, m]
              if e < 0.0:
                break
              dep = e
        s = max(free[d], dep, release[k // 2])
        en = s + dur[k]
        work_f[k, d, m] = en
        work_p[k, d, m] = p
        ends[d, p] = en
        free[d] = en
        work_i[d, 0] = p + 1
        work_i[d, 1 + k] = m + 1
        done += 1
        progress = True
    if not progress:
      return False, np.inf, np.inf
    sweep += 1
  return True, free.max(), free.sum()


@numba.njit(cache=True, nogil=True)
def peaks_kernel(order, deltas, out):
  """Per-device peak of held activation memory (running max of prefix sums), into out f8 [N]."""
  n, t = order.shape
  for d in range(n):
    cur = 0.0
    best = 0.0
    for p in range(t):
      cur += deltas[order[d, p]]
      if cur > best:
        best = cur
    out[d] = best
  return out


class Evaluator:
  """Holds the scratch buffers for one problem so repeated evaluations allocate nothing."""

  def __init__(self, problem: PipelineProblem):
    self.problem = problem
    self.params = problem.params()
    self.deltas = problem.mem_deltas()
    self.budget = problem.budget()
    n, t = problem.num_devices, problem.tasks_per_device
    mmax = max(problem.actor_microbatches, problem.critic_microbatches)
    self.ends = np.zeros((n, t))  # [N, T] end time of the task at each position
    self.work_f = np.zeros((4, n, mmax))
    self.work_i = np.zeros((n, 5), dtype=np.int64)
    self.work_p = np.zeros((4, n, mmax), dtype=np.int64)
    self.peaks = np.zeros(n)

  def timing(self, order: np.ndarray, release=(0.0, 0.0)) -> tuple[bool, float, float]:
    return simulate_kernel(order, self.params, np.asarray(release, dtype=np.float64), self.ends,
                           self.work_f, self.work_i, self.work_p)

  def peak(self, order: np.ndarray) -> np.ndarray:
    return peaks_kernel(order, self.deltas, self.peaks).copy()


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """Everything one evaluation says about a schedule."""
  valid: bool                    # False: deadlock (cyclic wait)
  makespan: float
  sum_finish: float              # sum over devices of the device's last end time
  peaks: np.ndarray              # [N] peak activation memory per device
  budget: np.ndarray             # [N]
  starts: Optional[np.ndarray]   # [N, T] start time of the task at each position (None if invalid)
  ends: Optional[np.ndarray]     # [N, T]
  work: float                    # busy time per device (equal on all devices)

  @property
  def overflow(self) -> float:
    """Total memory above budget over devices (0 for a schedule within budget)."""
    return float(np.maximum(self.peaks - self.budget, 0.0).sum())

  @property
  def within_budget(self) -> bool:
    return bool(np.all(self.peaks <= self.budget + 1e-9))

  @property
  def peak_over_budget(self) -> float:
    return peak_over_budget(self.peaks, self.budget)

  @property
  def bubble(self) -> float:
    """1 - N*W / (N*T): the idle fraction of device time (docs/architecture.md §3)."""
    return 1.0 - self.work / self.makespan if self.valid else float("nan")

  def objective(self) -> tuple:
    return objective_key(self.valid, self.overflow, self.makespan, self.peaks, self.sum_finish)


def objective_key(valid: bool, overflow: float, makespan: float, peaks: np.ndarray,
                  sum_finish: float) -> tuple:
  """The lexicographic objective; tuples compare smaller-is-better."""
  if not valid:
    return (1, np.inf, np.inf, np.inf, np.inf, np.inf)
  return (0, round(overflow, 9), round(makespan, 9), round(float(np.max(peaks)), 9),
          round(float(np.sum(peaks)), 9), round(sum_finish, 9))


def peak_over_budget(peaks, budget) -> float:
  """Largest per-device peak / budget ([N] each). A device with budget 0 (activation memory 0,
  a search without memory) counts 0 while it holds nothing: peaks / budget was nan there."""
  peaks, budget = np.asarray(peaks, np.float64), np.asarray(budget, np.float64)
  held = np.where(peaks > 1e-9, np.inf, 0.0)
  return float(np.divide(peaks, budget, out=held, where=budget > 0).max())


def evaluate(problem: PipelineProblem, order: np.ndarray, release=(0.0, 0.0)) -> Evaluation:
  """Times and measures one schedule. `release`: earliest start of (actor, critic) tasks."""
  order = validate_order(problem, order)
  ev = Evaluator(problem)
  ok, makespan, sum_finish = ev.timing(order, release)
  peaks = ev.peak(order)
  starts = ends = None
  if ok:
    ends = ev.ends.copy()
    starts = ends - problem.durations()[order.astype(np.int64)]
  return Evaluation(valid=bool(ok), makespan=float(makespan), sum_finish=float(sum_finish),
                    peaks=peaks, budget=ev.budget, starts=starts, ends=ends,
                    work=problem.work_per_device())


def peak_memory(problem: PipelineProblem, order: np.ndarray) -> np.ndarray:
  """Per-device peak activation memory of an order, [N]."""
  order = validate_order(problem, order)
  return peaks_kernel(order, problem.mem_deltas(), np.zeros(problem.num_devices))


kernel_cache.tie(globals())  # before any kernel runs: the cache key covers every kernel file
