"""Cheap tests proposed by a third mutation audit (models/, inference/scoring.py, trainer/, data/,
perf/): each one fails under a plausible bug that the rest of the suite lets through (see the
audit report for the mutation each kills)."""
import dataclasses
import functools
import json
import os
import shutil
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import ppo_tiny
from rlhfuse_jax.data import lengths
from rlhfuse_jax.data import prompts
from rlhfuse_jax.data import records
from rlhfuse_jax.data import tasks
from rlhfuse_jax.data.tokenizer import HFTokenizer
from rlhfuse_jax.inference.scoring import ScoringBatch
from rlhfuse_jax.models import attention as attn
from rlhfuse_jax.models import hf_loader
from rlhfuse_jax.models import llama
from rlhfuse_jax.models import sequences
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.perf import hlo_flops
from rlhfuse_jax.perf import timing
from rlhfuse_jax.trainer import async_ppo
from rlhfuse_jax.trainer import build
from rlhfuse_jax.trainer import evaluation
from rlhfuse_jax.trainer import loop
from rlhfuse_jax.trainer import ppo
from rlhfuse_jax.trainer import rollout as rollout_lib
from rlhfuse_jax.trainer import validate as validate_lib
from rlhfuse_jax.trainer.config import AlgoConfig, TrainConfig

_FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


# models/attention.py -----------------------------------------------------------------------------

def _qkv(b, l, s, h, kvh, d=8, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(b, l, h, d)), jnp.float32),
          jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.float32),
          jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.float32))


def _positions(b, n, start):
  return jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(n, dtype=jnp.int32)[None]


def test_a_prefill_in_several_query_passes_keeps_each_pass_at_its_positions():
  """cached_attention splits a long prefill into passes of block_q queries: each pass must mask
  with its own queries' positions (5 queries in passes of 2, rows at different offsets)."""
  b, s, l, h, kvh = 2, 12, 5, 4, 2
  q, _, _ = _qkv(b, l, s, h, kvh, seed=3)
  rng = np.random.default_rng(4)
  kc = jnp.asarray(rng.normal(size=(1, b, s, kvh, 8)), jnp.float32)
  vc = jnp.asarray(rng.normal(size=(1, b, s, kvh, 8)), jnp.float32)
  q_pos = _positions(b, l, [0, 6])
  got, _, _ = attn.cached_attention(q, kc, vc, 0, q_pos, jnp.max(q_pos) + 1, block_k=4,
                                    block_q=2)
  k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  want = attn.reference_attention(q, kc[0], vc[0], q_pos, k_pos)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_cudnn_call_masks_keys_after_each_query_inclusive(monkeypatch):
  """The GPU path's boolean mask: key s is visible to query t iff k_pos[s] <= q_pos[t] (its own
  position included). Checked on CPU by running the same jax.nn call with XLA's implementation
  against a numpy softmax."""
  real = jax.nn.dot_product_attention

  def xla(*args, implementation=None, **kw):
    return real(*args, implementation="xla", **kw)
  monkeypatch.setattr(jax.nn, "dot_product_attention", xla)
  b, l, s, h, kvh, d = 2, 3, 6, 2, 1, 8
  q, k, v = _qkv(b, l, s, h, kvh, d, seed=5)
  q_pos = _positions(b, l, [0, 3])
  k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  got = np.asarray(attn.cudnn_attention(q, k, v, q_pos, k_pos))
  qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
  for i in range(b):
    for t in range(l):
      n = int(q_pos[i, t]) + 1  # keys 0..q_pos inclusive
      for head in range(h):
        sc = kn[i, :n, 0] @ qn[i, t, head] / np.sqrt(d)
        p = np.exp(sc - sc.max())
        np.testing.assert_allclose(got[i, t, head], (p / p.sum()) @ vn[i, :n, 0], atol=1e-5)


# models/llama.py ---------------------------------------------------------------------------------

_SCALAR = llama.ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1, max_seq_len=32, head="scalar")


