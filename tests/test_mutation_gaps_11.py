"""Cheap tests from an eleventh mutation audit (pipeline/: graph.py, bounds.py, schedule.py,
program.py, windows.py, search.py, executor.py, stages.py, exact/time_indexed.py): each one pins
a survivor of that audit, failing under the plausible bug named in its docstring or comment that
the rest of the suite let through, and passing on the code as it is. They work on hand-sized
problems with numpy only; none compiles a pipeline or trains."""
import json

import numpy as np
import pytest

from rlhfuse_jax.pipeline import program as prog
from rlhfuse_jax.pipeline import bounds, schedule, schedules, search, windows
from rlhfuse_jax.pipeline.evaluate import evaluate
from rlhfuse_jax.pipeline.exact import time_indexed
from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF, PipelineProblem


# schedule.py -------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("stage", 0), ("replica", 0)])
def test_a_schedule_file_with_a_wrong_critic_label_is_refused(field, value):
  """from_dict checks every stored (replica, stage, microbatch) label against the placement.
  Mutant: the stage (or the replica) left out of that comparison, so a hand-edited file that
  puts a critic task on the wrong stage or replica read back as if it were right."""
  p = PipelineProblem(4, 2, 2, 2, 1.0, 1.0)  # device 2: critic replica 1, stage 1
  data = json.loads(schedule.from_order(p, schedules.greedy_order(p)).to_json())
  tasks = data["devices"][2]
  q = next(i for i, t in enumerate(tasks) if t["model"] == "critic")
  assert (tasks[q]["replica"], tasks[q]["stage"]) == (1, 1)
  tasks[q][field] = value
  with pytest.raises(ValueError, match="device 2: task .* does not match"):
    schedule.from_dict(data)


# program.py --------------------------------------------------------------------------------------

def _two_device_fused_program():
  """Pa=2, Pc=1 (two critic replicas), one micro-batch each; fa=2, fc=1 (so AF 2, AB 4, CF 1,
  CB 2). Device 0 runs AF CF CB AB, device 1 CF AF AB CB: every tick pairs an actor task with a
  critic task of another length."""
  p = PipelineProblem(2, 1, 1, 1, 2.0, 1.0)
  order = np.array([[AF, CF, CB, AB], [CF, AF, AB, CB]], dtype=np.int8)
  return prog.build_program(p, order)


def test_lockstep_time_charges_each_tick_its_longest_task():
  """Ticks by hand: AF(d1) waits for AF(d0) (tick 0), so it runs at tick 1; AB(d1) at 2; AB(d0)
  waits for it, at 3. Ticks last max(AF, CF) = 2, max(CF, AF) = 2, max(CB, AB) = 4, max(AB, CB)
  = 4: 12. Mutant: a tick charged the sum of its tasks (18) or the first device's task."""
  program = _two_device_fused_program()
  assert program.task_tick.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
  assert program.ticks == 4
  assert program.lockstep_time() == 12.0
  assert program.summary()["lockstep_time"] == 12.0


def test_critic_stash_ring_is_sized_by_its_non_first_stages_only():
  """Pa=4, Pc=2 serial 1F1B, Mc=3: the critic's first stage (devices 1 and 3, placed in reverse)
  holds 2 micro-batches in flight but embeds tokens instead of stashing, and its last stage
  (devices 0 and 2) holds 1: the critic's ring needs 1 slot. Mutant: the stashing devices
  picked by device index (d < N-1, right only for one replica) or all devices: a ring of 2,
  memory every device of the compiled step allocates for nothing."""
  p = PipelineProblem(4, 2, 2, 3, 1.0, 1.0)
  program = prog.build_program(p, schedules.serial_order(p), barrier=True)
  assert program.stash_peaks[:, 1].tolist() == [1, 2, 1, 2]
  assert program.stash_peaks[:, 0].tolist() == [2, 2, 2, 1]
  assert program.stash_sizes == (2, 1)


# windows.py --------------------------------------------------------------------------------------

