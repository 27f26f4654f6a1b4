"""Cheap tests proposed by a fifth mutation audit (the mutants the fourth audit wrote but did not
run: checkpointing.py, workdir.py, metrics.py, policy/, generation/, parallel/distributed.py,
trainer/{hooks,pipelined}.py, experiments/): each one fails under a plausible bug that the rest
of the suite lets through (see the audit report for the mutation each kills)."""
import gc
import json
import math
import os
import signal
import socket
import stat
import types

import numpy as np
import pytest

from rlhfuse_jax import metrics as metrics_lib
from rlhfuse_jax import workdir as wd


# workdir.py --------------------------------------------------------------------------------------

def test_appended_and_atomic_writes_reach_the_disk_before_they_return(tmp_path, monkeypatch):
  """append_jsonl flushes and fsyncs its line (a crash loses at most that line), and the
  directory after the line that created the file, with the new name in it (until 2026-12-07
  never: a power loss could drop metrics.jsonl's entry, its synced rows with it), not after
  every line (an fsync more per row); an atomic write fsyncs its temporary file before the
  rename, each fsync seeing the whole data written, then the directory after the rename, with
  the new name in it (a power loss right after the rename brought the old file back, or
  none)."""
  synced = []
  real_fsync = os.fsync

  def fsync(fd):
    st = os.fstat(fd)
    synced.append(sorted(os.listdir(tmp_path)) if stat.S_ISDIR(st.st_mode) else st.st_size)
    real_fsync(fd)
  monkeypatch.setattr(wd.os, "fsync", fsync)
  path = tmp_path / "metrics.jsonl"
  wd.append_jsonl(str(path), {"step": 1})
  wd.append_jsonl(str(path), {"step": 2})
  assert synced == [len('{"step": 1}\n'), ["metrics.jsonl"], 2 * len('{"step": 1}\n')]
  wd.write_json(str(tmp_path / "result.json"), {"a": 1})
  assert synced[3:] == [os.path.getsize(tmp_path / "result.json"),
                        ["metrics.jsonl", "result.json"]]
  # A first line that did not reach the file (its write refused: a full disk) created it: the
  # next line, the first in it, syncs the directory (the file found there skipped it).
  del synced[:]
  samples = tmp_path / "samples.jsonl"
  with monkeypatch.context() as m:
    m.setattr(wd.json, "dumps", lambda obj: (_ for _ in ()).throw(OSError(28, "No space")))
    with pytest.raises(OSError):
      wd.append_jsonl(str(samples), {"step": 1})
  assert samples.read_text() == "" and synced == []
  wd.append_jsonl(str(samples), {"step": 1})
  assert synced == [len('{"step": 1}\n'), ["metrics.jsonl", "result.json", "samples.jsonl"]]


def test_a_workdir_lock_names_only_its_current_holder(tmp_path):
  """WorkdirLock rewrites .lock with its own pid and host (an earlier holder's line is gone), so
  a second run is told who holds the workdir now, not every run that ever held it."""
  (tmp_path / ".lock").write_text("pid 1 on an-old-host\n")
  lock = wd.WorkdirLock(str(tmp_path))
  try:
    me = f"pid {os.getpid()} on {socket.gethostname()} (start {lock.token})"
    assert (tmp_path / ".lock").read_text().splitlines()[0] == me
    assert wd.lock_token(str(tmp_path)) == lock.token > 0  # what the other hosts read back
    with pytest.raises(wd.WorkdirInUseError) as e:
      wd.WorkdirLock(str(tmp_path))
    assert f"({me})" in str(e.value) and "an-old-host" not in str(e.value)
    assert wd.lock_token(str(tmp_path / "elsewhere")) == -1
  finally:
    lock.release()


# metrics.py --------------------------------------------------------------------------------------

def test_tensorboard_gets_finite_scalars_only(tmp_path):
  """MetricWriter sends TensorBoard the finite int/float metrics only (NaN, inf, booleans and
  lists stay in metrics.jsonl); the events stay readable after close()."""
  from tests.test_metrics import read_events
  writer = metrics_lib.MetricWriter(str(tmp_path))
  writer.write(3, {"loss": 0.5, "n": 2, "nan": math.nan, "inf": math.inf, "ninf": -math.inf,
                   "ok": True, "curve": [1.0, 2.0]})
  got = lambda: [(v.tag, v.simple_value, e.step) for e in read_events(tmp_path / "tb")  # noqa
                 for v in e.summary.value]
  assert got() == [("loss", 0.5, 3), ("n", 2, 3)]
  writer.close()
  assert got() == [("loss", 0.5, 3), ("n", 2, 3)]
  row = json.loads((tmp_path / "metrics.jsonl").read_text())
  assert row["nan"] is None and row["curve"] == [1.0, 2.0]


