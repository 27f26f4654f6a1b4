#!/usr/bin/env bash
# One task of launch/slurm_gpu.sbatch: `bash launch/slurm_task.sh COMMAND...` runs the binary
# and exits with its status, but for a death by a signal other than a stop: exit 69 instead,
# the status the sbatch script requeues (at most MAX_REQUEUES times, so a crash that comes
# back every start ends the job).
#
# Why: srun's status is its tasks' highest exit status, except that a task ended by a signal
# outranks every exit status (128 + the signal; Slurm's src/srun/launch.c). A process that jax
# aborted for a lost peer (SIGABRT: 134) or that was killed (SIGKILL: 137, the OOM killer, a
# kill -9) ended the step as a signal death, which was not requeued, although the run had only
# lost the iterations since its last checkpoint. This task's own status is an exit status.
#
# Stop signals (SIGTERM 10 minutes before the time limit, a preemption, scancel --signal):
# slurmstepd sends them to every process of the step (its proctrack container), the binary
# included, which saves and exits 75. This shell only outlives them (a trap, which the binary
# does not inherit, where an ignore would be) and keeps waiting; passing the signal on would
# give the binary a second one, which in set-up stops a process of several alone
# (trainer/hooks.stop_before_training). A binary that a stop signal kills (one without a
# handler, or a second signal) keeps that status (128 + the signal): not requeued, as before.
set -u
# (the trap runs once the binary has ended: bash waits for a foreground command first)
trap : TERM INT HUP
"$@"
rc=$?
if ((rc > 128 && rc <= 128 + 64)); then
  sig=$(kill -l "$rc" 2> /dev/null || echo "$((rc - 128))")
  case "$sig" in
    TERM | INT | HUP) ;;
    *)
      echo "slurm_task.sh: task ${SLURM_PROCID:-?} on $(uname -n): $1 ended by SIG$sig" \
        "(status $rc); exiting 69, which the job requeues to resume from the last checkpoint" >&2
      rc=69;;
  esac
fi
exit "$rc"
