"""Cost model formulas, length distributions and calibration files."""
import dataclasses
import json

import numpy as np
import pytest

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.policy import calibration
from rlhfuse_jax.sim import lengths, training_sim
from rlhfuse_jax.sim.cost_model import CostModel, Efficiency
from rlhfuse_jax.sim.hardware import Hardware, get_hardware
from rlhfuse_jax.sim.shapes import ModelShape, get_shape

TOY_HW = Hardware(name="toy", peak_flops=1e15, hbm_bw=1e9, hbm_bytes=1e10, intra_node_bw=1e8,
                  inter_node_bw=1e7, devices_per_node=4)
TOY = ModelShape(name="toy", vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=2,
                 num_heads=2, num_kv_heads=1)
EFF = Efficiency(decode_bw_eff=0.5, net_eff=0.5, collective_latency_s=0.0)


def test_decode_is_bandwidth_bound_by_hand():
  cm = CostModel(TOY_HW, EFF)
  # Weights (bf16) + 100 KV tokens read, at half of 1 GB/s; compute is negligible at 1 PFLOP/s.
  nbytes = 2 * TOY.num_params() + 100 * TOY.kv_bytes_per_token()
  assert cm.decode_step_s(TOY, 1, 1, 100) == pytest.approx(nbytes / 0.5e9)
  # Two tensor-parallel devices: half the bytes each, plus 2 all-reduces per layer of h*2 bytes.
  ar = 2 * (2 - 1) / 2 * (16 * 2) / (1e8 * 0.5)
  assert cm.decode_step_s(TOY, 2, 1, 100) == pytest.approx(nbytes / 2 / 0.5e9 + 2 * 2 * ar)
  # Vectorised over steps; zero live rows cost nothing.
  got = cm.decode_step_s(TOY, 1, np.array([1, 0]), np.array([100, 0]))
  assert got[1] == 0 and got[0] == pytest.approx(nbytes / 0.5e9)


def test_the_backward_pays_the_forwards_tensor_parallel_all_reduces_once():
  """By hand on the toy: a stage's forward holds 2 all-reduces a layer of its micro-batch's
  activations (tokens x h x 2 bytes); Megatron's backward has as many (f's conjugate), so it is
  bwd_over_fwd x the compute plus the same all-reduces, not bwd_over_fwd x all of it (10-21 %
  too slow a backward at the LLaMA pairs' tp 4-8, more the larger tp)."""
  cm = CostModel(TOY_HW, EFF)
  tokens = 64.0
  comm = cm.train_stage_comm_s(TOY, 2, 1, tokens)
  ar = 2 * (2 - 1) / 2 * (tokens * 16 * 2) / (1e8 * 0.5)  # ring all-reduce over 2 devices
  assert comm == pytest.approx(2 * 2 * ar)  # 2 layers x 2 all-reduces
  fwd = cm.train_stage_fwd_s(TOY, 2, 1, tokens, 32.0)
  assert fwd > comm > 0
  assert cm.train_stage_bwd_s(fwd, "actor", comm) == pytest.approx(2 * (fwd - comm) + comm)
  assert cm.train_stage_comm_s(TOY, 1, 1, tokens) == 0.0  # no tensor parallelism, no all-reduce
  # The step the simulator times uses it (training_sim.step_costs): the backward it hands the
  # schedule is the one above.
  from rlhfuse_jax.sim import training_sim  # pylint: disable=import-outside-toplevel
  plan = training_sim.TrainPlan(num_devices=2, minibatch=2, tp=2, actor_pp=1, critic_pp=1)
  costs = training_sim.step_costs(cm, TOY, TOY, plan, tokens, check_memory=False)
  p = costs.problem  # in the schedule's time unit
  assert p.actor_bwd / p.actor_fwd == pytest.approx((2 * (fwd - comm) + comm) / fwd, rel=1e-6)


def test_roofline_turns_compute_bound_with_large_batches():
  cm = CostModel(get_hardware("h100_sxm"))
  s = get_shape("llama-13b")
  small = cm.decode_step_s(s, 1, 1, 0)
  big = cm.decode_step_s(s, 1, 4096, 0)
  assert big > 5 * small  # 4096 rows x 2P FLOPs exceed what one weight read hides
  flops = 2.0 * s.matmul_params() * 4096
  assert big == pytest.approx(flops / (989.4e12 * 0.45))


def test_collectives_by_bandwidth():
  cm = CostModel(TOY_HW, EFF)
  assert cm.allreduce_s(1e6, 1) == 0.0
  assert cm.allreduce_s(1e6, 4) == pytest.approx(2 * 3 / 4 * 1e6 / 0.5e8)  # intra-node
  # Spans 2 nodes of 4: the ring's 4 channels leave each node through its 4 NICs.
  assert cm.allreduce_s(1e6, 8) == pytest.approx(2 * 7 / 8 * 1e6 / (4 * 0.5e7))
  assert cm.kv_migration_s(4e6, 2, cross_node=True, itemsize=2) == pytest.approx(2e6 / 0.5e7)


def test_collectives_follow_nccls_alpha_beta_model():
  """NVIDIA presets: NCCL's Ring latencies (hardware.NCCL_RING), the cheaper protocol wins."""
  cm = CostModel(get_hardware("h100_sxm"), Efficiency(net_eff=1.0))
  nvlink, net = 450e9, 50e9
  # 8 GPUs of one node, a small all-reduce (a decode step's activations): LL, 14 ring steps.
  assert cm.allreduce_s(1e3, 8) == pytest.approx(
      6.6e-6 + 14 * 0.6e-6 + 2 * 7 / 8 * 1e3 / (nvlink / 4))
  # A large one: Simple at the full bandwidth.
  assert cm.allreduce_s(1e9, 8) == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * 1e9 / nvlink)
  # 16 GPUs on 2 nodes: 30 steps, 2 x 2 of them across nodes, at the 8 NICs' bandwidth per
  # node (one ring channel per NIC; below NVLink's).
  assert cm.allreduce_s(1e9, 16) == pytest.approx(
      8.4e-6 + 26 * 3.4e-6 + 4 * 14e-6 + 2 * 15 / 16 * 1e9 / (8 * net))
  # All-gather: g - 1 steps, nodes - 1 across; point to point: one step.
  assert cm.allgather_s(1e9, 16) == pytest.approx(
      8.4e-6 + 14 * 3.4e-6 + 14e-6 + 15 / 16 * 1e9 / (8 * net))
  assert cm.p2p_s(1e3, True) == pytest.approx(6.6e-6 + 2.7e-6 + 1e3 / (net / 4))
  # LL inside one node outside an all-reduce: a third of the bandwidth (NCCL's model).
  assert cm.allgather_s(1e3, 8) == pytest.approx(6.6e-6 + 7 * 0.6e-6 + 7 / 8 * 1e3 / (nvlink / 3))
  assert cm.p2p_s(1e3, False) == pytest.approx(6.6e-6 + 0.6e-6 + 1e3 / (nvlink / 3))
  assert cm.p2p_s(1e8, False) == pytest.approx(8.4e-6 + 3.4e-6 + 1e8 / nvlink)
  # The gradient all-reduce of dp = 4 ranks 8 devices apart spans 4 nodes, one rank (one NIC)
  # in each.
  s = get_shape("llama-13b")
  nbytes = s.num_params() * 2.0 / (8 * 2)
  assert cm.grad_sync_s(s, 8, 2, 4) == pytest.approx(
      8.4e-6 + 0 * 3.4e-6 + 6 * 14e-6 + 2 * 3 / 4 * nbytes / net)
  # Latency grows with the ring at a fixed size; vectorised like the decode steps.
  assert cm.allreduce_s(1e3, 4) < cm.allreduce_s(1e3, 8)
  got = cm.allreduce_s(np.array([1e3, 1e9]), 8)
  assert got[0] == pytest.approx(cm.allreduce_s(1e3, 8)) and got[1] == pytest.approx(
      cm.allreduce_s(1e9, 8))
  # TPU presets have no cited per-step latency: bandwidth + the one collective_latency_s.
  tpu = CostModel(get_hardware("tpu_v5p"), Efficiency(net_eff=1.0, collective_latency_s=7e-6))
  assert tpu.allreduce_s(1e6, 8) == pytest.approx(2 * 7 / 8 * 1e6 / 600e9 + 7e-6)


