"""Faults a careful user meets, each with what must happen (docs/results.md "Reliability").

Non-finite values stop the run (or skip the step) before anything is written or saved; a resume
with a changed config is refused field by field; the LR schedule continues across a longer run;
metrics are written exactly once; one run per workdir; a damaged checkpoint falls back to the
intact one; a failed save or kill -9 loses nothing; bad inputs name the file and the field.
"""
import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from rlhfuse_jax import checkpointing
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.models import hf_loader
from rlhfuse_jax.trainer import build, hooks, loop
from rlhfuse_jax.trainer import config as config_lib
from rlhfuse_jax.trainer.loop import PPOTrainer
from tests.test_train_ppo_binary import COMPILE_LOG, METRIC_NAMES, REPO, _cmd, _env, _steps
from tests.test_trainer import _deterministic, _params, tiny_config, tiny_config_dict
from tests.test_workdir import _hold_as
from tests.xla_env import subprocess_env

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def _poison_update(trainer, at_call: int, how: str):
  """Wraps trainer.update's step function: at the at_call-th optimizer step (1-based) either the
  actor's new params become NaN ("params") or the mini-batch's advantages do, so its gradients
  are NaN ("grads")."""
  orig, calls = trainer.update._fn, [0]

  def update(actor, critic, mb):
    calls[0] += 1
    if how == "grads" and calls[0] == at_call:
      mb = {**mb, "advantages": mb["advantages"] * jnp.nan}
    actor, critic, m = orig(actor, critic, mb)
    if how == "params" and calls[0] == at_call:
      actor = actor.replace(params=jax.tree.map(lambda x: x * jnp.nan, actor.params))
    return actor, critic, m
  trainer.update._fn = update


# ------------------------------------------------------------------------------ non-finite
def test_nonfinite_params_stop_the_run_and_keep_the_last_finite_checkpoint(tmp_path):
  # 4 updates per iteration (16 samples, mini-batches of 8, 2 epochs): the 12th is the last of
  # iteration 3, so only the parameter check can see it. (3 iterations: the resume runs the 3rd.)
  cfg = tiny_config(**{"num_iterations": 3, "checkpoint.every": 1, "checkpoint.keep": 1})
  trainer = PPOTrainer(cfg, str(tmp_path))
  _poison_update(trainer, 12, "params")
  with pytest.raises(loop.NonFiniteError, match=r"iteration 3: .*actor parameters.*last "
                                                 r"checkpoint \(2\) is kept, .*resume "
                                                 r"naming them in config\.checkpoint\."
                                                 r"resume_changes"):
    trainer.run()
  assert _steps(str(tmp_path)) == [1, 2]  # nothing of iteration 3 written
  again = PPOTrainer(cfg, str(tmp_path))  # keep=1 did not rotate the finite one away
  assert again.resume_step == 2
  assert [h["step"] for h in again.run()] == [3]
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(_params(again)))


def test_nonfinite_gradients_stop_or_are_skipped(tmp_path):
  stop = PPOTrainer(tiny_config(), str(tmp_path / "stop"))
  _poison_update(stop, 3, "grads")
  with pytest.raises(loop.NonFiniteError, match=r"iteration 1: .*update 3/4"):
    stop.run()
  assert not os.path.exists(os.path.join(tmp_path, "stop", "metrics.jsonl")) or \
      _steps(str(tmp_path / "stop")) == []

  skip = PPOTrainer(tiny_config(**{"guard.on_nonfinite": "skip_update"}), str(tmp_path / "skip"))
  _poison_update(skip, 3, "grads")
  history = skip.run()
  assert [h["guard/skipped_updates"] for h in history] == [1, 1, 1, 1]  # actor's one step
  # The logged LR is the one the actor's last applied step used: the skipped step did not
  # advance its schedule (4 updates per iteration, one skipped in the first).
  lr = skip.update.actor_lr
  assert [h["actor/lr"] for h in history] == [float(lr(4 * (i + 1) - 2)) for i in range(4)]
  assert float(lr(4 - 2)) != float(lr(4 - 1))  # warmup: the schedule moves every step
  # The critic's steps were all applied: its LR is its own schedule's at its last step.
  critic_lr = skip.update.critic_lr
  assert [h["critic/lr"] for h in history] == [float(critic_lr(4 * (i + 1) - 1))
                                               for i in range(4)]
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(_params(skip)))
  assert all(np.isfinite(h["actor/pg_loss"]) for h in history)  # means over finite steps


def _stopped_by_rollout(trainer, poison) -> tuple[str, list]:
  """Runs `trainer` with each generated batch passed through poison(iteration, gen); returns
  the NonFiniteError's message and one entry per optimizer step that ran."""
  orig, updates = trainer._generate, []
  trainer._generate = lambda iteration, params, version: poison(
      iteration, orig(iteration, params, version))
  orig_update = trainer.update._fn
  trainer.update._fn = lambda *a: updates.append(1) or orig_update(*a)
  with pytest.raises(loop.NonFiniteError) as e:
    trainer.run()
  return str(e.value), updates


def test_a_nonfinite_rollout_stops_before_any_update_naming_what_and_the_sample(tmp_path):
  """A reward model's NaN (here: poisoned scores of samples 3 and 5, and one critic value inside
  sample 7's response) stops the run before any update trains on it, naming each part, its
  count and first sample; the advice is to check the reward, not to lower the learning rate.
  NaN values in a response's padding are not the run's: they pass."""
  def poison(iteration, gen):
    del iteration
    scores, values = gen.scores.copy(), gen.values.copy()
    scores[[3, 5]] = np.nan
    values[7, 0] = np.inf
    values[np.arange(len(values)), -1] = np.where(gen.response_lens < values.shape[1], np.nan,
                                                  values[:, -1])  # padding only
    return dataclasses.replace(gen, scores=scores, values=values)
  msg, updates = _stopped_by_rollout(PPOTrainer(tiny_config(), str(tmp_path)), poison)
  assert ("iteration 1: non-finite values: the rollout's reward of 2 of 16 samples (first: "
          "sample 3, nan); critic values of 1 of 16 samples (first: sample 7, inf), before any "
          "update") in msg, msg
  assert "check the reward" in msg and "Lower optim.actor_lr" not in msg, msg
  assert updates == []
  assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl")) or _steps(str(tmp_path)) == []


def test_an_async_rollout_with_nonfinite_reference_log_probs_stops_before_its_update(tmp_path):
  """Async PPO (staleness 1): iteration 2 trains on the batch generated during iteration 1,
  whose reference log-probs are NaN inside one response (a behaviour log-prob is inf on
  padding, which passes). The run stops before iteration 2's first update, names the reference
  model (not the reward), keeps the general advice's --workdir caveat, and says that the
  checkpoint saved since may hold the batch in flight."""
  def poison(iteration, gen):
    if iteration != 1:
      return gen
    ref, logp = gen.ref_logp.copy(), gen.logprobs.copy()
    ref[4, 0] = np.nan
    logp[np.arange(len(logp)), -1] = np.where(gen.response_lens < logp.shape[1], np.inf,
                                              logp[:, -1])  # padding only
    return dataclasses.replace(gen, ref_logp=ref, logprobs=logp)
  msg, updates = _stopped_by_rollout(PPOTrainer(
      tiny_config(**{"async_ppo.staleness": 1, "checkpoint.every": 1}), str(tmp_path)), poison)
  assert ("iteration 2: non-finite values: the rollout's reference log-probs of 1 of 16 samples "
          "(first: sample 4, nan), before any update") in msg, msg
  assert "check the reference model and" in msg and "the reward" not in msg, msg
  assert "in a new --workdir" in msg and "may hold this batch in flight" in msg, msg
  assert len(updates) == 4  # iteration 1's 2 epochs x 2 mini-batches, none of iteration 2's
  assert _steps(str(tmp_path)) == [1]


def test_async_proximal_log_probs_that_are_not_finite_stop_before_the_update(tmp_path):
  """Async PPO (staleness 1): the current actor's log-probs of the batch it trains on (the
  proximal policy, which weighs every token of the update) are checked as the rollout is: NaN
  inside one response of iteration 2's batch stops the run before that iteration's first
  update, naming the actor's forward; NaN on padding passes (iteration 1)."""
  trainer = PPOTrainer(tiny_config(**{"async_ppo.staleness": 1, "checkpoint.every": 1}),
                       str(tmp_path))
  rescorer, calls = trainer._rescorer, []
  orig = rescorer.logprobs

  def poisoned(cfg, params, batch, temperature):
    prox = np.array(orig(cfg, params, batch, temperature), np.float32)
    calls.append(1)
    if len(calls) == 1:  # padding only: passes
      prox[np.arange(len(prox)), -1] = np.where(batch.response_lens < prox.shape[1], np.nan,
                                                prox[:, -1])
    else:
      prox[6, 0] = np.nan
    return prox
  rescorer.logprobs = poisoned
  msg, updates = _stopped_by_rollout(trainer, lambda iteration, gen: gen)
  assert ("iteration 2: non-finite values: the rollout's proximal log-probs (the current "
          "actor's) of 1 of 16 samples (first: sample 6, nan), before any update") in msg, msg
  assert "check the actor (its forward on the batch)" in msg, msg
  assert len(updates) == 4 and _steps(str(tmp_path)) == [1]


def test_a_skipped_step_leaves_bfloat16_weights_and_their_float32_copy(tmp_path):
  """guard.on_nonfinite="skip_update" with optim.master_weights on bfloat16 weights (the GPU
  presets' optimizer): the skipped step leaves the weights and the copy as they were, and the
  weights stay the copy rounded. (The guard once sat outside the copy's step: its skip branch
  returned bfloat16 zeros against the step's float32 updates, and the first update failed.)"""
  cfg = tiny_config(num_iterations=1, **{
      "guard.on_nonfinite": "skip_update", "optim.master_weights": True,
      "model.param_dtype": "bfloat16", "critic_model.param_dtype": "bfloat16"})
  trainer = PPOTrainer(cfg, str(tmp_path))
  _poison_update(trainer, 2, "grads")
  seen, step = [], trainer.update._fn

  def spy(actor, critic, mb):
    seen.append(jax.device_get((actor.params, actor.opt_state.master)))
    out = step(actor, critic, mb)
    seen.append(jax.device_get((out[0].params, out[0].opt_state.master)))
    return out
  trainer.update._fn = spy
  history = trainer.run()
  assert [h["guard/skipped_updates"] for h in history] == [1]
  before, after = seen[2], seen[3]  # around the second (poisoned) step
  jax.tree.map(np.testing.assert_array_equal, after, before)
  # The third step (the first is at the warm-up's learning rate 0) moved the copy.
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(seen[4][1]),
                                                      jax.tree.leaves(seen[5][1])))
  params, master = jax.device_get((trainer.actor.params, trainer.actor.opt_state.master))
  jax.tree.map(lambda p, m: np.testing.assert_array_equal(p, m.astype(p.dtype)), params, master)


def test_nonfinite_weights_in_a_checkpoint_name_the_file_and_tensor(tmp_path):
  src = os.path.join(FIXTURES, "tiny_qwen2")
  dst = str(tmp_path / "ckpt")
  shutil.copytree(src, dst)
  path = os.path.join(dst, "model.safetensors")
  tensors = safetensors.numpy.load_file(path)
  name = "model.layers.0.mlp.up_proj.weight"
  tensors[name] = tensors[name].copy()
  tensors[name].flat[5] = np.nan
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
  cfg = hf_loader.load_hf_config(dst)
  with pytest.raises(ValueError, match=rf"model.safetensors: tensor {name} holds 1 non-finite"):
    hf_loader.load_hf_params(dst, cfg)


def test_truncated_safetensors_names_the_file(tmp_path):
  dst = str(tmp_path / "ckpt")
  shutil.copytree(os.path.join(FIXTURES, "tiny_qwen2"), dst)
  path = os.path.join(dst, "model.safetensors")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  with pytest.raises(ValueError, match="model.safetensors"):
    hf_loader.load_hf_params(dst, hf_loader.load_hf_config(dst))


_CALLS = [0]


def _reset_calls():
  """The reward functions below count their calls in _CALLS of the module the trainer imports
  them from (tests.test_faults), which may be another module object than this test's own."""
  for name in ("tests.test_faults", __name__):
    if name in sys.modules:
      sys.modules[name]._CALLS[0] = 0


def nan_in_the_second_batch(response, answer, record):
  """A reward function (config.reward.function) that returns NaN for the 20th sample it sees:
  in iteration 2 of the tiny run (16 samples each)."""
  del answer, record
  _CALLS[0] += 1
  return float("nan") if _CALLS[0] == 20 else float(len(response) % 3)


def test_a_reward_functions_bad_value_names_the_iteration_and_what_is_kept(tmp_path):
  """A reward function's NaN in iteration 2 stops the run naming the function and the sample,
  and now also the iteration and the checkpoint a re-run resumes from (it said neither: in a
  long run the progress line may be many iterations back). The re-run resumes there."""
  _reset_calls()
  cfg = tiny_config(**{"num_iterations": 3, "checkpoint.every": 1,
                       "reward.function": "tests.test_faults:nan_in_the_second_batch"})
  with pytest.raises(ValueError, match=r"^iteration 2: reward function 'tests\.test_faults:nan_in"
                                       r"_the_second_batch' returned nan for sample 3 .*the last "
                                       r"checkpoint \(1\) is kept: the same command resumes"):
    PPOTrainer(cfg, str(tmp_path)).run()
  assert _steps(str(tmp_path)) == [1]
  again = PPOTrainer(cfg, str(tmp_path))
  assert again.resume_step == 1
  assert [h["step"] for h in again.run()] == [2, 3]  # the 20th call is behind it


def fails_after_two_batches(response, answer, record):
  """A reward function (config.reward.function) that raises from its 33rd sample on: in the
  tiny run's validation pass after iteration 2 (16 training samples an iteration)."""
  del answer, record
  _CALLS[0] += 1
  if _CALLS[0] > 32:
    raise ZeroDivisionError("boom")
  return float(len(response) % 3)


