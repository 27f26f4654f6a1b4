"""Causal grouped-query attention by positions: a reference, a blockwise (flash-style) kernel in
plain JAX, and cuDNN's fused kernel on GPU.

Every implementation computes, for query row t of batch row b,

  out[b, t] = softmax_s(q[b, t] . k[b, s] / sqrt(d), over keys with k_pos[b, s] <= q_pos[b, t]) @ v

with query heads grouped over the key/value heads (GQA: query head i reads kv head i // group).
Masking by positions instead of indices covers the three ways models/llama.py calls attention:
training and scoring (q_pos == k_pos, right padding included), prefill and decode against a KV
cache of capacity S (q_pos = p..p+L-1 per row, k_pos = 0..S-1).

Invariants shared by the implementations:
- Softmax statistics are float32; matmul inputs are the compute dtype (q.dtype), as in the
  original llama.py attention (`reference_attention`, which the others are tested against).
- Masked scores are finfo(float32).min, not -inf: a query that sees no key (possible only for
  positions a caller made up, e.g. negative ones) gets the uniform average of all S values, not a
  NaN. The blockwise kernel reproduces this exactly; its own internal key padding is -inf, so it
  never leaks into any row.
- `blockwise_attention` never materialises [L, S] scores: forward and backward loop over
  [block_q, block_k] tiles, and the backward recomputes each tile's probabilities from the saved
  float32 row max and row sum (a custom_vjp), so what attention keeps for the backward is
  q, k, v, out and two [heads, L] vectors: O(L) per layer instead of O(L * S).
  This is the "activations in O(L)" half of the scale plan; remat of whole decoder blocks
  (ModelConfig.remat) is the other half (docs/architecture.md §5).

Against a KV cache (`cached_attention`) the live-prefix loop has a traced trip count. XLA:GPU
runs such a loop by copying its condition to the host and waiting, once per key block and layer:
on one H100 (1.1B bf16, cache 640) a decode step took 4.2 / 3.7 / 5.9 ms at batch 1 / 16 / 128
this way, and 2.1 / 1.7 / 4.2 ms reading the whole cache with static shapes
(experiments/results/h100_decode_variants). So `cache_attention_path` sends one-token decode
on GPU to the static path when the implementation is "auto" or "cudnn"; CPU and TPU keep
the loop (no host round trip there; on CPU the live prefix is what makes a step's cost follow
the live length, not the capacity).

"pallas" keeps the live-prefix loop but on the device: one-token decode runs
models/decode_kernel.py, a Pallas (Triton) kernel that reads each row's live key blocks from the
stacked cache in place; off GPU it runs the same kernel in interpret mode. Training, scoring and
prefill under "pallas" are those of "auto". On one H100 (1.1B bf16, cache 640,
experiments/results/h100_pallas_decode) it decodes in 1.90 / 1.34 / 2.52 ms per step at batch
1 / 16 / 128 against the static path's 2.11 / 1.67 / 4.16 ms, and a step at live length 128
costs the same at capacity 4096 as at 512 (1.01x; the static path 4.05x). So generation
instances on a GPU decode "auto" with the kernel (`instance_attention`); "cudnn" keeps the
static path (the opt-out). The kernel's Triton call has no partitioning rule, so on an instance
of several devices it runs inside a shard_map (`kernel_mesh`): each device attends its own rows
and KV heads of its own cache shard, which needs the KV heads split evenly over `tensor`.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Optional

from absl import logging
import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("reference", "blockwise", "cudnn", "auto", "pallas")
_MASKED = float(jnp.finfo(jnp.float32).min)  # score of a masked (but real) key, as reference
_warned: set = set()


def _warn_once(reason: str) -> None:
  # Traced once per shape; log each distinct reason once per process, not once per layer.
  if reason not in _warned:
    _warned.add(reason)
    logging.warning("attention: cudnn unavailable (%s); using blockwise", reason)


def _on_gpu() -> bool:
  """Whether jax's default backend is a GPU (False before any backend is initialised)."""
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def cache_attention_path(impl: str, num_queries: int) -> str:
  """How attention of `num_queries` queries against a KV cache runs under `impl` (module
  docstring): "kernel", one-token decode under "pallas" (`kernel_decode_attention`); "whole",
  every cache slot with static shapes (`reference_attention`), under "reference" and for
  one-token decode under "auto" / "cudnn" on a GPU backend; "loop", `cached_attention`'s
  live-prefix loop otherwise. Logs once per process when one-token decode on a GPU takes the
  loop: it works, but slowly."""
  if num_queries == 1 and impl == "pallas":
    return "kernel"
  if impl == "reference":
    return "whole"
  if num_queries == 1 and _on_gpu():
    if impl in ("auto", "cudnn"):
      return "whole"
    if "gpu-loop" not in _warned:
      _warned.add("gpu-loop")
      logging.warning(
          "model.attention=%r decodes on GPU through the live-prefix loop, whose traced trip "
          "count XLA:GPU syncs with the host per key block and layer: 1.4-2.5x slower per step "
          "than model.attention='auto' on an H100 (1.1B, cache 640; "
          "experiments/results/h100_decode_variants). Set model.attention='auto'.", impl)
  return "loop"


