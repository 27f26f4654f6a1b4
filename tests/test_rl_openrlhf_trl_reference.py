"""The RL math against OpenRLHF's and TRL's formulas (verl's: test_rl_public_reference.py), on
random batches of several layouts: ragged rows, rows that fill the grid (cut off, no EOS),
length-1 rows, a one-token grid, gamma and lambda below 1, groups whose scores tie, binary
rewards, groups of 2 to 5 samples.

Written in float64 numpy from the public code, not from ours (each cited by repository + path +
function):

- OpenRLHF/OpenRLHF openrlhf/models/utils.py: compute_reward (the score at the last action
  token, -kl_coef * kl on every token), compute_approx_kl (k1, k2, k3).
- openrlhf/trainer/ppo_utils/experience_maker.py: get_advantages_and_returns (GAE on the masked
  rewards and values, the next value read at t + 1, 0 past the grid), get_cumulative_returns,
  compute_advantages_and_returns (rloo, reinforce_baseline / dr_grpo, group_norm reward
  shaping before compute_reward; the batch whitening of gae and reinforce advantages:
  mean and BIASED variance over the action tokens, var.clamp(min=1e-8).rsqrt()).
- huggingface/trl trl/trainer/grpo_trainer.py: _compute_loss (per_token_loss = -min(coef_1 A,
  clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high) A) + beta * k3 to the reference; loss_type
  "bnpo": the batch's token mean, "grpo": the mean over sequences of each one's token mean,
  "dr_grpo": the sum over batch * max_completion_length).

Where we differ on purpose (docs/usage.md "The objectives against verl, TRL and OpenRLHF": the
whitening's Bessel-corrected variance, the KL loss term's token mean) the test pins our side.
"""
import numpy as np
import pytest

from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.rl import objective
from rlhfuse_jax.trainer import ppo
from rlhfuse_jax.trainer.config import AlgoConfig

# (group size, response lengths, grid T): rows at T have no EOS (cut off by max_new_tokens).
LAYOUTS = {
    "ragged": (4, [6, 6, 1, 3, 2, 6, 5, 4], 6),
    "pairs": (2, [5, 1, 3, 3, 5, 5], 5),
    "one_token": (3, [1, 1, 1, 1, 1, 1], 1),
    "wide": (5, [9, 2, 7, 9, 1, 3, 8, 9, 4, 6], 9),
}


def _layout(name, seed, scores="normal"):
  g, lengths, t = LAYOUTS[name]
  lengths = np.asarray(lengths)
  b = len(lengths)
  rng = np.random.default_rng(seed)
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  if scores == "binary":
    s = rng.integers(0, 2, size=b).astype(np.float32)
  else:
    s = rng.normal(size=b).astype(np.float32)
  s[:g] = s[0]  # the first group's scores tie (std 0)
  f = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
  return {"g": g, "lengths": lengths, "mask": mask, "scores": s, "values": f(b, t),
          "logp": f(b, t) * 0.5 - 1.0, "ref_logp": f(b, t) * 0.5 - 1.0}


def _close(ours, reference, mask, tol=3e-5):
  np.testing.assert_allclose(np.asarray(ours, np.float64) * mask, reference * mask, rtol=tol,
                             atol=tol)


def _ours(estimator, x, **algo):
  adv, ret, rewards, _ = ppo.advantages_and_returns(
      AlgoConfig(estimator=estimator, **algo), x["g"], x["scores"], x["mask"], x["logp"],
      x["ref_logp"], x["values"])
  return np.asarray(adv), np.asarray(ret), np.asarray(rewards)


# openrlhf/models/utils.py ----------------------------------------------------------------------

def _openrlhf_approx_kl(logp, ref_logp, kind):
  log_ratio = np.asarray(logp, np.float64) - np.asarray(ref_logp, np.float64)
  if kind == "k1":
    return log_ratio
  if kind == "k2":
    return log_ratio ** 2 / 2.0
  return np.exp(-log_ratio) - 1 + log_ratio  # k3


def _openrlhf_compute_reward(r, kl_coef, kl, action_mask):
  eos = action_mask.shape[1] - 1 - np.argmax(action_mask[:, ::-1], axis=1)
  last_reward = np.zeros(kl.shape)
  last_reward[np.arange(len(r)), eos] = r
  return last_reward + -kl_coef * kl


# openrlhf/trainer/ppo_utils/experience_maker.py ------------------------------------------------

def _openrlhf_gae(values, rewards, action_mask, gamma, lambd):
  values, rewards = action_mask * values, action_mask * rewards
  t_len = rewards.shape[1]
  lastgaelam, reversed_adv = 0.0, []
  for t in reversed(range(t_len)):
    nextvalues = values[:, t + 1] if t < t_len - 1 else 0.0
    delta = rewards[:, t] + gamma * nextvalues - values[:, t]
    lastgaelam = delta + gamma * lambd * lastgaelam
    reversed_adv.append(lastgaelam)
  advantages = np.stack(reversed_adv[::-1], axis=1)
  return advantages, advantages + values


