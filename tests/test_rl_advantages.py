"""Advantage estimators against plain python/numpy loops, on variable-length batches."""
import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from rlhfuse_jax.rl import advantages as adv_lib

LENGTHS = np.array([8, 3, 1, 6, 8, 2])
T = 8


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  b = len(LENGTHS)
  mask = (np.arange(T)[None] < LENGTHS[:, None]).astype(np.float32)
  rewards = rng.normal(size=(b, T)).astype(np.float32)
  values = rng.normal(size=(b, T)).astype(np.float32)
  # Garbage on padding must not matter.
  rewards = np.where(mask > 0, rewards, 1e6).astype(np.float32)
  values = np.where(mask > 0, values, np.nan).astype(np.float32)
  return rewards, values, mask


def _gae_reference(rewards, values, lengths, gamma, lam):
  adv = np.zeros(rewards.shape, np.float64)
  for i, n in enumerate(lengths):
    last = 0.0
    for t in reversed(range(n)):
      next_v = values[i, t + 1] if t + 1 < n else 0.0
      delta = rewards[i, t] + gamma * next_v - values[i, t]
      last = delta + gamma * lam * last
      adv[i, t] = last
  ret = np.zeros(rewards.shape, np.float64)
  for i, n in enumerate(lengths):
    ret[i, :n] = adv[i, :n] + values[i, :n]
  return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0)])
def test_gae_matches_loop_for_variable_lengths(gamma, lam):
  rewards, values, mask = _batch()
  adv, ret = jax.jit(adv_lib.gae, static_argnums=(3, 4))(rewards, values, mask, gamma, lam)
  ref_adv, ref_ret = _gae_reference(rewards, values, LENGTHS, gamma, lam)
  np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(adv)[mask == 0] == 0.0)


