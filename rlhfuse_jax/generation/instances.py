"""Generation instances: the device mesh split into G sub-meshes, each with S slots
(docs/architecture.md §2).

An instance is `tp` devices (tensor parallel inside it when tp > 1) owning a fixed-layout KV cache
of S slots x max_len positions, and its own executables, compiled ahead of time at start-up
(docs/architecture.md §2: a function first called on a new device set compiles then, which would
otherwise land in the middle of generation):

  prefill(params, tokens [S, P], lens [S], uids [S], budget [S], key) -> (DecodeState, summary)
  decode(params, DecodeState, key) -> (DecodeState, summary)   up to K steps, state donated
  gather[R](DecodeState, slots [R]) -> rows                    R rows of every field (KV too)
  scatter[R](DecodeState, slots [R], rows) -> DecodeState      donated; slot index S is dropped
  ref / critic / reward (params, tokens [mb, P+T], ...)        the inference forward passes
  ref / critic / reward [k] (stage k's params, tokens or hidden)  with inference_pp > 1 in
                                                               their place: stage k of a
                                                               pipeline of instances
                                                               (inference/stages.py)

The instance state is the engine's own `DecodeState` and `decode` is `engine.decode_chunk`, the
one decode loop (docs/architecture.md §2).

`summary` is int32 [3, S] (done, num_generated, stop_reason): the few bytes the host reads after
every chunk. It is a separate output, never donated, so a watcher thread may wait on it while the
state itself is already being decoded further.

Per-sample budget. `DecodeState.budget` [S] holds each sample's own response budget (<=
max_new_tokens; engine.py): a row stops at EOS or when it holds `budget` tokens. It is part of
the sample's state and travels with it when it migrates, so a forced length (the benchmark draws
long-tailed lengths for an untrained model) gives the same tokens on any instance. A budget of 0
marks an empty slot: done right after prefill. With budget = max_new_tokens everywhere the stop
rule is exactly the baseline generator's.

Migration moves the rows of every field between two instances of the same shape class (tp, slots,
max_len, dtype; docs/architecture.md §1: across classes a sampled token can flip): gather on the
source, `jax.device_put` onto the target's shardings (arrays of two sub-meshes cannot meet in one
jitted call), scatter on the target. Row counts are padded to a few buckets (1, 4, 16, ..., S, or
up to `migration_rows` where that is smaller: more rows move in parts) so each instance compiles a
handful of gather/scatter programs, not one per migration size.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Collection, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh

from rlhfuse_jax.generation import engine
from rlhfuse_jax.generation import sampling as sampling_lib
from rlhfuse_jax.generation.engine import DecodeState
from rlhfuse_jax.generation.sampling import SamplingConfig
from rlhfuse_jax.inference import scoring
from rlhfuse_jax.inference import stages as inf_stages
from rlhfuse_jax.models import attention
from rlhfuse_jax.models import llama
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel import mesh as mesh_lib


def _summary(state: DecodeState):
  """int32 [3, S] (done, num_generated, stop_reason): what the host reads after a chunk."""
  return jnp.stack([state.done.astype(jnp.int32), state.num_generated, state.stop_reason])


def prefill_slots(cfg: ModelConfig, params, tokens, lens, uids, budget, key, *,
                  sampling: SamplingConfig, max_len: int, mesh: Optional[Mesh] = None):
  """engine.prefill with each slot's budget; returns (state, summary). `mesh`: traced under
  llama.shard_activations(forward_only=True) on it (`activation_mesh`), else None."""
  with llama.shard_activations(mesh, mesh_lib.LOGICAL_RULES, forward_only=True):
    state = engine.prefill(cfg, params, tokens, lens, uids, key, sampling, max_len,
                           budget=budget)
  return state, _summary(state)


def activation_mesh(cfg: ModelConfig, mesh: Mesh, param_shardings: Any) -> Optional[Mesh]:
  """The mesh prefill keeps its activations split over the batch axes on (`prefill_slots`):
  `mesh` where the layers are unrolled and some weight is split over a batch axis of it
  (generation="mesh" on an fsdp training mesh), else None (traced as before).

  Unrolled layers without the constraint let GSPMD answer a weight split over fsdp on `embed`
  by multiplying each device's slice of `embed` for the whole batch and all-reducing the
  products: every row's activations on every device (7B widths, 4 layers, fsdp 8, 8 rows of
  1,024 tokens a device: 12.5 GB of temporaries; docs/results.md "Unrolled layers in mesh
  generation"). Under it each layer's weights are gathered, one layer after another
  (llama.after_input), and each device computes its own rows (3.35 GB; where a device holds few
  short prompts the two gathered layers cost more than those rows saved: 8 rows of 16 tokens at
  hidden 256, 2.1 -> 10.0 MB, fsdp 8). Scanned layers already gather
  theirs: their program is left as it was, so are its bfloat16 roundings. The decode chunk
  stays out: its one token a row all-reduces less than its weights would gather. An instance
  that holds its weights whole over the batch axes (data-only or tensor meshes) has nothing to
  gather."""
  def split(sharding) -> bool:
    if not isinstance(sharding, jax.sharding.NamedSharding):
      return False
    axes = {a for entry in sharding.spec if entry is not None
            for a in ((entry,) if isinstance(entry, str) else entry)}
    return any(mesh.shape.get(a, 1) > 1 for a in axes & set(mesh_lib.BATCH_AXES))
  if cfg.scan_layers or not any(split(s) for s in jax.tree.leaves(param_shardings)):
    return None
  return mesh


def decode_slots(cfg: ModelConfig, params, state: DecodeState, key, *,
                 sampling: SamplingConfig):
  """engine.decode_chunk (K steps, early exit; the budgets are in the state) and its summary."""
  state = engine.decode_chunk(cfg, params, state, key, sampling)
  return state, _summary(state)


def _rows_axis(path) -> int:
  """The slot axis of a DecodeState leaf: 1 for the KV cache [layers, S, ...], else 0."""
  return 1 if any(getattr(p, "name", None) == "cache" for p in path) else 0


def gather_rows(st: DecodeState, slots):
  """The rows `slots` [R] of every field (a DecodeState with R rows)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.take(x, slots, axis=_rows_axis(path)), st)


