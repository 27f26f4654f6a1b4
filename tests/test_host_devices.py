"""Child processes keep the caller's XLA flags and get their own host-device count."""
import os
import pathlib
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from rlhfuse_jax.parallel.host_devices import host_device_env, xla_flags_with_host_devices
from tests.test_train_ppo_binary import REPO
from tests.xla_env import RESET_SIGINT

COUNT = "--xla_force_host_platform_device_count"


def test_the_count_is_replaced_and_every_other_flag_kept():
  flags = f"--xla_a=1 {COUNT}=8 --xla_b {COUNT}=8"
  assert xla_flags_with_host_devices(4, flags) == f"--xla_a=1 --xla_b {COUNT}=4"
  assert xla_flags_with_host_devices(2, "") == f"{COUNT}=2"
  assert xla_flags_with_host_devices(None, f"--xla_a\t{COUNT}=8") == "--xla_a"


def test_a_child_env_sets_jax_num_cpu_devices_to_the_count_where_the_caller_has_it(monkeypatch):
  """jax's JAX_NUM_CPU_DEVICES overrides the XLA flag: a user's exported value gave every
  child its own count (plan_check, bench_async, bench_generation's reference, the launcher)."""
  monkeypatch.setenv("XLA_FLAGS", f"--xla_a=1 {COUNT}=8")
  monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
  assert host_device_env(4) == {"XLA_FLAGS": f"--xla_a=1 {COUNT}=4"}  # not added
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "2")
  assert host_device_env(4) == {"XLA_FLAGS": f"--xla_a=1 {COUNT}=4", "JAX_NUM_CPU_DEVICES": "4"}
  assert host_device_env(None) == {"XLA_FLAGS": "--xla_a=1", "JAX_NUM_CPU_DEVICES": "-1"}
  monkeypatch.setenv("XLA_FLAGS", "")  # (XLA aborts on the made-up --xla_a)
  out = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"],
                       env=dict(os.environ, JAX_PLATFORMS="cpu", **host_device_env(3)),
                       capture_output=True, text=True, timeout=120)
  assert out.stdout.split()[-1] == "3", (out.stdout, out.stderr)


def _stand_in(path, body: str, python: bool = True):
  """An executable bash script at `path` running `body`. python: it stands in for the
  interpreter, so the launcher's own `python -c` call (which rewrites the flags) goes first to
  the real one."""
  real = f'[[ $1 == -c ]] && exec {sys.executable} "$@"\n' if python else ""
  path.write_text(f"#!/usr/bin/env bash\n{real}{body}\n")
  path.chmod(path.stat().st_mode | stat.S_IEXEC)
  return path


def test_the_launcher_passes_the_callers_flags_to_every_process(tmp_path):
  # Stands in for the interpreter: records what each process got.
  fake = _stand_in(tmp_path / "python",
                   'echo "XLA_FLAGS=$XLA_FLAGS JAX_NUM_CPU_DEVICES=$JAX_NUM_CPU_DEVICES ARGS=$*"')
  # A tab between flags, and a value bash would glob against README.md (the launcher runs in
  # the repository root) if it split the flags unquoted. The caller's JAX_NUM_CPU_DEVICES,
  # which jax takes over the flag, becomes the launcher's count too.
  env = dict(os.environ, PYTHON=str(fake), XLA_FLAGS=f"--xla_a=1 {COUNT}=8\tREADM*",
             JAX_NUM_CPU_DEVICES="8")
  wd = str(tmp_path / "run")
  subprocess.run(["bash", "launch/local_multiprocess.sh", "2", "3", wd], cwd=REPO, env=env,
                 check=True, capture_output=True, timeout=60)
  for i in range(2):
    log = pathlib.Path(f"{wd}.proc{i}.log").read_text()
    assert (f"XLA_FLAGS=--xla_a=1 READM* {COUNT}=3 JAX_NUM_CPU_DEVICES=3 "
            "ARGS=-m experiments.train_ppo") in log, log
    assert f"--process_id={i}" in log, log


