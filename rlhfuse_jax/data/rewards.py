"""Verifiable reward functions: Python scorers of generated responses against a known target.

For `reward.kind='function'` the trainer scores a batch with one call
`fn(records, response_ids, response_lengths, tokenizer) -> rewards [B] float32` (the
registered verifiers and format rewards score in [0, 1]; a function of your own may return any
finite number, a penalty included):

  records: the B prompt records; each holds its answer under 'target' (text).
  response_ids: generated ids after the prompt.  # [B, T] int
  response_lengths: how many leading ids of each row were generated, counting the EOS token
    if one was emitted (ids past it are padding).  # [B] int

A response is its ids up to and including the first EOS (or all of its ids if it never stopped);
the target is the tokenised 'target' followed by EOS, so stopping at the right place is part of
the answer.

Per-sample text rewards `fn(response: str, answer: str | None, record) -> float` (the math
verifiers and format rewards of data/verifiers.py, or a user's function named by import path,
`"my_pkg.rewards:score"`) become batch functions through `per_sample`, which decodes each
response up to its EOS and names the function and the sample (index and `file:line`) in any
error. A text function that names a parameter `num_tokens` also gets the response's length in
tokens (NUM_TOKENS: a length penalty such as DAPO's overlong shaping) unless a functools.partial
bound it; the others are called with the three arguments alone. `resolve_reward_function` maps
config.reward.function to a batch function.
"""
from __future__ import annotations

import collections.abc
import copy
import decimal
import difflib
import functools
import importlib
import inspect
import numbers
import os
import pkgutil
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from rlhfuse_jax.data import verifiers
from rlhfuse_jax.data.prompts import where as _where
from rlhfuse_jax.data.tokenizer import Tokenizer

RewardFn = Callable[[Sequence[Mapping[str, Any]], np.ndarray, np.ndarray, Tokenizer], np.ndarray]


