"""KL estimators: formulas, k3 >= 0, and unbiasedness for sampled tokens."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from rlhfuse_jax.rl import kl


def test_formulas_match_numpy_and_mask():
  rng = np.random.default_rng(0)
  logp = -rng.exponential(size=(3, 5)).astype(np.float32)
  ref = -rng.exponential(size=(3, 5)).astype(np.float32)
  d = logp - ref
  expected = {"k1": d, "k2": 0.5 * d ** 2, "k3": np.exp(-d) + d - 1, "abs": np.abs(d)}
  for kind, want in expected.items():
    np.testing.assert_allclose(kl.kl_estimate(logp, ref, kind), want, rtol=1e-5, atol=1e-6)
  mask = np.ones((3, 5), np.float32)
  mask[1, 2:] = 0
  out = np.asarray(kl.kl_estimate(logp, np.where(mask > 0, ref, np.nan), "k3", mask=mask))
  np.testing.assert_array_equal(out[mask == 0], 0.0)
  np.testing.assert_allclose(out[mask > 0], expected["k3"][mask > 0], rtol=1e-5, atol=1e-6)


def test_k3_nonnegative_finite_and_zero_at_equality():
  rng = np.random.default_rng(1)
  logp = rng.normal(scale=30.0, size=(64, 64)).astype(np.float32)
  ref = rng.normal(scale=30.0, size=(64, 64)).astype(np.float32)
  k3 = np.asarray(kl.kl_estimate(logp, ref, "k3"))
  assert np.all(k3 >= 0) and np.all(np.isfinite(k3))
  np.testing.assert_array_equal(kl.kl_estimate(logp, logp, "k3"), 0.0)


def test_k1_k3_estimate_true_kl_from_policy_samples():
  rng = np.random.default_rng(2)
  vocab, n = 12, 200_000
  p = rng.dirichlet(np.ones(vocab))
  q = 0.7 * p + 0.3 * rng.dirichlet(np.ones(vocab))
  true_kl = float(np.sum(p * (np.log(p) - np.log(q))))
  tokens = rng.choice(vocab, size=n, p=p)
  logp, ref = np.log(p)[tokens].astype(np.float32), np.log(q)[tokens].astype(np.float32)
  k1 = float(np.mean(kl.kl_estimate(logp, ref, "k1")))
  k3_all = np.asarray(kl.kl_estimate(logp, ref, "k3"))
  k1_all = np.asarray(kl.kl_estimate(logp, ref, "k1"))
  assert k1 == pytest.approx(true_kl, rel=0.05)
  assert float(k3_all.mean()) == pytest.approx(true_kl, rel=0.05)
  assert k3_all.std() < k1_all.std()  # the point of k3: lower variance


def test_k3_gradient_is_zero_at_equality():
  g = jax.grad(lambda x: jnp.sum(kl.kl_estimate(x, jnp.zeros(3), "k3")))(jnp.zeros(3))
  np.testing.assert_allclose(g, 0.0)


def test_k3_keeps_pulling_a_token_that_drifted_far_above_the_reference():
  """d k3 / d logp = 1 - pi_ref / pi: about 1 once log(pi / pi_ref) is large. A two-sided clip
  of the log-ratio at 20 made it 0 there (the tokens that drifted furthest); the clip above
  (where exp overflows) stays: finite, no gradient."""
  drift = jnp.array([5.0, 19.0, 21.0, 25.0, 60.0])  # logp - ref_logp
  g = jax.grad(lambda x: jnp.sum(kl.kl_estimate(x, jnp.zeros(5), "k3")))(drift)
  np.testing.assert_allclose(g, 1.0 - np.exp(-np.asarray(drift)), rtol=1e-6)
  np.testing.assert_allclose(kl.kl_estimate(drift, jnp.zeros(5), "k3"),
                             np.expm1(-np.asarray(drift)) + np.asarray(drift), rtol=1e-6)
  below = jax.grad(lambda x: jnp.sum(kl.kl_estimate(x, jnp.zeros(1), "k3")))(jnp.array([-25.0]))
  assert np.isfinite(kl.kl_estimate(jnp.array([-25.0]), jnp.zeros(1), "k3")).all()
  assert float(below[0]) == 0.0


def test_unknown_kind_lists_known():
  with pytest.raises(ValueError, match=r"kind='k4'.*\['abs', 'k1', 'k2', 'k3'\]"):
    kl.kl_estimate(jnp.zeros(2), jnp.zeros(2), "k4")


@pytest.mark.parametrize("kind", ["k2", "k3", "abs"])
def test_padding_sends_no_nan_back_through_the_kl_loss(kind):
  """Whatever the log-probs hold on padding (NaN, -inf from a masked vocab entry, inf), the KL
  loss and its gradient are those of the valid tokens alone."""
  from rlhfuse_jax.rl import losses
  rng = np.random.default_rng(3)
  logp = -rng.exponential(size=(2, 6)).astype(np.float32)
  ref = -rng.exponential(size=(2, 6)).astype(np.float32)
  mask = np.ones((2, 6), np.float32)
  mask[0, 4:] = 0
  mask[1, 2:] = 0
  junk = np.array([np.nan, -np.inf, np.inf, np.nan], np.float32)
  dirty_logp, dirty_ref = logp.copy(), ref.copy()
  dirty_logp[0, 4:], dirty_ref[0, 4:] = junk[:2], junk[2:]
  dirty_logp[1, 2:], dirty_ref[1, 2:] = np.roll(junk, 1), junk
  loss = lambda lp, rf: losses.kl_loss(lp, rf, mask, kind=kind)  # noqa: E731
  (clean, g_clean), (dirty, g_dirty) = (
      jax.value_and_grad(loss)(jnp.asarray(lp), jnp.asarray(rf))
      for lp, rf in ((logp, ref), (dirty_logp, dirty_ref)))
  assert float(clean) > 0
  np.testing.assert_allclose(dirty, clean, rtol=1e-6)
  assert np.all(np.isfinite(g_dirty))
  np.testing.assert_allclose(g_dirty, g_clean, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(g_dirty)[mask == 0], 0.0)
