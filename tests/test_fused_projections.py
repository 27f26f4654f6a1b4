"""model.fused_projections: q/k/v and gate/up as one matmul each, against the same parameters.
Same parameter tree and values, the separate projections' logits, gradients and greedy tokens
to float32 rounding, and on a data x tensor mesh no collective the separate layers lack."""
import re

import jax
import jax.numpy as jnp
import numpy as np

from rlhfuse_jax.generation import instances
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.models import llama
from rlhfuse_jax.parallel import mesh as mesh_lib
from tests.test_generation import decode_collectives

CFG = llama.ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=2,
                        num_heads=6, num_kv_heads=2, max_seq_len=32)


def _tokens(b=3, l=10, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, (b, l)), jnp.int32)


def test_same_parameters_logits_and_gradients():
  """With and without q/k/v biases (Qwen2 / LLaMA): the same parameter tree and values for a
  seed, the separate projections' logits, loss and gradients to float32 rounding."""
  tok = _tokens()
  cases = []
  for bias in (False, True):
    cfg = CFG.replace(qkv_bias=bias)
    fused = cfg.replace(fused_projections=True)
    p, pf = (jax.jit(lambda k, c=c: llama.init_params(c, k)[0])(jax.random.key(1))
             for c in (cfg, fused))
    assert jax.tree.structure(p) == jax.tree.structure(pf)
    assert llama.logical_specs(cfg) == llama.logical_specs(fused)
    jax.tree.map(np.testing.assert_array_equal, p, pf)  # the same values for a seed
    cases.append((cfg, fused, p))

  @jax.jit
  def run(prms):  # one program (eager op-by-op dispatch would take most of a minute)
    loss = lambda c: lambda q: jnp.mean(jax.nn.logsumexp(llama.apply(c, q, tok)[0], -1))
    return [[(jax.value_and_grad(loss(c))(prm), llama.apply(c, prm, tok)[0]) for c in cs]
            for (*cs, _), prm in zip(cases, prms)]
  for ((l0, g0), y0), ((l1, g1), y1) in run([c[2] for c in cases]):
    np.testing.assert_allclose(y1, y0, atol=1e-5)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g1, g0)


def test_greedy_generation_and_sharded_collectives():
  """Greedy tokens on data 2 x tensor 2 with sharded parameters equal the separate
  projections' on one device; the sharded decode chunk has exactly the separate layers' collectives:
  the per-KV-head concatenation keeps each device's heads local."""
  params = jax.tree.map(jnp.asarray, llama.host_random_params(CFG, 0))
  tok = np.asarray(_tokens(4, 5, 1))
  lens = np.array([5, 2, 4, 3], np.int32)
  smp = SamplingConfig(greedy=True, max_new_tokens=6, chunk_size=3)
  key = jax.random.key(0)

  def run(cfg, mesh=None, prm=params):
    gen = instances.Generator(cfg, smp, batch_size=4, prompt_len=5, mesh=mesh,
                              params=prm if mesh is not None else None)
    return gen, gen.generate(prm, tok, lens, key)

  _, want = run(CFG)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, tensor=2), jax.devices()[:4])
  sharded = mesh_lib.shard_params(params, llama.logical_specs(CFG), mesh)
  plain, _ = run(CFG, mesh, sharded)
  fused, got = run(CFG.replace(fused_projections=True), mesh, sharded)
  np.testing.assert_array_equal(got.response_tokens, want.response_tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
  assert decode_collectives(fused) == decode_collectives(plain)
  dots = lambda g: len(re.findall(r" dot\(", g._exe["decode"].as_text()))
  assert dots(fused) < dots(plain)  # 2 matmuls per layer fewer: the flag takes effect
