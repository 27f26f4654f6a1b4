"""Training through the pipeline executor (mesh.stage > 1): intra_stage on == off == the plain
update, the on-disk schedule cache, and config errors that name their field.

One module fixture trains three tiny runs of 2 iterations (fused, serial 1F1B, plain) and the
tests compare them; the executor compiles at XLA optimisation level 0 to keep the file fast.
"""
import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import weakref

import jax
import numpy as np
import optax
import pytest

from rlhfuse_jax import checkpointing
from rlhfuse_jax.models import llama
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.pipeline import executor as executor_lib
from rlhfuse_jax.pipeline import program as prog
from rlhfuse_jax.pipeline import search as search_lib
from rlhfuse_jax.pipeline import schedules, stages
from rlhfuse_jax.trainer import build, pipelined, ppo
from rlhfuse_jax.trainer import update as update_lib
from rlhfuse_jax.trainer.config import PipelineConfig
from rlhfuse_jax.trainer.loop import PPOTrainer, TIMING_PREFIXES
from test_pipeline_executor import _batch
from test_trainer import tiny_config
from tests.xla_env import subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4 actor stages of 1 layer; 2 critic stages of 1 layer, 2 replicas. Mini-batch 8 rows over
# data=2: 4 rows per shard = 4 actor micro-batches = 2 replicas x 2 critic micro-batches.
PIPE = {"num_iterations": 2, "model.num_layers": 4, "critic_model.num_layers": 2,
        "pipeline.critic_pp": 2, "pipeline.actor_microbatches": 4,
        "pipeline.critic_microbatches": 2, "pipeline.search_time_s": 0.3,
        "pipeline.xla_opt_level": 0,
        # Decay on: the stage-stacked optimizer must decay exactly the plain update's leaves.
        "optim.weight_decay": 0.1}
STAGED = {"mesh.stage": 4, "mesh.data": 2}
# Compared only between the pipelined runs: identical there, not a property of the plain update.
PIPELINE_KEYS = ("pipeline/",)


def _config(cache_dir, **overrides):
  return tiny_config(**{**PIPE, "pipeline.schedule_cache_dir": str(cache_dir), **overrides})


def _params(trainer):
  return jax.device_get({m: trainer.model_params(m) for m in ("actor", "critic")})


def _deterministic(row):
  return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """{name: (trainer, history)} for fused (intra_stage on), serial (off) and plain (stage=1)."""
  root = tmp_path_factory.mktemp("pipelined")
  calls = []
  real_search = search_lib.search

  def counting_search(*args, **kwargs):
    if sys._getframe(1).f_code.co_name != "warmup":  # the kernels' tiny search, not the run's
      calls.append(args[0])
    return real_search(*args, **kwargs)

  out = {}
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(search_lib, "search", counting_search)
    for name, over, devices in (("fused", {"fusion.intra_stage": True, **STAGED}, 8),
                                ("serial", {"fusion.intra_stage": False, **STAGED}, 8),
                                ("plain", {"mesh.stage": 1, "mesh.data": 2}, 2)):
      cfg = _config(root / "cache", **over)
      if name == "fused":  # resolved as a trainer's cfg, which the resume tests restart from
        cfg = build.resolve_config(cfg, build.build_task_and_tokenizer(cfg)[1], log=False)
      mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:devices])
      trainer = PPOTrainer(cfg, str(root / name), mesh=mesh)
      # The iterations of trainer.run(), without its checkpoint writes (seconds each here) but
      # the fused run's first: run(stop_after=1) saves checkpoint 1, a copy of the workdir is
      # first_iteration's, and iteration 2 goes on in this trainer as in the uninterrupted
      # run (a second trainer that trained iteration 1 again for it: 2 x 37 s -> 46 s alone).
      history = []
      if name == "fused":
        history = [{k: v for k, v in row.items() if k != "step"}
                   for row in trainer.run(stop_after=1)]
        out["first_iteration"] = shutil.copytree(root / name, root / "first_iteration" / "wd")
      out[name] = (trainer, history + [trainer.iteration(it)
                                       for it in range(len(history), cfg.num_iterations)])
  out["search_calls"] = calls
  out["cache_dir"] = root / "cache"
  return out


def test_intra_stage_on_equals_off(runs):
  fused, h_fused = runs["fused"]
  serial, h_serial = runs["serial"]
  assert fused.update.is_pipelined
  assert fused.update.schedule_name == pipelined.FUSED
  assert serial.update.schedule_name == pipelined.SERIAL
  # Fusion fills the bubbles: fewer ticks than serial 1F1B (20 ticks for this problem).
  assert h_fused[-1]["pipeline/ticks"] < h_serial[-1]["pipeline/ticks"] == 20
  assert h_fused[-1]["pipeline/bubble"] < h_serial[-1]["pipeline/bubble"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               _params(fused), _params(serial))
  assert len(h_fused) == len(h_serial) == 2
  for a, b in zip(h_fused, h_serial):
    a, b = _deterministic(a), _deterministic(b)
    assert a.keys() == b.keys()
    for k in a:
      if k.startswith(PIPELINE_KEYS):
        continue
      np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_pipelined_equals_plain_update(runs):
  fused, h_fused = runs["fused"]
  plain, h_plain = runs["plain"]
  assert not plain.update.is_pipelined
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               _params(fused), _params(plain))
  for a, b in zip(h_fused, h_plain):
    a, b = _deterministic(a), _deterministic(b)
    assert {k for k in a if not k.startswith(PIPELINE_KEYS)} == set(b)
    for k in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
              "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
      assert k in b
    for k in b:
      np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # The agreement is not trivial: the updates moved the actor away from its initial copy
  # (the reference) by far more than the tolerance.
  moved = max(float(np.max(np.abs(a - b))) for a, b in
              zip(jax.tree.leaves(jax.device_get(plain.rollout.reference)),
                  jax.tree.leaves(_params(plain)["actor"])))
  assert moved > 1e-3


