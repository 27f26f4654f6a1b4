"""Masked reductions against numpy on the valid entries only."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from rlhfuse_jax.rl import masked


def _data(seed=0, batch=5, length=7):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch, length)).astype(np.float32)
  lengths = np.array([7, 3, 1, 5, 2])[:batch]
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.float32)
  return x, mask


def test_sum_mean_var_match_numpy():
  x, mask = _data()
  v = x[mask > 0]
  np.testing.assert_allclose(masked.masked_sum(x, mask), v.sum(), rtol=1e-5)
  np.testing.assert_allclose(masked.masked_mean(x, mask), v.mean(), rtol=1e-5)
  np.testing.assert_allclose(masked.masked_var(x, mask), v.var(ddof=1), rtol=1e-5)
  np.testing.assert_allclose(masked.masked_var(x, mask, unbiased=False), v.var(), rtol=1e-5)
  row_means = [x[i, mask[i] > 0].mean() for i in range(x.shape[0])]
  np.testing.assert_allclose(masked.masked_mean(x, mask, axis=-1), row_means, rtol=1e-5)
  row_vars = [x[i, mask[i] > 0].var() for i in range(x.shape[0])]
  np.testing.assert_allclose(masked.masked_var(x, mask, axis=-1, unbiased=False), row_vars,
                             rtol=1e-5, atol=1e-7)


def test_sum_and_mean_weigh_each_position_by_its_mask():
  """A mask of weights (not only 0/1) weighs each valid position: the sum is sum(w * x) over
  w > 0 and the mean sum(w * x) / sum(w), by hand. (The mean divides by the weights' sum, so a
  sum that ignored the weights made the mean of a constant differ from the constant.)"""
  x = np.array([[1.0, 2.0, 4.0], [3.0, np.nan, 5.0]], np.float32)
  w = np.array([[0.5, 2.0, 0.0], [1.0, 0.0, 0.25]], np.float32)
  assert float(masked.masked_sum(x, w)) == pytest.approx(0.5 + 4.0 + 3.0 + 1.25)
  assert float(masked.masked_mean(x, w)) == pytest.approx(8.75 / 3.75)
  np.testing.assert_allclose(masked.masked_mean(x, w, axis=-1), [4.5 / 2.5, 4.25 / 1.25],
                             rtol=1e-6)
  assert float(masked.masked_mean(np.full_like(x, 7.0), w)) == pytest.approx(7.0)


def test_padding_garbage_does_not_leak():
  x, mask = _data()
  dirty = np.where(mask > 0, x, np.nan).astype(np.float32)
  dirty[0, -1] = x[0, -1]  # row 0 is full length; keep it valid
  dirty[1, 5] = np.inf
  for fn in (masked.masked_sum, masked.masked_mean, masked.masked_var):
    np.testing.assert_allclose(fn(dirty, mask), fn(x, mask), rtol=1e-6)
  grad = jax.grad(lambda y: masked.masked_mean(y, mask))(jnp.asarray(dirty))
  assert np.all(np.isfinite(grad))
  np.testing.assert_array_equal(np.asarray(grad)[mask == 0], 0.0)


def test_all_masked_is_zero_not_nan():
  x, _ = _data()
  zero = np.zeros_like(x)
  assert float(masked.masked_mean(x, zero)) == 0.0
  assert float(masked.masked_var(x, zero)) == 0.0
  np.testing.assert_array_equal(masked.masked_mean(x, zero, axis=-1), 0.0)


def test_whiten():
  x, mask = _data(1)
  v = x[mask > 0]
  w = np.asarray(masked.masked_whiten(x, mask))
  np.testing.assert_allclose(w[mask > 0], (v - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(w[mask == 0], 0.0)
  w2 = np.asarray(masked.masked_whiten(x, mask, shift_mean=False))
  np.testing.assert_allclose(w2[mask > 0], (v - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8)
                             + v.mean(), rtol=1e-4, atol=1e-5)


def test_explained_variance():
  x, mask = _data(2)
  rng = np.random.default_rng(3)
  values = (x + 0.3 * rng.normal(size=x.shape)).astype(np.float32)
  ev = float(masked.explained_variance(values, x, mask))
  r, v = x[mask > 0], values[mask > 0]
  assert ev == pytest.approx(1 - np.var(r - v, ddof=1) / np.var(r, ddof=1), rel=1e-4)
  assert float(masked.explained_variance(x, x, mask)) == pytest.approx(1.0)
  assert float(masked.explained_variance(np.zeros_like(x), x, mask)) == pytest.approx(0.0,
                                                                                      abs=1e-5)


def test_whiten_and_var_are_exact_for_equal_values_and_values_far_from_zero():
  """Equal values (every REINFORCE++ return of a batch whose scores tie) whiten to exactly 0 and
  have a variance of exactly 0, and values with a large common offset whiten as a float64
  reference of the same float32 values does. The float32 mean of the raw values was off by
  about their spacing, which eps = 1e-8 turned into whitened values up to +-0.36, all of one
  sign, for 768 values of 123.456."""
  rng = np.random.default_rng(5)
  lengths = rng.integers(1, 13, size=64)
  mask = (np.arange(12)[None] < lengths[:, None]).astype(np.float32)
  for value in (0.3, 3.3, 123.456, 1e6 + 0.1):
    x = np.where(mask > 0, np.float32(value), np.nan).astype(np.float32)
    np.testing.assert_array_equal(masked.masked_whiten(x, mask), 0.0, err_msg=value)
    assert float(masked.masked_var(x, mask)) == 0.0, value
    np.testing.assert_array_equal(masked.masked_var(x, mask, axis=-1), 0.0, err_msg=value)
    shifted = np.asarray(masked.masked_whiten(x, mask, shift_mean=False))
    np.testing.assert_array_equal(shifted[mask > 0], np.float32(value))
  x = np.float32(1e6 + rng.integers(0, 48, size=mask.shape) / 16)  # exact in float32
  v = x[mask > 0].astype(np.float64)
  w = np.asarray(masked.masked_whiten(x, mask))
  np.testing.assert_allclose(w[mask > 0], (v - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(masked.masked_var(x, mask), v.var(ddof=1), rtol=1e-5)
  rows = [x[i, mask[i] > 0].astype(np.float64).var() for i in range(len(lengths))]
  np.testing.assert_allclose(masked.masked_var(x, mask, axis=-1, unbiased=False), rows,
                             rtol=1e-5, atol=1e-6)


def test_whiten_of_values_near_float32s_limit_and_of_huge_equal_values():
  """Values within float32's range whose differences are not (3e38 against -3e38) whiten as a
  float64 reference does: they are scaled by a power of two before the shift by a valid value,
  which overflowed to inf and gave NaN. Equal values of 1e30 (a scale of 2**99: eps = 1e-8 over
  its square flushes to 0) whiten to exactly 0, not 0 * rsqrt(0)."""
  x = np.float32([[3e38, -3e38, 0, 1], [2e38, 0, 0, 7]])
  mask = np.float32([[1, 1, 1, 1], [1, 1, 1, 0]])
  v = x[mask > 0].astype(np.float64)
  want = (v - v.mean()) / v.std(ddof=1)
  w = np.asarray(masked.masked_whiten(x, mask))
  np.testing.assert_allclose(w[mask > 0], want, rtol=1e-5, atol=1e-6)
  assert w[1, 3] == 0.0
  shifted = np.asarray(masked.masked_whiten(x, mask, shift_mean=False))
  np.testing.assert_allclose(shifted[mask > 0], want + v.mean(), rtol=1e-5)
  equal = np.full((3, 4), 1e30, np.float32)
  np.testing.assert_array_equal(masked.masked_whiten(equal, np.ones((3, 4))), 0.0)
  np.testing.assert_array_equal(masked.masked_whiten(equal, np.ones((3, 4)), shift_mean=False),
                                equal)
  assert float(masked.power_of_two_scale(jnp.float32(np.inf))) == 1.0  # frexp's inf: 0.5


def test_var_of_values_near_float32s_limit():
  """A variance float32 holds is found even where the squared deviations' sum is not (2.25e38 of
  +-1.5e19: it was inf), and one beyond float32's range is inf (3e38 against -3e38 gave NaN:
  inf - inf). Per row as for the whole array; the values are scaled by a power of two first."""
  x = np.float32([[1.5e19, -1.5e19, 0, 7], [3e38, -3e38, 0, 1]])
  mask = np.float32([[1, 1, 0, 0], [1, 1, 1, 1]])
  rows = np.asarray(masked.masked_var(x, mask, axis=1, unbiased=False))
  np.testing.assert_allclose(rows[0], 2.25e38, rtol=1e-6)
  assert rows[1] == np.inf
  assert float(masked.masked_var(x, mask)) == np.inf
  assert float(masked.masked_var(x[:1], mask[:1], unbiased=False)) == rows[0]
  # Where nothing overflows, numpy's float64 variance, to float32's rounding.
  small = np.float32([[1e3, 1e3 + 0.5, 2e3, -7e2]])
  np.testing.assert_allclose(masked.masked_var(small, np.ones_like(small)),
                             small.astype(np.float64).var(ddof=1), rtol=1e-6)


def test_var_and_whiten_of_bfloat16_values_are_taken_in_float32():
  """bfloat16 inputs: the deviations from the pivot are taken in float32, as the mean was before
  the pivot. In bfloat16 they were rounded to 8 bits: a variance ~2e-4 off (4e-3 per row)."""
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(0, 50, (64, 32)), jnp.bfloat16)
  mask = np.ones((64, 32), np.float32)
  v = np.asarray(x, np.float64)
  np.testing.assert_allclose(masked.masked_var(x, mask), v.var(ddof=1), rtol=1e-6)
  np.testing.assert_allclose(masked.masked_var(x, mask, axis=1), v.var(axis=1, ddof=1),
                             rtol=2e-6)
  np.testing.assert_allclose(masked.masked_whiten(x, mask), (v - v.mean()) / v.std(ddof=1),
                             rtol=1e-5, atol=1e-5)


def test_var_and_whiten_run_on_a_mesh_of_explicit_axes():
  """The pivot (the first valid value) is found by reductions: a gather of the flattened array,
  as before, was refused under jit on inputs sharded over explicit mesh axes
  (ShardingTypeError: the gather's output sharding needs collectives)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  rng = np.random.default_rng(7)
  x = rng.normal(3.0, 2.0, (16, 8)).astype(np.float32)
  mask = (rng.random((16, 8)) > 0.3).astype(np.float32)
  mask[0, :3] = 0  # the first valid value is not at index 0
  fns = (lambda a, m: masked.masked_whiten(a, m), lambda a, m: masked.masked_var(a, m),
         lambda a, m: masked.masked_var(a, m, axis=1))
  want = [np.asarray(f(x, mask)) for f in fns]
  sharding = NamedSharding(mesh, P("data", "model"))
  xs, ms = jax.device_put(x, sharding), jax.device_put(mask, sharding)
  with jax.set_mesh(mesh):
    got = [np.asarray(jax.jit(f)(xs, ms)) for f in fns]
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
