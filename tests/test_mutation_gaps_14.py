"""Pins the survivors of a mutation audit of pipeline/feasible_anneal, decoder, schedules,
evaluate and exact/grow: each test fails under a plausible bug that the rest of the suite let
through, and checks against an independent reference (a plain-python re-evaluation, hand
values, or the definition in the module's docstring)."""
import itertools

import numba
import numpy as np
import pytest

from rlhfuse_jax.pipeline import bounds, decoder, feasible_anneal, schedules
from rlhfuse_jax.pipeline.evaluate import Evaluation, evaluate, objective_key
from rlhfuse_jax.pipeline.exact import grow
from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF, PipelineProblem

# Tiny instances: latency, unequal durations and memory, several critic replicas.
_PROBLEMS = [
    PipelineProblem(2, 2, 2, 3, 1.0, 2.0, actor_bwd=3.0, critic_bwd=2.5, actor_mem=1.5,
                    critic_mem=0.5, transfer_latency=0.25),
    PipelineProblem(3, 1, 2, 2, 2.0, 1.0, transfer_latency=0.5),
    PipelineProblem(4, 2, 2, 3, 1.0, 1.5, actor_bwd=2.5, transfer_latency=0.75),
]


# Evaluation against a plain-python list scheduler -----------------------------------------------

def _predecessor(p, kind, d, m):
  """(kind, device, micro-batch) of the task's one dependency, or None: graph.py's rules through
  the problem's own placement helpers (critic_device), not the kernel's index arithmetic."""
  n = p.num_devices
  if kind == AF:
    return (AF, d - 1, m) if d > 0 else None
  if kind == AB:
    return (AB, d + 1, m) if d < n - 1 else (AF, d, m)
  stage, replica = p.critic_stage(d), p.critic_replica(d)
  if kind == CF:
    return (CF, p.critic_device(replica, stage - 1), m) if stage > 0 else None
  if stage < p.critic_pp - 1:
    return (CB, p.critic_device(replica, stage + 1), m)
  return (CF, d, m)


