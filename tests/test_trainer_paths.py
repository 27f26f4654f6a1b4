"""PPOTrainer on the paths a real run takes and the other trainer tests do not (issue 34.6).

  * actor, critic and tokenizer from the tiny HF fixtures (init.actor_checkpoint,
    init.critic_checkpoint, init.tokenizer) with prompts from a JSONL file (data.prompts_file);
  * a reward model (reward.kind="model") from a checkpoint written in tmp_path, through the
    serial rollout stage and through the fused one (fusion.inter_stage=True);
  * data.prompts_file with the task's own tokenizer, and its malformed-line error.

Every expected value is computed outside the trainer (hf_loader, llama.apply, scoring.Scorer on
one device, the reward functions) from what the trainer's rollout stage returned.
"""
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest

from rlhfuse_jax.data import rewards as rewards_lib
from rlhfuse_jax.data.tokenizer import HFTokenizer
from rlhfuse_jax.inference import scoring
from rlhfuse_jax.models import hf_loader, llama
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.trainer import build
from rlhfuse_jax.trainer import rollout as rollout_lib
from rlhfuse_jax.trainer.loop import PPOTrainer
from tests.test_trainer import record_rollouts, tiny_config

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LLAMA = os.path.join(FIXTURES, "tiny_llama")  # sharded, untied, head_dim 32 != 64 / 4 heads
QWEN2 = os.path.join(FIXTURES, "tiny_qwen2")  # single file, q/k/v biases, tied embeddings

# Prompts the fixtures' byte-level BPE can spell (its alphabet is only these sentences' bytes):
# (prompt, target) pairs; length_match scores a response's length against the target's.
SENTENCE_PROMPTS = [
    ("the quick", "brown fox"), ("a tiny model", "learns"), ("one plus two", "is three"),
    ("hello world", "this is"), ("the critic", "predicts the value"), ("three plus four", "seven"),
    ("the lazy dog", "jumps"), ("small numbers", "to count and add"),
]
# 'repeat' task prompts in the task's own vocabulary.
REPEAT_PROMPTS = [(f"{d} #{n} =", " ".join([str(d)] * n))
                  for d, n in [(3, 4), (0, 1), (7, 2), (9, 5), (1, 3), (5, 8), (2, 6), (4, 7)]]


def _write_prompts(path, pairs, blank_after=3):
  """A JSONL prompts file (a blank line after line `blank_after`, which loaders must skip);
  returns {prompt: 'path:line'}, what each record's _source must say."""
  lines, sources = [], {}
  for i, (prompt, target) in enumerate(pairs):
    lines.append(json.dumps({"prompt": prompt, "target": target, "id": i}))
    sources[prompt] = f"{path}:{len(lines)}"
    if len(lines) == blank_after:
      lines.append("")
  path.write_text("\n".join(lines) + "\n")
  return sources


def _packed(out):
  """[B, P+T] prompt then response then pad, and [B] prompt lengths, built here with numpy."""
  ro = out.rollout
  b, width = ro.prompt_tokens.shape[0], ro.prompt_tokens.shape[1] + ro.response_tokens.shape[1]
  tokens = np.zeros((b, width), np.int32)
  for i in range(b):
    p, r = ro.prompt_lens[i], ro.response_lens[i]
    tokens[i, :p + r] = np.concatenate([ro.prompt_tokens[i, :p], ro.response_tokens[i, :r]])
  return tokens, np.asarray(ro.prompt_lens)


_apply = jax.jit(llama.apply, static_argnums=0)


def _reference_logprobs(cfg, params, out):
  """[B, T] log-probs of each response token (0 past its length) from a plain forward pass."""
  tokens, plen = _packed(out)
  logits = np.asarray(_apply(cfg, params, tokens)[0], np.float64)  # [B, P+T, V]
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  ro, want = out.rollout, np.zeros(out.rollout.response_tokens.shape)
  for i in range(len(plen)):
    for t in range(ro.response_lens[i]):
      want[i, t] = logp[i, plen[i] - 1 + t, ro.response_tokens[i, t]]
  return want


def _decoded_prompts(tokenizer, prompts):
  return [tokenizer.decode(prompts.tokens[i, :prompts.lens[i]]) for i in range(len(prompts.lens))]


def _assert_tree_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _finite(history):
  for h in history:
    bad = {k: v for k, v in h.items() if isinstance(v, float) and not np.isfinite(v)}
    assert not bad, bad


