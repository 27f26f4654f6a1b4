"""Pins the survivors of a mutation audit of trainer/config.py and trainer/validate.py.

Each test asserts one bound of a config check from both sides where it matters: the value just
past the bound is refused with an error naming the field, and the value on the bound (often a
documented setting, such as min_lr_ratio=0 or gamma=0) is accepted. A check loosened or
tightened by one comparison, or dropped, fails here before a run starts with a config that
should have stopped it (or stops one that should run).
"""
import dataclasses
import math

import pytest

from configs import ppo_tiny
from rlhfuse_jax.trainer import config as config_lib
from rlhfuse_jax.generation import sampling
from rlhfuse_jax.trainer.config import (AlgoConfig, AsyncPPOConfig, DataConfig, GuardConfig,
                                        OptimConfig, PipelineConfig, PlanConfig, RolloutConfig,
                                        TrainConfig)


def _config(**overrides) -> TrainConfig:
  """configs/ppo_tiny.py's TrainConfig, with dotted overrides ("algo.kl_coef": 0.1) applied to
  the plain dict, as a sweep's or a plan file's values reach from_config_dict."""
  d = ppo_tiny.get_config().to_dict()
  for dotted, value in overrides.items():
    node = d
    *path, leaf = dotted.split(".")
    for part in path:
      node = node.setdefault(part, {})
    node[leaf] = value
  return TrainConfig.from_config_dict(d)


# DataConfig

def test_equal_task_length_bounds_are_accepted_and_crossed_ones_refused():
  """length_min == length_max is every target of one length (a fixed-length task)."""
  assert DataConfig(length_min=3, length_max=3).length_max == 3
  with pytest.raises(ValueError, match=r"config\.data\.length_min/length_max=\(4, 3\)"):
    DataConfig(length_min=4, length_max=3)


# RolloutConfig

def test_top_p_of_zero_is_refused_and_one_accepted():
  """top_p=0 keeps no token at all (nucleus of mass 0); 1.0 is the documented 'off'."""
  assert RolloutConfig(top_p=1.0).top_p == 1.0
  with pytest.raises(ValueError, match=r"config\.rollout\.top_p=0\.0: expected in \(0, 1\]"):
    RolloutConfig(top_p=0.0)


def test_steps_per_check_must_divide_the_chunk():
  """The decode's fixed-trip loop runs steps_per_check steps between tests inside a chunk: one
  that does not divide chunk_size would overrun the chunk."""
  assert RolloutConfig(chunk_size=8, steps_per_check=4).steps_per_check == 4
  with pytest.raises(ValueError, match=r"config\.rollout\.steps_per_check=3: expected a "
                                       r"positive divisor of rollout\.chunk_size=8"):
    RolloutConfig(chunk_size=8, steps_per_check=3)


def test_temperature_below_the_float32_safe_minimum_is_refused():
  """A temperature below sampling.MIN_TEMPERATURE overflows float32 logits / temperature; the
  minimum itself is accepted."""
  t = sampling.MIN_TEMPERATURE
  assert RolloutConfig(temperature=t).temperature == t
  with pytest.raises(ValueError, match=r"config\.rollout\.temperature="):
    RolloutConfig(temperature=t / 2)


# AlgoConfig

def test_gamma_bounds_are_inclusive():
  """gamma=0 (only the immediate reward) and gamma=1 (no discount) are both valid."""
  assert AlgoConfig(gamma=0.0).gamma == 0.0
  assert AlgoConfig(gamma=1.0).gamma == 1.0
  with pytest.raises(ValueError, match=r"config\.algo\.gamma=1\.01"):
    AlgoConfig(gamma=1.01)


def test_clip_eps_of_one_is_refused():
  """clip_eps=1 clips the ratio's lower side at 0: the clip no longer bounds a bad token."""
  with pytest.raises(ValueError, match=r"config\.algo\.clip_eps=1\.0: expected in \(0, 1\)"):
    AlgoConfig(clip_eps=1.0)


