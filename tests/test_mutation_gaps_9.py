"""Pins the survivors of a hand mutation audit of the inter-stage fusion engine
(generation/fused.py, generation/instances.py, generation/engine.py): the deal of a batch that
leaves slots empty, the slot table's stop reasons, what the consolidation plan is told of each
sample, the bytes a migration copies, which instances are freed for inference and when, the
streaming and draining of inference micro-batches, and the rollout's counters."""
import concurrent.futures
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.generation import engine, fused, instances
from rlhfuse_jax.generation.fused import FusedGenerator
from rlhfuse_jax.generation.instances import FrozenModels
from rlhfuse_jax.generation.sampling import SamplingConfig, sample_keys, sample_token
from rlhfuse_jax.models import llama
from tests.test_fused_generation import CFG, KEY, P, T, batch, build

MB = 4  # the generator's inference micro-batch (= slots)


@pytest.fixture(scope="module")
def ref_only():
  """4 instances of 1 device, 4 slots, a reference model only (the fewest executables)."""
  return build(4, 4, 1, FrozenModels(reference=CFG))


def like(gen, actor, params, batch_size=None, **fields):
  """A FusedGenerator like `gen` (other config fields or batch size) running `gen`'s
  executables: the instances have the same devices and shapes, so nothing compiles again."""
  real = instances.compile_all
  instances.compile_all = lambda *args, **kw: None
  try:
    new = FusedGenerator(gen.cfg, gen.sampling, dataclasses.replace(gen.config, **fields),
                         batch_size=batch_size or gen.batch_size, prompt_len=gen.prompt_len,
                         frozen=gen.frozen, actor_params=actor, frozen_params=params)
  finally:
    instances.compile_all = real
  for mine, theirs in zip(new.instances, gen.instances, strict=True):
    mine._exe = theirs._exe
  return new


def two_tails_batch():
  """test_fused_generation's two-consolidation batch: full prompts; one tail per instance
  (samples 0-3, sample b on instance b % 4, slot b // 4), samples 4-7 done in the second
  chunk, the rest at prefill. Rt=0.5 consolidates 8 -> 2 instances at step 0 and, with
  max_consolidations=2, 4 -> 1 at step 6."""
  tokens = np.random.default_rng(4).integers(1, CFG.vocab_size, (16, P)).astype(np.int32)
  lens = np.full(16, P, np.int32)
  budgets = np.ones(16, np.int32)
  budgets[0:4] = T
  budgets[4:8] = 5
  return tokens, lens, budgets


# FusedGenerator._deal ----------------------------------------------------------------------------

def test_a_short_batch_leaves_its_empty_slots_with_budget_zero_and_pad_prompts():
  """Sample b goes to instance b % G, slot b // G; a slot no sample fills gets budget 0 (done
  right after prefill, so its instance's chunks can exit early) and a pad prompt of length 1.
  An empty slot given max_new_tokens decoded to the end in every chunk, unseen in the outputs."""
  gen = types.SimpleNamespace(config=types.SimpleNamespace(num_instances=3, slots=2),
                              prompt_len=3, sampling=types.SimpleNamespace(pad_id=0),
                              batch_size=5)
  tokens = np.arange(1, 16, dtype=np.int32).reshape(5, 3)
  lens = np.array([3, 2, 1, 3, 2], np.int32)
  uids = np.array([10, 11, 12, 13, 14], np.int32)
  budgets = np.array([5, 6, 7, 8, 9], np.int32)
  per = FusedGenerator._deal(gen, tokens, lens, uids, budgets)
  assert [rows.tolist() for rows, *_ in per] == [[0, 3], [1, 4], [2]]
  rows, tok, ln, uid, bud = per[2]
  np.testing.assert_array_equal(tok, [[7, 8, 9], [0, 0, 0]])
  np.testing.assert_array_equal(ln, [1, 1])
  np.testing.assert_array_equal(uid, [12, 0])
  np.testing.assert_array_equal(bud, [7, 0])
  np.testing.assert_array_equal(per[0][4], [5, 8])