def test_trainer_from_hf_checkpoints_tokenizer_and_prompts_file(tmp_path, caplog):
  """init.actor_checkpoint / init.critic_checkpoint / init.tokenizer / data.prompts_file: the
  resolved shapes are the fixtures' config.json; the initial actor, reference and critic are
  exactly hf_loader's weights (the reference reproduces HF's golden logits); prompts are the
  file's, tokenised by the fixture's tokenizer; the reference log-probs of both iterations are
  the checkpoint's (it stays frozen while the actor moves); the reward is length_match under the
  fixture's tokenizer with the file's targets; two iterations run with finite metrics."""
  sources = _write_prompts(tmp_path / "prompts.jsonl", SENTENCE_PROMPTS)
  cfg = tiny_config(**{
      "num_iterations": 2, "init.actor_checkpoint": LLAMA, "init.critic_checkpoint": QWEN2,
      "init.tokenizer": os.path.join(LLAMA, "tokenizer.json"),
      "data.prompts_file": str(tmp_path / "prompts.jsonl"), "data.max_prompt_len": 8,
      "reward.function": "length_match", "rollout.prompts_per_iteration": 8,
      "algo.minibatch_size": 8, "algo.epochs": 1, "rollout.max_new_tokens": 6})
  with caplog.at_level(logging.INFO):
    trainer = PPOTrainer(cfg, str(tmp_path / "run"))
  # The set-up says how far num_iterations goes through the file.
  n = len(SENTENCE_PROMPTS)
  assert (f"setup: {n} training prompts, 8 per iteration: 2 iterations are {16 / n:.3g} passes "
          "over them") in caplog.text, caplog.text[-2000:]

  # Shapes: config.json's, not the config's 1-layer, 32-wide tiny model.
  with open(os.path.join(LLAMA, "config.json")) as f:
    hf = json.load(f)
  m = trainer.cfg.model
  run_fields = lambda section: {f: getattr(section, f) for f in build.RUN_MODEL_FIELDS}
  assert m == hf_loader.load_hf_config(LLAMA, **run_fields(cfg.model))
  assert (m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads,
          m.num_kv_heads, m.head_dim_, m.rms_norm_eps, m.rope_theta, m.tie_embeddings) == (
              hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"],
              hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"],
              hf["head_dim"], hf["rms_norm_eps"], hf["rope_parameters"]["rope_theta"],
              hf["tie_word_embeddings"])
  assert trainer.cfg.critic_model == hf_loader.load_hf_config(
      QWEN2, head="scalar", **run_fields(cfg.critic_model))
  assert trainer.cfg.critic_model.qkv_bias and trainer.cfg.critic_model.tie_embeddings

  # The tokenizer is the fixture's; generation stops on its EOS.
  tok = HFTokenizer.from_file(os.path.join(LLAMA, "tokenizer.json"))
  assert isinstance(trainer.tokenizer, HFTokenizer)
  assert (trainer.tokenizer.vocab_size, trainer.tokenizer.eos_id, trainer.tokenizer.pad_id) == (
      tok.vocab_size, tok.eos_id, tok.pad_id) == (128, 2, 0)
  assert trainer.sampling.eos_id == tok.eos_id and trainer.sampling.pad_id == tok.pad_id

  # Weights before any update: exactly the checkpoints' (critic: Qwen2 backbone + a value head
  # drawn from the key build_models documents).
  actor = hf_loader.load_hf_params(LLAMA, m)
  _assert_tree_equal(jax.device_get(trainer.actor.params), actor)
  _assert_tree_equal(jax.device_get(trainer.rollout.reference), actor)
  critic = hf_loader.load_hf_params(QWEN2, trainer.cfg.critic_model, head="scalar",
                                    rng=jax.random.fold_in(jax.random.key(cfg.seed), 2))
  _assert_tree_equal(jax.device_get(trainer.critic.params), critic)
  golden = np.load(os.path.join(LLAMA, "golden.npz"))  # HF's own logits, recorded with torch
  logits = np.asarray(_apply(m, trainer.rollout.reference, golden["input_ids"])[0])
  np.testing.assert_allclose(logits, golden["logits"], atol=1e-4, rtol=0)

  seen = record_rollouts(trainer)
  history = trainer.run()
  assert [h["step"] for h in history] == [1, 2]
  _finite(history)
  file_prompts = sorted(p for p, _ in SENTENCE_PROMPTS)
  for (prompts, out), h in zip(seen, history, strict=True):
    # 8 prompts per iteration from a pool of 8: each iteration is a permutation of the file.
    decoded = _decoded_prompts(tok, prompts)
    assert sorted(decoded) == file_prompts
    assert decoded == [r["prompt"] for r in prompts.records]
    assert [r["_source"] for r in prompts.records] == [sources[p] for p in decoded]
    np.testing.assert_array_equal(prompts.lens, [len(tok.encode(p)) for p in decoded])
    # The reference is the checkpoint in every iteration (frozen), not the moving actor.
    valid = np.arange(out.ref_logp.shape[1])[None] < out.rollout.response_lens[:, None]
    want = _reference_logprobs(m, actor, out)
    np.testing.assert_allclose(np.where(valid, out.ref_logp, 0), want, atol=2e-5, rtol=0)
    # Rewards: length_match with the fixture's tokenizer and the file's targets.
    scores = rewards_lib.length_match(prompts.records, out.rollout.response_tokens,
                                      out.rollout.response_lens, tok)
    np.testing.assert_array_equal(out.scores, scores)
    assert h["reward/mean"] == pytest.approx(float(np.mean(scores)), abs=1e-7)
    assert h["reward/std"] > 0  # responses of several lengths: a comparison that can fail
  # Iteration 1 samples from the checkpoint itself: behaviour log-probs are the reference's.
  first = seen[0][1]
  np.testing.assert_allclose(first.rollout.logprobs, first.ref_logp, atol=2e-5, rtol=0)
  # (k1's mean gap per token: the k3 of kl/ref_mean is about its square)
  assert abs(history[0]["kl/penalty_token_mean"]) < 1e-5
  # The actor trained away from the checkpoint, far enough that a reference following it would
  # have failed the frozen-reference check above.
  last = seen[-1][1]
  trained = jax.device_get(trainer.actor.params)
  drift = np.abs(_reference_logprobs(m, trained, last) - _reference_logprobs(m, actor, last))
  assert drift.max() > 100 * 2e-5


# ------------------------------------------------------------------ a reward model

REWARD_CFG = llama.ModelConfig(vocab_size=22, hidden_size=32, intermediate_size=64,
                               num_layers=1, num_heads=4, num_kv_heads=2, qkv_bias=True,
                               max_seq_len=64, head="scalar")


def write_reward_checkpoint(out_dir, cfg=REWARD_CFG, seed=0):
  """A random scalar-head (Qwen2ForSequenceClassification) checkpoint with O(1) weights, so
  that its scores differ between responses; value bias non-zero (written as score.bias)."""
  params = llama.host_random_params(cfg, seed, std=0.3)
  hf_loader.save_hf_checkpoint(params, cfg, str(out_dir))
  return params


# A length penalty added to the reward model's score (reward.format): the response's length in
# characters over 100, weighted -0.5.
LENGTH_PENALTY, PENALTY_WEIGHT = "tests.test_rewards:answer_length", -0.5


def _reward_run_config(prompts_file, ckpt, **overrides):
  """'repeat' prompts from a file, a reward model plus a length penalty, no critic
  (reinforce_pp): a small run."""
  return tiny_config(**{
      "num_iterations": 2, "reward.kind": "model", "reward.model_checkpoint": str(ckpt),
      "reward.format": LENGTH_PENALTY, "reward.format_weight": PENALTY_WEIGHT,
      "data.prompts_file": str(prompts_file), "algo.estimator": "reinforce_pp",
      "rollout.prompts_per_iteration": 8, "algo.minibatch_size": 8, "algo.epochs": 1,
      "rollout.max_new_tokens": 6, "rollout.chunk_size": 2, "checkpoint.every": 100,
      **overrides})


def _mesh4():
  return mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4), jax.devices()[:4])


@pytest.fixture(scope="module")
def reward_files(tmp_path_factory):
  """A reward-model checkpoint and a 'repeat' prompts file, written once for the tests below."""
  tmp = tmp_path_factory.mktemp("reward_files")
  params = write_reward_checkpoint(tmp / "rm")
  sources = _write_prompts(tmp / "prompts.jsonl", REPEAT_PROMPTS)
  return dict(ckpt=str(tmp / "rm"), params=params, prompts=str(tmp / "prompts.jsonl"),
              sources=sources, tmp=tmp)


