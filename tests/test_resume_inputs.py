"""rlhfuse_jax/trainer/inputs.py: the resume check compares what the files a run reads held,
not only their paths (the KL reference is re-read from init.actor_checkpoint at every start)."""
import os
import shutil
import types

import numpy as np
import pytest

from rlhfuse_jax.trainer import inputs

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def _cfg(actor="", tokenizer="", prompts="", critic=""):
  return types.SimpleNamespace(
      init=types.SimpleNamespace(actor_checkpoint=actor, tokenizer=tokenizer,
                                 critic_checkpoint=critic),
      reward=types.SimpleNamespace(model_checkpoint="", kind="function"),
      data=types.SimpleNamespace(prompts_file=prompts))


def test_a_fingerprint_covers_what_is_read_and_ignores_the_path(tmp_path):
  model = tmp_path / "model"
  shutil.copytree(os.path.join(FIXTURES, "tiny_llama"), model)
  fp = lambda field, path: inputs.content_fingerprint(field, str(path))
  before = fp("init.actor_checkpoint", model)
  assert sorted(before) == ["config.json", "generation_config.json",
                            "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                            "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
  assert before == fp("init.actor_checkpoint", str(model) + "/")  # a trailing slash
  moved = tmp_path / "scratch" / "model"
  shutil.copytree(model, moved)
  assert fp("init.actor_checkpoint", moved) == before  # same bytes elsewhere
  (model / "README.md").write_text("# a model card")  # not read: nothing changes
  assert fp("init.actor_checkpoint", model) == before
  (model / "config.json").write_text((model / "config.json").read_text() + " ")
  assert fp("init.actor_checkpoint", model) != before
  # A tokenizer: its file (named, or by its directory) and the files read beside it.
  tok = fp("init.tokenizer", model)
  assert tok == fp("init.tokenizer", model / "tokenizer.json") and sorted(tok) == [
      "generation_config.json", "tokenizer.json"]
  (model / "tokenizer_config.json").write_text('{"eos_token": "<pad>"}')
  assert sorted(fp("init.tokenizer", model)) == [
      "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
  # Weight shards are sampled (a byte inside a sample counts); other files are read whole: a
  # same-length edit 25 % into a 5 MiB prompts file counts.
  big = tmp_path / "big.safetensors"
  data = np.random.default_rng(0).integers(0, 256, 5 * inputs.SAMPLE_BYTES, np.uint8)
  big.write_bytes(data.tobytes())
  digest = fp("init.actor_checkpoint", big)
  data[len(data) // 2] ^= 1  # inside the middle sample
  big.write_bytes(data.tobytes())
  assert fp("init.actor_checkpoint", big) != digest
  prompts = tmp_path / "p.jsonl"
  rows = "".join(f'{{"prompt": "q{i:07d}", "answer": "{i:07d}"}}\n' for i in range(120_000))
  prompts.write_text(rows)
  digest = fp("data.prompts_file", prompts)
  at = len(rows) // 4
  prompts.write_text(rows[:at] + ("1" if rows[at] != "1" else "2") + rows[at + 1:])
  assert fp("data.prompts_file", prompts) != digest
  assert fp("init.actor_checkpoint", tmp_path / "nothing") is None


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
      "init.actor_checkpoint: config.json changed since the checkpoints were written (the KL "
      "reference is read from it at every start)",
      "data.prompts_file: p.jsonl changed since the checkpoints were written (the prompts "
      "are drawn from it)"]
  # The tokenizer given by its directory or its file: the same files.
  same_tok = inputs.fingerprints(_cfg(tokenizer=str(model)))
  assert same_tok["init.tokenizer"] == saved["init.tokenizer"]
  # A reward model a function-scored run does not read is not compared.
  reward = _cfg(str(model))
  reward.reward = types.SimpleNamespace(model_checkpoint=str(model), kind="function")
  assert "reward.model_checkpoint" not in inputs.fingerprints(reward)
  reward.reward.kind = "model"
  assert "reward.model_checkpoint" in inputs.fingerprints(reward)
  # Checkpoints without fingerprints compare paths alone.
  assert inputs.resume_changes([change], None, now, 5) == ([change], [])
  # The critic's weights are read by the first start only: their change is not refused; its
  # config.json gives the critic's architecture at every start: its change is.
  critic = inputs.fingerprints(_cfg(critic=str(scratch)))
  os.remove(scratch / "model-00003-of-00003.safetensors")
  assert inputs.resume_changes([], critic, inputs.fingerprints(_cfg(critic=str(scratch))),
                               5) == ([], [])
  (scratch / "config.json").write_text("{}")
  assert inputs.resume_changes([], critic, inputs.fingerprints(_cfg(critic=str(scratch))),
                               5) == ([], [
      "init.critic_checkpoint: config.json changed since the checkpoints were written (it "
      "gives the critic's architecture; its weights are the checkpoints')"])


def test_a_new_path_to_other_files_is_named_as_other_files(tmp_path):
  """A resume from a new path whose files differ from the run's (another revision of the model
  downloaded to scratch) names the field, the path change and the files that differ, for the
  'put the files back' error (another path to the same files is accepted). It was left a
  config change, refused as a field no resume may ever change."""
  model, scratch = tmp_path / "model", tmp_path / "scratch"
  shutil.copytree(os.path.join(FIXTURES, "tiny_llama"), model)
  shutil.copytree(model, scratch)
  (scratch / "config.json").write_text((scratch / "config.json").read_text() + " ")
  saved = inputs.fingerprints(_cfg(str(model), str(model / "tokenizer.json")))
  now = inputs.fingerprints(_cfg(str(scratch), str(scratch / "tokenizer.json")))
  actor = f"init.actor_checkpoint: {str(model)!r} -> {str(scratch)!r}"
  tok = (f"init.tokenizer: {str(model / 'tokenizer.json')!r} -> "
         f"{str(scratch / 'tokenizer.json')!r}")
  left, changed = inputs.resume_changes([actor, tok, "seed: 0 -> 1"], saved, now, 5)
  assert left == ["seed: 0 -> 1"]  # the tokenizer's files are the same: its move is taken
  assert changed == [f"{actor} holds other files than the run started with (config.json "
                     "changed; the KL reference is read from it at every start)"]
  # The critic's checkpoint, read by the first start only, stays as it was.
  critic = f"init.critic_checkpoint: {str(model)!r} -> {str(scratch)!r}"
  assert inputs.resume_changes([critic], inputs.fingerprints(_cfg(critic=str(model))),
                               inputs.fingerprints(_cfg(critic=str(scratch))), 5) == ([critic],
                                                                                       [])


def test_a_new_path_with_nothing_there_is_named_as_missing_files(tmp_path):
  """A resume whose input moved to a path with nothing the run reads (a copy to node-local
  scratch that failed, a typo) was refused as a config change no resume may make ("No resume
  may change data.prompts_file ... resume with the original value"), where another path to the
  same files is accepted: it is named as files missing there. Dropping the input (no path: the
  task's own prompts) stays the config change it is."""
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "a"}\n')
  saved = inputs.fingerprints(_cfg(prompts=str(prompts)))
  typo = str(tmp_path / "scratch" / "p.jsonl")
  change = f"data.prompts_file: {str(prompts)!r} -> {typo!r}"
  now = inputs.fingerprints(_cfg(prompts=typo))
  assert now == {}
  assert inputs.resume_changes([change, "seed: 0 -> 1"], saved, now, 5) == (
      ["seed: 0 -> 1"], [f"{change}: nothing there that the run reads (the prompts are drawn "
                         "from it)"])
  dropped = f"data.prompts_file: {str(prompts)!r} -> ''"
  assert inputs.resume_changes([dropped], saved, {}, 5) == ([dropped], [])
  # The trainer's refusal says to put the files back, not that the field may never change.
  import pytest
  from rlhfuse_jax.trainer import hooks
  from tests.test_trainer import tiny_config
  save_a_checkpoint(str(tmp_path / "run"), tiny_config(**{"data.prompts_file": str(prompts)}))
  moved = tiny_config(**{"data.prompts_file": typo})
  ckpts = hooks.Checkpoints(str(tmp_path / "run"), moved, moved.fingerprint())
  try:
    with pytest.raises(ValueError) as e:
      ckpts.resume_point()
  finally:
    ckpts.checkpointer.close()
  assert f"{change}: nothing there that the run reads" in str(e.value), str(e.value)
  assert "Put the files the run started with back" in str(e.value)
  assert "No resume may change" not in str(e.value)


def save_a_checkpoint(workdir: str, cfg, step: int = 2) -> None:
  """A checkpoint of `cfg` (a TrainConfig) at `step` in `workdir`, as a stopped run saves it,
  with a stand-in state: what a resume compares is its side-car."""
  import jax.numpy as jnp
  from rlhfuse_jax.trainer import hooks
  ckpts = hooks.Checkpoints(workdir, cfg, cfg.fingerprint())
  try:
    ckpts.state_fn = lambda: {"w": jnp.zeros((2,))}
    ckpts.meta_fn = lambda: {"data": {}}
    ckpts.after(step, {}, stopping=True)
    ckpts.wait()
  finally:
    ckpts.checkpointer.close()


def test_checkpoints_compare_the_inputs_contents_on_resume(tmp_path):
  """hooks.Checkpoints saves the inputs' fingerprints with each checkpoint: a resume from the
  same model at a new path starts (it was refused: the path differed), one whose model
  changed at the same path is refused, naming the field (it resumed against a new reference,
  silently)."""
  import pytest
  from rlhfuse_jax.trainer import hooks
  from tests.test_trainer import tiny_config
  model = tmp_path / "model"
  shutil.copytree(os.path.join(FIXTURES, "tiny_llama"), model)
  workdir = str(tmp_path / "run")

  def config(path):
    return tiny_config(**{"init.actor_checkpoint": str(path), "init.tokenizer": str(path)})

  first = config(model)
  save_a_checkpoint(workdir, first)

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
                     r".* \(iteration 2\) were written: init\.actor_checkpoint: config\.json "
                     r"changed since the checkpoints were written \(the KL reference is read "
                     r"from it at every start\)\. Put the files the run started with back"):
    resume(config(model))
  # The tokenizer's own files: tokenizer_config.json sets EOS, PAD and the chat template.
  (model / "config.json").write_text((model / "config.json").read_text()[:-1])
  (model / "tokenizer_config.json").write_text('{"eos_token": "<pad>"}')
  with pytest.raises(ValueError, match=r"init\.tokenizer: tokenizer_config\.json changed"):
    resume(config(model))


