"""plan.json's "workload" against the run that uses the plan (trainer/plan_file.py
plan_workload_note): every model field the simulator's times and memory rest on is recorded
and compared, and a file from before a field was recorded says once what it cannot check."""
import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from configs import ppo_tiny
from rlhfuse_jax.sim import iteration_sim, plan_search
from rlhfuse_jax.trainer import build, sim_plan
from rlhfuse_jax.trainer import inputs as inputs_lib
from rlhfuse_jax.trainer import plan_file as plan_file_lib
from rlhfuse_jax.trainer.config import TrainConfig
from rlhfuse_jax.trainer.loop import PPOTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The actor's and critic's fields plan.json recorded before 2026-12-06.
OLD_MODEL_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size",
                    "weight_itemsize", "kv_itemsize")


def _tiny_run_and_record(tmp_path):
  """(ppo_tiny's resolved config, the workload record plan_search writes for it)."""
  raw = TrainConfig.from_config_dict(ppo_tiny.get_config())
  task, tokenizer = build.build_task_and_tokenizer(raw)
  cfg = build.resolve_config(raw, tokenizer)
  wl = sim_plan.workload(cfg, task, tokenizer, 8, str(tmp_path / "lengths"))[0]
  opt = sim_plan.sim_options(iteration_sim.SimOptions(), cfg)
  return cfg, plan_search.workload_record(wl, "configs/ppo_tiny.py", opt)


def _plan_file(tmp_path, workload):
  path = tmp_path / "plan.json"
  path.write_text(json.dumps({
      "generation": {"mode": "instances", "tp": 1, "pp": 1, "groups": 1, "slots": 0},
      "inference": {"tp": 1, "pp": 1},
      "training": {"placement": "colocated", "devices": 8, "tp": 1, "actor_pp": 1,
                   "critic_pp": 1},
      "workload": workload}))
  return str(path)


def _with_model(cfg, role, **changes):
  field = "model" if role == "actor" else "critic_model"
  return dataclasses.replace(cfg, **{field: dataclasses.replace(getattr(cfg, field),
                                                                **changes)})


def test_the_whole_model_shape_is_recorded_and_compared(tmp_path):
  """A plan searched for ppo_tiny's models ran models of another MLP width, head_dim, tied
  embeddings, biases or q/k norms without a word: plan.json recorded only their layers,
  hidden size, heads, KV heads and vocabulary (and dtypes)."""
  cfg, record = _tiny_run_and_record(tmp_path)
  actor = record["actor"]
  assert (actor["intermediate_size"], actor["head_dim"], actor["tie_embeddings"],
          actor["qkv_bias"], actor["o_bias"], actor["qk_norm"], actor["max_seq_len"]) == (
              128, 16, False, False, False, False, 64), actor
  assert set(record["critic"]) == set(actor)
  plan = {"workload": record}
  assert plan_file_lib.plan_workload_differences(plan, cfg) == []
  # head_dim 0 (hidden_size / num_heads) is the recorded 16: the same model
  assert cfg.model.head_dim == 0 and actor["head_dim"] == 16
  run = _with_model(cfg, "actor", intermediate_size=256, tie_embeddings=True, qkv_bias=True,
                    o_bias=True, qk_norm=True)
  run = _with_model(run, "critic", head_dim=32)
  assert plan_file_lib.plan_workload_differences(plan, run) == [
      "actor intermediate_size=128 (this run has 256)",
      "actor tie_embeddings=False (this run has True)",
      "actor qkv_bias=False (this run has True)",
      "actor o_bias=False (this run has True)",
      "actor qk_norm=False (this run has True)",
      "critic head_dim=16 (this run has 32)"]
  # max_seq_len bounds the context; no time or memory of the plan rests on it. A critic's
  # scalar head has no embedding to tie.
  assert plan_file_lib.plan_workload_differences(
      plan, _with_model(_with_model(cfg, "actor", max_seq_len=128), "critic",
                        tie_embeddings=True)) == []
  # the note a run logs names them, as a warning
  path = _plan_file(tmp_path, record)
  warn, line = plan_file_lib.plan_workload_note(path, run)
  assert warn and line.startswith(
      f"config.plan.file={path!r} was searched for actor intermediate_size=128 (this run has "
      "256); actor tie_embeddings=False"), line
  assert "records no" not in line
  assert plan_file_lib.plan_workload_note(path, cfg) is None


