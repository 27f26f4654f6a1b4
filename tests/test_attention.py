"""models/attention.py: the blockwise kernel and the dispatcher against reference_attention (the
original llama.py math), values and gradients, on the position patterns llama.py produces; the
model's logits with each implementation; remat policies leave params and gradients unchanged."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.models import attention as attn
from rlhfuse_jax.models import llama

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


# Whole model ---------------------------------------------------------------------------------

CFG = llama.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, max_seq_len=32)


@pytest.fixture(scope="module")
def params():
  return jax.tree_util.tree_map(jnp.asarray, llama.host_random_params(CFG, 0))


@pytest.fixture
def small_blocks(monkeypatch):
  # Several tiles even at test lengths, so the model path exercises the online softmax.
  monkeypatch.setattr(attn, "blockwise_attention", _blockwise(2, 3))


def test_model_logits_without_cache(params, small_blocks):
  tokens = jnp.asarray(np.random.default_rng(7).integers(0, 32, (2, 9)), jnp.int32)
  ref, _ = llama.apply(CFG.replace(attention="reference"), params, tokens)
  got, _ = llama.apply(CFG, params, tokens)
  np.testing.assert_allclose(got, ref, **TOL)


def test_model_logits_with_cache(params, small_blocks):
  # Prefill 5 tokens at per-row offsets into a 16-slot cache, then one decode step.
  rng = np.random.default_rng(8)
  tokens = jnp.asarray(rng.integers(0, 32, (2, 5)), jnp.int32)
  positions = _arange(2, 5, jnp.array([0, 4]))
  step = jnp.asarray(rng.integers(0, 32, (2, 1)), jnp.int32)
  outs = []
  for impl in ("reference", "blockwise"):
    cfg = CFG.replace(attention=impl)
    cache = llama.KVCache.zeros(cfg, 2, 16)
    logits, cache = llama.apply(cfg, params, tokens, positions, cache)
    last, cache = llama.apply(cfg, params, step, positions[:, -1:] + 1, cache)
    outs.append((logits, last, cache.k))
  for got, want in zip(outs[1], outs[0]):
    np.testing.assert_allclose(got, want, **TOL)


def _param_keys(cfg):
  shapes = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0))[0])
  leaves = jax.tree_util.tree_leaves_with_path(shapes)
  return [(jax.tree_util.keystr(p), s.shape) for p, s in leaves]


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_params_and_gradients(params, remat):
  cfg = CFG.replace(remat=remat)
  # Checkpoints, the HF loader and pipeline stages address params by name (layers_i).
  assert _param_keys(cfg) == _param_keys(CFG)
  tokens = jnp.asarray(np.random.default_rng(9).integers(0, 32, (2, 9)), jnp.int32)

  def loss(c):
    return lambda p: jnp.sum(jax.nn.logsumexp(llama.apply(c, p, tokens)[0], -1))
  got = jax.grad(loss(cfg))(params)
  want = jax.grad(loss(CFG))(params)
  jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, **TOL), got, want)


@pytest.mark.parametrize("field,value", [("attention", "flash"), ("remat", "some")])
def test_config_rejects_unknown(field, value):
  with pytest.raises(ValueError, match=f"model.{field}='{value}'"):
    CFG.replace(**{field: value})
