r"""Decode tokens/s and achieved HBM bandwidth vs batch size, and the MFU of one PPO update.

  python -m experiments.bench_decode --config=configs/bench_decode.py --workdir=/tmp/bench_decode
  python -m experiments.bench_decode --config=configs/bench_decode.py:1b --workdir=/tmp/bench_1b

Decode: for each batch B the engine's own `Generator` (AOT-compiled prefill + chunked decode over
a donated KV cache) generates max_new_tokens per row from random prompts with random weights and
no EOS, so every row runs to the end: max_new_tokens - 1 decode steps per run. After `warmup`
untimed runs, `repeats` timed runs; the median decode wall time t gives

  tokens/s       = B * decode_steps / t
  step_s         = t / decode_steps
  achieved bw    = bytes_per_step / step_s   (bytes_per_step: the roofline, weights + the live
                   KV prefix; rlhfuse_jax/perf/accounting.py)
  bw fraction    = achieved bw / the preset's HBM bandwidth (sim/hardware.py), when known

Each batch row also carries XLA's memory figures of the compiled decode chunk (`decode_temp_bytes`
next to `cache_bytes`) and the prefill MFU. `capacity_scaling` times one decode chunk at a fixed
live length for several cache capacities (and, as the contrast, with whole-cache reference
attention); `scan_compile` times compiling the decode chunk at two depths with
model.scan_layers (and unrolled; null with config.scan_compile_layers=""); `peer` runs HF
transformers generation on the same shape on a GPU (config.peer). `--config.compile_only=True`
compiles from shapes and reports the memory figures and compile times without running anything
(e.g. `:1b` on a CPU).

The decode time includes the engine's one host read of the [B] `done` vector per chunk, as in
real use. Training: one `trainer.ppo.make_update_fn` step (actor and critic forward + backward +
AdamW) on train_batch random samples, timed the same way (block_until_ready on the new states);
MFU = model FLOPs (accounting.ppo_update_flops) / step time / the preset's peak bf16 FLOP/s.

The peak is looked up from `jax.devices()[0].device_kind` (config.hardware="auto"); on a CPU, or a
device no preset matches, fractions are null and the result says "unknown peak". Only device 0
is used. Writes result.json, calibration.json (rlhfuse_jax/policy/calibration.py format: decode step
time vs batch, prefill rate, train-stage forward times), bench_decode.png and config.json.

Docs: docs/results.md ("Decode throughput and MFU (H200, H100)", "Decode speed: CPU proxies").
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from experiments import config_files
from experiments import runner
from rlhfuse_jax import metrics
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.generation import instances
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.models import attention, llama, sequences
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.perf import accounting, scale_check
from rlhfuse_jax.perf.bench_config import BenchDecodeConfig
from rlhfuse_jax.rl import optim
from rlhfuse_jax.policy import calibration
from rlhfuse_jax.trainer import ppo
from rlhfuse_jax.trainer.config import AlgoConfig

_CONFIG = config_flags.DEFINE_config_file("config", None, "Benchmark config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
flags.mark_flags_as_required(["config", "workdir"])

UNKNOWN_PEAK = "unknown peak"
BYTES_FORMULA = (
    "weight_bytes + kv_bytes; weight_bytes = all params except the untied input embedding "
    "(only batch rows gathered); kv_bytes = 2 * layers * batch * mean_live_len * kv_heads * "
    "head_dim * itemsize (the live prefix each step attends over, averaged over the run's "
    "steps, not the cache's capacity); see rlhfuse_jax/perf/accounting.py")


def _timed_runs(fn: Callable[[], Any], warmup: int, repeats: int, what: str) -> list[float]:
  """Wall seconds of `repeats` calls of fn after `warmup` untimed ones; fn blocks on its result."""
  for _ in range(warmup):
    fn()
  times = []
  for i in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
    logging.info("%s: run %d/%d %.4f s", what, i + 1, repeats, times[-1])
  return times


def make_generator(cfg: BenchDecodeConfig, params: Any, batch: int) -> instances.Generator:
  """The engine's generator for one batch size (compiles prefill and decode ahead of time)."""
  return instances.Generator(
      cfg.model, _sampling(cfg.max_new_tokens, cfg.chunk_size, cfg.steps_per_check),
      batch_size=batch, prompt_len=cfg.prompt_len, params=params)