def _device_bytes(tree, device):
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)


def test_each_stage_device_holds_only_its_stages(runs):
  """Parameters and both Adam moments: a stage device holds its own layers (1/4 of the actor's,
  1/2 of the critic's) and 1/4 of each embedding and head leaf (split over the 4 stages; a leaf
  with no dimension divisible by 4, like the value head's bias, whole)."""
  fused, history = runs["fused"]
  whole = {m: fused.model_params(m) for m in ("actor", "critic")}

  def held(tree):  # what one stage device should hold of a whole model
    layers = sum(x.nbytes for k, v in tree.items() if k.startswith("layers_")
                 for x in jax.tree.leaves(v))
    tail = [x for k in ("embed", "head") for x in jax.tree.leaves(tree[k])]
    split = [executor_lib.tail_dim(x.shape, 4) >= 0 for x in tail]
    assert sum(split) >= 2  # the embedding and the head matrix at least
    return layers, sum(x.nbytes / 4 if s else x.nbytes for x, s in zip(tail, split))

  (a_layers, a_tail), (c_layers, c_tail) = held(whole["actor"]), held(whole["critic"])
  for d in fused.mesh.devices.flat:
    assert _device_bytes((fused.actor.params, fused.critic.params), d) == (
        a_layers / 4 + a_tail + c_layers / 2 + c_tail)
    mu = [s.mu for s in jax.tree.leaves(fused.actor.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
          if hasattr(s, "mu")]
    assert _device_bytes(mu, d) == a_layers / 4 + a_tail
  # The device at stage index d holds actor row d (stage d) and critic row d mod 2, which is
  # critic stage 1 - (d mod 2): the critic runs in the reverse direction.
  actor_leaf = jax.tree.leaves(fused.actor.params["layers"])[0]
  critic_leaf = jax.tree.leaves(fused.critic.params["layers"])[0]
  assert actor_leaf.shape[:2] == (4, 1) and critic_leaf.shape[:2] == (2, 1)
  stage_of = {dev: idx[2] for idx, dev in np.ndenumerate(fused.mesh.devices)}
  for leaf, rows in ((actor_leaf, lambda d: d), (critic_leaf, lambda d: d % 2)):
    for shard in leaf.addressable_shards:
      d = stage_of[shard.device]
      assert shard.index[0] == slice(rows(d), rows(d) + 1)
  whole_critic = jax.device_get(whole["critic"])
  np.testing.assert_array_equal(jax.device_get(critic_leaf)[1, 0],
                                jax.tree.leaves(whole_critic["layers_0"])[0])
  # Each iteration gathers both models whole (replicated here: tensor = fsdp = 1) for generation
  # and inference; the most loaded device receives what it lacks: 3/4 of the actor's layers,
  # 1/2 of the critic's, 3/4 of every split embedding/head leaf.
  split_tails = sum(x.nbytes for m in whole for k in ("embed", "head")
                    for x in jax.tree.leaves(whole[m][k])
                    if executor_lib.tail_dim(x.shape, 4) >= 0)
  want = a_layers * 3 / 4 + c_layers / 2 + split_tails * 3 / 4
  assert [h["perf/reshard_bytes"] for h in history] == [want, want]


# 2 stages of 2 layers for both models (the critic's rows reversed), fsdp=2 inside each stage.
SCAN_PIPE = {"mesh.stage": 2, "mesh.data": 1, "mesh.fsdp": 2, "model.num_layers": 4,
             "critic_model.num_layers": 4, "pipeline.critic_pp": 2,
             "pipeline.actor_microbatches": 2, "pipeline.critic_microbatches": 2,
             "fusion.intra_stage": False, "model.vocab_size": 64, "critic_model.vocab_size": 64}


def test_serial_rollout_splits_the_batch_over_the_stage_devices(runs):
  """On the data=2 x stage=4 mesh the serial rollout generates and scores with `stage` folded
  into `data`: each device decodes and scores 1/8 of the batch (not the 1/2 that data alone
  gives, the whole of which every stage device would run again), with the same devices'
  coordinates along the axes the weights are split over."""
  trainer = runs["serial"][0]
  assert dict(trainer.gen_mesh.shape) == {"data": 8, "fsdp": 1, "stage": 1, "tensor": 1}
  assert set(trainer.gen_mesh.devices.flat) == set(trainer.mesh.devices.flat)
  stage = trainer.rollout
  cache = stage.generator.state_sharding.cache.k  # [layers, slots, max_len, kv_heads, hd]
  slots = trainer.cfg.rollout.batch_size
  assert cache.shard_shape((1, slots, 4, 2, 2))[1] == slots // 8
  assert mesh_lib.batch_size_multiple(stage.scorer.mesh) == 8
  # The reference lives on that mesh, each device holding what it held on the training mesh.
  leaf = jax.tree.leaves(stage.reference)[0]
  assert leaf.sharding.mesh is trainer.gen_mesh
  # The plain run (stage 1) keeps one mesh for both.
  plain = runs["plain"][0]
  assert plain.gen_mesh is plain.mesh and not plain.moves_weights


@pytest.mark.parametrize("axes", [{"data": 1, "fsdp": 2, "stage": 2, "tensor": 2},
                                  {"data": 2, "fsdp": 1, "stage": 2, "tensor": 2},
                                  {"data": 1, "fsdp": 2, "stage": 4, "tensor": 1}])
def test_weights_move_to_the_folded_mesh_without_a_copy(axes):
  """fold_stage keeps each device's fsdp and tensor coordinates, so parameters sharded by
  their logical axes hold the same shard on every device on both meshes: put() relabels them
  (the same buffers), whatever the device order (fsdp > 1 reorders the devices)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(**axes))
  folded = mesh_lib.fold_stage(mesh)
  assert folded.shape["stage"] == 1 and folded.shape["data"] == axes["data"] * axes["stage"]
  for spec in (P(), P("fsdp", "tensor"), P(None, "tensor")):
    x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, spec))
    y = mesh_lib.put(x, NamedSharding(folded, spec))
    assert y.sharding == NamedSharding(folded, spec)
    ptr = {s.device: s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    assert all(ptr[s.device] == s.data.unsafe_buffer_pointer() for s in y.addressable_shards)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  # Another placement is a real move (a copy), still correct.
  x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("stage")))
  y = mesh_lib.put(x, NamedSharding(folded, P("data")))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_scanned_layers_pipeline_as_a_reshape_of_the_stack(tmp_path):
  """model.scan_layers=True through the pipeline (docs/architecture.md §3): the stage-stacked
  tree is a reshape of the scanned stack [L, ...] -> [S, L/S, ...] (the critic's rows flipped)
  and is the unrolled model's tree, placed alike; an update from it gives the unrolled update's
  parameters and metrics, and whole_fn gives them back scanned (llama.stack_layers of the
  unrolled ones), with as many bytes moved."""
  base = _config(tmp_path, **SCAN_PIPE)
  mesh = mesh_lib.make_mesh(base.mesh, jax.devices()[:4])
  init = {"actor": llama.host_random_params(base.model, 0),
          "critic": llama.host_random_params(base.critic_model, 1)}
  batch = _batch(base.algo.minibatch_size)
  out = {}
  for form, scan in (("unrolled", False), ("scanned", True)):
    cfg = dataclasses.replace(base, model=base.model.replace(scan_layers=scan),
                              critic_model=base.critic_model.replace(scan_layers=scan))
    pipelined.check_config(cfg, mesh)  # scan_layers is no reason to refuse a pipeline
    txs = {m: optax.adamw(1e-2, weight_decay=0.1, mask=stages.staged_decay_mask)
           for m in ("actor", "critic")}
    update = pipelined.make_pipelined_update_fn(
        cfg.model, cfg.critic_model, cfg.algo, cfg.rollout.temperature, txs["actor"],
        txs["critic"], mesh=mesh, config=cfg)
    staged, states, shardings = {}, {}, {}
    for m, model_cfg in (("actor", cfg.model), ("critic", cfg.critic_model)):
      params = llama.stack_layers(init[m], model_cfg.num_layers) if scan else init[m]
      whole = mesh_lib.shard_params(params, llama.logical_specs(model_cfg), mesh)
      shardings[m] = jax.tree.map(lambda x: x.sharding, whole)
      p = update.to_staged(m, whole)
      staged[m] = (jax.device_get(p), jax.tree.map(lambda x: x.sharding, p))
      states[m] = ppo.ModelState(p, update_lib.init_optimizer_state(txs[m], p, mesh))
    actor, critic, metrics = update(states["actor"], states["critic"], batch)
    back = {m: update.whole_fn(m, s.params, shardings[m])(s.params)
            for m, s in (("actor", actor), ("critic", critic))}
    out[form] = {"staged": staged, "trained": jax.device_get((actor.params, critic.params)),
                 "metrics": jax.device_get(metrics), "back": jax.device_get(back),
                 "bytes": [update.reshard_bytes(m, s.params, back[m])
                           for m, s in (("actor", actor), ("critic", critic))]}
  unrolled, scanned = out["unrolled"], out["scanned"]
  for m in ("actor", "critic"):
    (u, u_shard), (s, s_shard) = unrolled["staged"][m], scanned["staged"][m]
    jax.tree.map(np.testing.assert_array_equal, s, u)
    jax.tree.map(lambda a, b: a.is_equivalent_to(b, 4) or pytest.fail(f"{m}: {a} != {b}"),
                 s_shard, u_shard, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  # Row j of the critic holds stage 1 - j: layers 2, 3 in row 0.
  q = scanned["staged"]["critic"][0]["layers"]["attn"]["q_proj"]["kernel"]
  np.testing.assert_array_equal(q[0, 1], init["critic"]["layers_3"]["attn"]["q_proj"]["kernel"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               scanned["trained"], unrolled["trained"])
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.max(np.abs(a - b)),
                                       unrolled["trained"][0], unrolled["staged"]["actor"][0]))
  assert max(moved) > 1e-3  # the update did something
  for k, v in unrolled["metrics"].items():
    np.testing.assert_allclose(scanned["metrics"][k], v, rtol=1e-6, atol=1e-7, err_msg=k)
  for m in ("actor", "critic"):
    num_layers = base.model.num_layers if m == "actor" else base.critic_model.num_layers
    jax.tree.map(np.testing.assert_array_equal, scanned["back"][m],
                 llama.stack_layers(unrolled["back"][m], num_layers))
  assert scanned["bytes"] == unrolled["bytes"] and min(unrolled["bytes"]) > 0


@pytest.fixture(scope="module")
def first_iteration(runs):
  """A workdir of the fused run stopped after its first iteration (run(stop_after=1): its
  checkpoint 1), for the resume tests to copy."""
  return runs["first_iteration"]


def _resumable(first_iteration, tmp_path):
  """A copy of first_iteration's workdir in tmp_path, for one test to resume in."""
  return str(shutil.copytree(first_iteration, tmp_path / "wd"))


def test_pipelined_run_resumes_bitwise(runs, first_iteration, tmp_path, monkeypatch):
  """... also with the optimizer states in host memory during the resumed iteration's rollout
  (optim.offload_during_rollout, a field a resume may change): the same values come back."""
  fused, history = runs["fused"]
  workdir = _resumable(first_iteration, tmp_path)
  offload = dataclasses.replace(fused.cfg, optim=dataclasses.replace(
      fused.cfg.optim, offload_during_rollout=True))
  second = PPOTrainer(offload, workdir, mesh=fused.mesh)
  # The device arrays the moments leave: none may stay alive (and so in device memory) while
  # the rollout runs, e.g. held by a local variable of the trainer.
  left, to_host = [], mesh_lib.to_host_memory
  monkeypatch.setattr(mesh_lib, "to_host_memory", lambda tree: (
      left.extend(weakref.ref(x) for x in jax.tree.leaves(tree)), to_host(tree))[1])
  stage, seen = second.rollout, []

  def spied(params, prompts, key):  # where the stage-stacked moments are while it runs
    seen.append(({x.sharding.memory_kind for s in (second.actor, second.critic)
                  for x in jax.tree.leaves(s.opt_state)},
                 sum(r() is not None for r in left), len(left)))
    return stage(params, prompts, key)
  second.rollout = spied
  resumed = second.run()
  assert [h["step"] for h in resumed] == [2]
  assert len(seen) == 1 and seen[0][0] == {mesh_lib.HOST_MEMORY}
  assert seen[0][1:] == (0, len(jax.tree.leaves((fused.actor.opt_state,
                                                  fused.critic.opt_state))))
  for name in ("actor", "critic"):  # back where they were, each leaf as the update placed it
    assert (jax.tree.map(lambda x: x.sharding, getattr(second, name).opt_state) ==
            jax.tree.map(lambda x: x.sharding, getattr(fused, name).opt_state))
  # One device's share of both models' optimizer states (stage-stacked: split over `stage`).
  device = fused.mesh.devices.flat[0]
  share = sum(sh.data.nbytes for s in (fused.actor, fused.critic)
              for x in jax.tree.leaves(s.opt_state) for sh in x.addressable_shards
              if sh.device == device)
  assert resumed[0].pop("perf/optimizer_offload_bytes") == share > 0
  assert resumed[0]["timing_s/optimizer_offload"] > 0
  jax.tree.map(np.testing.assert_array_equal, _params(second), _params(fused))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(second.actor.opt_state),
               jax.device_get(fused.actor.opt_state))
  assert _deterministic(resumed[0]) == {"step": 2, **_deterministic(history[1])}


def test_zero1_splits_the_optimizer_state_over_the_model_copies(runs, first_iteration, tmp_path,
                                                                caplog):
  """optim.zero1 (a field a resume may change): resumed from the fused run's first iteration
  with the optimizer state split over data (2) and, for the critic, its 2 replicas, the second
  iteration gives the same weights and state as the run without it, up to float rounding (the
  gradient norm sums in another order); a device holds 1/2 of the actor's moments and 1/4 of
  the critic's layers' of what it held."""
  fused, history = runs["fused"]
  workdir = _resumable(first_iteration, tmp_path)
  cfg = dataclasses.replace(fused.cfg, optim=dataclasses.replace(fused.cfg.optim, zero1=True))
  with caplog.at_level(logging.INFO):
    second = PPOTrainer(cfg, workdir, mesh=fused.mesh)
  for name in ("actor", "critic"):  # the set-up log reads the split from the placement
    assert re.search(rf"setup: {name} on .*optimizer state .* [kMGT]?B \(split over data "
                     r"\(zero1\)\)", caplog.text), caplog.text
  with caplog.at_level(logging.WARNING):
    resumed = second.run()
  assert [h["step"] for h in resumed] == [2]
  assert re.search(r"saved with optim.zero1=False, with optim.zero1=True: .* not bitwise",
                   caplog.text), caplog.text
  def part(state, name):  # the state's leaves that mirror the parameters' `name` subtree
    return [s.mu[name] for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(
        x, "mu")) if hasattr(s, "mu")]
  # Layer rows: over data (the actor), over data and the replicas (the critic); the embedding
  # and the head, already split over all 4 stage devices: over data.
  for name, part_name, ratio in (("actor", "layers", 2), ("actor", "embed", 2),
                                 ("critic", "layers", 4), ("critic", "embed", 2)):
    for d in fused.mesh.devices.flat:
      assert (_device_bytes(part(getattr(second, name), part_name), d) * ratio ==
              _device_bytes(part(getattr(fused, name), part_name), d)), (name, part_name, d)
    # Each leaf's slices tile it: the state is split, not dropped.
    for x in jax.tree.leaves(getattr(second, name).opt_state):
      assert sum(s.data.size for s in x.addressable_shards if s.replica_id == 0) == x.size
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  jax.tree.map(close, _params(second), _params(fused))
  for name in ("actor", "critic"):
    jax.tree.map(close, jax.device_get(getattr(second, name).opt_state),
                 jax.device_get(getattr(fused, name).opt_state))
  want = {"step": 2, **_deterministic(history[1])}
  got = _deterministic(resumed[0])
  assert got.keys() == want.keys()
  for k in want:
    if isinstance(want[k], str):
      assert got[k] == want[k], k
    else:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_resuming_under_another_pipeline_layout_names_the_fields(runs, tmp_path):
  """A checkpoint of whole models (mesh.stage=1) met by a pipelined run: a clear error."""
  plain, _ = runs["plain"]
  workdir = str(tmp_path / "wd")
  saver = checkpointing.Checkpointer(workdir)
  saver.save(1, plain._state(), {"iteration": 1, "seed": plain.cfg.seed,
                                 "data": plain.dataset.state_dict()})
  saver.close()
  fused = runs["fused"][0]
  with pytest.raises(ValueError, match=r"does not fit this run's state \(stage-stacked for "
                                       r"mesh.stage=4, pipeline.critic_pp=2; .*\).*mesh.stage"):
    PPOTrainer(fused.cfg, workdir, mesh=fused.mesh).run()
  # Not damage: the checkpoint stays where it was (never set aside).
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["1"]


