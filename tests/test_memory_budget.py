"""The memory budget of a fused schedule: memory_budget_mode "uniform" vs "per_device" (graph.py).

Uniform gives every device the largest per-device budget, so it only admits more schedules; a
problem stored before the mode existed reads back as per_device, the budget it was made under.
"""
import json
import os
import re

import ml_collections
import numpy as np
import pytest

from configs import schedule_search as ss_config
from rlhfuse_jax.pipeline import bounds, schedule, schedules, search
from rlhfuse_jax.pipeline.evaluate import evaluate
from rlhfuse_jax.pipeline.exact import time_indexed
from rlhfuse_jax.pipeline.graph import (EXPLICIT, PER_DEVICE, UNIFORM, PipelineProblem,
                                        reverse_order)
from tests.test_pipeline_experiments import REPO
from tests.test_pipeline_search import SMALL, _random_valid_orders

REFERENCE = [PipelineProblem(pa, pc, ma, mc, fa, fc)
             for _, pa, pc, ma, mc, fa, fc in ss_config.REFERENCE_INSTANCES]


@pytest.mark.parametrize("p", SMALL + REFERENCE)
def test_uniform_budget_is_the_largest_per_device_budget_on_every_device(p):
  per_device = p.with_budget(None, PER_DEVICE).budget()
  uniform = p.with_budget(None, UNIFORM).budget()
  actor, critic = p.one_f_one_b_peaks()
  np.testing.assert_array_equal(per_device, actor + critic)
  np.testing.assert_array_equal(uniform, np.full(p.num_devices, np.max(actor + critic)))
  assert np.all(uniform >= per_device)


def test_uniform_and_per_device_coincide_when_every_device_carries_the_same_sum():
  # Pa = Pc and M >= P: actor stage d holds P - d, the reversed critic d + 1, so every device's
  # sum is P + 1 and the two modes are one budget. With critic replicas (R > 1) they differ.
  same = PipelineProblem(4, 4, 4, 4, 1.0, 1.0)
  np.testing.assert_array_equal(same.budget(), same.with_budget(None, UNIFORM).budget())
  e0 = REFERENCE[0]
  assert e0.budget().tolist() == [44.0, 43.0, 42.0, 41.0, 24.0, 23.0, 22.0, 21.0]
  assert e0.with_budget(None, UNIFORM).budget().tolist() == [44.0] * 8


@pytest.mark.parametrize("idx", range(len(SMALL)))
def test_a_schedule_within_the_per_device_budget_is_within_the_uniform_one(idx):
  p = SMALL[idx]
  u = p.with_budget(None, UNIFORM)
  within = 0
  for order in _random_valid_orders(p, np.random.default_rng(idx), 100):
    ev, ev_u = evaluate(p, order), evaluate(u, order)
    # The budget changes what is admissible, never the timing or the peaks.
    assert ev_u.makespan == ev.makespan and np.array_equal(ev_u.peaks, ev.peaks)
    if ev.within_budget:
      within += 1
      assert ev_u.within_budget
  assert within > 0


def test_a_kept_per_device_schedule_reads_back_per_device_and_is_within_uniform():
  # experiments/results/ schedules were written before the mode existed (no such key).
  path = os.path.join(REPO, "experiments", "results", "e7_cp_schedule", "schedule.json")
  with open(path) as f:
    assert "memory_budget_mode" not in json.load(f)["problem"]
  e7 = PipelineProblem(16, 8, 32, 16, 2.0, 2.0)
  kept = schedule.load(path, e7)  # equal to a problem built without a mode: per_device
  assert kept.problem.memory_budget_mode == PER_DEVICE and kept.within_budget
  assert kept.budget == tuple(e7.per_device_memory_budget())
  assert evaluate(e7.with_budget(None, UNIFORM), kept.order()).within_budget
  with pytest.raises(ValueError, match="not of the expected problem"):
    schedule.load(path, e7.with_budget(None, UNIFORM))
  # Not a schedule (its directory, a result.json, an empty file): one line naming it.
  result = os.path.join(REPO, "experiments", "results", "e7_cp_schedule", "result.json")
  for bad in (os.path.dirname(path), result, os.devnull):
    with pytest.raises(ValueError, match=f"{re.escape(bad)}: not a schedule.json"):
      schedule.load(bad, e7)


