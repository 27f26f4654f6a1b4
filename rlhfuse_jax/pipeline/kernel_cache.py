"""numba's on-disk cache of the search kernels, invalidated by an edit of any kernel file.

numba keys a cached function (`cache=True`) on its own source file only: "cache invalidation
fails to recognize changes in symbols defined in a different file" (numba's developer notes on
caching, "Cache limitations"; the patch extending it to other files was never merged, numba PRs
8396 and 9563), and the module globals a kernel reads are frozen into its compiled code. Our
kernels call across files: search.py's and feasible_anneal.py's annealers inline evaluate.py's
simulator and feasible_anneal.py's moves, and read graph.py's and evaluate.py's index constants.
So an edit of evaluate.py (a user's change, or a `git pull` into an editable install) left the
annealers running the old compiled simulator from the cache: schedules timed by code that no
longer exists, with nothing said (found by a mutation audit, whose mutants of evaluate.py did not
reach feasible_anneal.py's cached kernels).

`tie(namespace)` extends the cache key of every cached kernel in a module with a hash of the
bytes of every file in `KERNEL_FILES`, so an edit of any of them recompiles all the kernels
(tens of seconds, once) instead of loading stale ones. It sets a private attribute of numba's
cache (`Dispatcher._cache._cache_file._source_stamp`, the stamp numba compares with the one in
the cache index); tests/test_kernel_cache.py checks on the installed numba that an edit of a
called function in another file is seen, and fails if that attribute moves.
"""
from __future__ import annotations

import functools
import hashlib
import os
from typing import Any, Mapping

import numba

# The package's files whose code or constants end up in a compiled kernel: the four modules that
# define kernels, and graph.py, whose task-kind constants (AF, AB, CF, CB) schedules.py's kernel
# reads. tests/test_kernel_cache.py checks that every module defining a kernel is listed.
KERNEL_FILES = ("evaluate.py", "feasible_anneal.py", "graph.py", "schedules.py", "search.py")


@functools.lru_cache(maxsize=None)
def sources_hash() -> str:
  """sha256 over the bytes of KERNEL_FILES (in this directory), in their listed order."""
  h = hashlib.sha256()
  here = os.path.dirname(os.path.abspath(__file__))
  for name in KERNEL_FILES:
    with open(os.path.join(here, name), "rb") as f:
      h.update(name.encode() + b"\0" + f.read() + b"\0")
  return h.hexdigest()


def tie(namespace: Mapping[str, Any], digest: str | None = None) -> int:
  """Extends the cache stamp of every cached numba function that the module of `namespace` (its
  globals()) defines with `digest` (default: sources_hash()); returns how many it tied. Call it
  at the end of a kernel module, before any kernel runs (numba reads the stamp at the first
  call). Kernels the module imports are left to the module that defines them."""
  digest = sources_hash() if digest is None else digest
  n = 0
  for obj in list(namespace.values()):
    if (not isinstance(obj, numba.core.dispatcher.Dispatcher)
        or obj.py_func.__module__ != namespace["__name__"]):
      continue
    cache = getattr(obj, "_cache", None)
    if cache is None or type(cache).__name__ == "NullCache":  # not cache=True
      continue
    cache_file = getattr(cache, "_cache_file", None)
    if cache_file is None or not hasattr(cache_file, "_source_stamp"):
      raise RuntimeError(
          f"numba {numba.__version__} keeps no _source_stamp on {obj.__name__}'s cache: "
          "rlhfuse_jax/pipeline/kernel_cache.py cannot tie the kernels' cache to their files "
          "(see its docstring); pin numba to a version where it can, or remove cache=True")
    cache_file._source_stamp = ("rlhfuse_jax", (cache_file._source_stamp, digest))
    n += 1
  return n