def measure_decode(cfg: BenchDecodeConfig, gen: instances.Generator, params: Any) -> dict:
  """Times the engine's decode at the generator's batch size; returns the per-batch entry."""
  batch = gen.batch_size
  rng = np.random.default_rng([cfg.seed, batch])
  prompts = rng.integers(1, cfg.model.vocab_size, (batch, cfg.prompt_len)).astype(np.int32)
  lens = np.full((batch,), cfg.prompt_len, np.int32)  # [B]
  key = jax.random.key(cfg.seed)
  runs = []

  def once():
    runs.append(gen.generate(params, prompts, lens, key))  # returns host arrays: synchronous

  _timed_runs(once, cfg.warmup, cfg.repeats, f"decode batch {batch}")
  timed = runs[cfg.warmup:]
  steps = cfg.max_new_tokens - 1
  for r in timed:
    if r.decode_steps != steps:  # no EOS, so every row must run to max_new_tokens
      raise RuntimeError(f"batch {batch}: {r.decode_steps} decode steps, expected {steps}")
  decode_runs = [r.decode_s for r in timed]
  prefill_runs = [r.prefill_s for r in timed]
  decode_s = float(np.median(decode_runs))
  step_s = decode_s / steps
  live = accounting.mean_live_len(cfg.prompt_len, steps)
  nbytes = accounting.decode_step_bytes(cfg.model, batch, live)
  out = {
      "batch": batch, "decode_steps": steps, "decode_s": decode_s,
      "decode_s_runs": decode_runs, "prefill_s": float(np.median(prefill_runs)),
      "prefill_s_runs": prefill_runs, "step_s": step_s,
      "tokens_per_s": batch * steps / decode_s,
      # Prefill: the prompt through the backbone, the LM head at each row's last position.
      "prefill_flops": accounting.forward_flops(cfg.model, batch, cfg.prompt_len, 1),
      "mean_live_len": live, "weight_bytes": nbytes["weight_bytes"],
      "kv_bytes": nbytes["kv_bytes"], "bytes_per_step": nbytes["total_bytes"],
      "achieved_bw_bytes_per_s": nbytes["total_bytes"] / step_s,
      # What the instance ran: "auto" becomes "pallas" on a GPU (attention.instance_attention),
      # and how its one-token decode attended ("kernel", "whole" cache, live-prefix "loop"):
      # "auto" alone did not say which (on CPU the loop, on a GPU whose heads the kernel does
      # not split the whole cache).
      "attention": gen.cfg.attention,
      "decode_attention_path": attention.cache_attention_path(gen.cfg.attention, 1),
      **_memory_row(gen),
  }
  logging.info("decode batch %d: %.1f tokens/s, %.3f ms/step, %.3g GB/s achieved", batch,
               out["tokens_per_s"], 1e3 * step_s, out["achieved_bw_bytes_per_s"] / 1e9)
  return out


def _memory_row(gen: instances.Generator) -> dict:
  """The compiled decode chunk's temporaries and the KV cache it carries (XLA's accounting)."""
  mem = gen.memory()
  return {**mem, "decode_temp_over_cache": mem["decode_temp_bytes"] / mem["cache_bytes"]}


def _sampling(max_new_tokens: int, chunk_size: int, steps_per_check: int = 1) -> SamplingConfig:
  # No EOS: every row decodes to the end, so the step count is known.
  return SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens, eos_id=-1, pad_id=0,
                        chunk_size=chunk_size, steps_per_check=steps_per_check)


def compile_memory(cfg: BenchDecodeConfig, model: llama.ModelConfig) -> list[dict]:
  """Per batch size: the decode chunk and prefill compiled from shapes, XLA's memory figures."""
  rows = []
  for b in cfg.batch_sizes:
    gen = instances.Generator(
        model, _sampling(cfg.max_new_tokens, cfg.chunk_size, cfg.steps_per_check),
        batch_size=b, prompt_len=cfg.prompt_len)
    gen.compile(scale_check.abstract_params(model, mesh_lib.replicated(gen.mesh)))
    rows.append({"batch": b, **_memory_row(gen)})
    logging.info("compiled decode batch %d: temporaries %s = %.3f x the %s KV cache", b,
                 metrics.size(rows[-1]["decode_temp_bytes"]), rows[-1]["decode_temp_over_cache"],
                 metrics.size(rows[-1]["cache_bytes"]))
  return rows


