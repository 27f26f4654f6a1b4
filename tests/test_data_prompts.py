"""JSONL prompt loading errors, padded tokenisation, and a deterministic, resumable stream."""
import json

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from rlhfuse_jax.data.prompts import (PromptDataset, load_jsonl_prompts, pad_token_ids,
                                      tokenize_prompts)
from rlhfuse_jax.data.tokenizer import HFTokenizer

_WORDS = ["<pad>", "<bos>", "<eos>"] + [f"w{i}" for i in range(40)]


def _tokenizer():
  tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(_WORDS)}))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(_WORDS[:3])
  return HFTokenizer(tok, pad_id=0, bos_id=1, eos_id=2)


def _records(n, rng=None):
  rng = rng or np.random.default_rng(0)
  return [{"prompt": " ".join(f"w{j}" for j in rng.integers(0, 40, size=rng.integers(1, 6))),
           "id": i} for i in range(n)]


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def test_load_jsonl_skips_blank_lines_and_keeps_fields(tmp_path):
  path = _write(tmp_path / "p.jsonl", ['{"prompt": "w1 w2", "target": 3}', "", "   ",
                                       '{"prompt": "w3", "x": [1]}'])
  records = load_jsonl_prompts(path)
  assert [r["prompt"] for r in records] == ["w1 w2", "w3"]
  assert records[0]["target"] == 3 and records[1]["x"] == [1]
  assert records[1]["_source"] == f"{path}:4"  # blank lines still count
  assert load_jsonl_prompts(_write(tmp_path / "q.jsonl", ['{"q": "a"}']), field="q")[0]["q"] == "a"


@pytest.mark.parametrize("bad_line, expected", [
    ('{"prompt": "unterminated', r"invalid JSON .*expected one object per line"),
    ('["prompt", "w1"]', r"expected a JSON object with a string field 'prompt', got list"),
    ('{"text": "w1"}', r"missing field 'prompt' \(keys: \['text'\]\); expected a string"),
    ('{"prompt": 7}', r"field 'prompt' must be a string, got int"),
    ('{"prompt": "  "}', r"field 'prompt' is blank; expected the prompt's text"),
])
def test_malformed_line_names_path_and_line_number(tmp_path, bad_line, expected):
  path = _write(tmp_path / "p.jsonl", ['{"prompt": "w1"}', "", '{"prompt": "w2"}', bad_line,
                                       '{"prompt": "w3"}'])
  with pytest.raises(ValueError, match=rf"p\.jsonl:4: {expected}"):
    load_jsonl_prompts(path)


def test_encoding_a_bom_and_untokenisable_text(tmp_path):
  """A byte-order mark is read as nothing; a file that is not UTF-8 and a prompt the tokenizer
  cannot encode are errors naming the file and the line."""
  bom = tmp_path / "bom.jsonl"
  bom.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "w1"}\r{"prompt": "w2"}\r\n')
  assert [r["prompt"] for r in load_jsonl_prompts(str(bom))] == ["w1", "w2"]  # \r, \r\n end lines
  bad_bom = tmp_path / "bad_bom.jsonl"
  bad_bom.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "caf\xe9"}\n')
  with pytest.raises(ValueError, match=r"bad_bom\.jsonl:1: not UTF-8 text \(byte 0xe9 at column "
                                       r"16\)"):
    load_jsonl_prompts(str(bad_bom))
  latin = tmp_path / "latin1.jsonl"
  latin.write_bytes(b'{"prompt": "w1"}\n{"prompt": "caf\xe9"}\n')
  with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8 text \(byte 0xe9 at column "
                                       r"16\); expected a UTF-8 JSONL file"):
    load_jsonl_prompts(str(latin))
  path = _write(tmp_path / "p.jsonl", ['{"prompt": "w1"}', '{"prompt": "w2 hello"}'])
  with pytest.raises(ValueError, match=rf"prompt 1 \({path}:2\) cannot be tokenised \(.*\); "
                                       r"text starts 'w2 hello'"):
    tokenize_prompts(load_jsonl_prompts(path), _tokenizer(), 8)


def test_empty_file_is_an_error(tmp_path):
  with pytest.raises(ValueError, match="no prompts"):
    load_jsonl_prompts(_write(tmp_path / "e.jsonl", ["", ""]))


