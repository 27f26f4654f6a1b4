"""plan_check on the tiny plan: result.json holds every field, and what it reports from shapes
equals the memory of the same update compiled from real arrays built as the trainer builds them."""
import copy as copy_lib
import dataclasses
import json
import logging as std_logging
import os
import re
import types

import jax
import ml_collections
import numpy as np
import pytest

from configs import plan_check as plan_config
from experiments import plan_programs
from rlhfuse_jax.generation import engine
from rlhfuse_jax.generation import fused
from rlhfuse_jax.generation import instances as inst_lib
from rlhfuse_jax.inference import scoring
from rlhfuse_jax.models import llama
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.sim import hardware
from rlhfuse_jax.trainer import ppo
from rlhfuse_jax.trainer import update as update_lib

KEYS = ("argument_bytes", "output_bytes", "temp_bytes", "peak_bytes", "flops_per_device",
        "analytic", "replication", "hbm_bytes", "fits", "compile_s")
ANALYTIC = {"train_step": ("params_bytes", "grads_bytes", "optimizer_bytes",
                           "activations_bytes", "flops_per_device"),
            "decode": ("params_bytes", "kv_cache_bytes", "flops_per_device"),
            "inference": ("params_bytes", "activations_bytes", "flops_per_device"),
            "prefill": ("params_bytes", "kv_cache_bytes", "activations_bytes", "logits_bytes",
                        "flops_per_device")}


def _real_args(cfg, mesh, tx, update):
  """Real states and batch, placed as trainer/loop.py places them (stage-stacked: pp > 1; the
  optimizer state split over data: trainer/update.Update.init_state with optim.zero1)."""
  states = []
  for i, (name, model) in enumerate((("actor", cfg.actor), ("critic", cfg.critic))):
    params = mesh_lib.shard_params(llama.host_random_params(model, i),
                                   llama.logical_specs(model), mesh)
    if cfg.pp > 1:
      params = update.to_staged(name, params)
    shardings = update_lib.optimizer_state_shardings(tx, params, mesh, zero1=cfg.zero1)
    states.append(ppo.ModelState(params, jax.jit(tx.init, out_shardings=shardings)(params)))
  batch = {k: mesh_lib.put(np.zeros(shape, dt), mesh_lib.batch_sharding(mesh, len(shape)))
           for k, (shape, dt) in plan_programs.batch_shapes(cfg).items()}
  return (*states, batch)


def _device0_bytes(tree) -> int:
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == dev)


def test_tiny_end_to_end_and_agrees_with_real_arrays(tmp_path):
  """... with the GPU presets' optimizer: a float32 copy of the weights and float32 moments,
  split over the data axis (optim.master_weights, optim.zero1)."""
  cfg = plan_programs.PlanConfig.from_config_dict(plan_config.get_config("tiny"))
  cfg = dataclasses.replace(cfg, master_weights=True, zero1=True)
  assert cfg.dp > 1  # something to split over
  result = plan_programs.run_and_write(cfg, str(tmp_path))
  with open(os.path.join(tmp_path, "result.json")) as f:
    stored = json.load(f)
  for name in (*plan_programs.PROGRAMS, "prefill"):
    p = stored["programs"][name]
    for key in KEYS:
      assert key in p, (name, key)
    for key in ANALYTIC[name]:
      assert p["analytic"][key] > 0, (name, key)
    assert p["peak_bytes"] == (p["argument_bytes"] + p["output_bytes"] + p["temp_bytes"] -
                               p["alias_bytes"])
    assert p["fits"] is True and p["flops_per_device"] > 0
  # Generation and inference run on devices that keep the training state (its arguments); a
  # freed instance loads the critic's copy beside the reference (generation/fused.py
  # InferenceQueue._load places every scoring model at once), decode has no model beside it.
  state = stored["programs"]["train_step"]["argument_bytes"]
  critic = plan_programs._nbytes(llama.param_shapes(cfg.critic)) / cfg.gen_tp
  for name, beside in (("decode", 0), ("prefill", 0), ("inference", critic)):
    p = stored["programs"][name]
    assert p["resident_train_bytes"] == state > 0
    assert p["resident_model_bytes"] == beside
    assert p["peak_with_train_state_bytes"] == p["peak_bytes"] + state + beside
    assert p["fits"] == (p["peak_with_train_state_bytes"] <= p["hbm_bytes"])
    assert p["offloaded_optimizer_bytes"] == 0  # the tiny plan keeps its moments on device
  # The decode step's dot FLOPs are exactly the analytic count (no repeated work at gen_tp 1..).
  assert abs(stored["programs"]["decode"]["replication"] - 1.0) < 1e-6
  # Prefill (compiled since a review found it the largest program of an instance): its output
  # is the whole new KV cache, which decode takes as an argument.
  prefill, decode = stored["programs"]["prefill"], stored["programs"]["decode"]
  assert prefill["output_bytes"] >= prefill["analytic"]["kv_cache_bytes"]
  assert prefill["analytic"]["kv_cache_bytes"] == decode["analytic"]["kv_cache_bytes"]
  # A consolidation's migration (compiled since 2026-12-05): the instance's weights stay beside
  # it, read by neither its gather nor its scatter.
  mig = stored["programs"]["migrate"]
  actor = plan_programs._nbytes(llama.param_shapes(cfg.actor)) / cfg.gen_tp
  assert mig["resident_model_bytes"] == actor and mig["resident_train_bytes"] == state
  assert mig["peak_with_train_state_bytes"] == mig["peak_bytes"] + state + actor
  assert mig["replication"] is None and mig["flops_per_device"] == 0
  assert stored["layers_compiled"]["reduced"] is False
  assert stored["backend"] == {"platform": "cpu", "device_kind": "cpu", "device_count": 8,
                               "local_device_count": 8, "process_count": 1,
                               "mock_gpu_topology": None}

  # The same update from real arrays: same argument bytes on device 0, same temp.
  mesh = plan_programs.train_mesh(cfg)
  tx = plan_programs.make_optimizer(staged=cfg.pp > 1, master_weights=True)
  update, _ = plan_programs.make_update(cfg, mesh, tx, str(tmp_path))
  assert cfg.pp > 1  # the staged (pipelined) state is the one checked here
  args = _real_args(cfg, mesh, tx, update)
  train = result["programs"]["train_step"]
  # jit drops arguments the program never reads: ref_logp (the KL is in the reward here).
  used = (*args[:2], {k: v for k, v in args[2].items() if k != "ref_logp"})
  assert _device0_bytes(used) == train["argument_bytes"]
  real = update.lower(*args).compile().memory_analysis()
  assert real.argument_size_in_bytes == train["argument_bytes"]
  assert real.temp_size_in_bytes == train["temp_bytes"]
  # The moments' share of those arguments, what offload_optimizer takes off decode's and
  # inference's resident state (the trainer's optim.offload_during_rollout).
  moments = _device0_bytes([s.opt_state for s in args[:2]])
  assert train["optimizer_state_bytes"] == moments > 0
  # Each leaf of the float32 copy (and so of each moment) is split over data = 2 at least
  # beyond its parameter (the embedding and head, which the stages split but fsdp does not,
  # over data x fsdp), but for the value head's one-element bias.
  for state in args[:2]:
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state.master)):
      shard = lambda x: x.addressable_shards[0].data.size
      assert shard(m) * cfg.dp <= shard(p) or p.size == 1, (p.shape, m.sharding)

  # The actor's hand-over to the instances on the training devices, made for real as the
  # trainer makes it: Update.whole's copy (moving: each stage's layers where they are; these
  # unrolled layers are gathered), then FusedGenerator.place_actor onto instances cut from the
  # training mesh's devices as the trainer cuts them. The compiled reshard reads that copy and
  # writes what device 0 then holds of its instance.
  placement = stored["programs"]["placement"]
  assert set(placement["parts"]) == {"unstack_actor", "unstack_critic", "reshard"}
  trainer_update = update_lib.Update(None, txs={"actor": tx}, actor_lr=None,
                                     pipelined_update=update)
  whole = mesh_lib.shard_params(llama.host_random_params(cfg.actor, 0),
                                llama.logical_specs(cfg.actor), mesh)
  copy = trainer_update.whole("actor", trainer_update.init_state("actor", whole, mesh),
                              moving=True)
  reshard = placement["parts"]["reshard"]
  # (an output tuple's 8-byte pointers)
  assert (placement["parts"]["unstack_actor"]["output_bytes"] - 8 * len(jax.tree.leaves(copy))
          == _device0_bytes(copy))
  devices = list(mesh.devices.flat)
  n = placement["instances"]
  instances = [inst_lib.GenerationInstance(i, m, cfg.actor, plan_programs.make_instance(cfg)
                                           .sampling, slots=cfg.gen_slots,
                                           prompt_len=cfg.prompt_len)
               for i, m in enumerate(inst_lib.split_devices(devices, n, cfg.gen_tp))]
  generator = types.SimpleNamespace(instances=instances, local=list(range(n)), cfg=cfg.actor,
                                    config=types.SimpleNamespace(instance_devices=cfg.gen_tp),
                                    _actor_layouts={})
  generator._actor_layouts_of = lambda p: fused.FusedGenerator._actor_layouts_of(generator, p)
  placed = fused.FusedGenerator.place_actor(generator, copy)
  assert devices[0] in instances[0].devices

  def on_device0(x):
    return next(s.data for s in x.addressable_shards if s.device == devices[0])
  # The leaves place_actor left where they were (the same buffers: the replicated norms) are
  # not in the compiled reshard; the others are its argument and output.
  moved = [(x, y) for x, y in zip(jax.tree.leaves(copy), jax.tree.leaves(placed[0]))
           if on_device0(x).unsafe_buffer_pointer() != on_device0(y).unsafe_buffer_pointer()]
  assert 0 < len(moved) < len(jax.tree.leaves(copy))
  assert _device0_bytes([x for x, _ in moved]) == reshard["argument_bytes"]
  assert _device0_bytes([y for _, y in moved]) == reshard["output_bytes"] - 8 * len(moved) > 0
  # Onto an asynchronous run's generation group the same copy is made on these devices (and
  # put onto the group's): the conversion alone is counted, the actor's (the group scores no
  # values asynchronously).
  group = dataclasses.replace(cfg, generation="mesh", generation_devices=4, group_critic=False)
  alone = plan_programs.placement_programs(group, mesh, update)["placement"]
  assert set(alone["parts"]) == {"unstack_actor"} and alone["instances"] == 0
  assert alone["parts"]["unstack_actor"] == placement["parts"]["unstack_actor"] | {
      "compile_s": alone["parts"]["unstack_actor"]["compile_s"]}

  programs = result["programs"]
  plan_programs.beside_train_state(programs, 1.0, offload_optimizer=True)
  for name in ("decode", "inference"):
    p = programs[name]
    assert p["resident_train_bytes"] == train["argument_bytes"] - moments
    assert p["peak_with_train_state_bytes"] == (p["peak_bytes"] + p["resident_train_bytes"] +
                                                p["resident_model_bytes"])
    assert p["fits"] is False and p["fits_alone"] is True  # judged against the 1-byte HBM


@pytest.mark.parametrize("rows", [1, 2, 0])
def test_a_migration_copies_at_most_migration_rows_slots_beside_the_cache(rows):
  """plan_check's `migrate`: the source's gather outputs a copy of the largest bucket's rows
  (gen_slots 4, or migration_rows where smaller: the engine's own buckets) beside the cache it
  reads; the target's scatter writes them into its donated cache."""
  cfg = plan_programs.PlanConfig.from_config_dict(plan_config.get_config("tiny"))
  cfg = dataclasses.replace(cfg, migration_rows=rows)
  m = plan_programs.migrate_program(cfg)
  want = rows or cfg.gen_slots
  assert m["rows"] == want
  gather, scatter = m["parts"]["gather"], m["parts"]["scatter"]
  cache = m["analytic"]["kv_cache_bytes"]
  # (the state's few per-slot counters and the index vector beside the KV rows)
  assert gather["output_bytes"] == pytest.approx(cache * want / cfg.gen_slots, rel=0.05)
  assert gather["argument_bytes"] == pytest.approx(cache, rel=0.05)
  assert scatter["alias_bytes"] == pytest.approx(cache, rel=0.05)
  assert m["peak_bytes"] == max(gather["peak_bytes"], scatter["peak_bytes"])
  assert m["peak_bytes"] >= cache * (1 + want / cfg.gen_slots)


def test_paper_pairs_generate_with_the_simulators_slots():
  """configs/plan_check.py's training plans are sim/training_sim.best_plan's and its generation
  plans sim/iteration_sim.gen_plan's (h100_sxm, 256 devices, prompts up to 1024 + 1024 new
  tokens), at each pair's generation tp, for the
  trainer's engine (every slot prefilled) beside the training state; the state the simulator
  charges is within 30 % of what plan_check's kept result measured (the train step's
  arguments: weights, AdamW state and a batch)."""
  from rlhfuse_jax.sim import cost_model, hardware, shapes
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import training_sim as ts
  cost = cost_model.CostModel(hardware.HARDWARE["h100_sxm"])
  kept = os.path.join(os.path.dirname(__file__), "..", "experiments", "results",
                      "plan_check_2026-12-05")
  for pair, plan in plan_config.PAPER_PAIRS.items():
    actor, critic = pair.split("/")
    wl = it.Workload(actor=shapes.get_shape(f"llama-{actor}"),
                     critic=shapes.get_shape(f"llama-{critic}", "scalar"), num_devices=256,
                     max_new_tokens=1024, kv_at_max_prompt=True)
    c = plan_config.get_config(pair)
    prompts, resp = wl.sample_lengths()
    best, _ = ts.best_plan(cost, wl.actor, wl.critic, 256, wl.minibatch, 1,
                           float(np.mean(prompts + resp)), wl.num_minibatches,
                           padded_len=wl.padded_len, head_positions=1024)
    assert (c.pp, c.critic_pp, c.tp, c.dp) == (best.actor_pp, best.critic_pp, best.tp,
                                               best.dp), pair
    state = it.train_state_bytes(cost, wl, it.SimOptions(), plan["gen_tp"])
    with open(os.path.join(kept, pair.replace("/", "_"), "result.json")) as f:
      measured = json.load(f)["programs"]["train_step"]["argument_bytes"]
    assert state == pytest.approx(measured, rel=0.3), pair
    got = it.gen_plan(cost, wl, plan["gen_tp"], np.array([1024]), 256, state)
    assert got.slots == plan["gen_slots"], (pair, got)
    assert it.gen_plan(cost, wl, plan["gen_tp"], np.array([1024]), 256).slots >= got.slots
    assert (c.gen_tp, c.gen_slots) == (plan["gen_tp"], plan["gen_slots"])
    assert not c.offload_optimizer


def test_per_layer_upcast_drops_the_hoisted_float32_weight_copy():
  """bfloat16 weights on XLA:CPU: the decode chunk and the reference forward are compiled per
  layer (scanned, hoisting off) and as configured, and the smaller temp is reported. Either way
  the report holds no more than about one layer's float32 copy (jax 0.10's XLA:CPU hoists the
  whole copy out of the loops as configured; jax 0.11.2's does not, and per layer is then the
  larger). The FLOPs are the same program's."""
  c = plan_config.get_config("tiny")
  c.actor.update(param_dtype="bfloat16", dtype="bfloat16", hidden_size=128,
                 intermediate_size=256, num_heads=4, num_kv_heads=4)
  c.gen_tp = 1
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  assert cfg.cpu_upcast == "per_layer" and plan_programs.per_layer_upcast(cfg)
  progs = plan_programs.instance_programs(cfg)
  a = cfg.actor
  layer_f32 = 4 * (4 * a.hidden_size ** 2 + 3 * a.hidden_size * a.intermediate_size)
  plain = plan_programs.instance_programs(dataclasses.replace(cfg, cpu_upcast="as_compiled"))
  for name in ("decode", "inference"):
    p, rec = progs[name], progs[name]["cpu_upcast"]
    assert rec["mode"] == "per_layer" and rec["per_layer"]["scan_layers"], name
    both = {k: rec[k]["temp_bytes"] for k in ("per_layer", "as_compiled")}
    assert p["temp_bytes"] == min(both.values()) == both[rec["used"]], (name, rec)
    assert p["peak_bytes"] == rec[rec["used"]]["peak_bytes"]
    assert p["temp_bytes"] < 1.5 * layer_f32, (name, p["temp_bytes"], rec)
    # as_compiled: the plain compile's own figures, with the same dot FLOPs.
    assert plain[name]["cpu_upcast"] == {"mode": "as_compiled", "scan_layers": False}
    assert rec["as_compiled"]["temp_bytes"] == plain[name]["temp_bytes"]
    assert plain[name]["flops_per_device"] == p["flops_per_device"]
  hoists = plain["decode"]["temp_bytes"] >= a.num_layers * layer_f32  # the whole copy
  assert progs["decode"]["cpu_upcast"]["used"] == ("per_layer" if hoists else "as_compiled")
  # The table says which temp is the scanned compile's, and the unrolled program's own.
  scanned = [n for n, p in progs.items() if p.get("cpu_upcast", {}).get("used") == "per_layer"]
  notes = plan_programs.per_layer_notes({"programs": progs})
  assert len(notes) == (1 if scanned else 0), notes
  for name in scanned:
    own = plan_programs._gb(plain[name]["temp_bytes"])  # pylint: disable=protected-access
    assert f"{name} {own}" in notes[0], (name, own, notes)
  assert not plan_programs.per_layer_notes({"programs": plain})
  c.cpu_upcast = "gpu"
  with pytest.raises(ValueError, match="config.cpu_upcast='gpu': expected one of"):
    plan_programs.PlanConfig.from_config_dict(c)


def _tiny_mesh_generation():
  """The tiny pair on the unpipelined mesh data 2 x fsdp 2 x tensor 2, generating and scoring
  there (the trainer's default plan.generation), two accumulated micro-batches per update."""
  c = plan_config.get_config("tiny")
  c.pp = c.critic_pp = 1
  c.dp, c.fsdp, c.tp = 2, 2, 2
  c.minibatch_size, c.microbatch_size = 8, 1  # 2 rows per data shard, 1 at a time
  c.generation, c.gen_slots = "mesh", 8
  return c


def test_mesh_generation_and_accumulated_update_split_the_work(tmp_path):
  cfg = plan_programs.PlanConfig.from_config_dict(_tiny_mesh_generation())
  assert (cfg.gen_devices, cfg.gen_model_shards) == (8, 4)
  result = plan_programs.run_and_write(cfg, str(tmp_path))
  train = result["programs"]["train_step"]
  assert train["accumulated_microbatches"] == 2
  assert train["analytic"]["grad_accumulator_bytes"] > 0
  assert abs(train["replication"] - 1.0) < 0.1, train["replication"]
  # Decode and scoring over the data axes of the training mesh: each device its rows only
  # (measured 1.00 and 1.05). The scoring forward without llama.shard_activations repeats work
  # over fsdp: 1.15 here, 1.36 on 13B.
  for name, bound in (("decode", 1.02), ("inference", 1.07)):
    p = result["programs"][name]
    assert p["replication"] < bound, (name, p["replication"])
    assert p["resident_train_bytes"] == train["argument_bytes"]
  assert result["plan"]["generation"] == "mesh"
  # Collectives counted and timed per program: the update sums the data shards' gradients.
  sync = train["collective_bytes"]["all-reduce"] + train["collective_bytes"]["reduce-scatter"]
  assert sync > 0 and train["collective_s"] > 0 and train["unread_collective_groups"] == 0
  # At the program's widths too (read from XLA's dump before XLA:CPU widens 16-bit ones): never
  # more than as compiled.
  for p in result["programs"].values():
    assert all(p["program_collective_bytes"][k] <= v for k, v in p["collective_bytes"].items())
    assert p["program_collective_s"] <= p["collective_s"]
  assert result["programs"]["decode"]["analytic"]["hbm_s"] > 0
  lines = plan_programs.table(result)
  assert any(line.startswith("time bounds on h100_sxm") for line in lines)
  # Every figure of the KB-sized programs reads as itself in its column's unit (GB, s), not as
  # 0.00 (the table printed nothing else here).
  names = plan_programs.program_names(result)
  k = len(names)
  assert names == ["train_step", "decode", "inference", "prefill"], names
  for line, name in zip(lines[1:1 + k], names):
    p = result["programs"][name]
    cells = line.split()
    assert cells[0] == name
    for cell, x in zip(cells[1:5], (p["argument_bytes"], p["output_bytes"], p["temp_bytes"],
                                    p["peak_bytes"])):
      assert float(cell) == pytest.approx(x / 1e9, rel=0.01), (name, line)
  for line, name in zip(lines[k + 3:2 * k + 3], names):
    p = result["programs"][name]
    coll_gb, coll_s = (float(c) for c in line.split()[1:3])
    assert coll_gb == pytest.approx(sum(p["collective_bytes"].values()) / 1e9, rel=0.05), line
    assert coll_s == pytest.approx(p["collective_s"], rel=0.05), line
  # The tiny models' dots take next to nothing, so every program here outlasts them on its links
  # thousands of times over, but for milliseconds at most: no note (LINK_BOUND_MIN_S).
  assert plan_programs.link_bound_notes(result) == [] and lines[-2].startswith("prefill")
  assert lines[-1].startswith("verdict: every program fits in"), lines[-1]
  # Without the floor every program is bound by its links, and the notes name this plan's
  # causes: mesh generation and per-micro-batch accumulation.
  notes = plan_programs.link_bound_notes(result, min_s={})
  assert len(notes) == k
  assert "algo.gradient_sync='once'" in notes[0] and notes[0].startswith("train_step:")
  assert "configs/ppo_llama.py:fused/<pair>" in notes[0]  # fsdp 2: a pipeline gathers nothing
  assert all("plan.generation='instances'" in n for n in notes[1:])
  result["plan"]["gradient_sync"] = "once"
  assert "gradient_sync" not in plan_programs.link_bound_notes(result, min_s={})[0]


