"""bench_generation's, bench_async's and reproduce_ablations' result.json keep the data their
PNGs draw, and `redraw(WORKDIR)` draws each PNG again from result.json alone with the same
series (axes, lines, bars and titles compared, not pixels). Before, result.json kept neither an
instance's activity segments, the reward curves nor the simulated timelines and schedules: a
kept result's figure could not be restyled, redrawn at the current layout or set beside another
run's without running the bench (or the whole simulation) again.

The binaries define absl flags, so each is imported in a subprocess; the figures are read where
they are saved (matplotlib's Figure.savefig wrapped)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rlhfuse_jax.generation.timeline import Timeline
from rlhfuse_jax.sim import plots
from tests.xla_env import subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Prepended to a subprocess's code: every figure saved is recorded (each axes' title, labels,
# limits, lines' data and bar spans) in SEEN, then saved as before.
_CAPTURE = """
import json
import os
import matplotlib
matplotlib.use("Agg")
import matplotlib.figure
SEEN = []
_save = matplotlib.figure.Figure.savefig

def _axes(ax):
  return {"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
          "xlim": [float(v) for v in ax.get_xlim()], "ylim": [float(v) for v in ax.get_ylim()],
          "lines": [[l.get_label(), [float(v) for v in l.get_xdata()],
                     [float(v) for v in l.get_ydata()]] for l in ax.get_lines()],
          # broken_barh's bars: (x0, y0, width, height) of each, by collection and colour
          "bars": [[[float(v) for v in c.get_facecolor()[0]],
                    [[float(v) for v in p.get_extents().bounds] for p in c.get_paths()]]
                   for c in ax.collections if len(c.get_facecolor())],
          # imshow's cells (masked: idle) and colour range
          "images": [[im.get_array().filled(-1).tolist(), list(im.get_clim())]
                     for im in ax.get_images()]}

def _record(fig, path, *a, **kw):
  SEEN.append([os.path.basename(str(path)), [_axes(ax) for ax in fig.axes]])
  return _save(fig, path, *a, **kw)

