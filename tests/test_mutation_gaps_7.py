"""Cheap tests proposed by a seventh mutation audit (generation/timeline.py,
generation/multihost.py, parallel/distributed.py, parallel/mesh.py, checkpointing.py,
workdir.py): each one fails under a plausible bug that the rest of the fast suite lets through
(the audit report names the mutation each kills)."""
import re
import sys
import time
import types

import jax.numpy as jnp
import numpy as np
import pytest


# generation/timeline.py --------------------------------------------------------------------------

def _wait_for_segments(log, n):
  deadline = time.monotonic() + 10
  while len(log.segments) < n and time.monotonic() < deadline:
    time.sleep(0.001)
  assert len(log.segments) == n


def test_tagged_work_and_notes_are_filed_and_segments_come_back_sorted_by_start():
  """ActivityLog: a record's tag files its segment under that tag (same-host migrations'
  tag_span), an untagged one files nothing, note() files a zero-length moment; close() sorts
  the segments of every instance by start (not by completion); an unknown kind is refused
  rather than recorded where no metric counts it."""
  from rlhfuse_jax.generation.timeline import ActivityLog
  log = ActivityLog(2)
  log.note("asked")
  log.record(0, "migrate", jnp.zeros(2), since=2.0, tag="same_host")
  _wait_for_segments(log, 1)
  log.record(1, "decode", jnp.zeros(2), since=1.0)
  with pytest.raises(ValueError, match="activity kind 'decoding'"):
    log.record(0, "decoding", jnp.zeros(2))
  segments = log.close()
  assert [(i, k) for i, _, _, k in segments] == [(1, "decode"), (0, "migrate")]
  assert sorted(log.tagged) == ["asked", "same_host"]
  (start, end), = log.tagged["same_host"]
  assert start == 2.0 and end >= start and log.tag_span("same_host") == end - start
  (t, t2), = log.tagged["asked"]
  assert t == t2 and 0 <= t < 2.0 and log.tag_span("asked") == 0.0


def test_the_metrics_of_a_timeline_without_time_or_inference_are_zero():
  """Timeline.instance_busy_frac with gen_plus_inf_s == 0 (nothing measured) and
  inference_overlap_frac without inference segments are 0, not a ZeroDivisionError at the end
  of a generation run."""
  from rlhfuse_jax.generation.timeline import Timeline
  empty = Timeline(num_instances=2, segments=[], unfinished_curve=[], consolidations=[],
                   gen_end_s=0.0, gen_plus_inf_s=0.0)
  assert empty.instance_busy_frac == 0.0 and empty.inference_overlap_frac == 0.0
  decode_only = Timeline(num_instances=1, segments=[(0, 0.0, 2.0, "decode")],
                         unfinished_curve=[], consolidations=[], gen_end_s=2.0,
                         gen_plus_inf_s=4.0)
  assert decode_only.inference_overlap_frac == 0.0
  assert decode_only.instance_busy_frac == 0.5


# generation/multihost.py -------------------------------------------------------------------------

def test_one_process_exchanges_its_own_32_bit_values_unchanged():
  """Exchange on one process: allgather gives [1, *shape] of 32-bit data (only wider dtypes are
  refused), broadcast_float its float64 bit for bit (not through float32); on several,
  broadcast_float is process 0's value."""
  from rlhfuse_jax.generation import multihost
  ex = multihost.Exchange(60)
  for dtype in (np.int32, np.float32, np.uint8):
    x = np.arange(6, dtype=dtype).reshape(2, 3)
    got = ex.allgather(x, "rows")
    assert got.shape == (1, 2, 3) and got.dtype == dtype
    np.testing.assert_array_equal(got[0], x)
  assert ex.broadcast_float(0.1) == 0.1 and ex.broadcast_float(1 / 3) == 1 / 3
  # As process 1 of 2 (the gather faked): process 0's value, whatever this one holds.
  ex.count, ex.me = 2, 1
  words = lambda v: np.frombuffer(np.float64(v).tobytes(), np.int32)
  ex.allgather = lambda x, what="": np.stack([words(1 / 3), x])
  assert ex.broadcast_float(0.7) == 1 / 3


