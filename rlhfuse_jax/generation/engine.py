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

`Generator` is the non-fused baseline on top of these: it compiles one prefill and one decode
executable ahead of time for (batch, prompt bucket, max_new_tokens) on a mesh, runs prefill and
then chunks until every row is done, reading only the [B] `done` vector between chunks.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Optional

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
STOP_REASONS = {STOP_RUNNING: "running", STOP_EOS: "eos", STOP_MAX_TOKENS: "max_new_tokens"}


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
  eos = live & (token == sampling.eos_id)  # eos_id = -1 never matches
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

  A done row still runs through the batched forward: it rewrites the keys/values of its final
  token at its own final position (the values that token has), so its cache stays a valid
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
  total number of decode steps of a batch is max(response_len) - 1). The one decode loop of the
  package: the baseline Generator and the fused instances (instances.decode_slots) both run it;
  each row's stop rule, its budget included, lives in the state (`_record`)."""

  def cond(carry):
    i, s = carry
    return (i < sampling.chunk_size) & ~jnp.all(s.done)

  def body(carry):
    i, s = carry
    return i + 1, decode_step(cfg, params, s, iteration_key, sampling)

  _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
  return state


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
  decode_steps: int = 0  # decode steps run (= max(response_lens) - 1)
  decode_chunks: int = 0  # jitted decode calls

  @property
  def generate_s(self) -> float:
    return self.prefill_s + self.decode_s

  @property
  def num_response_tokens(self) -> int:
    return int(self.response_lens.sum())

  @property
  def decode_steps_per_s(self) -> float:
    return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


def _as_typed_key(key) -> jax.Array:
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  return jax.random.wrap_key_data(key)  # raw uint32 key data from jax.random.PRNGKey


