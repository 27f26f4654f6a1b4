"""Prompt datasets from files: JSONL, JSON-array or parquet rows with a prompt and a ground-truth
answer, rendered through an optional chat template, split into training and held-out prompts.

A row's prompt sits under `prompt_key` and its answer under `answer_key`; a dotted key reads a
nested field (verl's parquet files keep the answer in `reward_model.ground_truth`). A key that
exists literally, dots included, wins over the nested reading. The prompt is a string or a list
of messages ({"role", "content"} with string values); the answer a string or a number (kept as
its text; an integral float such as 42.0 as '42'). Every record keeps the row's own fields and
gets three more (replacing row fields of those names):

  prompt     the row's prompt (a string or the messages), what the chat template renders
  target     the row's answer as text (absent when the row has none and none is required): what
             the verifiers and a user's reward function receive as the sample's answer
  _source    'path:line' (JSONL, 1-based lines), 'path:item i' (a JSON array, 0-based) or
             'path:row i' (parquet, 0-based rows), which every later error about the record names

`render_prompts` adds `_prompt_text` (PROMPT_TEXT_KEY), the text that is tokenised.
"""
from __future__ import annotations

import codecs
import decimal
import json
import os
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from rlhfuse_jax.data.chat import ChatTemplate, ChatTemplateError
from rlhfuse_jax.data.prompts import SOURCE_KEY, check_unicode, jsonl_rows, where

PROMPT_KEY = "prompt"
ANSWER_KEY = "target"
PROMPT_TEXT_KEY = "_prompt_text"
_MISSING = object()


def _first_bytes(path: str, n: int = 64) -> bytes:
  with open(path, "rb") as f:
    return f.read(n)


def _rows(path: str) -> Iterator[tuple[str, Any]]:
  """(where, row) for every row of a JSONL, JSON-array or parquet file: parquet by extension or
  by its magic bytes (a `.pq` file was read as text and refused as "not UTF-8"), a JSON array
  (what `json.dump(rows)` and many exports write) by its opening bracket."""
  head = _first_bytes(path)
  if path.endswith(".parquet") or head.startswith(b"PAR1"):
    try:
      import pyarrow as pa  # pylint: disable=import-outside-toplevel
      import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
    try:
      table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 pyarrow raises several types for a bad file
      raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    rows = table.to_pylist()
    # to_pylist widens float32 to a Python float (0.1 -> 0.10000000149011612): float16/32
    # fields, top-level or nested in structs (verl's reward_model.ground_truth), keep their
    # numpy scalars, so an answer reads back as written.
    def narrow(path, arr):
      if pa.types.is_struct(arr.type):
        for i in range(arr.type.num_fields):
          narrow(path + (arr.type.field(i).name,), arr.field(i))
      elif arr.type in (pa.float16(), pa.float32()):
        *parents, last = path
        for row, value in zip(rows, arr.to_numpy(zero_copy_only=False)):
          for part in parents:
            row = row.get(part) if isinstance(row, dict) else None
          if isinstance(row, dict) and row.get(last) is not None:
            row[last] = value
    for name in table.column_names:
      narrow((name,), table.column(name).combine_chunks())
    for i, row in enumerate(rows):
      yield f"{path}:row {i}", row
    return
  if head.startswith(b"\x1f\x8b"):  # read as text, it was "not UTF-8 ... iconv -f latin1"
    raise ValueError(f"{path}: a gzip-compressed file; expected JSONL, a JSON array or parquet "
                     "uncompressed (gunzip it first)")
  # (these too got "not UTF-8 ... iconv -f latin1", which would garble them)
  if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
    raise ValueError(f"{path}: UTF-16 text (its byte-order mark); expected UTF-8 (convert it, "
                     "e.g. iconv -f utf-16 -t utf-8)")
  # Arrow's file format (Feather v2) opens with its magic, its stream format (datasets'
  # *.arrow shards) with a continuation marker; Feather v1 with FEA1.
  if head.startswith((b"ARROW1", b"\xff\xff\xff\xff", b"FEA1")):
    raise ValueError(f"{path}: an Arrow/Feather file (e.g. a Hugging Face datasets save_to_disk "
                     "shard); expected JSONL, a JSON array or parquet (e.g. "
                     "datasets.load_from_disk(DIR)['train'].to_json(PATH))")
  if head.lstrip(codecs.BOM_UTF8 + b" \t\r\n").startswith(b"["):
    with open(path, "rb") as f:
      data = f.read()
    try:
      rows = json.loads(data.decode("utf-8-sig"))
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
      # and an int over Python's 4300 digits; RecursionError: deep nesting
      raise ValueError(f"{path}: starts like a JSON array but does not parse as one ({e}); "
                       "expected a JSON array of objects or one object per line (JSONL)") from e
    if isinstance(rows, list):  # else one JSONL line that is an array: refused row by row
      for i, row in enumerate(rows):
        yield f"{path}:item {i}", row
      return
  # A file of another format (a .csv, a .txt of prompts) is refused at its first line: say
  # which formats are read.
  rows = jsonl_rows(path, " (JSONL; a JSON array of objects or a parquet file also reads)")
  first = next(rows, None)
  if first is None:
    return
  columns = first[1]
  if (isinstance(columns, dict) and columns and
      all(isinstance(v, list) for v in columns.values()) and
      len({len(v) for v in columns.values()}) == 1 and len(next(iter(columns.values()))) > 1
      and not any(isinstance(x, dict) for v in columns.values() for x in v)):
    second = next(rows, None)  # (only for such a row: else line 1 is checked before line 2)
    if second is None:
      # One object of equal-length lists (a dict of columns, as json.dump(dataset.to_dict())
      # writes): read as one row, it was refused on its prompt, "message 0 is a str; expected
      # an object {"role": ..., "content": ...}", as if a list of chat messages were at fault.
      # (A list holding objects is a row's chat messages: that one row is read.)
      raise ValueError(
          f"{path}: one JSON object whose fields {sorted(columns)[:4]} are lists of "
          f"{len(next(iter(columns.values())))} values (column-oriented); expected one object "
          "per prompt: JSONL, a JSON array of objects or parquet (e.g. "
          "pandas.DataFrame(columns).to_json(path, orient='records', lines=True))")
    yield first
    yield second
  else:
    yield first
  yield from rows


