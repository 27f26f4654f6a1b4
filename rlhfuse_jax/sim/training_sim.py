"""Training-stage time: pipeline plans, 1F1B-serial and fused schedules via `rlhfuse_jax.pipeline`.

The actor and the critic train on the same mini-batches. On a plan (tp, Pa, Pc, dp), the N
devices form dp * tp pipelines of Pa devices (layout: tp innermost, then dp, then the pipeline
axis); the critic has Pc stages and R = Pa/Pc replicas along the pipeline axis (docs/architecture.md
§3). A mini-batch of `minibatch` samples splits over dp groups, then into micro-batches of
`micro_batch` samples: Ma = minibatch / (dp * micro_batch), Mc = Ma / R.

Per mini-batch: the pipeline makespan (schedule code of `rlhfuse_jax.pipeline`: the serial
order = actor 1F1B then critic 1F1B, or the fused schedule found by `pipeline.search`), then the
data-parallel gradient all-reduce of both models and the optimizer steps (not overlapped).
Stage durations come from the cost model (per micro-batch of mean tokens: the pipeline code has
one duration per task kind), in milliseconds inside the PipelineProblem. Memory (the states, the
activations each in-flight micro-batch keeps) is sized at `padded_len` tokens a sample, the
length the trainer allocates every row (Workload.padded_len: max prompt + max new tokens); until
2026-12-04 it was the mean length too, and a plan_search plan that fit here took 85.7 GB of 48
in plan_check's compile of its train_step. The times stay token-count based (the papers'
systems' work); our trainer computes the padded tokens too (its update's FLOPs are those of
[batch, max_prompt_len + max_new_tokens] rows: trainer/loop.py perf/train_useful_frac), so its
update takes up to padded_len / mean length longer than simulated here.

A run without a critic (a critic-free estimator: GRPO, RLOO, ...; Workload.trains_critic) trains
the actor alone: `critic` None in step_costs, check_train_memory and best_plan, its step the
actor's own 1F1B (StepCosts.actor_only_ms), with nothing to fuse, and no critic state, gradient
all-reduce or optimizer step (until 2026-12-08 such a run was timed and sized as PPO's).

`ScheduleCache` keeps fused searches per problem (in memory and optionally in a JSON file), so a
grid of settings searches each distinct shape once. `zero3_train_s` is the DeepSpeed-Chat-like
alternative: no pipeline, ZeRO-3 data parallel over all devices.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Optional

import numpy as np

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.pipeline import schedules
from rlhfuse_jax.pipeline.bounds import (pipeline_1f1b_makespan, serial_makespan_formula,
                                         tight_lower_bound)
from rlhfuse_jax.pipeline.evaluate import evaluate
from rlhfuse_jax.pipeline.graph import PipelineProblem
from rlhfuse_jax.pipeline.search import SearchConfig, search
from rlhfuse_jax.sim.cost_model import GIB, CostModel, crossing_share
from rlhfuse_jax.sim.shapes import ModelShape

MS = 1e3  # PipelineProblem times are in milliseconds


def accumulates(pp: int, microbatches: int) -> bool:
  """Whether the trainer's update of a model on `pp` stages keeps float32 sums of its
  gradients: unpipelined (pp 1) over several micro-batches a data shard (algo.microbatch_size
  below the rows per shard: trainer/ppo._accumulated); the pipelined executor's sums are not
  counted (nor in plan_check's analytic figures). TrainPlan.accumulates, single_model_plan and
  plan_search.plan_memory's disjoint plans ask this one rule."""
  return pp == 1 and microbatches > 1


@dataclasses.dataclass(frozen=True)
class TrainPlan:
  """A training layout on `num_devices` devices (see module docstring)."""
  num_devices: int
  minibatch: int
  tp: int
  actor_pp: int
  critic_pp: int
  micro_batch: int = 1  # samples per micro-batch

  def __post_init__(self):
    n, tp, pa, pc = self.num_devices, self.tp, self.actor_pp, self.critic_pp
    for f in ("num_devices", "minibatch", "tp", "actor_pp", "critic_pp", "micro_batch"):
      if getattr(self, f) < 1:
        raise ValueError(f"train plan: {f}={getattr(self, f)} must be >= 1")
    if n % (tp * pa):
      raise ValueError(f"train plan: num_devices={n} must be divisible by tp*actor_pp="
                       f"{tp}*{pa}")
    if pa % pc:
      raise ValueError(f"train plan: actor_pp={pa} must be divisible by critic_pp={pc}")
    if self.minibatch % (self.dp * self.micro_batch):
      raise ValueError(f"train plan: minibatch={self.minibatch} must be divisible by "
                       f"dp*micro_batch={self.dp}*{self.micro_batch} (dp = num_devices/(tp*"
                       f"actor_pp) = {self.dp})")
    if self.actor_microbatches % self.critic_replicas:
      raise ValueError(f"train plan: actor micro-batches {self.actor_microbatches} must be "
                       f"divisible by critic replicas actor_pp/critic_pp={self.critic_replicas}")

  @property
  def dp(self) -> int:
    return self.num_devices // (self.tp * self.actor_pp)

  @property
  def critic_replicas(self) -> int:
    return self.actor_pp // self.critic_pp

  @property
  def actor_microbatches(self) -> int:
    return self.minibatch // (self.dp * self.micro_batch)

  @property
  def critic_microbatches(self) -> int:
    return self.actor_microbatches // self.critic_replicas

  @property
  def accumulates(self) -> bool:
    """Whether the trainer's update of this plan keeps float32 sums of the gradients
    (accumulates)."""
    return accumulates(self.actor_pp, self.actor_microbatches)

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self), "dp": self.dp, "Ma": self.actor_microbatches,
            "Mc": self.critic_microbatches}