# FusedGenerator.load_rt_state --------------------------------------------------------------------

def test_a_restored_length_histogram_drops_the_cached_rt_choice():
  """A resumed run chooses Rt from the lengths it restored: the Rt cached from the lengths seen
  before the restore must go, or "auto" kept it until the restored histogram grew by 25 %."""
  gen = types.SimpleNamespace(lengths=fused.LengthHistogram(T), _rt_cache=None)
  saved = fused.LengthHistogram(T)
  saved.add([3, 3, 9])
  gen._rt_cache = (100, "a choice made from other lengths")
  FusedGenerator.load_rt_state(gen, {"lengths": saved.to_dict()})
  assert gen._rt_cache is None
  np.testing.assert_array_equal(gen.lengths.counts, saved.counts)
  assert FusedGenerator.rt_state(gen) == {"lengths": {"bins": [3, 9], "counts": [2, 1]}}


def test_a_restored_run_keeps_the_rt_choice_it_had_cached():
  """The cached choice and the histogram total it was made at go into the checkpoint (through
  JSON), so a resumed run re-simulates Rt when the uninterrupted one would, not at once."""
  import json
  from rlhfuse_jax.policy.rt import RtChoice
  gen = types.SimpleNamespace(lengths=fused.LengthHistogram(T), _rt_cache=None)
  gen.lengths.add([3, 3, 9, 5])
  choice = RtChoice(0.2, "simulated", {0.0: 1.5, 0.2: 1.25})
  gen._rt_cache = (4, choice)
  state = json.loads(json.dumps(FusedGenerator.rt_state(gen)))
  back = types.SimpleNamespace(lengths=fused.LengthHistogram(T), _rt_cache=None)
  FusedGenerator.load_rt_state(back, state)
  assert back._rt_cache == (4, choice)
  np.testing.assert_array_equal(back.lengths.counts, gen.lengths.counts)


# SlotTable ---------------------------------------------------------------------------------------

def test_each_finished_sample_takes_the_stop_reason_of_its_own_slot():
  """The fused tests decode without EOS (every stop is max-tokens), so a stop reason read from
  the wrong slot went unseen."""
  table = fused.SlotTable(num_instances=1, slots=3, batch_size=3, max_new_tokens=2, pad_id=0)
  table.deal(0, np.array([2, 0, 1]))  # sample 2 in slot 0, sample 0 in slot 1, ...
  newly = table.observe(0, np.array([1, 1, 1]), np.array([1, 2, 2]))
  stop = np.array([engine.STOP_EOS, engine.STOP_MAX_TOKENS, engine.STOP_EOS])
  table.finish(newly, stop, np.zeros((3, 2), np.int32), np.zeros((3, 2), np.float32))
  np.testing.assert_array_equal(table.stop, [engine.STOP_MAX_TOKENS, engine.STOP_EOS,
                                             engine.STOP_EOS])
  np.testing.assert_array_equal(table.n_gen, [2, 2, 1])


# _Run.consolidate --------------------------------------------------------------------------------