def test_schedule_is_searched_once_then_loaded_from_disk(runs, monkeypatch):
  # The fixture's fused run searched once (the serial and plain runs never search).
  assert len(runs["search_calls"]) == 1
  files = sorted(os.listdir(runs["cache_dir"]))
  assert len(files) == 1 and files[0].endswith(".json")
  fused = runs["fused"][0]

  def no_search(*args, **kwargs):
    raise AssertionError("searched although the schedule is cached")

  monkeypatch.setattr(search_lib, "search", no_search)
  again = PPOTrainer(fused.cfg, str(runs["cache_dir"].parent / "again"), mesh=fused.mesh)
  np.testing.assert_array_equal(again.update.executor.program.order,
                                fused.update.executor.program.order)
  assert sorted(os.listdir(runs["cache_dir"])) == files
  # Without pipeline.schedule_cache_dir the cache is the run's WORKDIR/cache/schedules: a run
  # finds its schedule there (no search), and nothing is read from or written outside it.
  own = runs["cache_dir"].parent / "own_cache"
  os.makedirs(own / "cache" / "schedules")
  shutil.copy(runs["cache_dir"] / files[0], own / "cache" / "schedules" / files[0])
  cfg = dataclasses.replace(fused.cfg, pipeline=dataclasses.replace(fused.cfg.pipeline,
                                                                    schedule_cache_dir=""))
  own_run = PPOTrainer(cfg, str(own), mesh=fused.mesh)
  np.testing.assert_array_equal(own_run.update.executor.program.order,
                                fused.update.executor.program.order)
  assert os.listdir(own / "cache" / "schedules") == files
  # Another problem (other micro-batch counts) has another cache file: it is searched.
  problem = pipelined.pipeline_problem(4, dataclasses.replace(fused.cfg.pipeline,
                                                              actor_microbatches=2))
  with pytest.raises(AssertionError, match="searched although"):
    pipelined.searched_schedule(problem, fused.cfg.pipeline)