def test_memory_check_names_the_plan():
  cm = CostModel(get_hardware("a100_80g_sxm"))
  with pytest.raises(ValueError, match="does not fit in memory.*tp=1"):
    cm.check_fits("generation of llama-65b", 130e9, "tp=1")


def _cal(**ops):
  return {"format": calibration.FORMAT, "device": "test", "ops": ops}


def test_calibration_replaces_formulas(tmp_path):
  path = tmp_path / "cal.json"
  path.write_text(json.dumps(_cal(
      decode_step={"occupied_slots": [1, 4], "seconds": [0.01, 0.02]},
      prefill={"tokens_per_s": 1000.0, "overhead_s": 0.5},
      migration={"bytes_per_s": 1e6})))
  cal = calibration.load(str(path))
  cm = CostModel(get_hardware("h100_sxm"), calibration=cal)
  s = get_shape("llama-13b")
  assert cm.decode_step_s(s, 8, 1, 999) == pytest.approx(0.01)
  assert cm.decode_step_s(s, 8, 2.5, 0) == pytest.approx(0.015)  # linear in occupied slots
  assert cm.decode_step_s(s, 8, 10, 0) == pytest.approx(0.02)  # clamped at the measured end
  assert cm.prefill_s(s, 8, [100, 100]) == pytest.approx(0.7)
  assert cm.kv_migration_s(2e6, 8, True, 2) == pytest.approx(2.0)
  # Ops the file does not measure keep their formula.
  assert cm.inference_s([s], 8, [100]) == CostModel(get_hardware("h100_sxm")).inference_s(
      [s], 8, [100])


@pytest.mark.parametrize("obj,msg", [
    ({"format": "v0", "device": "x", "ops": {}}, "format"),
    (_cal(decode={"x": 1}), "unknown keys"),
    (_cal(decode_step={"occupied_slots": [2, 1], "seconds": [1, 1]}), "strictly increasing"),
    (_cal(prefill={"tokens_per_s": -1}), "tokens_per_s"),
    (_cal(prefill={"tokens_per_second": 1}), "unknown keys"),
    ({"format": calibration.FORMAT, "ops": {}}, "missing keys.*device"),
    # JSON true is a Python int: refused as parallel_tasks already was, not read as 1.
    ({**_cal(), "model_params": True}, "model_params=True must be a positive int"),
    ({**_cal(), "instance_devices": True}, "instance_devices=True must be a positive int"),
])
def test_calibration_errors_are_clear(obj, msg):
  with pytest.raises(ValueError, match=msg):
    calibration.from_dict(obj, "cal.json")


def test_a_calibration_file_with_a_key_given_twice_is_refused_naming_it(tmp_path):
  """json.load kept the last: a hand-edited file's first figure was silently ignored."""
  path = tmp_path / "cal.json"
  path.write_text(json.dumps(_cal(prefill={"tokens_per_s": 1000.0})).replace(
      '"tokens_per_s": 1000.0', '"tokens_per_s": 1000.0, "tokens_per_s": 2000.0'))
  with pytest.raises(ValueError, match=r"calibration .*cal\.json: the key 'tokens_per_s' "
                                       r"appears twice"):
    calibration.load(str(path))


def test_a_measured_table_times_only_the_split_it_was_measured_at():
  """A decode_step table is one instance's (instance_devices wide) and a train_stage one
  stage's of the split measured (its per-stage lists' length): both timed every tp and pp a plan
  search tried, as if 4 stages of a model took as long each as 2 stages did. Now the split is
  checked where it is known; the measured split itself, and files that do not say, as before."""
  s = get_shape("llama-13b")
  cal = calibration.from_dict({**_cal(
      decode_step={"occupied_slots": [1, 4], "seconds": [0.01, 0.02]},
      train_stage={"actor_fwd_s": 0.2, "critic_fwd_s": 0.1,
                   "actor_fwd_per_stage_s": [0.2, 0.2], "actor_bwd_per_stage_s": [0.4, 0.4]}),
      "instance_devices": 2}, "cal.json")
  cm = CostModel(get_hardware("h100_sxm"), calibration=cal)
  assert cm.decode_step_s(s, 2, 1, 0) == pytest.approx(0.01)
  with pytest.raises(ValueError, match=r"cal\.json.*instances of 2 device\(s\).*tp=4"):
    cm.decode_step_s(s, 4, 1, 0)
  assert cm.train_stage_fwd_s(s, 1, 2, 256, 128, "actor") == pytest.approx(0.2)
  with pytest.raises(ValueError, match=r"cal\.json.*actor in 2 pipeline stages.*pp=4"):
    cm.train_stage_fwd_s(s, 1, 4, 256, 128, "actor")
  # The critic's split was not measured per stage: its scalar times any pp, as before.
  assert cm.train_stage_fwd_s(s, 1, 4, 256, 128, "critic") == pytest.approx(0.1)
  unsaid = calibration.from_dict(_cal(decode_step={"occupied_slots": [1], "seconds": [0.01]}),
                                 "cal.json")
  assert CostModel(get_hardware("h100_sxm"), calibration=unsaid).decode_step_s(
      s, 8, 1, 0) == pytest.approx(0.01)