def lookup(row: Mapping[str, Any], key: str) -> Any:
  """row[key], or the nested field a dotted key names; _MISSING when absent."""
  if key in row:
    return row[key]
  node: Any = row
  for part in key.split("."):
    if not isinstance(node, Mapping) or part not in node:
      return _MISSING
    node = node[part]
  return node


def check_prompt(prompt: Any, where_: str, key: str) -> Any:
  """A string that is not blank, or a non-empty list of {'role': str, 'content': str}
  messages."""
  if isinstance(prompt, str):
    if not prompt.strip():  # whitespace alone asks nothing either (it was trained on as is)
      what = "an empty string" if not prompt else f"blank ({prompt!r:.40})"
      raise ValueError(f"{where_}: field '{key}' is {what}; expected a prompt")
    return check_unicode(prompt, where_, key)
  if isinstance(prompt, (list, tuple)):
    if not prompt:
      raise ValueError(f"{where_}: field '{key}' is an empty list; expected at least one message")
    for i, m in enumerate(prompt):
      if not isinstance(m, Mapping):
        raise ValueError(f"{where_}: field '{key}' message {i} is a {type(m).__name__}; expected "
                         "an object {\"role\": ..., \"content\": ...}")
      for name in ("role", "content"):
        if not isinstance(m.get(name), str):
          raise ValueError(f"{where_}: field '{key}' message {i} needs a string '{name}', got "
                           f"{type(m.get(name)).__name__}")
        check_unicode(m[name], where_, f"{key}' message {i} '{name}")
    if not any(m["content"].strip() for m in prompt):  # as a blank string prompt is refused:
      # the rendered prompt was the template's headers alone
      raise ValueError(f"{where_}: field '{key}' has no message with content (every 'content' "
                       "is blank); expected a prompt")
    return [dict(m) for m in prompt]
  nested = ""
  if isinstance(prompt, Mapping):  # ({"prompt": {"text": ...}}: the dotted key was not said)
    inner = [f"'{key}.{k}'" for k, v in prompt.items() if isinstance(v, (str, list, tuple))]
    nested = (f" with fields {sorted(map(str, prompt))[:8]}"
              + (f"; a dotted config.data.prompt_key reads a nested field: {', '.join(inner[:4])}"
                 if inner else ""))
  raise ValueError(f"{where_}: field '{key}' must be a string or a list of messages, got "
                   f"{type(prompt).__name__}{nested}")


