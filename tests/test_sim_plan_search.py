"""sim/plan_search.py: pipelined generation by hand, the search and its asynchronous splits
against brute force, the binary."""
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from rlhfuse_jax.sim import iteration_sim as it
from rlhfuse_jax.sim import plan_search as ps
from rlhfuse_jax.sim import training_sim as train_lib
from rlhfuse_jax.sim.cost_model import GIB, CostModel
from rlhfuse_jax.sim.hardware import get_hardware
from rlhfuse_jax.sim.lengths import LengthSpec
from rlhfuse_jax.sim.shapes import get_shape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COST = CostModel(get_hardware("h100_sxm"))
ACTOR = get_shape("llama-13b")


def test_resharding_inside_one_node_never_crosses_the_network():
  """On 8 H100s (one node) the actor's weights move over NVLink: each device of an 8-device
  copy receives its eighth there, a 4-device copy on 4 of the 8 devices its quarter; they
  were charged the NICs' 50 GB/s. Two nodes still cross the network."""
  wl = it.Workload(actor=ACTOR, critic=ACTOR.as_critic(), num_devices=8, global_batch=8,
                   minibatch=8)
  w = ACTOR.weight_bytes()
  assert ps.reshard_s(COST, wl, 8) == pytest.approx(COST.p2p_s(w / 8, cross_node=False))
  assert ps.reshard_s(COST, wl, 4, receivers=4, senders=4) == pytest.approx(
      COST.p2p_s(w / 4, cross_node=False))
  two = dataclasses.replace(wl, num_devices=16)
  assert ps.reshard_s(COST, two, 8) == pytest.approx(COST.p2p_s(w / 8, cross_node=True))


def test_pipelined_generation_by_hand():
  """Equal lengths: G >= pp keeps every stage busy; G = 1 leaves pp - 1 of pp stages idle. The
  time is the cost model's stage ticks summed as the module docstring says."""
  pp, tp, n = 4, 2, 8  # one replica
  prompts = np.full(8, 100)
  resp = np.full(8, 5)
  full = ps.pipelined_generation(COST, ACTOR, n, tp, pp, 4, prompts, resp, 16)
  plain = ps.pipelined_generation(COST, ACTOR, n, tp, pp, 1, prompts, resp, 16)
  assert full["replicas"] == plain["replicas"] == 1
  assert full["stage_busy_frac"] == pytest.approx(1.0)
  assert plain["stage_busy_frac"] == pytest.approx(1 / pp)
  # 4 decode steps (tokens 1..4), each max(G, pp) ticks.
  assert full["ticks"] == 4 * 4 and plain["ticks"] == 4 * pp
  st = ps.stage_shape(ACTOR, pp)
  act = lambda rows: COST.p2p_s(rows * ACTOR.hidden_size * 2.0 / tp, False)
  tick = lambda rows, k: float(COST.decode_step_s(st, tp, rows, rows * (100 + k))) + act(rows)
  pre_g = COST.prefill_s(st, tp, [100, 100])
  want = 4 * pre_g + 3 * pre_g + sum(4 * tick(2, k) for k in range(1, 5)) + 3 * tick(2, 1)
  assert full["gen_s"] == pytest.approx(want, rel=1e-9)
  pre_1 = COST.prefill_s(st, tp, [100] * 8)
  want = pre_1 + 3 * pre_1 + sum(pp * tick(8, k) for k in range(1, 5)) + 3 * tick(8, 1)
  assert plain["gen_s"] == pytest.approx(want, rel=1e-9)
  # Ragged lengths: finished groups leave the pipeline, so the busy fraction drops below 1.
  ragged = ps.pipelined_generation(COST, ACTOR, n, tp, pp, 4, prompts,
                                   np.array([2, 9, 3, 9, 4, 9, 5, 9]), 16)
  assert 0.25 < ragged["stage_busy_frac"] < 1.0


def test_pipelined_generation_errors_name_the_layout():
  with pytest.raises(ValueError, match="pp=3 must divide llama-13b's 40 layers"):
    ps.pipelined_generation(COST, ACTOR, 12, 1, 3, 3, np.full(4, 10), np.full(4, 2), 4)
  with pytest.raises(ValueError, match=r"tp\*pp=4\*4 must divide 8 devices"):
    ps.pipelined_generation(COST, ACTOR, 8, 4, 4, 4, np.full(4, 10), np.full(4, 2), 4)


def _small():
  return it.Workload(actor=ACTOR, critic=get_shape("llama-13b", "scalar"), num_devices=16,
                     global_batch=32, minibatch=16, max_new_tokens=64,
                     prompt=LengthSpec(kind="uniform", min_len=8, max_len=64),
                     response=LengthSpec(kind="uniform", min_len=1, max_len=64))


def _rescore(wl, seq, colocated, actor, critic):
  """Async PPO's rescore on a training layout, from its definition: the actor's and the
  critic's forwards over the batch where their weights are, `actor`/`critic` = (devices, tp,
  pp); one after the other on the same devices, at once on disjoint ones."""
  a, c = (ps.inference_stage_s(COST, (shape,), d, tp, pp, seq, 8, False)
          for shape, (d, tp, pp) in ((wl.actor, actor), (wl.critic, critic)))
  return a + c if colocated else max(a, c)


def _brute_force_stages(wl, opt, frozen=None, rescore=False, kept=0.0, idle=False):
  """Every stage plan of `wl` evaluated directly, without the search's code: ([(gen_s, devices
  per generation copy)], [(inf_s, inference tp)], [train_s]). `frozen`: the inference models
  (default reference, critic, reward model). `rescore`: each train_s with its plan's async
  rescore, (train_s, rescore_s). `kept`: bytes per device that generation and training must
  fit beside. `idle`: disjoint models may leave devices idle (the synchronous search's)."""
  prompts, resp = wl.sample_lengths()
  seq = (prompts + resp).astype(float)
  n = wl.num_devices
  frozen = frozen or (wl.actor, wl.critic, wl.critic)
  gens = []
  for tp in (1, 2, 4, 8):
    if wl.actor.tensor_parallel_error(tp):  # heads that do not split
      continue
    try:
      gens.append((ps.instance_generation(COST, wl, opt, tp, prompts, resp, kept)["gen_s"], tp))
    except ValueError:
      pass
    for pp, groups in itertools.product((2, 4, 8), (1, 2, 4, 8, 16)):
      if groups not in (pp, 2 * pp) or wl.actor.num_layers % pp or n % (tp * pp):
        continue
      try:
        gens.append((ps.pipelined_generation(COST, wl.actor, n, tp, pp, groups, prompts, resp,
                                             wl.max_new_tokens, kept)["gen_s"], tp * pp))
      except ValueError:
        pass
  infs = []
  # Inference pipelines of offloaded frozen models too (pp 2, 4), as the papers' systems may lay
  # them out (not the trainer's plans: it scores on its generation instances).
  pps = (1, 2, 4) if opt.offload_frozen and not (opt.trainer_runnable or wl.kv_at_max_prompt) \
      else (1,)
  for tp, pp in itertools.product((1, 2, 4, 8), pps):
    if any(m.tensor_parallel_error(tp) or m.num_layers % pp for m in frozen):
      continue
    try:
      it.check_inference_memory(COST, wl, tp, opt.inference_microbatch, frozen, pp=pp)
      infs.append((ps.inference_stage_s(COST, frozen, n, tp, pp, seq, opt.inference_microbatch,
                                        opt.offload_frozen), tp))
    except ValueError:
      pass
  trains = []
  for tp, pa, pc in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 8, 16)):
    if (wl.actor.tensor_parallel_error(tp) or wl.critic.tensor_parallel_error(tp) or
        wl.actor.num_layers % pa or wl.critic.num_layers % pc):  # whole heads, whole layers
      continue
    try:
      plan = train_lib.TrainPlan(n, wl.minibatch, tp, pa, pc, 1)
      costs = train_lib.step_costs(COST, wl.actor, wl.critic, plan, float(seq.mean()),
                                   resident_bytes=kept)
    except ValueError:
      continue
    if pc <= pa <= wl.actor.num_layers:
      t = train_lib.pipeline_train_s(costs, wl.num_minibatches, False)["train_s"]
      trains.append((t, _rescore(wl, seq, True, (n, tp, pa), (n, tp, pc))) if rescore else t)
  for s, q in train_lib.disjoint_splits(COST, wl.actor, wl.critic, n, wl.minibatch, 1,
                                        float(seq.mean()), resident_bytes=kept, idle=idle):
    a, c = q["actor"], q["critic"]
    trains.append((s * wl.num_minibatches, _rescore(
        wl, seq, False, (a["devices"], a["tp"], a["pp"]), (c["devices"], c["tp"], c["pp"])))
                  if rescore else s * wl.num_minibatches)
  return gens, infs, trains


def _brute_force_best(wl, opt, inf_s, kept=0.0):
  """The cheapest iteration with an inference stage of `inf_s`, generation and training fitting
  beside `kept` bytes per device, every combination evaluated directly."""
  gens, _, trains = _brute_force_stages(wl, opt, kept=kept, idle=True)
  if not (gens and trains):
    return float("inf")
  brute = min(g + ps.reshard_s(COST, wl, copy) for g, copy in gens) + inf_s + min(trains)
  # Instances of tp t on a colocated, unpipelined training layout of tp t hold their shards
  # already: no resharding.
  prompts, resp = wl.sample_lengths()
  mean_len = float((prompts + resp).mean())
  for tp in (1, 2, 4, 8):
    if wl.actor.tensor_parallel_error(tp) or wl.critic.tensor_parallel_error(tp):
      continue
    try:
      g = ps.instance_generation(COST, wl, opt, tp, prompts, resp, kept)["gen_s"]
      costs = train_lib.step_costs(COST, wl.actor, wl.critic,
                                   train_lib.TrainPlan(wl.num_devices, wl.minibatch, tp, 1, 1, 1),
                                   mean_len, resident_bytes=kept)
    except ValueError:
      continue
    brute = min(brute, g + inf_s + train_lib.pipeline_train_s(costs, wl.num_minibatches,
                                                              False)["train_s"])
  return brute


def test_search_finds_the_brute_force_optimum_on_a_small_cluster():
  """Every combination of generation layout (instances or pipeline), inference tp and training
  layout (colocated pipelines or a disjoint split), evaluated directly: the search's best plan
  is the cheapest of them."""
  wl, opt = _small(), it.SimOptions(gen_tps=(1, 2, 4, 8))
  gens, infs, trains = _brute_force_stages(wl, opt)
  brute = _brute_force_best(wl, opt, min(i for i, _ in infs))
  assert len(gens) * len(infs) * len(trains) > 20
  res = ps.search(COST, wl, opt)
  assert res["best"]["predicted"]["iteration_s"] == pytest.approx(brute, rel=1e-12)
  assert [p["predicted"]["iteration_s"] for p in res["top"]] == sorted(
      p["predicted"]["iteration_s"] for p in res["top"])
  assert res["uniform"]["predicted"]["reshard_s"] == 0.0
  assert "async" not in res  # staleness 0: the synchronous search only


def test_the_search_leaves_training_devices_idle_where_that_is_faster(monkeypatch):
  """Every plan used all the devices (docs/simulator.md's known limit): 13B/13B on 48 H100s,
  mini-batch 6, trained each model on 24 devices (tp2 pp4 dp3) whose gradient all-reduce costs
  more than its shorter pipeline saves. The search now lets a disjoint model use fewer of its
  devices: each on 16 (tp4 pp4 dp1, no all-reduce), 16 of the 48 idle while it trains, the
  same generation and inference, 3 % faster than the best plan that uses all 48, and it fits
  in memory."""
  wl = it.Workload(actor=ACTOR, critic=get_shape("llama-13b", "scalar"), num_devices=48,
                   global_batch=12, minibatch=6, max_new_tokens=64,
                   prompt=LengthSpec(kind="uniform", min_len=8, max_len=64),
                   response=LengthSpec(kind="uniform", min_len=1, max_len=64))
  opt = it.SimOptions()
  best = ps.search(COST, wl, opt)["best"]
  train = best["training"]
  assert train["placement"] == "disjoint"
  assert [(q["devices"], q["tp"], q["pp"], q["dp"]) for q in (train["actor"], train["critic"])
          ] == [(16, 4, 4, 1)] * 2
  assert all(r["total"] <= r["usable"] for r in ps.plan_memory(COST, wl, opt, best))
  # The best that uses all 48: the search with every model on all of its share.
  splits = train_lib.disjoint_splits
  monkeypatch.setattr(train_lib, "disjoint_splits",
                      lambda *a, **k: splits(*a, **{**k, "idle": False}))
  busy = ps.search(COST, wl, opt)["best"]
  assert [busy["training"][r]["devices"] for r in ("actor", "critic")] == [24, 24]
  assert (busy["generation"], busy["inference"]) == (best["generation"], best["inference"])
  assert best["predicted"]["iteration_s"] < 0.97 * busy["predicted"]["iteration_s"]


@pytest.mark.parametrize("field, value", [("chunk_steps", 0), ("inference_microbatch", -3),
                                          ("inference_microbatch", 0), ("gen_tps", (0,))])
def test_bad_sim_options_are_refused_by_name(field, value):
  """A bad knob is an error naming it, not a silent plan: chunk_steps=0 made every instance
  plan a refusal and the search returned a pipeline, inference_microbatch=-3 timed the
  inference stage as nothing but the weight load."""
  with pytest.raises(ValueError, match=rf"^config\.sim\.{field}="):
    ps.search(COST, _small(), it.SimOptions(**{field: value}))


