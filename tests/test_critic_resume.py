"""A resume reads no critic weights from init.critic_checkpoint (trainer/loop.py, build.py).

The checkpoint it restores holds the critic: the first start alone reads its HF weights (a
resume read a whole model only to overwrite it, and failed once the safetensors had been moved
away, though inputs.py logs the critic's checkpoint as unused on resume). Its config.json is
still read for the critic's shape. A resume that restores no checkpoint after all (Checkpoints
.restore's fresh start) loads the weights then: it trains what a fresh run trains.
"""
import dataclasses
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest

from rlhfuse_jax.models import hf_loader
from rlhfuse_jax.trainer import hooks
from rlhfuse_jax.trainer.loop import PPOTrainer
from tests.test_fused_trainer import TIMED
from tests.test_trainer import _deterministic, _params, tiny_config

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LLAMA = os.path.join(FIXTURES, "tiny_llama")
QWEN2 = os.path.join(FIXTURES, "tiny_qwen2")
PROMPTS = ["the quick", "a tiny model", "one plus two", "hello world", "the critic",
           "three plus four", "the lazy dog", "small numbers"]
# The update paths a resume builds its models on: each must leave the critic unread. (The
# critic comes from one build_models call on every path, unread on a resume. The fused stage's
# resume: tests/test_fused_trainer.py, test_auto_rt_resumes_with_the_lengths_it_had_seen; the
# pipelined update's: tests/test_trainer_pipelined.py, test_pipelined_run_resumes_bitwise.)
PATHS = {
    "serial": {},
    "async": {"async_ppo.staleness": 1},
}


def _config(tmp_path, **overrides):
  """Actor, tokenizer and prompts of the tiny fixtures; the critic from a copy of tiny_qwen2
  in tmp_path (which a test may take away). Every test here runs 2 iterations: one number of
  iterations (the LR schedule's horizon, a constant of the update's program) lets the tests
  after the first load its update instead of compiling their own."""
  critic = tmp_path / "critic"
  if not critic.exists():
    shutil.copytree(QWEN2, critic)
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "target": "is three"}) + "\n" for p in PROMPTS))
  return tiny_config(**{
      "num_iterations": 2, "checkpoint.every": 100, "init.actor_checkpoint": LLAMA,
      "init.critic_checkpoint": str(critic),
      "init.tokenizer": os.path.join(LLAMA, "tokenizer.json"),
      "data.prompts_file": str(tmp_path / "prompts.jsonl"), "data.max_prompt_len": 8,
      "reward.function": "length_match", "rollout.prompts_per_iteration": 8,
      "algo.minibatch_size": 8, "algo.epochs": 1, **overrides})


def _same(rows, want):
  strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMED}
                        for r in _deterministic(rows)]
  assert strip(rows) == strip(want)


def _trainer(cfg, workdir):
  return PPOTrainer(cfg, workdir)


def _count_critic_loads(monkeypatch, critic: str) -> list:
  """The calls of hf_loader.load_hf_params that read `critic` (the critic's directory)."""
  calls, load = [], hf_loader.load_hf_params

  def counted(path, *args, **kwargs):
    if os.path.realpath(path) == os.path.realpath(critic):
      calls.append(kwargs.get("head"))
    return load(path, *args, **kwargs)
  monkeypatch.setattr(hf_loader, "load_hf_params", counted)
  return calls


@pytest.mark.parametrize("path", list(PATHS))
def test_a_resume_reads_no_critic_weights_and_equals_the_uninterrupted_run(
    tmp_path, monkeypatch, path):
  """Stopped after iteration 1 (saved), the critic's safetensors deleted, then resumed: the
  resume does not call the weight loader on the critic's directory (the first start did, once)
  and its metrics and final weights are the uninterrupted run's. With the critic's whole
  directory gone, the error names init.critic_checkpoint (its config.json gives the shapes)."""
  cfg = _config(tmp_path, **PATHS[path])
  straight = _trainer(cfg, str(tmp_path / "straight"))
  h_straight = straight.run()
  p_straight = _params(straight)
  calls = _count_critic_loads(monkeypatch, cfg.init.critic_checkpoint)
  run = str(tmp_path / "run")
  h_first = _trainer(cfg, run).run(stop_after=1)
  assert calls == ["scalar"]  # the first start reads the critic's weights
  if path == "serial":  # the whole directory gone: the field is named
    os.rename(cfg.init.critic_checkpoint, tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match=r"config\.init\.critic_checkpoint=.*critic'"):
      _trainer(cfg, run)
    os.rename(tmp_path / "moved", cfg.init.critic_checkpoint)
  os.remove(os.path.join(cfg.init.critic_checkpoint, "model.safetensors"))
  resumed = _trainer(cfg, run)
  assert bool(resumed.cfg.async_ppo.staleness) == (path == "async")
  h_rest = resumed.run()
  assert calls == ["scalar"], calls  # the resume did not
  assert [h["step"] for h in h_first + h_rest] == [1, 2]
  _same(h_first + h_rest, h_straight)
  jax.tree.map(np.testing.assert_array_equal, _params(resumed), p_straight)


