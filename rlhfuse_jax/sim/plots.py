"""Figures of the simulator: iteration time per system and setting, generation timelines.

What a timeline or Gantt figure draws is also kept as JSON (`timeline_data`, `schedule_data`:
reproduce_ablations' result.json), and drawn again from it (`timeline_from_data`,
`schedule_from_data`), without the simulation that made it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

_KIND_COLORS = {"prefill": "#9e9e9e", "decode": "#2a5fa8", "migrate": "#d62728",
                "load": "#ffbf00", "inference": "#2ca02c"}


def plot_iteration_times(rows: Sequence[dict], systems: Sequence[str], path: str,
                         cols: int = 3, machine: str = "") -> None:
  """One panel per setting: each system's iteration time stacked by stage (linear scale; a bar
  far above the others is clipped and labelled with its value). A row whose stages overlap
  (iteration_s below their sum: pipe_rlhf_async) stands generation + inference and training
  side by side on its reshard. `machine` (e.g. "64 x h100_sxm") heads the figure: the times
  are the simulator's for that cluster."""
  labels = []
  for r in rows:
    if r["setting"]["label"] not in labels:
      labels.append(r["setting"]["label"])
  by = {(r["setting"]["label"], r["system"]): r for r in rows}
  cols = max(1, min(cols, len(labels)))  # one setting: one panel, not a third of the figure
  n_rows = -(-len(labels) // cols)
  fig, axes = plt.subplots(n_rows, cols, figsize=(4.2 * cols, 3.0 * n_rows), squeeze=False)
  parts = (("reshard_s", "#bbbbbb", "reshard"), ("gen_s", "#2a5fa8", "generation"),
           ("inf_s", "#2ca02c", "inference (exposed)"), ("train_s", "#c55a11", "training"))
  overlapped = False
  for ax, lab in zip(axes.flat, labels):
    totals = [by[(lab, s)]["iteration_s"] for s in systems if (lab, s) in by]
    typical = sorted(totals)[len(totals) // 2]
    top = min(max(totals), 2.0 * typical) * 1.15
    for j, s in enumerate(systems):
      if (lab, s) not in by:
        continue
      r, bottom = by[(lab, s)], 0.0
      if r["iteration_s"] < sum(r[k] for k, _, _ in parts) - 1e-9:
        # Overlapped groups (pipe_rlhf_async): generation + inference beside training, both
        # above the reshard.
        ax.bar(j, r["reshard_s"], color=parts[0][1], width=0.75)
        for key, color, _ in parts[1:3]:
          ax.bar(j - 0.19, r[key], bottom=r["reshard_s"] + bottom, color=color, width=0.37)
          bottom += r[key]
        ax.bar(j + 0.19, r["train_s"], bottom=r["reshard_s"], color=parts[3][1], width=0.37)
        bottom = r["iteration_s"]
        overlapped = True
      else:
        for key, color, _ in parts:
          ax.bar(j, r[key], bottom=bottom, color=color, width=0.75)
          bottom += r[key]
      ax.text(j, min(bottom, top * 0.97), f"{bottom:.1f}", ha="center", va="bottom" if
              bottom < top else "top", fontsize=6, fontweight="bold" if bottom > top else None)
    ax.set_ylim(0, top)
    ax.set_xticks(range(len(systems)))
    ax.set_xticklabels(systems, fontsize=6, rotation=35, ha="right")  # the table's names
    ax.set_title(lab, fontsize=9)
    ax.set_ylabel("iteration (s)", fontsize=7)
    ax.tick_params(axis="y", labelsize=7)
  for ax in list(axes.flat)[len(labels):]:
    ax.axis("off")
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c, _ in parts]
  names = [n for _, _, n in parts]
  if overlapped:  # pipe_rlhf_async's two half-width bars are not a broken stack
    handles.append(plt.Rectangle((0, 0), 1, 1, color="none"))
    names.append("half-width bars side by side: at once (async)")
  head = f"simulated iteration time{f' on {machine}' if machine else ''}"
  if cols == 1:  # one panel: the legend beside it (above, it covered the panel's title)
    fig.suptitle(head, fontsize=9)
    fig.tight_layout()
    fig.legend(handles, names, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
  else:  # its row (about 0.35 in) above the panels' titles, whatever the figure's height
    fig.suptitle(head, fontsize=9, y=1.0)
    fig.legend(handles, names, loc="upper center", ncol=len(names), fontsize=8,
               bbox_to_anchor=(0.5, 1 - 0.3 / fig.get_figheight()))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.65 / fig.get_figheight()))
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def _legend_below(fig, handles, labels) -> None:
  """One row of legend under the panels, outside every axes: inside the first panel it hid
  the bars it sat on (an instance's inference, a device's last backward passes)."""
  fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7, frameon=False)
  fig.tight_layout(rect=(0, 0.3 / fig.get_figheight(), 1, 1))  # 0.3 in for the legend row


