"""Cheap tests from an eleventh mutation audit (pipeline/: graph.py, bounds.py, schedule.py,
program.py, windows.py, search.py, executor.py, stages.py, exact/time_indexed.py): each one pins
a survivor of that audit, failing under the plausible bug named in its docstring or comment that
the rest of the suite let through, and passing on the code as it is. They work on hand-sized
problems with numpy only; none compiles a pipeline or trains."""
import json

import numpy as np
import pytest

from rlhfuse_jax.pipeline import program as prog
from rlhfuse_jax.pipeline import schedule, schedules, windows
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
