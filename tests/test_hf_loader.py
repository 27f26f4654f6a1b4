"""HF checkpoint loading against the committed tiny fixtures (see tests/make_tiny_checkpoint.py).

No torch or transformers at test time: golden logits were recorded from HF once. Broken
checkpoints are built in tmp_path by editing config.json or re-saving the safetensors.
"""
import dataclasses
import errno
import functools
import glob
import json
import math
import os
import re
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from jax.sharding import PartitionSpec as P

from rlhfuse_jax import workdir as wdlib
from rlhfuse_jax.data.tokenizer import HFTokenizer
from rlhfuse_jax.models import hf_loader, llama
from rlhfuse_jax.pipeline import executor
from rlhfuse_jax.sim import shapes

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LLAMA = os.path.join(FIXTURES, "tiny_llama")  # sharded, untied, head_dim != hidden / heads
QWEN2 = os.path.join(FIXTURES, "tiny_qwen2")  # single file, q/k/v biases, tied embeddings
LLAMA3 = os.path.join(FIXTURES, "tiny_llama3")  # rope_type "llama3", tied embeddings
QWEN3 = os.path.join(FIXTURES, "tiny_qwen3")  # q/k RMSNorm, head_dim 32 != 64 / 4, no biases
QWEN2_5 = os.path.join(FIXTURES, "tiny_qwen2_5")  # Qwen2ForCausalLM, untied (Qwen2.5 7B+)
MISTRAL = os.path.join(FIXTURES, "tiny_mistral")  # sliding_window 4096 > 256 positions
# architecture (as in docs/results.md's parity table) -> fixture; HF class / family it checks
CHECKPOINTS = {"llama": LLAMA, "qwen2": QWEN2, "llama3": LLAMA3, "qwen3": QWEN3,
               "qwen2_5": QWEN2_5, "mistral": MISTRAL}
FAMILY = {"llama": "llama", "qwen2": "qwen2", "llama3": "llama", "qwen3": "qwen3",
          "qwen2_5": "qwen2", "mistral": "mistral"}


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
@pytest.mark.parametrize("arch", list(CHECKPOINTS))
def test_logits_match_hf_golden(arch, scan):
  """The parity table of docs/results.md: `pytest tests/test_hf_loader.py -k golden -rP`
  prints one PARITY line per architecture and layer form."""
  ckpt = CHECKPOINTS[arch]
  cfg = hf_loader.load_hf_config(ckpt, scan_layers=scan)
  params = hf_loader.load_hf_params(ckpt, cfg)
  assert ("layers" in params) == scan  # one stacked block under model.scan_layers
  ids, golden = _golden(ckpt)
  logits = _forward(cfg, params, ids)
  assert logits.shape == golden.shape
  diff = np.abs(logits - golden).max()
  print(f"PARITY {arch} {'scan_layers' if scan else 'unrolled'} max|logit diff| = {diff:.1e}")
  np.testing.assert_array_less(diff, 1e-4)
  assert golden.std() > 0.5  # the comparison is not between two near-constant outputs


def test_llama3_rope_scaling_bands_and_effect():
  """The fixture's 8 RoPE frequencies fall in all three bands of the llama3 rule (wavelength
  < 64/4 kept, > 64/1 divided by 8, blended between), and ignoring the scaling moves the
  logits far beyond the parity tolerance, so the golden test checks the scaling."""
  cfg = hf_loader.load_hf_config(LLAMA3)
  assert (cfg.rope_type, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
          cfg.rope_original_max_len, cfg.rope_theta) == ("llama3", 8.0, 1.0, 4.0, 64, 5e5)
  plain = np.asarray(llama.rope_frequencies(cfg.replace(rope_type="default")))
  scaled = np.asarray(llama.rope_frequencies(cfg))
  wavelen = 2 * np.pi / plain
  kept, divided = wavelen < 16, wavelen > 64
  blended = ~kept & ~divided
  assert kept.any() and divided.any() and blended.any()
  np.testing.assert_array_equal(scaled[kept], plain[kept])
  np.testing.assert_allclose(scaled[divided], plain[divided] / 8, rtol=1e-6)
  assert np.all((scaled[blended] < plain[blended]) & (scaled[blended] > plain[blended] / 8))
  params = hf_loader.load_hf_params(LLAMA3, cfg)
  ids, golden = _golden(LLAMA3)
  unscaled = _forward(cfg.replace(rope_type="default"), params, ids)
  assert np.abs(unscaled - golden).max() > 0.1


def test_qwen3_qk_norm_is_loaded_and_counted():
  """q_norm / k_norm gains are read per layer (unit gains would miss the golden), and the
  parameter count of the model, of ModelConfig.num_params and of the simulator's shape agree."""
  cfg = hf_loader.load_hf_config(QWEN3)
  params = hf_loader.load_hf_params(QWEN3, cfg)
  attn = params["layers_1"]["attn"]
  assert attn["q_norm"]["scale"].shape == attn["k_norm"]["scale"].shape == (32,)
  assert "bias" not in attn["q_proj"] and "bias" not in attn["o_proj"]
  assert attn["q_proj"]["kernel"].shape == (64, 4 * 32)
  n = sum(x.size for x in jax.tree.leaves(params))
  assert n == cfg.num_params() == shapes.from_model_config(cfg).num_params()
  assert n - cfg.replace(qk_norm=False).num_params() == 2 * 2 * 32  # 2 layers x (q, k) x dim
  for biased in (cfg.replace(o_bias=True), cfg.replace(qkv_bias=True, o_bias=True)):
    built = llama.param_shapes(biased)  # o_proj's bias was not counted
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(built)) == biased.num_params()
  ones = jax.tree.map(np.asarray, params)
  for layer in ("layers_0", "layers_1"):
    for norm in ("q_norm", "k_norm"):
      ones[layer]["attn"][norm]["scale"] = np.ones(32, np.float32)
  ids, golden = _golden(QWEN3)
  assert np.abs(_forward(cfg, ones, ids) - golden).max() > 0.1


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_cached_decode_matches_hf_golden(arch):
  """Prefill 12 tokens into the KV cache, then decode the last 4 one at a time: the scaled
  RoPE and the normalised keys are cached and read back as the full forward computes them."""
  ckpt = CHECKPOINTS[arch]
  cfg = hf_loader.load_hf_config(ckpt)
  params = hf_loader.load_hf_params(ckpt, cfg)
  ids, golden = _golden(ckpt)
  positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
  step = jax.jit(lambda p, t, pos, c: llama.apply(cfg, p, t, pos, c))
  out, cache = step(params, ids[:, :12], positions[:, :12], llama.KVCache.zeros(cfg, 2, 16))
  logits = [np.asarray(out)]
  for t in range(12, ids.shape[1]):
    out, cache = step(params, ids[:, t:t + 1], positions[:, t:t + 1], cache)
    logits.append(np.asarray(out))
  np.testing.assert_array_less(np.abs(np.concatenate(logits, axis=1) - golden).max(), 1e-4)


