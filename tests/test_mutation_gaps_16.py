"""Pins the survivors of a second mutation audit of models/ and inference/scoring: cheap tests
against independent references (numpy formulas, hand-computed tables), each one failing under a
plausible bug that the rest of the suite lets through (the audit report lists the mutant each
kills)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.inference.scoring import ScoringBatch
from rlhfuse_jax.models import attention as attn
from rlhfuse_jax.models import decode_kernel as dk
from rlhfuse_jax.models import llama

_TINY = llama.ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=1, max_seq_len=32)


# models/llama.py ---------------------------------------------------------------------------------

def test_stacking_host_layers_keeps_them_on_the_host_in_layer_order():
  """stack_layers of numpy leaves (the HF loader's scan_layers path) gives numpy leaves, layer i
  at index i of the stacked axis: a loaded model is not copied onto one device whole before it
  is sharded. unstack_layers gives back the same arrays."""
  cfg = _TINY.replace(num_layers=3)
  params = llama.host_random_params(cfg, 0)
  stacked = llama.stack_layers(params, 3)
  assert set(stacked) == {"embed", "layers", "head"}
  for path, leaf in jax.tree_util.tree_leaves_with_path(stacked["layers"]["block"]):
    assert isinstance(leaf, np.ndarray) and leaf.shape[0] == 3, jax.tree_util.keystr(path)
  for i in range(3):
    jax.tree.map(lambda s, x, i=i: np.testing.assert_array_equal(s[i], x),
                 stacked["layers"]["block"], params[f"layers_{i}"])
  back = llama.unstack_layers(stacked)
  jax.tree.map(np.testing.assert_array_equal, back, params)


# models/attention.py -----------------------------------------------------------------------------

def test_cache_attention_path_table(monkeypatch):
  """Which path attention against a KV cache takes (attention.cache_attention_path): the Pallas
  kernel only for one-token decode under "pallas"; every slot with static shapes under
  "reference", and for one-token decode under "auto" or "cudnn" on a GPU (no host sync per key
  block); the live-prefix loop otherwise (prefill everywhere, and every decode on CPU)."""
  cases = [(impl, n) for impl in attn.IMPLEMENTATIONS for n in (1, 5)]
  monkeypatch.setattr(attn, "_on_gpu", lambda: False)
  cpu = {c: attn.cache_attention_path(*c) for c in cases}
  assert cpu == {
      ("reference", 1): "whole", ("reference", 5): "whole",
      ("blockwise", 1): "loop", ("blockwise", 5): "loop",
      ("cudnn", 1): "loop", ("cudnn", 5): "loop",
      ("auto", 1): "loop", ("auto", 5): "loop",
      ("pallas", 1): "kernel", ("pallas", 5): "loop"}
  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  monkeypatch.setattr(attn, "_warned", {"gpu-loop"})  # the slow-path warning, already given
  gpu = {c: attn.cache_attention_path(*c) for c in cases}
  assert gpu == {**cpu, ("cudnn", 1): "whole", ("auto", 1): "whole"}


def test_tracing_contexts_restore_the_enclosing_setting():
  """The model's tracing contexts (activation sharding, its lifting, tensor parallelism, the
  indices promise, the kernel mesh) hold only inside their `with` block, and a nested one
  gives the enclosing block its own setting back, also when the body raises."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  rules = {"batch": "data"}
  contexts = [
      (llama._ACTIVATIONS, lambda: llama.shard_activations(mesh, rules),
       llama.no_activation_constraints),
      (llama._TENSOR_AXIS, lambda: llama.tensor_parallel("tensor"),
       lambda: llama.tensor_parallel(None)),
      (attn._POSITIONS_ARE_INDICES, attn.positions_are_indices,
       lambda: attn.positions_are_indices(False)),
      (attn._KERNEL_MESH, lambda: attn.kernel_mesh(mesh, ("data",), None),
       lambda: attn.kernel_mesh(None, (), None)),
  ]
  for var, outer, inner in contexts:
    before = var.get()
    with outer():
      active = var.get()
      assert active != before, var.name
      with pytest.raises(RuntimeError):
        with inner():
          assert var.get() == before, var.name
          raise RuntimeError
      assert var.get() == active, var.name
    assert var.get() == before, var.name


