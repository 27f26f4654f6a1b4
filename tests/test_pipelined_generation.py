"""Delayed inter-batch pipelined generation (generation/pipelined.py, docs/architecture.md §4):
tokens, lengths and stop reasons bitwise equal to the non-pipelined Generator on the same
per-sample keys, log-probs to the last bit (docs/architecture.md), for pp 2 and 4 stages, G = pp
and 2*pp groups, ragged prompt lengths, per-sample budgets and EOS; the tick table the program
records equals the schedule's formula; the benchmark's pipelined path at its tiny size (equal
lengths: every stage busy after the fill); clear errors."""
import functools
import json
import os
import subprocess
import sys
import weakref

import jax
import numpy as np
import pytest

from rlhfuse_jax.generation import instances, pipelined
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.models import attention as attn
from rlhfuse_jax.models import llama
from rlhfuse_jax.parallel import mesh as mesh_lib

# scan_layers: the engine's layers then run as one scanned Block per layer, as the stages do, so
# the two compile to the same per-layer code (bitwise log-probs; the unrolled case below).
CFG = llama.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=4,
                        num_heads=4, num_kv_heads=2, max_seq_len=64, scan_layers=True)
B, P, T = 8, 6, 12
KEY = jax.random.key(7)
# EOS 11 ends two samples early (rows 3 and 6); chunk_size 3 puts chunk boundaries mid-stream.
SAMPLING = SamplingConfig(max_new_tokens=T, eos_id=11, chunk_size=3)


def _prompts():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, CFG.vocab_size, (B, P)).astype(np.int32)
  lens = np.array([6, 1, 3, 5, 2, 6, 4, 3], np.int32)
  tokens[np.arange(P)[None, :] >= lens[:, None]] = 0  # right padding (pad_id 0)
  budgets = np.array([12, 3, 7, 12, 1, 5, 9, 2], np.int32)  # ragged; budget 1: prefill only
  uids = np.array([5, 11, 2, 40, 7, 3, 9, 21], np.int32)
  return tokens, lens, budgets, uids


@functools.lru_cache(maxsize=None)
def _reference(cfg: llama.ModelConfig, groups: int):
  """The non-pipelined Generator with B/G rows per device (pipelined.reference_mesh)."""
  mesh = pipelined.reference_mesh(jax.devices(), B, groups)
  params = jax.device_put(llama.host_random_params(cfg, 0), mesh_lib.replicated(mesh))
  tokens, lens, budgets, uids = _prompts()
  gen = instances.Generator(cfg, SAMPLING, batch_size=B, prompt_len=P, mesh=mesh, params=params)
  return gen.generate(params, tokens, lens, KEY, uids=uids, budgets=budgets)


def _pipelined(cfg, stages, groups, sampling=SAMPLING, budgets=None):
  gen = pipelined.PipelinedGenerator(cfg, sampling, batch_size=B, prompt_len=P, stages=stages,
                                     groups=groups)
  tokens, lens, default_budgets, uids = _prompts()
  out = gen.generate(llama.host_random_params(cfg, 0), tokens, lens, KEY, uids=uids,
                     budgets=default_budgets if budgets is None else budgets)
  return gen, out


