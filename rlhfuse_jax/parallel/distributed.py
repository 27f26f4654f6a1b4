"""Multi-process (multi-host) start-up through `jax.distributed`.

Every process runs the same program on the same global batch (the data stream and all RNG are
derived from the seed), places its addressable shards of each global array, and reads results
back with `mesh.to_host` (an all-gather across processes). Only process 0 writes files other
than checkpoints (orbax coordinates those itself).

On one machine, several processes on 127.0.0.1 with CPU devices exercise the same code path as a
GPU/TPU cluster (see launch/local_multiprocess.sh).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import zlib
from typing import Callable, Mapping, Optional, TypeVar

import jax
import numpy as np
from absl import flags
from absl import logging

from rlhfuse_jax import workdir as wd

T = TypeVar("T")


def check_start_flags() -> None:
  """Registers the check of a binary's start flags (train_ppo, bench_generation; defined by
  the binary): --coordinator_address, --num_processes and --process_id are read only with
  --distributed. Without it each process ran a one-process job of its own (train_ppo: the
  first holding the workdir, the others refused as "another run holds it"), silently."""
  flags.register_multi_flags_validator(
      ["distributed", "coordinator_address", "num_processes", "process_id"],
      lambda f: f["distributed"] or not (f["coordinator_address"] or f["num_processes"] or
                                         f["process_id"] is not None),
      message="--coordinator_address, --num_processes and --process_id join the processes of "
              "one multi-host run only with --distributed: add it (or drop them for a "
              "one-process run)")


def initialize(coordinator_address: str = "", num_processes: int = 0,
               process_id: Optional[int] = None,
               heartbeat_timeout_s: Optional[int] = None) -> None:
  """Calls jax.distributed.initialize.

  With no arguments jax auto-detects the cluster (SLURM, TPU pods, Open MPI); on one machine pass
  coordinator_address="127.0.0.1:PORT", num_processes and process_id. heartbeat_timeout_s:
  how long the coordination service waits for a silent process before it fails the others
  (jax's default, 100 s, when None); a process whose peer died waits that long at exit.
  """
  if num_processes and num_processes < 1:
    raise ValueError(f"num_processes={num_processes}: expected >= 1")
  named = {"coordinator_address": bool(coordinator_address),
           "num_processes": bool(num_processes), "process_id": process_id is not None}
  if named["num_processes"] or named["process_id"]:
    # jax reads the coordinator's address from JAX_COORDINATOR_ADDRESS too: with the count
    # and index given, it completes them. Alone (no flags) it leaves the count and index to
    # jax's cluster detection (SLURM, Open MPI, TPU pods), which it was refused.
    named["coordinator_address"] |= bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))
  if any(named.values()) and not all(named.values()):
    # jax's own errors ("Number of processes must be defined", "coordinator_address should be
    # defined") name no flag, and a process_id alone was dropped without a word.
    given = [f for f, v in named.items() if v]
    raise ValueError(f"{' and '.join(given)} given without "
                     f"{' and '.join(f for f, v in named.items() if not v)}: pass all three "
                     "(--coordinator_address, --num_processes, --process_id), or none to let "
                     "jax detect the cluster (SLURM, TPU pods, Open MPI)")
  if num_processes and (process_id is None or not 0 <= process_id < num_processes):
    raise ValueError(f"process_id={process_id}: expected an integer in [0, {num_processes})")
  kwargs = {}
  if coordinator_address:
    kwargs["coordinator_address"] = coordinator_address
  if num_processes:
    kwargs["num_processes"] = num_processes
    kwargs["process_id"] = process_id
  if heartbeat_timeout_s is not None:
    kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_s)
  gpus = slurm_node_gpus(os.environ)
  if gpus is not None:
    kwargs["local_device_ids"] = gpus
    logging.info("SLURM, one task per node: all %d GPUs of the node (jax alone would use GPU "
                 "SLURM_LOCALID only)", len(gpus))
  if jax.config.jax_platforms in ("cpu",) or not jax.config.jax_platforms:
    # Cross-process collectives on CPU devices need gloo (GPUs use NCCL, TPUs ICI/DCN).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  joined = threading.Event()
  threading.Thread(target=_warn_while_joining, daemon=True, name="join_watchdog",
                   args=(joined, address, num_processes, process_id)).start()
  try:
    jax.distributed.initialize(**kwargs)
  except ValueError as e:
    if named["coordinator_address"]:
      raise
    raise ValueError(f"--distributed: jax found no cluster to join ({e}): it detects SLURM, TPU "
                     "pods and Open MPI; elsewhere give every process --coordinator_address="
                     "HOST:PORT --num_processes=N --process_id=i (launch/local_multiprocess.sh "
                     "does on one machine)") from e
  except jax.errors.JaxRuntimeError as e:
    if "Failed to start RPC server" not in str(e):
      raise
    # Process 0 could not listen on the coordinator's port; the others then wait for it in this
    # call until jax's initialization timeout (5 minutes) and abort.
    raise ValueError(f"--distributed: process 0 could not start jax's coordination service at "
                     f"{address or '?'} ({e}): the port is most likely in use (another run's "
                     "coordinator, or another program); choose another port for every process "
                     "(--coordinator_address; PORT= for launch/local_multiprocess.sh)") from e
  finally:
    joined.set()
  reclaim_sigterm()
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  check_same_local_devices(jax.devices(), jax.process_index())


JOIN_WARN_S = 30.0  # seconds in jax.distributed.initialize before _warn_while_joining speaks


def coordinator_unreachable(address: str, timeout_s: float = 5.0) -> Optional[str]:
  """Why no TCP connection opens to `address` (HOST:PORT, the coordinator's), or None when one
  does (or the address cannot be split: jax reports that)."""
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    return None
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
      return None
  except OSError as e:
    return f"{type(e).__name__}: {e}"


def _warn_while_joining(joined: threading.Event, address: str, num_processes: int,
                        process_id: Optional[int], wait_s: Optional[float] = None) -> None:
  """A warning after `wait_s` (JOIN_WARN_S), then after twice as long again, and so on, while
  this process is still in jax.distributed.initialize: a process given another
  --coordinator_address (or --num_processes on process 0) waited there silently for jax's
  initialization timeout, 5 minutes, and then every process aborted with jax's "another task
  died ... DEADLINE_EXCEEDED", which names no address and blames a peer. Said on every
  process: which address it connects to, and whether anything listens there (a process > 0
  that reaches none has the wrong address, or process 0 has not started)."""
  delay = JOIN_WARN_S if wait_s is None else wait_s
  waited = 0.0
  while not joined.wait(delay):  # after 30, 90, 210 s, ...
    waited += delay
    delay *= 2
    who = (f"process {process_id} of {num_processes}" if num_processes else "this process")
    why = coordinator_unreachable(address) if address and process_id != 0 else None
    logging.warning(
        "%s: still joining the run at the coordinator %s after %.0f s (jax gives up after its "
        "initialization timeout, 300 s, with \"another task died ... DEADLINE_EXCEEDED\")%s",
        who, address or "(detected by jax)", waited,
        f": nothing accepts connections there ({why}): check --coordinator_address (process "
        f"0's host and port, the same on every process) and that process 0 runs" if why else
        ": a process has not started yet, or was given another --coordinator_address, or "
        "process 0 another --num_processes (each process's log says which address it "
        "connects to)")


def check_same_local_devices(devices, me: int) -> None:
  """A ValueError, on every process alike (read from the global device list, no collective),
  unless every process has as many devices: the meshes and jax's multi-host utilities lay
  devices out process by process, and the first all-gather failed with numpy's "cannot reshape
  array of size 6 into shape (2,2)" (a host with a GPU missing or hidden, another
  XLA_FLAGS device count)."""
  counts: dict = {}
  for d in devices:
    counts[d.process_index] = counts.get(d.process_index, 0) + 1
  if len(set(counts.values())) > 1:
    seen = ", ".join(f"process {p}: {n}" for p, n in sorted(counts.items()))
    raise ValueError(
        f"the processes have different numbers of devices ({seen}; this is process {me}): every "
        "process must have as many (a host with a device missing or hidden by "
        "CUDA_VISIBLE_DEVICES or JAX_LOCAL_DEVICE_IDS; on CPU the same "
        "--xla_force_host_platform_device_count in every process's XLA_FLAGS)")


def reclaim_sigterm() -> None:
  """Gives SIGTERM back to the handler Python has for it. jax.distributed.initialize starts
  jax's preemption notifier, which takes SIGTERM over below Python (signal.getsignal still
  names the Python handler, which is never called again): a SIGTERM during a multi-host run's
  set-up (hooks.stop_before_training: exit 75 with the other processes) was swallowed and the
  run trained on to the end, exit 0; with no handler of ours it no longer terminated the
  process. The trainer's own handlers stop runs (hooks.StopFlag), not jax's notifier. On the
  main thread only (where Python allows handlers)."""
  if threading.current_thread() is not threading.main_thread():
    return
  handler = signal.getsignal(signal.SIGTERM)
  signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)


def _int(environ: Mapping[str, str], *names: str, typed: bool = False) -> Optional[int]:
  """The first of `names` set to an integer. typed: SLURM's GPU counts, "type:n" per GPU type,
  which add up ("a100:8" reads 8, "gpu:a100:2,gpu:v100:1" reads 3)."""
  for name in names:
    value = environ.get(name, "")
    counts = [part.rsplit(":", 1)[-1] for part in value.split(",")] if typed else [value]
    if all(c.isdigit() for c in counts):
      return sum(int(c) for c in counts)
  return None


def slurm_node_gpus(environ: Mapping[str, str]) -> Optional[list[int]]:
  """The local device ids for a SLURM step with one task per node: every GPU of the node.

  jax's SLURM detection assumes one process per GPU and, unless told otherwise, makes only GPU
  SLURM_LOCALID visible, so launch/slurm_gpu.sbatch's one process per node would see one GPU of
  eight. None (jax's own rule) outside SLURM, with several tasks per node, when
  JAX_LOCAL_DEVICE_IDS is set or when the node's GPU count is unknown."""
  if "SLURM_LOCALID" not in environ or environ.get("JAX_LOCAL_DEVICE_IDS"):
    return None
  per_node = _int(environ, "SLURM_NTASKS_PER_NODE")
  if per_node is None:
    tasks = _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    nodes = _int(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    per_node = tasks // nodes if tasks and nodes and tasks % nodes == 0 else None
  gpus = _int(environ, "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", typed=True)
  visible = environ.get("CUDA_VISIBLE_DEVICES", "")
  if gpus is None and visible:
    gpus = len(visible.split(","))
  if per_node != 1 or not gpus:
    return None
  return list(range(gpus))


def is_main_process() -> bool:
  return jax.process_index() == 0


def main_process_verdict(ok: bool) -> bool:
  """Process 0's `ok`, known to every process (one tiny collective; single process: `ok`).

  For a decision only process 0 can take (the workdir lock): every process must call it, so a
  refusal on process 0 stops the others at once instead of leaving them waiting in the first
  collective of a run that will never come."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils  # multi-host only
  return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


def run_on_main_process(fn: Callable[[], T], failure: str) -> Optional[T]:
  """`fn()` on process 0 alone, its success known to every process: process 0's result there,
  None on the others. Every process must call it at the same point. A failure raises on every
  process at once (process 0: fn's own exception; the others: workdir.MainProcessError
  (`failure`), a RuntimeError),
  instead of process 0 stopping alone while the others wait for it in the next collective.
  For what only process 0 may do: hold the workdir lock, move files, write a shared cache."""
  result, failed = None, None
  if jax.process_index() == 0:
    try:
      result = fn()
    except Exception as e:  # pylint: disable=broad-except  raised below, after the verdict
      failed = e
  if not main_process_verdict(failed is None):
    if failed is not None:
      raise failed
    raise wd.MainProcessError(failure)
  return result


def check_same_over_processes(values: tuple, what: str, why: str = "",
                              failed: Optional[BaseException] = None) -> None:
  """A ValueError on every process unless every process has the same integer `values` (one
  tiny collective that every process must call at the same point; single process: nothing).
  For what each process reads on its own but all must agree on, such as the checkpoint to
  resume: otherwise they would go on from different states without an error, or wait for
  each other in different collectives. `failed`: this process's own error in reading them
  (its `values` a marker the others do not have), raised here after the comparison, so the
  others learn of it rather than wait for this process."""
  if jax.process_count() == 1:
    if failed is not None:
      raise failed
    return
  every = gather_ints(values)
  if failed is not None:
    raise failed
  if not (every == every[0]).all():
    seen = "; ".join(f"process {p}: {tuple(int(v) for v in row)}" for p, row in enumerate(every))
    raise ValueError(f"the processes disagree on {what} ({seen}){why}")


def gather_ints(values) -> np.ndarray:
  """Every process's integer `values` (int32; as many on every process), one row per process in
  process order (one collective that every process must call at the same point; single
  process: one row)."""
  mine = np.asarray(values, np.int32).reshape(-1)
  if jax.process_count() == 1:
    return mine.reshape(1, -1)
  from jax.experimental import multihost_utils  # multi-host only
  return np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)


def max_over_processes(value: int) -> int:
  """The largest of every process's `value` (one tiny collective that every process must call at
  the same point; single process: `value`). For decisions each process may reach alone, such as
  a stop signal that reached only some of them: all then act on the same answer."""
  if jax.process_count() == 1:
    return int(value)
  from jax.experimental import multihost_utils  # multi-host only
  return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def checksum(text: str) -> int:
  """A non-negative int32 checksum of `text`, what the processes compare of a string (a config,
  a commit, a path) in check_same_over_processes (crc32, which int32 holds without its top
  bit)."""
  return zlib.crc32(text.encode()) & 0x7FFFFFFF


def differing_fields(flat: dict, most: int = 8) -> str:
  """The config fields (`flat`: {"section.field": value}) whose values differ between the
  processes, each with this process's value (two collectives every process must call at the
  same point): the end of train_ppo's error for processes that run different configs, which
  named only checksums and this process's command line, under SLURM or on a TPU pod every
  process's (a config file that differs between the nodes' checkouts, a variable it reads).
  "" when the values agree (the git commits differ)."""
  keys = sorted(flat)
  every = gather_ints((len(keys), checksum(json.dumps(keys))))
  if not (every == every[0]).all():
    return ("; their configs have different fields (another config file or variant, or "
            "another version of it)")
  every = gather_ints([checksum(json.dumps(flat[k], sort_keys=True, default=str)) for k in keys])
  diff = [k for i, k in enumerate(keys) if not (every[:, i] == every[0, i]).all()]
  if not diff:
    return ""
  shown = ", ".join(f"config.{k}={flat[k]!r}" for k in diff[:most])
  more = f" and {len(diff) - most} more" if len(diff) > most else ""
  return f"; the config fields that differ, as this process has them: {shown}{more}"