@pytest.fixture(scope="module")
def fused_run(reward_files):
  """Two iterations with a reward model, prompts from the file and inter-stage fusion (Rt = 1:
  every iteration consolidates and scores on the freed instances)."""
  f = reward_files
  cfg = _reward_run_config(f["prompts"], f["ckpt"], **{
      "fusion.inter_stage": True, "fusion.migration_threshold": "1.0"})
  trainer = PPOTrainer(cfg, str(f["tmp"] / "fused"), mesh=_mesh4())
  stage = trainer.rollout
  assert isinstance(stage, rollout_lib.FusedStage)
  seen = record_rollouts(trainer)
  history = trainer.run()
  return dict(trainer=trainer, stage=stage, seen=seen, history=history)


def _independent_scores(ckpt, out, pad_id):
  """Reward-model scores [B] of the rollout's samples: the checkpoint read back by hf_loader,
  scored by a one-device Scorer (not the trainer's, nor on its mesh or fused instances), and
  checked against llama.apply's scalar at position prompt_len + response_len - 1."""
  cfg = hf_loader.load_hf_config(ckpt)
  params = hf_loader.load_hf_params(ckpt, cfg)
  batch = scoring.ScoringBatch.from_rollout(out.rollout, pad_id)
  scores = scoring.Scorer().reward_scores(cfg, params, batch)
  tokens, plen = _packed(out)
  values = np.asarray(_apply(cfg, params, tokens)[0])  # [B, P+T]
  last = plen + out.rollout.response_lens - 1
  np.testing.assert_allclose(values[np.arange(len(last)), last], scores, atol=1e-5, rtol=0)
  return scores, params


def _penalty(out, prompts, tokenizer):
  """The length penalty's unweighted values [B] for the rollout's responses."""
  fn = rewards_lib.get_reward_function(LENGTH_PENALTY)
  return np.asarray(fn(prompts.records, out.rollout.response_tokens, out.rollout.response_lens,
                       tokenizer))


def test_reward_model_scores_the_fused_rollout(reward_files, fused_run):
  """reward.kind="model" with fusion.inter_stage=True: the reward model is the checkpoint's
  (shape from its config.json, weights as written), and each iteration's rewards are its
  scalar at the last response token of the responses generated, as a one-device Scorer
  computes them, plus the weighted length penalty (reward.format); reward/model_mean and
  reward/format_mean are the two terms' unweighted means, reward/mean their sum's."""
  f, r = reward_files, fused_run
  assert r["stage"].rewards.from_model
  assert r["stage"].rewards.model_cfg == hf_loader.load_hf_config(f["ckpt"]) == REWARD_CFG
  assert [h["step"] for h in r["history"]] == [1, 2]
  _finite(r["history"])
  tok = r["trainer"].tokenizer
  for (prompts, out), h in zip(r["seen"], r["history"], strict=True):
    want, params = _independent_scores(f["ckpt"], out, tok.pad_id)
    _assert_tree_equal(params, f["params"])  # the checkpoint holds what was written
    penalty = _penalty(out, prompts, tok)
    assert np.std(penalty) > 0  # responses of different lengths: the penalty is seen
    np.testing.assert_allclose(out.scores, want + PENALTY_WEIGHT * penalty, atol=1e-5, rtol=0)
    assert h["reward/mean"] == pytest.approx(float(np.mean(out.scores)), abs=1e-6)
    assert h["reward/model_mean"] == pytest.approx(float(np.mean(want)), abs=1e-6)
    assert h["reward/format_mean"] == pytest.approx(float(np.mean(penalty)), abs=1e-6)
    assert np.std(want) > 0.05  # scores that tell responses apart: the check can fail
    assert h["gen/migrated_samples"] > 0  # some samples were scored after migrating


def test_reward_model_scores_the_serial_rollout_as_the_fused_one(reward_files, fused_run,
                                                                 tmp_path):
  """reward.kind="model", serial stage (fusion off): the same responses as the fused run's
  first iteration and the same scores, which are the checkpoint's (one-device Scorer) plus
  the length penalty; reward/mean and the per-term means equal to the fused run's."""
  f = reward_files
  cfg = _reward_run_config(f["prompts"], f["ckpt"], num_iterations=1)
  trainer = PPOTrainer(cfg, str(tmp_path / "serial"), mesh=_mesh4())
  assert isinstance(trainer.rollout, rollout_lib.SerialStage)
  assert trainer.rollout.rewards.model_cfg == REWARD_CFG
  seen = record_rollouts(trainer)
  history = trainer.run()
  _finite(history)
  (_, serial), (_, fused) = seen[0], fused_run["seen"][0]
  for field in ("response_tokens", "response_lens"):
    np.testing.assert_array_equal(getattr(serial.rollout, field), getattr(fused.rollout, field))
  want, _ = _independent_scores(f["ckpt"], serial, trainer.tokenizer.pad_id)
  penalty = _penalty(serial, seen[0][0], trainer.tokenizer)
  np.testing.assert_allclose(serial.scores, want + PENALTY_WEIGHT * penalty, atol=1e-5, rtol=0)
  np.testing.assert_allclose(serial.scores, fused.scores, atol=1e-6, rtol=0)
  for key in ("reward/mean", "reward/model_mean", "reward/format_mean"):
    assert history[0][key] == pytest.approx(fused_run["history"][0][key], abs=1e-6), key
  assert history[0]["reward/model_mean"] == pytest.approx(float(np.mean(want)), abs=1e-6)


def _with_reward_stats(src, rm, mean: float, std: float):
  """A copy at `rm` of the reward model at `src` whose config.json holds OpenRLHF's reward
  statistics `mean` and `std` (its reward-model trainer's)."""
  shutil.copytree(src, rm)
  with open(rm / "config.json") as fh:
    hf = json.load(fh)
  hf.update(mean=mean, std=std)
  with open(rm / "config.json", "w") as fh:
    json.dump(hf, fh)
  return rm


