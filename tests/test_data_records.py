"""Prompt datasets from JSONL and parquet: configurable prompt/answer fields, errors naming the
file and the row, the seeded train/validation split, and build_datasets end to end (a chat
template, held-out prompts, the tokens the trainer would generate from)."""
import gzip
import json
import os
import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhfuse_jax.data.chat import ChatTemplate
from rlhfuse_jax.data.prompts import load_jsonl_prompts
from rlhfuse_jax.data.records import (PROMPT_TEXT_KEY, load_records, lookup, render_prompts,
                                      split_records)
from rlhfuse_jax.data.tokenizer import HFTokenizer
from rlhfuse_jax.trainer import build
from rlhfuse_jax.trainer import config as config_lib
from tests.test_trainer import tiny_config

CHAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tiny_chat")
with open(os.path.join(CHAT, "goldens.json"), encoding="utf-8") as _f:
  GOLDENS = json.load(_f)

# verl's layout: messages under "prompt", the answer nested in reward_model.ground_truth.
VERL_ROWS = [
    {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "What is 12 plus 30?"}],
     "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"index": 0}},
    {"data_source": "gsm8k", "prompt": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "What is 2 times 3?"}],
     "reward_model": {"style": "rule", "ground_truth": "6"}, "extra_info": {"index": 1}},
]


def _jsonl(path, rows, blank_after=None):
  lines = []
  for i, r in enumerate(rows):
    lines.append(r if isinstance(r, str) else json.dumps(r))
    if i == blank_after:
      lines.append("")
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def _parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_nested_keys_messages_and_sources(tmp_path, fmt):
  """verl-style rows: messages and a nested answer, read the same from JSONL and parquet;
  every record keeps its fields and says where it came from."""
  path = (_jsonl(tmp_path / "d.jsonl", VERL_ROWS, blank_after=0) if fmt == "jsonl"
          else _parquet(tmp_path / "d.parquet", VERL_ROWS))
  records = load_records(path, "prompt", "reward_model.ground_truth", require_answer=True)
  assert [r["target"] for r in records] == ["42", "6"]
  assert [r["prompt"] for r in records] == [v["prompt"] for v in VERL_ROWS]
  assert records[1]["extra_info"] == {"index": 1} and records[0]["data_source"] == "gsm8k"
  where = [f"{path}:1", f"{path}:3"] if fmt == "jsonl" else [f"{path}:row 0", f"{path}:row 1"]
  assert [r["_source"] for r in records] == where


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_flat_keys_numbers_and_optional_answers(tmp_path, fmt):
  """OpenRLHF-style flat columns; a numeric answer is kept as its text; without
  require_answer a row may lack the answer (no 'target')."""
  rows = [{"question": "What is 12 plus 30?", "label": 42, "target": "old"},
          {"question": "Half of 3?", "label": 1.5, "target": "old"},
          {"question": "Name a colour.", "label": None, "target": "old"}]
  path = (_jsonl(tmp_path / "d.jsonl", rows) if fmt == "jsonl"
          else _parquet(tmp_path / "d.parquet", rows))
  records = load_records(path, "question", "label")
  assert [r["prompt"] for r in records] == [r["question"] for r in rows]
  assert [r.get("target") for r in records] == ["42", "1.5", None]
  with pytest.raises(ValueError,
                     match=rf"{path}:(row 2|3): answer field 'label' is empty \(None\)"):
    load_records(path, "question", "label", require_answer=True)


