"""Inter-stage fusion over several processes (docs/architecture.md §2, "Several processes").

Each process drives the generation instances on its own devices; every decision of a batch (the
deal, the rounds, the consolidation plan, which freed instance scores which samples) is computed
by every process from the same global state, so no process ever waits for a plan it cannot
compute. What makes the state global is `Exchange`: after every decode round the processes
all-gather their instances' summaries (done, generated, stop: 12 bytes per slot), then the
tokens and log-probs of the rows that just finished, and at the end the inference results and
each process's figures of its own instances (fused.figures_over_processes).

Where the exchanges run (`exchange_on`): jax's process_allgather runs a program on every device
of every process, and an accelerator runs its programs in launch order, so each exchange would
wait for whatever is queued on any device: the scoring that freed instances run beside the
tail (the overlap inter-stage fusion is for) or, with asynchronous PPO, the whole update on the
training devices. "host" (the default) gathers over a mesh of one CPU device per process
instead (jax's CPU backend spans the processes once jax.distributed is initialised, with gloo
collectives), which no accelerator work delays; where it does not span them (a CPU backend
left out by JAX_PLATFORMS), or on CPU-only runs, the first device of each process. "devices"
is jax's process_allgather over every device. (Argued from jax's source and the GPU/TPU
runtimes' per-device ordering; on CPU devices, executions are not ordered per device, so the
tests cannot tell the two apart. Not yet measured on several GPU hosts.)

Cross-host KV migration (`CrossHostTransfer`): a jitted `shard_map` over a (2, tp) mesh of the
source instance's devices and the target's, whose body is one `lax.ppermute` from row 0 to row
1. Both processes run it; the source supplies its device shards of the gathered rows, the target
a zero buffer of the same shape, and the target's shards of the output become its rows,
already laid out as its scatter expects (same shape class, same mesh shape, so device k of the
source holds the piece device k of the target needs). No recompute, no host round trip.
Chosen by measurement over jax.experimental.transfer (a transfer server per process, the
target pulls): on 2 processes x 4 CPU devices (jax 0.10.2, gloo) the ppermute moved 12 kB /
192 kB / 4 MB in a median 0.1 / 2-4 / 6 ms after its compile, while a pull from the transfer
server never completed (killed after 90 s; the servers started and connected). The collective
also runs over the channel jax.distributed already set up (gloo on CPU, NCCL on GPU, ICI/DCN on
TPU) and needs no per-process address exchange; the transfer API is experimental and its
signature has changed between releases.

A process that dies or hangs must not leave the others waiting forever: every collective of the
loop runs under `Exchange.guard`, which turns a failed collective (gloo reports a closed
connection at once) into a `PeerLostError` naming what was being exchanged, and whose watchdog
ends this process with that message (exit code EXIT_PEER_LOST) when a collective has not
finished within `timeout_s` (a peer that hangs, or dies without closing its connections).

With one process every function here is the identity (no collective, no jax.experimental import).
"""
from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging as py_logging
import os
import sys
import threading
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

EXCHANGE_ON = ("host", "devices")
_WARM_UPS = [0]  # Exchange.warm_up calls in this process: each barrier's id (the same order
#                  on every process, as every process builds its generators alike)

# Exit code of a process whose collective timed out (Exchange.guard): EX_UNAVAILABLE, not
# train_ppo's 75 (stopped by a signal after saving), so a requeue script can tell them apart.
EXIT_PEER_LOST = 69


def exit_now(message: str, stacks: bool = False) -> None:
  """Ends this process at once with EXIT_PEER_LOST, from a watchdog thread: `message` (which
  ends "exiting (69)", what the local launcher looks for) as an absl error line and, with
  `stacks`, every thread's stack, written straight to file descriptor 2, not through logging or
  sys.stderr, whose locks the stuck main thread may hold (a write to a pipe nobody reads); then
  os._exit, since a thread blocked in a collective or a C call cannot be interrupted."""
  record = logging.get_absl_logger().makeRecord("absl", py_logging.ERROR, __file__, 0, message,
                                                (), None)
  os.write(2, (logging.PythonFormatter().format(record) + "\n").encode())
  if stacks:
    faulthandler.dump_traceback(file=2, all_threads=True)
  os._exit(EXIT_PEER_LOST)


class PeerLostError(RuntimeError):
  """A collective of the fused loop failed: another process died or left."""


