"""Search for a fused schedule: list-scheduling variants, decoder annealing, order annealing
with a memory penalty, and a memory phase, within a wall-clock budget and a seed.

1. Start pool: the greedy gap-filling schedule, both 1F1B-serial orders, and list schedules
   (schedules.py) over per-model in-flight caps (1F1B's cap x1, x1.5, x2, unbounded; random
   per-device splits of the budget between the two models), a combined memory cap (the budget,
   none, or the budget with a reserve for the other model, which cannot deadlock), priority
   biases towards backwards or one model (negative: GPipe-like), noise and idle windows, on two
   priority bases: the chain tail per (device, kind) and the edge-finding tail of each task
   (windows.py), the latter giving the better starts on most reference instances.
2. Decoder annealing (`decoder_anneal`): annealing over a per-device budget split and per-task
   priorities that a memory-safe list scheduler turns into a schedule; every candidate is within
   budget by construction, and one move changes many positions at once.
3. Order annealing over the per-device kind orders, two kinds of runs. Most runs stay within
   the budget (feasible_anneal.py: moves checked against the budget by prefix sums before they
   are timed; cost = makespan + a lateness surrogate that counts tasks whose start plus
   remaining path, or plus the rest of their own device's work, exceeds the tight bound, so
   progress shows before the makespan moves). The
   others (numba, `anneal_kernel`) penalise memory instead. A move takes one
   task (half the time one on the critical path) and reinserts it up to `max_shift` slots away
   on its device; moves that put a backward before its own forward are skipped. Cost = makespan
   + lam * (memory above budget) + eps * (mean device finish time); lam rises geometrically
   within a run, temperature cools geometrically; restarts alternate between the best feasible
   and the best unconstrained schedule (the rising penalty pulls the latter back within budget).
3b. Repair (`_Phase.repair`), after each penalty run while the best schedule without budget is
   shorter than the best within it: annealing from the former on its memory above budget
   (MODE_OVERFLOW; swap, block and reinsert moves as in feasible_anneal.py, which keep memory
   levels where one move alone would not) with moves above its makespan rejected; a schedule
   that gets within budget becomes the best within budget. Penalty runs find schedules at the
   bound easily (early, at a low penalty weight) but pull them back within budget only at a
   longer makespan; the repair keeps the makespan and fixes the memory instead. Each repair
   starts afresh from that schedule (repairs leave best_any alone: restarting from a stuck repair
   made no progress) and stops when the overflow stalls or is not halved in a quarter of its
   moves (far from the budget, e.g. e7 and e10: 142 -> ~100, such repairs never got there).
   Measured, 20 s, 2-core machine: e8 at its bound 186 on seeds 0-3 (188-190 on each without);
   no reference instance worse over the 12 (docs/schedules.md).
4. Memory phase: annealing on the peaks with the makespan never allowed above the best found.
5. Both directions (`search`): steps 1-4 run on the problem and on its time-reversed mirror
   (graph.time_reversed: forward and backward durations swapped; an order read backwards is a
   schedule of the mirror with the same makespan and peaks). Every heuristic above builds
   schedules from time 0, so the mirror treats the drain as carefully as the warm-up; each phase
   starts from the best schedules of the previous one.
6. Parallel workers (`SearchConfig.workers`): steps 1-5 as independent searches on that many
   cores at once (worker i: seed + i, odd workers with reverse_first flipped), the best kept. The
   runs of one instance differ a lot by seed (e7, 20 s: 330 on 1 of 6 seeds, 334-336 on the
   others), so a second core buys a second draw in the same wall time. By wall clock, a worker
   that ends at the tight bound stops the others (`_STOP`): no makespan can beat it.

Measured on the 12 reference instances: the unconstrained bound is reached easily (by list
scheduling alone on most), while the memory budget is the hard part; order annealing alone
barely moves a schedule that sits at the budget on most devices, decoder annealing helps more.

The best feasible schedule by the lexicographic objective of evaluate.py is returned, with the
best schedule found without the memory budget (the price of the budget is a result).
Deterministic for a given seed up to the wall-clock budget (how many iterations fit); with
`max_evaluations` set, phases are cut by evaluation counts only and the result is deterministic.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import numbers
import os
import time
from typing import Callable, NamedTuple, Optional

import numba
import numpy as np

from rlhfuse_jax.pipeline import kernel_cache, schedules, windows
from rlhfuse_jax.pipeline.bounds import tight_lower_bound
from rlhfuse_jax.pipeline.evaluate import (_PC, Evaluator, objective_key, peaks_kernel,
                                           simulate_kernel)
from rlhfuse_jax.pipeline.decoder import decoder_anneal
from rlhfuse_jax.pipeline.feasible_anneal import (draw_move, feasible_anneal, kind_durations,
                                                  lex_better, metropolis, perturb, reinsert,
                                                  row_peak, timing_scratch)
from rlhfuse_jax.pipeline.graph import PipelineProblem, reverse_order, validate_order


@numba.njit(cache=True, nogil=True)
def _row_valid(row):
  """No backward before its own forward: per-model prefix counts of B never exceed those of F."""
  fa = 0
  fc = 0
  for k in row:
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
def critical_path(order, params, ends, work_p, crit_d, crit_p):
  """Traces the chain of tasks that fixes the makespan back from the last-ending task.

  Each step goes to the predecessor that bound the task's start: the previous task on the same
  device if it ended exactly then, else the task's dependency. Writes (device, position) pairs
  into crit_d / crit_p and returns their number (at least 1: the last-ending task).
  """
  n, t = order.shape
  pc = int(params[_PC])
  dur = kind_durations(params)
  d = 0
  for dd in range(n):
    if ends[dd, t - 1] > ends[d, t - 1]:
      d = dd
  p = t - 1
  cnt = 0
  while True:
    crit_d[cnt] = d
    crit_p[cnt] = p
    cnt += 1
    k = order[d, p]
    s = ends[d, p] - dur[k]
    if s <= 1e-9:
      break
    if p > 0 and abs(ends[d, p - 1] - s) <= 1e-9:
      p -= 1
      continue
    # The dependency bound the start: find it (same micro-batch index m).
    m = 0
    for q in range(p):
      if order[d, q] == k:
        m += 1
    c = pc - 1 - d % pc
    if k == 0:
      nd, nk = d - 1, 0
    elif k == 1:
      nd, nk = (d + 1, 1) if d < n - 1 else (d, 0)
    elif k == 2:
      nd, nk = d + 1, 2
    else:
      nd, nk = (d - 1, 3) if c < pc - 1 else (d, 2)
    if nd < 0 or nd >= n or (k == 2 and c == 0) or (k == 0 and d == 0):
      break
    d = nd
    p = work_p[nk, nd, m]
  return cnt


# What the cost of anneal_kernel counts (AnnealSettings.mem_mode).
MODE_PENALTY = 0   # makespan + lam * (memory above budget) + eps * mean device finish time
MODE_PEAKS = 1     # max peak + mean peak; moves to a makespan above mk_cap are rejected
MODE_OVERFLOW = 2  # memory above budget + eps * mean peak; the same makespan cap


class AnnealSettings(NamedTuple):
  """Settings of one `anneal_kernel` call (a chunk of one cooling schedule), passed to numba as
  one typed struct; build it with `anneal_settings`, which fixes the field types."""
  iters: int        # moves proposed
  temp0: float      # temperature at the first move; cools geometrically towards temp1
  temp1: float
  lam0: float       # MODE_PENALTY: memory penalty weight at the first move, rising towards
  lam1: float       # lam1 geometrically (linearly from 0 when lam0 is 0)
  eps: float        # weight of the tie-breaking term of the cost (see the modes above)
  max_shift: int    # a move reinserts a task at most this many slots away
  mem_mode: int     # MODE_PENALTY, MODE_PEAKS or MODE_OVERFLOW
  mk_cap: float     # makespan cap of MODE_PEAKS and MODE_OVERFLOW
  seed: int         # of numba's np.random, the kernel's only source of randomness
  crit_frac: float  # share of moves that take a task on the critical path


def anneal_settings(iters, temp0, temp1, lam0, lam1, eps, max_shift, mem_mode, mk_cap, seed,
                    crit_frac) -> AnnealSettings:
  """AnnealSettings with every field cast to its type: an int where a float is expected (or a
  numpy scalar type) would make numba compile another copy of the kernel."""
  return AnnealSettings(
      iters=int(iters), temp0=float(temp0), temp1=float(temp1), lam0=float(lam0),
      lam1=float(lam1), eps=float(eps), max_shift=int(max_shift), mem_mode=int(mem_mode),
      mk_cap=float(mk_cap), seed=int(seed), crit_frac=float(crit_frac))


@numba.njit(cache=True, nogil=True, inline="always")
def _temperature(s, frac):
  """Temperature after `frac` of a chunk: geometric from s.temp0 to s.temp1."""
  return s.temp0 * (s.temp1 / s.temp0) ** frac


@numba.njit(cache=True, nogil=True, inline="always")
def _penalty_weight(s, frac):
  """Memory penalty weight after `frac` of a chunk: geometric from s.lam0 to s.lam1, or linear
  from 0 when s.lam0 is 0 (a geometric ramp cannot start at 0)."""
  return s.lam0 * (s.lam1 / s.lam0) ** frac if s.lam0 > 0 else s.lam1 * frac


@numba.njit(cache=True, nogil=True, inline="always")
def _cost(s, lam, mk, sf, over, peaks):
  """Cost in mode s.mem_mode of a schedule with makespan mk, sum of device finish times sf,
  memory above budget `over` and per-device peaks f8 [N]."""
  n = peaks.size
  if s.mem_mode == MODE_PEAKS:
    return peaks.max() + peaks.sum() / n
  if s.mem_mode == MODE_OVERFLOW:
    return over + s.eps * peaks.sum() / n
  return mk + lam * over + s.eps * sf / n


@numba.njit(cache=True, nogil=True)
def _overflow(peaks, budget):
  """Memory above budget, summed over devices."""
  over = 0.0
  for d in range(peaks.size):
    over += max(peaks[d] - budget[d], 0.0)
  return over


@numba.njit(cache=True, nogil=True, inline="always")
def _record_bests(order, over, mk, pmax, psum, sf, best_feas, best_any, stats):
  """Copies `order` into best_feas (if within budget) and / or best_any when it beats them on
  the lexicographic objective; stats as in anneal_kernel."""
  if over <= 1e-9 and lex_better((mk, pmax, psum, sf), stats[1:5], 4):
    stats[0] = 0.0
    stats[1] = mk
    stats[2] = pmax
    stats[3] = psum
    stats[4] = sf
    best_feas[:] = order
  if lex_better((mk, pmax, psum, sf), stats[6:10], 3):  # the sum of finishes breaks no tie here
    stats[5] = over
    stats[6] = mk
    stats[7] = pmax
    stats[8] = psum
    stats[9] = sf
    best_any[:] = order


@numba.njit(cache=True, nogil=True)
def anneal_kernel(order, params, deltas, budget, settings, best_feas, best_any, stats):
  """Simulated annealing in place on `order` int8 [N, T]; settings: AnnealSettings.

  MODE_PENALTY: cost = makespan + lam*overflow + eps*mean finish. MODE_PEAKS: cost = max peak +
  sum of peaks / N with moves that raise the makespan above mk_cap rejected (MODE_OVERFLOW: see
  its constant). best_feas / best_any: int8 [N, T] receive the best schedule within budget /
  without budget; stats f8 [10] holds (feas objective x5, any objective x5), each (overflow,
  makespan, max peak, sum of peaks, sum of finishes), on entry and is updated.
  Returns the number of evaluations.
  """
  s = settings
  np.random.seed(s.seed)
  n, t = order.shape
  release, ends, work_f, work_i, work_p = timing_scratch(order, params)
  crit_d = np.zeros(n * t, dtype=np.int64)
  crit_p = np.zeros(n * t, dtype=np.int64)
  peaks = np.zeros(n)
  peaks_kernel(order, deltas, peaks)
  ok, mk, sf = simulate_kernel(order, params, release, ends, work_f, work_i, work_p)
  if not ok:
    return 0
  ncrit = critical_path(order, params, ends, work_p, crit_d, crit_p)
  over = _overflow(peaks, budget)
  evals = 1
  saved = np.empty(t, dtype=np.int8)
  lam = s.lam0
  cur = _cost(s, lam, mk, sf, over, peaks)
  for it in range(s.iters):
    frac = it / s.iters
    temp = _temperature(s, frac)
    if s.mem_mode == MODE_PENALTY:
      new_lam = _penalty_weight(s, frac)
      cur += (new_lam - lam) * over
      lam = new_lam
    q, d, i, step = draw_move(n, t, s.max_shift, ncrit, s.crit_frac)
    if q >= 0:
      d = crit_d[q]
      i = crit_p[q]
    j = i + step
    if j < 0 or j >= t or order[d, i] == order[d, j]:
      continue
    # Reinsert; undone from `saved` unless valid, timed without deadlock and accepted.
    row = order[d]
    lo = min(i, j)
    hi = max(i, j)
    saved[lo:hi + 1] = row[lo:hi + 1]
    if s.mem_mode == MODE_OVERFLOW:  # swaps and F/B blocks keep memory levels (repair)
      hi = perturb(row, i, j, saved, lo, hi)
    else:
      reinsert(row, i, j)
    if not _row_valid(row):
      row[lo:hi + 1] = saved[lo:hi + 1]
      continue
    old_peak = peaks[d]
    peaks[d] = row_peak(row, deltas)
    new_over = over - max(old_peak - budget[d], 0.0) + max(peaks[d] - budget[d], 0.0)
    ok, nmk, nsf = simulate_kernel(order, params, release, ends, work_f, work_i, work_p)
    evals += 1
    if not ok or (s.mem_mode > MODE_PENALTY and nmk > s.mk_cap + 1e-9):  # deadlock, or capped
      row[lo:hi + 1] = saved[lo:hi + 1]
      peaks[d] = old_peak
      continue
    cost = _cost(s, lam, nmk, nsf, new_over, peaks)
    if not metropolis(cost, cur, temp):
      row[lo:hi + 1] = saved[lo:hi + 1]
      peaks[d] = old_peak
      continue
    ncrit = critical_path(order, params, ends, work_p, crit_d, crit_p)
    cur = cost
    over = new_over
    mk = nmk
    sf = nsf
    _record_bests(order, over, mk, peaks.max(), peaks.sum(), sf, best_feas, best_any, stats)
  return evals


@dataclasses.dataclass(frozen=True)
class SearchConfig:
  """Knobs of the search; defaults were tuned on the 12 reference instances."""
  time_budget_s: float = 20.0
  seed: int = 0
  list_variants: int = 1500         # list-scheduling variants in the start pool
  # At most this fraction of the wall-clock budget for the pool. With max_evaluations the pool
  # is built whole (list_variants schedules, ~430 when there are fewer distinct ones) and its
  # evaluations are counted once it is built, so a count below its size ends the search there.
  pool_time_frac: float = 0.3
  chunk_iters: int = 20000          # annealing iterations per numba call (progress granularity)
  run_iters: int = 200000           # iterations of one annealing run (one cooling schedule)
  max_shift: int = 8                # a move reinserts a task at most this many slots away
  temp0_frac: float = 0.5           # start temperature as a fraction of the smallest duration
  temp1_frac: float = 0.01
  lam0: float = 0.05                # memory penalty weight per unit over budget, start and end
  lam1: float = 50.0
  eps: float = 1e-3                 # weight of mean device finish time (guides through plateaus)
  mem_phase_frac: float = 0.05      # fraction of the budget for the memory phase
  crit_frac: float = 0.5            # fraction of moves that take a task on the critical path
  decoder_frac: float = 0.05        # fraction of the budget for decoder annealing
  feasible_frac: float = 0.75       # share of annealing runs that stay within the budget
  lateness_weight: float = 1000.0   # weight of mean lateness (vs the bound) in those runs
  # Tails of the lateness: "chain" (per device and kind) or "window" (per task). Measured with
  # 3e5 evaluations, seed 0: chain better on e0/e1/e4/e7/e8 (721/384/401/346/202 vs
  # 724/385/406/350/206), so per-task tails help the start pool but not this surrogate.
  lateness_tails: str = "chain"
  # Weight of the device term of that surrogate (feasible_anneal._device_lateness: idle time on
  # a device with no slack against the bound, counted on every task after it); 0 turns it off.
  # 20 s sweep, 2 workers: the bound on 8, 8, 7, 7, 8 of 12 in five sweeps with it, 6-7 of 12
  # in four without (misses with it: e1 374, e6 620-622, e9 608, e10 319, e0 712-713 in two);
  # e9 with 2 seeds each: 608 either way.
  device_lateness_weight: float = 1000.0
  # If set: count-based phases, deterministic per seed. A budget, not an exact cap: the start
  # pool is counted whole once built (above), and each annealing call also counts the
  # evaluation of its start, so a search can pass it by the pool and one per call.
  max_evaluations: Optional[int] = None
  # Share of the budget spent on the time-reversed mirror of the problem (graph.time_reversed:
  # same instance, forward and backward swapped; every heuristic here builds schedules from the
  # start, so the mirror gets the drain as carefully as the warm-up). The two phases run one after
  # the other, the second seeded with the first's best; 0 turns the mirror off. Measured with the
  # 20 s sweep of docs/schedules.md (2-core machine, seed 0), half forward then half mirror vs
  # forward only: better on 6 of 12 reference instances (e9 634 vs 654, e10 340 vs 351, e3 743 vs
  # 748, e11 193 vs 196, e6 632 vs 634, e7 344 vs 346), equal on 4, worse on 2 (e4 396 vs 393,
  # e0 719 vs 717).
  reverse_frac: float = 0.5
  reverse_first: bool = False       # run the mirror first
  direction_rounds: int = 1         # alternate the two directions this many times
  # Repair (step 3b): after each penalty run whose best unconstrained schedule beats the best
  # within budget, this many moves of MODE_OVERFLOW annealing from it (memory above budget, the
  # makespan capped at its own); 0 turns repair off.
  repair_iters: int = 300000
  repair_patience: int = 4          # repair stops after this many chunks without progress
  # Independent searches at once, one per core (step 6): worker 0 in this process, the others
  # in spawned processes (spawn, not fork: the caller may hold jax's threads), each within the
  # same wall-clock budget, less their start-up; with max_evaluations, each worker gets that
  # many (the total is workers x max_evaluations). Worker i: seed + i, and reverse_first
  # flipped for odd i (no effect when reverse_frac is 0). 1: this process only.
  workers: int = 1

  def __post_init__(self):
    # Counts: an integral float (2.0) is the integer, as in SamplingConfig; anything else was
    # truncated (max_evaluations=1.5) or failed later without its name (seed=-1 in numpy,
    # workers=2.0 in range()).
    for name in ("seed", "list_variants", "chunk_iters", "run_iters", "max_shift",
                 "direction_rounds", "repair_iters", "repair_patience", "max_evaluations",
                 "workers"):
      v = getattr(self, name)
      if v is None and name == "max_evaluations":
        continue
      if isinstance(v, bool) or not isinstance(v, numbers.Real) or not float(v).is_integer():
        raise ValueError(f"{name}={v!r} must be an integer")
      object.__setattr__(self, name, int(v))
    if self.seed < 0:  # numpy's default_rng takes none
      raise ValueError(f"seed={self.seed} must be >= 0")
    # (inf: the budget's share used stayed 0, and the search never returned)
    if not 0 < self.time_budget_s < math.inf:
      raise ValueError(f"time_budget_s={self.time_budget_s} must be a finite number > 0")
    if self.max_shift < 1:
      raise ValueError(f"max_shift={self.max_shift} must be >= 1")
    if not 0 <= self.pool_time_frac < 1 or not 0 <= self.mem_phase_frac < 1:
      raise ValueError("pool_time_frac and mem_phase_frac must be in [0, 1)")
    if not 0 <= self.feasible_frac <= 1:
      raise ValueError(f"feasible_frac={self.feasible_frac} must be in [0, 1]")
    # Cooling is geometric and the acceptance divides by the temperature: 0 failed as a
    # ZeroDivisionError in the first annealing run (nan never cooled).
    for name in ("temp0_frac", "temp1_frac"):
      if not 0 < getattr(self, name) < math.inf:
        raise ValueError(f"{name}={getattr(self, name)} must be a finite number > 0")
    # lam0 = 0: the penalty weight rises linearly from 0 (_penalty_weight); a geometric ramp
    # needs lam1 > 0 as well.
    if not (0 <= self.lam0 < math.inf and 0 <= self.lam1 < math.inf
            and (self.lam0 == 0 or self.lam1 > 0)):
      raise ValueError(f"lam0={self.lam0}, lam1={self.lam1}: expected finite weights >= 0 "
                       "(lam1 > 0 when lam0 > 0)")
    for name in ("eps", "lateness_weight"):
      if not 0 <= getattr(self, name) < math.inf:
        raise ValueError(f"{name}={getattr(self, name)} must be a finite number >= 0")
    if not 0 <= self.crit_frac <= 1:
      raise ValueError(f"crit_frac={self.crit_frac} must be in [0, 1]")
    if not 0 <= self.decoder_frac < 1:
      raise ValueError(f"decoder_frac={self.decoder_frac} must be in [0, 1)")
    if not self.device_lateness_weight >= 0:
      raise ValueError(f"device_lateness_weight={self.device_lateness_weight} must be >= 0")
    if self.lateness_tails not in ("window", "chain"):
      raise ValueError(f"lateness_tails={self.lateness_tails!r}; expected 'window' or 'chain'")
    if not 0 <= self.reverse_frac < 1:
      raise ValueError(f"reverse_frac={self.reverse_frac} must be in [0, 1)")
    if self.repair_iters < 0 or self.repair_patience < 1:
      raise ValueError(f"repair_iters={self.repair_iters} must be >= 0 and "
                       f"repair_patience={self.repair_patience} >= 1")
    for name in ("chunk_iters", "run_iters", "direction_rounds"):
      # 0 would never count an evaluation (a count-based search would never end) or search no
      # direction at all.
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.list_variants < 0:
      raise ValueError(f"list_variants={self.list_variants} must be >= 0")
    if self.max_evaluations is not None and self.max_evaluations < 1:
      raise ValueError(f"max_evaluations={self.max_evaluations} must be >= 1 (or None)")
    if self.workers < 1:
      raise ValueError(f"workers={self.workers} must be an integer >= 1")


# While the workers of step 6 search by wall clock: an Event (multiprocessing, shared by the
# workers) that a worker sets when it ends at the tight bound; every other worker's clock then
# reads its budget as spent, so nobody waits for a worker that cannot beat that result. None
# otherwise (one worker, or max_evaluations, where stopping early would make the kept result
# depend on timing).
_STOP = None


def _install_stop(event) -> None:
  """Pool initializer of step 6's spawned workers (an Event travels only by inheritance)."""
  global _STOP
  _STOP = event


