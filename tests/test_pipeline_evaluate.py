"""Evaluation of fused schedules: hand-computed cases, 1F1B formula, deadlocks, memory, errors."""
import numpy as np
import pytest

from rlhfuse_jax.pipeline import bounds, schedules
from rlhfuse_jax.pipeline.evaluate import Evaluator, evaluate, objective_key, peak_memory
from rlhfuse_jax.pipeline.graph import (AB, AF, CB, CF, PipelineProblem, parse_devices,
                                        validate_order)


def test_placement_critic_reversed_and_replicated():
  p = PipelineProblem(8, 4, 4, 4, 1.0, 1.0)
  assert p.critic_replicas == 2
  assert [p.critic_stage(d) for d in range(8)] == [3, 2, 1, 0, 3, 2, 1, 0]
  assert [p.critic_replica(d) for d in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
  assert all(p.critic_device(p.critic_replica(d), p.critic_stage(d)) == d for d in range(8))
  assert (p.actor_bwd, p.critic_bwd, p.actor_mem, p.critic_mem) == (2.0, 2.0, 1.0, 1.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(actor_pp=6, critic_pp=4), "actor_pp=6 must be divisible by critic_pp=4"),
    (dict(actor_pp=4, critic_pp=8), "critic_pp=8 exceeds actor_pp=4"),
    (dict(actor_pp=0, critic_pp=1), "actor_pp=0 must be a positive integer"),
    (dict(actor_pp=4, critic_pp=2, actor_fwd=0.0), "actor_fwd=0.0 must be a positive"),
    (dict(actor_pp=4, critic_pp=2, memory_budget=(1.0, 2.0)), "memory_budget has 2 entries"),
    # Not numbers: each refused naming its field (a comparison's TypeError before).
    (dict(actor_pp=4, critic_pp=2, actor_bwd="2"), "actor_bwd='2' must be a number"),
    (dict(actor_pp=4, critic_pp=2, critic_mem=True), "critic_mem=True must be a number"),
    (dict(actor_pp=4, critic_pp=2, transfer_latency=None), "transfer_latency=None must be"),
    (dict(actor_pp=4, critic_pp=2, memory_budget=5.0), "memory_budget=5.0 must be a sequence"),
])
def test_impossible_problems_raise_clear_errors(kwargs, match):
  base = dict(actor_microbatches=2, critic_microbatches=2, actor_fwd=1.0, critic_fwd=1.0)
  base.update(kwargs)
  with pytest.raises(ValueError, match=match):
    PipelineProblem(**base)


def test_order_with_wrong_counts_is_rejected():
  p = PipelineProblem(2, 1, 1, 1, 1.0, 1.0)
  with pytest.raises(ValueError, match="device 0: kind counts"):
    validate_order(p, np.array([[AF, AF, CF, CB], [AF, AB, CF, CB]]))
  with pytest.raises(ValueError, match="expected \\(num_devices=2, tasks_per_device=4\\)"):
    validate_order(p, np.zeros((2, 3)))


def test_order_with_codes_that_are_no_kinds_is_rejected_not_truncated():
  # A float order was cast to int8: 0.5 ran as AF, 1.5 as AB (a schedule nobody asked for, with
  # its makespan); a negative code failed inside np.bincount without naming the order.
  p = PipelineProblem(2, 1, 1, 1, 1.0, 1.0)
  good = np.array([[AF, CF, AB, CB], [AF, CF, AB, CB]])
  assert evaluate(p, good.astype(np.float64)).valid  # integral floats are kind codes
  for bad in (good + 0.5, np.where(good == AF, -1, good), np.where(good == AF, 4, good)):
    with pytest.raises(ValueError, match="kind codes 0..3"):
      evaluate(p, bad)


def test_device_list_flag_is_parsed_or_refused_naming_the_flag():
  assert parse_devices([], 4) is None
  assert parse_devices(["3", " 1", "3"], 4) == [1, 3]
  assert parse_devices(["each"], 4, allow_each=True) == "each"
  for values, kw in ((["each"], {}), (["1", "x"], {}), (["4"], {}), (["-1"], {})):
    with pytest.raises(ValueError, match=r"--devices=.*expected device indices in 0\.\.3"):
      parse_devices(values, 4, **kw)


