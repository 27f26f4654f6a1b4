r"""Measures decode step time vs occupied slots, prefill and inference throughput, KV
migration bandwidth and the frozen models' host -> device load on this machine, and writes them
as a simulator calibration file.

  python -m experiments.calibrate_sim --config=configs/calibrate_sim.py --workdir=/tmp/cal

Each op is compiled first and timed `repeats` times (median), with the engine's own pure
functions (generation.engine.prefill / decode_chunk, inference.scoring), on one device; a
migration is a `jax.device_put` of KV rows from device 0 to device 1. On a CPU with fake devices
all devices share the processor, which the file records (`devices_share_compute`).

Docs: docs/simulator.md ("Calibration").
"""
from __future__ import annotations

from rlhfuse_jax.parallel.host_devices import request_host_devices

request_host_devices(8)  # before the first jax import

import functools  # noqa: E402
import os  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import config_files  # noqa: E402
from experiments import runner  # noqa: E402
from rlhfuse_jax import workdir as wd  # noqa: E402
from rlhfuse_jax.generation import engine  # noqa: E402
from rlhfuse_jax.generation.measure import median_s  # noqa: E402
from rlhfuse_jax.generation.sampling import SamplingConfig  # noqa: E402
from rlhfuse_jax.inference import scoring  # noqa: E402
from rlhfuse_jax.models import hf_loader, llama  # noqa: E402
from rlhfuse_jax.policy import calibration  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Calibration config.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
flags.mark_flags_as_required(["config", "workdir"])


def check_config(c) -> tuple[llama.ModelConfig, object, list[int]]:
  """(model config, devices_share_compute, occupancies) of `c`; a ValueError naming the field
  otherwise. main calls it before the earlier run's calibration.json is moved aside (a typo
  left the workdir without one, the good file in previous/<n>)."""
  cfg = llama.ModelConfig(**c.model.to_dict())
  config_files.check_ints(c, ("repeats", "slots", "chunk_size", "migrate_rows",
                             "inference_microbatch", "prompt_len", "max_new_tokens"))
  config_files.check_int("seed", c.seed, 0)  # (numpy's default_rng refuses a negative one)
  max_len = c.prompt_len + c.max_new_tokens
  if max_len > cfg.max_seq_len:
    raise ValueError(f"config.prompt_len + config.max_new_tokens = {max_len}: expected at most "
                     f"config.model.max_seq_len={cfg.max_seq_len}")
  if c.migrate_rows > c.slots:
    raise ValueError(f"config.migrate_rows={c.migrate_rows}: expected at most slots={c.slots} "
                     "(the rows copied come from one instance's cache)")
  share = {"auto": "auto", "true": True, "false": False}.get(
      str(c.devices_share_compute).lower())
  if share is None:
    raise ValueError(f"config.devices_share_compute={c.devices_share_compute!r}: expected "
                     "'auto' (true on CPU), true or false")
  items = [x.strip() for x in str(c.occupancies).split(",") if x.strip()]
  if not items or not all(x.isdigit() for x in items):
    raise ValueError(f"config.occupancies={c.occupancies!r}: expected comma-separated slot "
                     "counts, e.g. '1,4,8'")
  # Measured in increasing order, each once: given as '8,4,2,1' the whole measurement ran and
  # then the calibration it made was refused ("occupied_slots ... must be strictly
  # increasing"), the earlier calibration.json already moved to previous/.
  occ = sorted({int(x) for x in items})
  if max(occ) > c.slots or min(occ) < 1:
    raise ValueError(f"config.occupancies={occ} must lie in [1, slots={c.slots}]")
  return cfg, share, occ


