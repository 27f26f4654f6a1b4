"""Generation: cache == full forward, behaviour log-probs == trainer recomputation, sampling
filters, per-sample stop, per-sample RNG invariance, sharded == single device, clear errors."""
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.generation import engine, instances, sampling
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.models import attention as attn
from rlhfuse_jax.models import llama, sequences
from rlhfuse_jax.parallel import mesh as mesh_lib

CFG = llama.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=4,
                        num_heads=4, num_kv_heads=2, max_seq_len=64)
B, P, T = 8, 6, 12
KEY = jax.random.key(7)


@pytest.fixture(scope="module")
def params():
  # Device arrays (one device), as test_clear_errors' placement check expects.
  return jax.tree_util.tree_map(jnp.asarray, llama.host_random_params(CFG, 0))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, CFG.vocab_size, (B, P)).astype(np.int32)
  lens = np.array([6, 1, 3, 5, 2, 6, 4, 3], np.int32)
  for b in range(B):  # right padding with pad_id=0, as generation expects
    tokens[b, lens[b]:] = 0
  return tokens, lens


_apply = jax.jit(
    lambda prm, tokens, pos=None, cache=None: llama.apply(CFG, prm, tokens, pos, cache))


def _full_logits(params, rollout):
  tokens = sequences.build_sequences(rollout.prompt_tokens, rollout.prompt_lens,
                                     rollout.response_tokens, rollout.response_lens, 0)
  return tokens, np.asarray(_apply(params, tokens)[0])  # [B, P+T, V]


def test_build_sequences_layout():
  tokens = sequences.build_sequences(np.array([[1, 2, 0], [3, 4, 5]]), np.array([2, 3]),
                                     np.array([[7, 8, 9], [10, 11, 12]]), np.array([3, 1]), 0)
  np.testing.assert_array_equal(tokens, [[1, 2, 7, 8, 9, 0], [3, 4, 5, 10, 0, 0]])
  np.testing.assert_array_equal(sequences.response_positions(np.array([2, 3]), 3),
                                [[1, 2, 3], [2, 3, 4]])
  np.testing.assert_array_equal(sequences.response_mask(np.array([3, 1]), 3),
                                [[1, 1, 1], [1, 0, 0]])
  host = sequences.response_mask([3, 1, 0], 3, xp=np)  # the trainer's host path
  assert isinstance(host, np.ndarray) and host.dtype == np.float32
  np.testing.assert_array_equal(host, [[1, 1, 1], [1, 0, 0], [0, 0, 0]])


def test_forward_at_equals_full_forward(params):
  tokens = jax.random.randint(jax.random.key(1), (3, 10), 0, CFG.vocab_size)
  at = jnp.array([[0, 3], [5, 9], [2, 2]])
  out, _ = jax.jit(lambda prm: sequences.forward_at(CFG, prm, tokens, at))(params)
  full, _ = _apply(params, tokens)
  np.testing.assert_allclose(out, jnp.take_along_axis(full, at[:, :, None], axis=1), atol=1e-6)