def test_a_cross_host_transfer_moves_row_0_of_the_pair_to_row_1():
  """CrossHostTransfer's program (one process here, 4 of its devices as a (2, 2) pair mesh):
  the target row of devices receives the source row's shards in device order, the source row
  ends with zeros; the target's zero input of each leaf has that leaf's dtype (leaves of one
  shape and different dtypes, tokens and log-probs, share no buffer)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from rlhfuse_jax.generation import multihost
  devices = jax.devices()[:4]
  t = multihost.CrossHostTransfer()
  mesh = t._mesh(devices[:2], devices[2:])
  x = jax.device_put(jnp.arange(16, dtype=jnp.int32).reshape(8, 2),
                     NamedSharding(mesh, P(("pair", "shard"))))
  out = np.asarray(multihost._permute(mesh)(x))
  np.testing.assert_array_equal(out[:4], 0)
  np.testing.assert_array_equal(out[4:], np.arange(8).reshape(4, 2))
  ints, floats = (t._zero(devices[2], (2, 3), d) for d in (np.int32, np.float32))
  assert (ints.dtype, floats.dtype) == (jnp.int32, jnp.float32)
  assert not np.asarray(floats).any() and ints.devices() == {devices[2]}


def test_a_collective_that_never_completes_ends_the_process_with_69(monkeypatch, capfd):
  """Exchange.guard's watchdog: a collective still running after timeout_s ends the process
  with EXIT_PEER_LOST (69, what a requeue rule tells apart from a crash), the reason on
  stderr."""
  from rlhfuse_jax.generation import multihost
  codes = []
  monkeypatch.setattr(multihost.os, "_exit", codes.append)  # the watchdog thread returns
  ex = multihost.Exchange(timeout_s=0.05)
  ex.count = 2
  with ex.guard("the finished rows"):
    deadline = time.monotonic() + 5
    while not codes and time.monotonic() < deadline:
      time.sleep(0.01)
  assert codes == [multihost.EXIT_PEER_LOST] == [69]
  assert re.search(r"exchanging the finished rows did not complete within 0\.05s: another "
                   r"process died.*; exiting \(69\)", capfd.readouterr().err)


# parallel/distributed.py -------------------------------------------------------------------------

def test_one_process_runs_main_process_work_and_raises_its_own_errors():
  """run_on_main_process on one process runs fn and returns its result; fn's own exception is
  raised (not the others' generic `failure`); main_process_verdict is the process's own `ok`;
  check_same_over_processes raises this process's reading error rather than going on."""
  from rlhfuse_jax.parallel import distributed
  assert distributed.run_on_main_process(lambda: 7, "lost") == 7

  def fails():
    raise KeyError("the lock")
  with pytest.raises(KeyError, match="the lock"):
    distributed.run_on_main_process(fails, "process 0 failed")
  assert distributed.main_process_verdict(False) is False
  assert distributed.main_process_verdict(True) is True
  distributed.check_same_over_processes((1, 2), "the checkpoint")
  with pytest.raises(OSError, match="unreadable"):
    distributed.check_same_over_processes((-1,), "the checkpoint", failed=OSError("unreadable"))


def test_several_processes_compare_every_value_and_take_the_largest(monkeypatch):
  """check_same_over_processes on 2 processes (the all-gather faked: the other process's values
  given): one differing value of several is a disagreement naming both processes' values; a
  process's own reading error is raised after the gather even when the values agree;
  max_over_processes is the largest value of any process; of 4, only process 0 is main."""
  import jax
  from jax.experimental import multihost_utils
  from rlhfuse_jax.parallel import distributed
  other = {}
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: np.stack([np.asarray(x), np.asarray(other["v"], np.int32)]))
  other["v"] = (3, 4)
  distributed.check_same_over_processes((3, 4), "the checkpoint")
  other["v"] = (3, 5)
  with pytest.raises(ValueError, match=r"disagree on the checkpoint \(process 0: \(3, 4\); "
                                       r"process 1: \(3, 5\)\)"):
    distributed.check_same_over_processes((3, 4), "the checkpoint")
  other["v"] = (3, 4)
  with pytest.raises(OSError, match="unreadable"):
    distributed.check_same_over_processes((3, 4), "the checkpoint", failed=OSError("unreadable"))
  other["v"] = 5
  assert distributed.max_over_processes(2) == 5
  other["v"] = 1
  assert distributed.max_over_processes(2) == 2
  monkeypatch.setattr(jax, "process_count", lambda: 4)
  for index in (1, 2, 3):  # only process 0 writes the run's files
    monkeypatch.setattr(jax, "process_index", lambda index=index: index)
    assert not distributed.is_main_process()


def test_sigterm_goes_back_to_pythons_handler_and_only_from_the_main_thread():
  """reclaim_sigterm re-installs the Python handler signal.getsignal names (not the default
  action, which would end the run without the trainer's save); on another thread it does
  nothing (Python refuses signal handlers there)."""
  import signal
  import threading
  from rlhfuse_jax.parallel import distributed
  handler = lambda signum, frame: None
  previous = signal.signal(signal.SIGTERM, handler)
  try:
    distributed.reclaim_sigterm()
    assert signal.getsignal(signal.SIGTERM) is handler
    errors = []

    def on_thread():
      try:
        distributed.reclaim_sigterm()
      except Exception as e:  # noqa: BLE001 recorded for the assertion
        errors.append(e)
    thread = threading.Thread(target=on_thread)
    thread.start()
    thread.join()
    assert errors == []
  finally:
    signal.signal(signal.SIGTERM, previous)


