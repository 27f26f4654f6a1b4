"""Cheap tests proposed by a mutation audit: each one fails under a plausible refactoring bug
that the rest of the suite lets through (see the audit report for the mutation each kills)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.rl import kl
from rlhfuse_jax.rl import losses
from rlhfuse_jax.rl import masked


# rl/ ---------------------------------------------------------------------------------------------

def test_discounted_returns_skip_holes_in_the_mask():
  # Tool-output holes are transparent (module docstring): G over the valid tokens 1, 2, 3 only.
  rewards = np.array([[1.0, 5.0, 2.0, 7.0, 3.0]], np.float32)
  mask = np.array([[1, 0, 1, 0, 1]], np.float32)
  g = 0.5
  got = np.asarray(adv_lib.discounted_returns(rewards, mask, g))
  np.testing.assert_allclose(got[0], [1 + g * (2 + g * 3), 0, 2 + g * 3, 0, 3], rtol=1e-6)


@pytest.mark.parametrize("size", [3, 8, 16])
@pytest.mark.parametrize("tie", [0.1, 0.7, 1.1])
def test_grpo_tied_group_is_exactly_zero_after_another_group(size, tie):
  # The existing test puts the tied group first; here it is second, after a group whose first
  # score is 0 (so a shift by the batch's first score instead of each group's does nothing).
  scores = np.array([0.0, 1.0] * (size // 2) + [0.5] * (size % 2) + [tie] * size, np.float32)
  adv, _ = adv_lib.grpo_advantages(scores, np.ones((2 * size, 2), np.float32), size)
  np.testing.assert_array_equal(np.asarray(adv)[size:], 0.0)


def test_whitening_a_constant_is_zero_not_nan():
  mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  w = np.asarray(masked.masked_whiten(np.full((2, 3), 0.25, np.float32), mask))
  np.testing.assert_array_equal(w, 0.0)
  # REINFORCE++ on a batch whose every reward is 0 (all wrong, no KL term): no signal, no nan.
  adv, _ = adv_lib.reinforce_pp_advantages(np.zeros((2, 3), np.float32), mask, 0.9)
  np.testing.assert_array_equal(np.asarray(adv), 0.0)


def test_masked_var_per_row_is_bessel_corrected_per_row():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 6)).astype(np.float32)
  lengths = np.array([6, 3, 1, 2])
  mask = (np.arange(6)[None] < lengths[:, None]).astype(np.float32)
  want = [x[i, :n].var(ddof=1) if n > 1 else 0.0 for i, n in enumerate(lengths)]
  np.testing.assert_allclose(masked.masked_var(x, mask, axis=-1), want, rtol=1e-5, atol=1e-7)


def test_policy_loss_is_finite_for_a_token_that_diverged():
  # log ratio 200 on a negative-advantage token: exp overflows float32 unless it is bounded.
  logp = jnp.array([[0.0, -1.0]], jnp.float32)
  old = jnp.array([[-200.0, -1.0]], jnp.float32)
  adv = jnp.array([[-1.0, 1.0]], jnp.float32)
  mask = jnp.ones((1, 2), jnp.float32)
  loss, _ = losses.policy_loss(logp, old, adv, mask, 0.2)
  assert float(loss) == pytest.approx((np.exp(20.0) - 1.0) / 2, rel=1e-5)
  grad = jax.grad(lambda lp: losses.policy_loss(lp, old, adv, mask, 0.2)[0])(logp)
  assert np.all(np.isfinite(np.asarray(grad)))


def test_token_mean_of_an_all_padding_micro_batch_is_zero():
  z = jnp.zeros((2, 3), jnp.float32)
  pg, _ = losses.policy_loss(z, z, z, z, 0.2)
  vf, _ = losses.value_loss(z, z, z, z, 0.2)
  assert float(pg) == 0.0 and float(vf) == 0.0


def test_k3_is_accurate_when_policy_and_reference_nearly_agree():
  # The common case in RLHF: |log ratio| ~ 1e-4, where exp(r) - 1 - r cancels in float32.
  ref = np.full(4, -2.0, np.float32)
  logp = (ref + np.array([1e-4, -1e-4, 3e-3, -3e-3], np.float32)).astype(np.float32)
  r = ref.astype(np.float64) - logp.astype(np.float64)  # exact: Sterbenz
  want = np.expm1(r) - r
  np.testing.assert_allclose(kl.kl_estimate(logp, ref, "k3"), want, rtol=1e-3)


def test_kl_estimate_is_float32_for_bfloat16_inputs():
  lp = jnp.array([-1.0, -2.0], jnp.bfloat16)
  assert kl.kl_estimate(lp, lp + 0.5, "k3").dtype == jnp.float32


# generation/sampling.py --------------------------------------------------------------------------

def _nucleus_rows(n):
  from rlhfuse_jax.generation import sampling
  probs = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
  vocab = np.random.default_rng(5).permutation(8)[:5]
  logits = np.full(8, -1e9, np.float32)
  logits[vocab] = np.log(probs)
  keys = jax.random.split(jax.random.key(0), n)
  return sampling, jnp.broadcast_to(logits, (n, 8)), keys, vocab


def test_top_p_also_applies_when_top_k_is_set():
  sampling, rows, keys, vocab = _nucleus_rows(4000)
  cfg = sampling.SamplingConfig(top_k=4, top_p=0.8)
  tokens = np.asarray(jax.jit(sampling.sample_token, static_argnums=2)(rows, keys, cfg)[0])
  assert np.isin(tokens, vocab[:3]).all()  # vocab[3] (7 % of the top 4) is outside the nucleus


def test_top_p_set_that_reaches_top_p_exactly_stops_there():
  from rlhfuse_jax.generation import sampling
  logits = jnp.log(jnp.array([0.5, 0.25, 0.125, 0.125], jnp.float32))  # cumsum 0.5, 0.75 exact
  n = 2000
  keys = jax.random.split(jax.random.key(1), n)
  tokens, _ = jax.jit(sampling.sample_token, static_argnums=2)(
      jnp.broadcast_to(logits, (n, 4)), keys, sampling.SamplingConfig(top_p=0.75))
  assert set(np.asarray(tokens).tolist()) == {0, 1}


def test_is_stop_matches_eos_and_every_extra_stop_id():
  from rlhfuse_jax.generation.sampling import SamplingConfig
  cfg = SamplingConfig(eos_id=5, extra_eos_ids=(7, 9))
  np.testing.assert_array_equal(cfg.is_stop(np.array([5, 7, 9, 1, 0])),
                                [True, True, True, False, False])
  np.testing.assert_array_equal(SamplingConfig().is_stop(np.array([0, 1])), [False, False])


def test_greedy_records_untempered_logprobs():
  from rlhfuse_jax.generation import sampling
  logits = jnp.asarray(np.random.default_rng(2).normal(size=(4, 10)), jnp.float32)
  keys = jax.random.split(jax.random.key(0), 4)
  tokens, logp = sampling.sample_token(logits, keys,
                                       sampling.SamplingConfig(greedy=True, temperature=0.5))
  want = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(4), np.argmax(logits, -1)]
  np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
  np.testing.assert_allclose(logp, want, rtol=1e-6)


# policy/consolidation.py -------------------------------------------------------------------------

def _three_instances():
  from rlhfuse_jax.policy.consolidation import InstanceState, SampleState
  a = InstanceState(0, 4, 80, (SampleState(0, 0, 20, 10), SampleState(1, 1, 20, 10)))  # free 20
  b = InstanceState(1, 4, 80, (SampleState(2, 0, 15, 5),))  # free 60
  c = InstanceState(2, 4, 80, (SampleState(3, 0, 5, 5),))  # the least work: it moves
  return [a, b, c]


def test_a_moved_sample_goes_to_the_kept_instance_with_most_free_tokens():
  from rlhfuse_jax.policy.consolidation import plan_consolidation
  plan = plan_consolidation(_three_instances(), 1.0, 10)
  assert plan.kept == (0, 1) and len(plan.moves) == 1
  assert plan.moves[0].dst_instance == 1  # worst fit (spread the tail), not the tight instance 0


def test_the_subset_fallback_for_large_classes_keeps_the_most_work():
  from rlhfuse_jax.policy.consolidation import plan_consolidation
  plan = plan_consolidation(_three_instances(), 1.0, 10, max_subsets=0)  # fallback only
  assert plan.kept == (0, 1) and plan.moved_tokens == 5


def test_rt_threshold_refuses_a_bool():
  from rlhfuse_jax.policy.rt import resolve_threshold
  assert resolve_threshold("auto") is None and resolve_threshold("0.3") == 0.3
  with pytest.raises(ValueError, match="fusion.migration_threshold=True"):
    resolve_threshold(True)  # a YAML/flag slip (true) is not Rt = 1.0


# data/ -------------------------------------------------------------------------------------------

def test_gsm8k_reads_the_number_after_the_last_marker():
  from rlhfuse_jax.data import verifiers
  text = "#### 5\nWait, that is wrong.\n#### 7"
  assert verifiers.final_number(text) == 7
  assert verifiers.gsm8k(text, "7", {}) == 1.0


class _DigitTokenizer:
  """id i decodes to the digit i; 0 is EOS."""
  eos_id, stop_ids, vocab_size, special_ids = 0, (0,), 10, frozenset({0})

  def decode(self, ids, skip_special_tokens=True):
    return "".join(str(i) for i in ids)


def test_exact_match_needs_the_response_to_stop():
  from rlhfuse_jax.data.rewards import exact_match
  ids = np.array([[1, 2, 0], [1, 2, 3]])  # "12" + EOS; "123" cut by the budget (no EOS)
  got = exact_match([{"target": "12"}] * 2, ids, np.array([3, 3]), _DigitTokenizer())
  np.testing.assert_array_equal(got, [1.0, 0.0])


def test_numpy_scalars_in_messages_become_plain_values():
  from rlhfuse_jax.data import chat
  msgs = chat.as_messages([{"role": np.str_("user"), "content": np.str_("hi"),
                            "n": np.int64(3)}])
  assert msgs == [{"role": "user", "content": "hi", "n": 3}]
  assert type(msgs[0]["content"]) is str and type(msgs[0]["n"]) is int


# trainer/evaluation.py ---------------------------------------------------------------------------

def test_validation_keys_depend_on_the_iteration():
  from rlhfuse_jax.trainer.evaluation import validation_key
  data = lambda k: np.asarray(jax.random.key_data(k))  # noqa: E731
  assert not np.array_equal(data(validation_key(0, 1)), data(validation_key(0, 2)))
  assert not np.array_equal(data(validation_key(0, 1)), data(validation_key(1, 1)))


def test_validation_pass_gives_each_batch_its_key_and_reports_population_std():
  import types
  from rlhfuse_jax.trainer.evaluation import HeldOutEval
  from rlhfuse_jax.trainer.rollout import StageOutputs
  seen = []

  def stage(params, prompts, key):
    seen.append(np.asarray(jax.random.key_data(key)))
    scores = np.asarray(prompts.uids, np.float32)  # 0..5 over the batches (5 is a filler)
    return StageOutputs(rollout=types.SimpleNamespace(response_lens=np.full(2, 4)), batch=None,
                        ref_logp=None, values=None, scores=scores, metrics={})

  class Pool:  # what HeldOutEval reads of a PromptDataset
    records, tokens, lengths = [{}] * 5, np.ones((5, 3), np.int32), np.full(5, 3, np.int32)

    def __len__(self):
      return 5

  metrics = HeldOutEval(Pool(), rows=2, seed=0)(stage, lambda n: None, iteration=1)
  assert len(seen) == 3 and len({s.tobytes() for s in seen}) == 3
  assert metrics["val/prompts"] == 5
  assert metrics["val/reward_mean"] == pytest.approx(2.0)
  assert metrics["val/reward_std"] == pytest.approx(np.std([0, 1, 2, 3, 4]))


def test_a_long_validation_pass_logs_its_progress_between_batches(monkeypatch, caplog):
  """Each batch of the pass is a rollout; over a whole test set the pass ran minutes after an
  iteration without a line. It logs between batches once PROGRESS_S has passed (never after the
  last: the iteration's own line follows)."""
  import logging as py_logging
  import types
  from rlhfuse_jax.trainer import evaluation
  from rlhfuse_jax.trainer.rollout import StageOutputs

  def stage(params, prompts, key):
    return StageOutputs(rollout=types.SimpleNamespace(response_lens=np.full(2, 4)), batch=None,
                        ref_logp=None, values=None, scores=np.zeros(2, np.float32), metrics={})

  class Pool:  # what HeldOutEval reads of a PromptDataset: 5 prompts, 3 batches of 2
    records, tokens, lengths = [{}] * 5, np.ones((5, 3), np.int32), np.full(5, 3, np.int32)

    def __len__(self):
      return 5

  monkeypatch.setattr(evaluation, "PROGRESS_S", 0.0)
  with caplog.at_level(py_logging.INFO):
    evaluation.HeldOutEval(Pool(), rows=2, seed=0)(stage, lambda n: None, iteration=6)
  lines = [r.getMessage() for r in caplog.records if "validation after" in r.getMessage()]
  assert [line.split(" in ")[0] for line in lines] == [
      "validation after iteration 7: 1/3 batches of held-out prompts",
      "validation after iteration 7: 2/3 batches of held-out prompts"], lines
  caplog.clear()
  monkeypatch.setattr(evaluation, "PROGRESS_S", 3600.0)  # a short pass says nothing
  with caplog.at_level(py_logging.INFO):
    evaluation.HeldOutEval(Pool(), rows=2, seed=0)(stage, lambda n: None, iteration=6)
  assert not [r for r in caplog.records if "validation after" in r.getMessage()]


# checkpointing.py, workdir.py --------------------------------------------------------------------

def test_checkpointer_rotation_and_set_aside_never_overwrite(tmp_path):
  from rlhfuse_jax import checkpointing
  ck = checkpointing.Checkpointer(str(tmp_path), keep=2)
  for step in (1, 2, 3):
    ck.save(step, {"w": jnp.full((2,), float(step))}, {"step": step})
    ck.wait()
  assert ck.all_steps() == [3, 2]  # keep=2 rotates the oldest away
  ck.set_aside(3)
  ck.save(3, {"w": jnp.zeros((2,))}, {"step": 3})
  ck.wait()
  ck.set_aside(3)
  assert sorted(os.listdir(tmp_path / "damaged_checkpoints")) == ["3", "3.1"]
  ck.close()


def test_read_jsonl_drops_only_a_torn_last_line(tmp_path):
  from rlhfuse_jax import workdir as wd
  torn = tmp_path / "torn.jsonl"
  torn.write_text('{"a": 1}\n{"a": 2')
  assert wd.read_jsonl(str(torn)) == [{"a": 1}]
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"a": 1}\n{oops\n{"a": 2}\n')
  with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed JSON line"):
    wd.read_jsonl(str(bad))


def test_config_history_and_earlier_starts_are_never_overwritten(tmp_path):
  from rlhfuse_jax import workdir as wd
  run = str(tmp_path)
  paths = [os.path.basename(wd.write_config_history(run, {"i": i}, 2)) for i in range(3)]
  assert paths == ["config.json", "config.2.json", "config.2.1.json"]
  assert wd.read_json_object(os.path.join(run, "config.2.json")) == {"i": 1}
  assert wd.set_aside_earlier_start(run) == os.path.join(run, "previous", "1")
  wd.append_jsonl(os.path.join(run, "metrics.jsonl"), {"step": 1})
  assert wd.set_aside_earlier_start(run) == os.path.join(run, "previous", "2")
  assert os.listdir(os.path.join(run, "previous", "2")) == ["metrics.jsonl"]