def test_a_reward_function_failing_in_the_validation_pass_names_it_and_the_way_past(tmp_path):
  """The held-out pass called the reward function without the training rollout's wrapping:
  the error named neither the iteration, nor the pass, nor what a re-run resumes from, nor
  that eval_every=0 trains past it."""
  _reset_calls()
  cfg = tiny_config(**{"num_iterations": 3, "checkpoint.every": 1, "eval_every": 2,
                       "data.val_fraction": 0.25, "data.val_max_prompts": 4,
                       "reward.function": "tests.test_faults:fails_after_two_batches"})
  with pytest.raises(ValueError, match=r"^iteration 2, the validation pass on the held-out "
                                       r"prompts: reward function 'tests\.test_faults:fails_after"
                                       r"_two_batches' failed on sample 0 .*ZeroDivisionError.*the "
                                       r"last checkpoint \(1\) is kept: the same command resumes "
                                       r"from it once the function is fixed \(or with --config\."
                                       r"eval_every=0"):
    PPOTrainer(cfg, str(tmp_path)).run()
  assert _steps(str(tmp_path)) == [1]


def huge_reward(response, answer, record):
  """A reward function with a finite value whose square overflows float32."""
  del answer, record
  return 1e30 if len(response) % 2 else -1e30


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_rewards_too_large_to_square_are_named_not_the_learning_rate(tmp_path, estimator):
  """Rewards of +-1e30 are finite (accepted), but the critic's loss (PPO) or reward/std (GRPO)
  overflows: the guard advised lowering the learning rate. It now names the rewards' scale."""
  over = {"num_iterations": 1, "reward.function": "tests.test_faults:huge_reward"}
  if estimator == "grpo":
    over.update({"algo.estimator": "grpo", "rollout.samples_per_prompt": 4,
                 "rollout.prompts_per_iteration": 4})
  with pytest.raises(loop.NonFiniteError, match=(
      r"^iteration 1: non-finite values: .*too large for float32 arithmetic: \d+ of 16 exceed "
      r"1\.9e\+18 in magnitude \(first: sample \d+, -?1e\+30\).*scale the reward .*, or "
      r"bound it with config\.reward\.clip_range")):
    PPOTrainer(tiny_config(**over), str(tmp_path)).run()


def test_the_reward_limit_is_where_the_batch_sum_of_squares_overflows():
  """The limit was 1e18 whatever the batch: 1024 samples of 16 tokens at 5e17 overflow the
  critic loss's float32 sum of squares but were not named. It now scales with the batch's
  tokens: just below it the sum is finite, just above it is not."""
  for n, t in ((16, 6), (1024, 16), (64, 256)):
    limit = loop.reward_square_limit(n, t)
    with np.errstate(over="ignore"):
      below = np.sum(np.square(np.full(n * t, 0.99 * limit, np.float32)), dtype=np.float32)
      above = np.sum(np.square(np.full(n * t, 1.01 * limit, np.float32)), dtype=np.float32)
    assert np.isfinite(below) and not np.isfinite(above), (n, t, limit)
  assert loop.reward_square_limit(1024, 16) < 5e17


# ------------------------------------------------------------------------------ resume safety
def test_a_refused_resume_says_which_fields_cannot_change_and_the_flag_for_the_others():
  """The refusal listed every field checkpoint.resume_changes takes, for a changed
  algo.estimator (which no resume may change) as for a changed algo.entropy_coef: now it names
  the fixed ones, and the exact flag (with the fields already named) for the others."""
  only = config_lib.resume_advice(["algo.entropy_coef: 0.0 -> 0.01"])
  assert "add --config.checkpoint.resume_changes=algo.entropy_coef," in only
  assert "No resume may change" not in only
  mixed = config_lib.resume_advice(["algo.entropy_coef: 0.0 -> 0.01",
                                    "algo.estimator: 'gae' -> 'rloo'"],
                                   frozenset({"optim.actor_lr"}))
  assert mixed.startswith("No resume may change algo.estimator (")
  assert "resume_changes=algo.entropy_coef,optim.actor_lr," in mixed
  fixed = config_lib.resume_advice(["model.num_layers: 2 -> 4"])
  assert "model.num_layers" in fixed and "resume_changes" not in fixed
  # The inference micro-batch moves rounding, not the saved state: a run started with one
  # larger than the batch (refused since) resumes with 0 through the flag.
  micro = config_lib.resume_advice(["fusion.inference_micro_batch: 1000 -> 0"])
  assert "add --config.checkpoint.resume_changes=fusion.inference_micro_batch," in micro


def test_resume_changes_says_what_is_wrong_with_each_field_it_does_not_take():
  """checkpoint.resume_changes naming a field it does not take said of each "others change the
  saved state's layout ...: start a new --workdir": num_iterations too, which a resume changes
  without naming it, and a misspelled field, which it did not point out. Each is named now with
  what is wrong with it."""
  def error(value):
    with pytest.raises(ValueError, match=r"config\.checkpoint\.resume_changes=.*: expected "
                                         r"comma-separated fields of \[") as e:
      tiny_config(**{"checkpoint.resume_changes": value})
    return str(e.value).partition("]: ")[2]
  assert error("optim.actor_lr,num_iterations") == (
      "num_iterations needs no naming (a resume may change it freely)")
  assert error("optim.critc_lr") == "'optim.critc_lr' is no config field (did you mean " \
      "optim.critic_lr?)"
  assert error("eval_every, data.val_file,seed") == (
      "data.val_file, eval_every need no naming (a resume may change them freely); no resume "
      "may change seed (the saved state's layout or what the checkpoints mean: start a new "
      "--workdir)")
  assert tiny_config(**{"checkpoint.resume_changes": " optim.actor_lr, algo.kl_coef "}
                     ).checkpoint.resume_changes_set == {"optim.actor_lr", "algo.kl_coef"}
  # An input's path (a model copied to node-local scratch) was "no resume may change
  # init.actor_checkpoint ... start a new --workdir", where a resume takes a new path to the
  # same files without naming it (trainer/inputs.py; docs/usage.md).
  assert error("init.actor_checkpoint,data.prompts_file") == (
      "data.prompts_file, init.actor_checkpoint need no naming for a new path (a resume takes "
      "the same files at another path; other files are refused)")


def test_resume_with_a_changed_config_is_refused_naming_each_field(tmp_path, straight):
  """A resume of the uninterrupted run (a copy of `straight`'s 6 iterations) with changed
  hyper-parameters is refused before anything is built, naming each field; more iterations and
  another logging/checkpoint cadence are allowed, and a field named in
  checkpoint.resume_changes may change (the LR then floors at the new peak's min_lr_ratio)."""
  _, workdir, _, _ = straight
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  changed = tiny_config(**{"num_iterations": 8, "optim.actor_lr": 5e-4,
                           "rollout.max_new_tokens": 5, "data.task": "copy"})
  t0 = time.time()
  with pytest.raises(ValueError) as e:
    PPOTrainer(changed, run)
  assert time.time() - t0 < 5  # refused before building or compiling anything
  msg = str(e.value)
  for field in ("optim.actor_lr: 0.003 -> 0.0005", "rollout.max_new_tokens: 6 -> 5",
                "data.task: 'repeat' -> 'copy'",
                "No resume may change data.task, rollout.max_new_tokens",
                "add --config.checkpoint.resume_changes=optim.actor_lr,"):
    assert field in msg, msg
  # What a resume may change is allowed: more iterations, other logging/checkpoint cadence.
  ok = PPOTrainer(tiny_config(**{"num_iterations": 7, "log_every": 2, "checkpoint.every": 3}),
                  run)
  assert [h["step"] for h in ok.run()] == [7]
  # A hyper-parameter named in checkpoint.resume_changes may change (the NaN guard's advice:
  # continue with a lower learning rate); the others are still refused.
  lower = {"num_iterations": 8, "optim.actor_lr": 5e-4}
  with pytest.raises(ValueError, match=r"optim\.actor_lr: 0\.003 -> 0\.0005.*config\.checkpoint"
                                       r"\.resume_changes"):
    PPOTrainer(tiny_config(**lower), run)
  with pytest.raises(ValueError, match=r"config\.checkpoint\.resume_changes='model\.num_layers': "
                                       r"expected comma-separated fields of"):
    tiny_config(**{"checkpoint.resume_changes": "model.num_layers"})
  with pytest.raises(ValueError, match=r"rollout\.max_new_tokens: 6 -> 5"):
    PPOTrainer(tiny_config(**lower, **{"rollout.max_new_tokens": 5,
                                       "checkpoint.resume_changes": "optim.actor_lr"}), run)
  # fusion.inference_micro_batch moves the inference's rounding only: it may change too.
  resumed = PPOTrainer(tiny_config(**lower, **{
      "fusion.inference_micro_batch": 2,
      "checkpoint.resume_changes": "optim.actor_lr,fusion.inference_micro_batch"}), run)
  assert [h["step"] for h in resumed.run()] == [8]
  rows = wd.read_jsonl(os.path.join(run, "metrics.jsonl"))
  # Past the first start's horizon (6 iterations x 4 updates) the LR sits on its floor:
  # min_lr_ratio (0.1) of the peak, now the new one.
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8]
  assert rows[6]["actor/lr"] == pytest.approx(3e-3 * 0.1)
  assert rows[7]["actor/lr"] == pytest.approx(5e-4 * 0.1)


def test_a_resume_may_split_the_update_into_micro_batches_when_named(tmp_path, straight):
  """algo.microbatch_size is the way out of an update out of memory, the same step up to float
  rounding: a resume with it was refused as a field no resume may change ("the saved state's
  layout"). Named in checkpoint.resume_changes, the run resumes from iteration 4 of `straight`
  on micro-batches of 2 rows (of the 8 a mini-batch has) and trains iterations 5-6 as the
  uninterrupted run did, up to rounding; the checkpoints then record the new value."""
  cfg, workdir, _, want_rows = straight
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  shutil.rmtree(os.path.join(run, "checkpoints", "6"))  # as a run stopped after iteration 4
  split = {"num_iterations": 6, "algo.microbatch_size": 2}
  with pytest.raises(ValueError, match=r"algo\.microbatch_size: 0 -> 2\. To continue with the "
                                       r"new value of algo\.microbatch_size, add --config\."
                                       r"checkpoint\.resume_changes=algo\.microbatch_size,"):
    PPOTrainer(tiny_config(**split), run)
  named = tiny_config(**split, **{"checkpoint.resume_changes": "algo.microbatch_size"})
  assert [h["step"] for h in PPOTrainer(named, run).run()] == [5, 6]
  rows = wd.read_jsonl(os.path.join(run, "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  for got, want in zip(rows[4:], want_rows[4:]):
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "reward/mean"):
      assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)
  # Recorded: the same config resumes without naming it again, the original one is refused.
  later = {"num_iterations": 7, "algo.microbatch_size": 2}
  assert [h["step"] for h in PPOTrainer(tiny_config(**later), run).run()] == [7]
  with pytest.raises(ValueError, match=r"algo\.microbatch_size: 2 -> 0"):
    PPOTrainer(tiny_config(**{"num_iterations": 8}), run)


def test_raising_num_iterations_continues_the_lr_schedule(tmp_path, straight, caplog):
  """The horizon is the first start's num_iterations (a copy of `straight`: 6 iterations x 4
  updates): extended to 8, the LR stays on the cosine's floor instead of restarting the cosine,
  and the resume says so; a longer optim.schedule_iterations, named in resume_changes, stretches
  the cosine (refused unless named)."""
  _, workdir, _, _ = straight
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  with caplog.at_level("WARNING"):
    history = PPOTrainer(tiny_config(**{"num_iterations": 8}), run).run()
  assert "iterations 7-8 run at the LR schedule's floor" in caplog.text
  rows = wd.read_jsonl(os.path.join(run, "metrics.jsonl"))
  lrs = [r["actor/lr"] for r in rows]
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8] and len(history) == 2
  floor = 3e-3 * 0.1  # optim.actor_lr * min_lr_ratio
  assert lrs[5] >= lrs[6] and lrs[6] == pytest.approx(floor) and lrs[7] == pytest.approx(floor), lrs
  # What the warning advises: a longer horizon, named in resume_changes, stretches the cosine.
  with pytest.raises(ValueError, match="optim.schedule_iterations"):
    PPOTrainer(tiny_config(**{"num_iterations": 9, "optim.schedule_iterations": 16}), run)
  caplog.clear()
  with caplog.at_level("WARNING"):
    PPOTrainer(tiny_config(**{"num_iterations": 9, "optim.schedule_iterations": 16,
                              "checkpoint.resume_changes": "optim.schedule_iterations"}),
               run).run()
  # (its 0 is the first start's horizon, which the log said nothing of)
  assert ("a changed optim.schedule_iterations: 0 -> 16 (0 there: the checkpoints' horizon, "
          "6 iterations)") in caplog.text, caplog.text
  last = wd.read_jsonl(os.path.join(run, "metrics.jsonl"))[-1]
  assert last["step"] == 9 and last["actor/lr"] > 2 * floor
  # Back to 0: the horizon the checkpoints keep is now 16, and it stays (the log read as a
  # return to the first start's 6 iterations, where the LR went on along the 16's cosine).
  caplog.clear()
  with caplog.at_level("WARNING"):
    PPOTrainer(tiny_config(**{"num_iterations": 10,
                              "checkpoint.resume_changes": "optim.schedule_iterations"}),
               run).run()
  assert ("a changed optim.schedule_iterations: 16 -> 0 (0 keeps the checkpoints' horizon, 16 "
          "iterations: the LR schedule stays as it was; set the number of iterations it should "
          "span instead)") in caplog.text, caplog.text
  last = wd.read_jsonl(os.path.join(run, "metrics.jsonl"))[-1]
  assert last["step"] == 10 and last["actor/lr"] > 2 * floor


def test_a_shorter_num_iterations_on_a_finished_run_says_where_the_run_stays(tmp_path, straight,
                                                                              caplog):
  """num_iterations below the iterations a workdir holds trains nothing and keeps them all:
  the log says so, and that a shorter run needs a new workdir (it said only "nothing to
  train", and result.json then read iterations 6 of num_iterations 4)."""
  _, workdir, _, _ = straight
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  with caplog.at_level("INFO"):
    assert PPOTrainer(tiny_config(**{"num_iterations": 4}), run).run() == []
  assert ("workdir already has 6 iterations (num_iterations=4): nothing to train; its "
          "checkpoints and metrics stay at iteration 6 (a shorter run of this config needs a "
          "new --workdir)") in caplog.text, caplog.text
  assert [r["step"] for r in wd.read_jsonl(os.path.join(run, "metrics.jsonl"))] == [
      1, 2, 3, 4, 5, 6]