def test_qk_norm_gradients_under_tensor_parallelism():
  """The pipeline executor's Megatron split of a Qwen3 layer over tensor=2 (its layer_splits and
  local_config, llama.tensor_parallel): each device normalises only its own heads, so the
  replicated q/k norm gains get their full gradient only through the sum over `tensor` that
  RMSNorm(per_head=True) adds. All gradients equal those of the unsplit layer."""
  cfg = hf_loader.load_hf_config(QWEN3)
  layer = jax.tree.map(jax.numpy.asarray, hf_loader.load_hf_params(QWEN3, cfg)["layers_0"])
  rng = np.random.default_rng(0)
  x = jax.numpy.asarray(rng.normal(size=(2, 8, 64)), jax.numpy.float32)
  w = jax.numpy.asarray(rng.normal(size=(2, 8, 64)), jax.numpy.float32)
  positions = jax.numpy.broadcast_to(jax.numpy.arange(8), (2, 8))

  def loss(c, p):
    return jax.numpy.sum(llama.Block(c).apply({"params": p}, x, positions)[0] * w)

  fast = {"xla_backend_optimization_level": 0}  # tiny programs: compile time dominates
  want = jax.jit(jax.grad(lambda p: loss(cfg, p)), compiler_options=fast)(layer)
  splits = executor.layer_splits(cfg, 1, 2)
  specs = jax.tree.map(lambda s: P(*s.dims), splits)
  assert specs["attn"]["q_proj"]["kernel"] == P(None, "tensor")
  assert specs["attn"]["q_norm"]["scale"] == P(None)  # replicated on both tensor devices
  local = executor.local_config(cfg, 2)

  def body(p):
    with llama.tensor_parallel("tensor"):
      return jax.grad(lambda q: loss(local, q))(p)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tensor",))
  got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=specs,
                              check_vma=False), compiler_options=fast)(layer)
  for path, g in jax.tree_util.tree_leaves_with_path(got):
    ref = functools.reduce(lambda t, k: t[k.key], path, want)
    np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=2e-5, atol=2e-5,
                               err_msg=jax.tree_util.keystr(path))


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
  q3 = hf_loader.load_hf_config(QWEN3)
  assert q3.qk_norm and not q3.qkv_bias and not q3.o_bias and q3.tie_embeddings
  assert (q3.head_dim, q3.head_dim_, q3.rope_type, q3.rope_theta) == (32, 32, "default", 1e6)
  q25 = hf_loader.load_hf_config(QWEN2_5)
  assert q25.qkv_bias and not q25.o_bias and not q25.tie_embeddings and not q25.qk_norm
  mistral = hf_loader.load_hf_config(MISTRAL)
  assert mistral == lcfg.replace(head_dim=0, rope_theta=1e6)  # LLaMA with its own shapes
  assert not lcfg.qk_norm and lcfg.rope_type == "default"


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
  # A null "dtype" beside a "torch_dtype" does not hide it; errors name the key that was read.
  assert hf_loader.config_from_hf(dict(hf, dtype=None, torch_dtype="bfloat16")).dtype == "bfloat16"
  with pytest.raises(ValueError, match=r": dtype='float8'; expected one of"):
    hf_loader.config_from_hf(dict(hf, dtype="float8"))


def test_absent_config_fields_take_transformers_defaults():
  """A config.json may omit what its HF config class defaults (LlamaConfig, Qwen2Config,
  MistralConfig and Qwen3Config all have rms_norm_eps=1e-6, rope_theta=10000.0,
  tie_word_embeddings=False); the fixtures set every field, so a wrong default here would
  load a model computing other logits without any test noticing. Where rope_parameters and a
  stale top-level rope_theta both appear, rope_parameters' value is the one used."""
  with open(os.path.join(LLAMA, "config.json")) as f:
    hf = json.load(f)
  for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"):
    bare = {k: v for k, v in hf.items() if k not in (
        "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "tie_word_embeddings")}
    bare["architectures"] = [arch]
    cfg = hf_loader.config_from_hf(bare)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.tie_embeddings) == (1e-6, 10000.0, False)
  both = dict(hf, rope_theta=10000.0)  # rope_parameters says 500000
  assert hf_loader.config_from_hf(both).rope_theta == 500000.0


def test_sharded_index_is_used_and_missing_shard_is_named(tmp_path):
  with open(os.path.join(LLAMA, "model.safetensors.index.json")) as f:
    shards = sorted(set(json.load(f)["weight_map"].values()))
  assert len(shards) >= 2 and not os.path.exists(os.path.join(LLAMA, "model.safetensors"))
  broken = str(tmp_path / "ckpt")
  shutil.copytree(LLAMA, broken)
  os.remove(os.path.join(broken, shards[-1]))
  with pytest.raises(FileNotFoundError, match=shards[-1]):
    hf_loader.load_hf_params(broken, hf_loader.load_hf_config(broken))
  # An index that names the wrong shard for a tensor: the error names the shard, the tensor and
  # the index (it was safetensors' bare "File does not contain tensor ...").
  lying = str(tmp_path / "lying")
  shutil.copytree(LLAMA, lying)
  index = os.path.join(lying, "model.safetensors.index.json")
  with open(index) as f:
    table = json.load(f)
  name = sorted(table["weight_map"])[0]
  other = next(s for s in shards if s != table["weight_map"][name])
  table["weight_map"][name] = other
  with open(index, "w") as f:
    json.dump(table, f)
  with pytest.raises(ValueError, match=rf"{other}: cannot read tensor {name} .*"
                                       r"model\.safetensors\.index\.json may name the wrong"):
    hf_loader.load_hf_params(lying, hf_loader.load_hf_config(lying))
  # A shard that is not a file name (it was os.path.join's TypeError, naming nothing).
  table["weight_map"][name] = None
  with open(index, "w") as f:
    json.dump(table, f)
  with pytest.raises(ValueError, match=rf"model.safetensors.index.json: weight_map names no "
                                       rf"shard file for {name} .*None"):
    hf_loader.load_hf_params(lying, hf_loader.load_hf_config(lying))
  empty = str(tmp_path / "empty")
  os.makedirs(empty)
  with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
    hf_loader.load_hf_params(empty, hf_loader.load_hf_config(LLAMA))


def test_a_shard_tensor_the_index_does_not_list_is_refused(tmp_path):
  """A stale index (a shard rewritten with one more layer's tensor, the index not) loaded the
  listed tensors and dropped the rest without a word; the loader reads only what the index
  names, so the shards' own headers are checked against it."""
  stale = str(tmp_path / "stale")
  shutil.copytree(LLAMA, stale)
  with open(os.path.join(stale, "model.safetensors.index.json")) as f:
    shard = sorted(set(json.load(f)["weight_map"].values()))[0]
  tensors = safetensors.numpy.load_file(os.path.join(stale, shard))
  extra = "model.layers.9.mlp.up_proj.weight"
  tensors[extra] = np.zeros((2, 2), np.float32)
  safetensors.numpy.save_file(tensors, os.path.join(stale, shard), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=rf"{shard}: holds tensor\(s\) that "
                     rf"model.safetensors.index.json does not list: {extra}"):
    hf_loader.load_hf_params(stale, hf_loader.load_hf_config(stale))


def test_a_shard_the_index_does_not_name_is_pointed_at(tmp_path):
  """A shard left out of the index (its tensors removed from weight_map) was not read, so its
  tensors were reported missing with no hint that the file holding them is right there."""
  stale = str(tmp_path / "stale")
  shutil.copytree(LLAMA, stale)
  path = os.path.join(stale, "model.safetensors.index.json")
  with open(path) as f:
    index = json.load(f)
  shard = sorted(set(index["weight_map"].values()))[-1]
  gone = sorted(n for n, s in index["weight_map"].items() if s == shard)
  index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s != shard}
  with open(path, "w") as f:
    json.dump(index, f)
  with pytest.raises(ValueError, match=rf"lacks tensor\(s\) the config needs: .*\({shard} in "
                     rf"the directory holds .*{re.escape(gone[0])}.*, but "
                     r"model\.safetensors\.index\.json does not name it: a stale index\?\)"):
    hf_loader.load_hf_params(stale, hf_loader.load_hf_config(stale))


