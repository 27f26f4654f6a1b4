"""The validation pass (trainer/evaluation.py) runs the reward alone: no reference or critic
forward (with algo.kl_coef > 0 and a critic they were two of its three inference passes), and
the val/* metrics are those of the whole stage's outputs."""
import jax
import pytest

from rlhfuse_jax.generation import instances
from rlhfuse_jax.inference import scoring
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.trainer import rollout
from rlhfuse_jax.trainer.loop import PPOTrainer
from tests.test_trainer import tiny_config


def _spy(monkeypatch, cls, name, calls):
  """Records each call of cls.name (the model's name for GenerationInstance.score)."""
  original = getattr(cls, name)

  def spied(self, *args, **kwargs):
    calls.append(args[0] if name == "score" else name)
    return original(self, *args, **kwargs)
  monkeypatch.setattr(cls, name, spied)


STAGES = {"serial": ({}, rollout.SerialStage),
          "fused": ({"fusion.inter_stage": True, "fusion.migration_threshold": "1.0"},
                    rollout.FusedStage),
          "planned": ({"plan.inference_tp": 2}, rollout.PlannedStage)}


@pytest.mark.parametrize("kind", sorted(STAGES))
def test_validation_pass_skips_the_reference_and_critic_with_the_same_metrics(
    tmp_path, monkeypatch, kind):
  extra, stage_class = STAGES[kind]
  fused = kind == "fused"
  cfg = tiny_config(**{"num_iterations": 1, "eval_every": 1, "data.val_fraction": 0.4,
                       "checkpoint.every": 100, **extra})
  assert cfg.algo.kl_coef > 0 and cfg.algo.estimator == "gae"  # a reference and a critic
  trainer = PPOTrainer(cfg, str(tmp_path), mesh=mesh_lib.make_mesh(
      mesh_lib.MeshConfig(data=4), jax.devices()[:4]))
  stage = trainer.rollout
  assert type(stage) is stage_class
  calls, asked = [], []
  for cls, name in ((scoring.Scorer, "logprobs"), (scoring.Scorer, "values"),
                    (instances.GenerationInstance, "score")):
    _spy(monkeypatch, cls, name, calls)
  params = trainer._generation_params()

  def recorded(model):
    asked.append(model)
    return params(model)
  val = trainer.held_out(stage, recorded, 0)
  assert val["val/prompts"] == len(trainer.held_out) > stage_rows(cfg)  # several batches
  assert calls == [] and asked == ["actor"] * -(-len(trainer.held_out) // stage_rows(cfg))
  # The whole stage (a wrapper is called as it is): reference and critic run, same val/*.
  full = trainer.held_out(lambda p, prompts, key: stage(p, prompts, key), recorded, 0)
  assert set(calls) >= ({"reference", "critic"} if fused else {"logprobs", "values"})
  assert "critic" in asked
  metrics = lambda m: {k: v for k, v in m.items() if k != "timing_s/validation"}  # noqa: E731
  assert metrics(val) == metrics(full)


def stage_rows(cfg):
  return cfg.rollout.batch_size


def test_validation_pass_before_any_training_batch_with_auto_rt_and_a_critic(tmp_path):
  """fusion.migration_threshold='auto' measures the instances' costs on the generator's first
  batch, with every inference model's params. A validation pass called on a new stage (the
  trainer's loop always generates a training batch first; async runs hold no critic on the
  stage) is that first batch: it left out the critic and failed with 'measuring the
  instances' costs ... needs every inference model's params'."""
  cfg = tiny_config(**{"num_iterations": 1, "eval_every": 1, "data.val_fraction": 0.4,
                       "checkpoint.every": 100, "fusion.inter_stage": True,
                       "fusion.migration_threshold": "auto"})
  trainer = PPOTrainer(cfg, str(tmp_path), mesh=mesh_lib.make_mesh(
      mesh_lib.MeshConfig(data=4), jax.devices()[:4]))
  stage = trainer.rollout
  assert type(stage) is rollout.FusedStage and stage.use_critic
  assert stage.generator.calibration is None
  params = trainer._generation_params()
  val = trainer.held_out(stage, params, 0)
  assert stage.generator.calibration is not None  # measured once, as a training batch does
  full = trainer.held_out(lambda p, prompts, key: stage(p, prompts, key), params, 0)
  metrics = lambda m: {k: v for k, v in m.items() if k != "timing_s/validation"}  # noqa: E731
  assert metrics(val) == metrics(full)


def test_a_fused_validation_pass_still_scores_with_the_reward_model(tmp_path, monkeypatch):
  """reward.kind='model' on a fused stage: the validation pass leaves out the reference (and
  any critic) but runs the reward model on the freed instances (rewards_only asks the generator
  for models=['reward']); val/* equal to the whole stage's. The tests above use a reward
  function, with which a pass that asked for no model at all passed too."""
  from tests.test_trainer_paths import (REPEAT_PROMPTS, _reward_run_config, _write_prompts,
                                        write_reward_checkpoint)
  write_reward_checkpoint(tmp_path / "rm")
  _write_prompts(tmp_path / "prompts.jsonl", REPEAT_PROMPTS)
  cfg = _reward_run_config(tmp_path / "prompts.jsonl", tmp_path / "rm", **{
      "num_iterations": 1, "eval_every": 1, "data.val_file": str(tmp_path / "prompts.jsonl"),
      "fusion.inter_stage": True, "fusion.migration_threshold": "1.0"})
  trainer = PPOTrainer(cfg, str(tmp_path / "run"), mesh=mesh_lib.make_mesh(
      mesh_lib.MeshConfig(data=4), jax.devices()[:4]))
  stage = trainer.rollout
  assert type(stage) is rollout.FusedStage and stage.rewards.from_model
  calls = []
  _spy(monkeypatch, instances.GenerationInstance, "score", calls)
  params = trainer._generation_params()
  val = trainer.held_out(stage, params, 0)
  assert set(calls) == {"reward"}
  calls.clear()
  full = trainer.held_out(lambda p, prompts, key: stage(p, prompts, key), params, 0)
  assert set(calls) == {"reference", "reward"}
  metrics = lambda m: {k: v for k, v in m.items() if k != "timing_s/validation"}  # noqa: E731
  assert metrics(val) == metrics(full)


def test_the_set_up_log_names_the_held_out_file(tmp_path, caplog):
  """configs/ppo_hf.py with only data.prompts_file replaced validated on the preset's own
  held-out file (the same keys as the user's GSM8K-format rows) without a word: the set-up line
  counted the held-out prompts but named no file."""
  import json
  import logging
  train, val = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
  rows = [{"prompt": f"#{n} =", "target": " ".join(f"#{k}" for k in range(n, 0, -1))}
          for n in (1, 2, 3, 4, 5, 6, 7, 8) * 2]
  train.write_text("".join(json.dumps(r) + "\n" for r in rows))
  val.write_text(json.dumps(rows[2]) + "\n")
  cfg = tiny_config(**{"num_iterations": 1, "eval_every": 1, "checkpoint.every": 100,
                       "data.prompts_file": str(train), "data.val_file": str(val)})
  with caplog.at_level(logging.INFO):
    PPOTrainer(cfg, str(tmp_path / "run"), mesh=mesh_lib.make_mesh(
        mesh_lib.MeshConfig(data=4), jax.devices()[:4]))
  assert (f"setup: 16 training prompts (1 held-out one from {val} validated every "
          "iteration), 16 per iteration: 1 iteration is 1 pass over them" in caplog.text), \
      caplog.text
