"""Lower bounds on the makespan of any fused schedule (docs/architecture.md §3), and the serial
baseline.

Work per device W = Ma*(fa+ba) + Mc*(fc+bc) (every device hosts one actor and one critic stage).

Simple bound: max(W, (Pa+Ma-1)(fa+ba), (Pc+Mc-1)(fc+bc)) -- a device must do its work, and
neither model can beat its own 1F1B pipeline: the device of a model's last stage cannot start
before (P-1)f, must do M(f+b) of that model's work, and leaves a backward chain of (P-1)b.

Tight bound: on device d (actor stage a = d, critic stage c = Pc-1-(d mod Pc)) no task can run
before min(a*fa, c*fc) (the forward chains from stage 0), and the device must stay busy until at
least min(a*ba, c*bc) before the end (the backward chains still to run on other devices):
LB = max((Pa+Ma-1)(fa+ba), (Pc+Mc-1)(fc+bc), max_d [W + min(a*fa, c*fc) + min(a*ba, c*bc)]).
Transfer latency only delays tasks, so both bounds hold with any latency (they ignore it).
"""
from __future__ import annotations

import numpy as np

from rlhfuse_jax.pipeline.graph import PipelineProblem


def pipeline_1f1b_makespan(num_stages: int, microbatches: int, fwd: float, bwd: float) -> float:
  """(P+M-1)(f+b): the 1F1B makespan of one pipeline without transfer latency."""
  return (num_stages + microbatches - 1) * (fwd + bwd)


def model_bounds(problem: PipelineProblem) -> tuple[float, float]:
  p = problem
  return (pipeline_1f1b_makespan(p.actor_pp, p.actor_microbatches, p.actor_fwd, p.actor_bwd),
          pipeline_1f1b_makespan(p.critic_pp, p.critic_microbatches, p.critic_fwd, p.critic_bwd))


def simple_lower_bound(problem: PipelineProblem) -> float:
  return max(problem.work_per_device(), *model_bounds(problem))


def device_heads(problem: PipelineProblem) -> np.ndarray:
  """f8 [N]: min(a*fa, c*fc), the earliest time any task can start on each device."""
  p = problem
  return np.array([min(p.actor_stage(d) * p.actor_fwd, p.critic_stage(d) * p.critic_fwd)
                   for d in range(p.num_devices)], dtype=np.float64)


def device_tails(problem: PipelineProblem) -> np.ndarray:
  """f8 [N]: min(a*ba, c*bc), the least time from each device's last task's end to the end of
  any schedule (the backward chain still to run on other devices)."""
  p = problem
  return np.array([min(p.actor_stage(d) * p.actor_bwd, p.critic_stage(d) * p.critic_bwd)
                   for d in range(p.num_devices)], dtype=np.float64)


def device_lower_bounds(problem: PipelineProblem) -> list[float]:
  """W + earliest possible start + unavoidable tail, per device: [N]."""
  w = problem.work_per_device()
  return [float(w + h + t) for h, t in zip(device_heads(problem), device_tails(problem))]


def tight_lower_bound(problem: PipelineProblem) -> float:
  return max(*model_bounds(problem), max(device_lower_bounds(problem)))


def serial_makespan_formula(problem: PipelineProblem) -> float:
  """T_serial = (Pa+Ma-1)(fa+ba) + (Pc+Mc-1)(fc+bc) (no transfer latency)."""
  return sum(model_bounds(problem))
