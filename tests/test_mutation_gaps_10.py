"""Pins the survivors of a tenth mutation audit, of rlhfuse_jax/sim/ (the cost model's
collectives, the generation, training and plan-search simulators, the validation rows and the
ablation report): each test fails under one plausible bug the rest of the suite let through.
Every test is cheap (toy shapes or a few small calls) and checks against hand-computed values
or an independent brute force."""
import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest

from rlhfuse_jax.policy import calibration
from rlhfuse_jax.sim import iteration_sim as it
from rlhfuse_jax.sim import lengths
from rlhfuse_jax.sim import plan_search as ps
from rlhfuse_jax.sim import report
from rlhfuse_jax.sim import training_sim as ts
from rlhfuse_jax.sim import validation
from rlhfuse_jax.sim.cost_model import CostModel, Efficiency, crossing_share
from rlhfuse_jax.sim.generation_sim import GenSetup, choose_threshold
from rlhfuse_jax.sim.hardware import get_hardware
from rlhfuse_jax.sim.shapes import get_shape
from tests.test_sim_cost import EFF, TOY, TOY_HW
from tests.test_sim_generation import measured_cost
from tests.test_sim_generation import run as run_generation
from tests.test_sim_plan_search import COST, _small
from tests.test_sim_validation import CAL, write_gen_bench


# ----------------------------------------------------------------------------- generation

def test_a_migration_waits_for_its_sources_chunk_and_holds_the_source_until_it_ends():
  """Two instances (10 ms decode steps, prefill 1000 tok/s, 1 GB/s migration, chunks of 4):
  instance 0 prefills 101 tokens, instance 1 120, so instance 1's prefill ends later (0.12 s)
  than instance 0's (0.101 s, where Rt = 1 makes the host decide: as the engine, it checks
  after the prefill too). Instance 0 keeps the longer KV; instance 1's sample (its 60 prompt
  tokens: the next step writes the first response token's) moves once its prefill ended, and
  instance 1 scores nothing before its rows have left."""
  kv = get_shape("llama-7b").kv_bytes_per_token()
  mig = 60 * kv / 1e9
  res = run_generation(measured_cost(migration=1e9), [100, 60, 1, 60], [20, 20, 1, 1],
                       num_instances=2, slots=2, threshold=1.0, stream_inference=True)
  (c,) = res.consolidations
  assert c["time_s"] == pytest.approx(0.101)
  assert (c["kept_list"], c["released"], c["moved_bytes"]) == ([0], [1], 60 * kv)
  segs = {(i, k): [] for i in (0, 1) for k in ("migrate", "inference")}
  for i, st, e, k in res.segments:
    if k in ("migrate", "inference"):
      segs[(i, k)].append((st, e))
  for i in (0, 1):
    assert segs[(i, "migrate")] == [(pytest.approx(0.12), pytest.approx(0.12 + mig))]
  # The released instance scores the two samples done at prefill (2 + 61 tokens at 500 tok/s)
  # once the migration is over, then the last two (120 + 80 tokens) after the tail.
  gen_end = 0.12 + mig + 19 * 0.01  # 19 tokens left of 20 after the prefill
  assert res.gen_end_s == pytest.approx(gen_end)
  assert segs[(1, "inference")] == [
      (pytest.approx(0.12 + mig), pytest.approx(0.12 + mig + 63 / 500)),
      (pytest.approx(gen_end), pytest.approx(gen_end + 200 / 500))]
  assert segs[(0, "inference")] == []


def test_two_samples_moving_to_one_instance_migrate_one_after_the_other():
  """Instance 1 hands both its unfinished samples (30 KV tokens each, after the prefill) to
  instance 0: one destination receives them in turn, so its migration takes the sum of the two
  moves."""
  kv = get_shape("llama-7b").kv_bytes_per_token()
  mig = 60 * kv / 1e9
  res = run_generation(measured_cost(migration=1e9), [100, 30, 1, 30, 1, 1],
                       [20, 20, 1, 20, 1, 1], num_instances=2, slots=3, threshold=1.0,
                       stream_inference=True)
  (c,) = res.consolidations
  assert (c["moves"], c["moved_bytes"]) == (2, 60 * kv)
  assert c["migration_s"] == pytest.approx(mig)
  # Instance 0 (prefill of 102 tokens) receives them, then decodes uid 0's 19 tokens left.
  assert [(st, e) for i, st, e, k in res.segments if (i, k) == (0, "migrate")] == [
      (pytest.approx(0.102), pytest.approx(0.102 + mig))]
  assert res.gen_end_s == pytest.approx(0.102 + mig + 19 * 0.01)


def test_inference_goes_to_a_loaded_instance_that_finishes_sooner_than_a_new_one_loads():
  """Offloaded frozen weights take 0.5 s to load. Instance 0 is free at 0.01 s (its sample ends
  at prefill), loads and scores it by 0.532 s; instance 1 is free at 0.53 s with the last
  sample. Instance 0, loaded, starts it at 0.532 s, sooner than instance 1 could after its own
  load (1.03 s): the instances queue by when they can compute, not when they are free."""
  shape = get_shape("llama-7b")
  cal = calibration.from_dict({
      "format": calibration.FORMAT, "device": "test",
      "ops": {"decode_step": {"occupied_slots": [1, 64], "seconds": [0.01, 0.01]},
              "prefill": {"tokens_per_s": 1000.0}, "inference": {"tokens_per_s": 500.0},
              "migration": {"bytes_per_s": 1e9},
              "weight_load": {"bytes_per_s": shape.weight_bytes() / 0.5}}})
  res = run_generation(CostModel(get_hardware("h100_sxm"), calibration=cal), [10, 10], [1, 53],
                       num_instances=2, slots=1, stream_inference=True, offload_frozen=True)
  assert res.gen_end_s == pytest.approx(0.53)
  assert res.gen_plus_inf_s == pytest.approx(0.01 + 0.5 + 11 / 500 + 63 / 500)
  assert [k for i, _, _, k in res.segments if i == 1] == ["prefill"] + ["decode"] * 13