def test_a_finished_run_whose_last_row_was_torn_says_so_and_stays_at_its_checkpoint(
    tmp_path, straight, caplog):
  """A finished run re-run after metrics.jsonl lost its last row (a torn line): the trainer
  warns that the row is missing, as a resume does (it dropped it silently), and trained_to,
  the iteration train_ppo's result.json gives, stays the checkpoint's 6."""
  _, workdir, _, _ = straight
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  path = os.path.join(run, "metrics.jsonl")
  with open(path) as f:
    text = f.read()
  with open(path, "w") as f:
    f.write(text[:text.rstrip("\n").rfind("\n") + 300])
  with caplog.at_level("INFO"):
    trainer = PPOTrainer(tiny_config(**{"num_iterations": 6}), run)
    assert trainer.run() == []
  assert trainer.trained_to == 6
  assert "has no row for 1 iteration(s) the checkpoint at iteration 6 covers (6)" in (
      caplog.text), caplog.text
  assert [r["step"] for r in wd.read_jsonl(path)] == [1, 2, 3, 4, 5]


def test_metrics_are_written_exactly_once_after_a_crash_before_the_first_checkpoint(tmp_path):
  cfg = tiny_config(**{"checkpoint.every": 100, "num_iterations": 3})
  crashing = PPOTrainer(cfg, str(tmp_path))
  orig = crashing.iteration

  def iteration(it):
    if it == 2:
      raise RuntimeError("crash")
    return orig(it)
  crashing.iteration = iteration
  with pytest.raises(RuntimeError, match="crash"):
    crashing.run()
  assert _steps(str(tmp_path)) == [1, 2]  # written, but no checkpoint holds them
  PPOTrainer(cfg, str(tmp_path)).run()
  assert _steps(str(tmp_path)) == [1, 2, 3]


_HANG_SCRIPT = """
import sys, time
from rlhfuse_jax.trainer import hooks
dog = hooks.HangWatchdog(2.0, num_iterations=5)
dog.begin(0)
# 3 iterations of 0.4 s: 1.2 s in all, none over the timeout (1.6 s of slack each: at 1 s, a
# loaded machine's 0.6 s stall would have ended an iteration that did not hang)
for step in (1, 2, 3):
  time.sleep(0.4)
  dog.after(step, {}, False)
print("three iterations done", flush=True)
def stuck_in_reward_function():
  time.sleep(60)
stuck_in_reward_function()
"""


# A hang in C code that holds the GIL (a regular expression backtracking for ever) keeps the
# Python timer from running: faulthandler's C watchdog ends it grace_s later (status 1).
_GIL_HANG_SCRIPT = """
import re
from rlhfuse_jax.trainer import hooks
dog = hooks.HangWatchdog(1.0, num_iterations=5, grace_s=1.0)
dog.begin(0)
def stuck_in_a_regex():
  return re.match(r"(a+)+$", "a" * 40 + "b")
stuck_in_a_regex()
print("the regex returned", flush=True)
"""


def test_a_hung_iteration_ends_the_process_with_its_stacks(tmp_path):
  """guard.iteration_timeout_s: iterations within the timeout pass however long the run;
  one that hangs ends the process with 69 (a requeue resumes), naming what it waited for and
  the timeout, with the stack of the thread that hangs. (Both processes start at once: each
  mostly imports and waits out its timeouts.)"""
  t0 = time.monotonic()
  procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for script in (_HANG_SCRIPT, _GIL_HANG_SCRIPT)]
  outs, took = [], []
  try:
    for proc in procs:
      stdout, stderr = proc.communicate(timeout=120)
      outs.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
      took.append(time.monotonic() - t0)
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  out = outs[0]
  assert out.returncode == 69, out.stderr[-3000:]
  assert "three iterations done" in out.stdout
  assert ("iteration 3's logging and checkpoint save, then iteration 4, did not finish within "
          "config.guard.iteration_timeout_s=2s: this process hangs") in out.stderr
  assert "in stuck_in_reward_function" in out.stderr  # faulthandler's stack of the main thread
  # An absl error line ending as the local launcher's first pattern expects (its "last error").
  assert re.search(r"^E[0-9]{4} .*exiting \(69\)$", out.stderr, re.M), out.stderr[:2000]
  assert took[0] < 30  # not the 60 s sleep
  out = outs[1]  # the regex
  assert out.returncode == 1 and "the regex returned" not in out.stdout, out.stderr[-2000:]
  assert "Timeout (0:00:02)!" in out.stderr and "in stuck_in_a_regex" in out.stderr
  assert took[1] < 30


def test_the_loop_arms_the_watchdog_for_every_iteration(tmp_path, monkeypatch):
  """The trainer's loop re-arms the watchdog after each iteration (a slow second iteration is
  what it reports) and disarms it when the run ends (nothing fires afterwards)."""
  fired = []
  monkeypatch.setattr(hooks.HangWatchdog, "_expire", lambda self: fired.append(self.waiting_for))
  cfg = tiny_config(**{"num_iterations": 2, "checkpoint.every": 100,
                       "guard.iteration_timeout_s": 0.5})
  trainer = PPOTrainer(cfg, str(tmp_path))
  orig = trainer.iteration

  def iteration(it):
    if it == 1:
      time.sleep(1.0)
    return orig(it)
  trainer.iteration = iteration
  trainer.run()
  assert "iteration 1's logging and checkpoint save, then iteration 2," in fired, fired
  n = len(fired)
  time.sleep(0.8)
  assert len(fired) == n  # disarmed at the end
  with pytest.raises(ValueError, match=r"config\.guard\.iteration_timeout_s=-1\.0: expected a "
                                       r"number of seconds >= 0"):
    tiny_config(**{"guard.iteration_timeout_s": -1})


def test_a_run_waits_for_a_lock_another_host_holds_until_lock_wait_s(tmp_path):
  """config.lock_wait_s reaches the workdir lock: a trainer waits for a holder on another host
  (a crashed node's lock on a shared filesystem, tests/test_workdir.py), refuses after the
  wait, naming the field; bad values are refused by name."""
  holder = _hold_as(str(tmp_path), "pid 7 on node-that-crashed (start 11)")
  with pytest.raises(RuntimeError, match=r"waited [12] s \(config\.lock_wait_s=1: how long"):
    PPOTrainer(tiny_config(lock_wait_s=1), str(tmp_path))
  cfg = tiny_config(lock_wait_s=60)

  class Locked(Exception):
    pass

  def on_locked():  # the workdir is this run's: stop before the set-up builds anything
    raise Locked()
  threading.Timer(1.0, holder.close).start()
  t0 = time.monotonic()
  with pytest.raises(Locked):
    PPOTrainer(cfg, str(tmp_path), on_locked=on_locked)
  assert time.monotonic() - t0 >= 0.9  # it waited for the holder
  wd.WorkdirLock(str(tmp_path)).release()  # and released on the way out
  for bad in (-1, float("inf")):
    with pytest.raises(ValueError, match=r"config\.lock_wait_s=.*: expected a finite number of "
                                         r"seconds >= 0"):
      tiny_config(lock_wait_s=bad)


def test_an_iteration_timeout_python_cannot_wait_for_is_refused():
  """Accepted before: the watchdog's Timer and faulthandler raised OverflowError at the first
  iteration, the first in the watchdog's own thread (so no timeout at all)."""
  with pytest.raises(ValueError, match=r"config\.guard\.iteration_timeout_s=10000000000\.0: "
                                       r"expected a number of seconds >= 0 and <= \d+ \(Python"):
    tiny_config(**{"guard.iteration_timeout_s": 1e10})


def test_a_run_whose_lock_file_is_deleted_stops_before_writing(tmp_path):
  """.lock taken for a stale pid file and deleted while the run lives: another start can lock a
  new one and write beside it (metrics rows twice, colliding saves). The live run notices and
  stops before its next iteration writes anything."""
  cfg = tiny_config(**{"num_iterations": 2})
  first = PPOTrainer(cfg, str(tmp_path / "wd"))
  assert "do not delete this file" in (tmp_path / "wd" / ".lock").read_text()
  os.remove(tmp_path / "wd" / ".lock")
  second = wd.WorkdirLock(str(tmp_path / "wd"))  # what another start would take now
  with pytest.raises(wd.WorkdirInUseError, match=r"\.lock was deleted or replaced while this run "
                                                 r"held it .* stopping before iteration 1 writes"):
    first.run()
  assert not os.path.exists(tmp_path / "wd" / "metrics.jsonl") or _steps(
      str(tmp_path / "wd")) == []
  second.release()


def test_a_run_whose_workdir_is_moved_stops_naming_where_it_went(tmp_path):
  """`mv WORKDIR NEW` while the run lives: it stops before its next iteration writes, and says
  the workdir moved and which --workdir resumes it (it said the .lock was deleted and another
  start may be writing there: check what else runs)."""
  cfg = tiny_config(**{"num_iterations": 2})
  first = PPOTrainer(cfg, str(tmp_path / "wd"))
  os.rename(tmp_path / "wd", tmp_path / "moved")
  with pytest.raises(wd.WorkdirInUseError, match=(
      rf"the workdir {re.escape(str(tmp_path / 'wd'))} was moved to "
      rf"{re.escape(str(tmp_path / 'moved'))} while this run wrote in it: stopping before "
      rf"iteration 1 writes .* resume with --workdir={re.escape(str(tmp_path / 'moved'))} ")):
    first.run()
  # No iteration written at the old path (a fresh start creates no empty metrics.jsonl there)
  assert not (tmp_path / "wd" / "metrics.jsonl").exists() or _steps(str(tmp_path / "wd")) == []


def test_the_other_processes_of_a_run_whose_workdir_moved_say_so_too(tmp_path, monkeypatch):
  """A multi-process run's workdir moved: the processes other than 0 (which hold no lock) said
  ".lock was deleted or replaced ... another start may be writing there", while process 0 said
  where the workdir went; they now say it moved (process 0's log names where). Stood in for:
  this process without the lock, process 0's verdict that it is lost."""
  from rlhfuse_jax.trainer import loop as loop_lib
  cfg = tiny_config(**{"num_iterations": 2})
  other = PPOTrainer(cfg, str(tmp_path / "wd"))
  other.release_lock()  # as on a process other than 0: no lock of its own
  os.rename(tmp_path / "wd", tmp_path / "moved")
  monkeypatch.setattr(loop_lib.distributed, "max_over_processes", lambda value: 1)
  monkeypatch.setattr(loop_lib.jax, "process_index", lambda: 1)
  with pytest.raises(wd.WorkdirInUseError, match=(
      rf"^the workdir {re.escape(str(tmp_path / 'wd'))} was moved, renamed or deleted "
      r"\(process 0's log names where\) while this run wrote in it: stopping before iteration 1 "
      r"writes")):
    other._check_lock(1)


def test_a_save_that_fails_as_its_workdir_moves_says_why_first(tmp_path):
  """`mv WORKDIR NEW` during a checkpoint save: the save fails (orbax: NOT_FOUND on its temporary
  directory, exit 3 in train_ppo) and the error now begins with the move and the --workdir that
  resumes, before orbax's text (stood in for here: a save failing as the workdir moves)."""
  cfg = tiny_config(**{"num_iterations": 3, "checkpoint.every": 1})
  trainer = PPOTrainer(cfg, str(tmp_path / "wd"))
  wait = trainer.checkpoints.wait

  def moved_mid_save():
    if trainer.checkpoints.latest_step() == 2:
      os.rename(tmp_path / "wd", tmp_path / "moved")
      raise checkpointing.SaveError("checkpoint save under .../checkpoints failed: ValueError: "
                                    "NOT_FOUND: Error opening \"zarr\" driver")
    wait()
  trainer.checkpoints.wait = moved_mid_save
  with pytest.raises(checkpointing.SaveError, match=(
      rf"^the workdir {re.escape(str(tmp_path / 'wd'))} was moved to "
      rf"{re.escape(str(tmp_path / 'moved'))} while this run wrote in it: the checkpoint save "
      rf"in progress failed\. .*resume with --workdir={re.escape(str(tmp_path / 'moved'))} .*"
      r"\(checkpoint save under \.\.\./checkpoints failed: ValueError: NOT_FOUND")):
    trainer.run()
  assert PPOTrainer(cfg, str(tmp_path / "moved")).resume_step >= 1


def test_a_second_run_on_the_same_workdir_is_refused(tmp_path):
  # (2 iterations, as the watchdog test's run: its update is loaded, not compiled again)
  cfg = tiny_config(**{"num_iterations": 2})
  first = PPOTrainer(cfg, str(tmp_path))
  with pytest.raises(RuntimeError, match=rf"in use by another run \(pid {os.getpid()} on \S+ "
                                         r"\(start \d+\)\); wait for it"):
    PPOTrainer(cfg, str(tmp_path))
  first.run()  # releases the lock when it ends
  # Once per trainer: a second call would restore the old resume point over the trained state
  # and rewrite metrics.jsonl; a new trainer on the workdir resumes.
  with pytest.raises(RuntimeError, match=r"run\(\) was already called on this trainer"):
    first.run()
  assert _steps(str(tmp_path)) == [1, 2]
  # keep_lock (train_ppo, which writes result.json after run()): held until release_lock(),
  # also on a start that finds nothing to train.
  again = PPOTrainer(cfg, str(tmp_path))
  assert again.run(keep_lock=True) == []
  with pytest.raises(RuntimeError, match="in use by another run"):
    PPOTrainer(cfg, str(tmp_path))
  again.release_lock()
  again.release_lock()  # idempotent
  assert PPOTrainer(cfg, str(tmp_path)).run() == []
  wd.WorkdirLock(str(tmp_path)).release()  # run() released it: free again


def test_a_start_refused_by_the_config_closes_what_it_opened(tmp_path, monkeypatch):
  """A config error found after the checkpoint manager opened (a mesh these devices cannot
  make) closes the manager (left open, orbax's cleanup thread raced the interpreter's shutdown
  and printed its traceback after the error) and releases the workdir."""
  closed = []
  real_close = checkpointing.Checkpointer.close
  monkeypatch.setattr(checkpointing.Checkpointer, "close",
                      lambda self: (closed.append(self), real_close(self))[-1])
  with pytest.raises(ValueError, match=r"multiply to 3 devices but 8 are available"):
    PPOTrainer(tiny_config(**{"mesh.data": 3}), str(tmp_path))
  assert len(closed) == 1
  wd.WorkdirLock(str(tmp_path)).release()  # free again