def test_float_answers_read_back_as_written(tmp_path):
  """A float32 column's 0.1 is '0.1' (not its float64 widening 0.10000000149011612), 1e-5 is
  '0.00001' (str() gave '1e-05', whose final number is 5), a NaN is a missing answer (pandas
  writes one for an empty cell), an inf is refused by row."""
  table = pa.table({"prompt": ["a", "b", "c", "d"],
                    "f32": pa.array([0.1, 2.5, 1e-5, 3.0], pa.float32()),
                    "f64": pa.array([0.1, 1e-5, np.nan, 12.0], pa.float64())})
  pq.write_table(table, str(tmp_path / "d.parquet"))
  path = str(tmp_path / "d.parquet")
  assert [r["target"] for r in load_records(path, answer_key="f32")] == [
      "0.1", "2.5", "0.00001", "3"]
  assert [r.get("target") for r in load_records(path, answer_key="f64")] == [
      "0.1", "0.00001", None, "12"]
  with pytest.raises(ValueError, match=r"row 2: answer field 'f64' is empty \(nan\)"):
    load_records(path, answer_key="f64", require_answer=True)
  rows = [{"prompt": "a", "target": 1.0}, {"prompt": "b", "target": float("inf")}]
  with pytest.raises(ValueError, match=r"d.jsonl:2: answer field 'target' is inf; expected a "
                                       r"finite number"):
    load_records(_jsonl(tmp_path / "d.jsonl", rows))


def test_nested_float32_and_decimal_answers_read_back_as_written(tmp_path):
  """verl's layout nests the answer (reward_model.ground_truth): a float32 there is '0.1' as at
  the top level, and a decimal column is a number ('2.50' -> '2.5'), not a refused type."""
  import decimal
  gt = pa.array([0.1, 2.5, None], pa.float32())
  table = pa.table({
      "prompt": ["a", "b", "c"],
      "reward_model": pa.StructArray.from_arrays([gt, pa.array(["x", "y", "z"])],
                                                 names=["ground_truth", "style"]),
      "dec": pa.array([decimal.Decimal("2.50"), decimal.Decimal("100"), decimal.Decimal("-0.01")],
                      pa.decimal128(6, 2))})
  path = str(tmp_path / "d.parquet")
  pq.write_table(table, path)
  assert [r.get("target") for r in load_records(path, answer_key="reward_model.ground_truth")
          ] == ["0.1", "2.5", None]
  assert [r["target"] for r in load_records(path, answer_key="dec")] == ["2.5", "100", "-0.01"]


def test_lookup_prefers_a_literal_dotted_key():
  row = {"a.b": 1, "a": {"b": 2, "c": {"d": 3}}}
  assert lookup(row, "a.b") == 1 and lookup(row, "a.c.d") == 3
  assert lookup(row, "a.x") is lookup(row, "z")  # the same "missing" marker


@pytest.mark.parametrize("row, expected", [
    ({"q": "x"}, r"missing prompt field 'prompt' \(keys: \['q'\]\); set config\.data\.prompt_key"),
    ({"prompt": ""}, "field 'prompt' is an empty string"),
    ({"prompt": " \n\t"}, r"field 'prompt' is blank \(' \\n\\t'\); expected a prompt"),
    ({"prompt": []}, "field 'prompt' is an empty list"),
    ({"prompt": 3}, "field 'prompt' must be a string or a list of messages, got int"),
    # A nested prompt: the dotted key that reads it is named.
    ({"prompt": {"text": "x", "id": 3}}, r"field 'prompt' must be a string or a list of "
     r"messages, got dict with fields \['id', 'text'\]; a dotted config\.data\.prompt_key reads "
     r"a nested field: 'prompt\.text'$"),
    ({"prompt": ["hi"]}, "field 'prompt' message 0 is a str; expected an object"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "user"}]},
     "field 'prompt' message 1 needs a string 'content', got NoneType"),
    # (a blank string is refused; these messages rendered as the template's headers alone)
    ({"prompt": [{"role": "system", "content": " "}, {"role": "user", "content": ""}]},
     r"field 'prompt' has no message with content \(every 'content' is blank\)"),
    ({"prompt": "x", "target": [1]}, "answer field 'target' must be a string or a number, got "
                                     r"list \(a reward function of your own reads any field of "
                                     r"the record itself: rename the field in the file, which "
                                     r"the default config\.data\.answer_key='target' reads"),
    ({"prompt": "x", "target": True}, "answer field 'target' must be a string or a number, got "
                                      "bool"),
])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_bad_rows_name_file_and_row(tmp_path, row, expected, fmt):
  rows = [{"prompt": "fine", "target": "1"}, row]
  if fmt == "jsonl":
    path, where = _jsonl(tmp_path / "d.jsonl", rows), "d.jsonl:2"
  else:  # a parquet column has one type: the bad row gets a file of its own
    path, where = _parquet(tmp_path / "d.parquet", [row]), r"d\.parquet:row 0"
  with pytest.raises(ValueError, match=rf"{where}: {expected}"):
    load_records(path)


