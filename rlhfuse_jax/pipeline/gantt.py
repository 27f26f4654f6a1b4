"""Gantt chart of a schedule (devices x time; actor vs critic colours, backward hatched).

The schedule binaries (schedule_search, schedule_cp_check) draw WORKDIR/gantt.png with `draw`,
which keeps its title in WORKDIR/gantt.json; the schedule is WORKDIR/schedule.json, so `redraw`
draws the figure again from those two files alone (at the current layout, or restyled).
"""
from __future__ import annotations

import os
import textwrap
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from rlhfuse_jax import workdir as wd  # noqa: E402
from rlhfuse_jax.pipeline import schedule as schedule_lib  # noqa: E402
from rlhfuse_jax.pipeline.evaluate import peak_over_budget  # noqa: E402
from rlhfuse_jax.pipeline.schedule import Schedule  # noqa: E402

_COLORS = {("actor", "F"): "#8fb8e8", ("actor", "B"): "#2a5fa8",
           ("critic", "F"): "#f4b183", ("critic", "B"): "#c55a11"}


def plot_gantt(schedule: Schedule, path: str, title: Optional[str] = None,
               label_microbatches: bool = False) -> None:
  n = len(schedule.devices)
  width = min(28.0, 8.0 + schedule.makespan / 40.0)
  fig, ax = plt.subplots(figsize=(width, 0.45 * n + 1.6))
  for d, dev in enumerate(schedule.devices):
    # One collection per device and task kind: a bar per task took 37 s for 8 devices x 3072
    # tasks (1024 actor micro-batches), the collections well under a second.
    spans: dict = {}
    for t in dev:
      spans.setdefault((t.model, t.kind), []).append((t.start, t.end - t.start))
      if label_microbatches:
        ax.text((t.start + t.end) / 2, d, str(t.microbatch), ha="center", va="center", fontsize=5)
    for (model, kind), xranges in spans.items():
      ax.broken_barh(xranges, (d - 0.4, 0.8), facecolors=_COLORS[(model, kind)],
                     edgecolor="black", linewidth=0.2, hatch="//" if kind == "B" else None)
  ax.set_ylim(n - 0.5, -0.5)
  ax.set_yticks(range(n))
  ax.set_yticklabels([f"dev {d}" for d in range(n)])
  ax.set_xlim(0, schedule.makespan)
  ax.set_xlabel("time (the problem's units: its forward/backward durations)")
  # Wrapped to the figure's width (about 9 characters an inch at the title's size):
  # schedule_search's title of a small instance ended "peak/budget 1.00 (unifo", cut off.
  ax.set_title(textwrap.fill(title or f"makespan {schedule.makespan:g}", int(9 * width)))
  fig.legend(handles=[Patch(facecolor=c, hatch="//" if k == "B" else None, label=f"{m} {k}")
                      for (m, k), c in _COLORS.items()], loc="lower center", fontsize=7, ncol=4)
  fig.tight_layout(rect=(0, 0.5 / (0.45 * n + 1.6), 1, 1))  # room for the legend below
  fig.savefig(path, dpi=110)
  plt.close(fig)


# The figure's files in a schedule binary's workdir: drawn from SCHEDULE, titled by TITLE's.
PNG, TITLE, SCHEDULE = "gantt.png", "gantt.json", "schedule.json"
_BINARIES = ("schedule_search", "schedule_cp_check")


def search_title(problem, makespan: float, lower_bound: float, serial: float,
                 over_budget: float) -> str:
  """schedule_search's title (`problem`: the PipelineProblem searched)."""
  return (f"fused schedule of Pa/Pc={problem.actor_pp}/{problem.critic_pp} "
          f"Ma/Mc={problem.actor_microbatches}/{problem.critic_microbatches}: "
          f"makespan {makespan:g}, tight LB {lower_bound:g}, serial {serial:g}, peak/budget "
          f"{over_budget:.2f} ({problem.memory_budget_mode})")


