"""Generation simulator on hand-computable cases: one sample, no tail, a pure-tail batch."""
import numpy as np
import pytest

from rlhfuse_jax.policy import calibration
from rlhfuse_jax.sim.cost_model import CostModel, stage_cost
from rlhfuse_jax.sim.generation_sim import (GenSetup, choose_threshold, handoff_s,
                                            simulate_generation)
from rlhfuse_jax.sim.hardware import get_hardware
from rlhfuse_jax.sim.shapes import get_shape, stage_shape

SHAPE = get_shape("llama-7b")


def measured_cost(share=False, step=0.01, migration=1e9):
  """Round measured costs: 10 ms per decode step, prefill 1000 tok/s, inference 500 tok/s."""
  cal = calibration.from_dict({
      "format": calibration.FORMAT, "device": "test", "devices_share_compute": share,
      "ops": {"decode_step": {"occupied_slots": [1, 64], "seconds": [step, step]},
              "prefill": {"tokens_per_s": 1000.0},
              "inference": {"tokens_per_s": 500.0},
              "migration": {"bytes_per_s": migration}}})
  return CostModel(get_hardware("h100_sxm"), calibration=cal)


def hand(cost, src, dst, width, **kw):
  """handoff_s of SHAPE's hidden states from instance src to dst, kw GenSetup's fields."""
  (h,) = handoff_s(cost, [SHAPE], GenSetup(**{"num_instances": 4, "slots": 1, **kw}), src, dst,
                   width)
  return h


def run(cost, prompts, resp, **kw):
  setup = GenSetup(**{"max_new_tokens": int(max(resp)), "chunk_steps": 4, **kw})
  return simulate_generation(cost, SHAPE, [SHAPE], setup, np.array(prompts), np.array(resp))


def test_one_sample_by_hand():
  res = run(measured_cost(), [10], [5], num_instances=1, slots=1)
  # prefill 10 tokens (samples token 1) + 4 decode steps of 10 ms; inference of 15 tokens.
  assert res.gen_end_s == pytest.approx(0.01 + 0.04)
  assert res.gen_plus_inf_s == pytest.approx(0.05 + 15 / 500)
  assert res.inf_exposed_s == pytest.approx(15 / 500)  # the inference after generation ends
  assert res.summary()["inf_exposed_s"] == res.inf_exposed_s
  assert res.unfinished_curve == [(0.0, 1), (pytest.approx(0.05), 0)]


def test_one_sample_with_formula_costs():
  cost = CostModel(get_hardware("h100_sxm"))
  res = run(cost, [10], [5], num_instances=1, slots=1, tp=2)
  steps = sum(float(cost.decode_step_s(SHAPE, 2, 1, 10 + 1 + k)) for k in range(4))
  assert res.gen_end_s == pytest.approx(cost.prefill_s(SHAPE, 2, [10]) + steps)
  assert res.gen_plus_inf_s == pytest.approx(res.gen_end_s + cost.inference_s([SHAPE], 2, [15]))


def test_no_tail_fusion_gains_nothing():
  cost = CostModel(get_hardware("h100_sxm"))
  prompts, resp = [64] * 32, [40] * 32
  base = run(cost, prompts, resp, num_instances=4, slots=8)
  fused = run(cost, prompts, resp, num_instances=4, slots=8, threshold=0.5,
              stream_inference=True)
  assert fused.consolidations == []  # every sample finishes in the same chunk
  assert fused.gen_plus_inf_s == pytest.approx(base.gen_plus_inf_s)
  assert fused.gen_end_s == pytest.approx(base.gen_end_s)


def test_pure_tail_batch():
  # 8 samples on 4 instances; one needs 100 tokens, the others finish at prefill.
  cost = measured_cost()
  prompts, resp = [10] * 8, [1] * 7 + [100]
  base = run(cost, prompts, resp, num_instances=4, slots=2, inference_microbatch=8)
  fused = run(cost, prompts, resp, num_instances=4, slots=2, inference_microbatch=8,
              threshold=0.5, stream_inference=True)
  gen_end = 2 * 10 / 1000 + 99 * 0.01  # prefill 20 tokens per instance, then 99 steps
  assert base.gen_end_s == pytest.approx(gen_end) and fused.gen_end_s == pytest.approx(gen_end)
  # Baseline: all 8 samples (7 x 11 + 110 tokens) go through inference after the tail.
  assert base.gen_plus_inf_s == pytest.approx(gen_end + (7 * 11 + 110) / 500)
  # Busy: 4 prefills, the tail's 99 steps and that one micro-batch, over 4 instances' time.
  busy = 4 * 0.02 + 99 * 0.01 + (7 * 11 + 110) / 500
  assert base.instance_busy_frac == pytest.approx(busy / (4 * base.gen_plus_inf_s))
  # Fused: the 7 short ones were scored on free instances during the tail; only the long one
  # remains (the policy moves nothing: one sample is already on the fewest instances).
  assert fused.consolidations == []
  assert fused.gen_plus_inf_s == pytest.approx(gen_end + 110 / 500)
  assert fused.inference_overlap_frac > 0.4


