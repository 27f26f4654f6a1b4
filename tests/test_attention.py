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


def _sin_loss(f):
  # A non-linear loss so that every output element gets a different cotangent.
  return lambda q, k, v, q_pos, k_pos: jnp.sum(jnp.sin(f(q, k, v, q_pos, k_pos)))


# The reference's values and gradients, jitted once for the file: 13 checks below share one
# input shape ([2, 9, 9, 4 heads, 2 KV heads]), and a closure made per check compiled it again.
_REFERENCE = jax.jit(attn.reference_attention)
_REFERENCE_GRAD = jax.jit(jax.grad(_sin_loss(attn.reference_attention), (0, 1, 2)))


def _check(q, k, v, q_pos, k_pos, fn=None, grads=True):
  # Jitted: one compile per function instead of one per op in eager mode (the blockwise
  # kernel's pads, transposes and scans), a third of this file's time.
  fn = fn or _blockwise()
  np.testing.assert_allclose(jax.jit(fn)(q, k, v, q_pos, k_pos),
                             _REFERENCE(q, k, v, q_pos, k_pos), **TOL)
  if not grads:
    return
  got = jax.jit(jax.grad(_sin_loss(fn), (0, 1, 2)))(q, k, v, q_pos, k_pos)
  want = _REFERENCE_GRAD(q, k, v, q_pos, k_pos)
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


@pytest.mark.parametrize("block_q,block_k", [(1, 1), (2, 3), (4, 4), (5, 2), (3, 7)])
def test_causal_skipping_changes_nothing(block_q, block_k):
  """causal=True (positions are the indices) skips the tiles above the diagonal: the forward is
  bitwise the full loop's (a skipped tile adds exactly 0), the gradients agree to rounding, and
  both are the reference's."""
  q, k, v = _qkv(2, 9, 9, 4, 2, seed=11)
  pos = _arange(2, 9)
  causal = functools.partial(attn.blockwise_attention, block_q=block_q, block_k=block_k,
                             causal=True)
  full = functools.partial(causal, causal=False)
  np.testing.assert_array_equal(jax.jit(causal)(q, k, v, pos, pos),
                                jax.jit(full)(q, k, v, pos, pos))
  _check(q, k, v, pos, pos, causal)
  with pytest.raises(ValueError, match="causal=True.*9 queries and 7 keys"):
    causal(q, k[:, :7], v[:, :7], pos, pos[:, :7])


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
  fn = _blockwise()
  out = jax.jit(fn)(q, k, v, q_pos, k_pos)  # (jitted as in _check, which reuses its compile)
  assert np.isfinite(np.asarray(out)).all()
  _check(q, k, v, q_pos, k_pos, fn)


def test_bfloat16_close_to_reference():
  q, k, v = _qkv(2, 9, 9, 4, 2, seed=5, dtype=jnp.bfloat16)
  pos = _arange(2, 9)
  got = _blockwise()(q, k, v, pos, pos)
  assert got.dtype == jnp.bfloat16
  want = attn.reference_attention(q, k, v, pos, pos)
  np.testing.assert_allclose(np.float32(got), np.float32(want), atol=3e-2)


