r"""Causal tile skipping in blockwise attention, timed (models/attention.py
`positions_are_indices`; docs/results.md "Causal tile skipping").

  python -m experiments.bench_attention --config=configs/bench_attention.py:cpu --workdir=DIR

For each sequence length, one jitted gradient step of sum(logsumexp(logits)) of a LLaMA-shaped
model under blockwise attention, twice: with the model's default positions (the token indices,
so only the key tiles on or below the diagonal are read) and with the same positions passed
explicitly (no promise: every tile). Times `repeats` steps of each, the two taking turns, and
reports each one's median, the median of the paired speed-ups, the compiled dot FLOPs of each
(perf/hlo_flops.py) and the largest difference between the two gradients relative to each
leaf's largest entry (rounding only: the forward is bitwise the same). Writes DIR/result.json
(with the device it ran on) and DIR/config.json.
"""
from __future__ import annotations

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from experiments import config_files
from experiments import runner
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.models import attention as attention_lib
from rlhfuse_jax.models import llama
from rlhfuse_jax.perf import hlo_flops
from rlhfuse_jax.perf.timing import time_in_rotation, timed

_CONFIG = config_flags.DEFINE_config_file("config", None, "Benchmark config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
flags.mark_flags_as_required(["config", "workdir"])


def parse_lengths(text: str) -> list[int]:
  try:
    lengths = [int(x) for x in str(text).split(",") if x.strip()]
  except ValueError:
    lengths = []
  if not lengths or min(lengths) < 1:
    raise ValueError(f"config.lengths={text!r}: expected comma-separated positive integers")
  return lengths


def check_config(c) -> tuple[list[int], llama.ModelConfig]:
  """(the lengths, the model) of config `c`; a ValueError naming the field first (checked before
  the earlier outputs move aside: a typo left the workdir holding only the failed run's config,
  the good result in previous/<n>)."""
  config_files.check_ints(c, ("batch", "repeats"))
  # (a negative seed: numpy's default_rng refused it after the earlier outputs moved aside)
  config_files.check_ints(c, ("warmup", "seed"), minimum=0)
  lengths = parse_lengths(c.lengths)
  try:
    cfg = llama.ModelConfig(**c.model.to_dict(), max_seq_len=max(lengths),
                            attention="blockwise")
  except ValueError as e:
    raise ValueError(f"config.model: {e}") from None
  return lengths, cfg


def measure(c) -> dict:
  lengths, cfg = check_config(c)
  params = jax.tree.map(jnp.asarray, llama.host_random_params(cfg, c.seed))
  rows = []
  for length in lengths:
    tokens = jnp.asarray(np.random.default_rng(c.seed).integers(
        0, cfg.vocab_size, (c.batch, length)), jnp.int32)
    explicit = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (c.batch, length))
    row = {"length": length}
    grads, steps = {}, {}
    for name, positions in (("causal", None), ("every_tile", explicit)):
      def loss(p, positions=positions):
        return jnp.sum(jax.nn.logsumexp(llama.apply(cfg, p, tokens, positions)[0], -1))
      compiled = jax.jit(jax.grad(loss)).lower(params).compile()
      row[f"{name}_dot_flops"] = hlo_flops.analyze(compiled.as_text()).flops
      grads[name] = compiled(params)
      steps[name] = lambda f=compiled: f(params)
      timed(steps[name], c.warmup, 0)
    # The two programs take turns (the order alternating), so a slow spell of a shared machine
    # falls on both; each pair's ratio is kept and their median reported.
    runs = time_in_rotation(steps, c.repeats, alternate=True)
    ratios = [e / a for e, a in zip(runs["every_tile"], runs["causal"])]
    for name in runs:
      row[f"{name}_runs_s"] = runs[name]
      row[f"{name}_s"] = float(np.median(runs[name]))
    row["speedup_runs"] = ratios
    row["speedup"] = float(np.median(ratios))
    if min(ratios) < 1.0 < max(ratios):
      logging.warning("L=%d: the paired speed-ups range over %.2f-%.2fx, on both sides of 1: "
                      "the timing noise is larger than the effect (more repeats, a quieter "
                      "machine)", length, min(ratios), max(ratios))
    # Largest difference of a gradient leaf, relative to that leaf's largest entry.
    row["max_grad_rel_diff"] = float(max(jax.tree.leaves(jax.tree.map(
        lambda a, b: jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30),
        grads["causal"], grads["every_tile"]))))
    logging.info("L=%d: every tile %.4f s, causal tiles %.4f s (medians of %d), %.2fx (paired "
                 "median; %.2f-%.2fx); dot FLOPs %.4g -> %.4g; gradients differ by %.2g "
                 "(relative)", length, row["every_tile_s"], row["causal_s"], c.repeats,
                 row["speedup"], min(ratios), max(ratios), row["every_tile_dot_flops"],
                 row["causal_dot_flops"], row["max_grad_rel_diff"])
    rows.append(row)
  device = jax.devices()[0]
  return {"device": {"platform": device.platform, "device_kind": device.device_kind,
                     "cpu_count": os.cpu_count()},
          "model": c.model.to_dict(), "batch": c.batch,
          "block": inspect.signature(attention_lib.blockwise_attention).parameters[
              "block_q"].default, "per_length": rows}


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  check_config(_CONFIG.value)
  wd.start_outputs(_WORKDIR.value, _CONFIG.value, ("result.json",))
  result = measure(_CONFIG.value)
  runner.write_result(_WORKDIR.value, result)
  logging.info("wrote %s", os.path.join(_WORKDIR.value, "result.json"))


if __name__ == "__main__":
  config_files.run(main)