def response_extent(response_ids: np.ndarray, response_lengths: np.ndarray,
                    eos_id: Union[int, Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
  """(length through the first EOS, whether an EOS was emitted) per row.  # [B], [B]
  `eos_id`: the id, or every id, that ends a response (a tokenizer's `stop_ids`)."""
  ids = np.asarray(response_ids)  # [B, T]
  lengths = np.asarray(response_lengths).astype(np.int64)  # [B]
  if ids.ndim != 2 or lengths.shape != ids.shape[:1]:
    raise ValueError(f"response_ids {ids.shape} must be [B, T] and response_lengths "
                     f"{lengths.shape} must be [B]")
  if np.any(lengths < 0) or np.any(lengths > ids.shape[1]):
    raise ValueError(f"response_lengths must lie in [0, T={ids.shape[1]}], got "
                     f"[{lengths.min()}, {lengths.max()}]")
  valid = np.arange(ids.shape[1])[None, :] < lengths[:, None]  # [B, T]
  is_eos = np.isin(ids, np.asarray(eos_id, np.int64)) & valid  # [B, T]
  stopped = is_eos.any(axis=1)  # [B]
  return np.where(stopped, is_eos.argmax(axis=1) + 1, lengths), stopped


def target_ids(records: Sequence[Mapping[str, Any]], tokenizer: Tokenizer) -> list[list[int]]:
  """Tokenised 'target' of each record, EOS appended."""
  for i, r in enumerate(records):
    if not isinstance(r.get("target"), str):
      raise ValueError(f"record {i}{_where(r)} needs a string 'target' for a verifiable reward, "
                       f"got {type(r.get('target')).__name__}")
  return [ids + [tokenizer.eos_id]
          for ids in tokenizer.encode_batch([r["target"] for r in records], add_bos=False)]


def _padded(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
  width = max(1, max(len(s) for s in seqs))
  out = np.full((len(seqs), width), -1, dtype=np.int64)  # [B, M]; -1 matches no token
  for row, s in enumerate(seqs):
    out[row, :len(s)] = s
  return out, np.array([len(s) for s in seqs], dtype=np.int64)


def target_match(records, response_ids, response_lengths, tokenizer) -> np.ndarray:
  """Partial credit: (# positions where response and target agree) / max(their lengths).

  Dense enough for RL from scratch: each right token earns a share, and a response that stops too
  early or runs on past the target is charged through the denominator. 1.0 exactly for the
  target; anything else scores less.
  """
  ids = np.array(response_ids)  # [B, T], a copy
  rlen, stopped = response_extent(ids, response_lengths, tokenizer.stop_ids)  # [B]
  # A response may stop on any stop id (Qwen's <|endoftext|> beside <|im_end|>); the target
  # ends in eos_id, so the stop counts as that.
  ends = np.flatnonzero(stopped)
  ids[ends, rlen[ends] - 1] = tokenizer.eos_id
  tgt, tlen = _padded(target_ids(records, tokenizer))  # [B, M], [B]
  k = min(ids.shape[1], tgt.shape[1])
  cols = np.arange(k)[None, :]  # [1, K]
  match = (ids[:, :k] == tgt[:, :k]) & (cols < rlen[:, None]) & (cols < tlen[:, None])  # [B, K]
  return (match.sum(axis=1) / np.maximum(rlen, tlen)).astype(np.float32)


def length_match(records, response_ids, response_lengths, tokenizer) -> np.ndarray:
  """min(len, target len) / max(len, target len), content ignored (lengths count the EOS).

  Trains a policy to reproduce the targets' length distribution, e.g. a long tail for the
  fusion benchmarks, faster than it would learn the content.
  """
  rlen, _ = response_extent(response_ids, response_lengths, tokenizer.stop_ids)  # [B]
  tlen = np.array([len(t) for t in target_ids(records, tokenizer)], dtype=np.int64)  # [B]
  return (np.minimum(rlen, tlen) / np.maximum(np.maximum(rlen, tlen), 1)).astype(np.float32)


def exact_match(records, response_ids, response_lengths, tokenizer) -> np.ndarray:
  """1.0 if the response stopped and its decoded text equals the target (whitespace-stripped).

  Compares text, not ids, so it also holds for BPE vocabularies where a target tokenised on its
  own may split differently from the generated ids.
  """
  ids = np.asarray(response_ids)  # [B, T]
  rlen, stopped = response_extent(ids, response_lengths, tokenizer.stop_ids)  # [B]
  out = np.zeros((ids.shape[0],), dtype=np.float32)
  for b, r in enumerate(records):
    if not isinstance(r.get("target"), str):
      raise ValueError(f"record {b}{_where(r)} needs a string 'target' for a verifiable reward")
    answer = ids[b, :rlen[b] - 1]  # [len]
    # decode drops ids beyond the tokenizer's vocabulary (a model's embedding may be padded
    # larger), so such ids are checked here; special tokens are kept in the text for the same
    # reason: a stray PAD or BOS inside the answer must not vanish from it.
    if stopped[b] and np.all((answer >= 0) & (answer < tokenizer.vocab_size)):
      text = tokenizer.decode(answer.tolist(), skip_special_tokens=False)
      out[b] = float(text.strip() == r["target"].strip())
  return out


class RewardFunctionError(ValueError):
  """A reward function failed or returned a bad value; the message names it and the sample."""
  names_function = True  # inference/scoring.Rewards passes it on without wrapping it again


def decode_responses(response_ids: np.ndarray, response_lengths: np.ndarray,
                     tokenizer: Tokenizer) -> list[str]:
  """Each response's text, up to (without) its first EOS, special tokens skipped.

  Ids outside the tokenizer's vocabulary (a model's embedding may be padded larger) cannot be
  decoded, and special tokens (`Tokenizer.special_ids`: Qwen's <|im_start|>, reserved ids) are
  dropped by decoding; each becomes U+FFFD between the decoded pieces around it, so that
  dropping it can never join the pieces into a different answer ('7', junk, '2' is not '72': a
  policy could otherwise write a number its verifier reads with a special token inside).
  """
  ids = np.asarray(response_ids)  # [B, T]
  rlen, stopped = response_extent(ids, response_lengths, tokenizer.stop_ids)  # [B]
  texts, special = [], tokenizer.special_ids
  for b in range(ids.shape[0]):
    row = ids[b, :rlen[b] - int(stopped[b])].tolist()
    pieces, current = [], []
    for i in row:
      if 0 <= i < tokenizer.vocab_size and i not in special:
        current.append(i)
      else:
        pieces.append(current)
        current = []
    pieces.append(current)
    texts.append("\ufffd".join(tokenizer.decode(p) for p in pieces))
  return texts


TextRewardFn = Callable[[str, Optional[str], Mapping[str, Any]], Any]

# The optional keyword a text reward function may take: the response's length in tokens, its
# generated ids through the first EOS, the EOS counted (what response_extent gives; the text
# the function reads stops before the EOS). Passed only to a function whose signature names it
# (a parameter, not **kwargs), so the three-argument functions are called as before; not to a
# functools.partial that binds it (the user's value stays).
NUM_TOKENS = "num_tokens"


def takes_num_tokens(fn: Callable) -> bool:
  """Whether `fn` names a parameter NUM_TOKENS that a keyword can fill and that its user has
  not bound (False for a callable whose signature Python cannot read). A
  functools.partial(fn, num_tokens=...) keeps the value bound there: it is not passed again."""
  try:
    param = inspect.signature(fn).parameters.get(NUM_TOKENS)
  except (TypeError, ValueError):
    return False
  return (param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                               inspect.Parameter.KEYWORD_ONLY)
          and not _binds_num_tokens(fn))


def _binds_num_tokens(fn: Callable) -> bool:
  """Whether a functools.partial in `fn` (through decorators' __wrapped__, as
  inspect.signature reads them) binds NUM_TOKENS: its signature still names the keyword, with
  the bound value as its default, and a call's keyword would replace that value."""
  fn = inspect.unwrap(fn)
  while isinstance(fn, functools.partial):
    if NUM_TOKENS in fn.keywords:
      return True
    fn = inspect.unwrap(fn.func)
  return False


def _short(text: Any, limit: int = 120) -> Any:
  """`text` cut to `limit` characters; None stays None and anything else is its str (an
  answer column of numbers, a reward function's odd return value)."""
  if text is None:
    return None
  text = text if isinstance(text, str) else str(text)
  return text if len(text) <= limit else text[:limit] + "..."


def _samples(records, texts: Sequence[str]) -> tuple[list, list]:
  """(each response's record, {} without records; each record's answer, its 'target').

  Each a copy: the records are the prompt pool's own, and a function that changed one (an
  answer "normalised" in place) changed it for every later draw, where a resumed run, which
  reads the file again, had it unchanged: the two runs scored differently. One copy per
  record (deepcopy's shared memo): a prompt's samples (rollout.samples_per_prompt rows holding
  the same record) share it, as they shared the record, so a function that groups them by
  identity (`rec is records[i - 1]`, id()) still finds its groups (each row had a copy of its
  own: every sample a group of one)."""
  memo: dict = {}
  recs = [copy.deepcopy(records[b], memo) if records is not None else {}
          for b in range(len(texts))]
  return recs, [r.get("target") for r in recs]


def _sample(b: int, record: Mapping[str, Any], answer: Any, text: str) -> str:
  """How an error names a sample: its index, its record's file:line, answer and response."""
  return (f"sample {b}{_where(record)} (answer {_short(answer)!r}, response "
          f"{_short(text)!r})")


# Rewards are float32 on their way to the advantages: a finite float64 beyond this overflows.
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_RANGE = f"(float32: magnitude at most {FLOAT32_MAX:.3g})"


def _as_float32(value: numbers.Real) -> np.float32:
  """`value` as a float32; inf where it lies outside float32's range (an int too large for
  any float included)."""
  try:
    with np.errstate(over="ignore"):
      return np.float32(value)
  except OverflowError:
    return np.float32(np.inf if value > 0 else -np.inf)


def _token_counts(response_ids: np.ndarray, response_lengths: np.ndarray,
                  tokenizer: Tokenizer) -> list[int]:
  """Each response's length in tokens (NUM_TOKENS): through its first EOS, the EOS counted."""
  return [int(n) for n in response_extent(response_ids, response_lengths, tokenizer.stop_ids)[0]]


def per_sample(fn: TextRewardFn, name: str, stat: bool = False) -> RewardFn:
  """A batch reward function that calls `fn(response, answer, record)` per sample.

  `answer` is record['target'] (the dataset's answer column; None when the row has none); a
  function that names a parameter `num_tokens` gets the response's length in tokens there
  (NUM_TOKENS, an int). An exception or a value that is not a finite real number raises
  RewardFunctionError naming
  `name`, the sample's index in the batch and its record's file:line, its answer and the start
  of its response. `stat`: a statistic (config.reward.stats), named so; NaN (or None) passes,
  its "no value for this sample".
  """
  what = "statistic" if stat else "reward function"
  with_tokens = takes_num_tokens(fn)

  def batch(records, response_ids, response_lengths, tokenizer) -> np.ndarray:
    texts = decode_responses(response_ids, response_lengths, tokenizer)
    counts = _token_counts(response_ids, response_lengths, tokenizer) if with_tokens else None
    out = np.zeros((len(texts),), np.float32)
    for b, (text, record, answer) in enumerate(zip(texts, *_samples(records, texts))):
      sample = _sample(b, record, answer, text)
      try:
        value = (fn(text, answer, record, **{NUM_TOKENS: counts[b]}) if with_tokens else
                 fn(text, answer, record))
      except Exception as e:  # noqa: BLE001 re-raised with the function and the sample named
        raise RewardFunctionError(f"{what} {name!r} failed on {sample}: "
                                  f"{type(e).__name__}: {e}") from e
      # A 0-d array (np.array(0.5), a jnp scalar: what reward code computed with numpy or jax
      # returns) is its one number, as a Python bool, int or float.
      if hasattr(value, "__array__") and np.shape(value) == ():
        value = np.asarray(value).item()
      if stat and value is None:  # a statistic's "no value", as a batched one's None reads
        value = float("nan")
      if isinstance(value, decimal.Decimal):  # (no numbers.Real; a batched function's pass)
        value = float(value) if not value.is_snan() else float("nan")
      number = _as_float32(value) if isinstance(value, numbers.Real) else None
      if number is None or not (np.isfinite(number) or stat and np.isnan(number)):
        raise RewardFunctionError(f"{what} {name!r} returned {value!r:.200} for "
                                  f"{sample}; expected a finite number {FLOAT32_RANGE}")
      out[b] = number
    return out
  batch.__name__ = f"per_sample({name})"
  return batch


def per_batch(fn: Callable, name: str, stat: bool = False) -> RewardFn:
  """A batch reward function that calls `fn(responses, answers, records)` once per batch (a
  user function marked `fn.batched = True`: one that batches its own work, a verifier pool or
  a reward server): lists of the decoded responses, each record's 'target' (None where a row
  has none) and the records (and, to a function that names a parameter `num_tokens`, the
  list of the responses' lengths in tokens, NUM_TOKENS); it returns one finite number per
  response. An exception, a
  result of another length or a non-finite value raises RewardFunctionError naming `name` (and
  the first bad sample's index, file:line, answer and response); `stat`: as per_sample's."""
  what = "statistic" if stat else "reward function"
  with_tokens = takes_num_tokens(fn)

  def batch(records, response_ids, response_lengths, tokenizer) -> np.ndarray:
    texts = decode_responses(response_ids, response_lengths, tokenizer)
    recs, answers = _samples(records, texts)
    try:
      values = (fn(texts, answers, recs, **{NUM_TOKENS: _token_counts(
          response_ids, response_lengths, tokenizer)}) if with_tokens else
                fn(texts, answers, recs))
      if isinstance(values, collections.abc.Iterator):  # concurrent.futures' Executor.map
        values = list(values)  # (it raises a worker's exception here)
    except Exception as e:  # noqa: BLE001 re-raised with the function named
      raise RewardFunctionError(f"{what} {name!r} (batched) failed on a batch of "
                                f"{len(texts)} responses: {type(e).__name__}: {e}") from e
    # A None (a forgotten return on some path) or a text ("0.5") among the values is refused
    # as per_sample refuses it: numpy read None as NaN (the error then named nan) and took the
    # text's number. A statistic's None is its "no value", NaN.
    # (an array of texts or objects too: np.array(["0.5", ...]) passed, read as numbers)
    each = (values.tolist() if isinstance(values, np.ndarray) and values.ndim == 1 and
            values.dtype.kind in "OUS" else values)
    if not isinstance(each, np.ndarray) and isinstance(each, collections.abc.Sequence):
      for b, v in enumerate(each[:len(texts)]):
        if v is None and not stat or isinstance(v, (str, bytes)):
          raise RewardFunctionError(
              f"{what} {name!r} (batched) returned {v!r:.200} for "
              f"{_sample(b, recs[b], answers[b], texts[b])}; expected one number per response")
    try:
      given = np.asarray(values, np.float64)
    except (TypeError, ValueError, OverflowError) as e:
      raise RewardFunctionError(f"{what} {name!r} (batched) returned {_short(values)!r}"
                                f"; expected {len(texts)} numbers ({e})") from None
    if given.shape != (len(texts),):
      raise RewardFunctionError(f"{what} {name!r} (batched) returned shape "
                                f"{given.shape}; expected one number per response, "
                                f"({len(texts)},)")
    with np.errstate(over="ignore"):
      out = given.astype(np.float32)
    bad = np.flatnonzero(np.isinf(out) if stat else ~np.isfinite(out))
    if bad.size:
      b = int(bad[0])
      raise RewardFunctionError(
          f"{what} {name!r} (batched) returned {given[b]} for "
          f"{_sample(b, recs[b], answers[b], texts[b])} and {bad.size - 1} more non-finite; "
          f"expected finite numbers {FLOAT32_RANGE}")
    return out
  batch.__name__ = f"per_batch({name})"
  return batch


def import_function(spec: str) -> Callable:
  """The callable that `"package.module:attribute"` names (the attribute may be dotted)."""
  module_name, _, attr = spec.partition(":")
  if not module_name or not attr:
    raise ValueError(f"reward function {spec!r}: expected 'package.module:function'")
  if module_name.endswith(".py") or "/" in module_name:  # a file where the module goes
    stem = module_name[:-3] if module_name.endswith(".py") else module_name
    where, module = (os.path.split(stem) if os.path.isabs(stem) else
                     ("the directory above it", stem.strip("./").replace("/", ".")))
    raise ValueError(f"reward function {spec!r}: {module_name!r} is a file path; name the "
                     f"module by import path, '{module}:{attr}', with {where} on PYTHONPATH")
  try:
    node = importlib.import_module(module_name)
  except Exception as e:  # noqa: BLE001 any import failure (missing module, its own error)
    raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r} "
                     f"({type(e).__name__}: {e}){_import_hint(e, module_name, attr)}") from e
  walked = []
  for part in attr.split("."):
    if not hasattr(node, part):
      names = [n for n in dir(node) if not n.startswith("_") and callable(getattr(node, n))]
      close = difflib.get_close_matches(part, names, n=1)
      hint = f"; did you mean '{module_name}:{'.'.join(walked + close)}'?" if close else ""
      raise ValueError(f"reward function {spec!r}: module {module_name!r} has no attribute "
                       f"{attr!r}{hint}")
    node = getattr(node, part)
    walked.append(part)
  if not callable(node):
    raise ValueError(f"reward function {spec!r}: {attr!r} is not callable (its type is "
                     f"{type(node).__name__})")
  return node