# policy/rt.py ------------------------------------------------------------------------------------

def test_rt_choice_clips_the_drawn_lengths_to_this_runs_max_new_tokens():
  """choose_rt clips lengths drawn from the history to max_new_tokens: a history kept from a
  run with longer responses (max_len 16) never makes a batch capped at 8 tokens simulate more."""
  from rlhfuse_jax.policy import rt as rt_lib
  from rlhfuse_jax.policy.lengths import LengthHistogram
  hist = LengthHistogram(16)
  hist.add([2, 12, 16, 16])
  seen = []

  def simulate(rt, prompt_lens, lens):
    seen.append(lens.copy())
    return float(lens.sum())
  rt_lib.choose_rt(hist, simulate, np.full(8, 4), 8, candidates=(0.5,), draws=3, seed=0)
  drawn = np.concatenate(seen)
  assert drawn.max() == 8 and drawn.min() >= 1


# generation/sampling.py, generation/timeline.py --------------------------------------------------

def test_a_tie_at_the_nucleus_edge_goes_to_the_lower_ids_as_with_top_k():
  """top_p's sort keeps tied tokens in id order (most likely first, ties by lower id): with 4
  equally likely tokens, top_p=0.5 keeps ids 0 and 1, the pair top_k=2 keeps too."""
  import jax
  import jax.numpy as jnp
  from rlhfuse_jax.generation import sampling
  keys = sampling.sample_keys(jax.random.key(0), jnp.arange(64), jnp.zeros(64, jnp.int32))
  logits = jnp.zeros((64, 4), jnp.float32)
  for cfg in (sampling.SamplingConfig(top_p=0.5), sampling.SamplingConfig(top_k=2)):
    tokens, _ = sampling.sample_token(logits, keys, cfg)
    assert sorted(set(np.asarray(tokens).tolist())) == [0, 1], cfg


def test_a_tags_span_runs_from_its_first_start_to_its_last_end():
  """ActivityLog.tag_span(tag) is the wall time from the first segment's start to the last one's
  end (same-host migrations reported as one span), 0 for a tag never recorded."""
  from rlhfuse_jax.generation.timeline import ActivityLog
  log = ActivityLog(2)
  log.close()
  log.tagged = {"migrate": [(1.0, 2.0), (1.5, 4.0), (3.0, 3.5)]}
  assert log.tag_span("migrate") == 3.0
  assert log.tag_span("other") == 0.0


# trainer/hooks.py --------------------------------------------------------------------------------

def test_the_progress_line_shows_every_log_every_and_the_last_iteration(tmp_path, monkeypatch):
  """MetricsLog logs a progress line every log_every iterations and at num_iterations (5, not a
  multiple of log_every=2): a run's last line is never missing from its log."""
  import tensorboardX
  from rlhfuse_jax.trainer import hooks

  class Quiet:
    def __init__(self, logdir, **kw):
      pass

    def add_scalar(self, *a):
      pass

    def close(self):
      pass
  monkeypatch.setattr(tensorboardX, "SummaryWriter", Quiet)
  lines = []
  monkeypatch.setattr(hooks.logging, "info", lambda msg, *a: lines.append(msg % a if a else msg))
  log = hooks.MetricsLog(str(tmp_path), types.SimpleNamespace(num_iterations=5, log_every=2),
                         lambda m: "")
  log.begin(0)
  for step in range(1, 6):
    log.after(step, {"reward/mean": 1.0}, stopping=False)
  log.end(failing=False)
  assert [s.split()[1] for s in lines if s.startswith("iter ")] == ["2/5", "4/5", "5/5"]


