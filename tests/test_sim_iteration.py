"""Training and iteration simulation: 1F1B formula, fusion bounds, plans, bad settings."""
import dataclasses

import numpy as np
import pytest

from rlhfuse_jax.pipeline.bounds import pipeline_1f1b_makespan, tight_lower_bound
from rlhfuse_jax.pipeline.graph import PipelineProblem
from rlhfuse_jax.sim import iteration_sim as it
from rlhfuse_jax.sim import training_sim as ts
from rlhfuse_jax.sim.cost_model import CostModel
from rlhfuse_jax.sim.hardware import get_hardware
from rlhfuse_jax.sim.lengths import LengthSpec
from rlhfuse_jax.sim.shapes import get_shape

H100 = CostModel(get_hardware("h100_sxm"))


def test_serial_schedule_is_the_1f1b_formula():
  p = PipelineProblem(actor_pp=4, critic_pp=2, actor_microbatches=8, critic_microbatches=4,
                      actor_fwd=3.0, critic_fwd=2.0)
  want = pipeline_1f1b_makespan(4, 8, 3.0, 6.0) + pipeline_1f1b_makespan(2, 4, 2.0, 4.0)
  assert ts.serial_makespan_ms(p) == pytest.approx(want)
  costs = ts.StepCosts(problem=p, grad_sync_s=0.5, optimizer_s=0.25)
  out = ts.pipeline_train_s(costs, num_minibatches=3, fused=False)
  assert out["train_s"] == pytest.approx(3 * (want / 1000 + 0.75))


def test_no_bubble_fusion_gains_nothing_and_bubbles_do():
  cache = ts.ScheduleCache(max_evaluations=5000)  # count-based: the same on any machine
  flat = PipelineProblem(actor_pp=1, critic_pp=1, actor_microbatches=4, critic_microbatches=4,
                         actor_fwd=2.0, critic_fwd=1.0)
  e = cache.fused(flat)
  assert e["makespan"] == pytest.approx(e["serial"]) == pytest.approx(4 * 6 + 4 * 3)
  deep = PipelineProblem(actor_pp=4, critic_pp=4, actor_microbatches=4, critic_microbatches=4,
                         actor_fwd=2.0, critic_fwd=1.0)
  e = cache.fused(deep)
  assert tight_lower_bound(deep) - 1e-9 <= e["makespan"] < e["serial"]
  assert e["peak_max"] <= e["budget_max"] + 1e-9
  assert cache.fused(deep) is e  # cached per problem


def test_a_persisted_schedule_cache_is_reused_only_for_the_same_search(tmp_path):
  """The cache file keys each entry by problem and search (budget, seed): reopened with the
  same search it answers without searching; with another budget or seed it searches again."""
  path = str(tmp_path / "schedule_cache.json")
  p = PipelineProblem(actor_pp=2, critic_pp=2, actor_microbatches=2, critic_microbatches=2,
                      actor_fwd=2.0, critic_fwd=1.0)
  calls = []
  first = ts.ScheduleCache(path, max_evaluations=200, log=calls.append).fused(p)
  assert len(calls) == 1
  assert ts.ScheduleCache(path, max_evaluations=200, log=calls.append).fused(p) == first
  assert len(calls) == 1  # answered from the file
  ts.ScheduleCache(path, max_evaluations=300, log=calls.append).fused(p)
  ts.ScheduleCache(path, max_evaluations=200, seed=1, log=calls.append).fused(p)
  assert len(calls) == 3  # another budget, another seed: searched
  # A damaged cache (a cut write by hand, a full disk) is searched again and said so: it was a
  # bare JSONDecodeError once reproduce_ablations had moved its earlier outputs aside.
  for text in ('{"a": ', "[1, 2]"):
    with open(path, "w") as f:
      f.write(text)
    calls.clear()
    again = ts.ScheduleCache(path, max_evaluations=200, log=calls.append).fused(p)
    assert {**again, "search_s": 0} == {**first, "search_s": 0}  # (count-based: the same)
    assert calls[0].startswith(f"schedule cache {path} is unreadable (") and len(calls) == 2


def test_train_plan_divisibility_errors():
  with pytest.raises(ValueError, match="minibatch=48 must be divisible by dp\\*micro_batch"):
    ts.TrainPlan(num_devices=256, minibatch=48, tp=8, actor_pp=1, critic_pp=1)
  with pytest.raises(ValueError, match="actor_pp=4 must be divisible by critic_pp=3"):
    ts.TrainPlan(num_devices=24, minibatch=24, tp=2, actor_pp=4, critic_pp=3)
  with pytest.raises(ValueError, match="num_devices=100"):
    ts.TrainPlan(num_devices=100, minibatch=64, tp=8, actor_pp=1, critic_pp=1)
  # Named as the user types them (config.minibatch; "workload.minibatch" named no field).
  with pytest.raises(ValueError, match=r"^config\.global_batch=500 must be divisible by "
                                       r"config\.minibatch=64$"):
    it.Workload(actor=get_shape("llama-7b"), critic=get_shape("llama-7b", "scalar"),
                global_batch=500)
  with pytest.raises(ValueError, match=r"^config\.minibatch=0 must be >= 1$"):
    it.Workload(actor=get_shape("llama-7b"), critic=get_shape("llama-7b", "scalar"),
                minibatch=0)