def test_a_tail_left_by_the_prefill_is_consolidated_before_any_decode():
  # 8 samples on 4 instances (uid % 4); uids 0 and 1 need 40 tokens, the rest finish at
  # prefill. Two unfinished <= 0.5 * 8 once the prefills end, so the host consolidates then, as
  # the engine does at step 0, not after the first chunk.
  cost = measured_cost(migration=1e12)
  prompts, resp = [10] * 8, [40, 40] + [1] * 6
  fused = run(cost, prompts, resp, num_instances=4, slots=2, threshold=0.5,
              stream_inference=True)
  [c] = fused.consolidations
  assert c["time_s"] == pytest.approx(2 * 10 / 1000)  # every instance's prefill: 20 tokens
  assert c["unfinished"] == 2 and c["kept"] == 1 and c["moves"] == 1
  # Only the kept instance ever decodes: the other's sample moved before its first chunk.
  decodes = {i for i, _, _, kind in fused.segments if kind == "decode"}
  assert decodes == set(c["kept_list"])
  # Rt = 1: the host consolidates at the first prefill end, with nothing finished there.
  every = run(cost, [10] * 4, [40] * 4, num_instances=4, slots=2, threshold=1.0,
              stream_inference=True)
  [c] = every.consolidations
  assert c["time_s"] == pytest.approx(10 / 1000) and c["unfinished"] == 4 and c["kept"] == 2


def test_the_host_decides_at_the_first_prefill_or_chunk_end_within_rt():
  """Prefills that end apart (20, 60 and 100 prompt tokens an instance at 1000 tok/s): the
  count is within Rt * B = 3 once the second prefill has ended (uids 0, 3 and 4 done), not only
  after the last one. And a chunk that ends before a later prefill can bring it there first:
  the host decides then, not at that prefill's end."""
  cost = measured_cost(migration=1e12)
  res = run(cost, [10, 30, 50, 10, 30, 50], [1, 40, 40, 1, 1, 1], num_instances=3, slots=2,
            threshold=0.5, stream_inference=True)
  [c] = res.consolidations
  assert c["time_s"] == pytest.approx(0.06) and c["moves"] == 1
  # Two samples of 300 prompt tokens prefill until 0.6 s; the 3-token responses on instances 1
  # and 2 finish in their first chunk, at 0.02 + 4 * 0.01 s, which leaves 5 = Rt * B unfinished.
  res = run(cost, [10, 10, 10, 300, 10, 10, 10, 300], [200, 200, 200, 1, 1, 3, 3, 1],
            num_instances=4, slots=2, threshold=5 / 8, stream_inference=True)
  assert res.consolidations[0]["time_s"] == pytest.approx(0.06)
  # A chunk that finishes nothing does not make the host decide early: here only the 300-token
  # prefills' one-token samples (done at 0.6 s) bring the count to Rt * B = 6.
  res = run(cost, [10, 10, 10, 300, 10, 10, 10, 300], [200, 200, 200, 1, 200, 200, 200, 1],
            num_instances=4, slots=4, threshold=6 / 8, stream_inference=True)
  assert res.consolidations[0]["time_s"] == pytest.approx(0.6)
  # A second consolidation (Rt = 1: the count is within from the start) is decided at a chunk
  # end after the first, once the short samples have finished and the two long ones fit on one
  # instance, never back at a time before the first.
  res = run(cost, [10] * 8, [40, 40, 5, 5, 5, 5, 5, 5], num_instances=4, slots=4,
            threshold=1.0, max_consolidations=2, stream_inference=True)
  first, second = res.consolidations
  assert first["time_s"] == pytest.approx(0.02) and first["kept"] == 2
  assert second["unfinished"] == 2 and second["kept"] == 1
  chunk_ends = {e for _, _, e, kind in res.segments if kind == "decode"}
  assert second["time_s"] > first["time_s"] and second["time_s"] in chunk_ends


