"""HF checkpoint loading against the committed tiny fixtures (see tests/make_tiny_checkpoint.py).

No torch or transformers at test time: golden logits were recorded from HF once. Broken
checkpoints are built in tmp_path by editing config.json or re-saving the safetensors.
"""
import glob
import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from rlhfuse_jax.models import hf_loader, llama

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LLAMA = os.path.join(FIXTURES, "tiny_llama")  # sharded, untied, head_dim != hidden / heads
QWEN2 = os.path.join(FIXTURES, "tiny_qwen2")  # single file, q/k/v biases, tied embeddings


def _golden(ckpt):
  g = np.load(os.path.join(ckpt, "golden.npz"))
  return g["input_ids"], g["logits"]  # [batch, len], [batch, len, vocab]


def _forward(cfg, params, ids):
  return np.asarray(jax.jit(lambda p, t: llama.apply(cfg, p, t)[0])(params, ids))


def _read_tensors(ckpt):
  tensors = {}
  for path in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
    tensors.update(safetensors.numpy.load_file(path))
  return tensors


def _copy(src, dst, edit_config=None, edit_tensors=None):
  """Re-saves checkpoint `src` into `dst` as one model.safetensors, after optional edits."""
  os.makedirs(dst)
  with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
  if edit_config:
    edit_config(config)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(config, f)
  tensors = _read_tensors(src)
  if edit_tensors:
    edit_tensors(tensors)
  safetensors.numpy.save_file(tensors, os.path.join(dst, "model.safetensors"),
                              metadata={"format": "pt"})
  shutil.copy(os.path.join(src, "tokenizer.json"), dst)
  return dst


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan_layers"])
@pytest.mark.parametrize("ckpt", [LLAMA, QWEN2], ids=["llama_sharded", "qwen2"])
def test_logits_match_hf_golden(ckpt, scan):
  cfg = hf_loader.load_hf_config(ckpt, scan_layers=scan)
  params = hf_loader.load_hf_params(ckpt, cfg)
  assert ("layers" in params) == scan  # one stacked block under model.scan_layers
  ids, golden = _golden(ckpt)
  logits = _forward(cfg, params, ids)
  assert logits.shape == golden.shape
  np.testing.assert_array_less(np.abs(logits - golden).max(), 1e-4)
  assert golden.std() > 0.5  # the comparison is not between two near-constant outputs


def test_config_mapping():
  lcfg = hf_loader.load_hf_config(LLAMA)
  assert (lcfg.vocab_size, lcfg.hidden_size, lcfg.intermediate_size, lcfg.num_layers) == (
      128, 64, 128, 2)
  assert (lcfg.num_heads, lcfg.num_kv_heads, lcfg.head_dim_) == (4, 2, 32)
  assert (lcfg.rope_theta, lcfg.rms_norm_eps, lcfg.max_seq_len) == (500000.0, 1e-5, 256)
  assert not lcfg.tie_embeddings and not lcfg.qkv_bias and not lcfg.o_bias
  assert (lcfg.param_dtype, lcfg.dtype, lcfg.head) == ("float32", "float32", "lm")
  qcfg = hf_loader.load_hf_config(QWEN2, max_seq_len=64, dtype="bfloat16")
  assert qcfg.tie_embeddings and qcfg.qkv_bias and not qcfg.o_bias
  assert (qcfg.rope_theta, qcfg.rms_norm_eps, qcfg.head_dim_) == (1e6, 1e-6, 16)
  assert (qcfg.max_seq_len, qcfg.dtype, qcfg.param_dtype) == (64, "bfloat16", "float32")
  with pytest.raises(ValueError, match="unknown ModelConfig override.*max_len"):
    hf_loader.load_hf_config(QWEN2, max_len=64)