def test_an_old_plan_file_loads_and_says_once_what_it_cannot_check(tmp_path):
  """A plan.json written before the whole shape was recorded is compared on what it has, and
  the note names, once, the fields it lacks (not a line per model)."""
  cfg, record = _tiny_run_and_record(tmp_path)
  old = {**{k: v for k, v in record.items() if k not in ("actor", "critic", "train_config",
                                                          "inference_micro_batch",
                                                          "migration_rows", "master_weights",
                                                          "offload_optimizer")},
         **{role: {f: record[role][f] for f in ("name",) + OLD_MODEL_FIELDS}
            for role in ("actor", "critic")}}
  path = _plan_file(tmp_path, old)
  plan_file_lib.plan_file_settings(plan_file_lib.load_plan_file(path), path)  # it loads
  unchecked = ("records no intermediate_size of the actor and critic, head_dim of the actor "
               "and critic, tie_embeddings of the actor, qkv_bias of the actor and "
               "critic, o_bias of the actor and critic, qk_norm of the actor and critic (a "
               "plan.json written before plan_search recorded them): those are not compared "
               "with this run's")
  assert plan_file_lib.plan_workload_note(path, cfg) == (
      False, f"config.plan.file={path!r} {unchecked}")
  # what it has is still compared; the note says once what it cannot check
  run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=4,
                                                           intermediate_size=256))
  warn, line = plan_file_lib.plan_workload_note(path, run)
  assert warn and line.startswith(
      f"config.plan.file={path!r} was searched for actor num_layers=2 (this run has 4): its "
      "predicted times and memory check are for that workload"), line
  assert line.endswith(f"; the file {unchecked}") and line.count("records no") == 1, line
  assert "intermediate_size=" not in line
  # a run's plan (train_config) lacking its run fields names those too
  partial = {**record, "actor": old["actor"]}
  del partial["migration_rows"]
  assert plan_file_lib.plan_workload_unrecorded({"workload": partial}) == [
      f"{f} of the actor" for f in ("intermediate_size", "head_dim", "tie_embeddings",
                                    "qkv_bias", "o_bias", "qk_norm")] + ["migration_rows"]
  # a run's plan with a reward model, from before its shape was recorded
  assert plan_file_lib.plan_workload_unrecorded({"workload": {
      **record, "reward_model": True}}) == ["the reward model's shape"]
  # a file with no workload at all keeps its own note
  assert plan_file_lib.plan_workload_unrecorded({}) == []


def _with_data(cfg, **changes):
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **changes))


def test_the_length_distribution_is_recorded_and_compared(tmp_path):
  """The prompt and response lengths drive the simulated generation times and long tail, and
  so the plan; plan.json did not record them (only their limits), and a plan searched for
  ppo_tiny's uniform 1-8-token 'repeat' targets ran a log-normal 'countdown' task without a
  word. The record holds the lengths sampled and the run's data fields they came from, each
  compared with the run's."""
  cfg, record = _tiny_run_and_record(tmp_path)
  lengths = record["lengths"]
  assert lengths["data"] == {"prompts_file": "", "task": "repeat", "num_prompts": 4096,
                             "length_dist": "uniform", "length_min": 1, "length_max": 8,
                             "val_fraction": 0.0, "tokenizer": "", "chat_template": "none"
                             }, lengths
  # what the search sampled: repeat's 4-token prompts, targets of 1-8 tokens + EOS
  assert (lengths["prompt"]["max"], lengths["prompt"]["p50"]) == (4, 4.0), lengths
  assert 2 <= lengths["response"]["p50"] and lengths["response"]["max"] <= 9, lengths
  assert lengths["response"]["spec"].endswith("clip [1, 12])"), lengths
  plan = {"workload": record}
  assert plan_file_lib.plan_workload_differences(plan, cfg) == []
  run = _with_data(cfg, task="countdown", length_dist="lognormal", length_max=11)
  assert plan_file_lib.plan_workload_differences(plan, run) == [
      "lengths.data.task='repeat' (this run's data.task is 'countdown')",
      "lengths.data.length_dist='uniform' (this run's data.length_dist is 'lognormal')",
      "lengths.data.length_max=8 (this run's data.length_max is 11)"]
  # a uniform distribution reads no log-normal parameter: changing them changes nothing
  assert plan_file_lib.plan_workload_differences(
      plan, _with_data(cfg, length_mu=3.0, length_sigma=2.0)) == []
  # two log-normal ones are compared on them
  lognormal = _with_data(cfg, length_dist="lognormal")
  task, tokenizer = build.build_task_and_tokenizer(lognormal)
  wl = sim_plan.workload(lognormal, task, tokenizer, 8, str(tmp_path / "ln"))[0]
  ln_plan = {"workload": plan_search.workload_record(wl, "configs/ppo_tiny.py")}
  assert plan_file_lib.plan_workload_differences(ln_plan, lognormal) == []
  assert plan_file_lib.plan_workload_differences(
      ln_plan, _with_data(lognormal, length_sigma=1.5)) == [
          "lengths.data.length_sigma=0.8 (this run's data.length_sigma is 1.5)"]
  # a prompts file replaces the task's prompts and targets: named alone
  assert plan_file_lib.plan_workload_differences(
      plan, _with_data(cfg, prompts_file="p.jsonl", length_max=11)) == [
          "lengths.data.prompts_file='' (this run's data.prompts_file is 'p.jsonl')"]
  # a paper pair's plan (the simulator's own config.prompt and config.response): recorded,
  # nothing of a run's data to compare
  pair = plan_search.workload_record(dataclasses.replace(wl, length_inputs=()))
  assert "data" not in pair["lengths"] and pair["lengths"]["response"]["n"] == 64
  assert plan_file_lib.plan_workload_differences({"workload": pair}, run) == []
  # the line train_ppo logs
  path = _plan_file(tmp_path, record)
  warn, line = plan_file_lib.plan_workload_note(path, run)
  assert warn and line.startswith(
      f"config.plan.file={path!r} was searched for lengths.data.task='repeat' (this run's "
      "data.task is 'countdown'); lengths.data.length_dist='uniform'"), line
  assert "records no" not in line


