"""config.reward.clip_range, OpenRLHF's --reward_clip_range: each sample's reward clamped before
the KL penalty and any group baseline, reward/clipped_frac logged, off by default (the run it was
before the field), bad values refused by name, and resumes of runs from before the field."""
import numpy as np
import pytest

from configs import ppo_tiny
from rlhfuse_jax.trainer import config as config_lib
from rlhfuse_jax.trainer import loop
from rlhfuse_jax.trainer.loop import PPOTrainer, TIMING_PREFIXES
from tests.test_trainer import tiny_config


def huge_reward(response, answer, record):
  """+-1e30, by the response's length: finite, far past any clip range, and too large to square
  in float32 (the guard stops such a run unclamped: tests/test_faults.py)."""
  del answer, record
  return 1e30 if len(response) % 2 else -1e30


def test_clip_range_is_read_in_any_spelling_and_bad_values_are_refused_by_name():
  """"low,high" with or without spaces, parentheses or brackets fingerprints as one value
  (a resume spelling it otherwise is no change); "" is off. Anything else is refused naming
  config.reward.clip_range and the expected form."""
  for given in ("-10,10", " -10, 10 ", "(-10, 10)", "[-10.0,1e1]"):
    cfg = tiny_config(**{"reward.clip_range": given})
    assert cfg.reward.clip_range == "-10.0,10.0", given
    assert cfg.reward.clip_bounds == (-10.0, 10.0)
    assert cfg.fingerprint()["reward.clip_range"] == "-10.0,10.0"
  assert tiny_config().reward.clip_bounds is None
  assert tiny_config(**{"reward.clip_range": " "}).reward.clip_range == ""
  for bad in ("10", "5,1", "1,1", "nan,1", "-inf,1", "a,b", "1,2,3", ",", "0,1e39"):
    with pytest.raises(ValueError, match=(
        rf"config\.reward\.clip_range={bad!r}: expected \"\" \(off\) or \"low,high\": two "
        r"finite numbers within float32's range, low < high \(OpenRLHF's --reward_clip_range")):
      tiny_config(**{"reward.clip_range": bad})
  # A list, as a config.json written by hand might hold it: the field is a string.
  d = ppo_tiny.get_config().to_dict()
  d["reward"]["clip_range"] = [-10, 10]
  with pytest.raises(ValueError, match=r"config\.reward\.clip_range=\[-10, 10\]: expected a "
                                       r"string"):
    config_lib.TrainConfig.from_config_dict(d)


def test_clipped_scores_clamps_counts_and_leaves_nan_to_the_guard():
  scores = np.array([-30.0, -10.0, 0.5, 10.0, 12.0, np.nan], np.float32)
  out, m = loop.clipped_scores(scores, (-10.0, 10.0))
  np.testing.assert_array_equal(out, np.array([-10, -10, 0.5, 10, 10, np.nan], np.float32))
  assert out.dtype == np.float32
  assert m == {"reward/clipped_frac": 2 / 6}
  same, none = loop.clipped_scores(scores, None)
  assert same is scores and none == {}


def _metrics_row(trainer):
  history = trainer.run()
  assert len(history) == 1
  return {k: v for k, v in history[0].items() if not k.startswith(TIMING_PREFIXES) and
          not k.startswith(("gen/", "fusion/", "perf/"))}


@pytest.mark.parametrize("estimator", ["gae", "reinforce_baseline"])
def test_a_reward_function_s_huge_scores_train_clamped(tmp_path, estimator):
  """Rewards of +-1e30 stopped the run before any update (too large to square); clamped to
  [-10, 10] they train: the token rewards (no KL: kl_coef 0) are the clamped scores, the
  logged reward/mean the unclamped ones (as OpenRLHF logs its reward), every sample counted
  in reward/clipped_frac; PPO's critic and reinforce_baseline's group baseline train on them."""
  over = {"num_iterations": 1, "reward.function": "tests.test_reward_clip:huge_reward",
          "reward.clip_range": "-10,10", "algo.kl_coef": 0.0}
  if estimator != "gae":
    over.update({"algo.estimator": estimator, "rollout.samples_per_prompt": 4,
                 "rollout.prompts_per_iteration": 4})
  trainer = PPOTrainer(tiny_config(**over), str(tmp_path))
  scores = []
  stage = trainer.rollout

  def recorded(params, prompts, key):
    out = stage(params, prompts, key)
    scores.append(np.asarray(out.scores, np.float64))
    return out
  trainer.rollout = recorded
  m = _metrics_row(trainer)
  raw = scores[0]
  assert set(np.abs(raw)) == {float(np.float32(1e30))}
  assert m["reward/clipped_frac"] == 1.0
  assert m["reward/mean"] == pytest.approx(float(np.mean(raw.astype(np.float32))))
  assert m["reward/token_reward_mean"] == pytest.approx(float(np.mean(np.sign(raw) * 10)))
  assert all(np.isfinite(v) for k, v in m.items() if isinstance(v, float)), m