def test_the_critics_gradient_sync_crosses_nodes_where_its_replicas_do():
  """tp 4, dp 1, Pa 4, Pc 2 on 16 H100s: the critic's two replicas hold stage 0 on devices 0
  and 8, two nodes, so its gradient all-reduce runs over one NIC each; it was priced as two
  ranks inside one node (NVLink), 9x shorter."""
  a, c = get_shape("llama-13b"), get_shape("llama-13b", "scalar")
  plan = ts.TrainPlan(num_devices=16, minibatch=16, tp=4, actor_pp=4, critic_pp=2)
  costs = ts.step_costs(H100, a, c, plan, 512.0, check_memory=False)
  nbytes = c.num_params() * 2.0 / (4 * 2)
  across = H100._allreduce_over(nbytes, 2, 2, 50e9)  # two ranks, two nodes, one NIC each
  assert costs.grad_sync_s - H100.grad_sync_s(a, 4, 4, 1) == pytest.approx(across, rel=1e-12)
  assert across > 8 * H100.allreduce_s(nbytes, 2)  # NVLink's, what it was


def test_disjoint_training_times_each_model_with_its_own_measured_stage():
  """A calibration's train_stage is per model: the critic trained alone (disjoint splits) was
  timed with the actor's measured forward and bwd_over_fwd x it, not its measured backward."""
  from rlhfuse_jax.policy.calibration import Calibration, TrainStage
  cal = Calibration(device="test", train_stage=TrainStage(
      actor_fwd_s=0.02, critic_fwd_s=0.01, actor_bwd_s=0.05, critic_bwd_s=0.03))
  cost = CostModel(get_hardware("h100_sxm"), calibration=cal)
  for shape, f, b in ((get_shape("llama-7b", "scalar"), 0.01, 0.03),
                      (get_shape("llama-7b"), 0.02, 0.05)):
    step, plan = ts.single_model_plan(cost, shape, 8, 8, 1, 100.0)
    assert (plan["tp"], plan["pp"], plan["dp"], plan["M"]) == (1, 1, 8, 1)
    assert step == pytest.approx(pipeline_1f1b_makespan(1, 1, f, b) + cost.grad_sync_s(
        shape, 1, 1, 8) + cost.optimizer_step_s(shape, 8))


def test_disjoint_1f1b_exposes_the_latency_of_every_round_trip():
  """One model's 1F1B with latency between stages (disjoint training, single_model_plan) must be
  priced as the colocated plans are (the evaluator), not as (P+M-1)(f+b) + 2(P-1) latency,
  which holds only for M <= P. By hand, P=2, M=4, f=1, b=2, latency 0.5 (ms): stage 1 runs
  F0 1.5-2.5 B0 2.5-4.5 F1 4.5-5.5 B1 5.5-7.5 F2 8.5-9.5 B2 9.5-11.5 F3 11.5-12.5 B3 12.5-14.5;
  stage 0 F0 0-1 F1 1-2 B0 5-7 F2 7-8 B1 8-10 F3 10-11 B2 12-14 B3 15-17: 17, not 16."""
  ms = 1e-3
  assert ts.one_f_one_b_s(2, 4, 1 * ms, 2 * ms, 0.5 * ms) == pytest.approx(17 * ms)
  assert pipeline_1f1b_makespan(2, 4, 1, 2) + 2 * 0.5 == 16
  # M <= P: the latency is paid on the first forward chain and the last backward chain only.
  assert ts.one_f_one_b_s(4, 2, 1 * ms, 2 * ms, 0.5 * ms) == pytest.approx(
      (pipeline_1f1b_makespan(4, 2, 1, 2) + 2 * 3 * 0.5) * ms)
  assert ts.one_f_one_b_s(4, 8, 1 * ms, 2 * ms, 0.0) == pytest.approx(33 * ms)


def test_disjoint_plans_time_their_pipelines_with_the_latency_of_every_round_trip(monkeypatch):
  """single_model_plan prices every candidate's pipeline with one_f_one_b_s (checked by hand
  above), latency included wherever the model has several stages, not with the closed form."""
  calls = []

  def spy(stages, microbatches, fwd_s, bwd_s, latency_s):
    calls.append((stages, latency_s))
    return ts.pipeline_1f1b_makespan(stages, microbatches, fwd_s, bwd_s) + 1.0  # a marker
  monkeypatch.setattr(ts, "one_f_one_b_s", spy)
  step, plan = ts.single_model_plan(H100, get_shape("llama-7b"), 16, 16, 1, 512.0)
  assert any(pp > 1 for pp, _ in calls)
  assert all((lat > 0) == (pp > 1) for pp, lat in calls)
  assert step > 1.0  # the chosen plan's pipeline came from one_f_one_b_s


