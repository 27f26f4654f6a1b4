"""Hugging Face LLaMA / Mistral / Qwen2 / Qwen3 checkpoints <-> our `llama.py` parameters.

The four families are one decoder with switches (ModelConfig): Qwen2 (and Qwen2.5, the same
architecture) adds q/k/v biases, Qwen3 drops them for a per-head RMSNorm on queries and keys
(`qk_norm`), Mistral is LLaMA plus a sliding window that we accept only where it never binds
(max_seq_len <= sliding_window), and Llama 3.1+ scales RoPE's frequencies (rope_type "llama3").

A HF checkpoint directory is `config.json` plus safetensors weights, either one `model.safetensors`
or a `model.safetensors.index.json` whose `weight_map` names the shard of every tensor. The
mapping to our parameter tree is one table (`_tensor_table`): HF `nn.Linear` weights are stored
[out, in] and our `nn.Dense` kernels [in, out], so every projection is transposed; everything else
is copied. Loading is strict: each expected tensor must be present with the shape the config
implies, and tensors we would silently drop are an error (only RoPE's recomputable `inv_freq`
buffers, and an LM head that a scalar-head model does not use, are skipped).

Configs are strict too: a feature our model does not implement (RoPE scaling other than
"llama3", partial rotary embeddings, sliding-window attention that is actually reached, biases on
the MLP, another activation, quantized weights) raises an error that names the config.json
field, rather than producing a model that quietly computes something else.

Export (`save_hf_checkpoint`) writes the family's config.json (transformers' legacy field names,
`rope_theta` + `rope_scaling` + `torch_dtype`, as transformers 4.x writes them and 5.x still
reads them; checked with 5.23.0) and the tensors under the names the family's HF classes use, so
an exported checkpoint reloads as the same model in transformers and here.

Critic and reward models (`head="scalar"`) start from an LM checkpoint (the backbone is loaded,
the value head drawn fresh from an rng) or from a HF `*ForSequenceClassification` checkpoint
(the value head is its `score.weight`).

bf16 safetensors are read through safetensors' numpy loader; importing `ml_dtypes` registers
numpy's `bfloat16`, which older safetensors releases need to recognise the dtype.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
from typing import Any, Optional, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers numpy bfloat16 for safetensors' numpy loader)
import numpy as np
import safetensors
import safetensors.numpy

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.models import hf_config, llama
# config.json's reading, shared with the simulator (models/hf_config.py, which imports no jax)
from rlhfuse_jax.models.hf_config import ARCHITECTURES, CONFIG_FILE, FAMILIES

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Tensor dtypes a checkpoint may store (float64 converts exactly enough; cast to param_dtype).
_TENSOR_DTYPES = tuple(np.dtype(t) for t in (*_NP_DTYPES.values(), np.float64))
# The same dtypes as a safetensors header spells them.
_HEADER_DTYPES = ("F32", "BF16", "F16", "F64")


def scalar_actor_error(where: str) -> str:
  """hf_config.scalar_actor_error (why a *ForSequenceClassification at `where` is no actor),
  for the trainer, which reads config.json through this module (docs/architecture.md §7): the
  planning tools refuse such an actor with the same words."""
  return hf_config.scalar_actor_error(where)


def _check_weight(x: np.ndarray, what: str, dtype_hint: str, nonfinite_hint: str) -> None:
  """Refuses `x` (named `what`) unless it is a weight the loader takes: the loader's check, and
  the export's (which must not write what the loader then refuses). Only real weights: an
  integer (quantized), bool or fp8 tensor cast to float would load a garbage model without a
  word (its scales live in other tensors or in a quantization_config); NaN/Inf are a damaged
  file or diverged weights."""
  if x.dtype not in _TENSOR_DTYPES:
    raise ValueError(f"{what} has dtype {x.dtype}; expected one of "
                     f"{sorted(d.name for d in _TENSOR_DTYPES)}{dtype_hint}")
  bad = int(np.size(x) - np.count_nonzero(np.isfinite(x.astype(np.float32))))
  if bad:
    raise ValueError(f"{what} holds {bad} non-finite value(s) (NaN/Inf) of "
                     f"{np.size(x)}{nonfinite_hint}")


# Tensors that HF checkpoints may carry and that hold nothing we need.
_HARMLESS = (re.compile(r".*rotary_emb\.inv_freq$"),)


def config_from_hf(hf: dict[str, Any], where: str = CONFIG_FILE, **overrides) -> llama.ModelConfig:
  """Maps a parsed HF config.json onto ModelConfig (see `load_hf_config`; the fields:
  hf_config.model_fields, which the simulator reads too)."""
  family, fields = hf_config.model_fields(hf, where)
  known = {f.name for f in dataclasses.fields(llama.ModelConfig)}
  unknown = sorted(set(overrides) - known)
  if unknown:
    raise ValueError(f"unknown ModelConfig override(s) {unknown}; known fields: {sorted(known)}")
  fields.update(overrides)
  try:
    cfg = llama.ModelConfig(**fields)
  except ValueError as e:  # the values came from config.json (or the overrides): name it
    raise ValueError(f"{where}: {e}") from e
  error = hf_config.sliding_window_error(hf, family, cfg.num_layers, cfg.max_seq_len, where)
  if error:
    raise ValueError(error)
  return cfg


def checkpoint_family(ckpt_dir: str) -> str:
  """The HF family ("llama", "mistral", "qwen2", "qwen3") of the checkpoint at `ckpt_dir`, from
  its config.json: what an export of a model trained from it should be written back as (a
  Mistral stays a Mistral, which `hf_family` cannot tell from the ModelConfig)."""
  path = os.path.join(ckpt_dir, CONFIG_FILE)
  return ARCHITECTURES[hf_config.architecture(hf_config.read_json(path), path)][0]


def reward_stats(ckpt_dir: str) -> Optional[tuple[float, float]]:
  """(mean, std) of the reward statistics that OpenRLHF's reward-model trainer writes into the
  config.json at `ckpt_dir` (hf_config.reward_stats), or None where it holds none."""
  path = os.path.join(ckpt_dir, CONFIG_FILE)
  return hf_config.reward_stats(hf_config.read_json(path), path)


def load_hf_config(ckpt_dir: str, **overrides) -> llama.ModelConfig:
  """ModelConfig of a HF {Llama,Mistral,Qwen2,Qwen3}ForCausalLM (or *ForSequenceClassification).

  param_dtype and dtype follow config.json's torch_dtype; `overrides` replace any ModelConfig
  field (e.g. `dtype="bfloat16", max_seq_len=1024, head="scalar"`).
  """
  path = os.path.join(ckpt_dir, CONFIG_FILE)
  return config_from_hf(hf_config.read_json(path), path, **overrides)


def _tensor_table(cfg: llama.ModelConfig) -> dict[str, tuple[tuple[str, ...], bool]]:
  """HF tensor name -> (our param path, transpose?) for every tensor the backbone needs."""
  table = {"model.embed_tokens.weight": (("embed", "embedding"), False),
           "model.norm.weight": (("head", "final_norm", "scale"), False)}
  for i in range(cfg.num_layers):
    hf, ours = f"model.layers.{i}.", f"layers_{i}"
    table[hf + "input_layernorm.weight"] = ((ours, "attn_norm", "scale"), False)
    table[hf + "post_attention_layernorm.weight"] = ((ours, "mlp_norm", "scale"), False)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      table[hf + f"self_attn.{proj}.weight"] = ((ours, "attn", proj, "kernel"), True)
    if cfg.qkv_bias:
      for proj in ("q_proj", "k_proj", "v_proj"):
        table[hf + f"self_attn.{proj}.bias"] = ((ours, "attn", proj, "bias"), False)
    if cfg.o_bias:
      table[hf + "self_attn.o_proj.bias"] = ((ours, "attn", "o_proj", "bias"), False)
    if cfg.qk_norm:
      for norm in ("q_norm", "k_norm"):
        table[hf + f"self_attn.{norm}.weight"] = ((ours, "attn", norm, "scale"), False)
    for proj in ("gate_proj", "up_proj", "down_proj"):
      table[hf + f"mlp.{proj}.weight"] = ((ours, "mlp", proj, "kernel"), True)
  if cfg.head == "lm" and not cfg.tie_embeddings:
    table["lm_head.weight"] = (("head", "lm_head"), True)
  return table


@contextlib.contextmanager
def _named(path: str):
  """Errors of opening a safetensors file (truncated, not safetensors) name the file."""
  try:
    yield
  except Exception as e:  # SafetensorError (a Rust exception type) and OSError alike
    raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e


def max_positions(ckpt_dir: str) -> int:
  """config.json's max_position_embeddings (2048 when absent, as config_from_hf reads it, and
  refused as it refuses a value that is not an integer)."""
  path = os.path.join(ckpt_dir, CONFIG_FILE)
  hf = hf_config.read_json(path)
  key = "max_position_embeddings"
  hf_config.check_types(hf, {key: int}, path)
  return hf.get(key, 2048)


def tensor_names(ckpt_dir: str) -> set[str]:
  """The tensor names of a safetensors checkpoint directory (headers only; nothing is read)."""
  return _Checkpoint(ckpt_dir).names()


class _Checkpoint:
  """Tensor name -> safetensors file of a checkpoint directory (single file or sharded)."""

  def __init__(self, ckpt_dir: str):
    self.dir = ckpt_dir
    single, index = os.path.join(ckpt_dir, SINGLE_FILE), os.path.join(ckpt_dir, INDEX_FILE)
    if os.path.isfile(single):
      with _named(single):
        with safetensors.safe_open(single, framework="numpy") as f:
          self.files = {name: single for name in f.keys()}
    elif os.path.isfile(index):
      weight_map = hf_config.read_json(index).get("weight_map")
      if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: missing 'weight_map' object")
      odd = sorted(n for n, shard in weight_map.items() if not isinstance(shard, str))
      if odd:
        raise ValueError(f"{index}: weight_map names no shard file for {_short_list(odd)} "
                         f"(e.g. {odd[0]}: {weight_map[odd[0]]!r}); expected file names")
      self.files = {name: os.path.join(ckpt_dir, shard) for name, shard in weight_map.items()}
      shards = sorted(set(self.files.values()))
      for shard in shards:
        if not os.path.isfile(shard):
          raise FileNotFoundError(f"{index} names shard {os.path.basename(shard)}, which is "
                                  "missing")
      # A tensor a shard holds but the index does not list (a stale index) would be dropped
      # without a word: an extra layer, a bias. Headers only; nothing is read.
      for shard in shards:
        with _named(shard):
          with safetensors.safe_open(shard, framework="numpy") as f:
            unlisted = [n for n in f.keys() if n not in self.files
                        and not any(p.match(n) for p in _HARMLESS)]
        if unlisted:
          raise ValueError(f"{shard}: holds tensor(s) that {INDEX_FILE} does not list: "
                           f"{_short_list(unlisted)} (a stale index?)")
    else:
      present = sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else "no such directory"
      raise FileNotFoundError(f"{ckpt_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found "
                              f"(contents: {present}); only safetensors checkpoints are supported")
    self._open: dict[str, Any] = {}

  def names(self) -> set[str]:
    return set(self.files)

  def unlisted_shards_hint(self, missing: Sequence[str]) -> str:
    """Where the index leaves out a shard of the directory that holds `missing` tensors (a
    stale index; the shards it names are checked for unlisted tensors, this one was not): a
    hint naming it, else ""."""
    named = set(self.files.values())
    if os.path.join(self.dir, SINGLE_FILE) in named:  # not a sharded checkpoint
      return ""
    for shard in sorted(glob.glob(os.path.join(self.dir, "*.safetensors"))):
      if shard in named:
        continue
      try:
        with safetensors.safe_open(shard, framework="numpy") as f:
          held = set(f.keys())
      except Exception:  # noqa: BLE001 a damaged stray file: no hint from it
        continue
      if held & set(missing):
        return (f" ({os.path.basename(shard)} in the directory holds "
                f"{_short_list(sorted(held & set(missing)))}, but {INDEX_FILE} does not name "
                "it: a stale index?)")
    return ""

  def shape(self, name: str) -> tuple[int, ...]:
    with self._reading(name):
      return tuple(self._handle(name).get_slice(name).get_shape())

  def get(self, name: str) -> np.ndarray:
    """The tensor, checked: a damaged file's garbage must not train (NaN/Inf are refused)."""
    with self._reading(name):
      x = self._handle(name).get_tensor(name)
    _check_weight(x, f"{self.files[name]}: tensor {name}",
                  " (quantized checkpoints are not supported)",
                  ": the file is damaged or the weights diverged")
    return x

  @contextlib.contextmanager
  def _reading(self, name: str):
    """A tensor that is not where the index says (the Rust side raises SafetensorError) names
    the file and the tensor (the header read for its shape comes first: both are covered)."""
    try:
      yield
    except ValueError:
      raise  # _handle's own, naming the file already
    except Exception as e:  # noqa: BLE001 SafetensorError is not importable as a Python type
      # The tensor is in the file but numpy cannot hold its dtype (FP8, FP4): a quantized
      # checkpoint, which the index hint below sent looking for a wrong shard.
      try:
        kind = self._handle(name).get_slice(name).get_dtype()
      except Exception:  # noqa: BLE001 not in this file: the index's fault
        kind = None
      if kind is not None and kind not in _HEADER_DTYPES:
        raise ValueError(f"{self.files[name]}: tensor {name} has dtype {kind}; expected one of "
                         f"{sorted(d.name for d in _TENSOR_DTYPES)} (quantized checkpoints are "
                         "not supported)") from e
      raise ValueError(f"{self.files[name]}: cannot read tensor {name} ({e}); the checkpoint's "
                       f"{INDEX_FILE} may name the wrong shard for it") from e

  def _handle(self, name: str):
    path = self.files[name]
    if path not in self._open:
      with _named(path):
        self._open[path] = safetensors.safe_open(path, framework="numpy").__enter__()
    return self._open[path]

  def close(self):
    for handle in self._open.values():
      handle.__exit__(None, None, None)
    self._open.clear()


