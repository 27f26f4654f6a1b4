"""Inter-stage fusion engine: identical outputs with and without consolidation (instances of 1
and of 2 devices, Rt fixed or "auto", one or two consolidations), migrated KV rows equal the
source rows, capacity limits, streamed inference equals inference after generation, the Rt
choice, and clear errors."""
import dataclasses
import threading
import types
import weakref

import jax
import numpy as np
import pytest

from rlhfuse_jax.generation import fused, instances, measure
from rlhfuse_jax.generation.fused import FusedGenConfig, FusedGenerator
from rlhfuse_jax.generation.instances import FrozenModels
from rlhfuse_jax.generation.timeline import Timeline, combined_figures
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.inference.scoring import Scorer, ScoringBatch
from rlhfuse_jax.models import llama
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.policy import rt as rt_choice
from rlhfuse_jax.policy.lengths import LengthHistogram
from rlhfuse_jax.sim import rt_model
from rlhfuse_jax.sim.generation_sim import GenSetup
from rlhfuse_jax.sim.shapes import from_model_config
from rlhfuse_jax.trainer.rt_auto import sim_setup, simulated_rt_model

CFG = llama.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2, max_seq_len=64)
SCORE = CFG.replace(head="scalar")
P, T = 6, 16
KEY = jax.random.key(3)


def batch(b, seed):
  rng = np.random.default_rng(seed)
  lens = rng.integers(1, P + 1, b).astype(np.int32)
  tokens = rng.integers(1, CFG.vocab_size, (b, P)).astype(np.int32)
  tokens[np.arange(P)[None] >= lens[:, None]] = 0
  budgets = np.clip(np.rint(rng.lognormal(np.log(4), 1.0, b)), 1, T).astype(np.int32)
  budgets[0] = T  # one sample runs to the end: a tail
  return tokens, lens, budgets


def build(num_instances, slots, devices_per_instance, frozen, cfg=CFG, **kw):
  actor = llama.host_random_params(CFG, 0)
  params = {"reference": actor}
  if frozen.critic is not None:
    params["critic"] = llama.host_random_params(SCORE, 1)
  if frozen.reward is not None:
    params["reward"] = llama.host_random_params(SCORE, 2)
  sampling = SamplingConfig(temperature=1.0, max_new_tokens=T, chunk_size=3, eos_id=-1)
  config = FusedGenConfig(num_instances=num_instances, slots=slots,
                          instance_devices=devices_per_instance, migration_threshold=0.5, **kw)
  gen = FusedGenerator(cfg, sampling, config, batch_size=num_instances * slots, prompt_len=P,
                       frozen=frozen, actor_params=actor, frozen_params=params)
  return gen, actor, params


@pytest.fixture(scope="module")
def one_device():
  """4 instances of 1 device, 4 slots; reference, critic and reward model."""
  return build(4, 4, 1, FrozenModels(reference=CFG, critic=SCORE, reward=SCORE))


@pytest.fixture(scope="module")
def runs(one_device):
  gen, actor, params = one_device
  tokens, lens, budgets = batch(16, 0)
  base = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=False)
  with jax.transfer_guard("disallow"):  # no implicit copy may sneak into the loop
    early = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=1.0)
  late = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=0.25)
  return (tokens, lens, budgets), base, early, late


def assert_same_samples(a, b):
  for f in ("response_tokens", "response_lens", "logprobs", "stop_reason"):
    np.testing.assert_array_equal(getattr(a.rollout, f), getattr(b.rollout, f), err_msg=f)


def assert_same_outputs(a, b):
  """Bitwise: tokens, log-probs, lengths, stop reasons, reference, critic and reward."""
  assert_same_samples(a, b)
  for name in ("ref_logp", "values", "rewards"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def variant(gen, actor, params, rt_model=None, **fields):
  """A FusedGenerator like `gen` with other config fields, built by the real constructor but
  running `gen`'s executables (same devices, same shapes): compiling 4 instances again would
  cost ~20 s on 2 cores."""
  real = instances.compile_all
  instances.compile_all = lambda *args, **kw: None
  try:
    new = FusedGenerator(gen.cfg, gen.sampling, dataclasses.replace(gen.config, **fields),
                         batch_size=gen.batch_size, prompt_len=gen.prompt_len, frozen=gen.frozen,
                         actor_params=actor, frozen_params=params, rt_model=rt_model)
  finally:
    instances.compile_all = real
  for mine, theirs in zip(new.instances, gen.instances, strict=True):
    assert mine.devices == theirs.devices and mine.shape_class == theirs.shape_class
    mine._exe = theirs._exe
  return new


def test_identical_outputs_with_and_without_consolidation(runs):
  (_, _, budgets), base, early, late = runs
  np.testing.assert_array_equal(base.rollout.response_lens, budgets)  # each stops at its budget
  for out in (early, late):
    assert out.metrics["gen/migrated_samples"] > 0, out.no_migration
    assert_same_samples(base, out)  # bitwise: tokens and log-probs
    for name in ("ref_logp", "values", "rewards"):
      np.testing.assert_array_equal(getattr(base, name), getattr(out, name), err_msg=name)
  assert base.metrics["gen/migrated_samples"] == 0
  assert early.metrics["gen/consolidation_step"] < late.metrics["gen/consolidation_step"]
  # Fewer, fuller instances: fewer decode chunks in all (each chunk runs every slot).
  assert early.metrics["gen/instance_chunks"] < base.metrics["gen/instance_chunks"]
  assert late.metrics["gen/instance_chunks"] < base.metrics["gen/instance_chunks"]
  # What consolidation saved: each run's chunks without it are the baseline's own.
  for out in (base, early, late):
    assert out.metrics["gen/instance_chunks_unfused"] == base.metrics["gen/instance_chunks"]


def test_an_actor_given_as_a_callable_is_made_once_and_freed_once_placed(one_device, runs,
                                                                         monkeypatch):
  """run() takes the actor as a callable too (the trainer's FusedStage passes one): it is
  called once, as the actor is placed, and the copy it made is freed once placed. A pipelined
  trainer's gathered whole actor, passed as an argument, lived until run() returned: a second
  actor on every training device through the whole generation. Same samples as the arrays."""
  gen, actor, params = one_device
  (tokens, lens, budgets), base, _, _ = runs
  made, alive_at_inference = [], []

  def make():  # a copy for this call, on a device no instance uses (placing copies it)
    copy = jax.device_put(actor, jax.devices()[7])
    made.append(weakref.ref(jax.tree.leaves(copy)[0]))
    return copy
  load = fused.InferenceQueue._load

  def loading(self, i):  # an instance freed for inference: the generation has run
    alive_at_inference.append(made[-1]() is not None)
    return load(self, i)
  monkeypatch.setattr(fused.InferenceQueue, "_load", loading)
  out = gen.run(make, params, tokens, lens, KEY, budgets=budgets, fuse=False)
  assert len(made) == 1 and alive_at_inference and not any(alive_at_inference)
  assert_same_samples(out, base)


def test_metrics_and_timeline(one_device, runs):
  _, base, early, _ = runs
  for out in (base, early):
    tl = out.timeline
    curve = out.metrics["gen/unfinished_curve"]
    assert curve[0][1] == 16 and curve[-1][1] == 0
    assert all(a[1] >= b[1] and a[0] <= b[0] for a, b in zip(curve, curve[1:]))
    assert 0 < out.metrics["gen/instance_busy_frac"] <= 1
    assert 0 < tl.gen_end_s <= tl.gen_plus_inf_s
    kinds = {k for _, _, _, k in tl.segments}
    assert {"prefill", "decode", "load", "inference"} <= kinds
  assert base.metrics["fusion/inference_overlap_frac"] == 0.0  # inference after generation
  # ... so no instance is freed for it before generation ends; a consolidation frees (at least)
  # the instances it released, whose loads may or may not end within the tail (timing).
  assert base.metrics["fusion/freed_before_gen_end"] == 0
  assert base.metrics["fusion/loaded_before_gen_end"] == 0
  assert early.metrics["fusion/freed_before_gen_end"] >= len(early.consolidations[0]["released"])
  assert early.metrics["fusion/freed_before_gen_end"] >= (
      early.metrics["fusion/loaded_before_gen_end"])
  # The baseline too stops decoding an instance once its own samples have finished
  # (docs/architecture.md §2 said it decoded on all instances until the last sample).
  assert base.metrics["gen/instance_chunks"] < 4 * base.metrics["gen/decode_rounds"]
  assert "migrate" in {k for _, _, _, k in early.timeline.segments}
  c = early.consolidations[0]
  assert c["moved_bytes"] == early.metrics["gen/migrated_kv_bytes"] > 0
  # Rt = 1 consolidates at the first check, after k decode steps: the samples of the released
  # instances (sample b is dealt to instance b % 4) with more than k + 1 tokens to go move, each
  # with k + 1 response tokens of which the KV rows hold all but the newest (the next step
  # writes it): prompt + k positions.
  (_, lens, budgets), gen, k = runs[0], one_device[0], c["step"]
  moved = [b for b in range(16) if b % 4 in c["released"] and budgets[b] > k + 1]
  assert k > 0 and c["moves"] == len(moved)
  assert c["moved_bytes"] == sum(int(lens[b]) + k for b in moved) * gen.kv_bytes_per_token
  assert c["copied_bytes"] >= c["moved_bytes"]  # whole rows (and padding rows) are copied
  # A token's K and V of every layer, as a cache of the model holds them.
  assert gen.kv_bytes_per_token == llama.KVCache.zeros(CFG, 1, 1).nbytes_per_token()
  # The released instances stop decoding at the consolidation and are freed for streaming
  # inference at once: each loads the frozen models while the kept ones still generate.
  tl = early.timeline
  for i in c["released"]:
    assert all(s < c["time_s"] for j, s, _, kind in tl.segments if j == i and kind == "decode")
    # Asked for while the kept instances still generate (the load's own thread may start after
    # the tail ends on a loaded 2-core machine: its segment's start is not the test).
    assert any(s < tl.gen_end_s for s, _ in tl.tagged[f"load_requested/{i}"])
    assert any(j == i and kind == "load" for j, _, _, kind in tl.segments)


def test_capacity_limits_respected(one_device, runs):
  gen, actor, params = one_device
  for out in runs[1:]:
    for c in out.consolidations:
      # Each kept instance holds at most its slots; the fewest instances that fit were kept.
      assert all(n <= 4 for n in c["occupancy"].values())
      assert sum(c["occupancy"].values()) == c["unfinished"]
      assert len(c["kept"]) == -(-c["unfinished"] // 4)
  # Every sample runs to max_new_tokens: the 16 never fit in fewer than 4 instances of 4 slots.
  tokens, lens, _ = runs[0]
  full = gen.run(actor, params, tokens, lens, KEY, budgets=np.full(16, T), fuse=True, rt=1.0)
  assert full.metrics["gen/migrated_samples"] == 0
  assert any("do not fit in fewer than 4 instances" in r for r in full.no_migration)
  assert (full.rollout.response_lens == T).all()


def test_streamed_inference_equals_inference_after_generation(one_device, runs):
  gen, _, params = one_device
  _, _, early, _ = runs
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1), jax.devices()[:1])
  scorer = Scorer(mesh, micro_batch_size=4)  # an instance's micro-batch shape
  sb = ScoringBatch.from_rollout(early.rollout, pad_id=0)
  np.testing.assert_allclose(early.ref_logp, scorer.logprobs(CFG, params["reference"], sb),
                             atol=1e-6)
  np.testing.assert_allclose(early.values, scorer.values(SCORE, params["critic"], sb), atol=1e-6)
  np.testing.assert_allclose(early.rewards, scorer.reward_scores(SCORE, params["reward"], sb),
                             atol=1e-6)