def test_hand_computed_two_devices_two_replicas():
  # Pa=2, Pc=1: actor stages on devices 0, 1; critic replica r alone on device r.
  p = PipelineProblem(2, 1, 1, 1, 1.0, 1.0)
  order = np.array([[AF, CF, CB, AB], [CF, AF, AB, CB]])
  ev = evaluate(p, order)
  assert ev.valid
  # dev0: AF 0-1, CF 1-2, CB 2-4, AB waits for AB on dev1 (2-4) -> 4-6.
  # dev1: CF 0-1, AF 1-2 (after AF on dev0), AB 2-4, CB 4-6.
  np.testing.assert_allclose(ev.starts, [[0, 1, 2, 4], [0, 1, 2, 4]])
  np.testing.assert_allclose(ev.ends, [[1, 2, 4, 6], [1, 2, 4, 6]])
  assert ev.makespan == 6.0 and ev.sum_finish == 12.0
  np.testing.assert_allclose(ev.peaks, [2.0, 2.0])
  assert ev.bubble == pytest.approx(1 - 6 / 6)
  # Transfer latency 0.5 applies only between devices: AF(1) starts at 1.5, AB(0) at 4.5 + 0.5.
  lat = evaluate(PipelineProblem(2, 1, 1, 1, 1.0, 1.0, transfer_latency=0.5), order)
  np.testing.assert_allclose(lat.ends, [[1, 2, 4, 7], [1, 2.5, 4.5, 6.5]])
  assert lat.makespan == 7.0


def test_hand_computed_unequal_backward_and_memory():
  # Pa=Pc=2 (critic reversed): dev0 = actor 0 + critic 1, dev1 = actor 1 + critic 0.
  p = PipelineProblem(2, 2, 1, 1, 2.0, 1.0, actor_bwd=3.0, critic_bwd=5.0, actor_mem=4.0,
                      critic_mem=1.0)
  order = np.array([[AF, CF, CB, AB], [CF, AF, AB, CB]])
  ev = evaluate(p, order)
  # dev1: CF 0-1, AF 2-4 (AF dev0 ends 2), AB 4-7, CB after CB dev0.
  # dev0: AF 0-2, CF 2-3 (CF dev1 ends 1), CB 3-8, AB max(8, 7) 8-11. dev1 CB 8-13.
  np.testing.assert_allclose(ev.ends, [[2, 3, 8, 11], [1, 4, 7, 13]])
  assert ev.makespan == 13.0
  np.testing.assert_allclose(ev.peaks, [5.0, 5.0])
  order2 = np.array([[AF, AB, CF, CB], [CF, AF, AB, CB]])
  np.testing.assert_allclose(peak_memory(p, order2), [4.0, 5.0])


def test_deadlocked_orders_are_rejected():
  p = PipelineProblem(2, 2, 1, 1, 1.0, 1.0)
  # dev0 waits in CF for dev1's CF, dev1 waits in AF for dev0's AF: a cyclic wait.
  ev = evaluate(p, np.array([[CF, AF, CB, AB], [AF, CF, AB, CB]]))
  assert not ev.valid and ev.objective()[0] == 1
  # A backward before its own forward on the last stage waits forever.
  ev = evaluate(p, np.array([[AF, CF, CB, AB], [AB, AF, CF, CB]]))
  assert not ev.valid
  from rlhfuse_jax.pipeline.schedule import from_order
  with pytest.raises(ValueError, match=r"order deadlocks \(cyclic wait between devices"):
    from_order(p, np.array([[CF, AF, CB, AB], [AF, CF, AB, CB]]))
  # The backward before its own forward (a hand-edited schedule file): named by device,
  # position and micro-batch, not as a wait between devices.
  with pytest.raises(ValueError, match=r"order deadlocks: on device 1, position 0, the actor "
                                       r"backward of micro-batch 0 comes before its own forward "
                                       r"\(on the same device\)"):
    from_order(p, np.array([[AF, CF, CB, AB], [AB, AF, CF, CB]]))


@pytest.mark.parametrize("stages, micro, fwd, bwd", [
    (4, 8, 1.0, 2.0), (8, 8, 5.0, 10.0), (8, 3, 2.0, 4.0), (3, 5, 1.0, 1.0), (5, 7, 1.0, 3.0),
    (16, 64, 2.0, 4.0), (1, 4, 1.0, 2.0)])
