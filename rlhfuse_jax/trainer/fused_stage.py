"""The trainer's generation+inference stage with inter-stage fusion (config.fusion.inter_stage).

`FusedStage` replaces the serial `PPOTrainer.generate_and_infer` body: it builds a
`generation.fused.FusedGenerator` over the trainer's devices and returns the very fields of
StageOutputs (same tokens, log-probs and scores as the serial path, bitwise when an instance's
shape matches a device's share of the serial batch: the defaults ensure it), plus the
docs/architecture.md §2 metrics.

Defaults (config.fusion): one instance per `instance_devices` devices, slots = batch /
instances, inference micro-batch = slots. The frozen models (reference, reward model) move to
host memory here and are placed on an instance only when it is freed for inference; the critic
is trained, so its current parameters are copied from the training devices each iteration.
The Rt histogram lives in the generator and restarts on resume (Rt changes timings only, never
the trajectory).
"""
from __future__ import annotations

import jax
import numpy as np

from rlhfuse_jax.generation import fused as fused_lib
from rlhfuse_jax.generation.instances import FrozenModels
from rlhfuse_jax.inference import scoring
from rlhfuse_jax.trainer import rt_auto


def fused_config(fusion, batch_size: int, num_devices: int) -> fused_lib.FusedGenConfig:
  """FusedGenConfig from config.fusion, with its 0 = automatic fields resolved."""
  g = fusion.num_instances or num_devices // fusion.instance_devices
  if g < 1:
    raise ValueError(f"config.fusion.instance_devices={fusion.instance_devices} exceeds the "
                     f"{num_devices} devices of the mesh")
  slots = fusion.slots or -(-batch_size // g)
  return fused_lib.FusedGenConfig(
      num_instances=g, slots=slots, instance_devices=fusion.instance_devices,
      migration_threshold=fusion.migration_threshold,
      max_consolidations=fusion.max_consolidations,
      inference_micro_batch=fusion.inference_micro_batch)


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


class FusedStage:
  """Generation + inference of one PPO iteration on fused instances."""

  def __init__(self, trainer):
    if jax.process_count() > 1:
      raise ValueError("config.fusion.inter_stage=True runs in a single process (instances "
                       "exchange KV rows with jax.device_put); got "
                       f"{jax.process_count()} processes")
    cfg = trainer.cfg
    self.trainer = trainer
    devices = list(trainer.mesh.devices.flat)
    self.config = fused_config(cfg.fusion, cfg.rollout.batch_size, len(devices))
    frozen = FrozenModels(reference=cfg.model,
                          critic=cfg.critic_model if trainer.use_critic else None,
                          reward=trainer.reward_cfg if cfg.reward.kind == "model" else None,
                          temperature=trainer.sampling.logprob_temperature)
    # Frozen weights live in host memory from now on (the serial path's device copies go).
    self.host = {"reference": jax.device_get(trainer.ref_params)}
    trainer.ref_params = None
    if frozen.reward is not None:
      self.host["reward"] = jax.device_get(trainer.reward_params)
      trainer.reward_params = None
    shapes = dict(self.host)
    if frozen.critic is not None:
      shapes["critic"] = trainer.model_shapes("critic")
    self.generator = fused_lib.FusedGenerator(
        cfg.model, trainer.sampling, self.config, batch_size=cfg.rollout.batch_size,
        prompt_len=cfg.data.max_prompt_len, frozen=frozen,
        actor_params=trainer.model_shapes("actor"),
        frozen_params=shapes, devices=devices, rt_model=rt_auto.simulated_rt_model)

  def __call__(self, records, prompt_tokens, prompt_lens, uids, gen_key) -> dict:
    """The fields of StageOutputs for this batch."""
    tr = self.trainer
    frozen = dict(self.host)
    if tr.use_critic:
      frozen["critic"] = tr.model_params("critic")
    out = self.generator.run(tr.model_params("actor"), frozen, prompt_tokens, prompt_lens,
                             gen_key, uids=uids, fuse=True)
    rollout = out.rollout
    batch = scoring.ScoringBatch.from_rollout(rollout, tr.tokenizer.pad_id)
    values = out.values if tr.use_critic else np.zeros(rollout.logprobs.shape, np.float32)
    if tr.reward_fn is not None:
      scores = np.asarray(tr.reward_fn(records, rollout.response_tokens, rollout.response_lens,
                                       tr.tokenizer), np.float32)
    else:
      scores = out.rewards
    metrics = dict(out.metrics)
    if out.rt_choice is not None:
      metrics["fusion/rt_simulated_s"] = {str(k): v for k, v in out.rt_choice.simulated_s.items()}
    return dict(rollout=rollout, batch=batch, ref_logp=out.ref_logp, values=values,
                scores=scores, metrics=metrics)
