"""Measured costs of the fused engine's own executables, as a simulator calibration file.

The Rt choice (policy/rt.py, with the model of sim/rt_model.py) simulates with these, and the
benchmark writes them as `calibration.json`, which the simulator reads (policy/calibration.py,
sim/validation.py). On a GPU this is the calibration of "decode step time against occupied slots
and KV migration".

Measured on this process's first instance (and its second for migration), each the median of
`repeats` after a warm-up:

  decode_step  one chunk / its K steps, with 1 and with S live rows (on prompts whose chunk
               no EOS ends early: `measure_costs`). The compiled step has a
               fixed [S] shape, so the two are close: on fixed shapes it is the number of
               instances still stepping that costs, not how full they are.
  prefill      one instance's prefill call, as `overhead_s` (a fixed [S, P] shape: the same
               cost for any prompt lengths; the token rate is set so high that it adds nothing).
  inference    one micro-batch of every inference model, as `overhead_s` (fixed shape too;
               with fusion.inference_pp > 1 each stage in turn on the one instance, summed).
  migration    gather + device_put + scatter of one sample between two instances, as
               `latency_s` per moved sample (rows are copied whole: max_len, not the length).
  weight_load  the copy of every inference model onto an instance freed for inference, as the
               engine loads them (the frozen ones from host memory, the critic from where the
               caller holds it: the trainer's training devices, or host memory), in the bytes
               copied (the models' own dtypes: the file's byte_unit "stored",
               policy/calibration.py; bf16, 2 a parameter whatever the dtype, until 2026-12-04).
  devices_share_compute: true on the CPU platform (fake devices are one processor).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import jax
import numpy as np
from absl import logging

from rlhfuse_jax.generation import engine
from rlhfuse_jax.policy import calibration as cal_lib

# Prompt draws tried for a decode chunk that no EOS ends early (measure_costs).
_PROMPT_DRAWS = 8
# A rate high enough that `amount / rate` vanishes next to a measured per-call overhead.
_NEGLIGIBLE_RATE = 1e15


def median_s(fn: Callable[..., object], repeats: int,
             setup: Optional[Callable[[], object]] = None) -> float:
  """Median wall seconds of `fn()` over `repeats` calls, after one untimed call (compile).
  With `setup`, each call is `fn(setup())`, setup's result made before the clock starts (a
  fresh input for a call that donates it)."""
  def args() -> tuple:
    return () if setup is None else (setup(),)
  jax.block_until_ready(fn(*args()))  # warm-up
  times = []
  for _ in range(repeats):
    a = args()
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*a))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def shares_compute(gen) -> bool:
  return gen.instances[0].devices[0].platform == "cpu"


def measure_costs(gen, actor_params, frozen_params: dict, repeats: int = 3) -> dict:
  """Times the engine's executables (module docstring); returns a calibration-file dict."""
  inst = gen.instances[gen.local[0]]  # this process's (several processes: each its own)
  s, p = gen.config.slots, gen.prompt_len
  t = gen.sampling.max_new_tokens
  params = inst.place(gen.cfg, actor_params)
  rng = np.random.default_rng(0)
  tok = rng.integers(1, gen.cfg.vocab_size, (s, p)).astype(np.int32)  # [S, P]
  lens = np.full(s, p, np.int32)
  uids = np.arange(s, dtype=np.int32)
  key = jax.device_put(jax.random.key(0), inst.rep)
  full = np.full(s, t, np.int32)
  prefill_s = median_s(lambda: inst.prefill(params, tok, lens, uids, full, key), repeats)
  occupancies = sorted({1, s})
  step_s = [_decode_step_s(gen, inst, params, (tok, lens, uids), key, occ, rng, repeats)
            for occ in occupancies]
  ops = {"decode_step": {"occupied_slots": occupancies, "seconds": step_s},
         "prefill": {"tokens_per_s": _NEGLIGIBLE_RATE, "overhead_s": prefill_s}}

  if len(gen.local) > 1:
    ops["migration"] = {"bytes_per_s": _NEGLIGIBLE_RATE,
                        "latency_s": _migration_s(gen, inst, params, actor_params,
                                                  (tok, lens, uids, full), key, repeats)}
  # A freed instance decodes no more: the engine drops its actor copy before it loads the
  # inference models (fused._Run's params.pop), so the loads and scoring below are
  # timed without it, in the memory a run has for them (held, a model that fits the run could
  # fail here, out of memory, where the run would not).
  params = None

  mb = gen.config.micro_batch
  seq = rng.integers(1, gen.cfg.vocab_size, (mb, p + t)).astype(np.int32)  # [mb, P+T]
  load_s, inf_s = _load_and_inference_s(gen, inst, frozen_params, seq, repeats)
  if gen.models:
    # The bytes copied (byte_unit "stored"), split over the instance: a float32 model's 4 a
    # parameter. (Counted at bf16's 2 whatever the dtype, a reader sizing a float32 model at its
    # own bytes, as plan_search:train does, charged it twice the measured time.)
    copied = sum(a.nbytes for n in gen.models for a in jax.tree.leaves(frozen_params[n]))
    ops["weight_load"] = {"bytes_per_s": copied / gen.config.instance_devices / load_s}
  ops["inference"] = {"tokens_per_s": _NEGLIGIBLE_RATE, "overhead_s": inf_s}
  dev = inst.devices[0]
  cal = {"format": cal_lib.FORMAT, "byte_unit": "stored",
         "device": f"{dev.platform} ({dev.device_kind}), {len(inst.devices)} device(s) per "
                   "instance, measured by rlhfuse_jax/generation/measure.py",
         "model_params": int(gen.cfg.num_params()), "instance_devices": len(inst.devices),
         "devices_share_compute": shares_compute(gen), "ops": ops,
         "notes": f"slots={s}, prompt bucket={p}, max_new_tokens={t}, "
                  f"chunk={gen.sampling.chunk_size}, inference micro-batch={mb}; fixed-shape "
                  "executables: prefill and inference as per-call overhead_s, migration as "
                  "latency_s per sample"}
  cal_lib.from_dict(cal, "measured")  # what we return must load
  return cal


