"""Verifiable reward functions: Python scorers of generated responses against a known target.

For `reward.kind='function'` the trainer scores a batch with one call
`fn(records, response_ids, response_lengths, tokenizer) -> rewards [B] float32 in [0, 1]`:

  records: the B prompt records; each holds its answer under 'target' (text).
  response_ids: generated ids after the prompt.  # [B, T] int
  response_lengths: how many leading ids of each row were generated, counting the EOS token
    if one was emitted (ids past it are padding).  # [B] int

A response is its ids up to and including the first EOS (or all of its ids if it never stopped);
the target is the tokenised 'target' followed by EOS, so stopping at the right place is part of
the answer.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rlhfuse_jax.data.prompts import where as _where
from rlhfuse_jax.data.tokenizer import Tokenizer

RewardFn = Callable[[Sequence[Mapping[str, Any]], np.ndarray, np.ndarray, Tokenizer], np.ndarray]


def response_extent(response_ids: np.ndarray, response_lengths: np.ndarray,
                    eos_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(length through the first EOS, whether an EOS was emitted) per row.  # [B], [B]"""
  ids = np.asarray(response_ids)  # [B, T]
  lengths = np.asarray(response_lengths).astype(np.int64)  # [B]
  if ids.ndim != 2 or lengths.shape != ids.shape[:1]:
    raise ValueError(f"response_ids {ids.shape} must be [B, T] and response_lengths "
                     f"{lengths.shape} must be [B]")
  if np.any(lengths < 0) or np.any(lengths > ids.shape[1]):
    raise ValueError(f"response_lengths must lie in [0, T={ids.shape[1]}], got "
                     f"[{lengths.min()}, {lengths.max()}]")
  valid = np.arange(ids.shape[1])[None, :] < lengths[:, None]  # [B, T]
  is_eos = (ids == eos_id) & valid  # [B, T]
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
  ids = np.asarray(response_ids)  # [B, T]
  rlen, _ = response_extent(ids, response_lengths, tokenizer.eos_id)  # [B]
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
  rlen, _ = response_extent(response_ids, response_lengths, tokenizer.eos_id)  # [B]
  tlen = np.array([len(t) for t in target_ids(records, tokenizer)], dtype=np.int64)  # [B]
  return (np.minimum(rlen, tlen) / np.maximum(np.maximum(rlen, tlen), 1)).astype(np.float32)


def exact_match(records, response_ids, response_lengths, tokenizer) -> np.ndarray:
  """1.0 if the response stopped and its decoded text equals the target (whitespace-stripped).

  Compares text, not ids, so it also holds for BPE vocabularies where a target tokenised on its
  own may split differently from the generated ids.
  """
  ids = np.asarray(response_ids)  # [B, T]
  rlen, stopped = response_extent(ids, response_lengths, tokenizer.eos_id)  # [B]
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


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "target_match": target_match,
    "length_match": length_match,
    "exact_match": exact_match,
}


def get_reward_function(name: str) -> RewardFn:
  """The reward function registered as `name`; the error lists the known names."""
  if name not in REWARD_FUNCTIONS:
    raise ValueError(f"unknown reward function {name!r}; known: {sorted(REWARD_FUNCTIONS)}")
  return REWARD_FUNCTIONS[name]
