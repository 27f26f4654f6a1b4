"""Multi-process (multi-host) start-up through `jax.distributed`.

Every process runs the same program on the same global batch (the data stream and all RNG are
derived from the seed), places its addressable shards of each global array, and reads results
back with `mesh.to_host` (an all-gather across processes). Only process 0 writes files other
than checkpoints (orbax coordinates those itself).

On one machine, several processes on 127.0.0.1 with CPU devices exercise the same code path as a
GPU/TPU cluster (see launch/local_multiprocess.sh).
"""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from absl import logging


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
  if jax.config.jax_platforms in ("cpu",) or not jax.config.jax_platforms:
    # Cross-process collectives on CPU devices need gloo (GPUs use NCCL, TPUs ICI/DCN).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**kwargs)
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())


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
