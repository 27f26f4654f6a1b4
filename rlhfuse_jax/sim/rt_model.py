"""The generation simulation as the model behind the Rt choice (docs/architecture.md §2, §6).

policy/rt.py picks the candidate Rt with the smallest simulated generation+inference time; this
module supplies that simulation: `generation_sim.simulate_generation` (the same code the
simulator runs, with the shared consolidation policy) over the engine's layout.

Cost model: the simulator's `CostModel` with a calibration measured on the engine's own
executables (generation/measure.py): decode step time vs occupied slots, prefill and inference
micro-batch time, migration time per moved sample and frozen-weight load bandwidth, and whether
the devices share one processor (fake CPU devices). The ops every batch uses (decode, prefill,
inference, and the weight load when frozen models come from the host) must be calibrated: a
missing one is an error, never the hardware preset's figure. Migration is measured where this
process holds two instances; one instance per process (a multi-host engine) leaves it to the
preset's links (H100 NVLink + NCCL latencies), a cost that stays small beside a decode step.

Plain numpy (no jax), like the rest of sim/.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rlhfuse_jax.policy import calibration as cal_lib
from rlhfuse_jax.policy.rt import Simulate
from rlhfuse_jax.sim.cost_model import CostModel
from rlhfuse_jax.sim.generation_sim import GenSetup, simulate_generation
from rlhfuse_jax.sim.hardware import get_hardware
from rlhfuse_jax.sim.shapes import ModelShape


def gen_plus_inf_model(calibration: dict, actor: ModelShape, frozen: Sequence[ModelShape],
                       setup: GenSetup) -> Simulate:
  """simulate(rt, prompt_lens, response_lens) -> simulated gen+inf seconds of one batch.

  calibration: a calibration-file dict (policy/calibration.py); setup: the engine's layout (its
  threshold is replaced by each candidate, streaming on).
  """
  cal = cal_lib.from_dict(calibration, "measured")
  needed = ("decode_step", "prefill", "inference") + (
      ("weight_load",) if setup.offload_frozen else ())
  missing = [op for op in needed if getattr(cal, op) is None]
  if missing:
    raise ValueError(f"the Rt model's calibration ({cal.device!r}) lacks the measured ops "
                     f"{missing}: the simulated batch needs them (no hardware preset applies)")
  cost = CostModel(get_hardware("h100_sxm"), calibration=cal)

  def simulate(rt: float, prompt_lens: np.ndarray, response_lens: np.ndarray) -> float:
    s = dataclasses.replace(setup, threshold=float(rt), stream_inference=True)
    return simulate_generation(cost, actor, frozen, s, prompt_lens,
                               response_lens).gen_plus_inf_s
  return simulate