def measure_scan_compile(cfg: BenchDecodeConfig) -> dict:
  """Compile seconds of the decode chunk (+ prefill) at each depth of scan_compile_layers, with
  model.scan_layers and unrolled, from shapes (nothing allocated). ratio: deepest over
  shallowest."""
  out = {"layers": list(cfg.scan_compile_layers), "batch": cfg.batch_sizes[-1],
         "persistent_cache_dir": jax.config.jax_compilation_cache_dir}
  if out["persistent_cache_dir"]:  # a program compiled before would be loaded, not compiled
    logging.warning("jax's persistent compilation cache is on (%s): the compile times below "
                    "include loads of programs compiled before; unset JAX_COMPILATION_CACHE_DIR "
                    "to time compilation", out["persistent_cache_dir"])
  for key, scan in (("compile_s", True), ("unrolled_compile_s", False)):
    times = []
    for n in cfg.scan_compile_layers:
      model = cfg.model.replace(num_layers=n, scan_layers=scan)
      gen = instances.Generator(
          model, _sampling(cfg.max_new_tokens, cfg.chunk_size, cfg.steps_per_check),
          batch_size=cfg.batch_sizes[-1], prompt_len=cfg.prompt_len)
      params = scale_check.abstract_params(model, mesh_lib.replicated(gen.mesh))
      # The bench compiled the configured model's program before (compile_memory): from jax's
      # in-memory cache it "compiled" in 0.02 s, a 952x ratio on the unrolled 1b preset.
      jax.clear_caches()
      t0 = time.perf_counter()
      gen.compile(params)
      times.append(time.perf_counter() - t0)
      logging.info("decode chunk + prefill, %d layers, %s: compiled in %.2f s", n,
                   "scanned" if scan else "unrolled", times[-1])
    out[key] = times
    out[key.replace("compile_s", "ratio")] = times[-1] / times[0]
  return out


def measure_capacity_scaling(cfg: BenchDecodeConfig, params: Any) -> dict:
  """Decode step time at one live length for each capacity, at the largest batch.

  Each run prefills prompts of live_len - steps tokens into a cache of the capacity, then times
  one decode chunk of `steps` steps (ending with every row at live_len live positions). The
  model's max_seq_len is raised to the largest capacity (RoPE has no table to outgrow). The
  same with model.attention="reference" (which attends over every cache slot) is the contrast:
  its ratio shows what reading the whole capacity would cost on this machine."""
  batch, steps = cfg.batch_sizes[-1], cfg.capacity_steps
  prompt_len = cfg.capacity_live_len - steps
  rng = np.random.default_rng([cfg.seed, 11])
  prompts = rng.integers(1, cfg.model.vocab_size, (batch, prompt_len)).astype(np.int32)
  lens = np.full((batch,), prompt_len, np.int32)
  uids = np.arange(batch, dtype=np.int32)
  key = jax.random.key(cfg.seed)
  out = {"live_len": cfg.capacity_live_len, "capacities": list(cfg.capacities), "batch": batch,
         "steps": steps}
  for name, impl in (("step_s", cfg.model.attention), ("reference_step_s", "reference")):
    model = cfg.model.replace(max_seq_len=max(cfg.capacities), attention=impl)
    runs = []
    for cap in cfg.capacities:
      gen = instances.Generator(model, _sampling(cap - prompt_len, steps), batch_size=batch,
                                prompt_len=prompt_len, params=params)
      runs.append((cap, gen, gen.place(params), np.full(batch, cap - prompt_len, np.int32)))
    times = [[] for _ in runs]
    # Interleaved, one run of each capacity per round: a change in what else the machine runs
    # then slows every capacity alike, and the ratio below still compares like with like (in
    # turn, a test suite's other worker once made the first capacity 4x slower than the last).
    for i in range(cfg.warmup + cfg.repeats):
      for (cap, gen, placed, budget), cap_times in zip(runs, times):
        state, _ = jax.block_until_ready(gen.prefill(placed, prompts, lens, uids, budget, key))
        t0 = time.perf_counter()
        state, _ = jax.block_until_ready(gen.decode(placed, state, key))
        if i >= cfg.warmup:
          cap_times.append((time.perf_counter() - t0) / steps)
        n = int(mesh_lib.to_host(state.num_generated).min())
        if n != steps + 1:
          raise RuntimeError(f"capacity {cap}: rows generated {n} tokens, expected {steps + 1}")
        del state
    per_cap = [float(np.median(t)) for t in times]
    for cap, t in zip(cfg.capacities, per_cap):
      logging.info("capacity %d, live %d, %s attention: %.4f ms/step", cap,
                   cfg.capacity_live_len, impl, 1e3 * t)
    out[name] = per_cap
    out[name.replace("step_s", "ratio")] = per_cap[-1] / per_cap[0]
  return out


