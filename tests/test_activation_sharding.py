"""llama.shard_activations: FSDP without repeated work, and the same gradients (8 fake devices).

Without the batch constraints GSPMD answers an fsdp-sharded weight by resharding the
activations and all-reducing the product, so everything after the first projection runs on the
whole global batch on every device (docs/results.md "Scale checks"). At this tiny shape that
doubles the per-device matmul FLOPs; with them each device does 1/8 of the work.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.generation import instances
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.inference import scoring
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


def _cost(mesh, rules, cfg=CFG):
  shapes = llama.param_shapes(cfg)
  shardings = mesh_lib.param_shardings(shapes, llama.logical_specs(cfg), mesh)
  n = mesh.devices.size
  return scale_check.grad_step_cost(cfg, mesh, shardings, mesh_lib.batch_sharding(mesh, 2), n,
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


# The plain update's gradient accumulation (algo.microbatch_size) on data 2 x fsdp 2 x tensor 2.
# remat "full": the unrolled layers split over fsdp then run through
# llama.Transformer._gathered_layers (not under gradient_sync="once": no activation
# constraints there), and both ways rematerialise them: the same FLOPs.
PPO_ACTOR = llama.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128,
                              remat="full")
PPO_B, PPO_P, PPO_T = 16, 64, 64  # 4 rows per batch shard


def _ppo_mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (tests/conftest.py forces 8 host devices)")
  return mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8])


def _ppo_update(mesh, microbatch_size, tx=None, gradient_sync="per_microbatch"):
  from rlhfuse_jax.rl import optim
  from rlhfuse_jax.trainer import ppo
  from rlhfuse_jax.trainer.config import AlgoConfig
  tx = tx or optim.make_optimizer(1e-2, 0, 10)
  algo = AlgoConfig(microbatch_size=microbatch_size, entropy_coef=0.01,
                    gradient_sync=gradient_sync)
  return tx, ppo.make_update_fn(PPO_ACTOR, PPO_ACTOR.replace(head="scalar"), algo, 1.0, tx, tx,
                                mesh=mesh)


def _ppo_batch(mesh, abstract):
  """The trainer's mini-batch fields (trainer/ppo.py), placed over the batch axes."""
  b, t = PPO_B, PPO_T
  fields = {"tokens": ((b, PPO_P + t), np.int32), "prompt_lens": ((b,), np.int32)}
  for k in ("mask", "old_logp", "ref_logp", "advantages", "returns", "old_values"):
    fields[k] = ((b, t), np.float32)
  rng = np.random.default_rng(0)
  out = {}
  for k, (shape, dtype) in fields.items():
    sharding = mesh_lib.batch_sharding(mesh, len(shape))
    if abstract:
      out[k] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
      continue
    if k == "tokens":
      x = rng.integers(0, PPO_ACTOR.vocab_size, shape)
    elif k == "prompt_lens":
      x = rng.integers(1, PPO_P + 1, shape)
    elif k == "mask":  # responses of 1 .. T tokens: micro-batches of unequal token counts
      x = np.arange(PPO_T)[None] < rng.integers(1, PPO_T + 1, (shape[0], 1))
    else:
      x = rng.normal(-1.0 if "logp" in k else 0.0, 0.3, shape)
    out[k] = jax.device_put(np.asarray(x, dtype), sharding)
  return out


def _ppo_states(mesh, tx, abstract, zero1=False):
  from experiments import plan_programs
  from rlhfuse_jax.trainer import ppo
  from rlhfuse_jax.trainer import update as update_lib
  states = []
  for seed, cfg in enumerate((PPO_ACTOR, PPO_ACTOR.replace(head="scalar"))):
    if abstract:
      params = plan_programs.abstract_params(cfg, mesh)
      states.append(ppo.ModelState(params, plan_programs.abstract_opt_state(tx, params, mesh,
                                                                            zero1)))
    else:
      params = mesh_lib.shard_params(llama.host_random_params(cfg, seed, std=0.05),
                                     llama.logical_specs(cfg), mesh)
      states.append(ppo.ModelState(params, update_lib.init_optimizer_state(tx, params, mesh)))
  return states