def test_response_logprobs_entropy_and_grad_match_full_forward(params, prompts):
  rng = np.random.default_rng(1)
  resp = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
  rlens = rng.integers(1, T + 1, B).astype(np.int32)
  tokens = sequences.build_sequences(*prompts, resp, rlens, 0)
  lens = jnp.asarray(prompts[1])

  mask = sequences.response_mask(rlens, T)

  def reference(prm):  # full logits, then gather: the obvious (memory-hungry) way
    logits = llama.apply(CFG, prm, tokens)[0] / 0.7
    pos = np.asarray(lens)[:, None] - 1 + np.arange(T)[None]
    lp_all = jax.nn.log_softmax(jnp.take_along_axis(logits, pos[:, :, None], axis=1), -1)
    tgt = jnp.take_along_axis(tokens, pos + 1, axis=1)
    lp = jnp.take_along_axis(lp_all, tgt[:, :, None], axis=-1)[..., 0]
    return jnp.sum(lp * mask), (lp, -jnp.sum(jnp.exp(lp_all) * lp_all, -1))

  def ours(prm):
    lp, ent = sequences.response_logprobs_and_entropy(CFG, prm, tokens, lens, T, 0.7)
    return jnp.sum(lp * mask), (lp, ent)

  (_, (lp, ent)), g = jax.jit(jax.value_and_grad(ours, has_aux=True))(params)
  (_, (lp_ref, ent_ref)), g_ref = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
  np.testing.assert_allclose(lp, lp_ref, atol=1e-5)
  np.testing.assert_allclose(ent, ent_ref, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.fixture(scope="module")
def sampled(params, prompts):
  sc = SamplingConfig(temperature=0.7, top_k=6, top_p=0.9, max_new_tokens=T, chunk_size=5)
  gen = instances.Generator(CFG, sc, batch_size=B, prompt_len=P, params=params)
  return gen, gen.generate(params, *prompts, KEY)


def test_cached_decode_logits_equal_full_forward(params, sampled):
  _, r = sampled
  _, full = _full_logits(params, r)
  sc = SamplingConfig(max_new_tokens=T)
  state = jax.jit(lambda prm, *a: engine.prefill(CFG, prm, *a, KEY, sc, P + T))(
      params, jnp.asarray(r.prompt_tokens), jnp.asarray(r.prompt_lens), jnp.asarray(r.uids))
  cache, pos = state.cache, jnp.asarray(r.prompt_lens)
  for t in range(T - 1):  # feed the generated tokens one by one through the cache
    logits, cache = _apply(params, jnp.asarray(r.response_tokens[:, t:t + 1]), pos[:, None],
                           cache)
    want = full[np.arange(B), np.asarray(pos)]  # [B, V] full-forward logits at the same positions
    live = t + 1 < r.response_lens
    np.testing.assert_allclose(np.asarray(logits[:, 0])[live], want[live], atol=1e-5)
    pos = pos + 1


def test_more_tokens_than_the_cache_holds_are_refused(params):
  """A prefill longer than the KV cache wrote out of bounds and gave wrong logits without an
  error (found by a review: 8 tokens into a cache of 5, logits 0.41 off); the engine sizes its
  caches, a direct caller of llama.apply is told."""
  tokens = jnp.ones((1, 8), jnp.int32)
  cache = llama.KVCache.zeros(CFG, 1, 5)
  # Jitted (_apply): the check reads static shapes, so it raises while tracing as it does
  # eagerly, and the call that fits compiles one program instead of each op (2.5 s).
  with pytest.raises(ValueError, match=r"8 tokens written at once into a KV cache of 5 "
                                       r"positions"):
    _apply(params, tokens, jnp.arange(8)[None], cache)
  _apply(params, tokens[:, :5], jnp.arange(5)[None], cache)  # fits: no error


def test_behaviour_logprobs_equal_trainer_recomputation(params, sampled):
  gen, r = sampled
  tokens = sequences.build_sequences(r.prompt_tokens, r.prompt_lens, r.response_tokens,
                                     r.response_lens, 0)
  lp, _ = jax.jit(lambda prm: sequences.response_logprobs_and_entropy(
      CFG, prm, tokens, r.prompt_lens, T, gen.sampling.logprob_temperature))(params)
  mask = np.asarray(sequences.response_mask(r.response_lens, T))
  np.testing.assert_allclose(np.asarray(lp) * mask, r.logprobs, atol=1e-5)
  assert (r.logprobs[mask == 0] == 0).all()


def test_whatever_lies_behind_a_prompt_changes_nothing(params, prompts, sampled):
  # Behind each row's length any value, in the vocabulary or not (-100, HF's ignore index; 99 >
  # vocab_size, which jnp.take embeds as NaN and masked attention's 0 x NaN would spread over
  # the row), gives the tokens and log-probs of pad_id padding.
  gen, ref = sampled
  tokens, lens = prompts
  behind = np.arange(P)[None] >= lens[:, None]
  for fill in (-100, 99, 5):
    out = gen.generate(params, np.where(behind, fill, tokens), lens, KEY)
    np.testing.assert_array_equal(out.response_tokens, ref.response_tokens)
    np.testing.assert_array_equal(out.logprobs, ref.logprobs)


@pytest.fixture(scope="module")
def greedy(params, prompts):
  sc = SamplingConfig(greedy=True, max_new_tokens=T, chunk_size=3)
  return instances.Generator(CFG, sc, batch_size=B, prompt_len=P).generate(params, *prompts, KEY)


def test_greedy_is_stepwise_argmax_and_top_k_1_equals_greedy(params, prompts, greedy):
  r = greedy
  assert (r.response_lens == T).all() and (r.stop_reason == engine.STOP_MAX_TOKENS).all()
  _, full = _full_logits(params, r)
  pos = r.prompt_lens[:, None] - 1 + np.arange(T)[None]  # [B, T]
  np.testing.assert_array_equal(r.response_tokens, full[np.arange(B)[:, None], pos].argmax(-1))
  top1 = instances.Generator(
      CFG, SamplingConfig(temperature=0.8, top_k=1, max_new_tokens=T, chunk_size=4),
      batch_size=B, prompt_len=P)
  np.testing.assert_array_equal(top1.generate(params, *prompts, KEY).response_tokens,
                                r.response_tokens)


def test_per_sample_stop_on_eos_or_max_new_tokens(params, prompts, greedy):
  base = greedy
  eos = int(base.response_tokens[0, 2])  # a token some rows emit, at different steps
  gen = instances.Generator(CFG, SamplingConfig(greedy=True, max_new_tokens=T, chunk_size=3,
                                                eos_id=eos, pad_id=0),
                            batch_size=B, prompt_len=P)
  r = gen.generate(params, *prompts, KEY)
  for b in range(B):
    hits = np.flatnonzero(base.response_tokens[b] == eos)
    want_len = hits[0] + 1 if hits.size else T
    assert r.response_lens[b] == want_len
    assert r.stop_reason[b] == (engine.STOP_EOS if hits.size else engine.STOP_MAX_TOKENS)
    np.testing.assert_array_equal(r.response_tokens[b, :want_len],
                                  base.response_tokens[b, :want_len])
    assert (r.response_tokens[b, want_len:] == 0).all() and (r.logprobs[b, want_len:] == 0).all()
  assert (r.stop_reason == engine.STOP_EOS).any()
  assert (r.stop_reason == engine.STOP_MAX_TOKENS).any()
  assert r.decode_steps == r.response_lens.max() - 1
  assert r.decode_chunks == -(-r.decode_steps // 3)


def test_an_eos_sampled_as_the_last_budgeted_token_is_an_eos_stop():
  """A row that emits EOS exactly at its token budget ended on its own: its stop reason is
  STOP_EOS, not STOP_MAX_TOKENS (the trainer's clip ratio counts only the budget's cut-offs as
  truncated, and so must the engine's result). One recorded step of three live rows, budget 4:
  EOS as the 4th token, another token as the 4th, EOS as the 2nd."""
  sc = SamplingConfig(max_new_tokens=4, eos_id=5)
  zeros = jnp.zeros((3,), jnp.int32)
  state = engine.DecodeState(
      cache=None, last_token=zeros, position=zeros, prompt_len=zeros,
      num_generated=jnp.array([3, 3, 1], jnp.int32), done=jnp.zeros((3,), bool),
      stop_reason=zeros, uid=zeros, budget=jnp.full((3,), 4, jnp.int32),
      tokens=jnp.zeros((3, 4), jnp.int32), logprobs=jnp.zeros((3, 4), jnp.float32))
  out = engine._record(state, jnp.array([5, 7, 5], jnp.int32), jnp.zeros((3,)), sc)
  np.testing.assert_array_equal(out.num_generated, [4, 4, 2])
  np.testing.assert_array_equal(out.done, [True, True, True])
  np.testing.assert_array_equal(out.stop_reason,
                                [engine.STOP_EOS, engine.STOP_MAX_TOKENS, engine.STOP_EOS])
  np.testing.assert_array_equal(out.tokens[:, 3], [5, 7, 0])


def test_any_of_several_eos_ids_stops_a_row(params, prompts, greedy):
  """A chat model's generation_config lists several ids that end a turn: a row stops at the
  first of any of them, as with one EOS, and the stop is an EOS stop (not the token budget)."""
  first, second = int(greedy.response_tokens[0, 2]), int(greedy.response_tokens[1, 3])
  unused = next(i for i in range(CFG.vocab_size) if i not in greedy.response_tokens)
  gen = instances.Generator(
      CFG, SamplingConfig(greedy=True, max_new_tokens=T, chunk_size=3, eos_id=unused, pad_id=0,
                          extra_eos_ids=[first, second]), batch_size=B, prompt_len=P)
  r = gen.generate(params, *prompts, KEY)
  for b in range(B):
    hits = np.flatnonzero(np.isin(greedy.response_tokens[b], [first, second]))
    assert r.response_lens[b] == (hits[0] + 1 if hits.size else T)
    assert r.stop_reason[b] == (engine.STOP_EOS if hits.size else engine.STOP_MAX_TOKENS)
  assert r.response_lens[1] <= 4 and r.stop_reason[1] == engine.STOP_EOS
  assert SamplingConfig(eos_id=5, extra_eos_ids=[7, 9]).stop_ids == (5, 7, 9)
  assert SamplingConfig().stop_ids == ()
  for kw, match in [({"extra_eos_ids": [3]}, "needs sampling.eos_id >= 0"),
                    ({"eos_id": 1, "extra_eos_ids": 3}, "expected a sequence"),
                    ({"eos_id": 1, "extra_eos_ids": [-1]}, "expected a sequence")]:
    with pytest.raises(ValueError, match=f"sampling.extra_eos_ids=.*{match}"):
      SamplingConfig(**kw)
  with pytest.raises(ValueError, match="sampling.extra_eos_ids=.40.*outside the vocabulary"):
    instances.Generator(CFG, SamplingConfig(eos_id=1, extra_eos_ids=(40,)), batch_size=B,
                        prompt_len=P)


def test_steps_per_check_runs_a_static_loop_and_changes_no_output(params, prompts, greedy):
  """Checking `done` every 3 steps (a fixed-trip-count inner loop) gives the same rollout as
  every step, rows stopping at EOS mid-loop included; the extra steps of a finished batch are
  no-ops, and the chunk has the static inner loop it exists for."""
  eos = int(greedy.response_tokens[0, 2])
  runs = {}
  for k in (1, 3):
    smp = SamplingConfig(greedy=True, max_new_tokens=T, chunk_size=6, eos_id=eos, pad_id=0,
                         steps_per_check=k)
    gen = instances.Generator(CFG, smp, batch_size=B, prompt_len=P)
    runs[k] = gen.generate(params, *prompts, KEY)
    hlo = gen._exe["decode"].as_text()  # XLA knows the inner loop's trip count: no sync
    assert ('known_trip_count":{"n":"3"}' in hlo) == (k == 3)
  a, b = runs[1], runs[3]
  assert (a.stop_reason == engine.STOP_EOS).any() and a.response_lens.max() % 3 != 1
  for field in ("response_tokens", "response_lens", "logprobs", "stop_reason"):
    np.testing.assert_array_equal(getattr(b, field), getattr(a, field))
  # Steps a chunk runs (the Rt calibration divides a chunk's time by them): whole groups of 3.
  assert [engine.chunk_steps(SamplingConfig(chunk_size=6, steps_per_check=k), n)
          for k in (1, 3) for n in (1, 4, 6, 11)] == [1, 4, 6, 6, 3, 6, 6, 6]
  with pytest.raises(ValueError, match="steps_per_check=4.*chunk_size=6"):
    SamplingConfig(chunk_size=6, steps_per_check=4)


def _decode_whiles(gen, params) -> int:
  """Loops in the decode chunk the engine emits: lowered, before XLA's passes (which expand some
  ops into loops of their own under XLA:CPU's loop emitters, tests/xla_env.py), and outside jax's
  threefry functions (each a loop of a fixed count)."""
  text = dict(gen.lower_all(params, {}, only=("decode",)))["decode"].as_text()
  funcs = re.split(r"(?=func\.func )", text)
  return sum(f.count("stablehlo.while") for f in funcs
             if not re.match(r"func\.func (private |public )?@_?threefry", f))


def test_gpu_decode_reads_the_whole_cache_with_static_shapes(params, prompts, greedy,
                                                            monkeypatch, caplog):
  """attention="cudnn" on a GPU backend (the opt-out: "auto" in a generation instance takes
  the kernel there, test_auto_decodes_with_the_kernel_on_gpu): one-token decode takes the static
  whole-cache path (no loop with a traced trip count, which XLA:GPU would sync on per key block
  and layer). Same
  tokens as the blockwise decode, log-probs to float32 rounding; "blockwise" there still loops,
  and says once that it is slow. The backend is faked: the dispatch reads
  jax.default_backend() while tracing, so no trace may come from (or stay in) jax's caches."""
  smp = SamplingConfig(greedy=True, max_new_tokens=T, chunk_size=4)
  jax.clear_caches()
  try:
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    gen = instances.Generator(CFG.replace(attention="cudnn"), smp, batch_size=B, prompt_len=P)
    r = gen.generate(params, *prompts, KEY)
    whiles = _decode_whiles(gen, params)
    with caplog.at_level("WARNING"):
      instances.Generator(CFG, smp, batch_size=B, prompt_len=P).compile(params)
    monkeypatch.undo()
  finally:
    jax.clear_caches()
  assert "decodes on GPU through the live-prefix loop" in caplog.text
  cpu = instances.Generator(CFG.replace(attention="auto"), smp, batch_size=B, prompt_len=P)
  assert whiles == 1 < _decode_whiles(cpu, params)  # chunk loop only
  np.testing.assert_array_equal(r.response_tokens, greedy.response_tokens)
  np.testing.assert_allclose(r.logprobs, greedy.logprobs, atol=1e-5)


def test_pallas_generation_equals_blockwise(params, prompts, greedy):
  """The engine with model.attention="pallas" (prefill as "auto", decode through the Pallas
  kernel, interpret mode on CPU) gives the blockwise engine's greedy tokens and log-probs to
  float32 rounding, with unrolled and scanned (traced layer index) layers."""
  smp = SamplingConfig(greedy=True, max_new_tokens=T, chunk_size=4)
  for scan in (False, True):
    cfg = CFG.replace(attention="pallas", scan_layers=scan)
    prm = llama.stack_layers(params, CFG.num_layers) if scan else params
    got = instances.Generator(cfg, smp, batch_size=B, prompt_len=P).generate(prm, *prompts, KEY)
    np.testing.assert_array_equal(got.response_tokens, greedy.response_tokens, err_msg=str(scan))
    np.testing.assert_allclose(got.logprobs, greedy.logprobs, atol=1e-5, err_msg=str(scan))


def decode_collectives(gen) -> list:
  """Sorted (dtype[shape], op) of every collective in a generator's compiled decode chunk."""
  return sorted(re.findall(r"= (\w+\[[\d,]*\])\{[^}]*\} (all-\w+|collective-permute)\(",
                           gen._exe["decode"].as_text()))


def test_pallas_on_a_sharded_instance_runs_per_device(params, prompts, greedy):
  """On an instance of data 2 x tensor 2 the kernel runs inside a shard_map on each device's
  rows and KV head of its own cache shard: the blockwise engine's greedy tokens and log-probs,
  and the compiled decode chunk has exactly the blockwise engine's collectives (the kernel
  moves no cache between devices; without the shard_map XLA gathers the KV shards). KV heads
  that do not split over `tensor` are refused, naming the field."""
  smp = SamplingConfig(greedy=True, max_new_tokens=T, chunk_size=4)
  cfg = CFG.replace(attention="pallas")
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, tensor=2), jax.devices()[:4])
  sharded = mesh_lib.shard_params(params, llama.logical_specs(CFG), mesh)
  gen = instances.Generator(cfg, smp, batch_size=B, prompt_len=P, mesh=mesh, params=sharded)
  got = gen.generate(sharded, *prompts, KEY)
  np.testing.assert_array_equal(got.response_tokens, greedy.response_tokens)
  np.testing.assert_allclose(got.logprobs, greedy.logprobs, atol=1e-5)
  plain = instances.Generator(CFG.replace(attention="blockwise"), smp, batch_size=B,
                              prompt_len=P, mesh=mesh, params=sharded)
  assert decode_collectives(gen) == decode_collectives(plain)  # the kernel adds none
  mesh4 = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, tensor=4), jax.devices()[:4])
  with pytest.raises(ValueError, match=r"model\.attention='pallas' needs the KV heads split "
                                       r"evenly .*model\.num_kv_heads=2, tensor=4"):
    instances.Generator(cfg, smp, batch_size=B, prompt_len=P, mesh=mesh4)