class _Budget:
  """Share of the search budget used: elapsed / time_budget_s, or evaluations / max_evaluations
  when that is set (then the wall clock is ignored, so a seed fixes the result). Infinite once
  another worker of step 6 has reached the bound (`_STOP`)."""

  # Iterations of the first kernel call of a timed search, before a rate is measured.
  PROBE_ITERS = 1000

  def __init__(self, config: SearchConfig):
    self.t0 = time.time()
    self.config = config
    self.evaluations = 0
    self._last = None  # (time, iterations) of the last chunk handed out (timed search)
    self._rate = None  # iterations per second, measured from the last chunk

  def used(self) -> float:
    if self.config.max_evaluations is not None:
      return self.evaluations / self.config.max_evaluations
    if _STOP is not None and _STOP.is_set():
      return math.inf  # not 1: a step that runs until used() + its share would never end
    return (time.time() - self.t0) / self.config.time_budget_s

  def chunk(self, until: float, default: int) -> int:
    """Iterations for the next kernel call: at most what is left before `until` in count mode.

    Timed: at most what the last chunk's rate (its iterations over the time to this call) fits
    in the time left before `until`, and in one second (progress and the bound are checked
    between calls). A fixed chunk_iters ran 20,000 moves of 8 x 3,072 tasks in one call, ~6 s,
    so a 5 s search took 12.8 s; small instances run a whole chunk in well under a second and
    are not affected."""
    if self.config.max_evaluations is None:
      now = time.time()
      if self._last is not None and now > self._last[0]:
        self._rate = self._last[1] / (now - self._last[0])
      if self._rate is None:
        n = min(default, self.PROBE_ITERS)
      else:
        left_s = max(0.0, until - self.used()) * self.config.time_budget_s
        n = int(min(default, max(1, math.ceil(self._rate * min(left_s, 1.0)))))
      self._last = (now, n)
      return n
    # ceil: while any budget is left before `until` this returns >= 1, so the caller's loop
    # (which checks used() < until) always progresses; int() could round to 0 forever.
    left = (until - self.used()) * self.config.max_evaluations
    return int(max(0, min(default, math.ceil(left))))