matplotlib.figure.Figure.savefig = _record
"""


def _python(code: str, *args: str, devices=None, timeout: int = 600) -> list:
  """`code` in a fresh interpreter from the repository root; the JSON of its last stdout line."""
  out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO,
                       env=subprocess_env(devices), capture_output=True, text=True,
                       timeout=timeout)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_timeline_reads_back_from_its_json_as_it_was():
  tl = Timeline(num_instances=3, segments=[(0, 0.0, 0.5, "prefill"), (2, 0.25, 1.0, "decode")],
                unfinished_curve=[(0.0, 8), (0.75, 3)],
                consolidations=[{"time_s": 0.5, "step": 4, "moves": 2}], gen_end_s=1.0,
                gen_plus_inf_s=1.5, observed=(0, 2), tagged={"same_host": [(0.5, 0.625)]})
  back = Timeline.from_json(json.loads(json.dumps(tl.to_json())))
  assert back == tl
  assert back.instance_busy_frac == tl.instance_busy_frac
  assert Timeline.from_json(json.loads(json.dumps(
      Timeline(1, [], [], [], 0.0, 0.0).to_json()))) == Timeline(1, [], [], [], 0.0, 0.0)


_BENCH_GENERATION = _CAPTURE + """
import sys
from configs import bench_generation as cb
from experiments import bench_generation as bg
workdir = sys.argv[1]
c = cb.get_config("tiny")
c.repeats = 1
c.generation.migration_threshold = "0.75"
c.lengths.median = 8.0  # a tail long enough to consolidate (test_tiny_bench's setting)
bg.run_and_write(c, workdir)
ran = list(SEEN)
SEEN.clear()
redrawn = bg.redraw(workdir)
print(json.dumps({"ran": ran, "redrawn": SEEN, "paths": redrawn}))
"""


def test_bench_generation_redraws_its_timelines_from_result_json(tmp_path):
  got = _python(_BENCH_GENERATION, str(tmp_path), devices=8)
  with open(tmp_path / "result.json") as f:
    result = json.load(f)
  spec = result["timelines"]
  assert set(spec["panels"]) == {"baseline", "fused"}
  for mode, panel in spec["panels"].items():
    tl = panel["timeline"]
    assert panel["title"] == f"{mode} (median of 1 runs)"
    assert tl["gen_plus_inf_s"] == result[mode]["gen_plus_inf_s"]
    assert {k for _, _, _, k in tl["segments"]} >= {"prefill", "decode", "inference"}
    # the fused run's consolidation is in its timeline (the red line the figure draws)
    assert len(tl["consolidations"]) == len(result[mode]["consolidations"])
  assert spec["panels"]["fused"]["timeline"]["consolidations"], "no consolidation: nothing drawn"
  assert spec["t_max_s"] == max(result[m]["gen_plus_inf_s"] for m in ("baseline", "fused"))
  # The same figures, series for series, drawn from result.json as by the run.
  assert [name for name, _ in got["ran"]] == ["timeline_baseline.png", "timeline_fused.png"]
  assert got["redrawn"] == got["ran"]
  assert got["paths"] == [str(tmp_path / n) for n in ("timeline_baseline.png",
                                                         "timeline_fused.png")]
  # ... and those series are the stored data: the unfinished-sample step curve (right axis).
  for (_, axes), mode in zip(got["ran"], ("baseline", "fused")):
    curve = spec["panels"][mode]["timeline"]["unfinished_curve"]
    steps = [ax["lines"] for ax in axes if ax["ylabel"] == "unfinished samples"][0]
    assert steps[0][1:] == [[t for t, _ in curve], [float(u) for _, u in curve]]
    assert axes[0]["xlim"][1] == spec["t_max_s"] * 1.02
    # every activity segment is a bar (the tiny bench's 2 instances are all drawn)
    segments = spec["panels"][mode]["timeline"]["segments"]
    assert sum(len(bars) for _, bars in axes[0]["bars"]) == len(segments)


_PIPELINED = _CAPTURE + """
import sys
from configs import bench_generation as cb
from experiments import bench_generation as bg
workdir = sys.argv[1]
bg.run_and_write(cb.get_config("pipelined_tiny"), workdir)
ran = list(SEEN)
SEEN.clear()
redrawn = bg.redraw(workdir)
print(json.dumps({"ran": ran, "redrawn": SEEN, "paths": redrawn}))
"""


def test_bench_generation_redraws_a_pipelined_runs_tick_table_from_result_json(tmp_path):
  """schedule_pipelined.png from result.json's decode_table ([stages][ticks] there, as the
  figure's rows): the same cells as the run's."""
  got = _python(_PIPELINED, str(tmp_path), devices=8)
  with open(tmp_path / "result.json") as f:
    result = json.load(f)
  assert [name for name, _ in got["ran"]] == ["schedule_pipelined.png"]
  assert got["redrawn"] == got["ran"] and got["paths"] == [str(tmp_path /
                                                               "schedule_pipelined.png")]
  cells, _ = got["ran"][0][1][0]["images"][0]
  assert cells == result["decode_table"]  # (idle cells, masked, filled with IDLE = -1)
  assert len(cells) == result["stages"]


_BENCH_ASYNC = _CAPTURE + """
import os, re, sys
workdir = sys.argv[1]
sys.argv = ["bench_async", "--config=configs/bench_async.py", f"--workdir={workdir}",
            "--config.staleness=(0,1)", "--config.seeds=(0,1)", "--config.window=0.25",
            "--config.skip=1", "--config.num_iterations=4",
            "--config.runs=('configs/ppo_tiny.py','configs/grpo_tiny.py')"]
from absl import flags
from experiments import bench_async as b

def fake_run(cmd, run_dir, name, env, started=None, prefix=None):
  # each run's rewards and step times from its name: distinct per config, staleness and seed
  stem, k, seed = re.fullmatch(r"(.*)_s(\\d+)_seed(\\d+)", name).groups()
  base = (len(stem) + 3 * int(k) + int(seed)) / 10
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    for i in range(4):
      f.write(json.dumps({"step": i + 1, "reward/mean": base + 0.25 * i * i,
                          "timing_s/step": 9.0 if i == 0 else base + i}) + "\\n")
  return 0

