r"""Benchmark of the fused actor/critic pipeline executor (docs/architecture.md §3, intra-stage
fusion).

  python -m experiments.bench_pipeline --config=configs/bench_pipeline.py --workdir=/tmp/bench_pipeline

Runs four schedules of the same problem through pipeline/executor.py on a `data x stage` mesh:
serial 1F1B (actor 1F1B, then critic 1F1B behind a barrier), greedy fused, and two searched fused
schedules (pipeline/search.py within the memory budget): `searched` minimises lockstep ticks (the
search on unit durations), `searched_time` the list-scheduled time under the cost model (backward
= bwd_ratio x forward). For each: lockstep ticks (program.py), the
lockstep time under the cost model (each tick lasts as long as its longest task), compile time,
wall time of one step (median of `repeats` after `warmup`), stash ring sizes and per-device peaks,
and the gradient errors of both models against `jax.grad` of the unpipelined losses
(stages.reference_grads). Also the wall time of that unpipelined step on one device.

On a CPU the binary gives the host platform 8 fake devices (XLA_FLAGS, set before jax is
imported, unless already set). They share the host's cores, so a step's wall time there is the
total work plus per-tick overhead, not the pipeline's parallel time: the ticks and the lockstep
time are the figures that carry over to real accelerators.

It also measures, with the same executor, the costs the simulator needs to predict these step
times (sim/lockstep.py, checked by experiments/reproduce_ablations.py's validation) and writes
them to `calibration.json` (policy/calibration.py format): per stage and micro-batch, the forward
and backward of the actor and of the critic, and the executor's fixed cost per tick and per
step (see measure_calibration). `schedules.json` records the orders that ran, so the validation
rebuilds exactly those ticks.
"""
from __future__ import annotations

import os

from rlhfuse_jax.parallel.host_devices import request_host_devices

request_host_devices(8)  # before the first jax import

import dataclasses  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

import jax  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import config_files  # noqa: E402
from experiments import runner  # noqa: E402
from rlhfuse_jax import workdir as wd  # noqa: E402
from rlhfuse_jax.models import llama  # noqa: E402
from rlhfuse_jax.parallel.mesh import MeshConfig, make_mesh  # noqa: E402
from rlhfuse_jax.pipeline import program as prog  # noqa: E402
from rlhfuse_jax.pipeline import bounds, schedules, search, stages  # noqa: E402
from rlhfuse_jax.pipeline.evaluate import evaluate  # noqa: E402
from rlhfuse_jax.pipeline.executor import PipelineExecutor, make_executor  # noqa: E402
from rlhfuse_jax.perf.timing import time_in_rotation, timed  # noqa: E402
from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF, KIND_NAMES, PipelineProblem  # noqa: E402
from rlhfuse_jax.policy import calibration as cal_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Benchmark config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
flags.mark_flags_as_required(["config", "workdir"])

_MODEL_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads")


