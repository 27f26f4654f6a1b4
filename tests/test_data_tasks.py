"""Synthetic tasks: vocabularies, prompt semantics, rewards (scalar == vectorised), length tails."""
import numpy as np
import pytest

from rlhfuse_jax.data.lengths import LengthDistribution
from rlhfuse_jax.data.prompts import PromptDataset
from rlhfuse_jax.data.rewards import (REWARD_FUNCTIONS, get_reward_function, response_extent)
from rlhfuse_jax.data.tasks import TASKS, TaskConfig, make_task

ALL_TASKS = sorted(TASKS)


def _ids(task, text, eos=True):
  return task.tokenizer.encode(text, add_bos=False) + ([task.tokenizer.eos_id] if eos else [])


def _pack(rows, width, fill):
  out = np.full((len(rows), width), fill, dtype=np.int32)  # [B, T]
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out, np.array([len(r) for r in rows], dtype=np.int32)


def test_registries_reject_unknown_names():
  with pytest.raises(ValueError,
                     match=r"unknown task 'nope'; known: \['count_up', 'countdown', 'repeat'"):
    make_task("nope")
  with pytest.raises(ValueError, match="unknown task 'nope'"):
    TaskConfig(name="nope")
  with pytest.raises(ValueError, match=r"unknown reward function 'nope'; known: \[.*target_match"):
    get_reward_function("nope")
  assert get_reward_function("target_match") is REWARD_FUNCTIONS["target_match"]
  with pytest.raises(ValueError, match="num_symbols=11"):
    TaskConfig(num_symbols=11)
  with pytest.raises(ValueError, match=r"num_symbols=1: expected 2\.\.10"):
    TaskConfig(num_symbols=1)
  assert [TaskConfig(num_symbols=n).num_symbols for n in (2, 10)] == [2, 10]  # both ends valid
  with pytest.raises(ValueError, match="length_dist='zipf'"):
    TaskConfig(length_dist="zipf")
  with pytest.raises(ValueError, match="max_len=2 must be >= min_len=3"):
    TaskConfig(length_min=3, length_max=2)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_task_vocabulary_round_trips(name):
  task = make_task(name, num_symbols=7, length_max=12)
  tok = task.tokenizer
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size == 4 + 7 + 12
  for record in task.make_prompts(50, 0):
    ids = tok.encode(record["prompt"])
    assert ids[0] == tok.bos_id and len(ids) <= task.max_prompt_len
    assert tok.decode(ids) == record["prompt"]
    target = task.target_ids(record)
    assert target[-1] == tok.eos_id and len(target) <= task.max_response_len
    assert tok.decode(target) == record["target"]
  with pytest.raises(ValueError, match="cannot encode"):
    tok.encode("7 #1 =")  # symbol 7 is outside a 7-symbol vocabulary


def test_prompts_mean_what_they_say():
  rng = np.random.default_rng(0)
  for r in make_task("repeat").make_prompts(100, rng):
    assert r["target"].split() == [str(r["symbol"])] * r["count"]
    assert r["prompt"] == f"{r['symbol']} #{r['count']} ="
  for r in make_task("count_up", num_symbols=5).make_prompts(100, rng):
    assert r["target"].split() == [str((r["symbol"] + i) % 5) for i in range(r["count"])]
  for r in make_task("countdown").make_prompts(100, rng):
    assert r["target"].split() == [f"#{c}" for c in range(r["count"], 0, -1)]
    assert r["prompt"] == f"#{r['count']} ="
  for r in make_task("sort").make_prompts(100, rng):
    xs = r["prompt"].split()[:-1]
    assert len(xs) == r["count"] and r["target"].split() == sorted(xs)
  task = make_task("repeat")
  assert task.make_prompts(20, 5) == task.make_prompts(20, np.random.default_rng(5))
  assert task.make_prompts(20, 5) != task.make_prompts(20, 6)


