"""Atomic, resumable checkpoints of a training run (orbax-checkpoint).

A checkpoint holds the array state (actor/critic params and optimizer states, anything the caller
puts in the pytree) and a small JSON side-car (iteration, data position, RNG seed, config
fingerprint). Orbax writes each step into a temporary directory and renames it when complete, so a
run killed mid-save keeps its previous checkpoint; `latest_step()` only sees finished ones.

The side-car also holds a checksum of every array (`checksums`), checked after a restore: orbax's
chunks have no checksum of their own, so a file damaged inside a compressed chunk could restore
as other numbers without an error (a review's bit flips did: the run then failed on NaNs one
update later and advised lowering the learning rate). And a digest of itself (`meta_checksum`),
checked whenever it is read: a flipped bit in one of its numbers still parses.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging as py_logging
import os
import shlex
import shutil
import sys
import tempfile
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging


def _layout(leaves) -> dict:
  """{path: (shape, dtype)} of flattened leaves; paths as plain names (keystr simple), so
  orbax's metadata tree (dicts and lists) and the live state (dataclasses, namedtuples)
  compare."""
  return {jax.tree_util.keystr(path, simple=True, separator="/"):
          (tuple(x.shape), str(np.dtype(x.dtype))) for path, x in leaves}


@jax.jit
def _bit_sum(x: jax.Array) -> jax.Array:
  """sum_i bits_i * (2 i + 1) mod 2**32 (uint32), bits_i the i-th element's bit pattern as an
  unsigned integer (i in row-major order). The odd weight of each position keeps every single
  flipped bit visible and makes flips that cancel in a plain sum (+2**k here, -2**k there)
  count differently."""
  if x.dtype == jnp.bool_:  # (bitcast refuses bool)
    bits = x.astype(jnp.uint32)
  else:
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    bits = bits.astype(jnp.uint32)
  # The row-major index from one iota per axis, in x's own shape: partitioned like x (a flat
  # iota reshaped could be built whole on every device).
  index, stride = jnp.zeros(x.shape, jnp.uint32), 1
  for axis in reversed(range(x.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(
        stride % 2**32)
    stride *= x.shape[axis]
  return jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32)


def _bit_sum_host(x: jax.Array) -> int:
  """_bit_sum in numpy, of an array this process holds whole: the same uint32 arithmetic (the
  products and the sum wrap mod 2**32 alike), so the same checksum."""
  if x.size >= 2**32:  # (its index would wrap: the device program's uint32 arithmetic)
    return int(np.asarray(_bit_sum(x).addressable_data(0)))
  x = np.asarray(x)
  if x.dtype == np.bool_:
    bits = x.astype(np.uint32)
  else:
    bits = x.view(np.dtype(f"uint{8 * x.dtype.itemsize}")).astype(np.uint32)
  index = np.arange(x.size, dtype=np.uint32).reshape(x.shape)  # row-major, as _bit_sum's
  return int(np.sum(bits * (np.uint32(2) * index + np.uint32(1)), dtype=np.uint32))


def checksums(state: Any) -> dict[str, int]:
  """{array path: checksum} of a state pytree: each element's bits, weighted by position,
  summed mod 2**32 (_bit_sum), one reduction per array on its own devices. Integer addition
  mod 2**32 does not depend on the order, so the sum is the same however the array is sharded
  (a restore onto other devices checks as well), and any one flipped bit changes it (of the
  array as jax holds it: 32 bits wide at most, with 64-bit types off). Every process of a
  multi-host run must call it (one collective program per array, in the same order)."""
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  # One program per array, not one for the state: XLA on CPU materialises each weighted array
  # before reducing it, which over the whole state at once doubled its memory (compiled on 8
  # fake devices); one at a time it is at most the largest array's shard. Each read before the
  # next starts: on CPU, reductions of arrays on overlapping device groups (a pipelined state's
  # stages) dispatched together deadlocked in their all-reduce rendezvous (XLA aborted).
  keys = [jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in flat]
  if jax.default_backend() == "cpu" and jax.process_count() == 1:
    # One process on the CPU: the same sums in numpy, on the arrays' host views. The device
    # programs were one per distinct shape and sharding (10 for the tiny run's state), each
    # traced, lowered and loaded from the compilation cache at every save and restore.
    return {k: _bit_sum_host(jnp.asarray(x)) for k, (_, x) in zip(keys, flat)}
  if jax.default_backend() == "cpu":
    return {k: int(np.asarray(_bit_sum(jnp.asarray(x)).addressable_data(0)))
            for k, (_, x) in zip(keys, flat)}
  # Elsewhere all dispatched, then read at once: one host round trip, not one per array (a
  # 65B actor and critic hold thousands). (XLA fuses the weighting into the reduction there.)
  sums = [_bit_sum(jnp.asarray(x)) for _, x in flat]
  return {k: int(v) for k, v in zip(keys, jax.device_get([s.addressable_data(0) for s in sums]))}


# What orbax appends to an array read's error: the array's TensorStore spec, a multi-line repr
# whose first line reads "<bound method ...spec of TensorStore({" (cut off there); and what
# TensorStore appends to an error opening an array (a checkpoint missing its manifest.ocdbt):
# its spec as escaped JSON, which filled the 300 characters twice, once per error of the chain.
_TENSORSTORE_DETAILS = (". See full TensorStore details", " [tensorstore_spec")


def error_line(e: BaseException) -> str:
  """`Type: first line` of an error reading a checkpoint, at most 300 characters of the line
  (orbax's run to dozens of lines): what the refusals of a checkpoint that cannot be read show.
  With the error it was raised from (`raise ... from`), that one's line too: orbax's array read
  says only "Encountered error while reading array index: (...)", and the TensorStore error
  beneath names the array and the file ("Error reading "w/0" in OCDBT database at local file
  ...: Requested byte range [0, 2552) is not valid for value of size 1000")."""
  def line(x: BaseException) -> str:
    text = (str(x).splitlines() or [""])[0]
    for details in _TENSORSTORE_DETAILS:
      text = text.split(details)[0]
    return f"{type(x).__name__}: {text[:300]}"
  root, seen = e, {id(e)}
  while root.__cause__ is not None and id(root.__cause__) not in seen:
    root = root.__cause__
    seen.add(id(root))
  outer = line(e)
  if root is e or line(root).split(": ", 1)[1] in outer:
    return outer
  return f"{outer} (from {line(root)})"


class UnreadableJsonError(ValueError):
  """A JSON file of a checkpoint (orbax's metadata, the side-car) that does not parse, named:
  json's error says where in the text, not which file (a fallback's warning named the step
  alone: a kill-and-damage review, 2026-12-07)."""


def _json_file(directory: str, doc: str) -> Optional[str]:
  """The file under `directory` whose text is `doc` (what a JSONDecodeError failed on), if any;
  only files of that very size are read, and never the array data (ocdbt's d/ folders)."""
  text = doc.encode()
  for root, dirs, files in os.walk(directory):
    dirs[:] = sorted(d for d in dirs if d != "d")
    for name in sorted(files):
      path = os.path.join(root, name)
      try:
        if os.path.getsize(path) == len(text):
          with open(path, "rb") as f:
            if f.read() == text:
              return path
      except OSError:
        continue
  return None


@contextlib.contextmanager
def _naming_json_files(directory: str):
  """Re-raises a JSONDecodeError from reading the checkpoint in `directory` as
  UnreadableJsonError naming the file first (error_line keeps a line's first 300 characters)."""
  try:
    yield
  except json.JSONDecodeError as e:
    path = _json_file(directory, e.doc)
    if path is None:
      raise
    raise UnreadableJsonError(f"{path} is not valid JSON ({e})") from e


class DamagedCheckpointError(ValueError):
  """A checkpoint restored without an error but holds other bits than were saved."""


def verify(step: int, state: Any, meta: dict) -> None:
  """Raises DamagedCheckpointError when the restored `state` differs from the checksums its
  side-car recorded at save time (checkpoints written before they existed are not checked)."""
  saved = meta.get("checksums") if isinstance(meta, dict) else None
  if not saved:
    return
  now = checksums(state)
  bad = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
  if bad:
    raise DamagedCheckpointError(
        f"checkpoint {step}: {len(bad)} array(s) read back with other contents than were saved "
        f"(checksum), e.g. {bad[0]}: the files are damaged")


# The side-car's own digest, under this key of it: the JSON file has no checksum either, and a
# flipped bit inside a number still parses (a digit for another: the prompt stream's position,
# the LR schedule's horizon), so a damaged side-car resumed another run, silently.
META_CHECKSUM = "meta_checksum"


def meta_checksum(meta: dict) -> str:
  """sha256 of `meta` (but its META_CHECKSUM) as it reads back from JSON, keys sorted."""
  plain = json.loads(json.dumps({k: v for k, v in meta.items() if k != META_CHECKSUM}))
  return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()


def verify_meta(step: int, meta: Any) -> None:
  """Raises DamagedCheckpointError when checkpoint `step`'s side-car `meta` differs from the
  digest it was saved with (side-cars written before there was one are not checked)."""
  saved = meta.get(META_CHECKSUM) if isinstance(meta, dict) else None
  if saved is not None and saved != meta_checksum(meta):
    raise DamagedCheckpointError(f"checkpoint {step}: its side-car (meta) reads back with other "
                                 "contents than were saved (checksum): the file is damaged")


class _ClosedLoopCallbacks:
  """A sys.unraisablehook that drops tensorstore's callbacks onto orbax's closed event loop and
  passes everything else on to the hook it replaced.

  A restore that fails on a damaged file (or a save that fails on a full disk) ends orbax's
  asyncio loop while tensorstore still finishes the other reads (writes); each finished one's
  `call_soon_threadsafe` raises RuntimeError('Event loop is closed') on a tensorstore thread,
  which Python prints as an unraisable traceback: 18-130 of them for one damaged checkpoint,
  68-172 (6 lines each) for the tiny run's save on a full disk (measured), harmless (the
  fallback to the checkpoint before proceeds; the failed save raises SaveError), but the log
  reads like a crash. Nothing in this package runs an event loop of its own."""

  def __init__(self):
    self.dropped = 0
    self._previous = None
    self._inside = threading.local()  # a hook installed later that passes calls on to us

  def install(self) -> None:
    """Puts this hook in front of the current one (again, if something replaced it since)."""
    if sys.unraisablehook is not self:
      self._previous, sys.unraisablehook = sys.unraisablehook, self

  def __call__(self, unraisable) -> None:
    e = unraisable.exc_value
    if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
      self.dropped += 1
      return
    if getattr(self._inside, "active", False):  # a cycle through a hook that chains to us
      sys.__unraisablehook__(unraisable)
      return
    self._inside.active = True
    try:
      (self._previous or sys.__unraisablehook__)(unraisable)
    finally:
      self._inside.active = False


_CLOSED_LOOP_CALLBACKS = _ClosedLoopCallbacks()


class SaveError(RuntimeError):
  """A checkpoint could not be written. The run must stop: going on would train past progress
  it can no longer keep. (Orbax's background threads of the failed save wait 5 minutes for a
  signal that never comes; train_ppo exits at once instead of waiting for them.)"""


# The exit status of a binary stopped by a SaveError (a checkpoint save, or another record of the
# run: trainer/hooks.LogWriteError; train_ppo and export_hf): one status for a scheduler.
EXIT_SAVE_FAILED = 3


# Orbax's replica-parallel save splits each replicated array into one slice per replica, each
# written by its own replica; every slice costs a slicing op (compiled per shape, on its first
# use in a process) and a device-to-host transfer: 1.5 ms a slice on the 2-core CPU machine
# with a warm compilation cache; a process's first save of 70 replicated float32 arrays of
# distinct shapes (8-9 KB each) on 8 devices took 17.8 s, 0.25 s with this threshold
# (2026-12-01), and a 4-iteration toy PPO run's two saves 2.1 s, 0.24 s. At a write
# bandwidth of ~1 GB/s, 1.5 ms writes ~1.5 MB, so a slice under 1 MiB costs more than its
# parallel write saves: such arrays are written whole by one replica, larger ones in parallel.
MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL = 1 << 20


def _use_array_handler() -> None:
  """Registers (once per process, orbax's registry being global) orbax's ArrayHandler with
  MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL in place of orbax's own, keeping that one's array
  metadata store (its per-array metadata: a typed PRNG key restores as a key). Left as it is
  where it is not orbax's plain handler (a user registered another) or is already ours, and on
  an orbax without the threshold (0.11.17, the oldest that imports with jax 0.10.2) or without
  that store: saves as before, only slower for small arrays."""
  handler = ocp.type_handlers.get_type_handler(jax.Array)
  if (type(handler) is not ocp.type_handlers.ArrayHandler
      or not hasattr(handler, "_array_metadata_store")
      or getattr(handler, "_min_slice_bytes_for_replica_parallel", None) is not None):
    return
  try:
    ours = ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL,
        array_metadata_store=handler._array_metadata_store)  # pylint: disable=protected-access
  except TypeError:  # an orbax whose ArrayHandler has no such arguments
    return
  # Without orbax's warning that this very call overrides its handler, on every run's start.
  quiet = lambda record: "overriding" not in record.getMessage()
  absl_logger = py_logging.getLogger("absl")
  absl_logger.addFilter(quiet)
  try:
    ocp.type_handlers.register_type_handler(jax.Array, ours, override=True)
  finally:
    absl_logger.removeFilter(quiet)


class Checkpointer:
  """Saves/restores (state pytree, metadata dict) under workdir/checkpoints/<step>."""

  def __init__(self, workdir: str, keep: int = 2):
    _use_array_handler()
    self.keep = keep
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, "checkpoints")
    if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
      # orbax lists it at once: a NotADirectoryError traceback from its threads, no advice.
      raise ValueError(f"{self.directory} is not a directory (a file, or a link to none): the "
                       "run keeps its checkpoints there; move it away or use another --workdir")
    # Handlers named up front, so a checkpoint's metadata reads before anything was restored.
    # cleanup_tmp_directories: the partial directory of a save that was killed mid-way
    # (<step>.orbax-checkpoint-tmp-*) is never a checkpoint and would otherwise stay, one full
    # copy of the state per preemption. Safe: the trainer builds this holding the workdir lock,
    # so no save of another run is in progress.
    self._mngr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, cleanup_tmp_directories=True),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})
    # That cleanup runs on a background thread that only save() waits for (orbax 0.12), and
    # close() does not: a start that then fails on the user's input (a prompts file without the
    # answer field) could end with that thread's "cannot schedule new futures after
    # interpreter shutdown" traceback as the last thing on screen (seen by a review in 3 of 5
    # tries; not reproduced on the dev machine). Waited for here, while nothing else runs.
    await_cleanup = getattr(self._mngr, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:  # a private method: absent in another orbax, skip the wait
      await_cleanup()
    self._probe_writable()  # its failure: raise_if_unwritable

  def _probe_writable(self) -> None:
    """Creates and removes a file in the checkpoints directory: one that cannot be written
    was found only at the first save, checkpoint.every iterations of work later, after
    hundreds of lines of orbax's tracebacks (a permission check alone misses a read-only
    mount, an immutable directory, or root's rights). Where the directory is not there yet
    (orbax creates it from process 0 of a multi-host run) only process 0's probe counts."""
    self.unwritable: Optional[str] = None
    if not os.path.isdir(self.directory):
      return
    try:
      with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".write_probe_"):
        pass
    except OSError as e:
      self.unwritable = (f"the checkpoints directory {self.directory} is not writable "
                         f"({type(e).__name__}: {e}); the run would lose its work at the "
                         "first save: fix its permissions or use another --workdir")

  def raise_if_unwritable(self) -> None:
    """The probe's failure as a ValueError (raised where the caller's processes agree: a
    multi-host run's set-up compares every process's reading of the workdir, so one that
    stops here does not leave the others waiting in a collective)."""
    if self.unwritable:
      raise ValueError(self.unwritable)

  def latest_step(self) -> Optional[int]:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    """Finished checkpoints, newest first."""
    return sorted(self._mngr.all_steps(), reverse=True)

  def trim(self) -> list[int]:
    """Deletes the finished checkpoints beyond the newest `keep` (orbax keeps no other: no
    best_fn) and returns their steps, oldest first. Orbax deletes the oldest only after it
    commits a new one: a process killed between the two leaves keep + 1, which orbax's next
    save trims (it lists every step on disk), but a start that saves none (a finished run
    re-run) kept it for good. Every process calls it (orbax's delete waits for all)."""
    extra = sorted(self.all_steps()[self.keep:])
    for step in extra:
      self._mngr.delete(step)
    return extra

  def set_aside(self, step: int) -> str:
    """Moves checkpoint `step` (one that cannot be read) out of the rotation, to
    workdir/damaged_checkpoints/<step>[.n], never deleting it; returns where it went. Without
    this, the run would reach `step` again, find it present, keep the damaged one and lose
    the progress again on the next resume."""
    src, dst = self._aside(step)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.move(src, dst)
    self._mngr.reload()
    return dst

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _aside(self, step: int) -> tuple[str, str]:
    """(checkpoint `step`'s directory, where set_aside moves it: a free name)."""
    dst_dir = os.path.join(self.workdir, "damaged_checkpoints")
    dst, n = os.path.join(dst_dir, str(step)), 1
    while os.path.exists(dst):
      dst, n = os.path.join(dst_dir, f"{step}.{n}"), n + 1
    return self._step_dir(step), dst

  def set_aside_command(self, step: int) -> str:
    """The shell command that sets checkpoint `step` aside as set_aside would (for a run that
    does not do it itself: checkpoint.fallback=False, several processes)."""
    src, dst = self._aside(step)
    return f"mkdir -p {shlex.quote(os.path.dirname(dst))} && mv {shlex.quote(src)} " \
           f"{shlex.quote(dst)}"

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Starts an (asynchronous) save; `wait()` blocks until it is durable."""
    if step in self._mngr.all_steps():
      return
    _CLOSED_LOOP_CALLBACKS.install()  # before: the callbacks come while a failed write unwinds
    meta = {**meta, META_CHECKSUM: meta_checksum(meta)}
    self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                  meta=ocp.args.JsonSave(meta)))
    logging.info("checkpoint %d: saving to %s", step, self.directory)

  def wait(self) -> None:
    """Blocks until the pending save is durable; raises SaveError (path and cause) if it
    failed."""
    try:
      self._mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 whatever orbax or the filesystem raised
      raise SaveError(f"checkpoint save under {self.directory} failed: {type(e).__name__}: "
                      f"{e}") from e

  def restore(self, step: int, like: Any) -> tuple[Any, dict]:
    """Restores into the structure, shapes, dtypes and shardings of `like`."""
    _CLOSED_LOOP_CALLBACKS.install()  # before: the callbacks come while a failed read unwinds
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
    with _naming_json_files(self._step_dir(step)):
      out = self._mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    verify_meta(step, out["meta"])
    return out["state"], out["meta"]

  def layout_mismatch(self, step: int, like: Any) -> Optional[str]:
    """Whether checkpoint `step` holds `like`'s arrays (same paths, shapes and dtypes), from its
    metadata alone: None if it does, else what differs. A checkpoint that fails to restore
    although its layout matches is damaged; one whose layout differs was written by another
    configuration or version of the code and must not be set aside as damaged. Raises if the
    metadata itself cannot be read."""
    with _naming_json_files(self._step_dir(step)):
      tree = self._mngr.item_metadata(step)["state"].tree
    stored = _layout(jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: hasattr(x, "shape"))[0])
    want = _layout(jax.tree_util.tree_flatten_with_path(like)[0])
    if stored == want:
      return None
    differ = sorted(k for k in set(stored) | set(want) if stored.get(k) != want.get(k))
    k = differ[0]
    return (f"{len(differ)} array(s) differ from this run's state, e.g. {k}: stored "
            f"{stored.get(k, 'absent')}, this run {want.get(k, 'absent')}")

  def restore_meta(self, step: int) -> dict:
    """The JSON side-car of checkpoint `step` alone: no array is read, nothing is built."""
    with _naming_json_files(self._step_dir(step)):
      out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    verify_meta(step, out["meta"])
    return out["meta"]

  def close(self) -> None:
    self.wait()
    self._mngr.close()