MB = 1e6  # the pipeline problems' memory unit (bytes per MB)


def stash_bytes(shape: ModelShape, stages: int, tp: int, mb_tokens: float) -> float:
  """Activation bytes one device keeps per in-flight micro-batch of its stage, from the model's
  shape: with full recomputation each layer keeps only its input, 2 s b h bytes in 16-bit
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Table 2; act_itemsize s b h at the shape's compute dtype, 4 for a float32 run's), split
  over the tensor devices by sequence parallelism; times the stage's layers.
  This models the papers' Megatron-style systems; our executor keeps only each stage's input
  (whole on every tensor device) and recomputes the stage (pipeline/executor.py)."""
  return (shape.act_itemsize * mb_tokens * shape.hidden_size * (shape.num_layers / stages)
          / tp)


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """Per-mini-batch costs of a plan (seconds) and its pipeline problem (milliseconds); for the
  actor alone (no critic) no problem, its 1F1B makespan `actor_only_ms` instead."""
  problem: Optional[PipelineProblem]
  grad_sync_s: float
  optimizer_s: float
  actor_only_ms: Optional[float] = None


def stage_hop_s(cost: CostModel, nbytes: float, stride: int, stages: int,
                first: int = 0) -> float:
  """Mean seconds of one hop of `nbytes` between pipeline neighbours `stride` devices apart
  (tp x dp: the layout of every training plan here), the chain starting at device `first`; a
  hop inside a node runs at NVLink speed (crossing_share). 0 without a pipeline."""
  if stages <= 1:
    return 0.0
  return cost.hop_s(nbytes, crossing_share(stride, stages - 1, cost.hw.devices_per_node, first))


def memory_len(mean_seq_len: float, padded_len: Optional[float]) -> float:
  """Tokens a sample's activations are sized at: `padded_len` (module docstring), or the mean
  length where a caller gives none (samples all of one length)."""
  if padded_len is None:
    return mean_seq_len
  if padded_len < mean_seq_len:
    raise ValueError(f"training: padded_len={padded_len} (max prompt + max new tokens) is below "
                     f"the mean sample length {mean_seq_len:g}; expected >= it")
  return padded_len