def _openrlhf_cumulative_returns(rewards, action_mask, gamma):
  rewards = action_mask * rewards
  returns, cumulative = np.zeros_like(rewards), np.zeros(rewards.shape[0])
  for t in reversed(range(rewards.shape[1])):
    cumulative = rewards[:, t] + gamma * cumulative
    returns[:, t] = cumulative
  return returns


def _openrlhf_shape_rewards(r, n, estimator):
  r = np.asarray(r, np.float64).reshape(-1, n)
  if estimator == "rloo":
    r = r - (r.sum(-1, keepdims=True) - r) / (n - 1)
  elif estimator in ("reinforce_baseline", "dr_grpo"):
    r = r - r.mean(-1, keepdims=True)
  elif estimator == "group_norm":
    r = (r - r.mean(-1, keepdims=True)) / (r.std(-1, ddof=1, keepdims=True) + 1e-9)
  return r.reshape(-1)


def _openrlhf_normalize(adv, action_mask):
  n = action_mask.sum()
  mean = (adv * action_mask).sum() / n
  var = ((adv - mean) ** 2 * action_mask).sum() / n
  return (adv - mean) / np.sqrt(max(var, 1e-8))


def _bessel(mask):
  """Our whitening divides by the Bessel-corrected std (as verl): OpenRLHF's result times this."""
  n = mask.sum()
  return np.sqrt((n - 1) / n)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.5, 0.0)])
def test_gae_and_token_rewards_match_openrlhf(layout, gamma, lam):
  x = _layout(layout, seed=len(layout))
  m = x["mask"].astype(np.float64)
  kl = _openrlhf_approx_kl(x["logp"], x["ref_logp"], "k2") * m
  rewards = _openrlhf_compute_reward(x["scores"], 0.05, kl, m)
  expected_adv, expected_ret = _openrlhf_gae(x["values"].astype(np.float64), rewards, m, gamma,
                                             lam)
  adv, ret, token_rewards = _ours("gae", x, gamma=gamma, lam=lam, kl_coef=0.05,
                                  kl_estimator="k2", whiten_advantages=False)
  _close(token_rewards, rewards, m)
  _close(adv, expected_adv, m)
  _close(ret, expected_ret, m)
  if m.sum() > 1:
    adv, ret_w, _ = _ours("gae", x, gamma=gamma, lam=lam, kl_coef=0.05, kl_estimator="k2")
    _close(adv, _openrlhf_normalize(expected_adv, m) * _bessel(m), m, tol=1e-4)
    _close(ret_w, expected_ret, m)  # the critic's target is taken before the whitening


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("scores", ["normal", "binary"])
def test_group_baselines_match_openrlhf(layout, scores):
  # Without a KL penalty OpenRLHF's reward shaping, compute_reward and get_cumulative_returns
  # (gamma 1) give every token of a sample its shaped score: our advantages. (With one, OpenRLHF
  # adds the KL per token after the shaping; we shape the penalised score, as verl.)
  x = _layout(layout, seed=7, scores=scores)
  m, g = x["mask"].astype(np.float64), x["g"]
  for ours_name, theirs in (("grpo", "group_norm"), ("dr_grpo", "dr_grpo"), ("rloo", "rloo")):
    shaped = _openrlhf_shape_rewards(x["scores"], g, theirs)
    expected = _openrlhf_cumulative_returns(_openrlhf_compute_reward(shaped, 0.0, 0 * m, m), m,
                                            1.0)
    adv, ret, _ = _ours(ours_name, x, kl_coef=0.0)
    # GRPO's eps is 1e-6 to OpenRLHF's 1e-9: a relative 1e-6 / std.
    _close(adv, expected, m, tol=1e-5)
    _close(ret, expected, m, tol=1e-5)
    # The tied first group has no signal in either (0 / (0 + eps) = 0, exactly here).
    assert not np.asarray(adv)[:g].any(), ours_name


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("gamma", [1.0, 0.7])
def test_reinforce_pp_matches_openrlhf_reinforce(layout, gamma):
  x = _layout(layout, seed=11)
  m = x["mask"].astype(np.float64)
  kl = _openrlhf_approx_kl(x["logp"], x["ref_logp"], "k1") * m
  returns = _openrlhf_cumulative_returns(_openrlhf_compute_reward(x["scores"], 0.05, kl, m), m,
                                         gamma)
  adv, ret, _ = _ours("reinforce_pp", x, gamma=gamma, kl_coef=0.05, kl_estimator="k1")
  _close(adv, _openrlhf_normalize(returns, m) * _bessel(m), m, tol=1e-4)
  _close(ret, adv, m)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("gamma", [1.0, 0.7])
