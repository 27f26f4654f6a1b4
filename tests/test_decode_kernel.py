"""models/decode_kernel.py: the Pallas decode kernel (interpret mode on CPU) against
reference_attention over the live keys, on f32 and bf16-bit caches, GQA groups 1, 4 and 7,
ragged rows, splits with no live block, static and traced layers; garbage (NaN) past a row's
position never reaches its output; the kernel lowers to a Triton call for CUDA. The engine with
model.attention="pallas" is tested in test_generation.py, on its fixtures."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.models import attention as attn
from rlhfuse_jax.models import decode_kernel as dk
from rlhfuse_jax.models import llama

LAYERS = 3


def _case(b, h, kvh, d, s, dtype, seed):
  """q [b, 1, h, d]; caches [LAYERS, b, s, kvh, d] as llama stores them (bits for bf16); ragged
  positions [b, 1] with row 0 at position 0 and the last row at the last slot."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, 1, h, d)), dtype)
  k = jnp.asarray(rng.normal(size=(LAYERS, b, s, kvh, d)), dtype)
  v = jnp.asarray(rng.normal(size=(LAYERS, b, s, kvh, d)), dtype)
  pos = rng.integers(0, s, (b, 1)).astype(np.int32)
  pos[0, 0], pos[-1, 0] = 0, s - 1
  return q, llama.cache_bits(k), llama.cache_bits(v), jnp.asarray(pos)


def _reference(q, kc, vc, layer, pos, dtype, upcast=False):
  """reference_attention of q against layer `layer`, in float32 on the same inputs if upcast."""
  k, v = llama.from_bits(kc[layer], dtype), llama.from_bits(vc[layer], dtype)
  if upcast:
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  keys = jnp.broadcast_to(jnp.arange(k.shape[1]), k.shape[:2])
  return attn.reference_attention(q, k, v, pos, keys)


# (batch, heads, kv_heads, head_dim, capacity, block_k, k_splits, dtype): groups 1, 4 and 7;
# head_dim 8 (< 16: the multiply-sum path), 16, 32 and 80 (= 64 + 16 column chunks); capacities
# that are not a multiple of the block (a clamped last block); k_splits 1, 3, 4 and the default.
CASES = [
    (3, 4, 4, 16, 40, 16, 1, jnp.float32),
    (4, 8, 2, 8, 37, 8, 3, jnp.float32),
    (3, 14, 2, 80, 50, 16, 4, jnp.float32),
    (4, 14, 2, 80, 50, 16, 4, jnp.bfloat16),
    (3, 4, 1, 32, 64, 16, None, jnp.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}h{}kv{}d{}s{}bk{}ks{}-{}".format(
    *c[:7], jnp.dtype(c[7]).name))
def test_kernel_matches_reference_over_live_keys(case):
  b, h, kvh, d, s, bk, splits, dtype = case
  q, kc, vc, pos = _case(b, h, kvh, d, s, dtype, seed=s + h)
  name = jnp.dtype(dtype).name
  # Layer 0 static; the last layer traced (an argument of the jit, as under scan_layers).
  static = dk.pallas_decode_attention(q, kc, vc, 0, pos, name, block_k=bk, k_splits=splits,
                                      interpret=True)
  traced = jax.jit(lambda layer: dk.pallas_decode_attention(
      q, kc, vc, layer, pos, name, block_k=bk, k_splits=splits, interpret=True))(LAYERS - 1)
  for layer, got in ((0, static), (LAYERS - 1, traced)):
    assert got.shape == q.shape and got.dtype == q.dtype
    if dtype == jnp.float32:
      np.testing.assert_allclose(got, _reference(q, kc, vc, layer, pos, name), atol=1e-5,
                                 rtol=1e-5, err_msg=f"layer {layer}")
    else:  # float32 math on the bf16 inputs, then one bf16 rounding of outputs of size ~1
      want = _reference(q, kc, vc, layer, pos, name, upcast=True)
      np.testing.assert_allclose(got.astype(jnp.float32), want, atol=2 ** -7, rtol=2 ** -7,
                                 err_msg=f"layer {layer}")
      ref16 = _reference(q, kc, vc, layer, pos, name).astype(jnp.float32)
      np.testing.assert_allclose(got.astype(jnp.float32), ref16, atol=2 ** -6, rtol=2 ** -6)


