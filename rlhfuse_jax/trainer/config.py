"""Typed, validated configuration of a PPO/GRPO run.

The ml_collections ConfigDict lives only at the binary boundary: `TrainConfig.from_config_dict`
converts it once, rejecting unknown fields and checking every value with an error that names the
dotted field and what was expected. Deeper code takes these frozen dataclasses.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import threading
from typing import Any, Collection, Mapping, Optional, Sequence

from rlhfuse_jax.data import rewards as rewards_lib
from rlhfuse_jax.fields import check as _check
from rlhfuse_jax.fields import check_int32
from rlhfuse_jax.fields import MAX_INT
from rlhfuse_jax.fields import is_int as _is_int
from rlhfuse_jax.fields import is_number as _is_number
from rlhfuse_jax.generation import fused as fused_lib
from rlhfuse_jax.generation import sampling
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel.mesh import MeshConfig
from rlhfuse_jax.policy import async_copies
from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.rl import kl as kl_lib
from rlhfuse_jax.rl import losses as losses_lib
from rlhfuse_jax.trainer import plan_file as plan_file_lib
# (a module without jax: experiments/bench_async.py checks its config against them)
from rlhfuse_jax.trainer.async_objectives import ASYNC_OBJECTIVES


# Field type -> (accepts the value?, what was expected). A bool field given the string "False"
# would be true; an integer field given 2.0 (a JSON plan) or 0.5 (a sweep) fails far from the
# config (range(2.0), a shape of 0.5); a float given "0.9" fails in a comparison that names no
# field. ml_collections' typed overrides refuse these on the command line, but plain dicts (a
# sweep's, a plan file's) and the dataclasses built directly reach the checks as given.
# A str field given a list or a number failed far away, naming no field ("unhashable type:
# 'list'", "'int' object has no attribute 'split'"); plan.file=True opened and then closed file
# descriptor 1, the process's stdout.
_TYPE_CHECKS = {
    "int": (_is_int, "an integer"),
    "bool": (lambda v: isinstance(v, bool), "True or False"),
    "float": (_is_number, "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


def _check_types(klass, section: Mapping[str, Any], prefix: str) -> None:
  """Refuses by name a value of the wrong type for an int, bool, float or str field of `klass`,
  or an int beyond fields.MAX_INT (before the section's own checks compare it; TrainConfig
  checks its own seed's range)."""
  for f in dataclasses.fields(klass):
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    if kind in _TYPE_CHECKS and f.name in section:
      ok, expected = _TYPE_CHECKS[kind]
      name = f"{prefix}.{f.name}" if prefix else f.name
      value = section[f.name]
      _check(ok(value), name, value, expected)
      if kind == "int":
        check_int32(name, value)


GRADIENT_SYNC_MODES = ("per_microbatch", "once")  # AlgoConfig.gradient_sync


@dataclasses.dataclass(frozen=True)
class DataConfig:
  task: str = "repeat"  # synthetic verifiable task (rlhfuse_jax.data.tasks.TASKS)
  # Training prompts: a JSONL file, a JSON array or parquet (data/records.py); empty: the task
  # makes the prompts.
  prompts_file: str = ""
  # The field holding a row's prompt, a string or a list of {"role", "content"} messages, and
  # the one holding its ground-truth answer, which reward functions get per sample. A dotted key
  # reads a nested field (verl's files: answer_key="reward_model.ground_truth").
  prompt_key: str = "prompt"
  answer_key: str = "target"
  # "none": prompts are plain text; "auto": the chat template next to init.tokenizer
  # (chat_template.jinja or tokenizer_config.json); or a path to a .jinja file, a
  # tokenizer_config.json or a directory. The generation prompt is added.
  chat_template: str = "none"
  val_file: str = ""  # held-out prompts (JSONL or parquet) for the validation pass (eval_every)
  val_fraction: float = 0.0  # or hold out this fraction of the training prompts (seeded split)
  val_max_prompts: int = 0  # validate on the first k held-out prompts; 0: all
  num_prompts: int = 4096  # prompts the task generates (ignored with prompts_file)
  length_dist: str = "uniform"  # task target lengths: "uniform" or "lognormal" (long tail)
  length_min: int = 1
  length_max: int = 8
  length_mu: float = 1.0  # lognormal parameters of the target length
  length_sigma: float = 0.8
  max_prompt_len: int = 8  # prompts are right-padded to this bucket; longer ones: below
  # A prompt longer than max_prompt_len tokens (after rendering): "error" stops the run naming
  # it; "skip" leaves it out of the pool (training and validation), logging how many.
  overlong_prompts: str = "error"

  def __post_init__(self):
    _check(self.num_prompts > 0, "data.num_prompts", self.num_prompts, "> 0")
    _check(self.length_dist in ("uniform", "lognormal"), "data.length_dist", self.length_dist,
           "'uniform' or 'lognormal'")
    _check(1 <= self.length_min <= self.length_max, "data.length_min/length_max",
           (self.length_min, self.length_max), "1 <= length_min <= length_max")
    # (data/lengths.py refuses them too, but when the task is built: after the workdir is
    # locked, as "sigma=-1.0: expected ...", naming no field of the config)
    _check(math.isfinite(self.length_mu), "data.length_mu", self.length_mu, "a finite value")
    _check(math.isfinite(self.length_sigma) and self.length_sigma > 0, "data.length_sigma",
           self.length_sigma, "a finite value > 0")
    _check(self.max_prompt_len > 0, "data.max_prompt_len", self.max_prompt_len, "> 0")
    _check(self.overlong_prompts in ("error", "skip"), "data.overlong_prompts",
           self.overlong_prompts, "'error' or 'skip'")
    for name in ("prompt_key", "answer_key", "chat_template"):
      _check(isinstance(getattr(self, name), str) and bool(getattr(self, name)), f"data.{name}",
             getattr(self, name), "a non-empty string")
    _check(0 <= self.val_fraction < 1, "data.val_fraction", self.val_fraction,
           "in [0, 1) (0: no split)")
    _check(not (self.val_file and self.val_fraction > 0), "data.val_fraction", self.val_fraction,
           f"0 when data.val_file={self.val_file!r} gives the held-out prompts (one or the other)")
    _check(self.val_max_prompts >= 0, "data.val_max_prompts", self.val_max_prompts,
           ">= 0 (0: every held-out prompt)")

  @property
  def has_validation_set(self) -> bool:
    return bool(self.val_file) or self.val_fraction > 0


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  prompts_per_iteration: int = 32  # B prompts per PPO iteration
  samples_per_prompt: int = 1  # n responses per prompt (GRPO groups need n > 1)
  max_new_tokens: int = 16
  temperature: float = 1.0
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1.0: off
  chunk_size: int = 8  # decode steps per jitted call (host checks `done` between chunks)
  # Decode steps between the device's "all rows done?" tests inside a chunk; > 1 runs them as
  # a fixed-trip-count loop (a GPU reads each test back to the host; generation/sampling.py).
  # Same tokens whatever its value; must divide chunk_size.
  steps_per_check: int = 1

  def __post_init__(self):
    _check(self.prompts_per_iteration > 0, "rollout.prompts_per_iteration",
           self.prompts_per_iteration, "> 0")
    _check(self.samples_per_prompt > 0, "rollout.samples_per_prompt", self.samples_per_prompt,
           "> 0")
    _check(self.max_new_tokens > 0, "rollout.max_new_tokens", self.max_new_tokens, "> 0")
    _check(math.isfinite(self.temperature) and self.temperature >= sampling.MIN_TEMPERATURE,
           "rollout.temperature", self.temperature,
           f"a finite value >= {sampling.MIN_TEMPERATURE:g} (smaller ones overflow float32)")
    _check(self.top_k >= 0, "rollout.top_k", self.top_k, ">= 0 (0 disables)")
    _check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "in (0, 1]")
    _check(self.chunk_size > 0, "rollout.chunk_size", self.chunk_size, "> 0")
    _check(self.steps_per_check > 0 and self.chunk_size % self.steps_per_check == 0,
           "rollout.steps_per_check", self.steps_per_check,
           f"a positive divisor of rollout.chunk_size={self.chunk_size}")

  @property
  def batch_size(self) -> int:
    return self.prompts_per_iteration * self.samples_per_prompt