def test_frozen_weights_kept_on_the_devices_bound_generation_and_training():
  """sim.offload_frozen=False: the frozen reference and reward model stay in the inference
  layout (a copy over each inference instance's tp devices) while generation and training run.
  The search's best plan is the brute-force best over the inference plans of every generation
  and training plan evaluated beside that inference plan's share of them; plans that fit only
  without them are refused naming them. Until 2026-11-30 the search charged generation and
  training nothing for them, and here (33B/13B on 16 H100s) chose a plan 2 % faster than any
  that fits."""
  wl = dataclasses.replace(_small(), actor=get_shape("llama-33b"), global_batch=64,
                           minibatch=32, max_new_tokens=256,
                           response=LengthSpec(kind="uniform", min_len=1, max_len=256))
  opt = it.SimOptions(gen_tps=(1, 2, 4, 8), offload_frozen=False)
  _, infs, _ = _brute_force_stages(wl, opt)
  assert [tp for _, tp in infs] == [2, 4]  # tp 1 cannot hold the three models; 52 heads
  share = lambda tp: (wl.actor.weight_bytes() + wl.critic.weight_bytes()) / tp  # noqa: E731
  brute = min(_brute_force_best(wl, opt, i, share(tp)) for i, tp in infs)
  res = ps.search(COST, wl, opt)
  assert res["best"]["predicted"]["iteration_s"] == pytest.approx(brute, rel=1e-12)
  # Charging nothing finds faster plans, which do not fit.
  assert min(_brute_force_best(wl, opt, i) for i, _ in infs) < brute * 0.99
  refused = {k: v for k, v in res["rejected"].items() if " beside " in k}
  assert refused and all("GiB of frozen weights" in k for k in refused)
  assert any("sim.offload_frozen=False" in v for v in refused.values())


def test_no_feasible_plan_names_each_stage_its_closest_plan_and_what_makes_room():
  """13B/13B on 16 devices of 16 GB: generation fits, no training plan does. The refusal
  printed the whole dict of rejections on one line (21 kB for a 14B pair on 4 GB devices), and
  the colocated training plans as one string; it names each stage without a plan, its count,
  the plan closest to fitting and what makes room, and logs every rejection on a line."""
  hw = dataclasses.replace(get_hardware("h100_sxm"), name="h100_16g", hbm_bytes=16e9)
  lines = []
  with pytest.raises(ValueError) as e:
    ps.search(CostModel(hw), _small(), it.SimOptions(gen_tps=(1, 2, 4, 8)), log=lines.append)
  msg = str(e.value)
  assert msg.startswith("plan search: no feasible plan of llama-13b + llama-13b-critic on 16 "
                        "x h100_16g (16 GB per device): no training plan fits ("), msg
  assert "no generation plan" not in msg and "no inference plan" not in msg
  train = re.search(r"no training plan fits \((\d+) rejected; the closest: training (\S+): "
                    r"training .* needs ([0-9.]+) GiB per device .*; room: more devices "
                    r"\(config\.num_devices\) for more stages and tensor devices\)", msg)
  assert train, msg
  rejected = [m for m in lines if m.startswith("rejected training tp")]
  assert len(rejected) > 10  # each colocated plan on its own line, and the disjoint splits
  assert int(train.group(1)) == len(rejected) + 1
  assert any(m.startswith("rejected training disjoint: ") for m in lines)
  needs = [float(re.search(r"needs ([0-9.]+) GiB", m).group(1)) for m in rejected
           if "needs" in m]
  assert float(train.group(3)) == min(needs)
  assert f"rejected training {train.group(2)}: " in "\n".join(lines)
  assert "{" not in msg and len(msg) < 2000, msg
  assert msg.endswith(f"Each of the {sum(m.startswith('rejected ') for m in lines)} rejected "
                      "plans and why: the 'rejected' lines above."), msg
  # A tensor degree the heads refuse was skipped in silence: "no generation plan fits (0
  # rejected; ...)" for sim.gen_tps=8 and a 28-head actor. Named, without memory advice.
  from rlhfuse_jax.sim.shapes import ModelShape
  q7 = ModelShape("q7", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                  num_layers=28, num_heads=28, num_kv_heads=4)
  wl = dataclasses.replace(_small(), actor=q7, critic=q7.as_critic())
  with pytest.raises(ValueError) as e:
    ps.search(COST, wl, it.SimOptions(gen_tps=(8,)))
  assert str(e.value) == (
      "plan search: no feasible plan of q7 + q7-critic on 16 x h100_sxm (80 GB per device): no "
      "generation plan fits (1 rejected; gen tp8: tp8 does not divide q7's num_heads=28, "
      "num_kv_heads=4 (config.sim.gen_tps)).")


def small_workload():
  """A 1024-wide, 8-layer model pair on 8 GPUs (64 samples, responses of ~32 tokens)."""
  from rlhfuse_jax.sim.shapes import ModelShape
  small = ModelShape("small", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                     num_layers=8, num_heads=8, num_kv_heads=8)
  return it.Workload(actor=small, critic=small.as_critic(), num_devices=8, global_batch=64,
                     minibatch=16, max_new_tokens=64,
                     prompt=LengthSpec(kind="constant", value=32, max_len=32),
                     response=LengthSpec(kind="lognormal", median=32, sigma=0.5))


def test_a_plan_on_the_training_layout_pays_no_resharding_and_uniform_can_win():
  """A small model on 8 GPUs: instances of tp 1 over a colocated tp-1 training layout are the
  uniform tp1 pp1 layout and cost the same (no resharding charged for weights already in
  place). 13B on 16 GPUs, a batch of 16 with responses of at most 8 tokens: the uniform tp4
  pp4 layout, which pays no resharding of the actor between nodes, is the fastest, and
  pipe_rlhf's simulated row takes it. (On the small model it won until 2026-12-05 (bl), while
  the per-stage inference plans had no pipelines: its own inference pipeline loaded a quarter
  of the offloaded weights a device.)"""
  wl = dataclasses.replace(small_workload(), max_new_tokens=32)
  res = ps.search(COST, wl, it.SimOptions(), top_k=2000)
  same = [p["predicted"] for p in res["top"] if p["summary"].startswith("gen instances tp1 ")
          and p["summary"].endswith("training colocated tp1 Pa/Pc=1/1")]
  assert same and same[0]["reshard_s"] == 0.0
  # With inference on the same tp-1 instances, the uniform tp1 pp1 layout's time exactly.
  inf_tp1 = dict(res["stages"]["inference"])["tp1"]
  assert same[0]["gen_s"] + inf_tp1 + same[0]["train_s"] == pytest.approx(
      dict(res["stages"]["uniform"])["tp1 pp1"], rel=1e-12)
  wl = dataclasses.replace(_small(), global_batch=16, max_new_tokens=8,
                           response=LengthSpec(kind="uniform", min_len=1, max_len=8))
  res = ps.search(COST, wl, it.SimOptions())
  assert res["best"]["predicted"]["reshard_s"] > 0  # the fastest per-stage plan reshards
  u = res["uniform"]["predicted"]["iteration_s"]
  assert res["uniform"]["layout"]["pp"] > 1 and u < res["best"]["predicted"]["iteration_s"]
  rows, _ = it.simulate_iteration(COST, wl, it.SimOptions(),
                                  systems=("pipe_rlhf", "pipe_rlhf_async"))
  assert rows["pipe_rlhf"]["iteration_s"] == pytest.approx(u, rel=1e-12)
  # Asynchronous PPO falls back on the synchronous plan, here the uniform layout, colocated:
  # run asynchronously, without the critic on the instances and with the rescore on its
  # training layout (since 2026-12-07; u before), which here is faster (the critic's offloaded
  # weights are not loaded for inference: 0.111 -> 0.074 s, for 0.024 s of rescore).
  a = rows["pipe_rlhf_async"]
  assert a["details"]["async"]["colocated"] and a["details"]["plan"]["uniform"]
  lay = res["uniform"]["layout"]
  want = ps.async_colocated_predicted(
      COST, wl, it.SimOptions(), res["uniform"]["predicted"], lay,
      {"placement": "colocated", "devices": 16, "tp": lay["tp"], "actor_pp": lay["pp"],
       "critic_pp": lay["pp"]})
  assert a["iteration_s"] == pytest.approx(want["iteration_s"], rel=1e-12)
  assert a["inf_s"] < rows["pipe_rlhf"]["inf_s"] and a["train_s"] > rows["pipe_rlhf"]["train_s"]


def _small_async():
  """7B models on 16 devices: four splits in steps of 2 fit, generation- and training-bound."""
  return dataclasses.replace(_small(), actor=get_shape("llama-7b"),
                             critic=get_shape("llama-7b", "scalar"))


def test_async_search_picks_the_brute_force_best_split():
  """Asynchronous PPO on 16 devices split in steps of 2: for every split, every generation x
  inference plan (reference and reward model) on the generation group against the fastest
  training plan on the others plus the rescoring with the current actor and critic there,
  iteration = max(gen + inference, rescore + train) + the actor's reshard, each evaluated
  directly; the search's async plan is the cheapest of them and of the synchronous plan."""
  wl, opt = _small_async(), it.SimOptions(gen_tps=(1, 2, 4, 8))
  res = ps.search(COST, wl, opt, staleness=2, split_unit=2)
  brute, fitting = [(res["best"]["predicted"]["iteration_s"], 16)], []
  for g in range(2, 16, 2):
    gens, infs, _ = _brute_force_stages(dataclasses.replace(wl, num_devices=g), opt,
                                        frozen=(wl.actor, wl.critic))
    trains = _brute_force_stages(dataclasses.replace(wl, num_devices=16 - g), opt,
                                 rescore=True)[2]
    if not (gens and infs and trains):
      continue
    fitting.append(g)
    for (gen_s, copy), (inf_s, tp) in itertools.product(gens, infs):
      move = wl.actor.weight_bytes() / copy
      brute.append((max(gen_s + inf_s, min(t + r for t, r in trains)) +
                    COST.p2p_s(move, True), g))
  a = res["async"]
  assert len(fitting) >= 3 and a["staleness"] == 2
  assert [sp["generation_devices"] for sp in a["splits"]] == list(range(2, 16, 2))
  assert {sp["bound"] for sp in a["splits"] if "iteration_s" in sp} == {"generation",
                                                                        "training"}
  assert sorted(sp["generation_devices"] for sp in a["splits"] if "iteration_s" in sp) == fitting
  best_s, best_g = min(brute)
  assert a["best"]["predicted"]["iteration_s"] == pytest.approx(best_s, rel=1e-12)
  assert a["best"]["async"]["generation_devices"] == best_g
  # The search may choose the synchronous plan (colocated): never worse than it; here a split
  # is strictly better.
  assert a["best"]["predicted"]["iteration_s"] < res["best"]["predicted"]["iteration_s"]
  assert not a["best"]["async"]["colocated"]


def test_the_async_search_says_how_far_it_is(monkeypatch):
  """The splits of thousands of devices take minutes (4096: 81 s), which were silent: a line
  every PROGRESS_S (0 here: one before each split) counts the splits tried and those that fit."""
  monkeypatch.setattr(ps, "PROGRESS_S", 0.0)
  lines = []
  ps.search(COST, _small_async(), it.SimOptions(gen_tps=(1, 2, 4, 8)), staleness=2,
            split_unit=2, log=lines.append)
  progress = [ln for ln in lines if "splits tried" in ln]
  assert [ln.split(": ")[1].split(" splits")[0] for ln in progress] == [
      f"{i} of 7" for i in range(7)], lines
  assert progress[0].startswith("async plan search (k=2): 0 of 7 splits tried, 0 fit (")
  assert not progress[-1].split("tried, ")[1].startswith("0 fit")


def test_async_iteration_is_max_of_the_groups_plus_reshard():
  """Each split's plan: max(gen + inference, train) + reshard, from the component times the
  code computes on each group's devices; serial_s is their sum."""
  wl, opt = _small_async(), it.SimOptions(gen_tps=(1, 2, 4, 8))
  prompts, resp = wl.sample_lengths()
  seq = (prompts + resp).astype(float)
  a = ps.search(COST, wl, opt, staleness=1, split_unit=2)["async"]
  disjoint = [p for p in a["top"] if not p["async"]["colocated"]]
  assert len(disjoint) >= 3
  for p in disjoint:
    q, g = p["predicted"], p["async"]["generation_devices"]
    assert p["async"]["training_devices"] == 16 - g and p["async"]["staleness"] == 1
    gp, ip = p["generation"], p["inference"]
    wg = dataclasses.replace(wl, num_devices=g)
    if gp["mode"] == "instances":
      gen_s = ps.instance_generation(COST, wg, opt, gp["tp"], prompts, resp)["gen_s"]
    else:
      gen_s = ps.pipelined_generation(COST, wl.actor, g, gp["tp"], gp["pp"], gp["groups"],
                                      prompts, resp, wl.max_new_tokens)["gen_s"]
    inf_s = ps.inference_stage_s(COST, (wl.actor, wl.critic), g, ip["tp"], ip.get("pp", 1),
                                 seq, opt.inference_microbatch, opt.offload_frozen)
    t = p["training"]
    if t["placement"] == "colocated":
      rescore = _rescore(wl, seq, True, (16 - g, t["tp"], t["actor_pp"]),
                         (16 - g, t["tp"], t["critic_pp"]))
    else:
      a, c = t["actor"], t["critic"]
      rescore = _rescore(wl, seq, False, (a["devices"], a["tp"], a["pp"]),
                         (c["devices"], c["tp"], c["pp"]))
    assert q["rescore_s"] == pytest.approx(rescore, rel=1e-12)
    # The training plan with its rescore is the group's fastest pair.
    train_s = rescore + next(c.seconds for c in ps.training_candidates(
        COST, dataclasses.replace(wl, num_devices=16 - g), float(seq.mean()), {})
        if c.plan == t)
    assert train_s == pytest.approx(min(tr + r for tr, r in _brute_force_stages(
        dataclasses.replace(wl, num_devices=16 - g), opt, rescore=True)[2]), rel=1e-12)
    # The actor's weights from the training group's 16 - g devices into g (reshard_s).
    copy, w = gp["tp"] * gp["pp"], wl.actor.weight_bytes()
    spread = max(copy, COST.hw.devices_per_node)
    reshard = max(COST.p2p_s(max(w / spread, g / spread * w / (16 - g)), True),
                  COST.p2p_s(w / copy, False) if copy < COST.hw.devices_per_node else 0.0)
    assert (q["gen_s"], q["inf_s"], q["train_s"]) == pytest.approx((gen_s, inf_s, train_s))
    assert q["reshard_s"] == pytest.approx(reshard, rel=1e-12)
    assert q["iteration_s"] == pytest.approx(max(gen_s + inf_s, train_s) + reshard, rel=1e-12)
    assert q["serial_s"] == pytest.approx(gen_s + inf_s + train_s + reshard, rel=1e-12)
    assert q["bound"] == ("generation" if gen_s + inf_s >= train_s else "training")


