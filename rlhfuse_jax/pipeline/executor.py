"""The fused actor/critic training step: any compiled schedule as one jitted shard_map program.

Idea (docs/architecture.md §3, "Executor"): every device of the mesh axis `stage` holds
its actor stage and its critic stage, and nothing of the other stages. Parameters enter as the
stage-stacked trees of stages.StageLayout.stack: the actor's layer leaves [Pa, L/Pa, ...]
sharded P('stage'); the critic's [Pc, L/Pc, ...] sharded over the critic_stage half of the stage
axis split as (critic_replica, critic_stage) = (N/Pc, Pc) (`stage_mesh`; rows stored reversed, so
device d = r*Pc + j runs critic stage Pc-1-j, and the R = N/Pc replicas of a critic stage hold the
same rows); embedding and head leaves split over all N stage devices and gathered whole for the
step. The instruction table of program.py, indexed by the
device's stage index, tells each device at each tick of a `lax.fori_loop` what to run;
`lax.switch` picks the branch

  idle | actor task | critic task

and the row's flags pick forward or backward and first / middle / last stage. A model's branch
traces its stage once, as a `jax.vjp` whose backward half runs under `lax.cond`: each model's
layers are compiled once, not once per task variant, which keeps compiles short. A forward
stashes its stage input in a ring buffer (sized by the schedule's peak in-flight micro-batches)
and sends its output; a backward recomputes the stage from the stash, runs the head and the PPO
actor loss or the value loss on the last stage, accumulates the parameter gradients and sends
the input gradient. (The last stage's forward also runs its layers, unused: in lockstep a tick
lasts as long as its longest task, so this costs no time.) After each task two `lax.ppermute`s
move one padded message each: `up` (d -> d+1: actor activations, critic gradients) and `down`
(d -> d-1: actor gradients, critic activations, the critic running in reverse), and the
receiver files the message into the inbox ring its table row names.

Gradients accumulate per device in one flat float32 vector per model (a switch branch then
carries one buffer instead of one per parameter leaf). At the end each device turns its
accumulator back into its block of the stage-stacked tree: layer gradients are summed over the
data shards (and, for the critic, over its replicas: one psum over critic_replica) and leave the
program sharded like the parameters, so the optimizer updates each stage where it lives; the
embedding and head gradients are summed over all devices and reduce-scattered back to their
split (each device keeps its 1/N).

Data parallelism: the mini-batch is split over the mesh's data axes (`data`, `fsdp`, manual
here); each data shard runs the pipeline on its rows with the normalisers of the whole
mini-batch. Micro-batches: the actor's Ma and the critic's R*Mc (replica r takes r*Mc ..
r*Mc+Mc-1) are consecutive row slices of each data shard.

Inside a stage (`layer_splits`, from the parameters' logical axes and parallel/mesh.LOGICAL_RULES):
`fsdp` splits each layer matrix along its "embed" dimension, gathered one layer at a time just
before it runs (the gather's vjp reduce-scatters the gradient); `tensor` (manual too) splits
heads and MLP width Megatron-style: the stage runs its layers on a local config (heads, KV heads
and MLP width divided by the tensor size; one KV head where there are fewer KV heads than
devices: the K/V projections then stay whole and each device slices its query heads' KV head)
with column-split q/k/v/gate/up and row-split o/down kernels, between llama.tensor_parallel's
f/g operators. The actor's untied LM head and loss split the vocabulary over `tensor` too
(stages.vocab_parallel_logprobs: V/tp logits per device, the softmax's sums across devices); the
embedding, a tied head and the critic's scalar head run whole on every tensor device.

The table is an argument of the compiled step, not a constant: schedules with the same
program.ProgramShape share one compilation (serial and fused, for example).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from rlhfuse_jax.models import llama
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.pipeline import program as prog
from rlhfuse_jax.pipeline import stages
from rlhfuse_jax.pipeline.graph import PipelineProblem
from rlhfuse_jax.pipeline.stages import LossConfig, StageLayout

STAGE_AXIS = "stage"
# Inside the step the stage axis is split in two (stage_mesh): (critic replica, critic stage).
REPLICA_AXIS, CRITIC_STAGE_AXIS = "critic_replica", "critic_stage"
STAGE_AXES = (REPLICA_AXIS, CRITIC_STAGE_AXIS)
DATA_AXES = ("data", "fsdp")
MODELS = ("actor", "critic")


def check_placement(mesh: Mesh, problem: PipelineProblem, actor_cfg: ModelConfig,
                    critic_cfg: ModelConfig) -> None:
  """Clear errors for placements the executor cannot run."""
  if STAGE_AXIS not in mesh.shape:
    raise ValueError(f"mesh has no {STAGE_AXIS!r} axis (axes: {mesh.axis_names})")
  n = mesh.shape[STAGE_AXIS]
  if problem.actor_pp != n:
    raise ValueError(f"actor_pp={problem.actor_pp} stages need {problem.actor_pp} devices on mesh "
                     f"axis {STAGE_AXIS!r}, which has {n} (one actor stage per device)")
  if problem.critic_pp > n or n % problem.critic_pp:
    raise ValueError(f"critic_pp={problem.critic_pp} must divide the {n} devices of mesh axis "
                     f"{STAGE_AXIS!r} (actor_pp={problem.actor_pp})")
  stages.check_split(actor_cfg, problem.actor_pp, "actor")
  stages.check_split(critic_cfg, problem.critic_pp, "critic")
  tensor = mesh.shape.get("tensor", 1)
  for name, cfg in (("actor", actor_cfg), ("critic", critic_cfg)):
    for field in ("num_heads", "intermediate_size"):
      if getattr(cfg, field) % tensor:
        raise ValueError(f"{name}.{field}={getattr(cfg, field)} must be divisible by the mesh's "
                         f"tensor axis ({tensor}): a tensor-parallel device runs an equal share")
    kv = cfg.num_kv_heads
    if kv % tensor and tensor % kv:
      raise ValueError(f"{name}.num_kv_heads={kv} must be divisible by the mesh's tensor axis "
                       f"({tensor}), or divide it (fewer KV heads than tensor devices: each "
                       "KV head is kept by the devices of its query heads)")
    if tensor > 1 and cfg.o_bias:
      raise ValueError(f"{name}.o_bias=True with tensor={tensor}: the row-split output "
                       "projection would add its bias once per tensor device")
  if actor_cfg.head != "lm":
    raise ValueError(f"actor.head={actor_cfg.head!r}; the actor needs head='lm'")
  if critic_cfg.head != "scalar":
    raise ValueError(f"critic.head={critic_cfg.head!r}; the critic needs head='scalar'")


@dataclasses.dataclass(frozen=True)
class _Spec:
  """Everything the compiled step depends on besides array shapes (hashable: the cache key)."""
  actor_cfg: ModelConfig
  critic_cfg: ModelConfig
  loss_cfg: LossConfig
  num_devices: int
  actor_pp: int
  critic_pp: int
  stash_sizes: tuple
  inbox_sizes: tuple
  mesh: Mesh
  data_axes: tuple
  compiler_options: tuple  # XLA options as sorted (name, value) pairs


class PipelineExecutor:
  """One jitted fused training step for a compiled schedule on `mesh`.

  `executor(actor_params, critic_params, batch) -> (actor_grads, critic_grads, metrics)`: params
  in the unpipelined structure of llama.init_params (unrolled or scanned, as each model's
  scan_layers says), `batch` as in stages.py (leading dim the mini-batch), grads in the params'
  structure and dtypes, metrics a dict of float32 scalars (stages.ACTOR_METRICS +
  stages.CRITIC_METRICS, mini-batch totals). `grads_fn` is the same computation as a traceable
  function, to call inside a larger jitted update.
  """

  def __init__(self, actor_cfg: ModelConfig, critic_cfg: ModelConfig, loss_cfg: LossConfig,
               program: prog.Program, mesh: Mesh,
               compiler_options: Optional[Dict[str, Any]] = None):
    check_placement(mesh, program.problem, actor_cfg, critic_cfg)
    self.program, self.mesh, self.loss_cfg = program, mesh, loss_cfg
    data_axes = tuple(a for a in DATA_AXES if a in mesh.shape)
    self.data_size = math.prod(mesh.shape[a] for a in data_axes)
    problem = program.problem
    self.spec = _Spec(actor_cfg=actor_cfg, critic_cfg=critic_cfg, loss_cfg=loss_cfg,
                      num_devices=problem.num_devices, actor_pp=problem.actor_pp,
                      critic_pp=problem.critic_pp,
                      stash_sizes=program.stash_sizes, inbox_sizes=program.inbox_sizes,
                      mesh=mesh, data_axes=data_axes,
                      compiler_options=tuple(sorted((compiler_options or {}).items())))
    self.table = np.asarray(program.table)  # [N, ticks, FIELDS]
    self.layouts = layouts_for(actor_cfg, critic_cfg, problem.actor_pp, problem.critic_pp)
    # The one mesh of the step's program (stage_mesh): its shard_map's, both models' staged
    # placements' and, through `on_program_mesh`, its inputs'.
    self.program_mesh = stage_mesh(mesh, problem.critic_pp)

  def __call__(self, actor_params: Any, critic_params: Any, batch: Dict[str, jax.Array]):
    actor_params, critic_params, batch = self.on_program_mesh(
        (actor_params, critic_params, self._select(batch)))
    return _jitted_step(self.spec)(self.table, actor_params, critic_params, batch,
                                   self.microbatch_sizes(batch["tokens"].shape[0]))

  def grads_fn(self, actor_params: Any, critic_params: Any, batch: Dict[str, jax.Array]):
    """Traceable form of __call__ (for use inside another jax.jit)."""
    batch = self._select(batch)
    return _step(self.spec, jnp.asarray(self.table), actor_params, critic_params, batch,
                 self.microbatch_sizes(batch["tokens"].shape[0]))

  def staged_grads_fn(self, actor: Any, critic: Any, batch: Dict[str, jax.Array]):
    """Traceable step on stage-stacked trees (`stack`): the trainer's form. Gradients come back
    stage-stacked and placed like `staged_shardings`: no device ever holds a whole model's."""
    batch = self._select(batch)
    return _staged_step(self.spec, jnp.asarray(self.table), actor, critic, batch,
                        self.microbatch_sizes(batch["tokens"].shape[0]))

  def stack(self, model: str, params: Any) -> Dict[str, Any]:
    """Unpipelined params of "actor" / "critic" (unrolled, or scanned under the model's
    scan_layers) -> the stage-stacked tree the step takes (the critic's rows reversed: row j is
    critic stage Pc-1-j, placed on critic_stage j). StageLayout.stack: a reshape of the stack."""
    return self.layouts[model].stack(params)

  def unstack(self, model: str, staged: Dict[str, Any]) -> Dict[str, Any]:
    return self.layouts[model].unstack(staged)

  def on_program_mesh(self, tree: Any) -> Any:
    """`tree` with every leaf placed on `mesh` moved onto program_mesh, the same devices holding
    the same blocks (`program_spec`): arrays rewrapped shard by shard (nothing is copied),
    jax.ShapeDtypeStructs by their sharding; other leaves as they are.

    jax lowers a program that holds a primitive needing devices while lowering (cuDNN's fused
    attention on GPU, a callback) only when all its NamedShardings share one mesh ("mesh should be
    the same across the entire program"): the pipelined step with cuDNN attention failed so on
    an H200 (2026-12-04) with the actor and the batch on `mesh` and the shard_map and the critic
    on stage_mesh."""
    target = self.program_mesh

    def move(x):
      s = getattr(x, "sharding", None)
      # Leaves on another mesh (or one device) are jax's to place, as before.
      if not isinstance(s, jax.sharding.NamedSharding) or s.mesh != self.mesh:
        return x
      moved = jax.sharding.NamedSharding(target, program_spec(s.spec), memory_kind=s.memory_kind)
      if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=moved, weak_type=x.weak_type)
      # The same shards under the equivalent sharding: no copy, no program. (device_put shares
      # the buffers in one process only; across processes it ran a resharding program that
      # copied every call's batch, seen with 2 processes of 4 CPU devices.)
      return jax.make_array_from_single_device_arrays(
          x.shape, moved, [shard.data for shard in x.addressable_shards])
    return jax.tree.map(move, tree)

  def staged_shardings(self, model: str) -> Dict[str, Any]:
    """NamedShardings of `model`'s stage-stacked tree, on program_mesh: layer rows one per
    stage device (critic: one per critic stage, replicated over its replicas), embedding and
    head leaves split over all stage devices (tail_dim)."""
    layers = STAGE_AXES if model == "actor" else CRITIC_STAGE_AXIS
    specs = _staged_specs(self.layouts[model], layers, STAGE_AXES, self.spec.num_devices,
                          _splits(self.spec)[model])
    return jax.tree.map(lambda p: jax.sharding.NamedSharding(self.program_mesh, p), specs,
                        is_leaf=lambda x: isinstance(x, P))

  def lower(self, actor_params: Any, critic_params: Any, batch: Dict[str, jax.Array]):
    """jax.jit(...).lower for ahead-of-time compilation (and compile-time measurement)."""
    actor_params, critic_params, batch = self.on_program_mesh(
        (actor_params, critic_params, self._select(batch)))
    return _jitted_step(self.spec).lower(self.table, actor_params, critic_params, batch,
                                         self.microbatch_sizes(batch["tokens"].shape[0]))

  def compile(self, actor_params: Any, critic_params: Any,
              batch: Dict[str, jax.Array]) -> Callable:
    """Ahead-of-time compiled step: returns f(actor_params, critic_params, batch) -> outputs."""
    compiled = self.lower(actor_params, critic_params, batch).compile()
    table = jnp.asarray(self.table)
    return lambda ap, cp, b: compiled(table, *self.on_program_mesh((ap, cp, self._select(b))))

  def microbatch_sizes(self, batch_size: int) -> Tuple[int, int]:
    """(actor, critic) rows per micro-batch for a mini-batch of `batch_size` rows."""
    problem = self.program.problem
    if batch_size % self.data_size:
      raise ValueError(f"mini-batch of {batch_size} rows cannot be split over the data axes "
                       f"{self.spec.data_axes} of size {self.data_size}")
    local = batch_size // self.data_size
    if local < 1:  # zero rows would reach the micro-batch reshapes as a division by zero
      raise ValueError(f"mini-batch of {batch_size} rows: each of the {self.data_size} data "
                       f"shards (axes {self.spec.data_axes}) needs at least one row")
    n_critic = problem.critic_replicas * problem.critic_microbatches
    if local % problem.actor_microbatches or local % n_critic:
      raise ValueError(
          f"mini-batch shard of {local} rows (batch {batch_size} / data {self.data_size}) must be "
          f"divisible by actor_microbatches={problem.actor_microbatches} and by critic replicas "
          f"x critic_microbatches={problem.critic_replicas}x{problem.critic_microbatches}")
    return local // problem.actor_microbatches, local // n_critic

  def _select(self, batch: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    keys = stages.batch_keys(self.loss_cfg)
    missing = [k for k in keys if k not in batch]
    if missing:
      raise KeyError(f"batch lacks {missing}; the pipelined losses need {list(keys)}")
    rows = {k: np.shape(batch[k])[0] if np.ndim(batch[k]) else None for k in keys}
    odd = [k for k in keys if rows[k] != rows["tokens"]]
    if odd:  # micro-batches slice every field by row: a short field would misalign silently
      raise ValueError(f"batch field {odd[0]!r} has {rows[odd[0]]} rows, batch['tokens'] has "
                       f"{rows['tokens']}: every field needs one row per sample")
    # Shapes as stages.py documents them: a per-token field [B, 1] broadcast silently in the
    # losses (one value for every token of a row); other shapes failed deep inside the step.
    want = {"tokens": "[rows, sequence length]", "prompt_lens": "[rows]",
            "mask": "[rows, response length]"}
    for k, ndim in (("tokens", 2), ("prompt_lens", 1), ("mask", 2)):
      if np.ndim(batch[k]) != ndim:
        raise ValueError(f"batch field {k!r} has shape {np.shape(batch[k])}; expected {want[k]}")
    t = np.shape(batch["mask"])
    odd = [k for k in keys if k not in want and np.shape(batch[k]) != t]
    if odd:
      raise ValueError(f"batch field {odd[0]!r} has shape {np.shape(batch[odd[0]])}, "
                       f"batch['mask'] has {t}: per-token fields are [rows, response length]")
    return {k: batch[k] for k in keys}


def stage_mesh(mesh: Mesh, critic_pp: int) -> Mesh:
  """`mesh` with its `stage` axis split into (critic_replica, critic_stage) = (N/Pc, Pc): the
  same devices in the same order, so stage index d = r*Pc + j is (replica r, critic stage j).
  The critic's stacked layers [Pc, ...] shard over critic_stage and are replicated over
  critic_replica; the replicas' gradients add up with one psum over critic_replica."""
  names = list(mesh.axis_names)
  i = names.index(STAGE_AXIS)
  n = mesh.shape[STAGE_AXIS]
  shape = list(mesh.devices.shape)
  shape[i:i + 1] = [n // critic_pp, critic_pp]
  names[i:i + 1] = [REPLICA_AXIS, CRITIC_STAGE_AXIS]
  return Mesh(mesh.devices.reshape(shape), tuple(names),
              axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def program_spec(spec: P) -> P:
  """A PartitionSpec of `mesh` as the same placement on stage_mesh(mesh, ...): the stage axis
  becomes (critic_replica, critic_stage), whose devices, major to minor, are the stage axis's
  in its order."""
  def entry(e):
    if e == STAGE_AXIS:
      return STAGE_AXES
    if isinstance(e, tuple) and STAGE_AXIS in e:
      return tuple(a for x in e for a in (STAGE_AXES if x == STAGE_AXIS else (x,)))
    return e
  return P(*(entry(e) for e in spec))


def _splits(spec: _Spec) -> Dict[str, Any]:
  fsdp, tensor = _axis_sizes(spec.mesh)
  return {"actor": layer_splits(spec.actor_cfg, fsdp, tensor),
          "critic": layer_splits(spec.critic_cfg, fsdp, tensor)}


def _tensor_axis(mesh: Mesh) -> Tuple[str, ...]:
  """("tensor",) where the mesh has that axis: manual in the step (Megatron splits)."""
  return ("tensor",) if "tensor" in mesh.shape else ()


@functools.lru_cache(maxsize=64)
def layouts_for(actor_cfg: ModelConfig, critic_cfg: ModelConfig, actor_pp: int, critic_pp: int
                ) -> Dict[str, StageLayout]:
  """The two models' layouts; the critic's rows are reversed (placed in the reverse direction)."""
  return {"actor": StageLayout.for_config(actor_cfg, actor_pp, "actor"),
          "critic": StageLayout.for_config(critic_cfg, critic_pp, "critic", reverse=True)}


def tail_dim(shape: Tuple[int, ...], num_devices: int) -> int:
  """The dimension along which an embedding/head leaf is split over the stage devices: the first
  one the device count divides; -1 (kept whole on every device) if there is none."""
  for k, size in enumerate(shape):
    if size % num_devices == 0:
      return k
  return -1


@dataclasses.dataclass(frozen=True)
class LayerSplit:
  """How one layer leaf's own dimensions split inside a stage: per dimension the mesh axis
  ("fsdp" or "tensor") or None (a jax.tree leaf: not a tuple)."""
  dims: Tuple[Optional[str], ...]


@functools.lru_cache(maxsize=64)
def layer_splits(cfg: ModelConfig, fsdp: int, tensor: int) -> Any:
  """LayerSplit of every leaf of one layer (the tree of llama's layers_0), from the logical
  axis names of the parameters and parallel/mesh.LOGICAL_RULES: "embed" dims over fsdp
  (FSDP: gathered one layer at a time), heads and MLP width over tensor (Megatron column/row
  splits, never gathered). A dim an axis does not divide stays whole."""
  sizes = {"fsdp": fsdp, "tensor": tensor}
  cfg = cfg.replace(scan_layers=False)  # one layer's tree is the same either way
  kv_whole = shares_kv_heads(cfg, tensor)  # the K/V projections stay whole: kv_head_dims

  def one(spec, shape):
    dims = []
    for name, size in zip(spec, shape.shape):
      axis = mesh_lib.LOGICAL_RULES.get(name)
      ok = axis in sizes and sizes[axis] > 1 and size % sizes[axis] == 0
      ok = ok and not (name == "kv_heads" and kv_whole)
      dims.append(axis if ok else None)
    return LayerSplit(tuple(dims))
  return jax.tree.map(one, llama.logical_specs(cfg)["layers_0"],
                      llama.param_shapes(cfg)["layers_0"], is_leaf=lambda x: isinstance(x, P))


def shares_kv_heads(cfg: ModelConfig, tensor: int) -> bool:
  """Fewer KV heads than `tensor` devices (check_placement: then they divide it): each KV head
  is kept whole by the devices of its query heads."""
  return tensor > 1 and cfg.num_kv_heads % tensor != 0


@functools.lru_cache(maxsize=64)
def kv_head_dims(cfg: ModelConfig, tensor: int) -> Any:
  """Per leaf of one layer: the dimension holding KV heads (K/V kernels and biases) when the
  model shares KV heads over `tensor` (shares_kv_heads), else -1. Those leaves stay whole on
  every tensor device; each device slices the KV head its query heads attend with
  (_ModelPlan.select_kv_head), and their gradients are summed over `tensor`."""
  cfg = cfg.replace(scan_layers=False)
  whole = shares_kv_heads(cfg, tensor)
  return jax.tree.map(lambda spec: spec.index("kv_heads") if whole and "kv_heads" in spec else -1,
                      llama.logical_specs(cfg)["layers_0"], is_leaf=lambda x: isinstance(x, P))


def _axis_sizes(mesh: Mesh) -> Tuple[int, int]:
  return mesh.shape.get("fsdp", 1), mesh.shape.get("tensor", 1)


def local_config(cfg: ModelConfig, tensor: int) -> ModelConfig:
  """The config one tensor-parallel device runs a layer with: its share of the heads and of
  the MLP width (check_placement guarantees they divide), and one KV head when the model has
  fewer KV heads than devices."""
  if tensor == 1:
    return cfg
  return cfg.replace(num_heads=cfg.num_heads // tensor,
                     num_kv_heads=max(1, cfg.num_kv_heads // tensor),
                     intermediate_size=cfg.intermediate_size // tensor, head_dim=cfg.head_dim_)


def _staged_specs(layout: StageLayout, layers_axes: Any, tail_axes: Any, num_devices: int,
                  splits: Any) -> Dict[str, Any]:
  """PartitionSpecs of a stage-stacked tree. Layer leaves [S, L/S, *shape]: rows over
  `layers_axes`, the dimensions of `shape` by their LayerSplit (fsdp, tensor). Each embedding
  and head leaf is split over all stage devices (`tail_axes`) along its tail_dim. A device thus
  keeps 1/(pp*fsdp*tp) of the layer matrices (norm gains, never split: 1/pp; K/V projections of
  shared KV heads: 1/(pp*fsdp)) and 1/N of the
  embedding and head, and as much of their optimizer moments; the step gathers the embedding
  and head whole once (small next to the layers) and reduce-scatters their gradients back."""
  def tail_spec(x):
    k = tail_dim(x.shape, num_devices)
    return P() if k < 0 else P(*([None] * k), tail_axes)

  shapes = layout.staged_shapes()
  return {"embed": jax.tree.map(tail_spec, shapes["embed"]),
          "layers": jax.tree.map(lambda split: P(layers_axes, None, *split.dims), splits),
          "head": jax.tree.map(tail_spec, shapes["head"])}


def _local_layout(layout: StageLayout, splits: Any, mesh: Mesh) -> StageLayout:
  """The layout of one device's block: layer leaves with their split dimensions divided."""
  def local(x, split):
    shape = list(x.shape)
    for k, axis in enumerate(split.dims):
      if axis is not None:
        shape[2 + k] //= mesh.shape[axis]
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
  shapes = layout.staged_shapes()
  local_shapes = {**shapes, "layers": jax.tree.map(local, shapes["layers"], splits)}
  return StageLayout(layout.cfg, local_shapes, layout.num_stages, reverse=layout.reverse)


def _staged_step(spec: _Spec, table, actor, critic, batch, mb_sizes):
  """The fused step on stage-stacked trees: (actor grads, critic grads, metrics), the grads
  stage-stacked like the parameters and placed like them."""
  layouts = layouts_for(spec.actor_cfg, spec.critic_cfg, spec.actor_pp, spec.critic_pp)
  num_tokens, num_seqs = stages.normalisers(batch)
  rows = P(spec.data_axes) if spec.data_axes else P()
  n, splits = spec.num_devices, _splits(spec)
  specs = {"actor": _staged_specs(layouts["actor"], STAGE_AXES, STAGE_AXES, n, splits["actor"]),
           "critic": _staged_specs(layouts["critic"], CRITIC_STAGE_AXIS, STAGE_AXES, n,
                                   splits["critic"])}
  in_specs = (P(), specs["actor"], specs["critic"], jax.tree.map(lambda _: rows, batch), P(),
              P())
  fn = jax.shard_map(_make_body(spec, layouts, *mb_sizes), mesh=stage_mesh(spec.mesh,
                                                                           spec.critic_pp),
                     in_specs=in_specs, out_specs=(specs["actor"], specs["critic"], P(), P()),
                     axis_names=frozenset(spec.data_axes + STAGE_AXES + _tensor_axis(spec.mesh)),
                     check_vma=False)
  ga, gc, ma, mc = fn(table, actor, critic, batch, num_tokens, num_seqs)
  ga = jax.tree.map(lambda g, p: g.astype(p.dtype), ga, actor)
  gc = jax.tree.map(lambda g, p: g.astype(p.dtype), gc, critic)
  metrics = {k: ma[i] for i, k in enumerate(stages.ACTOR_METRICS)}
  metrics.update({k: mc[i] for i, k in enumerate(stages.CRITIC_METRICS)})
  return ga, gc, metrics


def _step(spec: _Spec, table, actor_params, critic_params, batch, mb_sizes):
  """The fused step on unpipelined trees (stacked in, unstacked out)."""
  layouts = layouts_for(spec.actor_cfg, spec.critic_cfg, spec.actor_pp, spec.critic_pp)
  ga, gc, metrics = _staged_step(spec, table, layouts["actor"].stack(actor_params),
                                 layouts["critic"].stack(critic_params), batch, mb_sizes)
  return layouts["actor"].unstack(ga), layouts["critic"].unstack(gc), metrics


@functools.lru_cache(maxsize=32)
def _jitted_step(spec: _Spec) -> Callable:
  """The jitted step for one spec (cached, so equal specs share compilations)."""
  return jax.jit(functools.partial(_step, spec), static_argnums=(4,),
                 compiler_options=dict(spec.compiler_options) or None)


# The per-device program (docs/architecture.md §3) -----------------------------------------------
#
# `_make_body` assembles the shard_map body from named pieces: `_Carry` is the tick loop's state
# (one `_ModelState` per model); `_StageTasks` runs one model's tasks on this device (`forward`,
# `backward`, and `branch`, the switch branch that picks between them); `_idle` is the idle
# branch; `_exchange` is the end of every tick (two ppermutes, arrivals filed into inboxes);
# `_model_grads_out` reduces an accumulator once the loop is done.


class _ModelState(NamedTuple):
  """One model's part of the tick loop's carry on one device."""
  stash: jax.Array       # [ring, mb, L, H]: inputs of this stage's forwards, for the recompute
  act_inbox: jax.Array   # [ring, mb, L, H]: activations received from the previous stage
  grad_inbox: jax.Array  # [ring, mb, L, H]: output gradients received from the next stage
  grads: jax.Array       # [device_size] float32: the flat accumulator of StageLayout
  metrics: jax.Array     # [len(ACTOR_METRICS) or len(CRITIC_METRICS)] float32 sums


class _Carry(NamedTuple):
  """The tick loop's carry: a task reads and writes only its own model's state (the inboxes of
  both are written by `_exchange`)."""
  actor: _ModelState
  critic: _ModelState


@dataclasses.dataclass(frozen=True)
class _Messages:
  """The two channels' format: one flat vector [size] of one dtype carries either model's
  [mb, L, H] activations or gradients (zero-padded), so both models share the channels."""
  size: int
  dtype: Any

  def zero(self) -> jax.Array:
    return jnp.zeros((self.size,), self.dtype)

  def pack(self, y: jax.Array) -> jax.Array:
    flat = y.reshape(-1).astype(self.dtype)
    return jnp.pad(flat, (0, self.size - flat.shape[0]))

  def unpack(self, msg: jax.Array, shape: Tuple[int, ...], dtype: Any) -> jax.Array:
    return msg[:math.prod(shape)].reshape(shape).astype(dtype)


@dataclasses.dataclass(frozen=True)
class _ModelPlan:
  """What one model's tasks on a device depend on besides traced values (static)."""
  name: str                 # "actor" | "critic"
  cfg: ModelConfig          # the whole model's: embedding, head and loss run whole
  layer_cfg: ModelConfig    # its layers' (local_config: this device's tensor share)
  layout: StageLayout       # of this device's block (_local_layout)
  splits: Any               # LayerSplit per layer leaf
  tail_dims: Dict[str, Any]  # tail_dim of each embedding / head leaf
  rows: int                 # rows per micro-batch
  forward_up: bool          # forwards send up (d -> d+1): the actor; the critic runs reversed
  replica_axes: Tuple[str, ...]  # axes its layer gradients are also summed over
  fsdp: bool                # layers split over fsdp: gathered one layer at a time
  vocab: stages.VocabAxis = None  # the LM head's vocabulary split over `tensor`, or whole
  kv_dims: Any = None       # kv_head_dims: per layer leaf its shared-KV-head dim, or -1
  tensor: int = 1

  @property
  def head_loss(self) -> Callable:
    if self.name == "critic":
      return stages.critic_head_loss
    return functools.partial(stages.actor_head_loss, vocab=self.vocab)

  @property
  def num_metrics(self) -> int:
    return len(stages.ACTOR_METRICS if self.name == "actor" else stages.CRITIC_METRICS)

  def gather_layer(self) -> Optional[Callable[[Any], Any]]:
    """One layer's fsdp shards -> whole over fsdp (its vjp reduce-scatters the gradients)."""
    if not self.fsdp:
      return None

    def gather(p):
      def one(x, split):
        for k, axis in enumerate(split.dims):
          if axis == "fsdp":
            x = lax.all_gather(x, "fsdp", axis=k, tiled=True)
        return x
      return jax.tree.map(one, p, self.splits)
    return gather

  def select_kv_head(self) -> Optional[Callable[[Any], Any]]:
    """One whole layer -> the K/V columns of this tensor device's KV head (kv_head_dims); its
    vjp puts the gradient into those columns of a whole-size zero gradient."""
    if not shares_kv_heads(self.cfg, self.tensor):
      return None
    kv, head_dim = self.cfg.num_kv_heads, self.cfg.head_dim_
    group = self.tensor // kv  # tensor devices sharing one KV head

    def select(p):
      start = (lax.axis_index("tensor") // group) * head_dim
      return jax.tree.map(
          lambda x, k: x if k < 0 else lax.dynamic_slice_in_dim(x, start, head_dim, axis=k),
          p, self.kv_dims)
    return select


@dataclasses.dataclass(frozen=True)
class _StageTasks:
  """One model's tasks on this device: its stage's parameters (embedding and head gathered
  whole), the data shard and the channels. Built inside the body (it holds traced values).

  `branch` is the model's switch branch; the table row's flags pick `forward` or `backward` and
  first / middle / last stage. The stage's layers are traced once, as one jax.vjp whose
  backward half runs under lax.cond: XLA compiles each model's layers once instead of once per
  task variant, which keeps compiles short."""
  plan: _ModelPlan
  params: Dict[str, Any]       # {"layers" (leaves [L/S, ...]), "embed", "head"}
  batch: Dict[str, jax.Array]  # this data shard's rows
  num_tokens: jax.Array        # normalisers of the whole mini-batch
  num_seqs: jax.Array
  loss_cfg: LossConfig
  msgs: _Messages

  @property
  def act_shape(self) -> Tuple[int, int, int]:  # [mb, L, H]
    return (self.plan.rows, self.batch["tokens"].shape[1], self.plan.cfg.hidden_size)

  @property
  def act_dtype(self) -> Any:
    return self.plan.cfg.jnp_dtype

  def initial_state(self, stash_size: int, act_inbox: int, grad_inbox: int) -> _ModelState:
    def ring(size):
      return jnp.zeros((size,) + self.act_shape, self.act_dtype)
    return _ModelState(stash=ring(stash_size), act_inbox=ring(act_inbox),
                       grad_inbox=ring(grad_inbox),
                       grads=jnp.zeros((self.plan.layout.device_size,), jnp.float32),
                       metrics=jnp.zeros((self.plan.num_metrics,), jnp.float32))

  def from_msg(self, msg: jax.Array) -> jax.Array:
    return self.msgs.unpack(msg, self.act_shape, self.act_dtype)

  def micro(self, j: jax.Array) -> Dict[str, jax.Array]:
    """Rows j*mb .. j*mb+mb-1 of the data shard."""
    rows = self.plan.rows
    return jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, j * rows, rows, axis=0),
                        self.batch)

  def embed(self, tokens: jax.Array) -> jax.Array:
    return stages.embed(self.plan.cfg, self.params["embed"], tokens)

  def blocks(self, layers: Any, x: jax.Array) -> jax.Array:
    return stages.blocks(self.plan.layer_cfg, layers, x, self.plan.gather_layer(),
                         self.plan.select_kv_head())

  def branch(self, carry: _Carry, row: jax.Array) -> Tuple[_Carry, jax.Array, jax.Array]:
    """Runs the row's task of this model: (carry, up message, down message)."""
    state: _ModelState = getattr(carry, self.plan.name)
    bwd, first, last = row[prog.BACKWARD] == 1, row[prog.FIRST] == 1, row[prog.LAST] == 1
    mb = self.micro(row[prog.MICRO])
    # The stage input: stashed (backward), received (forward) or embedded (first stage).
    saved = state.stash[row[prog.STASH_SLOT]]  # [mb, L, H]
    x_in = jnp.where(bwd, saved, state.act_inbox[row[prog.INBOX_SLOT]])
    x_in = jnp.where(first, self.embed(mb["tokens"]).astype(x_in.dtype), x_in)
    # A forward of a non-first stage keeps its input for its backward (recompute).
    keep = jnp.logical_and(jnp.logical_not(bwd), jnp.logical_not(first))
    stash = lax.dynamic_update_index_in_dim(state.stash, jnp.where(keep, x_in, saved),
                                            row[prog.STASH_SLOT], 0)
    y, blocks_vjp = jax.vjp(self.blocks, self.params["layers"], x_in)

    def backward(grads, metrics):
      return self.backward(grads, metrics, mb, y, blocks_vjp, first, last, state.grad_inbox,
                           row[prog.INBOX_SLOT])
    grads, metrics, dx = lax.cond(bwd, backward, functools.partial(self.forward, x_in=x_in),
                                  state.grads, state.metrics)
    state = state._replace(stash=stash, grads=grads, metrics=metrics)
    up, down = self.send(bwd, first, last, y, dx)
    return carry._replace(**{self.plan.name: state}), up, down

  def forward(self, grads: jax.Array, metrics: jax.Array, x_in: jax.Array):
    """A forward task: its output y (computed by `branch`) is all it makes; no gradient."""
    return grads, metrics, jnp.zeros_like(x_in)

  def backward(self, grads: jax.Array, metrics: jax.Array, mb: Dict[str, jax.Array],
               y: jax.Array, blocks_vjp: Callable, first: jax.Array, last: jax.Array,
               grad_inbox: jax.Array, slot: jax.Array):
    """A backward task: the output gradient (from the head and loss on the last stage, else
    received in `grad_inbox[slot]`), the layers' vjp, the embedding's on the first stage;
    gradients accumulated. Returns (grads, metrics, dx: the input gradient to send back)."""
    def received(grads, metrics):
      return grads, metrics, grad_inbox[slot]
    grads, metrics, dy = lax.cond(last, functools.partial(self.head_loss_grad, mb=mb, y=y),
                                  received, grads, metrics)
    d_layers, dx = blocks_vjp(dy)
    grads = self.plan.layout.add(grads, "layers", d_layers)
    grads = lax.cond(first, functools.partial(self.embed_grad, mb=mb, dx=dx), lambda g: g, grads)
    return grads, metrics, dx

  def head_loss_grad(self, grads: jax.Array, metrics: jax.Array, mb: Dict[str, jax.Array],
                     y: jax.Array):
    """Last stage: head + loss, their gradients, and the output gradient dy."""
    cfg, p = self.plan.cfg, self.params
    hp = {"head": p["head"]}
    if cfg.tie_embeddings:
      hp["embed"] = p["embed"]
    loss, vjp, m = jax.vjp(
        lambda hp, y: self.plan.head_loss(cfg, self.loss_cfg, hp.get("embed", p["embed"]),
                                          hp["head"], y, mb, self.num_tokens, self.num_seqs),
        hp, y, has_aux=True)
    d_hp, dy = vjp(jnp.ones_like(loss))
    for key, g in d_hp.items():
      grads = self.plan.layout.add(grads, key, g)
    return grads, metrics + m, dy.astype(y.dtype)

  def embed_grad(self, grads: jax.Array, mb: Dict[str, jax.Array], dx: jax.Array) -> jax.Array:
    """First stage: the embedding's gradient from the input gradient dx."""
    _, vjp = jax.vjp(lambda e: stages.embed(self.plan.cfg, e, mb["tokens"]),
                     self.params["embed"])
    return self.plan.layout.add(grads, "embed", vjp(dx.astype(self.act_dtype))[0])

  def send(self, bwd, first, last, y, dx) -> Tuple[jax.Array, jax.Array]:
    """(up, down) messages: forwards send their output on (not from the last stage), backwards
    the input gradient back (not from the first stage). The actor's forward direction is up;
    the critic, placed in reverse, runs down."""
    zero = self.msgs.zero()
    send = jnp.where(bwd, jnp.logical_not(first), jnp.logical_not(last))
    msg = jnp.where(send, self.msgs.pack(jnp.where(bwd, dx, y)), zero)
    goes_up = jnp.logical_not(bwd) if self.plan.forward_up else bwd
    return jnp.where(goes_up, msg, zero), jnp.where(goes_up, zero, msg)


def _idle(msgs: _Messages) -> Callable:
  """The idle branch: the carry unchanged, nothing sent."""
  def idle(carry, row):
    del row
    zero = msgs.zero()
    return carry, zero, zero
  return idle


def _exchange(carry: _Carry, row: jax.Array, up: jax.Array, down: jax.Array,
              tasks: Dict[str, _StageTasks], n: int) -> _Carry:
  """The end of a tick: `up` moves d -> d+1 (actor activations, critic gradients), `down`
  d -> d-1 (actor gradients, critic activations), and each device files what arrives into the
  inbox ring its table row names (or nowhere: RECV_NONE)."""
  up_in = lax.ppermute(up, STAGE_AXES, [(d, d + 1) for d in range(n - 1)])
  down_in = lax.ppermute(down, STAGE_AXES, [(d + 1, d) for d in range(n - 1)])
  carry = _file(carry, tasks, up_in, row[prog.UP_RECV], row[prog.UP_SLOT],
                act_model="actor", grad_model="critic")
  return _file(carry, tasks, down_in, row[prog.DOWN_RECV], row[prog.DOWN_SLOT],
               act_model="critic", grad_model="actor")


def _file(carry: _Carry, tasks: Dict[str, _StageTasks], msg: jax.Array, code: jax.Array,
          slot: jax.Array, act_model: str, grad_model: str) -> _Carry:
  """Writes an arrived message into `act_model`'s activation inbox (code RECV_ACT) or
  `grad_model`'s gradient inbox (RECV_GRAD); both slots are rewritten, unchanged if not named."""
  def put(ring, want, model):
    new = jnp.where(code == want, tasks[model].from_msg(msg), ring[slot])
    return lax.dynamic_update_index_in_dim(ring, new, slot, 0)
  act, grad = getattr(carry, act_model), getattr(carry, grad_model)
  return carry._replace(**{
      act_model: act._replace(act_inbox=put(act.act_inbox, prog.RECV_ACT, act_model)),
      grad_model: grad._replace(grad_inbox=put(grad.grad_inbox, prog.RECV_GRAD, grad_model))})


def _gather_tail(tree: Any, dims: Any) -> Any:
  """This device's 1/N of each embedding/head leaf -> whole (all-gather over the stages)."""
  return jax.tree.map(
      lambda x, k: x if k < 0 else lax.all_gather(x, STAGE_AXES, axis=k, tiled=True), tree, dims)


def _scatter_tail(tree: Any, dims: Any, data_axes: Tuple[str, ...],
                  vocab: stages.VocabAxis = None) -> Any:
  """Whole embedding/head gradients -> summed over all devices, this device's 1/N kept. With a
  vocabulary-parallel head each tensor device holds its own columns of the LM head's gradient
  (zeros elsewhere), so that leaf is summed over `tensor` too."""
  def one(path, g, k):
    axes = data_axes
    if vocab is not None and any(getattr(p, "key", None) == "lm_head" for p in path):
      axes = axes + (vocab[0],)
    g = lax.psum(g, axes) if axes else g
    if k < 0:
      return lax.psum(g, STAGE_AXES)
    return lax.psum_scatter(g, STAGE_AXES, scatter_dimension=k, tiled=True)
  return jax.tree_util.tree_map_with_path(one, tree, dims)


def _model_grads_out(plan: _ModelPlan, acc: jax.Array, data_axes: Tuple[str, ...]
                     ) -> Dict[str, Any]:
  """A device's accumulator -> its block of the stage-stacked gradient tree. Layer gradients
  stay on the device: summed over the data shards (and the critic's replicas); the embedding
  and head gradients are summed over all devices and each device keeps its 1/N."""
  layers, embed, head = plan.layout.split_accumulator(acc)

  def layer_sum(g, split, kv_dim):  # fsdp-split leaves are summed over fsdp already
    axes = tuple(a for a in data_axes if a != "fsdp" or "fsdp" not in split.dims)
    axes += plan.replica_axes + (("tensor",) if kv_dim >= 0 else ())  # a shared KV head
    return lax.psum(g, axes) if axes else g
  return {"layers": jax.tree.map(layer_sum, layers, plan.splits, plan.kv_dims),
          "embed": _scatter_tail(embed, plan.tail_dims["embed"], data_axes),
          "head": _scatter_tail(head, plan.tail_dims["head"], data_axes, plan.vocab)}


def _model_plans(spec: _Spec, layouts: Dict[str, StageLayout], mba: int, mbc: int
                 ) -> Dict[str, _ModelPlan]:
  n, splits = spec.num_devices, _splits(spec)
  fsdp, tensor = _axis_sizes(spec.mesh)
  plans = {}
  for m, cfg, rows, replica_axes in (("actor", spec.actor_cfg, mba, ()),
                                     ("critic", spec.critic_cfg, mbc, (REPLICA_AXIS,))):
    layout = _local_layout(layouts[m], splits[m], spec.mesh)
    shapes = layout.staged_shapes()
    # The stage runs its layers itself (stages.blocks): how the whole model would run them
    # (cfg.scan_layers) only matters to the layout's stack / unstack.
    cfg = cfg.replace(scan_layers=False)
    plans[m] = _ModelPlan(
        name=m, cfg=cfg, layer_cfg=local_config(cfg, tensor), layout=layout, splits=splits[m],
        tail_dims={part: jax.tree.map(lambda x: tail_dim(x.shape, n), shapes[part])
                   for part in ("embed", "head")},
        rows=rows, forward_up=m == "actor", replica_axes=replica_axes, fsdp=fsdp > 1,
        vocab=stages.vocab_parallel(cfg, tensor) if m == "actor" else None,
        kv_dims=kv_head_dims(cfg, tensor), tensor=tensor)
  return plans


def _make_body(spec: _Spec, layouts: Dict[str, StageLayout], mba: int, mbc: int) -> Callable:
  """The per-device code: fori_loop over ticks of (switch, two ppermutes, file arrivals)."""
  plans = _model_plans(spec, layouts, mba, mbc)
  tensor = _axis_sizes(spec.mesh)[1]
  all_axes = STAGE_AXES + spec.data_axes

  def body(table, actor, critic, batch, num_tokens, num_seqs):
    # Attention and MLP sum their tensor-split outputs over "tensor" (llama.tensor_parallel).
    with llama.tensor_parallel("tensor" if tensor > 1 else None):
      seq_len = batch["tokens"].shape[1]
      sizes = [p.rows * seq_len * p.cfg.hidden_size for p in plans.values()]
      msgs = _Messages(max(sizes), jnp.result_type(*(p.cfg.jnp_dtype for p in plans.values())))
      # This device's stages (critic stage Pc-1-(device mod Pc): its rows are stored
      # reversed), with the embedding and head gathered whole.
      tasks = {}
      for m, local in (("actor", actor), ("critic", critic)):
        plan = plans[m]
        whole = {part: _gather_tail(local[part], plan.tail_dims[part])
                 for part in ("embed", "head")}
        tasks[m] = _StageTasks(plan, plan.layout.local_tree({**local, **whole}), batch,
                               num_tokens, num_seqs, spec.loss_cfg, msgs)
      # Branches indexed by the row's MODEL field (prog.IDLE, prog.ACTOR, prog.CRITIC).
      branches = [_idle(msgs), tasks["actor"].branch, tasks["critic"].branch]
      my_table = table[lax.axis_index(STAGE_AXES)]  # [ticks, FIELDS]

      def tick(t, carry):
        row = my_table[t]
        carry, up, down = lax.switch(row[prog.MODEL], branches, carry, row)
        return _exchange(carry, row, up, down, tasks, spec.num_devices)

      inbox = dict(zip(prog.INBOXES, spec.inbox_sizes))
      carry = _Carry(*(tasks[m].initial_state(stash, inbox[f"{m}_act"], inbox[f"{m}_grad"])
                       for m, stash in zip(MODELS, spec.stash_sizes)))
      carry = lax.fori_loop(0, my_table.shape[0], tick, carry)
      out = {m: _model_grads_out(plans[m], getattr(carry, m).grads, spec.data_axes)
             for m in MODELS}
      return (out["actor"], out["critic"], lax.psum(carry.actor.metrics, all_axes),
              lax.psum(carry.critic.metrics, all_axes))

  return body


def make_executor(actor_cfg: ModelConfig, critic_cfg: ModelConfig, loss_cfg: LossConfig,
                  problem: PipelineProblem, order: np.ndarray, mesh: Mesh, barrier: bool = False,
                  min_shape: Optional[prog.ProgramShape] = None,
                  compiler_options: Optional[Dict[str, Any]] = None) -> PipelineExecutor:
  """Compiles `order` (graph.py kinds, [N, T]) for `problem` and builds its executor (which
  checks the placement)."""
  return PipelineExecutor(actor_cfg, critic_cfg, loss_cfg,
                          prog.build_program(problem, order, barrier, min_shape), mesh,
                          compiler_options)
