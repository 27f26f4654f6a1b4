r"""Exact CP-SAT model of the fused schedule within budget: a target's feasibility, or minimisation.

Check mode: is there a schedule of makespan <= target within budget?

Answers the question the heuristic search cannot: whether the tight lower bound is reachable at
all while every device's peak memory stays within its budget. The model has one start variable
per task, the dependencies of graph.py, micro-batches of one kind in increasing order on each
device (the canonical order every schedule of this package uses), one no-overlap constraint per
device, and the budget per device as a reservoir (+mem at a forward's start, -mem at its
backward's end, level within [0, budget]) or, equivalently, a cumulative of one interval per
micro-batch (--memory). INFEASIBLE is a proof (for that canonical order); OPTIMAL/FEASIBLE
comes with a schedule that evaluate.py re-checks. Integer durations and memory only.

Every start is confined to its window of pipeline/windows.py (edge-finding heads and tails,
round-trip lags): redundant constraints that let CP-SAT prove infeasibility in minutes
(--nowindows drops them). --devices=a,b,..: the same model on a subset of the devices, the rest
summarised by those windows: a relaxation, so INFEASIBLE there is a proof for the instance, and
far smaller on 16-device instances.

Minimise mode (--minimize): minimises the makespan, hinted with (and bounded above by) the best
schedule the heuristic search finds in --hint_search_s seconds, or by a kept schedule
(--hint_schedule=DIR/schedule.json, to go on from an earlier run), bounded below by the tight bound;
reports the best makespan found and CP-SAT's proven lower bound (equal: a proven optimum).
A schedule found is written as schedule.json and gantt.png (its title in gantt.json, which
pipeline/gantt.py's redraw reads), as schedule_search does;
schedule.json is rewritten (atomically) at each improvement, so stopping a long run early keeps
its best schedule. --log_search prints CP-SAT's own progress log (bounds, subsolvers).

Splice mode (--hint_schedule=S --splice=T1,T2,D): a local repair of schedule S that CP-SAT's own
neighbourhood search cannot express: S's tasks starting before T1 keep their starts, those at or
after T2 move D earlier, and the band between is re-solved at S's makespan - D. A restriction:
a schedule found is valid; INFEASIBLE says only that no repair of this band exists.

Grow mode (--hint_schedule=S --grow=T1,T2,SLOPE): S is a schedule of the same instance with
fewer micro-batches (e7's at its bound for e6); pipeline/exact/grow.py inserts the extra actor
micro-batches as 1F1B pairs where that adds only their work (else they join the band), then the
extra critic micro-batches go into the band [T1 + SLOPE*d, T2 + SLOPE*d) of that schedule on
device d, the rest pinned (after the band: moved later by the extra work), at the grown
makespan. A restriction: a schedule found is valid; INFEASIBLE says only that this growth does
not exist.

Needs ortools (an optional analysis dependency, not needed by the library): `pip install -e
".[exact]"`; where its protobuf pin conflicts with the environment's, `pip install --target DIR
ortools` and put DIR on PYTHONPATH for this binary only.
  python -m experiments.schedule_cp_check --config=configs/schedule_search.py \
      --config.memory_budget_mode=per_device \
      --config.actor_pp=8 --config.critic_pp=4 --config.actor_microbatches=16 \
      --config.critic_microbatches=8 --workdir=/tmp/cp_e1 --time_limit_s=120
  python -m experiments.schedule_cp_check --config=configs/schedule_search.py --minimize \
      --config.memory_budget_mode=per_device \
      --hint_search_s=20 --workdir=/tmp/cp_e0_min --time_limit_s=600
  python -m experiments.schedule_cp_check --config=configs/schedule_search.py \
      --config.memory_budget_mode=per_device \
      --config.actor_pp=16 --config.critic_pp=8 --config.actor_microbatches=64 \
      --config.critic_microbatches=32 --config.actor_fwd=2 --config.critic_fwd=2 \
      --hint_schedule=experiments/results/e7_cp_schedule/schedule.json --grow=120,200,0 \
      --workdir=/tmp/cp_e6_grow --time_limit_s=1200

Docs: docs/schedules.md ("How the proofs work").
"""
from __future__ import annotations

import importlib.util
import math
import os
import time
from typing import Callable, Optional, Sequence

