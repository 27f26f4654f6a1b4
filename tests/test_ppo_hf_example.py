"""configs/ppo_hf.py end to end (issue 32): the shipped HF model directory and GSM8K-format data
are what configs/data/make_tiny_example.py makes; the real config loads, templates, generates,
verifies, validates, trains and exports an HF checkpoint that reloads to identical logits and is
laid out as the fixture whose HF logits are recorded (tests/fixtures/tiny_llama3/golden.npz).
The export option (checkpoint.export_hf) on its own: the family, the files, the refusals."""
import dataclasses
import filecmp
import importlib.util
import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy

from configs import ppo_hf
from rlhfuse_jax.data import verifiers
from rlhfuse_jax.data.tokenizer import HFTokenizer
from rlhfuse_jax.models import hf_loader, llama
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.trainer import build, hf_export
from rlhfuse_jax.trainer.config import EXPORT_HF_CHOICES, TrainConfig
from rlhfuse_jax.trainer.loop import PPOTrainer
from rlhfuse_jax.trainer.validate import validate
from tests.test_trainer import tiny_config, with_overrides

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "configs", "data")
FIXTURES = os.path.join(REPO, "tests", "fixtures")
LLAMA3 = os.path.join(FIXTURES, "tiny_llama3")


def _make_script():
  path = os.path.join(DATA, "make_tiny_example.py")
  spec = importlib.util.spec_from_file_location("make_tiny_example", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _tensors(ckpt):
  return safetensors.numpy.load_file(os.path.join(ckpt, "model.safetensors"))


def _logits(cfg, params, ids):
  return np.asarray(jax.jit(lambda p, t: llama.apply(cfg, p, t)[0])(params, ids))


def test_shipped_data_is_what_the_script_makes(tmp_path):
  """Every shipped file is reproduced byte for byte (the model's from the fixture, so its HF
  goldens are this model's), and every row is a well-formed GSM8K problem whose own solution
  the gsm8k verifier accepts."""
  _make_script().main(str(tmp_path))
  for sub in ("tiny_llama3_chat", "tiny_gsm8k"):
    names = sorted(os.listdir(tmp_path / sub))
    assert names == sorted(os.listdir(os.path.join(DATA, sub)))
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / sub, os.path.join(DATA, sub), names,
                                           shallow=False)
    assert not mismatch and not errors, (sub, mismatch, errors)
  for name in ("config.json", "model.safetensors"):
    assert filecmp.cmp(os.path.join(DATA, "tiny_llama3_chat", name), os.path.join(LLAMA3, name),
                       shallow=False)
  for split, n in (("train", 256), ("val", 64)):
    with open(os.path.join(DATA, "tiny_gsm8k", f"{split}.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    assert len(rows) == n
    for r in rows:
      solution, final = r["answer"].rsplit("\n#### ", 1)
      # The solution's last equation computes the final answer: "... = <<a+b=s>>s ...".
      assert solution.split(">>")[-1].startswith(final + " ")
      assert verifiers.gsm8k(f"So the answer is\n#### {final}", r["answer"], r) == 1.0
      assert verifiers.gsm8k("#### 1000", r["answer"], r) == 0.0


def _example_config(**overrides) -> TrainConfig:
  return with_overrides(ppo_hf.get_config(), **overrides)


def test_example_config_trains_validates_and_exports(tmp_path, monkeypatch):
  """The real config, 2 iterations (validation after the last): verifier and validation reward in
  the metrics, and WORKDIR/hf_export reloads to the trained actor's parameters and logits
  exactly, with the config and tensor layout of the HF fixture it started from."""
  monkeypatch.chdir(REPO)  # the config's paths are relative to the repository, as runs start
  cfg = _example_config(num_iterations=2, eval_every=2, **{"data.val_max_prompts": 16})
  wd = str(tmp_path / "run")
  # One CPU device, as the command runs (the tests' 8 fake devices would only slow it down).
  trainer = PPOTrainer(cfg, wd, mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1]))
  assert trainer.cfg.model == hf_loader.load_hf_config(LLAMA3, max_seq_len=128)
  history = trainer.run()
  assert [h["step"] for h in history] == [1, 2]
  for h in history:
    assert 0.0 <= h["reward/mean"] <= 1.1  # gsm8k (0/1) + 0.1 * gsm8k_format (0/1)
    assert h["response_length/mean"] > 0
  assert "val/reward_mean" not in history[0]
  assert history[1]["val/prompts"] == 16 and 0.0 <= history[1]["val/reward_mean"] <= 1.1
  # The held-out verifier accuracy and format share apart (reward = function + 0.1 x format).
  val = {k: history[1][f"val/{k}_mean"] for k in ("reward", "function", "format")}
  assert 0.0 <= val["function"] <= 1.0 and 0.0 <= val["format"] <= 1.0
  assert val["reward"] == pytest.approx(val["function"] + 0.1 * val["format"], abs=1e-6)

  out = os.path.join(wd, hf_export.HF_EXPORT_DIR)
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                     "model.safetensors", hf_export.EXPORT_MARKER, "tokenizer.json",
                                     "tokenizer_config.json"]
  assert hf_export.exported_step(out) == 2
  for name in ("tokenizer.json", "tokenizer_config.json"):  # the chat template goes along
    assert filecmp.cmp(os.path.join(out, name), os.path.join(DATA, "tiny_llama3_chat", name),
                       shallow=False)
  # Layout: the fixture's tensor names, shapes and dtypes, and its architecture in config.json
  # (transformers loads exports of this layout to golden.npz exactly, tests/test_hf_loader.py).
  src, dst = _tensors(LLAMA3), _tensors(out)
  assert sorted(src) == sorted(dst)
  assert all(src[k].shape == dst[k].shape and src[k].dtype == dst[k].dtype for k in src)
  assert not all(np.array_equal(src[k], dst[k]) for k in src)  # it trained
  with open(os.path.join(out, "config.json")) as f:
    exported = json.load(f)
  assert exported["architectures"] == ["LlamaForCausalLM"] and exported["model_type"] == "llama"
  assert exported["rope_scaling"]["rope_type"] == "llama3"
  # The model's own context stays the source checkpoint's (the run trained at 128 positions).
  with open(os.path.join(LLAMA3, "config.json")) as f:
    source = json.load(f)
  assert exported["max_position_embeddings"] == source["max_position_embeddings"] != 128
  assert hf_loader.load_hf_config(out, max_seq_len=128) == trainer.cfg.model
  # Reload: the same parameters, bit for bit, so the same logits.
  actor = mesh_lib.to_host(trainer.model_params("actor"))
  again = hf_loader.load_hf_params(out, trainer.cfg.model)
  assert jax.tree.structure(again) == jax.tree.structure(actor)
  for a, b in zip(jax.tree.leaves(actor), jax.tree.leaves(again)):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  ids = np.load(os.path.join(LLAMA3, "golden.npz"))["input_ids"]
  np.testing.assert_array_equal(_logits(trainer.cfg.model, again, ids),
                                _logits(trainer.cfg.model, actor, ids))

  # The export lost (a failed or killed export at the very end, the checkpoint saved): the same
  # command restores the last checkpoint and exports it again, training nothing ...
  os.replace(out, out + ".lost")
  redo = PPOTrainer(cfg, wd, mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1]))
  assert redo.export_only and redo.run() == []
  assert hf_export.exported_step(out) == 2
  assert filecmp.cmp(os.path.join(out, "model.safetensors"),
                     os.path.join(out + ".lost", "model.safetensors"), shallow=False)
  # ... and a finished run whose export is current builds nothing.
  def no_build(*args, **kwargs):
    raise AssertionError("a finished run with its export built its models")
  monkeypatch.setattr(build, "build_models", no_build)
  done = PPOTrainer(cfg, wd)
  assert done.finished_at == 2 and not done.export_only and done.run() == []
  # ... while another family asked for on a re-run exports again (it kept the old one).
  monkeypatch.undo()
  mistral = _example_config(num_iterations=2, eval_every=2, **{
      "data.val_max_prompts": 16, "checkpoint.export_hf": "mistral"})
  redo = PPOTrainer(mistral, wd, mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1]))
  assert redo.export_only and redo.run() == []
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["architectures"] == ["MistralForCausalLM"]


