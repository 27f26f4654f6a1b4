r"""Pipe-RLHF's hierarchical plan search: a parallel plan per RLHF stage for one setting.

  python -m experiments.plan_search --config=configs/plan_search.py:65b/33b --workdir=/tmp/plan

Searches generation (instances, or delayed inter-batch pipelines), inference and training
(colocated pipelines or disjoint groups) layouts on the simulator's cost model
(rlhfuse_jax/sim/plan_search.py, docs/architecture.md §4), with `sim.staleness` k >= 1 also
asynchronous PPO's splits of the devices into a generation and a training group, and writes
into the workdir:
  plan.json       the fastest plan: generation / inference / training layouts, predicted stage
                  times; the asynchronous plan where it beats the synchronous one, then with
                  "async": {generation_devices, training_devices, staleness} (the generation
                  and inference layouts on the generation group, training on the other devices)
  result.json     {"best", "top", "uniform", "async", "plan_json", "stages", "systems",
                  "search_s", "setting"}; best.predicted_iteration_s (synchronous),
                  uniform.predicted_iteration_s and async.predicted_iteration_s (with
                  async.generation_devices, training_devices, staleness, colocated) are the
                  figures; plan_json says which plan plan.json holds ("synchronous" or
                  "asynchronous")
  plan_search.md  the top plans with predicted stage times, the best uniform layout, the
                  asynchronous plans and splits, and the simulator's other systems on the same
                  setting
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
  a = res.get("async")
  if a is not None:
    lines += ["", f"Asynchronous PPO (staleness k={a['staleness']}: the generation group "
              "generates and scores the batch k iterations ahead while the training group "
              "trains; iteration = max(gen + inference, train) + reshard of actor and critic, "
              "or the serial sum with both groups on all devices; searched in "
              f"{a['search_s']:.1f} s):", "",
              "| rank | plan | generation / training devices | reshard s | gen s | inference s "
              "| train s | iteration s |", "|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(a["top"]):
      q, sp = p["predicted"], p["async"]
      where = ("all / all (colocated, serial)" if sp["colocated"] else
               f"{sp['generation_devices']} / {sp['training_devices']}")
      lines.append(f"| {i + 1} | {p['summary']} | {where} | {q['reshard_s']:.2f} | "
                   f"{q['gen_s']:.2f} | {q['inf_s']:.2f} | {q['train_s']:.2f} | "
                   f"{q['iteration_s']:.2f} |")
    fit = [sp for sp in a["splits"] if "iteration_s" in sp]
    lines += ["", f"Splits tried: {len(a['splits'])}, {len(fit)} fit (the others: no training "
              "plan divides the mini-batch over the group, or a stage does not fit in memory); "
              "best per split (generation / training devices: iteration s, the slower group):",
              ""]
    lines += [f"- {sp['generation_devices']} / {sp['training_devices']}: "
              f"{sp['iteration_s']:.2f} ({sp['bound']})" for sp in fit]
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
  res = plan_search.search(cost, wl, cfg.sim, top_k=int(_CONFIG.value.top_k), log=logging.info,
                           staleness=cfg.sim.staleness, split_unit=cfg.sim.async_split_unit)
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
  plan, which, asynchronous = res["best"], "synchronous", None
  if "async" in res:
    a = res["async"]
    ab = a["best"]
    asynchronous = {**ab["async"], "predicted_iteration_s": ab["predicted"]["iteration_s"],
                    "plan": ab, "top": a["top"], "splits": a["splits"], "search_s": a["search_s"]}
    if not ab["async"]["colocated"] and (ab["predicted"]["iteration_s"] <
                                         best["predicted_iteration_s"]):
      plan, which = ab, "asynchronous"
  wd.write_json(os.path.join(workdir, "plan.json"), plan)
  wd.write_json(os.path.join(workdir, "result.json"),
                {"setting": setting, "best": best, "top": res["top"], "uniform": uniform,
                 "async": asynchronous, "plan_json": which, "stages": res["stages"],
                 "rejected": res["rejected"], "systems": systems, "search_s": res["search_s"]})
  with open(os.path.join(workdir, "plan_search.md"), "w") as f:
    f.write("\n".join(report(res, systems, setting)))
  logging.info("best %.2fs (%s); uniform %s; async %s; plan.json %s; search %.1fs -> %s",
               best["predicted_iteration_s"], res["best"]["summary"],
               f"{uniform['predicted_iteration_s']:.2f}s" if uniform else "none",
               f"{asynchronous['predicted_iteration_s']:.2f}s ({asynchronous['plan']['summary']})"
               if asynchronous else "off", which, res["search_s"],
               os.path.join(workdir, "plan_search.md"))


if __name__ == "__main__":
  app.run(main)
