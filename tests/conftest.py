"""Test setup: 8 fake CPU devices and the suite's codegen flags (tests/xla_env.py), set before jax
is imported anywhere, and one persistent XLA compilation cache for the whole run.

The cache: many tests compile the same programs (every trainer test builds the same tiny update;
the binary tests start the same run in several subprocesses), and jax's persistent cache keyed
by the compiled program lets all of them after the first load it instead of compiling again
(test_faults.py + test_train_ppo_binary.py: 136 s -> 78 s on the 2-core dev machine). It starts
empty in a fresh directory each run, is shared by the xdist workers and every subprocess they
start (through the environment), and is deleted at the end. A run that sets
JAX_COMPILATION_CACHE_DIR itself keeps its own. Tests that time compilation unset it for their
subprocess (test_bench_decode.py).

A whole-suite run may end with one "PytestUnraisableExceptionWarning: Exception ignored in
_xla_gc_callback ... KeyboardInterrupt" after the last test, all tests passed. It is xdist's
worker shutdown, not a test: execnet (gateway_base.WorkerGateway._terminate_execution) sends the
worker a SIGINT when it is still busy 5 s after being told to stop, and a worker that compiled
hundreds of programs can still be freeing them in jax's gc callback then.
"""
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.xla_env import CODEGEN_FLAGS  # pylint: disable=wrong-import-position

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" {CODEGEN_FLAGS} --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Opt-in audit, off in CI: RLHFUSE_TEST_ONE_MESH=1 makes every in-process program that holds
# an exp lower as a GPU program holding cuDNN's fused attention does: jax then refuses any
# program whose NamedShardings are on more than one mesh ("mesh should be the same across the
# entire program"), which only a GPU run showed before (the pipelined step, 2026-12-04). jax's
# list of primitives that need devices while lowering is private: this is an audit, not a test.
# Binaries the tests start as subprocesses are not covered. Whole suite, 2026-12-04: 2626
# passed; 1 failed, test_decode_kernel.py's lowering for CUDA from an abstract mesh, which jax
# refuses for any such primitive (the real kernel holds none): expected, not a finding.
if os.environ.get("RLHFUSE_TEST_ONE_MESH") == "1":
  import jax  # pylint: disable=wrong-import-position
  from jax._src import dispatch  # pylint: disable=wrong-import-position
  dispatch.prim_requires_devices_during_lowering.add(jax.lax.exp_p)

_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the controller (or a plain run) makes it
  _OWN_CACHE = tempfile.mkdtemp(prefix="rlhfuse_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  # Cache every program: the tiny test programs compile in well under jax's default 1 s
  # minimum. (Only in our own cache: a user's keeps its thresholds; the xdist workers inherit
  # these from the controller.)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# The files that take longest (seconds of one CI run, `--durations=0`, 2026-11-29), run first.
# `--dist loadfile` hands each worker a whole file at a time in collection order; xdist's own
# order (most tests first) started these last, so one worker still ran one of them minutes
# after the other had finished. Longest first, the last files handed out are short ones.
# test_pipeline_experiments.py (third longest) stays out on purpose: its binaries start warm
# from the numba and XLA caches the files before it fill. Moved third (2026-12-02), its tests
# took 277 s against 168 s before and 199 s after, in fresh-clone CI runs where the other files
# took about as long as in the first run (+0-25 %: this host's speed drifts).
HEAVY_FILES = ("test_multiprocess.py", "test_faults.py", "test_pipeline_executor.py",
               "test_bench_decode.py", "test_fused_multiprocess.py", "test_attention.py",
               "test_plan_check.py", "test_plan.py", "test_trainer_pipelined.py",
               "test_generation.py", "test_activation_sharding.py", "test_async_ppo.py",
               "test_ppo_update_reference.py", "test_trainer.py", "test_trainer_paths.py")


# Every XLA:CPU program a process holds, compiled or loaded from the persistent cache, keeps about
# 35 memory maps (LLVM's JIT: its code and data), and Linux caps a process's maps at
# vm.max_map_count (65530 by default). jax keeps each program in its in-memory caches as long as
# its jitted function lives (a module-level one: the whole run), so an xdist worker kept the
# programs of every file it ran: +1800 to +4100 maps a heavy file. Past the cap LLVM maps no more
# code, and loading or compiling a program aborts ("LLVM ERROR: Unable to allocate section
# memory": 1750 cached programs loaded in one process, 2026-12-07) or segfaults (the CI run of
# 2026-12-07, at ~78 %, in jax's compilation_cache.get_executable_and_time). So when a file ends
# with the process past CLEAR_AT_MAP_SHARE of the cap, jax's caches are dropped and the next
# files load what they share from the persistent cache. Not after every file: that retraced and
# reloaded the library's programs in every file, and CI took 19 min 50 s against 11-12.
CLEAR_AT_MAP_SHARE = float(os.environ.get("RLHFUSE_TEST_CLEAR_AT_MAP_SHARE", "0.5"))


def _count_lines(path: str) -> "int | None":
  try:
    with open(path, "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # (not Linux)
    return None


def _map_cap() -> "int | None":
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
  yield  # the file's fixtures are torn down first
  if (nextitem is None or nextitem.path != item.path) and "jax" in sys.modules:
    maps, cap = _count_lines("/proc/self/maps"), _map_cap()
    if maps is not None and cap is not None and maps >= CLEAR_AT_MAP_SHARE * cap:
      sys.modules["jax"].clear_caches()


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(HEAVY_FILES)}
  # A stable sort: the rest keep their order, as do the tests within a file.
  items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))
