"""llama.shard_activations: FSDP without repeated work, and the same gradients (8 fake devices).

Without the batch constraints GSPMD answers an fsdp-sharded weight by resharding the
activations and all-reducing the product, so everything after the first projection runs on the
whole global batch on every device (docs/results.md "Scale checks"). At this tiny shape that
doubles the per-device matmul FLOPs; with them each device does 1/8 of the work.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.models import llama
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.perf import scale_check

CFG = llama.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=4, max_seq_len=64, dtype="bfloat16")
LEN = 64


def _mesh(n):
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} devices (tests/conftest.py forces 8 host devices)")
  return mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, fsdp=n), jax.devices()[:n])


def _cost(mesh, rules):
  shapes = llama.param_shapes(CFG)
  shardings = mesh_lib.param_shardings(shapes, llama.logical_specs(CFG), mesh)
  n = mesh.devices.size
  return scale_check.grad_step_cost(CFG, mesh, shardings, mesh_lib.batch_sharding(mesh, 2), n,
                                    LEN, rules)


def test_fsdp_gradient_step_splits_the_work():
  one = _cost(_mesh(1), None)["flops"]  # one sequence on one device: the per-device share
  mesh = _mesh(8)
  unconstrained = _cost(mesh, None)["flops"] / one
  constrained = _cost(mesh, mesh_lib.LOGICAL_RULES)["flops"] / one
  assert unconstrained > 1.5, unconstrained  # the check below would catch a regression
  assert abs(constrained - 1.0) <= 0.05, constrained


def test_gradients_do_not_depend_on_the_constraints():
  cfg = CFG.replace(dtype="float32")
  mesh = _mesh(8)
  params = mesh_lib.shard_params(llama.host_random_params(cfg, 0, std=0.05),
                                 llama.logical_specs(cfg), mesh)
  tokens = jax.device_put(np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16)),
                          mesh_lib.batch_sharding(mesh, 2))

  def grad(rules):
    return jax.jit(jax.grad(scale_check.logsumexp_loss(cfg, mesh, rules)))(params, tokens)

  with_c, without = grad(mesh_lib.LOGICAL_RULES), grad(None)
  for a, b in zip(jax.tree.leaves(with_c), jax.tree.leaves(without)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_constraint_is_a_no_op_where_it_cannot_apply():
  mesh = _mesh(8)
  x = jnp.ones((3, 4))  # 3 rows cannot be split 8 ways: left alone, not an error
  with llama.shard_activations(mesh, mesh_lib.LOGICAL_RULES):
    assert jax.jit(llama.constrain_batch)(x).shape == (3, 4)
  assert llama.constrain_batch(x) is x  # no context: untouched