def _import_hint(e: Exception, module_name: str, attr: str) -> str:
  """What to fix when `module_name` did not import: a module the path names that is missing (a
  typo in it, with the closest module its package has, or a directory off PYTHONPATH), or a
  module that was found but failed in its own code (an import of its own: not PYTHONPATH)."""
  missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
  parts = module_name.split(".")
  if missing not in [".".join(parts[:i]) for i in range(1, len(parts) + 1)]:
    return "; the module was found: the error is in its own code or imports"
  if missing == parts[0]:
    return "; is its directory on PYTHONPATH?"
  parent = missing.rpartition(".")[0]
  try:
    package = importlib.import_module(parent)
  except Exception:  # noqa: BLE001 no hint rather than a second error
    return ""
  if not hasattr(package, "__path__"):  # "'os' is not a package", as the error says
    return ""
  siblings = [m.name for m in pkgutil.iter_modules(package.__path__)]
  close = difflib.get_close_matches(missing.rpartition(".")[2], siblings, n=1)
  if not close:
    return f"; package {parent!r} has no module {missing.rpartition('.')[2]!r}"
  fixed = ".".join([parent, close[0]] + parts[len(missing.split(".")):])
  return f"; did you mean '{fixed}:{attr}'?"


def _check_arguments(fn: Callable, spec: str, batched: bool = False) -> None:
  """A ValueError now when `fn` cannot be called as fn(response, answer, record) (or, batched,
  fn(responses, answers, records)): it failed at the first reward, after the models were built
  and the first batch generated. A callable whose signature Python cannot read (a C function)
  is left to that first call."""
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return
  try:
    signature.bind("response", "answer", {"record": 1},
                   **({NUM_TOKENS: 1} if takes_num_tokens(fn) else {}))
  except TypeError as e:
    args = "(responses, answers, records)" if batched else "(response, answer, record)"
    raise ValueError(f"reward function {spec!r}: its signature {signature} cannot take the "
                     f"three arguments it is called with, {args} ({e}); "
                     "one it does not need can be a `*_` or a default") from None


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "target_match": target_match,
    "length_match": length_match,
    "exact_match": exact_match,
    **{name: per_sample(fn, name) for name, fn in verifiers.VERIFIERS.items()},
}
# Registered functions that score the response against the whole target, EOS included: full
# marks need rollout.max_new_tokens >= the target's length + 1.
WHOLE_TARGET = frozenset({"target_match", "length_match", "exact_match"})
# Registered functions that read each record's answer ('target'): a dataset used with them must
# have one in every row.
NEEDS_ANSWER = WHOLE_TARGET | verifiers.NEEDS_ANSWER


