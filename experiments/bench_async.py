r"""Asynchronous PPO against the synchronous loop (config.async_ppo; docs/usage.md
"Asynchronous PPO").

  python -m experiments.bench_async --config=configs/bench_async.py --workdir=/tmp/bench_async
  python -m experiments.bench_async --config=configs/bench_async.py:timing --workdir=/tmp/ba_t

Runs `python -m experiments.train_ppo` once per run config, staleness (the first is the
synchronous reference, 0) and seed, each in DIR/<config>_s<k>_seed<n> with its own
metrics.jsonl (`parallel` of them at once), and writes DIR/result.json and DIR/curves.png
(reward per iteration and against the iterations' summed wall time, means over the seeds; the
series it draws are result.json's `curves`, and `redraw(DIR)` draws it again from them):

  reward_gain       mean reward of the last window minus the first (window: a fraction of the
                    iterations), averaged over the seeds (per seed in reward_gain_per_seed);
                    gain_ratio: over the synchronous runs' (the acceptance bar: min_gain_ratio).
                    One seed's gain varies by tens of percent on these tiny runs, hence seeds.
  median_step_s     median iteration wall time, after the first `skip` iterations (compiles)
                    and without the last max(1, staleness) (nothing is generated ahead in
                    them)
  overlap_frac      mean perf/async_overlap_frac: how much of the shorter of generation and
                    training ran while the other did
  failed_runs       runs that failed (then the exit status is 1 and their config has no
                    figures; re-running the command resumes them)

The default compares learning (ppo_tiny and grpo_tiny on one CPU device, staleness 0, 1, 2);
`timing` compares iteration wall time on 8 fake CPU devices split 4 generate / 4 train. Fake
devices share the host's cores, so there the overlap buys time only where a core would
otherwise idle; result.json records the machine.
"""
from __future__ import annotations

import concurrent.futures
import json
import math
import os
import re
import sys

import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import config_files
from experiments import runner
from rlhfuse_jax import workdir as wd
from rlhfuse_jax.fields import check as _check
from rlhfuse_jax.parallel.host_devices import host_device_env
# Not trainer.config, which imports jax (as matplotlib.pyplot, imported by `plot`, takes a
# second): this process only starts train_ppo runs, and refuses a bad config or workdir first
# (check_config loads the run configs, which import it, after its own fields pass).
from rlhfuse_jax.trainer.async_objectives import ASYNC_OBJECTIVES

