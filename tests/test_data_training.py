"""The trainer on a user's data and reward: a parquet dataset with question/answer columns, the
tokenizer's chat template, a reward function by import path, a held-out split and the periodic
validation pass (metrics.jsonl and TensorBoard), which leaves training untouched."""
import glob
import json
import os
import struct

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tensorboardX.proto import event_pb2

from rlhfuse_jax.data.tokenizer import HFTokenizer
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.trainer import evaluation
from rlhfuse_jax.trainer.loop import PPOTrainer, TIMING_PREFIXES
from tests.test_rewards import answer_length
from tests.test_trainer import record_rollouts, tiny_config

CHAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tiny_chat")
with open(os.path.join(CHAT, "goldens.json"), encoding="utf-8") as _f:
  GOLDENS = json.load(_f)
VAL = 3  # held-out prompts of the 12


def _rows():
  """12 rows: the goldens' 'user' and 'system_user' conversations (whose ids transformers
  recorded) and 10 'What is a plus b?' strings."""
  convs = GOLDENS["conversations"]
  rows = [{"question": convs["user"], "answer": 42, "golden": "user"},
          {"question": convs["system_user"], "answer": 24, "golden": "system_user"}]
  rows += [{"question": [{"role": "user", "content": f"What is {a} plus {b}?"}], "answer": a + b,
            "golden": ""} for a, b in zip(range(3, 13), range(20, 30))]
  return rows


def _config(path, workdir_eval_every, **extra):
  return tiny_config(**{
      "num_iterations": 3, "eval_every": workdir_eval_every,
      "init.tokenizer": os.path.join(CHAT, "chatml", "tokenizer.json"),
      "data.prompts_file": path, "data.prompt_key": "question", "data.answer_key": "answer",
      "data.chat_template": "auto", "data.val_fraction": VAL / 12, "data.max_prompt_len": 40,
      "reward.function": "tests.test_rewards:answer_length",
      "rollout.prompts_per_iteration": 4, "algo.minibatch_size": 4, "algo.epochs": 1,
      "rollout.max_new_tokens": 6, "rollout.chunk_size": 3, "checkpoint.every": 100, **extra})


def _tb_scalars(workdir):
  """{tag: {step: value}} from the run's TensorBoard event files (TFRecord framing)."""
  out = {}
  for path in glob.glob(os.path.join(workdir, "tb", "events.*")):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      for v in event.summary.value:
        out.setdefault(v.tag, {})[event.step] = v.simple_value
  return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("data_training")
  path = str(tmp / "train.parquet")
  pq.write_table(pa.Table.from_pylist(_rows()), path)
  out = {}
  for every in (2, 0):
    trainer = PPOTrainer(_config(path, every), str(tmp / f"every{every}"), mesh=mesh_lib.make_mesh(
        mesh_lib.MeshConfig(data=1), jax.devices()[:1]))
    seen = record_rollouts(trainer)
    keys, recorded = [], trainer.rollout  # the key of each call, in order

    def keyed(params, prompts, key, recorded=recorded, keys=keys):
      keys.append(key)
      return recorded(params, prompts, key)
    trainer.rollout = keyed
    out[every] = dict(trainer=trainer, seen=seen, keys=keys, history=trainer.run(),
                      workdir=str(tmp / f"every{every}"))
  return out


def test_the_validation_pass_after_an_iteration_folds_that_iterations_key(runs):
  """The pass after 0-based iteration i samples its batch b with fold_in(fold_in(k_i,
  VALIDATION_STREAM), b), k_i the key iteration i generated with (trainer/evaluation.py): the
  policy after iteration i, the stream of iteration i. The pass given the 1-based step drew the
  stream of the next iteration's. (Mutation audit of trainer/, L18.)"""
  data = lambda k: np.asarray(jax.random.key_data(k))  # noqa: E731
  keys = runs[2]["keys"]  # train 1, train 2, validation, train 3, validation
  assert len(keys) == 5
  for train, val in ((keys[1], keys[2]), (keys[3], keys[4])):
    want = jax.random.fold_in(jax.random.fold_in(train, evaluation.VALIDATION_STREAM), 0)
    np.testing.assert_array_equal(data(val), data(want))