def test_a_set_up_signal_that_stops_the_loop_gives_the_handlers_back(monkeypatch):
  """With several processes a set-up signal is only recorded; StopFlag.begin then stops with
  StoppedBeforeTraining and hands SIGTERM/SIGINT back to the set-up handler first (the run's
  last moments must not be caught by a flag nobody checks any more)."""
  import jax
  from rlhfuse_jax.trainer import hooks
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  with hooks.stop_before_training():
    setup = signal.getsignal(signal.SIGTERM)
    was = gc.isenabled()
    gc.disable()  # the handler must not run inside jax's gc callback (test_train_ppo_binary)
    try:
      signal.raise_signal(signal.SIGTERM)  # recorded for the next agreement, not raised
    finally:
      if was:
        gc.enable()
    assert hooks._LOOP["pending"] == signal.SIGTERM
    flag = hooks.StopFlag()
    with pytest.raises(hooks.StoppedBeforeTraining):
      flag.begin(0)
    assert signal.getsignal(signal.SIGTERM) is setup
    assert signal.getsignal(signal.SIGINT) is setup


def test_the_hf_export_is_written_once_at_the_last_iteration(tmp_path, monkeypatch):
  """HFExport.after exports at num_iterations only (not every iteration: each export gathers
  and writes the whole actor), and not at all without checkpoint.export_hf."""
  from rlhfuse_jax.trainer import hf_export
  for export_hf, want in (("llama", [3]), ("", [])):
    cfg = types.SimpleNamespace(num_iterations=3,
                                checkpoint=types.SimpleNamespace(export_hf=export_hf))
    hook = hf_export.HFExport(str(tmp_path), cfg, lambda: None)
    done = []
    monkeypatch.setattr(hook, "export", done.append)
    for step in range(1, 4):
      hook.after(step, {}, stopping=step == 2)
    assert done == want, export_hf


def test_an_export_fills_null_special_ids_and_starts_from_an_empty_directory(tmp_path,
                                                                            monkeypatch):
  """export_hf writes into a fresh hidden directory of its own (a killed export's leftovers, e.g.
  the shards of another family, are removed first, not renamed into the export; a user's
  hf_export.old / hf_export.tmp, an export kept aside, are left alone: the export deleted them),
  and _fill_special_ids replaces a null id (as well as an absent one) with the run's
  tokenizer's."""
  from rlhfuse_jax.trainer import hf_export

  def save(params, model, out, family=None):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
      json.dump({"bos_token_id": None, "pad_token_id": 5}, f)
  monkeypatch.setattr(hf_export.hf_loader, "save_hf_checkpoint", save)
  monkeypatch.setattr(hf_export.mesh_lib, "to_host", lambda p: p)
  monkeypatch.setattr(hf_export, "export_family", lambda cfg, model="actor": "llama")
  monkeypatch.setattr(hf_export, "_resolved_family", lambda cfg, model="actor": "llama")
  monkeypatch.setattr(hf_export, "_copy_tokenizer", lambda cfg, tokenizer, out, read: None)
  out = tmp_path / "hf_export"
  writing, _ = hf_export.export_work_dirs(str(out))
  os.makedirs(writing)
  with open(os.path.join(writing, "model-00002-of-00002.safetensors"), "w") as f:
    f.write("stale")
  for kept in ("hf_export.old", "hf_export.tmp"):
    (tmp_path / kept).mkdir()
    (tmp_path / kept / "notes.txt").write_text("mine")
  cfg = types.SimpleNamespace(model=None, init=types.SimpleNamespace(actor_checkpoint=""),
                              data=types.SimpleNamespace(chat_template="none"))
  tok = types.SimpleNamespace(bos_id=1, eos_id=2, pad_id=0, extra_eos_ids=(), stop_ids=(2,))
  hf_export.export_hf({}, cfg, str(out), step=3, tokenizer=tok)
  assert sorted(os.listdir(out)) == ["config.json", hf_export.EXPORT_MARKER]
  assert sorted(os.listdir(tmp_path)) == ["hf_export", "hf_export.old", "hf_export.tmp"]
  assert (tmp_path / "hf_export.old" / "notes.txt").read_text() == "mine"
  config = json.loads((out / "config.json").read_text())
  assert config == {"bos_token_id": 1, "pad_token_id": 5, "eos_token_id": 2}


# experiments/runner.py, sweep.py, config_files.py ------------------------------------------------