def test_a_model_alone_may_leave_devices_idle_and_is_then_the_best_on_any_fewer():
  """single_model_plan(idle=True) on n devices is the best of the plans that use all of m
  devices, any m <= n (every (tp, pp, dp) with tp x pp x dp <= n, brute force; its lower bound
  skips none that wins), on fixed-seed random instances, where no plan uses all n (a factor the
  mini-batch lacks) as well; where it is not strictly faster than the best on all n it is that
  plan. Its plan's "devices" are those it uses. Strictly faster on a case by hand below."""
  rng = np.random.default_rng(0)
  shapes = (get_shape("llama-7b"), get_shape("llama-13b", "scalar"))
  rescued = 0
  for _ in range(40):
    shape = shapes[int(rng.integers(2))]
    n, minibatch = int(rng.integers(1, 33)), int(rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24]))
    mean_len, first = float(rng.uniform(50, 2000)), int(rng.choice([0, 4, 12]))
    full = ts.single_model_plan(H100, shape, n, minibatch, 1, mean_len, first=first)
    idle = ts.single_model_plan(H100, shape, n, minibatch, 1, mean_len, first=first, idle=True)
    each = [p for m in range(1, n + 1)
            if (p := ts.single_model_plan(H100, shape, m, minibatch, 1, mean_len, first=first))]
    if not each:
      assert idle is None and full is None
      continue
    best = min(each, key=lambda p: p[0])
    assert idle[0] == pytest.approx(best[0], rel=1e-12), (shape.name, n, minibatch, mean_len)
    q = idle[1]
    assert q["devices"] == q["tp"] * q["pp"] * q["dp"] <= n and q["dp"] * q["M"] == minibatch
    if full is None:
      rescued += 1
    elif not idle[0] < full[0]:
      assert idle[0] == full[0] and idle[1] == full[1]  # a tie keeps every device busy
  assert rescued >= 10, rescued
  # 13B alone on 24 H100s, mini-batch 6 (the docstring's): tp2 pp4 dp3 on all 24 pays a
  # 12.1 ms all-reduce a step, tp4 pp4 dp1 on 16 none; 12 devices and a mini-batch of 16: dp 3
  # or 12 on all of them, so only 8 of them train.
  a = get_shape("llama-13b")
  step, plan = ts.single_model_plan(H100, a, 24, 6, 1, 200 / 3, padded_len=128.0,
                                    head_positions=64.0)
  assert (plan["tp"], plan["pp"], plan["dp"], plan["devices"]) == (2, 4, 3, 24)
  assert step == pytest.approx(0.0426, abs=1e-4)
  step, plan = ts.single_model_plan(H100, a, 24, 6, 1, 200 / 3, padded_len=128.0,
                                    head_positions=64.0, idle=True)
  assert (plan["tp"], plan["pp"], plan["dp"], plan["devices"]) == (4, 4, 1, 16)
  assert step == pytest.approx(0.0364, abs=1e-4)
  assert ts.single_model_plan(H100, a, 12, 16, 1, 500.0) is None
  assert ts.single_model_plan(H100, a, 12, 16, 1, 500.0, idle=True)[1]["devices"] == 8


def test_training_plans_split_whole_layers_per_stage():
  """13B's 40 layers: no plan puts 2.5 layers on each of 16 stages (a stage holds whole layers,
  as Megatron-LM and our executor require); every candidate tried has pp dividing the layers."""
  a, c = get_shape("llama-13b"), get_shape("llama-13b", "scalar")
  plan, tried = ts.best_plan(H100, a, c, 256, 64, 1, 1024.0, 8)
  assert a.num_layers % plan.actor_pp == 0 and c.num_layers % plan.critic_pp == 0
  assert not any("pa16" in name or "pc16" in name for name in tried), sorted(tried)
  assert any("pa8" in name for name in tried)


@pytest.mark.parametrize("minibatch, held", [(8, (4, 2)), (2, (2, 1))])
def test_training_memory_counts_the_1f1b_in_flight_micro_batches_of_stage_0(minibatch, held):
  """Stage 0 of a P-stage 1F1B with M micro-batches holds min(P, M) of them (graph.py); a plan
  is checked with both models' stage 0 at once, the critic's states sharded over its dp x R
  copies. Pa=4, Pc=2 on 4 devices: minibatch 8 (Ma=8, Mc=4) holds 4 and 2, minibatch 2 (Ma=2,
  Mc=1) 2 and 1. The check must pass with exactly that much usable memory, refuse a byte less."""
  a, c = get_shape("llama-7b"), get_shape("llama-7b", "scalar")
  plan = ts.TrainPlan(num_devices=4, minibatch=minibatch, tp=1, actor_pp=4, critic_pp=2)
  tokens = 64.0
  need = (H100.train_memory_bytes(a, 1, 4, 1, True, tokens, held[0]) +
          H100.train_memory_bytes(c, 1, 2, 2, True, tokens, held[1]))
  headroom = H100.eff.memory_headroom
  for usable, fits in ((need * (1 + 1e-9), True), (need * (1 - 1e-9), False)):
    hw = dataclasses.replace(H100.hw, hbm_bytes=usable / headroom)
    if fits:
      ts.check_train_memory(CostModel(hw), a, c, plan, tokens)
    else:
      with pytest.raises(ValueError, match="does not fit in memory"):
        ts.check_train_memory(CostModel(hw), a, c, plan, tokens)