def test_windows_charge_the_latency_on_every_hop_of_both_chains():
  """Pa = Pc = 2, one micro-batch, f=1, b=2, latency 0.5 (so each model's 1F1B alone takes
  1 + .5 + 1 + 2 + .5 + 2 = 7). Actor (device 0 -> 1): AF heads 0, 1.5; AB(d1) 2.5, AB(d0)
  2.5 + 2 + .5 = 5; tails AB(d0) 2, AB(d1) 2 + .5 + 2 = 4.5, AF(d1) 1 + 4.5, AF(d0) 1 + .5 +
  5.5 = 7. The critic mirrors it (device 1 -> 0). Mutants: the latency dropped from the
  backward chain's heads (AB(d0) 4.5) or from the forward chain's tails (AF(d0) 6.5): windows
  too wide, so the exact checks lose what the latency proves."""
  p = PipelineProblem(2, 2, 1, 1, 1.0, 1.0, transfer_latency=0.5)
  win = windows.task_windows(p)
  for fk, bk, chain in ((AF, AB, [0, 1]), (CF, CB, [1, 0])):
    first, last = chain
    assert (win.heads[fk][first, 0], win.heads[fk][last, 0]) == (0.0, 1.5)
    assert (win.heads[bk][last, 0], win.heads[bk][first, 0]) == (2.5, 5.0)
    assert (win.tails[bk][first, 0], win.tails[bk][last, 0]) == (2.0, 4.5)
    assert (win.tails[fk][last, 0], win.tails[fk][first, 0]) == (5.5, 7.0)
  assert win.bound() == 7.0


# exact/time_indexed.py ---------------------------------------------------------------------------

@pytest.mark.parametrize("optimum, status", [(0.25, "infeasible"), (0.0, "feasible")])
def test_an_uncertified_positive_elastic_optimum_still_reads_infeasible(monkeypatch, optimum,
                                                                      status):
  """solve's status is the solver's verdict (elastic optimum > 0: the LP has no solution) and
  `certified` whether an exact certificate backs it; schedule_lp_check words the two apart
  ("infeasible, not certified" vs "the relaxation proves nothing"). A solver that returns no
  duals stands in for one whose multipliers fail the exact check. Mutant: status infeasible
  only when certified as well, so such a run read as a feasible LP."""
  model = time_indexed.build(PipelineProblem(2, 1, 2, 2, 1.0, 1.0), 14.0)
  assert model.infeasible_reason is None and model.num_vars > 0
  monkeypatch.setattr(time_indexed, "_solve_scipy", lambda *a: (optimum, None, "stub"))
  res = time_indexed.solve(model, solver="scipy")
  assert res["status"] == status and not res["certified"]
  assert res["certificate_bound"] is None and res["elastic_optimum"] == optimum


def test_every_cross_device_precedence_of_the_lp_carries_the_transfer_latency():
  """graph.py: a dependency between two devices adds transfer_latency. The LP's precedence rows
  (time_indexed._edges) state start_b >= start_a + delta; every edge between devices must have
  delta = duration(a) + latency, and there is one per hop and micro-batch of each chain (actor
  (N-1) x Ma forward and backward; critic R x (Pc-1) x Mc each way). Mutant: the critic's
  forward hop without the latency (its windows hide it with one micro-batch: a relaxation too
  weak where the latency binds between tasks with slack)."""
  p = PipelineProblem(4, 2, 2, 3, 2.0, 1.0, transfer_latency=0.5)
  unit = time_indexed.time_unit(p)
  dur_u = np.rint(p.durations() / unit).astype(np.int64)
  lat_u = int(round(p.transfer_latency / unit))
  tasks = [(k, d, j) for d in range(p.num_devices) for k in range(4)
           for j in range(int(p.kind_counts()[k]))]
  where = {t: i for i, t in enumerate(tasks)}
  big = np.full((p.num_devices, 2), 1 << 30, dtype=np.int64)
  edges = time_indexed._edges(  # pylint: disable=protected-access
      p, lambda k, d, j: where.get((k, d, j)), dur_u, lat_u, np.zeros((p.num_devices, 2)), big,
      range(p.num_devices))
  hops = {}
  for a, b, delta in edges:
    (ka, da, _), (kb, db, _) = tasks[a], tasks[b]
    if da != db:
      assert ka == kb and delta == dur_u[ka] + lat_u, (tasks[a], tasks[b], delta)
      hops[ka] = hops.get(ka, 0) + 1
  reps, pc = p.critic_replicas, p.critic_pp
  assert hops == {AF: 3 * 2, AB: 3 * 2, CF: reps * (pc - 1) * 3, CB: reps * (pc - 1) * 3}