def test_colocated_groups_gain_nothing():
  """Both groups on all devices overlap nothing: the serial sum, so with no split to try the
  async plan is the synchronous one, its instances scoring without the critic and its
  training devices rescoring first (since 2026-12-07: the synchronous time before); a
  staleness below 1 is refused."""
  assert ps.async_iteration_s(5.0, 3.0, 0.5, colocated=True) == 8.5
  assert ps.async_iteration_s(5.0, 3.0, 0.5, colocated=False) == 5.5
  assert ps.async_splits(COST, 16) == [8] and ps.async_splits(COST, 16, 4) == [4, 8, 12]
  wl, opt = _small(), it.SimOptions(gen_tps=(1, 2, 4, 8))
  res = ps.search(COST, wl, opt, staleness=1, split_unit=16)
  a = res["async"]
  assert a["splits"] == [] and a["best"]["async"]["colocated"]
  q, got = res["best"]["predicted"], a["best"]["predicted"]
  assert a["best"]["summary"] == res["best"]["summary"]
  assert got["iteration_s"] == pytest.approx(
      q["reshard_s"] + q["gen_s"] + got["inf_s"] + q["train_s"] + got["rescore_s"], rel=1e-12)
  assert got["serial_s"] == got["iteration_s"] and got["rescore_s"] > 0
  with pytest.raises(ValueError, match="staleness=0 must be an integer >= 1"):
    ps.async_search(COST, wl, opt, 0, res["best"])


def test_an_async_split_without_a_generation_plan_says_why():
  """A split whose generation group has no plan read "no generation plan on 8 devices: nothing
  fits": its rejections are keyed "gen ..." and the reason was looked up under "generation".
  With sim.gen_tps=8 and a 28-head actor it names the tensor degree the heads refuse."""
  from rlhfuse_jax.sim.shapes import ModelShape
  q7 = ModelShape("q7", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                  num_layers=28, num_heads=28, num_kv_heads=4)
  wl = dataclasses.replace(_small(), actor=q7, critic=q7.as_critic(), global_batch=64)
  sync_best = {"predicted": {"gen_s": 5.0, "inf_s": 0.0, "reshard_s": 0.0, "train_s": 5.0,
                             "iteration_s": 10.0},
               # (its layouts: the colocated option's memory is checked, with the actor's copy)
               "generation": {"mode": "instances", "tp": 4, "pp": 1, "groups": 1, "slots": 16},
               "inference": {"tp": 4, "pp": 1},
               "training": {"placement": "colocated", "devices": 16, "tp": 4, "actor_pp": 2,
                            "critic_pp": 2}}
  res = ps.async_search(COST, wl, it.SimOptions(gen_tps=(8,)), 1, sync_best, split_unit=4)
  gen = [s["rejected"] for s in res["splits"] if "no generation plan" in s["rejected"]]
  assert gen, res["splits"]
  for why in gen:
    assert re.fullmatch(r"no generation plan on \d+ devices: tp8 does not divide q7's "
                        r"num_heads=28, num_kv_heads=4 \(config\.sim\.gen_tps\)", why), why


def test_trainer_refusal_names_what_the_trainer_cannot_run():
  """sim.trainer_runnable's rules on hand-made plans of 13B models on 16 devices (batch 32,
  mini-batch 16), and the restricted search: only plans they let through, the fastest first,
  no faster than the unrestricted search's."""
  wl = _small()
  inst = {"mode": "instances", "tp": 2, "pp": 1, "groups": 1, "slots": 4}
  ok = {"generation": inst, "inference": {"tp": 2, "pp": 1},
        "training": {"placement": "colocated", "tp": 2, "actor_pp": 2, "critic_pp": 1}}
  assert ps.trainer_refusal(wl, ok) is None
  pipe = {"mode": "pipeline", "tp": 1, "pp": 8, "groups": 8, "slots": 32}
  split = {"generation_devices": 8, "training_devices": 8, "staleness": 1, "colocated": False}
  assert ps.trainer_refusal(wl, {**ok, "generation": pipe, "async": split}) is None
  for change, match in [
      ({"training": {"placement": "disjoint", "actor": {}, "critic": {}}}, "disjoint training"),
      ({"training": {"placement": "colocated", "tp": 2, "actor_pp": 16, "critic_pp": 1}},
       "Pa/Pc=16/1 with 40 actor"),
      ({"async": {**split, "generation_devices": 4, "training_devices": 12}},
       "tp2 x Pa2 on 12 devices: the data-parallel size does not divide the mini-batch of 16"),
      ({"inference": {"tp": 1, "pp": 1}}, "inference tp1 after instances of tp2"),
      ({"generation": {**inst, "slots": 3}}, "3 slots per instance for a batch of 32"),
      ({"generation": {**pipe, "pp": 8}}, "pp8 on 16 devices .* not 2 replicas"),
      ({"generation": {**pipe, "tp": 2}}, "pipelined generation with tp2"),
      ({"generation": {**pipe, "groups": 5}, "async": split}, "G=5"),
      ({"async": {**split, "generation_devices": 6, "training_devices": 10}},
       "batch of 32 does not split over 6 generation devices")]:
    why = ps.trainer_refusal(wl, {**ok, **change})
    assert why is not None and re.search(match, why), (change, why)
  opt = it.SimOptions(gen_tps=(1, 2, 4, 8))
  free = ps.search(COST, wl, opt, top_k=3)
  res = ps.search(COST, wl, dataclasses.replace(opt, trainer_runnable=True), top_k=3,
                  staleness=1, split_unit=4)
  assert all(ps.trainer_refusal(wl, p) is None for p in res["top"] + res["async"]["top"])
  times = [p["predicted"]["iteration_s"] for p in res["top"]]
  assert times == sorted(times) and times[0] >= free["best"]["predicted"]["iteration_s"]
  assert sum(res["refused"].values()) > 0 and free["refused"] == {}


def test_trainer_refusal_keeps_pipelined_generation_to_one_host():
  """train_ppo refuses plan.generation='pipeline' on several processes (trainer/rollout.
  check_plan: the pipeline and its inference mesh run in one process), but trainer_refusal let
  such plans through on hardware of several hosts (16 H100s, 8 a host; a TPU v5p's 4 chips a
  host): plan_search:train listed them among the plans train_ppo runs, and could write one to
  plan.json."""
  wl = _small()
  pipe = {"generation": {"mode": "pipeline", "tp": 1, "pp": 8, "groups": 8, "slots": 32},
          "inference": {"tp": 2, "pp": 1},
          "training": {"placement": "colocated", "tp": 2, "actor_pp": 2, "critic_pp": 1},
          "async": {"generation_devices": 8, "training_devices": 8, "staleness": 1,
                    "colocated": False}}
  assert ps.trainer_refusal(wl, pipe) is None  # one host (no host size given)
  assert ps.trainer_refusal(wl, pipe, host_devices=16) is None  # the 16 devices on one host
  why = ps.trainer_refusal(wl, pipe, host_devices=8)
  assert why is not None and why.startswith("pipelined generation on 2 hosts of 8"), why
  inst = {**pipe, "generation": {"mode": "instances", "tp": 2, "pp": 1, "groups": 1,
                                 "slots": 8}}
  assert ps.trainer_refusal(wl, inst, host_devices=8) is None  # instances run on several
  # The search on 8 TPU v5p chips (2 hosts of 4) of an 8-layer 7B: pipelined generation plans
  # were about 160 of its 220 runnable ones (one host's H100s keep theirs).
  eight = dataclasses.replace(get_shape("llama-7b"), num_layers=8)
  wl = dataclasses.replace(wl, actor=eight, critic=eight.as_critic(), num_devices=8,
                           global_batch=64, minibatch=32)
  opt = it.SimOptions(trainer_runnable=True, offload_frozen=False)
  modes = {hw: {p["generation"]["mode"] for p in ps.search(
      CostModel(get_hardware(hw)), wl, opt, top_k=1000)["top"]} for hw in ("tpu_v5p", "h100_sxm")}
  assert modes == {"tpu_v5p": {"instances"}, "h100_sxm": {"instances", "pipeline"}}, modes


def test_trainer_refusal_wants_an_equal_generation_share_of_every_host():
  """An asynchronous split's generation group is g / P devices of each of P processes
  (trainer/async_ppo.split_devices refuses a g that is not a multiple of P), but trainer_refusal
  let 1 or 3 generation devices through on 2 hosts of 8 (batches of 15 and 39 divide over them
  and over the 15 or 13 training devices)."""
  a = get_shape("llama-7b")
  wl = dataclasses.replace(_small(), actor=a, critic=a.as_critic(), global_batch=15,
                           minibatch=15)
  plan = {"generation": {"mode": "instances", "tp": 1, "pp": 1, "groups": 1, "slots": 15},
          "inference": {"tp": 1, "pp": 1},
          "training": {"placement": "colocated", "tp": 1, "actor_pp": 1, "critic_pp": 1},
          "async": {"generation_devices": 1, "training_devices": 15, "staleness": 1,
                    "colocated": False}}
  assert ps.trainer_refusal(wl, plan) is None  # one host
  why = ps.trainer_refusal(wl, plan, host_devices=8)
  assert why is not None and why.startswith("a generation group of 1 devices on 2 hosts of 8"), (
      why)
  three = {**plan, "async": {**plan["async"], "generation_devices": 3, "training_devices": 13}}
  wl39 = dataclasses.replace(wl, global_batch=39, minibatch=13)
  assert ps.trainer_refusal(wl39, three) is None
  why = ps.trainer_refusal(wl39, three, host_devices=8)
  assert why is not None and why.startswith("a generation group of 3 devices on 2 hosts"), why
  two = {**plan, "async": {**plan["async"], "generation_devices": 2, "training_devices": 14}}
  assert ps.trainer_refusal(dataclasses.replace(wl, global_batch=14, minibatch=14), two,
                            host_devices=8) is None  # one device of each host


def test_binary_searches_for_the_runs_devices_per_process(tmp_path):
  """plan_search:train searched for the hardware's hosts (8 H100s) whatever the run's processes
  hold: a tp8 instance it wrote to plan.json was refused by train_ppo on 2 processes x 4
  devices (launch/local_multiprocess.sh 2 4), and nothing said so. --config.devices_per_host
  gives the run's devices a process (plan.json records it), and without it a plan that the
  trainer refuses on smaller processes is said (a line at info level), naming the flag."""
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
         "JAX_PLATFORMS": "cpu"}
  heads = [f"--run_config.{m}.{f}=8" for m in ("model", "critic_model")
           for f in ("num_heads", "num_kv_heads")]
  args = [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:train",
          "--config.systems=", "--config.sim.staleness=0", "--run_config=configs/ppo_tiny.py",
          *heads, "--config.sim.gen_tps=8"]
  run = lambda wd, *more: subprocess.run([*args, f"--workdir={tmp_path / wd}", *more], cwd=ROOT,
                                         env=env, capture_output=True, text=True, timeout=300)
  out = run("hosts_of_8")
  assert out.returncode == 0, out.stderr[-3000:]
  plan = json.loads((tmp_path / "hosts_of_8" / "plan.json").read_text())
  assert plan["generation"]["tp"] == 8 and plan["hardware"]["devices_per_host"] == 0, plan
  assert ("was searched for processes of 8 devices (the host of config.hardware='h100_sxm'), "
          "as one process on them all runs it; a multi-process run whose processes drive 4 or "
          "2 or 1 devices refuses it (on 4: generation instances "
          "of tp8 on 4 generation devices a process (2 hosts of 4; an instance is one "
          "process's)): for such a run (launch/local_multiprocess.sh N D: D devices a process) "
          "search with --config.devices_per_host=D") in out.stderr, out.stderr[-3000:]
  out = run("hosts_of_4", "--config.devices_per_host=4")  # tp8 only: nothing runs on 4
  assert out.returncode == 1, out.stderr[-3000:]
  assert ("x generation instances of tp8 on 4 generation devices a process (2 hosts of 4"
          in out.stderr), out.stderr[-3000:]
  out = run("hosts_of_4", "--config.devices_per_host=4", "--config.sim.gen_tps=1,2,4,8")
  assert out.returncode == 0, out.stderr[-3000:]
  plan = json.loads((tmp_path / "hosts_of_4" / "plan.json").read_text())
  assert plan["hardware"]["devices_per_host"] == 4 and plan["generation"]["tp"] <= 4, plan
  assert "devices_per_host=D" not in out.stderr, out.stderr[-3000:]
  out = run("bad", "--config.devices_per_host=3")
  assert out.returncode == 1 and (
      "config.devices_per_host=3: expected the devices of each of the run's processes, an "
      "integer >= 1 dividing config.num_devices=8") in out.stderr, out.stderr[-3000:]
  assert not (tmp_path / "bad").exists()


def test_binary_searches_alone_with_no_systems(tmp_path):
  """`--config.systems=` (configs/plan_search.py: "" for none) was refused ("must list at least
  one item"): the plan search runs alone, synchronous plans only with sim.staleness=0, and
  the default systems with staleness 0 say how to get that. (The refusal is
  AblationConfig.from_config_dict's, plan_search's first reading of its config, as the run
  below shows: checked in-process, without a second 2 s start of the binary.)"""
  from configs import plan_search as plan_search_config
  from rlhfuse_jax.sim import ablations
  c = plan_search_config.get_config("13b/13b")
  c.num_devices, c.global_batch, c.minibatch, c.max_new_tokens = 8, 16, 8, "64"
  c.sim.search_time_s, c.sim.staleness = 0.2, 0
  with pytest.raises(ValueError) as refused:
    ablations.AblationConfig.from_config_dict(c, systems_optional=True)
  assert ("config.sim.staleness=0: pipe_rlhf_async (in config.systems) needs a staleness >= 1 "
          "(updates the generating policy lags behind); for a synchronous-only search leave it "
          "out of config.systems (e.g. --config.systems=pipe_rlhf") in str(refused.value)
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  args = [sys.executable, "-m", "experiments.plan_search",
          "--config=configs/plan_search.py:13b/13b", f"--workdir={tmp_path}",
          "--config.num_devices=8", "--config.global_batch=16", "--config.minibatch=8",
          "--config.max_new_tokens=64", "--config.sim.search_time_s=0.2",
          "--config.sim.staleness=0"]
  out = subprocess.run(args + ["--config.systems="], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads((tmp_path / "result.json").read_text())
  assert res["systems"] == {} and res["async"] is None and res["plan_json"] == "synchronous"
  assert "The simulator's systems" not in (tmp_path / "plan_search.md").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--config=configs/plan_search.py", "--config.top_k=0"],
     "config.top_k=0: expected an integer >= 1"),
    (["--config=configs/plan_search.py:train", "--config.train_config=configs/nope.py"],
     "config.train_config='configs/nope.py': no such file 'configs/nope.py'")])