def test_the_value_head_adds_its_bias():
  """A scalar head is final_norm(x) @ value_head + value_bias: a reward model's loaded
  score.bias (and a critic's trained bias) shifts every value by exactly that amount."""
  params = llama.host_random_params(_SCALAR, 0)
  tokens = jnp.asarray([[3, 4, 5, 6]], jnp.int32)
  base, _ = llama.apply(_SCALAR, params, tokens)
  shifted = jax.tree.map(lambda x: x, params)
  shifted["head"] = dict(params["head"], value_bias=params["head"]["value_bias"] + 0.75)
  got, _ = llama.apply(_SCALAR, shifted, tokens)
  np.testing.assert_allclose(np.asarray(got) - np.asarray(base), 0.75, atol=1e-6)


def test_cache_bytes_per_token_count_keys_and_values():
  """KVCache.nbytes_per_token: what one token of one row occupies, K and V over all layers."""
  cache = llama.KVCache.zeros(_SCALAR.replace(num_layers=3), batch=2, max_len=5,
                              dtype="bfloat16")
  assert cache.nbytes_per_token() == (cache.k.nbytes + cache.v.nbytes) // (2 * 5)


@pytest.mark.parametrize("fields,match", [
    (dict(hidden_size=18, num_heads=2, head_dim=9), "must be even"),
    (dict(num_heads=3, num_kv_heads=2, head_dim=4), "multiple of"),
    (dict(score_pad_id=-2), "score_pad_id"),
])
def test_model_config_refuses_shapes_the_model_cannot_run(fields, match):
  """Checked at construction, naming the field: RoPE rotates pairs (even head_dim), and GQA
  groups whole query heads per KV head."""
  with pytest.raises(ValueError, match=match):
    _SCALAR.replace(**fields)


# models/sequences.py, inference/scoring.py -------------------------------------------------------

def test_a_pad_id_of_zero_is_skipped_like_any_other():
  """score_positions: pad_id 0 (a vocabulary whose pad is id 0) is a real pad id, skipped as any
  id >= 0 is; only -1 means "the last response token"."""
  tokens = np.array([[5, 6, 7, 0, 0, 0], [5, 0, 6, 8, 0, 0]], np.int32)
  plens, rlens = np.array([2, 2]), np.array([3, 3])  # rows end at columns 4 and 4
  got = np.asarray(sequences.score_positions(jnp.asarray(tokens), plens, rlens, 0))
  want = [max(i for i in range(p + r) if tokens[b, i] != 0)
          for b, (p, r) in enumerate(zip(plens, rlens))]
  np.testing.assert_array_equal(got, want)  # [2, 3]
  np.testing.assert_array_equal(sequences.score_positions(jnp.asarray(tokens), plens, rlens, -1),
                                plens + rlens - 1)


def test_a_response_longer_than_its_row_is_refused():
  """ScoringBatch: response_lens may reach T, not T + 1 (the last token would be read past the
  row's response columns)."""
  tok = np.arange(1, 10, dtype=np.int32)[None]  # P = 4, T = 5
  ScoringBatch(tok, np.array([4], np.int32), tok[:, 4:], np.array([5], np.int32))
  with pytest.raises(ValueError, match=r"response_lens must be in \[0, 5\]"):
    ScoringBatch(tok, np.array([4], np.int32), tok[:, 4:], np.array([6], np.int32))


# models/hf_loader.py -----------------------------------------------------------------------------

def _llama_config():
  with open(os.path.join(_FIXTURES, "tiny_llama", "config.json")) as f:
    return json.load(f)


def test_config_defaults_and_precedence_follow_transformers():
  """A config.json without tie_word_embeddings is untied (LlamaConfig's default); with both
  rope_parameters and a legacy rope_theta, rope_parameters' theta is the one used."""
  hf = _llama_config()
  hf.pop("tie_word_embeddings", None)
  assert not hf_loader.config_from_hf(hf).tie_embeddings
  both = dict(_llama_config(), rope_theta=10000.0)
  both["rope_parameters"] = dict(both["rope_parameters"], rope_theta=123456.0)
  assert hf_loader.config_from_hf(both).rope_theta == 123456.0


# data/ -------------------------------------------------------------------------------------------

