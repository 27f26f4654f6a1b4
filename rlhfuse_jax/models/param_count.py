"""The parameter count of a decoder of the shape models/llama.py builds, from its config fields
alone (no jax): `ModelConfig.num_params` (models/llama.py) and the simulator's
`ModelShape.num_params` (sim/shapes.py, which imports no jax) both return it, so a flag that
adds parameters is counted in one place. tests/test_sim_presets.py checks it against the built
parameter tree for every such flag."""
from __future__ import annotations

# transformers' Qwen3Config(head_dim=128): a Qwen3 config.json that omits head_dim means 128,
# not hidden_size / num_attention_heads (Qwen3-0.6B: 1024 / 16 = 64). Read by the loader
# (models/hf_loader.py) and by the simulator's shapes (sim/shapes.py), which imports no jax.
QWEN3_DEFAULT_HEAD_DIM = 128
# The model's heads: "lm" (the actor's vocabulary logits) or "scalar" (the critic's and a reward
# model's value); num_params counts each. ModelConfig (models/llama.py) and the simulator's
# ModelShape (sim/shapes.py) accept these alone.
HEADS = ("lm", "scalar")


def num_params(m) -> int:
  """`m`: a ModelConfig or a ModelShape (hidden_size, intermediate_size, head_dim_, num_heads,
  num_kv_heads, qkv_bias, o_bias, qk_norm, num_layers, vocab_size, tie_embeddings, head)."""
  e, f, d = m.hidden_size, m.intermediate_size, m.head_dim_
  attn = e * d * (m.num_heads + 2 * m.num_kv_heads) + m.num_heads * d * e
  if m.qkv_bias:
    attn += d * (m.num_heads + 2 * m.num_kv_heads)
  if m.o_bias:
    attn += e
  if m.qk_norm:
    attn += 2 * d
  layer = attn + 3 * e * f + 2 * e  # + the two RMSNorm gains
  embed = m.vocab_size * e
  head = 0 if (m.tie_embeddings and m.head == "lm") else (
      m.vocab_size * e if m.head == "lm" else e + 1)  # the LM head, or the scalar head's w, b
  return m.num_layers * layer + embed + head + e  # + the final norm