def test_1f1b_makespan_formula(stages, micro, fwd, bwd):
  p = PipelineProblem(stages, stages, micro, micro, fwd, fwd, actor_bwd=bwd, critic_bwd=bwd)
  expected = (stages + micro - 1) * (fwd + bwd)
  assert schedules.model_makespan(p, "actor") == expected
  assert schedules.model_makespan(p, "critic") == expected
  assert bounds.pipeline_1f1b_makespan(stages, micro, fwd, bwd) == expected


def test_1f1b_peaks_define_the_default_budget():
  p = PipelineProblem(8, 4, 6, 2, 3.0, 2.0)
  # Per-model peaks of the 1F1B orders: min(P - s, M) micro-batches of that model.
  actor_peaks, critic_peaks = p.one_f_one_b_peaks()
  np.testing.assert_allclose(actor_peaks, [3.0 * min(8 - d, 6) for d in range(8)])
  np.testing.assert_allclose(critic_peaks, [2.0 * min(4 - (3 - d % 4), 2) for d in range(8)])
  np.testing.assert_allclose(p.budget(), actor_peaks + critic_peaks)
  # Serial (actor 1F1B then critic 1F1B) peaks at the larger of the two, within the budget.
  serial = evaluate(p, schedules.serial_order(p), schedules.serial_release(p))
  np.testing.assert_allclose(serial.peaks, np.maximum(actor_peaks, critic_peaks))
  assert serial.makespan == bounds.serial_makespan_formula(p)


def test_greedy_within_budget_and_between_bound_and_serial():
  for args in [(8, 4, 8, 4, 5.0, 4.0), (8, 8, 8, 8, 5.0, 2.0), (4, 2, 6, 3, 1.0, 3.0)]:
    p = PipelineProblem(*args)
    greedy = evaluate(p, schedules.greedy_order(p))
    serial = evaluate(p, schedules.serial_order(p), schedules.serial_release(p))
    assert greedy.valid and greedy.within_budget
    assert bounds.tight_lower_bound(p) <= greedy.makespan <= serial.makespan


def test_peak_over_budget_with_no_activation_memory():
  # actor_mem = critic_mem = 0 (a search without memory): every budget is 0, and schedule_search
  # wrote peaks / budget = nan into result.json (null) and its gantt title ("peak/budget nan").
  p = PipelineProblem(4, 2, 3, 2, 2.0, 1.0, actor_mem=0.0, critic_mem=0.0)
  ev = evaluate(p, schedules.greedy_order(p))
  assert ev.budget.tolist() == [0.0] * 4 and ev.peak_over_budget == 0.0
  q = PipelineProblem(4, 2, 3, 2, 2.0, 1.0)
  ev = evaluate(q, schedules.greedy_order(q))
  assert ev.peak_over_budget == pytest.approx(float(np.max(ev.peaks / ev.budget)))
  explicit = evaluate(q.with_budget([0.0, 10.0, 10.0, 10.0]), schedules.greedy_order(q))
  assert explicit.peak_over_budget == float("inf")


def test_objective_ranks_overflow_then_makespan_then_max_then_sum_of_peaks():
  """The search keeps the schedule with the smallest objective, so its order is the contract of
  docs/architecture.md §3: total overflow over devices first (a schedule within budget beats a
  faster one that is not), then makespan, then the largest peak, then the sum of peaks."""
  p = PipelineProblem(2, 1, 1, 1, 1.0, 1.0, memory_budget=(1.0,))
  # The hand-computed order above: makespan 6, both devices hold 2 (1 over budget each).
  fast = evaluate(p, np.array([[AF, CF, CB, AB], [CF, AF, AB, CB]]))
  # One micro-batch in flight: dev1 AF 1-2, AB 2-4; dev0 AB 4-6, CF 6-7, CB 7-9.
  slow = evaluate(p, schedules.sequential_order(p))
  assert (fast.makespan, slow.makespan) == (6.0, 9.0)
  assert fast.overflow == 2.0 and not fast.within_budget
  assert slow.overflow == 0.0 and slow.within_budget
  assert slow.objective() < fast.objective()
  # Equal overflow and makespan: the smaller largest peak wins even with the larger sum.
  even = objective_key(True, 0.0, 10.0, np.array([2.0, 2.0, 2.0]), 30.0)
  skewed = objective_key(True, 0.0, 10.0, np.array([3.0, 1.0, 1.0]), 30.0)
  assert even < skewed


