"""Per-token estimators of KL(policy || reference) from sampled tokens.

The response tokens are sampled from the policy, so for token t with log-probs `logp` (policy)
and `ref_logp` (reference), with r = ref_logp - logp (the log of p_ref / p_policy):

- 'k1':  -r = logp - ref_logp. Unbiased for KL, high variance, can be negative per token.
         For the reward only: as a loss its gradient is that of logp, whose expectation on
         the policy's own samples is zero whatever the reference (config refuses it there).
- 'k2':  0.5 * r^2. Biased, nonnegative. As a loss its expected gradient on the policy's own
         samples is exactly that of the reverse KL(policy || reference).
- 'k3':  exp(r) - r - 1. Unbiased for KL (E[exp(r)] = 1), nonnegative, low variance
         (Schulman, "Approximating KL divergence", 2020). Used by GRPO as a loss (DeepSeekMath
         eq. 4), where its expected gradient is that of the FORWARD KL(reference || policy)
         (Tang & Munos 2025, arXiv 2506.09477): E[(1 - exp(r)) grad logp] = -E_ref[grad logp].
- 'abs': |logp - ref_logp|. As a loss, the sign of the gap times grad logp: no KL's gradient.

(Per token, given the prefix: a token's loss term leaves out its effect on later tokens' KL,
as in every token-level implementation. tests/test_rl_public_reference.py checks the
directions.)

Estimates are per token, `[batch, resp_len]`; pass `mask` to zero padding exactly.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp

# exp(20) ~ 5e8: far beyond any sane policy/reference ratio, yet finite in fp32, so a diverged
# token cannot make the KL (and the loss built on it) inf. The PPO ratio (rl/losses.py) and
# asynchronous PPO's behaviour weights (trainer/async_ppo.py) clip with the same bound.
MAX_LOG_RATIO = 20.0


def _k1(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  return logp - ref_logp


def _k2(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  return 0.5 * jnp.square(logp - ref_logp)


def _k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  # Clipped above only, where exp overflows: below, k3 = exp(r) - r - 1 is about -r - 1 and its
  # gradient is the policy's pull back to the reference (a two-sided clip zeroed it on the tokens
  # that had drifted furthest, log(pi / pi_ref) > 20).
  log_ratio = jnp.minimum(ref_logp - logp, MAX_LOG_RATIO)
  # expm1 keeps precision when the ratio is ~1 (the common case), where exp(r) - 1 cancels.
  return jnp.expm1(log_ratio) - log_ratio


def _abs(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  return jnp.abs(logp - ref_logp)


KL_ESTIMATORS: Dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "abs": _abs,
}


def get_kl_estimator(kind: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """Returns the estimator `fn(logp, ref_logp) -> per-token KL` registered under `kind`."""
  if kind not in KL_ESTIMATORS:
    raise ValueError(f"Unknown KL estimator kind={kind!r}; known kinds: {sorted(KL_ESTIMATORS)}")
  return KL_ESTIMATORS[kind]


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, kind: str,
                mask: Optional[jax.Array] = None) -> jax.Array:
  """Per-token KL estimate `[batch, resp_len]`, computed in fp32; 0 where `mask` is 0."""
  fn = get_kl_estimator(kind)
  logp, ref_logp = logp.astype(jnp.float32), ref_logp.astype(jnp.float32)
  if mask is None:
    return fn(logp, ref_logp)  # [batch, resp_len]
  # Padding's log-probs are zeroed before the estimator, not only its output: a where() after
  # exp/square of a NaN or -inf still sends NaN back through the gradient (0 * NaN).
  valid = mask > 0
  kl = fn(jnp.where(valid, logp, 0.0), jnp.where(valid, ref_logp, 0.0))
  return jnp.where(valid, kl, 0.0)