def test_a_prompts_file_is_compared_by_content_then_by_resolved_path(tmp_path, monkeypatch):
  """The workload recorded data.prompts_file as typed and compared it so: './p.jsonl',
  'p.jsonl' and its absolute path were warned of as three files, and other prompts written to
  the same path ran without a word. It records the absolute path and the resume check's content
  digest (trainer/inputs.py): the same content anywhere is the same prompts, other content at
  the same path is warned of; a file from before the digest compares resolved paths."""
  cfg = TrainConfig.from_config_dict(ppo_tiny.get_config())
  monkeypatch.chdir(tmp_path)
  (tmp_path / "p.jsonl").write_text('{"prompt": "a b c"}\n')
  data = plan_file_lib.run_length_inputs(_with_data(cfg, prompts_file="p.jsonl"))
  full = str(tmp_path / "p.jsonl")
  assert data["prompts_file"] == full and len(data["prompts_digest"]) == 64, data
  plan = {"workload": {"train_config": "c.py", "lengths": {"data": data}}}
  for typed in ("p.jsonl", "./p.jsonl", full, "../" + tmp_path.name + "/p.jsonl"):
    assert plan_file_lib.plan_workload_differences(
        plan, _with_data(cfg, prompts_file=typed)) == [], typed
  (tmp_path / "copy.jsonl").write_text('{"prompt": "a b c"}\n')  # the same prompts elsewhere
  assert plan_file_lib.plan_workload_differences(
      plan, _with_data(cfg, prompts_file="copy.jsonl")) == []
  (tmp_path / "q.jsonl").write_text('{"prompt": "a b c d e f"}\n')
  assert plan_file_lib.plan_workload_differences(
      plan, _with_data(cfg, prompts_file="q.jsonl")) == [
          f"lengths.data.prompts_file={full!r} (this run's data.prompts_file is 'q.jsonl')"]
  (tmp_path / "p.jsonl").write_text('{"prompt": "a b c d e f"}\n')  # rewritten in place
  assert plan_file_lib.plan_workload_differences(
      plan, _with_data(cfg, prompts_file="./p.jsonl")) == [
          f"lengths.data.prompts_file={full!r} (this run's data.prompts_file is './p.jsonl': "
          "the same path, other content: its digest is not the one recorded)"]
  assert not any("digest" in x for x in plan_file_lib.plan_workload_unrecorded(plan))
  # a plan.json from before the digest: loads, compares resolved paths and says so once
  old = {"workload": {"train_config": "c.py", "lengths": {"data": {"prompts_file": "p.jsonl"}}}}
  for typed in ("./p.jsonl", full):
    assert plan_file_lib.plan_workload_differences(
        old, _with_data(cfg, prompts_file=typed)) == [], typed
  assert plan_file_lib.plan_workload_differences(
      old, _with_data(cfg, prompts_file="q.jsonl")) == [
          "lengths.data.prompts_file='p.jsonl' (this run's data.prompts_file is 'q.jsonl')"]
  assert "content digest of its prompts file (its data.prompts_file is compared by path)" in \
      plan_file_lib.plan_workload_unrecorded(old)