@pytest.fixture(scope="module")
def compiled_update():
  """compiled_update(microbatch_size, gradient_sync, zero1): the update with the trainer's
  AdamW on data 2 x fsdp 2 x tensor 2, compiled from shapes, once per module for each
  combination (the tests below share two of them)."""
  done = {}

  def get(microbatch_size, gradient_sync="per_microbatch", zero1=False):
    key = (microbatch_size, gradient_sync, zero1)
    if key not in done:
      mesh = _ppo_mesh()
      tx, update = _ppo_update(mesh, microbatch_size, gradient_sync=gradient_sync)
      done[key] = update.lower(*_ppo_states(mesh, tx, True, zero1),
                               _ppo_batch(mesh, True)).compile()
    return done[key]
  return get


def test_accumulated_update_holds_one_micro_batch_and_repeats_no_work(compiled_update):
  measured = {}
  for size in (0, 1):  # 0: 4 rows per shard at once; 1: 4 micro-batches of 1 row
    compiled = compiled_update(size)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    measured[size] = (compiled.memory_analysis().temp_size_in_bytes, cost["flops"])
  (whole_temp, whole_flops), (micro_temp, micro_flops) = measured[0], measured[1]
  # XLA counts a loop body once: the scan's 4 trips do the whole mini-batch's work, no more.
  assert abs(4 * micro_flops / whole_flops - 1.0) < 0.05, (micro_flops, whole_flops)
  assert micro_temp < 0.4 * whole_temp, (micro_temp, whole_temp)  # measured 2.3 vs 9.1 MB


def _sgd_step(size, sync):
  """(the parameters before, the updated states and metrics) of one update of micro-batches of
  `size` rows (0: the whole shard) with plain SGD from the seeded states and batch. Plain SGD:
  the parameters move by 100 x the gradients (Adam's first step divides by |g|, so a
  rounding-level change of a tiny gradient would move its parameter by lr)."""
  import optax
  mesh = _ppo_mesh()
  tx, update = _ppo_update(mesh, size, optax.sgd(100.0), gradient_sync=sync)
  actor, critic = _ppo_states(mesh, tx, False)
  before = jax.tree.map(np.asarray, (actor.params, critic.params))
  return before, update(actor, critic, _ppo_batch(mesh, False))


@pytest.fixture(scope="module")
def whole_sgd_step():
  """_sgd_step of the whole shard at once (one micro-batch: algo.gradient_sync plays no part)."""
  return _sgd_step(0, "per_microbatch")