def cp_sat_title(makespan: float, lower_bound: float, over_budget: float) -> str:
  """schedule_cp_check's title."""
  return (f"CP-SAT schedule: makespan {makespan:g}, tight LB {lower_bound:g}, "
          f"peak/budget {over_budget:.2f}")


def draw(schedule: Schedule, workdir: str, title: str) -> str:
  """workdir/gantt.png of `schedule` (kept as workdir/schedule.json by the caller) under
  `title`, kept in workdir/gantt.json for `redraw`; returns the PNG's path."""
  wd.write_json(os.path.join(workdir, TITLE), {"title": title, "schedule": SCHEDULE})
  path = os.path.join(workdir, PNG)
  plot_gantt(schedule, path, title=title)
  return path


def redraw(workdir: str) -> str:
  """gantt.png of a finished schedule_search or schedule_cp_check run in `workdir`, drawn
  again from its schedule.json under the title its gantt.json keeps; returns its path. A run
  kept before gantt.json existed (2026-12-07) has its title rebuilt from the figures its
  result.json holds, by the binary's formula (`rebuilt_title`)."""
  sched_path = os.path.join(workdir, SCHEDULE)
  if not os.path.isfile(sched_path):
    raise ValueError(f"{sched_path}: no such file (gantt.png is drawn from the schedule.json "
                     f"of a {' or '.join(_BINARIES)} run; a run that found no schedule writes "
                     "none)")
  sched = schedule_lib.load(sched_path)
  title_path = os.path.join(workdir, TITLE)
  if os.path.exists(title_path):
    title = wd.read_json_object(title_path).get("title")
    if not isinstance(title, str):
      raise ValueError(f"{title_path}: expected {{\"title\": a string}}, got title={title!r}")
  else:
    title = rebuilt_title(workdir, sched)
  path = os.path.join(workdir, PNG)
  plot_gantt(sched, path, title=title)
  return path


def rebuilt_title(workdir: str, sched: Schedule) -> str:
  """The title of a run in `workdir` that kept none (no gantt.json), from the figures its
  result.json holds (schedule_cp_check's makespan, lower_bound, peak_memory and budget;
  schedule_search's searched, lower_bound, serial_1f1b and peak_memory), which must be those of
  `sched` (its schedule.json); a ValueError naming the file otherwise."""
  path = os.path.join(workdir, "result.json")
  if not os.path.exists(path):
    raise ValueError(f"{os.path.join(workdir, TITLE)}: no such file, nor {path} to rebuild "
                     "gantt.png's title from (a run stopped before its end keeps only its "
                     "schedule.json)")
  result = wd.read_json_object(path)
  wrote = wd.written_by(result)
  if wrote not in (None, *_BINARIES):
    raise ValueError(f"{path}: written by experiments.{wrote}, not experiments."
                     f"{' or experiments.'.join(_BINARIES)}")
  peaks = result.get("peak_memory")
  if isinstance(peaks, list) and all(k in result for k in ("makespan", "lower_bound", "budget")):
    makespan = result["makespan"]
    title = cp_sat_title(makespan, result["lower_bound"], peak_over_budget(peaks, result["budget"]))
  elif (isinstance(peaks, dict) and {"searched", "budget"} <= peaks.keys()
        and all(k in result for k in ("searched", "lower_bound", "serial_1f1b"))):
    makespan = result["searched"]
    title = search_title(sched.problem, makespan, result["lower_bound"], result["serial_1f1b"],
                         peak_over_budget(peaks["searched"], peaks["budget"]))
  else:
    raise ValueError(f"{path}: no title to redraw gantt.png with: no {TITLE} beside it, and "
                     "not the figures of one (schedule_cp_check's makespan, lower_bound, "
                     "peak_memory, budget; schedule_search's searched, lower_bound, serial_1f1b, "
                     "peak_memory)")
  if abs(makespan - sched.makespan) > 1e-6:
    raise ValueError(f"{path}: makespan {makespan:g}, but {SCHEDULE}'s is {sched.makespan:g}: "
                     "not the run of that schedule, no title to rebuild from it")
  return title