def test_missing_tensor_is_named(tmp_path):
  name = "model.layers.1.self_attn.k_proj.bias"
  ckpt = _copy(QWEN2, str(tmp_path / "c"), edit_tensors=lambda t: t.pop(name))
  with pytest.raises(ValueError, match=f"lacks tensor.*{name}"):
    hf_loader.load_hf_params(ckpt, hf_loader.load_hf_config(ckpt))


def test_a_checkpoint_path_that_is_a_file_or_a_hub_id_says_what_is_expected(tmp_path,
                                                                            monkeypatch):
  """A weights file given for the checkpoint, or a hub id (nothing is downloaded), said only
  '.../config.json not found'."""
  with pytest.raises(FileNotFoundError, match=r"index\.json' is a file: expected the "
                     "checkpoint's directory"):
    hf_loader.load_hf_config(os.path.join(LLAMA, "model.safetensors.index.json"))
  monkeypatch.chdir(tmp_path)
  with pytest.raises(FileNotFoundError, match=r"expected a local checkpoint directory \(a hub id "
                     r"is not downloaded: `hf download meta-llama/Llama-3\.2-1B --local-dir"):
    hf_loader.load_hf_config("meta-llama/Llama-3.2-1B")
  with pytest.raises(FileNotFoundError, match=r"nope/x/config\.json not found$"):
    hf_loader.load_hf_config(str(tmp_path / "nope" / "x"))


def test_a_missing_lm_head_suggests_tied_embeddings(tmp_path):
  ckpt = _copy(LLAMA, str(tmp_path / "c"), edit_tensors=lambda t: t.pop("lm_head.weight"))
  with pytest.raises(ValueError, match=r"lacks tensor.*lm_head\.weight \(its config\.json says "
                     r"tie_word_embeddings=false"):
    hf_loader.load_hf_params(ckpt, hf_loader.load_hf_config(ckpt))


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
  name = "model.layers.0.mlp.up_proj.weight"
  def shrink(t):
    t[name] = t[name][:100]
  ckpt = _copy(LLAMA, str(tmp_path / "c"), edit_tensors=shrink)
  with pytest.raises(ValueError, match=rf"{name} has shape \[100, 64\].*expects \[128, 64\]"):
    hf_loader.load_hf_params(ckpt, hf_loader.load_hf_config(ckpt))


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.bool_])
def test_a_tensor_that_is_not_floating_point_is_refused(tmp_path, dtype):
  """An int8 (quantized) or bool tensor of the right shape was cast to float and loaded: a
  garbage model without a word. Its file, name and dtype are named."""
  name = "model.layers.0.mlp.up_proj.weight"
  def quantize(t):
    t[name] = (t[name] * 100).astype(dtype)
  ckpt = _copy(LLAMA, str(tmp_path / "c"), edit_tensors=quantize)
  with pytest.raises(ValueError, match=rf"model.safetensors: tensor {name} has dtype "
                     rf"{np.dtype(dtype).name}; expected one of"):
    hf_loader.load_hf_params(ckpt, hf_loader.load_hf_config(ckpt))


def test_an_fp8_tensor_is_refused_as_quantized_not_blamed_on_the_index(tmp_path):
  """numpy holds no float8: reading one raised inside safetensors, and the error said the
  single-file checkpoint's model.safetensors.index.json 'may name the wrong shard for it'."""
  name = "model.layers.0.mlp.up_proj.weight"
  def fp8(t):
    t[name] = t[name].astype(ml_dtypes.float8_e4m3fn)
  ckpt = _copy(LLAMA, str(tmp_path / "c"), edit_tensors=fp8)
  with pytest.raises(ValueError, match=rf"model.safetensors: tensor {name} has dtype F8_E4M3; "
                     r"expected one of .* \(quantized checkpoints are not supported\)$"):
    hf_loader.load_hf_params(ckpt, hf_loader.load_hf_config(ckpt))


def test_a_quantized_checkpoint_is_refused_naming_its_quantization_config(tmp_path):
  """A GPTQ checkpoint (qweight/scales in place of each projection's weight, as Qwen publishes
  its -GPTQ-Int4 models) was refused for "lacking" model.layers.0.mlp.down_proj.weight, ...:
  nothing said it was quantized. config.json's quantization_config says it first."""
  def gptq(t):
    for name in [n for n in t if n.endswith("proj.weight")]:
      w = t.pop(name)
      t[name[:-len("weight")] + "qweight"] = np.zeros((w.shape[1] // 8, w.shape[0]), np.int32)
      t[name[:-len("weight")] + "scales"] = np.ones((1, w.shape[0]), np.float16)
  ckpt = _copy(QWEN2, str(tmp_path / "c"), edit_tensors=gptq, edit_config=lambda c: c.update(
      quantization_config={"quant_method": "gptq", "bits": 4}))
  with pytest.raises(ValueError, match=r"c/config\.json: quantization_config is set "
                     r"\(quant_method='gptq'\): quantized checkpoints are not supported"):
    hf_loader.load_hf_config(ckpt)
  with open(os.path.join(QWEN2, "config.json")) as f:  # null: no quantization
    assert hf_loader.config_from_hf(dict(json.load(f), quantization_config=None)).qkv_bias


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


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(architectures=["Qwen3MoeForCausalLM"]), r"architectures=\['Qwen3Moe"),
    (lambda c: (c.pop("architectures"), c.update(model_type="gpt2")), "model_type='gpt2'"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}),
     "rope_parameters has rope_type='yarn'.*implemented: \\['default', 'llama3'\\]"),
    (lambda c: (c.pop("rope_parameters"), c.update(rope_theta=1e4, rope_scaling={
        "type": "linear", "factor": 2.0})), "rope_scaling has rope_type='linear'"),
    (lambda c: c.update(rope_parameters={k: v for k, v in _LLAMA3_ROPE.items()
                                         if k != "low_freq_factor"}),
     r"rope_parameters with rope_type='llama3' lacks \['low_freq_factor'\]"),
    (lambda c: c.update(rope_parameters=dict(_LLAMA3_ROPE, high_freq_factor=1.0)),
     "high_freq_factor=1.0.*0 < low_freq_factor < high_freq_factor"),
    (lambda c: c.update(rope_parameters=dict(_LLAMA3_ROPE, attention_factor=1.2)),
     r"rope_parameters has key\(s\) \['attention_factor'\]"),
    (lambda c: c.update(rope_scaling=_LLAMA3_ROPE),
     "rope_parameters and rope_scaling disagree on rope_type \\('default' vs 'llama3'\\)"),
    (lambda c: c.update(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                         "partial_rotary_factor": 0.25}),
     "rope_parameters.partial_rotary_factor=0.25"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu'"),
    (lambda c: c.update(mlp_bias=True), "mlp_bias"),
    (lambda c: c.pop("intermediate_size"), r"missing required field\(s\) \['intermediate_size'\]"),
], ids=["architecture", "model_type", "rope_yarn", "rope_scaling_linear", "llama3_missing_key",
        "llama3_bad_factors", "llama3_unknown_key", "rope_fields_disagree",
        "partial_rotary", "partial_rotary_in_rope", "act", "mlp_bias", "missing_field"])