# What the collectives' transport says when a peer process is gone (gloo over TCP; jax's
# coordination service). jax 0.10 raises a gloo failure inside a jitted call as a ValueError
# ("UNKNOWN: Gloo AllGather failed ... Connection reset by peer"), elsewhere as JaxRuntimeError:
# either way an XLA status ("UNKNOWN: ") leads the text, which no error of ours has.
_RUNTIME_STATUSES = ("UNKNOWN: ", "UNAVAILABLE: ", "INTERNAL: ", "ABORTED: ", "CANCELLED: ",
                     "DEADLINE_EXCEEDED: ", "FAILED_PRECONDITION: ")
_TRANSPORT_FAILURES = ("Gloo", "Connection reset by peer", "Connection closed by peer",
                       "Broken pipe", "heartbeat")


def exit_if_peer_lost(e: BaseException) -> None:
  """Ends this process with EXIT_PEER_LOST, at once, when `e` (raised out of a multi-process
  run's training or generation) is a collective's report of a peer that died or left
  (transport_failure): it waited for jax's coordination service to notice the dead peer
  (~100 s) and ended with 134, which the launcher then blamed on this process. Returns
  otherwise (one process, or another error: the caller raises it)."""
  if jax.process_count() == 1 or not transport_failure(e):
    return
  msg = (f"process {jax.process_index()} of {jax.process_count()}: a collective failed because "
         f"another process died or left the run (see the other processes' logs): "
         f"{type(e).__name__}: {str(e)[:500]}; exiting ({EXIT_PEER_LOST})")
  logging.error("%s", msg)
  logging.flush()
  print(msg, file=sys.stderr, flush=True)
  os._exit(EXIT_PEER_LOST)


def transport_failure(e: BaseException) -> bool:
  """Whether `e`, raised by a cross-process collective, is its transport's report of a peer that
  died or left: a runtime status naming the transport. Not this process's own error (an
  out-of-memory, a shape or compile error), nor one of ours that quotes such words (a reward
  function's error holds the model's response): blamed on a peer, it became exit 69, which a
  requeue rule retries for ever."""
  text = str(e)
  return (isinstance(e, (jax.errors.JaxRuntimeError, ValueError, OSError)) and
          not getattr(e, "names_function", False) and text.startswith(_RUNTIME_STATUSES) and
          any(t in text for t in _TRANSPORT_FAILURES))


def process_of(devices: Sequence[jax.Device], what: str,
               width_field: str = "config.fusion.instance_devices") -> int:
  """The one process that owns `devices`; a clear error, naming the config field that sets an
  instance's width, when they span several."""
  procs = sorted({d.process_index for d in devices})
  if len(procs) != 1:
    raise ValueError(f"{what} spans processes {procs} (devices "
                     f"{[d.id for d in devices]}): an instance must live in one process; "
                     f"choose {width_field} dividing each process's device count")
  return procs[0]