def test_initialize_passes_the_heartbeat_and_names_bad_counts_and_jaxs_own_errors(monkeypatch):
  """initialize: the heartbeat timeout reaches jax; a negative count or process id is refused by
  name; with every flag given, jax's ValueError (a bad address) and a runtime error other than
  a port in use come through as they are, not reworded as "no cluster" or "port in use"."""
  import jax
  from rlhfuse_jax.parallel import distributed
  calls = []
  monkeypatch.setattr(jax.config, "update", lambda *a: None)  # no gloo for the test process
  monkeypatch.setattr(distributed, "reclaim_sigterm", lambda: None)
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  distributed.initialize("127.0.0.1:1234", 2, 1, heartbeat_timeout_s=30)
  assert calls == [{"coordinator_address": "127.0.0.1:1234", "num_processes": 2,
                    "process_id": 1, "heartbeat_timeout_seconds": 30}]
  with pytest.raises(ValueError, match=r"num_processes=-1: expected >= 1"):
    distributed.initialize("127.0.0.1:1234", -1, 0)
  with pytest.raises(ValueError, match=r"process_id=-1: expected an integer in \[0, 2\)"):
    distributed.initialize("127.0.0.1:1234", 2, -1)
  assert len(calls) == 1
  for error in (ValueError("invalid address 'x'"), jax.errors.JaxRuntimeError("INTERNAL: x")):
    def fail(error=error, **kw):
      raise error
    monkeypatch.setattr(jax.distributed, "initialize", fail)
    with pytest.raises(type(error)) as raised:
      distributed.initialize("127.0.0.1:1234", 2, 0)
    assert raised.value is error


# parallel/mesh.py --------------------------------------------------------------------------------

def test_a_mesh_config_that_does_not_factor_is_refused_by_name():
  """MeshConfig: two -1 axes, a zero axis, fixed axes that do not divide the devices or (no -1)
  do not multiply to them are each refused with what to change, not built into a mesh of
  another size."""
  from rlhfuse_jax.parallel.mesh import MeshConfig
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    MeshConfig(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match=r"mesh\.tensor=0; expected a positive size or -1"):
    MeshConfig(tensor=0)
  with pytest.raises(ValueError, match=r"the fixed axes take 3 devices, which does not divide 8"):
    MeshConfig(data=-1, tensor=3).resolve(8)
  with pytest.raises(ValueError, match=r"multiply to 4 devices but 8 are available"):
    MeshConfig(data=2, tensor=2).resolve(8)
  assert MeshConfig(data=2, fsdp=-1).resolve(8) == {"data": 2, "fsdp": 4, "stage": 1,
                                                     "tensor": 1}


def test_missing_bytes_counts_only_what_a_device_does_not_already_hold():
  """mesh.missing_bytes: per device, the bytes of its shard less the overlap with what it holds
  (a disjoint box overlaps nothing, not a negative amount); _box / _inside compare shards'
  boxes."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from rlhfuse_jax.parallel import mesh as mesh_lib
  devices = jax.devices()[:4]
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4), devices)
  dst = jax.device_put(jnp.zeros((8, 4), jnp.float32), NamedSharding(mesh, P("data")))
  whole = slice(None)
  held = {devices[0]: (slice(0, 2), whole),  # its own rows 0-1
          devices[1]: (slice(0, 3), whole),  # row 2 of its rows 2-3
          devices[3]: (slice(0, 2), whole)}  # none of its rows 6-7
  got = mesh_lib.missing_bytes(dst, held.get)
  assert got == {devices[0]: 0, devices[1]: 16, devices[2]: 32, devices[3]: 32}
  # _box / _inside (the puts' pieces): a box lies in another only if it does on every axis.
  box = mesh_lib._box((whole, slice(0, 2)), (8, 4))
  assert box == ((0, 8), (0, 2))
  assert mesh_lib._inside(box, mesh_lib._box((whole, whole), (8, 4)))
  assert not mesh_lib._inside(box, mesh_lib._box((slice(0, 4), whole), (8, 4)))


def test_an_unknown_logical_axis_is_refused_and_zero1_keeps_the_memory_kind():
  """param_shardings: a logical axis without a rule (a typo in a model's specs) is a KeyError
  naming it, not a silently replicated parameter; zero1_sharding keeps the parameter's memory
  kind (an offloaded state stays in host memory)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from rlhfuse_jax.parallel import mesh as mesh_lib
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2), jax.devices()[:2])
  with pytest.raises(KeyError, match="logical axis 'embedding' of \\['w'\\] has no rule"):
    mesh_lib.param_shardings({"w": np.zeros((4, 4))}, {"w": P("embedding", None)}, mesh)
  pinned = NamedSharding(mesh, P(), memory_kind=mesh_lib.HOST_MEMORY)
  split = mesh_lib.zero1_sharding(pinned, (6, 4))
  assert split.spec == P("data", None) and split.memory_kind == mesh_lib.HOST_MEMORY