def _decode_step_s(gen, inst, params, prompt: tuple, key, occ: int, rng: np.random.Generator,
                   repeats: int) -> float:
  """Seconds per decode step with `occ` live rows: the median over chunks that run every step,
  so that neither an early EOS nor a call's fixed cost skews the per-step time."""
  tok, lens, uids = prompt  # [S, P], [S], [S]
  s, p = tok.shape
  t = gen.sampling.max_new_tokens
  full_steps = engine.chunk_steps(gen.sampling, t - 1)  # a chunk from a fresh prefill
  budget = np.where(np.arange(s) < occ, t, 0).astype(np.int32)

  def chunk(prompts):
    """(seconds, decode steps run) of one chunk from a fresh prefill of `prompts`."""
    st, _ = inst.prefill(params, prompts, lens, uids, budget, key)
    jax.block_until_ready(st)
    before = np.asarray(st.num_generated)  # read before the decode donates st
    t0 = time.perf_counter()
    after, summary = inst.decode(params, st, key)
    jax.block_until_ready(summary)
    elapsed = time.perf_counter() - t0
    longest = int(np.max(np.asarray(after.num_generated) - before))  # the last live row's
    # 0: every row ended at prefill (a stop token first) and the chunk ran no step, which
    # chunk_steps counts as one group of steps_per_check: where a full chunk is one group
    # (steps_per_check = chunk_size) it passed for a full one and timed a call that decoded
    # nothing.
    return elapsed, engine.chunk_steps(gen.sampling, longest) if longest else 0

  # A chunk stops once every row is done, so a sampled EOS (these prompts are random tokens)
  # can end it after a step or two: dividing by the full chunk's steps made the step several
  # times too cheap, and dividing by the steps run charges it the whole call's fixed cost.
  # So draw other prompts until one chunk runs every step (the first almost always does).
  prompts = tok
  for attempt in range(_PROMPT_DRAWS):
    ran = chunk(prompts)[1]  # also the warm-up
    if ran == full_steps:
      break
    prompts = rng.integers(1, gen.cfg.vocab_size, (s, p)).astype(np.int32)
  else:
    logging.warning("measure_costs: every chunk with %d occupied slot(s) stopped early (EOS "
                    "within %d steps on %d prompt draws): decode_step is its time per step "
                    "run, which includes the chunk's fixed cost", occ, full_steps,
                    _PROMPT_DRAWS)
  # max(ran, 1): no draw decoded a step (warned above); the call's time is all there is.
  return float(np.median([elapsed / max(ran, 1) for elapsed, ran in
                          (chunk(prompts) for _ in range(repeats))]))