def test_a_list_answer_under_another_key_says_to_leave_answer_key_unset(tmp_path):
  """Under a key of the user's, leaving answer_key unset is the fix; under the default key
  it was the advice too, though the default reads the same field and fails the same way."""
  path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answers": ["1", "one"]}])
  with pytest.raises(ValueError, match=r"leave config\.data\.answer_key unset and read "
                                       r"record\['answers'\] there\)"):
    load_records(path, answer_key="answers")
  assert "target" not in load_records(path)[0]  # the fix works: the row loads without it


def test_file_level_errors(tmp_path):
  with pytest.raises(ValueError, match=r"d\.jsonl:2: invalid JSON"):
    load_records(_jsonl(tmp_path / "d.jsonl", ['{"prompt": "a"}', '{"prompt": ']))
  with pytest.raises(ValueError, match=r"e\.jsonl: no prompts"):
    load_records(_jsonl(tmp_path / "e.jsonl", []))
  (tmp_path / "bad.parquet").write_bytes(b"not parquet")
  with pytest.raises(ValueError, match=r"bad\.parquet: not a readable parquet file"):
    load_records(str(tmp_path / "bad.parquet"))
  with pytest.raises(FileNotFoundError, match="prompts file not found"):
    load_records(str(tmp_path / "missing.jsonl"))
  # A directory is there: "not found" sent the user looking for it.
  with pytest.raises(ValueError, match=f"^{tmp_path} is a directory; expected a JSONL or "
                                       "parquet file of prompts$"):
    load_records(str(tmp_path))
  # Invalid JSON anywhere is reported before a missing field on an earlier line.
  with pytest.raises(ValueError, match=r"d\.jsonl:3: invalid JSON"):
    load_records(_jsonl(tmp_path / "d.jsonl", ['{"q": "a"}', '{"prompt": "b"}', '{"prompt":']),
                 require_answer=True)
  # A file that opens with '[' is a JSON array: its items are the rows.
  with pytest.raises(ValueError, match=r"d\.jsonl:item 0: expected an object .* got str"):
    load_records(_jsonl(tmp_path / "d.jsonl", ['["prompt"]']))
  (tmp_path / "torn.json").write_text('[{"prompt": "a"},\n {"prompt": ')
  with pytest.raises(ValueError, match=r"torn\.json: starts like a JSON array but does not "
                     r"parse"):
    load_records(str(tmp_path / "torn.json"))
  # A CSV is named as the wrong format, with the ones that read; JSON's own message is not
  # run into ours ("Unterminated string starting at at column 12").
  (tmp_path / "p.csv").write_text("prompt,target\nhi,1\n")
  with pytest.raises(ValueError, match=r"p\.csv:1: invalid JSON \(Expecting value, column 1\); "
                     r"expected one object per line \(JSONL; a JSON array of objects or a "
                     r"parquet file also reads\)"):
    load_records(str(tmp_path / "p.csv"))
  with pytest.raises(ValueError, match=r"invalid JSON \(Unterminated string starting at, "
                                       r"column 12\)"):
    load_records(_jsonl(tmp_path / "d.jsonl", ['{"prompt": "a']))
  # A gzipped JSONL (as datasets often ship) was "not UTF-8 ... iconv -f latin1": wrong advice.
  with gzip.open(tmp_path / "t.jsonl.gz", "wt") as f:
    f.write('{"prompt": "a"}\n')
  with pytest.raises(ValueError, match=r"t\.jsonl\.gz: a gzip-compressed file; expected JSONL, "
                     r"a JSON array or parquet uncompressed \(gunzip it first\)"):
    load_records(str(tmp_path / "t.jsonl.gz"))
  # UTF-16 text and Arrow files (a datasets save_to_disk shard, Feather) got the same advice,
  # which would garble them.
  (tmp_path / "u.jsonl").write_bytes('{"prompt": "a"}\n'.encode("utf-16"))
  with pytest.raises(ValueError, match=r"u\.jsonl: UTF-16 text \(its byte-order mark\); "
                                       r"expected UTF-8 \(convert it, e\.g\. iconv -f utf-16"):
    load_records(str(tmp_path / "u.jsonl"))
  import pyarrow.feather
  import pyarrow.ipc
  table = pa.table({"prompt": ["a"]})
  pyarrow.feather.write_feather(table, str(tmp_path / "t.feather"))
  with pyarrow.ipc.new_stream(str(tmp_path / "t.arrow"), table.schema) as w:
    w.write_table(table)
  for name in ("t.feather", "t.arrow"):
    with pytest.raises(ValueError, match=rf"{name}: an Arrow/Feather file .*; expected JSONL, a "
                                         r"JSON array or parquet \(e\.g\. datasets\.load_from"):
      load_records(str(tmp_path / name))