@dataclasses.dataclass(frozen=True)
class BenchPipelineConfig:
  """Typed form of configs/bench_pipeline.py."""
  seed: int
  actor_pp: int
  critic_pp: int
  data: int
  actor_microbatches: int
  critic_microbatches: int
  minibatch_size: int
  prompt_len: int
  response_len: int
  actor: llama.ModelConfig
  critic: llama.ModelConfig
  actor_fwd: float
  critic_fwd: float
  bwd_ratio: float
  search_time_s: float
  warmup: int
  repeats: int
  calib_ticks: int
  loss: stages.LossConfig

  def __post_init__(self):
    for name in ("actor_pp", "critic_pp", "data", "actor_microbatches", "critic_microbatches",
                 "minibatch_size", "prompt_len", "response_len", "repeats", "calib_ticks"):
      if getattr(self, name) < 1:
        raise ValueError(f"config.{name}={getattr(self, name)} must be >= 1")
    if self.warmup < 0:
      raise ValueError(f"config.warmup={self.warmup} must be >= 0")
    if self.seed < 0:  # numpy's default_rng refused it after the earlier outputs moved aside
      raise ValueError(f"config.seed={self.seed} must be >= 0")
    for name in ("bwd_ratio", "search_time_s"):
      # (search_time_s inf: the schedule search never returned)
      if not 0 < getattr(self, name) < float("inf"):
        raise ValueError(f"config.{name}={getattr(self, name)!r} must be a finite number > 0")

  @classmethod
  def from_config_dict(cls, c: Any) -> "BenchPipelineConfig":
    for name in ("prompt_len", "response_len"):  # (else blamed on the models' max_seq_len)
      if int(c[name]) < 1:
        raise ValueError(f"config.{name}={c[name]} must be >= 1")
    seq = int(c.prompt_len) + int(c.response_len)
    def model(name, head):  # its errors name this config's section, not ModelConfig's "model."
      try:
        return llama.ModelConfig(**{f: int(c[name][f]) for f in _MODEL_FIELDS}, head=head,
                                 max_seq_len=seq)
      except ValueError as e:
        raise ValueError(f"config.{name}: {e}") from None
    if float(c.value_clip_eps) < 0:  # (0: unclipped; LossConfig's own error says None)
      raise ValueError(f"config.value_clip_eps={c.value_clip_eps}: expected >= 0 (0: unclipped)")
    try:
      loss = stages.LossConfig(clip_eps=float(c.clip_eps),
                               value_clip_eps=float(c.value_clip_eps) or None,
                               vf_coef=float(c.vf_coef), entropy_coef=float(c.entropy_coef))
    except ValueError as e:  # "loss.clip_eps=...": these are top-level fields here
      raise ValueError(f"config.{str(e).removeprefix('loss.')}") from None
    return cls(seed=int(c.seed), actor_pp=int(c.actor_pp), critic_pp=int(c.critic_pp),
               data=int(c.data), actor_microbatches=int(c.actor_microbatches),
               critic_microbatches=int(c.critic_microbatches),
               minibatch_size=int(c.minibatch_size), prompt_len=int(c.prompt_len),
               response_len=int(c.response_len), actor=model("actor", "lm"),
               critic=model("critic", "scalar"), actor_fwd=float(c.actor_fwd),
               critic_fwd=float(c.critic_fwd), bwd_ratio=float(c.bwd_ratio),
               search_time_s=float(c.search_time_s), warmup=int(c.warmup),
               repeats=int(c.repeats), calib_ticks=int(c.calib_ticks), loss=loss)

  def problem(self) -> PipelineProblem:
    return PipelineProblem(self.actor_pp, self.critic_pp, self.actor_microbatches,
                           self.critic_microbatches, self.actor_fwd, self.critic_fwd,
                           actor_bwd=self.bwd_ratio * self.actor_fwd,
                           critic_bwd=self.bwd_ratio * self.critic_fwd)


def machine() -> dict:
  """What ran the benchmark, in words and figures."""
  devs = jax.devices()
  cpu = runner.host_cpu()
  fake = devs[0].platform == "cpu"
  return {
      "platform": devs[0].platform, "device_kind": devs[0].device_kind,
      "num_devices": len(devs), "host_cpu": cpu, "host_cores": os.cpu_count(),
      "jax": jax.__version__, "jaxlib": jaxlib.__version__,
      "description": (f"{len(devs)} fake CPU devices sharing {os.cpu_count()} host cores "
                      f"({cpu}); wall times measure total work, not pipeline parallelism"
                      if fake else f"{len(devs)} x {devs[0].device_kind}"),
  }