def test_a_refused_value_leaves_the_earlier_runs_outputs_in_place(tmp_path, flags, message):
  """A value refused before the search leaves the workdir as it was: the earlier run's outputs
  were moved to previous/<n>, and a config.json of a run that never ran took their place."""
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  earlier = {"config.json": '{"top_k": 5}', "result.json": '{"best": 1}', "plan.json": "{}"}
  for name, text in earlier.items():
    (tmp_path / name).write_text(text)
  out = subprocess.run([sys.executable, "-m", "experiments.plan_search",
                        f"--workdir={tmp_path}", *flags],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and message in out.stderr, out.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == sorted([*earlier, "traceback.txt"])
  assert all((tmp_path / name).read_text() == text for name, text in earlier.items())


def test_binary_writes_plan_result_and_report(tmp_path):
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:13b/13b",
       f"--workdir={tmp_path}", "--config.num_devices=32", "--config.global_batch=64",
       "--config.minibatch=16", "--config.max_new_tokens=128", "--config.sim.search_time_s=0.2",
       "--config.systems=rlhfuse,pipe_rlhf,rlhfuse_planned,pipe_rlhf_async"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  # The systems' simulation (minutes of fused-schedule searches) is announced, then each search.
  start = out.stderr.find("simulating rlhfuse, pipe_rlhf, rlhfuse_planned, pipe_rlhf_async for "
                          "comparison (fused-schedule searches of sim.search_time_s=0.2s per "
                          "distinct pipeline shape, a first run of a checkout compiles the "
                          "search's numba kernels first, a minute or more, then caches them on "
                          "disk; --config.systems= skips them) ...")
  assert 0 <= start < out.stderr.find("fused schedule Pa/Pc=") < out.stderr.find("simulated "), \
      out.stderr[-3000:]
  res = json.loads((tmp_path / "result.json").read_text())
  plan = json.loads((tmp_path / "plan.json").read_text())
  a = res["async"]
  assert a["staleness"] == 1 and a["predicted_iteration_s"] <= res["best"]["predicted_iteration_s"]
  assert a["generation_devices"] + (0 if a["colocated"] else a["training_devices"]) == 32
  # plan.json: the faster plan, here the asynchronous one, with the synchronous plan's keys and
  # its split.
  assert res["plan_json"] == "asynchronous" and not a["colocated"]
  # and the hardware's values, and the workload it was searched for (train_ppo compares it)
  assert plan == {**a["plan"], "hardware": res["hardware"], "workload": plan["workload"]}
  assert set(plan) == {"generation", "inference", "training", "predicted", "summary", "async",
                       "hardware", "workload"}
  w = plan["workload"]
  assert (w["actor"]["num_layers"], w["actor"]["hidden_size"], w["critic"]["vocab_size"]) == (
      40, 5120, 32000) and "train_config" not in w
  assert (w["global_batch"], w["minibatch"], w["epochs"], w["max_new_tokens"],
          w["num_devices"]) == (64, 16, 1, 128, 32)
  assert plan["async"] == {"generation_devices": a["generation_devices"], "staleness": 1,
                           "training_devices": 32 - a["generation_devices"], "colocated": False}
  assert plan["predicted"]["iteration_s"] < res["best"]["predicted_iteration_s"]
  u = res["uniform"]["layout"]
  assert u["tp"] * u["pp"] * u["dp"] == 32 and res["uniform"]["predicted"]["reshard_s"] == 0
  assert res["search_s"] < 60
  sys_rows = res["systems"]
  assert sys_rows["pipe_rlhf"]["iteration_s"] == pytest.approx(res["best"]["predicted_iteration_s"])
  assert sys_rows["rlhfuse_planned"]["iteration_s"] <= sys_rows["pipe_rlhf"]["iteration_s"]
  assert sys_rows["pipe_rlhf_async"]["iteration_s"] == pytest.approx(a["predicted_iteration_s"])
  md = (tmp_path / "plan_search.md").read_text()
  assert "| uniform | one layout" in md and "| rlhfuse_planned |" in md
  # plan.json's plan's memory per device of each stage, against the usable HBM (result.json's
  # plan_memory, one row a stage, in GiB with each part named)
  mem = res["plan_memory"]
  # (an asynchronous plan's two rescoring passes on the training devices too, since
  # 2026-12-07: ps.rescore_rows)
  assert [r["stage"] for r in mem] == (
      ["generation", "inference", "training (actor)", "training (critic)"]
      if plan["training"]["placement"] == "disjoint" else
      ["generation", "inference", "training"]) + list(ps.RESCORE_STAGES.values())
  assert "Memory per device of plan.json's (asynchronous) plan, GiB" in md
  for r in mem:
    row = next(line for line in md.splitlines() if line.startswith(f"| {r['stage']} | "))
    assert f"| {r['total'] / 2**30:.2f} | {100 * r['total'] / r['usable']:.0f} % |" in row, row
  assert "weights" in md and "KV cache" in md and "optimizer" in md
  assert "Asynchronous PPO (staleness k=1" in md and "| pipe_rlhf_async |" in md
  # The counts say which plans fit ("45 stage plans evaluated, 44 rejected" read as 45 tried),
  # and the log's times are the report's: the synchronous search's, the asynchronous one's and
  # both together.
  feasible = sum(len(plans) for plans in res["stages"].values())
  assert (f"({feasible} feasible stage plans, {len(res['rejected'])} rejected for memory or "
          "divisibility)" in md)
  sync = re.search(r"synchronous plan search done in ([\d.]+)s", out.stderr).group(1)
  both = re.search(r"searched in ([\d.]+)s in all", out.stderr).group(1)
  assert both == f"{res['search_s']:.1f}"
  assert (f"Searched in {both} s in all: the synchronous plans in {sync} s" in md and
          f"the asynchronous splits in {a['search_s']:.1f} s." in md), md[:600]
  # Only generation's times include a resharding (the actor's, into its layout).
  headings = [line for line in md.splitlines() if line.startswith("Best ")]
  assert [h.split(" (")[0] for h in headings] == [f"Best {s} plans" for s in res["stages"]]
  assert [h for h in headings if "included" in h] == [
      "Best generation plans (seconds, the actor's resharding into the layout included):"]
  assert {"Best inference plans (seconds):", "Best training plans (seconds):"} <= set(headings)


def test_resharding_by_hand():
  """The actor's weights into generation copies (reshard_s), on H100 nodes of 8 (40 GB/s of
  scale-out network per GPU after net_eff, 360 GB/s of NVLink). A copy smaller than a node
  crosses the network once a node, through its 8 NICs, and spreads over NVLink: 13B at tp 1
  costs what tp 8 does (it was charged 8x, each GPU pulling a whole copy through its own NIC).
  Sending from fewer devices than receive is bound by the senders' NICs."""
  cost = CostModel(get_hardware("h100_sxm"))
  wl = it.Workload(actor=get_shape("llama-13b"), critic=get_shape("llama-13b", "scalar"))
  w, nic, nvlink = wl.actor.weight_bytes(), 50e9 * 0.8, 450e9 * 0.8
  assert cost.hw.inter_node_bw * cost.eff.net_eff == pytest.approx(nic)
  assert cost.hw.intra_node_bw * cost.eff.net_eff == pytest.approx(nvlink)
  for tp in (1, 2, 4, 8):
    assert ps.reshard_s(cost, wl, tp) == pytest.approx(w / (8 * nic), rel=0.01), tp
  assert w / (8 * nic) > w / nvlink  # tp 1: the NVLink fan-out hides under the network
  assert ps.reshard_s(cost, wl, 16) == pytest.approx(w / (16 * nic), rel=0.01)
  # Asynchronous PPO: 192 generation devices receive copies of 64 from 64 training devices:
  # 3 copies leave through 64 NICs.
  assert ps.reshard_s(cost, wl, 64, receivers=192, senders=64) == pytest.approx(
      3 * w / (64 * nic), rel=0.01)
  assert ps.reshard_s(cost, wl, 64, receivers=64, senders=192) == pytest.approx(
      w / (64 * nic), rel=0.01)


def test_the_report_says_what_a_calibration_measured_and_where_each_default_comes_from(
    tmp_path):
  """calibrate_sim's file for "your machine" fed to plan_search: plan_search.md and result.json
  said nothing of it (which costs it measured, which still come from the formulas), and the
  efficiencies were bare numbers, a changed one indistinguishable from a default."""
  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text(json.dumps({
      "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "vocab_size": 256, "max_position_embeddings": 256}))
  (tmp_path / "host.json").write_text(json.dumps({
      "base": "h100_sxm", "name": "host", "peak_flops": 1e11, "hbm_bw": 2e10, "hbm_bytes": 3e9,
      "collective_protocols": None}))
  cal = {"format": "rlhfuse_jax.sim.calibration/v1", "device": "cpu x8 (test)",
         "model_params": 106816, "instance_devices": 1, "devices_share_compute": True,
         "ops": {"decode_step": {"occupied_slots": [1, 8], "seconds": [3e-4, 3e-4]},
                 "prefill": {"tokens_per_s": 1e5}, "weight_load": {"bytes_per_s": 6e8}}}
  (tmp_path / "cal.json").write_text(json.dumps(cal))
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  wd = tmp_path / "ps"
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py",
       f"--workdir={wd}", f"--config.shapes=m={model}", "--config.pairs=m/m",
       "--config.num_devices=8", "--config.global_batch=64", "--config.minibatch=16",
       "--config.max_new_tokens=64", "--config.prompt.max_len=16", "--config.systems=",
       f"--config.hardware={tmp_path / 'host.json'}", f"--config.calibration={tmp_path}/cal.json",
       "--config.efficiency.train_mfu=0.3"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  md = (wd / "plan_search.md").read_text()
  assert (f"**Calibration** `{tmp_path}/cal.json` (cpu x8 (test)): measured, in place of the "
          "formulas: decode_step, prefill, weight_load; not measured, from the formulas with the "
          "figures and efficiencies above: train_stage, pipeline_executor, inference, "
          "migration") in md, md
  assert "| train_mfu | 0.3 | config | assumption inside published MFUs" in md
  assert "| memory_headroom | 0.9 | default | vLLM's default gpu_memory_utilization |" in md
  # What did not fit, per stage (the report gave a count only)
  res = json.loads((wd / "result.json").read_text())
  assert (f"Rejected stage plans ({len(res['rejected'])}; every one with why: result.json "
          "`rejected`), the nearest to fitting in memory per stage:") in md
  inference = [k for k in res["rejected"] if k.startswith("inference")]
  assert inference == ["inference tp1 x pp4", "inference tp2 x pp4", "inference tp4",
                       "inference tp8"], res["rejected"]
  assert ("- inference: 4 rejected (none for memory; e.g. inference tp1 x pp4: pp4 does not "
          "divide m's 2 layers") in md, md
  res = json.loads((wd / "result.json").read_text())
  assert res["calibration"]["path"] == f"{tmp_path}/cal.json"
  assert res["calibration"]["prefill"]["per_s"] == 1e5 and "train_stage" not in res["calibration"]


def test_no_plan_the_trainer_runs_lists_each_reason_with_its_count():
  """Every combination refused by the trainer's rules or checks: the error printed the dict of
  reasons on one line ("refused: {'disjoint training ...': 12, ...}"); each reason now comes
  with its count, the most frequent first (here also the combinations whose inference, or
  generation beside a disjoint plan that leaves devices idle, does not fit beside their training
  plan's state, _memory_refusal, refused before `accept` sees them)."""
  wl = _small()
  reasons = itertools.cycle(["first", "second", "second"])
  with pytest.raises(ValueError) as e:
    ps.search(COST, wl, it.SimOptions(gen_tps=(1, 2, 4, 8)), accept=lambda p: next(reasons))
  msg = str(e.value)
  head = (f"plan search: no plan of {wl.actor.name} + {wl.critic.name} on 16 devices that the "
          "trainer runs (")
  assert msg.startswith(head) and "{" not in msg, msg
  total, body = re.fullmatch(r".*\((\d+) combinations refused\): (.*)", msg).groups()
  listed = [(int(n), why) for n, why in re.findall(r"(\d+) x ([^;]+)", body)]
  assert [why for _, why in listed[:2]] == ["second", "first"], msg
  counts = [n for n, _ in listed]
  assert counts == sorted(counts, reverse=True) and counts[0] > counts[1], msg
  assert sum(counts) == int(total), msg  # (fewer than 9 reasons: each listed)
  assert all(re.fullmatch(r"(inference tp\d( x pp\d)?|generation instances tp\d \(\d+ slots\)) "
                          r"does not fit in memory beside its training plan's "
                          r"state \(both models' weights and AdamW state\)", why)
             for _, why in listed[2:]), msg


def test_training_memory_is_sized_at_the_padded_rows_the_trainer_allocates():
  """The trainer runs every training row padded to max prompt + max new tokens (Workload.
  padded_len), so each plan's activations are sized at that length, not at the mean the stage
  times use: a plan whose memory fits at the mean but not padded is rejected, naming the padded
  need, and the pipeline problem's per-micro-batch stash is the padded one. At the mean, the
  search chose plans that plan_check then measured at 85.7 GB on 48 GB devices."""
  a = get_shape("llama-7b")
  c = a.as_critic()
  wl = it.Workload(actor=a, critic=c, num_devices=8, global_batch=16, minibatch=16, micro_batch=2,
                   max_new_tokens=2048, prompt=LengthSpec(kind="constant", value=16, max_len=2048),
                   response=LengthSpec(kind="constant", value=16))
  prompts, resp = wl.sample_lengths()
  mean_len = float(np.mean(prompts + resp))
  assert wl.padded_len == 4096 and mean_len == 32.0
  plan = train_lib.TrainPlan(8, 16, tp=1, actor_pp=1, critic_pp=1, micro_batch=2)

  def need(tokens):  # both models' states (ZeRO-1 over dp 8) and one micro-batch in flight
    states = sum(s.num_params() * (4.0 + 12.0 / 8) for s in (a, c))
    acts = sum(34.0 * s.hidden_size * 2 * tokens * s.num_layers for s in (a, c))
    return states + acts

  padded, mean = need(wl.padded_len), need(mean_len)
  assert mean < 0.95 * padded
  hw = dataclasses.replace(COST.hw, hbm_bytes=(mean + padded) / 2 / COST.eff.memory_headroom)
  cost = CostModel(hw)
  rejected: dict = {}
  got = ps.training_candidates(cost, wl, mean_len, rejected)
  assert not [x for x in got if x.plan.get("tp") == 1 and x.plan.get("actor_pp") == 1
              and x.plan.get("critic_pp") == 1]
  # (the search also counts the actor's update logits: 4 float32 copies of 2 rows x 2048
  # response positions x the vocabulary, cost_model.LOGITS_COPIES_UPDATE)
  logits = 4 * 4.0 * 2 * wl.max_new_tokens * a.vocab_size
  assert f"needs {(padded + logits) / 2**30:.1f} GiB" in rejected["training tp1/pa1/pc1"]
  with pytest.raises(ValueError, match=rf"needs {padded / 2**30:.1f} GiB per device"):
    train_lib.step_costs(cost, a, c, plan, mean_len, padded_len=wl.padded_len)
  # With room for the padded rows it fits, and its stash per micro-batch is the padded one.
  roomy = CostModel(dataclasses.replace(hw, hbm_bytes=padded * 1.001 / COST.eff.memory_headroom))
  problem = train_lib.step_costs(roomy, a, c, plan, mean_len, padded_len=wl.padded_len).problem
  assert problem.actor_mem == pytest.approx(2.0 * 2 * 4096 * a.hidden_size * a.num_layers / 1e6,
                                            rel=1e-6)
  # The disjoint placement (each model alone; on one device its one plan) is sized the same way.
  alone = [a.num_params() * 16.0 + 34.0 * a.hidden_size * 2 * n * a.num_layers
           for n in (mean_len, wl.padded_len)]
  one = CostModel(dataclasses.replace(hw, hbm_bytes=sum(alone) / 2 / COST.eff.memory_headroom))
  assert train_lib.single_model_plan(one, a, 1, 2, 2, mean_len) is not None
  assert train_lib.single_model_plan(one, a, 1, 2, 2, mean_len, padded_len=4096) is None
  with pytest.raises(ValueError, match="padded_len=16 .* below the mean sample length 32"):
    train_lib.step_costs(cost, a, c, plan, mean_len, padded_len=16)


@pytest.mark.parametrize("offload", [True, False])
def test_plan_memory_is_what_each_stage_check_allows(offload):
  """plan_memory's per-device totals of the chosen plan are the needs the search's memory checks
  compare with the usable HBM: each stage's check passes with exactly that much usable memory
  and refuses a byte less (training at the padded rows, beside the frozen weights kept with
  sim.offload_frozen=False)."""
  a = get_shape("llama-7b")
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=16, global_batch=32, minibatch=16,
                   max_new_tokens=512, prompt=LengthSpec(kind="constant", value=64, max_len=256),
                   response=LengthSpec(kind="constant", value=100))
  opt = it.SimOptions(offload_frozen=offload, trainer_runnable=True)
  plan = ps.search(COST, wl, opt, top_k=1)["best"]
  rows = {r["stage"]: r for r in ps.plan_memory(COST, wl, opt, plan)}
  assert set(rows) == {"generation", "inference", "training"}
  assert ("frozen weights kept" in rows["training"]["parts"]) == (not offload)
  prompts, _ = wl.sample_lengths()
  gen, inf, train = plan["generation"], plan["inference"], plan["training"]
  kept = it.kept_frozen_bytes(wl, inf["tp"], opt)
  tplan = train_lib.TrainPlan(16, 16, train["tp"], train["actor_pp"], train["critic_pp"])
  # Beside generation and inference, the training state: both models' bf16 weights and
  # AdamW state (a float32 master copy and two moments, 12 bytes a parameter, ZeRO-1 over
  # their data degree), as counted by hand.
  assert a.optimizer_bytes_per_param() == 12.0
  state = sum(shape.num_params() / (train["tp"] * pp) * (2 + 12 / dp)
              for shape, pp, dp in ((a, train["actor_pp"], tplan.dp),
                                    (wl.critic, train["critic_pp"],
                                     tplan.dp * tplan.critic_replicas)))
  assert rows["generation"]["parts"]["training state kept"] == pytest.approx(state)
  assert rows["inference"]["parts"]["training state kept"] == pytest.approx(state)
  checks = {
      # (the trainer's KV slots: trainer_runnable sizes them at max_prompt_len + max_new_tokens)
      "generation": lambda c: it.gen_plan(c, ps.trainer_workload(wl), gen["tp"], prompts,
                                          opt.max_slots, kept + state),
      # (the trainer's inference beside the state: its check on what the state leaves)
      "inference": lambda c: it.check_inference_memory(
          CostModel(dataclasses.replace(c.hw, hbm_bytes=c.hw.hbm_bytes -
                                        state / c.eff.memory_headroom)),
          wl, inf["tp"], ps.inference_rows(wl, opt, plan), pp=inf.get("pp", 1)),
      "training": lambda c: train_lib.step_costs(c, wl.actor, wl.critic, tplan, 164.0,
                                                 resident_bytes=kept,
                                                 padded_len=wl.padded_len,
                                                 head_positions=wl.max_new_tokens)}
  assert gen["mode"] == "instances" and train["placement"] == "colocated"
  # A pipelined generation layout and a disjoint training placement, by hand.
  other = {**plan, "generation": {"mode": "pipeline", "tp": 2, "pp": 4, "groups": 4, "slots": 16},
           "training": {"placement": "disjoint",
                        "actor": {"devices": 8, "tp": 2, "pp": 2, "dp": 2, "M": 4},
                        "critic": {"devices": 8, "tp": 1, "pp": 4, "dp": 2, "M": 8}}}
  more = {r["stage"]: r for r in ps.plan_memory(COST, wl, opt, other)}
  assert set(more) == {"generation", "inference", "training (actor)", "training (critic)"}
  rows["pipeline"] = more["generation"]
  # (the trainer's pipeline stage keeps the frozen models on its inference mesh whatever
  # sim.offload_frozen says: plan_search.keeps_frozen_on_mesh)
  on_mesh = it.kept_frozen_bytes(wl, inf["tp"], dataclasses.replace(opt, offload_frozen=False))
  assert on_mesh > 0
  # (the disjoint placement's larger state: the actor's on its 8 devices, tp2 pp2 dp2)
  disjoint = a.num_params() / 4 * (2 + 12 / 2)
  assert more["generation"]["parts"]["training state kept"] == pytest.approx(disjoint)
  checks["pipeline"] = lambda c: ps.pipelined_generation(c, a, 16, 2, 4, 4, prompts,
                                                         np.full(32, 100), 512,
                                                         on_mesh + disjoint, wl.padded_len)
  for role, shape in (("actor", wl.actor), ("critic", wl.critic)):
    q = other["training"][role]
    want = COST.train_memory_parts(shape, q["tp"], q["pp"], q["dp"], True, wl.padded_len,
                                   min(q["pp"], q["M"]), False, wl.micro_batch,
                                   wl.max_new_tokens)
    assert more[f"training ({role})"]["parts"] == (
        {**want, "frozen weights kept": on_mesh})
  for stage, check in checks.items():
    need = rows[stage]["total"]
    assert rows[stage]["usable"] == COST.usable_bytes
    for scale, fits in ((1 + 1e-9, True), (1 - 1e-9, False)):
      cost = CostModel(dataclasses.replace(COST.hw, hbm_bytes=need * scale /
                                           COST.eff.memory_headroom))
      if fits:
        check(cost)
      else:
        with pytest.raises(ValueError, match="does not fit in memory"):
          check(cost)


def test_search_counts_each_stage_plan_once():
  """With sim.offload_frozen=False each generation and training plan is tried beside each
  inference plan's frozen weights: plan_search.md's headline counted it once per group (on
  13B/13B, 16 H100s: 117 feasible and 89 rejected for 49 and 38 distinct plans), as
  no_plan_message no longer does.
  `evaluated` and `rejected_plans` count distinct plans."""
  a = get_shape("llama-13b")
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=16, global_batch=64, minibatch=16)
  opt = it.SimOptions(offload_frozen=False)
  res = ps.search(COST, wl, opt, top_k=1)
  names = {re.sub(r" beside \S+ GiB of frozen weights$", "", k) for k in res["rejected"]}
  assert res["rejected_plans"] == len(names) < len(res["rejected"])
  prompts, resp = wl.sample_lengths()
  seq = (prompts + resp).astype(np.float64)
  infs = ps.inference_candidates(COST, wl, opt, seq, {})
  levels = {it.kept_frozen_bytes(wl, c.plan.tp, opt) for c in infs}
  assert len(levels) > 1
  gens, trains, tried = set(), set(), 0
  for kept in levels:
    g = ps.generation_candidates(COST, wl, opt, prompts, resp, {}, resident_bytes=kept)
    t = ps.training_candidates(COST, wl, float(seq.mean()), {}, kept, idle=True)  # (search's)
    gens |= {(c.plan.mode, c.plan.tp, c.plan.pp, c.plan.groups) for c in g}
    trains |= {json.dumps(c.plan, sort_keys=True) for c in t}
    tried += len(g) + len(t)
  assert len(gens) + len(trains) < tried
  assert res["evaluated"] == len(infs) + len(res["stages"]["uniform"]) + len(gens) + len(trains)


def test_no_plan_message_counts_each_rejected_plan_once():
  """With sim.offload_frozen=False each training plan is tried beside each inference plan's
  frozen weights; the refusal counted it once per inference degree (82 training plans rejected
  for 41 distinct on 13B/13B, 16 devices of 36 GB): it counts distinct plans and says where each
  was tried."""
  a = get_shape("llama-13b")
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=16, global_batch=64, minibatch=16)
  cost = CostModel(dataclasses.replace(COST.hw, hbm_bytes=36e9))
  lines = []
  with pytest.raises(ValueError) as e:
    ps.search(cost, wl, it.SimOptions(offload_frozen=False), log=lines.append)
  tried = [m.group(1) for m in map(re.compile(r"^rejected (training .*?): ").match, lines) if m]
  plans = {re.sub(r" beside \S+ GiB of frozen weights$", "", t) for t in tried}
  assert len(tried) == 2 * len(plans) > 0  # each beside the two inference plans' weights
  assert (f"no training plan fits ({len(plans)} rejected, each beside the frozen weights of 2 "
          "inference plans; the closest: ") in str(e.value)
  rejected = [line.split(": ")[0] for line in lines if line.startswith("rejected ")]
  every = {re.sub(r" beside \S+ GiB of frozen weights$", "", r) for r in rejected}
  assert (f"Each of the {len(every)} rejected plans and why: the 'rejected' lines above "
          f"({len(rejected)}, one for each inference plan's frozen weights it was tried "
          "beside).") in str(e.value)


def test_search_keeps_generation_and_inference_beside_the_training_state():
  """The stages' candidates are searched beside the frozen weights only; the combination's
  training plan also keeps both models' weights and AdamW state on the same devices between
  steps (the trainer does, and so do the colocated systems: iteration_sim.train_state_bytes).
  Until 2026-12-05 the search left it out and plan.json's generation and inference could need
  more than the HBM. 13B models on 16 devices, the search held to inference at tp2 (39 GiB of
  frozen weights a device) and two colocated training plans (`accept`): beside the 31.6 GiB of
  state that tp2 Pa/Pc=8/1 keeps (the critic unpipelined on 8 replicas) it does not fit, and the
  search skips those combinations for tp8 Pa/Pc=2/1's, which keep less; every stage of every
  plan it returns fits with the state counted, and with sim.offload_optimizer (the moments in
  host memory while the other stages run) the state kept is the weights."""
  wl, opt = _small(), it.SimOptions(gen_tps=(1, 2, 4, 8))
  layout = lambda t: (t.get("tp"), t.get("actor_pp"), t.get("critic_pp"))
  res = ps.search(COST, wl, opt, top_k=3, accept=lambda p: None if (
      (p["inference"]["tp"], p["inference"]["pp"]) == (2, 1) and
      layout(p["training"]) in ((2, 8, 1), (8, 2, 1))) else "other")
  memory = {w: n for w, n in res["refused"].items() if w != "other"}
  # (each refused before `accept` sees it, other training plans' too: one reason, counted;
  # since 2026-12-07 also the disjoint plans that leave 4 devices idle, a model alone on 4 and
  # the other on 8 of the 16, whose 4 keep a quarter of a 13B model's state each: inference
  # tp1 x pp2 and generation tp1 do not fit beside that)
  beside = " does not fit in memory beside its training plan's state (both models' weights and " \
           "AdamW state)"
  assert sorted(memory) == [f"generation instances tp1 (256 slots){beside}",
                            f"inference tp1 x pp2{beside}", f"inference tp2{beside}"], \
      res["refused"]
  trainer = ps.trainer_workload(wl)  # (as `accept` makes the search size it)
  # tp2 Pa/Pc=8/1 was among those refused: its 31.6 GiB of state is more than fits there.
  slow = {**res["top"][0], "training": {**res["top"][0]["training"], "tp": 2, "actor_pp": 8,
                                        "critic_pp": 1}}
  row = ps.plan_memory(COST, trainer, opt, slow)[1]
  assert row["total"] > row["usable"] >= row["total"] - row["parts"]["training state kept"]
  assert row["parts"]["training state kept"] / GIB == pytest.approx(31.6, abs=0.05)
  for plan in res["top"]:
    assert plan["inference"]["tp"] == 2 and layout(plan["training"]) == (8, 2, 1)
    rows = ps.plan_memory(COST, trainer, opt, plan)
    assert all(r["total"] <= r["usable"] for r in rows), rows
    state = rows[0]["parts"]["training state kept"]
    assert state > 10 * GIB and rows[1]["parts"]["training state kept"] == state
    # The papers' systems: beside their generation and their inference too (since
    # 2026-12-05 (bl); they may pipeline the inference where it does not fit otherwise).
    papers = ps.plan_memory(COST, wl, opt, plan)
    assert papers[0]["parts"]["training state kept"] == state
    assert papers[1]["parts"]["training state kept"] == state
    lean = ps.plan_memory(COST, trainer, dataclasses.replace(opt, offload_optimizer=True), plan)
    t = plan["training"]
    assert t["placement"] == "colocated"
    weights = sum(s.num_params() * 2 / (t["tp"] * pp)
                  for s, pp in ((wl.actor, t["actor_pp"]), (wl.critic, t["critic_pp"])))
    assert lean[0]["parts"]["training state kept"] == pytest.approx(weights)
  # An asynchronous split's generation group keeps no training state.
  split = {**res["best"], "async": {"generation_devices": 8, "training_devices": 8,
                                    "staleness": 1, "colocated": False},
           "generation": {"mode": "instances", "tp": 4, "pp": 1, "groups": 1, "slots": 16},
           "training": {"placement": "colocated", "devices": 8, "tp": 1, "actor_pp": 8,
                        "critic_pp": 8}}
  assert "training state kept" not in ps.plan_memory(COST, wl, opt, split)[0]["parts"]


def test_with_no_synchronous_plan_the_asynchronous_splits_are_still_searched(tmp_path):
  """On 24 devices no layout of all of them divides a mini-batch of 32 (dp 3 or 24); a disjoint
  plan may leave some idle (since 2026-12-07: 7B's actor and critic on 8 of them each fit), but
  33B's keep so much state on their devices that no generation fits beside it, so no
  synchronous plan fits; with staleness the search raised that before searching the splits,
  where 8 generating beside 16 training fits (the generation group keeps no training state).
  Now the splits are searched alone: best None, synchronous_error the reason; the binary
  writes the split's plan to plan.json and its report says why there is no synchronous one."""
  s = get_shape("llama-33b")
  opt = it.SimOptions(search_time_s=0.2)
  wl = it.Workload(actor=s, critic=s.as_critic(), num_devices=24, global_batch=128,
                   minibatch=32, max_new_tokens=512)
  with pytest.raises(ValueError, match=r"no plan of llama-33b \+ llama-33b-critic on 24 devices "
                                       r"\(\d+ combinations refused\): \d+ x generation .* does "
                                       r"not fit in memory beside its training plan's state"):
    ps.search(COST, wl, opt)
  res = ps.search(COST, wl, opt, staleness=1)
  assert res["best"] is None and res["top"] == []
  assert res["synchronous_error"].startswith("plan search: no plan of llama-33b")
  best = res["async"]["best"]
  assert not best["async"]["colocated"] and best["async"]["generation_devices"] + best[
      "async"]["training_devices"] == 24
  with pytest.raises(ValueError, match=r"no plan of llama-33b.*; and async plan search "
                                       r"\(k=1\): no split of 24 devices fits: 12 / 12: no "
                                       r"training plan on 12 devices"):
    ps.search(COST, wl, opt, staleness=1, split_unit=12)
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:13b/13b",
       "--config.pairs=llama-33b/llama-33b",
       f"--workdir={tmp_path}", "--config.num_devices=24", "--config.global_batch=128",
       "--config.minibatch=32", "--config.max_new_tokens=512", "--config.sim.staleness=1",
       "--config.sim.search_time_s=0.2"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  # the default systems: those that need a plan on all 24 devices are left out, said so
  assert ("no synchronous plan fits, so the systems realhf_like, rlhfuse_base, rlhfuse, "
          "pipe_rlhf, rlhfuse_planned (each a plan on all 24 devices) are not simulated"
          in out.stderr), out.stderr[-3000:]
  assert "] best none (no synchronous plan fits); uniform none; async " in out.stderr, (
      out.stderr[-3000:])  # not "best nones"
  result = json.loads((tmp_path / "result.json").read_text())
  assert result["best"] is None and result["plan_json"] == "asynchronous"
  plan = json.loads((tmp_path / "plan.json").read_text())
  assert plan["async"]["generation_devices"] + plan["async"]["training_devices"] == 24
  assert list(result["systems"]) == ["pipe_rlhf_async"]
  assert result["systems"]["pipe_rlhf_async"]["iteration_s"] == pytest.approx(
      result["async"]["predicted_iteration_s"])
  # The report's systems table adds up: its reshard column (gen+inf + train fell short of the
  # iteration by it, unexplained).
  row = result["systems"]["pipe_rlhf_async"]
  assert row["reshard_s"] > 0 and row["iteration_s"] == pytest.approx(
      max(row["gen_plus_inf_s"], row["train_s"]) + row["reshard_s"])
  assert "| system | gen+inf s | train s | reshard s | iteration s |" in (
      tmp_path / "plan_search.md").read_text()
  assert "No synchronous plan: plan search: no plan of llama-33b" in (
      tmp_path / "plan_search.md").read_text()


def test_binary_names_the_models_it_planned_and_warns_of_a_short_context(tmp_path):
  """A search for models of one's own (config.shapes=NAME=PATH) said only the names the user
  gave them (plan_search.md's title, result.json's setting), and planned sequences past a
  model's context without a word (reproduce_ablations warns of them): the report and
  result.json now list each model's shape, parameter count and config.json, and the warning."""
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32001,
           "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": True,
           "max_position_embeddings": 96, "torch_dtype": "bfloat16"}
  qwen3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1000,
           "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 4096, "torch_dtype": "float32"}
  for name, hf in (("a", llama), ("c", qwen3)):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(hf))
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py",
       f"--workdir={tmp_path / 'out'}", f"--config.shapes=mine={tmp_path / 'a'},"
       f"crit={tmp_path / 'c'}", "--config.pairs=mine/crit", "--config.num_devices=8",
       "--config.global_batch=16", "--config.minibatch=8", "--config.max_new_tokens=64",
       "--config.systems=", "--config.sim.staleness=0"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads((tmp_path / "out" / "result.json").read_text())
  models = res["setting"]["models"]
  # by hand: 4 layers of attention 512·64·(8 + 2·2) + 8·64·512 and MLP 3·512·1408 and two
  # norms, the tied embedding, the final norm
  layer = 512 * 64 * 12 + 8 * 64 * 512 + 3 * 512 * 1408 + 2 * 512
  assert models["actor"]["num_params"] == 4 * layer + 32001 * 512 + 512
  # Qwen3: head_dim 128 (its default, not 256 / 4), q/k norms; the critic's scalar head
  layer = 256 * 128 * 8 + 4 * 128 * 256 + 2 * 128 + 3 * 256 * 768 + 2 * 256
  assert models["critic"]["num_params"] == 2 * layer + 1000 * 256 + 256 + 257
  assert models["actor"]["source"] == f"config.shapes: {tmp_path / 'a'} (HF config.json)"
  assert (models["actor"]["weight_itemsize"], models["critic"]["weight_itemsize"]) == (2, 4)
  md = (tmp_path / "out" / "plan_search.md").read_text()
  assert (f"| actor | mine | 27.7M | 4 | 512 | 1408 | 8 / 2 x 64 | 32001 (tied) | 2 / 2 | "
          f"config.shapes: {tmp_path / 'a'} (HF config.json) |") in md
  assert "| critic | crit-critic | 2.22M | 2 | 256 | 768 | 4 / 2 x 128 | 1000 | 4 / 4 |" in md
  # 96 positions against prompts up to 1024 tokens and 64 new ones; the critic's 4096 suffice
  warning = "mine holds 96 positions (max_seq_len), and rows are sized at 1088"
  assert [w for w in res["setting"]["context_warnings"] if warning in w]
  assert f"Warning: mine/crit L=64: {warning}" in md
  assert warning in out.stderr and "crit holds" not in out.stderr