class Generator:
  """Non-fused baseline generator for fixed shapes (batch, prompt bucket, max_new_tokens).

  Compiles exactly one prefill and one decode-chunk executable (ahead of time, in `compile`),
  so nothing compiles in the middle of generation. Params must be placed by the caller (e.g.
  mesh.shard_params); the executables are specialised to their shardings.
  """

  def __init__(self, cfg: ModelConfig, sampling: SamplingConfig, *, batch_size: int,
               prompt_len: int, mesh: Optional[Mesh] = None, params: Any = None):
    if cfg.head != "lm":
      raise ValueError(f"generation needs an LM-head model (model.head='lm'), got {cfg.head!r}")
    sampling.check_vocab(cfg.vocab_size)
    if prompt_len < 1:
      raise ValueError(f"generation prompt_len={prompt_len}; expected >= 1")
    self.max_len = prompt_len + sampling.max_new_tokens
    if self.max_len > cfg.max_seq_len:
      raise ValueError(
          f"context too long: prompt bucket {prompt_len} + sampling.max_new_tokens="
          f"{sampling.max_new_tokens} = {self.max_len} exceeds model.max_seq_len="
          f"{cfg.max_seq_len}")
    self.mesh = mesh if mesh is not None else mesh_lib.make_mesh(
        mesh_lib.MeshConfig(data=1), jax.devices()[:1])
    multiple = mesh_lib.batch_size_multiple(self.mesh)
    if batch_size < 1 or batch_size % multiple:
      raise ValueError(f"generation batch_size={batch_size} must be a positive multiple of the "
                       f"data-parallel mesh size {multiple} (axes {mesh_lib.BATCH_AXES})")
    self.cfg, self.sampling = cfg, sampling
    self.batch_size, self.prompt_len = batch_size, prompt_len
    self.num_compiles = 0
    self._prefill = self._decode = None
    if params is not None:
      self.compile(params)

  def _param_shardings(self, params: Any) -> Any:
    rep = mesh_lib.replicated(self.mesh)
    mesh_devices = set(self.mesh.devices.flat)

    def one(x):
      sharding = getattr(x, "sharding", None)
      if sharding is None:  # host arrays: replicate onto the mesh
        return rep
      if set(sharding.device_set) != mesh_devices:
        raise ValueError(
            f"generation params live on {len(sharding.device_set)} device(s) but the generation "
            f"mesh has {len(mesh_devices)}; place them on the mesh first (parallel.mesh."
            f"shard_params or jax.device_put(params, replicated(mesh)))")
      return sharding
    return jax.tree.map(one, params)

  def compile(self, params: Any) -> None:
    """AOT-compiles prefill and decode for these params' shardings (arrays or
    ShapeDtypeStructs with .sharding)."""
    cfg, sampling, mesh = self.cfg, self.sampling, self.mesh
    b, p = self.batch_size, self.prompt_len
    self._param_sh = self._param_shardings(params)
    abstract_params = mesh_lib.abstract(params, self._param_sh)
    row1, row2 = mesh_lib.batch_sharding(mesh, 1), mesh_lib.batch_sharding(mesh, 2)
    rep = mesh_lib.replicated(mesh)
    self._state_sh = state_shardings(cfg, mesh)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)
    tokens = jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=row2)
    lens = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=row1)
    prefill_fn = functools.partial(prefill, cfg, sampling=sampling, max_len=self.max_len)
    self._prefill = jax.jit(
        prefill_fn, out_shardings=self._state_sh).lower(
            abstract_params, tokens, lens, lens, key).compile()
    state = jax.eval_shape(prefill_fn, abstract_params, tokens, lens, lens, key)
    state = self._state_struct = mesh_lib.abstract(state, self._state_sh)
    # The state is donated: XLA writes the new cache and buffers into the old ones in place, so
    # a chunk holds one KV cache, not two. The caller must drop its reference to the old state
    # (reusing a donated array raises).
    self._decode = jax.jit(
        lambda prm, st, k: decode_chunk(cfg, prm, st, k, sampling),
        out_shardings=self._state_sh, donate_argnums=(1,)).lower(
            abstract_params, state, key).compile()
    self.num_compiles += 2

  def place(self, params: Any) -> Any:
    """params on this generator's mesh, as its executables expect them (no copy when there)."""
    if self._prefill is None:
      self.compile(params)
    return mesh_lib.put(params, self._param_sh)

  def memory(self) -> dict:
    """XLA's own accounting of the compiled executables (bytes; nothing is allocated): the
    decode chunk's and prefill's temporaries, and the KV cache the decode state carries (the
    whole buffer: global, summed over devices)."""
    if self._decode is None:
      raise RuntimeError("Generator.memory() needs compiled executables: call compile() first")
    dec, pre = self._decode.memory_analysis(), self._prefill.memory_analysis()
    cache = self._state_struct.cache
    return {"decode_temp_bytes": int(dec.temp_size_in_bytes),
            "decode_argument_bytes": int(dec.argument_size_in_bytes),
            "prefill_temp_bytes": int(pre.temp_size_in_bytes),
            "cache_bytes": int(2 * cache.k.size * cache.k.dtype.itemsize)}

  def prefill(self, params, prompt_tokens, prompt_lens, uids, iteration_key) -> DecodeState:
    """Device-side prefill of host arrays (already validated and padded to the bucket)."""
    put = mesh_lib.put
    return self._prefill(params, put(prompt_tokens, mesh_lib.batch_sharding(self.mesh, 2)),
                         put(prompt_lens, mesh_lib.batch_sharding(self.mesh, 1)),
                         put(uids, mesh_lib.batch_sharding(self.mesh, 1)),
                         put(iteration_key, mesh_lib.replicated(self.mesh)))

  def decode_chunk(self, params, state: DecodeState, iteration_key) -> DecodeState:
    """One chunk; `state` is donated and must not be used afterwards."""
    return self._decode(params, state, iteration_key)

  def _check_inputs(self, prompt_tokens, prompt_lens, uids):
    b, p = self.batch_size, self.prompt_len
    prompt_tokens = np.asarray(prompt_tokens, np.int32)
    prompt_lens = np.asarray(prompt_lens, np.int32)
    if prompt_tokens.ndim != 2 or prompt_tokens.shape[0] != b or prompt_tokens.shape[1] > p:
      raise ValueError(f"prompt_tokens has shape {prompt_tokens.shape}; this generator takes "
                       f"[{b}, <= {p}] (batch_size, prompt bucket)")
    if prompt_lens.shape != (b,):
      raise ValueError(f"prompt_lens has shape {prompt_lens.shape}; expected ({b},)")
    if prompt_lens.min() < 1 or prompt_lens.max() > prompt_tokens.shape[1]:
      raise ValueError(f"prompt_lens must be in [1, {prompt_tokens.shape[1]}]; got min "
                       f"{prompt_lens.min()}, max {prompt_lens.max()}")
    padded = np.full((b, p), self.sampling.pad_id, np.int32)
    padded[:, :prompt_tokens.shape[1]] = prompt_tokens
    uids = np.arange(b, dtype=np.int32) if uids is None else np.asarray(uids, np.int32)
    if uids.shape != (b,):
      raise ValueError(f"uids has shape {uids.shape}; expected ({b},)")
    return padded, prompt_lens, uids

  def generate(self, params: Any, prompt_tokens, prompt_lens, iteration_key,
               uids=None) -> Rollout:
    """Generates one response per row.

    prompt_tokens: [B, <=P] right-padded (padded here to the bucket P); prompt_lens: [B];
    iteration_key: PRNG key of this iteration; uids: [B] sample ids (default 0..B-1). A sample's
    tokens depend only on (its prompt, its uid, iteration_key), not on its row.
    """
    tokens, lens, uids = self._check_inputs(prompt_tokens, prompt_lens, uids)
    params = self.place(params)
    key = _as_typed_key(iteration_key)
    t0 = time.perf_counter()
    state = self.prefill(params, tokens, lens, uids, key)
    done = mesh_lib.to_host(state.done)  # [B] bool: the only per-chunk host read
    t1 = time.perf_counter()
    chunks = 0
    while not done.all():
      state = self.decode_chunk(params, state, key)
      chunks += 1
      done = mesh_lib.to_host(state.done)
    t2 = time.perf_counter()
    out = mesh_lib.to_host({"tokens": state.tokens, "logprobs": state.logprobs,
                          "n": state.num_generated, "stop": state.stop_reason})
    return Rollout(
        prompt_tokens=tokens, prompt_lens=lens, response_tokens=np.asarray(out["tokens"]),
        response_lens=np.asarray(out["n"]), logprobs=np.asarray(out["logprobs"]),
        stop_reason=np.asarray(out["stop"]), uids=uids, prefill_s=t1 - t0, decode_s=t2 - t1,
        decode_steps=int(out["n"].max()) - 1, decode_chunks=chunks)
