"""A run's config as the plan search's workload, and the trainer's verdict on a searched plan
(`python -m experiments.plan_search --config=configs/plan_search.py:train`; docs/usage.md
"Per-stage plans").

`workload` turns a resolved TrainConfig into the simulator's Workload (sim/iteration_sim.py):
the actor's, the critic's and a reward model's shapes (sim/shapes.from_model_config), the
rollout batch, the mini-batch, the epochs and the max generation length of the run. Prompt
lengths are the training pool's tokenised prompts (at most data.max_prompt_len). Response
lengths are the task's target lengths plus the EOS (what a policy that solves the task
generates; an untrained one runs to rollout.max_new_tokens more often) for the task's own
prompts, and uniform in 1..rollout.max_new_tokens for data.prompts_file, whose lengths are not
known. Both are written as length files and sampled (with replacement) by the workload's seed.
The reward model (reward.kind='model') is simulated at its own shape and dtypes, its
checkpoint's config.json as the trainer reads it (build.reward_model_config: Workload.reward;
until 2026-12-04 the critic's shape, which the papers' presets keep); ppo_tiny's reward is a
function: no model.

`PlanCheck` asks the trainer itself whether it runs a plan: the plan written as plan.json and
set as config.plan.file, then what PPOTrainer does before it builds anything
(TrainConfig.from_config_dict, build.resolve_config, the device split of config.async_ppo,
config.mesh over the training devices, validate.validate). Nothing is allocated or compiled.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional, Sequence

import numpy as np

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.sim import iteration_sim
from rlhfuse_jax.sim.lengths import LengthSpec
from rlhfuse_jax.sim.shapes import from_model_config
from rlhfuse_jax.trainer import async_ppo as async_lib
from rlhfuse_jax.trainer import build
from rlhfuse_jax.trainer import plan_file as plan_file_lib
from rlhfuse_jax.trainer.config import TrainConfig
from rlhfuse_jax.trainer.validate import validate


def _lengths_file(path: str, lengths: np.ndarray) -> str:
  # Whole or not at all, an error naming the file: a full disk named none and left the file
  # cut, which the simulator reads.
  wd.atomic_write_text(path, " ".join(str(int(x)) for x in lengths) + "\n")
  return path


def workload(cfg: TrainConfig, task: Any, tokenizer: Any, num_devices: int, lengths_dir: str,
             micro_batch: int = 1, seed: int = 0, name: str = "run", dataset: Any = None
             ) -> tuple[iteration_sim.Workload, dict]:
  """(the Workload of `cfg`, resolved (build.resolve_config), on `num_devices` devices; what its
  lengths are, for reports). The prompt and response length files are written into
  `lengths_dir` (prompt_lengths.txt, response_lengths.txt). `dataset`: the run's
  build.build_dataset, when the caller has built it already (None: built here)."""
  if dataset is None:
    dataset = build.build_dataset(cfg, task, tokenizer)
  prompts = np.asarray(dataset.lengths, np.int64)
  prompt = LengthSpec(kind="empirical", min_len=1, max_len=cfg.data.max_prompt_len,
                      path=_lengths_file(os.path.join(lengths_dir, "prompt_lengths.txt"),
                                         prompts))
  t = cfg.rollout.max_new_tokens
  if cfg.data.prompts_file:
    response = LengthSpec(kind="uniform", min_len=1, max_len=t)
    source = f"uniform 1..{t} (data.prompts_file: lengths not known)"
    resp = None
  else:
    resp = np.minimum([len(task.target_ids(r)) for r in dataset.records], t).astype(np.int64)
    response = LengthSpec(kind="empirical", min_len=1, max_len=t,
                          path=_lengths_file(os.path.join(lengths_dir, "response_lengths.txt"),
                                             resp))
    source = f"the task's targets + EOS ({cfg.data.task}, {cfg.data.length_dist} lengths)"
  reward_cfg = build.reward_model_config(cfg)  # None: reward.kind='function'
  reward = (None if reward_cfg is None else
            from_model_config(reward_cfg, f"{name} reward model", dtypes=True))
  wl = iteration_sim.Workload(
      # the run's dtypes and optimizer state: its weights, AdamW state and KV cache as the
      # trainer holds them
      actor=from_model_config(cfg.model, f"{name} actor", dtypes=True,
                              master_weights=cfg.optim.master_weights),
      critic=from_model_config(cfg.critic_model, f"{name} critic", dtypes=True,
                               master_weights=cfg.optim.master_weights),
      num_devices=num_devices,
      global_batch=cfg.rollout.batch_size, minibatch=cfg.algo.minibatch_size,
      epochs=cfg.algo.epochs, micro_batch=micro_batch, max_new_tokens=t, prompt=prompt,
      response=response, seed=seed, reference=cfg.algo.uses_reference,
      reward_model=cfg.reward.uses_model, reward=reward,
      inference_micro_batch=cfg.fusion.inference_micro_batch,
      migration_rows=cfg.fusion.migration_rows,
      # what its lengths came from: plan.json records it, train_ppo compares the run's
      length_inputs=tuple(plan_file_lib.run_length_inputs(cfg).items()),
      # asynchronous PPO on the training devices: its copy of the actor for the next batch
      actor_copy=cfg.async_ppo.keeps_actor_copy,
      # a critic-free estimator (grpo, rloo, ...): the actor's training alone is searched
      trains_critic=cfg.algo.trains_critic)
  summary = lambda x: None if x is None else {"mean": float(np.mean(x)), "min": int(np.min(x)),
                                              "max": int(np.max(x))}
  info = {"prompt_lengths": summary(prompts), "response_lengths": summary(resp),
          "response_lengths_from": source, "lengths_dir": lengths_dir}
  return wl, info


def sim_options(opt: iteration_sim.SimOptions, cfg: TrainConfig) -> iteration_sim.SimOptions:
  """The search's options `opt` for the run `cfg`: its optim.offload_during_rollout (the AdamW
  state in host memory while generation and inference run) as sim.offload_optimizer, so that
  only the weights are kept beside them (plan_search.plan_memory); an asynchronous run's
  async_ppo.staleness as sim.staleness (the splits searched at another k were all refused by
  the trainer check, as conflicting with the run's value). The run's own values replace the
  config's, as its batches and lengths do; a synchronous run (staleness 0) keeps sim.staleness
  (a plan may make it asynchronous)."""
  staleness = cfg.async_ppo.staleness or opt.staleness
  return dataclasses.replace(opt, offload_optimizer=bool(cfg.optim.offload_during_rollout),
                             staleness=staleness)


class PlanCheck:
  """plan dict -> why the trainer refuses to run `config_dict` with it as config.plan.file on
  `devices` (the message of its ValueError), or None: a plan_search `accept`. The plan is
  written to `plan_dir`/plan_check.json for the check and removed after it."""

  def __init__(self, config_dict: Any, devices: Sequence[Any], tokenizer: Any, plan_dir: str):
    self.config = config_dict.to_dict() if hasattr(config_dict, "to_dict") else dict(config_dict)
    self.devices = list(devices)
    self.tokenizer = tokenizer
    self.path = os.path.join(plan_dir, "plan_check.json")

  def __call__(self, plan: dict) -> Optional[str]:
    with open(self.path, "w") as f:
      json.dump(plan, f)
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in self.config.items()}
    d["plan"] = {**d.get("plan", {}), "file": self.path}
    try:
      cfg = build.resolve_config(TrainConfig.from_config_dict(d), self.tokenizer, log=False)
      # a config's own fsdp that outgrows the plan's devices, named as train_ppo names it
      why = plan_file_lib.plan_fsdp_error(dataclasses.asdict(cfg.mesh), self.path)
      if why:
        raise ValueError(why)
      train_mesh, gen_mesh = async_lib.meshes(cfg, self.devices)
      validate(cfg, train_mesh, generation_devices=gen_mesh.devices.size)
    except ValueError as e:  # the file is this check's, not one the user wrote
      return str(e).replace(f"config.plan.file={self.path!r}",
                            "config.plan.file=<the searched plan>")
    finally:
      os.remove(self.path)
    return None
