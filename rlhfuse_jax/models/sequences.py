"""The prompt+response layout shared by generation, inference and the trainer's losses.

A sample is stored contiguously: prompt tokens at positions 0..p-1, response tokens at
p..p+r-1, padding after that (so a batch row is `[prompt | response | pad]`, and the width is
P + T for a prompt bucket P and T = max_new_tokens). Causal attention means nothing before a
position ever sees the padding behind it, so no padding mask is needed.

Response token t (0-based) sits at position p+t and is *predicted* by the logit at position
p-1+t; the critic's value of "the state before response token t" is read at the same position.
The reward model scores the whole sequence at `score_positions`: the last response token,
position p+r-1, or, with the model's score_pad_id set, the last token that is not that id.

All functions are pure, jittable and differentiable (the trainer takes gradients through
`response_logprobs_and_entropy` and `response_values`). The LM head is applied only at the T
response positions (`forward_at`), not at all P+T: with a 150k vocabulary the full logits of a
long batch would dwarf everything else in memory.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from rlhfuse_jax.models import llama
from rlhfuse_jax.models.llama import KVCache, ModelConfig


def build_sequences(prompt_tokens, prompt_lens, response_tokens, response_lens, pad_id: int):
  """Concatenates right-padded prompts and responses row by row.

  prompt_tokens: [B, P] right-padded; prompt_lens: [B]; response_tokens: [B, T];
  response_lens: [B]. Returns tokens [B, P+T] int32: prompt, then response, then pad_id.
  """
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  response_tokens = jnp.asarray(response_tokens, jnp.int32)
  b, p_width = prompt_tokens.shape
  t_width = response_tokens.shape[1]
  p = jnp.asarray(prompt_lens, jnp.int32)[:, None]  # [B, 1]
  r = jnp.asarray(response_lens, jnp.int32)[:, None]  # [B, 1]
  col = jnp.arange(p_width + t_width, dtype=jnp.int32)[None, :]  # [1, P+T]
  prompt_part = jnp.pad(prompt_tokens, ((0, 0), (0, t_width)))  # [B, P+T]
  resp_idx = jnp.clip(col - p, 0, t_width - 1)  # [B, P+T]
  resp_part = jnp.take_along_axis(response_tokens, resp_idx, axis=1)  # [B, P+T]
  out = jnp.where(col < p, prompt_part, jnp.where(col < p + r, resp_part, pad_id))
  return out.astype(jnp.int32)


def response_positions(prompt_lens, num_response: int):
  """[B, T] index of the position whose output predicts (or values) response token t."""
  p = jnp.asarray(prompt_lens, jnp.int32)[:, None]
  return p - 1 + jnp.arange(num_response, dtype=jnp.int32)[None, :]


def response_targets(tokens, positions):
  """[B, T] the token each of `positions` ([B, T], response_positions) predicts: the next one
  of `tokens` [B, L] (the log-probabilities' targets)."""
  return jnp.take_along_axis(tokens, positions + 1, axis=1)


def last_token_positions(prompt_lens, response_lens):
  """[B] position of the last response token (p+r-1)."""
  return jnp.asarray(prompt_lens, jnp.int32) + jnp.asarray(response_lens, jnp.int32) - 1


def response_mask(response_lens, num_response: int, xp: Any = jnp):
  """float32 [B, T]: 1.0 on real response tokens (EOS included), 0.0 on padding. `xp=numpy`
  builds it on the host: the same floats without tracing, lowering and loading its tiny device
  programs (the trainer's rollout bookkeeping, once per iteration and launch)."""
  t = xp.arange(num_response, dtype=xp.int32)[None, :]
  return (t < xp.asarray(response_lens, xp.int32)[:, None]).astype(xp.float32)


def forward_at(cfg: ModelConfig, params: Any, tokens, at, positions=None,
               cache: Optional[KVCache] = None):
  """Forward pass whose head runs only at the L-axis indices `at` [B, n].

  Returns (out, cache): out is float32 logits [B, n, vocab] (head="lm") or values [B, n]
  (head="scalar"); cache as in `llama.apply`.
  """
  return llama.apply(cfg, params, tokens, positions, cache, at)


def token_logprobs_and_entropy(logits, targets, temperature: float = 1.0):
  """log_softmax(logits/temperature) at targets, and the entropy of that distribution.

  logits: [..., V] float32; targets: [...] int. Returns (logprobs [...], entropy [...]).
  """
  logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  logp = jnp.take_along_axis(logp_all, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  probs = jnp.exp(logp_all)
  # an entry masked with -inf (probability 0) adds 0, not 0 * -inf = nan (value and gradient)
  entropy = -jnp.sum(probs * jnp.where(probs > 0, logp_all, 0.0), axis=-1)
  return logp, entropy


def token_logprobs(logits, targets, temperature: float = 1.0):
  """token_logprobs_and_entropy's log-probs alone, as the scoring forward needs them: the
  target's logit, shifted by the max, less the log-sum-exp of the shifted logits, so nothing of
  the logits' size is stored beside them. The same operations as jax.nn.log_softmax at the
  target: the same values (bit for bit on XLA:CPU). Through log_softmax, GSPMD with the
  vocabulary split over `tensor` stored its shifted copy beside the logits (the max's
  all-reduce sits between them): two copies of the share a device, as many bytes at tensor 2 as
  at tensor 1 (plan_check's actor_logp)."""
  x = logits.astype(jnp.float32) / temperature
  top = jax.lax.stop_gradient(jnp.max(x, axis=-1))
  lse = jnp.log(jnp.sum(jnp.exp(x - top[..., None]), axis=-1))
  hit = jnp.take_along_axis(x, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return (hit - top) - lse


def _response_logits(cfg: ModelConfig, params: Any, tokens, prompt_lens, num_response: int,
                     caller: str):
  """(logits [B, T, V], targets [B, T]) at the response positions of an LM-head model; a
  scalar head refused naming `caller`."""
  if cfg.head != "lm":
    raise ValueError(f"{caller} needs model.head='lm', got {cfg.head!r}")
  pos = response_positions(prompt_lens, num_response)  # [B, T]
  logits, _ = forward_at(cfg, params, tokens, pos)
  return logits, response_targets(tokens, pos)


def response_logprobs(cfg: ModelConfig, params: Any, tokens, prompt_lens, num_response: int,
                      temperature: float = 1.0):
  """response_logprobs_and_entropy's log-probs [B, T] alone (`token_logprobs`): the scoring
  forward's (inference/scoring.response_logprobs)."""
  logits, targets = _response_logits(cfg, params, tokens, prompt_lens, num_response,
                                     "response_logprobs")
  return token_logprobs(logits, targets, temperature)


def response_logprobs_and_entropy(cfg: ModelConfig, params: Any, tokens, prompt_lens,
                                  num_response: int, temperature: float = 1.0):
  """Per-response-token log-probs and entropies under `params` (an LM-head model).

  tokens: [B, P+T] from build_sequences; prompt_lens: [B]; num_response: T (static).
  Returns (logprobs [B, T], entropy [B, T]) in float32 of softmax(logits / temperature).
  Entries past a row's response length are meaningless (mask them with response_mask).
  """
  logits, targets = _response_logits(cfg, params, tokens, prompt_lens, num_response,
                                     "response_logprobs_and_entropy")
  return token_logprobs_and_entropy(logits, targets, temperature)


def response_values(cfg: ModelConfig, params: Any, tokens, prompt_lens, num_response: int):
  """Critic value of the state before each response token: [B, T] float32 (scalar head)."""
  if cfg.head != "scalar":
    raise ValueError(f"response_values needs model.head='scalar', got {cfg.head!r}")
  values, _ = forward_at(cfg, params, tokens, response_positions(prompt_lens, num_response))
  return values


def score_positions(tokens, prompt_lens, response_lens, pad_id: int):
  """[B] where a reward model reads each sequence's score: the last position of prompt +
  response whose token is not `pad_id` (transformers' *ForSequenceClassification pooling, which
  skips its pad_token_id; 0 when every token is it, as there); pad_id -1: the last response
  token (last_token_positions)."""
  last = last_token_positions(prompt_lens, response_lens)
  if pad_id < 0:
    return last
  col = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
  scored = (col <= last[:, None]) & (tokens != pad_id)
  return jnp.max(jnp.where(scored, col, 0), axis=1)


def sequence_scores(cfg: ModelConfig, params: Any, tokens, prompt_lens, response_lens):
  """Reward-model score of each whole sequence: [B] float32, read at its last response token,
  or with cfg.score_pad_id >= 0 at its last token that is not that id (`score_positions`)."""
  if cfg.head != "scalar":
    raise ValueError(f"sequence_scores needs model.head='scalar', got {cfg.head!r}")
  at = score_positions(tokens, prompt_lens, response_lens, cfg.score_pad_id)[:, None]  # [B, 1]
  values, _ = forward_at(cfg, params, tokens, at)
  return values[:, 0]