def test_gae_mask_with_holes_skips_them():
  rng = np.random.default_rng(5)
  mask = np.array([[1, 1, 0, 0, 1, 1, 0, 0]], np.float32)
  rewards = rng.normal(size=(1, T)).astype(np.float32)
  values = rng.normal(size=(1, T)).astype(np.float32)
  adv, _ = adv_lib.gae(rewards, values, mask, 0.9, 0.8)
  keep = mask[0] > 0
  ref_adv, _ = _gae_reference(rewards[:, keep], values[:, keep], [int(keep.sum())], 0.9, 0.8)
  np.testing.assert_allclose(np.asarray(adv)[0, keep], ref_adv[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(adv)[0, ~keep], 0.0)


def test_token_level_rewards():
  rng = np.random.default_rng(1)
  _, _, mask = _batch()
  scores = rng.normal(size=len(LENGTHS)).astype(np.float32)
  kl = rng.normal(size=mask.shape).astype(np.float32)
  out = np.asarray(adv_lib.token_level_rewards(scores, kl, mask, 0.1))
  want = -0.1 * kl * mask
  want[np.arange(len(LENGTHS)), LENGTHS - 1] += scores
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
  # A row with no valid token receives nothing.
  empty = np.asarray(adv_lib.token_level_rewards(scores[:1], kl[:1], np.zeros((1, T)), 0.1))
  np.testing.assert_array_equal(empty, 0.0)


def test_gae_gamma_lam_one_gives_reward_to_go_minus_value():
  rewards, values, mask = _batch(3)
  adv, ret = adv_lib.gae(rewards, values, mask, 1.0, 1.0)
  r = np.where(mask > 0, rewards, 0.0)
  to_go = np.cumsum(r[:, ::-1], axis=1)[:, ::-1] * mask
  np.testing.assert_allclose(ret, to_go, rtol=1e-5, atol=1e-5)


def test_grpo_group_stats():
  rng = np.random.default_rng(0)
  g, prompts = 4, 3
  scores = rng.normal(size=g * prompts).astype(np.float32)
  mask = (np.arange(5)[None] < rng.integers(1, 6, size=g * prompts)[:, None]).astype(np.float32)
  adv, ret = adv_lib.grpo_advantages(scores, mask, group_size=g)
  adv = np.asarray(adv)
  per_sample = adv[:, 0]
  grouped = scores.reshape(prompts, g)
  want = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True)
                                                         + 1e-6)
  np.testing.assert_allclose(per_sample, want.reshape(-1), rtol=1e-5)
  np.testing.assert_allclose(per_sample.reshape(prompts, g).mean(1), 0.0, atol=1e-6)
  np.testing.assert_allclose(per_sample.reshape(prompts, g).std(1, ddof=1), 1.0, rtol=1e-4)
  np.testing.assert_array_equal(adv, per_sample[:, None] * mask)  # broadcast, masked
  np.testing.assert_array_equal(adv, ret)
  centred, _ = adv_lib.grpo_advantages(scores, mask, g, normalize_std=False)
  np.testing.assert_allclose(np.asarray(centred)[:, 0],
                             (grouped - grouped.mean(1, keepdims=True)).reshape(-1), atol=1e-6)
  # A group with identical scores has zero advantage (no signal), not nan: also where the
  # score is not exact in binary (0.1, 0.7, 1.1: gsm8k + a 0.1 format bonus) and beside groups
  # that differ. The float32 mean of eight 0.1s is off by ~1e-8, and dividing that by a std of
  # ~1e-8 (+ eps) gave every sample of the group the same advantage, up to about +-0.1.
  flat, _ = adv_lib.grpo_advantages(np.ones(4, np.float32), np.ones((4, 2)), 4)
  np.testing.assert_array_equal(flat, 0.0)
  for size in (3, 8, 16):
    for tie in (0.1, 0.7, 1.1):
      scores = np.array([tie] * size + [0.0, 1.0] * (size // 2) + [0.5] * (size % 2),
                        np.float32)
      adv, _ = adv_lib.grpo_advantages(scores, np.ones((2 * size, 3)), size)
      np.testing.assert_array_equal(np.asarray(adv)[:size], 0.0, err_msg=f"{size} x {tie}")
      assert np.abs(np.asarray(adv)[size:]).max() > 0.5


def test_grpo_and_reinforce_pp_keep_their_signal_for_huge_scores():
  """Scores within float32's range (which the reward check lets through) but beyond ~1.8e19
  give the advantages a float64 reference does. The std's squares overflowed: the group's (or
  the batch's) std was inf and every advantage 0, with nothing non-finite to stop the run."""
  scores = np.float32([1e20, 0, 0, 0, 1e30, -1e30, 1e30, 1e30, 3e38, -3e38, 3e38, 3e38])
  adv = np.asarray(adv_lib.grpo_advantages(scores, np.ones((12, 2), np.float32), 4)[0])[:, 0]
  grouped = scores.astype(np.float64).reshape(3, 4)
  want = (grouped - grouped.mean(1, keepdims=True)) / grouped.std(1, ddof=1, keepdims=True)
  np.testing.assert_allclose(adv, want.reshape(-1), rtol=1e-5)
  centred = np.asarray(adv_lib.dr_grpo_advantages(scores[:8], np.ones((8, 2)), 4)[0])[:, 0]
  np.testing.assert_allclose(centred, (grouped - grouped.mean(1, keepdims=True))[:2].ravel(),
                             rtol=1e-5)
  mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  rewards = np.float32([[0, 1e20, 0], [3e19, 0, 0]])
  adv = np.asarray(adv_lib.reinforce_pp_advantages(rewards, mask, 1.0)[0])
  v = np.array([1e20, 1e20, 3e19])
  np.testing.assert_allclose(adv[mask > 0], (v - v.mean()) / v.std(ddof=1), rtol=1e-5)


def test_reinforce_baseline_centres_each_group_then_whitens_the_returns():
  """REINFORCE++-baseline: each sample's score less its group's mean, taken off at its last
  token, then REINFORCE++ (discounted return-to-go, whitened over the batch), against a float64
  loop; scores with a large common offset keep their differences, and a group whose scores tie
  gets the same advantage as a row with no reward at all (its centred score is exactly 0)."""
  rewards, _, mask = _batch(6)
  lengths = np.asarray(LENGTHS)
  gamma, g = 0.9, 3
  # (Far from zero, a KL penalty at the last token is rounded to the score's float32 precision
  # already in the token rewards: that case has none.)
  for offset, kl_coef in ((0.0, 0.01), (3e5, 0.0)):
    scores = np.float32(offset + np.array([0.1, 0.0, 0.25, 0.1, 0.1, 0.1]))  # group 2 ties
    last = np.zeros(rewards.shape, np.float32)
    last[np.arange(6), lengths - 1] = scores
    token_rewards = np.where(mask > 0, rewards * kl_coef, 0.0).astype(np.float32) + last
    adv = np.asarray(adv_lib.reinforce_baseline_advantages(scores, token_rewards, mask, gamma,
                                                           g)[0])
    grouped = scores.astype(np.float64).reshape(-1, g)
    centred = (grouped - grouped.mean(1, keepdims=True)).reshape(-1)
    ret = np.zeros(rewards.shape)
    for i, n in enumerate(LENGTHS):
      acc = 0.0
      for t in reversed(range(n)):
        acc = rewards[i, t] * kl_coef + (centred[i] if t == n - 1 else 0.0) + gamma * acc
        ret[i, t] = acc
    v = ret[mask > 0]
    np.testing.assert_allclose(adv[mask > 0], (v - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8),
                               rtol=1e-4, atol=1e-4, err_msg=offset)
    np.testing.assert_array_equal(adv[mask == 0], 0.0)
  # Without a KL penalty a tied group's returns are exactly 0: one value, the batch mean's
  # negative over the std, on each of its tokens.
  tied = np.asarray(adv_lib.reinforce_baseline_advantages(scores, last, mask, 1.0, g)[0])[3:]
  assert len(set(tied[mask[3:] > 0].tolist())) == 1
  with pytest.raises(ValueError, match=r"batch size 6.*group_size=4"):
    adv_lib.reinforce_baseline_advantages(scores, last, mask, 1.0, 4)


def test_rloo_matches_leave_one_out_loop():
  rng = np.random.default_rng(4)
  g = 3
  scores = rng.normal(size=2 * g).astype(np.float32)
  mask = np.ones((2 * g, 2), np.float32)
  adv = np.asarray(adv_lib.rloo_advantages(scores, mask, g)[0])[:, 0]
  want = []
  for i in range(2 * g):
    grp = range((i // g) * g, (i // g + 1) * g)
    want.append(scores[i] - np.mean([scores[j] for j in grp if j != i]))
  np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)


def test_rloo_is_exact_for_scores_far_from_zero():
  """Scores with a large common offset (a reward model's bias, rewards in large units): the
  leave-one-out baselines match a float64 loop on the same float32 scores, and a tied group is
  exactly 0. The float32 group sum was rounded to the offset's precision, which biased every
  advantage of the group (for 3e5: by 0.03 against differences of 0.1)."""
  for offset in (3e5, 1e6, 0.1):
    spread = np.array([0.1, 0.0, 0.0, 0.1, 0.25, 0.0, 0.75, 0.5, 0.0, 0.0, 0.0, 0.0])
    scores = np.float32(offset + spread)  # the last group ties
    adv = np.asarray(adv_lib.rloo_advantages(scores, np.ones((12, 2), np.float32), 4)[0])[:, 0]
    grouped = scores.astype(np.float64).reshape(3, 4)
    want = grouped - (grouped.sum(1, keepdims=True) - grouped) / 3
    np.testing.assert_allclose(adv, want.reshape(-1), rtol=1e-5, atol=1e-6, err_msg=offset)
    np.testing.assert_array_equal(adv[8:], 0.0)


def test_reinforce_pp_is_whitened_discounted_return():
  rewards, _, mask = _batch(6)
  gamma = 0.9
  adv = np.asarray(adv_lib.reinforce_pp_advantages(rewards, mask, gamma)[0])
  ret = np.zeros(rewards.shape)
  for i, n in enumerate(LENGTHS):
    g = 0.0
    for t in reversed(range(n)):
      g = rewards[i, t] + gamma * g
      ret[i, t] = g
  v = ret[mask > 0]
  np.testing.assert_allclose(adv[mask > 0], (v - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(adv[mask == 0], 0.0)


def test_registry_dispatch_and_errors():
  rewards, values, mask = _batch()
  scores = np.arange(6, dtype=np.float32)
  common = dict(scores=scores, token_rewards=rewards, values=values, mask=mask, gamma=0.9,
                lam=0.95, group_size=2)
  np.testing.assert_array_equal(adv_lib.compute_advantages("gae", **common)[0],
                                adv_lib.gae(rewards, values, mask, 0.9, 0.95)[0])
  np.testing.assert_array_equal(adv_lib.compute_advantages("grpo", **common)[0],
                                adv_lib.grpo_advantages(scores, mask, 2)[0])
  assert set(adv_lib.ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "dr_grpo", "rloo", "reinforce_pp",
                                               "reinforce_baseline"}
  assert adv_lib.needs_critic("gae")
  assert not any(adv_lib.needs_critic(n) for n in ("grpo", "dr_grpo", "rloo", "reinforce_pp",
                                                   "reinforce_baseline"))
  assert [n for n in adv_lib.ADVANTAGE_ESTIMATORS if adv_lib.compares_groups(n)] == [
      "grpo", "dr_grpo", "rloo", "reinforce_baseline"]
  with pytest.raises(ValueError, match=r"'ppo2'.*\['dr_grpo', 'gae', 'grpo', "
                     r"'reinforce_baseline', 'reinforce_pp', 'rloo'\]"):
    adv_lib.compute_advantages("ppo2", **common)
  with pytest.raises(ValueError, match=r"'gae' needs inputs \['values'\]"):
    adv_lib.compute_advantages("gae", token_rewards=rewards, mask=mask, gamma=1.0, lam=1.0)
  with pytest.raises(ValueError, match="unknown inputs.*'valuez'"):
    adv_lib.compute_advantages("gae", valuez=values, **common)
  with pytest.raises(ValueError, match=r"batch size 6.*group_size=4"):
    adv_lib.grpo_advantages(scores, mask, 4)
  with pytest.raises(ValueError, match="group_size=1 must be >= 2"):
    adv_lib.rloo_advantages(scores, mask, 1)


def test_dr_grpo_centres_each_groups_scores_without_the_std():
  """Dr. GRPO: each sample's score less its group's mean, not divided by the group's std (a
  group of nearly tied scores keeps its small advantages), on every valid token."""
  scores = np.array([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.1], np.float32)
  mask = np.ones((8, 3), np.float32)
  mask[1, 2:] = 0.0
  adv, ret = adv_lib.compute_advantages("dr_grpo", scores=scores, mask=mask, group_size=4)
  grouped = scores.reshape(2, 4).astype(np.float64)
  want = (grouped - grouped.mean(-1, keepdims=True)).reshape(-1)
  np.testing.assert_allclose(np.asarray(adv), want[:, None] * mask, atol=1e-6)
  np.testing.assert_array_equal(adv, ret)
  assert abs(float(adv[7, 0]) - 0.075) < 1e-5  # GRPO would give it ~1.5


def test_an_input_with_a_default_is_optional_and_one_the_trainer_lacks_is_a_config_error(
    monkeypatch):
  """A registered estimator's input is optional when its parameter has a default (no
  hand-kept list to extend), and one without a default that the trainer does not pass is an
  error of algo.estimator when the config is built, not at the first iteration's trace."""
  from rlhfuse_jax.trainer.config import AlgoConfig
  reg = adv_lib.ADVANTAGE_ESTIMATORS

  def centred(scores, mask, group_size, epsilon=0.0):
    return adv_lib.dr_grpo_advantages(scores + epsilon, mask, group_size)

  def by_length(scores, mask, lengths):
    del lengths
    return scores[:, None] * mask, scores[:, None] * mask
  monkeypatch.setitem(reg, "centred", adv_lib.AdvantageEstimator(
      centred, ("scores", "mask", "group_size", "epsilon"), False, "x"))
  monkeypatch.setitem(reg, "by_length", adv_lib.AdvantageEstimator(
      by_length, ("scores", "mask", "lengths"), False, "x"))
  scores, mask = jnp.asarray([1.0, 3.0, 2.0, 2.0]), jnp.ones((4, 2))
  adv, _ = adv_lib.compute_advantages("centred", scores=scores, mask=mask, group_size=2)
  np.testing.assert_array_equal(adv[:, 0], [-1.0, 1.0, 0.0, 0.0])
  assert adv_lib.required_inputs("centred") == ("scores", "mask", "group_size")
  AlgoConfig(estimator="centred")
  with pytest.raises(ValueError, match=r"algo\.estimator='by_length'.*needs \['lengths'\]"):
    AlgoConfig(estimator="by_length")
  # A wrapper taking **kwargs (no functools.wraps): what its signature does not show is optional
  monkeypatch.setitem(reg, "wrapped", dataclasses.replace(
      reg["grpo"], fn=lambda **kw: adv_lib.grpo_advantages(**kw)))
  assert adv_lib.required_inputs("wrapped") == ()
  AlgoConfig(estimator="wrapped")
  np.testing.assert_array_equal(
      adv_lib.compute_advantages("wrapped", scores=scores, mask=mask, group_size=2)[0],
      adv_lib.grpo_advantages(scores, mask, 2)[0])


def test_the_trainer_passes_what_trainer_inputs_says(monkeypatch):
  """adv_lib.TRAINER_INPUTS (what the config check allows an estimator to need) is what
  trainer/ppo.advantages_and_returns passes."""
  from rlhfuse_jax.trainer import ppo
  from rlhfuse_jax.trainer.config import AlgoConfig
  seen = {}

  def record(name, **inputs):
    seen.update(inputs)
    return inputs["mask"], inputs["mask"]
  monkeypatch.setattr(adv_lib, "compute_advantages", record)
  mask = jnp.ones((4, 3))
  ppo.advantages_and_returns(AlgoConfig(), 2, jnp.ones(4), mask, -mask, -mask, mask)
  assert set(seen) == adv_lib.TRAINER_INPUTS


def test_a_registry_entry_whose_inputs_miss_its_parameters_is_refused_when_made():
  """An AdvantageEstimator whose `inputs` misspell a parameter, leave out one without a default,
  or leave out one the trainer passes (group_size with a default: never passed, and the entry no
  group estimator) is refused when it is made, naming the parameters; before, the first case
  failed at the run's first iteration with a bare TypeError and the last trained silently with
  the default."""
  def centred(scores, mask, group_size):
    return adv_lib.dr_grpo_advantages(scores, mask, group_size)

  def with_default(scores, mask, group_size=4):
    return adv_lib.dr_grpo_advantages(scores, mask, group_size)
  with pytest.raises(ValueError, match=r"centred.*it takes no \['group_sise'\]; missing "
                                       r"\['group_size'\]"):
    adv_lib.AdvantageEstimator(centred, ("scores", "mask", "group_sise"), False, "x")
  with pytest.raises(ValueError, match=r"centred.*missing \['group_size'\]"):
    adv_lib.AdvantageEstimator(centred, ("scores", "mask"), False, "x")
  with pytest.raises(ValueError, match=r"with_default.*missing \['group_size'\]"):
    adv_lib.AdvantageEstimator(with_default, ("scores", "mask"), False, "x")
  # A default parameter the trainer does not pass may stay out (a constant of the estimator).
  def scaled(scores, mask, group_size, scale=2.0):
    return adv_lib.dr_grpo_advantages(scores * scale, mask, group_size)
  adv_lib.AdvantageEstimator(scaled, ("scores", "mask", "group_size"), False, "x")
  adv_lib.AdvantageEstimator(lambda **kw: kw, ("scores", "anything"), False, "x")  # unchecked


def test_grpo_gives_a_tied_group_of_huge_scores_zero_advantages():
  """A group whose scores tie beyond ~1e32 (which the reward check lets through): its std is
  exactly 0, and eps over the group's power-of-two scale (1e-6 / 2**106 and below) is subnormal,
  which XLA flushes to 0: the group's advantages were 0 / 0, NaN. A group that does not tie
  keeps the float64 reference's values."""
  scores = np.float32([1e33, 1e33, 1e33, 1e33, 3e38, 3e38, 3e38, 3e38, -1e35, -1e35, 2e35, 2e35])
  adv = np.asarray(adv_lib.grpo_advantages(scores, np.ones((12, 2), np.float32), 4)[0])[:, 0]
  np.testing.assert_array_equal(adv[:8], 0.0)
  g = scores[8:].astype(np.float64)
  np.testing.assert_allclose(adv[8:], (g - g.mean()) / g.std(ddof=1), rtol=1e-5)


def test_the_share_of_groups_whose_rewards_tie_is_logged():
  """reward/tied_group_frac: the prompts whose samples' rewards all tie (GRPO gives them
  advantages of 0: DAPO's dynamic sampling would replace them), on the rewards before any KL
  penalty; only with groups (samples_per_prompt > 1)."""
  from rlhfuse_jax.trainer import ppo
  from rlhfuse_jax.trainer.config import AlgoConfig
  # 4 groups of 3: [0 0 0] ties, [1 0 1] not, [1 1 1] ties, [0.5 0.5 0.25] not.
  scores = jnp.asarray([0, 0, 0, 1, 0, 1, 1, 1, 1, 0.5, 0.5, 0.25], jnp.float32)
  mask = jnp.ones((12, 4), jnp.float32)
  rng = np.random.default_rng(0)
  old, ref = (jnp.asarray(rng.normal(-2, 1, (12, 4)), jnp.float32) for _ in range(2))
  for kl_in_reward in (True, False):  # a KL penalty in the reward does not untie them
    algo = AlgoConfig(estimator="grpo", kl_coef=0.1, kl_in_reward=kl_in_reward,
                      kl_estimator="k3")
    adv, _, m = ppo.rollout_statistics(algo, 3, scores, mask, old, ref, jnp.zeros((12, 4)))
    assert float(m["reward/tied_group_frac"]) == 0.5
    if not kl_in_reward:  # the tied groups' advantages
      np.testing.assert_array_equal(np.asarray(adv)[[0, 1, 2, 6, 7, 8]], 0.0)
  _, _, m = ppo.rollout_statistics(AlgoConfig(estimator="reinforce_pp"), 1, scores, mask, old,
                                   ref, jnp.zeros((12, 4)))
  assert "reward/tied_group_frac" not in m
