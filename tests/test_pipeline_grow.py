"""Growing schedules to more micro-batches (pipeline/exact/grow.py, schedule.band_pins)."""
import json
import os

import numpy as np
import pytest

from rlhfuse_jax.pipeline import bounds, schedule, schedules
from rlhfuse_jax.pipeline.exact import grow
from rlhfuse_jax.pipeline.evaluate import evaluate
from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF, UNIFORM, PipelineProblem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("model", ["actor", "critic"])
def test_insert_pairs_extends_a_steady_state_by_exactly_its_work(model):
  # Each model's own 1F1B first (the other model after it) has a steady state of alternating
  # forwards and backwards: 3 more micro-batches fit in as 3 pairs, the schedule growing by
  # exactly their work, within budget, the original order kept around the inserted block.
  p = PipelineProblem(4, 2, 8, 6, 2.0, 1.0)
  order = schedules.one_f_one_b_order(p, model)
  ev0 = evaluate(p, order)
  big, grown, cut = grow.insert_pairs(p, order, model, 3)
  fwd, bwd = (AF, AB) if model == "actor" else (CF, CB)
  extra = (3, 0) if model == "actor" else (0, 3)
  assert (big.actor_microbatches, big.critic_microbatches) == (8 + extra[0], 6 + extra[1])
  ev = evaluate(big, grown)
  assert ev.valid and ev.within_budget
  assert ev.makespan == ev0.makespan + 3 * (p.duration(fwd) + p.duration(bwd))
  block = [fwd, bwd] * 3 if cut.block == "FB" else [bwd, fwd] * 3
  for d, pos in enumerate(cut.positions):
    assert grown[d, pos:pos + 6].tolist() == block
    assert np.concatenate([grown[d, :pos], grown[d, pos + 6:]]).tolist() == order[d].tolist()


def test_insert_pairs_refuses_a_model_without_a_steady_state():
  # In e7's schedule at its bound the critic runs only in the warm-up and the drain (frozen in
  # the middle), so no cut takes critic pairs without lengthening it by more than their work.
  path = os.path.join(REPO, "experiments", "results", "e7_cp_schedule", "schedule.json")
  kept = schedule.load(path)
  with pytest.raises(ValueError, match="the critic has no steady state to extend"):
    grow.insert_pairs(kept.problem, kept.order(), "critic", 1)
  with pytest.raises(ValueError, match="model='both'"):
    grow.insert_pairs(kept.problem, kept.order(), "both", 1)
  with pytest.raises(ValueError, match="extra=0 must be a positive integer"):
    grow.insert_pairs(kept.problem, kept.order(), "actor", 0)


def test_check_grows_names_what_differs():
  small = PipelineProblem(16, 8, 32, 16, 2.0, 2.0)
  assert grow.check_grows(small, PipelineProblem(16, 8, 64, 32, 2.0, 2.0)) == (32, 16)
  with pytest.raises(ValueError, match="critic_fwd=2.0 into one of critic_fwd=1.0"):
    grow.check_grows(small, PipelineProblem(16, 8, 64, 32, 2.0, 1.0))
  with pytest.raises(ValueError, match="actor_microbatches: 32 -> 16; a schedule can only grow"):
    grow.check_grows(small, PipelineProblem(16, 8, 16, 16, 2.0, 2.0))
  with pytest.raises(ValueError, match="memory_budget"):
    grow.check_grows(small, PipelineProblem(16, 8, 64, 32, 2.0, 2.0, memory_budget=(40.0,)))