def _scaled_result(scale: float) -> dict:
  """A result.json's table fields, its byte, FLOP and second figures times `scale`: 1 is a
  LLaMA-preset-sized plan, 1e-6 a tiny one."""
  def program(coll_s):
    return {"argument_bytes": 7.22e9 * scale, "output_bytes": 0.81e9 * scale,
            "temp_bytes": 2.74e9 * scale, "peak_bytes": 10.77e9 * scale,
            "peak_with_train_state_bytes": 17.99e9 * scale, "hbm_bytes": 80e9, "fits": True,
            "analytic": {"total_bytes": 10.48e9 * scale, "hbm_s": 0.005 * scale},
            "flops_per_device": 8.961e12 * scale, "replication": 1.05, "compile_s": 4.6,
            "collective_bytes": {"all-gather": 9.6e9 * scale}, "collective_s": coll_s * scale,
            "program_collective_bytes": {"all-gather": 4.8e9 * scale},
            "program_collective_s": coll_s * scale / 2, "compute_s": 0.01 * scale}
  return {"plan": {"hardware": "h100_sxm", "generation": "mesh", "fsdp": 4, "pp": 2},
          "programs": {"train_step": program(1.5), "decode": program(0.13),
                       "inference": program(0.3)}}


def test_the_table_ends_with_a_verdict_naming_what_does_not_fit():
  """A plan that does not fit ended with the table's `fits False` cells alone, and one
  compiled with fewer layers (config.layers) said `fits True` of those layers only: the last
  line now says which program does not fit, what would shrink its largest term, and that a
  reduced compile is no verdict on the whole models."""
  result = _scaled_result(1.0)
  train = result["programs"]["train_step"]
  train.update(fits=False, temp_bytes=119.27e9, argument_bytes=14.39e9, peak_bytes=133.66e9)
  result["layers_compiled"] = {"actor": 8, "actor_full": 32, "critic": 4, "critic_full": 16,
                               "reduced": True}
  last = plan_programs.table(result)[-1]
  assert result["plan"]["pp"] > 1
  assert last == ("verdict: DOES NOT FIT: train_step (peak 133.66 of 80.00 GB; largest: "
                  "temporaries: more micro-batches (microbatch_size, the rows of one: a run's "
                  "pipeline.actor_microbatches / critic_microbatches), remat (a run's "
                  "model.remat)) -- for 8 of 32 actor layers and 4 of 16 critic layers "
                  "(config.layers): not a verdict on the whole models")
  # each program's own knob, with the run's field (it was "smaller or more micro-batches")
  inference = result["programs"]["inference"]
  inference.update(fits=False, temp_bytes=100e9, peak_with_train_state_bytes=0.0)
  assert ("largest: temporaries: smaller micro-batches (inference_microbatch: a run's "
          "fusion.inference_micro_batch, 0 = the slots))") in plan_programs.verdict(result)
  inference.update(fits=True)
  result["plan"]["pp"] = 1
  assert ("largest: temporaries: smaller micro-batches (microbatch_size: a run's "
          "algo.microbatch_size), remat (a run's model.remat))") in plan_programs.verdict(result)
  result["plan"]["pp"] = 8
  train.update(temp_bytes=1e9, argument_bytes=90e9)
  assert ("largest: arguments: zero1 (a run's optim.zero1), fsdp, more stages or tensor "
          "devices)") in plan_programs.verdict(result)
  result["plan"]["zero1"] = True  # already split: not proposed again
  assert "largest: arguments: fsdp, more stages" in plan_programs.verdict(result)


def test_a_hand_over_that_does_not_fit_names_the_part_that_adds_the_most():
  """placement's verdict: its peak is the training state plus its costliest part, and the
  remedy that part's: a pipelined actor's conversion gathers unrolled layers (scanned layers),
  or holds one stage's layers (more splitting); the reshard onto the instances holds their
  shares (larger instances)."""
  result = _scaled_result(1.0)
  result["layers_compiled"] = {"reduced": False}
  result["plan"].update(generation="instances", pp=8, scan_layers=False)
  parts = {"unstack_actor": {"argument_bytes": 1e9, "output_bytes": 50e9, "temp_bytes": 11.5e9},
           "reshard": {"argument_bytes": 50e9, "output_bytes": 2e9, "temp_bytes": 0.0}}
  over = {"unstack_actor": 61.5e9, "reshard": 52e9}
  result["programs"]["placement"] = {
      **result["programs"]["decode"], "parts": parts, "fits": False, "resident_train_bytes": 20e9,
      "resident_model_bytes": 0.0, "over_state_bytes": over,
      "peak_with_train_state_bytes": 81.5e9, "replication": None}
  scan = ("scanned layers (scan_layers: a run's model.scan_layers; a pipelined model is then "
          "handed over split over the stages, not gathered)")
  assert plan_programs.verdict(result) == (
      "verdict: DOES NOT FIT: placement (peak 81.50 of 80.00 GB with the training state; "
      f"largest: arguments: {scan})")
  result["plan"]["scan_layers"] = True
  assert plan_programs.verdict(result).endswith(
      "largest: arguments: fsdp, more stages or tensor devices)")
  over.update(reshard=70e9)  # the instances' shares now
  assert plan_programs.verdict(result).endswith(
      "largest: arguments: more devices per instance (gen_tp: a run's "
      "fusion.instance_devices or plan.generation_tp))")
  # The training state the largest term: offload first, but never beside a generation group
  # (the trainer refuses optim.offload_during_rollout there).
  result["programs"]["placement"]["resident_train_bytes"] = 75e9
  assert plan_programs.verdict(result).endswith(
      "largest: the training state beside it: offload_optimizer (a run's "
      "optim.offload_during_rollout), zero1 (a run's optim.zero1), fsdp, more stages or tensor "
      "devices)")
  result["plan"]["generation_devices"] = 4
  assert plan_programs.verdict(result).endswith(
      "largest: the training state beside it: zero1 (a run's optim.zero1), fsdp, more stages "
      "or tensor devices)")
  line = next(x for x in plan_programs.table(result) if x.startswith("placement"))
  assert line.split()[10] == "-"  # replication: a reshard computes nothing
  assert not any(n.startswith("placement") for n in plan_programs.link_bound_notes(
      result, min_s={}))


def test_the_hand_over_has_the_training_state_beside_it_also_for_a_generation_group():
  """The conversion of a pipelined actor runs on the training devices wherever the copy goes:
  beside the whole training state, less the optimizer state only where the rollout has moved
  it to host memory (never beside a generation group: the trainer refuses that offload)."""
  def programs():
    return {"train_step": {"argument_bytes": 10.0, "optimizer_state_bytes": 4.0,
                           "peak_bytes": 20.0, "fits": True},
            "decode": {"analytic": {"params_bytes": 3.0}, "peak_bytes": 5.0, "fits": True},
            "inference": {"analytic": {"params_bytes": 3.0}, "peak_bytes": 5.0, "fits": True},
            "placement": {"over_state_bytes": {"unstack_actor": 7.0, "reshard": 2.0},
                          "peak_bytes": 9.0, "fits": True}}
  for group, group_critic, resident in ((False, 0.0, 6.0), (True, 0.0, 10.0), (True, 1.0, 10.0)):
    out = programs()
    plan_programs.beside_train_state(out, 16.5, True, group, group_critic)
    p = out["placement"]
    assert (p["resident_train_bytes"], p["resident_model_bytes"]) == (resident, 0.0)
    assert p["peak_with_train_state_bytes"] == resident + 7.0
    assert p["fits"] == (resident + 7.0 <= 16.5) and p["fits_alone"] is True


def test_a_prefill_that_does_not_fit_names_the_cache_it_writes():
  """An instance's prefill writes the whole new KV cache (its output; its arguments are the
  weights alone): the paper's 33b/13b pair's came to 85.04 GB with the training state on 80 GB
  devices, and the verdict named its arguments (the weights) with their remedies, the output
  being no term. The output not written into a donated argument is a term now, with what
  shrinks a cache: fewer slots, shorter sequences, larger instances (on instances)."""
  result = _scaled_result(1.0)
  result["layers_compiled"] = {"reduced": False}
  result["plan"]["generation"] = "instances"
  result["programs"]["prefill"] = {
      **result["programs"]["decode"], "argument_bytes": 16.5e9, "output_bytes": 55.4e9,
      "alias_bytes": 0, "temp_bytes": 7.26e9, "peak_bytes": 79.14e9, "fits": False,
      "fits_alone": True, "resident_train_bytes": 5.9e9, "peak_with_train_state_bytes": 85.04e9}
  line = plan_programs.verdict(result)
  assert line.startswith("verdict: DOES NOT FIT: prefill (peak 85.04 of 80.00 GB with the "
                         "training state; largest: outputs: fewer slots per instance"), line
  assert "shorter sequences (seq_len" in line and "more devices per instance (gen_tp" in line
  result["plan"]["generation"] = "mesh"  # no instances to widen
  assert "gen_tp" not in plan_programs.verdict(result)
  # Decode writes its cache into the donated state: no output term.
  decode = result["programs"]["decode"]
  assert decode["output_bytes"] - decode.get("alias_bytes", 0) <= decode["argument_bytes"]


def test_a_migration_that_does_not_fit_names_the_rows_it_copies():
  """A consolidation's migration (the `migrate` program): its cache as an argument, the copy
  of the rows it moves as its output, the instance's weights beside it. Over the HBM with the
  cache the largest term, the remedy is fewer rows at once (fusion.migration_rows) or fewer
  slots, not the arguments' fsdp or stages (which do not split an instance's cache)."""
  result = _scaled_result(1.0)
  result["layers_compiled"] = {"reduced": False}
  result["plan"]["generation"] = "instances"
  result["programs"]["migrate"] = {
      **result["programs"]["decode"], "argument_bytes": 47.4e9, "output_bytes": 40.9e9,
      "alias_bytes": 40.9e9, "temp_bytes": 10.5e9, "peak_bytes": 58.0e9, "fits": False,
      "fits_alone": True, "resident_train_bytes": 8.0e9, "resident_model_bytes": 16.3e9,
      "peak_with_train_state_bytes": 82.3e9}
  line = plan_programs.verdict(result)
  assert line.startswith(
      "verdict: DOES NOT FIT: migrate (peak 82.30 of 80.00 GB with the training state and the "
      "models; largest: arguments: fewer rows a migration moves at once (migration_rows: a "
      "run's fusion.migration_rows), fewer slots per instance"), line


def test_a_decode_that_fits_only_alone_is_named_with_the_training_state_beside_it():
  """Decode and inference fit beside the training state the trainer keeps on their devices:
  one that did not said "decode (peak 27.13 of 80.00 GB; largest: arguments: ...)", a peak
  below the HBM it exceeds and a fix for its own arguments. The verdict gives the peak with
  the state and, when the state is the largest term, moving the optimizer state to host memory
  (offload_optimizer) first, unless the plan does already."""
  result = _scaled_result(1.0)
  result["layers_compiled"] = {"reduced": False}
  decode = result["programs"]["decode"]
  decode.update(fits=False, fits_alone=True, peak_with_train_state_bytes=85.08e9,
                resident_train_bytes=85.08e9 - 10.77e9)
  assert plan_programs.verdict(result) == (
      "verdict: DOES NOT FIT: decode (peak 85.08 of 80.00 GB with the training state; largest: "
      "the training state beside it: offload_optimizer (a run's optim.offload_during_rollout), "
      "zero1 (a run's optim.zero1), fsdp, more stages or tensor devices)")
  result["plan"].update(offload_optimizer=True, zero1=True)
  assert plan_programs.verdict(result).endswith(
      "largest: the training state beside it: fsdp, more stages or tensor devices)")
  decode.update(resident_train_bytes=0, resident_model_bytes=85.08e9 - 10.77e9)  # async group
  result["plan"]["generation_devices"] = 4
  assert plan_programs.verdict(result) == (
      "verdict: DOES NOT FIT: decode (peak 85.08 of 80.00 GB with the models; largest: the "
      "models beside it: generation on the training devices (generation_devices 0: a run's "
      "async_ppo.generation_devices; a generation group keeps the models whole on every "
      "device))")
  # Both beside it: the peak counts both, each is a term with its own remedy (the models, a
  # little larger, hid the training state's before); where the run keeps the models says
  # what frees them.
  decode.update(resident_train_bytes=30e9, resident_model_bytes=44.31e9)
  result["plan"].update(generation_devices=0, generation="mesh")
  assert plan_programs.verdict(result) == (
      "verdict: DOES NOT FIT: decode (peak 85.08 of 80.00 GB with the training state and the "
      "models; largest: the models beside it: generation on instances (a run's "
      "plan.generation='instances' or fusion.inter_stage: the frozen models wait in host "
      "memory))")
  decode.update(resident_train_bytes=44.31e9, resident_model_bytes=30e9)
  result["plan"]["generation"] = "instances"
  assert plan_programs.verdict(result).endswith(
      "largest: the training state beside it: fsdp, more stages or tensor devices)")
  decode.update(resident_train_bytes=30e9, resident_model_bytes=44.31e9)
  assert plan_programs.verdict(result).endswith(
      "largest: the models beside it: more devices per instance (gen_tp: a run's "
      "fusion.instance_devices or plan.generation_tp))")


def test_table_reads_at_every_scale_in_the_same_units():
  """A preset-sized plan's table is as it always was (2 decimals of GB, 3 of TFLOP, 4 of
  seconds); a tiny one's figures keep their units and show 3 significant digits where those
  decimals would show 0 (every byte column read 0.00 on configs/plan_check.py:tiny)."""
  big = plan_programs.table(_scaled_result(1.0))
  assert big[1].split() == ["train_step", "7.22", "0.81", "2.74", "10.77", "17.99", "80.00",
                            "True", "10.48", "8.961", "1.05", "4.6"]
  assert big[6].split() == ["train_step", "9.60", "1.5000", "4.80", "0.7500", "0.0100", "0.0050"]
  assert "arg GB" in big[0] and "TFLOP/dev" in big[0] and "coll s" in big[5]
  tiny = plan_programs.table(_scaled_result(1e-6))
  assert tiny[1].split() == ["train_step", "7.22e-06", "8.10e-07", "2.74e-06", "1.08e-05",
                             "1.80e-05", "80.00", "True", "1.05e-05", "8.96e-06", "1.05", "4.6"]
  assert tiny[6].split() == ["train_step", "9.60e-06", "1.50e-06", "4.80e-06", "7.50e-07",
                             "1.00e-08", "5.00e-09"]
  assert plan_programs._gb(0) == "0.00"  # pylint: disable=protected-access
  # Each table line its columns' width: the small figures fit them.
  assert len({len(line) for line in tiny[1:4]}) == 1 == len({len(line) for line in tiny[6:9]})
  assert len(tiny[1]) == len(big[1]) and len(tiny[6]) == len(big[6])
  # Link-bound notes: the preset-sized plan's collectives (at 16 bits: 0.75 s, 65 ms, 0.15 s)
  # outlast 2x its other bounds, and so do the tiny one's, by as much but for microseconds:
  # below LINK_BOUND_MIN_S it gets no note.
  notes = plan_programs.link_bound_notes(_scaled_result(1.0))
  assert [n.split(":")[0] for n in notes] == list(plan_programs.PROGRAMS)
  assert big[-4:-1] == notes and big[-1].startswith("verdict: every program fits")
  assert plan_programs.link_bound_notes(_scaled_result(1e-6)) == []
  assert tiny[-2].startswith("inference")
  assert len(plan_programs.link_bound_notes(_scaled_result(1e-6), min_s={})) == 3


def test_compile_logs_nothing_of_its_cache_resets(caplog):
  """_compile resets jax's compilation cache around each compile (so that the dump options take
  effect); jax logs each reset at INFO, six lines a plan_check run that said nothing about the
  plan. The logger's level is left as it was."""
  name = "jax._src.compilation_cache"
  with caplog.at_level("INFO", logger=name):
    before = std_logging.getLogger(name).level
    lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((8,), np.float32))
    compiled, _ = plan_programs._compile(lowered, None)  # pylint: disable=protected-access
    assert compiled is not None
    assert std_logging.getLogger(name).level == before
  assert not [r for r in caplog.records if "Resetting cache" in r.getMessage()], caplog.text


def test_mesh_generation_config_errors_and_llama_presets():
  c = _tiny_mesh_generation()
  c.pp = c.critic_pp = 2  # pipelined: generation on the mesh with stage folded into data
  c.tp, c.gen_slots = 1, 4
  with pytest.raises(ValueError, match=r"config\.gen_slots=4: expected a multiple of "
                                       r"dp\*fsdp\*pp=8"):
    plan_programs.PlanConfig.from_config_dict(c)
  c.gen_slots = 8
  inst = plan_programs.make_instance(plan_programs.PlanConfig.from_config_dict(c))
  assert dict(inst.mesh.shape) == {"data": 4, "fsdp": 2, "stage": 1, "tensor": 1}
  c = _tiny_mesh_generation()
  c.gen_slots = 6
  with pytest.raises(ValueError, match=r"config\.gen_slots=6: expected a multiple of "
                                       r"dp\*fsdp\*pp=4"):
    plan_programs.PlanConfig.from_config_dict(c)
  c.gen_slots, c.critic_microbatch_size = 8, 1
  with pytest.raises(ValueError, match=r"config\.critic_microbatch_size=1: expected 0 with pp=1"):
    plan_programs.PlanConfig.from_config_dict(c)
  # microbatch_size 0 (the trainer's default): each data shard's 2 rows at once, unpipelined only.
  c = _tiny_mesh_generation()
  c.microbatch_size = 0
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  assert (cfg.micro_rows, cfg.actor_microbatches) == (2, 1)
  analytic = plan_programs.train_analytic(cfg, {})
  assert "grad_accumulator_bytes" not in analytic
  c.microbatch_size = 1
  one = plan_programs.train_analytic(plan_programs.PlanConfig.from_config_dict(c), {})
  assert one["activations_bytes"] * 2 == pytest.approx(analytic["activations_bytes"])
  c.microbatch_size = 3  # at least the 2 rows per shard: the whole shard, as the trainer takes it
  assert plan_programs.PlanConfig.from_config_dict(c).actor_microbatches == 1
  c.minibatch_size = 16  # 4 rows per shard
  with pytest.raises(ValueError, match=r"config\.microbatch_size=3: expected a divisor of the "
                                       r"rows per data shard \(minibatch_size/\(dp\*fsdp\) = "
                                       r"16/4 = 4\)"):
    plan_programs.PlanConfig.from_config_dict(c)
  c = plan_config.get_config("tiny")
  c.gradient_sync = "twice"
  with pytest.raises(ValueError, match=r"config\.gradient_sync='twice': expected one of"):
    plan_programs.PlanConfig.from_config_dict(c)
  c = plan_config.get_config("tiny")
  c.microbatch_size = 0
  with pytest.raises(ValueError, match=r"config\.microbatch_size=0: expected >= 1 with pp=2"):
    plan_programs.PlanConfig.from_config_dict(c)
  c = _tiny_mesh_generation()
  c.generation = "pipeline"
  with pytest.raises(ValueError, match=r"config\.generation='pipeline': expected one of"):
    plan_programs.PlanConfig.from_config_dict(c)
  c = plan_config.get_config("tiny")
  c.layers = 3  # over pp=2 stages
  with pytest.raises(ValueError, match=r"config\.layers=3: expected a multiple of the actor's 2 "
                                       r"pipeline stages \(e\.g\. 2\)"):
    plan_programs.PlanConfig.from_config_dict(c)
  # A bool is not a count (True passed as 1, a plan file's `"pp": true` read as one stage).
  for name, minimum, hint in (("pp", 1, ""), ("gen_slots", 1, ""),
                              ("layers", 0, r" \(0: the model's own\)"),
                              ("microbatch_size", 0, r" \(0, pp 1 only: each data shard")):
    d = plan_config.get_config("tiny").to_dict()
    d[name] = True
    with pytest.raises(ValueError, match=rf"config\.{name}=True: expected an integer >= "
                                         rf"{minimum}{hint}"):
      plan_programs.PlanConfig.from_config_dict(d)
  # search_time_s 0 was accepted and refused in the run, after the earlier result had moved
  # aside, as the trainer's config.pipeline.search_time_s.
  c = plan_config.get_config("tiny")
  c.search_seed = -1  # (refused by the search, after the earlier result had moved aside)
  with pytest.raises(ValueError, match=r"^config\.search_seed=-1: expected an integer >= 0$"):
    plan_programs.PlanConfig.from_config_dict(c)
  for value in (0.0, float("nan")):
    c = plan_config.get_config("tiny")
    c.search_time_s = value
    with pytest.raises(ValueError, match=rf"^config\.search_time_s={value!r}: expected a finite "
                                         r"number of seconds > 0$"):
      plan_programs.PlanConfig.from_config_dict(c)
  # The presets' own layer counts are derived, not settable (accepted, then overwritten).
  d = plan_config.get_config("tiny").to_dict()
  d["actor_layers"] = 2
  with pytest.raises(ValueError, match=r"config: unknown fields \['actor_layers'\]"):
    plan_programs.PlanConfig.from_config_dict(d)
  # llama/<variant>: configs/ppo_llama.py's run on its smallest mesh (data 1).
  from configs import ppo_llama
  for variant in ("7b", "13b", "65b/33b"):
    run, plan = ppo_llama.get_config(variant), plan_config.get_config(f"llama/{variant}")
    assert (plan.pp, plan.tp, plan.fsdp, plan.dp) == (1, run.mesh.tensor, run.mesh.fsdp, 1)
    assert (plan.minibatch_size, plan.microbatch_size) == (64, run.algo.microbatch_size)
    # The GPU presets' optimizer: a float32 copy of the bfloat16 weights; split over data in
    # the fused presets only.
    assert plan.master_weights is run.optim.master_weights is True
    assert plan.zero1 is run.optim.zero1 is False
    assert plan_config.get_config(f"llama/fused/{variant}").zero1 is True
    assert plan.seq_len == run.data.max_prompt_len + run.rollout.max_new_tokens
    # Generation on instances of `tensor` devices, the batch dealt over them; moments offloaded.
    instances = plan.tp * plan.fsdp // run.plan.generation_tp
    assert (plan.generation, plan.gen_tp) == (run.plan.generation, run.mesh.tensor)
    assert plan.gen_slots == run.rollout.prompts_per_iteration // instances
    assert plan.inference_microbatch == run.fusion.inference_micro_batch == 8
    assert plan.offload_optimizer is run.optim.offload_during_rollout is True
    assert plan.scan_layers == run.model.scan_layers == run.critic_model.scan_layers is True
  # hf_gpu/<model>: configs/ppo_hf.py:ppo_gpu on a model of HF_MODELS.
  from configs import ppo_hf
  run, plan = ppo_hf.get_config("ppo_gpu"), plan_config.get_config("hf_gpu/qwen3-0.6b")
  cfg = plan_programs.PlanConfig.from_config_dict(plan)
  assert (cfg.fsdp, cfg.tp, cfg.dp, cfg.pp) == (run.mesh.fsdp, 1, 1, 1)
  # 128 responses dealt over 8 one-device instances.
  assert (cfg.microbatch_size, cfg.generation, cfg.gen_tp, cfg.gen_slots) == (
      run.algo.microbatch_size, "instances", 1, 16)
  assert cfg.gradient_sync == run.algo.gradient_sync == "once"
  assert cfg.actor.qk_norm and cfg.actor.tie_embeddings and cfg.actor.head_dim == 128
  assert cfg.actor.scan_layers and cfg.critic.head == "scalar"
  # Qwen2.5 carries q/k/v biases (the loader reads them from any qwen2 config.json).
  qwen2 = plan_programs.PlanConfig.from_config_dict(plan_config.get_config("hf_gpu/qwen2.5-1.5b"))
  assert qwen2.actor.qkv_bias and qwen2.critic.qkv_bias and not qwen2.actor.o_bias
  with pytest.raises(ValueError, match=r"unknown model 'gpt2' in 'hf_gpu/gpt2'"):
    plan_config.get_config("hf_gpu/gpt2")