_CONFIG = config_flags.DEFINE_config_file("config", None, "Benchmark config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
flags.mark_flags_as_required(["config", "workdir"])


def check_config(c) -> None:
  _check(len(c.runs) > 0, "runs", c.runs, "one or more train_ppo config paths")
  for r in c.runs:
    path = r.split(":")[0]
    _check(os.path.isfile(os.path.join(runner.REPO_ROOT, path)), "runs", r,
           "train_ppo config files (configs/*.py[:variant])")
  s = list(c.staleness)
  _check(len(s) >= 2 and s[0] == 0 and all(isinstance(k, int) and k >= 1 for k in s[1:]),
         "staleness", c.staleness, "0 (the synchronous reference) first, then values >= 1")
  _check(0 < c.window <= 0.5, "window", c.window, "in (0, 0.5]")
  # (NaN: every run compared False against it, and the bench reported FAIL after all the runs)
  _check(isinstance(c.min_gain_ratio, (int, float)) and 0 <= c.min_gain_ratio < float("inf"),
         "min_gain_ratio", c.min_gain_ratio, "a finite number >= 0")
  config_files.check_ints(c, ("host_devices", "parallel"))  # parallel: runs at once
  # (negative, summarize sliced rows[skip:-k] from the end: -3 timed the last 2 iterations, -1
  # none, and the median fell back to every iteration, the compiles' included)
  config_files.check_int("skip", c.skip, 0, "iterations left out of the median step time")
  # (Each run refused a seed train_ppo does not take after starting jax: 6 launches per
  # seed of the default config.)
  _check(len(c.seeds) >= 1 and all(isinstance(x, int) and not isinstance(x, bool) and
                                   0 <= x < 2**32 for x in c.seeds), "seeds", c.seeds,
         "one or more integers in [0, 2**32) (each run's config.seed)")
  # A repeated entry (a seed typed twice, one config file named two ways) gave two jobs one
  # train_ppo workdir: at once, the second was refused by the first's lock and its config lost
  # its figures; one after the other, it read the first's finished run back as another seed.
  for field, names in (("runs", [run_name(r, 0, 0)[:-len("_s0_seed0")] for r in c.runs]),
                       ("staleness", list(c.staleness)), ("seeds", list(c.seeds))):
    repeated = sorted({str(n) for n in names if names.count(n) > 1})
    _check(not repeated, field, c[field], "distinct entries (each run gets a directory of its "
           f"own, by config, staleness and seed): {', '.join(repeated)} repeated")
  config_files.check_int("num_iterations", c.num_iterations, 0, "0: each run config's own")
  _check(0 <= c.generation_devices < c.host_devices, "generation_devices", c.generation_devices,
         f"0 or fewer than host_devices={c.host_devices}")
  # (Each run refused it after starting jax: 18 launches of the default config.)
  _check(c.objective in ASYNC_OBJECTIVES, "objective", c.objective,
         f"one of {ASYNC_OBJECTIVES}")
  # Each run config loaded, its variant too, last (the configs import jax, ~1 s): an unknown
  # variant started every run (9 of the default config), each failing on the same flag error.
  for r in c.runs:
    try:
      run = config_files.get_config(os.path.join(runner.REPO_ROOT, r), "config.runs entry")
    except Exception as e:  # noqa: BLE001 what the config file's get_config raises
      raise ValueError(f"config.runs entry {r!r}: {type(e).__name__}: {e}") from None
    # Each run gets host_devices fake devices (its XLA_FLAGS replaced): a mesh that needs more
    # failed every run after jax started, advising an XLA_FLAGS the bench overrides.
    mesh = run.get("mesh", {}) if hasattr(run, "get") else {}
    need = math.prod(v for v in mesh.values() if isinstance(v, int) and v > 0) + (
        c.generation_devices)
    gen = f" + generation_devices={c.generation_devices}" if c.generation_devices else ""
    _check(need <= c.host_devices, "host_devices", c.host_devices,
           f"at least the {need} devices config.runs entry {r!r} needs (its mesh {dict(mesh)}"
           f"{gen}): each run gets config.host_devices fake CPU devices")


def run_name(config: str, staleness: int, seed: int) -> str:
  base = os.path.splitext(os.path.basename(config.split(":")[0]))[0]
  variant = config.split(":")[1] if ":" in config else ""
  return re.sub(r"[^A-Za-z0-9_]", "_", base + (f"_{variant}" if variant else "")) + \
      f"_s{staleness}_seed{seed}"


def summarize(rows: list[dict], window: float, skip: int, staleness: int) -> dict:
  """The figures of one run's metrics.jsonl rows (module docstring)."""
  rewards = np.array([r["reward/mean"] for r in rows], np.float64)
  k = max(1, int(round(len(rows) * window)))
  # Without the last max(1, staleness) iterations: they generate nothing ahead.
  steps = ([r["timing_s/step"] for r in rows[skip:-max(1, staleness)]] or
           [r["timing_s/step"] for r in rows])
  overlap = [r["perf/async_overlap_frac"] for r in rows if "perf/async_overlap_frac" in r]
  return {"iterations": len(rows), "reward_first": float(rewards[:k].mean()),
          "reward_last": float(rewards[-k:].mean()),
          "reward_gain": float(rewards[-k:].mean() - rewards[:k].mean()),
          "median_step_s": float(np.median(steps)),
          "overlap_frac": float(np.mean(overlap)) if overlap else None,
          "behaviour_weight_mean": (float(np.mean([r["async/behaviour_weight_mean"]
                                                   for r in rows]))
                                    if "async/behaviour_weight_mean" in rows[0] else None)}


def describe(s: dict, min_gain_ratio: float, parallel: int = 1) -> str:
  """One staleness's figures (`summarize` plus the ratios to the synchronous run) in words;
  `min_gain_ratio` 0: no bar (timing only); `parallel` > 1: the runs' step times were measured
  beside each other, under loads that differ."""
  parts = [f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f} "
           f"(gain {s['reward_gain']:+.3f} over {int(s['iterations'])} iterations)",
           f"median step {s['median_step_s']:.3f}s"]
  if "gain_ratio" in s:
    ratio = ("gain ratio n/a (the synchronous run did not learn)" if s["gain_ratio"] is None
             else f"gain {s['gain_ratio']:.2f}x the synchronous run's")
    bar = (f" (bar {min_gain_ratio:g}: {'ok' if s['gain_ok'] else 'MISSED'})"
           if min_gain_ratio > 0 else "")
    shared = (f" (runs measured beside each other, config.parallel={parallel}: not comparable)"
              if parallel > 1 else "")
    parts.append(f"{ratio}{bar}, step time {s['step_time_ratio']:.2f}x{shared}")
  if s.get("overlap_frac") is not None:
    parts.append(f"overlap {s['overlap_frac']:.0%}")
  return "; ".join(parts)