def test_openrlhf_reward_statistics_normalise_the_fused_rollouts_scores(reward_files, tmp_path):
  """A reward model whose config.json holds OpenRLHF's `mean` and `std` (its reward-model
  trainer's): the fused run's rewards are (score - mean) / std plus the length penalty (they
  were the raw scores, on another scale than OpenRLHF's PPO with --normalize_reward), the
  scores read on the freed instances after the weights moved there."""
  f = reward_files
  mean, std = 0.75, 0.25
  rm = _with_reward_stats(f["ckpt"], tmp_path / "rm", mean, std)
  cfg = _reward_run_config(f["prompts"], rm, num_iterations=1, **{
      "fusion.inter_stage": True, "fusion.migration_threshold": "1.0"})
  trainer = PPOTrainer(cfg, str(tmp_path / "run"), mesh=_mesh4())
  assert isinstance(trainer.rollout, rollout_lib.FusedStage)
  seen = record_rollouts(trainer)
  history = trainer.run()
  _finite(history)
  (prompts, out), = seen
  raw, _ = _independent_scores(str(rm), out, trainer.tokenizer.pad_id)
  want = (raw - mean) / std
  penalty = _penalty(out, prompts, trainer.tokenizer)
  np.testing.assert_allclose(out.scores, want + PENALTY_WEIGHT * penalty, atol=1e-5, rtol=0)
  assert history[0]["reward/model_mean"] == pytest.approx(float(np.mean(want)), abs=1e-5)
  assert abs(float(np.mean(raw)) - float(np.mean(want))) > 0.1  # the check can fail


def test_a_critic_from_an_openrlhf_reward_model_starts_on_the_normalised_scale(reward_files,
                                                                               tmp_path):
  """init.critic_checkpoint at the reward model whose config.json holds OpenRLHF's mean and std
  (OpenRLHF's default critic): with the rewards normalised its values start as
  (value - mean) / std, as OpenRLHF's critic under --normalize_reward (read raw, they started
  on another scale than the returns); with reward.model_normalize='off' raw, as before."""
  mean, std = 0.75, 0.25
  rm = _with_reward_stats(reward_files["ckpt"], tmp_path / "rm", mean, std)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1), jax.devices()[:1])
  tokens = np.array([[1, 5, 7, 9, 11, 3]], np.int32)
  values = {}
  for how in ("auto", "off"):
    cfg = tiny_config(**{"reward.kind": "model", "reward.model_checkpoint": str(rm),
                         "init.critic_checkpoint": str(rm), "reward.model_normalize": how})
    _, tok = build.build_task_and_tokenizer(cfg)
    cfg = build.resolve_config(cfg, tok, log=False)
    critic = jax.device_get(build.build_critic(cfg, mesh))
    values[how] = np.asarray(_apply(cfg.critic_model, critic, tokens)[0])
  np.testing.assert_allclose(values["auto"], (values["off"] - mean) / std, atol=1e-5, rtol=0)
  assert np.abs(values["off"] - values["auto"]).max() > 0.1  # the check can fail


def _count_parses(monkeypatch, *checkpoints):
  """{checkpoint: how often its config.json is opened as text (read to parse it)} from here
  on; the resume check's digest reads its bytes (a binary open), not counted."""
  import builtins
  import collections
  files = {os.path.abspath(os.path.join(c, "config.json")): str(c) for c in checkpoints}
  reads, real_open = collections.Counter(), builtins.open

  def counting(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, os.PathLike)) and "b" not in mode:
      name = files.get(os.path.abspath(file))
      if name is not None:
        reads[name] += 1
    return real_open(file, mode, *args, **kwargs)
  monkeypatch.setattr(builtins, "open", counting)
  return reads


def test_a_start_reads_each_checkpoint_s_config_json_once(reward_files, tmp_path, monkeypatch):
  """A trainer's set-up parsed the reward model's config.json 13 times where the critic starts
  from it (docs/own_model.md), 8 beside a critic of its own: its shape, positions and head prefix
  at the config's resolution, validate and the models' build, its statistics, and all again as
  the critic's (only the statistics were cached). Each checkpoint's is parsed once per start
  (hf_config.reads_once), and a config.json rewritten since is read anew."""
  rm = _with_reward_stats(reward_files["ckpt"], tmp_path / "rm", 0.75, 0.25)
  critic = _with_reward_stats(reward_files["ckpt"], tmp_path / "critic", 0.5, 2.0)
  reads = _count_parses(monkeypatch, rm, critic)
  cfg = _reward_run_config(reward_files["prompts"], rm, num_iterations=1, **{
      "algo.estimator": "gae", "init.critic_checkpoint": str(critic)})
  trainer = PPOTrainer(cfg, str(tmp_path / "run"), mesh=_mesh4())
  assert trainer.rollout.rewards.model_norm == (0.75, 0.25)
  assert reads == {str(rm): 1, str(critic): 1}, reads
  reads.clear()
  cfg = _reward_run_config(reward_files["prompts"], rm, num_iterations=1, **{
      "algo.estimator": "gae", "init.critic_checkpoint": str(rm)})
  PPOTrainer(cfg, str(tmp_path / "run_rm_critic"), mesh=_mesh4())
  assert reads == {str(rm): 1}, reads
  # a rewritten config.json (another size: other statistics) is read again, not the old ones
  hf = json.loads((rm / "config.json").read_text())
  (rm / "config.json").write_text(json.dumps({**hf, "mean": 1.5, "std": 0.5}))
  assert build.reward_normalization(cfg) == (1.5, 0.5)
  assert reads == {str(rm): 2}, reads


def test_a_format_term_beside_a_reward_model_is_said_once_per_start(reward_files, tmp_path,
                                                                    caplog):
  """A format term beside a reward model and a verifier left from a preset (configs/ppo_hf.py
  with reward.kind='model') was said twice at start: in validate's warning of the unused
  reward.function and in build_rewards' `reward:` line. The warning names the function alone;
  the `reward:` line, said whether or not a function is left, says what the format adds."""
  cfg = _reward_run_config(reward_files["prompts"], reward_files["ckpt"], num_iterations=1,
                           **{"reward.function": "gsm8k"})
  with caplog.at_level(logging.INFO):
    PPOTrainer(cfg, str(tmp_path / "run"), mesh=_mesh4())
  assert ("config.reward.function='gsm8k' not used: reward.kind='model': the reward model "
          "scores every sample\n" in caplog.text), caplog.text
  assert (f"reward: the reward model's score + {PENALTY_WEIGHT:g} x {LENGTH_PENALTY!r}"
          in caplog.text), caplog.text
  assert caplog.text.count(repr(LENGTH_PENALTY)) == 1, caplog.text