def test_run_variant_maps_a_training_config_file(monkeypatch, tmp_path):
  """run/<file>[:<variant>]: a training config file as its trainer runs it. The LLaMA preset's
  file gives the llama/ variant's plan; an HF checkpoint's architecture comes from its
  config.json, as the trainer reads it."""
  import dataclasses
  from rlhfuse_jax.models import hf_loader
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.chdir(repo)  # the configs' paths are relative to the repository, as runs start
  as_run = plan_programs.PlanConfig.from_config_dict(
      plan_config.get_config("run/configs/ppo_llama.py:13b"))
  preset = plan_programs.PlanConfig.from_config_dict(plan_config.get_config("llama/13b"))
  assert dataclasses.replace(as_run, actor=preset.actor, critic=preset.critic) == preset
  for got, want in ((as_run.actor, preset.actor), (as_run.critic, preset.critic)):
    assert got.num_params() == want.num_params() and got.head == want.head
  from configs import ppo_hf
  run = ppo_hf.get_config("ppo_gpu")
  hf = plan_programs.PlanConfig.from_config_dict(
      plan_config.get_config("run/configs/ppo_hf.py:ppo_gpu"))
  ckpt = hf_loader.load_hf_config(run.init.actor_checkpoint)
  for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
    assert getattr(hf.actor, f) == getattr(ckpt, f), f
  assert (hf.generation, hf.gen_tp, hf.gradient_sync) == ("instances", 1, "once")
  with pytest.raises(ValueError, match=r"'run/configs/nope\.py': no config file"):
    plan_config.get_config("run/configs/nope.py")
  with pytest.raises(ValueError, match=r"grpo_tiny\.py's get_config\(\) takes no variant"):
    plan_config.get_config("run/configs/grpo_tiny.py:fused")  # was a TypeError
  (tmp_path / "empty.py").write_text("")
  with pytest.raises(ValueError, match=r"empty\.py defines no get_config\(\)"):
    plan_config.get_config(f"run/{tmp_path / 'empty.py'}")
  # The README's main job: pipelined actor (4 stages) and critic (2 stages, 2 replicas) with the
  # searched fused schedule, generation and scoring on the fused stage's one-device instances.
  fused = plan_programs.PlanConfig.from_config_dict(
      plan_config.get_config("run/configs/ppo_tiny.py:fused"))
  assert (fused.pp, fused.critic_pp, fused.dp, fused.intra_stage) == (4, 2, 1, True)
  assert fused.search_seed == 0  # the run's pipeline.search_seed
  # 32 rows per data shard: 8 actor micro-batches of 4 rows, 2 replicas x 4 critic ones of 4.
  assert (fused.actor_microbatches, fused.micro_rows) == (8, 4)
  assert (fused.critic_microbatches, fused.critic_micro_rows) == (4, 4)
  assert (fused.generation, fused.gen_tp, fused.gen_slots) == ("instances", 1, 16)
  # The trainer's own pipeline checks, naming the run's fields; an unpipelined run ignores
  # pipeline.critic_pp, as its trainer does.
  from configs import ppo_tiny
  for overrides, match in (({"pipeline.critic_pp": 8}, r"pipeline\.critic_pp=8 must divide "
                                                       r"mesh\.stage=4"),
                           ({"mesh.data": 64}, r"algo\.minibatch_size=32 must be at least")):
    run = ppo_tiny.get_config("fused")
    for k, v in overrides.items():
      section, field = k.split(".")
      setattr(run[section], field, v)
    with pytest.raises(ValueError, match=match):
      plan_config.apply_run(plan_config.get_config("tiny"), run)
  run = ppo_tiny.get_config()
  run.pipeline.critic_pp = 2
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, run)
  assert (c.pp, c.critic_pp) == (1, 1)


def test_a_run_taking_its_vocabulary_from_the_tokenizer_is_checked_with_it():
  """model.vocab_size=0 (ppo_tiny's: the task tokenizer's 22 tokens) is compiled at the
  tokenizer's vocabulary, as the trainer resolves it; it was compiled as a vocabulary of 1 (and
  plan_check warned that a plan searched for vocab 22 did not match)."""
  from configs import ppo_tiny
  run = ppo_tiny.get_config()
  assert run.model.vocab_size == 0
  c = plan_config.get_config("tiny")
  resolved = plan_config.apply_run(c, run)
  assert c.actor.vocab_size == c.critic.vocab_size == resolved.model.vocab_size == 22


def test_a_run_whose_actor_is_a_sequence_classification_is_refused_as_train_ppo_refuses_it(
    tmp_path):
  """--run_config.init.actor_checkpoint=<a *ForSequenceClassification: a reward model's
  directory> compiled the actor's programs with an LM head and said the plan fits, where
  train_ppo refuses the run (build.resolve_config): refused with the trainer's message."""
  from configs import ppo_hf
  from rlhfuse_jax.trainer import build
  from rlhfuse_jax.trainer.config import TrainConfig
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  own = os.path.join(repo, "configs", "data", "tiny_llama3_chat")
  with open(os.path.join(own, "config.json")) as f:
    hf = json.load(f)
  rm = tmp_path / "rm"
  rm.mkdir()
  (rm / "config.json").write_text(json.dumps(
      {**hf, "architectures": ["LlamaForSequenceClassification"]}))
  run = ppo_hf.get_config("ppo_gpu")
  run.init.actor_checkpoint = str(rm)
  with pytest.raises(ValueError) as planned:
    plan_config.apply_run(plan_config.get_config("tiny"), run)
  assert str(planned.value) == (
      f"config.init.actor_checkpoint={str(rm)!r} is a *ForSequenceClassification (a scalar "
      "head, a reward model's or a critic's): the actor needs a language model, a "
      "*ForCausalLM checkpoint")
  cfg = TrainConfig.from_config_dict(run)
  with pytest.raises(ValueError) as trained:
    build.resolve_config(cfg, build.build_task_and_tokenizer(cfg)[1])
  assert str(trained.value) == str(planned.value)
  # its *ForCausalLM twin is checked with the LM head it generates with
  (rm / "config.json").write_text(json.dumps(hf))
  c = plan_config.get_config("tiny")
  assert plan_config.apply_run(c, run).model.head == "lm" and c.actor.head == "lm"


def test_a_run_config_training_in_float16_is_refused_as_train_ppo_refuses_it():
  """--run_config.model.dtype=float16 (or a critic's param_dtype) compiled and said "every
  program fits", exit 0, for a run train_ppo refuses (no loss scaling: trainer/validate.py); a
  critic-free estimator's unused critic section is not refused, as train_ppo does not."""
  from configs import ppo_tiny
  for section, field in (("model", "dtype"), ("critic_model", "param_dtype")):
    run = ppo_tiny.get_config()
    run[section][field] = "float16"
    with pytest.raises(ValueError, match=rf"config\.{section}\.{field}='float16': .*loss "
                                         r"scaling.*'bfloat16'"):
      plan_config.apply_run(plan_config.get_config("tiny"), run)
  run = ppo_tiny.get_config("grpo")
  run.critic_model.dtype = "float16"
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, run)
  # ... and stands in (an upper bound) at bfloat16, the same bytes: the plan takes it
  assert plan_programs.PlanConfig.from_config_dict(c).critic.dtype == "bfloat16"


@pytest.mark.parametrize("field,name", [("actor", "dtype"), ("actor", "param_dtype"),
                                        ("critic", "dtype")])
def test_a_plain_plan_training_in_float16_is_refused_as_its_run_would_be(field, name):
  """A plan config (no --run_config) with a float16 actor or critic, both of which its train
  step trains, compiled and said "every program fits", exit 0, where train_ppo and plan_check
  --run_config refuse such a model (no loss scaling: trainer/validate.check_trained_dtypes).
  Refused before anything compiles, naming the field; a float16 reward model (not trained)
  is taken, as train_ppo takes it."""
  c = plan_config.get_config("tiny")
  c[field][name] = "float16"
  with pytest.raises(ValueError, match=rf"^config\.{field}\.{name}='float16': .*loss "
                                       r"scaling.*'bfloat16'"):
    plan_programs.PlanConfig.from_config_dict(c)
  c = plan_config.get_config("tiny")
  del c["reward_model"]  # (a string field: a section replaces it, as apply_run does)
  c.reward_model = c.critic.to_dict()
  c.reward_model["dtype"] = c.reward_model["param_dtype"] = "float16"
  assert plan_programs.PlanConfig.from_config_dict(c).reward.dtype == "float16"


def test_a_run_with_a_plan_file_is_checked_on_the_devices_the_plan_was_searched_for(tmp_path):
  """mesh.data=-1 beside a plan.file searched for 8 devices (tensor 2, generation instances of
  4 devices): checked on those 8, data 4, as train_ppo resolves it there. It was checked on
  one replica (2 devices) and refused the plan's generation_tp=4 unless
  --run_config.mesh.data was spelled out."""
  from configs import ppo_tiny
  plan = {"generation": {"mode": "instances", "tp": 4, "pp": 1, "groups": 2, "slots": 0},
          "inference": {"tp": 1, "pp": 1},
          "training": {"placement": "colocated", "tp": 2, "actor_pp": 1, "critic_pp": 1,
                       "devices": 8},
          "predicted": {"iteration_s": 1.0}, "summary": "test plan"}
  path = tmp_path / "plan.json"
  path.write_text(json.dumps(plan))
  run = ppo_tiny.get_config()
  run.plan.file = str(path)
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, run)
  assert (c.dp, c.tp, c.gen_tp) == (4, 2, 4)
  run.mesh.data = 2  # the user's own count stays theirs
  plan_config.apply_run(c, run)
  assert c.dp == 2


def test_pipelined_training_config_compiles_as_its_trainer_runs_it(tmp_path, monkeypatch):
  """run/configs/ppo_tiny.py:fused with serial generation: the pipelined update of the run's
  micro-batch counts with its searched fused schedule, and generation on the training mesh with
  stage folded into data, as trainer/loop.py lays it out."""
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from configs import ppo_tiny
  run = ppo_tiny.get_config("fused")
  run.fusion.inter_stage = False
  run.pipeline.critic_microbatches = 2  # critic micro-batches of 8 rows, the actor's of 4
  run.pipeline.search_seed = 3  # the schedule searched as the run would search it
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, run)
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  assert (cfg.generation, cfg.gen_slots, cfg.critic_micro_rows) == ("mesh", 64, 8)
  result = plan_programs.run_and_write(cfg, str(tmp_path))
  train = result["programs"]["train_step"]
  assert train["schedule"] == "fused"
  assert (train["actor_microbatches"], train["critic_microbatches"]) == (8, 2)
  assert result["plan"]["critic_microbatch_size"] == 8 and result["plan"]["search_seed"] == 3
  # The batch over data x stage (4 devices, 16 rows each): the decode step's dots split 4 ways.
  assert abs(result["programs"]["decode"]["replication"] - 1.0) < 0.02
  assert result["programs"]["decode"]["resident_train_bytes"] == train["argument_bytes"]


def test_a_runs_count_budget_certifies_the_schedule_its_trainer_trains(tmp_path, monkeypatch):
  """--run_config with pipeline.search_evaluations: plan_check searches the fused schedule by the
  run's count, as the trainer does, so the schedule it compiles and certifies is the one the run
  trains, on any machine. It searched by search_time_s's wall clock (max_evaluations None in its
  cache key), which found another schedule than the run's 20000 evaluations (2026-12-07)."""
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from configs import ppo_tiny
  from rlhfuse_jax.trainer import pipelined
  from rlhfuse_jax.trainer.config import TrainConfig
  run = ppo_tiny.get_config("fused")
  run.pipeline.search_evaluations = 5000
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, run)
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  searched = []
  real = pipelined.searched_schedule

  def spy(problem, pipeline, workdir=""):
    schedule, path = real(problem, pipeline, workdir)
    searched.append((schedule, json.load(open(path))["key"]["search"]))
    return schedule, path

  monkeypatch.setattr(pipelined, "searched_schedule", spy)
  # plan_check's update (its own workdir: no cache shared with the trainer's search below)
  plan_programs.make_update(cfg, plan_programs.train_mesh(cfg), plan_programs.make_optimizer(True),
                            str(tmp_path / "plan_check"))
  trained = TrainConfig.from_config_dict(run).pipeline
  trainer = real(pipelined.pipeline_problem(cfg.pp, trained), trained, str(tmp_path / "run"))[0]
  (certified, key), = searched
  assert key["max_evaluations"] == 5000 and key["seed"] == trained.search_seed
  assert certified.problem == trainer.problem
  assert certified.to_dict() == trainer.to_dict()
  c.search_evaluations = -1
  with pytest.raises(ValueError, match=r"^config\.search_evaluations=-1: expected an integer "
                     r">= 0 \(0: the wall-clock budget search_time_s\)$"):
    plan_programs.PlanConfig.from_config_dict(c)


def test_asynchronous_run_generates_on_its_own_group(tmp_path):
  """async_ppo.generation_devices=4: generation and scoring on the group's data-only mesh (the
  rollout batch split 4 ways, the actor whole on each device beside the reference), none of the
  training state there; the update on the training mesh."""
  from configs import ppo_tiny
  run = ppo_tiny.get_config()
  run.async_ppo.staleness, run.async_ppo.generation_devices = 1, 4
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, run)
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  assert (cfg.generation, cfg.generation_devices, cfg.gen_slots) == ("mesh", 4, 64)
  assert (cfg.train_devices, cfg.gen_devices, cfg.gen_model_shards) == (1, 4, 1)
  # Through the binary, which sets the fake device count from the plan before jax starts: the
  # group (4) is larger than the training mesh (1), which it once did not count. The caller's
  # XLA_FLAGS ask for 2 devices (a count exported for another command), and so does jax's own
  # JAX_NUM_CPU_DEVICES (which overrides the flag): the plan's count replaces both; each was
  # kept, and the run stopped with "the plan needs 4 devices ... but jax has 2: run
  # experiments/plan_check.py, which sets the count".
  import subprocess
  import sys
  from tests.xla_env import subprocess_env
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_check", "--config=configs/plan_check.py:tiny",
       "--run_config=configs/ppo_tiny.py", "--run_config.async_ppo.staleness=1",
       "--run_config.async_ppo.generation_devices=4", f"--workdir={tmp_path}"], cwd=repo,
      env=subprocess_env(2, JAX_NUM_CPU_DEVICES="2"), capture_output=True, text=True,
      timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(tmp_path, "result.json")) as f:
    result = json.load(f)
  assert result["devices"] == 4 and result["backend"]["device_count"] == 4
  for name in ("decode", "inference"):
    p = result["programs"][name]
    assert p["replication"] < 1.05, (name, p["replication"])  # 16 rows per device
    assert p["resident_train_bytes"] == p["offloaded_optimizer_bytes"] == 0
    assert p["resident_model_bytes"] == p["analytic"]["params_bytes"] > 0
    assert p["peak_with_train_state_bytes"] == p["peak_bytes"] + p["resident_model_bytes"]
  assert result["plan"]["generation_devices"] == 4
  # Synchronous on a separate group: the critic is scored there too, its weights beside.
  run.async_ppo.staleness = 0
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, run)
  assert c.group_critic and not cfg.group_critic
  programs = {k: dict(v) for k, v in result["programs"].items()}
  critic = plan_programs._nbytes(llama.param_shapes(cfg.critic))
  plan_programs.beside_train_state(programs, 80e9, False, True, critic)
  for name in ("decode", "inference"):
    p = programs[name]
    assert p["resident_model_bytes"] == p["analytic"]["params_bytes"] + critic
  with pytest.raises(ValueError, match=r"config\.gen_slots=6: expected a multiple of "
                                       r"generation_devices=4"):
    c.gen_slots = 6
    plan_programs.PlanConfig.from_config_dict(c)


def _async_run(**overrides):
  """ppo_tiny with async_ppo.staleness=1 (a ConfigDict, as train_ppo's --config) and
  `overrides` ("mesh.fsdp": 2)."""
  from configs import ppo_tiny
  run = ppo_tiny.get_config()
  run.async_ppo.staleness = 1
  run.data.num_prompts = 64
  for field, value in overrides.items():
    section, name = field.split(".")
    run[section][name] = value
  return run


@pytest.mark.parametrize("overrides", [
    {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},  # a jnp.copy of the state's own actor
    # pipelined: Update.whole's gathered copy, placed on the serial rollout's folded mesh
    {"mesh.stage": 2, "mesh.data": 2, "mesh.fsdp": 2, "pipeline.actor_microbatches": 4,
     "pipeline.critic_microbatches": 4}])
def test_async_ppos_copy_of_the_actor_is_counted_as_the_trainer_holds_it(tmp_path, caplog,
                                                                          overrides):
  """async_ppo.staleness > 0 without a generation group: before each update the trainer copies
  the actor for the next batch's generation (PPOTrainer._snapshot), kept through the update
  and that generation on the training devices. plan_check only warned that it did not count
  it; actor_copy_bytes is now what one device holds of the trainer's own copy, measured here
  from its arrays, and nothing is warned of. With a generation group the copy is the group's
  actor: none on the training devices."""
  from rlhfuse_jax.trainer.config import TrainConfig
  from rlhfuse_jax.trainer.loop import PPOTrainer
  run = _async_run(**overrides)
  c = plan_config.get_config("tiny")
  with caplog.at_level(std_logging.WARNING):
    plan_config.apply_run(c, run)
    cfg = plan_programs.PlanConfig.from_config_dict(c)
  assert "staleness" not in caplog.text, caplog.text
  assert cfg.keeps_actor_copy
  counted = plan_programs.actor_copy_bytes(cfg, plan_programs.train_mesh(cfg))
  trainer = PPOTrainer(TrainConfig.from_config_dict(run), str(tmp_path))
  copy = trainer._snapshot()("actor")
  held = {d: 0 for d in trainer.mesh.devices.flat}
  for x in jax.tree.leaves(copy):
    for shard in x.addressable_shards:
      held[shard.device] += shard.data.nbytes
  assert set(held) == set(jax.devices())  # on every training device, as much on each
  assert set(held.values()) == {counted} and counted > 0
  assert counted == pytest.approx(  # the whole actor split over fsdp x tensor
      plan_programs._nbytes(llama.param_shapes(cfg.actor)) / (cfg.fsdp * cfg.tp), rel=0.05)
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, _async_run(**{"async_ppo.generation_devices": 4}))
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  assert not cfg.keeps_actor_copy and plan_programs.actor_copy_bytes(cfg, None) == 0


