"""Pipe-RLHF's hierarchical plan search: a parallel plan per RLHF stage, on the simulator's costs.

Generation (memory-bound decode), inference (compute-bound forwards) and training want different
layouts (docs/architecture.md §4). A plan gives each stage its own layout over the same devices:

  generation  `instances` of tp devices (the engine's instances: slots, no consolidation), or a
              `pipeline` of pp stages x tp devices whose batch is split into G groups that enter
              one stage apart (delayed inter-batch pipelined generation, `pipelined_generation`)
  inference   instances of tp devices (reference, reward, critic forwards of the finished batch)
  training    `colocated`: actor and critic pipelines on all devices (training_sim.TrainPlan,
              actor 1F1B then critic 1F1B); or `disjoint`: each model alone on its own share of
              the devices, both at once (training_sim.single_model_plan), synchronously on as
              many of them as is fastest: the one stage plan that may leave devices idle

Synchronously, the stages of an iteration run one after the other, and a plan pays one
resharding: the actor's new weights into the generation layout (one copy a node over the
scale-out network, then over NVLink: reshard_s, which iteration_sim charges every system). So
the search is hierarchical: the outer level picks the training placement (colocated or a
device split) and the generation mode, and with asynchronous PPO also the split of the devices
into a generation and a training group (below); the inner level the degrees of each stage, each
stage searched on its own (iteration time = reshard + generation + inference + training), and
the top plans are the best combinations that fit: their generation (and for the trainer's
plans inference) beside the state their training plan keeps on the same devices between steps
(both models' weights and AdamW state, the latter not with sim.offload_optimizer: plan_memory,
_memory_refusal).

The `uniform` plan is what one layout for every stage gives: a (tp, pp) grid whose generation is
a plain pipeline (G = 1: each token passes all pp stages before the next starts), whose
inference is a forward pipeline and whose training is the same (tp, pp, pp) pipeline; it needs
no resharding.

Pipelined generation, as simulated: R = N / (tp * pp) pipeline replicas, the batch dealt
round-robin to them and, in a replica, round-robin to G groups. A tick is one stage running its
L/pp layers on one group's live rows (the cost model's decode step of a model of L/pp layers,
whose embedding and head are spread evenly over the stages) plus the activation transfer to the
next stage. A decode step of every group takes max(sum over groups of their ticks, pp x the
longest tick): with G >= pp every stage is busy all step long; with G < pp (or once groups have
finished) a group's token must cross all pp stages before its next one, and stages wait. The
fill adds pp - 1 ticks. Busy fraction = stage-ticks of work / (pp x step time). With a
calibration measured on devices that share one processor (fake CPU devices:
CostModel.shares_compute) every task runs one after another instead, as in generation_sim:
generation and inference take the sum of all their stages' work.

Asynchronous PPO (`staleness` k >= 1; Pipe-RLHF's paper runs it): the devices split into a
generation group of g devices and a training group of the other N - g. While the training group
trains on iteration i's batch, the generation group already generates the batch of iteration
i + k, and runs its reference / reward forwards, with a policy k updates old. As the trainer does
(trainer/loop.py), the training group first scores the batch with the current actor (proximal
log-probs) and critic (values: GAE's baseline and the value clip's anchor must be those of the
critic it trains), and after each update the actor's new weights move from the training layout
into the generation layout (reshard_s: one copy a node, bound by the senders' NICs too).
In steady state an iteration costs

  iteration = max(generation + inference on g, rescore + training on N - g) + reshard (actor)

The transfer is counted on the critical path of both groups: the generation group holds one copy
of the actor (no double buffer), so it cannot start the next batch before the new one arrived,
and the training group sends it from its own devices between two updates. So k sets only the
lag, not the time, and the first k batches, generated before any update, are a prefill amortised
over the run. (With double-buffered weights and a transfer hidden behind compute, a period could
shrink towards max(gen + inf, train, (gen + inf + train + reshard) / (k + 1)); not modelled, the
formula above is the conservative one.) Each split g
(a multiple of `split_unit` devices, a node by default) is searched like the synchronous plan:
generation and inference candidates on g devices, training candidates on N - g (colocated or
disjoint inside the group); a split where a stage fits nowhere is rejected. For a split the best
training plan is the fastest one (the time only grows with it); every generation x inference
pair is tried, since a wider generation copy shortens the reshard. With both groups on all
devices (`colocated`) nothing overlaps: the iteration is the synchronous plan's serial sum, its
instances scoring with the frozen models alone and its training devices rescoring first, as a
split's (so it can be slower or faster than the synchronous plan: the rescore's two forwards
against the critic's forward and, offloaded, its weights' load on the instances), where that
plan fits beside the copy of the actor the trainer keeps on its devices then
(keeps_actor_copy, plan_memory) and its rescoring passes fit (rescore_rows).

A run without a critic (Workload.trains_critic False: GRPO, RLOO, ...) is searched without one:
the actor's training alone (training_sim with `critic` None; no disjoint placement), no critic
forward in the inference or the rescore, no critic state in any memory row; trainer_refusal
keeps its training unpipelined, as the trainer runs it. plan.json records no critic_pp.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import time
from typing import Callable, Optional

import numpy as np

from rlhfuse_jax.policy import async_copies
from rlhfuse_jax.sim import generation_sim as gen_lib
from rlhfuse_jax.sim import training_sim as train_lib
from rlhfuse_jax.sim.cost_model import (GIB, LOGITS_COPIES_SCORING, CostModel, crossing_share,
                                        stage_cost)
from rlhfuse_jax.sim.lengths import summarize
from rlhfuse_jax.sim.shapes import ModelShape, end_params, stage_shape


@dataclasses.dataclass(frozen=True)
class GenerationPlan:
  mode: str  # "instances" | "pipeline"
  tp: int
  pp: int = 1
  groups: int = 1  # pipeline: groups per replica (G)
  slots: int = 0  # instances: slots per instance; pipeline: samples per replica

  def describe(self) -> str:
    if self.mode == "instances":
      return f"instances tp{self.tp} ({self.slots} slots)"
    return f"pipeline pp{self.pp} x tp{self.tp}, G={self.groups}"


@dataclasses.dataclass(frozen=True)
class InferencePlan:
  tp: int
  pp: int = 1

  def describe(self) -> str:
    return f"tp{self.tp}" + (f" x pp{self.pp}" if self.pp > 1 else "")


# ----------------------------------------------------------------------------- generation
def prefill_activation_bytes(cost: CostModel, actor: ModelShape, tp: int, rows: float,
                             prompt_len: float) -> float:
  """Per device, one layer's activations of a prefill of `rows` prompts of `prompt_len` tokens
  over tp devices: what a generation's prefill holds beside its KV cache (iteration_sim.gen_plan,
  pipelined_generation, plan_memory)."""
  return cost.activation_bytes(actor, tp, rows * prompt_len, 1)


def pipelined_generation(cost: CostModel, actor: ModelShape, num_devices: int, tp: int, pp: int,
                         groups: int, prompts: np.ndarray, resp: np.ndarray,
                         max_new_tokens: int, resident_bytes: float = 0.0,
                         slot_len: int = 0, resident: str = "", whole_ends: bool = False) -> dict:
  """Delayed inter-batch pipelined generation of one batch (module docstring), beside
  `resident_bytes` per device of frozen weights (frozen_note; or of what `resident` names),
  its KV slots `slot_len` tokens
  (0: the longest prompt + max_new_tokens; Workload.kv_slot_len). `whole_ends`: every stage
  holds the embedding and LM head (over tp), as the trainer's pipeline does (plan_memory); else
  they are spread over the stages. Returns {gen_s, prefill_s, decode_s, ticks, stage_busy_frac,
  replicas, samples_per_replica}."""
  if num_devices % (tp * pp):
    raise ValueError(f"pipelined generation: tp*pp={tp}*{pp} must divide {num_devices} devices")
  if groups < 1:
    raise ValueError(f"pipelined generation: groups={groups} must be >= 1")
  st = stage_shape(actor, pp)
  reps = num_devices // (tp * pp)
  b = prompts.size
  per_rep = -(-b // reps)
  slot_cap = slot_len or int(prompts.max()) + max_new_tokens
  per_group = -(-per_rep // groups)
  # The ends beyond their 1/pp share of weight_bytes (whole on every stage).
  ends = sum(end_params(actor)) * actor.weight_itemsize * (pp - 1) / (tp * pp) if whole_ends else 0
  # A stage prefills one group's prompts at a time (the groups one stage apart): one layer's
  # activations of them beside the cache (iteration_sim.gen_plan's prefill term).
  need = ((actor.weight_bytes() + per_rep * slot_cap * actor.kv_bytes_per_token()) / (tp * pp)
          + ends
          + prefill_activation_bytes(cost, actor, tp, per_group, slot_cap - max_new_tokens)
          + resident_bytes)
  cost.check_fits(f"pipelined generation of {actor.name}", need,
                  f"pp={pp} tp={tp}: a stage's weights + KV for {per_rep} samples + a group's "
                  "prefill activations"
                  + (f", beside {resident_bytes / GIB:.1f} GiB of {resident}"
                     if resident and resident_bytes else train_lib.frozen_note(resident_bytes)))
  # [R, G, S]: sample of each (replica, group, position), -1 where empty.
  idx = np.full((reps * groups * per_group,), -1, dtype=np.int64)
  # Round-robin to replicas, then within a replica round-robin to groups.
  rep_of, pos = np.arange(b) % reps, np.arange(b) // reps
  idx[(rep_of * groups + pos % groups) * per_group + pos // groups] = np.arange(b)
  idx = idx.reshape(reps, groups, per_group)
  valid = idx >= 0
  plen = np.where(valid, prompts[np.maximum(idx, 0)], 0)
  rlen = np.where(valid, resp[np.maximum(idx, 0)], 0)
  hop = crossing_share(tp, pp - 1, cost.hw.devices_per_node)

  def ticks_s(rows, ctx):
    """Per-tick seconds of one stage on `rows` live rows reading `ctx` KV tokens."""
    act = cost.hop_s(rows * actor.hidden_size * actor.act_itemsize / tp, hop) if pp > 1 else 0.0
    return np.where(rows > 0, stage_cost(cost, "decode_step_s", st, actor, tp, rows, ctx) + act,
                    0.0)

  # Prefill: each group's prompts through the pp stages, the groups one stage apart.
  pre = np.stack([[stage_cost(cost, "prefill_s", st, actor, tp, plen[r, g][valid[r, g]])
                   if valid[r, g].any() else 0.0 for g in range(groups)]
                  for r in range(reps)])  # [R, G]
  prefill = pre.sum(1) + (pp - 1) * pre.max(1)  # [R]
  # Decode step k (k = 1 .. max-1; prefill sampled token 0): rows with rlen > k.
  kmax = int(rlen.max())
  k = np.arange(1, max(kmax, 1))[:, None, None, None]  # [K, 1, 1, 1]
  live = (rlen[None] > k)  # [K, R, G, S]
  rows = live.sum(-1).astype(np.float64)  # [K, R, G]
  ctx = (live * (plen[None] + k)).sum(-1).astype(np.float64)  # [K, R, G]
  tick = ticks_s(rows, ctx)  # [K, R, G]
  work = tick.sum(-1)  # [K, R] one stage's busy time in the step
  step = np.maximum(work, pp * tick.max(-1))  # [K, R]
  decode = step.sum(0) + (pp - 1) * (tick[0].max(-1) if kmax > 1 else 0.0)  # [R]
  total = prefill + decode
  busy = float(work.sum() / max(step.sum(), 1e-30))
  # Decode ticks of the slowest replica (replicas run side by side).
  ticks = int(np.max(np.sum(np.maximum((rows > 0).sum(-1), pp * (rows > 0).any(-1)), axis=0)))
  r_last = int(np.argmax(total))
  out = {"gen_s": float(total.max()), "prefill_s": float(prefill[r_last]),
         "decode_s": float(decode[r_last]), "ticks": ticks, "stage_busy_frac": busy,
         "replicas": reps, "samples_per_replica": per_rep}
  if cost.shares_compute:  # every stage's every task one after another (module docstring)
    out.update(prefill_s=float(pp * pre.sum()), decode_s=float(pp * work.sum()))
    out["gen_s"] = out["prefill_s"] + out["decode_s"]
  return out


def instance_generation(cost: CostModel, wl, opt, tp: int, prompts: np.ndarray,
                        resp: np.ndarray, resident_bytes: float = 0.0,
                        resident: str = "the frozen reference and reward weights "
                                        "(sim.offload_frozen=False)") -> dict:
  """Generation alone on instances of tp devices (no consolidation; inference is its own
  stage here), beside `resident_bytes` per device of frozen weights (or of what `resident`
  names): {gen_s, plan}."""
  from rlhfuse_jax.sim import iteration_sim as it  # iteration_sim imports this module
  plan = it.gen_plan(cost, wl, tp, prompts, opt.max_slots, resident_bytes, resident)
  res = gen_lib.simulate_generation(cost, wl.actor, wl.frozen_models()[1],
                                    it.gen_setup(plan, wl, opt, cost, False, None), prompts,
                                    resp)
  return {"gen_s": res.gen_end_s, "plan": plan}


# ----------------------------------------------------------------------------- inference
def inference_stage_s(cost: CostModel, frozen, num_devices: int, tp: int, pp: int,
                      seq_lens: np.ndarray, microbatch: int, offload: bool) -> float:
  """Reference / reward / critic forwards of the whole batch on R = N / (tp * pp) replicas of
  a pp-stage forward pipeline (pp = 1: instances): micro-batches of `microbatch` samples,
  shortest first (about the order they finish generating, which is how generation_sim schedules
  the other systems' inference after generation: one rule for the same stage; until 2026-11-29
  longest first here, 8-13 % faster than the same stage in those systems), each to the
  least-loaded replica; a replica takes the sum of its micro-batches' stage times plus a
  pipeline fill of pp - 1 stage times; the frozen weights are first copied from host memory
  when offloaded."""
  if num_devices % (tp * pp):
    raise ValueError(f"inference: tp*pp={tp}*{pp} must divide {num_devices} devices")
  reps = num_devices // (tp * pp)
  stages = [stage_shape(s, pp) for s in frozen]
  lens = np.sort(np.asarray(seq_lens, dtype=np.float64), kind="stable")
  mbs = [lens[i:i + microbatch] for i in range(0, lens.size, microbatch)]
  t_mb = np.array([float(stage_cost(cost, "inference_s", stages, list(frozen), tp, m))
                   for m in mbs])
  load = np.zeros(reps)
  longest = np.zeros(reps)
  for t in t_mb:  # list scheduling in finish order
    r = int(np.argmin(load))
    load[r] += t
    longest[r] = max(longest[r], t)
  w = cost.weight_load_s(frozen, tp * pp) if offload else 0.0
  if cost.shares_compute:  # every micro-batch through every stage, one after another
    return float(pp * t_mb.sum() + w)
  return float(np.max(load + (pp - 1) * longest) + w)


# ----------------------------------------------------------------------------- search
@dataclasses.dataclass
class Candidate:
  """One stage's option: its plan, predicted seconds, and what it reports."""
  plan: object
  seconds: float
  info: dict = dataclasses.field(default_factory=dict)


