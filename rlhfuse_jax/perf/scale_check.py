"""Per-device memory and matmul work of a model's gradient step, compiled from shapes.

The scale checks of docs/results.md ("Scale checks"): a LLaMA-shaped model's gradient of
sum(logsumexp(logits)) over a [batch, len] token batch, lowered from jax.ShapeDtypeStructs (nothing
is allocated) and compiled for the caller's mesh, e.g. 8 fake CPU devices
(--xla_force_host_platform_device_count) with fsdp=8. Reported per device:

  temp_bytes  compiled.memory_analysis().temp_size_in_bytes (XLA:CPU's buffer assignment: an
              estimate of a GPU's, docs/results.md "Scale checks")
  flops       dot FLOPs with every loop iteration counted (perf/hlo_flops.py; blockwise
              attention is a lax.scan, which cost_analysis() counts once)

This module reports the figures; its callers (the scale-check tests, experiments/plan_programs.py)
divide them into `replication`: the flops per device over those of one sequence compiled for one
device (1.0: each device does exactly its share, nothing repeated across the batch axes).

The caller supplies the placements (parallel/mesh.param_shardings and batch_sharding; perf does not
import parallel, docs/architecture.md §7) and the logical rules that llama.shard_activations
needs (None: the model unconstrained, as before activation sharding).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

from rlhfuse_jax.models import llama
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.perf import hlo_flops
from rlhfuse_jax.sim import cost_model as cost_model_lib


def logsumexp_loss(cfg: ModelConfig, mesh, rules: Optional[Mapping[str, Any]]):
  """loss(params, tokens) = sum(logsumexp(logits)), traced under llama.shard_activations when
  rules are given: a loss that needs the whole head and backbone, the same in every check."""
  def loss(params, tokens):  # tokens: [batch, len]
    with llama.shard_activations(mesh if rules is not None else None, rules or {}):
      logits, _ = llama.apply(cfg, params, tokens)  # [batch, len, vocab] float32
    return jnp.sum(jax.nn.logsumexp(logits, axis=-1))
  return loss


def abstract_params(cfg: ModelConfig, param_shardings: Any) -> Any:
  """The model's parameters as jax.ShapeDtypeStructs placed by `param_shardings` (a tree of
  shardings, e.g. parallel/mesh.param_shardings, or one sharding for every leaf): lowering
  from them allocates nothing."""
  shapes = llama.param_shapes(cfg)
  if isinstance(param_shardings, jax.sharding.Sharding):
    param_shardings = jax.tree.map(lambda _: param_shardings, shapes)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, param_shardings)


def compiled_costs(compiled: Any, cost_model: Any = None,
                   widths: Optional[hlo_flops.Widths] = None) -> dict:
  """Per-device figures of a compiled program: memory_analysis()'s argument / output / temp /
  alias bytes, dot FLOPs with loops counted (`flops`, perf/hlo_flops.py; the custom-calls it
  cannot count in `uncounted_custom_calls`), cost_analysis()'s
  `xla_flops` (loop bodies once), the loops whose trip count hlo_flops could not read, and the
  bytes each kind of collective moves per device (`collective_bytes`, loops counted). With a
  sim CostModel (`cost_model`), `collective_s`: those collectives one after another on its
  hardware (CostModel.group_collective_s, each over its slowest group): what the program
  spends communicating unless XLA overlaps it with compute. With `widths` (hlo_flops.
  program_widths of the partitioned program before XLA:CPU widens its 16-bit collectives), the
  same at the widths the program asks for, as a GPU moves them: `program_collective_bytes`,
  `program_collective_s`."""
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list on some jax versions
  text = compiled.as_text()
  counted = hlo_flops.analyze(text)
  out = {"argument_bytes": int(mem.argument_size_in_bytes),
         "output_bytes": int(mem.output_size_in_bytes),
         "temp_bytes": int(mem.temp_size_in_bytes),
         "alias_bytes": int(mem.alias_size_in_bytes),
         "flops": counted.flops, "xla_flops": float(cost.get("flops", 0.0)),
         "loops_without_trip_count": counted.unknown_trip_loops,
         "collective_bytes": counted.collective_bytes(),
         "unread_collective_groups": counted.unread_groups,
         # custom-calls whose FLOPs `flops` leaves out (cuDNN attention, Pallas kernels), by
         # target -> times run; cuBLAS GEMMs are counted
         "uncounted_custom_calls": counted.uncounted_calls}
  if cost_model is not None:
    out["collective_s"] = collective_seconds(counted, cost_model)
  if widths is not None:
    narrow = hlo_flops.analyze(text, widths)
    out["program_collective_bytes"] = narrow.collective_bytes()
    if cost_model is not None:
      out["program_collective_s"] = collective_seconds(narrow, cost_model)
  return out


def collective_seconds(counted: hlo_flops.HloCosts, cost_model: Any) -> float:
  """Seconds of `counted`'s collectives run one after another (compiled_costs). A collective
  whose groups hlo_flops could not read is timed as a pair across two nodes (the slow link)."""
  node = cost_model.hw.devices_per_node
  total = 0.0
  for c, n in counted.collectives.items():
    if c.kind == "collective-permute":
      cross = not c.groups or any(not cost_model_lib.same_node(a, b, node) for a, b in c.groups)
      one = cost_model.p2p_s(c.nbytes, cross) if c.nbytes else 0.0
    else:
      one = max(cost_model.group_collective_s(c.kind, c.nbytes, g)
                for g in (c.groups or ((0, node),)))
    total += n * float(one)
  return total


def grad_step_cost(cfg: ModelConfig, mesh: jax.sharding.Mesh, param_shardings: Any,
                   token_sharding: jax.sharding.Sharding, batch: int, seq_len: int,
                   rules: Optional[Mapping[str, Any]] = None) -> dict:
  """Compiles grad(sum logsumexp(logits)) for `batch` sequences of `seq_len` tokens on `mesh`.

  Returns compiled_costs(...) per device (temp_bytes, argument_bytes, flops: HLO dots with loops
  counted, xla_flops: cost_analysis, loop bodies once, ...). Gradients come out placed like the
  parameters.
  """
  params = abstract_params(cfg, param_shardings)
  tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=token_sharding)
  step = jax.jit(jax.grad(logsumexp_loss(cfg, mesh, rules)), out_shardings=param_shardings)
  return compiled_costs(step.lower(params, tokens).compile())