def test_the_plan_sees_each_samples_kv_tokens_and_the_tokens_it_may_still_add(ref_only,
                                                                             monkeypatch):
  """The policy gets length = prompt + generated - 1 (the newest token is not in the cache yet)
  and remaining = max_new_tokens - generated, at the sample's own slot: after prefill (1 token)
  6 and 15, after two more chunks of 3 (7 tokens) 12 and 9."""
  gen, actor, params = ref_only
  seen = []
  plan = fused.policy.plan_consolidation

  def spy(states, *args, **kw):
    seen.append({s.uid: (st.index, s.slot, s.length, s.remaining)
                 for st in states for s in st.samples})
    return plan(states, *args, **kw)
  monkeypatch.setattr(fused.policy, "plan_consolidation", spy)
  tokens, lens, budgets = two_tails_batch()
  out = like(gen, actor, params, max_consolidations=2).run(
      actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=0.5)
  assert [c["step"] for c in out.consolidations] == [0, 6]
  assert seen[0] == {b: (b % 4, b // 4, P + 1 - 1, T - 1) for b in range(8)}
  kept = out.consolidations[0]["kept"]
  assert sorted(seen[-1]) == [0, 1, 2, 3]  # the plan at step 6 (step 3 fitted nothing)
  for b, (i, slot, length, remaining) in seen[-1].items():
    assert i in kept and (length, remaining) == (P + 7 - 1, T - 7)
  # Two samples per kept instance, in distinct slots (where the first migration put them).
  assert len({(i, slot) for i, slot, _, _ in seen[-1].values()}) == 4


def test_a_migration_copies_whole_rows_padded_to_their_bucket_and_none_across_hosts(ref_only):
  """copied_bytes counts each (source, target) group's rows padded to a bucket (1, 4) times the
  bytes of one DecodeState row: the KV cache's max_len positions (K and V), 7 int32 scalars and
  a bool, and the tokens and log-probs of max_new_tokens. Plan: 8 -> 2 instances moving 2 rows
  from each of 2 instances (2 buckets of 4), then 4 -> 1 moving 2 rows (1 bucket of 4). One
  process: nothing counts as cross-host."""
  gen, actor, params = ref_only
  head_dim = CFG.hidden_size // CFG.num_heads
  kv = 2 * CFG.num_layers * (P + T) * CFG.num_kv_heads * head_dim * 4
  row = kv + 7 * 4 + 1 + 2 * T * 4
  assert gen.row_bytes == row
  tokens, lens, budgets = two_tails_batch()
  out = like(gen, actor, params, max_consolidations=2).run(
      actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=0.5)
  assert [c["moves"] for c in out.consolidations] == [4, 2]
  assert [c["copied_bytes"] for c in out.consolidations] == [8 * row, 4 * row]
  # The unfinished samples each kept instance holds afterwards (the released ones hold none).
  assert [c["occupancy"] for c in out.consolidations] == [{0: 4, 1: 4}, {0: 4}]
  m = out.metrics
  assert m["gen/migration_copied_bytes"] == 12 * row
  assert m["gen/consolidation_step"] == 0  # the first consolidation's, not the last one's
  assert m["gen/migrated_samples_cross_host"] == m["gen/migration_cross_host_bytes"] == 0
  assert all(c["cross_host_moves"] == 0 for c in out.consolidations)


# _Run._execute: freeing instances for inference ---------------------------------------------------

def test_an_instance_done_in_the_consolidation_round_is_freed_for_inference_at_once(ref_only):
  """Instance 3's samples all finish at prefill, the round that also consolidates the 3 tails
  into one instance: it joins the released instances in loading the frozen models while the
  tail decodes, not after generation (the consolidation's list used to replace the idle one)."""
  gen, actor, params = ref_only
  tokens, lens, _ = batch(16, 0)
  budgets = np.ones(16, np.int32)
  budgets[:3] = T  # tails on instances 0, 1, 2; instance 3 holds samples 3, 7, 11, 15
  out = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=0.5)
  c = out.consolidations[0]
  assert c["step"] == 0 and len(c["kept"]) == 1 and 3 not in c["kept"] + c["released"]
  tl = out.timeline
  for i in c["released"] + [3]:
    assert min(s for s, _ in tl.tagged[f"load_requested/{i}"]) < tl.gen_end_s, i


def test_freed_instances_score_full_micro_batches_while_the_tail_decodes(ref_only, monkeypatch):
  """With the loads waited for (so the test does not hang on the loader thread's timing), the
  finished samples are scored during generation: micro-batches exist before the drain."""
  gen, actor, params = ref_only
  monkeypatch.setattr(fused.InferenceQueue, "loaded",
                      lambda self: [i for i, f in self.loads.items() if f.result() is not None])
  before_drain = []
  drain = fused.InferenceQueue.drain

  def spy(self):
    before_drain.append([(i, len(take)) for i, take, _ in self.batches])
    return drain(self)
  monkeypatch.setattr(fused.InferenceQueue, "drain", spy)
  tokens, lens, budgets = batch(16, 0)
  out = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=1.0)
  assert out.metrics["gen/migrated_samples"] > 0
  assert before_drain[0] and all(n == MB for _, n in before_drain[0])