def test_model_that_does_not_fit_is_named():
  a100 = CostModel(get_hardware("a100_80g_sxm"))
  a, c = get_shape("llama-65b"), get_shape("llama-65b", "scalar")
  plan = ts.TrainPlan(num_devices=8, minibatch=8, tp=8, actor_pp=1, critic_pp=1)
  with pytest.raises(ValueError, match="training llama-65b.*does not fit in memory.*tp=8"):
    ts.step_costs(a100, a, c, plan, 512.0)
  with pytest.raises(ValueError, match="no training plan fits"):
    ts.best_plan(a100, a, c, 8, 8, 1, 512.0, 1)
  wl = it.Workload(actor=a, critic=c, num_devices=8, global_batch=8, minibatch=8)
  with pytest.raises(ValueError, match="generation of llama-65b does not fit"):
    it.gen_plan(a100, wl, 1, wl.sample_lengths()[0], 64)


def small_workload(**kw):
  return it.Workload(actor=get_shape("llama-7b"), critic=get_shape("llama-7b", "scalar"),
                     num_devices=16, global_batch=64, minibatch=16, max_new_tokens=256,
                     prompt=LengthSpec(kind="constant", value=64, max_len=64),
                     response=LengthSpec(median=64, sigma=1.0), **kw)


def test_six_systems_on_one_small_setting():
  opt = it.SimOptions(search_time_s=0.3, gen_tps=(2, 4), threshold_candidates=(0.0, 0.2))
  rows, raw = it.simulate_iteration(H100, small_workload(), opt)
  assert set(rows) == set(it.SYSTEMS)
  for name, r in rows.items():
    for f in ("iteration_s", "gen_s", "inf_s", "gen_plus_inf_s", "train_s", "reshard_s"):
      assert r[f] >= 0, (name, f)
    serial = r["reshard_s"] + r["gen_plus_inf_s"] + r["train_s"]
    if name == "pipe_rlhf_async" and not r["details"]["async"]["colocated"]:
      # The generation group overlaps the training group.
      assert r["iteration_s"] == pytest.approx(
          r["reshard_s"] + max(r["gen_plus_inf_s"], r["train_s"]))
      assert r["details"]["async"]["serial_s"] == pytest.approx(serial)
    else:
      assert r["iteration_s"] == pytest.approx(serial)
    assert r["samples_per_s"] == pytest.approx(64 / r["iteration_s"])
    assert r["gen_plus_inf_s"] == pytest.approx(r["gen_s"] + r["inf_s"])
  # Here the asynchronous search splits the devices and the overlap pays (with the disjoint
  # groups timed serially, the colocated option won and the overlap above went unchecked).
  assert not rows["pipe_rlhf_async"]["details"]["async"]["colocated"]
  assert rows["pipe_rlhf_async"]["iteration_s"] < rows["pipe_rlhf"]["iteration_s"]
  with pytest.raises(ValueError, match=r"^config\.sim\.staleness=0: pipe_rlhf_async needs"):
    it.simulate_iteration(H100, small_workload(), dataclasses.replace(opt, staleness=0),
                          systems=("pipe_rlhf_async",))
  base, inter, intra, full = (rows[s] for s in ("rlhfuse_base", "inter_stage", "intra_stage",
                                                 "rlhfuse"))
  # Each fusion changes only its own stage.
  assert intra["gen_plus_inf_s"] == base["gen_plus_inf_s"]
  assert inter["train_s"] == base["train_s"]
  assert full["train_s"] == intra["train_s"] and full["gen_plus_inf_s"] == inter["gen_plus_inf_s"]
  assert intra["train_s"] <= base["train_s"] + 1e-9
  assert (False, False) in raw["gen"] and True in raw["train"]


def test_same_workload_for_every_system():
  wl = small_workload()
  p1, r1 = wl.sample_lengths()
  p2, r2 = dataclasses.replace(wl).sample_lengths()
  assert (p1 == p2).all() and (r1 == r2).all() and r1.max() <= 256
  with pytest.raises(ValueError, match="unknown systems"):
    it.simulate_iteration(H100, wl, it.SimOptions(), systems=("verl",))


def test_fused_schedule_memory_comes_from_the_models_shapes():
  """Per in-flight micro-batch a stage keeps each layer's input (2 s b h bytes, full
  recomputation), over tp: the actor and the critic weigh by width x layers per stage, not by
  their forward times."""
  actor, critic = get_shape("llama-65b"), get_shape("llama-33b", "scalar")
  plan = ts.TrainPlan(num_devices=256, minibatch=64, tp=4, actor_pp=16, critic_pp=4)
  p = ts.step_costs(H100, actor, critic, plan, 1000.0).problem
  assert p.actor_mem == pytest.approx(2 * 1000 * 8192 * (80 / 16) / 4 / 1e6, rel=1e-6)
  assert p.critic_mem == pytest.approx(2 * 1000 * 6656 * (60 / 4) / 4 / 1e6, rel=1e-6)
  # Forward times would weigh them otherwise (the critic's 15-layer stages vs 5-layer ones).
  assert p.critic_mem / p.actor_mem != pytest.approx(p.critic_fwd / p.actor_fwd, rel=0.05)