def test_a_chat_template_file_is_compared_by_content(tmp_path, monkeypatch):
  """data.chat_template given as a path renders every prompt; the fingerprint held its path
  alone, so a resume after the template was edited in place trained on other prompt text,
  silently. Its content now counts like the tokenizer's ('none' and 'auto' name no file)."""
  template = tmp_path / "chat.jinja"
  template.write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")

  def cfg(spec):
    c = _cfg()
    c.data.chat_template = str(spec)
    return c
  saved = inputs.fingerprints(cfg(template))
  assert list(saved) == ["data.chat_template"]
  moved = tmp_path / "copy" / "chat.jinja"
  moved.parent.mkdir()
  shutil.copy(template, moved)
  change = f"data.chat_template: {str(template)!r} -> {str(moved)!r}"
  assert inputs.resume_changes([change], saved, inputs.fingerprints(cfg(moved)), 5) == ([], [])
  template.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
  assert inputs.resume_changes([], saved, inputs.fingerprints(cfg(template)), 5) == ([], [
      "data.chat_template: chat.jinja changed since the checkpoints were written (every prompt "
      "is rendered with it)"])
  # A directory: its template and the special tokens read beside it.
  (tmp_path / "tmpl").mkdir()
  (tmp_path / "tmpl" / "chat_template.jinja").write_text("{{ messages[0].content }}")
  (tmp_path / "tmpl" / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
  (tmp_path / "tmpl" / "README.md").write_text("# not read")
  assert sorted(inputs.fingerprints(cfg(tmp_path / "tmpl"))["data.chat_template"]) == [
      "chat_template.jinja", "tokenizer_config.json"]
  monkeypatch.chdir(tmp_path)  # files named like the keywords are not read for them
  (tmp_path / "none").write_text("x")
  (tmp_path / "auto").write_text("x")
  assert inputs.fingerprints(cfg("none")) == {} and inputs.fingerprints(cfg("auto")) == {}


def test_a_schedule_file_is_compared_by_content(tmp_path):
  """pipeline.schedule_file (the fused schedule a pipelined run executes): its path alone was
  fingerprinted, so the same schedule copied elsewhere (a job's node-local scratch) was refused
  as "No resume may change pipeline.schedule_file (the saved state's layout ...)", while another
  schedule written over the same path resumed without a word."""
  from rlhfuse_jax.trainer.config import fingerprint_changes
  from test_trainer import tiny_config
  schedule = tmp_path / "schedule.json"
  schedule.write_text('{"problem": {}, "devices": []}\n')
  copy = tmp_path / "scratch" / "schedule.json"
  copy.parent.mkdir()
  copy.write_text(schedule.read_text())
  cfgs = [tiny_config(**{"pipeline.schedule_file": str(p)}) for p in (schedule, copy)]
  saved, now = inputs.fingerprints(cfgs[0]), inputs.fingerprints(cfgs[1])
  assert saved["pipeline.schedule_file"] == now["pipeline.schedule_file"]
  changes = fingerprint_changes(cfgs[0].fingerprint(), cfgs[1].fingerprint())
  assert changes == [f"pipeline.schedule_file: {str(schedule)!r} -> {str(copy)!r}"], changes
  assert inputs.resume_changes(changes, saved, now, 4) == ([], [])
  schedule.write_text('{"problem": {}, "devices": [[]]}\n')  # another schedule, same path
  left, changed = inputs.resume_changes([], saved, inputs.fingerprints(cfgs[0]), 4)
  assert left == [] and len(changed) == 1 and changed[0].startswith(
      "pipeline.schedule_file: schedule.json changed since the checkpoints were written"), changed


def test_a_resume_with_other_validation_settings_says_so_naming_the_field(tmp_path, caplog):
  """The validation pass's eval_every, data.val_file (its path and its content) and
  val_max_prompts may change on a resume (docs/usage.md): a change of the prompts is a warning
  naming the field, since val/* before and after it average other prompts (it resumed without
  a word); a copy of the same file elsewhere is no change, nor is eval_every, which only moves
  the iterations validated (an info line: the pass after an iteration is the same whatever it
  is; it was warned of as making val/* incomparable)."""
  import logging
  from rlhfuse_jax.trainer import hooks
  from tests.test_trainer import tiny_config
  val = tmp_path / "val.jsonl"
  val.write_text('{"prompt": "1 #2 =", "target": "1 1"}\n')
  workdir = str(tmp_path / "run")

  def config(path, **kw):
    return tiny_config(**{"data.val_file": str(path), "eval_every": 2, **kw})

  first = config(val)
  save_a_checkpoint(workdir, first)

  def warnings(cfg):
    caplog.clear()
    c = hooks.Checkpoints(workdir, cfg, cfg.fingerprint())
    try:
      with caplog.at_level(logging.INFO):  # (the warnings below; info lines in caplog.text)
        assert c.resume_point()[0] == 2
    finally:
      c.checkpointer.close()
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warnings(config(val)) == []
  copy = tmp_path / "copy" / "val.jsonl"
  copy.parent.mkdir()
  shutil.copy(val, copy)
  assert warnings(config(copy)) == []  # the same prompts at another path
  said = warnings(config(val, **{"eval_every": 1, "data.val_max_prompts": 4}))
  assert "with config.eval_every: 2 -> 1: the validation pass runs at other iterations" in (
      caplog.text)
  assert len(said) == 1
  assert said[0].startswith("resuming iteration 2 with a changed config.data.val_max_prompts: "
                            "0 -> 4 (") and "val/*" in said[0]
  other = tmp_path / "other.jsonl"
  other.write_text('{"prompt": "3 #1 =", "target": "3"}\n')
  said = warnings(config(other))
  assert len(said) == 1 and f"config.data.val_file: {str(val)!r} -> {str(other)!r}" in said[0]
  val.write_text('{"prompt": "3 #1 =", "target": "3"}\n')  # other prompts at the same path
  said = warnings(config(val))
  assert len(said) == 1 and (f"config.data.val_file={str(val)!r}: other content than when the "
                             "checkpoints were written") in said[0]


def test_val_max_prompts_raised_past_the_pool_on_resume_is_no_change(tmp_path, caplog):
  """A resume judges data.val_max_prompts by the prompts it selects, min(pool, k): raised past
  the held-out pool's size (or to 0, the whole pool) it selects the same ones, an info line
  (it was warned of as a change making val/* incomparable); lowered below the pool, or raised
  while it capped the pool, other prompts: the warning."""
  import logging
  import jax
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.trainer import hooks
  from rlhfuse_jax.trainer.loop import PPOTrainer
  from tests.test_trainer import tiny_config
  val = tmp_path / "val.jsonl"
  val.write_text("".join(f'{{"prompt": "{d} #2 =", "target": "{d} {d}"}}\n' for d in (1, 2, 3)))
  workdir = str(tmp_path / "run")

  def config(k, **kw):
    return tiny_config(**{"data.val_file": str(val), "eval_every": 1, "num_iterations": 1,
                          "data.val_max_prompts": k, **kw})
  trainer = PPOTrainer(config(5), workdir, mesh=mesh_lib.make_mesh(
      mesh_lib.MeshConfig(data=1), jax.devices()[:1]))
  assert trainer.run()[-1]["val/prompts"] == 3  # the pool's 3 of the 5 allowed

  def warnings(cfg):
    caplog.clear()
    c = hooks.Checkpoints(workdir, cfg, cfg.fingerprint())
    try:
      with caplog.at_level(logging.INFO):
        assert c.resume_point()[0] == 1
    finally:
      c.checkpointer.close()
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  for k in (10, 0, 3):
    assert warnings(config(k)) == [], k
    assert (f"config.data.val_max_prompts: 5 -> {k}: the same 3 held-out prompts (the pool "
            "holds 3") in caplog.text
  said = warnings(config(2))
  assert len(said) == 1 and "config.data.val_max_prompts: 5 -> 2 (" in said[0]
  # Written with a cap below the pool: raising it selects more prompts.
  second = str(tmp_path / "capped")
  ckpts = hooks.Checkpoints(second, config(2), config(2).fingerprint())
  try:
    ckpts.set_val_pool(3)
    ckpts.state_fn, ckpts.meta_fn = (lambda: {"w": jax.numpy.zeros((2,))}), (lambda: {"data": {}})
    ckpts.after(1, {}, stopping=True)
    ckpts.wait()
  finally:
    ckpts.checkpointer.close()
  workdir = second
  said = warnings(config(3, **{"eval_every": 2}))
  assert len(said) == 1 and "config.data.val_max_prompts: 2 -> 3 (" in said[0]


def test_the_held_out_pool_is_counted_before_val_max_prompts_caps_it(tmp_path):
  """build_datasets_and_pool: the pool's size saved for the resume check (data.val_pool) is
  taken before data.val_max_prompts caps it. Counted after the cap, a run validating on 2 of 3
  prompts saved 2, and a resume raising the cap to 3 (all 3 prompts) was told 'the same 2
  held-out prompts' in an info line, not warned that val/* average other prompts."""
  from rlhfuse_jax.trainer import build
  from tests.test_trainer import tiny_config
  val = tmp_path / "val.jsonl"
  val.write_text("".join(f'{{"prompt": "{d} #2 =", "target": "{d} {d}"}}\n' for d in (1, 2, 3)))
  cfg = tiny_config(**{"data.val_file": str(val), "eval_every": 1, "data.val_max_prompts": 2})
  task, tokenizer = build.build_task_and_tokenizer(cfg)
  _, held_out, pool = build.build_datasets_and_pool(cfg, task, tokenizer)
  assert len(held_out.records) == 2 and pool == 3


def test_a_val_max_prompts_change_on_another_pool_is_warned_of(caplog):
  """min(pool, val_max_prompts) equal before and after says the same prompts only of the same
  pool: with other content in data.val_file (at its path or a new one) the cap's change is
  warned of too, not logged as 'the same 3 held-out prompts' of a pool that is no longer
  there."""
  import logging
  saved = {"eval_every": 1, "data.val_file": "/data/val.jsonl", "data.val_max_prompts": 5,
           "data.val_file content": {"sha256": "aa"}, inputs.VAL_POOL: 3}
  other = {**saved, "data.val_max_prompts": 10, "data.val_file content": {"sha256": "bb"}}
  for now in (other, {**other, "data.val_file": "/data/val2.jsonl"}):
    caplog.clear()
    with caplog.at_level(logging.INFO):
      said = inputs.warn_eval_changes(saved, now, 4)
    assert "config.data.val_max_prompts: 5 -> 10" in said and len(said) == 2, said
    assert "the same 3 held-out prompts" not in caplog.text
  # The same content: the same 3 prompts, an info line.
  caplog.clear()
  with caplog.at_level(logging.INFO):
    assert inputs.warn_eval_changes(saved, {**saved, "data.val_max_prompts": 10}, 4) == []
  assert "the same 3 held-out prompts" in caplog.text


def test_the_same_file_under_another_name_resumes(tmp_path):
  """A byte-identical copy of the prompts file or the tokenizer under another name (copied to
  scratch as own2.jsonl) was refused as "own.jsonl, own2.jsonl changed": a fingerprint keys
  the named file by its name. The same files at another path are accepted, whatever the named
  file is called; a renamed side file, or other content under the new name, is not."""
  prompts, copy = tmp_path / "own.jsonl", tmp_path / "copy" / "own2.jsonl"
  prompts.write_text('{"prompt": "a"}\n')
  copy.parent.mkdir()
  shutil.copyfile(prompts, copy)
  tok_dir = tmp_path / "tok"
  shutil.copytree(os.path.join(FIXTURES, "tiny_llama"), tok_dir)
  renamed = tmp_path / "tokcopy"
  renamed.mkdir()
  shutil.copyfile(tok_dir / "tokenizer.json", renamed / "tok.json")
  for name in inputs.TOKENIZER_SIDE_FILES:
    if (tok_dir / name).is_file():
      shutil.copyfile(tok_dir / name, renamed / name)
  saved = inputs.fingerprints(_cfg(tokenizer=str(tok_dir / "tokenizer.json"),
                                   prompts=str(prompts)))
  now = inputs.fingerprints(_cfg(tokenizer=str(renamed / "tok.json"), prompts=str(copy)))
  changes = [f"data.prompts_file: {str(prompts)!r} -> {str(copy)!r}",
             f"init.tokenizer: {str(tok_dir / 'tokenizer.json')!r} -> "
             f"{str(renamed / 'tok.json')!r}"]
  assert inputs.resume_changes(changes, saved, now, 5) == ([], [])
  copy.write_text('{"prompt": "b"}\n')
  now = inputs.fingerprints(_cfg(tokenizer=str(renamed / "tok.json"), prompts=str(copy)))
  left, changed = inputs.resume_changes(changes, saved, now, 5)
  assert left == [] and len(changed) == 1 and changed[0].startswith(changes[0]), changed
  assert not inputs.same_files({"a": "1", "b": "2"}, {"c": "1", "d": "2"})  # two renamed
  assert not inputs.same_files({"a": "1", "b": "2"}, {"c": "1", "b": "3"})
  assert inputs.same_files({"a": "1", "b": "2"}, {"c": "1", "b": "2"})


def test_an_export_compares_the_files_it_copies():
  """export_changes: the tokenizer's files, the chat template and the actor checkpoint's config
  files; not the initial actor's weights (the export writes the run's own): a re-downloaded
  base model blocked every export. A checkpoint without fingerprints compares nothing."""
  saved = {"init.actor_checkpoint": {"config.json": "a", "generation_config.json": "b",
                                     "model.safetensors": "w"},
           "init.tokenizer": {"tokenizer.json": "t"}}
  weights = {**saved, "init.actor_checkpoint": {**saved["init.actor_checkpoint"],
                                                "model.safetensors": "w2"}}
  assert inputs.export_changes(saved, weights) == []
  eos = {**saved, "init.actor_checkpoint": {**saved["init.actor_checkpoint"],
                                            "generation_config.json": "b2"}}
  assert inputs.export_changes(saved, eos) == [
      "config.init.actor_checkpoint: generation_config.json changed"]
  tok = {**saved, "init.tokenizer": {"tokenizer.json": "t2"}}
  assert inputs.export_changes(saved, tok) == ["config.init.tokenizer: tokenizer.json changed"]
  assert inputs.export_changes(None, tok) == []


def test_a_raised_schedule_after_a_resumes_horizon_names_the_checkpoints_horizon(tmp_path,
                                                                                caplog):
  """optim.schedule_iterations 0 means the horizon the checkpoints keep: the first start's
  num_iterations, or the longer one a resume set since (kept after a later resume set 0 again,
  docs/usage.md). Checkpoints written with 0 that keep a resume's 16 (the first start ran 6)
  resumed with 20 said '0 -> 20 (0 there: the first start's horizon, 16 iterations)': 16 was
  no first start's."""
  import jax.numpy as jnp
  from rlhfuse_jax.trainer import hooks
  from tests.test_trainer import tiny_config
  workdir = str(tmp_path / "run")
  cfg = tiny_config(**{"num_iterations": 10})
  ckpts = hooks.Checkpoints(workdir, cfg, cfg.fingerprint())
  try:
    ckpts.state_fn = lambda: {"w": jnp.zeros((2,))}
    ckpts.meta_fn = lambda: {"data": {}, "schedule_iterations": 16}
    ckpts.after(9, {}, stopping=True)
    ckpts.wait()
  finally:
    ckpts.checkpointer.close()
  raised = tiny_config(**{"num_iterations": 11, "optim.schedule_iterations": 20,
                          "checkpoint.resume_changes": "optim.schedule_iterations"})
  resumed = hooks.Checkpoints(workdir, raised, raised.fingerprint())
  try:
    caplog.clear()
    with caplog.at_level("WARNING"):
      assert resumed.resume_point()[0] == 9
  finally:
    resumed.checkpointer.close()
  assert ("a changed optim.schedule_iterations: 0 -> 20 (0 there: the checkpoints' horizon, 16 "
          "iterations)") in caplog.text, caplog.text
  assert "first start" not in caplog.text, caplog.text


@pytest.mark.parametrize("written, resumed, said", [
    (0, 3, "0 -> 3 (0 there: the checkpoints' horizon, 1 iteration)"),
    (1, 0, "1 -> 0 (0 keeps the checkpoints' horizon, 1 iteration: the LR schedule")])
def test_a_one_iteration_horizon_is_said_in_the_singular(tmp_path, caplog, written, resumed,
                                                          said):
  """Checkpoints keeping a 1-iteration LR horizon, resumed with another schedule_iterations:
  the warning said '1 iterations'."""
  import jax.numpy as jnp
  from rlhfuse_jax.trainer import hooks
  from tests.test_trainer import tiny_config
  workdir = str(tmp_path / "run")
  cfg = tiny_config(**{"num_iterations": 1, "optim.schedule_iterations": written})
  ckpts = hooks.Checkpoints(workdir, cfg, cfg.fingerprint())
  try:
    ckpts.state_fn = lambda: {"w": jnp.zeros((2,))}
    ckpts.meta_fn = lambda: {"data": {}, "schedule_iterations": 1}
    ckpts.after(1, {}, stopping=True)
    ckpts.wait()
  finally:
    ckpts.checkpointer.close()
  again = tiny_config(**{"num_iterations": 3, "optim.schedule_iterations": resumed,
                         "checkpoint.resume_changes": "optim.schedule_iterations"})
  restarted = hooks.Checkpoints(workdir, again, again.fingerprint())
  try:
    with caplog.at_level("WARNING"):
      assert restarted.resume_point()[0] == 1
  finally:
    restarted.checkpointer.close()
  assert f"a changed optim.schedule_iterations: {said}" in caplog.text, caplog.text
  assert "1 iterations" not in caplog.text, caplog.text


def test_a_new_path_with_files_an_unread_input_is_not_named_missing(tmp_path):
  """A reward model the resumed run does not read (reward.kind 'function' now) has no
  fingerprint this start, whatever its path holds: a new reward.model_checkpoint beside it was
  refused as 'nothing there that the run reads' ('put the files back'), where the path holds
  the model, and the refusal hid the real change, reward.kind. Both stay config changes."""
  model = tmp_path / "model"
  shutil.copytree(os.path.join(FIXTURES, "tiny_llama"), model)
  moved = tmp_path / "scratch" / "model"
  shutil.copytree(model, moved)
  was = _cfg()
  was.reward = types.SimpleNamespace(model_checkpoint=str(model), kind="model")
  now = _cfg()
  now.reward = types.SimpleNamespace(model_checkpoint=str(moved), kind="function")
  saved, fresh = inputs.fingerprints(was), inputs.fingerprints(now)
  assert "reward.model_checkpoint" in saved and "reward.model_checkpoint" not in fresh
  changes = ["reward.kind: 'model' -> 'function'",
             f"reward.model_checkpoint: {str(model)!r} -> {str(moved)!r}"]
  assert inputs.resume_changes(changes, saved, fresh, 5) == (changes, [])


def test_an_input_a_start_cannot_list_or_read_is_a_read_error_naming_the_field(tmp_path,
                                                                                monkeypatch):
  """Every start fingerprints its input files first. A checkpoint directory it cannot list (no
  read permission: os.listdir refused; chmod stops no root, so it is refused here) was a bare
  PermissionError naming no field, as a file it cannot read was until 2026-12-07 (faults7):
  now both are workdir.ReadError naming the path and config.<field>, and saying what to do."""
  from rlhfuse_jax import workdir as wd
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "config.json").write_text("{}")
  listdir = os.listdir

  def refused(path):
    if os.path.abspath(path) == str(ckpt):
      raise PermissionError(13, "Permission denied", str(path))
    return listdir(path)
  with monkeypatch.context() as m:
    m.setattr(inputs.os, "listdir", refused)
    with pytest.raises(wd.ReadError) as e:
      inputs.content_fingerprint("init.actor_checkpoint", str(ckpt))
  assert str(e.value) == (
      f"reading {ckpt} failed: PermissionError: [Errno 13] Permission denied; "
      f"config.init.actor_checkpoint={str(ckpt)!r} names it, and its content is fingerprinted "
      "(a run's starts check it against their checkpoints'; plan files, against the run they "
      "plan): make it readable")
  assert list(inputs.content_fingerprint("init.actor_checkpoint", str(ckpt))) == ["config.json"]
