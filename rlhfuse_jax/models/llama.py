"""LLaMA-family decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) in flax linen.

One backbone serves the four RLHF roles: the actor and the reference use the language-model head
(`head="lm"`), the critic and the reward model a scalar head (`head="scalar"`).

Sequences are stored contiguously: prompt tokens at positions 0..p-1, response tokens from p on.
The KV cache is explicit (not a flax collection) so that generation can donate it, and so that the
inter-stage fusion can gather/scatter a sample's cache rows between instances:

  cache.k, cache.v: [layers, batch, max_len, kv_heads, head_dim] (the values' bits, KVCache)

A forward pass with a cache writes the new keys/values of row b at positions
positions[b, 0] .. positions[b, 0] + L - 1 (each row has its own offset), in place, then lets
query position t attend to cached keys at positions <= t, reading only the key blocks below the
longest live row (docs/architecture.md §5). Right-padded prompts therefore need no padding mask:
a real token only ever sees real tokens before it, and the padding slots behind a prompt are
overwritten by decode before any query can reach them.

Attention never needs more than O(len) memory per layer by default: `cfg.attention` picks the
implementation in models/attention.py (blockwise flash-style tiles unless "reference"), and
`cfg.remat` what each decoder Block keeps for the backward. Neither changes the parameter tree.

Parameters carry logical axis names (`embed`, `vocab`, `q_heads`, `kv_heads`, `mlp`) that
`rlhfuse_jax.parallel.mesh` maps onto the mesh axes. Under `shard_activations` (the unpipelined
update) every activation is also kept split over the batch axes, so FSDP does no repeated work.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from rlhfuse_jax.models import attention as attention_lib
from rlhfuse_jax.models import param_count

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
HEADS = param_count.HEADS
# How RoPE's frequencies are derived from rope_theta: "default" (theta ** (-2i/d)) or "llama3"
# (Llama 3.1+ long-context scaling, `rope_frequencies`).
ROPE_TYPES = ("default", "llama3")
# Per-Block rematerialisation: "none" keeps every activation for the backward; "full" keeps
# only each Block's input and recomputes the layer; "dots" also keeps the outputs of matmuls
# without batch dimensions (the q/k/v/o and MLP projections), so the backward recomputes only
# the cheap elementwise work and attention (whose own backward already recomputes its tiles).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a LLaMA-family decoder (LLaMA 1-3, Mistral, Qwen2/2.5, Qwen3)."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int = 0  # 0: hidden_size // num_heads
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections
  o_bias: bool = False
  max_seq_len: int = 2048
  # RoPE scaling (HF rope_scaling / rope_parameters). "llama3" divides the long wavelengths
  # (> rope_original_max_len / rope_low_freq_factor) by rope_factor, keeps the short ones
  # (< rope_original_max_len / rope_high_freq_factor) and blends in between; the rope_* factors
  # are read only then. The defaults are plain RoPE, as before these fields existed.
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  # Qwen3: an RMSNorm over head_dim (its own [head_dim] gain, shared by all heads) on every
  # query and key head after the projection, before RoPE. Adds attn/q_norm and attn/k_norm.
  qk_norm: bool = False
  param_dtype: str = "float32"
  dtype: str = "float32"  # compute dtype; norms, softmax and heads run in float32
  head: str = "lm"  # "lm" (actor, reference) or "scalar" (critic, reward model)
  # A reward model's sequence score (models/sequences.sequence_scores) is read at the last
  # token of prompt + response that is not this id: how transformers' *ForSequenceClassification
  # pools, at the last token that is not config.json's pad_token_id (read by hf_loader). With
  # pad = EOS (common in TRL-trained reward models) that is the token before the EOS, where the
  # model was trained to score. -1: at the last response token, EOS included (OpenRLHF's).
  score_pad_id: int = -1
  # reference | blockwise | cudnn | auto | pallas (models/attention.py). "pallas" is "auto" plus
  # a Pallas (Triton) kernel for one-token decode against the cache, which generation instances
  # on GPU also use for "auto" (attention.instance_attention).
  attention: str = "blockwise"
  # q/k/v as one matmul against their kernels concatenated per KV head ([embed, kv_heads,
  # (group + 2) x head_dim]), and gate/up as one against [embed, 2, mlp]: fewer, larger
  # kernels. The parameters are the same arrays under the same names (checkpoints and the HF
  # loader unchanged); outputs equal the separate projections to rounding. The per-KV-head
  # layout keeps a split of the heads over `tensor` local when it divides the KV heads. Costs
  # memory: the concatenated kernels (and in training their gradients) are buffers of their
  # own, on a CPU compile ~65 % of the layer weights for a decode chunk and about one more
  # copy of the parameters for a gradient step (docs/architecture.md §5).
  fused_projections: bool = False
  remat: str = "none"  # none | full | dots: what each Block keeps for the backward
  # One scanned Block instead of num_layers unrolled ones: params["layers"]["block"] leaves get
  # a leading [num_layers] axis (`stack_layers` / `unstack_layers` convert), and compile time
  # no longer grows with depth. A pipelined run reshapes the stack into its stages
  # ([L, ...] -> [stages, L/stages, ...], pipeline/stages.py).
  scan_layers: bool = False

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "max_seq_len"):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"model.{name}={getattr(self, name)} must be a positive integer")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"model.num_heads={self.num_heads} must be a multiple of "
                       f"model.num_kv_heads={self.num_kv_heads} (grouped-query attention)")
    if int(self.head_dim) < 0:  # (-2 passed the evenness check below and failed in init)
      raise ValueError(f"model.head_dim={self.head_dim}: expected 0 (hidden_size / num_heads) "
                       "or a positive even size")
    if self.head_dim == 0 and self.hidden_size % self.num_heads:
      raise ValueError(f"model.hidden_size={self.hidden_size} must be divisible by "
                       f"model.num_heads={self.num_heads} when model.head_dim is 0")
    if self.head_dim_ % 2:
      raise ValueError(f"model.head_dim={self.head_dim_} must be even (RoPE rotates pairs)")
    # (0, a negative or a NaN base made RoPE's inverse frequencies inf or NaN, and a negative
    # epsilon RMSNorm's rsqrt NaN: the logits were NaN, seen only once a run had compiled)
    if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
      raise ValueError(f"model.rope_theta={self.rope_theta}: expected a finite value > 0 "
                       "(RoPE's base)")
    if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps >= 0):
      raise ValueError(f"model.rms_norm_eps={self.rms_norm_eps}: expected a finite value >= 0")
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"model.rope_type={self.rope_type!r}; expected one of {ROPE_TYPES}")
    if self.rope_type == "llama3":
      if not self.rope_factor > 0 or not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
        raise ValueError(
            f"model.rope_factor={self.rope_factor}, rope_low_freq_factor="
            f"{self.rope_low_freq_factor}, rope_high_freq_factor={self.rope_high_freq_factor}: "
            "rope_type='llama3' needs factor > 0 and 0 < low_freq_factor < high_freq_factor")
      if int(self.rope_original_max_len) <= 0:
        raise ValueError(f"model.rope_original_max_len={self.rope_original_max_len} must be a "
                         "positive integer")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"model.{name}={getattr(self, name)!r}; expected one of {list(_DTYPES)}")
    if self.head not in HEADS:
      raise ValueError(f"model.head={self.head!r}; expected one of {HEADS}")
    if int(self.score_pad_id) < -1:
      raise ValueError(f"model.score_pad_id={self.score_pad_id}: expected -1 (score at the last "
                       "token) or a token id >= 0")
    if self.attention not in attention_lib.IMPLEMENTATIONS:
      raise ValueError(f"model.attention={self.attention!r}; expected one of "
                       f"{attention_lib.IMPLEMENTATIONS}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat={self.remat!r}; expected one of {tuple(REMAT_POLICIES)}")

  @property
  def head_dim_(self) -> int:
    return self.head_dim or self.hidden_size // self.num_heads

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    """Parameter count (used for FLOP estimates and the simulator)."""
    return param_count.num_params(self)


def cache_bits_dtype(dtype) -> jnp.dtype:
  """The dtype a KV cache of `dtype` values is stored in: uint16 for 16-bit floats.

  The cache holds raw bits: XLA:CPU runs bfloat16 scatters and copies in float32 over a
  converted copy of the whole operand (measured on the decode chunk: a float32 copy of the
  cache per step), while integer buffers are written and sliced as they are. Attention turns
  each block it reads back into values (`from_bits`) after slicing.
  """
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.uint16) if dtype.itemsize == 2 and jnp.issubdtype(
      dtype, jnp.floating) else dtype


def cache_bits(x: jax.Array) -> jax.Array:
  """Values -> the stored bits (`cache_bits_dtype`)."""
  bits = cache_bits_dtype(x.dtype)
  return x if bits == x.dtype else jax.lax.bitcast_convert_type(x, bits)


def from_bits(x: jax.Array, dtype) -> jax.Array:
  """The stored bits of a cache of `dtype` values -> values."""
  return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


@flax.struct.dataclass
class KVCache:
  """Per-row key/value cache. k, v: [layers, batch, max_len, kv_heads, head_dim], holding the
  values' bits (`cache_bits_dtype(dtype)`: uint16 for a bfloat16 cache); `dtype` names the
  values' dtype. Moving rows or bytes between caches needs no conversion either way."""
  k: jax.Array
  v: jax.Array
  dtype: str = flax.struct.field(pytree_node=False, default="float32")

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim_)
    dtype = jnp.dtype(dtype or cfg.jnp_dtype)
    bits = cache_bits_dtype(dtype)
    return cls(k=jnp.zeros(shape, bits), v=jnp.zeros(shape, bits), dtype=dtype.name)

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def values(self) -> tuple[jax.Array, jax.Array]:
    """(k, v) as `dtype` values."""
    return from_bits(self.k, self.dtype), from_bits(self.v, self.dtype)

  def nbytes_per_token(self) -> int:
    """Bytes one cached token of one row occupies (keys and values, all layers)."""
    layers, _, _, kv, d = self.k.shape
    return 2 * layers * kv * d * self.k.dtype.itemsize