def test_the_pool_fingerprint_separates_its_prompts():
  """Two pools whose prompts concatenate to the same text are different pools: resuming one's
  stream position on the other is refused."""
  tok = tasks.make_task("repeat").tokenizer
  a = prompts.PromptDataset([{"prompt": "1 "}, {"prompt": "2"}], tok, batch_size=1,
                            max_prompt_len=4)
  b = prompts.PromptDataset([{"prompt": "1"}, {"prompt": " 2"}], tok, batch_size=1,
                            max_prompt_len=4)
  with pytest.raises(ValueError, match="fingerprint"):
    b.load_state_dict(a.state_dict())


def test_a_prompt_of_zero_tokens_is_refused():
  """Generation conditions on at least one prompt token (position p - 1 predicts the first
  response token): a prompt that encodes to nothing is an error naming it."""
  tok = tasks.make_task("repeat").tokenizer
  with pytest.raises(ValueError, match="prompt 1 encodes to zero tokens"):
    prompts.tokenize_prompts([{"prompt": "1 #2 ="}, {"prompt": " "}], tok, 4, add_bos=False)


def test_the_held_out_count_is_the_rounded_fraction():
  """split_records holds out round(fraction * N): 0.25 of 6 prompts is 2 (1.5 rounded), not 1."""
  recs = [{"prompt": f"p{i}"} for i in range(6)]
  train, held = records.split_records(recs, 0.25, seed=0)
  assert (len(train), len(held)) == (4, 2)


def test_add_bos_token_without_a_bos_token_adds_nothing(tmp_path):
  """tokenizer_config.json with add_bos_token=true but bos_token null (no BOS to add): the
  tokenizer loads and adds none, rather than refusing the config."""
  shutil.copy(os.path.join(_FIXTURES, "tiny_qwen2", "tokenizer.json"), tmp_path)
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json.dump({"eos_token": "</s>", "bos_token": None, "add_bos_token": True}, f)
  tok = HFTokenizer.from_file(str(tmp_path))
  assert tok.bos_id is None and not tok.add_bos
  assert tok.encode("hello") == tok.encode("hello", add_bos=False)


def test_lognormal_lengths_round_to_the_nearest_integer():
  """LengthDistribution('lognormal'): round(exp(N(mu, sigma^2))) clipped to [min, max], not
  truncated (truncation would shift every length down by half a token on average)."""
  dist = lengths.LengthDistribution(kind="lognormal", min_len=1, max_len=40, mu=1.5, sigma=0.8)
  got = dist.sample(np.random.default_rng(0), 2000)
  raw = np.random.default_rng(0).lognormal(1.5, 0.8, size=2000)
  np.testing.assert_array_equal(got, np.clip(np.round(raw), 1, 40))


# trainer/ ----------------------------------------------------------------------------------------

def test_rollout_statistics_report_sequence_and_token_kl_and_the_token_reward():
  """ppo.rollout_statistics' metrics by hand, on real tokens: kl/ref_mean is the mean over
  samples of each sample's summed k3 estimate of KL(pi_old || pi_ref) (d = log pi_ref -
  log pi_old: e^d - d - 1), kl/ref_token_mean its mean over real tokens, whatever the penalty's
  estimator; with k1 configured, kl/penalty_token_mean is k1's token mean (log pi_old -
  log pi_ref) and reward/token_reward_mean the mean of score - kl_coef * summed k1."""
  rng = np.random.default_rng(0)
  lens = np.array([5, 2, 3, 1])
  mask = (np.arange(5)[None] < lens[:, None]).astype(np.float32)
  old, ref = (rng.normal(-2, 1, (4, 5)).astype(np.float32) for _ in range(2))
  scores = rng.normal(size=4).astype(np.float32)
  d = ref.astype(np.float64) - old
  seq_k3 = ((np.exp(d) - d - 1) * mask).sum(1)
  seq_k1 = (-d * mask).sum(1)
  for estimator in ("k1", "k3"):
    algo = AlgoConfig(estimator="reinforce_pp", kl_coef=0.1, kl_estimator=estimator)
    _, _, m = ppo.rollout_statistics(algo, 1, jnp.asarray(scores), jnp.asarray(mask),
                                     jnp.asarray(old), jnp.asarray(ref), jnp.zeros((4, 5)))
    np.testing.assert_allclose(m["kl/ref_mean"], seq_k3.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["kl/ref_token_mean"], seq_k3.sum() / lens.sum(), rtol=1e-5)
    penalty = seq_k1 if estimator == "k1" else seq_k3
    np.testing.assert_allclose(m["reward/token_reward_mean"], (scores - 0.1 * penalty).mean(),
                               rtol=1e-5, atol=1e-6)
    if estimator == "k1":
      np.testing.assert_allclose(m["kl/penalty_token_mean"], seq_k1.sum() / lens.sum(),
                                 rtol=1e-5)
    else:
      assert "kl/penalty_token_mean" not in m