def test_schedule_cache_dir_defaults_to_the_workdir(monkeypatch, tmp_path):
  pipe = PipelineConfig()
  assert pipelined.cache_dir(pipe, "/runs/a") == os.path.join("/runs/a", "cache", "schedules")
  explicit = dataclasses.replace(pipe, schedule_cache_dir=str(tmp_path / "shared"))
  assert pipelined.cache_dir(explicit, "/runs/a") == str(tmp_path / "shared")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # a caller without a workdir
  assert pipelined.cache_dir(pipe) == str(tmp_path / "xdg" / "rlhfuse_jax" / "schedules")


@pytest.mark.parametrize("me", [0, 1])
def test_a_schedule_search_that_fails_on_process_0_stops_every_process(monkeypatch, me):
  """Several processes: process 0 searches or loads the fused schedule and writes the cache
  alone; when that fails (an unwritable cache) every process stops at the broadcast, process 0
  with its own error. Before, process 0 left and the others waited in the update's first
  collective."""
  problem = pipelined.pipeline_problem(4, PipelineConfig())
  verdicts = []

  def verdict(ok):  # process 0's verdict reaches every process (here: the search failed)
    verdicts.append(ok)
    return ok if me == 0 else False

  def search(*args):
    if me:
      raise AssertionError("only process 0 searches")
    raise OSError("[Errno 28] No space left on device: 'cache/schedules/x.json'")
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: me)
  monkeypatch.setattr(pipelined.distributed, "main_process_verdict", verdict)
  monkeypatch.setattr(pipelined, "searched_schedule", search)
  with pytest.raises(OSError if me == 0 else RuntimeError,
                     match="No space left" if me == 0 else "process 0 failed to search"):
    pipelined.fused_order(problem, PipelineConfig(), "/runs/a")
  assert len(verdicts) == 1  # the verdict was joined
  # Nothing failing: process 0's order on every process.
  order = schedules.serial_order(problem)[:, ::-1].copy()
  monkeypatch.setattr(pipelined, "searched_schedule", lambda *a: (
      type("S", (), {"order": lambda self: order})(), ""))
  monkeypatch.setattr(pipelined.distributed, "main_process_verdict", lambda ok: True)
  monkeypatch.setattr(pipelined.multihost_utils, "broadcast_one_to_all",
                      lambda o: order if me else np.asarray(o))
  np.testing.assert_array_equal(pipelined.fused_order(problem, PipelineConfig(), "/runs/a"),
                                order)