def test_the_launcher_refuses_a_port_in_use_at_once(tmp_path):
  """A PORT in use: process 0 failed with jax's "Failed to start RPC server" and the others
  waited 5 minutes in jax.distributed.initialize, then aborted. Refused before any process
  starts, naming the port."""
  fake = _stand_in(tmp_path / "python", 'echo started')
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    out = subprocess.run(["bash", "launch/local_multiprocess.sh", "2", "1", str(tmp_path / "wd")],
                         cwd=REPO, env=dict(os.environ, PYTHON=str(fake), PORT=str(port)),
                         capture_output=True, text=True, timeout=60)
  assert out.returncode == 2, (out.stdout, out.stderr)
  assert f"PORT={port}: the port is in use" in out.stderr, out.stderr
  assert not (tmp_path / "wd.proc0.log").exists()
  # Not a port number: said so (it was "in use" too).
  for bad in ("abc", "70000", "0", "80 81"):
    out = subprocess.run(["bash", "launch/local_multiprocess.sh", "2", "1", str(tmp_path / "wd")],
                         cwd=REPO, env=dict(os.environ, PYTHON=str(fake), PORT=bad),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and (f"PORT={bad}: expected a TCP port number, 1-65535"
                                    in out.stderr), (bad, out.stderr)
  assert not (tmp_path / "wd.proc0.log").exists()


def test_the_tpu_script_runs_from_the_repository_root_wherever_it_is_started(tmp_path):
  """launch/tpu_pod.sh started outside the checkout: every worker failed with "No module named
  'experiments'". It runs the binary in the repository root, with a relative workdir or config
  file made absolute against where it was started; configs/X.py (not a file there) and a URI
  (refused by the binary, naming it) stay as given. The binary replaces the script's shell
  (exec): a signal to the launcher's pid reaches the run (a child left running went on,
  holding the workdir)."""
  fake = _stand_in(tmp_path / "python", f'echo "$PWD python $*" >> {tmp_path}/calls; '
                   f'echo $$ > {tmp_path}/pid', python=False)
  (tmp_path / "mine.py").write_text("")
  for config, workdir, want in (
      ("configs/ppo_tiny.py:fused", "runs/wd",
       f"--config=configs/ppo_tiny.py:fused --workdir={tmp_path}/runs/wd"),
      ("mine.py:x", "gs://bucket/wd", f"--config={tmp_path}/mine.py:x --workdir=gs://bucket/wd")):
    with subprocess.Popen(["bash", os.path.join(REPO, "launch", "tpu_pod.sh"), config,
                           workdir], cwd=tmp_path, env=dict(os.environ, PYTHON=str(fake)),
                          stderr=subprocess.PIPE, text=True) as out:
      assert out.wait(timeout=60) == 0, out.stderr.read()
    assert (tmp_path / "pid").read_text().strip() == str(out.pid)
    last = (tmp_path / "calls").read_text().splitlines()[-1]
    assert last == f"{REPO} python -m experiments.train_ppo {want} --distributed", last


def test_the_launcher_refuses_the_flags_it_sets_itself(tmp_path):
  """--config among the extra flags (as a plain run is given it) failed every process in absl
  with "The flag 'config.num_iterations' is defined twice", naming neither flag nor CONFIG.
  A --config.<field> override still passes."""
  fake = _stand_in(tmp_path / "python", 'echo "ARGS=$*"')
  env = dict(os.environ, PYTHON=str(fake))
  wd = str(tmp_path / "wd")
  # (absl takes one dash too, and --distributed=false turned the launcher's flag off)
  for flag in ("--config=configs/ppo_tiny.py:fused", "--workdir=/tmp/x", "--process_id=1",
               "-workdir=/tmp/x", "--distributed=false", "-config", "-nodistributed"):
    out = subprocess.run(["bash", "launch/local_multiprocess.sh", "2", "1", wd,
                          "--config.num_iterations=3", flag], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (flag, out.stdout, out.stderr)
    assert f"{flag.split('=')[0]}: the launcher sets it for every process" in out.stderr
    assert "CONFIG=..." in out.stderr and not os.path.exists(f"{wd}.proc0.log")
  out = subprocess.run(["bash", "launch/local_multiprocess.sh", "1", "1", wd,
                        "--config.num_iterations=3"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 0 and "--config.num_iterations=3" in open(f"{wd}.proc0.log").read()


def test_the_launcher_refuses_a_binary_that_does_not_run_as_several_processes(tmp_path):
  """BINARY=plan_search (a real binary without --distributed) started every process, and each
  failed on absl's unknown flag 'distributed'."""
  fake = _stand_in(tmp_path / "python", 'echo started')
  wd = str(tmp_path / "wd")
  for binary in ("plan_search", "nope"):
    out = subprocess.run(["bash", "launch/local_multiprocess.sh", "2", "1", wd], cwd=REPO,
                         env=dict(os.environ, PYTHON=str(fake), BINARY=binary),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (binary, out.stdout, out.stderr)
    assert f"BINARY={binary}: expected train_ppo or bench_generation" in out.stderr
    assert not os.path.exists(f"{wd}.proc0.log")


def test_the_launcher_refuses_a_uri_workdir_before_it_writes_anything(tmp_path):
  """WORKDIR=gs://bucket/wd was made "absolute" against where the launcher started: folders
  gs:/bucket were made there and the processes' logs written into them (status 0 here, with a
  stand-in for the binary; train_ppo then refused the mangled --workdir=/.../gs://bucket/wd)."""
  fake = _stand_in(tmp_path / "python", 'echo started')
  start = tmp_path / "start"
  start.mkdir()
  for uri in ("gs://bucket/wd", "s3://b/wd/"):
    out = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", "1",
                          uri], cwd=start, env=dict(os.environ, PYTHON=str(fake)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (uri, out.stdout, out.stderr)
    assert f"WORKDIR={uri}: a URI, but the workdir is a directory on this machine" in out.stderr
  assert not list(start.iterdir()) and not os.path.exists(os.path.join(REPO, "gs:"))


def test_the_launcher_runs_where_flock_fails_without_a_holder(tmp_path):
  """On a filesystem without locks flock(1) exits 71 ("No locks available"), and the launcher
  took any failure for a lock held: every start after the first (a resume; the last run's
  .lock names this host) was refused as "in use by another run", where train_ppo warns and
  runs unlocked. Only flock's status for a held lock (1) refuses."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  fake = _stand_in(tmp_path / "python", 'echo started')
  wd = tmp_path / "wd"
  wd.mkdir()
  (wd / ".lock").write_text(f"pid 1 on {socket.gethostname()} (start 5)\n")
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=str(fake),
             FOLLOW="0")
  for status, refused in ((71, False), (65, False), (1, True)):
    _stand_in(bin_dir / "flock", f'echo "flock: $2: why {status}" >&2; exit {status}',
              python=False)
    out = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "1", "1",
                          str(wd)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == (1 if refused else 0), (status, out.stdout, out.stderr)
    assert ("is in use by another run (pid 1 on" in out.stderr) == refused, out.stderr
    assert f"why {status}" not in out.stderr, out.stderr  # (the binary says why)


def test_the_launcher_reads_relative_paths_where_it_was_started(tmp_path):
  """A relative workdir, config file and interpreter are the caller's, not the repository's
  (the launcher runs from the repository root): the logs landed inside the repository, and a
  relative CONFIG or PYTHON=.venv/bin/python was looked for there. configs/X.py, not a file
  where the caller is, stays as given (the repository's)."""
  bin_dir = tmp_path / "venv" / "bin"
  bin_dir.mkdir(parents=True)
  _stand_in(bin_dir / "python", 'echo "ARGS=$*"')
  (tmp_path / "mine.py").write_text("")
  launcher = os.path.join(REPO, "launch", "local_multiprocess.sh")
  for config, want in (("mine.py:fused", f"--config={tmp_path}/mine.py:fused"),
                       ("configs/ppo_tiny.py:fused", "--config=configs/ppo_tiny.py:fused")):
    env = dict(os.environ, PYTHON="venv/bin/python", CONFIG=config)
    out = subprocess.run(["bash", launcher, "1", "1", "runs/wd"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"tail -f {tmp_path}/runs/wd.proc0.log" in out.stdout, out.stdout
    log = (tmp_path / "runs" / "wd.proc0.log").read_text()
    assert f"{want} --workdir={tmp_path}/runs/wd " in log, log
  assert not os.path.exists(os.path.join(REPO, "runs", "wd.proc0.log"))


def _path_flag_files(tmp_path):
  """What the launchers' path-flag tests name: ps/plan.json, p.jsonl and a model/ folder, where
  the launcher is started (tmp_path)."""
  (tmp_path / "ps").mkdir()
  (tmp_path / "ps" / "plan.json").write_text("{}")
  (tmp_path / "p.jsonl").write_text("")
  (tmp_path / "model").mkdir()


def _launch_with_paths(tmp_path, script, flags):
  """`script` started in tmp_path with `flags`, its python a stand-in that logs its arguments:
  (the launcher's CompletedProcess, which must exit 0; the arguments the processes got)."""
  fake = _stand_in(tmp_path / "python", f'echo "ARGS=$*" >> {tmp_path}/calls')
  first = ["1", "1"] if script == "local_multiprocess.sh" else ["configs/ppo_tiny.py"]
  out = subprocess.run(["bash", os.path.join(REPO, "launch", script), *first, "wd", *flags],
                       cwd=tmp_path, env=dict(os.environ, PYTHON=str(fake), FOLLOW="0"),
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  return out, (tmp_path / "calls").read_text()


@pytest.mark.parametrize("script", ["local_multiprocess.sh", "tpu_pod.sh"])
def test_the_launchers_read_a_flags_relative_path_where_started_if_only_there(tmp_path, script):
  """--config.plan.file=ps/plan.json, given from the directory that holds ps/, was read from
  the repository root (where the processes run) and every process stopped on "No such file"
  naming ps/plan.json alone (tpu_pod.sh: every worker). A relative path that names nothing
  under the root and something where the launcher was started is made absolute, and said; one
  under the root is read there as before; one found in neither place is said, naming both. A
  bare word is passed as given, said: --config.reward.kind=model, started beside a model/
  folder, became that folder's path."""
  _path_flag_files(tmp_path)
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "ppo_tiny.py").write_text("")  # also under the root: the root's
  flags = ["--config.plan.file=ps/plan.json", "--config.data.prompts_file=./ps/plan.json",
           "--config.pipeline.schedule_file=configs/ppo_tiny.py", "--config.data.task=repeat",
           "--config.init.tokenizer=nothere/tok.json", "--config.num_iterations=2",
           "--config.reward.kind=model", "--config.data.val_file=p.jsonl"]
  out, log = _launch_with_paths(tmp_path, script, flags)
  assert (f"--config.plan.file={tmp_path}/ps/plan.json --config.data.prompts_file={tmp_path}/"
          "./ps/plan.json --config.pipeline.schedule_file=configs/ppo_tiny.py "
          "--config.data.task=repeat --config.init.tokenizer=nothere/tok.json "
          f"--config.num_iterations=2 --config.reward.kind=model "
          f"--config.data.val_file={tmp_path}/p.jsonl") in log, log
  assert (f"--config.plan.file=ps/plan.json: not under the repository root ({REPO}), where "
          "the processes read a relative path; read where the launcher was started: "
          f"{tmp_path}/ps/plan.json") in out.stderr, out.stderr
  assert (f"--config.init.tokenizer=nothere/tok.json: a relative path, which the processes "
          f"read (or write) under the repository root ({REPO}); it names nothing there, nor "
          f"where the launcher was started ({tmp_path})") in out.stderr, out.stderr
  assert ("--config.reward.kind=model: passed as given (a name, or a path the processes read "
          f"under the repository root, {REPO}); for the one where the launcher was started, "
          "give ./model") in out.stderr, out.stderr
  assert "schedule_file" not in out.stderr and "data.task" not in out.stderr, out.stderr


@pytest.mark.parametrize("script", ["local_multiprocess.sh", "tpu_pod.sh"])
def test_the_launchers_read_a_space_separated_flags_path_as_the_equals_form(tmp_path, script):
  """absl reads --config.plan.file ps/plan.json (the value as the next argument) as it reads
  --config.plan.file=ps/plan.json, but the launchers rewrote the '=' form alone: the space
  form's relative path was passed as given, read from the repository root, and every process
  stopped on "No such file" naming ps/plan.json alone. Both forms are rewritten and said alike;
  a flag without a value (a boolean) before another flag is left alone."""
  _path_flag_files(tmp_path)
  flags = ["--config.plan.file", "ps/plan.json", "--config.fusion.inter_stage",
           "--config.data.val_file", "p.jsonl", "--config.reward.kind", "model",
           "-config.init.tokenizer", "nothere/tok.json", "--config.num_iterations", "2"]
  out, log = _launch_with_paths(tmp_path, script, flags)
  assert (f"--config.plan.file {tmp_path}/ps/plan.json --config.fusion.inter_stage "
          f"--config.data.val_file {tmp_path}/p.jsonl --config.reward.kind model "
          "-config.init.tokenizer nothere/tok.json --config.num_iterations 2") in log, log
  assert (f"--config.plan.file ps/plan.json: not under the repository root ({REPO}), where "
          "the processes read a relative path; read where the launcher was started: "
          f"{tmp_path}/ps/plan.json") in out.stderr, out.stderr
  assert ("--config.reward.kind model: passed as given (a name, or a path the processes read "
          f"under the repository root, {REPO}); for the one where the launcher was started, "
          "give ./model") in out.stderr, out.stderr
  assert (f"-config.init.tokenizer nothere/tok.json: a relative path, which the processes "
          f"read (or write) under the repository root ({REPO}); it names nothing there, nor "
          f"where the launcher was started ({tmp_path})") in out.stderr, out.stderr
  assert "inter_stage" not in out.stderr and "num_iterations" not in out.stderr, out.stderr


def test_the_launcher_exits_with_a_failure_rather_than_a_clean_stop(tmp_path):
  """Process statuses (0 saved-and-stopped 75, 1 failed with 3): the launcher exits 3, not 75
  (a caller would requeue a failed run as resumable) and not the last process's status; a
  process's own failure (1) beside one that lost it (69, peer lost; 134, jax's or gloo's abort
  for a lost peer) gives 1, not 69; each
  process's status is in its last line. All stopped on SIGTERM: 75; all fine: 0. Process 0's
  output is shown as it runs, and the end of each failed process's log after."""
  launcher = os.path.join(REPO, "launch", "local_multiprocess.sh")
  for codes, want in (((75, 3), 3), ((3, 75), 3), ((75, 75), 75), ((0, 75), 75), ((0, 0), 0),
                      ((2, 3), 2), ((69, 1), 1), ((69, 75), 69), ((0, 69), 69)):
    fake = _stand_in(tmp_path / "python", "case \"$*\" in\n" + "".join(
        f"  *--process_id={i}*) echo 'why {i} ended'; exit {c};;\n"
        for i, c in enumerate(codes)) + "esac")
    out = subprocess.run(["bash", launcher, "2", "1", str(tmp_path / "run")], cwd=REPO,
                         env=dict(os.environ, PYTHON=str(fake)), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == want, (codes, out.stdout, out.stderr)
    assert f"(process:status): 0:{codes[0]} 1:{codes[1]}; exit status {want}" in out.stdout
    assert out.stdout.count("why 0 ended") == 1, out.stdout  # followed, not repeated
    failed_1 = f"--- process 1 exited {codes[1]}\n--- the end of {tmp_path}/run.proc1.log:"
    assert (failed_1 in out.stdout) == (codes[1] not in (0, 75)), out.stdout
    assert out.stdout.count("why 1 ended") == (codes[1] not in (0, 75)), out.stdout
  # After a runtime abort the log ends in a stack dump: its last error line comes first; a
  # fatal (F) line is the cause, even with an error line after it, unless the run logged its
  # own reason for exiting.
  for name, lines, cause in (
      ("abort", "echo 'E1130 15:00:00.000 1 x.py:9] ValueError: the cause'; "
                "for i in $(seq 30); do echo \"  frame $i\"; done",
       "E1130 15:00:00.000 1 x.py:9] ValueError: the cause"),
      ("fatal", "echo 'F1130 15:00:00.000 1 c.cc:9] Check failed: the cause'; "
                "echo 'E1130 15:00:01.000 1 c.cc:9] a consequence'",
       "F1130 15:00:00.000 1 c.cc:9] Check failed: the cause"),
      # the run's own reason (a lost peer) before the runtime's fatal line about it
      ("peer", "echo 'E1130 15:00:00.000 1 m.py:9] process 1 of 2: a collective failed; "
               "exiting (69)'; echo 'F1130 15:00:00.100 1 c.cc:9] Terminating process'",
       "E1130 15:00:00.000 1 m.py:9] process 1 of 2: a collective failed; exiting (69)")):
    fake = _stand_in(tmp_path / "python", "case \"$*\" in\n  *--process_id=0*) exit 0;;\n"
                     f"  *) {lines}; exit 134;;\nesac")
    out = subprocess.run(["bash", launcher, "2", "1", str(tmp_path / name)], cwd=REPO,
                         env=dict(os.environ, PYTHON=str(fake)), capture_output=True, text=True,
                         timeout=60)
    assert f"--- process 1 exited 134; its last error: {cause}\n" in out.stdout, out.stdout
  # jax aborts a process whose peer stopped heartbeating (an error on that peer alone): the
  # peer's failure gives the status, as a 69 would leave it, even when the abort is process 0's.
  abort = ("echo 'F1201 06:29:31.977143 9714 client.h:80] Terminating process because the JAX "
           "distributed service detected fatal errors. This most likely indicates that another "
           "task died'; for i in $(seq 40000); do echo \"  frame $i of the abort's stack\"; done; "
           "exit 134")  # a log longer than a pipe's buffer: read whole, not through `| grep -q`
  # gloo (CPU collectives) aborts a process whose peer was killed mid-message, blaming "a
  # distributed collective mismatch in your code": the killed peer's 137 gave the status (it
  # was 134, the survivor's, as if it had failed on its own).
  gloo = ("echo \"terminate called after throwing an instance of 'gloo::EnforceNotMet'\"; echo "
          "\"  what():  [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:459] "
          "op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected "
          "size. Is there a distributed collective mismatch in your code?\"; exit 134")
  for codes, want in (((abort, "exit 1"), 1), (("exit 1", abort), 1), ((abort, "exit 0"), 134),
                      ((gloo, "exit 137"), 137), (("exit 137", gloo), 137)):
    fake = _stand_in(tmp_path / "python", "case \"$*\" in\n" + "".join(
        f"  *--process_id={i}*) {c};;\n" for i, c in enumerate(codes)) + "esac")
    out = subprocess.run(["bash", launcher, "2", "1", str(tmp_path / "lost")], cwd=REPO,
                         env=dict(os.environ, PYTHON=str(fake)), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == want, (codes, out.stdout, out.stderr)


def test_the_same_error_on_every_process_is_shown_once(tmp_path):
  """Every process refusing the same bad input (a batch that does not divide over the data
  axes): the error and its log's end are shown for the first to end, the others name it. (3
  processes printed three 15-line tails; which ends first is up to the scheduler. Process 0's
  note that it exits in 10 s is not its cause.)"""
  fake = _stand_in(tmp_path / "python", 'for a in "$@"; do [[ $a == --process_id=* ]] && '
                   'i=${a#--process_id=}; done\n'
                   # (the last a little behind the others, as a slower import is)
                   '[[ $i == 2 ]] && sleep 0.6\n'
                   'echo "E1201 06:00:0$i.000 10$i validate.py:114] ValueError: config.batch=64 '
                   'must be a multiple of 6"; for k in $(seq 20); do echo "  frame $k of $i"; '
                   'done\n'
                   # process 0's last error line, after its own (config_files.exit_now): it was
                   # taken for its cause, so the others' same error was shown again
                   '[[ $i == 0 ]] && echo "E1201 06:00:09.000 100 config_files.py:321] process 0 '
                   'exits in 10 s (the others that fail too report their errors first)"; exit 1')
  out = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "3", "1",
                        str(tmp_path / "run")], cwd=REPO, env=dict(os.environ, PYTHON=str(fake),
                        FOLLOW="0"), capture_output=True, text=True, timeout=60)
  assert out.returncode == 1, out.stdout + out.stderr
  assert out.stdout.count("must be a multiple of 6") == 1, out.stdout
  assert len(re.findall(r"--- process \d exited 1 with process \d's error", out.stdout)) == 2
  # (they ended within a second: none was said to wait for another in a collective)
  assert "still running" not in out.stdout, out.stdout


def test_process_0_s_followed_error_is_not_shown_again(tmp_path):
  """The same bad input on every process, with process 0 followed (the default): process 0
  logs its error and waits 10 s before exiting (config_files.exit_now), so the others ended
  first and the first of them printed the same error again, with its log's last 15 lines. Now
  it names process 0's error, already on screen."""
  if subprocess.run(["tail", "--pid=1", "-n", "0", "/dev/null"], capture_output=True).returncode:
    pytest.skip("process 0 is followed with GNU tail's --pid")
  error = ("E1201 06:00:00.000 100 validate.py:114] ValueError: config.batch=64 must be a "
           "multiple of 6")
  fake = _stand_in(tmp_path / "python", 'for a in "$@"; do [[ $a == --process_id=* ]] && '
                   'i=${a#--process_id=}; done\n'
                   # (the others a little behind process 0, which then waits before it exits)
                   f'[[ $i != 0 ]] && sleep 0.5; echo "{error}"\n'
                   'for k in $(seq 20); do echo "  frame $k of $i"; done\n'
                   '[[ $i == 0 ]] && echo "E1201 06:00:00.100 100 config_files.py:321] process 0 '
                   'exits in 2 s (the others that fail too report their errors first)" && '
                   'sleep 2; exit 1')
  out = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "3", "1",
                        str(tmp_path / "run")], cwd=REPO, env=dict(os.environ, PYTHON=str(fake)),
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 1, out.stdout + out.stderr
  assert out.stdout.count("must be a multiple of 6") == 1, out.stdout  # process 0's, followed
  # (the second to end may name the first's, the same)
  assert len(re.findall(r"--- process [12] exited 1 with process [01]'s error", out.stdout)) == 2
  assert "--- process 1 exited 1 with process 0's error (above)" in out.stdout, out.stdout
  # Another error on process 1 is still shown with its log's end.
  fake.write_text(fake.read_text().replace('echo "E1201', 'echo "E1201 $i'))
  out = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", "1",
                        str(tmp_path / "run2")], cwd=REPO, env=dict(os.environ, PYTHON=str(fake)),
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 1, out.stdout + out.stderr
  assert f"--- process 1 exited 1; its last error: E1201 1 {error[6:]}" in out.stdout, out.stdout
  assert f"--- the end of {tmp_path}/run2.proc1.log:" in out.stdout, out.stdout


def test_absl_s_flag_parsing_error_is_named_as_the_cause(tmp_path):
  """absl's bad command line ("FATAL Flags parsing error: ...") matched none of the error
  patterns: no "its last error", and every process's identical error and log tail shown."""
  fake = _stand_in(tmp_path / "python", "echo \"FATAL Flags parsing error: --config.x='y': "
                   "expected an integer\"; echo 'Pass --helpshort or --helpfull'; exit 1")
  out = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", "1",
                        str(tmp_path / "run")], cwd=REPO, env=dict(os.environ, PYTHON=str(fake),
                        FOLLOW="0"), capture_output=True, text=True, timeout=60)
  assert out.returncode == 1, out.stdout + out.stderr
  assert re.search(r"--- process \d exited 1; its last error: FATAL Flags parsing error: "
                   r"--config.x='y'", out.stdout), out.stdout
  assert out.stdout.count("expected an integer") == 2, out.stdout  # the cause, and its log's end


@pytest.mark.parametrize("failing", [1, 0])
def test_the_launcher_shows_a_failure_while_the_other_processes_still_run(tmp_path, failing):
  """One process fails at once; the other waits (as for it in a collective) until the test has
  seen the failure on the launcher's output. Before, the reason came only after every process
  had ended: after jax.distributed's timeout. Process 0's own output is on screen already
  (followed): for it only the note that the others still run."""
  other = 1 - failing
  seen = tmp_path / "seen"
  fake = _stand_in(tmp_path / "python", f"""case "$*" in
  *--process_id={failing}*) echo 'why {failing} ended'; exit 3;;
  *) for _ in $(seq 200); do [[ -e {seen} ]] && exit 0; sleep 0.1; done; echo 'gave up';;
esac""")
  note = f"1 process(es) still running 2 s after process {failing} exited 3"
  with subprocess.Popen(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2",
                         "1", str(tmp_path / "run")], cwd=REPO, env=dict(os.environ,
                        PYTHON=str(fake)), stdout=subprocess.PIPE, text=True) as launcher:
    try:
      lines = []
      for line in launcher.stdout:
        lines.append(line)
        if note in line:
          seen.touch()
      assert launcher.wait(timeout=60) == 3
    finally:
      launcher.kill()
  out = "".join(lines)
  assert "gave up" not in out and seen.exists(), out
  assert out.count(f"why {failing} ended") == 1, out  # shown once: its log's end, or followed
  assert out.count(f"--- process {failing} exited 3") == (failing == 1), out
  codes = {failing: 3, other: 0}
  assert f"(process:status): 0:{codes[0]} 1:{codes[1]}; exit status 3" in out, out


def test_a_signal_to_the_launcher_stops_every_process(tmp_path):
  """A SIGINT or SIGTERM to the launcher (its pid alone: `kill`): it passes SIGTERM to every
  process and waits for them (which save and exit 75); a second signal kills them. Before, the
  launcher died and its processes trained on, holding the workdir. (A terminal's Ctrl-C, to
  the whole process group: the next test.)"""
  # Stands in for train_ppo: exits 75 on SIGTERM, as the trainer does after saving.
  fake = _stand_in(
      tmp_path / "python",
      f'exec {sys.executable} -c "import signal, sys, time\n'
      'signal.signal(signal.SIGTERM, lambda s, f: (print(\'got\', s, flush=True), sys.exit(75)))\n'
      'print(\'ready\', flush=True)\n'
      'time.sleep(30 if \'--process_id=0\' in sys.argv else 0.5)" "$@"')
  env = dict(os.environ, PYTHON=str(fake))
  for sig in (signal.SIGINT, signal.SIGTERM):
    wd = str(tmp_path / f"run{sig}")
    logs = [pathlib.Path(f"{wd}.proc{i}.log") for i in range(2)]
    # SIGINT as a terminal's shell leaves it: pytest-xdist's workers ignore it, and bash can
    # neither trap nor reset a signal ignored when it starts. (An exec'ing interpreter, not
    # preexec_fn, which forks a multithreaded process.)
    with subprocess.Popen([*RESET_SIGINT, "bash",
                           "launch/local_multiprocess.sh", "2", "1", wd], cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                          ) as launcher:
      try:
        deadline = time.time() + 30
        while not all(p.exists() and "ready" in p.read_text() for p in logs):
          assert time.time() < deadline and launcher.poll() is None
          time.sleep(0.05)
        time.sleep(1)  # process 1 has ended (0), process 0 still runs
        launcher.send_signal(sig)
        assert launcher.wait(timeout=30) == 75, launcher.stderr.read()
      finally:
        launcher.kill()
    assert "got 15" in logs[0].read_text(), logs[0].read_text()


def test_the_slurm_script_requeues_a_run_stopped_after_saving(tmp_path):
  """launch/slurm_gpu.sbatch with stand-ins for srun and scontrol: exit 75 (SIGTERM before the
  time limit, --signal=TERM@600: saved) requeues the job and keeps the status, as does 69 up to
  MAX_REQUEUES times; another status is returned as it is; submitted outside the repository it
  says so."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name, body in (("srun", f'echo "srun $* cpus=${{SRUN_CPUS_PER_TASK:-unset}}" >> '
                             f'{tmp_path}/calls; exit $SRUN_RC'),
                     ("scontrol", f'echo "scontrol $*" >> {tmp_path}/calls')):
    _stand_in(bin_dir / name, body, python=False)
  script = os.path.join(REPO, "launch", "slurm_gpu.sbatch")
  # 69 (a lost peer, a hung iteration: re-run to resume) requeues MAX_REQUEUES (3) times in a
  # job's life, so a fault that comes back every start ends the job; counted by the script, not
  # by SLURM_RESTART_COUNT, which counts exit 75's time-limit requeues too (a job requeued 3
  # times at its limit got no retry on its first 69). Another job's count is its own.
  wd = tmp_path / "wd"
  wd.mkdir()
  for job, rc, restarts, requeued in (
      ("4242", 75, 0, True), ("4242", 3, 1, False), ("4242", 75, 1, True),
      ("4242", 75, 2, True), ("4242", 69, 3, True), ("4242", 69, 4, True),
      ("4242", 75, 5, True), ("4242", 69, 6, True), ("4242", 69, 7, False),
      ("4242", 75, 7, True), ("77", 69, 0, True)):
    (tmp_path / "calls").write_text("")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SRUN_RC=str(rc),
               SLURM_JOB_ID=job, SLURM_CPUS_ON_NODE="96", SLURM_RESTART_COUNT=str(restarts))
    env.pop("SRUN_CPUS_PER_TASK", None)
    env.pop("SLURM_CPUS_PER_TASK", None)
    out = subprocess.run(["bash", script, "configs/ppo_tiny.py", str(wd), "--x=1"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == rc, out.stderr
    calls = (tmp_path / "calls").read_text()
    assert (f"-m experiments.train_ppo --config=configs/ppo_tiny.py --workdir={wd} "
            "--distributed --x=1") in calls, calls
    assert (f"scontrol requeue {job}" in calls) == requeued, (rc, restarts, calls)
    if rc == 69:
      assert (f"requeueing job {job}" if requeued else
              "exit 69 again after 3 requeues for it") in out.stderr, out.stderr
    # the node's CPUs for its one process (srun >= 22.05 gave it one)
    assert calls.splitlines()[0].endswith("cpus=96"), calls
  assert (wd / ".slurm_requeues_69.4242").read_text() == "3\n"
  assert (wd / ".slurm_requeues_69.77").read_text() == "1\n"
  out = subprocess.run(["bash", script, "c.py", "/wd"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 2 and "submit from the repository root" in out.stderr, out.stderr
  with open(script) as f:
    text = f.read()
  assert "#SBATCH --signal=TERM@600" in text and "#SBATCH --open-mode=append" in text


def test_the_slurm_script_requeues_a_stop_whatever_the_sites_kill_on_bad_exit(tmp_path):
  """A site's slurm.conf KillOnBadExit=1 (0 by default) has srun SIGTERM, then SIGKILL, every
  other task as soon as one exits non-zero, 75 and 69 included, and a task ended by a signal
  outranks every exit code in srun's status (Slurm's src/srun/launch.c): a stop after saving
  whose processes exit a moment apart (one still tearing down, its signal handlers given back)
  ended the step with 143, and the job was not requeued. The script runs srun with
  --kill-on-bad-exit=0: srun waits for every task (tests/fake_srun.py models srun)."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  calls = tmp_path / "calls"
  _stand_in(bin_dir / "srun", f'exec {sys.executable} {REPO}/tests/fake_srun.py "$@"',
            python=False)
  _stand_in(bin_dir / "scontrol", f'echo "scontrol $*" >> {calls}', python=False)
  # Task 0 exits 75 at once, task 1 (its process's teardown) 1.5 s later; SIGTERM ends it.
  fake = _stand_in(tmp_path / "python",
                   f'exec {sys.executable} -c "import os, sys, time\n'
                   'time.sleep(1.5 * int(os.environ[\'SLURM_PROCID\']))\n'
                   'sys.exit(75)" "$@"', python=False)
  wd = tmp_path / "wd"
  wd.mkdir()
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=str(fake),
             SLURM_JOB_ID="31", FAKE_SRUN_NTASKS="2", FAKE_SRUN_KILL_ON_BAD_EXIT="1",
             FAKE_SRUN_KILL_WAIT="1", FAKE_SRUN_CALLS=str(calls))
  # What srun without the option gives on such a site: 128 + SIGTERM, not requeued.
  out = subprocess.run(["srun", str(fake)], env=env, capture_output=True, text=True,
                       timeout=60)
  assert out.returncode == 128 + signal.SIGTERM, (out.returncode, out.stderr)
  out = subprocess.run(["bash", os.path.join(REPO, "launch", "slurm_gpu.sbatch"),
                        "configs/ppo_tiny.py", str(wd)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 75, (out.returncode, out.stderr)
  assert (f"srun --kill-on-bad-exit=0 bash launch/slurm_task.sh {fake} -m experiments.train_ppo"
          in calls.read_text()), calls.read_text()
  assert "scontrol requeue 31" in calls.read_text(), calls.read_text()


def test_the_slurm_script_refuses_a_bad_max_requeues_before_the_run(tmp_path):
  """MAX_REQUEUES was read only once a process had exited 69, after the run: "abc" ended the
  script on "unbound variable" (status 1, the 69 lost, no requeue), "3x", "1.5" and "08" (octal
  to bash) on arithmetic errors, with "not requeued". Refused before srun, naming it; 0 (never
  requeue a 69) and unset (3) still run."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  _stand_in(bin_dir / "srun", f'echo "srun $*" >> {tmp_path}/calls; exit 69', python=False)
  _stand_in(bin_dir / "scontrol", f'echo "scontrol $*" >> {tmp_path}/calls', python=False)
  wd = tmp_path / "wd"
  wd.mkdir()
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="5")
  run = lambda **more: subprocess.run(
      ["bash", os.path.join(REPO, "launch", "slurm_gpu.sbatch"), "configs/ppo_tiny.py",
       str(wd)], cwd=REPO, env=dict(env, **more), capture_output=True, text=True, timeout=60)
  for bad in ("abc", "3x", "1.5", "08", "-1"):
    out = run(MAX_REQUEUES=bad)
    assert out.returncode == 2, (bad, out.returncode, out.stderr)
    assert f"MAX_REQUEUES={bad}: expected a whole number >= 0" in out.stderr, out.stderr
    assert not (tmp_path / "calls").exists(), (tmp_path / "calls").read_text()
  out = run(MAX_REQUEUES="0")
  assert out.returncode == 69 and "exit 69 again after 0 requeues" in out.stderr, out.stderr
  assert "scontrol" not in (tmp_path / "calls").read_text()
  env.pop("MAX_REQUEUES", None)
  out = run()
  assert out.returncode == 69 and "requeue 1 of MAX_REQUEUES=3" in out.stderr, out.stderr
  assert "scontrol requeue 5" in (tmp_path / "calls").read_text()


def test_the_slurm_script_keeps_the_status_when_requeue_fails(tmp_path):
  """A failed `scontrol requeue` (a site that forbids it) ended the script under set -e with
  scontrol's status 1 in place of the run's 75 or 69, after it had said "requeueing". The
  status is kept and the log says the job was not requeued."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  _stand_in(bin_dir / "srun", "exit $SRUN_RC", python=False)
  _stand_in(bin_dir / "scontrol", 'echo "scontrol: error: Requeue of job $2 denied" >&2; exit 1',
            python=False)
  wd = tmp_path / "wd"
  wd.mkdir()
  for rc in (75, 69):
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SRUN_RC=str(rc),
               SLURM_JOB_ID="9")
    out = subprocess.run(["bash", os.path.join(REPO, "launch", "slurm_gpu.sbatch"),
                          "configs/ppo_tiny.py", str(wd)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == rc, (rc, out.returncode, out.stderr)
    assert "scontrol requeue 9 failed (above): the job is not requeued" in out.stderr, out.stderr


@pytest.mark.parametrize("script", ["slurm_gpu.sbatch", "tpu_pod.sh", "local_multiprocess.sh"])
def test_the_launchers_run_python3_where_there_is_no_python(tmp_path, script):
  """Without PYTHON the launchers ran `python`, which Cloud TPU VMs and many clusters' images
  lack (only python3): every process failed with "python: command not found" (127). They take
  python3 from PATH, else python, and refuse with status 2, naming PYTHON, where neither is."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  calls = tmp_path / "calls"
  _stand_in(bin_dir / "srun", 'while [[ $1 == -* ]]; do shift; done; "$@"', python=False)
  _stand_in(bin_dir / "python3", f'echo "$(basename "$0") $*" >> {calls}')
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "SLURM_JOB_ID")}
  # (a PATH with no `python`: the system's directories may hold python3, not this stand-in's)
  env["PATH"] = f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"
  run = lambda path: subprocess.run(
      [shutil.which("bash"), os.path.join(REPO, "launch", script),
       *(["1", "1"] if script == "local_multiprocess.sh" else ["configs/ppo_tiny.py"]),
       str(tmp_path / "wd")], cwd=REPO, env=dict(env, PATH=path, FOLLOW="0"),
      capture_output=True, text=True, timeout=120)
  out = run(env["PATH"])
  assert out.returncode == 0, out.stdout + out.stderr
  assert re.search(r"^python3 -m experiments\.train_ppo .*--distributed", calls.read_text(),
                   re.M), calls.read_text()
  # Neither on PATH (only what the launchers run before they look: dirname)
  bare = tmp_path / "bare"
  bare.mkdir()
  (bare / "dirname").symlink_to(shutil.which("dirname"))
  out = run(str(bare))
  assert out.returncode == 2, out.stdout + out.stderr
  assert "neither python3 nor python is on PATH: set PYTHON" in out.stderr, out.stderr


@pytest.mark.parametrize("script", ["slurm_gpu.sbatch", "tpu_pod.sh"])
def test_the_cluster_scripts_refuse_a_binary_or_flag_they_cannot_run(tmp_path, script):
  """launch/slurm_gpu.sbatch and launch/tpu_pod.sh, as the local launcher: a BINARY without
  --distributed (every node failed on absl's "Unknown command line flag 'distributed'", after
  the allocation) and the flags the script sets or jax detects (a second --config replaced
  CONFIG without a word; a --process_id was every process's) are refused before any process
  starts, naming what to change; train_ppo and bench_generation still start."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  _stand_in(bin_dir / "srun", f'echo "srun $*" >> {tmp_path}/calls', python=False)
  fake = _stand_in(tmp_path / "python", f'echo "python $*" >> {tmp_path}/calls', python=False)
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=str(fake))
  env.pop("SLURM_JOB_ID", None)
  run = lambda *extra, **more: subprocess.run(
      ["bash", os.path.join(REPO, "launch", script), "configs/ppo_tiny.py", "/shared/wd",
       *extra], cwd=REPO, env=dict(env, **more), capture_output=True, text=True, timeout=60)
  refused = [(("--config=configs/ppo_tiny.py:fused",), {}, "--config: this script sets it"),
             (("--process_id=1",), {}, "--process_id: this script sets it"),
             (("--nodistributed",), {}, "--nodistributed: this script sets it"),
             (("--distributed=false",), {}, "--distributed: this script sets it"),
             (("-workdir=/other",), {}, "-workdir: this script sets it"),
             ((), {"BINARY": "plan_check"}, "BINARY=plan_check: expected train_ppo or "
                                            "bench_generation")]
  for extra, more, message in refused:
    out = run(*extra, **more)
    assert out.returncode == 2 and message in out.stderr, (extra, more, out.stderr)
    assert not (tmp_path / "calls").exists(), (tmp_path / "calls").read_text()
  for binary in ("train_ppo", "bench_generation"):
    out = run("--config.seed=3", BINARY=binary)
    assert out.returncode == 0, out.stderr
    # (tpu_pod.sh makes a config file it finds absolute: it runs in the repository root)
    config = ("" if script == "slurm_gpu.sbatch" else f"{REPO}/") + "configs/ppo_tiny.py"
    assert (f"-m experiments.{binary} --config={config} --workdir=/shared/wd "
            "--distributed --config.seed=3") in (tmp_path / "calls").read_text()


def test_a_ctrl_c_reaches_the_launcher_and_every_process_that_handles_sigint(tmp_path):
  """A terminal's Ctrl-C goes to its whole foreground process group, the launcher's background
  processes included: they start with SIGINT ignored (bash without job control), but one that
  installs a SIGINT handler, as train_ppo does (trainer/hooks.stop_signals), gets the Ctrl-C
  itself and then the launcher's SIGTERM; one that keeps the ignore gets the SIGTERM alone. All
  exit 75 and so does the launcher. (The launcher's comment said a Ctrl-C "reaches the launcher
  alone".)"""
  fake = _stand_in(
      tmp_path / "python",
      f'exec {sys.executable} -c "import os, signal, sys, time\n'
      'print(\'ignored at start\', signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n'
      # One write per line (os.write): the launcher's SIGTERM can come while the SIGINT
      # handler prints, and print's separate writes of 'got', ' 2' and the newline, cut by the
      # SIGTERM handler's exit, left 'gotgot 15' on a loaded machine.
      'say = lambda s: os.write(1, (\'got %d\\\\n\' % s).encode())\n'
      'if os.environ[\'HANDLE\'] == \'1\':\n'
      '  signal.signal(signal.SIGINT, lambda s, f: say(s))\n'
      'signal.signal(signal.SIGTERM, lambda s, f: (say(s), sys.exit(75)))\n'
      'print(\'ready\', flush=True)\n'
      'time.sleep(30)" "$@"')
  for handle, got in (("1", ["got 2", "got 15"]), ("0", ["got 15"])):
    wd = str(tmp_path / f"run{handle}")
    logs = [pathlib.Path(f"{wd}.proc{i}.log") for i in range(2)]
    # In a session of its own, as a terminal's foreground job; SIGINT not ignored (RESET_SIGINT)
    with subprocess.Popen([*RESET_SIGINT, "bash", "launch/local_multiprocess.sh", "2", "1", wd],
                          cwd=REPO, env=dict(os.environ, PYTHON=str(fake), HANDLE=handle,
                                             FOLLOW="0"),
                          start_new_session=True, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as launcher:
      try:
        deadline = time.time() + 30
        while not all(p.exists() and "ready" in p.read_text() for p in logs):
          assert time.time() < deadline and launcher.poll() is None
          time.sleep(0.05)
        os.killpg(launcher.pid, signal.SIGINT)  # the terminal's Ctrl-C
        assert launcher.wait(timeout=30) == 75, launcher.stderr.read()
      finally:
        launcher.kill()
    for log in logs:
      lines = log.read_text().splitlines()
      assert lines[1:3] == ["ignored at start True", "ready"] and lines[3:] == got, lines
