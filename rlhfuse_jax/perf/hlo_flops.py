"""Matrix-product FLOPs and collective traffic of a compiled XLA program, counting every
iteration of its loops.

`compiled.cost_analysis()["flops"]` counts a while-loop body once, whatever its trip count, and a
conditional as its costliest branch (measured on jax 0.10.2, CPU: a `fori_loop` of 10 matmuls
reports the FLOPs of one). Our programs are loops: the pipeline executor's ticks, a stage's
`lax.scan` over layers, blockwise attention's tiles, the decode chunk. This walks the optimized
HLO text (`compiled.as_text()`, one SPMD partition, so the counts are per device) and counts

  dot        2 * prod(output dims) * prod(lhs contracting dims)
  GEMM custom-call  the same, for the dots XLA:GPU hands to cuBLAS / cuBLASLt (or rocBLAS):
             `custom-call(...), custom_call_target="__cublas$gemm"` (or `$lt$matmul...`),
             contracting dims from its backend config's dot_dimension_numbers, the result the
             first array of its (result, workspace) tuple. Any other custom-call (a cuDNN
             attention, a Pallas / Triton kernel) is opaque: counted in `uncounted_calls` by
             target, its FLOPs not in `flops`
  while      body x known_trip_count (XLA's loop analysis puts it in the backend config); a loop
             without a known trip count (an early-exit `while_loop`) counts once and is reported
  conditional  its costliest branch (as XLA's cost analysis: a lockstep tick lasts as long as
             its longest task); for collectives, the branch moving the most bytes
  fusion / call / map / async  the computation they call

Only dots are counted as FLOPs: the analytic model (perf/accounting.py) counts matrix products
too, so the two compare; elementwise work (norms, softmax, the optimizer) is left out of both.

Collectives (`collectives`): each all-gather, all-reduce, reduce-scatter, all-to-all and
collective-permute (or its async `-start`; `-done` moves nothing new) with its per-device buffer
in NCCL's sense (all-gather: the gathered output; reduce-scatter: the input, output x group;
all-reduce, all-to-all, collective-permute: the operands, every one of a combined
collective; an in-place collective-permute, `slice_sizes=`: its first array, not the slices),
its device groups (explicit `{{0,1},{2,3}}`, iota `[G,N]<=[dims]T(perm)` or named-axis
`mesh['a'=2,'b'=4] {'b'}` replica groups; partition ids, which are the mesh's devices in order)
and how often it runs. A decode chunk's loop has no known trip count, so its collectives count
once: one decode step's.

Widths: XLA:CPU widens 16-bit collectives to float32 after partitioning (its
all-reduce-promotion and float-normalization-bf16 passes; a bf16 weight's all-gather becomes a
convert, an f32 all-gather and a convert back), where a GPU moves them in 16 bits. Given the
element types of the partitioned program before those passes (`program_widths`, e.g. from an
XLA dump), `analyze` counts such float32 collectives at 16 bits: a collective of that kind and
shape that the program has only in bf16/f16. Matched by kind and shape, not by instruction:
later passes rename, combine and move collectives.
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
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# A GEMM custom-call's contracting dims: "lhs_contracting_dimensions":["1"] (or [1]).
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([\d",\s]*)\]')
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")  # (and $lt$matmul$f8)


_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Bytes per element of HLO's element types (sub-byte types rounded up to one byte).
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the program (module docstring)."""
  kind: str  # one of COLLECTIVES
  nbytes: int  # per device: the buffer NCCL's formulas take (module docstring)
  # Device groups: replica groups (each a tuple of partition ids), or for collective-permute the
  # (source, target) pairs. Empty: unreadable (counted in HloCosts.unread_groups).
  groups: tuple[tuple[int, ...], ...]