def test_auto_decodes_with_the_kernel_on_gpu(monkeypatch):
  """"auto" becomes "pallas" for a generation instance on a GPU backend (faster at every
  measured batch, experiments/results/h100_pallas_decode) when its KV heads split over the
  instance's tensor devices; another backend, KV heads that do not split, or an explicit
  implementation ("cudnn", the opt-out) keep their path. Construction only: the Triton kernel
  cannot run here."""
  smp = SamplingConfig(max_new_tokens=T)
  mesh4 = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, tensor=4), jax.devices()[:4])
  assert attn.instance_attention("auto", 2, 1) == "auto"  # the CPU backend: unchanged
  assert instances.Generator(CFG.replace(attention="auto"), smp, batch_size=B,
                             prompt_len=P).cfg.attention == "auto"
  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  assert [attn.instance_attention(i, kv, t) for i, kv, t in (
      ("auto", 2, 1), ("auto", 8, 4), ("auto", 2, 4), ("cudnn", 2, 1), ("blockwise", 2, 1),
      ("pallas", 2, 1))] == ["pallas", "pallas", "auto", "cudnn", "blockwise", "pallas"]
  one = instances.Generator(CFG.replace(attention="auto"), smp, batch_size=B, prompt_len=P)
  four = instances.Generator(CFG.replace(attention="auto"), smp, batch_size=B, prompt_len=P,
                             mesh=mesh4)
  assert (one.cfg.attention, four.cfg.attention) == ("pallas", "auto")