@pytest.mark.parametrize("staleness", [1, 0])
def test_an_async_generation_groups_actor_is_counted_whole_as_the_trainer_holds_it(tmp_path,
                                                                                 staleness):
  """async_ppo.generation_devices=4 with plan.generation='instances' (instances of
  generation_tp=2): the trainer moves the actor (at staleness 0 the critic too) onto the
  group's data-only mesh, whole on every group device (PPOTrainer._snapshot), and each instance
  then holds its own copy over its 2 devices beside it. plan_check and plan_search counted the
  instance's copy alone as the group's actor and critic (gen_tp times less than the trainer
  holds); both now count them whole, measured here from the trainer's arrays, beside decode
  and beside the scoring programs."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim import shapes
  from rlhfuse_jax.trainer.config import TrainConfig
  from rlhfuse_jax.trainer.loop import PPOTrainer
  run = _async_run(**{"async_ppo.generation_devices": 4, "plan.generation": "instances",
                      "plan.generation_tp": 2, "async_ppo.staleness": staleness})
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, run)
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  assert (cfg.generation, cfg.gen_tp, cfg.generation_devices) == ("instances", 2, 4)
  counted = plan_programs.group_actor_bytes(cfg)
  trainer = PPOTrainer(TrainConfig.from_config_dict(run), str(tmp_path))
  group = set(trainer.gen_mesh.devices.flat)

  def held(tree):
    out = {}
    for x in jax.tree.leaves(tree):
      for shard in x.addressable_shards:
        out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out
  snapshot = trainer._snapshot()("actor")
  whole = held(snapshot)
  assert set(whole) == group and set(whole.values()) == {counted} and counted > 0
  critic = plan_programs.group_critic_bytes(cfg)
  assert cfg.group_critic is (staleness == 0) and bool(critic) is (staleness == 0)
  if staleness == 0:
    critics = held(trainer._snapshot()("critic"))
    assert set(critics) == group and set(critics.values()) == {critic}
  # The instance's own copy (decode's params_bytes) is beside it, gen_tp times smaller.
  instance = held(dict(trainer.rollout.generator.place_actor(snapshot)))
  assert set(instance) == group
  assert max(instance.values()) == pytest.approx(counted / cfg.gen_tp, rel=0.05)
  # plan_check: the whole actor beside decode (whose argument is the instance's copy) and
  # beside the scoring programs, in place of the instance's copy.
  programs = {"train_step": {"argument_bytes": 100, "optimizer_state_bytes": 40,
                             "peak_bytes": 150, "fits": True},
              "decode": {"peak_bytes": 50, "fits": True,
                         "analytic": {"params_bytes": counted / cfg.gen_tp}},
              "inference": {"peak_bytes": 40, "fits": True,
                            "analytic": {"params_bytes": counted / cfg.gen_tp}}}
  plan_programs.beside_train_state(programs, 10 ** 9, False, True, critic, reference=True,
                                   generation="instances", group_actor_bytes=counted)
  assert programs["decode"]["resident_model_bytes"] == counted + counted / cfg.gen_tp + critic
  assert programs["inference"]["resident_model_bytes"] == counted + critic
  # plan_search: the generation and inference rows of an asynchronous split hold it too.
  wl = it.Workload(actor=shapes.from_model_config(cfg.actor, "actor", dtypes=True),
                   critic=shapes.from_model_config(cfg.critic, "critic", dtypes=True),
                   num_devices=8, global_batch=16, minibatch=8)
  split = {"async": {"generation_devices": 4, "training_devices": 4, "staleness": 1,
                     "colocated": False}}
  opt = it.SimOptions(trainer_runnable=True)
  assert ps.group_actor_bytes(wl, opt, split) == pytest.approx(counted, rel=0.01)
  assert ps.group_actor_bytes(wl, opt, {}) == 0  # (no group: none)


def test_a_generation_groups_instance_of_tp1_holds_the_groups_actor_counted_once(tmp_path):
  """At generation_tp=1 each instance of an asynchronous generation group is placed from the
  group's whole actor onto one of its devices, and jax hands it the group's own buffers (all of
  them, measured here): plan_check counted the actor twice beside decode, as decode's argument
  and as the group's copy beside it (a safe over-count). Decode now has the reference beside
  it, not the actor again; at gen_tp 2 the instance's copy is new buffers, beside the group's."""
  from rlhfuse_jax.policy import async_copies
  from rlhfuse_jax.trainer.config import TrainConfig
  from rlhfuse_jax.trainer.loop import PPOTrainer
  run = _async_run(**{"async_ppo.generation_devices": 4, "plan.generation": "instances",
                      "plan.generation_tp": 1})
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, run)
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  assert (cfg.gen_model_shards, cfg.group_critic) == (1, False)
  counted = plan_programs.group_actor_bytes(cfg)
  trainer = PPOTrainer(TrainConfig.from_config_dict(run), str(tmp_path))
  snapshot = trainer._snapshot()("actor")
  group = {(s.device, s.data.unsafe_buffer_pointer()) for x in jax.tree.leaves(snapshot)
           for s in x.addressable_shards}
  held = shared = 0
  for x in jax.tree.leaves(dict(trainer.rollout.generator.place_actor(snapshot))):
    for s in x.addressable_shards:
      held += s.data.nbytes
      shared += s.data.nbytes if (s.device, s.data.unsafe_buffer_pointer()) in group else 0
  assert held == shared == 4 * counted > 0, (held, shared, counted)
  for shards, beside in ((1, counted), (2, counted + counted / 2)):
    programs = {"train_step": {"argument_bytes": 100, "optimizer_state_bytes": 40,
                               "peak_bytes": 150, "fits": True},
                "decode": {"peak_bytes": 50, "fits": True,
                           "analytic": {"params_bytes": counted / shards}},
                "inference": {"peak_bytes": 40, "fits": True,
                              "analytic": {"params_bytes": counted / shards}}}
    plan_programs.beside_train_state(
        programs, 10 ** 9, False, True, 0.0, reference=True, generation="instances",
        group_actor_bytes=counted,
        group_actor_shared=async_copies.shares_group_buffers(shards))
    # (the reference, the actor's size, over gen_tp; at gen_tp 2 the group's actor too)
    assert programs["decode"]["resident_model_bytes"] == beside, shards
    assert programs["inference"]["resident_model_bytes"] == counted, shards


def test_a_generation_groups_pipeline_keeps_the_reference_on_its_inference_mesh(tmp_path):
  """async_ppo.generation_devices=4 with plan.generation='pipeline' (generation_pp=2) and
  plan.inference_tp=2: the trainer's PlannedStage places the reference on a data=2 x tensor=2
  mesh of the group once, where it stays through every generation. plan_search's generation
  row of such a split (sim.trainer_runnable) counted no frozen weights beside the pipeline
  (sim.offload_frozen's host memory, which this stage never uses); it now counts the
  reference over the inference tp, measured here from the trainer's arrays, beside the whole
  actor."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.trainer.config import TrainConfig
  from rlhfuse_jax.trainer.loop import PPOTrainer
  run = _async_run(**{"async_ppo.generation_devices": 4, "plan.generation": "pipeline",
                      "plan.generation_pp": 2, "plan.inference_tp": 2})
  run.model.num_layers = run.critic_model.num_layers = 2
  trainer = PPOTrainer(TrainConfig.from_config_dict(run), str(tmp_path))
  group = set(trainer.gen_mesh.devices.flat)
  held = _reference_bytes_by_device(trainer)
  assert set(held) == group and len(set(held.values())) == 1
  cfg = TrainConfig.from_config_dict(run)
  wl = _tiny_workload(cfg)
  plan = {"generation": {"mode": "pipeline", "tp": 1, "pp": 2, "groups": 2, "slots": 16},
          "inference": {"tp": 2, "pp": 1},
          "training": {"placement": "colocated", "devices": 4, "tp": 1, "actor_pp": 1,
                       "critic_pp": 1},
          "async": {"generation_devices": 4, "training_devices": 4, "staleness": 1,
                    "colocated": False}}
  gen = ps.plan_memory(ps.CostModel(hardware.get_hardware("h100_sxm")), wl,
                       it.SimOptions(trainer_runnable=True), plan)[0]
  assert gen["parts"]["frozen weights kept"] == pytest.approx(max(held.values()), rel=0.05)
  assert gen["parts"][ps.GROUP_ACTOR] == pytest.approx(
      plan_programs._nbytes(llama.param_shapes(cfg.model)), rel=0.01)


def test_a_generation_groups_pipeline_of_tp1_holds_new_layers_and_the_groups_ends(tmp_path):
  """A generation group's pipeline (plan.generation='pipeline', tp 1, a stage a device: the plan
  the trainer runs there) placed from the group's whole actor: jax hands every stage the
  group's own buffers of the embedding and LM head (replicated on each stage), while its layers,
  stacked per stage, are new buffers beside the group's. plan_search's generation row counted
  the whole actor over pp beside the group's copy (the embedding and head twice); it now counts
  the stage's layers, measured here from the trainer's buffers, beside the whole actor."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.trainer.config import TrainConfig
  from rlhfuse_jax.trainer.loop import PPOTrainer
  run = _async_run(**{"async_ppo.generation_devices": 4, "plan.generation": "pipeline",
                      "plan.generation_pp": 4})
  run.model.num_layers = 4
  cfg = TrainConfig.from_config_dict(run)
  trainer = PPOTrainer(cfg, str(tmp_path))
  snapshot = trainer._snapshot()("actor")
  group = {(s.device, s.data.unsafe_buffer_pointer()) for x in jax.tree.leaves(snapshot)
           for s in x.addressable_shards}
  staged = trainer.rollout.pipe.place(snapshot)
  new, shared = {}, {}  # {(device, part): bytes} of the stages' tree
  for part in ("embed", "layers", "head"):
    for x in jax.tree.leaves(staged[part]):
      for s in x.addressable_shards:
        mine = (s.device, s.data.unsafe_buffer_pointer()) not in group
        into = new if mine else shared
        into[s.device, part] = into.get((s.device, part), 0) + s.data.nbytes
  stages = set(trainer.gen_mesh.devices.flat)
  assert {d for d, _ in new} == {d for d, _ in shared} == stages
  assert {part for _, part in new} == {"layers"}  # the ends are all the group's
  assert {part for _, part in shared} == {"embed", "head"}
  layers = set(new.values())
  assert len(layers) == 1 and len(set(shared.values())) <= 2
  plan = {"generation": {"mode": "pipeline", "tp": 1, "pp": 4, "groups": 4, "slots": 16},
          "inference": {"tp": 1, "pp": 1},
          "training": {"placement": "colocated", "devices": 4, "tp": 1, "actor_pp": 1,
                       "critic_pp": 1},
          "async": {"generation_devices": 4, "training_devices": 4, "staleness": 1,
                    "colocated": False}}
  # (the run's resolved config: the tokenizer's vocabulary, as the trainer's arrays have it)
  gen = ps.plan_memory(ps.CostModel(hardware.get_hardware("h100_sxm")),
                       _tiny_workload(trainer.cfg), it.SimOptions(trainer_runnable=True),
                       plan)[0]
  # (the final norm, 256 bytes, counts with the layers there)
  assert gen["parts"]["weights"] == pytest.approx(layers.pop(), rel=2e-3)
  whole = {}
  for x in jax.tree.leaves(snapshot):
    for s in x.addressable_shards:
      whole[s.device] = whole.get(s.device, 0) + s.data.nbytes
  assert gen["parts"][ps.GROUP_ACTOR] == pytest.approx(whole.popitem()[1], rel=1e-3)


def _reference_bytes_by_device(trainer) -> dict:
  """{device: bytes of the trainer's reference model's shards on it}."""
  held = {}
  for x in jax.tree.leaves(trainer.rollout.reference):
    for shard in x.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return held


def _tiny_workload(cfg):
  """The simulator's workload of a ppo_tiny-shaped run `cfg` on 8 devices."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import shapes
  return it.Workload(actor=shapes.from_model_config(cfg.model, "actor", dtypes=True),
                     critic=shapes.from_model_config(cfg.critic_model, "critic", dtypes=True),
                     num_devices=8, global_batch=16, minibatch=8, max_new_tokens=6,
                     reward_model=False)  # (ppo_tiny scores with a function)


@pytest.fixture(scope="module")
def async_mesh_plan(tmp_path_factory):
  """(cfg, result, result.json's programs) of _tiny_mesh_generation at staleness 1, compiled
  once for the two tests that read it (plan_check compiles every program afresh, with the
  persistent cache off: a second run_and_write of the same plan cost its whole compile again).
  Each test takes a deep copy: none sees what another changed."""
  c = _tiny_mesh_generation()
  c.staleness = 1
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  workdir = str(tmp_path_factory.mktemp("async_mesh_plan"))
  result = plan_programs.run_and_write(cfg, workdir)
  with open(os.path.join(workdir, "result.json")) as f:
    programs = json.load(f)["programs"]
  return cfg, result, programs


def test_async_ppos_copy_of_the_actor_stands_beside_the_update_and_the_generation(
    async_mesh_plan):
  """The copy counts where the trainer holds it, beside the whole training state: beside the
  train step (whose peak alone was its fit), beside every program of the generation it feeds
  (on the serial stage not beside decode and prefill, whose argument it is: the state's own
  actor there no longer stands for the reference, which is beside them), not beside the passes
  that run before it is made; in result.json, the table's "+state" column and the verdict, so
  a plan that fits without it but not with it does not fit (plan_check's exit status reads
  every program's fit)."""
  cfg, result, programs = copy_lib.deepcopy(async_mesh_plan)
  copy = plan_programs.actor_copy_bytes(cfg, plan_programs.train_mesh(cfg))
  assert copy > 0 and result["plan"]["actor_copy_bytes"] == copy
  train = programs["train_step"]
  reference = programs["inference"]["analytic"]["params_bytes"]
  assert train["actor_copy_bytes"] == copy
  assert train["peak_with_train_state_bytes"] == train["peak_bytes"] + reference + copy
  for name in ("inference", "actor_logp", "critic_values", "decode"):
    p = programs[name]
    assert p["actor_copy_bytes"] == (copy if name == "inference" else 0), name
    assert p["peak_with_train_state_bytes"] == (
        p["peak_bytes"] + p["resident_train_bytes"] + p["resident_model_bytes"] +
        p["actor_copy_bytes"]), name
  assert programs["decode"]["resident_model_bytes"] == reference  # (was 0: "counted twice")
  line = next(ln for ln in plan_programs.table(result) if ln.startswith("train_step "))
  assert plan_programs._gb(train["peak_with_train_state_bytes"]) in line.split(), line
  # Between the train step's peak with the reference and that plus the copy: it fits without
  # the copy, not with it, and the verdict names the copy and what removes or shrinks it.
  hbm = train["peak_with_train_state_bytes"] - 1
  for counted, fits in ((0, True), (copy, False)):
    rejudged = {k: {**v, "hbm_bytes": hbm} for k, v in result["programs"].items()}
    plan_programs.beside_train_state(rejudged, hbm, False, reference=True, generation="mesh",
                                     actor_copy_bytes=counted)
    assert rejudged["train_step"]["fits"] is fits
    assert rejudged["train_step"]["fits_alone"] is True
  rejudged["train_step"].update(temp_bytes=0, argument_bytes=0, output_bytes=0, alias_bytes=0,
                                peak_bytes=0, resident_model_bytes=0)  # the copy alone
  part = plan_programs.verdict({**result, "programs": rejudged}).split("train_step (peak")[1]
  assert ("with the actor's copy; largest: the actor's copy beside it: a generation group "
          "(generation_devices: a run's async_ppo.generation_devices") in part, part
  assert "staleness 0" in part, part


def test_where_async_ppos_copy_of_the_actor_stands_on_each_layout():
  """beside_train_state on hand-made figures (per device: the copy 30, the training state 100,
  the reference 30, the critic's copy 10): on instances over the training devices the copy
  (in the training layout) is beside every program of theirs, the unpipelined hand-over
  included (its argument is the copy, the state's own actor stays), not a pipelined one's (the
  copy is its output); on the serial stage beside the scoring programs only; with a generation
  group nowhere (the copy is the group's actor)."""
  def programs():
    return {"train_step": {"argument_bytes": 100, "optimizer_state_bytes": 40,
                           "peak_bytes": 150, "fits": True},
            "decode": {"peak_bytes": 50, "fits": True, "analytic": {"params_bytes": 30}},
            "inference": {"peak_bytes": 40, "fits": True, "analytic": {"params_bytes": 30}},
            "placement": {"peak_bytes": 60, "fits": True, "over_state_bytes": {"reshard": 25}},
            "critic_values": {"peak_bytes": 20, "fits": True, "state_critic_bytes": 10}}

  def copies(**kw):
    p = programs()
    plan_programs.beside_train_state(p, 1000, False, actor_copy_bytes=30, **kw)
    return {k: v["actor_copy_bytes"] for k, v in p.items()}, p

  got, p = copies(critic_copy_bytes=10)  # instances
  assert got == {"train_step": 30, "decode": 30, "inference": 30, "placement": 30,
                 "critic_values": 0}
  assert p["train_step"]["peak_with_train_state_bytes"] == 150 + 30
  assert p["decode"]["peak_with_train_state_bytes"] == 50 + 100 + 30
  assert p["placement"]["peak_with_train_state_bytes"] == 100 + 30 + 25
  assert p["critic_values"]["peak_with_train_state_bytes"] == 20 + 90
  got, _ = copies(critic_copy_bytes=10, pipelined=True)
  assert got["placement"] == 0 and got["decode"] == 30
  got, p = copies(generation="mesh")
  assert (got["train_step"], got["decode"], got["inference"], got["critic_values"]) == (
      30, 0, 30, 0)
  assert p["decode"]["resident_model_bytes"] == 30  # the reference, beside the copy it reads
  got, _ = copies(generation_group=True)
  assert set(got.values()) == {0}


@pytest.mark.parametrize("field,value", [("staleness", 1), ("generation_devices", 4)])
def test_offloading_the_optimizer_beside_async_ppo_is_refused_as_the_trainer_refuses_it(
    field, value):
  """The trainer refuses optim.offload_during_rollout with async_ppo.staleness > 0 or a
  generation group; a plan config with offload_optimizer beside either was accepted, its
  generation programs judged with the moments in host memory, for a run that cannot be made."""
  c = plan_config.get_config("tiny")
  c.generation, c.gen_slots = "mesh", 8
  c[field], c.offload_optimizer = value, True
  with pytest.raises(ValueError, match=r"config\.offload_optimizer=True: expected False with "
                                       r"staleness > 0 or generation_devices > 0"):
    plan_programs.PlanConfig.from_config_dict(c)
  c.offload_optimizer = False
  assert getattr(plan_programs.PlanConfig.from_config_dict(c), field) == value
  # Nor does a verdict propose it there (the state beside decode its largest term).
  result = _scaled_result(1.0)
  result["programs"]["decode"].update(fits=False, resident_train_bytes=85.08e9 - 10.77e9)
  assert "offload_optimizer" in plan_programs.verdict(result)
  result["plan"][field] = value
  assert plan_programs.verdict(result).endswith(
      "largest: the training state beside it: zero1 (a run's optim.zero1), fsdp, more stages "
      "or tensor devices)")


def test_a_run_without_a_reference_is_checked_without_one(tmp_path):
  """--run_config with algo.kl_coef=0: the trainer builds no reference (AlgoConfig.
  uses_reference), yet plan_check compiled a reference forward and counted a reference
  resident beside the actor on an asynchronous generation group. The plan follows the run
  (config.reference, False), the inference program is the critic's value forward, and the
  group holds no reference: decode has nothing beside it, the critic's forward the actor."""
  import subprocess
  import sys
  from configs import ppo_tiny
  from tests.xla_env import subprocess_env
  run = ppo_tiny.get_config()
  run.algo.kl_coef = 0.0
  c = plan_config.get_config("tiny")
  assert c.reference is True  # the presets' default: a reference
  plan_config.apply_run(c, run)
  assert c.reference is False
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_check", "--config=configs/plan_check.py:tiny",
       "--run_config=configs/ppo_tiny.py", "--run_config.algo.kl_coef=0",
       "--run_config.async_ppo.staleness=1", "--run_config.async_ppo.generation_devices=4",
       f"--workdir={tmp_path}"], cwd=repo, env=subprocess_env(4), capture_output=True,
      text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(tmp_path, "result.json")) as f:
    result = json.load(f)
  assert result["plan"]["reference"] is False
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  decode, inference = result["programs"]["decode"], result["programs"]["inference"]
  critic = plan_programs._nbytes(llama.param_shapes(cfg.critic))  # one device's, data-only mesh
  actor = plan_programs._nbytes(llama.param_shapes(cfg.actor))
  assert critic != actor
  assert inference["analytic"]["params_bytes"] == critic
  assert decode["analytic"]["params_bytes"] == actor
  assert decode["resident_model_bytes"] == 0
  assert inference["resident_model_bytes"] == actor
  # Synchronous on the group (staleness 0): the critic's copy sits beside decode.
  programs = {k: dict(v) for k, v in result["programs"].items()}
  plan_programs.beside_train_state(programs, 80e9, False, True, critic, reference=False)
  assert (programs["decode"]["resident_model_bytes"],
          programs["inference"]["resident_model_bytes"]) == (critic, actor)


def test_binary_takes_a_training_config_with_its_overrides(tmp_path):
  """experiments/plan_check.py --run_config=<train_ppo's --config> with an override of it: the
  plan follows the run as overridden (its response length), the models come from the run's
  checkpoint, the rest from --config."""
  import subprocess
  import sys
  from tests.xla_env import subprocess_env
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  wd = str(tmp_path / "pc")
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_check", "--config=configs/plan_check.py",
       "--run_config=configs/ppo_hf.py:ppo_gpu", "--run_config.rollout.max_new_tokens=16",
       f"--workdir={wd}"], cwd=repo, env=subprocess_env(), capture_output=True, text=True,
      timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(wd, "result.json")) as f:
    result = json.load(f)
  from configs import ppo_hf
  run = ppo_hf.get_config("ppo_gpu")
  plan = result["plan"]
  assert (plan["response_len"], plan["seq_len"]) == (16, run.data.max_prompt_len + 16)
  assert (plan["fsdp"], plan["generation"], plan["gradient_sync"]) == (8, "instances", "once")
  assert plan["hardware"] == "h100_sxm" and result["devices"] == 8
  with open(os.path.join(repo, run.init.actor_checkpoint, "config.json")) as f:
    hf = json.load(f)
  assert result["models"]["actor"]["hidden_size"] == hf["hidden_size"]
  assert "time bounds on h100_sxm" in out.stderr
  # 512 + 16 tokens past the tiny checkpoint's 256 positions: train_ppo refuses it, and the
  # check said "fits" without a word.
  assert ("train_ppo would refuse this run: config.data.max_prompt_len + "
          "config.rollout.max_new_tokens = 528 exceeds the max_position_embeddings=256"
          in out.stderr)


@pytest.mark.parametrize("generation,kv_heads,tp", [("instances", 2, 1), ("instances", 2, 2),
                                                        ("instances", 2, 4),
                                                        ("instances", 1, 4), ("mesh", 2, 2),
                                                        ("mesh", 1, 2)])
