"""rlhfuse_jax/metrics.py's progress line: what elapsed counts from, and the ETA's pace."""
import json
import logging

from rlhfuse_jax import metrics as metrics_lib
from rlhfuse_jax.trainer import hooks


def test_progress_line_counts_elapsed_from_t0_and_paces_the_eta_after_the_first(monkeypatch):
  now = [1000.0]
  monkeypatch.setattr(metrics_lib.time, "time", lambda: now[0])
  progress = metrics_lib.ProgressReporter(total=10, start_step=2, t0=1000.0 - 125)  # setup
  now[0] += 40  # iteration 3 (compiles)
  first = progress.line(3, {"reward/mean": 0.25, "perf/tokens_per_s": 1234.4})
  assert first == "iter 3/10 reward/mean=0.25 tok/s=1234 elapsed=2m45s ETA=?"
  now[0] += 10  # iterations 4 and 5: 5 s each, 5 left
  assert progress.line(5, {}, extra="(x)") == "iter 5/10 elapsed=2m55s ETA=0m25s (x)"
  # Without t0, elapsed starts at construction.
  assert metrics_lib.ProgressReporter(10).line(1, {}).endswith("elapsed=0m00s ETA=?")


def test_the_trainers_progress_counts_from_when_it_was_built(tmp_path):
  class Cfg:
    num_iterations = 4
  log = hooks.MetricsLog(str(tmp_path), Cfg(), lambda m: "", started=123.0)
  log.begin(0)
  try:
    assert log.progress.t0 == 123.0
  finally:
    log.end(failing=False)


def test_library_info_lines_are_dropped_and_their_warnings_kept():
  import logging as py_logging
  drop = metrics_lib._DropLibraryInfo(metrics_lib.LIBRARY_INFO)

  def record(path, level):
    return py_logging.LogRecord("x", level, path, 1, "m", None, None)
  probe = "/site-packages/jax/_src/xla_bridge.py"  # "Unable to initialize backend 'tpu'"
  assert not drop.filter(record(probe, py_logging.INFO))
  assert drop.filter(record(probe, py_logging.WARNING))  # "a GPU may be present, but ..."
  assert not drop.filter(record("/site-packages/orbax/checkpoint/x.py", py_logging.INFO))
  assert drop.filter(record("/site-packages/jax/_src/compiler.py", py_logging.INFO))
  assert drop.filter(record("/repo/rlhfuse_jax/trainer/hooks.py", py_logging.INFO))


def test_a_resume_over_a_torn_row_the_checkpoint_covers_warns_of_the_gap(tmp_path, caplog):
  """metrics.jsonl whose row of the checkpointed iteration is torn (or removed): the resumed run
  starts after it, so that row is never written again; the start says which rows are missing
  (it dropped the torn line silently, leaving a gap nothing pointed at)."""
  class Cfg:
    num_iterations, log_every = 6, 1

  rows = "".join(json.dumps({"step": s, "reward/mean": 0.1}) + "\n" for s in (1, 2))
  (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 3, "rew')  # torn, step 3 saved
  log = hooks.MetricsLog(str(tmp_path), Cfg(), lambda m: "")
  with caplog.at_level(logging.WARNING):
    log.begin(3)
  log.end(False)
  assert "has no row for 1 iteration(s) the checkpoint at iteration 3 covers (3)" in caplog.text
  assert (tmp_path / "metrics.jsonl").read_text() == rows
  caplog.clear()
  with caplog.at_level(logging.WARNING):  # every row there: nothing to say
    log = hooks.MetricsLog(str(tmp_path), Cfg(), lambda m: "")
    log.begin(2)
    log.end(False)
  assert "has no row" not in caplog.text
