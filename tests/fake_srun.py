"""A stand-in for SLURM's srun, for the launcher tests (launch/slurm_gpu.sbatch): runs the
command as FAKE_SRUN_NTASKS tasks (SLURM_PROCID set), waits for them and exits with the status
srun reports. Modelled on Slurm's src/srun/launch.c (_task_finish) and slurmstepd's
SIG_TERM_KILL:

- the status: the highest exit code, but any task ended by a signal outranks every exit code
  (128 + the highest such signal);
- kill-on-bad-exit: with `--kill-on-bad-exit[=1]` / `-K[1]`, or without the option where
  slurm.conf's KillOnBadExit (here FAKE_SRUN_KILL_ON_BAD_EXIT) is 1, the first task to exit
  with a status other than 0 has srun send SIGCONT and SIGTERM to the others, then SIGKILL
  KillWait (FAKE_SRUN_KILL_WAIT, s) later; `--kill-on-bad-exit=0` / `-K0` waits for every
  task whatever slurm.conf says;
- signals: slurmstepd sends them to every process of a task (proctrack_g_signal on the step's
  container, src/slurmd/slurmstepd/req.c), not to the task's first process alone: each task
  runs in a process group of its own, which a test signals as slurmstepd would (SIGTERM before
  the time limit, a preemption), and which the kill-on-bad-exit signals go to.

Its arguments are appended to the file FAKE_SRUN_CALLS names, when set."""
import os
import signal
import subprocess
import sys
import time


def _signal_task(task: subprocess.Popen, sig: int) -> None:
  """`sig` to every process of a task (its process group), as slurmstepd signals a step."""
  try:
    os.killpg(task.pid, sig)
  except ProcessLookupError:  # (ended meanwhile)
    pass


def main(argv: list[str]) -> int:
  kill_on_bad_exit = os.environ.get("FAKE_SRUN_KILL_ON_BAD_EXIT", "0") == "1"
  i = 0
  while i < len(argv) and argv[i].startswith("-"):
    opt = argv[i]
    if opt in ("-K", "--kill-on-bad-exit"):
      kill_on_bad_exit = True
    elif opt.startswith("--kill-on-bad-exit=") or (opt.startswith("-K") and len(opt) > 2):
      kill_on_bad_exit = opt.split("=", 1)[-1].removeprefix("-K") != "0"
    else:
      sys.exit(f"fake srun: option {opt} not modelled")
    i += 1
  command = argv[i:]
  if os.environ.get("FAKE_SRUN_CALLS"):
    with open(os.environ["FAKE_SRUN_CALLS"], "a") as f:
      f.write("srun " + " ".join(argv) + "\n")
  tasks = [subprocess.Popen(command, env=dict(os.environ, SLURM_PROCID=str(t)),
                            start_new_session=True)
           for t in range(int(os.environ.get("FAKE_SRUN_NTASKS", "1")))]
  kill_wait = float(os.environ.get("FAKE_SRUN_KILL_WAIT", "30"))
  terminated_at = None
  while any(t.poll() is None for t in tasks):
    if (kill_on_bad_exit and terminated_at is None and
        any(t.returncode not in (None, 0) for t in tasks)):
      terminated_at = time.time()
      for t in tasks:
        if t.poll() is None:
          _signal_task(t, signal.SIGCONT)
          _signal_task(t, signal.SIGTERM)
    if terminated_at is not None and time.time() > terminated_at + kill_wait:
      for t in tasks:
        if t.poll() is None:
          _signal_task(t, signal.SIGKILL)
    time.sleep(0.02)
  signals = [-t.returncode for t in tasks if t.returncode < 0]
  return 128 + max(signals) if signals else max(t.returncode for t in tasks)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