def test_offloaded_frozen_weights_load_a_tensor_parallel_share_per_device():
  """Each of an instance's tp devices copies its 1/tp of the frozen weights from host memory
  (H100: 64 GB/s of PCIe per device)."""
  shape = get_shape("llama-7b")
  cost = CostModel(get_hardware("h100_sxm"))
  res = run_generation(cost, [10], [2], num_instances=1, slots=1, tp=2, offload_frozen=True)
  (load,) = [e - st for _, st, e, k in res.segments if k == "load"]
  assert load == pytest.approx(shape.weight_bytes() / 2 / 64e9)


def test_the_inference_overlap_is_the_share_of_inference_done_before_generation_ends():
  """The pure-tail batch of test_sim_generation: 7 one-token samples (77 tokens) are scored
  while the long one decodes, its 110 tokens after it: overlap 77 / 187."""
  res = run_generation(measured_cost(), [10] * 8, [1] * 7 + [100], num_instances=4, slots=2,
                       inference_microbatch=8, threshold=0.5, stream_inference=True)
  assert res.inference_overlap_frac == pytest.approx(77 / 187)


def test_the_unfinished_curve_counts_down_every_finished_sample():
  """One instance, 3 samples: one ends at prefill (0.03 s), two after 4 steps (0.07 s)."""
  res = run_generation(measured_cost(), [10] * 3, [1, 5, 5], num_instances=1, slots=3)
  assert res.unfinished_curve == [(0.0, 3), (pytest.approx(0.03), 2), (pytest.approx(0.07), 0)]


def test_thresholds_that_tie_choose_the_smallest():
  """Equal lengths leave no tail: every Rt simulates the same time, and the choice is the
  smallest (min over (time, Rt))."""
  setup = GenSetup(num_instances=2, slots=4, chunk_steps=4, max_new_tokens=8)
  best, times = choose_threshold(measured_cost(), get_shape("llama-7b"),
                                 [get_shape("llama-7b")], setup, np.full(8, 8), np.full(8, 8),
                                 (0.5, 0.1, 0.3))
  assert len(set(times.values())) == 1 and best == 0.1


def test_the_kv_pool_is_checked_against_the_longest_prompt():
  """An instance's share of the batch is provisioned at the longest prompt + max_new_tokens:
  2 samples of prompts 10 and 100 with 10 new tokens need 2 x 110 KV tokens, not 2 x 65."""
  kw = dict(num_instances=1, slots=2, max_new_tokens=10)
  run_generation(measured_cost(), [10, 100], [5, 5], kv_capacity_tokens=220, **kw)
  with pytest.raises(ValueError, match="may need 220 KV tokens > kv_capacity_tokens=219"):
    run_generation(measured_cost(), [10, 100], [5, 5], kv_capacity_tokens=219, **kw)


def test_no_consolidation_is_planned_when_none_is_allowed():
  """max_consolidations = 0 (a bench run without migration): the tail decodes where it is,
  whatever Rt says; with 1 the same batch consolidates once."""
  cost = measured_cost(migration=1e12)
  rng = np.random.default_rng(0)
  resp = np.clip(np.rint(rng.lognormal(np.log(20), 1.0, 64)), 1, 200).astype(int)
  kw = dict(num_instances=8, slots=32, threshold=0.3, stream_inference=True)
  assert run_generation(cost, np.full(64, 8), resp, max_consolidations=0, **kw
                        ).consolidations == []
  assert len(run_generation(cost, np.full(64, 8), resp, max_consolidations=1, **kw
                            ).consolidations) == 1


# ----------------------------------------------------------------------------- training

