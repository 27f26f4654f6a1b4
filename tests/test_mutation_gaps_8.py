"""Cheap tests proposed by an eighth mutation audit (trainer/pipelined.py and the reshard-bytes
accumulation of trainer/update.py): each one fails under a plausible bug that the rest of the
fast suite lets through (the audit report names the mutation each kills). They call the
module's pure functions on hand-sized problems; none trains."""
import dataclasses
import json
import re
import shutil
import types

import jax
import jax.numpy as jnp
import optax
import pytest

from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.pipeline import program as prog
from rlhfuse_jax.pipeline import schedules
from rlhfuse_jax.pipeline import search as search_lib
from rlhfuse_jax.trainer import pipelined
from rlhfuse_jax.trainer import update as update_lib
from rlhfuse_jax.trainer.config import AlgoConfig, PipelineConfig
from tests.test_trainer import tiny_config


# trainer/pipelined.py ----------------------------------------------------------------------------

@pytest.mark.parametrize("microbatches, ticks, bubble", [
    # Serial 1F1B on 2 stages: each model's 1F1B takes 2 (M + S - 1) ticks, the critic's after
    # the actor's; each device runs 2 M tasks of each model.
    (1, 8, 1 - 4 / 8),   # 4 + 4 ticks, 4 busy per device
    (2, 12, 1 - 8 / 12),  # 6 + 6 ticks, 8 busy per device
])
def test_bubble_is_the_idle_share_of_each_devices_ticks(microbatches, ticks, bubble):
  problem = pipelined.pipeline_problem(2, PipelineConfig(actor_microbatches=microbatches,
                                                         critic_microbatches=microbatches))
  program = prog.build_program(problem, schedules.serial_order(problem), barrier=True)
  executor = types.SimpleNamespace(program=program)  # the schedule figures read only this
  update = pipelined.PipelinedUpdate(executor, pipelined.SERIAL, AlgoConfig(), optax.sgd(0.1),
                                     optax.sgd(0.1), {})
  m = update.schedule_metrics
  assert m["pipeline/schedule"] == pipelined.SERIAL and m["pipeline/ticks"] == ticks
  assert m["pipeline/bubble"] == pytest.approx(bubble)


def test_zero_microbatches_give_each_critic_replica_its_share_of_the_rows():
  """8 rows per data shard on 4 stages: the actor gets 8 micro-batches; the critic, replicated
  4 / critic_pp times, 8 / replicas per replica. Explicit counts are kept as given."""
  zero = PipelineConfig(actor_microbatches=0, critic_microbatches=0)
  for critic_pp, critic_mb in ((0, 8), (4, 8), (2, 4), (1, 2)):
    p = pipelined.resolve_microbatches(dataclasses.replace(zero, critic_pp=critic_pp), 4, 8)
    assert (p.actor_microbatches, p.critic_microbatches) == (8, critic_mb)
  given = PipelineConfig(critic_pp=2, actor_microbatches=3, critic_microbatches=5)
  assert pipelined.resolve_microbatches(given, 4, 8) == given


def test_schedule_problem_takes_each_models_stages_and_microbatches():
  p = pipelined.pipeline_problem(4, PipelineConfig(critic_pp=2, actor_microbatches=6,
                                                   critic_microbatches=3))
  assert (p.actor_pp, p.critic_pp, p.actor_microbatches, p.critic_microbatches) == (4, 2, 6, 3)
  assert p.critic_replicas == 2 and p.tasks_per_device == 2 * 6 + 2 * 3
  assert pipelined.pipeline_problem(4, PipelineConfig()).critic_pp == 4  # 0: the actor's stages


def test_cached_schedule_is_reused_only_under_the_same_search_settings(tmp_path, monkeypatch):
  """The cache key holds the search settings: a run with another seed or time budget searches
  (its schedule may differ), the same settings load the file."""
  searched = []

  def fake_search(problem, config):  # the serial order stands for a searched one
    searched.append((config.seed, config.time_budget_s))
    return types.SimpleNamespace(best=schedules.serial_order(problem), search_s=0.0,
                                 evaluations=1)
  monkeypatch.setattr(search_lib, "search", fake_search)
  monkeypatch.setattr(search_lib, "warmup", lambda: 0.0)  # (its tiny search is not the run's)
  pipe = PipelineConfig(critic_pp=2, actor_microbatches=2, critic_microbatches=1,
                        search_seed=0, search_time_s=1.0, schedule_cache_dir=str(tmp_path))
  problem = pipelined.pipeline_problem(4, pipe)
  paths = [pipelined.searched_schedule(problem, pipe)[1]]
  paths.append(pipelined.searched_schedule(problem, pipe)[1])  # loaded
  for other in ({"search_seed": 1}, {"search_time_s": 2.0}):
    paths.append(pipelined.searched_schedule(problem, dataclasses.replace(pipe, **other))[1])
  assert searched == [(0, 1.0), (1, 1.0), (0, 2.0)]
  assert paths[0] == paths[1] and len(set(paths)) == 3
  # A file copied by hand under this key's name from a run with another seed (same problem,
  # so only the stored key tells them apart) is not taken for this run's: it searches again.
  other_seed = pipelined.searched_schedule(problem, dataclasses.replace(pipe, search_seed=1))[1]
  shutil.copy(other_seed, paths[0])
  assert pipelined.searched_schedule(problem, pipe)[0].problem == problem
  assert searched[-1] == (0, 1.0) and len(searched) == 4