# Activation sharding ---------------------------------------------------------------------------
# (mesh, logical rules) while a caller traces the model under `shard_activations`, else None.
_ACTIVATIONS: contextvars.ContextVar = contextvars.ContextVar("llama_activations", default=None)


@contextlib.contextmanager
def shard_activations(mesh: Optional[jax.sharding.Mesh], rules: Mapping[str, Any],
                      forward_only: bool = False):
  """FSDP inside the traced model: every activation stays split over the batch axes.

  `rules` maps logical axis names to mesh axes (parallel/mesh.LOGICAL_RULES); rules["batch"] are
  the batch axes. Without this, GSPMD may answer a weight sharded over fsdp on `embed` by
  resharding the activations to embed and all-reducing the product: the dot is not repeated,
  but its output [global batch, len, out] is then replicated over fsdp, and so is all that
  follows (attention, norms, the next layer): 30-60 % repeated FLOPs on a 7B shape
  (docs/results.md "Scale checks"). Under this context every activation keeps its batch dim
  split (`constrain_batch`), which leaves GSPMD the FSDP schedule: gather the weight, compute
  the local rows (docs/architecture.md §5, activations split under FSDP).

  Only for jit-level (GSPMD) callers such as trainer/ppo.make_update_fn: inside a shard_map body
  (the pipeline executor) the axes are manual and a constraint would be rejected, so the
  default, no context, leaves the model as it was; so does mesh=None (a caller without a mesh).

  Unrolled layers whose weights are split over a batch axis gather them one layer at a time.
  `forward_only` (the scoring forwards, inference/): each layer's shards are tied to the
  previous layer's input (`after_input`). Otherwise (the update's differentiated forward), with
  cfg.remat "full", each layer runs through `Transformer._gathered_layers`: an explicit gather
  tied likewise, and in the backward gathered again with the recomputed layer and its gradient
  reduce-scattered (after_input's tie alone would not do there: the backward kept every layer's
  gathered weights anyway, and the tied copies of the shards beside them). Remat "none" and
  "dots" keep the plain forward, whose backward holds every gathered layer: rematerialising the
  layer there would cost them a recomputed forward they chose not to pay (scanned layers hold
  one gathered layer at a time under any policy).
  """
  if mesh is None:
    yield
    return
  token = _ACTIVATIONS.set((mesh, dict(rules), forward_only))
  try:
    yield
  finally:
    _ACTIVATIONS.reset(token)


@contextlib.contextmanager
def no_activation_constraints():
  """Lifts an enclosing `shard_activations` while tracing a model applied to one data shard's
  rows under jax.vmap(spmd_axis_name=the batch axes) (trainer/ppo.py's gradient_sync="once"):
  there the vmapped axis already carries the batch axes, and a constraint naming them again
  inside would be rejected."""
  token = _ACTIVATIONS.set(None)
  try:
    yield
  finally:
    _ACTIVATIONS.reset(token)


def _axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes of one entry of a PartitionSpec or of the logical rules (None, a name or a
  tuple of names)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _mesh_axes(rules: Mapping[str, Any], name: Optional[str]) -> tuple[str, ...]:
  return _axes(rules.get(name) if name is not None else None)