@dataclasses.dataclass
class SearchResult:
  best: np.ndarray                  # [N, T] best order within budget (None if none found)
  best_unconstrained: np.ndarray    # [N, T] best order ignoring the budget
  start: np.ndarray                 # [N, T] best start-pool order within budget
  evaluations: int
  search_s: float
  history: list                     # (seconds, best feasible makespan, best any makespan)


def _key(ev: Evaluator, order: np.ndarray) -> tuple:
  ok, mk, sf = ev.timing(order)
  peaks = ev.peak(order)
  over = float(np.maximum(peaks - ev.budget, 0.0).sum())
  return objective_key(bool(ok), over, float(mk), peaks, float(sf))


def _stats_of(key: tuple) -> np.ndarray:
  return np.array(key[1:], dtype=np.float64)  # (overflow, mk, max peak, sum peaks, sum finish)


def start_pool(problem: PipelineProblem, rng: np.random.Generator, variants: int,
               expired: Callable[[], bool]) -> list[np.ndarray]:
  """Valid orders: greedy, serial orders and list-scheduling variants (see module doc)."""
  pool = [schedules.greedy_order(problem), schedules.serial_order(problem),
          schedules.one_f_one_b_order(problem, "critic")]
  n = problem.num_devices
  # Two priority bases: the chain tail per (device, kind), and the edge-finding tail of every
  # task (windows.py: it also counts the work that must follow on the same device, so it tells
  # micro-batches apart). Measured over 300 random variants on e0..e11, the per-task base gave a
  # better best start on 9 of 12 instances (e.g. e6 636 vs 648, e8 198 vs 204), worse on 1.
  chain = windows.chain_tails_per_task(problem)  # [4, N, M]
  per_task = windows.per_task_tails(problem)  # [4, N, M]
  base_caps = schedules.one_f_one_b_caps(problem)
  budget = problem.budget()
  am, cm = problem.actor_mem, problem.critic_mem
  scale = float(problem.durations().max())
  big = np.full(n, 1 << 30, dtype=np.int64)
  mults = [1.0, 1.5, 2.0, np.inf]
  # (actor cap mult, critic cap mult, memory cap on, actor B bias, critic B bias, model bias,
  # noise, window). Negative backward biases make a model GPipe-like (forwards early, backwards
  # late), which lets it fill the other model's warm-up and drain bubbles.
  structured = []
  for ma in mults:
    for mc in mults:
      for memcap in (True, False):
        for bias_b in (0.0, 2.0):
          for bias_m in (-1.0, 0.0, 1.0):
            structured.append((ma, mc, memcap, bias_b, bias_b, bias_m, 0.0, 0.0))
  for bias_a, bias_c in ((-3.0, 2.0), (2.0, -3.0), (-3.0, 0.0), (0.0, -3.0), (-3.0, -3.0)):
    for bias_m in (-1.0, 0.0, 1.0):
      structured.append((np.inf, np.inf, True, bias_a, bias_c, bias_m, 0.0, 0.0))
  # Cap pairs that trade one model's memory for the other's, each pair within the budget.
  for shift in range(-3, 4):
    structured.append((shift, None, False, 0.0, 0.0, 0.0, 0.0, 0.0))
  structured = [x + (base,) for base in (per_task, chain) for x in structured]
  for v in range(max(variants, len(structured))):
    if expired() and len(pool) > 3:
      break
    if v < len(structured):
      ma, mc, memcap, bias_a, bias_c, bias_m, noise, window, tails = structured[v]
    else:
      # Random variants; a third of them split each device's budget between per-model caps at
      # random (feasible and deadlock-free by construction), a third use the combined budget
      # with a reserve for the other model (also deadlock-free).
      ma, mc = rng.choice(mults), rng.choice(mults)
      memcap = bool(rng.integers(2))
      bias_a, bias_c = float(rng.uniform(-3, 3)), float(rng.uniform(-3, 3))
      bias_m = float(rng.uniform(-2, 2))
      noise, window = float(rng.uniform(0, 1)), float(rng.choice([0.0, 0.0, 0.5, 1.0]))
      tails = chain if rng.random() < 1 / 3 else per_task  # per-task: better starts (above)
      style = v % 3
      if style == 1:
        ma, mc = "split", None
      elif style == 2:
        ma, mc, memcap = np.inf, np.inf, "reserve"
    reserve = memcap == "reserve"
    if mc is None and ma == "split":
      max_a = np.maximum(1, np.floor((budget - cm) / max(am, 1e-12)))
      frac = rng.uniform(0, 1, size=n) if rng.random() < 0.5 else np.full(n, rng.uniform(0, 1))
      caps = np.empty((n, 2), dtype=np.int64)
      caps[:, 0] = np.clip(np.round(1 + frac * (max_a - 1)), 1, problem.actor_microbatches)
      left = budget - caps[:, 0] * am
      caps[:, 1] = np.clip(np.floor(left / max(cm, 1e-12)), 1, problem.critic_microbatches)
      mem_cap = np.full(n, np.inf)
    elif mc is None:  # a memory trade: actor cap shifted by `ma`, critic gets what is left
      caps = base_caps.copy()
      caps[:, 0] = np.clip(base_caps[:, 0] + int(ma), 1, problem.actor_microbatches)
      left = budget - caps[:, 0] * am
      caps[:, 1] = np.clip(np.floor(left / max(cm, 1e-12)), 1, problem.critic_microbatches)
      mem_cap = np.full(n, np.inf)
    else:
      caps = np.empty((n, 2), dtype=np.int64)
      for col, mult in ((0, ma), (1, mc)):
        caps[:, col] = big if math.isinf(mult) else np.maximum(
            1, np.ceil(base_caps[:, col] * mult)).astype(np.int64)
      mem_cap = budget if memcap else np.full(n, np.inf)
    prio = tails.copy()  # [4, N, M]
    prio[1] += bias_a * scale
    prio[3] += bias_c * scale
    prio[:2] += bias_m * scale
    if noise > 0:
      prio += rng.uniform(0, noise * scale, size=prio.shape)
    order = schedules.list_schedule(problem, prio, caps, mem_cap, window * scale, reserve)
    if order is not None:
      pool.append(order)
  return pool