def test_per_sample_rng_invariance(params, prompts, sampled):
  gen, r = sampled
  tokens, lens = prompts
  perm = np.random.default_rng(3).permutation(B)
  rp = gen.generate(params, tokens[perm], lens[perm], KEY, uids=perm)
  np.testing.assert_array_equal(rp.response_tokens, r.response_tokens[perm])  # bitwise
  np.testing.assert_array_equal(rp.logprobs, r.logprobs[perm])
  # Sample 0 in slot 5 among other samples (different prompts and uids), same batch size.
  others = np.random.default_rng(4).integers(1, CFG.vocab_size, (B, P)).astype(np.int32)
  olens, ouids = np.full(B, P, np.int32), np.arange(100, 100 + B, dtype=np.int32)
  others[5], olens[5], ouids[5] = tokens[0], lens[0], 0
  ro = gen.generate(params, others, olens, KEY, uids=ouids)
  np.testing.assert_array_equal(ro.response_tokens[5], r.response_tokens[0])
  np.testing.assert_array_equal(ro.logprobs[5], r.logprobs[0])
  # Alone in a batch of 1: on CPU the logits differ in the last bit across batch sizes (a
  # different GEMM shape), so log-probs match to tolerance; tokens matched for this seed.
  alone = instances.Generator(CFG, gen.sampling, batch_size=1, prompt_len=P)
  for b in (0, 3):
    r1 = alone.generate(params, tokens[b:b + 1], lens[b:b + 1], KEY, uids=[b])
    np.testing.assert_array_equal(r1.response_tokens[0], r.response_tokens[b])
    np.testing.assert_allclose(r1.logprobs[0], r.logprobs[b], atol=1e-5)
  # A different iteration key gives different samples.
  assert (gen.generate(params, tokens, lens, jax.random.key(8)).response_tokens
          != r.response_tokens).any()


