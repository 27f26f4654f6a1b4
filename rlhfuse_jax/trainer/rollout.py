"""Stages 1-2 of a PPO iteration behind one interface (docs/architecture.md §1, §2).

A `RolloutStage` turns the current actor and critic parameters (`params(model)` gives a
model's whole parameters when the stage needs them, so a serial stage never holds the whole
actor and critic at once), a batch of prompts and a key into `StageOutputs`: the sampled
responses, the reference log-probs, the critic values and the rewards, as host arrays. Two
implementations return the same outputs:

  SerialStage  generation on the whole mesh, then reference / critic / reward inference
  FusedStage   inter-stage fusion (config.fusion.inter_stage): sample-level generation
               instances, long-tail consolidation, inference on the freed instances,
               overlapped (generation/fused.py); bitwise the serial outputs when an instance's
               shape matches a device's share of the serial batch (the defaults ensure it)

Both are built from configs, the frozen parameters (the reference, a reward model through
`scoring.Rewards`) and devices, never from the trainer. A stage owns the frozen models from then
on: the serial stage keeps them on the mesh; the fused stage keeps them in host memory and
places them on an instance only when it is freed for inference (its builder hands them over
already on the host, build.Models.frozen_to_host, so no device copy outlives setup).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import jax
import numpy as np

from rlhfuse_jax.generation import engine
from rlhfuse_jax.generation import fused as fused_lib
from rlhfuse_jax.generation import instances
from rlhfuse_jax.generation.instances import FrozenModels
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.inference import scoring
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
  ref_logp: np.ndarray  # [B, T] reference log-probs
  values: np.ndarray  # [B, T] critic values (zeros without a critic)
  scores: np.ndarray  # [B] sequence rewards
  metrics: dict  # timings (timing_s/generate, timing_s/inference) and stage-specific metrics


# params("actor") / params("critic"): a model's whole parameters, placed as generation and
# inference take them (for a pipelined run, gathered from the stage-stacked state on each call).
WholeParams = Callable[[str], Any]


class RolloutStage(Protocol):
  def __call__(self, params: WholeParams, prompts: Prompts, key: jax.Array) -> StageOutputs:
    """The critic is asked for only in a run with one (otherwise values are zeros)."""


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

  def __call__(self, params: WholeParams, prompts: Prompts, key) -> StageOutputs:
    t0 = time.time()
    # The whole actor lives only while generating, the whole critic only while scoring.
    rollout = self.generator.generate(params("actor"), prompts.tokens, prompts.lens, key,
                                      uids=prompts.uids)
    t_gen = time.time() - t0
    t0 = time.time()
    batch = scoring.ScoringBatch.from_rollout(rollout, self.pad_id)
    ref_logp = self.scorer.ref_logprobs(self.actor_cfg, self.reference, batch,
                                        self.sampling.logprob_temperature)
    values = (self.scorer.values(self.critic_cfg, params("critic"), batch)
              if self.use_critic else np.zeros(rollout.logprobs.shape, np.float32))
    scores = self.rewards(batch, prompts.records)
    return StageOutputs(rollout=rollout, batch=batch, ref_logp=ref_logp, values=values,
                        scores=scores, metrics={"timing_s/generate": t_gen,
                                                "timing_s/inference": time.time() - t0})


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
  if jax.process_count() > 1:
    raise ValueError("config.fusion.inter_stage=True runs in a single process (instances "
                     "exchange KV rows with jax.device_put); got "
                     f"{jax.process_count()} processes")
  fc = fused_config(cfg.fusion, cfg.rollout.batch_size, num_devices)
  fused_lib.check_layout(fc, cfg.rollout.batch_size, num_devices)  # the engine's own check
  return fc


class FusedStage:
  """Generation + inference of one PPO iteration on fused instances (docs/architecture.md §2).

  Defaults (config.fusion): one instance per `instance_devices` devices, slots = batch /
  instances, inference micro-batch = slots. The critic is trained, so its current parameters
  come with each call; the frozen models live in host memory. The Rt histogram lives in the
  generator and restarts on resume (Rt changes timings only, never the trajectory).
  """

  def __init__(self, cfg: TrainConfig, sampling: SamplingConfig, devices: Sequence[Any], *,
               reference: Any, rewards: scoring.Rewards, pad_id: int, actor_shapes: Any,
               critic_shapes: Optional[Any] = None):
    self.config = check_fusion(cfg, len(devices))
    self.pad_id, self.use_critic = pad_id, critic_shapes is not None
    frozen = FrozenModels(reference=cfg.model,
                          critic=cfg.critic_model if self.use_critic else None,
                          reward=rewards.model_cfg,
                          temperature=sampling.logprob_temperature)
    # The host copies this stage owns: an instance loads them when it is freed for inference.
    self.host = {"reference": jax.device_get(reference)}
    if rewards.from_model:
      self.host["reward"] = jax.device_get(rewards.model_params)
    self.rewards = rewards.without_model_params()
    shapes = dict(self.host)
    if self.use_critic:
      shapes["critic"] = critic_shapes
    self.generator = fused_lib.FusedGenerator(
        cfg.model, sampling, self.config, batch_size=cfg.rollout.batch_size,
        prompt_len=cfg.data.max_prompt_len, frozen=frozen, actor_params=actor_shapes,
        frozen_params=shapes, devices=list(devices), rt_model=rt_auto.simulated_rt_model)

  def __call__(self, params: WholeParams, prompts: Prompts, key) -> StageOutputs:
    # Both at once: the critic scores finished samples while the tail still decodes.
    frozen = dict(self.host)
    if self.use_critic:
      frozen["critic"] = params("critic")
    out = self.generator.run(params("actor"), frozen, prompts.tokens, prompts.lens, key,
                             uids=prompts.uids, fuse=True)
    rollout = out.rollout
    batch = scoring.ScoringBatch.from_rollout(rollout, self.pad_id)
    values = out.values if self.use_critic else np.zeros(rollout.logprobs.shape, np.float32)
    scores = (out.rewards if self.rewards.from_model else
              self.rewards.from_function(prompts.records, rollout.response_tokens,
                                         rollout.response_lens))
    metrics = dict(out.metrics)
    if out.rt_choice is not None:
      metrics["fusion/rt_simulated_s"] = {str(k): v for k, v in out.rt_choice.simulated_s.items()}
    return StageOutputs(rollout=rollout, batch=batch, ref_logp=out.ref_logp, values=values,
                        scores=scores, metrics=metrics)


def make_rollout_stage(cfg: TrainConfig, sampling: SamplingConfig, mesh: jax.sharding.Mesh, *,
                       reference: Any, rewards: scoring.Rewards, pad_id: int, actor_shapes: Any,
                       critic_shapes: Optional[Any]) -> RolloutStage:
  """The stage config.fusion.inter_stage asks for, over the mesh's devices."""
  if cfg.fusion.inter_stage:
    return FusedStage(cfg, sampling, list(mesh.devices.flat), reference=reference,
                      rewards=rewards, pad_id=pad_id, actor_shapes=actor_shapes,
                      critic_shapes=critic_shapes)
  return SerialStage(cfg, sampling, mesh, reference=reference, rewards=rewards, pad_id=pad_id,
                     actor_shapes=actor_shapes, use_critic=critic_shapes is not None)


