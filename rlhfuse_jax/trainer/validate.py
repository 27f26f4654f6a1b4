"""Every check of a run's config against its mesh, in one place, before anything is built.

`TrainConfig` checks each field on its own when it is constructed (trainer/config.py); what
needs the mesh or several sections together is checked here, on the resolved config
(trainer/build.resolve_config), so a bad run stops in seconds with an error that names the
field, not minutes later inside a compile. The builders keep their own asserts as a second line
of defence; this is where a user's mistake is caught first.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Collection, Optional, Sequence

import jax
import jax.numpy as jnp
from absl import logging

from rlhfuse_jax.generation import fused as fused_lib
from rlhfuse_jax.inference import stages as inf_stages
from rlhfuse_jax.models import hf_loader
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.trainer import build, hf_export, pipelined, ppo, rollout
from rlhfuse_jax.trainer.config import TrainConfig


def set_fields(cfg: TrainConfig, section: str,
               names: Optional[Sequence[str]] = None) -> list[str]:
  """'section.name=value' for each of `names` (default: every field of the section) that the
  config sets away from its default."""
  obj = getattr(cfg, section)
  defaults = {f.name: f.default for f in dataclasses.fields(obj)}
  return [f"{section}.{n}={getattr(obj, n)!r}" for n in (names or defaults)
          if getattr(obj, n) != defaults[n]]


def warn_unused(fields: Sequence[str], why: str) -> None:
  """One warning for fields a config sets that this run does not use (when there are any)."""
  if fields:
    logging.warning("config.%s not used: %s", ", config.".join(fields), why)


def _critic_free_unused(cfg: TrainConfig) -> list[str]:
  """The fields a critic-free estimator ignores that this config sets away from their defaults
  (a critic checkpoint that is never loaded, a GAE lambda that changes nothing). Not
  optim.critic_lr: presets carry one rate for all their variants."""
  if adv_lib.needs_critic(cfg.algo.estimator):
    return []
  # lambda and the discount read from the registry: a group estimator compares one score per
  # sample (no discounting), and so does any estimator of the scores alone (a batch-mean
  # baseline, found unwarned); a critic-free estimator that takes lam (a lambda-return) was
  # warned of as ignoring it.
  inputs = adv_lib.get_estimator(cfg.algo.estimator).inputs
  algo = [f for f in ("lam", "vf_coef", "value_clip_eps", "whiten_advantages", "gamma")
          if f not in inputs]
  return set_fields(cfg, "algo", algo) + set_fields(cfg, "init", ["critic_checkpoint"])


def _reward_unused(cfg: TrainConfig) -> list[str]:
  """reward.function set with a reward model, which scores every sample in its place (a config
  made for a verifier, switched to reward.kind='model', kept it in its config.json silently;
  reward.format adds to the model's score)."""
  # An empty function is the way to clear a preset's (configs/ppo_hf.py's gsm8k): not a setting
  # that goes unused (it was warned of as one).
  if cfg.reward.kind != "model" or not cfg.reward.function:
    return []
  return set_fields(cfg, "reward", ["function"])


def _unused_beside_switch(cfg: TrainConfig, given: Collection[str], switch: str, section: str,
                          names: Sequence[str]) -> list[str]:
  """set_fields(cfg, section, names) of fields a `switch` leaves unused, but where the command
  line set the switch (turned it off) only those it also set: the others are the config file's,
  set beside the switch the user turned off, not settings of the user's that go unused."""
  if switch in given:
    names = [n for n in names if f"{section}.{n}" in given]
  return set_fields(cfg, section, names) if names else []


def _format_weight_unused(cfg: TrainConfig, given: Collection[str]) -> list[str]:
  """reward.format_weight set without a reward.format, unless the command line cleared the
  format and left the weight alone: then the weight is the config file's, set beside the format
  the user turned off (configs/ppo_hf.py's 0.1 beside gsm8k_format: --config.reward.format=''
  was warned of as leaving it unused, although the user set no weight)."""
  if cfg.reward.format:
    return []
  return _unused_beside_switch(cfg, given, "reward.format", "reward", ["format_weight"])


def _validation_unused(cfg: TrainConfig, given: Collection[str]) -> list[str]:
  """The held-out set's fields with eval_every=0, unless the command line turned evaluation off
  and left them alone (configs/ppo_hf.py's val_file and val_max_prompts: --config.eval_every=0
  was warned of as leaving them unused, although the user set neither). data.val_fraction is
  said whoever set it: it still holds its prompts out of training."""
  return (set_fields(cfg, "data", ["val_fraction"]) +
          _unused_beside_switch(cfg, given, "eval_every", "data", ["val_file", "val_max_prompts"]))


def _task_prompt_fields(cfg: TrainConfig) -> list[str]:
  """The data fields that shape the task's generated prompts (their count and target lengths)
  that this config sets away from their defaults beside data.prompts_file, which replaces those
  prompts: --config.data.num_prompts=64 with a prompts file trained on the whole file without a
  word. data.length_max also sizes the task's vocabulary, the run's tokenizer without
  init.tokenizer: then it is used."""
  names = ["num_prompts", "length_dist", "length_min", "length_mu", "length_sigma"]
  if cfg.init.tokenizer:
    names.append("length_max")
  return set_fields(cfg, "data", names)


def _fusion_unused(cfg: TrainConfig) -> list[str]:
  """The inter-stage fusion fields (generation/fused.FusionFields: the instances, Rt, the
  consolidations) that a run without fusion.inter_stage ignores: --config.fusion.num_instances=4
  alone generated serially without a word. With plan.generation='instances' (the instances
  without fusion) only Rt and the consolidations' count."""
  if cfg.fusion.inter_stage:
    return []
  if cfg.plan.generation == "instances":
    # The same instances without fusion: the baseline (FusedGenerator.run(fuse=False)) never
    # consolidates, so Rt and the consolidations' count steer nothing (the layout fields are
    # refused: rollout.plan_instances_config).
    return set_fields(cfg, "fusion", ["migration_threshold", "max_consolidations"])
  return set_fields(cfg, "fusion", [f.name for f in dataclasses.fields(fused_lib.FusionFields)])


def _uneven_tensor_split(cfg: TrainConfig, mesh: jax.sharding.Mesh) -> None:
  """A mesh.tensor that does not divide a trained model's query heads or MLP width is said so.
  An MLP width it does not divide stays whole on every tensor device (parallel/mesh.py
  replicates what its axis does not divide, logged at INFO only): the devices repeat that
  work. Query heads it does not divide are split mid-head where it divides heads x head_dim
  (the projections' columns), and the attention between the projections cannot give each
  device whole heads: XLA reshards or repeats part of it. KV heads fewer than the devices are
  GQA's usual copies, not warned of. (The pipelined update refuses all of it:
  pipelined.check_config.)"""
  tp = mesh.shape["tensor"]
  if tp == 1 or mesh.shape["stage"] > 1:
    return
  for section, model, _ in _trained_models(cfg):
    bad = [f"{f}={getattr(model, f)}" for f in ("num_heads", "intermediate_size")
           if getattr(model, f) % tp]
    if bad:
      logging.warning("config.mesh.tensor=%d does not divide config.%s.%s: the %d tensor "
                      "devices cannot each take whole heads or an even share of the MLP, so "
                      "part of every layer's work is repeated or resharded instead of split; "
                      "use a tensor size that divides them", tp, section,
                      f", config.{section}.".join(bad), tp)


def _async_unused(cfg: TrainConfig) -> None:
  """async_ppo fields that change nothing in a synchronous run (staleness 0) are said so; a
  device split without staleness is a synchronous loop on split devices (what bench_async's
  timing compares against), so it is only noted. With staleness, the behaviour objective
  drops no token, so a cap set beside it is said to do nothing too."""
  if cfg.async_ppo.staleness:
    if cfg.async_ppo.objective == "behaviour":
      warn_unused(set_fields(cfg, "async_ppo", ["behaviour_weight_cap"]),
                  "async_ppo.objective='behaviour' drops no token (the cap applies to the "
                  "'decoupled' objective's weights)")
    k, n = cfg.async_ppo.staleness, cfg.num_iterations
    if k >= n - 1:  # (ran without a word) batch i (from 0): the policy after max(0, i - k)
      logging.warning(
          "config.async_ppo.staleness=%d with num_iterations=%d: all %d batches are generated "
          "by the initial policy (%s), so nothing the run learns is sampled; lower "
          "async_ppo.staleness below num_iterations - 1", k, n, n,
          "before the first update: generation overlaps no training" if k >= n else
          "the last while the first update trains")
    return
  warn_unused(set_fields(cfg, "async_ppo", ["objective", "behaviour_weight_cap"]),
              "no effect with config.async_ppo.staleness=0 (every batch comes from the current "
              "policy)")
  if cfg.async_ppo.generation_devices:
    logging.info("async_ppo.generation_devices=%d with staleness 0: generation and training "
                 "on separate devices, one after the other", cfg.async_ppo.generation_devices)


def _trained_models(cfg: TrainConfig) -> list[tuple[str, Any, float]]:
  """(section, model config, learning rate) of each model the run trains."""
  out = [("model", cfg.model, cfg.optim.actor_lr)]
  if adv_lib.needs_critic(cfg.algo.estimator):
    out.append(("critic_model", cfg.critic_model, cfg.optim.critic_lr))
  return out


def _low_precision_trained(cfg: TrainConfig) -> list[tuple[str, Any, float]]:
  """_trained_models' entries whose weights are a 16-bit float."""
  if cfg.optim.master_weights:  # stepped in float32 (rl/optim.float32_master)
    return []
  return [(s, m, lr) for s, m, lr in _trained_models(cfg)
          if jnp.finfo(m.param_dtype).bits == 16]


def _half_spacing(x: float, dtype: Any) -> float:
  """Half the spacing of `dtype`'s values around `x` > 0: the smallest step that changes a
  weight of magnitude `x` once rounded to `dtype` (for 0.02 in bfloat16, 2**-14 = 6.1e-5; x
  times 2**-(nmant + 1), 7.8e-5, took the magnitude for the power of two below it)."""
  return 2.0 ** (math.floor(math.log2(x)) - jnp.finfo(dtype).nmant - 1)


# The learning rates PPO/GRPO fine-tuning of a pretrained LLM uses: the public trainers'
# defaults for the policy are 1e-6 (TRL GRPOConfig.learning_rate; OpenRLHF
# --actor_learning_rate; verl actor_rollout_ref.actor.optim.lr), their critics' 9e-6 (OpenRLHF)
# and 1e-5 (verl), and this repository's fine-tuning presets use 1e-6 (configs/ppo_hf.py
# :ppo_gpu). An actor loaded from a checkpoint and stepped at more than FINE_TUNE_LR_MAX (the
# toy ppo_hf run's 1e-4 on a random model is the most this repository uses) is most likely a
# from-scratch rate left in place (ppo_tiny's 3e-3): a warning, not an error (a user may mean it).
FINE_TUNE_LR_MAX = 1e-4
FINE_TUNE_LR_RANGE = "1e-6 .. 1e-5"


def warn_fine_tune_lr(cfg: TrainConfig) -> Optional[str]:
  """Logs (and returns) one warning when the actor starts from init.actor_checkpoint and
  optim.actor_lr exceeds FINE_TUNE_LR_MAX, naming the field, its value and the usual range."""
  lr = cfg.optim.actor_lr
  if not cfg.init.actor_checkpoint or lr <= FINE_TUNE_LR_MAX:
    return None
  text = (f"config.optim.actor_lr={lr:g} fine-tunes the pretrained actor of "
          f"config.init.actor_checkpoint={cfg.init.actor_checkpoint!r} at a from-scratch rate: "
          f"PPO/GRPO fine-tuning usually runs at {FINE_TUNE_LR_RANGE} (TRL, OpenRLHF and verl "
          f"default to 1e-6; configs/ppo_hf.py:ppo_gpu uses 1e-6): at 1e-3 even the toy "
          "configs/ppo_hf.py run drifted to a KL of ~6 from its reference within 20 iterations. "
          "Lower it unless you mean it")
  logging.warning("%s", text)
  return text


def check_checkpoint_positions(cfg: TrainConfig) -> None:
  """The actor's and critic's context is the config's (model.max_seq_len), but a checkpoint was
  trained on its config.json's positions only: rotary positions past them are ones its weights
  never saw, so a run that needs them is refused, as a reward model's shorter context is.
  (Also plan_check's --run_config: it said "fits" for a run train_ppo refuses.)"""
  context = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
  for field, needed in (("actor_checkpoint", True),
                        ("critic_checkpoint", adv_lib.needs_critic(cfg.algo.estimator))):
    path = getattr(cfg.init, field)
    if not path or not needed:
      continue
    positions = build.load_named(f"init.{field}", path, hf_loader.max_positions)
    if context > positions:
      raise ValueError(f"config.data.max_prompt_len + config.rollout.max_new_tokens = {context} "
                       f"exceeds the max_position_embeddings={positions} that config.init."
                       f"{field}={path!r} was trained on: a prompt and its response must fit "
                       "its positions")


def check_trained_dtypes(cfg: TrainConfig) -> None:
  """Refuses a trained model (the actor; the critic when the estimator trains one) whose dtype
  or param_dtype is float16, naming the field. Also plan_check's and plan_search's --run_config
  (plan_check compiled such a run and said it fits, where train_ppo refuses it)."""
  for section, model, _ in _trained_models(cfg):
    check_trained_dtype(model, f"config.{section}")


def check_trained_dtype(model: Any, field: str) -> None:
  """Refuses one trained model (`field`: the config section that sets it, as the error names
  it: config.model, or plan_check's config.actor) whose dtype or param_dtype is float16."""
  for name in ("dtype", "param_dtype"):
    if jnp.dtype(getattr(model, name)) == jnp.float16:
      # Measured on a 4-layer actor: 51 % of the gradient entries subnormal at 16k response
      # tokens a mini-batch (a token-mean loss divides the cotangents by the token count);
      # fp16 AdamW's second moment underflows to 0 and its first step sets weights to inf.
      raise ValueError(
          f"{field}.{name}='float16': a trained model in float16 needs loss "
          "scaling, which this trainer does not do (its gradients underflow, and float16 "
          "AdamW moments divide by 0); use 'bfloat16' (the same memory, float32's range) or "
          "'float32'")


def validate(cfg: TrainConfig, mesh: jax.sharding.Mesh,
             generation_devices: Optional[int] = None, weights: bool = True,
             given: Collection[str] = ()) -> None:
  """Raises ValueError naming the config field for a run this mesh cannot do. `mesh` is the
  training mesh; generation and inference run on `generation_devices` devices (default: the
  mesh's; fewer with async_ppo.generation_devices). weights=False: an export's, which reads no
  HF checkpoint's weights (build.reward_model_config). `given`: the fields the command line set
  ("reward.format"; train_ppo's --config.* flags), which tells a setting of the user's from the
  config file's (_format_weight_unused, _validation_unused)."""
  check_trained_dtypes(cfg)
  n_gen = mesh.devices.size if generation_devices is None else generation_devices
  g = cfg.async_ppo.generation_devices
  train_group = (f"; the training group: the devices left by config.async_ppo."
                 f"generation_devices={g}" if g else "")
  mult = mesh_lib.batch_size_multiple(mesh)
  for name, value in (("rollout.prompts_per_iteration*samples_per_prompt",
                       cfg.rollout.batch_size), ("algo.minibatch_size", cfg.algo.minibatch_size)):
    if value % mult:
      # A run (or a resume: the batch is the checkpoint's) on a device count the batch does not
      # split over: say which data-parallel sizes would do.
      sizes = [d for d in range(1, cfg.algo.minibatch_size + 1)
               if not cfg.rollout.batch_size % d and not cfg.algo.minibatch_size % d]
      raise ValueError(f"config.{name}={value} must be a multiple of the data-parallel size "
                       f"{mult} (mesh data*fsdp = {dict(mesh.shape)}{train_group}); sizes that "
                       f"split both the batch and the mini-batch: {sizes} (with mesh.data=-1 "
                       f"the visible devices set it: CUDA_VISIBLE_DEVICES, or "
                       f"--xla_force_host_platform_device_count on a CPU)")
  if cfg.algo.microbatch_size and mesh.shape["stage"] > 1:
    # A preset's setting stays valid under a pipelined plan file.
    logging.info("config.algo.microbatch_size=%d and algo.gradient_sync=%r are not used: the "
                 "pipelined update splits its mini-batch with config.pipeline."
                 "actor_microbatches / critic_microbatches", cfg.algo.microbatch_size,
                 cfg.algo.gradient_sync)
  elif mesh.shape["stage"] == 1:
    count = ppo.microbatch_count(cfg.algo, cfg.algo.minibatch_size, mult)  # the update's check
    if count == 1:  # each shard's rows at once: nothing accumulates, so nothing to sync once
      warn_unused(set_fields(cfg, "algo", ["gradient_sync"]), "it applies to accumulated "
                  f"gradients, and algo.microbatch_size={cfg.algo.microbatch_size} takes each "
                  f"data shard's {cfg.algo.minibatch_size // mult} mini-batch rows at once")
  if cfg.algo.estimator == "dr_grpo" and cfg.algo.loss_agg != "seq-mean-token-sum-norm":
    logging.warning("config.algo.estimator='dr_grpo' with algo.loss_agg=%r is half of Dr. "
                    "GRPO: its paper also replaces the per-sequence length mean by a constant "
                    "normaliser, algo.loss_agg='seq-mean-token-sum-norm' (both set: "
                    "configs/ppo_tiny.py:dr_grpo)", cfg.algo.loss_agg)
  if (adv_lib.get_estimator(cfg.algo.estimator).group_std and cfg.algo.kl_in_reward and
      cfg.algo.kl_coef > 0):
    # Accepted (verl computes it so too), but rarely what a user who only switched the estimator
    # wants: the group's std rescales the penalty whatever its coefficient.
    logging.warning("config.algo.estimator=%r with the KL in the reward (algo.kl_in_reward="
                    "True, kl_coef=%g): it divides each group's scores by their std, so in a "
                    "group whose rewards tie the KL penalty alone becomes advantages of about "
                    "+-1, whatever kl_coef is. GRPO's own setting is algo.kl_in_reward=False "
                    "(the KL as a loss term, kl_estimator='k3'), as configs/ppo_tiny.py:grpo has",
                    cfg.algo.estimator, cfg.algo.kl_coef)
  warn_fine_tune_lr(cfg)
  for section, model, lr in _low_precision_trained(cfg):
    # AdamW moves a weight by about the learning rate per step; bfloat16 keeps 8 significant
    # bits, so a step below half the weight's spacing rounds away (float16 is refused above).
    # Measured (AdamW lr 1e-6, weights ~N(0, 0.02), bf16): 1.9 % of the weights changed in 10
    # steps, against all of them in float32 (tests/test_trainer.py).
    logging.warning(
        "config.%s.param_dtype=%r trains the weights themselves in 16 bits: an AdamW step of "
        "~lr=%g changes a weight of magnitude 0.02 only if lr > %.1e, so most updates round "
        "away and the model barely moves. Set config.optim.master_weights=True (a float32 "
        "copy and float32 moments in the optimizer state; the weights stay 16-bit for "
        "generation and inference) or config.%s.param_dtype='float32' (computation still in "
        "dtype=%r)", section, model.param_dtype, lr,
        _half_spacing(0.02, model.param_dtype), section, model.dtype)
  if cfg.optim.master_weights:
    wide = [f"config.{s}.param_dtype={m.param_dtype!r}" for s, m, _ in _trained_models(cfg)
            if jnp.finfo(m.param_dtype).bits > 16]
    if wide:  # float32_master's copy of float32 weights: the same values twice
      logging.warning("config.optim.master_weights=True with %s: the float32 copy of weights "
                      "already in float32 adds 4 bytes a parameter and no precision; it is "
                      "for 16-bit weights", ", ".join(wide))
  warn_unused(_critic_free_unused(cfg), f"algo.estimator={cfg.algo.estimator!r} trains no "
              "critic and computes its advantages without them")
  if cfg.algo.kl_coef == 0:  # kl/ref_* are k3 estimates whatever kl_estimator is (ppo.py)
    warn_unused(set_fields(cfg, "algo", ["kl_estimator", "kl_in_reward"]), "algo.kl_coef=0 "
                "puts no KL to the reference in the reward or the loss")
  _async_unused(cfg)
  _uneven_tensor_split(cfg, mesh)
  # (A format term kept beside it is said by build_rewards' `reward:` line, once a start, also
  # where no function is left to warn of.)
  warn_unused(_reward_unused(cfg), "reward.kind='model': the reward model scores every sample")
  # A reward model's path without reward.kind='model', a weight without a format: ignored
  # without a word, as the fusion fields below were.
  if cfg.reward.kind != "model":
    warn_unused(set_fields(cfg, "reward", ["model_checkpoint", "model_normalize"]),
                f"reward.kind={cfg.reward.kind!r} loads no reward model (reward.kind='model' does)")
  warn_unused(_format_weight_unused(cfg, given), "no reward.format to weigh")
  if cfg.guard.on_nonfinite != "skip_update":
    warn_unused(set_fields(cfg, "guard", ["max_consecutive_skips"]), f"guard.on_nonfinite="
                f"{cfg.guard.on_nonfinite!r} skips no step (it bounds the steps in a row that "
                "guard.on_nonfinite='skip_update' skips)")
  warn_unused(_fusion_unused(cfg), "plan.generation='instances' without fusion.inter_stage "
              "never consolidates" if cfg.plan.generation == "instances" else
              "config.fusion.inter_stage=False (they lay out and steer the fused generation "
              "instances)")
  if cfg.plan.generation == "pipeline":
    warn_unused(set_fields(cfg, "rollout", ["steps_per_check"]), "plan.generation='pipeline' "
                "tests for finished rows once per decode chunk of rollout.chunk_size steps "
                "(generation/pipelined.py)")
  if cfg.data.prompts_file:
    # The task's prompt count and target lengths make the task's own prompts; length_max also
    # sizes the task's vocabulary, the tokenizer of a run without init.tokenizer.
    warn_unused(_task_prompt_fields(cfg), f"data.prompts_file={cfg.data.prompts_file!r} gives "
                "the prompts (they shape the task's own prompts)")
  elif not cfg.data.val_file:  # the task makes every prompt
    warn_unused(set_fields(cfg, "data", ["prompt_key", "answer_key"]), "they name the fields "
                "of a data.prompts_file or data.val_file's rows, and neither is set (the task "
                "makes the prompts)")
  if not cfg.data.has_validation_set:
    warn_unused(set_fields(cfg, "data", ["val_max_prompts"]), "no held-out prompts (set "
                "data.val_file or data.val_fraction, and eval_every)")
  elif not cfg.eval_every:
    warn_unused(_validation_unused(cfg, given),
                "eval_every=0 runs no validation pass (a data.val_fraction still holds its "
                "prompts out of training, so that a resume with eval_every > 0 validates on "
                "them)")
  if cfg.rollout.top_k > cfg.model.vocab_size:
    raise ValueError(f"config.rollout.top_k={cfg.rollout.top_k} exceeds the actor's vocabulary "
                     f"(model.vocab_size={cfg.model.vocab_size}); 0 samples from all of it")
  context = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
  # (where its vocabulary comes from, where its max_seq_len comes from, the model): a
  # checkpoint sets the architecture, but the actor's and critic's context is the config's
  # (build.RUN_MODEL_FIELDS); a reward model's is capped by its own positions.
  models = [("config.model", "config.model", cfg.model)]
  if adv_lib.needs_critic(cfg.algo.estimator):
    models.append((f"config.init.critic_checkpoint={cfg.init.critic_checkpoint!r}"
                   if cfg.init.critic_checkpoint else "config.critic_model",
                   "config.critic_model", cfg.critic_model))
  reward_cfg = build.reward_model_config(cfg, weights)
  if reward_cfg is not None:
    rm = f"config.reward.model_checkpoint={cfg.reward.model_checkpoint!r}"
    models.append((rm, rm, reward_cfg))
    # (the reference's and critic's: rollout.check_inference_pp; the reward model's shape is
    # its checkpoint's, known here)
    pp, field = ((cfg.plan.inference_pp, "plan.inference_pp") if cfg.plan.generation ==
                 "instances" else (cfg.fusion.inference_pp, "fusion.inference_pp"))
    if cfg.plan.generation == "instances" or cfg.fusion.inter_stage:
      inf_stages.check_split(reward_cfg, pp, f"config.{field}", f"reward model ({rm})")
  for vocab_name, context_name, model in models:
    if model.vocab_size < cfg.model.vocab_size:
      fix = ("; point it at a checkpoint of the actor's vocabulary (e.g. the actor's own "
             "directory), or set it to '' for a critic built from config.critic_model"
             if vocab_name.startswith("config.init.critic_checkpoint") else
             "; a reward model must read the actor's tokenizer's ids"
             if vocab_name.startswith("config.reward") else "")
      raise ValueError(f"{vocab_name} embeds vocab_size={model.vocab_size} tokens but the actor "
                       f"(config.model) generates ids up to {cfg.model.vocab_size - 1}: every "
                       f"model reads the actor's token ids{fix}")
  short = [(name, m) for _, name, m in models if context > m.max_seq_len]
  if short:
    # Every model too short at once (raising the actor's alone then failed on the critic's).
    raisable = [f"{name}.max_seq_len" for name, _ in short if name.startswith("config.model")
                or name.startswith("config.critic_model")]
    fix = (f"raise {' and '.join(raisable)} to at least {context}, or lower "
           "config.data.max_prompt_len / config.rollout.max_new_tokens" if raisable else
           "lower config.data.max_prompt_len / config.rollout.max_new_tokens")
    def length(name, m):
      # A reward model's context is its config.json's positions where they are fewer than the
      # run's: "max_seq_len" sent the user looking for a field neither file has.
      if name.startswith("config.reward") and m.max_seq_len < cfg.model.max_seq_len:
        return f"max_position_embeddings={m.max_seq_len} in the config.json of {name}"
      return f"max_seq_len={m.max_seq_len} of {name}"
    raise ValueError(f"config.data.max_prompt_len + config.rollout.max_new_tokens = {context} "
                     "exceeds the " + " and the ".join(length(name, m) for name, m in short) +
                     f": a prompt and its response must fit every model's context; {fix}")
  check_checkpoint_positions(cfg)
  if mesh.shape["stage"] > 1:  # the actor/critic pipeline: estimator, layer split, micro-batches
    pipe = pipelined.check_config(cfg, mesh)
    if cfg.fusion.intra_stage and pipe.schedule_file:  # its shape, before anything compiles
      pipelined.file_schedule(pipelined.pipeline_problem(mesh.shape["stage"], pipe),
                              pipe.schedule_file)
      warn_unused(set_fields(cfg, "pipeline", ["search_time_s", "search_evaluations",
                                               "search_seed"]),
                  "config.pipeline.schedule_file gives the fused schedule (no search)")
    if not cfg.fusion.intra_stage:
      warn_unused(set_fields(cfg, "pipeline", ["search_time_s", "search_evaluations",
                                               "search_seed", "schedule_cache_dir",
                                               "schedule_file"]),
                  "fusion.intra_stage=False runs serial 1F1B (they give the fused schedule or "
                  "steer its search)")
  else:
    warn_unused(set_fields(cfg, "pipeline"), "mesh.stage=1 runs the plain (unpipelined) "
                "update; the pipeline section applies with mesh.stage > 1")
  try:
    fused = rollout.check_fusion(cfg, n_gen)
    if fused is not None:
      rollout.warn_idle_instance_devices(fused, n_gen)
      rollout.warn_single_instance(fused, n_gen)
    rollout.check_plan(cfg, n_gen)
    if cfg.plan.generation == "instances":
      rollout.check_instances_within_processes("plan.generation_tp", cfg.plan.generation_tp,
                                               n_gen, cfg.plan.inference_pp, "plan.inference_pp")
    elif cfg.fusion.inter_stage:
      rollout.check_instances_within_processes("fusion.instance_devices",
                                               cfg.fusion.instance_devices, n_gen,
                                               cfg.fusion.inference_pp, "fusion.inference_pp")
  except ValueError as e:
    if not g:
      raise
    raise ValueError(f"{e} (generation runs on the {n_gen} devices of config.async_ppo."
                     f"generation_devices={g})") from None
  if cfg.async_ppo.generation_devices and cfg.rollout.batch_size % n_gen:
    raise ValueError(f"config.rollout.prompts_per_iteration*samples_per_prompt="
                     f"{cfg.rollout.batch_size} must be a multiple of the generation group's "
                     f"{n_gen} devices (config.async_ppo.generation_devices)")
  build.check_reward_functions(cfg)
  if cfg.checkpoint.export_hf:  # a family that cannot express the actor: now, not at the end
    try:
      hf_loader.hf_config_dict(cfg.model, family=hf_export.export_family(cfg))
    except ValueError as e:
      raise ValueError(f"config.checkpoint.export_hf={cfg.checkpoint.export_hf!r}: {e}") from e
