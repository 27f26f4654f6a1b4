"""Searches a fused actor/critic pipeline schedule for one instance and reports it.

  python -m experiments.schedule_search --config=configs/schedule_search.py --workdir=/tmp/ss_e0

Writes into --workdir: config.json, result.json (serial 1F1B, greedy, searched, lower bounds, gap,
bubbles, per-device peak memory against the budget, the best schedule without the budget),
schedule.json (pipeline/schedule.py format) and gantt.png, its title kept in gantt.json
(`python -c "from rlhfuse_jax.pipeline import gantt; gantt.redraw('DIR')"` draws it again).

The budget is config.memory_budget_mode's ("uniform" by default, or "per_device"; graph.py) unless
config.memory_budget gives one; result.json names the mode in force ("explicit" for a given
budget) and the budget's and the searched schedule's largest per-device figures as scalars, so
that a sweep's summary table shows them.
Launch commands: see configs/schedule_search.py.

Docs: docs/schedules.md.
"""
from __future__ import annotations

import os

from absl import flags, logging
from ml_collections import config_flags
import numpy as np

from experiments import config_files
from experiments import runner
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.pipeline import bounds, gantt, schedule, schedules, search
from rlhfuse_jax.pipeline.evaluate import evaluate
from rlhfuse_jax.pipeline.graph import PipelineProblem, config_number

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory", required=True)
flags.mark_flags_as_required(["config"])


def run(c, workdir: str) -> dict:
  try:
    problem = PipelineProblem.from_config(c)
    evaluations = config_number(c, "max_evaluations", int)
    if evaluations < 0:
      raise ValueError(f"config.max_evaluations={evaluations}: expected >= 0 (0: stop at "
                       "time_budget_s)")
    cfg = search.SearchConfig(time_budget_s=config_number(c, "time_budget_s"),
                              seed=config_number(c, "seed", int),
                              workers=config_number(c, "workers", int),
                              max_evaluations=evaluations or None)
  except ValueError as e:
    # Their checks name the field as the config spells it, without the "config." of the
    # command line (--config.critic_pp): "actor_pp=8 must be divisible by critic_pp=3".
    if str(e).startswith("config."):
      raise
    raise ValueError(f"config.{e}") from None
  need = max(problem.actor_mem, problem.critic_mem)
  if c.memory_budget >= 0 and c.memory_budget < need:
    # (the search found it only after moving the earlier result aside and compiling its
    # kernels, as a RuntimeError traceback)
    raise ValueError(f"config.memory_budget={c.memory_budget:g}: expected at least max(actor_mem, "
                     f"critic_mem) = {need:g} (every device runs a forward of each model), or -1 "
                     "for the budget of config.memory_budget_mode")
  wd.start_outputs(workdir, c, ("result.json", "schedule.json", "gantt.png", "gantt.json"))
  serial = evaluate(problem, schedules.serial_order(problem), schedules.serial_release(problem))
  greedy = evaluate(problem, schedules.greedy_order(problem))
  lb = bounds.tight_lower_bound(problem)
  logging.info("N=%d devices, %d tasks per device; serial %g, greedy %g, tight LB %g; memory "
               "budget %s, %s", problem.num_devices, problem.tasks_per_device, serial.makespan,
               greedy.makespan, lb, problem.memory_budget_mode, problem.budget().tolist())
  for name, ev in (("serial 1F1B", serial), ("greedy", greedy)):
    if not ev.within_budget:
      d = int(np.argmax(ev.peaks - ev.budget))
      logging.warning("%s exceeds this memory budget (device %d: peak %g > %g): no baseline "
                      "the searched schedule must beat", name, d, ev.peaks[d], ev.budget[d])
  logging.info("loading the search's numba kernels (%s) ...", search.KERNELS_NOTE)
  logging.info("numba kernels ready in %.1fs (compiled or loaded from cache)", search.warmup())
  res = search.search(problem, cfg, log=logging.info)
  best = evaluate(problem, res.best)
  unc = evaluate(problem, res.best_unconstrained)
  sched = schedule.from_order(problem, res.best)
  result = {
      "serial_1f1b": serial.makespan,
      "greedy": greedy.makespan,
      # The uniform and per_device budgets hold both; an explicit --config.memory_budget may
      # not, and then searched (within it) may be above them.
      "serial_within_budget": serial.within_budget,
      "greedy_within_budget": greedy.within_budget,
      "searched": best.makespan,
      "lower_bound": lb,
      "lower_bound_simple": bounds.simple_lower_bound(problem),
      "gap_to_lower_bound": best.makespan / lb - 1.0,
      "within_budget": best.within_budget,
      "at_lower_bound": bool(best.makespan <= lb + 1e-9),
      "memory_budget_mode": problem.memory_budget_mode,
      "budget_max": float(np.max(best.budget)),
      "peak_max": float(np.max(best.peaks)),
      "devices_at_budget": int(np.sum(best.peaks >= best.budget - 1e-9)),
      "bubble": {"serial": serial.bubble, "searched": best.bubble},
      "peak_memory": {"serial": serial.peaks.tolist(), "searched": best.peaks.tolist(),
                      "budget": best.budget.tolist()},
      "unconstrained": {"makespan": unc.makespan, "peak_memory": unc.peaks.tolist(),
                        "max_peak_over_budget": unc.peak_over_budget},
      "search_s": res.search_s,
      "evaluations": res.evaluations,
      "evaluations_per_s": res.evaluations / max(res.search_s, 1e-9),
      "seed": int(c.seed),
      "workers": int(c.workers),
  }
  runner.write_result(workdir, result)
  wd.atomic_write_text(os.path.join(workdir, "schedule.json"), sched.to_json() + "\n")
  gantt.draw(sched, workdir, gantt.search_title(problem, best.makespan, lb, serial.makespan,
                                                 best.peak_over_budget))
  logging.info("%s", summary(result, workdir))
  return result


def summary(result: dict, workdir: str) -> str:
  """The closing log line, from result.json's fields."""
  n = result["devices_at_budget"]
  serial = result.get("serial_1f1b")  # (the time units are actor_fwd's and critic_fwd's)
  return (f"searched {result['searched']:g} time units (LB {result['lower_bound']:g}, gap "
          f"{100 * result['gap_to_lower_bound']:.2f}%"
          + (f"; serial 1F1B {serial:g}, {serial / result['searched']:.2f}x the searched"
             if serial else "") + f"), peak {result['peak_max']:g} of the "
          f"{result['memory_budget_mode']} budget {result['budget_max']:g} ({n} "
          f"device{'' if n == 1 else 's'} at it), within budget: {result['within_budget']}; "
          f"wrote {workdir} (a run of this shape trains it, each task one tick: train_ppo "
          f"--config.pipeline.schedule_file={os.path.join(workdir, 'schedule.json')}; "
          "docs/schedules.md says which durations to search it on)")


def main(argv):
  # SIGTERM (config_files.run's handler) ends the search as an exception: its `finally`
  # terminates the worker processes (config.workers) first, which SIGTERM's default left
  # running to the end of their budget, holding the output a sweep reads.
  del argv
  run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  config_files.run(main)