def test_the_commit_is_dirty_only_with_changes_to_tracked_files(tmp_path, monkeypatch):
  """git_commit: HEAD's 12 hex digits, with -dirty only once a tracked file changed (an
  untracked file, like a run's outputs, leaves it clean)."""
  import subprocess
  from experiments import runner

  def git(*args):
    return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c",
                           "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                          check=True, capture_output=True, text=True).stdout.strip()
  git("init", "-q")
  (tmp_path / "a.txt").write_text("1")
  git("add", "a.txt")
  git("commit", "-qm", "one")
  head = git("rev-parse", "--short=12", "HEAD")
  monkeypatch.setattr(runner, "REPO_ROOT", str(tmp_path))
  (tmp_path / "result.json").write_text("{}")
  assert runner.git_commit() == head
  (tmp_path / "a.txt").write_text("2")
  assert runner.git_commit() == head + "-dirty"


def test_a_re_run_appends_to_the_runs_log(tmp_path, capsys):
  """run_streamed appends to run_dir/log.txt after a header line: a resumed sweep's re-run
  keeps the earlier run's log (and its error) above its own."""
  import sys
  from experiments import runner
  for word in ("first", "second"):
    rc = runner.run_streamed([sys.executable, "-c", f"print('{word}')"], str(tmp_path), "r",
                             runner.repo_env())
    assert rc == 0
  lines = (tmp_path / "log.txt").read_text().splitlines()
  assert [s for s in lines if not s.startswith("=== ")] == ["first", "second"]
  assert sum(s.startswith("=== ") for s in lines) == 2
  assert "[r] first" in capsys.readouterr().out


def test_a_runs_environment_imports_this_repository_first(monkeypatch):
  """repo_env puts the repository first on PYTHONPATH, keeping the caller's entries after it
  (a run then imports this checkout whatever its working directory or PYTHONSAFEPATH)."""
  from experiments import runner
  monkeypatch.setenv("PYTHONPATH", "/elsewhere")
  env = runner.repo_env(JAX_PLATFORMS="cpu")
  assert env["PYTHONPATH"].split(os.pathsep) == [runner.REPO_ROOT, "/elsewhere"]
  assert env["JAX_PLATFORMS"] == "cpu"


_SWEEP_CHECKS = """
import json, os, sys
from experiments import sweep
work = sys.argv[1]
out = {"flat": sweep.flatten_scalars({"a": None, "b": {"c": 1, "d": None}, "curve": [1, 2]})}
sweep.write_summary(work, [{"run": "a", "x": 1}, {"run": "b", "y": 2, "error": "E"}])
ran = []

def fake_run(cmd, run_dir, name, env, started=None, prefix=None):
  ran.append(name)
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "result.json"), "w") as f:
    json.dump({"loss": 0.5}, f)  # left by an earlier start of the run
  return 1
sweep.run_streamed = fake_run
signals = sweep._Signals()
out["failed"] = sweep._run_locked("b", "c.py", work, [], False, signals, [(0, "f", {})],
                                  lambda rows: None)
signals.signum = 15  # SIGTERM came before the next run started
out["signalled"] = sweep._run_locked("b", "c.py", work, [], False, signals, [(1, "g", {})],
                                     lambda rows: None)
out["ran"] = ran
print(json.dumps(out))
"""