def test_decode_analytic_cache_bytes_follow_the_engines_cache_sharding(generation, kv_heads, tp):
  """The analytic KV bytes per device are those of the cache as the engine shards it: split
  over the tensor devices only where they divide the KV heads, replicated otherwise (gen_tp 4
  over 2 heads holds 4x what an even split would)."""
  cfg = plan_programs.PlanConfig.from_config_dict(plan_config.get_config("tiny"))
  cfg = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, num_kv_heads=kv_heads),
                            generation=generation, gen_tp=tp)
  if generation == "mesh":  # the training mesh's tensor axis: pp 2 x tp 2 x fsdp 2
    cfg = dataclasses.replace(cfg, tp=tp, dp=1, gen_slots=8)
  if generation == "instances":
    mesh = inst_lib.split_devices(jax.devices(), 1, tp)[0]
  else:
    mesh = mesh_lib.fold_stage(plan_programs.train_mesh(cfg))  # as make_instance builds it
  a = cfg.actor
  shape = (a.num_layers, cfg.gen_slots, cfg.seq_len, a.num_kv_heads, a.head_dim_)
  k = engine.state_shardings(a, mesh).cache.k
  per_device = 2 * np.prod(k.shard_shape(shape)) * np.dtype(a.dtype).itemsize
  assert plan_programs.decode_analytic(cfg)["kv_cache_bytes"] == per_device


def test_decode_replication_compares_like_with_like_past_one_key_block():
  """A cache longer than one key block (seq_len 320 > CACHE_BLOCK_K = 128): XLA counts the
  live-prefix loop's body, one block, once, and the analytic count it is compared with does
  the same, so the split decode step shows replication 1 (it read 0.7 here, 0.93-0.96 on the
  paper pairs, comparing one block with the whole cache)."""
  cfg = plan_programs.PlanConfig.from_config_dict(plan_config.get_config("tiny"))
  cfg = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, max_seq_len=320),
                            seq_len=320, response_len=16, gen_tp=2)
  out = plan_programs.instance_programs(cfg)["decode"]
  assert abs(out["replication"] - 1.0) < 1e-6, out["replication"]
  a = out["analytic"]
  assert a["flops_counted_per_device"] < a["flops_per_device"]  # the whole cache's step


def test_a_layer_count_the_stages_do_not_divide_names_config_layers():
  """config.layers=4 on an 8-stage plan named config.actor.num_layers, which the user never
  set, and advised setting config.layers, which they had."""
  c = plan_config.get_config("7b_host8")
  c.layers = 4
  with pytest.raises(ValueError, match=r"^config\.layers=4: expected a multiple of the actor's 8 "
                                       r"pipeline stages \(e\.g\. 8\)$"):
    plan_programs.PlanConfig.from_config_dict(c)


def test_replication_is_the_compiled_flops_over_the_analytic():
  """replication > 1: the compiled program does more dot work than the useful work (repeated
  across devices); the loop-aware analytic count is the divisor where there is one."""
  finish = plan_programs._finish  # pylint: disable=protected-access
  measured = {"flops_per_device": 6.0, "peak_bytes": 1}
  out = finish(measured, {"flops_per_device": 4.0, "lockstep_flops_per_device": 5.0})
  assert out["replication"] == 1.5 and out["replication_lockstep"] == 1.2
  out = finish(measured, {"flops_per_device": 4.0, "flops_counted_per_device": 2.0})
  assert out["replication"] == 3.0 and "replication_lockstep" not in out


def test_a_16_bit_hand_over_measures_half_the_float32_one():
  """The placement reshard moves bits: a bfloat16 actor's measures half a float32 one's, its
  temporaries included (XLA:CPU widens a bfloat16 collective to float32, which a GPU does not:
  compiled as bfloat16 the temp was twice the bytes gathered), and in a plan that generates on
  the mesh, or on instances that do not cover the training devices (or on asynchronous PPO's
  generation group) without a pipelined copy to make, or on instances that split the weights
  as training does, there is none."""
  c = plan_config.get_config("tiny")
  c.update(pp=1, critic_pp=1, fsdp=4, dp=2, gen_tp=2, microbatch_size=0)
  figures = {}
  for dtype in ("float32", "bfloat16"):
    c.actor.param_dtype = c.critic.param_dtype = dtype
    cfg = plan_programs.PlanConfig.from_config_dict(c)
    out = plan_programs.placement_programs(cfg, plan_programs.train_mesh(cfg), None)
    assert set(out["placement"]["parts"]) == {"reshard"}  # pp == 1: the state's own actor
    figures[dtype] = out["placement"]["parts"]["reshard"]
  half, full = figures["bfloat16"], figures["float32"]
  assert 2 * half["argument_bytes"] == full["argument_bytes"]
  # Outputs: the same leaves at half the width, and the output tuple's 8-byte pointers.
  table = 2 * half["output_bytes"] - full["output_bytes"]
  assert 0 < table <= 8 * len(jax.tree.leaves(llama.param_shapes(cfg.actor))) and table % 8 == 0
  # (the same buffers at half the width; XLA aligns each to a few bytes)
  assert full["temp_bytes"] > 0 and abs(2 * half["temp_bytes"] - full["temp_bytes"]) <= 64
  for other in ({"generation": "mesh"}, {"gen_tp": 3}, {"generation_devices": 4}):
    assert plan_programs.placement_programs(dataclasses.replace(cfg, **other), None, None) == {}
  # Instances split like training (tensor 2 both): every weight is where an instance wants it
  # already, nothing moves (mesh_lib.put relabels it), nothing is counted.
  same = dataclasses.replace(cfg, fsdp=1, dp=4, tp=2)
  assert plan_programs.placement_programs(same, plan_programs.train_mesh(same), None) == {}


def test_a_program_fits_when_its_whole_peak_does():
  """fits compares the peak (arguments + outputs + temporaries - aliased) with the preset's
  HBM, not one of its parts: a program whose 1 MiB argument alone exceeds the HBM does not fit."""
  x = jax.ShapeDtypeStruct((512, 512), np.float32)
  lowered = jax.jit(lambda a: (a @ a).sum()).lower(x)
  hw = hardware.get_hardware("h100_sxm")
  m = plan_programs.measure(lowered, hw)
  assert m["argument_bytes"] == 512 * 512 * 4
  assert m["peak_bytes"] == (m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"] -
                             m["alias_bytes"])
  exact = plan_programs.measure(lowered, dataclasses.replace(hw, hbm_bytes=m["peak_bytes"]))
  short = plan_programs.measure(lowered, dataclasses.replace(hw, hbm_bytes=m["peak_bytes"] - 1))
  assert exact["fits"] is True and short["fits"] is False
  small = dataclasses.replace(hw, hbm_bytes=m["argument_bytes"] - 1)
  assert plan_programs.measure(lowered, small)["fits"] is False


def test_decode_and_inference_fit_only_beside_the_training_state():
  """beside_train_state, on hand-made figures (HBM 100 bytes): a decode peak of 50 fits alone but
  not beside the train step's 60 bytes of arguments; it does once the 20 bytes of moments are
  offloaded (50 + 40); a generation group holds the other model's weights (30) and the critic's
  (15 or 25) instead of the training state."""
  def programs():
    return {"train_step": {"argument_bytes": 60, "optimizer_state_bytes": 20},
            **{name: {"peak_bytes": 50, "fits": True, "analytic": {"params_bytes": 30}}
               for name in ("decode", "inference")}}
  p = programs()
  plan_programs.beside_train_state(p, 100, offload_optimizer=False)
  assert (p["decode"]["peak_with_train_state_bytes"], p["decode"]["fits"]) == (110, False)
  assert p["decode"]["fits_alone"] is True and p["inference"]["fits"] is False
  p = programs()
  plan_programs.beside_train_state(p, 100, offload_optimizer=True)
  assert (p["decode"]["peak_with_train_state_bytes"], p["decode"]["fits"]) == (90, True)
  for critic, fits in ((15, True), (25, False)):
    p = programs()
    plan_programs.beside_train_state(p, 100, offload_optimizer=True, generation_group=True,
                                     group_critic_bytes=critic)
    assert p["decode"]["resident_train_bytes"] == 0
    assert (p["decode"]["peak_with_train_state_bytes"], p["decode"]["fits"]) == (
        50 + 30 + critic, fits)


def test_decode_reads_its_shard_of_the_weights_and_cache_per_step():
  """decode_analytic's bandwidth bound: per device, the actor's weights over the generation
  model shards plus the K/V cache of every slot over the cache shards, counted by hand from the
  parameter shapes and the cache's [layers, 2, slots, seq, kv_heads, head_dim] layout."""
  cfg = plan_programs.PlanConfig.from_config_dict(_tiny_mesh_generation())
  a = cfg.actor
  assert cfg.gen_model_shards > 1 and cfg.gen_kv_shards > 1  # something to split
  params = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(llama.param_shapes(a)))
  kv = (a.num_layers * 2 * cfg.gen_slots * cfg.seq_len * a.num_kv_heads * a.head_dim_ *
        np.dtype(a.dtype).itemsize)
  out = plan_programs.decode_analytic(cfg)
  assert out["params_bytes"] == params / cfg.gen_model_shards
  assert out["kv_cache_bytes"] == kv / cfg.gen_kv_shards
  total = params / cfg.gen_model_shards + kv / cfg.gen_kv_shards
  assert out["total_bytes"] == total
  assert out["hbm_s"] == pytest.approx(total / cfg.hardware.hbm_bw)
  # Dot FLOPs of a step over the whole cache: the layers' kernels (2D leaves of one layer), the
  # attention over seq_len keys and the LM head, for every slot, split over the devices.
  layer = llama.param_shapes(a)["layers_0"]
  kernels = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(layer) if len(x.shape) == 2)
  per_row = (2 * a.num_layers * kernels + 4 * a.num_layers * a.num_heads * a.head_dim_ *
             cfg.seq_len + 2 * a.hidden_size * a.vocab_size)
  assert cfg.gen_devices > 1
  assert out["flops_per_device"] == pytest.approx(cfg.gen_slots * per_row / cfg.gen_devices)


def test_the_binary_sets_enough_devices_for_the_largest_group():
  """plan_check.device_count, before jax starts: the training mesh (pp*tp*dp*fsdp), one
  generation instance (gen_tp) or asynchronous PPO's generation group, whichever is largest.
  In a child process: the binary defines absl flags at import."""
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = ("import ml_collections as m; from experiments import plan_check as p; "
          "base = dict(pp=1, tp=1, dp=2, fsdp=1, gen_tp=1); "
          "print([p.device_count(m.ConfigDict({**base, **x})) for x in ("
          "{}, {'gen_tp': 4}, {'generation_devices': 6}, {'pp': 2, 'fsdp': 2, "
          "'generation_devices': 0}, {'generation_devices': None}, "
          "{'gen_tp': 3, 'generation_devices': 5}, {'gen_tp': 5, 'generation_devices': 3})])")
  out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split("\n")[-2] == "[2, 4, 6, 8, 2, 5, 5]"


def _analytic(c, ticks=0):
  return plan_programs.train_analytic(plan_programs.PlanConfig.from_config_dict(c),
                                      {"ticks": ticks})


def test_train_analytic_splits_grads_and_optimizer_state_as_the_plan_does():
  """Per device: gradients are the parameters' bytes (their dtype) over pp*tp*fsdp shards;
  zero1 splits the optimizer state a further dp ways, and only with zero1."""
  c = plan_config.get_config("tiny")  # pp 2, tp 1, fsdp 2, dp 2
  n = sum(int(np.prod(x.shape)) for m in ("actor", "critic")
          for x in jax.tree.leaves(llama.param_shapes(
              getattr(plan_programs.PlanConfig.from_config_dict(c), m))))
  off = _analytic(c)
  assert off["params_bytes"] == off["grads_bytes"] == 4 * n / (2 * 1 * 2)  # float32 parameters
  c.zero1 = True
  on = _analytic(c)
  assert on["optimizer_bytes"] * 2 == pytest.approx(off["optimizer_bytes"])
  assert on["grads_bytes"] == off["grads_bytes"] and on["params_bytes"] == off["params_bytes"]
  # Adam's two float32 moments per parameter (plus step counters) over the 4 shards.
  assert off["optimizer_bytes"] >= 8 * n / 4


def test_pipelined_activations_hold_one_micro_batch_per_stage_in_flight():
  """1F1B keeps min(stages, micro-batches) micro-batches' activations per device, counted per
  model: 34*h bytes per token and layer (the simulator's figure) times a stage's layers, at the
  models' dtype (tiny's float32: twice the 16-bit figure)."""
  c = plan_config.get_config("tiny")  # pp = critic_pp = 2, 2 rows per data shard
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  assert cfg.actor.dtype == cfg.critic.dtype == "float32"
  per_h = plan_programs.CostModel(cfg.hardware).eff.act_bytes_per_token_layer_per_h * 4 / 2
  one = lambda m, rows: per_h * m.hidden_size * rows * cfg.seq_len * m.num_layers / 2
  # Actor: 2 micro-batches of 1 row, both in flight; critic: 1 micro-batch of 2 rows.
  c.critic_microbatch_size = 2
  out = _analytic(c)
  assert out["activations_bytes"] == pytest.approx(2 * one(cfg.actor, 1) + one(cfg.critic, 2))
  # 4 micro-batches per shard: still 2 in flight on 2 stages.
  c.minibatch_size, c.critic_microbatch_size = 16, 0
  out = _analytic(c)
  assert out["activations_bytes"] == pytest.approx(2 * one(cfg.actor, 1) + 2 * one(cfg.critic, 1))


def test_lockstep_flops_split_over_the_tensor_devices():
  """A lockstep tick's task is split tp ways: doubling tp halves the lockstep FLOPs per device
  for the same ticks; doubling the ticks doubles them."""
  c = plan_config.get_config("tiny")
  c.dp, c.tp = 1, 1
  base = _analytic(c, ticks=6)["lockstep_flops_per_device"]
  c.tp = 2
  assert _analytic(c, ticks=6)["lockstep_flops_per_device"] * 2 == pytest.approx(base)
  assert _analytic(c, ticks=12)["lockstep_flops_per_device"] == pytest.approx(base)


def test_compute_s_is_the_compiled_dot_flops_at_peak():
  """A 512x512 matmul is 2*512**3 dot FLOPs; compute_s is that at the preset's peak FLOP/s
  (not its HBM bandwidth, nor the analytic count)."""
  x = jax.ShapeDtypeStruct((512, 512), np.float32)
  hw = hardware.get_hardware("h100_sxm")
  m = plan_programs.measure(jax.jit(lambda a: a @ a).lower(x), hw)
  assert m["flops_per_device"] == 2 * 512 ** 3
  assert m["compute_s"] == pytest.approx(2 * 512 ** 3 / hw.peak_flops)


def test_zero1_splits_an_unpipelined_critic_over_its_stage_replicas_too():
  """pp 2 with critic_pp 1: each critic weight has 2 (stage replicas) x dp 2 copies, so zero1
  gives every device a quarter of the critic's state over its fsdp shards, as many bytes as
  the 2-stage critic's quarter of its half; without zero1 the unstaged critic holds twice that."""
  c = plan_config.get_config("tiny")
  c.zero1 = True
  staged = _analytic(c)["optimizer_bytes"]
  c.critic_pp = 1
  assert _analytic(c)["optimizer_bytes"] == pytest.approx(staged)
  c.zero1 = False
  plain = _analytic(c)["optimizer_bytes"]
  c.critic_pp = 2
  assert plain > _analytic(c)["optimizer_bytes"]


def test_accumulated_gradients_and_mesh_inference_by_hand():
  """Unpipelined, data 2 x fsdp 2 x tensor 2, 2 micro-batches: float32 gradient sums split like
  the weights (over fsdp*tp = 4), or with gradient_sync="once" over tensor only beside the
  weights gathered over fsdp. Mesh inference scores 8 rows over data*fsdp = 4 shards, 2 rows of
  34*h bytes per token on one layer at a time, split over tensor 2; weights over fsdp*tp."""
  c = _tiny_mesh_generation()
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  n = sum(int(np.prod(x.shape)) for m in (cfg.actor, cfg.critic)
          for x in jax.tree.leaves(llama.param_shapes(m)))
  assert _analytic(c)["grad_accumulator_bytes"] == 4 * n / 4
  c.gradient_sync = "once"
  once = _analytic(c)
  assert once["grad_accumulator_bytes"] == once["gathered_params_bytes"] == 4 * n / 2
  a = cfg.actor
  assert a.dtype == "float32"  # its activations at 4 bytes: twice the 16-bit 34*h
  per_h = plan_programs.CostModel(cfg.hardware).eff.act_bytes_per_token_layer_per_h * 4 / 2
  out = plan_programs.inference_analytic(cfg)
  assert out["activations_bytes"] == pytest.approx(per_h * a.hidden_size * 2 * cfg.seq_len / 2)
  actor = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(llama.param_shapes(a)))
  assert out["params_bytes"] == 4 * actor / 4


def test_run_config_refuses_an_override_of_its_checkpoints_architecture(tmp_path):
  """--run_config.model.num_layers beside the run's init.actor_checkpoint is refused, as
  train_ppo refuses it: the plan was checked for the checkpoint's model, not the one asked."""
  import subprocess
  import sys
  from tests.xla_env import subprocess_env
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_check", "--config=configs/plan_check.py",
       "--run_config=configs/ppo_hf.py:ppo_gpu", "--run_config.model.num_layers=5",
       f"--workdir={tmp_path / 'pc'}"], cwd=repo, env=subprocess_env(), capture_output=True,
      text=True, timeout=600)
  assert out.returncode == 1, out.stderr[-3000:]
  assert ("--run_config.model.num_layers=5 cannot apply: config.init.actor_checkpoint="
          "'configs/data/tiny_llama3_chat' sets the model's architecture from its "
          "config.json, where num_layers is 2.") in out.stderr, out.stderr[-3000:]
  assert not os.path.exists(tmp_path / "pc")


def test_run_config_beside_a_preset_variant_is_refused(tmp_path):
  """--config=configs/plan_check.py:llama/13b --run_config=configs/ppo_hf.py checked ppo_hf's
  tiny model (the variant's models and plan replaced by the run's) and said it fits, exit 0,
  with nothing saying the 13B preset was not checked. Refused before anything compiles; the
  default variant (`tiny`, named or not) still takes --run_config."""
  import subprocess
  import sys
  from tests.xla_env import subprocess_env
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_check", "--config=configs/plan_check.py:llama/13b",
       "--run_config=configs/ppo_hf.py", f"--workdir={tmp_path / 'pc'}"], cwd=repo,
      env=subprocess_env(), capture_output=True, text=True, timeout=600)
  assert out.returncode == 1, out.stderr[-3000:]
  assert ("--config=configs/plan_check.py:llama/13b with --run_config: the variant 'llama/13b' "
          "sets the models and the plan, which --run_config sets too; give one") in out.stderr, (
              out.stderr[-3000:])
  assert not os.path.exists(tmp_path / "pc")
  for arg in ("configs/plan_check.py", "configs/plan_check.py:tiny"):
    plan_config.check_one_training_config(arg, run_config_given=True)
  for arg in ("configs/plan_check.py:7b_host8", "configs/plan_check.py:run/configs/ppo_tiny.py"):
    plan_config.check_one_training_config(arg, run_config_given=False)
    with pytest.raises(ValueError, match="give one"):
      plan_config.check_one_training_config(arg, run_config_given=True)


def test_a_pipelined_run_is_checked_with_its_checkpoints_layers(tmp_path, monkeypatch):
  """The trainer checks a pipelined run's layer split and tensor split on the checkpoint's
  architecture (trainer/build.resolve_config before trainer/validate); apply_run checked them
  on the config file's own model section (ppo_hf's 2 layers, 4 heads) and refused a
  checkpoint of 8 layers and 8 heads on 4 stages of 2 tensor devices ("config.model.num_layers
  =2 must be divisible by its pipeline stages 4"), the checkpoint a plan.json was searched for."""
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from configs import ppo_hf
  with open("configs/data/tiny_llama3_chat/config.json", encoding="utf-8") as f:
    spec = json.load(f)
  spec.update(num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, head_dim=8)
  (tmp_path / "config.json").write_text(json.dumps(spec))
  run = ppo_hf.get_config("ppo")
  run.init.actor_checkpoint = run.init.critic_checkpoint = str(tmp_path)
  run.mesh.stage, run.mesh.tensor, run.mesh.data = 4, 2, 1
  run.pipeline.critic_pp = 2
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, run)
  assert (c.actor.num_layers, c.actor.num_heads, c.pp, c.critic_pp, c.tp) == (8, 8, 4, 2, 2)
  spec["num_hidden_layers"] = 6  # the trainer's refusal, on the checkpoint's layers
  (tmp_path / "config.json").write_text(json.dumps(spec))
  with pytest.raises(ValueError, match=r"config\.model\.num_layers=6 must be divisible by its "
                                       r"pipeline stages 4"):
    plan_config.apply_run(plan_config.get_config("tiny"), run)


def test_a_critic_free_runs_critic_checkpoint_is_not_read(tmp_path):
  """A critic-free run (algo.estimator grpo) never reads init.critic_checkpoint: the trainer
  resolves and checks it only where a critic trains (build.resolve_config, validate's
  warning that it is not used), so a path with no config.json passes train_ppo. apply_run read
  it anyway, and refused the run plan_check now checks without a critic ("config.init.
  actor_checkpoint='...': .../config.json not found", the wrong field too). A GAE run's
  missing critic checkpoint is still refused, by its own field."""
  from configs import ppo_tiny
  missing = str(tmp_path / "no_critic")
  run = ppo_tiny.get_config("grpo")
  run.init.critic_checkpoint = missing
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, run)
  assert c.trains_critic is False
  assert c.critic.num_layers == run.critic_model.num_layers
  run = ppo_tiny.get_config("ppo")
  run.init.critic_checkpoint = missing
  with pytest.raises(FileNotFoundError, match=r"config\.init\.critic_checkpoint="):
    plan_config.apply_run(plan_config.get_config("tiny"), run)