def test_unsupported_config_names_the_field(tmp_path, edit, match):
  with open(os.path.join(LLAMA, "config.json")) as f:
    config = json.load(f)
  edit(config)
  ckpt = tmp_path / "c"
  ckpt.mkdir()
  (ckpt / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=match):
    hf_loader.load_hf_config(str(ckpt))


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(tie_word_embeddings="false"),
     r"tie_word_embeddings='false' \(str\); expected true or false"),
    (lambda c: c.update(hidden_size=64.5), r"hidden_size=64.5 \(float\); expected an integer"),
    (lambda c: c.update(num_hidden_layers=True), "num_hidden_layers=True"),
    (lambda c: c.update(rms_norm_eps=None), "rms_norm_eps=null; expected a number"),
    (lambda c: c.update(rope_theta=None, rope_parameters={"rope_type": "default",
                                                          "rope_theta": None}),
     "rope_theta=null and no rope_parameters.rope_theta"),
    (lambda c: c.update(rope_parameters=dict(_LLAMA3_ROPE, factor="8")),
     r"rope_parameters.factor='8' \(str\); expected a number"),
    (lambda c: c.update(layer_types="full_attention"), "layer_types='full_attention'"),
    (lambda c: c.update(num_key_value_heads=3), "model.num_heads=4 must be a multiple of "
     "model.num_kv_heads=3"),
], ids=["bool_string", "int_float", "int_bool", "null_eps", "null_theta", "rope_string",
        "layer_types_string", "bad_heads"])
def test_a_config_field_of_the_wrong_type_is_refused_naming_the_file(edit, match):
  """bool("false") is True, int(64.5) is 64, float(None) raised a TypeError naming nothing, and
  ModelConfig's own refusals did not say the value came from config.json."""
  with open(os.path.join(LLAMA, "config.json")) as f:
    config = json.load(f)
  edit(config)
  with pytest.raises(ValueError, match="^where/config.json: .*" + match):
    hf_loader.config_from_hf(config, "where/config.json")


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
  qwen3 = dict(v5, architectures=["Qwen3ForCausalLM"])  # Qwen3 reads the same fields
  with pytest.raises(ValueError, match=r"sliding_window=64 is used by layers \[0\]"):
    hf_loader.config_from_hf(qwen3)
  assert hf_loader.config_from_hf(qwen3, max_seq_len=64).qk_norm
  # Omitted keys read as transformers' Qwen2Config / Qwen3Config defaults: sliding_window 4096
  # (it was read as none: full attention where HF slides), max_window_layers 28 (read as 0).
  long = dict(hf, max_position_embeddings=8192, use_sliding_window=True)
  long.pop("sliding_window", None)
  long.pop("max_window_layers", None)
  for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    with pytest.raises(ValueError, match=r"sliding_window=4096 is used by layers \[1\]"):
      hf_loader.config_from_hf(dict(long, architectures=[arch], max_window_layers=1))
    assert hf_loader.config_from_hf(dict(long, architectures=[arch])).max_seq_len == 8192  # 28
    assert hf_loader.config_from_hf(dict(long, architectures=[arch], use_sliding_window=False,
                                         max_window_layers=1)).max_seq_len == 8192


def test_qwen3_without_head_dim_takes_transformers_default():
  """Qwen3Config's head_dim defaults to 128 (not hidden / heads, as LLaMA's): a config.json
  that omits it describes 128-wide heads."""
  with open(os.path.join(QWEN2, "config.json")) as f:
    hf = dict(json.load(f), architectures=["Qwen3ForCausalLM"])
  hf.pop("head_dim", None)
  cfg = hf_loader.config_from_hf(hf)
  assert cfg.head_dim_ == 128 != hf["hidden_size"] // hf["num_attention_heads"]
  assert hf_loader.config_from_hf(dict(hf, head_dim=8)).head_dim_ == 8


def test_mistral_window_binds_on_every_layer_unless_it_covers_max_seq_len():
  with open(os.path.join(MISTRAL, "config.json")) as f:
    hf = json.load(f)
  assert hf["sliding_window"] == 4096 and hf["max_position_embeddings"] == 256
  assert hf_loader.config_from_hf(hf).max_seq_len == 256
  assert hf_loader.config_from_hf(dict(hf, sliding_window=None)).max_seq_len == 256
  with pytest.raises(ValueError, match=r"sliding_window=128 is used by layers \[0, 1\] "
                                       r"\(model_type mistral\).*max_seq_len=256"):
    hf_loader.config_from_hf(dict(hf, sliding_window=128))
  assert hf_loader.config_from_hf(dict(hf, sliding_window=128), max_seq_len=128).max_seq_len == 128
  # Absent (not null), transformers' MistralConfig defaults the window to 4096, and so do we.
  absent = {k: v for k, v in hf.items() if k != "sliding_window"}
  with pytest.raises(ValueError, match=r"sliding_window=4096 is used by layers \[0, 1\]"):
    hf_loader.config_from_hf(absent, max_seq_len=8192)
  assert hf_loader.config_from_hf(absent, max_seq_len=4096).max_seq_len == 4096
  # LLaMA has no sliding window: a stray field does not change its attention in HF either.
  with open(os.path.join(LLAMA, "config.json")) as f:
    assert hf_loader.config_from_hf(dict(json.load(f), sliding_window=8)).max_seq_len == 256