def test_migrated_kv_rows_equal_source_rows(one_device):
  gen, actor, _ = one_device
  src, dst = gen.instances[0], gen.instances[1]
  tokens, lens, _ = batch(4, 1)
  uids = np.arange(4, dtype=np.int32)
  full = np.full(4, T, np.int32)
  st_src, _ = src.prefill(src.place(CFG, actor), tokens, lens, uids, full, KEY)
  st_src, _ = src.decode(src.place(CFG, actor), st_src, jax.device_put(KEY, src.rep))
  st_dst, _ = dst.prefill(dst.place(CFG, actor), tokens[::-1], lens[::-1], uids + 10, full, KEY)
  before = jax.device_get(st_dst)
  rows, n = src.gather(st_src, [2, 0])
  assert n == 2 and rows.budget.shape == (4,)  # padded to the bucket of 4
  moved = dst.receive(rows)
  assert moved.cache.k.sharding == dst.state_sharding.cache.k
  after = jax.device_get(dst.scatter(st_dst, [1, 3], moved))
  source = jax.device_get(st_src)
  flat = [jax.tree_util.tree_flatten_with_path(x)[0] for x in (after, source, before)]
  for (path, a), (_, s), (_, b) in zip(*flat, strict=True):
    ax = 1 if "cache" in jax.tree_util.keystr(path) else 0
    take = lambda x, i: np.take(x, i, axis=ax)
    np.testing.assert_array_equal(take(a, [1, 3]), take(s, [2, 0]))  # bitwise, KV included
    np.testing.assert_array_equal(take(a, [0, 2]), take(b, [0, 2]))  # other slots untouched


def test_auto_rt_outputs_identical_and_choice_recorded(one_device, runs):
  """migration_threshold="auto" with the trainer's simulated model: the first batch (no length
  seen yet) runs the prior Rt, the second the simulated choice, recorded in rt_choice (the
  candidate with the least simulated time, every candidate simulated) and in fusion/rt. Both
  give the unfused run's outputs bitwise; the second consolidates (every candidate does on
  this batch; the prior Rt, 0.2, does not: the last 4 samples end in the same chunk)."""
  gen, actor, params = one_device
  (tokens, lens, budgets), base, _, _ = runs
  candidates = (0.25, 0.5, 1.0)  # all consolidate on this batch, whichever the timing picks
  auto = variant(gen, actor, params, rt_model=simulated_rt_model, migration_threshold="auto",
                 rt_candidates=candidates)
  assert auto.fixed_rt is None
  first = auto.run(actor, params, tokens, lens, KEY, budgets=budgets)
  assert auto.calibration is not None  # costs measured once, on the engine's executables
  assert first.rt_choice.rt == first.rt == rt_choice.PRIOR_RT == first.metrics["fusion/rt"]
  assert first.rt_choice.simulated_s == {}
  second = auto.run(actor, params, tokens, lens, KEY, budgets=budgets)
  choice = second.rt_choice
  assert set(choice.simulated_s) == set(candidates)
  assert choice.rt == min(candidates, key=lambda r: (choice.simulated_s[r], r))
  assert second.rt == choice.rt == second.metrics["fusion/rt"]
  assert second.metrics["gen/migrated_samples"] > 0, second.no_migration
  for out in (first, second):
    assert_same_outputs(base, out)
  # rt="auto" for one batch of a generator whose config fixes Rt: the simulated choice too
  # (it was resolved to None and failed with a TypeError in the consolidation gate).
  fixed = variant(gen, actor, params, rt_model=simulated_rt_model, migration_threshold=0.5,
                  rt_candidates=candidates)
  fixed.calibration, fixed.lengths = auto.calibration, auto.lengths
  forced = fixed.run(actor, params, tokens, lens, KEY, budgets=budgets, rt="auto")
  assert forced.rt_choice is not None and forced.rt == forced.rt_choice.rt in candidates
  assert_same_outputs(base, forced)


def test_auto_rt_without_consolidations_neither_measures_nor_simulates(one_device, runs,
                                                                      monkeypatch):
  """max_consolidations=0 consolidates nothing, whatever Rt: "auto" still measured the
  instances' costs (seconds to minutes on a real model) and simulated every candidate on each
  batch, for a threshold nothing read. Now neither runs; the outputs stay the unfused run's."""
  gen, actor, params = one_device
  (tokens, lens, budgets), base, _, _ = runs
  ran = []
  monkeypatch.setattr(fused.measure, "measure_costs", lambda *a: ran.append("measure"))
  auto = variant(gen, actor, params, rt_model=lambda *a: ran.append("simulate"),
                 migration_threshold="auto", max_consolidations=0)
  for _ in range(2):
    out = auto.run(actor, params, tokens, lens, KEY, budgets=budgets)
    assert out.rt == out.rt_choice.rt == rt_choice.PRIOR_RT
    assert "max_consolidations=0" in out.rt_choice.reason
    assert out.metrics["gen/migrated_samples"] == 0
    assert_same_outputs(base, out)
  assert ran == [] and auto.calibration is None
  # A fixed Rt is kept as given; a per-batch rt="auto" is not simulated either.
  fixed = variant(gen, actor, params, rt_model=lambda *a: ran.append("simulate"),
                  migration_threshold=0.5, max_consolidations=0)
  assert fixed.run(actor, params, tokens, lens, KEY, budgets=budgets).rt == 0.5
  assert fixed.run(actor, params, tokens, lens, KEY, budgets=budgets,
                   rt="auto").rt == rt_choice.PRIOR_RT
  assert ran == []