def search(problem: PipelineProblem, config: SearchConfig = SearchConfig(),
           log: Optional[Callable[[str], None]] = None,
           initial: Optional[list[np.ndarray]] = None) -> SearchResult:
  """Best fused schedule within the memory budget found in config.time_budget_s seconds
  (or config.max_evaluations evaluations).

  Two phases, on the problem and on its time-reversed mirror (config.reverse_frac of the
  budget; order by config.reverse_first; config.direction_rounds alternations); each phase starts
  from the best schedules found so far, and the result is the best over all phases, so it is
  never worse than the start or than any phase's result. The search stops early at the bound.
  """
  if config.workers > 1:
    return _search_workers(problem, config, log, initial)
  if config.reverse_frac <= 0:
    return _search_one(problem, config, log, initial)
  t0 = time.time()
  mirror = problem.time_reversed()
  pair = [(mirror, True, config.reverse_frac), (problem, False, 1.0 - config.reverse_frac)]
  if not config.reverse_first:
    pair.reverse()
  k = config.direction_rounds
  phases = [(prob, mirrored, frac / k) for _ in range(k) for prob, mirrored, frac in pair]
  ev = Evaluator(problem)
  seeds = list(initial or []) + [schedules.greedy_order(problem)]
  first, history, evaluations, best_feas, best_any = None, [], 0, None, None
  for i, (prob, mirrored, frac) in enumerate(phases):
    cfg = dataclasses.replace(
        config, reverse_frac=0.0, time_budget_s=config.time_budget_s * frac,
        max_evaluations=(None if config.max_evaluations is None
                         else max(1, int(config.max_evaluations * frac))))
    to_phase = reverse_order if mirrored else (lambda o: o)
    if log:
      log(f"phase {i + 1}/{len(phases)}: {'time-reversed mirror' if mirrored else 'forward'} "
          f"problem, {100 * frac:.0f}% of the budget")
    res = _search_one(prob, cfg, log, [to_phase(o) for o in seeds])
    t_off = time.time() - t0 - res.search_s
    history += [(t + t_off, a, b) for t, a, b in res.history]
    evaluations += res.evaluations
    found = [to_phase(o) for o in (res.best, res.best_unconstrained)]  # an involution
    if first is None:  # the start, judged by this problem's objective (ties differ in mirror)
      first = min([to_phase(res.start)] + seeds[-1:], key=lambda o: _key(ev, o))
    cands = [o for o in (best_feas, found[0], first) if o is not None]
    best_feas = min(cands, key=lambda o: _key(ev, o))
    cands = [o for o in (best_any, found[1], best_feas) if o is not None]
    best_any = min(cands, key=lambda o: _key(ev, o)[2:])
    if _key(ev, best_feas)[2] <= tight_lower_bound(problem) + 1e-9:
      break
    seeds = [best_feas, best_any]
  if log:
    key = _key(ev, best_feas)
    log(f"search done: {time.time() - t0:.1f}s, {evaluations} evaluations in {i + 1} phase(s); "
        f"best {key[2]:g} ({'within' if key[1] == 0 else 'over'} budget), "
        f"unconstrained {_key(ev, best_any)[2]:g}")
  return SearchResult(best=best_feas, best_unconstrained=best_any, start=first,
                      evaluations=evaluations, search_s=time.time() - t0, history=history)