def test_export_carries_the_runs_tokenizer_template_and_special_ids(tmp_path):
  """Without a source checkpoint the export is the run's own: the tokenizer file it read (named
  anything, beside another directory's tokenizer.json) as tokenizer.json, the chat template it
  rendered prompts with, and the tokenizer's bos/eos/pad ids in config.json (absent, transformers
  reads bos 1 / eos 2). A run on the synthetic task's tokenizer exports that one."""
  import shutil
  chat = os.path.join(FIXTURES, "tiny_chat")
  llama_dir = os.path.join(FIXTURES, "tiny_llama")
  mine = tmp_path / "tok"
  mine.mkdir()
  shutil.copyfile(os.path.join(chat, "chatml", "tokenizer.json"), mine / "chatml_tok.json")
  shutil.copyfile(os.path.join(chat, "chatml", "tokenizer_config.json"),
                  mine / "tokenizer_config.json")  # read beside the file, by the run and HF
  shutil.copyfile(os.path.join(llama_dir, "tokenizer.json"), mine / "tokenizer.json")  # not it
  # A second id a response ends on (Qwen2.5 Instruct's <|endoftext|> beside <|im_end|>).
  chatml = HFTokenizer.from_file(str(mine / "chatml_tok.json"))
  stops = [chatml.eos_id, chatml.token_to_id("<|endoftext|>")]
  (mine / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
  template = os.path.join(chat, "inst", "chat_template.jinja")
  cfg = tiny_config(**{"init.actor_checkpoint": llama_dir, "checkpoint.export_hf": "llama",
                       "init.tokenizer": os.path.join(llama_dir, "tokenizer.json")})
  cfg = build.resolve_config(cfg, HFTokenizer.from_file(llama_dir))
  params = hf_loader.load_hf_params(llama_dir, cfg.model)
  cfg = dataclasses.replace(
      cfg, init=dataclasses.replace(cfg.init, actor_checkpoint="",
                                    tokenizer=str(mine / "chatml_tok.json")),
      data=dataclasses.replace(cfg.data, chat_template=template))
  tok = HFTokenizer.from_file(str(mine / "chatml_tok.json"))
  out = str(tmp_path / "export")
  hf_export.export_hf(params, cfg, out, tokenizer=tok)
  assert filecmp.cmp(os.path.join(out, "tokenizer.json"), mine / "chatml_tok.json",
                     shallow=False)
  with open(os.path.join(out, "chat_template.jinja"), encoding="utf-8") as f, \
       open(template, encoding="utf-8") as g:
    source = g.read()
    assert f.read() == source
  # tokenizer_config.json as the run read it, but for its template: the one the prompts were
  # rendered with (it kept ChatML's, which readers of that file alone would have used).
  with open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8") as f, \
       open(mine / "tokenizer_config.json", encoding="utf-8") as g:
    exported_tc, read_tc = json.load(f), json.load(g)
  assert read_tc["chat_template"] != source and exported_tc["chat_template"] == source
  assert {**exported_tc, "chat_template": None} == {**read_tc, "chat_template": None}
  with open(os.path.join(out, "config.json")) as f:
    exported = json.load(f)
  assert (exported["bos_token_id"], exported["eos_token_id"], exported["pad_token_id"]) == (
      tok.bos_id, stops, tok.pad_id)
  assert tok.bos_id is None and tok.eos_id != 2  # ChatML has no BOS; not LlamaConfig's 1 / 2
  assert filecmp.cmp(os.path.join(out, "generation_config.json"),
                     mine / "generation_config.json", shallow=False)
  assert HFTokenizer.from_file(out).stop_ids == tuple(stops)  # the export ends where the run did
  # The synthetic task's word-level tokenizer, written from memory.
  _, task_tok = build.build_task_and_tokenizer(tiny_config())
  plain = dataclasses.replace(cfg, init=dataclasses.replace(cfg.init, tokenizer=""),
                              data=dataclasses.replace(cfg.data, chat_template="none"))
  out = str(tmp_path / "task_export")
  hf_export.export_hf(params, plain, out, tokenizer=task_tok)
  again = HFTokenizer.from_file(os.path.join(out, "tokenizer.json"), eos_token=(
      task_tok.id_to_token(task_tok.eos_id)))
  assert again.encode("2 #3 =", add_bos=False) == task_tok.encode("2 #3 =", add_bos=False)
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["eos_token_id"] == task_tok.eos_id


def _export_of(source, tmp_path, tokenizer_dir=None):
  """The export (directory) of `source`'s weights by a run of tiny_config reading its
  tokenizer.json (or `tokenizer_dir`'s), and that run's tokenizer."""
  tok_path = os.path.join(tokenizer_dir or source, "tokenizer.json")
  cfg = tiny_config(**{"init.actor_checkpoint": str(source), "init.tokenizer": tok_path,
                       "checkpoint.export_hf": "auto"})
  tok = build.build_task_and_tokenizer(cfg)[1]
  cfg = build.resolve_config(cfg, tok)
  out = str(tmp_path / "export")
  hf_export.export_hf(hf_loader.load_hf_params(str(source), cfg.model), cfg, out, tokenizer=tok)
  return out, tok


def test_an_export_of_a_bare_tokenizer_json_reads_as_the_run_read_it(tmp_path):
  """A tokenizer.json alone (no tokenizer_config.json, no post-processor): the run put BOS first
  and stopped on the EOS it found in the vocabulary (<|end_of_text|>) and on config.json's
  eos_token_id. The export held only the tokenizer.json, which HF reads with no BOS, no EOS
  token and no BOS prepended, and config.json's single eos. It now names the special tokens
  (tokenizer_config.json), puts BOS first in its post-processor (transformers' fast tokenizers
  add special tokens only through it), and lists every stop id in generation_config.json; a
  source config.json with null ids (as transformers saves some) gets the run's."""
  import shutil
  import tokenizers
  src = tmp_path / "model"
  src.mkdir()
  for name in ("config.json", "model.safetensors", "tokenizer.json"):
    shutil.copyfile(os.path.join(DATA, "tiny_llama3_chat", name), src / name)
  out, tok = _export_of(src, tmp_path)
  text = "Natalia sold clips"
  assert tok.add_bos and tok.stop_ids == (tok.token_to_id("<|end_of_text|>"), 2)
  with open(os.path.join(out, "tokenizer_config.json")) as f:
    assert json.load(f) == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                            "pad_token": tok.id_to_token(tok.pad_id), "add_bos_token": True}
  # (HF's fast tokenizers encode with add_special_tokens=True by default)
  assert tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json")).encode(
      text).ids == tok.encode(text)
  with open(os.path.join(out, "generation_config.json")) as f:
    assert json.load(f)["eos_token_id"] == list(tok.stop_ids)
  again = HFTokenizer.from_file(out)
  assert again.encode(text) == tok.encode(text) and again.stop_ids == tok.stop_ids
  # Null ids in the source's config.json: the run's, not null (generate() ran past the EOS).
  config = json.loads((src / "config.json").read_text())
  (src / "config.json").write_text(json.dumps({**config, "bos_token_id": None,
                                               "eos_token_id": None}))
  shutil.rmtree(out)
  out, tok = _export_of(src, tmp_path)
  with open(os.path.join(out, "config.json")) as f:
    exported = json.load(f)
  assert (exported["bos_token_id"], exported["eos_token_id"]) == (tok.bos_id, tok.eos_id)
  assert tok.stop_ids == (tok.eos_id,)  # (config.json named none: no generation_config needed)
  assert not os.path.exists(os.path.join(out, "generation_config.json"))