# config.json fields that decide the computation; an export must state them as the source does
# (transformers' legacy spelling: rope_theta + rope_scaling instead of rope_parameters).
_SAME_FIELDS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_act", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
                "mlp_bias", "max_position_embeddings")


@pytest.mark.parametrize("arch", list(CHECKPOINTS))
def test_save_load_round_trip_is_exact(tmp_path, arch):
  """Export -> our loader gives the same config, the same parameters and so the same logits;
  the exported tensors are the fixture's, name for name and bit for bit, and its config.json
  says what the fixture's says (transformers loads these exports and reproduces golden.npz
  exactly: checked once with the versions of make_tiny_checkpoint.py, docs/results.md)."""
  ckpt = CHECKPOINTS[arch]
  cfg = hf_loader.load_hf_config(ckpt)
  params = hf_loader.load_hf_params(ckpt, cfg)
  out = str(tmp_path / "export")
  hf_loader.save_hf_checkpoint(jax.tree.map(jax.numpy.asarray, params), cfg, out,
                               family=FAMILY[arch])
  assert hf_loader.load_hf_config(out) == cfg
  again = hf_loader.load_hf_params(out, cfg)
  assert jax.tree.structure(again) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  # The export holds exactly the HF tensors of the source, bit for bit, in files any user may
  # read as a plain open() would make them (safetensors wrote 0600: a serving job of another
  # user could not load the weights), and no temporary file is left.
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  assert os.stat(os.path.join(out, "model.safetensors")).st_mode & 0o777 == wdlib.PLAIN_FILE_MODE
  src, dst = _read_tensors(ckpt), _read_tensors(out)
  assert sorted(src) == sorted(dst)
  assert all(np.array_equal(src[k], dst[k]) for k in src)
  with open(os.path.join(ckpt, "config.json")) as f:
    want = json.load(f)
  with open(os.path.join(out, "config.json")) as f:
    got = json.load(f)
  for field in _SAME_FIELDS:
    if field in want:
      assert got[field] == want[field], field
  rope = dict(want["rope_parameters"])
  assert got["rope_theta"] == rope.pop("rope_theta")
  assert (got["rope_scaling"] or {"rope_type": "default"}) == rope
  assert got["torch_dtype"] == want["dtype"] == "float32"
  if "sliding_window" in want or FAMILY[arch] != "llama":
    assert got["sliding_window"] is None  # transformers' MistralConfig would default to 4096
  ids = _golden(ckpt)[0]
  np.testing.assert_array_equal(_forward(cfg, again, ids), _forward(cfg, params, ids))


def test_a_failed_export_over_a_checkpoint_leaves_that_checkpoint(tmp_path, monkeypatch):
  """A full disk while config.json was written (in place, after the new weights had replaced
  the old) left a truncated config.json: neither the old checkpoint nor the new one loaded."""
  cfg = llama.ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1,
                          num_heads=2, num_kv_heads=1)
  out = str(tmp_path / "ckpt")
  old = llama.host_random_params(cfg, 0)
  hf_loader.save_hf_checkpoint(old, cfg, out)

  def full_disk(obj, f, **kwargs):
    f.write('{"archi')
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(hf_loader.json, "dump", full_disk)
  with pytest.raises(OSError, match="No space left"):
    hf_loader.save_hf_checkpoint(llama.host_random_params(cfg, 1), cfg, out)
  monkeypatch.undo()
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  assert hf_loader.load_hf_config(out) == cfg
  again = hf_loader.load_hf_params(out, cfg)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(again)))
  # Both files are on disk (fsynced) before either is renamed into place.
  synced, renamed = [], []
  monkeypatch.setattr(hf_loader.os, "fsync", lambda fd: synced.append(os.readlink(
      f"/proc/self/fd/{fd}")))
  monkeypatch.setattr(hf_loader.os, "replace", lambda a, b: (renamed.append(len(synced)),
                                                           os.rename(a, b)))
  hf_loader.save_hf_checkpoint(old, cfg, out)
  assert sorted(os.path.basename(p) for p in synced) == [".tmp_config.json",
                                                         ".tmp_model.safetensors"]
  assert renamed == [2, 2]


def test_a_full_disk_at_the_weights_is_an_os_error_naming_the_file(tmp_path):
  """safetensors' failed write (here past a file-size limit, EFBIG, as a full disk fails with
  ENOSPC) raised its SafetensorError, no OSError, which the run's handling of a full disk
  (train_ppo: exit 3) missed: now the OSError it wraps, naming the file; nothing is left."""
  import resource
  import signal
  cfg = llama.ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_layers=1,
                          num_heads=2, num_kv_heads=1)  # weights of ~120 kB, config.json < 1 kB
  out = str(tmp_path / "ckpt")
  params = llama.host_random_params(cfg, 0)
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (else it kills the process)
  resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, hard))
  try:
    with pytest.raises(OSError) as e:
      hf_loader.save_hf_checkpoint(params, cfg, out)
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, handler)
  assert (e.value.errno, e.value.filename) == (errno.EFBIG, os.path.join(out, "model.safetensors"))
  assert os.listdir(out) == []


def test_an_export_of_weights_the_loader_refuses_writes_nothing(tmp_path):
  """save_hf_checkpoint wrote NaN (diverged) or integer weights, which load_hf_params then
  refused: an export over a good one replaced it with one that does not load."""
  cfg = llama.ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1,
                          num_heads=2, num_kv_heads=1)
  out = str(tmp_path / "ckpt")
  good = llama.host_random_params(cfg, 0)
  hf_loader.save_hf_checkpoint(good, cfg, out)
  name, kernel = "model.layers.0.mlp.up_proj.weight", ("layers_0", "mlp", "up_proj", "kernel")
  for value, match in ((np.nan, "holds 1 non-finite value"), (None, "has dtype int32")):
    bad = jax.tree.map(np.array, good)
    w = bad[kernel[0]][kernel[1]][kernel[2]]
    if value is None:
      bad[kernel[0]][kernel[1]][kernel[2]] = {"kernel": w["kernel"].astype(np.int32)}
    else:
      w["kernel"][0, 0] = value
    with pytest.raises(ValueError, match=f"tensor {name} {match}"):
      hf_loader.save_hf_checkpoint(bad, cfg, out)
  again = hf_loader.load_hf_params(out, cfg)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(good), jax.tree.leaves(again)))