def test_a_resume_that_restores_no_checkpoint_loads_the_critic(tmp_path, monkeypatch):
  """Checkpoints.restore falls back to (0, None, None), a fresh start, when no checkpoint can
  be restored (its _damaged stops a run before that today: the stand-in below returns it): the
  critic built from the seed for the resume is replaced by init.critic_checkpoint's weights
  there, and the run trains exactly as a fresh one, never from a random critic."""
  cfg = _config(tmp_path)
  fresh = _trainer(cfg, str(tmp_path / "fresh"))
  h_fresh = fresh.run()
  run = str(tmp_path / "run")
  _trainer(cfg, run).run(stop_after=1)
  calls = _count_critic_loads(monkeypatch, cfg.init.critic_checkpoint)
  resumed = _trainer(cfg, run)
  assert resumed.resume_step == 1 and calls == []  # nothing read to build it
  monkeypatch.setattr(hooks.Checkpoints, "restore", lambda self, *a: (0, None, None))
  h = resumed.run()
  assert calls == ["scalar"]  # read once no checkpoint was restored
  assert [m["step"] for m in h] == [1, 2]
  _same(h, h_fresh)
  jax.tree.map(np.testing.assert_array_equal, _params(resumed), _params(fresh))


def _change_critic_architecture(cfg) -> None:
  """Another rms_norm_eps and rope_theta in init.critic_checkpoint's config.json: the same
  shapes (nothing the restore would refuse), another function."""
  path = os.path.join(cfg.init.critic_checkpoint, "config.json")
  with open(path) as f:
    config = json.load(f)
  config["rms_norm_eps"] = 0.5
  config["rope_parameters"]["rope_theta"] = 10.0
  with open(path, "w") as f:
    json.dump(config, f)


def test_a_resume_refuses_a_critic_checkpoint_whose_config_json_changed(tmp_path):
  """The resume still reads init.critic_checkpoint's config.json for the critic's architecture:
  another one there (rope_theta, rms_norm_eps: no shape the restore would refuse) ran the
  checkpoint's critic as another function, silently, with an info line calling the files
  unused. It is refused, naming the field; its weights alone may change or go."""
  cfg = _config(tmp_path)
  run = str(tmp_path / "run")
  _trainer(cfg, run).run(stop_after=1)
  _change_critic_architecture(cfg)
  with pytest.raises(ValueError, match=r"init\.critic_checkpoint: config\.json changed since "
                                       r"the checkpoints were written"):
    _trainer(cfg, run)


def test_a_resume_does_not_log_its_critic_as_randomly_initialised(tmp_path, caplog):
  """A run whose critic starts from config.critic_model's shape (no init.critic_checkpoint),
  resumed: its critic is the checkpoint's, but the set-up said 'config.critic_model, randomly
  initialised' (log_architectures with weights=False, the resume's and an export's, named the
  checkpoint's weights only beside an init.critic_checkpoint). (The actor, data and iterations
  are the other tests': their generation programs are loaded, not compiled again.)"""
  cfg = _config(tmp_path, **{"init.critic_checkpoint": ""})
  run = str(tmp_path / "run")

  def critic_lines(trainer_fn):
    caplog.clear()
    with caplog.at_level(logging.INFO):
      trainer = trainer_fn()
    return trainer, [r.getMessage() for r in caplog.records
                     if r.getMessage().startswith("critic: ")]
  first, said = critic_lines(lambda: _trainer(cfg, run))
  assert len(said) == 1 and said[0].endswith("(config.critic_model, randomly initialised)")
  first.run(stop_after=1)
  resumed, said = critic_lines(lambda: _trainer(cfg, run))
  assert resumed.resume_step == 1
  assert len(said) == 1 and said[0].endswith(
      "(config.critic_model; the weights are the checkpoint's)"), said
  resumed.release_lock()


def test_an_export_of_the_critic_refuses_a_changed_config_json(tmp_path):
  """The critic's export (export_step) writes the architecture init.critic_checkpoint's
  config.json gives beside the checkpoint's weights: another config.json there (rope_theta,
  rms_norm_eps) shipped the trained critic as another model (the actor's change is refused by
  export_changes). It is refused, naming the field; the actor still exports."""
  cfg = _config(tmp_path)
  run = str(tmp_path / "run")
  _trainer(cfg, run).run()
  _change_critic_architecture(cfg)
  exporter = PPOTrainer(dataclasses.replace(cfg, checkpoint=dataclasses.replace(
      cfg.checkpoint, export_hf="llama")), run, export_step=2)
  try:
    with pytest.raises(ValueError, match=r"config\.init\.critic_checkpoint=.*: config\.json "
                                         r"changed since checkpoint 2 was written"):
      exporter.export_checkpoint(str(tmp_path / "critic_out"), "critic")
    assert not os.path.exists(tmp_path / "critic_out")
    exporter.export_checkpoint(str(tmp_path / "actor_out"), "actor")
  finally:
    exporter.checkpoints.checkpointer.close()
    exporter.release_lock()