def test_the_set_up_hashes_the_prompts_file_once(tmp_path, monkeypatch):
  """A plan.json that records its prompts file's digest made train_ppo's set-up hash the file
  twice: once for the resume check (trainer/inputs.fingerprints), once more to compare it with
  the plan's. The comparison takes the resume check's digests, of the tokenizer's and the chat
  template's files too. (A top_k the trainer's checks refuse stops the set-up after the
  comparison, before anything is built.)"""
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "a b c"}\n')
  shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "tiny_chat", "chatml"),
                  tmp_path / "chatml")
  c = ppo_tiny.get_config()
  c.data.prompts_file, c.rollout.top_k = str(prompts), 100000
  c.init.tokenizer = c.data.chat_template = str(tmp_path / "chatml")
  data = plan_file_lib.run_length_inputs(TrainConfig.from_config_dict(c))
  assert data["prompts_file"] == str(prompts) and len(data["prompts_digest"]) == 64
  c.plan.file = _plan_file(tmp_path, {"train_config": "c.py", "lengths": {"data": data}})
  cfg = TrainConfig.from_config_dict(c)
  hashed, digest = collections.Counter(), inputs_lib._file_digest
  monkeypatch.setattr(inputs_lib, "_file_digest",
                      lambda path: hashed.update([os.path.abspath(path)]) or digest(path))
  inputs_lib.fingerprints(cfg)  # what the resume check hashes (the template's
  resume_check = collections.Counter(hashed)  # tokenizer_config.json twice: the tokenizer's too)
  hashed.clear()
  with pytest.raises(ValueError, match="config.rollout.top_k=100000"):
    PPOTrainer(cfg, str(tmp_path / "run"))
  assert hashed[str(prompts)] == 1 and hashed == resume_check, hashed


def test_a_plan_file_without_lengths_loads_and_says_it_cannot_check_them(tmp_path):
  """A plan.json from before the lengths were recorded loads; its note names them once, as
  fields it cannot check, and what it has is still compared."""
  cfg, record = _tiny_run_and_record(tmp_path)
  old = {k: v for k, v in record.items() if k != "lengths"}
  path = _plan_file(tmp_path, old)
  plan_file_lib.plan_file_settings(plan_file_lib.load_plan_file(path), path)  # it loads
  unchecked = ("records no prompt and response lengths (data.prompts_file, data.task, "
               "data.num_prompts, data.length_dist, data.length_min, data.length_max, "
               "data.length_mu, data.length_sigma, data.prompt_key, data.val_fraction, "
               "init.tokenizer, data.chat_template) (a plan.json written before plan_search "
               "recorded them): those are not compared with this run's")
  assert plan_file_lib.plan_workload_note(path, cfg) == (
      False, f"config.plan.file={path!r} {unchecked}")
  run = _with_data(dataclasses.replace(cfg, rollout=dataclasses.replace(
      cfg.rollout, prompts_per_iteration=32)), length_dist="lognormal")
  warn, line = plan_file_lib.plan_workload_note(path, run)
  assert warn and line.startswith(
      f"config.plan.file={path!r} was searched for global_batch=64 (this run's "
      "rollout.batch_size is 32) (plan_search's train_config="), line
  assert line.endswith(f"; the file {unchecked}") and line.count("records no") == 1, line
  assert "lengths.data" not in line
  # a paper pair's plan without them names no run field
  pair = {k: v for k, v in old.items() if k not in ("train_config", "inference_micro_batch",
                                                    "migration_rows", "master_weights",
                                                    "offload_optimizer")}
  assert plan_file_lib.plan_workload_unrecorded({"workload": pair}) == [
      "prompt and response lengths"]


def _with_tokenizer(cfg, path):
  return dataclasses.replace(cfg, init=dataclasses.replace(cfg.init, tokenizer=path))


