"""rlhfuse_jax/workdir.py's start of a one-shot binary: an earlier run's outputs move aside."""
import fcntl
import json
import os
import re
import socket
import threading
import time

import pytest

from rlhfuse_jax import workdir as wd

OUTPUTS = ("result.json", "certificate.npz", "schedule.json", "timeline_*.png")


def test_an_earlier_runs_outputs_move_to_previous_and_nothing_else_does(tmp_path):
  run = tmp_path / "run"
  assert wd.start_outputs(str(run), {"a": 1}, OUTPUTS) is None  # a new workdir
  (run / "result.json").write_text("first")
  (run / "certificate.npz").write_text("proof")
  (run / "timeline_fused.png").write_text("png")
  (run / "schedule_cache.json").write_text("reused")  # not an output: stays
  (run / "notes.md").write_text("mine")  # a user's: stays
  (run / "log.txt").write_text("=== start 2\n")  # the sweep streams this start's log into it
  (run / "schedule.json").write_text("go on from here")  # this run's input: stays, and a copy
  dest = wd.start_outputs(str(run), {"a": 2}, OUTPUTS,
                          inputs=(str(run / "schedule.json"), None, "/elsewhere/x"))
  assert dest == str(run / "previous" / "1")
  assert sorted(os.listdir(dest)) == ["certificate.npz", "config.json", "result.json",
                                      "schedule.json", "timeline_fused.png"]
  assert (run / "previous" / "1" / "result.json").read_text() == "first"
  assert json.loads((run / "previous" / "1" / "config.json").read_text()) == {"a": 1}
  assert sorted(os.listdir(run)) == ["config.json", "log.txt", "notes.md", "previous",
                                     "schedule.json", "schedule_cache.json"]
  assert json.loads((run / "config.json").read_text()) == {"a": 2}
  assert (run / "log.txt").read_text() == "=== start 2\n"
  assert wd.start_outputs(str(run), {"a": 3}, OUTPUTS) == str(run / "previous" / "2")
  assert sorted(os.listdir(run / "previous" / "2")) == ["config.json", "schedule.json"]


def test_a_linked_input_stays_and_a_training_workdir_is_refused(tmp_path):
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "hint.json").write_text("hint")
  run = tmp_path / "run"
  run.mkdir()
  (run / "schedule.json").symlink_to(tmp_path / "data" / "hint.json")
  wd.start_outputs(str(run), {}, OUTPUTS, inputs=(str(run / "schedule.json"),))
  assert (run / "schedule.json").read_text() == "hint"  # the link, not only its target
  train = tmp_path / "train"
  (train / "checkpoints").mkdir(parents=True)
  (train / "result.json").write_text("a training run's")
  with pytest.raises(ValueError, match=r"holds a training run \(checkpoints\)"):
    wd.start_outputs(str(train), {}, OUTPUTS)
  assert (train / "result.json").read_text() == "a training run's"


def test_a_sweep_and_the_other_binaries_refuse_each_others_workdirs(tmp_path):
  """train_ppo went on in a finished sweep's directory (its config, metrics, checkpoints beside
  the summary and run folders), and a sweep in a training run's: each is refused now, as the
  one-shot binaries refuse a training workdir."""
  sweep = tmp_path / "sweep"
  sweep.mkdir()
  (sweep / "summary.json").write_text("[]")
  with pytest.raises(wd.ForeignWorkdirError, match=r"holds the outputs of experiments\.sweep "
                                                   r"\(its summary\.json\); give train_ppo a"):
    wd.refuse_foreign_result(str(sweep), "train_ppo", shown="train_ppo")
  wd.refuse_foreign_result(str(sweep), "sweep")  # its own
  train = tmp_path / "train"
  train.mkdir()
  (train / "result.json").write_text(json.dumps(
      {"provenance": {"command": "python -m experiments.train_ppo --config=c.py"}}))
  with pytest.raises(wd.ForeignWorkdirError, match=r"experiments\.train_ppo \(its result\.json\)"
                                                   r"; give experiments\.sweep"):
    wd.refuse_foreign_result(str(train), "sweep")