def test_dual_clip_constant_of_one_is_refused():
  """Dual clip's c must be > 1 (the paper's 3): c = 1 caps a negative advantage's loss at its
  value at ratio 1, so no token whose ratio grew gets a gradient."""
  assert AlgoConfig(clip_ratio_c=3.0).clip_ratio_c == 3.0
  with pytest.raises(ValueError, match=r"config\.algo\.clip_ratio_c=1\.0"):
    AlgoConfig(clip_ratio_c=1.0)


def test_k1_as_a_loss_is_refused_only_with_a_nonzero_coefficient():
  """k1 as a loss term adds noise, not a pull to the reference; with kl_coef=0 there is no KL
  term at all, so the estimator is moot and the config runs."""
  AlgoConfig(kl_in_reward=False, kl_coef=0.0, kl_estimator="k1")
  with pytest.raises(ValueError, match=r"config\.algo\.kl_estimator='k1'"):
    AlgoConfig(kl_in_reward=False, kl_coef=0.1, kl_estimator="k1")


# OptimConfig

def test_min_lr_ratio_of_zero_is_accepted():
  """A cosine to 0 is the common schedule; a ratio above 1 would make the 'decay' a rise."""
  assert OptimConfig(min_lr_ratio=0.0).min_lr_ratio == 0.0
  with pytest.raises(ValueError, match=r"config\.optim\.min_lr_ratio=1\.5"):
    OptimConfig(min_lr_ratio=1.5)


# PipelineConfig, PlanConfig, AsyncPPOConfig, GuardConfig

def test_an_infinite_schedule_search_budget_is_refused():
  """search_time_s=inf: the search never returns and training never starts."""
  with pytest.raises(ValueError, match=r"config\.pipeline\.search_time_s=inf"):
    PipelineConfig(search_time_s=math.inf)


def test_generation_groups_equal_to_the_stages_are_accepted_and_fewer_refused():
  """G >= pp: G == pp (the default 0 resolves to it) is the smallest valid pipeline."""
  plan = PlanConfig(generation="pipeline", generation_pp=2, generation_groups=2)
  assert plan.groups == 2
  with pytest.raises(ValueError, match=r"config\.plan\.generation_groups=1: expected >= "
                                       r"plan\.generation_pp=2"):
    PlanConfig(generation="pipeline", generation_pp=2, generation_groups=1)


def test_generation_tp_on_the_training_mesh_is_refused():
  """plan.generation_tp belongs to plan.generation='instances': with 'mesh' it would be ignored
  (generation runs on the training mesh's own tensor axis)."""
  assert PlanConfig(generation="instances", generation_tp=2).generation_tp == 2
  with pytest.raises(ValueError, match=r"config\.plan\.generation_tp=2: expected its default 1 "
                                       r"with plan\.generation='mesh'"):
    PlanConfig(generation="mesh", generation_tp=2)


def test_a_behaviour_weight_cap_of_one_is_refused():
  """pi_prox / pi_behaviour is about 1 on average: a cap of 1 drops every token the proximal
  policy favours even slightly more than the behaviour policy did."""
  assert AsyncPPOConfig(behaviour_weight_cap=0.0).behaviour_weight_cap == 0.0
  with pytest.raises(ValueError, match=r"config\.async_ppo\.behaviour_weight_cap=1\.0"):
    AsyncPPOConfig(behaviour_weight_cap=1.0)


def test_zero_consecutive_skips_is_refused():
  """max_consecutive_skips=0 would make 'skip_update' stop at the first skip, as 'stop' does."""
  assert GuardConfig(max_consecutive_skips=1).max_consecutive_skips == 1
  with pytest.raises(ValueError, match=r"config\.guard\.max_consecutive_skips=0"):
    GuardConfig(max_consecutive_skips=0)


# TrainConfig: cross-field checks and types

def test_a_seed_of_two_to_the_32_is_refused_and_the_largest_32_bit_one_accepted():
  """jax's keys keep a seed's low 32 bits: 2**32 would draw seed 0's models."""
  cfg = _config()
  assert dataclasses.replace(cfg, seed=2**32 - 1).seed == 2**32 - 1
  with pytest.raises(ValueError, match=r"config\.seed=4294967296"):
    dataclasses.replace(cfg, seed=2**32)


