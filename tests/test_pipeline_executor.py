"""The fused pipeline executor: instruction tables (numpy) and gradients against jax.grad.

The executor tests compile one shard_map program per mesh/model configuration and run several
schedules of the same program shape through it (program.common_shape), to keep the file fast.
"""
import functools
import json

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.models import llama, sequences
from rlhfuse_jax.parallel.mesh import MeshConfig, make_mesh
from rlhfuse_jax.pipeline import program as prog
from rlhfuse_jax.pipeline import schedule, schedules, search, stages
from rlhfuse_jax.pipeline.evaluate import peak_memory
from rlhfuse_jax.pipeline.executor import PipelineExecutor, make_executor
from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF, PipelineProblem
from rlhfuse_jax.pipeline.stages import StageLayout

SEQ, RESP, VOCAB = 12, 6, 64
# Tiny test programs: LLVM's optimisations cost more compile time than they save at run time.
FAST = {"xla_backend_optimization_level": 0}


def _random_valid_order(p: PipelineProblem, rng: np.random.Generator) -> np.ndarray:
  """A random interleaving in which every task runs after its dependency: always valid."""
  n = p.num_devices
  counts = {AF: p.actor_microbatches, AB: p.actor_microbatches, CF: p.critic_microbatches,
            CB: p.critic_microbatches}
  done = set()
  cnt = np.zeros((n, 4), dtype=int)
  rows = [[] for _ in range(n)]
  while len(done) < n * p.tasks_per_device:
    ready = []
    for d in range(n):
      for k in (AF, AB, CF, CB):
        m = cnt[d, k]
        if m < counts[k] and (prog._dependency(p, d, k, m) is None or
                              prog._dependency(p, d, k, m) in done):
          ready.append((d, k, m))
    d, k, m = ready[rng.integers(len(ready))]
    done.add((k, d, m))
    rows[d].append(k)
    cnt[d, k] += 1
  return np.array(rows, dtype=np.int8)


# Instruction tables (numpy only) ----------------------------------------------------------------

PROBLEMS = [PipelineProblem(4, 2, 4, 2, 1.0, 1.0), PipelineProblem(4, 4, 3, 5, 2.0, 1.0),
            PipelineProblem(2, 1, 3, 4, 1.0, 1.0), PipelineProblem(8, 4, 6, 3, 5.0, 4.0)]


def _replay(program: prog.Program):
  """Plays the table like the executor does, with (model, micro-batch) labels instead of
  arrays, and checks that every task reads exactly the message or stash entry it needs."""
  p = program.problem
  n, ticks = program.num_devices, program.ticks
  stash = [[dict() for _ in range(2)] for _ in range(n)]
  inbox = [[dict() for _ in range(4)] for _ in range(n)]
  seen = [[] for _ in range(n)]
  for t in range(ticks):
    up, down = [None] * n, [None] * n
    for d in range(n):
      row = program.table[d, t]
      if row[prog.MODEL] == prog.IDLE:
        continue
      model, fwd = row[prog.MODEL] - 1, row[prog.BACKWARD] == 0
      k = 2 * model + (0 if fwd else 1)
      first, last = bool(row[prog.FIRST]), bool(row[prog.LAST])
      stage = p.actor_stage(d) if model == 0 else p.critic_stage(d)
      assert first == (stage == 0) and last == (stage == (p.actor_pp, p.critic_pp)[model] - 1)
      local = row[prog.MICRO] - (p.critic_replica(d) * p.critic_microbatches if model else 0)
      seen[d].append((k, local))
      label = (model, row[prog.MICRO])
      if (fwd and not first) or (not fwd and not last):
        got = inbox[d][k].pop(row[prog.INBOX_SLOT])
        assert got == (label, "act" if fwd else "grad"), (d, t, got, label)
      if fwd and not first:
        assert row[prog.STASH_SLOT] not in stash[d][model]
        stash[d][model][row[prog.STASH_SLOT]] = label
      if not fwd and not first:
        assert stash[d][model].pop(row[prog.STASH_SLOT]) == label
      if (fwd and not last) or (not fwd and not first):
        msg = (k, (label, "act" if fwd else "grad"))
        if k in (AF, CB):
          up[d + 1] = msg
        else:
          down[d - 1] = msg
    for d in range(n):
      row = program.table[d, t]
      for msg, code, slot in ((up[d], row[prog.UP_RECV], row[prog.UP_SLOT]),
                              (down[d], row[prog.DOWN_RECV], row[prog.DOWN_SLOT])):
        assert (msg is None) == (code == prog.RECV_NONE), (d, t, msg, code)
        if msg is not None:
          k, payload = msg
          assert code == (prog.RECV_ACT if k % 2 == 0 else prog.RECV_GRAD)
          assert slot not in inbox[d][k], "ring slot overwritten"
          inbox[d][k][slot] = payload
  for d in range(n):  # every task ran once, in the schedule's order; nothing left behind
    micro = prog._task_ids(p, program.order)[d]
    assert seen[d] == list(zip(program.order[d].tolist(), micro.tolist()))
    assert all(not box for box in inbox[d]) and all(not s for s in stash[d])


