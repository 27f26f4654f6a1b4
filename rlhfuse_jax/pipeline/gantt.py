"""Gantt chart of a schedule (devices x time; actor vs critic colours, backward hatched)."""
from __future__ import annotations

import textwrap
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

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