@pytest.mark.parametrize("sync", ["per_microbatch", "once"])
def test_accumulated_update_equals_the_whole_mini_batch_on_a_mesh(sync, whole_sgd_step):
  """4 micro-batches of one row per shard (algo.gradient_sync `sync`) step the parameters as the
  whole shard at once does, placed alike, with the same metrics. (k = 2 against the
  hand-written reference: test_ppo_update_reference.)"""
  before, (wa, wc, wm) = whole_sgd_step
  again, (ga, gc, gm) = _sgd_step(1, sync)
  jax.tree.map(np.testing.assert_array_equal, again, before)  # the same start
  largest = 0.0
  for got, want, b in zip(jax.tree.leaves((ga.params, gc.params)),
                          jax.tree.leaves((wa.params, wc.params)), jax.tree.leaves(before)):
    step = np.asarray(want) - b
    largest = max(largest, float(np.max(np.abs(step))))
    # atol: well above the float32 spacing of the parameters (~4e-9 at 0.05).
    np.testing.assert_allclose(np.asarray(got) - b, step, rtol=1e-4,
                               atol=1e-3 * np.max(np.abs(step)))
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
  assert largest > 1e-2  # the gradients are not vanishing
  for k in wm:
    np.testing.assert_allclose(gm[k], wm[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_gradient_sync_once_gathers_and_reduces_once_per_step(compiled_update):
  """algo.gradient_sync="once" against "per_microbatch", 4 micro-batches of one row per shard
  on data 2 x fsdp 2 x tensor 2, compiled from shapes: the collectives over the batch axes (the
  fsdp weight gathers, the gradient reductions) run once per step instead of per micro-batch
  (counted by perf/hlo_flops.py, loops multiplied out; the tensor-parallel ones are the same),
  with the same dot FLOPs and more memory for the gathered weights and per-shard sums."""
  from rlhfuse_jax.perf import hlo_flops
  mesh = _ppo_mesh()
  coords = np.stack(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape), 1)
  batch_dims = [mesh.axis_names.index(a) for a in mesh_lib.BATCH_AXES]

  def over_batch_axes(c):  # a group whose members sit on more than one data x fsdp shard
    return any(len({tuple(coords[d][batch_dims]) for d in g}) > 1 for g in c.groups)
  measured = {}
  for sync in ("per_microbatch", "once"):
    compiled = compiled_update(1, sync)
    costs = hlo_flops.analyze(compiled.as_text())
    assert costs.unread_groups == 0
    batch = sum(c.nbytes * n for c, n in costs.collectives.items() if over_batch_axes(c))
    measured[sync] = (batch, costs.flops, compiled.memory_analysis().temp_size_in_bytes)
  (each, each_flops, each_temp), (once, once_flops, once_temp) = (measured["per_microbatch"],
                                                                  measured["once"])
  assert once_flops == pytest.approx(each_flops, rel=0.02)
  assert once < 0.35 * each, (once, each)  # measured 0.28 (the embedding gather stays per row)
  assert once_temp > each_temp


def test_zero1_reduces_the_gradients_as_without_it(compiled_update):
  """optim.zero1 on data 2 x fsdp 2 x tensor 2, the whole shard at once, compiled from shapes:
  the gradients are reduced to the parameters' placement as without the split (the same
  all-reduces, byte for byte), and the split costs only the gather of the stepped weights over
  data. (Unconstrained, XLA reduced them in the optimizer's float32 over other groups: 2.66 s of
  collectives against 0.81 for the 7B preset on 32 devices.)"""
  from rlhfuse_jax.perf import hlo_flops
  measured = {}
  for zero1 in (False, True):
    compiled = compiled_update(0, zero1=zero1)
    measured[zero1] = hlo_flops.analyze(compiled.as_text()).collective_bytes()
  plain, split = measured[False], measured[True]
  assert split["all-reduce"] == pytest.approx(plain["all-reduce"], rel=0.01), (plain, split)
  assert split["reduce-scatter"] == plain["reduce-scatter"]
  assert plain["all-gather"] < split["all-gather"] < 1.5 * plain["all-gather"], (plain, split)


def test_init_makes_each_device_only_its_shards_and_the_unsharded_values():
  """llama.init_params with shardings (the trainer's initialisation): every leaf lands with its
  sharding, each device's compiled output is its shards (an eighth of the fsdp-split weights,
  plus the replicated norm gains), and the values are the unsharded init's, bit for bit."""
  mesh = _mesh(8)
  shapes = llama.param_shapes(CFG)
  shardings = mesh_lib.param_shardings(shapes, llama.logical_specs(CFG), mesh)
  key = jax.random.key(3)
  sharded, specs = llama.init_params(CFG, key, shardings)
  whole, _ = llama.init_params(CFG, key)
  assert specs == llama.logical_specs(CFG)
  for x, s, y in zip(*map(jax.tree.leaves, (sharded, shardings, whole))):
    assert x.sharding == s
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  pairs = list(zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)))
  total = sum(x.size * x.dtype.itemsize for x, _ in pairs)
  shard = sum(np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in pairs)
  assert shard < total / 7
  out = llama.init_program(CFG, shardings).lower(key).compile().memory_analysis()
  assert out.output_size_in_bytes == shard + 8 * len(pairs)  # + the output tuple's pointers
  # Nor do the devices draw the whole model's random bits to keep their part (88 kB of
  # temporaries here; 297 kB with jax_threefry_partitionable off, 2026-12-01).
  assert out.temp_size_in_bytes < total / 3, (out.temp_size_in_bytes, total)
  # The init traces a cheap forward (whole-cache attention, no remat): the same parameters as
  # the model's own configuration would create.
  real = CFG.replace(attention="blockwise", remat="full")
  own = jax.jit(lambda k: nn.unbox(llama.Transformer(real).init(
      k, jnp.zeros((1, 2), jnp.int32))["params"]))(key)
  for x, y in zip(jax.tree.leaves(own), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert jax.tree.structure(own) == jax.tree.structure(whole)


# Unrolled layers with their weights split over fsdp=8: four layers of 1.05 MB float32 each.
WIDE = llama.ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=512, num_layers=4,
                         num_heads=4, num_kv_heads=4, max_seq_len=64, dtype="float32")