def scatter_rows(st: DecodeState, slots, rows: DecodeState):
  """Writes rows [R] into `slots` [R]; a slot index >= S (padding) is dropped."""

  def put(path, x, r):
    if _rows_axis(path) == 1:
      return x.at[:, slots].set(r, mode="drop")
    return x.at[slots].set(r, mode="drop")
  return jax.tree_util.tree_map_with_path(put, st, rows)


def migration_buckets(slots: int, max_rows: int = 0) -> tuple[int, ...]:
  """Row counts a migration is padded to: 1, 4, 16, ... below the largest, and the largest, S
  or `max_rows` where smaller (0: S). A migration of more rows moves in parts of the largest
  (FusedGenerator's consolidate): the gathered rows are a copy beside the cache, on the source
  and on the target, and S rows would double it (fusion.migration_rows)."""
  top = min(slots, max_rows) if max_rows else slots
  out, b = [], 1
  while b < top:
    out.append(b)
    b *= 4
  return tuple(out) + (top,)


def check_device_count(num_instances: int, devices_per_instance: int, available: int,
                       section: str = "fusion") -> None:
  """The instances fit the devices (split_devices; checked before a run builds anything).
  `section`: the config section holding the two fields, named in errors (bench_generation's
  is "generation")."""
  need = num_instances * devices_per_instance
  if num_instances < 1 or devices_per_instance < 1:
    raise ValueError(f"{section}.num_instances={num_instances} and {section}.instance_devices="
                     f"{devices_per_instance} must be >= 1")
  if need > available:
    raise ValueError(f"{section}.num_instances={num_instances} x {section}.instance_devices="
                     f"{devices_per_instance} = {need} devices, but only {available} are "
                     "available: fewer or smaller instances")


def check_model(cfg: ModelConfig, sampling: SamplingConfig, prompt_len: int) -> int:
  """What every generator checks of its model and lengths before compiling; returns max_len
  (the KV cache's positions: prompt bucket + max_new_tokens)."""
  if cfg.head != "lm":
    raise ValueError(f"generation needs an LM-head model (model.head='lm'), got {cfg.head!r}")
  sampling.check_vocab(cfg.vocab_size)
  if prompt_len < 1:
    raise ValueError(f"generation prompt_len={prompt_len}; expected >= 1")
  max_len = prompt_len + sampling.max_new_tokens
  if max_len > cfg.max_seq_len:
    raise ValueError(f"context too long: prompt bucket {prompt_len} + sampling.max_new_tokens="
                     f"{sampling.max_new_tokens} = {max_len} exceeds model.max_seq_len="
                     f"{cfg.max_seq_len}")
  return max_len


def _int32(name: str, x) -> np.ndarray:
  """`x` as int32, refused (naming the first bad element) where that would change a value:
  numpy's cast truncated 2.7 to 2 and wrapped the uid 2**32 + 7 to 7 (that sample then drew
  uid 7's random stream) without a word."""
  a = np.asarray(x)
  if a.dtype.kind not in "biuf":
    raise ValueError(f"{name} has dtype {a.dtype}; expected integers")
  with np.errstate(invalid="ignore"):  # NaN: cast to anything, and unequal below, as it should
    out = a.astype(np.int32)
    bad = out != a
  if bad.any():
    index = tuple(int(i[0]) for i in np.nonzero(bad))
    where = "" if a.ndim == 0 else "[" + ", ".join(map(str, index)) + "]"
    raise ValueError(f"{name}{where} = {a[index].item()!r}: expected an integer that fits int32")
  return out