def test_a_measured_training_stage_times_other_layouts_by_the_formulas_ratio():
  """train_stage with the timed micro-batch (tokens, seq_len; bench_decode writes them): at the
  measured layout (1 device, 1 stage, 8 x 512 tokens) the measured forward and backward; at
  another the measured times x the formulas' ratio of the two layouts, the backward by the same
  factor as its forward. Taken as they were, a 1-sample micro-batch on a quarter of the model
  cost as much as the 8 x 512 measured, and a plan search preferred tp 1, pp 1. A file without
  the micro-batch keeps its times for every layout, as before."""
  s = get_shape("llama-7b")
  hw = get_hardware("h100_sxm")
  f = CostModel(hw)
  cal = calibration.from_dict({**_cal(train_stage={
      "actor_fwd_s": 0.3, "critic_fwd_s": 0.2, "actor_bwd_s": 0.7, "bwd_over_fwd": 2.5,
      "tokens": 4096, "seq_len": 512}), "instance_devices": 1}, "cal.json")
  cm = CostModel(hw, calibration=cal)
  ctx = (512 + 1) / 2
  assert cm.train_stage_fwd_s(s, 1, 1, 4096, ctx, "actor") == pytest.approx(0.3)
  assert cm.train_stage_bwd_s(0.3, "actor") == pytest.approx(0.7)
  for tp, pp, tokens in ((2, 2, 512), (1, 1, 512), (8, 4, 4096)):
    ratio = (f.train_stage_fwd_s(s, tp, pp, tokens, ctx) /
             f.train_stage_fwd_s(s, 1, 1, 4096, ctx))
    assert 0 < ratio < 0.5, (tp, pp, tokens)
    for model, measured in (("actor", 0.3), ("critic", 0.2)):
      fwd = cm.train_stage_fwd_s(s, tp, pp, tokens, ctx, model)
      assert fwd == pytest.approx(measured * ratio), (tp, pp, tokens, model)
    assert cm.train_stage_bwd_s(cm.train_stage_fwd_s(s, tp, pp, tokens, ctx), "actor") == \
        pytest.approx(0.7 * ratio)
    # No measured critic backward: the file's ratio times the scaled forward.
    assert cm.train_stage_bwd_s(0.2 * ratio, "critic") == pytest.approx(2.5 * 0.2 * ratio)
  # The measured side of the ratio: its context ((seq_len + 1) / 2, not the one asked) and
  # its instance width (instance_devices).
  for asked_ctx in (100.0, 1000.0):
    want = 0.3 * (f.train_stage_fwd_s(s, 2, 1, 2048, asked_ctx) /
                  f.train_stage_fwd_s(s, 1, 1, 4096, ctx))
    assert cm.train_stage_fwd_s(s, 2, 1, 2048, asked_ctx) == pytest.approx(want)
  wide = calibration.from_dict({**_cal(train_stage={
      "actor_fwd_s": 0.3, "critic_fwd_s": 0.2, "tokens": 4096, "seq_len": 512}),
      "instance_devices": 4}, "cal.json")
  cw = CostModel(hw, calibration=wide)
  assert cw.train_stage_fwd_s(s, 4, 1, 4096, ctx) == pytest.approx(0.3)
  assert cw.train_stage_fwd_s(s, 1, 1, 4096, ctx) == pytest.approx(
      0.3 * f.train_stage_fwd_s(s, 1, 1, 4096, ctx) / f.train_stage_fwd_s(s, 4, 1, 4096, ctx))
  old = calibration.from_dict(_cal(train_stage={"actor_fwd_s": 0.3, "critic_fwd_s": 0.2}),
                              "cal.json")
  assert CostModel(hw, calibration=old).train_stage_fwd_s(s, 2, 2, 512, ctx) == 0.3
  with pytest.raises(ValueError, match=r"cal\.json ops\.train_stage.*tokens and seq_len come "
                                       r"together"):
    calibration.from_dict(_cal(train_stage={"actor_fwd_s": 0.3, "critic_fwd_s": 0.2,
                                            "tokens": 4096}), "cal.json")


def test_a_pipeline_stage_pays_its_share_of_the_measured_whole_models_times():
  """A calibration's decode step, prefill and inference are the measured model's, whole: a
  pp-stage pipeline's stage (plan_search.stage_shape) was charged all of it, so pipelined
  generation at pp 2 cost twice the instances'. plan_search.stage_cost scales them by the
  formulas' stage share; ops the file does not measure (formulas, a decode_fit) are the stage's
  own already; pipelined generation and the inference stage time their stages through it."""
  from rlhfuse_jax.sim import plan_search
  hw = get_hardware("h100_sxm")
  a, c = get_shape("llama-7b"), get_shape("llama-7b", "scalar")
  cal = calibration.from_dict(_cal(decode_step={"occupied_slots": [1, 64],
                                                "seconds": [0.01, 0.02]},
                                   prefill={"tokens_per_s": 1e5},
                                   inference={"tokens_per_s": 2e5}), "cal.json")
  cm, f = CostModel(hw, calibration=cal), CostModel(hw)
  st = plan_search.stage_shape(a, 4)
  rows, ctx = np.array([0.0, 1.0, 64.0]), np.array([0.0, 100.0, 6400.0])
  got = plan_search.stage_cost(cm, "decode_step_s", st, a, 2, rows, ctx)
  share = f.decode_step_s(st, 2, rows[1:], ctx[1:]) / f.decode_step_s(a, 2, rows[1:], ctx[1:])
  assert np.all((share > 0.2) & (share < 0.5)), share  # about a quarter of the layers
  np.testing.assert_allclose(got, [0.0, *(cm.decode_step_s(a, 2, rows[1:], ctx[1:]) * share)])
  lens = np.array([300.0, 500.0])
  assert plan_search.stage_cost(cm, "prefill_s", st, a, 2, lens) == pytest.approx(
      cm.prefill_s(a, 2, lens) * f.prefill_s(st, 2, lens) / f.prefill_s(a, 2, lens))
  stages = [plan_search.stage_shape(m, 4) for m in (a, c)]
  assert plan_search.stage_cost(cm, "inference_s", stages, [a, c], 2, lens) == pytest.approx(
      cm.inference_s([a, c], 2, lens) * f.inference_s(stages, 2, lens)
      / f.inference_s([a, c], 2, lens))
  # Not measured: the formulas, the stage's own.
  assert plan_search.stage_cost(f, "prefill_s", st, a, 2, lens) == f.prefill_s(st, 2, lens)
  seen = []
  real = plan_search.stage_cost
  try:
    plan_search.stage_cost = lambda cost, op, *rest: seen.append(op) or real(cost, op, *rest)
    plan_search.pipelined_generation(cm, a, 8, 2, 2, 2, np.array([100, 120, 90, 80]),
                                     np.array([30, 5, 12, 7]), 32)
    plan_search.inference_stage_s(cm, (a, c), 8, 2, 2, lens, 1, False)
  finally:
    plan_search.stage_cost = real
  assert {"decode_step_s", "prefill_s", "inference_s"} <= set(seen), seen