def test_cached_schedule_for_another_problem_is_not_used(tmp_path):
  cfg = _config(tmp_path, **STAGED, **{"fusion.intra_stage": True})
  problem = pipelined.pipeline_problem(4, cfg.pipeline)
  first, path = pipelined.searched_schedule(problem, cfg.pipeline)
  # The searched schedule is a valid fused schedule no worse than the serial orders in ticks.
  serial_ticks = prog.build_program(problem, schedules.serial_order(problem), barrier=True).ticks
  assert prog.build_program(problem, first.order()).ticks < serial_ticks
  # A file under this problem's name that holds another problem is searched again, rewritten.
  other = pipelined.pipeline_problem(4, dataclasses.replace(cfg.pipeline, critic_pp=4))
  other_sched, other_path = pipelined.searched_schedule(other, cfg.pipeline)
  os.replace(other_path, path)
  again, path2 = pipelined.searched_schedule(problem, cfg.pipeline)
  assert path2 == path and again.problem == problem
  # This problem's key over another problem's schedule (a file edited or merged by hand): the
  # key alone does not make it this problem's.
  with open(path) as f:
    stored = json.load(f)
  stored["schedule"] = other_sched.to_dict()
  with open(path, "w") as f:
    json.dump(stored, f)
  again, _ = pipelined.searched_schedule(problem, cfg.pipeline)
  assert again.problem == problem
  with open(path, "w") as f:  # a damaged file is searched again too
    f.write("{not json")
  again, _ = pipelined.searched_schedule(problem, cfg.pipeline)
  assert again.problem == problem
  with open(path, "w") as f:  # JSON, not an object: an AttributeError's traceback ended the run
    f.write("[]")
  again, _ = pipelined.searched_schedule(problem, cfg.pipeline)
  assert again.problem == problem