from absl import flags, logging
from ml_collections import config_flags
import numpy as np

from experiments import config_files
from experiments import runner
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.pipeline import bounds, gantt, schedule, search, windows
from rlhfuse_jax.pipeline.exact import grow
from rlhfuse_jax.pipeline.evaluate import evaluate
from rlhfuse_jax.pipeline.graph import PipelineProblem, parse_devices

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory", required=True)
flags.mark_flags_as_required(["config"])  # without it: an AttributeError on None in main
_TARGET = flags.DEFINE_float("target", -1.0, "makespan to check; -1: the tight lower bound")
_TIME = flags.DEFINE_float("time_limit_s", 120.0, "CP-SAT time limit")
_WORKERS = flags.DEFINE_integer("workers", 2, "CP-SAT search workers")
_MINIMIZE = flags.DEFINE_bool("minimize", False, "minimise the makespan instead of checking")
_MEMORY = flags.DEFINE_enum("memory", "reservoir", ["reservoir", "cumulative", "both"],
                            "CP model of the memory budget")
_HINT_S = flags.DEFINE_float("hint_search_s", 20.0, "heuristic search seconds for the hint")
_HINT_SCHEDULE = flags.DEFINE_string("hint_schedule", None, "schedule.json to hint with instead "
                                     "of a search (e.g. a kept CP-SAT schedule, to go on "
                                     "minimising from it); its problem must equal the config's")
_WINDOWS = flags.DEFINE_bool("windows", True, "add the task windows and lags of "
                             "pipeline/windows.py (redundant constraints that speed up proofs)")
_MEM_LAGS = flags.DEFINE_bool("memory_lags", True, "add the precedences the memory budget "
                               "implies: F(d, j+K) starts after B(d, j) ends, K = budget // mem")
_SPLICE = flags.DEFINE_list("splice", [], "T1,T2,S with --hint_schedule: keep the hint's tasks "
                            "starting before T1, move those starting at or after T2 S earlier, "
                            "re-solve the band between at the hint's makespan - S (a "
                            "restriction: INFEASIBLE says only that this repair does not exist)")
_GROW = flags.DEFINE_list("grow", [], "T1,T2,SLOPE with --hint_schedule of the same instance "
                          "with fewer micro-batches: grow it into the config's instance "
                          "(pipeline/exact/grow.py). The extra actor micro-batches go in as "
                          "1F1B pairs at the first cut that adds only their work (if none "
                          "does, into the band); the extra critic ones go into the band "
                          "[T1 + SLOPE*d, T2 + SLOPE*d) of that schedule (device d), re-solved "
                          "with the rest pinned, after the band moved later by the extra work; "
                          "target: the grown makespan (a restriction, like --splice)")
_DEVICES = flags.DEFINE_list("devices", [], "relaxation on these devices only (e.g. 8,9,10): "
                             "INFEASIBLE proves the whole instance infeasible; empty: all")
_LOG_SEARCH = flags.DEFINE_bool("log_search", False, "print CP-SAT's own search log (presolve, "
                                "subsolvers, each improving solution and bound)")