def test_validation_pass_scores_the_held_out_prompts(runs):
  """eval_every=2 over 3 iterations: passes after iterations 2 and 3 (the last), each one
  rollout of the 3 held-out prompts in file order plus one filler row; val/reward_mean is
  answer_length of the decoded held-out responses (filler dropped); the same values reach
  metrics.jsonl and TensorBoard."""
  r = runs[2]
  trainer, seen = r["trainer"], r["seen"]
  tok = HFTokenizer.from_file(os.path.join(CHAT, "chatml"))
  held_out = trainer.held_out.dataset.records
  assert len(held_out) == VAL
  train_prompts = {r["_source"] for r in trainer.dataset.records}
  assert not train_prompts & {r["_source"] for r in held_out}
  # Calls in order: train 1, train 2, validation, train 3, validation.
  kinds = ["val" if p.records[0]["_source"] not in train_prompts else "train" for p, _ in seen]
  assert kinds == ["train", "train", "val", "train", "val"]
  with open(os.path.join(r["workdir"], "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  tb = _tb_scalars(r["workdir"])
  val_calls = [s for s, k in zip(seen, kinds) if k == "val"]
  for (prompts, out), step in zip(val_calls, (2, 3), strict=True):
    assert [p["_source"] for p in prompts.records] == [h["_source"] for h in held_out] + [
        held_out[0]["_source"]]
    texts = [_text(tok, out.rollout.response_tokens[i, :out.rollout.response_lens[i]])
             for i in range(VAL)]
    want = np.mean([answer_length(t, None, {}) for t in texts])
    row = rows[step - 1]
    assert row["val/reward_mean"] == pytest.approx(want, abs=1e-6)
    assert row["val/prompts"] == VAL
    assert row["val/response_length_mean"] == pytest.approx(
        np.mean(out.rollout.response_lens[:VAL]))
    assert tb["val/reward_mean"][step] == pytest.approx(want, abs=1e-6)
  assert "val/reward_mean" not in rows[0] and set(tb["val/reward_mean"]) == {2, 3}
  # Responses of different lengths: a mean that a wrong row selection would change.
  assert len({len(t) for t in texts}) > 1


def _text(tok, ids):
  """A response as the reward functions read it: up to its EOS, a special token inside it
  (the random policy writes <|im_start|> at times) a U+FFFD between the pieces around it."""
  ids = list(ids)
  if ids and ids[-1] in tok.stop_ids:
    ids = ids[:-1]
  pieces, current = [], []
  for i in ids:
    if i in tok.special_ids:
      pieces.append(current)
      current = []
    else:
      current.append(i)
  return "\ufffd".join(tok.decode(p) for p in pieces + [current])


def test_prompts_are_the_chat_rendered_rows(runs):
  """Training and validation generate from the chat-rendered questions: the held-out golden
  conversations' prompt tokens are transformers' ids (goldens.json), every training prompt is
  the ChatML text written out here by hand; the reward is the user function of the decoded
  responses, and each record carries its answer column as text."""
  r = runs[2]
  tok = HFTokenizer.from_file(os.path.join(CHAT, "chatml"))
  train = r["trainer"].dataset.records
  goldens = set()
  for prompts, out in r["seen"]:
    for i, rec in enumerate(prompts.records):
      ids = prompts.tokens[i, :prompts.lens[i]].tolist()
      if rec["golden"]:
        assert ids == GOLDENS["chatml"]["conversations"][rec["golden"]]["ids"]
        goldens.add(rec["golden"])
      else:
        text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                f"{rec['question'][0]['content']}<|im_end|>\n<|im_start|>assistant\n")
        assert ids == tok.encode(text, add_bos=False)
      assert rec["target"] == str(rec["answer"])
    texts = [_text(tok, out.rollout.response_tokens[i, :out.rollout.response_lens[i]])
             for i in range(len(prompts.records))]
    np.testing.assert_allclose(out.scores, [answer_length(t, None, {}) for t in texts],
                               atol=1e-6)
  # With seed 0 the split holds out rows 0, 1 and 8: both golden conversations are validated.
  assert goldens == {"user", "system_user"}
  assert not any(rec["golden"] for rec in train)


def test_the_validation_pass_reports_each_reward_terms_mean(tmp_path):
  """With reward.format the pass also logs each term's unweighted mean over the held-out
  prompts, val/function_mean and val/format_mean (the held-out accuracy of a verifier without
  the format bonus), its filler rows dropped, through the trainer's own rollout stage. Here
  the format term is 100 x the function's (characters against characters / 100), so a swap
  of the two or a filler row counted shows."""
  path = str(tmp_path / "train.parquet")
  pq.write_table(pa.Table.from_pylist(_rows()), path)
  cfg = _config(path, 1, **{"num_iterations": 1, "reward.format_weight": 0.5,
                            "reward.format": "tests.test_rewards:with_defaults"})
  trainer = PPOTrainer(cfg, str(tmp_path / "run"), mesh=mesh_lib.make_mesh(
      mesh_lib.MeshConfig(data=1), jax.devices()[:1]))
  seen = record_rollouts(trainer)
  row = trainer.run()[-1]
  (out,) = [o for p, o in seen
            if p.records[0]["_source"] == trainer.held_out.dataset.records[0]["_source"]]
  tok = HFTokenizer.from_file(os.path.join(CHAT, "chatml"))
  scores = [answer_length(_text(tok, out.rollout.response_tokens[i, :n]), None, {})
            for i, n in enumerate(out.rollout.response_lens)]
  want = np.mean(scores[:VAL])
  assert row["val/function_mean"] == pytest.approx(want, abs=1e-6)
  assert row["val/format_mean"] == pytest.approx(100 * want, abs=1e-4)
  assert row["val/reward_mean"] == pytest.approx(want + 50 * want, abs=1e-4)
  # The filler row (the first held-out prompt again) answered otherwise: counting it would
  # change the means.
  assert len(scores) == VAL + 1 and np.mean(scores) != pytest.approx(want, abs=1e-4)


def test_validation_leaves_training_untouched(runs):
  """The run without validation (eval_every=0) trains identically: same sampled tokens, same
  deterministic metrics; only val/* and its timing differ."""
  a, b = runs[2], runs[0]
  train_a = [out for p, out in a["seen"] if p.records[0] in a["trainer"].dataset.records]
  train_b = [out for _, out in b["seen"]]
  assert len(train_a) == len(train_b) == 3
  for x, y in zip(train_a, train_b):
    np.testing.assert_array_equal(x.rollout.response_tokens, y.rollout.response_tokens)
  for ha, hb in zip(a["history"], b["history"], strict=True):
    det = lambda h: {k: v for k, v in h.items() if not k.startswith(TIMING_PREFIXES + ("val/",))}
    assert det(ha) == det(hb)


def test_overlong_prompts_stop_the_run_or_are_left_out(tmp_path, caplog):
  """data.overlong_prompts: 'error' (the default) names the prompt, its row and the field to
  change; 'skip' leaves it out of the training and validation pools (verl's
  filter_overlong_prompts: a few long rows of a large dataset needed offline filtering), logging
  how many; a pool with nothing left is an error."""
  import logging
  from rlhfuse_jax.trainer import build
  rows = [{"question": f"What is {a} plus {a}?", "answer": 2 * a} for a in range(8)]
  rows[5]["question"] = " ".join(["What is one plus one?"] * 12)
  path = tmp_path / "p.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))

  def datasets(**kw):
    cfg = tiny_config(**{"init.tokenizer": os.path.join(CHAT, "chatml", "tokenizer.json"),
                         "data.prompts_file": str(path), "data.prompt_key": "question",
                         "data.answer_key": "answer", "data.chat_template": "auto",
                         "data.val_fraction": 0.25, "data.max_prompt_len": 40,
                         "reward.function": "tests.test_rewards:answer_length",
                         "rollout.prompts_per_iteration": 4, "algo.minibatch_size": 4, **kw})
    task, tok = build.build_task_and_tokenizer(cfg)
    return build.build_datasets(cfg, task, tok)
  with pytest.raises(ValueError, match=r"p\.jsonl:6\) has \d+ tokens, more than max_prompt_len=40 "
                     r".*config\.data\.overlong_prompts='skip'"):
    datasets()
  with caplog.at_level(logging.WARNING):
    train, val = datasets(**{"data.overlong_prompts": "skip"})
  assert len(train.records) + len(val.records) == 7
  assert "left out 1 of the" in caplog.text and "p.jsonl:6" in caplog.text
  with pytest.raises(ValueError, match=r"every one of the \d training prompts is longer than "
                     r"config\.data\.max_prompt_len=5 tokens"):
    datasets(**{"data.overlong_prompts": "skip", "data.max_prompt_len": 5})
  with pytest.raises(ValueError, match=r"config\.data\.overlong_prompts='drop'.*'error' or 'skip'"):
    datasets(**{"data.overlong_prompts": "drop"})
