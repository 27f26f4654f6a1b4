"""One-token decode attention against the stacked KV cache as a Pallas kernel (Triton backend).

Why a kernel: on GPU the live-prefix loop of attention.cached_attention has a traced trip count,
which XLA:GPU runs with a host round trip per key block and layer, and the static alternative
reads the whole cache every step (attention.cache_attention_path). A kernel keeps the loop on
the device: each program reads only its row's live key blocks, in place, from the stacked cache
[layers, batch, S, kv_heads, dim] (no per-step copy or transpose of the layer). Measured on one
H100 it is the fastest of the three at batch 1, 16 and 128, so generation instances on GPU
decode "auto" with it (attention.instance_attention; experiments/results/h100_pallas_decode).

Layout. Grid (batch, kv_heads, k_splits). The key blocks 0..ceil(S / block_k) - 1 are dealt out
to the splits in contiguous runs; program (b, h, s) walks the blocks of its run that are live for
row b (block j is live iff j * block_k <= q_pos[b]) and keeps float32 online-softmax state for
the G query heads of kv head h: row max m [Gp], row sum l [Gp], unnormalised acc [Gp, D]. It
writes (acc, m, l); `_combine` merges the splits (log-sum-exp) and normalises. A split without a
live block writes m = -inf, l = 0, acc = 0 and contributes exactly nothing.

Triton constraints the kernel is written for (all loads, stores and tiles power-of-2 sized):
- Query heads per kv head are padded to Gp = max(16, next_pow2(G)) rows in the wrapper (q is
  tiny); padded rows are zeros and dropped at the end. 16 is the smallest M of tl.dot.
- head_dim D is covered by power-of-2 column chunks (80 = 64 + 16), so no load is masked or
  out of bounds; chunks of >= 16 columns use the tensor-core dot, narrower ones (and blocks of
  < 16 keys) a broadcast multiply-sum.
- Key blocks are min(block_k, largest power of 2 <= S) keys; the last block of a cache whose S is
  not a multiple is clamped to end at S and its re-read keys (index < j * block_k) get -inf.
- The caches are passed whole (no BlockSpec) and indexed inside the kernel with one indexer,
  [layer, b, pl.ds(start, bk), h, pl.ds(col, w)]; `layer` arrives as an int32 array, so a traced
  layer index (ModelConfig.scan_layers) works the same as a static one. 16-bit caches hold raw
  bits (llama.cache_bits): the loaded tile is bitcast to the value dtype in the kernel.
- float32 dots ask for Precision.HIGHEST (IEEE in Triton; DEFAULT would be TF32).

Masking: keys past q_pos[b] score -inf and their values are zeroed before p @ v, so whatever the
cache holds past a row's position (stale or even NaN bits) cannot reach the output. Every live
block holds key j * block_k <= q_pos[b], so a split that reads any block has a finite max.

jax 0.11 deprecates the Pallas Triton backend (a DeprecationWarning at lowering: "will be removed
in a future JAX version", in favour of Mosaic GPU); it still lowers and runs there. attention.py
imports this module only when a kernel path is chosen, so a jax without it breaks only those.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

MIN_DOT = 16  # smallest M, N and K of Triton's tl.dot
TARGET_PROGRAMS = 512  # default k_splits aims at about this many programs (~4 per H100 SM)


def _pow2_floor(n: int) -> int:
  return 1 << (int(n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
  return 1 << (int(n) - 1).bit_length()


def column_chunks(d: int) -> tuple[tuple[int, int], ...]:
  """head_dim d as power-of-2 column chunks (offset, width), widest first: 80 -> (0, 64),
  (64, 16). Each chunk is one load of the cache tile and one dot."""
  chunks, off = [], 0
  while off < d:
    w = _pow2_floor(d - off)
    chunks.append((off, w))
    off += w
  return tuple(chunks)


def default_k_splits(batch: int, kv_heads: int, num_blocks: int) -> int:
  """Enough splits for about TARGET_PROGRAMS programs, at most one per key block: batch 1 splits
  the sequence to fill the GPU, large batches need no split (and no epilogue traffic)."""
  return max(1, min(num_blocks, -(-TARGET_PROGRAMS // (batch * kv_heads))))


def _dot(a, b, contract_b: int):
  """float32 a @ b (contract_b=0) or a @ b.T (contract_b=1) of 2-D tiles. tl.dot where every
  dim is >= MIN_DOT, else a broadcast multiply-sum (Triton's dot has no smaller shapes)."""
  m, k = a.shape
  n = b.shape[1 - contract_b]
  if min(m, k, n) >= MIN_DOT:
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
  a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
  if contract_b == 1:  # [m, 1, k] * [1, n, k] -> sum over k
    return jnp.sum(a32[:, None, :] * b32[None, :, :], axis=2)
  return jnp.sum(a32[:, :, None] * b32[None, :, :], axis=1)  # [m, k, 1] * [1, k, n]


def _kernel(layer_ref, qpos_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, n_ref, *, bk, s_len,
            blocks_per_split, value_dtype, chunks, scale):
  """One (row b, kv head h, split s) program.

  layer_ref: [1] int32; qpos_ref: [B] int32; q_ref: [Gp, D] (this row's and kv head's padded
  query heads); k_ref, v_ref: the whole caches [layers, B, S, KVH, D] (bits or values).
  o_ref: [Gp, D] float32 unnormalised acc; m_ref, l_ref: [Gp] float32; n_ref: [] int32, the
  key blocks this program read (counted by the loop body itself: tests check live-only reads).
  """
  b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer = layer_ref[0]
  qpos = qpos_ref[b]
  gp = q_ref.shape[0]
  compute_dtype = q_ref.dtype
  qs = [q_ref[:, off:off + w] for off, w in chunks]  # [Gp, w] each
  # Blocks 0..n_live-1 hold a key <= qpos; this split owns [lo, hi) of them.
  n_live = jax.lax.div(qpos + bk, bk)
  lo = s * blocks_per_split
  hi = jnp.maximum(lo, jnp.minimum(lo + blocks_per_split, n_live))

  def load(ref, start, off, w):
    x = ref[layer, b, pl.ds(start, bk), h, pl.ds(off, w)]  # [bk, w]
    if x.dtype != value_dtype:
      x = jax.lax.bitcast_convert_type(x, value_dtype)
    return x.astype(compute_dtype)

  def body(j, carry):
    m, l, accs, n = carry
    start = jnp.minimum(j * bk, s_len - bk)  # the last block is clamped inside the cache
    kidx = start + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
    # Visible: at or before the query, and not re-read by the clamped last block.
    live = (kidx <= qpos) & (kidx >= j * bk)  # [bk]
    sc = sum(_dot(qc, load(k_ref, start, off, w), 1) for qc, (off, w) in zip(qs, chunks))
    sc = jnp.where(live[None, :], sc * scale, -jnp.inf)  # [Gp, bk] float32
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))  # finite: the block holds key j * bk <= qpos
    p = jnp.exp(sc - m_new[:, None])
    corr = jnp.exp(m - m_new)
    p_c = p.astype(compute_dtype)
    new_accs = []
    for acc, (off, w) in zip(accs, chunks):
      vb = jnp.where(live[:, None], load(v_ref, start, off, w), 0)  # no NaN from dead slots
      new_accs.append(acc * corr[:, None] + _dot(p_c, vb, 0))
    return m_new, l * corr + jnp.sum(p, axis=1), tuple(new_accs), n + 1

  init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32),
          tuple(jnp.zeros((gp, w), jnp.float32) for _, w in chunks), jnp.int32(0))
  m, l, accs, n = jax.lax.fori_loop(lo, hi, body, init)
  for acc, (off, w) in zip(accs, chunks):
    o_ref[:, off:off + w] = acc
  m_ref[...] = m
  l_ref[...] = l
  n_ref[...] = n