def test_a_resume_over_a_garbled_log_row_names_the_file_and_the_line(tmp_path):
  """A metrics.jsonl row that is JSON but not an object (a hand edit, a concatenated file), or
  whose step is not a number, stopped the resume with AttributeError ('list' object has no
  attribute 'get') or TypeError, naming neither the file nor the row."""
  path = tmp_path / "metrics.jsonl"
  for line, match in (("[1, 2]", r"metrics\.jsonl:2: expected a JSON object per line, got list"),
                      ("7", r"metrics\.jsonl:2: expected a JSON object per line, got int"),
                      ('{"step": "3"}', r"metrics\.jsonl: a row with step='3': expected an "
                       "integer step"),
                      ('{"step": null}', r"metrics\.jsonl: a row with step=None"),
                      (b'{"step": 2, "x": "\xff"}', r"metrics\.jsonl:2: malformed JSON line")):
    body = line if isinstance(line, bytes) else line.encode()
    path.write_bytes(b'{"step": 1}\n' + body + b'\n{"step": 4}\n')
    with pytest.raises(ValueError, match=match):
      wd.keep_jsonl_through(str(path), 3)
    assert path.read_bytes().endswith(b'{"step": 4}\n')  # left as it was
  path.write_text('{"step": 1}\n{"step": 2.0}\n{"note": "no step"}\n{"step": 4}\n{"st')
  assert wd.keep_jsonl_through(str(path), 3) == [{"step": 1}, {"step": 2.0}, {"note": "no step"}]


def test_a_lock_says_where_its_workdir_moved(tmp_path):
  """WorkdirLock.moved_to: None for a workdir in place, also one reached through a symlink (its
  open file's /proc entry is the real path: taken for a move, it would have told a user whose
  .lock was deleted to resume in the symlink's target); the new directory after a rename."""
  real = tmp_path / "real"
  real.mkdir()
  os.symlink(real, tmp_path / "link")
  lock = wd.WorkdirLock(str(tmp_path / "link"))
  assert lock.moved_to() is None
  os.rename(real, tmp_path / "moved")
  assert lock.moved_to() == os.path.realpath(tmp_path / "moved")
  lock.release()


def test_a_lock_renamed_inside_its_workdir_is_no_move(tmp_path):
  """A .lock renamed in place (mv .lock .lock.old) leaves the workdir where it was: moved_to
  read its new name's directory, the workdir itself, as where the workdir went, so the run
  said "the workdir W was moved to W ... resume with --workdir=W" instead of that its lock was
  replaced (trainer/loop.py _moved)."""
  lock = wd.WorkdirLock(str(tmp_path))
  os.rename(tmp_path / ".lock", tmp_path / ".lock.old")
  assert not lock.held() and lock.moved_to() is None
  lock.release()


def _hold_as(path, line):
  """Locks `path`'s .lock through a file description of its own (flock locks conflict between
  descriptions, also within one process) and writes a holder's line: a run that looks alive."""
  f = open(os.path.join(path, ".lock"), "a+")
  fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  f.seek(0)
  f.truncate()
  f.write(line + "\n")
  f.flush()
  return f


def test_a_lock_held_from_another_host_is_waited_for_until_it_frees(tmp_path):
  """A job requeued onto another node right after its node crashed meets the dead node's lock
  on the shared filesystem until the server's lease on that node ends (NFS): it waits for a
  holder on another host (wait_s), took the lock once freed and wrote its own line; it
  refused at once before, and the requeued job ended."""
  holder = _hold_as(str(tmp_path), "pid 7 on node-that-crashed (start 11)")
  threading.Timer(1.5, holder.close).start()  # the lease ends: the server drops the lock
  t0 = time.monotonic()
  lock = wd.WorkdirLock(str(tmp_path), wait_s=60)
  assert 1.4 <= time.monotonic() - t0 < 30
  assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} on "
                                                     f"{socket.gethostname()} (start ")
  lock.release()


