"""Masked reductions over per-token arrays.

Every RL quantity lives on a static `[batch, resp_len]` grid whose tail is padding. The mask
(float32, 1.0 on real response tokens, 0.0 on padding) decides what counts. Masked positions are
removed with `jnp.where`, not by multiplying with the mask: `nan * 0` is `nan`, and a padded
position may well hold `inf`/`nan` (for example a log-prob of a padding token), so only `where`
gives exactly zero values AND exactly zero gradients there.

All functions are pure, jit-friendly and never branch on data; an all-masked input gives 0 (not
`nan`) for means and variances.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp

Axis = Optional[Union[int, Sequence[int]]]


def _valid(mask: jax.Array) -> jax.Array:
  return mask > 0


def masked_sum(x: jax.Array, mask: jax.Array, axis: Axis = None) -> jax.Array:
  """Sum of `x` over positions where `mask` is nonzero (weighted by the mask)."""
  mask = jnp.broadcast_to(mask, x.shape)
  return jnp.sum(jnp.where(_valid(mask), x * mask, 0.0), axis=axis)


def _safe_count(mask: jax.Array, axis: Axis) -> jax.Array:
  count = jnp.sum(mask, axis=axis)
  # An all-padding row/batch has nothing to average: 0 / 1 = 0 instead of 0 / 0 = nan.
  return jnp.where(count > 0, count, 1.0)


def masked_mean(x: jax.Array, mask: jax.Array, axis: Axis = None) -> jax.Array:
  """Mean of `x` over valid positions; 0 where nothing is valid."""
  mask = jnp.broadcast_to(mask, x.shape).astype(jnp.result_type(x, jnp.float32))
  return masked_sum(x, mask, axis=axis) / _safe_count(mask, axis)


def power_of_two_scale(magnitude: jax.Array) -> jax.Array:
  """The largest power of two <= `magnitude` where that is >= 1, else 1 (elementwise), at most
  2**126 (its reciprocal, which XLA may divide by, is then still a normal float32).

  Dividing by it is exact and brings values of that magnitude into [1, 4), so that their squares
  (a variance, a std) cannot overflow float32 for values beyond ~1.8e19; the results are those
  of the unscaled values with eps rescaled, as a variance's eps / scale**2."""
  _, exponent = jnp.frexp(magnitude)
  exponent = jnp.minimum(exponent - 1, 126)
  # Not for inf (frexp gives it the exponent 0: a scale of 0.5) or NaN.
  big = (magnitude >= 1) & jnp.isfinite(magnitude)
  return jnp.where(big, jnp.ldexp(jnp.ones_like(magnitude), exponent), 1.0)


def scaled_eps(eps: float, divisor: jax.Array) -> jax.Array:
  """`eps / divisor` (a power_of_two_scale, or its square), at least float32's smallest normal
  number where eps > 0. Past a scale of ~2**106 (eps = 1e-6; 2**50 for a variance's 1e-8 over
  the scale squared) the quotient is subnormal, and XLA flushes subnormals to 0: a group or batch
  of equal values then divided 0 by 0, NaN. The floor adds nothing measurable otherwise: a
  nonzero std or variance of values scaled into [1, 4) is at least ~2**-24 (2**-48)."""
  return jnp.maximum(eps / divisor, jnp.where(eps > 0, jnp.finfo(jnp.float32).tiny, 0.0))


def _pivot(x: jax.Array, mask: jax.Array, axis: Axis) -> jax.Array:
  """A valid value of `x` (the first) over `axis` (None or one axis; 0 for several axes or where
  nothing is valid), with the reduced axes kept: what the variance subtracts first.

  Found with reductions alone (the smallest valid index, then a masked sum), not a gather of a
  flattened array: that needs collectives on sharded inputs, which jit refuses to infer on a
  mesh of explicit axes (jax.sharding.AxisType.Explicit)."""
  valid = _valid(jnp.broadcast_to(mask, x.shape))
  if axis is not None and not isinstance(axis, int):
    return jnp.zeros((), x.dtype)
  if axis is None:
    index = jnp.arange(x.size, dtype=jnp.int32).reshape(x.shape)  # row-major, as reshape(-1)
  else:
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis % x.ndim)
  keep = axis is not None
  first = jnp.min(jnp.where(valid, index, x.size), axis=axis, keepdims=keep)
  # Exactly the first valid value (every other term is 0); 0 where nothing is valid.
  return jnp.sum(jnp.where(valid & (index == first), x, 0.0), axis=axis, keepdims=keep)