def test_top_p_keeps_only_the_nucleus():
  probs = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
  vocab = np.random.default_rng(5).permutation(8)[:5]  # tokens holding that mass, rest ~0
  logits = np.full(8, -1e9, np.float32)
  logits[vocab] = np.log(probs)
  n = 4000
  keys = jax.random.split(jax.random.key(0), n)
  rows = jnp.broadcast_to(logits, (n, 8))
  draw = jax.jit(sampling.sample_token, static_argnums=2)
  tokens, logp = draw(rows, keys, SamplingConfig(top_p=0.8))
  tokens = np.asarray(tokens)
  nucleus = vocab[:3]  # 0.5 + 0.25 < 0.8 <= 0.5 + 0.25 + 0.15
  assert np.isin(tokens, nucleus).all()
  freq = np.array([(tokens == v).mean() for v in nucleus])
  np.testing.assert_allclose(freq, probs[:3] / probs[:3].sum(), atol=0.03)
  # Recorded log-probs are the untruncated ones (what the trainer recomputes).
  full_logp = np.full(8, -np.inf)
  full_logp[vocab] = np.log(probs)  # probs sum to 1: the untruncated log-softmax
  np.testing.assert_allclose(np.asarray(logp), full_logp[tokens], atol=1e-5)
  top_k2, _ = draw(rows, keys, SamplingConfig(top_k=2))
  assert np.isin(np.asarray(top_k2), vocab[:2]).all()