def _expected_shapes(cfg: llama.ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
  shapes = llama.param_shapes(cfg)
  return {k: tuple(v.shape) for k, v in flax.traverse_util.flatten_dict(shapes).items()}


def _short_list(names, limit: int = 20) -> str:
  names = sorted(names)
  more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
  return ", ".join(names[:limit]) + more


def load_hf_params(ckpt_dir: str, cfg: llama.ModelConfig, dtype: Optional[str] = None,
                   head: Optional[str] = None, rng: Optional[jax.Array] = None) -> Any:
  """Reads a HF checkpoint into our parameter tree (host numpy arrays).

  Args:
    ckpt_dir: directory with model.safetensors or model.safetensors.index.json + shards.
    cfg: the model config (usually `load_hf_config(ckpt_dir)`); shapes are validated against it.
    dtype: dtype of the returned arrays ("float32", "bfloat16", "float16"); default
      cfg.param_dtype.
    head: "lm" or "scalar"; default cfg.head (the config decides the tree, so they must agree).
    rng: for head="scalar" without a `score.weight` in the checkpoint: key that draws the value
      head as `llama.init_params` would (normal(0.02) weight, zero bias).

  Returns:
    Nested dict matching `llama.init_params(cfg, ...)[0]`, as numpy arrays, so that the caller
    places them with `jax.device_put(params, shardings)` without a detour through one device.
  """
  head = cfg.head if head is None else head
  if head not in llama.HEADS:
    raise ValueError(f"head={head!r}; expected one of {llama.HEADS}")
  if head != cfg.head:
    cfg = cfg.replace(head=head)
  dtype = cfg.param_dtype if dtype is None else dtype
  if dtype not in _NP_DTYPES:
    raise ValueError(f"dtype={dtype!r}; expected one of {list(_NP_DTYPES)}")
  np_dtype = _NP_DTYPES[dtype]
  ckpt = _Checkpoint(ckpt_dir)
  try:
    params = _load(ckpt, cfg.replace(scan_layers=False), np_dtype, rng)
  finally:
    ckpt.close()
  return llama.stack_layers(params, cfg.num_layers) if cfg.scan_layers else params


def _load(ckpt: _Checkpoint, cfg: llama.ModelConfig, np_dtype, rng) -> Any:
  table = _tensor_table(cfg)
  expected = _expected_shapes(cfg)
  names = ckpt.names()
  optional = set()  # present-or-not tensors we know how to use or safely skip
  own = own_head_prefix(ckpt.dir) if cfg.head == "scalar" else None
  if cfg.head == "scalar":
    optional |= SCALAR_HEAD_TENSORS | {"lm_head.weight"} | (
        {f"{own}.weight", f"{own}.bias"} if own else set())
  elif cfg.tie_embeddings:
    optional.add("lm_head.weight")  # some exporters store the tied copy; checked equal below
  missing = sorted(set(table) - names)
  if missing:
    hint = (" (its config.json says tie_word_embeddings=false: with no lm_head.weight of its "
            "own the head is the embedding, tie_word_embeddings=true)"
            if missing == ["lm_head.weight"] and not cfg.tie_embeddings else
            ckpt.unlisted_shards_hint(missing))
    raise ValueError(f"{ckpt.dir}: checkpoint lacks tensor(s) the config needs: "
                     f"{_short_list(missing)}{hint}")
  unexpected = [n for n in names - set(table) - optional
                if not any(p.match(n) for p in _HARMLESS)]
  if unexpected:
    raise ValueError(f"{ckpt.dir}: checkpoint has tensor(s) this config does not use "
                     f"(is the config right?): {_short_list(unexpected)}")

  flat = {}
  for name, (path, transpose) in table.items():
    want = expected[path][::-1] if transpose else expected[path]
    got = ckpt.shape(name)
    if got != want:
      raise ValueError(f"{ckpt.dir}: tensor {name} has shape {list(got)} but the config expects "
                       f"{list(want)} (our {'/'.join(path)} {list(expected[path])})")
    w = ckpt.get(name)
    flat[path] = np.ascontiguousarray(w.T if transpose else w).astype(np_dtype, copy=False)

  if cfg.head == "lm" and cfg.tie_embeddings and "lm_head.weight" in names:
    lm = ckpt.get("lm_head.weight")
    if lm.shape != flat[("embed", "embedding")].shape or not np.array_equal(
        lm.astype(np_dtype), flat[("embed", "embedding")]):
      raise ValueError(f"{ckpt.dir}: tie_word_embeddings=true but lm_head.weight differs from "
                       "model.embed_tokens.weight; set tie_word_embeddings=false in config.json")
  if cfg.head == "scalar":
    flat.update(_value_head(ckpt, cfg, expected, np_dtype, rng, own))
  return flax.traverse_util.unflatten_dict(flat)


# A scalar head's tensors by the name each writer gives its nn.Linear(hidden, 1): transformers'
# *ForSequenceClassification `score` (no bias in transformers; ours writes one: save_hf_checkpoint),
# OpenRLHF's value_head_prefix when not "score", TRL's AutoModelForCausalLMWithValueHead
# `v_head.summary` (with a bias). Each was refused as an unused tensor, or as "no trained head".
SCALAR_HEAD_PREFIXES = ("score", "value_head", "v_head.summary")
SCALAR_HEAD_TENSORS = frozenset(f"{p}.{k}" for p in SCALAR_HEAD_PREFIXES
                                for k in ("weight", "bias"))


def head_prefixes(own: Optional[str] = None) -> tuple[str, ...]:
  """SCALAR_HEAD_PREFIXES, then `own` (config.json's value_head_prefix: OpenRLHF's
  --value_head_prefix, which may be any name) where it is none of them."""
  return SCALAR_HEAD_PREFIXES + ((own,) if own and own not in SCALAR_HEAD_PREFIXES else ())


def own_head_prefix(ckpt_dir: str) -> Optional[str]:
  """The value_head_prefix that the config.json at `ckpt_dir` names (None: none, or no
  config.json)."""
  path = os.path.join(ckpt_dir, CONFIG_FILE)
  if not os.path.isfile(path):
    return None
  return hf_config.value_head_prefix(hf_config.read_json(path), path)


def scalar_heads(names, own: Optional[str] = None) -> list[str]:
  """The prefixes of head_prefixes(own) whose `.weight` the checkpoint's tensor `names` hold,
  in that order."""
  return [p for p in head_prefixes(own) if f"{p}.weight" in names]


def scalar_head_prefix(names, own: Optional[str] = None) -> Optional[str]:
  """The first of `scalar_heads(names, own)`, or None: a checkpoint without a trained scalar
  head."""
  return next(iter(scalar_heads(names, own)), None)


def _value_head(ckpt: _Checkpoint, cfg: llama.ModelConfig, expected, np_dtype, rng,
                own: Optional[str]):
  """The scalar head's tensors; `own`: own_head_prefix(ckpt.dir), read once by _load."""
  w_path, b_path = ("head", "value_head"), ("head", "value_bias")
  names = ckpt.names()
  heads = scalar_heads(names, own)
  prefix = heads[0] if heads else None
  # Two heads, or a bias beside another prefix's weight: which one a writer meant is unknown
  # (the first was taken and the other dropped without a word).
  stray = [f"{p}.bias" for p in head_prefixes(own) if f"{p}.bias" in names and p != prefix]
  if len(heads) > 1 or stray:
    raise ValueError(f"{ckpt.dir}: scalar head tensors of more than one writer: "
                     f"{', '.join([f'{p}.weight' for p in heads] + stray)}; keep one head (its "
                     "weight, and its bias if any)")
  if prefix is not None:
    name = f"{prefix}.weight"
    want = expected[w_path][::-1]  # HF score: nn.Linear(hidden, num_labels=1) -> [1, hidden]
    if ckpt.shape(name) != want:
      raise ValueError(f"{ckpt.dir}: tensor {name} has shape {list(ckpt.shape(name))} but a "
                       f"scalar head expects {list(want)} (num_labels must be 1)")
    w = ckpt.get(name).T  # [hidden, 1]
  else:
    if rng is None:
      raise ValueError(f"{ckpt.dir}: head='scalar' and the checkpoint has no score.weight; pass "
                       "rng= to initialise the value head")
    w = np.asarray(nn.initializers.normal(0.02)(rng, expected[w_path], jnp.float32))
  b = np.zeros(expected[b_path], np.float32)
  bias = f"{prefix or 'score'}.bias"
  if bias in names:
    if ckpt.shape(bias) != expected[b_path]:
      raise ValueError(f"{ckpt.dir}: tensor {bias} has shape {list(ckpt.shape(bias))}"
                       f" but a scalar head expects {list(expected[b_path])}")
    b = ckpt.get(bias)
  return {w_path: np.ascontiguousarray(w).astype(np_dtype, copy=False),
          b_path: np.asarray(b).astype(np_dtype, copy=False)}


def _family_error(cfg: llama.ModelConfig, family: str) -> Optional[str]:
  """Why HF's `family` cannot express cfg's attention (None if it can)."""
  biases = f"qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias}"
  if family == "qwen2":
    ok = cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm
    need = "qkv_bias=True, o_bias=False, qk_norm=False"
  elif family == "mistral":
    ok = not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm)
    need = "no biases, qk_norm=False"
  else:  # llama (qk_norm=False), qwen3 (qk_norm=True): attention_bias = both or neither
    ok = cfg.qkv_bias == cfg.o_bias and cfg.qk_norm == (family == "qwen3")
    need = f"qkv_bias == o_bias, qk_norm={family == 'qwen3'}"
  return None if ok else (f"model {biases}, qk_norm={cfg.qk_norm} has no HF {family} "
                          f"equivalent (needs {need})")


