"""The suite's XLA flags, and the environment its subprocesses start with.

Most of the suite's time is XLA:CPU compiling small programs; two codegen flags make that faster:
- LLVM's optimisation off (`--xla_backend_optimization_level=0`): on the 2-core dev machine
  test_pipeline_executor.py + test_attention.py took 88 s with the default level and 71 s at 0
  (2026-11-26).
- XLA:CPU's loop emitters instead of its MLIR fusion emitters
  (`--xla_cpu_use_fusion_emitters=false`): test_attention.py, one pipeline-executor and one
  sharded-trainer test took 131 s with the fusion emitters and 82 s without (2026-11-29, with
  level 0 in both; disabling LLVM's expensive passes or codegen splitting gained <= 7 %).
The flags change machine code only, not the HLO programs, their buffers or XLA's memory/cost
analyses that tests read. They can change float rounding (e.g. fewer multiply-adds contracted
into FMAs), so every process whose outputs a test compares bitwise with another's must compile
with the same flags: subprocesses get them through `subprocess_env`.
"""
from __future__ import annotations

import os

from rlhfuse_jax.parallel.host_devices import xla_flags_with_host_devices

CODEGEN_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def subprocess_env(devices: int | None = None, **extra: str) -> dict:
  """This process's environment for a subprocess on the CPU: XLA_FLAGS keeps this process's flags
  (the suite's codegen flags and whatever the caller set) with `devices` fake CPU devices in place
  of its 8 (None: the one real device, as a user's plain run)."""
  env = dict(os.environ)
  flags = xla_flags_with_host_devices(devices)
  missing = [f for f in CODEGEN_FLAGS.split() if f not in flags.split()]
  flags = " ".join([*missing, flags]).strip()
  env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **extra)
  return env
