"""Prompts: a JSONL loader and a resumable stream of padded prompt batches.

The stream is the concatenation of per-epoch permutations of the prompt pool, cut into global
batches of B. Epoch e's permutation depends only on (seed, e), so the position in the stream,
(epoch, index into that epoch's permutation), is the whole state: a run resumed from
`state_dict()` yields exactly the batches the uninterrupted run would have. A batch that crosses
an epoch boundary is completed from the next epoch, so every batch has B prompts (static shapes
for jit) and every prompt is seen once per epoch.

All prompts are tokenised when the dataset is built, so a prompt that does not fit fails at the
start of a run, not hours into it.
"""
from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from rlhfuse_jax.data.tokenizer import Tokenizer

# Key added to records read from JSONL so that later errors can point at the line.
SOURCE_KEY = "_source"
# Right padding only: every generator (generation/instances.check_prompts) and the training
# sequences read a prompt's tokens from column 0 with per-row lengths (models.llama's per-row
# cache offsets make a padding mask unnecessary). Left-padded prompts were offered here once and
# were overwritten with padding by the generators, silently.
_PADDINGS = ("right",)


def _check_padding(padding: str) -> None:
  if padding not in _PADDINGS:
    raise ValueError(f"padding={padding!r}: expected 'right' (every generator reads a prompt's "
                     "tokens from column 0, with its length)")


def jsonl_rows(path: str, example: str = "") -> Iterator[tuple[str, Any]]:
  """("path:line", parsed object) for every non-blank line of a JSONL file; a line that is not
  JSON raises ValueError naming path:line (`example`: text after "one object per line")."""
  # Read as bytes and decoded line by line (\n, \r\n or \r ends a line), so a line that is not
  # UTF-8 is named; a byte-order mark that some editors write first is read as nothing.
  with open(path, "rb") as f:
    data = f.read()
  if data.startswith(codecs.BOM_UTF8):
    data = data[len(codecs.BOM_UTF8):]
  for line_number, raw in enumerate(data.splitlines(), start=1):
    where = f"{path}:{line_number}"
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                       f"{e.start + 1}); expected a UTF-8 JSONL file (convert it, e.g. iconv "
                       f"-f latin1 -t utf-8)") from e
    if not line.strip():
      continue
    try:
      yield where, json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: invalid JSON ({e.msg}, column {e.colno}); expected one "
                       f"object per line{example}") from e
    except (ValueError, RecursionError) as e:  # an int over Python's 4300 digits, deep nesting
      raise ValueError(f"{where}: cannot read this JSON line ({type(e).__name__}: {e})") from e


def check_unicode(text: str, where_: str, field: str) -> str:
  """`text`, refused (naming `where_` and `field`) when it holds a lone surrogate: JSON's
  "\\ud800" escape without its pair reads as a str that no tokenizer can encode, which failed
  only when the text was tokenised (a target: inside the reward, mid-run, unnamed)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(f"{where_}: field '{field}' holds a lone surrogate {text[e.start]!r} at "
                     f"character {e.start + 1} (a \\u escape without its pair); expected "
                     "Unicode text") from None
  return text


def load_jsonl_prompts(path: str, field: str = "prompt") -> list[dict[str, Any]]:
  """Reads one JSON object per line; each must hold a string under `field`.

  Blank lines are skipped. Each returned record is the line's object plus
  `record["_source"] = "path:line"`. A malformed line raises ValueError naming `path:line` and
  what was expected.
  """
  records = []
  for where, record in jsonl_rows(path, f" like {{\"{field}\": \"...\"}}"):
    if not isinstance(record, dict):
      raise ValueError(f"{where}: expected a JSON object with a string field '{field}', got "
                       f"{type(record).__name__}")
    if field not in record:
      raise ValueError(f"{where}: missing field '{field}' (keys: {sorted(record)}); expected a "
                       "string")
    if not isinstance(record[field], str):
      raise ValueError(f"{where}: field '{field}' must be a string, got "
                       f"{type(record[field]).__name__}")
    if not record[field].strip():
      raise ValueError(f"{where}: field '{field}' is blank; expected the prompt's text")
    check_unicode(record[field], where, field)
    record.setdefault(SOURCE_KEY, where)
    records.append(record)
  if not records:
    raise ValueError(f"{path}: no prompts (the file is empty or blank)")
  return records


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  """One global batch of prompts.

  Attributes:
    records: the B prompt records (text and whatever the reward needs).
    indices: position of each record in the dataset's pool.  # [B] int64
    tokens: prompt ids padded with pad_id to a common width P.  # [B, P] int32
    lengths: number of real (non-pad) tokens of each prompt.  # [B] int32
  Real tokens start at column 0 (right padding, _PADDINGS).
  """
  records: list[dict[str, Any]]
  indices: np.ndarray
  tokens: np.ndarray
  lengths: np.ndarray

  @property
  def mask(self) -> np.ndarray:
    """True on real tokens.  # [B, P] bool"""
    cols = np.arange(self.tokens.shape[1])[None, :]
    return cols < self.lengths[:, None]