def make_batch(cfg: BenchPipelineConfig) -> dict:
  """A random PPO mini-batch in the trainer's layout (stages.py)."""
  b, p, t = cfg.minibatch_size, cfg.prompt_len, cfg.response_len
  rng = np.random.default_rng([cfg.seed, 1])
  resp = np.where(np.arange(b) < b // 2, t, rng.integers(1, t + 1, size=b))  # [B]
  v = cfg.actor.vocab_size
  batch = {
      "tokens": rng.integers(1, v, (b, p + t)).astype(np.int32),  # [B, P+T]
      "prompt_lens": np.full((b,), p, np.int32),  # [B]
      "mask": (np.arange(t)[None] < resp[:, None]).astype(np.float32),  # [B, T]
      "old_logp": (-np.log(v) + 0.2 * rng.standard_normal((b, t))).astype(np.float32),
      "advantages": rng.standard_normal((b, t)).astype(np.float32),
      "returns": rng.standard_normal((b, t)).astype(np.float32),
      "old_values": (0.5 * rng.standard_normal((b, t))).astype(np.float32),
  }
  return {k: jax.numpy.asarray(x) for k, x in batch.items()}


def grad_error(got: Any, want: Any) -> dict:
  """Max over leaves of max|g - r| / max|r|, and the global relative L2 error."""
  worst, num, den = 0.0, 0.0, 0.0
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    worst = max(worst, float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)))
    num += float(np.sum((g - r) ** 2))
    den += float(np.sum(r ** 2))
  return {"max_leaf_rel": worst, "global_rel_l2": (num / max(den, 1e-300)) ** 0.5}


def run_schedule(name: str, cfg: BenchPipelineConfig, problem: PipelineProblem,
                 order: np.ndarray, barrier: bool, mesh, params, batch,
                 reference, compiled: Optional[dict] = None) -> tuple[dict, Callable[[], Any]]:
  """(result without timings, the compiled and warmed step): timed by run() in rotation.
  `compiled`: {(spec, table shape): the schedule that compiled it}, of the schedules before:
  the instruction table is an argument of the program, so a schedule of another's shape
  (ticks) runs that one's executable, and its compile_s is jax's cache lookup."""
  ex = make_executor(cfg.actor, cfg.critic, cfg.loss, problem, order, mesh, barrier=barrier)
  program = ex.program
  key = (ex.spec, np.shape(ex.table))
  reused = None if compiled is None else compiled.setdefault(key, name)
  reused = None if reused == name else reused
  logging.info("%s: %d ticks; compiling the shard_map program ...", name, program.ticks)
  t0 = time.perf_counter()
  step = ex.compile(params[0], params[1], batch)
  compile_s = time.perf_counter() - t0
  ga, gc, metrics = jax.block_until_ready(step(params[0], params[1], batch))
  timed(lambda: step(params[0], params[1], batch), cfg.warmup, 0)
  release = schedules.serial_release(problem) if barrier else (0.0, 0.0)
  ev = evaluate(problem, order, release)
  out = {
      **program.summary(),
      "bubble_ticks": 1.0 - problem.tasks_per_device / program.ticks,
      "list_schedule_makespan": ev.makespan,
      "peak_memory": ev.peaks.tolist(),
      "memory_budget": ev.budget.tolist(),
      "compile_s": compile_s,
      # The program it ran was compiled for that schedule (same shape): compile_s is no compile.
      "compile_reused_from": reused,
      "grad_error": {"actor": grad_error(ga, reference[0]),
                     "critic": grad_error(gc, reference[1])},
      "metrics": {k: float(v) for k, v in metrics.items()},
      "metrics_reference": {k: float(reference[2][k]) for k in metrics},
  }
  logging.info("%s: %d ticks (lockstep time %g), compile %.1fs%s; grad error actor %.2e critic "
               "%.2e", name, program.ticks, out["lockstep_time"], compile_s,
               f" (none: {reused}'s program, the same shape)" if reused else "",
               out["grad_error"]["actor"]["max_leaf_rel"],
               out["grad_error"]["critic"]["max_leaf_rel"])
  return out, lambda: step(params[0], params[1], batch)