def measure_peer(cfg: BenchDecodeConfig, batch: int) -> dict:
  """HF transformers generation of the same shape, dtype, batch and lengths (random weights,
  static KV cache, sampling, no early stop), timed as ours: decode seconds = median time of
  max_new_tokens tokens minus median time of 1 token (prefill + first token). transformers'
  own compiled static-cache generation where it works, eager otherwise; `mode` says which."""
  import torch  # only where the peer runs: not a dependency of this package
  import transformers
  m = cfg.model
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
  hf_cfg = transformers.LlamaConfig(
      vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
      num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
      num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim_,
      max_position_embeddings=m.max_seq_len, rope_theta=m.rope_theta,
      rms_norm_eps=m.rms_norm_eps, tie_word_embeddings=m.tie_embeddings)
  torch.manual_seed(cfg.seed)
  model = transformers.LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype[m.dtype]).eval()
  ids = torch.randint(1, m.vocab_size, (batch, cfg.prompt_len), device=device)
  n = cfg.max_new_tokens

  def generate(tokens: int) -> float:
    with torch.inference_mode():
      t0 = time.perf_counter()
      out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                           temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=tokens,
                           min_new_tokens=tokens, pad_token_id=0,
                           cache_implementation="static", **extra)
      if device == "cuda":
        torch.cuda.synchronize()
      dt = time.perf_counter() - t0
    if out.shape[1] != cfg.prompt_len + tokens:
      raise RuntimeError(f"HF generated {out.shape[1] - cfg.prompt_len} tokens, asked {tokens}")
    return dt

  # transformers compiles the forward of a static-cache generation itself (its auto-compile);
  # wrapping model.forward in torch.compile as well failed on an H100 with transformers 5.17
  # ("accessing tensor output of CUDAGraphs that has been overwritten",
  # experiments/results/h100_decode_variants), so the first try is plain generate, labelled
  # compiled only if dynamo compiled a graph, and the fallback is eager (disable_compile=True).
  from torch._dynamo.utils import counters  # pylint: disable=import-outside-toplevel
  extra = {}
  graphs = counters["stats"]["unique_graphs"]
  try:
    generate(n)
    compiled = counters["stats"]["unique_graphs"] > graphs
    mode = ("generate(static cache), compiled by transformers" if compiled
            else "generate(static cache), eager: transformers did not compile it")
  except Exception as e:  # noqa: BLE001 any compile failure: measure eager instead, say why
    logging.warning("peer: compiled generation failed (%s: %s); timing eager", type(e).__name__, e)
    mode, extra = f"eager (compiled generation failed: {type(e).__name__})", {
        "disable_compile": True}
  full = _timed_runs(lambda: generate(n), cfg.warmup, cfg.repeats, f"peer batch {batch}")
  first = _timed_runs(lambda: generate(1), cfg.warmup, cfg.repeats, f"peer prefill {batch}")
  decode_s = float(np.median(full)) - float(np.median(first))
  return {"batch": batch, "mode": mode, "device": device, "torch": torch.__version__,
          "transformers": transformers.__version__, "generate_s_runs": full,
          "prefill_s_runs": first, "decode_s": decode_s, "decode_steps": n - 1,
          "tokens_per_s": batch * (n - 1) / decode_s}


def peer_baselines(cfg: BenchDecodeConfig, per_batch: list[dict]) -> dict:
  """HF peer per batch size and ours/peer tokens/s, or why the peer was not run."""
  platform = jax.devices()[0].platform
  if cfg.peer == "none" or (cfg.peer == "auto" and platform != "gpu"):
    return {"skipped": f"config.peer={cfg.peer!r} on platform {platform!r} (auto runs the peer "
                       "on a GPU only)"}
  try:
    import torch  # noqa: F401 (availability check)
    import transformers  # noqa: F401
  except ImportError as e:
    if cfg.peer == "hf":
      raise
    return {"skipped": f"torch/transformers not importable: {e}"}
  rows = []
  for ours in per_batch:
    try:
      peer = measure_peer(cfg, ours["batch"])
      peer["ours_over_peer"] = ours["tokens_per_s"] / peer["tokens_per_s"]
    except Exception as e:  # noqa: BLE001 a failed peer is reported, not fatal to our figures
      logging.exception("peer batch %d failed", ours["batch"])
      peer = {"batch": ours["batch"], "error": f"{type(e).__name__}: {e}"}
    rows.append(peer)
  return {"per_batch": rows}


def _train_batch(cfg: BenchDecodeConfig) -> dict:
  b, p, t = cfg.train_batch, cfg.train_prompt_len, cfg.train_response_len
  v = cfg.model.vocab_size
  rng = np.random.default_rng([cfg.seed, 7])
  mb = {
      "tokens": rng.integers(1, v, (b, p + t)).astype(np.int32),  # [B, P+T]
      "prompt_lens": np.full((b,), p, np.int32),  # [B]
      "mask": np.ones((b, t), np.float32),  # [B, T] every response token real
      "old_logp": np.full((b, t), -np.log(v), np.float32),  # [B, T] uniform policy
      "ref_logp": np.full((b, t), -np.log(v), np.float32),
      "advantages": rng.standard_normal((b, t)).astype(np.float32),
      "returns": rng.standard_normal((b, t)).astype(np.float32),
      "old_values": np.zeros((b, t), np.float32),
  }
  return jax.device_put(mb, jax.devices()[0])


