"""A Hugging Face config.json read as the fields of our decoder, without jax: the loader
(models/hf_loader.config_from_hf) builds its ModelConfig from `model_fields`, and the simulator
(sim/shapes.from_hf_config, which imports no jax) its ModelShape, so a model the trainer cannot
load (another architecture such as a mixture of experts, another activation, quantized weights,
RoPE scaling other than "llama3", partial rotary embeddings, a field of the wrong JSON type) is
refused by both with the same message naming the config.json field. The simulator read the file
on its own until 2026-12-06 and took all of these, a Mixtral-8x7B as a dense Mistral-7B's
7.2B parameters.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import math
import os
import re
from typing import Any, Iterator, Optional

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.models.param_count import QWEN3_DEFAULT_HEAD_DIM

CONFIG_FILE = "config.json"

# architecture name -> (model family, head it implies)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
HEAD_SUFFIX = {"lm": "ForCausalLM", "scalar": "ForSequenceClassification"}
ARCHITECTURES = {CLASS_PREFIX[f] + HEAD_SUFFIX[h]: (f, h) for f in FAMILIES for h in HEAD_SUFFIX}
_MODEL_TYPES = {f: CLASS_PREFIX[f] + "ForCausalLM" for f in FAMILIES}
# Keys of a RoPE parameter object (rope_parameters / rope_scaling) per rope_type; any other key
# is a feature we would silently ignore, so it is an error.
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"},
    "llama3": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor",
               "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
# The weights' dtypes a config.json may name (dtype or torch_dtype; float32 where it names none).
DTYPES = ("float32", "bfloat16", "float16")


# The files read_json parsed in the `reads_once` block under way, by (absolute path, inode, size,
# mtime); None outside one.
_READS: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("_READS", default=None)


@contextlib.contextmanager
def reads_once() -> Iterator[None]:
  """Within it, read_json parses each file once per version (its path, inode, size and mtime):
  a trainer's set-up (trainer/loop.PPOTrainer) asked for a reward model's config.json 13 times,
  each a read and parse (its shape, positions and head prefix at the config's resolution,
  validate and the models' build, its statistics, and again as the critic's). Outside one every
  call reads the file, so that a file rewritten between two starts, or by a test, is read
  anew. A block inside another shares the outer one's reads."""
  if _READS.get() is not None:
    yield
    return
  token = _READS.set({})
  try:
    yield
  finally:
    _READS.reset(token)