def step_costs(cost: CostModel, actor: ModelShape, critic: Optional[ModelShape],
               plan: TrainPlan, mean_seq_len: float, check_memory: bool = True,
               resident_bytes: float = 0.0, padded_len: Optional[float] = None,
               head_positions: float = 0.0) -> StepCosts:
  """Stage durations (at `mean_seq_len` tokens a sample), transfer latency and the per-step
  extras of a plan; its memory at `padded_len` tokens a sample (memory_len; `resident_bytes`,
  `head_positions`: check_train_memory's). `critic` None: the actor alone (module docstring;
  the plan's critic_pp is not read)."""
  mb_tokens = plan.micro_batch * mean_seq_len
  mem_tokens = plan.micro_batch * memory_len(mean_seq_len, padded_len)
  ctx = (mean_seq_len + 1) / 2.0
  fa = float(cost.train_stage_fwd_s(actor, plan.tp, plan.actor_pp, mb_tokens, ctx, "actor"))
  ba = cost.train_stage_bwd_s(fa, "actor", cost.train_stage_comm_s(
      actor, plan.tp, plan.actor_pp, mb_tokens))
  trained = (actor,) if critic is None else (actor, critic)
  act_bytes = mb_tokens * max(s.hidden_size * s.act_itemsize for s in trained) / plan.tp
  lat = stage_hop_s(cost, act_bytes, plan.tp * plan.dp, plan.actor_pp)
  if critic is None:
    if check_memory:
      check_train_memory(cost, actor, None, plan, mem_tokens, resident_bytes, head_positions)
    return StepCosts(
        problem=None, grad_sync_s=float(cost.grad_sync_s(actor, plan.tp, plan.actor_pp, plan.dp)),
        optimizer_s=float(cost.optimizer_step_s(actor, plan.tp * plan.actor_pp * plan.dp)),
        actor_only_ms=one_f_one_b_s(plan.actor_pp, plan.actor_microbatches, fa, ba, lat) * MS)
  fc = float(cost.train_stage_fwd_s(critic, plan.tp, plan.critic_pp, mb_tokens, ctx, "critic"))
  bc = cost.train_stage_bwd_s(fc, "critic", cost.train_stage_comm_s(
      critic, plan.tp, plan.critic_pp, mb_tokens))
  problem = PipelineProblem(
      actor_pp=plan.actor_pp, critic_pp=plan.critic_pp,
      actor_microbatches=plan.actor_microbatches, critic_microbatches=plan.critic_microbatches,
      actor_fwd=round(fa * MS, 6), critic_fwd=round(fc * MS, 6),
      actor_bwd=round(ba * MS, 6), critic_bwd=round(bc * MS, 6),
      actor_mem=round(stash_bytes(actor, plan.actor_pp, plan.tp, mem_tokens) / MB, 6),
      critic_mem=round(stash_bytes(critic, plan.critic_pp, plan.tp, mem_tokens) / MB, 6),
      transfer_latency=round(lat * MS, 6))
  if check_memory:
    check_train_memory(cost, actor, critic, plan, mem_tokens, resident_bytes, head_positions)
  sync = cost.grad_sync_s(actor, plan.tp, plan.actor_pp, plan.dp) + critic_grad_sync_s(
      cost, critic, plan)
  opt = (cost.optimizer_step_s(actor, plan.tp * plan.actor_pp * plan.dp) +
         cost.optimizer_step_s(critic, plan.tp * plan.critic_pp * plan.dp * plan.critic_replicas))
  return StepCosts(problem=problem, grad_sync_s=float(sync), optimizer_s=float(opt))


def critic_grad_sync_s(cost: CostModel, critic: ModelShape, plan: TrainPlan) -> float:
  """The critic's data-parallel gradient all-reduce: dp ranks tp apart in each of its R
  replicas, the replicas Pc * tp * dp devices apart along the pipeline axis (module docstring),
  so the group spans nodes wherever its replicas do. (As grad_sync_s over dp * R ranks tp apart
  it was priced inside one node whenever tp * dp * R fits one: tp 4, dp 1, Pa 4, Pc 2 on 16
  H100s put the replicas on devices 0 and 8, two nodes, at NVLink's bandwidth, 9x short.)"""
  if plan.critic_replicas == 1:
    return cost.grad_sync_s(critic, plan.tp, plan.critic_pp, plan.dp)
  members = [r * plan.critic_pp * plan.tp * plan.dp + d * plan.tp
             for r in range(plan.critic_replicas) for d in range(plan.dp)]
  return cost.group_collective_s("all-reduce",
                                 critic.weight_bytes() / (plan.tp * plan.critic_pp), members)