def test_a_step_of_a_replicated_critic_plan_by_hand():
  """7B actor (32 layers, h 4096) and 13B critic (40 layers, h 5120) on 32 H100s: tp 2, Pa 4,
  Pc 2, dp 4. Pipeline neighbours are tp x dp = 8 devices apart, a node: every hop crosses
  the network, with the wider model's activations. The critic's 2 replicas each shard its
  optimizer over dp, so its states split 2 x 4 x 2 x 2 ways; its gradient all-reduce joins its
  dp x R ranks, devices 0, 2, 4, 6 and 16, 18, 20, 22: two nodes of 4 NICs each (the
  replicas Pc x tp x dp devices apart)."""
  cm = CostModel(get_hardware("h100_sxm"))
  a, c = get_shape("llama-7b"), get_shape("llama-13b", "scalar")
  plan = ts.TrainPlan(num_devices=32, minibatch=32, tp=2, actor_pp=4, critic_pp=2)
  assert (plan.dp, plan.actor_microbatches, plan.critic_microbatches) == (4, 8, 4)
  costs = ts.step_costs(cm, a, c, plan, 300.0, check_memory=False)
  p = costs.problem
  assert p.transfer_latency == pytest.approx(1e3 * cm.p2p_s(300 * 5120 * 2 / 2, True), abs=1e-6)
  assert p.actor_mem == pytest.approx(2 * 300 * 4096 * 8 / 2 / 1e6, abs=1e-6)
  assert p.critic_mem == pytest.approx(2 * 300 * 5120 * 20 / 2 / 1e6, abs=1e-6)
  opt = 28 * (a.num_params() / 32 + c.num_params() / 32) / (3.35e12 * 0.7)
  assert costs.optimizer_s == pytest.approx(opt)
  critic_sync = cm._allreduce_over(c.num_params() * 2 / 4, 8, 2, 4 * 50e9)
  assert costs.grad_sync_s == pytest.approx(cm.grad_sync_s(a, 2, 4, 4) + critic_sync)
  # The stage forwards attend on average to (300 + 1) / 2 keys (causal), and a step is the
  # pipeline, the gradient all-reduces and the optimizer steps, once per mini-batch.
  assert p.actor_fwd == pytest.approx(1e3 * cm.train_stage_fwd_s(a, 2, 4, 300, 150.5),
                                      abs=1e-6)
  assert p.critic_fwd == pytest.approx(1e3 * cm.train_stage_fwd_s(c, 2, 2, 300, 150.5),
                                       abs=1e-6)
  run = ts.pipeline_train_s(costs, 3, fused=False)
  step = ts.serial_makespan_ms(p) / 1e3 + costs.grad_sync_s + costs.optimizer_s
  assert run["step_s"] == pytest.approx(step) and run["train_s"] == pytest.approx(3 * step)
  # On 16 devices (dp 2) neighbours are 4 apart: of the 3 hops only 4 -> 8 crosses a node, and
  # the critic's replicas (ranks 0, 2 and 8, 10) span two nodes with 2 NICs each.
  plan = ts.TrainPlan(num_devices=16, minibatch=16, tp=2, actor_pp=4, critic_pp=2)
  costs = ts.step_costs(cm, a, c, plan, 300.0, check_memory=False)
  assert costs.problem.transfer_latency == pytest.approx(
      1e3 * cm.hop_s(300 * 5120 * 2 / 2, 1 / 3), abs=1e-6)
  critic_sync = cm._allreduce_over(c.num_params() * 2 / 4, 4, 2, 2 * 50e9)
  assert costs.grad_sync_s == pytest.approx(cm.grad_sync_s(a, 2, 4, 2) + critic_sync)


def test_a_model_alone_takes_a_plan_that_splits_its_mini_batch_evenly():
  """8 devices, mini-batches of 12 and 6 samples of 2000 tokens: dp 8 (tp 1, pp 1; it fits on
  GPUs of 400 GB) would give replicas 1.5 or 0.75 samples, timed as 1 or 0; the plan's dp
  divides the mini-batch into M micro-batches each."""
  cm = CostModel(dataclasses.replace(get_hardware("h100_sxm"), hbm_bytes=400e9))
  for minibatch in (12, 6):
    _, plan = ts.single_model_plan(cm, get_shape("llama-7b"), 8, minibatch, 1, 2000.0)
    assert plan["dp"] * plan["M"] == minibatch, plan
    assert plan["tp"] * plan["pp"] * plan["dp"] == 8


def test_a_model_alone_over_several_micro_batches_holds_the_float32_gradient_sums():
  """One device, a mini-batch of 2 samples of 1 (tp 1, pp 1, M 2): the unpipelined update keeps
  float32 sums of the gradients, 4 bytes a parameter, as a colocated plan is charged
  (TrainPlan.accumulates). With HBM between the need without them and with them, nothing fits
  (it was planned); with room for them it is, and a one-micro-batch mini-batch needs none."""
  a = get_shape("llama-7b")
  base = CostModel(get_hardware("h100_sxm"))
  without = base.train_memory_bytes(a, 1, 1, 1, True, 300.0, 1)
  assert base.train_memory_bytes(a, 1, 1, 1, True, 300.0, 1, True) == pytest.approx(
      without + 4 * a.num_params())
  for extra, minibatch, fits in ((2, 2, False), (5, 2, True), (2, 1, True)):
    hbm = (without + extra * a.num_params()) / base.eff.memory_headroom
    cm = CostModel(dataclasses.replace(get_hardware("h100_sxm"), hbm_bytes=hbm))
    got = ts.single_model_plan(cm, a, 1, minibatch, 1, 300.0)
    assert (got is not None) == fits, (extra, minibatch)
    if got is not None:
      assert (got[1]["tp"], got[1]["pp"], got[1]["M"]) == (1, 1, minibatch)


def test_zero3_memory_holds_the_shards_the_activations_and_one_gathered_layer():
  """Per device and trained model: 16 bytes a parameter over all devices, the activations of
  its tokens (34 h bytes a token a layer), and one whole layer's bf16 weights gathered."""
  cm = CostModel(get_hardware("h100_sxm"))
  seen = []
  cm.check_fits = lambda what, need, detail: seen.append(need)
  a, c = get_shape("llama-7b"), get_shape("llama-13b", "scalar")
  ts.check_zero3_memory(cm, (a, c), 8, 500.0)
  want = sum(16 * s.num_params() / 8 + 34 * s.hidden_size * 500 * s.num_layers
             + 2 * (s.num_params() - s.vocab_size * s.hidden_size) / s.num_layers
             for s in (a, c))
  assert seen == [pytest.approx(want)]


def test_a_model_alone_pays_its_pipeline_hops_of_a_tensor_shard_of_activations():
  """7B alone on 8 H100s, mini-batch 4 of 300 tokens: tp 2 x pp 4. Each hop carries one
  micro-batch's activations split over tp (300 x 4096 x 2 / 2 bytes), inside the one node (it
  was priced across nodes, as no hop of these 8 devices is); the step is the 1F1B with that
  latency, the gradient all-reduce and the optimizer step."""
  cm = CostModel(get_hardware("h100_sxm"))
  a = get_shape("llama-7b")
  step, plan = ts.single_model_plan(cm, a, 8, 4, 1, 300.0)
  assert (plan["tp"], plan["pp"], plan["dp"], plan["M"]) == (2, 4, 1, 4)
  f = cm.train_stage_fwd_s(a, 2, 4, 300, 150.5)
  b = cm.train_stage_bwd_s(f, "actor", cm.train_stage_comm_s(a, 2, 4, 300))
  lat = cm.p2p_s(300 * 4096 * 2 / 2, False)
  assert step == pytest.approx(ts.one_f_one_b_s(4, 4, f, b, lat) + cm.grad_sync_s(a, 2, 4, 1)
                               + cm.optimizer_step_s(a, 8))