def test_the_loop_trains_on_the_behaviour_log_probs_against_the_reference():
  """PPOTrainer._advantages: the training data's old_logp are generation's behaviour log-probs
  (the PPO ratio's denominator), ref_logp the reference's, old_values the critic's; the KL
  statistics are of KL(pi_behaviour || pi_ref) (k3 of d = log pi_ref - log pi_behaviour), not
  the other way round."""
  rng = np.random.default_rng(1)
  b, p, t = 4, 3, 5
  lens = np.array([5, 1, 3, 4], np.int32)
  gen = async_ppo.Generated(
      iteration=0, version=0, tokens=np.zeros((b, p + t), np.int32),
      prompt_lens=np.full(b, p, np.int32), response_tokens=np.zeros((b, t), np.int32),
      response_lens=lens, logprobs=rng.normal(-2, 1, (b, t)).astype(np.float32),
      ref_logp=rng.normal(-2, 1, (b, t)).astype(np.float32),
      values=rng.normal(size=(b, t)).astype(np.float32),
      scores=rng.normal(size=b).astype(np.float32), metrics={})
  algo = AlgoConfig(kl_estimator="k1")
  fake = types.SimpleNamespace(  # what _advantages reads of the trainer
      cfg=types.SimpleNamespace(algo=algo, rollout=types.SimpleNamespace(
          max_new_tokens=t, samples_per_prompt=1),
          reward=types.SimpleNamespace(clip_bounds=None)), _put=jnp.asarray)
  data, stats = loop.PPOTrainer._advantages(fake, gen)  # pylint: disable=protected-access
  np.testing.assert_array_equal(data["old_logp"], gen.logprobs)
  np.testing.assert_array_equal(data["ref_logp"], gen.ref_logp)
  np.testing.assert_array_equal(data["old_values"], gen.values)
  np.testing.assert_array_equal(data["mask"], np.arange(t)[None] < lens[:, None])
  mask = np.arange(t)[None] < lens[:, None]
  d = gen.ref_logp.astype(np.float64) - gen.logprobs
  kl = np.where(mask, np.exp(d) - d - 1, 0.0).sum(1)
  np.testing.assert_allclose(stats["kl/ref_mean"], kl.mean(), rtol=1e-5)


def test_explained_variance_is_of_the_returns_by_the_values():
  """critic/vf_explained_var = 1 - Var[returns - values] / Var[returns] over real tokens
  (returns here are GAE's with lam = gamma = 1 and no KL: the score on every real token)."""
  algo = AlgoConfig(estimator="gae", kl_coef=0.0, gamma=1.0, lam=1.0,
                    whiten_advantages=False)
  lens = np.array([3, 1, 2])
  mask = (np.arange(3)[None] < lens[:, None]).astype(np.float32)
  scores = np.array([1.0, -2.0, 0.5], np.float32)
  values = np.array([[0.2, 0.9, 0.0], [-1.0, 3.0, 3.0], [1.5, 0.0, 7.0]], np.float32)
  zeros = jnp.zeros((3, 3))
  _, ret, m = ppo.rollout_statistics(algo, 1, jnp.asarray(scores), jnp.asarray(mask), zeros,
                                     zeros, jnp.asarray(values))
  real = mask > 0
  want_ret = np.broadcast_to(scores[:, None], (3, 3))[real]
  np.testing.assert_allclose(np.asarray(ret)[real], want_ret, atol=1e-6)
  resid = want_ret - values[real]
  ev = 1 - np.var(resid, ddof=1) / np.var(want_ret, ddof=1)
  np.testing.assert_allclose(m["critic/vf_explained_var"], ev, rtol=1e-5)