def read_json(path: str) -> dict[str, Any]:
  """The JSON object in the file at `path` (a checkpoint's config.json), a missing or malformed
  file named; read once per version of the file inside `reads_once`. The caller's to change."""
  reads = _READS.get()
  try:
    st = os.stat(path) if reads is not None else None
  except OSError:  # _read_json's own error says what is missing
    st = None
  if st is None:
    return _read_json(path)
  key = (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)
  if key not in reads:
    reads[key] = _read_json(path)
  return copy.deepcopy(reads[key])


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    parent = os.path.dirname(path)
    why = (f"; {parent!r} is a file: expected the checkpoint's directory" if os.path.isfile(
        parent) else f"; expected a local checkpoint directory (a hub id is not downloaded: "
                     f"`hf download {parent} --local-dir DIR`)" if not os.path.exists(parent)
           and parent.count("/") == 1 and not parent.startswith((".", "/")) else "")
    raise FileNotFoundError(f"{path} not found{why}")
  try:
    with open(path) as f:
      data = wd.load_json(f)
  except ValueError as e:  # JSONDecodeError, a key given twice
    raise ValueError(f"{path}: not valid JSON ({e})") from e
  if not isinstance(data, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
  return data


def scalar_actor_error(where: str) -> str:
  """Why a *ForSequenceClassification checkpoint (`where`: the field naming it, "config.
  init.actor_checkpoint='/rm'") cannot be the actor: the trainer's loader refuses it
  (trainer/build.actor_checkpoint_config), and the planning tools with the same words
  (plan_check's run, the simulator's config.shapes), which sized it with an LM head."""
  return (f"{where} is a *ForSequenceClassification (a scalar head, a reward model's or a "
          "critic's): the actor needs a language model, a *ForCausalLM checkpoint")


# OpenRLHF saves its critic and reward model as classes of its own, built on the backbone of
# config.json's model_type with the head under value_head_prefix (transformers' save_pretrained
# records the class name): they were refused as unsupported architectures. Each scores at the
# last attended token, EOS included, whatever pad_token_id says.
OPENRLHF_ARCHITECTURES = ("CriticModel", "RewardModel")


# OpenRLHF's reward-model trainer (openrlhf/trainer/rm_trainer.py, evaluate) writes the mean and
# the std (torch.std, clamped to >= 1e-8) of its scores on the evaluation pairs into config.json
# as top-level `mean` and `std`; its PPO (train_ppo_ray.py --normalize_reward, as its example
# scripts run it) scores (r - mean) / std. config.json's own `normalize_reward` records only the
# flag the model was last loaded with (OpenRLHF overwrites it at every load), so it is not read.
REWARD_STATS = ("mean", "std")


def reward_stats(hf: dict[str, Any], where: str = CONFIG_FILE) -> Optional[tuple[float, float]]:
  """(mean, std) of OpenRLHF's reward statistics in config.json `hf`, or None where it has
  neither; one without the other, or a value that is no finite number (std: > 0), is refused
  naming the field."""
  given = {k: hf.get(k) for k in REWARD_STATS if hf.get(k) is not None}
  if not given:
    return None
  if len(given) == 1:
    (have, value), = given.items()
    lacks = next(k for k in REWARD_STATS if k != have)
    raise ValueError(f"{where}: {have}={value!r} without {lacks}; OpenRLHF's reward statistics "
                     "are the two together (expected both numbers, or neither)")
  for key, value in given.items():
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (key != "std" or value > 0))
    if not ok:
      what = "a finite number > 0" if key == "std" else "a finite number"
      raise ValueError(f"{where}: {key}={value!r}; expected {what} (OpenRLHF's reward "
                       "statistics)")
  return float(given["mean"]), float(given["std"])


# OpenRLHF names its value head's nn.Linear by --value_head_prefix (default "score", earlier
# "value_head") and records the name in config.json as `value_head_prefix`.
_TENSOR_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def value_head_prefix(hf: dict[str, Any], where: str = CONFIG_FILE) -> Optional[str]:
  """config.json's `value_head_prefix` (OpenRLHF's name for its value head's tensors), or None
  where it names none."""
  prefix = hf.get("value_head_prefix")
  if prefix is None:
    return None
  if not isinstance(prefix, str) or not _TENSOR_PREFIX.fullmatch(prefix):
    raise ValueError(f"{where}: value_head_prefix={prefix!r}; expected a tensor name prefix "
                     "such as 'score' or 'value_head' (OpenRLHF's --value_head_prefix)")
  return prefix


def _openrlhf(hf: dict[str, Any]) -> bool:
  archs = hf.get("architectures")
  return isinstance(archs, list) and len(archs) == 1 and archs[0] in OPENRLHF_ARCHITECTURES


def architecture(hf: dict[str, Any], where: str) -> str:
  """The key of ARCHITECTURES that config.json `hf` names (OpenRLHF's critic and reward model:
  the *ForSequenceClassification of its model_type)."""
  archs = hf.get("architectures")
  model_type = hf.get("model_type")
  if _openrlhf(hf):
    if model_type not in _MODEL_TYPES:
      raise ValueError(f"{where}: architectures={archs} (OpenRLHF's) with model_type="
                       f"{model_type!r} is not supported; expected a model_type of "
                       f"{sorted(_MODEL_TYPES)}")
    return CLASS_PREFIX[model_type] + HEAD_SUFFIX["scalar"]
  if archs:
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
      raise ValueError(f"{where}: architectures={archs} is not supported; expected one of "
                       f"{sorted(ARCHITECTURES)} (or OpenRLHF's {list(OPENRLHF_ARCHITECTURES)})")
    return archs[0]
  if model_type not in _MODEL_TYPES:
    raise ValueError(f"{where}: no 'architectures' and model_type={model_type!r} is not "
                     f"supported; expected one of {sorted(_MODEL_TYPES)}")
  return _MODEL_TYPES[model_type]