def _combine(acc, m, l):
  """Log-sum-exp merge of the splits. acc: [splits, B, KVH, Gp, D]; m, l: [splits, B, KVH, Gp]
  float32. Returns the normalised [B, KVH, Gp, D] float32. Splits with m = -inf (no live block)
  get weight exp(-inf) = 0; the row max is finite because block 0 is live for every row."""
  m_all = jnp.max(m, axis=0)
  w = jnp.exp(m - m_all[None])  # [splits, B, KVH, Gp]
  l_all = jnp.sum(w * l, axis=0)
  return jnp.sum(w[..., None] * acc, axis=0) / l_all[..., None]


@functools.partial(jax.jit, static_argnames=("dtype", "block_k", "k_splits", "interpret",
                                             "num_warps", "num_stages", "with_stats"))
def pallas_decode_attention(q, k_cache, v_cache, layer, q_pos, dtype, *, block_k: int = 64,
                            k_splits: Optional[int] = None, interpret: bool = False,
                            num_warps: int = 4, num_stages: int = 2, with_stats: bool = False):
  """Attention of one query per row against layer `layer` of the stacked cache, live blocks only.

  q: [B, 1, H, D] (compute dtype); k_cache, v_cache: [layers, B, S, KVH, D] as stored (values,
  or their bits for 16-bit `dtype`); layer: int or int32 scalar; q_pos: [B, 1] int32, the query
  positions (row b sees keys 0..q_pos[b, 0]; its own key is already in the cache); dtype: the
  cache's value dtype. Returns [B, 1, H, D] in q.dtype: reference_attention over the keys at
  positions <= q_pos, softmax statistics and accumulation in float32. q_pos must be in [0, S):
  a negative position has no live block (reference_attention would average all S values).

  block_k: keys per block (clipped to the largest power of 2 <= S); k_splits: programs per
  (row, kv head) over the key blocks (default `default_k_splits`); interpret: run the kernel
  body as plain JAX (CPU tests); num_warps, num_stages: Triton's (untuned). The Triton
  CompilerParams also pick the Triton backend: jax's default GPU backend for pallas_call is
  Mosaic GPU, which this kernel is not written for. with_stats: also return the number of key
  blocks read per (row, kv head), [B, KVH] int32 (ceil((q_pos + 1) / block) when only live
  blocks are read).
  """
  b, l, h, d = q.shape
  if l != 1:
    raise ValueError(f"pallas_decode_attention takes one query per row, got L={l}")
  n_layers, cb, s_len, kvh, cd = k_cache.shape
  if (cb, cd) != (b, d) or h % kvh:
    raise ValueError(f"q {q.shape} does not match the cache {k_cache.shape}")
  g = h // kvh
  gp = max(MIN_DOT, _pow2_ceil(g))
  bk = min(block_k, _pow2_floor(s_len))
  num_blocks = -(-s_len // bk)
  splits = min(k_splits or default_k_splits(b, kvh, num_blocks), num_blocks)
  blocks_per_split = -(-num_blocks // splits)
  splits = -(-num_blocks // blocks_per_split)  # no split left without a block to own

  qh = q.reshape(b, kvh, g, d)
  qh = jnp.pad(qh, ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # [B, KVH, Gp, D]
  layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
  qpos = q_pos.reshape(b).astype(jnp.int32)

  kernel = functools.partial(
      _kernel, bk=bk, s_len=s_len, blocks_per_split=blocks_per_split,
      value_dtype=jnp.dtype(dtype), chunks=column_chunks(d), scale=1.0 / math.sqrt(d))
  whole = pl.BlockSpec()  # the whole array; the kernel indexes it
  acc, m, lsum, n_read = pl.pallas_call(
      kernel,
      grid=(b, kvh, splits),
      in_specs=[
          whole,  # layer
          whole,  # q_pos
          pl.BlockSpec((None, None, gp, d), lambda i, j, s: (i, j, 0, 0)),
          whole,  # k cache
          whole,  # v cache
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, gp, d), lambda i, j, s: (s, i, j, 0, 0)),
          pl.BlockSpec((None, None, None, gp), lambda i, j, s: (s, i, j, 0)),
          pl.BlockSpec((None, None, None, gp), lambda i, j, s: (s, i, j, 0)),
          pl.BlockSpec((None, None, None), lambda i, j, s: (s, i, j)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((splits, b, kvh, gp, d), jnp.float32),
          jax.ShapeDtypeStruct((splits, b, kvh, gp), jnp.float32),
          jax.ShapeDtypeStruct((splits, b, kvh, gp), jnp.float32),
          jax.ShapeDtypeStruct((splits, b, kvh), jnp.int32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="rlhfuse_decode_attention",
  )(layer_arr, qpos, qh, k_cache, v_cache)
  del n_layers
  out = _combine(acc, m, lsum)[:, :, :g]  # [B, KVH, G, D]
  out = out.reshape(b, 1, h, d).astype(q.dtype)
  return (out, jnp.sum(n_read, axis=0)) if with_stats else out