def _fits(fn: Callable, rejected: dict, name: str):
  try:
    return fn()
  except ValueError as e:
    rejected[name] = str(e)
    return None


def generation_candidates(cost: CostModel, wl, opt, prompts, resp, rejected: dict,
                          pps=(2, 4, 8), resident_bytes: float = 0.0) -> list[Candidate]:
  """Generation on instances (each tp of opt.gen_tps) and as pipelines (pp x tp, G = pp and
  2 pp), each with the resharding of the actor's weights into its layout, beside
  `resident_bytes` per device of frozen weights (search)."""
  out = []
  for tp in opt.gen_tps:
    # named, not skipped in silence: with sim.gen_tps=8 and a 28-head actor the search said no
    # generation plan fits, 0 rejected
    why = (f"tp{tp} is more than a node's {cost.hw.devices_per_node} devices"
           if tp > cost.hw.devices_per_node else wl.actor.tensor_parallel_error(tp))
    if why:
      rejected[f"gen tp{tp}"] = f"{why} (config.sim.gen_tps)"
      continue
    g = _fits(lambda: instance_generation(cost, wl, opt, tp, prompts, resp, resident_bytes),
              rejected, f"gen instances tp{tp}")
    if g is not None:
      # The trainer's instances hold their share of the batch (more slots only cost it).
      slots = (-(-wl.global_batch // (wl.num_devices // tp)) if opt.trainer_runnable else
               g["plan"].slots)
      plan = GenerationPlan("instances", tp, slots=slots)
      out.append(Candidate(plan, g["gen_s"], {"gen_s": g["gen_s"],
                                               "reshard_s": reshard_s(cost, wl, tp)}))
    for pp in pps:
      if wl.actor.num_layers % pp or wl.num_devices % (tp * pp):
        continue
      for groups in (pp, 2 * pp):
        p = _fits(lambda: pipelined_generation(cost, wl.actor, wl.num_devices, tp, pp, groups,
                                               prompts, resp, wl.max_new_tokens,
                                               resident_bytes, wl.kv_slot_len(prompts),
                                               whole_ends=opt.trainer_runnable),
                  rejected,
                  f"gen pipeline pp{pp} tp{tp} G{groups}")
        if p is not None:
          plan = GenerationPlan("pipeline", tp, pp, groups, p["samples_per_replica"])
          out.append(Candidate(plan, p["gen_s"], {**p, "reshard_s": reshard_s(cost, wl,
                                                                                tp * pp)}))
  for c in out:
    c.seconds = c.info["gen_s"] + c.info["reshard_s"]
  return out


def reshard_s(cost: CostModel, wl, devices_per_copy: int, receivers: int = 0,
              senders: int = 0) -> float:
  """The actor's new weights into a generation layout whose copy spans `devices_per_copy`
  devices (every simulated system pays it, iteration_sim). A node's devices hold identical
  copies when a copy is smaller than the node, so one copy a node crosses the scale-out network,
  through all the node's NICs (the ring collectives' link model, hardware.link_bw), and spreads
  over NVLink, the two pipelined (each chunk forwarded as it lands), hence the slower of them.
  With `receivers` and `senders` (asynchronous PPO: the training group holds the weights, the
  generation group receives them) the senders' NICs bound it too: every node-level copy leaves
  through them. (Each receiver pulling its shard through its own NIC, as this was until
  2026-11-30, charged a copy smaller than a node up to 8x, DeepSpeed-Chat's tp-1 13B 0.65 s
  for 0.08 s, and never the senders.) A cluster of one node never uses the network: the same
  bytes move over its fast link (they crossed the NICs, 9x slower on H100, until 2026-12-03)."""
  w, dpn = wl.actor.weight_bytes(), cost.hw.devices_per_node
  spread = max(devices_per_copy, dpn)  # devices (NICs) one copy crosses the network through
  network = w / spread
  if receivers and senders:
    network = max(network, receivers / spread * w / senders)
  fan_out = cost.p2p_s(w / devices_per_copy, cross_node=False) if devices_per_copy < dpn else 0.0
  return float(max(cost.p2p_s(network, cross_node=wl.num_devices > dpn), fan_out))


# Asynchronous PPO's inference on the generation group: the frozen models only (reference and
# reward model). The trainer (trainer/loop.py) scores a batch with the current actor (proximal
# log-probs) and critic (values) on the training group when it trains on it: rescore_s.
ASYNC_GENERATION_FROZEN = ("reference", "reward")
# Seconds between the asynchronous search's progress lines (its splits of 4096 devices: 81 s,
# 2026-12-06 on the 2-core dev machine, silent before).
PROGRESS_S = 15.0


def rescore_s(cost: CostModel, wl, train_plan: dict, seq_lens: np.ndarray, opt) -> float:
  """Asynchronous PPO, on the training group before its updates: the current actor's log-probs
  and the current critic's values over the batch (trainer/loop.py _current_values and
  _off_policy), on the training plan's own layout, where both models' weights already are (no
  load, no second copy: a layout of its own would have to fit beside the training state, and
  the whole-model shards of tp-only instances do not, e.g. 65 GB per device at 65B/65B tp 4).
  Colocated: the actor's forward pipeline (tp x actor_pp, every replica of the group) then the
  critic's (none where the run trains no critic); disjoint: each model on its own devices at
  once, the slower one counts."""
  if train_plan["placement"] == "colocated":
    n, tp = train_plan["devices"], train_plan["tp"]
    return sum(inference_stage_s(cost, (shape,), n, tp, train_plan[f"{role}_pp"], seq_lens,
                                 opt.inference_microbatch, False)
               for role, shape in wl.trained_models)
  return max(inference_stage_s(cost, (shape,), q["devices"], q["tp"], q["pp"], seq_lens,
                               opt.inference_microbatch, False)
             for shape, q in ((wl.actor, train_plan["actor"]), (wl.critic, train_plan["critic"])))


def rescores(wl, plan: dict) -> bool:
  """Whether the trainer scores each batch again on the training devices of `plan` before its
  update (asynchronous PPO: rescore_s's passes): a plan with an "async" entry (a split or
  async_search's colocated option), or one searched for a run that generates asynchronously on
  its training devices (Workload.actor_copy)."""
  return bool(plan.get("async")) or bool(wl.actor_copy)


# plan_memory's stage names of the two rescoring passes on the training devices (rescore_rows).
RESCORE_STAGES = {"actor": "rescore (actor log-probs)", "critic": "rescore (critic values)"}


def rescore_rows(cost: CostModel, wl, opt, train: dict, kept: dict) -> list[dict]:
  """Per device of the training devices, what rescore_s's two passes hold, one after the
  other (plan_memory's rows; plan_check's actor_logp and critic_values programs): beside the
  whole training state of the model's devices (both models' weights and AdamW state where
  colocated, the model's own where disjoint; the AdamW state whatever sim.offload_optimizer
  says, as the passes run after the rollout: plan_programs.beside_train_state) and `kept`
  (the frozen weights kept there), one layer's activations of the rows scored at once at
  wl.padded_len tokens and, for the actor, its float32 logits of those rows at the response
  positions (LOGITS_COPIES_SCORING), over the tensor devices. The rows: with
  sim.trainer_runnable the trainer's, a mini-batch a piece (its Scorer's micro_batch_size =
  algo.minibatch_size) split over the data shards of the training mesh, and on a pipelined
  update (actor_pp > 1) each model's whole weights gathered over the tensor devices beside
  its stage shards (Update.whole's copy, plan_check's state_actor_bytes = 0); else (the
  papers' systems: a forward pipeline on the training layout, rescore_s)
  sim.inference_microbatch samples a replica, on the stage shards. Until 2026-12-07 the passes
  were timed (rescore_s) but their memory was counted nowhere. A run without a critic
  (Workload.trains_critic) has the actor's pass alone."""
  state_opt = dataclasses.replace(opt, offload_optimizer=False)
  if train["placement"] == "colocated":
    tplan = colocated_train_plan(wl, train)
    layouts = {"actor": (train["tp"], train["actor_pp"], tplan.dp),
               "critic": (train["tp"], tplan.critic_pp, tplan.dp * tplan.critic_replicas)}
    from rlhfuse_jax.sim import iteration_sim as it
    shared = it.colocated_state_bytes(cost, wl, state_opt, tplan)
    state = {"actor": shared, "critic": shared}
    # the Scorer runs on the training mesh: its data axis (tp x actor_pp x dp) for both
    data = {"actor": tplan.dp, "critic": tplan.dp}
    gathered = train["actor_pp"] > 1
    gather = {"actor": gathered, "critic": gathered}
  else:
    layouts = {r: (train[r]["tp"], train[r]["pp"], train[r]["dp"]) for r in ("actor", "critic")}
    state = {r: _model_state(cost, s, *layouts[r], state_opt)
             for r, s in (("actor", wl.actor), ("critic", wl.critic))}
    data = {r: train[r]["dp"] for r in ("actor", "critic")}
    gather = {r: train[r]["pp"] > 1 for r in ("actor", "critic")}
  rows = []
  for role, shape in wl.trained_models:
    tp, pp, _ = layouts[role]
    if opt.trainer_runnable:
      at_once = -(-wl.minibatch // data[role])
      whole = shape.weight_bytes() / tp if gather[role] else 0.0
    else:
      at_once, whole = opt.inference_microbatch, 0.0
    parts = {"training state": state[role], **kept}
    if whole:
      parts["whole weights gathered (pp > 1)"] = whole
    parts["activations"] = cost.activation_bytes(shape, tp, at_once * wl.padded_len, 1)
    logits = cost.logits_bytes(shape, tp, at_once, wl.max_new_tokens, LOGITS_COPIES_SCORING)
    if logits:
      parts["logits"] = logits
    rows.append({"stage": RESCORE_STAGES[role],
                 "layout": (_describe_train(train) if train["placement"] == "colocated" else
                            f"{train[role]['devices']} dev tp{tp} pp{pp} dp{data[role]}")
                 + f", {at_once} samples at once", "parts": parts})
  return rows


def _model_state(cost: CostModel, shape: ModelShape, tp: int, pp: int, dp: int, opt) -> float:
  """One model's weights and AdamW state (ZeRO-1 over dp) per device on a tp x pp x dp layout
  (iteration_sim.kept_state_bytes of its cost_model.train_memory_parts)."""
  from rlhfuse_jax.sim import iteration_sim as it
  return it.kept_state_bytes(cost.train_memory_parts(shape, tp, pp, dp, True, 0.0, 0), opt)


def rescore_refusal(cost: CostModel, wl, opt, train: dict, kept: Optional[dict] = None
                    ) -> Optional[str]:
  """Why rescore_s's passes on the training plan `train` do not fit (rescore_rows beside
  `kept`), or None."""
  for row in rescore_rows(cost, wl, opt, train, kept or {}):
    need = sum(row["parts"].values())
    if need > cost.usable_bytes:
      return (f"{row['stage']} on training {row['layout']} does not fit in memory: needs "
              f"{need / GIB:.1f} GiB per device > {cost.usable_bytes / GIB:.1f} GiB usable "
              "(asynchronous PPO scores each batch again on the training devices, beside the "
              "training state)")
  return None


def async_iteration_s(gen_plus_inf_s: float, train_s: float, reshard: float,
                      colocated: bool) -> float:
  """Steady-state iteration of asynchronous PPO (module docstring): the groups overlap when
  disjoint; colocated (both groups on all devices) the stages still run one after the other."""
  if colocated:
    return reshard + gen_plus_inf_s + train_s
  return max(gen_plus_inf_s, train_s) + reshard


def async_colocated_predicted(cost: CostModel, wl, opt, predicted: dict, inference: dict,
                              training: dict) -> dict:
  """The predicted times of a synchronous plan (`predicted`: its reshard_s, gen_s, train_s;
  `inference` and `training` in plan.json's form) run asynchronously with both groups on all
  the devices (async_search's colocated option; iteration_sim's pipe_rlhf_async row for the
  uniform layout): its instances score with ASYNC_GENERATION_FROZEN alone (the trainer's
  asynchronous stage has no critic, trainer/loop.py stage_critic), its training devices
  rescore the batch first (rescore_s), and nothing overlaps (async_iteration_s). Until
  2026-12-07 both kept the synchronous plan's times, the critic's forwards and no rescore."""
  prompts, resp = wl.sample_lengths()
  seq = (prompts + resp).astype(np.float64)
  inf_s = inference_stage_s(cost, wl.frozen_models(ASYNC_GENERATION_FROZEN)[1], wl.num_devices,
                            inference["tp"], inference.get("pp", 1), seq,
                            opt.inference_microbatch, opt.offload_frozen)
  rescore = rescore_s(cost, wl, training, seq, opt)
  train_s = predicted["train_s"] + rescore
  iteration = async_iteration_s(predicted["gen_s"] + inf_s, train_s, predicted["reshard_s"],
                                True)
  return {**predicted, "inf_s": inf_s, "train_s": train_s, "rescore_s": rescore,
          "gen_plus_inf_s": predicted["gen_s"] + inf_s, "iteration_s": iteration,
          "serial_s": iteration, "bound": "colocated"}


def async_splits(cost: CostModel, num_devices: int, split_unit: int = 0) -> list[int]:
  """Generation-group sizes g tried (the training group gets num_devices - g): multiples of
  `split_unit` devices strictly between 0 and num_devices. 0: a node, so no node is shared by
  the two groups; where one node holds every device (one GPU node; a TPU preset's node is a
  whole pod slice, 256 or 8960 chips) a host, and where one host does, a device (a node step
  tried no split there: the async plan was the synchronous one, 19 % slower than a 4-chip step
  on 256 v5p chips, 13b/13b)."""
  hw = cost.hw
  unit = split_unit or next(u for u in (hw.devices_per_node, hw.host_devices, 1)
                            if u < num_devices or u == 1)
  if unit < 1:
    raise ValueError(f"async split unit={unit} must be >= 1")
  return list(range(unit, num_devices, unit))


def inference_candidates(cost: CostModel, wl, opt, seq_lens, rejected: dict,
                         models: tuple = ("reference", "critic", "reward")) -> list[Candidate]:
  """Inference plans (tp, and pp: a forward pipeline of pp stages, shapes.stage_shape) for the
  forwards of `models` (reference: the actor's shape; critic its own; reward model:
  Workload.reward_shape) over the batch: `seq_lens`, prompt + response (the time); the memory
  check scores sim.inference_microbatch samples at once at wl.padded_len tokens
  (iteration_sim.inference_memory_parts; beside the training state, and with
  sim.trainer_runnable at the trainer's rows, per plan: _memory_refusal). Pipelines (pp 2, 4)
  only for offloaded frozen models (sim.offload_frozen; kept ones stay whole on their tp
  devices: iteration_sim.kept_frozen_bytes); the papers' systems lay the frozen models out so
  where they do not fit otherwise (since 2026-12-05 (bl): 65B/33B's three frozen models, 65 GB,
  do not fit on 4 devices beside the training state, and 52 heads rule out tp8), and the
  trainer runs them on its generation instances (plan.inference_pp; trainer_refusal)."""
  from rlhfuse_jax.sim import iteration_sim as it
  models, frozen = wl.frozen_models(models)
  pps = (1, 2, 4) if opt.offload_frozen else (1,)
  out = []
  for tp in (1, 2, 4, 8):
    why = (f"tp{tp} is more than a node's {cost.hw.devices_per_node} devices"
           if tp > cost.hw.devices_per_node else
           next(filter(None, (s.tensor_parallel_error(tp) for s in frozen)), None))
    if why:  # (once for the degree, not once per pipeline depth)
      rejected[f"inference {InferencePlan(tp).describe()}"] = why
      continue
    for pp in pps:
      name = f"inference {InferencePlan(tp, pp).describe()}"
      why = next((f"pp{pp} does not divide {s.name}'s {s.num_layers} layers" for s in frozen
                  if s.num_layers % pp), None)
      if why:
        rejected[name] = why
        continue
      t = _fits(lambda: (it.check_inference_memory(cost, wl, tp, opt.inference_microbatch,
                                                   frozen, " + ".join(models), pp),
                         inference_stage_s(cost, frozen, wl.num_devices, tp, pp, seq_lens,
                                           opt.inference_microbatch, opt.offload_frozen))[1],
                rejected, name)
      if t is not None:
        out.append(Candidate(InferencePlan(tp, pp), t, {"inf_s": t}))
  return out


def colocated_train_plan(wl, train: dict, devices: Optional[int] = None
                         ) -> "train_lib.TrainPlan":
  """training_sim.TrainPlan of a colocated training plan `train` (plan.json's form) on its
  devices (or `devices`); a plan without a critic (training_candidates' for a run that trains
  none) records no critic_pp: its TrainPlan's is the actor's (unread)."""
  return train_lib.TrainPlan(devices or train["devices"], wl.minibatch, train["tp"],
                             train["actor_pp"], train.get("critic_pp", train["actor_pp"]),
                             wl.micro_batch)


def colocated_train_dict(wl, tp: int, actor_pp: int, critic_pp: int) -> dict:
  """A colocated training plan in plan.json's form: placement, devices, tp, actor_pp and
  critic_pp (none where the run trains no critic: Workload.trains_critic) and its
  micro_batching."""
  return {"placement": "colocated", "devices": wl.num_devices, "tp": tp, "actor_pp": actor_pp,
          **({"critic_pp": critic_pp} if wl.trains_critic else {}),
          **micro_batching(wl, tp, actor_pp, critic_pp)}


def micro_batching(wl, tp: int, actor_pp: int, critic_pp: int) -> dict:
  """The micro-batching a colocated training plan was timed and sized with, for plan.json: the
  samples per micro-batch and, pipelined, the actor's micro-batches per data shard and the
  critic's per replica (training_sim.TrainPlan's Ma, Mc). The trainer runs the plan with them
  (trainer/plan_file.plan_file_settings): without, it kept its own (ppo configs: 4 micro-batches
  of 16 rows for an 8B actor) and a plan the search said fits took 134 GB of 80."""
  plan = train_lib.TrainPlan(wl.num_devices, wl.minibatch, tp, actor_pp, critic_pp,
                             wl.micro_batch)
  out = {"micro_batch": wl.micro_batch}
  if actor_pp > 1:
    out["actor_microbatches"] = plan.actor_microbatches
    if wl.trains_critic:
      out["critic_microbatches"] = plan.critic_microbatches
  return out


def training_candidates(cost: CostModel, wl, mean_len: float, rejected: dict,
                        resident_bytes: float = 0.0, idle: bool = False) -> list[Candidate]:
  """Colocated pipeline plans (serial 1F1B time at `mean_len`; training_sim.best_plan's grid)
  and disjoint splits (each model alone on 1/4, 1/2 or 3/4 of the devices, at once), their
  memory at the trainer's padded rows (wl.padded_len), beside `resident_bytes` per device of
  frozen weights (search). With `idle` (the synchronous search's) a disjoint model may leave
  some of its share idle (training_sim.single_model_plan): the one kind of plan here that does;
  an asynchronous split's training group does not (its size is itself searched; with it 23 of
  65B/33B's 31 splits of 256 H100s fit instead of 3, each searched through: 3.5x the search's
  time, for the same best split). A run without a critic (Workload.trains_critic): the
  actor's colocated plans alone (training_sim's `critic` None), no critic_pp, no splits."""
  out = []
  try:
    _, tried = train_lib.best_plan(cost, wl.actor, wl.trained_critic, wl.num_devices,
                                   wl.minibatch,
                                   wl.micro_batch, mean_len, wl.num_minibatches,
                                   resident_bytes=resident_bytes, padded_len=wl.padded_len,
                                   head_positions=wl.max_new_tokens)
  except train_lib.NoTrainingPlan as e:  # each candidate's reason, named as below
    tried = e.tried
    if not tried:
      rejected["training colocated"] = str(e)
  for name, t in tried.items():
    if isinstance(t, str):
      rejected[f"training {name}"] = t
      continue
    tp, pa, *pc = (int(x[2:]) for x in name.split("/"))  # ("tp2/pa4": no critic)
    out.append(Candidate(colocated_train_dict(wl, tp, pa, pc[0] if pc else pa), float(t),
                         {"train_s": float(t)}))
  if not wl.trains_critic:
    return out  # (no critic to train on devices of its own)
  splits = train_lib.disjoint_splits(cost, wl.actor, wl.critic, wl.num_devices, wl.minibatch,
                                     wl.micro_batch, mean_len, resident_bytes=resident_bytes,
                                     padded_len=wl.padded_len,
                                     head_positions=wl.max_new_tokens, idle=idle)
  if not splits:
    rejected["training disjoint"] = "no split of the devices fits both models"
  for step, plans in splits:
    t = step * wl.num_minibatches
    out.append(Candidate({"placement": "disjoint", **plans}, t, {"train_s": t}))
  return out


def beside_frozen(cost: CostModel, wl, opt, infs: list, prompts, resp, mean_len: float,
                  rejected: dict, training: bool = True) -> tuple[dict, dict]:
  """Generation (and with `training` training) candidates beside each inference plan's frozen
  weights: ({kept bytes per device: (generation, training candidates, fastest first)},
  {inference tp: its kept bytes}). With sim.offload_frozen=False the frozen reference and
  reward model stay in the inference layout, a copy over each inference instance's tp devices
  (iteration_sim.kept_frozen_bytes), while the other stages run, so a generation or training
  plan must fit beside the share of the inference plan it is combined with. Offloaded, every
  share is 0 and each stage is searched once, as before 2026-11-30, when no stage here charged
  them."""
  from rlhfuse_jax.sim import iteration_sim as it
  kept_at = {c.plan.tp: it.kept_frozen_bytes(wl, c.plan.tp, opt) for c in infs}
  groups = {}
  for kept in sorted(set(kept_at.values())) or [0.0]:
    rej: dict = {}
    gens = generation_candidates(cost, wl, opt, prompts, resp, rej, resident_bytes=kept)
    trains = training_candidates(cost, wl, mean_len, rej, kept, idle=True) if training else []
    rejected.update(rej if not kept else {
        f"{k} beside {kept / GIB:.1f} GiB of frozen weights": v for k, v in rej.items()})
    groups[kept] = tuple(sorted(c, key=lambda x: x.seconds) for c in (gens, trains))
  return groups, kept_at


def uniform_candidates(cost: CostModel, wl, opt, prompts, resp, mean_len: float,
                       rejected: dict) -> list[Candidate]:
  """One (tp, pp) layout for every stage (module docstring); no resharding. With
  sim.offload_frozen=False the frozen reference and reward model stay in that layout through
  generation and training; generation fits beside the training state of that layout's
  training plan too (until 2026-12-05 it did not count it), and so does its inference (its
  pp stages; until 2026-12-05 (bl) not checked)."""
  from rlhfuse_jax.sim import iteration_sim as it
  frozen = wl.frozen_models()[1]
  seq = (prompts + resp).astype(np.float64)
  out = []
  for tp, pp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16)):
    if (tp > cost.hw.devices_per_node or wl.num_devices % (tp * pp) or
        any(s.tensor_parallel_error(tp) or s.num_layers % pp
            for s in tuple(m for _, m in wl.trained_models) + frozen)):
      continue
    name = f"uniform tp{tp} pp{pp}"
    kept = it.kept_frozen_bytes(wl, tp * pp, opt)
    try:
      plan = train_lib.TrainPlan(wl.num_devices, wl.minibatch, tp, pp, pp, wl.micro_batch)
      # generation beside the training state too (plan_memory's "training state kept")
      state = it.colocated_state_bytes(cost, wl, opt, plan)
      beside = "the training state" + (" and the frozen models' weights "
                                         "(sim.offload_frozen=False)" if kept else "")
      if pp == 1:
        g = instance_generation(cost, wl, opt, tp, prompts, resp, kept + state, beside)
        slots = (-(-wl.global_batch // (wl.num_devices // tp)) if opt.trainer_runnable else
                 g["plan"].slots)  # (generation_candidates')
        gen_plan = GenerationPlan("instances", tp, slots=slots)
      else:
        g = pipelined_generation(cost, wl.actor, wl.num_devices, tp, pp, 1, prompts, resp,
                                 wl.max_new_tokens, kept + state, wl.kv_slot_len(prompts),
                                 beside, whole_ends=opt.trainer_runnable)
        gen_plan = GenerationPlan("pipeline", tp, pp, 1, g["samples_per_replica"])
      gen = g["gen_s"]
      it.check_inference_memory(cost, wl, tp, opt.inference_microbatch, pp=pp,
                                resident_bytes=state, resident="the training state")
      inf = inference_stage_s(cost, frozen, wl.num_devices, tp, pp, seq,
                              opt.inference_microbatch, opt.offload_frozen)
      costs = train_lib.step_costs(cost, wl.actor, wl.trained_critic, plan, mean_len,
                                   resident_bytes=kept, padded_len=wl.padded_len,
                                   head_positions=wl.max_new_tokens)
      train = train_lib.pipeline_train_s(costs, wl.num_minibatches, fused=False)["train_s"]
    except ValueError as e:
      rejected[name] = str(e)
      continue
    # (plans: the layout in plan.json's form, for plan_memory)
    plans = {"generation": dataclasses.asdict(gen_plan),
             "inference": dataclasses.asdict(InferencePlan(tp, pp)),
             "training": colocated_train_dict(wl, tp, pp, pp)}
    out.append(Candidate({"tp": tp, "pp": pp, "dp": wl.num_devices // (tp * pp)},
                         gen + inf + train, {"gen_s": gen, "inf_s": inf, "train_s": train,
                                             "reshard_s": 0.0, "plans": plans}))
  return out


def _pair_reshard_s(gen: Candidate, train: Candidate) -> float:
  """The actor's weights into the generation layout, or 0 where generation runs on instances of
  the training layout itself (colocated, the same tp, no actor pipeline: each instance already
  holds its shard, as the uniform plans do)."""
  t = train.plan
  same = (gen.plan.mode == "instances" and t["placement"] == "colocated" and
          t["tp"] == gen.plan.tp and t["actor_pp"] == 1)
  return 0.0 if same else gen.info["reshard_s"]


def _combo_s(combo: tuple) -> float:
  gen, inf, train = combo
  return gen.info["gen_s"] + _pair_reshard_s(gen, train) + inf.seconds + train.seconds


def _plan_dict(gen: Candidate, inf: Candidate, train: Candidate) -> dict:
  g = gen.info
  return {
      "generation": dataclasses.asdict(gen.plan), "inference": dataclasses.asdict(inf.plan),
      "training": train.plan,
      "predicted": {"reshard_s": _pair_reshard_s(gen, train), "gen_s": g["gen_s"],
                    "inf_s": inf.seconds, "train_s": train.seconds,
                    "iteration_s": _combo_s((gen, inf, train))},
      "summary": f"gen {gen.plan.describe()}; inference {inf.plan.describe()}; training "
                 f"{_describe_train(train.plan)}",
  }


def inference_rows(wl, opt, plan: dict) -> int:
  """Samples the inference of `plan` (plan.json's form) scores at once: sim.inference_microbatch;
  with sim.trainer_runnable the trainer's, whose programs plan_check compiles: on generation
  instances the run's fusion.inference_micro_batch (Workload.inference_micro_batch), 0 (the
  default) a micro-batch of the instance's slots (trainer/rollout.plan_instances_config,
  FusedGenConfig.micro_batch), after a generation pipeline the Scorer's whole rollout batch
  split over the inference mesh's data = g / tp (trainer/rollout.PlannedStage)."""
  if not opt.trainer_runnable:
    return opt.inference_microbatch
  split = plan.get("async")
  g = wl.num_devices if async_copies.split_colocated(split) else split["generation_devices"]
  gen, tp = plan["generation"], plan["inference"]["tp"]
  if gen["mode"] == "instances":
    return wl.inference_micro_batch or gen["slots"]
  return -(-wl.global_batch // (g // tp))


def inference_memory(cost: CostModel, wl, opt, plan: dict) -> dict:
  """Per device of `plan`'s inference: the frozen models it scores with (ASYNC_GENERATION_FROZEN
  for any asynchronous plan, a split's generation group or async_search's colocated option:
  the trainer's async stage has no critic, trainer/loop.py stage_critic; the colocated option
  was charged the critic until 2026-12-07; else reference, critic and reward model) over its
  tp, and one layer's activations of inference_rows samples
  (iteration_sim.inference_memory_parts)."""
  from rlhfuse_jax.sim import iteration_sim as it
  models = ASYNC_GENERATION_FROZEN if plan.get("async") else ("reference", "critic", "reward")
  frozen = wl.frozen_models(models)[1]
  return it.inference_memory_parts(cost, wl, plan["inference"]["tp"],
                                   inference_rows(wl, opt, plan), frozen,
                                   plan["inference"].get("pp", 1))


# plan_memory's name for asynchronous PPO's copy of the actor on the training devices.
ACTOR_COPY = "actor's copy (async PPO)"


def keeps_actor_copy(wl, plan: dict) -> bool:
  """Whether the trainer keeps asynchronous PPO's copy of the actor on the training devices of
  `plan` (trainer/loop.PPOTrainer._snapshot: made before each update, kept through it and the
  next batch's generation; plan_check's actor_copy_bytes): an asynchronous plan with both groups
  on all the devices (async_search's colocated option), or a plan without an "async" entry
  searched for a run that generates asynchronously on its training devices
  (Workload.actor_copy); not an asynchronous split's (the generation group's actor is the
  copy there): the trainer's rule (policy/async_copies.keeps_actor_copy) of the plan's split,
  which the trainer runs with no generation group where it is colocated."""
  split = plan.get("async")
  if split:
    return async_copies.keeps_actor_copy(
        split.get("staleness", async_copies.SPLIT_STALENESS),
        0 if async_copies.split_colocated(split) else split["generation_devices"])
  return bool(wl.actor_copy)


def actor_copy_bytes(wl, train: dict) -> float:
  """Per device, asynchronous PPO's copy of the actor (keeps_actor_copy) on the training plan
  `train` (plan.json's "training"): the actor's whole weights in their dtype
  (ModelShape.weight_bytes, the run's model.param_dtype) split over the tensor degree, as the
  trainer places it: unpipelined a copy of the state's own shards (replicated over data),
  pipelined Update.whole's copy gathered over the stages; over fsdp x tensor, and the plans
  here set no fsdp (a run's own mesh.fsdp would split it further). A disjoint placement's on
  the actor's devices, at the actor's tp."""
  tp = train["tp"] if train["placement"] == "colocated" else train["actor"]["tp"]
  return wl.actor.weight_bytes() / tp


# plan_memory's name for the whole actor an asynchronous split's generation group keeps.
GROUP_ACTOR = "actor whole (async PPO's generation group)"


def group_actor_bytes(wl, opt, plan: dict) -> float:
  """Per device of an asynchronous split's generation group (plan "async", not colocated),
  with sim.trainer_runnable: the actor's whole weights in their dtype (ModelShape.
  weight_bytes). The trainer moves the actor onto the group's data-only mesh, whole on every
  device (trainer/async_ppo.meshes, PPOTrainer._to_generation), and keeps that copy, the policy
  of the batch in flight, through its generation and inference, beside the generation layout's
  own copy (instances of tp devices, a pipeline's stages) and the frozen models. 0 for every
  other plan, and without sim.trainer_runnable (a system that receives the actor straight
  into its generation layout). Until 2026-12-07 not counted: 33B on 64 H100s (batch 128,
  mini-batch 64, staleness 1) was given generation on 32 devices in instances of tp4 at 33.4
  GiB a device, where the trainer holds 60.6 GiB more."""
  split = plan.get("async")
  if not opt.trainer_runnable or async_copies.split_colocated(split):
    return 0.0
  return float(wl.actor.weight_bytes())


def keeps_frozen_on_mesh(opt, plan: dict) -> bool:
  """Whether the trainer keeps the frozen models (reference, reward model) on the devices of
  `plan`'s generation whatever sim.offload_frozen says (with sim.trainer_runnable): a
  generation pipeline runs in the trainer's PlannedStage (rollout.stage_kind), which places
  them once on its inference mesh (data x tensor = plan.inference_tp over the stage's devices)
  and keeps them there for the whole run (loop.PPOTrainer: only the fused and instances stages
  move them to host memory): on a generation group beside its generation, synchronously on
  the training devices beside every stage, the update included. Until 2026-12-07 counted
  on a generation group alone: the synchronous pipeline's training and generation were
  checked with sim.offload_frozen's host memory, which this stage never uses."""
  return bool(opt.trainer_runnable) and plan["generation"]["mode"] == "pipeline"


def plan_memory(cost: CostModel, wl, opt, plan: dict) -> list[dict]:
  """Per device, what each stage of `plan` (plan.json's form: _plan_dict, _async_plan) holds,
  by the formulas its memory checks use: [{"stage", "layout", "parts": {name: bytes},
  "total", "usable"}], `usable` the HBM the checks allow (memory_headroom of hbm_bytes).
  Generation: the actor's weights, the KV cache of its share of the batch at
  Workload.kv_slot_len tokens a slot and the prefill's activations of the prompts it prefills at
  once (iteration_sim.gen_plan, pipelined_generation; with
  sim.trainer_runnable the trainer's, trainer_workload); inference: the frozen
  weights and one layer's activations of the rows it scores at once (inference_memory);
  training: each model's weights, gradients, optimizer state and in-flight activations at the
  trainer's padded rows (cost_model.train_memory_parts, training_sim.check_train_memory). With
  sim.offload_frozen=False each row also holds the frozen weights kept on its devices, and
  generation and inference, where training shares their devices, the training state: both
  models' weights and AdamW state (iteration_sim.kept_state_bytes; a disjoint placement's
  larger one), the search's _memory_refusal. On an asynchronous split's generation group, with
  sim.trainer_runnable, generation and inference also hold the whole actor (GROUP_ACTOR,
  group_actor_bytes). With sim.trainer_runnable a generation pipeline's rows hold the frozen
  weights the trainer keeps on its inference mesh (keeps_frozen_on_mesh): the group's, or
  synchronously every row, training included. Where the trainer keeps asynchronous PPO's
  copy of
  the actor on the training devices (keeps_actor_copy), every row also holds it (ACTOR_COPY,
  actor_copy_bytes: beside the update, and beside the generation and inference it is made
  for; a disjoint placement's on the actor's devices), and the AdamW state is kept whatever
  sim.offload_optimizer says (the trainer refuses optim.offload_during_rollout with
  asynchronous PPO)."""
  from rlhfuse_jax.sim import iteration_sim as it
  if opt.trainer_runnable:
    wl = trainer_workload(wl)
  n, b = wl.num_devices, wl.global_batch
  split = plan.get("async")
  g = n if async_copies.split_colocated(split) else split["generation_devices"]
  t = n if g == n else n - g
  gen, inf, train = plan["generation"], plan["inference"], plan["training"]
  prompts, _ = wl.sample_lengths()
  slot_cap = wl.kv_slot_len(prompts)
  kept = it.kept_frozen_bytes(wl, inf["tp"], opt)
  if keeps_frozen_on_mesh(opt, plan):
    kept = it.kept_frozen_bytes(wl, inf["tp"], dataclasses.replace(opt, offload_frozen=False))
  kept_parts = {"frozen weights kept": kept} if kept else {}
  a = wl.actor
  if gen["mode"] == "instances":
    per = -(-b // (g // gen["tp"]))
    copy = gen["tp"]
    prefilled = per  # the share at once (gen_plan's check)
  else:
    per = -(-b // (g // (gen["tp"] * gen["pp"])))
    copy = gen["tp"] * gen["pp"]
    prefilled = -(-per // gen.get("groups", 1))  # a group at a time
  slot_kv = slot_cap * a.kv_bytes_per_token() / copy
  row_act = prefill_activation_bytes(cost, a, gen["tp"], 1, slot_cap - wl.max_new_tokens)
  if gen["mode"] == "instances" and wl.kv_at_max_prompt:  # the trainer's engine: or, at
    # another time, a migration's copy of its rows (iteration_sim.gen_plan)
    transient = {"prefill activations or a migration's rows":
                 it.transient_bytes(wl, per, row_act, slot_kv)}
  else:
    transient = {"prefill activations": prefilled * row_act}
  tokens = wl.micro_batch * wl.padded_len
  # The training group keeps no frozen weights when generation has its own devices.
  kept_train = kept_parts if g == n else {}
  actor_copy = actor_copy_bytes(wl, train) if keeps_actor_copy(wl, plan) else 0.0
  if actor_copy:  # (config.py refuses optim.offload_during_rollout with asynchronous PPO)
    opt = dataclasses.replace(opt, offload_optimizer=False)
  copy_part = {ACTOR_COPY: actor_copy} if actor_copy else {}
  if train["placement"] == "colocated":
    tplan = colocated_train_plan(wl, train, t)
    tp, pa, pc = tplan.tp, tplan.actor_pp, tplan.critic_pp
    parts = [cost.train_memory_parts(a, tp, pa, tplan.dp, True, tokens,
                                     min(pa, tplan.actor_microbatches), tplan.accumulates,
                                     wl.micro_batch, wl.max_new_tokens)]
    if wl.trains_critic:
      parts.append(cost.train_memory_parts(wl.critic, tp, pc, tplan.dp * tplan.critic_replicas,
                                           True, tokens, min(pc, tplan.critic_microbatches),
                                           tplan.accumulates))
    both = {k: sum(p.get(k, 0.0) for p in parts)
            for k in dict.fromkeys(k for p in parts for k in p)}  # (the actor's logits alone)
    trains = [{"stage": "training", "layout": _describe_train(train),
               "parts": {**both, **kept_train, **copy_part}}]
    state = sum(it.kept_state_bytes(p, opt) for p in parts)
    beside = {**copy_part}
  else:
    trains, state, states = [], 0.0, {}
    for role, shape in (("actor", a), ("critic", wl.critic)):
      q = train[role]
      p = cost.train_memory_parts(shape, q["tp"], q["pp"], q["dp"], True, tokens,
                                  min(q["pp"], q["M"]), train_lib.accumulates(q["pp"], q["M"]),
                                  wl.micro_batch, wl.max_new_tokens)
      trains.append({"stage": f"training ({role})",
                     "layout": f"{q['devices']} dev tp{q['tp']} pp{q['pp']} dp{q['dp']}",
                     "parts": {**p, **kept_train, **(copy_part if role == "actor" else {})}})
      states[role] = it.kept_state_bytes(p, opt)
      state = max(state, states[role])  # each model on its own devices
    # the copy on the actor's devices: what it adds to the larger state
    more = max(states["actor"] + actor_copy, states["critic"]) - state
    beside = {ACTOR_COPY: more} if actor_copy else {}
  # What training keeps between its steps stays on the devices while the other stages run
  # there (iteration_sim.train_state_bytes): not on an asynchronous split's generation group.
  # Until 2026-12-05 left out here: the search's combinations did not charge it; until
  # 2026-12-05 (bl) the inference was charged it only for the trainer's plans.
  kept_state = {"training state kept": state} if g == n and state else {}
  if g == n:
    kept_state.update(beside)
  group = group_actor_bytes(wl, opt, plan)
  group_part = {GROUP_ACTOR: group} if group else {}
  # An instance of tp 1 holds the group's own buffers of the actor (async_copies.
  # shares_group_buffers): its weights are the whole actor, counted once. Until 2026-12-07
  # counted twice there (a safe over-count).
  shared = (group and gen["mode"] == "instances" and
            async_copies.shares_group_buffers(gen["tp"]))
  weights = {} if shared else {"weights": a.weight_bytes() / copy}
  if group and gen["mode"] == "pipeline" and gen["tp"] == 1:
    # The trainer's pipeline (generation/pipelined.PipelinedGenerator.place) of tp 1 placed from
    # the group's whole actor: the embedding and LM head, replicated on every stage, are the
    # group's own buffers; the layers, stacked per stage (llama.stage_stack), new ones, L/pp a
    # stage. Measured 2026-12-07 (jax 0.10.2, 8 CPU devices, buffer pointers; ppo_tiny's actor
    # on a group of 4): at 2 layers, pp 1 and 2, all 11,520 bytes a stage of embedding and head
    # the group's, none of its 295,936 / pp of layers; at 4 layers, pp 4, the same
    # (tests/test_plan_check.py). Until then the embedding and head were counted again over pp.
    embed, head = end_params(a)
    weights = {"weights": (a.num_params() - embed - head) * a.weight_itemsize / gen["pp"]}
  elif opt.trainer_runnable and gen["mode"] == "pipeline" and gen["tp"] == 1:
    # The trainer's pipeline on the training devices: every stage holds the embedding and LM
    # head whole (PipelinedGenerator.param_shardings), beside L/pp layers. Measured 2026-12-07
    # (jax 0.10.2, 8 CPU devices, buffer pointers, tests/test_plan_check.py): from an actor
    # replicated over the training mesh (tp 1, no stages) they are its own buffers, counted in
    # the training state kept; from a split one (tensor or fsdp 2) new ones on each stage. Until
    # then both were spread over pp: a split actor's ends under-counted by (1 - 1/pp) of them.
    embed, head = end_params(a)
    whole = train["placement"] == "colocated" and train["tp"] == 1 and train["actor_pp"] == 1
    ends = 0 if whole else embed + head
    weights = {"weights": ((a.num_params() - embed - head) / gen["pp"] + ends)
               * a.weight_itemsize}
  rows = [{"stage": "generation", "layout": GenerationPlan(**gen).describe(),
           "parts": {**weights, "KV cache": per * slot_kv,
                     **transient, **kept_parts, **kept_state, **group_part}},
          {"stage": "inference", "layout": InferencePlan(**inf).describe(),
           "parts": {**inference_memory(cost, wl, opt, plan), **kept_state, **group_part}}
           ] + trains
  if rescores(wl, plan):  # asynchronous PPO's passes on the training devices (rescore_rows)
    rows += rescore_rows(cost, wl, opt, {**train, "devices": t} if train["placement"] ==
                         "colocated" else train, kept_train)
  for r in rows:
    r["total"] = sum(r["parts"].values())
    r["usable"] = cost.usable_bytes
  return rows


# The model fields plan.json's "workload" records of the actor and the critic (the trainer
# compares them, and the run fields below, with its own: trainer/plan_file.plan_workload_note).
# weight_itemsize and kv_itemsize: the bytes its weights and KV cache were sized at (a run's
# model.param_dtype and model.dtype, shapes.from_model_config). Every ModelShape field but its
# name, its head (the role's) and master_weights (a run field): until 2026-12-06 the first
# seven alone, and a run of another MLP width, head_dim, tied embeddings or biases was not
# warned of. head_dim is the one the model computes with (head_dim_: 0 resolved).
WORKLOAD_MODEL_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size",
                         "weight_itemsize", "kv_itemsize", "intermediate_size", "head_dim",
                         "tie_embeddings", "qkv_bias", "o_bias", "qk_norm", "max_seq_len")


def length_record(wl) -> dict:
  """plan.json's workload "lengths": the prompt and response length distributions `wl` was
  searched with, which drive the generation times, the long tail and so the plan's choice
  ("prompt", "response": each LengthSpec described and a summary of the lengths the search
  sampled, recorded, not compared), and for a train_ppo run's workload "data": the run's
  fields they came from (Workload.length_inputs: data.task, num_prompts and length_* or
  data.prompts_file and prompt_key; data.val_fraction, init.tokenizer, data.chat_template;
  the files' content digests), which
  train_ppo compares with its own (trainer/plan_file.py); none for the simulator's own
  config.prompt and config.response (the paper pairs' variants). Not recorded until
  2026-12-07: a plan searched for 1-8-token responses ran a long-tailed task without a word."""
  prompts, resp = wl.sample_lengths()
  out = {"prompt": {"spec": wl.prompt.describe(),
                    **summarize(prompts, wl.prompt.max_len)},
         "response": {"spec": wl.response.with_max_len(wl.max_new_tokens).describe(),
                      **summarize(resp, wl.max_new_tokens)}}
  if wl.length_inputs:
    out["data"] = dict(wl.length_inputs)
  return out


def workload_record(wl, train_config: str = "", opt=None, plan: Optional[dict] = None) -> dict:
  """plan.json's "workload": what the plan was searched for (the models' shapes, the reward
  model's when it has its own (Workload.reward), the batch,
  mini-batch, epochs, max prompt and generation lengths, the devices, whether it runs a
  reference model (Workload.reference) and a reward model (Workload.reward_model); the
  train_ppo config, its fusion.inference_micro_batch and fusion.migration_rows when one was
  given: they sized the inference's activations and the room a migration's rows take beside the
  KV cache; with the search's options `opt`, offload_optimizer: the run's
  optim.offload_during_rollout, which sized the training state kept beside generation; the
  length distributions: length_record; and actor_copy: whether the memory check counted
  asynchronous PPO's copy of the actor on the training devices (keeps_actor_copy of `plan`,
  the plan written; without one the run's, Workload.actor_copy), so that a run of another
  workload with it is warned of; trains_critic: whether it trains a critic
  (Workload.trains_critic; the critic's shape recorded only then)."""
  roles = wl.trained_models + (
      (("reward", wl.reward),) if wl.reward_model and wl.reward is not None else ())
  out = {role: {"name": shape.name, **{f: getattr(shape, "head_dim_" if f == "head_dim" else f)
                                       for f in WORKLOAD_MODEL_FIELDS}}
         for role, shape in roles}
  out.update(global_batch=wl.global_batch, minibatch=wl.minibatch, epochs=wl.epochs,
             max_prompt_len=wl.prompt.max_len, max_new_tokens=wl.max_new_tokens,
             num_devices=wl.num_devices, reference=wl.reference, reward_model=wl.reward_model,
             trains_critic=wl.trains_critic, lengths=length_record(wl),
             actor_copy=keeps_actor_copy(wl, plan) if plan is not None else bool(wl.actor_copy))
  if train_config:  # and the run's inference micro-batch and optimizer state, which sized
    # its inference and training memory
    out.update(train_config=train_config, inference_micro_batch=wl.inference_micro_batch,
               migration_rows=wl.migration_rows, master_weights=wl.actor.master_weights)
    if opt is not None:
      out["offload_optimizer"] = bool(opt.offload_optimizer)
  return out


def trainer_workload(wl):
  """`wl` as the trainer allocates it: every generation slot's KV cache at
  data.max_prompt_len + rollout.max_new_tokens (Workload.kv_at_max_prompt), for the plans it
  runs (search with sim.trainer_runnable or `accept`, plan_memory)."""
  return dataclasses.replace(wl, kv_at_max_prompt=True)


def _describe_train(p: dict) -> str:
  if p["placement"] == "colocated":
    if "critic_pp" not in p:  # (a run without a critic: training_candidates)
      return f"colocated tp{p['tp']} Pa={p['actor_pp']} (actor alone)"
    return f"colocated tp{p['tp']} Pa/Pc={p['actor_pp']}/{p['critic_pp']}"
  a, c = p["actor"], p["critic"]
  return (f"disjoint actor {a['devices']} dev (tp{a['tp']} pp{a['pp']} dp{a['dp']}), critic "
          f"{c['devices']} dev (tp{c['tp']} pp{c['pp']} dp{c['dp']})")


def plan_json_choice(wl, best: Optional[dict], async_best: Optional[dict]) -> str:
  """Which plan plan.json holds: "asynchronous" (`async_best`, async_search's best, where it
  is a split) or "synchronous" (`best`, the synchronous search's; its colocated option
  written as that plan). A split where no synchronous plan fits, or where it is predicted
  faster than the synchronous plan; for a run that generates asynchronously on its training
  devices (Workload.actor_copy: async_ppo.staleness > 0 without a generation group) wherever
  it is async_search's best: the trainer runs a plan without an "async" split asynchronously
  too, at the colocated option's time (async_colocated_predicted: the rescore, no critic on
  the instances), which the split beat. Until 2026-12-07 the split was compared with the
  synchronous time there: 7B/7B on 16 H100s (batch 64, mini-batch 32, 64 new tokens,
  staleness 1, trainer_runnable) wrote the synchronous plan (0.997 s) that such a run takes
  1.130 s with, over the 8 / 8 split's 1.052 s."""
  if async_best is None or async_copies.split_colocated(async_best["async"]):
    return "synchronous" if best is not None else "asynchronous"
  if best is None or wl.actor_copy:
    return "asynchronous"
  faster = async_best["predicted"]["iteration_s"] < best["predicted"]["iteration_s"]
  return "asynchronous" if faster else "synchronous"


# ----------------------------------------------------------------------------- the trainer
def trainer_refusal(wl, plan: dict, host_devices: Optional[int] = None) -> Optional[str]:
  """Why the trainer (rlhfuse_jax/trainer: plan_file.plan_file_settings, rollout.check_plan,
  validate.validate, pipelined.check_config) would refuse `plan` (plan.json's form: _plan_dict,
  _async_plan) for `wl`, or run it otherwise than simulated; None if it runs it.

  Training: colocated only (mesh.tensor = tp, mesh.stage = actor_pp, pipeline.critic_pp); tp
  divides both models' heads and MLP width, and their KV heads divide by tp or tp by them (the
  pipelined update's Megatron-style split); actor_pp divides the actor's layers, critic_pp the
  critic's layers and actor_pp; the training devices' data-parallel size divides the
  mini-batch (and so the rollout batch). Generation: instances of tp devices, tp dividing the
  generation devices and the actor's heads and KV heads, at least the batch's share of slots
  each, and inference on those instances (inference tp = generation tp; pp 1, or pipelines of
  pp instances, pp dividing the instances and the layers of every frozen model scored there,
  and, on several hosts of `host_devices` devices (Hardware.host_devices: one process each),
  each process's share of the instances: a pipeline's instances are one process's; an
  asynchronous split's generation group takes an equal share of every process's devices,
  trainer/async_ppo.split_devices); or, on one host (the trainer runs it in one process), one
  pipeline of tp 1 over all the generation devices (the trainer's engine runs one pipeline: a
  plan of several replicas would generate on a fraction of the devices), pp dividing the actor's
  layers, its G >= pp groups dividing the batch, and inference pp 1, tp dividing the generation
  devices. Asynchronous split ("async", not colocated): generation on g devices that divide
  the rollout batch, training on the others. What a run's config pins (micro-batch counts, the
  fusions, fields set away from their defaults) is not known here: `accept` of `search`."""
  n, a, c, b = wl.num_devices, wl.actor, wl.critic, wl.global_batch
  split = plan.get("async")
  g = n if async_copies.split_colocated(split) else split["generation_devices"]
  t = n if g == n else n - g
  if not 0 < g <= n:
    return f"a generation group of {g} of the {n} devices"
  if g < n and b % g:
    return f"the rollout batch of {b} does not split over {g} generation devices"
  gen, inf, train = plan["generation"], plan["inference"], plan["training"]
  if train.get("placement") != "colocated":
    return "disjoint training (the trainer trains actor and critic on the same devices)"
  tp, pa, pc = train["tp"], train["actor_pp"], train.get("critic_pp", train["actor_pp"])
  if not wl.trains_critic and pa > 1:
    return (f"training Pa={pa} without a critic (the trainer's pipelined update runs the actor "
            "and the critic together; a run that trains no critic takes mesh.stage=1)")
  for _, m in wl.trained_models:
    bad = [f"{f}={getattr(m, f)}" for f in ("num_heads", "intermediate_size")
           if getattr(m, f) % tp]
    bad += ([f"num_kv_heads={m.num_kv_heads}"] if m.num_kv_heads % tp and tp % m.num_kv_heads
            else [])
    if bad:
      return f"training tp{tp} does not split {m.name}'s {', '.join(bad)}"
  if a.num_layers % pa or (wl.trains_critic and (c.num_layers % pc or pa % pc)):
    return (f"training Pa/Pc={pa}/{pc} with {a.num_layers} actor and {c.num_layers} critic "
            "layers (Pa must divide the actor's layers, Pc the critic's and Pa)")
  if t % (tp * pa) or wl.minibatch % (t // (tp * pa)):
    return (f"training tp{tp} x Pa{pa} on {t} devices: the data-parallel size does not divide "
            f"the mini-batch of {wl.minibatch}")
  gtp, itp, ipp = gen["tp"], inf["tp"], inf.get("pp", 1)
  procs = n // host_devices if host_devices and n > host_devices else 1
  if g < n and g % procs:  # (trainer/async_ppo.split_devices: g / P devices of each process)
    return (f"a generation group of {g} devices on {procs} hosts of {host_devices} (each "
            "process gives an equal share of its devices)")
  if gen["mode"] == "instances":
    if g % gtp or a.num_heads % gtp or a.num_kv_heads % gtp:
      return (f"generation instances of tp{gtp} on {g} devices ({a.name}: {a.num_heads} heads, "
              f"{a.num_kv_heads} KV heads)")
    if itp != gtp:
      return (f"inference tp{itp} after instances of tp{gtp} (the trainer scores on the "
              "generation instances)")
    if gen["slots"] < -(-b // (g // gtp)):
      return f"{gen['slots']} slots per instance for a batch of {b} on {g // gtp} instances"
    # (asynchronous: the critic is not scored on the instances, trainer/loop.py stage_critic)
    models = ASYNC_GENERATION_FROZEN if split else ("reference", "critic", "reward")
    bad = list(dict.fromkeys(s.name for s in wl.frozen_models(models)[1] if s.num_layers % ipp))
    if (g // gtp) % ipp or bad:
      return (f"inference pipelines of pp{ipp} on {g // gtp} instances (pp must divide the "
              "instances and every frozen model's layers" +
              (f": not {', '.join(bad)}'s)" if bad else ")"))
    share = g // procs  # each process's generation devices
    if procs > 1 and share % gtp:  # (a tp16 instance on hosts of 8 read as a pipeline's error)
      return (f"generation instances of tp{gtp} on {share} generation devices a process "
              f"({procs} hosts of {host_devices}; an instance is one process's)")
    if procs > 1 and (share // gtp) % ipp:
      return (f"inference pipelines of pp{ipp} on {share} generation devices a process "
              f"({procs} hosts of {host_devices}; tp{gtp} instances and a pipeline's instances "
              "are one process's)")
    return None
  else:
    pp, groups = gen["pp"], gen["groups"]
    if procs > 1:  # (trainer/rollout.check_plan refuses plan.generation='pipeline' there)
      return (f"pipelined generation on {procs} hosts of {host_devices} (the trainer runs its "
              "generation pipeline and the inference mesh after it in one process)")
    if gtp != 1:
      return f"pipelined generation with tp{gtp} (the trainer's stages are one device each)"
    if pp != g:
      return (f"a generation pipeline of pp{pp} on {g} devices (the trainer runs one pipeline, "
              f"not {g // pp} replicas)")
    if a.num_layers % pp or groups < pp or b % groups:
      return (f"pipelined generation pp{pp}, G={groups} ({a.num_layers} layers, batch {b}: pp "
              "must divide the layers, G >= pp the batch)")
  if inf.get("pp", 1) != 1 or g % itp:
    return f"inference tp{itp} x pp{inf.get('pp', 1)} on {g} devices (pp must be 1)"
  return None


def _memory_refusal(cost: CostModel, wl, opt, plan: dict) -> Optional[str]:
  """Why the generation or inference of `plan` does not fit beside what the combination keeps
  on their devices (plan_memory: the training state of its training plan, which the stages'
  candidates are searched without, and with opt.trainer_runnable the rows the trainer scores at
  once, inference_rows: the inference candidates are checked at sim.inference_microbatch,
  before the generation plan that decides them is known), or None. The reason names the stage's
  layout, not the training plan's, so that search's `refused` counts the combinations of one
  stage plan together; it blames the state only where the stage fits without it. Where the
  trainer keeps asynchronous PPO's copy of the actor on the training devices
  (keeps_actor_copy), the training rows too (their candidates are searched without it), and a
  row that fits without the copy blames it. Until 2026-12-07 the copy was counted nowhere: on
  8 H100s a 13B/13B run with async_ppo.staleness=1 was given tp2 Pa/Pc=4/4, whose update needs
  73.6 GiB with it (61.5 without) of the 67.1 usable."""
  rows = plan_memory(cost, wl, opt, plan)
  # (the training candidates were searched beside the frozen weights sim.offload_frozen
  # keeps: not beside those the trainer's pipeline stage keeps on the training devices)
  on_training = async_copies.split_colocated(plan.get("async"))
  kept_anyway = keeps_frozen_on_mesh(opt, plan) and opt.offload_frozen and on_training
  checked = rows if keeps_actor_copy(wl, plan) or kept_anyway else [
      r for r in rows if r["stage"] in ("generation", "inference", *RESCORE_STAGES.values())]
  for row in checked:
    if row["total"] <= row["usable"]:
      continue
    what = f"{row['stage']} {row['layout']}"
    if row["stage"] == "inference" and opt.trainer_runnable:
      what += f" scoring the trainer's {inference_rows(wl, opt, plan)} samples at once"
    if row["stage"] in RESCORE_STAGES.values():
      return (f"{what} does not fit in memory (asynchronous PPO's pass on the training "
              "devices before the update, beside the training state)")
    copy = row["parts"].get(ACTOR_COPY, 0.0)
    if copy and row["total"] - copy <= row["usable"]:
      return (f"{what} does not fit in memory beside asynchronous PPO's copy of the actor (its "
              "weights over the training tp, kept on the training devices for the next "
              "batch's generation)")
    whole = row["parts"].get(GROUP_ACTOR, 0.0)
    if whole and row["total"] - whole <= row["usable"]:
      return (f"{what} does not fit in memory beside the whole actor the trainer keeps on every "
              "device of an asynchronous generation group (its data-only mesh)")
    frozen = row["parts"].get("frozen weights kept", 0.0)
    if kept_anyway and frozen and row["total"] - frozen <= row["usable"]:
      return (f"{what} does not fit in memory beside the frozen models the trainer's pipeline "
              "stage keeps on its inference mesh (rollout.PlannedStage, whatever "
              "sim.offload_frozen says)")
    state = row["parts"].get("training state kept", 0.0)
    if state and row["total"] - state <= row["usable"]:
      return (f"{what} does not fit in memory beside its training plan's state (both models' "
              "weights and AdamW state)")
    return f"{what} does not fit in memory"
  return None


def _runnable(cost: CostModel, wl, opt, plans, accept: Optional[Callable[[dict], Optional[str]]],
              top_k: int, refused: dict) -> list[dict]:
  """The first `top_k` of `plans` (an iterable of plan dicts, fastest first) that
  trainer_refusal (with opt.trainer_runnable), _memory_refusal and `accept` let through; the
  others counted in `refused` {reason: plans}."""
  out = []
  for plan in plans:
    why = (trainer_refusal(wl, plan, cost.hw.host_devices) if opt.trainer_runnable
           else None)
    if why is None:
      why = _memory_refusal(cost, wl, opt, plan)
    if why is None and accept is not None:
      why = accept(plan)
    if why is not None:
      refused[why] = refused.get(why, 0) + 1
      continue
    out.append(plan)
    if len(out) == top_k:
      break
  return out


def _async_plan(cost: CostModel, wl, g: int, staleness: int, gen: Candidate, inf: Candidate,
                train: Candidate, rescore: float) -> dict:
  """A disjoint split's plan: each group's layouts, predicted times and the split. Training
  includes `rescore` (rescore_s); only the actor moves to the generation group."""
  gp, ip = gen.plan, inf.plan
  reshard = reshard_s(cost, wl, gp.tp * gp.pp, receivers=g, senders=wl.num_devices - g)
  gen_s, inf_s, train_s = gen.info["gen_s"], inf.seconds, train.seconds + rescore
  n = wl.num_devices
  return {
      "generation": dataclasses.asdict(gp), "inference": dataclasses.asdict(ip),
      "training": train.plan,
      "predicted": {"reshard_s": reshard, "gen_s": gen_s, "inf_s": inf_s, "train_s": train_s,
                    "rescore_s": rescore,
                    "gen_plus_inf_s": gen_s + inf_s,
                    "iteration_s": async_iteration_s(gen_s + inf_s, train_s, reshard, False),
                    "serial_s": async_iteration_s(gen_s + inf_s, train_s, reshard, True),
                    "bound": "generation" if gen_s + inf_s >= train_s else "training"},
      "summary": f"async k={staleness}: gen {gp.describe()} and inference {ip.describe()} on "
                 f"{g} dev; training {_describe_train(train.plan)} on {n - g} dev",
      "async": {"generation_devices": g, "training_devices": n - g, "staleness": staleness,
                "colocated": False},
  }


class NoAsyncPlan(ValueError):
  """async_search's refusal where splits were tried and none fits (nor the colocated option),
  as opposed to a bad input (a staleness or split unit out of range, or one that leaves no
  split to try)."""


def async_search(cost: CostModel, wl, opt, staleness: int, sync_best: Optional[dict],
                 top_k: int = 5,
                 split_unit: int = 0, log: Optional[Callable[[str], None]] = None,
                 accept: Optional[Callable[[dict], Optional[str]]] = None) -> dict:
  """Asynchronous PPO's outer level (module docstring): every split of the devices into a
  generation and a training group, each group's stages searched on its own devices, and the
  colocated option (`sync_best`, the synchronous search's best plan, run serially; None where
  there is none: the splits alone, a ValueError naming each split's reason if none fits). Returns
  {best, top, splits, staleness, colocated_refused, search_s}: `best` and each of `top` a plan
  with an "async" object {generation_devices, training_devices, staleness, colocated}; `splits`
  one entry per g tried, its best iteration_s or why it was rejected; `colocated_refused` why
  the colocated option does not fit with asynchronous PPO's copy of the actor beside it
  (_memory_refusal, keeps_actor_copy), or None. With opt.trainer_runnable or `accept`
  (search's), a split's plan is its fastest generation x inference x training combination that
  both let through."""
  if not isinstance(staleness, (int, np.integer)) or staleness < 1:
    raise ValueError(f"async PPO: staleness={staleness!r} must be an integer >= 1")
  t0 = time.time()
  n = wl.num_devices
  prompts, resp = wl.sample_lengths()
  seq = (prompts + resp).astype(np.float64)
  mean_len = float(seq.mean())
  plans, splits, colocated_refused = [], [], None
  if sync_best is not None:
    # The synchronous plan run asynchronously: its instances score with the frozen models
    # alone (ASYNC_GENERATION_FROZEN: the trainer's async stage has no critic,
    # trainer/loop.py stage_critic) and its training group rescores the batch first
    # (rescore_s), as a split's does. Until 2026-12-07 it kept the synchronous time (the
    # critic's forwards on the instances, no rescore), which favoured it over the splits.
    colocated = {**sync_best,
                 "predicted": async_colocated_predicted(
                     cost, wl, opt, sync_best["predicted"], sync_best["inference"],
                     sync_best["training"]),
                 "async": {"generation_devices": n, "training_devices": n,
                           "staleness": staleness, "colocated": True}}
    # Asynchronous on all the devices, the trainer keeps a copy of the actor there beside the
    # synchronous plan's stages (keeps_actor_copy; sync_best was checked without it unless the
    # run is asynchronous already): the option only where that fits.
    colocated_refused = _memory_refusal(cost, wl, opt, colocated)
    if colocated_refused is None:
      plans.append(colocated)
    elif log:
      log(f"async plan search (k={staleness}): both groups colocated refused: "
          f"{colocated_refused}")
  restricted = opt.trainer_runnable or accept is not None
  tried = async_splits(cost, n, split_unit)
  said = t0  # a progress line every PROGRESS_S: thousands of devices take minutes
  for i, g in enumerate(tried):
    if log and time.time() - said >= PROGRESS_S:
      said = time.time()
      log(f"async plan search (k={staleness}): {i} of {len(tried)} splits tried, "
          f"{sum(1 for sp in splits if 'iteration_s' in sp)} fit ({said - t0:.0f}s)")
    rejected: dict = {}
    if opt.trainer_runnable and wl.global_batch % g:
      splits.append({"generation_devices": g, "training_devices": n - g,
                     "rejected": f"the trainer: the rollout batch of {wl.global_batch} does not "
                                 f"split over {g} generation devices"})
      continue
    # Training first: most training-group sizes fail the mini-batch's divisibility at once.
    trains = training_candidates(cost, dataclasses.replace(wl, num_devices=n - g), mean_len,
                                 rejected)
    # and whose rescoring passes fit beside their state (rescore_rows; until 2026-12-07 only
    # timed)
    fit = []
    for c in trains:
      why = rescore_refusal(cost, wl, opt, c.plan)
      if why:
        rejected[f"training {_describe_train(c.plan)}"] = why
      else:
        fit.append(c)
    trains = fit
    pairs, any_gen = [], False  # (generation, inference) candidates of the generation group
    if trains:
      wg = dataclasses.replace(wl, num_devices=g)
      infs = inference_candidates(cost, wg, opt, seq, rejected,
                                  ASYNC_GENERATION_FROZEN)
      # The frozen models live on the generation group only (beside its generation).
      groups, kept_at = beside_frozen(cost, wg, opt, infs, prompts, resp, mean_len, rejected,
                                      training=False)
      any_gen = any(gens for gens, _ in groups.values())
      pairs = [(gen, inf) for inf in infs for gen in groups[kept_at[inf.plan.tp]][0]]
    if not (trains and pairs):
      stage = "training" if not trains else "generation" if not any_gen else "inference"
      # Generation's rejections are keyed "gen ...": looked up as "generation" none was found
      # ("nothing fits"). The memory refusal nearest to fitting first, else the first reason.
      mine, closest = closest_rejection(rejected, "gen" if stage == "generation" else stage)
      why = mine[closest] if closest else next(iter(mine.values()), "nothing fits")
      splits.append({"generation_devices": g, "training_devices": n - g,
                     "rejected": f"no {stage} plan on {n - g if stage == 'training' else g} "
                                 f"devices: {why.split('; tried')[0][:300]}"})
      continue
    # Each training plan rescores on its own layout (rescore_s), so the pair is chosen together.
    scored = [(c, rescore_s(cost, wl, c.plan, seq, opt)) for c in trains]
    if restricted:
      refused: dict = {}
      found = _runnable(cost, wl, opt, sorted(
          (_async_plan(cost, wl, g, staleness, gen, inf, train, rescore)
           for (gen, inf), (train, rescore) in itertools.product(pairs, scored)),
          key=lambda p: p["predicted"]["iteration_s"]), accept, 1, refused)
      if not found:
        why = max(refused, key=refused.get) if refused else "nothing"
        splits.append({"generation_devices": g, "training_devices": n - g,
                       "rejected": f"no plan the trainer runs ({sum(refused.values())} refused, "
                                   f"most for: {why})"})
        continue
      best = found[0]
    else:
      train, rescore = min(scored, key=lambda c: c[0].seconds + c[1])
      best = min((_async_plan(cost, wl, g, staleness, gen, inf, train, rescore)
                  for gen, inf in pairs),
                 key=lambda p: p["predicted"]["iteration_s"])
    plans.append(best)
    splits.append({"generation_devices": g, "training_devices": n - g,
                   "iteration_s": best["predicted"]["iteration_s"],
                   "bound": best["predicted"]["bound"]})
  if not plans and not tried:  # (the error below ended on an empty list)
    raise ValueError(f"async plan search (k={staleness}): no split of {n} devices into two "
                     "groups to try: it takes at least 2 devices, and a sim.async_split_unit "
                     f"below {n}" + (f"; and both groups colocated: {colocated_refused}"
                                     if colocated_refused else ""))
  if not plans:
    raise NoAsyncPlan(f"async plan search (k={staleness}): no split of {n} devices fits: "
                      + "; ".join(f"{sp['generation_devices']} / {sp['training_devices']}: "
                                  f"{sp['rejected']}" for sp in splits[:6])
                      + (f"; and {len(splits) - 6} other splits" if len(splits) > 6 else "")
                      + (f"; both groups colocated: {colocated_refused}"
                         if colocated_refused else ""))
  top = sorted(plans, key=lambda p: p["predicted"]["iteration_s"])[:top_k]
  if log:
    a = top[0]["async"]
    fit = sum(1 for sp in splits if "iteration_s" in sp)
    log(f"async plan search (k={staleness}): {fit} of {len(splits)} splits fit; best "
        f"{top[0]['predicted']['iteration_s']:.3g}s with "
        + ("both groups colocated (no overlap)" if a["colocated"] else
           f"generation on {a['generation_devices']}, training on {a['training_devices']}")
        + f" ({time.time() - t0:.1f}s)")
  return {"best": top[0], "top": top, "splits": splits, "staleness": staleness,
          "colocated_refused": colocated_refused, "search_s": time.time() - t0}


_NEEDS = re.compile(r"needs ([0-9.]+) GiB per device")
# What else makes room for a stage's plans (no_plan_message).
_ROOM = {"inference": "a smaller config.sim.inference_microbatch (tp stops at 8 and the node)",
         "gen": "more devices (config.num_devices: fewer samples per instance)",
         "training": "more devices (config.num_devices) for more stages and tensor devices"}


def closest_rejection(rejected: dict, stage: str) -> tuple[dict, Optional[str]]:
  """({name: why} of the rejected plans of `stage` ('inference', 'gen', 'training',
  'uniform'), the name of the memory refusal nearest to fitting, or None: none was one)."""
  mine = {k: v for k, v in rejected.items() if k.split()[0] == stage}
  need = {k: float(m.group(1)) for k, v in mine.items() if (m := _NEEDS.search(v))}
  return mine, (min(need, key=need.get) if need else None)


_BESIDE = re.compile(r" beside [0-9.]+ GiB of frozen weights$")


def plan_name(rejection: str) -> str:
  """The plan a `rejected` key names, without where it was tried: beside_frozen tries each
  generation and training plan once per inference plan's share of frozen weights and keys its
  refusals "<plan> beside X GiB of frozen weights"."""
  return _BESIDE.sub("", rejection)


def distinct_stage_plans(groups: dict) -> int:
  """Generation and training plans that fit beside some inference plan's frozen weights
  (beside_frozen's groups), each counted once however many groups it fits in (an instance
  plan's slots may differ between groups: it is the same layout)."""
  gens = {(c.plan.mode, c.plan.tp, c.plan.pp, c.plan.groups)
          for g, _ in groups.values() for c in g}
  trains = {repr(sorted(c.plan.items())) for _, t in groups.values() for c in t}
  return len(gens) + len(trains)


def no_plan_message(cost: CostModel, wl, rejected: dict, infs: list, groups: dict,
                    kept_at: dict, log: Optional[Callable[[str], None]]) -> str:
  """search's refusal when no combination fits: the stages with no plan, each with its count of
  distinct rejected plans (plan_name: one tried beside each inference plan's frozen weights
  counts once; it counted once per inference degree) and the closest to fitting (the smallest
  per-device need), and what would make room. Each rejection goes to `log` (the error printed
  the whole dict on one line: 21 kB for a 14B pair on 4 GB devices)."""
  for name, why in rejected.items() if log else ():
    log(f"rejected {name}: {why}")
  if not infs:
    empty = ["inference"]
  else:
    gens, trains = groups[min(kept_at.values())]  # the inference plan that leaves most room
    empty = [stage for stage, got in (("gen", gens), ("training", trains)) if not got]
  names = {plan_name(k) for k in rejected}
  beside = (f", each beside the frozen weights of {len(groups)} inference plans"
            if len(groups) > 1 else "")
  parts, memory = [], False
  for stage in empty:
    mine, closest = closest_rejection(rejected, stage)
    memory = memory or closest is not None
    if closest:  # memory refusals: the nearest to fitting, and what else makes room
      why = f"; the closest: {closest}: {mine[closest]}; room: {_ROOM[stage]}"
    else:  # none tried for its memory (a tensor degree the heads refuse): each says why
      first = {}
      for k, v in mine.items():
        first.setdefault(plan_name(k), v)
      why = "".join(f"; {k}: {v}" for k, v in list(first.items())[:4])
    distinct = len({plan_name(k) for k in mine})
    parts.append(f"no {'generation' if stage == 'gen' else stage} plan fits ({distinct} "
                 f"rejected{beside if stage != 'inference' else ''}{why})")
  return (f"plan search: no feasible plan of "
          f"{train_lib.models_name(wl.actor, wl.trained_critic)} on {wl.num_devices} x "
          f"{cost.hw.name} ({cost.hw.hbm_bytes / 1e9:g} GB per device): "
          + "; ".join(parts) + "." + (
              " Each also fits with more memory per device (the hardware's hbm_bytes) or "
              "shorter prompts and responses (config.prompt.max_len, config.max_new_tokens)."
              if memory else "") + (
              " Every plan but a disjoint training uses all the devices, so fewer may "
              "divide the batch where these do not (config.num_devices)."
              if any("divisible" in str(v) for v in rejected.values()) else "") + (
              f" Each of the {len(names)} rejected plans and why: the 'rejected' lines above"
              + (f" ({len(rejected)}, one for each inference plan's frozen weights it was tried "
                 "beside)" if len(names) < len(rejected) else "") + "." if log else ""))


def search(cost: CostModel, wl, opt, top_k: int = 5,
           log: Optional[Callable[[str], None]] = None, staleness: int = 0,
           split_unit: int = 0,
           accept: Optional[Callable[[dict], Optional[str]]] = None) -> dict:
  """The hierarchical search (module docstring): {best, top, uniform, stages, rejected,
  refused, search_s, synchronous_search_s, evaluated, rejected_plans}. `best` and each of `top` hold
  generation / inference / training plans and their predicted stage times; `uniform` the best
  single layout; `evaluated` counts the distinct stage plans (and uniform layouts) that fit,
  `rejected` the others by name, with why (one key for each inference plan's frozen weights a
  plan was tried beside), `rejected_plans` the distinct plans among them (plan_name: it was
  len(rejected), and `evaluated` counted a plan once per frozen-weights group too). With
  `staleness` k >= 1 also "async": async_search's result (asynchronous PPO, devices split into a
  generation and a training group in multiples of `split_unit`); search_s then covers both
  searches, synchronous_search_s the first. Where no synchronous plan fits, a ValueError saying
  why; with `staleness`, the splits are searched alone first (best None, top [],
  synchronous_error the reason), the ValueError only if none of them fits either; where a
  synchronous plan fits and no split does, no "async" but "async_error", async_search's
  NoAsyncPlan (a bad staleness or split unit still raises, as one that leaves no split).
  The top plans are the fastest combinations that fit beside their training plan's state
  (_memory_refusal) and, with opt.trainer_runnable (trainer_refusal) or `accept` (a plan dict
  -> why a caller refuses it, or None), that both let through, synchronous and asynchronous;
  "refused" counts the other combinations tried by reason; with either, every generation
  plan's KV cache is sized as the trainer allocates it (trainer_workload)."""
  t0 = time.time()
  if opt.trainer_runnable or accept is not None:
    wl = trainer_workload(wl)
  prompts, resp = wl.sample_lengths()
  seq = (prompts + resp).astype(np.float64)
  mean_len = float(seq.mean())
  rejected: dict = {}
  say = log or (lambda m: None)
  infs = sorted(inference_candidates(cost, wl, opt, seq, rejected),
                key=lambda c: c.seconds)
  groups, kept_at = beside_frozen(cost, wl, opt, infs, prompts, resp, mean_len, rejected)
  gens, trains = groups[kept_at[infs[0].plan.tp]] if infs else next(iter(groups.values()))
  say(f"plan search: {len(infs)} inference plans; {len(gens)} generation plans, best "
      f"{gens[0].plan.describe() if gens else '-'}; {len(trains)} training plans"
      + (f" (beside inference tp{infs[0].plan.tp}'s frozen weights; "
         f"{len(groups)} inference degrees searched)" if len(groups) > 1 else "")
      + f" ({time.time() - t0:.1f}s)")
  unif = sorted(uniform_candidates(cost, wl, opt, prompts, resp, mean_len, rejected),
                key=lambda c: c.seconds)
  # Every combination of an inference plan with the generation and training plans that fit
  # beside its frozen weights.
  every = [(gen, inf, train) for inf in infs
           for gen, train in itertools.product(*groups[kept_at[inf.plan.tp]])]
  uniform = None
  if unif:
    u = unif[0]
    info = dict(u.info)
    uniform = {"layout": u.plan, "plans": info.pop("plans"),
               "predicted": {**info, "iteration_s": u.seconds}}
  refused: dict = {}

  def stages(gens: list, trains: list) -> dict:
    return {"generation": [(c.plan.describe(), c.seconds) for c in gens],
            "inference": [(c.plan.describe(), c.seconds) for c in infs],
            "training": [(_describe_train(c.plan), c.seconds) for c in trains],
            "uniform": [(f"tp{c.plan['tp']} pp{c.plan['pp']}", c.seconds) for c in unif]}

  def asynchronous_alone(message: str) -> dict:
    """No synchronous plan (every layout uses all the devices: at 24 of them no data-parallel
    size divides a mini-batch of 32): with staleness the splits may still fit, each group on
    its own devices, so they are searched alone; until 2026-12-06 the error came first. `best`
    and `top` are then None and [], `synchronous_error` the reason."""
    if not staleness:
      raise ValueError(message)
    say(f"{message}; searching the asynchronous splits alone (staleness {staleness})")
    try:
      a = async_search(cost, wl, opt, staleness, None, top_k, split_unit, log, accept)
    except ValueError as e:
      raise ValueError(f"{message}; and {e}") from None
    sync_s = time.time() - t0 - a["search_s"]
    return {"best": None, "top": [], "uniform": uniform, "stages": stages(gens, trains),
            "rejected": rejected, "refused": refused, "search_s": time.time() - t0,
            "synchronous_search_s": sync_s, "synchronous_error": message,
            "evaluated": len(infs) + len(unif) + distinct_stage_plans(groups),
            "rejected_plans": len({plan_name(k) for k in rejected}), "async": a}
  if not every:
    return asynchronous_alone(no_plan_message(cost, wl, rejected, infs, groups, kept_at, log))
  # Every generation and training plan: a pair of the same layout pays no resharding, so plans
  # outside their stage's top k may still make the best combination. The fastest that fit
  # beside the training plan's state (_memory_refusal) and, with opt.trainer_runnable or
  # `accept`, that the trainer runs.
  top = _runnable(cost, wl, opt, (_plan_dict(*c) for c in sorted(every, key=_combo_s)),
                  accept, top_k, refused)
  if not top:
    # each reason on its own, the most frequent first (a dict's repr on one line, before)
    whys = sorted(refused.items(), key=lambda x: -x[1])
    return asynchronous_alone(
        f"plan search: no plan of {train_lib.models_name(wl.actor, wl.trained_critic)} on "
        f"{wl.num_devices} "
        f"devices" + (" that the trainer runs" if opt.trainer_runnable or accept else "")
        + f" ({sum(refused.values())} combinations refused): "
        + "; ".join(f"{n} x {why}" for why, n in whys[:8])
        + (f"; and {len(whys) - 8} other reasons ({sum(n for _, n in whys[8:])} combinations)"
           if len(whys) > 8 else ""))
  # The stage lists shown: those beside the best plan's inference.
  gens, trains = groups[kept_at[top[0]["inference"]["tp"]]]
  sync_s = time.time() - t0
  # With staleness the asynchronous search follows and logs its own time: this one says whose.
  say(f"{'synchronous ' if staleness else ''}plan search done in {sync_s:.1f}s: best "
      f"{top[0]['predicted']['iteration_s']:.3g}s ({top[0]['summary']})"
      + (f"; uniform {uniform['predicted']['iteration_s']:.3g}s "
         f"(tp{u.plan['tp']} pp{u.plan['pp']})" if uniform else ""))
  out = {"best": top[0], "top": top, "uniform": uniform, "stages": stages(gens, trains),
         "rejected": rejected, "refused": refused, "search_s": sync_s,
         "synchronous_search_s": sync_s,
         "evaluated": len(infs) + len(unif) + distinct_stage_plans(groups),
         "rejected_plans": len({plan_name(k) for k in rejected})}
  if staleness:
    # No asynchronous plan beside a synchronous one leaves the synchronous one (as none of the
    # synchronous ones leaves the splits, asynchronous_alone). Until 2026-12-07 the search
    # failed: 65B/33B with sim.trainer_runnable since a generation group is charged the whole
    # actor (group_actor_bytes), where no group of 65B fits.
    try:
      out["async"] = async_search(cost, wl, opt, staleness, top[0], top_k, split_unit, log,
                                  accept)
    except NoAsyncPlan as e:
      out["async_error"] = str(e)
      say(f"{e}; the synchronous plan stands")
    out["search_s"] = time.time() - t0
  return out