def test_an_export_stops_where_the_run_did_with_the_tokenizer_elsewhere(tmp_path):
  """init.tokenizer in another directory than init.actor_checkpoint (an Instruct model's
  tokenizer beside a checkpoint of one's own): the run stopped on both directories' eos ids
  (the tokenizer's generation_config.json lists <|end_of_text|> too), but the export copied
  the checkpoint's generation_config.json, which names its EOS alone: transformers' generate()
  on the export, and a run reading it as its tokenizer, went on past <|end_of_text|>. The
  copied file's eos_token_id is now the run's, its other settings kept."""
  import shutil
  src, tok_dir = tmp_path / "model", tmp_path / "tok"
  shutil.copytree(os.path.join(DATA, "tiny_llama3_chat"), src)
  os.makedirs(tok_dir)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copyfile(src / name, tok_dir / name)
  source = json.loads((src / "generation_config.json").read_text())
  eos = HFTokenizer.from_file(str(src)).eos_id
  assert source["eos_token_id"] == eos
  end = HFTokenizer.from_file(str(src)).token_to_id("<|end_of_text|>")
  (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, end]}))
  out, tok = _export_of(src, tmp_path, str(tok_dir))
  assert tok.stop_ids == (eos, end)
  exported = json.loads(open(os.path.join(out, "generation_config.json")).read())
  assert exported == {**source, "eos_token_id": [eos, end]}
  assert HFTokenizer.from_file(out).stop_ids == tok.stop_ids