def _loads_and_inference(res):
  return sorted((kind, i, float(b), float(e)) for i, b, e, kind in res.segments
                if kind in ("load", "inference"))


def test_inference_units_form_as_instances_are_freed_and_load_their_stage():
  """inference_pp=2 with offloaded frozen weights: the instances pair up in the order they
  leave generation (0 and 1 first, whatever their numbers), each loads half the weights (over
  tp * pp devices) as soon as it is free itself, and a unit computes once both have loaded."""
  cost = CostModel(get_hardware("h100_sxm"), calibration=calibration.from_dict({
      "format": calibration.FORMAT, "device": "test", "devices_share_compute": False,
      "ops": {"decode_step": {"occupied_slots": [1, 64], "seconds": [0.01, 0.01]},
              "prefill": {"tokens_per_s": 1000.0}, "inference": {"tokens_per_s": 500.0},
              "weight_load": {"bytes_per_s": 1e12}}}))
  load = cost.weight_load_s([SHAPE], 2)
  assert load == pytest.approx(cost.weight_load_s([SHAPE], 1) / 2)
  stage = lambda lens: float(stage_cost(cost, "inference_s", [stage_shape(SHAPE, 2)], [SHAPE],
                                        1, np.array(lens)))
  # Instance 1's sample decodes 16 steps (until 0.17 s); instances 0, 2 and 3 are free at
  # 0.01 s, so 0 and 2 form the first unit and 3 waits for 1.
  res = run(cost, [10] * 4, [1, 17, 1, 1], num_instances=4, slots=1, inference_microbatch=8,
            inference_pp=2, stream_inference=True, offload_frozen=True)
  s1, s2 = stage([11, 11, 11]), stage([27])
  # Stage 1 waits for stage 0's hidden states: 8 rows x (10 + 17) tokens x 4096 x 2 bytes,
  # at the formulas' point-to-point rate (this calibration has no migration).
  h = hand(cost, 0, 2, 27, inference_microbatch=8)
  assert h == pytest.approx(cost.p2p_s(8 * 27 * 4096 * 2, cross_node=False))
  t0 = 0.01 + load
  assert _loads_and_inference(res) == [
      ("inference", 0, pytest.approx(t0), pytest.approx(t0 + s1)),
      ("inference", 0, pytest.approx(0.17), pytest.approx(0.17 + s2)),
      ("inference", 2, pytest.approx(t0 + s1 + h), pytest.approx(t0 + 2 * s1 + h)),
      ("inference", 2, pytest.approx(0.17 + s2 + h), pytest.approx(0.17 + 2 * s2 + h)),
      ("load", 0, pytest.approx(0.01), pytest.approx(t0)),
      ("load", 2, pytest.approx(0.01), pytest.approx(t0))]
  # Half of the inference work ran during the tail.
  assert res.inference_overlap_frac == pytest.approx(2 * s1 / (2 * s1 + 2 * s2))
  # A unit whose instances are free at different times: each loads when it is free, and the
  # unit computes after the later load.
  res = run(cost, [10] * 2, [1, 9], num_instances=2, slots=1, inference_pp=2,
            stream_inference=True, offload_frozen=True)
  s = stage([11, 19])
  h = hand(cost, 0, 1, 19)
  assert _loads_and_inference(res) == [
      ("inference", 0, pytest.approx(0.09 + load), pytest.approx(0.09 + load + s)),
      ("inference", 1, pytest.approx(0.09 + load + s + h),
       pytest.approx(0.09 + load + 2 * s + h)),
      ("load", 0, pytest.approx(0.01), pytest.approx(0.01 + load)),
      ("load", 1, pytest.approx(0.09), pytest.approx(0.09 + load))]