def _migration_s(gen, inst, params, actor_params, prompt: tuple, key, repeats: int) -> float:
  """Seconds to move one sample's KV rows from `inst` to this process's second instance, the
  latency a consolidation pays per migrated sample."""
  tok, lens, uids, full = prompt  # [S, P], [S], [S], [S]
  s = tok.shape[0]
  dst = gen.instances[gen.local[1]]
  src_state = inst.prefill(params, tok, lens, uids, full, key)[0]
  holder = {"st": dst.prefill(dst.place(gen.cfg, actor_params), tok, lens, uids, full,
                              jax.device_put(key, dst.rep))[0]}

  def migrate():
    rows, _ = inst.gather(src_state, [0])
    holder["st"] = dst.scatter(holder["st"], [s - 1], dst.receive(rows))
    return holder["st"]
  return median_s(migrate, repeats)


def _load_and_inference_s(gen, inst, frozen_params: dict, seq: np.ndarray,
                          repeats: int) -> tuple[float, float]:
  """(load seconds, inference seconds) of a freed instance: its copy of every inference model
  and one micro-batch `seq` [mb, P+T] scored by each, whole or stage by stage (inference_pp)."""
  mb, p = seq.shape[0], gen.prompt_len
  plens, rlens = np.full(mb, p, np.int32), np.full(mb, seq.shape[1] - p, np.int32)
  placed: dict = {}  # the last load's copies: the inference below scores with them

  def place(stage: Optional[int]) -> Callable[[], dict]:
    def run():
      placed.clear()  # the previous copies freed first, as each timed load starts without them
      placed.update({n: inst.place(c, frozen_params[n]) if stage is None else
                     inst.place_stage(c, frozen_params[n], stage)
                     for n, c in gen.models.items()})
      return placed
    return run

  # The load of a freed instance (fused.InferenceQueue._load): every inference model from
  # where the caller holds it, the critic included (the trainer's: its training devices in one
  # process, a host copy with several or with a pipelined update; bench_generation's: host
  # memory). Its first micro-batch waits for all of them, so the critic's copy is charged too:
  # it was left out of the timing but its bytes charged at the frozen models' rate, and not at
  # all without one of them.
  pp = gen.config.inference_pp
  if pp == 1 or not gen.models:
    load_s = median_s(place(None), repeats) if gen.models else 0.0

    def score_all():
      inputs: dict = {}  # as fused.InferenceQueue._score: copied once for every model
      return [inst.score(n, placed[n], seq, plens, rlens, inputs) for n in placed]
    inf_s = median_s(score_all, repeats)
    return load_s, inf_s
  # Scoring on pipelines of pp instances: here every stage in turn on this one instance, one
  # stage's weights at a time (as each instance of a pipeline holds them), each stage fed
  # the previous one's output. The sums are the whole model's load and forward, which the
  # simulator splits into stages (GenSetup.inference_pp, cost_model.stage_cost).
  load_s = inf_s = 0.0
  x = dict.fromkeys(gen.models)
  out: dict = {}  # the last timed call's outputs: the next stage's input
  for stage in range(pp):
    load_s += median_s(place(stage), repeats)

    def run(stage=stage, x=x):
      inputs: dict = {}  # as fused.InferenceQueue._score_stages: copied once for every model
      out.update({n: inst.score_stage(n, stage, placed[n], x[n], seq, plens, rlens, inputs)
                  for n in placed})
      return out
    inf_s += median_s(run, repeats)
    x = dict(out)
  placed.clear()
  return load_s, inf_s