def _task_table(problem: PipelineProblem, ticks: int, device: int, kind: int,
                shape: prog.ProgramShape) -> np.ndarray:
  """int32 [N, ticks, FIELDS]: `device` runs a task of `kind` at every tick, the others idle
  (kind None: all idle). No message is filed (arrival codes stay RECV_NONE): the two ppermutes
  and the filing run every tick whatever the table says, so only the task's own work differs
  from an idle tick. Stage inputs and messages are whatever the rings hold; the work does not
  depend on their values."""
  table = np.zeros((problem.num_devices, ticks, prog.FIELDS), np.int32)
  if kind is None:
    return table
  actor = kind in (AF, AB)
  stage = device if actor else problem.critic_stage(device)
  pp = problem.actor_pp if actor else problem.critic_pp
  m = problem.actor_microbatches if actor else problem.critic_microbatches
  base = 0 if actor else problem.critic_replica(device) * m
  stash = shape.stash_sizes[0 if actor else 1]
  for t in range(ticks):
    row = table[device, t]
    row[prog.MODEL] = prog.ACTOR if actor else prog.CRITIC
    row[prog.BACKWARD] = kind in (AB, CB)
    row[prog.FIRST], row[prog.LAST] = stage == 0, stage == pp - 1
    row[prog.MICRO] = base + t % m
    row[prog.STASH_SLOT] = t % stash
    row[prog.INBOX_SLOT] = t % shape.inbox_sizes[kind]
  return table


def _stepper(cfg: BenchPipelineConfig, template: prog.Program, table: np.ndarray,
             shape: prog.ProgramShape, mesh, params, batch) -> Callable[[], float]:
  """A compiled, warmed executor step running `table`; calling it times one step (seconds)."""
  program = dataclasses.replace(template, table=table, stash_sizes=shape.stash_sizes,
                                inbox_sizes=shape.inbox_sizes)
  ex = PipelineExecutor(cfg.actor, cfg.critic, cfg.loss, program, mesh)
  # Tables of one shape on one mesh share a compilation (the table is an argument).
  timed(lambda: ex(params[0], params[1], batch), cfg.warmup + 1, 0)

  def one() -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(ex(params[0], params[1], batch))
    return time.perf_counter() - t0
  return one


def _paired(a: Callable[[], float], b: Callable[[], float], repeats: int) -> tuple:
  """(median of b - a over interleaved pairs, median of a): pairs taken back to back cancel the
  slow drift of a host shared with other work, which medians of separate batches do not."""
  runs = [(a(), b()) for _ in range(repeats)]
  return (float(np.median([y - x for x, y in runs])), float(np.median([x for x, _ in runs])))


