"""Fake host (CPU) devices for the CPU benchmarks: one place for the XLA flag and its rule.

Must run before the first `import jax` anywhere in the process (XLA reads the flag once), so this
module imports nothing from jax. The flag only adds host devices, so it is harmless where an
accelerator is the default backend; a count the caller already set is left alone.
"""
from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"


def request_host_devices(count: int = 8) -> None:
  """Adds `--xla_force_host_platform_device_count=count` to XLA_FLAGS unless a count is set."""
  flags = os.environ.get("XLA_FLAGS", "")
  if _FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()