def _worker_config(config: SearchConfig, i: int) -> SearchConfig:
  """Worker i of step 6: its own seed, every other one starting with the mirror."""
  return dataclasses.replace(config, workers=1, seed=config.seed + i,
                             reverse_first=config.reverse_first != bool(i % 2))


# Seconds of a time budget kept back from every worker of step 6: the spawned ones' results come
# back pickled after their last phase, which itself overruns its share by up to ~0.5 s (e6, 20 s).
WORKER_RESERVE_S = 0.3


def _spawned_search(problem: PipelineProblem, config: SearchConfig, t0: float,
                    initial: Optional[list[np.ndarray]]) -> SearchResult:
  """A spawned worker: the budget left of the parent's, counted from t0 (time.time() is one
  clock for every process of the machine)."""
  if config.max_evaluations is None:
    config = dataclasses.replace(
        config, time_budget_s=max(1e-3, config.time_budget_s - (time.time() - t0)))
  warmup()  # compiled kernels from numba's on-disk cache
  res = search(problem, config, None, initial)
  _stop_others_at_bound(problem, res)
  return res


def _stop_others_at_bound(problem: PipelineProblem, res: SearchResult) -> None:
  """Sets `_STOP` (if installed) when `res` is within budget at the tight bound."""
  if _STOP is not None and res.best is not None:
    key = _key(Evaluator(problem), res.best)
    if key[1] == 0 and key[2] <= tight_lower_bound(problem) + 1e-9:
      _STOP.set()