def hf_family(cfg: llama.ModelConfig) -> str:
  """The HF family `save_hf_checkpoint` writes by default: qwen3 with q/k norms, qwen2 with
  q/k/v biases only, else llama (a Mistral without a binding window is a LLaMA)."""
  family = "qwen3" if cfg.qk_norm else ("qwen2" if cfg.qkv_bias and not cfg.o_bias else "llama")
  error = _family_error(cfg, family)
  if error:
    raise ValueError(error)
  return family


def hf_config_dict(cfg: llama.ModelConfig, torch_dtype: Optional[str] = None,
                   family: Optional[str] = None) -> dict[str, Any]:
  """The config.json that describes `cfg` to transformers (and to `load_hf_config`).

  family: "llama", "mistral", "qwen2" or "qwen3"; default `hf_family(cfg)`.
  """
  if family is None:
    family = hf_family(cfg)
  if family not in FAMILIES:
    raise ValueError(f"family={family!r}; expected one of {FAMILIES}")
  error = _family_error(cfg, family)
  if error:
    try:  # the family that does express it, when there is one
      error += f"; this model is written as {hf_family(cfg)!r} (export_hf='auto' picks it)"
    except ValueError:
      pass
    raise ValueError(error)
  rope_scaling = None
  if cfg.rope_type == "llama3":
    rope_scaling = {"rope_type": "llama3", "factor": cfg.rope_factor,
                    "low_freq_factor": cfg.rope_low_freq_factor,
                    "high_freq_factor": cfg.rope_high_freq_factor,
                    "original_max_position_embeddings": cfg.rope_original_max_len}
  elif cfg.rope_type != "default":
    raise ValueError(f"model.rope_type={cfg.rope_type!r} cannot be exported")
  hf = {
      "architectures": [hf_config.CLASS_PREFIX[family] + hf_config.HEAD_SUFFIX[cfg.head]],
      "model_type": family,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim_,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": rope_scaling,
      "tie_word_embeddings": cfg.tie_embeddings,
      "torch_dtype": torch_dtype or cfg.param_dtype,
  }
  if family == "llama":
    hf.update(attention_bias=cfg.qkv_bias, mlp_bias=False)
  elif family == "mistral":
    hf.update(sliding_window=None)  # transformers' MistralConfig would default to 4096
  else:
    hf.update(use_sliding_window=False, sliding_window=None)
    if family == "qwen3":
      hf.update(attention_bias=cfg.qkv_bias)
  if cfg.head == "scalar":
    hf.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if cfg.score_pad_id >= 0:  # where it scores (config_from_hf reads it back)
      hf.update(pad_token_id=cfg.score_pad_id)
  return hf