def check_prompts(batch_size: int, prompt_len: int, sampling: SamplingConfig, prompt_tokens,
                  prompt_lens, uids=None, budgets=None, vocab_size: Optional[int] = None):
  """A batch's host inputs checked and completed: (tokens [B, P], pad_id behind each row's length
  and up to the bucket, lens [B], uids [B] (default 0..B-1), budgets [B] (default max_new_tokens)).
  `vocab_size`: the prompts' tokens (before each row's length) must lie in [0, vocab_size); an
  id outside it embeds as NaN (jnp.take's fill) and its row would decode garbage silently."""
  b, p, t = batch_size, prompt_len, sampling.max_new_tokens
  prompt_tokens = _int32("prompt_tokens", prompt_tokens)
  prompt_lens = _int32("prompt_lens", prompt_lens)
  if prompt_tokens.ndim != 2 or prompt_tokens.shape[0] != b or prompt_tokens.shape[1] > p:
    raise ValueError(f"prompt_tokens has shape {prompt_tokens.shape}; this generator takes "
                     f"[{b}, <= {p}] (batch_size, prompt bucket)")
  if prompt_lens.shape != (b,):
    raise ValueError(f"prompt_lens has shape {prompt_lens.shape}; expected ({b},)")
  if prompt_lens.min() < 1 or prompt_lens.max() > prompt_tokens.shape[1]:
    raise ValueError(f"prompt_lens must be in [1, {prompt_tokens.shape[1]}]; got min "
                     f"{prompt_lens.min()}, max {prompt_lens.max()}")
  real = np.arange(prompt_tokens.shape[1])[None] < prompt_lens[:, None]
  if vocab_size is not None:
    bad = real & ((prompt_tokens < 0) | (prompt_tokens >= vocab_size))
    if bad.any():
      row, pos = (int(x[0]) for x in np.nonzero(bad))
      raise ValueError(f"prompt_tokens[{row}, {pos}] = {int(prompt_tokens[row, pos])} is not a "
                       f"token id of this model (vocab_size {vocab_size}; {int(bad.sum())} such "
                       "ids in the batch): was the prompt tokenized with another tokenizer?")
  # pad_id behind every row's length, whatever the caller had there: the padding is written
  # into the KV cache (masked), and an id outside the vocabulary would embed as NaN, which the
  # masked attention's 0 x NaN spreads over the row.
  padded = np.full((b, p), sampling.pad_id, np.int32)
  padded[:, :prompt_tokens.shape[1]] = np.where(real, prompt_tokens, sampling.pad_id)
  uids = np.arange(b, dtype=np.int32) if uids is None else _int32("uids", uids)
  if uids.shape != (b,):
    raise ValueError(f"uids has shape {uids.shape}; expected ({b},)")
  values, counts = np.unique(uids, return_counts=True)
  if (counts > 1).any():
    i = int(np.argmax(counts > 1))
    rows = np.nonzero(uids == values[i])[0][:2].tolist()
    raise ValueError(f"uids[{rows[0]}] = uids[{rows[1]}] = {int(values[i])}: a sample's uid seeds "
                     "its random stream, so two rows with one uid would draw the same tokens; "
                     "expected distinct uids")
  budgets = np.full(b, t, np.int32) if budgets is None else _int32("budgets", budgets)
  if budgets.shape != (b,) or budgets.min() < 1 or budgets.max() > t:
    raise ValueError(f"budgets must be [{b}] in [1, max_new_tokens={t}]")
  return padded, prompt_lens, uids, budgets


def instance_groups(devices: Sequence[Any], num_instances: int,
                    devices_per_instance: int) -> list[list[Any]]:
  """The devices of each of G instances: `devices_per_instance` consecutive devices of
  `devices` taken process by process (a stable sort by process_index first).

  An instance must live in one process (multihost.process_of). jax's device order already goes
  process by process, so this changes nothing there; a mesh arranged by the TPU torus
  (parallel/mesh.device_array) interleaves the hosts of a pod, and its flattened order would put
  most instances across two hosts."""
  devices = sorted(devices, key=lambda d: d.process_index)
  check_device_count(num_instances, devices_per_instance, len(devices))
  return [devices[i * devices_per_instance:(i + 1) * devices_per_instance]
          for i in range(num_instances)]


def split_devices(devices: Sequence[jax.Device], num_instances: int,
                  devices_per_instance: int) -> list[Mesh]:
  """G sub-meshes (axis `tensor` inside) over `instance_groups`."""
  return [mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, tensor=devices_per_instance), group)
          for group in instance_groups(devices, num_instances, devices_per_instance)]


@dataclasses.dataclass(frozen=True)
class FrozenModels:
  """Shapes of the inference models (params are given per run): None = not used."""
  reference: Optional[ModelConfig]  # LM head: reference log-probs (None: not used)
  critic: Optional[ModelConfig] = None  # scalar head: values
  reward: Optional[ModelConfig] = None  # scalar head: reward-model scores
  temperature: float = 1.0  # of the reference log-probs (the actor's logprob_temperature)


