#!/usr/bin/env bash
# Runs a binary (default train_ppo) as N processes on this machine (127.0.0.1), each with D fake
# CPU devices: the same code path as a multi-host GPU/TPU run (jax.distributed, global arrays
# spanning processes, fused generation instances on every process).
#
#   bash launch/local_multiprocess.sh N D WORKDIR [extra flags...]
#   bash launch/local_multiprocess.sh 2 4 /tmp/mp_run --config.num_iterations=5
#   BINARY=bench_generation CONFIG=configs/bench_generation.py \
#     bash launch/local_multiprocess.sh 2 4 /tmp/mp_bench
# BINARY picks experiments/BINARY.py (train_ppo or bench_generation); CONFIG its config (default
# configs/ppo_tiny.py for train_ppo, configs/BINARY.py otherwise); PYTHON the interpreter
# (default: python on PATH), e.g. PYTHON=.venv/bin/python. XLA_FLAGS: the caller's, with D
# devices. Logs: WORKDIR.proc<i>.log (appended, a header line per start).
set -euo pipefail
N=${1:?number of processes}; D=${2:?devices per process}; WORKDIR=${3:?workdir}; shift 3
BINARY=${BINARY:-train_ppo}
if [[ "$BINARY" == train_ppo ]]; then DEFAULT_CONFIG=configs/ppo_tiny.py
else DEFAULT_CONFIG="configs/$BINARY.py"; fi
PORT=${PORT:-$((20000 + RANDOM % 20000))}
# Paths the caller gave relative to where it runs (the workdir, a config file, an interpreter
# such as .venv/bin/python) made absolute before the cd below; a config that is not a file here
# stays as given (configs/X.py[:variant], read from the repository root).
abspath() { [[ "$1" == /* ]] && echo "$1" || echo "$PWD/$1"; }
WORKDIR=$(abspath "$WORKDIR")
if [[ -n "${CONFIG:-}" && -f "${CONFIG%%:*}" ]]; then
  CONFIG="$(abspath "${CONFIG%%:*}")${CONFIG#"${CONFIG%%:*}"}"
fi
if [[ "${PYTHON:-}" == */* ]]; then PYTHON=$(abspath "$PYTHON"); fi
cd "$(dirname "$0")/.."
if [[ ! -f "experiments/$BINARY.py" ]]; then
  echo "BINARY=$BINARY: no experiments/$BINARY.py (expected train_ppo or bench_generation)" >&2
  exit 2
fi
# The caller's XLA flags stay, any device count replaced by D: the binaries' own rule
# (rlhfuse_jax/parallel/host_devices.py, which imports no jax).
FLAGS="$("${PYTHON:-python}" -c 'import sys
from rlhfuse_jax.parallel.host_devices import xla_flags_with_host_devices
print(xla_flags_with_host_devices(int(sys.argv[1])))' "$D")"
mkdir -p "$(dirname "${WORKDIR%/}")"
echo "$N processes x $D CPU devices; logs (appended): ${WORKDIR%/}.proc<i>.log" \
  "(follow: tail -f ${WORKDIR%/}.proc0.log)"
pids=()
for ((i = 0; i < N; i++)); do
  echo "=== $(date '+%F %T'): process $i of $N" >> "${WORKDIR%/}.proc$i.log"
  XLA_FLAGS="$FLAGS" JAX_PLATFORMS=cpu \
    "${PYTHON:-python}" -m "experiments.$BINARY" --config="${CONFIG:-$DEFAULT_CONFIG}" \
      --workdir="$WORKDIR" --distributed --coordinator_address="127.0.0.1:$PORT" \
      --num_processes="$N" --process_id="$i" "$@" >> "${WORKDIR%/}.proc$i.log" 2>&1 &
  pids+=($!)
done
# Background processes of a script ignore SIGINT (bash without job control), so a Ctrl-C or a
# SIGTERM reaches the launcher alone: it passes SIGTERM on (each process saves after its
# iteration and exits 75, or ends at once if it has not started training) and keeps waiting;
# a second signal kills them.
signalled=0
interrupted=0
forward() {
  interrupted=1
  if ((signalled)); then kill -KILL "${pids[@]}" 2>/dev/null || true
  else signalled=1; echo "stopping: SIGTERM to every process (again: kill)" >&2
    kill -TERM "${pids[@]}" 2>/dev/null || true; fi
}
trap forward INT TERM
# The launcher's status: the first failure in process order that is not 75, else 75 when a
# process stopped on SIGTERM (saved; resumable: a caller may requeue), else 0. A failure beside
# a clean stop must not read as "stopped, start again".
status=0
summary=""
for i in "${!pids[@]}"; do
  while :; do  # a trapped signal ends `wait` early (128 + signal): wait again for the status
    interrupted=0
    wait "${pids[$i]}" && rc=0 || rc=$?
    ((interrupted && rc > 128)) || break  # <= 128: the process's own status
  done
  summary+=" $i:$rc"
  if ((rc != 0 && rc != 75 && (status == 0 || status == 75))); then status=$rc
  elif ((rc == 75 && status == 0)); then status=75; fi
done
echo "logs: ${WORKDIR%/}.proc*.log; exit status per process (process:status):$summary;" \
  "exit status $status"
exit $status