def test_a_critic_source_s_malformed_eos_ids_are_replaced_in_its_export(tmp_path, monkeypatch):
  """The critic's export copies init.critic_checkpoint's generation_config.json, which nothing
  reads before (the actor's is checked at set-up), and sets its eos_token_id to the run's stop
  ids where it names others. A value that is not token ids (a null in the list) was sorted with
  them: the export (experiments/export_hf.py --model=critic) failed with a TypeError. It is
  replaced as other ids are; a file that is not JSON is refused naming it."""
  import dataclasses
  import shutil
  from flax import traverse_util
  monkeypatch.chdir(REPO)
  src = tmp_path / "critic_src"
  shutil.copytree(os.path.join(REPO, ppo_hf.MODEL_DIR), src)
  source = json.loads((src / "generation_config.json").read_text())
  c = ppo_hf.get_config()
  c.init.critic_checkpoint = str(src)
  critic = hf_loader.load_hf_config(str(src), head="scalar", max_seq_len=128)
  cfg = dataclasses.replace(TrainConfig.from_config_dict(c), critic_model=critic)
  params = traverse_util.flatten_dict(jax.device_get(
      llama.init_params(critic, jax.random.key(0))[0]))
  params[("head", "value_bias")] = np.zeros((1,), np.float32)
  params = traverse_util.unflatten_dict(params)
  tokenizer = HFTokenizer.from_file(c.init.tokenizer)
  stops = list(tokenizer.stop_ids)
  want = stops if len(stops) > 1 else stops[0]
  for eos in ([stops[0], None], ["</s>", stops[0]]):
    (src / "generation_config.json").write_text(json.dumps({**source, "eos_token_id": eos}))
    out = str(tmp_path / "critic")
    hf_export.export_hf(params, cfg, out, 7, tokenizer, str(tmp_path), model="critic")
    exported = json.loads(open(os.path.join(out, "generation_config.json")).read())
    assert exported == {**source, "eos_token_id": want}, eos
  (src / "generation_config.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"generation_config.json: not a valid "
                                       r"generation_config.json \("):
    hf_export.export_hf(params, cfg, str(tmp_path / "critic"), 7, tokenizer, str(tmp_path),
                        model="critic")