def test_to_dict_writes_the_mode_and_an_old_dict_without_it_reads_per_device():
  p = PipelineProblem(8, 4, 6, 3, 5.0, 4.0, memory_budget_mode=UNIFORM)
  d = p.to_dict()
  assert d["memory_budget_mode"] == UNIFORM and d["memory_budget"] is None
  assert PipelineProblem.from_dict(json.loads(json.dumps(d))) == p
  old = {k: v for k, v in d.items() if k != "memory_budget_mode"}
  back = PipelineProblem.from_dict(old)
  assert back.memory_budget_mode == PER_DEVICE
  np.testing.assert_array_equal(back.budget(), p.per_device_memory_budget())
  assert PipelineProblem.from_dict(back.to_dict()) == back
  # The schedule file's reader (schedule.from_dict) builds the problem the same way.
  data = schedule.from_order(p, schedules.serial_order(p)).to_dict()
  assert schedule.from_dict(data).problem == p
  del data["problem"]["memory_budget_mode"]
  assert schedule.from_dict(data).problem == back


def test_an_explicit_budget_overrides_the_mode_and_records_it():
  a = PipelineProblem(4, 2, 3, 3, 2.0, 1.0, memory_budget=(7.0,), memory_budget_mode=UNIFORM)
  b = PipelineProblem(4, 2, 3, 3, 2.0, 1.0, memory_budget=(7.0,))
  assert a == b and a.memory_budget_mode == EXPLICIT and a.budget().tolist() == [7.0] * 4
  old = {k: v for k, v in a.to_dict().items() if k != "memory_budget_mode"}
  assert PipelineProblem.from_dict(old) == a
  assert a.with_budget(None, UNIFORM).budget().tolist() == [8.0] * 4  # max of [7, 8, 5, 4]
  with pytest.raises(ValueError, match="needs a mode"):
    a.with_budget(None)
  with pytest.raises(ValueError, match="memory_budget_mode='explicit' needs a memory_budget"):
    PipelineProblem(4, 2, 3, 3, 2.0, 1.0, memory_budget_mode=EXPLICIT)
  with pytest.raises(ValueError, match="memory_budget_mode='uniformm'"):
    PipelineProblem(4, 2, 3, 3, 2.0, 1.0, memory_budget_mode="uniformm")


def test_the_time_reversed_mirror_keeps_the_uniform_budget():
  p = PipelineProblem(4, 2, 3, 3, 2.0, 1.0, memory_budget_mode=UNIFORM)
  mirror = p.time_reversed()
  np.testing.assert_array_equal(mirror.budget(), p.budget())
  order = schedules.serial_order(p)
  assert evaluate(mirror, reverse_order(order)).within_budget == evaluate(p, order).within_budget


def test_from_config_defaults_to_uniform_and_a_config_without_the_field_to_per_device():
  c = ss_config.get_config()
  assert c.memory_budget_mode == UNIFORM
  assert PipelineProblem.from_config(c).memory_budget_mode == UNIFORM
  c.memory_budget_mode = PER_DEVICE
  assert PipelineProblem.from_config(c).memory_budget_mode == PER_DEVICE
  c.memory_budget = 50.0
  assert PipelineProblem.from_config(c).budget().tolist() == [50.0] * 8
  old = ml_collections.ConfigDict({k: v for k, v in ss_config.get_config().items()
                                   if k != "memory_budget_mode"})
  assert PipelineProblem.from_config(old).memory_budget_mode == PER_DEVICE
  bad = ss_config.get_config()
  bad.memory_budget_mode = "per-device"
  with pytest.raises(ValueError, match="config.memory_budget_mode='per-device'"):
    PipelineProblem.from_config(bad)


def test_from_config_takes_zero_as_a_value_and_only_minus_one_as_the_default():
  """-1 is the config files' "default" sentinel; 0 is a real setting (a search without
  activation memory, or a budget of nothing) and must reach the problem as 0, not the default
  (activation memory = forward time, the 1F1B budget)."""
  c = ss_config.get_config()
  c.actor_mem, c.critic_mem = 0.0, 0.0
  p = PipelineProblem.from_config(c)
  assert (p.actor_mem, p.critic_mem) == (0.0, 0.0)
  assert p.budget().tolist() == [0.0] * p.num_devices
  c = ss_config.get_config()
  c.memory_budget = 0.0
  p = PipelineProblem.from_config(c)
  assert p.memory_budget_mode == EXPLICIT and p.budget().tolist() == [0.0] * p.num_devices
  c.memory_budget, c.actor_mem = -1.0, -1.0
  p = PipelineProblem.from_config(c)
  assert p.actor_mem == p.actor_fwd and p.memory_budget_mode == c.memory_budget_mode
  c.actor_mem = -2.0
  with pytest.raises(ValueError, match="config.actor_mem=-2.0"):
    PipelineProblem.from_config(c)


@pytest.mark.parametrize("field,value,expected", [
    ("actor_pp", "8", "an integer"), ("critic_microbatches", 2.5, "an integer"),
    ("actor_fwd", "5", "a number"), ("memory_budget", "x", "a number"),
    ("critic_bwd", True, "a number")])