def plot_generation_timelines(results: Sequence[tuple[str, object]], path: str,
                              max_instances: int = 64, setting: str = "",
                              t_max: Optional[float] = None, note: str = "") -> None:
  """One panel per (title, GenResult): each instance's activity over time, and the number of
  unfinished samples (right axis). `setting` (e.g. "65B/65B L=2048") heads each panel's title:
  the figure shows one setting of a run of many. `t_max`: the time axis's end (default the
  longest result's), for figures drawn apart that are compared; `note`: a second title line
  (what the instances drawn are of). Instances past `max_instances` are not drawn, which the
  panel's title says."""
  fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.6 * len(results)), squeeze=False)
  t_max = t_max or max(r.gen_plus_inf_s for _, r in results)
  for ax, (title, res) in zip(axes[:, 0], results):
    groups: dict = {}  # (instance, kind) -> [(start, width)]: one artist per group is fast
    for inst, start, end, kind in res.segments:
      if inst < max_instances:
        groups.setdefault((inst, kind), []).append((start, end - start))
    for (inst, kind), spans in groups.items():
      ax.broken_barh(spans, (inst - 0.42, 0.84), facecolors=_KIND_COLORS[kind], linewidth=0)
    ax.set_ylabel("instance")
    ax.set_xlim(0, t_max * 1.02)
    total = 1 + max(s[0] for s in res.segments)
    n = min(max_instances, total)
    ax.set_ylim(n - 0.5, -0.5)
    # whole instances only (2 instances read -0.50, -0.25, ..., 1.50)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.axvline(res.gen_end_s, color="black", linestyle="--", linewidth=0.8)
    ax2 = ax.twinx()
    t, u = zip(*res.unfinished_curve)
    ax2.step(t, u, where="post", color="black", linewidth=1.2)
    ax2.set_ylabel("unfinished samples")
    ax2.set_ylim(0, max(u) * 1.05)
    for c in res.consolidations:
      ax.axvline(c["time_s"], color=_KIND_COLORS["migrate"], linewidth=1.0)
    head = f"{setting}, {title}" if setting else title
    # (3 significant digits: a CPU run's 0.0046 s read "0.00s"; instances past max_instances
    # were left out without a word, while the curve and busy counted them all)
    cut = f"; instances 0-{n - 1} of {total} drawn" if n < total else ""
    ax.set_title(f"{head}: generation ends {res.gen_end_s:.3g}s (dashed), gen+inf "
                 f"{res.gen_plus_inf_s:.3g}s, busy {res.instance_busy_frac:.0%}{cut}"
                 + (f"\n{note}" if note else ""), fontsize=9)
  axes[-1, 0].set_xlabel("time (s)")
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _KIND_COLORS.values()]
  _legend_below(fig, handles, list(_KIND_COLORS))
  fig.savefig(path, dpi=110)
  plt.close(fig)


_TASK_COLORS = {("actor", "F"): "#8fb8e8", ("actor", "B"): "#2a5fa8",
                ("critic", "F"): "#f4b183", ("critic", "B"): "#c55a11"}


def plot_schedules(panels: Sequence[tuple[str, object]], path: str) -> None:
  """Gantt charts of pipeline Schedules (rlhfuse_jax.pipeline.schedule), one panel each, on a
  common time axis; one broken_barh artist per (device, model, kind) keeps large schedules fast
  (same colours as pipeline.gantt: actor blue, critic orange, backward darker)."""
  fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                           figsize=(12, sum(0.3 * len(s.devices) + 1.2 for _, s in panels)))
  t_max = max(s.makespan for _, s in panels)
  for ax, (title, sched) in zip(axes[:, 0], panels):
    for d, dev in enumerate(sched.devices):
      groups: dict = {}
      for t in dev:
        groups.setdefault((t.model, t.kind), []).append((t.start, t.end - t.start))
      for key, spans in groups.items():
        ax.broken_barh(spans, (d - 0.4, 0.8), facecolors=_TASK_COLORS[key], edgecolor="black",
                       linewidth=0.15)
    n = len(sched.devices)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"dev {d}" for d in range(n)], fontsize=6)
    ax.set_xlim(0, t_max * 1.01)
    ax.set_title(title, fontsize=9)
  axes[-1, 0].set_xlabel("time (ms)")
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _TASK_COLORS.values()]
  _legend_below(fig, handles, [f"{m} {k}" for m, k in _TASK_COLORS])
  fig.savefig(path, dpi=110)
  plt.close(fig)


def time_decimals(t_max: float) -> int:
  """Decimal places that keep 6 significant digits of a time axis ending at `t_max`: what the
  kept figure data is rounded to (a millionth of the axis, far below a pixel)."""
  return 6 if not t_max > 0 else max(0, 5 - math.floor(math.log10(t_max)))


def _columns(spans: Sequence[tuple[int, float, float]], decimals: int, row: str) -> dict:
  """{row: [...], "start": [...], "width": [...]} of (row, start, end) spans, times rounded to
  `decimals`; "width" holds one value when every span has it (a pipeline's tasks of one model
  and kind)."""
  width = [round(float(e) - float(s), decimals) for _, s, e in spans]
  return {row: [int(r) for r, _, _ in spans],
          "start": [round(float(s), decimals) for _, s, _ in spans],
          "width": width[:1] if len(set(width)) == 1 else width}