def _search_workers(problem: PipelineProblem, config: SearchConfig,
                    log: Optional[Callable[[str], None]],
                    initial: Optional[list[np.ndarray]]) -> SearchResult:
  """Step 6: config.workers searches at once, the best result (ties: the lowest worker)."""
  t0 = time.time()
  n = config.workers
  cores = os.cpu_count() or 1
  if n > cores and log:  # measured on 2 cores: budget 1 s took 9 s at 8 workers, 29 s at 32
    log(f"workers={n} > this host's {cores} cores: the workers share them, and each spawned "
        "one's start-up (~1 s: imports, compiles) comes on top of the time budget")
  if config.max_evaluations is None:
    config = dataclasses.replace(
        config, time_budget_s=max(1e-3, config.time_budget_s - WORKER_RESERVE_S))
  ctx = multiprocessing.get_context("spawn")
  stop = ctx.Event() if config.max_evaluations is None else None
  # concurrent.futures, not multiprocessing.Pool: a Pool replaces a worker that dies (killed,
  # or one that cannot start: a caller's script without a __main__ guard re-runs itself in it)
  # and never answers its job, so the search waited forever (thousands of tracebacks of
  # restarted workers in the second case); a dead worker here fails its future at once. One
  # executor a worker: an executor that loses one process fails all its futures.
  pools = [concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, initializer=_install_stop,
                                                  initargs=(stop,)) for _ in range(1, n)]
  global _STOP
  try:
    others = [pool.submit(_spawned_search, problem, _worker_config(config, i), t0, initial)
              for i, pool in enumerate(pools, 1)]
    _STOP = stop
    try:
      results = [search(problem, _worker_config(config, 0), log, initial)]
      _stop_others_at_bound(problem, results[0])
    finally:
      _STOP = None
    for i, job in enumerate(others, 1):
      try:
        results.append(job.result())
      except Exception as e:  # noqa: BLE001 a lost worker costs its draw, not the others'
        if log:
          log(f"worker {i} failed ({type(e).__name__}: {e}); keeping the others' results")
  finally:  # results in (or worker 0 interrupted): stop the workers now, do not wait for them
    for pool in pools:
      workers = list((getattr(pool, "_processes", None) or {}).values())
      pool.shutdown(wait=False, cancel_futures=True)
      for w in workers:  # (the executor has no terminate(): its processes, where it lists them)
        if w.is_alive():
          w.terminate()
  ev = Evaluator(problem)
  keys = [_key(ev, r.best) for r in results]
  win = min(range(len(results)), key=lambda i: keys[i])
  best_any = min((r.best_unconstrained for r in results), key=lambda o: _key(ev, o)[2:])
  if log:
    log(f"{len(results)} of {n} workers: best within budget "
        + ", ".join(f"{k[2]:g}" for k in keys) + f"; kept result {win}")
  return SearchResult(best=results[win].best, best_unconstrained=best_any,
                      start=results[0].start, evaluations=sum(r.evaluations for r in results),
                      search_s=time.time() - t0, history=results[win].history)


def _search_one(problem: PipelineProblem, config: SearchConfig,
                log: Optional[Callable[[str], None]] = None,
                initial: Optional[list[np.ndarray]] = None) -> SearchResult:
  """One phase of `search`: start pool, decoder annealing, order annealing, memory phase."""
  return _Phase(problem, config, log).run(initial)