# ------------------------------------------------------------------------------ damage
def _damage_arrays(step_dir):
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    for f in files:
      if os.sep + "d" in root:  # the array data files
        p = os.path.join(root, f)
        with open(p, "r+b") as fh:
          fh.write(b"\x00garbage" * (os.path.getsize(p) // 8 + 1))


def test_only_callbacks_onto_a_closed_event_loop_are_dropped(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
  hook = checkpointing._ClosedLoopCallbacks()
  hook.install()
  hook.install()  # twice: still one link in the chain
  assert sys.unraisablehook is hook

  class Unraisable:  # the fields sys.unraisablehook reads
    def __init__(self, e):
      self.exc_type, self.exc_value, self.exc_traceback = type(e), e, None
      self.err_msg, self.object = None, None

  other = RuntimeError("something else")
  for e in (RuntimeError("Event loop is closed"), other, ValueError("Event loop is closed")):
    sys.unraisablehook(Unraisable(e))
  assert hook.dropped == 1 and [str(e) for e in seen] == ["something else",
                                                          "Event loop is closed"]
  # A hook installed later that passes calls on to ours, then ours put in front again (the
  # next restore): a cycle, which ends in Python's default hook instead of recursing.
  chained = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: (chained.append(1), hook(u)))
  hook.install()
  printed = []
  monkeypatch.setattr(sys, "__unraisablehook__", lambda u: printed.append(str(u.exc_value)))
  sys.unraisablehook(Unraisable(RuntimeError("once")))
  assert chained == [1] and printed == ["once"]


def test_an_unwritable_checkpoints_directory_stops_the_set_up(tmp_path, monkeypatch):
  """Found at set-up, naming the directory, not at the first save checkpoint.every iterations
  later. (The tests may run as root, whom permissions do not stop: the failed write is made.)"""
  def refused(**kw):
    raise PermissionError(1, "Operation not permitted", kw["dir"])
  monkeypatch.setattr(checkpointing.tempfile, "NamedTemporaryFile", refused)
  with pytest.raises(ValueError, match=r"the checkpoints directory .*/checkpoints is not "
                                       r"writable \(PermissionError: .*Operation not permitted"):
    checkpointing.Checkpointer(str(tmp_path)).raise_if_unwritable()
  # The trainer stops at set-up, where its processes compare what they read of the workdir.
  with pytest.raises(ValueError, match=r"the checkpoints directory .*/checkpoints is not "):
    PPOTrainer(tiny_config(num_iterations=1), str(tmp_path / "run"))
  monkeypatch.undo()
  checkpointing.Checkpointer(str(tmp_path)).close()
  assert os.listdir(tmp_path / "checkpoints") == []  # the probe leaves nothing


def test_a_file_where_the_checkpoints_directory_goes_is_named(tmp_path):
  """WORKDIR/checkpoints a file (or a dangling link): orbax's threads failed on it with a
  NotADirectoryError traceback, which train_ppo reported as a crash; now a ValueError (bad
  input, one line) naming it and what to do, and the file stays."""
  (tmp_path / "checkpoints").write_text("notes")
  with pytest.raises(ValueError, match=r"/checkpoints is not a directory \(a file, or a link to "
                                       r"none\): the run keeps its checkpoints there; move it"):
    checkpointing.Checkpointer(str(tmp_path))
  assert (tmp_path / "checkpoints").read_text() == "notes"
  (tmp_path / "checkpoints").unlink()
  (tmp_path / "checkpoints").symlink_to(tmp_path / "gone")
  with pytest.raises(ValueError, match=r"/checkpoints is not a directory"):
    checkpointing.Checkpointer(str(tmp_path))


def test_small_replicated_arrays_are_saved_whole_with_orbaxs_array_metadata(tmp_path,
                                                                            monkeypatch, caplog):
  """checkpointing's ArrayHandler: an array replicated over 8 devices whose per-replica slices
  would be under MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL is written by one replica, not sliced (a
  compiled slicing op per slice); orbax's array metadata is still written, so a typed PRNG key
  restores as a key; registering it prints no orbax warning."""
  import logging as py_logging
  import orbax.checkpoint as ocp
  from rlhfuse_jax.parallel import mesh as mesh_lib
  slices = []
  real_slice = jax.lax.slice_in_dim
  monkeypatch.setattr(jax.lax, "slice_in_dim", lambda *a, **k: slices.append(1) or
                      real_slice(*a, **k))
  # orbax's own handler, as in a fresh process (an earlier test may have registered ours)
  handler = ocp.type_handlers.get_type_handler(jax.Array)
  store = handler._array_metadata_store  # pylint: disable=protected-access
  ocp.type_handlers.register_type_handler(
      jax.Array, ocp.type_handlers.ArrayHandler(array_metadata_store=store), override=True)
  caplog.set_level(py_logging.INFO)
  caplog.clear()
  ckpt = checkpointing.Checkpointer(str(tmp_path))
  assert "overriding" not in caplog.text, caplog.text
  handler = ocp.type_handlers.get_type_handler(jax.Array)
  assert handler._min_slice_bytes_for_replica_parallel == (  # pylint: disable=protected-access
      checkpointing.MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = {"w": jax.device_put(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), replicated),
           "key": jax.random.key(1)}
  ckpt.save(1, state, {"iteration": 1})
  ckpt.wait()
  assert not slices
  assert os.path.exists(tmp_path / "checkpoints" / "1" / "state" / "array_metadatas" /
                        "process_0")
  out, _ = ckpt.restore(1, state)
  assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(state["key"]))
  np.testing.assert_array_equal(out["w"], state["w"])
  ckpt.close()


def test_checksums_see_any_flipped_bit_and_not_the_sharding():
  """checkpointing.checksums: the same values give the same sums however they are sharded
  (a restore onto other devices checks as well); one flipped bit in any dtype changes them."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from rlhfuse_jax.parallel import mesh as mesh_lib
  rng = np.random.default_rng(0)
  state = {"w": rng.normal(size=(8, 6)).astype(np.float32),
           "b": jnp.asarray(rng.normal(size=(16,)), jnp.bfloat16),
           "step": np.int32(7), "mask": np.array([True, False, True])}
  sums = checkpointing.checksums(state)
  assert set(sums) == {"w", "b", "step", "mask"}
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))
  sharded = dict(state, w=jax.device_put(state["w"], NamedSharding(mesh, P("data"))),
                 b=jax.device_put(state["b"], NamedSharding(mesh, P("data"))))
  assert checkpointing.checksums(sharded) == sums
  for key in ("w", "b"):
    flipped = np.array(state[key]).copy()
    bits = flipped.view(np.uint32 if key == "w" else np.uint16)
    bits.flat[3] ^= 1 << 5
    assert checkpointing.checksums(dict(state, **{key: flipped}))[key] != sums[key]
  # Two flips of one bit that cancel in a plain sum (+32 in one element, -32 in another).
  w = np.zeros((8, 6), np.float32)
  w.view(np.uint32).flat[1] = 32
  moved = np.zeros((8, 6), np.float32)
  moved.view(np.uint32).flat[2] = 32
  assert checkpointing.checksums({"w": w}) != checkpointing.checksums({"w": moved})
  meta = {"checksums": sums}
  checkpointing.verify(4, sharded, meta)
  with pytest.raises(checkpointing.DamagedCheckpointError, match="checkpoint 4: 1 array"):
    checkpointing.verify(4, dict(state, step=np.int32(8)), meta)
  checkpointing.verify(4, {"anything": 1}, {})  # written before checksums: not checked


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """An uninterrupted tiny run of 6 iterations: (config, workdir, final params, metrics rows)."""
  cfg = tiny_config(**{"num_iterations": 6})
  workdir = str(tmp_path_factory.mktemp("straight"))
  trainer = PPOTrainer(cfg, workdir)
  trainer.run()
  return cfg, workdir, _params(trainer), wd.read_jsonl(os.path.join(workdir, "metrics.jsonl"))


def test_a_damaged_checkpoint_a_run_does_not_set_aside_comes_with_the_command(tmp_path,
                                                                             straight):
  """checkpoint.fallback=False (and a multi-process run, the same message's other branch) stops
  on a damaged latest checkpoint: the error now gives the command that sets it aside as a
  single-process run would (it said: move that checkpoint out of the checkpoints directory);
  that command, run as given, lets the same start resume from the one before."""
  import shutil
  _, workdir, _, _ = straight
  run = str(tmp_path / "run dir")  # a space: the command quotes its paths
  shutil.copytree(workdir, run)
  os.remove(os.path.join(run, "checkpoints", "6", "meta", "metadata"))
  cfg = tiny_config(**{"num_iterations": 6, "checkpoint.fallback": False})
  with pytest.raises(ValueError, match=r"checkpoint 6 .* cannot be read .*fallback=False.* set "
                                       r"it aside and re-run: mkdir -p .* && mv ") as e:
    PPOTrainer(cfg, run)
  command = str(e.value).split("re-run: ")[-1].rstrip(")")
  subprocess.run(command, shell=True, check=True)
  assert os.listdir(os.path.join(run, "damaged_checkpoints")) == ["6"]
  assert PPOTrainer(cfg, run).resume_step == 4


@pytest.fixture(scope="module")
def stopped_at_4(tmp_path_factory, straight):
  """`straight`'s config stopped after iteration 4 (as by SIGTERM): a workdir with checkpoints
  2 and 4, as a preempted run leaves them. Each damage case below damages its own copy (one
  4-iteration run for the three, not one each)."""
  run = str(tmp_path_factory.mktemp("stopped_at_4") / "run")
  PPOTrainer(straight[0], run).run(stop_after=4, config_record={"start": "first"})
  return run


@pytest.mark.parametrize("damage", ["arrays", "side-car", "bits"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_intact_one(tmp_path, straight,
                                                                  stopped_at_4, damage, caplog,
                                                                  monkeypatch):
  """Also the in-process resume test: stopped at 4 (as by SIGTERM), resumed from 2 after the
  damage, the run ends with the uninterrupted run's parameters bitwise and its metrics.
  "bits": arrays that read without an error but hold other bits than were saved (damage inside
  a compressed chunk), found by the side-car's checksums (here the recorded checksum of one
  array changed instead: the same mismatch, made deterministic). The
  failed read's tensorstore callbacks onto orbax's closed event loop (18-130 unraisable
  tracebacks on stderr) are not printed."""
  import logging as py_logging
  caplog.set_level(py_logging.WARNING)
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))
  cfg, _, want_params, want_rows = straight
  run = str(tmp_path / "run")
  shutil.copytree(stopped_at_4, run)  # checkpoints 2 and 4, as a preempted run leaves them
  assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["2", "4"]
  latest = os.path.join(run, "checkpoints", "4")
  if damage == "arrays":
    _damage_arrays(latest)
  elif damage == "bits":
    side_car = os.path.join(latest, "meta", "metadata")
    meta = wd.read_json_object(side_car)
    path = sorted(meta["checksums"])[0]
    meta["checksums"][path] = (meta["checksums"][path] + 1) % 2**32
    meta[checkpointing.META_CHECKSUM] = checkpointing.meta_checksum(meta)  # the side-car intact
    with open(side_car, "w") as f:
      json.dump(meta, f)
  else:
    with open(os.path.join(latest, "meta", "metadata"), "w") as f:
      f.write("{not json")
  refuse = tiny_config(**{"num_iterations": 6, "checkpoint.fallback": False})
  if damage == "side-car":  # found while choosing what to resume
    with pytest.raises(ValueError, match=r"checkpoint 4 in .* cannot be read.*fallback=False"):
      PPOTrainer(refuse, run)
  again = PPOTrainer(cfg, run)
  assert [h["step"] for h in again.run(config_record={"start": "again"})] == [3, 4, 5, 6]
  # The config of each start is named by the iteration it really started at (from 2, not 4).
  assert [f for f in sorted(os.listdir(run)) if f.startswith("config")] == [
      "config.2.json", "config.json"]
  assert wd.read_json_object(os.path.join(run, "config.2.json")) == {"start": "again"}
  assert not [r for r in caplog.records if "resuming checkpoint" in r.getMessage()]  # same devices
  assert os.path.isdir(os.path.join(run, "damaged_checkpoints", "4"))  # kept, not deleted
  if damage == "bits":
    assert (f"checkpoint 4: 1 array(s) read back with other contents than were saved (checksum)"
            f", e.g. {path}") in caplog.text
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(again), want_params)
  rows = wd.read_jsonl(os.path.join(run, "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # nothing lost or written twice
  assert _deterministic(rows) == _deterministic(want_rows)
  assert not unraisable, unraisable[:3]


def test_a_side_car_with_a_flipped_bit_that_still_parses_is_damage(tmp_path):
  """A flipped bit in a digit of the JSON side-car ('5' -> '7' in the prompt stream's
  position) parses, and the arrays' checksums do not cover the side-car: the run resumed from
  another data position (or LR horizon), silently. Its own digest now finds it: damage, set
  aside with fallback as an unreadable side-car is."""
  import jax.numpy as jnp
  from rlhfuse_jax.trainer import hooks
  ck = checkpointing.Checkpointer(str(tmp_path), keep=3)
  try:
    for step in (2, 4):
      ck.save(step, {"w": jnp.zeros((2,))}, {"iteration": step, "seed": 0,
                                             "data": {"position": 5 * step}})
      ck.wait()
    assert ck.restore_meta(4)["data"] == {"position": 20}
  finally:
    ck.close()
  side_car = tmp_path / "checkpoints" / "4" / "meta" / "metadata"
  text = side_car.read_text()
  assert '"position": 20' in text
  side_car.write_text(text.replace('"position": 20', '"position": 22'))  # '0' ^ 0b10
  ck = checkpointing.Checkpointer(str(tmp_path), keep=3)
  try:
    with pytest.raises(checkpointing.DamagedCheckpointError,
                       match=r"checkpoint 4: its side-car \(meta\) reads back with other "
                             r"contents than were saved"):
      ck.restore_meta(4)
    with pytest.raises(checkpointing.DamagedCheckpointError, match="checkpoint 4: its side-car"):
      ck.restore(4, {"w": jnp.zeros((2,))})
  finally:
    ck.close()
  c = hooks.Checkpoints(str(tmp_path), tiny_config(), {})
  try:
    step, meta = c.resume_point()
  finally:
    c.checkpointer.close()
  assert (step, meta["data"]) == (2, {"position": 10})
  assert os.listdir(tmp_path / "damaged_checkpoints") == ["4"]


def test_a_finished_run_builds_nothing_and_still_checks_the_config(straight, monkeypatch):
  cfg, workdir, _, _ = straight

  def no_build(*args, **kwargs):
    raise AssertionError("a finished run built its models")
  monkeypatch.setattr(build, "build_models", no_build)
  # A row after the last checkpoint (an extension to 7 iterations that died before saving)
  # holds no kept state: a finished start drops it too, as every start does.
  wd.append_jsonl(os.path.join(workdir, "metrics.jsonl"), {"step": 7, "reward/mean": 0.5})
  events = set(os.listdir(os.path.join(workdir, "tb")))
  again = PPOTrainer(cfg, workdir)
  assert again.finished_at == 6 and again.run() == []
  assert _steps(workdir) == [1, 2, 3, 4, 5, 6]
  # ... and from TensorBoard: a new events file whose purge marker (SessionLog START at step 7)
  # hides what the extension wrote there.
  new = set(os.listdir(os.path.join(workdir, "tb"))) - events
  assert len(new) == 1, new
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  data = open(os.path.join(workdir, "tb", new.pop()), "rb").read()
  marks, pos = [], 0
  while pos < len(data):  # TFRecord framing: length, crc, event, crc
    (length,) = struct.unpack("<Q", data[pos:pos + 8])
    event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
    pos += 12 + length + 4
    if event.HasField("session_log"):
      marks.append((event.session_log.status, event.step))
  assert marks == [(event_pb2.SessionLog.START, 7)], marks
  again = PPOTrainer(cfg, workdir)  # nothing after the checkpoint now: tb/ stays as it is
  assert again.run() == [] and len(os.listdir(os.path.join(workdir, "tb"))) == len(events) + 1
  # checked without a build; the way to resume is named, not only a new workdir
  with pytest.raises(ValueError, match=r"config.seed=1 differs .*: resume with "
                                       r"--config.seed=0, or start a new --workdir"):
    PPOTrainer(tiny_config(num_iterations=6, seed=1), workdir)


def test_a_finished_start_drops_the_sample_rows_after_its_checkpoint(tmp_path, straight):
  """samples.jsonl is written exactly once, as metrics.jsonl: the rows of an extension that
  died before its next save belong to no kept state, and a finished start drops them too (it
  kept them: rows of iteration 7 beside a run finished at 6)."""
  cfg, workdir, _, _ = straight
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  path = os.path.join(run, "samples.jsonl")
  for step in (6, 7):
    wd.append_jsonl(path, {"step": step, "sample": 0, "prompt": "p", "response": "r"})
  assert PPOTrainer(cfg, run).run() == []
  assert [r["step"] for r in wd.read_jsonl(path)] == [6]


def test_a_resume_on_other_devices_says_so(tmp_path, straight, caplog):
  """mesh.data=-1 takes every device: a preempted run may come back on fewer. It continues,
  with a warning that names both layouts, since it is not the uninterrupted trajectory."""
  import logging as py_logging
  import shutil
  from rlhfuse_jax.parallel import mesh as mesh_lib
  _, workdir, _, _ = straight
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  cfg = tiny_config(**{"num_iterations": 7})
  with caplog.at_level(py_logging.WARNING):
    again = PPOTrainer(cfg, run, mesh=mesh_lib.make_mesh(mesh_lib.MeshConfig(data=4),
                                                         jax.devices()[:4]))
    assert [h["step"] for h in again.run()] == [7]
  warned = [r.getMessage() for r in caplog.records if "resuming checkpoint 6" in r.getMessage()]
  assert len(warned) == 1 and "'data': 8" in warned[0] and "'data': 4" in warned[0], warned


def test_a_device_count_the_batch_does_not_split_over_names_the_counts_that_do():
  """A job back on 3 devices (a GPU lost) with mesh.data=-1: the batch of 16 does not split
  over them. The error said only that it must be a multiple of 3; it now lists the
  data-parallel sizes that split batch and mini-batch (a resume cannot change them) and how
  to show jax that many devices."""
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.trainer import validate
  with pytest.raises(ValueError, match=(
      r"config\.rollout\.prompts_per_iteration\*samples_per_prompt=16 must be a multiple of the "
      r"data-parallel size 3 .*; sizes that split both the batch and the mini-batch: "
      r"\[1, 2, 4, 8\] \(with mesh\.data=-1 the visible devices set it: CUDA_VISIBLE_DEVICES")):
    validate.validate(tiny_config(), mesh_lib.make_mesh(mesh_lib.MeshConfig(data=3),
                                                        jax.devices()[:3]))


@pytest.mark.parametrize("axes, now", [({"mesh.data": 4}, "'data': 4, 'fsdp': 1"),
                                        ({"mesh.fsdp": 2, "mesh.tensor": 2},
                                         "'data': 1, 'fsdp': 2, 'stage': 1, 'tensor': 2")])
def test_a_resume_may_lay_the_state_out_on_the_devices_it_has(tmp_path, straight, caplog, axes,
                                                              now):
  """A run saved on data=8 comes back on 4 devices: it resumes with --config.mesh.data=4 (a run
  that set it explicitly; -1 always resized), or with the state split over fsdp and tensor,
  warning of the other layout (the state is restored into the new shardings, its shapes
  checked). Both were refused as "No resume may change mesh.data (the saved state's layout
  ...)": start a new --workdir. (mesh.stage changes the saved state's shapes: still refused.)"""
  import logging as py_logging
  import shutil
  from rlhfuse_jax.parallel import mesh as mesh_lib
  _, workdir, _, _ = straight
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  cfg = tiny_config(**{"num_iterations": 7, **axes})
  with caplog.at_level(py_logging.WARNING):
    again = PPOTrainer(cfg, run, mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4]))
    assert [h["step"] for h in again.run()] == [7]
  warned = [r.getMessage() for r in caplog.records if "resuming checkpoint 6" in r.getMessage()]
  assert len(warned) == 1 and "'data': 8" in warned[0] and now in warned[0], warned
  # The state restored into the new shardings is the saved one: iteration 7 on 4 devices ends
  # where it ends on the 8 that saved it (up to the reductions' rounding).
  same = str(tmp_path / "same")
  shutil.copytree(workdir, same)
  on_8 = PPOTrainer(tiny_config(**{"num_iterations": 7}), same)
  on_8.run()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               _params(again), _params(on_8))
  changes = config_lib.fingerprint_changes(tiny_config().fingerprint(), cfg.fingerprint())
  assert not [c for c in changes if c.startswith("mesh.")], changes
  assert config_lib.fingerprint_changes(tiny_config().fingerprint(),
                                        tiny_config(**{"mesh.stage": 2}).fingerprint()) == [
      "mesh.stage: 1 -> 2"]