@pytest.mark.parametrize("dtype,d,l,s,why", [
    (jnp.bfloat16, 128, 4, 6, None),  # the common LLaMA head_dim is within cuDNN's range
    (jnp.float16, 64, 2, 2, None),
    (jnp.bfloat16, 136, 4, 6, "head_dim 136"),
    (jnp.bfloat16, 100, 4, 6, "head_dim 100"),
    (jnp.float32, 64, 4, 6, "dtype float32"),
    (jnp.bfloat16, 64, 5, 6, "odd length"),
    (jnp.bfloat16, 64, 4, 7, "odd length"),
])
def test_cudnn_is_tried_exactly_where_it_runs(monkeypatch, dtype, d, l, s, why):
  """_cudnn_unsupported on a (faked) GPU backend: bfloat16 / float16, head_dim a multiple of 8
  up to and including 128, even query and key lengths; otherwise the reason names the cause.
  An off-by-one at 128 would send every 7B-class model to the blockwise fallback."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  q = jnp.zeros((1, l, 2, d), dtype)
  k = jnp.zeros((1, s, 2, d), dtype)
  got = attn._cudnn_unsupported(q, k)  # pylint: disable=protected-access
  if why is None:
    assert got is None
  else:
    assert got is not None and why in got


@pytest.mark.parametrize("impl,want", [
    ("reference", "reference"), ("blockwise", "blockwise"), ("cudnn", "cudnn"),
    ("auto", "cudnn"), ("pallas", "cudnn")])
def test_attention_without_a_cache_uses_cudnn_wherever_it_runs(monkeypatch, impl, want):
  """dot_product_attention: where cuDNN can run the call, "cudnn", "auto" and "pallas" (whose
  kernel is for decode only) train, score and prefill through it; "blockwise" and "reference"
  never do. On CPU every path gives the same numbers, so the choice is checked by stubbing the
  three implementations."""
  calls = []
  monkeypatch.setattr(attn, "_cudnn_unsupported", lambda q, k: None)
  for name in ("reference", "blockwise", "cudnn"):
    monkeypatch.setattr(attn, f"{name}_attention",
                        lambda *a, name=name, **kw: calls.append(name) or name)
  q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
  pos = jnp.arange(4, dtype=jnp.int32)[None]
  assert attn.dot_product_attention(q, q, q, pos, pos, impl) == want
  assert calls == [want]


# models/decode_kernel.py -------------------------------------------------------------------------

@pytest.mark.parametrize("batch,kv_heads,blocks,want", [
    (1, 1, 1000, 512),  # one row: split the sequence over TARGET_PROGRAMS programs
    (1, 1, 10, 10),  # at most one split per key block
    (1, 3, 1000, 171),  # ceil(512 / 3): at least TARGET_PROGRAMS programs in all
    (2, 5, 1000, 52),  # ceil(512 / 10)
    (64, 8, 1000, 1),  # 512 programs without a split
    (128, 8, 1000, 1),  # more than enough programs: never 0 splits
])
def test_default_k_splits_rounds_the_programs_up_to_the_target(batch, kv_heads, blocks, want):
  """default_k_splits: ceil(TARGET_PROGRAMS / (batch * kv_heads)) splits, at most one per key
  block and at least one (the Triton grid needs about 4 programs per SM to fill an H100)."""
  assert dk.TARGET_PROGRAMS == 512
  assert dk.default_k_splits(batch, kv_heads, blocks) == want


def test_kernel_on_a_cache_shorter_than_one_block():
  """A cache of 12 slots against the default block of 64 keys: the kernel's block shrinks to
  8 (the largest power of 2 <= 12), the second block is clamped to slots 4..11, and the output
  is reference_attention over each row's live keys (rows at positions 0, 5, 8 and 11)."""
  rng = np.random.default_rng(11)
  b, h, kvh, d, s = 4, 4, 2, 16, 12
  q = jnp.asarray(rng.normal(size=(b, 1, h, d)), jnp.float32)
  kc = jnp.asarray(rng.normal(size=(1, b, s, kvh, d)), jnp.float32)
  vc = jnp.asarray(rng.normal(size=(1, b, s, kvh, d)), jnp.float32)
  pos = jnp.array([[0], [5], [8], [11]], jnp.int32)
  got, read = dk.pallas_decode_attention(q, kc, vc, 0, pos, "float32", interpret=True,
                                         with_stats=True)
  keys = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  want = attn.reference_attention(q, kc[0], vc[0], pos, keys)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(read, np.broadcast_to([[1], [1], [2], [2]], (b, kvh)))