def _reference(p, order, release=(0.0, 0.0)):
  """(starts [N, T], makespan, sum of finishes, peaks [N]) or None on deadlock, in python."""
  n, t = order.shape
  end = {}
  starts = np.zeros((n, t))
  free = [0.0] * n
  pos = [0] * n
  seen = [[0] * 4 for _ in range(n)]
  while any(q < t for q in pos):
    progress = False
    for d in range(n):
      while pos[d] < t:
        k = int(order[d, pos[d]])
        m = seen[d][k]
        pred = _predecessor(p, k, d, m)
        ready = 0.0
        if pred is not None:
          if pred not in end:
            break
          ready = end[pred] + (p.transfer_latency if pred[1] != d else 0.0)
        s = max(free[d], ready, release[k // 2])
        starts[d, pos[d]] = s
        end[(k, d, m)] = free[d] = s + p.duration(k)
        seen[d][k] += 1
        pos[d] += 1
        progress = True
    if not progress:
      return None
  mem = [p.actor_mem, -p.actor_mem, p.critic_mem, -p.critic_mem]
  peaks = np.array([max(np.cumsum([mem[k] for k in row]).max(), 0.0) for row in order])
  return starts, max(free), sum(free), peaks


def _orders(p, count=6, seed=0):
  """The constructive orders and a few list-scheduled ones with random priorities."""
  rng = np.random.default_rng(seed)
  out = [schedules.serial_order(p), schedules.greedy_order(p), schedules.sequential_order(p),
         schedules.one_f_one_b_order(p, "critic")]
  n = p.num_devices
  while len(out) < 4 + count:
    o = schedules.list_schedule(p, rng.uniform(0, 10, size=(n, 4)), np.full((n, 2), 8),
                                np.full(n, np.inf), float(rng.uniform(0, 2)))
    if o is not None:
      out.append(o)
  return out


@pytest.mark.parametrize("idx", range(len(_PROBLEMS)))
def test_evaluator_times_and_peaks_match_a_plain_python_list_scheduler(idx):
  # Every dependency kind, with its latency across devices, the critic's reversed placement, the
  # release times and the running-memory peaks, on orders of every constructive kind.
  p = _PROBLEMS[idx]
  for order in _orders(p):
    for release in ((0.0, 0.0), (1.5, 0.0), (0.0, 2.25)):
      want = _reference(p, order, release)
      ev = evaluate(p, order, release)
      assert want is not None and ev.valid
      starts, makespan, sum_finish, peaks = want
      np.testing.assert_allclose(ev.starts, starts, atol=1e-9)
      np.testing.assert_allclose(ev.ends, starts + p.durations()[order.astype(int)], atol=1e-9)
      assert ev.makespan == pytest.approx(makespan)
      assert ev.sum_finish == pytest.approx(sum_finish)
      np.testing.assert_allclose(ev.peaks, peaks)


def test_evaluation_overflow_sums_devices_and_a_peak_at_the_budget_is_within_it():
  ev = Evaluation(valid=True, makespan=10.0, sum_finish=25.0, peaks=np.array([5.0, 3.0, 4.0]),
                  budget=np.array([3.0, 3.0, 3.0]), starts=None, ends=None, work=6.0)
  assert ev.overflow == 3.0  # 2 + 0 + 1 over the three devices
  assert not ev.within_budget
  assert ev.bubble == pytest.approx(0.4)  # 1 - 6 / 10
  at = Evaluation(valid=True, makespan=10.0, sum_finish=25.0, peaks=np.array([3.0, 3.0]),
                  budget=np.array([3.0, 3.0]), starts=None, ends=None, work=10.0)
  assert at.within_budget and at.overflow == 0.0 and at.bubble == 0.0


def test_objective_breaks_a_tie_on_everything_else_by_the_sum_of_finishes():
  peaks = np.array([2.0, 1.0])
  assert objective_key(True, 0.0, 10.0, peaks, 17.0) < objective_key(True, 0.0, 10.0, peaks, 18.0)


# In-budget annealing (feasible_anneal.py) --------------------------------------------------------

def _rows(p):
  """Every row of one device: each kind's count, no backward before its model's forward."""
  base = ([AF, AB] * p.actor_microbatches) + ([CF, CB] * p.critic_microbatches)
  out = set()
  for perm in set(itertools.permutations(base)):
    held = [0, 0]
    ok = True
    for k in perm:
      held[k // 2] += 1 if k % 2 == 0 else -1
      ok = ok and held[k // 2] >= 0
    if ok:
      out.add(perm)
  return sorted(out)


def test_feasible_anneal_reaches_the_brute_force_lexicographic_optimum_past_the_makespan():
  # Two devices, 30 possible rows each: every makespan-optimal schedule ties at 18, so only the
  # later levels (max peak, sum of peaks, sum of finishes) can improve on the worst of them; the
  # annealer keeps the best by the whole objective, i.e. the brute-force minimum.
  p = PipelineProblem(2, 1, 2, 1, 2.0, 1.0, memory_budget=(10.0,))
  keys = {}
  for combo in itertools.product(_rows(p), repeat=2):
    ev = evaluate(p, np.array(combo, np.int8))
    if ev.valid and ev.within_budget:
      keys[combo] = ev.objective()
  best_key = min(keys.values())
  start = max((k, c) for c, k in keys.items() if k[2] == best_key[2])[1]
  assert keys[start] > best_key
  best, stats, _ = feasible_anneal.feasible_anneal(
      p, np.array(start, np.int8), 3000, seed=0, target=bounds.tight_lower_bound(p), temp0=1.0,
      temp1=0.01)
  ev = evaluate(p, best)
  assert ev.objective() == best_key
  np.testing.assert_allclose(stats, [ev.makespan, ev.peaks.max(), ev.peaks.sum(), ev.sum_finish])


@pytest.mark.parametrize("idx", range(len(_PROBLEMS)))
def test_feasible_anneal_stats_are_those_of_the_returned_best_which_is_its_own_copy(idx):
  # stats = (makespan, max peak, sum of peaks, sum of finishes) of `best`, all four of them; the
  # start is annealed in place, so `best` must be a separate buffer holding the best order seen.
  p = _PROBLEMS[idx]
  start = schedules.greedy_order(p)
  work = start.copy()
  ev0 = evaluate(p, start)
  best, stats, evals = feasible_anneal.feasible_anneal(
      p, work, 4000, seed=idx, target=bounds.tight_lower_bound(p), temp0=2.0, temp1=0.01)
  assert evals > 1 and not np.shares_memory(best, work)
  ev = evaluate(p, best)
  assert ev.valid and ev.within_budget and ev.objective() <= ev0.objective()
  np.testing.assert_allclose(stats, [ev.makespan, ev.peaks.max(), ev.peaks.sum(), ev.sum_finish])
  # The annealed order itself stays a valid order within the budget (every rejected or
  # infeasible move undone).
  ev_work = evaluate(p, work)
  assert ev_work.valid and ev_work.within_budget


def test_feasible_anneal_without_moves_returns_the_start_and_its_stats():
  p = _PROBLEMS[0]
  start = schedules.greedy_order(p)
  ev = evaluate(p, start)
  best, stats, evals = feasible_anneal.feasible_anneal(p, start.copy(), 0, seed=0, target=1.0,
                                                       temp0=1.0, temp1=0.1)
  assert evals == 1 and best.tolist() == start.tolist()
  assert stats.tolist() == [ev.makespan, ev.peaks.max(), ev.peaks.sum(), ev.sum_finish]


def test_feasible_anneal_passes_the_device_lateness_weight_to_its_cost():
  # The same seed proposes the same moves; a device-lateness term in the cost (positive while
  # the greedy start sits above the tight bound) changes which of them are accepted, so the
  # walk (the order annealed in place, the evaluations) differs from the run without it.
  p = PipelineProblem(4, 4, 6, 6, 2.0, 1.0)
  start = schedules.greedy_order(p)
  target = bounds.tight_lower_bound(p)
  assert evaluate(p, start).makespan > target
  walks = []
  for weight in (0.0, 200.0):
    work = start.copy()
    _, _, evals = feasible_anneal.feasible_anneal(p, work, 3000, seed=0, target=target,
                                                  temp0=1.0, temp1=0.01, dev_weight=weight)
    walks.append((evals, work.tolist()))
  assert walks[0] != walks[1]


def test_row_ok_checks_the_running_memory_and_each_backward_after_its_forward():
  p = PipelineProblem(2, 2, 1, 1, 1.0, 1.0, actor_mem=2.0, critic_mem=1.0)
  deltas = p.mem_deltas()
  row_ok = feasible_anneal._row_ok  # pylint: disable=protected-access

  def ok(kinds, budget):
    return row_ok(np.array(kinds, np.int8), deltas, budget)
  assert ok([AF, CF, CB, AB], 3.0)       # holds 2 + 1 at most: exactly the budget
  assert not ok([AF, CF, CB, AB], 2.9)
  assert ok([AF, AB, CF, CB], 2.0)
  assert not ok([CF, AF, AB, CB], 2.9)   # over at the second task, back under later
  assert not ok([AB, AF, CF, CB], 9.0)   # actor backward before its forward
  assert not ok([AF, CB, CF, AB], 9.0)   # critic backward before its forward
  assert feasible_anneal.row_peak(np.array([CF, AF, AB, CB], np.int8), deltas) == 3.0


@numba.njit
def _seed(seed):
  """Seeds numba's np.random, which _move_block draws its block length from."""
  np.random.seed(seed)


def _block_move(t, i, j, seed):
  """Runs _move_block on 0..t-1 with row[lo:hi + 1] saved as the kernel does; returns (moved
  row, row after undoing row[lo:h + 1] = saved[lo:h + 1] with h the position it returns)."""
  _seed(seed)
  row = np.arange(t, dtype=np.int8)
  lo, hi = min(i, j), max(i, j)
  saved = np.full(t, -1, np.int8)
  saved[lo:hi + 1] = row[lo:hi + 1]
  h = feasible_anneal._move_block(row, i, j, saved, lo, hi)  # pylint: disable=protected-access
  moved = row.copy()
  row[lo:h + 1] = saved[lo:h + 1]
  return moved, row


def test_move_block_moves_two_or_three_tasks_by_the_shift_and_undoes_exactly():
  t = 7
  for i in range(t):
    for j in range(t):
      if i == j:
        continue
      want = []
      for ln in (2, 3):  # the block [i, i + ln), clipped to the row and (moving right) to j - i
        ln = min(ln, j - i) if i < j else min(ln, t - i)
        rest = [x for x in range(t) if not i <= x < i + ln]
        at = j - ln + 1 if i < j else j  # moving right the block ends at j, left starts at j
        want.append(rest[:at] + list(range(i, i + ln)) + rest[at:])
      for seed in range(6):
        moved, undone = _block_move(t, i, j, seed)
        assert moved.tolist() in want, (i, j, seed)
        assert undone.tolist() == list(range(t)), (i, j, seed)


def test_draw_move_shifts_either_way_by_one_to_max_shift_slots():
  # A move takes a task 1..max_shift slots before or after (module docstring), any task of the
  # [n, t] or, with probability cand_frac, candidate q of the list (device and position -1).
  _seed(0)
  draws = [feasible_anneal.draw_move(3, 5, 3, 0, 0.5) for _ in range(600)]
  assert {q for q, _, _, _ in draws} == {-1}
  assert {(d, i) for _, d, i, _ in draws} == {(d, i) for d in range(3) for i in range(5)}
  assert {step for _, _, _, step in draws} == {-3, -2, -1, 1, 2, 3}
  cand = [feasible_anneal.draw_move(3, 5, 2, 4, 1.0) for _ in range(200)]
  assert {(q, d, i) for q, d, i, _ in cand} == {(q, -1, -1) for q in range(4)}
  assert {step for _, _, _, step in cand} == {-2, -1, 1, 2}


def test_lex_better_decides_at_the_first_level_that_differs():
  # (makespan, max peak, sum of peaks, sum of finishes): a longer schedule never wins on its
  # peaks, ties within 1e-9 are no improvement, and only the first `levels` entries count.
  lex = feasible_anneal.lex_better
  old = np.array([10.0, 4.0, 8.0, 30.0])
  assert lex(np.array([9.0, 9.0, 9.0, 99.0]), old, 4)
  assert not lex(np.array([11.0, 1.0, 1.0, 1.0]), old, 4)
  assert lex(np.array([10.0, 3.0, 9.0, 31.0]), old, 4)
  assert not lex(np.array([10.0, 5.0, 1.0, 1.0]), old, 4)
  assert lex(np.array([10.0, 4.0, 8.0, 29.0]), old, 4)
  assert not lex(np.array([10.0, 4.0, 8.0, 29.0]), old, 3)
  assert not lex(old + 1e-10, old, 4) and not lex(old - 1e-10, old, 4)


# Decoder annealing (decoder.py) ------------------------------------------------------------------

class _CountingClock:
  """The search clock's interface: `evaluations` counted by the caller, used() the share of a
  budget of `limit` decodes (counted here, so a caller that forgets to count still stops)."""

  def __init__(self, limit):
    self.evaluations = 0
    self.decoded = 0
    self.limit = limit

  def used(self):
    return self.decoded / self.limit


@pytest.mark.parametrize("args, seed", [((3, 1, 3, 3, 2.0, 1.0), 1), ((4, 2, 3, 3, 1.0, 1.0), 1)])
def test_decoder_anneal_returns_the_cheapest_decoded_order_and_counts_every_decode(
    monkeypatch, args, seed):
  # Cost of a decoded order: makespan + 1e-3 x sum of finishes / N. Every decode is a list
  # scheduling call; the best over all of them (restarts and annealing) is what comes back.
  p = PipelineProblem(*args, transfer_latency=0.25)
  clock = _CountingClock(150)
  decoded = []
  real = schedules.list_schedule

  def recording(*args, **kw):
    clock.decoded += 1
    order = real(*args, **kw)
    if order is not None:
      decoded.append(order.copy())
    return order
  monkeypatch.setattr(schedules, "list_schedule", recording)
  best, decodes = decoder.decoder_anneal(p, np.random.default_rng(seed), clock, until=1.0,
                                         restarts=12)
  assert decodes == clock.evaluations == clock.decoded >= 150
  costs = []
  for order in decoded:
    ev = evaluate(p, order)
    assert ev.valid and ev.within_budget
    costs.append(ev.makespan + 1e-3 * ev.sum_finish / p.num_devices)
  assert len(set(np.round(costs, 9))) > 1  # the decodes differ, so the choice matters
  ev = evaluate(p, best)
  assert ev.makespan + 1e-3 * ev.sum_finish / p.num_devices == pytest.approx(min(costs),
                                                                              abs=1e-9)


def test_decoder_anneal_returns_nothing_rather_than_an_order_over_a_budget_below_both_models():
  # A budget of one micro-batch of the larger model (sequential_order fits it) leaves no room
  # for a cap of one micro-batch per model: no decodable state, so nothing comes back.
  p = PipelineProblem(2, 2, 2, 2, 2.0, 1.0, memory_budget=(2.5,))
  assert evaluate(p, schedules.sequential_order(p)).within_budget
  clock = _CountingClock(30)
  clock.used = lambda: clock.evaluations / clock.limit
  best, decodes = decoder.decoder_anneal(p, np.random.default_rng(0), clock, until=1.0,
                                         restarts=5)
  assert best is None and decodes == 5


# List scheduling (schedules.py) ------------------------------------------------------------------

def _held(order, model):
  """[N] most micro-batches of `model` (0 actor, 1 critic) in flight on each device."""
  f, b = 2 * model, 2 * model + 1
  return np.cumsum((order == f).astype(int) - (order == b), axis=1).max(axis=1)


def test_sequential_order_holds_one_micro_batch_at_a_time():
  # F, B, F, B, ...: the actor's micro-batches, then the critic's, each backed before the next
  # forward, so a device never holds more than the larger model's one micro-batch.
  p = PipelineProblem(2, 2, 2, 3, 1.0, 1.0, actor_mem=2.0, critic_mem=3.0)
  row = [AF, AB, AF, AB, CF, CB, CF, CB, CF, CB]
  assert schedules.sequential_order(p).tolist() == [row, row]
  np.testing.assert_allclose(evaluate(p, schedules.sequential_order(p)).peaks, [3.0, 3.0])


def test_list_schedule_keeps_each_models_in_flight_cap_and_the_memory_cap():
  rng = np.random.default_rng(1)
  p = PipelineProblem(3, 3, 4, 4, 1.0, 1.0, actor_mem=2.0, critic_mem=1.0)
  n = p.num_devices
  got = 0
  for _ in range(40):
    caps = rng.integers(1, 4, size=(n, 2))
    mem_cap = rng.uniform(3.0, 8.0, size=n)
    order = schedules.list_schedule(p, rng.uniform(0, 10, size=(n, 4)), caps, mem_cap,
                                    float(rng.uniform(0, 2)), reserve=True)
    if order is None:
      continue
    got += 1
    assert np.all(_held(order, 0) <= caps[:, 0]) and np.all(_held(order, 1) <= caps[:, 1])
    assert np.all(evaluate(p, order).peaks <= mem_cap + 1e-9)
  assert got >= 20


def test_list_schedule_window_lets_a_device_wait_for_a_higher_priority_task():
  # Device 1 (actor stage 1, critic stage 0): its critic forward is ready at 0, its actor
  # forward at 1 (after device 0's). With no window the device starts what is ready; with a
  # window of 2 it idles one unit for the actor forward, which has the higher priority.
  p = PipelineProblem(2, 2, 1, 1, 1.0, 1.0)
  prio = np.array([[10.0, 0.0, 1.0, 0.0]] * 2)
  caps, no_cap = np.full((2, 2), 4), np.full(2, np.inf)
  assert schedules.list_schedule(p, prio, caps, no_cap, 0.0)[1, 0] == CF
  assert schedules.list_schedule(p, prio, caps, no_cap, 2.0)[1, 0] == AF
  # Lower priority of the actor forward: the critic forward goes first whatever the window.
  low = np.array([[10.0, 0.0, 1.0, 0.0], [0.5, 0.0, 1.0, 0.0]])
  assert schedules.list_schedule(p, low, caps, no_cap, 2.0)[1, 0] == CF


# Growing a schedule (exact/grow.py) -------------------------------------------------------------

@pytest.mark.parametrize("args, model, extra", [
    ((4, 2, 8, 6, 2.0, 1.0), "critic", 2), ((2, 2, 3, 3, 1.0, 1.0), "actor", 1),
    ((3, 3, 4, 2, 1.0, 1.0), "actor", 2)])
def test_insert_pairs_takes_the_first_cut_in_its_documented_order(args, model, extra):
  # The docstring's order: time ascending from 0 in steps of the smallest duration, then slopes
  # -3f .. 3f, then "FB" before "BF"; a cut at (time, slope) puts the pairs before the first
  # task of device d that starts at or after time + slope * d. The first cut that keeps the
  # schedule valid, within budget and at most extra * (f + b) longer is the one taken.
  p = PipelineProblem(*args)
  order = schedules.one_f_one_b_order(p, model)
  ev0 = evaluate(p, order)
  fwd, bwd = (AF, AB) if model == "actor" else (CF, CB)
  f, b = p.duration(fwd), p.duration(bwd)
  big = PipelineProblem(*args[:2], args[2] + extra * (model == "actor"),
                        args[3] + extra * (model == "critic"), *args[4:])
  step = min(p.durations())
  want = None
  for i in range(int(ev0.makespan / step) + 1):
    for slope in [k * f for k in range(-3, 4)]:
      pos = tuple(int(np.sum(ev0.starts[d] < i * step + slope * d - 1e-9))
                  for d in range(p.num_devices))
      for label, pair in (("FB", [fwd, bwd]), ("BF", [bwd, fwd])):
        grown = np.array([list(order[d, :q]) + pair * extra + list(order[d, q:])
                          for d, q in enumerate(pos)], np.int8)
        ev = evaluate(big, grown)
        if ev.valid and ev.within_budget and ev.makespan <= ev0.makespan + extra * (f + b):
          want = (i * step, slope, label, pos)
          break
      if want:
        break
    if want:
      break
  _, _, cut = grow.insert_pairs(p, order, model, extra)
  assert (cut.time, cut.slope, cut.block, cut.positions) == want


def test_check_grows_refuses_one_micro_batch_fewer_and_accepts_the_same_problem():
  small = PipelineProblem(4, 2, 4, 3, 2.0, 1.0)
  assert grow.check_grows(small, small) == (0, 0)
  with pytest.raises(ValueError, match="critic_microbatches: 3 -> 2; a schedule can only grow"):
    grow.check_grows(small, PipelineProblem(4, 2, 5, 2, 2.0, 1.0))
  # The default budget follows the 1F1B peaks, min(P - s, M): 2 actor micro-batches hold less
  # than 5 on the first stages, so that budget changes with the growth, which is refused.
  with pytest.raises(ValueError, match="memory budgets differ"):
    grow.check_grows(PipelineProblem(4, 2, 2, 3, 2.0, 1.0), PipelineProblem(4, 2, 5, 3, 2.0, 1.0))
