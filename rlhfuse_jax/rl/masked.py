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


def masked_var(x: jax.Array, mask: jax.Array, axis: Axis = None,
               unbiased: bool = True) -> jax.Array:
  """Variance of `x` over valid positions (Bessel-corrected by default, like torch.var)."""
  mask = jnp.broadcast_to(mask, x.shape).astype(jnp.result_type(x, jnp.float32))
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
  mean = masked_mean(x, mask)
  var = masked_var(x, mask)
  whitened = (x - mean) * jax.lax.rsqrt(var + eps)
  if not shift_mean:
    whitened = whitened + mean
  return jnp.where(_valid(jnp.broadcast_to(mask, x.shape)), whitened, 0.0)


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array,
                       eps: float = 1e-8) -> jax.Array:
  """1 - Var[returns - values] / Var[returns] over valid tokens (1 = perfect critic).

  `eps` keeps the value finite when the returns are constant (then the result is very negative
  unless the critic is exact, which is the honest answer for a useless baseline).
  """
  var_returns = masked_var(returns, mask)
  var_residual = masked_var(returns - values, mask)
  return 1.0 - var_residual / (var_returns + eps)