def test_legacy_config_fields_map_the_same():
  """transformers < 5 writes rope_theta/rope_scaling/torch_dtype instead of rope_parameters/dtype;
  a LLaMA with attention_bias gets biases on q/k/v and o."""
  with open(os.path.join(LLAMA, "config.json")) as f:
    hf = json.load(f)
  legacy = dict(hf, rope_theta=hf["rope_parameters"]["rope_theta"], rope_scaling=None,
                torch_dtype="bfloat16")
  del legacy["rope_parameters"], legacy["dtype"]
  cfg = hf_loader.config_from_hf(legacy)
  assert cfg == hf_loader.load_hf_config(LLAMA).replace(param_dtype="bfloat16", dtype="bfloat16")
  del legacy["head_dim"], legacy["num_key_value_heads"]  # absent in old configs: derived
  old = hf_loader.config_from_hf(legacy)
  assert (old.head_dim_, old.num_kv_heads) == (16, 4)
  biased = hf_loader.config_from_hf(dict(hf, attention_bias=True))
  assert biased.qkv_bias and biased.o_bias


def test_sharded_index_is_used_and_missing_shard_is_named(tmp_path):
  with open(os.path.join(LLAMA, "model.safetensors.index.json")) as f:
    shards = sorted(set(json.load(f)["weight_map"].values()))
  assert len(shards) >= 2 and not os.path.exists(os.path.join(LLAMA, "model.safetensors"))
  broken = str(tmp_path / "ckpt")
  shutil.copytree(LLAMA, broken)
  os.remove(os.path.join(broken, shards[-1]))
  with pytest.raises(FileNotFoundError, match=shards[-1]):
    hf_loader.load_hf_params(broken, hf_loader.load_hf_config(broken))
  empty = str(tmp_path / "empty")
  os.makedirs(empty)
  with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
    hf_loader.load_hf_params(empty, hf_loader.load_hf_config(LLAMA))


def test_missing_tensor_is_named(tmp_path):
  name = "model.layers.1.self_attn.k_proj.bias"
  ckpt = _copy(QWEN2, str(tmp_path / "c"), edit_tensors=lambda t: t.pop(name))
  with pytest.raises(ValueError, match=f"lacks tensor.*{name}"):
    hf_loader.load_hf_params(ckpt, hf_loader.load_hf_config(ckpt))


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
  name = "model.layers.0.mlp.up_proj.weight"
  def shrink(t):
    t[name] = t[name][:100]
  ckpt = _copy(LLAMA, str(tmp_path / "c"), edit_tensors=shrink)
  with pytest.raises(ValueError, match=rf"{name} has shape \[100, 64\].*expects \[128, 64\]"):
    hf_loader.load_hf_params(ckpt, hf_loader.load_hf_config(ckpt))


def test_unexpected_tensors_listed_but_inv_freq_is_harmless(tmp_path):
  def add(t):
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
  ok = _copy(QWEN2, str(tmp_path / "ok"), edit_tensors=add)
  cfg = hf_loader.load_hf_config(ok)
  params = hf_loader.load_hf_params(ok, cfg)
  ids, golden = _golden(QWEN2)
  np.testing.assert_array_less(np.abs(_forward(cfg, params, ids) - golden).max(), 1e-4)

  def add_bad(t):
    t["model.layers.0.mlp.gate_proj.bias"] = np.zeros(128, np.float32)
    t["model.extra.weight"] = np.zeros(3, np.float32)
  bad = _copy(QWEN2, str(tmp_path / "bad"), edit_tensors=add_bad)
  with pytest.raises(ValueError, match="does not use.*model.extra.weight.*gate_proj.bias"):
    hf_loader.load_hf_params(bad, cfg)


