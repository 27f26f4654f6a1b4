"""In-budget annealing (feasible_anneal.py) and the count-based, deterministic search budget."""
import os

import numpy as np
import pytest

from rlhfuse_jax.pipeline import bounds, schedule, schedules, search
from rlhfuse_jax.pipeline.evaluate import evaluate
from rlhfuse_jax.pipeline.feasible_anneal import _device_lateness, feasible_anneal, kind_durations
from rlhfuse_jax.pipeline.graph import PipelineProblem

CASES = [
    PipelineProblem(4, 2, 4, 4, 2.0, 1.0),
    PipelineProblem(4, 4, 6, 6, 2.0, 1.0, actor_bwd=3.0, critic_bwd=1.5),
    PipelineProblem(4, 1, 3, 5, 3.0, 1.0, actor_mem=1.0, critic_mem=2.0, transfer_latency=0.5),
]


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_feasible_anneal_never_worse_than_start_and_stays_within_budget(idx):
  p = CASES[idx]
  start = schedules.greedy_order(p)
  ev0 = evaluate(p, start)
  assert ev0.within_budget
  best, stats, evals = feasible_anneal(p, start.copy(), 20000, seed=idx,
                                       target=bounds.tight_lower_bound(p), temp0=1.0, temp1=0.01)
  ev = evaluate(p, best)
  assert evals > 100
  assert ev.valid and ev.within_budget
  assert ev.makespan == stats[0] and ev.peaks.max() == stats[1]
  assert ev.objective() <= ev0.objective()
  assert ev.makespan >= bounds.tight_lower_bound(p)


def test_feasible_anneal_improves_a_tight_budget_case():
  # With a budget of exactly the 1F1B sum the greedy gap-filling schedule is far from the bound;
  # annealing within the budget must find a strictly shorter schedule.
  p = PipelineProblem(4, 4, 6, 6, 2.0, 1.0)
  start = schedules.greedy_order(p)
  best, _, _ = feasible_anneal(p, start.copy(), 50000, seed=0,
                               target=bounds.tight_lower_bound(p), temp0=1.0, temp1=0.01)
  assert evaluate(p, best).makespan < evaluate(p, start).makespan
  assert evaluate(p, best).within_budget


def test_feasible_anneal_rejects_a_start_over_budget():
  p = PipelineProblem(4, 2, 4, 4, 2.0, 1.0)
  over = p.with_budget([1.0] * 4)
  with pytest.raises(ValueError, match="within the memory budget"):
    feasible_anneal(over, schedules.greedy_order(p), 10, 0, 1.0, 1.0, 0.1)


def test_count_based_search_is_deterministic_per_seed():
  p = PipelineProblem(4, 2, 5, 4, 2.0, 1.0)
  cfg = search.SearchConfig(time_budget_s=1e6, seed=3, list_variants=40, max_evaluations=30000,
                            chunk_iters=3000, run_iters=6000)
  a, b = search.search(p, cfg), search.search(p, cfg)
  assert np.array_equal(a.best, b.best)
  assert np.array_equal(a.best_unconstrained, b.best_unconstrained)
  assert a.evaluations == b.evaluations
  ev = evaluate(p, a.best)
  assert ev.valid and ev.within_budget
  assert ev.objective() <= evaluate(p, a.start).objective()


def test_search_config_rejects_bad_counts():
  with pytest.raises(ValueError, match="max_evaluations"):
    search.SearchConfig(max_evaluations=0)
  with pytest.raises(ValueError, match="feasible_frac"):
    search.SearchConfig(feasible_frac=1.5)
  with pytest.raises(ValueError, match="device_lateness_weight"):
    search.SearchConfig(device_lateness_weight=-1.0)


@pytest.mark.parametrize("max_evaluations", [700, 2000, 4321])
def test_count_based_search_ends_near_its_budget(max_evaluations):
  # Budgets that leave a fraction of an evaluation before a phase ends used to round the next
  # chunk down to 0 iterations and loop forever.
  p = PipelineProblem(4, 2, 6, 4, 2.0, 1.0)
  cfg = search.SearchConfig(time_budget_s=1e6, seed=1, list_variants=20,
                            max_evaluations=max_evaluations)
  res = search.search(p, cfg)
  assert res.evaluations <= 2 * max_evaluations + 1000
  assert evaluate(p, res.best).within_budget


def _device_lateness_reference(s, tails, target):
  """Sum over every device's tasks of max(0, start + the device's work from it on + its tail -
  target), from the schedule's task list."""
  tot = 0.0
  for d, tasks in enumerate(s.devices):
    for i, task in enumerate(tasks):
      rest = sum(t.end - t.start for t in tasks[i:])
      tot += max(0.0, task.start + rest + tails[d] - target)
  return tot


def _kernel_device_lateness(s, target):
  p = s.problem
  ends = np.array([[t.end for t in tasks] for tasks in s.devices])
  return _device_lateness(s.order(), ends, kind_durations(p.params()), bounds.device_tails(p),
                          float(target))


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_device_lateness_is_zero_at_the_makespan_and_matches_its_definition(idx):
  # The device term of the in-budget annealing's cost: 0 whenever the target is the makespan
  # (each device's tail is a lower bound on the time after its last task), positive below it,
  # and equal to the sum written out task by task.
  p = CASES[idx]
  for order in (schedules.greedy_order(p), schedules.serial_order(p)):
    s = schedule.from_order(p, order)
    assert _kernel_device_lateness(s, s.makespan) == 0.0
    for target in (s.makespan - 1.0, bounds.tight_lower_bound(p)):
      got = _kernel_device_lateness(s, target)
      assert got == pytest.approx(_device_lateness_reference(s, bounds.device_tails(p), target))
    assert _kernel_device_lateness(s, s.makespan - 1.0) > 0.0


def test_device_lateness_sees_the_idle_unit_of_the_kept_e10_schedules():
  # e10 (uniform budget): the searched 319 idles one unit on device 5, the device whose term is
  # the tight bound 318; the CP-SAT schedule at 318 runs it without a gap (README there).
  root = os.path.join(os.path.dirname(__file__), "..", "experiments", "results", "e10_uniform_cp")
  at_bound = schedule.load(os.path.join(root, "schedule.json"))
  hint = schedule.load(os.path.join(root, "hint_319.json"))
  assert _kernel_device_lateness(at_bound, 318) == 0.0
  assert _kernel_device_lateness(hint, 318) > 0.0