def test_each_prompt_is_repeated_on_consecutive_rows_with_its_record():
  """PPOTrainer._prompts: samples_per_prompt copies of each prompt on consecutive rows (a
  GRPO/RLOO group), the tokens of row i those of records[i] (whose target the reward reads),
  and sample ids unique over the run (iteration * batch + row)."""
  tok = tasks.make_task("repeat").tokenizer
  pool = [{"prompt": f"{d} #{d + 1} =", "target": str(d)} for d in range(5)]
  ds = prompts.PromptDataset(pool, tok, batch_size=3, max_prompt_len=4, seed=1)
  fake = types.SimpleNamespace(dataset=ds, cfg=types.SimpleNamespace(
      rollout=types.SimpleNamespace(samples_per_prompt=2, batch_size=6)))
  loop.PPOTrainer._prompts(fake, 0)  # pylint: disable=protected-access
  got = loop.PPOTrainer._prompts(fake, 1)  # pylint: disable=protected-access
  for i, r in enumerate(got.records):
    ids = tok.encode(r["prompt"])
    np.testing.assert_array_equal(got.tokens[i, :got.lens[i]], ids)
    assert got.lens[i] == len(ids)
  assert [r["target"] for r in got.records[::2]] == [r["target"] for r in got.records[1::2]]
  np.testing.assert_array_equal(got.uids, 6 + np.arange(6))


def test_a_task_reward_needs_an_answer_in_every_row():
  """build._needs_answer: reward.function='task' verifies against each record's target, so a
  prompts file without answers is refused when it is read, not at the first reward."""
  def cfg(function, fmt=""):
    return types.SimpleNamespace(reward=types.SimpleNamespace(
        kind="function", function=function, format=fmt, stat_specs=[]))
  assert build._needs_answer(cfg("task"))  # pylint: disable=protected-access
  assert build._needs_answer(cfg("exact_match"))  # pylint: disable=protected-access
  assert not build._needs_answer(cfg("my_pkg.rewards:score"))  # pylint: disable=protected-access


def test_the_critic_reads_the_vocabulary_of_the_actor_checkpoint():
  """build.resolve_config: an actor checkpoint whose embedding (128) is larger than the
  tokenizer's vocabulary gives the critic (no checkpoint of its own) the same 128 ids."""
  c = ppo_tiny.get_config()
  c.init.actor_checkpoint = os.path.join(_FIXTURES, "tiny_llama")
  cfg = TrainConfig.from_config_dict(c)
  tok = tasks.make_task("repeat").tokenizer  # 22 ids
  out = build.resolve_config(cfg, tok)
  assert out.model.vocab_size == out.critic_model.vocab_size == 128


def test_async_ppo_trains_against_the_current_critics_values():
  """PPOTrainer._current_values: a stale batch's values are replaced by the current critic's
  (scored on the training devices), the rest of the batch kept."""
  b, p, t = 2, 2, 3
  gen = async_ppo.Generated(
      iteration=3, version=1, tokens=np.ones((b, p + t), np.int32),
      prompt_lens=np.full(b, p, np.int32), response_tokens=np.ones((b, t), np.int32),
      response_lens=np.full(b, t, np.int32), logprobs=np.zeros((b, t), np.float32),
      ref_logp=np.zeros((b, t), np.float32), values=np.full((b, t), -5.0, np.float32),
      scores=np.ones(b, np.float32), metrics={})
  asked = []

  def values(cfg, params, batch):
    asked.append((cfg, params, batch.batch_size))
    return np.arange(b * t, dtype=np.float32).reshape(b, t)
  fake = types.SimpleNamespace(use_critic=True, cfg=types.SimpleNamespace(critic_model="C"),
                               _rescore_params=lambda name: f"{name} now",
                               _rescorer=types.SimpleNamespace(values=values))
  out = loop.PPOTrainer._current_values(fake, gen)  # pylint: disable=protected-access
  assert asked == [("C", "critic now", b)]
  np.testing.assert_array_equal(out.values, np.arange(b * t).reshape(b, t))
  np.testing.assert_array_equal(out.logprobs, gen.logprobs)
  assert (out.iteration, out.version) == (3, 1)


