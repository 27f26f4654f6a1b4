"""The PPO update through the fused actor/critic pipeline executor (mesh axis `stage` > 1).

Idea (docs/architecture.md §3): with a pipeline axis, one optimizer step of actor and critic is one
jitted program in which `pipeline/executor.py` runs a schedule of both models' micro-batch forwards
and backwards over the `stage` devices and returns each stage's gradients where its parameters
live (stage-stacked state); the optimizer steps follow in the same program.
`config.fusion.intra_stage` picks the schedule:

  True   the searched fused schedule (pipeline/search.py): the critic fills the actor's bubbles
  False  serial 1F1B: the actor's 1F1B, then the critic's 1F1B behind a barrier

Both run through the same executor, so they compute the same gradients (to float32 summation
order) and differ only in ticks. The gradients equal those of the plain update
(ppo.make_update_fn), whose metric names this update reports too.

The executor runs in lockstep ticks, so the schedule is searched on unit task durations: its
makespan is then exactly the tick count (program.py levels tasks the same way). A search runs once
per problem: the schedule is stored as JSON under `pipeline.schedule_cache_dir` (default: the
run's WORKDIR/cache/schedules, so a resumed run reuses its own schedule and nothing is written
outside the workdir), keyed by a hash of the problem and the search settings, and later runs load
it. The search has a wall-clock budget, so which optimal schedule it finds may vary between
machines; the cached file fixes it. Point several runs' `schedule_cache_dir` at one directory to
share searches between them. `pipeline.schedule_file` runs a given schedule instead (a
schedule.json of experiments.schedule_search for the run's shape: `file_schedule`).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Tuple

import jax
import numpy as np
import optax
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.models.llama import ModelConfig
from rlhfuse_jax.parallel import distributed
from rlhfuse_jax.parallel import mesh as mesh_lib
from rlhfuse_jax.pipeline.executor import PipelineExecutor, make_executor
from rlhfuse_jax.pipeline.graph import PipelineProblem
from rlhfuse_jax.rl import advantages as adv_lib
from rlhfuse_jax.trainer import ppo
from rlhfuse_jax.trainer.config import AlgoConfig, PipelineConfig, TrainConfig
from rlhfuse_jax.trainer.ppo import ModelState

if TYPE_CHECKING:
  from rlhfuse_jax.pipeline import schedule as schedule_lib
  from rlhfuse_jax.pipeline import search

# The schedule modules (numba's kernels: ~0.5 s to import numba) are imported where a pipelined
# update is built, not by every process that imports the trainer.

SERIAL, FUSED = "serial_1f1b", "fused"
_CACHE_VERSION = 1  # bump when the cached file's meaning changes


def pipeline_problem(stages: int, pipeline: PipelineConfig) -> PipelineProblem:
  """The schedule problem on unit durations (one task per lockstep tick).

  Per-device memory budget (docs/architecture.md §3): the executor's ring buffers are per-model
  maxima over devices, which neither budget bounds, and on unit-duration problems the uniform
  budget gained at most one tick while it can enlarge the rings."""
  return PipelineProblem(actor_pp=stages, critic_pp=pipeline.critic_pp or stages,
                         actor_microbatches=pipeline.actor_microbatches,
                         critic_microbatches=pipeline.critic_microbatches,
                         actor_fwd=1.0, critic_fwd=1.0, actor_bwd=1.0, critic_bwd=1.0,
                         memory_budget_mode="per_device")


def resolve_microbatches(pipeline: PipelineConfig, stages: int, rows: int) -> PipelineConfig:
  """`pipeline` with a micro-batch count of 0 made one row per micro-batch for `rows` mini-batch
  rows per data shard: the actor's `rows`, each critic replica's rows / (stages / critic_pp).
  (A count fits one data-parallel size; 0 fits every size whose rows split evenly over the
  critic replicas, as the LLaMA fused presets need; check_config says when they do not.)"""
  replicas = stages // (pipeline.critic_pp or stages)
  return dataclasses.replace(
      pipeline, actor_microbatches=pipeline.actor_microbatches or rows,
      critic_microbatches=pipeline.critic_microbatches or rows // max(replicas, 1))


def check_config(cfg: TrainConfig, mesh: Mesh) -> PipelineConfig:
  """Errors, naming the config field, for runs the pipelined update cannot do; returns
  config.pipeline with its micro-batch counts resolved for the mesh (resolve_microbatches)."""
  stages = mesh.shape["stage"]
  shards = mesh_lib.batch_size_multiple(mesh)
  rows = cfg.algo.minibatch_size // shards
  if rows < 1:
    raise ValueError(f"config.algo.minibatch_size={cfg.algo.minibatch_size} must be at least the "
                     f"data-parallel size (mesh data*fsdp = {shards}): each data shard needs a row")
  if not adv_lib.needs_critic(cfg.algo.estimator):
    raise ValueError(
        f"config.algo.estimator={cfg.algo.estimator!r} trains no critic, but mesh.stage={stages} "
        "> 1 trains through the fused actor/critic pipeline executor, which has no actor-only "
        "pipeline: use mesh.stage=1 or an estimator with a critic ('gae')")
  critic_pp = cfg.pipeline.critic_pp or stages
  if critic_pp > stages or stages % critic_pp:
    raise ValueError(f"config.pipeline.critic_pp={critic_pp} must divide mesh.stage={stages} "
                     "(the critic is replicated mesh.stage / critic_pp times over the stages)")
  if cfg.pipeline.critic_microbatches == 0 and rows % (stages // critic_pp):
    raise ValueError(
        f"config.pipeline.critic_microbatches=0 (one row per micro-batch) needs the mini-batch "
        f"rows per data shard (algo.minibatch_size={cfg.algo.minibatch_size} / mesh data*fsdp="
        f"{shards} = {rows}) to be a multiple of the critic replicas {stages // critic_pp} "
        "(mesh.stage / pipeline.critic_pp): fewer data shards, or a larger mini-batch")
  p = resolve_microbatches(cfg.pipeline, stages, rows)
  for field, model, n in (("model.num_layers", cfg.model, stages),
                          ("critic_model.num_layers", cfg.critic_model, critic_pp)):
    if model.num_layers % n:
      raise ValueError(f"config.{field}={model.num_layers} must be divisible by its pipeline "
                       f"stages {n} (mesh.stage={stages}, pipeline.critic_pp={critic_pp}): "
                       "layers are split evenly over stages")
  tensor = mesh.shape["tensor"]
  for field, model in (("model", cfg.model), ("critic_model", cfg.critic_model)):
    for name in ("num_heads", "intermediate_size"):
      if getattr(model, name) % tensor:
        raise ValueError(
            f"config.{field}.{name}={getattr(model, name)} must be divisible by mesh.tensor="
            f"{tensor}: the pipelined update splits heads and MLP width over the tensor axis "
            "(Megatron-style)")
    kv = model.num_kv_heads
    if kv % tensor and tensor % kv:
      raise ValueError(
          f"config.{field}.num_kv_heads={kv} must be divisible by mesh.tensor={tensor} or "
          "divide it (fewer KV heads than tensor devices: each is kept whole by the devices of "
          "its query heads)")
    if tensor > 1 and model.o_bias:
      raise ValueError(
          f"config.{field}.o_bias=True with mesh.tensor={tensor}: the pipelined update splits "
          "the output projection's rows over the tensor axis and would add its bias once per "
          "tensor device; use mesh.tensor=1 or mesh.stage=1 (the plain update handles it)")
  where = (f"the mini-batch rows per data shard (algo.minibatch_size={cfg.algo.minibatch_size} "
           f"/ mesh data*fsdp={shards} = {rows})")
  # A run resumed on more devices (mesh.data=-1 grows) cannot change the fingerprinted
  # micro-batch counts or mini-batch; mesh.data, fsdp and tensor it may (config.RESUMABLE_FIELDS).
  fix = ("; fewer data shards (mesh.data, mesh.fsdp; devices left over can go to mesh.tensor, "
         "which a resumed run may change too) or other micro-batch counts (a new run)")
  if rows % p.actor_microbatches:
    raise ValueError(f"config.pipeline.actor_microbatches={p.actor_microbatches} must divide "
                     f"{where}{fix}")
  replicas = stages // critic_pp
  if rows % (replicas * p.critic_microbatches):
    raise ValueError(f"config.pipeline.critic_microbatches={p.critic_microbatches} x critic "
                     f"replicas {replicas} (mesh.stage / pipeline.critic_pp) must divide "
                     f"{where}{fix}")
  return p


def cache_dir(pipeline: PipelineConfig, workdir: str = "") -> str:
  """pipeline.schedule_cache_dir if set, else WORKDIR/cache/schedules; a caller without a
  workdir (a library user) gets $XDG_CACHE_HOME or ~/.cache/rlhfuse_jax/schedules."""
  if pipeline.schedule_cache_dir:
    return os.path.expanduser(pipeline.schedule_cache_dir)
  if workdir:
    return os.path.join(workdir, "cache", "schedules")
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "rlhfuse_jax", "schedules")


def _cache_key(problem: PipelineProblem, config: search.SearchConfig) -> dict:
  return {"version": _CACHE_VERSION, "problem": problem.to_dict(),
          "search": dataclasses.asdict(config)}


def _shape(problem: PipelineProblem) -> dict:
  """What a schedule's order is for: the stages and micro-batches (schedule_search's fields)."""
  return {f: getattr(problem, f) for f in ("actor_pp", "critic_pp", "actor_microbatches",
                                           "critic_microbatches")}


def _shape_text(shape: dict, prefix: str = "", sep: str = ", ") -> str:
  return sep.join(f"{prefix}{k}={v}" for k, v in shape.items())


def search_command(problem: PipelineProblem) -> str:
  """The schedule_search command for the trainer's own problem (`pipeline_problem`): its shape,
  unit durations and per-device budget. With the shape alone it searched configs/
  schedule_search.py's durations (actor forward 5, critic 4), another cost: ppo_tiny:fused's
  shape then trained at 28 ticks where its own search reaches the bound, 26."""
  timing = {k: f"{getattr(problem, k):g}" for k in ("actor_fwd", "critic_fwd", "actor_bwd",
                                                   "critic_bwd")}
  return ("python -m experiments.schedule_search --config=configs/schedule_search.py "
          "--workdir=DIR " + _shape_text({**_shape(problem), **timing,
                                          "memory_budget_mode": problem.memory_budget_mode},
                                         "--config.", " "))


def file_schedule(problem: PipelineProblem, path: str) -> schedule_lib.Schedule:
  """pipeline.schedule_file's schedule, re-timed on the run's `problem` (unit durations: its
  makespan is the lockstep program's ticks). The file is a schedule.json of
  experiments.schedule_search or a cache file of searched_schedule ({"key", "schedule"}); its
  durations and memory budget may differ from the run's (the executor runs the order in
  lockstep), its shape may not: an error names both shapes and the fields that set the run's."""
  from rlhfuse_jax.pipeline import schedule as schedule_lib
  field = f"config.pipeline.schedule_file={path!r}"
  try:
    with open(os.path.expanduser(path)) as f:
      data = json.load(f)
  except FileNotFoundError:
    raise FileNotFoundError(f"{field}: no such file") from None
  except IsADirectoryError:  # schedule_search's workdir, not its schedule.json
    raise ValueError(f"{field} is a directory; expected a file (schedule_search writes "
                     f"{os.path.join(path, 'schedule.json')})") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{field}: not JSON ({e}); expected a schedule.json of "
                     "experiments.schedule_search") from None
  if isinstance(data, dict) and "schedule" in data:
    data = data["schedule"]  # a cache file
  try:
    found = schedule_lib.from_dict(data)
  except (KeyError, TypeError) as e:
    raise ValueError(f"{field}: not a schedule ({type(e).__name__}: {e}); expected a "
                     "schedule.json of experiments.schedule_search") from None
  except ValueError as e:
    raise ValueError(f"{field}: {e}") from None
  if _shape(found.problem) != _shape(problem):
    raise ValueError(
        f"{field} is a schedule for {_shape_text(_shape(found.problem))}; this run's pipeline "
        f"is {_shape_text(_shape(problem))} (mesh.stage, pipeline.critic_pp, "
        f"pipeline.actor_microbatches, pipeline.critic_microbatches): search one on the "
        f"trainer's problem with {search_command(problem)}")
  # Its order re-timed on its own problem: one that holds more micro-batches' activations than
  # the budget it states (tasks reordered by hand, all forwards first) was trained without a
  # word, the executor's activation buffers grown to match.
  over = schedule_lib.from_order(found.problem, found.order()).over_budget()
  if over:
    raise ValueError(f"{field}: its order holds more in-flight activations than the memory "
                     f"budget it states ({over}, in micro-batch units): not a schedule the "
                     f"search keeps; search one with {search_command(problem)}")
  here = schedule_lib.from_order(problem, found.order())
  over = here.over_budget()
  if over:
    logging.warning("%s: within its own memory budget, but over this run's per-device one (%s, "
                    "in micro-batch units): the executor holds that many micro-batches' "
                    "activations; %s searches one within it", field, over,
                    search_command(problem))
  return here