def test_repeat_reward_hand_computed():
  task = make_task("repeat")
  record = {"prompt": "3 #4 =", "target": "3 3 3 3", "symbol": 3, "count": 4}
  eos = task.tokenizer.eos_id
  cases = {  # response ids -> reward; the target is 3 3 3 3 <eos> (5 positions)
      "3 3 3 3": 1.0,
      "3 3": 2 / 5,  # stopped early
      "3 3 3 3 3 3": 4 / 7,  # ran on
      "3 5 3 3": 4 / 5,  # one wrong symbol
      "5 5 5 5": 1 / 5,  # only the stop is right
  }
  for text, expected in cases.items():
    assert task.reward(record, _ids(task, text)) == pytest.approx(expected)
    assert task.reward(record, text) == pytest.approx(expected)  # text: a finished answer
  assert task.reward(record, _ids(task, "3 3 3 3", eos=False)) == pytest.approx(4 / 5)
  assert task.reward(record, _ids(task, "3 3 3 3") + [eos, 5, 0, 0]) == 1.0  # after EOS: ignored
  assert task.reward(record, []) == 0.0


@pytest.mark.parametrize("name", ALL_TASKS)
@pytest.mark.parametrize("length_dist", ["uniform", "lognormal"])
def test_batch_rewards_equal_scalar_rewards(name, length_dist):
  task = make_task(name, length_dist=length_dist, length_max=16, length_mu=1.2)
  rng = np.random.default_rng(1)
  records = task.make_prompts(300, rng)
  v, width = task.tokenizer.vocab_size, 20
  rows = []
  for i, r in enumerate(records):
    kind = i % 4
    if kind == 0:  # the right answer, sometimes with junk after EOS
      row = task.target_ids(r) + list(rng.integers(0, v, size=rng.integers(0, 3)))
    elif kind == 1:  # right answer with one corrupted position
      row = task.target_ids(r)
      row[rng.integers(len(row))] = int(rng.integers(3, v))
    else:  # random tokens (EOS comes up by chance), random length, maybe none generated
      row = list(rng.integers(0, v, size=rng.integers(0, width + 1)))
    rows.append(row[:width])
  ids, lengths = _pack(rows, width, fill=task.tokenizer.pad_id)
  batch = task.batch_rewards(records, ids, lengths)
  scalar = np.array([task.reward(r, row) for r, row in zip(records, rows)])
  assert batch.shape == (300,) and batch.dtype == np.float32
  np.testing.assert_allclose(batch, scalar, rtol=1e-6)
  assert np.all((batch >= 0) & (batch <= 1))
  exact = np.array([row[:len(task.target_ids(r))] == task.target_ids(r)
                    for r, row in zip(records, rows)])
  np.testing.assert_array_equal(batch == 1.0, exact)  # 1.0 exactly for right answers
  assert exact.sum() >= 75


def test_other_reward_functions():
  task = make_task("repeat")
  tok = task.tokenizer
  records = [{"target": "3 3 3"}] * 6
  three = _ids(task, "3", eos=False)
  # The last row holds an id beyond the tokenizer's vocabulary (a padded model embedding can
  # sample one); decode would drop it silently.
  rows = [_ids(task, "3 3 3"), _ids(task, "4 4 4"), _ids(task, "3 3 3", eos=False),
          _ids(task, "3 <pad> 3 3"), _ids(task, "3"),
          three + [tok.vocab_size + 3] + _ids(task, "3 3")]
  ids, lengths = _pack(rows, 6, fill=tok.pad_id)
  np.testing.assert_array_equal(REWARD_FUNCTIONS["exact_match"](records, ids, lengths, tok),
                                [1, 0, 0, 0, 0, 0])
  np.testing.assert_allclose(REWARD_FUNCTIONS["length_match"](records, ids, lengths, tok),
                             [1, 1, 3 / 4, 4 / 5, 2 / 4, 4 / 5])
  np.testing.assert_allclose(REWARD_FUNCTIONS["target_match"](records, ids, lengths, tok),
                             [1, 1 / 4, 3 / 4, 2 / 5, 1 / 4, 2 / 5])
  rlen, stopped = response_extent(ids, lengths, tok.eos_id)
  np.testing.assert_array_equal(rlen, [4, 4, 3, 5, 2, 5])
  np.testing.assert_array_equal(stopped, [1, 1, 0, 1, 1, 1])
  with pytest.raises(ValueError, match="response_lengths must lie in"):
    response_extent(ids, lengths + 3, tok.eos_id)
  with pytest.raises(ValueError, match="needs a string 'target'"):
    REWARD_FUNCTIONS["target_match"]([{"prompt": "x"}] * 6, ids, lengths, tok)