def kernel_splits_heads(num_kv_heads: int, tensor: int) -> bool:
  """Whether the kernel can run on a mesh with `tensor` devices on the head axis: each needs
  whole KV heads (and the query heads that read them) of its own."""
  return tensor == 1 or num_kv_heads % tensor == 0


def instance_attention(impl: str, num_kv_heads: int, tensor: int) -> str:
  """The `model.attention` a generation instance runs (module docstring): "auto" becomes
  "pallas" on a GPU backend, where the kernel was measured faster at every batch, when its KV
  heads split evenly over the instance's `tensor` devices; everything else is kept (an
  explicit "pallas" that cannot split is refused by the instance, not here)."""
  if impl == "auto" and _on_gpu() and kernel_splits_heads(num_kv_heads, tensor):
    return "pallas"
  return impl


# (mesh, batch axes, tensor axis or None) while a generation instance traces its programs
# (`kernel_mesh`), else None: the kernel then runs per device inside a shard_map.
_KERNEL_MESH: contextvars.ContextVar = contextvars.ContextVar("kernel_mesh", default=None)


@contextlib.contextmanager
def kernel_mesh(mesh, batch_axes: tuple[str, ...], tensor_axis: Optional[str]):
  """While active (tracing), `kernel_decode_attention` runs the kernel per device of `mesh` (a
  Mesh or an AbstractMesh: generation instances pass the abstract one, so instances of one
  shape share a trace): rows split over `batch_axes`, KV heads (and their query heads) over
  `tensor_axis` (None: not split), as the instance's cache is placed
  (generation/engine.state_shardings). A mesh of one device, or None, calls the kernel
  directly."""
  size = 1 if mesh is None else math.prod(mesh.shape.values())
  token = _KERNEL_MESH.set(None if size == 1 else (mesh, tuple(batch_axes), tensor_axis))
  try:
    yield
  finally:
    _KERNEL_MESH.reset(token)


def kernel_decode_attention(q, k_cache, v_cache, layer, q_pos, dtype):
  """One-token decode through models/decode_kernel.py (the Triton kernel on GPU, the same kernel
  body in interpret mode elsewhere, so CPU tests run its code).

  q: [batch, 1, heads, dim]; k_cache, v_cache: [layers, batch, S, kv_heads, dim] as stored
  (bits for 16-bit `dtype`), already holding this step's keys; layer: int or int32 scalar;
  q_pos: [batch, 1]. Returns [batch, 1, heads, dim] in q.dtype. Imported here, not at the top:
  only "pallas" runs pay for importing jax.experimental.pallas.
  """
  from rlhfuse_jax.models import decode_kernel  # pylint: disable=import-outside-toplevel
  fn = functools.partial(decode_kernel.pallas_decode_attention, dtype=dtype,
                         interpret=not _on_gpu())
  ctx = _KERNEL_MESH.get()
  if ctx is None:
    return fn(q, k_cache, v_cache, layer, q_pos)
  mesh, ax, t = ctx
  if t is not None and k_cache.shape[3] % mesh.shape[t]:
    raise ValueError(f"model.attention='pallas' splits the KV heads over {t!r}: "
                     f"model.num_kv_heads={k_cache.shape[3]} on {mesh.shape[t]} devices")
  P = jax.sharding.PartitionSpec
  rows, cache = P(ax, None, t, None), P(None, ax, None, t, None)
  # A Pallas call has no replication rule for shard_map's checker; every output here is split
  # by rows and heads like its inputs, nothing is replicated.
  return jax.shard_map(fn, mesh=mesh, in_specs=(rows, cache, cache, P(), P(ax, None)),
                       out_specs=rows, check_vma=False)(q, k_cache, v_cache,
                                                        jnp.asarray(layer, jnp.int32), q_pos)