def test_splits_without_a_live_block_contribute_nothing():
  """Row 0 sits at position 0: only block 0 is live, so with one block per split every split
  but the first is empty for it; all split counts give the one-split result."""
  q, kc, vc, pos = _case(2, 4, 2, 16, 64, jnp.float32, seed=3)
  outs = [dk.pallas_decode_attention(q, kc, vc, 1, pos, "float32", block_k=16, k_splits=n,
                                     interpret=True) for n in (1, 2, 4)]
  assert all(np.isfinite(o).all() for o in outs)
  for o in outs[1:]:
    np.testing.assert_allclose(o, outs[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nothing_past_a_rows_position_is_read(dtype):
  """Every slot past each row's position, and every other layer, holds NaN (bits, for bf16):
  the output is finite and bitwise the clean cache's. A key past the position in the row's
  last live block is masked (score -inf, value zeroed); a block past it is never loaded (the
  kernel's own count of the blocks it read)."""
  name = jnp.dtype(dtype).name
  q, kc, vc, pos = _case(4, 8, 2, 16, 45, dtype, seed=5)
  past = np.arange(45)[None, :] > np.asarray(pos)  # [b, S]
  poison = np.zeros((LAYERS, 4, 45, 1, 1), bool)
  poison[:] = past[None, :, :, None, None]
  poison[[0, 2]] = True  # the other layers
  nan = llama.cache_bits(jnp.full((), jnp.nan, dtype))
  bad_k, bad_v = jnp.where(poison, nan, kc), jnp.where(poison, nan, vc)
  run = lambda k, v: dk.pallas_decode_attention(q, k, v, 1, pos, name, block_k=8, k_splits=2,
                                                interpret=True, with_stats=True)
  (clean, read), (dirty, _) = run(kc, vc), run(bad_k, bad_v)
  # The loop itself counts the blocks it loads: ceil((pos + 1) / 8) per row and kv head.
  np.testing.assert_array_equal(read, np.broadcast_to((np.asarray(pos) + 8) // 8, (4, 2)))
  assert np.isfinite(np.asarray(dirty, np.float32)).all()
  np.testing.assert_array_equal(np.asarray(dirty, np.float32), np.asarray(clean, np.float32))


def test_kernel_lowers_to_a_triton_call_for_cuda():
  """Exported for CUDA (no GPU needed): the Pallas Triton lowering accepts every tile shape,
  the traced layer index, the bf16 bitcast and the non-power-of-2 group and head_dim (7, 80),
  and emits one Triton custom call (not Mosaic GPU, jax's default pallas_call GPU backend)."""
  q = jax.ShapeDtypeStruct((4, 1, 28, 80), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((LAYERS, 4, 100, 4, 80), jnp.uint16)
  pos = jax.ShapeDtypeStruct((4, 1), jnp.int32)
  layer = jax.ShapeDtypeStruct((), jnp.int32)
  fn = jax.jit(lambda q, k, v, layer, pos: dk.pallas_decode_attention(
      q, k, v, layer, pos, "bfloat16"))
  # The GPU it is lowered for: jax 0.11's Triton lowering asks the abstract mesh's device when
  # the process has no GPU (0.10's did not ask).
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                     platform="gpu")
  target = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                     abstract_device=h100)
  with jax.sharding.use_abstract_mesh(target):
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            q, cache, cache, layer, pos)
  text = exported.mlir_module()
  assert text.count("@__gpu$xla.gpu.triton") == 1 and "mosaic" not in text.lower()