OLD_LOGP_SOURCES = ("auto", "generation", "recompute")


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
  estimator: str = "gae"  # a name in rl/advantages.ADVANTAGE_ESTIMATORS (usage.md lists them)
  gamma: float = 1.0
  lam: float = 0.95
  kl_coef: float = 0.02  # weight of the KL to the reference
  kl_estimator: str = "k1"  # a name in rl/kl.KL_ESTIMATORS (usage.md lists them)
  kl_in_reward: bool = True  # True: token-level penalty folded into the reward; False: a loss term
  clip_eps: float = 0.2  # PPO ratio clip: the ratio is clipped to [1 - clip_eps, 1 + ...]
  # The upper clip, 1 + clip_eps_high; 0: clip_eps. Higher than clip_eps is DAPO's clip-higher
  # (Yu et al. 2025, arXiv 2503.14476: 0.28 with clip_eps 0.2), room for rare tokens to grow.
  clip_eps_high: float = 0.0
  # Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729): for negative advantages the loss is also
  # capped at -A * clip_ratio_c, so one huge ratio on a bad token cannot dominate the update;
  # 0: off, else >= the upper clip 1 + clip_eps_high (or clip_eps) (the paper and verl use 3).
  clip_ratio_c: float = 0.0
  value_clip_eps: float = 0.2  # clip of the value update around the old values; 0: unclipped
  vf_coef: float = 0.5
  entropy_coef: float = 0.0
  # Aggregation of the policy loss (rl/losses.py: token-mean, seq-mean-token-mean (GRPO's),
  # ...); the KL loss term, the entropy bonus and the value loss are token-means whatever this
  # is (verl aggregates GRPO's KL term like the policy loss instead).
  loss_agg: str = "token-mean"
  epochs: int = 2  # passes over the rollout per iteration
  minibatch_size: int = 32  # samples per optimizer step
  # Unpipelined update (mesh.stage = 1): rows each data shard (mesh data x fsdp coordinate) takes
  # through forward + backward at a time, the gradients accumulated over the micro-batches
  # (the same step up to float rounding, one micro-batch's activations in memory); it must
  # divide the rows per shard, and 0 or a value >= them takes the shard's whole share at once.
  # Pipelined updates ignore it (they split with pipeline.*_microbatches).
  microbatch_size: int = 0
  # How the accumulated update (microbatch_size splitting a shard) communicates on a mesh:
  # "per_microbatch", each micro-batch gathers the fsdp-split weights for its forward and
  # backward and reduces its gradients over the data shards (the least memory); "once", the
  # weights are gathered once per optimizer step and held, each data shard sums its own
  # micro-batches' gradients in float32, and the sums are reduced once (collectives 1/k of the
  # weights' traffic and of the gradients' for k micro-batches, for the weights' tensor share
  # gathered and its float32 sums in memory: docs/usage.md "Communication at scale").
  gradient_sync: str = "per_microbatch"
  # Balance mini-batch shards across data-parallel devices by tokens (rl/minibatch.py). The
  # update here runs static padded shapes, so it moves neither the step time nor the result
  # beyond float rounding; it pays where shards skip padding.
  balance_tokens: bool = True
  # Whiten a critic's (GAE's) advantages over the batch; the critic-free estimators set their
  # own scale (grpo within each prompt's group, reinforce_pp and reinforce_baseline over the
  # batch, dr_grpo and rloo not at all) and ignore it (docs/architecture.md §1).
  whiten_advantages: bool = True
  # PPO's old log-probs (the ratio's denominator and the KL penalty's policy side): "generation",
  # the behaviour log-probs the decode recorded (no extra pass); "recompute", one forward pass
  # of the actor on the training devices after generation (verl's and OpenRLHF's way); "auto":
  # recompute when the actor computes in a 16-bit dtype. In float32 the two agree to ~1e-6; in
  # bfloat16 the decode and the training forward round apart (a 16-layer stand-in: up to 0.36
  # per token, 0.7 % of tokens clipped before any update: docs/architecture.md §1).
  old_logp: str = "auto"

  def recomputes_old_logp(self, staleness: int, pipelined: bool, model: ModelConfig) -> bool:
    """Whether old_logp resolves to the recomputation for a run of async_ppo.staleness
    `staleness`, a pipelined update (mesh.stage > 1) or not, and actor `model`: "recompute",
    or "auto" with a 16-bit compute dtype and an unpipelined update; never asynchronously (the
    generating policy is gone). trainer/loop.py runs the pass; experiments/plan_programs.py
    compiles it (the `actor_logp` program)."""
    # "auto" leaves a pipelined update (mesh.stage > 1) the decode's: the pass runs the whole
    # model, not the update's staged program, and rounded as far from it as the decode (2-layer
    # bfloat16, first step ppo_kl 5.2e-5 recomputed, 1.9e-5 not), with the whole actor
    # gathered beside the training state.
    return staleness == 0 and (
        self.old_logp == "recompute" or
        (self.old_logp == "auto" and not pipelined and model.dtype in ("bfloat16", "float16")))

  def logprob_rows(self, recompute: bool, pipelined: bool, shards: int) -> int:
    """Rows per piece of the trainer's actor log-prob pass on the training devices (its
    Scorer's micro_batch_size; `shards`: the scorer mesh's batch shards): algo.old_logp's
    recomputation (`recompute`) before an unpipelined update in the update's micro-batches
    (microbatch_size rows a data shard), whose forward and backward the devices hold beside the
    training state, so a forward alone of as many rows fits where they do; else (async PPO's
    proximal log-probs, a pipelined update) the mini-batch."""
    micro = self.microbatch_size * shards
    if recompute and not pipelined and 0 < micro < self.minibatch_size:
      return micro
    return self.minibatch_size

  def __post_init__(self):
    _check(self.old_logp in OLD_LOGP_SOURCES, "algo.old_logp", self.old_logp,
           f"one of {list(OLD_LOGP_SOURCES)}")
    _check(self.estimator in adv_lib.ADVANTAGE_ESTIMATORS, "algo.estimator", self.estimator,
           f"one of {sorted(adv_lib.ADVANTAGE_ESTIMATORS)}")
    lacking = sorted(set(adv_lib.required_inputs(self.estimator)) - adv_lib.TRAINER_INPUTS)
    _check(not lacking, "algo.estimator", self.estimator,
           f"an estimator whose inputs the trainer passes: it needs {lacking} without a "
           f"default, and the trainer passes {sorted(adv_lib.TRAINER_INPUTS)} "
           "(trainer/ppo.advantages_and_returns)")
    _check(self.kl_estimator in kl_lib.KL_ESTIMATORS, "algo.kl_estimator", self.kl_estimator,
           f"one of {sorted(kl_lib.KL_ESTIMATORS)}")
    _check(self.loss_agg in losses_lib.LOSS_AGGREGATIONS, "algo.loss_agg", self.loss_agg,
           f"one of {sorted(losses_lib.LOSS_AGGREGATIONS)}")
    for name in ("kl_coef", "value_clip_eps", "vf_coef", "entropy_coef"):
      v = getattr(self, name)
      _check(math.isfinite(v) and v >= 0, f"algo.{name}", v, "a finite value >= 0")
    _check(0 <= self.gamma <= 1, "algo.gamma", self.gamma, "in [0, 1]")
    _check(0 <= self.lam <= 1, "algo.lam", self.lam, "in [0, 1]")
    _check(0 < self.clip_eps < 1, "algo.clip_eps", self.clip_eps,
           "in (0, 1) (the ratio is clipped to [1 - clip_eps, 1 + clip_eps])")
    _check(math.isfinite(self.clip_eps_high) and self.clip_eps_high >= 0, "algo.clip_eps_high",
           self.clip_eps_high, "0 (= algo.clip_eps) or a finite value > 0 (the upper clip is "
           "1 + clip_eps_high)")
    _check(self.clip_ratio_c == 0 or (math.isfinite(self.clip_ratio_c) and self.clip_ratio_c > 1),
           "algo.clip_ratio_c", self.clip_ratio_c, "0 (dual clip off) or a finite value > 1")
    # The cap is for ratios beyond the clip (one huge ratio on a bad token): below its upper
    # bound it also zeroes the gradient of negative-advantage tokens the clip leaves in
    # range (c = 1.1 with clip_eps 0.2: every such token whose ratio rose past 1.1).
    upper = 1 + (self.clip_eps_high or self.clip_eps)
    _check(self.clip_ratio_c == 0 or self.clip_ratio_c >= upper, "algo.clip_ratio_c",
           self.clip_ratio_c, f"0 (dual clip off) or >= the PPO clip's upper bound {upper:g} "
           f"(1 + algo.{'clip_eps_high' if self.clip_eps_high else 'clip_eps'}): a lower cap "
           "stops the gradient of negative-advantage tokens whose ratio is inside the clip "
           "range (the paper's c is 3)")
    # As a loss, k1's gradient (that of logp) has zero expectation on the policy's own samples
    # whatever the reference: it would add noise, not pull toward the reference (rl/kl.py).
    _check(self.kl_in_reward or self.kl_coef == 0 or self.kl_estimator != "k1",
           "algo.kl_estimator", self.kl_estimator,
           "'k3' (GRPO's), 'k2' or 'abs' when the KL is a loss term (algo.kl_in_reward=False): "
           "k1's gradient does not depend on the reference")
    for name in ("epochs", "minibatch_size"):
      v = getattr(self, name)
      _check(_is_int(v) and v > 0, f"algo.{name}", v, "an integer > 0")
    _check(_is_int(self.microbatch_size) and self.microbatch_size >= 0, "algo.microbatch_size",
           self.microbatch_size, "an integer >= 0 (0: no gradient accumulation)")
    _check(self.gradient_sync in GRADIENT_SYNC_MODES, "algo.gradient_sync", self.gradient_sync,
           f"one of {list(GRADIENT_SYNC_MODES)}")

  @property
  def uses_reference(self) -> bool:
    """Whether anything reads the reference model's log-probs: the KL penalty in the reward or
    the KL loss term, both weighted by kl_coef. With kl_coef=0 (DAPO's setting) the reference is
    neither built nor run, and the kl/ref_* metrics are not logged (docs/usage.md)."""
    return self.kl_coef > 0

  @property
  def trains_critic(self) -> bool:
    """Whether the estimator reads critic values, so the run builds, runs and trains a critic
    (GAE's); critic-free estimators (grpo, rloo, ...) leave config.critic_model unused."""
    return adv_lib.needs_critic(self.estimator)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  actor_lr: float = 1e-3
  critic_lr: float = 2e-3
  # Linear warm-up, in optimizer steps (algo.epochs * rollout batch / algo.minibatch_size per
  # iteration), not iterations: then the cosine to min_lr_ratio over schedule_iterations.
  warmup_steps: int = 10
  min_lr_ratio: float = 0.1  # cosine decays to this fraction of the peak
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  # Iterations the LR schedule spans (warmup + cosine). 0: num_iterations of the run's first
  # start, kept in its checkpoints, so raising num_iterations later continues the schedule's
  # floor (min_lr_ratio) instead of restarting the cosine.
  schedule_iterations: int = 0
  # True: both models' optimizer state (AdamW moments; the float32 copy of master_weights)
  # moves into the host memory beside each device (shard by shard, nothing gathered) while the
  # rollout generates and scores, and back before the update, so generation's KV cache may use
  # their HBM (verl's optimizer offload; docs/usage.md "Memory at scale"). The parameters stay.
  # Synchronous loop on the training devices only.
  offload_during_rollout: bool = False
  # 16-bit weights: keep a float32 copy of them and float32 moments in the optimizer state and
  # step that (rl/optim.float32_master; the weights are its rounding). Mixed precision as the
  # simulator's memory model assumes (16 bytes a parameter with bf16 weights and gradients).
  master_weights: bool = False
  # ZeRO stage 1: each model's optimizer state (AdamW moments, the float32 copy) split over the
  # devices that hold the same parameters (the data axis; a pipelined critic's replicas; fsdp,
  # tensor or stage for a leaf they leave whole) instead of repeated on each; the update
  # gathers the stepped weights (parallel/mesh.zero1_sharding; docs/usage.md "Memory at
  # scale"). The same values up to float rounding.
  zero1: bool = False

  def __post_init__(self):
    _check(self.schedule_iterations >= 0, "optim.schedule_iterations", self.schedule_iterations,
           ">= 0 (0: num_iterations of the first start)")
    for name in ("actor_lr", "critic_lr", "grad_clip"):
      v = getattr(self, name)
      _check(math.isfinite(v) and v > 0, f"optim.{name}", v, "a finite value > 0")
    _check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, ">= 0")
    _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
    _check(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "optim.weight_decay",
           self.weight_decay, "a finite value >= 0")