def searched_schedule(problem: PipelineProblem, pipeline: PipelineConfig, workdir: str = ""
                      ) -> Tuple[schedule_lib.Schedule, str]:
  """The fused schedule of `problem`, from the disk cache or searched (then cached) in
  cache_dir(pipeline, workdir).

  Returns (schedule, path of its cache file).
  """
  from rlhfuse_jax.pipeline import schedule as schedule_lib
  from rlhfuse_jax.pipeline import search
  config = search.SearchConfig(time_budget_s=pipeline.search_time_s, seed=pipeline.search_seed,
                               max_evaluations=pipeline.search_evaluations or None)
  key = _cache_key(problem, config)
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
  path = os.path.join(cache_dir(pipeline, workdir), f"{digest}.json")
  if os.path.exists(path):
    try:
      # (a JSON list, not an object, was an AttributeError's 54-line traceback)
      stored = wd.read_json_object(path)
      if stored.get("key") != json.loads(json.dumps(key)):
        raise ValueError("it holds another problem's schedule")
      found = schedule_lib.from_dict(stored["schedule"])  # re-checked: valid, deadlock-free
      if found.problem != problem:  # a key of this problem over another problem's schedule
        raise ValueError("its schedule is of another problem than its key")
      logging.info("pipeline: using the cached fused schedule %s", path)
      return found, path
    except (ValueError, KeyError, TypeError) as e:
      logging.warning("pipeline: ignoring the cached schedule %s (%s); searching again", path, e)
  budget = (f"{config.time_budget_s:g}s" if config.max_evaluations is None else
            f"{config.max_evaluations} evaluations")
  logging.info("pipeline: searching a fused schedule (budget %s, %s; cached afterwards in %s) "
               "...", budget, search.KERNELS_NOTE, os.path.dirname(path))
  # The kernels first, outside the budget: compiled inside it, a fresh checkout's 2 s search
  # took 34 s and saw 6 start schedules instead of ~600 (schedule_search does the same).
  logging.info("pipeline: search kernels ready in %.1fs (compiled or loaded from cache)",
               search.warmup())
  result = search.search(problem, config)
  found = schedule_lib.from_order(problem, result.best)
  try:
    wd.write_json(path, {"key": key, "schedule": found.to_dict(),
                         "search_s": result.search_s, "evaluations": result.evaluations})
  except OSError as e:  # (a full disk stopped the set-up: a cache only spares a search)
    logging.warning("pipeline: could not cache the searched schedule in %s (%s); the run goes "
                    "on, and its next start searches again", path, wd.os_error_text(e))
  else:
    logging.info("pipeline: searched a fused schedule in %.1fs (%d evaluations), makespan %g "
                 "ticks; cached at %s", result.search_s, result.evaluations, found.makespan,
                 path)
  return found, path


