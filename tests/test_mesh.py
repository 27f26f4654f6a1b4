"""parallel/mesh.device_array: how make_mesh arranges devices. TPU pods are checked on mock devices
(the attributes jax's mesh_utils reads: coords, core_on_chip, slice_index), since no TPU is here."""
import dataclasses
import itertools
import logging
import threading

import jax
import numpy as np

from rlhfuse_jax.generation import instances
from rlhfuse_jax.parallel import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class MockTpu:
  id: int
  coords: tuple
  slice_index: int = 0
  process_index: int = 0
  core_on_chip: int = 0
  platform: str = "tpu"
  device_kind: str = "TPU v4"


def _pod(x, y, z, slices=1, seed=0):
  """Every chip of `slices` slices of an x × y × z TPU v4 torus, shuffled: the arrangement must
  not depend on the order the devices come in. A host holds a 2 × 2 × 1 block of chips, as a
  v4 host does (x and y even)."""
  hosts_per_slice = (x // 2) * (y // 2) * z
  devices = [MockTpu(id=s * x * y * z + i, coords=(cx, cy, cz), slice_index=s,
                     process_index=s * hosts_per_slice + (cz * (y // 2) + cy // 2) * (x // 2)
                     + cx // 2)
             for s in range(slices)
             for i, (cx, cy, cz) in enumerate((cx, cy, cz) for cz in range(z) for cy in range(y)
                                              for cx in range(x))]
  order = np.random.default_rng(seed).permutation(len(devices))
  return [devices[i] for i in order]


def _is_ring(group, side):
  """The devices of `group` are one whole ring of the torus: they share two coordinates and
  take every value of the third (length `side`), so neighbours in the group are ICI links."""
  coords = np.array([d.coords for d in group])
  varying = [k for k in range(3) if len(set(coords[:, k])) > 1]
  return len(varying) == 1 and sorted(coords[:, varying[0]]) == list(range(side))


def test_a_tpu_slice_puts_tensor_and_stage_groups_on_the_torus_rings():
  devices = _pod(4, 4, 4)
  shape = (2, 2, 4, 4)  # data, fsdp, stage, tensor
  arranged = mesh_lib.device_array(shape, devices)
  assert arranged.shape == shape and sorted(d.id for d in arranged.flat) == list(range(64))
  for a, b, c in itertools.product(range(2), range(2), range(4)):
    assert _is_ring(arranged[a, b, c, :], 4), [d.coords for d in arranged[a, b, c, :]]
  for a, b, t in itertools.product(range(2), range(2), range(4)):
    assert _is_ring(arranged[a, b, :, t], 4), [d.coords for d in arranged[a, b, :, t]]
  # The order given, reshaped, is what make_mesh did before: its tensor groups are not rings.
  plain = np.asarray(devices, dtype=object).reshape(shape)
  assert not all(_is_ring(plain[a, b, c, :], 4)
                 for a, b, c in itertools.product(range(2), range(2), range(4)))


def test_several_tpu_slices_split_only_the_data_axis_between_them():
  devices = _pod(2, 2, 2, slices=2)
  arranged = mesh_lib.device_array((4, 1, 1, 4), devices)
  for i in range(4):  # a data index's devices are in one slice; data 0-1 and 2-3 in two
    assert len({d.slice_index for d in arranged[i].flat}) == 1, i
  assert len({arranged[i, 0, 0, 0].slice_index for i in range(4)}) == 2
  for i in range(4):  # tensor groups of 4 in a 2 × 2 × 2 slice: a face of the cube
    coords = np.array([d.coords for d in arranged[i, 0, 0, :]])
    assert sum(len(set(coords[:, k])) > 1 for k in range(3)) == 2, coords


def test_what_mesh_utils_cannot_arrange_keeps_the_order_given_and_says_so(caplog):
  devices = _pod(2, 2, 2, slices=2)
  with caplog.at_level(logging.WARNING):
    arranged = mesh_lib.device_array((1, 1, 2, 8), devices)  # data 1 over 2 slices
  assert [d.id for d in arranged.flat] == [d.id for d in devices]
  assert "not arranged by the ICI topology (mesh.data=1 is not a multiple of the 2 TPU " in (
      caplog.text)


def test_other_platforms_keep_the_order_given():
  devices = jax.devices()[:8][::-1]
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, stage=2, tensor=2), devices)
  assert list(mesh.devices.flat) == devices


def test_generation_instances_on_a_torus_arranged_pod_each_stay_inside_one_host():
  """The training mesh of a multi-host pod is arranged by the torus, which interleaves the hosts
  in its flattened order; the instances of fused generation are taken from that order and must
  each live in one process (instances.instance_groups groups it by process first)."""
  devices = _pod(4, 4, 4)
  assert len({d.process_index for d in devices}) == 16
  arranged = mesh_lib.device_array((4, 1, 4, 4), devices)
  flat = list(arranged.flat)
  for width in (1, 2, 4):
    groups = instances.instance_groups(flat, 64 // width, width)
    assert sorted(d.id for g in groups for d in g) == list(range(64))
    assert all(len({d.process_index for d in g}) == 1 for g in groups), width
  # Taken straight from the flattened order (what the builder did before), most width-4
  # instances would span two hosts.
  straight = [flat[i:i + 4] for i in range(0, 64, 4)]
  assert sum(len({d.process_index for d in g}) > 1 for g in straight) > 8


def test_make_mesh_keeps_the_order_given_unless_asked_to_arrange_by_topology():
  """Callers that build a mesh over groups they chose (an instance; the grid of all instances,
  whose data rows must be the instances) get the devices in their order, also on a TPU."""
  devices = _pod(2, 2, 2)
  kept = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, tensor=4), devices)
  assert [d.id for d in kept.devices.flat] == [d.id for d in devices]
  arranged = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, tensor=4), devices, by_topology=True)
  assert [d.id for d in arranged.devices.flat] == [
      d.id for d in mesh_lib.device_array((2, 1, 1, 4), devices).flat]
  assert [d.id for d in arranged.devices.flat] != [d.id for d in devices]


