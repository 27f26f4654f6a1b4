"""Fake host (CPU) devices for the CPU benchmarks: one place for the XLA flag and its rule.

Must run before the first `import jax` anywhere in the process (XLA reads the flag once), so this
module imports nothing from jax. The flag only adds host devices, so it is harmless where an
accelerator is the default backend; a count the caller already set is left alone.
"""
from __future__ import annotations

import os
import re

_FLAG = "--xla_force_host_platform_device_count"


def request_host_devices(count: int = 8) -> None:
  """Adds `--xla_force_host_platform_device_count=count` to XLA_FLAGS unless a count is set."""
  flags = os.environ.get("XLA_FLAGS", "")
  if _FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()


def xla_flags_with_host_devices(count: int | None, flags: str | None = None) -> str:
  """XLA_FLAGS for a child process with `count` host devices (None: no count, the one real CPU
  device): `flags` (default this process's XLA_FLAGS) with any device count replaced, every other
  flag kept (a user's GPU or debug flags, the test suite's codegen level: a child compiled with
  other flags may round differently)."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  kept = re.sub(rf"{_FLAG}=\S*", "", flags).split()
  return " ".join(kept + ([f"{_FLAG}={count}"] if count is not None else []))


def host_device_env(count: int | None) -> dict:
  """The variables a child process with `count` host devices starts with (None: the one real
  CPU device): XLA_FLAGS as xla_flags_with_host_devices gives it, and JAX_NUM_CPU_DEVICES, when
  this process has it, set to the count too (removed for None). jax's own count overrides the
  flag's: a JAX_NUM_CPU_DEVICES=2 the user exported gave every child 2 devices whatever count
  it was started for. Update a copy of os.environ with it (for None the variable is -1, jax's
  default: the flag decides)."""
  env = {"XLA_FLAGS": xla_flags_with_host_devices(count)}
  if "JAX_NUM_CPU_DEVICES" in os.environ:
    env["JAX_NUM_CPU_DEVICES"] = str(-1 if count is None else count)
  return env
