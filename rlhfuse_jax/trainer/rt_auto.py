"""Plugs the simulator into the generation engine for `fusion.migration_threshold="auto"`.

The engine (generation/fused.py) chooses Rt through a model it is given; the simulator
(sim/rt_model.py) provides one from an engine layout. This module, above both in the package
graph (docs/architecture.md §7), describes a `FusedGenerator` to the simulator, so neither
imports the other.
"""
from __future__ import annotations

from rlhfuse_jax.generation import measure
from rlhfuse_jax.generation.fused import FusedGenerator
from rlhfuse_jax.policy.rt import Simulate
from rlhfuse_jax.sim import rt_model
from rlhfuse_jax.sim import shapes as shapes_lib
from rlhfuse_jax.sim.generation_sim import GenSetup


def sim_setup(gen: FusedGenerator) -> tuple:
  """(actor shape, inference model shapes, GenSetup) describing the engine to the simulator.
  The shapes at the models' own dtypes (from_model_config's dtypes: dtype for the KV rows a
  migration moves, param_dtype for the weights a freed instance loads), as measure_costs counts
  the bytes it copied (its calibration's byte_unit "stored"; the cost model converts a bf16-unit
  file). Every inference model is in the load a freed instance waits for, the critic included
  (measure_costs times it from where it is held)."""
  cfg = gen.config
  actor = shapes_lib.from_model_config(gen.cfg, "actor", dtypes=True)
  frozen = tuple(shapes_lib.from_model_config(c, n, dtypes=True) for n, c in gen.models.items())
  setup = GenSetup(num_instances=cfg.num_instances, slots=cfg.slots, tp=cfg.instance_devices,
                   chunk_steps=gen.sampling.chunk_size,
                   max_new_tokens=gen.sampling.max_new_tokens,
                   max_consolidations=max(cfg.max_consolidations, 1), stream_inference=True,
                   inference_microbatch=cfg.micro_batch, kv_capacity_tokens=gen.kv_capacity,
                   # every inference model is copied onto a freed instance (the critic too,
                   # from its training devices or host memory; measure_costs times that load)
                   offload_frozen=bool(gen.models), inference_pp=cfg.inference_pp,
                   # a pipeline's instances are one process's (generation/fused.py)
                   instance_groups=(tuple(int(o) for o in gen.owner) if gen.exchange.multi
                                    else ()),
                   # its inference micro-batches' width, [mb, P + T] (a pipeline's hand-offs)
                   prompt_len=gen.prompt_len,
                   devices_share_compute=measure.shares_compute(gen))
  return actor, frozen, setup


def simulated_rt_model(gen: FusedGenerator, calibration: dict) -> Simulate:
  """The `rt_model` of FusedGenerator: its batches simulated with its measured costs."""
  return rt_model.gen_plus_inf_model(calibration, *sim_setup(gen))