def test_async_ppos_copy_of_the_actor_on_the_training_devices_is_counted():
  """A run with async_ppo.staleness > 0 and no generation group (Workload.actor_copy) keeps a
  copy of the actor on the training devices from before each update to the end of the next
  batch's generation (PPOTrainer._snapshot): the actor's bf16 weights over the training tp,
  beside every stage. Until 2026-12-07 the search left it out: 13B/13B on 8 H100s was given
  training tp2 Pa/Pc=4/4, whose update needs 61.5 GiB without the copy and 73.6 with its 12.1
  (67.1 usable); now that plan is refused naming the copy, and every stage of the plan given
  fits with the copy counted by hand."""
  a = get_shape("llama-13b")
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=8, global_batch=32, minibatch=16,
                   actor_copy=True)
  opt = it.SimOptions(trainer_runnable=True)
  plain = ps.search(COST, dataclasses.replace(wl, actor_copy=False), opt, top_k=1)["best"]
  old = plain["training"]
  assert (old["tp"], old["actor_pp"], old["critic_pp"]) == (2, 4, 4)
  res = ps.search(COST, wl, opt, top_k=1)
  refusal = ("training colocated tp2 Pa/Pc=4/4 does not fit in memory beside asynchronous "
             "PPO's copy of the actor")
  assert any(why.startswith(refusal) for why in res["refused"]), res["refused"]

  def by_hand(plan):
    """Each stage's need: plan_memory's parts but the copy, plus the copy from its
    definition (2 bytes a parameter over the training tp)."""
    copy = a.num_params() * 2 / plan["training"]["tp"]
    # (the rescoring passes run before the copy is made: plan_check's actor_logp and
    # critic_values have none beside them)
    rows = [r for r in ps.plan_memory(COST, wl, opt, plan)
            if r["stage"] not in ps.RESCORE_STAGES.values()]
    for r in rows:
      assert r["parts"][ps.ACTOR_COPY] == pytest.approx(copy), r
    return [sum(v for k, v in r["parts"].items() if k != ps.ACTOR_COPY) + copy for r in rows]

  need = by_hand(plain)[2]
  assert need / GIB == pytest.approx(73.6, abs=0.05) and need > COST.usable_bytes
  assert max(by_hand(res["best"])) <= COST.usable_bytes
  # Without the copy (a synchronous run, or an asynchronous split: the group's actor is the
  # copy) nothing of it is counted.
  split = {**res["best"], "async": {"generation_devices": 4, "training_devices": 4,
                                    "staleness": 1, "colocated": False},
           "generation": {"mode": "instances", "tp": 4, "pp": 1, "groups": 1, "slots": 8},
           "inference": {"tp": 4, "pp": 1},
           "training": {"placement": "colocated", "devices": 4, "tp": 4, "actor_pp": 1,
                        "critic_pp": 1}}
  for w, plan in ((dataclasses.replace(wl, actor_copy=False), res["best"]), (wl, split)):
    assert not ps.keeps_actor_copy(w, plan)
    assert all(ps.ACTOR_COPY not in r["parts"] for r in ps.plan_memory(COST, w, opt, plan))