def test_tokenize_pads_and_reports_lengths():
  tok = _tokenizer()
  records = [{"prompt": "w5"}, {"prompt": "w1 w2 w3"}]
  tokens, lengths = tokenize_prompts(records, tok, max_prompt_len=5)
  assert tokens.dtype == np.int32 and lengths.dtype == np.int32 and tokens.shape == (2, 5)
  np.testing.assert_array_equal(lengths, [2, 4])  # BOS counted
  real = [[1, 8], [1, 4, 5, 6]]
  for row, ids in enumerate(real):
    np.testing.assert_array_equal(tokens[row], ids + [0] * (5 - len(ids)))


@pytest.mark.parametrize("padding", ["left", "middle"])
def test_only_right_padding_is_offered(padding):
  """Generators read a prompt's tokens from column 0: left-padded prompts were overwritten with
  padding there, silently (generation/instances.check_prompts)."""
  with pytest.raises(ValueError, match=f"padding='{padding}': expected 'right'"):
    pad_token_ids([[1]], 3, 0, padding=padding)
  with pytest.raises(ValueError, match=f"padding='{padding}': expected 'right'"):
    PromptDataset([{"prompt": "w1"}], _tokenizer(), batch_size=1, max_prompt_len=4,
                  padding=padding)


def test_too_long_prompt_names_its_line_and_lengths(tmp_path):
  path = _write(tmp_path / "p.jsonl", ['{"prompt": "w1"}', '{"prompt": "w1 w2 w3 w4 w5"}'])
  records = load_jsonl_prompts(path)
  with pytest.raises(ValueError, match=rf"prompt 1 \({path}:2\) has 6 tokens, more than "
                                       r"max_prompt_len=4"):
    PromptDataset(records, _tokenizer(), batch_size=1, max_prompt_len=4)
  with pytest.raises(ValueError, match=r"prompt 1 has 6 tokens, more than max_prompt_len=5"):
    tokenize_prompts([{"prompt": "w1"}, {"prompt": "w1 w2 w3 w4 w5"}], _tokenizer(), 5)


def test_too_long_prompts_are_counted_with_the_longest():
  """Every overlong prompt is measured before the error: it says how many there are and the
  longest, so that one raise of max_prompt_len fits them (one at a time, a large file took a
  start per prompt)."""
  records = [{"prompt": "w1"}, {"prompt": "w1 w2 w3"}, {"prompt": "w1 w2 w3 w4 w5 w6"},
             {"prompt": "w1 w2 w3 w4"}]
  with pytest.raises(ValueError, match=r"prompt 1 has 4 tokens, more than max_prompt_len=3; "
                                       r"3 of the 4 prompts are longer, the longest 7 tokens"):
    tokenize_prompts(records, _tokenizer(), 3)


def test_prompts_are_tokenised_in_chunks(monkeypatch):
  """The pool is tokenised ENCODE_CHUNK texts per call, each chunk's ids written into the padded
  array at once: a whole pool's encodings at once held ~120 bytes a token (3.7 GB for 100k
  prompts of 300 tokens), for an array of 4 bytes a token."""
  from rlhfuse_jax.data import prompts
  monkeypatch.setattr(prompts, "ENCODE_CHUNK", 4, raising=False)
  tok, sizes = _tokenizer(), []
  encode_batch = tok.encode_batch

  def recorded(texts, add_bos=None):
    sizes.append(len(texts))
    return encode_batch(texts, add_bos=add_bos)
  monkeypatch.setattr(tok, "encode_batch", recorded)
  records = _records(10)
  tokens, lengths = tokenize_prompts(records, tok, 8)
  assert sizes == [4, 4, 2]
  for row, r in enumerate(records):
    ids = _tokenizer().encode(r["prompt"])
    assert lengths[row] == len(ids) and tokens[row, :len(ids)].tolist() == ids
    assert (tokens[row, len(ids):] == 0).all()
  records[6]["prompt"] = "w1 w2 w99"  # not in the vocabulary: named by its index in the pool
  with pytest.raises(ValueError, match=r"prompt 6 cannot be tokenised"):
    tokenize_prompts(records, tok, 8)


def _take(ds, k):
  return [ds.next_batch() for _ in range(k)]