# search.py ---------------------------------------------------------------------------------------

def test_the_unconstrained_result_of_a_two_direction_search_ignores_the_budget():
  """search() keeps, over its forward and mirror phases, the best schedule by makespan alone
  (best_unconstrained: what the budget costs is read against it). On this uniform-budget
  instance (the repair test's) a short count-limited search finds schedules at the tight bound
  180 only above the budget, and 190 within it. Mutant: the phases' unconstrained schedules
  compared with the overflow first, so the within-budget 190 came back as the unconstrained
  best too."""
  p = PipelineProblem(4, 2, 8, 4, 5.0, 4.0, memory_budget_mode="uniform")
  res = search.search(p, search.SearchConfig(max_evaluations=5000, seed=0, list_variants=50))
  best, free = evaluate(p, res.best), evaluate(p, res.best_unconstrained)
  assert best.valid and best.within_budget and best.makespan == 190.0
  assert free.valid and not free.within_budget
  assert free.makespan == bounds.tight_lower_bound(p) == 180.0


def test_a_mirror_first_search_reports_its_start_as_an_order_of_the_problem():
  """With reverse_first the first phase runs on the time-reversed mirror; the start it reports
  must be mapped back (reverse_order) and is never worse than the greedy order it was seeded
  with (both 36 here). Mutant: the mirror phase's own start reported as is, an order of the
  mirror that times at 39 on the problem."""
  p = PipelineProblem(4, 2, 3, 3, 2.0, 1.0)
  res = search.search(p, search.SearchConfig(max_evaluations=3000, seed=0, list_variants=50,
                                             reverse_first=True))
  start, greedy = evaluate(p, res.start), evaluate(p, schedules.greedy_order(p))
  assert start.valid and start.within_budget
  assert start.objective() <= greedy.objective()
  assert start.makespan == 36.0


def test_an_in_budget_annealing_chunk_that_beats_the_unconstrained_best_replaces_it():
  """_Phase._feasible_chunk: in-budget annealing improves best_feas only; when the result beats
  best_any (makespan, then max peak) it becomes best_any too, so the unconstrained best is never
  worse than the best within budget. Here best_feas starts at greedy (36) and best_any at serial
  1F1B (47). Mutant: that hand-over dropped (the two-direction search() masks it, since it
  also offers best_feas to its unconstrained pick; a one-direction search does not)."""
  p = PipelineProblem(4, 2, 3, 3, 2.0, 1.0)
  phase = search._Phase(p, search.SearchConfig(max_evaluations=1000, seed=0), None)
  phase.lb = bounds.tight_lower_bound(p)
  greedy, serial = schedules.greedy_order(p), schedules.serial_order(p)
  phase.best_feas, phase.best_any = greedy.copy(), serial.copy()
  phase.stats = np.concatenate([search._stats_of(search._key(phase.ev, o))
                                for o in (greedy, serial)])
  assert phase.stats[1] == 36.0 and phase.stats[6] == 47.0
  phase._feasible_chunk(greedy.copy(), 50, 1, 0.5, 0.01, windows.chain_tails_per_task(p))
  best, free = evaluate(p, phase.best_feas), evaluate(p, phase.best_any)
  assert best.within_budget and best.makespan <= 36.0
  assert free.makespan == best.makespan == phase.stats[6] == phase.stats[1]