def test_scoring_forward_gathers_unrolled_layers_one_after_another():
  """The trainer's log-prob recomputation on the training mesh (Scorer.lower_logprobs, as
  plan_check's actor_logp compiles it) holds at most two layers' gathered weights, not every
  layer's (before: XLA issued all the all-gathers at the start, 4.2 MB of temporaries for 4.2 MB
  of weights)."""
  mesh = _mesh(8)
  shapes = llama.param_shapes(WIDE)
  params = mesh_lib.abstract(shapes, mesh_lib.param_shardings(shapes, llama.logical_specs(WIDE),
                                                             mesh))
  whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
  layer = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes["layers_0"]))
  lowered = scoring.Scorer(mesh, micro_batch_size=8).lower_logprobs(WIDE, params, 8, 16, 8)
  temp = lowered.compile().memory_analysis().temp_size_in_bytes
  assert temp < 2.5 * layer < 0.7 * whole, (temp, layer, whole)


def test_scoring_forward_copies_no_weights_where_none_is_gathered():
  """On a data-only mesh every device holds the weights whole: no gather to order, and no tied
  copy of them (one made 2 layers' copies: 2.1 MB of temporaries for 4.2 MB of weights)."""
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8), jax.devices()[:8])
  shapes = llama.param_shapes(WIDE)
  params = mesh_lib.abstract(shapes, mesh_lib.param_shardings(shapes, llama.logical_specs(WIDE),
                                                             mesh))
  layer = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes["layers_0"]))
  lowered = scoring.Scorer(mesh, micro_batch_size=8).lower_logprobs(WIDE, params, 8, 16, 8)
  temp = lowered.compile().memory_analysis().temp_size_in_bytes
  assert temp < 0.5 * layer, (temp, layer)


def test_tied_layers_score_as_the_single_device_forward():
  """after_input leaves every weight's value as it was: the scores on the fsdp mesh are the
  single-device ones, on a mesh that also splits heads over tensor (data 2 x fsdp 2 x tensor
  2)."""
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8])
  host = llama.host_random_params(WIDE, 0, std=0.05)
  params = mesh_lib.shard_params(host, llama.logical_specs(WIDE), mesh)
  tokens = np.random.default_rng(0).integers(0, WIDE.vocab_size, (8, 16)).astype(np.int32)
  lens = np.full((8,), 8, np.int32)
  # The forward reads the layers' specs while flax runs it: traced there first (they were
  # cached by the placement above), not in a context of its own, flax rejected the new model.
  llama._abstract_boxed.cache_clear()
  on_mesh = scoring.response_logprobs(
      WIDE, params, jax.device_put(tokens, mesh_lib.batch_sharding(mesh, 2)),
      jax.device_put(lens, mesh_lib.batch_sharding(mesh, 1)), 8, mesh=mesh)
  alone = scoring.response_logprobs(WIDE, host, tokens, lens, 8)
  np.testing.assert_allclose(np.asarray(on_mesh), np.asarray(alone), rtol=1e-5, atol=1e-5)


# The update of unrolled layers split over fsdp=8 (llama.Transformer._gathered_layers).
NARROW = llama.ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=512, num_layers=4,
                           num_heads=4, num_kv_heads=4, max_seq_len=64, dtype="float32")


def _update_parts(cfg, mesh, abstract, tx=None, host=None, seed=0):
  """(update, actor state, mini-batch) of the actor alone with `tx` (the trainer's AdamW by
  default) on `mesh`, from the `host` parameters (seeded ones by default): 8 rows of 16 + 16
  tokens."""
  from experiments import plan_programs
  from rlhfuse_jax.rl import optim
  from rlhfuse_jax.trainer import ppo
  from rlhfuse_jax.trainer import update as update_lib
  from rlhfuse_jax.trainer.config import AlgoConfig
  tx = tx or optim.make_optimizer(1e-2, 0, 10)
  update = ppo.make_update_fn(cfg, cfg.replace(head="scalar"), AlgoConfig(entropy_coef=0.01),
                              1.0, tx, None, mesh=mesh)
  if abstract:
    params = plan_programs.abstract_params(cfg, mesh)
    state = ppo.ModelState(params, plan_programs.abstract_opt_state(tx, params, mesh))
  else:
    host = llama.host_random_params(cfg, seed, std=0.05) if host is None else host
    params = mesh_lib.shard_params(host, llama.logical_specs(cfg), mesh)
    state = ppo.ModelState(params, update_lib.init_optimizer_state(tx, params, mesh))
  b, p, t = 8, 16, 16
  rng = np.random.default_rng(seed)
  fields = {"tokens": rng.integers(0, cfg.vocab_size, (b, p + t)).astype(np.int32),
            "prompt_lens": rng.integers(1, p + 1, (b,)).astype(np.int32),
            "mask": (np.arange(t)[None] < rng.integers(1, t + 1, (b, 1))).astype(np.float32)}
  for k in ("old_logp", "ref_logp", "advantages", "returns", "old_values"):
    fields[k] = rng.normal(-1.0 if "logp" in k else 0.0, 0.3, (b, t)).astype(np.float32)
  batch = {}
  for k, x in fields.items():
    sharding = mesh_lib.batch_sharding(mesh, x.ndim)
    batch[k] = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) if abstract
                else jax.device_put(x, sharding))
  return update, state, batch


