"""rlhfuse_jax/trainer/inputs.py: the resume check compares what the files a run reads held,
not only their paths (the KL reference is re-read from init.actor_checkpoint at every start)."""
import os
import shutil
import types

import numpy as np

from rlhfuse_jax.trainer import inputs

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def _cfg(actor="", tokenizer="", prompts="", critic=""):
  return types.SimpleNamespace(
      init=types.SimpleNamespace(actor_checkpoint=actor, tokenizer=tokenizer,
                                 critic_checkpoint=critic),
      reward=types.SimpleNamespace(model_checkpoint=""),
      data=types.SimpleNamespace(prompts_file=prompts))


def test_a_fingerprint_sees_any_rewrite_and_ignores_the_path(tmp_path):
  model = tmp_path / "model"
  shutil.copytree(os.path.join(FIXTURES, "tiny_llama"), model)
  before = inputs.content_fingerprint(str(model))
  assert before == inputs.content_fingerprint(str(model) + "/")  # a trailing slash
  moved = tmp_path / "scratch" / "model"
  shutil.copytree(model, moved)
  assert inputs.content_fingerprint(str(moved)) == before  # same bytes elsewhere
  # A byte in the middle of a file larger than the three samples' reach is missed by design;
  # one inside a sample, a size change or another file is not.
  big = tmp_path / "big.bin"
  data = np.random.default_rng(0).integers(0, 256, 5 * inputs.SAMPLE_BYTES, np.uint8)
  big.write_bytes(data.tobytes())
  digest = inputs.content_fingerprint(str(big))
  data[len(data) // 2] ^= 1  # inside the middle sample
  big.write_bytes(data.tobytes())
  assert inputs.content_fingerprint(str(big)) != digest
  (model / "config.json").write_text((model / "config.json").read_text() + " ")
  edited = inputs.content_fingerprint(str(model))
  assert edited != before
  (model / "generation_config.json").write_text("{}")  # a file more
  assert inputs.content_fingerprint(str(model)) != edited
  assert inputs.content_fingerprint(str(tmp_path / "nothing")) is None


def test_resume_takes_a_new_path_to_the_same_content_and_refuses_new_content(tmp_path):
  model = tmp_path / "model"
  shutil.copytree(os.path.join(FIXTURES, "tiny_llama"), model)
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "a"}\n')
  saved = inputs.fingerprints(_cfg(str(model), str(model / "tokenizer.json"), str(prompts)))
  assert sorted(saved) == ["data.prompts_file", "init.actor_checkpoint", "init.tokenizer"]
  # The same model copied to node-local scratch: its path change is taken off the changes.
  scratch = tmp_path / "scratch"
  shutil.copytree(model, scratch)
  now = inputs.fingerprints(_cfg(str(scratch), str(model / "tokenizer.json"), str(prompts)))
  change = f"init.actor_checkpoint: {str(model)!r} -> {str(scratch)!r}"
  assert inputs.resume_changes([change, "seed: 0 -> 1"], saved, now, 5) == (["seed: 0 -> 1"], [])
  # Other weights at the same path: refused, naming the field and why it matters.
  (model / "config.json").write_text((model / "config.json").read_text() + " ")
  prompts.write_text('{"prompt": "b"}\n')
  now = inputs.fingerprints(_cfg(str(model), str(model / "tokenizer.json"), str(prompts)))
  left, changed = inputs.resume_changes([], saved, now, 5)
  assert left == [] and changed == [
      "init.actor_checkpoint: its files changed since the checkpoints were written (the KL "
      "reference is read from it at every start)",
      "data.prompts_file: its files changed since the checkpoints were written (the prompts "
      "are drawn from it)"]
  # A new path to other content stays a config change; checkpoints without fingerprints
  # compare paths alone.
  assert inputs.resume_changes([change], saved, {}, 5)[0] == [change]
  assert inputs.resume_changes([change], None, now, 5) == ([change], [])
  # The critic's checkpoint is read by the first start only: its change is not refused.
  critic = inputs.fingerprints(_cfg(critic=str(scratch)))
  (scratch / "config.json").write_text("{}")
  assert inputs.resume_changes([], critic, inputs.fingerprints(_cfg(critic=str(scratch))),
                               5) == ([], [])


def test_checkpoints_compare_the_inputs_contents_on_resume(tmp_path):
  """hooks.Checkpoints saves the inputs' fingerprints with each checkpoint: a resume from the
  same model at a new path starts (it was refused: the path differed), one whose model
  changed at the same path is refused, naming the field (it resumed against a new reference,
  silently)."""
  import jax.numpy as jnp
  import pytest
  from rlhfuse_jax.trainer import hooks
  from tests.test_trainer import tiny_config
  model = tmp_path / "model"
  shutil.copytree(os.path.join(FIXTURES, "tiny_llama"), model)
  workdir = str(tmp_path / "run")

  def config(path):
    return tiny_config(**{"init.actor_checkpoint": str(path), "init.tokenizer": str(path)})

  first = config(model)
  ckpts = hooks.Checkpoints(workdir, first, first.fingerprint())
  try:
    ckpts.state_fn = lambda: {"w": jnp.zeros((2,))}
    ckpts.meta_fn = lambda: {"data": {}}
    ckpts.after(2, {}, stopping=True)
    ckpts.wait()
  finally:
    ckpts.checkpointer.close()

  def resume(cfg):
    c = hooks.Checkpoints(workdir, cfg, cfg.fingerprint())
    try:
      return c.resume_point()[0]
    finally:
      c.checkpointer.close()
  scratch = tmp_path / "scratch"
  shutil.copytree(model, scratch)
  assert resume(config(scratch)) == 2
  (model / "config.json").write_text((model / "config.json").read_text() + " ")
  with pytest.raises(ValueError, match=r"files this run reads changed since the checkpoints in "
                     r".* \(iteration 2\) were written: init\.actor_checkpoint: its files changed "
                     r".*; init\.tokenizer: its files changed .*Put the files the run started "
                     r"with back"):
    resume(config(model))