@pytest.mark.parametrize("lat", [0.0, 0.5])
def test_task_tails_are_the_remaining_chain_of_one_micro_batch(lat):
  """task_tails (the list scheduler's and decoder's priorities) is the time from a task's start
  to the end of its micro-batch's chain (forwards to the last stage, backwards to stage 0, a
  latency per hop). With one micro-batch per model run alone that chain is the whole schedule,
  so the evaluator's makespan minus each task's start must equal it."""
  p = PipelineProblem(4, 2, 1, 1, 1.0, 2.0, actor_bwd=3.0, critic_bwd=5.0,
                      transfer_latency=lat)
  tails = schedules.task_tails(p)
  inf = float("inf")
  for model, release, kinds in (("actor", (0.0, inf), (AF, AB)),
                                ("critic", (inf, 0.0), (CF, CB))):
    ev = Evaluator(p)
    ev.timing(schedules.one_f_one_b_order(p, model), release)
    ends = ev.ends[:, :2]  # [N, 2]: the model's forward then its backward on each device
    starts = ends - np.array([p.duration(k) for k in kinds])
    np.testing.assert_allclose(tails[:, list(kinds)], ends.max() - starts)


def test_one_f_one_b_caps_are_the_in_flight_counts_of_the_1f1b_orders():
  """The list scheduler's per-model caps are the most micro-batches each device holds in flight
  (forwards started, backwards not yet) in the two models' 1F1B orders."""
  p = PipelineProblem(8, 4, 6, 2, 3.0, 2.0)
  actor, critic = schedules.one_f_one_b_order(p, "actor"), schedules.one_f_one_b_order(
      p, "critic")

  def held(order, f, b):  # [N] most forwards started and not yet backed on each device
    return np.cumsum((order == f).astype(int) - (order == b), axis=1).max(axis=1)
  np.testing.assert_array_equal(schedules.one_f_one_b_caps(p),
                                np.stack([held(actor, AF, AB), held(critic, CF, CB)], axis=1))


def test_list_scheduling_with_the_reserve_never_stalls_under_the_budget():
  """reserve=True admits a forward only if one forward of the other model still fits while that
  model holds nothing on the device, which makes the combined memory cap deadlock-free: every
  variant must come back (none None) and hold at most the cap."""
  rng = np.random.default_rng(0)
  for p in (PipelineProblem(4, 2, 4, 2, 1.0, 2.0, actor_mem=3.0, critic_mem=2.0),
            PipelineProblem(4, 4, 3, 3, 2.0, 1.0)):
    n = p.num_devices
    cap = np.full(n, p.actor_mem + p.critic_mem)  # one micro-batch of each model at once
    for _ in range(40):
      order = schedules.list_schedule(p, rng.uniform(0, 10, size=(n, 4)), np.full((n, 2), 8),
                                      cap, float(rng.uniform(0, 3)), reserve=True)
      assert order is not None
      ev = evaluate(p, order)
      assert ev.valid and np.all(ev.peaks <= cap + 1e-9)


def test_the_gantt_title_is_wrapped_to_the_figure(tmp_path, monkeypatch):
  """schedule_search's title of a small instance (a figure 8 inches wide) ended "peak/budget
  1.00 (unifo": cut off at the figure's edge. It is wrapped to the width, every word kept."""
  import matplotlib.figure
  from rlhfuse_jax.pipeline import gantt
  from rlhfuse_jax.pipeline import schedule as schedule_lib
  seen = []
  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **kw: seen.append(fig))
  p = PipelineProblem(actor_pp=2, critic_pp=2, actor_microbatches=2, critic_microbatches=2,
                      actor_fwd=2.0, critic_fwd=1.0)
  sched = schedule_lib.from_order(p, schedules.serial_order(p))
  title = ("Pa/Pc=2/2, Ma/Mc=2/2: makespan 18, tight LB 18, serial 27, peak/budget 1.00 "
           "(uniform), searched in 2.0 s by 1 worker of the anneal, seed 0, " * 2).strip()
  gantt.plot_gantt(sched, str(tmp_path / "g.png"), title)
  fig, = seen
  fig.canvas.draw()
  text = fig.axes[0].title
  assert text.get_text().split() == title.split()
  box = text.get_window_extent()
  assert 0 <= box.x0 and box.x1 <= fig.bbox.width, (box, fig.bbox.width)