def pad_token_ids(ids: Sequence[Sequence[int]], width: int, pad_id: int,
                  padding: str = "right") -> tuple[np.ndarray, np.ndarray]:
  """Packs variable-length id lists into ([N, width] int32 tokens, [N] int32 lengths), each
  row's ids from column 0 (`padding` must be 'right', _PADDINGS)."""
  _check_padding(padding)
  tokens = np.full((len(ids), width), pad_id, dtype=np.int32)  # [N, width]
  lengths = np.zeros((len(ids),), dtype=np.int32)  # [N]
  for row, seq in enumerate(ids):
    n = len(seq)
    if n > width:
      raise ValueError(f"sequence {row} has {n} tokens, more than width={width}")
    lengths[row] = n
    if n:
      tokens[row, :n] = seq
  return tokens, lengths


# Prompts tokenised per call to the tokenizer: its encodings of a whole pool (the library's
# Encoding objects: tokens, offsets and masks besides the ids) took ~120 bytes a token at once,
# 3.7 GB for a 52 MB JSONL of 100k prompts; a chunk's ids go into the padded array at once.
ENCODE_CHUNK = 1024


def tokenize_prompts(records: Sequence[Mapping[str, Any]], tokenizer: Tokenizer,
                     max_prompt_len: int, *, field: str = "prompt", padding: str = "right",
                     add_bos: Optional[bool] = None) -> tuple[np.ndarray, np.ndarray]:
  """Tokenises `record[field]` of each record to ([N, max_prompt_len] int32, [N] int32 lengths).

  add_bos: None, the tokenizer's own setting; False for text a chat template rendered (the
  template writes BOS itself). A prompt longer than `max_prompt_len` tokens raises ValueError
  naming its index (and its `path:line` for records read from a file) and both lengths, with
  how many prompts are over it and the longest's length.
  """
  if max_prompt_len < 1:
    raise ValueError(f"max_prompt_len={max_prompt_len}: expected >= 1")
  _check_padding(padding)
  tokens = np.empty((len(records), max_prompt_len), dtype=np.int32)  # [N, P]
  lengths = np.empty((len(records),), dtype=np.int32)  # [N]
  first_over, num_over, longest = None, 0, 0
  for start in range(0, len(records), ENCODE_CHUNK):
    chunk = records[start:start + ENCODE_CHUNK]
    try:
      ids = tokenizer.encode_batch([r[field] for r in chunk], add_bos=add_bos)
    except Exception:  # the tokenizer's own error names neither the prompt nor its line
      for i, r in enumerate(chunk, start):
        try:
          tokenizer.encode_batch([r[field]], add_bos=add_bos)
        except Exception as one:  # pylint: disable=broad-except
          raise ValueError(f"prompt {i}{where(r)} cannot be tokenised ({one}); text starts "
                           f"{r[field][:60]!r}") from one
      raise
    for i, seq in enumerate(ids, start):
      n = len(seq)
      if n == 0:
        raise ValueError(f"prompt {i}{where(records[i])} encodes to zero tokens; a prompt needs "
                         "at least one token to condition generation")
      if n > max_prompt_len:
        first_over = i if first_over is None else first_over
        num_over, longest = num_over + 1, max(longest, n)
    # (an overlong prompt's row is left empty: the error below names it)
    rows = slice(start, start + len(chunk))
    tokens[rows], lengths[rows] = pad_token_ids(
        [seq if len(seq) <= max_prompt_len else () for seq in ids], max_prompt_len,
        tokenizer.pad_id, padding)
  if first_over is not None:
    record = records[first_over]
    n = len(tokenizer.encode(record[field], add_bos=add_bos))
    others = (f"; {num_over} of the {len(records)} prompts are longer, the longest "
              f"{longest} tokens" if num_over > 1 else "")
    raise ValueError(f"prompt {first_over}{where(record)} has {n} tokens, more than "
                     f"max_prompt_len={max_prompt_len}{others} (text starts "
                     f"{record[field][:60]!r}); raise max_prompt_len (config.data.max_prompt_len), "
                     "shorten the prompt, or leave such prompts out "
                     "(config.data.overlong_prompts='skip')")
  return tokens, lengths


def where(record: Mapping[str, Any]) -> str:
  """' (path:line)' of a record loaded from a prompts file, '' for one made in memory."""
  return f" ({record[SOURCE_KEY]})" if SOURCE_KEY in record else ""


def _fingerprint(texts: Sequence[str]) -> int:
  """A 31-bit hash of the pool, so resuming onto a different pool is caught (fits int32)."""
  h = hashlib.sha256()
  for t in texts:
    h.update(t.encode("utf-8"))
    h.update(b"\0")
  return int.from_bytes(h.digest()[:4], "little") & 0x7FFFFFFF