def test_off_and_a_range_that_clamps_nothing_train_the_same(tmp_path):
  """The default "" is the run as before the field (no reward/clipped_frac); a range no reward
  reaches trains bit for bit as it does, with reward/clipped_frac 0."""
  over = {"num_iterations": 1, "reward.function": "tests.test_rewards:answer_length"}
  off = _metrics_row(PPOTrainer(tiny_config(**over), str(tmp_path / "off")))
  wide = _metrics_row(PPOTrainer(tiny_config(**over, **{"reward.clip_range": "-100,100"}),
                                 str(tmp_path / "wide")))
  assert "reward/clipped_frac" not in off
  assert wide.pop("reward/clipped_frac") == 0.0
  assert wide == off


def test_a_checkpoint_from_before_clip_range_resumes_unchanged_and_a_clamp_is_named():
  """A checkpoint written before reward.clip_range existed ran unclamped, the default: resumed
  at the default it shows no change. Resumed with a clamp it is refused as that change, with the
  flag that allows it (checkpoint.resume_changes takes it: the saved state is the same)."""
  cfg = tiny_config()
  old = {k: v for k, v in cfg.fingerprint().items() if k != "reward.clip_range"}
  assert "reward.clip_range" not in loop.ran_before_fields(cfg)
  assert config_lib.fingerprint_changes(old, cfg.fingerprint(),
                                        loop.ran_before_fields(cfg)) == []
  clamped = tiny_config(**{"reward.clip_range": "-10,10"})
  changes = config_lib.fingerprint_changes(old, clamped.fingerprint(),
                                           loop.ran_before_fields(clamped))
  assert changes == ["reward.clip_range: (absent) -> '-10.0,10.0'"], changes
  assert "--config.checkpoint.resume_changes=reward.clip_range" in (
      config_lib.resume_advice(changes))
  assert config_lib.split_resume_changes(changes, {"reward.clip_range"}) == (changes, [])


def test_the_guard_judges_the_clamped_rewards_that_trained(tmp_path):
  """Rewards of +-1e30 clamped to [-10, 10] train: an update's NaN (here a learning rate of
  1e38) was blamed on the unclamped rewards, "too large for float32 arithmetic", with the advice
  to bound them with the clamp already set, rather than on the learning rate. A clamp too wide
  to help names the clamped rewards and says to narrow it."""
  over = {"num_iterations": 1, "reward.function": "tests.test_reward_clip:huge_reward",
          "algo.kl_coef": 0.0}
  lr = {"optim.actor_lr": 1e38, "optim.critic_lr": 1e38}
  with pytest.raises(loop.NonFiniteError) as e:
    PPOTrainer(tiny_config(**over, **lr, **{"reward.clip_range": "-10,10"}),
               str(tmp_path / "lr")).run()
  assert "re-run with a lower optim.actor_lr / optim.critic_lr" in str(e.value), e.value
  assert "too large for float32" not in str(e.value), e.value
  with pytest.raises(loop.NonFiniteError, match=(
      r"^iteration 1: non-finite values: the rollout's rewards overflow float32 once squared, "
      r"before any update.* The batch's rewards \(clamped by reward\.clip_range\) are too large "
      r"for float32 arithmetic: 16 of 16 exceed 1\.9e\+18 in magnitude \(first: sample 0, "
      r"-?1e\+25\).*, or narrow config\.reward\.clip_range='-1e\+25,1e\+25', rather than the "
      r"learning rate$")):
    PPOTrainer(tiny_config(**over, **{"reward.clip_range": "-1e25,1e25"}),
               str(tmp_path / "wide")).run()