# One Python callable per (model, sampling, length, kernel mesh): instances then share jax's
# trace cache, so only XLA's compile runs once per instance (tracing the model again costs ~0.3 s
# each). `kernel`: None, or attention.kernel_mesh's arguments with the instance's *abstract*
# mesh (axis names and sizes, no devices), so that instances of one shape share the trace and
# the shard_map of a "pallas" decode is part of it (a context entered around jit would not be:
# jax's trace cache does not see it).
def _under_kernel_mesh(fn: Callable, kernel: Optional[tuple]) -> Callable:
  if kernel is None:
    return fn

  def run(*args, **kwargs):
    with attention.kernel_mesh(*kernel):
      return fn(*args, **kwargs)
  return run


@functools.lru_cache(maxsize=None)
def _prefill_fn(cfg: ModelConfig, sampling: SamplingConfig, max_len: int,
                kernel: Optional[tuple] = None, mesh: Optional[Mesh] = None) -> Callable:
  return _under_kernel_mesh(
      functools.partial(prefill_slots, cfg, sampling=sampling, max_len=max_len, mesh=mesh),
      kernel)


@functools.lru_cache(maxsize=None)
def _decode_fn(cfg: ModelConfig, sampling: SamplingConfig,
               kernel: Optional[tuple] = None) -> Callable:
  return _under_kernel_mesh(functools.partial(decode_slots, cfg, sampling=sampling), kernel)


@functools.lru_cache(maxsize=None)
def _logical_specs(cfg: ModelConfig) -> Any:
  return llama.logical_specs(cfg)


class PlacedOnInstances(dict):
  """{instance index: params already on that instance}: one model placed on each of a process's
  instances at once (generation/fused.FusedGenerator.place_actor); `GenerationInstance.place`
  hands each instance its own."""