def test_the_colocated_async_option_keeps_the_actors_copy_and_the_optimizer_state():
  """The asynchronous search's colocated option is the synchronous best plan run
  asynchronously on all the devices: with the copy of the actor (its bf16 weights over the
  training tp) beside its stages, and the AdamW state kept (the trainer refuses
  optim.offload_during_rollout with asynchronous PPO). Where the copy does not fit beside them
  the option is refused, and the search says why; until 2026-12-07 it was returned as
  fitting."""
  a = get_shape("llama-13b")
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=16, global_batch=32, minibatch=16)
  opt = it.SimOptions(trainer_runnable=True)
  sync = ps.search(COST, wl, opt, top_k=1)["best"]
  need = max(r["total"] for r in ps.plan_memory(COST, wl, opt, sync))
  copy = a.num_params() * 2 / sync["training"]["tp"]
  # HBM with room for the synchronous plan, not for the copy beside it: the colocated option
  # is refused, and with no split to try the search says why.
  cost = CostModel(dataclasses.replace(
      COST.hw, hbm_bytes=(need + copy / 2) / COST.eff.memory_headroom))
  assert ps.search(cost, wl, opt, top_k=1)["best"]["summary"] == sync["summary"]
  with pytest.raises(ValueError, match="no split of 16 devices into two groups to try.*both "
                     "groups colocated: .* does not fit in memory beside asynchronous PPO's "
                     "copy of the actor"):
    ps.search(cost, wl, opt, staleness=1, split_unit=16, top_k=1)
  # With the HBM to spare it is the option, the copy and the AdamW state beside its stages.
  lean = dataclasses.replace(opt, offload_optimizer=True)
  res = ps.search(COST, wl, lean, staleness=1, split_unit=16, top_k=1)
  best = res["async"]["best"]
  assert best["async"]["colocated"] and ps.keeps_actor_copy(wl, best)
  assert res["async"]["colocated_refused"] is None
  rows = ps.plan_memory(COST, wl, lean, best)
  assert rows[0]["parts"][ps.ACTOR_COPY] == pytest.approx(
      a.num_params() * 2 / best["training"]["tp"])
  kept = ps.plan_memory(COST, wl, opt, best)
  assert rows[0]["parts"]["training state kept"] == kept[0]["parts"]["training state kept"]
  offloaded = ps.plan_memory(COST, wl, lean, res["best"])  # (synchronous: no copy)
  assert offloaded[0]["parts"]["training state kept"] < rows[0]["parts"]["training state kept"]
  assert ps.ACTOR_COPY not in offloaded[0]["parts"]


