"""Inference scores equal direct forward passes (whole batch, micro-batched, sharded); reward
dispatch between a reward model and a Python function; clear errors."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.inference.scoring import RewardTerm, Rewards, Scorer, ScoringBatch
from rlhfuse_jax.models import llama, sequences
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.sim import cost_model

ACTOR = llama.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, max_seq_len=64)
CRITIC = ACTOR.replace(head="scalar")
B, P, T = 12, 5, 7


@pytest.fixture(scope="module")
def models():
  return tuple(jax.tree_util.tree_map(jnp.asarray, llama.host_random_params(cfg, seed))
               for cfg, seed in ((ACTOR, 0), (CRITIC, 1)))


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  prompt = rng.integers(1, 32, (B, P)).astype(np.int32)
  plens = rng.integers(1, P + 1, B).astype(np.int32)
  resp = rng.integers(1, 32, (B, T)).astype(np.int32)
  rlens = rng.integers(1, T + 1, B).astype(np.int32)
  rlens[0], plens[0] = T, P  # a row that fills the whole width
  for b in range(B):
    prompt[b, plens[b]:] = 0
    resp[b, rlens[b]:] = 0

  class Rollout:  # duck-typed like generation.engine.Rollout
    prompt_tokens, prompt_lens, response_tokens, response_lens = prompt, plens, resp, rlens
  return ScoringBatch.from_rollout(Rollout, pad_id=0)


@pytest.fixture(scope="module")
def direct(models, batch):
  """Scores computed the obvious way: full forward, then index with python loops."""
  actor, critic = models
  logits = np.asarray(jax.jit(lambda p, x: llama.apply(ACTOR, p, x)[0])(actor, batch.tokens))
  values = np.asarray(jax.jit(lambda p, x: llama.apply(CRITIC, p, x)[0])(critic, batch.tokens))
  ref = np.zeros((B, T), np.float32)
  val = np.zeros((B, T), np.float32)
  score = np.zeros(B, np.float32)
  for b in range(B):
    p, r = batch.prompt_lens[b], batch.response_lens[b]
    for t in range(T):
      z = logits[b, p - 1 + t].astype(np.float64) / 0.8
      lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
      ref[b, t] = lp[batch.tokens[b, p + t]]
      val[b, t] = values[b, p - 1 + t]
    assert batch.tokens[b, p + r - 1] == batch.response_tokens[b, r - 1]
    score[b] = values[b, p + r - 1]
  return ref, val, score


def _masked(x, batch):
  return x * (np.arange(T)[None] < batch.response_lens[:, None])


def test_scores_equal_direct_forward(models, batch, direct):
  actor, critic = models
  ref, val, score = direct
  scorer = Scorer()
  np.testing.assert_allclose(_masked(scorer.logprobs(ACTOR, actor, batch, 0.8), batch),
                             _masked(ref, batch), atol=1e-5)
  np.testing.assert_allclose(_masked(scorer.values(CRITIC, critic, batch), batch),
                             _masked(val, batch), atol=1e-5)
  np.testing.assert_allclose(scorer.reward_scores(CRITIC, critic, batch), score, atol=1e-5)


def test_micro_batched_and_sharded_scores_equal_whole_batch(models, batch, direct):
  actor, critic = models
  ref, val, score = direct
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4, fsdp=2))
  specs = llama.logical_specs(ACTOR)
  actor_s = mesh_lib.shard_params(actor, specs, mesh)
  critic_s = mesh_lib.shard_params(critic, llama.logical_specs(CRITIC), mesh)
  # 12 rows in micro-batches of 8: the second piece is padded, and both reuse one executable.
  scorer = Scorer(mesh, micro_batch_size=8)
  out = scorer.logprobs(ACTOR, actor_s, batch, 0.8)
  assert out.shape == (B, T)
  np.testing.assert_allclose(_masked(out, batch), _masked(ref, batch), atol=1e-5)
  np.testing.assert_allclose(_masked(scorer.values(CRITIC, critic_s, batch), batch),
                             _masked(val, batch), atol=1e-5)
  np.testing.assert_allclose(scorer.reward_scores(CRITIC, critic_s, batch), score, atol=1e-5)
  # Streaming a subset (e.g. the samples that just finished) scores exactly those rows.
  rows = np.array([3, 7, 10])
  np.testing.assert_allclose(scorer.reward_scores(CRITIC, critic_s, batch.take(rows)),
                             score[rows], atol=1e-5)
  # Whole-batch scoring (no micro-batches) pads the 12 rows to 16, a multiple of the mesh's 8
  # data-parallel devices, which a batch-sharded input needs.
  np.testing.assert_allclose(Scorer(mesh).reward_scores(CRITIC, critic_s, batch), score,
                             atol=1e-5)


def test_reward_dispatch_model_and_function(models, batch, direct):
  _, critic = models
  _, _, score = direct
  by_model = Rewards(model_cfg=CRITIC, model_params=critic)
  np.testing.assert_allclose(by_model(batch), score, atol=1e-5)
  seen = {}

  def count_threes(records, response_tokens, response_lens):
    seen["records"] = records
    mask = np.arange(response_tokens.shape[1])[None] < response_lens[:, None]
    return ((response_tokens == 3) & mask).sum(1) / response_lens

  records = [{"prompt": str(i)} for i in range(B)]
  by_fn = Rewards(fn=count_threes, name="threes")
  want = [(batch.response_tokens[b, :batch.response_lens[b]] == 3).mean() for b in range(B)]
  np.testing.assert_allclose(by_fn(batch, records), want, atol=1e-6)
  assert seen["records"] is records
  with pytest.raises(ValueError, match="gave its reward-model weights away"):
    by_model.without_model_params()(batch)
  assert by_fn.without_model_params() is by_fn


def test_reward_model_plus_weighted_terms(models, batch, direct):
  """A reward model's score plus weighted function terms: the sum per sample, each term's
  unweighted mean as reward/<label>_mean; the terms stay when the weights move."""
  _, critic = models
  _, _, score = direct
  lens = batch.response_lens.astype(np.float32)
  ones = RewardTerm(label="ones", fn=lambda r, t, l: np.ones(len(l)), name="ones", weight=2.0)
  length = RewardTerm(label="length", fn=lambda r, t, l: l, name="len", weight=-0.25)
  rewards = Rewards(model_cfg=CRITIC, model_params=critic, extra=[ones, length])
  total, metrics = rewards.scored(batch)
  np.testing.assert_allclose(total, score + 2.0 - 0.25 * lens, atol=1e-5)
  assert metrics == pytest.approx({"reward/model_mean": float(np.mean(score)),
                                   "reward/ones_mean": 1.0,
                                   "reward/length_mean": float(np.mean(lens))}, abs=1e-5)
  np.testing.assert_array_equal(rewards(batch), total)
  moved = rewards.without_model_params()
  assert moved.extra == rewards.extra
  # The fused stage's path: scores computed elsewhere, the terms added.
  t2, m2 = moved.combine(None, batch.response_tokens, batch.response_lens, score)
  np.testing.assert_allclose(t2, total, atol=1e-6)
  assert m2 == pytest.approx(metrics, abs=1e-6)
  with pytest.raises(ValueError, match="model_scores must be given exactly when"):
    moved.combine(None, batch.response_tokens, batch.response_lens)
  bad = Rewards(model_cfg=CRITIC, model_params=critic, extra=[RewardTerm(
      label="short", fn=lambda r, t, l: np.zeros(2), name="my_pkg:short")])
  with pytest.raises(ValueError, match=r"'my_pkg:short' returned shape \(2,\)"):
    bad(batch)
  with pytest.raises(ValueError, match="distinct labels other than 'function' and 'model'"):
    Rewards(fn=len, name="f", extra=[RewardTerm(label="function", fn=len)])
  with pytest.raises(ValueError, match="distinct labels"):
    Rewards(fn=len, name="f", extra=[ones, ones])


def test_clear_errors(models, batch):
  actor, critic = models
  with pytest.raises(ValueError, match="exactly one source"):
    Rewards()
  with pytest.raises(ValueError, match="exactly one source"):
    Rewards(fn=len, model_cfg=CRITIC, model_params=critic)
  with pytest.raises(ValueError, match="reward model needs model.head='scalar'"):
    Rewards(model_cfg=ACTOR, model_params=actor)
  with pytest.raises(ValueError, match="reward function 'f': needs a callable"):
    Rewards(fn="f", name="f")
  bad = Rewards(fn=lambda r, t, l: np.zeros(3), name="f")
  with pytest.raises(ValueError, match=r"'f' returned shape \(3,\); expected \(12,\)"):
    bad(batch)
  nan = Rewards(fn=lambda r, t, l: np.full(len(l), np.nan), name="f")
  with pytest.raises(ValueError,
                     match="'f' returned a non-finite reward for sample 0 of the batch of 12"):
    nan(batch)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))
  with pytest.raises(ValueError, match="micro_batch_size=4 must be 0"):
    Scorer(mesh, micro_batch_size=4)
  with pytest.raises(ValueError, match="critic needs model.head='scalar'"):
    Scorer().values(ACTOR, actor, batch)
  # An empty batch: Python's "range() arg 3 must not be zero" (whole batch) or numpy's "need
  # at least one array to concatenate" (micro-batched) before.
  empty = batch.take(np.arange(0))
  for scorer in (Scorer(), Scorer(micro_batch_size=4)):
    with pytest.raises(ValueError, match="Scorer: the batch to score has no rows"):
      scorer.logprobs(ACTOR, actor, empty)


def test_static_arguments_may_be_passed_by_keyword(models, batch):
  """The jitted forwards name their static arguments (cfg, num_response, temperature, mesh): a
  keyword call is static too, and equals the positional one."""
  from rlhfuse_jax.inference import scoring
  actor, _ = models
  t = batch.num_response
  positional = scoring.response_logprobs(ACTOR, actor, batch.tokens, batch.prompt_lens, t, 0.7)
  keyword = scoring.response_logprobs(cfg=ACTOR, params=actor, tokens=batch.tokens,
                                      prompt_lens=batch.prompt_lens, num_response=t,
                                      temperature=0.7, mesh=None)
  np.testing.assert_array_equal(np.asarray(keyword), np.asarray(positional))


@pytest.mark.parametrize("plen, rlen, match", [
    (0, 5, r"prompt_lens must be in \[1, 4\]"),  # read position -1: the row's last column
    (6, 5, r"prompt_lens must be in \[1, 4\]"),  # past the row: NaN
    (4, 7, r"response_lens must be in \[0, 5\]"),
])
def test_scoring_batch_refuses_lengths_outside_its_rows(plen, rlen, match):
  tok = np.arange(1, 10, dtype=np.int32)[None]  # P = 4, T = 5
  with pytest.raises(ValueError, match=match):
    ScoringBatch(tok, np.array([plen], np.int32), tok[:, 4:], np.array([rlen], np.int32))
  with pytest.raises(ValueError, match=r"response_tokens \(1, 5\) must be"):
    ScoringBatch(tok[0], np.array([4], np.int32), tok[:, 4:], np.array([5], np.int32))


def test_a_reward_model_with_a_pad_id_scores_where_transformers_pools(models, batch):
  """score_pad_id (a *ForSequenceClassification's config.json pad_token_id, often = EOS): the
  score is read at the last token of prompt + response that is not that id, as transformers
  pools; -1 reads the last response token. Rows here end in the id (an EOS), hold it inside
  the prompt, or are nothing but it after the first token."""
  _, critic = models
  eos = 3
  tokens = np.array(batch.tokens)
  plens, rlens = np.array(batch.prompt_lens), np.array(batch.response_lens)
  for b in range(B):
    p, r = plens[b], rlens[b]
    if b % 3 == 0:
      tokens[b, p + r - 1] = eos  # the response stopped at EOS
    if b % 4 == 1 and r >= 2:
      tokens[b, p + r - 2: p + r] = eos  # two trailing: both skipped
    if b % 5 == 2:
      tokens[b, 0] = eos  # inside the prompt: not a trailing one, kept
  tokens[11, :plens[11] + rlens[11]] = eos  # all of it: position 0, as transformers reads
  tokens[11, 0] = 5
  edited = dataclasses.replace(batch, tokens=tokens)  # only the tokens are scored
  full = np.asarray(jax.jit(lambda p, x: llama.apply(CRITIC, p, x)[0])(critic, tokens))
  want, last = np.zeros(B, np.float32), np.zeros(B, np.float32)
  for b in range(B):
    seq = tokens[b, :plens[b] + rlens[b]]
    keep = [i for i, t in enumerate(seq) if t != eos]
    want[b] = full[b, keep[-1] if keep else 0]
    last[b] = full[b, len(seq) - 1]
  got = Scorer().reward_scores(CRITIC.replace(score_pad_id=eos), critic, edited)
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert np.abs(want - last).max() > 1e-3  # the two rules differ on these rows
  np.testing.assert_allclose(Scorer().reward_scores(CRITIC, critic, edited), last, atol=1e-5)


def test_a_sequence_that_is_all_pad_id_is_scored_at_position_0():
  """transformers' *ForSequenceClassification pools at argmax(index * (token != pad)): 0 for a
  row with no other token. score_positions must read position 0 there too, not wrap to the
  row's last column (padding past the response, another value entirely)."""
  from rlhfuse_jax.models import sequences
  pad = 3
  tokens = np.array([[pad, pad, pad, pad, 9, 9], [5, pad, 7, pad, pad, 9]], np.int32)
  plens, rlens = np.array([2, 2]), np.array([2, 3])  # scored spans: 4 and 5 tokens
  got = np.asarray(sequences.score_positions(tokens, plens, rlens, pad))
  np.testing.assert_array_equal(got, [0, 2])
  np.testing.assert_array_equal(np.asarray(sequences.score_positions(tokens, plens, rlens, -1)),
                                [3, 4])


def test_a_statistic_may_have_no_value_but_not_an_infinite_one(batch):
  """Rewards' stats: a sample's NaN means "no value" and is left out of the batch mean; an
  infinite one is refused (it would make the logged mean inf), naming the statistic and the
  sample, even for a function passed in directly rather than through data/rewards' per-sample
  wrapper (which checks its own)."""
  lens = batch.response_lens.astype(np.float64)
  some = RewardTerm(label="some", name="some", fn=lambda r, t, l: np.where(l > 3, l, np.nan))
  _, metrics = Rewards(fn=lambda r, t, l: np.zeros(len(l)), stats=[some]).scored(batch)
  assert metrics["stats/some_mean"] == pytest.approx(lens[lens > 3].mean())
  huge = RewardTerm(label="huge", name="huge",
                    fn=lambda r, t, l: np.where(np.arange(len(l)) == 1, 1e39, 1.0))
  with pytest.raises(ValueError, match="statistic 'huge' returned a non-finite reward for "
                                       "sample 1 of"):
    Rewards(fn=lambda r, t, l: np.zeros(len(l)), stats=[huge]).scored(batch)


def test_log_probs_on_tensor_devices_hold_one_copy_of_their_share_of_the_logits():
  """The scoring forward (the trainer's actor_logp, an instance's reference) with the vocabulary
  split over `tensor`: its temporaries are one float32 copy of each device's V/tp columns of the
  logits, as cost_model.LOGITS_COPIES_SCORING counts them. Through log_softmax, GSPMD kept its
  shifted copy beside the logits (the max's all-reduce between them): 2 copies of the half at
  tensor 2, as many bytes a device as at tensor 1 (1.00x; now 0.50x)."""
  cfg = llama.ModelConfig(vocab_size=16384, hidden_size=64, intermediate_size=128, num_layers=1,
                          num_heads=2, num_kv_heads=2, max_seq_len=128)
  rows, seq, t = 4, 48, 32
  one = 4.0 * rows * t * cfg.vocab_size  # float32 logits [rows, T, V]
  temps = {}
  for tp in (1, 2):
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, tensor=tp), jax.devices()[:tp])
    shapes = llama.param_shapes(cfg)
    params = mesh_lib.abstract(shapes, mesh_lib.param_shardings(shapes, llama.logical_specs(cfg),
                                                                mesh))
    low = Scorer(mesh).lower_logprobs(cfg, params, rows, seq, t)
    temps[tp] = low.compile().memory_analysis().temp_size_in_bytes
    assert temps[tp] == pytest.approx(cost_model.LOGITS_COPIES_SCORING * one / tp, rel=0.1), (
        tp, temps[tp] / one)
  assert temps[2] < 0.6 * temps[1], temps


def test_log_probs_alone_are_the_log_softmaxs_to_the_bit():
  """sequences.token_logprobs (the scoring forward's) against the update's
  token_logprobs_and_entropy: the same operations at the target, so a recomputed old_logp
  equals the update's first log-probs exactly (ratio 1), -inf logits included."""
  key = jax.random.PRNGKey(0)
  logits = 30.0 * jax.random.normal(key, (3, 8, 500))
  targets = jax.random.randint(key, (3, 8), 0, 500)
  logits = logits.at[0, 0, targets[0, 0]].set(-jnp.inf)
  for temp in (1.0, 0.7):
    alone = jax.jit(sequences.token_logprobs, static_argnums=2)(logits, targets, temp)
    both = jax.jit(sequences.token_logprobs_and_entropy, static_argnums=2)(logits, targets, temp)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(both[0]))
  assert np.asarray(alone)[0, 0] == -np.inf