def test_the_tokenizer_chat_template_and_prompt_count_are_recorded_and_compared(tmp_path):
  """The prompts' lengths are their tokens: the tokenizer and the chat template rendering them
  make them, and a task's data.num_prompts draws them. plan.json did not record them, and a
  plan searched for plain prompts ran a chat template's without a word (the fixture's chatml
  made 64 prompts 25 tokens longer, 67 on average from 42). They are recorded, a file by its
  content (the resume check's digests: a copy elsewhere agrees, other content at the same path
  is warned of), each compared; a file from before they were recorded names them once, not
  compared."""
  cfg, record = _tiny_run_and_record(tmp_path)
  plan = {"workload": record}
  assert plan_file_lib.plan_workload_differences(
      plan, _with_data(cfg, num_prompts=16)) == [
          "lengths.data.num_prompts=4096 (this run's data.num_prompts is 16)"]
  chat = os.path.join(ROOT, "tests", "fixtures", "tiny_chat")
  for name in ("t1", "t2"):  # a chat template and a copy of it elsewhere
    shutil.copytree(os.path.join(chat, "chatml"), tmp_path / name)
  assert plan_file_lib.plan_workload_differences(
      plan, _with_data(cfg, chat_template=str(tmp_path / "t1"))) == [
          f"lengths.data.chat_template='none' (this run's data.chat_template is "
          f"{str(tmp_path / 't1')!r})"]
  for name in ("tok", "tok2"):  # a tokenizer and a copy of it elsewhere
    os.makedirs(tmp_path / name)
    shutil.copy(os.path.join(chat, "tokenizer.json"), tmp_path / name)
  run = _with_tokenizer(_with_data(cfg, chat_template=str(tmp_path / "t1")),
                        str(tmp_path / "tok"))
  data = plan_file_lib.run_length_inputs(run)
  assert (data["tokenizer"], data["chat_template"]) == (str(tmp_path / "tok"),
                                                        str(tmp_path / "t1")), data
  assert sorted(data["tokenizer_digests"]) == ["tokenizer.json"], data
  assert sorted(data["chat_template_digests"]) == ["tokenizer_config.json"], data
  plan = {"workload": {"train_config": "c.py", "lengths": {"data": data}}}
  assert plan_file_lib.plan_workload_differences(plan, run) == []
  # the same files elsewhere, the tokenizer named by its file: the same inputs
  copy = _with_tokenizer(_with_data(cfg, chat_template=str(tmp_path / "t2")),
                         str(tmp_path / "tok2" / "tokenizer.json"))
  assert plan_file_lib.plan_workload_differences(plan, copy) == []
  other = _with_tokenizer(_with_data(cfg, chat_template="auto"),
                          os.path.join(ROOT, "tests", "fixtures", "tiny_llama"))
  assert plan_file_lib.plan_workload_differences(plan, other) == [
      f"lengths.data.tokenizer={str(tmp_path / 'tok')!r} (this run's init.tokenizer is "
      f"{os.path.join(ROOT, 'tests', 'fixtures', 'tiny_llama')!r})",
      f"lengths.data.chat_template={str(tmp_path / 't1')!r} (this run's data.chat_template is "
      "'auto')"]
  template = tmp_path / "t1" / "tokenizer_config.json"  # the template rewritten in place
  template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))
  assert plan_file_lib.plan_workload_differences(plan, run) == [
      f"lengths.data.chat_template={str(tmp_path / 't1')!r} (this run's data.chat_template is "
      f"{str(tmp_path / 't1')!r}: the same path, other content: its files' digests are not "
      "the ones recorded)"]
  # a prompts file's prompts are its own (num_prompts unread); its tokenizer is still compared
  (tmp_path / "p.jsonl").write_text('{"prompt": "a b c"}\n')
  with_file = _with_data(run, prompts_file=str(tmp_path / "p.jsonl"), num_prompts=16)
  plan = {"workload": {"train_config": "c.py", "lengths": {
      "data": plan_file_lib.run_length_inputs(with_file)}}}
  assert "num_prompts" not in plan["workload"]["lengths"]["data"]
  assert plan_file_lib.plan_workload_differences(
      plan, _with_tokenizer(with_file, "")) == [
          f"lengths.data.tokenizer={str(tmp_path / 'tok')!r} (this run's init.tokenizer is '')"]
  # a plan.json from before they were recorded: the rest compared, they named once
  old = {**record, "lengths": {**record["lengths"], "data": {
      k: v for k, v in record["lengths"]["data"].items()
      if k not in ("num_prompts", "tokenizer", "chat_template")}}}
  path = _plan_file(tmp_path, old)
  assert plan_file_lib.plan_workload_note(path, other) == (False, (
      f"config.plan.file={path!r} records no init.tokenizer, data.chat_template, "
      "data.num_prompts of its lengths (a plan.json written before plan_search recorded "
      "them): those are not compared with this run's"))
  assert plan_file_lib.plan_workload_unrecorded({"workload": {**old, "lengths": {
      "data": {"prompts_file": "p.jsonl", "prompts_digest": "0" * 64}}}})[-1] == (
          "init.tokenizer, data.chat_template, data.prompt_key, data.val_fraction of its "
          "lengths")