def _is_nan(x: Any) -> bool:
  return isinstance(x, (float, np.floating)) and bool(np.isnan(x))


def _answer_text(answer: Any, where_: str, key: str) -> str:
  if isinstance(answer, str):
    return check_unicode(answer, where_, key)
  if isinstance(answer, (int, np.integer)) and not isinstance(answer, bool):
    return str(int(answer))
  if isinstance(answer, (float, np.floating)):
    # A parquet column of numbers is float as soon as one is: 42 reads back as 42.0. Digits
    # are positional (str() writes 1e-05, whose final number reads as 5) and the shortest
    # that give back the value in its own precision (a float32 0.1 is '0.1').
    if not np.isfinite(answer):
      raise ValueError(f"{where_}: answer field '{key}' is {answer}; expected a finite number "
                       "(or none: a missing answer)")
    if float(answer).is_integer():
      return str(int(answer))
    return np.format_float_positional(answer, unique=True, trim="-")
  if isinstance(answer, decimal.Decimal):  # a parquet decimal column
    if not answer.is_finite():
      raise ValueError(f"{where_}: answer field '{key}' is {answer}; expected a finite number "
                       "(or none: a missing answer)")
    return format(answer.normalize(), "f")
  # A field under the default key is read whatever answer_key says: "leave answer_key unset"
  # left the run failing on it.
  fix = (f"leave config.data.answer_key unset and read record[{key!r}] there" if key != ANSWER_KEY
         else f"rename the field in the file, which the default config.data.answer_key={key!r} "
         "reads, and read it from the record there")
  raise ValueError(f"{where_}: answer field '{key}' must be a string or a number, got "
                   f"{type(answer).__name__} (a reward function of your own reads any field "
                   f"of the record itself: {fix})")