def check(problem: PipelineProblem, target: int, time_limit_s: float, workers: int,
          minimize: bool = False, hint: Optional[np.ndarray] = None,
          memory: str = "reservoir", use_windows: bool = True,
          devices: Optional[Sequence[int]] = None, memory_lags: bool = True,
          on_solution: Optional[Callable[[np.ndarray, float], None]] = None,
          log_search: bool = False, fixed: Optional[dict] = None):
  """Returns (status name, order int8 [N, T] or None, seconds, proven lower bound).

  target: the makespan to reach (check) or the horizon (minimize). hint: an order [N, T] whose
  list-scheduled start times seed the solver. memory: how the budget is modelled, 'reservoir',
  'cumulative' or 'both' (same constraint, different propagation and presolve cost).
  use_windows: confine every start to [head, target - tail] and add the round-trip lags of
  pipeline/windows.py (redundant constraints: they cut no valid schedule, and let CP-SAT prove
  infeasibility sooner; e8 at its bound is proved unreachable in about a minute with them).
  devices: a relaxation on these devices only: their tasks, the dependencies among them, and the
  windows and lags standing in for everything else. INFEASIBLE on a subset proves the whole
  problem infeasible (every constraint kept is implied by the full model); a schedule of the
  subset proves nothing, so no order is returned.
  memory_lags: for each model on each device, at most K = budget // (its activation memory)
  micro-batches can be in flight even when the other model holds none; with micro-batches in
  canonical order that is the precedence F(j + K) starts no earlier than B(j) ends (else j..j+K
  would all hold memory at once). Redundant with the memory constraint, but propagated directly.
  on_solution(order, seconds): called with each schedule the solver finds on the full problem
  (in minimize mode, each improvement), so a long run that is killed keeps its best schedule.
  log_search: CP-SAT's own progress log on stdout.
  fixed: {(kind, device, microbatch): start} pins those tasks (a restriction: a schedule found
  is valid, INFEASIBLE then proves nothing about the instance).
  """
  if memory not in ("reservoir", "cumulative", "both"):
    raise ValueError(f"memory={memory!r}; expected 'reservoir', 'cumulative' or 'both'")
  try:
    from ortools.sat.python import cp_model
  except ImportError as e:
    raise ImportError(f"schedule_cp_check needs ortools: {INSTALL}") from e
  p = problem
  vals = list(p.durations()) + list(p.mem_deltas()) + list(p.budget())
  if any(abs(v - round(v)) > 1e-9 for v in vals):
    raise ValueError("durations, memory and budget must be integers for the CP model")
  dur = [int(round(x)) for x in p.durations()]
  dmem = [int(round(x)) for x in p.mem_deltas()]
  budget = [int(round(b)) for b in p.budget()]
  counts = p.kind_counts()
  n, pc = p.num_devices, p.critic_pp
  devs = sorted(set(range(n) if devices is None else devices))
  if not devs or devs[0] < 0 or devs[-1] >= n:
    raise ValueError(f"devices={devices} must be a non-empty subset of 0..{n - 1}")
  full = len(devs) == n
  m = cp_model.CpModel()
  if use_windows:
    win = windows.task_windows(p, memory_lags=memory_lags)
    lo = {(k, d, j): int(math.ceil(win.heads[k][d, j] - 1e-9)) for d in devs
          for k in range(4) for j in range(counts[k])}
    hi = {key: int(math.floor(target - win.tails[key[0]][key[1], key[2]] + 1e-9))
          for key in lo}
    if any(hi[key] < lo[key] for key in lo):
      # Some task cannot fit at all: the target is below a bound on the makespan.
      return "INFEASIBLE", None, 0.0, float("nan")
    lag = [[int(math.ceil(x - 1e-9)) for x in row] for row in win.lags]
  else:
    lo = {(k, d, j): 0 for d in devs for k in range(4) for j in range(counts[k])}
    hi = {key: target - dur[key[0]] for key in lo}
  s = {key: m.NewIntVar(lo[key], hi[key], "s{}_{}_{}".format(*key)) for key in lo}
  fixed = {key: int(round(start)) for key, start in (fixed or {}).items() if key in s}
  outside = [key for key, start in fixed.items() if not lo[key] <= start <= hi[key]]
  if outside:  # pinned tasks whose windows exclude their pinned starts: no solver needed
    logging.info("%d pinned tasks lie outside their windows at target %d, e.g. (kind, device, "
                 "microbatch) %s", len(outside), target, sorted(outside, key=fixed.get)[:5])
    return "INFEASIBLE", None, 0.0, float("nan")
  for key, start in fixed.items():
    m.Add(s[key] == start)
  def dep(kind, dev, j, extra):  # a dependency on a task that may lie outside the subset
    if (kind, dev, j) in s:
      m.Add(x >= s[kind, dev, j] + extra)

  for d in devs:
    c = p.critic_stage(d)
    for k in range(4):
      for j in range(counts[k]):
        x = s[k, d, j]
        if j > 0:
          m.Add(x >= s[k, d, j - 1] + dur[k])
        if k == 0 and d > 0:
          dep(0, d - 1, j, dur[0])
        if k == 1:
          dep(*((1, d + 1, j, dur[1]) if d < n - 1 else (0, d, j, dur[0])))
        if k == 2 and c > 0:
          dep(2, d + 1, j, dur[2])
        if k == 3:
          dep(*((3, d - 1, j, dur[3]) if c < pc - 1 else (2, d, j, dur[2])))
        if use_windows and k % 2:  # round trip through the other devices
          m.Add(x >= s[k - 1, d, j] + dur[k - 1] + lag[d][k // 2])
        if memory_lags and k % 2 == 0 and dmem[k] > 0:
          cap = budget[d] // dmem[k]  # micro-batches of this model in flight at most
          if j >= cap:
            m.Add(x >= s[k + 1, d, j - cap] + dur[k + 1])
    keys = [(k, j) for k in range(4) for j in range(counts[k])]
    m.AddNoOverlap([m.NewFixedSizeIntervalVar(s[k, d, j], dur[k], "") for k, j in keys])
    if memory in ("reservoir", "both"):
      # +mem at a forward's start, -mem at its backward's end: propagates well (it proved the
      # e8 optimum in minutes) but presolves slowly, quadratically in the tasks per device.
      m.AddReservoirConstraint([s[k, d, j] + (dur[k] if k % 2 else 0) for k, j in keys],
                               [dmem[k] for k, _ in keys], 0, budget[d])
    if memory in ("cumulative", "both"):
      # The same constraint as one interval per micro-batch (forward start to backward end)
      # under a cumulative: presolves in seconds on the largest instances.
      holds, demands = [], []
      for fk, bk in ((0, 1), (2, 3)):
        for j in range(counts[fk]):
          size = m.NewIntVar(dur[fk] + dur[bk], target, "")
          holds.append(m.NewIntervalVar(s[fk, d, j], size, s[bk, d, j] + dur[bk], ""))
          demands.append(dmem[fk])
      m.AddCumulative(holds, demands, budget[d])
  if minimize:
    mk = m.NewIntVar(int(math.ceil(bounds.tight_lower_bound(p) - 1e-9)) if full else 0, target,
                     "makespan")
    for d in devs:
      for k in range(4):
        m.Add(mk >= s[k, d, counts[k] - 1] + dur[k])
        if use_windows:
          for j in range(counts[k]):
            m.Add(mk >= s[k, d, j] + int(math.ceil(win.tails[k][d, j] - 1e-9)))
    m.Minimize(mk)
  if hint is not None:
    ev = evaluate(p, hint)
    for d in devs:
      seen = [0] * 4
      for q, k in enumerate(hint[d].tolist()):
        m.AddHint(s[k, d, seen[k]], int(round(ev.starts[d, q])))
        seen[k] += 1
    if minimize:
      m.AddHint(mk, int(round(ev.makespan)))
  def order_of(value):  # each device's kinds sorted by start time
    return np.array([[k for _, k in sorted((value(s[k, d, j]), k) for k in range(4)
                                           for j in range(counts[k]))] for d in range(n)],
                    dtype=np.int8)

  class Progress(cp_model.CpSolverSolutionCallback):
    def on_solution_callback(self):
      on_solution(order_of(self.Value), time.time() - t0)

  solver = cp_model.CpSolver()
  solver.parameters.max_time_in_seconds = time_limit_s
  solver.parameters.num_workers = workers
  solver.parameters.log_search_progress = log_search
  t0 = time.time()
  status = solver.Solve(m, Progress() if on_solution is not None and full else None)
  order = None
  if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) and full:
    order = order_of(solver.Value)
  bound = solver.BestObjectiveBound() if minimize else float("nan")
  return solver.StatusName(status), order, time.time() - t0, bound


def _numbers(flag: str, values: Sequence[str], form: str) -> tuple[float, ...]:
  """The numbers of a list flag of the form `form` (e.g. "T1,T2,S"); else a ValueError."""
  try:
    out = tuple(float(x) for x in values)
  except ValueError:
    out = ()
  if len(out) != len(form.split(",")):
    raise ValueError(f"{flag}={','.join(values)}: expected {len(form.split(','))} numbers {form}")
  return out


INSTALL = 'pip install -e ".[exact]" (ortools; the module docstring has a --target install)'


# What each CP-SAT status means for this binary: a check asks "is `target` reachable?", a
# minimisation "how short, and is that proven?".
VERDICT = {
    ("OPTIMAL", False): "reachable: a schedule of the target makespan exists (kept)",
    ("FEASIBLE", False): "reachable: a schedule of the target makespan exists (kept)",
    ("INFEASIBLE", False): "unreachable: a proof that no schedule reaches the target",
    ("OPTIMAL", True): "minimised: the makespan found is proven optimal",
    ("FEASIBLE", True): "a schedule found, its optimality not proven within the time limit",
    ("INFEASIBLE", True): "no schedule within the horizon (the target)",
}


def verdict(status: str, minimize: bool, subset: bool = False, pinned: bool = False) -> str:
  """`status` of CP-SAT in words (an UNKNOWN: no answer within the time limit). On a device
  subset (a relaxation) only an INFEASIBLE says something about the instance; with pinned
  tasks (--splice, --grow: a restriction) only a schedule found does. An INFEASIBLE holds for
  the model's canonical order of each model's tasks (module docstring)."""
  if status == "UNKNOWN":
    return "no answer within --time_limit_s (raise it, or hint with --hint_schedule)"
  if subset and status in ("OPTIMAL", "FEASIBLE"):
    return "feasible on the device subset (a relaxation: this proves nothing; no schedule kept)"
  if pinned and status == "INFEASIBLE":
    return "no schedule with these pinned tasks (a restriction: proves nothing about the instance)"
  out = VERDICT.get((status, minimize), status)
  return out + " (in the canonical task order)" if status == "INFEASIBLE" else out


def main(argv):
  del argv
  problem = PipelineProblem.from_config(_CONFIG.value)
  if problem.transfer_latency:
    # The model's dependencies carry no transfer latency: an INFEASIBLE would still prove a
    # bound (the model is a relaxation), but an OPTIMAL schedule could be faster than any real one.
    raise ValueError(f"config.transfer_latency={problem.transfer_latency}: expected 0 (the "
                     "CP-SAT model has no transfer latency between devices)")
  lb = bounds.tight_lower_bound(problem)
  # The flag's own check, before any search or solver.
  config_files.check_makespan_target(_TARGET.value, lb)
  # (a hint search of 0 s was refused as "time_budget_s=0.0", after the kernels compiled; a
  # time limit of 0 or less ran CP-SAT for nothing and reported UNKNOWN)
  for flag, value in (("--time_limit_s", _TIME.value), ("--hint_search_s", _HINT_S.value)):
    if not 0 < value < math.inf:
      raise ValueError(f"{flag}={value:g}: expected a finite number of seconds > 0")
  devices = parse_devices(_DEVICES.value, problem.num_devices)
  hint, result = None, {}
  fixed, default_target = None, lb
  if (_SPLICE.value or _GROW.value) and not _HINT_SCHEDULE.value:
    flag = "--grow" if _GROW.value else "--splice"
    raise ValueError(f"{flag} needs --hint_schedule (the schedule to {flag[2:]})")
  if _SPLICE.value and _GROW.value:
    raise ValueError("--splice and --grow exclude each other")
  # After the flags' own checks (they need no solver: --grow's and --splice's numbers and
  # pins too), before the hint search: without the solver, 20 s of searching for a hint would
  # end in an ImportError.
  def need_ortools():
    if importlib.util.find_spec("ortools") is None:
      raise ValueError(f"schedule_cp_check needs ortools: {INSTALL}")
  if _GROW.value:
    t1, t2, slope = _numbers("--grow", _GROW.value, "T1,T2,SLOPE")
    fixed, grown = grow.grow_pins(schedule.load(_HINT_SCHEDULE.value), problem, t1, t2, slope)
    default_target = grown["target"]
    logging.info("grow: %s; %d tasks pinned", grown, len(fixed))
    result.update(hint_schedule=_HINT_SCHEDULE.value, grow=grown, pinned_tasks=len(fixed),
                  free_tasks=problem.num_devices * problem.tasks_per_device - len(fixed))
  elif _HINT_SCHEDULE.value:
    kept = schedule.load(_HINT_SCHEDULE.value, problem)
    hint = kept.order()
    result["hint_schedule"] = _HINT_SCHEDULE.value
    if _SPLICE.value:
      t1, t2, shift = _numbers("--splice", _SPLICE.value, "T1,T2,S")
      fixed = schedule.splice_pins(kept, t1, t2, shift)
      result.update(splice={"t1": t1, "t2": t2, "shift": shift},
                    pinned_tasks=len(fixed), free_tasks=hint.size - len(fixed))
      logging.info("splice: %d tasks pinned, %d free in the band", len(fixed),
                   hint.size - len(fixed))
  elif _MINIMIZE.value:
    need_ortools()
    search.warmup()
    res = search.search(problem, search.SearchConfig(time_budget_s=_HINT_S.value,
                                                     seed=int(_CONFIG.value.seed)))
    hint = res.best
  need_ortools()
  if hint is not None:
    ev = evaluate(problem, hint)
    if _MINIMIZE.value and not ev.within_budget:
      raise ValueError(f"hint schedule exceeds the memory budget (peaks {ev.peaks.tolist()}, "
                       f"budget {ev.budget.tolist()}): it cannot bound the minimisation")
    result["hint_makespan"] = ev.makespan
    logging.info("hint (%s): makespan %g", _HINT_SCHEDULE.value or
                 f"{_HINT_S.value:g}s of search", ev.makespan)
    if _MINIMIZE.value or fixed is not None:
      default_target = ev.makespan - (shift if _SPLICE.value else 0)
  target = config_files.check_makespan_target(_TARGET.value, default_target)
  # After every check and the hint: a mistyped flag leaves the earlier run's files in place.
  wd.start_outputs(_WORKDIR.value, _CONFIG.value,
                   ("result.json", "schedule.json", "gantt.png", "gantt.json"),
                   inputs=(_HINT_SCHEDULE.value,))
  sched_path = os.path.join(_WORKDIR.value, "schedule.json")

  def on_solution(order, secs):
    # Each schedule the solver finds is kept at once (atomically), so a run stopped or killed
    # before its time limit still leaves its best schedule behind.
    ev = evaluate(problem, order)
    wd.atomic_write_text(sched_path, schedule.from_order(problem, order).to_json() + "\n")
    logging.info("solution at %.1fs: makespan %g (LB %g), within budget %s; kept in %s",
                 secs, ev.makespan, lb, ev.within_budget, sched_path)

  logging.info("%s target %d (tight LB %g) on %s of %d devices, %d tasks each; time limit "
               "%gs, %d workers ...", "minimising from" if _MINIMIZE.value else "checking",
               target, lb, devices or "all", problem.num_devices, problem.tasks_per_device,
               _TIME.value, _WORKERS.value)
  status, order, secs, bound = check(problem, target, _TIME.value, _WORKERS.value,
                                     _MINIMIZE.value, hint, _MEMORY.value, _WINDOWS.value,
                                     devices,
                                     _MEM_LAGS.value, on_solution=on_solution,
                                     log_search=_LOG_SEARCH.value, fixed=fixed)
  result.update({"target": target, "lower_bound": lb, "status": status, "solve_s": secs,
                 "windows": _WINDOWS.value, "memory_model": _MEMORY.value,
                 "memory_lags": _MEM_LAGS.value,
                 "devices": devices or "all",
                 "workers": _WORKERS.value})
  if _MINIMIZE.value:
    result["proven_lower_bound"] = bound
  if order is not None:
    ev = evaluate(problem, order)
    result.update(makespan=ev.makespan, within_budget=ev.within_budget,
                  peak_memory=ev.peaks.tolist(), budget=ev.budget.tolist())
    # The solver's schedule, re-timed by evaluate.py, in the format of schedule_search (it can
    # seed a search, run through the executor, or be looked at).
    sched = schedule.from_order(problem, order)
    wd.atomic_write_text(sched_path, sched.to_json() + "\n")
    gantt.draw(sched, _WORKDIR.value, gantt.cp_sat_title(ev.makespan, lb, ev.peak_over_budget))
  result["verdict"] = verdict(status, _MINIMIZE.value, subset=bool(devices),
                              pinned=fixed is not None)
  found = ", ".join(f"{k} {result[k]:g}" for k in ("makespan", "proven_lower_bound")
                    if result.get(k) is not None)
  logging.info("target %d (LB %g): %s (CP-SAT %s in %.1fs)%s", target, lb, result["verdict"],
               status, secs, f"; {found}" if found else "")
  path = runner.write_result(_WORKDIR.value, result)
  logging.info("wrote %s%s", path,
               " (+ schedule.json, gantt.png, gantt.json)" if order is not None else "")


if __name__ == "__main__":
  config_files.run(main)