def test_a_measured_prefill_and_inference_time_other_widths_by_the_formulas_ratio():
  """A file's prefill and inference rates are those of an instance of instance_devices: at
  another tp the measured time x the formulas' ratio of the two widths, as a training stage is
  scaled. They were charged as measured at every width: a plan search's inference cost the same
  at tp 1, 2 and 4. A file that does not say its width: as measured at every width."""
  hw = get_hardware("h100_sxm")
  a, c = get_shape("llama-7b"), get_shape("llama-7b", "scalar")
  ops = {"prefill": {"tokens_per_s": 1e5}, "inference": {"tokens_per_s": 2e5}}
  cal = calibration.from_dict({**_cal(**ops), "instance_devices": 1}, "cal.json")
  cm, f = CostModel(hw, calibration=cal), CostModel(hw)
  lens = np.array([300.0, 500.0])
  assert cm.prefill_s(a, 1, lens) == pytest.approx(800 / 1e5)
  assert cm.inference_s([a, c], 1, lens) == pytest.approx(800 / 2e5)
  for tp in (2, 4):
    assert cm.prefill_s(a, tp, lens) == pytest.approx(
        800 / 1e5 * f.prefill_s(a, tp, lens) / f.prefill_s(a, 1, lens))
    assert cm.inference_s([a, c], tp, lens) == pytest.approx(
        800 / 2e5 * f.inference_s([a, c], tp, lens) / f.inference_s([a, c], 1, lens))
  assert cm.inference_s([a, c], 4, lens) < 0.5 * cm.inference_s([a, c], 1, lens)
  unsaid = CostModel(hw, calibration=calibration.from_dict(_cal(**ops), "cal.json"))
  assert unsaid.inference_s([a, c], 4, lens) == pytest.approx(800 / 2e5)


def test_a_shared_processor_calibration_serialises_pipelines_and_inference_as_instances():
  """With a file measured on devices that share one processor (devices_share_compute),
  generation_sim runs instances one task at a time; pipelined generation's replicas and the
  inference replicas ran side by side, so a plan search compared instances at 5x a pipeline of
  the same work. Now every stage's every task is summed; dedicated devices as before."""
  from rlhfuse_jax.sim import plan_search
  hw = get_hardware("h100_sxm")
  a, c = get_shape("llama-7b"), get_shape("llama-7b", "scalar")
  ops = {"prefill": {"tokens_per_s": 1e5}, "inference": {"tokens_per_s": 2e5}}
  shared = CostModel(hw, calibration=calibration.from_dict(
      {**_cal(**ops), "devices_share_compute": True}, "cal.json"))
  dedicated = CostModel(hw, calibration=calibration.from_dict(_cal(**ops), "cal.json"))
  prompts, resp = np.array([100, 120, 90, 80]), np.array([30, 5, 12, 7])
  # pp 1, one group: each replica's total is its own work; shared, the replicas' sum
  per_rep = [plan_search.pipelined_generation(dedicated, a, 1, 1, 1, 1, prompts[r::4],
                                              resp[r::4], 32)["gen_s"] for r in range(4)]
  together = plan_search.pipelined_generation(dedicated, a, 4, 1, 1, 1, prompts, resp, 32)
  assert together["gen_s"] == pytest.approx(max(per_rep))
  got = plan_search.pipelined_generation(shared, a, 4, 1, 1, 1, prompts, resp, 32)
  assert got["gen_s"] == pytest.approx(sum(per_rep))
  assert got["gen_s"] == pytest.approx(got["prefill_s"] + got["decode_s"])
  # pp 2: both stages' work, one after the other
  two = plan_search.pipelined_generation(shared, a, 4, 1, 2, 2, prompts, resp, 32)
  assert two["gen_s"] > plan_search.pipelined_generation(dedicated, a, 4, 1, 2, 2, prompts,
                                                         resp, 32)["gen_s"]
  lens = np.array([300.0, 500.0, 200.0, 100.0])
  mbs = sum(shared.inference_s([a, c], 1, lens[i:i + 1]) for i in range(4))
  assert plan_search.inference_stage_s(shared, (a, c), 4, 1, 1, lens, 1, False) == (
      pytest.approx(mbs))
  assert plan_search.inference_stage_s(dedicated, (a, c), 4, 1, 1, lens, 1, False) == (
      pytest.approx(max(dedicated.inference_s([a, c], 1, lens[i:i + 1]) for i in range(4))))


def test_an_unmeasured_backward_is_the_files_bwd_over_fwd_times_the_forward():
  """Without a measured backward, a stage's backward is bwd_over_fwd x its forward with the
  ratio the file gives (3.0 here: 0.5 s -> 1.5 s per stage), not the default 2.0; a measured
  backward still wins. The pipeline simulators read every backward duration from here."""
  ts = calibration.TrainStage(actor_fwd_s=0.5, critic_fwd_s=0.25, bwd_over_fwd=3.0,
                              critic_bwd_s=0.4)
  fwd, bwd = ts.stage_times("actor", 3)
  np.testing.assert_allclose(fwd, [0.5, 0.5, 0.5])
  np.testing.assert_allclose(bwd, [1.5, 1.5, 1.5])
  np.testing.assert_allclose(ts.stage_times("critic", 2)[1], [0.4, 0.4])


def test_a_decode_fit_at_full_efficiency_loads_and_one_above_is_refused():
  """mfu and bw_eff are fractions in (0, 1] (module docstring): exactly 1.0, a roofline-perfect
  fit, is a legal file and loads as written; 1.01 is refused naming the key."""
  fit = {"step_s": 0.0, "layer_s": 1e-5, "mfu": 1.0, "bw_eff": 1.0}
  cal = calibration.from_dict(_cal(decode_fit=fit), "cal.json")
  assert cal.decode_fit.mfu == 1.0 and cal.decode_fit.bw_eff == 1.0
  with pytest.raises(ValueError, match=r"bw_eff=1.01 must be a fraction in \(0, 1\]"):
    calibration.from_dict(_cal(decode_fit={**fit, "bw_eff": 1.01}), "cal.json")


def test_the_executors_step_overhead_is_read_from_the_file():
  """pipeline_executor's step_overhead_s (optional, default 0) is the file's figure once given:
  the lockstep pipeline model adds it to every training step it simulates."""
  cal = calibration.from_dict(_cal(pipeline_executor={"tick_overhead_s": 0.001,
                                                      "step_overhead_s": 0.25}), "cal.json")
  assert cal.pipeline_executor == calibration.ExecutorCost(0.001, 0.25)
  bare = calibration.from_dict(_cal(pipeline_executor={"tick_overhead_s": 0.001}), "cal.json")
  assert bare.pipeline_executor.step_overhead_s == 0.0