def test_tied_lm_head_copy_must_equal_embedding(tmp_path):
  def tie(t):
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
  same = _copy(QWEN2, str(tmp_path / "same"), edit_tensors=tie)
  params = hf_loader.load_hf_params(same, hf_loader.load_hf_config(same))
  assert "lm_head" not in params["head"]

  def untie(t):
    t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1.0
  differ = _copy(QWEN2, str(tmp_path / "differ"), edit_tensors=untie)
  with pytest.raises(ValueError, match="lm_head.weight differs"):
    hf_loader.load_hf_params(differ, hf_loader.load_hf_config(differ))


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(architectures=["MistralForCausalLM"]), r"architectures=\['Mistral"),
    (lambda c: (c.pop("architectures"), c.update(model_type="gpt2")), "model_type='gpt2'"),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                         "rope_theta": 5e5}), "rope_parameters.*'llama3'"),
    (lambda c: (c.pop("rope_parameters"), c.update(rope_theta=1e4, rope_scaling={
        "type": "linear", "factor": 2.0})), "rope_scaling.*'linear'"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu'"),
    (lambda c: c.update(mlp_bias=True), "mlp_bias"),
    (lambda c: c.pop("intermediate_size"), r"missing required field\(s\) \['intermediate_size'\]"),
], ids=["architecture", "model_type", "rope_llama3", "rope_scaling_linear", "act", "mlp_bias",
        "missing_field"])
def test_unsupported_config_names_the_field(tmp_path, edit, match):
  with open(os.path.join(LLAMA, "config.json")) as f:
    config = json.load(f)
  edit(config)
  ckpt = tmp_path / "c"
  ckpt.mkdir()
  (ckpt / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=match):
    hf_loader.load_hf_config(str(ckpt))


def test_sliding_window_only_rejected_when_it_bites():
  with open(os.path.join(QWEN2, "config.json")) as f:
    hf = json.load(f)
  hf.pop("layer_types")  # transformers < 5 derives it from use_sliding_window/max_window_layers
  on = dict(hf, use_sliding_window=True, sliding_window=128, max_window_layers=1)
  with pytest.raises(ValueError, match=r"sliding_window=128 is used by layers \[1\]"):
    hf_loader.config_from_hf(on)  # max_position_embeddings=256 > 128
  assert hf_loader.config_from_hf(on, max_seq_len=128).max_seq_len == 128
  assert hf_loader.config_from_hf(dict(on, max_window_layers=2)).max_seq_len == 256
  assert hf_loader.config_from_hf(dict(on, use_sliding_window=False)).max_seq_len == 256
  v5 = dict(hf, sliding_window=64, layer_types=["sliding_attention", "full_attention"])
  with pytest.raises(ValueError, match=r"sliding_window=64 is used by layers \[0\]"):
    hf_loader.config_from_hf(v5)


@pytest.mark.parametrize("ckpt", [LLAMA, QWEN2], ids=["llama", "qwen2"])
def test_save_load_round_trip_is_exact(tmp_path, ckpt):
  cfg = hf_loader.load_hf_config(ckpt)
  params = hf_loader.load_hf_params(ckpt, cfg)
  out = str(tmp_path / "export")
  hf_loader.save_hf_checkpoint(jax.tree.map(jax.numpy.asarray, params), cfg, out)
  assert hf_loader.load_hf_config(out) == cfg
  again = hf_loader.load_hf_params(out, cfg)
  assert jax.tree.structure(again) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  # The export holds exactly the HF tensors of the source, bit for bit.
  src, dst = _read_tensors(ckpt), _read_tensors(out)
  assert sorted(src) == sorted(dst)
  assert all(np.array_equal(src[k], dst[k]) for k in src)


def test_scan_layers_export_is_the_same_checkpoint(tmp_path):
  cfg = hf_loader.load_hf_config(LLAMA, scan_layers=True)
  params = hf_loader.load_hf_params(LLAMA, cfg)
  out = str(tmp_path / "export")
  hf_loader.save_hf_checkpoint(params, cfg, out)
  src, dst = _read_tensors(LLAMA), _read_tensors(out)
  assert sorted(src) == sorted(dst) and all(np.array_equal(src[k], dst[k]) for k in src)


