"""experiments/train_ppo end to end: SIGTERM / SIGINT save and exit with the stopped status.
(What a run writes, kill -9 and resume, a finished run: tests/test_faults.py.)"""
import gc
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from rlhfuse_jax.trainer import hooks
from tests.xla_env import RESET_SIGINT, subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Same shapes as tests/test_trainer.tiny_config (test_multiprocess compares the two).
SMALL = ["--config.model.num_layers=1", "--config.critic_model.num_layers=1",
         "--config.model.hidden_size=32", "--config.critic_model.hidden_size=32",
         "--config.model.intermediate_size=64", "--config.critic_model.intermediate_size=64",
         "--config.rollout.chunk_size=3",
         "--config.rollout.prompts_per_iteration=16", "--config.algo.minibatch_size=8",
         "--config.rollout.max_new_tokens=6", "--config.data.num_prompts=64",
         "--config.checkpoint.every=2"]


def _cmd(workdir, *extra):
  return [sys.executable, "-m", "experiments.train_ppo", "--config=configs/ppo_tiny.py",
          f"--workdir={workdir}", *SMALL, *extra]


def _env(**extra):
  return subprocess_env(**extra)  # the binary runs on the one real CPU device, as a user's would


COMPILE_LOG = "Compiling "  # what jax logs for every XLA compile with JAX_LOG_COMPILES=1
# The docs/architecture.md §1 metric names every iteration's row carries.
METRIC_NAMES = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
                "actor/grad_norm", "critic/vf_loss", "critic/vf_clipfrac",
                "critic/vf_explained_var", "reward/mean", "kl/ref_mean", "response_length/mean",
                "response_length/max", "response_length/clip_ratio", "timing_s/generate",
                "timing_s/inference", "timing_s/train", "timing_s/step", "perf/tokens_per_s")


def _steps(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["step"] for line in f if line.strip()]


def test_sigterm_saves_and_exits_with_the_stopped_status(tmp_path):
  """The binary: SIGTERM (a scheduler's preemption) saves where it stops and exits 75. SIGINT
  takes the same handler (test_sigint_stops_like_sigterm_and_twice_interrupts_at_once)."""
  wd = str(tmp_path / "run")
  # An earlier start's failure (corrected since): removed once this start finishes or stops,
  # not left beside its results (log.txt keeps every start's traceback).
  os.makedirs(wd)
  with open(os.path.join(wd, "traceback.txt"), "w") as f:
    f.write("ValueError: config.data.task='countdwn'")
  os.utime(os.path.join(wd, "traceback.txt"), (time.time() - 60,) * 2)
  proc = subprocess.Popen(_cmd(wd, "--config.num_iterations=10000",
                               "--config.checkpoint.every=10000"),
                          cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  metrics = os.path.join(wd, "metrics.jsonl")
  deadline = time.time() + 500
  while not (os.path.exists(metrics) and len(_steps(wd)) >= 2):
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    assert time.time() < deadline, "no iterations within the deadline"
    time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  # 75: stopped after saving, re-run to resume (a scheduler tells it from completion, 0).
  assert proc.returncode == 75, err.decode()[-3000:]
  last = _steps(wd)[-1]
  ckpts = [int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()]
  assert ckpts == [last], (ckpts, last)  # saved exactly where it stopped
  # The config of the start, recorded once it knew where it started (PPOTrainer.run).
  assert json.load(open(os.path.join(wd, "config.json")))["num_iterations"] == 10000
  result = json.load(open(os.path.join(wd, "result.json")))  # not mistaken for a finished run
  assert (result["status"], result["iterations"]) == ("stopped", last), result
  # The start that trained them, with its code and machine (provenance is the last start's).
  made = result["provenance"]
  assert [(s["from"], s["to"], s["git_commit"], s["host_cpu"], s["started"])
          for s in result["trained_by"]] == [
              (0, last, made["git_commit"], made["host_cpu"], made["started"])], result
  assert not os.path.exists(os.path.join(wd, "traceback.txt"))


def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path):
  """Ctrl-C twice (or more): the run stops without the save the first asked for, exit 130, and
  says so in one line (it printed Python's ~40-line KeyboardInterrupt traceback, and with a
  save in flight orbax's threads failed at the interpreter's shutdown, ~80 lines more); the
  traceback is kept in log.txt, and the earlier checkpoints stay. (A second Ctrl-C that lands
  inside orbax's own wait for a save still gets orbax's log of it.)"""
  wd = str(tmp_path / "run")
  proc = subprocess.Popen([*RESET_SIGINT, *_cmd(wd, "--config.num_iterations=10000")],
                          cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  deadline = time.time() + 500
  while not (os.path.exists(os.path.join(wd, "metrics.jsonl")) and len(_steps(wd)) >= 3):
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    assert time.time() < deadline, "no iterations within the deadline"
    time.sleep(0.2)
  # Ctrl-C pressed repeatedly until the run ends: the first asks for the save, the next one
  # that the run handles after it stops it at once, and the rest are ignored. (Two presses 20 ms
  # apart were not enough: a signal that arrives before Python ran the handler of the one before
  # it, while the main thread is in a long C call, is merged with it into one handler call.)
  for _ in range(2000):
    proc.send_signal(signal.SIGINT)
    try:  # (communicate reads the pipes while it waits; a retry loses none of their output)
      _, err = proc.communicate(timeout=0.05)
      break
    except subprocess.TimeoutExpired:
      pass
  else:
    _, err = proc.communicate(timeout=300)
  err = err.decode()
  assert proc.returncode == 130, err[-3000:]
  assert "interrupted by Ctrl-C (a second one, or one after the last iteration): stopped at " \
      "once without saving" in err, err[-3000:]
  assert "cannot schedule new futures" not in err and "File \"" not in err.split(
      "interrupted by Ctrl-C")[1], err[-3000:]
  with open(os.path.join(wd, "log.txt")) as f:
    assert "KeyboardInterrupt" in f.read()
  # The earlier checkpoints stay: which ones depends on how many iterations ran before the
  # presses were handled (it asserted checkpoint 2, which retention removes once a run on a
  # quiet machine reaches iteration 6 first: 2 of 5 runs alone).
  ckpts = sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit())
  assert ckpts and ckpts[-1] <= _steps(wd)[-1], (ckpts, _steps(wd))