def test_weight_load_metrics_sum_every_instance_that_loaded_the_frozen_models(ref_only):
  """fusion/weight_load_bytes: the reference model's bytes once per instance that loaded it
  (not the first instance's only); fusion/weight_load_s: the load segments' seconds summed over
  instances (one load each), not the inference segments'."""
  gen, actor, params = ref_only
  tokens, lens, budgets = batch(16, 0)
  out = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=1.0)
  loads = [(i, end - start) for i, start, end, kind in out.timeline.segments if kind == "load"]
  loaded = {i for i, _ in loads}
  assert len(loaded) == len(loads) >= 2
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(params["reference"]))
  m = out.metrics
  assert m["fusion/weight_load_bytes"] == len(loaded) * model_bytes
  assert m["fusion/weight_load_s"] == pytest.approx(sum(s for _, s in loads))


# _Run._output ------------------------------------------------------------------------------------

def test_a_batch_filling_neither_slots_nor_micro_batches_equals_the_full_batch(ref_only):
  """14 samples on 4 x 4 slots: two slots stay empty and the last inference micro-batch holds
  2 samples and 2 padding rows. Each sample's tokens and reference log-probs equal those of the
  same sample (prompt, uid) in the full batch of 16; a partial micro-batch's results were
  once taken from its end (the padding)."""
  gen, actor, params = ref_only
  tokens, lens, budgets = batch(16, 0)
  full = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=False)
  short = like(gen, actor, params, batch_size=14)
  for fuse in (False, True):
    out = short.run(actor, params, tokens[:14], lens[:14], KEY, budgets=budgets[:14],
                    fuse=fuse, rt=0.5 if fuse else None)
    for f in ("response_tokens", "response_lens", "logprobs", "stop_reason"):
      np.testing.assert_array_equal(getattr(out.rollout, f), getattr(full.rollout, f)[:14])
    np.testing.assert_array_equal(out.ref_logp, full.ref_logp[:14])


def test_the_rollout_counts_decode_steps_and_rounds(ref_only):
  """decode_steps = the longest response - 1 (the first token comes from prefill), as the
  baseline Generator reports; decode_chunks = the decode rounds; the timings add up."""
  gen, actor, params = ref_only
  tokens, lens, budgets = batch(16, 0)
  for fuse in (False, True):
    out = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=fuse,
                  rt=1.0 if fuse else None)
    r, m = out.rollout, out.metrics
    assert r.decode_steps == T - 1 == int(budgets.max()) - 1
    # Chunks of 3 steps: the tail needs T - 1 = 15 steps, 5 rounds.
    assert r.decode_chunks == m["gen/decode_rounds"] == -(-(T - 1) // 3)
    assert r.generate_s == pytest.approx(m["timing_s/generate"])
    # prefill_s ends at the first read of the summaries (the curve's second point), not at
    # the last round's.
    curve = out.timeline.unfinished_curve
    assert 0 < r.prefill_s <= curve[1][0] < curve[2][0] and r.decode_s > 0
    assert m["timing_s/inference"] == pytest.approx(m["timing_s/gen_plus_inf"] -
                                                    m["timing_s/generate"])
    if not fuse:  # nothing consolidated: step -1 (step 0 is a consolidation right after prefill)
      assert (m["gen/consolidation_step"], m["gen/consolidated_from"],
              m["gen/consolidated_to"], m["gen/migrated_samples"]) == (-1, 0, 0, 0)


# engine.decode_chunk -----------------------------------------------------------------------------

_TINY = llama.ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=1, max_seq_len=32)