class PromptDataset:
  """Endless, seeded, resumable stream of `PromptBatch`es over a fixed pool of prompts."""

  def __init__(self, records: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, *,
               batch_size: int, max_prompt_len: int, seed: int = 0, shuffle: bool = True,
               padding: str = "right", field: str = "prompt", add_bos: Optional[bool] = None):
    """Tokenises the pool now (see `tokenize_prompts` for the errors).

    Args:
      records: prompt records, e.g. from `load_jsonl_prompts` or a task's `make_prompts`.
      tokenizer: turns `record[field]` into ids (BOS as the tokenizer decides).
      batch_size: B, prompts per global batch (may exceed the pool: the batch then spans epochs).
      max_prompt_len: P, width of the padded token array; longer prompts are an error.
      seed: the shuffling seed (epoch e uses permutation rng([seed, e])).
      shuffle: False streams the pool in file order every epoch.
      padding: 'right' (the only one: _PADDINGS).
      field: which key holds the prompt text.
      add_bos: passed to the tokenizer (None: its own setting; False for chat-rendered text).
    """
    if not records:
      raise ValueError("records is empty: a PromptDataset needs at least one prompt")
    if batch_size < 1:
      raise ValueError(f"batch_size={batch_size}: expected >= 1")
    _check_padding(padding)
    for i, r in enumerate(records):
      if not isinstance(r.get(field), str):
        raise ValueError(f"record {i}{where(r)}: field '{field}' must be a string, got "
                         f"{type(r.get(field)).__name__}")
    self.records = [dict(r) for r in records]
    self.batch_size = int(batch_size)
    self.max_prompt_len = int(max_prompt_len)
    self.seed = int(seed)
    self.shuffle = bool(shuffle)
    self._tokens, self._lengths = tokenize_prompts(  # [N, P], [N]
        self.records, tokenizer, max_prompt_len, field=field, padding=padding, add_bos=add_bos)
    self._fingerprint = _fingerprint([r[field] for r in self.records])
    self._epoch = 0
    self._index = 0
    self._order_epoch = -1
    self._order = np.arange(0)

  def __len__(self) -> int:
    """Number of prompts in the pool."""
    return len(self.records)

  @property
  def tokens(self) -> np.ndarray:
    """Every prompt's ids in pool order, padded.  # [N, P] int32"""
    return self._tokens

  @property
  def lengths(self) -> np.ndarray:
    """Every prompt's length in pool order.  # [N] int32"""
    return self._lengths

  @property
  def epoch(self) -> int:
    return self._epoch

  def _permutation(self, epoch: int) -> np.ndarray:
    if self._order_epoch != epoch:
      n = len(self.records)
      self._order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                     else np.arange(n))
      self._order_epoch = epoch
    return self._order

  def next_batch(self) -> PromptBatch:
    """The next B prompts of the stream; advances the state."""
    picked, count = [], 0
    while count < self.batch_size:
      order = self._permutation(self._epoch)
      take = min(self.batch_size - count, len(order) - self._index)
      picked.append(order[self._index:self._index + take])
      count += take
      self._index += take
      if self._index == len(order):
        self._epoch += 1
        self._index = 0
    indices = np.concatenate(picked).astype(np.int64)  # [B]
    return PromptBatch(records=[self.records[i] for i in indices], indices=indices,
                       tokens=self._tokens[indices], lengths=self._lengths[indices])

  def __iter__(self) -> Iterator[PromptBatch]:
    while True:
      yield self.next_batch()

  def state_dict(self) -> dict[str, int]:
    """The stream position plus what must match on resume; plain ints (JSON / orbax friendly)."""
    return {"epoch": self._epoch, "index": self._index, "seed": self.seed,
            "num_prompts": len(self.records), "fingerprint": self._fingerprint}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Continues from `state`; the pool and seed must be the ones the state was taken from."""
    missing = {"epoch", "index", "seed", "num_prompts", "fingerprint"} - set(state)
    if missing:
      raise ValueError(f"prompt dataset state lacks {sorted(missing)}")
    expected = {"seed": self.seed, "num_prompts": len(self.records),
                "fingerprint": self._fingerprint}
    for key, value in expected.items():
      if int(state[key]) != value:
        raise ValueError(f"prompt dataset state has {key}={int(state[key])} but this dataset has "
                         f"{key}={value}: resuming onto a different prompt pool or seed")
    epoch, index = int(state["epoch"]), int(state["index"])
    if epoch < 0 or not 0 <= index < len(self.records):
      raise ValueError(f"prompt dataset state epoch={epoch}, index={index}: expected epoch >= 0 "
                       f"and 0 <= index < {len(self.records)}")
    self._epoch, self._index = epoch, index