@pytest.mark.parametrize("problem", PROBLEMS)
def test_tables_replay_serial_greedy_and_random_orders(problem):
  rng = np.random.default_rng(0)
  orders = [(schedules.serial_order(problem), True), (schedules.serial_order(problem), False),
            (schedules.greedy_order(problem), False)]
  orders += [(_random_valid_order(problem, rng), False) for _ in range(3)]
  for order, barrier in orders:
    program = prog.build_program(problem, order, barrier=barrier)
    _replay(program)
    assert program.busy_ticks().tolist() == [problem.tasks_per_device] * problem.num_devices
    # Stash rings hold exactly the schedule's peak number of in-flight micro-batches.
    actor_only = PipelineProblem(problem.actor_pp, problem.critic_pp, problem.actor_microbatches,
                                 problem.critic_microbatches, 1.0, 1.0, critic_mem=0.0)
    peaks_a = peak_memory(actor_only, order)  # [N] in micro-batches
    assert program.stash_peaks[:, 0].tolist() == peaks_a.astype(int).tolist()
    # The first stage reads tokens; the others stash exactly their peak.
    assert program.stash_sizes[0] == max(int(peaks_a[1:].max(initial=0)), 1)


def test_serial_ticks_are_two_one_f_one_b_pipelines():
  for p in PROBLEMS:
    program = prog.build_program(p, schedules.serial_order(p), barrier=True)
    assert program.ticks == (2 * (p.actor_pp + p.actor_microbatches - 1) +
                             2 * (p.critic_pp + p.critic_microbatches - 1))
    assert prog.build_program(p, schedules.greedy_order(p)).ticks < program.ticks


def test_min_shape_pads_and_keeps_the_replay_valid():
  p = PROBLEMS[0]
  a = prog.build_program(p, schedules.serial_order(p), barrier=True)
  b = prog.build_program(p, _random_valid_order(p, np.random.default_rng(1)))
  shape = prog.common_shape(a, b)
  for order, barrier in ((a.order, True), (b.order, False)):
    padded = prog.build_program(p, order, barrier, min_shape=shape)
    assert padded.shape == shape
    _replay(padded)


def test_deadlocked_orders_are_rejected():
  p = PipelineProblem(2, 2, 1, 1, 1.0, 1.0)
  # Device 0 waits for the critic forward of device 1, which waits for device 0's actor.
  order = np.array([[CF, CB, AF, AB], [AF, AB, CF, CB]], dtype=np.int8)
  with pytest.raises(ValueError, match="deadlock"):
    prog.build_program(p, order)
  with pytest.raises(ValueError, match="deadlock"):
    prog.level_ticks(p, order)
  # A fused order cannot run behind a barrier (critic tasks before actor tasks).
  with pytest.raises(ValueError, match="barrier"):
    prog.build_program(PROBLEMS[0], schedules.greedy_order(PROBLEMS[0]), barrier=True)


# Stage-stacked trees (numpy only) ---------------------------------------------------------------