@dataclasses.dataclass
class HloCosts:
  flops: float  # dot FLOPs per device, loops multiplied out, conditionals at their maximum
  unknown_trip_loops: int  # while loops counted once because XLA knows no trip count
  loops: int  # while loops seen (each counted as often as its callers run)
  collectives: dict[Collective, float]  # each collective -> times it runs (loops multiplied)
  unread_groups: int = 0  # collectives whose groups are in a form this does not read
  # custom-call target -> times run, for custom-calls whose FLOPs are not counted (not GEMMs)
  uncounted_calls: dict[str, float] = dataclasses.field(default_factory=dict)

  def collective_bytes(self) -> dict[str, float]:
    """Per-device buffer bytes moved by each kind of collective, every execution counted."""
    out = {k: 0.0 for k in COLLECTIVES}
    for c, n in self.collectives.items():
      out[c.kind] += c.nbytes * n
    return out


def _dims(shape: str) -> tuple[int, ...] | None:
  m = _SHAPE.match(shape)
  if not m:
    return None
  return tuple(int(d) for d in m.group(1).split(",") if d)


def _array_bytes(type_str: str, kind: str = "", widths: Widths | None = None) -> list[int]:
  """Bytes of each array in an HLO type (a tuple lists several), in order. With `widths`
  (program_widths of the partitioned program), a float32 array of a `kind` collective is
  counted at 16 bits where the partitioned program has that collective on that shape only in
  16 bits (XLA:CPU widened it: module docstring)."""
  out = []
  for dtype, dims in _ARRAY.findall(type_str):
    shape = tuple(int(d) for d in dims.split(",") if d)
    itemsize = _ITEMSIZE.get(dtype, 1)
    if widths is not None and dtype == "f32":
      asked = widths.get((kind, shape))
      if asked and asked <= _16_BIT:
        itemsize = 2
    out.append(math.prod(shape) * itemsize)
  return out


_16_BIT = frozenset({"bf16", "f16"})
# (collective kind, array shape) -> the element types the partitioned program gives it.
Widths = dict[tuple[str, tuple[int, ...]], frozenset[str]]