def test_a_failed_batch_leaves_no_thread(one_device, runs, monkeypatch):
  """A batch that raises (here: in its consolidation) stops its activity watchers and the
  inference loader too: each failed batch used to leave one waiting thread per instance."""
  gen, actor, params = one_device
  (tokens, lens, budgets), _, _, _ = runs

  def fail(self, step):
    raise RuntimeError("consolidation failed (test)")
  monkeypatch.setattr(fused._Run, "consolidate", fail)
  before = threading.active_count()
  for _ in range(2):
    with pytest.raises(RuntimeError, match="consolidation failed"):
      gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=1.0)
  assert threading.active_count() == before


def test_a_decode_round_reads_the_instances_in_one_call_and_their_finished_rows_in_another(
    one_device, runs, monkeypatch):
  """The host's read after each decode round: every instance's summary in one device_get, and
  the rows of all instances with newly finished samples in one more. One device_get per
  instance (and per instance with finished rows) waited for each copy before starting the
  next. Outputs stay bitwise those of the run before."""
  gen, actor, params = one_device
  (tokens, lens, budgets), _, early, _ = runs
  calls, rounds, real_get, real_read = [], [], jax.device_get, fused._Run.read

  def get(tree):
    calls.append(tree)
    return real_get(tree)

  def read(self, ran, summaries):
    before = len(calls)
    real_read(self, ran, summaries)
    rounds.append((len(ran), len(calls) - before))
  monkeypatch.setattr(jax, "device_get", get)
  monkeypatch.setattr(fused._Run, "read", read)
  out = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=1.0)
  assert_same_outputs(out, early)
  assert rounds[0][0] == gen.config.num_instances > 1  # the prefill round: all 4 instances
  assert all(1 <= n <= 2 for _, n in rounds), rounds
  assert any(n == 2 for _, n in rounds), rounds  # some round fetched finished rows


def test_no_actor_copy_outlives_generation(one_device, runs, monkeypatch):
  """Once the instances stop decoding, their actor copies are gone before inference drains:
  the freed instances score with the frozen models only (what the planner's memory check
  counts). The run used to keep every copy to the end of the batch."""
  import gc
  import weakref
  gen, actor, params = one_device
  (tokens, lens, budgets), _, _, _ = runs
  copies, alive = [], []
  place = FusedGenerator.place_actor

  def recording_place(self, p):
    out = place(self, p)
    copies.extend(weakref.ref(x) for i in self.local for x in jax.tree.leaves(out[i]))
    return out
  drain = fused.InferenceQueue.drain

  def checking_drain(self):
    gc.collect()
    alive.append(sum(r() is not None for r in copies))
    return drain(self)
  monkeypatch.setattr(FusedGenerator, "place_actor", recording_place)
  monkeypatch.setattr(fused.InferenceQueue, "drain", checking_drain)
  gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=0.5)
  assert len(copies) == 4 * len(jax.tree.leaves(actor)) and alive == [0]


def test_a_micro_batch_puts_its_tokens_and_lengths_once_for_all_models(one_device, runs,
                                                                         monkeypatch):
  """Streaming inference copies a micro-batch's tokens, prompt lengths and response lengths
  onto its instance once each, shared by the reference, critic and reward models (each model
  put its own copies: 7 per micro-batch, not 3), and scores exactly as before."""
  gen, actor, params = one_device
  (tokens, lens, budgets), _, _, late = runs
  main, inside, puts, scores = threading.get_ident(), [], [], []
  put, score = mesh_lib.put, fused.InferenceQueue._score

  def counting_put(tree, shardings):
    if inside and threading.get_ident() == main:  # (not the loader thread's weights)
      puts.append(np.shape(tree))
    return put(tree, shardings)

  def counting_score(self, i, take):
    inside.append(i)
    try:
      return score(self, i, take)
    finally:
      inside.pop()
      scores.append(i)
  monkeypatch.setattr(mesh_lib, "put", counting_put)
  monkeypatch.setattr(fused.InferenceQueue, "_score", counting_score)
  out = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=0.25)
  assert_same_outputs(out, late)
  mb = gen.config.micro_batch
  assert scores and sorted(puts) == sorted([(mb,), (mb,), (mb, P + T)] * len(scores))


def test_prompt_ids_outside_the_vocabulary_are_refused(one_device):
  gen, actor, params = one_device
  tokens, lens, budgets = batch(16, 0)
  tokens[3, 0] = CFG.vocab_size  # embeds as NaN: the row would decode garbage silently
  with pytest.raises(ValueError, match=r"prompt_tokens\[3, 0\] = 32 is not a token id of "
                                       r"this model \(vocab_size 32"):
    gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=False)
  tokens[3, 0], tokens[5, P - 1], lens[5] = 1, -1, P - 1  # padding is not checked
  gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=False)
  # A model the generator scores with, missing: a bare KeyError after the batch had decoded.
  with pytest.raises(ValueError, match=r"frozen_params lacks \['critic'\]: the generator "
                                       r"scores with \['critic', 'reference', 'reward'\]"):
    gen.run(actor, {k: v for k, v in params.items() if k != "critic"}, tokens, lens, KEY,
            budgets=budgets, fuse=False)


def test_timeline_metrics_average_over_the_watched_instances():
  """On several processes each watches its own instances: instance 1 here is another
  process's, so it has no segments and must not count as idle."""
  segments = [(0, 0.0, 1.0, "decode"), (0, 1.0, 2.0, "inference")]
  mine = Timeline(num_instances=2, segments=segments, unfinished_curve=[], consolidations=[],
                  gen_end_s=1.5, gen_plus_inf_s=2.0, observed=(0,))
  assert mine.instance_busy_frac == 1.0
  assert mine.inference_overlap_frac == 0.5
  everyone = dataclasses.replace(mine, observed=None)
  assert everyone.instance_busy_frac == 0.5  # one process holding both: the other idles


def test_a_batch_without_inference_models_gives_no_reason_for_its_overlap(one_device, runs):
  """A batch that runs no inference model (GRPO with kl_coef 0 and a verifier: no reference,
  critic or reward model; a validation pass's rewards_only with a verifier) frees no instance
  for inference, by design: its consolidation released instances all the same. The progress
  line said "inference overlap 0% (no instance freed before generation ended)", a cause that
  was false; the two counts behind a reason are left out, and so is the reason."""
  from rlhfuse_jax.trainer.rollout import progress_summary
  gen, actor, params = one_device
  (tokens, lens, budgets), _, early, _ = runs
  out = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=1.0, models=[])
  assert_same_samples(out, early)
  assert out.consolidations and out.consolidations[0]["released"]
  assert out.metrics["fusion/inference_overlap_frac"] == 0.0
  assert "fusion/freed_before_gen_end" not in out.metrics
  assert "fusion/loaded_before_gen_end" not in out.metrics
  assert progress_summary(out.metrics).endswith(", inference overlap 0%"), (
      progress_summary(out.metrics))
  # With the models, the counts are there (test_metrics_and_timeline checks their values).
  assert {"fusion/freed_before_gen_end", "fusion/loaded_before_gen_end"} <= early.metrics.keys()


def test_instances_loaded_before_generation_ended_count_only_loads_that_ended_in_time():
  """The count behind a 0 % overlap's reason on the progress line: an instance whose weights
  came in after the tail ended (2 here) could not score during it, nor could another process's
  (3, not watched) or one that never loaded (0)."""
  segments = [(0, 0.0, 1.0, "decode"), (1, 0.5, 0.8, "load"), (1, 0.8, 1.2, "inference"),
              (2, 0.6, 1.1, "load"), (2, 1.1, 1.3, "inference"), (3, 0.5, 0.6, "load")]
  tl = Timeline(num_instances=4, segments=segments, unfinished_curve=[], consolidations=[],
                gen_end_s=1.0, gen_plus_inf_s=1.3, observed=(0, 1, 2))
  assert tl.loaded_before_gen_end == 1
  late = dataclasses.replace(tl, gen_end_s=0.7)  # every load still running when the tail ended
  assert late.loaded_before_gen_end == 0 and late.inference_overlap_frac == 0.0
  assert dataclasses.replace(tl, gen_end_s=1.2).loaded_before_gen_end == 2