def test_a_signal_during_set_up_exits_with_the_stopped_status(tmp_path):
  """A preemption while the run sets up (before the loop's handlers exist) exits 75 too, with
  the workdir unlocked and nothing written for an iteration: before, SIGTERM killed it with
  143, which a scheduler's requeue rule (launch/slurm_gpu.sbatch) does not resume."""
  from rlhfuse_jax import workdir as wdlib
  wd = str(tmp_path / "run")
  proc = subprocess.Popen(_cmd(wd), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
  deadline = time.time() + 300
  lock = os.path.join(wd, ".lock")  # taken (the holder's pid written) first thing in set-up
  while not (os.path.exists(lock) and open(lock).read().startswith("pid ")):
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    assert time.time() < deadline, "the run never took its workdir lock"
    time.sleep(0.01)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  err = err.decode()
  assert proc.returncode == 75, err[-3000:]
  assert "signal 15 came before training began" in err, err[-3000:]
  assert not os.path.exists(os.path.join(wd, "metrics.jsonl"))
  wdlib.WorkdirLock(wd).release()  # free: the lock was given back


def _signal_self(sig):
  """`sig` to this thread (raise(3): its C handler has run when it returns; os.kill to the
  process may deliver it to another of jax's or xdist's threads later, and an assert right after
  it failed on a loaded machine), with automatic garbage collection off until the handler has
  run. Python runs a handler at its next bytecode boundary; a collection there would run it
  inside jax's gc callback, where its exception is swallowed ("Exception ignored in
  _xla_gc_callback") instead of reaching the test."""
  was = gc.isenabled()
  gc.disable()
  try:
    signal.raise_signal(sig)
  finally:
    if was:
      gc.enable()


def test_signals_before_the_loop_raise_and_the_loops_own_handler_takes_over():
  before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  with hooks.stop_before_training():
    with pytest.raises(hooks.StoppedBeforeTraining) as stopped:
      _signal_self(signal.SIGTERM)
    assert stopped.value.signum == signal.SIGTERM
    # The signal stays recorded: where the handler's raise is dropped (Python ran it inside a
    # gc callback or a __del__, which print and drop exceptions) the next agreement point
    # stops the run. (A SIGTERM right after the workdir lock once went unnoticed on a loaded
    # CI machine: the run trained to the end.)
    with pytest.raises(hooks.StoppedBeforeTraining):
      hooks.agree_setup_signal()
    try:
      signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    except hooks.StoppedBeforeTraining:
      pass  # dropped, as in a gc callback
    with pytest.raises(hooks.StoppedBeforeTraining) as stopped:
      hooks.StopFlag().begin(0)  # the loop's start is such a point
    assert stopped.value.signum == signal.SIGTERM
    flag = hooks.StopFlag()
    flag.begin(0)
    try:
      _signal_self(signal.SIGTERM)  # the loop's: finish the iteration, save
      assert flag.set and flag.signal == signal.SIGTERM
    finally:
      flag.end(failing=False)
    # Given back after the loop (result.json, a failed save's exit): not "before training".
    with pytest.raises(KeyboardInterrupt):
      _signal_self(signal.SIGINT)
  assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.parametrize("mine, others", [(signal.SIGTERM, 0), (0, signal.SIGTERM), (0, 0)])
def test_several_processes_stop_together_when_a_signal_came_during_set_up(monkeypatch, mine,
                                                                          others):
  """Several processes: a signal during set-up is only recorded, and the loop's start stops
  every process together (the largest signal over them), with the stopped status; before,
  the signalled process left alone and the others waited for it in a collective."""
  import jax
  from rlhfuse_jax.parallel import distributed
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(distributed, "max_over_processes", lambda v: max(v, others))
  before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  with hooks.stop_before_training():
    assert not hooks.setup_signal_pending()
    if mine:
      _signal_self(mine)  # recorded, not raised: the set-up goes on
    # (what ends process 0's wait for the workdir lock: trainer/loop.py)
    assert hooks.setup_signal_pending() == bool(mine)
    flag = hooks.StopFlag()
    if mine or others:
      with pytest.raises(hooks.StoppedBeforeTraining) as stopped:
        flag.begin(0)
      assert stopped.value.signum == signal.SIGTERM
    else:
      flag.begin(0)
      flag.end(failing=False)
  assert {sig: signal.getsignal(sig) for sig in before} == before
  # The set-up's other points of agreement (trainer/loop.py: after the workdir lock, after
  # reading the checkpoints, around the restore) stop as soon as one is reached; the signal is
  # then used up.
  with hooks.stop_before_training():
    if mine:
      _signal_self(mine)
    if mine or others:
      with pytest.raises(hooks.StoppedBeforeTraining):
        hooks.agree_setup_signal()
    monkeypatch.setattr(distributed, "max_over_processes", lambda v: v)
    hooks.agree_setup_signal()  # nothing pending any more
  # A second signal during another set-up stops at once, this process alone (train_ppo then
  # leaves without jax's exit barrier, which would wait for the others); an agreed stop is not
  # alone.
  with hooks.stop_before_training():
    _signal_self(signal.SIGTERM)
    with pytest.raises(hooks.StoppedBeforeTraining) as stopped:
      _signal_self(signal.SIGTERM)
    assert stopped.value.alone
  with hooks.stop_before_training():
    _signal_self(signal.SIGTERM)
    with pytest.raises(hooks.StoppedBeforeTraining) as stopped:
      hooks.agree_setup_signal()
    assert not stopped.value.alone


def test_a_launchers_sigterm_after_a_ctrl_c_in_set_up_is_the_same_stop(monkeypatch):
  """Several processes: a Ctrl-C reaches every process and the launcher, which passes SIGTERM
  on (launch/local_multiprocess.sh). That SIGTERM is the same stop, not a second signal: it
  stopped each process alone (raised inside jax's gc callback, a dropped traceback). A second
  Ctrl-C still stops this process at once."""
  import jax
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  with hooks.stop_before_training():
    _signal_self(signal.SIGINT)  # recorded
    _signal_self(signal.SIGTERM)  # the launcher's: nothing more
    assert hooks._LOOP["pending"] == signal.SIGINT
    with pytest.raises(hooks.StoppedBeforeTraining) as stopped:
      _signal_self(signal.SIGINT)  # Ctrl-C again
    assert stopped.value.alone


def test_sighup_stops_like_sigterm_unless_ignored():
  """A closed terminal or dropped ssh session (SIGHUP) stops the run cleanly, as SIGTERM does
  (it killed the run without saving); under nohup (SIGHUP ignored) the run goes on. The test
  starts from SIGHUP's default whatever it inherited: run under nohup (the suite started with
  `nohup bash .ci/run`), the first half found SIGHUP ignored, as a run under nohup must, and
  failed."""
  before = signal.getsignal(signal.SIGHUP)
  signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a terminal's session
  try:
    flag = hooks.StopFlag()
    flag.begin(0)
    try:
      _signal_self(signal.SIGHUP)
      assert flag.set and flag.signal == signal.SIGHUP
    finally:
      flag.end(failing=False)
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # handed back
    with hooks.stop_before_training():
      with pytest.raises(hooks.StoppedBeforeTraining):
        _signal_self(signal.SIGHUP)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
    assert signal.SIGHUP not in hooks.stop_signals()
    flag = hooks.StopFlag()
    flag.begin(0)
    try:
      _signal_self(signal.SIGHUP)
      assert not flag.set
    finally:
      flag.end(failing=False)
  finally:
    signal.signal(signal.SIGHUP, before)


def test_sigint_stops_like_sigterm_and_twice_interrupts_at_once():
  flag = hooks.StopFlag()
  before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  flag.begin(0)
  try:
    assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == flag._handle
    _signal_self(signal.SIGINT)  # Ctrl-C: finish the iteration, save, exit
    assert flag.set and flag.signal == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C again: stop now
      _signal_self(signal.SIGINT)
  finally:
    flag.end(failing=False)
  assert {sig: signal.getsignal(sig) for sig in before} == before  # handlers given back


def test_a_second_ctrl_c_while_the_first_is_logged_interrupts(monkeypatch):
  """Python runs a signal's handler between two bytecodes of whatever runs, the first signal's
  handler included: a second Ctrl-C that landed while the first one's warning was written saw
  no first signal (the flag was set after the log), logged into the same stream again (a
  reentrant write, reported as a logging traceback) and never interrupted: the run went on
  to save and exit 75 (seen once in a whole-suite run of the binary test above). A SIGTERM
  that lands there is not logged a second time."""
  for second, interrupts in ((signal.SIGINT, True), (signal.SIGTERM, False)):
    flag, logged = hooks.StopFlag(), []

    def warning(msg, *args, flag=flag, second=second):
      logged.append(msg % args)
      if len(logged) == 1:  # the second signal lands while the first is being logged
        flag._handle(second, None)
    monkeypatch.setattr(hooks.logging, "warning", warning)
    if interrupts:
      with pytest.raises(KeyboardInterrupt):
        flag._handle(signal.SIGINT, None)
    else:
      flag._handle(signal.SIGINT, None)
    assert flag.set and flag.signal == signal.SIGINT
    assert len(logged) == 1 and logged[0].startswith("signal 2: finishing this iteration")


def test_a_signal_after_the_last_iteration_says_the_run_is_ending(monkeypatch):
  """Once the loop's iterations are over (stop.ending, set as the loop's end hooks run: the last
  checkpoint's save and wait) there is no iteration left to finish: the message says what the
  run waits for, and Ctrl-C again still stops it at once."""
  flag, logged = hooks.StopFlag(), []
  monkeypatch.setattr(hooks.logging, "warning", lambda msg, *args: logged.append(msg % args))
  flag.ending = True
  flag._handle(signal.SIGTERM, None)
  assert flag.set and flag.signal == signal.SIGTERM
  assert logged == ["signal 15: the run is ending; waiting for its last checkpoint to be saved "
                    "(Ctrl-C again: stop now without it)"]
  with pytest.raises(KeyboardInterrupt):
    flag._handle(signal.SIGINT, None)
  assert len(logged) == 1


def test_a_stop_flag_off_the_main_thread_installs_nothing():
  """Python installs signal handlers from the main thread only: a trainer driven from another
  thread runs without them instead of failing before its first iteration."""
  import threading
  before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  errors = []

  def body():
    try:
      flag = hooks.StopFlag()
      flag.begin(0)
      flag.end(failing=False)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)
  thread = threading.Thread(target=body)
  thread.start()
  thread.join()
  assert errors == []
  assert {sig: signal.getsignal(sig) for sig in before} == before