# The JSON type of every config.json number or flag read here: Python's conversions took a
# string "false" as true, 16.7 as 16 and "abc" or null with an error naming neither the file nor
# the field. Null reads as absent, except for fields whose absence means a default (_NOT_NULL).
_FIELD_TYPES = {
    "vocab_size": int, "hidden_size": int, "intermediate_size": int, "num_hidden_layers": int,
    "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int,
    "max_position_embeddings": int, "sliding_window": int, "max_window_layers": int,
    "rms_norm_eps": float, "rope_theta": float, "partial_rotary_factor": float,
    "tie_word_embeddings": bool, "attention_bias": bool, "mlp_bias": bool,
    "use_sliding_window": bool,
}
_NOT_NULL = ("rms_norm_eps", "max_position_embeddings")  # (rope_theta: _rope_fields)
_ROPE_FIELD_TYPES = {"rope_theta": float, "factor": float, "low_freq_factor": float,
                     "high_freq_factor": float, "original_max_position_embeddings": int,
                     "partial_rotary_factor": float}


def check_types(obj: dict[str, Any], types: dict[str, type], where: str, prefix: str = ""):
  for key, kind in types.items():
    value = obj.get(key)
    if value is None:
      if key in obj and key in _NOT_NULL and not prefix:
        raise ValueError(f"{where}: {key}=null; expected a number (or leave it out)")
      continue
    ok = kind is bool if isinstance(value, bool) else (
        kind is not bool and isinstance(value, int if kind is int else (int, float)))
    if not ok:
      what = {bool: "true or false", int: "an integer", float: "a number"}[kind]
      raise ValueError(f"{where}: {prefix}{key}={value!r} ({type(value).__name__}); expected "
                       f"{what}")


def _rope_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
  """ModelConfig's rope_* fields: unscaled ("default") RoPE or Llama 3.1's "llama3" scaling.

  transformers >= 5 writes `rope_parameters` ({rope_type, rope_theta, ...}); older releases write
  `rope_theta` and `rope_scaling` ({type or rope_type, factor, ...} or null). Where both are
  present, they must agree on rope_type and rope_parameters' values are used (transformers 5
derives it from the legacy fields).
  """
  present = []  # (field, rope_type, params)
  for field in ("rope_parameters", "rope_scaling"):
    params = hf.get(field)
    if params is None:
      continue
    if not isinstance(params, dict):
      raise ValueError(f"{where}: {field}={params!r}; expected an object or null")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_KEYS:
      raise ValueError(f"{where}: {field} has rope_type={rope_type!r} ({params}); implemented: "
                       f"{sorted(_ROPE_KEYS)}")
    unknown = sorted(set(params) - _ROPE_KEYS[rope_type])
    if unknown:
      raise ValueError(f"{where}: {field} has key(s) {unknown} that rope_type={rope_type!r} "
                       f"does not use here (accepted: {sorted(_ROPE_KEYS[rope_type])})")
    check_types(params, _ROPE_FIELD_TYPES, where, f"{field}.")
    present.append((field, rope_type, params))
  if len({t for _, t, _ in present}) > 1:
    raise ValueError(f"{where}: rope_parameters and rope_scaling disagree on rope_type "
                     f"({present[0][1]!r} vs {present[1][1]!r})")
  field, rope_type, params = present[0] if present else ("rope_scaling", "default", {})
  for name, value in (("partial_rotary_factor", hf.get("partial_rotary_factor")),
                      (f"{field}.partial_rotary_factor", params.get("partial_rotary_factor"))):
    if value is not None and float(value) != 1.0:
      raise ValueError(f"{where}: {name}={value}; only full rotary embeddings (1.0) are "
                       "implemented")
  theta = params.get("rope_theta")
  theta = hf.get("rope_theta", 10000.0) if theta is None else theta
  if theta is None:
    raise ValueError(f"{where}: rope_theta=null and no {field}.rope_theta; expected a number")
  fields = dict(rope_theta=float(theta))
  if rope_type == "llama3":
    need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    absent = [k for k in need if params.get(k) is None]
    if absent:
      raise ValueError(f"{where}: {field} with rope_type='llama3' lacks {absent}")
    factor, low, high = (float(params[k]) for k in need[:3])
    old_len = int(params["original_max_position_embeddings"])
    if not (factor > 0 and 0 < low < high and old_len > 0):
      raise ValueError(f"{where}: {field} has factor={factor}, low_freq_factor={low}, "
                       f"high_freq_factor={high}, original_max_position_embeddings={old_len}; "
                       "rope_type='llama3' needs factor > 0, 0 < low_freq_factor < "
                       "high_freq_factor and original_max_position_embeddings > 0")
    fields.update(rope_type="llama3", rope_factor=factor, rope_low_freq_factor=low,
                  rope_high_freq_factor=high, rope_original_max_len=old_len)
  return fields