def random_params(cfgs: list, key: jax.Array) -> list:
  """Random N(0, 0.02) weights (norm scales 1 + noise) for each model config, a leaf at a time:
  one small compiled draw per distinct leaf shape (a few), each leaf from its own folded key.
  Timing does not depend on the values. (One flat draw sliced into the ~200 leaves of the 1.1B
  model compiled in 2 min 51 s on an H200 with jax 0.11.2, 2026-12-04.)"""
  @functools.partial(jax.jit, static_argnums=(1, 2, 3))
  def draw(k, shape, dtype, is_scale):
    x = 0.02 * jax.random.normal(k, shape, dtype)
    return x + 1 if is_scale else x

  trees = []
  for i, c in enumerate(cfgs):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(llama.param_shapes(c))
    k = jax.random.fold_in(key, i)
    arrays = [draw(jax.random.fold_in(k, j), tuple(s.shape), jnp.dtype(s.dtype),
                   "scale" in jax.tree_util.keystr(path))
              for j, (path, s) in enumerate(leaves)]
    trees.append(jax.tree_util.tree_unflatten(treedef, arrays))
  return trees


@dataclasses.dataclass
class TrainBench:
  """Compiled executables and inputs of the training measurement."""
  update: Any  # compiled ppo update(actor, critic, mb) -> (actor, critic, metrics), donating
  actor_fwd: Any  # compiled actor forward (response log-probs + entropy)
  critic_fwd: Any  # compiled critic forward (response values)
  state: dict  # {"actor": ModelState, "critic": ModelState}, replaced after every update
  mb: dict
  attention: str = ""  # the attention the update's program holds (attention_in)


def attention_in(lowered_text: str, configured: str) -> str:
  """The attention a lowered program holds: "cudnn" where it calls cuDNN's fused attention,
  else what `configured` (model.attention) runs without it ("cudnn", "auto" and "pallas" fall
  back to blockwise, silently for "auto": models/attention.dot_product_attention). The update's
  MFU depends on it (H100: 35.9 % with cuDNN, 28 % blockwise at 8 x 512), and "auto" alone did
  not say which ran."""
  if "__cudnn$fmha" in lowered_text:
    return "cudnn"
  return "blockwise" if configured in ("cudnn", "auto", "pallas") else configured


def make_train_bench(cfg: BenchDecodeConfig, actor_params: Any, critic_params: Any,
                     pool: concurrent.futures.Executor) -> TrainBench:
  """Builds the optimizer states and batch and compiles the update and the two forwards (as
  three concurrent tasks of `pool`)."""
  actor_cfg, critic_cfg = cfg.model, cfg.critic_model
  t = cfg.train_response_len
  tx = optim.make_optimizer(1e-5, warmup_steps=1, total_steps=1_000_000)
  actor = ppo.ModelState(actor_params, tx.init(actor_params))
  critic = ppo.ModelState(critic_params, tx.init(critic_params))
  mb = _train_batch(cfg)
  update = ppo.make_update_fn(actor_cfg, critic_cfg, AlgoConfig(), 1.0, tx, tx)
  fwd_a = jax.jit(lambda prm, x: sequences.response_logprobs_and_entropy(
      actor_cfg, prm, x["tokens"], x["prompt_lens"], t))
  fwd_c = jax.jit(lambda prm, x: sequences.response_values(
      critic_cfg, prm, x["tokens"], x["prompt_lens"], t))
  lowered = update.lower(actor, critic, mb)
  jobs = [pool.submit(lowered.compile),
          pool.submit(lambda: fwd_a.lower(actor_params, mb).compile()),
          pool.submit(lambda: fwd_c.lower(critic_params, mb).compile())]
  return TrainBench(update=jobs[0].result(), actor_fwd=jobs[1].result(),
                    critic_fwd=jobs[2].result(), state={"actor": actor, "critic": critic},
                    mb=mb, attention=attention_in(lowered.as_text(), actor_cfg.attention))


def measure_train(cfg: BenchDecodeConfig, tb: TrainBench) -> dict:
  """Times one PPO update (actor + critic) and each model's forward on the same batch."""
  state, mb, t = tb.state, tb.mb, cfg.train_response_len

  def step():  # the update donates the states: only `state` holds the live ones
    state["actor"], state["critic"], m = tb.update(state["actor"], state["critic"], mb)
    jax.block_until_ready((state["actor"], state["critic"], m))

  step_runs = _timed_runs(step, cfg.warmup, cfg.repeats, "ppo update")
  pa, pc = state["actor"].params, state["critic"].params
  fa_runs = _timed_runs(lambda: jax.block_until_ready(tb.actor_fwd(pa, mb)), cfg.warmup,
                        cfg.repeats, "actor forward")
  fc_runs = _timed_runs(lambda: jax.block_until_ready(tb.critic_fwd(pc, mb)), cfg.warmup,
                        cfg.repeats, "critic forward")
  step_s = float(np.median(step_runs))
  tokens = cfg.train_batch * (cfg.train_prompt_len + t)
  flops = accounting.ppo_update_flops(cfg.model, cfg.critic_model, cfg.train_batch,
                                      cfg.train_prompt_len, t)
  out = {
      "batch": cfg.train_batch, "prompt_len": cfg.train_prompt_len, "response_len": t,
      "tokens": tokens, "step_s": step_s, "step_s_runs": step_runs,
      "tokens_per_s": tokens / step_s, "flops": flops, "achieved_flops_per_s": flops / step_s,
      "flops_6nd": accounting.six_nd_flops(cfg.model, cfg.critic_model, tokens),
      "actor_fwd_s": float(np.median(fa_runs)), "critic_fwd_s": float(np.median(fc_runs)),
      "attention": tb.attention,
  }
  logging.info("ppo update: %.4f s, %.1f tokens/s, %.3g FLOP/s achieved", step_s,
               out["tokens_per_s"], out["achieved_flops_per_s"])
  return out