def _update_temp(cfg):
  update, state, batch = _update_parts(cfg, _mesh(8), abstract=True)
  return update.lower(state, None, batch).compile().memory_analysis().temp_size_in_bytes


def test_unrolled_update_keeps_no_gathered_layer_from_forward_to_backward():
  """The actor's update (ppo.make_update_fn compiled from shapes, fsdp=8) of unrolled layers
  gathers each layer again in the backward and reduce-scatters its gradient with remat "full":
  its temp grows by well under a gathered layer per layer and stays near the scanned update's.
  (Before, every gathered layer and its whole all-reduced gradient stayed live to the end: 4.7
  -> 8.9 MB from 2 to 4 layers of 1.05 MB, scanned 2.9 MB; docs/results.md "Unrolled layers
  in the scoring forwards". Remat "none" keeps that plain forward, 3.8 -> 7.0 MB: not
  rematerialising is what it chose.)"""
  layer = sum(x.size * x.dtype.itemsize
              for x in jax.tree.leaves(llama.param_shapes(NARROW)["layers_0"]))
  scanned = _update_temp(NARROW.replace(scan_layers=True, remat="full"))
  two, four = (_update_temp(NARROW.replace(num_layers=n, remat="full")) for n in (2, 4))
  assert (four - two) / 2 < 0.5 * layer, (two, four, layer)
  assert four < 1.5 * scanned, (four, scanned)


def _run_update(cfg, mesh, tx=None, host=None):
  """(actor state, metrics) after one update of the seeded actor and batch, as host arrays."""
  update, state, batch = _update_parts(cfg, mesh, False, tx, host)
  actor, _, metrics = update(state, None, batch)
  return jax.tree.map(np.asarray, (actor, metrics))