def test_deepspeed_chat_generates_at_the_smallest_degree_beside_its_zero3_shards():
  """65B/65B on 256 H100s: DeepSpeed-Chat's hybrid engine generates at tp 4, the smallest
  degree whose weights and KV cache fit beside the ZeRO-3 shards of the four models (tp 2 does
  not). Its inference runs under ZeRO-3, so the instances' inference memory (three whole frozen
  models, which needs tp 8) must not decide it, as it did."""
  cost = CostModel(get_hardware("h100_sxm"))
  wl = it.Workload(actor=get_shape("llama-65b"), critic=get_shape("llama-65b", "scalar"),
                   max_new_tokens=1024)
  g = it.simulate_gen_stage(cost, wl, it.SimOptions(), False, smallest_tp=True)
  assert g["plan"].tp == 4
  # Whatever order the degrees are listed in.
  reverse = it.simulate_gen_stage(cost, wl, it.SimOptions(gen_tps=(8, 4, 2, 1)), False,
                                  smallest_tp=True)
  assert reverse["plan"].tp == 4
  assert "ZeRO-3 shards" in g["rejected_tps"][2]
  resident = it.zero3_resident_bytes(wl)
  assert resident == pytest.approx(18 * 2 * wl.actor.num_params() / 256, rel=0.01)
  # The pool: what is left after the weights, the shards and the prefill's activations of the
  # instance's share of the batch (its longest prompt each).
  prompt = int(wl.sample_lengths()[0].max())
  share = 512 // 64
  prefill = share * 34 * 8192 * prompt / 4
  free = cost.usable_bytes - wl.actor.weight_bytes() / 4 - resident - prefill
  assert g["plan"].kv_capacity_tokens == int(free // (wl.actor.kv_bytes_per_token() / 4))
  # The instances' own inference (RLHFuse's generation stage) does not fit on one tp4
  # instance beside the training state: at tp4 it runs on pipelines of several instances.
  with pytest.raises(ValueError, match=r"inference \(reference \+ critic \+ reward\) does "
                                       r"not fit .*tp=4"):
    it.check_inference_memory(cost, wl, 4, 8)
  assert it.simulate_gen_stage(cost, wl, it.SimOptions(gen_tps=(4,)), False)[
      "plan"].inference_pp > 1


def test_the_instances_inference_fits_beside_the_training_state_on_pipelines_of_them():
  """65B/33B on 256 H100s: the 33B models' 52 heads rule out tp8, and a tp4 instance cannot
  hold the reference, critic and reward model (65 GB) beside the training state that stays on
  its devices. The papers' systems give the frozen models layouts of their own; the simulated
  freed instances run inference as pipelines of the fewest instances whose stages fit (here
  2), each instance loading its stage's share. Until 2026-12-05 (bl) this inference was not
  checked beside the training state and ran on single tp4 instances that could not hold it."""
  cost = CostModel(get_hardware("h100_sxm"))
  wl = it.Workload(actor=get_shape("llama-65b"), critic=get_shape("llama-33b", "scalar"),
                   max_new_tokens=1024)
  opt = it.SimOptions()
  g = it.simulate_gen_stage(cost, wl, opt, True)
  assert (g["plan"].tp, g["plan"].inference_pp) == (4, 2)
  state = it.train_state_bytes(cost, wl, opt, 4)
  frozen = wl.frozen_models()[1]
  weights = sum(s.weight_bytes() for s in frozen)
  assert weights == pytest.approx(2 * (65.3e9 + 2 * 32.5e9), rel=0.02)  # bf16
  with pytest.raises(ValueError, match=r"inference .* tp=4, 8 samples at once, beside "
                                       r"[0-9.]+ GiB of the training state"):
    it.check_inference_memory(cost, wl, 4, 8, resident_bytes=state, resident="the training state")
  two = it.inference_memory_parts(cost, wl, 4, 8, pp=2)
  # The heaviest stage is the first: half of every model's layers and all three embeddings
  # (the last holds the reference's LM head beside its half), over tp 4.
  embeds = sum(2 * s.vocab_size * s.hidden_size for s in frozen)
  lm_head = 2 * wl.actor.vocab_size * wl.actor.hidden_size
  assert two["weights"] == pytest.approx(((weights - embeds - lm_head) / 2 + embeds) / 4)
  assert two["weights"] > weights / 8
  # The last stage still makes the whole LM head's logits.
  assert two["logits"] == it.inference_memory_parts(cost, wl, 4, 8)["logits"]
  assert sum(two.values()) + state <= cost.usable_bytes
  assert it.inference_pp(cost, wl, 4, 64, opt, state, "the training state") == 2
  # The instances of a unit both run inference, one stage each, after loading half the
  # offloaded weights a device.
  res = g["result"]
  inf = {i for i, _, _, kind in res.segments if kind == "inference"}
  assert inf and len(inf) % 2 == 0
  loads = [(i, e - b) for i, b, e, kind in res.segments if kind == "load"]
  assert {i for i, _ in loads} == inf
  assert all(d == pytest.approx(cost.weight_load_s(frozen, 8)) for _, d in loads)
  # Frozen models kept on the instances (sim.offload_frozen=False) are not split: one
  # instance must hold them whole, and no unit is formed.
  with pytest.raises(ValueError, match=r"beside [0-9.]+ GiB of the training state"):
    it.inference_pp(cost, wl, 4, 64, dataclasses.replace(opt, offload_frozen=False), state,
                    "the training state")


def test_the_heaviest_pipeline_stage_holds_the_embeddings_or_the_lm_head():
  """shapes.heaviest_stage_weight_bytes: each stage holds 1/pp of the layers; the first the
  embedding, the last the LM head, and with tied embeddings a copy of its own."""
  from rlhfuse_jax.sim.shapes import heaviest_stage_weight_bytes
  lm = get_shape("llama-7b")
  e = 2 * lm.vocab_size * lm.hidden_size  # bf16
  assert heaviest_stage_weight_bytes([lm], 2) == pytest.approx((lm.weight_bytes() - 2 * e) / 2
                                                               + e)
  tied = dataclasses.replace(lm, tie_embeddings=True)
  assert heaviest_stage_weight_bytes([tied], 4) == pytest.approx(
      (tied.weight_bytes() - e) / 4 + e)
  critic = lm.as_critic()  # the first stage, with the embedding, is the heavier
  assert heaviest_stage_weight_bytes([critic], 2) == pytest.approx(
      (critic.weight_bytes() - e) / 2 + e)
  assert heaviest_stage_weight_bytes([lm, critic], 1) == lm.weight_bytes() + critic.weight_bytes()
  assert heaviest_stage_weight_bytes([lm, critic], 2) == pytest.approx(
      (lm.weight_bytes() + critic.weight_bytes() - 3 * e) / 2 + 2 * e)


def test_the_generation_stage_charges_only_the_frozen_models_the_run_has():
  """A workload without a reward model (Workload.reward_model, a run with a reward function):
  RLHFuse's generation stage neither keeps its weights beside the KV cache
  (sim.offload_frozen=False) nor runs its forward, as plan_search's inference plans do not
  (Workload.frozen_models); a group that holds no frozen model needs no inference memory.
  Until 2026-12-04 it charged both, and an empty set of models was charged the default ones."""
  cost = CostModel(get_hardware("h100_sxm"))
  wl = it.Workload(actor=get_shape("llama-13b"), critic=get_shape("llama-13b", "scalar"),
                   max_new_tokens=1024)
  opt = it.SimOptions(gen_tps=(4,), offload_frozen=False)  # their weights beside the KV cache
  full = it.simulate_gen_stage(cost, wl, opt, True)
  fn = it.simulate_gen_stage(cost, dataclasses.replace(wl, reward_model=False), opt, True)
  kv_tok = wl.actor.kv_bytes_per_token() / 4
  freed = (fn["plan"].kv_capacity_tokens - full["plan"].kv_capacity_tokens) * kv_tok
  assert abs(freed - wl.reward_shape.weight_bytes() / 4) <= kv_tok  # one model's weights / tp
  busy = lambda g: sum(e - b for _, b, e, kind in g["result"].segments if kind == "inference")
  assert busy(fn) < 0.8 * busy(full)  # two forwards a sample instead of three
  with pytest.raises(ValueError, match=r"inference \(reference \+ critic\) does not fit"):
    it.check_inference_memory(cost, dataclasses.replace(wl, reward_model=False), 1, 4096)
  none = dataclasses.replace(wl, reference=False, reward_model=False)
  assert it.inference_memory_parts(cost, none, 1, 8, ()) == {"weights": 0, "activations": 0}


def test_frozen_models_kept_on_the_devices_shrink_the_kv_pool():
  """sim.offload_frozen=False: the reference, critic and reward model stay on the generation
  instances, so their weights (split over the instance's tp) come out of the KV pool, and a
  degree where they leave no room for the batch is refused naming them. Until 2026-11-30 no
  memory check counted them."""
  cost = CostModel(get_hardware("h100_sxm"))
  wl = it.Workload(actor=get_shape("llama-13b"), critic=get_shape("llama-13b", "scalar"),
                   max_new_tokens=1024)
  on, off = (it.simulate_gen_stage(cost, wl, it.SimOptions(gen_tps=(4,), offload_frozen=o),
                                   False) for o in (False, True))
  kv_tok = wl.actor.kv_bytes_per_token() / 4
  frozen = (wl.actor.weight_bytes() + 2 * wl.critic.weight_bytes()) / 4  # bf16, per device
  assert frozen == pytest.approx(2 * 39e9 / 4, rel=0.05)  # three 13B models
  # Besides: the training state (the same plan either way: 13B/13B fits the fastest beside
  # them) and the prefill's activations of the instance's share of the batch.
  state = it.train_state_bytes(cost, wl, it.SimOptions(), 4)
  assert state == it.train_state_bytes(cost, wl, it.SimOptions(offload_frozen=False), 4) > 0
  prompt = int(wl.sample_lengths()[0].max())
  free = (cost.usable_bytes - wl.actor.weight_bytes() / 4 - state
          - (512 // 64) * 34 * wl.actor.hidden_size * prompt / 4)
  assert off["plan"].kv_capacity_tokens == int(free // kv_tok)
  assert on["plan"].kv_capacity_tokens == int((free - frozen) // kv_tok)
  # 65B: three frozen 65B-class models fill tp 4 instances (about 98 GB a device).
  wl = it.Workload(actor=get_shape("llama-65b"), critic=get_shape("llama-65b", "scalar"),
                   max_new_tokens=1024)
  with pytest.raises(ValueError, match=r"tp=4: weights \+ KV cache .* \+ the training state "
                                       r"and the frozen models' weights "
                                       r"\(sim\.offload_frozen=False\)"):
    it.simulate_gen_stage(cost, wl, it.SimOptions(gen_tps=(4,), offload_frozen=False), False)


def test_the_training_state_beside_generation_is_both_models_weights_and_zero1_adamw():
  """What stays on the generation devices: the actor's and critic's weights split over their
  stages and tensor devices, and their AdamW state split over data too (ZeRO-1), on the plan
  the colocated systems train with; sim.offload_optimizer leaves the AdamW state out. More
  state, fewer slots for the trainer's engine."""
  cost = CostModel(get_hardware("h100_sxm"))
  wl = it.Workload(actor=get_shape("llama-33b"), critic=get_shape("llama-13b", "scalar"),
                   max_new_tokens=1024, kv_at_max_prompt=True)
  prompts, resp = wl.sample_lengths()
  plan, _ = ts.best_plan(cost, wl.actor, wl.critic, 256, wl.minibatch, 1,
                         float(np.mean(prompts + resp)), wl.num_minibatches,
                         padded_len=wl.padded_len, head_positions=1024)
  weights = opt = 0.0
  for shape, pp, dp in ((wl.actor, plan.actor_pp, plan.dp),
                        (wl.critic, plan.critic_pp, plan.dp * plan.critic_replicas)):
    weights += 2 * shape.num_params() / (plan.tp * pp)
    opt += shape.optimizer_bytes_per_param() * shape.num_params() / (plan.tp * pp * dp)
  full = it.train_state_bytes(cost, wl, it.SimOptions(), 4)
  assert full == pytest.approx(weights + opt, rel=1e-9)
  assert it.train_state_bytes(cost, wl, it.SimOptions(offload_optimizer=True), 4) == (
      pytest.approx(weights, rel=1e-9))
  slots = [it.gen_plan(cost, wl, 4, prompts, 256, b).slots for b in (0.0, full)]
  assert slots[0] > slots[1] >= wl.global_batch // 64


def test_frozen_models_kept_on_the_devices_bound_the_training_plan_too():
  """sim.offload_frozen=False: the frozen reference and reward model stay on the generation
  instances while the actor and critic train, so the training plan must fit beside their
  weights split over the generation tp. Here (33B/13B on 16 H100s) the plan that is fastest
  when they are offloaded does not fit beside them, and is refused naming them. Until
  2026-11-30 training charged nothing for them."""
  wl = it.Workload(actor=get_shape("llama-33b"), critic=get_shape("llama-13b", "scalar"),
                   num_devices=16, global_batch=64, minibatch=32, max_new_tokens=256,
                   prompt=LengthSpec(kind="uniform", min_len=8, max_len=64),
                   response=LengthSpec(kind="uniform", min_len=1, max_len=256))
  # (The optimizer state in host memory while the instances generate: beside the whole
  # training state and the frozen models no generation fits on 16 devices.)
  on, off = (it.simulate_iteration(H100, wl, it.SimOptions(gen_tps=(1, 2, 4, 8),
                                                           offload_frozen=o,
                                                           offload_optimizer=True),
                                   systems=("rlhfuse_base",))[0]["rlhfuse_base"]
             for o in (False, True))
  with pytest.raises(ValueError, match=r"tp=4: .* \+ the training state and the frozen"):
    it.simulate_iteration(H100, wl, it.SimOptions(gen_tps=(4,), offload_frozen=False),
                          systems=("rlhfuse_base",))
  gen_tp = on["details"]["gen_plan"]["tp"]
  kept = (wl.actor.weight_bytes() + wl.critic.weight_bytes()) / gen_tp
  assert it.kept_frozen_bytes(wl, gen_tp, it.SimOptions(offload_frozen=False)) == kept
  prompts, resp = wl.sample_lengths()
  mean_len = float((prompts + resp).mean())
  plan = lambda p: ts.TrainPlan(16, 32, p["tp"], p["actor_pp"], p["critic_pp"], 1)  # noqa: E731
  chosen, fastest = on["details"]["train"]["plan"], off["details"]["train"]["plan"]
  assert (fastest["tp"], fastest["dp"]) == (2, 2) and (chosen["tp"], chosen["dp"]) == (4, 1)
  assert on["train_s"] > off["train_s"]
  ts.step_costs(H100, wl.actor, wl.critic, plan(chosen), mean_len, resident_bytes=kept)
  with pytest.raises(ValueError, match=r"beside [\d.]+ GiB of frozen models' weights kept on "
                                       r"the devices \(sim\.offload_frozen=False\)"):
    ts.step_costs(H100, wl.actor, wl.critic, plan(fastest), mean_len, resident_bytes=kept)


@pytest.mark.parametrize("fused_train_s, picked", [(0.8, True), (0.99, False)])
def test_planned_fused_training_pays_the_resharding_its_layout_brings(fused_train_s, picked):
  """rlhfuse_planned swaps the plan's training for the fused schedule on a pipelined layout. A
  generation layout that needed no resharding (here the uniform tp 8 layout, every stage on
  it) then does: the weights move from the fused layout to it. The swap is charged that, and
  taken only where it still wins (it stayed free before: a 0.8 s schedule beat 1.0 s with
  0 s of resharding)."""
  from rlhfuse_jax.sim import plan_search as ps  # pylint: disable=import-outside-toplevel
  cost = CostModel(get_hardware("h100_sxm"))
  wl = it.Workload(actor=get_shape("llama-13b"), critic=get_shape("llama-13b", "scalar"))
  lay = {"tp": 8, "pp": 1, "dp": 32}
  searched = {"best": {"predicted": {"gen_s": 2.0, "inf_s": 0.5, "reshard_s": 0.0,
                                     "train_s": 1.0, "iteration_s": 3.5},
                       "generation": {"mode": "instances", "tp": 8, "pp": 1}, "inference": {},
                       "training": {}, "summary": "same layout"},
              "uniform": {"layout": lay, "predicted": {"gen_s": 2.0, "inf_s": 0.5,
                                                       "train_s": 1.0, "reshard_s": 0.0,
                                                       "iteration_s": 3.4}},
              "search_s": 0}
  fused_train = {"train_s": fused_train_s,
                 "plan": {"tp": 4, "actor_pp": 8, "critic_pp": 8, "dp": 8}}
  row = it._planned_row(cost, wl, searched, None, fused_train)
  moved = ps.reshard_s(cost, wl, 8)
  assert 0.05 < moved < 0.2  # 13B's bf16 weights in tp-8 shards over the scale-out network
  if picked:
    assert row["reshard_s"] == moved and row["train_s"] == fused_train_s
    assert row["iteration_s"] == pytest.approx(moved + 2.5 + fused_train_s)
  else:  # 0.99 s + the move > 1.0 s: the uniform layout's own training stays
    assert row["reshard_s"] == 0.0 and row["train_s"] == 1.0 and "train" not in row["details"]


def test_zero3_step_overlaps_three_parameter_gathers_with_the_compute():
  """DeepSpeed-Chat-like ZeRO-3 by hand: each step all-gathers the bf16 parameters for the
  forward and for the backward and reduce-scatters the gradients, 3 x (n-1)/n x the weight
  bytes through every device's link, prefetched under the compute (3 x the forward's FLOPs at
  train_mfu over n devices): the step is the larger of the two plus the optimizer step."""
  from rlhfuse_jax.sim.cost_model import Efficiency
  from rlhfuse_jax.sim.hardware import Hardware
  from rlhfuse_jax.sim.shapes import ModelShape
  hw = Hardware(name="toy", peak_flops=1e15, hbm_bw=1e9, hbm_bytes=1e10, intra_node_bw=1e8,
                inter_node_bw=1e7, devices_per_node=4)
  cost = CostModel(hw, Efficiency(train_mfu=0.5, decode_bw_eff=0.5, net_eff=0.5,
                                  collective_latency_s=0.0))
  shape = ModelShape(name="toy", vocab_size=100, hidden_size=16, intermediate_size=32,
                     num_layers=2, num_heads=2, num_kv_heads=1)
  gathers = 3 * (3 / 4) * 2 * shape.num_params() / (1e8 * 0.5)
  opt = 28 * shape.num_params() / 4 / (1e9 * 0.5)
  for tokens in (1e6, 1e9):
    compute = 3 * shape.forward_flops(tokens, 100.5) / (4 * 1e15 * 0.5)
    assert (compute < gathers) == (tokens == 1e6)
    assert ts.zero3_train_s(cost, shape, 4, tokens, 200.0) == pytest.approx(
        max(compute, gathers) + opt)


def test_a_decode_table_of_one_width_rules_out_the_other_generation_degrees():
  """A calibration's decode_step table times its instance width (instance_devices) only: the
  simulated systems' other degrees are ruled out with the reason, as a degree that does not
  fit. reproduce_ablations with calibrate_sim's file (a table at width 1) failed on tp 2,
  fused or not (the Rt choice and the simulation were outside the degree's refusal)."""
  from rlhfuse_jax.policy import calibration
  cal = calibration.from_dict({"format": calibration.FORMAT, "device": "test",
                               "instance_devices": 1, "ops": {"decode_step": {
                                   "occupied_slots": [1, 64], "seconds": [0.01, 0.02]}}},
                              "cal.json")
  cost = CostModel(get_hardware("h100_sxm"), calibration=cal)
  wl = it.Workload(actor=get_shape("llama-7b"), critic=get_shape("llama-7b", "scalar"),
                   num_devices=8, global_batch=16, minibatch=8, max_new_tokens=64)
  for fused in (False, True):
    g = it.simulate_gen_stage(cost, wl, it.SimOptions(gen_tps=(2, 1, 4)), fused)
    assert g["plan"].tp == 1
    assert set(g["rejected_tps"]) == {2, 4}
    assert "decode_step table was measured on instances of 1 device(s)" in (
        g["rejected_tps"][2])
