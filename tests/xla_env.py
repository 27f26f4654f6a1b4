"""The suite's XLA flags, and the environment its subprocesses start with.

The suite compiles with LLVM's optimisation off (`--xla_backend_optimization_level=0`). Most of
its time is XLA:CPU compiling small programs, and LLVM's passes are a large part of that: on the
2-core dev machine test_pipeline_executor.py + test_attention.py took 88 s with the default level
and 71 s at 0 (2026-11-26). The flag changes machine code only, not the HLO programs, their
buffers or XLA's memory/cost analyses that tests read. It can change float rounding (LLVM at 0
contracts fewer multiply-adds into FMAs), so every process whose outputs a test compares bitwise
with another's must compile with the same flags: subprocesses get them through `subprocess_env`.
"""
from __future__ import annotations

import os

from rlhfuse_jax.parallel.host_devices import xla_flags_with_host_devices

CODEGEN_FLAGS = "--xla_backend_optimization_level=0"


def subprocess_env(devices: int | None = None, **extra: str) -> dict:
  """This process's environment for a subprocess on the CPU: XLA_FLAGS keeps this process's flags
  (the suite's codegen flags and whatever the caller set) with `devices` fake CPU devices in place
  of its 8 (None: the one real device, as a user's plain run)."""
  env = dict(os.environ)
  flags = xla_flags_with_host_devices(devices)
  if CODEGEN_FLAGS not in flags.split():
    flags = f"{CODEGEN_FLAGS} {flags}".strip()
  env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **extra)
  return env