def check_train_memory(cost: CostModel, actor: ModelShape, critic: Optional[ModelShape],
                       plan: TrainPlan, mb_tokens: float, resident_bytes: float = 0.0,
                       head_positions: float = 0.0) -> None:
  """Both models' states and their 1F1B activation peaks on the busiest device (stage 0 of
  each; `mb_tokens`: a micro-batch's tokens as the trainer allocates them; the actor's head
  logits at `head_positions` positions a row, the response's: cost_model.train_memory_parts)
  must fit, beside `resident_bytes` per device that other stages keep there (the frozen
  models' weights with sim.offload_frozen=False: frozen_note); the fused schedule's budget is
  the sum of the two models' (docs/architecture.md §3). `critic` None: the actor's alone."""
  ma, mc = plan.actor_microbatches, plan.critic_microbatches
  need = (cost.train_memory_bytes(actor, plan.tp, plan.actor_pp, plan.dp, True, mb_tokens,
                                  min(plan.actor_pp, ma), plan.accumulates, plan.micro_batch,
                                  head_positions) + resident_bytes)
  if critic is not None:
    need += cost.train_memory_bytes(critic, plan.tp, plan.critic_pp,
                                    plan.dp * plan.critic_replicas, True, mb_tokens,
                                    min(plan.critic_pp, mc), plan.accumulates)
  cost.check_fits(f"training {models_name(actor, critic)}", need,
                  f"plan tp={plan.tp} actor_pp={plan.actor_pp}" +
                  (f" critic_pp={plan.critic_pp}" if critic is not None else "") +
                  f" dp={plan.dp}{frozen_note(resident_bytes)}; use more pipeline stages or "
                  "tensor parallelism")


def models_name(actor: ModelShape, critic: Optional[ModelShape]) -> str:
  """'actor + critic' by name, or the actor's name alone where no critic is trained."""
  return actor.name if critic is None else f"{actor.name} + {critic.name}"


def frozen_note(resident_bytes: float) -> str:
  """The part of a memory refusal that names what other stages keep on the devices."""
  if not resident_bytes:
    return ""
  return (f", beside {resident_bytes / GIB:.1f} GiB of frozen models' weights kept on the "
          "devices (sim.offload_frozen=False)")


def serial_makespan_ms(problem: PipelineProblem) -> float:
  """Actor 1F1B then critic 1F1B, timed by the pipeline evaluator (with transfer latency)."""
  ev = evaluate(problem, schedules.serial_order(problem), schedules.serial_release(problem))
  return ev.makespan


class ScheduleCache:
  """Fused-schedule searches keyed by problem; optionally persisted as JSON."""

  def __init__(self, path: str = "", time_budget_s: float = 2.0, seed: int = 0,
               log: Optional[Callable[[str], None]] = None,
               max_evaluations: Optional[int] = None):
    """max_evaluations: count-based searches (deterministic per seed, the same on any machine)
    instead of time_budget_s seconds each."""
    self.path, self.log = path, log
    self.search_config = SearchConfig(time_budget_s=time_budget_s, seed=seed,
                                      max_evaluations=max_evaluations)
    self.entries: dict = {}
    if path and os.path.exists(path):
      try:
        self.entries = wd.read_json_object(path)
      except ValueError as e:  # a cache: searched again (a bare JSONDecodeError before)
        if log:
          log(f"schedule cache {path} is unreadable ({e}): its searches run again, and it is "
              "rewritten")

  def key(self, problem: PipelineProblem) -> str:
    """The problem and the search that solves it (as trainer/pipelined.py keys its cache): a
    persisted cache reused under another budget or seed searches again instead of reporting the
    old result under the new settings."""
    return json.dumps({"problem": problem.to_dict(),
                       "search": dataclasses.asdict(self.search_config)}, sort_keys=True)

  def fused(self, problem: PipelineProblem) -> dict:
    """{'makespan', 'serial', 'greedy', 'lower_bound', 'peak_max', 'search_s', 'order'}."""
    k = self.key(problem)
    if k in self.entries:
      return self.entries[k]
    res = search(problem, self.search_config)
    ev = evaluate(problem, res.best)
    greedy = evaluate(problem, schedules.greedy_order(problem))
    entry = {"makespan": ev.makespan, "serial": serial_makespan_ms(problem),
             "greedy": greedy.makespan, "lower_bound": tight_lower_bound(problem),
             "serial_formula": serial_makespan_formula(problem),
             "peak_max": float(np.max(ev.peaks)), "budget_max": float(np.max(ev.budget)),
             "search_s": res.search_s, "evaluations": res.evaluations,
             "order": res.best.astype(int).tolist()}
    if self.log:
      self.log(f"fused schedule Pa/Pc={problem.actor_pp}/{problem.critic_pp} "
               f"Ma/Mc={problem.actor_microbatches}/{problem.critic_microbatches}: "
               f"{entry['makespan']:.1f} ms (serial {entry['serial']:.1f}, LB "
               f"{entry['lower_bound']:.1f}) in {res.search_s:.1f}s")
    self.entries[k] = entry
    if self.path:
      from rlhfuse_jax import workdir as wd
      wd.write_json(self.path, self.entries)
    return entry