def test_prompts_file_is_what_the_trainer_generates_from(reward_files, fused_run):
  """data.prompts_file with the task's tokenizer: every iteration generates from the file's
  prompts (decoded from the recorded prompt tokens), each file record once per iteration (8 of
  8), with its fields and its path:line, reshuffled in the next iteration (the pool's second
  epoch)."""
  tok = fused_run["trainer"].tokenizer
  file_prompts = sorted(p for p, _ in REPEAT_PROMPTS)
  targets = dict(REPEAT_PROMPTS)
  orders = []
  for prompts, _ in fused_run["seen"]:
    decoded = _decoded_prompts(tok, prompts)
    assert sorted(decoded) == file_prompts
    assert decoded == [rec["prompt"] for rec in prompts.records]
    assert [rec["target"] for rec in prompts.records] == [targets[p] for p in decoded]
    assert [rec["_source"] for rec in prompts.records] == [
        reward_files["sources"][p] for p in decoded]
    np.testing.assert_array_equal(prompts.lens, 4)  # <bos> d #n =
    orders.append(decoded)
  assert len(orders) == 2 and orders[0] != orders[1]  # epoch 1 reshuffles the pool


def test_malformed_prompts_file_names_file_and_line(tmp_path, monkeypatch):
  """A bad line in data.prompts_file stops PPOTrainer before any model is built, with an error
  naming the file and the line."""
  path = tmp_path / "prompts.jsonl"
  path.write_text('{"prompt": "1 #2 ="}\n\n{"prompt": "3 #1 =", }\n')

  def no_build(*args, **kwargs):
    raise AssertionError("models were built before the prompts file was read")
  monkeypatch.setattr(build, "build_models", no_build)
  with pytest.raises(ValueError, match=rf"{path}:3: invalid JSON"):
    PPOTrainer(tiny_config(**{"data.prompts_file": str(path)}), str(tmp_path / "run"))


# ------------------------------------------------------------------ what a checkpoint may set

def test_a_checkpoint_sets_the_architecture_and_keeps_the_runs_own_fields():
  """init.actor_checkpoint: the architecture comes from config.json, the run's numerics,
  attention, remat, scanning and context from the config; a critic without a checkpoint of its
  own takes the actor's vocabulary (it reads the actor's token ids)."""
  cfg = tiny_config(**{"init.actor_checkpoint": LLAMA, "model.remat": "full",
                       "model.attention": "reference", "model.scan_layers": True,
                       "model.max_seq_len": 48, "model.dtype": "bfloat16"})
  tok = HFTokenizer.from_file(os.path.join(LLAMA, "tokenizer.json"))
  m = build.resolve_config(cfg, tok).model
  hf = hf_loader.load_hf_config(LLAMA)
  for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "tie_embeddings", "qkv_bias"):
    assert getattr(m, f) == getattr(hf, f), f
  assert (m.remat, m.attention, m.scan_layers, m.max_seq_len, m.dtype) == (
      "full", "reference", True, 48, "bfloat16")
  assert build.resolve_config(cfg, tok).critic_model.vocab_size == hf.vocab_size != 22
  # A config file's vocabulary beside a checkpoint is replaced, not checked against the
  # tokenizer (8 < its 128 tokens was refused, though the model built embeds 128).
  small = tiny_config(**{"init.actor_checkpoint": LLAMA, "model.vocab_size": 8,
                         "critic_model.vocab_size": 8})
  assert build.resolve_config(small, tok, log=False).critic_model.vocab_size == hf.vocab_size


def test_a_tokenizer_much_smaller_than_a_checkpoint_without_its_own_is_warned_of(tmp_path,
                                                                                  caplog):
  """A checkpoint folder without tokenizer.json leaves nothing to compare the run's tokenizer
  with: one far smaller than the embedding (a config's example tokenizer kept beside a user's
  model) is warned of; the checkpoint's own size, or an embedding padded by a few rows, not."""
  bare = tmp_path / "bare"
  shutil.copytree(LLAMA, bare)
  os.remove(bare / "tokenizer.json")
  cfg = tiny_config(**{"init.actor_checkpoint": str(bare), "init.tokenizer": "example.json"})

  class Tokenizer:
    def __init__(self, n):
      self.vocab_size = n
  for size, warned in ((22, True), (115, True), (116, False), (128, False)):  # 0.9 x 128 = 115.2
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      build.resolve_config(cfg, Tokenizer(size), log=False)
    line = (f"the tokenizer (config.init.tokenizer='example.json') has {size} tokens, "
            f"{100 * size / 128:.0f}% of the 128 that config.init.actor_checkpoint=")
    assert (line in caplog.text) == warned, (size, caplog.text)
  with caplog.at_level(logging.WARNING):  # its own tokenizer beside it: compared instead
    build.resolve_config(tiny_config(**{"init.actor_checkpoint": LLAMA}), Tokenizer(22),
                         log=False)
  assert "tokenizer.json to compare it with" not in caplog.text


def test_plain_prompts_that_begin_with_bos_are_warned_of(tmp_path, caplog):
  """data.chat_template='none' with text that already starts with the BOS token (data rendered
  by another tool): the tokenizer adds its own, as transformers' tokenizer(text) does, and the
  model reads two; the run warns, counting them. Text without it, or a chat template, not."""
  tok = os.path.join(LLAMA, "tokenizer.json")  # BOS '<s>', id 1, added to plain text
  for prompts, said in ((["<s>hello world", "the lazy dog", "<s>small"], "2 of 3 prompts"),
                        (["hello world", "the lazy dog"], None)):
    path = tmp_path / "prompts.jsonl"
    _write_prompts(path, [(p, "x") for p in prompts])
    cfg = tiny_config(**{"init.tokenizer": tok, "data.prompts_file": str(path),
                         "data.max_prompt_len": 8})
    task, tokenizer = build.build_task_and_tokenizer(cfg)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      train, _, _ = build.build_datasets_and_pool(cfg, task, tokenizer)
    twice = int(np.sum((train.tokens[:, 0] == 1) & (train.tokens[:, 1] == 1)))
    assert twice == (2 if said else 0)  # what the tokenizer really made
    line = "begin with two BOS tokens (id 1): their text already starts with '<s>'"
    assert (f"{said} {line}" in caplog.text) if said else line not in caplog.text, caplog.text