@pytest.mark.parametrize("scores", ["normal", "binary"])
def test_reinforce_baseline_matches_openrlhf(layout, gamma, scores):
  # OpenRLHF's reinforce_baseline: each bare score less its group's mean, then compute_reward
  # (the KL per token), get_cumulative_returns and the batch whitening, as "reinforce". OpenRLHF
  # runs it at gamma 1 only (compute_advantages_and_returns sets args.gamma = 1.0 for it, with a
  # warning); ours discounts by algo.gamma (docs/usage.md), pinned here at 0.7 by the same
  # formula with the discount OpenRLHF would have replaced.
  x = _layout(layout, seed=17, scores=scores)
  m, g = x["mask"].astype(np.float64), x["g"]
  kl = _openrlhf_approx_kl(x["logp"], x["ref_logp"], "k1") * m
  shaped = _openrlhf_shape_rewards(x["scores"], g, "reinforce_baseline")
  returns = _openrlhf_cumulative_returns(_openrlhf_compute_reward(shaped, 0.05, kl, m), m, gamma)
  adv, ret, token_rewards = _ours("reinforce_baseline", x, gamma=gamma, kl_coef=0.05,
                                  kl_estimator="k1")
  _close(adv, _openrlhf_normalize(returns, m) * _bessel(m), m, tol=1e-4)
  _close(ret, adv, m)
  # The trainer's token rewards carry the bare score (the baseline is the estimator's own).
  _close(token_rewards, _openrlhf_compute_reward(x["scores"], 0.05, kl, m), m)


# trl/trainer/grpo_trainer.py -------------------------------------------------------------------

def _trl_grpo_loss(logp, old_logp, ref_logp, adv, mask, eps_low, eps_high, beta, loss_type,
                   max_completion_length):
  logp, old_logp, ref_logp = (np.asarray(a, np.float64) for a in (logp, old_logp, ref_logp))
  per_token_kl = np.exp(ref_logp - logp) - (ref_logp - logp) - 1
  coef_1 = np.exp(logp - old_logp)
  coef_2 = np.clip(coef_1, 1 - eps_low, 1 + eps_high)
  per_token_loss = -np.minimum(coef_1 * adv[:, None], coef_2 * adv[:, None])
  per_token_loss = per_token_loss + beta * per_token_kl
  if loss_type == "grpo":
    return ((per_token_loss * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).mean()
  if loss_type == "bnpo":
    return (per_token_loss * mask).sum() / max(mask.sum(), 1.0)
  assert loss_type == "dr_grpo"
  return (per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_completion_length)


TRL_LOSS_AGG = {"bnpo": "token-mean", "grpo": "seq-mean-token-mean",
                "dr_grpo": "seq-mean-token-sum-norm"}


@pytest.mark.parametrize("layout", ["ragged", "wide"])
@pytest.mark.parametrize("loss_type", sorted(TRL_LOSS_AGG))
def test_grpo_loss_matches_trl(layout, loss_type):
  x = _layout(layout, seed=13)
  m = x["mask"].astype(np.float64)
  rng = np.random.default_rng(14)
  old_logp = x["logp"] + rng.normal(size=m.shape).astype(np.float32) * 0.3
  adv = np.asarray(adv_lib.grpo_advantages(x["scores"], x["mask"], x["g"])[0][:, 0])
  batch = {"mask": x["mask"], "old_logp": old_logp, "ref_logp": x["ref_logp"],
           "advantages": adv[:, None] * x["mask"]}
  entropy = np.zeros_like(x["mask"])
  t = m.shape[1]
  for beta in (0.0, 0.04):
    cfg = objective.LossConfig(clip_eps=0.2, clip_eps_high=0.28, kl_coef=beta,
                               kl_estimator="k3", loss_agg=TRL_LOSS_AGG[loss_type])
    loss, metrics = objective.actor_objective(cfg, x["logp"], entropy, batch)
    pg = _trl_grpo_loss(x["logp"], old_logp, x["ref_logp"], adv, m, 0.2, 0.28, 0.0, loss_type, t)
    if beta == 0.0:
      _close(loss, pg, 1.0)
      continue
    trl = _trl_grpo_loss(x["logp"], old_logp, x["ref_logp"], adv, m, 0.2, 0.28, beta,
                         loss_type, t)
    if loss_type == "bnpo":  # the token mean: the KL term aggregates as TRL's
      _close(loss, trl, 1.0)
    # Ours: the KL loss term is a token mean whatever loss_agg is (TRL aggregates it as the
    # policy term): TRL's policy term + beta * the token mean of k3.
    kl_token_mean = _trl_grpo_loss(x["logp"], x["logp"], x["ref_logp"], 0 * adv, m, 0.2, 0.28,
                                   1.0, "bnpo", t)
    _close(metrics["kl_loss"], kl_token_mean, 1.0)
    _close(loss, pg + beta * kl_token_mean, 1.0)