def test_a_sweeps_rows_keep_nulls_and_columns_and_no_run_starts_after_a_signal(tmp_path):
  """experiments/sweep.py (its runs faked): flatten_scalars keeps null scalars (an empty cell,
  not a missing column) and skips lists; summary.md's columns are the union of all rows' keys; a
  failed run's row takes nothing from a result.json an earlier start left; and a SIGTERM that
  came before a run started starts no run (the sweep is incomplete, with no row)."""
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=repo)
  proc = subprocess.run([sys.executable, "-c", _SWEEP_CHECKS, str(tmp_path)], cwd=repo, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(proc.stdout.splitlines()[-1])
  assert out["flat"] == {"a": None, "b/c": 1, "b/d": None}
  head = (tmp_path / "summary.md").read_text().splitlines()[0]
  assert head == "| run | x | y | error |"
  (row,), complete = out["failed"]
  assert row["status"] == "failed (exit 1)" and "loss" not in row and complete  # it ran
  assert out["signalled"] == [[], False] and out["ran"] == ["f"]


def test_a_config_files_error_names_its_own_line_not_a_librarys(tmp_path):
  """config_files._load_message: the "(FILE, line N)" of an error raised while a config file
  loaded is the config file's own frame, not the library frame that raised (here pathlib's)."""
  import importlib.util
  from experiments import config_files
  cfg = tmp_path / "cfg.py"
  cfg.write_text("import pathlib\n\n\ndef get_config():\n"
                 f"  return pathlib.Path({str(tmp_path / 'missing.txt')!r}).read_text()\n")
  spec = importlib.util.spec_from_file_location("cfg_under_test", cfg)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  with pytest.raises(FileNotFoundError) as e:
    module.get_config()
  message = config_files._load_message("config", str(cfg), e.value)
  assert message.startswith(f"--config={str(cfg)!r}: loading it raised FileNotFoundError: ")
  assert message.endswith(f"({cfg}, line 5)")


# generation/pipelined.py -------------------------------------------------------------------------

def test_the_pipeline_shape_checks_hold_at_their_exact_limits():
  """check_pipeline: one group fewer than stages is refused (G >= pp), as is one stage more than
  devices; G == pp on pp devices is accepted (rows per group returned)."""
  from rlhfuse_jax.generation import pipelined
  cfg = types.SimpleNamespace(num_layers=8)
  with pytest.raises(ValueError, match="pipeline_groups=3 < config.generation.pipeline_stages=4"):
    pipelined.check_pipeline(cfg, 6, 4, 3, 8)
  with pytest.raises(ValueError, match="pipeline_stages=8 needs 8 devices, but only 7"):
    pipelined.check_pipeline(cfg, 8, 8, 8, 7)
  assert pipelined.check_pipeline(cfg, 8, 4, 4, 4) == 2


def test_the_schedule_report_flags_a_table_that_misses_the_formula():
  """schedule_report's ticks_match_formula is the check it names: true for the formula's own
  table, false for an extra chunk of idle ticks or for a stage-tick left idle."""
  from rlhfuse_jax.generation import pipelined
  gen = types.SimpleNamespace(group_steps=lambda lens: [2, 2], stages=2, chunk_ticks=4,
                              groups=2, bg=1, sampling=types.SimpleNamespace(chunk_size=2))

  def report(table):
    rollout = types.SimpleNamespace(response_lens=[3, 3], decode_table=table, decode_chunks=2)
    return pipelined.schedule_report(gen, rollout)
  good = pipelined.expected_tick_table([2, 2], 2, 8)
  assert report(good)["ticks_match_formula"] and report(good)["table_matches_formula"]
  longer = pipelined.expected_tick_table([2, 2], 2, 12)
  assert not report(longer)["ticks_match_formula"]
  idle = good.copy()
  idle[4, 1] = pipelined.IDLE
  assert not report(idle)["ticks_match_formula"] and not report(idle)["table_matches_formula"]


# generation/measure.py ---------------------------------------------------------------------------

def test_a_measured_time_is_the_median_after_an_untimed_warm_up(monkeypatch):
  """measure.median_s calls fn once untimed (the compile) and returns the median of `repeats`
  timed calls: one slow call (5 s) among 1 s and 2 s gives 2 s, neither the mean nor the min."""
  from rlhfuse_jax.generation import measure
  clock = iter([0.0, 5.0, 10.0, 11.0, 20.0, 22.0])
  monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
  calls = []
  assert measure.median_s(lambda: calls.append(1), 3) == 2.0
  assert len(calls) == 4


def test_measured_costs_use_exactly_the_occupied_slots_and_per_device_bytes(monkeypatch):
  """measure_costs (its instance faked) times the decode step with exactly 1 and exactly S live
  rows (budget 0 for the others), and weight_load in the bytes copied (byte_unit "stored": the
  float32 arrays' 4 a parameter here) of the models a freed instance loads (the critic too:
  fused.InferenceQueue._load copies it in before the first micro-batch), split over its
  instance_devices."""
  import itertools
  from rlhfuse_jax.generation import measure
  from rlhfuse_jax.generation.sampling import SamplingConfig
  s, live = 4, []

  class Inst:
    devices = [types.SimpleNamespace(platform="cpu", device_kind="cpu")]
    rep = None

    def place(self, cfg, params):
      return params

    def prefill(self, params, tok, lens, uids, budget, key):
      return types.SimpleNamespace(num_generated=np.zeros(s, np.int32),
                                   budget=np.asarray(budget)), None

    def decode(self, params, st, key):
      live.append(int((st.budget > 0).sum()))
      return types.SimpleNamespace(num_generated=np.where(st.budget > 0, 2, 0)), np.zeros(1)

    def score(self, name, params, seq, plens, rlens, inputs=None):
      return np.zeros(1)

  def model(n):
    return types.SimpleNamespace(vocab_size=16, num_params=lambda: n)
  gen = types.SimpleNamespace(
      instances=[Inst()], local=[0], prompt_len=3, cfg=model(1000),
      config=types.SimpleNamespace(slots=s, instance_devices=2, micro_batch=2, inference_pp=1),
      sampling=SamplingConfig(max_new_tokens=5, chunk_size=2),
      models={"ref": model(300), "reward": model(100), "critic": model(50)})
  monkeypatch.setattr(measure, "median_s", lambda fn, repeats: (fn(), 0.5)[1])
  monkeypatch.setattr(measure, "time",
                      types.SimpleNamespace(perf_counter=itertools.count().__next__))
  held = {n: np.zeros(k, np.float32) for n, k in (("ref", 300), ("reward", 100), ("critic", 50))}
  cal = measure.measure_costs(gen, {}, held, repeats=1)
  assert sorted(set(live)) == [1, 4]
  assert cal["ops"]["decode_step"]["occupied_slots"] == [1, 4]
  assert cal["byte_unit"] == "stored"
  assert cal["ops"]["weight_load"]["bytes_per_s"] == 4 * (300 + 100 + 50) / 2 / 0.5


# generation/fused.py -----------------------------------------------------------------------------

def test_auto_rt_is_simulated_again_only_once_the_histogram_grew_by_a_quarter(monkeypatch):
  """FusedGenerator._choose_rt keeps its last simulated Rt until the length histogram holds
  RESIMULATE_GROWTH (1.25) times the lengths it was simulated on (a simulation per batch would
  cost more than it saves)."""
  from rlhfuse_jax.generation import fused
  from rlhfuse_jax.policy import rt as rt_lib
  calls = []

  def choose(lengths, model, prompt_lens, max_new_tokens, candidates):
    calls.append(lengths.total)
    return rt_lib.RtChoice(0.1 * len(calls), "simulated", {})
  monkeypatch.setattr(fused.rt_choice, "choose_rt", choose)
  gen = types.SimpleNamespace(
      calibration=object(), lengths=types.SimpleNamespace(total=0), _rt_cache=None,
      rt_model=lambda g, c: None, sampling=types.SimpleNamespace(max_new_tokens=8),
      config=types.SimpleNamespace(rt_candidates=(0.1, 0.2)))
  rts = []
  for total in (100, 120, 124, 125, 150, 157):
    gen.lengths.total = total
    rts.append(fused.FusedGenerator._choose_rt(gen, np.ones(2))[0])
  assert calls == [100, 125, 157]
  assert rts == pytest.approx([0.1, 0.1, 0.1, 0.2, 0.2, 0.3])


def test_fusion_fields_refuse_a_zero_timeout_and_keep_the_inference_micro_batch():
  """FusionFields: exchange_timeout_s must be > 0 (0 would end every process at its first
  collective); FusedGenConfig.micro_batch is inference_micro_batch when set, else slots."""
  from rlhfuse_jax.generation import fused
  with pytest.raises(ValueError, match=r"config.fusion.exchange_timeout_s=0: expected a number "
                     "of seconds > 0"):
    fused.FusionFields(num_instances=1, slots=1, exchange_timeout_s=0)
  assert fused.FusionFields(num_instances=1, slots=1, exchange_timeout_s=0.5)
  assert fused.FusedGenConfig(num_instances=1, slots=4, inference_micro_batch=2).micro_batch == 2
  assert fused.FusedGenConfig(num_instances=1, slots=4).micro_batch == 4


def test_an_inflight_cap_is_refused_with_several_processes(monkeypatch):
  """FusedGenerator: fusion.inference_inflight (a cap on running micro-batches, which a process
  cannot count on another's instances) must be 0 with several processes, refused before
  anything compiles (here process 0 of 2, each owning one instance)."""
  from rlhfuse_jax.generation import fused
  from rlhfuse_jax.models import llama
  from tests.test_fused_generation import CFG, P, T

  class TwoProcesses(fused.multihost.Exchange):
    def __init__(self, *args):
      super().__init__(*args)
      self.count = 2
  monkeypatch.setattr(fused.multihost, "Exchange", TwoProcesses)
  monkeypatch.setattr(fused.multihost, "process_of", lambda devices, what, field: int(what[-1]))
  shapes = {"reference": llama.host_random_params(CFG, 0)}
  sampling = fused.SamplingConfig(max_new_tokens=T, eos_id=-1)
  config = fused.FusedGenConfig(num_instances=2, slots=4, migration_threshold=0.5,
                                inference_inflight=1)
  with pytest.raises(ValueError, match=r"fusion.inference_inflight=1 caps running "
                     r"micro-batches.*expected 0 with 2 processes"):
    fused.FusedGenerator(CFG, sampling, config, batch_size=8, prompt_len=P,
                         frozen=fused.inst_lib.FrozenModels(reference=CFG),
                         actor_params=shapes["reference"], frozen_params=shapes)


# generation/multihost.py -------------------------------------------------------------------------

def test_by_owner_takes_each_row_from_its_owner_and_a_collective_is_timed(monkeypatch):
  """Exchange.by_owner (its all-gather faked for 2 processes) takes row n from process owner[n];
  guard arms a timer of timeout_s around each collective (a peer that hangs ends this process)
  and cancels it once the collective completes."""
  from rlhfuse_jax.generation import multihost
  ex = multihost.Exchange(5.0)
  ex.count = 2
  monkeypatch.setattr(ex, "allgather", lambda x, what: np.stack([x, x + 100]))
  got = ex.by_owner(np.arange(4), np.array([0, 1, 1, 0]))
  assert got.tolist() == [0, 101, 102, 3]
  timers = []

  class Timer:
    def __init__(self, interval, fn):
      self.interval, self.events = interval, []
      timers.append(self)

    def start(self):
      self.events.append("start")

    def cancel(self):
      self.events.append("cancel")
  monkeypatch.setattr(multihost.threading, "Timer", Timer)
  with ex.guard("rows"):
    assert timers[0].events == ["start"] and timers[0].interval == 5.0
  assert timers[0].events == ["start", "cancel"]


def test_an_instance_spanning_two_processes_is_refused_by_name():
  """process_of: devices of one process give that process; devices of two are refused, naming
  the processes, the devices and the config field that sets an instance's width."""
  from rlhfuse_jax.generation import multihost
  dev = lambda i, p: types.SimpleNamespace(id=i, process_index=p)  # noqa: E731
  assert multihost.process_of([dev(4, 1), dev(5, 1)], "instance 2") == 1
  with pytest.raises(ValueError, match=r"instance 1 spans processes \[0, 1\] \(devices \[3, 4\]\)"
                     r".*config.fusion.instance_devices"):
    multihost.process_of([dev(3, 0), dev(4, 1)], "instance 1")


# parallel/distributed.py -------------------------------------------------------------------------

def test_a_nodes_gpus_fall_back_to_cuda_visible_devices_and_skip_unreadable_counts():
  """slurm_node_gpus: with one task per node and no SLURM GPU count, CUDA_VISIBLE_DEVICES gives
  the node's GPUs; a typed count with an unreadable part is skipped for the next variable (not
  read as a number, nor a crash)."""
  from rlhfuse_jax.parallel import distributed
  env = {"SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": "0,1,2"}
  assert distributed.slurm_node_gpus(env) == [0, 1, 2]
  env.update(SLURM_GPUS_ON_NODE="gpu:a100:2,gpu:x", SLURM_GPUS_PER_NODE="a100:4")
  assert distributed.slurm_node_gpus(env) == [0, 1, 2, 3]


def test_a_process_id_alone_is_refused_and_only_process_0_is_main(monkeypatch):
  """initialize: a process_id without num_processes names the missing flags (it was dropped
  without a word); is_main_process is true on process 0 only."""
  import jax
  from rlhfuse_jax.parallel import distributed
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  with pytest.raises(ValueError, match="process_id given without coordinator_address and "
                     "num_processes"):
    distributed.initialize(process_id=0)
  assert not calls
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  assert not distributed.is_main_process()
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  assert distributed.is_main_process()