@pytest.mark.parametrize("overrides, match", [
    ({"algo.estimator": "grpo", "rollout.samples_per_prompt": 2}, "config.algo.estimator='grpo'"),
    ({"pipeline.critic_pp": 3}, "config.pipeline.critic_pp=3 must divide mesh.stage=4"),
    ({"model.num_layers": 2}, "config.model.num_layers=2 must be divisible"),
    ({"critic_model.num_layers": 3}, "config.critic_model.num_layers=3 must be divisible"),
    # Both name the fix a resume on more devices may take (it cannot change the micro-batches).
    ({"pipeline.actor_microbatches": 3}, "config.pipeline.actor_microbatches=3 must divide"),
    ({"pipeline.actor_microbatches": 3}, "devices left over can go to mesh.tensor"),
    ({"pipeline.critic_microbatches": 4}, "config.pipeline.critic_microbatches=4 x critic"),
    ({"pipeline.critic_microbatches": 4}, "devices left over can go to mesh.tensor"),
    ({"mesh.tensor": 2, "mesh.data": 1, "critic_model.num_heads": 6,
      "critic_model.num_kv_heads": 3, "critic_model.hidden_size": 48},
     "config.critic_model.num_kv_heads=3 must be divisible by mesh.tensor=2 or divide it"),
    ({"mesh.tensor": 2, "mesh.data": 1, "model.o_bias": True},
     "config.model.o_bias=True with mesh.tensor=2"),
])
def test_config_errors_name_the_field(tmp_path, overrides, match):
  cfg = _config(tmp_path, **{**STAGED, **overrides})
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices())
  with pytest.raises(ValueError, match=re.escape(match)):
    pipelined.check_config(cfg, mesh)