b.runner.run_streamed = fake_run
flags.FLAGS(sys.argv)
assert b.main(["bench_async"]) == 0
ran = list(SEEN)
SEEN.clear()
path = b.redraw(workdir)
print(json.dumps({"ran": ran, "redrawn": SEEN, "path": path}))
"""


def test_bench_async_redraws_its_curves_from_result_json(tmp_path):
  """main's runs faked (test_mutation_gaps_12's way): result.json's `curves` are each config's
  and staleness's seeds' mean reward and elapsed time per iteration, and curves.png drawn from
  them alone is the run's own figure."""
  got = _python(_BENCH_ASYNC, str(tmp_path))
  with open(tmp_path / "result.json") as f:
    curves = json.load(f)["curves"]
  assert curves["width"] == 1 and curves["skip"] == 1
  assert curves["machine"] == "1 CPU devices, 2 run(s) at once"
  assert list(curves["runs"]) == ["configs/ppo_tiny.py", "configs/grpo_tiny.py"]
  for config, by_k in curves["runs"].items():
    stem = os.path.splitext(os.path.basename(config))[0]
    assert list(by_k) == ["0", "1"]
    for k, series in by_k.items():
      bases = [(len(stem) + 3 * int(k) + seed) / 10 for seed in (0, 1)]
      base = sum(bases) / 2
      assert series["reward"] == pytest.approx([base + 0.25 * i * i for i in range(4)])
      # the first step (a compile, 9 s) counted at the median of the others: base + 2
      per_seed = [[b + 2, b + 1, b + 2, b + 3] for b in bases]
      elapsed = [sum(sum(s[:i + 1]) for s in per_seed) / 2 for i in range(4)]
      assert series["elapsed_s"] == pytest.approx(elapsed)
  assert [name for name, _ in got["ran"]] == ["curves.png"]
  assert got["redrawn"] == got["ran"] and got["path"] == str(tmp_path / "curves.png")
  axes = got["ran"][0][1]  # 2 rows x 2 columns, row-major: ppo by iteration, grpo by ...
  ppo_top, ppo_bottom = axes[0], axes[2]
  assert ppo_top["title"] == "configs/ppo_tiny.py (1 CPU devices, 2 run(s) at once)"
  sync = curves["runs"]["configs/ppo_tiny.py"]["0"]
  # (a moving mean of width 1: the reward itself, up to its cumulative sum's rounding)
  label, x, y = ppo_top["lines"][0]
  assert (label, x, y) == ("synchronous", [1.0, 2.0, 3.0, 4.0], pytest.approx(sync["reward"]))
  label, x, y = ppo_bottom["lines"][0]
  assert (label, x, y) == ("synchronous", sync["elapsed_s"], pytest.approx(sync["reward"]))