def test_the_searchs_copy_of_the_actor_is_what_plan_check_counts():
  """plan_search's actor_copy_bytes (the actor's weights in their dtype over the training tp)
  is plan_check's actor_copy_bytes (the trainer's copy as its arrays place it, over fsdp x
  tensor) for the tiny plan, unpipelined and pipelined, within the norms and biases that stay
  whole on every tensor device (1 %); a run's own fsdp splits it further."""
  from configs import plan_check as plan_config
  from experiments import plan_programs
  from rlhfuse_jax.sim import shapes
  for pp, tp, fsdp in ((1, 1, 1), (2, 2, 1), (1, 2, 2)):
    c = plan_config.get_config("tiny")
    c.staleness, c.pp, c.critic_pp, c.tp, c.fsdp = 1, pp, pp, tp, fsdp
    c.dp = 8 // (pp * tp * fsdp)
    cfg = plan_programs.PlanConfig.from_config_dict(c)
    counted = plan_programs.actor_copy_bytes(cfg, plan_programs.train_mesh(cfg))
    wl = it.Workload(actor=shapes.from_model_config(cfg.actor, "actor", dtypes=True),
                     critic=shapes.from_model_config(cfg.critic, "critic", dtypes=True))
    searched = ps.actor_copy_bytes(wl, {"placement": "colocated", "tp": tp})
    assert counted == pytest.approx(searched / fsdp, rel=0.01), (pp, tp, fsdp)


# A Llama-3-8B-shaped pair (128k vocabulary, GQA): the rescoring passes' float32 logits matter.
L3 = ps.ModelShape(name="l3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_layers=32, num_heads=32, num_kv_heads=8, max_seq_len=8192)


def _l3_workload(**kw):
  return it.Workload(actor=L3, critic=L3.as_critic(), num_devices=16, global_batch=128,
                     minibatch=64, max_new_tokens=1024, **kw)


def _need(row) -> float:
  return sum(row["parts"].values())


def test_the_async_rescoring_passes_memory_is_counted_for_the_trainers_plans():
  """Asynchronous PPO scores each batch again on the training devices before its update (the
  current actor's log-probs, then the current critic's values: plan_check's actor_logp and
  critic_values), a mini-batch a piece split over the data shards, beside the whole training
  state; on a pipelined update each model's whole weights gathered beside its stage shards.
  Until 2026-12-07 the search timed the passes and counted their memory nowhere: an 8B pair
  (128k vocabulary) on 16 H100s, trainer_runnable, was given training colocated tp1 Pa/Pc=4/2
  on 8 devices, whose actor pass needs 71.5 GiB of the 67.1 usable (the 8B actor gathered,
  16 GB, and 32 rows' float32 logits over 1024 response positions, 16.8 GB). By hand here."""
  wl = _l3_workload()
  opt = it.SimOptions(trainer_runnable=True)
  old = {"placement": "colocated", "devices": 8, "tp": 1, "actor_pp": 4, "critic_pp": 2}
  rows = ps.rescore_rows(COST, wl, opt, old, {})
  # by hand: ZeRO-1 AdamW (12 bytes a parameter over dp) and bf16 weights of each stage
  # shard, the actor on 4 stages x dp 2, the critic on 2 stages x dp 4 (2 replicas)
  state = sum(s.num_params() / pp * (2 + 12 / dp)
              for s, pp, dp in ((L3, 4, 2), (L3.as_critic(), 2, 4)))
  at_once = 64 // 2  # the mini-batch over the training mesh's data shards
  act = 34 * L3.hidden_size * at_once * (1024 + 1024)  # one layer, bf16, padded rows
  logits = 4 * at_once * 1024 * L3.vocab_size
  for row, shape in zip(rows, (L3, L3.as_critic())):
    assert row["parts"]["training state"] == pytest.approx(state, rel=1e-9)
    assert row["parts"]["whole weights gathered (pp > 1)"] == pytest.approx(
        2 * shape.num_params(), rel=1e-9)
    assert row["parts"]["activations"] == pytest.approx(act, rel=1e-9)
  assert rows[0]["parts"]["logits"] == pytest.approx(logits, rel=1e-9)
  assert "logits" not in rows[1]["parts"]
  assert _need(rows[0]) / GIB == pytest.approx(71.5, abs=0.05)
  assert _need(rows[0]) > COST.usable_bytes
  res = ps.search(COST, wl, opt, top_k=1, staleness=1)
  best = res["async"]["best"]
  assert not best["async"]["colocated"]
  t = best["training"]
  assert (t["tp"], t["actor_pp"], t["critic_pp"]) != (1, 4, 2)
  got = ps.plan_memory(COST, wl, opt, best)
  assert [r["stage"] for r in got[-2:]] == list(ps.RESCORE_STAGES.values())
  assert all(_need(r) <= COST.usable_bytes for r in got), [(r["stage"], _need(r)) for r in got]
  old_plan = {**best, "training": old}
  assert ps._memory_refusal(COST, wl, opt, old_plan).startswith(
      "rescore (actor log-probs) colocated tp1 Pa/Pc=4/2, 32 samples at once does not fit")
  # A synchronous plan (no rescoring) has no such rows.
  assert all(r["stage"] not in ps.RESCORE_STAGES.values()
             for r in ps.plan_memory(COST, wl, opt, res["best"]))


def test_a_splits_training_plan_is_refused_where_its_rescoring_does_not_fit():
  """The papers' systems (no trainer_runnable) rescore in sim.inference_microbatch samples a
  replica on the training layout's stage shards: with 32 at once at a 128k vocabulary, on
  55 GB devices, the 8B pair's old split (disjoint, each model on 4 devices tp1 pp4) trains in
  38.4 GiB of the 46.1 usable but its actor pass needs 50.3 GiB: the search took it (no memory
  check on the splits' training plans beside their rescoring), and now takes another."""
  cost = CostModel(dataclasses.replace(COST.hw, hbm_bytes=55e9))
  wl = _l3_workload()
  opt = it.SimOptions(inference_microbatch=32)
  old = {"placement": "disjoint",
         "actor": {"devices": 4, "tp": 1, "pp": 4, "dp": 1, "M": 64},
         "critic": {"devices": 4, "tp": 1, "pp": 4, "dp": 1, "M": 64}}
  rows = ps.rescore_rows(cost, wl, opt, old, {})
  assert "whole weights gathered (pp > 1)" not in rows[0]["parts"]
  assert rows[0]["parts"]["logits"] == pytest.approx(4 * 32 * 1024 * L3.vocab_size)
  assert _need(rows[0]) / GIB == pytest.approx(50.3, abs=0.05)
  assert _need(rows[0]) > cost.usable_bytes
  assert "rescore (actor log-probs)" in ps.rescore_refusal(cost, wl, opt, old)
  res = ps.search(cost, wl, opt, top_k=1, staleness=1)
  best = res["async"]["best"]
  assert best["training"]["placement"] != "disjoint" or best["training"]["actor"]["pp"] != 4
  assert all(_need(r) <= cost.usable_bytes for r in ps.plan_memory(cost, wl, opt, best))


def test_the_searchs_rescoring_memory_is_what_plan_check_compiles():
  """The simulator's rescoring rows beyond the training state (rescore_rows: the gathered
  whole model with pp > 1, one layer's activations and the actor's float32 logits of a
  mini-batch's share of a data shard) are plan_check's analytic figures of its actor_logp and
  critic_values programs (less the state's own model they count where pp == 1), and within
  40 % of what XLA allocates for them beyond that model on the tiny plan at an 8192
  vocabulary (2026-12-07, XLA:CPU: pp 1 tp 1 actor +25 %, critic +133 % of a 60 kB pass, its
  fixed buffers: not checked; pp 2 tp 2 -17 % / +10 %; pp 2 tp 1 +5 % / +6 %)."""
  from configs import plan_check as plan_config
  from experiments import plan_programs
  from rlhfuse_jax.sim import shapes
  for pp, tp in ((1, 1), (2, 2), (2, 1)):
    c = plan_config.get_config("tiny")
    c.staleness, c.pp, c.critic_pp, c.tp, c.fsdp, c.dp = 1, pp, pp, tp, 1, 8 // (pp * tp)
    c.actor.vocab_size = c.critic.vocab_size = 8192
    cfg = plan_programs.PlanConfig.from_config_dict(c)
    mesh = plan_programs.train_mesh(cfg)
    wl = it.Workload(actor=shapes.from_model_config(cfg.actor, "actor", dtypes=True),
                     critic=shapes.from_model_config(cfg.critic, "critic", dtypes=True),
                     num_devices=8, global_batch=cfg.minibatch_size,
                     minibatch=cfg.minibatch_size, max_new_tokens=cfg.response_len,
                     prompt=LengthSpec(kind="constant", value=cfg.seq_len - cfg.response_len,
                                       min_len=1, max_len=cfg.seq_len - cfg.response_len))
    rows = ps.rescore_rows(CostModel(cfg.hardware), wl, it.SimOptions(trainer_runnable=True),
                           {"placement": "colocated", "devices": 8, "tp": tp, "actor_pp": pp,
                            "critic_pp": pp}, {})
    progs = (plan_programs.actor_logp_program(cfg, mesh)["actor_logp"],
             plan_programs.critic_values_program(cfg, mesh)["critic_values"])
    for row, p, own in zip(rows, progs, ("state_actor_bytes", "state_critic_bytes")):
      sim = _need(row) - row["parts"]["training state"]
      a = p["analytic"]
      assert sim == pytest.approx(a["total_bytes"] - (a["params_bytes"] if pp == 1 else 0),
                                  rel=1e-6), (pp, tp, row["stage"])
      if row["stage"] == ps.RESCORE_STAGES["actor"] or pp > 1:
        assert sim == pytest.approx(p["peak_bytes"] - p[own], rel=0.4), (pp, tp, row["stage"])


def test_the_colocated_async_option_is_charged_the_rescore_and_no_critic_on_the_instances():
  """The asynchronous search's colocated option runs the synchronous best plan
  asynchronously: its instances score with the reference and reward model alone (the
  trainer's asynchronous stage has no critic: trainer/loop.py stage_critic) and its training
  devices rescore the batch first (rescore_s), as a split's do. Until 2026-12-07 it kept the
  synchronous plan's time (the critic's forwards on the instances, no rescore) and its
  inference memory counted the critic: 7B/7B on 16 H100s (batch 64, mini-batch 32, 64 new
  tokens, split unit 8) chose it at 0.914 s over the 8 / 8 split's 0.927 s; charged as the
  splits are, it takes 1.033 s and the split is chosen."""
  a = get_shape("llama-7b")
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=16, global_batch=64,
                   minibatch=32, max_new_tokens=64)
  opt = it.SimOptions()
  res = ps.search(COST, wl, opt, top_k=3, staleness=1, split_unit=8)
  sync, top = res["best"], res["async"]["top"]
  colocated = next(p for p in top if p["async"]["colocated"])
  q, got = sync["predicted"], colocated["predicted"]
  prompts, resp = wl.sample_lengths()
  seq = (prompts + resp).astype(np.float64)
  inf, t = sync["inference"], sync["training"]
  inf_s = ps.inference_stage_s(COST, (a, a.as_critic()), 16, inf["tp"], inf["pp"], seq, 8, True)
  if t["placement"] == "colocated":
    rescore = _rescore(wl, seq, True, (16, t["tp"], t["actor_pp"]),
                       (16, t["tp"], t["critic_pp"]))
  else:
    rescore = _rescore(wl, seq, False, *((t[m]["devices"], t[m]["tp"], t[m]["pp"])
                                         for m in ("actor", "critic")))
  assert got["inf_s"] == pytest.approx(inf_s, rel=1e-12) and got["inf_s"] < q["inf_s"]
  assert got["rescore_s"] == pytest.approx(rescore, rel=1e-12)
  assert got["train_s"] == pytest.approx(q["train_s"] + rescore, rel=1e-12)
  want = q["reshard_s"] + q["gen_s"] + inf_s + q["train_s"] + rescore
  assert got["iteration_s"] == pytest.approx(want, rel=1e-12) == got["serial_s"]
  assert got["iteration_s"] == pytest.approx(1.033, abs=5e-4)
  best = res["async"]["best"]
  assert not best["async"]["colocated"] and best["async"]["generation_devices"] == 8
  assert best["predicted"]["iteration_s"] == pytest.approx(0.927, abs=5e-4)
  # Its inference holds the reference and the reward model (the critic's shape here), not
  # the critic; the synchronous plan's all three.
  mem = ps.inference_memory(COST, wl, opt, colocated)
  from rlhfuse_jax.sim.shapes import heaviest_stage_weight_bytes
  c = a.as_critic()
  assert mem["weights"] == pytest.approx(
      heaviest_stage_weight_bytes((a, c), inf["pp"]) / inf["tp"], rel=1e-9)
  assert ps.inference_memory(COST, wl, opt, sync)["weights"] == pytest.approx(
      heaviest_stage_weight_bytes((a, c, c), inf["pp"]) / inf["tp"], rel=1e-9)


def _async_search_7b_on_16():
  """(workload, options, plan_search.search's result) of LLaMA-7B/7B on 16 devices, staleness 1:
  the uniform-fallback tests' setting."""
  a = get_shape("llama-7b")
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=16, global_batch=64,
                   minibatch=32, max_new_tokens=64)
  opt = it.SimOptions()
  return wl, opt, ps.search(COST, wl, opt, top_k=1, staleness=1, split_unit=8)