def test_sharded_generation_equals_single_device(params, prompts, sampled, monkeypatch):
  _, r = sampled
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))
  gen = instances.Generator(CFG, sampled[0].sampling, batch_size=B, prompt_len=P, mesh=mesh)
  r8 = gen.generate(jax.device_put(params, mesh_lib.replicated(mesh)), *prompts, KEY)
  np.testing.assert_array_equal(r8.response_tokens, r.response_tokens)
  np.testing.assert_array_equal(r8.response_lens, r.response_lens)
  np.testing.assert_allclose(r8.logprobs, r.logprobs, atol=1e-5)
  # data x tensor with tensor-sharded params and KV heads.
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4, tensor=2))
  sharded = mesh_lib.shard_params(params, llama.logical_specs(CFG), mesh)
  gen = instances.Generator(CFG, sampled[0].sampling, batch_size=B, prompt_len=P, mesh=mesh,
                            params=sharded)
  rt = gen.generate(sharded, *prompts, KEY)
  np.testing.assert_array_equal(rt.response_tokens, r.response_tokens)
  np.testing.assert_allclose(rt.logprobs, r.logprobs, atol=1e-5)
  # generation="mesh" on an fsdp mesh: the weights split over a batch axis. Unrolled layers
  # prefill under shard_activations (instances.activation_mesh); the tokens are those of the
  # program without it, the log-probs within float32 rounding of its (9.5e-7 apart, 2026-12-07).
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, fsdp=8))
  fsdp = mesh_lib.shard_params(params, llama.logical_specs(CFG), mesh)

  def on_fsdp(cfg, prm):
    return instances.Generator(cfg, sampled[0].sampling, batch_size=B, prompt_len=P, mesh=mesh,
                               params=prm).generate(prm, *prompts, KEY)
  rf = on_fsdp(CFG, fsdp)
  with monkeypatch.context() as m:
    m.setattr(instances, "activation_mesh", lambda cfg, mesh, shardings: None)
    today = on_fsdp(CFG, fsdp)
  for got in (today, r):
    np.testing.assert_array_equal(rf.response_tokens, got.response_tokens)
    np.testing.assert_array_equal(rf.response_lens, got.response_lens)
  np.testing.assert_allclose(rf.logprobs, today.logprobs, rtol=0, atol=1e-5)
  np.testing.assert_allclose(rf.logprobs, r.logprobs, rtol=0, atol=1e-5)
  scanned = CFG.replace(scan_layers=True)
  stacked = mesh_lib.shard_params(llama.stack_layers(params, CFG.num_layers),
                                  llama.logical_specs(scanned), mesh)
  rs = on_fsdp(scanned, stacked)
  np.testing.assert_array_equal(rs.response_tokens, r.response_tokens)
  np.testing.assert_allclose(rs.logprobs, r.logprobs, rtol=0, atol=1e-5)


