"""rlhfuse_jax/metrics.py: the progress line (what elapsed counts from, the ETA's pace) and
the writers' durability; the end hooks' errors."""
import json
import logging
import os
import struct

import pytest

from rlhfuse_jax import metrics as metrics_lib
from rlhfuse_jax.trainer import hooks


def test_sizes_read_in_the_unit_that_fits():
  """metrics.size: 3 significant digits in B, kB, MB, GB or TB. The progress line's migrated KV
  read '2.5e+03 MB' for 2.5 GB, and 999,999 bytes '1e+03 kB'."""
  assert metrics_lib.size(0) == "0 B"
  assert metrics_lib.size(307_456) == "307 kB"
  assert metrics_lib.size(999_999) == "1 MB"
  assert metrics_lib.size(2.5e9) == "2.5 GB"
  assert metrics_lib.size(25.84e9) == "25.8 GB"
  assert metrics_lib.size(3e12) == "3 TB"


def test_the_set_up_log_gives_a_toy_models_memory_in_kb(caplog):
  """The set-up line of what one device holds of each model (PPOTrainer._log_state_bytes): a
  toy model's weights read 'weights 0.0003075 GB'."""
  import types
  import jax
  import numpy as np
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.trainer.loop import PPOTrainer
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1), jax.devices()[:1])
  state = types.SimpleNamespace(params={"w": jax.numpy.zeros(76_875, np.float32)},  # 307.5 kB
                                opt_state={"mu": jax.numpy.zeros(2_500_000, np.float32)})
  trainer = types.SimpleNamespace(mesh=mesh, actor=state, critic=None)
  cfg = types.SimpleNamespace(optim=types.SimpleNamespace(master_weights=False, zero1=False))
  with caplog.at_level(logging.INFO):
    PPOTrainer._log_state_bytes(trainer, cfg)
  assert f"setup: actor on {jax.devices()[0]}: weights 308 kB, optimizer state 10 MB" in (
      caplog.text), caplog.text


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
  # The last iteration has no time left, also when it is the run's first (one iteration, or
  # a resume one before the end): not ETA=?.
  assert metrics_lib.ProgressReporter(1).line(1, {}).endswith("ETA=0m00s")
  assert metrics_lib.ProgressReporter(10, start_step=9).line(10, {}).endswith("ETA=0m00s")


def test_progress_line_shows_hours_past_an_hour(monkeypatch):
  now = [0.0]
  monkeypatch.setattr(metrics_lib.time, "time", lambda: now[0])
  progress = metrics_lib.ProgressReporter(total=3000, start_step=0, t0=0.0)
  now[0] = 30.0
  progress.line(1, {})
  now[0] = 30.0 + 999 * 12.5  # 12.5 s per iteration: 2000 x 12.5 s = 6h56m40s left
  assert progress.line(1000, {}).endswith("elapsed=3h28m37s ETA=6h56m40s")
  now[0] = 3599.9
  assert "elapsed=59m59s" in metrics_lib.ProgressReporter(10, t0=0.0).line(1, {})


def test_the_eta_paces_from_the_first_iteration_when_lines_are_every_k(tmp_path, monkeypatch,
                                                                       caplog):
  """log_every=10: iteration 1 (which compiles) is not logged, yet the line of iteration 10
  has an ETA, paced over iterations 2-10."""
  class Cfg:
    num_iterations, log_every = 30, 10
  now = [1000.0]
  monkeypatch.setattr(metrics_lib.time, "time", lambda: now[0])
  log = hooks.MetricsLog(str(tmp_path), Cfg(), lambda m: "", started=1000.0)
  log.begin(0)
  try:
    with caplog.at_level(logging.INFO):
      now[0] += 60  # iteration 1 compiles
      log.after(1, {}, stopping=False)
      for step in range(2, 11):  # 2 s each
        now[0] += 2
        log.after(step, {}, stopping=False)
  finally:
    log.end(failing=False)
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("iter ")]
  assert lines == ["iter 10/30 elapsed=1m18s ETA=0m40s"]