def _opaque_zero(s: jax.Array) -> jax.Array:
  """+0 computed from `s` (a float32 scalar >= 0, or NaN): exact whatever `s` is, inf and NaN
  included, yet not a constant XLA could fold away, so what is tied to it waits for `s`."""
  return jnp.where(s < 1, s, 0.0) * 0.0


def constrain_batch(x: jax.Array) -> jax.Array:
  """x: [batch, ...] split over the batch axes of the active `shard_activations` (dims after the
  first are left to the compiler, so tensor-parallel splits of heads or vocab stay possible).
  A no-op outside the context, and where the batch axes have size 1 or do not divide the batch
  (one prompt scored alone)."""
  ctx = _ACTIVATIONS.get()
  if ctx is None:
    return x
  mesh, rules, _ = ctx
  axes = _mesh_axes(rules, "batch")
  n = math.prod(mesh.shape[a] for a in axes)
  if n == 1 or x.shape[0] % n:
    return x
  spec = P(axes, *([P.UNCONSTRAINED] * (x.ndim - 1)))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def after_input(x: jax.Array, params: Any, specs: Any) -> Any:
  """`params` (one layer's, placed by their logical `specs` under the active
  `shard_activations(..., forward_only=True)`), the same values, made to depend on `x` [batch,
  len, embed], the input of the layer before them: their fsdp gather then cannot start before
  that layer does.

  Unrolled layers have no loop to hold each layer's gather in: XLA (jax 0.10.2, XLA:CPU) issues
  every layer's all-gather at the program's start, so a forward holds all layers gathered, the
  whole model on every device (plan_check's actor_logp on 8 layers over fsdp=8: 38.4 MB of
  temporaries for 34.1 MB of weights, 5.7 MB scanned). With each layer's shards tied to the
  previous layer's input at most two layers are whole at once (the next one's gather may overlap
  the running layer): 10.2 MB. An optimisation barrier would say the same, but XLA:CPU drops
  barriers before it schedules, and the scheduler then hoists the gathers again.

  The tie is local to each device (a shard_map: no collective): every parameter shard minus an
  exact +0 computed from the first element of the device's first row of `x` (+0 whatever that
  element is, NaN and inf included), so the values, signed zeros too, are unchanged. It makes a
  copy of the shards: where no weight is split over a batch axis (data-only or tensor meshes)
  there is no gather to order, and `params` are returned as they are (tied, a data-only mesh's
  8-layer forward held 8.7 MB of temporaries instead of 0.9). For a forward that is not
  differentiated: `gather_layer` ties and gathers a differentiated one's layers."""
  mesh, rules, _ = _ACTIVATIONS.get()
  batch = _mesh_axes(rules, "batch")
  leaves, tree = jax.tree.flatten(params)
  if not _batch_split_axes(params, specs):
    return params  # no weight split over the batch axes, no gather to order: a copy for nothing
  places = [_param_spec(mesh, rules, spec, leaf.shape)
            for leaf, spec in zip(leaves, tree.flatten_up_to(specs))]
  rows = P(batch) if x.shape[0] % math.prod(mesh.shape[a] for a in batch) == 0 else P()
  first = jax.lax.with_sharding_constraint(x[:, 0, 0].astype(jnp.float32),
                                           NamedSharding(mesh, rows))  # [batch]

  def tie(first, leaves):
    zero = _opaque_zero(jnp.abs(first[0]))
    return [leaf - zero.astype(leaf.dtype) for leaf in leaves]

  tied = jax.shard_map(tie, mesh=mesh, in_specs=(rows, places), out_specs=places,
                       check_vma=False)(first, leaves)
  return jax.tree.unflatten(tree, tied)


def _batch_split_axes(params: Any, specs: Any) -> tuple[str, ...]:
  """The batch axes of the active `shard_activations` (of size > 1) that split some of one
  layer's `params` (placed by their logical `specs`): those its gather runs over."""
  leaves, tree = jax.tree.flatten(params)
  return _local_specs(leaves, tree.flatten_up_to(specs))[0]


def gather_layer(prev: jax.Array, params: Any, specs: Any) -> Any:
  """One layer's `params`, placed by their logical `specs` under the active
  `shard_activations`, gathered over the batch axes that split them (the other axes, tensor,
  left to GSPMD): an explicit all-gather (a shard_map manual over those axes only), whose
  transpose is a reduce-scatter of the gradient. Before gathering, each device ties its shards
  to `prev` [batch, len, ...], as `after_input` does (an exact -0, no collective): the gather
  cannot start before `prev` exists."""
  mesh, _, _ = _ACTIVATIONS.get()
  leaves, tree = jax.tree.flatten(params)
  manual, local = _local_specs(leaves, tree.flatten_up_to(specs))
  rows = P(manual) if prev.shape[0] % math.prod(mesh.shape[a] for a in manual) == 0 else P()
  first = jax.lax.stop_gradient(prev[:, 0, 0].astype(jnp.float32))  # [batch]

  def gather(first, leaves):
    zero = _opaque_zero(jnp.abs(first[0]))
    out = []
    for leaf, place in zip(leaves, local):
      leaf = leaf - zero.astype(leaf.dtype)
      for k, axes in enumerate(place):
        if axes is not None:
          leaf = jax.lax.all_gather(leaf, axes, axis=k, tiled=True)
      out.append(leaf)
    return out

  whole = jax.shard_map(gather, mesh=mesh, in_specs=(rows, local),
                        out_specs=[P() for _ in local], axis_names=set(manual),
                        check_vma=False)(first, leaves)
  return jax.tree.unflatten(tree, whole)


def _after_shards(x: jax.Array, shards: Any, specs: Any) -> jax.Array:
  """x, made to depend on every leaf of `shards` (one layer's reduce-scattered gradient, placed
  as its parameters by their logical `specs`) through an exact -0 that each device computes
  from its own shards (no collective): the backward of the layer before cannot start until
  this layer's gradient is reduced, so no whole gradient waits for its reduce-scatter."""
  mesh, _, _ = _ACTIVATIONS.get()
  leaves, tree = jax.tree.flatten(shards)
  manual, local = _local_specs(leaves, tree.flatten_up_to(specs))

  def zero(leaves):  # +0, whatever the shards hold
    return _opaque_zero(sum(jnp.abs(leaf.reshape(-1)[0].astype(jnp.float32)) for leaf in leaves))
  z = jax.shard_map(zero, mesh=mesh, in_specs=(local,), out_specs=P(), axis_names=set(manual),
                    check_vma=False)(leaves)
  return x - z.astype(x.dtype)


