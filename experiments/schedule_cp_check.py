"""Exhaustive check with a CP-SAT model: is there a schedule of makespan <= target within budget?

Answers the question the heuristic search cannot: whether the tight lower bound is reachable at
all while every device's peak memory stays within its budget. The model has one start variable
per task, the dependencies of graph.py, micro-batches of one kind in increasing order on each
device (the canonical order every schedule of this package uses), one no-overlap constraint per
device, and a reservoir constraint per device (+mem at a forward's start, -mem at its backward's
end, level within [0, budget]). INFEASIBLE is a proof (for that canonical order); OPTIMAL/FEASIBLE
comes with a schedule that evaluate.py re-checks. Integer durations and memory only.

Needs `pip install ortools` (an optional analysis dependency; not needed by the library).
  python -m experiments.schedule_cp_check --config=configs/schedule_search.py \
      --config.actor_pp=8 --config.critic_pp=4 --config.actor_microbatches=16 \
      --config.critic_microbatches=8 --workdir=/tmp/cp_e1 --time_limit_s=120
"""
from __future__ import annotations

import os
import time

from absl import app, flags, logging
from ml_collections import config_flags
import numpy as np

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.pipeline import bounds
from rlhfuse_jax.pipeline.evaluate import evaluate
from rlhfuse_jax.pipeline.graph import PipelineProblem

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory", required=True)
_TARGET = flags.DEFINE_float("target", -1.0, "makespan to check; -1: the tight lower bound")
_TIME = flags.DEFINE_float("time_limit_s", 120.0, "CP-SAT time limit")
_WORKERS = flags.DEFINE_integer("workers", 2, "CP-SAT search workers")


def check(problem: PipelineProblem, target: int, time_limit_s: float, workers: int):
  """Returns (status name, order int8 [N, T] or None, seconds)."""
  try:
    from ortools.sat.python import cp_model
  except ImportError as e:
    raise ImportError("schedule_cp_check needs ortools: pip install ortools") from e
  p = problem
  vals = list(p.durations()) + list(p.mem_deltas()) + list(p.budget())
  if any(abs(v - round(v)) > 1e-9 for v in vals):
    raise ValueError("durations, memory and budget must be integers for the CP model")
  dur = [int(round(x)) for x in p.durations()]
  dmem = [int(round(x)) for x in p.mem_deltas()]
  budget = [int(round(b)) for b in p.budget()]
  counts = p.kind_counts()
  n, pc = p.num_devices, p.critic_pp
  m = cp_model.CpModel()
  s = {(k, d, j): m.NewIntVar(0, target - dur[k], f"s{k}_{d}_{j}")
       for d in range(n) for k in range(4) for j in range(counts[k])}
  for d in range(n):
    c = p.critic_stage(d)
    for k in range(4):
      for j in range(counts[k]):
        x = s[k, d, j]
        if j > 0:
          m.Add(x >= s[k, d, j - 1] + dur[k])
        if k == 0 and d > 0:
          m.Add(x >= s[0, d - 1, j] + dur[0])
        if k == 1:
          m.Add(x >= (s[1, d + 1, j] + dur[1] if d < n - 1 else s[0, d, j] + dur[0]))
        if k == 2 and c > 0:
          m.Add(x >= s[2, d + 1, j] + dur[2])
        if k == 3:
          m.Add(x >= (s[3, d - 1, j] + dur[3] if c < pc - 1 else s[2, d, j] + dur[2]))
    keys = [(k, j) for k in range(4) for j in range(counts[k])]
    m.AddNoOverlap([m.NewFixedSizeIntervalVar(s[k, d, j], dur[k], "") for k, j in keys])
    m.AddReservoirConstraint([s[k, d, j] + (dur[k] if k % 2 else 0) for k, j in keys],
                             [dmem[k] for k, _ in keys], 0, budget[d])
  solver = cp_model.CpSolver()
  solver.parameters.max_time_in_seconds = time_limit_s
  solver.parameters.num_workers = workers
  t0 = time.time()
  status = solver.Solve(m)
  order = None
  if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
    order = np.array([[k for _, k in sorted((solver.Value(s[k, d, j]), k) for k in range(4)
                                            for j in range(counts[k]))] for d in range(n)],
                     dtype=np.int8)
  return solver.StatusName(status), order, time.time() - t0


def main(argv):
  del argv
  problem = PipelineProblem.from_config(_CONFIG.value)
  lb = bounds.tight_lower_bound(problem)
  target = int(round(lb if _TARGET.value < 0 else _TARGET.value))
  wd.write_config(_WORKDIR.value, _CONFIG.value)
  status, order, secs = check(problem, target, _TIME.value, _WORKERS.value)
  result = {"target": target, "lower_bound": lb, "status": status, "solve_s": secs}
  if order is not None:
    ev = evaluate(problem, order)
    result.update(makespan=ev.makespan, within_budget=ev.within_budget,
                  peak_memory=ev.peaks.tolist(), budget=ev.budget.tolist())
  logging.info("target %d (LB %g): %s in %.1fs", target, lb, status, secs)
  wd.write_json(os.path.join(_WORKDIR.value, "result.json"), result)


if __name__ == "__main__":
  app.run(main)