def test_lengths_seeded_clipped_and_described():
  spec = lengths.LengthSpec(kind="lognormal", median=100, sigma=1.0, max_len=300)
  a = spec.sample(np.random.default_rng(3), 2000)
  b = spec.sample(np.random.default_rng(3), 2000)
  assert np.array_equal(a, b) and a.min() >= 1 and a.max() == 300
  assert 80 < np.median(a) < 120
  assert "lognormal" in spec.describe()
  assert np.all(lengths.LengthSpec(kind="constant", value=7, max_len=9).sample(
      np.random.default_rng(0), 5) == 7)
  p = lengths.LengthSpec(kind="pareto", alpha=1.2, min_len=10, max_len=1000)
  x = p.sample(np.random.default_rng(0), 5000)
  assert x.min() >= 10 and np.mean(x >= 1000) > 0.001  # a real power-law tail
  # uniform: every length of [min_len, max_len], both ends included; one length, and a constant
  # at max_len, are valid.
  u = lengths.LengthSpec(kind="uniform", min_len=3, max_len=9).sample(
      np.random.default_rng(0), 2000)
  assert set(u.tolist()) == set(range(3, 10))
  assert set(lengths.LengthSpec(kind="uniform", min_len=5, max_len=5).sample(
      np.random.default_rng(0), 10).tolist()) == {5}
  assert np.all(lengths.LengthSpec(kind="constant", value=9, min_len=9, max_len=9).sample(
      np.random.default_rng(0), 3) == 9)
  with pytest.raises(ValueError, match="kind"):
    lengths.LengthSpec(kind="gamma")
  for bad, match in (({"median": 0.0}, r"median=0\.0 > 0"), ({"sigma": 0.0}, r"sigma=0\.0 > 0"),
                     ({"kind": "pareto", "alpha": 0.0}, r"alpha=0\.0 > 0")):
    with pytest.raises(ValueError, match=match):
      lengths.LengthSpec(**{"kind": "lognormal", **bad})
  # An infinite median was taken (its sigma was checked for finiteness, it was not): every
  # sample then sat at max_len.
  with pytest.raises(ValueError, match="median=inf > 0 and sigma=.* both finite"):
    lengths.LengthSpec(kind="lognormal", median=float("inf"))


def test_empirical_lengths_from_files(tmp_path):
  (tmp_path / "a.json").write_text(json.dumps([5, 6, 7]))
  (tmp_path / "h.json").write_text(json.dumps({"bins": [10, 20], "counts": [3, 1]}))
  np.save(tmp_path / "c.npy", np.array([1, 2, 3]))
  (tmp_path / "m.jsonl").write_text(
      json.dumps({"step": 1, "gen/response_lengths": [4, 9]}) + "\n" +
      json.dumps({"step": 2, "gen/response_lengths": [8]}) + "\n")
  assert lengths.load_lengths(str(tmp_path / "a.json")).tolist() == [5, 6, 7]
  assert lengths.load_lengths(str(tmp_path / "h.json")).tolist() == [10, 10, 10, 20]
  assert lengths.load_lengths(str(tmp_path / "c.npy")).tolist() == [1, 2, 3]
  assert lengths.load_lengths(str(tmp_path / "m.jsonl")).tolist() == [4, 9, 8]
  spec = lengths.LengthSpec(kind="empirical", path=str(tmp_path / "m.jsonl"), max_len=8)
  assert set(spec.sample(np.random.default_rng(0), 50).tolist()) <= {4, 8}
  # train_ppo's metrics.jsonl holds only aggregates today: the error says so.
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"response_length/mean": 3.0}) + "\n")
  with pytest.raises(ValueError, match="only aggregates"):
    lengths.load_lengths(str(tmp_path / "metrics.jsonl"))
  (tmp_path / "bad.json").write_text(json.dumps([1, 0]))
  with pytest.raises(ValueError, match="integers >= 1"):
    lengths.load_lengths(str(tmp_path / "bad.json"))
  # An empty .npy was numpy's EOFError traceback.
  (tmp_path / "e.npy").write_bytes(b"")
  with pytest.raises(ValueError, match=r"e\.npy': not a readable \.npy array"):
    lengths.load_lengths(str(tmp_path / "e.npy"))
  # A path beside another kind was ignored without a word (the run's lengths file given, and
  # log-normal lengths simulated).
  with pytest.raises(ValueError, match=r"path='.*m\.jsonl' is read only with kind='empirical' "
                                       r"\(kind='lognormal' draws its own lengths\)"):
    lengths.LengthSpec(path=str(tmp_path / "m.jsonl"))


def test_a_lengths_file_is_read_once_per_version(tmp_path, monkeypatch):
  """A plan search samples the workload's lengths for every combination it checks: the file
  is parsed once, and again only once it has changed; the array is shared, so read-only."""
  path = tmp_path / "m.jsonl"
  path.write_text(json.dumps({"gen/response_lengths": [4, 9]}) + "\n")
  parsed = []
  real = lengths._from_jsonl
  monkeypatch.setattr(lengths, "_from_jsonl", lambda p: parsed.append(p) or real(p))
  spec = lengths.LengthSpec(kind="empirical", path=str(path), max_len=16)
  for seed in range(3):
    assert set(spec.sample(np.random.default_rng(seed), 20).tolist()) <= {4, 9}
  assert len(parsed) == 1
  out = lengths.load_lengths(str(path))
  with pytest.raises(ValueError, match="read-only"):
    out[0] = 1
  path.write_text(json.dumps({"gen/response_lengths": [5, 6, 7]}) + "\n")  # another size
  assert lengths.load_lengths(str(path)).tolist() == [5, 6, 7] and len(parsed) == 2


def test_empirical_lengths_files_with_bad_content_are_named(tmp_path):
  """A .txt with a header line was "could not convert string to float" naming no file; a
  histogram's fractional counts were cut to whole ones silently (2.5 -> 2: the lengths drawn
  changed); a .jsonl line holding a bare number was a TypeError."""
  (tmp_path / "l.txt").write_text("length\n12\n30\n")
  with pytest.raises(ValueError, match=r"l.txt.*'length' is not a number"):
    lengths.load_lengths(str(tmp_path / "l.txt"))
  (tmp_path / "h.json").write_text(json.dumps({"bins": [10, 20], "counts": [2.5, 1]}))
  with pytest.raises(ValueError, match="whole numbers of samples"):
    lengths.load_lengths(str(tmp_path / "h.json"))
  (tmp_path / "h2.json").write_text(json.dumps({"bins": [10, 20], "counts": [2.0, 1]}))
  assert lengths.load_lengths(str(tmp_path / "h2.json")).tolist() == [10, 10, 20]
  (tmp_path / "b.jsonl").write_text('5\n{"lengths": [3]}\n')
  with pytest.raises(ValueError, match=r"b.jsonl:1: expected one JSON object per line"):
    lengths.load_lengths(str(tmp_path / "b.jsonl"))


