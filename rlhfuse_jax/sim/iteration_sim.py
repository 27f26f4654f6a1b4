"""One RLHF iteration (weight resharding, generation, inference, training) for nine systems.

All systems run the same workload: the same prompts and response lengths (drawn once per
setting from the length distributions with the workload seed), the same models, the same
cluster and the same cost model. They differ only in what the papers say they do:

  deepspeed_chat_like  colocated: generation with the smallest tensor-parallel degree that fits
                       (DeepSpeed-Chat's hybrid engine, inference_tp_size), no consolidation;
                       reference/reward/critic inference and actor/critic training with ZeRO-3
                       data parallelism over all devices (no pipeline).
  realhf_like          a parallel plan per stage (ReaLHF): generation tp chosen by simulation;
                       training either colocated (actor then critic, 1F1B) or actor and critic
                       concurrently on disjoint device groups, whichever the cost model prefers;
                       no fusion.
  rlhfuse_base         stages in series: generation (tp chosen by simulation), then inference on
                       the same instances, then training with the best colocated pipeline plan,
                       actor 1F1B followed by critic 1F1B (RLHFuse-Base).
  inter_stage          rlhfuse_base + long-tail consolidation and streaming inference on the
                       freed instances (generation_sim with the shared consolidation policy).
  intra_stage          rlhfuse_base + the fused actor/critic pipeline schedule (pipeline.search
                       on the same plan).
  rlhfuse              both fusions.
  pipe_rlhf            Pipe-RLHF: a plan per stage from the hierarchical plan search
                       (sim/plan_search.py): generation on instances or as a delayed inter-batch
                       pipeline, inference on its own layout, training colocated or disjoint.
  rlhfuse_planned      the searched plan with both fusions where they are faster than the
                       plan's stage (inter-stage fusion on instances, the fused schedule on the
                       best colocated pipeline).
  pipe_rlhf_async      Pipe-RLHF with asynchronous PPO (SimOptions.staleness k >= 1): the best
                       of pipe_rlhf's plan run asynchronously on all the devices (no critic on
                       the instances, the rescore on the training layout: it can be slower
                       than pipe_rlhf, by the rescore's forwards less the critic's) and every
                       split of the devices into a generation group (generation + inference
                       of the batch k iterations ahead) and a training group working at once
                       (plan_search.async_search). A row of its own, not folded into
                       pipe_rlhf: it trains on samples of a policy k updates old, which no
                       other row does.

The other systems are synchronous (on-policy). rlhfuse_planned stays so: both fusions would fit
inside the groups (consolidation and streamed inference on the generation group's instances, the
fused schedule on the training group's pipeline), but every split that fits would need its own
fused generation (an Rt chosen by simulation) and fused-schedule searches (seconds each), the
split best without the fusions need not be best with them, and RLHFuse itself is synchronous.

iteration_s = reshard_s + gen_plus_inf_s + train_s (stages do not overlap across iterations),
except pipe_rlhf_async on disjoint groups: max(gen_plus_inf_s, train_s) + reshard_s;
gen_s = when the last sample finished; inf_s = gen_plus_inf_s - gen_s (inference not hidden
behind generation); samples_per_s = global_batch / iteration_s.
reshard_s: the actor's new weights into the generation layout, one copy a node over the
scale-out network through the node's NICs, then over NVLink (plan_search.reshard_s); under
pipe_rlhf_async too, the actor's only (the generation group scores with the frozen reference and
reward model; the critic's values are computed on the training group, plan_search.rescore_s).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from rlhfuse_jax.sim import generation_sim as gen_lib
from rlhfuse_jax.sim import plan_search as plan_lib
from rlhfuse_jax.sim import training_sim as train_lib
from rlhfuse_jax.sim.cost_model import GIB, LOGITS_COPIES_SCORING, CostModel
from rlhfuse_jax.sim.lengths import LengthSpec
from rlhfuse_jax.sim.shapes import ModelShape, heaviest_stage_weight_bytes, stage_shape

SYSTEMS = ("deepspeed_chat_like", "realhf_like", "rlhfuse_base", "inter_stage", "intra_stage",
           "rlhfuse", "pipe_rlhf", "rlhfuse_planned", "pipe_rlhf_async")
_INTER = {"inter_stage", "rlhfuse"}
_INTRA = {"intra_stage", "rlhfuse"}


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one iteration processes, on which models and how many devices."""
  actor: ModelShape
  critic: ModelShape  # scalar head; the reward model has its shape unless `reward` is set
  num_devices: int = 256
  global_batch: int = 512
  minibatch: int = 64
  epochs: int = 1
  micro_batch: int = 1
  max_new_tokens: int = 1024
  prompt: LengthSpec = LengthSpec(kind="lognormal", median=256, sigma=0.5, min_len=16,
                                  max_len=1024)
  response: LengthSpec = LengthSpec(kind="lognormal", median=256, sigma=0.8)
  seed: int = 0
  # The trainer's generation (generation/instances.Generator, pipelined.PipelinedGenerator)
  # allocates every KV slot at data.max_prompt_len + rollout.max_new_tokens: kv_slot_len.
  # plan_search sets it for the plans the trainer runs (sim.trainer_runnable, a train_config
  # search); the papers' systems size it at the longest sampled prompt (paged KV caches).
  kv_at_max_prompt: bool = False
  # Whether the run scores with a frozen reference model: a train_ppo config with
  # algo.kl_coef=0 builds and runs none (AlgoConfig.uses_reference; trainer/sim_plan.workload).
  # plan_search drops its weights and forwards then (Workload.frozen_models); the papers'
  # systems always run one.
  reference: bool = True
  # Whether the run scores with a reward model (of reward_shape): a train_ppo config whose
  # reward is a function (reward.kind='function', RewardConfig.uses_model) builds and runs none;
  # plan_search drops its weights and forwards then, as the reference's; the papers' systems
  # always run one.
  reward_model: bool = True
  # The reward model's own shape (scalar head): a train_ppo run's reward.model_checkpoint
  # (trainer/sim_plan.workload), which need not be the critic's; None: the critic's, as the
  # papers' presets assume (Workload.reward_shape). Until 2026-12-04 always the critic's.
  reward: Optional[ModelShape] = None
  # A train_ppo run's fusion.inference_micro_batch (trainer/sim_plan.workload): the samples its
  # inference on generation instances scores at once, 0 (the default) the instance's slots
  # (trainer/rollout.plan_instances_config, FusedGenConfig.micro_batch); plan_search's
  # inference_rows for the plans the trainer runs.
  inference_micro_batch: int = 0
  # A train_ppo run's fusion.migration_rows (trainer/sim_plan.workload): the rows the trainer's
  # engine moves at once in a consolidation, whose gathered copy sits beside the cache; gen_plan
  # keeps room for it with kv_at_max_prompt (the papers' paged engines move blocks into the
  # pool itself). 0: up to the slots.
  migration_rows: int = 8
  # A train_ppo run's fields its prompt and response lengths came from
  # (trainer/plan_file.run_length_inputs, as (field, value) pairs: trainer/sim_plan.workload);
  # plan.json's workload records them (plan_search.length_record) and train_ppo compares its
  # own. (): the simulator's own `prompt` and `response` (the paper pairs).
  length_inputs: tuple = ()
  # Asynchronous PPO on the training devices: a train_ppo run with async_ppo.staleness > 0 and
  # no generation group (async_ppo.generation_devices = 0; trainer/sim_plan.workload) copies the
  # actor before each update for the next batch's generation and keeps the copy through that
  # update and that generation (trainer/loop.PPOTrainer._snapshot; plan_check's
  # actor_copy_bytes). plan_search counts it beside every stage of the run's plans without an
  # "async" split (plan_memory); its asynchronous search's colocated option keeps it whatever
  # this says. Until 2026-12-07 counted nowhere: a plan could need a copy more than the HBM.
  actor_copy: bool = False
  # Whether the run trains (and scores with) a critic: a train_ppo config whose
  # algo.estimator reads no values (grpo, rloo, ...: AlgoConfig.trains_critic;
  # trainer/sim_plan.workload) builds none. plan_search then searches the actor's training
  # alone (training_sim's `critic` None: no critic state, forwards, rescore or fusion) and
  # drops the critic's forwards from the inference; the papers' systems (simulate_iteration)
  # are PPO's and always train one. Until 2026-12-08 such a run was searched as PPO's.
  trains_critic: bool = True

  def __post_init__(self):
    # The counts first: minibatch=0 was a ZeroDivisionError in the divisibility check below.
    # Named as the user types them: the simulator's configs (configs/ablations.py,
    # configs/plan_search.py) set these fields at their top level, config.minibatch (a
    # training run's own are checked, under their own names, before its workload is built).
    for f in ("num_devices", "global_batch", "minibatch", "epochs", "micro_batch",
              "max_new_tokens"):
      if getattr(self, f) < 1:
        raise ValueError(f"config.{f}={getattr(self, f)} must be >= 1")
    if self.global_batch % self.minibatch:
      raise ValueError(f"config.global_batch={self.global_batch} must be divisible by "
                       f"config.minibatch={self.minibatch}")
    for role in ("critic", "reward"):
      shape = getattr(self, role)
      if shape is not None and shape.head != "scalar":
        raise ValueError(f"workload.{role} {shape.name!r} must have head='scalar'")

  @property
  def trained_models(self) -> tuple:
    """(("actor", shape), ("critic", shape)) of the models the run trains: the actor's alone
    where it trains no critic (trains_critic)."""
    return (("actor", self.actor),) + ((("critic", self.critic),) if self.trains_critic else ())

  @property
  def trained_critic(self) -> Optional[ModelShape]:
    """The critic's shape where the run trains one (trains_critic), else None: training_sim's
    `critic` argument."""
    return self.critic if self.trains_critic else None

  @property
  def reward_shape(self) -> ModelShape:
    """The reward model's shape: `reward`, else the critic's (the papers' presets)."""
    return self.critic if self.reward is None else self.reward

  @property
  def num_minibatches(self) -> int:
    return self.epochs * self.global_batch // self.minibatch

  @property
  def padded_len(self) -> int:
    """Tokens a training row holds: the trainer's update runs every sample right-padded to
    data.max_prompt_len + rollout.max_new_tokens (trainer/ppo.py's `tokens` [batch, prompt_bucket
    + max_new]; plan_check's train_step seq_len), so the training activations are sized at it,
    not at the mean length the stage times are counted at (training_sim.step_costs)."""
    return self.prompt.max_len + self.max_new_tokens

  def frozen_models(self, models: tuple = ("reference", "critic", "reward")) -> tuple:
    """(names, shapes) of the frozen `models` the run scores with: the reference has the
    actor's shape, the critic its own, the reward model reward_shape; the reference left out when
    the run has none (reference: a train_config with algo.kl_coef=0, which until 2026-12-04
    was charged its weights and forwards), the reward model when its reward is a function
    (reward_model, charged until 2026-12-04 too), the critic when the run trains none
    (trains_critic, charged until 2026-12-08)."""
    has = {"reference": self.reference, "reward": self.reward_model,
           "critic": self.trains_critic}
    names = tuple(m for m in models if has.get(m, True))
    shape = {"reference": self.actor, "critic": self.critic, "reward": self.reward_shape}
    return names, tuple(shape[m] for m in names)

  def kv_slot_len(self, prompt_lens: np.ndarray) -> int:
    """KV tokens a generation slot is allocated: padded_len with kv_at_max_prompt (the
    trainer's), else the longest of `prompt_lens` + max_new_tokens (until 2026-12-04 for every
    plan: ppo_tiny's 4-token prompts sized its slots at 516 of the trainer's 1024 tokens)."""
    if self.kv_at_max_prompt:
      return self.padded_len
    return int(prompt_lens.max()) + self.max_new_tokens

  def sample_lengths(self) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_lens [B], response_lens [B]) of this workload, fixed by its seed."""
    rng = np.random.default_rng([self.seed, 1])
    prompts = self.prompt.sample(rng, self.global_batch)
    resp = self.response.with_max_len(self.max_new_tokens).sample(rng, self.global_batch)
    return prompts, resp


@dataclasses.dataclass(frozen=True)
class SimOptions:
  """Knobs of the simulated systems (not of the workload)."""
  threshold: float = -1.0  # Rt for consolidation; < 0: chosen by simulation (choose_threshold)
  threshold_candidates: tuple = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)  # 0: stream, never migrate
  chunk_steps: int = 16  # decode steps between host checks
  inference_microbatch: int = 8  # samples per inference micro-batch
  # Slots per generation instance at most (memory may allow fewer); an instance's share of the
  # global batch is decoded at once whatever this says (gen_plan: at least that share).
  max_slots: int = 256
  gen_tps: tuple = (1, 2, 4, 8)  # tensor-parallel degrees tried for generation
  offload_frozen: bool = True  # reference/reward/critic weights in host memory until used
  # The trainer's optim.offload_during_rollout: the AdamW state waits in host memory while the
  # instances generate (train_state_bytes; its copy out and back, ~2x its bytes over
  # hardware.host_to_device_bw an iteration, is not timed).
  offload_optimizer: bool = False
  search_time_s: float = 2.0  # fused-schedule search budget per distinct pipeline problem
  staleness: int = 1  # pipe_rlhf_async: updates the generating policy lags behind (k >= 1)
  # pipe_rlhf_async: generation-group sizes step (0: a node, or smaller where one node holds
  # every device: plan_search.async_splits)
  async_split_unit: int = 0
  # plan search (pipe_rlhf, rlhfuse_planned, pipe_rlhf_async): only plans the trainer runs as
  # simulated (plan_search.trainer_refusal)
  trainer_runnable: bool = False

  def __post_init__(self):
    # Checked here, not only where a system uses them: the plan search turned the GenSetup
    # refusal of chunk_steps=0 into "no instance plan fits" and returned a pipelined plan, and
    # timed inference_microbatch=-3 as no inference at all (range() with a negative step).
    for f in ("chunk_steps", "inference_microbatch", "max_slots"):
      v = getattr(self, f)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"config.sim.{f}={v!r} must be an integer >= 1")
    if not self.gen_tps or any(not isinstance(t, (int, np.integer)) or t < 1
                               for t in self.gen_tps):
      raise ValueError(f"config.sim.gen_tps={self.gen_tps!r} must list tensor-parallel "
                       "degrees >= 1")
    if not self.threshold <= 1:
      raise ValueError(f"config.sim.threshold={self.threshold} must be an Rt in [0, 1], or < 0 to "
                       "choose it by simulation")
    # (0 or NaN failed in the first fused search, after reproduce_ablations had moved the
    # earlier outputs aside, as "time_budget_s=0.0 must be > 0", naming no field)
    t = self.search_time_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
      raise ValueError(f"config.sim.search_time_s={t!r} must be a finite number of seconds > 0")


@dataclasses.dataclass(frozen=True)
class GenPlan:
  tp: int
  num_instances: int
  slots: int
  kv_capacity_tokens: int
  inference_pp: int = 1  # instances a freed unit's inference pipeline spans (inference_pp)


def gen_plan(cost: CostModel, wl: Workload, tp: int, prompt_lens: np.ndarray, max_slots: int,
             resident_bytes: float = 0.0, resident: str = "") -> GenPlan:
  """Instances of `tp` devices; slots and KV pool from the memory left after the actor's
  weights, `resident_bytes` per device that stay there (named `resident`) and the prefill's
  activations. Raises if the batch's share of an instance cannot fit.

  Prefill runs an instance's prompts through the model at once (generation_sim._prefill; the
  trainer's engine, generation/instances.Generator, every slot's row, empty ones included, at
  the longest prompt: kv_at_max_prompt), and its peak holds the whole new KV cache beside one
  layer's activations of those prompt tokens (cost_model.activation_bytes). Until 2026-12-05
  those activations were left out: the slots filled the KV budget, and plan_check's compiled
  prefill of the 33B/13B and 65B/33B pairs did not fit beside the training state. The trainer's
  engine (kv_at_max_prompt) also keeps room for a migration's copy of migration_rows slots
  (plan_check's `migrate`), at other times than the prefill's activations."""
  n = wl.num_devices
  if n % tp:
    raise ValueError(f"generation tp={tp} must divide num_devices={n}")
  g = n // tp
  per_inst = -(-wl.global_batch // g)
  kv_tok_bytes = wl.actor.kv_bytes_per_token() / tp  # per device
  slot_cap = wl.kv_slot_len(prompt_lens)
  prompt_cap = slot_cap - wl.max_new_tokens  # a prefill row's tokens
  row_act = plan_lib.prefill_activation_bytes(cost, wl.actor, tp, 1, prompt_cap)  # a row's
  weights = wl.actor.weight_bytes() / tp
  free = cost.usable_bytes - weights - resident_bytes
  slot_kv = slot_cap * kv_tok_bytes
  need = (weights + per_inst * slot_kv + transient_bytes(wl, per_inst, row_act, slot_kv)
          + resident_bytes)
  # An instance holds its whole share of the batch at the longest length at once (no waves,
  # no KV paged by the lengths reached): a cluster too small for that is refused.
  cost.check_fits(f"generation of {wl.actor.name}", need,
                  f"tp={tp}: weights + KV cache for {per_inst} samples x {slot_cap} tokens "
                  f"+ their prefill's activations"
                  + (" (or a migration's rows)" if wl.kv_at_max_prompt else "")
                  + (f" + {resident}" if resident and resident_bytes else "")
                  + "; the simulated engine holds an instance's whole share of the batch at the "
                  "longest length at once: more devices or a smaller global_batch fit")
  if wl.kv_at_max_prompt:  # every slot is prefilled, and takes a migration's rows
    s = int(free // (slot_kv + row_act)) if free > 0 else 0
    while s > 0 and s * slot_kv + transient_bytes(wl, s, row_act, slot_kv) > free:
      s -= 1
    slots = max(per_inst, min(max_slots, s))
    pool = slots * slot_cap
  else:  # the share is prefilled; the rest of the pool takes migrated caches
    rest = free - per_inst * row_act
    pool = int(rest // kv_tok_bytes) if rest > 0 else 0
    slots = max(per_inst, min(max_slots, pool // slot_cap))
  return GenPlan(tp=tp, num_instances=g, slots=slots, kv_capacity_tokens=pool)


def transient_bytes(wl: Workload, rows: int, row_act: float, slot_kv: float) -> float:
  """Per device, what an instance of `rows` slots holds beside its KV cache at some moment
  (gen_plan, plan_search.plan_memory): the prefill's activations of its rows (`row_act` each)
  and, for the trainer's engine (kv_at_max_prompt), at another moment a migration's copy of up
  to migration_rows slots' cache (`slot_kv` each): the larger of the two."""
  prefill = rows * row_act
  if not wl.kv_at_max_prompt:
    return prefill
  return max(prefill, min(rows, wl.migration_rows or rows) * slot_kv)


def inference_memory_parts(cost: CostModel, wl: Workload, tp: int, rows: int,
                           frozen: Optional[tuple] = None, pp: int = 1) -> dict:
  """Per device of an inference copy of tp devices (with `pp` > 1, of the heaviest of its
  pipeline stages: shapes.heaviest_stage_weight_bytes, one stage's activations, and the whole
  LM head's logits the last stage makes), bytes: {"weights" (the frozen models,
  default those the run scores with, Workload.frozen_models, over tp), "activations" (one
  layer's of the largest, they run one after the other, for `rows` samples at once at
  wl.padded_len tokens: the trainer's scoring programs take their rows right-padded to
  data.max_prompt_len + rollout.max_new_tokens, plan_check's inference seq_len; until
  2026-12-04 the longest sampled prompt + max_new_tokens, which on ppo_tiny's 4-token prompts
  and max_prompt_len 512 was 1540 of the 2048 tokens)}, and with an LM head among them (the
  reference) "logits": its float32 logits of those rows at the response positions."""
  # (`is None`: an empty `frozen`, the asynchronous generation group of a run with neither a
  # reference nor a reward model, holds nothing; `or` charged it the default models)
  frozen = wl.frozen_models()[1] if frozen is None else frozen
  stages = frozen if pp == 1 else tuple(stage_shape(s, pp) for s in frozen)
  tokens = rows * wl.padded_len
  out = {"weights": heaviest_stage_weight_bytes(frozen, pp) / tp,
         "activations": max((cost.activation_bytes(s, tp, tokens, 1) for s in stages),
                            default=0.0)}
  # The reference's log-probs: its float32 logits at the response positions (cost_model
  # LOGITS_COPIES_SCORING), beside the last layer's activations at most.
  logits = max((cost.logits_bytes(s, tp, rows, wl.max_new_tokens, LOGITS_COPIES_SCORING)
                for s in frozen), default=0.0)
  if logits:
    out["logits"] = logits
  return out


def check_inference_memory(cost: CostModel, wl: Workload, tp: int, microbatch: int,
                           frozen: Optional[tuple] = None,
                           what: Optional[str] = None, pp: int = 1,
                           resident_bytes: float = 0.0, resident: str = "") -> None:
  """inference_memory_parts of one micro-batch of `microbatch` samples (on `pp` pipeline
  stages), beside `resident_bytes` per device that stay there (named `resident`), against the
  usable HBM; `what` names the models in the error (default: the run's,
  Workload.frozen_models)."""
  what = " + ".join(wl.frozen_models()[0]) if what is None else what
  need = sum(inference_memory_parts(cost, wl, tp, microbatch, frozen, pp).values())
  cost.check_fits(f"inference ({what})", need + resident_bytes,
                  f"tp={tp}" + (f" x pp{pp}" if pp > 1 else "") +
                  f", {microbatch} samples at once" +
                  (f", beside {resident_bytes / GIB:.1f} GiB of {resident}"
                   if resident and resident_bytes else ""))


def inference_pp(cost: CostModel, wl: Workload, tp: int, num_instances: int, opt: "SimOptions",
                 resident_bytes: float, resident: str) -> int:
  """The fewest instances of `tp` devices a freed unit's inference pipeline spans (1, 2, 4 or
  8; generation_sim.GenSetup.inference_pp) for the frozen models to fit beside
  `resident_bytes` per device (the training state the colocated systems keep there): instances
  of tp4 cannot hold 65B/33B's reference, reward model and critic (65 GB) beside it, and the
  papers' systems give the frozen models layouts of their own (ReaLHF's per-model plans,
  RLHFuse's per-stage parallel strategies). Only offloaded frozen models (sim.offload_frozen)
  are split so, as they are loaded stage by stage onto the freed instances; resident ones stay
  whole on each instance (frozen_resident_bytes). A ValueError names the largest tried."""
  frozen = wl.frozen_models()[1]
  err = None
  for pp in ((1, 2, 4, 8) if opt.offload_frozen else (1,)):
    if num_instances % pp or any(s.num_layers % pp for s in frozen):
      continue
    try:
      check_inference_memory(cost, wl, tp, opt.inference_microbatch, pp=pp,
                             resident_bytes=resident_bytes, resident=resident)
      return pp
    except ValueError as e:
      err = e
  raise err


def gen_setup(plan: GenPlan, wl: Workload, opt: SimOptions, cost: CostModel, fused: bool,
               threshold: Optional[float]) -> gen_lib.GenSetup:
  return gen_lib.GenSetup(
      num_instances=plan.num_instances, slots=plan.slots, tp=plan.tp,
      chunk_steps=opt.chunk_steps, max_new_tokens=wl.max_new_tokens,
      threshold=threshold if fused else None, stream_inference=fused,
      inference_microbatch=opt.inference_microbatch, kv_capacity_tokens=plan.kv_capacity_tokens,
      offload_frozen=opt.offload_frozen, inference_pp=plan.inference_pp,
      devices_share_compute=cost.shares_compute,
      devices_per_node=cost.hw.devices_per_node)


def frozen_resident_bytes(frozen: tuple, tp: int, opt: SimOptions) -> float:
  """Per device of a tp-device generation instance, the frozen models' weights that stay there
  while it generates: none when they wait in host memory (`offload_frozen`), else their
  weights split over tp (the instance scores with them)."""
  return 0.0 if opt.offload_frozen else sum(s.weight_bytes() for s in frozen) / tp


def kept_frozen_bytes(wl: Workload, devices_per_copy: int, opt: SimOptions) -> float:
  """Per device, what the frozen reference and reward model keep on the devices through every
  stage, training included, with sim.offload_frozen=False (no host memory to wait in): their
  weights split over the `devices_per_copy` devices of the layout that scores with them.
  0 when they are offloaded; only those the run has (Workload.reference, reward_model).
  (The critic's scoring copy is rebuilt from its training state; generation, which scores beside
  decoding, charges it too: frozen_resident_bytes.)"""
  return frozen_resident_bytes(wl.frozen_models(("reference", "reward"))[1], devices_per_copy,
                               opt)


def train_state_bytes(cost: CostModel, wl: Workload, opt: SimOptions, tp: int) -> float:
  """Per device, the training state that stays on the devices while instances of `tp` devices
  generate: the actor's and critic's weights and AdamW state (ZeRO-1 over data, as
  training_sim.check_train_memory sizes them) on the training plan the colocated systems take
  there (training_sim.best_plan beside kept_frozen_bytes at tp), the AdamW state left out with
  sim.offload_optimizer. The trainer keeps them on the training devices for the whole run, and
  the instances run on those devices (plan_check's resident_train_bytes); gradients and
  activations live only within a step. 0 where no training plan fits: the training stage
  refuses that itself, naming its plan.
  Until 2026-12-05 generation was sized as if the devices held nothing else."""
  prompts, resp = wl.sample_lengths()
  try:
    plan, _ = train_lib.best_plan(cost, wl.actor, wl.trained_critic, wl.num_devices,
                                  wl.minibatch, wl.micro_batch, float(np.mean(prompts + resp)),
                                  wl.num_minibatches,
                                  resident_bytes=kept_frozen_bytes(wl, tp, opt),
                                  padded_len=wl.padded_len, head_positions=wl.max_new_tokens)
  except ValueError:
    return 0.0
  return colocated_state_bytes(cost, wl, opt, plan)


def colocated_state_bytes(cost: CostModel, wl: Workload, opt: SimOptions,
                          plan: train_lib.TrainPlan) -> float:
  """Per device, the actor's and critic's kept_state_bytes on the colocated training plan
  `plan` (train_state_bytes, plan_search.uniform_candidates); the actor's alone where the run
  trains no critic (Workload.trains_critic)."""
  layouts = {"actor": (plan.actor_pp, plan.dp),
             "critic": (plan.critic_pp, plan.dp * plan.critic_replicas)}
  parts = (cost.train_memory_parts(shape, plan.tp, *layouts[role], True, 0.0, 0)
           for role, shape in wl.trained_models)
  return sum(kept_state_bytes(p, opt) for p in parts)


def kept_state_bytes(parts: dict, opt: SimOptions) -> float:
  """Of one model's training memory (cost_model.train_memory_parts), what stays on its devices
  between steps (train_state_bytes, plan_search.plan_memory): its weights and, unless
  sim.offload_optimizer, its AdamW state (with any float32 master copy)."""
  return parts["weights"] + (0.0 if opt.offload_optimizer else parts["optimizer"])


def zero3_resident_bytes(wl: Workload) -> float:
  """Per device, what DeepSpeed-Chat keeps while its hybrid engine generates: the ZeRO-3 shards
  of the trained actor and critic (16 bytes a parameter: bf16 weights and gradients, fp32
  master weights and two Adam moments) and of the frozen reference and reward model (bf16
  weights; DeepSpeed-Chat gives them ZeRO-3 too: DeepSpeedExamples step3's
  rlhf_engine._init_ref takes the actor's ZeRO stage, "If actor is ZeRO-3 then we use it for
  everything"; some versions read a reference_zero_stage argument instead); those the workload
  has (Workload.frozen_models), as the four forwards of _zero3_stage."""
  trained = wl.actor.num_params() + wl.critic.num_params()
  frozen = sum(s.num_params() for s in wl.frozen_models(("reference", "reward"))[1])
  return (16.0 * trained + 2.0 * frozen) / wl.num_devices


def simulate_gen_stage(cost: CostModel, wl: Workload, opt: SimOptions, fused: bool,
                       smallest_tp: bool = False, log: Optional[Callable] = None) -> dict:
  """Generation + inference with the best tensor-parallel degree; `smallest_tp`: DeepSpeed-
  Chat's hybrid engine, the smallest degree whose generation fits beside the ZeRO-3 shards every
  device keeps (`zero3_resident_bytes`). Its inference runs under ZeRO-3 (iteration_sim's
  _zero3_stage), not on the instances, so neither their inference memory nor the critic's
  heads limit the degree (both did until 2026-11-28: 65B generated at tp 8 where tp 4 fits).
  The frozen models are those of the workload (Workload.frozen_models; the papers' systems
  always have a reference and a reward model, and plan_search simulates them so)."""
  prompts, resp = wl.sample_lengths()
  frozen = wl.frozen_models()[1]
  rejected, best = {}, None
  # Smallest first: "the smallest degree that fits" must not depend on how gen_tps is listed.
  for tp in (sorted(opt.gen_tps) if smallest_tp else opt.gen_tps):
    split = next((e for e in (m.tensor_parallel_error(tp) for m in
                              ((wl.actor,) if smallest_tp else (wl.actor,) + frozen)) if e),
                 None) or cost.decode_width_error(tp)  # (a calibration's decode table: its width)
    if split:
      rejected[tp] = split
      continue
    try:
      if smallest_tp:
        plan = gen_plan(cost, wl, tp, prompts, opt.max_slots, zero3_resident_bytes(wl),
                        "the ZeRO-3 shards of the four models")
      else:
        state = train_state_bytes(cost, wl, opt, tp)
        kept = frozen_resident_bytes(frozen, tp, opt)
        plan = gen_plan(cost, wl, tp, prompts, opt.max_slots, kept + state,
                        "the training state" + (" and the frozen models' weights "
                                                "(sim.offload_frozen=False)" if kept else ""))
        # Beside the training state (since 2026-12-05 (bl)): 65B/33B's instances of tp4 (the
        # 33B models' 52 heads rule out tp8) cannot hold the three frozen models' 65 GB beside
        # it, so their inference runs on pipelines of several instances.
        plan = dataclasses.replace(plan, inference_pp=inference_pp(
            cost, wl, tp, plan.num_instances, opt, state, "the training state"))
    except ValueError as e:
      rejected[tp] = str(e)
      continue
    rt, rt_times = None, None
    if fused:
      if opt.threshold >= 0:
        rt = opt.threshold
      else:
        # The histogram "kept across iterations": lengths of another draw of the workload.
        hist = dataclasses.replace(wl, seed=wl.seed + 1000).sample_lengths()
        rt, rt_times = gen_lib.choose_threshold(
            cost, wl.actor, frozen, gen_setup(plan, wl, opt, cost, True, 0.0), hist[0],
            hist[1], opt.threshold_candidates)
    res = gen_lib.simulate_generation(cost, wl.actor, frozen,
                                      gen_setup(plan, wl, opt, cost, fused, rt), prompts, resp)
    cand = {"plan": plan, "result": res, "threshold": rt, "threshold_sweep": rt_times}
    if best is None or res.gen_plus_inf_s < best["result"].gen_plus_inf_s:
      best = cand
    if smallest_tp:
      break
  if best is None:
    raise ValueError(f"no generation plan fits {wl.actor.name} on {cost.hw.name}: {rejected}")
  best["rejected_tps"] = rejected
  return best


def _zero3_stage(cost: CostModel, wl: Workload, prompts: np.ndarray, resp: np.ndarray) -> dict:
  """DeepSpeed-Chat-like inference and training (ZeRO-3 over all devices)."""
  n = wl.num_devices
  seq = (prompts + resp).astype(np.float64)
  tokens, mean_len = float(seq.sum()), float(seq.mean())
  inf = 0.0
  # DeepSpeed-Chat's generate_experience runs four forwards: the actor (the old log-probs), the
  # reference, the critic and the reward model (until 2026-11-29 the actor's was missing here);
  # of the frozen ones, those the run has (Workload.frozen_models).
  for s in (wl.actor,) + wl.frozen_models()[1]:
    compute = float(np.sum(s.forward_flops(seq, (seq + 1) / 2.0))) / (
        n * cost.hw.peak_flops * cost.eff.prefill_mfu)
    inf += max(compute, cost.allgather_s(s.weight_bytes(), n))
  mb_tokens = tokens / wl.global_batch * wl.minibatch
  # Sized as allocated: every row padded to the max prompt + max new tokens (Workload.padded_len;
  # DeepSpeed-Chat pads to max_prompt_seq_len + max_answer_seq_len too); timed at the mean.
  train_lib.check_zero3_memory(cost, (wl.actor, wl.critic), n, wl.minibatch * wl.padded_len / n)
  step = (train_lib.zero3_train_s(cost, wl.actor, n, mb_tokens, mean_len) +
          train_lib.zero3_train_s(cost, wl.critic, n, mb_tokens, mean_len))
  return {"inf_s": inf, "train_s": wl.num_minibatches * step, "step_s": step}


def _planned_row(cost: CostModel, wl: Workload, searched: dict, fused_gen: Optional[dict],
                 fused_train: Optional[dict]) -> dict:
  """pipe_rlhf (fused_* None): the searched per-stage plan as is. rlhfuse_planned: both fusions
  where the plan allows them, each taken where it is faster than the plan's stage: inter-stage
  fusion on instances (rlhfuse's fused generation, inference streamed on them) instead of
  the plan's generation then inference; the fused schedule on the best colocated pipeline
  instead of the plan's training."""
  best = searched["best"]
  if best is None:  # only asynchronous splits fit (plan_search.search)
    raise ValueError(searched["synchronous_error"])
  p = best["predicted"]
  gen_s, inf_s, reshard = p["gen_s"], p["inf_s"], p["reshard_s"]
  train_s = p["train_s"]
  details = {"plan": {k: best[k] for k in ("generation", "inference", "training", "summary")},
             "uniform": searched["uniform"], "search_s": searched["search_s"]}
  u = searched["uniform"]
  g = best["generation"]
  gen_layout = (g["mode"], g["tp"], g.get("pp", 1))  # where generation runs (its weights)
  if u is not None and u["predicted"]["iteration_s"] < p["iteration_s"]:
    # One layout for every stage is a plan too (a pipeline layout's generation and inference,
    # which no per-stage combination expresses), and it pays no resharding.
    q, lay = u["predicted"], u["layout"]
    gen_s, inf_s, reshard, train_s = q["gen_s"], q["inf_s"], 0.0, q["train_s"]
    gen_layout = ("uniform", lay["tp"], lay["pp"])
    details["plan"] = {"uniform": lay, "summary": f"one layout tp{lay['tp']} pp{lay['pp']} "
                                                  f"dp{lay['dp']} for every stage"}
  if fused_gen is not None:
    r = fused_gen["result"]
    fused_reshard = plan_lib.reshard_s(cost, wl, fused_gen["plan"].tp)
    if r.gen_plus_inf_s + fused_reshard < gen_s + inf_s + reshard:
      gen_s, inf_s, reshard = r.gen_end_s, r.inf_exposed_s, fused_reshard
      gen_layout = ("instances", fused_gen["plan"].tp, 1)
      details["gen"] = {"mode": "inter_stage_fusion", "tp": fused_gen["plan"].tp,
                        "threshold": fused_gen["threshold"]}
  if fused_train is not None:
    # The fused schedule trains on its own pipelined layout: a generation layout that needed no
    # resharding (the uniform one, or instances of the training layout) now needs it, unless it
    # is that very layout.
    ft = fused_train["plan"]
    same = (gen_layout[0] == "uniform" and gen_layout[1] == ft["tp"] and
            gen_layout[2] == ft["actor_pp"])
    moved = reshard if reshard or same else plan_lib.reshard_s(cost, wl,
                                                              gen_layout[1] * gen_layout[2])
    if fused_train["train_s"] + moved < train_s + reshard:
      train_s, reshard = fused_train["train_s"], moved
      details["train"] = {"mode": "fused", "plan": fused_train["plan"]}
  row = {"gen_s": gen_s, "inf_s": inf_s, "gen_plus_inf_s": gen_s + inf_s, "train_s": train_s,
         "reshard_s": reshard, "details": details}
  row["iteration_s"] = reshard + row["gen_plus_inf_s"] + train_s
  row["samples_per_s"] = wl.global_batch / row["iteration_s"]
  return row


def _async_row(cost: CostModel, wl: Workload, opt: SimOptions, searched: dict) -> dict:
  """pipe_rlhf_async: the asynchronous search's best plan (plan_search.async_search), the
  synchronous plan run asynchronously where both groups colocated are faster than every split.
  Or the uniform layout run so where it beats them, which async_search's colocated option (the
  search's best) does not know; without it the row was slower than pipe_rlhf's on a small
  model on 8 GPUs. Both colocated plans are charged as the splits are: no critic on the
  instances, the rescore on the training layout (plan_search.async_colocated_predicted; until
  2026-12-07 the uniform layout kept its synchronous time), and both only where their memory
  with asynchronous PPO's copy of the actor and the rescoring passes fits
  (plan_search._memory_refusal; a refused uniform layout's reason in details'
  uniform_async_refused). A ValueError where no split fits (the search's async_error)."""
  if "async" not in searched:
    raise ValueError(f"pipe_rlhf_async: {searched['async_error']}")
  a = searched["async"]
  best = a["best"]
  p = best["predicted"]
  split = best["async"]
  plan = {k: best[k] for k in ("generation", "inference", "training", "summary")}
  u = searched["uniform"]
  q, refused = None, None
  if u is not None:
    lay, plans = u["layout"], u["plans"]
    # Memory as async_search checks its colocated option (plan_search._memory_refusal): with
    # the actor's copy and the rescoring passes beside the layout's stages (until 2026-12-07
    # only as the synchronous uniform_candidates checked it, without either).
    refused = plan_lib._memory_refusal(
        cost, wl, opt, {**plans, "async": {"generation_devices": wl.num_devices,
                                           "training_devices": wl.num_devices,
                                           "staleness": a["staleness"], "colocated": True}})
    if refused is None:
      q = plan_lib.async_colocated_predicted(cost, wl, opt, u["predicted"], plans["inference"],
                                             plans["training"])
  if q is not None and q["iteration_s"] < p["iteration_s"]:
    p = q
    split = {"generation_devices": wl.num_devices, "training_devices": wl.num_devices,
             "staleness": a["staleness"], "colocated": True}
    plan = {"uniform": lay, "summary": f"one layout tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} "
                                       "for every stage"}
  row = {"gen_s": p["gen_s"], "inf_s": p["inf_s"], "gen_plus_inf_s": p["gen_s"] + p["inf_s"],
         "train_s": p["train_s"], "reshard_s": p["reshard_s"],
         "iteration_s": p["iteration_s"],
         "details": {"plan": plan,
                     "async": {**split, "bound": p["bound"], "serial_s": p["serial_s"],
                               "splits": a["splits"]},
                     "uniform": searched["uniform"], "search_s": searched["search_s"]}}
  if refused:
    row["details"]["uniform_async_refused"] = refused
  row["samples_per_s"] = wl.global_batch / row["iteration_s"]
  return row


def simulate_iteration(cost: CostModel, wl: Workload, opt: SimOptions, systems=SYSTEMS,
                       cache: Optional[train_lib.ScheduleCache] = None,
                       log: Optional[Callable[[str], None]] = None) -> tuple[dict, dict]:
  """({system: row}, raw) for one setting: row fields in the module docstring (+ details);
  raw = {"gen": {(fused, smallest_tp): stage}, "train": {fused: result}} with the GenResult
  timelines and the fused schedule's order, for figures."""
  unknown = [s for s in systems if s not in SYSTEMS]
  if unknown:
    raise ValueError(f"unknown systems {unknown}; known: {list(SYSTEMS)}")
  if not wl.trains_critic:
    raise ValueError("simulate_iteration: the simulated systems are PPO's, each trains a critic; "
                     "a workload without one (trains_critic=False) is searched by plan_search "
                     "alone (experiments/plan_search.py compares the systems with a critic)")
  if "pipe_rlhf_async" in systems and opt.staleness < 1:
    raise ValueError(f"config.sim.staleness={opt.staleness}: pipe_rlhf_async needs a "
                     "staleness >= 1 (updates the generating policy lags behind)")
  cache = cache or train_lib.ScheduleCache(time_budget_s=opt.search_time_s, log=log)
  prompts, resp = wl.sample_lengths()
  mean_len = float(np.mean(prompts + resp))
  out = {}
  gen_cache: dict = {}

  def gen(fused: bool, smallest: bool = False) -> dict:
    key = (fused, smallest)
    if key not in gen_cache:
      gen_cache[key] = simulate_gen_stage(cost, wl, opt, fused, smallest, log)
    return gen_cache[key]

  train_cache: dict = {}

  def train(fused: bool, kept: float = 0.0) -> dict:
    """The training stage, beside `kept` bytes per device of frozen weights (kept_frozen_bytes
    at the system's generation degree, where it scores)."""
    if (fused, kept) not in train_cache:
      plan, _ = train_lib.best_plan(cost, wl.actor, wl.critic, wl.num_devices, wl.minibatch,
                                    wl.micro_batch, mean_len, wl.num_minibatches,
                                    resident_bytes=kept, padded_len=wl.padded_len,
                                    head_positions=wl.max_new_tokens)
      costs = train_lib.step_costs(cost, wl.actor, wl.critic, plan, mean_len,
                                   resident_bytes=kept, padded_len=wl.padded_len,
                                   head_positions=wl.max_new_tokens)
      res = train_lib.pipeline_train_s(costs, wl.num_minibatches, fused, cache)
      res["plan"] = plan.to_dict()
      res["problem"] = costs.problem.to_dict()
      train_cache[(fused, kept)] = res
    return train_cache[(fused, kept)]

  def kept(g: dict) -> float:
    return kept_frozen_bytes(wl, g["plan"].tp, opt)

  planned: dict = {}

  def plan() -> dict:
    """The hierarchical plan search of this setting (sim/plan_search.py), once; with the
    asynchronous splits when pipe_rlhf_async is simulated."""
    if "res" not in planned:
      k = opt.staleness if "pipe_rlhf_async" in systems else 0
      planned["res"] = plan_lib.search(cost, wl, opt, log=log, staleness=k,
                                       split_unit=opt.async_split_unit)
    return planned["res"]

  for name in systems:
    if log:
      log(f"  system {name}")
    if name == "pipe_rlhf_async":
      out[name] = _async_row(cost, wl, opt, plan())
      continue
    if name in ("pipe_rlhf", "rlhfuse_planned"):
      fused = name == "rlhfuse_planned"
      out[name] = _planned_row(cost, wl, plan(), gen(True) if fused else None,
                               train(True, kept(gen(True))) if fused else None)
      continue
    if name == "deepspeed_chat_like":
      g = gen(False, smallest=True)
      z = _zero3_stage(cost, wl, prompts, resp)
      gen_s = g["result"].gen_end_s
      row = {"gen_s": gen_s, "inf_s": z["inf_s"], "gen_plus_inf_s": gen_s + z["inf_s"],
             "train_s": z["train_s"], "details": {"gen_tp": g["plan"].tp, "train": "zero3"}}
    else:
      g = gen(name in _INTER)
      r = g["result"]
      row = {"gen_s": r.gen_end_s, "inf_s": r.inf_exposed_s, "gen_plus_inf_s": r.gen_plus_inf_s}
      details = {"gen_plan": dataclasses.asdict(g["plan"]), "threshold": g["threshold"],
                 "threshold_sweep": g["threshold_sweep"], "gen": r.summary()}
      if name == "realhf_like":
        colocated = train(False, kept(g))
        split = min(train_lib.disjoint_splits(cost, wl.actor, wl.critic, wl.num_devices,
                                              wl.minibatch, wl.micro_batch, mean_len,
                                              resident_bytes=kept(g),
                                              padded_len=wl.padded_len,
                                              head_positions=wl.max_new_tokens),
                    key=lambda x: x[0], default=None)
        if split is not None and split[0] * wl.num_minibatches < colocated["train_s"]:
          row["train_s"] = split[0] * wl.num_minibatches
          details["train"] = {"mode": "disjoint_concurrent", **split[1]}
        else:
          row["train_s"] = colocated["train_s"]
          details["train"] = {"mode": "colocated_serial_1f1b", "plan": colocated["plan"]}
      else:
        t = train(name in _INTRA, kept(g))
        row["train_s"] = t["train_s"]
        details["train"] = {k: v for k, v in t.items() if k != "search"}
        if t["search"] is not None:
          details["train"]["search"] = {k: v for k, v in t["search"].items() if k != "order"}
      row["details"] = details
    row["reshard_s"] = plan_lib.reshard_s(cost, wl, row["details"].get("gen_tp") or
                                  row["details"]["gen_plan"]["tp"])
    row["iteration_s"] = row["reshard_s"] + row["gen_plus_inf_s"] + row["train_s"]
    row["samples_per_s"] = wl.global_batch / row["iteration_s"]
    out[name] = row
  # raw["train"] by `fused` alone: with sim.offload_frozen=False a system's training also
  # depends on where its generation keeps the frozen weights; the figures take one of each.
  return out, {"gen": gen_cache, "train": {fused: res for (fused, _), res in train_cache.items()}}