@pytest.mark.parametrize("line,refused_after", [
    # this host's holder is alive (its kernel drops the lock when it exits): no wait
    (f"pid 7 on {socket.gethostname()} (start 11)", 0.0),
    # a line of no known form: nothing to say the holder is elsewhere
    ("something else", 0.0),
    # another host's, held past the wait: refused after it, saying why it may be stale
    ("pid 7 on node-that-crashed (start 11)", 1.0)])
def test_a_lock_that_stays_held_is_refused_naming_the_holder(tmp_path, line, refused_after):
  holder = _hold_as(str(tmp_path), line)
  t0 = time.monotonic()
  with pytest.raises(wd.WorkdirInUseError) as e:
    wd.WorkdirLock(str(tmp_path), wait_s=1.0, wait_field="config.lock_wait_s")
  # (no wait: well under the 1 s wait_s; the wait: 1 s, more on a loaded machine)
  assert refused_after <= time.monotonic() - t0 < (1.0 if refused_after == 0 else 10.0)
  msg = str(e.value)
  assert f"is in use by another run ({line})" in msg
  stale = ("If node-that-crashed is down (a crashed node), a shared filesystem keeps its lock "
           "until the server's lease on it ends (NFSv4: 90 s by default); waited ")
  assert (stale in msg) == ("node-that-crashed" in line), msg
  # (waited 1 s, or 2 s on a loaded machine: %.0f of the seconds it took)
  assert ("node-that-crashed" not in line or
          re.search(r"; waited [12] s \(config\.lock_wait_s=1: how long a start waits for "
                    r"that\)$", msg)), msg
  holder.close()
  wd.WorkdirLock(str(tmp_path)).release()  # free again: nothing of the refusal kept it


def test_no_wait_refuses_another_hosts_lock_at_once_and_says_it_may_be_stale(tmp_path):
  holder = _hold_as(str(tmp_path), "pid 7 on node-that-crashed (start 11)")
  t0 = time.monotonic()
  with pytest.raises(wd.WorkdirInUseError, match=r"If node-that-crashed is down .* \(NFSv4: 90 "
                     r"s by default\)$"):
    wd.WorkdirLock(str(tmp_path))
  assert time.monotonic() - t0 < 1.0
  holder.close()


def test_a_stop_asked_during_the_wait_ends_it_and_a_wait_must_be_finite(tmp_path):
  """`stop` is asked at every poll of the wait: a sweep's SIGTERM handler only records the
  signal, and the sweep waited out the whole --lock_wait_s before exiting 1 (a scheduler's
  SIGKILL usually came first). A wait of nan waited for ever (`waited >= nan` is never true)."""
  holder = _hold_as(str(tmp_path), "pid 7 on node-that-crashed (start 11)")
  asked = []
  t0 = time.monotonic()
  with pytest.raises(wd.LockWaitStopped, match=r"^stopped after waiting [0-9]+ s for the lock "
                     r"of .* held by pid 7 on node-that-crashed \(start 11\)$"):
    wd.WorkdirLock(str(tmp_path), wait_s=60, stop=lambda: asked.append(1) or len(asked) >= 2)
  assert len(asked) == 2 and time.monotonic() - t0 < 10  # the second poll, about 2 s in
  holder.close()
  wd.WorkdirLock(str(tmp_path)).release()  # nothing of the stopped wait kept the lock
  # A stop that comes in the wait's last poll interval is a stop (exit 75 for a sweep), not
  # the refusal at its end (exit 1).
  holder = _hold_as(str(tmp_path), "pid 7 on node-that-crashed (start 11)")
  t0 = time.monotonic()
  with pytest.raises(wd.LockWaitStopped):
    wd.WorkdirLock(str(tmp_path), wait_s=1, stop=lambda: time.monotonic() - t0 >= 0.9)
  holder.close()
  for bad in (float("nan"), float("inf"), -1.0, True):
    with pytest.raises(ValueError, match=r"^--lock_wait_s=.*: expected a finite number of "
                                         r"seconds >= 0$"):
      wd.WorkdirLock(str(tmp_path), wait_s=bad, wait_field="--lock_wait_s")


