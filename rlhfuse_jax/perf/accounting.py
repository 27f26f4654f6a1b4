"""How many bytes a decode step must move and how many FLOPs a PPO update does, for our models.

Achieved bandwidth and MFU are (work counted here) / (measured time); their fractions of a
device's peak use the presets of rlhfuse_jax.sim.hardware. The counts are the *useful* work of
the operation as our engine defines it, so anything the compiled program does beyond it (extra
copies of the cache, masked-out attention) shows up as a lower achieved fraction, never as a
higher one.

Decode step of `batch` rows whose attention reads `kv_len` cached positions per row (bytes read
from HBM; the roofline of the step):

  weight_bytes = (num_params - vocab * hidden) * param_bytes + batch * hidden * param_bytes
                 every parameter is read once; of an untied input embedding only the `batch`
                 looked-up rows are (with tied embeddings the table is read whole as the LM head,
                 so weight_bytes = num_params * param_bytes)
  kv_bytes     = 2 (K and V) * layers * batch * kv_len * kv_heads * head_dim * compute_bytes
                 kv_len is the live prefix, not the cache's capacity: a step at position t needs
                 the t keys before it, and our decode reads only the key blocks below the longest
                 live row (models/attention.cached_attention). Over a run of n decode steps after
                 a prompt of p tokens the mean live prefix is p + (n + 1) / 2 (`mean_live_len`).
  bytes/step   = weight_bytes + kv_bytes
  (not counted: the new K/V rows, activations and logits written, all O(batch * (hidden + vocab)))

One PPO update (trainer.ppo.make_update_fn: forward + backward + AdamW, actor then critic) on
`batch` samples of S = prompt_len + response_len tokens. Per model, forward FLOPs =

  batch * S * (2 * layers * layer_matmul_params + 4 * layers * heads * head_dim * (S + 1) / 2)
  + batch * response_len * 2 * hidden * head_width

  layer_matmul_params = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
                        + 3 * hidden * intermediate   (q, k, v, o and the SwiGLU MLP)
  attention: QK^T and PV at 2 FLOPs per multiply-add over the causal context, on average (S+1)/2
             keys per query (our kernel computes the full S x S scores and masks half of them;
             the masked half is not counted, as in the simulator's sim/shapes.py)
  head:      applied only at the response_len positions (models/sequences.forward_at); width =
             vocab (actor LM head) or 1 (critic scalar head); the input embedding is a lookup
  training = 3 x forward (backward = 2 x forward); the optimizer's O(params) work is ignored.

For reference the 6ND rule, 6 * (actor params + critic params) * batch * S, is reported too.
"""
from __future__ import annotations

from typing import Any, Optional

from rlhfuse_jax.sim import shapes

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _itemsize(dtype: str, field: str) -> int:
  if dtype not in ITEMSIZE:
    raise ValueError(f"{field}={dtype!r}; expected one of {list(ITEMSIZE)}")
  return ITEMSIZE[dtype]


def mean_live_len(prompt_len: int, decode_steps: int) -> float:
  """Mean live prefix a decode step attends over: step i (1-based) of a row with a p-token
  prompt writes position p + i - 1 and attends over p + i positions."""
  return prompt_len + (decode_steps + 1) / 2


def decode_step_bytes(cfg: Any, batch: int, kv_len: float) -> dict[str, int]:
  """Bytes read by one decode step whose rows attend over kv_len positions each (see module
  docstring). cfg: a models.llama.ModelConfig."""
  if batch < 1 or kv_len < 1:
    raise ValueError(f"batch={batch} and kv_len={kv_len} must be >= 1")
  p = _itemsize(cfg.param_dtype, "model.param_dtype")
  c = _itemsize(cfg.dtype, "model.dtype")
  table = cfg.vocab_size * cfg.hidden_size
  if cfg.tie_embeddings and cfg.head == "lm":
    weight = cfg.num_params() * p
  else:
    weight = (cfg.num_params() - table) * p + batch * cfg.hidden_size * p
  kv = 2 * cfg.num_layers * batch * kv_len * cfg.num_kv_heads * cfg.head_dim_ * c
  return {"weight_bytes": int(weight), "kv_bytes": int(kv), "total_bytes": int(weight + kv)}


def layer_matmul_params(cfg: Any) -> int:
  """Weights of one decoder layer that take part in matrix products (no norms or biases): the
  simulator's count of the same model."""
  return shapes.from_model_config(cfg).layer_matmul_params()


def forward_flops(cfg: Any, batch: int, seq_len: int, head_positions: int) -> float:
  """Forward FLOPs of `batch` causal sequences of `seq_len` tokens with the head applied at
  `head_positions` positions per row (see module docstring)."""
  backbone = 2.0 * cfg.num_layers * layer_matmul_params(cfg)
  attn = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim_ * (seq_len + 1) / 2.0
  head_width = cfg.vocab_size if cfg.head == "lm" else 1
  return (batch * seq_len * (backbone + attn) +
          batch * head_positions * 2.0 * cfg.hidden_size * head_width)


def ppo_update_flops(actor_cfg: Any, critic_cfg: Optional[Any], batch: int, prompt_len: int,
                     response_len: int) -> float:
  """Model FLOPs of one PPO update of the actor (and the critic, unless None). The lengths may
  be arrays of per-sample lengths with batch=1: the FLOPs of each sample (the trainer's
  perf/train_flops_per_s sums them)."""
  s = prompt_len + response_len
  total = 3.0 * forward_flops(actor_cfg, batch, s, response_len)
  if critic_cfg is not None:
    total += 3.0 * forward_flops(critic_cfg, batch, s, response_len)
  return total


def six_nd_flops(actor_cfg: Any, critic_cfg: Optional[Any], tokens: int) -> float:
  """The 6 * params * tokens rule of thumb over actor and critic."""
  n = actor_cfg.num_params() + (critic_cfg.num_params() if critic_cfg is not None else 0)
  return 6.0 * n * tokens


def fraction(achieved: float, peak: Optional[float]) -> Optional[float]:
  """achieved / peak, or None when the peak is unknown (e.g. on a CPU)."""
  return None if peak is None else achieved / peak