def test_inference_units_stay_within_the_engines_processes():
  """instance_groups (the engine's process of each instance, trainer/rt_auto.py): a unit's
  instances are one group's. The case above with instances 0-1 on one process and 2-3 on
  another: 2 and 3 pair up at once and score everything (0 and 1 are a unit only once 1 is
  free); without groups 0 and 2 pair up (across the processes)."""
  cost = CostModel(get_hardware("h100_sxm"), calibration=calibration.from_dict({
      "format": calibration.FORMAT, "device": "test", "devices_share_compute": False,
      "ops": {"decode_step": {"occupied_slots": [1, 64], "seconds": [0.01, 0.01]},
              "prefill": {"tokens_per_s": 1000.0}, "inference": {"tokens_per_s": 500.0},
              "weight_load": {"bytes_per_s": 1e12}}}))
  kw = dict(num_instances=4, slots=1, inference_microbatch=8, inference_pp=2,
            stream_inference=True, offload_frozen=True)
  res = run(cost, [10] * 4, [1, 17, 1, 1], instance_groups=(0, 0, 1, 1), **kw)
  assert {i for i, _, _, kind in res.segments if kind == "inference"} == {2, 3}
  whole = run(cost, [10] * 4, [1, 17, 1, 1], **kw)
  assert {i for i, _, _, kind in whole.segments if kind == "inference"} == {0, 2}
  with pytest.raises(ValueError, match=r"instance_groups=\(0, 0, 0, 1\): expected a group "
                                       r"for each of the 4 instances, each group's count "
                                       r"divisible by inference_pp=2"):
    run(cost, [10] * 4, [1, 17, 1, 1], instance_groups=(0, 0, 0, 1), **kw)


def test_inference_on_a_pipeline_of_two_instances_by_hand():
  """inference_pp=2: both instances form one unit, stage k of each micro-batch on instance k
  after stage k-1, the next micro-batch entering stage 0 as soon as it is free."""
  cost = measured_cost()
  prompts, resp = [10] * 4, [1] * 4  # every sample finishes at prefill (20 tokens an instance)
  res = run(cost, prompts, resp, num_instances=2, slots=2, inference_microbatch=2,
            inference_pp=2)
  stages = [stage_shape(SHAPE, 2)]
  s = float(stage_cost(cost, "inference_s", stages, [SHAPE], 1, np.array([11, 11])))
  # The measured 500 tok/s of the whole model, scaled by the formulas' stage share (one half:
  # half the layers and half the vocabulary).
  assert s == pytest.approx(22 / 500 / 2, rel=1e-6)
  t0 = 2 * 10 / 1000
  h = hand(cost, 0, 1, 11, inference_microbatch=2)  # to stage 1
  inf = sorted((i, b, e) for i, b, e, kind in res.segments if kind == "inference")
  assert [i for i, _, _ in inf] == [0, 0, 1, 1]
  # (flat: pytest.approx compares nested tuples exactly)
  assert [x for _, b, e in inf for x in (b, e)] == pytest.approx(
      [t0, t0 + s, t0 + s, t0 + 2 * s, t0 + s + h, t0 + 2 * s + h, t0 + 2 * s + h,
       t0 + 3 * s + h])
  assert res.gen_plus_inf_s == pytest.approx(t0 + 3 * s + h)
  # One instance each (pp 1): the same work in two micro-batches side by side.
  one = run(cost, prompts, resp, num_instances=2, slots=2, inference_microbatch=2)
  assert one.gen_plus_inf_s == pytest.approx(t0 + 22 / 500)
  with pytest.raises(ValueError, match=r"generation.inference_pp=3 must divide "
                                       r"num_instances=2"):
    run(cost, prompts, resp, num_instances=2, slots=2, inference_pp=3)