def test_stream_is_deterministic_and_covers_each_epoch_once():
  records = _records(10)
  a = PromptDataset(records, _tokenizer(), batch_size=4, max_prompt_len=8, seed=3)
  b = PromptDataset(records, _tokenizer(), batch_size=4, max_prompt_len=8, seed=3)
  c = PromptDataset(records, _tokenizer(), batch_size=4, max_prompt_len=8, seed=4)
  ba, bb, bc = _take(a, 10), _take(b, 10), _take(c, 10)
  stream_a = np.concatenate([x.indices for x in ba])
  np.testing.assert_array_equal(stream_a, np.concatenate([x.indices for x in bb]))
  assert not np.array_equal(stream_a, np.concatenate([x.indices for x in bc]))
  # 40 draws over a pool of 10: four epochs, each a permutation, different from each other.
  epochs = stream_a.reshape(4, 10)
  for e in epochs:
    assert sorted(e) == list(range(10))
  assert len({tuple(e) for e in epochs}) == 4
  assert a.epoch == 4
  # Batches hold the records and token rows of their indices.
  tokens, lengths = tokenize_prompts(records, _tokenizer(), 8)
  for batch in ba:
    assert batch.tokens.shape == (4, 8) and batch.tokens.dtype == np.int32
    assert [r["id"] for r in batch.records] == batch.indices.tolist()
    np.testing.assert_array_equal(batch.tokens, tokens[batch.indices])
    np.testing.assert_array_equal(batch.mask.sum(1), lengths[batch.indices])


def test_unshuffled_stream_is_file_order_and_batch_may_exceed_pool():
  ds = PromptDataset(_records(3), _tokenizer(), batch_size=7, max_prompt_len=8, shuffle=False)
  np.testing.assert_array_equal(ds.next_batch().indices, [0, 1, 2, 0, 1, 2, 0])
  np.testing.assert_array_equal(ds.next_batch().indices, [1, 2, 0, 1, 2, 0, 1])


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 5])
def test_resume_continues_exactly(stop_after):
  records = _records(11)
  straight = PromptDataset(records, _tokenizer(), batch_size=4, max_prompt_len=8, seed=7)
  expected = [x.indices for x in _take(straight, 8)]

  first = PromptDataset(records, _tokenizer(), batch_size=4, max_prompt_len=8, seed=7)
  got = [x.indices for x in _take(first, stop_after)]
  state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
  assert all(isinstance(v, int) and 0 <= v < 2**31 for v in state.values())
  resumed = PromptDataset(records, _tokenizer(), batch_size=4, max_prompt_len=8, seed=7)
  resumed.load_state_dict(state)
  got += [x.indices for x in _take(resumed, 8 - stop_after)]
  for e, g in zip(expected, got):
    np.testing.assert_array_equal(e, g)


def test_resume_onto_a_different_pool_or_seed_fails():
  ds = PromptDataset(_records(6), _tokenizer(), batch_size=2, max_prompt_len=8, seed=1)
  ds.next_batch()
  state = ds.state_dict()
  other_seed = PromptDataset(_records(6), _tokenizer(), batch_size=2, max_prompt_len=8, seed=2)
  with pytest.raises(ValueError, match="seed=1 but this dataset has seed=2"):
    other_seed.load_state_dict(state)
  other_pool = PromptDataset(_records(6, np.random.default_rng(9)), _tokenizer(), batch_size=2,
                             max_prompt_len=8, seed=1)
  with pytest.raises(ValueError, match="fingerprint=.*different prompt pool"):
    other_pool.load_state_dict(state)
  with pytest.raises(ValueError, match=r"lacks \['index'\]"):
    ds.load_state_dict({k: v for k, v in state.items() if k != "index"})


def test_constructor_errors():
  with pytest.raises(ValueError, match="batch_size=0"):
    PromptDataset(_records(2), _tokenizer(), batch_size=0, max_prompt_len=8)
  with pytest.raises(ValueError, match="record 1: field 'prompt' must be a string, got NoneType"):
    PromptDataset([{"prompt": "w1"}, {"text": "w2"}], _tokenizer(), batch_size=1, max_prompt_len=8)
  with pytest.raises(ValueError, match="empty"):
    PromptDataset([], _tokenizer(), batch_size=1, max_prompt_len=8)
  with pytest.raises(ValueError, match="cannot encode 'w1 zzz'"):
    PromptDataset([{"prompt": "w1 zzz"}], _tokenizer(), batch_size=1, max_prompt_len=8)
