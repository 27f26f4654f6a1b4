"""The one wording of a bad config value, shared by every typed config (trainer/config.py, the
benchmarks' configs, plan_check's, the fused engine's): `config.FIELD=VALUE: expected WHAT`.

No imports: the jax-free binaries (bench_async) use it too.
"""
from __future__ import annotations

import numbers
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


def is_seed_field(key: str) -> bool:
  """A config field that only picks a random stream: `seed`, `pipeline.search_seed`, ..."""
  last = key.rsplit(".", 1)[-1]
  return last == "seed" or last.endswith("_seed")


# Sizes and counts become int32 shapes, loop bounds and device scalars: 2**70 passed the
# configs' checks and then failed in jit ("overflow ... parsing an argument"), in MLIR, in numpy,
# or hung building a model of that many layers, or an error named another field (plan_check's
# pp blamed actor.num_layers). Seeds are no size (numpy takes 64 bits).
MAX_INT = 2**31 - 1


def check_int32(field: str, value: int) -> None:
  """`fail` for an integer beyond MAX_INT in magnitude, unless `field` is a seed's."""
  check(is_seed_field(field) or abs(value) <= MAX_INT, field, value,
        f"an integer of at most {MAX_INT} in magnitude (2**31 - 1: sizes and counts are 32-bit "
        "on the devices)")


def is_number(v: Any) -> bool:
  """An int or float that is not a bool."""
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_numeric(v: Any, integral: bool = False) -> bool:
  """is_int (`integral`) or is_number with numpy's scalars too (np.int64, np.float32: a config
  file may hold them, and numpy registers them as numbers.Integral / numbers.Real)."""
  return not isinstance(v, bool) and isinstance(v, numbers.Integral if integral else numbers.Real)