def load_records(path: str, prompt_key: str = PROMPT_KEY, answer_key: str = ANSWER_KEY, *,
                 require_answer: bool = False, check_answer_key: bool = True,
                 keys_of: str = "") -> list[dict[str, Any]]:
  """The rows of a JSONL, JSON-array or parquet file (_rows) as prompt records.

  require_answer: every row must have an answer (the run's reward verifies against it);
  otherwise a row without one simply has no 'target'. check_answer_key: an answer_key other
  than the default that no row has is refused (a misspelling; off for a held-out file, which
  a run without verification may hold without answers). keys_of: the file whose keys this one
  shares (a held-out file is read with the training file's): a missing field then says to
  rename it here, since changing the key would break that file. Errors name the file and the
  row; a line that is not JSON is reported before any row's missing field.
  """
  if keys_of:
    fix_prompt = fix_answer = (
        f"this file is read with the keys of {keys_of} (config.data.prompt_key={prompt_key!r}, "
        f"config.data.answer_key={answer_key!r}): give its rows the same field names, or, if "
        # (a preset's held-out file kept beside the user's prompts was said to need renaming)
        "it is not your held-out file (a preset's own, such as configs/ppo_hf.py's, is read "
        "unless replaced), point config.data.val_file at yours ('' for none)")
  else:
    fix_prompt = "set config.data.prompt_key to the field that holds the prompt"
    fix_answer = "set config.data.answer_key to the field that holds the ground truth"
  if os.path.isdir(path):  # "not found" sent the user looking for a path that is there
    raise ValueError(f"{path} is a directory; expected a JSONL or parquet file of prompts")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"prompts file not found: {path}")
  records = []
  # Every row is parsed before any is checked: a file that is not JSONL (or parquet) at all is
  # reported as such, whatever its first rows lack.
  for where_, row in list(_rows(path)):
    if not isinstance(row, Mapping):
      raise ValueError(f"{where_}: expected an object with a prompt field '{prompt_key}', got "
                       f"{type(row).__name__}")
    prompt = lookup(row, prompt_key)
    if prompt is None:
      raise ValueError(f"{where_}: prompt field '{prompt_key}' is null on this row (keys: "
                       f"{sorted(row)}); fill it in or drop the row"
                       f"{'' if keys_of else ', or ' + fix_prompt}")
    if prompt is _MISSING:
      raise ValueError(f"{where_}: missing prompt field '{prompt_key}' (keys: {sorted(row)}); "
                       f"{fix_prompt}")
    if not records:
      first_keys = sorted(row)
    record = dict(row)
    record[PROMPT_KEY] = check_prompt(prompt, where_, prompt_key)
    answer = lookup(row, answer_key)
    # A blank answer verifies nothing either: it passed here and stopped the run mid-training,
    # when its row was first drawn ("the answer '' holds no number").
    blank = require_answer and isinstance(answer, str) and not answer.strip()
    if answer is _MISSING or answer is None or _is_nan(answer) or blank:  # NaN: pandas' missing
      if require_answer and answer is not _MISSING:  # the field is there, without a value
        raise ValueError(f"{where_}: answer field '{answer_key}' is empty ({answer!r}) on this "
                         "row; every row needs an answer when the run's reward verifies "
                         "against it (fill it in or drop the row)")
      if require_answer:
        raise ValueError(f"{where_}: missing answer field '{answer_key}' (keys: {sorted(row)}), "
                         f"which the run's reward verifies against; {fix_answer}")
      record.pop(ANSWER_KEY, None)
    else:
      record[ANSWER_KEY] = _answer_text(answer, where_, answer_key)
    record[SOURCE_KEY] = where_
    records.append(record)
  if not records:
    raise ValueError(f"{path}: no prompts (the file is empty or blank)")
  if check_answer_key and answer_key != ANSWER_KEY and not any(ANSWER_KEY in r for r in records):
    # A key the user chose that no row has is a misspelling: every answer a reward function
    # got was None, silently (the default key may be absent: a reward model needs none).
    raise ValueError(f"{path}: no row has the answer field '{answer_key}' (the first row's "
                     f"keys: {first_keys}); set "
                     f"config.data.answer_key to the field that holds the answer, or to "
                     f"'{ANSWER_KEY}' (the default) for a file without answers")
  return records


def split_records(records: Sequence[Mapping[str, Any]], fraction: float, seed: int
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """(training, held-out): round(fraction * N) records (at least one) drawn with
  rng([seed, 29]), each part in the original order; the split depends only on (N, seed)."""
  n = len(records)
  k = max(1, int(round(fraction * n)))
  if not 0 < fraction < 1 or k >= n:
    raise ValueError(f"config.data.val_fraction={fraction} of {n} prompts leaves "
                     f"{n - k} for training; expected 0 < val_fraction < 1 leaving at least one")
  held = np.zeros(n, bool)
  held[np.random.default_rng([seed, 29]).permutation(n)[:k]] = True
  return ([dict(r) for r, h in zip(records, held) if not h],
          [dict(r) for r, h in zip(records, held) if h])


def render_prompts(records: Sequence[Mapping[str, Any]],
                   template: Optional[ChatTemplate]) -> list[dict[str, Any]]:
  """Records with PROMPT_TEXT_KEY: the chat template's rendering (generation prompt added), or
  the prompt itself when there is no template (a list of messages then is an error)."""
  out = []
  for i, r in enumerate(records):
    prompt = r.get(PROMPT_KEY)
    if template is None:
      if not isinstance(prompt, str):
        raise ValueError(f"prompt {i}{where(r)} is a list of messages but "
                         "config.data.chat_template='none': set 'auto' (the tokenizer's "
                         "template) or a template path")
      text = prompt
    else:
      try:
        text = template.render(prompt)
      except ChatTemplateError as e:
        raise ValueError(f"prompt {i}{where(r)}: {e}") from e
    out.append({**r, PROMPT_TEXT_KEY: text})
  return out