@pytest.mark.parametrize("chunk_size, steps_per_check, budget, expected",
                         [(8, 1, 3, 2), (2, 2, 4, 2)])
def test_a_decode_chunk_runs_only_the_steps_its_rows_need(chunk_size, steps_per_check, budget,
                                                          expected, monkeypatch):
  """Row 0 is done at prefill (budget 1). Budget 3: row 1 needs 2 more steps, and a chunk of 8
  single steps stops after them (it ran all 8 without the all-done exit: outputs unchanged,
  decode time wasted). Budget 4 with a chunk of 2 steps in groups of 2: one group, 2 steps
  (counting the loop by 1 per group ran a second group)."""
  steps = []
  real = engine.decode_step

  def counting(*args):
    jax.debug.callback(lambda: steps.append(1))
    return real(*args)
  monkeypatch.setattr(engine, "decode_step", counting)
  sampling = SamplingConfig(max_new_tokens=4, chunk_size=chunk_size,
                            steps_per_check=steps_per_check, greedy=True)
  params = llama.host_random_params(_TINY, 0)
  st = engine.prefill(_TINY, params, jnp.array([[3, 4], [5, 0]], jnp.int32),
                      jnp.array([2, 1], jnp.int32), jnp.arange(2), jax.random.key(0), sampling,
                      max_len=8, budget=jnp.array([1, budget], jnp.int32))
  st = engine.decode_chunk(_TINY, params, st, jax.random.key(0), sampling)
  jax.effects_barrier()
  assert len(steps) == expected
  np.testing.assert_array_equal(st.num_generated, [1, 1 + expected])


@pytest.mark.parametrize("remaining, expected", [(-2, 2), (0, 2), (1, 2), (3, 4), (9, 6)])
def test_a_chunk_runs_at_least_one_group_of_steps_and_at_most_chunk_size(remaining, expected):
  """chunk_steps: the steps the longest row still needs, rounded up to whole groups of
  steps_per_check, at most chunk_size, and never 0: a chunk asked for with nothing left to
  decode still runs one group (the done test ends it), never a chunk that decodes nothing."""
  sampling = SamplingConfig(max_new_tokens=16, chunk_size=6, steps_per_check=2)
  assert engine.chunk_steps(sampling, remaining) == expected


# instances.check_model / check_prompts ----------------------------------------------------------

def test_a_context_of_exactly_max_seq_len_fits_and_one_more_does_not():
  sampling = SamplingConfig(max_new_tokens=T)
  cfg = CFG.replace(max_seq_len=P + T)
  assert instances.check_model(cfg, sampling, P) == P + T  # the KV cache's positions
  with pytest.raises(ValueError, match="context too long"):
    instances.check_model(cfg, sampling, P + 1)


def test_a_prompt_length_past_the_tokens_given_is_refused_even_within_the_bucket():
  """Tokens [1, 2] with length 3 in a bucket of 4: the third token does not exist (it would be
  the pad id, read as a prompt token)."""
  sampling = SamplingConfig(max_new_tokens=2)
  with pytest.raises(ValueError, match=r"prompt_lens must be in \[1, 2\]"):
    instances.check_prompts(1, 4, sampling, [[1, 2]], [3])
  tokens = instances.check_prompts(1, 4, sampling, [[1, 2]], [2])[0]
  np.testing.assert_array_equal(tokens, [[1, 2, sampling.pad_id, sampling.pad_id]])


# GenerationInstance.bucket -----------------------------------------------------------------------

def test_migrated_rows_pad_to_the_smallest_bucket_that_holds_them():
  """1 row copies 1 row, 2-4 rows a bucket of 4, S = 16 rows the bucket of 16 (a full instance
  moving, which `b > n` refused), and more than S is refused."""
  inst = types.SimpleNamespace(buckets=instances.migration_buckets(16))
  assert inst.buckets == (1, 4, 16)
  assert [instances.GenerationInstance.bucket(inst, n) for n in (1, 2, 4, 5, 16)] == [
      1, 4, 4, 16, 16]
  with pytest.raises(ValueError, match="17 rows exceed the largest migration bucket 16"):
    instances.GenerationInstance.bucket(inst, 17)


