"""pipeline/gantt.py's redraw: a schedule binary's gantt.png drawn again from its schedule.json
and the title it kept (gantt.json), or, for a run kept before titles were (the 16 kept CP-SAT
folders of experiments/results/), the title rebuilt from its result.json; a folder without
what it needs is refused naming the file."""
import json
import os
import shutil

import pytest

from rlhfuse_jax.pipeline import gantt, schedules
from rlhfuse_jax.pipeline import schedule as schedule_lib
from rlhfuse_jax.pipeline.graph import PipelineProblem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tiny(workdir):
  """A 2x2-stage serial schedule kept as workdir/schedule.json; returns it."""
  p = PipelineProblem(actor_pp=2, critic_pp=2, actor_microbatches=2, critic_microbatches=2,
                      actor_fwd=2.0, critic_fwd=1.0)
  sched = schedule_lib.from_order(p, schedules.serial_order(p))
  (workdir / "schedule.json").write_text(sched.to_json() + "\n")
  return sched


@pytest.fixture
def titles(monkeypatch):
  """The titles plot_gantt is called with, the PNGs still written."""
  seen = []
  plot = gantt.plot_gantt

  def spy(sched, path, title=None, **kw):
    seen.append(title)
    plot(sched, path, title=title, **kw)
  monkeypatch.setattr(gantt, "plot_gantt", spy)
  return seen


def test_redraw_draws_a_tiny_schedule_again_under_its_kept_title(tmp_path, titles):
  sched = _tiny(tmp_path)
  drawn = gantt.draw(sched, str(tmp_path), "tiny: makespan 18")
  first = (tmp_path / "gantt.png").read_bytes()
  assert drawn == str(tmp_path / "gantt.png") and first.startswith(PNG_MAGIC)
  assert json.loads((tmp_path / "gantt.json").read_text())["title"] == "tiny: makespan 18"
  os.remove(tmp_path / "gantt.png")
  assert gantt.redraw(str(tmp_path)) == drawn
  # the same figure, byte for byte: the same schedule under the same title
  assert (tmp_path / "gantt.png").read_bytes() == first
  # the kept title is the one drawn (a user's edit of it too)
  (tmp_path / "gantt.json").write_text(json.dumps({"title": "edited"}))
  gantt.redraw(str(tmp_path))
  assert titles == ["tiny: makespan 18", "tiny: makespan 18", "edited"]
  (tmp_path / "gantt.json").write_text(json.dumps({"title": 3}))
  with pytest.raises(ValueError, match=r"gantt.json: expected \{\"title\": a string\}"):
    gantt.redraw(str(tmp_path))


def test_redraw_refuses_a_folder_without_its_schedule_or_a_title_naming_the_file(tmp_path):
  (tmp_path / "result.json").write_text(json.dumps({"makespan": 18.0}))
  with pytest.raises(ValueError) as e:
    gantt.redraw(str(tmp_path))
  assert str(e.value).startswith(f"{tmp_path}/schedule.json: no such file (gantt.png is drawn "
                                 "from the schedule.json of a schedule_search or "
                                 "schedule_cp_check run"), e.value
  _tiny(tmp_path)
  with pytest.raises(ValueError) as e:  # no gantt.json, nor the figures of a title
    gantt.redraw(str(tmp_path))
  assert str(e.value).startswith(f"{tmp_path}/result.json: no title to redraw gantt.png with"), \
      e.value
  os.remove(tmp_path / "result.json")
  with pytest.raises(ValueError, match=f"^{tmp_path}/gantt.json: no such file, nor "
                     f"{tmp_path}/result.json"):
    gantt.redraw(str(tmp_path))
  (tmp_path / "result.json").write_text(json.dumps({"provenance": {
      "command": "python -m experiments.bench_decode --workdir=x"}}))
  with pytest.raises(ValueError, match=f"^{tmp_path}/result.json: written by "
                     "experiments.bench_decode, not experiments.schedule_search or "):
    gantt.redraw(str(tmp_path))
  assert not os.path.exists(tmp_path / "gantt.png")


def test_redraw_rebuilds_an_old_schedule_search_title_from_its_result(tmp_path, titles):
  """schedule_search's result.json holds every figure its title quotes; one of another
  schedule (its makespan not schedule.json's) is refused, not drawn under a wrong title."""
  sched = _tiny(tmp_path)
  peaks = {"searched": [2.0, 3.0, 3.0, 2.0], "budget": [4.0, 4.0, 4.0, 4.0]}
  result = {"searched": sched.makespan, "lower_bound": 15.0, "serial_1f1b": 27.0,
            "peak_memory": peaks}
  (tmp_path / "result.json").write_text(json.dumps(result))
  gantt.redraw(str(tmp_path))
  assert titles == [f"fused schedule of Pa/Pc=2/2 Ma/Mc=2/2: makespan {sched.makespan:g}, "
                    "tight LB 15, serial 27, peak/budget 0.75 (per_device)"]
  (tmp_path / "result.json").write_text(json.dumps({**result, "searched": 99.0}))
  with pytest.raises(ValueError, match=f"^{tmp_path}/result.json: makespan 99, but "
                     f"schedule.json's is {sched.makespan:g}: not the run of that schedule"):
    gantt.redraw(str(tmp_path))


def test_a_kept_cp_sat_folder_redraws_under_the_title_its_png_shows(tmp_path, titles):
  """The kept CP-SAT folders predate gantt.json: e1's title is rebuilt from its result.json
  as the committed gantt.png shows it (read off the image)."""
  kept = os.path.join(REPO, "experiments", "results", "e1_cp_schedule")
  for name in ("schedule.json", "result.json"):
    shutil.copy(os.path.join(kept, name), tmp_path / name)
  gantt.redraw(str(tmp_path))
  assert titles == ["CP-SAT schedule: makespan 375, tight LB 372, peak/budget 1.00"]
  assert (tmp_path / "gantt.png").read_bytes().startswith(PNG_MAGIC)


def test_every_kept_schedule_has_its_gantt_png_and_a_title_to_redraw_it_under():
  """docs/schedules.md's kept schedules each come with their figure: a folder of
  experiments/results/ with a schedule.json has its gantt.png beside it (e9_uniform_cp's growth
  steps g40, g48, g56 had none until 2026-12-07), and a title rebuilt from its result.json, so
  any of them redraws."""
  results = os.path.join(REPO, "experiments", "results")
  folders = sorted(root for root, _, files in os.walk(results) if gantt.SCHEDULE in files)
  assert len(folders) == 16, folders
  for folder in folders:
    with open(os.path.join(folder, gantt.PNG), "rb") as f:
      assert f.read(len(PNG_MAGIC)) == PNG_MAGIC, folder
    sched = schedule_lib.load(os.path.join(folder, gantt.SCHEDULE))
    assert gantt.rebuilt_title(folder, sched).startswith(
        f"CP-SAT schedule: makespan {sched.makespan:g}, tight LB "), folder