def two_processes(p0: Timeline, p1: Timeline, load_bytes: dict, place_s: dict, sent: list):
  """(process, rows) of each of 2 processes' `fused.figures_over_processes`, the all-gather
  faked with the other's row sent as the real one is (padded, as int32 words); `sent`
  collects the dtypes each process sent."""
  from rlhfuse_jax.generation import multihost
  timelines = (p0, p1)
  for me in (0, 1):
    ex = multihost.Exchange(timeout_s=60)
    ex.count, ex.me = 2, me
    other = 1 - me

    def gather(x, other=other):
      sent.append(x.dtype)
      row = timelines[other].process_figures(load_bytes[other], place_s[other])
      padded = np.zeros(x.size // 2, np.float64)
      padded[:len(row)] = row
      theirs = np.frombuffer(padded.tobytes(), np.int32)
      return np.stack([x, theirs] if other == 1 else [theirs, x])
    ex._host_allgather = gather
    yield me, fused.figures_over_processes(timelines[me], load_bytes[me], place_s[me], ex)


def test_overlap_loads_and_busy_time_cover_every_processs_instances():
  """Several processes: each watches and loads its own instances only, while
  fusion/freed_before_gen_end counts every process's (the shared inference queue). With process
  0's figures alone the metrics said "overlap 0%, 2 freed, none loaded" of a batch where process
  1's freed instance had loaded and scored during the tail, and logged process 0's weight loads
  and busy fraction: half the bytes of 2 processes. The loads' seconds and bytes are summed,
  the busy fraction is the busy instance-seconds over every instance's (its process's span)."""
  from rlhfuse_jax.generation import multihost
  # Process 0 (instances 0, 1): 1 loads after the tail ended. Process 1 (2, 3): 2 loads in
  # time and scores 0.6 s of its 0.8 s before the end; its clock saw a shorter batch.
  p0 = Timeline(num_instances=4, segments=[(0, 0.0, 1.0, "decode"), (1, 0.5, 1.1, "load"),
                                           (1, 1.1, 1.5, "inference")],
                unfinished_curve=[], consolidations=[], gen_end_s=1.0, gen_plus_inf_s=1.5,
                observed=(0, 1))
  p1 = dataclasses.replace(p0, segments=[(3, 0.0, 1.0, "decode"), (2, 0.2, 0.4, "load"),
                                         (2, 0.4, 1.2, "inference")], observed=(2, 3),
                           gen_plus_inf_s=1.25)
  # Byte counts float32 would round (and int32 overflow).
  loaded_bytes = {0: 3_000_000_001, 1: 2_000_000_003}
  assert (p0.loaded_before_gen_end, p0.inference_overlap_frac) == (0, 0.0)
  sent = []
  for me, rows in two_processes(p0, p1, loaded_bytes, {0: 0.0, 1: 0.0}, sent):
    got = combined_figures(rows)
    assert got["fusion/loaded_before_gen_end"] == 1, me
    assert got["fusion/inference_overlap_frac"] == pytest.approx(0.6 / 1.2), me
    assert got["fusion/weight_load_bytes"] == 5_000_000_004, me
    assert got["fusion/weight_load_s"] == pytest.approx(0.6 + 0.2), me
    # 4 busy instance-seconds of 2 x 1.5 + 2 x 1.25 (not the processes' mean, 0.733)
    assert got["gen/instance_busy_frac"] == pytest.approx(4.0 / 5.5), me
  assert sent == [np.int32, np.int32]  # (Exchange.allgather refuses 64-bit data)
  # One process: its own figures, bit for bit, and no exchange.
  one = multihost.Exchange(timeout_s=60)
  got = combined_figures(fused.figures_over_processes(p1, 7, 0.25, one))
  assert {k: got[k] for k in ("fusion/loaded_before_gen_end", "fusion/inference_overlap_frac",
                              "fusion/weight_load_s", "fusion/weight_load_bytes",
                              "gen/instance_busy_frac", "timing_s/gen_plus_inf",
                              "timing_s/actor_to_instances")} == {
      "fusion/loaded_before_gen_end": 1, "fusion/inference_overlap_frac": 0.75,
      "fusion/weight_load_s": p1.kind_s("load"), "fusion/weight_load_bytes": 7,
      "gen/instance_busy_frac": p1.instance_busy_frac, "timing_s/gen_plus_inf": 1.25,
      "timing_s/actor_to_instances": 0.25}
  assert p1.inference_overlap_frac == 0.75 and p1.instance_busy_frac == 2.0 / 2.5


def test_migration_spans_stage_times_and_the_curve_are_the_slowest_processs():
  """Several processes: each times its own instances' copies and its own stages, by its own
  clock (process 1's started 0.1 s after process 0's). Process 0's figures alone logged its
  0.3 s of copies where process 1's took 0.8 s, 0.05 s of waiting for the cross-process
  collectives where process 1 waited 0.25 s, and 0.5 s of inference left after generation
  where process 1 scored 0.8 s more (every process waits for that at the results' exchange).
  The whole run's figure of each is its slowest process's; its clock starts with the earliest
  process, so generation ends at 2.0 s and everything at 1.9 + 0.8 + 0.1 = 2.8 s, and each
  read-out of the unfinished samples at its latest reading."""
  cons = [{"time_s": 0.9, "cross_host_s": 0.05, "cross_host_compile_s": 0.5}]
  p0 = Timeline(num_instances=4, segments=[(1, 1.0, 1.3, "migrate")],
                unfinished_curve=[(0.0, 4), (1.0, 2), (2.0, 0)], consolidations=cons,
                gen_end_s=2.0, gen_plus_inf_s=2.5, observed=(0, 1),
                tagged={"same_host": [(1.0, 1.3)]})
  p1 = Timeline(num_instances=4, segments=[(2, 1.1, 1.8, "migrate"), (3, 1.0, 1.2, "migrate")],
                unfinished_curve=[(0.0, 4), (0.95, 2), (1.9, 0)],
                consolidations=[{"time_s": 0.85, "cross_host_s": 0.25,
                                 "cross_host_compile_s": 0.4}],
                gen_end_s=1.9, gen_plus_inf_s=2.7, observed=(2, 3),
                tagged={"same_host": [(1.0, 1.2)]})
  assert (p1.migration_s, p1.same_host_migration_s) == pytest.approx((0.7 + 0.1, 0.2))
  for me, rows in two_processes(p0, p1, {0: 0, 1: 0}, {0: 0.3, 1: 0.35}, []):
    got = combined_figures(rows, [4, 2, 0])
    assert {k: got[k] for k in got if k.startswith(("gen/migration", "timing_s/"))} == (
        pytest.approx({"gen/migration_s": 0.8, "gen/migration_same_host_s": 0.3,
                       "gen/migration_cross_host_s": 0.25,
                       "gen/migration_cross_host_compile_s": 0.5, "timing_s/generate": 2.0,
                       "timing_s/inference": 0.8, "timing_s/gen_plus_inf": 2.8,
                       "timing_s/actor_to_instances": 0.35})), me
    assert got["gen/unfinished_curve"] == [[0.0, 4], [1.0, 2], [2.0, 0]], me
  # One process: its own, bit for bit (gen_plus_inf_s itself, not generate + inference).
  got = combined_figures([p1.process_figures(0, 0.35)], [4, 2, 0])
  assert (got["timing_s/generate"], got["timing_s/gen_plus_inf"]) == (1.9, 2.7)
  assert got["timing_s/inference"] == 2.7 - 1.9
  assert got["gen/unfinished_curve"] == [[0.0, 4], [0.95, 2], [1.9, 0]]


def test_migration_time_leaves_out_the_decoding_between_two_consolidations():
  """gen/migration_s sums each consolidation's copies (first start to last end): consolidations
  at 1 s (copies 1.0-1.5 and 1.2-2.0) and at 10 s (10.0-10.5), decoding in between, took 1.5 s
  of migration, not the 9.5 s from the first copy to the last; same for a tag's spans."""
  segments = [(2, 1.0, 1.5, "migrate"), (0, 1.2, 2.0, "migrate"), (0, 2.0, 9.0, "decode"),
              (0, 10.0, 10.5, "migrate"), (0, 10.5, 12.0, "decode")]
  tagged = {"same_host": [(1.0, 1.5), (1.2, 2.0), (10.0, 10.5)]}
  two = Timeline(num_instances=4, segments=segments, unfinished_curve=[],
                 consolidations=[{"time_s": 0.9}, {"time_s": 9.5}], gen_end_s=12.0,
                 gen_plus_inf_s=12.0, tagged=tagged)
  assert two.migration_s == 1.5
  assert two.per_consolidation_span_s(tagged["same_host"]) == 1.5
  one = dataclasses.replace(two, consolidations=[{"time_s": 0.9}])  # one window: the span
  assert one.migration_s == one.span_s("migrate") == 9.5


def test_two_consolidations_outputs_identical(one_device):
  """max_consolidations=2 on a batch built to need two: after prefill 8 samples are left, two
  on each of the 4 instances (Rt=0.5: 8 <= 0.5 x 16), which pack into 2 instances; after two
  chunks 4 are left, two on each, which pack into 1. Both consolidations run (the second moves
  two rows between one pair of instances), outputs equal the unfused run bitwise; with
  max_consolidations=1 only the first runs."""
  gen, actor, params = one_device
  # Full prompts: every instance holds the same KV tokens, so the plans are fixed by indices:
  # instances 0 and 1 kept, 2 and 3 moved there (tails 0, 2 on 0 and 1, 3 on 1); then 0 kept.
  tokens = np.random.default_rng(4).integers(1, CFG.vocab_size, (16, P)).astype(np.int32)
  lens = np.full(16, P, np.int32)
  budgets = np.ones(16, np.int32)  # sample b: instance b % 4, slot b // 4
  budgets[0:4] = T  # the tail: one sample per instance
  budgets[4:8] = 5  # done in the second chunk (1 token at prefill, 3 per chunk)
  base = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=False)
  np.testing.assert_array_equal(base.rollout.response_lens, budgets)
  once = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=0.5)
  twice = variant(gen, actor, params, max_consolidations=2).run(
      actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=0.5)
  assert [(c["step"], c["unfinished"], c["kept"], c["moves"]) for c in twice.consolidations] == [
      (0, 8, [0, 1], 4), (6, 4, [0], 2)]
  assert len(twice.timeline.consolidations) == 2
  m = twice.metrics
  assert (m["gen/consolidated_from"], m["gen/consolidated_to"], m["gen/migrated_samples"]) == (
      4, 1, 6)
  assert [(c["step"], len(c["kept"])) for c in once.consolidations] == [(0, 2)]
  assert (once.metrics["gen/consolidated_to"], once.metrics["gen/migrated_samples"]) == (2, 4)
  assert m["gen/instance_chunks"] < once.metrics["gen/instance_chunks"]
  # The migration time leaves out the decode rounds between the two consolidations.
  tl = twice.timeline
  assert 0 < m["gen/migration_s"] < tl.span_s("migrate")
  assert 0 < m["gen/migration_same_host_s"] < tl.span_s("migrate")
  assert once.metrics["gen/migration_s"] == once.timeline.span_s("migrate") > 0
  for out in (once, twice):
    assert_same_outputs(base, out)
  # One row a migration at most (fusion.migration_rows=1): the pair's two rows move in two
  # parts, to the same slots; the same plans and outputs.
  single = variant(gen, actor, params, max_consolidations=2, migration_rows=1)
  assert all(inst.buckets == (1,) for inst in single.instances)
  gathers = []
  for inst in single.instances:
    inst.gather = (lambda f: lambda st, slots: gathers.append(len(slots)) or f(st, slots))(
        inst.gather)
  parts = single.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=0.5)
  assert [(c["step"], c["kept"], c["moves"]) for c in parts.consolidations] == [
      (c["step"], c["kept"], c["moves"]) for c in twice.consolidations]
  assert gathers == [1] * 6  # the 6 migrated rows, one a part
  assert_same_outputs(base, parts)