def test_stage_layout_stacks_scanned_layers_by_a_reshape():
  """docs/architecture.md §3: under model.scan_layers the stage-stacked tree is the layer stack
  [L, ...] reshaped to [S, L/S, ...] (a reverse layout's rows flipped): row layout.row(s) holds
  stage s's layers, as for the unrolled model, whose tree it equals; unstack gives each form
  back."""
  cfg = llama.ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=6,
                          num_heads=2, num_kv_heads=1)
  unrolled = llama.host_random_params(cfg, 0)  # numpy: nothing below compiles
  scanned = llama.stack_layers(unrolled, cfg.num_layers)
  for num_stages, reverse in ((3, False), (3, True), (2, True), (6, False), (1, True)):
    per_stage = cfg.num_layers // num_stages
    plain = StageLayout.for_config(cfg, num_stages, reverse=reverse)
    layout = StageLayout.for_config(cfg.replace(scan_layers=True), num_stages, reverse=reverse)
    assert layout.scanned and not plain.scanned
    staged = layout.stack(scanned)
    jax.tree.map(np.testing.assert_array_equal, plain.stack(unrolled), staged)
    for s in range(num_stages):
      for k in range(per_stage):
        jax.tree.map(lambda x, want: np.testing.assert_array_equal(x[layout.row(s), k], want),
                     staged["layers"], unrolled[f"layers_{s * per_stage + k}"])
    jax.tree.map(np.testing.assert_array_equal, layout.unstack(staged), scanned)
    jax.tree.map(np.testing.assert_array_equal, plain.unstack(staged), unrolled)
    # A layout read from the stage-stacked tree itself has the same accumulator.
    again = StageLayout(cfg, staged, num_stages, reverse=reverse)
    assert again.device_size == layout.device_size == plain.device_size
  with pytest.raises(ValueError, match=r"params are unrolled \(layers_i\), but the model's "
                                       r"cfg.scan_layers=True"):
    layout.stack(unrolled)


def test_accumulator_segments_add_and_split_back_to_their_own_parts():
  """A device's flat gradient accumulator is [its stage's layers | embed | head]: add() of each
  part's gradients must land in that part's segment only, and split_accumulator must give each
  part back (else the head's gradients would update the embedding, or overwrite each other)."""
  cfg = llama.ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=4,
                          num_heads=2, num_kv_heads=1)
  layout = StageLayout.for_config(cfg, 2)
  staged = layout.stack(llama.host_random_params(cfg, 0))
  local = layout.local_tree({**staged, "layers": jax.tree.map(lambda x: x[:1],
                                                              staged["layers"])})
  acc = jnp.zeros(layout.device_size, jnp.float32)
  # The layers twice: add accumulates (micro-batch after micro-batch), it does not overwrite.
  for scale, key in ((1.0, "layers"), (5.0, "embed"), (3.0, "head"), (1.0, "layers")):
    acc = layout.add(acc, key, jax.tree.map(lambda x, c=scale: np.full(x.shape, c), local[key]))
  assert layout.device_size == layout.stage_size + layout.embed_size + layout.head_size
  for part, scale in zip(layout.split_accumulator(acc), (2.0, 5.0, 3.0)):
    for leaf in jax.tree.leaves(part):
      np.testing.assert_array_equal(np.asarray(leaf), scale)

# The executor -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _models(actor_layers, critic_layers, critic_hidden=32, tie=False, critic_kv_heads=1):
  acfg = llama.ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                           num_layers=actor_layers, num_heads=4, num_kv_heads=2,
                           tie_embeddings=tie)
  ccfg = llama.ModelConfig(vocab_size=VOCAB, hidden_size=critic_hidden, intermediate_size=48,
                           num_layers=critic_layers, num_heads=2, num_kv_heads=critic_kv_heads,
                           head="scalar")
  return acfg, ccfg, _init(acfg, 0), _init(ccfg, 1)