def test_export_family_and_refusals(tmp_path):
  """export_hf='auto' keeps the source checkpoint's family (a Mistral stays a Mistral, which
  the model's shape alone would write as LLaMA); a family that cannot express the actor is
  refused before anything is built; an unknown value names the field."""
  mistral = os.path.join(FIXTURES, "tiny_mistral")
  tok = os.path.join(mistral, "tokenizer.json")
  cfg = tiny_config(**{"checkpoint.export_hf": "auto", "init.actor_checkpoint": mistral,
                       "init.tokenizer": tok})
  cfg = build.resolve_config(cfg, HFTokenizer.from_file(tok))  # the checkpoint's architecture
  assert hf_export.export_family(cfg) == "mistral"
  params = hf_loader.load_hf_params(mistral, cfg.model)
  out = str(tmp_path / "export")
  os.makedirs(out)
  (tmp_path / "export" / "stale.txt").write_text("an earlier export")
  assert hf_export.export_hf(params, cfg, out) == "mistral"
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                     "tokenizer.json"]  # unmarked: no step given
  assert hf_export.exported_step(out) is None
  with open(os.path.join(out, "config.json")) as f:
    exported = json.load(f)
  with open(os.path.join(mistral, "config.json")) as f:
    source = json.load(f)
  assert exported["architectures"] == ["MistralForCausalLM"]
  # The model's own fields come from the source: its positions and its special ids.
  for k in ("max_position_embeddings", "sliding_window", "bos_token_id", "eos_token_id",
            "pad_token_id"):
    assert k in source and exported.get(k) == source[k], k
  src, dst = _tensors(mistral), _tensors(out)
  assert sorted(src) == sorted(dst) and all(np.array_equal(src[k], dst[k]) for k in src)
  # Without a source checkpoint "auto" is the shape's family.
  assert hf_export.export_family(dataclasses.replace(
      cfg, init=dataclasses.replace(cfg.init, actor_checkpoint=""))) is None

  bad = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                export_hf="qwen3"))
  mesh = mesh_lib.make_mesh(cfg.mesh)
  with pytest.raises(ValueError, match=r"config.checkpoint.export_hf='qwen3': .*qk_norm=False "
                                       r"has no HF qwen3"):
    validate(bad, mesh)
  with pytest.raises(ValueError, match=r"config.checkpoint.export_hf='gpt2': expected one of"):
    tiny_config(**{"checkpoint.export_hf": "gpt2"})
  assert set(hf_loader.FAMILIES) == set(EXPORT_HF_CHOICES) - {"", "auto"}