def test_a_model_directory_is_not_set_aside_as_an_earlier_start(tmp_path):
  """set_aside_earlier_start moved every config*.json, a Hugging Face model's too (the workdir
  was the model's directory): refused now, before anything moves; a run's config (a JSON
  object without the model keys) still moves."""
  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
  (model / "metrics.jsonl").write_text("{}\n")
  with pytest.raises(wd.ForeignWorkdirError, match=r"holds config\.json, a model's config "
                                                   r"\(architectures \['LlamaForCausalLM'\]\)"):
    wd.set_aside_earlier_start(str(model))
  assert sorted(os.listdir(model)) == ["config.json", "metrics.jsonl"]
  (model / "config.json").write_text("[1, 2]")
  with pytest.raises(wd.ForeignWorkdirError, match=r"config\.json, not a JSON object"):
    wd.refuse_foreign_configs(str(model))
  (model / "config.json").write_text(json.dumps({"model": {"model_types": 1}, "seed": 0}))
  assert wd.set_aside_earlier_start(str(model)) == str(model / "previous" / "1")
  assert sorted(os.listdir(model / "previous" / "1")) == ["config.json", "metrics.jsonl"]


def test_write_json_keeps_a_list_of_numbers_on_one_line(tmp_path):
  """Indented JSON took a line per number: bench_async's 2,400-point curves made a 157 kB
  result.json (95 kB of numbers). A list of numbers now stays on one line; every other value
  is laid out as json.dumps(indent=2) lays it out, and everything reads back as it was."""
  import numpy as np
  path = tmp_path / "result.json"
  obj = {"curve": [0.5, 1, None, True, -1e-7], "pairs": [[0, 1.5], [2, 3]],
         "names": ["a", "b"], "mixed": ["x", 1], "empty": [], "nested": {"x": {}}}
  wd.write_json(str(path), obj)
  text = path.read_text()
  assert json.loads(text) == obj and text.endswith("}\n")
  assert '\n  "curve": [0.5, 1, null, true, -1e-07],\n' in text
  assert '\n  "pairs": [\n    [0, 1.5],\n    [2, 3]\n  ],\n' in text
  assert '\n  "mixed": [\n    "x",\n    1\n  ],\n' in text  # (not numbers alone)
  plain = {"names": ["a", "b"], "empty": [], "obj": {"x": {}, "y": [{"z": "w\u00e9"}, []]}}
  assert wd.dumps_json(plain) == json.dumps(plain, indent=2)
  curve = np.arange(2400, dtype=np.float32) / 7
  wd.write_json(str(path), {"reward": curve})
  assert len(path.read_text().splitlines()) == 3
  assert json.loads(path.read_text())["reward"] == curve.tolist()


def test_fsync_directory_syncs_it_and_passes_a_filesystem_that_cannot(tmp_path, monkeypatch):
  """fsync_directory fsyncs the directory itself (the names in it: the HF export's rename);
  a filesystem that refuses to sync a directory (EINVAL) is passed over, any other error is
  raised and the descriptor closed either way."""
  import errno
  synced, opened, fail = [], [], []
  real_open, real_close = os.open, os.close

  def fsync(fd):
    synced.append(os.fstat(fd).st_ino)
    if fail:
      raise OSError(fail[0], os.strerror(fail[0]))
  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "open", lambda *a: opened.append(real_open(*a)) or opened[-1])
  monkeypatch.setattr(os, "close", lambda fd: opened.remove(fd) or real_close(fd))
  wd.fsync_directory(str(tmp_path))
  assert synced == [os.stat(tmp_path).st_ino] and opened == []
  fail.append(errno.EINVAL)
  wd.fsync_directory(str(tmp_path))
  fail[0] = errno.EIO
  with pytest.raises(OSError, match=r"\[Errno 5\]"):
    wd.fsync_directory(str(tmp_path))
  assert len(synced) == 3 and opened == []