def _init(cfg, seed):
  # Random parameters from numpy on the model's shapes: no init program to compile.
  shapes = jax.eval_shape(lambda: flax.linen.unbox(llama.Transformer(cfg).init(
      jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"]))
  rng = np.random.default_rng(seed)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  out = []
  for path, leaf in leaves:
    scale = "scale" in jax.tree_util.keystr(path)  # RMSNorm gains around 1
    x = rng.normal(1.0 if scale else 0.0, 0.1 if scale else 0.05, leaf.shape)
    out.append(jnp.asarray(x, leaf.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def _batch(size, seed=0, ref=False):
  rng = np.random.default_rng(seed)
  resp = rng.integers(1, RESP + 1, size=size)
  batch = {
      "tokens": rng.integers(0, VOCAB, size=(size, SEQ)).astype(np.int32),
      "prompt_lens": rng.integers(1, SEQ - RESP + 1, size=size).astype(np.int32),
      "mask": (np.arange(RESP)[None] < resp[:, None]).astype(np.float32),
      "old_logp": rng.normal(-4.2, 0.3, (size, RESP)).astype(np.float32),
      "advantages": rng.normal(0, 1, (size, RESP)).astype(np.float32),
      "returns": rng.normal(0, 1, (size, RESP)).astype(np.float32),
      # Far from the fresh critic's values (|v| < 0.5): the value clip is active or not by a
      # wide margin, so vf_clipfrac does not hinge on float rounding.
      "old_values": (rng.choice([-1, 1], (size, RESP)) *
                     rng.uniform(0.8, 1.8, (size, RESP))).astype(np.float32),
  }
  if ref:
    batch["ref_logp"] = rng.normal(-4.2, 0.3, (size, RESP)).astype(np.float32)
  return {k: jnp.asarray(v) for k, v in batch.items()}


def _assert_matches(got, want, rtol=1e-5):
  g_leaves, treedef = jax.tree.flatten(got)
  w_leaves, w_treedef = jax.tree.flatten(want)
  assert treedef == w_treedef
  for g, w in zip(g_leaves, w_leaves):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and g.dtype == w.dtype
    scale = np.abs(w).max()
    assert scale > 0, "a reference gradient is all zero: the test would prove nothing"
    np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)


def _check(executors, acfg, ccfg, loss_cfg, ap, cp, batch):
  ref_a, ref_c, ref_m = jax.jit(stages.reference_grads, static_argnums=(0, 1, 2),
                                compiler_options=FAST)(acfg, ccfg, loss_cfg, ap, cp, batch)
  for ex in executors:
    ga, gc, metrics = ex(ap, cp, batch)  # ex: an executor, or any f(ap, cp, batch)
    _assert_matches(ga, ref_a)
    _assert_matches(gc, ref_c)
    for k in stages.ACTOR_METRICS + stages.CRITIC_METRICS:
      np.testing.assert_allclose(metrics[k], ref_m[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _executors(acfg, ccfg, loss_cfg, mesh, programs):
  shape = prog.common_shape(*programs)
  return [PipelineExecutor(acfg, ccfg, loss_cfg,
                           prog.build_program(p.problem, p.order, p.barrier, shape), mesh,
                           FAST)
          for p in programs]


def test_grads_match_for_serial_and_searched_schedules_critic_replicated():
  """Pa=4, Pc=2: two critic replicas, reversed placement; the searched schedule. Ma=4, Mc=3:
  actor micro-batches of 3 rows, critic micro-batches of 2 (replica r's m-th is r*Mc+m)."""
  problem = PipelineProblem(4, 2, 4, 3, 1.0, 1.0)
  acfg, ccfg, ap, cp = _models(4, 2)
  mesh = make_mesh(MeshConfig(data=1, stage=4), jax.devices()[:4])
  found = search.search(problem, search.SearchConfig(max_evaluations=4000, seed=0,
                                                    list_variants=20))
  # Through schedule.json's format, as a schedule would come from the search binary.
  fused = schedule.from_dict(json.loads(schedule.from_order(problem, found.best).to_json()))
  serial = prog.build_program(problem, schedules.serial_order(problem), barrier=True)
  fused_prog = prog.from_schedule(fused)
  assert fused_prog.ticks < serial.ticks
  loss_cfg = stages.LossConfig()
  _check(_executors(acfg, ccfg, loss_cfg, mesh, [serial, fused_prog]), acfg, ccfg, loss_cfg,
         ap, cp, _batch(12))


def test_grads_match_equal_stages_random_schedule_tied_embeddings_and_loss_terms():
  """Pa=Pc=4, a random valid interleaving, a narrower critic (padded messages), tied actor
  embeddings (gradient from the first and the last stage), entropy and KL loss terms."""
  problem = PipelineProblem(4, 4, 2, 4, 1.0, 1.0)
  acfg, ccfg, ap, cp = _models(4, 4, critic_hidden=16, tie=True)
  mesh = make_mesh(MeshConfig(data=1, stage=4), jax.devices()[4:])
  loss_cfg = stages.LossConfig(clip_eps=0.1, clip_eps_high=0.3, loss_agg="seq-mean-token-mean",
                               entropy_coef=0.05, kl_coef=0.1, kl_estimator="k3",
                               kl_loss_agg="seq-mean-token-sum-norm",
                               value_clip_eps=0.05, temperature=0.7)
  programs = [prog.build_program(problem, schedules.serial_order(problem), barrier=True),
              prog.build_program(problem, _random_valid_order(problem, np.random.default_rng(3)))]
  _check(_executors(acfg, ccfg, loss_cfg, mesh, programs), acfg, ccfg, loss_cfg, ap, cp,
         _batch(8, seed=1, ref=True))


def test_grads_match_with_a_data_axis_and_a_single_stage_critic():
  """mesh data=2 x stage=4: each data shard pipelines its rows and the gradients add up; Pc=1
  (four critic replicas whose only stage embeds, runs its layers and the loss)."""
  problem = PipelineProblem(4, 1, 2, 1, 1.0, 1.0)
  acfg, ccfg, ap, cp = _models(4, 2)
  mesh = make_mesh(MeshConfig(data=2, stage=4))
  loss_cfg = stages.LossConfig(loss_agg="seq-mean-token-sum")
  ex = make_executor(acfg, ccfg, loss_cfg, problem, schedules.greedy_order(problem), mesh,
                     compiler_options=FAST)
  critic_rows = ex.program.table[ex.program.table[:, :, prog.MODEL] == prog.CRITIC]
  assert np.all(critic_rows[:, prog.FIRST] == 1) and np.all(critic_rows[:, prog.LAST] == 1)
  _check([ex], acfg, ccfg, loss_cfg, ap, cp, _batch(16, seed=2))


def test_grads_match_with_a_tensor_axis_and_two_layers_per_stage():
  """stage=2 x data=2 x tensor=2: Megatron splits inside each stage (heads and MLP width over
  tensor, llama.tensor_parallel); the actor's stages hold two layers each, and its head and loss
  split the vocabulary over tensor (the entropy bonus and a temperature put every term of the
  vocabulary-parallel softmax into the gradient)."""
  problem = PipelineProblem(2, 2, 2, 2, 1.0, 1.0)
  acfg, ccfg, ap, cp = _models(4, 2, critic_kv_heads=2)
  mesh = make_mesh(MeshConfig(data=2, stage=2, tensor=2))
  loss_cfg = stages.LossConfig(entropy_coef=0.05, temperature=0.8)
  assert stages.vocab_parallel(acfg, 2) == ("tensor", 2)
  ex = make_executor(acfg, ccfg, loss_cfg, problem, schedules.greedy_order(problem), mesh)
  # grads_fn: the traceable form, as a trainer calls it inside its own jitted update.
  _check([jax.jit(ex.grads_fn, compiler_options=FAST)], acfg, ccfg, loss_cfg, ap, cp, _batch(8))
  # The split is real: a device holds half of each projection of its stage.
  staged = jax.device_put(ex.stack("actor", ap), ex.staged_shardings("actor"))
  q = staged["layers"]["attn"]["q_proj"]["kernel"]  # [2 stages, 2 layers, H, heads*dim]
  assert {s.data.shape for s in q.addressable_shards} == {(1, 2, 32, 16)}
  odd = llama.ModelConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=48, num_layers=2,
                          num_heads=6, num_kv_heads=3, head="scalar")
  with pytest.raises(ValueError, match=r"critic.num_kv_heads=3 must be divisible by the mesh's "
                                       r"tensor axis \(2\), or divide it"):
    make_executor(acfg, odd, loss_cfg, problem, schedules.greedy_order(problem), mesh)


def test_grads_match_with_fewer_kv_heads_than_tensor_devices():
  """stage=2 x tensor=4 with grouped-query attention below the tensor size: the actor's one KV
  head is shared by all 4 devices, the critic's 2 by pairs. Each device slices its KV head from
  the whole K/V projections; their gradients are summed over tensor."""
  problem = PipelineProblem(2, 2, 2, 2, 1.0, 1.0)
  acfg = llama.ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=1, qkv_bias=True)
  ccfg = llama.ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head="scalar")
  mesh = make_mesh(MeshConfig(stage=2, tensor=4))
  loss_cfg = stages.LossConfig(entropy_coef=0.05)
  ex = make_executor(acfg, ccfg, loss_cfg, problem, schedules.greedy_order(problem), mesh)
  _check([jax.jit(ex.grads_fn, compiler_options=FAST)], acfg, ccfg, loss_cfg, _init(acfg, 0),
         _init(ccfg, 1), _batch(4))
  staged = jax.device_put(ex.stack("actor", _init(acfg, 0)), ex.staged_shardings("actor"))
  k = staged["layers"]["attn"]["k_proj"]["kernel"]  # [2 stages, 1 layer, H, 1 head * 8]: whole
  q = staged["layers"]["attn"]["q_proj"]["kernel"]  # [2, 1, H, 4 heads * 8]: a head per device
  assert {s.data.shape for s in k.addressable_shards} == {(1, 1, 32, 8)}
  assert {s.data.shape for s in q.addressable_shards} == {(1, 1, 32, 8)}


def test_vocab_parallel_head_equals_the_whole_head():
  """Log-probs, entropies and their gradients (head kernel, final norm, hidden input) of the
  vocabulary-parallel head over tensor=4 equal the whole head's (fp32); targets hit every
  device's columns. The head kernel's gradient is summed over `tensor`, as the executor does."""
  from jax.sharding import PartitionSpec as P
  cfg = llama.ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=2, dtype="float32", param_dtype="float32")
  params = llama.host_random_params(cfg, 3)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 64, size=(3, 5)), jnp.int32)
  wl, we = (jnp.asarray(rng.normal(size=(3, 5)), jnp.float32) for _ in range(2))
  temp = 0.7

  def whole(hp, x):
    logits = stages.head(cfg, params["embed"], hp, x)
    logp, ent = sequences.token_logprobs_and_entropy(logits, targets, temp)
    return jnp.sum(logp * wl) + jnp.sum(ent * we), (logp, ent)

  def split(hp, x):
    return (lambda lp, e: (jnp.sum(lp * wl) + jnp.sum(e * we), (lp, e)))(
        *stages.vocab_parallel_logprobs(cfg, hp, x, targets, temp, ("tensor", 4)))

  def device(hp, x):
    (_, out), (dhp, dx) = jax.value_and_grad(split, argnums=(0, 1), has_aux=True)(hp, x)
    dhp = {**dhp, "lm_head": jax.lax.psum(dhp["lm_head"], "tensor")}
    return out, dhp, dx
  mesh = make_mesh(MeshConfig(tensor=4), jax.devices()[:4])
  got = jax.jit(jax.shard_map(device, mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                              check_vma=False))(params["head"], x)
  (_, want), (dhp, dx) = jax.value_and_grad(whole, argnums=(0, 1), has_aux=True)(
      params["head"], x)
  assert len(set(np.asarray(targets).ravel() // 16)) == 4
  for a, b in zip(jax.tree.leaves((got[0], got[1], got[2])), jax.tree.leaves((want, dhp, dx))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert stages.vocab_parallel(cfg, 4) == ("tensor", 4)
  assert stages.vocab_parallel(cfg.replace(tie_embeddings=True), 4) is None
  assert stages.vocab_parallel(cfg, 1) is None and stages.vocab_parallel(cfg, 3) is None


def _device_bytes(tree, device):
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)


@pytest.mark.parametrize("axes", [{"data": 2, "fsdp": 2, "stage": 2, "tensor": 1},
                                  {"data": 1, "fsdp": 2, "stage": 2, "tensor": 2}],
                         ids=["stage2-fsdp2-data2", "stage2-tensor2-fsdp2"])
def test_stage_sharded_state_with_fsdp_and_tensor_inside_each_stage(axes):
  """The trainer's form (actor and critic in 2 stages): each device holds 1/(pp*fsdp*tp) of
  every layer matrix and 1/pp of the embedding and head; gradients come back placed the same
  way and equal jax.grad of the unpipelined losses."""
  problem = PipelineProblem(2, 2, 2, 2, 1.0, 1.0)
  acfg, ccfg, ap, cp = _models(4, 2, critic_kv_heads=2)
  mesh = make_mesh(MeshConfig(**axes))
  split = axes["stage"] * axes["fsdp"] * axes["tensor"]
  loss_cfg = stages.LossConfig()
  ex = make_executor(acfg, ccfg, loss_cfg, problem, schedules.greedy_order(problem), mesh,
                     compiler_options=FAST)
  staged = {m: jax.device_put(ex.stack(m, p), ex.staged_shardings(m))
            for m, p in (("actor", ap), ("critic", cp))}
  for m, whole in (("actor", ap), ("critic", cp)):
    # Layer matrices: 1/(pp*fsdp*tp); norm gains (logical axis "norm", never split): 1/pp.
    layers = sum(x.nbytes / (2 if "norm" in jax.tree_util.keystr(path) else split)
                 for k, v in whole.items() if k.startswith("layers_")
                 for path, x in jax.tree_util.tree_flatten_with_path(v)[0])
    tail = [x for k in ("embed", "head") for x in jax.tree.leaves(whole[k])]
    # Every tiny leaf has a dimension divisible by 2 except the value head's bias, if any.
    want = layers + sum(x.nbytes / 2 if x.shape and max(x.shape) % 2 == 0 else x.nbytes
                        for x in tail)
    for d in mesh.devices.flat:
      assert _device_bytes(staged[m], d) == want, (m, d)
  batch = _batch(8)
  ga, gc, metrics = jax.jit(ex.staged_grads_fn, compiler_options=FAST)(
      staged["actor"], staged["critic"], batch)
  for g, m in ((ga, "actor"), (gc, "critic")):
    jax.tree.map(lambda x, p: (x.sharding.is_equivalent_to(p.sharding, x.ndim) or
                               pytest.fail(f"{m} gradient placed as {x.sharding}")),
                 g, staged[m])
  ref_a, ref_c, ref_m = jax.jit(stages.reference_grads, static_argnums=(0, 1, 2),
                                compiler_options=FAST)(acfg, ccfg, loss_cfg, ap, cp, batch)
  _assert_matches(ex.unstack("actor", ga), ref_a)
  _assert_matches(ex.unstack("critic", gc), ref_c)
  for k in stages.ACTOR_METRICS + stages.CRITIC_METRICS:
    np.testing.assert_allclose(metrics[k], ref_m[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_impossible_placements_give_clear_errors():
  acfg, ccfg, _, _ = _models(4, 2)
  mesh4 = make_mesh(MeshConfig(data=1, stage=4), jax.devices()[:4])
  order = schedules.serial_order
  with pytest.raises(ValueError, match="actor_pp=4 must be divisible by critic_pp=3"):
    PipelineProblem(4, 3, 2, 2, 1.0, 1.0)
  p8 = PipelineProblem(8, 2, 2, 2, 1.0, 1.0)
  with pytest.raises(ValueError, match="actor_pp=8 stages need 8 devices on mesh axis 'stage'"):
    make_executor(acfg.replace(num_layers=8), ccfg, stages.LossConfig(), p8, order(p8), mesh4)
  p = PipelineProblem(4, 2, 2, 2, 1.0, 1.0)
  with pytest.raises(ValueError, match="actor.num_layers=6 must be divisible by its pipeline "
                                       "stages=4"):
    make_executor(acfg.replace(num_layers=6), ccfg, stages.LossConfig(), p, order(p), mesh4)
  with pytest.raises(ValueError, match="critic.num_layers=3 must be divisible"):
    make_executor(acfg, ccfg.replace(num_layers=3), stages.LossConfig(), p, order(p), mesh4)
  with pytest.raises(ValueError, match="critic.head='lm'"):
    make_executor(acfg, ccfg.replace(head="lm"), stages.LossConfig(), p, order(p), mesh4)
  ex = make_executor(acfg, ccfg, stages.LossConfig(), p, order(p), mesh4)
  with pytest.raises(ValueError, match="divisible by actor_microbatches=2 and by critic replicas "
                                       "x critic_microbatches=2x2"):
    ex.microbatch_sizes(6)
  with pytest.raises(ValueError, match="mini-batch of 0 rows: each of the 1 data shards"):
    ex.microbatch_sizes(0)  # was a ZeroDivisionError deep in the micro-batch reshapes
  with pytest.raises(KeyError, match="ref_logp"):
    make_executor(acfg, ccfg, stages.LossConfig(kl_coef=0.1), p, order(p), mesh4)._select(
        _batch(8))
  short = dict(_batch(8), advantages=_batch(4)["advantages"])
  with pytest.raises(ValueError, match="batch field 'advantages' has 4 rows, batch\\['tokens'\\] "
                                       "has 8"):
    ex(None, None, short)
  # A per-token field one column wide broadcast silently over the response (wrong gradients),
  # another width failed deep inside the traced losses.
  for width in (1, 2):
    narrow = dict(_batch(8), old_logp=_batch(8)["old_logp"][:, :width])
    with pytest.raises(ValueError, match=rf"batch field 'old_logp' has shape \(8, {width}\), "
                                         rf"batch\['mask'\] has \(8, {RESP}\)"):
      ex(None, None, narrow)
  with pytest.raises(ValueError, match=r"batch field 'prompt_lens' has shape \(8, 1\); "
                                       r"expected \[rows\]"):
    ex(None, None, dict(_batch(8), prompt_lens=_batch(8)["prompt_lens"][:, None]))


def test_the_step_lowers_on_one_mesh_with_a_primitive_that_needs_devices(monkeypatch):
  """A program holding a primitive that needs devices while lowering (cuDNN's fused attention
  on GPU) lowers only when every NamedSharding in it shares one mesh. On an H200 (2026-12-04)
  the pipelined step with cuDNN attention failed so: the actor and the batch on the trainer's
  mesh, the shard_map and the critic on stage_mesh. Here jnp.exp stands in for the cuDNN call
  (jax's own list of such primitives, extended for this test): inputs placed on the trainer's
  mesh are moved onto the program's mesh (executor.on_program_mesh), the executor's and the
  trainer's forms both lower."""
  from jax._src import dispatch
  from jax.sharding import NamedSharding, PartitionSpec as P
  import optax
  from rlhfuse_jax.pipeline import executor as executor_lib
  from rlhfuse_jax.trainer import pipelined, ppo
  from rlhfuse_jax.trainer.config import AlgoConfig
  monkeypatch.setattr(dispatch, "prim_requires_devices_during_lowering",
                      dispatch.prim_requires_devices_during_lowering | {jax.lax.exp_p})
  mesh = make_mesh(MeshConfig(data=2, stage=4), jax.devices()[:8])
  split = executor_lib.stage_mesh(mesh, 2)
  # The check this test relies on: two meshes in one program with exp in it are refused.
  with pytest.raises(ValueError, match="mesh should be the same"):
    jax.jit(lambda x, y: jnp.exp(x) + y).lower(
        jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("stage"))),
        jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(split, P())))
  problem = PipelineProblem(4, 2, 4, 2, 1.0, 1.0)
  acfg, ccfg, ap, cp = _models(4, 2)
  program = prog.build_program(problem, schedules.serial_order(problem), barrier=True)
  loss_cfg = stages.LossConfig()
  ex = PipelineExecutor(acfg, ccfg, loss_cfg, program, mesh, FAST)
  ap, cp = jax.device_put((ap, cp), NamedSharding(mesh, P()))
  batch = jax.device_put(_batch(16), NamedSharding(mesh, P("data")))
  ex.lower(ap, cp, batch)
  # The placement is the same blocks on the same devices: only the mesh's name for them moved.
  moved = ex.on_program_mesh(batch)["tokens"]
  assert moved.sharding.mesh == ex.program_mesh
  assert moved.sharding.devices_indices_map(moved.shape) == (
      batch["tokens"].sharding.devices_indices_map(moved.shape))
  pointers = lambda x: [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]  # noqa: E731
  assert pointers(moved) == pointers(batch["tokens"])  # nothing copied
  staged = {m: ex.on_program_mesh(ex.stack(m, p)) for m, p in (("actor", ap), ("critic", cp))}
  assert all(s.mesh == ex.program_mesh for s in jax.tree.leaves(ex.staged_shardings("actor")))
  tx = optax.adam(1e-3)
  # The optimizer state on the trainer's mesh, as a zero1 placement or a restore leaves it.
  states = [ppo.ModelState(staged[m], jax.tree.map(
      lambda x: jax.device_put(x, NamedSharding(mesh, P())), tx.init(staged[m])))
      for m in ("actor", "critic")]
  update = pipelined.PipelinedUpdate(ex, "serial_1f1b", AlgoConfig(), tx, tx, FAST)
  update.lower(*states, batch)