def test_a_pipelines_stages_wait_for_the_hidden_states():
  """handoff_s: per frozen model, [micro-batch, width, hidden] at its act_itemsize, a copy of
  the whole to each of the tp devices (one point-to-point copy's time; a calibration's measured
  migration where it has one), across nodes where the two instances' first devices are in
  different nodes. With one model stage 1 starts after stage 0 and the copy; with several,
  each model's copy overlaps the next models' compute (the engine dispatches model by model):
  stage 1 starts max_j (d_j + h_j) after stage 0 did. A delay, not work."""
  cost = CostModel(get_hardware("h100_sxm"))
  critic = get_shape("llama-13b")
  setup = GenSetup(num_instances=4, slots=1, tp=4, inference_microbatch=8, devices_per_node=8)
  per = [8 * 1536 * h * 2 for h in (4096, 5120)]
  assert handoff_s(cost, [SHAPE, critic], setup, 0, 1, 1536) == pytest.approx(
      [cost.p2p_s(n, cross_node=False) for n in per])  # devices 0-3 and 4-7: one node
  assert handoff_s(cost, [SHAPE, critic], setup, 1, 2, 1536) == pytest.approx(
      [cost.p2p_s(n, cross_node=True) for n in per])  # devices 4-7 and 8-11
  assert cost.p2p_s(per[0], True) > 5 * cost.p2p_s(per[0], False) > 0
  # A calibration's measured instance-to-instance copy (its migration rate, bf16 units) sets it.
  measured = measured_cost(migration=2e9)
  assert handoff_s(measured, [SHAPE], setup, 0, 1, 1536) == pytest.approx([4 * per[0] / 2e9])
  # In the simulation: two instances a node each, so stage 1's hidden states cross nodes.
  kw = dict(num_instances=2, slots=2, inference_microbatch=2, inference_pp=2)
  inf = lambda r: sorted((i, b, e) for i, b, e, kind in r.segments if kind == "inference")
  for dpn in (1, 8):
    segs = inf(run(cost, [10] * 4, [1] * 4, devices_per_node=dpn, **kw))
    h = hand(cost, 0, 1, 11, inference_microbatch=2, devices_per_node=dpn)
    assert h == pytest.approx(cost.p2p_s(2 * 11 * 4096 * 2, cross_node=dpn == 1))
    # stage 1 of the first micro-batch: after stage 0's end and the copy
    assert segs[2][0] == 1 and segs[2][1] == pytest.approx(segs[0][2] + h)
    # a delay, not work: every segment as long as its stage
    assert [e - b for _, b, e in segs] == pytest.approx([segs[0][2] - segs[0][1]] * 4)
  # Two frozen models (the 7B reference, a 13B critic): stage 1 starts max_j (d_j + h_j) after
  # stage 0, d_j each model's share of the stage (by the formulas), not after all of stage 0
  # and both copies.
  two = simulate_generation(cost, SHAPE, [SHAPE, critic], GenSetup(
      max_new_tokens=1, chunk_steps=4, devices_per_node=1, **kw), np.array([10] * 4),
      np.array([1] * 4))
  s0, s1 = inf(two)[0], inf(two)[2]
  assert (s0[0], s1[0]) == (0, 1)
  dur = s0[2] - s0[1]
  stages = [stage_shape(m, 2) for m in (SHAPE, critic)]
  d = [float(cost.inference_s([st], 1, np.array([11, 11]))) for st in stages]
  assert sum(d) == pytest.approx(dur)
  h = handoff_s(cost, [SHAPE, critic], GenSetup(num_instances=2, slots=2, inference_microbatch=2,
                                                devices_per_node=1), 0, 1, 11)
  assert s1[1] == pytest.approx(s0[1] + max(d[0] + h[0], d[1] + h[1]))
  assert s1[1] < s0[2] + h[0] + h[1]  # the copies overlap compute


def test_consolidation_moves_samples_and_frees_instances():
  cost = measured_cost(migration=1e12)
  rng = np.random.default_rng(0)
  resp = np.clip(np.rint(rng.lognormal(np.log(20), 1.0, 64)), 1, 200).astype(int)
  prompts = np.full(64, 8)
  fused = run(cost, prompts, resp, num_instances=8, slots=32, threshold=0.3,
              stream_inference=True)
  base = run(cost, prompts, resp, num_instances=8, slots=32)
  assert len(fused.consolidations) == 1
  c = fused.consolidations[0]
  assert c["unfinished"] <= 0.3 * 64 and c["kept"] < 8 and c["moves"] > 0
  assert c["moved_bytes"] > 0 and len(c["released"]) >= 1
  assert not set(c["released"]) & set(c["kept_list"])
  # Every sample still finishes; decode cost here is flat in occupancy, so the tail is as fast
  # and the freed instances' inference is pure gain.
  assert np.all(np.isfinite(fused.finish_s))
  assert fused.gen_plus_inf_s < base.gen_plus_inf_s
  kinds = {k for _, _, _, k in fused.segments}
  assert {"prefill", "decode", "migrate", "inference"} <= kinds


def test_shared_processor_serialises_everything():
  cost = measured_cost(share=True)
  res = run(cost, [10] * 8, [5, 9, 13, 2, 7, 7, 3, 11], num_instances=4, slots=2)
  busy = sum(e - s for _, s, e, _ in res.segments)
  assert res.gen_plus_inf_s == pytest.approx(busy)  # one processor: no two ops overlap
  ends = sorted((s, e) for _, s, e, _ in res.segments)
  assert all(a[1] <= b[0] + 1e-12 for a, b in zip(ends, ends[1:]))