def _file_run_and_record(tmp_path, prompts, **data):
  """(ppo_tiny's resolved config reading `prompts` with the tiny_chat tokenizer and the `data`
  changes, the "lengths" plan_search records for it)."""
  c = ppo_tiny.get_config()
  c.init.tokenizer = os.path.join(ROOT, "tests", "fixtures", "tiny_chat", "tokenizer.json")
  c.data.prompts_file, c.data.max_prompt_len = str(prompts), 16
  for k, v in data.items():
    setattr(c.data, k, v)
  raw = TrainConfig.from_config_dict(c)
  task, tokenizer = build.build_task_and_tokenizer(raw)
  cfg = build.resolve_config(raw, tokenizer)
  wl = sim_plan.workload(cfg, task, tokenizer, 8, str(tmp_path / "lengths"))[0]
  return cfg, plan_search.workload_record(wl, "c.py")["lengths"]


def test_the_prompt_field_and_the_held_out_fraction_are_recorded_and_compared(tmp_path):
  """The search samples the training pool's prompts: a prompts file's data.prompt_key field
  of each row, less the data.val_fraction held out. Neither was recorded, and a plan searched
  for 40 prompts of 5.5 tokens on average ran their 3-token 'question' field, or half of them,
  without a word. They are compared; a file from before names them once, not compared.
  data.overlong_prompts is not recorded: 'skip' leaves out what 'error' refuses, the pool of a
  run that builds is the same, and another max_prompt_len is compared already."""
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": " ".join(["a"] * (1 + i % 8)),
                                         "question": "a b", "target": "a"}) + "\n"
                             for i in range(40)))
  cfg, lengths = _file_run_and_record(tmp_path, prompts)
  assert (lengths["data"]["prompt_key"], lengths["data"]["val_fraction"]) == ("prompt", 0.0)
  plan = {"workload": {"train_config": "c.py", "lengths": lengths}}
  assert plan_file_lib.plan_workload_differences(plan, cfg) == []
  for change, said in (({"prompt_key": "question"}, "lengths.data.prompt_key='prompt' (this "
                        "run's data.prompt_key is 'question')"),
                       ({"val_fraction": 0.5}, "lengths.data.val_fraction=0.0 (this run's "
                        "data.val_fraction is 0.5)")):
    run, other = _file_run_and_record(tmp_path, prompts, **change)
    assert other["prompt"]["mean"] != lengths["prompt"]["mean"], (change, other["prompt"])
    assert plan_file_lib.plan_workload_differences(plan, run) == [said]
  # overlong_prompts='skip' at the same max_prompt_len: the same pool (nothing is longer)
  run, other = _file_run_and_record(tmp_path, prompts, overlong_prompts="skip")
  assert other == lengths
  assert plan_file_lib.plan_workload_differences(plan, run) == []
  # a task's prompts read no prompt_key (not recorded, not compared); its val_fraction is
  task_cfg, record = _tiny_run_and_record(tmp_path)
  task_plan = {"workload": record}
  assert "prompt_key" not in record["lengths"]["data"]
  assert plan_file_lib.plan_workload_differences(
      task_plan, _with_data(task_cfg, prompt_key="question", val_fraction=0.25)) == [
          "lengths.data.val_fraction=0.0 (this run's data.val_fraction is 0.25)"]
  # a plan.json from before they were recorded: the rest compared, they named once
  old = {**lengths, "data": {k: v for k, v in lengths["data"].items()
                             if k not in ("prompt_key", "val_fraction")}}
  old_plan = {"workload": {"train_config": "c.py", "lengths": old}}
  run = _file_run_and_record(tmp_path, prompts, prompt_key="question")[0]
  assert plan_file_lib.plan_workload_differences(old_plan, run) == []
  assert plan_file_lib.plan_workload_differences(old_plan, _with_data(
      run, prompts_file=str(tmp_path / "q.jsonl"))) == [
          f"lengths.data.prompts_file={str(prompts)!r} (this run's data.prompts_file is "
          f"{str(tmp_path / 'q.jsonl')!r})"]
  assert plan_file_lib.plan_workload_unrecorded(old_plan)[-1] == (
      "data.prompt_key, data.val_fraction of its lengths")
  # (a task's names no prompt_key, which it never read)
  old_task = {**record, "lengths": {**record["lengths"], "data": {
      k: v for k, v in record["lengths"]["data"].items() if k != "val_fraction"}}}
  path = _plan_file(tmp_path, old_task)
  assert plan_file_lib.plan_workload_note(path, task_cfg) == (False, (
      f"config.plan.file={path!r} records no data.val_fraction of its lengths (a plan.json "
      "written before plan_search recorded them): those are not compared with this run's"))