def test_an_override_of_a_checkpoints_architecture_is_refused(monkeypatch):
  """--config.model.num_layers=4 beside init.actor_checkpoint (whose config.json says 2) built
  the checkpoint's 2 layers, said only in the `actor: ...` log line; now it is refused, naming
  the override and the checkpoint's value. The checkpoint's own value, a field a run chooses
  (remat), the config file's own shape fields (not overrides), a critic field for a run that
  trains no critic, and an override with no checkpoint pass."""
  monkeypatch.chdir(REPO)  # the config's paths are relative to the repository
  ckpt = hf_loader.load_hf_config(ppo_hf.MODEL_DIR)
  given = lambda **fields: with_overrides(ppo_hf.get_config(), **fields)
  asked = given(**{"model.num_layers": ckpt.num_layers + 2})
  with pytest.raises(ValueError, match=(
      rf"--config\.model\.num_layers={ckpt.num_layers + 2} cannot apply: "
      rf"config\.init\.actor_checkpoint='{ppo_hf.MODEL_DIR}' sets the model's architecture "
      rf"from its config\.json, where num_layers is {ckpt.num_layers}\. Drop the override")):
    build.check_shape_overrides(asked, {"model.num_layers": ckpt.num_layers + 2})
  build.check_shape_overrides(asked, {})  # the same value from the file: not an override
  same = given(**{"model.num_layers": ckpt.num_layers, "model.remat": "full"})
  build.check_shape_overrides(same, {"model.num_layers": ckpt.num_layers, "model.remat": "full"})
  wide = given(**{"critic_model.hidden_size": 2 * ckpt.hidden_size})
  with pytest.raises(ValueError, match=r"--run_config\.critic_model\.hidden_size=.*config\.init\."
                                       r"critic_checkpoint=.* where hidden_size is "
                                       rf"{ckpt.hidden_size}\."):
    build.check_shape_overrides(wide, {"critic_model.hidden_size": 2 * ckpt.hidden_size},
                                flag="--run_config")
  free = given(**{"critic_model.hidden_size": 2 * ckpt.hidden_size,
                  "algo.estimator": "reinforce_pp"})
  build.check_shape_overrides(free, {"critic_model.hidden_size": 2 * ckpt.hidden_size})
  own = given(**{"model.num_layers": ckpt.num_layers + 2, "init.actor_checkpoint": ""})
  build.check_shape_overrides(own, {"model.num_layers": ckpt.num_layers + 2})