# Online softmax at extreme scores ---------------------------------------------------------------

def _extreme_case():
  """One query per row against 8 keys whose scores are set exactly: key j scores c_j for query
  head 0 and -c_j for head 1, with c_j = -300 + 7 j (all far below 0 for head 0, far above for
  head 1, spread enough that several keys carry weight). Rows at positions 7 and 3."""
  b, s, d = 2, 8, 8
  c = -300.0 + 7.0 * np.arange(s)
  k = np.zeros((b, s, 1, d), np.float32)
  k[:, :, 0, 0] = c
  q = np.zeros((b, 1, 2, d), np.float32)
  q[:, 0, 0, 0], q[:, 0, 1, 0] = np.sqrt(d), -np.sqrt(d)  # q . k_j / sqrt(d) = +-c_j
  v = np.random.default_rng(0).normal(size=(b, s, 1, d)).astype(np.float32)
  q_pos = np.array([[7], [3]], np.int32)
  want = np.zeros((b, 1, 2, d))
  for i in range(b):
    n = q_pos[i, 0] + 1
    for head, sign in ((0, 1.0), (1, -1.0)):
      z = sign * c[:n]
      p = np.exp(z - z.max())
      want[i, 0, head] = (p / p.sum()) @ v[i, :n, 0].astype(np.float64)
  return q, k, v, q_pos, want


@pytest.mark.parametrize("impl", ["reference", "blockwise", "cached", "kernel"])
def test_online_softmax_is_exact_at_scores_far_from_zero(impl):
  """Every attention implementation normalises by the running row max: scores around -300
  (exp underflows to 0 unless shifted) and +300 (exp overflows) give the float64 softmax. A
  running max started at 0 instead of -inf, or a missing shift, gives NaN or 0 here while
  random test inputs (scores of order 1) cannot tell."""
  q, k, v, q_pos, want = (jnp.asarray(x) for x in _extreme_case())
  keys = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
  if impl == "reference":
    got = attn.reference_attention(q, k, v, q_pos, keys)
  elif impl == "blockwise":
    got = attn.blockwise_attention(q, k, v, q_pos, keys, block_k=3, block_q=1)
  elif impl == "cached":
    got, _, _ = attn.cached_attention(q, k[None], v[None], 0, q_pos, 8, block_k=3)
  else:
    got = dk.pallas_decode_attention(q, k[None], v[None], 0, q_pos, "float32", block_k=2,
                                     k_splits=2, interpret=True)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


# inference/scoring.py ----------------------------------------------------------------------------

def test_scoring_batch_accepts_the_extreme_lengths_inside_its_rows():
  """ScoringBatch's bounds are inclusive: a prompt filling its whole bucket (P = width - T), a
  response of T tokens and one of 0 tokens fit the row; one token more does not."""
  tok = np.arange(1, 10, dtype=np.int32)[None].repeat(2, axis=0)  # P = 4, T = 5
  resp = tok[:, 4:]
  batch = ScoringBatch(tok, np.array([4, 1], np.int32), resp, np.array([5, 0], np.int32))
  assert (batch.batch_size, batch.num_response) == (2, 5)
  with pytest.raises(ValueError, match="prompt_lens"):
    ScoringBatch(tok, np.array([5, 1], np.int32), resp, np.array([5, 0], np.int32))
  with pytest.raises(ValueError, match="response_lens"):
    ScoringBatch(tok, np.array([4, 1], np.int32), resp, np.array([6, 0], np.int32))