def measure(c) -> dict:
  cfg, share, occ = check_config(c)
  critic_cfg = cfg.replace(head="scalar")
  max_len = c.prompt_len + c.max_new_tokens
  key = jax.random.key(c.seed)
  params, _ = llama.init_params(cfg, key)
  cparams, _ = llama.init_params(critic_cfg, jax.random.fold_in(key, 1))
  sampling = SamplingConfig(max_new_tokens=c.max_new_tokens, chunk_size=c.chunk_size)
  s, p = c.slots, c.prompt_len
  rng = np.random.default_rng(c.seed)
  prompts = jnp.asarray(rng.integers(1, cfg.vocab_size, (s, p)), jnp.int32)  # [S, P]
  plens = jnp.full((s,), p, jnp.int32)
  uids = jnp.arange(s, dtype=jnp.int32)
  pre = jax.jit(functools.partial(engine.prefill, cfg, sampling=sampling, max_len=max_len))
  prefill_s = median_s(lambda: pre(params, prompts, plens, uids, key), c.repeats)
  state = pre(params, prompts, plens, uids, key)
  # The state donated, as the engine's decode donates it (generation/instances.py): without,
  # every timed call first copied the whole KV cache into new buffers, a cost the engine never
  # pays (a 1.1B model's 64 x 640-slot cache: 0.55 ms on an H100, ~5 % of a step at chunk 8).
  chunk = jax.jit(functools.partial(engine.decode_chunk, cfg, sampling=sampling),
                  donate_argnums=(1,))
  step_s = []
  for b in occ:
    st = state.replace(done=jnp.arange(s) >= b)  # b live rows; done rows stay in the batch

    def fresh():  # a copy of st for each call, made outside the clock (the call donates it)
      return jax.block_until_ready(jax.tree.map(jnp.copy, st))
    # The steps the chunk runs, counted: it stops once every live row is done (its budget,
    # max_new_tokens - 1 steps after prefill, or an EOS), which may be before chunk_size.
    ran = int(np.max(np.asarray(chunk(params, fresh(), key).num_generated - st.num_generated)))
    steps = engine.chunk_steps(sampling, ran)
    step_s.append(median_s(lambda fresh_st: chunk(params, fresh_st, key), c.repeats,
                           setup=fresh) / steps)
    logging.info("decode step with %d/%d live rows: %.3f ms (%d steps per chunk)", b, s,
                 1e3 * step_s[-1], steps)
  if any(later < 0.9 * earlier for earlier, later in zip(step_s, step_s[1:])):
    logging.warning("the decode step got >10 %% faster with more live rows (%s ms): timing "
                    "noise; the simulator would read more rows as cheaper. Raise "
                    "config.repeats or measure on a quiet machine",
                    ", ".join(f"{1e3 * x:.3f}" for x in step_s))
  mb, t = c.inference_microbatch, c.max_new_tokens
  toks = jnp.asarray(rng.integers(1, cfg.vocab_size, (mb, p + t)), jnp.int32)  # [mb, P+T]
  mplens, rlens = jnp.full((mb,), p, jnp.int32), jnp.full((mb,), t, jnp.int32)

  def infer():
    return (scoring.response_logprobs(cfg, params, toks, mplens, t),
            scoring.critic_values(critic_cfg, cparams, toks, mplens, t),
            scoring.reward_model_scores(critic_cfg, cparams, toks, mplens, rlens))
  inf_s = median_s(infer, c.repeats)
  devs = jax.devices()
  if len(devs) < 2:
    raise ValueError("migration timing needs at least 2 devices")
  rows = jax.device_put(state.cache.k[:, :c.migrate_rows], devs[0])  # [L, rows, max_len, kv, d]
  # K and V (the K rows copied twice) in the bytes copied, at the cache's dtype (the file's
  # byte_unit "stored"): the cost model converts a shape's KV bytes into it
  # (Calibration.rate_bytes). Counted at bf16's 2 an element (until 2026-12-04) a float32 reader
  # (plan_search:train) was charged twice the measured time.
  nbytes = 2 * int(rows.nbytes)
  mig_s = median_s(lambda: (jax.device_put(rows, devs[1]), jax.device_put(rows, devs[1])),
                   c.repeats)
  logging.info("migration of %d KV rows: %d bytes in %.3f ms",
               c.migrate_rows, nbytes, 1e3 * mig_s)
  # The frozen models an instance freed for inference loads from host memory (the reference:
  # the actor's shape; the reward model: the critic's), in the bytes copied, as
  # generation/measure.py times them. Without it the file could not predict bench_generation
  # (sim/validation.py needs every op it times).
  host = jax.device_get((params, cparams))
  load_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(host))
  load_s = median_s(lambda: jax.device_put(host, devs[0]), c.repeats)
  logging.info("frozen models host -> device: %d bytes in %.3f ms",
               load_bytes, 1e3 * load_s)
  return {
      "format": calibration.FORMAT, "byte_unit": "stored",
      "device": f"{jax.devices()[0].platform} x{len(devs)} ({jax.devices()[0].device_kind}), "
                f"measured by experiments/calibrate_sim.py",
      "model_params": int(cfg.num_params()), "instance_devices": 1,
      "devices_share_compute": devs[0].platform == "cpu" if share == "auto" else share,
      "ops": {
          "decode_step": {"occupied_slots": occ, "seconds": step_s},
          "prefill": {"tokens_per_s": s * p / prefill_s},
          "inference": {"tokens_per_s": mb * (p + t) / inf_s},
          "migration": {"bytes_per_s": nbytes / mig_s},
          "weight_load": {"bytes_per_s": load_bytes / load_s},
      },
      "notes": f"slots={s}, prompt_len={p}, max_len={max_len}, chunk={c.chunk_size}",
  }


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  c = _CONFIG.value
  check_config(c)  # before the earlier calibration.json moves aside
  wd.start_outputs(_WORKDIR.value, c, ("calibration.json", "result.json", "model"))
  cal = measure(c)
  calibration.from_dict(cal, "measured")  # what we write must load
  path = runner.write_result(_WORKDIR.value, cal, "calibration.json")
  logging.info("wrote %s: %s", path, cal["ops"])
  # result.json, as every binary's: the workdir's owner (workdir.workdir_writer) and what a
  # sweep reads (its summary row, a finished run kept on a re-run: without one it measured
  # again on every start and its rows had no figures).
  runner.write_result(_WORKDIR.value, {"calibration": os.path.basename(path),
                                       **{k: cal[k] for k in ("device", "model_params")},
                                       "ops": cal["ops"]})
  # The measured model as an HF config.json: the shape its decode_step, prefill and inference
  # time, which the simulator accepts only for a model of that size (--config.shapes=NAME=DIR).
  model_dir = os.path.join(_WORKDIR.value, "model")
  os.makedirs(model_dir, exist_ok=True)
  wd.write_json(os.path.join(model_dir, "config.json"),
                hf_loader.hf_config_dict(llama.ModelConfig(**c.model.to_dict())))
  logging.info("wrote %s/config.json, the measured model's shape: plan_search / "
               "reproduce_ablations --config.shapes=mine=%s --config.pairs=mine/mine "
               "--config.calibration=%s --config.hardware=<a hardware file of this machine> "
               "(docs/simulator.md, Calibration)", model_dir, model_dir, path)


if __name__ == "__main__":
  config_files.run(main)
