"""PPO losses against numpy, every loss aggregation, and zero gradients on padding."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from rlhfuse_jax.models import sequences
from rlhfuse_jax.rl import losses

LENGTHS = np.array([6, 2, 4, 1, 5])
T = 7  # longer than the longest row: a horizon taken from the batch (6) differs from T
AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def test_every_registered_aggregation_has_a_numpy_reference_here():
  """AGGS (each with a numpy reference in _agg_np) is the registry: an aggregation added to
  rl/losses.LOSS_AGGREGATIONS alone is not compared with anything until it is added here."""
  assert sorted(AGGS) == sorted(losses.LOSS_AGGREGATIONS)


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  shape = (len(LENGTHS), T)
  mask = (np.arange(T)[None] < LENGTHS[:, None]).astype(np.float32)
  old_logp = -rng.exponential(size=shape).astype(np.float32)
  logp = (old_logp + rng.normal(scale=0.3, size=shape)).astype(np.float32)
  adv = rng.normal(size=shape).astype(np.float32)
  return logp, old_logp, adv, mask


def _agg_np(loss, mask, mode):
  m = mask > 0
  if mode == "token-mean":
    return loss[m].mean()
  rows = [loss[i, m[i]] for i in range(loss.shape[0])]
  if mode == "seq-mean-token-sum":
    return np.mean([r.sum() for r in rows])
  if mode == "seq-mean-token-mean":
    return np.mean([r.mean() for r in rows])
  return np.mean([r.sum() / loss.shape[1] for r in rows])


def _pg_np(logp, old_logp, adv, mask, lo, hi, c=None):
  ratio = np.exp(logp.astype(np.float64) - old_logp)
  l1 = -adv * ratio
  l2 = -adv * np.clip(ratio, 1 - lo, 1 + hi)
  per = np.maximum(l1, l2)
  lower = np.zeros_like(per, bool)
  if c is not None:
    l3 = -adv * c
    lower = (adv < 0) & (l3 < per)
    per = np.where(adv < 0, np.minimum(per, l3), per)
  m = mask > 0
  return per, (l2 > l1)[m].mean(), lower[m].mean(), (old_logp - logp)[m].mean()


@pytest.mark.parametrize("loss_agg", AGGS)
def test_policy_loss_matches_numpy(loss_agg):
  logp, old_logp, adv, mask = _batch()
  loss, metrics = losses.policy_loss(logp, old_logp, adv, mask, 0.1, 0.15, loss_agg=loss_agg)
  per, clipfrac, _, ppo_kl = _pg_np(logp, old_logp, adv, mask, 0.1, 0.15)
  assert float(loss) == pytest.approx(_agg_np(per, mask, loss_agg), rel=1e-5)
  assert float(metrics["pg_loss"]) == float(loss)
  assert float(metrics["pg_clipfrac"]) == pytest.approx(clipfrac, abs=1e-6)
  assert 0.0 < clipfrac < 1.0  # the data exercises both branches
  assert float(metrics["ppo_kl"]) == pytest.approx(ppo_kl, rel=1e-5)


def test_dual_clip_matches_numpy():
  logp, old_logp, adv, mask = _batch(1)
  logp = logp + 1.5 * (adv < 0)  # big ratios on negative advantages trigger the dual clip
  loss, metrics = losses.policy_loss(logp, old_logp, adv, mask, 0.2, clip_ratio_c=3.0)
  per, clipfrac, lower, _ = _pg_np(logp, old_logp, adv, mask, 0.2, 0.2, c=3.0)
  assert float(loss) == pytest.approx(_agg_np(per, mask, "token-mean"), rel=1e-5)
  assert float(metrics["pg_clipfrac"]) == pytest.approx(clipfrac, abs=1e-6)
  assert float(metrics["pg_clipfrac_lower"]) == pytest.approx(lower, abs=1e-6)
  assert lower > 0
  with pytest.raises(ValueError, match="clip_ratio_c=0.5 must be > 1.0"):
    losses.policy_loss(logp, old_logp, adv, mask, 0.2, clip_ratio_c=0.5)


@pytest.mark.parametrize("loss_agg", AGGS)
def test_policy_gradient_zero_on_padding_even_with_nan(loss_agg):
  logp, old_logp, adv, mask = _batch(2)
  logp = np.where(mask > 0, logp, np.nan).astype(np.float32)
  adv = np.where(mask > 0, adv, np.inf).astype(np.float32)
  fn = lambda lp: losses.policy_loss(lp, old_logp, adv, mask, 0.2, loss_agg=loss_agg)[0]
  loss, grad = jax.value_and_grad(fn)(jnp.asarray(logp))
  grad = np.asarray(grad)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(grad))
  np.testing.assert_array_equal(grad[mask == 0], 0.0)
  assert np.any(grad[mask > 0] != 0.0)


@pytest.mark.parametrize("loss_agg", AGGS)
def test_value_loss_matches_numpy(loss_agg):
  rng = np.random.default_rng(3)
  _, _, _, mask = _batch()
  old_v = rng.normal(size=mask.shape).astype(np.float32)
  v = (old_v + rng.normal(scale=0.5, size=mask.shape)).astype(np.float32)
  ret = rng.normal(size=mask.shape).astype(np.float32)
  loss, metrics = losses.value_loss(v, old_v, ret, mask, 0.2, loss_agg=loss_agg)
  e1 = (v - ret) ** 2
  e2 = (old_v + np.clip(v - old_v, -0.2, 0.2) - ret) ** 2
  assert float(loss) == pytest.approx(0.5 * _agg_np(np.maximum(e1, e2), mask, loss_agg),
                                      rel=1e-5)
  frac = ((np.abs(v - old_v) > 0.2) & (e2 > e1))[mask > 0].mean()
  assert float(metrics["vf_clipfrac"]) == pytest.approx(frac, abs=1e-6) and 0 < frac < 1
  assert float(metrics["vf_loss"]) == float(loss)
  unclipped, m2 = losses.value_loss(v, old_v, ret, mask, None, loss_agg=loss_agg)
  assert float(unclipped) == pytest.approx(0.5 * _agg_np(e1, mask, loss_agg), rel=1e-5)
  assert float(m2["vf_clipfrac"]) == 0.0
  vn = np.where(mask > 0, v, np.nan).astype(np.float32)
  grad = np.asarray(jax.grad(
      lambda x: losses.value_loss(x, old_v, ret, mask, 0.2, loss_agg=loss_agg)[0])(vn))
  assert np.all(np.isfinite(grad))
  np.testing.assert_array_equal(grad[mask == 0], 0.0)


def test_value_clipfrac_counts_no_rounding_inside_the_clip_range():
  # Every V within 0.2 of V_old: nothing clips. V_old + (V - V_old) is V only up to float
  # rounding, so comparing the clipped and unclipped errors alone counted some of these tokens as
  # clipped (4 of 2048 here; in a tiny PPO run up to 9 %, differing between runs equal to 1e-7).
  rng = np.random.default_rng(5)
  shape = (64, 32)
  old_v = rng.normal(scale=3.0, size=shape).astype(np.float32)
  v = (old_v + rng.uniform(-0.19, 0.19, size=shape)).astype(np.float32)
  ret = rng.normal(size=shape).astype(np.float32)
  mask = np.ones(shape, np.float32)
  loss, metrics = losses.value_loss(v, old_v, ret, mask, 0.2)
  assert float(metrics["vf_clipfrac"]) == 0.0
  assert float(loss) == pytest.approx(0.5 * float(np.mean((v - ret) ** 2)), rel=1e-6)
  # Pushed past the range on half the tokens, the clipped error is the larger one on some of them.
  far = v + np.where(rng.random(shape) < 0.5, 0.5, 0.0).astype(np.float32)
  _, metrics = losses.value_loss(far, old_v, ret, mask, 0.2)
  e1, e2 = (far - ret) ** 2, (old_v + np.clip(far - old_v, -0.2, 0.2) - ret) ** 2
  want = ((np.abs(far - old_v) > 0.2) & (e2 > e1)).mean()
  assert float(metrics["vf_clipfrac"]) == pytest.approx(want, abs=1e-6) and 0 < want < 0.5


def test_aggregation_denominator_overrides_make_microbatches_add_up():
  logp, old_logp, adv, mask = _batch(4)
  full, _ = losses.policy_loss(logp, old_logp, adv, mask, 0.2)
  halves = [slice(0, 2), slice(2, 5)]
  total = mask.sum()
  parts = [losses.policy_loss(logp[s], old_logp[s], adv[s], mask[s], 0.2,
                              num_tokens=total)[0] for s in halves]
  assert float(sum(parts)) == pytest.approx(float(full), rel=1e-5)
  seq = [losses.policy_loss(logp[s], old_logp[s], adv[s], mask[s], 0.2,
                            loss_agg="seq-mean-token-mean", num_seqs=5)[0] for s in halves]
  full_seq, _ = losses.policy_loss(logp, old_logp, adv, mask, 0.2,
                                   loss_agg="seq-mean-token-mean")
  assert float(sum(seq)) == pytest.approx(float(full_seq), rel=1e-5)


def test_unknown_loss_agg_lists_modes():
  logp, old_logp, adv, mask = _batch()
  with pytest.raises(ValueError, match=r"loss_agg='mean'.*seq-mean-token-sum-norm"):
    losses.policy_loss(logp, old_logp, adv, mask, 0.2, loss_agg="mean")
  with pytest.raises(ValueError, match=r"loss_agg='sum'"):
    losses.value_loss(logp, logp, logp, mask, 0.2, loss_agg="sum")


def _entropy(logits):
  return sequences.token_logprobs_and_entropy(
      logits, jnp.zeros(jnp.shape(logits)[:-1], jnp.int32))[1]


def test_entropy_stable():
  """models/sequences.token_logprobs_and_entropy's entropy (the one training logs and the
  entropy bonus uses) against numpy: huge logits, -inf masked entries (value and gradient
  finite), bfloat16 logits upcast."""
  rng = np.random.default_rng(5)
  logits = rng.normal(scale=3.0, size=(2, 3, 11))
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = -(p * np.log(p)).sum(-1)
  np.testing.assert_allclose(_entropy(logits.astype(np.float32)), want, rtol=1e-5, atol=1e-6)
  # Huge logits (no overflow) and -inf masked entries (no nan); bf16 input upcasts.
  big = (logits * 1e4).astype(np.float32)
  assert np.all(np.isfinite(_entropy(big)))
  masked_logits = logits.copy()
  masked_logits[..., 5:] = -np.inf
  pm = np.exp(logits[..., :5] - logits[..., :5].max(-1, keepdims=True))
  pm /= pm.sum(-1, keepdims=True)
  np.testing.assert_allclose(_entropy(masked_logits.astype(np.float32)),
                             -(pm * np.log(pm)).sum(-1), rtol=1e-5, atol=1e-6)
  g = jax.grad(lambda z: jnp.sum(_entropy(z)))(jnp.asarray(masked_logits, jnp.float32))
  assert np.all(np.isfinite(g))
  h16 = _entropy(jnp.asarray(logits, jnp.bfloat16))
  assert h16.dtype == jnp.float32
  uniform = _entropy(jnp.zeros((1, 1, 11)))
  np.testing.assert_allclose(uniform, np.log(11), rtol=1e-6)


def test_kl_loss_matches_numpy():
  logp, ref, _, mask = _batch(6)
  d = (ref - logp)[mask > 0].astype(np.float64)
  assert float(losses.kl_loss(logp, ref, mask, "k3")) == pytest.approx(
      np.mean(np.exp(d) - d - 1), rel=1e-5)
  assert float(losses.kl_loss(logp, ref, mask, "k1")) == pytest.approx(np.mean(-d), rel=1e-5)


def test_token_logprobs_matches_log_softmax_gather():
  rng = np.random.default_rng(7)
  logits = rng.normal(scale=5.0, size=(2, 4, 13)).astype(np.float32)
  tokens = rng.integers(0, 13, size=(2, 4))
  z = logits.astype(np.float64)
  logsm = z - z.max(-1, keepdims=True)
  logsm -= np.log(np.exp(logsm).sum(-1, keepdims=True))
  want = np.take_along_axis(logsm, tokens[..., None], -1)[..., 0]
  out = sequences.token_logprobs_and_entropy(logits, tokens)[0]
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  out16 = sequences.token_logprobs_and_entropy(jnp.asarray(logits, jnp.bfloat16), tokens)[0]
  assert out16.dtype == jnp.float32
  np.testing.assert_allclose(out16, want, atol=0.1)


def test_jitted_on_data_sharded_batch_matches_unsharded():
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from rlhfuse_jax.rl import advantages
  devices = np.array(jax.devices()[:8])
  mesh = Mesh(devices, ("data",))
  rng = np.random.default_rng(9)
  b, t = 16, 12
  mask = (np.arange(t)[None] < rng.integers(1, t + 1, size=b)[:, None]).astype(np.float32)
  logp = -rng.exponential(size=(b, t)).astype(np.float32)
  old = (logp + rng.normal(scale=0.2, size=(b, t))).astype(np.float32)
  values = rng.normal(size=(b, t)).astype(np.float32)
  scores = rng.normal(size=b).astype(np.float32)

  def step(logp, old, values, scores, mask):
    rewards = advantages.token_level_rewards(scores, logp - old, mask, 0.05)
    adv, ret = advantages.gae(rewards, values, mask, 1.0, 0.95)
    pg, m = losses.policy_loss(logp, old, adv, mask, 0.2, loss_agg="seq-mean-token-mean")
    vf, _ = losses.value_loss(values, values + 0.1, ret, mask, 0.2)
    return pg, vf, m["pg_clipfrac"]

  args = (logp, old, values, scores, mask)
  want = jax.jit(step)(*args)
  sharded = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in args]
  got = jax.jit(step)(*sharded)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