def test_state_is_donated_and_compiled_once(params, prompts, sampled):
  gen, _ = sampled
  tokens, lens = prompts
  placed = jax.device_put(params, gen._param_sh)
  with jax.transfer_guard("disallow"):  # no implicit copy may sneak into the decode loop
    state, _ = gen.prefill(placed, tokens, lens, np.arange(B, dtype=np.int32),
                           np.full(B, T, np.int32), KEY)
    old = state
    state, summary = gen.decode(placed, state, KEY)
    assert old.cache.k.is_deleted() and old.tokens.is_deleted()
    done = jax.device_get(summary)[0]
  assert done.shape == (B,)
  gen.generate(params, tokens, lens, KEY)
  assert gen.num_compiles == 2


def test_the_ahead_of_time_compile_says_what_it_does_and_how_long_it_took(params, sampled,
                                                                           caplog):
  """The serial stage compiles prefill and decode after train_ppo's "models and update ready":
  a line before and after, not a silence as long as the compile. (The `sampled` generator's
  sampling: its programs load from the persistent compilation cache instead of compiling.)"""
  with caplog.at_level(logging.INFO):
    instances.Generator(CFG, sampled[0].sampling, batch_size=B, prompt_len=P, params=params)
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generation:")]
  assert lines[0] == (f"generation: compiling prefill and decode ({B} rows, prompts up to {P} "
                      f"tokens, {T} new) ...")
  assert re.fullmatch(r"generation: prefill and decode compiled in \d+\.\ds", lines[1])


def test_clear_errors(params, prompts):
  with pytest.raises(ValueError, match="context too long.*max_seq_len=64"):
    instances.Generator(CFG, SamplingConfig(max_new_tokens=60), batch_size=B, prompt_len=P)
  for kw, match in [({"temperature": 0.0}, "temperature"), ({"temperature": 1e-38}, "temp"),
                    ({"temperature": float("inf")}, "temperature"), ({"top_p": 0.0}, "top_p"),
                    ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
                    ({"max_new_tokens": 0}, "max_new_tokens"), ({"chunk_size": 0}, "chunk_size"),
                    ({"eos_id": -2}, "eos_id"), ({"pad_id": -1}, "pad_id")]:
    with pytest.raises(ValueError, match=f"sampling.{match}"):
      SamplingConfig(**kw)
  with pytest.raises(ValueError, match="sampling.top_k=2.5; expected an integer"):
    SamplingConfig(top_k=2.5)
  whole = SamplingConfig(top_k=2.0, max_new_tokens=4.0, chunk_size=4.0, steps_per_check=2.0)
  assert whole == SamplingConfig(top_k=2, max_new_tokens=4, chunk_size=4, steps_per_check=2)
  assert all(type(getattr(whole, f)) is int
             for f in ("top_k", "max_new_tokens", "chunk_size", "steps_per_check"))
  with pytest.raises(ValueError, match="sampling.eos_id=40 is outside the vocabulary"):
    instances.Generator(CFG, SamplingConfig(eos_id=40), batch_size=B, prompt_len=P)
  # (padded positions are embedded like any token: the id must be one of the model's)
  with pytest.raises(ValueError, match="sampling.pad_id=32 is outside the vocabulary"):
    instances.Generator(CFG, SamplingConfig(pad_id=32), batch_size=B, prompt_len=P)
  with pytest.raises(ValueError, match="sampling.top_k=33 exceeds"):
    instances.Generator(CFG, SamplingConfig(top_k=33), batch_size=B, prompt_len=P)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))
  with pytest.raises(ValueError, match=r"batch_size \(slots\)=4 must be a positive multiple of"):
    instances.Generator(CFG, SamplingConfig(), batch_size=4, prompt_len=P, mesh=mesh)
  with pytest.raises(ValueError, match="params live on 1 device.*mesh has 8"):
    instances.Generator(CFG, SamplingConfig(), batch_size=B, prompt_len=P, mesh=mesh, params=params)
  gen = instances.Generator(CFG, SamplingConfig(max_new_tokens=2), batch_size=B, prompt_len=P)
  with pytest.raises(ValueError, match="prompt_lens must be in"):
    gen.generate(params, prompts[0], np.zeros(B, np.int32), KEY)
  with pytest.raises(ValueError, match="prompt_tokens has shape"):
    gen.generate(params, np.zeros((B, P + 1), np.int32), prompts[1], KEY)
  with pytest.raises(ValueError, match=r"uids\[1\] = uids\[3\] = 7: .*expected distinct"):
    gen.generate(params, *prompts, KEY, uids=[0, 7, 2, 7, 4, 5, 6, 1])