def test_trainer_rejects_a_pipeline_without_critic(tmp_path):
  cfg = _config(tmp_path, **STAGED, **{"algo.estimator": "grpo",
                                       "rollout.samples_per_prompt": 2})
  with pytest.raises(ValueError, match="no actor-only pipeline"):
    PPOTrainer(cfg, str(tmp_path / "wd"), mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()))


def test_typed_config_errors(tmp_path):
  with pytest.raises(ValueError, match="config.fusion.intra_stage=True"):
    _config(tmp_path, **{"fusion.intra_stage": True, "mesh.stage": 1})
  with pytest.raises(ValueError, match="config.pipeline.critic_microbatches=-1"):
    _config(tmp_path, **{"pipeline.critic_microbatches": -1})


def test_zero_microbatches_mean_one_row_each(tmp_path):
  """pipeline.*_microbatches = 0: PIPE's counts, which are one row per micro-batch (4 rows per
  data shard; 2 per critic replica), for the same schedule problem and program."""
  optimizer = optax.adamw(1e-2)
  updates = []
  for counts in ((4, 2), (0, 0)):
    cfg = _config(tmp_path, **STAGED, **{"fusion.intra_stage": False,
                                         "pipeline.actor_microbatches": counts[0],
                                         "pipeline.critic_microbatches": counts[1]})
    mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices())
    updates.append(pipelined.make_pipelined_update_fn(
        cfg.model, cfg.critic_model, cfg.algo, 1.0, optimizer, optimizer, mesh=mesh, config=cfg))
  explicit, zero = (u.executor.program for u in updates)
  assert zero.problem == explicit.problem
  np.testing.assert_array_equal(zero.order, explicit.order)
  assert updates[1].executor.microbatch_sizes(8) == (1, 1)
  with pytest.raises(ValueError, match="config.pipeline: unknown fields"):
    _config(tmp_path, **{"pipeline.stages": 2})


def test_binary_says_how_to_get_devices(tmp_path):
  """configs/ppo_tiny.py:fused on the one CPU device of a plain process: a clear error."""
  env = subprocess_env()
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train_ppo", "--config=configs/ppo_tiny.py:fused",
       f"--workdir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "needs at least 4 devices, but jax sees 1 (cpu)" in proc.stderr
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in proc.stderr
  # 4 is the least; the README runs this config on 8 (mesh.data=-1 takes the rest)
  assert "or a multiple of it (mesh.data=-1 takes what the other axes leave: 8 devices give " \
      "it 2)" in proc.stderr


def _schedule_json(path, problem, order):
  """A schedule.json as experiments.schedule_search writes it (schedule.to_json())."""
  from rlhfuse_jax.pipeline import schedule as schedule_lib
  path.write_text(schedule_lib.from_order(problem, order).to_json() + "\n")
  return str(path)


def test_a_schedule_file_of_schedule_search_is_run_as_given(tmp_path, monkeypatch):
  """pipeline.schedule_file: a schedule_search result for the run's shape (its own durations
  and budget mode) is run instead of a search; before, a searched schedule could reach
  train_ppo only through a cache file named by a hash of the trainer's own problem."""
  from rlhfuse_jax.pipeline.graph import PipelineProblem
  pipe = PipelineConfig(critic_pp=2, actor_microbatches=4, critic_microbatches=2)
  problem = pipelined.pipeline_problem(4, pipe)
  searched_for = PipelineProblem(actor_pp=4, critic_pp=2, actor_microbatches=4,
                                 critic_microbatches=2, actor_fwd=5.0, critic_fwd=4.0,
                                 memory_budget_mode="uniform")
  order = schedules.greedy_order(searched_for)
  path = _schedule_json(tmp_path / "schedule.json", searched_for, order)
  found = pipelined.file_schedule(problem, path)
  assert found.problem == problem  # re-timed on unit durations: its makespan is ticks
  np.testing.assert_array_equal(found.order(), order)

  def no_search(*args, **kwargs):
    raise AssertionError("searched although config.pipeline.schedule_file gives the schedule")

  monkeypatch.setattr(search_lib, "search", no_search)
  cache = tmp_path / "cache"
  with_file = dataclasses.replace(pipe, schedule_file=path, schedule_cache_dir=str(cache))
  np.testing.assert_array_equal(pipelined.fused_order(problem, with_file, ""), order)
  assert not cache.exists()  # nothing searched, nothing cached
  # A file of the cache ({"key", "schedule"}) is taken too.
  cached = tmp_path / "cached.json"
  cached.write_text(json.dumps({"key": {}, "schedule": json.loads(open(path).read())}))
  np.testing.assert_array_equal(pipelined.file_schedule(problem, str(cached)).order(), order)


