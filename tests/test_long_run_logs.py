"""A long run's logs at each start and at its end: metrics.jsonl (2.5 kB a row in the tiny fused
run, ~8 KiB as a Python dict) is neither rewritten whole when a start has nothing to drop, nor
held whole as dicts to truncate it or to summarise it into result.json."""
import json
import os
import subprocess
import sys

from rlhfuse_jax import metrics as metrics_lib
from rlhfuse_jax import workdir as wd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(n):
  return [{"step": i, "reward/mean": i / 10, "timing_s/step": 0.5, "perf/tokens_per_s": 100.0,
           "gen/response_lengths": [i] * 64, "kl/ref_mean": 1.0} for i in range(1, n + 1)]


def _write(path, rows, tail=""):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_a_start_with_nothing_to_drop_leaves_the_log_as_it_is(tmp_path):
  """Every start (MetricWriter.truncate_after, SamplesLog.begin) rewrote metrics.jsonl and
  samples.jsonl whole, also with no row after the checkpoint: hundreds of MB per start of a
  long run. The file must be the same file (inode) afterwards."""
  path = tmp_path / "metrics.jsonl"
  _write(path, _rows(5))
  before = os.stat(path)
  assert metrics_lib.MetricWriter(str(tmp_path), tensorboard=False).truncate_after(5) == []
  after = os.stat(path)
  assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
  assert wd.keep_jsonl_through(str(path), 7, rows=False) == [1, 2, 3, 4, 5]
  assert os.stat(path).st_ino == before.st_ino


def test_rows_after_the_step_a_torn_line_and_a_missing_newline_are_still_rewritten(tmp_path):
  path = tmp_path / "metrics.jsonl"
  _write(path, _rows(4), tail='{"step": 5, "rew')  # killed mid-write
  assert wd.keep_jsonl_through(str(path), 3, rows=False) == [1, 2, 3]
  assert path.read_text() == "".join(json.dumps(r) + "\n" for r in _rows(3))
  _write(path, _rows(3))
  path.write_text(path.read_text() + '{"step": 4}')  # a complete row without its newline
  assert wd.keep_jsonl_through(str(path), 9) == [*_rows(3), {"step": 4}]
  assert path.read_text().endswith('{"step": 4}\n')
  wd.append_jsonl(str(path), {"step": 5})
  assert [r["step"] for r in wd.read_jsonl(str(path))] == [1, 2, 3, 4, 5]
  path.write_text('{"step": 1}\n\n{"step": 2}\n')  # a blank line is dropped as before
  assert wd.keep_jsonl_through(str(path), 9, rows=False) == [1, 2]
  assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_result_json_is_summarised_without_holding_every_row_whole(tmp_path):
  """train_ppo read metrics.jsonl whole into dicts for result.json: ~8 KiB a row, ~1 GB at the
  end of a 100k-iteration run. read_history keeps the last row whole (result.json's `final`) and
  the others cut to what summarize reads, with the same summary."""
  path = tmp_path / "metrics.jsonl"
  _write(path, _rows(30))
  script = f"""
import json
from experiments import train_ppo
from rlhfuse_jax import workdir as wd
slim, whole = train_ppo.read_history({str(path)!r}), wd.read_jsonl({str(path)!r})
print(json.dumps([train_ppo.summarize(slim, 40, None, {{1, 11}}),
                  train_ppo.summarize(whole, 40, None, {{1, 11}}),
                  sorted(set(k for r in slim[:-1] for k in r)), slim[-1] == whole[-1]]))
"""
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=True)
  slim, whole, keys, last_whole = json.loads(out.stdout.strip().splitlines()[-1])
  assert slim == whole
  assert keys == sorted(["step", "reward/mean", "timing_s/step", "perf/tokens_per_s"])
  assert last_whole