def test_a_chain_starting_inside_a_node_counts_the_hops_its_own_devices_cross():
  """Stages 2 devices apart, 4 stages, 8 devices a node: from device 0 (0-1, 2-3, 4-5, 6-7) no
  hop leaves the node; from device 4 (the second model of a disjoint split: 4-5, 6-7, 8-9,
  10-11) the middle hop crosses."""
  assert crossing_share(2, 3, 8) == 0.0
  assert crossing_share(2, 3, 8, first=4) == pytest.approx(1 / 3)
  assert crossing_share(2, 3, 8, first=8) == 0.0


def test_a_disjoint_split_places_the_critic_on_the_devices_after_the_actors(monkeypatch):
  """disjoint_splits gives the actor devices 0..na-1 and the critic na..n-1: the critic's plan
  is priced from device na, so its pipeline hops cross the nodes that group really spans."""
  seen = []

  def fake(cost, shape, n, *args, first=0, **kw):
    seen.append((shape.head, n, first))
    return 1.0, {}
  monkeypatch.setattr(ts, "single_model_plan", fake)
  a, c = get_shape("llama-7b"), get_shape("llama-13b", "scalar")
  ts.disjoint_splits(CostModel(get_hardware("h100_sxm")), a, c, 16, 8, 1, 300.0,
                     fractions=(0.25,))
  assert seen == [("lm", 4, 0), ("scalar", 12, 4)]