def test_vocabulary_and_context_mismatches_are_named_before_any_build(tmp_path, monkeypatch):
  """A tokenizer larger than the checkpoint's embedding, or a reward model with another
  vocabulary or a shorter context, is an error naming the field, not NaN losses later."""
  def no_build(*args, **kwargs):
    raise AssertionError("models were built before the config was validated")
  monkeypatch.setattr(build, "build_models", no_build)

  class BigTokenizer:
    vocab_size = 1000
  with pytest.raises(ValueError, match=r"tokenizer has 1000 tokens but config\.init\."
                                       r"actor_checkpoint=.* embeds 128"):
    build.resolve_config(tiny_config(**{"init.actor_checkpoint": LLAMA}), BigTokenizer())
  # The checkpoint's own tokenizer: its config.json is at fault, not the tokenizer named.
  odd = tmp_path / "odd"
  shutil.copytree(LLAMA, odd)
  hf = json.loads((odd / "config.json").read_text())
  (odd / "config.json").write_text(json.dumps({**hf, "vocab_size": 100}))
  with pytest.raises(ValueError, match=r"odd': its config\.json has vocab_size=100 but its own "
                                       r"tokenizer\.json has 128 tokens; one of the two"):
    build.resolve_config(tiny_config(**{"init.actor_checkpoint": str(odd),
                                        "init.tokenizer": str(odd)}), HFTokenizer.from_file(odd))
  prompts = tmp_path / "prompts.jsonl"
  _write_prompts(prompts, REPEAT_PROMPTS)
  write_reward_checkpoint(tmp_path / "rm16", REWARD_CFG.replace(vocab_size=16))
  with pytest.raises(ValueError, match=r"config\.reward\.model_checkpoint='.*rm16' embeds "
                                       r"vocab_size=16 tokens but the actor \(config\.model\) "
                                       r"generates ids up to 21"):
    PPOTrainer(_reward_run_config(prompts, tmp_path / "rm16"), str(tmp_path / "a"))
  write_reward_checkpoint(tmp_path / "rm8", REWARD_CFG.replace(max_seq_len=8))
  # (named by its config.json's field: the reward model has no max_seq_len of its own)
  with pytest.raises(ValueError, match=r"= 14 exceeds the max_position_embeddings=8 in the "
                                       r"config\.json of config\.reward\.model_checkpoint="):
    PPOTrainer(_reward_run_config(prompts, tmp_path / "rm8"), str(tmp_path / "b"))
  # An actor or critic checkpoint trained on fewer positions than a prompt and its response.
  short = tmp_path / "llama8"
  shutil.copytree(LLAMA, short)
  with open(short / "config.json") as f:
    hf_cfg = json.load(f)
  with open(short / "config.json", "w") as f:
    json.dump({**hf_cfg, "max_position_embeddings": 8}, f)
  for field in ("actor_checkpoint", "critic_checkpoint"):
    with pytest.raises(ValueError, match=rf"= 14 exceeds the max_position_embeddings=8 that "
                                         rf"config\.init\.{field}='.*llama8' was trained on"):
      PPOTrainer(tiny_config(**{f"init.{field}": str(short), "init.tokenizer": str(
          short / "tokenizer.json")}), str(tmp_path / field))
  # A larger vocabulary (e.g. a pad token added to the reward model) reads every actor id: it
  # passes validation and reaches the build.
  write_reward_checkpoint(tmp_path / "rm30", REWARD_CFG.replace(vocab_size=30))
  with pytest.raises(AssertionError, match="built before the config was validated"):
    PPOTrainer(_reward_run_config(prompts, tmp_path / "rm30"), str(tmp_path / "c"))


def test_the_task_reward_reads_ids_with_the_runs_tokenizer():
  """reward.function='task' with init.tokenizer: the verifier decodes the generated ids and
  tokenises the targets with the run's tokenizer, not the task's own word-level one."""
  cfg = tiny_config(**{"init.tokenizer": os.path.join(LLAMA, "tokenizer.json")})
  task, tok = build.build_task_and_tokenizer(cfg)
  assert tok is not task.tokenizer
  rewards = build.build_rewards(cfg, task, tok, None, None)
  records = [{"prompt": "the quick", "target": "brown fox"}]
  ids = np.asarray([tok.encode("brown fox", add_bos=False) + [tok.eos_id]], np.int32)
  lens = np.asarray([ids.shape[1]], np.int32)
  np.testing.assert_allclose(rewards.combine(records, ids, lens)[0], [1.0])
  np.testing.assert_allclose(rewards_lib.target_match(records, ids, lens, tok), [1.0])


def test_the_ids_generation_config_lists_all_end_a_response(tmp_path):
  """A tokenizer directory whose generation_config.json lists several eos_token_ids (chat
  models end a turn on any of them): the trainer's sampling stops on each, and a response cut
  at the token budget by any of them counts as ended, not truncated."""
  shutil.copyfile(os.path.join(LLAMA, "tokenizer.json"), tmp_path / "tokenizer.json")
  other = HFTokenizer.from_file(LLAMA).encode("e", add_bos=False)[0]
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, other]}))
  trainer = PPOTrainer(tiny_config(**{"init.tokenizer": str(tmp_path), "num_iterations": 1,
                                      "rollout.max_new_tokens": 3}), str(tmp_path / "run"))
  assert trainer.sampling.stop_ids == (2, other)
  rows = np.asarray([[5, 6, 2], [5, 6, other], [5, 6, 7], [5, 2, 0]], np.int32)
  gen = type("Gen", (), {"response_tokens": rows, "response_lens": np.asarray([3, 3, 3, 2])})
  np.testing.assert_array_equal(trainer._truncated(gen), [False, False, True, False])


def test_a_checkpoints_architecture_keeps_the_runs_own_model_fields():
  """config.json sets the architecture; what the run chooses (numerics, kernels, recomputation,
  scanning, context, fused projections) stays as the config says. model.fused_projections was
  silently dropped for a checkpoint (the option aimed at exactly those runs did nothing)."""
  section = llama.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                              num_layers=1, num_heads=4, num_kv_heads=2, max_seq_len=96,
                              fused_projections=True, remat="full", scan_layers=True,
                              attention="reference")
  m = build.checkpoint_config(LLAMA, section)
  assert (m.fused_projections, m.remat, m.scan_layers, m.attention, m.max_seq_len) == (
      True, "full", True, "reference", 96)
  with open(os.path.join(LLAMA, "config.json")) as f:
    assert m.num_layers == json.load(f)["num_hidden_layers"] != section.num_layers


