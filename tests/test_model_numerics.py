"""16-bit numerics that a float32 test cannot see: sums over many tokens kept in float32 (the
embedding lookup's and a bias's gradients, the logged gradient norm), the vocabulary-parallel
entropy at large logits, and float16 training refused. Each compares against a float64 sum
of the same inputs; each failed on the code before its fix (bfloat16 accumulators)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlhfuse_jax.models import llama, sequences
from rlhfuse_jax.parallel.mesh import MeshConfig, make_mesh
from rlhfuse_jax.pipeline import stages
from rlhfuse_jax.trainer import ppo


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_embedding_gradient_of_a_frequent_token_sums_in_float32():
  """A token making up half of 16k lookups (BOS, a chat template's): its row of the bfloat16
  table's gradient is the float64 sum rounded once (bfloat16 accumulation: 10 % short), also
  with the table split over 8 devices; the lookup's value is unchanged."""
  v, h, n = 64, 16, 16384
  rng = np.random.default_rng(0)
  tokens = np.where(rng.random(n) < 0.5, 7, rng.integers(0, v, n)).astype(np.int32)[None]
  dy = rng.normal(size=(1, n, h)).astype(np.float32)
  exact = np.zeros((v, h))
  np.add.at(exact, tokens[0], dy[0].astype(np.float64))
  cfg = llama.ModelConfig(vocab_size=v, hidden_size=h, intermediate_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=2, dtype="float32", param_dtype="bfloat16")
  table = jnp.asarray(rng.normal(size=(v, h)), jnp.bfloat16)

  def loss(t, tok):
    return jnp.sum(llama.Embed(cfg).apply({"params": {"embedding": t}}, tok) * dy)

  np.testing.assert_array_equal(
      llama.Embed(cfg).apply({"params": {"embedding": table}}, tokens),
      np.asarray(table, np.float32)[tokens])
  whole = jax.jit(jax.grad(loss))(table, tokens)
  assert whole.dtype == jnp.bfloat16
  assert _rel(whole[7], exact[7]) < 1e-2  # one bfloat16 rounding: 2^-9 ~ 2e-3
  assert _rel(whole, exact) < 1e-2
  mesh = make_mesh(MeshConfig(data=8))
  split = jax.jit(jax.grad(loss))(jax.device_put(table, NamedSharding(mesh, P("data"))),
                                  jax.device_put(tokens, NamedSharding(mesh, P(None, "data"))))
  assert _rel(split[7], exact[7]) < 1e-2


def test_bias_gradient_sums_over_tokens_in_float32():
  """A bfloat16 projection's bias (Qwen2's q/k/v): its gradient, the sum of 64k tokens'
  cotangents, is the float64 sum rounded once (summed in bfloat16: 20 % off); the layer's
  output is the bfloat16 add's."""
  n, e, f = 65536, 8, 8
  cfg = llama.ModelConfig(vocab_size=16, hidden_size=e, intermediate_size=16, num_layers=1,
                          num_heads=2, num_kv_heads=2, dtype="bfloat16", param_dtype="bfloat16")
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(n, e)), jnp.bfloat16)
  dy = rng.normal(0.05, 1, (n, f)).astype(np.float32)

  class Proj(nn.Module):
    @nn.compact
    def __call__(self, x):
      return llama._dense(f, ("embed", "mlp"), cfg, "proj", use_bias=True)(x)

  params = nn.unbox(Proj().init(jax.random.key(0), x)["params"])
  params = {"proj": {**params["proj"], "bias": jnp.asarray(rng.normal(size=f), jnp.bfloat16)}}
  y = Proj().apply({"params": params}, x)
  kernel, bias = params["proj"]["kernel"], params["proj"]["bias"]
  np.testing.assert_array_equal(y, jnp.dot(x, kernel) + bias)  # the value: bfloat16's add
  g = jax.jit(jax.grad(lambda p: jnp.sum(Proj().apply({"params": p}, x).astype(jnp.float32)
                                         * dy)))(params)
  assert _rel(g["proj"]["bias"], dy.astype(np.float64).sum(0)) < 1e-2


def test_logged_gradient_norm_sums_in_float32():
  """400 bfloat16 leaves: the logged norm is the float64 norm of the same values (optax's
  norm summed them in bfloat16: +10 %)."""
  rng = np.random.default_rng(2)
  grads = [jnp.asarray(rng.normal(0, 0.07, (16, 16)), jnp.bfloat16) for _ in range(400)]
  exact = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads))
  assert float(ppo.grad_norm(grads)) == pytest.approx(exact, rel=1e-5)


def test_vocab_parallel_entropy_at_large_logits():
  """Logits of size ~100-400 (a sharp policy late in training): the entropy of the head split
  over tensor=8 is float64's to 3e-6, as the whole head's is (as lse - E[l] it was 3.5e-5
  off)."""
  v, h, tp = 256, 32, 8
  cfg = llama.ModelConfig(vocab_size=v, hidden_size=h, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=2, dtype="float32", param_dtype="float32")
  params = llama.host_random_params(cfg, 3)
  rng = np.random.default_rng(1)
  hp = {**params["head"], "lm_head": jnp.asarray(rng.normal(0, 100 / np.sqrt(h), (h, v)),
                                                 jnp.float32)}
  x = jnp.asarray(rng.normal(size=(3, 5, h)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, size=(3, 5)), jnp.int32)
  logits = stages.head(cfg, params["embed"], hp, x)
  assert float(jnp.max(jnp.abs(logits))) > 300
  z = np.asarray(logits, np.float64)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1)
  mesh = make_mesh(MeshConfig(tensor=tp), jax.devices()[:tp])
  _, ent = jax.jit(jax.shard_map(
      lambda hp, x: stages.vocab_parallel_logprobs(cfg, hp, x, targets, 1.0, ("tensor", tp)),
      mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))(hp, x)
  np.testing.assert_allclose(ent, want, atol=3e-6)
  np.testing.assert_allclose(sequences.token_logprobs_and_entropy(logits, targets)[1], want,
                             atol=3e-6)


@pytest.mark.parametrize("field", ["model.dtype", "model.param_dtype",
                                   "critic_model.param_dtype"])
def test_float16_training_is_refused(field):
  """A trained model in float16 (no loss scaling here: its gradients underflow and float16
  AdamW moments divide by 0) is refused before anything compiles, naming the field."""
  from rlhfuse_jax.trainer import build
  from rlhfuse_jax.trainer.validate import validate
  from tests.test_trainer import tiny_config
  cfg = tiny_config(**{field: "float16", "optim.master_weights": True})
  _, tokenizer = build.build_task_and_tokenizer(cfg)
  with pytest.raises(ValueError, match=rf"config\.{field}='float16': .*loss scaling.*bfloat16"):
    validate(build.resolve_config(cfg, tokenizer), make_mesh(MeshConfig(data=8)))