def test_export_family_defaults_and_refusals(tmp_path):
  """Without family= an export is named after what the config can tell: q/k norms -> Qwen3,
  q/k/v biases only -> Qwen2, else LLaMA (a Mistral without a binding window is one);
  a family that cannot express the config is refused before anything is written."""
  expect = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen2_5": "Qwen2ForCausalLM", "mistral": "LlamaForCausalLM"}
  for arch, ckpt in CHECKPOINTS.items():
    cfg = hf_loader.load_hf_config(ckpt)
    assert hf_loader.hf_config_dict(cfg)["architectures"] == [expect[arch]]
    critic = hf_loader.hf_config_dict(cfg.replace(head="scalar"), family=FAMILY[arch])
    assert critic["architectures"] == [expect[arch].replace("ForCausalLM",
                                                           "ForSequenceClassification")
                                       if arch != "mistral" else
                                       "MistralForSequenceClassification"]
    assert hf_loader.config_from_hf(critic) == cfg.replace(head="scalar")
    # A reward model's pad_token_id is where it scores (transformers pools at the last token
    # that is not it); a language model's is not read.
    rm = hf_loader.hf_config_dict(cfg.replace(head="scalar", score_pad_id=7), family=FAMILY[arch])
    assert rm["pad_token_id"] == 7
    assert hf_loader.config_from_hf(rm) == cfg.replace(head="scalar", score_pad_id=7)
    lm = hf_loader.hf_config_dict(cfg)
    assert "pad_token_id" not in lm
    assert hf_loader.config_from_hf(dict(lm, pad_token_id=7)).score_pad_id == -1
  with pytest.raises(ValueError, match=r"pad_token_id=-2; expected null or a token id >= 0"):
    hf_loader.config_from_hf(dict(hf_loader.hf_config_dict(cfg.replace(head="scalar")),
                                  pad_token_id=-2))
  q3 = hf_loader.load_hf_config(QWEN3)
  biased = hf_loader.hf_config_dict(q3.replace(qkv_bias=True, o_bias=True))
  assert biased["attention_bias"] and hf_loader.config_from_hf(biased).o_bias
  for cfg, family, match in [
      (q3, "qwen2", "qk_norm=True has no HF qwen2 equivalent"),
      (q3, "llama", "qk_norm=True has no HF llama equivalent"),
      (hf_loader.load_hf_config(QWEN2), "mistral", "qkv_bias=True.*no HF mistral"),
      (hf_loader.load_hf_config(LLAMA), "qwen3", "qk_norm=False has no HF qwen3 equivalent "
       r".*; this model is written as 'llama' \(export_hf='auto' picks it\)"),
      (hf_loader.load_hf_config(LLAMA), "gpt2", "family='gpt2'")]:
    with pytest.raises(ValueError, match=match):
      hf_loader.save_hf_checkpoint({}, cfg, str(tmp_path / "x"), family=family)
  assert not (tmp_path / "x").exists()
  with pytest.raises(ValueError, match="o_bias=True.*has no HF llama"):
    hf_loader.hf_config_dict(q3.replace(qk_norm=False, o_bias=True))


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
  # drawn as llama.init_params draws it: N(0, 0.02), zero bias (64 draws: std within ~10 %)
  assert np.all(critic["head"]["value_bias"] == 0)
  assert 0.015 < critic["head"]["value_head"].std() < 0.025
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
  """With score.weight = row k of the (tied) LM head, values equal HF's logits[..., k], plus
  score.bias where the checkpoint has one (our export writes a critic's value bias there: a
  critic whose learned bias were dropped on reload or in the head would be off by a constant,
  which shifts every advantage's bootstrap)."""
  k, bias = 7, 0.75
  def add_score(t):
    t["score.weight"] = t["model.embed_tokens.weight"][k:k + 1].copy()  # [1, hidden]
    t["score.bias"] = np.array([bias], np.float32)
  ckpt = _copy(QWEN2, str(tmp_path / "rm"), edit_tensors=add_score,
               edit_config=lambda c: c.update(architectures=["Qwen2ForSequenceClassification"]))
  cfg = hf_loader.load_hf_config(ckpt)
  assert cfg.head == "scalar"
  values = _forward(cfg, hf_loader.load_hf_params(ckpt, cfg), _golden(QWEN2)[0])
  np.testing.assert_array_less(np.abs(values - bias - _golden(QWEN2)[1][..., k]).max(), 1e-4)


def test_trl_and_openrlhf_value_heads_load_as_the_score_head(tmp_path):
  """TRL's AutoModelForCausalLMWithValueHead saves its head as v_head.summary.{weight,bias},
  OpenRLHF with another value_head_prefix as value_head.weight: both were refused ("tensor(s)
  this config does not use", or as a reward model "no score.weight ... not a language
  model's"). They load as the scalar head, their bias with them."""
  k, bias = 7, 0.75
  golden = _golden(QWEN2)
  for prefix, with_bias in (("v_head.summary", True), ("value_head", False)):
    def add_head(t, prefix=prefix, with_bias=with_bias):
      t[f"{prefix}.weight"] = t["model.embed_tokens.weight"][k:k + 1].copy()
      if with_bias:
        t[f"{prefix}.bias"] = np.array([bias], np.float32)
    ckpt = _copy(QWEN2, str(tmp_path / prefix), edit_tensors=add_head)
    cfg = hf_loader.load_hf_config(ckpt).replace(head="scalar")
    assert hf_loader.scalar_head_prefix(hf_loader.tensor_names(ckpt)) == prefix
    values = _forward(cfg, hf_loader.load_hf_params(ckpt, cfg), golden[0])
    shift = bias if with_bias else 0.0
    np.testing.assert_array_less(np.abs(values - shift - golden[1][..., k]).max(), 1e-4)
  # Two heads, or a bias of another writer's name beside the weight: refused (the first was
  # taken and the rest dropped silently).
  for i, extra in enumerate(({"score.weight": 3, "value_head.weight": 7},
                             {"value_head.weight": 7, "score.bias": None})):
    def add(t, extra=extra):
      for name, row in extra.items():
        t[name] = (np.array([bias], np.float32) if row is None else
                   t["model.embed_tokens.weight"][row:row + 1].copy())
    ckpt = _copy(QWEN2, str(tmp_path / f"two{i}"), edit_tensors=add)
    cfg = hf_loader.load_hf_config(ckpt).replace(head="scalar")
    with pytest.raises(ValueError, match=r"scalar head tensors of more than one writer: "):
      hf_loader.load_hf_params(ckpt, cfg)


def test_openrlhf_s_own_critic_and_reward_model_classes_load_as_scalar_heads(tmp_path):
  """OpenRLHF saves its critic and reward model through save_pretrained as classes of its own
  (architectures ["CriticModel"] / ["RewardModel"], model_type the backbone's, the head under
  value_head_prefix): both were refused as unsupported architectures. They load as the
  model_type's scalar head, scoring at the last token (OpenRLHF's rule) despite a
  pad_token_id."""
  k = 7
  golden = _golden(QWEN2)
  def add_head(t):
    t["value_head.weight"] = t["model.embed_tokens.weight"][k:k + 1].copy()
  for arch in ("CriticModel", "RewardModel"):
    ckpt = _copy(QWEN2, str(tmp_path / arch), edit_tensors=add_head,
                 edit_config=lambda c, arch=arch: c.update(
                     architectures=[arch], value_head_prefix="value_head", pad_token_id=0))
    cfg = hf_loader.load_hf_config(ckpt)
    assert (cfg.head, cfg.score_pad_id, cfg.qkv_bias) == ("scalar", -1, True)
    assert hf_loader.checkpoint_family(ckpt) == "qwen2"
    values = _forward(cfg, hf_loader.load_hf_params(ckpt, cfg), golden[0])
    np.testing.assert_array_less(np.abs(values - golden[1][..., k]).max(), 1e-4)
  bad = _copy(QWEN2, str(tmp_path / "gpt2"), edit_tensors=add_head,
              edit_config=lambda c: c.update(architectures=["RewardModel"], model_type="gpt2"))
  with pytest.raises(ValueError, match=r"architectures=\['RewardModel'\] \(OpenRLHF's\) with "
                     r"model_type='gpt2' is not supported; expected a model_type of "):
    hf_loader.load_hf_config(bad)