def test_scalar_head_from_lm_checkpoint(tmp_path):
  cfg = hf_loader.load_hf_config(LLAMA, head="scalar")
  lm = hf_loader.load_hf_params(LLAMA, cfg.replace(head="lm"))
  with pytest.raises(ValueError, match="no score.weight; pass rng="):
    hf_loader.load_hf_params(LLAMA, cfg)
  critic = hf_loader.load_hf_params(LLAMA, cfg, rng=jax.random.key(3))
  assert critic["head"]["value_head"].shape == (64, 1)
  assert np.all(critic["head"]["value_bias"] == 0) and critic["head"]["value_head"].std() > 0
  assert np.array_equal(critic["head"]["value_head"],
                        hf_loader.load_hf_params(LLAMA, cfg, rng=jax.random.key(3))["head"][
                            "value_head"])
  for key in [k for k in lm if k != "head"]:
    assert jax.tree.all(jax.tree.map(np.array_equal, lm[key], critic[key]))
  values = _forward(cfg, critic, _golden(LLAMA)[0])
  assert values.shape == (2, 16)

  # Exported as LlamaForSequenceClassification (score.weight, score.bias) and read back.
  critic["head"]["value_bias"] = np.full((1,), 0.5, np.float32)
  out = str(tmp_path / "critic")
  hf_loader.save_hf_checkpoint(critic, cfg, out)
  assert json.load(open(os.path.join(out, "config.json")))["architectures"] == [
      "LlamaForSequenceClassification"]
  back = hf_loader.load_hf_params(out, hf_loader.load_hf_config(out))
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(critic), jax.tree.leaves(back)))


def test_sequence_classification_score_is_the_value_head(tmp_path):
  """With score.weight = row k of the (tied) LM head, values equal HF's logits[..., k]."""
  k = 7
  def add_score(t):
    t["score.weight"] = t["model.embed_tokens.weight"][k:k + 1].copy()  # [1, hidden]
  ckpt = _copy(QWEN2, str(tmp_path / "rm"), edit_tensors=add_score,
               edit_config=lambda c: c.update(architectures=["Qwen2ForSequenceClassification"]))
  cfg = hf_loader.load_hf_config(ckpt)
  assert cfg.head == "scalar"
  values = _forward(cfg, hf_loader.load_hf_params(ckpt, cfg), _golden(QWEN2)[0])
  np.testing.assert_array_less(np.abs(values - _golden(QWEN2)[1][..., k]).max(), 1e-4)


def test_bf16_checkpoint_close_to_fp32(tmp_path):
  def to_bf16(t):
    for name in t:
      t[name] = t[name].astype(ml_dtypes.bfloat16)
  ckpt = _copy(LLAMA, str(tmp_path / "bf16"), edit_tensors=to_bf16,
               edit_config=lambda c: c.update(dtype="bfloat16"))
  cfg = hf_loader.load_hf_config(ckpt)
  assert (cfg.param_dtype, cfg.dtype) == ("bfloat16", "bfloat16")
  params = hf_loader.load_hf_params(ckpt, cfg)
  assert {a.dtype for a in jax.tree.leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}
  ids, golden = _golden(LLAMA)
  logits = _forward(cfg, params, ids)
  assert np.abs(logits - golden).max() < 0.1 * np.abs(golden).max()
  assert np.corrcoef(logits.ravel(), golden.ravel())[0, 1] > 0.99
  # Casting an fp32 checkpoint on load gives the same bf16 weights.
  cast = hf_loader.load_hf_params(LLAMA, cfg, dtype="bfloat16")
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(cast)))


def test_tokenizer_round_trip():
  tok = hf_loader.load_hf_tokenizer(QWEN2)
  text = "the critic predicts the value of every token"
  ids = tok.encode(text, add_bos=False)
  assert tok.decode(ids) == text
  assert max(ids) < hf_loader.load_hf_config(QWEN2).vocab_size
  assert (tok.eos_id, tok.bos_id) == (tok.token_to_id("</s>"), tok.token_to_id("<s>"))
  assert tok.encode(text, add_bos=True) == [tok.bos_id] + ids
  # The golden sequence starts with the tokenized first training sentence after BOS.
  golden_ids = _golden(QWEN2)[0][0]
  first = tok.encode("the quick brown fox", add_bos=True)
  assert list(golden_ids[:len(first)]) == first