def test_a_from_scratch_learning_rate_on_a_pretrained_actor_is_warned_of(monkeypatch, caplog):
  """init.actor_checkpoint with optim.actor_lr above 1e-4 (ppo_tiny's from-scratch 3e-3 left in
  place): one warning naming the field, its value and the usual fine-tuning range; not an
  error. The shipped configs (the toy run's 1e-4, ppo_gpu's 1e-6) and a run without a
  checkpoint say nothing."""
  import logging
  monkeypatch.chdir(REPO)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=8))

  def warned(cfg):
    caplog.clear()
    tok = HFTokenizer.from_file(os.path.join(DATA, "tiny_llama3_chat"))
    with caplog.at_level(logging.WARNING):
      validate(build.resolve_config(cfg, tok), mesh)
    return [r.getMessage() for r in caplog.records if "optim.actor_lr" in r.getMessage()]
  said = warned(_example_config(**{"optim.actor_lr": 3e-3}))
  assert len(said) == 1 and said[0].startswith(
      "config.optim.actor_lr=0.003 fine-tunes the pretrained actor of config.init."
      "actor_checkpoint='configs/data/tiny_llama3_chat'") and "1e-6 .. 1e-5" in said[0]
  assert warned(_example_config()) == []  # 1e-4: the toy run's rate
  # (ppo_gpu's context does not fit the tiny model it points at: its rate alone.)
  from rlhfuse_jax.trainer.validate import warn_fine_tune_lr
  assert warn_fine_tune_lr(with_overrides(ppo_hf.get_config("ppo_gpu"))) is None
  assert warned(_example_config(**{"optim.actor_lr": 3e-3, "init.actor_checkpoint": "",
                                   "init.critic_checkpoint": ""})) == []