def test_openrlhf_s_value_head_prefix_names_the_head(tmp_path):
  """OpenRLHF names its value head by --value_head_prefix and records the name in config.json
  (value_head_prefix): a head under another name than score / value_head was refused as
  'tensor(s) this config does not use'. The config.json's prefix is the head now (with its
  bias); one that is no tensor name is refused naming the field."""
  k, bias = 7, 0.5
  golden = _golden(QWEN2)
  def add_head(t):
    t["reward_head.weight"] = t["model.embed_tokens.weight"][k:k + 1].copy()
    t["reward_head.bias"] = np.array([bias], np.float32)
  ckpt = _copy(QWEN2, str(tmp_path / "rm"), edit_tensors=add_head,
               edit_config=lambda c: c.update(architectures=["RewardModel"],
                                              value_head_prefix="reward_head"))
  cfg = hf_loader.load_hf_config(ckpt)
  names = hf_loader.tensor_names(ckpt)
  assert hf_loader.scalar_head_prefix(names, hf_loader.own_head_prefix(ckpt)) == "reward_head"
  assert hf_loader.scalar_head_prefix(names) is None  # only the config.json names it
  values = _forward(cfg, hf_loader.load_hf_params(ckpt, cfg), golden[0])
  np.testing.assert_array_less(np.abs(values - bias - golden[1][..., k]).max(), 1e-4)
  # Beside a head of a known name too: two writers' heads, refused as before.
  def two(t):
    add_head(t)
    t["score.weight"] = t["model.embed_tokens.weight"][3:4].copy()
  both = _copy(QWEN2, str(tmp_path / "both"), edit_tensors=two,
               edit_config=lambda c: c.update(architectures=["RewardModel"],
                                              value_head_prefix="reward_head"))
  with pytest.raises(ValueError, match=r"scalar head tensors of more than one writer: "
                     r"score\.weight, reward_head\.weight"):
    hf_loader.load_hf_params(both, hf_loader.load_hf_config(both))
  for bad in (3, "", "reward head"):
    odd = _copy(QWEN2, str(tmp_path / f"odd{bad!r}"), edit_tensors=add_head,
                edit_config=lambda c, bad=bad: c.update(architectures=["RewardModel"],
                                                        value_head_prefix=bad))
    with pytest.raises(ValueError, match=r"config\.json: value_head_prefix=" + re.escape(
        repr(bad)) + r"; expected a tensor name prefix"):
      hf_loader.load_hf_params(odd, hf_loader.load_hf_config(odd))


def test_a_scalar_head_load_reads_config_json_once(tmp_path, monkeypatch):
  """The loader reads the checkpoint's value_head_prefix from its config.json once per load:
  _load and _value_head each read the file again (two reads of every reward model or critic)."""
  def add_head(t):
    t["reward_head.weight"] = t["model.embed_tokens.weight"][7:8].copy()
  ckpt = _copy(QWEN2, str(tmp_path / "rm"), edit_tensors=add_head,
               edit_config=lambda c: c.update(architectures=["RewardModel"],
                                              value_head_prefix="reward_head"))
  cfg = hf_loader.load_hf_config(ckpt)
  reads = []
  read_json = hf_loader.hf_config.read_json
  monkeypatch.setattr(hf_loader.hf_config, "read_json",
                      lambda path: reads.append(os.path.basename(path)) or read_json(path))
  params = hf_loader.load_hf_params(ckpt, cfg)
  assert reads == ["config.json"]
  np.testing.assert_array_equal(
      params["head"]["value_head"][:, 0], params["embed"]["embedding"][7])


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
  tok = HFTokenizer.from_file(QWEN2)
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


@pytest.mark.parametrize("arch", list(CHECKPOINTS))
def test_the_simulator_reads_a_config_json_as_the_loader_does(arch, tmp_path):
  """config.shapes='NAME=PATH' (reproduce_ablations, plan_search): the simulator reads an HF
  config.json with the loader's code (models/hf_config); its shape has the fields and
  parameter count of the model the loader builds from the same file (GQA, head_dim, tied
  embeddings, Qwen2's biases, Qwen3's q/k norms). Before, only the four LLaMA-1 presets could
  be named."""
  ckpt = CHECKPOINTS[arch]
  got = shapes.from_hf_config(ckpt, arch)
  want = shapes.from_model_config(hf_loader.load_hf_config(ckpt), arch, dtypes=True)
  same = lambda s, seq: dataclasses.replace(s, head_dim=s.head_dim_, max_seq_len=seq)
  assert same(got, 1) == same(want, 1)
  assert got.num_params() == want.num_params()
  # Bytes per element at the file's dtype, as the loader reads it (they were bf16's whatever
  # the file said: a float32 model's loads and migrations charged at half their bytes).
  with open(os.path.join(ckpt, "config.json")) as f:
    stored = json.load(f)
  for key, dtype, size in (("torch_dtype", "bfloat16", 2), ("dtype", "float32", 4),
                           (None, None, 4)):
    hf = {k: v for k, v in stored.items() if k not in ("dtype", "torch_dtype")}
    if key:
      hf[key] = dtype
    (tmp_path / f"d{size}{key}").mkdir()
    (tmp_path / f"d{size}{key}" / "config.json").write_text(json.dumps(hf))
    got_dtype = shapes.from_hf_config(str(tmp_path / f"d{size}{key}"), arch)
    loaded = hf_loader.config_from_hf(hf)
    assert (got_dtype.weight_itemsize, got_dtype.kv_itemsize) == (size, size), (key, dtype)
    assert loaded.param_dtype == loaded.dtype == (dtype or "float32")
  (tmp_path / "d8").mkdir()
  (tmp_path / "d8" / "config.json").write_text(json.dumps({**hf, "torch_dtype": "int8"}))
  with pytest.raises(ValueError, match=r"torch_dtype='int8'; expected one of"):
    shapes.from_hf_config(str(tmp_path / "d8"), arch)
  # attention_bias as the loader reads it: q, k, v and o for LLaMA and Qwen3, ignored by
  # Mistral, Qwen2's own q, k, v biases whatever it says.
  with open(os.path.join(ckpt, "config.json")) as f:
    hf = {**json.load(f), "attention_bias": True}
  (tmp_path / "biased").mkdir()
  (tmp_path / "biased" / "config.json").write_text(json.dumps(hf))
  got = shapes.from_hf_config(str(tmp_path / "biased"), arch)
  want = shapes.from_model_config(hf_loader.config_from_hf(hf), arch)
  assert (got.qkv_bias, got.o_bias) == (want.qkv_bias, want.o_bias)
  assert got.num_params() == want.num_params()
  # head_dim left out: transformers' default (Qwen3Config: 128, not hidden / heads; the
  # others: hidden / heads), as the loader reads it.
  hf.pop("head_dim", None)
  (tmp_path / "biased" / "config.json").write_text(json.dumps(hf))
  got = shapes.from_hf_config(str(tmp_path / "biased"), arch)
  want = shapes.from_model_config(hf_loader.config_from_hf(hf), arch)
  assert got.head_dim_ == want.head_dim_
  assert got.num_params() == want.num_params()
  # A model the loader refuses is refused here too (its shape would be estimated silently).
  (tmp_path / "biased" / "config.json").write_text(json.dumps({**hf, "mlp_bias": True}))
  with pytest.raises(ValueError, match=r"mlp_bias=true is not supported"):
    shapes.from_hf_config(str(tmp_path / "biased"), arch)
  with pytest.raises(ValueError, match=r"mlp_bias=true is not supported"):
    hf_loader.config_from_hf({**hf, "mlp_bias": True})
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
  with pytest.raises(ValueError, match=r"shape 'x': .*config\.json: missing required field\(s\) "
                     r"\['vocab_size'"):
    shapes.from_hf_config(str(tmp_path), "x")