# InferenceQueue ----------------------------------------------------------------------------------

class _Out:
  def __init__(self, ready):
    self.ready = ready

  def is_ready(self):
    return self.ready


def _queue(num_instances, loaded, inflight=0, mb=2):
  """An InferenceQueue over a stand-in generator; instances in `loaded` have their weights;
  `_score` returns a result still running."""
  gen = types.SimpleNamespace(
      config=types.SimpleNamespace(num_instances=num_instances, micro_batch=mb, inference_pp=1),
      exchange=types.SimpleNamespace(multi=False), inflight=inflight, is_local=lambda i: True,
      owner=np.zeros(num_instances, np.int64))
  q = fused.InferenceQueue(gen, {}, None, None, None, None)
  q.freed = list(loaded)  # (the engine frees an instance before it loads)
  for i in loaded:
    f = concurrent.futures.Future()
    f.set_result({})
    q.loads[i] = f
  q._score = lambda i, take: {"m": _Out(False)}
  return q


def _assigned(q):
  return [(i, list(take)) for i, take, _ in q.batches]


def test_streaming_balances_full_micro_batches_over_loaded_instances_two_each():
  q = _queue(3, loaded=[0, 1])
  try:
    q.add(list(range(11)))
    q.stream()
    # Least running first, then least dispatched, then index; at most PER_INSTANCE_QUEUE (2)
    # running on an instance; instance 2 has no weights yet.
    assert fused.PER_INSTANCE_QUEUE == 2
    assert _assigned(q) == [(0, [0, 1]), (1, [2, 3]), (0, [4, 5]), (1, [6, 7])]
    assert q.waiting == [8, 9, 10] and q.dispatched.tolist() == [2, 2, 0]
  finally:
    q.close()


def test_streaming_leaves_a_partial_micro_batch_waiting():
  q = _queue(2, loaded=[0, 1])
  try:
    q.add([5, 6, 7])
    q.stream()
    assert _assigned(q) == [(0, [5, 6])] and q.waiting == [7]
  finally:
    q.close()


def test_streaming_counts_only_the_micro_batches_still_running():
  """Instance 0 has completed two micro-batches: it has room again (behind instance 1, which
  was dispatched fewer)."""
  q = _queue(2, loaded=[0, 1])
  try:
    q.batches = [[0, [90, 91], {"m": _Out(True)}], [0, [92, 93], {"m": _Out(True)}]]
    q.dispatched[0] = 2
    q.add([0, 1, 2, 3])
    q.stream()
    assert _assigned(q)[2:] == [(1, [0, 1]), (0, [2, 3])]
  finally:
    q.close()


def test_streaming_respects_the_inflight_cap():
  q = _queue(2, loaded=[0, 1], inflight=1)
  try:
    q.add(list(range(6)))
    q.stream()
    assert _assigned(q) == [(0, [0, 1])]
  finally:
    q.close()


def test_drain_spreads_the_rest_over_freed_then_least_loaded_instances():
  """After generation: instance 2 (freed) first, then the least dispatched (1 and 3 before 0),
  and only the instances that get a micro-batch load weights."""
  q = _queue(4, loaded=[])
  freed = []
  try:
    q.freed, q.dispatched[:] = [2], [1, 0, 0, 0]
    q.free = freed.append
    q.pump = lambda block: None
    q.add(list(range(5)))
    q.drain()
    assert freed == [1, 3]  # (2 was freed before: its load is under way; 0 gets none)
    assert _assigned(q) == [(2, [0, 1]), (1, [2, 3]), (3, [4])]
  finally:
    q.close()


# ------------------------------------------------------------------ follow-up audit of the engine

