"""Device meshes and the mapping of logical parameter/activation axes onto them.

Mesh axes (in this order): `data` (pure data parallel), `fsdp` (data parallel with parameters
sharded along `embed`), `stage` (pipeline), `tensor` (Megatron-style tensor parallel). A mesh is
built from a `MeshConfig`; -1 in one field takes the remaining devices.

Parameters carry logical names (see models/llama.py); `LOGICAL_RULES` maps each onto mesh axes.
A dimension that the mapped mesh axis does not divide is replicated instead of failing, and the
fallback is logged once: correctness never depends on the sharding. The attention projections'
head axes are their heads x head_dim columns, so the test is on that product: 2 KV heads of 64
on tensor=4 split mid-head (128 columns, 32 a device), not replicated.
(The pipelined update's manual Megatron split is stricter: it needs heads and MLP width divisible
by `tensor`, and KV heads divisible by it or dividing it; trainer/pipelined.check_config says so.)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "stage", "tensor")
BATCH_AXES = ("data", "fsdp")  # the global batch is split over both data-parallel axes

# logical axis -> mesh axis (None: replicated).
LOGICAL_RULES = {
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    "layers": None,  # the stacked axis of model.scan_layers params
    "batch": BATCH_AXES,
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1  # -1: all devices left after the other axes
  fsdp: int = 1
  stage: int = 1
  tensor: int = 1

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    if sum(v == -1 for v in sizes.values()) > 1:
      raise ValueError(f"mesh: at most one axis may be -1 (take the rest); got {sizes}")
    for k, v in sizes.items():
      if v != -1 and v < 1:
        raise ValueError(f"mesh.{k}={v}; expected a positive size or -1")

  @property
  def fixed_devices(self) -> int:
    """The devices the axes other than a -1 one take: the fewest the mesh runs on."""
    return math.prod(v for v in dataclasses.asdict(self).values() if v != -1)

  def resolve(self, num_devices: int) -> dict[str, int]:
    """Axis sizes for `num_devices`, with a clear error when they do not factor."""
    sizes = dataclasses.asdict(self)
    fixed = self.fixed_devices
    free = [k for k, v in sizes.items() if v == -1]
    if free:
      if num_devices % fixed:
        raise ValueError(
            f"mesh: {num_devices} devices cannot be split as {sizes}: the fixed axes take "
            f"{fixed} devices, which does not divide {num_devices}")
      sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
      raise ValueError(f"mesh: axes {sizes} multiply to {fixed} devices but {num_devices} are "
                       f"available; set one axis to -1 or make the product {num_devices}")
    return sizes


_warned: set = set()  # the fallbacks already logged (each once)


def make_mesh(cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None, *,
              by_topology: bool = False) -> Mesh:
  """Builds a mesh with axes MESH_AXES (Auto axis types: classic GSPMD/shard_map semantics).

  The devices go in the order given (reshaped, the last axis fastest): callers that build a
  mesh over groups they chose (an instance, the grid of all instances) rely on it. The
  training mesh passes by_topology=True: its devices are arranged by `device_array`."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = cfg.resolve(len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  arranged = (device_array(shape, devices) if by_topology
              else np.asarray(devices, dtype=object).reshape(shape))
  if by_topology:
    warn_tensor_across_hosts(arranged)
  return Mesh(arranged, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def warn_tensor_across_hosts(arranged: np.ndarray) -> bool:
  """Warns (once per layout; returns True) when a tensor group of the training mesh (`arranged`,
  MESH_AXES order) holds GPU or CPU devices of several processes: tensor parallelism all-reduces
  twice per layer, over the hosts' network there instead of NVLink. (A TPU slice's hosts share
  the ICI torus, so it is not warned of there.)"""
  first = arranged.flat[0]
  if getattr(first, "platform", None) == "tpu":
    return False
  procs = np.vectorize(lambda d: getattr(d, "process_index", 0), otypes=[int])(arranged)
  tensor = procs.reshape(-1, arranged.shape[-1])  # one row per tensor group
  if (tensor.min(axis=1) == tensor.max(axis=1)).all():
    return False
  key = ("tensor_across_hosts", arranged.shape)
  if key not in _warned:
    _warned.add(key)
    split = [row for row in tensor.tolist() if len(set(row)) > 1]
    logging.warning(
        "mesh.tensor=%d: %d of its %d tensor groups span processes (hosts; up to %d each): "
        "each layer's tensor-parallel all-reduces cross the network there; keep every group "
        "within one host (tensor a divisor of the devices per host, data or fsdp across "
        "hosts)", arranged.shape[-1], len(split), len(tensor), max(len(set(r)) for r in split))
  return True


def device_array(shape: Sequence[int], devices: Sequence[Any]) -> np.ndarray:
  """`devices` as an array of `shape` (MESH_AXES order: from the axis that communicates least,
  data, to the one that communicates most, tensor).

  TPU: by the chips' positions in the ICI torus (jax's mesh_utils.create_device_mesh, as
  MaxText builds its meshes), so that each tensor group, and each group along the axes before
  it, lies along the torus' rings whatever order the devices come in; with several slices
  (multislice), the data axis spans the slices over the data-centre network and every other
  axis stays inside one (create_hybrid_device_mesh). A device set mesh_utils cannot arrange (a
  part of a slice, data not a multiple of the slices) falls back to the order given, with a
  warning. Other platforms: the order given (jax.devices(): by process, so the innermost axes
  stay inside a host, e.g. a GPU node's NVLink domain)."""
  devices = list(devices)
  if devices and getattr(devices[0], "platform", None) == "tpu":
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    try:
      if slices == 1:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
      if shape[0] % slices:
        raise ValueError(f"mesh.data={shape[0]} is not a multiple of the {slices} TPU slices")
      return mesh_utils.create_hybrid_device_mesh(
          (shape[0] // slices, *shape[1:]), (slices,) + (1,) * (len(shape) - 1), devices,
          allow_split_physical_axes=True)
    except (ValueError, AssertionError, NotImplementedError) as e:
      key = ("device_array", tuple(shape), len(devices))
      if key not in _warned:
        _warned.add(key)
        logging.warning("mesh %s on %d TPU devices: not arranged by the ICI topology (%s); "
                        "using the devices in the order given", dict(zip(MESH_AXES, shape)),
                        len(devices), e)
  return np.asarray(devices, dtype=object).reshape(shape)


def fold_stage(mesh: Mesh) -> Mesh:
  """The same devices with the `stage` axis folded into `data` (stage 1): the layout for work on
  whole models (generation, inference) on a pipelined training mesh, where the batch then splits
  over data x stage x fsdp instead of running again on every stage device. Each device keeps its
  fsdp and tensor coordinates, so parameters sharded by their logical axes (never over `stage`)
  occupy every device exactly as on `mesh`."""
  d, f, s, t = (mesh.shape[a] for a in MESH_AXES)
  if s == 1:
    return mesh
  devices = np.transpose(mesh.devices, (0, 2, 1, 3)).reshape(d * s, f, 1, t)
  return Mesh(devices, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def batch_size_multiple(mesh: Mesh) -> int:
  """The global batch must be a multiple of this to be split over the data axes."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Sharding of an array whose leading dim is the batch: split over (data, fsdp), the rest
  replicated."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def _mesh_spec(logical: P, shape: Sequence[int], mesh: Mesh, where: str) -> P:
  out = []
  for dim, name in zip(shape, tuple(logical) + (None,) * (len(shape) - len(logical))):
    axis = LOGICAL_RULES.get(name) if name is not None else None
    if name is not None and name not in LOGICAL_RULES:
      raise KeyError(f"logical axis {name!r} of {where} has no rule; known: {list(LOGICAL_RULES)}")
    if axis is not None:
      size = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
      if dim % size:
        key = (where, name, size)
        if key not in _warned:
          _warned.add(key)
          logging.info("replicating %s dim %d (%s): not divisible by mesh size %d", where, dim,
                       name, size)
        axis = None
    out.append(axis)
  return P(*out)


def param_shardings(params: Any, logical_specs: Any, mesh: Mesh) -> Any:
  """NamedSharding per parameter leaf, from its logical spec and shape."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  spec_leaves = treedef.flatten_up_to(logical_specs)
  out = []
  for (path, leaf), spec in zip(leaves, spec_leaves):
    where = jax.tree_util.keystr(path)
    out.append(NamedSharding(mesh, _mesh_spec(spec, np.shape(leaf), mesh, where)))
  return jax.tree_util.tree_unflatten(treedef, out)


def zero1_sharding(sharding: NamedSharding, shape: Sequence[int]) -> NamedSharding:
  """ZeRO stage 1's placement of an optimizer-state leaf (a float32 copy, a moment) that mirrors
  a parameter placed by `sharding`: split further over every mesh axis of size > 1 the
  parameter is replicated over (its data-parallel copies, a pipelined critic's replicas), each
  such axis on the dimension with the most elements per shard that it divides. These copies all
  see the same gradients and take the same step, so each device can keep and step one slice of
  the state; the update then gathers the stepped weights over those axes. An axis no dimension
  divides (a norm gain on a large mesh) stays replicated."""
  if not isinstance(sharding, NamedSharding):
    raise TypeError("optim.zero1 splits a parameter over the axes of the mesh it is placed on, "
                    f"so it needs a NamedSharding; this one is placed by {sharding!r}")
  mesh = sharding.mesh
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  entries = [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in spec]
  used = {a for e in entries for a in e}
  for axis in mesh.axis_names:
    size = mesh.shape[axis]
    if size == 1 or axis in used:
      continue
    split = [math.prod(mesh.shape[a] for a in e) for e in entries]
    fits = [k for k, dim in enumerate(shape) if dim % (split[k] * size) == 0]
    if fits:
      k = max(fits, key=lambda k: shape[k] // split[k])
      entries[k] += (axis,)
  spec = [None if not e else (e[0] if len(e) == 1 else e) for e in entries]
  return NamedSharding(mesh, P(*spec), memory_kind=sharding.memory_kind)


def places_alike(x: Any, sharding: Any) -> bool:
  """Whether every device already holds exactly the shard of `x` (an array or a placed
  jax.ShapeDtypeStruct) that `sharding` gives it (e.g. a NamedSharding of fold_stage's mesh for
  an array on the training mesh): `put` relabels such an array, nothing moves (and
  experiments/plan_programs.py counts no move for it)."""
  return (x.sharding.device_set == sharding.device_set
          and x.sharding.devices_indices_map(x.shape) == sharding.devices_indices_map(x.shape))


def _same_placement(x: Any, sharding: Any) -> bool:
  return (isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
          and places_alike(x, sharding))


def _identity(x: Any) -> Any:
  return x


def _box(index: tuple, shape: tuple) -> tuple:
  """A shard's index (a tuple of slices) as ((start, stop), ...) per dimension."""
  return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


def _inside(inner: tuple, outer: tuple) -> bool:
  return all(a <= c and d <= b for (c, d), (a, b) in zip(inner, outer))


def _device_order(sharding: Any) -> list:
  """The devices of `sharding` in its own order (a jitted reshard's output must keep it)."""
  if isinstance(sharding, NamedSharding):
    return list(sharding.mesh.devices.flat)
  return list(sharding._device_assignment)  # pylint: disable=protected-access  (jit's order)


def _nesting_sharding(x: jax.Array, boxes: list) -> NamedSharding:
  """A layout of `x` over its own devices in which every one of `boxes` lies inside one device's
  shard: each dimension split into the most even chunks (as many as the devices allow, the
  first dimensions first) of which none cuts a box, replicated over the devices left."""
  devices, left, names, spec = _device_order(x.sharding), len(x.sharding.device_set), [], []
  for k, n in enumerate(x.shape):
    spans = {b[k] for b in boxes if b[k][1] > b[k][0]}
    r = max((r for r in range(1, left + 1) if left % r == 0 and n % r == 0 and
             all(c // (n // r) == (d - 1) // (n // r) for c, d in spans)), default=1)
    spec.append(f"_d{k}" if r > 1 else None)
    if r > 1:
      names.append((f"_d{k}", r))
      left //= r
  shape = [r for _, r in names] + [left]
  mesh = Mesh(np.array(devices).reshape(shape), tuple(a for a, _ in names) + ("_rest",))
  return NamedSharding(mesh, P(*spec))


def _pieces(x: jax.Array, targets: dict) -> list:
  """x's shard for each of `targets` ({device: index}, every device this process's), as one
  single-device array each, copied device to device from a shard of x that holds it (x first
  resharded on its own devices, one jitted program, where no shard does).

  jax.device_put to a layout on other devices (or to another layout of the same devices in the
  same order) copies only shards whose index matches a target's exactly, and otherwise reads
  the whole array into host memory and puts it back, shard by shard: a GPU run's actor went
  through host memory each iteration on its way to generation instances that split it another
  way than training (gen_tp > 1 from a replicated or fsdp-split actor)."""
  want = {d: _box(i, x.shape) for d, i in targets.items()}

  def held(arr):
    return [(s, _box(s.index, x.shape)) for s in arr.addressable_shards]
  shards = held(x)
  if not all(any(_inside(w, b) for _, b in shards) for w in want.values()):
    x = jax.jit(_identity, out_shardings=_nesting_sharding(x, list(want.values())))(x)
    shards = held(x)
  out = []
  for device, w in want.items():
    holders = [(s, b) for s, b in shards if _inside(w, b)]
    s, b = next(((s, b) for s, b in holders if s.device == device), holders[0])
    piece = s.data if w == b else s.data[tuple(slice(c - a, d - a)
                                               for (c, d), (a, _) in zip(w, b))]
    out.append(piece if s.device == device else jax.device_put(piece, device))
  return out


def _moved(x: jax.Array, sharding: Any) -> jax.Array:
  """`x` (every shard this process's) placed by `sharding` (every device this process's),
  device to device (_pieces: never through host memory)."""
  if x.sharding.device_set == sharding.device_set:
    if _device_order(x.sharding) == _device_order(sharding):
      return jax.jit(_identity, out_shardings=sharding)(x)  # one program: XLA's collectives
    if isinstance(x.sharding, NamedSharding) and isinstance(sharding, NamedSharding):
      return jax.device_put(x, sharding)  # jax's own reshard of another device order: one jit
  return jax.make_array_from_single_device_arrays(
      x.shape, sharding, _pieces(x, sharding.addressable_devices_indices_map(x.shape)))


def _put_leaf(x: Any, sharding: NamedSharding) -> jax.Array:
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  if _same_placement(x, sharding):
    # Relabelled, not moved: device_put would copy every shard when the mesh's device order
    # differs, and across processes the path below would gather the whole array to each host.
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [s.data for s in x.addressable_shards])
  if (isinstance(x, jax.Array) and x.is_fully_addressable and sharding.is_fully_addressable
      and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) and not x.weak_type):
    return _moved(x, sharding)  # (a weak-typed scalar as jax.device_put keeps it: weak)
  if jax.process_count() == 1 or sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(_put_leaf(jax.random.key_data(x), sharding))
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if x.sharding.device_set == sharding.device_set:
      # Multi-host, an array spread over the processes onto another layout of the same devices:
      # one collective reshard, device to device, which every process joins (as it would
      # to_host's gather). jax refuses it between different device sets (CPU and GPU runtimes).
      return jax.device_put(x, sharding)
    grid = _process_grid(x.sharding.device_set, sharding.device_set)
    if grid is not None:
      return _put_via_own_devices(x, sharding, grid)
  # Multi-host otherwise: every process holds the same host value (same seed, same data stream)
  # and supplies the shards its own devices own; an array placed on another set of devices is
  # gathered to every process first.
  host = np.asarray(to_host(x))
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _process_grid(src: set, dst: set) -> Optional[np.ndarray]:
  """`src`'s devices as a [processes, devices per process] array (each row one process's, by id),
  when every process has as many of them and every process owning a device of `dst` owns some of
  `src`; None otherwise."""
  rows: dict = {}
  for d in src:
    rows.setdefault(d.process_index, []).append(d)
  if len({len(r) for r in rows.values()}) != 1 or not {d.process_index for d in dst} <= set(rows):
    return None
  return np.array([sorted(rows[p], key=lambda d: d.id) for p in sorted(rows)])


def _put_via_own_devices(x: jax.Array, sharding: NamedSharding, grid: np.ndarray) -> jax.Array:
  """Multi-host, `x` onto another set of devices without going through host memory: resharded on
  its own devices so that each process's share of them holds the whole array (split along one
  dimension over that process's devices where it divides, the processes alike: one collective
  every process joins, device to device), then each process copies to its own devices of
  `sharding` from its own (device to device, no other process involved).

  Extra memory on `x`'s devices: the array over the devices each process has (1/L of it per
  device for L such devices, the whole of it where no dimension divides by L); none when `x` is
  replicated (each process copies from one of its own copies). Async PPO hands
  the updated policy from the training group to the generation group this way
  (trainer/loop._to_generation); jax refuses a device_put between different device sets across
  processes.
  """
  targets = sharding.addressable_devices_indices_map(x.shape)
  if x.is_fully_replicated:  # each device of `x` has it whole: no collective
    local = x.addressable_shards[0].data if targets else None
  else:
    n = grid.shape[1]
    dim = next((i for i, size in enumerate(x.shape) if size % n == 0), None)
    spec = P(*["_local" if i == dim else None for i in range(x.ndim)])
    staged = jax.device_put(x, NamedSharding(Mesh(grid, ("_proc", "_local")), spec))
    if targets:  # this process's row of the grid holds the whole array
      own = next(row for row in grid if row[0].process_index == jax.process_index())
      shards = {s.device: s.data for s in staged.addressable_shards}
      local = jax.make_array_from_single_device_arrays(
          x.shape, NamedSharding(Mesh(own, ("_local",)), spec), [shards[d] for d in own])
  pieces = _pieces(local, targets) if targets else []
  return jax.make_array_from_single_device_arrays(x.shape, sharding, pieces)


def put(tree: Any, shardings: Any) -> Any:
  """jax.device_put that also works when the shardings span several processes (multi-host).

  `shardings` is one sharding for all leaves or a matching tree of shardings. Every process
  calls it with the same shardings and either the same host values, its own local arrays, or
  global arrays. Not for a global array whose devices all belong to one process (an
  instance's) moved elsewhere, or onto one process's devices from several: the path taken
  reads `is_fully_addressable`, which differs between the owner and the others, and the
  owner cannot tell such an array from a local one, so nothing here can refuse it; use
  jax.device_put on the owner (as generation/fused.py does for its instances).
  """
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree_util.tree_map(lambda x: _put_leaf(x, shardings), tree)
  return jax.tree_util.tree_map(_put_leaf, tree, shardings)


def local_blocks(x: jax.Array, blocks: dict) -> list[jax.Array]:
  """{device: index into x} -> each block of `x` as a one-device array on its device, copied
  device to device (_pieces), so no device holds more of `x` than it did plus its own blocks
  (a reshaped or stacked copy of x put afterwards would first sit whole on x's devices). `x` and
  every device this process's (callers check `movable_locally`)."""
  return _pieces(x, blocks)


def movable_locally(x: Any) -> bool:
  """Whether `local_blocks` takes `x`: a jax array of this process's devices, not a key."""
  return (isinstance(x, jax.Array) and x.is_fully_addressable
          and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))


def shard_params(params: Any, logical_specs: Any, mesh: Mesh) -> Any:
  """Places parameters onto the mesh according to the logical rules."""
  return put(params, param_shardings(params, logical_specs, mesh))


HOST_MEMORY = "pinned_host"  # the host memory beside each device (jax memory kinds)


def _local_devices(mesh: Mesh) -> list[jax.Device]:
  """The devices of `mesh` that this process drives, in mesh order."""
  return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def first_local_device(mesh: Mesh) -> jax.Device:
  return _local_devices(mesh)[0]


def has_host_memory(mesh: Mesh) -> bool:
  """Whether every local device of `mesh` can hold arrays in its host memory (`HOST_MEMORY`):
  GPU, TPU and the CPU backend can."""
  return all(HOST_MEMORY in {m.kind for m in d.addressable_memories()}
             for d in _local_devices(mesh))


def to_host_memory(tree: Any) -> tuple[Any, Any]:
  """(moved, shardings): `tree`'s arrays moved shard by shard into the host memory beside the
  devices that hold them (same devices, same shards: nothing is gathered or replicated), and
  their shardings as they were, for `from_host_memory`."""
  shardings = jax.tree.map(lambda x: x.sharding, tree)
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(HOST_MEMORY)),
                      tree), shardings


def from_host_memory(tree: Any, shardings: Any) -> Any:
  """`to_host_memory` undone: each shard back into its device's memory, placed exactly as
  before (the same shardings, so a jitted function taking them does not compile again)."""
  return jax.tree.map(jax.device_put, tree, shardings)


def abstract(tree: Any, shardings: Any = None) -> Any:
  """jax.ShapeDtypeStructs of `tree`'s leaves (arrays or structs) placed by `shardings` (a
  matching tree), or by each leaf's own sharding: ahead-of-time lowering allocates nothing."""
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def missing_bytes(dst: jax.Array, held: Callable[[jax.Device], Optional[tuple]]
                  ) -> dict[jax.Device, int]:
  """Per device: bytes of its shard of `dst` that it does not hold already, where `held(device)`
  is the index box (a tuple of slices into dst's shape) of what the device holds of the same
  values, or None. Computed from the placements alone (no data is read)."""
  shape, out = dst.shape, {}
  for device, box in dst.sharding.devices_indices_map(shape).items():
    need = math.prod(len(range(*sl.indices(n))) for sl, n in zip(box, shape))
    have = held(device)
    if have is not None:
      have = math.prod(max(0, min(a.indices(n)[1], b.indices(n)[1]) -
                              max(a.indices(n)[0], b.indices(n)[0]))
                       for a, b, n in zip(box, have, shape))
    out[device] = (need - (have or 0)) * dst.dtype.itemsize
  return out


def to_host(tree: Any) -> Any:
  """jax.device_get that also works for arrays spanning several processes (multi-host).

  A global array whose shards live on other hosts cannot be read locally: it is all-gathered
  first (every process gets the full value, which keeps the host-side loop identical on all of
  them). Single-process runs take the plain device_get path.
  """
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils  # multi-host only

  def get(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.device_get(x)

  return jax.tree_util.tree_map(get, tree)