def marked_batched(fn: Callable) -> bool:
  """Whether `fn` is marked `batched = True`: on itself, else on the function a
  functools.partial wraps (a partial has no attributes of its function: a batched function's
  partial would be called per sample, each response's characters read as the batch)."""
  while True:
    marked = getattr(fn, "batched", None)
    if marked is not None or not isinstance(fn, functools.partial):
      return marked is True
    fn = fn.func


def get_reward_function(name: str, stat: bool = False) -> RewardFn:
  """The reward function registered as `name`, or a user function by import path
  ('package.module:function': per sample, see `per_sample`, or once per batch when the function
  has `batched = True`, see `per_batch`); the error lists the known names. `stat`: a statistic
  (config.reward.stats), which may return NaN for a sample it has no value for."""
  if stat and name in verifiers.VERIFIERS:  # its errors say "statistic", not "reward function"
    return per_sample(verifiers.VERIFIERS[name], name, stat)
  if name in REWARD_FUNCTIONS:
    return REWARD_FUNCTIONS[name]
  if ":" in name:
    fn = import_function(name)
    batched = marked_batched(fn)
    _check_arguments(fn, name, batched)
    return per_batch(fn, name, stat) if batched else per_sample(fn, name, stat)
  module, _, attr = name.rpartition(".")
  close = difflib.get_close_matches(name, list(REWARD_FUNCTIONS), n=1)
  hint = (f"; did you mean {module + ':' + attr!r} (a colon before the function)?"
          if module and attr else f"; did you mean {close[0]!r}?" if close else "")
  raise ValueError(f"unknown reward function {name!r}; known: {sorted(REWARD_FUNCTIONS)}, or a "
                   f"function by import path 'package.module:function'{hint}")