def add_fractions(result: dict, peak_flops: float | None, peak_bw: float | None) -> dict:
  """Adds bw_fraction and prefill_mfu per decode batch and mfu / mfu_6nd to the train entry
  (None: unknown peak; `run` passes none for a model that does not compute in bfloat16, whose
  peak the hardware presets do not hold)."""
  for row in result["decode"]["per_batch"]:
    row["bw_fraction"] = accounting.fraction(row["achieved_bw_bytes_per_s"], peak_bw)
    row["prefill_mfu"] = accounting.fraction(row["prefill_flops"] / row["prefill_s"], peak_flops)
  tr = result["train"]
  tr["mfu"] = accounting.fraction(tr["achieved_flops_per_s"], peak_flops)
  tr["mfu_6nd"] = accounting.fraction(tr["flops_6nd"] / tr["step_s"], peak_flops)
  return result


def calibration_file(result: dict) -> dict:
  """The measurements as a simulator calibration file (rlhfuse_jax/policy/calibration.py)."""
  dev, dec, tr = result["device"], result["decode"], result["train"]
  rows = dec["per_batch"]
  largest = rows[-1]
  ops = {
      "decode_step": {"occupied_slots": [r["batch"] for r in rows],
                      "seconds": [r["step_s"] for r in rows]},
      "prefill": {"tokens_per_s": largest["batch"] * dec["prompt_len"] / largest["prefill_s"]},
  }
  fwd = tr["actor_fwd_s"] + tr["critic_fwd_s"]
  bwd_over_fwd = (tr["step_s"] - fwd) / fwd
  notes = (f"decode_step: an instance of B slots, all live (B = occupied_slots), attending over "
           f"the live prefix, {largest['mean_live_len']:g} positions on average (prompt "
           f"{dec['prompt_len']}, {largest['decode_steps']} steps; cache capacity "
           f"{dec['cache_len']}); per_context_token_s is not fitted, so the times hold for this "
           f"mean length. prefill: "
           f"{largest['batch']} x {dec['prompt_len']} tokens, first token sampled included. ")
  if bwd_over_fwd > 0:
    seq_len = tr["prompt_len"] + tr["response_len"]
    ops["train_stage"] = {"actor_fwd_s": tr["actor_fwd_s"], "critic_fwd_s": tr["critic_fwd_s"],
                          "bwd_over_fwd": bwd_over_fwd, "tokens": tr["batch"] * seq_len,
                          "seq_len": seq_len}
    notes += (f"train_stage: one micro-batch of {tr['batch']} x {tr['prompt_len']} + "
              f"{tr['response_len']} tokens on one stage (no pipeline); bwd_over_fwd = (update "
              f"- forwards) / forwards, so it includes the AdamW step.")
  else:
    notes += (f"train_stage omitted: the update ({tr['step_s']:.4g} s) did not take longer than "
              f"the two forwards ({fwd:.4g} s), so no backward time could be derived.")
  return {
      "format": calibration.FORMAT,
      "device": f"{dev['platform']} ({dev['device_kind']}), measured by "
                f"experiments/bench_decode.py",
      "model_params": result["model"]["num_params"], "instance_devices": 1,
      # Fake CPU devices are one shared processor (see calibration.py).
      "devices_share_compute": dev["platform"] == "cpu",
      "ops": ops, "notes": notes,
  }


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = result["decode"]["per_batch"]
  b = [r["batch"] for r in rows]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  ax1.plot(b, [r["tokens_per_s"] for r in rows], "o-")
  ax1.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s",
          title="decode throughput")
  ax2.plot(b, [r["achieved_bw_bytes_per_s"] / 1e9 for r in rows], "o-", label="achieved")
  peak = result["device"]["peak_hbm_bw_bytes_per_s"]
  if peak:
    ax2.axhline(peak / 1e9, color="k", ls="--", label=f"peak {result['device']['peak']}")
  # The KV bytes the result counted, as its formula says: the live prefix (BYTES_FORMULA), or
  # the whole cache in a result kept from before (h100_bench_decode_1b, whose redraw said
  # "live KV" of its whole-cache bytes)
  formula = result["decode"].get("bytes_per_step_formula", BYTES_FORMULA)
  kv = "live KV" if "mean_live_len" in formula else "full KV cache"
  ax2.set(xscale="log", xlabel="batch", ylabel=f"GB/s (weights + {kv} per step)",
          title="achieved memory bandwidth" + ("" if peak else f" ({UNKNOWN_PEAK})"))
  ax2.legend()
  dev = result["device"]
  fig.suptitle(f"{dev['device_kind']} ({dev['platform']}), {result['model']['num_params']:,} "
               f"params, {result['model']['dtype']}, cache {result['decode']['cache_len']}")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def run(cfg: BenchDecodeConfig, workdir: str) -> dict:
  """Runs every measurement and writes result.json, calibration.json and the PNG."""
  t_start = time.perf_counter()
  device = jax.devices()[0]
  hw = cfg.resolve_hardware(device.device_kind)
  logging.info("device %s (%s); peak: %s", device.device_kind, device.platform,
               hw.name if hw else UNKNOWN_PEAK)
  key = jax.random.key(cfg.seed)
  params, critic_params = random_params([cfg.model, cfg.critic_model], key)
  logging.info("model: %s params (%s)", f"{cfg.model.num_params():,}", cfg.model.param_dtype)
  # Every executable is compiled before anything is timed, concurrently: XLA compiles outside
  # the GIL, and compilation, not measurement, is most of a small run's wall time.
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(len(cfg.batch_sizes) + 3) as pool:
    gens = [pool.submit(make_generator, cfg, params, b) for b in cfg.batch_sizes]
    train_bench = make_train_bench(cfg, params, critic_params, pool)
    gens = [g.result() for g in gens]
  compile_s = time.perf_counter() - t0
  logging.info("compiled %d generators and the ppo update in %.1f s", len(gens), compile_s)
  per_batch = []
  for i, gen in enumerate(gens):
    logging.info("decode batch %d (%d/%d)", gen.batch_size, i + 1, len(gens))
    per_batch.append(measure_decode(cfg, gen, params))
  del gens
  logging.info("capacity scaling: live length %d, capacities %s", cfg.capacity_live_len,
               cfg.capacities)
  capacity = measure_capacity_scaling(cfg, params)
  peer = peer_baselines(cfg, per_batch)
  logging.info("ppo update: batch %d x %d tokens", cfg.train_batch,
               cfg.train_prompt_len + cfg.train_response_len)
  train = measure_train(cfg, train_bench)
  del params, critic_params, train_bench  # donated to the update
  scan = measure_scan_compile(cfg) if cfg.scan_compile_layers else None
  result = {
      "device": {
          "platform": device.platform, "device_kind": device.device_kind,
          "num_devices": jax.device_count(), "devices_used": 1,
          "hardware_preset": hw.name if hw else None,
          "peak": hw.name if hw else UNKNOWN_PEAK,
          "peak_bf16_flops": hw.peak_flops if hw else None,
          "peak_hbm_bw_bytes_per_s": hw.hbm_bw if hw else None,
      },
      "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__,
      "model": {**dataclasses.asdict(cfg.model), "num_params": cfg.model.num_params(),
                "critic_num_params": cfg.critic_model.num_params()},
      "decode": {
          "prompt_len": cfg.prompt_len, "max_new_tokens": cfg.max_new_tokens,
          "cache_len": cfg.cache_len, "chunk_size": cfg.chunk_size,
          "steps_per_check": cfg.steps_per_check, "warmup": cfg.warmup,
          "repeats": cfg.repeats,
          "bytes_per_step_formula": BYTES_FORMULA,
          "per_batch": per_batch,
      },
      "capacity_scaling": capacity,
      "scan_compile": scan,
      "peer": peer,
      "compile_s": compile_s,
      "train": {**train, "flops_formula": (
          "3 x forward per model (actor + critic); forward = B*S*(2*layers*layer_matmul_params "
          "+ 4*layers*heads*head_dim*(S+1)/2) + B*T*2*hidden*head_width; see "
          "rlhfuse_jax/perf/accounting.py")},
  }
  # The presets' peak is the dense bfloat16 one: a float32 model's MFU against it understated
  # it 2-15x (TF32 or plain float32 peaks), so as the trainer's perf/mfu it is left out (None).
  bf16 = cfg.model.dtype == "bfloat16"
  add_fractions(result, hw.peak_flops if hw and bf16 else None, hw.hbm_bw if hw else None)
  result["wall_s"] = time.perf_counter() - t_start
  runner.write_result(workdir, result)
  cal = calibration_file(result)
  calibration.from_dict(cal, "bench_decode")  # what we write must load
  runner.write_result(workdir, cal, "calibration.json")
  plot(result, os.path.join(workdir, "bench_decode.png"))
  return result