def test_offload_with_a_separate_generation_group_is_refused_even_without_staleness():
  """A generation group (async_ppo.generation_devices > 0, staleness 0) holds no optimizer
  state to offload: the offload is refused for either async setting alone."""
  with pytest.raises(ValueError, match=r"config\.optim\.offload_during_rollout=True"):
    _config(**{"optim.offload_during_rollout": True, "async_ppo.generation_devices": 2})
  with pytest.raises(ValueError, match=r"config\.optim\.offload_during_rollout=True"):
    _config(**{"optim.offload_during_rollout": True, "async_ppo.staleness": 1})
  assert _config(**{"optim.offload_during_rollout": True}).optim.offload_during_rollout


def test_a_model_vocabulary_equal_to_the_tokenizers_is_accepted():
  """with_vocab: model.vocab_size >= the tokenizer's; equal is the usual case."""
  cfg = _config(**{"model.vocab_size": 32})
  assert cfg.with_vocab(32).model.vocab_size == 32
  with pytest.raises(ValueError, match=r"config\.model\.vocab_size=32: expected >= the "
                                       r"tokenizer's vocabulary \(33\)"):
    cfg.with_vocab(33)


def test_a_bool_for_a_float_field_is_refused_by_name():
  """True for algo.kl_coef would be a coefficient of 1 (bool is an int in Python)."""
  with pytest.raises(ValueError, match=r"config\.algo\.kl_coef=True: expected a number"):
    _config(**{"algo.kl_coef": True})
  assert _config(**{"algo.kl_coef": 1}).algo.kl_coef == 1


def test_a_lognormal_sigma_of_zero_is_refused():
  """sigma=0 is no distribution (data/lengths.py divides by it); any sigma > 0 is one."""
  assert DataConfig(length_sigma=0.1).length_sigma == 0.1
  with pytest.raises(ValueError, match=r"config\.data\.length_sigma=0\.0: expected a finite "
                                       r"value > 0"):
    DataConfig(length_sigma=0.0)


def test_gae_lambda_of_one_and_no_warmup_are_accepted():
  """lam=1 (Monte-Carlo returns) and warmup_steps=0 (no warm-up) are the bounds of their
  ranges, not past them."""
  assert AlgoConfig(lam=1.0).lam == 1.0
  with pytest.raises(ValueError, match=r"config\.algo\.lam=1\.5"):
    AlgoConfig(lam=1.5)
  assert OptimConfig(warmup_steps=0).warmup_steps == 0
  with pytest.raises(ValueError, match=r"config\.optim\.warmup_steps=-1"):
    OptimConfig(warmup_steps=-1)


def test_keeping_no_checkpoint_is_refused():
  """checkpoint.keep=0 would delete every checkpoint it writes: nothing to resume from."""
  assert config_lib.CheckpointConfig(keep=1).keep == 1
  with pytest.raises(ValueError, match=r"config\.checkpoint\.keep=0: expected > 0"):
    config_lib.CheckpointConfig(keep=0)


def test_a_minibatch_that_does_not_divide_the_rollout_batch_is_refused():
  """ppo_tiny's rollout batch is 64 x 1: a mini-batch of 24 leaves 16 samples out of every
  epoch; 16 divides it."""
  assert _config(**{"algo.minibatch_size": 16}).algo.minibatch_size == 16
  with pytest.raises(ValueError, match=r"config\.algo\.minibatch_size=24: expected a divisor "
                                       r"of the rollout batch prompts_per_iteration\*"
                                       r"samples_per_prompt=64"):
    _config(**{"algo.minibatch_size": 24})


def test_a_negative_log_samples_is_refused():
  """log_samples counts samples written per log; 0 is none, a negative count is a typo."""
  assert _config(log_samples=0).log_samples == 0
  with pytest.raises(ValueError, match=r"config\.log_samples=-1: expected >= 0"):
    _config(log_samples=-1)


# validate: checks against the mesh and the models

def _validate(cfg: TrainConfig) -> None:
  """validate() on `cfg` resolved against its task's tokenizer, on a data-parallel mesh of 8."""
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.trainer import build
  from rlhfuse_jax.trainer.validate import validate
  _, tokenizer = build.build_task_and_tokenizer(cfg)
  validate(build.resolve_config(cfg, tokenizer),
           mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8)))