def test_a_model_alone_is_sized_for_the_micro_batches_its_first_stage_holds():
  """1F1B's first stage holds min(pp, M) micro-batches: a mini-batch of 2 on 8 devices gives
  a 4-stage plan (dp 1) M = 2 in flight, not 4."""
  cm = CostModel(get_hardware("h100_sxm"))
  calls, measure = [], cm.train_memory_bytes

  def spy(shape, tp, pp, dp, zero1, mb_tokens, inflight, accumulate, *head):
    calls.append((pp, dp, inflight))
    return measure(shape, tp, pp, dp, zero1, mb_tokens, inflight, accumulate, *head)
  cm.train_memory_bytes = spy
  assert ts.single_model_plan(cm, get_shape("llama-7b"), 8, 2, 1, 300.0) is not None
  assert (4, 1, 2) in calls
  assert all(inflight == min(pp, 2 // dp) for pp, dp, inflight in calls), calls


def test_a_disjoint_step_lasts_as_long_as_the_slower_model():
  """Actor and critic train at once on their own devices: the step is the slower one's (on
  GPUs of 400 GB, so that both splits fit)."""
  cm = CostModel(dataclasses.replace(get_hardware("h100_sxm"), hbm_bytes=400e9))
  a, c = get_shape("llama-13b"), get_shape("llama-7b", "scalar")
  splits = ts.disjoint_splits(cm, a, c, 16, 16, 1, 300.0, fractions=(0.5,))
  assert len(splits) == 1
  for (step, plans), na in zip(splits, (8,)):
    sa = ts.single_model_plan(cm, a, na, 16, 1, 300.0)
    sc = ts.single_model_plan(cm, c, 16 - na, 16, 1, 300.0)
    assert step == max(sa[0], sc[0]) and sa[0] != sc[0]
    assert plans == {"actor": sa[1], "critic": sc[1]}


def test_a_cluster_too_small_to_split_a_quarter_off_skips_that_fraction():
  """2 devices: a quarter is no device, so only the half and three-quarter splits (1 device
  each, int(1.5)) are tried; a quarter's single_model_plan on 0 devices divided by zero."""
  cm = CostModel(get_hardware("h100_sxm"))
  a, c = get_shape("llama-7b"), get_shape("llama-7b", "scalar")
  hw = dataclasses.replace(cm.hw, hbm_bytes=400e9)  # both 7B models fit on one device each
  splits = ts.disjoint_splits(CostModel(hw), a, c, 2, 2, 1, 100.0)
  assert [(p["actor"]["devices"], p["critic"]["devices"]) for _, p in splits] == [(1, 1)] * 2


def test_training_plans_keep_tensor_parallelism_inside_a_node():
  """A node of 4 devices: no training plan of tp 8 (its all-reduces would cross the network
  twice per layer), though 8 divides the models."""
  hw = dataclasses.replace(get_hardware("h100_sxm"), devices_per_node=4)
  a, c = get_shape("llama-7b"), get_shape("llama-7b", "scalar")
  _, tried = ts.best_plan(CostModel(hw), a, c, 16, 16, 1, 300.0, 1)
  assert tried and not any(name.startswith("tp8") for name in tried)
  assert any(name.startswith("tp4") for name in tried)


# ----------------------------------------------------------------------------- shapes

def test_a_scalar_head_multiplies_by_one_column_not_the_vocabulary():
  """The toy's layer: q, k, v (2 + 2 x 1 heads of 8) and o projections of 16, a 3 x 16 x 32
  SwiGLU MLP = 2304 matmul weights; the LM head adds 100 x 16, a critic's scalar head 16."""
  assert TOY.layer_matmul_params() == 16 * 8 * 4 + 2 * 8 * 16 + 3 * 16 * 32 == 2304
  assert TOY.matmul_params() == 2 * 2304 + 100 * 16
  assert TOY.as_critic().matmul_params() == 2 * 2304 + 16


# ----------------------------------------------------------------------------- collectives

def test_a_collective_over_one_device_costs_nothing():
  """One rank has nobody to exchange with: no base latency either (ZeRO-3 on one device)."""
  for hw in (TOY_HW, get_hardware("h100_sxm")):
    cm = CostModel(hw, EFF)
    assert cm.allgather_s(1e9, 1) == 0.0
    assert cm.allreduce_s(1e9, 1) == 0.0
    assert cm.group_collective_s("all-gather", 1e9, [3]) == 0.0


def test_a_strided_group_inside_one_node_runs_at_the_fast_link():
  """Devices 0, 3, 6 (3 ranks 3 apart) and 0, 5 sit in one node of 8: NVLink, not the NICs;
  the group's span is its first to its last device, not ranks x stride."""
  hw = get_hardware("h100_sxm")
  assert hw.link_bw(3, stride=3) == hw.intra_node_bw
  assert hw.link_bw(2, stride=5) == hw.intra_node_bw
  # Ranks 0, 3, 6, 9: across two nodes, three members in the first and one in the second,
  # so the second node's one NIC sets the pace.
  assert hw.link_bw(4, stride=3) == hw.inter_node_bw


def test_an_all_to_all_is_priced_as_an_all_gather_of_its_buffer():
  """perf/scale_check times compiled programs' collectives, all-to-all among them: it moves
  (g-1)/g of its buffer in g-1 ring steps, like an all-gather, not 2(g-1)/g as an all-reduce."""
  cm = CostModel(get_hardware("h100_sxm"), Efficiency(net_eff=1.0))
  for members in ([0, 1, 2, 3], list(range(16))):
    got = cm.group_collective_s("all-to-all", 1e8, members)
    assert got == pytest.approx(cm.allgather_s(1e8, len(members)))
    assert got < cm.group_collective_s("all-reduce", 1e8, members)
  # 4 devices of one node, Simple protocol at NVLink speed: by hand.
  assert cm.group_collective_s("all-to-all", 1e8, [0, 1, 2, 3]) == pytest.approx(
      8.4e-6 + 3 * 3.4e-6 + 3 / 4 * 1e8 / 450e9)


def test_a_hop_chain_that_partly_crosses_nodes_pays_the_mean_of_both_links():
  """hop_s weighs the cross-node and in-node hop by the share of hops that cross (a pipeline of
  3 hops, 1 across nodes: a third of the network's time, two thirds of NVLink's)."""
  cm = CostModel(TOY_HW, EFF)
  across, inside = 1e6 / 0.5e7, 1e6 / 0.5e8
  for share in (0.25, 0.5, 2 / 3):
    assert cm.hop_s(1e6, share) == pytest.approx(share * across + (1 - share) * inside)


def test_a_fitted_decode_step_adds_the_tensor_parallel_all_reduces():
  """With a decode_fit the step is the fit's fixed costs + its roofline + the 2 all-reduces a
  layer of the batch's activations over tp, as the uncalibrated step."""
  fit = calibration.DecodeFit(step_s=1e-4, layer_s=5e-5, mfu=0.04, bw_eff=0.7)
  cm = CostModel(TOY_HW, EFF, calibration.Calibration(device="test", decode_fit=fit))
  nbytes = 2 * TOY.num_params() + 100 * TOY.kv_bytes_per_token()
  ar = 2 * (2 - 1) / 2 * (3 * 16 * 2) / (1e8 * 0.5)  # 3 rows' activations over 2 devices
  assert cm.decode_step_s(TOY, 2, 3, 100) == pytest.approx(
      1e-4 + 2 * 5e-5 + nbytes / 2 / (1e9 * 0.7) + 2 * 2 * ar)


# ----------------------------------------------------------------------------- forwards

def test_a_short_prefill_or_inference_pass_reads_every_weight_once():
  """A forward over few tokens is bandwidth bound like a decode step: its roofline has the
  weights' bytes on the byte side (at 1 PFLOP/s the toy's compute is negligible)."""
  cm = CostModel(TOY_HW, EFF)
  read = 2 * TOY.num_params() / 0.5e9
  assert cm.prefill_s(TOY, 1, [1]) == pytest.approx(read)
  assert cm.inference_s([TOY, TOY.as_critic()], 1, [3]) == pytest.approx(
      read + 2 * TOY.as_critic().num_params() / 0.5e9)


def test_a_pipeline_stage_all_reduces_only_its_own_layers():
  """Two all-reduces per layer of the stage: with pp = 2 the toy's stage holds 1 of 2 layers,
  so half the tensor-parallel traffic of the whole model."""
  cm = CostModel(TOY_HW, EFF)
  ar = 2 * (2 - 1) / 2 * (64 * 16 * 2) / (1e8 * 0.5)  # ring all-reduce over 2 devices
  assert cm.train_stage_comm_s(TOY, 2, 1, 64.0) == pytest.approx(2 * 2 * ar)
  assert cm.train_stage_comm_s(TOY, 2, 2, 64.0) == pytest.approx(2 * 1 * ar)


# ----------------------------------------------------------------------------- plan search

def test_a_pipelined_generation_stage_holds_its_share_of_weights_and_kv():
  """pp 4 x tp 2 on 8 H100s: each device holds 1/8 of the weights and of the KV of the
  replica's 8 samples at 100 + 16 tokens, and one layer's activations of a group's prefill (4
  groups: 2 prompts of 100 tokens, 34*h bytes a token, over tp 2); it fits with exactly that
  much memory, not less."""
  a = get_shape("llama-13b")
  need = ((a.weight_bytes() + 8 * 116 * a.kv_bytes_per_token()) / 8
          + 2 * 100 * 34 * a.hidden_size / 2)

  def generate(scale):
    hw = dataclasses.replace(get_hardware("h100_sxm"), hbm_bytes=need * scale / 0.9)
    return ps.pipelined_generation(CostModel(hw), a, 8, 2, 4, 4, np.full(8, 100),
                                   np.full(8, 5), 16)
  assert generate(1 + 1e-9)["replicas"] == 1
  with pytest.raises(ValueError, match="does not fit in memory"):
    generate(1 - 1e-9)


def test_pipelined_generation_deals_a_replicas_samples_round_robin_to_its_groups():
  """G = 2 groups of one replica: samples 0 and 2 share a group, 1 and 3 the other. Swapping
  the lengths of samples 0 and 2 changes nothing; putting both long ones in one group does."""
  cm = CostModel(get_hardware("h100_sxm"))
  a = get_shape("llama-13b")

  def gen_s(resp):
    return ps.pipelined_generation(cm, a, 4, 2, 2, 2, np.full(4, 100), np.array(resp),
                                   16)["gen_s"]
  assert gen_s([10, 10, 2, 2]) == gen_s([2, 10, 10, 2])
  assert gen_s([10, 10, 2, 2]) != pytest.approx(gen_s([10, 2, 10, 2]), rel=1e-6)


def test_the_inference_stage_schedules_shortest_first_on_the_least_loaded_replica():
  """Two replicas at 500 tokens/s, micro-batches of one: 10 -> r0, 20 -> r1, 30 -> r0 (40),
  1000 -> r1 (1020 tokens): the order samples finish generating, as generation_sim scores
  them (longest first would give 1000 tokens)."""
  t = ps.inference_stage_s(measured_cost(), (get_shape("llama-7b"),), 2, 1, 1,
                           np.array([30, 1000, 10, 20]), 1, False)
  assert t == pytest.approx(1020 / 500)


def test_an_offloaded_forward_pipeline_loads_a_stage_per_device():
  """pp 2 x tp 1: each device copies half of the frozen weights from host memory."""
  cm = CostModel(get_hardware("h100_sxm"))
  a = get_shape("llama-7b")
  kw = dict(seq_lens=np.full(4, 300.0), microbatch=2)
  loaded = ps.inference_stage_s(cm, (a,), 2, 1, 2, offload=True, **kw)
  assert loaded - ps.inference_stage_s(cm, (a,), 2, 1, 2, offload=False, **kw) == (
      pytest.approx(a.weight_bytes() / 2 / 64e9))


def test_async_splits_give_both_groups_some_devices():
  cm = CostModel(get_hardware("h100_sxm"))
  assert ps.async_splits(cm, 32) == [8, 16, 24]
  assert ps.async_splits(cm, 8, split_unit=2) == [2, 4, 6]
  # The node step where one node holds every device tried no split (a TPU preset's node is a
  # pod slice: the async plan was the synchronous one): a host, or one device, instead.
  assert ps.async_splits(cm, 8) == list(range(1, 8))
  v5p = CostModel(get_hardware("tpu_v5p"))
  assert ps.async_splits(v5p, 256) == list(range(4, 256, 4))
  assert ps.async_splits(v5p, 2) == [1] and ps.async_splits(v5p, 1) == []


def test_a_uniform_layout_generates_as_one_plain_pipeline():
  """The uniform plan's generation is a plain pipeline (G = 1: each token crosses all pp
  stages before the next starts), with the layout's inference and 1F1B training after it."""
  wl, opt = _small(), it.SimOptions()
  prompts, resp = wl.sample_lengths()
  seq = (prompts + resp).astype(float)
  cands = ps.uniform_candidates(COST, wl, opt, prompts, resp, float(seq.mean()), {})
  piped = [c for c in cands if c.plan["pp"] > 1]
  assert piped
  for c in piped:
    tp, pp = c.plan["tp"], c.plan["pp"]
    gen = ps.pipelined_generation(COST, wl.actor, 16, tp, pp, 1, prompts, resp, 64)["gen_s"]
    assert c.info["gen_s"] == pytest.approx(gen, rel=1e-12)
    assert c.seconds == pytest.approx(gen + c.info["inf_s"] + c.info["train_s"], rel=1e-12)


# ----------------------------------------------------------------------------- iteration

def _wl(**kw):
  return it.Workload(actor=get_shape("llama-7b"), critic=get_shape("llama-7b", "scalar"),
                     **{"num_devices": 8, "global_batch": 64, "minibatch": 16, **kw})


def test_an_instance_gets_at_least_its_share_of_the_batch_whatever_max_slots_says():
  """8 instances of tp 1 for a batch of 64: 8 slots each, though sim.max_slots is 2 (the
  engine admits the whole batch at the start)."""
  plan = it.gen_plan(CostModel(get_hardware("h100_sxm")), _wl(), 1, np.full(64, 100), 2)
  assert (plan.num_instances, plan.slots) == (8, 8)


def test_the_generation_degree_is_chosen_by_generation_plus_inference():
  """7B on 8 H100s, 64 samples up to 256 tokens: tp 8 ends generation first, tp 4 ends the
  stage (generation and the inference after it, on the instances) first; the stage time
  decides."""
  cm = CostModel(get_hardware("h100_sxm"))
  wl = _wl(max_new_tokens=256)
  alone = {tp: it.simulate_gen_stage(cm, wl, it.SimOptions(gen_tps=(tp,)), False)["result"]
           for tp in (1, 2, 4, 8)}
  assert min(alone, key=lambda tp: alone[tp].gen_end_s) == 8
  best = min(alone, key=lambda tp: alone[tp].gen_plus_inf_s)
  assert best == 4
  assert it.simulate_gen_stage(cm, wl, it.SimOptions(), False)["plan"].tp == best


def test_inference_memory_holds_one_micro_batch_of_the_largest_model():
  """The frozen models' weights over tp, plus one micro-batch's activations of the largest
  one (they run one after the other), padded as the trainer pads its rows: the prompt's
  max_len (1024, the default LengthSpec's) + max_new_tokens; and the reference's float32
  logits of the micro-batch at the response positions, the vocabulary over tp."""
  cm = CostModel(get_hardware("h100_sxm"))
  wl = it.Workload(actor=get_shape("llama-7b"), critic=get_shape("llama-13b", "scalar"),
                   num_devices=8, global_batch=64, minibatch=16, max_new_tokens=50)
  seen = []
  cm.check_fits = lambda what, need, detail: seen.append(need)
  it.check_inference_memory(cm, wl, 2, 4)
  weights = (wl.actor.weight_bytes() + 2 * wl.critic.weight_bytes()) / 2
  logits = 4.0 * 4 * 50 * 32000 / 2
  assert seen == [pytest.approx(weights + 34 * 5120 * 4 * 1074 / 2 + logits)]


def test_deepspeed_chat_scores_with_four_forwards_under_zero3():
  """generate_experience's actor (old log-probs), reference, critic and reward forwards, each
  the larger of its compute over all devices and its parameter all-gather."""
  cm = CostModel(get_hardware("h100_sxm"))
  wl = _wl()
  prompts, resp = wl.sample_lengths()
  seq = (prompts + resp).astype(float)

  def fwd(s):
    flops = float(np.sum(s.forward_flops(seq, (seq + 1) / 2)))
    return max(flops / (8 * 989.4e12 * 0.45), cm.allgather_s(s.weight_bytes(), 8))
  assert it._zero3_stage(cm, wl, prompts, resp)["inf_s"] == pytest.approx(
      2 * fwd(wl.actor) + 2 * fwd(wl.critic))


def test_realhf_trains_disjoint_only_where_its_iteration_is_shorter():
  """ReaLHF-like training: the colocated 1F1B plan or the best disjoint split, each over all
  of the iteration's mini-batches, whichever is shorter."""
  cm = CostModel(get_hardware("h100_sxm"))
  wl = it.Workload(actor=get_shape("llama-7b"), critic=get_shape("llama-13b", "scalar"),
                   num_devices=16, global_batch=64, minibatch=16, max_new_tokens=64)
  rows, _ = it.simulate_iteration(cm, wl, it.SimOptions(), systems=("realhf_like",))
  prompts, resp = wl.sample_lengths()
  mean = float(np.mean(prompts + resp))
  plan, _ = ts.best_plan(cm, wl.actor, wl.critic, 16, 16, 1, mean, 4)
  colocated = ts.pipeline_train_s(ts.step_costs(cm, wl.actor, wl.critic, plan, mean), 4,
                                  False)["train_s"]
  split = min(s for s, _ in ts.disjoint_splits(cm, wl.actor, wl.critic, 16, 16, 1, mean))
  assert split < colocated < 4 * split  # colocated wins over the iteration's 4 mini-batches
  assert rows["realhf_like"]["train_s"] == pytest.approx(colocated)
  assert rows["realhf_like"]["details"]["train"]["mode"] == "colocated_serial_1f1b"


def test_planned_generation_takes_inter_stage_fusion_only_with_its_resharding():
  """rlhfuse_planned swaps the searched generation + inference for inter-stage fusion only
  when the fused stage plus the resharding into its instances is shorter: a plan that pays no
  resharding (instances of the training layout) keeps its 1.5 s against a fused stage shorter
  by half the resharding, and takes one shorter by twice it."""
  cm = CostModel(get_hardware("h100_sxm"))
  wl = it.Workload(actor=get_shape("llama-13b"), critic=get_shape("llama-13b", "scalar"),
                   num_devices=64, global_batch=64, minibatch=16)
  reshard = ps.reshard_s(cm, wl, 1)
  assert reshard > 0.02
  best = {"generation": {"mode": "instances", "tp": 2, "pp": 1}, "inference": {"tp": 2},
          "training": {}, "summary": "",
          "predicted": {"gen_s": 1.0, "inf_s": 0.5, "reshard_s": 0.0, "train_s": 2.0,
                        "iteration_s": 3.5}}
  searched = {"best": best, "uniform": None, "search_s": 0.0}
  fused = {"result": SimpleNamespace(gen_plus_inf_s=1.5 - reshard / 2, gen_end_s=1.2,
                                     inf_exposed_s=0.3 - reshard / 2),
           "plan": SimpleNamespace(tp=1), "threshold": 0.2}
  row = it._planned_row(cm, wl, searched, fused, None)
  assert (row["gen_s"], row["inf_s"], row["reshard_s"]) == (1.0, 0.5, 0.0)
  fused["result"].gen_plus_inf_s = 1.5 - 2 * reshard
  row = it._planned_row(cm, wl, searched, fused, None)
  assert row["reshard_s"] == reshard and row["gen_s"] == 1.2


def test_every_epoch_trains_on_every_mini_batch():
  """2 PPO epochs over 64 samples in mini-batches of 16: 8 mini-batch steps; DeepSpeed-Chat's
  ZeRO-3 steps each take a mini-batch's tokens, whatever the epochs."""
  one, two = _wl(), _wl(epochs=2)
  assert (one.num_minibatches, two.num_minibatches) == (4, 8)
  cm = CostModel(get_hardware("h100_sxm"))
  prompts, resp = one.sample_lengths()
  z1, z2 = (it._zero3_stage(cm, w, prompts, resp) for w in (one, two))
  assert z2["step_s"] == pytest.approx(z1["step_s"])
  assert z2["train_s"] == pytest.approx(2 * z1["train_s"])


# ----------------------------------------------------------------------------- validation

def test_the_validation_rows_hold_predicted_over_measured_minus_one(tmp_path):
  """validate()'s rows (result.json's `validation`): a bench_generation workdir measured 1.0 s
  baseline and 0.8 s fused, so the measured ratio is 0.8 and each row's error is
  predicted / measured - 1 (a prediction 10 % long is +0.1)."""
  write_gen_bench(tmp_path / "gen", measured=(1.0, 0.8))
  # Dedicated devices, where fusion pays (on CAL's shared processor both predict the same).
  cal = calibration.from_dict({**CAL, "devices_share_compute": False}, "cal.json")
  _, rows, skipped = validation.validate(cal, str(tmp_path / "gen"), "")
  assert skipped == []
  pred = validation.predict_bench_generation(
      cal, validation.gen_bench_from_workdir(str(tmp_path / "gen"))[0])
  base, fused = pred["baseline"]["gen_plus_inf_s"], pred["fused"]["gen_plus_inf_s"]
  assert fused < base
  want = {"baseline gen_plus_inf_s": (base, 1.0), "fused gen_plus_inf_s": (fused, 0.8),
          "ratio fused / baseline": (fused / base, 0.8)}
  got = {r["quantity"]: (r["predicted"], r["measured"]) for r in rows}
  # One approx per row: pytest 9.2's approx takes no dict of tuples (a TypeError, 9.0 took it).
  assert got.keys() == want.keys()
  for quantity, pair in want.items():
    assert got[quantity] == pytest.approx(pair), quantity
  for r in rows:
    assert r["bench"] == "bench_generation" and r["prediction"] == "calibrated"
    assert r["error"] == pytest.approx(r["predicted"] / r["measured"] - 1)


def test_a_generation_bench_is_rebuilt_with_its_own_instance_width_and_micro_batch(tmp_path):
  """A bench that ran instances of 2 devices and inference micro-batches of 4 is predicted at
  those (the defaults 1 and 8 are for a bench that does not say)."""
  write_gen_bench(tmp_path / "gen")
  spec, _ = validation.gen_bench_from_workdir(str(tmp_path / "gen"))
  assert (spec.tp, spec.inference_microbatch) == (1, 8)
  cfg = json.loads((tmp_path / "gen" / "config.json").read_text())
  cfg["fusion"].update(devices_per_instance=2, inference_micro_batch=4)
  (tmp_path / "gen" / "config.json").write_text(json.dumps(cfg))
  spec, _ = validation.gen_bench_from_workdir(str(tmp_path / "gen"))
  assert (spec.tp, spec.inference_microbatch) == (2, 4)


# ----------------------------------------------------------------------------- lengths

def test_lognormal_lengths_are_rounded_draws_clipped_to_the_limits():
  """round(exp(N(log median, sigma^2))) clipped to [min_len, max_len], as the module says:
  the same draws numpy gives, rounded to the nearest length, not cut down."""
  got = lengths.LengthSpec(kind="lognormal", median=100, sigma=1.0, min_len=2,
                           max_len=300).sample(np.random.default_rng(3), 500)
  raw = np.random.default_rng(3).lognormal(np.log(100), 1.0, 500)
  assert np.array_equal(got, np.clip(np.rint(raw), 2, 300).astype(np.int64))


def test_pareto_lengths_start_at_min_len_with_a_lomax_tail():
  """min_len x (1 + Lomax(alpha)): the median is min_len x 2^(1/alpha) (17.8 for 10 and 1.2)
  and few draws sit at min_len itself."""
  x = lengths.LengthSpec(kind="pareto", alpha=1.2, min_len=10, max_len=1000).sample(
      np.random.default_rng(0), 20000)
  assert abs(np.median(x) - 10 * 2 ** (1 / 1.2)) <= 1
  assert np.mean(x == 10) < 0.1


def test_the_length_summary_counts_samples_at_the_limit_as_clipped():
  out = lengths.summarize(np.array([1, 5, 5, 3]), max_len=5)
  assert out["clip_frac"] == 0.5 and (out["n"], out["max"]) == (4, 5)
  assert out["mean"] == 3.5 and out["p50"] == 4.0


# ----------------------------------------------------------------------------- the report

def _rows(times: dict) -> list:
  return [{"setting": {"label": "S"}, "system": s, "iteration_s": t, "gen_s": 0.0, "inf_s": 0.0,
           "gen_plus_inf_s": 0.0, "train_s": t, "reshard_s": 0.0, "samples_per_s": 1.0 / t,
           "details": {}} for s, t in times.items()]


def test_the_summary_table_reports_speedups_as_slower_over_faster():
  """rlhfuse vs base = base's time / rlhfuse's; vs the best existing system = the faster of
  DeepSpeed-Chat-like and ReaLHF-like, over rlhfuse's (the paper's "up to 3.7x" direction)."""
  times = {"deepspeed_chat_like": 12.0, "realhf_like": 6.0, "rlhfuse_base": 5.0, "rlhfuse": 4.0}
  lines = report.summary_table(_rows(times), list(times))
  assert lines[-1] == "| S | 12.00 | 6.00 | 5.00 | 4.00 | 1.25x | 1.50x (realhf_like) |"


def test_the_speedup_matrix_is_the_column_time_over_the_row_time():
  times = {"rlhfuse_base": 6.0, "rlhfuse": 4.0}
  lines = report.setting_section("S", {r["system"]: r for r in _rows(times)}, list(times))
  assert "| rlhfuse | 1.50 | 1.00 |" in lines
  assert "| rlhfuse_base | 1.00 | 0.67 |" in lines