def test_choose_threshold_returns_the_best_simulated():
  cost = measured_cost()
  rng = np.random.default_rng(1)
  resp = np.clip(np.rint(rng.lognormal(np.log(20), 1.0, 64)), 1, 200).astype(int)
  setup = GenSetup(num_instances=8, slots=32, chunk_steps=4, max_new_tokens=200)
  best, times = choose_threshold(cost, SHAPE, [SHAPE], setup, np.full(64, 8), resp,
                                 (0.0, 0.2, 0.5))
  assert best in times and times[best] == min(times.values())
  # Each time is that threshold's own simulation (one threshold's time for all passed above).
  for rt in (0.0, 0.2, 0.5):
    alone = run(cost, np.full(64, 8), resp, num_instances=8, slots=32, max_new_tokens=200,
                threshold=rt, stream_inference=True)
    assert times[rt] == alone.gen_plus_inf_s, (rt, times)
  assert len(set(times.values())) == 3, times  # the threshold matters on these lengths


def test_bad_settings():
  cost = measured_cost()
  with pytest.raises(ValueError, match="num_instances\\*slots"):
    run(cost, [10] * 9, [3] * 9, num_instances=2, slots=4)
  with pytest.raises(ValueError, match="threshold"):
    GenSetup(num_instances=1, slots=1, threshold=1.5)
  with pytest.raises(ValueError, match="kv_capacity_tokens"):
    run(cost, [10] * 4, [3] * 4, num_instances=1, slots=4, kv_capacity_tokens=20)
  # A negative prompt was simulated (its KV rows read negative bytes), not refused.
  with pytest.raises(ValueError, match="prompt lengths must be >= 0, got -500"):
    run(cost, [-500, 3], [3, 3], num_instances=2, slots=1)


def test_consolidation_provisions_every_sample_for_max_new_tokens():
  """The host cannot know when a sample will stop, so the consolidation plan counts each one at
  its KV length plus max_new_tokens - generated (module docstring), never its true response
  length. Three instances of 216 KV tokens each keep one 30-token sample; after the prefill
  and one 4-step chunk each holds 8 + 5 - 1 = 12 tokens and may grow by 100 - 5 = 95, 107 in
  all: two fit on an instance (214), three do not (321), so the plan keeps 2 instances and
  moves one sample of 12 tokens (a planner that knew the lengths would pack all three on one)."""
  cost = measured_cost(migration=1e12)
  res = run(cost, [8] * 6, [30, 30, 30, 2, 2, 2], num_instances=3, slots=4, threshold=0.5,
            max_new_tokens=100, kv_capacity_tokens=216)
  assert len(res.consolidations) == 1
  c = res.consolidations[0]
  assert (c["unfinished"], c["kept"], c["moves"]) == (3, 2, 1)
  assert c["moved_bytes"] == 12 * SHAPE.kv_bytes_per_token()
  assert np.all(np.isfinite(res.finish_s))


def test_migrations_to_different_instances_run_at_once():
  """Each destination receives its rows over its own links, so a consolidation's migration
  lasts as long as the slowest destination's, not the sum. Four instances of 216 KV tokens
  each keep one 30-token sample (107 tokens provisioned, as above): two fit an instance, so
  two of them each receive one 12-token sample (6291456 bytes at 1 GB/s: 6.29 ms), at once."""
  cost = measured_cost(migration=1e9)
  res = run(cost, [8] * 8, [30] * 4 + [2] * 4, num_instances=4, slots=4, threshold=0.5,
            max_new_tokens=100, kv_capacity_tokens=216)
  c = res.consolidations[0]
  assert (c["kept"], c["moves"]) == (2, 2)
  one = 12 * SHAPE.kv_bytes_per_token() / 1e9
  assert c["migration_s"] == pytest.approx(one)
  migrations = [(st, e) for _, st, e, k in res.segments if k == "migrate"]
  assert migrations and all(e - st == pytest.approx(one) for st, e in migrations)


def test_a_migration_between_nodes_runs_over_the_network():
  """Formula costs: instance 1 (devices 4-7 at tp 4) moves its sample to instance 0 (devices
  0-3) over the inter-node link when a node holds 4 devices, over NVLink when it holds 8. (The
  instances' first devices decide: a mistake there priced every move as one inside a node.)"""
  cost = CostModel(get_hardware("h100_sxm"))
  for per_node, apart in ((4, True), (8, False)):
    res = run(cost, [8] * 4, [30, 30, 2, 2], num_instances=2, slots=2, threshold=0.5, tp=4,
              devices_per_node=per_node, max_new_tokens=100)
    c, = res.consolidations
    assert (c["kept_list"], c["moves"]) == ([0], 1)
    assert c["migration_s"] == cost.kv_migration_s(c["moved_bytes"], 4, apart, 2), per_node
  assert cost.kv_migration_s(1e6, 4, True, 2) > cost.kv_migration_s(1e6, 4, False, 2)