class GenerationInstance:
  """One sub-mesh with S slots and its AOT-compiled executables (module docstring)."""

  def __init__(self, index: int, mesh: Mesh, cfg: ModelConfig, sampling: SamplingConfig, *,
               slots: int, prompt_len: int, frozen: Optional[FrozenModels] = None,
               micro_batch: int = 0, migration_rows: int = 0, inference_pp: int = 1):
    self.max_len = check_model(cfg, sampling, prompt_len)
    tp = mesh.shape.get("tensor", 1)
    impl = attention.instance_attention(cfg.attention, cfg.num_kv_heads, tp)
    if impl != cfg.attention:
      logging.log_first_n(logging.INFO, "generation instances on GPU decode "
                          "model.attention=%r with the Pallas kernel (models/attention.py; "
                          "'cudnn' keeps the static whole-cache path)", 1, cfg.attention)
      cfg = cfg.replace(attention=impl)
    if cfg.attention == "pallas" and not attention.kernel_splits_heads(cfg.num_kv_heads, tp):
      # Each device runs the kernel on its own KV heads (attention.kernel_mesh).
      raise ValueError(
          f"model.attention='pallas' needs the KV heads split evenly over a generation "
          f"instance's tensor devices: model.num_kv_heads={cfg.num_kv_heads}, tensor={tp} "
          f"(fusion.instance_devices for fused instances, plan.generation_tp for a plan's "
          f"instances, mesh.tensor otherwise); use 'auto', "
          f"or a tensor size that divides num_kv_heads")
    # Under "pallas" on several devices the kernel runs per device (attention.kernel_mesh).
    self.kernel = ((mesh.abstract_mesh, mesh_lib.BATCH_AXES, "tensor" if tp > 1 else None)
                   if cfg.attention == "pallas" and mesh.devices.size > 1 else None)
    multiple = mesh_lib.batch_size_multiple(mesh)
    if slots < 1 or slots % multiple:
      raise ValueError(f"generation batch_size (slots)={slots} must be a positive multiple of the "
                       f"data-parallel mesh size {multiple} (axes {mesh_lib.BATCH_AXES})")
    self.index, self.mesh, self.cfg, self.sampling = index, mesh, cfg, sampling
    self.slots, self.prompt_len, self.micro_batch = slots, prompt_len, micro_batch
    self.frozen = frozen
    # > 1: this instance scores as one stage of a pipeline of that many instances (any stage:
    # a unit is formed of instances in the order they are freed), so it compiles every stage's
    # program of every inference model (inference/stages.py) instead of the whole model's.
    self.inference_pp = inference_pp
    self.devices = tuple(mesh.devices.flat)
    self.buckets = migration_buckets(slots, migration_rows)
    self.row1 = mesh_lib.batch_sharding(mesh, 1)
    self.row2 = mesh_lib.batch_sharding(mesh, 2)
    self.row3 = mesh_lib.batch_sharding(mesh, 3)  # hidden states handed between stages
    self.rep = mesh_lib.replicated(mesh)
    self.state_sharding = engine.state_shardings(cfg, mesh)
    self._exe: dict = {}
    # bucket -> ShapeDtypeStructs of gathered rows (set by lower_all): what a cross-host
    # migration sends and receives (generation/multihost.py).
    self.rows_abstract: dict = {}

  @property
  def shape_class(self) -> str:
    """Instances migrate only within a class (docs/architecture.md §1: numerics depend on the
    shape)."""
    return (f"tp{len(self.devices)}-S{self.slots}-L{self.max_len}-"
            f"{jnp.dtype(self.cfg.jnp_dtype).name}")

  def param_shardings(self, cfg: ModelConfig, params) -> Any:
    return mesh_lib.param_shardings(params, _logical_specs(cfg), self.mesh)

  def place(self, cfg: ModelConfig, params) -> Any:
    """Copies params (host or any devices of this process) onto this instance (no copy if
    already there), device to device from devices (mesh_lib.put: jax.device_put went through
    host memory whenever the instance splits a weight other than its source does); a
    PlacedOnInstances gives this instance's own copy."""
    if isinstance(params, PlacedOnInstances):
      return params[self.index]
    return mesh_lib.put(params, self.param_shardings(cfg, params))

  def place_stage(self, cfg: ModelConfig, params, stage: int) -> Any:
    """Copies stage `stage` of the unpipelined params (host or devices of this process) onto
    this instance: only that stage's layers are sliced and copied (inference/stages.py)."""
    part = inf_stages.stage_params(cfg, params, self.inference_pp, stage)
    return mesh_lib.put(part, inf_stages.stage_shardings(cfg, part, self.inference_pp, stage,
                                                         self.mesh))

  # ------------------------------------------------------------------ ahead-of-time compile
  def lower_all(self, actor_params, frozen_params: dict,
                only: Optional[Collection[str]] = None) -> list[tuple[Any, Any]]:
    """(name, jax Lowered) of every executable of this instance; `compile_all` compiles them.

    actor_params / frozen_params: pytrees of arrays or ShapeDtypeStructs (shapes and dtypes
    only); frozen_params maps 'reference' / 'critic' / 'reward' to the models to score with.
    only: kinds to lower ('prefill', 'decode', 'gather', 'scatter', 'reference', 'critic',
    'reward'); None: all (experiments/plan_check.py lowers a few to measure them; the baseline
    Generator only prefill and decode).
    """
    want = (lambda kind: True) if only is None else (lambda kind: kind in only)
    cfg, sampling, p = self.cfg, self.sampling, self.prompt_len
    st_sh, rep = self.state_sharding, self.rep
    prm, tok, row, key = self._prefill_args(actor_params)
    pre = self._prefill_fn(prm)
    st = self.state_abstract(actor_params)
    out = []
    if want("prefill"):
      out.append(("prefill", jax.jit(pre, out_shardings=(st_sh, rep)).lower(prm, tok, row, row,
                                                                           row, key)))
    if want("decode"):
      # The state is donated: the chunk writes the new cache into the old buffers.
      out.append(("decode", jax.jit(_decode_fn(cfg, sampling, self.kernel),
                                    out_shardings=(st_sh, rep),
                                    donate_argnums=(1,)).lower(prm, st, key)))
    for r in self.buckets:
      idx = jax.ShapeDtypeStruct((r,), jnp.int32, sharding=rep)
      rows = mesh_lib.abstract(jax.eval_shape(gather_rows, st, idx), st_sh)
      self.rows_abstract[r] = rows
      if want("gather"):
        out.append((("gather", r), jax.jit(gather_rows, out_shardings=st_sh).lower(st, idx)))
      if want("scatter"):
        out.append((("scatter", r), jax.jit(scatter_rows, out_shardings=st_sh,
                                            donate_argnums=(0,)).lower(st, idx, rows)))
    mb, t = self.micro_batch, sampling.max_new_tokens
    seq = jax.ShapeDtypeStruct((mb, p + t), jnp.int32, sharding=self.row2)
    lens = jax.ShapeDtypeStruct((mb,), jnp.int32, sharding=self.row1)
    fz = self.frozen
    models = () if fz is None else (("reference", fz.reference), ("critic", fz.critic),
                                    ("reward", fz.reward))
    for name, mcfg in models:
      if mcfg is None or not want(name):
        continue
      if self.inference_pp > 1:
        out.extend(self._lower_stages(name, mcfg, frozen_params[name], seq, lens))
        continue
      fp = mesh_lib.abstract(frozen_params[name], self.param_shardings(mcfg, frozen_params[name]))
      # The very jitted functions the serial Scorer runs, so the numbers are the same.
      mesh = self.mesh
      if name == "reference":
        low = scoring.response_logprobs.lower(mcfg, fp, seq, lens, t, float(fz.temperature),
                                              mesh=mesh)
      elif name == "critic":
        low = scoring.critic_values.lower(mcfg, fp, seq, lens, t, mesh=mesh)
      else:
        low = scoring.reward_model_scores.lower(mcfg, fp, seq, lens, lens, mesh=mesh)
      out.append((name, low))
    return out

  def _lower_stages(self, name: str, mcfg: ModelConfig, params, seq, lens) -> list:
    """((name, stage), Lowered) of every stage of inference model `name` (inference_pp > 1)."""
    pp, t, mesh = self.inference_pp, self.sampling.max_new_tokens, self.mesh
    x = jax.ShapeDtypeStruct(seq.shape + (mcfg.hidden_size,), mcfg.jnp_dtype, sharding=self.row3)
    temperature = float(self.frozen.temperature) if name == "reference" else 1.0
    out = []
    for s in range(pp):
      part = jax.eval_shape(lambda p, s=s: inf_stages.stage_params(mcfg, p, pp, s), params)
      part = mesh_lib.abstract(part, inf_stages.stage_shardings(mcfg, part, pp, s, mesh))
      if s < pp - 1:
        low = inf_stages.hidden.lower(mcfg, part, seq if s == 0 else x, pp=pp, first=s == 0,
                                      mesh=mesh)
      else:
        low = inf_stages.scores.lower(mcfg, part, x, seq, lens, lens, kind=name, pp=pp,
                                      num_response=t, temperature=temperature, mesh=mesh)
      out.append(((name, s), low))
    return out

  def _prefill_args(self, actor_params) -> tuple:
    """ShapeDtypeStructs of prefill's arguments (params, tokens, a row vector, key)."""
    s, p = self.slots, self.prompt_len
    prm = mesh_lib.abstract(actor_params, self.param_shardings(self.cfg, actor_params))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=self.rep)
    tok = jax.ShapeDtypeStruct((s, p), jnp.int32, sharding=self.row2)
    row = jax.ShapeDtypeStruct((s,), jnp.int32, sharding=self.row1)
    return prm, tok, row, key

  def state_abstract(self, actor_params) -> DecodeState:
    """ShapeDtypeStructs (with this instance's shardings) of the decode state."""
    prm, tok, row, key = self._prefill_args(actor_params)
    return mesh_lib.abstract(jax.eval_shape(self._prefill_fn(prm), prm, tok, row, row, row,
                                            key)[0], self.state_sharding)

  def _prefill_fn(self, prm) -> Callable:
    """The prefill function for params `prm` (ShapeDtypeStructs with their shardings)."""
    act = activation_mesh(self.cfg, self.mesh, jax.tree.map(lambda x: x.sharding, prm))
    return _prefill_fn(self.cfg, self.sampling, self.max_len, self.kernel, act)

  @property
  def num_executables(self) -> int:
    return len(self._exe)

  # ------------------------------------------------------------------ execution
  def prefill(self, params, tokens, lens, uids, budget, key):
    """(state, summary) of host inputs already checked and padded to the bucket."""
    put = mesh_lib.put
    return self._exe["prefill"](params, put(tokens, self.row2), put(lens, self.row1),
                                put(uids, self.row1), put(budget, self.row1), put(key, self.rep))

  def decode(self, params, st: DecodeState, key):
    """One chunk; `st` is donated and must not be used afterwards."""
    return self._exe["decode"](params, st, key)

  def bucket(self, n: int) -> int:
    for b in self.buckets:
      if b >= n:
        return b
    raise ValueError(f"{n} rows exceed the largest migration bucket {self.buckets[-1]}")

  def gather(self, st: DecodeState, slots: Sequence[int]) -> tuple[DecodeState, int]:
    """Rows `slots` padded to a bucket (padding repeats the first slot); returns (rows, n)."""
    b = self.bucket(len(slots))
    idx = np.full(b, slots[0], np.int32)
    idx[:len(slots)] = slots
    return self._exe[("gather", b)](st, jax.device_put(idx, self.rep)), len(slots)

  def scatter(self, st: DecodeState, slots: Sequence[int], rows: DecodeState) -> DecodeState:
    """Writes the first len(slots) rows into `slots` (padding rows go to index S: dropped).
    `st` is donated; `rows` must already be on this instance (see receive)."""
    b = rows.budget.shape[0]
    idx = np.full(b, self.slots, np.int32)
    idx[:len(slots)] = slots
    return self._exe[("scatter", b)](st, jax.device_put(idx, self.rep), rows)

  def receive(self, rows: DecodeState) -> DecodeState:
    """Copies rows gathered on another instance onto this one (device to device)."""
    return jax.device_put(rows, self.state_sharding)

  def score(self, name: str, params, tokens, prompt_lens, response_lens, inputs: dict):
    """One inference micro-batch: tokens [mb, P+T]; returns a device array (not waited on).
    `inputs`: a dict the models of one micro-batch on this instance share, so each input is
    copied here once, by the first model that needs it (`_inputs`)."""
    put = self._inputs(inputs)
    args = (params, put("tokens", tokens, self.row2), put("prompt_lens", prompt_lens, self.row1))
    if name == "reward":
      args = args + (put("response_lens", response_lens, self.row1),)
    return self._exe[name](*args)

  def score_stage(self, name: str, stage: int, params, x, tokens, prompt_lens, response_lens,
                  inputs: dict):
    """Stage `stage` of one inference micro-batch (inference_pp > 1): from the tokens
    [mb, P+T] (stage 0) or the previous stage's hidden states `x` (on another instance:
    copied here device to device), to hidden states, or at the last stage to the scores.
    Returns a device array (not waited on). `inputs`: as in `score`."""
    put, exe = self._inputs(inputs), self._exe[(name, stage)]
    if stage == 0:
      return exe(params, put("tokens", tokens, self.row2))
    x = jax.device_put(x, self.row3)
    if stage < self.inference_pp - 1:
      return exe(params, x)
    return exe(params, x, put("tokens", tokens, self.row2),
               put("prompt_lens", prompt_lens, self.row1),
               put("response_lens", response_lens, self.row1))

  @staticmethod
  def _inputs(inputs: dict):
    """put(key, host array, sharding): the array on this instance, copied once per `inputs`
    (every model of a micro-batch reads the same tokens and lengths: one copy each, not one
    per model)."""
    def put(key, x, sharding):
      if key not in inputs:
        inputs[key] = mesh_lib.put(x, sharding)
      return inputs[key]
    return put