def test_a_schedule_file_for_another_shape_is_refused_naming_both(tmp_path):
  pipe = PipelineConfig(critic_pp=2, actor_microbatches=4, critic_microbatches=2)
  problem = pipelined.pipeline_problem(4, pipe)
  other = pipelined.pipeline_problem(4, dataclasses.replace(pipe, actor_microbatches=8))
  path = _schedule_json(tmp_path / "schedule.json", other, schedules.serial_order(other))
  with pytest.raises(ValueError, match=re.escape(
      f"config.pipeline.schedule_file={path!r} is a schedule for actor_pp=4, critic_pp=2, "
      "actor_microbatches=8, critic_microbatches=2; this run's pipeline is actor_pp=4, "
      "critic_pp=2, actor_microbatches=4, critic_microbatches=2 (mesh.stage, ") + r".*"
      + re.escape("search one on the trainer's problem with python -m experiments."
                  "schedule_search --config=configs/schedule_search.py --workdir=DIR "
                  "--config.actor_pp=4 --config.critic_pp=2 --config.actor_microbatches=4 "
                  "--config.critic_microbatches=2 --config.actor_fwd=1")):
    pipelined.file_schedule(problem, path)
  # The command searches the trainer's own problem: its shape, unit durations (one tick a
  # task) and per-device budget. With the shape alone it searched configs/schedule_search.py's
  # durations, and ppo_tiny:fused's shape trained at 28 ticks where its own search gives 26.
  from configs import schedule_search as search_config
  from rlhfuse_jax.pipeline.graph import PipelineProblem
  c = search_config.get_config()
  for flag in pipelined.search_command(problem).split(" --config.")[1:]:
    name, value = flag.split("=")
    setattr(c, name, type(getattr(c, name))(value))
  assert PipelineProblem.from_config(c) == problem
  with pytest.raises(FileNotFoundError, match=r"config\.pipeline\.schedule_file='/nonexistent"
                                              r"/schedule\.json': no such file"):
    pipelined.file_schedule(problem, "/nonexistent/schedule.json")
  # schedule_search's workdir for its schedule.json: named as the field (a bare
  # IsADirectoryError did not say which)
  with pytest.raises(ValueError, match=rf"config\.pipeline\.schedule_file='{tmp_path}' is a "
                                       r"directory; expected a file \(schedule_search writes "
                                       rf"{tmp_path}/schedule\.json\)"):
    pipelined.file_schedule(problem, str(tmp_path))
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match=r"schedule_file=.*bad\.json': not JSON"):
    pipelined.file_schedule(problem, str(bad))
  bad.write_text('{"makespan": 3}')
  with pytest.raises(ValueError, match=r"bad\.json': not a schedule \(KeyError"):
    pipelined.file_schedule(problem, str(bad))


def test_a_schedule_file_over_its_own_memory_budget_is_refused(tmp_path):
  """A schedule.json whose order holds more in-flight activations than the budget it states
  (tasks reordered by hand: every forward first, GPipe-like) was trained without a word, the
  executor's activation buffers grown to match; refused, naming the devices."""
  from rlhfuse_jax.pipeline.graph import AF, CF
  pipe = PipelineConfig(critic_pp=2, actor_microbatches=4, critic_microbatches=2)
  problem = pipelined.pipeline_problem(4, pipe)
  order = schedules.serial_order(problem)
  # Forwards first on every device, each kind's micro-batches in their order (stable sort).
  gpipe = np.array([sorted(row, key=lambda k: k not in (AF, CF)) for row in order], np.int8)
  path = _schedule_json(tmp_path / "gpipe.json", problem, gpipe)
  with pytest.raises(ValueError, match=r"gpipe\.json'\: its order holds more in-flight "
                                       r"activations than the memory budget it states "
                                       r"\(device 0: \d+ > \d+"):
    pipelined.file_schedule(problem, path)


def test_a_schedule_file_of_another_shape_stops_the_run_at_validation(tmp_path, monkeypatch):
  """The run's check (trainer/validate.py) reads the file before anything is built; serial
  1F1B (fusion.intra_stage=False) runs no file, which it says."""
  from rlhfuse_jax.trainer import validate as validate_lib
  cfg = _config(tmp_path, **STAGED, **{"fusion.intra_stage": True})
  mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices())
  other = pipelined.pipeline_problem(4, dataclasses.replace(cfg.pipeline, actor_microbatches=2))
  path = _schedule_json(tmp_path / "schedule.json", other, schedules.serial_order(other))
  cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, schedule_file=path))
  with pytest.raises(ValueError, match=r"is a schedule for actor_pp=4, critic_pp=2, "
                                       r"actor_microbatches=2"):
    validate_lib.validate(cfg, mesh)
  seen = []
  monkeypatch.setattr(validate_lib.logging, "warning", lambda msg, *a: seen.append(msg % a))
  validate_lib.validate(dataclasses.replace(
      cfg, fusion=dataclasses.replace(cfg.fusion, intra_stage=False)), mesh)
  assert [w for w in seen if "schedule_file" in w] == [
      f"config.pipeline.search_time_s=0.3, config.pipeline.schedule_cache_dir={str(tmp_path)!r}, "
      f"config.pipeline.schedule_file={path!r} not used: fusion.intra_stage=False runs serial "
      "1F1B (they give the fused schedule or steer its search)"], seen