def program_widths(hlo_text: str) -> Widths:
  """The element types of each (collective kind, array shape) in an HLO module: read from the
  partitioned program before XLA:CPU's float normalisation, which widens 16-bit collectives to
  float32 (XLA:CPU's all-reduce-promotion and float-normalization-bf16 passes; a GPU moves them
  in 16 bits), so that `analyze(optimized, widths=...)` can count them at the width the program
  asks for (module docstring)."""
  out: dict[tuple[str, tuple[int, ...]], set[str]] = {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    _, type_str, op, _ = m.groups()
    kind = op[:-len("-start")] if op.endswith("-start") else op
    if kind not in COLLECTIVES:
      continue
    for dtype, dims in _ARRAY.findall(type_str):
      out.setdefault((kind, tuple(int(d) for d in dims.split(",") if d)), set()).add(dtype)
  return {k: frozenset(v) for k, v in out.items()}


def _iota_groups(shape: list[int], dims: list[int], perm: list[int] | None):
  """XLA's iota replica groups: arange(prod(dims)) reshaped to dims, transposed by perm,
  reshaped to [groups, group size]."""
  total = math.prod(dims)
  ids = list(range(total))
  if perm:  # index arithmetic of numpy's reshape(dims).transpose(perm).reshape(-1)
    strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    tdims = [dims[p] for p in perm]
    ids = []
    for flat in range(total):
      idx, rem = [], flat
      for d in reversed(tdims):
        idx.append(rem % d)
        rem //= d
      idx.reverse()
      ids.append(sum(idx[k] * strides[perm[k]] for k in range(len(perm))))
  size = shape[-1]
  return tuple(tuple(ids[i:i + size]) for i in range(0, total, size))


def _mesh_groups(axes: str, chosen: str, device_ids: list[int] | None = None):
  """Named-axis replica groups `mesh['a'=2,'b'=4] {'b'}`: the mesh positions (row-major over the
  axes) that differ only along the chosen axes form a group; `device_ids` (`device_ids=([dims]
  T(perm))`, an iota like _iota_groups') names the device at each position (default: itself)."""
  names, sizes = [], []
  for part in axes.split(","):
    name, size = part.split("=")
    names.append(name.strip().strip("'\""))
    sizes.append(int(size))
  picked = {x.strip().strip("'\"") for x in chosen.split(",") if x.strip()}
  if not picked <= set(names):  # e.g. a sub-axis {'a':(1)2}: read as unread groups
    return ()
  strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
  groups: dict[tuple, list[int]] = {}
  for flat in range(math.prod(sizes)):
    idx = [(flat // strides[i]) % sizes[i] for i in range(len(sizes))]
    key = tuple(idx[i] for i in range(len(sizes)) if names[i] not in picked)
    groups.setdefault(key, []).append(flat if device_ids is None else device_ids[flat])
  return tuple(tuple(g) for g in groups.values())


def _groups(rest: str, kind: str, partitions: int) -> tuple[tuple[int, ...], ...]:
  if kind == "collective-permute":
    m = _PAIRS.search(rest)
    return tuple(tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}",
                                                                       m.group(1))) if m else ()
  m = _GROUPS_LIST.search(rest)
  if m:
    groups = tuple(tuple(int(x) for x in g.split(",") if x)
                   for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    groups = tuple(g for g in groups if g)
    return groups or (tuple(range(partitions)),)  # {}: every device, one group
  m = _GROUPS_IOTA.search(rest)
  if m:
    ints = lambda x: [int(v) for v in x.split(",")] if x else None
    return _iota_groups(ints(m.group(1)), ints(m.group(2)), ints(m.group(3)))
  m = _GROUPS_MESH.search(rest)
  if m and re.fullmatch(r"(?:\s*'?[\w.]+'?\s*=\s*\d+\s*,?)+", m.group(1)):
    ids = None
    if m.group(2):
      dims = [int(v) for v in m.group(2).split(",")]
      perm = [int(v) for v in m.group(3).split(",")] if m.group(3) else None
      ids = [i for g in _iota_groups([math.prod(dims)], dims, perm) for i in g]
    return _mesh_groups(m.group(1), m.group(4), ids)
  if "replica_groups" not in rest:
    return (tuple(range(partitions)),)
  return ()


def _tuple_elements(type_str: str) -> list[str]:
  """The top-level elements of a tuple type "(a, (b, c), u32[])" -> ["a", "(b, c)", "u32[]"];
  [] when the type is not a tuple."""
  type_str = type_str.strip()
  if not type_str.startswith("("):
    return []
  out, depth, begin = [], 0, 1
  for i, ch in enumerate(type_str):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth == 0:
        out.append(type_str[begin:i].strip())
        break
    elif ch == "," and depth == 1:
      out.append(type_str[begin:i].strip())
      begin = i + 1
  return [e for e in out if e]


def _collective(kind: str, start: bool, type_str: str, rest: str, partitions: int,
                widths: Widths | None = None) -> Collective:
  arrays = _array_bytes(type_str, kind, widths)
  if start and kind == "all-gather":  # (operands..., outputs...)
    nbytes = sum(arrays[len(arrays) // 2:])
  elif kind == "collective-permute" and "slice_sizes=" in rest:
    # In-place (input, output, input/output start indices): counted as before, the first
    # array (-start: the input; otherwise the output), not the slices it sends.
    nbytes = arrays[0] if arrays else 0
  elif start and kind == "collective-permute":  # (inputs, outputs, contexts...)
    inputs = (_tuple_elements(type_str) or [type_str])[0]
    nbytes = sum(_array_bytes(inputs, kind, widths))
  else:
    nbytes = sum(arrays)
  groups = _groups(rest, kind, partitions)
  if kind == "reduce-scatter" and groups:
    nbytes *= len(groups[0])  # the input: each device keeps 1/group of it
  return Collective(kind, int(nbytes), groups)


def _parse(hlo_text: str) -> tuple[dict[str, list[str]], str]:
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
  return comps, entry


def _add_into(out: dict, b: dict, reps: float = 1.0) -> None:
  for c, n in b.items():
    out[c] = out.get(c, 0.0) + n * reps


def _dot_flops(inst: str, comp: str, shapes: dict, out: tuple[int, ...] | None, rest: str,
               contracting: str | None) -> float:
  """2 x prod(out) x prod(lhs contracting dims) of a dot (or GEMM custom-call) `inst` whose
  first operand's shape is in `shapes`; `contracting`: the lhs contracting dims, "1,2"."""
  operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
  lhs = shapes.get(operands[0]) if operands else None
  if lhs is None or out is None or contracting is None:
    raise ValueError(f"cannot read the shapes of dot {inst!r} in {comp!r}")
  k = math.prod(lhs[int(d)] for d in contracting.split(",") if d.strip())
  return 2.0 * math.prod(out) * k


def analyze(hlo_text: str, widths: Widths | None = None) -> HloCosts:
  """Per-device dot FLOPs and collectives of an optimized HLO module's text (module
  docstring); with `widths` (program_widths), widened collectives at the program's width."""
  comps, entry = _parse(hlo_text)
  m = _PARTITIONS.search(hlo_text.split("\n", 1)[0])
  partitions = int(m.group(1)) if m else 1
  memo: dict[str, tuple] = {}
  unread = [0]

  def cost(name: str) -> tuple[float, int, int, dict, dict]:
    """(flops, loops without trip count, loops, collectives, uncounted custom-calls)."""
    if name in memo:
      return memo[name]
    memo[name] = (0.0, 0, 0, {}, {})  # guards against recursion
    shapes: dict[str, tuple[int, ...] | None] = {}
    flops, unknown, loops, colls, opaque = 0.0, 0, 0, {}, {}
    for line in comps.get(name, []):
      m = _INSTR.match(line)
      if not m:
        continue
      inst, shape, op, rest = m.groups()
      shapes[inst] = _dims(shape)
      base = op[:-len("-start")] if op.endswith("-start") else op
      if base in COLLECTIVES:
        c = _collective(base, op != base, shape, rest, partitions, widths)
        unread[0] += 0 if c.groups else 1
        colls[c] = colls.get(c, 0.0) + 1.0
      elif op.endswith("-done") or op.endswith("-update"):
        continue  # the -start (or async-start's computation) holds the work
      elif op == "dot":
        contract = _CONTRACT.search(rest)
        flops += _dot_flops(inst, name, shapes, shapes[inst], rest,
                            contract.group(1) if contract else None)
      elif op == "custom-call":
        target = _TARGET.search(rest)
        target = target.group(1) if target else "?"
        if target.startswith(_GEMM_TARGETS):
          result = _ARRAY.search(shape)  # the result: the first array of (result, workspace)
          contract = _GEMM_CONTRACT.search(rest)
          flops += _dot_flops(inst, name, shapes, _dims(result.group(0)) if result else None,
                              rest, contract.group(1).replace('"', "") if contract else None)
        else:
          opaque[target] = opaque.get(target, 0.0) + 1.0
      elif op == "while":
        body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
        trip = _TRIP.search(rest)
        f, u, n, c, o = cost(body)
        reps = int(trip.group(1)) if trip else 1
        flops += reps * f
        _add_into(colls, c, reps)
        _add_into(opaque, o, reps)
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
        _add_into(colls, max((x[3] for x in branch), key=lambda d: sum(
            c.nbytes * n for c, n in d.items())))
        for target in {t for x in branch for t in x[4]}:  # as often as the branch calling most
          opaque[target] = opaque.get(target, 0.0) + max(x[4].get(target, 0.0) for x in branch)
      else:
        for callee in _CALLS.findall(rest):
          f, u, n, c, o = cost(callee)
          flops, unknown, loops = flops + f, unknown + u, loops + n
          _add_into(colls, c)
          _add_into(opaque, o)
    memo[name] = (flops, unknown, loops, colls, opaque)
    return memo[name]

  f, u, n, c, o = cost(entry)
  return HloCosts(flops=f, unknown_trip_loops=u, loops=n, collectives=c,
                  unread_groups=unread[0], uncounted_calls=o)