# The OS error inside a safetensors write's error (0.8: "I/O error: No space left on device (os
# error 28)"; 0.4: "IoError(Os { code: 28, ... })").
_SAFETENSORS_OS_ERROR = re.compile(r"os error (\d+)|\bcode: (\d+)")


@contextlib.contextmanager
def _os_error_of_safetensors(path: str):
  """Re-raises safetensors' error of a failed write (a full disk) as the OSError it wraps, naming
  `path`: its SafetensorError is no OSError, so a caller's handling of a full disk (train_ppo:
  exit 3, trainer/hooks.writing) missed the largest file of an export."""
  try:
    yield
  except safetensors.SafetensorError as e:
    found = _SAFETENSORS_OS_ERROR.search(str(e))
    if found is None:
      raise
    code = int(found.group(1) or found.group(2))
    raise OSError(code, os.strerror(code), path) from e


def save_hf_checkpoint(params: Any, cfg: llama.ModelConfig, out_dir: str,
                       family: Optional[str] = None) -> None:
  """Writes `params` as a HF checkpoint: config.json + one model.safetensors.

  family: the HF model family of config.json ("llama", "mistral", "qwen2", "qwen3"); default
  `hf_family(cfg)`. ModelConfig does not record where a model came from, so a Mistral
  checkpoint is written back as LLaMA (the same model: names, tensors and logits) unless
  family="mistral" is passed.

  Tensors keep their dtype (config.json's torch_dtype is that of the embedding). A scalar head
  becomes `score.weight` of a *ForSequenceClassification; a non-zero value bias is written as
  `score.bias`, which `load_hf_params` reads back but transformers ignores (its score layer has
  no bias).
  """
  hf_config_dict(cfg, family=family)  # a family that cannot express cfg: refused before any work
  if cfg.scan_layers:  # HF stores one tensor per layer
    params, cfg = llama.unstack_layers(jax.device_get(params)), cfg.replace(scan_layers=False)
  flat = flax.traverse_util.flatten_dict(jax.device_get(params))
  expected = _expected_shapes(cfg)
  if set(flat) != set(expected):
    raise ValueError(f"params do not match the config: missing "
                     f"{_short_list('/'.join(p) for p in set(expected) - set(flat))}; unexpected "
                     f"{_short_list('/'.join(p) for p in set(flat) - set(expected))}")
  tensors = {}
  for name, (path, transpose) in _tensor_table(cfg).items():
    w = np.asarray(flat[path])
    if w.shape != expected[path]:
      raise ValueError(f"param {'/'.join(path)} has shape {list(w.shape)}; config expects "
                       f"{list(expected[path])}")
    tensors[name] = np.ascontiguousarray(w.T if transpose else w)
  if cfg.head == "scalar":
    tensors["score.weight"] = np.ascontiguousarray(np.asarray(flat[("head", "value_head")]).T)
    bias = np.asarray(flat[("head", "value_bias")])
    if np.any(bias != 0):
      tensors["score.bias"] = np.ascontiguousarray(bias)
  # What load_hf_params would refuse is not written: an export of diverged (NaN) weights
  # replaced a good earlier export with one that no longer loads.
  for name, w in tensors.items():
    _check_weight(w, f"tensor {name}", "", ": the weights diverged; nothing was written")
  dtype_name = np.dtype(tensors["model.embed_tokens.weight"].dtype).name
  if dtype_name not in _NP_DTYPES:
    raise ValueError(f"embedding dtype {dtype_name} cannot be saved; expected one of "
                     f"{list(_NP_DTYPES)}")
  hf_config = hf_config_dict(cfg, dtype_name, family)
  os.makedirs(out_dir, exist_ok=True)
  # transformers refuses safetensors files without a known "format"; "pt" is what it writes.
  # Both files are written beside and moved into place only once both are whole (a reader never
  # sees half a file, and a failed write, a full disk, leaves the checkpoint that was there: the
  # config.json written in place was left truncated over the old one), the weights with a plain
  # file's mode: safetensors creates 0600 files, which a serving job of another user cannot read.
  path, config_path = os.path.join(out_dir, SINGLE_FILE), os.path.join(out_dir, CONFIG_FILE)
  tmp, config_tmp = (os.path.join(out_dir, f"{wd.TMP_PREFIX}{n}")
                     for n in (SINGLE_FILE, CONFIG_FILE))
  try:
    with _os_error_of_safetensors(path):
      safetensors.numpy.save_file(tensors, tmp, metadata={"format": "pt"})
    os.chmod(tmp, wd.PLAIN_FILE_MODE)
    with open(config_tmp, "w") as f:
      json.dump(hf_config, f, indent=2, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    with open(tmp, "rb") as f:  # on disk before the rename (safetensors closes it unsynced)
      os.fsync(f.fileno())
    os.replace(tmp, path)
    os.replace(config_tmp, config_path)
  finally:
    for t in (tmp, config_tmp):
      if os.path.exists(t):
        os.remove(t)