def test_prefill_draws_each_rows_first_token_from_its_own_uid_stream():
  """The first response token of sample u is drawn with sample_keys(key, u, 0), as every later
  token is with (u, t): rows with one prompt but distinct uids draw independently. Drawing all
  first tokens from uid 0's stream would make them identical."""
  cfg = CFG  # 1 layer, 32 ids
  prm = jax.tree_util.tree_map(jnp.asarray, llama.host_random_params(cfg, 0))
  sc = SamplingConfig(max_new_tokens=4)
  s, key = 16, jax.random.key(3)
  tokens = np.tile(np.array([[3, 5, 7]], np.int32), (s, 1))
  lens, uids = np.full(s, 3, np.int32), np.arange(10, 10 + s, dtype=np.int32)
  st = jax.jit(engine.prefill, static_argnums=(0, 6, 7))(cfg, prm, tokens, lens, uids, key,
                                                         sc, 8)
  logits = llama.apply(cfg, prm, jnp.asarray(tokens))[0][:, 2]  # every row: the same logits
  keys = sample_keys(key, uids, np.zeros(s, np.int32))
  want, _ = sample_token(logits, keys, sc)
  first = np.asarray(st.tokens[:, 0])
  np.testing.assert_array_equal(first, np.asarray(want))
  assert len(set(first.tolist())) > 1, first


def test_decode_state_splits_kv_heads_over_tensor_only_where_it_divides_them():
  """2 KV heads over 4 tensor devices cannot be split evenly: the cache is replicated over
  `tensor` there (as the attention weights are), and split over 2."""
  cfg = dataclasses.replace(CFG, num_kv_heads=2)  # what CFG has; the test depends on it
  for tp, kv_axis in ((4, None), (2, "tensor")):
    mesh = instances.split_devices(jax.devices(), 1, tp)[0]
    sh = engine.state_shardings(cfg, mesh)
    assert tuple(sh.cache.k.spec)[3] == kv_axis and tuple(sh.cache.v.spec)[3] == kv_axis, tp


def test_check_prompts_rejects_a_budget_past_max_new_tokens():
  """A budget above max_new_tokens is an error, not silently clipped (prefill's clip would give
  the sample fewer tokens than asked); max_new_tokens itself is accepted."""
  sc = SamplingConfig(max_new_tokens=5)
  tokens, lens = np.ones((2, 3), np.int32), np.array([3, 2], np.int32)
  out = instances.check_prompts(2, 3, sc, tokens, lens, budgets=[5, 1])
  np.testing.assert_array_equal(out[3], [5, 1])
  with pytest.raises(ValueError, match="budgets"):
    instances.check_prompts(2, 3, sc, tokens, lens, budgets=[6, 1])


def test_the_slot_summary_carries_each_rows_own_stop_reason():
  """The [3, S] summary the host reads after a chunk is (done, num_generated, stop_reason) of
  every slot: the fused rollout's stop reasons are taken from its third row."""
  st = types.SimpleNamespace(done=jnp.array([True, True, False]),
                             num_generated=jnp.array([3, 5, 1], jnp.int32),
                             stop_reason=jnp.array([engine.STOP_EOS, engine.STOP_MAX_TOKENS,
                                                    engine.STOP_RUNNING], jnp.int32))
  np.testing.assert_array_equal(np.asarray(instances._summary(st)),
                                [[1, 1, 0], [3, 5, 1], [1, 2, 0]])


def test_check_prompts_overwrites_whatever_lies_behind_each_prompt_with_pad_id():
  """Ids behind a row's length are never checked against the vocabulary: they must become
  pad_id (written into the KV cache, an id outside the vocabulary would embed as NaN)."""
  sc = SamplingConfig(max_new_tokens=4, pad_id=2)
  tokens = np.array([[5, 99, -7], [6, 7, 8]], np.int32)
  out = instances.check_prompts(2, 4, sc, tokens, [1, 3], vocab_size=32)[0]
  np.testing.assert_array_equal(out, [[5, 2, 2, 2], [6, 7, 8, 2]])