@pytest.mark.parametrize("shape", [dict(fsdp=8), dict(data=2, fsdp=2, tensor=2)])
def test_gathered_layers_update_as_the_plain_unrolled_and_scanned_layers(shape, monkeypatch):
  """The update of unrolled layers gathered one at a time (Transformer._gathered_layers) moves
  the parameters and the optimizer state, with the same metrics, as the plain unrolled forward
  did (it now runs where weights are split over a batch axis, remat "full"), and on fsdp 8 as
  the scanned layers do (plain SGD there: Adam's first step moves a parameter by the learning
  rate whatever the size of its gradient, so a rounding-level change of a tiny one would move
  it by lr)."""
  import optax
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(**shape), jax.devices()[:8])
  cfg = NARROW.replace(num_layers=2, remat="full")
  split, real = [], llama._batch_split_axes
  with monkeypatch.context() as m:  # the batch axes the layers were gathered over, seen
    m.setattr(llama, "_batch_split_axes", lambda *a: split.append(real(*a)) or split[-1])
    gathered = _run_update(cfg, mesh)
  assert set(split) == {("fsdp",)}, split  # the gathered path ran, over fsdp alone
  with monkeypatch.context() as m:
    m.setattr(llama, "_batch_split_axes", lambda *_: ())  # the path before
    plain = _run_update(cfg, mesh)
  (actor, metrics), (p_actor, p_metrics) = gathered, plain
  for got, want in zip(jax.tree.leaves((actor.opt_state, metrics)),
                       jax.tree.leaves((p_actor.opt_state, p_metrics))):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Not bitwise: the gradients are reduce-scattered, not all-reduced, in another order. AdamW's
  # first step moves each parameter by about lr = 1e-2 whatever its gradient's size, so a
  # rounding-level change of a tiny gradient moves it by more than that change (measured 9e-7 on
  # fsdp 8, 9e-6 on data x fsdp x tensor), a wrong gradient by lr.
  for got, want in zip(jax.tree.leaves(actor.params), jax.tree.leaves(p_actor.params)):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
  if shape != dict(fsdp=8):
    return
  host = llama.host_random_params(cfg, 0, std=0.05)
  before = jax.tree.leaves(host)
  (actor, metrics), (stacked, s_metrics) = (
      _run_update(cfg, mesh, optax.sgd(100.0), host),
      _run_update(cfg.replace(scan_layers=True), mesh, optax.sgd(100.0),
                  llama.stack_layers(host, cfg.num_layers)))
  scanned = jax.tree.leaves(llama.unstack_layers(stacked.params))
  largest = 0.0
  for got, want, b in zip(jax.tree.leaves(actor.params), scanned, before):
    step = want - b
    largest = max(largest, float(np.max(np.abs(step))))
    np.testing.assert_allclose(got - b, step, rtol=1e-4, atol=1e-3 * np.max(np.abs(step)))
  assert largest > 1e-2  # the gradients are not vanishing
  for k in metrics:
    np.testing.assert_allclose(metrics[k], s_metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _mesh_generator(cfg, mesh, rows=64, prompt_len=48):
  """instances.Generator on `mesh` (generation="mesh"), the actor placed as training places it,
  and its placed params' ShapeDtypeStructs."""
  shapes = llama.param_shapes(cfg)
  params = mesh_lib.abstract(shapes, mesh_lib.param_shardings(shapes, llama.logical_specs(cfg),
                                                             mesh))
  gen = instances.Generator(cfg, SamplingConfig(max_new_tokens=64 - prompt_len),
                            batch_size=rows, prompt_len=prompt_len, mesh=mesh)
  return gen, params


def test_mesh_generation_prefill_holds_its_own_rows():
  """generation="mesh" with unrolled layers split over fsdp=8 (as plan_check compiles it): the
  prefill of 64 rows x 48 tokens holds about what scanned layers do, the gathered layers over
  it, not every row's activations on every device (before: 25.5 MB of temporaries against
  3.07 MB scanned, 1.05 MB a layer; 5.26 MB since, 2026-12-07)."""
  mesh = _mesh(8)
  temp = {}
  for scan in (False, True):
    gen, params = _mesh_generator(WIDE.replace(scan_layers=scan), mesh)
    lowered = dict(gen.lower_all(params, {}, only=("prefill",)))["prefill"]
    temp[scan] = lowered.compile().memory_analysis().temp_size_in_bytes
  layer = sum(x.size * x.dtype.itemsize
              for x in jax.tree.leaves(llama.param_shapes(WIDE)["layers_0"]))
  # (the unrolled program holds up to two gathered layers and the tied shards, scanned one)
  assert temp[False] < temp[True] + 3 * layer, (temp, layer)


def test_only_the_unrolled_prefill_on_split_weights_is_constrained(monkeypatch):
  """The prefill of unrolled layers whose weights are split over a batch axis is traced under
  shard_activations; the decode chunk never is (its one token a row all-reduces less than its
  weights would gather), nor any program of scanned layers or of whole weights."""
  fsdp, data = _mesh(8), mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8), jax.devices()[:8])
  tensor = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, tensor=8), jax.devices()[:8])

  def placed(cfg, mesh):
    return mesh_lib.param_shardings(llama.param_shapes(cfg), llama.logical_specs(cfg), mesh)
  assert instances.activation_mesh(WIDE, fsdp, placed(WIDE, fsdp)) is fsdp
  scanned = WIDE.replace(scan_layers=True)
  assert instances.activation_mesh(scanned, fsdp, placed(scanned, fsdp)) is None
  assert instances.activation_mesh(WIDE, data, placed(WIDE, data)) is None
  assert instances.activation_mesh(WIDE, tensor, placed(WIDE, tensor)) is None
  whole = jax.tree.map(lambda _: mesh_lib.replicated(fsdp), placed(WIDE, fsdp))
  assert instances.activation_mesh(WIDE, fsdp, whole) is None

  def programs():
    gen, params = _mesh_generator(WIDE, fsdp, rows=8, prompt_len=16)
    return {k: low.as_text() for k, low in gen.lower_all(params, {}, only=("prefill", "decode"))}
  ours = programs()
  monkeypatch.setattr(instances, "activation_mesh", lambda cfg, mesh, shardings: None)
  unconstrained = programs()
  assert ours["decode"] == unconstrained["decode"]
  assert ours["prefill"] != unconstrained["prefill"]