class PipelinedUpdate:
  """update(actor, critic, mb) -> (actor, critic, metrics), as ppo.make_update_fn's, on states
  whose parameters are stage-stacked (`to_staged`; `whole_fn` converts back), with optimizers
  built for that tree (rl/optim.py with stages.staged_decay_mask).

  `schedule_metrics` holds the schedule's figures (pipeline/schedule, /ticks, /bubble), the same
  every step; the trainer adds them to each iteration's metrics.
  """

  def __init__(self, executor: PipelineExecutor, schedule_name: str, algo: AlgoConfig,
               actor_tx: optax.GradientTransformation, critic_tx: optax.GradientTransformation,
               compiler_options: Dict[str, Any]):
    self.executor, self.schedule_name = executor, schedule_name
    self._txs = (actor_tx, critic_tx)
    # Built at the first call, when the states' shardings are known: the gradients are
    # constrained to them, so the updated parameters and moments keep their stage placement.
    self._step = ppo.StatePreservingJit(self._make, donate_argnums=(0, 1),
                                        compiler_options=compiler_options or None)
    self._conversions: Dict[Any, Callable] = {}  # to_staged / whole_fn executables
    self._reshard_bytes: Dict[Any, int] = {}
    program = executor.program
    self.schedule_metrics = {
        "pipeline/schedule": schedule_name,
        "pipeline/ticks": program.ticks,
        # Share of device ticks spent idle (each device runs 2 Ma + 2 Mc tasks).
        "pipeline/bubble": 1.0 - program.problem.tasks_per_device / program.ticks,
    }

  def __call__(self, actor: ModelState, critic: ModelState, mb: Dict[str, jax.Array]):
    # One mesh for the whole program (executor.on_program_mesh): the batch each call, the
    # state's leaves still on the trainer's mesh (the optimizer's step counts) once; the states
    # come back on the program's mesh.
    return self._step(*self.executor.on_program_mesh((actor, critic, mb)))

  # The states' parameters are stage-stacked (executor.stack): each stage device holds its own
  # layers, their gradients and their optimizer moments, nothing of the other stages.

  def to_staged(self, model: str, params: Any) -> Any:
    """Unpipelined params of "actor" / "critic" (in the model's form: unrolled, or scanned
    under scan_layers) -> the stage-stacked tree, placed (StageLayout.stack)."""
    key = ("staged", model)
    if key not in self._conversions:
      self._conversions[key] = jax.jit(functools.partial(self.executor.stack, model),
                                       out_shardings=self.executor.staged_shardings(model))
    return self._conversions[key](params)

  def whole_fn(self, model: str, staged: Any, shardings: Any) -> Callable:
    """f(staged) -> unpipelined params of "actor" / "critic" placed by `shardings` (how
    generation and inference take them): a resharding, gathering each stage's layers onto every
    device that needs them; the state's own arrays are left untouched. Compiled ahead of time
    for `staged`'s shapes and placement (once per model and target placement), so that calling
    it costs only the transfer."""
    key = ("whole", model, tuple(jax.tree.leaves(shardings)))
    if key not in self._conversions:
      self._conversions[key] = jax.jit(functools.partial(self.executor.unstack, model),
                                       out_shardings=shardings).lower(
                                           mesh_lib.abstract(staged)).compile()
    return self._conversions[key]

  def reshard_bytes(self, model: str, staged: Any, whole: Any) -> int:
    """Bytes the most loaded device receives when `whole_fn` turns `staged` into `whole`, from
    both placements' shard boxes (exact; computed once per model and placement)."""
    key = (model, tuple(x.sharding for x in jax.tree.leaves(whole)))
    if key in self._reshard_bytes:
      return self._reshard_bytes[key]
    layout = self.executor.layouts[model]
    received: collections.Counter = collections.Counter()
    for part in ("embed", "head"):
      for src, dst in zip(jax.tree.leaves(staged[part]), jax.tree.leaves(whole[part])):
        received.update(mesh_lib.missing_bytes(dst, src.sharding.devices_indices_map(
            src.shape).get))
    layer_leaves = jax.tree.leaves(staged["layers"])  # [S, L/S, *shape] each
    boxes = [x.sharding.devices_indices_map(x.shape) for x in layer_leaves]
    if layout.scanned:  # whole leaves [L, *shape]: what a device holds is one box of layers
      for box_map, dst in zip(boxes, jax.tree.leaves(whole["layers"]["block"])):
        received.update(mesh_lib.missing_bytes(dst, functools.partial(
            _held_layers, layout=layout, box_map=box_map)))
    else:  # unrolled: layer by layer
      for i in range(layout.cfg.num_layers):
        stage, k = divmod(i, layout.per_stage)
        row = layout.row(stage)

        def held(device, box_map, row=row, k=k):  # what `device` holds of layer i's leaf
          rows, ks, *rest = box_map[device]
          inside = (row in range(*rows.indices(layout.num_stages)) and
                    k in range(*ks.indices(layout.per_stage)))
          return tuple(rest) if inside else None
        for box_map, dst in zip(boxes, jax.tree.leaves(whole[f"layers_{i}"])):
          received.update(mesh_lib.missing_bytes(dst, functools.partial(held, box_map=box_map)))
    self._reshard_bytes[key] = max(received.values())
    return self._reshard_bytes[key]

  def lower(self, actor: ModelState, critic: ModelState, mb: Dict[str, Any]):
    """The jitted update lowered for states and batch given as arrays or as
    jax.ShapeDtypeStructs with shardings (ahead-of-time memory checks: nothing is allocated)."""
    return self._step.lower(*self.executor.on_program_mesh((actor, critic, mb)))

  def _make(self, shardings) -> Callable:
    """The update for states placed by `shardings` ((actor, critic) ModelStates of shardings)."""
    shardings = (shardings[0].params, shardings[1].params)
    actor_tx, critic_tx = self._txs
    grads_fn = self.executor.staged_grads_fn

    def update(actor: ModelState, critic: ModelState, mb):
      ag, cg, m = grads_fn(actor.params, critic.params, mb)
      ag = jax.lax.with_sharding_constraint(ag, shardings[0])
      cg = jax.lax.with_sharding_constraint(cg, shardings[1])
      updates, opt = actor_tx.update(ag, actor.opt_state, actor.params)
      actor = ModelState(optax.apply_updates(actor.params, updates), opt)
      updates, copt = critic_tx.update(cg, critic.opt_state, critic.params)
      critic = ModelState(optax.apply_updates(critic.params, updates), copt)
      # The executor's metrics are mini-batch values, logged as the plain update logs them.
      metrics = ppo.actor_metrics(self.executor.loss_cfg, m)
      metrics["actor/grad_norm"] = ppo.grad_norm(ag)
      metrics.update(ppo.critic_metrics(m))
      metrics["critic/grad_norm"] = ppo.grad_norm(cg)
      return actor, critic, metrics

    return update