# checkpointing.py --------------------------------------------------------------------------------

def test_checksums_see_a_sign_flip_anywhere_and_two_elements_swapped():
  """checkpointing.checksums: a flipped sign bit (bit 31: a negated weight) of any element,
  the first included, changes the sum (an even position weight would cancel it mod 2**32),
  and so does swapping elements [0, 1] and [1, 0] (positions weighted in row-major order, not
  by the sum of their coordinates)."""
  from rlhfuse_jax import checkpointing
  w = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
  base = checkpointing.checksums({"w": w})["w"]
  for i in range(w.size):
    negated = w.copy()
    negated.flat[i] = -negated.flat[i]
    assert checkpointing.checksums({"w": negated})["w"] != base, i
  swapped = w.copy()
  swapped[0, 1], swapped[1, 0] = w[1, 0], w[0, 1]
  assert checkpointing.checksums({"w": swapped})["w"] != base


def test_a_failed_save_is_a_save_error_naming_the_directory(tmp_path, monkeypatch):
  """Checkpointer.wait turns whatever the write raised into SaveError (train_ppo stops on it
  at once instead of waiting for orbax's threads), naming the directory and the cause."""
  from rlhfuse_jax import checkpointing
  ck = checkpointing.Checkpointer(str(tmp_path))

  def full(*a, **kw):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(ck._mngr, "wait_until_finished", full)
  with pytest.raises(checkpointing.SaveError, match=r"checkpoints failed: OSError: .*No space"):
    ck.wait()
  monkeypatch.undo()
  ck.close()


def test_a_checkpoint_with_an_array_this_run_lacks_is_another_layout(tmp_path):
  """Checkpointer.layout_mismatch names an array the checkpoint holds and this run's state
  does not (a run without a critic resuming one with it), rather than finding no difference."""
  from rlhfuse_jax import checkpointing
  ck = checkpointing.Checkpointer(str(tmp_path))
  try:
    ck.save(1, {"actor": jnp.ones((2,)), "critic": jnp.ones((3,))}, {})
    ck.wait()
    got = ck.layout_mismatch(1, {"actor": jnp.ones((2,))})
  finally:
    ck.close()
  assert got == ("1 array(s) differ from this run's state, e.g. critic: stored ((3,), "
                 "'float32'), this run absent")


# workdir.py --------------------------------------------------------------------------------------

def test_a_torn_result_names_no_writer_and_a_lock_knows_when_it_was_replaced(tmp_path,
                                                                            monkeypatch):
  """workdir_writer of a torn result.json (a run killed while writing it) is None, not a
  JSONDecodeError; a binary's own earlier result is not foreign to it; a fresh start sets aside
  config*.json, not a user's other config* file; `python -m experiments.NAME` is NAME;
  WorkdirLock.held is False once .lock is deleted or replaced, and True for a run that could
  not lock at all (a filesystem without flock: nothing to lose)."""
  import errno
  import fcntl
  import os
  from rlhfuse_jax import workdir as wd
  (tmp_path / "result.json").write_text('{"provenance": {"command": "python -m experi')
  assert wd.workdir_writer(str(tmp_path)) is None
  own = tmp_path / "own"
  wd.write_json(str(own / "result.json"),
                {"provenance": {"command": "python -m experiments.bench_decode --x=1"}})
  wd.refuse_foreign_result(str(own), "bench_decode")  # its own earlier result: not refused
  with pytest.raises(wd.ForeignWorkdirError, match="outputs of experiments.bench_decode"):
    wd.refuse_foreign_result(str(own), "train_ppo")
  (own / "config_notes.txt").write_text("a user's")
  (own / "config.json").write_text("{}")
  moved = wd.set_aside_earlier_start(str(own))
  assert sorted(os.listdir(moved)) == ["config.json", "result.json"]
  assert (own / "config_notes.txt").exists()
  monkeypatch.setattr(sys.modules["__main__"], "__spec__",
                      types.SimpleNamespace(name="experiments.bench_decode"), raising=False)
  assert wd._running_binary() == "bench_decode"  # what start_outputs refuses others' results by
  lock = wd.WorkdirLock(str(tmp_path / "a"))
  assert lock.held()
  os.replace(tmp_path / "result.json", tmp_path / "a" / ".lock")
  assert not lock.held()
  os.remove(tmp_path / "a" / ".lock")
  assert not lock.held()
  lock.release()

  def no_flock(f, op):
    raise OSError(errno.ENOLCK, "No locks available")
  monkeypatch.setattr(fcntl, "flock", no_flock)
  unlocked = wd.WorkdirLock(str(tmp_path / "b"))
  assert unlocked.held()