class Exchange:
  """The host-side all-gathers of the fused loop. Every process must call each method in the
  same order with arrays of the same shape (the shapes derive from global state only)."""

  def __init__(self, timeout_s: float = 600.0, on: str = "host"):
    if on not in EXCHANGE_ON:
      raise ValueError(f"exchange_on={on!r}: expected one of {EXCHANGE_ON}")
    self.count = jax.process_count()
    self.me = jax.process_index()
    self.timeout_s = timeout_s
    self.on = on
    self._gather = None  # (the host mesh's local device, jitted gather), built at first use

  def host_devices(self) -> list:
    """One device per process, in process order, for the "host" exchanges (module docstring):
    the lowest-numbered CPU device of each process where the CPU backend spans them all, else
    the lowest-numbered device of each process."""
    try:
      cpus = jax.devices("cpu")
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu)
      cpus = []
    pool = cpus if {d.process_index for d in cpus} == set(range(self.count)) else jax.devices()
    first: dict = {}
    for d in sorted(pool, key=lambda d: d.id):
      first.setdefault(d.process_index, d)
    return [first[p] for p in range(self.count)]

  def _host_allgather(self, x: np.ndarray) -> np.ndarray:
    if self._gather is None:
      devices = self.host_devices()
      mesh = Mesh(np.array(devices, dtype=object), ("process",))
      self._gather = (devices[self.me], NamedSharding(mesh, P("process")),
                      jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P())))
    local, sharding, gather = self._gather
    piece = jax.device_put(x[None], local)
    glob = jax.make_array_from_single_device_arrays((self.count,) + x.shape, sharding, [piece])
    return np.asarray(gather(glob).addressable_data(0))

  def warm_up(self) -> None:
    """Lines the processes up, then runs the first exchange (at start-up, after each
    process's own compiles). A collective's first use on a device set opens a gloo context,
    whose rendezvous gives up after about 30 s whatever timeout_s says: a process that
    compiled longer would have failed the others' first round as a lost peer (exit 69). The
    wait here is a coordination-service barrier bounded by timeout_s. With every process
    there, a failed first exchange is the transport's (gloo's TCP between the hosts), not a
    lost peer's: a RuntimeError naming exchange_on, not exit 69 for a requeue to retry."""
    if self.count == 1:
      return
    from jax._src import distributed as jax_distributed  # the coordination service's client
    _WARM_UPS[0] += 1
    with self.guard("the start of fused generation (every process's set-up)"):
      jax_distributed.global_state.client.wait_at_barrier(f"rlhfuse_exchange_{_WARM_UPS[0]}",
                                                          int(self.timeout_s * 1000))
    try:
      self.allgather(np.zeros(1, np.int32), "a first exchange")
    except PeerLostError as e:
      how = ("one CPU device per process (gloo over TCP between the hosts; "
             "--config.fusion.exchange_on=devices uses the accelerators' collectives)"
             if self.on == "host" else "every device of every process")
      raise RuntimeError(f"fused generation, process {self.me} of {self.count}: every process "
                         f"reached the start, but the first exchange over {how} failed: "
                         f"{e.__cause__}") from e

  def _message(self, what: str, within: str = "") -> str:
    return (f"fused generation, process {self.me} of {self.count}: the collective exchanging "
            f"{what} did not complete{within}: another process died, hung or left the run (see "
            "the other processes' logs)")

  @contextlib.contextmanager
  def guard(self, what: str):
    """Runs a collective (module docstring): a failure raises PeerLostError; no completion
    within timeout_s logs the error and ends this process (it cannot be interrupted)."""
    if self.count == 1:
      yield
      return

    def expire():
      exit_now(f"{self._message(what, f' within {self.timeout_s:g}s')}; exiting "
               f"({EXIT_PEER_LOST})")
    timer = threading.Timer(self.timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
      yield
    except (jax.errors.JaxRuntimeError, OSError, ValueError) as e:
      # The runtime's error (gloo: connection closed or reset by the peer; from a jitted call a
      # ValueError: transport_failure). Not one that names this process's own cause (an
      # out-of-memory here), nor any other exception (a compile or a shape error of the block):
      # blamed on another process, it became exit 69, which a scheduler's requeue rule would
      # retry for ever. (A ValueError not from the transport went on as this process's error,
      # and the process waited for the coordination service's heartbeat timeout, ~100 s, to
      # end with 134.)
      own = str(e).startswith("RESOURCE_EXHAUSTED") or (
          isinstance(e, ValueError) and not transport_failure(e))
      if own:
        raise
      raise PeerLostError(f"{self._message(what)}: {type(e).__name__}: {e}") from e
    finally:
      timer.cancel()

  @property
  def multi(self) -> bool:
    return self.count > 1

  def allgather(self, x: np.ndarray, what: str = "host data") -> np.ndarray:
    """[P, *x.shape]: every process's `x` (P = process count), on every process. At most 32
    bits per element: jax would narrow a 64-bit dtype without a word (x64 is off)."""
    x = np.asarray(x)
    if x.dtype.itemsize > 4:
      raise ValueError(f"Exchange.allgather of {what}: dtype {x.dtype} would be narrowed to 32 "
                       "bits; send it as 32-bit words (as allgather_float64 does)")
    if self.count == 1:
      return x[None]
    with self.guard(what):
      if self.on == "host":
        return self._host_allgather(x)
      from jax.experimental import multihost_utils  # multi-host only
      return np.asarray(multihost_utils.process_allgather(x, tiled=False))

  def broadcast_float(self, x: float) -> float:
    """Process 0's `x` on every process, bit for bit (sent as its float64 bytes: a float
    through jax would round to float32, and processes must compare against the same Rt)."""
    if self.count == 1:
      return float(x)
    return float(self.allgather_float64(np.float64([x]), "process 0's Rt")[0, 0])

  def allgather_float64(self, x: np.ndarray, what: str = "host data") -> np.ndarray:
    """[P, n]: every process's float64 vector `x` [n], bit for bit (sent as 32-bit words of its
    bytes: through float32 a byte count above 2**24 would round)."""
    x = np.ascontiguousarray(x, np.float64).reshape(-1)  # [n]
    words = np.frombuffer(x.tobytes(), np.int32)  # [2n]
    got = np.ascontiguousarray(self.allgather(words, what), np.int32)  # [P, 2n]
    return np.frombuffer(got.tobytes(), np.float64).reshape(got.shape[0], x.size)

  def by_owner(self, local: np.ndarray, owner: np.ndarray, what: str = "host data"
               ) -> np.ndarray:
    """Rows of `local` [N, ...] combined over processes: row n from process owner[n] [N]
    (each process fills the rows it owns; the others' values are ignored)."""
    if self.count == 1:
      return local
    g = self.allgather(local, what)  # [P, N, ...]
    return g[np.asarray(owner), np.arange(local.shape[0])]


def pad_rows(n: int) -> int:
  """Row counts of the finished-rows exchange rounded up to a power of two, so the all-gather
  compiles a handful of shapes, not one per count."""
  return 1 << max(0, int(n) - 1).bit_length()


def _permute(mesh: Mesh):
  spec = P(("pair", "shard"))
  body = functools.partial(jax.lax.ppermute, axis_name="pair", perm=[(0, 1)])
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


class CrossHostTransfer:
  """Moves gathered DecodeState rows from an instance of one process to an instance of another
  (module docstring). One program per (source, target) pair and row bucket, compiled at its
  first use (a consolidation happens once or twice per batch; the G^2 pairs are too many to
  compile ahead of time) and timed apart: `compile_s` sums those compiles."""

  def __init__(self):
    self._meshes: dict = {}
    self._exe: dict = {}
    self._zeros: dict = {}
    self.compile_s = 0.0

  def _mesh(self, src_devices, dst_devices) -> Mesh:
    return Mesh(np.array([list(src_devices), list(dst_devices)], dtype=object), ("pair", "shard"))

  def __call__(self, src_devices: Sequence[jax.Device], dst_devices: Sequence[jax.Device],
               rows_abstract: Any, rows: Any = None) -> Any:
    """Run by both processes; returns when the collective has completed. rows_abstract: the
    rows' ShapeDtypeStructs with the local instance's shardings (source or target: same shape
    class); rows: the gathered rows on the source process, None on the target. Returns the
    rows on the target's devices (the target process), None on the source process."""
    key = (tuple(d.id for d in src_devices), tuple(d.id for d in dst_devices))
    if key not in self._meshes:
      self._meshes[key] = self._mesh(src_devices, dst_devices)
    mesh = self._meshes[key]
    pair_sh = NamedSharding(mesh, P(("pair", "shard")))
    sending = rows is not None
    leaves, treedef = jax.tree_util.tree_flatten(rows_abstract)
    data = jax.tree_util.tree_leaves(rows) if sending else None
    inputs = []
    for n, a in enumerate(leaves):
      shard = a.sharding.shard_shape(a.shape)
      if not shard:
        raise ValueError(f"cross-host transfer of a 0-d leaf {a}: rows must have a row axis")
      glob = (2 * len(src_devices) * shard[0],) + tuple(shard[1:])
      if sending:
        by_dev = {s.device: s.data for s in data[n].addressable_shards}
        pieces = [by_dev[d] for d in src_devices]
      else:
        pieces = [self._zero(d, shard, a.dtype) for d in dst_devices]
      inputs.append(jax.make_array_from_single_device_arrays(glob, pair_sh, pieces))
    exe_key = (key, tuple((x.shape, x.dtype.name) for x in inputs))
    if exe_key not in self._exe:
      t0 = time.perf_counter()
      self._exe[exe_key] = _permute(mesh).lower(inputs).compile()
      self.compile_s += time.perf_counter() - t0
    out = self._exe[exe_key](inputs)
    jax.block_until_ready(out)  # waited for: it is the migration's time; a lost peer shows here
    if sending:
      return None
    result = []
    for a, o in zip(leaves, out):
      by_dev = {s.device: s.data for s in o.addressable_shards}
      result.append(jax.make_array_from_single_device_arrays(
          a.shape, a.sharding, [by_dev[d] for d in dst_devices]))
    return jax.tree_util.tree_unflatten(treedef, result)

  def _zero(self, device, shape, dtype):
    """The target's (never donated, so reusable) zero input of one leaf."""
    k = (device.id, tuple(shape), jnp.dtype(dtype).name)
    if k not in self._zeros:
      self._zeros[k] = jax.device_put(np.zeros(shape, dtype), device)
    return self._zeros[k]