def _held_layers(device: Any, layout: Any, box_map: Dict[Any, tuple]) -> Tuple[slice, ...]:
  """What `device` holds of a scanned layer leaf [L, *shape], as a box, from its box of the
  stage-stacked leaf [S, L/S, *shape]: its rows are consecutive stages (a reverse layout's rows
  too), so with whole rows (the stage placement never splits L/S) its layers are consecutive."""
  rows, ks, *rest = box_map[device]
  stage_ids = sorted(layout.row(r) for r in range(*rows.indices(layout.num_stages)))
  k0, k1, _ = ks.indices(layout.per_stage)
  if len(stage_ids) > 1 and (k0, k1) != (0, layout.per_stage):
    raise NotImplementedError(f"a device holds part of each of the stages {stage_ids}: its "
                              "layers are no single box")
  first = stage_ids[0] * layout.per_stage
  return (slice(first + k0, stage_ids[-1] * layout.per_stage + k1),) + tuple(rest)


def _fused_order_here(problem: PipelineProblem, pipeline: PipelineConfig, workdir: str
                      ) -> np.ndarray:
  if pipeline.schedule_file:
    found = file_schedule(problem, pipeline.schedule_file)
    logging.info("pipeline: the fused schedule of config.pipeline.schedule_file=%r (%d ticks "
                 "here), no search", pipeline.schedule_file, found.makespan)
    return found.order()
  return searched_schedule(problem, pipeline, workdir)[0].order()