def test_the_example_maker_refuses_an_option_for_its_output_directory(tmp_path):
  """`make_tiny_example.py --help` took "--help" for the output directory and wrote the whole
  example into ./--help/."""
  import subprocess
  import sys
  out = subprocess.run([sys.executable, os.path.join(DATA, "make_tiny_example.py"), "--help"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert out.returncode == 1 and "usage: python configs/data/make_tiny_example.py" in out.stderr
  assert os.listdir(tmp_path) == []


def _reward_model_checkpoint(rm):
  """A reward model at `rm`: the example's model with a score head (its embedding's row 3)."""
  import shutil
  shutil.copytree(os.path.join(DATA, "tiny_llama3_chat"), rm)
  with open(rm / "config.json") as f:
    hf = json.load(f)
  hf["architectures"] = ["LlamaForSequenceClassification"]
  (rm / "config.json").write_text(json.dumps(hf))
  weights = _tensors(str(rm))
  weights["score.weight"] = weights["model.embed_tokens.weight"][3:4].copy()  # [1, hidden]
  safetensors.numpy.save_file(weights, str(rm / "model.safetensors"))
  return rm


def _flat(d, prefix=""):
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
  return out


# What configs/ppo_hf.py's reward-model forms set back to their defaults beside a reward model
# (given by the user) and no verifier (reward.function=''): the format term, the answer column
# and the held-out set.
REWARD_MODEL_FIELDS = ("reward.format", "reward.format_weight", "data.answer_key",
                       "data.val_file", "data.val_max_prompts", "eval_every")


@pytest.mark.parametrize("base", ["ppo", "grpo", "ppo_gpu", "grpo_gpu"])
def test_every_example_variant_has_a_reward_model_form(base, tmp_path, caplog):
  """configs/ppo_hf.py:<variant>_reward_model (reward_model for ppo): the variant, GPU size or
  GRPO alike, with the verifier's fields cleared as :reward_model clears PPO's (a user of
  grpo_gpu with a reward model spelled seven flags by hand), every other field the variant's
  own; with the reward model given it validates on 8 devices warning of no field unused (the GPU
  sizes' context shrunk to the tiny model's 256 positions)."""
  import logging
  from rlhfuse_jax.trainer import config as config_lib
  name = "reward_model" if base == "ppo" else f"{base}_reward_model"
  plain, c = _flat(ppo_hf.get_config(base).to_dict()), ppo_hf.get_config(name)
  got, defaults = _flat(c.to_dict()), _flat(config_lib.defaults())
  want = {**plain, **{k: defaults[k] for k in REWARD_MODEL_FIELDS}, "reward.kind": "model",
          "reward.function": "", "reward.model_checkpoint": ""}
  assert got == want, {k: (got[k], want[k]) for k in got if got[k] != want[k]}
  assert plain["reward.format"] and plain["eval_every"]  # what there was to clear
  c.reward.model_checkpoint = str(_reward_model_checkpoint(tmp_path / "rm"))
  if base.endswith("_gpu"):
    c.data.max_prompt_len, c.rollout.max_new_tokens = 80, 32
    c.model.max_seq_len = c.critic_model.max_seq_len = 128
  cfg = TrainConfig.from_config_dict(c)
  assert cfg.mesh.fsdp == (8 if base.endswith("_gpu") else 1)
  assert cfg.algo.estimator == ("grpo" if base.startswith("grpo") else "gae")
  _, tokenizer = build.build_task_and_tokenizer(cfg)
  with caplog.at_level(logging.WARNING):
    validate(build.resolve_config(cfg, tokenizer), mesh_lib.make_mesh(cfg.mesh))
  assert "not used" not in caplog.text, caplog.text


def test_the_binary_warns_of_a_format_weight_only_where_its_command_line_set_it(tmp_path):
  """--config.reward.format='' on configs/ppo_hf.py was warned of as leaving the preset's
  config.reward.format_weight=0.1 unused: train_ppo tells validate which fields its flags set.
  A weight given on the command line beside no format is still warned of. (Subprocesses, each
  stopped after validate by the actor's unreadable weights, read after it.)"""
  import shutil
  import subprocess
  import sys
  from tests.xla_env import subprocess_env
  actor = tmp_path / "actor"
  shutil.copytree(os.path.join(DATA, "tiny_llama3_chat"), actor)
  (actor / "model.safetensors").write_bytes(b"not safetensors")
  for flags, said in (([], None), (["--config.reward.format_weight=0.2"], "0.2")):
    out = subprocess.run(
        [sys.executable, "-m", "experiments.train_ppo", "--config=configs/ppo_hf.py",
         f"--workdir={tmp_path / 'run'}", "--config.reward.format=",
         f"--config.init.actor_checkpoint={actor}", *flags],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 1 and "not a readable safetensors file" in out.stderr, (
        out.stderr[-3000:])
    assert "setup: prompts" in out.stderr, out.stderr[-3000:]  # (validate passed)
    warning = (f"config.reward.format_weight={said} not used: no reward.format to weigh"
               if said else "format_weight")
    assert (warning in out.stderr) == bool(said), out.stderr[-3000:]


def test_the_reward_model_variant_clears_the_verifier_and_needs_a_checkpoint(tmp_path):
  """configs/ppo_hf.py:reward_model (docs/own_model.md's reward-model command): no verifier,
  format term, answer column or held-out file left from the example, the reward model's path
  required by name; with a reward model (the example's model with a score head) the binary
  starts and trains 1 iteration warning of no field left unused. (A subprocess: the binary
  defines absl flags.)"""
  import subprocess
  import sys
  from tests.xla_env import subprocess_env
  c = ppo_hf.get_config("reward_model")
  assert (c.reward.kind, c.reward.function, c.reward.format) == ("model", "", "")
  assert c.data.val_file == "" and c.data.answer_key == "target"  # the default, read by none
  assert c.data.prompts_file and c.init.actor_checkpoint == ppo_hf.MODEL_DIR
  with pytest.raises(ValueError, match=r"^config\.reward\.model_checkpoint='': expected a "
                                       r"checkpoint directory when reward\.kind='model'"):
    TrainConfig.from_config_dict(c)
  rm = _reward_model_checkpoint(tmp_path / "rm")
  wd = tmp_path / "run"
  out = subprocess.run(
      [sys.executable, "-m", "experiments.train_ppo", "--config=configs/ppo_hf.py:reward_model",
       f"--workdir={wd}", f"--config.reward.model_checkpoint={rm}",
       "--config.num_iterations=1", "--config.rollout.prompts_per_iteration=4",
       "--config.algo.minibatch_size=4", "--config.rollout.max_new_tokens=8",
       "--config.log_samples=0", "--config.checkpoint.export_hf="],
      cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "not used" not in out.stderr, out.stderr[-3000:]
  with open(wd / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  assert [r["step"] for r in rows] == [1]
  assert f"reward model {rm} scores each sequence" in out.stderr, out.stderr[-3000:]
  assert np.isfinite(rows[0]["reward/mean"]) and rows[0]["reward/std"] > 0, rows[0]
  # The model's score alone: no verifier, format term or validation pass.
  assert not [k for k in rows[0] if "function" in k or "format" in k or k.startswith("val/")]
