"""Diagnostic run once on the H100 (2026-11-23) to look at decode at batch 1; wrote kernels_per_step.json.

  PYTHONPATH=.:<ml-collections> OUT=DIR python experiments/results/h100_bench_decode_1b/diag_decode.py

hlo_b*: fusions and custom calls in the compiled decode-chunk executable of the 1.1B model
(one while loop; its body is one decode step). weights_only_b*: a lax.scan over stacked layer
weights doing only the decode matmuls; the scan slices the stacked weights every layer, so it
is *not* a clean bandwidth floor, and it is reported as what it is (it was slower than the engine).
"""
import json, os, re, time, sys
import jax, jax.numpy as jnp, numpy as np
sys.argv = sys.argv[:1]
from configs import bench_decode as bdc
from experiments import bench_decode as bd
from rlhfuse_jax.perf.bench_config import BenchDecodeConfig
cfg = BenchDecodeConfig.from_config_dict(bdc.get_config("1b"))
m = cfg.model
out = {}
params, = bd.random_params([m], jax.random.key(0))
for b in (1, 128):
  gen = bd.make_generator(cfg, params, b)
  txt = gen._exe["decode"].as_text()  # was gen._decode before the Generator became an instance
  out[f"hlo_b{b}"] = {"fusions": len(re.findall(r"= \S+ fusion\(", txt)),
                      "custom_calls": len(re.findall(r"custom-call\(", txt)),
                      "while": txt.count(" while(")}
  open(os.environ["OUT"] + f"/decode_b{b}.hlo.txt", "w").write(txt) if b == 1 else None
# weights-only floor: per step, x[B,H] through each layer's matmuls (q,k,v,o,gate,up,down) + lm head
h, f, L, v = m.hidden_size, m.intermediate_size, m.num_layers, m.vocab_size
kvd = m.num_kv_heads * (h // m.num_heads)
key = jax.random.key(1)
ws = [0.02 * jax.random.normal(jax.random.fold_in(key, i), s, jnp.bfloat16) for i, s in enumerate(
    [(L, h, h), (L, h, kvd), (L, h, kvd), (L, h, h), (L, h, f), (L, h, f), (L, f, h), (h, v)])]
nbytes = sum(w.size * 2 for w in ws)


def run(x, ws, steps=127):
  wq, wk, wv, wo, wg, wu, wd, lm = ws
  def step(i, x):
    def layer(x, w):
      q, k, vv, o, g, u, d = w
      a = (x @ q) + jnp.pad(x @ k + x @ vv, ((0, 0), (0, h - kvd)))
      x = x + a @ o
      return x + (jax.nn.silu(x @ g) * (x @ u)) @ d, None
    x, _ = jax.lax.scan(layer, x, (wq, wk, wv, wo, wg, wu, wd))
    lo = x @ lm
    return x + 1e-3 * jnp.max(lo, axis=-1, keepdims=True).astype(x.dtype)
  return jax.lax.fori_loop(0, steps, step, x)


f_run = jax.jit(run)
for b in (1, 16, 128):
  x = jnp.ones((b, h), jnp.bfloat16)
  f_run(x, ws).block_until_ready()
  ts = []
  for _ in range(5):
    t0 = time.perf_counter(); f_run(x, ws).block_until_ready(); ts.append(time.perf_counter() - t0)
  s = float(np.median(ts)) / 127
  out[f"weights_only_b{b}"] = {"step_s": s, "bytes": nbytes, "bw": nbytes / s}
  print(b, s, nbytes / s / 1e9, "GB/s", flush=True)
print(json.dumps(out, indent=1))
json.dump(out, open(os.environ["OUT"] + "/diag_decode.json", "w"), indent=1)