def test_a_paper_pairs_plan_says_its_lengths_are_not_compared(tmp_path):
  """plan_search without a train_config (a paper pair) records the simulator's own length
  distributions and no run's "data": train_ppo's set-up with such a plan.json stopped with
  KeyError: 'data'. Its lengths cannot be compared with a run's: the note says so, as neither
  a warning of a difference nor a silent pass."""
  from rlhfuse_jax.sim.shapes import get_shape
  cfg, record = _tiny_run_and_record(tmp_path)
  pair = plan_search.workload_record(iteration_sim.Workload(
      actor=get_shape("llama-13b"), critic=get_shape("llama-13b", "scalar")))
  assert "data" not in pair["lengths"] and "train_config" not in pair
  said = ("was searched with the simulator's own prompt and response lengths (prompt "
          "lognormal(median=256, sigma=0.5, clip [16, 1024]), response lognormal(median=256, "
          "sigma=0.8, clip [1, 1024])), which no field of a run stands for: not compared with "
          "this run's")
  path = _plan_file(tmp_path, pair)
  warn, line = plan_file_lib.plan_workload_note(path, cfg)
  assert warn and line.startswith(
      f"config.plan.file={path!r} was searched for actor num_layers=40 (this run has 2)"), line
  assert line.endswith(f"; the file {said}") and "lengths.data" not in line, line
  assert "records no" not in line
  # the same workload as the run's but for the lengths: said, not warned of
  same = {k: v for k, v in record.items() if k not in (
      "train_config", "inference_micro_batch", "migration_rows", "master_weights",
      "offload_optimizer")}
  path = _plan_file(tmp_path, {**same, "lengths": pair["lengths"]})
  assert plan_file_lib.plan_workload_unrecorded(plan_file_lib.load_plan_file(path)) == []
  assert plan_file_lib.plan_workload_note(path, cfg) == (False, f"config.plan.file={path!r} "
                                                                f"{said}")
  # a run's plan (its lengths' data recorded) says nothing of the kind
  assert plan_file_lib.simulator_lengths_note({"workload": record}) == ""