def _fmt_bytes(n: float) -> str:
  for unit, scale in (("MB", 1e6), ("kB", 1e3)):
    if n >= scale:
      return f"{n / scale:.3g} {unit}"
  return f"{int(n)} B"


def progress_summary(m: dict) -> str:
  """What inter-stage fusion did in one iteration, for the progress line (from its metrics):
  'gen: consolidated 8->2 instances at step 12 (Rt=0.2), migrated 5 samples (40 kB KV),
  inference overlap 63%', or 'gen: no consolidation (Rt=0), inference overlap 0%'. Empty for
  an iteration without the fusion metrics (fusion.inter_stage off)."""
  if "gen/migrated_samples" not in m:
    return ""
  rt = f"Rt={m['fusion/rt']:.2g}"
  if m["gen/migrated_samples"] > 0:
    what = (f"consolidated {m['gen/consolidated_from']}->{m['gen/consolidated_to']} instances "
            f"at step {m['gen/consolidation_step']} ({rt}), migrated "
            f"{m['gen/migrated_samples']} samples ({_fmt_bytes(m['gen/migrated_kv_bytes'])} KV)")
  else:
    what = f"no consolidation ({rt})"
  return f"gen: {what}, inference overlap {m['fusion/inference_overlap_frac']:.0%}"