def _sliding_layers(hf: dict[str, Any], family: str, num_layers: int) -> list[int]:
  """Layers that HF would run with sliding-window attention (LLaMA: none; Mistral: all of them
  whenever sliding_window is set; Qwen2/3: per layer_types, or use_sliding_window from
  max_window_layers on)."""
  if family == "llama":
    return []
  if family == "mistral":
    return list(range(num_layers)) if window(hf, family) is not None else []
  if hf.get("layer_types") is not None:
    return [i for i, t in enumerate(hf["layer_types"]) if t != "full_attention"]
  if hf.get("use_sliding_window") and window(hf, family) is not None:
    first = hf.get("max_window_layers")
    return list(range(_QWEN_DEFAULT_MAX_WINDOW_LAYERS if first is None else int(first),
                      num_layers))
  return []


# transformers' defaults for keys a config.json may omit, where they differ from "none":
# MistralConfig(sliding_window=4096), Qwen2Config / Qwen3Config(sliding_window=4096,
# max_window_layers=28); Qwen3Config(head_dim=128) is QWEN3_DEFAULT_HEAD_DIM. (An
# explicit null window is kept.)
_DEFAULT_WINDOW = 4096
_QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28


def window(hf: dict[str, Any], family: str) -> Optional[int]:
  """The sliding window of config.json `hf` (transformers' default where it leaves it out; None:
  none)."""
  if "sliding_window" not in hf and (family == "mistral" or (
      family in ("qwen2", "qwen3") and hf.get("use_sliding_window"))):  # Qwen: None unless used
    return _DEFAULT_WINDOW
  return hf.get("sliding_window")