@pytest.mark.parametrize("stages,groups", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_pipelined_equals_engine_bitwise(stages, groups):
  gen, out = _pipelined(CFG, stages, groups)
  ref = _reference(CFG, groups)
  np.testing.assert_array_equal(out.response_tokens, ref.response_tokens)
  np.testing.assert_array_equal(out.response_lens, ref.response_lens)
  np.testing.assert_array_equal(out.stop_reason, ref.stop_reason)
  # Bitwise, pp 4's one layer per stage included: it runs as the engine's loop body runs each
  # layer (pipelined._Stage.layers). Scanned from a one-row stack, 15 of pp 4, G 8's 96
  # log-probs differed in their last bits under the suite's codegen flags (tests/xla_env.py).
  np.testing.assert_array_equal(out.logprobs, ref.logprobs)
  # The batch really is ragged: EOS and budgets both stop samples, one at its first token.
  assert {1, 2} <= set(out.stop_reason.tolist()) and out.response_lens.min() == 1
  assert len(set(out.response_lens.tolist())) >= 4

  # The executed schedule: what each stage ran at each tick, recorded by the program itself.
  steps = gen.group_steps(out.response_lens)
  table = out.decode_table
  np.testing.assert_array_equal(table, pipelined.expected_tick_table(steps, stages, len(table)))
  formula = pipelined.ticks_formula(steps, stages, gen.chunk_ticks)
  assert len(table) == formula["executed_ticks"] == out.decode_chunks * SAMPLING.chunk_size * groups
  assert (table != pipelined.IDLE).sum() == formula["busy_stage_ticks"] == stages * sum(steps)
  # Every group's steps run in order, one stage after another (no group ever overtakes).
  for g, n in enumerate(steps):
    for s in range(stages):
      np.testing.assert_array_equal(np.nonzero(table[:, s] == g)[0], s + g + groups * np.arange(n))
  # Prefill: group g on stage s at tick g + s.
  np.testing.assert_array_equal(out.prefill_table,
                                pipelined.expected_tick_table([1] * groups, stages,
                                                              groups + stages - 1))


# XLA:CPU's default codegen, in a subprocess: the suite's flags (tests/xla_env.py) compiled both
# programs of each case alike even before the fixes.
_DEFAULT_CODEGEN_CASES = """
import jax, numpy as np
from rlhfuse_jax.generation import instances, pipelined
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.models import attention, llama
from rlhfuse_jax.parallel import mesh as mesh_lib

def check(cfg, stages, b, p, lens, sampling, groups=2):
  tokens = np.random.default_rng(1).integers(1, cfg.vocab_size, (b, p)).astype(np.int32)
  gen = pipelined.PipelinedGenerator(cfg, sampling, batch_size=b, prompt_len=p, stages=stages,
                                     groups=groups)
  params = llama.host_random_params(cfg, 0)
  out = gen.generate(params, tokens, lens, jax.random.key(7))
  mesh = pipelined.reference_mesh(jax.devices(), b, groups)
  ref = instances.Generator(cfg, sampling, batch_size=b, prompt_len=p, mesh=mesh).generate(
      jax.device_put(params, mesh_lib.replicated(mesh)), tokens, lens, jax.random.key(7))
  np.testing.assert_array_equal(out.response_tokens, ref.response_tokens)
  np.testing.assert_array_equal(out.logprobs, ref.logprobs)
  return gen

cfg = llama.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=4,
                        num_heads=4, num_kv_heads=2, max_seq_len=160, scan_layers=True)
gen = check(cfg, 2, 4, 120, np.array([120, 97, 110, 64], np.int32),
            SamplingConfig(max_new_tokens=12, chunk_size=4))
assert gen.max_len > attention.CACHE_BLOCK_K
check(cfg.replace(num_layers=2, qk_norm=True, max_seq_len=64), 2, 8, 6,
      np.array([6, 1, 3, 5, 2, 6, 4, 3], np.int32), SamplingConfig(max_new_tokens=12, chunk_size=3))
# Unrolled: its prefill positions were opaque too (11 of 48 log-probs off, 1 layer per stage).
# 2 layers per stage: its stages run them unrolled, as the engine does; a scan there rounds
# 30 of 96 log-probs otherwise (7e-7), which the suite's codegen flags do not show.
check(cfg.replace(scan_layers=False, num_layers=4, max_seq_len=64), 2, 8, 6,
      np.array([6, 1, 3, 5, 2, 6, 4, 3], np.int32), SamplingConfig(max_new_tokens=12, chunk_size=3))
"""


def test_bitwise_the_engine_under_default_codegen():
  """Two cases whose log-probs differed from the engine's in their last bits (tokens equal):
  a cache longer than one key block (prompt bucket + max_new_tokens past
  attention.CACHE_BLOCK_K), where the prefill passed its positions 0 .. P-1 into the stage's cond
  as an operand, opaque there, so XLA compiled the attention's key-block loop without the trip
  count the engine's constant positions give (27 of 48 differed, the prefill's included); and
  one layer per stage with qk_norm, whose one-row parameter stack XLA saw as constants where
  the engine's loop body slices each layer out of L rows (about half of them differed); and an
  unrolled model, whose prefill had the same opaque positions, with two layers a stage (a
  stage that scanned its unrolled layers would differ too)."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _DEFAULT_CODEGEN_CASES], cwd=repo, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_batch_that_ends_at_prefill_runs_no_decode_chunk():
  """Every budget 1: each row has its one token from the prefill, and the first done-check
  (the last stage's record, the only stage that sees every row finish) ends the batch without
  a decode chunk."""
  _, out = _pipelined(CFG, 2, 2, budgets=np.ones(B, np.int32))
  assert (out.response_lens == 1).all() and out.decode_chunks == 0


def test_unrolled_model_equals_engine_bitwise():
  """An unrolled model: its stages run their layers unrolled, as the engine does; log-probs to
  the last bit (the default-codegen case above covers the same). (2 layers: a fast compile.)"""
  cfg = CFG.replace(scan_layers=False, num_layers=2)
  _, out = _pipelined(cfg, 2, 2)
  ref = _reference(cfg, 2)
  np.testing.assert_array_equal(out.response_tokens, ref.response_tokens)
  np.testing.assert_array_equal(out.response_lens, ref.response_lens)
  np.testing.assert_array_equal(out.logprobs, ref.logprobs)


def test_pallas_decode_equals_engine(monkeypatch):
  """The Pallas decode kernel (interpret mode here) on each stage device of the pipeline, with
  the scanned layers' traced layer index: the engine's tokens, log-probs to float32 rounding.
  On a GPU backend "auto" becomes this kernel (construction only: Triton cannot run here)."""
  _, out = _pipelined(CFG.replace(attention="pallas"), 2, 2)
  ref = _reference(CFG, 2)
  np.testing.assert_array_equal(out.response_tokens, ref.response_tokens)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=0, atol=1e-6)
  make = lambda: pipelined.PipelinedGenerator(CFG.replace(attention="auto"), SAMPLING,
                                              batch_size=B, prompt_len=P, stages=2, groups=2)
  assert make().cfg.attention == "auto"
  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  assert make().cfg.attention == "pallas"


def test_clear_errors():
  def make(cfg=CFG, stages=2, groups=2, batch_size=B):
    return pipelined.PipelinedGenerator(cfg, SAMPLING, batch_size=batch_size, prompt_len=P,
                                        stages=stages, groups=groups)
  with pytest.raises(ValueError, match="pipeline_groups=2 < config.generation.pipeline_stages=4"):
    make(stages=4, groups=2)
  with pytest.raises(ValueError, match="num_layers=4 is not divisible by .*pipeline_stages=3"):
    make(stages=3, groups=4)
  with pytest.raises(ValueError, match="batch_size=6 is not a positive multiple of "
                     "config.generation.pipeline_groups=4"):
    make(groups=4, batch_size=6)
  with pytest.raises(ValueError, match="pipeline_stages=16 needs 16 devices"):
    pipelined.check_pipeline(CFG.replace(num_layers=16), 16, 16, 16, 8)
  # The reference's mesh puts B/G rows on each device: it needs a batch G divides too.
  with pytest.raises(ValueError, match="batch_size=6 is not a positive multiple of "
                     "pipeline_groups=4"):
    pipelined.reference_mesh(jax.devices(), 6, 4)


def test_params_stacked_for_another_pipeline_are_refused():
  """Stage-stacked params are taken as they come (`is_staged`): a stack for 4 stages on a
  2-stage generator was split 2 rows per device and each stage ran 1 of its 2 layers (log-probs
  off by ~0.6, no error). Refused before anything compiles, naming the expected layout."""
  gen = pipelined.PipelinedGenerator(CFG, SAMPLING, batch_size=B, prompt_len=P, stages=2,
                                     groups=2)
  tokens, lens, budgets, uids = _prompts()
  staged = pipelined.stack_params(CFG, llama.host_random_params(CFG, 0), 4)
  with pytest.raises(ValueError, match=r"stage-stacked params: layers\[.*\] has shape "
                     r"\(4, 1, .*expected \[2, 2, \.\.\.\] for config\.generation\."
                     r"pipeline_stages=2 and model\.num_layers=4"):
    gen.generate(staged, tokens, lens, KEY, uids=uids, budgets=budgets)
  with pytest.raises(ValueError, match=r"expected \[2, 2, \.\.\.\]"):
    gen.compile(staged)
  with pytest.raises(ValueError, match=r"expected \[2, 2, \.\.\.\]"):
    gen.place(staged)
  assert gen.num_compiles == 0
  # Params stacked for this pipeline are placed as they are (place of place: the same tree).
  placed = gen.place(llama.host_random_params(CFG, 0))
  again = gen.place(placed)
  assert jax.tree.structure(again) == jax.tree.structure(placed)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(placed)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_params_with_another_layer_count_are_refused():
  """Unpipelined params of another depth: a scan_layers stack failed in numpy's reshape, and an
  unrolled tree with extra layers_i had them dropped without a word."""
  gen = pipelined.PipelinedGenerator(CFG, SAMPLING, batch_size=B, prompt_len=P, stages=2,
                                     groups=2)
  tokens, lens, budgets, uids = _prompts()
  for cfg in (CFG.replace(num_layers=2), CFG.replace(num_layers=6, scan_layers=False)):
    with pytest.raises(ValueError, match=f"params hold {cfg.num_layers} layers; expected "
                       "model.num_layers=4"):
      gen.generate(llama.host_random_params(cfg, 0), tokens, lens, KEY, uids=uids,
                   budgets=budgets)
  assert gen.num_compiles == 0


def test_pipeline_sizes_must_be_integers():
  """A float stage count failed while building the mesh (a TypeError in slicing), a float
  group count at the first generate (deep in jax); an integral float is the integer, as in
  SamplingConfig, anything else is refused naming the field."""
  gen = pipelined.PipelinedGenerator(CFG, SAMPLING, batch_size=float(B), prompt_len=P,
                                     stages=2.0, groups=np.float64(4))
  assert (gen.stages, gen.groups, gen.batch_size, gen.bg) == (2, 4, B, 2)
  assert all(type(x) is int for x in (gen.stages, gen.groups, gen.batch_size, gen.chunk_ticks))
  for kwargs, field in (({"groups": 2.5}, "config.generation.pipeline_groups=2.5"),
                        ({"stages": None}, "config.generation.pipeline_stages=None"),
                        ({"stages": True}, "config.generation.pipeline_stages=True"),
                        ({"batch_size": 8.5}, "batch_size=8.5")):
    args = {"batch_size": B, "stages": 2, "groups": 2, **kwargs}
    with pytest.raises(ValueError, match=f"{field}; expected an integer"):
      pipelined.PipelinedGenerator(CFG, SAMPLING, prompt_len=P, **args)


def test_bench_pipelined_tiny(tmp_path):
  """The acceptance command's code path at its test size: bitwise identical outputs against the
  Generator, busy fraction counted from the executed table, ticks equal to the formula."""
  from configs import bench_generation as bench_config  # pylint: disable=import-outside-toplevel
  from experiments import bench_generation  # pylint: disable=import-outside-toplevel
  c = bench_config.get_config("pipelined_tiny")
  c.warmup = 0  # timings are not checked here
  result = bench_generation.run_and_write(c, str(tmp_path))
  assert result["identical_outputs"] is True and result["identity"]["logprobs"]
  p, g = result["pipelined"], c.generation
  stages, groups, steps = g.pipeline_stages, g.pipeline_groups, g.max_new_tokens - 1
  assert p["group_steps"] == [steps] * groups
  assert p["ticks_match_formula"] and p["table_matches_formula"]
  # 7 steps x 4 groups + 1 fill = 29 ticks, in chunks of K*G = 8: 32 executed.
  assert p["formula"]["pipeline_ticks"] == steps * groups + stages - 1 == 29
  assert p["ticks"] == 32 and p["busy_stage_ticks"] == stages * steps * groups
  assert p["stage_busy_frac"] == steps * groups / 32 and p["stage_busy_frac_steady"] == 1.0
  table = np.asarray(result["decode_table"]).T  # [ticks, stages]
  assert (table[stages - 1:steps * groups] != pipelined.IDLE).all()  # after the fill: all busy
  assert (table[:stages - 1, -1] == pipelined.IDLE).all()  # the fill: the last stage waits
  assert (table[steps * groups + stages - 1:] == pipelined.IDLE).all()  # the chunk's rest
  with open(tmp_path / "result.json") as f:
    stored = json.load(f)
  assert stored["pipelined"]["stage_busy_frac"] == p["stage_busy_frac"]
  assert os.path.getsize(tmp_path / "schedule_pipelined.png") > 5_000


# Each live array's (device id, buffer pointer, bytes), by id(array), with a weak reference that
# tells a reused id from the same array: an array's buffers are fixed while it lives, and
# building its shards again at every sample took most of the test's time (35.0 -> 11.5 s CPU
# for both cases alone).
_SHARDS = {}


def _shard_bytes(a) -> list:
  ref, rows = _SHARDS.get(id(a), (None, None))
  if ref is None or ref() is not a:
    rows = [(s.device.id, s.data.unsafe_buffer_pointer(), s.data.nbytes)
            for s in a.addressable_shards]
    _SHARDS[id(a)] = (weakref.ref(a), rows)
  return rows


def _live_bytes() -> dict:
  """Bytes of live device buffers per device id (each buffer once: a shard's .data is a view)."""
  seen, out = set(), {}
  for a in jax.live_arrays():
    for device, pointer, nbytes in _shard_bytes(a):
      if (device, pointer) not in seen:
        seen.add((device, pointer))
        out[device] = out.get(device, 0) + nbytes
  return out


@pytest.mark.parametrize("scan_layers", [True, False])
def test_place_holds_one_stage_share_per_device(scan_layers):
  """`place` of an actor on devices (the trainer's, here replicated over all 8) copies each
  stage only its own layers: stacking first held a second whole copy of the layers on every
  device until the put ended (+ layers + share: issue 25's transient, a 65B actor's layers
  twice on a device). Live bytes per device are sampled at every call and return of this
  package's functions while it runs; the result is bitwise the host-placed tree."""
  cfg = CFG.replace(scan_layers=scan_layers)
  gen = pipelined.PipelinedGenerator(cfg, SAMPLING, batch_size=B, prompt_len=P, stages=4,
                                     groups=4)
  host = llama.host_random_params(cfg, 0)
  actor = jax.device_put(host, mesh_lib.replicated(mesh_lib.make_mesh(
      mesh_lib.MeshConfig(data=8), jax.devices())))
  stacked = pipelined.stack_params(cfg, host, 4)["layers"]
  share = sum(x.nbytes for x in jax.tree.leaves(stacked)) // 4
  leaf = max(x.nbytes for x in jax.tree.leaves(stacked)) // 4  # one leaf's transient copy
  base, peak = _live_bytes(), {}

  def sample(frame, event, arg):
    if event in ("call", "return") and "rlhfuse_jax" in frame.f_code.co_filename:
      for d, n in _live_bytes().items():
        peak[d] = max(peak.get(d, 0), n)
  sys.setprofile(sample)
  try:
    placed = gen.place(actor)
  finally:
    sys.setprofile(None)
  for d in range(4):  # the embedding and head are the actor's own buffers (relabelled)
    assert share <= peak[d] - base[d] <= share + leaf, (d, peak[d] - base[d], share)
  want = gen.place(host)
  assert jax.tree.structure(placed) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(want)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
