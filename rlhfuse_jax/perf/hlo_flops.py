"""Matrix-product FLOPs of a compiled XLA program, counting every iteration of its loops.

`compiled.cost_analysis()["flops"]` counts a while-loop body once, whatever its trip count, and a
conditional as its costliest branch (measured on jax 0.10.2, CPU: a `fori_loop` of 10 matmuls
reports the FLOPs of one). Our programs are loops: the pipeline executor's ticks, a stage's
`lax.scan` over layers, blockwise attention's tiles, the decode chunk. This walks the optimized
HLO text (`compiled.as_text()`, one SPMD partition, so the counts are per device) and counts

  dot        2 * prod(output dims) * prod(lhs contracting dims)
  while      body x known_trip_count (XLA's loop analysis puts it in the backend config); a loop
             without a known trip count (an early-exit `while_loop`) counts once and is reported
  conditional  its costliest branch (as XLA's cost analysis: a lockstep tick lasts as long as
             its longest task)
  fusion / call / map  the computation they call

Only dots are counted: the analytic model (perf/accounting.py) counts matrix products too, so the
two compare; elementwise work (norms, softmax, the optimizer) is left out of both.
"""
from __future__ import annotations

import dataclasses
import math
import re

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
# name = type op(operands), attributes; a tuple type "(s32[], f32[2]{0})" holds spaces.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"^[a-z]\w*\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"(?:true_computation|false_computation)=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


@dataclasses.dataclass
class HloFlops:
  flops: float  # dot FLOPs per device, loops multiplied out, conditionals at their maximum
  unknown_trip_loops: int  # while loops counted once because XLA knows no trip count
  loops: int  # while loops seen (each counted as often as its callers run)


def _dims(shape: str) -> tuple[int, ...] | None:
  m = _SHAPE.match(shape)
  if not m:
    return None
  return tuple(int(d) for d in m.group(1).split(",") if d)


def dot_flops(hlo_text: str) -> HloFlops:
  """Per-device dot FLOPs of an optimized HLO module's text (see module docstring)."""
  comps: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    m = _HEADER.match(line)
    if m:
      current = m.group(1)
      comps[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif current is not None and line.strip() == "}":
      current = None
    elif current is not None:
      comps[current].append(line)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  memo: dict[str, tuple[float, int, int]] = {}

  def cost(name: str) -> tuple[float, int, int]:
    if name in memo:
      return memo[name]
    memo[name] = (0.0, 0, 0)  # guards against recursion
    shapes: dict[str, tuple[int, ...] | None] = {}
    flops, unknown, loops = 0.0, 0, 0
    for line in comps.get(name, []):
      m = _INSTR.match(line)
      if not m:
        continue
      inst, shape, op, rest = m.groups()
      shapes[inst] = _dims(shape)
      if op == "dot":
        operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        lhs = shapes.get(operands[0]) if operands else None
        out = shapes[inst]
        contract = _CONTRACT.search(rest)
        if lhs is None or out is None or contract is None:
          raise ValueError(f"cannot read the shapes of dot {inst!r} in {name!r}")
        k = math.prod(lhs[int(d)] for d in contract.group(1).split(",") if d)
        flops += 2.0 * math.prod(out) * k
      elif op == "while":
        body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
        trip = _TRIP.search(rest)
        f, u, n = cost(body)
        reps = int(trip.group(1)) if trip else 1
        flops += reps * f
        unknown += u + (0 if trip else 1)
        loops += n + 1
      elif op == "conditional":
        names = _TRUE_FALSE.findall(rest)
        b = _BRANCHES.search(rest)
        if b:
          names = [x.strip().lstrip("%") for x in b.group(1).split(",")]
        branch = [cost(x) for x in names]
        flops += max(x[0] for x in branch)
        unknown += sum(x[1] for x in branch)
        loops += sum(x[2] for x in branch)
      else:
        for callee in _CALLS.findall(rest):
          f, u, n = cost(callee)
          flops, unknown, loops = flops + f, unknown + u, loops + n
    memo[name] = (flops, unknown, loops)
    return memo[name]

  f, u, n = cost(entry)
  return HloFlops(flops=f, unknown_trip_loops=u, loops=n)