def test_two_device_instances_identical_with_and_without_consolidation():
  gen, actor, params = build(2, 4, 2, FrozenModels(reference=CFG))
  assert gen.instances[0].state_sharding.cache.k.spec[3] == "tensor"  # KV heads split
  assert len(gen.instances[1].devices) == 2
  tokens, lens, budgets = batch(8, 2)
  budgets[2:] = np.minimum(budgets[2:], 4)
  budgets[:2] = T  # the tail: samples 0 and 1, one on each instance
  base = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=False)
  out = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=0.5)
  assert out.metrics["gen/migrated_samples"] >= 1 and len(out.consolidations[0]["kept"]) == 1
  assert_same_samples(base, out)
  np.testing.assert_array_equal(base.ref_logp, out.ref_logp)


def test_an_actor_on_the_instances_devices_is_placed_by_layouts_made_once(monkeypatch):
  """place_actor from the training mesh the instances were cut from (the main job's path; here
  fsdp=4 over 2 instances of 2 devices, which split the weights over tensor instead): each
  instance's copy is bitwise the actor, placed as its executables take it, call after call;
  the layouts are made on the first call only. Made on every call (a param_shardings per
  instance), with each leaf's shards listed once per instance, they took a third of the main
  job's place_actor (39 leaves, 8 instances: 15.0 ms of host time a call, now 9.5)."""
  monkeypatch.setattr(instances, "compile_all", lambda *args, **kw: None)  # not run here
  actor = llama.host_random_params(CFG, 0)
  sampling = SamplingConfig(temperature=1.0, max_new_tokens=T, chunk_size=3, eos_id=-1)
  config = FusedGenConfig(num_instances=2, slots=4, instance_devices=2, migration_threshold=0.5)
  gen = FusedGenerator(CFG, sampling, config, batch_size=8, prompt_len=P,
                       frozen=FrozenModels(reference=CFG), actor_params=actor,
                       frozen_params={"reference": actor})
  devices = [d for inst in gen.instances for d in inst.devices]
  training = mesh_lib.shard_params(actor, llama.logical_specs(CFG), mesh_lib.make_mesh(
      mesh_lib.MeshConfig(data=1, fsdp=4), devices))
  want = {i: inst.param_shardings(CFG, actor) for i, inst in enumerate(gen.instances)}
  made, real = [], instances.GenerationInstance.param_shardings

  def counted(self, cfg, params):
    made.append(self.index)
    return real(self, cfg, params)
  monkeypatch.setattr(instances.GenerationInstance, "param_shardings", counted)
  for call in range(3):
    placed = gen.place_actor(training)
    assert made == ([0, 1] if call == 0 else []), (call, made)
    made.clear()
    assert sorted(placed) == [0, 1]
    for i, params in placed.items():
      assert jax.tree.map(lambda x: x.sharding, params) == want[i]
      assert any("tensor" in x.sharding.spec for x in jax.tree.leaves(params))
      for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(actor), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_pallas_kernel_on_two_device_instances():
  """model.attention="pallas" on fused instances of 2 devices (tensor 2): each instance runs
  the kernel per device inside a shard_map over its own abstract mesh (both instances share
  one trace, and each compiles for its own devices). Outputs identical with and without
  consolidation (the kernel's rows are independent, every instance has the same shape), and
  the blockwise engine's samples to rounding."""
  tokens, lens, budgets = batch(8, 2)
  budgets[2:] = np.minimum(budgets[2:], 4)
  budgets[:2] = T
  gen, actor, params = build(2, 4, 2, FrozenModels(reference=CFG),
                             cfg=CFG.replace(attention="pallas"))
  a, b = gen.instances
  assert a.kernel == b.kernel and a.kernel[2] == "tensor"  # abstract meshes: one shared trace
  base = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=False)
  out = gen.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=True, rt=0.5)
  assert out.metrics["gen/migrated_samples"] >= 1
  assert_same_samples(base, out)
  plain, actor, params = build(2, 4, 2, FrozenModels(reference=CFG))
  want = plain.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=False)
  np.testing.assert_array_equal(base.rollout.response_tokens, want.rollout.response_tokens)
  np.testing.assert_allclose(base.rollout.logprobs, want.rollout.logprobs, atol=1e-5)


def test_length_histogram_round_trips_and_drops_lengths_past_a_smaller_budget():
  hist = LengthHistogram(8)
  hist.add([1, 3, 3, 8, 8, 8])
  again = LengthHistogram(8)
  assert again.load_dict(hist.to_dict()) == 0
  np.testing.assert_array_equal(again.counts, hist.counts)
  shorter = LengthHistogram(4)  # resumed with max_new_tokens 4
  assert shorter.load_dict(hist.to_dict()) == 3 and shorter.counts.tolist() == [0, 1, 0, 2, 0]
  with pytest.raises(ValueError, match="bins and counts of one length"):
    shorter.load_dict({"bins": [1, 2], "counts": [1]})