def measure_calibration(cfg: BenchPipelineConfig, problem: PipelineProblem,
                        programs: list, mesh, params, batch) -> tuple[dict, dict]:
  """This machine's executor costs in the simulator's calibration format (policy/calibration.py),
  and a check of the lockstep model on a table where every device works at every tick.

  Everything runs through PipelineExecutor with hand-made tables of the ring sizes of the
  programs the bench ran (`programs`), so the stage code, the switch and the ppermutes are the
  ones timed in the bench:
  - tick and step overhead: all-idle tables of K and 3K ticks on the bench's mesh. A step is
    step_overhead + ticks x tick_overhead; two lengths separate the two (slope and intercept),
    and the mesh is the bench's, since the exchange costs depend on how many devices take part.
  - a task: a table where one device runs that task (one model, one stage, forward or
    backward) at every one of K ticks and every other device idles, minus the all-idle table of
    the same shape, over K. The difference is what the task adds to a tick. It is taken on a
    mesh of the stage axis alone (no data copies) with the mini-batch shard one data copy sees
    (same micro-batch rows), so exactly one device computes while the others wait at the
    ppermute: the task's time on one core, without competition for the shared cores, which is
    the quantity the lockstep model (sim/lockstep.py) composes per tick.
  - the check (not used by the model): on the bench's mesh every device runs its actor
    backward at every tick; the lockstep model predicts what that adds per tick from the
    measured task times and the host's cores, the measurement says how many tasks effectively
    ran at once.
  """
  shape = prog.common_shape(*programs)
  k, reps = cfg.calib_ticks, cfg.repeats
  template = programs[0]
  idle = _stepper(cfg, template, _task_table(problem, k, 0, None, shape), shape, mesh, params,
                  batch)
  idle_long = _stepper(cfg, template, _task_table(problem, 3 * k, 0, None, shape), shape, mesh,
                       params, batch)
  diff, t_short = _paired(idle, idle_long, reps)
  tick_s = max(diff / (2 * k), 0.0)
  step_over_s = max(t_short - k * tick_s, 0.0)
  logging.info("executor overhead on the %s mesh: %.3f ms per tick, %.3f ms per step",
               dict(mesh.shape), 1e3 * tick_s, 1e3 * step_over_s)

  one = make_mesh(MeshConfig(data=1, stage=cfg.actor_pp), jax.devices()[:cfg.actor_pp])
  shard = cfg.minibatch_size // cfg.data
  local = {key: x[:shard] for key, x in batch.items()}  # one data copy's rows
  idle_one = _stepper(cfg, template, _task_table(problem, k, 0, None, shape), shape, one, params,
                      local)
  per_stage = {}
  for kind in (AF, AB, CF, CB):
    actor = kind in (AF, AB)
    pp = problem.actor_pp if actor else problem.critic_pp
    secs = []
    for stage in range(pp):
      device = stage if actor else problem.critic_device(0, stage)
      busy = _stepper(cfg, template, _task_table(problem, k, device, kind, shape), shape, one,
                      params, local)
      # Below the clock's noise a task still costs something; 1 us keeps the file valid.
      secs.append(max(_paired(idle_one, busy, reps)[0] / k, 1e-6))
    per_stage[kind] = secs
    logging.info("%s per stage (ms): %s", KIND_NAMES[kind],
                 " ".join(f"{1e3 * x:.3f}" for x in secs))

  all_busy = np.zeros((problem.num_devices, k, prog.FIELDS), np.int32)
  for d in range(problem.num_devices):
    all_busy[d] = _task_table(problem, k, d, AB, shape)[d]
  busy = _stepper(cfg, template, all_busy, shape, mesh, params, batch)
  added = _paired(idle, busy, reps)[0] / k
  mach = machine()
  shared = mach["platform"] == "cpu"
  cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count()) if shared else None
  work = cfg.data * float(np.sum(per_stage[AB]))  # one actor backward per device, all copies
  predicted = max(max(per_stage[AB]), work / cores) if shared else max(per_stage[AB])
  check = {"what": "every device runs its actor backward at every tick, on the bench mesh",
           "added_per_tick_s": added, "predicted_added_per_tick_s": predicted,
           "task_work_per_tick_s": work,
           "effective_parallel_tasks": work / added if added > 0 else None,
           "host_cores": cores}
  logging.info("all devices busy: %.3f ms added per tick, lockstep model %.3f ms; %.2f tasks "
               "ran at once (host cores: %s)", 1e3 * added, 1e3 * predicted,
               work / added if added > 0 else float("nan"), cores)

  mean = {kind: float(np.mean(v)) for kind, v in per_stage.items()}
  out = {
      "format": cal_lib.FORMAT,
      "device": f"{mach['description']}; measured by experiments/bench_pipeline.py",
      "devices_share_compute": shared,
      "ops": {
          "train_stage": {
              "actor_fwd_s": mean[AF], "critic_fwd_s": mean[CF],
              "actor_bwd_s": mean[AB], "critic_bwd_s": mean[CB],
              "bwd_over_fwd": (mean[AB] + mean[CB]) / (mean[AF] + mean[CF]),
              "actor_fwd_per_stage_s": per_stage[AF], "actor_bwd_per_stage_s": per_stage[AB],
              "critic_fwd_per_stage_s": per_stage[CF], "critic_bwd_per_stage_s": per_stage[CB]},
          "pipeline_executor": {"tick_overhead_s": tick_s, "step_overhead_s": step_over_s},
      },
      "notes": (f"one micro-batch of {shard // cfg.actor_microbatches} (actor) / "
                f"{shard // (problem.critic_replicas * cfg.critic_microbatches)} (critic) rows "
                f"x {cfg.prompt_len + cfg.response_len} tokens per stage; actor "
                f"{cfg.actor.num_layers // cfg.actor_pp} layers/stage, critic "
                f"{cfg.critic.num_layers // cfg.critic_pp}; tasks timed over {k} ticks on a "
                f"{cfg.actor_pp}-device stage mesh, overheads from {k} and {3 * k} idle ticks on "
                f"the bench mesh {dict(mesh.shape)}; medians of {reps} back-to-back pairs "
                f"(task table, idle table) after {cfg.warmup} warm-up runs"),
  }
  if shared:
    # Fake devices are threads of one process: at most as many run at once as the cores this
    # process may use.
    out["parallel_tasks"] = cores
  cal_lib.from_dict(out, "measured")  # what is written must load
  return out, check