def test_decoupled_async_ppo_weights_by_the_behaviour_log_probs():
  """PPOTrainer._off_policy (objective 'decoupled'): the proximal policy is the current actor
  scored at the rollout temperature; old_logp becomes it and each advantage is weighted by
  pi_prox / pi_behaviour, the behaviour being generation's log-probs (not the reference's)."""
  rng = np.random.default_rng(3)
  b, p, t = 2, 2, 4
  lens = np.array([4, 2], np.int32)
  gen = async_ppo.Generated(
      iteration=5, version=3, tokens=np.ones((b, p + t), np.int32),
      prompt_lens=np.full(b, p, np.int32), response_tokens=np.ones((b, t), np.int32),
      response_lens=lens, logprobs=rng.normal(-2, 0.3, (b, t)).astype(np.float32),
      ref_logp=rng.normal(-2, 0.3, (b, t)).astype(np.float32),
      values=np.zeros((b, t), np.float32), scores=np.ones(b, np.float32), metrics={})
  prox = rng.normal(-2, 0.3, (b, t)).astype(np.float32)
  asked = []

  def ref_logprobs(cfg, params, batch, temperature):
    asked.append((cfg, params, temperature))
    return prox
  mask = (np.arange(t)[None] < lens[:, None]).astype(np.float32)
  adv = rng.normal(size=(b, t)).astype(np.float32) * mask
  data = {"old_logp": gen.logprobs, "advantages": adv, "mask": mask}
  fake = types.SimpleNamespace(
      cfg=types.SimpleNamespace(
          async_ppo=types.SimpleNamespace(objective="decoupled", behaviour_weight_cap=0.0),
          model="M", rollout=types.SimpleNamespace(temperature=0.7, max_new_tokens=t),
          guard=types.SimpleNamespace(on_nonfinite="skip_update")),  # (test_faults.py: "stop")
      _rescore_params=lambda name: f"{name} now",
      _rescorer=types.SimpleNamespace(logprobs=ref_logprobs))
  fake._actor_logprobs = functools.partial(loop.PPOTrainer._actor_logprobs, fake)
  out, m = loop.PPOTrainer._off_policy(fake, 5, gen, data)  # pylint: disable=protected-access
  assert asked == [("M", "actor now", 0.7)]
  np.testing.assert_array_equal(out["old_logp"], prox)
  w = np.exp(prox.astype(np.float64) - gen.logprobs) * mask
  np.testing.assert_allclose(out["advantages"], adv * w, rtol=1e-5, atol=1e-7)
  assert m["async/staleness"] == 2 and m["async/policy_version"] == 3


def test_held_out_prompts_are_capped_at_val_max_prompts():
  """data.val_max_prompts keeps at most that many held-out prompts."""
  c = ppo_tiny.get_config()
  c.data.val_fraction, c.data.val_max_prompts = 0.5, 3
  cfg = TrainConfig.from_config_dict(c)
  train, held = build.load_prompt_records(cfg, tasks.make_task("repeat"))
  assert len(held) == 3 and len(train) == cfg.data.num_prompts // 2


@pytest.mark.parametrize("overrides,match", [
    ({"data.max_prompt_len": 53}, "= 65 exceeds the max_seq_len=64 of config.model"),
    ({"rollout.top_k": 23}, "top_k=23 exceeds the actor's vocabulary"),
    ({"init.actor_checkpoint": os.path.join(_FIXTURES, "tiny_llama"), "model.max_seq_len": 512,
      "critic_model.max_seq_len": 512, "data.max_prompt_len": 245},
     "exceeds the max_position_embeddings=256"),
])
def test_validate_refuses_a_run_one_past_the_limits(overrides, match):
  """trainer/validate: a prompt + response one token longer than the model's context, a top_k
  one past the vocabulary (22 task ids), and a context past the positions an actor checkpoint
  was trained on (tiny_llama: 256), are refused by name."""
  c = ppo_tiny.get_config()
  for k, v in overrides.items():
    section, name = k.split(".")
    c[section][name] = v
  cfg = build.resolve_config(TrainConfig.from_config_dict(c), tasks.make_task("repeat").tokenizer)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1), jax.devices()[:1])
  with pytest.raises(ValueError, match=match):
    validate_lib.validate(cfg, mesh)