def test_from_config_names_a_field_of_the_wrong_type(field, value, expected):
  """A config file's "8" stages ran as 8 and 2.5 micro-batches as 2 (int()); a str budget
  failed as a TypeError of a comparison, naming no field."""
  d = ss_config.get_config().to_dict()
  d[field] = value
  with pytest.raises(ValueError, match=f"config.{field}={value!r}: expected {expected}"):
    PipelineProblem.from_config(ml_collections.ConfigDict(d))


def test_problem_keyed_caches_tell_the_modes_apart():
  # sim/training_sim.ScheduleCache keys on to_dict(), as trainer/pipelined's schedule cache does:
  # entries written before the mode existed (no key) are not hits for either mode (re-keyed).
  from rlhfuse_jax.sim.training_sim import ScheduleCache
  p = PipelineProblem(4, 2, 3, 3, 2.0, 1.0)
  u = p.with_budget(None, UNIFORM)
  cache = ScheduleCache()
  assert cache.key(p) != cache.key(u)
  assert '"memory_budget_mode": "per_device"' in cache.key(p)


# LB 42; under the per-device budget [9, 8, 7, 6] the LP relaxation proves 42 unreachable (the
# certificate of tests/test_pipeline_time_indexed.py); the uniform budget, 9 on every device,
# admits it and the search finds it.
TIGHT = PipelineProblem(4, 4, 4, 4, 2.0, 1.0)


def test_uniform_admits_a_strictly_better_searched_makespan():
  per_device, uniform = TIGHT, TIGHT.with_budget(None, UNIFORM)
  lb = bounds.tight_lower_bound(per_device)
  assert lb == bounds.tight_lower_bound(uniform) == 42.0
  cfg = search.SearchConfig(max_evaluations=20000, seed=0)
  best = {}
  for name, p in (("per_device", per_device), ("uniform", uniform)):
    res = search.search(p, cfg)
    ev = evaluate(p, res.best)
    assert ev.within_budget
    best[name] = ev
  assert best["uniform"].makespan == lb < best["per_device"].makespan
  # Not a weakness of the search: 42 is proved unreachable within the per-device budget, and the
  # uniform schedule at 42 holds more than the per-device budget on some device.
  res = time_indexed.solve(time_indexed.build(per_device, lb), solver="scipy")
  assert res["status"] == "infeasible" and res["certified"]
  assert np.any(best["uniform"].peaks > per_device.budget())


def test_schedule_search_reports_the_mode_and_the_budget_it_used(tmp_path):
  """The binary (run as a user runs it: a subprocess, its absl flags its own) writes the mode,
  the budget it used and its peaks: uniform by default, per_device and explicit on request
  (an explicit budget below serial's and greedy's peaks: they are reported outside it, the
  search's schedule within), in three runs."""
  from tests.test_pipeline_experiments import _run
  inst = ["experiments.schedule_search", "--config=configs/schedule_search.py",
          "--config.actor_pp=4", "--config.critic_pp=2", "--config.actor_microbatches=3",
          "--config.critic_microbatches=3", "--config.actor_fwd=2", "--config.critic_fwd=1",
          "--config.time_budget_s=0.3",
          # One search process: a second (spawned) search worker is what test_pipeline_experiments
          # runs the binary with; the budget modes are the same with one.
          "--config.workers=1"]

  def run(name, *flags):
    out = _run([*inst, f"--workdir={tmp_path / name}", *flags])
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp_path / name / "result.json").read_text())
  uniform = run("u")
  assert uniform["memory_budget_mode"] == UNIFORM
  assert uniform["peak_memory"]["budget"] == [8.0] * 4 and uniform["budget_max"] == 8.0
  assert uniform["peak_max"] <= uniform["budget_max"] and uniform["devices_at_budget"] >= 0
  per_device = run("p", "--config.memory_budget_mode=per_device")
  assert per_device["memory_budget_mode"] == PER_DEVICE
  assert per_device["peak_memory"]["budget"] == [7.0, 8.0, 5.0, 4.0]
  for r in (uniform, per_device):  # both modes hold serial 1F1B (and greedy)
    assert r["serial_within_budget"] and r["greedy_within_budget"], r
  # An explicit budget overrides the mode given with it (one run: an explicit budget under the
  # default uniform mode is test_an_explicit_budget_overrides_the_mode_and_records_it's). 4 is
  # below serial's and greedy's peak of 6 on devices 0 and 1: result.json says so (the search
  # keeps within it, so it may take longer than they do).
  tight = run("e4", "--config.memory_budget_mode=per_device", "--config.memory_budget=4.0")
  assert tight["memory_budget_mode"] == EXPLICIT
  assert tight["peak_memory"]["budget"] == [4.0] * 4 and tight["budget_max"] == 4.0, tight
  assert not tight["serial_within_budget"] and not tight["greedy_within_budget"], tight
  assert tight["within_budget"] and tight["peak_max"] <= 4.0, tight