def test_the_iteration_a_signal_stops_after_gets_its_line(tmp_path, caplog):
  """log_every=100, Ctrl-C after iteration 201: its line is logged, the others' not."""
  class Cfg:
    num_iterations, log_every = 2000, 100
  log = hooks.MetricsLog(str(tmp_path), Cfg(), lambda m: "")
  log.begin(199)
  try:
    with caplog.at_level(logging.INFO):
      log.after(200, {}, stopping=False)
      log.after(201, {}, stopping=True)
  finally:
    log.end(failing=False)
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("iter ")]
  assert [line.split(" elapsed")[0] for line in lines] == ["iter 200/2000", "iter 201/2000"]


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


def test_tensorboard_events_are_on_disk_with_their_jsonl_row(tmp_path):
  """A kill -9 after a checkpoint must not lose TensorBoard events the checkpoint covers (the
  resume does not run those steps again): each write reaches the event file, not only the
  writer's buffer (flushed every 10 s before)."""
  writer = metrics_lib.MetricWriter(str(tmp_path))
  writer.write(1, {"reward/mean": 0.5, "gen/response_lengths": [3, 4], "x/nan": float("nan")})
  writer.write(2, {"reward/mean": 0.75})
  got = [(e.step, v.tag, v.simple_value) for e in read_events(tmp_path / "tb")
         for v in e.summary.value]
  assert got == [(1, "reward/mean", 0.5), (2, "reward/mean", 0.75)]  # no lists, no NaN
  writer.close()


def test_booleans_stay_out_of_tensorboard(tmp_path):
  """A flag among the metrics (True is an int to Python) is JSONL-only: a TensorBoard scalar
  of it would plot as 1.0 / 0.0 under a name that is not a number."""
  writer = metrics_lib.MetricWriter(str(tmp_path))
  writer.write(3, {"fusion/applied": True, "skipped": False, "loss": 2, "kl": 0.25})
  got = [(e.step, v.tag, v.simple_value) for e in read_events(tmp_path / "tb")
         for v in e.summary.value]
  assert got == [(3, "loss", 2.0), (3, "kl", 0.25)]
  with open(tmp_path / "metrics.jsonl") as f:
    assert json.loads(f.readline())["fusion/applied"] is True
  writer.close()


def test_an_end_hook_error_does_not_replace_the_error_leaving_the_run(caplog):
  """hooks.run_hooks("end", failing): with an error already on its way out (a failed save: exit
  3) a hook's own failure in end (the TensorBoard close on a full disk) is logged, not raised
  in its place; without one it is the run's error."""
  ended = []

  class Full(hooks.Hook):
    def end(self, failing):
      raise OSError(28, "No space left on device")

  class Other(hooks.Hook):
    def end(self, failing):
      ended.append(failing)
  hooks.run_hooks([Other(), Full()], "end", True)  # logged
  assert ended == [True]  # every hook ends
  assert "No space left on device" in caplog.text
  with pytest.raises(OSError, match="No space left"):
    hooks.run_hooks([Other(), Full()], "end", False)


def read_events(logdir):
  """Every Event of the TFRecord event files in `logdir` (length, crc, data, crc per record)."""
  from tensorboardX.proto.event_pb2 import Event
  events = []
  for name in sorted(os.listdir(logdir)):
    data = (logdir / name).read_bytes()
    i = 0
    while i < len(data):
      n, = struct.unpack("<Q", data[i:i + 8])
      events.append(Event.FromString(data[i + 12:i + 12 + n]))
      i += 12 + n + 4
  return events


def test_two_writers_in_the_same_second_keep_both_event_files(tmp_path, monkeypatch):
  """tensorboardX names an event file by the whole second and the host and opens it "wb": a
  second writer in the same second (a resume in the same process) truncated the first one's
  file, and step 1's events were gone."""
  from tensorboardX import event_file_writer
  monkeypatch.setattr(event_file_writer.time, "time", lambda: 1_800_000_000.25)
  first = metrics_lib.MetricWriter(str(tmp_path))
  first.write(1, {"reward/mean": 0.5})
  first.close()
  second = metrics_lib.MetricWriter(str(tmp_path), purge_step=2)
  second.write(2, {"reward/mean": 0.75})
  second.close()
  got = [(e.step, v.tag, v.simple_value) for e in read_events(tmp_path / "tb")
         for v in e.summary.value]
  assert sorted(got) == [(1, "reward/mean", 0.5), (2, "reward/mean", 0.75)]