def test_run_config_with_a_plan_file_for_another_workload_says_so(tmp_path):
  """--run_config's plan.file searched for another model and batch: train_ppo warns of it at
  set-up, plan_check checked the plan on the run's workload without a word (a 48-layer plan on
  ppo_gpu's 512-token prompts). Stopped right after by an unknown hardware, to stay cheap."""
  import subprocess
  import sys
  from tests.xla_env import subprocess_env
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  layer = {"num_layers": 48, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
           "vocab_size": 128}
  plan = {"generation": {"mode": "instances", "tp": 1, "pp": 1, "groups": 1, "slots": 0},
          "inference": {"tp": 1, "pp": 1},
          "training": {"placement": "colocated", "devices": 8, "tp": 1, "actor_pp": 1,
                       "critic_pp": 1},
          "predicted": {"iteration_s": 1.0}, "summary": "test plan",
          "workload": {"actor": layer, "critic": layer, "global_batch": 512, "minibatch": 64,
                       "epochs": 1, "max_prompt_len": 1024, "max_new_tokens": 1024,
                       "num_devices": 8}}
  (tmp_path / "plan.json").write_text(json.dumps(plan))
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_check", "--config=configs/plan_check.py",
       "--config.hardware=no_such_gpu", "--run_config=configs/ppo_hf.py:ppo_gpu",
       f"--run_config.plan.file={tmp_path / 'plan.json'}", f"--workdir={tmp_path / 'pc'}"],
      cwd=repo, env=subprocess_env(), capture_output=True, text=True, timeout=600)
  assert out.returncode == 1, out.stderr[-3000:]
  assert (f"--run_config: config.plan.file='{tmp_path / 'plan.json'}' was searched for actor "
          "num_layers=48 (this run has 2); critic num_layers=48 (this run has 2); global_batch="
          "512 (this run's rollout.batch_size is 128); max_prompt_len=1024 (this run's data."
          "max_prompt_len is 512): its predicted times and memory check are for that workload"
          ) in out.stderr, \
      out.stderr[-3000:]
  assert "unknown hardware 'no_such_gpu'" in out.stderr, out.stderr[-3000:]


def test_a_tensor_degree_the_heads_refuse_names_plan_checks_own_fields():
  """configs/plan_check.py:7b_host8 with --config.tp=3 stopped after jax started with the
  trainer's "config.model.num_heads=32 must be divisible by mesh.tensor=3", fields plan_check
  has not; it names config.tp and the model's dimensions before anything compiles."""
  c = plan_config.get_config("7b_host8")
  c.tp = 3
  with pytest.raises(ValueError, match=(
      r"^config\.tp=3: expected a divisor of the actor's num_heads=32, intermediate_size=11008, "
      r"num_kv_heads=32 \(or a multiple of it\) \(config\.actor\): the pipelined update")):
    plan_programs.PlanConfig.from_config_dict(c)
  c = plan_config.get_config("tiny")  # 4 heads, 2 KV heads (fewer than tp: kept whole)
  c.tp, c.dp, c.fsdp = 4, 1, 1
  assert plan_programs.PlanConfig.from_config_dict(c).tp == 4


def test_the_simulators_training_memory_is_plan_checks_at_the_padded_rows():
  """The simulator sized a plan's training activations at the mean sample length while the
  trainer, and plan_check's train_step, run every row at seq_len = max prompt + max new tokens:
  plan_search chose a plan that plan_check then measured at 85.7 GB on 48 GB devices. The
  search's memory check of a pipelined plan now allows exactly plan_check's analytic bytes of
  the same plan (params, grads, ZeRO-1 optimizer state, 1F1B activations at the padded rows),
  with samples 16 tokens long on average: the plan fits with that much usable memory and is
  refused with 0.1 % less."""
  from rlhfuse_jax.sim import iteration_sim, plan_search, shapes
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.lengths import LengthSpec
  c = plan_config.get_config("tiny")
  for m in (c.actor, c.critic):
    m.num_layers, m.hidden_size, m.intermediate_size, m.max_seq_len = 4, 256, 512, 512
    m.dtype = m.param_dtype = "bfloat16"
  c.pp, c.critic_pp, c.tp, c.dp, c.fsdp = 2, 2, 1, 4, 1
  c.minibatch_size, c.microbatch_size = 32, 1
  c.seq_len, c.response_len = 512, 384
  c.master_weights = c.zero1 = True
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  analytic = plan_programs.train_analytic(cfg, {"ticks": 1})  # (ticks: FLOPs only)
  need = sum(analytic[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                   "activations_bytes"))
  wl = iteration_sim.Workload(
      actor=shapes.from_model_config(cfg.actor, "actor"),
      critic=shapes.from_model_config(cfg.critic, "critic").as_critic(), num_devices=8,
      global_batch=32, minibatch=32, max_new_tokens=384,
      prompt=LengthSpec(kind="constant", value=8, max_len=128),
      response=LengthSpec(kind="constant", value=8))
  assert wl.padded_len == cfg.seq_len
  base = hardware.get_hardware("h100_sxm")
  for scale, fits in ((1.001, True), (0.999, False)):
    cost = CostModel(dataclasses.replace(base, hbm_bytes=need * scale / 0.9))
    assert cost.eff.memory_headroom == 0.9
    rejected: dict = {}
    plans = plan_search.training_candidates(cost, wl, 16.0, rejected)
    assert any(p.plan.get("actor_pp") == 2 and p.plan.get("critic_pp") == 2 and
               p.plan.get("tp") == 1 for p in plans) == fits, rejected.get("training tp1/pa2/pc2")


def _small_case(generation: str):
  """The brief's small case as the simulator sees it and as plan_check compiles it: a 1024-wide,
  4-layer bf16 actor and critic, 4-token prompts padded to max_prompt_len 512, 1536 new
  tokens, a batch of 64 on 8 devices; inference tp2 on instances of tp2 with 16 slots, or
  (8 layers) after a pipeline of 8 one-device stages, the Scorer over data 2 x tensor 4."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim.lengths import LengthSpec
  from rlhfuse_jax.sim.shapes import ModelShape
  layers, tp = (4, 2) if generation == "instances" else (8, 4)
  a = ModelShape("actor", num_layers=layers, hidden_size=1024, intermediate_size=2048, num_heads=8,
                 num_kv_heads=8, vocab_size=22)
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=8, global_batch=64, minibatch=32,
                   epochs=2, max_new_tokens=1536,
                   prompt=LengthSpec(kind="constant", value=4, max_len=512),
                   response=LengthSpec(kind="constant", value=8))
  c = plan_config.get_config("tiny")
  for m in ("actor", "critic"):
    c[m].update(hidden_size=1024, intermediate_size=2048, num_layers=layers, num_heads=8,
                num_kv_heads=8, vocab_size=22, max_seq_len=2048, param_dtype="bfloat16",
                dtype="bfloat16")
  c.pp = c.critic_pp = 1
  c.tp, c.dp, c.fsdp, c.minibatch_size = tp, 8 // tp, 1, 32
  c.seq_len, c.response_len = 2048, 1536
  if generation == "instances":
    gen = {"mode": "instances", "tp": 2, "pp": 1, "groups": 1, "slots": 16}
    c.gen_tp, c.gen_slots, c.inference_microbatch = 2, 16, 16  # fusion's 0: the slots
  else:
    gen = {"mode": "pipeline", "tp": 1, "pp": 8, "groups": 8, "slots": 8}
    c.generation, c.gen_slots = "mesh", 64  # the Scorer: the whole batch over data x tensor
  plan = {"generation": gen, "inference": {"tp": tp, "pp": 1},
          "training": {"placement": "colocated", "devices": 8, "tp": tp, "actor_pp": 1,
                       "critic_pp": 1, "micro_batch": 1}}
  return wl, plan, plan_programs.PlanConfig.from_config_dict(c)


@pytest.mark.parametrize("generation", ["instances", "pipeline"])
def test_simulated_inference_activations_are_plan_checks_analytic_ones(generation):
  """The search's inference memory of a plan the trainer runs (sim.trainer_runnable) holds the
  activations plan_check's analytic figures count for the program the trainer compiles: the
  rows it scores at once (an instance's slots; the Scorer's batch share) at the padded length
  (max_prompt_len + max_new_tokens). It sized 8 rows (sim.inference_microbatch) at the longest
  sampled prompt + max_new_tokens: 0.20 GiB against 0.53 on instances."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  wl, plan, cfg = _small_case(generation)
  cost = CostModel(hardware.get_hardware("h100_sxm"))
  opt = it.SimOptions(trainer_runnable=True)
  want = plan_programs.inference_analytic(cfg)["activations_bytes"]
  rows = 16 if generation == "instances" else 32
  assert ps.trainer_refusal(wl, plan) is None
  assert ps.inference_rows(wl, opt, plan) == rows
  assert ps.inference_memory(cost, wl, opt, plan)["activations"] == pytest.approx(want)
  # And the reference's float32 logits of those rows, as plan_check's analytic figure.
  logits = plan_programs.inference_analytic(cfg)["logits_bytes"]
  assert logits > 0 and ps.inference_memory(cost, wl, opt, plan)["logits"] == pytest.approx(
      logits)
  inf = next(r for r in ps.plan_memory(cost, wl, opt, plan) if r["stage"] == "inference")
  assert inf["parts"]["activations"] == pytest.approx(want)
  if generation == "pipeline":
    # The trainer's pipeline stage keeps the frozen models on its inference mesh beside the
    # generation too (plan_search.keeps_frozen_on_mesh; since 2026-12-07): its generation row
    # is then the larger and refused first, whatever its groups.
    gen = next(r for r in ps.plan_memory(cost, wl, opt, plan) if r["stage"] == "generation")
    assert gen["parts"]["frozen weights kept"] > 0 and gen["total"] > inf["total"]
    return
  # Where it does not fit at the trainer's rows the search refuses the combination, naming them.
  need = inf["total"]
  assert next(r for r in ps.plan_memory(cost, wl, opt, plan) if r["stage"] == "generation")[
      "total"] < 0.99 * need
  small = CostModel(dataclasses.replace(cost.hw, hbm_bytes=need * 0.99 /
                                        cost.eff.memory_headroom))
  refused: dict = {}
  # pylint: disable-next=protected-access
  assert ps._runnable(small, wl, opt, [plan], None, 1, refused) == []
  # (the trainer keeps its training state beside its inference: without, it would fit)
  assert need - inf["parts"]["training state kept"] < 0.99 * need
  assert list(refused) == [f"inference tp{plan['inference']['tp']} scoring the trainer's {rows} "
                           "samples at once does not fit in memory beside its training plan's "
                           "state (both models' weights and AdamW state)"]


def test_simulated_inference_takes_the_runs_inference_micro_batch(tmp_path):
  """A train_config with fusion.inference_micro_batch=8 scores 8 samples at once on its
  generation instances (FusedGenConfig.micro_batch); the search sized the inference
  activations at the instance's 16 slots (the default 0's) whatever the run set. The run's
  value travels in its workload (sim_plan.workload, plan.json's record, compared by train_ppo)
  and the activations are plan_check's for 8 rows."""
  from configs import ppo_tiny
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.trainer import build, sim_plan
  from rlhfuse_jax.trainer import config as config_lib
  from rlhfuse_jax.trainer import plan_file as plan_file_lib
  wl, plan, cfg = _small_case("instances")
  wl = dataclasses.replace(wl, inference_micro_batch=8)
  cfg = dataclasses.replace(cfg, inference_microbatch=8)
  cost = CostModel(hardware.get_hardware("h100_sxm"))
  opt = it.SimOptions(trainer_runnable=True)
  want = plan_programs.inference_analytic(cfg)["activations_bytes"]
  assert ps.inference_rows(wl, opt, plan) == 8
  assert ps.inference_memory(cost, wl, opt, plan)["activations"] == pytest.approx(want)
  # the run's value, from its config to plan.json's workload and back to train_ppo's check
  c = ppo_tiny.get_config()
  c.fusion.inference_micro_batch = 4
  c.fusion.migration_rows = 3
  run = config_lib.TrainConfig.from_config_dict(c)
  task, tok = build.build_task_and_tokenizer(run)
  run = build.resolve_config(run, tok)
  wl = sim_plan.workload(run, task, tok, 8, str(tmp_path))[0]
  assert wl.inference_micro_batch == 4
  record = ps.workload_record(wl, "configs/ppo_tiny.py",
                              sim_plan.sim_options(it.SimOptions(offload_optimizer=True), run))
  assert record["inference_micro_batch"] == 4 and record["migration_rows"] == 3
  assert record["offload_optimizer"] is False  # the run's optim.offload_during_rollout
  assert "inference_micro_batch" not in ps.workload_record(wl)  # a pair's search: no run's
  assert "migration_rows" not in ps.workload_record(wl)
  other = dataclasses.replace(run, fusion=dataclasses.replace(
      run.fusion, inference_micro_batch=0, migration_rows=8),
                              optim=dataclasses.replace(run.optim, offload_during_rollout=True))
  assert plan_file_lib.plan_workload_differences({"workload": record}, run) == []
  assert plan_file_lib.plan_workload_differences({"workload": record}, other) == [
      "inference_micro_batch=4 (this run's fusion.inference_micro_batch is 0)",
      "migration_rows=3 (this run's fusion.migration_rows is 8)",
      "offload_optimizer=False (this run's optim.offload_during_rollout is True)"]


def test_simulated_kv_cache_is_plan_checks_decode_cache():
  """The search's KV cache of a plan the trainer runs (sim.trainer_runnable) is the cache
  plan_check's decode program allocates: every slot at max_prompt_len + max_new_tokens (2048
  here). It sized the slots at the longest sampled prompt + max_new_tokens: 1540 of the 2048
  tokens, 64 MiB a device short. Without trainer_runnable (the papers' paged caches) it
  stays at the sampled prompts."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  wl, plan, cfg = _small_case("instances")
  cost = CostModel(hardware.get_hardware("h100_sxm"))
  want = plan_programs.decode_analytic(cfg)["kv_cache_bytes"]
  got = {r["stage"]: r for r in ps.plan_memory(cost, wl, it.SimOptions(trainer_runnable=True),
                                               plan)}["generation"]["parts"]["KV cache"]
  assert got == pytest.approx(want)
  paged = {r["stage"]: r for r in ps.plan_memory(cost, wl, it.SimOptions(), plan)}
  assert paged["generation"]["parts"]["KV cache"] == pytest.approx(want * (4 + 1536) / 2048)
  # The search's generation check allows exactly that cache: on devices with room for the
  # sampled prompts' cache but not the trainer's, no trainer plan of instances of tp2 fits.
  gen = {r["stage"]: r for r in ps.plan_memory(cost, wl, it.SimOptions(trainer_runnable=True),
                                               plan)}["generation"]
  small = CostModel(dataclasses.replace(cost.hw, hbm_bytes=gen["total"] * 0.99 /
                                        cost.eff.memory_headroom))
  prompts, _ = wl.sample_lengths()
  state = gen["parts"]["training state kept"]  # (beside it in both)
  it.gen_plan(small, wl, 2, prompts, 16, state)  # the paper engines' cache fits
  with pytest.raises(ValueError, match="16 samples x 2048 tokens"):
    it.gen_plan(small, ps.trainer_workload(wl), 2, prompts, 16, state)


def test_simulated_activations_take_a_float32_runs_dtype():
  """A float32 run's activations are float32: the search (a train_config's shapes carry
  model.dtype, ModelShape.act_itemsize) and plan_check's analytic figure sized them at the 34*h
  bytes of 16-bit ones, half: 272 MiB against the 499 MiB the compiled float32 reference
  forward of this case allocates (temp_bytes; 544 MiB now). The papers' presets stay 16-bit."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim import shapes
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.lengths import LengthSpec
  c = plan_config.get_config("tiny")
  for m in ("actor", "critic"):
    c[m].update(hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                num_kv_heads=8, vocab_size=22, max_seq_len=2048, param_dtype="float32",
                dtype="float32")
  c.pp = c.critic_pp = 1
  c.tp, c.dp, c.fsdp, c.minibatch_size = 2, 4, 1, 32
  c.seq_len, c.response_len = 2048, 1536
  c.gen_tp, c.gen_slots, c.inference_microbatch = 2, 16, 16
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  a = shapes.from_model_config(cfg.actor, "actor", dtypes=True)
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=8, global_batch=64, minibatch=32,
                   max_new_tokens=1536, prompt=LengthSpec(kind="constant", value=4, max_len=512),
                   response=LengthSpec(kind="constant", value=8))
  plan = {"generation": {"mode": "instances", "tp": 2, "pp": 1, "groups": 1, "slots": 16},
          "inference": {"tp": 2, "pp": 1}}
  cost = CostModel(hardware.get_hardware("h100_sxm"))
  got = ps.inference_memory(cost, wl, it.SimOptions(trainer_runnable=True), plan)["activations"]
  assert got == pytest.approx(plan_programs.inference_analytic(cfg)["activations_bytes"])
  measured = plan_programs.instance_programs(cfg)["inference"]["temp_bytes"]
  assert 0.8 < got / measured < 1.25, (got / 2**20, measured / 2**20)
  bf16 = shapes.get_shape("llama-7b")  # a preset: 16-bit, the 34*h bytes as before
  assert cost.activation_bytes(bf16, 2, 100.0, 3) == 34.0 * bf16.hidden_size * 100 * 3 / 2
  assert cost.activation_bytes(dataclasses.replace(bf16, kv_itemsize=4), 2, 100.0, 3) == (
      2 * cost.activation_bytes(bf16, 2, 100.0, 3))


def test_simulated_weights_and_kv_cache_take_a_float32_runs_dtype(tmp_path):
  """A train_config's models at float32 (ppo_tiny's): the search sized the KV cache and the
  weights at bf16, half of plan_check's decode program's cache and parameters. The run's
  shapes (sim_plan.workload: from_model_config with dtypes) carry its dtypes, and the
  generation stage's memory is plan_check's; the papers' presets stay bf16."""
  from configs import ppo_tiny
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim import shapes
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.trainer import build, sim_plan
  from rlhfuse_jax.trainer.config import TrainConfig
  wl, plan, cfg = _small_case("instances")
  f32 = {m: getattr(cfg, m).replace(param_dtype="float32", dtype="float32")
         for m in ("actor", "critic")}
  cfg = dataclasses.replace(cfg, **f32)
  wl = dataclasses.replace(wl, actor=shapes.from_model_config(f32["actor"], "a", dtypes=True),
                           critic=shapes.from_model_config(f32["critic"], "c", dtypes=True))
  cost = CostModel(hardware.get_hardware("h100_sxm"))
  want = plan_programs.decode_analytic(cfg)
  got = {r["stage"]: r for r in ps.plan_memory(cost, wl, it.SimOptions(trainer_runnable=True),
                                               plan)}["generation"]["parts"]
  assert got["KV cache"] == pytest.approx(want["kv_cache_bytes"])
  assert got["weights"] == pytest.approx(want["params_bytes"])
  # float32 weights: their gradients float32 too, and no master copy beside Adam's m and v
  train = cost.train_memory_parts(wl.actor, 2, 1, 4, True, 1.0, 1)
  n = wl.actor.num_params() / 2
  assert (train["weights"], train["grads"], train["optimizer"]) == pytest.approx(
      (4 * n, 4 * n, 8 * n / 4))
  assert shapes.get_shape("llama-13b").kv_itemsize == 2  # the papers' presets: bf16
  c = ppo_tiny.get_config()
  run = TrainConfig.from_config_dict(c)
  task, tok = build.build_task_and_tokenizer(run)
  run = build.resolve_config(run, tok)
  wl = sim_plan.workload(run, task, tok, 8, str(tmp_path))[0]
  assert (run.model.param_dtype, run.model.dtype) == ("float32", "float32")
  assert (wl.actor.weight_itemsize, wl.actor.kv_itemsize, wl.critic.weight_itemsize) == (4, 4, 4)


def test_simulated_training_memory_counts_plan_checks_gradient_accumulator():
  """The unpipelined update over several micro-batches a data shard keeps float32 sums of both
  models' gradients (trainer/ppo._accumulated): plan_check's analytic figures count them, and so
  do the search's training check and plan_memory (they did not: 0.16 GiB a device short on the
  small case). Pipelined, or one micro-batch a shard, neither counts them."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim import training_sim as train_lib
  from rlhfuse_jax.sim.cost_model import CostModel
  wl, plan, cfg = _small_case("instances")
  cost = CostModel(hardware.get_hardware("h100_sxm"))
  opt = it.SimOptions(trainer_runnable=True)
  analytic = plan_programs.train_analytic(cfg, {})
  assert cfg.actor_microbatches == 8  # 32 rows over data 4, one at a time
  train = next(r for r in ps.plan_memory(cost, wl, opt, plan) if r["stage"] == "training")
  assert train["parts"]["grad accumulator"] == pytest.approx(
      analytic["grad_accumulator_bytes"], rel=1e-3)
  # (and the actor's update logits, the same figure in both)
  assert train["parts"]["logits"] == pytest.approx(analytic["logits_bytes"], rel=1e-3)
  # The search's check allows exactly plan_memory's total (accumulator included).
  tplan = train_lib.TrainPlan(8, 32, 2, 1, 1, 1)
  for scale, fits in ((1 + 1e-9, True), (1 - 1e-9, False)):
    c = CostModel(dataclasses.replace(cost.hw, hbm_bytes=train["total"] * scale /
                                      cost.eff.memory_headroom))
    if fits:
      train_lib.step_costs(c, wl.actor, wl.critic, tplan, 12.0, padded_len=wl.padded_len,
                           head_positions=wl.max_new_tokens)
    else:
      with pytest.raises(ValueError, match="does not fit in memory"):
        train_lib.step_costs(c, wl.actor, wl.critic, tplan, 12.0, padded_len=wl.padded_len,
                             head_positions=wl.max_new_tokens)
  # 8 rows a micro-batch: the whole shard at once, no sums; pipelined: not counted either.
  whole = dataclasses.replace(wl, micro_batch=8)
  rows = ps.plan_memory(cost, whole, opt, {**plan, "training": {**plan["training"],
                                                                "micro_batch": 8}})
  assert "grad accumulator" not in next(r for r in rows if r["stage"] == "training")["parts"]
  assert not train_lib.TrainPlan(8, 32, 2, 1, 1, 8).accumulates
  assert not train_lib.TrainPlan(8, 32, 2, 2, 1, 1).accumulates


def test_a_critic_free_runs_simulated_training_memory_is_plan_checks_actor_alone():
  """plan_search sizes a critic-free run's training as the actor's alone (Workload.
  trains_critic, since 2026-12-08) and plan_check now compiles it so (PlanConfig.
  trains_critic): the search's plan_memory training row and plan_check's analytic figures of
  the same unpipelined plan agree part by part, half the PPO pair's on the small case (both
  models one shape; plan_check counted the pair's 84.0 MB of weights before, the row 42.0 MB).
  The optimizer state is left out: the two count AdamW's moments apart for PPO too."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.sim.cost_model import CostModel
  wl, plan, cfg = _small_case("instances")
  cost = CostModel(hardware.get_hardware("h100_sxm"))
  opt = it.SimOptions(trainer_runnable=True)
  parts = {"weights": "params_bytes", "grads": "grads_bytes", "activations": "activations_bytes",
           "grad accumulator": "grad_accumulator_bytes", "logits": "logits_bytes"}
  free_plan = {**plan, "training": {k: v for k, v in plan["training"].items()
                                    if k != "critic_pp"}}
  rows = {}
  for trains_critic, p in ((True, plan), (False, free_plan)):
    w = dataclasses.replace(wl, trains_critic=trains_critic)
    analytic = plan_programs.train_analytic(
        dataclasses.replace(cfg, trains_critic=trains_critic), {})
    train = next(r for r in ps.plan_memory(cost, w, opt, p) if r["stage"] == "training")
    assert set(parts) <= set(train["parts"])
    for name, key in parts.items():
      assert train["parts"][name] == pytest.approx(analytic[key], rel=1e-6), (name,
                                                                              trains_critic)
    rows[trains_critic] = train["parts"]
  assert rows[False]["weights"] == pytest.approx(rows[True]["weights"] / 2, rel=1e-3)