def test_random_policy_scores_low_and_copying_leaves_headroom():
  """What an RL run starts from and what the first thing it can learn is worth (repeat task)."""
  task = make_task("repeat")
  rng = np.random.default_rng(0)
  records = task.make_prompts(4000, rng)
  tok, width = task.tokenizer, 16
  # A randomly initialised policy is close to uniform over the vocabulary.
  random_ids = rng.integers(0, tok.vocab_size, size=(4000, width)).astype(np.int32)
  random_reward = task.batch_rewards(records, random_ids, np.full(4000, width))
  assert 0.01 < random_reward.mean() < 0.05
  assert (random_reward > 0).mean() > 0.15  # enough samples carry a gradient signal
  # Copying the prompt symbol and always stopping after 5 ignores the count, yet scores ~0.57.
  copy_rows = [_ids(task, " ".join([str(r["symbol"])] * 5)) for r in records]
  copy_ids, copy_len = _pack(copy_rows, width, fill=tok.pad_id)
  copy_reward = task.batch_rewards(records, copy_ids, copy_len).mean()
  assert copy_reward > random_reward.mean() + 0.4
  assert copy_reward < 0.7  # the count still matters


def test_lognormal_lengths_are_long_tailed_and_clipped():
  rng = np.random.default_rng(0)
  tail = LengthDistribution(kind="lognormal", min_len=2, max_len=128, mu=2.0, sigma=0.9)
  n = tail.sample(rng, 20000)
  assert n.min() >= 2 and n.max() <= 128 and n.dtype == np.int64
  p50, p99 = np.percentile(n, [50, 99])
  assert 6 <= p50 <= 9  # exp(2) = 7.4
  assert p99 / p50 > 5  # exp(2.33 * 0.9) = 8.1 before rounding
  assert n.mean() > p50 * 1.2  # right-skewed

  clipped = LengthDistribution(kind="lognormal", min_len=3, max_len=20, mu=2.0, sigma=0.9)
  c = clipped.sample(np.random.default_rng(0), 20000)
  assert c.min() == 3 and c.max() == 20
  assert 0.05 < (c == 20).mean() < 0.2  # the clipped tail piles up at max_len

  flat = LengthDistribution(kind="uniform", min_len=1, max_len=8).sample(rng, 8000)
  counts = np.bincount(flat, minlength=9)[1:]
  assert counts.min() > 850 and counts.max() < 1150
  p50, p99 = np.percentile(flat, [50, 99])
  assert p99 / p50 < 2.5

  # The task draws its target lengths from the configured distribution.
  task = make_task("repeat", length_dist="lognormal", length_min=1, length_max=64,
                   length_mu=2.0, length_sigma=0.9)
  counts = np.array([r["count"] for r in task.make_prompts(5000, 0)])
  assert np.percentile(counts, 99) / np.percentile(counts, 50) > 4
  assert task.max_response_len == 65 and task.tokenizer.vocab_size == 4 + 10 + 64


def test_task_prompts_feed_a_prompt_dataset():
  task = make_task("sort", length_max=6)
  ds = PromptDataset(task.make_prompts(64, 0), task.tokenizer, batch_size=16,
                     max_prompt_len=task.max_prompt_len, seed=0)
  batch = ds.next_batch()
  assert batch.tokens.shape == (16, 8)
  np.testing.assert_array_equal(batch.lengths, [r["count"] + 2 for r in batch.records])
  np.testing.assert_array_equal(batch.tokens[:, 0], task.tokenizer.bos_id)
