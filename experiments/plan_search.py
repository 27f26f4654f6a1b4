r"""Pipe-RLHF's hierarchical plan search: a parallel plan per RLHF stage for one setting.

  python -m experiments.plan_search --config=configs/plan_search.py:65b/33b --workdir=/tmp/plan

Searches generation (instances, or delayed inter-batch pipelines), inference and training
(colocated pipelines or disjoint groups) layouts on the simulator's cost model
(rlhfuse_jax/sim/plan_search.py, docs/architecture.md §4), and writes into the workdir:
  plan.json       the best plan: generation / inference / training layouts, predicted stage times
  result.json     {"best", "top", "uniform", "stages", "systems", "search_s", "setting"};
                  best.predicted_iteration_s and uniform.predicted_iteration_s are the two figures
  plan_search.md  the top plans with predicted stage times, the best uniform layout and the
                  simulator's other systems on the same setting
  config.json
"""
from __future__ import annotations

import os
import time

from absl import app, flags, logging
from ml_collections import config_flags

from rlhfuse_jax import workdir as wd
from rlhfuse_jax.sim import ablations, iteration_sim, plan_search, training_sim

_CONFIG = config_flags.DEFINE_config_file("config", None, "Plan search config.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
flags.mark_flags_as_required(["config", "workdir"])


def report(res: dict, systems: dict, setting: dict) -> list[str]:
  """plan_search.md: the top plans, the uniform layout, the other systems."""
  lines = [f"# Plan search: {setting['label']} on {setting['num_devices']} x "
           f"{setting['hardware']}", "",
           f"Searched in {res['search_s']:.1f} s ({res['evaluated']} stage plans evaluated, "
           f"{len(res['rejected'])} rejected for memory or divisibility). Times are simulated "
           "seconds of one iteration (rlhfuse_jax/sim/).", "",
           "| rank | plan | reshard s | gen s | inference s | train s | iteration s |",
           "|---|---|---|---|---|---|---|"]
  for i, p in enumerate(res["top"]):
    q = p["predicted"]
    lines.append(f"| {i + 1} | {p['summary']} | {q['reshard_s']:.2f} | {q['gen_s']:.2f} | "
                 f"{q['inf_s']:.2f} | {q['train_s']:.2f} | {q['iteration_s']:.2f} |")
  u = res["uniform"]
  if u is not None:
    q = u["predicted"]
    lines.append(f"| uniform | one layout tp{u['layout']['tp']} pp{u['layout']['pp']} "
                 f"dp{u['layout']['dp']} for every stage | 0 | {q['gen_s']:.2f} | "
                 f"{q['inf_s']:.2f} | {q['train_s']:.2f} | {q['iteration_s']:.2f} |")
  if systems:
    lines += ["", "The simulator's systems on the same setting:", "",
              "| system | gen+inf s | train s | iteration s |", "|---|---|---|---|"]
    lines += [f"| {k} | {r['gen_plus_inf_s']:.2f} | {r['train_s']:.2f} | "
              f"{r['iteration_s']:.2f} |" for k, r in systems.items()]
  for stage, opts in res["stages"].items():
    lines += ["", f"Best {stage} plans (seconds, resharding included for generation):", ""]
    lines += [f"- {name}: {s:.3f}" for name, s in opts[:8]]
  return lines + [""]


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  cfg = ablations.AblationConfig.from_config_dict(_CONFIG.value)
  workdir = _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  wd.write_config(workdir, _CONFIG.value)
  setting = cfg.settings()[0]
  if len(cfg.settings()) != 1:
    raise ValueError(f"plan search takes one setting; the config has {len(cfg.settings())} "
                     "(one pair in `pairs`, one length in `max_new_tokens`)")
  cost, wl = ablations.cost_model(cfg), ablations.workload(cfg, setting)
  res = plan_search.search(cost, wl, cfg.sim, top_k=int(_CONFIG.value.top_k), log=logging.info)
  systems = {}
  if cfg.systems:
    t0 = time.time()
    cache = training_sim.ScheduleCache(time_budget_s=cfg.sim.search_time_s, seed=cfg.seed)
    rows, _ = iteration_sim.simulate_iteration(cost, wl, cfg.sim, cfg.systems, cache)
    systems = {k: {f: float(r[f]) for f in ("gen_plus_inf_s", "train_s", "iteration_s")}
               for k, r in rows.items()}
    logging.info("simulated %s in %.1fs", ", ".join(cfg.systems), time.time() - t0)
  best = {**res["best"], "predicted_iteration_s": res["best"]["predicted"]["iteration_s"]}
  uniform = None if res["uniform"] is None else {
      **res["uniform"], "predicted_iteration_s": res["uniform"]["predicted"]["iteration_s"]}
  wd.write_json(os.path.join(workdir, "plan.json"), res["best"])
  wd.write_json(os.path.join(workdir, "result.json"),
                {"setting": setting, "best": best, "top": res["top"], "uniform": uniform,
                 "stages": res["stages"], "rejected": res["rejected"], "systems": systems,
                 "search_s": res["search_s"]})
  with open(os.path.join(workdir, "plan_search.md"), "w") as f:
    f.write("\n".join(report(res, systems, setting)))
  logging.info("best %.2fs (%s); uniform %s; search %.1fs -> %s", best["predicted_iteration_s"],
               res["best"]["summary"],
               f"{uniform['predicted_iteration_s']:.2f}s" if uniform else "none",
               res["search_s"], os.path.join(workdir, "plan_search.md"))


if __name__ == "__main__":
  app.run(main)