class _Phase:
  """One phase of `search` (one direction), its steps as methods over the phase's state.

  The clock and the rng are shared by every step, in a fixed order of use, so that a seed fixes
  the result; best_feas / best_any / stats are the incumbents, updated in place by the kernels
  (stats f8 [10]: the objective of best_feas, then of best_any, each (overflow, makespan, max
  peak, sum of peaks, sum of finishes), the layout anneal_kernel reads and writes).
  """

  def __init__(self, problem: PipelineProblem, config: SearchConfig,
               log: Optional[Callable[[str], None]]):
    self.problem, self.config, self.log = problem, config, log
    self.clock = _Budget(config)
    self.rng = np.random.default_rng(config.seed)
    self.ev = Evaluator(problem)
    self.params, self.deltas, self.budget = problem.params(), problem.mem_deltas(), problem.budget()
    self.history: list = []  # (seconds, best feasible makespan, best any makespan)
    self.best_feas = self.best_any = self.stats = self.start = None
    self.lb = None

  def run(self, initial: Optional[list[np.ndarray]]) -> SearchResult:
    """Steps 1-4 of the module docstring, from `initial` and the start pool."""
    self.start_from(initial)
    self.anneal()
    self.memory_phase()
    if self.log:
      self.log(f"phase done: {self.elapsed():.1f}s, {self.clock.evaluations} evaluations; best "
               f"within budget {self.stats[1]:g} (max peak {self.stats[2]:g}), unconstrained "
               f"{self.stats[6]:g}, LB {self.lb:g}")
    return SearchResult(best=self.best_feas, best_unconstrained=self.best_any, start=self.start,
                        evaluations=self.clock.evaluations, search_s=self.elapsed(),
                        history=self.history)

  def elapsed(self) -> float:
    return time.time() - self.clock.t0

  def note_progress(self):
    """Appends (seconds, best makespan within budget, best without budget) to the history."""
    self.history.append((self.elapsed(), self.stats[1], self.stats[6]))

  def start_from(self, initial: Optional[list[np.ndarray]]):
    """Steps 1-2: the best schedules of `initial`, the start pool and decoder annealing become
    the incumbents (within budget and without budget) and the phase's start."""
    pool, keys, valid, feas = self._candidates(initial)
    i_feas = min(feas, key=lambda i: keys[i])
    i_any = min(valid, key=lambda i: keys[i][2:])
    self.best_feas = pool[i_feas].copy()
    self.best_any = pool[i_any].copy()
    self.start = self.best_feas.copy()
    self.stats = np.concatenate([_stats_of(keys[i_feas]), _stats_of(keys[i_any])])
    self.lb = tight_lower_bound(self.problem)
    self.note_progress()
    if self.log:
      self.log(f"start pool: {len(pool)} schedules in {self.elapsed():.1f}s; best within budget "
               f"{self.stats[1]:g}, best unconstrained {self.stats[6]:g}, lower bound "
               f"{self.lb:g}")

  def _candidates(self, initial: Optional[list[np.ndarray]]) -> tuple[list, list, list, list]:
    """(orders, their objective keys, indices of the valid ones, of those within budget):
    `initial`, the start pool, and the best schedule of decoder annealing."""
    problem, config, clock = self.problem, self.config, self.clock
    pool = list(initial or []) + start_pool(
        problem, self.rng, config.list_variants, lambda: clock.used() >= config.pool_time_frac)
    pool = [validate_order(problem, o) for o in pool]
    keys = [_key(self.ev, o) for o in pool]
    clock.evaluations += len(pool)
    valid = [i for i, k in enumerate(keys) if k[0] == 0]
    feas = [i for i in valid if keys[i][1] == 0]
    if not feas:  # an explicit budget below the two models' sum: one micro-batch at a time
      last = validate_order(problem, schedules.sequential_order(problem))
      pool.append(last)
      keys.append(_key(self.ev, last))
      clock.evaluations += 1
      valid.append(len(pool) - 1)
      if keys[-1][1] == 0:
        feas.append(len(pool) - 1)
    if not feas:
      need = max(problem.actor_mem, problem.critic_mem)
      raise RuntimeError(f"no schedule fits the memory budget {problem.budget().tolist()}: every "
                         f"device runs a forward of each model, so it needs at least "
                         f"max(actor_mem, critic_mem) = {need:g}")
    if config.decoder_frac > 0:
      dec_order, decodes = decoder_anneal(problem, self.rng, clock,
                                          clock.used() + config.decoder_frac)
      if dec_order is not None:
        pool.append(dec_order)
        keys.append(_key(self.ev, dec_order))
        valid.append(len(pool) - 1)  # also a candidate for the best unconstrained schedule
        feas.append(len(pool) - 1)
        if self.log:
          self.log(f"decoder annealing: {decodes} decodes; best {keys[-1][2]:g}")
    return pool, keys, valid, feas

  def anneal(self):
    """Step 3: annealing runs, each one cooling schedule, until 1 - mem_phase_frac of the budget
    is used or the best schedule within budget reaches the bound."""
    config, stats = self.config, self.stats
    dmin = float(self.problem.durations().min())
    tails = (windows.per_task_tails(self.problem) if config.lateness_tails == "window"
             else windows.chain_tails_per_task(self.problem))
    until = 1.0 - config.mem_phase_frac
    run = 0
    while self.clock.used() < until and stats[1] > self.lb + 1e-9:
      feasible_run, cur = self._run_start(run)
      self._anneal_run(cur, feasible_run, until, dmin, tails)
      if not feasible_run:
        self.repair(until)
      run += 1
      if self.log:
        self.log(f"anneal run {run} ({'within budget' if feasible_run else 'penalty'}): "
                 f"{self.elapsed():.1f}s, {self.clock.evaluations} evaluations; best within "
                 f"budget {stats[1]:g} (max peak {stats[2]:g}), unconstrained {stats[6]:g}, "
                 f"LB {self.lb:g}")

  def _run_start(self, run: int) -> tuple[bool, np.ndarray]:
    """(whether run `run` stays within the budget, a copy of its start schedule).

    Runs within the budget (feasible_frac of them, spread evenly) restart from the best
    feasible schedule; penalty runs alternate between the best feasible and the best
    unconstrained schedule (the rising penalty pulls the latter back within budget).
    """
    frac, stats = self.config.feasible_frac, self.stats
    feasible_run = math.floor((run + 1) * frac) > math.floor(run * frac)
    pen_run = run - math.floor(run * frac)
    from_feas = feasible_run or pen_run % 2 == 0 or stats[6] >= stats[1]
    return feasible_run, (self.best_feas if from_feas else self.best_any).copy()

  def _anneal_run(self, cur: np.ndarray, feasible_run: bool, until: float, dmin: float,
                  tails: np.ndarray):
    """One annealing run in place on `cur`: config.run_iters moves cooling from temp0_frac to
    temp1_frac of the shortest task, in kernel calls of config.chunk_iters (the budget and the
    bound are checked between them)."""
    config, clock = self.config, self.clock
    done = 0
    while done < config.run_iters and clock.used() < until:
      n_it = clock.chunk(until, min(config.chunk_iters, config.run_iters - done))
      if n_it <= 0:
        break
      f0, f1 = done / config.run_iters, (done + n_it) / config.run_iters
      temp_a = config.temp0_frac * dmin * (config.temp1_frac / config.temp0_frac) ** f0
      temp_b = config.temp0_frac * dmin * (config.temp1_frac / config.temp0_frac) ** f1
      seed = int(self.rng.integers(1 << 31))
      if feasible_run:
        n_ev = self._feasible_chunk(cur, n_it, seed, temp_a, temp_b, tails)
      else:
        n_ev = self._penalty_chunk(cur, n_it, seed, temp_a, temp_b, f0, f1)
      clock.evaluations += n_ev
      done += n_it
      self.note_progress()
      if self.stats[1] <= self.lb + 1e-9:
        break

  def _feasible_chunk(self, cur, n_it, seed, temp_a, temp_b, tails) -> int:
    """n_it moves of in-budget annealing (feasible_anneal.py) on `cur`; returns evaluations.

    Its incumbent is best_feas; a new best also becomes best_any when it beats that.
    """
    config, stats = self.config, self.stats
    fstats = stats[1:5].copy()
    _, fstats, n_ev = feasible_anneal(self.problem, cur, n_it, seed, self.lb, temp_a, temp_b,
                                      config.lateness_weight, config.max_shift,
                                      config.crit_frac, self.best_feas, fstats, tails,
                                      config.device_lateness_weight)
    stats[1:5] = fstats
    if stats[1] < stats[6] - 1e-9 or (stats[1] <= stats[6] + 1e-9 and stats[2] < stats[7]):
      self.best_any[:] = self.best_feas
      stats[5:10] = stats[0:5]
    return n_ev

  def _penalty_chunk(self, cur, n_it, seed, temp_a, temp_b, f0, f1) -> int:
    """n_it moves of penalty annealing on `cur`, the penalty weight rising from where the run
    stands (f0) to f1 of its lam0 -> lam1 ramp; returns evaluations."""
    config = self.config

    def lam(f):  # the run's ramp at f, as _penalty_weight has it (linear from 0 when lam0 = 0)
      if config.lam0 > 0:
        return config.lam0 * (config.lam1 / config.lam0) ** f
      return config.lam1 * f
    lam_a, lam_b = lam(f0), lam(f1)
    settings = anneal_settings(
        iters=n_it, temp0=temp_a, temp1=temp_b, lam0=lam_a, lam1=lam_b, eps=config.eps,
        max_shift=config.max_shift, mem_mode=MODE_PENALTY, mk_cap=0.0, seed=seed,
        crit_frac=config.crit_frac)
    return anneal_kernel(cur, self.params, self.deltas, self.budget, settings, self.best_feas,
                         self.best_any, self.stats)

  def repair(self, until: float):
    """Step 3b: when the best schedule without budget is shorter than the best within it, anneal
    its memory above budget down with its makespan as a cap (MODE_OVERFLOW, swap / block /
    reinsert moves); a schedule that gets within budget becomes the best within budget. Stops
    early when config.repair_patience chunks in a row lower the overflow no further, or when a
    quarter of the moves have not halved it."""
    config, clock, stats = self.config, self.clock, self.stats
    if config.repair_iters <= 0 or not stats[6] < stats[1] - 1e-9:
      return
    cur = self.best_any.copy()
    mk_cap = float(stats[6])
    unit = float(min(self.problem.actor_mem, self.problem.critic_mem)) or 1.0
    over0 = best_over = self._overflow(cur)
    # best_any is left as it is (repair only lowers its peaks): every repair from it is a fresh
    # try; letting repairs replace it made the next ones restart from a stuck local minimum.
    scratch, rstats = self.best_any.copy(), stats.copy()
    done = stale = 0
    while (done < config.repair_iters and clock.used() < until and stats[1] > mk_cap + 1e-9
           and stale < config.repair_patience):
      n_it = clock.chunk(until, min(config.chunk_iters, config.repair_iters - done))
      if n_it <= 0:
        break
      f0, f1 = done / config.repair_iters, (done + n_it) / config.repair_iters
      settings = anneal_settings(
          iters=n_it, temp0=0.5 * unit * 0.02 ** f0, temp1=0.5 * unit * 0.02 ** f1, lam0=0.0,
          lam1=0.0, eps=config.eps, max_shift=config.max_shift, mem_mode=MODE_OVERFLOW,
          mk_cap=mk_cap, seed=int(self.rng.integers(1 << 31)), crit_frac=0.0)
      clock.evaluations += anneal_kernel(cur, self.params, self.deltas, self.budget, settings,
                                         self.best_feas, scratch, rstats)
      stats[0:5] = rstats[0:5]
      done += n_it
      over = self._overflow(cur)
      stale = 0 if over < best_over - 1e-9 else stale + 1
      best_over = min(best_over, over)
      self.note_progress()
      if 4 * done >= config.repair_iters and best_over > 0.5 * over0:
        break  # too slow: measured, such repairs never got within budget (e.g. e7, e10)
    if self.log:
      self.log(f"repair at makespan {mk_cap:g}: {self.elapsed():.1f}s, {done} moves, overflow "
               f"{over0:g} -> {best_over:g}; best within budget {stats[1]:g}")

  def _overflow(self, order: np.ndarray) -> float:
    return float(_overflow(self.ev.peak(order), self.budget))

  def memory_phase(self):
    """Step 4: to the end of the budget, lower the peaks of the best schedule within budget
    without raising its makespan (MODE_PEAKS, each chunk restarted from the best)."""
    config, clock = self.config, self.clock
    while clock.used() < 1.0:
      n_it = clock.chunk(1.0, config.chunk_iters)
      if n_it <= 0:
        break
      cur = self.best_feas.copy()
      seed = int(self.rng.integers(1 << 31))
      settings = anneal_settings(
          iters=n_it, temp0=0.5, temp1=0.01, lam0=0.0, lam1=0.0, eps=0.0,
          max_shift=config.max_shift, mem_mode=MODE_PEAKS, mk_cap=self.stats[1], seed=seed,
          crit_frac=0.0)
      clock.evaluations += anneal_kernel(cur, self.params, self.deltas, self.budget, settings,
                                         self.best_feas, self.best_any, self.stats)
      self.note_progress()


