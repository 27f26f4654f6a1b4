"""The one wording of a bad config value, shared by every typed config (trainer/config.py, the
benchmarks' configs, plan_check's, the fused engine's): `config.FIELD=VALUE: expected WHAT`.

No imports: the jax-free binaries (bench_async) use it too.
"""
from __future__ import annotations

from typing import Any, NoReturn


def fail(field: str, value: Any, expected: str) -> NoReturn:
  """Raises the ValueError naming `config.{field}`, its value and what was expected."""
  raise ValueError(f"config.{field}={value!r}: expected {expected}")


def check(cond: bool, field: str, value: Any, expected: str) -> None:
  """`fail` unless `cond`."""
  if not cond:
    fail(field, value, expected)


def is_int(v: Any) -> bool:
  """An int that is not a bool (True would pass as 1)."""
  return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
  """An int or float that is not a bool."""
  return isinstance(v, (int, float)) and not isinstance(v, bool)
