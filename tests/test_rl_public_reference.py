"""The RL math against transcriptions of the public implementations it claims to match.

tests/test_rl_*.py compare with numpy references written from our own reading; these compare
with float64 numpy transcriptions of the widely used code (each cited by repository + path +
function), so a misreading we share with our own references still fails here:

- verl: volcengine/verl, verl/trainer/ppo/core_algos.py (compute_gae_advantage_return,
  compute_grpo_outcome_advantage, compute_rloo_outcome_advantage,
  compute_reinforce_plus_plus_outcome_advantage, compute_policy_loss_vanilla,
  compute_value_loss, kl_penalty, agg_loss), verl/utils/torch_functional.py (masked_whiten:
  Bessel-corrected masked_var, rsqrt(var + 1e-8)), verl/trainer/ppo/ray_trainer.py
  (apply_kl_penalty: token_level_scores - beta * kl_penalty(old_log_prob, ref_log_prob)).
- TRL: huggingface/trl, trl/trainer/grpo_trainer.py (_compute_loss, loss_type "grpo" and
  "dr_grpo"), trl/trainer/utils.py (nanstd: Bessel-corrected).
- OpenRLHF: OpenRLHF/OpenRLHF, openrlhf/models/utils.py (compute_approx_kl, compute_reward).

Where we differ on purpose (docs/usage.md "The objectives against verl, TRL and OpenRLHF") the
test pins our side of the difference.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.rl import kl as kl_lib
from rlhfuse_jax.rl import losses
from rlhfuse_jax.trainer import ppo
from rlhfuse_jax.trainer.config import AlgoConfig

B, T, G = 8, 7, 4  # rows, response grid, group size (two prompts of four samples)
LENGTHS = np.array([7, 3, 1, 5, 7, 2, 6, 4])


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  mask = (np.arange(T)[None] < LENGTHS[:, None]).astype(np.float32)
  f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
  return {"mask": mask, "scores": f(B), "values": f(B, T) * mask, "logp": f(B, T) * 0.5 - 1.0,
          "ref_logp": f(B, T) * 0.5 - 1.0, "rewards": f(B, T) * mask, "advantages": f(B, T)}


def _close(ours, reference, mask=None, tol=2e-5):
  ours = np.asarray(ours, np.float64)
  if mask is not None:  # the references leave carries or garbage on padding; we leave 0
    ours, reference = ours * mask, reference * mask
  np.testing.assert_allclose(ours, reference, rtol=tol, atol=tol)


# verl/utils/torch_functional.py ---------------------------------------------------------------

def _verl_masked_whiten(x, m):
  n = m.sum()
  mean = (x * m).sum() / n
  var = ((x - mean) ** 2 * m).sum() / n * n / (n - 1)  # unbiased=True
  return (x - mean) / np.sqrt(var + 1e-8)


# verl/trainer/ppo/core_algos.py ---------------------------------------------------------------

def _verl_gae(r, v, m, gamma, lam):
  """compute_gae_advantage_return: (whitened advantages, returns = raw advantages + values)."""
  r, v, m = (np.asarray(a, np.float64) for a in (r, v, m))
  nextvalues, lastgaelam, out = 0.0, 0.0, []
  for t in reversed(range(r.shape[1])):
    delta = r[:, t] + gamma * nextvalues - v[:, t]
    lastgaelam_ = delta + gamma * lam * lastgaelam
    nextvalues = v[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
    lastgaelam = lastgaelam_ * m[:, t] + (1 - m[:, t]) * lastgaelam
    out.append(lastgaelam)
  adv = np.stack(out[::-1], axis=1)
  return _verl_masked_whiten(adv, m), adv + v


def _verl_grpo(token_rewards, m, norm_by_std=True, epsilon=1e-6):
  """compute_grpo_outcome_advantage (torch.std: Bessel-corrected; index = consecutive groups)."""
  s = np.asarray(token_rewards, np.float64).sum(-1).reshape(-1, G)
  adv = s - s.mean(-1, keepdims=True)
  if norm_by_std:
    adv = adv / (s.std(-1, ddof=1, keepdims=True) + epsilon)
  return adv.reshape(-1)[:, None] * m


def _verl_rloo(token_rewards, m):
  s = np.asarray(token_rewards, np.float64).sum(-1).reshape(-1, G)
  adv = s * G / (G - 1) - s.mean(-1, keepdims=True) * G / (G - 1)
  return adv.reshape(-1)[:, None] * m


def _verl_reinforce_pp(token_rewards, m, gamma):
  r = np.asarray(token_rewards, np.float64)
  returns, running = np.zeros_like(r), 0.0
  for t in reversed(range(r.shape[1])):
    running = r[:, t] + gamma * running
    returns[:, t] = running
    running = running * m[:, t]  # "Reset after EOS"
  return _verl_masked_whiten(returns, m) * m


def _verl_kl_penalty(logp, ref_logp, kind):
  logp, ref_logp = np.asarray(logp, np.float64), np.asarray(ref_logp, np.float64)
  if kind == "k1":
    return logp - ref_logp
  if kind == "abs":
    return np.abs(logp - ref_logp)
  if kind == "k2":  # "mse"
    return 0.5 * (logp - ref_logp) ** 2
  kl = np.clip(ref_logp - logp, -20, 20)  # "low_var_kl"
  return np.clip(np.exp(kl) - kl - 1, -10, 10)


def _verl_apply_kl_penalty(scores, logp, ref_logp, m, beta, kind):
  """ray_trainer.apply_kl_penalty on token_level_scores (the score at the last valid token)."""
  token_scores = np.zeros(m.shape)
  token_scores[np.arange(len(scores)), LENGTHS - 1] = scores
  return token_scores - beta * _verl_kl_penalty(logp, ref_logp, kind) * m


def _verl_agg_loss(x, m, mode):
  if mode == "token-mean":
    return (x * m).sum() / m.sum()
  if mode == "seq-mean-token-sum":
    return (x * m).sum(-1).mean()
  if mode == "seq-mean-token-mean":
    return ((x * m).sum(-1) / m.sum(-1)).mean()
  assert mode == "seq-mean-token-sum-norm"
  return (x * m).sum() / m.shape[-1]


def _verl_policy_loss(old_logp, logp, adv, m, lo, hi, clip_ratio_c, mode):
  """compute_policy_loss_vanilla: (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)."""
  old_logp, logp, adv = (np.asarray(a, np.float64) for a in (old_logp, logp, adv))
  neg_kl = np.clip(logp - old_logp, -20.0, 20.0)
  ratio = np.exp(neg_kl)
  l1 = -adv * ratio
  l2 = -adv * np.clip(ratio, 1 - lo, 1 + hi)
  c1 = np.maximum(l1, l2)
  l3 = -adv * clip_ratio_c
  c2 = np.minimum(l3, c1)
  pg = np.where(adv < 0, c2, c1)
  mean = lambda x: (x * m).sum() / m.sum()  # noqa: E731
  return (_verl_agg_loss(pg, m, mode), mean(l2 > l1), mean(-neg_kl),
          mean((c1 > l3) * (adv < 0)))


def _verl_value_loss(vpreds, returns, values, m, cliprange_value):
  vpreds, returns, values = (np.asarray(a, np.float64) for a in (vpreds, returns, values))
  clipped = np.clip(vpreds, values - cliprange_value, values + cliprange_value)
  l1, l2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
  return 0.5 * _verl_agg_loss(np.maximum(l1, l2), m, "token-mean"), (l2 > l1).astype(float)


# Advantages: the trainer's whole path, ppo.advantages_and_returns --------------------------------

def _ours(estimator, x, **algo):
  cfg = AlgoConfig(estimator=estimator, **algo)
  adv, ret, token_rewards, _ = ppo.advantages_and_returns(
      cfg, G, x["scores"], x["mask"], x["logp"], x["ref_logp"], x["values"])
  return np.asarray(adv), np.asarray(ret), np.asarray(token_rewards)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_gae_kl_in_reward_and_whitening_match_verl(kind):
  x = _inputs()
  adv, ret, token_rewards = _ours("gae", x, gamma=0.9, lam=0.8, kl_coef=0.05, kl_estimator=kind)
  expected_rewards = _verl_apply_kl_penalty(x["scores"], x["logp"], x["ref_logp"], x["mask"],
                                            0.05, kind)
  _close(token_rewards, expected_rewards, x["mask"])
  expected_adv, expected_ret = _verl_gae(expected_rewards, x["values"], x["mask"], 0.9, 0.8)
  _close(adv, expected_adv, x["mask"])
  _close(ret, expected_ret, x["mask"])  # the critic's target: before the whitening


def test_gae_skips_holes_in_the_mask_as_verl_does():
  # verl's GAE carries the next value and advantage over masked positions (tool-output tokens).
  x = _inputs(1)
  mask = x["mask"].copy()
  mask[0, [1, 4]] = 0.0
  mask[3, 2] = 0.0
  adv, ret = adv_lib.gae(x["rewards"], x["values"], mask, 0.95, 0.9)
  _, expected_ret = _verl_gae(x["rewards"] * mask, x["values"] * mask, mask, 0.95, 0.9)
  _close(adv, expected_ret - x["values"] * mask, mask)  # before verl's whitening
  _close(ret, expected_ret, mask)


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_grpo_matches_verl_bessel_std_and_eps(kl_in_reward):
  x = _inputs(2)
  kw = dict(kl_coef=0.05, kl_in_reward=kl_in_reward, kl_estimator="k1" if kl_in_reward else "k3")
  adv, ret, _ = _ours("grpo", x, **kw)
  beta = 0.05 if kl_in_reward else 0.0  # verl's GRPO sums the token-level rewards
  rewards = _verl_apply_kl_penalty(x["scores"], x["logp"], x["ref_logp"], x["mask"], beta, "k1")
  _close(adv, _verl_grpo(rewards, x["mask"]))
  _close(ret, adv)


def test_grpo_std_is_bessel_corrected_not_the_population_std():
  # A group of two: ddof=1 gives +-1/sqrt(2), ddof=0 would give +-1 (TRL's nanstd and
  # OpenRLHF's torch.std are Bessel-corrected too).
  mask = np.ones((2, 1), np.float32)
  adv, _ = adv_lib.grpo_advantages(np.array([1.0, 0.0], np.float32), mask, 2)
  _close(adv[:, 0], np.array([1.0, -1.0]) / (np.sqrt(0.5) + 1e-6) * 0.5)


def test_dr_grpo_and_rloo_match_verl():
  x = _inputs(3)
  rewards = _verl_apply_kl_penalty(x["scores"], x["logp"], x["ref_logp"], x["mask"], 0.0, "k1")
  adv, _, _ = _ours("dr_grpo", x, kl_coef=0.0)
  _close(adv, _verl_grpo(rewards, x["mask"], norm_by_std=False))
  adv, _, _ = _ours("rloo", x, kl_coef=0.0)
  _close(adv, _verl_rloo(rewards, x["mask"]))
  # RLOO's baseline is the mean of the OTHER samples (Ahmadian et al. 2024, eq. 6).
  s = x["scores"].astype(np.float64).reshape(-1, G)
  others = (s.sum(-1, keepdims=True) - s) / (G - 1)
  _close(adv[:, 0], (s - others).reshape(-1))


def test_reinforce_pp_matches_verl():
  x = _inputs(4)
  adv, _, _ = _ours("reinforce_pp", x, gamma=0.97, kl_coef=0.05, kl_estimator="k2")
  rewards = _verl_apply_kl_penalty(x["scores"], x["logp"], x["ref_logp"], x["mask"], 0.05, "k2")
  _close(adv, _verl_reinforce_pp(rewards, x["mask"], 0.97))


# Losses ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_loss_clip_higher_and_dual_clip_match_verl(mode):
  x = _inputs(5)
  old = x["logp"] + np.random.default_rng(5).normal(size=(B, T)).astype(np.float32) * 0.4
  adv = x["advantages"].copy()
  old[:2, 0] = x["logp"][:2, 0] - 2.0  # ratio e^2 > clip_ratio_c on two bad tokens: dual clip
  adv[:2, 0] = -1.0
  loss, m = losses.policy_loss(x["logp"], old, adv, x["mask"], 0.2, 0.28, mode, clip_ratio_c=3.0)
  pg, clipfrac, ppo_kl, clipfrac_lower = _verl_policy_loss(old, x["logp"], adv, x["mask"], 0.2,
                                                           0.28, 3.0, mode)
  assert 0 < clipfrac < 1 and 0 < clipfrac_lower  # both clips bind somewhere in this batch
  _close(loss, pg)
  _close(m["pg_clipfrac"], clipfrac)
  _close(m["ppo_kl"], ppo_kl)
  _close(m["pg_clipfrac_lower"], clipfrac_lower)


def test_dr_grpo_aggregation_is_trls_and_verls_over_the_sequence_count():
  # TRL's loss_type="dr_grpo": sum(loss * mask) / (batch * max_completion_length); verl's
  # seq-mean-token-sum-norm does not divide by the batch (a documented difference).
  x = _inputs(6)
  loss = losses.aggregate_loss(x["advantages"], x["mask"], "seq-mean-token-sum-norm")
  trl = (x["advantages"] * x["mask"]).astype(np.float64).sum() / (B * T)
  _close(loss, trl)
  _close(loss * B, _verl_agg_loss(x["advantages"].astype(np.float64), x["mask"],
                                  "seq-mean-token-sum-norm"))
  # TRL's loss_type="grpo" (DeepSeekMath eq. 3's 1/G sum_i 1/|o_i| sum_t) is ours
  # seq-mean-token-mean.
  grpo = ((x["advantages"] * x["mask"]).sum(-1) / x["mask"].sum(-1)).mean()
  _close(losses.aggregate_loss(x["advantages"], x["mask"], "seq-mean-token-mean"), grpo)


def test_value_loss_matches_verl():
  x = _inputs(7)
  old_values = x["values"]
  vpreds = old_values + np.random.default_rng(7).normal(size=(B, T)).astype(np.float32) * 0.3
  returns = x["rewards"]
  loss, m = losses.value_loss(vpreds, old_values, returns, x["mask"], 0.2)
  expected, clipped = _verl_value_loss(vpreds, returns, old_values, x["mask"], 0.2)
  _close(loss, expected)
  # verl counts clipped > unclipped; ours also needs |V - V_old| > eps (a rounding tie inside
  # the range is not a clip): the same count wherever no error ties.
  _close(m["vf_clipfrac"], (clipped * x["mask"]).sum() / x["mask"].sum())


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_kl_estimators_match_verl_and_openrlhf(kind):
  x = _inputs(8)
  ours = kl_lib.kl_estimate(x["logp"], x["ref_logp"], kind)
  _close(ours, _verl_kl_penalty(x["logp"], x["ref_logp"], kind))
  if kind != "abs":  # OpenRLHF's compute_approx_kl(log_probs, log_probs_base)
    r = x["logp"].astype(np.float64) - x["ref_logp"]
    openrlhf = {"k1": r, "k2": r ** 2 / 2.0, "k3": np.exp(-r) - 1 + r}[kind]
    _close(ours, openrlhf)


def test_k3_is_not_capped_at_10_as_verls_low_var_kl_is():
  # verl clamps low_var_kl to [-10, 10] (a token past 10 then has no gradient back to the
  # reference); ours keeps exp(r) - r - 1 up to r = 20 (rl/kl.py), as OpenRLHF and TRL do.
  logp, ref_logp = np.array([0.0, -8.0]), np.array([-8.0, 0.0])
  ours = np.asarray(kl_lib.kl_estimate(logp, ref_logp, "k3"))
  _close(ours, np.exp(ref_logp - logp) - (ref_logp - logp) - 1, tol=1e-5)
  assert ours.min() > 7 and ours.max() > 2900
  assert _verl_kl_penalty(logp, ref_logp, "k3").max() == 10


# Which KL a KL loss term's gradient minimises --------------------------------------------------

@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_loss_gradient_directions(kind):
  """The expected gradient of a token's KL loss term on the policy's own samples,
  sum_a pi(a) grad kl_estimate(log pi(a), log ref(a)), computed exactly on a categorical:
  k1's is zero (config refuses it as a loss), k2's is that of the reverse KL(pi || ref) the
  reward's penalty estimates, k3's (GRPO's loss, DeepSeekMath eq. 4) that of the forward
  KL(ref || pi) (Tang & Munos 2025, arXiv 2506.09477, "On a few pitfalls in KL divergence
  gradient estimation for RL"; docs/usage.md "The objectives against verl, TRL and OpenRLHF")."""
  rng = np.random.default_rng(9)
  theta = jnp.asarray(rng.normal(size=6), jnp.float32)
  log_ref = jax.nn.log_softmax(jnp.asarray(rng.normal(size=6) * 1.5, jnp.float32))

  def surrogate(t):  # the loss term over every token a, weighted by its (fixed) probability
    log_pi = jax.nn.log_softmax(t)
    return jnp.sum(jax.lax.stop_gradient(jnp.exp(log_pi)) *
                   kl_lib.kl_estimate(log_pi, log_ref, kind))

  def reverse_kl(t):
    log_pi = jax.nn.log_softmax(t)
    return jnp.sum(jnp.exp(log_pi) * (log_pi - log_ref))

  def forward_kl(t):
    return jnp.sum(jnp.exp(log_ref) * (log_ref - jax.nn.log_softmax(t)))

  ours = np.asarray(jax.grad(surrogate)(theta))
  expected = {"k1": np.zeros(6), "k2": np.asarray(jax.grad(reverse_kl)(theta)),
              "k3": np.asarray(jax.grad(forward_kl)(theta))}[kind]
  _close(ours, expected, tol=1e-5)
  if kind != "k1":  # and the two directions do differ here
    other = jax.grad(forward_kl if kind == "k2" else reverse_kl)(theta)
    assert np.abs(ours - np.asarray(other)).max() > 1e-2