# For the log line before a search or `warmup`: the compile is silent, minutes on a busy machine
# (162 s for schedule_search's first run of a fresh checkout on the 2-core dev machine at load
# 12; 0.2 s once cached).
KERNELS_NOTE = ("a first run of a checkout compiles the search's numba kernels first, a minute "
                "or more, then caches them on disk")


def warmup() -> float:
  """Compiles (or loads from numba's cache) every kernel on a tiny instance; returns seconds.

  Call before timing a search so that compilation is not charged to its budget.
  """
  t0 = time.time()
  # A problem whose start does not meet its bound, with memory, searched for a count of
  # evaluations: a tiny one met its bound at once and never annealed, so the annealer and the
  # kernels it calls compiled inside the first real search's budget (3.7 s of a 0.3 s budget,
  # 1600 evaluations against 21000 once cached, 2026-12-06). Its search also runs every kernel
  # the tiny one's did (the same signatures).
  small = PipelineProblem(actor_pp=4, critic_pp=2, actor_microbatches=8, critic_microbatches=4,
                          actor_fwd=1.0, critic_fwd=1.7, actor_bwd=2.1, critic_bwd=3.3,
                          actor_mem=1.0, critic_mem=1.0)
  search(small, SearchConfig(time_budget_s=60.0, max_evaluations=2000, list_variants=2,
                             chunk_iters=10, run_iters=10))
  tiny = PipelineProblem(actor_pp=2, critic_pp=1, actor_microbatches=2, critic_microbatches=2,
                         actor_fwd=1.0, critic_fwd=1.0)
  feasible_anneal(tiny, schedules.greedy_order(tiny), 10, 0, tight_lower_bound(tiny), 1.0, 0.1)
  return time.time() - t0


kernel_cache.tie(globals())  # before any kernel runs: the cache key covers every kernel file
