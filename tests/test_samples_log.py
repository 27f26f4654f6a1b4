"""samples.jsonl (config.log_samples): each sample's ground truth and its reward's terms, so a
user can see why it scored what it did."""
import json
import os

import numpy as np

from rlhfuse_jax.data import tasks
from rlhfuse_jax.trainer import async_ppo, loop
from rlhfuse_jax.trainer.loop import PPOTrainer
from tests.test_trainer import record_rollouts, tiny_config


def test_logged_samples_carry_their_target_and_reward_terms(tmp_path):
  cfg = tiny_config(**{"num_iterations": 1, "log_samples": 3, "reward.format": "length_match",
                       "reward.format_weight": 0.5})
  trainer = PPOTrainer(cfg, str(tmp_path))
  seen = record_rollouts(trainer)
  trainer.run()
  with open(os.path.join(tmp_path, "samples.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  (prompts, out), = seen
  assert [r["sample"] for r in rows] == [0, 1, 2]
  for r in rows:
    b = r["sample"]
    assert r["target"] == prompts.records[b]["target"]  # the ground truth the verifier read
    terms = r["reward_terms"]
    assert set(terms) == {"function", "format"}
    assert terms == {k: float(v[b]) for k, v in out.reward_terms.items()}
    assert r["reward"] == float(out.scores[b])
    np.testing.assert_allclose(r["reward"], terms["function"] + 0.5 * terms["format"],
                               rtol=1e-6)


def _generated(**kw):
  tok = tasks.make_task("repeat").tokenizer
  ids = tok.encode("1 #2 =")
  p, t = len(ids), 3
  tokens = np.full((2, p + t), tok.pad_id, np.int32)
  tokens[:, :p] = ids
  gen = async_ppo.Generated(
      iteration=1, version=0, tokens=tokens, prompt_lens=np.array([p, p], np.int32),
      response_tokens=np.full((2, t), tok.pad_id, np.int32),
      response_lens=np.array([0, 0], np.int32), logprobs=np.zeros((2, t), np.float32),
      ref_logp=None, values=np.zeros((2, t), np.float32),
      scores=np.array([0.75, 0.0], np.float32), metrics={}, **kw)
  return gen, tok


def test_a_sample_without_a_target_has_none_and_one_term_is_the_reward():
  gen, tok = _generated(targets=[None, "7 7"])
  rows = loop.sample_rows(gen, tok, 2, "model")
  assert "target" not in rows[0] and rows[1]["target"] == "7 7"
  assert [r["reward_terms"] for r in rows] == [{"model": 0.75}, {"model": 0.0}]


def test_a_batch_in_flight_keeps_what_its_samples_log_shows_across_a_checkpoint():
  """Async PPO: a batch restored from a checkpoint logs its samples as the one generated did."""
  terms = {"function": np.array([1.0, 0.0], np.float32),
           "format": np.array([0.5, 0.25], np.float32)}
  gen, tok = _generated(targets=["7 7", None], reward_terms=terms)
  back = async_ppo.Generated.restore(gen.arrays(), json.loads(json.dumps(gen.side_car())))
  assert back.ref_logp is None  # saved as zeros, restored as absent
  assert loop.sample_rows(back, tok, 2) == loop.sample_rows(gen, tok, 2)
  assert loop.sample_rows(back, tok, 2)[1]["reward_terms"] == {"function": 0.0, "format": 0.25}