def curve(runs: list[list[dict]], skip: int = 0) -> dict:
  """The seeds' mean reward per iteration and mean wall time of the iterations so far (each
  run's metrics.jsonl rows; the seeds ran the same number of iterations). The first `skip`
  iterations (config.skip: their steps compile) count at the run's median step of the others:
  iteration 1's compiles (8-10 s of a 40-iteration timing run's 13 s, more in the async run)
  set the wall-time axis apart where the plot means to compare the steady state."""
  def elapsed(run):
    steps = np.array([r["timing_s/step"] for r in run], dtype=float)
    if 0 < skip < len(steps):
      steps[:skip] = np.median(steps[skip:])
    return np.cumsum(steps)
  return {"reward": np.mean([[r["reward/mean"] for r in run] for run in runs], axis=0),
          "elapsed_s": np.mean([elapsed(run) for run in runs], axis=0)}


def plot(curves: dict, path: str, width: int, skip: int = 0, machine: str = "") -> None:
  """A column per run config, a curve per staleness: the reward (moving average) per iteration
  (top) and against the wall time the iterations took so far (bottom: what asynchrony is for;
  start-up and compiles not counted: `curve`). curves[config][staleness]: {"reward": [...],
  "elapsed_s": [...]}; `skip`: the first iterations counted at the median step (`curve`),
  said on the axis; `machine`: where the runs ran, in each column's title."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(2, len(curves), figsize=(5.5 * len(curves), 7.2), squeeze=False)
  for col, (config, by_k) in enumerate(curves.items()):
    top, bottom = axes[0, col], axes[1, col]
    for k, series in by_k.items():
      label = "synchronous" if k == 0 else f"async, staleness {k}"
      reward = runner.smooth(series["reward"], width)
      # (one iteration: a point, which a line without a marker does not draw)
      marker = "o" if len(reward) == 1 else None
      top.plot(np.arange(1, len(reward) + 1), reward, label=label, marker=marker)
      bottom.plot(series["elapsed_s"], reward, label=label, marker=marker)
    top.set_title(f"{config}{f' ({machine})' if machine else ''}", fontsize=9)
    top.set_xlabel("iteration")
    # `curve` counts the first `skip` at the median step only where iterations follow them:
    # the axis said so of runs of `skip` iterations or fewer, whose compiles it includes.
    lengths = [len(series["reward"]) for series in by_k.values()]
    note = ("" if not skip else
            f"\n(the first {skip} iterations, which compile, counted at the median step)"
            if all(skip < n for n in lengths) else
            f"\n(compiles included: runs of {min(lengths)} iterations, config.skip={skip})")
    bottom.set_xlabel("wall time of the iterations so far (s)" + note)
    for ax in (top, bottom):
      ax.set_ylabel(f"reward (seeds' mean, moving mean of {width})")
      ax.grid(alpha=0.3)
      ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# Significant digits a kept curve's value has: a float32 reward's (train_ppo logs them), and
# 10 us of a 100 s wall time. 17 each (a float64's repr) made the default run's curves 95 kB.
CURVE_DIGITS = 7


def curves_entry(curves: dict, width: int, skip: int = 0, machine: str = "") -> dict:
  """What curves.png draws, as result.json keeps it (`curves`): `plot`'s arguments, each
  staleness's series under its number as a string (a JSON key) and as lists (values to
  CURVE_DIGITS significant digits), so a kept result is drawn again, restyled or compared
  with another run's (`plot_result`) without its runs. The run's own curves.png is drawn from
  this entry too, so it is the figure a redraw gives."""
  return {"width": width, "skip": skip, "machine": machine,
          "runs": {config: {str(k): {name: [float(f"{x:.{CURVE_DIGITS}g}") for x in values]
                                     for name, values in series.items()}
                            for k, series in by_k.items()}
                   for config, by_k in curves.items()}}


def plot_result(result: dict, path: str) -> None:
  """curves.png drawn from a result's `curves` (curves_entry) alone."""
  entry = result["curves"]
  plot({config: {int(k): {name: np.asarray(values, np.float64)
                          for name, values in series.items()}
                 for k, series in by_k.items()}
        for config, by_k in entry["runs"].items()},
       path, entry["width"], entry["skip"], entry["machine"])


