"""Model shapes for the simulator: parameter counts, FLOPs per token and KV bytes per token.

Plain numpy/Python (the simulator never imports jax). `ModelShape` mirrors the fields of
`rlhfuse_jax.models.llama.ModelConfig` that cost depends on, and `num_params()` uses the same
formula (a test checks the two agree), so any config of ours simulates via `from_model_config`.

FLOP accounting (per token, forward):
  matmul FLOPs = 2 * (parameters used in matrix products) = 2 * (num_params - input embedding
                 - norm scales - biases), the usual "2N" rule (Kaplan et al. 2020, §2.1);
  attention    = 4 * layers * (heads * head_dim) * context   (QK^T and PV, 2 FLOPs per MAC),
                 where `context` is the number of keys the token attends to.
Training (forward + backward) is 3x the forward FLOPs (backward = 2x forward).
KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * bytes per element.
Bytes per element: `weight_itemsize` for the weights (and the gradients), `kv_itemsize` for the
KV cache and the activations (`act_itemsize`); 2 (bf16) for the papers' presets, a train_ppo
config's model.param_dtype and model.dtype in `from_model_config(..., dtypes=True)`
(trainer/sim_plan.workload: a train_config search, whose plans the trainer runs; ppo_tiny's
models are float32), a HF config.json's dtype in `from_hf_config`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

# These modules alone (docs/architecture.md §7: sim may import models.param_count and
# models.hf_config, no other models: they import no jax)
from rlhfuse_jax.models.hf_config import model_fields, read_json, sliding_window_error, window
from rlhfuse_jax.models.param_count import HEADS
from rlhfuse_jax.models.param_count import num_params as _num_params

ITEMSIZES = (2, 4)
# Bytes per element of the dtypes a ModelConfig names (models/llama._DTYPES).
DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# The ModelShape fields sized by a ModelConfig's dtype fields: the weights (and gradients) by
# param_dtype, the KV cache and activations by dtype.
ITEMSIZE_DTYPES = {"weight_itemsize": "param_dtype", "kv_itemsize": "dtype"}


def dtype_itemsizes(dtypes: Mapping[str, Any], where: str = "") -> dict:
  """{weight_itemsize, kv_itemsize} (ModelShape's fields) of a model's {param_dtype, dtype}
  (ITEMSIZE_DTYPES); a ValueError names `where` + model.<field> for a dtype not in
  DTYPE_ITEMSIZE."""
  out = {}
  for field, key in ITEMSIZE_DTYPES.items():
    dtype = dtypes[key]
    if dtype not in DTYPE_ITEMSIZE:
      raise ValueError(f"{where}model.{key}={dtype!r}: expected one of "
                       f"{sorted(DTYPE_ITEMSIZE)}")
    out[field] = DTYPE_ITEMSIZE[dtype]
  return out


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """What the cost of a LLaMA-style decoder depends on."""
  name: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int = 0  # 0: hidden_size // num_heads
  head: str = "lm"  # "lm" (actor, reference) or "scalar" (critic, reward model)
  tie_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False  # a bias on the attention's output projection (LLaMA's attention_bias)
  max_seq_len: int = 2048
  qk_norm: bool = False  # Qwen3's per-head q/k RMSNorm gains: 2 * head_dim params a layer
  weight_itemsize: int = 2  # bytes per weight (and gradient) element: bf16, or param_dtype's
  kv_itemsize: int = 2  # bytes per KV cache element: bf16, or the compute dtype's (model.dtype)
  # A run's optim.master_weights (rl/optim.float32_master): True, AdamW steps a float32 copy
  # of the weights with float32 moments; False, the moments take the weights' dtype (optax's
  # default). None: the papers' engines' mixed precision (float32 moments, and a float32 master
  # copy of 16-bit weights).
  master_weights: Optional[bool] = None

  def __post_init__(self):
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "max_seq_len"):
      if int(getattr(self, f)) <= 0:
        raise ValueError(f"shape {self.name!r}: {f}={getattr(self, f)} must be a positive int")
    if self.weight_itemsize not in ITEMSIZES or self.kv_itemsize not in ITEMSIZES:
      raise ValueError(f"shape {self.name!r}: weight_itemsize={self.weight_itemsize}, "
                       f"kv_itemsize={self.kv_itemsize}: expected bytes per element in "
                       f"{ITEMSIZES}")
    if int(self.head_dim) < 0:  # 0: hidden_size // num_heads; a negative one made KV bytes < 0
      raise ValueError(f"shape {self.name!r}: head_dim={self.head_dim} must be >= 0 (0: "
                       "hidden_size // num_heads)")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"shape {self.name!r}: num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head not in HEADS:
      raise ValueError(f"shape {self.name!r}: head={self.head!r}; expected one of {HEADS}")

  @property
  def act_itemsize(self) -> int:
    """Bytes per activation element: the compute dtype's (model.dtype), which the KV cache takes
    too (kv_itemsize): 2 for the papers' presets, 4 for a float32 run's (ppo_tiny)."""
    return self.kv_itemsize

  @property
  def head_dim_(self) -> int:
    return self.head_dim or self.hidden_size // self.num_heads

  def tensor_parallel_error(self, tp: int):
    """Why Megatron tensor parallelism of degree tp cannot split this model (None if it can):
    heads, KV heads and MLP width must each divide by tp (our pipelined update requires it of
    the heads and MLP width, trainer/pipelined.check_config, as Megatron-LM does; it also runs
    a tp that is a multiple of the KV heads, each kept whole, whose replicated KV cache the
    cost model does not price: refused here, docs/simulator.md)."""
    bad = [f"{f}={getattr(self, f)}" for f in ("num_heads", "num_kv_heads", "intermediate_size")
           if getattr(self, f) % tp]
    return f"tp{tp} does not divide {self.name}'s {', '.join(bad)}" if bad else None

  def optimizer_bytes_per_param(self) -> float:
    """Bytes of AdamW state per parameter (master_weights): m and v, and any float32 copy."""
    if self.master_weights is None:
      return 8.0 + (4.0 if self.weight_itemsize < 4 else 0.0)
    return 12.0 if self.master_weights else 2.0 * self.weight_itemsize

  def num_params(self) -> int:
    """Same count as ModelConfig.num_params() (models/param_count.py, which imports no jax)."""
    return _num_params(self)

  def layer_matmul_params(self) -> int:
    """Weights of one decoder layer that take part in matrix products (no norms or biases)."""
    e, f, d = self.hidden_size, self.intermediate_size, self.head_dim_
    return e * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * e + 3 * e * f

  def matmul_params(self) -> int:
    """Parameters that take part in matrix products (no embedding lookup, norms or biases)."""
    head = self.vocab_size * self.hidden_size if self.head == "lm" else self.hidden_size
    return self.num_layers * self.layer_matmul_params() + head

  def forward_flops(self, tokens: float, mean_context: float) -> float:
    """Forward FLOPs of `tokens` tokens attending on average to `mean_context` keys each."""
    attn = 4.0 * self.num_layers * self.num_heads * self.head_dim_ * mean_context
    return tokens * (2.0 * self.matmul_params() + attn)

  def kv_bytes_per_token(self) -> int:
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim_ * self.kv_itemsize

  def weight_bytes(self) -> float:
    return float(self.num_params() * self.weight_itemsize)

  def as_critic(self) -> "ModelShape":
    """The same backbone with a scalar head (critic / reward model)."""
    name = self.name if self.head == "scalar" else f"{self.name}-critic"
    return dataclasses.replace(self, head="scalar", name=name)

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self), "num_params": self.num_params()}


def stage_shape(shape: ModelShape, pp: int) -> ModelShape:
  """One of pp equal pipeline stages of `shape`: L/pp layers, the embedding and head spread
  evenly (vocab / pp), so pp stages hold the whole model's weights."""
  if shape.num_layers % pp:
    raise ValueError(f"pp={pp} must divide {shape.name}'s {shape.num_layers} layers")
  return dataclasses.replace(shape, name=f"{shape.name}/pp{pp}",
                             num_layers=shape.num_layers // pp,
                             vocab_size=max(1, shape.vocab_size // pp))


def end_params(shape: ModelShape) -> tuple[int, int]:
  """(embedding, LM head) parameters of `shape`: the head's 0 for a scalar head or one tied to
  the embedding; the final norm counts with the layers."""
  embed = shape.vocab_size * shape.hidden_size
  untied = shape.head == "lm" and not shape.tie_embeddings
  return embed, embed if untied else 0


def heaviest_stage_weight_bytes(shapes, pp: int) -> float:
  """Bytes of weights on the heaviest of pp pipeline stages that run `shapes` one after the
  other (the inference's frozen models): each stage holds 1/pp of every model's layers; the
  first also every model's whole embedding, the last every LM head (an embedding tied to it
  too: the last stage needs its own copy); the final norms and scalar heads (a few kB) are
  counted with the layers. stage_shape spreads the embedding and head evenly, which
  under-counts these two stages. pp = 1: every weight."""
  if pp == 1:
    return float(sum(s.weight_bytes() for s in shapes))
  first = last = 0.0
  for s in shapes:
    embed, untied = end_params(s)
    lm = s.vocab_size * s.hidden_size if s.head == "lm" else 0
    body = s.num_params() - embed - untied  # layers, final norm, a scalar head
    first += (body / pp + embed) * s.weight_itemsize
    last += (body / pp + lm) * s.weight_itemsize
  return float(max(first, last))


def from_model_config(cfg: Any, name: str = "custom", dtypes: bool = False,
                      master_weights: Optional[bool] = None) -> ModelShape:
  """A ModelShape from a `rlhfuse_jax.models.llama.ModelConfig` (read by attribute name, so the
  simulator does not import jax); with `dtypes` its weights and KV cache at the config's
  param_dtype and dtype (DTYPE_ITEMSIZE), else bf16 (a shape timed as the papers' engines run
  it); `master_weights`: the run's optim.master_weights (ModelShape.master_weights)."""
  sizes = {"master_weights": master_weights}
  if dtypes:
    sizes.update(dtype_itemsizes({k: getattr(cfg, k) for k in ITEMSIZE_DTYPES.values()}))
  return ModelShape(**sizes, name=name, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                    intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
                    num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim, head=cfg.head, tie_embeddings=cfg.tie_embeddings,
                    qkv_bias=cfg.qkv_bias, o_bias=getattr(cfg, "o_bias", False),
                    max_seq_len=cfg.max_seq_len, qk_norm=getattr(cfg, "qk_norm", False))


def from_hf_config(path: str, name: str) -> ModelShape:
  """The shape a Hugging Face config.json describes (`path`: the file or its model directory),
  read as the trainer's loader reads it (models/hf_config.model_fields, no jax): LLaMA,
  Mistral, Qwen2/2.5/3 fields, grouped-query heads, an explicit head_dim (Qwen3's default 128),
  tied embeddings, Qwen2's q/k/v biases (or `attention_bias`), Qwen3's q/k norms, the weights'
  dtype (the file's, float32 where it names none). A model the loader refuses is refused here
  with its message, naming the file and the field (another architecture, activation, RoPE
  scaling, quantized weights, a field of the wrong type). Its context (max_seq_len, which
  ablations.context_warnings compares with the sequences simulated) is max_position_embeddings,
  or the sliding window where layers use a shorter one: the trainer runs such a model only at
  max_seq_len <= the window (sliding-window attention is not implemented)."""
  file = os.path.join(path, "config.json") if os.path.isdir(path) else path
  try:
    hf = read_json(file)
    family, f = model_fields(hf, file)
  except (OSError, ValueError) as e:
    raise ValueError(f"shape {name!r}: {e}") from None
  context = f["max_seq_len"]
  if sliding_window_error(hf, family, f["num_layers"], context, file):
    context = int(window(hf, family))  # the longest the trainer loads it at
  dtypes = {k: f[k] for k in ITEMSIZE_DTYPES.values()}
  # its head as the file declares it: a *ForSequenceClassification's is scalar (refused as a
  # pair's actor by sim/ablations.py, as the trainer refuses it; it was sized with an LM head)
  return ModelShape(
      **dtype_itemsizes(dtypes), name=name, max_seq_len=context, head=f["head"],
      **{k: f[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                           "num_heads", "num_kv_heads", "head_dim", "tie_embeddings",
                           "qkv_bias", "o_bias", "qk_norm")})


def _llama1(name: str, hidden: int, inter: int, layers: int, heads: int) -> ModelShape:
  return ModelShape(name=name, vocab_size=32000, hidden_size=hidden, intermediate_size=inter,
                    num_layers=layers, num_heads=heads, num_kv_heads=heads, max_seq_len=2048)


# LLaMA (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models", Table 2:
# dimension / heads / layers for 6.7B, 13.0B, 32.5B, 65.2B; context 2048). Vocabulary 32000:
# the released tokenizer's size (the LLaMA 2 paper, Touvron et al. 2023b §2.2: "the same
# tokenizer as Llama 1 ... The total vocabulary size is 32k tokens"). FFN sizes from the
# released params.json: SwiGLU width 2/3 * 4d rounded up to a multiple of 256 (11008, 13824,
# 17920, 22016). Full multi-head attention (kv_heads = heads).
PRESET_SOURCE = "LLaMA-1, Touvron et al. 2023, Table 2"  # of every preset below
SHAPES: dict[str, ModelShape] = {
    "llama-7b": _llama1("llama-7b", 4096, 11008, 32, 32),
    "llama-13b": _llama1("llama-13b", 5120, 13824, 40, 40),
    "llama-33b": _llama1("llama-33b", 6656, 17920, 60, 52),
    "llama-65b": _llama1("llama-65b", 8192, 22016, 80, 64),
}


def get_shape(name: str, head: str = "lm", extra: Any = ()) -> ModelShape:
  """A preset shape, or one of `extra` ((name, ModelShape) pairs: a config's own, `shapes`),
  with a scalar head for head='scalar' (critic / reward model)."""
  known = {**SHAPES, **dict(extra)}
  if name not in known:
    raise ValueError(f"unknown model shape {name!r}; known: {sorted(known)} (a model of your "
                     "own: config.shapes='NAME=path/to/config.json')")
  shape = known[name]
  return shape.as_critic() if head == "scalar" else shape