def run(cfg: BenchPipelineConfig, workdir: str) -> dict:
  problem = cfg.problem()
  mesh = make_mesh(MeshConfig(data=cfg.data, stage=cfg.actor_pp),
                   jax.devices()[:cfg.data * cfg.actor_pp])
  key_a, key_c = jax.random.split(jax.random.key(cfg.seed))
  params = (llama.init_params(cfg.actor, key_a)[0], llama.init_params(cfg.critic, key_c)[0])
  batch = make_batch(cfg)
  ref_fn = jax.jit(stages.reference_grads, static_argnums=(0, 1, 2))
  reference = jax.block_until_ready(ref_fn(cfg.actor, cfg.critic, cfg.loss, *params, batch))
  ref_runs = timed(lambda: ref_fn(cfg.actor, cfg.critic, cfg.loss, *params, batch), cfg.warmup,
                   cfg.repeats)
  logging.info("unpipelined jax.grad step (one device): %.4fs", np.median(ref_runs))

  # The executor runs in lockstep ticks, so its own objective is the tick count: the search on
  # unit durations minimises exactly that (list scheduling with unit tasks is the ASAP leveling
  # of program.py). `searched_time` optimises the cost model's list-scheduled time instead.
  unit = dataclasses.replace(problem, actor_fwd=1.0, critic_fwd=1.0, actor_bwd=1.0,
                             critic_bwd=1.0)
  search_cfg = search.SearchConfig(time_budget_s=cfg.search_time_s, seed=cfg.seed)
  found = {"ticks": search.search(unit, search_cfg), "time": search.search(problem, search_cfg)}
  orders = {"serial_1f1b": (schedules.serial_order(problem), True),
            "greedy": (schedules.greedy_order(problem), False),
            "searched": (found["ticks"].best, False),
            "searched_time": (found["time"].best, False)}
  results, steps, compiled = {}, {}, {}
  for name, (order, barrier) in orders.items():
    results[name], steps[name] = run_schedule(name, cfg, problem, order, barrier, mesh, params,
                                              batch, reference, compiled)
  for name, runs in time_in_rotation(steps, cfg.repeats).items():
    results[name].update(step_s=float(np.median(runs)), step_s_runs=runs)
    logging.info("%s: step %.4fs (median of %d)", name, results[name]["step_s"], cfg.repeats)
  paired = [f / s for f, s in zip(results["searched"]["step_s_runs"],
                                  results["serial_1f1b"]["step_s_runs"])]
  # The orders exactly as run: the simulator's validation rebuilds their ticks from these.
  wd.write_json(os.path.join(workdir, "schedules.json"), {
      "problem": problem.to_dict(), "data_replicas": cfg.data, "serial": "serial_1f1b",
      "fused": "searched",
      "schedules": {name: {"order": order.tolist(), "barrier": barrier,
                           "ticks": results[name]["ticks"]}
                    for name, (order, barrier) in orders.items()}})
  cal, tick_check = measure_calibration(
      cfg, problem, [prog.build_program(problem, o, barrier=b) for o, b in orders.values()],
      mesh, params, batch)
  runner.write_result(workdir, cal, "calibration.json")
  tol = 1e-5
  errors = [r["grad_error"][m]["max_leaf_rel"] for r in results.values()
            for m in ("actor", "critic")]
  result = {
      "machine": machine(),
      "problem": problem.to_dict(),
      "mesh": dict(mesh.shape),
      "minibatch_size": cfg.minibatch_size,
      "microbatch_rows": dict(zip(("actor", "critic"), PipelineExecutor(
          cfg.actor, cfg.critic, cfg.loss, prog.build_program(problem, orders["greedy"][0]),
          mesh).microbatch_sizes(cfg.minibatch_size))),
      "schedules": results,
      # The step times the simulator's validation compares its prediction with.
      "serial_step_s": results["serial_1f1b"]["step_s"],
      "fused_step_s": results["searched"]["step_s"],
      # Median over rounds of fused / serial of the same round (perf/timing.time_in_rotation).
      "paired_ratio_fused_over_serial": float(np.median(paired)),
      "unpipelined_step_s": float(np.median(ref_runs)),
      "search_s": {k: f.search_s for k, f in found.items()},
      # No lockstep execution of this problem has fewer ticks (docs/schedules.md's tight bound
      # in ticks).
      "ticks_lower_bound": bounds.tight_lower_bound(unit),
      "fused_ticks_lt_serial_ticks": bool(results["searched"]["ticks"] <
                                          results["serial_1f1b"]["ticks"]),
      # Measured costs for the simulator (also in calibration.json) and the lockstep model's
      # check on an all-busy table (measure_calibration).
      "calibration": cal["ops"],
      "tick_model_check": tick_check,
      "grad_error_tolerance": tol,
      "grad_errors_within_tolerance": bool(max(errors) <= tol),
  }
  runner.write_result(workdir, result)
  logging.info("ticks: %s; fused < serial: %s; wall time of a step, fused (the searched "
               "schedule) %.4fs / serial 1F1B %.4fs (medians of %d rounds): paired median %.3f, "
               "rounds %.3f-%.3f (%s); max grad error %.2e (tolerance %g); wrote %s",
               {k: r["ticks"] for k, r in results.items()}, result["fused_ticks_lt_serial_ticks"],
               result["fused_step_s"], result["serial_step_s"], len(paired),
               result["paired_ratio_fused_over_serial"], min(paired), max(paired),
               result["machine"]["description"], max(errors), tol,
               os.path.join(workdir, "result.json"))
  if min(paired) < 1.0 < max(paired):
    logging.warning("the rounds' fused / serial ratios lie on both sides of 1 (%.3f-%.3f): "
                    "this machine's timing noise is larger than the difference; more "
                    "--config.repeats, or a quieter machine, tell them apart", min(paired),
                    max(paired))
  return result