def stat_label(spec: str) -> str:
  """The metric label of a reward.stats entry: the function's name (after ':' and the last '.')."""
  return spec.rpartition(":")[2].rpartition(".")[2] or spec


MODEL_NORMALIZE = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  kind: str = "function"  # "function" (a Python verifier) or "model" (a scalar-head reward model)
  # "task": the data task's verifier; a name in data.rewards.REWARD_FUNCTIONS ("math", "gsm8k",
  # "target_match", ...); or a per-sample function by import path, "my_pkg.rewards:score",
  # called as score(response, answer, record) -> float.
  function: str = "task"
  # A second function added to the function's or the reward model's reward (same forms as
  # `function`: a format reward, "boxed_format"; a length penalty by import path); "": none.
  # The reward is function (or model) + format_weight * format; with it, the metrics also hold
  # each term's batch mean (reward/function_mean or reward/model_mean, reward/format_mean).
  format: str = ""
  format_weight: float = 1.0
  # Statistics of the responses that are not rewards: comma-separated functions of the same
  # forms, each measured per sample and logged as its batch mean, stats/<function>_mean (the
  # fraction that shows the work, a part's length; NaN for a sample without a value, left out of
  # the mean); "": none.
  stats: str = ""
  model_checkpoint: str = ""  # HF-style checkpoint dir of the reward model (kind="model")
  # OpenRLHF's reward normalisation, the model's score as (score - mean) / std with the `mean`
  # and `std` its reward-model trainer writes into config.json (OpenRLHF's PPO with
  # --normalize_reward, as its example scripts run): "auto" where config.json holds them (else
  # the raw score), "on" (config.json must hold them), "off" (the raw score). The run logs
  # which (trainer/build.reward_normalization).
  model_normalize: str = "auto"
  # OpenRLHF's --reward_clip_range: each sample's reward (the model's score after
  # model_normalize, plus any format term) clamped to (low, high) before the KL penalty and any
  # group baseline, for every estimator; the metrics' reward/* stay the unclamped rewards and
  # reward/clipped_frac counts the clamped share: "low,high" ("-10,10", OpenRLHF's default), or
  # "" (off).
  clip_range: str = ""

  @property
  def uses_model(self) -> bool:
    """Whether a reward model scores (kind='model'); a function's reward builds and runs none
    (trainer/build.reward_model_config)."""
    return self.kind == "model"

  def __post_init__(self):
    _check(self.kind in ("function", "model"), "reward.kind", self.kind, "'function' or 'model'")
    _check(self.kind != "model" or bool(self.model_checkpoint), "reward.model_checkpoint",
           self.model_checkpoint, "a checkpoint directory when reward.kind='model'")
    _check(self.model_normalize in MODEL_NORMALIZE, "reward.model_normalize",
           self.model_normalize, f"one of {list(MODEL_NORMALIZE)}")
    _check(self.model_normalize != "on" or self.kind == "model", "reward.model_normalize",
           self.model_normalize, "'auto' or 'off' when reward.kind='function' (it normalises a "
           "reward model's scores)")
    self._check_clip_range()
    _check(self.format != "task", "reward.format", self.format,
           "a reward function name or import path (the task's verifier is reward.function)")
    _check(math.isfinite(self.format_weight)
           and abs(self.format_weight) <= rewards_lib.FLOAT32_MAX,
           "reward.format_weight", self.format_weight,
           f"a finite number {rewards_lib.FLOAT32_RANGE}")
    labels = [stat_label(s) for s in self.stat_specs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    _check("task" not in self.stat_specs and not repeated, "reward.stats",
           self.stats, "comma-separated reward function names or import paths with distinct "
           "function names (the task's verifier is reward.function)" +
           (f"; {', '.join(repeated)} named twice" if repeated else ""))

  @property
  def clip_bounds(self) -> Optional[tuple[float, float]]:
    """clip_range as (low, high) floats; None when off ("")."""
    if not self.clip_range:
      return None
    low, high = (float(v) for v in self.clip_range.split(","))
    return low, high

  def _check_clip_range(self) -> None:
    """Checked, then written as repr(low),repr(high) ("-10.0,10.0"): "(-10, 10)" and "-10,10"
    fingerprint alike. A string, as reward.stats: a ConfigDict's tuple default reads back from
    defaults() and config.json as a list, which no --config flag can override."""
    expected = ('"" (off) or "low,high": two finite numbers within float32\'s range, low < '
                'high (OpenRLHF\'s --reward_clip_range, e.g. "-10,10")')
    _check(isinstance(self.clip_range, str), "reward.clip_range", self.clip_range, expected)
    text = self.clip_range.strip(" ()[]")
    parts = text.split(",") if text else []
    try:
      bounds = [float(v) for v in parts]
    except ValueError:
      bounds = []
    ok = not parts or (len(bounds) == 2 and bounds[0] < bounds[1] and all(
        math.isfinite(v) and abs(v) <= rewards_lib.FLOAT32_MAX for v in bounds))
    _check(ok, "reward.clip_range", self.clip_range, expected)
    object.__setattr__(self, "clip_range", ",".join(repr(v) for v in bounds))

  @property
  def stat_specs(self) -> list[str]:
    return [s.strip() for s in self.stats.split(",") if s.strip()]


@dataclasses.dataclass(frozen=True)
class InitConfig:
  actor_checkpoint: str = ""  # HF-style dir (config.json + safetensors); empty: random init
  critic_checkpoint: str = ""  # empty: a critic of shape critic_model, initialised from the seed
  tokenizer: str = ""  # tokenizer.json; empty: the task's own tokenizer


@dataclasses.dataclass(frozen=True)
class FusionConfig(fused_lib.FusionFields):
  """The two fusions of docs/architecture.md §2 (inter-stage) and §3 (intra-stage).

  The inter-stage fields and their checks are declared once, in generation/fused.py
  FusionFields (see there for the list), which the engine's FusedGenConfig shares. Here
  num_instances = 0 and slots = 0 mean automatic (the trainer's `fused_config` resolves them:
  FusedGenConfig.of(fusion, num_instances=..., slots=...)).
  """
  AUTOMATIC_LAYOUT = True  # a class attribute, not a field
  inter_stage: bool = False  # sample-level generation with long-tail consolidation (§2)
  intra_stage: bool = False  # fused actor/critic pipeline schedule (§3)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """Training over the mesh's `stage` axis (> 1): actor and critic through the fused pipeline
  executor (trainer/pipelined.py); fusion.intra_stage picks the searched fused schedule or
  serial 1F1B."""
  critic_pp: int = 0  # critic stages; 0: mesh.stage (one replica); must divide mesh.stage
  actor_microbatches: int = 4  # actor micro-batches per mini-batch data shard; 0: one row each
  # micro-batches per critic replica (mesh.stage / critic_pp of them); 0: one row each
  critic_microbatches: int = 4
  search_time_s: float = 2.0  # fused-schedule search budget, once per shape (then cached)
  # Or a budget of this many schedule evaluations instead (0: search_time_s): the search is then
  # deterministic for its seed, so two fresh runs find, compile and train the same schedule
  # (by wall clock each can find another of the same makespan, whose update rounds differently:
  # docs/usage.md, faults and resuming). The main job's 2 s made 380k-407k on 2 cores.
  search_evaluations: int = 0
  search_seed: int = 0  # seed of the fused-schedule search
  schedule_cache_dir: str = ""  # searched schedules; "": WORKDIR/cache/schedules
  # A fused schedule to run instead of a search: a schedule.json of experiments.schedule_search
  # (or a file of the cache) for this run's pipeline shape (mesh.stage, critic_pp, the
  # micro-batch counts; its durations may be any); "": search (or the cache's)
  schedule_file: str = ""
  xla_opt_level: int = -1  # XLA backend optimisation level of the pipelined update; -1: default

  def __post_init__(self):
    _check(isinstance(self.critic_pp, int) and self.critic_pp >= 0, "pipeline.critic_pp",
           self.critic_pp, "an integer >= 0 (0: mesh.stage)")
    for name in ("actor_microbatches", "critic_microbatches"):
      _check(isinstance(getattr(self, name), int) and getattr(self, name) >= 0,
             f"pipeline.{name}", getattr(self, name),
             "an integer >= 1, or 0 (one mini-batch row per micro-batch)")
    # (inf: the search never returned, and the run never started training)
    # (2**70 s never returned either: at most a day)
    _check(0 < self.search_time_s <= 86400, "pipeline.search_time_s", self.search_time_s,
           "a number of seconds > 0 and at most 86400 (a day)")
    # (the search refused a negative one when the update was built, in the set-up after the
    # workdir was locked, as "seed=-1 must be >= 0")
    _check(self.search_seed >= 0, "pipeline.search_seed", self.search_seed, ">= 0")
    _check(_is_int(self.search_evaluations) and 0 <= self.search_evaluations <= MAX_INT,
           "pipeline.search_evaluations", self.search_evaluations,
           "an integer >= 0 (0: the wall-clock budget pipeline.search_time_s) and < 2**31")
    # (XLA takes 0-3 as an int32 option: 2**70 failed the first update, after the set-up)
    _check(-1 <= self.xla_opt_level <= 3, "pipeline.xla_opt_level", self.xla_opt_level,
           "-1 (XLA's default) or a level 0-3")


PLAN_GENERATION_MODES = ("mesh", "instances", "pipeline")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """Per-stage parallel plans (docs/architecture.md §4, docs/usage.md "Per-stage plans"): each
  stage of an iteration on its own layout over the same devices, the weights resharded between
  layouts every iteration (timing_s/reshard_generation, timing_s/reshard_inference). Training
  keeps config.mesh (data x fsdp x stage x tensor) and config.pipeline; a plan file
  (`file`, the format of `python -m experiments.plan_search`) sets these fields and the mesh and
  pipeline fields its training plan maps to (trainer/plan_file.py). The defaults are today's
  single layout: generation and inference on the training mesh.

  Every field but `file` is in the checkpoint fingerprint: a layout moves work between devices,
  and a different number of rows per device or a tensor-parallel split can round the logits
  differently (the tokens are the same per-sample streams), so a run resumes bitwise only on
  the plan that wrote it."""
  file: str = ""  # a plan.json of experiments.plan_search; "": the fields below as given
  # Generation: "mesh" (the Generator on the training mesh), "instances" (G = devices /
  # generation_tp instances of generation_slots slots: generation/instances.py, the machinery of
  # inter-stage fusion, fused only with fusion.inter_stage) or "pipeline" (one delayed
  # inter-batch pipeline of generation_pp devices, generation_groups groups: generation/
  # pipelined.py; then inference as in "mesh").
  generation: str = "mesh"
  generation_tp: int = 1  # instances: devices (tensor parallel) per instance; pipeline: 1 only
  generation_slots: int = 0  # instances: slots per instance; 0: batch / instances
  generation_pp: int = 1  # pipeline: stages (one device each)
  generation_groups: int = 0  # pipeline: groups G >= generation_pp; 0: generation_pp
  # Inference (reference, critic, reward model): 0 on the training mesh; k > 0 on a mesh of
  # (data = devices / k) x (tensor = k) over the same devices. With generation="instances" it
  # runs on the instances (k must be 0 or generation_tp).
  inference_tp: int = 0
  # instances: > 1 scores on pipelines of that many freed instances, each holding one stage
  # of every inference model (the engine's fusion.inference_pp, generation/fused.py); 1 only
  # with the other modes.
  inference_pp: int = 1

  def __post_init__(self):
    _check(self.generation in PLAN_GENERATION_MODES, "plan.generation", self.generation,
           f"one of {PLAN_GENERATION_MODES}")
    for name, low in (("generation_tp", 1), ("generation_slots", 0), ("generation_pp", 1),
                      ("generation_groups", 0), ("inference_tp", 0), ("inference_pp", 1)):
      v = getattr(self, name)
      _check(_is_int(v) and v >= low, f"plan.{name}", v,
             f"an integer >= {low}")
    _check(self.inference_pp == 1 or self.generation == "instances", "plan.inference_pp",
           self.inference_pp, f"1 with plan.generation={self.generation!r} (inference on "
           "pipelines of instances runs on the generation instances: plan.generation="
           "'instances')")
    defaults = {f.name: f.default for f in dataclasses.fields(self)}
    owners = {"generation_pp": "pipeline", "generation_groups": "pipeline",
              "generation_slots": "instances"}
    if self.generation == "mesh":
      owners["generation_tp"] = "instances"
    for name, mode in owners.items():
      _check(self.generation == mode or getattr(self, name) == defaults[name], f"plan.{name}",
             getattr(self, name), f"its default {defaults[name]} with plan.generation="
             f"{self.generation!r} (a field of plan.generation={mode!r})")
    if self.generation == "pipeline":
      _check(self.generation_tp == 1, "plan.generation_tp", self.generation_tp,
             "1 with plan.generation='pipeline' (the pipelined engine runs one device per stage; "
             "tensor parallelism inside a stage is not implemented)")
      _check(self.groups >= self.generation_pp, "plan.generation_groups",
             self.generation_groups, f">= plan.generation_pp={self.generation_pp} (G >= pp: a "
             "group's token must be back at stage 0 when its turn comes), or 0 (= pp)")

  @property
  def groups(self) -> int:
    return self.generation_groups or self.generation_pp


@dataclasses.dataclass(frozen=True)
class AsyncPPOConfig:
  """Asynchronous PPO (docs/architecture.md §4, docs/usage.md "Asynchronous PPO"): batch i
  (counted from 0; the log's and metrics.jsonl's step i + 1) is generated by the policy after
  max(0, i - staleness) updates (async/policy_version), so that generation of the next
  batches overlaps training; the order of events is the schedule's (trainer/async_ppo.py), and
  a run is as reproducible and resumable as a synchronous one.

  generation_devices = g > 0 splits the devices into a generation group (generation and
  reference / reward inference, the first g devices; with several processes the first
  g / processes local devices of each) and a training group (config.mesh over the others); the
  actor is copied to the generation group after each update, and with staleness 0 the critic
  too (it scores there); with staleness >= 1 the training group scores the values with the
  current critic. 0: both on all
  devices, interleaved (no device overlap; the host's work still overlaps)."""
  staleness: int = 0  # 0: the synchronous loop; k >= 1: at most k updates between the policies
  generation_devices: int = 0
  # "behaviour": PPO's ratio against the generating policy's log-probs. "decoupled": AReaL's
  # objective (arXiv 2505.24298, eq. 5): the ratio against a proximal policy (the policy before
  # this iteration's updates, one forward pass), each token weighted by pi_prox / pi_behaviour.
  objective: str = "behaviour"
  # decoupled: tokens whose pi_prox / pi_behaviour exceeds the cap are dropped (weight 0), as
  # AReaL's behav_imp_weight_cap does; 0: no cap.
  behaviour_weight_cap: float = 5.0

  def __post_init__(self):
    for name in ("staleness", "generation_devices"):
      v = getattr(self, name)
      _check(_is_int(v) and v >= 0, f"async_ppo.{name}", v,
             "an integer >= 0")
    _check(self.objective in ASYNC_OBJECTIVES, "async_ppo.objective", self.objective,
           f"one of {ASYNC_OBJECTIVES}")
    _check(self.behaviour_weight_cap == 0 or self.behaviour_weight_cap > 1,
           "async_ppo.behaviour_weight_cap", self.behaviour_weight_cap, "> 1, or 0 (no cap)")

  @property
  def keeps_actor_copy(self) -> bool:
    """Whether the training devices keep a copy of the actor for each next batch's generation
    (PPOTrainer._snapshot), beside the update and through that generation: staleness > 0
    without a generation group (with one, the copy is the group's actor)."""
    return async_copies.keeps_actor_copy(self.staleness, self.generation_devices)


# checkpoint.export_hf: off, the source checkpoint's family, or one of hf_loader.FAMILIES
# (spelled out here: the config module reads no checkpoint code; a test keeps the two equal).
EXPORT_HF_CHOICES = ("", "auto", "llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 25  # save every k iterations (and at the end, and on SIGTERM/SIGINT)
  keep: int = 2  # checkpoints kept on disk
  # A latest checkpoint that cannot be read: True resumes from the newest intact one (with a
  # warning naming the damaged one, which is never deleted); False stops with the error.
  fallback: bool = True
  # When the run completes num_iterations, the actor as a Hugging Face checkpoint in
  # WORKDIR/hf_export (config.json + model.safetensors + the tokenizer's files), which
  # transformers and init.actor_checkpoint load. "": none; "auto": the family of
  # init.actor_checkpoint's config.json (else the one the model's shape implies); or a family.
  export_hf: str = ""
  # Comma-separated fields this start may change against the checkpoints' config, from
  # RESUME_CHANGEABLE (hyper-parameters that leave the saved state's layout as it is): e.g.
  # "optim.actor_lr,optim.grad_clip" to continue a run the NaN guard stopped with a lower
  # learning rate. Each change is logged; later checkpoints record the new values.
  resume_changes: str = ""

  @property
  def resume_changes_set(self) -> frozenset:
    return frozenset(x.strip() for x in self.resume_changes.split(",") if x.strip())

  def __post_init__(self):
    _check(isinstance(self.resume_changes, str), "checkpoint.resume_changes",
           self.resume_changes, f"a string: comma-separated fields of {sorted(RESUME_CHANGEABLE)}")
    bad = sorted(self.resume_changes_set - RESUME_CHANGEABLE)
    _check(not bad, "checkpoint.resume_changes", self.resume_changes,
           f"comma-separated fields of {sorted(RESUME_CHANGEABLE)}: "
           f"{_not_resume_changeable(bad)}")
    _check(self.every > 0, "checkpoint.every", self.every, "> 0")
    _check(self.keep > 0, "checkpoint.keep", self.keep, "> 0")
    _check(self.export_hf in EXPORT_HF_CHOICES, "checkpoint.export_hf", self.export_hf,
           f"one of {EXPORT_HF_CHOICES} ('': no export)")


GUARD_MODES = ("stop", "skip_update")


@dataclasses.dataclass(frozen=True)
class GuardConfig:
  """Non-finite values (docs/usage.md "Faults and resuming"): losses, gradient norms and
  parameters are checked every iteration. "stop": the run stops with an error naming the
  iteration and the quantity, before anything of that iteration is written or saved.
  "skip_update": an optimizer step whose gradients are not finite is skipped
  (optax.apply_if_finite); after max_consecutive_skips in a row the run stops as with "stop".

  iteration_timeout_s: a process whose iteration (with its validation pass and checkpoint
  save) has not finished within this many seconds writes every thread's stack to stderr and
  exits 69, as a lost peer does (trainer/hooks.HangWatchdog): a hung reward function, or a peer
  process that hangs (alive, so jax's heartbeat never fails) while the others wait in a
  collective. The first iteration compiles too. 0: never."""
  on_nonfinite: str = "stop"
  max_consecutive_skips: int = 10
  iteration_timeout_s: float = 0.0

  def __post_init__(self):
    _check(self.on_nonfinite in GUARD_MODES, "guard.on_nonfinite", self.on_nonfinite,
           f"one of {GUARD_MODES}")
    _check(self.max_consecutive_skips >= 1, "guard.max_consecutive_skips",
           self.max_consecutive_skips, ">= 1")
    t = self.iteration_timeout_s
    # At most the longest wait Python's timers take: the watchdog's Timer and faulthandler's
    # dump raised OverflowError (in the watchdog's thread: no timeout at all) above it.
    _check(_is_number(t) and 0 <= t <= threading.TIMEOUT_MAX, "guard.iteration_timeout_s", t,
           f"a number of seconds >= 0 and <= {threading.TIMEOUT_MAX:.0f} (Python's longest "
           "timer; 0: no timeout)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  seed: int
  num_iterations: int
  model: ModelConfig  # actor/reference shape (vocab_size 0: take it from the tokenizer)
  critic_model: ModelConfig  # critic/reward backbone shape (head is forced to "scalar")
  mesh: MeshConfig
  data: DataConfig
  rollout: RolloutConfig
  algo: AlgoConfig
  optim: OptimConfig
  reward: RewardConfig
  init: InitConfig
  fusion: FusionConfig
  checkpoint: CheckpointConfig
  pipeline: PipelineConfig = PipelineConfig()
  guard: GuardConfig = GuardConfig()
  plan: PlanConfig = PlanConfig()
  async_ppo: AsyncPPOConfig = AsyncPPOConfig()
  log_every: int = 1
  # Every log_every iterations (and after the last), the first k samples of the batch trained on
  # as text (prompt, response, reward) in WORKDIR/samples.jsonl: what the policy writes. 0: none.
  log_samples: int = 0
  # Every k iterations (and after the last), the reward on the held-out prompts (data.val_file
  # or data.val_fraction): val/* in metrics.jsonl and TensorBoard. 0: never.
  eval_every: int = 0
  # jax's persistent compilation cache for the train_ppo binary: a restart (a resume, a
  # requeued job) loads the programs the earlier start compiled instead of compiling them again.
  # "": WORKDIR/cache/xla; "none": off. A JAX_COMPILATION_CACHE_DIR the caller set wins.
  compilation_cache_dir: str = ""
  # How long a start waits for the workdir's lock when another host holds it (workdir.
  # WorkdirLock): a job requeued onto another node right after its node crashed finds the dead
  # node's lock on the shared filesystem until the server's lease on that node ends (NFSv4:
  # 90 s, up to about twice that). A holder on this host is alive and refuses at once. 0: never.
  lock_wait_s: float = 240.0
  vocab_from_tokenizer: bool = False  # set when model.vocab_size was 0 in the ConfigDict

  @property
  def min_devices(self) -> int:
    """The fewest devices the run needs: the mesh's fixed axes, plus an asynchronous run's
    generation group (apart from the mesh)."""
    return self.mesh.fixed_devices + self.async_ppo.generation_devices

  def with_vocab(self, vocab_size: int) -> "TrainConfig":
    """Resolves the vocabulary against the tokenizer's (0 in the config: take the tokenizer's)."""
    if self.vocab_from_tokenizer:
      return dataclasses.replace(
          self, model=self.model.replace(vocab_size=vocab_size),
          critic_model=self.critic_model.replace(vocab_size=vocab_size),
          vocab_from_tokenizer=False)
    _check(self.model.vocab_size >= vocab_size, "model.vocab_size", self.model.vocab_size,
           f">= the tokenizer's vocabulary ({vocab_size}), or 0 to take it from the tokenizer")
    _check(self.critic_model.vocab_size == self.model.vocab_size, "critic_model.vocab_size",
           self.critic_model.vocab_size, f"equal to model.vocab_size={self.model.vocab_size}")
    return self

  def __post_init__(self):
    _check(self.num_iterations > 0, "num_iterations", self.num_iterations, "> 0")
    # jax's random keys (the models' initialisation, sampling) keep a seed's low 32 bits only
    # (x64 off): 2**32 + 5 drew seed 5's models and tokens beside other prompts, and a seed
    # from 2**63 failed in set-up with an OverflowError.
    _check(isinstance(self.seed, int) and 0 <= self.seed < 2**32, "seed", self.seed,
           "an integer in [0, 2**32) (numpy seeds the prompt stream with it, jax's random keys "
           "its low 32 bits)")
    _check(self.log_every > 0, "log_every", self.log_every, "> 0 (log every k iterations)")
    _check(self.log_samples >= 0, "log_samples", self.log_samples,
           ">= 0 (samples written as text every log_every iterations; 0: none)")
    _check(self.eval_every >= 0, "eval_every", self.eval_every, ">= 0 (0: no validation pass)")
    _check(_is_number(self.lock_wait_s) and 0 <= self.lock_wait_s < float("inf"), "lock_wait_s",
           self.lock_wait_s,
           "a finite number of seconds >= 0 (0: a workdir locked from another host is refused "
           "at once)")
    _check(isinstance(self.compilation_cache_dir, str), "compilation_cache_dir",
           self.compilation_cache_dir, "a directory, '' (WORKDIR/cache/xla) or 'none'")
    _check(self.eval_every == 0 or self.data.has_validation_set, "eval_every", self.eval_every,
           "0 without held-out prompts: set data.val_file or data.val_fraction")
    b = self.rollout.batch_size
    _check(b % self.algo.minibatch_size == 0, "algo.minibatch_size", self.algo.minibatch_size,
           f"a divisor of the rollout batch prompts_per_iteration*samples_per_prompt={b}")
    if adv_lib.compares_groups(self.algo.estimator):
      _check(self.rollout.samples_per_prompt > 1, "rollout.samples_per_prompt",
             self.rollout.samples_per_prompt,
             f"> 1 for the group estimator algo.estimator={self.algo.estimator!r}")
    _check(not self.optim.offload_during_rollout or (
        self.async_ppo.staleness == 0 and self.async_ppo.generation_devices == 0),
           "optim.offload_during_rollout", True, "False with async_ppo.staleness > 0 or "
           "async_ppo.generation_devices > 0 (the moments move out while the training devices "
           "generate; asynchronously they train meanwhile, and a separate generation group "
           "holds no optimizer state)")
    # Each of the k batches in flight is held (a template per slot, in memory and in every
    # checkpoint): 2**30 asked for that many and failed in MemoryError; past the run's length
    # the slots never fill.
    _check(self.async_ppo.staleness <= self.num_iterations, "async_ppo.staleness",
           self.async_ppo.staleness, f"at most num_iterations={self.num_iterations} (the "
           "batches generated ahead are held in memory and checkpoints)")
    # Asynchronously the generating policy is gone when its batch trains; the decoupled
    # objective's proximal log-probs are the current actor's forward instead.
    _check(self.algo.old_logp != "recompute" or self.async_ppo.staleness == 0, "algo.old_logp",
           "recompute", "'auto' or 'generation' with async_ppo.staleness > 0 (the policy that "
           "generated a batch is updated before the batch trains; async_ppo.objective="
           "'decoupled' takes its ratio against the current actor's forward pass)")
    _check(not self.fusion.intra_stage or self.mesh.stage != 1, "fusion.intra_stage",
           self.fusion.intra_stage, "False with mesh.stage=1 (the fused actor/critic schedule "
           "pipelines both models over the mesh's stage axis: set mesh.stage > 1)")

  def fingerprint(self) -> dict[str, Any]:
    """Every field that shapes the trajectory, as {dotted name: JSON value}: stored in each
    checkpoint, compared on resume (`fingerprint_changes`). Fields a resumed run may change are
    in RESUMABLE_FIELDS."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, x: Any) -> None:
      if isinstance(x, dict):
        for k, v in x.items():
          walk(f"{prefix}{k}.", v)
      else:
        name = prefix[:-1]
        if name not in RESUMABLE_FIELDS:
          flat[name] = list(x) if isinstance(x, tuple) else x
    walk("", dataclasses.asdict(self))
    return json.loads(json.dumps(flat))  # as it reads back from a checkpoint (tuples -> lists)

  @classmethod
  def from_config_dict(cls, cd: Any, given: Collection[str] = ()) -> "TrainConfig":
    """The config of ConfigDict (or dict) `cd`, checked, with config.plan.file applied; `given`:
    the fields ("section.field") the command line set (a value equal to the default among them
    is the user's, not unset: plan_file.apply_plan_file)."""
    d = cd.to_dict() if hasattr(cd, "to_dict") else dict(cd)
    d = plan_file_lib.apply_plan_file(dict(d), _field_defaults(), given)
    cd_plan = d.get("plan")
    kwargs = {}
    for name, klass in SECTIONS.items():
      try:
        kwargs[name] = _build(klass, d.pop(name, {}), name)
      except ValueError as e:
        # A class the trainer shares with other code (MeshConfig) names its field without
        # "config.": "mesh.data=-2; expected a positive size or -1".
        msg = str(e) if str(e).startswith("config") else f"config.{e}"
        raise ValueError(plan_file_lib.attribute_to_plan(
            msg, (cd_plan or {}).get("file", ""))) from None
    model, critic = d.pop("model", {}), d.pop("critic_model", {})
    kwargs["vocab_from_tokenizer"] = model.get("vocab_size", 0) == 0
    # The critic reads the actor's token ids: with the actor's vocabulary from the tokenizer
    # (with_vocab) a critic's own vocab_size was replaced by it without a word.
    critic_vocab = (critic or {}).get("vocab_size", 0)
    _check(not kwargs["vocab_from_tokenizer"] or critic_vocab == 0, "critic_model.vocab_size",
           critic_vocab, "0 or unset with model.vocab_size=0 (the critic reads the actor's token "
           "ids: it takes the tokenizer's vocabulary too)")
    kwargs["model"] = _build_model(model, "model")
    kwargs["critic_model"] = _build_model({"vocab_size": model.get("vocab_size", 0), **critic},
                                          "critic_model", head="scalar")
    top = {f.name for f in dataclasses.fields(cls)} - set(kwargs)
    unknown = set(d) - top
    if unknown:
      raise ValueError(f"config: unknown top-level fields {sorted(unknown)}; known: {sorted(top)}")
    _check_required(cls, {**d, **kwargs}, "")
    _check_types(cls, d, "")
    return cls(**kwargs, **d)


# The config sections (ConfigDict key -> dataclass) besides the two model shapes.
SECTIONS = {
    "mesh": MeshConfig, "data": DataConfig, "rollout": RolloutConfig, "algo": AlgoConfig,
    "optim": OptimConfig, "reward": RewardConfig, "init": InitConfig, "fusion": FusionConfig,
    "checkpoint": CheckpointConfig, "pipeline": PipelineConfig, "guard": GuardConfig,
    "plan": PlanConfig, "async_ppo": AsyncPPOConfig,
}
# ... and with the two model shapes: every section of a TrainConfig.
_ALL_SECTIONS = {"model": ModelConfig, "critic_model": ModelConfig, **SECTIONS}

# Fields a resume may change when checkpoint.resume_changes names them: they change the
# trajectory from the restored iteration on, but not the layout of the saved state (the
# optimizer's chain is the same for any value: grad_clip stays > 0, the decay mask is fixed).
RESUME_CHANGEABLE = frozenset({
    "optim.actor_lr", "optim.critic_lr", "optim.grad_clip", "optim.weight_decay",
    "optim.min_lr_ratio", "algo.clip_eps", "algo.clip_eps_high", "algo.clip_ratio_c",
    "algo.value_clip_eps", "algo.vf_coef",
    "algo.entropy_coef", "algo.kl_coef",
    # The LR schedule's horizon: a run extended past it trains on the floor; a longer horizon
    # stretches the cosine from the restored step on (optax counts the steps, not the horizon).
    "optim.schedule_iterations",
    # How many finished samples an instance scores at once: only the inference's float rounding
    # moves (measured: reference log-probs within 2.4e-7 of micro-batch 0's), no state. A run
    # started before a micro-batch larger than the batch was refused could resume no other way.
    "fusion.inference_micro_batch",
    # The unpipelined update's gradient accumulation, the documented way out of an out-of-memory
    # update: the same step up to float rounding (a resume on micro-batches matches the
    # uninterrupted run's losses: tests/test_faults.py), the optimizer state as it was.
    "algo.microbatch_size",
    # Scoring on pipelines of instances: the same forward split into stages, run as a scan over
    # each stage's layers (inference/stages.py): float rounding only (tested to 1e-5).
    "fusion.inference_pp", "plan.inference_pp",
    # The update's other memory knobs, the same step up to float rounding and the same state:
    # what each decoder block keeps for its backward (recomputed, not kept: a resume with "full"
    # trained iterations 5-6 within 6e-8 of the run it was stopped from), and how the
    # accumulated update communicates ("once" holds the gathered weights and float32 sums: a
    # run out of memory with it resumes on "per_microbatch"; the same sums in another order).
    "model.remat", "critic_model.remat", "algo.gradient_sync",
    # The reward model's scale (OpenRLHF's mean/std in its config.json, or its raw scores): the
    # same state, a reward of another scale from then on, as a changed kl_coef is a deliberate
    # change of the objective.
    "reward.model_normalize",
    # The reward's clamp (OpenRLHF's --reward_clip_range): the same state, rewards bounded
    # otherwise from then on.
    "reward.clip_range",
})


def _field_names() -> set[str]:
  """Every config field's dotted name ('seed', 'optim.actor_lr', 'model.hidden_size')."""
  return {f.name for f in dataclasses.fields(TrainConfig) if f.name not in _ALL_SECTIONS} | {
      f"{sec}.{f.name}" for sec, klass in _ALL_SECTIONS.items()
      for f in dataclasses.fields(klass)}


def _not_resume_changeable(names: Sequence[str]) -> str:
  """What checkpoint.resume_changes says of the `names` it does not take: that a resume changes
  a RESUMABLE_FIELDS field without naming it, that no resume may change another field, or the
  closest field to a misspelled one. It said of each "others change the saved state's layout
  ...: start a new --workdir", num_iterations and a misspelled optim.critc_lr alike."""
  from rlhfuse_jax.trainer import inputs  # pylint: disable=import-outside-toplevel
  known = _field_names()
  free = [n for n in names if n in RESUMABLE_FIELDS]
  # An input's path: its files are compared, not the path (trainer/inputs.resume_changes)
  moved = [n for n in names if n in inputs.PATH_FIELDS]
  fixed = [n for n in names if n in known and n not in RESUMABLE_FIELDS and n not in moved]
  parts = []
  if free:
    parts.append(f"{', '.join(free)} need{'s' if len(free) == 1 else ''} no naming (a resume "
                 f"may change {'it' if len(free) == 1 else 'them'} freely)")
  if moved:
    parts.append(f"{', '.join(moved)} need{'s' if len(moved) == 1 else ''} no naming for a new "
                 "path (a resume takes the same files at another path; other files are "
                 "refused)")
  if fixed:
    parts.append(f"no resume may change {', '.join(fixed)} (the saved state's layout or what "
                 "the checkpoints mean: start a new --workdir)")
  for name in names:
    if name not in known:
      close = difflib.get_close_matches(name, sorted(known), n=1)
      parts.append(f"{name!r} is no config field" + (f" (did you mean {close[0]}?)"
                                                     if close else ""))
  return "; ".join(parts)


def resume_advice(changes: Sequence[str], named: frozenset = frozenset()) -> str:
  """What a refused resume tells the user to do about its changed fields (`changes`, each
  "field: old -> new"; `named`: checkpoint.resume_changes's fields): which of them can never
  change on a resume, and the exact flag that continues with the new values of the others. It
  listed every field resume_changes takes for all of them alike, algo.estimator's change too."""
  fields = sorted({c.split(":")[0] for c in changes})
  fixed = [f for f in fields if f not in RESUME_CHANGEABLE]
  may = [f for f in fields if f in RESUME_CHANGEABLE]
  advice = []
  if fixed:
    advice.append(f"No resume may change {', '.join(fixed)} (the saved state's layout or what "
                  f"the checkpoints mean): resume with the original value"
                  f"{'s' if len(fixed) > 1 else ''} or start a new --workdir")
  if may:
    flag = ",".join(sorted(set(named) | set(may)))
    advice.append(f"To continue with the new value{'s' if len(may) > 1 else ''} of "
                  f"{', '.join(may)}{' (the others restored)' if fixed else ''}, add "
                  f"--config.checkpoint.resume_changes={flag}, or resume with the original "
                  f"value{'s' if len(may) > 1 else ''}")
  return ". ".join(advice)


# Fields that do not change what a resumed run computes: how long it runs, how often it logs
# and saves, what it does when a checkpoint or a value goes bad.
RESUMABLE_FIELDS = frozenset({
    "num_iterations", "log_every", "log_samples", "checkpoint.every", "checkpoint.keep",
    "checkpoint.fallback",
    "checkpoint.export_hf",  # written after the last iteration; the trajectory is the same
    "checkpoint.resume_changes",  # what it allows is checked field by field (hooks.py)
    "guard.max_consecutive_skips", "guard.iteration_timeout_s", "pipeline.schedule_cache_dir",
    "compilation_cache_dir", "lock_wait_s",
    # The validation pass reads the policy and its own prompts; training never sees them.
    "eval_every", "data.val_file", "data.val_max_prompts",
    # Measured beside the reward, never added to it.
    "reward.stats",
    # The plan file's path: what it sets (plan.*, mesh.*, pipeline.critic_pp) is fingerprinted.
    "plan.file",
    # When the device tests "all rows done?": the same tokens, only the decode's host syncs.
    "rollout.steps_per_check",
    # Where the fused loop's host exchanges run and how long one may wait: the same values.
    "fusion.exchange_on", "fusion.exchange_timeout_s",
    # How many rows a migration moves at once: the same rows reach the same slots, in parts.
    "fusion.migration_rows",
    # Where the moments wait during the rollout: the same values come back (tested bitwise).
    "optim.offload_during_rollout",
    # Where the optimizer state lives: restored into the new placement, the same values up to
    # float rounding (the gradient norm sums in another order; tested allclose on the pipelined
    # update, test_trainer_pipelined.py); the resume says so in a warning.
    "optim.zero1",
    # The data axis: mesh.data=-1 sizes it from the device count, so a resume on other devices
    # is allowed (with a warning naming both layouts, trainer/loop.py); the same set explicitly
    # (8 -> 4 on a job back on fewer devices) was refused as a change of the saved layout. fsdp
    # and tensor split the same arrays: the state is restored into the new shardings (its
    # shapes checked, checkpointing.layout_mismatch); mesh.stage stacks it per stage: refused.
    "mesh.data", "mesh.fsdp", "mesh.tensor",
})


# Model fields the config does not set: the head is the role's; the critic's vocabulary is the
# actor's; where a reward model scores comes from its checkpoint's config.json.
_MODEL_FORCED = {"model": ("head", "score_pad_id"),
                 "critic_model": ("head", "vocab_size", "score_pad_id")}


def _declared_defaults() -> dict[str, dict[str, Any]]:
  """{section: {field: JSON default}} of every field that declares a default; section "" holds
  TrainConfig's own scalar fields. What defaults() and the fingerprint check both read."""
  out = {"": {f.name: f.default for f in dataclasses.fields(TrainConfig)
              if f.name not in _ALL_SECTIONS and f.default is not dataclasses.MISSING}}
  for sec, klass in _ALL_SECTIONS.items():
    out[sec] = {f.name: f.default for f in dataclasses.fields(klass)
                if f.default is not dataclasses.MISSING}
  return json.loads(json.dumps(out))  # tuples -> lists, as a ConfigDict or a checkpoint holds


def defaults() -> dict[str, Any]:
  """Every config field that has a default, at that default, as the nested dict a ConfigDict
  is made from: the one source of defaults (configs/*.py start from it and set only what their
  run changes, so a default lives here and nowhere else). Model shape fields without a default
  (hidden_size, num_layers, ...) and the top-level seed and num_iterations are the config's to
  set."""
  declared = _declared_defaults()
  out: dict[str, Any] = {k: v for k, v in declared.pop("").items()
                         if k != "vocab_from_tokenizer"}
  for sec, fields in declared.items():
    out[sec] = {k: v for k, v in fields.items() if k not in _MODEL_FORCED.get(sec, ())}
  return out


def fingerprint_changes(saved: Mapping[str, Any], now: Mapping[str, Any],
                        absent: Optional[Mapping[str, Any]] = None) -> list[str]:
  """'field: saved -> now' for every field whose value differs. A field the saved fingerprint
  lacks (added to the code since) counts only if it is not at its default, or, where `absent`
  names it, at the value the run had before the field existed (the run computes otherwise at
  the default: trainer/loop.py's ran_before_fields); one only the saved fingerprint has
  (removed from the code) cannot change the run any more."""
  defaults = _field_defaults()
  absent = absent or {}
  out = []
  for name in sorted(now):
    if name not in saved and name in absent:
      if now[name] != absent[name]:
        out.append(f"{name}: (absent: ran as {absent[name]!r}) -> {now[name]!r}")
      continue
    if name not in saved:
      if name in defaults and now[name] == defaults[name]:
        continue
      out.append(f"{name}: (absent) -> {now[name]!r}")
    elif saved[name] != now[name]:
      out.append(f"{name}: {saved[name]!r} -> {now[name]!r}")
  return out


def split_resume_changes(changes: Sequence[str], allowed: Collection[str]
                         ) -> tuple[list[str], list[str]]:
  """fingerprint_changes' `changes` ('field: saved -> now') as (those whose field `allowed`
  (checkpoint.resume_changes) lets a resume change, the rest), each in order: a resume's
  (hooks) and a sweep's up-front check (experiments/sweep.py) alike."""
  passed = [c for c in changes if c.split(":")[0] in allowed]
  return passed, [c for c in changes if c.split(":")[0] not in allowed]


def _field_defaults() -> dict[str, Any]:
  """{dotted name: JSON default} of every config field that has a default."""
  return {f"{sec}.{k}" if sec else k: v for sec, fields in _declared_defaults().items()
          for k, v in fields.items()}


def _check_required(klass, section: Mapping[str, Any], prefix: str) -> None:
  """A ValueError naming the fields of `klass` without a default that `section` lacks: the
  dataclass's own TypeError ("__init__() missing 1 required positional argument: 'seed'") named
  no config section and ended the binary in a traceback."""
  missing = [f.name for f in dataclasses.fields(klass) if f.name not in section and
             f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
  if missing:
    where = f"config.{prefix}." if prefix else "config."
    raise ValueError(f"{where[:-1]}: missing fields {missing}; expected a value for each (they "
                     f"have no default: set {', '.join(where + m for m in missing)})")


def _build(klass, section: Optional[Mapping[str, Any]], prefix: str):
  section = dict(section or {})
  known = {f.name for f in dataclasses.fields(klass)}
  unknown = set(section) - known
  if unknown:
    raise ValueError(f"config.{prefix}: unknown fields {sorted(unknown)}; known: {sorted(known)}")
  _check_required(klass, section, prefix)
  _check_types(klass, section, prefix)
  return klass(**section)


def _build_model(section: Mapping[str, Any], prefix: str, head: str = "lm") -> ModelConfig:
  section = dict(section or {})
  section["head"] = head
  # vocab_size 0 means "from the tokenizer": a placeholder until TrainConfig.with_vocab.
  if section.get("vocab_size", 0) == 0:
    section["vocab_size"] = 1
  try:
    return _build(ModelConfig, section, prefix)
  except ValueError as e:
    msg = str(e)  # ModelConfig's own checks say "model."; _build's name the prefix already
    if not msg.startswith(f"config.{prefix}"):
      msg = model_fields_named(msg, prefix)
    raise ValueError(msg) from None


def model_fields_named(msg: str, prefix: str) -> str:
  """ModelConfig's error `msg` with every field it names ("model.num_heads") spelled as the
  command line does for the section `prefix` ("config.critic_model.num_heads"): the critic's
  num_kv_heads was "model.num_kv_heads", the actor's, in "critic_model.num_heads=3 must be a
  multiple of model.num_kv_heads=2"."""
  return re.sub(r"(?<![\w.])model\.", f"config.{prefix}.", msg)


def config_record(config_dict: Any, cfg: TrainConfig) -> dict:
  """What config.json records: the config as given and, with config.plan.file, the plan file's
  content (under "plan_file_content"; its path is config.plan.file), so the run says which
  layout it ran even after the file changed."""
  out = config_dict.to_dict() if hasattr(config_dict, "to_dict") else dict(config_dict)
  if cfg.plan.file:
    out["plan_file_content"] = plan_file_lib.load_plan_file(cfg.plan.file)
  return out
