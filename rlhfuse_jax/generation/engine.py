"""Baseline generation: jitted prefill, then chunked decode over a donated, preallocated KV cache.

The engine is two pure functions over an explicit `DecodeState`:

  prefill(cfg, params, prompt_tokens, prompt_lens, uids, iteration_key, sampling, max_len,
          budget=None)
      -> DecodeState  (prompt run through a fresh cache, first response token sampled)
  decode_chunk(cfg, params, state, iteration_key, sampling) -> DecodeState
      (up to K = sampling.chunk_size decode steps in one `lax.while_loop`: the one decode loop,
      which the fused instances run too, generation/instances.py)

Every row (slot) carries its own position, sample uid, response budget and stop state, so rows
are independent: a row's tokens depend only on its prompt, its uid and the iteration key (see
sampling.py), never on the other rows. That is what lets the inter-stage fusion
(docs/architecture.md §2) move a row, with its KV cache row and its budget, into a slot of
another instance of the same shape and keep decoding it.

Response budget. `DecodeState.budget` [S] is each row's own response budget (<= max_new_tokens):
a row stops at EOS or once it holds `budget` tokens. It is part of the row's stop condition and
state, not of the loop, so one `decode_chunk` serves every caller and a migrated row takes its
budget along (the benchmark forces long-tailed lengths on an untrained model with it). The
default, max_new_tokens everywhere, is the plain stop rule; a budget of 0 marks an empty slot,
done right after prefill.

The drivers on top of these live in instances.py: a `GenerationInstance` compiles them ahead of
time for a mesh and S slots; the fused generator runs G of them, and `Generator`, the non-fused
baseline, is the one-instance case (the whole mesh, batch = slots).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlhfuse_jax.generation import sampling as sampling_lib
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.models import llama, sequences
from rlhfuse_jax.models.llama import KVCache, ModelConfig
from rlhfuse_jax.parallel import mesh as mesh_lib

STOP_RUNNING, STOP_EOS, STOP_MAX_TOKENS = 0, 1, 2


@flax.struct.dataclass
class DecodeState:
  """Everything decoding needs, per slot (S = batch slots, T = max_new_tokens).

  Invariant for a live row: the response so far is tokens[:num_generated]; the cache holds the
  keys/values of positions 0 .. position-1 (prompt, then response tokens except the newest);
  last_token = tokens[num_generated-1] sits at `position` = prompt_len + num_generated - 1 and
  is written to the cache by the next decode step.
  """
  cache: KVCache  # k, v: [layers, S, max_len, kv_heads, head_dim] (bits: llama.KVCache)
  last_token: jax.Array  # [S] int32 newest sampled token, input of the next step
  position: jax.Array  # [S] int32 cache position of last_token
  prompt_len: jax.Array  # [S] int32 real prompt tokens (positions 0..prompt_len-1)
  num_generated: jax.Array  # [S] int32 response tokens so far (EOS included)
  done: jax.Array  # [S] bool row finished (frozen from then on)
  stop_reason: jax.Array  # [S] int32 STOP_RUNNING / STOP_EOS / STOP_MAX_TOKENS
  uid: jax.Array  # [S] int32 sample id: selects the sample's RNG stream
  budget: jax.Array  # [S] int32 response budget, <= T (module docstring; 0: an empty slot)
  tokens: jax.Array  # [S, T] int32 response buffer, pad_id past num_generated
  logprobs: jax.Array  # [S, T] float32 behaviour log-probs, 0 past num_generated


def _record(state: DecodeState, token, logprob, sampling: SamplingConfig) -> DecodeState:
  """Appends token/logprob [S] to every live row and updates its stop state (EOS, else its
  budget reached); done rows keep every field (their writes go to column T, which `mode="drop"`
  discards)."""
  s, t_max = state.tokens.shape
  live = ~state.done  # [S]
  rows = jnp.arange(s)
  col = jnp.where(live, state.num_generated, t_max)  # [S]
  tokens = state.tokens.at[rows, col].set(token, mode="drop")
  logprobs = state.logprobs.at[rows, col].set(logprob, mode="drop")
  n = jnp.where(live, state.num_generated + 1, state.num_generated)
  eos = live & sampling.is_stop(token)
  full = live & (n >= state.budget)  # budget <= t_max (prefill clips it)
  stop = jnp.where(eos, STOP_EOS, jnp.where(full, STOP_MAX_TOKENS, state.stop_reason))
  return state.replace(
      last_token=jnp.where(live, token, state.last_token),
      num_generated=n, done=state.done | eos | full, stop_reason=stop.astype(jnp.int32),
      tokens=tokens, logprobs=logprobs)


def prefill(cfg: ModelConfig, params: Any, prompt_tokens, prompt_lens, uids,
            iteration_key: jax.Array, sampling: SamplingConfig, max_len: int,
            budget=None) -> DecodeState:
  """Runs right-padded prompts [S, P] through a fresh cache of max_len positions and samples
  each row's first response token from the logit at position prompt_len-1. budget: [S] response
  budgets (module docstring), clipped to max_new_tokens; None: max_new_tokens for every row.

  The padding behind a prompt is written into the cache too; decode overwrites those positions
  before any query can attend to them (llama.py), so it never influences a token.
  """
  s, _ = prompt_tokens.shape
  prompt_lens = prompt_lens.astype(jnp.int32)
  uids = uids.astype(jnp.int32)
  cache = KVCache.zeros(cfg, s, max_len)
  logits, cache = sequences.forward_at(cfg, params, prompt_tokens, (prompt_lens - 1)[:, None],
                                       cache=cache)  # logits [S, 1, V]
  zeros = jnp.zeros((s,), jnp.int32)
  keys = sampling_lib.sample_keys(iteration_key, uids, zeros)
  token, logprob = sampling_lib.sample_token(logits[:, 0], keys, sampling)
  t_max = sampling.max_new_tokens
  budget = (jnp.full((s,), t_max, jnp.int32) if budget is None
            else jnp.minimum(jnp.asarray(budget, jnp.int32), t_max))
  state = DecodeState(
      cache=cache, last_token=token, position=prompt_lens, prompt_len=prompt_lens,
      num_generated=zeros, done=jnp.zeros((s,), bool), stop_reason=zeros, uid=uids, budget=budget,
      tokens=jnp.full((s, t_max), sampling.pad_id, jnp.int32),
      logprobs=jnp.zeros((s, t_max), jnp.float32))
  return _record(state, token, logprob, sampling)


def decode_step(cfg: ModelConfig, params: Any, state: DecodeState, iteration_key: jax.Array,
                sampling: SamplingConfig) -> DecodeState:
  """One token for every live row.

  A done row still runs through the batched forward: it writes (or rewrites) the keys/values of
  its final token at its own final position (the values that token has), so its cache stays a valid
  prefix of its sequence, and `_record` leaves its tokens, log-probs and counters untouched.
  """
  logits, cache = llama.apply(cfg, params, state.last_token[:, None], state.position[:, None],
                              state.cache)  # logits [S, 1, V]
  keys = sampling_lib.sample_keys(iteration_key, state.uid, state.num_generated)
  token, logprob = sampling_lib.sample_token(logits[:, 0], keys, sampling)
  live = ~state.done
  state = state.replace(cache=cache, position=jnp.where(live, state.position + 1, state.position))
  return _record(state, token, logprob, sampling)


def decode_chunk(cfg: ModelConfig, params: Any, state: DecodeState, iteration_key: jax.Array,
                 sampling: SamplingConfig) -> DecodeState:
  """Up to K = sampling.chunk_size decode steps; stops early once every row is done (so the
  total number of decode steps of a batch is max(response_len) - 1, rounded up to a multiple
  of sampling.steps_per_check). The one decode loop of the package: every generation instance
  runs it (instances.decode_slots), the baseline Generator too; each row's stop rule, its budget
  included, lives in the state (`_record`)."""
  k = sampling.steps_per_check

  def cond(carry):
    i, s = carry
    return (i < sampling.chunk_size) & ~jnp.all(s.done)

  def body(carry):
    i, s = carry
    if k == 1:
      return i + 1, decode_step(cfg, params, s, iteration_key, sampling)
    # k steps with a static trip count: no loop condition to read back (SamplingConfig). A
    # step of a finished batch changes nothing (decode_step freezes done rows).
    s = jax.lax.fori_loop(0, k, lambda _, s: decode_step(cfg, params, s, iteration_key,
                                                         sampling), s)
    return i + k, s

  _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
  return state


def chunk_steps(sampling: SamplingConfig, remaining: int) -> int:
  """Decode steps one `decode_chunk` runs when its longest row needs `remaining` more: up to
  chunk_size, rounded up to whole groups of steps_per_check (the done test's granularity)."""
  k = sampling.steps_per_check
  return min(sampling.chunk_size, -(-max(1, remaining) // k) * k)


def state_shardings(cfg: ModelConfig, mesh: Mesh) -> DecodeState:
  """NamedShardings of a DecodeState: slots split over BATCH_AXES, KV heads over `tensor`
  when it divides them (as the attention weights are), everything else replicated."""
  ax = mesh_lib.BATCH_AXES
  tp = mesh.shape.get("tensor", 1)
  kv_axis = "tensor" if tp > 1 and cfg.num_kv_heads % tp == 0 else None
  kv = NamedSharding(mesh, P(None, ax, None, kv_axis, None))
  row, row_t = NamedSharding(mesh, P(ax)), NamedSharding(mesh, P(ax, None))
  return DecodeState(cache=KVCache(k=kv, v=kv, dtype=cfg.dtype), last_token=row, position=row,
                     prompt_len=row, num_generated=row, done=row, stop_reason=row, uid=row,
                     budget=row, tokens=row_t, logprobs=row_t)


@dataclasses.dataclass
class Rollout:
  """One batch of generated samples, on the host (numpy)."""
  prompt_tokens: np.ndarray  # [B, P] int32, right-padded with pad_id
  prompt_lens: np.ndarray  # [B] int32
  response_tokens: np.ndarray  # [B, T] int32, pad_id past response_lens
  response_lens: np.ndarray  # [B] int32, EOS included
  logprobs: np.ndarray  # [B, T] float32 behaviour log-probs (sampling.py), 0 past the length
  stop_reason: np.ndarray  # [B] int32 STOP_EOS or STOP_MAX_TOKENS
  uids: np.ndarray  # [B] int32
  prefill_s: float = 0.0  # wall time of prefill (including the first token)
  decode_s: float = 0.0  # wall time of all decode chunks
  # Decode steps that produced a token (= max(response_lens) - 1); with steps_per_check > 1 a
  # chunk may run up to steps_per_check - 1 more, which change nothing (engine.chunk_steps).
  decode_steps: int = 0
  decode_chunks: int = 0  # jitted decode calls

  @property
  def generate_s(self) -> float:
    return self.prefill_s + self.decode_s