def _local_specs(leaves: list, specs: list) -> tuple[tuple[str, ...], list]:
  """(the batch axes of size > 1 that split some of `leaves`, each leaf's mesh spec restricted
  to those axes) for one layer's parameters placed by their logical `specs`."""
  mesh, rules, _ = _ACTIVATIONS.get()
  places = [_param_spec(mesh, rules, spec, leaf.shape) for leaf, spec in zip(leaves, specs)]
  manual = tuple(a for a in _mesh_axes(rules, "batch") if mesh.shape[a] > 1 and any(
      a in _axes(axes) for place in places for axes in place))

  def only(axes):
    kept = tuple(a for a in _axes(axes) if a in manual)
    return None if not kept else kept[0] if len(kept) == 1 else kept
  return manual, [P(*(only(axes) for axes in place)) for place in places]


def _param_spec(mesh: jax.sharding.Mesh, rules: Mapping[str, Any], logical: Any,
                shape: tuple[int, ...]) -> P:
  """The mesh spec parallel/mesh.param_shardings places a parameter of `shape` by: each logical
  axis on its rule's mesh axes, replicated where their size does not divide the dimension."""
  out = []
  for dim, name in zip(shape, tuple(logical) + (None,) * (len(shape) - len(logical))):
    axes = _mesh_axes(rules, name)
    out.append(axes if axes and dim % math.prod(mesh.shape[a] for a in axes) == 0 else None)
  return P(*out)


# Megatron-style tensor parallelism inside a shard_map (pipeline/executor.py): the block runs
# on a local config (heads and MLP width divided by the tensor size) with column-split q/k/v,
# gate and up kernels and row-split o and down kernels. Two conjugate operators bracket each
# of the attention and the MLP (Shoeybi et al. 2019, "f" and "g"): on entry the replicated
# input's gradient is summed over the tensor devices; on exit the partial outputs are summed.
_TENSOR_AXIS: contextvars.ContextVar = contextvars.ContextVar("llama_tensor_axis", default=None)


@contextlib.contextmanager
def tensor_parallel(axis: Optional[str]):
  """While active (tracing inside a shard_map whose manual axes include `axis`), Attention and
  MLP sum their row-split outputs over `axis` and their input gradients likewise. None: no-op."""
  token = _TENSOR_AXIS.set(axis)
  try:
    yield
  finally:
    _TENSOR_AXIS.reset(token)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _enter(x, axis):  # identity forward, psum of the gradient backward
  return x


def _enter_fwd(x, axis):
  return x, None


def _enter_bwd(axis, _, g):
  return (jax.lax.psum(g, axis),)


_enter.defvjp(_enter_fwd, _enter_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _exit(x, axis):  # psum forward, identity backward
  return jax.lax.psum(x, axis)


def _exit_fwd(x, axis):
  return jax.lax.psum(x, axis), None


def _exit_bwd(axis, _, g):
  return (g,)


_exit.defvjp(_exit_fwd, _exit_bwd)


def tp_enter(x: jax.Array) -> jax.Array:
  axis = _TENSOR_AXIS.get()
  return x if axis is None else _enter(x, axis)


def tp_exit(x: jax.Array) -> jax.Array:
  axis = _TENSOR_AXIS.get()
  return x if axis is None else _exit(x, axis)


def _kernel_init(logical):
  return nn.with_logical_partitioning(nn.initializers.normal(0.02), logical)


def _bias_init(logical):
  return nn.with_logical_partitioning(nn.initializers.zeros, logical[-1:])


def _dense(features, logical, cfg: ModelConfig, name: str, use_bias: bool = False):
  """A Dense layer (parameters `name`/kernel, `name`/bias). With a bias, the bias is added in
  float32 (`_fused_matmul`): flax's nn.Dense adds it in the compute dtype, so in bfloat16 its
  gradient, the sum of the output's cotangents over every token, was summed in bfloat16 too
  (36 % off at 131k tokens on XLA:CPU)."""
  if use_bias:
    return lambda x: _fused_matmul(
        x, *_Kernel(features, logical, cfg, True, name=name)(x.shape[-1]), cfg)
  return nn.Dense(
      features, use_bias=False, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
      kernel_init=_kernel_init(logical), name=name)


class _Kernel(nn.Module):
  """The parameters of a `_dense` layer without its matmul (same names, shapes, initialisers
  and logical axes, so the same values for a seed): `fused_projections` multiplies several at
  once. Returns (kernel [in, features], bias [features] or None), not yet cast."""
  features: int
  logical: tuple
  cfg: ModelConfig
  use_bias: bool = False

  @nn.compact
  def __call__(self, in_features: int):
    dt = self.cfg.jnp_param_dtype
    kernel = self.param("kernel", _kernel_init(self.logical), (in_features, self.features), dt)
    bias = (self.param("bias", _bias_init(self.logical), (self.features,), dt)
            if self.use_bias else None)
    return kernel, bias


def _fused_matmul(x, kernel, bias, cfg: ModelConfig):
  """x [..., in] @ kernel [in, *out] in the compute dtype, as nn.Dense does, + bias [*out] added
  in float32 and cast once (the same value; its gradient summed over tokens in float32)."""
  x, kernel = x.astype(cfg.jnp_dtype), kernel.astype(cfg.jnp_dtype)
  y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
  if bias is None:
    return y
  return (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(cfg.jnp_dtype)


def _qkv(x, cfg: ModelConfig):
  """q [b, l, h, d], k and v [b, l, kvh, d] from x [b, l, embed] (cfg local to a tensor shard
  inside the pipeline executor). Separate Dense layers, or with cfg.fused_projections one
  matmul against the kernels concatenated per KV head: [embed, kvh, (g + 2) d], each KV head's
  g query heads then its key and value, so heads split over `tensor` stay on their device."""
  b, l, e = x.shape
  h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim_
  names = (("q_proj", h, "q_heads"), ("k_proj", kvh, "kv_heads"), ("v_proj", kvh, "kv_heads"))
  if not cfg.fused_projections:
    return tuple(_dense(n * d, ("embed", ax), cfg, name, cfg.qkv_bias)(x).reshape(b, l, n, d)
                 for name, n, ax in names)
  params = [_Kernel(n * d, ("embed", ax), cfg, cfg.qkv_bias, name=name)(e)
            for name, n, ax in names]
  kernel = jnp.concatenate([k.reshape(e, kvh, -1) for k, _ in params], axis=2)
  bias = (None if not cfg.qkv_bias else
          jnp.concatenate([bb.reshape(kvh, -1) for _, bb in params], axis=1))
  y = _fused_matmul(x, kernel, bias, cfg)  # [b, l, kvh, (g + 2) d]
  g = h // kvh
  return (y[..., :g * d].reshape(b, l, h, d), y[..., g * d:(g + 1) * d],
          y[..., (g + 1) * d:])


class RMSNorm(nn.Module):
  """RMSNorm over the last axis with a learned gain.

  per_head: the gain of Qwen3's q/k norm, applied inside Attention's tensor-parallel region
  where each device holds only its share of the heads: its gradient there covers only those
  heads, so `tp_enter` sums it over the tensor devices (identity outside tensor_parallel).
  """
  cfg: ModelConfig
  per_head: bool = False

  @nn.compact
  def __call__(self, x):  # x: [..., embed] (or [..., head_dim] if per_head)
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x.shape[-1],), self.cfg.jnp_param_dtype)
    if self.per_head:
      scale = tp_enter(scale)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
    return (y * scale.astype(jnp.float32)).astype(self.cfg.jnp_dtype)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
  """RoPE's inverse frequencies [head_dim/2], float32, computed as transformers does.

  "default": theta ** (-2i/d). "llama3" (transformers' `_compute_llama3_parameters`, Llama 3.1+):
  with wavelength w = 2 pi / f and L = rope_original_max_len, frequencies with
  w > L / low_freq_factor are divided by `factor`, those with w < L / high_freq_factor kept,
  and those between interpolated by s = (L / w - low) / (high - low): (1 - s) f / factor + s f.
  """
  d = cfg.head_dim_
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [dim/2]
  if cfg.rope_type == "default":
    return inv_freq
  factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  old_len = cfg.rope_original_max_len
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.where(medium, smoothed, scaled)