def check_run(cfg: BenchPipelineConfig) -> None:
  """What `run` needs of the config and the machine, checked before the earlier outputs move
  aside (a critic_pp, device count, mini-batch or layer count it refused moved a 135 s result to
  previous/<n> first, some 25 s in)."""
  cfg.problem()
  need, have = cfg.data * cfg.actor_pp, jax.device_count()
  if need > have:
    raise ValueError(f"config.data={cfg.data} x config.actor_pp={cfg.actor_pp} = {need} devices, "
                     f"but jax sees {have} (bench_pipeline runs one pipeline per data replica)")
  if cfg.minibatch_size % cfg.data:
    raise ValueError(f"config.minibatch_size={cfg.minibatch_size} must be divisible by "
                     f"config.data={cfg.data} (each replica takes an equal share)")
  # (the executor refused these only when the first schedule compiled: after the earlier
  # outputs moved aside, the reference step and both schedule searches, ~30 s in)
  rows = cfg.minibatch_size // cfg.data
  replicas = cfg.actor_pp // cfg.critic_pp
  for name, parts, what in (
      ("actor_microbatches", cfg.actor_microbatches, ""),
      ("critic_microbatches", replicas * cfg.critic_microbatches,
       f" x the critic's {replicas} replicas (config.actor_pp / config.critic_pp)")):
    if rows % parts:
      raise ValueError(f"config.{name}={getattr(cfg, name)}{what} must divide the "
                       f"{rows} rows of a data replica (config.minibatch_size="
                       f"{cfg.minibatch_size} / config.data={cfg.data})")
  stages.check_split(cfg.actor, cfg.actor_pp, "config.actor")
  stages.check_split(cfg.critic, cfg.critic_pp, "config.critic")


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  cfg = BenchPipelineConfig.from_config_dict(_CONFIG.value)
  check_run(cfg)
  wd.start_outputs(_WORKDIR.value, _CONFIG.value,
                   ("result.json", "schedules.json", "calibration.json"))
  run(cfg, _WORKDIR.value)


if __name__ == "__main__":
  config_files.run(main)