def test_a_tokenizer_other_than_the_actor_checkpoints_is_refused_or_warned_of(tmp_path, caplog):
  """configs/ppo_hf.py names its example's tokenizer: a user who changed only
  init.actor_checkpoint trained their model on the example's ids (its prompts read as other
  text) and exported that tokenizer beside it, with one warning line. A tokenizer that gives
  the checkpoint's tokens other ids is now refused; one that extends it (its ids kept) is
  warned of; the checkpoint's own, named as its file, its directory or a byte-identical copy,
  is neither."""
  import tokenizers
  copy = tmp_path / "copy.json"
  shutil.copy(os.path.join(LLAMA, "tokenizer.json"), copy)
  other = os.path.join(os.path.dirname(LLAMA), "tiny_chat")  # another vocabulary
  for given in (os.path.join(other, "tokenizer.json"), other):  # a directory: its tokenizer.json
    with pytest.raises(ValueError, match=r"config\.init\.tokenizer=.* is not the tokenizer of "
                       r"config\.init\.actor_checkpoint=.*: of the 400 pieces of its "
                       r"vocabulary, 51 are in the checkpoint's .* and 48 of those have other "
                       r"ids \(e\.g\. "):
      build.check_foreign_tokenizer(LLAMA, given)
  extended = tokenizers.Tokenizer.from_file(os.path.join(LLAMA, "tokenizer.json"))
  extended.add_tokens(["<tool_call>"])
  extended.save(str(tmp_path / "extended.json"))
  assert build.check_foreign_tokenizer(LLAMA, str(tmp_path / "extended.json"))
  # Special tokens alone at other ids (Llama 3.1 renamed 3.0's reserved ones; the text reads
  # the same): warned of, naming one, not refused.
  ckpt = tmp_path / "ckpt"
  shutil.copytree(LLAMA, ckpt)
  for order, path in ((["<|a|>", "<|b|>"], ckpt / "tokenizer.json"),
                      (["<|b|>", "<|a|>"], tmp_path / "renamed.json")):
    t = tokenizers.Tokenizer.from_file(os.path.join(LLAMA, "tokenizer.json"))
    t.add_special_tokens(order)
    t.save(str(path))
  with caplog.at_level(logging.WARNING):
    assert build.check_foreign_tokenizer(str(ckpt), str(tmp_path / "renamed.json"))
  assert "gives 2 special token(s) other ids than" in caplog.text
  # QWEN2's is a byte-identical copy of LLAMA's (the fixtures share one tokenizer).
  for same in (os.path.join(LLAMA, "tokenizer.json"), LLAMA, str(copy), QWEN2, ""):
    assert not build.check_foreign_tokenizer(LLAMA, same), same
  assert not build.check_foreign_tokenizer(str(tmp_path), other)  # no tokenizer of its own


def test_a_critic_or_reward_model_trained_with_another_tokenizer_is_refused():
  """configs/ppo_hf.py's critic is its example's checkpoint: a PPO run that changed the actor
  and init.tokenizer (as own_model.md's table says) but not init.critic_checkpoint trained that
  critic on ids it never saw, with one info line naming it. The refusal names the checkpoint,
  not the tokenizer; a critic or reward model with the run's own tokenizer passes."""
  other = os.path.join(FIXTURES, "tiny_chat", "tokenizer.json")  # another vocabulary
  tokenizer = HFTokenizer.from_file(other)
  critic = r"config\.init\.critic_checkpoint='.*tiny_llama' was not trained with config\.init\."
  with pytest.raises(ValueError, match=critic + r"tokenizer='.*tiny_chat/tokenizer\.json': of "
                     r"the 400 pieces of that vocabulary, 51 are in the checkpoint's .* and 48 "
                     r"of those have other ids \(e\.g\. .*; the critic would read every "
                     r"sequence as other tokens; set config\.init\.critic_checkpoint"):
    build.resolve_config(tiny_config(**{"init.critic_checkpoint": LLAMA,
                                        "init.tokenizer": other}), tokenizer, log=False)
  with pytest.raises(ValueError, match=r"config\.reward\.model_checkpoint='.*tiny_llama' was "
                     r"not trained with .*; the reward model would score every sequence as "
                     r"other tokens"):
    build.reward_model_config(tiny_config(**{"reward.kind": "model",
                                             "reward.model_checkpoint": LLAMA,
                                             "init.tokenizer": other}))
  # The checkpoint's own tokenizer (QWEN2's is a copy of LLAMA's): the critic loads its shape.
  own = os.path.join(QWEN2, "tokenizer.json")
  cfg = build.resolve_config(tiny_config(**{"init.critic_checkpoint": LLAMA,
                                            "init.tokenizer": own}),
                             HFTokenizer.from_file(own), log=False)
  with open(os.path.join(LLAMA, "config.json")) as f:
    assert cfg.critic_model.num_layers == json.load(f)["num_hidden_layers"]
  # A critic-free estimator loads no critic: its checkpoint is not compared.
  build.resolve_config(tiny_config(**{"init.critic_checkpoint": LLAMA, "init.tokenizer": other,
                                      "algo.estimator": "grpo",
                                      "rollout.samples_per_prompt": 2}), tokenizer, log=False)


def test_a_tokenizer_that_cannot_spell_the_prompts_is_warned_of():
  """A tokenizer without byte fallback or an unknown token drops what its vocabulary lacks:
  tests/fixtures/tiny_mistral's read 'Ann has 14 cards' back as 'nn has  cards', so every
  number of every GSM8K prompt vanished, silently. The first prompts are now read back and the
  loss warned of; configs/ppo_hf.py's example tokenizer spells its own data."""
  from rlhfuse_jax.data.tokenizer import HFTokenizer
  repo = os.path.dirname(os.path.dirname(os.path.dirname(LLAMA)))
  with open(os.path.join(repo, "configs", "data", "tiny_gsm8k", "train.jsonl")) as f:
    questions = [json.loads(line)["question"] for line in f][:2]
  records = [{"prompt": questions[0]}, {"prompt": [{"role": "user", "content": questions[1]}]}]
  lossy = HFTokenizer.from_file(os.path.join(os.path.dirname(LLAMA), "tiny_mistral"))
  assert build.warn_unspellable(records, lossy, "prompts.jsonl") == 2
  own = HFTokenizer.from_file(os.path.join(repo, "configs", "data", "tiny_llama3_chat"))
  assert build.warn_unspellable(records, own, "prompts.jsonl") == 0
  # Prompts rendered by another tool (chat_template=none) hold the template's special tokens:
  # they read back too (decoded without them, all 32 of a file were said unspellable).
  rendered = [{"prompt": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n" + q +
               "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"}
              for q in questions]
  assert build.warn_unspellable(rendered, own, "prerendered.jsonl") == 0