def test_bfloat16_reference_is_as_accurate_as_blockwise():
  """The reference path decodes on GPU (model.attention='cudnn', shared KV heads): its bf16
  scores came out of a bf16 dot (~8x the blockwise error against float32 math on the same
  inputs, which take float32 dot outputs); now both do."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=shape) * sc, jnp.bfloat16) for shape, sc in (
      ((2, 1, 4, 128), 2.0), ((2, 512, 2, 128), 2.0), ((2, 512, 2, 128), 1.0)))
  pos, keys = jnp.full((2, 1), 511, jnp.int32), _arange(2, 512)
  truth = attn.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), pos, keys)
  err = lambda x: float(jnp.max(jnp.abs(x.astype(jnp.float32) - truth)))
  ref, blockwise = attn.reference_attention(q, k, v, pos, keys), _blockwise()(q, k, v, pos, keys)
  assert ref.dtype == jnp.bfloat16
  assert err(ref) < 2 * err(blockwise), (err(ref), err(blockwise))


@pytest.mark.parametrize("impl", ["blockwise", "cudnn", "auto"])
def test_dispatch(impl):
  # On CPU cudnn and auto fall back to blockwise.
  q, k, v = _qkv(2, 6, 6, 4, 2, seed=6)
  pos = _arange(2, 6)
  _check(q, k, v, pos, pos, functools.partial(attn.dot_product_attention, impl=impl),
         grads=False)
  with pytest.raises(ValueError, match="flash"):
    attn.dot_product_attention(q, k, v, pos, pos, "flash")


def test_reference_dispatch_runs_the_reference(monkeypatch):
  """impl="reference" is the oracle the model-level tests compare the blockwise kernel with
  (model.attention="reference" against the default): were it dispatched to the blockwise
  kernel too, those comparisons would compare the kernel with itself and pass whatever it
  computed."""
  def no_kernel(*args, **kwargs):
    raise AssertionError("blockwise_attention called for impl='reference'")
  q, k, v = _qkv(2, 6, 6, 4, 2, seed=6)
  pos = _arange(2, 6)
  want = attn.reference_attention(q, k, v, pos, pos)
  monkeypatch.setattr(attn, "blockwise_attention", no_kernel)
  np.testing.assert_array_equal(attn.dot_product_attention(q, k, v, pos, pos, "reference"), want)


# Whole model ---------------------------------------------------------------------------------

CFG = llama.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, max_seq_len=32)


def _jit_apply(cfg):
  """llama.apply(cfg, ...) jitted: one compile per input shape instead of one per op. A fresh
  closure each call, so no trace outlives a test's monkeypatched block sizes."""
  return jax.jit(lambda p, tokens, positions=None, cache=None: llama.apply(
      cfg, p, tokens, positions, cache))


@pytest.fixture(scope="module")
def params():
  return jax.tree_util.tree_map(jnp.asarray, llama.host_random_params(CFG, 0))


@pytest.fixture
def small_blocks(monkeypatch):
  # Several tiles even at test lengths, so the model path exercises the online softmax (and,
  # with a cache, the live-length loop and its clamped last block: 16 slots in blocks of 3).
  monkeypatch.setattr(attn, "blockwise_attention", _blockwise(2, 3))
  monkeypatch.setattr(attn, "CACHE_BLOCK_K", 3)


def test_model_logits_without_cache(params, small_blocks):
  tokens = jnp.asarray(np.random.default_rng(7).integers(0, 32, (2, 9)), jnp.int32)
  ref, _ = _jit_apply(CFG.replace(attention="reference"))(params, tokens)
  got, _ = _jit_apply(CFG)(params, tokens)
  np.testing.assert_allclose(got, ref, **TOL)


def test_default_positions_skip_the_tiles_above_the_diagonal(params, monkeypatch):
  """The model's default positions (training, scoring) are the indices: its attention reads
  only the key tiles on or below the diagonal. Counted in the compiled program's dot FLOPs
  against the same positions passed explicitly (no promise, every tile): 16 tokens in 4 x 4
  tiles of 4 read 10 tiles instead of 16, each 2 dots of 2 * batch * heads * 4 * 4 * head_dim
  FLOPs, in each of the 2 layers. Same logits."""
  from rlhfuse_jax.perf import hlo_flops
  monkeypatch.setattr(attn, "blockwise_attention", _blockwise(4, 4))
  tokens = jnp.asarray(np.random.default_rng(12).integers(0, 32, (2, 16)), jnp.int32)
  explicit = _arange(2, 16)
  fns = {"default": lambda p, t: llama.apply(CFG, p, t)[0],
         "explicit": lambda p, t: llama.apply(CFG, p, t, explicit)[0]}
  flops, logits = {}, {}
  for name, fn in fns.items():
    compiled = jax.jit(fn).lower(params, tokens).compile()
    flops[name] = hlo_flops.analyze(compiled.as_text()).flops
    logits[name] = compiled(params, tokens)
  np.testing.assert_array_equal(logits["default"], logits["explicit"])
  tile = 2 * 2 * CFG.num_heads * 4 * 4 * CFG.head_dim_
  assert flops["explicit"] - flops["default"] == CFG.num_layers * (16 - 10) * 2 * tile