def test_redraw_names_a_result_without_the_data_or_of_another_binary(tmp_path):
  """A result.json written before the benches kept their data (or of another binary) is
  refused by path and by what it lacks, not with a KeyError."""
  made = {}
  for name, binary in (("gen", "bench_generation"), ("async", "bench_async"),
                       ("other", "bench_decode"), ("abl", "reproduce_ablations")):
    made[name] = tmp_path / name
    made[name].mkdir()
    (made[name] / "result.json").write_text(json.dumps({"runs": {}, "provenance": {
        "command": f"python -m experiments.{binary} --workdir=x"}}))
  # (one binary per process: both define --config; each process reads both its workdirs)
  code = """
import sys
from experiments import {binary} as b
for where in sys.argv[1:]:
  try:
    b.redraw(where)
    print("drawn")
  except ValueError as e:
    print(e)
"""
  said = {}  # (binary, workdir): its line
  for binary, wheres in (("bench_generation", ("gen", "async")),
                         ("bench_async", ("async", "other")),
                         ("reproduce_ablations", ("abl", "gen"))):
    out = subprocess.run([sys.executable, "-c", code.format(binary=binary),
                          *(str(made[where]) for where in wheres)], cwd=REPO,
                         env=subprocess_env(None), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()[-2:]
    said.update({(binary, where): line for where, line in zip(wheres, lines, strict=True)})
  gen, asy, abl = "bench_generation", "bench_async", "reproduce_ablations"
  assert said[gen, "gen"].startswith(f"{made['gen']}/result.json: no `timelines` ("), said
  assert said[asy, "async"].startswith(f"{made['async']}/result.json: no `curves` ("), said
  assert said[gen, "async"] == (f"{made['async']}/result.json: written by "
                                "experiments.bench_async, not experiments.bench_generation"), said
  assert said[asy, "other"] == (f"{made['other']}/result.json: written by "
                                "experiments.bench_decode, not experiments.bench_async"), said
  assert said[abl, "abl"].startswith(f"{made['abl']}/result.json: no `figures` ("), said
  assert said[abl, "gen"] == (f"{made['gen']}/result.json: written by "
                              "experiments.bench_generation, not experiments.reproduce_ablations"
                              ), said


_ROUNDED = """
import json
import numpy as np
from experiments import bench_async as b
entry = b.curves_entry({"c": {0: {"reward": np.float32([1 / 3, 2 / 3, 0.1]),
                                  "elapsed_s": np.array([0.1 + 0.2, 123.456789012, 1e-9])}}},
                       40)
print(json.dumps(entry))
"""


def test_bench_async_keeps_its_curves_to_a_float32_rewards_digits():
  """A curve's values to 7 significant digits (a float32 reward's; 10 us of a 100 s wall
  time): their 17-digit reprs made the default run's `curves` 95 kB."""
  entry = _python(_ROUNDED)
  assert entry["runs"]["c"]["0"] == {"reward": [0.3333333, 0.6666667, 0.1],
                                     "elapsed_s": [0.3, 123.4568, 1e-9]}


KEPT_ASYNC = os.path.join(REPO, "experiments", "results", "async_ppo_learning")

_REDRAW_KEPT = _CAPTURE + """
import sys
from experiments import bench_async as b
b.redraw(sys.argv[1])
print(json.dumps(SEEN))
"""


def test_the_kept_async_learning_result_is_compact_and_every_reader_still_reads_it(tmp_path):
  """async_ppo_learning/result.json was 157 kB, a line per float; rewritten in write_json's
  layout with its curves to 7 digits (not re-run) it is 55 kB. Its README's table still reads
  from it, its curves still give the gains it reports, and it still redraws (in a copy: the
  run's own curves.png stays)."""
  path = os.path.join(KEPT_ASYNC, "result.json")
  with open(path) as f:
    text = f.read()
  result = json.loads(text)
  from rlhfuse_jax import workdir as wd
  assert text == wd.dumps_json(result) + "\n" and len(text) < 60_000
  width = result["curves"]["width"]
  with open(os.path.join(KEPT_ASYNC, "README.md")) as f:
    table = [line for line in f if line.startswith("| ppo_tiny |") or
             line.startswith("| grpo_tiny |")]
  assert len(table) == 2
  for line in table:
    name = line.split("|")[1].strip()
    runs = result["runs"][f"configs/{name}.py"]
    s0, s1, s2 = runs["s0"], runs["s1"], runs["s2"]
    shown = (f"| {name} | {s0['reward_gain']:.3f} ("
             + ", ".join(f"{g:.3f}" for g in s0["reward_gain_per_seed"])
             + f") | {s1['reward_gain']:.3f} ({s1['gain_ratio']:.3f}) | "
             f"{s2['reward_gain']:.3f} ({s2['gain_ratio']:.3f}) |")
    assert line.strip() == shown
    for k, s in enumerate((s0, s1, s2)):  # the seeds' mean curve gives the seeds' mean gain
      reward = result["curves"]["runs"][f"configs/{name}.py"][str(k)]["reward"]
      gain = (sum(reward[-width:]) - sum(reward[:width])) / width
      assert gain == pytest.approx(s["reward_gain"], abs=1e-7)
  (tmp_path / "result.json").write_text(text)
  seen = _python(_REDRAW_KEPT, str(tmp_path))
  assert [name for name, _ in seen] == ["curves.png"]
  axes = seen[0][1]
  assert len(axes) == 4 and all(len(ax["lines"]) == 3 for ax in axes)
  sync = result["curves"]["runs"]["configs/ppo_tiny.py"]["0"]
  assert axes[2]["lines"][0][1] == sync["elapsed_s"]  # (the bottom row: against wall time)


_ABLATIONS = _CAPTURE + """
import sys
workdir = sys.argv[1]
sys.argv = ["reproduce_ablations", "--config=configs/ablations.py:quick", f"--workdir={workdir}",
            "--config.sim.search_time_s=0.3",
            "--config.systems=rlhfuse_base,inter_stage,intra_stage"]
from absl import flags
from experiments import reproduce_ablations as ra
flags.FLAGS(sys.argv)
ra.main(["reproduce_ablations"])
ran = list(SEEN)
SEEN.clear()
redrawn = ra.redraw(workdir)
print(json.dumps({"ran": ran, "redrawn": SEEN, "paths": redrawn}))
"""


def test_reproduce_ablations_redraws_its_figures_from_result_json(tmp_path):
  """The simulated generation timelines and pipeline schedules were kept nowhere: the
  figures of a kept run could only be had by running the whole simulation again (the fused
  schedule, of a wall-clock-limited search, not even then). Now result.json's `figures` holds
  what they draw, the run draws them from it, and `redraw` draws the same series."""
  got = _python(_ABLATIONS, str(tmp_path))
  with open(tmp_path / "result.json") as f:
    result = json.load(f)
  names = ["iteration_time.png", "generation_timeline.png", "fused_gantt.png"]
  assert [name for name, _ in got["ran"]] == names
  assert got["redrawn"] == got["ran"] and got["paths"] == [str(tmp_path / n) for n in names]
  rows = {r["system"]: r for r in result["rows"]}
  figures = result["figures"]
  assert figures["iteration_time"] == {"systems": ["rlhfuse_base", "inter_stage",
                                                   "intra_stage"], "machine": "64 x h100_sxm"}
  # The timelines are the simulated generations of the rows they stand for ...
  panels = figures["generation_timeline"]["panels"]
  assert figures["generation_timeline"]["setting"] == "13B/13B L=512"
  for panel, system in zip(panels, ("rlhfuse_base", "inter_stage")):
    assert panel["title"].endswith(f"({system})")
    assert panel["timeline"]["gen_end_s"] == rows[system]["gen_s"]
    assert panel["timeline"]["gen_plus_inf_s"] == rows[system]["gen_plus_inf_s"]
  # ... each of its spans a bar, its curve the right axis's line
  timeline_axes = [axes for name, axes in got["ran"] if name == names[1]][0]
  n = len(panels)  # (the panels' axes, then their right axes: twinx adds each at the end)
  assert len(timeline_axes) == 2 * n
  for panel, ax, curve_ax in zip(panels, timeline_axes[:n], timeline_axes[n:]):
    spans = panel["timeline"]["spans"]
    assert set(spans) >= {"prefill", "decode", "inference"}
    assert sum(len(bars) for _, bars in ax["bars"]) == sum(len(c["start"])
                                                           for c in spans.values())
    assert curve_ax["lines"][0][1:] == [panel["timeline"]["unfinished"]["t_s"],
                                        panel["timeline"]["unfinished"]["samples"]]
  # The schedules are the rows' pipelines: every task of each model and kind, at its time.
  fused, serial = figures["fused_gantt"]["panels"]
  train = rows["intra_stage"]["details"]["train"]
  problem = train["problem"]
  assert fused["schedule"]["makespan"] == train["pipeline_ms"]
  assert serial["schedule"]["makespan"] == rows["rlhfuse_base"]["details"]["train"][
      "pipeline_ms"]
  for panel in (fused, serial):
    tasks = panel["schedule"]["tasks"]
    assert set(tasks) == {"actor F", "actor B", "critic F", "critic B"}
    for key, columns in tasks.items():
      model, kind = key.split()
      assert len(columns["start"]) == (problem[f"{model}_pp"] *
                                       problem[f"{model}_microbatches"])
      pass_ = "fwd" if kind == "F" else "bwd"
      assert columns["width"] == [pytest.approx(problem[f"{model}_{pass_}"], abs=1e-3)]


def _pixels(path) -> np.ndarray:
  import matplotlib.image
  return matplotlib.image.imread(str(path))


def test_a_timeline_and_a_schedule_read_back_from_their_data_as_drawn(tmp_path):
  """timeline_data keeps a generation's spans by kind (touching ones as one bar), its curve
  and consolidations; schedule_data a schedule's tasks by model and kind (one width where all
  share it). Read back, at full precision they draw the very same pixels; at the figure's
  6 significant digits every time is within half a millionth of the axis."""
  import types
  from rlhfuse_jax.pipeline import schedule as schedule_lib, schedules
  from rlhfuse_jax.pipeline.graph import PipelineProblem
  segments = [(0, 0.0, 0.25, "prefill"), (0, 0.25, 1.0 / 3, "decode"),
              (0, 1.0 / 3, 0.75, "decode"), (1, 0.5, 0.625, "decode"), (0, 0.8, 0.9, "decode"),
              (1, 0.625, 0.7, "migrate"), (1, 0.7, 1.2, "inference")]
  res = types.SimpleNamespace(
      segments=segments, unfinished_curve=[(0.0, 4), (0.75, 1), (0.9, 0)],
      consolidations=[{"time_s": 0.625, "moves": 1}], gen_end_s=0.9, gen_plus_inf_s=1.2,
      instance_busy_frac=0.8123456789)
  d = json.loads(json.dumps(plots.timeline_data(res, 12)))
  assert d["spans"]["decode"] == {"instance": [0, 0, 1], "start": [0.25, 0.8, 0.5],
                                  "width": [0.5, pytest.approx(0.1), 0.125]}
  back = plots.timeline_from_data(d)
  assert sorted(back.segments) == sorted([(0, 0.0, 0.25, "prefill"), (0, 0.25, 0.75, "decode"),
                                          (0, 0.8, 0.9, "decode"), (1, 0.5, 0.625, "decode"),
                                          (1, 0.625, 0.7, "migrate"),
                                          (1, 0.7, 1.2, "inference")])
  assert back.unfinished_curve == res.unfinished_curve
  assert back.consolidations == [{"time_s": 0.625}]
  assert (back.gen_end_s, back.gen_plus_inf_s, back.instance_busy_frac) == (0.9, 1.2,
                                                                            0.8123456789)
  plots.plot_generation_timelines([("t", res)], str(tmp_path / "a.png"), setting="s")
  plots.plot_generation_timelines([("t", back)], str(tmp_path / "b.png"), setting="s")
  assert (_pixels(tmp_path / "a.png") == _pixels(tmp_path / "b.png")).all()
  decimals = plots.time_decimals(1.2)
  assert decimals == 5
  res.consolidations = [{"time_s": 2 / 3}]
  rounded = plots.timeline_data(res, decimals)
  assert rounded["consolidations_s"] == [0.66667]
  assert rounded["spans"]["decode"]["width"] == [0.5, 0.1, 0.125]  # (0.9 - 0.8: 0.0999...98)
  problem = PipelineProblem(actor_pp=4, critic_pp=2, actor_microbatches=8,
                            critic_microbatches=4, actor_fwd=2.459148, critic_fwd=2.453499,
                            actor_bwd=3.869188, critic_bwd=3.857889, transfer_latency=0.053843)
  sched = schedule_lib.from_order(problem, schedules.serial_order(problem))
  d = json.loads(json.dumps(plots.schedule_data(sched, 12)))
  assert d["devices"] == len(sched.devices) and d["makespan"] == sched.makespan
  count = {k: sum(f"{t.model} {t.kind}" == k for dev in sched.devices for t in dev)
           for k in ("actor F", "actor B", "critic F", "critic B")}
  assert count["actor F"] == 32 and count["critic F"] == 16  # (the critic's 2 replicas)
  assert {k: (len(c["start"]), c["width"]) for k, c in d["tasks"].items()} == {
      "actor F": (count["actor F"], [2.459148]), "actor B": (count["actor B"], [3.869188]),
      "critic F": (count["critic F"], [2.453499]), "critic B": (count["critic B"], [3.857889])}
  back = plots.schedule_from_data(d)
  for drawn, dev in zip(back.devices, sched.devices, strict=True):
    drawn, dev = (sorted((t.model, t.kind, t.start, t.end) for t in tasks)
                  for tasks in (drawn, dev))
    assert [t[:2] for t in drawn] == [t[:2] for t in dev]
    assert [t[2:] for t in drawn] == [pytest.approx(t[2:], abs=1e-9) for t in dev]
  plots.plot_schedules([("s", sched)], str(tmp_path / "a.png"))
  plots.plot_schedules([("s", back)], str(tmp_path / "b.png"))
  assert (_pixels(tmp_path / "a.png") == _pixels(tmp_path / "b.png")).all()
  d["tasks"]["actor B"]["width"] = [1.0, 2.0]
  with pytest.raises(ValueError, match=r"^tasks\.actor B: 32 devices, 32 starts and 2 widths: "
                                       r"expected as many of each \(or one width\)$"):
    plots.schedule_from_data(d)


KEPT_ABLATIONS = os.path.join(REPO, "experiments", "results", "ablations_2026-12-06")


def test_the_kept_chunk_steps_results_redraw_from_their_figures(tmp_path):
  """ablations_2026-12-06/chunk_steps_K/ were re-run (2026-12-07, the same rows) to keep
  `figures`: their PNGs redraw from result.json alone (in a copy), the timelines those of
  the rows they stand for. (All three in one process: reproduce_ablations' import is 2 s.)"""
  results = {}
  for k in (1, 8, 16):
    with open(os.path.join(KEPT_ABLATIONS, f"chunk_steps_{k}", "result.json")) as f:
      text = f.read()
    results[k] = json.loads(text)
    (tmp_path / str(k)).mkdir()
    (tmp_path / str(k) / "result.json").write_text(text)
  code = _CAPTURE + """
import sys
from experiments import reproduce_ablations as ra
got = []
for where in sys.argv[1:]:
  SEEN.clear()
  got.append({"paths": ra.redraw(where), "seen": list(SEEN)})
print(json.dumps(got))
"""
  drawn = _python(code, *(str(tmp_path / str(k)) for k in results))
  for (k, result), got in zip(results.items(), drawn, strict=True):
    names = ["iteration_time.png", "generation_timeline.png"]
    assert got["paths"] == [str(tmp_path / str(k) / n) for n in names]
    assert [name for name, _ in got["seen"]] == names
    rows = {r["system"]: r for r in result["rows"]}
    panels = result["figures"]["generation_timeline"]["panels"]
    for panel, system in zip(panels, ("rlhfuse_base", "inter_stage")):
      assert panel["timeline"]["gen_plus_inf_s"] == rows[system]["gen_plus_inf_s"]
    timeline_axes = got["seen"][1][1]
    assert f"gen+inf {rows['inter_stage']['gen_plus_inf_s']:.3g}s" in timeline_axes[1]["title"]


# iteration_time.png as drawn: the figure's heading, each panel's title, systems, bar labels
# and bars (x, bottom, height), then saved as before.
_BARS = """
import json
import sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.figure
SEEN = []
_save = matplotlib.figure.Figure.savefig

def _record(fig, path, *a, **kw):
  SEEN.append({"heading": fig._suptitle.get_text() if fig._suptitle else None, "panels": [
      [ax.get_title(), [t.get_text() for t in ax.get_xticklabels()],
       [t.get_text() for t in ax.texts],
       [[float(p.get_x()), float(p.get_y()), float(p.get_height())] for p in ax.patches]]
      for ax in fig.axes if ax.get_title()]})
  return _save(fig, path, *a, **kw)

matplotlib.figure.Figure.savefig = _record
from experiments import reproduce_ablations as ra
got = []
for where in sys.argv[1:]:
  SEEN.clear()
  got.append({"paths": ra.redraw(where), "seen": list(SEEN)})
print(json.dumps(got))
"""


def test_a_result_kept_without_figures_redraws_its_iteration_times_from_its_rows(tmp_path):
  """A reproduce_ablations result written before 2026-12-07 keeps no `figures`, but its rows
  are iteration_time.png's bars and name the systems and the cluster: redraw draws that PNG
  (it refused the whole folder); the timelines and schedules were never kept. Checked on
  chunk_steps_1, whose kept `figures` must give the same figure, and on ablations_2026-12-05."""
  with open(os.path.join(KEPT_ABLATIONS, "chunk_steps_1", "result.json")) as f:
    result = json.load(f)
  full, bare = tmp_path / "full", tmp_path / "bare"
  for where, kept in ((full, result), (bare, {k: v for k, v in result.items()
                                              if k != "figures"})):
    where.mkdir()
    (where / "result.json").write_text(json.dumps(kept))
  old = tmp_path / "old"
  old.mkdir()
  with open(os.path.join(REPO, "experiments", "results", "ablations_2026-12-05",
                         "result.json")) as f:
    rows = json.load(f)["rows"]
  (old / "result.json").write_text(json.dumps({"rows": rows}))
  # (the three in one process: reproduce_ablations' import is 2 s)
  out = subprocess.run([sys.executable, "-c", _BARS, str(full), str(bare), str(old)], cwd=REPO,
                       env=subprocess_env(None), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  got_full, got_bare, got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got_bare["paths"] == [str(bare / "iteration_time.png")]
  assert got_bare["seen"] == got_full["seen"][:1]
  assert (_pixels(bare / "iteration_time.png") == _pixels(full / "iteration_time.png")).all()
  assert (f"{old}/result.json: no `figures` (written before 2026-12-07): iteration_time.png "
          "alone, from its rows" in out.stderr), out.stderr[-3000:]
  figure, = got["seen"]
  assert figure["heading"] == "simulated iteration time on 256 x h100_sxm"
  labels = list(dict.fromkeys(r["setting"]["label"] for r in rows))
  systems = list(dict.fromkeys(r["system"] for r in rows))
  assert [p[0] for p in figure["panels"]] == labels and len(labels) == 12
  for title, ticks, texts, _ in figure["panels"]:
    assert ticks == systems
    # each bar's label: its row's stages stacked (pipe_rlhf_async's: its iteration time)
    assert texts == [f"{r['iteration_s']:.1f}" for r in rows if r["setting"]["label"] == title]


_BENCH_DECODE_PLOT = _CAPTURE + """
import sys
from experiments import bench_decode as bd
for path in sys.argv[2:]:
  with open(path) as f:
    bd.plot(json.load(f), os.path.join(sys.argv[1], "bench_decode.png"))
print(json.dumps(SEEN))
"""


def test_bench_decode_redraws_a_kept_result_with_the_bytes_it_counted(tmp_path):
  """bench_decode.png's bandwidth axis said "weights + live KV" whatever the result counted:
  h100_bench_decode_1b's (2026-11-23) counted the whole cache every step, as its
  bytes_per_step_formula and its own PNG say, and its redraw mislabelled it."""
  results = os.path.join(REPO, "experiments", "results")
  kept = [os.path.join(results, d, "result.json") for d in (
      "h100_bench_decode_1b", "h200_2026-12-04/bench", "cpu_bench_decode_tiny")]
  seen = _python(_BENCH_DECODE_PLOT, str(tmp_path), *kept)
  labels = [axes[1]["ylabel"] for _, axes in seen]
  assert labels == ["GB/s (weights + full KV cache per step)",
                    "GB/s (weights + live KV per step)", "GB/s (weights + live KV per step)"]
  with open(kept[0]) as f:
    per_batch = json.load(f)["decode"]["per_batch"]
  assert seen[0][1][1]["lines"][0][2] == [r["achieved_bw_bytes_per_s"] / 1e9 for r in per_batch]
