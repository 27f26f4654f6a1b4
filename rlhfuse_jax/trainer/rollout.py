"""Stages 1-2 of a PPO iteration behind one interface (docs/architecture.md §1, §2).

A `RolloutStage` turns the current actor and critic parameters (`params(model)` gives a
model's whole parameters when the stage needs them, so a serial stage never holds the whole
actor and critic at once), a batch of prompts and a key into `StageOutputs`: the sampled
responses, the reference log-probs, the critic values and the rewards, as host arrays. Two
implementations return the same outputs:

  SerialStage  generation on the whole mesh, then reference / critic / reward inference
  FusedStage   inter-stage fusion (config.fusion.inter_stage): sample-level generation
               instances, long-tail consolidation, inference on the freed instances,
               overlapped (generation/fused.py); the serial outputs when an instance's
               shape matches a device's share of the serial batch (the defaults ensure it on
               a data-parallel mesh): the responses and their log-probs bitwise; the frozen
               models' outputs too where a row's result does not depend on its place in the
               batch, since the inference micro-batches group samples in finishing order
               (XLA:CPU, 9 rows a device: critic values 7e-9 apart, the rest bitwise; the
               tests' 4 rows: all bitwise). With mesh.tensor > 1 the serial stage splits
               each matmul over tensor devices while a default instance is one device, so
               the log-probs differ in the last bits and a sampled token may flip; the tests
               check data-parallel meshes. With several processes each drives the instances
               on its own devices (generation/multihost.py).

Both are built from configs, the frozen parameters (the reference, a reward model through
`scoring.Rewards`) and devices, never from the trainer. A stage owns the frozen models from then
on: the serial stage keeps them on the mesh; the fused stage keeps them in host memory and
places them on an instance only when it is freed for inference (its builder hands them over
already on the host, build.Models.frozen_to_host, so no device copy outlives setup).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import jax
import numpy as np
from absl import logging

from rlhfuse_jax import metrics as metrics_lib
from rlhfuse_jax.fields import fail as _fail
from rlhfuse_jax.generation import engine
from rlhfuse_jax.generation import fused as fused_lib
from rlhfuse_jax.generation import instances
from rlhfuse_jax.generation import pipelined
from rlhfuse_jax.generation.instances import FrozenModels
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.inference import scoring
from rlhfuse_jax.inference import stages as inf_stages
from rlhfuse_jax.models import llama
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.trainer import rt_auto
from rlhfuse_jax.trainer.config import TrainConfig


@dataclasses.dataclass
class Prompts:
  """One iteration's prompts, each repeated samples_per_prompt times (GRPO/RLOO groups are
  consecutive rows)."""
  records: list  # [B] prompt records (dicts), what reward functions read
  tokens: np.ndarray  # [B, P] int32, right-padded
  lens: np.ndarray  # [B] int32
  uids: np.ndarray  # [B] sample ids, unique over the run (per-sample RNG streams)


@dataclasses.dataclass
class StageOutputs:
  """What generation + inference hand to training (host numpy arrays)."""
  rollout: engine.Rollout
  batch: scoring.ScoringBatch  # tokens [B, P+T] etc.
  # [B, T] reference log-probs; None when nothing reads them (algo.kl_coef=0: the stage holds
  # no reference and runs no forward of it)
  ref_logp: Optional[np.ndarray]
  values: np.ndarray  # [B, T] critic values (zeros without a critic)
  scores: np.ndarray  # [B] sequence rewards
  metrics: dict  # timings (timing_s/generate, timing_s/inference) and stage-specific metrics
  # {label: [B] unweighted values} of each reward term when there are several
  # (Rewards.combine_terms: "function" or "model", "format"); {} for one
  reward_terms: dict = dataclasses.field(default_factory=dict)


# params("actor") / params("critic"): a model's whole parameters, placed as generation and
# inference take them (for a pipelined run, resharded from the stage-stacked state on each call:
# gathered for a stage that runs them on the training mesh, the layers left split over the
# stages for one that moves them on, FusedStage.moves_params).
WholeParams = Callable[[str], Any]


class RolloutStage(Protocol):
  def __call__(self, params: WholeParams, prompts: Prompts, key: jax.Array, *,
               rewards_only: bool = False) -> StageOutputs:
    """The critic is asked for only in a run with one (otherwise values are zeros).
    rewards_only: the responses and their rewards alone (a validation pass): no reference or
    critic forward (ref_logp None, values zeros); the same responses and scores."""


def validation_stage(stage: Any) -> Callable[[WholeParams, Prompts, jax.Array], StageOutputs]:
  """The call of `stage` for a validation pass, which reads the responses and their rewards
  alone: a stage of this module skips the reference's and the critic's forwards there
  (rewards_only; with algo.kl_coef > 0 and a critic they were two of its three inference
  passes); any other callable (a test's stand-in or wrapper) is called as it is."""
  if isinstance(stage, (SerialStage, FusedStage, PlannedStage)):
    return functools.partial(stage, rewards_only=True)
  return stage


def fused_generator(stage: Any) -> Optional[fused_lib.FusedGenerator]:
  """The generator of a fused stage (FusedStage, InstancesStage), which learns the "auto" Rt's
  length histogram from the batches it generates; None for the other stages (and for a stage
  a test replaced by a plain function)."""
  gen = getattr(stage, "generator", None)
  return gen if isinstance(gen, fused_lib.FusedGenerator) else None


class SerialStage:
  """Generation on the whole mesh, then inference: the baseline the fusion must match."""

  def __init__(self, cfg: TrainConfig, sampling: SamplingConfig, mesh: jax.sharding.Mesh, *,
               reference: Any, rewards: scoring.Rewards, pad_id: int, actor_shapes: Any,
               use_critic: bool):
    self.actor_cfg, self.critic_cfg, self.use_critic = cfg.model, cfg.critic_model, use_critic
    self.sampling, self.pad_id = sampling, pad_id
    self.reference, self.rewards = reference, rewards
    self.scorer = scoring.Scorer(mesh)
    self.generator = instances.Generator(cfg.model, sampling,
                                         batch_size=cfg.rollout.batch_size,
                                         prompt_len=cfg.data.max_prompt_len, mesh=mesh,
                                         params=actor_shapes)

  def __call__(self, params: WholeParams, prompts: Prompts, key, *,
               rewards_only: bool = False) -> StageOutputs:
    # The whole actor lives only while generating, the whole critic only while scoring. Their
    # fetches (a pipelined state's gather, timing_s/reshard) stay outside the stage clocks, as
    # in the planned and fused stages.
    actor = params("actor")
    t0 = time.time()
    rollout = self.generator.generate(actor, prompts.tokens, prompts.lens, key,
                                      uids=prompts.uids)
    t_gen = time.time() - t0
    del actor
    return score_rollout(self, rollout, params, prompts, {"timing_s/generate": t_gen},
                         rewards_only=rewards_only)


def score_rollout(stage: Any, rollout: Any, params: WholeParams, prompts: Prompts, m: dict,
                  place_critic: Optional[Callable[[Any, dict], Any]] = None,
                  rewards_only: bool = False) -> StageOutputs:
  """The inference half of the serial and planned stages: reference log-probs (None without a
  reference), values (the critic fetched after the reference's pass, not both whole at once;
  `place_critic(critic, m)` moves it where the stage scores and records its own timing),
  rewards. timing_s/inference leaves out the fetch and the placement (timed apart);
  timing_s/reward, part of it, times the rewards (reward model and functions). `stage` holds
  actor_cfg, critic_cfg, use_critic, sampling, pad_id, reference, rewards and scorer.
  rewards_only: the rewards alone (no reference log-probs, values zeros, no critic fetched)."""
  t0 = time.time()
  batch = scoring.ScoringBatch.from_rollout(rollout, stage.pad_id)
  ref_logp = None  # no reference (algo.kl_coef=0): nothing reads its log-probs
  if stage.reference is not None and not rewards_only:
    ref_logp = stage.scorer.logprobs(stage.actor_cfg, stage.reference, batch,
                                     stage.sampling.logprob_temperature)
  values = np.zeros(rollout.logprobs.shape, np.float32)
  if stage.use_critic and not rewards_only:
    t_fetch = time.time()
    critic = params("critic")
    if place_critic is not None:
      critic = place_critic(critic, m)
    t0 += time.time() - t_fetch
    values = stage.scorer.values(stage.critic_cfg, critic, batch)
    del critic  # a pipelined update's gathered copy: not beside the reward model's pass
  t_reward = time.time()  # the reward model's forward (if any) and the reward functions
  scores, reward_metrics, terms = stage.rewards.scored_terms(batch, prompts.records)
  t_end = time.time()
  m["timing_s/reward"] = t_end - t_reward
  m["timing_s/inference"] = t_end - t0
  m.update(reward_metrics)
  return StageOutputs(rollout=rollout, batch=batch, ref_logp=ref_logp, values=values,
                      scores=scores, metrics=m, reward_terms=terms)


def fused_config(fusion, batch_size: int, num_devices: int) -> fused_lib.FusedGenConfig:
  """FusedGenConfig from config.fusion, with its 0 = automatic fields resolved."""
  g = fusion.num_instances or num_devices // fusion.instance_devices
  if g < 1:
    raise ValueError(f"config.fusion.instance_devices={fusion.instance_devices} exceeds the "
                     f"{num_devices} devices of the mesh")
  slots = fusion.slots or -(-batch_size // g)
  return fused_lib.FusedGenConfig.of(fusion, num_instances=g, slots=slots)


def check_fusion(cfg: TrainConfig, num_devices: int) -> Optional[fused_lib.FusedGenConfig]:
  """What FusedStage would reject, checked before anything is built (trainer/validate.py); the
  engine's config when config.fusion.inter_stage is on."""
  if not cfg.fusion.inter_stage:
    return None
  fc = fused_config(cfg.fusion, cfg.rollout.batch_size, num_devices)
  fused_lib.check_layout(fc, cfg.rollout.batch_size, num_devices)  # the engine's own check
  check_inference_pp(cfg, fc.inference_pp, "fusion.inference_pp")
  return fc


def check_inference_pp(cfg: TrainConfig, pp: int, field: str) -> None:
  """The engine's checks of inference on pipelines of instances (generation/fused.py), before
  the models are built: pp divides the layers of the reference (a run with one) and the critic
  (a run that scores one on the instances: not asynchronous PPO's, trainer/loop.py
  stage_critic); the reward model's, read from its checkpoint, trainer/validate.py checks."""
  if pp == 1:
    return
  models = [("reference", cfg.model)] if cfg.algo.uses_reference else []
  if adv_lib.needs_critic(cfg.algo.estimator) and not cfg.async_ppo.staleness:
    models.append(("critic", cfg.critic_model))
  for name, model in models:
    inf_stages.check_split(model, pp, f"config.{field}", name)


def warn_idle_instance_devices(fc: fused_lib.FusedGenConfig, num_devices: int) -> None:
  """Legal but rarely meant: instances that leave some of the generation devices idle."""
  used = fc.num_instances * fc.instance_devices
  if used < num_devices:
    logging.warning("config.fusion: %d instances of %d device(s) use %d of the %d devices; the "
                    "other %d stay idle while they generate (instance_devices does not divide "
                    "the devices, or num_instances is set lower)", fc.num_instances,
                    fc.instance_devices, used, num_devices, num_devices - used)


def warn_single_instance(fc: fused_lib.FusedGenConfig, num_devices: int) -> None:
  """fusion.inter_stage with one generation instance does nothing: no fewer instances to
  consolidate onto, none freed for inference while the tail decodes (the default ppo_tiny run
  on one device took it without a word, compiling the migration's programs)."""
  if fc.num_instances == 1:
    logging.warning("config.fusion.inter_stage=True with one generation instance (%d device(s), "
                    "fusion.instance_devices=%d, num_instances=%d): nothing to consolidate onto "
                    "and no instance freed for inference while the tail decodes, so the fusion "
                    "changes nothing; it needs several instances (more devices, a smaller "
                    "fusion.instance_devices, fusion.num_instances > 1 or 0: devices / "
                    "instance_devices)", num_devices, fc.instance_devices, fc.num_instances)


def check_instances_within_processes(field: str, width: int, num_devices: int,
                                     pp: int = 1, pp_field: str = "") -> None:
  """Generation instances of `width` consecutive devices over a multi-process run's
  `num_devices` generation devices: each must lie in one process (generation/multihost.py), so
  `width` must divide each process's share: its device count, or with fewer devices (an
  asynchronous run's generation group) num_devices / P, what async_ppo.split_devices takes of
  each process. Asks jax for its processes, which starts its backend: only for a run on a live
  mesh (trainer/validate.py), never while a binary may still set the device count."""
  procs = jax.process_count()
  if procs > 1:
    # (A generation group was left to the engine, which refused it only once the models were
    # built, telling the user to divide each process's whole device count, which it did.)
    group = num_devices != jax.device_count()
    local = num_devices // procs if group else jax.local_device_count()
    if local % width:
      _fail(field, width, f"a divisor of each process's {local} "
            f"{'generation ' if group else ''}devices ({procs} processes): a generation "
            "instance must live in one process")
    if (local // width) % pp:  # (generation/fused.py: a pipeline's instances are one process's)
      _fail(pp_field, pp, f"a divisor of each process's {local // width} generation instances "
            f"({procs} processes): the instances of an inference pipeline are one process's")


class FusedStage:
  """Generation + inference of one PPO iteration on fused instances (docs/architecture.md §2).

  Defaults (config.fusion): one instance per `instance_devices` devices, slots = batch /
  instances, inference micro-batch = slots. The critic is trained, so its current parameters
  come with each call; the frozen models live in host memory. The Rt histogram lives in the
  generator; checkpoints keep it (PPOTrainer._meta), so a resumed "auto" Rt chooses from the
  lengths seen before (Rt changes timings and the fusion decision metrics, never the tokens or
  the trajectory).
  """

  # params(model) are moved at once onto instances (or host memory): the trainer hands a
  # pipelined model over without gathering its layers first (Update.whole's `moving`).
  moves_params = True

  def __init__(self, cfg: TrainConfig, sampling: SamplingConfig, devices: Sequence[Any], *,
               reference: Any, rewards: scoring.Rewards, pad_id: int, actor_shapes: Any,
               critic_shapes: Optional[Any] = None,
               config: Optional[fused_lib.FusedGenConfig] = None, fuse: bool = True):
    # config/fuse: InstancesStage's (config.plan.generation='instances'); else config.fusion.
    self.config = config or check_fusion(cfg, len(devices))
    self.fuse = fuse
    self.pipelined = cfg.mesh.stage > 1  # params(model) makes a copy (update.Update.whole)
    self.pad_id, self.use_critic = pad_id, critic_shapes is not None
    # reference None (algo.kl_coef=0): no instance loads, compiles or runs it.
    frozen = FrozenModels(reference=cfg.model if reference is not None else None,
                          critic=cfg.critic_model if self.use_critic else None,
                          reward=rewards.model_cfg,
                          temperature=sampling.logprob_temperature)
    # The host copies this stage owns: an instance loads them when it is freed for inference.
    # (to_host: with several processes a model sharded over them is all-gathered first.)
    self.host = {} if reference is None else {"reference": mesh_lib.to_host(reference)}
    if rewards.from_model:
      self.host["reward"] = mesh_lib.to_host(rewards.model_params)
    self.rewards = rewards.without_model_params()
    shapes = dict(self.host)
    if self.use_critic:
      shapes["critic"] = critic_shapes
    self.generator = fused_lib.FusedGenerator(
        cfg.model, sampling, self.config, batch_size=cfg.rollout.batch_size,
        prompt_len=cfg.data.max_prompt_len, frozen=frozen, actor_params=actor_shapes,
        frozen_params=shapes, devices=list(devices), rt_model=rt_auto.simulated_rt_model)

  def __call__(self, params: WholeParams, prompts: Prompts, key, *,
               rewards_only: bool = False) -> StageOutputs:
    # Both at once: the critic scores finished samples while the tail still decodes.
    frozen = dict(self.host)
    use_critic = self.use_critic and not rewards_only
    # A pass that measures the costs for Rt 'auto' (the generator's first batch: a validation
    # pass run before any training batch, HeldOutEval called on a new stage) needs the critic.
    if self.use_critic and (use_critic or self.generator.measures_costs(self.fuse)):
      frozen["critic"] = self._instance_ready(params("critic"), self.pipelined)
    # rewards_only: the reward model alone (if any) is loaded onto the freed instances and run.
    models = (["reward"] if self.rewards.from_model else []) if rewards_only else None
    # The actor as placed for training: the generator reshards it onto its instances on the
    # devices, also across processes (FusedGenerator.place_actor). Passed as a callable, which
    # the generator calls as it places it: a pipelined update's copy of the actor (its layers
    # split over the stages: Update.whole's `moving`) is then dropped once placed; an argument
    # lives until the call returns, and that copy sat beside the instances through the whole
    # generation.
    out = self.generator.run(functools.partial(params, "actor"), frozen, prompts.tokens,
                             prompts.lens, key, uids=prompts.uids, fuse=self.fuse, models=models)
    rollout = out.rollout
    batch = scoring.ScoringBatch.from_rollout(rollout, self.pad_id)
    values = out.values if use_critic else np.zeros(rollout.logprobs.shape, np.float32)
    # The reward model scored on the instances; the function terms are added here, after the
    # engine's clocks (timing_s/reward: these functions; the model's forward ran on the
    # instances beside the reference's and the critic's, in timing_s/inference or overlapped).
    t_reward = time.perf_counter()
    scores, reward_metrics, terms = self.rewards.combine_terms(
        prompts.records, rollout.response_tokens, rollout.response_lens,
        out.rewards if self.rewards.from_model else None)
    metrics = {**out.metrics, **reward_metrics,
               "timing_s/reward": time.perf_counter() - t_reward}
    if out.rt_choice is not None:
      metrics["fusion/rt_simulated_s"] = {str(k): v for k, v in out.rt_choice.simulated_s.items()}
    return StageOutputs(rollout=rollout, batch=batch, ref_logp=out.ref_logp, values=values,
                        scores=scores, metrics=metrics, reward_terms=terms)

  @staticmethod
  def _instance_ready(params: Any, pipelined: bool) -> Any:
    """Params an instance freed for inference can copy onto its devices: as they are in one
    process; with several, host copies (the critic: any instance may be freed, so every process
    keeps it whole); host copies too when `pipelined` (a pipelined update's critic is a copy
    made for this call, its layers split over the stages: the frozen models' way, host memory,
    until an instance loads it, rather than beside the instances through the whole generation;
    gathered, as it was before, a whole critic on every training device)."""
    if jax.process_count() == 1 and not pipelined:
      return params
    return mesh_lib.to_host(params)


def stage_kind(cfg: TrainConfig) -> str:
  """Which RolloutStage config.fusion.inter_stage and config.plan ask for: "instances",
  "planned", "fused" or "serial" (generation and inference on one mesh)."""
  if cfg.plan.generation == "instances":
    return "instances"
  if cfg.plan.generation == "pipeline" or cfg.plan.inference_tp:
    return "planned"
  return "fused" if cfg.fusion.inter_stage else "serial"


def make_rollout_stage(cfg: TrainConfig, sampling: SamplingConfig, mesh: jax.sharding.Mesh, *,
                       reference: Any, rewards: scoring.Rewards, pad_id: int, actor_shapes: Any,
                       critic_shapes: Optional[Any]) -> RolloutStage:
  """The stage config.fusion.inter_stage and config.plan ask for (stage_kind), over the mesh's
  devices."""
  kind = stage_kind(cfg)
  if kind == "instances":
    return InstancesStage(cfg, sampling, list(mesh.devices.flat), reference=reference,
                          rewards=rewards, pad_id=pad_id, actor_shapes=actor_shapes,
                          critic_shapes=critic_shapes)
  if kind == "planned":
    return PlannedStage(cfg, sampling, mesh, reference=reference, rewards=rewards, pad_id=pad_id,
                        actor_shapes=actor_shapes, use_critic=critic_shapes is not None)
  if kind == "fused":
    return FusedStage(cfg, sampling, list(mesh.devices.flat), reference=reference,
                      rewards=rewards, pad_id=pad_id, actor_shapes=actor_shapes,
                      critic_shapes=critic_shapes)
  return SerialStage(cfg, sampling, mesh, reference=reference, rewards=rewards, pad_id=pad_id,
                     actor_shapes=actor_shapes, use_critic=critic_shapes is not None)


# ---------------------------------------------------------------- per-stage plans (config.plan)

def plan_instances_config(cfg: TrainConfig, num_devices: int) -> fused_lib.FusedGenConfig:
  """The instances of config.plan.generation='instances': G = devices / generation_tp instances
  of generation_slots slots (0: batch / G), the other fields from config.fusion."""
  plan, fusion, b = cfg.plan, cfg.fusion, cfg.rollout.batch_size
  tp = plan.generation_tp
  if num_devices % tp:
    _fail("plan.generation_tp", tp, f"a divisor of the {num_devices} devices (G = devices / tp "
          "instances)")
  for name, default in (("instance_devices", 1), ("num_instances", 0), ("slots", 0),
                        ("inference_pp", 1)):
    if getattr(fusion, name) != default:
      _fail(f"fusion.{name}", getattr(fusion, name),
            f"its default {default} with config.plan.generation='instances' (the plan's "
            "generation_tp, generation_slots and inference_pp lay out the instances)")
  g = num_devices // tp
  need = -(-b // g)
  if plan.generation_slots and plan.generation_slots < need:
    _fail("plan.generation_slots", plan.generation_slots,
          f">= {need} ({b} samples dealt to {g} instances of generation_tp={tp}), or 0")
  fc = fused_lib.FusedGenConfig.of(fusion, instance_devices=tp, num_instances=g,
                                   slots=plan.generation_slots or need,
                                   inference_pp=plan.inference_pp)
  if g % plan.inference_pp:
    _fail("plan.inference_pp", plan.inference_pp, f"a divisor of the {g} instances "
          f"(devices / plan.generation_tp={tp}): the freed instances score in units of that many")
  check_inference_pp(cfg, plan.inference_pp, "plan.inference_pp")
  return fc


def check_plan(cfg: TrainConfig, num_devices: int) -> None:
  """What the trainer cannot run of config.plan on `num_devices`, before anything is built
  (trainer/validate.py). Field-local checks are PlanConfig's."""
  plan = cfg.plan
  if plan.generation == "instances":
    plan_instances_config(cfg, num_devices)
    if plan.inference_tp not in (0, plan.generation_tp):
      _fail("plan.inference_tp", plan.inference_tp,
            f"0 or plan.generation_tp={plan.generation_tp} with plan.generation='instances' "
            "(inference runs on the generation instances, generation/fused.py; scoring on a "
            "layout of its own after instance generation is not implemented)")
    return
  if jax.process_count() > 1 and (plan.generation == "pipeline" or plan.inference_tp):
    field = "plan.generation" if plan.generation == "pipeline" else "plan.inference_tp"
    _fail(field, plan.generation if field == "plan.generation" else
          plan.inference_tp, f"the default with {jax.process_count()} processes (pipelined "
          "generation and inference on its own mesh run in one process so far; multi-host "
          "runs take plan.generation='instances' or the default 'mesh')")
  if cfg.fusion.inter_stage:
    if plan.generation == "pipeline":
      _fail("fusion.inter_stage", True, "False with config.plan.generation='pipeline' (the "
            "fusion runs on generation instances: plan.generation='instances')")
    if plan.inference_tp:
      _fail("plan.inference_tp", plan.inference_tp, "0 with config.fusion.inter_stage=True "
            "(fused inference runs on the generation instances)")
  if plan.inference_tp and num_devices % plan.inference_tp:
    _fail("plan.inference_tp", plan.inference_tp,
          f"0 or a divisor of the {num_devices} devices (inference mesh data x tensor)")
  if plan.generation == "pipeline":
    pp, g, b = plan.generation_pp, plan.groups, cfg.rollout.batch_size
    if pp > num_devices:
      _fail("plan.generation_pp", pp, f"<= the {num_devices} devices (one device per stage)")
    if cfg.model.num_layers % pp:
      _fail("plan.generation_pp", pp,
            f"a divisor of model.num_layers={cfg.model.num_layers} (L/pp layers per stage)")
    if b % g:
      _fail("plan.generation_groups", plan.generation_groups,
            f"a divisor of the rollout batch {b} (groups of B/G rows; 0 means generation_pp)")


def _reshard(params: Any, model_cfg: Any, mesh: jax.sharding.Mesh) -> tuple[Any, float]:
  """`params` placed on `mesh` by their logical axes, and the seconds the transfer took."""
  t0 = time.perf_counter()
  out = mesh_lib.shard_params(params, llama.logical_specs(model_cfg), mesh)
  jax.block_until_ready(out)
  return out, time.perf_counter() - t0


class InstancesStage(FusedStage):
  """config.plan.generation='instances': generation on G = devices / generation_tp instances
  (generation/instances.py), inference on them after the last sample (generation/fused.py's
  baseline, `run(fuse=False)`), or fused with config.fusion.inter_stage. The actor is resharded
  onto the instances every call (timing_s/reshard_generation = timing_s/actor_to_instances).

  Bitwise the serial stage's outputs when an instance's shape is one training device's share of
  the serial batch (generation_tp=1, slots = batch / devices: the default); with
  generation_tp > 1 the logits are reduced over the instance's devices in another order, so the
  log-probs agree to float rounding (tests/test_plan.py)."""

  def __init__(self, cfg: TrainConfig, sampling: SamplingConfig, devices: Sequence[Any], **kw):
    super().__init__(cfg, sampling, devices, config=plan_instances_config(cfg, len(devices)),
                     fuse=cfg.fusion.inter_stage, **kw)

  def __call__(self, params: WholeParams, prompts: Prompts, key, *,
               rewards_only: bool = False) -> StageOutputs:
    out = super().__call__(params, prompts, key, rewards_only=rewards_only)
    out.metrics["timing_s/reshard_generation"] = out.metrics["timing_s/actor_to_instances"]
    return out


def planned_layout(plan: Any, num_devices: int) -> str:
  """PlannedStage's layouts over its `num_devices` devices (the training mesh's, or with
  async_ppo.generation_devices the generation group's) in one phrase, for the set-up log (a
  plan set by its fields, not by plan.file, was otherwise in config.json alone; the pipeline's
  idle devices nowhere)."""
  if plan.generation == "pipeline":
    pp = plan.generation_pp
    gen = (f"generation: one delayed inter-batch pipeline of {pp} stages x {plan.groups} groups "
           f"(config.plan.generation_pp, generation_groups) on the first {pp} of its "
           f"{num_devices} devices")
    if pp < num_devices:
      gen += f" (the other {num_devices - pp} idle while it generates)"
  else:
    gen = f"generation: on the mesh of its {num_devices} devices"
  inf = (f"a data={num_devices // plan.inference_tp} x tensor={plan.inference_tp} mesh of them "
         "(config.plan.inference_tp)" if plan.inference_tp else "the mesh of all of them")
  return f"{gen}; inference on {inf}"


class PlannedStage:
  """config.plan with generation 'mesh' or 'pipeline' and inference on the training mesh or a
  mesh of its own (plan.inference_tp > 0: data = devices / tp, tensor = tp).

  'pipeline' generates with one delayed inter-batch pipeline (generation/pipelined.py) on the
  first generation_pp devices (the plan's other replicas are not run yet: the engine has one),
  its stage-stacked actor resharded from the training layout each call
  (timing_s/reshard_generation). Then inference as in SerialStage, on the inference mesh: the
  frozen models are placed there once, the critic every call (timing_s/reshard_inference)."""

  def __init__(self, cfg: TrainConfig, sampling: SamplingConfig, mesh: jax.sharding.Mesh, *,
               reference: Any, rewards: scoring.Rewards, pad_id: int, actor_shapes: Any,
               use_critic: bool):
    plan, devices = cfg.plan, list(mesh.devices.flat)
    self.actor_cfg, self.critic_cfg, self.use_critic = cfg.model, cfg.critic_model, use_critic
    self.sampling, self.pad_id = sampling, pad_id
    self.pipe, self.generator = None, None
    b, p = cfg.rollout.batch_size, cfg.data.max_prompt_len
    logging.info("%s", planned_layout(plan, len(devices)))
    if plan.generation == "pipeline":
      self.pipe = pipelined.PipelinedGenerator(
          cfg.model, sampling, batch_size=b, prompt_len=p, stages=plan.generation_pp,
          groups=plan.groups, devices=devices,
          fields=("config.plan.generation_pp", "config.plan.generation_groups"))
    else:
      self.generator = instances.Generator(cfg.model, sampling, batch_size=b, prompt_len=p,
                                           mesh=mesh, params=actor_shapes)
    self.inf_mesh = None
    if plan.inference_tp:
      self.inf_mesh = mesh_lib.make_mesh(
          mesh_lib.MeshConfig(data=-1, tensor=plan.inference_tp), devices)
      if reference is not None:
        reference, _ = _reshard(reference, cfg.model, self.inf_mesh)
      if rewards.from_model:
        rewards = rewards.with_model_params(
            _reshard(rewards.model_params, rewards.model_cfg, self.inf_mesh)[0],
            scoring.Scorer(self.inf_mesh))
    self.reference, self.rewards = reference, rewards
    self.scorer = scoring.Scorer(self.inf_mesh or mesh)

  def __call__(self, params: WholeParams, prompts: Prompts, key, *,
               rewards_only: bool = False) -> StageOutputs:
    m: dict = {}
    # The whole actor's fetch (a pipelined state's gather, timing_s/reshard) stays outside the
    # stage clocks.
    actor = params("actor")
    if self.pipe is not None:
      t = time.perf_counter()
      staged = self.pipe.place(actor)
      del actor
      jax.block_until_ready(staged)
      m["timing_s/reshard_generation"] = time.perf_counter() - t
      t0 = time.time()  # timing_s/generate without the reshard (timed apart above)
      rollout = self.pipe.generate(staged, prompts.tokens, prompts.lens, key, uids=prompts.uids)
      del staged
      # From the tick table the program records: a function of the tokens only.
      m["gen/pipeline_stage_busy_frac"] = pipelined.busy_stats(
          rollout.decode_table)["stage_busy_frac"]
    else:
      t0 = time.time()
      rollout = self.generator.generate(actor, prompts.tokens, prompts.lens, key,
                                        uids=prompts.uids)
      del actor
    m["timing_s/generate"] = time.time() - t0

    def place_critic(critic, m):  # onto the inference mesh (timing_s/reshard_inference)
      if self.inf_mesh is None:
        return critic
      critic, m["timing_s/reshard_inference"] = _reshard(critic, self.critic_cfg, self.inf_mesh)
      return critic
    return score_rollout(self, rollout, params, prompts, m, place_critic, rewards_only)


def _no_overlap_reason(m: dict) -> str:
  """Why an iteration's inference overlapped none of the tail, where it could not (metrics of
  generation/fused.py; '' where they do not say): no instance was freed before the last sample
  finished (no consolidation, and every instance held a sample of the tail), or none of the
  freed ones had its weights in by then (a freed instance loads the reference, critic and
  reward models first: on a loaded CPU one load can outlast the whole tail after the
  consolidation; docs/architecture.md §2)."""
  if m.get("fusion/freed_before_gen_end") == 0:
    return " (no instance freed before generation ended)"
  if m.get("fusion/loaded_before_gen_end") == 0:
    return (f" ({m['fusion/freed_before_gen_end']} freed, none loaded its weights before "
            "generation ended)")
  return ""


def progress_summary(m: dict) -> str:
  """What the throughput features did in one iteration, for the progress line (from its
  metrics), '; '-joined: inter-stage fusion, 'gen: consolidated 8->2 instances at decode step 12
  (Rt=0.2), migrated 5 samples (40 kB KV), inference overlap 63%' or 'gen: no consolidation
  (Rt=0), inference overlap 0% (no instance freed before generation ended)' (a 0 % says why
  where it could not be more: `_no_overlap_reason`); delayed inter-batch pipelined generation,
  'gen pipeline: stages busy 83%'; asynchronous PPO, 'async: staleness 1 (policy 2), overlap
  61%' (the overlap only where the iteration generated ahead). Empty for an iteration with none
  of them (a synchronous run without fusion.inter_stage or a pipelined plan.generation)."""
  parts = []
  if "gen/migrated_samples" in m:
    rt = f"Rt={m['fusion/rt']:.2g}"
    if m["gen/migrated_samples"] > 0:
      kv = metrics_lib.size(m["gen/migrated_kv_bytes"])
      what = (f"consolidated {m['gen/consolidated_from']}->{m['gen/consolidated_to']} instances "
              f"at decode step {m['gen/consolidation_step']} ({rt}), migrated "
              f"{m['gen/migrated_samples']} samples ({kv} KV)")
    else:
      what = f"no consolidation ({rt})"
    overlap = f"{m['fusion/inference_overlap_frac']:.0%}"
    if overlap == "0%":
      overlap += _no_overlap_reason(m)
    parts.append(f"gen: {what}, inference overlap {overlap}")
  if "gen/pipeline_stage_busy_frac" in m:
    parts.append(f"gen pipeline: stages busy {m['gen/pipeline_stage_busy_frac']:.0%}")
  if "async/staleness" in m:
    what = f"async: staleness {m['async/staleness']} (policy {m['async/policy_version']})"
    if "perf/async_overlap_frac" in m:
      what += f", overlap {m['perf/async_overlap_frac']:.0%}"
    parts.append(what)
  return "; ".join(parts)