def test_a_count_budget_makes_two_fresh_runs_search_the_same_schedule(tmp_path):
  """pipeline.search_evaluations: the search is cut by evaluations, not by the wall clock, so
  two fresh runs (separate caches) of the main job's shape (4 stages, critic_pp 2) find the
  same schedule. By wall clock three fresh searches found three schedules of one makespan with
  different inbox rings, so each run compiled and rounded another update (docs/usage.md)."""
  pipe = PipelineConfig(critic_pp=2, actor_microbatches=4, critic_microbatches=2,
                        search_evaluations=30000)
  problem = pipelined.pipeline_problem(4, pipe)
  found = []
  for run in ("a", "b"):
    schedule, path = pipelined.searched_schedule(
        problem, dataclasses.replace(pipe, schedule_cache_dir=str(tmp_path / run)))
    found.append(schedule.to_dict())
    assert json.load(open(path))["key"]["search"]["max_evaluations"] == 30000
  assert found[0] == found[1]
  for bad in (-1, True, 1.5):
    with pytest.raises(ValueError, match=re.escape(
        f"pipeline.search_evaluations={bad!r}") + ".*an integer >= 0"):
      PipelineConfig(search_evaluations=bad)


@pytest.mark.parametrize("overrides, match", [
    # 1 row over 2 data shards: a shard with no row, whatever the micro-batch counts.
    ({"algo.minibatch_size": 1},
     "config.algo.minibatch_size=1 must be at least the data-parallel size"),
    # 1 row per shard does not split over the 2 critic replicas one row each.
    ({"algo.minibatch_size": 2, "pipeline.actor_microbatches": 1,
      "pipeline.critic_microbatches": 0},
     "config.pipeline.critic_microbatches=0 (one row per micro-batch) needs"),
])
def test_check_config_refuses_rows_that_do_not_split(overrides, match):
  cfg = tiny_config(**{"model.num_layers": 4, "critic_model.num_layers": 2,
                       "pipeline.critic_pp": 2, "pipeline.actor_microbatches": 4,
                       "pipeline.critic_microbatches": 2, "mesh.stage": 4, "mesh.data": 2,
                       **overrides})
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices())
  with pytest.raises(ValueError, match=re.escape(match)):
    pipelined.check_config(cfg, mesh)


def test_held_layers_of_a_reversed_stage_stack():
  """_held_layers on a reverse layout (row r holds stage S-1-r, as the critic's), 2 stages of 3
  layers: a device holding row 0 holds layers 3..5; both rows, layers 0..5; part of both rows is
  no single box."""
  layout = types.SimpleNamespace(num_stages=2, per_stage=3, row=lambda r: 1 - r)
  rest = slice(None, None, None)
  boxes = {"row0": (slice(0, 1), slice(None), rest), "row1": (slice(1, 2), slice(None), rest),
           "both": (slice(None), slice(None), rest), "part": (slice(None), slice(0, 1), rest),
           "one_layer": (slice(0, 1), slice(2, 3), rest)}
  held = {d: pipelined._held_layers(d, layout, boxes)  # pylint: disable=protected-access
          for d in ("row0", "row1", "both", "one_layer")}
  assert held == {"row0": (slice(3, 6), rest), "row1": (slice(0, 3), rest),
                  "both": (slice(0, 6), rest), "one_layer": (slice(5, 6), rest)}
  with pytest.raises(NotImplementedError, match="no single box"):
    pipelined._held_layers("part", layout, boxes)  # pylint: disable=protected-access


# trainer/update.py: perf/reshard_bytes -----------------------------------------------------------

class _FakePipelined:
  """The parts of PipelinedUpdate that Update.whole reads, with fixed bytes per model."""
  schedule_name, schedule_metrics = pipelined.SERIAL, {}
  BYTES = {"actor": 100, "critic": 7}

  def to_staged(self, model, params):
    return params

  def whole_fn(self, model, staged, shardings):
    return lambda params: params

  def reshard_bytes(self, model, staged, whole):
    return self.BYTES[model]


def test_reshard_bytes_sum_every_gather_since_the_last_take():
  mesh = mesh_lib.make_mesh(tiny_config().mesh, jax.devices()[:1])
  tx = optax.sgd(0.1)
  update = update_lib.Update(None, txs={"actor": tx, "critic": tx}, actor_lr=None,
                             pipelined_update=_FakePipelined())
  params = {"w": jnp.ones(3)}
  states = {m: update.init_state(m, params, mesh) for m in ("actor", "critic")}
  for m in ("actor", "critic", "actor"):  # e.g. generation, inference, a second generation
    update.whole(m, states[m])
  got = update.take_reshard_metrics()
  assert got["perf/reshard_bytes"] == 100 + 7 + 100 and got["timing_s/reshard"] >= 0
  assert update.take_reshard_metrics()["perf/reshard_bytes"] == 0  # the take started afresh
  update.whole("critic", states["critic"])
  assert update.take_reshard_metrics()["perf/reshard_bytes"] == 7
  plain = update_lib.Update(None, txs={"actor": tx}, actor_lr=None)
  assert plain.take_reshard_metrics() == {}  # a plain update never reshards
