r"""Benchmark of the fused actor/critic pipeline executor (DESIGN §3, intra-stage fusion).

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
"""
from __future__ import annotations

import os

# Must precede the first jax import. The flag only adds host (CPU) devices, so it is harmless
# where an accelerator is the default backend; it is left alone when the caller set it.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import dataclasses  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from rlhfuse_jax import workdir as wd  # noqa: E402
from rlhfuse_jax.models import llama  # noqa: E402
from rlhfuse_jax.parallel.mesh import MeshConfig, make_mesh  # noqa: E402
from rlhfuse_jax.pipeline import program as prog  # noqa: E402
from rlhfuse_jax.pipeline import bounds, schedules, search, stages  # noqa: E402
from rlhfuse_jax.pipeline.evaluate import evaluate  # noqa: E402
from rlhfuse_jax.pipeline.executor import PipelineExecutor  # noqa: E402
from rlhfuse_jax.pipeline.graph import PipelineProblem  # noqa: E402

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
  loss: stages.LossConfig

  def __post_init__(self):
    for name in ("actor_pp", "critic_pp", "data", "actor_microbatches", "critic_microbatches",
                 "minibatch_size", "prompt_len", "response_len", "repeats"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.warmup < 0:
      raise ValueError(f"warmup={self.warmup} must be >= 0")
    if not self.bwd_ratio > 0 or not self.search_time_s > 0:
      raise ValueError("bwd_ratio and search_time_s must be > 0")

  @classmethod
  def from_config_dict(cls, c: Any) -> "BenchPipelineConfig":
    seq = int(c.prompt_len) + int(c.response_len)
    def model(section, head):
      return llama.ModelConfig(**{f: int(section[f]) for f in _MODEL_FIELDS}, head=head,
                               max_seq_len=seq)
    return cls(seed=int(c.seed), actor_pp=int(c.actor_pp), critic_pp=int(c.critic_pp),
               data=int(c.data), actor_microbatches=int(c.actor_microbatches),
               critic_microbatches=int(c.critic_microbatches),
               minibatch_size=int(c.minibatch_size), prompt_len=int(c.prompt_len),
               response_len=int(c.response_len), actor=model(c.actor, "lm"),
               critic=model(c.critic, "scalar"), actor_fwd=float(c.actor_fwd),
               critic_fwd=float(c.critic_fwd), bwd_ratio=float(c.bwd_ratio),
               search_time_s=float(c.search_time_s), warmup=int(c.warmup),
               repeats=int(c.repeats),
               loss=stages.LossConfig(clip_eps=float(c.clip_eps),
                                      value_clip_eps=float(c.value_clip_eps),
                                      vf_coef=float(c.vf_coef),
                                      entropy_coef=float(c.entropy_coef)))

  def problem(self) -> PipelineProblem:
    return PipelineProblem(self.actor_pp, self.critic_pp, self.actor_microbatches,
                           self.critic_microbatches, self.actor_fwd, self.critic_fwd,
                           actor_bwd=self.bwd_ratio * self.actor_fwd,
                           critic_bwd=self.bwd_ratio * self.critic_fwd)


def machine() -> dict:
  """What ran the benchmark, in words and figures."""
  devs = jax.devices()
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    cpu = names[0] if names else cpu
  except OSError:
    pass
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


def timed(fn: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
  for _ in range(warmup):
    jax.block_until_ready(fn())
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - t0)
  return out


def run_schedule(name: str, cfg: BenchPipelineConfig, problem: PipelineProblem,
                 order: np.ndarray, barrier: bool, mesh, params, batch, reference) -> dict:
  program = prog.build_program(problem, order, barrier=barrier)
  ex = PipelineExecutor(cfg.actor, cfg.critic, cfg.loss, program, mesh)
  t0 = time.perf_counter()
  step = ex.compile(params[0], params[1], batch)
  compile_s = time.perf_counter() - t0
  ga, gc, metrics = jax.block_until_ready(step(params[0], params[1], batch))
  runs = timed(lambda: step(params[0], params[1], batch), cfg.warmup, cfg.repeats)
  release = schedules.serial_release(problem) if barrier else (0.0, 0.0)
  ev = evaluate(problem, order, release)
  out = {
      **program.summary(),
      "bubble_ticks": 1.0 - problem.tasks_per_device / program.ticks,
      "list_schedule_makespan": ev.makespan,
      "peak_memory": ev.peaks.tolist(),
      "memory_budget": ev.budget.tolist(),
      "compile_s": compile_s,
      "step_s": float(np.median(runs)),
      "step_s_runs": runs,
      "grad_error": {"actor": grad_error(ga, reference[0]),
                     "critic": grad_error(gc, reference[1])},
      "metrics": {k: float(v) for k, v in metrics.items()},
      "metrics_reference": {k: float(reference[2][k]) for k in metrics},
  }
  logging.info("%s: %d ticks (lockstep time %g), compile %.1fs, step %.4fs; grad error actor "
               "%.2e critic %.2e", name, program.ticks, out["lockstep_time"], compile_s,
               out["step_s"], out["grad_error"]["actor"]["max_leaf_rel"],
               out["grad_error"]["critic"]["max_leaf_rel"])
  return out


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
  results = {name: run_schedule(name, cfg, problem, order, barrier, mesh, params, batch, reference)
             for name, (order, barrier) in orders.items()}
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
      "unpipelined_step_s": float(np.median(ref_runs)),
      "search_s": {k: f.search_s for k, f in found.items()},
      # No lockstep execution of this problem has fewer ticks (DESIGN §3's tight bound in ticks).
      "ticks_lower_bound": bounds.tight_lower_bound(unit),
      "fused_ticks_lt_serial_ticks": bool(results["searched"]["ticks"] <
                                          results["serial_1f1b"]["ticks"]),
      "grad_error_tolerance": tol,
      "grad_errors_within_tolerance": bool(max(errors) <= tol),
  }
  wd.write_json(os.path.join(workdir, "result.json"), result)
  logging.info("ticks: %s; fused < serial: %s; max grad error %.2e (tolerance %g)",
               {k: r["ticks"] for k, r in results.items()}, result["fused_ticks_lt_serial_ticks"],
               max(errors), tol)
  return result


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  cfg = BenchPipelineConfig.from_config_dict(_CONFIG.value)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  wd.write_config(_WORKDIR.value, _CONFIG.value)
  run(cfg, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
