"""launch/slurm_gpu.sbatch's tasks under launch/slurm_task.sh, with tests/fake_srun.py as srun:
a death by a signal is requeued as a lost peer (69, bounded), a stop signal still reaches the
binary, once, and every other status keeps its meaning."""
import os
import signal
import subprocess
import sys
import time

from tests.test_host_devices import _stand_in
from tests.test_train_ppo_binary import REPO

SCRIPT = os.path.join(REPO, "launch", "slurm_gpu.sbatch")


def _slurm_env(tmp_path, body: str, **more) -> dict:
  """The environment of a batch job (id 8, 2 tasks) whose srun is tests/fake_srun.py and whose
  interpreter is a stand-in running the Python code `body`; scontrol's calls go to
  tmp_path/calls."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  _stand_in(bin_dir / "srun", f'exec {sys.executable} {REPO}/tests/fake_srun.py "$@"',
            python=False)
  _stand_in(bin_dir / "scontrol", f'echo "scontrol $*" >> {tmp_path}/calls', python=False)
  (tmp_path / "task.py").write_text(body)
  fake = _stand_in(tmp_path / "python", f'exec {sys.executable} {tmp_path}/task.py "$@"',
                   python=False)
  env = {k: v for k, v in os.environ.items() if k != "MAX_REQUEUES"}
  return dict(env, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=str(fake),
              SLURM_JOB_ID="8", FAKE_SRUN_NTASKS="2", **more)


def test_a_task_killed_or_aborted_requeues_the_job_within_max_requeues(tmp_path):
  """srun's status is its tasks' highest exit status, but a task ended by a signal outranks
  every exit status (Slurm's src/srun/launch.c): a process that jax aborted for a lost peer
  (SIGABRT, 134) or that was killed (SIGKILL, 137: the OOM killer) ended the step with 128 + the
  signal, and the job was not requeued, though only the iterations since the last checkpoint
  were lost. Each task runs under launch/slurm_task.sh, which exits 69 for it: requeued, at most
  MAX_REQUEUES times (a crash at every start ends the job), a process's own failure beside a
  peer aborted for losing it included, as beside a peer's 69. A clean exit, a config error (2,
  or 1 from an exception), a failed write (3) and a stop after saving (75) keep their meaning;
  a 75 beside a killed task still requeues without counting. A binary that a stop signal killed
  (no handler, or a second signal) keeps 128 + the signal, not requeued, as before."""
  body = ("import os, resource, signal, sys\n"
          "how = os.environ['HOW'].split()[int(os.environ['SLURM_PROCID'])]\n"
          "if how in ('ABRT', 'KILL', 'SEGV', 'TERM'):\n"
          "  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # (no core file in the checkout)\n"
          "  os.kill(os.getpid(), getattr(signal, 'SIG' + how))\n"
          "sys.exit(int(how))\n")
  wd = tmp_path / "wd"
  wd.mkdir()
  for how, status, requeued in (
      ("ABRT 69", 69, True), ("0 0", 0, False), ("2 2", 2, False), ("1 1", 1, False),
      ("3 3", 3, False),  # a failed save or metrics write (a full disk): docs/usage.md
      ("75 KILL", 75, True), ("KILL KILL", 69, True), ("75 75", 75, True),
      ("75 TERM", 143, False), ("1 ABRT", 69, True), ("SEGV ABRT", 69, False)):
    (tmp_path / "calls").write_text("")
    out = subprocess.run(["bash", SCRIPT, "configs/ppo_tiny.py", str(wd)], cwd=REPO,
                         env=_slurm_env(tmp_path, body, HOW=how, MAX_REQUEUES="3"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == status, (how, out.returncode, out.stderr)
    assert ("scontrol requeue 8" in (tmp_path / "calls").read_text()) == requeued, (
        how, out.stderr)
    assert "ended by SIGTERM" not in out.stderr, out.stderr
    for sig in how.split():
      if not sig.isdigit() and sig != "TERM":
        assert (f"ended by SIG{sig} (status {128 + getattr(signal, 'SIG' + sig)}); exiting 69"
                in out.stderr), (how, out.stderr)
  # the fourth start that ended 69 is not requeued: the bound
  assert "exit 69 again after 3 requeues for it (MAX_REQUEUES=3)" in out.stderr, out.stderr
  assert (wd / ".slurm_requeues_69.8").read_text() == "3\n"


def test_a_stop_signal_reaches_the_binary_once_and_its_75_requeues(tmp_path):
  """SIGTERM before the time limit (--signal=TERM@600) or at a preemption goes from slurmstepd
  to every process of the step (tests/fake_srun.py: the task's process group), the wrapper
  shell included: it outlives the signal (a wrapper that did not ended the task 143, not
  requeued) and does not pass it on (a second SIGTERM in set-up stops a process of several
  alone: trainer/hooks.stop_before_training). The binary gets it once, saves and exits 75; the
  job is requeued."""
  body = ("import os, signal, sys, time\n"
          "got = []\n"
          "signal.signal(signal.SIGTERM, lambda s, f: got.append(s))\n"
          f"ready = '{tmp_path}/ready' + os.environ['SLURM_PROCID']\n"
          "with open(ready + '.tmp', 'w') as f:\n"
          "  f.write(str(os.getpgid(0)))\n"
          "os.rename(ready + '.tmp', ready)\n"
          "deadline = time.time() + 30\n"
          "while not got and time.time() < deadline:\n"
          "  time.sleep(0.02)\n"
          "time.sleep(0.5)  # (a second signal would come by now)\n"
          "print('SIGTERMs:', len(got), flush=True)\n"
          "sys.exit(75 if got else 1)\n")
  wd = tmp_path / "wd"
  wd.mkdir()
  with subprocess.Popen(["bash", SCRIPT, "configs/ppo_tiny.py", str(wd)], cwd=REPO,
                        env=_slurm_env(tmp_path, body), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True) as job:
    try:
      ready = [tmp_path / f"ready{t}" for t in range(2)]
      deadline = time.time() + 60
      while not all(r.exists() for r in ready):
        assert time.time() < deadline and job.poll() is None, job.stderr.read()
        time.sleep(0.05)
      for r in ready:
        os.killpg(int(r.read_text()), signal.SIGTERM)
      stdout, stderr = job.communicate(timeout=60)
    finally:
      job.kill()
  assert job.returncode == 75, (job.returncode, stdout, stderr)
  assert stdout.count("SIGTERMs: 1") == 2, stdout
  assert "scontrol requeue 8" in (tmp_path / "calls").read_text(), stderr