def test_validate_refuses_a_reward_model_with_a_smaller_vocabulary(monkeypatch):
  """trainer/validate: a reward model (or critic) checkpoint that embeds fewer ids than the
  actor generates is refused by name, before any build: its embedding lookup would read past
  its table (the reward model's shape faked: the fixtures share one vocabulary)."""
  c = ppo_tiny.get_config()
  cfg = build.resolve_config(TrainConfig.from_config_dict(c), tasks.make_task("repeat").tokenizer)
  small = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size - 1)
  monkeypatch.setattr(build, "reward_model_config", lambda run_cfg, weights=True: small)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1), jax.devices()[:1])
  with pytest.raises(ValueError, match=f"embeds vocab_size={small.vocab_size} tokens but the "
                     "actor"):
    validate_lib.validate(cfg, mesh)


def test_the_serial_rollout_scores_values_with_the_critic_and_ref_at_the_temperature():
  """rollout.score_rollout: in a run with a critic its values are the critic's (GAE's baseline),
  fetched when asked for; the reference log-probs are scored at the sampling temperature."""
  b, p, t = 2, 2, 3
  rollout = types.SimpleNamespace(
      prompt_tokens=np.ones((b, p), np.int32), prompt_lens=np.full(b, p, np.int32),
      response_tokens=np.ones((b, t), np.int32), response_lens=np.array([3, 1], np.int32),
      logprobs=np.zeros((b, t), np.float32))
  asked = []
  scorer = types.SimpleNamespace(
      logprobs=lambda cfg, params, batch, temp: asked.append(("ref", params, temp)) or
      np.full((b, t), -1.0, np.float32),
      values=lambda cfg, params, batch: asked.append(("values", params)) or
      np.full((b, t), 2.5, np.float32))
  stage = types.SimpleNamespace(
      actor_cfg="A", critic_cfg="C", use_critic=True, pad_id=0, reference="ref params",
      sampling=types.SimpleNamespace(logprob_temperature=0.7), scorer=scorer,
      rewards=types.SimpleNamespace(scored_terms=lambda batch, records: (
          np.ones(b, np.float32), {"reward/x_mean": 1.0}, {})))
  prompts_ = types.SimpleNamespace(records=[{}, {}])
  out = rollout_lib.score_rollout(stage, rollout, lambda name: f"{name} params", prompts_, {})
  assert asked == [("ref", "ref params", 0.7), ("values", "critic params")]
  np.testing.assert_array_equal(out.values, 2.5)
  np.testing.assert_array_equal(out.ref_logp, -1.0)
  assert out.metrics["reward/x_mean"] == 1.0  # the reward terms' metrics reach the stage's


def test_async_overlap_is_the_intersection_of_the_two_intervals():
  """async_ppo.overlap_metrics: seconds both ran (the intervals' intersection) and that over the
  shorter of the two."""
  m = async_ppo.overlap_metrics((0.0, 10.0), (4.0, 16.0))
  assert m["timing_s/async_overlap"] == pytest.approx(6.0)
  assert m["perf/async_overlap_frac"] == pytest.approx(0.6)
  assert async_ppo.overlap_metrics((0.0, 1.0), (2.0, 3.0))["timing_s/async_overlap"] == 0.0


def test_the_generation_group_is_the_first_devices():
  """async_ppo.split_devices: async_ppo.generation_devices = g takes the first g devices (by
  id) to generate and leaves the others, in order, to train."""
  devices = jax.devices()[:8]
  cfg = types.SimpleNamespace(async_ppo=types.SimpleNamespace(generation_devices=2))
  gen, train = async_ppo.split_devices(cfg, devices)
  assert [d.id for d in gen] == [d.id for d in devices[:2]]
  assert [d.id for d in train] == [d.id for d in devices[2:]]