def model_fields(hf: dict[str, Any], where: str = CONFIG_FILE) -> tuple[str, dict[str, Any]]:
  """(the family, ModelConfig's fields) of a parsed HF config.json `hf` (`where`: its path, for
  the errors); a ValueError names the field of a model our decoder does not implement. The
  sliding window is checked against the run's max_seq_len apart (`sliding_window_error`)."""
  arch = architecture(hf, where)
  family, head = ARCHITECTURES[arch]
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads")
  absent = [k for k in required if hf.get(k) is None]
  if absent:
    raise ValueError(f"{where}: missing required field(s) {absent}")
  check_types(hf, _FIELD_TYPES, where)
  if hf.get("layer_types") is not None and not (isinstance(hf["layer_types"], list) and all(
      isinstance(t, str) for t in hf["layer_types"])):
    raise ValueError(f"{where}: layer_types={hf['layer_types']!r}; expected a list of strings")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"{where}: hidden_act={act!r} is not supported; expected 'silu' (SwiGLU)")
  if hf.get("mlp_bias"):
    raise ValueError(f"{where}: mlp_bias=true is not supported (our MLP has no biases)")
  # A quantized checkpoint (GPTQ, AWQ, FP8, bitsandbytes) stores its projections under other
  # names or with scale tensors: the tensor checks then reported "lacks tensor(s)" or "has
  # tensor(s) this config does not use" without saying why.
  quant = hf.get("quantization_config")
  if quant is not None:
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    raise ValueError(f"{where}: quantization_config is set (quant_method={method!r}): "
                     "quantized checkpoints are not supported; expected the unquantized model "
                     "(float32, bfloat16 or float16 weights)")
  # transformers 5 writes "dtype", 4 "torch_dtype"; a null one does not hide the other.
  key = "dtype" if hf.get("dtype") is not None else "torch_dtype"
  dtype_name = hf.get(key) or "float32"
  if dtype_name not in DTYPES:
    raise ValueError(f"{where}: {key}={dtype_name!r}; expected one of {list(DTYPES)}")
  if family == "qwen2":
    qkv_bias, o_bias = True, False
  elif family == "mistral":  # MistralAttention has no biases whatever the config says
    qkv_bias = o_bias = False
  else:  # LLaMA and Qwen3: attention_bias puts biases on q, k, v and o
    qkv_bias = o_bias = bool(hf.get("attention_bias", False))
  num_heads = int(hf["num_attention_heads"])
  if family == "qwen3" and "head_dim" not in hf:
    head_dim = QWEN3_DEFAULT_HEAD_DIM
  else:
    head_dim = int(hf.get("head_dim") or 0)
  if head_dim * num_heads == int(hf["hidden_size"]):
    head_dim = 0  # canonical form: ModelConfig derives it, so configs compare equal
  fields = dict(
      vocab_size=int(hf["vocab_size"]),
      hidden_size=int(hf["hidden_size"]),
      intermediate_size=int(hf["intermediate_size"]),
      num_layers=int(hf["num_hidden_layers"]),
      num_heads=num_heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
      head_dim=head_dim,
      **_rope_fields(hf, where),
      qk_norm=family == "qwen3",
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=qkv_bias,
      o_bias=o_bias,
      max_seq_len=int(hf.get("max_position_embeddings", 2048)),
      param_dtype=dtype_name,
      dtype=dtype_name,
      head=head,
      # A *ForSequenceClassification scores at its last token that is not pad_token_id.
      score_pad_id=_pad_id(hf, where) if head == "scalar" and not _openrlhf(hf) else -1,
  )
  return family, fields


def sliding_window_error(hf: dict[str, Any], family: str, num_layers: int, max_seq_len: int,
                         where: str = CONFIG_FILE) -> Optional[str]:
  """Why a model of config.json `hf` cannot run max_seq_len positions here (None if it can):
  layers with a sliding window shorter than that (sliding-window attention is not
  implemented). A window at least as long as any sequence we run is plain causal attention:
  HF lets query q see keys k > q - window, so with max_seq_len <= window every earlier key
  stays visible."""
  sliding = _sliding_layers(hf, family, num_layers)
  size = window(hf, family)
  if not sliding or size is None or int(size) >= max_seq_len:
    return None
  how = "model_type mistral" if family == "mistral" else "use_sliding_window / layer_types"
  return (f"{where}: sliding_window={size} is used by layers {sliding} ({how}) and is shorter "
          f"than max_seq_len={max_seq_len}; sliding-window attention is not implemented "
          f"(override max_seq_len <= {size} to load anyway)")


def _pad_id(hf: dict[str, Any], where: str) -> int:
  """config.json's pad_token_id as ModelConfig.score_pad_id (-1 when null or absent)."""
  pad = hf.get("pad_token_id")
  if pad is None:
    return -1
  if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
    raise ValueError(f"{where}: pad_token_id={pad!r}; expected null or a token id >= 0")
  return pad
