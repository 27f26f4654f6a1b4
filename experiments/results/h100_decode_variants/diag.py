"""GPU diagnostics of 2026-11-26 (one H100 call): decode step time of the engine's variants, the
PPO update's MFU with two attention implementations, and a 1-device plan_check compile.

  OUT=DIR PYTHONPATH=.:<ml-collections> python experiments/results/h100_decode_variants/diag.py \
      decode|train

decode: the 1.1B bf16 model of configs/bench_decode.py:1b (prompt 128, 512 new tokens, cache
640, chunk 128), timed with bench_decode.measure_decode (the engine's Generator; median of
REPEATS runs after one warm-up) for each VARIANT "attention:steps_per_check" ("c": the chunk
size, one check per chunk; "attention+fp": with model.fused_projections) and batch in
BATCHES; plus per-variant counts in the compiled decode chunk (fusions, custom calls, while
loops, loops with a trip count XLA knows). Writes $OUT/decode_<TAG>.json after every point;
with DUMP_HLO=DIR also the optimised decode chunk of every point as DIR/decode_*.hlo.
train: bench_decode.measure_train at each TRAIN variant "attention:batch". Writes
$OUT/train.json after every point. kernel: the Pallas decode kernel compiled for the device vs
reference_attention (error, time per call); writes $OUT/kernel.json. peer:
bench_decode.measure_peer (HF transformers, same shape and lengths) at each batch of BATCHES;
writes $OUT/peer.json.
"""
import concurrent.futures
import dataclasses
import json
import os
import re
import sys
import time

import jax

sys.argv = sys.argv[:2]
from configs import bench_decode as bdc  # noqa: E402
from experiments import bench_decode as bd  # noqa: E402
from rlhfuse_jax.generation import instances  # noqa: E402
from rlhfuse_jax.generation.sampling import SamplingConfig  # noqa: E402
from rlhfuse_jax.perf.bench_config import BenchDecodeConfig  # noqa: E402
from rlhfuse_jax.sim import hardware  # noqa: E402

OUT = os.environ["OUT"]
CFG = BenchDecodeConfig.from_config_dict(bdc.get_config("1b"))
CFG = dataclasses.replace(CFG, warmup=1, repeats=int(os.environ.get("REPEATS", "2")))
# The preset matching this device (sim/hardware.py; the H100 SXM's 3.35 TB/s when none matches,
# as in 2026-11-26's runs); the result keeps the raw bytes and times and names the peak used.
_HW = hardware.hardware_for_device_kind(jax.devices()[0].device_kind)
PEAK_BW = _HW.hbm_bw if _HW is not None else 3.35e12


def hlo_counts(txt: str) -> dict:
  return {"fusions": len(re.findall(r"= \S+ fusion\(", txt)),
          "custom_calls": len(re.findall(r"custom-call\(", txt)),
          "whiles": txt.count(" while("),
          "known_trip_counts": re.findall(r'known_trip_count":\{"n":"(\d+)"', txt)}


def decode(tag: str) -> None:
  variants = os.environ.get("VARIANTS", "blockwise:1,reference:1,reference:c").split(",")
  batches = [int(b) for b in os.environ.get("BATCHES", "1,16,128").split(",")]
  params, = bd.random_params([CFG.model], jax.random.key(0))
  out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
         "xla_flags": os.environ.get("XLA_FLAGS", ""), "peak_hbm_bw": PEAK_BW, "rows": []}
  path = os.path.join(OUT, f"decode_{tag}.json")
  points = [(v, b) for v in variants for b in batches]

  def build(point):
    v, b = point
    att, k = v.split(":")
    fused = att.endswith("+fp")  # "auto+fp": with model.fused_projections
    model = CFG.model.replace(attention=att.removesuffix("+fp"), fused_projections=fused)
    smp = SamplingConfig(temperature=1.0, max_new_tokens=CFG.max_new_tokens, eos_id=-1,
                         pad_id=0, chunk_size=CFG.chunk_size,
                         steps_per_check=CFG.chunk_size if k == "c" else int(k))
    t0 = time.perf_counter()
    gen = instances.Generator(model, smp, batch_size=b, prompt_len=CFG.prompt_len, params=params)
    return model, gen, time.perf_counter() - t0

  # Compiled concurrently (XLA compiles outside the GIL), timed one at a time.
  with concurrent.futures.ThreadPoolExecutor(len(points)) as pool:
    jobs = [pool.submit(build, p) for p in points]
  for (v, b), job in zip(points, jobs):
    try:
      model, gen, compile_s = job.result()
      row = bd.measure_decode(dataclasses.replace(CFG, model=model), gen, params)
      txt = gen._exe["decode"].as_text()
      row.update(variant=v, compile_s=compile_s, bw_fraction=row["achieved_bw_bytes_per_s"]
                 / PEAK_BW, hlo=hlo_counts(txt))
      if os.environ.get("DUMP_HLO"):  # the optimised decode chunk, to read offline
        with open(os.path.join(os.environ["DUMP_HLO"], f"decode_{v.replace(':', '_')}_b{b}.hlo"),
                  "w") as f:
          f.write(txt)
    except Exception as e:  # noqa: BLE001 report and go on with the next point
      row = {"variant": v, "batch": b, "error": f"{type(e).__name__}: {e}"[:2000]}
    jobs[points.index((v, b))] = None  # drop the generator (its cache) once timed
    out["rows"].append(row)
    print(f"DECODE {tag} {v} b={b}: " + (
        f"{1e3 * row['step_s']:.3f} ms/step, {row['tokens_per_s']:.0f} tok/s, "
        f"{100 * row['bw_fraction']:.1f}% of HBM peak, compile {row['compile_s']:.1f} s"
        if "error" not in row else row["error"][:300]), flush=True)
    json.dump(out, open(path, "w"), indent=1)