def _read_through_host(monkeypatch) -> list:
  """(thread, shape) of each multi-device array read into host memory from here on: jax.device_put
  reads the whole array (ArrayImpl._value) when it cannot copy the shards a target layout
  needs device to device, then puts it back piece by piece."""
  from jax._src import array  # pylint: disable=import-outside-toplevel
  read, real = [], array.ArrayImpl._value

  def value(self):
    if self.sharding.num_devices > 1:
      read.append((threading.get_ident(), self.shape))
    return real.fget(self)
  monkeypatch.setattr(array.ArrayImpl, "_value", property(value))
  return read


def test_put_moves_any_layout_to_any_other_device_to_device(monkeypatch):
  """mesh.put between layouts and device sets (a training layout to a generation instance's,
  within one process): the values, the target's placement, and not one multi-device array
  read into host memory. jax.device_put read the whole array into host memory and put it
  back whenever a target shard matched no source shard exactly: a pipelined or fsdp-split
  actor placed onto instances of gen_tp > 1 went device -> host -> device every iteration
  (the first case below is jax.device_put's own, asserted so that the test shows the path
  it replaces)."""
  d = jax.devices()
  mesh = lambda devs, shape, names: jax.sharding.Mesh(np.array(devs).reshape(shape), names)
  P = jax.sharding.PartitionSpec
  named = jax.sharding.NamedSharding
  value = np.arange(8 * 12 * 16, dtype=np.float32).reshape(8, 12, 16)
  sources = [named(mesh(d, (2, 4), ("stage", "data")), P()),
             named(mesh(d, (2, 4), ("stage", "data")), P("stage")),
             named(mesh(d, (2, 4), ("stage", "fsdp")), P(None, "fsdp", "stage")),
             named(mesh(d[::-1], (2, 4), ("a", "b")), P(None, None, "b")),
             named(mesh(d[4:], (4,), ("a",)), P(None, None, "a")),
             named(mesh(d[3:4], (1,), ("a",)), P())]
  targets = [named(mesh(d[2:4], (2,), ("tensor",)), P(None, None, "tensor")),  # an instance
             named(mesh(d[6:], (2,), ("tensor",)), P()),
             named(mesh(d[:4], (4,), ("tensor",)), P("tensor")),
             named(mesh(d, (8,), ("tensor",)), P(None, None, "tensor")),
             named(mesh(d, (4, 2), ("x", "y")), P("y", "x")),
             named(mesh(d[::-1], (4, 2), ("x", "y")), P(None, "x")),
             named(mesh(d[5:6], (1,), ("t",)), P())]
  read = _read_through_host(monkeypatch)
  jax.device_put(jax.device_put(value, sources[0]), targets[0]).block_until_ready()
  assert [shape for _, shape in read] == [value.shape]  # what jax.device_put does
  read.clear()
  for source, target in itertools.product(sources, targets):
    x = jax.device_put(value, source)
    y = mesh_lib.put(x, target)
    assert y.sharding == target and not read, (source, target, read)
    for shard in y.addressable_shards:  # each device holds its own box of the values
      np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


def test_pieces_of_a_subset_of_targets_whose_boxes_even_halves_would_cut():
  """What one process of several asks of mesh._pieces (its own targets only, in
  _put_via_own_devices): rows 2-4 and 4-6 of a 6-row array split 3 ways, from 2 devices that
  hold halves 0-3 and 3-6. The layout it reshards through must not cut a box (halves cut rows
  2-4: no shard held it, an IndexError)."""
  d = jax.devices()
  P, named = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
  value = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
  local = jax.device_put(value, named(jax.sharding.Mesh(np.array(d[:2]), ("a",)), P("a")))
  target = named(jax.sharding.Mesh(np.array(d[2:5]), ("t",)), P("t"))
  mine = dict(list(target.devices_indices_map(value.shape).items())[1:])
  pieces = mesh_lib._pieces(local, mine)  # pylint: disable=protected-access
  assert [p.devices() for p in pieces] == [{dev} for dev in mine]
  for piece, index in zip(pieces, mine.values()):
    np.testing.assert_array_equal(np.asarray(piece), value[index])