def test_a_prompt_and_response_filling_the_context_exactly_are_accepted():
  """max_prompt_len + max_new_tokens == max_seq_len fits (positions 0 .. max_seq_len - 1); one
  token more is refused naming the models' max_seq_len."""
  fits = {"data.max_prompt_len": 8, "rollout.max_new_tokens": 8, "model.max_seq_len": 16,
          "critic_model.max_seq_len": 16}
  _validate(_config(**fits))
  with pytest.raises(ValueError, match=r"= 17 exceeds the max_seq_len=16 of config\.model and "
                                       r"the max_seq_len=16 of config\.critic_model"):
    _validate(_config(**{**fits, "rollout.max_new_tokens": 9}))


def _resolved_with_init(tmp_path, positions: int, **overrides):
  """(ppo_tiny resolved with `overrides`, a checkpoint directory whose config.json says it was
  trained on `positions` positions): validate reads only that field of an init checkpoint."""
  from rlhfuse_jax.trainer import build
  ckpt = tmp_path / f"ckpt{positions}"
  ckpt.mkdir()
  (ckpt / "config.json").write_text(f'{{"max_position_embeddings": {positions}}}')
  cfg = _config(**overrides)
  _, tokenizer = build.build_task_and_tokenizer(cfg)
  return build.resolve_config(cfg, tokenizer), str(ckpt)


def _validate_resolved(cfg: TrainConfig) -> None:
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.trainer.validate import validate
  validate(cfg, mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8)))


def test_an_actor_checkpoint_trained_on_exactly_the_runs_context_is_accepted(tmp_path):
  """ppo_tiny's context is 8 + 12 = 20 positions: a checkpoint trained on 20 covers them all,
  one trained on 19 is refused naming init.actor_checkpoint."""
  for positions, ok in ((20, True), (19, False)):
    cfg, ckpt = _resolved_with_init(tmp_path, positions)
    cfg = dataclasses.replace(cfg, init=dataclasses.replace(cfg.init, actor_checkpoint=ckpt))
    if ok:
      _validate_resolved(cfg)
    else:
      with pytest.raises(ValueError, match=r"= 20 exceeds the max_position_embeddings=19 that "
                                           r"config\.init\.actor_checkpoint="):
        _validate_resolved(cfg)


def test_a_short_critic_checkpoint_is_refused_only_when_the_estimator_trains_a_critic(tmp_path):
  """A critic-free estimator (GRPO) never loads init.critic_checkpoint (validate warns that it
  is unused), so its positions cannot stop the run; GAE loads it and is refused."""
  for estimator, samples in (("grpo", 2), ("gae", 1)):
    (tmp_path / estimator).mkdir()
    cfg, ckpt = _resolved_with_init(tmp_path / estimator, 8, **{
        "algo.estimator": estimator, "rollout.samples_per_prompt": samples})
    cfg = dataclasses.replace(cfg, init=dataclasses.replace(cfg.init, critic_checkpoint=ckpt))
    if estimator == "grpo":
      _validate_resolved(cfg)
    else:
      with pytest.raises(ValueError, match=r"max_position_embeddings=8 that config\.init\."
                                           r"critic_checkpoint="):
        _validate_resolved(cfg)


def test_a_minibatch_not_split_evenly_over_the_data_shards_is_refused():
  """A mini-batch of 4 divides the rollout batch (64) but not the 8 data shards of the mesh:
  refused naming algo.minibatch_size, as the rollout batch is for its own multiple."""
  _validate(_config(**{"algo.minibatch_size": 8}))
  with pytest.raises(ValueError, match=r"config\.algo\.minibatch_size=4 must be a multiple of "
                                       r"the data-parallel size 8"):
    _validate(_config(**{"algo.minibatch_size": 4}))


def test_a_format_reward_beside_a_reward_model_is_not_called_unused():
  """reward.format adds to the reward model's score (reward = model + format_weight * format):
  only reward.function is replaced by the model."""
  from rlhfuse_jax.trainer.validate import _reward_unused
  model = {"reward.kind": "model", "reward.model_checkpoint": "rm"}
  assert _reward_unused(_config(**model, **{"reward.format": "boxed_format"})) == []
  assert _reward_unused(_config(**model, **{"reward.function": "math"})) == [
      "reward.function='math'"]
