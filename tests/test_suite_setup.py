"""tests/conftest.py's own behaviour, seen from a pytest run in a subprocess."""
import subprocess
import sys

import pytest

from tests.test_train_ppo_binary import REPO
from tests.xla_env import subprocess_env

# Two files in one process, as an xdist worker runs them: the first compiles 20 programs of a
# module-level jitted function (its cache lives as long as the module), the second looks at what
# the process still holds of them.
_FIRST = '''
import jax.numpy as jnp

import _held_programs as held


def test_compile():
  held.MAPS.append(held.maps())
  for n in range(1, 21):
    held.f(jnp.ones(n))
  held.MAPS.append(held.maps())


def test_still_held_within_the_file():
  assert held.f._cache_size() == 20
'''
_SECOND = '''
import os

import _held_programs as held


def test_released_after_the_first_file_past_the_share():
  grown = held.MAPS[1] - held.MAPS[0]
  assert grown > 200, held.MAPS  # (about 35 maps a program)
  if os.environ["RLHFUSE_TEST_CLEAR_AT_MAP_SHARE"] == "0":  # past it: dropped
    assert held.f._cache_size() == 0
    assert held.maps() < held.MAPS[1] - grown // 2, (held.MAPS, held.maps())
  else:  # below it: kept for the next files
    assert held.f._cache_size() == 20
'''
_HELD = '''
import jax

MAPS = []
f = jax.jit(lambda x: x * 3 + 1)


def maps():
  with open("/proc/self/maps") as fh:
    return sum(1 for _ in fh)
'''


@pytest.mark.parametrize("share", ["0", "1"])
def test_the_programs_of_a_finished_file_are_released_past_a_share_of_the_map_cap(tmp_path,
                                                                                share):
  """jax keeps a module-level jitted function's programs for the whole run, each about 35 memory
  maps, and a process gets vm.max_map_count of them (65530): conftest drops jax's caches when a
  file ends with the process past CLEAR_AT_MAP_SHARE of them (tests/conftest.py), and keeps
  them otherwise (dropped after every file, the suite took 8 min longer). Share 0: always past
  it; 1: never."""
  for name, text in (("_held_programs", _HELD), ("test_a_first", _FIRST),
                     ("test_b_second", _SECOND)):
    (tmp_path / f"{name}.py").write_text(text)
  # (a cache of its own: programs the other case wrote would load, with fewer maps than compiled)
  env = {**subprocess_env(8), "RLHFUSE_TEST_CLEAR_AT_MAP_SHARE": share,
         "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla_cache")}
  out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest",
                        "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        str(tmp_path / "test_a_first.py"), str(tmp_path / "test_b_second.py")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and "3 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