# ------------------------------------------------------------------------------ processes
def test_kill_9_then_resume_equals_the_uninterrupted_run(tmp_path, straight):
  """The binary end to end: what a run writes; kill -9 mid-run, the same command resumes and
  gives the uninterrupted run's metrics; once more, it says the run is finished and compiles
  nothing. (Continuing to a larger num_iterations: test_raising_num_iterations_...)

  The binary runs on the suite's 8 devices, as `straight` does: the uninterrupted run is that
  fixture's (SMALL is tiny_config; checkpoint.every changes no metric). A third binary start
  for it trained the same 6 iterations again; on 8 devices the binary's rows equal the
  fixture's bitwise, and its starts load the fixture's programs from the compilation cache."""
  want = straight[3]
  n = ["--config.num_iterations=6", "--config.checkpoint.every=1"]
  env = lambda **extra: subprocess_env(8, **extra)
  run = str(tmp_path / "run")
  proc = subprocess.Popen(_cmd(run, *n), cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while not (os.path.exists(os.path.join(run, "metrics.jsonl")) and len(_steps(run)) >= 3):
    assert proc.poll() is None and time.time() < deadline
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)  # mid-iteration or mid-save: whatever it was doing
  proc.wait(timeout=60)
  out = subprocess.run(_cmd(run, *n), cwd=REPO, env=env(), capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed from checkpoint at iteration" in out.stderr
  rows = wd.read_jsonl(os.path.join(run, "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # no step repeated or lost
  assert _deterministic(rows) == _deterministic(want)
  # What the run wrote (the resumed start finished it).
  for name in ("config.json", "metrics.jsonl", "result.json"):
    assert os.path.exists(os.path.join(run, name)), name
  assert os.listdir(os.path.join(run, "tb")), "no TensorBoard events"
  result = json.load(open(os.path.join(run, "result.json")))
  assert (result["status"], result["iterations"], result["num_iterations"]) == ("done", 6, 6)
  assert not [k for k, v in result["final"].items() if isinstance(v, list)]
  for key in METRIC_NAMES:  # docs/architecture.md §1
    assert key in rows[0], key
  # The same command again: the run is finished, so it says so without compiling anything.
  out = subprocess.run(_cmd(run, *n), cwd=REPO, env=env(JAX_LOG_COMPILES="1"), check=True,
                       capture_output=True, text=True, timeout=600)
  assert "workdir already has 6 iterations (num_iterations=6): nothing to train" in out.stderr
  assert COMPILE_LOG not in out.stderr, out.stderr[-3000:]
  assert _steps(run) == [1, 2, 3, 4, 5, 6]
  # The config of each start is kept: config.json (first) and config.<k>.json (the resume).
  starts = sorted(f for f in os.listdir(run) if f.startswith("config."))
  assert "config.json" in starts and len(starts) == 2, starts
  # WORKDIR/log.txt: each start's log under its own header, the killed one's lines included.
  log = open(os.path.join(run, "log.txt")).read()
  assert log.count("\n=== ") + log.startswith("=== ") == 3, log[:2000]
  for line in ("iter 3/6", "resumed from checkpoint at iteration", "nothing to train"):
    assert line in log, line
  umask = os.umask(0)
  os.umask(umask)
  assert os.stat(os.path.join(run, "result.json")).st_mode & 0o777 == 0o666 & ~umask


def test_a_failed_save_stops_the_run_at_once(tmp_path):
  run = str(tmp_path / "run")
  proc = subprocess.Popen(_cmd(run, "--config.num_iterations=10000", "--config.checkpoint.every=1"),
                          cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  deadline = time.time() + 300
  while not (os.path.exists(os.path.join(run, "metrics.jsonl")) and len(_steps(run)) >= 2):
    assert proc.poll() is None and time.time() < deadline
    time.sleep(0.05)
  ckpts = os.path.join(run, "checkpoints")
  # The checkpoint directory is gone and a file is in its way: every later save fails. A save
  # under way can make the directory again between the move and the file's creation (the CI
  # saw it once): then move that one too and try again.
  for attempt in range(100):
    if os.path.isdir(ckpts):
      shutil.move(ckpts, f"{ckpts}.moved{attempt}")
    try:
      fd = os.open(ckpts, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except (FileExistsError, IsADirectoryError):
      continue
    with os.fdopen(fd, "w") as f:
      f.write("not a directory")
    break
  assert os.path.isfile(ckpts)
  t0 = time.time()
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 3, err[-3000:]
  assert time.time() - t0 < 60  # not orbax's 5-minute wait
  assert "checkpoint save under" in err and ckpts in err


# Runs a command with every file it writes limited to `argv[1]` bytes: a write past it fails
# (EFBIG; SIGXFSZ ignored, else it kills the process), in tensorstore's threads as on a full disk.
_FILE_SIZE_LIMIT = [sys.executable, "-c", "import os, resource, signal, sys; "
                    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); n = int(sys.argv[1]); "
                    "resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
                    "os.execvp(sys.argv[2], sys.argv[2:])"]


def test_a_save_failing_in_the_writes_says_so_in_a_few_lines(tmp_path):
  """A save whose array writes fail (a full disk: here a file-size limit that the checkpoint's
  arrays pass and the run's log (31 kB), metrics and config do not; the MLP's intermediate size
  makes each of its weights 131 kB: ocdbt may split a save's small arrays over several data
  files under load, each under the limit, and the save then succeeded) ends the run
  with exit 3 and the one-line error, and not with what orbax and tensorstore print on the way:
  tensorstore's callbacks onto orbax's closed event loop (152 unraisable tracebacks, measured
  before they were dropped) and orbax's per-thread tracebacks (80 in all, 791 stderr lines),
  now in log.txt alone. (A log file that cannot be written either: test_config_files.py.)"""
  run = str(tmp_path / "run")
  env = _env()
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # its entries would pass the limit too
  out = subprocess.run(
      _FILE_SIZE_LIMIT + ["80000"] + _cmd(run, "--config.num_iterations=4",
                                          "--config.compilation_cache_dir=none",
                                          "--config.model.intermediate_size=1024"),
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  err = out.stderr
  assert out.returncode == 3, err[-3000:]
  assert "checkpoint save under" in err.splitlines()[-1], err[-3000:]
  assert err.splitlines()[-1].endswith(  # (its first checkpoint: orbax lists no failed one)
      "; no checkpoint was saved yet: once the cause is fixed, the same command starts the run "
      "over"), err[-3000:]
  assert "Event loop is closed" not in err and "Traceback" not in err, err[-3000:]
  assert len(err.splitlines()) < 40, err[-3000:]
  log = open(os.path.join(run, "log.txt")).read()
  assert "Traceback (most recent call last)" in log and f"(traceback: {run}/log.txt)" in err
  assert _steps(run) == [1, 2] and not os.path.isdir(os.path.join(run, "checkpoints", "2"))


# (the file, and its fsync at iteration 3: one per row, log_samples=1; TensorBoard's event
# file syncs once more, at its start)
@pytest.mark.parametrize("name,fails_at", [("metrics.jsonl", 3), ("samples.jsonl", 3), ("tb", 4)])
def test_a_full_disk_at_a_log_row_stops_the_run_as_a_failed_save_does(tmp_path, monkeypatch,
                                                                      name, fails_at):
  """A full disk at iteration 3's row (its fsync fails: ENOSPC, as written data meets a full
  disk) ended the run with the bare OSError (train_ppo: exit 1), where one at a checkpoint save
  ends it with SaveError (exit 3): one fault, two statuses for a scheduler. Now a SaveError too,
  naming the file (TensorBoard's directory: its writes name none) and the checkpoint the same
  command resumes from; that resume then writes every row once."""
  run = str(tmp_path / "run")
  path = os.path.join(run, name)
  real, synced = os.fsync, []

  def fsync(fd):
    target = os.readlink(f"/proc/self/fd/{fd}")
    if path in (target, os.path.dirname(target)):
      synced.append(fd)
      if len(synced) == fails_at:
        raise OSError(errno.ENOSPC, "No space left on device")
    real(fd)
  monkeypatch.setattr(os, "fsync", fsync)
  cfg = tiny_config(log_samples=1)  # 4 iterations, checkpoints every 2
  with pytest.raises(checkpointing.SaveError) as e:
    PPOTrainer(cfg, run).run()
  assert str(e.value) == (
      f"writing {path} failed: OSError: [Errno 28] No space left on device; nothing saved "
      "before is lost: checkpoint 2 and the metrics through it are intact, and the same "
      "command resumes from it once the cause is fixed")
  monkeypatch.undo()
  assert [h["step"] for h in PPOTrainer(cfg, run).run()] == [3, 4]
  for log in ("metrics.jsonl", "samples.jsonl"):
    assert [r["step"] for r in wd.read_jsonl(os.path.join(run, log))] == [1, 2, 3, 4]


def _full_disk_under(monkeypatch, directory: str, name: str = "") -> None:
  """os.fsync fails with ENOSPC (written data meeting a full disk) for the files in `directory`
  whose name ends with `name`."""
  real = os.fsync

  def fsync(fd):
    target = os.readlink(f"/proc/self/fd/{fd}")
    if os.path.dirname(target) == directory and target.endswith(name):
      raise OSError(errno.ENOSPC, "No space left on device")
    real(fd)
  monkeypatch.setattr(os, "fsync", fsync)


# What a 2-iteration run stopped after its last checkpoint says it keeps, after the error.
_FINISHED_2_KEPT = ("; the run is finished and nothing of it is lost: checkpoint 2 and the "
                    "metrics through it are intact, and the same command, re-run once the cause "
                    "is fixed, trains nothing and writes result.json and the HF export (where "
                    "asked) again")


def _finished_run_write_failed(path: str) -> str:
  """The SaveError of a full disk at `path` after a 2-iteration run's last checkpoint."""
  return f"writing {path} failed: OSError: [Errno 28] No space left on device{_FINISHED_2_KEPT}"


def test_a_full_disk_at_the_start_s_config_json_stops_the_run_as_a_failed_save_does(
    tmp_path, monkeypatch):
  """The start's config.json (config.K.json on a resume) on a full disk ended the run with the
  bare OSError (train_ppo: exit 1, a traceback), where the same disk at a metrics row or a save
  exits 3: now a SaveError naming the file and what the same command does once space is freed,
  before anything else is written."""
  run = str(tmp_path / "run")
  os.makedirs(run)
  _full_disk_under(monkeypatch, run, "config.json")
  with pytest.raises(checkpointing.SaveError) as e:
    PPOTrainer(tiny_config(), run).run(config_record={"start": "first"})
  assert str(e.value) == (
      f"writing {run}/config.json failed: OSError: [Errno 28] No space left on device; no "
      "checkpoint was saved yet: once the cause is fixed, the same command starts the run over")
  assert sorted(n for n in os.listdir(run) if n != ".lock") == ["checkpoints"]  # (empty)


def test_a_full_disk_at_the_hf_export_says_the_finished_run_is_kept(tmp_path, monkeypatch):
  """checkpoint.export_hf on a full disk at the end of the run ended it with the bare OSError
  (train_ppo: exit 1, a traceback): now a SaveError (exit 3) naming the export and saying that
  the finished run lost nothing and that the same command writes the export again, which it
  does, training nothing. Both exports, the run's own and the re-run's, are given the
  fingerprints that their start took of the files the run read (here its data.chat_template:
  the export checks a file of them gone or unreadable since, _check_template_file), not None
  (unknown: the check passes over a directory in the template's place); until 2026-12-07 a
  test checked only the re-run's (the wiring of both was right). A re-run that cannot read the
  template stops as it starts (it hashes its inputs), naming the file and the field: it was
  the bare PermissionError."""
  from rlhfuse_jax.trainer import hf_export
  from rlhfuse_jax.trainer import inputs as inputs_lib
  run, template = str(tmp_path / "run"), str(tmp_path / "t.jinja")
  with open(template, "w") as f:
    f.write("{{ messages[0]['content'] }}")  # (the synthetic task's prompts, as they were)
  cfg = tiny_config(num_iterations=2, **{"checkpoint.export_hf": "auto",
                                         "data.chat_template": template})
  read = inputs_lib.fingerprints(cfg)
  assert list(read) == ["data.chat_template"]
  told = _told_export_inputs(monkeypatch)
  with monkeypatch.context() as m:
    _full_disk_under(m, hf_export.export_work_dirs(os.path.join(run, "hf_export"))[0])
    with pytest.raises(checkpointing.SaveError) as e:
      PPOTrainer(cfg, run).run()
  assert str(e.value) == _finished_run_write_failed(f"{run}/hf_export")
  assert not os.path.exists(os.path.join(run, "hf_export"))
  with monkeypatch.context() as m:
    _unreadable(m, template)
    with pytest.raises(wd.ReadError) as e:
      PPOTrainer(cfg, run)
  assert str(e.value) == (
      f"reading {template} failed: PermissionError: [Errno 13] Permission denied; "
      f"config.data.chat_template={template!r} names it, and its content is fingerprinted (a "
      "run's starts check it against their checkpoints'; plan files, against the run they "
      "plan): make it readable")
  redo = PPOTrainer(cfg, run)
  assert redo.export_only and redo.run() == []
  assert hf_export.exported_step(os.path.join(run, "hf_export")) == 2
  assert [r["step"] for r in wd.read_jsonl(os.path.join(run, "metrics.jsonl"))] == [1, 2]
  assert told == [read, read]


def _hf_export_inputs(tmp_path):
  """(cfg, tokenizer, params) of an export that reads and writes every kind of file an export
  has: tiny_llama's weights (its generation_config.json and config.json read from it), a copy
  of ChatML's tokenizer directory as init.tokenizer (tokenizer_config.json with a template,
  chat_template.jinja, generation_config.json) and a chat template given by path
  (data.chat_template, written over the copied one and into tokenizer_config.json)."""
  from rlhfuse_jax.data.tokenizer import HFTokenizer
  llama_dir, chat = os.path.join(FIXTURES, "tiny_llama"), os.path.join(FIXTURES, "tiny_chat")
  tok_dir = tmp_path / "tok"
  shutil.copytree(os.path.join(chat, "chatml"), tok_dir)
  (tok_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
  (tok_dir / "generation_config.json").write_text('{"eos_token_id": 1}')
  template = str(tmp_path / "inst.jinja")
  shutil.copyfile(os.path.join(chat, "inst", "chat_template.jinja"), template)
  cfg = tiny_config(**{"init.actor_checkpoint": llama_dir, "checkpoint.export_hf": "llama",
                       "init.tokenizer": os.path.join(llama_dir, "tokenizer.json")})
  cfg = build.resolve_config(cfg, HFTokenizer.from_file(llama_dir))
  cfg = dataclasses.replace(
      cfg, init=dataclasses.replace(cfg.init, tokenizer=str(tok_dir / "tokenizer.json")),
      data=dataclasses.replace(cfg.data, chat_template=template))
  return (cfg, HFTokenizer.from_file(str(tok_dir / "tokenizer.json")),
          hf_loader.load_hf_params(llama_dir, cfg.model))


def test_an_input_gone_before_the_hf_export_is_named_as_a_read_not_a_failed_write(
    tmp_path, monkeypatch):
  """The run's tokenizer.json deleted before the export copies it (a run reads it at its start,
  hours before): the export said "writing .../tok/tokenizer.json failed: FileNotFoundError"
  (train_ppo and export_hf: exit 3, a full disk's status), a write of a file it only reads.
  Now an ExportInputError (a ValueError: exit 1, one line) saying it read the file, which
  field names it and to put it back; nothing of the export is left. A full disk at the same
  file's copy is still a failed write (exit 3)."""
  from experiments import config_files
  from rlhfuse_jax.trainer import hf_export
  cfg, tok, params = _hf_export_inputs(tmp_path)
  run = str(tmp_path / "run")
  os.makedirs(run)
  source = cfg.init.tokenizer
  os.rename(source, source + ".aside")
  with pytest.raises(hf_export.ExportInputError) as e:
    hf_export.HFExport(run, cfg, lambda: params, tok).export(2)
  assert str(e.value) == (
      f"reading {source} failed: FileNotFoundError: [Errno 2] No such file or directory; it is "
      "the tokenizer config.init.tokenizer names, which the run read and its HF export copies: "
      "put it back (nothing of the export is left)")
  assert config_files.user_error(e.value) and not isinstance(e.value, checkpointing.SaveError)
  assert os.listdir(run) == [] and sorted(os.listdir(tmp_path)) == ["inst.jinja", "run", "tok"]
  os.rename(source + ".aside", source)
  writing = hf_export.export_work_dirs(os.path.join(run, "hf_export"))[0]
  with monkeypatch.context() as m:
    _full_disk_under(m, writing, "tokenizer.json")
    with pytest.raises(hooks.LogWriteError) as e:
      hf_export.HFExport(run, cfg, lambda: params, tok).export(2)
  assert str(e.value) == (f"writing {writing}/tokenizer.json failed: OSError: [Errno 28] No "
                          "space left on device")
  assert os.listdir(run) == []
  hf_export.HFExport(run, cfg, lambda: params, tok).export(2)
  assert hf_export.exported_step(os.path.join(run, "hf_export")) == 2


def test_every_file_of_an_hf_export_is_on_disk_before_its_rename(tmp_path, monkeypatch):
  """The export's small files (its marker, the tokenizer's, config.json's rewrites) were
  written unsynced and the directory renamed into place: a power loss soon after could leave
  a complete-looking export (its marker there) of empty files. Now each file is fsynced as it
  ends up (no write after its fsync), the directory too before its rename, and the parent
  after it."""
  from rlhfuse_jax.trainer import hf_export
  cfg, tok, params = _hf_export_inputs(tmp_path)
  out = str(tmp_path / "export")
  writing = hf_export.export_work_dirs(out)[0]
  events, real_fsync, real_replace = [], os.fsync, os.replace

  def fsync(fd):
    st = os.fstat(fd)
    events.append(("fsync", st.st_ino, st.st_size, st.st_mtime_ns))
    real_fsync(fd)

  def replace(src, dst):
    events.append(("replace", str(src), str(dst)))
    real_replace(src, dst)
  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "replace", replace)
  hf_export.export_hf(params, cfg, out, 2, tok, str(tmp_path))
  monkeypatch.undo()
  renamed = events.index(("replace", writing, out))
  before = set(events[:renamed])
  files = sorted(os.listdir(out))
  assert files == ["chat_template.jinja", "config.json", "generation_config.json",
                   "model.safetensors", hf_export.EXPORT_MARKER, "tokenizer.json",
                   "tokenizer_config.json"]
  for name in files + [""]:  # (and the directory itself, its entries as they are)
    st = os.stat(os.path.join(out, name))
    assert ("fsync", st.st_ino, st.st_size, st.st_mtime_ns) in before, name
  parent = os.stat(tmp_path).st_ino
  assert [e for e in events[renamed:] if e[:2] == ("fsync", parent)], events[renamed:]
  assert (tmp_path / "export" / "chat_template.jinja").read_text() == (
      tmp_path / "inst.jinja").read_text()  # (written over the copied one)


def _env_with_sitecustomize(tmp_path, text: str) -> dict:
  """_env() with `text` as a sitecustomize every Python process it starts runs first (the
  faults a binary meets in its own writes)."""
  site = tmp_path / "site"
  site.mkdir()
  (site / "sitecustomize.py").write_text(text)
  env = _env()
  env["PYTHONPATH"] = os.pathsep.join([str(site), REPO, env.get("PYTHONPATH", "")])
  return env


# A sitecustomize for the binary below: log.txt cannot be created, result.json's fsync fails.
_FULL_AT_LOG_AND_RESULT = """import builtins, errno, os
_W, _open = {run!r}, builtins.open
def _refused(file, *args, **kwargs):
  if file == os.path.join(_W, "log.txt"):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file)
  return _open(file, *args, **kwargs)
def _fsync(fd, _real=os.fsync):
  target = os.readlink(f"/proc/self/fd/{{fd}}")
  if os.path.dirname(target) == _W and target.endswith("result.json"):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  _real(fd)
builtins.open, os.fsync = _refused, _fsync
"""


def test_a_full_disk_at_log_txt_and_result_json_ends_the_binary_in_one_line(tmp_path):
  """The binary's own writes on a full disk: log.txt that cannot be created ended the run at
  its start with a traceback (exit 1), and result.json that cannot be written ended a finished
  run the same way. Now log.txt is said once, as a write to it that fails (the log goes on on
  stderr), and result.json exits 3 in one line naming it and what is kept; the same command
  re-run writes result.json, training nothing."""
  run = str(tmp_path / "run")
  env = _env_with_sitecustomize(tmp_path, _FULL_AT_LOG_AND_RESULT.format(run=run))
  cmd = _cmd(run, "--config.num_iterations=2")
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  err = out.stderr
  assert out.returncode == 3, err[-3000:]
  assert err.count(f"{run}/log.txt: cannot write (OSError: [Errno 28] No space left on device: "
                   f"'{run}/log.txt'); this run's log is on stderr only") == 1, err[-3000:]
  assert err.splitlines()[-1].endswith(
      f"writing {run}/result.json failed: OSError: [Errno 28] No space left on device; the run "
      "is finished and nothing of it is lost: checkpoint 2 and the metrics through it are "
      "intact, and the same command, re-run once the cause is fixed, trains nothing and writes "
      "result.json and the HF export (where asked) again"), err[-3000:]
  assert "Traceback" not in err and "log: stderr only" in err, err[-3000:]
  assert not os.path.exists(os.path.join(run, "result.json"))
  assert not os.path.exists(os.path.join(run, "log.txt"))
  again = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "nothing to train" in again.stderr, again.stderr[-3000:]
  result = json.load(open(os.path.join(run, "result.json")))
  assert (result["status"], result["iterations"]) == ("done", 2), result
  assert _steps(run) == [1, 2]


@pytest.fixture(scope="module")
def finished_2(tmp_path_factory):
  """(config, workdir) of a finished tiny run of 2 iterations (checkpoint 2) with the config.json
  train_ppo records: the full-disk cases after a run's end copy it."""
  c = tiny_config_dict()
  c.num_iterations = 2
  cfg = config_lib.TrainConfig.from_config_dict(c)
  run = str(tmp_path_factory.mktemp("finished_2") / "run")
  PPOTrainer(cfg, run).run(config_record=config_lib.config_record(c, cfg))
  return cfg, run


def test_a_full_disk_at_a_finished_run_s_re_run_stops_it_as_a_failed_save_does(
    tmp_path, finished_2, monkeypatch):
  """A finished run re-run drops the metrics rows after its last checkpoint (an extension that
  died before its next save): on a full disk that rewrite of metrics.jsonl ended it with the
  bare OSError (train_ppo: exit 1, a traceback), where every other write of its records exits
  3. Now a SaveError naming the file and saying that nothing is lost; once space is freed the
  same command drops the row, training nothing."""
  cfg, workdir = finished_2
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  path = os.path.join(run, "metrics.jsonl")
  wd.append_jsonl(path, {"step": 3})
  with monkeypatch.context() as m:
    _full_disk_under(m, run, "metrics.jsonl")
    with pytest.raises(checkpointing.SaveError) as e:
      PPOTrainer(cfg, run).run()
  assert str(e.value) == _finished_run_write_failed(path)
  assert [r["step"] for r in wd.read_jsonl(path)] == [1, 2, 3]
  assert not [n for n in os.listdir(run) if n.startswith(wd.TMP_PREFIX)]
  assert PPOTrainer(cfg, run).run() == []
  assert [r["step"] for r in wd.read_jsonl(path)] == [1, 2]


def _told_export_inputs(monkeypatch) -> list:
  """hf_export.export_hf, recording the `inputs` (the run's fingerprints) each call is given,
  in the returned list, in order."""
  from rlhfuse_jax.trainer import hf_export
  told, export_hf = [], hf_export.export_hf

  def export(*args, inputs=None, **kwargs):
    told.append(inputs)
    return export_hf(*args, inputs=inputs, **kwargs)
  monkeypatch.setattr(hf_export, "export_hf", export)
  return told


def _unreadable(monkeypatch, path: str) -> None:
  """Opening `path` to read fails with EACCES, as for a user without read permission (chmod 000
  does not stop root, who runs the tests in CI): its writes and every other file's open."""
  import builtins
  real = builtins.open

  def opening(file, mode="r", *args, **kwargs):
    if str(file) == path and not set(mode) & set("wax+"):
      raise PermissionError(errno.EACCES, "Permission denied", path)
    return real(file, mode, *args, **kwargs)
  monkeypatch.setattr(builtins, "open", opening)


@pytest.mark.parametrize("more", [0, 1], ids=["finished", "resumed"])
def test_an_unreadable_metrics_jsonl_at_a_start_is_a_failed_read_not_write(
    tmp_path, finished_2, monkeypatch, more):
  """A start reads metrics.jsonl to drop the rows after its checkpoint, inside hooks.writing (a
  full disk at that rewrite: exit 3): the file unreadable (permissions, an I/O error) was
  reported as "writing metrics.jsonl failed" and exit 3 (a resume), or as the bare OSError and
  its traceback (a finished run's re-run). Now a one-line input error (exit 1) that says it is
  the read, and that nothing is lost; once the file reads, the same command goes on."""
  cfg, workdir = finished_2
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  cfg = dataclasses.replace(cfg, num_iterations=cfg.num_iterations + more)
  path = os.path.join(run, "metrics.jsonl")
  with monkeypatch.context() as m:
    _unreadable(m, path)
    with pytest.raises(wd.ReadError) as e:
      PPOTrainer(cfg, run).run()
  assert not isinstance(e.value, checkpointing.SaveError)
  assert str(e.value) == (
      f"reading {path} failed: PermissionError: [Errno 13] Permission denied" +
      (_FINISHED_2_KEPT if not more else "; nothing saved before is lost: checkpoint 2 and the "
       "metrics through it are intact, and the same command resumes from it once the cause is "
       "fixed"))
  assert [r["step"] for r in wd.read_jsonl(path)] == [1, 2]


def test_the_logs_a_start_cannot_read_are_named_as_reads(tmp_path):
  """MetricsLog.begin and SamplesLog.begin read their file before rewriting it: a directory in
  its place was "writing ... failed" (LogWriteError, exit 3, a full disk's words)."""
  cfg = tiny_config()
  for name in ("metrics.jsonl", "samples.jsonl"):
    os.makedirs(tmp_path / name)
  log = hooks.MetricsLog(str(tmp_path), cfg, lambda metrics: "")
  with pytest.raises(wd.ReadError, match=re.escape(
      f"reading {tmp_path}/metrics.jsonl failed: IsADirectoryError: [Errno 21] Is a directory")):
    log.begin(2)
  log.end(failing=True)
  with pytest.raises(wd.ReadError, match=re.escape(f"reading {tmp_path}/samples.jsonl failed")):
    hooks.SamplesLog(str(tmp_path), lambda: None).begin(2)


def test_an_input_gone_at_a_finished_run_s_hf_export_says_the_run_is_kept(tmp_path, finished_2,
                                                                          monkeypatch):
  """A file the run's HF export reads that is gone (test_an_input_gone_before_the_hf_export_...)
  at the run's end, or at the re-run that writes its export: the error says, as a failed
  write's does, that the finished run lost nothing and what the same command does once the
  file is back."""
  from rlhfuse_jax.trainer import hf_export
  cfg, workdir = finished_2
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                export_hf="auto"))
  gone = str(tmp_path / "tok" / "tokenizer.json")
  told = _told_export_inputs(monkeypatch)

  def copy(c, t, out, names=()):
    hf_export._read_input(gone, "the tokenizer config.init.tokenizer names")
  monkeypatch.setattr(hf_export, "_copy_tokenizer", copy)
  with pytest.raises(hf_export.ExportInputError) as e:
    PPOTrainer(cfg, run).run()
  assert str(e.value) == (
      f"reading {gone} failed: FileNotFoundError: [Errno 2] No such file or directory; it is the "
      "tokenizer config.init.tokenizer names, which the run read and its HF export copies: put "
      f"it back (nothing of the export is left){_FINISHED_2_KEPT}")
  assert not os.path.exists(os.path.join(run, "hf_export"))
  assert told == [{}]  # known: none (the tiny run names no input file), not None (unknown)


def test_a_schedule_cache_that_cannot_be_written_is_said_and_the_run_goes_on(
    tmp_path, monkeypatch, caplog):
  """The fused schedule's cache file on a full disk ended the set-up with an OSError (train_ppo:
  exit 1) before config.json: a cache only spares the next start a search. Now one warning
  names the file and the run takes the schedule it searched; the next start searches again
  and caches it. A truncated cache file is searched again too, with a warning."""
  from rlhfuse_jax.pipeline import schedules
  from rlhfuse_jax.pipeline import search as search_lib
  from rlhfuse_jax.trainer import pipelined
  searched = []

  def fake_search(problem, config):  # the serial order stands for a searched one
    searched.append(config.seed)
    return types.SimpleNamespace(best=schedules.serial_order(problem), search_s=0.0,
                                 evaluations=1)
  monkeypatch.setattr(search_lib, "search", fake_search)
  monkeypatch.setattr(search_lib, "warmup", lambda: 0.0)
  cache = str(tmp_path / "cache")
  pipe = config_lib.PipelineConfig(critic_pp=2, actor_microbatches=2, critic_microbatches=1,
                                   schedule_cache_dir=cache)
  problem = pipelined.pipeline_problem(4, pipe)
  with monkeypatch.context() as m, caplog.at_level("WARNING"):
    os.makedirs(cache)
    _full_disk_under(m, cache)
    found, path = pipelined.searched_schedule(problem, pipe)
  assert found.problem == problem and os.listdir(cache) == []  # (no temp file left either)
  said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert said == [f"pipeline: could not cache the searched schedule in {path} (OSError: [Errno "
                  "28] No space left on device); the run goes on, and its next start searches "
                  "again"], said
  assert pipelined.searched_schedule(problem, pipe)[0].order().tolist() == (
      found.order().tolist())
  assert len(searched) == 2 and os.path.isfile(path)
  whole = open(path, "rb").read()
  with open(path, "wb") as f:  # a file cut short (a crash of a copy, a full disk elsewhere)
    f.write(whole[:len(whole) // 2])
  caplog.clear()
  with caplog.at_level("WARNING"):
    assert pipelined.searched_schedule(problem, pipe)[0].problem == problem
  assert f"pipeline: ignoring the cached schedule {path} (" in caplog.text, caplog.text
  assert len(searched) == 3 and open(path, "rb").read() == whole


def test_plan_search_s_lengths_files_on_a_full_disk_are_named_and_not_left_cut(tmp_path,
                                                                                monkeypatch):
  """plan_search's lengths/ files (sim_plan.workload; the simulator reads them: no cache to
  skip) on a full disk: the error named no file ("OSError: [Errno 27] File too large" under
  `ulimit -f`) and left prompt_lengths.txt cut at the limit. Now written whole or not at all,
  the error naming the file."""
  from rlhfuse_jax.trainer import sim_plan
  cfg = tiny_config()
  task, tok = build.build_task_and_tokenizer(cfg)
  cfg = build.resolve_config(cfg, tok)
  lengths = str(tmp_path / "lengths")
  with monkeypatch.context() as m:
    os.makedirs(lengths)
    _full_disk_under(m, lengths, "prompt_lengths.txt")
    with pytest.raises(OSError) as e:
      sim_plan.workload(cfg, task, tok, 8, lengths)
  assert str(e.value) == ("[Errno 28] No space left on device: "
                          f"'{lengths}/prompt_lengths.txt'")
  assert os.listdir(lengths) == []
  wl, _ = sim_plan.workload(cfg, task, tok, 8, lengths)
  assert sorted(os.listdir(lengths)) == ["prompt_lengths.txt", "response_lengths.txt"]
  assert len(np.loadtxt(wl.prompt.path)) == cfg.data.num_prompts


# A sitecustomize for export_hf below: the writes into the export's working directory fail.
_FULL_AT_EXPORT = """import errno, os
_W = {writing!r}
def _fsync(fd, _real=os.fsync):
  if os.path.dirname(os.readlink(f"/proc/self/fd/{{fd}}")) == _W:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  _real(fd)
os.fsync = _fsync
"""


def test_a_full_disk_at_export_hf_ends_it_in_one_line_and_leaves_no_export(
    tmp_path, finished_2):
  """experiments/export_hf.py on a full disk ended with exit 1 and left its half-written export
  beside the target: now exit 3 (train_ppo's status for a failed write) in one line naming the
  export and saying that the run is untouched, and nothing of the export is left; the same
  export, once space is freed, writes it whole."""
  from rlhfuse_jax.trainer import export as export_lib
  from rlhfuse_jax.trainer import hf_export
  cfg, workdir = finished_2
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  out = export_lib.default_out(run, 2)
  env = _env_with_sitecustomize(
      tmp_path, _FULL_AT_EXPORT.format(writing=hf_export.export_work_dirs(out)[0]))
  proc = subprocess.run([sys.executable, "-m", "experiments.export_hf", f"--workdir={run}"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  err = proc.stderr
  assert proc.returncode == 3, err[-3000:]
  assert err.splitlines()[-1].endswith(
      f"writing {out} failed: OSError: [Errno 28] No space left on device; the run in {run} "
      "is as it was: once the cause is fixed, the same command writes the export again"), (
      err[-3000:])
  assert "Traceback" not in err, err[-3000:]
  assert sorted(n for n in os.listdir(run) if "hf_export" in n) == []
  assert export_lib.export(run)["out"] == out and hf_export.exported_step(out) == 2


def test_a_failed_last_save_is_raised_unless_another_error_is_leaving(tmp_path):
  """The end of run(): a failed final save is the run's error; while another error is already
  on its way out it is logged instead, so that it does not hide that one."""
  ckpts = hooks.Checkpoints(str(tmp_path), tiny_config(), {})

  def failed_save():
    raise checkpointing.SaveError("checkpoint save under /x failed: disk full")
  ckpts.checkpointer.wait = failed_save
  with pytest.raises(checkpointing.SaveError, match="disk full"):
    ckpts.end(failing=False)
  ckpts.end(failing=True)  # logged only


def test_a_sigterm_while_the_last_save_commits_keeps_it(tmp_path, monkeypatch, caplog):
  """The stop flag's handlers stay until the last save has committed (hooks end in reverse
  order): a SIGTERM during that wait killed the process (the default action, restored first)
  and the checkpoint being committed was lost."""
  end = hooks.Checkpoints.end
  sent = []

  def signalled_end(self, failing):  # a preemption notice arrives while the last save commits
    sent.append(True)
    signal.raise_signal(signal.SIGTERM)
    return end(self, failing)
  monkeypatch.setattr(hooks.Checkpoints, "end", signalled_end)
  cfg = tiny_config(**{"num_iterations": 2, "checkpoint.every": 1})
  with caplog.at_level("WARNING"):
    history = PPOTrainer(cfg, str(tmp_path)).run()
  assert sent and [h["step"] for h in history] == [1, 2]
  assert "waiting for its last checkpoint to be saved" in caplog.text
  assert checkpointing.Checkpointer(str(tmp_path)).latest_step() == 2


def test_a_sigterm_during_the_last_iteration_completes_the_run(tmp_path, monkeypatch):
  """A SIGTERM during iteration 1 of 2 stops the run after it (saved; stopped_by_signal is the
  signal: train_ppo exits 75, "re-run to resume"); one during the last iteration stops nothing,
  the run is complete (stopped_by_signal None: exit 0). Counted as stopped, a finished run
  exited 75, and a scheduler re-ran it for nothing. (Mutation audit of trainer/, L19.)"""
  iteration = PPOTrainer.iteration

  def signalled(self, it):  # a preemption notice arrives while the iteration runs
    signal.raise_signal(signal.SIGTERM)
    return iteration(self, it)
  monkeypatch.setattr(PPOTrainer, "iteration", signalled)
  cfg = tiny_config(**{"num_iterations": 2, "checkpoint.every": 5})
  first = PPOTrainer(cfg, str(tmp_path))
  assert [h["step"] for h in first.run()] == [1]
  assert first.stopped_by_signal == signal.SIGTERM
  last = PPOTrainer(cfg, str(tmp_path))
  assert [h["step"] for h in last.run()] == [2]
  assert last.stopped_by_signal is None
  assert checkpointing.Checkpointer(str(tmp_path)).latest_step() == 2


def test_the_binary_names_a_bad_value_and_records_nothing(tmp_path):
  """The binary's side of tests/test_trainer.py::test_bad_config_names_the_field (one process
  start: every value there is refused by the same TrainConfig check before the run records
  anything)."""
  message = "config.log_every=0: expected > 0"
  out = subprocess.run(_cmd(str(tmp_path), "--config.log_every=0"), cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and message in out.stderr, out.stderr[-2000:]
  assert not os.path.exists(os.path.join(tmp_path, "config.json"))  # nothing recorded


def test_a_record_without_target_is_named_by_file_and_line(tmp_path):
  from rlhfuse_jax.data import prompts, rewards, tasks
  path = str(tmp_path / "prompts.jsonl")
  with open(path, "w") as f:
    f.write('{"prompt": "1 #2 =", "target": "1 1"}\n\n{"prompt": "2 #1 ="}\n')
  records = prompts.load_jsonl_prompts(path)
  tok = tasks.make_task("repeat").tokenizer
  ids = np.zeros((2, 4), np.int64)
  with pytest.raises(ValueError, match=rf"record 1 \({path}:3\) needs a string 'target'"):
    rewards.target_match(records, ids, np.array([4, 4]), tok)


def test_schedule_search_rejects_a_negative_time_that_is_not_the_default():
  from configs import schedule_search
  from rlhfuse_jax.pipeline.graph import PipelineProblem
  c = schedule_search.get_config()
  assert PipelineProblem.from_config(c).critic_bwd == 2 * c.critic_fwd  # -1: the default
  c.critic_bwd = -2.0
  with pytest.raises(ValueError, match=r"config.critic_bwd=-2.0: expected -1 \(the default\)"):
    PipelineProblem.from_config(c)


def test_bench_generation_errors_name_the_generation_section():
  from rlhfuse_jax.generation import fused
  with pytest.raises(ValueError, match=r"config.generation.slots=0: expected an integer >= 1"):
    fused.FusedGenConfig(num_instances=2, slots=0, section="generation")
  with pytest.raises(ValueError, match=r"config.generation.migration_threshold='x'"):
    fused.FusedGenConfig(num_instances=2, slots=2, migration_threshold="x",
                         section="generation")


def test_a_field_added_to_the_code_at_its_default_does_not_block_resume():
  from rlhfuse_jax.trainer import config as config_lib
  now = tiny_config().fingerprint()
  saved = {k: v for k, v in now.items() if k != "guard.on_nonfinite"}  # an older checkpoint
  assert config_lib.fingerprint_changes(saved, now) == []
  changed = tiny_config(**{"guard.on_nonfinite": "skip_update"}).fingerprint()
  assert config_lib.fingerprint_changes(saved, changed) == [
      "guard.on_nonfinite: (absent) -> 'skip_update'"]


def test_another_layout_is_not_mistaken_for_damage(tmp_path):
  # Same shapes under other names (a renamed parameter in a newer version of the code): the
  # restore fails, the metadata says why, and the checkpoint is not set aside.
  from rlhfuse_jax import checkpointing
  ck = checkpointing.Checkpointer(str(tmp_path))
  ck.save(1, {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}, {"iteration": 1})
  ck.wait()
  assert ck.layout_mismatch(1, {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}) is None
  msg = ck.layout_mismatch(1, {"kernel": jnp.ones((3, 2)), "b": jnp.zeros(2)})
  assert msg is not None and "differ from this run's state" in msg
  assert ck.layout_mismatch(1, {"w": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.zeros(2)})
  ck.close()


def test_an_unreadable_array_is_named_with_its_file_in_the_one_line_error(tmp_path):
  """A truncated data file of a checkpoint: orbax raises "Encountered error while reading array
  index: (...). See full TensorStore details: <bound method ...spec of TensorStore({" and keeps
  the array's name and the file in the error it raised from; the fallback's warning (and the
  refusals) showed orbax's line alone, naming neither (a kill-and-damage review, 2026-12-07)."""
  import jax.numpy as jnp
  ck = checkpointing.Checkpointer(str(tmp_path))
  state = {"w": jnp.arange(4096, dtype=jnp.float32)}
  try:
    ck.save(2, state, {"iteration": 2})
    ck.wait()
    data = os.path.join(tmp_path, "checkpoints", "2", "state", "ocdbt.process_0", "d")
    for name in os.listdir(data):  # every data file cut short: the array's chunk is in one
      os.truncate(os.path.join(data, name), 100)
    with pytest.raises(Exception) as e:
      ck.restore(2, state)
  finally:
    ck.close()
  line = checkpointing.error_line(e.value)
  assert "TensorStore details" not in line and "bound method" not in line, line
  assert '"w/0"' in line, line  # the array (its first chunk)
  assert os.path.join(str(tmp_path), "checkpoints", "2") in line, line
  assert len(line) <= 700 and "\n" not in line


def test_a_checkpoint_without_its_manifest_is_named_without_tensorstores_spec(tmp_path):
  """A checkpoint missing state/manifest.ocdbt (as a kill in orbax's in-place delete of an old
  checkpoint can leave it): TensorStore's error goes on after the file with the array's spec as
  escaped JSON, "[tensorstore_spec[1]='{\\"base\\":...", which filled the one-line error's 300
  characters (in a trainer's resume twice: once more for the error it was raised from)."""
  state = {"a": jnp.arange(4096, dtype=jnp.float32), "b": jnp.ones((64, 64))}
  ck = checkpointing.Checkpointer(str(tmp_path))
  try:
    ck.save(2, state, {"iteration": 2})
    ck.wait()
    os.remove(os.path.join(tmp_path, "checkpoints", "2", "state", "manifest.ocdbt"))
    with pytest.raises(Exception) as e:
      ck.restore(2, state)
  finally:
    ck.close()
  line = checkpointing.error_line(e.value)
  assert "tensorstore_spec" not in line, line
  assert re.search(r'"[ab]/\.zarray"', line), line  # the array
  assert f'local file "{os.path.join(str(tmp_path), "checkpoints", "2", "state")}' in line, line
  assert line.endswith("does not exist") or "does not exist (from" in line, line
  assert "\n" not in line


@pytest.mark.parametrize("name", ["meta/metadata", "state/_METADATA"])
def test_a_truncated_json_file_is_named_in_the_one_line_error(tmp_path, name, caplog):
  """A checkpoint's JSON file cut to half its length (the side-car, orbax's array metadata):
  the read failed with json's bare "JSONDecodeError: Unterminated string starting at: line 1
  column 35 (char 34)", and the fallback's warning named the step but not the file."""
  import logging as py_logging
  from rlhfuse_jax.trainer import hooks
  caplog.set_level(py_logging.WARNING)
  state = {"w": jnp.arange(16, dtype=jnp.float32)}
  ck = checkpointing.Checkpointer(str(tmp_path), keep=3)
  try:
    for step in (2, 4):
      ck.save(step, state, {"iteration": step, "seed": 0, "data": {"position": step}})
      ck.wait()
    path = os.path.join(str(tmp_path), "checkpoints", "4", *name.split("/"))
    os.truncate(path, os.path.getsize(path) // 2)
    reads = [lambda: ck.restore(4, state)] + (
        [lambda: ck.restore_meta(4)] if name == "meta/metadata" else
        [lambda: ck.layout_mismatch(4, state)])
    for read in reads:
      with pytest.raises(Exception) as e:
        read()
      line = checkpointing.error_line(e.value)
      assert line.startswith(f"UnreadableJsonError: {path} is not valid JSON ("), line
      assert "\n" not in line
  finally:
    ck.close()
  if name == "meta/metadata":  # the fallback's warning, as a resume shows it
    c = hooks.Checkpoints(str(tmp_path), tiny_config(), {})
    try:
      assert c.resume_point()[0] == 2
    finally:
      c.checkpointer.close()
    assert f"checkpoint 4 in {tmp_path}" in caplog.text
    assert f"(UnreadableJsonError: {path} is not valid JSON" in caplog.text


def test_the_partial_directory_of_a_killed_save_is_removed(tmp_path):
  """A save killed mid-way leaves <step>.orbax-checkpoint-tmp-*: never a checkpoint, one copy
  of the state per preemption. The next start removes it and keeps the finished checkpoints,
  before the Checkpointer is returned (orbax's background cleanup is waited for: left running,
  it could print a traceback at the exit of a start that failed on bad input)."""
  from rlhfuse_jax import checkpointing
  ck = checkpointing.Checkpointer(str(tmp_path))
  ck.save(1, {"w": jnp.ones((3, 2))}, {"iteration": 1})
  ck.wait()
  ck.close()
  partial = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-123"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "garbage").write_bytes(b"\x00" * 64)
  again = checkpointing.Checkpointer(str(tmp_path))
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
  assert again.all_steps() == [1]
  again.close()


def test_a_start_trims_the_checkpoint_a_kill_before_orbaxs_delete_left(tmp_path, caplog):
  """Orbax deletes the oldest checkpoint after it commits a new one; a SIGKILL between the two
  leaves checkpoint.keep + 1 (2, 4, 6 with keep=2: the same directories a keep=3 run leaves,
  and orbax lists them all on the next start). Its next save trims them, but a start that
  saves none, the finished run re-run, kept the extra one for good (and export_hf's best:
  chose among it). Every start now keeps the newest `keep`, saying which it removed."""
  import logging as py_logging
  caplog.set_level(py_logging.WARNING)
  run = str(tmp_path)
  PPOTrainer(tiny_config(**{"num_iterations": 6, "checkpoint.keep": 3}), run).run()
  ckpts = os.path.join(run, "checkpoints")
  assert sorted(os.listdir(ckpts)) == ["2", "4", "6"]
  again = PPOTrainer(tiny_config(**{"num_iterations": 6}), run)  # keep=2
  assert again.run() == []  # finished: nothing trained, nothing saved
  assert sorted(os.listdir(ckpts)) == ["4", "6"]
  assert again.checkpoints.checkpointer.all_steps() == [6, 4]
  assert (f"{ckpts} held 3 checkpoints, more than checkpoint.keep=2 (a run killed between a "
          "save and the removal of the oldest, or a lowered keep): removed checkpoint 2"
          ) in caplog.text


def test_two_damaged_checkpoints_in_a_row_stop_instead_of_going_further_back(tmp_path):
  cfg = tiny_config(**{"num_iterations": 6, "checkpoint.keep": 3})
  run = str(tmp_path)
  PPOTrainer(cfg, run).run(stop_after=6)  # checkpoints 2, 4, 6
  for step in (6, 4):
    with open(os.path.join(run, "checkpoints", str(step), "meta", "metadata"), "w") as f:
      f.write("{not json")
  with pytest.raises(ValueError, match=r"checkpoint 4 .* cannot be read.*checkpoint 6 was "
                                       r"already set aside"):
    PPOTrainer(tiny_config(**{"num_iterations": 8, "checkpoint.keep": 3}), run)
  assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["2", "4"]  # 4 not moved
  assert os.listdir(os.path.join(run, "damaged_checkpoints")) == ["6"]


def test_nonfinite_error_advises_what_the_guard_has_not_tried():
  """Under "stop" the error suggests skip_update; under skip_update (its max_consecutive_skips
  used up, so the bad update was applied) it names max_consecutive_skips instead."""
  import types

  def message(**guard):
    fake = types.SimpleNamespace(
        checkpoints=types.SimpleNamespace(latest_step=lambda: 2),
        cfg=tiny_config(**{f"guard.{k}": v for k, v in guard.items()}))
    return str(loop.PPOTrainer._nonfinite(fake, 2, "actor parameters hold NaN/Inf"))
  assert "set guard.on_nonfinite='skip_update'" in message()
  skip = message(on_nonfinite="skip_update", max_consecutive_skips=3)
  assert "raise guard.max_consecutive_skips=3" in skip and "set guard.on_nonfinite" not in skip


def test_a_fresh_start_keeps_an_earlier_start_that_left_no_checkpoint(tmp_path):
  """A run stopped before its first checkpoint left metrics and a config: the next start (no
  checkpoint to resume) moves them to previous/1/ instead of truncating them."""
  run = str(tmp_path / "run")
  os.makedirs(run)
  rows = [{"step": 1, "reward/mean": 0.5}]
  with open(os.path.join(run, "metrics.jsonl"), "w") as f:
    f.write(json.dumps(rows[0]) + "\n")
  with open(os.path.join(run, "config.json"), "w") as f:
    f.write('{"seed": 0}')
  trainer = PPOTrainer(tiny_config(num_iterations=2), run)  # (the update of the tests above)
  assert trainer.resume_step is None
  kept = os.path.join(run, "previous", "1")
  assert sorted(os.listdir(kept)) == ["config.json", "metrics.jsonl"]
  assert wd.read_jsonl(os.path.join(kept, "metrics.jsonl")) == rows
  assert not os.path.exists(os.path.join(run, "metrics.jsonl"))
  trainer.run()
  assert _steps(run) == [1, 2]


@pytest.mark.parametrize("me", [0, 1])
def test_setting_aside_the_earlier_start_fails_on_every_process(tmp_path, monkeypatch, me):
  """Process 0 alone moves an earlier start's outputs aside; when that fails (a full disk,
  permissions) every process stops (process 0 with its own error), instead of process 0 alone
  while the others go on into the next collective. As process 0 and as process 1 of 2 (its
  verdict from process 0 faked)."""
  def full(workdir):
    raise OSError(28, "No space left on device")
  verdicts = iter([True, False])  # the lock's (granted), then the set-aside's (failed)
  monkeypatch.setattr(loop.wd, "set_aside_earlier_start", full)
  if me:
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(loop.distributed, "main_process_verdict", lambda ok: next(verdicts))
  with pytest.raises(OSError if me == 0 else RuntimeError,
                     match="No space left" if me == 0 else "process 0 could not set aside"):
    PPOTrainer(tiny_config(num_iterations=1), str(tmp_path / "run"))


def test_non_finite_numpy_and_jax_values_are_written_as_strict_json(tmp_path):
  # A nan from numpy or jax went through .tolist() as NaN / Infinity, which json.dumps writes
  # but strict readers (jq, JavaScript, json.loads with parse_constant) refuse.
  record = {"a": np.float32("nan"), "b": np.float64("inf"), "c": jnp.float32(-np.inf),
            "d": np.array([1.0, np.nan]), "e": float("nan")}
  wd.append_jsonl(str(tmp_path / "m.jsonl"), record)
  wd.write_json(str(tmp_path / "r.json"), {"x": record})

  def refuse(constant):
    raise ValueError(f"non-standard JSON constant {constant}")
  line = json.loads((tmp_path / "m.jsonl").read_text(), parse_constant=refuse)
  assert line == {"a": None, "b": 1e308, "c": -1e308, "d": [1.0, None], "e": None}
  assert json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse) == {"x": line}
