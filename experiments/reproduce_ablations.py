r"""Reproduces the RLHFuse ablations at paper scale with the simulator (rlhfuse_jax/sim/).

  python -m experiments.reproduce_ablations --config=configs/ablations.py --workdir=/tmp/abl

Writes into the workdir: config.json, result.json ({"rows": [{setting, system, iteration_s,
gen_s, inf_s, gen_plus_inf_s, train_s, samples_per_s, reshard_s, details}], "inputs",
"validation", "figures"}), ablations.md, iteration_time.png, generation_timeline.png,
fused_gantt.png (fused schedule above the serial 1F1B one; the PNGs are drawn from result.json's
`rows` and `figures`, and `redraw(WORKDIR)` draws them again from it alone),
schedule_cache.json (fused searches, reused on re-runs),
and, with --config.validate.bench_decode_workdir, decode_fit_calibration.json: the decode model
fitted to that bench, which --config.calibration=<it> turns into the simulated engine.

Docs: docs/simulator.md.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from experiments import config_files
from experiments import runner
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.pipeline import schedule as schedule_lib, schedules
from rlhfuse_jax.pipeline.graph import PipelineProblem
from rlhfuse_jax.pipeline.search import warmup
from rlhfuse_jax.sim import ablations, iteration_sim, plots, report, validation
from rlhfuse_jax.policy import calibration as cal_lib
from rlhfuse_jax.sim import generation_sim as gen_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Ablation config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
flags.mark_flags_as_required(["config", "workdir"])
PAPER_RT = 0.2  # RLHFuse (arXiv 2409.13221): about 20 % of samples remaining is often a good Rt


def figure_data(cfg, out: dict) -> dict:
  """What the PNGs draw, as result.json keeps it (`figures`; the bars of iteration_time.png
  are result.json's `rows`): the systems and machine of iteration_time.png; the setting and
  each panel's title and timeline (plots.timeline_data) of generation_timeline.png; each
  panel's title and schedule (plots.schedule_data) of fused_gantt.png. `plot_figures` draws
  them, for the run and for `redraw`."""
  figures = {"iteration_time": {"systems": list(cfg.systems),
                                "machine": f"{cfg.num_devices} x {cfg.hardware}"}}
  raw = out["raw"]
  gens = raw["gen"]
  panels = []
  if (False, False) in gens:
    panels.append(("without consolidation (rlhfuse_base)", gens[(False, False)]["result"]))
  if (True, False) in gens:
    fused = gens[(True, False)]
    rt = fused["threshold"]
    panels.append((f"sample-level streaming, Rt={rt:g} chosen by simulation (inter_stage)",
                   fused["result"]))
    if not fused["result"].consolidations:
      # The chosen Rt did not migrate: also show the paper's suggested Rt, which does.
      wl = ablations.workload(cfg, raw["setting"])
      setup = iteration_sim.gen_setup(fused["plan"], wl, cfg.sim, ablations.cost_model(cfg),
                                       True, PAPER_RT)
      prompts, resp = wl.sample_lengths()
      res = gen_lib.simulate_generation(ablations.cost_model(cfg), wl.actor,
                                        (wl.actor, wl.critic, wl.critic), setup, prompts, resp)
      panels.append((f"with consolidation at the paper's Rt={PAPER_RT:g} (not chosen)", res))
  label = raw["setting"]["label"]
  if panels:
    decimals = plots.time_decimals(max(r.gen_plus_inf_s for _, r in panels))
    figures["generation_timeline"] = {
        "setting": label, "panels": [{"title": title, "timeline": plots.timeline_data(r, decimals)}
                                     for title, r in panels]}
  train = raw["train"]
  if True in train and False in train:
    pdict = dict(train[True]["problem"])
    problem = PipelineProblem(**{k: v for k, v in pdict.items() if k != "memory_budget"})
    fused = schedule_lib.from_order(problem, np.array(train[True]["search"]["order"], np.int8))
    serial = _serial_schedule(problem, schedules.serial_order(problem))
    decimals = plots.time_decimals(max(fused.makespan, serial.makespan))
    figures["fused_gantt"] = {"panels": [
        {"title": f"fused actor+critic schedule (intra_stage / rlhfuse), {label}: "
                  f"{fused.makespan:.1f} ms per mini-batch",
         "schedule": plots.schedule_data(fused, decimals)},
        {"title": f"serial: actor 1F1B then critic 1F1B (rlhfuse_base): {serial.makespan:.1f} ms",
         "schedule": plots.schedule_data(serial, decimals)}]}
  return figures


def plot_figures(result: dict, workdir: str) -> list[str]:
  """The PNGs of `result` (its `rows` and `figures`: figure_data) in `workdir`, drawn from
  those alone; returns their names."""
  figures = result["figures"]
  names = ["iteration_time.png"]
  plots.plot_iteration_times(result["rows"], figures["iteration_time"]["systems"],
                             os.path.join(workdir, names[0]),
                             machine=figures["iteration_time"]["machine"])
  if "generation_timeline" in figures:
    entry = figures["generation_timeline"]
    names.append("generation_timeline.png")
    plots.plot_generation_timelines(
        [(p["title"], plots.timeline_from_data(p["timeline"])) for p in entry["panels"]],
        os.path.join(workdir, names[-1]), setting=entry["setting"])
  if "fused_gantt" in figures:
    names.append("fused_gantt.png")
    plots.plot_schedules([(p["title"], plots.schedule_from_data(p["schedule"]))
                          for p in figures["fused_gantt"]["panels"]],
                         os.path.join(workdir, names[-1]))
  return names


def redraw(workdir: str) -> list[str]:
  """The PNGs of a finished run in `workdir`, drawn again from its result.json alone (no
  simulation); returns their paths. A result written before 2026-12-07 keeps no `figures`:
  iteration_time.png alone is drawn, from its `rows` (rows_figure), with a warning; its
  timelines and schedules were never kept, so the other two PNGs need its command again."""
  path = os.path.join(workdir, "result.json")
  result = wd.read_result(workdir, "reproduce_ablations")
  if "figures" not in result:
    figure = rows_figure(result.get("rows"))
    if figure is None:
      raise ValueError(f"{path}: no `figures` (a reproduce_ablations result written before "
                       "2026-12-07 does not keep what its PNGs draw; its command, in "
                       "`provenance`, draws them again)")
    logging.warning("%s: no `figures` (written before 2026-12-07): iteration_time.png alone, "
                    "from its rows; generation_timeline.png and fused_gantt.png need the "
                    "simulation again (its command, in `provenance`)", path)
    result = {**result, "figures": {"iteration_time": figure}}
  return [os.path.join(workdir, name) for name in plot_figures(result, workdir)]


def rows_figure(rows) -> Optional[dict]:
  """figure_data's `iteration_time` entry as a result's `rows` give it (None without rows):
  the systems in the rows' order (the config's, each setting's rows in it) and the cluster
  their settings name (the config's num_devices and hardware)."""
  if not isinstance(rows, list) or not rows or not all(
      isinstance(r, dict) and "system" in r and isinstance(r.get("setting"), dict)
      and {"num_devices", "hardware"} <= r["setting"].keys() for r in rows):
    return None
  machines = dict.fromkeys(f"{r['setting']['num_devices']} x {r['setting']['hardware']}"
                           for r in rows)
  return {"systems": list(dict.fromkeys(r["system"] for r in rows)),
          "machine": " / ".join(machines)}


def _serial_schedule(problem, order):
  """The serial order timed with the critic released after the actor (a Schedule for plotting)."""
  from rlhfuse_jax.pipeline.evaluate import evaluate
  ev = evaluate(problem, order, schedules.serial_release(problem))
  sched = schedule_lib.from_order(problem, order)  # labels; re-time with the release below
  devices = []
  for d, dev in enumerate(sched.devices):
    devices.append(tuple(schedule_lib.Task(t.model, t.replica, t.stage, t.microbatch, t.kind,
                                           float(ev.starts[d, p]), float(ev.ends[d, p]))
                         for p, t in enumerate(dev)))
  return schedule_lib.Schedule(problem=problem, devices=tuple(devices), makespan=ev.makespan,
                               peaks=sched.peaks, budget=sched.budget)


def check_bench_workdir(name: str, given: str) -> None:
  """A ValueError naming config.validate.`name`_workdir unless it is empty or holds the
  result.json of a finished `name` run: another binary's result (a train_ppo or bench_decode
  workdir given for bench_generation) was taken as the bench's and, after the whole
  simulation, skipped with a warning or a bare KeyError ("could not compare: 'device'"), exit 0.
  The binary is read from the result's provenance command (results without one pass)."""
  if not given:
    return
  field = f"config.validate.{name}_workdir={given!r}"
  path = os.path.join(given, "result.json")
  if not os.path.isfile(path):
    raise ValueError(f"{field}: no result.json there (the --workdir of a finished python -m "
                     f"experiments.{name} run)")
  result = wd.read_json_object(path, invalid="not valid JSON (a result.json being written?)")
  wrote = wd.written_by(result)
  if wrote is not None and wrote != name:
    raise ValueError(f"{field}: its result.json was written by experiments.{wrote}, not "
                     f"experiments.{name} ({result['provenance']['command'][:120]})")


def iteration_table(rows: list) -> dict:
  """{setting label: {system: iteration seconds}}: the headline figures as scalars, which a
  sweep's summary (it keeps scalars only) shows as columns `iteration_s/<label>/<system>`; a
  sweep over hardware or efficiencies showed only the inputs."""
  out: dict = {}
  for row in rows:
    out.setdefault(row["setting"]["label"], {})[row["system"]] = row["iteration_s"]
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  cfg = ablations.AblationConfig.from_config_dict(_CONFIG.value)
  for name in ("bench_generation", "bench_pipeline", "bench_decode"):
    check_bench_workdir(name, getattr(cfg, f"{name}_workdir"))
  # The calibration files read and checked before the earlier outputs move aside (a malformed
  # one, or one of another model, left the workdir without its result).
  ablations.cost_model(cfg)
  for line in ablations.context_warnings(cfg):  # (not refused: the papers' L=2048 settings)
    logging.warning("sequences longer than a model's context: %s", line)
  if cfg.validation_calibration:
    cal_lib.load(cfg.validation_calibration, "config.validate.calibration")
  workdir = _WORKDIR.value
  # schedule_cache.json is not an output: the searches it holds are reused on a re-run.
  wd.start_outputs(workdir, _CONFIG.value, (
      "result.json", "ablations.md", "decode_fit_calibration.json", "fused_gantt.png",
      "generation_timeline.png", "iteration_time.png"),
      inputs=(cfg.calibration, cfg.validation_calibration))
  t0 = time.time()
  logging.info("compiling the schedule kernels (numba; cached after the first run) ...")
  logging.info("schedule kernels ready in %.1fs", warmup())
  out = ablations.run_ablations(cfg, workdir, log=logging.info)
  val_cal = (cal_lib.load(cfg.validation_calibration, "config.validate.calibration")
             if cfg.validation_calibration else None)
  val_lines, val_rows, val_skipped = validation.validate(
      val_cal, cfg.bench_generation_workdir, cfg.bench_pipeline_workdir,
      cfg.bench_decode_workdir, cfg.efficiency, cfg.bench_decode_extra,
      decode_fit_out=os.path.join(workdir, "decode_fit_calibration.json"))
  result = {"iteration_s": iteration_table(out["rows"]), "rows": out["rows"],
            "inputs": out["inputs"], "validation": val_rows,
            "figures": figure_data(cfg, out)}
  # drawn from what result.json keeps (as it reads back): the figures a redraw gives
  figures = plot_figures(wd.as_json(result), workdir)
  runner.write_result(workdir, result)
  made = runner.provenance()  # as result.json's
  when = made.get("started", made["date"])[:10]
  report.write_markdown(os.path.join(workdir, "ablations.md"), out["rows"], cfg.systems,
                        out["inputs"], val_lines, made["command"], figures, time.time() - t0,
                        f"at commit {made['git_commit']}, {when}, on {made['host_cpu']}")
  for row in val_rows:
    if row.get("measured") is not None:
      logging.info("validation %s (%s): %s predicted %.4g, measured %.4g (%+.1f %%)",
                   row["bench"], row.get("prediction", ""), row["quantity"], row["predicted"],
                   row["measured"], 100 * row["error"])
  for bench, reason in val_skipped:  # a bench the user named that could not be compared
    logging.warning("validation: %s: %s", bench, reason)
  logging.info("done in %.0fs: %s", time.time() - t0, os.path.join(workdir, "ablations.md"))


if __name__ == "__main__":
  config_files.run(main)