def pipeline_train_s(costs: StepCosts, num_minibatches: int, fused: bool,
                     cache: Optional[ScheduleCache] = None) -> dict:
  """Training time of all mini-batches with the serial or the fused schedule (the actor alone:
  its 1F1B, whichever is asked: there is nothing to fuse it with)."""
  if costs.problem is None:
    entry, fused = None, False
    makespan_ms = costs.actor_only_ms
  elif fused:
    if cache is None:
      raise ValueError("fused training needs a ScheduleCache")
    entry = cache.fused(costs.problem)
    makespan_ms = entry["makespan"]
  else:
    entry = None
    makespan_ms = serial_makespan_ms(costs.problem)
  step = makespan_ms / MS + costs.grad_sync_s + costs.optimizer_s
  return {"train_s": num_minibatches * step, "step_s": step, "pipeline_ms": makespan_ms,
          "grad_sync_s": costs.grad_sync_s, "optimizer_s": costs.optimizer_s,
          "schedule": ("fused" if fused else "serial_1f1b" if costs.problem is not None else
                       "actor_1f1b"), "search": entry}


def best_plan(cost: CostModel, actor: ModelShape, critic: Optional[ModelShape], num_devices: int,
              minibatch: int, micro_batch: int, mean_seq_len: float, num_minibatches: int,
              tps=(1, 2, 4, 8), pps=(1, 2, 4, 8, 16),
              resident_bytes: float = 0.0,
              padded_len: Optional[float] = None,
              head_positions: float = 0.0) -> tuple[TrainPlan, dict]:
  """The plan with the smallest serial (1F1B) training time among those that fit in memory
  (at `padded_len` tokens a sample, beside `resident_bytes` per device: step_costs). Returns
  (plan, {candidate description: train_s or the reason it was rejected}): "tp2/pa4/pc2", or
  with `critic` None (the actor alone) "tp2/pa4", its plan's critic_pp = actor_pp (unread)."""
  tried, best, best_t = {}, None, float("inf")
  for tp in tps:
    if tp > cost.hw.devices_per_node:
      continue
    for pa in pps:
      for pc in pps if critic is not None else (pa,):
        # A stage holds whole layers (Megatron-LM, and our executor, need pp | layers).
        if pc > pa or actor.num_layers % pa or (critic is not None and critic.num_layers % pc):
          continue
        name = f"tp{tp}/pa{pa}" + (f"/pc{pc}" if critic is not None else "")
        split = actor.tensor_parallel_error(tp) or (
            critic is not None and critic.tensor_parallel_error(tp))
        if split:
          tried[name] = split
          continue
        try:
          plan = TrainPlan(num_devices, minibatch, tp, pa, pc, micro_batch)
          costs = step_costs(cost, actor, critic, plan, mean_seq_len,
                             resident_bytes=resident_bytes, padded_len=padded_len,
                             head_positions=head_positions)
        except ValueError as e:
          tried[name] = str(e)
          continue
        t = pipeline_train_s(costs, num_minibatches, fused=False)["train_s"]
        tried[name] = t
        if t < best_t:
          best, best_t = plan, t
  if best is None:
    raise NoTrainingPlan(f"no training plan fits: {models_name(actor, critic)} on "
                         f"{num_devices} x {cost.hw.name}, minibatch={minibatch}; tried {tried}",
                         tried)
  return best, tried