def redraw(workdir: str) -> str:
  """WORKDIR/curves.png drawn again from WORKDIR/result.json alone (not the runs' metrics);
  returns its path."""
  path = os.path.join(workdir, "result.json")
  result = wd.read_result(workdir, "bench_async")
  if not result.get("curves"):
    raise ValueError(f"{path}: no `curves` (no config had all its runs finish, or a "
                     "bench_async result written before 2026-12-07, which did not keep them)")
  out = os.path.join(workdir, "curves.png")
  plot_result(result, out)
  return out


# The fields that change a run without changing its name (a run is named by its config,
# staleness and seed; each train_ppo run refuses a resume under another config of its own).
# The others (window, skip, min_gain_ratio, parallel; runs, staleness and seeds add or drop
# runs) may change between starts.
RUN_FIELDS = ("objective", "num_iterations", "generation_devices", "host_devices")


def run_iterations(num_iterations, config: str):
  """The iterations a run of train_ppo config `config` (FILE.py[:variant], from the repository
  root) trains: `num_iterations`, or the config's own when 0; None when that config cannot be
  read (the run itself reports why)."""
  if num_iterations:
    return int(num_iterations)
  try:
    return int(config_files.get_config(os.path.join(runner.REPO_ROOT, config)).num_iterations)
  except Exception:  # pylint: disable=broad-except
    return None


