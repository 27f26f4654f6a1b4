"""Plugs the simulator into the generation engine for `fusion.migration_threshold="auto"`.

The engine (generation/fused.py) chooses Rt through a model it is given; the simulator
(sim/rt_model.py) provides one from an engine layout. This module, above both in the package
graph (docs/architecture.md §7), describes a `FusedGenerator` to the simulator, so neither
imports the other.
"""
from __future__ import annotations

import dataclasses

from rlhfuse_jax.generation import measure
from rlhfuse_jax.generation.fused import FusedGenerator
from rlhfuse_jax.policy.rt import Simulate
from rlhfuse_jax.sim import rt_model
from rlhfuse_jax.sim import shapes as shapes_lib
from rlhfuse_jax.sim.generation_sim import GenSetup


def sim_setup(gen: FusedGenerator) -> tuple:
  """(actor shape, inference model shapes, GenSetup) describing the engine to the simulator.
  The shapes at the models' own dtypes (from_model_config's dtypes: dtype for the KV rows a
  migration moves), but the frozen models' weights in the unit the engine's measured
  weight_load rate counts (measure.WEIGHT_LOAD_ITEMSIZE, bf16 bytes whatever their
  param_dtype): at a float32 run's 4 bytes a parameter each instance's load was simulated at
  twice its measured time (briefly on 2026-12-04). Every inference model is in the load a
  freed instance waits for, the critic included (measure_costs times it from where it is held)."""
  cfg = gen.config
  actor = shapes_lib.from_model_config(gen.cfg, "actor", dtypes=True)
  frozen = tuple(dataclasses.replace(shapes_lib.from_model_config(c, n, dtypes=True),
                                     weight_itemsize=measure.WEIGHT_LOAD_ITEMSIZE)
                 for n, c in gen.models.items())
  setup = GenSetup(num_instances=cfg.num_instances, slots=cfg.slots, tp=cfg.instance_devices,
                   chunk_steps=gen.sampling.chunk_size,
                   max_new_tokens=gen.sampling.max_new_tokens,
                   max_consolidations=max(cfg.max_consolidations, 1), stream_inference=True,
                   inference_microbatch=cfg.micro_batch, kv_capacity_tokens=gen.kv_capacity,
                   # every inference model is copied onto a freed instance (the critic too,
                   # from its training devices; measure_costs times that load)
                   offload_frozen=bool(gen.models),
                   devices_share_compute=measure.shares_compute(gen))
  return actor, frozen, setup


def simulated_rt_model(gen: FusedGenerator, calibration: dict) -> Simulate:
  """The `rt_model` of FusedGenerator: its batches simulated with its measured costs."""
  return rt_model.gen_plus_inf_model(calibration, *sim_setup(gen))