def test_simulated_optimizer_state_takes_the_runs_master_weights(tmp_path):
  """AdamW's state as the trainer holds it (rl/optim.float32_master with optim.master_weights;
  optax's moments in the weights' dtype without): the simulator counted the papers' float32
  moments and master copy (12 bytes a bf16 parameter) for a bf16 run without master weights,
  which holds 4 (plan_check's analytic figure: the optimizer's own init, eval_shape'd)."""
  import jax.numpy as jnp
  from configs import ppo_tiny
  from rlhfuse_jax.sim import shapes
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.trainer import build, sim_plan
  from rlhfuse_jax.trainer import plan_file as plan_file_lib
  from rlhfuse_jax.trainer.config import TrainConfig
  cost = CostModel(hardware.get_hardware("h100_sxm"))
  base = shapes.get_shape("llama-7b")
  n = base.num_params() / 2
  for item, master, per_param in ((2, None, 12), (2, True, 12), (2, False, 4), (4, None, 8),
                                  (4, True, 12), (4, False, 8)):
    shape = dataclasses.replace(base, weight_itemsize=item, master_weights=master)
    got = cost.train_memory_parts(shape, 2, 1, 4, False, 1.0, 1)["optimizer"]
    assert got == pytest.approx(per_param * n), (item, master)
  # What the trainer's optimizer holds for bf16 weights, both ways (eval_shape: no arrays).
  params = {"w": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)}
  for master in (False, True):
    tx = plan_programs.make_optimizer(staged=False, master_weights=master)
    state = jax.eval_shape(tx.init, params)
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.ndim)
    want = dataclasses.replace(base, master_weights=master).optimizer_bytes_per_param()
    assert held == want * 64 * 32, (master, held)
  run = TrainConfig.from_config_dict(ppo_tiny.get_config())
  task, tok = build.build_task_and_tokenizer(run)
  for master in (False, True):
    cfg = build.resolve_config(dataclasses.replace(run, optim=dataclasses.replace(
        run.optim, master_weights=master)), tok)
    wl = sim_plan.workload(cfg, task, tok, 8, str(tmp_path / str(master)))[0]
    assert (wl.actor.master_weights, wl.critic.master_weights) == (master, master)
    from rlhfuse_jax.sim import plan_search as ps
    record = ps.workload_record(wl, "configs/ppo_tiny.py")
    assert record["master_weights"] is master
    # A plan searched for the other setting is warned of, naming the field.
    other = dict(record, master_weights=not master)
    assert plan_file_lib.plan_workload_differences({"workload": other}, cfg) == [
        f"master_weights={not master!r} (this run's optim.master_weights is {master!r})"]


def test_a_run_with_a_reward_model_is_checked_with_its_forward(tmp_path):
  """A run with reward.kind='model' scores with its reward model on the instances, beside the
  reference; plan_check compiled no forward of it, so a reward model larger than the actor
  (a 13B actor with a 33B reward model) went unchecked where it can be the instance's largest
  program. apply_run takes the checkpoint's architecture (config.reward_model), and the
  `reward` program is its scalar forward on the instance's devices and micro-batch: its weights
  are its arguments, it fits beside the training state or the verdict names it; a plan
  without a reward model compiles no such program."""
  from configs import ppo_tiny
  from tests.test_trainer_paths import write_reward_checkpoint
  reward_cfg = llama.ModelConfig(vocab_size=22, hidden_size=64, intermediate_size=128,
                                 num_layers=3, num_heads=4, num_kv_heads=2, max_seq_len=64,
                                 head="scalar")
  write_reward_checkpoint(tmp_path / "rm", reward_cfg)
  run = ppo_tiny.get_config()
  run.reward.kind, run.reward.model_checkpoint = "model", str(tmp_path / "rm")
  c = plan_config.get_config("tiny")
  assert c.reward_model == ""  # the presets' default: a reward function
  plan_config.apply_run(c, run)
  assert (c.reward_model.hidden_size, c.reward_model.num_layers) == (64, 3)
  cfg = dataclasses.replace(plan_programs.PlanConfig.from_config_dict(c),
                            cpu_upcast="as_compiled")
  assert cfg.reward.head == "scalar" and cfg.reward_layers == 3
  programs = plan_programs.instance_programs(cfg)
  assert set(programs) == {"decode", "prefill", "inference", "reward"}
  reward, inference = programs["reward"], programs["inference"]
  weights = plan_programs._nbytes(llama.param_shapes(cfg.reward)) / cfg.gen_model_shards
  assert reward["analytic"]["params_bytes"] == weights
  # Its arguments: its weights as the instance places them (this device's share) and the
  # micro-batch's tokens and lengths.
  inst = plan_programs.make_instance(cfg)
  shapes = llama.param_shapes(cfg.reward)
  placed = plan_programs._device_bytes(
      mesh_lib.abstract(shapes, inst.param_shardings(cfg.reward, shapes)))
  rows = inst.micro_batch  # (ppo_tiny generates on the training mesh: its whole batch)
  assert reward["argument_bytes"] == placed + rows * cfg.seq_len * 4 + 2 * rows * 4
  assert reward["argument_bytes"] > inference["argument_bytes"]  # larger than the reference
  # The head reads one position per row: the analytic FLOPs are the backbone's and that.
  assert reward["analytic"]["flops_per_device"] == pytest.approx(
      plan_programs.accounting.forward_flops(cfg.reward, rows, cfg.seq_len, 1) / cfg.gen_devices)
  assert 0.9 < reward["replication"] < 1.5
  # Beside the training state, as decode and inference (beside_train_state's other cases:
  # test_what_stays_beside_each_program_follows_where_the_run_scores); the verdict names a
  # reward program that does not fit with its micro-batch knob.
  programs["train_step"] = {"argument_bytes": 1000, "optimizer_state_bytes": 0, "fits": True,
                            "peak_bytes": 1000, "hbm_bytes": 0}
  plan_programs.beside_train_state(programs, 1e12, offload_optimizer=False, generation="mesh")
  # The serial stage keeps the reference on the mesh beside the reward model's forward.
  assert reward["resident_model_bytes"] == programs["decode"]["analytic"]["params_bytes"]
  assert reward["peak_with_train_state_bytes"] == (reward["peak_bytes"] + 1000 +
                                                   reward["resident_model_bytes"])
  hbm = reward["peak_with_train_state_bytes"] - 1
  for p in programs.values():
    p["hbm_bytes"], p["fits"] = hbm, True
  reward["fits"] = False
  line = plan_programs.verdict({"programs": programs, "plan": {}})
  assert line.startswith("verdict: DOES NOT FIT: reward (peak ") and (
      "inference_microbatch" in line), line
  result = {"programs": programs}
  assert plan_programs.program_names(result) == ["train_step", "decode", "inference",
                                                 "prefill", "reward"]
  del programs["reward"]
  assert plan_programs.program_names(result) == ["train_step", "decode", "inference",
                                                 "prefill"]
  # A plan without one: no reward program.
  c.reward_model = ml_collections.ConfigDict()
  assert plan_programs.PlanConfig.from_config_dict(c).reward is None
  with pytest.raises(ValueError, match=r"config\.reward_model=3: expected '' \(no reward "
                                       r"model\), one of \['7b'"):
    plan_programs.PlanConfig.from_config_dict(dict(c.to_dict(), reward_model=3))


def test_what_stays_beside_each_program_follows_where_the_run_scores():
  """beside_train_state on hand-made figures (per device: the actor and so the reference 30,
  the reward model 20, the critic 10; training state 100): what each program has beside it
  where the run scores. The serial stage keeps the reference and the reward model on the
  training mesh for the whole run, the train step included (decode's own figures count the
  actor twice, standing for the reference); instances load every scoring model at once when
  freed (the critic's copy too) and nothing while they decode; an asynchronous generation
  group keeps them all whole beside each other."""
  def programs(reward=True):
    out = {"train_step": {"argument_bytes": 100, "optimizer_state_bytes": 40, "peak_bytes": 150,
                          "fits": True},
           "decode": {"peak_bytes": 50, "fits": True, "analytic": {"params_bytes": 30}},
           "inference": {"peak_bytes": 40, "fits": True, "analytic": {"params_bytes": 30}}}
    if reward:
      out["reward"] = {"peak_bytes": 35, "fits": True, "analytic": {"params_bytes": 20}}
    return out

  def beside(**kw):
    p = programs(kw.pop("reward", True))
    plan_programs.beside_train_state(p, 1000, False, **kw)
    return {k: v.get("resident_model_bytes") for k, v in p.items()}, p

  got, p = beside(generation="mesh")
  assert got == {"train_step": 50, "decode": 20, "inference": 20, "reward": 30}
  assert p["train_step"]["peak_with_train_state_bytes"] == 200
  assert p["reward"]["peak_with_train_state_bytes"] == 35 + 100 + 30
  # Pipelined, decode's actor is a gathered copy beside the state's stage shards: the
  # reference does not hide in it.
  got, _ = beside(generation="mesh", pipelined=True)
  assert got == {"train_step": 50, "decode": 50, "inference": 20, "reward": 30}
  got, _ = beside(generation="mesh", reference=False)  # the critic's forward, no reference
  assert got == {"train_step": 20, "decode": 20, "inference": 20, "reward": 0}
  got, _ = beside(generation="mesh", reward=False)  # as before the reward program
  assert got == {"train_step": 30, "decode": 0, "inference": 0}
  got, p = beside(critic_copy_bytes=10)  # instances
  assert got == {"train_step": None, "decode": 0, "inference": 30, "reward": 40}
  assert "peak_with_train_state_bytes" not in p["train_step"]
  got, _ = beside(critic_copy_bytes=10, reference=False)
  assert got == {"train_step": None, "decode": 0, "inference": 20, "reward": 10}
  got, p = beside(generation_group=True, group_critic_bytes=10)
  assert got == {"train_step": None, "decode": 60, "inference": 60, "reward": 70}
  assert p["reward"]["resident_train_bytes"] == 0
  got, _ = beside(generation_group=True, reference=False)
  assert got == {"train_step": None, "decode": 20, "inference": 50, "reward": 30}
  # A freed instance of the group scoring values loads its own copy of the critic (5 here)
  # beside the whole one: beside the scoring programs, not decode; the critic's own forward
  # (no reference) has the whole one beside its copy.
  got, _ = beside(generation_group=True, group_critic_bytes=10, critic_copy_bytes=5)
  assert got == {"train_step": None, "decode": 60, "inference": 65, "reward": 75}
  got, _ = beside(generation_group=True, group_critic_bytes=10, critic_copy_bytes=5,
                  reference=False)
  assert got == {"train_step": None, "decode": 30, "inference": 60, "reward": 45}
  # The train step fits only with the frozen models beside it, and the verdict says so.
  p = programs()
  plan_programs.beside_train_state(p, 180, False, generation="mesh")
  assert (p["train_step"]["fits"], p["train_step"]["fits_alone"]) == (False, True)
  for v in p.values():
    v.update(hbm_bytes=180, temp_bytes=10, argument_bytes=v.get("argument_bytes", 10))
  for name in ("decode", "inference", "reward"):
    p[name]["fits"] = True
  line = plan_programs.verdict({"programs": p, "plan": {}})
  assert line.startswith("verdict: DOES NOT FIT: train_step (peak 2.00e-07 of 1.80e-07 GB with "
                         "the models; largest: arguments"), line


def test_inference_on_pipelines_of_instances_compiles_each_stage():
  """inference_pp = 2 (a run's fusion.inference_pp or plan.inference_pp): every stage's scoring
  program is compiled and the heaviest reported; its arguments are its stage's weights (half
  the layers, the embedding or the head), well below the whole model's, and its analytic
  figures are the stage's. The run's field reaches plan_check; bad values name the field."""
  c = plan_config.get_config("tiny")
  c.inference_pp = 2
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  out = plan_programs.instance_programs(cfg)
  p = out["inference"]
  assert p["stages"] == 2 and len(p["stage_peak_bytes"]) == 2
  assert p["peak_bytes"] == max(p["stage_peak_bytes"]) and p["stage"] in (0, 1)
  from rlhfuse_jax.inference import stages as inf_stages
  shapes = llama.param_shapes(cfg.actor)
  stage = inf_stages.stage_nbytes(cfg.actor, shapes, 2, p["stage"]) / cfg.gen_tp
  whole = plan_programs._nbytes(shapes) / cfg.gen_tp
  assert p["analytic"]["params_bytes"] == stage < 0.75 * whole
  assert stage <= p["argument_bytes"] < stage + 0.1 * whole  # its weights and a micro-batch
  assert 0.9 < p["replication"] < 1.1
  for field, value, match in (
      ("inference_pp", 3, r"config\.inference_pp=3: expected a divisor of the 4 layers compiled "
                          r"of the actor"),
      ("inference_pp", 4, r"config\.inference_pp=4: expected a divisor of the 2 layers compiled "
                          r"of the critic"),
      ("inference_pp", 0, r"config\.inference_pp=0: expected an integer >= 1")):
    bad = plan_config.get_config("tiny")
    bad[field] = value
    with pytest.raises(ValueError, match=match):
      plan_programs.PlanConfig.from_config_dict(bad)
  bad = _tiny_mesh_generation()
  bad.inference_pp = 2
  with pytest.raises(ValueError, match=r"config\.inference_pp=2: expected 1 with "
                                       r"generation='mesh'"):
    plan_programs.PlanConfig.from_config_dict(bad)


def test_a_runs_inference_pipelines_reach_plan_check(monkeypatch, tmp_path):
  """run/<file>: a training config's fusion.inference_pp is plan_check's inference_pp."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  monkeypatch.chdir(repo)
  path = tmp_path / "piped.py"
  path.write_text("from configs import ppo_tiny\n\n\ndef get_config():\n"
                  "  c = ppo_tiny.get_config('fused')\n  c.fusion.inference_pp = 2\n  return c\n")
  plan = plan_config.get_config(f"run/{path}")
  assert plan.inference_pp == 2 and plan.generation == "instances"
  assert plan_config.get_config("run/configs/ppo_tiny.py:fused").inference_pp == 1


def test_a_generation_groups_instances_keep_the_critic_whole(tmp_path, monkeypatch):
  """An asynchronous PPO generation group (generation_devices) of instances that also scores
  values (group_critic) keeps the critic whole on its mesh, also when its instances score on
  pipelines (inference_pp 2: a stage of the critic is what a freed instance of the training
  devices would load). A group's instances had no row for their migration (a KeyError)."""
  c = plan_config.get_config("tiny")
  c.pp = c.critic_pp = 1
  c.generation_devices, c.group_critic, c.inference_pp = 2, True, 2
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  seen = {}
  real = plan_programs.beside_train_state

  def spy(programs, hbm, offload, group, group_critic_bytes=0.0, *args, **kw):
    seen.update(group=group, critic=group_critic_bytes, copy=kw.get("critic_copy_bytes"))
    return real(programs, hbm, offload, group, group_critic_bytes, *args, **kw)
  monkeypatch.setattr(plan_programs, "beside_train_state", spy)
  result = plan_programs.run(cfg, str(tmp_path))
  whole = plan_programs._nbytes(llama.param_shapes(cfg.critic))
  # the freed instance's stage of the critic (group_instance_critic_bytes: split, not the
  # group's buffers)
  from rlhfuse_jax.inference import stages as inf_stages
  stage = max(inf_stages.stage_nbytes(cfg.critic, llama.param_shapes(cfg.critic), 2, s)
              for s in range(2)) / cfg.gen_model_shards
  assert seen == {"group": True, "critic": whole, "copy": stage}
  programs = result["programs"]
  assert programs["migrate"]["resident_model_bytes"] > 0
  inference = programs["inference"]
  # beside the reference's stage: the actor and the critic, whole on the group (until
  # 2026-12-07 both over gen_tp: the instance's share, not the group's copies), and the
  # instance's own stage of the critic (until 2026-12-07 not counted)
  actor = plan_programs._nbytes(llama.param_shapes(cfg.actor))
  assert cfg.gen_model_shards > 1 and whole == plan_programs.group_critic_bytes(cfg)
  assert inference["resident_model_bytes"] == pytest.approx(actor + whole + stage)


def _tiny_bfloat16_mesh():
  """_tiny_mesh_generation with bfloat16 models: algo.old_logp "auto" recomputes there."""
  c = _tiny_mesh_generation()
  for m in (c.actor, c.critic):
    m.dtype = m.param_dtype = "bfloat16"
  return c


def _zero_piece(mesh, rows: int, seq_len: int) -> tuple:
  """(tokens, lens) of `rows` zero rows placed as the trainer's scorer places a piece."""
  return tuple(mesh_lib.put(np.zeros(shape, np.int32), mesh_lib.batch_sharding(mesh, len(shape)))
               for shape in ((rows, seq_len), (rows,)))


def _beside_smaller_hbm(result: dict, hbm: int) -> dict:
  """result's programs, each fit judged again beside the training state on an HBM of `hbm`."""
  programs = {k: dict(v) for k, v in result["programs"].items()}
  for q in programs.values():
    q["hbm_bytes"] = hbm
  plan_programs.beside_train_state(programs, hbm, False, reference=True, generation="mesh")
  return programs


def test_the_old_logp_recomputation_is_compiled_beside_the_training_state(tmp_path):
  """algo.old_logp "auto" with a 16-bit actor and an unpipelined update: the trainer runs the
  actor's forward over the rollout on the training devices before the update, in the update's
  micro-batches (trainer/loop.py _recompute_logp), a program plan_check did not compile. It is
  `actor_logp` now: the trainer's Scorer and jitted forward (the same lowering as from the
  trainer's placed arrays), 1 row a data shard (4 a piece), beside the training state less the
  actor its arguments hold and, on the serial stage, the reference kept on the mesh; in the
  table, and its fit in the verdict (plan_check's exit status reads every program's fit)."""
  cfg = plan_programs.PlanConfig.from_config_dict(_tiny_bfloat16_mesh())
  assert cfg.actor_logp_pass == "recompute"
  result = plan_programs.run_and_write(cfg, str(tmp_path))
  with open(os.path.join(tmp_path, "result.json")) as f:
    p = json.load(f)["programs"]["actor_logp"]
  train = result["programs"]["train_step"]
  assert (p["pass"], p["rows"], p["mesh"]) == ("recompute", 4, "training")
  mesh = plan_programs.train_mesh(cfg)
  own = plan_programs._device_bytes(plan_programs.abstract_params(cfg.actor, mesh))
  assert p["state_actor_bytes"] == own > 0 and p["argument_bytes"] >= own
  assert p["resident_train_bytes"] == train["argument_bytes"] - own
  reference = result["programs"]["inference"]["analytic"]["params_bytes"]
  assert p["resident_model_bytes"] == reference > 0
  assert p["peak_with_train_state_bytes"] == (p["peak_bytes"] + p["resident_train_bytes"] +
                                              reference)
  assert p["peak_bytes"] == (p["argument_bytes"] + p["output_bytes"] + p["temp_bytes"] -
                             p["alias_bytes"])
  assert p["fits"] is True and p["flops_per_device"] > 0 and p["replication"] < 1.1
  assert p["cpu_upcast"]["mode"] == "per_layer"  # 16-bit: compiled like the instance's
  assert result["plan"]["actor_logp_pass"] == "recompute"
  assert plan_programs.program_names(result)[-1] == "actor_logp"
  lines = plan_programs.table(result)
  assert sum(line.startswith("actor_logp ") for line in lines) == 2  # memory and time rows
  # The lowering is the trainer's: Scorer.logprobs on a piece of 4 rows placed as _run places
  # them, the actor's parameters placed as the trainer places them.
  scorer = scoring.Scorer(mesh, micro_batch_size=4)
  real = mesh_lib.shard_params(llama.host_random_params(cfg.actor, 0),
                               llama.logical_specs(cfg.actor), mesh)
  tokens, lens = _zero_piece(mesh, 4, cfg.seq_len)
  assert (scorer.lower_logprobs(cfg.actor, plan_programs.abstract_params(cfg.actor, mesh), 8,
                                cfg.seq_len, cfg.response_len).as_text() ==
          scoring.response_logprobs.lower(cfg.actor, real, tokens, lens, cfg.response_len, 1.0,
                                          mesh=mesh).as_text())
  # Beside a smaller HBM it is the program that does not fit, and the verdict names its knobs.
  programs = _beside_smaller_hbm(result, p["peak_with_train_state_bytes"] - 1)
  assert programs["actor_logp"]["fits"] is False
  line = plan_programs.verdict({**result, "programs": programs})
  assert "actor_logp (peak" in line, line
  part = line[line.index("actor_logp (peak"):]
  # The state beside it is its largest term here; the optimizer state is back on the devices
  # when the pass runs (offloading it during the rollout does not help).
  assert "largest: the training state beside it: zero1" in part, part
  assert "offload_optimizer" not in part, part
  programs["actor_logp"]["temp_bytes"] = 1e12
  part = plan_programs.verdict({**result, "programs": programs}).split("actor_logp (peak")[1]
  assert ("largest: temporaries: smaller micro-batches (microbatch_size: a run's "
          "algo.microbatch_size), no recomputation (a run's algo.old_logp='generation')") in part