@pytest.mark.parametrize("kw", [{"eos_id": 2.5}, {"pad_id": 0.5}, {"eos_id": None},
                                {"top_k": float("nan")}, {"max_new_tokens": float("inf")},
                                {"chunk_size": None}, {"steps_per_check": float("nan")},
                                {"eos_id": True}, {"top_k": True}, {"max_new_tokens": np.True_}])
def test_sampling_ids_and_sizes_that_are_not_integers_are_refused_naming_them(kw):
  # eos_id=2.5 was accepted and matched no token, so no response ended on it; pad_id=0.5 padded
  # with 0; NaN, inf or None in a size raised int()'s bare error, naming no field; a bool was
  # its int (eos_id=True token 1, top_k=True greedy-like), where extra_eos_ids refused it.
  (name, value), = kw.items()
  with pytest.raises(ValueError, match=re.escape(f"sampling.{name}={value}; expected")):
    SamplingConfig(**kw)
  ids = SamplingConfig(eos_id=np.int64(3), pad_id=1.0)  # integral values are the integers
  assert (ids.eos_id, ids.pad_id) == (3, 1) and type(ids.eos_id) is type(ids.pad_id) is int


@pytest.mark.parametrize("kw", [{"temperature": "0.7"}, {"top_p": "0.9"}, {"greedy": "no"},
                                {"top_p": True}, {"temperature": True}, {"greedy": 1},
                                {"temperature": 0.0}, {"temperature": float("nan")}])
def test_sampling_numbers_and_flags_of_the_wrong_type_are_refused_naming_them(kw):
  # A string failed a bare comparison ("'<=' not supported"), naming no field; greedy="no" was
  # truthy and decoded argmax; top_p=True and temperature=True were kept as True.
  (name, value), = kw.items()
  with pytest.raises(ValueError, match=re.escape(f"sampling.{name}={value!r}; expected")):
    SamplingConfig(**kw)


def test_greedy_sampling_takes_temperature_zero_and_numpy_stop_ids():
  # temperature=0 (the usual spelling of greedy) beside greedy=True was refused with "use
  # greedy=True"; greedy ignores it (log-probs at temperature 1). extra_eos_ids refused the
  # numpy integers eos_id takes.
  greedy = SamplingConfig(greedy=True, temperature=0, eos_id=np.int64(1),
                          extra_eos_ids=(np.int64(7), 9.0))
  assert greedy.logprob_temperature == 1.0 and greedy.extra_eos_ids == (7, 9)
  assert all(type(i) is int for i in greedy.extra_eos_ids)
  assert SamplingConfig(temperature=np.float32(0.5), top_p=1).top_p == 1.0
  with pytest.raises(ValueError, match=r"sampling\.temperature=-1; expected a finite number "
                     r">= 1e-06$"):
    SamplingConfig(greedy=True, temperature=-1)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_frequencies_follow_the_tempered_softmax(temperature):
  # 40,000 draws from one row of fixed logits (one key per draw, as sample_keys gives each
  # (uid, step) its own): each token's frequency is within 5 binomial standard deviations of
  # softmax(logits / T), and the reported log-prob is log softmax(logits / T) at the token.
  n, logits = 40_000, jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], jnp.float32)
  cfg = sampling.SamplingConfig(temperature=temperature, max_new_tokens=1, eos_id=-1, pad_id=0)
  keys = sampling.sample_keys(jax.random.key(7), jnp.arange(n, dtype=jnp.int32),
                              jnp.zeros((n,), jnp.int32))
  tokens, logp = jax.jit(lambda k: sampling.sample_token(
      jnp.broadcast_to(logits, (n, logits.shape[0])), k, cfg))(keys)
  want = np.asarray(jax.nn.softmax(logits / temperature))
  freq = np.bincount(np.asarray(tokens), minlength=len(want)) / n
  sd = np.sqrt(want * (1 - want) / n)
  assert np.all(np.abs(freq - want) <= 5 * sd + 1e-4), (freq, want)
  np.testing.assert_allclose(np.asarray(logp), np.log(want)[np.asarray(tokens)], atol=1e-5)
