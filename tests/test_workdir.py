"""rlhfuse_jax/workdir.py's start of a one-shot binary: an earlier run's outputs move aside."""
import json
import os

from rlhfuse_jax import workdir as wd


def test_an_earlier_runs_outputs_move_to_previous_and_nothing_is_lost(tmp_path):
  run = tmp_path / "run"
  assert wd.start_outputs(str(run), {"a": 1}) is None  # a new workdir: nothing to move
  (run / "result.json").write_text("first")
  (run / "certificate.npz").write_text("proof")
  (run / "cache.json").write_text("reused")
  (run / "hint").mkdir()
  (run / "hint" / "schedule.json").write_text("go on from here")
  dest = wd.start_outputs(str(run), {"a": 2}, keep=("cache.json",),
                          inputs=(str(run / "hint" / "schedule.json"), None, "/elsewhere/x"))
  assert dest == str(run / "previous" / "1")
  assert sorted(os.listdir(dest)) == ["certificate.npz", "config.json", "result.json"]
  assert (run / "previous" / "1" / "result.json").read_text() == "first"
  assert json.loads((run / "previous" / "1" / "config.json").read_text()) == {"a": 1}
  # Kept: the cache, this run's input, and the earlier starts; config.json is this run's.
  assert sorted(os.listdir(run)) == ["cache.json", "config.json", "hint", "previous"]
  assert json.loads((run / "config.json").read_text()) == {"a": 2}
  assert wd.start_outputs(str(run), {"a": 3}) == str(run / "previous" / "2")
  assert sorted(os.listdir(run / "previous" / "2")) == ["cache.json", "config.json", "hint"]
  assert sorted(os.listdir(run / "previous")) == ["1", "2"]


def test_the_log_a_sweep_streams_into_the_run_stays(tmp_path):
  (tmp_path / "log.txt").write_text("=== start 2\n")  # the sweep wrote it before the run began
  (tmp_path / "result.json").write_text("{}")
  wd.start_outputs(str(tmp_path), {})
  assert (tmp_path / "log.txt").read_text() == "=== start 2\n"
  assert os.listdir(tmp_path / "previous" / "1") == ["result.json"]