def test_the_uniform_layout_run_asynchronously_is_charged_the_rescore_too():
  """pipe_rlhf_async's row takes the uniform layout (every stage on one layout, no reshard)
  where it beats the asynchronous search's best; it is run asynchronously then, charged as the
  colocated option is: its inference without the critic, the rescore of the batch on its
  (tp, pp, pp) training layout over all the devices. Until 2026-12-07 the row compared the
  uniform layout's synchronous time: one 1 ms below the split's best was taken, though with the
  rescore (two forwards for the critic's one) it is slower than the split."""
  wl, opt, res = _async_search_7b_on_16()
  best = res["async"]["best"]
  assert not best["async"]["colocated"]
  u = res["uniform"]
  lay, q = u["layout"], u["predicted"]
  target = best["predicted"]["iteration_s"] - 1e-3  # synchronously just faster than the split
  gen_s = target - q["inf_s"] - q["train_s"]
  assert gen_s > 0
  u = {**u, "predicted": {**q, "gen_s": gen_s, "iteration_s": target}}
  row = it._async_row(COST, wl, opt, {**res, "uniform": u})
  assert not row["details"]["async"]["colocated"]
  assert row["iteration_s"] == best["predicted"]["iteration_s"]
  # By hand: what the uniform layout costs asynchronously.
  prompts, resp = wl.sample_lengths()
  seq = (prompts + resp).astype(np.float64)
  inf_s = ps.inference_stage_s(COST, (wl.actor, wl.critic), 16, lay["tp"], lay["pp"], seq, 8, True)
  rescore = _rescore(wl, seq, True, (16, lay["tp"], lay["pp"]), (16, lay["tp"], lay["pp"]))
  got = ps.async_colocated_predicted(
      COST, wl, opt, u["predicted"], {"tp": lay["tp"], "pp": lay["pp"]},
      {"placement": "colocated", "devices": 16, "tp": lay["tp"], "actor_pp": lay["pp"],
       "critic_pp": lay["pp"]})
  assert got["iteration_s"] == pytest.approx(gen_s + inf_s + q["train_s"] + rescore, rel=1e-12)
  assert got["iteration_s"] > best["predicted"]["iteration_s"] > target
  # Where it is faster still it is taken, with those times.
  fast = {**u, "predicted": {**u["predicted"], "gen_s": gen_s - 1.0}}
  row = it._async_row(COST, wl, opt, {**res, "uniform": fast})
  assert row["details"]["async"]["colocated"] and "uniform" in row["details"]["plan"]
  assert row["iteration_s"] == pytest.approx(got["iteration_s"] - 1.0, rel=1e-12)
  assert row["inf_s"] == pytest.approx(inf_s, rel=1e-12)


def test_an_async_generation_group_is_charged_the_whole_actor_the_trainer_keeps_there():
  """The trainer moves the actor onto an asynchronous split's generation group whole on every
  device (its data-only mesh: trainer/async_ppo.meshes) and keeps it through the batch's
  generation and inference, beside the instances' own copies (tests/test_plan_check.py
  measures it from the trainer's arrays). Until 2026-12-07 the search charged the instances'
  copy alone: 33B on 64 H100s (batch 128, mini-batch 64, staleness 1) was given generation on
  32 devices in instances of tp4 at 33.4 GiB a device, where the trainer holds the 60.6 GiB
  actor beside that (94 GiB of 67.1 usable). That plan is now refused, naming the copy, and
  every plan the search returns fits with it. Without sim.trainer_runnable nothing changes."""
  a = get_shape("llama-33b")
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=64, global_batch=128,
                   minibatch=64)
  opt = it.SimOptions(trainer_runnable=True)
  old = {"generation": {"mode": "instances", "tp": 4, "pp": 1, "groups": 1, "slots": 16},
         "inference": {"tp": 4, "pp": 1},
         "training": {"placement": "colocated", "devices": 32, "tp": 4, "actor_pp": 2,
                      "critic_pp": 2, "micro_batch": 1, "actor_microbatches": 16,
                      "critic_microbatches": 16},
         "async": {"generation_devices": 32, "training_devices": 32, "staleness": 1,
                   "colocated": False}}
  gen, inf = ps.plan_memory(COST, wl, opt, old)[:2]
  for row in (gen, inf):
    assert row["parts"][ps.GROUP_ACTOR] == a.weight_bytes()
  assert gen["total"] - a.weight_bytes() < COST.usable_bytes < gen["total"]
  assert gen["total"] / GIB == pytest.approx(33.4 + a.weight_bytes() / GIB, abs=0.1)
  assert ps._memory_refusal(COST, wl, opt, old) == (
      "generation instances tp4 (16 slots) does not fit in memory beside the whole actor the "
      "trainer keeps on every device of an asynchronous generation group (its data-only mesh)")
  res = ps.search(COST, wl, opt, staleness=1, top_k=3)["async"]
  assert res["top"]
  for plan in res["top"]:
    rows = ps.plan_memory(COST, wl, opt, plan)
    assert all(r["total"] <= r["usable"] for r in rows[:2]), plan["summary"]
    if not plan["async"]["colocated"]:
      assert rows[0]["parts"][ps.GROUP_ACTOR] == a.weight_bytes()
  assert ps.GROUP_ACTOR not in ps.plan_memory(COST, wl, it.SimOptions(), old)[0]["parts"]


def test_an_instance_of_tp1_on_a_generation_group_counts_the_whole_actor_once():
  """An instance of tp 1 placed from an asynchronous generation group's whole actor holds the
  group's own buffers (tests/test_plan_check.py measures it from the trainer's arrays): its
  generation row counted the actor twice, as the instance's weights and as the group's whole
  actor (a safe over-count, 60.6 GiB too much for 33B). Once now: the row is the whole actor,
  the KV cache and the transient; at tp 2 the layout's own copy is new buffers beside the
  group's, on a pipeline its layers only (the stages hold the group's embedding and head:
  tests/test_plan_check.py), and without a group the weights are the instance's."""
  a = get_shape("llama-33b")
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=64, global_batch=128,
                   minibatch=64)
  opt = it.SimOptions(trainer_runnable=True)

  def plan(tp, mode="instances", split=True):
    return {"generation": {"mode": mode, "tp": tp, "pp": 1, "groups": 1, "slots": 16},
            "inference": {"tp": tp, "pp": 1},
            "training": {"placement": "colocated", "devices": 32, "tp": 4, "actor_pp": 2,
                         "critic_pp": 2, "micro_batch": 1, "actor_microbatches": 16,
                         "critic_microbatches": 16},
            **({"async": {"generation_devices": 32, "training_devices": 32, "staleness": 1,
                          "colocated": False}} if split else {})}
  gen = ps.plan_memory(COST, wl, opt, plan(1))[0]
  transient = "prefill activations or a migration's rows"
  assert set(gen["parts"]) == {ps.GROUP_ACTOR, "KV cache", transient}, gen["parts"]
  assert gen["parts"][ps.GROUP_ACTOR] == a.weight_bytes()
  assert gen["total"] == pytest.approx(a.weight_bytes() + gen["parts"]["KV cache"] +
                                       gen["parts"][transient])
  two = ps.plan_memory(COST, wl, opt, plan(2))[0]["parts"]
  assert (two["weights"], two[ps.GROUP_ACTOR]) == (a.weight_bytes() / 2, a.weight_bytes())
  pipe = ps.plan_memory(COST, wl, opt, plan(1, "pipeline"))[0]["parts"]
  layers = (a.num_params() - 2 * a.vocab_size * a.hidden_size) * a.weight_itemsize
  assert (pipe["weights"], pipe[ps.GROUP_ACTOR]) == (layers, a.weight_bytes())
  alone = ps.plan_memory(COST, wl, opt, plan(1, split=False))[0]["parts"]
  assert alone["weights"] == a.weight_bytes() and ps.GROUP_ACTOR not in alone


def test_an_asynchronous_run_on_the_training_devices_writes_the_split_that_beats_it():
  """plan.json's choice (plan_json_choice): for a run with async_ppo.staleness > 0 and no
  generation group (Workload.actor_copy) a plan without an "async" split runs asynchronously,
  at the colocated option's time, so a split faster than that is written even where the
  synchronous time is lower. 7B/7B on 16 H100s: synchronous 0.997 s < the 8 / 8 split's
  1.052 s < the synchronous plan run asynchronously, 1.130 s; until 2026-12-07 such a run was
  given the synchronous plan. A synchronous run keeps the synchronous plan."""
  a = get_shape("llama-7b")
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=16, global_batch=64,
                   minibatch=32, max_new_tokens=64, actor_copy=True)
  res = ps.search(COST, wl, it.SimOptions(trainer_runnable=True), top_k=5, staleness=1,
                  split_unit=8)
  sync, top = res["best"], res["async"]["top"]
  split = res["async"]["best"]
  colocated = next(p for p in top if p["async"]["colocated"])
  assert not split["async"]["colocated"]
  assert (sync["predicted"]["iteration_s"] < split["predicted"]["iteration_s"] <
          colocated["predicted"]["iteration_s"])
  assert ps.plan_json_choice(wl, sync, split) == "asynchronous"
  assert ps.plan_json_choice(dataclasses.replace(wl, actor_copy=False), sync,
                             split) == "synchronous"
  assert ps.plan_json_choice(wl, sync, colocated) == "synchronous"
  assert ps.plan_json_choice(wl, None, split) == "asynchronous"


def test_the_uniform_layout_run_asynchronously_is_memory_checked_as_the_colocated_option():
  """pipe_rlhf_async's uniform fallback holds what async_search's colocated option holds:
  asynchronous PPO's copy of the actor beside every stage and the rescoring passes
  (plan_search._memory_refusal on the layout's plans). On hardware whose HBM holds the layout
  synchronously but not with those, the fallback is refused and its reason recorded; until
  2026-12-07 it was taken, checked only as the synchronous uniform_candidates checks it."""
  wl, opt, res = _async_search_7b_on_16()
  best = res["async"]["best"]
  u = res["uniform"]
  plans = u["plans"]
  colocated = {**plans, "async": {"generation_devices": 16, "training_devices": 16,
                                  "staleness": 1, "colocated": True}}
  sync_need = max(r["total"] for r in ps.plan_memory(COST, wl, opt, plans))
  async_need = max(r["total"] for r in ps.plan_memory(COST, wl, opt, colocated))
  assert async_need > sync_need
  # Faster than the split's best by a second: taken where it fits.
  fast = {**u, "predicted": {**u["predicted"], "gen_s": u["predicted"]["gen_s"] - (
      u["predicted"]["iteration_s"] - best["predicted"]["iteration_s"]) - 1.0}}
  fast["predicted"]["iteration_s"] = best["predicted"]["iteration_s"] - 1.0
  row = it._async_row(COST, wl, opt, {**res, "uniform": fast})
  assert row["details"]["async"]["colocated"] and "uniform_async_refused" not in row["details"]
  hw = dataclasses.replace(COST.hw, hbm_bytes=(sync_need + async_need) / 2 /
                           COST.eff.memory_headroom)
  small = CostModel(hw)
  assert ps._memory_refusal(small, wl, opt, plans) is None
  row = it._async_row(small, wl, opt, {**res, "uniform": fast})
  assert not row["details"]["async"]["colocated"], row["details"]["plan"]
  assert row["iteration_s"] == best["predicted"]["iteration_s"]
  assert "does not fit in memory" in row["details"]["uniform_async_refused"]


def test_the_trainers_pipeline_is_checked_with_the_embedding_and_head_on_every_stage():
  """The trainer's generation pipeline holds the embedding and LM head whole on each stage
  (PipelinedGenerator.param_shardings; measured in tests/test_plan_check.py). The search's
  memory check of a pipeline spread them over pp: for 7B at pp 4 each stage's need was
  (embed + head) * 3/4 short (~0.4 GB in bf16). With sim.trainer_runnable it counts them whole;
  the papers' engines keep the spread."""
  a = get_shape("llama-7b")
  wl = it.Workload(actor=a, critic=a.as_critic(), num_devices=8, global_batch=64, minibatch=16)
  prompts, resp = wl.sample_lengths()
  need = {}
  for runnable in (False, True):
    seen = []
    cost = CostModel(get_hardware("h100_sxm"))
    cost.check_fits = lambda what, n, detail: seen.append((what, detail, n))  # noqa: E731
    ps.generation_candidates(cost, wl, it.SimOptions(trainer_runnable=runnable), prompts, resp,
                             {}, pps=(4,))
    need[runnable] = [(int(re.search(r"tp=(\d+)", d)[1]), n) for w, d, n in seen
                      if w.startswith("pipelined generation")]
  assert 1 in {tp for tp, _ in need[True]} and len(need[True]) == len(need[False])
  ends = 2 * a.vocab_size * a.hidden_size * a.weight_itemsize
  for (tp, whole), (_, spread) in zip(need[True], need[False]):  # (over tp: the papers' tp)
    assert whole - spread == pytest.approx(ends * 3 / 4 / tp), tp
  assert 0.35 * GIB < ends * 3 / 4 < 0.4 * GIB


def test_with_no_asynchronous_split_the_synchronous_plan_still_stands(tmp_path):
  """65B's actor and 33B's critic on 64 H100s: a synchronous plan fits, but no split of the
  devices does (no group of 56 or fewer divides the mini-batch, and the 65B actor's copy beside
  the colocated plan does not fit). The search raised that, losing the synchronous plan: since
  the generation group was charged the whole actor (2026-12-07) the documented
  `plan_search.py:65b/33b --config.sim.trainer_runnable=True` exited 1 so. Now best holds the
  synchronous plan, async_error why no split fits; a bad input still raises; the binary writes
  the synchronous plan and leaves pipe_rlhf_async out of the systems."""
  wl = it.Workload(actor=get_shape("llama-65b"), critic=get_shape("llama-33b").as_critic(),
                   num_devices=64, global_batch=512, minibatch=64)
  opt = it.SimOptions(search_time_s=0.2)
  res = ps.search(COST, wl, opt, staleness=1, top_k=2)
  assert res["best"]["summary"] == ps.search(COST, wl, opt, top_k=2)["best"]["summary"]
  assert "async" not in res
  assert res["async_error"].startswith("async plan search (k=1): no split of 64 devices fits: "
                                       "8 / 56: no training plan on 56 devices")
  with pytest.raises(ValueError, match="async split unit=-8 must be >= 1"):
    ps.search(COST, wl, opt, staleness=1, split_unit=-8)
  with pytest.raises(ValueError, match="pipe_rlhf_async: async plan search .k=1.: no split"):
    it._async_row(COST, wl, opt, res)
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:13b/13b",
       "--config.pairs=llama-65b/llama-33b", f"--workdir={tmp_path}",
       "--config.num_devices=64", "--config.global_batch=512", "--config.minibatch=64",
       "--config.sim.staleness=1", "--config.sim.search_time_s=0.2",
       "--config.systems=pipe_rlhf,pipe_rlhf_async"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.load(open(tmp_path / "result.json"))
  assert got["plan_json"] == "synchronous" and got["async"] is None
  assert got["best"]["summary"] == res["best"]["summary"]
  assert got["async_error"].startswith("async plan search (k=1): no split of 64 devices")
  assert list(got["systems"]) == ["pipe_rlhf"] and "systems_error" not in got
  assert "\nNo asynchronous plan: async plan search (k=1)" in (
      tmp_path / "plan_search.md").read_text()
  assert "pipe_rlhf_async is not simulated" in out.stderr