def test_length_histogram_draws_the_observed_lengths_at_their_frequencies():
  """The Rt choice simulates batches drawn from the histogram: a draw must be an observed
  length, at its observed frequency (lengths 2 and 5 seen 1 : 3 times here), never a neighbour
  of it. 4,000 draws with a fixed seed; the binomial standard error of the share is 0.007."""
  hist = LengthHistogram(6)
  hist.add([2, 5, 5, 5])
  draws = hist.sample(np.random.default_rng(0), 4000)
  assert set(draws.tolist()) == {2, 5}
  assert abs(np.mean(draws == 5) - 0.75) < 0.03


def test_the_rt_calibration_times_a_decode_step_on_a_chunk_that_decoded():
  """measure_costs times one live row's decode step on prompts whose chunk runs its steps. A
  draw whose row samples a stop token first ends at prefill, so its chunk decodes nothing; with
  steps_per_check = chunk_size that chunk passed for a full one and the step was timed on a call
  that decoded nothing (on a real 1-layer instance: 0.2 ms where a step takes 0.6 ms). The
  instance is faked: the first prompts it sees end at prefill, any others decode."""
  from rlhfuse_jax.generation import measure
  s, seen, decoded = 2, [], []  # decoded: (live rows, tokens) of each decode call

  class Inst:
    devices = [types.SimpleNamespace(platform="cpu", device_kind="cpu")]
    rep = None

    def place(self, cfg, params):
      return params

    def prefill(self, params, tok, lens, uids, budget, key):
      if tok.tobytes() not in seen:
        seen.append(tok.tobytes())
      st = types.SimpleNamespace(num_generated=np.ones(s, np.int32), budget=np.asarray(budget),
                                 ended=tok.tobytes() == seen[0])
      return st, None

    def decode(self, params, st, key):
      n = st.num_generated + np.where((st.budget > 0) & ~st.ended, 2, 0)
      decoded.append((int((st.budget > 0).sum()), int(np.max(n - st.num_generated))))
      return types.SimpleNamespace(num_generated=n), None

  gen = types.SimpleNamespace(
      instances=[Inst()], local=[0], prompt_len=3, models={},
      cfg=types.SimpleNamespace(vocab_size=16, num_params=lambda: 1000),
      config=types.SimpleNamespace(slots=s, instance_devices=1, micro_batch=s, inference_pp=1),
      sampling=SamplingConfig(max_new_tokens=6, chunk_size=2, steps_per_check=2))
  cal = measure.measure_costs(gen, {}, {}, repeats=2)
  assert cal["ops"]["decode_step"]["occupied_slots"] == [1, 2]
  one = [n for live, n in decoded if live == 1]
  assert one[0] == 0 and all(n > 0 for n in one[-2:]), decoded  # the 2 timed chunks decoded


