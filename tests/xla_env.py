"""The suite's XLA flags, and the environment its subprocesses start with.

Most of the suite's time is XLA:CPU compiling small programs; two codegen flags make that faster:
- LLVM's optimisation off (`--xla_backend_optimization_level=0`): on the 2-core dev machine
  test_pipeline_executor.py + test_attention.py took 88 s with the default level and 71 s at 0
  (2026-11-26).
- XLA:CPU's loop emitters instead of its MLIR fusion emitters
  (`--xla_cpu_use_fusion_emitters=false`, where this XLA has the switch: jax 0.10.x, not
  0.11.2): test_attention.py, one pipeline-executor and one sharded-trainer test took 131 s with
  the fusion emitters and 82 s without (2026-11-29, jax 0.10.2, with level 0 in both; disabling
  LLVM's expensive passes or codegen splitting gained <= 7 %).
The flags change machine code only, not the HLO programs, their buffers or XLA's memory/cost
analyses that tests read. They can change float rounding (e.g. fewer multiply-adds contracted
into FMAs), so every process whose outputs a test compares bitwise with another's must compile
with the same flags: subprocesses get them through `subprocess_env`.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from rlhfuse_jax.parallel.host_devices import host_device_env

_LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
  """Whether this jaxlib's XLA accepts `flag`: an unknown flag in XLA_FLAGS aborts the process,
  and jax 0.11.2's XLA no longer has the emitter switch (0.10.x has it). Asked of a subprocess,
  once per test run (about 1 s): the result travels to the xdist workers and subprocesses in
  RLHFUSE_TEST_CODEGEN_FLAGS."""
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True, timeout=300).returncode == 0


CODEGEN_FLAGS = os.environ.get("RLHFUSE_TEST_CODEGEN_FLAGS")
if CODEGEN_FLAGS is None:
  CODEGEN_FLAGS = " ".join(["--xla_backend_optimization_level=0",
                            *([_LOOP_EMITTERS] if _xla_knows(_LOOP_EMITTERS) else [])])
  os.environ["RLHFUSE_TEST_CODEGEN_FLAGS"] = CODEGEN_FLAGS


def subprocess_env(devices: int | None = None, **extra: str) -> dict:
  """This process's environment for a subprocess on the CPU: XLA_FLAGS keeps this process's flags
  (the suite's codegen flags and whatever the caller set) with `devices` fake CPU devices in place
  of its 8 (None: the one real device, as a user's plain run)."""
  env = dict(os.environ, **host_device_env(devices))  # JAX_NUM_CPU_DEVICES too, if set
  flags = env["XLA_FLAGS"]
  missing = [f for f in CODEGEN_FLAGS.split() if f not in flags.split()]
  flags = " ".join([*missing, flags]).strip()
  env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **extra)
  # Process 0 of a multi-process run that fails waits this long for the others to report
  # (experiments/config_files.PEER_GRACE_S, 10 s): 3 s is ample for processes that fail at the
  # same check, and saves 7 s of each such test. test_multiprocess's test of the grace keeps 10.
  env.setdefault("RLHFUSE_PEER_GRACE_S", "3")
  return env


# A command prefix that starts the command after it with SIGINT at its default, as a terminal's
# shell leaves it: a process that inherits SIGINT ignored keeps ignoring it (bash starts its
# background jobs so), and a Ctrl-C test would test nothing. (Not Popen's preexec_fn: that forks
# a multithreaded jax process, which jax warns of.)
RESET_SIGINT = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
                "signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"]


def free_port() -> str:
  """A TCP port free on 127.0.0.1 now (a coordinator's for jax.distributed)."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return str(sock.getsockname()[1])