def test_a_response_budget_shorter_than_the_targets_is_warned_of():
  """rollout.max_new_tokens below a target's length + EOS, with a reward that scores the whole
  target: those responses are cut before they can earn full marks. A run with
  max_new_tokens=1 on 'repeat' (targets up to 9 tokens) trained on without a word."""
  cfg = tiny_config(**{"rollout.max_new_tokens": 4})
  task, tok = build.build_task_and_tokenizer(cfg)
  records = task.make_prompts(64, 0)
  needed = [len(tok.encode(r["target"], add_bos=False)) + 1 for r in records]
  assert build.warn_short_budget(cfg, records, tok) == sum(n > 4 for n in needed) > 0
  assert build.warn_short_budget(tiny_config(**{"rollout.max_new_tokens": max(needed)}),
                                 records, tok) == 0
  # A reward that reads only part of the response (a final number): no warning.
  cfg = tiny_config(**{"rollout.max_new_tokens": 4, "reward.function": "gsm8k"})
  assert build.warn_short_budget(cfg, records, tok) == 0


def test_the_models_built_are_logged_and_a_toy_critic_beside_a_real_actor_warned_of(caplog):
  """A checkpoint's config.json replaces config.model's shape (a --config.model.num_layers
  beside it is not the model trained): the log names each model's shape and source. A critic
  built from config.critic_model's shape (ppo_hf.py's 2 x 64 toy) beside an actor of a
  checkpoint 8 times its size trained silently."""
  tok = HFTokenizer.from_file(LLAMA)
  with caplog.at_level(logging.INFO):
    build.resolve_config(tiny_config(**{
        "init.actor_checkpoint": LLAMA, "init.tokenizer": LLAMA, "model.num_layers": 8,
        "critic_model.hidden_size": 8, "critic_model.intermediate_size": 16,
        "critic_model.num_heads": 2, "critic_model.num_kv_heads": 2}), tok)
  assert "actor: 2 layers, hidden 64, 4/2 heads, vocab 128" in caplog.text  # not 8 layers
  assert f"(config.init.actor_checkpoint={LLAMA!r})" in caplog.text
  assert "critic: 1 layers, hidden 8" in caplog.text
  assert "the critic is built from config.critic_model's shape" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.INFO):
    build.resolve_config(tiny_config(**{"init.actor_checkpoint": LLAMA, "init.tokenizer": LLAMA,
                                        "init.critic_checkpoint": LLAMA}), tok)
  assert "critic: 2 layers, hidden 64" in caplog.text
  assert f"critic_checkpoint={LLAMA!r}; value head drawn fresh)" in caplog.text
  assert "the critic is built from" not in caplog.text


def test_the_log_says_whether_the_critic_value_head_is_a_reward_models_score_head(tmp_path,
                                                                                  caplog):
  """A critic from a reward model starts from its trained score head (hf_loader._value_head),
  from a language model with a fresh one; the log said neither."""
  write_reward_checkpoint(tmp_path / "rm")
  cfg = tiny_config(**{"init.critic_checkpoint": str(tmp_path / "rm")})
  with caplog.at_level(logging.INFO):
    build.resolve_config(cfg, build.build_task_and_tokenizer(cfg)[1])
  assert "; value head: its score.weight (a reward model's head))" in caplog.text


def test_the_checkpoints_generation_config_stop_ids_hold_with_a_tokenizer_elsewhere(tmp_path):
  """The tokenizer reads the generation_config.json beside its own file only: with
  init.tokenizer in another directory the run generated past the checkpoint's stop ids, which
  the export (copying the checkpoint's generation_config.json) tells transformers to stop on."""
  model, tok_dir = tmp_path / "model", tmp_path / "tok"
  shutil.copytree(LLAMA, model)
  tok_dir.mkdir()
  shutil.copy(os.path.join(LLAMA, "tokenizer.json"), tok_dir / "tokenizer.json")
  cfg = tiny_config(**{"init.actor_checkpoint": str(model),
                       "init.tokenizer": str(tok_dir / "tokenizer.json")})
  _, plain = build.build_task_and_tokenizer(cfg)
  (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, plain.eos_id]}))
  _, tok = build.build_task_and_tokenizer(cfg)
  assert 5 not in plain.stop_ids and tok.stop_ids == plain.stop_ids + (5,)
  # Without the file, the checkpoint's config.json's eos_token_id, as transformers reads it.
  os.remove(model / "generation_config.json")
  config = json.loads((model / "config.json").read_text())
  (model / "config.json").write_text(json.dumps({**config, "eos_token_id": [6, plain.eos_id]}))
  assert build.build_task_and_tokenizer(cfg)[1].stop_ids == plain.stop_ids + (6,)
  (model / "config.json").write_text(json.dumps(config))
  (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 4000}))
  with pytest.raises(ValueError, match=r"config\.init\.tokenizer=.* is not the tokenizer of "
                     r"config\.init\.actor_checkpoint=.*: its 128 tokens lack the ids \[4000\] "
                     r"that the checkpoint's generation_config\.json stops on"):
    build.build_task_and_tokenizer(cfg)


def test_the_log_names_the_chat_template_and_the_prompt_lengths(tmp_path, caplog):
  """The log said nothing of the prompts' rendering: which template 'auto' or a path found (or
  none), and how long the rendered prompts are against data.max_prompt_len (to size it)."""
  repo = os.path.dirname(os.path.dirname(os.path.dirname(LLAMA)))
  model = os.path.join(repo, "configs", "data", "tiny_llama3_chat")
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": "1 2 3 " * n, "target": "1"}) + "\n"
                             for n in (1, 2, 5)))
  common = {"init.tokenizer": os.path.join(model, "tokenizer.json"),
            "data.prompts_file": str(prompts), "data.max_prompt_len": 60}
  lines = {}
  for template in ("auto", "none"):
    cfg = tiny_config(**common, **{"data.chat_template": template})
    task, tok = build.build_task_and_tokenizer(cfg)
    caplog.clear()
    with caplog.at_level(logging.INFO):
      train, _ = build.build_datasets(cfg, task, tok)
    lines[template] = [r.getMessage() for r in caplog.records
                       if r.getMessage().startswith("prompts: rendered")]
    lengths = np.sort(np.asarray(train.lengths))
    how = (f"with the chat template of {model}/tokenizer_config.json "
           "(config.data.chat_template='auto')" if template == "auto" else
           "as plain text (config.data.chat_template='none')")
    assert lines[template] == [
        f"prompts: rendered {how}; tokens per prompt: training median {lengths[1]}, longest "
        f"{lengths[2]} (config.data.max_prompt_len=60)"]
  assert lines["auto"] != lines["none"]  # the template's tokens count