def _exe_name(name) -> str:
  return name if isinstance(name, str) else f"{name[0]}[{name[1]}]"


def _program_key(inst: GenerationInstance, low) -> Any:
  """What makes two lowerings one executable: the instance (its devices), the program's text
  (donation, shardings and constants are in it), the argument and result trees, and which
  arguments jax kept (it drops unused ones before the text: `lambda a, b: a * 2` and
  `lambda a, b: b * 2` print alike). Where jax does not say which (a private field), the
  lowering is its own program: compiled alone, never shared."""
  try:
    args = low._lowering.compile_args  # pylint: disable=protected-access
    kept = tuple(sorted(args["kept_var_idx"]))
  except (AttributeError, KeyError, TypeError):
    return id(low)
  return (id(inst), low.as_text(), str(low.in_tree), str(low.out_tree), kept)


def compile_all(instances: Sequence[GenerationInstance], actor_params, frozen_params: dict,
                threads: int = 4) -> None:
  """Compiles every instance's executables at start-up. Lowering runs here (instances share
  jax's trace cache); XLA compiles in `threads` threads (it releases the GIL).

  Logs its progress (this is most of a fused run's start-up): one line when lowering is done,
  then one per instance as its executables finish, with the seconds elapsed."""
  t0 = time.perf_counter()
  g = len(instances)
  jobs = [(inst, name, low) for inst in instances
          for name, low in inst.lower_all(actor_params, frozen_params)]
  names = [_exe_name(n) for inst_, n, _ in jobs if inst_ is instances[0]]
  logging.info("generation: lowered in %.1fs; compiling %d executables per instance (%s) for "
               "%d instances in %d threads ...", time.perf_counter() - t0, len(names),
               ", ".join(names), g, threads)
  # With jax's persistent cache on a GPU backend, the first instance compiles alone and the
  # others then load its executables: jax leaves the device assignment out of a GPU program's
  # cache key (jax/_src/cache_key.py), so instances of one shape share entries. Compiled all at
  # once, every instance would miss. (XLA:CPU keys keep the devices: no sharing, one wave.)
  # Expected on GPUs, not yet measured there.
  waves = (len(names) if len(instances) > 1 and jax.config.jax_compilation_cache_dir and
           instances[0].devices[0].platform == "gpu" else len(jobs))
  # One compile per distinct program of an instance: with inference_pp > 1 the reference's and
  # the critic's first stage (token embedding and layers, no head) are one program when the two
  # models have one architecture (a critic from the actor's checkpoint), and were compiled twice
  # at once, racing on one entry of jax's persistent cache (a truncated read, then a recompile).
  first: dict = {}
  source = [first.setdefault(_program_key(inst, low), n) for n, (inst, _, low) in enumerate(jobs)]
  futures: dict = {}

  def submit(lo: int, hi: int) -> None:
    for k in range(lo, hi):
      if source[k] == k:
        futures[k] = pool.submit(jobs[k][2].compile)

  with ThreadPoolExecutor(max_workers=threads) as pool:
    submit(0, waves)
    compiled = 0
    for n, (inst, name, _) in enumerate(jobs):
      if n == waves:  # the first instance is done: the others load from the cache
        submit(n, len(jobs))
      inst._exe[name] = futures[source[n]].result()
      if n + 1 == len(jobs) or jobs[n + 1][0] is not inst:  # the instance's last executable
        compiled += 1
        logging.info("generation: compiled instance %d/%d (devices %s), %.1fs elapsed",
                     compiled, g, ",".join(str(d.id) for d in inst.devices),
                     time.perf_counter() - t0)


