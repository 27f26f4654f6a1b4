"""Response-length distributions for the simulator: parametric long tails and empirical files.

RLHF response lengths are long-tailed (most responses short, a few run to the generation limit);
that tail is what inter-stage fusion attacks, so the simulator's result depends on it directly.
Kinds (`LengthSpec.kind`), all clipped to [min_len, max_len] (the generation limit):

  lognormal  round(exp(N(log(median), sigma^2))); median ~ `median`, p99 ~ median*exp(2.33 sigma)
  pareto     round(min_len * (1 + Lomax(alpha))): power-law tail, heavier than log-normal
  uniform    every length in [min_len, max_len] equally likely
  constant   every sample has length `value` (no tail: the control case)
  empirical  resampled with replacement from lengths read from `path`:
             .npy 1-D array; .txt one length per line; .json a list, {"lengths": [...]} or a
             histogram {"bins": [...], "counts": [...]}; .jsonl one object per line holding a
             per-sample list under one of PER_SAMPLE_KEYS (e.g. a metrics.jsonl of ours).
Sampling takes a numpy Generator, so a seed fixes the lengths.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Optional

import numpy as np

from rlhfuse_jax import workdir as wd

KINDS = ("lognormal", "pareto", "uniform", "constant", "empirical")
# Keys of a per-sample length list in a JSON / JSONL record, in the order they are tried.
PER_SAMPLE_KEYS = ("response_lengths", "gen/response_lengths", "response_length/values",
                   "lengths")


def load_lengths(path: str) -> np.ndarray:
  """Per-sample lengths from a file (formats in the module docstring). int64 [n], read-only.

  Read once per version of the file (its path, device and inode, size, and modification and
  change times): a plan search samples a workload's lengths for every combination it checks,
  and parsing a run's metrics.jsonl of 20k lengths took 2-12 ms each time."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"lengths file {path!r} does not exist")
  st = os.stat(path)
  return _load_lengths(path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


@functools.lru_cache(maxsize=32)
def _load_lengths(path: str, version: tuple) -> np.ndarray:
  """load_lengths of one version of the file (`version`: the cache's key, from os.stat)."""
  del version
  ext = os.path.splitext(path)[1].lower()
  if ext == ".npy":
    try:  # (an empty or cut file was numpy's EOFError or "pickled data" traceback)
      out = np.load(path)
    except (OSError, ValueError, EOFError) as e:
      raise ValueError(f"lengths file {path!r}: not a readable .npy array ({e})") from None
  elif ext == ".txt":
    with open(path) as f:
      words = f.read().split()
    try:  # (a header line was "could not convert string to float: 'length'", naming no file)
      out = np.array([float(x) for x in words])
    except ValueError:
      bad = next(x for x in words if not _is_number(x))
      raise ValueError(f"lengths file {path!r}: {bad[:40]!r} is not a number; expected one "
                       "length per line") from None
  elif ext == ".json":
    try:
      with open(path, encoding="utf-8") as f:
        obj = wd.load_json(f)
    except ValueError as e:  # JSONDecodeError, not UTF-8, a key given twice
      raise ValueError(f"lengths file {path!r}: not valid JSON ({e})") from None
    out = _from_json_obj(obj, path)
  elif ext == ".jsonl":
    out = _from_jsonl(path)
  else:
    raise ValueError(f"lengths file {path!r}: unknown extension {ext!r}; expected .npy, .txt, "
                     ".json or .jsonl")
  out = np.asarray(out, dtype=np.float64).ravel()
  if out.size == 0:
    raise ValueError(f"lengths file {path!r} holds no lengths")
  if not np.all(np.isfinite(out)) or np.any(out < 1) or np.any(out != np.round(out)):
    raise ValueError(f"lengths file {path!r}: lengths must be integers >= 1")
  out = out.astype(np.int64)
  out.flags.writeable = False  # shared by every caller of this version of the file
  return out


def _is_number(word: str) -> bool:
  try:
    float(word)
  except ValueError:
    return False
  return True


def _from_json_obj(obj, path: str) -> np.ndarray:
  if isinstance(obj, list):
    return np.asarray(obj)
  if isinstance(obj, dict):
    if "bins" in obj and "counts" in obj:
      # Counts read as numbers first: as int64 a fraction was cut silently (2.5 -> 2), and a
      # normalised histogram (frequencies summing to 1) became all zeros, "holds no lengths".
      bins, counts = np.asarray(obj["bins"]), np.asarray(obj["counts"], dtype=np.float64)
      if (bins.shape != counts.shape or not np.all(np.isfinite(counts)) or np.any(counts < 0)
          or np.any(counts != np.round(counts))):
        raise ValueError(f"{path}: histogram 'bins' and 'counts' must have equal length and "
                         "counts must be whole numbers of samples >= 0 (not frequencies)")
      return np.repeat(bins, counts.astype(np.int64))
    for k in PER_SAMPLE_KEYS:
      if k in obj:
        return np.asarray(obj[k])
  raise ValueError(f"{path}: expected a list of lengths, a {{'bins', 'counts'}} histogram or "
                   f"one of the keys {PER_SAMPLE_KEYS}")


def _from_jsonl(path: str) -> np.ndarray:
  lists, aggregate_only = [], False
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: malformed JSON line ({e.msg})") from None
      if not isinstance(rec, dict):  # (a bare number or list was a TypeError, no line named)
        raise ValueError(f"{path}:{n}: expected one JSON object per line, got "
                         f"{type(rec).__name__}")
      key = next((k for k in PER_SAMPLE_KEYS if k in rec), None)
      if key is not None:
        lists.append(np.asarray(rec[key]))
      elif "response_length/mean" in rec:
        aggregate_only = True
  if not lists:
    hint = (" It records only aggregates (response_length/mean, /max, /clip_ratio), which do not "
            "give a histogram; record per-sample lengths under one of the keys, or pass a "
            ".json/.npy lengths file." if aggregate_only else "")
    raise ValueError(f"{path}: no per-sample lengths under any of {PER_SAMPLE_KEYS}.{hint}")
  return np.concatenate(lists)


@dataclasses.dataclass(frozen=True)
class LengthSpec:
  """A response-length distribution (see module docstring for the kinds)."""
  kind: str = "lognormal"
  max_len: int = 1024  # generation limit (max_new_tokens): every length is clipped to it
  min_len: int = 1
  median: float = 256.0  # lognormal
  sigma: float = 0.8  # lognormal
  alpha: float = 1.5  # pareto tail index (smaller = heavier tail)
  value: int = 0  # constant
  path: str = ""  # empirical

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"lengths.kind={self.kind!r}; expected one of {KINDS}")
    if self.min_len < 1 or self.max_len < self.min_len:
      raise ValueError(f"lengths: need 1 <= min_len={self.min_len} <= max_len={self.max_len}")
    if self.kind == "lognormal" and not (self.median > 0 and math.isfinite(self.median) and
                                         self.sigma > 0 and math.isfinite(self.sigma)):
      raise ValueError(f"lengths: lognormal needs median={self.median} > 0 and sigma="
                       f"{self.sigma} > 0, both finite")
    if self.kind == "pareto" and not self.alpha > 0:
      raise ValueError(f"lengths: pareto needs alpha={self.alpha} > 0")
    if self.kind == "constant" and not self.min_len <= self.value <= self.max_len:
      raise ValueError(f"lengths: constant value={self.value} must be in [min_len, max_len]")
    if self.kind == "empirical" and not self.path:
      raise ValueError("lengths: kind='empirical' needs a path")
    if self.path and self.kind != "empirical":  # the file was ignored, without a word
      raise ValueError(f"lengths: path={self.path!r} is read only with kind='empirical' "
                       f"(kind={self.kind!r} draws its own lengths); set kind='empirical' to "
                       "replay the file, or leave path empty")

  def with_max_len(self, max_len: int) -> "LengthSpec":
    return dataclasses.replace(self, max_len=max_len)

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` lengths, int64 [n]."""
    if self.kind == "lognormal":
      raw = rng.lognormal(math.log(self.median), self.sigma, size=n)
    elif self.kind == "pareto":
      raw = self.min_len * (1.0 + rng.pareto(self.alpha, size=n))
    elif self.kind == "uniform":
      raw = rng.integers(self.min_len, self.max_len + 1, size=n)
    elif self.kind == "constant":
      raw = np.full(n, self.value)
    else:
      raw = rng.choice(load_lengths(self.path), size=n, replace=True)
    return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)

  def describe(self) -> str:
    if self.kind == "lognormal":
      body = f"median={self.median:g}, sigma={self.sigma:g}"
    elif self.kind == "pareto":
      body = f"alpha={self.alpha:g}"
    elif self.kind == "constant":
      body = f"value={self.value}"
    elif self.kind == "empirical":
      body = f"path={self.path}"
    else:
      body = ""
    return f"{self.kind}({body}{', ' if body else ''}clip [{self.min_len}, {self.max_len}])"


def summarize(lengths: np.ndarray, max_len: Optional[int] = None) -> dict:
  """Mean, percentiles and the fraction that hit the limit, for reports."""
  x = np.asarray(lengths)
  out = {"n": int(x.size), "mean": float(x.mean()), "p50": float(np.percentile(x, 50)),
         "p90": float(np.percentile(x, 90)), "p99": float(np.percentile(x, 99)),
         "max": int(x.max())}
  if max_len is not None:
    out["clip_frac"] = float(np.mean(x >= max_len))
  return out