def test_calibrate_sim_writes_what_the_cost_model_reads(tmp_path):
  """calibrate_sim's real output (a short run, ~15 s) loads as a calibration whose measured ops
  replace the cost model's formulas exactly: the decode table at each measured occupancy,
  prefill and inference throughput, migration bandwidth; the device and the share flag as
  measured."""
  from tests.test_pipeline_experiments import _run
  out = _run(["experiments.calibrate_sim", "--config=configs/calibrate_sim.py",
              f"--workdir={tmp_path}", "--config.repeats=3", "--config.max_new_tokens=16",
              "--config.chunk_size=32", "--config.occupancies=1,8"])
  assert out.returncode == 0, out.stderr[-3000:]
  # A chunk of 32 from a fresh prefill runs the 15 steps left of the budget of 16, and the
  # step is its time over those (it was over 32).
  assert out.stderr.count("(15 steps per chunk)") == 2, out.stderr[-3000:]
  raw = json.loads((tmp_path / "calibration.json").read_text())
  cal = calibration.load(str(tmp_path / "calibration.json"))
  assert cal.devices_share_compute is True and "calibrate_sim" in cal.device
  # Where and when (it said only "cpu x8", the fake devices): the writer's provenance.
  measured = cal.describe()["measured"]
  assert set(measured) == {"date", "git_commit", "host_cpu", "jax"}, measured
  assert calibration.to_dict(cal)["provenance"] == raw["provenance"]
  # result.json too, as every binary's (a sweep read none: no figures, measured again on every
  # re-run), holding the measured ops and naming the file.
  result = json.loads((tmp_path / "result.json").read_text())
  assert result["ops"] == raw["ops"] and result["calibration"] == "calibration.json"
  assert wd.workdir_writer(str(tmp_path)) == "calibrate_sim"
  ops = raw["ops"]
  assert ops["decode_step"]["occupied_slots"] == [1, 8]
  cost = CostModel(get_hardware("h100_sxm"), calibration=cal)
  shape = get_shape("llama-7b")  # any shape: measured ops never consult it
  for occ, sec in zip(ops["decode_step"]["occupied_slots"], ops["decode_step"]["seconds"]):
    assert sec > 0 and float(cost.decode_step_s(shape, 1, occ, 0.0)) == pytest.approx(sec)
  assert cost.prefill_s(shape, 1, [16, 16]) == pytest.approx(
      32 / ops["prefill"]["tokens_per_s"])
  assert cost.inference_s([shape], 1, [32]) == pytest.approx(
      32 / ops["inference"]["tokens_per_s"])
  assert cal.byte_unit == "stored"
  assert cost.kv_migration_s(1e6, 1, False, 4) == pytest.approx(
      1e6 / ops["migration"]["bytes_per_s"])
  # The rate is of the bytes copied (byte_unit "stored"): 4 rows of max_len 32 of the config's
  # model, K and V at its float32 cache's 4 bytes an element (bf16's 2 until 2026-12-04).
  model = ModelShape(name="cal", vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, kv_itemsize=4)
  assert f"migration of 4 KV rows: {4 * 32 * model.kv_bytes_per_token()} bytes" in out.stderr


def test_decode_host_overhead_stretches_the_uncalibrated_step_only():
  """configs/ablations.py:vllm_sync: each decode step also waits for 29/38 of its device time."""
  from configs import ablations as ablation_config
  from rlhfuse_jax.sim.ablations import AblationConfig
  eff = AblationConfig.from_config_dict(ablation_config.get_config("vllm_sync")).efficiency
  assert eff.decode_host_overhead == pytest.approx(29 / 38)
  hw, s = get_hardware("h100_sxm"), get_shape("llama-13b")
  base, slow = CostModel(hw), CostModel(hw, eff)
  assert slow.decode_step_s(s, 4, 16, 16 * 500) == pytest.approx(
      base.decode_step_s(s, 4, 16, 16 * 500) * (1 + 29 / 38))
  assert slow.prefill_s(s, 4, [500]) == base.prefill_s(s, 4, [500])  # decode steps only
  with pytest.raises(ValueError, match="decode_host_overhead=-0.1"):
    Efficiency(decode_host_overhead=-0.1)


@pytest.mark.parametrize("field, value", [
    ("collective_latency_s", float("nan")),
    ("bwd_over_fwd", float("nan")), ("bwd_over_fwd", float("inf")),
    ("act_bytes_per_token_layer_per_h", float("nan")),
    ("act_bytes_per_token_layer_per_h", -34.0)])
def test_efficiencies_that_are_not_numbers_are_refused_by_name(field, value):
  """A NaN passed `x < 0` checks: NaN latencies and backwards surfaced as a pipeline problem's
  actor_fwd=nan, and a NaN or negative activation size let every plan pass the memory check."""
  with pytest.raises(ValueError, match=rf"^config\.efficiency\.{field}="):
    Efficiency(**{field: value})


@pytest.mark.parametrize("flag, message", [
    ("train_mfu=2", "config.efficiency.train_mfu=2.0 must be in (0, 1]"),
    ("decode_host_overhead=-1", "config.efficiency.decode_host_overhead=-1.0 must be a fraction"),
    ("bwd_over_fwd=0", "config.efficiency.bwd_over_fwd=0.0 must be a finite number > 0")])
def test_efficiency_errors_name_the_field_as_the_user_types_it(flag, message):
  """--config.efficiency.X=... was refused as "efficiency.X=...": the field the user types is
  config.efficiency.X (reproduce_ablations, plan_search)."""
  from configs import ablations as ablation_config
  from rlhfuse_jax.sim.ablations import AblationConfig
  c = ablation_config.get_config()
  field, value = flag.split("=")
  c.efficiency[field] = float(value)
  with pytest.raises(ValueError) as e:
    AblationConfig.from_config_dict(c)
  assert str(e.value).startswith(message), str(e.value)


def test_hops_across_nodes_follow_the_layout():
  """Which neighbour hops of a chain cross a node boundary (nodes of 8, consecutive numbering):
  stages 4 devices apart cross at every second hop, 8 apart at every hop, 2 apart at every
  fourth, and a hop crosses if any of its shards does; a mean hop mixes the two links' times by
  that share."""
  from rlhfuse_jax.sim.cost_model import crossing_share, same_node
  assert same_node(4, 7, 8) and not same_node(7, 8, 8)
  assert crossing_share(4, 3, 8) == pytest.approx(1 / 3)  # hops 4->8 cross; 0->4, 8->12 not
  assert crossing_share(8, 3, 8) == 1.0 and crossing_share(2, 4, 8) == pytest.approx(1 / 4)
  # Groups of 3: hop 0 (0..2 -> 3..5) stays, hop 1 (3..5 -> 6..8) has shard 5 -> 8 crossing,
  # and a hop lasts as long as its slowest shard.
  assert crossing_share(3, 2, 8) == pytest.approx(1 / 2)
  assert crossing_share(6, 1, 8) == 1.0  # shards 2..5 of 0..5 -> 6..11 cross
  assert crossing_share(4, 0, 8) == 0.0
  cm = CostModel(get_hardware("h100_sxm"))
  assert cm.hop_s(1e6, 0.25) == pytest.approx(0.25 * cm.p2p_s(1e6, True) +
                                              0.75 * cm.p2p_s(1e6, False))
  assert cm.hop_s(1e6, 1.0) == cm.p2p_s(1e6, True) and cm.hop_s(1e6, 0) == cm.p2p_s(1e6, False)