def test_the_validation_key_is_its_own_stream():
  """evaluation.validation_key: the iteration's training key with VALIDATION_STREAM folded in,
  so a validation pass never draws the samples training drew at that iteration."""
  train = jax.random.fold_in(jax.random.key(7), 3)
  got = evaluation.validation_key(7, 3)
  want = jax.random.fold_in(train, evaluation.VALIDATION_STREAM)
  np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
  assert not np.array_equal(jax.random.key_data(got), jax.random.key_data(train))


# perf/ -------------------------------------------------------------------------------------------

_DOTS_HLO = """HloModule m, num_partitions=4

%small (a: f32[4,16]) -> f32[4,8] {
  %a = f32[4,16]{1,0} parameter(0)
  %w = f32[16,8]{1,0} parameter(1)
  ROOT %d = f32[4,8]{1,0} dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%large (b: f32[4,16]) -> f32[4,32] {
  %b = f32[4,16]{1,0} parameter(0)
  %v = f32[16,32]{1,0} parameter(1)
  ROOT %e = f32[4,32]{1,0} dot(%b, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[4,16]) -> f32[4,8] {
  %x = f32[4,16]{1,0} parameter(0)
  %as = ((f32[4,16]{1,0}), f32[4,8]{1,0}) async-start(%x), calls=%small
  %ad = f32[4,8]{1,0} async-done(%as), calls=%small
  %i = s32[] constant(0)
  %c = f32[4,32]{1,0} conditional(%i, %x, %x), branch_computations={%small, %large}
  %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(%x), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %agd = f32[16]{0} all-gather-done(%ags)
}
"""


def test_hlo_dot_flops_async_pairs_conditionals_and_gather_bytes():
  """hlo_flops.analyze: a dot is 2 * M * N * K FLOPs; an async-start / async-done pair runs its
  computation once; a conditional costs its costliest branch; an all-gather-start moves its
  gathered output (64 bytes here), not operand plus output."""
  costs = hlo_flops.analyze(_DOTS_HLO)
  small, large = 2 * 4 * 8 * 16, 2 * 4 * 32 * 16
  assert costs.flops == small + large  # the async pair once, the conditional's larger branch
  (gather, count), = costs.collectives.items()
  assert (gather.kind, gather.nbytes, gather.groups, count) == (
      "all-gather", 16 * 4, ((0, 1, 2, 3),), 1.0)


def test_timed_warms_up_then_times_each_repeat():
  """timing.timed: `warmup` untimed calls, then one timing per repeat."""
  calls = []
  out = timing.timed(lambda: calls.append(1) or jnp.zeros(()), warmup=2, repeats=3)
  assert len(calls) == 5 and len(out) == 3


def test_each_timing_covers_the_call_it_times():
  """The clock starts before the call and stops after its result is ready: a step that takes
  at least 20 ms (sleep's lower bound) is never timed shorter, in timed and time_in_rotation
  alike (with the clock started after the call, each read ~0)."""
  slow = lambda: time.sleep(0.02) or jnp.zeros(())
  assert min(timing.timed(slow, warmup=0, repeats=3)) >= 0.02
  runs = timing.time_in_rotation({"fast": lambda: jnp.zeros(()), "slow": slow}, repeats=2)
  assert min(runs["slow"]) >= 0.02


def test_time_in_rotation_alternates_the_order_every_other_round():
  """timing.time_in_rotation(alternate=True): round r runs the steps in order, round r + 1 in
  reverse, so neither of two steps always runs first."""
  order = []
  steps = {n: (lambda n=n: order.append(n) or jnp.zeros(())) for n in ("a", "b")}
  runs = timing.time_in_rotation(steps, repeats=3, alternate=True)
  assert order == ["a", "b", "b", "a", "a", "b"]
  assert {k: len(v) for k, v in runs.items()} == {"a": 3, "b": 3}