class NoTrainingPlan(ValueError):
  """best_plan found no plan that fits; `tried` holds each candidate's reason (plan_search
  lists them one by one rather than as one string)."""

  def __init__(self, message: str, tried: dict):
    super().__init__(message)
    self.tried = tried


def one_f_one_b_s(stages: int, microbatches: int, fwd_s: float, bwd_s: float,
                  latency_s: float) -> float:
  """Makespan of one model's 1F1B (seconds) with `latency_s` per hop between stages, timed by
  the pipeline evaluator as serial_makespan_ms times the colocated plans. Latency is exposed on
  every round trip of the steady state, not only on the first forward and the last backward:
  (P+M-1)(f+b) + 2(P-1) latency is exact only for M <= P (P=2, M=4, f=1, b=2, latency 0.5: 17,
  not 16), and it priced disjoint training below the colocated plans it is compared with."""
  if stages == 1 or latency_s == 0:
    return pipeline_1f1b_makespan(stages, microbatches, fwd_s, bwd_s)
  p = PipelineProblem(stages, stages, microbatches, microbatches, fwd_s * MS, fwd_s * MS,
                      actor_bwd=bwd_s * MS, critic_bwd=bwd_s * MS, transfer_latency=latency_s * MS)
  return schedules.model_makespan(p, "actor") / MS


def single_model_plan(cost: CostModel, shape: ModelShape, n: int, minibatch: int,
                      micro_batch: int, mean_len: float, resident_bytes: float = 0.0,
                      first: int = 0,
                      padded_len: Optional[float] = None,
                      head_positions: float = 0.0,
                      idle: bool = False) -> Optional[tuple[float, dict]]:
  """(1F1B step seconds, plan) of one model alone on n devices (tp x pp x dp) numbered from
  `first`, the fastest that fits (at `padded_len` tokens a sample: step_costs) beside
  `resident_bytes` per device, or None if nothing fits (ReaLHF-like disjoint training;
  plan_search). With `idle`, each (tp, pp) also takes a smaller dp that divides the mini-batch,
  the model then on the first tp x pp x dp of the n devices (the plan's "devices") and the
  others idle, where that is strictly faster or the only fit: a gradient all-reduce can cost
  more than the shorter pipeline it buys (13B alone on 24 H100s, mini-batch 6 of 67 tokens:
  tp2 pp4 dp3 takes 42.6 ms a step, 12.1 of them the all-reduce; tp4 pp4 dp1 on 16 of them
  36.4 ms), and a device count with a factor the mini-batch lacks has no plan on all of its
  devices (12, mini-batch 16)."""
  mem_len = memory_len(mean_len, padded_len)
  best = None
  # The calibration's measured stage times are per model (a scalar head: the critic's); the
  # critic alone was timed with the actor's measured forward and neither measured backward.
  model = "critic" if shape.head == "scalar" else "actor"
  for tp, pp, dp in _single_model_layouts(shape, n, minibatch, micro_batch,
                                          cost.hw.devices_per_node, idle):
    m = minibatch // (dp * micro_batch)
    mb_tokens = micro_batch * mean_len
    need = cost.train_memory_bytes(shape, tp, pp, dp, True, micro_batch * mem_len,
                                   min(pp, m), accumulates(pp, m), micro_batch,
                                   head_positions)
    if need + resident_bytes > cost.usable_bytes:
      continue
    f = float(cost.train_stage_fwd_s(shape, tp, pp, mb_tokens, (mean_len + 1) / 2, model))
    b = cost.train_stage_bwd_s(f, model, cost.train_stage_comm_s(shape, tp, pp, mb_tokens))
    opt = cost.optimizer_step_s(shape, tp * pp * dp)
    # No faster than its 1F1B without latency or all-reduce: such a layout is not timed (the
    # evaluator's 1F1B below), which keeps `idle`'s smaller dps, M times the work, cheap.
    if best is not None and pipeline_1f1b_makespan(pp, m, f, b) + opt >= best[0]:
      continue
    lat = stage_hop_s(cost, mb_tokens * shape.hidden_size * shape.act_itemsize / tp, tp * dp,
                      pp, first)
    step = one_f_one_b_s(pp, m, f, b, lat) + cost.grad_sync_s(shape, tp, pp, dp) + opt
    if best is None or step < best[0]:
      best = (step, {"devices": tp * pp * dp, "tp": tp, "pp": pp, "dp": dp, "M": m})
  return best


