"""Timing model of the lockstep pipeline executor: a schedule's ticks, and the tasks in each.

Idea: pipeline/executor.py runs a schedule as lockstep *ticks* (pipeline/program.py levels the
task graph with unit steps): at each tick every device of the `stage` axis runs at most one task,
then all devices exchange messages (two ppermutes). A tick therefore ends when its last task
ends, plus the executor's fixed cost per tick:

  dedicated devices:                 tick_s = longest task of the tick + tick_overhead_s
  one shared processor, C cores:     tick_s = max(longest task, sum of the tick's tasks / C)
                                              + tick_overhead_s

(the second is how C preemptively shared cores finish independent work: no task finishes before
its own length, and the cores cannot do more than C seconds of work per second). A stage axis
repeated over R data-parallel copies runs each of its tasks R times per tick, one per copy: the
longest task is unchanged, the sum is R times larger. A step is step_overhead_s plus its ticks.

No jax here: the same orders the executor ran are rebuilt from numbers (schedules.json) and
timed with measured stage costs (policy/calibration.py, op `train_stage` / `pipeline_executor`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from rlhfuse_jax.pipeline import program as prog
from rlhfuse_jax.pipeline.graph import AB, AF, CB, CF, PipelineProblem


@dataclasses.dataclass(frozen=True)
class StageTimes:
  """Seconds of one micro-batch's forward / backward on each stage of each model."""
  actor_fwd: tuple[float, ...]   # [Pa]
  actor_bwd: tuple[float, ...]   # [Pa]
  critic_fwd: tuple[float, ...]  # [Pc]
  critic_bwd: tuple[float, ...]  # [Pc]

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = tuple(float(x) for x in getattr(self, f.name))
      if not v or any(not np.isfinite(x) or x < 0 for x in v):
        raise ValueError(f"StageTimes.{f.name}={v} must be a non-empty tuple of non-negative "
                         "finite seconds")
      object.__setattr__(self, f.name, v)
    if len(self.actor_fwd) != len(self.actor_bwd) or len(self.critic_fwd) != len(
        self.critic_bwd):
      raise ValueError("StageTimes: forward and backward lists of one model must have one "
                       f"entry per stage (actor {len(self.actor_fwd)}/{len(self.actor_bwd)}, "
                       f"critic {len(self.critic_fwd)}/{len(self.critic_bwd)})")

  @classmethod
  def uniform(cls, problem: PipelineProblem) -> "StageTimes":
    """Every stage of a model costs the problem's per-kind durations."""
    pa, pc = problem.actor_pp, problem.critic_pp
    return cls((problem.actor_fwd,) * pa, (problem.actor_bwd,) * pa,
               (problem.critic_fwd,) * pc, (problem.critic_bwd,) * pc)

  def check(self, problem: PipelineProblem) -> None:
    if len(self.actor_fwd) != problem.actor_pp or len(self.critic_fwd) != problem.critic_pp:
      raise ValueError(f"StageTimes has {len(self.actor_fwd)} actor / {len(self.critic_fwd)} "
                       f"critic stages; the problem has actor_pp={problem.actor_pp}, "
                       f"critic_pp={problem.critic_pp}")


def task_seconds(problem: PipelineProblem, order: np.ndarray, times: StageTimes) -> np.ndarray:
  """float [N, T]: seconds of the task at each position of the order (its device's stage)."""
  times.check(problem)
  n, t = order.shape
  out = np.zeros((n, t))
  for d in range(n):
    per_kind = {AF: times.actor_fwd[d], AB: times.actor_bwd[d],
                CF: times.critic_fwd[problem.critic_stage(d)],
                CB: times.critic_bwd[problem.critic_stage(d)]}
    out[d] = [per_kind[int(k)] for k in order[d]]
  return out


def tick_tasks(problem: PipelineProblem, order: np.ndarray, times: StageTimes,
               barrier: bool = False) -> np.ndarray:
  """float [ticks, N]: seconds of the task each device runs at each tick (0: idle), with the
  executor's own leveling (program.level_ticks), so the ticks are the ones the bench ran."""
  order = np.asarray(order)
  tick = prog.level_ticks(problem, order, barrier)  # [N, T]
  secs = task_seconds(problem, order, times)  # [N, T]
  out = np.zeros((int(tick.max()) + 1, problem.num_devices))
  for d in range(problem.num_devices):
    out[tick[d], d] = secs[d]
  return out


def tick_seconds(tasks: np.ndarray, tick_overhead_s: float,
                 parallel_tasks: Optional[int] = None, data_replicas: int = 1) -> np.ndarray:
  """float [ticks]: duration of each tick (module docstring). `tasks` [ticks, N] from
  tick_tasks; parallel_tasks None means dedicated devices, else the cores of a shared processor
  that all N x data_replicas devices run on."""
  if parallel_tasks is not None and parallel_tasks < 1:
    raise ValueError(f"parallel_tasks={parallel_tasks} must be >= 1 (or None: dedicated)")
  if data_replicas < 1:
    raise ValueError(f"data_replicas={data_replicas} must be >= 1")
  if tick_overhead_s < 0:
    raise ValueError(f"tick_overhead_s={tick_overhead_s} must be >= 0")
  longest = tasks.max(axis=1)  # [ticks]
  if parallel_tasks is not None:
    longest = np.maximum(longest, data_replicas * tasks.sum(axis=1) / parallel_tasks)
  return longest + tick_overhead_s


def step_seconds(problem: PipelineProblem, order: np.ndarray, times: StageTimes, *,
                 barrier: bool = False, tick_overhead_s: float = 0.0,
                 step_overhead_s: float = 0.0, parallel_tasks: Optional[int] = None,
                 data_replicas: int = 1) -> dict:
  """Predicted executor step: {'step_s', 'ticks', 'task_s' (the ticks' task part, no
  overheads), 'overhead_s' (ticks x tick_overhead_s + step_overhead_s)}."""
  tasks = tick_tasks(problem, order, times, barrier)
  ticks = tick_seconds(tasks, tick_overhead_s, parallel_tasks, data_replicas)
  overhead = len(ticks) * tick_overhead_s + step_overhead_s
  return {"step_s": float(ticks.sum()) + step_overhead_s, "ticks": int(len(ticks)),
          "task_s": float(ticks.sum()) - len(ticks) * tick_overhead_s,
          "overhead_s": overhead}