def train() -> None:
  variants = os.environ.get("TRAIN", "blockwise:8,cudnn:8").split(",")
  out = {"device": jax.devices()[0].device_kind, "rows": []}
  for v in variants:
    att, b = v.split(":")
    cfg = dataclasses.replace(CFG, model=CFG.model.replace(attention=att), train_batch=int(b))
    try:
      actor, critic = bd.random_params([cfg.model, cfg.critic_model], jax.random.key(1))
      t0 = time.perf_counter()
      with concurrent.futures.ThreadPoolExecutor(3) as pool:
        tb = bd.make_train_bench(cfg, actor, critic, pool)
      row = bd.measure_train(cfg, tb)
      row.update(variant=v, compile_s=time.perf_counter() - t0,
                 mfu=row["achieved_flops_per_s"] / 989.4e12,
                 mfu_6nd=row["flops_6nd"] / row["step_s"] / 989.4e12)
      del tb, actor, critic
    except Exception as e:  # noqa: BLE001
      row = {"variant": v, "error": f"{type(e).__name__}: {e}"[:2000]}
    out["rows"].append(row)
    print(f"TRAIN {v}: " + (f"{row['step_s']:.4f} s, MFU {100 * row['mfu']:.1f}% "
                            f"(6ND {100 * row['mfu_6nd']:.1f}%)" if "error" not in row
                            else row["error"][:300]), flush=True)
    json.dump(out, open(os.path.join(OUT, "train.json"), "w"), indent=1)


def kernel() -> None:
  """The Pallas decode kernel compiled for the device against reference_attention: random
  bf16 caches of the 1.1B shape (S 640, layer 21 of 22), ragged positions, batch 1/16/128;
  max abs error and the two step times (median of 20 calls)."""
  import numpy as np
  from rlhfuse_jax.models import attention, decode_kernel, llama
  m = CFG.model
  h, kvh, d, s_len, layers = m.num_heads, m.num_kv_heads, m.head_dim_, CFG.cache_len, 22
  out = {"device": jax.devices()[0].device_kind, "rows": []}
  for b in (1, 16, 128):
    rng = np.random.default_rng(b)
    try:
      k = jax.numpy.asarray(rng.standard_normal((layers, b, s_len, kvh, d)), "bfloat16")
      v = jax.numpy.asarray(rng.standard_normal((layers, b, s_len, kvh, d)), "bfloat16")
      kb, vb = llama.cache_bits(k), llama.cache_bits(v)
      q = jax.numpy.asarray(rng.standard_normal((b, 1, h, d)), "bfloat16")
      pos = jax.numpy.asarray(rng.integers(0, s_len, (b, 1)), "int32")
      fk = jax.jit(lambda q, kb, vb, pos: decode_kernel.pallas_decode_attention(
          q, kb, vb, layers - 1, pos, "bfloat16"))
      fr = jax.jit(lambda q, k, v, pos: attention.reference_attention(
          q, k[layers - 1], v[layers - 1], pos,
          jax.numpy.broadcast_to(jax.numpy.arange(s_len), (b, s_len))))
      got, want = fk(q, kb, vb, pos), fr(q, k, v, pos)
      err = float(jax.numpy.max(jax.numpy.abs(got.astype("float32") - want.astype("float32"))))
      times = {}
      for name, f, args in (("kernel_s", fk, (q, kb, vb, pos)),
                            ("reference_s", fr, (q, k, v, pos))):
        ts = []
        for _ in range(20):
          t0 = time.perf_counter()
          jax.block_until_ready(f(*args))
          ts.append(time.perf_counter() - t0)
        times[name] = float(np.median(ts))
      row = {"batch": b, "max_abs_err": err, **times}
    except Exception as e:  # noqa: BLE001
      row = {"batch": b, "error": f"{type(e).__name__}: {e}"[:3000]}
    out["rows"].append(row)
    print(f"KERNEL b={b}: {row}"[:600], flush=True)
    json.dump(out, open(os.path.join(OUT, "kernel.json"), "w"), indent=1)


def peer() -> None:
  """HF transformers generation at each batch of BATCHES (bench_decode.measure_peer)."""
  out = {"device": jax.devices()[0].device_kind, "rows": []}
  for b in [int(b) for b in os.environ.get("BATCHES", "1,16,128").split(",")]:
    try:
      row = bd.measure_peer(CFG, b)
    except Exception as e:  # noqa: BLE001
      row = {"batch": b, "error": f"{type(e).__name__}: {e}"[:2000]}
    out["rows"].append(row)
    print(f"PEER b={b}: " + (f"{row['tokens_per_s']:.0f} tok/s, "
                             f"{1e3 * row['decode_s'] / row['decode_steps']:.3f} ms/step, "
                             f"{row['mode']}" if "error" not in row else row["error"][:300]),
          flush=True)
    json.dump(out, open(os.path.join(OUT, "peer.json"), "w"), indent=1)


if __name__ == "__main__":
  {"decode": lambda: decode(os.environ.get("TAG", "default")), "train": train,
   "peer": peer, "kernel": kernel}[sys.argv[1]]()