def test_a_column_oriented_json_object_is_named_as_such(tmp_path):
  """{"question": [...], "answer": [...]} (json.dump(dataset.to_dict())) read as one row and
  was refused on its prompt as a chat message list: "message 0 is a str; expected an object"."""
  columns = tmp_path / "cols.json"
  columns.write_text(json.dumps({"question": ["a", "b"], "answer": ["1", "2"]}))
  with pytest.raises(ValueError, match=r"cols\.json: one JSON object whose fields \['answer', "
                     r"'question'\] are lists of 2 values \(column-oriented\); expected one "
                     r"object per prompt: JSONL, a JSON array of objects or parquet"):
    load_records(str(columns), "question", "answer")
  # A JSONL whose one row holds a list prompt (chat messages) and list fields still reads, and
  # so does a file of several rows with list fields.
  one = _jsonl(tmp_path / "one.jsonl", [json.dumps(
      {"prompt": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x"}],
       "tags": ["a", "b"]})])
  assert load_records(one)[0]["tags"] == ["a", "b"]
  two = _jsonl(tmp_path / "two.jsonl", [json.dumps({"prompt": ["a", "b"]})] * 2)
  with pytest.raises(ValueError, match=r"two\.jsonl:1: field 'prompt' message 0 is a str"):
    load_records(two)


def test_json_that_python_cannot_hold_names_the_file_and_line(tmp_path):
  """json.loads raises a plain ValueError for an int of over 4300 digits and RecursionError
  for deep nesting, not JSONDecodeError: both escaped unnamed (no file, no line)."""
  huge, deep = '{"prompt": "b", "target": ' + "9" * 5000 + "}", '{"x": ' + "[" * 10**5
  for bad, error in ((huge, ValueError), (deep, RecursionError)):
    path = _jsonl(tmp_path / "d.jsonl", ['{"prompt": "a"}', bad])
    for load in (load_records, load_jsonl_prompts):
      with pytest.raises(ValueError, match=rf"d\.jsonl:2: cannot read this JSON line "
                                           rf"\({error.__name__}: "):
        load(path)
    (tmp_path / "a.json").write_text('[{"prompt": "a"}, ' + bad + "]")
    with pytest.raises(ValueError, match=r"a\.json: starts like a JSON array but does not "
                                         r"parse as one"):
      load_records(str(tmp_path / "a.json"))