def test_model_logits_with_cache(params, small_blocks):
  # Prefill 5 tokens at per-row offsets into a 16-slot cache, then one decode step.
  rng = np.random.default_rng(8)
  tokens = jnp.asarray(rng.integers(0, 32, (2, 5)), jnp.int32)
  positions = _arange(2, 5, jnp.array([0, 4]))
  step = jnp.asarray(rng.integers(0, 32, (2, 1)), jnp.int32)
  outs = []
  for impl in ("reference", "blockwise"):
    cfg = CFG.replace(attention=impl)
    apply = _jit_apply(cfg)
    cache = llama.KVCache.zeros(cfg, 2, 16)
    logits, cache = apply(params, tokens, positions, cache)
    last, cache = apply(params, step, positions[:, -1:] + 1, cache)
    outs.append((logits, last, cache.k))
  for got, want in zip(outs[1], outs[0]):
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_decode_through_cache_equals_full_forward(params, small_blocks, dtype):
  # Prefill 4 tokens, then decode 6 one at a time: each step's logits are the full forward's at
  # that position. A bfloat16 cache holds uint16 bits (KVCache.dtype names the values).
  cfg = CFG.replace(dtype=dtype)
  tokens = jnp.asarray(np.random.default_rng(9).integers(0, 32, (2, 10)), jnp.int32)
  apply = _jit_apply(cfg)
  want, _ = apply(params, tokens)
  cache = llama.KVCache.zeros(cfg, 2, 16)
  assert cache.dtype == dtype and cache.k.dtype == llama.cache_bits_dtype(dtype)
  got, cache = apply(params, tokens[:, :4], cache=cache)
  steps = [got]
  for t in range(4, 10):
    logits, cache = apply(params, tokens[:, t:t + 1], jnp.full((2, 1), t), cache)
    steps.append(logits)
  tol = TOL if dtype == "float32" else dict(atol=3e-2, rtol=3e-2)
  np.testing.assert_allclose(jnp.concatenate(steps, 1), want, **tol)
  k, _ = cache.values()
  assert k.dtype == jnp.dtype(dtype) and bool(jnp.any(k[:, :, 9] != 0))


# Cached attention: live blocks only, in place -------------------------------------------------

# Jitted as the model runs it (layer and block sizes static, live_len traced): eagerly, each op
# around the key-block loop compiled on its own.
_cached_attention = jax.jit(attn.cached_attention, static_argnums=(3,),
                            static_argnames=("block_k", "block_q"))


def _cache(b, s, kvh, d=8, layers=2, seed=0):
  rng = np.random.default_rng(seed)
  shape = (layers, b, s, kvh, d)  # [layers, batch, S, kv, dim]
  return (jnp.asarray(rng.normal(size=shape), jnp.float32),
          jnp.asarray(rng.normal(size=shape), jnp.float32))


@pytest.mark.parametrize("l,block_k,block_q", [(1, 4, None), (1, 5, None), (5, 4, None),
                                               (5, 64, None), (5, 4, 2)])
def test_cached_attention_matches_reference(l, block_k, block_q):
  # 18 slots in blocks of 4 or 5: the last block is clamped inside the cache and must not count
  # the keys it re-reads twice. Rows sit at different offsets, one at the very end. block_q=2:
  # a prefill longer than CACHE_BLOCK_Q (512) runs in passes of block_q queries, the last one
  # partial; each pass must mask with its own queries' positions.
  b, s, h, kvh = 3, 18, 4, 2
  q, _, _ = _qkv(b, l, s, h, kvh, seed=1)
  kc, vc = _cache(b, s, kvh)
  q_pos = _arange(b, l, jnp.array([0, 7, s - l]))
  live = jnp.max(q_pos) + 1
  got, kc2, vc2 = _cached_attention(q, kc, vc, 1, q_pos, live, block_k=block_k,
                                     block_q=block_q)
  k_pos = _arange(b, s)
  want = _REFERENCE(q, kc[1], vc[1], q_pos, k_pos)
  np.testing.assert_allclose(got, want, **TOL)
  assert kc2 is not None and np.array_equal(kc2, kc) and np.array_equal(vc2, vc)


def test_cached_attention_reads_only_live_blocks():
  # Blocks wholly past the live length hold NaN: if they were read, the output would be NaN.
  # A row's result is the same whatever the batch's longest row (bitwise: fused == serial).
  b, s, h, kvh, bk = 2, 32, 4, 2, 4
  q, _, _ = _qkv(b, 1, s, h, kvh, seed=2)
  kc, vc = _cache(b, s, kvh, seed=3)
  q_pos = jnp.array([[5], [9]], jnp.int32)
  poisoned = (kc.at[:, :, 12:].set(jnp.nan), vc.at[:, :, 12:].set(jnp.nan))
  got, _, _ = _cached_attention(q, *poisoned, 0, q_pos, 10, block_k=bk)
  assert bool(jnp.all(jnp.isfinite(got)))
  longer, _, _ = _cached_attention(q, kc, vc, 0, q_pos, s, block_k=bk)
  np.testing.assert_array_equal(got, longer)
  np.testing.assert_allclose(got, _REFERENCE(q, kc[0], vc[0], q_pos, _arange(b, s)), **TOL)