def test_the_runs_old_logp_and_staleness_decide_the_actor_logp_program(tmp_path):
  """As the trainer resolves them (AlgoConfig.recomputes_old_logp, logprob_rows): no pass for
  a float32 actor on "auto", or on "generation"; the recomputation for "recompute" or a 16-bit
  "auto"; async PPO's proximal pass (staleness > 0, whatever the objective: the lag's metrics
  need it) a mini-batch a piece. A pipelined update's pass reads Update.whole's gathered copy
  (no part of the state), on the rollout's folded mesh where the serial rollout runs."""
  from configs import ppo_tiny
  from rlhfuse_jax.trainer.config import TrainConfig
  for changes, want in (({}, ""), ({"algo.old_logp": "recompute"}, "recompute"),
                        ({"model.dtype": "bfloat16"}, "recompute"),
                        ({"model.dtype": "bfloat16", "algo.old_logp": "generation"}, ""),
                        ({"async_ppo.staleness": 1}, "proximal"),
                        ({"async_ppo.staleness": 1, "async_ppo.objective": "decoupled"},
                         "proximal")):
    run = ppo_tiny.get_config()
    for field, value in changes.items():
      section, name = field.split(".")
      run[section][name] = value
    c = plan_config.get_config("tiny")
    plan_config.apply_run(c, run)
    cfg = plan_programs.PlanConfig.from_config_dict(c)
    assert cfg.actor_logp_pass == want, changes
    t = TrainConfig.from_config_dict(run)
    assert t.algo.recomputes_old_logp(t.async_ppo.staleness, t.mesh.stage > 1,
                                      t.model) == (want == "recompute"), changes
  with pytest.raises(ValueError, match=r"config\.old_logp='recompute'.*staleness > 0"):
    plan_programs.PlanConfig.from_config_dict({**plan_config.get_config("tiny").to_dict(),
                                               "old_logp": "recompute", "staleness": 1})
  with pytest.raises(ValueError, match=r"config\.old_logp='training'"):
    plan_programs.PlanConfig.from_config_dict({**plan_config.get_config("tiny").to_dict(),
                                               "old_logp": "training"})
  # Pipelined (tiny: 2 stages x data 2 x fsdp 2): "auto" leaves it the decode's; "recompute"
  # scores mini-batches on a gathered copy, on the instances' training mesh or folded.
  c = plan_config.get_config("tiny")
  assert plan_programs.PlanConfig.from_config_dict(c).actor_logp_pass == ""
  c.old_logp = "recompute"
  for generation, mesh_kind, shards in (("instances", "training", 4), ("mesh", "folded", 8)):
    c.generation, c.gen_slots = generation, 8
    cfg = plan_programs.PlanConfig.from_config_dict(c)
    p = plan_programs.actor_logp_program(cfg, plan_programs.train_mesh(cfg))["actor_logp"]
    assert (p["rows"], p["mesh"], p["pieces_split_over"]) == (8, mesh_kind, shards)
    assert p["state_actor_bytes"] == 0 and p["argument_bytes"] > 0
  c.old_logp = "generation"
  assert plan_programs.actor_logp_program(
      plan_programs.PlanConfig.from_config_dict(c), None) == {}


def test_async_ppos_current_critic_values_are_compiled_beside_the_training_state(
    async_mesh_plan):
  """Asynchronous PPO (staleness > 0) scores each batch generated earlier again with the
  current critic on the training devices, every iteration, beside the whole training state
  (trainer/loop.py _current_values), a program plan_check did not compile. It is
  `critic_values` now: the trainer's Scorer and jitted critic_values (the same lowering as from
  the trainer's placed arrays), a mini-batch a piece, beside the training state less the critic
  its arguments hold and, on the serial stage, the reference kept on the mesh; in result.json,
  the table (its name in the column's width) and the verdict (the exit status reads every
  program's fit)."""
  cfg, result, programs = copy_lib.deepcopy(async_mesh_plan)
  assert cfg.critic_values_pass
  p = programs["critic_values"]
  train = result["programs"]["train_step"]
  assert (p["rows"], p["mesh"], p["pieces_split_over"]) == (8, "training", 4)
  mesh = plan_programs.train_mesh(cfg)
  own = plan_programs._device_bytes(plan_programs.abstract_params(cfg.critic, mesh))
  assert p["state_critic_bytes"] == own > 0
  # Plausible: its arguments are the critic's quarter (fsdp 2 x tensor 2) and a piece's tokens
  whole = plan_programs._nbytes(llama.param_shapes(cfg.critic))
  assert p["analytic"]["params_bytes"] == whole / 4 and p["analytic"]["logits_bytes"] == 0
  assert own == pytest.approx(whole / 4, rel=0.02)
  assert p["argument_bytes"] == own + (8 // 4) * (cfg.seq_len + 1) * 4
  assert p["resident_train_bytes"] == train["argument_bytes"] - own
  reference = result["programs"]["inference"]["analytic"]["params_bytes"]
  assert p["resident_model_bytes"] == reference > 0
  assert p["peak_with_train_state_bytes"] == (p["peak_bytes"] + p["resident_train_bytes"] +
                                              reference)
  assert p["fits"] is True and p["flops_per_device"] > 0 and p["replication"] < 1.1
  assert plan_programs.program_names(result)[-2:] == ["actor_logp", "critic_values"]
  lines = plan_programs.table(result)
  assert sum(line.startswith("critic_values ") for line in lines) == 2  # memory and time rows
  k = len(plan_programs.program_names(result))
  assert len({len(line) for line in lines[:1 + k]}) == 1, lines[:1 + k]
  # The lowering is the trainer's: Scorer.values on a piece of 8 rows placed as _run places
  # them, the critic's parameters placed as the trainer places them.
  scorer = scoring.Scorer(mesh, micro_batch_size=8)
  real = mesh_lib.shard_params(llama.host_random_params(cfg.critic, 0),
                               llama.logical_specs(cfg.critic), mesh)
  tokens, lens = _zero_piece(mesh, 8, cfg.seq_len)
  assert (scorer.lower_values(cfg.critic, plan_programs.abstract_params(cfg.critic, mesh), 16,
                              cfg.seq_len, cfg.response_len).as_text() ==
          scoring.critic_values.lower(cfg.critic, real, tokens, lens, cfg.response_len,
                                      mesh=mesh).as_text())
  # Beside a smaller HBM it does not fit, and the verdict names its knobs (the optimizer state
  # is back on the devices when it runs: no offload).
  programs = _beside_smaller_hbm(result, p["peak_with_train_state_bytes"] - 1)
  assert programs["critic_values"]["fits"] is False
  part = plan_programs.verdict({**result, "programs": programs}).split("critic_values (peak")[1]
  assert "largest: the training state beside it: zero1" in part, part
  assert "offload_optimizer" not in part, part
  programs["critic_values"]["temp_bytes"] = 1e12
  part = plan_programs.verdict({**result, "programs": programs}).split("critic_values (peak")[1]
  assert ("largest: temporaries: a smaller mini-batch (minibatch_size: a run's "
          "algo.minibatch_size)") in part, part


def test_a_runs_staleness_decides_the_critic_values_program():
  """Only asynchronous PPO scores values on the training devices; --run_config's staleness is
  the run's. Pipelined, the pass reads Update.whole's gathered critic (no part of the state),
  on the rollout's folded mesh where the serial rollout runs."""
  from configs import ppo_tiny
  for staleness in (0, 1):
    run = ppo_tiny.get_config()
    run.async_ppo.staleness = staleness
    c = plan_config.get_config("tiny")
    plan_config.apply_run(c, run)
    assert plan_programs.PlanConfig.from_config_dict(c).critic_values_pass == bool(staleness)
  c = plan_config.get_config("tiny")  # 2 stages x data 2 x fsdp 2
  assert plan_programs.critic_values_program(
      plan_programs.PlanConfig.from_config_dict(c), None) == {}
  c.staleness = 1
  for generation, mesh_kind, shards in (("instances", "training", 4), ("mesh", "folded", 8)):
    c.generation, c.gen_slots = generation, 8
    cfg = plan_programs.PlanConfig.from_config_dict(c)
    p = plan_programs.critic_values_program(cfg, plan_programs.train_mesh(cfg))["critic_values"]
    assert (p["rows"], p["mesh"], p["pieces_split_over"]) == (8, mesh_kind, shards)
    assert p["state_critic_bytes"] == 0 and p["argument_bytes"] > 0


def test_a_generation_group_is_proposed_for_the_actors_copy_only_on_the_training_devices():
  """The verdict's remedies where the actor's copy (asynchronous PPO on the training devices)
  is the largest term: a generation group takes it off the training devices (the train step,
  the hand-over), but beside decode and the scoring programs a group keeps the actor whole on
  every device (group_actor_bytes), fsdp x tensor times the copy: not proposed there (it was,
  until 2026-12-07). The other remedies stay."""
  result = _scaled_result(1.0)
  result["plan"]["staleness"] = 1
  for name in ("train_step", "decode", "inference"):
    result["programs"][name].update(fits=False, actor_copy_bytes=90e9)
  line = plan_programs.verdict(result)
  parts = re.split(r"(?:: |; )(train_step|decode|inference) \(peak ", line)[1:]
  hints = dict(zip(parts[::2], parts[1::2]))
  assert set(hints) == {"train_step", "decode", "inference"}, line
  for name, hint in hints.items():
    assert "largest: the actor's copy beside it: " in hint, (name, hint)
    assert ("a generation group" in hint) is (name == "train_step"), (name, hint)
    assert "fsdp or more tensor devices" in hint and "staleness 0" in hint, (name, hint)


def test_a_synchronous_pipeline_keeps_the_frozen_models_beside_the_update(tmp_path):
  """plan.generation='pipeline' on the training devices (no generation group, no async PPO):
  the trainer's PlannedStage places the reference once on its data=4 x tensor=2 inference
  mesh of all 8 training devices and keeps it there for the whole run, the update included
  (measured here from the trainer's arrays). plan_search's plan_memory counted it on a
  generation group only: the synchronous plan's generation and training were checked with
  sim.offload_frozen's host memory, which this stage never uses, and the search could hand the
  trainer a plan whose update does not fit beside them."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.trainer.config import TrainConfig
  from rlhfuse_jax.trainer.loop import PPOTrainer
  run = _async_run(**{"async_ppo.staleness": 0, "plan.generation": "pipeline",
                      "plan.generation_pp": 2, "plan.inference_tp": 2})
  run.model.num_layers = run.critic_model.num_layers = 2
  trainer = PPOTrainer(TrainConfig.from_config_dict(run), str(tmp_path))
  held = _reference_bytes_by_device(trainer)
  assert set(held) == set(trainer.mesh.devices.flat) and len(set(held.values())) == 1
  cfg = TrainConfig.from_config_dict(run)
  wl = _tiny_workload(cfg)
  plan = {"generation": {"mode": "pipeline", "tp": 1, "pp": 2, "groups": 2, "slots": 16},
          "inference": {"tp": 2, "pp": 1},
          "training": {"placement": "colocated", "devices": 8, "tp": 1, "actor_pp": 1,
                       "critic_pp": 1}}
  cost = ps.CostModel(hardware.get_hardware("h100_sxm"))
  opt = it.SimOptions(trainer_runnable=True)
  assert opt.offload_frozen
  rows = {r["stage"]: r for r in ps.plan_memory(cost, wl, opt, plan)}
  for stage in ("generation", "training"):
    assert rows[stage]["parts"]["frozen weights kept"] == pytest.approx(max(held.values()),
                                                                        rel=0.05), stage
  # The search refuses the plan where the update fits only without them, and says why.
  train = rows["training"]
  frozen = train["parts"]["frozen weights kept"]
  small = ps.CostModel(dataclasses.replace(
      cost.hw, hbm_bytes=(train["total"] - frozen / 2) / cost.eff.memory_headroom))
  why = ps._memory_refusal(small, wl, opt, plan)
  assert why is not None and why.startswith("training colocated tp1 Pa/Pc=1/1 does not fit in "
                                            "memory beside the frozen models"), why
  # (instances: the fused stage keeps them in host memory)
  inst = {**plan, "generation": {"mode": "instances", "tp": 1, "slots": 2}}
  assert "frozen weights kept" not in ps.plan_memory(cost, wl, opt, inst)[2]["parts"]


@pytest.mark.parametrize("tensor", [1, 2])
def test_a_synchronous_pipelines_stages_hold_the_embedding_and_head_whole(tmp_path, tensor):
  """plan.generation='pipeline' on the training devices: PipelinedGenerator.place gives every
  stage the embedding and LM head whole beside its L/pp layers (measured here from the
  trainer's buffers). From an actor replicated over the training mesh they are its own buffers;
  from one split over tensor 2, new ones on each stage. plan_memory's generation row spread
  them over pp (both ways): (1 - 1/pp) of them under-counted on a split actor's stages."""
  from rlhfuse_jax.sim import iteration_sim as it
  from rlhfuse_jax.sim import plan_search as ps
  from rlhfuse_jax.trainer.config import TrainConfig
  from rlhfuse_jax.trainer.loop import PPOTrainer
  run = _async_run(**{"async_ppo.staleness": 0, "plan.generation": "pipeline",
                      "plan.generation_pp": 2, "mesh.tensor": tensor})
  run.model.num_layers = run.critic_model.num_layers = 2
  trainer = PPOTrainer(TrainConfig.from_config_dict(run), str(tmp_path))
  snapshot = trainer._snapshot()("actor")
  own = {(s.device, s.data.unsafe_buffer_pointer()) for x in jax.tree.leaves(snapshot)
         for s in x.addressable_shards}
  staged = trainer.rollout.pipe.place(snapshot)
  new, whole = {}, {}  # {device: bytes}: the stage's new buffers; its whole tree
  for x in jax.tree.leaves(staged):
    for s in x.addressable_shards:
      whole[s.device] = whole.get(s.device, 0) + s.data.nbytes
      if (s.device, s.data.unsafe_buffer_pointer()) not in own:
        new[s.device] = new.get(s.device, 0) + s.data.nbytes
  ends = sum(x.nbytes for part in ("embed", "head") for x in jax.tree.leaves(snapshot[part]))
  layers = sum(x.nbytes for x in jax.tree.leaves(staged["layers"]))  # (global: all stages)
  assert set(whole.values()) == {layers // 2 + ends}  # each stage: its layers and both ends
  plan = {"generation": {"mode": "pipeline", "tp": 1, "pp": 2, "groups": 2, "slots": 16},
          "inference": {"tp": 1, "pp": 1},
          "training": {"placement": "colocated", "devices": 8, "tp": tensor, "actor_pp": 1,
                       "critic_pp": 1}}
  gen = ps.plan_memory(ps.CostModel(hardware.get_hardware("h100_sxm")),
                       _tiny_workload(trainer.cfg),  # (resolved: the tokenizer's vocabulary)
                       it.SimOptions(trainer_runnable=True), plan)[0]
  assert len(set(new.values())) == 1
  # (the final norm, 256 bytes, counts with the layers there and with the head here)
  assert gen["parts"]["weights"] == pytest.approx(new.popitem()[1], rel=2e-3)


@pytest.mark.parametrize("gen_tp", [1, 2])
def test_a_groups_freed_instance_loads_its_own_critic_beside_the_whole_one(gen_tp):
  """async_ppo.staleness 0 with a generation group of instances: the group holds the critic
  whole (replicated over its data-only mesh), and a freed instance loads it for the values
  (GenerationInstance.place: mesh_lib.put onto the instance's param shardings). Measured from
  the arrays: at gen_tp 1 the instance gets the group's own buffers (nothing new); at gen_tp 2
  each device gets new buffers of its share beside the whole critic, as
  plan_programs.group_instance_critic_bytes counts (it was 0 for every gen_tp)."""
  c = plan_config.get_config("tiny")
  c.pp = c.critic_pp = 1
  c.gen_tp, c.generation_devices, c.group_critic = gen_tp, 4, True
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  params = llama.init_params(cfg.critic, jax.random.PRNGKey(0))[0]
  group = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4), jax.devices()[:4])
  whole = mesh_lib.shard_params(params, llama.logical_specs(cfg.critic), group)
  mine = {}
  for x in jax.tree.leaves(whole):
    for shard in x.addressable_shards:
      mine.setdefault(shard.device, set()).add(shard.data.unsafe_buffer_pointer())
  instance = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, tensor=gen_tp),
                                jax.devices()[:gen_tp])
  placed = mesh_lib.put(whole, mesh_lib.param_shardings(whole, llama.logical_specs(cfg.critic),
                                                        instance))
  new = {}
  for x in jax.tree.leaves(placed):
    for shard in x.addressable_shards:
      if shard.data.unsafe_buffer_pointer() not in mine[shard.device]:
        new[shard.device] = new.get(shard.device, 0) + shard.data.nbytes
  copy = plan_programs._nbytes(llama.param_shapes(cfg.critic)) / cfg.gen_model_shards
  counted = plan_programs.group_instance_critic_bytes(cfg, copy)
  if gen_tp == 1:
    assert not new and counted == 0.0
  else:
    assert set(new) == set(instance.devices.flat)
    # (an upper bound: the instance's replicated norms share the group's buffers)
    assert max(new.values()) <= counted < 1.05 * max(new.values()), (new, counted)


def test_a_critic_free_run_is_checked_without_a_critic(tmp_path):
  """--run_config of a critic-free estimator (ppo_tiny:grpo; here also kl_coef=0 and
  staleness 1): the trainer builds no critic (rollout.use_critic, update.make_update(
  use_critic=False): the actor's update with the critic state None), yet plan_check compiled
  and counted one ("an upper bound"), until 2026-12-08. The plan follows the run
  (trains_critic False): the train step's arguments are the actor's state and the batch fields
  its loss reads, below the same run's with a critic; no critic_values pass at staleness 1, and
  without a reference nor a critic the instances score nothing: no inference program."""
  from configs import ppo_tiny
  run = ppo_tiny.get_config("grpo")
  run.algo.kl_coef = 0.0
  run.async_ppo.staleness = 1
  c = plan_config.get_config("tiny")
  plan_config.apply_run(c, run)
  cfg = plan_programs.PlanConfig.from_config_dict(c)
  result = plan_programs.run_and_write(cfg, str(tmp_path))
  train = result["programs"]["train_step"]
  mesh = plan_programs.train_mesh(cfg)
  tx = plan_programs.make_optimizer(staged=False, master_weights=cfg.master_weights)
  update, _ = plan_programs.make_update(cfg, mesh, tx, str(tmp_path))
  actor, _, batch = plan_programs.train_args(cfg, mesh, tx, update)
  # The same run's critic state (PPO's train step holds it beside the actor's).
  params = plan_programs.abstract_params(cfg.critic, mesh)
  critic = ppo.ModelState(params, plan_programs.abstract_opt_state(tx, params, mesh, cfg.zero1))
  # (jit drops the batch fields the actor's loss never reads: the critic's and ref_logp)
  read = ("tokens", "prompt_lens", "mask", "old_logp", "advantages")
  state = plan_programs._device_bytes(actor)
  assert train["argument_bytes"] == state + sum(plan_programs._device_bytes(batch[k])
                                                for k in read)
  assert train["optimizer_state_bytes"] == plan_programs._device_bytes(actor.opt_state)
  assert train["argument_bytes"] < state + plan_programs._device_bytes(critic)
  params = plan_programs._nbytes(llama.param_shapes(cfg.actor))
  assert train["analytic"]["params_bytes"] == params / (cfg.tp * cfg.fsdp)
  assert cfg.staleness == 1 and cfg.reference is False
  assert sorted(result["programs"]) == ["actor_logp", "decode", "prefill", "train_step"]
  assert result["plan"]["trains_critic"] is False and "critic" not in result["models"]
  # The verdict of fewer layers compiled names the actor's alone (it read the critic's
  # counts: a KeyError), and what would make room takes no stages, which such a run refuses.
  reduced = {**result, "layers_compiled": {**result["layers_compiled"], "reduced": True}}
  reduced["programs"] = {**result["programs"],
                         "train_step": {**train, "fits": False, "argument_bytes": 1e12}}
  line = plan_programs.verdict(reduced)
  assert "critic" not in line and "actor layers (config.layers)" in line, line
  assert "more stages" not in line and "more tensor devices" in line, line
  bound = {**result, "plan": {**result["plan"], "fsdp": 2}}
  bound["programs"] = {**result["programs"], "train_step": {
      **train, "collective_s": 10.0, "program_collective_s": 10.0}}
  notes = plan_programs.link_bound_notes(bound, {})
  assert notes and not any("a pipeline keeps" in n for n in notes), notes
  # The trainer's refusal of a pipelined critic-free run, by plan_check's own field.
  with pytest.raises(ValueError, match=r"config\.pp=2: expected 1 with trains_critic=False"):
    dataclasses.replace(cfg, pp=2, microbatch_size=1).validate()
  with pytest.raises(ValueError, match=r"config\.group_critic=True: expected False with "
                     "trains_critic=False"):
    dataclasses.replace(cfg, group_critic=True, generation_devices=4).validate()
  fields = c.to_dict()
  fields["trains_critic"] = "False"  # (a bool, as reference and group_critic)
  with pytest.raises(ValueError, match=r"config\.trains_critic='False': expected True or False"):
    plan_programs.PlanConfig.from_config_dict(ml_collections.ConfigDict(fields))