def _device_entry() -> dict:
  device = jax.devices()[0]
  return {"platform": device.platform, "device_kind": device.device_kind,
          "num_devices": jax.device_count(), "devices_used": 1}


def compile_only(cfg: BenchDecodeConfig, workdir: str) -> dict:
  """Compiles the decode chunk and prefill at every batch size from shapes and reports XLA's
  memory figures, and the scan-over-layers compile times; runs and allocates nothing, so the
  accelerator shape (`:1b`) is checked on any machine.

  On a CPU with a 16-bit model the same is compiled at float32 too (`float32_per_batch`):
  XLA:CPU has no bfloat16 matmul, so it converts every weight to float32 once per chunk
  (hoisted out of the decode loop), 2 bytes per parameter of temporaries that a GPU or TPU
  does not have; the float32 compile has no conversion and shows the program's own."""
  t_start = time.perf_counter()
  result = {"compile_only": True, "device": _device_entry(), "jax_version": jax.__version__,
            "model": {**dataclasses.asdict(cfg.model), "num_params": cfg.model.num_params()},
            "decode": {"prompt_len": cfg.prompt_len, "max_new_tokens": cfg.max_new_tokens,
                       "cache_len": cfg.cache_len, "chunk_size": cfg.chunk_size,
                       "per_batch": compile_memory(cfg, cfg.model)}}
  if result["device"]["platform"] == "cpu" and cfg.model.dtype != "float32":
    f32 = cfg.model.replace(dtype="float32", param_dtype="float32")
    result["decode"]["float32_per_batch"] = compile_memory(cfg, f32)
  result["scan_compile"] = measure_scan_compile(cfg) if cfg.scan_compile_layers else None
  result["wall_s"] = time.perf_counter() - t_start
  runner.write_result(workdir, result)
  return result