def reference_attention(q, k, v, q_pos, k_pos):
  """The original llama.py attention: materialises float32 [batch, kv, group, L, S] scores.

  q: [batch, L, heads, dim]; k, v: [batch, S, kv_heads, dim]; q_pos: [batch, L];
  k_pos: [batch, S]. Returns [batch, L, heads, dim] in q.dtype.
  """
  b, l, h, d = q.shape
  kvh = k.shape[2]
  dtype = q.dtype
  q = q.reshape(b, l, kvh, h // kvh, d)  # [batch, L, kv, group, dim]
  # Float32 scores and p @ v sums straight from the dots, as the blockwise paths and the kernel
  # have them (16-bit dot outputs upcast afterwards were ~8x less accurate in bfloat16).
  scores = jnp.einsum("blkgd,bskd->bkgls", q, k.astype(dtype),
                      preferred_element_type=jnp.float32)
  scores = scores / jnp.sqrt(jnp.float32(d))
  causal = k_pos[:, None, :] <= q_pos[:, :, None]  # [batch, L, S]
  scores = jnp.where(causal[:, None, None], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("bkgls,bskd->blkgd", probs, v.astype(dtype),
                   preferred_element_type=jnp.float32).astype(dtype)
  return out.reshape(b, l, h, d)


# Blockwise kernel ------------------------------------------------------------------------------
# Internal layout is head-major: q [batch, kv, group, L, dim], k and v [batch, kv, S, dim]; the
# sequence axes are padded to whole blocks. `s_len` (static) is the true key count: keys at index
# >= s_len are padding and score -inf, so they get probability 0 even in a fully masked row.

def _tile_scores(qb, kb, qpos, kpos, kidx, s_len, d):
  """Masked float32 scores of one tile and the causal mask.

  qb: [b, kv, g, bq, d]; kb: [b, kv, bk, d]; qpos: [b, bq]; kpos: [b, bk]; kidx: [bk].
  Returns s [b, kv, g, bq, bk] and mask [b, 1, 1, bq, bk].
  """
  s = jnp.einsum("bkgqd,bksd->bkgqs", qb, kb, preferred_element_type=jnp.float32)
  s = s / jnp.sqrt(jnp.float32(d))
  mask = (kpos[:, None, :] <= qpos[:, :, None])[:, None, None]  # [b, 1, 1, bq, bk]
  s = jnp.where(mask, s, _MASKED)
  s = jnp.where(kidx < s_len, s, -jnp.inf)  # internal padding: never attended
  return s, mask


def _blocks(x, axis, n):
  """Splits `axis` into n blocks and moves the block index first (the scan axis)."""
  shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x, axis):
  """Inverse of _blocks: [n, ..., block at axis, ...] -> [..., n * block, ...]."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _causal_blocks(bq: int, bk: int, nq: int, nk: int) -> list:
  """Key blocks each query block reads when the positions are the indices
  (`positions_are_indices`): those up to its last query, ceil((i+1) bq / bk); a tile wholly
  above the diagonal has every score masked and adds exactly 0 to the row sums and gradients."""
  return [min(nk, -(-(i + 1) * bq // bk)) for i in range(nq)]


def _flash_fwd_impl(bq, bk, s_len, causal, q, k, v, q_pos, k_pos):
  """Returns out [b, kv, g, Lp, d] (q.dtype) and float32 row max m and row sum l [b, kv, g, Lp]."""
  b, kvh, g, lp, d = q.shape
  sp = k.shape[2]
  nq, nk = lp // bq, sp // bk
  ks, vs = _blocks(k, 2, nk), _blocks(v, 2, nk)  # [nk, b, kv, bk, d]
  kposs = _blocks(k_pos, 1, nk)  # [nk, b, bk]
  kidxs = jnp.arange(sp).reshape(nk, bk)

  def q_block(qb, qpos, n):  # [b, kv, g, bq, d], [b, bq]; the first n key blocks
    def k_block(carry, ys):
      m, l, acc = carry  # [b, kv, g, bq] x2 (float32), [b, kv, g, bq, d] (float32)
      kb, vb, kpos, kidx = ys
      s, _ = _tile_scores(qb, kb, qpos, kpos, kidx, s_len, d)
      # The first tile always holds a real key (padding < one block), so m_new is finite.
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      corr = jnp.exp(m - m_new)
      l = l * corr + p.sum(-1)
      pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(q.dtype), vb,
                      preferred_element_type=jnp.float32)
      return (m_new, l, acc * corr[..., None] + pv), None

    init = (jnp.full((b, kvh, g, bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, kvh, g, bq), jnp.float32), jnp.zeros((b, kvh, g, bq, d), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(k_block, init, (ks[:n], vs[:n], kposs[:n], kidxs[:n]))
    return (acc / l[..., None]).astype(q.dtype), m, l

  qs, qposs = _blocks(q, 3, nq), _blocks(q_pos, 1, nq)
  if not causal:  # one loop over the query blocks, each reading every key block
    _, (out, m, l) = jax.lax.scan(lambda _, xs: (None, q_block(*xs, nk)), None, (qs, qposs))
    return _unblocks(out, 3), _unblocks(m, 3), _unblocks(l, 3)
  # Causal: query block i reads its own key blocks only, a static count per block, so the
  # query blocks are unrolled (nq loops of different lengths; nq = L / block_q is small).
  parts = [q_block(qs[i], qposs[i], n) for i, n in enumerate(_causal_blocks(bq, bk, nq, nk))]
  return tuple(jnp.concatenate(xs, axis=3) for xs in zip(*parts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _flash(bq, bk, s_len, causal, q, k, v, q_pos, k_pos):
  return _flash_fwd_impl(bq, bk, s_len, causal, q, k, v, q_pos, k_pos)[0]


def _flash_fwd(bq, bk, s_len, causal, q, k, v, q_pos, k_pos):
  out, m, l = _flash_fwd_impl(bq, bk, s_len, causal, q, k, v, q_pos, k_pos)
  # Residuals are O(L): no per-tile scores or probabilities survive the forward.
  return out, (q, k, v, q_pos, k_pos, out, m, l)


def _flash_bwd(bq, bk, s_len, causal, res, dout):
  q, k, v, q_pos, k_pos, out, m, l = res
  b, kvh, g, lp, d = q.shape
  sp = k.shape[2]
  nq, nk = lp // bq, sp // bk
  dtype = q.dtype
  # D_t = sum_s p_ts dp_ts = dout_t . out_t (FlashAttention-2, eq. for dS).
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)  # [b, kv, g, Lp]
  ks, vs = _blocks(k, 2, nk), _blocks(v, 2, nk)  # [nk, b, kv, bk, d]
  kposs = _blocks(k_pos, 1, nk)
  kidxs = jnp.arange(sp).reshape(nk, bk)

  def q_block(dk, dv, xs, n):  # dk, dv: [b, kv, Sp, d] float32; the first n key blocks
    qb, dob, deltab, mb, lb, qpos = xs

    def k_block(dq, ys):
      kb, vb, kpos, kidx = ys
      s, mask = _tile_scores(qb, kb, qpos, kpos, kidx, s_len, d)
      p = jnp.exp(s - mb[..., None]) / lb[..., None]  # [b, kv, g, bq, bk] float32
      dp = jnp.einsum("bkgqd,bksd->bkgqs", dob, vb, preferred_element_type=jnp.float32)
      # Masked scores are constants (jnp.where in the reference): no gradient flows to q or k
      # through them, even in a fully masked row where their probability is not 0.
      ds = jnp.where(mask, p * (dp - deltab[..., None]), 0.0)
      ds = (ds / jnp.sqrt(jnp.float32(d))).astype(dtype)
      dq = dq + jnp.einsum("bkgqs,bksd->bkgqd", ds, kb, preferred_element_type=jnp.float32)
      dk_j = jnp.einsum("bkgqs,bkgqd->bksd", ds, qb, preferred_element_type=jnp.float32)
      dv_j = jnp.einsum("bkgqs,bkgqd->bksd", p.astype(dtype), dob,
                        preferred_element_type=jnp.float32)
      return dq, (dk_j, dv_j)

    dq, (dk_js, dv_js) = jax.lax.scan(k_block, jnp.zeros(qb.shape, jnp.float32),
                                      (ks[:n], vs[:n], kposs[:n], kidxs[:n]))
    if n == nk:
      return dk + _unblocks(dk_js, 2), dv + _unblocks(dv_js, 2), dq
    return (dk.at[:, :, :n * bk].add(_unblocks(dk_js, 2)),
            dv.at[:, :, :n * bk].add(_unblocks(dv_js, 2)), dq)

  zeros = jnp.zeros((b, kvh, sp, d), jnp.float32)
  xs = (_blocks(q, 3, nq), _blocks(dout.astype(dtype), 3, nq), _blocks(delta, 3, nq),
        _blocks(m, 3, nq), _blocks(l, 3, nq), _blocks(q_pos, 1, nq))
  if not causal:
    def step(carry, x):
      dk, dv, dq = q_block(*carry, x, nk)
      return (dk, dv), dq
    (dk, dv), dqs = jax.lax.scan(step, (zeros, zeros), xs)
    dq = _unblocks(dqs, 3)
  else:  # unrolled over the query blocks, as in the forward
    dk, dv, dqs = zeros, zeros, []
    for i, n in enumerate(_causal_blocks(bq, bk, nq, nk)):
      dk, dv, dq_i = q_block(dk, dv, tuple(x[i] for x in xs), n)
      dqs.append(dq_i)
    dq = jnp.concatenate(dqs, axis=3)
  # Positions are integers: no cotangent.
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_to(x, axis, size):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


# True while tracing a forward whose attention positions are the token indices, 0..L-1 in every
# row for queries and keys alike (`positions_are_indices`).
_POSITIONS_ARE_INDICES: contextvars.ContextVar = contextvars.ContextVar(
    "positions_are_indices", default=False)


@contextlib.contextmanager
def positions_are_indices(value: bool = True):
  """While active (tracing), the caller promises that every attention call without a cache has
  q_pos == k_pos == 0..L-1 in every row (models/llama.py's default positions, which training and
  scoring use), so `blockwise_attention` skips the key tiles wholly above the diagonal: about
  half of the causal L x L work, with bitwise the same result (those tiles' scores are all
  masked and add exactly 0). `value=False` withdraws the promise for a nested call."""
  token = _POSITIONS_ARE_INDICES.set(bool(value))
  try:
    yield
  finally:
    _POSITIONS_ARE_INDICES.reset(token)


def blockwise_attention(q, k, v, q_pos, k_pos, block_k: int = 512, block_q: int = 512,
                        causal: Optional[bool] = None):
  """Flash-style attention with O(L * block) memory in forward and backward.

  Same contract as `reference_attention` (shapes, masking, dtype, fully masked rows). Blocks are
  clipped to the sequence lengths (decode: block_q = 1) and the sequences padded to whole
  blocks internally; padded keys are never attended, padded queries are dropped.

  causal: the positions are the indices (q_pos == k_pos == 0..L-1 in every row): tiles wholly
  above the diagonal are skipped. None: as `positions_are_indices` says while tracing. Wrong
  positions under causal=True give wrong results: only pass it when it holds.
  """
  b, l, h, d = q.shape
  s, kvh = k.shape[1], k.shape[2]
  if causal is None:
    causal = _POSITIONS_ARE_INDICES.get()
  if causal and l != s:
    raise ValueError(f"blockwise_attention(causal=True) needs as many queries as keys (the "
                     f"positions are the indices), got {l} queries and {s} keys")
  g = h // kvh
  dtype = q.dtype
  bq, bk = max(1, min(block_q, l)), max(1, min(block_k, s))
  lp, sp = -(-l // bq) * bq, -(-s // bk) * bk
  qh = jnp.transpose(q.reshape(b, l, kvh, g, d), (0, 2, 3, 1, 4))  # [b, kv, g, L, d]
  kh = jnp.transpose(k.astype(dtype), (0, 2, 1, 3))  # [b, kv, S, d]
  vh = jnp.transpose(v.astype(dtype), (0, 2, 1, 3))
  out = _flash(bq, bk, s, bool(causal), _pad_to(qh, 3, lp), _pad_to(kh, 2, sp), _pad_to(vh, 2, sp),
               _pad_to(q_pos.astype(jnp.int32), 1, lp), _pad_to(k_pos.astype(jnp.int32), 1, sp))
  out = out[:, :, :, :l]  # [b, kv, g, L, d]
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, l, h, d)


# Attention against a KV cache ------------------------------------------------------------------
# Decode (and prefill) read the cache in place: keys at cache index s have position s, so only
# the blocks below the longest live row can hold a key any query sees. The loop over key blocks
# has a traced trip count, ceil(live_len / block), not the capacity: a step's reads grow with the
# live prefix, and a cache of capacity 4096 costs what one of 512 does at the same live length.
CACHE_BLOCK_K = 128  # keys per block of `cached_attention`; also the live-length granularity
CACHE_BLOCK_Q = 512  # queries per pass of a long prefill (bounds its [.., L, block] scores)


def cached_attention(q, k_cache, v_cache, layer: int, q_pos, live_len, load=None,
                     block_k: Optional[int] = None, block_q: Optional[int] = None):
  """Attention of q against layer `layer` of a stacked cache, reading only live key blocks.

  q: [batch, L, heads, dim]; k_cache, v_cache: [layers, batch, S, kv_heads, dim], already
  holding this call's keys (key at index s has position s); q_pos: [batch, L]; live_len: int32
  scalar > max(q_pos) (traced; keys at index >= live_len are never read); load: turns a block
  read from the cache into its values (default: as it is; llama.py stores raw bits). Returns
  (out [batch, L, heads, dim] in q.dtype, k_cache, v_cache): the caches come back unchanged,
  threaded through the loop carry so XLA reads them where they are instead of copying the layer.

  Same masking as the other implementations (finfo.min for a real key past a query, so a row's
  result does not depend on how many blocks the batch's longest row needs: a block wholly past
  a row's position adds exactly 0 to its sums). Forward only: the trainer never reads a cache.
  """
  b, l, h, d = q.shape
  _, _, s, kvh, _ = k_cache.shape
  g = h // kvh
  dtype = q.dtype
  load = load or (lambda x: x)
  block_q = block_q or CACHE_BLOCK_Q
  bk = max(1, min(block_k or CACHE_BLOCK_K, s))
  live_len = jnp.asarray(live_len, jnp.int32)
  outs = []
  for q0 in range(0, l, block_q):  # a long prefill in passes of block_q queries
    qb = q[:, q0:q0 + block_q]
    lq = qb.shape[1]
    qh = jnp.transpose(qb.reshape(b, lq, kvh, g, d), (0, 2, 3, 1, 4))  # [b, kv, g, Lq, d]
    qpos = q_pos[:, q0:q0 + block_q]  # [b, Lq]
    # This pass's queries see no key past their own largest position (a causal prefill's
    # first pass reads its first blocks only).
    num_blocks = (jnp.minimum(live_len, jnp.max(qpos) + 1) + bk - 1) // bk

    def body(carry, qh=qh, qpos=qpos):
      j, kc, vc, m, lsum, acc = carry
      # The last block is clamped inside the cache; keys it re-reads were counted already.
      start = jnp.minimum(j * bk, s - bk)
      kb = load(jax.lax.dynamic_slice(kc, (layer, 0, start, 0, 0), (1, b, bk, kvh, d))[0])
      vb = load(jax.lax.dynamic_slice(vc, (layer, 0, start, 0, 0), (1, b, bk, kvh, d))[0])
      kidx = start + jnp.arange(bk, dtype=jnp.int32)  # [bk] = the keys' positions
      sc = jnp.einsum("bkgqd,bskd->bkgqs", qh, kb.astype(dtype),
                      preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
      mask = (kidx[None, None, :] <= qpos[:, :, None])[:, None, None]  # [b, 1, 1, Lq, bk]
      sc = jnp.where(mask, sc, _MASKED)
      sc = jnp.where(kidx >= j * bk, sc, -jnp.inf)
      # Block 0 holds position 0 <= every query position, so m_new is finite from the start.
      m_new = jnp.maximum(m, sc.max(-1))
      p = jnp.exp(sc - m_new[..., None])
      corr = jnp.exp(m - m_new)
      pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(dtype), vb.astype(dtype),
                      preferred_element_type=jnp.float32)
      return j + 1, kc, vc, m_new, lsum * corr + p.sum(-1), acc * corr[..., None] + pv

    init = (jnp.int32(0), k_cache, v_cache, jnp.full((b, kvh, g, lq), -jnp.inf, jnp.float32),
            jnp.zeros((b, kvh, g, lq), jnp.float32), jnp.zeros((b, kvh, g, lq, d), jnp.float32))
    _, k_cache, v_cache, _, lsum, acc = jax.lax.while_loop(
        lambda c, n=num_blocks: c[0] < n, body, init)
    out = (acc / lsum[..., None]).astype(dtype)  # [b, kv, g, Lq, d]
    outs.append(jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, lq, h, d))
  out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
  return out, k_cache, v_cache


# cuDNN -----------------------------------------------------------------------------------------

def _cudnn_unsupported(q, k) -> Optional[str]:
  """Why cuDNN's fused attention cannot run this call (None if it can), checked before tracing
  it so the fallback is a decision, not an exception mid-compile."""
  try:
    backend = jax.default_backend()
  except RuntimeError as e:  # no backend initialised: treat as unsupported
    return f"no backend ({e})"
  if backend != "gpu":
    return f"backend is {backend!r}, not 'gpu'"
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    return f"dtype {q.dtype} (cudnn needs bfloat16 or float16)"
  d = q.shape[-1]
  if d % 8 or d > 128:
    return f"head_dim {d} (cudnn needs a multiple of 8, <= 128)"
  if q.shape[1] % 2 or k.shape[1] % 2:
    # Training with a bias/mask needs even lengths (check_is_flash_attention).
    return f"odd length (L={q.shape[1]}, S={k.shape[1]})"
  return None


def cudnn_attention(q, k, v, q_pos, k_pos):
  """jax.nn.dot_product_attention(implementation="cudnn") with the position mask.

  The mask [batch, 1, L, S] is boolean (no heads, 1 byte per pair): cuDNN's causal mask types
  are aligned at index 0 and cannot express per-row cache offsets, and the mask argument exists
  with the same meaning in jax 0.10 and 0.11. Raises where cuDNN rejects the call.
  """
  dtype = q.dtype
  mask = (k_pos[:, None, :] <= q_pos[:, :, None])[:, None]  # [batch, 1, L, S]
  return jax.nn.dot_product_attention(
      q, k.astype(dtype), v.astype(dtype), mask=mask, scale=1.0 / math.sqrt(q.shape[-1]),
      implementation="cudnn")


def dot_product_attention(q, k, v, q_pos, k_pos, impl: str = "blockwise", **block_sizes):
  """Dispatches on impl in IMPLEMENTATIONS. "cudnn", "auto" and "pallas" (whose kernel is for
  decode only) use cuDNN where it runs (GPU, bf16/fp16, supported head_dim) and fall back to
  blockwise, "cudnn" with a logged reason, otherwise.

  q: [batch, L, heads, dim]; k, v: [batch, S, kv_heads, dim]; q_pos: [batch, L];
  k_pos: [batch, S]. Returns [batch, L, heads, dim] in q.dtype.
  """
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention impl {impl!r}; expected one of {IMPLEMENTATIONS}")
  if impl == "reference":
    return reference_attention(q, k, v, q_pos, k_pos)
  if impl in ("cudnn", "auto", "pallas"):
    reason = _cudnn_unsupported(q, k)
    if reason is None:
      try:
        return cudnn_attention(q, k, v, q_pos, k_pos)
      except (NotImplementedError, ValueError, RuntimeError) as e:  # raised while tracing
        reason = f"{type(e).__name__}: {e}"
    if impl == "cudnn":  # asked for explicitly: say why it did not happen
      _warn_once(reason)
  return blockwise_attention(q, k, v, q_pos, k_pos, **block_sizes)