def test_auto_rt_simulates_the_engine_at_its_dtypes():
  """rt_auto describes the engine to the simulator at its models' dtypes: the KV rows a
  migration moves at model.dtype (it sized them at bf16, half a float32 run's); the frozen
  weights an instance loads at their param_dtype, the bytes measure_costs' weight_load counts
  (byte_unit "stored": test_auto_rt_loads_the_frozen_weights_in_the_calibrations_time)."""
  for dtype in ("float32", "bfloat16"):
    cfg = CFG.replace(dtype=dtype, param_dtype=dtype)
    reward = cfg.replace(head="scalar", num_layers=2, hidden_size=64)
    gen = types.SimpleNamespace(
        cfg=cfg, models={"reference": cfg, "reward": reward}, kv_capacity=64,
        config=FusedGenConfig(num_instances=2, slots=4, migration_threshold="auto"),
        sampling=SamplingConfig(max_new_tokens=T, chunk_size=3),
        instances=[types.SimpleNamespace(devices=jax.devices()[:1])], prompt_len=P,
        exchange=types.SimpleNamespace(multi=False))
    actor, frozen, setup = sim_setup(gen)
    item = np.dtype(cfg.jnp_dtype).itemsize  # what the engine's KVCache holds (engine.py)
    assert actor.kv_bytes_per_token() == 2 * cfg.num_layers * cfg.num_kv_heads * (
        cfg.hidden_size // cfg.num_heads) * item, dtype
    # the frozen models (the reward model at its own shape) as the instances load them
    assert [s.weight_bytes() for s in frozen] == [
        c.num_params() * np.dtype(c.jnp_param_dtype).itemsize for c in (cfg, reward)], dtype
    assert setup.offload_frozen and setup.kv_capacity_tokens == 64


class _LoadingInstance:
  """A generation instance faked for measure_costs: each decode call generates 2 tokens in the
  rows with budget left; `placed` lists the configs of the models placed on it."""
  devices = [types.SimpleNamespace(platform="cpu", device_kind="cpu")]
  rep = None

  def __init__(self):
    self.placed = []

  def place(self, cfg, params):
    self.placed.append(cfg)
    return params

  def prefill(self, params, tok, lens, uids, budget, key):
    n = len(budget)
    return types.SimpleNamespace(num_generated=np.ones(n, np.int32),
                                 budget=np.asarray(budget)), None

  def decode(self, params, st, key):
    return types.SimpleNamespace(num_generated=st.num_generated + 2 * (st.budget > 0)), None

  def score(self, *args):
    return None


def _simulated_load_s(inst: _LoadingInstance, cfg, models: dict, held: dict) -> tuple:
  """(the seconds the Rt model charges a freed instance's load, its GenSetup): measure_costs on
  `inst` holding `held` ({name: params}), then rt_auto.sim_setup and a cost model of that
  calibration."""
  from rlhfuse_jax.policy import calibration as cal_lib
  from rlhfuse_jax.sim.cost_model import CostModel
  from rlhfuse_jax.sim.hardware import get_hardware
  gen = types.SimpleNamespace(
      instances=[inst], local=[0], prompt_len=3, cfg=cfg, models=models, kv_capacity=64,
      config=FusedGenConfig(num_instances=2, slots=2, migration_threshold="auto"),
      sampling=SamplingConfig(max_new_tokens=6, chunk_size=2, steps_per_check=2),
      exchange=types.SimpleNamespace(multi=False))
  cal = measure.measure_costs(gen, {}, held, repeats=1)
  _, frozen, setup = sim_setup(gen)
  cost = CostModel(get_hardware("h100_sxm"), calibration=cal_lib.from_dict(cal, "measured"))
  return cost.weight_load_s(frozen, setup.tp), setup


def test_median_s_makes_each_calls_input_outside_the_clock():
  """median_s(fn, n, setup): each call gets its own setup() (a fresh state for a call that
  donates it: calibrate_sim's decode chunk, which had timed a copy of the whole KV cache with
  every step), made before the clock starts."""
  import time
  made = []

  def setup():
    time.sleep(0.2)
    made.append(len(made))
    return made[-1]
  seen = []
  took = measure.median_s(lambda x: seen.append(x), 3, setup=setup)
  assert seen == [0, 1, 2, 3] and took < 0.1, (seen, took)  # a warm-up and 3 timed calls


def test_auto_rt_loads_the_frozen_weights_in_the_calibrations_time(monkeypatch):
  """The Rt model times loading the frozen weights with the engine's measured weight_load,
  whose rate measure_costs records in the bytes it copied (byte_unit "stored") and rt_auto
  sizes the models at their param_dtype. measure_costs counted 2 bytes a parameter whatever
  the dtype while rt_auto described a float32 engine's frozen models at 4 (briefly on
  2026-12-04), so each instance's load was simulated at twice what was measured (1.0 s for
  0.5 s here)."""
  monkeypatch.setattr(measure, "median_s", lambda fn, repeats: (fn(), 0.5)[1])
  for dtype in ("float32", "bfloat16"):
    cfg = CFG.replace(dtype=dtype, param_dtype=dtype)
    models = {"reference": cfg, "reward": cfg.replace(head="scalar", num_layers=2)}
    held = {n: np.zeros(c.num_params(), c.jnp_param_dtype) for n, c in models.items()}
    load_s, _ = _simulated_load_s(_LoadingInstance(), cfg, models, held)
    assert load_s == pytest.approx(0.5), dtype


def test_auto_rt_charges_the_critics_copy_onto_a_freed_instance(monkeypatch):
  """A freed instance loads every inference model before its first micro-batch
  (InferenceQueue._load, the critic from its training devices), so the Rt model charges that
  whole load as measure_costs timed it. measure_costs timed the frozen models alone while the
  simulator charged the critic's bytes at their rate too (reference + critic: 0.5 s (1 +
  critic/reference params) for a measured 1.0 s), and a critic alone (no reference, a reward
  function) was charged nothing (no weight_load op, offload_frozen False)."""
  inst = _LoadingInstance()

  def median_s(fn, repeats):  # 0.5 s for each model an instance copies in
    inst.placed.clear()
    fn()
    return 0.5 * max(len(inst.placed), 1)

  monkeypatch.setattr(measure, "median_s", median_s)
  critic = CFG.replace(head="scalar", num_layers=3)  # not the reference's size
  for models in ({"reference": CFG, "critic": critic}, {"critic": critic}):
    held = {n: np.zeros(c.num_params(), np.float32) for n, c in models.items()}
    load_s, setup = _simulated_load_s(inst, CFG, models, held)
    assert setup.offload_frozen, models
    assert load_s == pytest.approx(0.5 * len(models)), sorted(models)


def test_rt_choice_follows_the_costs():
  actor = from_model_config(CFG)
  hist = LengthHistogram(64)

  def never(*args):
    raise AssertionError("nothing to simulate before any length is observed")
  assert rt_choice.choose_rt(hist, never, np.full(16, 6), 64).rt == rt_choice.PRIOR_RT
  rng = np.random.default_rng(0)
  hist.add(np.clip(np.rint(rng.lognormal(np.log(4), 1.2, 400)), 1, 64))

  def cal(migration_s):
    return {"format": "rlhfuse_jax.sim.calibration/v1", "device": "test",
            "devices_share_compute": True,
            "ops": {"decode_step": {"occupied_slots": [1, 4], "seconds": [0.01, 0.01]},
                    "prefill": {"tokens_per_s": 1e6}, "inference": {"tokens_per_s": 1e5},
                    "migration": {"bytes_per_s": 1e15, "latency_s": migration_s}}}
  setup = GenSetup(num_instances=4, slots=4, chunk_steps=2, max_new_tokens=64)
  cheap = rt_choice.choose_rt(hist, rt_model.gen_plus_inf_model(cal(0.0), actor, (actor,), setup),
                              np.full(16, 6), 64)
  dear = rt_choice.choose_rt(hist, rt_model.gen_plus_inf_model(cal(100.0), actor, (actor,),
                                                               setup), np.full(16, 6), 64)
  # On one shared processor, fewer instances stepping saves time when moving is free ...
  assert cheap.rt > 0 and cheap.simulated_s[cheap.rt] < cheap.simulated_s[0.0]
  # ... and nothing is worth a 100 s migration.
  assert dear.rt == 0.0
  # Frozen models loaded from the host need the measured load: no H100 PCIe figure stands in.
  offload = dataclasses.replace(setup, offload_frozen=True)
  with pytest.raises(ValueError, match=r"lacks the measured ops \['weight_load'\]"):
    rt_model.gen_plus_inf_model(cal(0.0), actor, (actor,), offload)
  loads = cal(0.0)
  loads["ops"]["weight_load"] = {"bytes_per_s": 1e9}
  assert rt_model.gen_plus_inf_model(loads, actor, (actor,), offload)(
      0.5, np.full(16, 6), np.full(16, 8)) > 0


@pytest.mark.parametrize("kw, match", [
    ({"migration_threshold": 1.5}, "fusion.migration_threshold"),
    ({"migration_threshold": -0.1}, "fusion.migration_threshold"),
    ({"migration_threshold": "sometimes"}, "fusion.migration_threshold"),
    ({"num_instances": 0}, "fusion.num_instances"),
    ({"max_consolidations": -1}, "fusion.max_consolidations"),
    # Accepted before, then a TypeError in choose_rt (0.0 <= 'auto') or an unnamed error there.
    ({"rt_candidates": ("auto",)}, r"fusion.rt_candidates=\('auto',\): expected numbers"),
    ({"rt_candidates": ()}, r"fusion.rt_candidates=\(\): expected at least one"),
    # Accepted before: a multi-process run then failed at its start with an OverflowError
    # (the barrier's milliseconds), and above threading.TIMEOUT_MAX no collective had a timeout.
    ({"exchange_timeout_s": float("inf")}, r"fusion.exchange_timeout_s=inf: expected a number "
     r"of seconds > 0 and <= \d+ \(Python.s longest timer\)"),
    ({"exchange_timeout_s": 1e10}, r"fusion.exchange_timeout_s=10000000000.0: expected"),
])
def test_bad_fusion_config(kw, match):
  with pytest.raises(ValueError, match=match):
    FusedGenConfig(**{"num_instances": 2, "slots": 4, **kw})


def test_rt_candidates_are_stored_as_floats():
  assert FusedGenConfig(num_instances=2, slots=4, rt_candidates=("0.3", 1)).rt_candidates == (
      0.3, 1.0)


def test_per_batch_auto_rt_without_a_model_is_refused(one_device):
  """run(rt='auto') on a generator with a fixed Rt built without rt_model: the first batch
  silently ran the prior Rt and the second failed in choose_rt with "'NoneType' object is not
  callable"; now every batch refuses at once, naming what is missing."""
  gen, actor, params = one_device
  fixed = variant(gen, actor, params, migration_threshold=0.5)
  assert fixed.rt_model is None
  tokens, lens, budgets = batch(16, 0)
  for _ in range(2):
    with pytest.raises(ValueError, match=r"run\(rt='auto'\) needs a model to simulate Rt"):
      fixed.run(actor, params, tokens, lens, KEY, budgets=budgets, rt="auto")
  with pytest.raises(ValueError, match=r"choose_rt\(auto=True\) needs a model to simulate Rt"):
    fixed.choose_rt(lens, auto=True)
  # Unfused runs take no Rt: unaffected.
  assert fixed.run(actor, params, tokens, lens, KEY, budgets=budgets, fuse=False,
                   rt="auto").rt == 0.0


def test_host_inputs_that_int32_would_change_are_refused():
  """check_prompts cast the batch's host inputs to int32 as numpy does, silently: a budget of
  2.7 became 2, and the uid 2**32 + 7 became 7 (that sample drew uid 7's random stream). Now
  refused, naming the element; integral floats still pass."""
  sampling = SamplingConfig(max_new_tokens=4)
  tokens, lens = [[1, 2, 3], [4, 5, 6]], [3, 2]
  ok = instances.check_prompts(2, 3, sampling, np.float32(tokens), [3.0, 2.0], budgets=[1.0, 4])
  np.testing.assert_array_equal(ok[0][0], tokens[0])  # (row 1: pad_id behind its length)
  assert ok[1].dtype == ok[3].dtype == np.int32
  for kw, match in (({"uids": np.int64([0, 2**32 + 7])}, r"uids\[1\] = 4294967303"),
                    ({"budgets": [2.7, 3]}, r"budgets\[0\] = 2.7: expected an integer")):
    with pytest.raises(ValueError, match=match):
      instances.check_prompts(2, 3, sampling, tokens, lens, **kw)
  with pytest.raises(ValueError, match=r"prompt_tokens\[1, 2\] = nan"):
    instances.check_prompts(2, 3, sampling, [[1, 2, 3], [4, 5, np.nan]], lens)
  with pytest.raises(ValueError, match="prompt_lens has dtype <U1; expected integers"):
    instances.check_prompts(2, 3, sampling, tokens, ["3", "2"])


def test_bad_layouts_fail_before_compiling():
  sampling = SamplingConfig(max_new_tokens=T, eos_id=-1)
  frozen = FrozenModels(reference=CFG)
  shapes = {"reference": llama.host_random_params(CFG, 0)}

  def make(b, **kw):
    return FusedGenerator(CFG, sampling, FusedGenConfig(**kw), batch_size=b, prompt_len=P,
                          frozen=frozen, actor_params=shapes["reference"], frozen_params=shapes)
  with pytest.raises(ValueError, match=r"num_instances=5 x fusion.instance_devices=2 = 10 "
                                       r"devices, but only 8"):
    make(20, num_instances=5, slots=4, instance_devices=2)
  with pytest.raises(ValueError, match=r"fusion.slots=4 do not fit the KV cache: 4 slots x "
                                       r"max_len=22 .* = 88 tokens > config.fusion.kv_capacity"):
    make(8, num_instances=2, slots=4, kv_capacity_tokens=80)
  with pytest.raises(ValueError, match=r"fusion.slots=2: 16 samples .* expected slots >= 4"):
    make(16, num_instances=4, slots=2)
  with pytest.raises(ValueError, match=r"migration_threshold='auto' needs a model"):
    make(8, num_instances=2, slots=4)  # "auto" without the simulator plugged in
  with pytest.raises(ValueError, match=r"generation batch_size=0: expected an integer >= 1"):
    make(0, num_instances=2, slots=4, migration_threshold=0.5)  # ran into numpy at run()
  with pytest.raises(ValueError, match="context too long"):
    FusedGenerator(CFG, SamplingConfig(max_new_tokens=60), FusedGenConfig(num_instances=1,
                                                                         slots=1),
                   batch_size=1, prompt_len=P, frozen=frozen,
                   actor_params=shapes["reference"], frozen_params=shapes)


def test_layout_errors_name_the_section_the_user_edits():
  """bench_generation's instances are config.generation's fields: too many for the devices was
  reported as fusion.num_instances, a section that binary does not have."""
  config = FusedGenConfig(num_instances=16, slots=1, migration_threshold=0.5,
                          section="generation")
  with pytest.raises(ValueError, match=r"^generation\.num_instances=16 x generation\."
                                       r"instance_devices=1 = 16 devices, but only 8"):
    fused.check_layout(config, 16, 8)


def test_an_inference_micro_batch_larger_than_the_batch_is_refused():
  """fusion.inference_micro_batch=1000 for a batch of 16 was accepted: every micro-batch was
  padded to 1000 rows, and none was scored while the tail decoded. The batch size is the most."""
  config = FusedGenConfig(num_instances=4, slots=4, inference_micro_batch=17)
  with pytest.raises(ValueError, match=r"^config\.fusion\.inference_micro_batch=17: expected "
                                       r"at most the batch's 16 samples .*0 takes the slots, "
                                       r"4\)$"):
    fused.check_layout(config, 16, 8)
  fused.check_layout(dataclasses.replace(config, inference_micro_batch=16), 16, 8)
  # Slots beyond the batch: 0 is not offered as the remedy it is not.
  with pytest.raises(ValueError, match=r"0 takes the slots, 32, more than the batch too\)$"):
    fused.check_layout(dataclasses.replace(config, num_instances=1, slots=32), 16, 8)


def test_every_process_refuses_a_layout_that_leaves_one_without_an_instance(monkeypatch):
  """2 instances on the first 2 of process 0's devices, 2 processes: process 0 refuses too (it
  used to compile on and wait in its first exchange for process 1, which had refused)."""
  class TwoProcesses(fused.multihost.Exchange):
    def __init__(self, *args):
      super().__init__(*args)
      self.count = 2  # as process 0 of 2
  monkeypatch.setattr(fused.multihost, "Exchange", TwoProcesses)
  shapes = {"reference": llama.host_random_params(CFG, 0)}
  with pytest.raises(ValueError, match=r"num_instances=2 x instance_devices=1 leaves "
                                       r"process\(es\) \[1\] of 2 without an instance"):
    FusedGenerator(CFG, SamplingConfig(max_new_tokens=T, eos_id=-1),
                   FusedGenConfig(num_instances=2, slots=4, migration_threshold=0.5),
                   batch_size=8, prompt_len=P, frozen=FrozenModels(reference=CFG),
                   actor_params=shapes["reference"], frozen_params=shapes)


def test_instances_split_the_devices():
  meshes = instances.split_devices(jax.devices(), 4, 2)
  assert [tuple(m.devices.flat) for m in meshes] == [tuple(jax.devices()[2 * i:2 * i + 2])
                                                    for i in range(4)]
  assert instances.migration_buckets(8) == (1, 4, 8)
  assert instances.migration_buckets(1) == (1,)
  # At most migration_rows (fusion.migration_rows; 0: the slots), more rows move in parts.
  assert instances.migration_buckets(64, 8) == (1, 4, 8)
  assert instances.migration_buckets(64, 16) == (1, 4, 16)
  assert instances.migration_buckets(4, 8) == (1, 4)
  assert instances.migration_buckets(64, 0) == (1, 4, 16, 64)
  with pytest.raises(ValueError, match=r"config\.fusion\.migration_rows=-1: expected an "
                                       r"integer >= 0 \(0: up to the slots\)"):
    FusedGenConfig(num_instances=2, slots=4, migration_threshold=0.5, migration_rows=-1)
  assert fused.INFERENCE_MODELS == ("reference", "critic", "reward")


def test_a_validation_pass_leaves_the_rt_history_as_it_was():
  """The held-out pass runs through the fused stage, and its response lengths went into the
  Rt histogram (and the cached simulated choice): eval_every, which training never sees,
  changed the Rt given to training batches. Inside FusedGenerator.history_kept they do not."""
  import types
  from rlhfuse_jax.generation.fused import FusedGenerator
  from rlhfuse_jax.policy.lengths import LengthHistogram
  from rlhfuse_jax.trainer.evaluation import HeldOutEval
  from rlhfuse_jax.trainer.rollout import StageOutputs
  gen = FusedGenerator.__new__(FusedGenerator)  # its Rt state only: no instances built
  gen.lengths, gen._rt_cache = LengthHistogram(8), (4, "training's choice")
  gen.lengths.add([2, 3, 5, 8])

  def stage(params, prompts, key):  # generates, adding to the history as FusedGenerator.run
    lens = np.full(len(prompts.lens), 7, np.int32)
    gen.lengths.add(lens)
    gen._rt_cache = (gen.lengths.total, "another choice")
    rollout = types.SimpleNamespace(response_lens=lens)
    return StageOutputs(rollout=rollout, batch=None, ref_logp=None, values=None,
                        scores=np.ones(len(lens), np.float32), metrics={})
  stage.generator = gen
  before = gen.lengths.counts.copy()
  evaluation = HeldOutEval(_Pool(records=[{}] * 6, tokens=np.ones((6, 3), np.int32),
                                 lengths=np.full(6, 3, np.int32)), rows=4, seed=0)
  metrics = evaluation(stage, lambda name: None, iteration=3)
  assert metrics["val/prompts"] == 6 and metrics["val/response_length_mean"] == 7
  np.testing.assert_array_equal(gen.lengths.counts, before)
  assert gen._rt_cache == (4, "training's choice")


class _Pool:
  """A prompt pool as HeldOutEval reads one (records, tokens, lengths, len)."""

  def __init__(self, records, tokens, lengths):
    self.records, self.tokens, self.lengths = records, tokens, lengths

  def __len__(self):
    return len(self.records)


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_gpu_instances_compile_one_first_so_the_others_load_it(platform, monkeypatch):
  """With jax's persistent cache (the suite runs with one) on a GPU backend, instance 0's
  executables compile before any other instance's start, so those load instance 0's from the
  cache (GPU cache keys carry no device assignment); on CPU (keys keep the devices) all start
  at once."""
  import threading
  import time as time_lib
  import types
  from rlhfuse_jax.generation import instances as inst_lib
  assert jax.config.jax_compilation_cache_dir  # tests/conftest.py
  events, lock = [], threading.Lock()

  class Lowered:
    def __init__(self, i):
      self.i = i

    def compile(self):
      with lock:
        events.append(("start", self.i))
      time_lib.sleep(0.2 if self.i == 0 else 0.01)
      with lock:
        events.append(("end", self.i))
      return f"exe{self.i}"

  def instance(i):
    inst = types.SimpleNamespace(devices=[types.SimpleNamespace(platform=platform, id=i)],
                                 _exe={})
    inst.lower_all = lambda *a: [("prefill", Lowered(i)), ("decode", Lowered(i))]
    return inst
  insts = [instance(i) for i in range(3)]
  inst_lib.compile_all(insts, None, {}, threads=4)
  assert all(inst._exe == {"prefill": f"exe{i}", "decode": f"exe{i}"}
             for i, inst in enumerate(insts))
  last_end_of_0 = max(k for k, e in enumerate(events) if e == ("end", 0))
  first_start_of_others = min(k for k, e in enumerate(events) if e[0] == "start" and e[1])
  assert (first_start_of_others > last_end_of_0) == (platform == "gpu"), events


def test_the_host_side_sequences_equal_build_sequences():
  """fused._sequences builds on the host what models.sequences.build_sequences builds on the
  device (the fused engine scores the former, the trainer the latter): pinned equal."""
  from rlhfuse_jax.models import sequences  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  n, p, t = 6, 5, 7
  prompts, responses = rng.integers(3, 50, (n, p)), rng.integers(3, 50, (n, t))
  prompt_lens, response_lens = rng.integers(1, p + 1, n), rng.integers(0, t + 1, n)
  response_lens[0], prompt_lens[1] = t, p  # full rows too
  np.testing.assert_array_equal(
      fused._sequences(prompts, prompt_lens, responses, response_lens, pad_id=1),
      np.asarray(sequences.build_sequences(prompts, prompt_lens, responses, response_lens, 1)))