def test_train_ppo_warns_of_a_plan_for_another_mlp_width(tmp_path):
  """The reproduction: plan_search for ppo_tiny, then train_ppo with that plan and
  --config.model.intermediate_size=256 (or --config.data.length_dist=lognormal, or
  --config.data.chat_template=...) ran without a word. The warning comes at set-up,
  before the trainer's checks (a top_k that validate refuses stops the run in seconds)."""
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
         "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  out = subprocess.run(
      [sys.executable, "-m", "experiments.plan_search", "--config=configs/plan_search.py:train",
       f"--workdir={tmp_path / 'ps'}", "--config.systems=pipe_rlhf"], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  path = str(tmp_path / "ps" / "plan.json")
  assert json.loads(open(path).read())["workload"]["actor"]["intermediate_size"] == 128
  out = subprocess.run([sys.executable, "-m", "experiments.train_ppo",
                        "--config=configs/ppo_tiny.py", f"--config.plan.file={path}",
                        f"--workdir={tmp_path / 'run'}", "--config.rollout.top_k=100000",
                        "--config.model.intermediate_size=256",
                        "--config.critic_model.head_dim=32",
                        "--config.data.length_dist=lognormal",
                        "--config.data.num_prompts=64",
                        "--config.data.chat_template=tests/fixtures/tiny_chat/chatml"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and "config.rollout.top_k=100000" in out.stderr, out.stderr[-3000:]
  # (and of one searched for another length distribution, prompt count or chat template:
  # plan.json records them since 2026-12-07)
  assert (f"config.plan.file={path!r} was searched for actor intermediate_size=128 (this run "
          "has 256); critic head_dim=16 (this run has 32); lengths.data.num_prompts=4096 (this "
          "run's data.num_prompts is 64); lengths.data.length_dist='uniform' (this run's "
          "data.length_dist is 'lognormal'); lengths.data.chat_template='none' (this run's "
          "data.chat_template is 'tests/fixtures/tiny_chat/chatml') (plan_search's "
          "train_config='configs/ppo_tiny.py'): its predicted times and memory check are for "
          "that workload") in out.stderr, out.stderr[-3000:]


def test_an_asynchronous_run_on_its_training_devices_is_searched_with_its_copy_of_the_actor(
    tmp_path):
  """async_ppo.staleness > 0 without a generation group keeps a copy of the actor on the
  training devices (PPOTrainer._snapshot): the run's workload says so (Workload.actor_copy),
  so that plan_search counts it beside the stages of the plans it gives the run; a synchronous
  run, or one with a generation group (whose actor is the copy), keeps none."""
  raw = TrainConfig.from_config_dict(ppo_tiny.get_config())
  task, tokenizer = build.build_task_and_tokenizer(raw)
  for staleness, group, copy in ((0, 0, False), (1, 0, True), (1, 4, False)):
    cfg = build.resolve_config(dataclasses.replace(raw, async_ppo=dataclasses.replace(
        raw.async_ppo, staleness=staleness, generation_devices=group)), tokenizer)
    wl = sim_plan.workload(cfg, task, tokenizer, 8, str(tmp_path / "lengths"))[0]
    assert wl.actor_copy is copy, (staleness, group)


def test_a_plan_checked_without_the_actors_copy_is_warned_of_in_an_asynchronous_run(tmp_path):
  """A plan searched for a synchronous run (its memory check without asynchronous PPO's copy of
  the actor) run with async_ppo.staleness=1 and no generation group, which keeps one on the
  training devices: plan.json records actor_copy, and the run is warned of it (the plan's
  stages could need a copy of the actor more than the HBM). Searched for the asynchronous
  run, or run with a generation group (whose actor is the copy), nothing is said."""
  cfg, record = _tiny_run_and_record(tmp_path)
  assert record["actor_copy"] is False
  path = _plan_file(tmp_path, record)
  run = dataclasses.replace(cfg, async_ppo=dataclasses.replace(cfg.async_ppo, staleness=1))
  warn, line = plan_file_lib.plan_workload_note(path, run)
  assert warn and ("actor_copy=False (this run's async_ppo.staleness=1, generation_devices=0: a "
                   "copy of the actor on the training devices for the next batch's "
                   "generation)") in line, line
  assert plan_file_lib.plan_workload_note(path, cfg) is None
  grouped = dataclasses.replace(run, async_ppo=dataclasses.replace(run.async_ppo,
                                                                   generation_devices=4))
  assert plan_file_lib.plan_workload_note(path, grouped) is None
  path = _plan_file(tmp_path, {**record, "actor_copy": True})
  assert plan_file_lib.plan_workload_note(path, run) is None
  # plan_search records the written plan's: an asynchronous split keeps no copy there
  from rlhfuse_jax.sim.shapes import get_shape
  wl = iteration_sim.Workload(actor=get_shape("llama-7b"),
                              critic=get_shape("llama-7b", "scalar"), actor_copy=True)
  split = {"async": {"generation_devices": 4, "training_devices": 4, "staleness": 1,
                     "colocated": False}}
  assert plan_search.workload_record(wl)["actor_copy"] is True
  assert plan_search.workload_record(wl, plan=split)["actor_copy"] is False
  assert plan_search.workload_record(wl, plan={})["actor_copy"] is True


@pytest.mark.parametrize("default", [0, 2])
def test_a_split_without_its_staleness_is_read_with_one_default_by_trainer_and_search(
    monkeypatch, default):
  """An "async" entry that states no staleness: the trainer's mapping of the plan file and
  plan_search's memory rows (whether the training devices hold a copy of the actor) both take
  policy/async_copies.SPLIT_STALENESS, where each wrote its own literal 1."""
  from rlhfuse_jax.policy import async_copies
  from rlhfuse_jax.sim.shapes import get_shape
  monkeypatch.setattr(async_copies, "SPLIT_STALENESS", default)
  plan = {"generation": {"mode": "instances", "tp": 1, "pp": 1, "groups": 1, "slots": 0},
          "inference": {"tp": 1, "pp": 1},
          "training": {"placement": "colocated", "devices": 4, "tp": 1, "actor_pp": 1,
                       "critic_pp": 1},
          "async": {"generation_devices": 4, "training_devices": 4, "colocated": False}}
  settings = plan_file_lib.plan_file_settings(plan, "plan.json")
  assert settings["async_ppo", "staleness"] == (default, "async.staleness")
  # colocated: both groups on the training devices, which hold the copy at any k >= 1
  wl = iteration_sim.Workload(actor=get_shape("llama-7b"),
                              critic=get_shape("llama-7b", "scalar"), actor_copy=False)
  assert plan_search.keeps_actor_copy(wl, {"async": {"colocated": True}}) is (default > 0)
  # and the trainer runs a colocated entry at that k too, with no generation group
  settings = plan_file_lib.plan_file_settings({**plan, "async": {"colocated": True}}, "plan.json")
  assert (settings["async_ppo", "staleness"][0],
          settings["async_ppo", "generation_devices"][0]) == (default, 0)