def rope(x, positions, inv_freq):
  """Rotary embedding, HF "rotate_half" layout. x: [batch, len, heads, dim]; positions:
  [batch, len]; inv_freq: [dim/2] (`rope_frequencies`)."""
  d = x.shape[-1]
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, len, dim/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [batch, len, 1, dim]
  x32 = x.astype(jnp.float32)
  rotated = jnp.concatenate([-x32[..., d // 2:], x32[..., :d // 2]], axis=-1)
  return (x32 * jnp.cos(emb) + rotated * jnp.sin(emb)).astype(x.dtype)


def write_cache(cache, layer: int, new, start):
  """Writes new[b] into layer `layer` of the stacked cache, row b, from position start[b].

  cache: [layers, batch, max_len, kv, dim] (bits, see `cache_bits`); new: [batch, len, kv,
  dim] already in the cache's bits; start: [batch]. One scatter whose batch dimension is the
  cache's own batch dimension (operand_batching_dims), so the SPMD partitioner keeps each row's
  write on the row's device, and XLA writes the len tokens into the cache in place: no copy of
  the layer or of the cache (docs/architecture.md §5, in-place KV cache).
  """
  b, l = new.shape[:2]
  pos = start[:, None] + jnp.arange(l, dtype=start.dtype)[None, :]  # [batch, len]
  idx = jnp.stack([jnp.full_like(pos, layer), pos], axis=-1)  # [batch, len, 2] (layer, pos)
  dnums = jax.lax.ScatterDimensionNumbers(
      update_window_dims=(2, 3), inserted_window_dims=(0, 2),
      scatter_dims_to_operand_dims=(0, 2), operand_batching_dims=(1,),
      scatter_indices_batching_dims=(0,))
  return jax.lax.scatter(cache, idx, new, dnums, indices_are_sorted=True, unique_indices=True,
                         mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@flax.struct.dataclass
class CacheView:
  """What one layer's attention gets of the KV cache: the whole stacked arrays (bits, written
  and read in place, then handed to the next layer), the layer's index, the values' dtype and
  a bound on the live length."""
  k: jax.Array  # [layers, batch, max_len, kv_heads, head_dim], KVCache's bits
  v: jax.Array
  live_len: jax.Array  # int32 scalar: no query of this call sits at a position >= live_len
  layer: Any  # the layer's index: an int, or an int32 scalar inside the scan over layers
  dtype: str = flax.struct.field(pytree_node=False, default="float32")


class Attention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, cache: Optional[CacheView] = None):
    """x: [batch, len, embed]; positions: [batch, len]; cache: the KV cache (or None). Writes
    this call's keys/values at `positions` (row b from positions[b, 0]) and attends over the
    cache. Returns (out, cache with the new keys/values)."""
    cfg = self.cfg
    b, l, _ = x.shape
    h, d = cfg.num_heads, cfg.head_dim_
    x = tp_enter(x)
    q, k, v = _qkv(x, cfg)
    if cfg.qk_norm:  # Qwen3: normalise each head's query and key, then rotate
      q = RMSNorm(cfg, per_head=True, name="q_norm")(q)
      k = RMSNorm(cfg, per_head=True, name="k_norm")(k)
    # [batch, len, heads, dim] each, kept on the local rows so attention is not repeated.
    inv_freq = rope_frequencies(cfg)
    q = constrain_batch(rope(q, positions, inv_freq))
    k = constrain_batch(rope(k, positions, inv_freq))
    v = constrain_batch(v)
    if cache is None:
      # [batch, len, heads, dim]; O(len) memory unless cfg.attention == "reference".
      out = attention_lib.dot_product_attention(q, k, v, positions, positions, cfg.attention)
    else:
      if l > cache.k.shape[2]:  # (static shapes; a position past the end is the caller's)
        raise ValueError(f"{l} tokens written at once into a KV cache of {cache.k.shape[2]} "
                         "positions: they would land out of bounds and give wrong logits "
                         "without an error; size the cache for prompt + new tokens")
      kc = write_cache(cache.k, cache.layer, cache_bits(k.astype(cache.dtype)), positions[:, 0])
      vc = write_cache(cache.v, cache.layer, cache_bits(v.astype(cache.dtype)), positions[:, 0])
      # attention.cache_attention_path: the Pallas kernel (live blocks, looped on the device),
      # every slot with static shapes (the oracle, and GPU decode: no host round trip per key
      # block), or the live-prefix loop reading the cache in place.
      path = attention_lib.cache_attention_path(cfg.attention, l)
      if path == "kernel":
        out = attention_lib.kernel_decode_attention(q, kc, vc, cache.layer, positions,
                                                    cache.dtype)
      elif path == "whole":
        keys = jnp.broadcast_to(jnp.arange(kc.shape[2]), (b, kc.shape[2]))
        out = attention_lib.reference_attention(
            q, from_bits(kc[cache.layer], cache.dtype), from_bits(vc[cache.layer], cache.dtype),
            positions, keys)
      else:
        out, kc, vc = attention_lib.cached_attention(
            q, kc, vc, cache.layer, positions, cache.live_len,
            load=functools.partial(from_bits, dtype=cache.dtype))
      cache = cache.replace(k=kc, v=vc)
    out = constrain_batch(out.reshape(b, l, h * d))
    out = tp_exit(_dense(cfg.hidden_size, ("q_heads", "embed"), cfg, "o_proj", cfg.o_bias)(out))
    return constrain_batch(out), cache


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    x = tp_enter(x)
    if cfg.fused_projections:  # one matmul against [embed, 2, mlp] (ModelConfig)
      (wg, _), (wu, _) = (_Kernel(cfg.intermediate_size, ("embed", "mlp"), cfg, name=name)(
          x.shape[-1]) for name in ("gate_proj", "up_proj"))
      y = _fused_matmul(x, jnp.stack([wg, wu], axis=1), None, cfg)
      gate, up = constrain_batch(y[..., 0, :]), constrain_batch(y[..., 1, :])
    else:
      gate = constrain_batch(_dense(cfg.intermediate_size, ("embed", "mlp"), cfg, "gate_proj")(x))
      up = constrain_batch(_dense(cfg.intermediate_size, ("embed", "mlp"), cfg, "up_proj")(x))
    return constrain_batch(tp_exit(
        _dense(cfg.hidden_size, ("mlp", "embed"), cfg, "down_proj")(nn.silu(gate) * up)))


class Block(nn.Module):
  """One decoder layer (pre-norm attention + pre-norm SwiGLU MLP)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, cache: Optional[CacheView] = None):
    x = constrain_batch(x)  # [batch, len, embed]
    attn_out, cache = Attention(self.cfg, name="attn")(
        RMSNorm(self.cfg, name="attn_norm")(x), positions, cache)
    x = constrain_batch(x + attn_out)
    x = x + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg, name="mlp_norm")(x))
    return constrain_batch(x), cache


def block_class(cfg: ModelConfig):
  """Block, wrapped in nn.remat with cfg.remat's policy. The wrapper keeps the module name given
  by the parent (layers_i), so the parameter tree is the same for every policy."""
  if cfg.remat == "none":
    return Block
  return nn.remat(Block, policy=REMAT_POLICIES[cfg.remat])


class _ScanStep(nn.Module):
  """One step of the scan over layers: ((x, cache view), positions) -> (x, view of the next
  layer). Its params are one Block's, stacked [num_layers, ...] by nn.scan."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, carry, positions):
    x, view = carry
    x, view = block_class(self.cfg)(self.cfg, name="block")(x, positions, view)
    if view is not None:
      view = view.replace(layer=view.layer + 1)
    return (x, view), None


def stack_layers(params: Any, num_layers: int) -> Any:
  """Unrolled params (layers_0 .. layers_{n-1}) -> the scan_layers tree (layers/block, every
  leaf stacked on a new leading axis). Leaves may be numpy or jax arrays."""
  names = [f"layers_{i}" for i in range(num_layers)]
  missing = [n for n in names if n not in params]
  if missing:
    raise ValueError(f"stack_layers: params lack {missing[:3]} (expected {num_layers} layers "
                     "layers_0..; already stacked?)")
  xp = lambda x: np if isinstance(x, np.ndarray) else jnp  # noqa: E731 keep host arrays on host
  block = jax.tree.map(lambda *xs: xp(xs[0]).stack(xs), *[params[n] for n in names])
  out = {k: v for k, v in params.items() if k not in names}
  out["layers"] = {"block": block}
  return out


def stage_stack(params: Any, num_layers: int, stages: int) -> Any:
  """Unpipelined params (unrolled or scan_layers) -> {"embed", "layers", "head"} with every
  layer leaf [stages, num_layers / stages, ...]: row s holds layers s*L/S .. (s+1)*L/S - 1. The
  stage-stacked layout both pipelines use (pipeline/stages.py for training,
  generation/pipelined.py for generation)."""
  if "layers_0" in params:
    params = stack_layers(params, num_layers)
  per = num_layers // stages
  layers = jax.tree.map(lambda x: x.reshape((stages, per) + x.shape[1:]),
                        params["layers"]["block"])
  return {"embed": params["embed"], "layers": layers, "head": params["head"]}


def unstack_layers(params: Any) -> Any:
  """Inverse of `stack_layers`."""
  if "layers" not in params or "block" not in params["layers"]:
    raise ValueError("unstack_layers: params have no layers/block (not a scan_layers tree)")
  block = params["layers"]["block"]
  n = jax.tree.leaves(block)[0].shape[0]
  out = {k: v for k, v in params.items() if k != "layers"}
  for i in range(n):
    out[f"layers_{i}"] = jax.tree.map(lambda x: x[i], block)
  return out


# Stage computations: parts of the forward pass that a pipeline stage runs (pipeline/stages.py,
# inference/stages.py); Transformer, defined below, is looked up when they run.
def embed_tokens(cfg: ModelConfig, embed_params: Any, tokens: jax.Array) -> jax.Array:
  """tokens [mb, L] -> hidden [mb, L, H]."""
  return Transformer(cfg).apply({"params": {"embed": embed_params}}, tokens,
                                method=lambda m, t: m.embed(t))


def run_layers(cfg: ModelConfig, layers: Any, x: jax.Array,
               gather: Optional[Callable[[Any], Any]] = None,
               select: Optional[Callable[[Any], Any]] = None) -> jax.Array:
  """Runs the stacked layers [layers_per_stage, ...] of one stage: [mb, L, H] -> [mb, L, H].

  `gather` (inside a shard_map) turns one layer's parameter shards into the whole layer just
  before it runs (FSDP inside a stage). The gather and the layer are then rematerialised
  together: a vjp keeps only each layer's shards and input, and its backward gathers the layer
  again, so one layer is whole at a time (otherwise every gathered layer of the stage would be
  kept for the backward). `select` (also inside the shard_map) then picks what this device
  runs of the whole layer (the executor's shared KV head), without rematerialising."""
  positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])

  def layer(h, p):
    p = p if select is None else select(p)
    with attention_lib.positions_are_indices():  # they are: skip the tiles above the diagonal
      return block_class(cfg)(cfg).apply({"params": p}, h, positions)[0]

  if gather is None:
    body = lambda h, p: (layer(h, p), None)
  else:
    gathered = jax.checkpoint(lambda h, p: layer(h, gather(p)),
                              policy=jax.checkpoint_policies.nothing_saveable)
    body = lambda h, p: (gathered(h, p), None)

  return jax.lax.scan(body, x, layers)[0]


def run_head(cfg: ModelConfig, embed_params: Any, head_params: Any, x: jax.Array) -> jax.Array:
  """Final norm + head on hidden [mb, n, H]: logits [mb, n, V] or values [mb, n] (float32)."""
  return Transformer(cfg).apply(
      {"params": {"embed": embed_params, "head": head_params}}, x,
      method=lambda m, h: m.head(h, m.embed))


@jax.custom_vjp
def _lookup(table, tokens):
  """jnp.take(table, tokens, axis=0), whose gradient is added up in float32 and cast to the
  table's dtype once. jax's own transpose of the lookup is a scatter-add in the table's dtype: in
  bfloat16 a token that occurs often (BOS, the chat template's, a space) stops growing once its
  running sum is ~256x one occurrence's cotangent (a token making up half of 8 x 520 tokens got
  a gradient row 33 % short). The forward is the same gather, so outputs are unchanged."""
  return jnp.take(table, tokens, axis=0)


def _lookup_fwd(table, tokens):
  # the residual's zero-width [vocab, 0] array carries the table's row count and dtype statically
  return jnp.take(table, tokens, axis=0), (tokens, jnp.zeros((table.shape[0], 0), table.dtype))


def _lookup_bwd(res, g):
  tokens, proto = res
  grad = jnp.zeros((proto.shape[0], g.shape[-1]), jnp.float32).at[tokens].add(
      g.astype(jnp.float32))
  return grad.astype(proto.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


class Embed(nn.Module):
  cfg: ModelConfig

  def setup(self):
    self.embedding = self.param(
        "embedding", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
        (self.cfg.vocab_size, self.cfg.hidden_size), self.cfg.jnp_param_dtype)

  def __call__(self, tokens):  # [batch, len] -> [batch, len, embed]
    return constrain_batch(_lookup(self.embedding, tokens).astype(self.cfg.jnp_dtype))

  def attend(self, x):  # tied LM head: [batch, len, embed] -> [batch, len, vocab]
    return jnp.einsum("ble,ve->blv", x.astype(jnp.float32), self.embedding.astype(jnp.float32))


class Head(nn.Module):
  """Final norm + LM head (float32 logits [batch, len, vocab]) or scalar head ([batch, len])."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, embed: Optional[Embed] = None):
    cfg = self.cfg
    x = RMSNorm(cfg, name="final_norm")(x)
    if cfg.head == "scalar":
      w = self.param("value_head", nn.with_logical_partitioning(
          nn.initializers.normal(0.02), ("embed", None)), (cfg.hidden_size, 1),
                     cfg.jnp_param_dtype)
      b = self.param("value_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                     (1,), cfg.jnp_param_dtype)
      return (x.astype(jnp.float32) @ w.astype(jnp.float32) + b.astype(jnp.float32))[..., 0]
    if cfg.tie_embeddings:
      return constrain_batch(embed.attend(x))
    w = self.param("lm_head", nn.with_logical_partitioning(
        nn.initializers.normal(0.02), ("embed", "vocab")), (cfg.hidden_size, cfg.vocab_size),
                   cfg.jnp_param_dtype)
    return constrain_batch(x.astype(jnp.float32) @ w.astype(jnp.float32))  # [batch, len, vocab]


class Transformer(nn.Module):
  """The whole decoder. Param tree: embed, layers_0..layers_{n-1}, head."""
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embed = Embed(cfg)
    if cfg.scan_layers:
      self.layers = nn.scan(
          _ScanStep, variable_axes={"params": 0}, split_rngs={"params": True},
          in_axes=nn.broadcast, length=cfg.num_layers,
          metadata_params={nn.PARTITION_NAME: "layers"})(cfg, name="layers")
    else:
      self.layers = [block_class(cfg)(cfg) for _ in range(cfg.num_layers)]
    self.head = Head(cfg)

  def __call__(self, tokens, positions=None, cache: Optional[KVCache] = None, at=None):
    """tokens: [batch, len] int32; positions: [batch, len] (default 0..len-1); at: [batch, n]
    indices along len where the head runs (default every position: with a 150k vocabulary the
    logits of all positions of a long batch would dwarf everything else in memory).

    Returns (out, cache): out is float32 logits [batch, len or n, vocab] for head="lm", values
    [batch, len or n] for head="scalar"; cache is the updated KVCache (None if none was given).
    """
    # Default positions without a cache are the indices: blockwise attention then skips the key
    # tiles above the diagonal (attention.positions_are_indices).
    indices = positions is None and cache is None
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    with attention_lib.positions_are_indices(indices):
      return self._forward(tokens, positions, cache, at)

  def _forward(self, tokens, positions, cache, at):
    x = self.embed(tokens)
    if cache is not None and cache.k.dtype != cache_bits_dtype(cache.dtype):
      raise ValueError(f"KVCache of {cache.dtype} values must hold {cache_bits_dtype(cache.dtype)} "
                       f"bits, got k of dtype {cache.k.dtype} (build it with KVCache.zeros)")
    view = None if cache is None else CacheView(
        k=cache.k, v=cache.v, dtype=cache.dtype, layer=jnp.int32(0),
        live_len=jnp.max(positions).astype(jnp.int32) + 1)
    context = _ACTIVATIONS.get()
    if self.cfg.scan_layers:
      (x, view), _ = self.layers((x, view), positions)
    elif (context is not None and not context[2] and view is None and self.cfg.remat == "full"
          and _batch_split_axes(self.layers[0].variables["params"],
                                logical_specs(self.cfg)["layers_0"])):
      x = self._gathered_layers(x, positions)
    elif context is None or not context[2]:
      for i, layer in enumerate(self.layers):
        x, view = layer(x, positions, None if view is None else view.replace(layer=i))
    else:  # a GSPMD forward with fsdp-split weights: each layer's gather waits for the last
      params = [layer.variables["params"] for layer in self.layers]
      specs = logical_specs(self.cfg)
      for i, p in enumerate(params):
        if i + 1 < len(params):
          params[i + 1] = after_input(x, params[i + 1], specs[f"layers_{i + 1}"])
        x, view = block_class(self.cfg)(self.cfg, parent=None).apply(
            {"params": p}, x, positions, None if view is None else view.replace(layer=i))
    if at is not None:
      x = constrain_batch(jnp.take_along_axis(x, at[:, :, None], axis=1))  # [batch, n, embed]
    out = self.head(x, self.embed)
    if view is not None:
      cache = KVCache(k=view.k, v=view.v, dtype=cache.dtype)
    return out, cache

  def _gathered_layers(self, x, positions):
    """Unrolled layers of a differentiated GSPMD forward (under `shard_activations`, forward_only
    False) whose weights are split over a batch axis, with cfg.remat "full", run as the
    pipeline executor's `run_layers` runs them with a gather: each layer gathers its own shards
    (`gather_layer`: an all-gather whose transpose reduce-scatters the gradient) and is
    rematerialised whole with that gather, as "full" rematerialises it anyway. Its backward
    (`_gathered_block`) gathers the layer again once the layer's output cotangent exists and
    reduce-scatters its gradient, instead of keeping every layer's gathered weights and whole
    all-reduced gradient from the forward to the optimizer (docs/results.md "Unrolled layers in
    the scoring forwards")."""
    specs = logical_specs(self.cfg)
    # The backward is traced after this forward returns, outside the contexts it runs in
    # (shard_activations, attention's positions_are_indices): it runs in a copy of them.
    context = contextvars.copy_context()
    prev = x
    for i, block in enumerate(self.layers):
      # layer i's gather waits for layer i - 1 to start (its input `prev`)
      layer = _GatheredLayer(self.cfg, specs[f"layers_{i}"], context)
      x, prev = _gathered_block(layer, prev, x, block.variables["params"], positions), x
    return x


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity (static in vjp)
class _GatheredLayer:
  """One unrolled layer of `Transformer._gathered_layers`: its config, its parameters' logical
  specs and the contexts its backward is traced in."""
  cfg: ModelConfig
  specs: Any
  context: contextvars.Context

  def __call__(self, after: jax.Array, x: jax.Array, params: Any, positions: jax.Array):
    """The Block on x [batch, len, embed] with its shards gathered once `after` exists."""
    whole = gather_layer(after, params, self.specs)
    return Block(self.cfg, parent=None).apply({"params": whole}, x, positions)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gathered_block(layer: _GatheredLayer, prev, x, params, positions):
  """layer(prev, x, params, positions): a layer whose gather waits for `prev`. Its vjp keeps
  only x and the shards; the backward runs the layer again with the gather tied to the output's
  cotangent, so no gathered layer is live from the forward into the backward (jax.checkpoint
  alone is not enough on XLA:CPU: it drops the barrier that keeps the recomputed gather apart,
  and the gather is then shared with the forward's), and ties the input's cotangent to the
  reduce-scattered gradient (`_after_shards`)."""
  return layer(prev, x, params, positions)


def _gathered_block_fwd(layer, prev, x, params, positions):
  return layer(prev, x, params, positions), (x, params, positions)


def _gathered_block_bwd(layer, res, g):
  x, params, positions = res

  def backward():
    _, vjp = jax.vjp(lambda x, p: layer(jax.lax.stop_gradient(g), x, p, positions), x, params)
    dx, dparams = vjp(g)
    return _after_shards(dx, dparams, layer.specs), dparams
  dx, dparams = layer.context.run(backward)
  return None, dx, dparams, None


_gathered_block.defvjp(_gathered_block_fwd, _gathered_block_bwd)


def _init_boxed(cfg: ModelConfig, rng: jax.Array) -> Any:
  """flax's init: the parameters (boxed with their logical axis names) that a forward pass of
  two tokens creates. The attention implementation and remat do not change the parameter tree
  or the random values (flax derives each parameter's key from its module path), so the
  forward traced is the cheapest one: whole-cache attention, nothing rematerialised."""
  cheap = cfg.replace(attention="reference", remat="none")
  # Also when a forward asks for its specs while it is traced (Transformer._forward under
  # shard_activations(forward_only=True)): a model of its own, none of that forward's context.
  with no_activation_constraints():
    return Transformer(cheap, parent=None).init(rng, jnp.zeros((1, 2), jnp.int32))["params"]


def _init_arrays(cfg: ModelConfig, rng: jax.Array) -> Any:
  return nn.unbox(_init_boxed(cfg, rng))


def init_params(cfg: ModelConfig, rng: jax.Array, shardings: Any = None) -> tuple[Any, Any]:
  """Returns (params, logical_specs): params as plain arrays, logical axis names per leaf.

  The parameters are made by one compiled program. (Run eagerly, flax's init is about a
  thousand small ops, each compiled on its first use in a process: 3.1 s for a one-layer toy
  model against 1.1 s compiled whole, 2026-12-01, 2-core CPU.) With `shardings` (one sharding
  for all, or one per parameter leaf in the parameters' tree, e.g. mesh.param_shardings of
  `param_shapes(cfg)`), each device holds only its own shards, so the whole model never sits on
  one device. The values do not depend on the shardings; with jax's partitionable threefry (its
  default) each device also draws only its own shards' random bits."""
  return init_program(cfg, shardings)(rng), logical_specs(cfg)


def init_program(cfg: ModelConfig, shardings: Any = None) -> Any:
  """init_params' jitted rng -> params function (lower it to read what each device holds).
  One per config and placement in a process (a second trainer of the same models neither
  traces nor compiles it again)."""
  if shardings is None or isinstance(shardings, jax.sharding.Sharding):
    return _init_program(cfg, shardings)
  return _init_program(cfg, tuple(jax.tree.leaves(shardings)))


@functools.lru_cache(maxsize=16)
def _init_program(cfg: ModelConfig, shardings: Any) -> Any:
  if isinstance(shardings, tuple):  # the leaves of a tree shaped as the parameters
    shardings = jax.tree.unflatten(jax.tree.structure(param_shapes(cfg)), shardings)
  return jax.jit(functools.partial(_init_arrays, cfg), out_shardings=shardings)


@functools.lru_cache(maxsize=16)
def _abstract_boxed(cfg: ModelConfig) -> Any:
  return jax.eval_shape(functools.partial(_init_boxed, cfg), jax.random.key(0))


def param_shapes(cfg: ModelConfig) -> Any:
  """ShapeDtypeStructs of init_params(cfg)'s parameters (nothing is allocated or compiled; the
  trace is cached per config, the returned tree is a new one each call)."""
  return nn.unbox(_abstract_boxed(cfg))


def logical_specs(cfg: ModelConfig) -> Any:
  """Logical axis names of every parameter, without allocating the parameters (cached per
  config, as param_shapes)."""
  return nn.get_partition_spec(_abstract_boxed(cfg))


def apply(cfg: ModelConfig, params, tokens, positions=None, cache: Optional[KVCache] = None,
          at=None):
  """Functional forward: see Transformer.__call__."""
  return Transformer(cfg).apply({"params": params}, tokens, positions, cache,
                                None if at is None else jnp.asarray(at, jnp.int32))


def host_random_params(cfg: ModelConfig, seed: int, std: float = 0.1) -> Any:
  """Random weights drawn with numpy on the host: N(0, std), norm scales N(1, std).

  For tests and benchmarks: no flax initialiser is compiled (seconds per model on CPU), and the
  caller places the numpy arrays wherever the model runs.
  """
  shapes = param_shapes(cfg)
  rng = np.random.default_rng(seed)

  def draw(path, s):
    x = rng.normal(0.0, std, s.shape)
    return np.asarray(x + 1.0 if "scale" in jax.tree_util.keystr(path) else x, s.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)