# ModelConfig fields that do not describe the model an HF config.json holds: how it runs here.
RUN_ONLY_FIELDS = {"param_dtype", "dtype", "attention", "fused_projections", "remat",
                   "scan_layers"}
# A value other than the default for every other field (with what it needs beside it).
NON_DEFAULT = {
    "vocab_size": {"vocab_size": 40}, "hidden_size": {"hidden_size": 48},
    "intermediate_size": {"intermediate_size": 80}, "num_layers": {"num_layers": 3},
    "num_heads": {"num_heads": 8, "num_kv_heads": 4}, "num_kv_heads": {"num_kv_heads": 1},
    "head_dim": {"head_dim": 16}, "rope_theta": {"rope_theta": 5e5},
    "rms_norm_eps": {"rms_norm_eps": 1e-5}, "tie_embeddings": {"tie_embeddings": True},
    "qkv_bias": {"qkv_bias": True}, "o_bias": {"qkv_bias": True, "o_bias": True},
    "max_seq_len": {"max_seq_len": 512},
    **{f: {"rope_type": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 2.0,
           "rope_high_freq_factor": 8.0, "rope_original_max_len": 256}
       for f in ("rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "rope_original_max_len")},
    "qk_norm": {"qk_norm": True}, "head": {"head": "scalar"},
    "score_pad_id": {"head": "scalar", "score_pad_id": 3},
}


def test_every_model_field_is_exported_or_run_only():
  """A new ModelConfig field must be added to NON_DEFAULT (then it round-trips below) or to
  RUN_ONLY_FIELDS, so that its export is decided, not forgotten (one that cannot be exported
  gets a test that hf_config_dict refuses it). One test, not one per field: a new field failed
  all 21 round trips with the bare set of names."""
  fields = {f.name for f in dataclasses.fields(llama.ModelConfig)}
  listed = set(NON_DEFAULT) | RUN_ONLY_FIELDS
  assert fields == listed, (
      f"tests/test_hf_loader.py: ModelConfig fields in neither NON_DEFAULT (a value that must "
      f"round-trip through the HF config.json: models/hf_loader.hf_config_dict and "
      f"config_from_hf) nor RUN_ONLY_FIELDS (how a run computes, not the model): "
      f"{sorted(fields - listed)}; listed but not fields: {sorted(listed - fields)} "
      "(docs/architecture.md §8, \"A model field\")")


def test_a_run_only_field_is_kept_beside_a_checkpoint():
  """A field config.json does not hold is taken from the run's config when the model comes from
  a checkpoint (trainer/build.RUN_MODEL_FIELDS): left out there, load_hf_config gave it its
  default, so a preset's model.remat='full' beside init.actor_checkpoint trained with 'none',
  silently (checked by taking remat out of the tuple)."""
  from rlhfuse_jax.trainer import build
  missing = sorted(RUN_ONLY_FIELDS - set(build.RUN_MODEL_FIELDS))
  assert not missing, (f"run-only model fields {missing} are not in trainer/build."
                       "RUN_MODEL_FIELDS: beside a checkpoint they would load as their defaults")
  cfg = llama.ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, remat="full", scan_layers=True)
  back = build.checkpoint_config(CHECKPOINTS["llama"], cfg)
  assert (back.remat, back.scan_layers) == ("full", True)


@pytest.mark.parametrize("field", sorted(NON_DEFAULT))
def test_every_model_field_survives_the_hf_export(field):
  """An exported config.json read back gives every ModelConfig field the model had: a field
  the export wrote as a constant would load as another model without a word (a researcher's
  new MLP activation came back as SwiGLU)."""
  base = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
              num_kv_heads=2)
  cfg = llama.ModelConfig(**{**base, **NON_DEFAULT[field]})
  assert getattr(cfg, field) != getattr(llama.ModelConfig(**base), field)
  back = hf_loader.config_from_hf(hf_loader.hf_config_dict(cfg))
  assert getattr(back, field) == getattr(cfg, field)


def test_reads_once_parses_a_config_json_once_per_version(tmp_path, monkeypatch):
  """hf_config.reads_once (a trainer's set-up): one parse per version of a file, each caller
  given its own copy; a rewrite inside the block is read anew, and outside it every call reads
  the file."""
  import builtins
  from rlhfuse_jax.models import hf_config
  path = tmp_path / "config.json"
  path.write_text('{"a": 1, "b": [1]}')
  opened, real_open = [], builtins.open
  monkeypatch.setattr(builtins, "open",
                      lambda f, *a, **k: opened.append(f) or real_open(f, *a, **k))
  with hf_config.reads_once():
    first = hf_config.read_json(str(path))
    first["b"].append(2)  # the caller's copy
    with hf_config.reads_once():  # an inner block shares the outer one's reads
      assert hf_config.read_json(str(path)) == {"a": 1, "b": [1]}
    assert len(opened) == 1, opened
    path.write_text('{"a": 10, "b": [1]}')  # another size: another version
    assert hf_config.read_json(str(path))["a"] == 10 and len(opened) == 2
    with pytest.raises(FileNotFoundError, match="missing.json not found"):
      hf_config.read_json(str(tmp_path / "missing.json"))
  assert hf_config.read_json(str(path))["a"] == 10 and len(opened) == 3
  assert hf_config.read_json(str(path))["a"] == 10 and len(opened) == 4