def test_a_lone_surrogate_is_refused_naming_the_row_and_field(tmp_path):
  """JSON's "\ud800" escape without its pair loads as a str no tokenizer encodes: a target
  holding one failed inside the reward (target_match tokenises targets), mid-run, unnamed."""
  for row, field in (({"prompt": "a", "target": "4\ud800"}, "'target'"),
                     ({"prompt": "a\udc00"}, "'prompt'"),
                     ({"prompt": [{"role": "user", "content": "\ud800"}]},
                      "'prompt' message 0 'content'")):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, row])
    with pytest.raises(ValueError, match=rf"d\.jsonl:2: field {field} holds a lone surrogate"):
      load_records(path)
  with pytest.raises(ValueError, match=r"d\.jsonl:2: field 'prompt' holds a lone surrogate "
                                       r"'\\udc00' at character 2"):
    load_jsonl_prompts(_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": "a\udc00"}]))
  path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a\U0001F600", "target": "\u00e9"}])
  assert load_records(path)[0]["prompt"] == "a\U0001F600"  # a pair is one character


def test_an_answer_key_that_no_row_has_is_refused(tmp_path):
  """A chosen answer_key that no row has is a misspelling: with a user's reward function (no
  answer required) every answer it got was None, silently. The default key may be absent (a
  reward model, a function without answers), and so may a chosen one on some rows."""
  rows = [{"question": "a", "answer": "1"}, {"question": "b"}]
  path = _jsonl(tmp_path / "d.jsonl", rows)
  with pytest.raises(ValueError, match=r"d\.jsonl: no row has the answer field 'answr' \(the "
                     r"first row's keys: \['answer', 'question'\]\); set config\.data\."
                     r"answer_key"):
    load_records(path, "question", "answr")
  # a held-out file may lack answers where the run verifies none (build checks the training
  # file only)
  assert len(load_records(path, "question", "answr", check_answer_key=False)) == 2
  assert [r.get("target") for r in load_records(path, "question", "answer")] == ["1", None]
  assert all("target" not in r for r in load_records(path, "question"))


def test_json_arrays_and_unsuffixed_parquet_are_read(tmp_path):
  """What users have besides JSONL: a JSON array (json.dump(rows), many exports; it was
  "invalid JSON at column 2"), and a parquet file not named *.parquet (a .pq was read as text
  and refused as "not UTF-8 ... convert it with iconv"). Both read as their rows, sources named."""
  array = tmp_path / "rows.json"
  array.write_text(json.dumps(VERL_ROWS, indent=2))
  got = load_records(str(array), "prompt", "reward_model.ground_truth", require_answer=True)
  assert [r["target"] for r in got] == ["42", "6"]
  assert [r["_source"] for r in got] == [f"{array}:item 0", f"{array}:item 1"]
  pq_path = _parquet(tmp_path / "rows.pq", VERL_ROWS)
  got = load_records(pq_path, "prompt", "reward_model.ground_truth", require_answer=True)
  assert [r["target"] for r in got] == ["42", "6"] and got[1]["_source"] == f"{pq_path}:row 1"


def test_an_empty_answer_is_named_as_empty_not_missing(tmp_path):
  """A row whose answer field is there but null (or NaN) said the field was missing and to
  change config.data.answer_key, which is not the fix."""
  path = _jsonl(tmp_path / "d.jsonl", [{"q": "1+1?", "label": 2}, {"q": "2+2?", "label": None}])
  with pytest.raises(ValueError, match=r"d\.jsonl:2: answer field 'label' is empty \(None\) on "
                     r"this row; every row needs an answer"):
    load_records(path, "q", "label", require_answer=True)
  assert [r.get("target") for r in load_records(path, "q", "label")] == ["2", None]


@pytest.mark.parametrize("blank", ["", "  \n"])
def test_a_blank_answer_is_refused_when_the_reward_verifies(tmp_path, blank):
  """A blank answer string passed the load and stopped the run mid-training, when the verifier
  first met its row ("the answer '' holds no number"); it is named at the start, as null is."""
  path = _jsonl(tmp_path / "d.jsonl", [{"q": "1+1?", "label": "2"}, {"q": "2+2?", "label": blank}])
  with pytest.raises(ValueError, match=r"d\.jsonl:2: answer field 'label' is empty \(" +
                     re.escape(repr(blank)) + r"\) on this row"):
    load_records(path, "q", "label", require_answer=True)
  # Without a verifier the row keeps its answer as it is (a user's function may read it).
  assert [r["target"] for r in load_records(path, "q", "label")] == ["2", blank]


def test_split_is_seeded_disjoint_and_ordered():
  records = [{"prompt": f"p{i}", "i": i} for i in range(20)]
  train, val = split_records(records, 0.25, seed=3)
  assert len(val) == 5 and len(train) == 15
  ids_t, ids_v = [r["i"] for r in train], [r["i"] for r in val]
  assert sorted(ids_t + ids_v) == list(range(20))
  assert ids_t == sorted(ids_t) and ids_v == sorted(ids_v)  # file order kept in each part
  assert split_records(records, 0.25, seed=3)[1] == val
  assert [r["i"] for r in split_records(records, 0.25, seed=4)[1]] != ids_v
  assert len(split_records(records, 0.01, seed=0)[1]) == 1  # at least one held out
  with pytest.raises(ValueError, match="val_fraction=0.5 of 1 prompts leaves 0 for training"):
    split_records(records[:1], 0.5, seed=0)


def _chat_config(tmp_path, **overrides):
  return tiny_config(**{"init.tokenizer": os.path.join(CHAT, "chatml", "tokenizer.json"),
                        "data.chat_template": "auto", "data.max_prompt_len": 64,
                        "model.max_seq_len": 80, "critic_model.max_seq_len": 80,
                        "reward.function": "gsm8k", **overrides})


def test_build_datasets_renders_tokenises_and_holds_out(tmp_path):
  """build_datasets with a parquet file, the tokenizer's chat template and a 25 % split: the
  token rows are transformers' ids of each rendered prompt (goldens), no BOS added, the held-out
  prompts are the split's, in file order."""
  convs = GOLDENS["conversations"]
  names = ["user", "system_user", "multi_turn", "unicode"]
  rows = [{"messages": convs[n], "answer": str(i), "name": n} for i, n in enumerate(names)]
  path = _parquet(tmp_path / "train.parquet", rows)
  cfg = _chat_config(tmp_path, **{"data.prompts_file": path, "data.prompt_key": "messages",
                                  "data.answer_key": "answer", "data.val_fraction": 0.25,
                                  "rollout.prompts_per_iteration": 2, "algo.minibatch_size": 2})
  task, tok = build.build_task_and_tokenizer(cfg)
  train, val = build.build_datasets(cfg, task, tok)
  assert len(train) == 3 and len(val) == 1
  _, want_val = split_records(load_records(path, "messages", "answer"), 0.25, cfg.seed)
  assert [r["name"] for r in val.records] == [r["name"] for r in want_val]
  for ds in (train, val):
    for i, r in enumerate(ds.records):
      golden = GOLDENS["chatml"]["conversations"][r["name"]]
      assert r[PROMPT_TEXT_KEY] == golden["text"]
      assert r["target"] == str(names.index(r["name"]))
      np.testing.assert_array_equal(ds.tokens[i, :ds.lengths[i]], golden["ids"])
      assert np.all(ds.tokens[i, ds.lengths[i]:] == tok.pad_id)
  # The stream draws from the training part only.
  drawn = {r["name"] for _ in range(6) for r in train.next_batch().records}
  assert drawn == {r["name"] for r in train.records} and not drawn & {val.records[0]["name"]}


def test_build_datasets_errors_name_the_row(tmp_path):
  """A missing answer for a verifier, a template error and a too-long rendered prompt all stop
  build_datasets naming the file and the row."""
  rows = [{"prompt": "What is 12 plus 30?", "target": "42"}, {"prompt": "Half of 3?"}]
  path = _jsonl(tmp_path / "p.jsonl", rows)
  cfg = _chat_config(tmp_path, **{"data.prompts_file": path})
  task, tok = build.build_task_and_tokenizer(cfg)
  with pytest.raises(ValueError, match=r"p\.jsonl:2: missing answer field 'target'"):
    build.build_datasets(cfg, task, tok)
  # A user's function needs no answer column; the row without one loads.
  user = _chat_config(tmp_path, **{"data.prompts_file": path,
                                   "reward.function": "tests.test_rewards:answer_length"})
  assert [r.get("target") for r in build.build_datasets(user, task, tok)[0].records] == [
      "42", None]
  short = _chat_config(tmp_path, **{"data.prompts_file": _jsonl(tmp_path / "q.jsonl", rows[:1]),
                                    "data.max_prompt_len": 20})
  with pytest.raises(ValueError, match=r"prompt 0 \(.*q\.jsonl:1\) has 31 tokens, more than "
                                       r"max_prompt_len=20"):
    build.build_datasets(short, task, tok)
  two_users = [{"prompt": GOLDENS["conversations"]["two_users"], "target": "1"}]
  inst = _chat_config(tmp_path, **{
      "data.prompts_file": _jsonl(tmp_path / "r.jsonl", two_users),
      "init.tokenizer": os.path.join(CHAT, "inst", "tokenizer.json")})
  with pytest.raises(ValueError, match=r"prompt 0 \(.*r\.jsonl:1\): .*roles must alternate"):
    build.build_datasets(inst, task, HFTokenizer.from_file(os.path.join(CHAT, "inst")))


def test_task_prompts_without_template_keep_their_tokens():
  """The defaults (synthetic task, chat_template='none') tokenise as before: the task's own
  text with the tokenizer's BOS, so existing runs and checkpoints are unchanged."""
  cfg = tiny_config()
  task, tok = build.build_task_and_tokenizer(cfg)
  ds = build.build_dataset(cfg, task, tok)
  for i in range(5):
    r = ds.records[i]
    assert r[PROMPT_TEXT_KEY] == r["prompt"]
    np.testing.assert_array_equal(ds.tokens[i, :ds.lengths[i]], tok.encode(r["prompt"]))
  assert render_prompts(ds.records[:1], None)[0][PROMPT_TEXT_KEY] == ds.records[0]["prompt"]


def test_config_fields_checks_and_resume():
  """The new fields' errors name them; at their defaults they keep a checkpoint written before
  they existed resumable, and the validation-only fields may change on resume."""
  with pytest.raises(ValueError, match=r"config\.data\.val_fraction=0\.1: expected 0 when "
                                       r"data\.val_file='v\.jsonl'"):
    tiny_config(**{"data.val_file": "v.jsonl", "data.val_fraction": 0.1})
  with pytest.raises(ValueError, match=r"config\.eval_every=5: expected 0 without held-out "
                                       "prompts"):
    tiny_config(eval_every=5)
  with pytest.raises(ValueError, match=r"config\.data\.val_fraction=1\.0: expected in \[0, 1\)"):
    tiny_config(**{"data.val_fraction": 1.0})
  with pytest.raises(ValueError, match=r"config\.data\.prompt_key='': expected a non-empty"):
    tiny_config(**{"data.prompt_key": ""})
  now = tiny_config().fingerprint()
  new = {"data.prompt_key", "data.answer_key", "data.chat_template", "data.val_fraction",
         "reward.format", "reward.format_weight"}
  assert new <= set(now)
  old = {k: v for k, v in now.items() if k not in new}  # a checkpoint from before the fields
  assert config_lib.fingerprint_changes(old, now) == []
  changed = tiny_config(**{"data.chat_template": "auto"}).fingerprint()
  assert config_lib.fingerprint_changes(old, changed) == [
      "data.chat_template: (absent) -> 'auto'"]
  assert not {"eval_every", "data.val_file", "data.val_max_prompts"} & set(now)


def test_chat_prompts_get_no_second_bos(tmp_path):
  """A tokenizer that adds BOS by itself (add_bos_token=true, as LLaMA's) with a template that
  writes bos_token: the prompt starts with one BOS, exactly transformers' ids."""
  d = tmp_path / "tok"
  shutil.copytree(os.path.join(CHAT, "headers"), d)
  config = json.loads((d / "tokenizer_config.json").read_text())
  (d / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
  tok = HFTokenizer.from_file(str(d))
  assert tok.add_bos and tok.encode("hi")[0] == tok.bos_id
  path = _jsonl(tmp_path / "p.jsonl", [{"prompt": GOLDENS["conversations"]["user"][0]["content"],
                                        "target": "42"}])
  cfg = _chat_config(tmp_path, **{"data.prompts_file": path, "init.tokenizer": str(d),
                                  "rollout.prompts_per_iteration": 8})
  ds = build.build_dataset(cfg, None, tok)
  np.testing.assert_array_equal(ds.tokens[0, :ds.lengths[0]],
                                GOLDENS["headers"]["conversations"]["user"]["ids"])


def test_text_prompts_without_a_tokenizer_name_the_row_and_the_field(tmp_path):
  """A prompts file of text with the synthetic task's word-level tokenizer (no
  init.tokenizer): the error was the tokenizer library's "Missing [UNK] token", naming neither
  the row nor the field to set."""
  path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "3 #2 =", "target": "3 3"},
                                       {"prompt": "How many cards?", "target": "2"}])
  cfg = tiny_config(**{"data.prompts_file": path})
  task, tok = build.build_task_and_tokenizer(cfg)
  with pytest.raises(ValueError, match=r"d\.jsonl:2: the prompt 'How many cards\?' is not in "
                     r"the 'repeat' task's word-level vocabulary .* set config\.init\.tokenizer"):
    build.build_datasets(cfg, task, tok)
  # an answer outside it too (the task's verifier reads the answers with the same tokenizer)
  _jsonl(tmp_path / "d.jsonl", [{"prompt": "3 #2 =", "target": "three three"}])
  with pytest.raises(ValueError, match=r"d\.jsonl:1: the answer 'three three' is not in the "
                     r"'repeat' task's word-level vocabulary"):
    build.build_datasets(cfg, task, tok)
  # the task's own words read
  _jsonl(tmp_path / "d.jsonl", [{"prompt": "3 #2 =", "target": "3 3"}])
  assert len(build.build_datasets(cfg, task, tok)[0]) == 1


def test_the_rendered_text_replaces_a_rows_own_prompt_text_field(tmp_path):
  """A row may already carry `_prompt_text` (records saved after rendering and loaded again,
  or a file that happens to use the name): the text the run tokenises is this rendering's, as
  the module docstring says of the fields it adds."""
  path = tmp_path / "p.jsonl"
  path.write_text(json.dumps({"prompt": "what is 2+2?", PROMPT_TEXT_KEY: "stale"}) + "\n")
  records = load_records(str(path))
  assert records[0][PROMPT_TEXT_KEY] == "stale"  # kept as a row field until rendering
  out = render_prompts(records, None)
  assert out[0][PROMPT_TEXT_KEY] == "what is 2+2?"
  template = ChatTemplate("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                          "{% endfor %}")
  assert render_prompts(records, template)[0][PROMPT_TEXT_KEY] == "<user>what is 2+2?"