def _spans(columns: dict, row: str, what: str) -> list[tuple[int, float, float]]:
  """_columns' (row, start, end) spans back; a ValueError naming `what` when the columns'
  lengths disagree."""
  rows, start, width = columns[row], columns["start"], columns["width"]
  if len(width) == 1:
    width = width * len(start)
  if not len(rows) == len(start) == len(width):
    raise ValueError(f"{what}: {len(rows)} {row}s, {len(start)} starts and "
                     f"{len(columns['width'])} widths: expected as many of each (or one width)")
  return [(r, s, s + w) for r, s, w in zip(rows, start, width)]


@dataclasses.dataclass(frozen=True)
class DrawnTimeline:
  """What plot_generation_timelines reads of a simulated generation (a GenResult), as
  timeline_from_data gives it back."""
  segments: list  # [(instance, start_s, end_s, kind)]
  unfinished_curve: list  # [(t_s, unfinished samples)]
  consolidations: list  # [{"time_s": t}]
  gen_end_s: float
  gen_plus_inf_s: float
  instance_busy_frac: float


def timeline_data(res, decimals: int) -> dict:
  """What plot_generation_timelines draws of `res` (a GenResult), as JSON values: the titles'
  figures as they are; times drawn (activity spans by kind, the unfinished-sample curve, the
  consolidations' lines) rounded to `decimals` (time_decimals of the figure's axis). The spans
  of one kind on one instance that touch (each decode chunk starts where the last ended: 93 %
  of a paper-scale run's segments) are kept as one, the bar they drew edge to edge."""
  by_kind: dict = {}  # kind -> [[instance, start, end]], by instance then start
  for inst, start, end, kind in sorted(res.segments, key=lambda s: (s[3], s[0], s[1])):
    spans = by_kind.setdefault(kind, [])
    if spans and spans[-1][0] == inst and start == spans[-1][2]:
      spans[-1][2] = end
    else:
      spans.append([inst, start, end])
  return {"gen_end_s": float(res.gen_end_s), "gen_plus_inf_s": float(res.gen_plus_inf_s),
          "instance_busy_frac": float(res.instance_busy_frac),
          "consolidations_s": [round(float(c["time_s"]), decimals) for c in res.consolidations],
          "unfinished": {"t_s": [round(float(t), decimals) for t, _ in res.unfinished_curve],
                         "samples": [int(u) for _, u in res.unfinished_curve]},
          "spans": {kind: _columns(spans, decimals, "instance")
                    for kind, spans in by_kind.items()}}


def timeline_from_data(d: dict) -> DrawnTimeline:
  """The DrawnTimeline of timeline_data's `d` (as json.load reads it back)."""
  return DrawnTimeline(
      segments=[(i, s, e, kind) for kind, columns in d["spans"].items()
                for i, s, e in _spans(columns, "instance", f"spans.{kind}")],
      unfinished_curve=list(zip(d["unfinished"]["t_s"], d["unfinished"]["samples"])),
      consolidations=[{"time_s": t} for t in d["consolidations_s"]],
      gen_end_s=d["gen_end_s"], gen_plus_inf_s=d["gen_plus_inf_s"],
      instance_busy_frac=d["instance_busy_frac"])


@dataclasses.dataclass(frozen=True)
class DrawnTask:
  model: str
  kind: str
  start: float
  end: float


@dataclasses.dataclass(frozen=True)
class DrawnSchedule:
  """What plot_schedules reads of a pipeline Schedule, as schedule_from_data gives it back."""
  devices: tuple  # [device][task]: DrawnTask
  makespan: float


def schedule_data(sched, decimals: int) -> dict:
  """What plot_schedules draws of `sched` (a pipeline Schedule), as JSON values: the makespan
  as it is, and the spans of each model and kind's tasks ("actor F": device, start, width;
  times rounded to `decimals`, time_decimals of the axis; one width where all share it)."""
  tasks: dict = {}
  for d, dev in enumerate(sched.devices):
    for t in dev:
      tasks.setdefault(f"{t.model} {t.kind}", []).append((d, t.start, t.end))
  return {"makespan": float(sched.makespan), "devices": len(sched.devices),
          "tasks": {key: _columns(spans, decimals, "device") for key, spans in tasks.items()}}


def schedule_from_data(d: dict) -> DrawnSchedule:
  """The DrawnSchedule of schedule_data's `d` (as json.load reads it back)."""
  devices: list = [[] for _ in range(d["devices"])]
  for key, columns in d["tasks"].items():
    model, kind = key.split(" ")
    for dev, s, e in _spans(columns, "device", f"tasks.{key}"):
      devices[dev].append(DrawnTask(model, kind, s, e))
  return DrawnSchedule(devices=tuple(tuple(dev) for dev in devices), makespan=d["makespan"])