def masked_var(x: jax.Array, mask: jax.Array, axis: Axis = None,
               unbiased: bool = True) -> jax.Array:
  """Variance of `x` over valid positions (Bessel-corrected by default, like torch.var)."""
  # In float32 at least: the deviations from the pivot below, in bfloat16, were rounded to 8 bits.
  x = x.astype(jnp.result_type(x, jnp.float32))
  mask = jnp.broadcast_to(mask, x.shape).astype(x.dtype)
  # Taken of values scaled by a power of two into [-4, 4) (exact), the scale's square multiplied
  # back at the end: unscaled, the deviations of 3e38 against -3e38 overflowed to inf and
  # inf - inf gave NaN, and the squares' sum overflowed for a variance float32 holds (2.25e38 of
  # +-1.5e19). A variance beyond float32's range is now inf, as it should be.
  scale = power_of_two_scale(jnp.max(jnp.where(_valid(mask), jnp.abs(x), 0.0), axis=axis,
                                     keepdims=True, initial=0.0))
  var = _shifted_var(x / scale, mask, axis, unbiased)
  return var * jnp.square(jnp.squeeze(scale, axis=tuple(range(x.ndim)) if axis is None else axis))


def _shifted_var(x: jax.Array, mask: jax.Array, axis: Axis, unbiased: bool) -> jax.Array:
  """masked_var of float32 `x` whose deviations and squares cannot overflow (scaled)."""
  # Taken of the deviations from one valid value (the variance does not change): values far from
  # 0 then cancel exactly, and equal values have a variance of exactly 0. Unshifted, the float32
  # mean of equal values (123.456 each) is off by ~1e-5: a variance of ~1e-10, not 0.
  x = x - _pivot(x, mask, axis)
  mean = masked_mean(x, mask, axis=axis)
  mean_b = mean if axis is None else jnp.expand_dims(mean, axis)
  var = masked_mean(jnp.square(x - mean_b), mask, axis=axis)
  if unbiased:
    n = jnp.sum(mask, axis=axis)
    # With a single valid element the unbiased variance is undefined; keep the biased one (0).
    var = var * jnp.where(n > 1, n / jnp.maximum(n - 1, 1.0), 1.0)
  return var


def masked_whiten(x: jax.Array, mask: jax.Array, shift_mean: bool = True,
                  eps: float = 1e-8) -> jax.Array:
  """Normalises `x` to unit variance (and zero mean if `shift_mean`) over all valid positions.

  Statistics are taken over the whole array (the batch), as in PPO advantage whitening.
  Padding positions of the result are exactly 0.
  """
  x = x.astype(jnp.result_type(x, jnp.float32))  # as in masked_var
  valid = _valid(jnp.broadcast_to(mask, x.shape))
  # Whitening does not change with the values' scale: a power of two brings them below 4
  # (exactly), so that neither their deviations below nor those deviations' squares overflow.
  # Values beyond ~1.8e19 had an infinite variance, and every whitened value was 0; scaled after
  # the shift below, 3e38 against -3e38 gave an infinite deviation and NaN.
  scale = power_of_two_scale(jnp.max(jnp.where(valid, jnp.abs(x), 0.0)))
  x = x / scale
  # Centred on a valid value first, as masked_var is: equal values whiten to exactly 0. The mean
  # of the raw values is off by about their float32 spacing, and with eps = 1e-8 that error came
  # out as up to +-0.36 for 768 returns of 123.456 each (+-0.005 for 0.3 each), all one sign.
  pivot = _pivot(x, mask, None)
  x = x - pivot
  mean = masked_mean(x, mask)
  # (Scaled already: masked_var's own scale would change the reductions' fusion, and with it
  # the last bit of some whitened values.)
  var = _shifted_var(x, jnp.broadcast_to(mask, x.shape).astype(x.dtype), None, True)
  whitened = (x - mean) * jax.lax.rsqrt(var + scaled_eps(eps, scale * scale))
  if not shift_mean:
    whitened = whitened + (mean + pivot) * scale
  return jnp.where(valid, whitened, 0.0)


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array,
                       eps: float = 1e-8) -> jax.Array:
  """1 - Var[returns - values] / Var[returns] over valid tokens (1 = perfect critic).

  `eps` keeps the value finite when the returns are constant (then the result is very negative
  unless the critic is exact, which is the honest answer for a useless baseline).
  """
  var_returns = masked_var(returns, mask)
  var_residual = masked_var(returns - values, mask)
  return 1.0 - var_residual / (var_returns + eps)