def check_reuse(path: str, config: dict) -> None:
  """The runs in a workdir are train_ppo workdirs: re-running resumes them (an interrupted
  benchmark finishes) and reads finished ones back. That is only this benchmark's result when
  they were started with this config, so a workdir whose runs trained under other RUN_FIELDS
  is refused, naming the fields that differ."""
  if not os.path.exists(path):
    return
  old = wd.read_json_object(path)
  new = json.loads(json.dumps(config))  # as it reads back (tuples -> lists)
  workdir = os.path.dirname(path)
  trained = any(os.path.exists(os.path.join(workdir, d, "metrics.jsonl"))
                for d in os.listdir(workdir))
  differ = sorted(k for k in RUN_FIELDS if old.get(k) != new.get(k)) if trained else []
  if "num_iterations" in differ:
    # 0 (each config's own) and that count given explicitly train the same runs: compared by
    # the counts the runs were started with (recorded since 2026-11-30; before, the config
    # files' counts as they read now).
    started = old.get("resolved_num_iterations") or {}

    def same(r: str) -> bool:
      now = run_iterations(new["num_iterations"], r)
      then = started[r] if r in started else run_iterations(old.get("num_iterations"), r)
      return now is not None and now == then
    if all(same(r) for r in set(old.get("runs") or ()) | set(new.get("runs") or ())):
      differ.remove("num_iterations")
  if differ:
    raise ValueError(
        f"--workdir={os.path.dirname(path)} holds bench_async runs of another config "
        f"({', '.join(f'{k}: {old.get(k)!r} -> {new.get(k)!r}' for k in differ)}); their "
        "train_ppo runs would be resumed or read back as this config's: use a new workdir")
  logging.info("%s: the same config; finished runs are read back, unfinished ones resumed",
               os.path.dirname(path))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  c, out = _CONFIG.value, _WORKDIR.value
  check_config(c)
  # Another binary's outputs (a plan_check's config.json and result.json were replaced).
  wd.refuse_foreign_result(out, "bench_async")
  os.makedirs(out, exist_ok=True)
  check_reuse(os.path.join(out, "config.json"), c.to_dict())
  iterations = {r: run_iterations(c.num_iterations, r) for r in c.runs}  # None: unreadable
  wd.write_json(os.path.join(out, "config.json"),
                {**c.to_dict(), "resolved_num_iterations": iterations})
  env = runner.repo_env(JAX_PLATFORMS="cpu", **host_device_env(c.host_devices))
  # `parallel`: the runs at once on this machine, which its step times (median_step_s,
  # step_time_ratio, curves.png's wall-time axis) were measured beside (config.json alone
  # said so); 1 for step times of a run alone.
  result = {"machine": {"host_devices": c.host_devices, "parallel": c.parallel},
            "runs": {}}  # and `provenance`
  jobs = [(config, k, seed) for config in c.runs for k in c.staleness for seed in c.seeds]

  def run(job) -> list[dict]:
    config, k, seed = job
    name = run_name(*job)
    run_dir = os.path.join(out, name)
    overrides = {"seed": seed, "async_ppo.staleness": k,
                 "async_ppo.generation_devices": c.generation_devices,
                 "async_ppo.objective": c.objective}
    if c.num_iterations:
      overrides["num_iterations"] = c.num_iterations
    # A progress line per tenth of the run: its runs' lines interleave (`parallel`), and
    # metrics.jsonl has every iteration anyway (log_every may change on a resume).
    if iterations[config] is not None:
      overrides["log_every"] = max(1, iterations[config] // 10)
    cmd = runner.build_command("train_ppo", config, run_dir, overrides, [])
    logging.info("[%d/%d] %s: %s", jobs.index(job) + 1, len(jobs), name, " ".join(cmd[1:]))
    rc = runner.run_streamed(cmd, run_dir, name, env)
    if rc == 75:  # stopped by a signal after saving: not a failure
      logging.warning("%s stopped after saving (exit 75): the same command resumes it", name)
      return None
    if rc != 0:  # the other runs go on; this config gets no figures (below)
      logging.error("%s failed (exit %d); its log: %s/log.txt", name, rc, run_dir)
      return None
    return wd.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))

  with concurrent.futures.ThreadPoolExecutor(c.parallel) as pool:
    rows = dict(zip(jobs, pool.map(run, jobs)))
  failed = [run_name(*job) for job, r in rows.items() if r is None]
  curves: dict = {}
  for config in c.runs:
    missing = [run_name(*job) for job in jobs if job[0] == config and rows[job] is None]
    if missing:
      result["runs"][config] = {"failed_runs": missing}
      continue
    entry, curves[config] = {}, {}
    for k in c.staleness:
      per_seed = [summarize(rows[config, k, seed], c.window, c.skip, k) for seed in c.seeds]
      s = {key: (float(np.mean([p[key] for p in per_seed])) if per_seed[0][key] is not None
                 else None) for key in per_seed[0]}
      s["reward_gain_per_seed"] = [p["reward_gain"] for p in per_seed]
      if k:
        base = entry["s0"]
        # A ratio over a synchronous run that did not learn says nothing: no ratio, no pass.
        s["gain_ratio"] = (s["reward_gain"] / base["reward_gain"] if base["reward_gain"] > 0
                           else None)
        s["step_time_ratio"] = s["median_step_s"] / base["median_step_s"]
        # (min_gain_ratio 0, the timing variant's: no bar, so no verdict)
        s["gain_ok"] = (s["gain_ratio"] is not None and s["gain_ratio"] >= c.min_gain_ratio
                        if c.min_gain_ratio > 0 else None)
      entry[f"s{k}"] = s
      curves[config][k] = curve([rows[config, k, seed] for seed in c.seeds], c.skip)
      logging.info("%s staleness %d: %s", config, k, describe(s, c.min_gain_ratio, c.parallel))
    result["runs"][config] = entry
  result["failed_runs"] = failed
  result["all_gains_ok"] = (not failed and all(
      s.get("gain_ok", True) for e in result["runs"].values() for s in e.values())
                            if c.min_gain_ratio > 0 else None)
  # Runs side by side (parallel > 1) share the cores unevenly: their step-time ratios compare
  # loads, not asynchrony (one run left alone at the end measured 0.63x).
  result["step_times_comparable"] = c.parallel == 1
  # The runs' devices, not this process's (it imported jax to check their configs, with the
  # caller's XLA_FLAGS: 1 device where each run had host_devices).
  if curves:  # what curves.png draws, kept: `redraw` draws it again from result.json
    result["curves"] = curves_entry(curves, max(1, int(round(
        min(len(v["reward"]) for by_k in curves.values() for v in by_k.values()) *
        c.window))), c.skip, f"{c.host_devices} CPU devices, {c.parallel} run(s) at once")
  runner.write_result(out, result, ran_on={
      "num_devices": c.host_devices, "platform": "cpu", "device_kind": "cpu",
      "num_processes": 1,
      "devices_of": "each train_ppo run (config.host_devices fake CPU devices)"})
  if curves:
    plot_result(result, os.path.join(out, "curves.png"))
  logging.info("wrote %s/result.json%s", out, " and curves.png" if curves else "")
  if not failed and c.min_gain_ratio > 0:
    (logging.info if result["all_gains_ok"] else logging.warning)(
        "acceptance (every asynchronous run's reward gain >= %g x the synchronous one's): %s",
        c.min_gain_ratio, "PASS" if result["all_gains_ok"] else "FAIL")
  elif not failed:
    logging.info("acceptance: not judged (config.min_gain_ratio=0: the runs are timed, their "
                 "learning not compared)")
  if failed:  # re-running the same command resumes them (their finished peers are read back)
    logging.error("%d run(s) failed: %s", len(failed), ", ".join(failed))
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(config_files.run(main))