def test_band_pins_keep_the_head_move_and_renumber_the_tail_on_a_sloped_band():
  p = PipelineProblem(4, 2, 6, 3, 2.0, 1.0)
  sched = schedule.from_order(p, schedules.greedy_order(p))
  order = sched.order()
  t1, t2, slope, move = 6.0, 14.0, 2.0, 5.0
  pins = schedule.band_pins(sched, t1, t2, move, slope, index_shift=(1, 2))
  n_free = 0
  for d, dev in enumerate(sched.devices):
    for i, t in enumerate(dev):
      k = int(order[d, i])
      if t.start < t1 + slope * d:
        assert pins[k, d, t.microbatch] == t.start
      elif t.start >= t2 + slope * d:
        assert pins[k, d, t.microbatch + (1, 2)[k // 2]] == t.start + move
      else:
        n_free += 1
  assert n_free and len(pins) == order.size - n_free
  with pytest.raises(ValueError, match="index_shift"):
    schedule.band_pins(sched, t1, t2, move, index_shift=(0, -1))


def test_grow_pins_put_the_actor_in_the_band_when_it_has_no_steady_state():
  # 2 actor micro-batches on 4 stages never reach a 1F1B steady state, so growing to 4 sends the
  # actor's 2 extra micro-batches into the band with the critic's 1: both renumbered after the
  # band, which moves later by all the extra work.
  # (An explicit budget: the default one depends on the micro-batch counts below 4.)
  p = PipelineProblem(4, 2, 2, 2, 2.0, 1.0, memory_budget=(12.0,))
  kept = schedule.from_order(p, schedules.greedy_order(p))
  big = PipelineProblem(4, 2, 4, 3, 2.0, 1.0, memory_budget=(12.0,))
  pins, info = grow.grow_pins(kept, big, 4.0, 10.0)
  assert isinstance(info["actor_pairs"], str) and "no steady state" in info["actor_pairs"]
  assert info["move"] == 2 * 6.0 + 1 * 3.0 and info["target"] == kept.makespan + 15.0
  assert pins == schedule.band_pins(kept, 4.0, 10.0, 15.0, index_shift=(2, 1))
  assert all(j < 4 and (k < 2 or j < 3) for k, _, j in pins)


def _e9_family(microbatches):
  """e9/e10's pipelines (16/16, fa/fc 2/1) under the uniform budget, Ma = Mc = microbatches."""
  return PipelineProblem(16, 16, microbatches, microbatches, 2.0, 1.0,
                         memory_budget_mode=UNIFORM)


@pytest.mark.parametrize("name,source,problem,bound,moved", [
    ("e6_cp_schedule", "e7_cp_schedule", PipelineProblem(16, 8, 64, 32, 2.0, 2.0), 618.0, 0),
    ("e0_grown", "e1_cp_schedule", PipelineProblem(8, 4, 32, 16, 5.0, 4.0), 708.0, 0),
    # Under the uniform budget, from e1's and e4's schedules at their bounds to e0's and e3's.
    # In e0's, evaluate.py's re-timing (each task as early as its order allows) starts one
    # pinned task, device 7's actor backward 11, at 321 instead of its pinned 327.
    ("e0_uniform_cp", "e1_uniform_cp",
     PipelineProblem(8, 4, 32, 16, 5.0, 4.0, memory_budget_mode=UNIFORM), 708.0, 1),
    ("e3_uniform_cp", "e4_uniform_cp",
     PipelineProblem(8, 8, 32, 32, 5.0, 2.0, memory_budget_mode=UNIFORM), 702.0, 0),
    # e9 (64/64) from e10 (32/32) in four steps of 8 micro-batches per model, each at its
    # instance's tight bound (the steps are kept in e9_uniform_cp/g40, g48, g56). The first
    # step's re-timing starts three pinned tasks of device 8 one unit earlier.
    ("e9_uniform_cp/g40", "e10_uniform_cp", _e9_family(40), 390.0, 3),
    ("e9_uniform_cp/g48", "e9_uniform_cp/g40", _e9_family(48), 462.0, 0),
    ("e9_uniform_cp/g56", "e9_uniform_cp/g48", _e9_family(56), 534.0, 0),
    ("e9_uniform_cp", "e9_uniform_cp/g56", _e9_family(64), 606.0, 0),
])
def test_kept_grown_schedules_are_grown_as_their_readmes_say(name, source, problem, bound,
                                                             moved):
  # experiments/results/<name> was made by `schedule_cp_check --grow` from <source>'s kept
  # schedule (the band is in its result.json): every task the growth pins keeps that start in
  # the kept schedule (but `moved` ones, which the re-timing started earlier), whose makespan is
  # the growth's target (e6: its tight bound; e0: 3 above it, as e1's optimum is above e1's;
  # the uniform ones: their tight bounds).
  results = os.path.join(REPO, "experiments", "results")
  small = schedule.load(os.path.join(results, source, "schedule.json"))
  kept = schedule.load(os.path.join(results, name, "schedule.json"), problem)
  with open(os.path.join(results, name, "result.json")) as f:
    result = json.load(f)
  band = result["grow"]["band"]
  pins, info = grow.grow_pins(small, problem, band["t1"], band["t2"], band["slope"])
  assert info == result["grow"] and len(pins) == result["pinned_tasks"]
  # The growth adds exactly the extra work per device, and so does the bound: same gap.
  lb, small_lb = bounds.tight_lower_bound(problem), bounds.tight_lower_bound(small.problem)
  assert lb == bound and kept.makespan == info["target"]
  assert kept.makespan - lb == small.makespan - small_lb
  assert kept.within_budget
  starts = kept.starts()
  assert all(starts[key] <= st for key, st in pins.items())
  assert sum(starts[key] != st for key, st in pins.items()) == moved


def test_kept_spliced_schedule_is_spliced_as_its_readme_says():
  # experiments/results/e10_uniform_cp was made by `schedule_cp_check --splice` from the searched
  # schedule kept beside it (319): the tasks the splice pins keep their pinned starts (the head's
  # unchanged, the tail's one earlier) in the kept schedule at the tight bound 318.
  results = os.path.join(REPO, "experiments", "results", "e10_uniform_cp")
  problem = PipelineProblem(16, 16, 32, 32, 2.0, 1.0, memory_budget_mode=UNIFORM)
  hint = schedule.load(os.path.join(results, "hint_319.json"), problem)
  kept = schedule.load(os.path.join(results, "schedule.json"), problem)
  with open(os.path.join(results, "result.json")) as f:
    result = json.load(f)
  band = result["splice"]
  pins = schedule.splice_pins(hint, band["t1"], band["t2"], band["shift"])
  assert len(pins) == result["pinned_tasks"] and hint.within_budget and kept.within_budget
  assert hint.makespan == 319.0 and kept.makespan == bounds.tight_lower_bound(problem) == 318.0
  starts = kept.starts()
  assert all(starts[key] == st for key, st in pins.items())


def test_cp_check_grow_flag_errors_name_the_flag(tmp_path):
  # Checked before ortools is needed (it is an optional dependency, absent in CI).
  from tests.test_pipeline_experiments import _run
  inst = ["experiments.schedule_cp_check", "--config=configs/schedule_search.py",
          "--config.actor_pp=16", "--config.critic_pp=8", "--config.actor_microbatches=64",
          "--config.critic_microbatches=32", "--config.actor_fwd=2", "--config.critic_fwd=2",
          f"--workdir={tmp_path}"]
  e7 = os.path.join(REPO, "experiments", "results", "e7_cp_schedule", "schedule.json")
  for extra, msg in ((["--grow=120,200"], "--grow needs --hint_schedule"),
                     ([f"--hint_schedule={e7}", "--grow=120,x,0"],
                      "--grow=120,x,0: expected 3 numbers T1,T2,SLOPE"),
                     ([f"--hint_schedule={e7}", "--grow=1,2,0", "--splice=1,2,3"],
                      "--splice and --grow exclude each other"),
                     ([f"--hint_schedule={e7}", "--grow=1,2,0", "--config.critic_fwd=1"],
                      "cannot grow a schedule of critic_fwd=2.0 into one of critic_fwd=1.0")):
    out = _run([*inst, *extra])
    assert out.returncode != 0 and msg in out.stderr, out.stderr[-2000:]