class Generator(GenerationInstance):
  """The non-fused baseline: one instance over a whole mesh, batch = slots, split over the
  mesh's batch axes (docs/architecture.md §2).

  It runs the instances' own prefill and decode executables, compiled ahead of time (in
  `compile`, or at construction when `params` are given), so nothing compiles in the middle of
  generation and there is one decode loop. Unlike a fused instance, it keeps the placement the
  caller gave the params (e.g. mesh.shard_params on the training mesh).
  """

  def __init__(self, cfg: ModelConfig, sampling: SamplingConfig, *, batch_size: int,
               prompt_len: int, mesh: Optional[Mesh] = None, params: Any = None):
    mesh = mesh if mesh is not None else mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1),
                                                            jax.devices()[:1])
    super().__init__(0, mesh, cfg, sampling, slots=batch_size, prompt_len=prompt_len)
    self.num_compiles = 0
    self._param_sh = None
    if params is not None:
      self.compile(params)

  @property
  def batch_size(self) -> int:
    return self.slots

  def param_shardings(self, cfg: ModelConfig, params) -> Any:
    """The params' own shardings (host arrays: replicated); they must be on this mesh."""
    rep, mesh_devices = self.rep, set(self.devices)

    def one(x):
      sharding = getattr(x, "sharding", None)
      if sharding is None:
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
    ShapeDtypeStructs with .sharding). Logs a line before and after: the serial stage compiles
    them after train_ppo's "setup: models and update ready", and said nothing for as long as
    the compile took (a 7B decode: minutes)."""
    t0 = time.perf_counter()
    logging.info("generation: compiling prefill and decode (%d rows, prompts up to %d tokens, "
                 "%d new) ...", self.slots, self.prompt_len, self.sampling.max_new_tokens)
    self._param_sh = self.param_shardings(self.cfg, params)
    for name, low in self.lower_all(params, {}, only=("prefill", "decode")):
      self._exe[name] = low.compile()
      self.num_compiles += 1
    logging.info("generation: prefill and decode compiled in %.1fs", time.perf_counter() - t0)

  def place(self, params: Any) -> Any:
    """params on this generator's mesh, as its executables expect them (no copy when there)."""
    if not self._exe:
      self.compile(params)
    return mesh_lib.put(params, self._param_sh)

  def memory(self) -> dict:
    """XLA's own accounting of the compiled executables (bytes; nothing is allocated): the
    decode chunk's and prefill's temporaries, and the KV cache the decode state carries (the
    whole buffer: global, summed over devices)."""
    if not self._exe:
      raise RuntimeError("Generator.memory() needs compiled executables: call compile() first")
    dec = self._exe["decode"].memory_analysis()
    pre = self._exe["prefill"].memory_analysis()
    cache = jax.eval_shape(lambda: llama.KVCache.zeros(self.cfg, self.slots, self.max_len))
    return {"decode_temp_bytes": int(dec.temp_size_in_bytes),
            "decode_argument_bytes": int(dec.argument_size_in_bytes),
            "prefill_temp_bytes": int(pre.temp_size_in_bytes),
            "cache_bytes": int(2 * cache.k.size * cache.k.dtype.itemsize)}

  def generate(self, params: Any, prompt_tokens, prompt_lens, iteration_key, uids=None,
               budgets=None) -> engine.Rollout:
    """Generates one response per row.

    prompt_tokens: [B, <=P] right-padded (padded here to the bucket P); prompt_lens: [B];
    iteration_key: PRNG key of this iteration; uids: [B] sample ids (default 0..B-1); budgets:
    [B] response budgets (default max_new_tokens). A sample's tokens depend only on (its
    prompt, its uid, its budget, iteration_key), not on its row.
    """
    tokens, lens, uids, budgets = check_prompts(self.batch_size, self.prompt_len, self.sampling,
                                                prompt_tokens, prompt_lens, uids, budgets,
                                                self.cfg.vocab_size)
    params = self.place(params)
    key = sampling_lib.as_typed_key(iteration_key)
    t0 = time.perf_counter()
    state, summary = self.prefill(params, tokens, lens, uids, budgets, key)
    done = mesh_lib.to_host(summary)[0]  # the only per-chunk host read
    t1 = time.perf_counter()
    chunks = 0
    while not done.all():
      state, summary = self.decode(params, state, key)
      chunks += 1
      done = mesh_lib.to_host(summary)[0]
    t2 = time.perf_counter()
    out = mesh_lib.to_host({"tokens": state.tokens, "logprobs": state.logprobs,
                            "n": state.num_generated, "stop": state.stop_reason})
    return engine.Rollout(
        prompt_tokens=tokens, prompt_lens=lens, response_tokens=np.asarray(out["tokens"]),
        response_lens=np.asarray(out["n"]), logprobs=np.asarray(out["logprobs"]),
        stop_reason=np.asarray(out["stop"]), uids=uids, prefill_s=t1 - t0, decode_s=t2 - t1,
        decode_steps=int(out["n"].max()) - 1, decode_chunks=chunks)