def test_measured_backwards_reach_the_pipeline_problem():
  """A calibration's measured actor_bwd_s / critic_bwd_s are the problem's backward durations
  (they were bwd_over_fwd x forward, the ratio pooled over both models: 80 / 20 ms became
  66.7 / 33.3 ms); without them the ratio applies."""
  from rlhfuse_jax.sim import training_sim  # pylint: disable=import-outside-toplevel
  a, c = get_shape("llama-7b"), get_shape("llama-7b", "scalar")
  plan = training_sim.TrainPlan(8, 8, 1, 4, 4)
  ratio = (0.08 + 0.02) / (0.02 + 0.01)  # as bench_pipeline writes it
  for bwd, expected in (((0.08, 0.02), (80.0, 20.0)), ((None, None), (20 * ratio, 10 * ratio))):
    stage = calibration.TrainStage(actor_fwd_s=0.02, critic_fwd_s=0.01, actor_bwd_s=bwd[0],
                                   critic_bwd_s=bwd[1], bwd_over_fwd=ratio)
    cost = CostModel(get_hardware("h100_sxm"),
                     calibration=calibration.Calibration(device="x", train_stage=stage))
    p = training_sim.step_costs(cost, a, c, plan, 512, check_memory=False).problem
    assert (p.actor_fwd, p.critic_fwd) == (20.0, 10.0)
    assert (p.actor_bwd, p.critic_bwd) == pytest.approx(expected, abs=1e-6)  # ms, 6 decimals


def test_optimizer_step_and_activation_memory_by_hand():
  """The two per-parameter and per-token constants of the module docstring, by hand on the toy:
  Adam touches 28 bytes a parameter (fp32 master, m and v each read and written, the bf16
  gradient read and the bf16 weight written) over the device's shard at hbm_bw x decode_bw_eff;
  an in-flight micro-batch keeps 34 h bytes a token a layer (Korthikanti et al. 2022, Table 2:
  tensor + sequence parallel, selective recomputation), split over the tp devices."""
  cm = CostModel(TOY_HW, EFF)
  touched = 3 * (4 + 4) + 2 + 2
  assert cm.optimizer_step_s(TOY, 4) == pytest.approx(touched * TOY.num_params() / 4 / 0.5e9)
  tp, pp, tokens = 2, 2, 8.0
  held = [cm.train_memory_bytes(TOY, tp, pp, 1, False, tokens, k) for k in (0, 3)]
  layers = TOY.num_layers / pp
  assert held[1] - held[0] == pytest.approx(3 * 34 * 16 * tokens * layers / tp)


def test_a_group_that_spills_into_another_node_spans_both():
  """nodes_spanned rounds up: 9 or 12 consecutive devices on nodes of 8 occupy two nodes (their
  collectives pay NCCL's inter-node steps and ride the NICs), 17 three; a group never spans
  fewer than one node."""
  hw = get_hardware("h100_sxm")
  assert [hw.nodes_spanned(g) for g in (0, 1, 8, 9, 12, 16, 17)] == [1, 1, 1, 2, 2, 2, 3]


def test_a_group_spread_unevenly_over_nodes_goes_at_its_emptiest_nodes_pace():
  """12 consecutive H100s, nodes of 8: 8 members on one node, 4 on the other. Across nodes each
  byte leaves every node through its members' NICs, so the node with 4 sets the pace: 4 x 50
  GB/s, not 8 x 50 (Hardware.link_bw, which plans' collectives use, gave the fuller node's 8).
  The same all-reduce priced by the analytic path and by a compiled program's member list
  (CostModel.group_collective_s) must agree; power-of-two groups keep their figures."""
  hw = get_hardware("h100_sxm")
  assert hw.link_bw(12) == 4 * hw.inter_node_bw
  assert hw.link_bw(16) == 8 * hw.inter_node_bw and hw.link_bw(8) == hw.intra_node_bw
  assert hw.link_bw(8, stride=2) == 4 * hw.inter_node_bw  # 0, 2, .., 14: 4 per node
  assert hw.link_bw(4, stride=8) == hw.inter_node_bw  # one per node
  cost = CostModel(hw)
  for group in (12, 16, 24):
    assert cost.allreduce_s(1e9, group) == pytest.approx(
        cost.group_collective_s("all-reduce", 1e9, range(group)), rel=1e-12)


def test_activations_moved_and_kept_take_the_compute_dtype():
  """A float32 run's activations are 4 bytes an element where they are kept (a pipeline
  stage's stash, training_sim.stash_bytes) and where they move (tensor-parallel all-reduces of
  a forward, a pipelined decode's stage hops); they were 2 whatever the dtype. The papers'
  presets (16-bit) are timed and sized as before."""
  cm = CostModel(get_hardware("h100_sxm"))
  bf16 = get_shape("llama-7b")
  f32 = dataclasses.replace(bf16, kv_itemsize=4)
  assert training_sim.stash_bytes(bf16, 4, 2, 1000.0) == 2.0 * 1000 * 4096 * 8 / 2
  assert training_sim.stash_bytes(f32, 4, 2, 1000.0) == 2 * training_sim.stash_bytes(
      bf16, 4, 2, 1000.0)
  # One forward of 4096 tokens on tp 8: the same FLOPs and weight bytes, twice the all-reduced
  # bytes (their time is the difference).
  lens = np.full(4, 1024.0)
  comm = lambda s: cm._forward_s(s, 8, lens, 0.5) - cm.roofline_s(
      float(np.sum(s.forward_flops(lens, (lens + 1) / 2))), s.weight_bytes(), 8, 0.5,
      cm.eff.decode_bw_eff)
  want = lambda b: 2.0 * 32 * cm.allreduce_s(4096 * 4096 * b, 8)
  assert comm(bf16) == pytest.approx(want(2)) and comm(f32) == pytest.approx(want(4))