def fused_order(problem: PipelineProblem, pipeline: PipelineConfig, workdir: str) -> np.ndarray:
  """The fused schedule's per-device order (pipeline.schedule_file's, else searched), the same
  on every process: process 0 searches (on its own clock) or loads, and alone writes the cache,
  so the cached schedule is the one every process runs and a resume runs it again; the others
  take it by broadcast. A failure there (a schedule_file that does not fit; a cache file that
  cannot be written only warns) stops every process, not process 0 alone while the others wait
  for it in the update's first collective."""
  from rlhfuse_jax.pipeline import schedules
  if jax.process_count() == 1:
    return _fused_order_here(problem, pipeline, workdir)
  order = distributed.run_on_main_process(
      lambda: _fused_order_here(problem, pipeline, workdir),
      "process 0 failed to search or cache the fused pipeline schedule (its log has the error)")
  if order is None:  # the others: a placeholder of the order's shape and dtype
    order = schedules.serial_order(problem)
  return np.asarray(multihost_utils.broadcast_one_to_all(order))


def make_pipelined_update_fn(actor_cfg: ModelConfig, critic_cfg: ModelConfig, algo: AlgoConfig,
                             temperature: float, actor_tx: optax.GradientTransformation,
                             critic_tx: optax.GradientTransformation, *, mesh: Mesh,
                             config: TrainConfig, workdir: str = "") -> PipelinedUpdate:
  """ppo.make_update_fn through the pipeline executor on `mesh` (whose `stage` axis is > 1).

  `config` supplies the pipeline section, fusion.intra_stage and the mini-batch size; `workdir`
  (the run's) holds the searched-schedule cache unless pipeline.schedule_cache_dir is set.
  """
  config = dataclasses.replace(config, pipeline=check_config(
      dataclasses.replace(config, model=actor_cfg, critic_model=critic_cfg), mesh))
  problem = pipeline_problem(mesh.shape["stage"], config.pipeline)
  from rlhfuse_jax.pipeline import schedules
  if config.fusion.intra_stage:
    name, barrier = FUSED, False
    order = fused_order(problem, config.pipeline, workdir)
  else:
    name, barrier = SERIAL, True
    order = schedules.serial_order(problem)
  executor = make_executor(actor_cfg, critic_cfg, ppo.loss_config(algo, temperature), problem,
                           order, mesh, barrier=barrier)
  program = executor.program
  executor.microbatch_sizes(config.algo.minibatch_size)  # raises if the rows do not split
  logging.info("pipeline: %s schedule, %d ticks (bubble %.2f) on stage=%d, critic_pp=%d, "
               "micro-batches %d (actor) / %d per critic replica", name, program.ticks,
               1.0 - problem.tasks_per_device / program.ticks, problem.actor_pp,
               problem.critic_pp, problem.actor_microbatches, problem.critic_microbatches)
  opts = ({"xla_backend_optimization_level": config.pipeline.xla_opt_level}
          if config.pipeline.xla_opt_level >= 0 else {})
  return PipelinedUpdate(executor, name, algo, actor_tx, critic_tx, opts)