def test_decode_chunk_writes_the_cache_in_place():
  # XLA's own accounting of the compiled decode chunk: its temporaries are a small fraction of
  # the KV cache (the state, cache included, is donated and aliased to the output). Before the
  # in-place cache the chunk rebuilt every layer's cache each step: 1.5x the cache at float32.
  from rlhfuse_jax.generation import instances
  from rlhfuse_jax.generation.sampling import SamplingConfig
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.perf import scale_check
  cfg = llama.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=4,
                          num_heads=4, num_kv_heads=2, max_seq_len=1024)
  sampling = SamplingConfig(temperature=1.0, max_new_tokens=1008, eos_id=-1, pad_id=0,
                            chunk_size=8)
  gen = instances.Generator(cfg, sampling, batch_size=32, prompt_len=16)
  gen.compile(scale_check.abstract_params(cfg, mesh_lib.replicated(gen.mesh)))
  mem = gen.memory()
  cache = jax.eval_shape(lambda: llama.KVCache.zeros(cfg, 32, 1024))
  assert mem["cache_bytes"] == 2 * cache.k.size * cache.k.dtype.itemsize
  assert mem["decode_temp_bytes"] <= 0.1 * mem["cache_bytes"], mem


def _param_keys(cfg):
  shapes = llama.param_shapes(cfg)
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
  got = jax.jit(jax.grad(loss(cfg)))(params)
  want = jax.jit(jax.grad(loss(CFG)))(params)
  jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, **TOL), got, want)


@pytest.mark.parametrize("field,value", [("attention", "flash"), ("remat", "some")])
def test_config_rejects_unknown(field, value):
  with pytest.raises(ValueError, match=f"model.{field}='{value}'"):
    CFG.replace(**{field: value})


# Scan over layers ------------------------------------------------------------------------------

def test_scan_layers_matches_unrolled(params):
  # Same weights stacked: logits with and without a cache, decode steps and gradients agree;
  # the tree converts both ways exactly.
  scfg = CFG.replace(scan_layers=True)
  sp = llama.stack_layers(params, CFG.num_layers)
  shapes = llama.param_shapes(scfg)
  assert jax.tree.structure(shapes) == jax.tree.structure(sp)
  assert tuple(llama.logical_specs(scfg)["layers"]["block"]["mlp"]["up_proj"]["kernel"]) == (
      "layers", "embed", "mlp")
  tokens = jnp.asarray(np.random.default_rng(10).integers(0, 32, (2, 9)), jnp.int32)
  outs = []
  for cfg, p in ((CFG, params), (scfg, sp)):
    apply = _jit_apply(cfg)
    logits, cache = apply(p, tokens, cache=llama.KVCache.zeros(cfg, 2, 16))
    step, cache = apply(p, tokens[:, :1], jnp.full((2, 1), 9), cache)
    outs.append((logits, step, cache.values()[0]))
  for got, want in zip(outs[1], outs[0]):
    np.testing.assert_allclose(got, want, **TOL)

  def loss(cfg, p):  # the logits too: one program per model for the forward and its gradients
    logits = llama.apply(cfg, p, tokens)[0]
    return jnp.sum(jnp.sin(logits)), logits

  def grad(cfg, p):
    return jax.jit(jax.grad(functools.partial(loss, cfg), has_aux=True))(p)
  (g_scan, logits_scan), (g, logits) = grad(scfg, sp), grad(CFG, params)
  np.testing.assert_allclose(logits_scan, logits, **TOL)
  for a, b in zip(jax.tree.leaves(llama.unstack_layers(g_scan)), jax.tree.leaves(g)):
    np.testing.assert_allclose(a, b, **TOL)
  back = llama.unstack_layers(sp)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))
  with pytest.raises(ValueError, match="layers_0"):
    llama.stack_layers(sp, CFG.num_layers)