def test_the_lm_heads_logits_copies_are_what_the_compiled_programs_hold():
  """cost_model.LOGITS_COPIES_SCORING / _UPDATE against XLA's memory_analysis of the programs
  they stand for, compiled here: the scoring forward's temporaries are one float32 copy of the
  logits [rows, response, vocab], the gradient of log-probs and entropy four (within 10 %, a
  1-layer model 64 wide whose own buffers are small beside a 32000-token head). The training
  memory adds them to the update's busiest device: the last stage's one micro-batch, beyond
  what the first stage's in-flight ones hold."""
  import jax
  import jax.numpy as jnp
  from rlhfuse_jax.inference import scoring
  from rlhfuse_jax.models import llama, sequences
  from rlhfuse_jax.sim import cost_model
  b, p, t, v = 4, 8, 64, 32000
  cfg = llama.ModelConfig(vocab_size=v, hidden_size=64, intermediate_size=128, num_layers=1,
                          num_heads=2, num_kv_heads=2, max_seq_len=128)
  params = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.PRNGKey(0))[0])
  tokens = jax.ShapeDtypeStruct((b, p + t), jnp.int32)
  lens = jax.ShapeDtypeStruct((b,), jnp.int32)
  one = 4.0 * b * t * v

  def loss(prm, x, n):
    logp, ent = sequences.response_logprobs_and_entropy(cfg, prm, x, n, t)
    return logp.sum() + 0.01 * ent.sum()
  for program, copies in (
      (scoring.response_logprobs.lower(cfg, params, tokens, lens, num_response=t),
       cost_model.LOGITS_COPIES_SCORING),
      (jax.jit(jax.grad(loss)).lower(params, tokens, lens), cost_model.LOGITS_COPIES_UPDATE)):
    temp = program.compile().memory_analysis().temp_size_in_bytes
    assert temp == pytest.approx(copies * one, rel=0.1), (temp / one, copies)
  # In the training memory: the whole update logits at pp 1; beyond the first stage's extra
  # micro-batches at pp > 1; none for a scalar head.
  cm = CostModel(get_hardware("h100_sxm"))
  a = get_shape("llama-7b")
  logits = cost_model.LOGITS_COPIES_UPDATE * 4.0 * 2 * 512 * a.vocab_size / 2
  assert cm.train_memory_parts(a, 2, 1, 4, True, 2048, 1, False, 2, 512)["logits"] == (
      pytest.approx(logits))
  per_mb = cm.activation_bytes(a, 2, 256, a.num_layers / 4)
  staged = cm.train_memory_parts(a, 2, 4, 4, True, 256, 2, False, 2, 512)
  assert 0 < staged["logits"] == pytest.approx(logits - per_mb)
  assert "logits" not in cm.train_memory_parts(a, 2, 4, 4, True, 256, 4, False, 2, 512)
  assert "logits" not in cm.train_memory_parts(a.as_critic(), 2, 1, 4, True, 2048, 1, False,
                                               2, 512)


def test_the_updates_logits_copies_split_over_the_tensor_devices():
  """cost_model.LOGITS_COPIES_UPDATE on tensor devices: the trainer's whole update
  (trainer/ppo.make_update_fn: actor and critic, AdamW) on a tensor=4 mesh holds that many
  float32 copies of each device's V/4 columns of the logits. Taken as the temp bytes'
  difference over rows x vocabulary, which cancels what grows with one alone (the
  activations, the embedding's and head's parameters and their updates): 4.000 at tensor 1,
  2 and 4 (2026-12-07), measured at tensor 1 alone before."""
  import jax
  import jax.numpy as jnp
  from rlhfuse_jax.models import llama
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.rl import optim
  from rlhfuse_jax.sim import cost_model
  from rlhfuse_jax.trainer import ppo
  from rlhfuse_jax.trainer import update as update_lib
  from rlhfuse_jax.trainer.config import AlgoConfig
  tp, p, t = 4, 16, 64
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, tensor=tp), jax.devices()[:tp])
  tx = optim.make_optimizer(1e-6, 10, 1000, grad_clip=1.0)

  def temp(vocab: int, rows: int) -> int:
    models = [llama.ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                num_layers=1, num_heads=4, num_kv_heads=4, max_seq_len=128,
                                head=head) for head in ("lm", "scalar")]
    update = ppo.make_update_fn(*models, AlgoConfig(minibatch_size=rows, epochs=1), 1.0, tx,
                                tx, mesh=mesh)
    states = []
    for m in models:
      shapes = llama.param_shapes(m)
      params = mesh_lib.abstract(shapes, mesh_lib.param_shardings(shapes, llama.logical_specs(m),
                                                                  mesh))
      opt = mesh_lib.abstract(jax.eval_shape(tx.init, params),
                              update_lib.optimizer_state_shardings(tx, params, mesh, False))
      states.append(ppo.ModelState(params, opt))
    fields = {"tokens": ((rows, p + t), jnp.int32), "prompt_lens": ((rows,), jnp.int32),
              **{k: ((rows, t), jnp.float32) for k in ("mask", "old_logp", "ref_logp",
                                                       "advantages", "returns", "old_values")}}
    batch = {k: jax.ShapeDtypeStruct(shape, dt, sharding=mesh_lib.batch_sharding(mesh, len(shape)))
             for k, (shape, dt) in fields.items()}
    return update.lower(*states, batch).compile().memory_analysis().temp_size_in_bytes
  grown = (temp(32768, 8) - temp(16384, 8)) - (temp(32768, 4) - temp(16384, 4))
  one = 4.0 * 4 * t * 16384 / tp  # float32 [4 rows, T, a device's 16384 / tp columns]
  assert grown / one == pytest.approx(cost_model.LOGITS_COPIES_UPDATE, rel=0.05), grown / one


def test_rollout_bytes_are_the_arrays_the_trainer_keeps_on_its_devices():
  """cost_model.rollout_bytes is what PPOTrainer._advantages puts on the training devices (and
  keeps through the update) on a data 2 x fsdp 2 x tensor 2 mesh: 4 batch shards; its figure
  at the RLHFuse setting is below 1 % of every hardware preset's HBM (0.1 % of the smallest),
  which is why the memory model leaves it out (cost_model.ROLLOUT_FLOAT32_ROWS)."""
  import types

  import jax
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.sim import cost_model
  from rlhfuse_jax.sim.hardware import HARDWARE
  from rlhfuse_jax.trainer import async_ppo, config as tc, loop

  b, p, t = 8, 5, 3
  rng = np.random.default_rng(0)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8])
  cfg = types.SimpleNamespace(
      algo=tc.AlgoConfig(minibatch_size=b), reward=tc.RewardConfig(),
      rollout=types.SimpleNamespace(max_new_tokens=t, samples_per_prompt=1))
  trainer = types.SimpleNamespace(
      cfg=cfg, _put=lambda x: mesh_lib.put(x, mesh_lib.batch_sharding(mesh, np.ndim(x))))

  def floats():  # [B, T]
    return rng.normal(size=(b, t)).astype(np.float32)

  gen = async_ppo.Generated(
      iteration=0, version=0, tokens=rng.integers(0, 9, (b, p + t)).astype(np.int32),
      prompt_lens=np.full(b, p, np.int32), response_tokens=np.zeros((b, t), np.int32),
      response_lens=rng.integers(1, t + 1, b).astype(np.int32), logprobs=floats(),
      ref_logp=floats(), values=floats(), scores=rng.normal(size=b).astype(np.float32),
      metrics={})
  data, _ = loop.PPOTrainer._advantages(trainer, gen)
  assert len(data) == 2 + cost_model.ROLLOUT_FLOAT32_ROWS  # tokens, prompt_lens, the rows
  device = jax.devices()[0]
  kept = sum(s.data.nbytes for x in data.values() for s in x.addressable_shards
             if s.device == device)
  assert kept == cost_model.rollout_bytes(b, p, t, 4) == 8 * (4 * 9 + 24 * 3) / 4
  paper = cost_model.rollout_bytes(512, 1024, 1024)  # one device holding the whole batch
  assert paper == 512 * (4 * 2049 + 24 * 1024) == 16_779_264
  assert paper < 0.0011 * min(h.hbm_bytes for h in HARDWARE.values())