# One jitted program under hooks.enable_compilation_cache(argv[1], argv[2]) (the setting, the
# workdir), printing hooks.cache_note(); _CACHE_NOTE reads its counts.
_CACHED_JIT = ("import sys, jax, jax.numpy as jnp\n"
               "from rlhfuse_jax.trainer import hooks\n"
               "hooks.enable_compilation_cache(sys.argv[1], sys.argv[2])\n"
               "jax.jit(lambda x: x * 3 + 1)(jnp.ones(5)).block_until_ready()\n"
               "print(repr(hooks.cache_note()))\n")
_CACHE_NOTE = re.compile(r"' \(compilation cache so far: (\d+) programs loaded, "
                         r"(\d+) compiled\)'")


def _no_cache_env():
  """_env() without a compilation cache the caller set (it would win over the workdir's)."""
  return {k: v for k, v in _env().items() if not k.startswith(("JAX_COMPILATION_CACHE",
                                                              "JAX_PERSISTENT_CACHE"))}


def test_the_compilation_cache_lives_in_the_workdir_unless_the_caller_set_one(tmp_path):
  """train_ppo's hooks.enable_compilation_cache: WORKDIR/cache/xla by default, and every program
  is written there (a small one too: jax's default skips those under 1 s); 'none' turns it off;
  a JAX_COMPILATION_CACHE_DIR the caller set is kept. (The suite itself runs with its own cache,
  tests/conftest.py, so the binary tests above take the last branch.)"""
  code = ("import sys, jax, jax.numpy as jnp\n"
          "from rlhfuse_jax.trainer import hooks\n"
          "print(hooks.enable_compilation_cache(sys.argv[1], sys.argv[2]))\n"
          "jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()\n")
  env = _no_cache_env()
  for setting, caller, want in (("", None, tmp_path / "a" / "cache" / "xla"),
                                (str(tmp_path / "mine"), None, tmp_path / "mine"),
                                ("none", None, None),
                                ("", str(tmp_path / "callers"), tmp_path / "callers")):
    wd = tmp_path / "a"
    run_env = dict(env, **({"JAX_COMPILATION_CACHE_DIR": caller} if caller else {}))
    out = subprocess.run([sys.executable, "-c", code, setting, str(wd)], cwd=REPO, env=run_env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(want), (setting, out.stdout)
    if want is not None and caller is None:  # (the caller's keeps jax's 1 s threshold)
      assert os.listdir(want), f"nothing cached in {want}"
  assert sorted(os.listdir(tmp_path / "a" / "cache")) == ["xla"]  # 'none' wrote no other


def test_a_restart_says_how_many_programs_it_loaded_from_the_compilation_cache(tmp_path):
  """The first update's log line says what the compilation cache did (hooks.cache_note): a
  restart that loaded its programs showed only in shorter times, nothing said the cache was
  used, or that it was not (a cache directory each host sees apart). Two starts of the same
  program on one cache: the first compiles and writes it, the second loads it; with the cache
  off, nothing is said.

  The second start is on the workdir moved (or copied to another path: a node's scratch)
  before it: it loads the programs of its cache/xla too. jax put the path of its GPU
  autotuning cache, under the cache directory, into every key, so the moved copy compiled
  everything again (0 loaded). (A restart at the same path loads them: the third start of
  test_a_cache_entry_cut_short_is_compiled_again_once_and_written_whole.)"""
  def start(setting, run):
    return subprocess.run([sys.executable, "-c", _CACHED_JIT, setting, str(tmp_path / run)],
                          cwd=REPO, env=_no_cache_env(), capture_output=True, text=True,
                          timeout=120)
  notes = [start("", "run")]
  shutil.move(str(tmp_path / "run"), str(tmp_path / "moved"))
  notes += [start("", "moved"), start("none", "moved")]
  assert all(n.returncode == 0 for n in notes), [n.stderr[-2000:] for n in notes]
  (loaded, written), again = (_CACHE_NOTE.fullmatch(n.stdout.strip()).groups()
                              for n in notes[:2])
  assert loaded == "0" and int(written) >= 1, notes[0].stdout  # the jit and jnp.ones' programs
  assert again == (written, "0"), notes[1].stdout  # every program loaded at the new path
  assert notes[2].stdout.strip() == "''"


def test_a_cache_entry_cut_short_is_compiled_again_once_and_written_whole(tmp_path):
  """jax writes a compilation cache entry in place and never rewrites one that exists: an entry
  cut short (a kill -9 or a full disk while jax wrote it) failed every later start's read
  ("truncated stream"), and its program compiled again each time. The damaged entries (cut,
  empty) are removed as the cache is enabled: the next start compiles once and writes them
  whole, the one after loads everything."""
  run = lambda: subprocess.run([sys.executable, "-c", _CACHED_JIT, "", str(tmp_path / "run")],
                               cwd=REPO, env=_no_cache_env(), capture_output=True, text=True,
                               timeout=120)
  first = run()
  assert first.returncode == 0, first.stderr[-2000:]
  cache = tmp_path / "run" / "cache" / "xla"
  entries = sorted(p for p in cache.iterdir() if p.name.endswith("-cache"))
  whole = {p.name: p.read_bytes() for p in entries}
  assert len(entries) >= 2, entries
  entries[0].write_bytes(whole[entries[0].name][:len(whole[entries[0].name]) // 2])
  entries[1].write_bytes(b"")
  for p in entries[:2]:  # (an entry written in the last seconds is left: it may be in progress)
    os.utime(p, (time.time() - 60, time.time() - 60))
  second = run()
  assert second.returncode == 0, second.stderr[-2000:]
  assert "removed 2 damaged compilation cache entries" in second.stderr, second.stderr[-2000:]
  assert "Error reading persistent compilation cache entry" not in second.stderr
  from jax._src import compilation_cache  # (the format's reader)
  for p in entries:  # written whole again
    compilation_cache.decompress_executable(p.read_bytes())
  third = run()
  loaded, written = _CACHE_NOTE.fullmatch(third.stdout.strip()).groups()
  assert (int(loaded), written) == (len(whole), "0"), third.stdout
  assert "damaged" not in third.stderr


def test_a_damaged_cache_entry_written_just_now_is_left(tmp_path):
  """An entry written in the last seconds may be one another run sharing the cache (a sweep's)
  is writing: left. Older, it is removed; a file that is no entry is never touched."""
  from rlhfuse_jax.trainer import hooks
  (tmp_path / "jit_f-abc-cache").write_bytes(b"cut")
  (tmp_path / "notes.txt").write_bytes(b"cut")
  assert hooks.drop_damaged_cache_entries(str(tmp_path)) == []
  for name in ("jit_f-abc-cache", "notes.txt"):
    os.utime(tmp_path / name, (time.time() - 60, time.time() - 60))
  assert hooks.drop_damaged_cache_entries(str(tmp_path)) == ["jit_f-abc-cache"]
  assert os.listdir(tmp_path) == ["notes.txt"]


def test_a_compilation_cache_dir_that_is_a_file_is_refused_before_the_workdir(tmp_path):
  """config.compilation_cache_dir naming a file (or a path under one) is refused by name before
  the workdir is made: jax warned at every compile and the run went on without a cache."""
  (tmp_path / "afile").write_text("mine")
  env = _no_cache_env()
  for cache in (tmp_path / "afile", tmp_path / "afile" / "xla"):
    wd = str(tmp_path / "run")
    out = subprocess.run(_cmd(wd, f"--config.compilation_cache_dir={cache}"), cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert (f"ValueError: config.compilation_cache_dir='{cache}': {tmp_path / 'afile'} is a "
            "file, not a directory; expected a directory") in out.stderr, out.stderr[-3000:]
    assert not os.path.exists(wd)
  assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("flag, message", [
    ("--config.mesh.data=3", "config.mesh: axes {'data': 3, 'fsdp': 1, 'stage': 1, 'tensor': 1} "
                             "multiply to 3 devices but 8 are available"),
    ("--config.reward.function=tests.test_rewards:two_args",
     "config.reward.function='tests.test_rewards:two_args': reward function "
     "'tests.test_rewards:two_args': its signature (response, answer) cannot take")])
def test_a_bad_mesh_or_reward_function_leaves_no_workdir(tmp_path, flag, message):
  """config.mesh whose axes do not make the devices jax sees, or a reward function that cannot
  be called as it will be, is refused before the workdir is made (they were refused after,
  leaving a workdir with a traceback.txt), naming the field."""
  wd = str(tmp_path / "run")
  env = subprocess_env(8)
  out = subprocess.run([sys.executable, "-m", "experiments.train_ppo",
                        "--config=configs/ppo_tiny.py", f"--workdir={wd}", flag],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  assert message in out.stderr, out.stderr[-3000:]
  assert not os.path.exists(wd)


@pytest.mark.parametrize("flags", [
    ["--coordinator_address=127.0.0.1:1234", "--num_processes=2", "--process_id=1"],
    ["--process_id=0"]])
def test_multi_host_flags_without_distributed_are_refused(tmp_path, flags):
  """--coordinator_address / --num_processes / --process_id are read only with --distributed:
  without it each process of a launch trained a one-process run of its own (the first alone
  held the workdir; the others were refused as "another run holds it")."""
  wd = str(tmp_path / "run")
  out = subprocess.run(_cmd(wd, *flags), cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  assert ("--coordinator_address, --num_processes and --process_id join the processes of one "
          "multi-host run only with --distributed") in out.stderr, out.stderr[-3000:]
  assert not os.path.exists(wd)


def test_an_override_of_the_checkpoints_architecture_leaves_no_workdir(tmp_path):
  """--config.model.num_layers beside init.actor_checkpoint (configs/ppo_hf.py's 2-layer
  model) is refused before the workdir is made, naming the override and the checkpoint's
  value: the run trained the checkpoint's 2 layers, said only in one log line."""
  wd = str(tmp_path / "run")
  out = subprocess.run([sys.executable, "-m", "experiments.train_ppo",
                        "--config=configs/ppo_hf.py", f"--workdir={wd}",
                        "--config.model.num_layers=5"],
                       cwd=REPO, env=subprocess_env(8), capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  assert ("--config.model.num_layers=5 cannot apply: config.init.actor_checkpoint="
          "'configs/data/tiny_llama3_chat' sets the model's architecture from its config.json, "
          "where num_layers is 2.") in out.stderr, out.stderr[-3000:]
  assert not os.path.exists(wd)


_SUMMARIZE = """
import json
import math
from experiments import train_ppo
rows = [{"step": i + 1, "reward/mean": 0.1 * i, "timing_s/step": s, "perf/tokens_per_s": t}
        for i, (s, t) in enumerate([(9.0, 10.0), (0.2, 500.0), (0.4, 300.0), (0.3, 400.0)])]
# A reward model's NaN whose updates guard.on_nonfinite='skip_update' skipped: metrics.jsonl
# holds null for it (workdir._to_jsonable).
skipped = [{"step": i + 1, "reward/mean": None if i in (0, 19) else 0.5 + (i > 9)}
           for i in range(20)]
print(json.dumps([train_ppo.summarize(rows, 4), train_ppo.summarize(rows[:3], 4),
                  train_ppo.summarize([{"step": 1, "reward/mean": 0.0}], 4),
                  train_ppo.summarize(skipped, 20), train_ppo.summarize(skipped[:1], 20),
                  train_ppo.summarize(rows[:3], 4, trained_to=4),
                  train_ppo.summarize([], 4, trained_to=4),
                  train_ppo.summarize(rows, 4, first_of_start={1, 3}),
                  train_ppo.summarize(rows[:1], 4)]))
print(json.dumps([train_ppo.closing_line(train_ppo.summarize(rows, 4), "w/result.json"),
                  train_ppo.closing_line(train_ppo.summarize(rows[:3], 4), "w/result.json"),
                  train_ppo.closing_line(train_ppo.summarize([], 4, trained_to=4), "r.json")]))
import os, tempfile
from rlhfuse_jax.trainer import hooks
with tempfile.TemporaryDirectory() as d:
  for name in ("config.json", "config.4.json", "config.4.1.json", "config.9.json", "c.2.json"):
    open(os.path.join(d, name), "w").close()
  print(json.dumps(hooks.start_points(d)))
"""


def test_result_json_holds_the_throughput_beside_the_reward():
  """result.json's median step time and tokens/s (a sweep of fusion on/off showed only wall_s,
  compiles included: 17 s without inter-stage fusion, 55 s with, in a 4-iteration tiny
  sweep). Each start's first iteration, which compiles, is left out of the medians unless it is
  the only one (the median of a 4-iteration run took it in: half the tokens/s). A reward that
  was not finite is left out of the reward means and counted."""
  out = subprocess.run([sys.executable, "-c", _SUMMARIZE], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  four, three, bare, skipped, none, torn, lost, resumed, one = json.loads(
      out.stdout.strip().splitlines()[-3])
  # The run's last log line carries the headline figures (it said only "done: PATH").
  assert json.loads(out.stdout.strip().splitlines()[-2]) == [
      "done: w/result.json (reward/mean 0 -> 0.3 (first -> last 10 % of iterations); median "
      "0.3 s and 400 tokens/s an iteration)",
      "stopped at iteration 3 of 4: w/result.json (reward/mean 0 -> 0.2 (first -> last 10 % of "
      "iterations); median 0.3 s and 400 tokens/s an iteration)",
      "done: r.json"]
  assert json.loads(out.stdout.strip().splitlines()[-1]) == [0, 4, 9]  # the starts' iterations
  assert (four["median_step_s"], four["median_tokens_per_s"]) == (0.3, 400.0)
  assert (three["median_step_s"], three["median_tokens_per_s"]) == (pytest.approx(0.3), 400.0)
  # A resume at 2: iteration 3 compiled too.
  assert (resumed["median_step_s"], resumed["median_tokens_per_s"]) == (
      pytest.approx(0.25), 450.0)
  assert (one["median_step_s"], one["median_tokens_per_s"]) == (9.0, 10.0)
  assert (three["status"], three["iterations"]) == ("stopped", 3)
  assert (bare["median_step_s"], bare["median_tokens_per_s"]) == (None, None)
  assert "timing_s/step" not in four["final"]  # still in metrics.jsonl alone
  assert "reward_nonfinite_iterations" not in four
  # Iterations whose reward was not finite are left out of the means and counted (a run with
  # one ended in a TypeError and no result.json, the same on every re-run).
  assert (skipped["reward_first_10pct"], skipped["reward_last_10pct"]) == (0.5, 1.5)
  assert (skipped["reward_gain"], skipped["reward_nonfinite_iterations"]) == (1.0, 2)
  assert (none["reward_first_10pct"], none["reward_gain"], none["status"]) == (None, None,
                                                                                "stopped")
  # The status and the count are the trained state's: a finished run re-run after its last row
  # was torn (or metrics.jsonl removed) wrote "stopped" at 3 (or 0) over its "done" at 4.
  assert (torn["status"], torn["iterations"], torn["metrics_missing_iterations"]) == (
      "done", 4, 1)
  assert (lost["status"], lost["iterations"], lost["metrics_missing_iterations"]) == (
      "done", 4, 4)
  assert "metrics_missing_iterations" not in four and "metrics_missing_iterations" not in three


def test_the_nan_guards_stop_is_one_line_saying_what_to_change(tmp_path):
  """A learning rate so large that iteration 1's losses are NaN: the guard's error (the
  iteration, the step, the quantities) ends the run in one line, exit 1, as every input error
  does (it came under a 30-line Python traceback); with no checkpoint yet it says that a re-run
  starts over with the lower rate (it advised resuming with checkpoint.resume_changes)."""
  wd = str(tmp_path / "run")
  out = subprocess.run(_cmd(wd, "--config.num_iterations=2", "--config.optim.warmup_steps=0",
                            "--config.optim.actor_lr=1e8", "--config.optim.critic_lr=1e8"),
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  assert "Traceback (most recent call last)" not in out.stderr, out.stderr[-3000:]
  line = [x for x in out.stderr.splitlines() if "NonFiniteError: " in x]
  assert len(line) == 1 and "iteration 1: non-finite values: update " in line[0], line
  assert "no checkpoint came before it: re-run with a lower optim.actor_lr" in line[0], line
  assert "resume_changes (e.g." not in line[0], line
  assert "NonFiniteError" in open(os.path.join(wd, "traceback.txt")).read()


MESH_FLAGS = ["--config.num_iterations=4", "--config.mesh.data=2", "--config.mesh.fsdp=2",
              "--config.algo.microbatch_size=1"]


@pytest.fixture(scope="module")
def straight_on_a_mesh(tmp_path_factory):
  """An uninterrupted 4-iteration train_ppo run on data 2 x fsdp 2 with micro-batches of one
  row (algo.gradient_sync then applies): (workdir, metrics rows). (4: checkpoints 2 and 4, a
  resume from 2 trains two iterations; it ran 6, two more of the slowest iterations here.)"""
  workdir = str(tmp_path_factory.mktemp("mesh") / "run")
  out = subprocess.run(_cmd(workdir, *MESH_FLAGS), cwd=REPO, env=subprocess_env(4),
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return workdir, [json.loads(line) for line in f if line.strip()]


# Each memory knob of the update a resume may change when named: its flags, the fields named.
MEMORY_KNOBS = [(["--config.model.remat=full", "--config.critic_model.remat=dots"],
                 "critic_model.remat,model.remat"),
                (["--config.algo.gradient_sync=once"], "algo.gradient_sync")]


def test_a_resume_may_change_remat_or_gradient_sync_when_named(tmp_path, straight_on_a_mesh):
  """model.remat (what a block keeps for its backward) and algo.gradient_sync (how the
  accumulated update communicates) are the update's memory knobs: neither changes the saved
  state, yet no resume could change them ("the saved state's layout"), so a run out of memory
  could not resume with remat or per-micro-batch syncing. Unnamed, each is refused with the
  flag to add; named in checkpoint.resume_changes, a resume from iteration 2 with both changed
  trains 3-4 as the uninterrupted run did, up to float rounding (measured on 5-6 of 6
  iterations: within 6e-8 for remat, 2.4e-7 for gradient_sync; one binary start for both, as
  either alone is no closer). (The refusal is the trainer's config check, before anything is
  built: checked in-process on the binary's config, as tiny_config spells it, not in a binary
  start of its own; the binary's exit 1 with such an error: test_the_binary_names_a_bad_value_...
  in test_faults.py.)"""
  import jax
  from rlhfuse_jax.parallel import mesh as mesh_lib
  from rlhfuse_jax.trainer.loop import PPOTrainer
  from tests.test_trainer import tiny_config
  workdir, want = straight_on_a_mesh
  run = str(tmp_path / "run")
  shutil.copytree(workdir, run)
  shutil.rmtree(os.path.join(run, "checkpoints", "4"))  # as a run stopped after iteration 2
  for flags, named in MEMORY_KNOBS:
    cfg = tiny_config(**{"num_iterations": 4, "mesh.data": 2, "mesh.fsdp": 2,
                         "algo.microbatch_size": 1},
                      **{f[len("--config."):].split("=")[0]: f.split("=")[1] for f in flags})
    # (named alone, then ", or": no field but the named ones differs from the saved run's)
    with pytest.raises(ValueError, match=re.escape(
        f"add --config.checkpoint.resume_changes={named}, or resume with the original")):
      PPOTrainer(cfg, run, mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()[:4]))
  flags = [f for knob, _ in MEMORY_KNOBS for f in knob]
  named = ",".join(n for _, n in MEMORY_KNOBS)
  out = subprocess.run(_cmd(run, *MESH_FLAGS, *flags,
                            f"--config.checkpoint.resume_changes={named}"),
                       cwd=REPO, env=subprocess_env(4), capture_output=True, text=True,
                       timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resuming iteration 2 with a changed" in out.stderr, out.stderr[-3000:]
  with open(os.path.join(run, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  for got, wanted in zip(rows[2:], want[2:]):
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "reward/mean",
                "kl/ref_mean"):
      assert got[key] == pytest.approx(wanted[key], rel=1e-4, abs=1e-6), (got["step"], key)


def test_reinforce_baseline_trains_from_the_command_line(tmp_path):
  """REINFORCE++-baseline (algo.estimator='reinforce_baseline') as a user runs it, flags on
  configs/ppo_tiny.py: no critic, each iteration's advantages whitened over the batch (mean
  0), the reward finite, and the policy moves off the reference after the first update."""
  wd = str(tmp_path / "run")
  out = subprocess.run(_cmd(wd, "--config.num_iterations=3", "--config.checkpoint.every=100",
                            "--config.algo.estimator=reinforce_baseline",
                            "--config.rollout.samples_per_prompt=2",
                            "--config.rollout.prompts_per_iteration=8"),
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  assert [r["step"] for r in rows] == [1, 2, 3]
  for r in rows:
    assert not any(k.startswith("critic/") for k in r), sorted(r)
    assert abs(r["advantages/mean"]) < 1e-4, r["advantages/mean"]
    assert math.isfinite(r["reward/mean"]) and math.isfinite(r["actor/pg_loss"])
  kl = [r["kl/ref_mean"] for r in rows]  # the first rollout is the reference's own
  assert kl[0] < 1e-9 and kl[-1] > 1e-5, kl
  result = json.load(open(os.path.join(wd, "result.json")))
  assert (result["status"], result["iterations"]) == ("done", 3), result
