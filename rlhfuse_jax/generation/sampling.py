"""Token sampling with per-sample RNG streams (docs/architecture.md §1; §2 relies on them).

Every sample owns its random stream: the key for response token t of the sample with id `uid` is

  fold_in(fold_in(iteration_key, uid), t)

so the random stream never depends on the slot, instance or batch that decoded the sample, nor
on whether it was migrated between instances: only (iteration, uid, t) and the logits matter
(the logits' last bits may differ between programs of another shape, so tokens are bitwise
equal within one shape class: generation/instances.py).
`t` is the 0-based index of the token within the response (0 = first token after the prompt).

Behaviour log-probs. The log-prob recorded for a sampled token is

  log_softmax(logits / temperature)[token]   (temperature taken as 1 when greedy)

over the FULL vocabulary, without renormalising over the top-k / top-p survivors. That is exactly
what the trainer recomputes from a full forward (models/sequences.response_logprobs_and_entropy
with the same temperature), so the PPO ratio starts at 1. Truncation is treated as part of the
environment, as in common RLHF tools; the recorded value is not the probability that the
truncated sampler assigned to the token.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from rlhfuse_jax import fields


# The smallest temperature sampled with: logits / temperature must stay finite in float32
# (3.4e38) for every logit a model gives (|logit| < 1e32 here). Below it every positive logit
# became +inf: the draw took the lowest such id, not the argmax, and its log-prob was NaN.
# 1e-6 already samples the argmax but for logits within ~1e-5 of it; greedy=True is argmax.
MIN_TEMPERATURE = 1e-6


def _whole(x) -> bool:
  """Whether `x` is an integer value (an int, or an integral float such as 2.0; not a bool:
  eos_id=True was token 1, top_k=True greedy-like)."""
  if isinstance(x, (bool, np.bool_)):
    return False
  try:
    return int(x) == x
  except (TypeError, ValueError, OverflowError):  # None, a string, NaN, inf: refused, named
    return False


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How responses are drawn. Frozen and hashable: it is a static argument of the jitted code."""
  # Logits are divided by it (>= MIN_TEMPERATURE); ignored for sampling when greedy.
  temperature: float = 1.0
  top_k: int = 0  # keep the k most likely tokens; 0 disables
  top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p; 1 disables
  greedy: bool = False  # argmax decoding (no randomness)
  max_new_tokens: int = 16  # response budget T per sample (EOS included)
  eos_id: int = -1  # token that ends a response (it is kept in the response); -1: no EOS
  # Other tokens that end a response too (a tuple: the config is hashed); needs eos_id >= 0.
  extra_eos_ids: tuple[int, ...] = ()
  pad_id: int = 0  # fills response buffers past a sample's length
  chunk_size: int = 8  # decode steps K per jitted call; the host checks `done` between calls
  # Decode steps between the device's own "is every row done?" tests inside a chunk. Between
  # two tests the steps run as a fixed-trip-count loop: XLA:GPU evaluates a data-dependent loop
  # condition by copying it to the host and waiting (one sync per test), a known trip count
  # needs none. Costs at most steps_per_check - 1 idle steps after the last row finishes (done
  # rows are frozen: the tokens do not change). Must divide chunk_size; 1: a test every step.
  steps_per_check: int = 1

  def __post_init__(self):
    # A string or a bool ("0.7", True) failed a comparison without naming the field, or was
    # taken as a number (top_p=True) or a truth value (greedy="no" decoded argmax).
    if not isinstance(self.greedy, (bool, np.bool_)):
      raise ValueError(f"sampling.greedy={self.greedy!r}; expected True or False")
    object.__setattr__(self, "greedy", bool(self.greedy))
    # Greedy decoding ignores the temperature (its log-probs are at 1: logprob_temperature), so
    # temperature=0, the usual spelling of greedy, is accepted beside greedy=True.
    if not (fields.is_numeric(self.temperature) and (
        MIN_TEMPERATURE <= self.temperature < math.inf or
        self.greedy and 0 <= self.temperature < math.inf)):
      raise ValueError(f"sampling.temperature={self.temperature!r}; expected a finite number >= "
                       f"{MIN_TEMPERATURE:g}" + ("" if self.greedy else
                                                 " (use greedy=True for argmax decoding)"))
    if not _whole(self.top_k) or self.top_k < 0:
      raise ValueError(f"sampling.top_k={self.top_k}; expected an integer >= 0 (0 disables)")
    if not (fields.is_numeric(self.top_p) and 0 < self.top_p <= 1):
      raise ValueError(f"sampling.top_p={self.top_p!r}; expected in (0, 1] (1 disables)")
    for name in ("temperature", "top_p"):
      object.__setattr__(self, name, float(getattr(self, name)))
    if not _whole(self.max_new_tokens) or self.max_new_tokens < 1:
      raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens}; expected an integer >= 1")
    if not _whole(self.chunk_size) or self.chunk_size < 1:
      raise ValueError(f"sampling.chunk_size={self.chunk_size}; expected an integer >= 1")
    k = self.steps_per_check
    if not _whole(k) or k < 1 or self.chunk_size % k:
      raise ValueError(f"sampling.steps_per_check={k}; expected an integer >= 1 that divides "
                       f"sampling.chunk_size={self.chunk_size}")
    # An integral float (2.0) is taken as the integer: these size static shapes and loops,
    # where a float failed later, while tracing, without naming the field.
    for name in ("top_k", "max_new_tokens", "chunk_size", "steps_per_check"):
      object.__setattr__(self, name, int(getattr(self, name)))
    # Token ids are integers: eos_id=2.5 matched no token (no response ever ended on it) and
    # pad_id=0.5 padded with 0, both without a word.
    if not _whole(self.eos_id) or self.eos_id < -1:
      raise ValueError(f"sampling.eos_id={self.eos_id}; expected a token id >= 0, or -1 for none")
    if not _whole(self.pad_id) or self.pad_id < 0:
      raise ValueError(f"sampling.pad_id={self.pad_id}; expected a token id >= 0")
    for name in ("eos_id", "pad_id"):
      object.__setattr__(self, name, int(getattr(self, name)))
    extra = self.extra_eos_ids
    if isinstance(extra, (int, str)) or not all(
        _whole(i) and i >= 0 for i in extra):
      raise ValueError(f"sampling.extra_eos_ids={extra!r}; expected a sequence of token ids >= 0")
    if extra and self.eos_id < 0:
      raise ValueError(f"sampling.extra_eos_ids={extra!r} needs sampling.eos_id >= 0")
    object.__setattr__(self, "extra_eos_ids", tuple(int(i) for i in extra))

  def check_vocab(self, vocab_size: int) -> None:
    """Raises if a token id or top_k does not fit the model's vocabulary."""
    for name in ("eos_id", "pad_id", "extra_eos_ids"):
      value = getattr(self, name)
      if max((value,) if isinstance(value, int) else value, default=-1) >= vocab_size:
        raise ValueError(f"sampling.{name}={value} is outside the vocabulary "
                         f"(model.vocab_size={vocab_size})")
    if self.top_k > vocab_size:
      raise ValueError(f"sampling.top_k={self.top_k} exceeds model.vocab_size={vocab_size}")

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Every token that ends a response (empty when eos_id is -1)."""
    return ((self.eos_id,) if self.eos_id >= 0 else ()) + self.extra_eos_ids

  def is_stop(self, token):
    """Whether each token of `token` (any shape, jax or numpy) ends a response."""
    hit = token == self.eos_id  # eos_id = -1 never matches
    for i in self.extra_eos_ids:
      hit = hit | (token == i)
    return hit

  @property
  def logprob_temperature(self) -> float:
    """Temperature of the recorded behaviour log-probs (and of the trainer's recomputation)."""
    return 1.0 if self.greedy else float(self.temperature)


def sample_keys(iteration_key: jax.Array, uids, t):
  """Per-row keys [B] for response token t[b] of sample uids[b] (both [B] int32)."""
  return jax.vmap(lambda u, i: jax.random.fold_in(jax.random.fold_in(iteration_key, u), i))(
      jnp.asarray(uids, jnp.int32), jnp.asarray(t, jnp.int32))


def _sample_row(key, scaled, top_k: int, top_p: float):
  """One row: scaled [V] float32 logits (already divided by temperature) -> token id.

  top_k keeps exactly k tokens: a tie at the k-th logit goes to the lower ids (lax.top_k), where
  transformers and vLLM keep every token tied with it. Exact float ties there are rare, and
  keeping them would need a sort of the whole vocabulary per step instead of a top-k."""
  if top_k > 0:
    vals, idx = jax.lax.top_k(scaled, top_k)  # [k] sorted descending
  elif top_p < 1.0:
    idx = jnp.argsort(-scaled, stable=True)  # [V] most likely first, ties by lower id
    vals = scaled[idx]
  else:
    return jax.random.categorical(key, scaled)
  if top_p < 1.0:
    probs = jax.nn.softmax(vals)
    before = jnp.cumsum(probs) - probs  # probability of strictly more likely tokens
    # Keep a token while the mass before it is < top_p: the smallest set reaching top_p.
    vals = jnp.where(before < top_p, vals, -jnp.inf)
  return idx[jax.random.categorical(key, vals)]


def sample_token(logits, keys, cfg: SamplingConfig):
  """Draws one token per row.

  logits: [B, V] float32; keys: [B] typed PRNG keys (see sample_keys).
  Returns (tokens [B] int32, logprobs [B] float32) with logprobs as in the module docstring.
  """
  logits = logits.astype(jnp.float32)
  if cfg.greedy:
    tokens = jnp.argmax(logits, axis=-1)
  else:
    scaled = logits / cfg.temperature  # [B, V]
    tokens = jax.vmap(lambda k, s: _sample_row(k, s, cfg.top_k, cfg.top_p))(keys, scaled)
  tokens = tokens.astype(jnp.int32)
  logp_all = jax.nn.log_softmax(logits / cfg.logprob_temperature, axis=-1)  # [B, V]
  logprobs = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
  return tokens, logprobs


def as_typed_key(key) -> jax.Array:
  """A typed PRNG key from a typed key or raw uint32 key data (jax.random.PRNGKey)."""
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  return jax.random.wrap_key_data(key)