def _single_model_layouts(shape: ModelShape, n: int, minibatch: int, micro_batch: int,
                          devices_per_node: int, idle: bool):
  """(tp, pp, dp) of single_model_plan's candidates on n devices: tp inside a node and
  dividing the heads, pp dividing the layers, dp dividing the mini-batch into micro-batches;
  dp = n / (tp x pp), then with `idle` every smaller such dp (after all the former, so that the
  best of those prunes them, and a tie keeps every device busy)."""
  grid = [(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8, 16)
          if tp <= devices_per_node and not shape.tensor_parallel_error(tp)
          and not shape.num_layers % pp]
  for tp, pp in grid:
    dp = n // (tp * pp)
    if not n % (tp * pp) and minibatch % (dp * micro_batch) == 0:
      yield tp, pp, dp
  for tp, pp in grid if idle else ():
    top = n // (tp * pp) - (not n % (tp * pp))  # (n / (tp x pp) itself came above)
    for dp in range(top, 0, -1):
      if minibatch % (dp * micro_batch) == 0:
        yield tp, pp, dp


def disjoint_splits(cost: CostModel, actor: ModelShape, critic: ModelShape, n: int,
                    minibatch: int, micro_batch: int, mean_len: float,
                    fractions=(0.25, 0.5, 0.75), resident_bytes: float = 0.0,
                    padded_len: Optional[float] = None,
                    head_positions: float = 0.0,
                    idle: bool = False) -> list[tuple[float, dict]]:
  """Actor and critic trained at once on disjoint device groups (the actor on each fraction of
  the n devices, the critic on the rest): [(step seconds, {"actor": plan, "critic": plan})]
  for the splits where both fit (at `padded_len` tokens a sample, beside `resident_bytes` per
  device); a step lasts as long as the slower model's. `idle`: single_model_plan's, each
  model may leave some of its group idle."""
  out = []
  for frac in fractions:
    na = int(n * frac)
    if not 0 < na < n:  # too few devices to give each model some
      continue
    a = single_model_plan(cost, actor, na, minibatch, micro_batch, mean_len, resident_bytes,
                          padded_len=padded_len, head_positions=head_positions, idle=idle)
    c = single_model_plan(cost, critic, n - na, minibatch, micro_batch, mean_len,
                          resident_bytes, first=na, padded_len=padded_len,
                          head_positions=head_positions, idle=idle)
    if a and c:
      out.append((max(a[0], c[0]), {"actor": a[1], "critic": c[1]}))
  return out


def zero3_train_s(cost: CostModel, shape: ModelShape, num_devices: int, tokens: float,
                  mean_seq_len: float) -> float:
  """One model's step on `tokens` tokens with ZeRO-3 data parallelism over all devices: the
  parameters are all-gathered for the forward and for the backward and the gradients
  reduce-scattered (3 x the bf16 parameter bytes through every device's link), overlapped with
  compute (prefetching), so the step takes the larger of the two, plus the optimizer step."""
  flops = 3.0 * shape.forward_flops(tokens, (mean_seq_len + 1) / 2.0)
  compute = flops / (num_devices * cost.hw.peak_flops * cost.eff.train_mfu)
  comm = 3.0 * cost.allgather_s(shape.weight_bytes(), num_devices)
  return float(max(compute, comm) + cost.optimizer_step_s(shape, num_devices))


def check_zero3_memory(cost: CostModel, shapes, num_devices: int, tokens_per_device: float):
  """ZeRO-3: 16 bytes/param sharded over all devices for each trained model, plus activations
  of the device's tokens and one gathered layer."""
  need = 0.0
  for s in shapes:
    need += 16.0 * s.num_params() / num_devices
    need += cost.activation_bytes(s, 1, tokens_per_device, s.num_layers)
    # The gathered layer: its bf16 weights whole (the largest gather outside the embedding,
    # which is gathered and used alone at the start and end).
    need += 2.0 * (s.num_params() - s.vocab_size * s.hidden_size) / s.num_layers
  cost.check_fits("ZeRO-3 training", need, f"{num_devices} devices")
