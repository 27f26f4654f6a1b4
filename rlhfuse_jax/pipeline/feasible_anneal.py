"""Annealing that never leaves the memory budget, guided by a lateness surrogate of the makespan.

Idea: peak memory depends only on each device's order (prefix sums of +mem per forward and -mem
per backward), so a move is checked against the budget before it is timed, and infeasible moves
are never evaluated. Penalty annealing (search.py) spends most of its evaluations outside the
budget and, with the makespan alone as cost, sits on plateaus: most moves change no critical
path. Here the cost is

  makespan + w * mean over tasks of max(0, start + tail - target) [+ the device term below]

where `tail` is the least time from the task's start to the end of any schedule
(windows.per_task_tails: edge-finding, so it also counts the work that must follow on the same
device; schedules.task_tails, the plain chain per device and kind, is the other choice), and
`target` is the tight lower bound.
A task with start + tail > target is late: every late task must move earlier for the makespan to
reach the bound, so the surrogate counts progress that the makespan alone does not show.

Those tails follow other devices' chains, not the task's own device, so an idle gap on the
device whose term sets the tight bound (bounds.py: W + head + tail) shows only once, on its last
task. A second term (weight `dev_weight`, `_device_lateness`) adds, per task, max(0, start +
the device's work from that task on + the device's tail - target): every task after a gap on a
device without slack is late by that gap. Measured with the 20 s sweep of docs/schedules.md
(2-core machine, 2 workers; experiments/results/schedule_sweep_2workers): the bound on 8, 8, 7,
7 and 8 of 12 in five sweeps, 6-7 of 12 in the four without the term; e0 708, 708, 713, 712,
708 (710 in each without: the bound reached for the first time, a wider spread).

Moves: take one task (with probability crit_frac a late one) and reinsert it up to `max_shift`
slots away on its device, or swap it with the task there, or move a block of 2-3 tasks starting
at it by that shift (pairs keep the memory level where single moves would exceed the budget);
skipping moves that put a backward before its own forward or a device over budget. The best
schedule by the lexicographic objective of evaluate.py (makespan, max peak, sum of peaks, sum of
finishes) is kept.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np

from rlhfuse_jax.pipeline import bounds, kernel_cache, windows
from rlhfuse_jax.pipeline.evaluate import _BA, _BC, _FA, _FC, _MA, _MC, simulate_kernel


@numba.njit(cache=True, nogil=True)
def _row_ok(row, deltas, budget_d):
  """Per-model backward never before its forward, and the running memory within budget_d.

  One pass for both checks on purpose (it repeats search._row_valid's counting): a memory pass
  followed by a call of search._row_valid made feasible_anneal 9% slower on e9 (20.8k vs 22.7k
  evaluations/s from the greedy start, idle core); this runs once per proposed move.
  """
  fa = 0
  fc = 0
  cur = 0.0
  for k in row:
    cur += deltas[k]
    if cur > budget_d + 1e-9:
      return False
    if k == 0:
      fa += 1
    elif k == 1:
      fa -= 1
      if fa < 0:
        return False
    elif k == 2:
      fc += 1
    else:
      fc -= 1
      if fc < 0:
        return False
  return True


@numba.njit(cache=True, nogil=True)
def row_peak(row, deltas):
  """Peak of the running memory (prefix sums of per-task deltas) of one device's order."""
  cur = 0.0
  best = 0.0
  for k in row:
    cur += deltas[k]
    if cur > best:
      best = cur
  return best


@numba.njit(cache=True, nogil=True)
def _lateness(order, ends, dur, tails, target, late_d, late_p, record):
  """Sum over tasks of max(0, start + tail - target); [N, T] inputs, tails [4, N, M] per task.

  With `record`, the late tasks' (device, position) go into late_d / late_p and their number is
  returned second (else 0).
  """
  n, t = order.shape
  tot = 0.0
  nlate = 0
  seen = np.zeros(4, dtype=np.int64)
  for d in range(n):
    seen[:] = 0
    for p in range(t):
      k = order[d, p]
      x = ends[d, p] - dur[k] + tails[k, d, seen[k]] - target
      seen[k] += 1
      if x > 0.0:
        tot += x
        if record and x > 1e-9:
          late_d[nlate] = d
          late_p[nlate] = p
          nlate += 1
  return tot, nlate


@numba.njit(cache=True, nogil=True)
def _device_lateness(order, ends, dur, dev_tails, target):
  """Sum over tasks of max(0, start + (work from it to the device's end) + dev_tails[d] -
  target): the device-order analogue of _lateness, 0 on a device that runs without a gap from
  its earliest start to target - dev_tails[d]; an idle gap counts once per task after it."""
  n, t = order.shape
  tot = 0.0
  for d in range(n):
    rem = dev_tails[d]
    for p in range(t - 1, -1, -1):
      k = order[d, p]
      rem += dur[k]
      x = ends[d, p] - dur[k] + rem - target
      if x > 0.0:
        tot += x
  return tot


class FeasibleSettings(NamedTuple):
  """Settings of one `feasible_anneal_kernel` call, passed to numba as one typed struct.

  `feasible_anneal` builds it with every field cast to its type: an int where a float is
  expected would make numba compile a second copy of the kernel.
  """
  target: float     # makespan that lateness is measured against (the tight lower bound)
  iters: int        # moves proposed
  temp0: float      # temperature at the first move; cools geometrically towards temp1
  temp1: float
  weight: float     # weight of the mean lateness in the cost
  max_shift: int    # a move takes a task at most this many slots away
  crit_frac: float  # share of moves that take a late task
  seed: int         # of numba's np.random, the kernel's only source of randomness
  dev_weight: float  # weight of the mean device lateness (_device_lateness) in the cost


@numba.njit(cache=True, nogil=True)
def timing_scratch(order, params):
  """Scratch buffers of simulate_kernel for `order` [N, T]: (release, ends, work_f, work_i,
  work_p); an annealing kernel allocates them once so that its evaluations allocate nothing."""
  n, t = order.shape
  mmax = max(int(params[_MA]), int(params[_MC]))
  release = np.zeros(2)
  ends = np.zeros((n, t))
  work_f = np.zeros((4, n, mmax))
  work_i = np.zeros((n, 5), dtype=np.int64)
  work_p = np.zeros((4, n, mmax), dtype=np.int64)
  return release, ends, work_f, work_i, work_p


@numba.njit(cache=True, nogil=True)
def kind_durations(params):
  """f8 [4] duration of each task kind (AF, AB, CF, CB), from PipelineProblem.params()."""
  return np.array([params[_FA], params[_BA], params[_FC], params[_BC]])


# The per-move helpers below are inlined into the kernels (inline="always", at numba IR level):
# called instead, those that take arrays cost about 80 ns per move (feasible_anneal_kernel on e2:
# 2.16 vs 2.08 us per evaluation with perturb called, min of 9 runs, loaded 2-core machine).


@numba.njit(cache=True, nogil=True, inline="always")
def draw_move(n, t, max_shift, ncand, cand_frac):
  """Draws a move of one task to another slot of its device: (q, device, position, step).

  With probability cand_frac (if ncand > 0) the task is candidate q of a list of ncand tasks
  (tasks on the critical path, or late ones: only those can shorten the makespan), which the
  caller looks up (device and position are then -1); else q is -1 and the task any of the
  [n, t]. The task goes `step` slots away, 1..max_shift before or after. Both annealing kernels
  draw here, in one fixed order of np.random draws. Scalars only, on purpose: with the candidate
  arrays passed in (and the lookup done here), feasible_anneal_kernel was 3% slower on e2 (2.12
  vs 2.06 us per evaluation), inlined or not.
  """
  q = d = i = -1
  if ncand > 0 and np.random.random() < cand_frac:
    q = np.random.randint(ncand)
  else:
    d = np.random.randint(n)
    i = np.random.randint(t)
  sh = np.random.randint(1, max_shift + 1)
  step = sh if np.random.random() < 0.5 else -sh
  return q, d, i, step


@numba.njit(cache=True, nogil=True, inline="always")
def reinsert(row, i, j):
  """Reinserts row[i] at position j, shifting the elements in between."""
  x = row[i]
  if i < j:
    for p in range(i, j):
      row[p] = row[p + 1]
  else:
    for p in range(i, j, -1):
      row[p] = row[p - 1]
  row[j] = x


@numba.njit(cache=True, nogil=True, inline="always")
def metropolis(cost, cur, temp):
  """Whether to accept a move from cost `cur` to `cost`: always if no worse, else with
  probability exp(-(cost - cur) / temp) (one draw of np.random, only then)."""
  return cost <= cur or np.random.random() < math.exp(-(cost - cur) / temp)


@numba.njit(cache=True, nogil=True, inline="always")
def lex_better(new, old, levels):
  """Whether `new` beats `old` on the lexicographic objective over their first `levels`
  entries (e.g. makespan, max peak, sum of peaks, sum of finishes), ties within 1e-9."""
  for q in range(levels):
    if new[q] < old[q] - 1e-9:
      return True
    if not new[q] <= old[q] + 1e-9:
      return False
  return False


@numba.njit(cache=True, nogil=True, inline="always")
def _swap(row, i, j):
  """Swaps two tasks: at the budget moving one forward earlier alone is rejected, swapping it
  with a backward keeps the memory level between them."""
  x = row[i]
  row[i] = row[j]
  row[j] = x


@numba.njit(cache=True, nogil=True, inline="always")
def _move_block(row, i, j, saved, lo, hi):
  """Moves a block of up to 3 tasks (length drawn) starting at i by the shift to j (e.g. an F/B
  pair together). Returns the last position to restore: a block moved left may reach past `hi`;
  those positions are saved too, so that row[lo:hi + 1] = saved[lo:hi + 1] undoes the move."""
  t = row.size
  ln = np.random.randint(2, 4)
  if i < j:
    if i + ln > j:
      ln = j - i
    # Block [i, i+ln) goes to end at j: rotate [i, j] left by ln.
    for _ in range(ln):
      x = row[i]
      for p in range(i, j):
        row[p] = row[p + 1]
      row[j] = x
    return hi
  if ln > t - i:
    ln = t - i
  hi2 = min(i + ln - 1, t - 1)
  saved[lo:hi2 + 1] = row[lo:hi2 + 1]
  # Block [i, i+ln) moves to start at j: rotate [j, i+ln) right by ln.
  for _ in range(ln):
    x = row[hi2]
    for p in range(hi2, j, -1):
      row[p] = row[p - 1]
    row[j] = x
  return max(hi, hi2)


@numba.njit(cache=True, nogil=True, inline="always")
def perturb(row, i, j, saved, lo, hi):
  """Applies one of the three moves to `row` (drawn: swap 25%, block 20%, single task 55%),
  with row[lo:hi + 1] already in `saved`; returns the last position to restore on undo."""
  r = np.random.random()
  if r < 0.25:
    _swap(row, i, j)
  elif r < 0.45:
    hi = _move_block(row, i, j, saved, lo, hi)
  else:
    reinsert(row, i, j)
  return hi


@numba.njit(cache=True, nogil=True)
def feasible_anneal_kernel(order, params, deltas, budget, tails, dev_tails, settings, best,
                           stats):
  """Annealing in place on `order` int8 [N, T], which must be valid and within budget.

  tails: f8 [4, N, M] least time from each task's start to the end (windows.py).
  settings: FeasibleSettings. best: int8 [N, T] receives the best order;
  stats f8 [4] = (makespan, max peak, sum of peaks, sum of finishes) of `best` on entry, updated.
  Returns the number of timed evaluations.
  """
  s = settings
  np.random.seed(s.seed)
  n, t = order.shape
  release, ends, work_f, work_i, work_p = timing_scratch(order, params)
  dur = kind_durations(params)
  peaks = np.zeros(n)
  for d in range(n):
    peaks[d] = row_peak(order[d], deltas)
  ok, mk, sf = simulate_kernel(order, params, release, ends, work_f, work_i, work_p)
  if not ok:
    return 0
  # Late tasks on the latest-finishing device's path are sampled from this list.
  late_d = np.zeros(n * t, dtype=np.int64)
  late_p = np.zeros(n * t, dtype=np.int64)
  scale = 1.0 / (n * t)
  late, nlate = _lateness(order, ends, dur, tails, s.target, late_d, late_p, True)
  cur = mk + s.weight * late * scale
  if s.dev_weight > 0:
    cur += s.dev_weight * _device_lateness(order, ends, dur, dev_tails, s.target) * scale
  evals = 1
  saved = np.empty(t, dtype=np.int8)
  for it in range(s.iters):
    temp = s.temp0 * (s.temp1 / s.temp0) ** (it / s.iters)
    q, d, i, step = draw_move(n, t, s.max_shift, nlate, s.crit_frac)
    if q >= 0:
      d = late_d[q]
      i = late_p[q]
    j = i + step
    if j < 0 or j >= t or order[d, i] == order[d, j]:
      continue
    row = order[d]
    lo = min(i, j)
    hi = max(i, j)
    saved[lo:hi + 1] = row[lo:hi + 1]
    hi = perturb(row, i, j, saved, lo, hi)
    if not _row_ok(row, deltas, budget[d]):
      row[lo:hi + 1] = saved[lo:hi + 1]
      continue
    ok, nmk, nsf = simulate_kernel(order, params, release, ends, work_f, work_i, work_p)
    evals += 1
    if not ok:
      row[lo:hi + 1] = saved[lo:hi + 1]
      continue
    nlat, _ = _lateness(order, ends, dur, tails, s.target, late_d, late_p, False)
    cost = nmk + s.weight * nlat * scale
    if s.dev_weight > 0:
      cost += s.dev_weight * _device_lateness(order, ends, dur, dev_tails, s.target) * scale
    if not metropolis(cost, cur, temp):
      row[lo:hi + 1] = saved[lo:hi + 1]
      continue
    cur = cost
    mk = nmk
    peaks[d] = row_peak(row, deltas)
    _, nlate = _lateness(order, ends, dur, tails, s.target, late_d, late_p, True)
    pmax = peaks.max()
    psum = peaks.sum()
    if lex_better((mk, pmax, psum, nsf), stats, 4):
      stats[0] = mk
      stats[1] = pmax
      stats[2] = psum
      stats[3] = nsf
      best[:] = order
  return evals


def feasible_anneal(problem, order: np.ndarray, iters: int, seed: int, target: float,
                    temp0: float, temp1: float, weight: float = 1000.0, max_shift: int = 8,
                    crit_frac: float = 0.5, best: np.ndarray = None, stats: np.ndarray = None,
                    tails: np.ndarray = None, dev_weight: float = 0.0):
  """One annealing run from `order` (valid, within budget); returns (best, stats, evaluations).

  tails: [4, N, M] per-task tails of the lateness surrogate; None: windows.per_task_tails.

  best / stats (makespan, max peak, sum of peaks, sum of finishes) may carry a better incumbent
  from earlier runs; they are updated in place when this run beats them.
  """
  from rlhfuse_jax.pipeline.evaluate import evaluate
  order = np.ascontiguousarray(order, dtype=np.int8)  # annealed in place
  if tails is None:
    tails = windows.per_task_tails(problem)
  if best is None or stats is None:
    ev = evaluate(problem, order)
    if not (ev.valid and ev.within_budget):
      raise ValueError("feasible_anneal needs a valid start order within the memory budget")
    best = order.copy()
    stats = np.array([ev.makespan, ev.peaks.max(), ev.peaks.sum(), ev.sum_finish])
  settings = FeasibleSettings(
      target=float(target), iters=int(iters), temp0=float(temp0), temp1=float(temp1),
      weight=float(weight), max_shift=int(max_shift), crit_frac=float(crit_frac), seed=int(seed),
      dev_weight=float(dev_weight))
  evals = feasible_anneal_kernel(order, problem.params(), problem.mem_deltas(), problem.budget(),
                                 tails, bounds.device_tails(problem), settings, best, stats)
  return best, stats, evals


kernel_cache.tie(globals())  # before any kernel runs: the cache key covers every kernel file