def _log_scan_compile(sc: dict | None) -> None:
  if sc:
    logging.info("scan over layers: compile %s s at %s layers (ratio %.2f; unrolled %.2f)",
                 [round(t, 2) for t in sc["compile_s"]], sc["layers"], sc["ratio"],
                 sc["unrolled_ratio"])


def check_peer(cfg: BenchDecodeConfig) -> None:
  """config.peer='hf' runs the peer whatever the platform: without torch or transformers the
  run compiled and measured everything else, then ended on the ImportError (a traceback)
  without writing result.json, the earlier one already moved aside. Checked before that."""
  if cfg.peer != "hf" or cfg.compile_only:
    return
  try:
    for name in ("torch", "transformers"):
      importlib.import_module(name)
  except ImportError as e:
    raise ValueError(f"config.peer='hf': {e}; expected torch and transformers importable (the "
                     "HF peer baseline), or config.peer='auto' (a GPU where they import) or "
                     "'none'") from None


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  cfg = BenchDecodeConfig.from_config_dict(_CONFIG.value)
  check_peer(cfg)
  wd.start_outputs(_WORKDIR.value, _CONFIG.value,
                   ("result.json", "calibration.json", "bench_decode.png"))
  if cfg.compile_only:
    result = compile_only(cfg, _WORKDIR.value)
    _log_scan_compile(result["scan_compile"])
    logging.info("wrote %s", os.path.join(_WORKDIR.value, "result.json"))
    return
  result = run(cfg, _WORKDIR.value)
  for row in result["decode"]["per_batch"]:
    frac = row["bw_fraction"]
    logging.info("batch %4d: %10.1f tokens/s  %8.3f GB/s  %s", row["batch"],
                 row["tokens_per_s"], row["achieved_bw_bytes_per_s"] / 1e9,
                 f"{100 * frac:.1f}% of peak" if frac is not None else UNKNOWN_PEAK)
  cs, sc = result["capacity_scaling"], result["scan_compile"]
  logging.info("live length %d: step time capacity %d / %d = %.2f (whole-cache attention: %.2f)",
               cs["live_len"], cs["capacities"][-1], cs["capacities"][0], cs["ratio"],
               cs["reference_ratio"])
  _log_scan_compile(sc)
  tr = result["train"]
  logging.info("ppo update: %.4f s, %.1f tokens/s, MFU %s", tr["step_s"], tr["tokens_per_s"],
               f"{100 * tr['mfu']:.2f}%" if tr["mfu"] is not None else UNKNOWN_PEAK)
  logging.info("wrote %s", os.path.join(_WORKDIR.value, "result.json"))


if __name__ == "__main__":
  config_files.run(main)
