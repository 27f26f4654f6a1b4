#!/usr/bin/env bash
# Runs train_ppo as N processes on this machine (127.0.0.1), each with D fake CPU devices: the
# same code path as a multi-host GPU/TPU run (jax.distributed, global arrays spanning processes).
#
#   bash launch/local_multiprocess.sh N D WORKDIR [extra train_ppo flags...]
#   bash launch/local_multiprocess.sh 2 4 /tmp/mp_run --config.num_iterations=5
# PYTHON picks the interpreter (default: python on PATH), e.g. PYTHON=.venv/bin/python.
set -euo pipefail
N=${1:?number of processes}; D=${2:?devices per process}; WORKDIR=${3:?workdir}; shift 3
PORT=${PORT:-$((20000 + RANDOM % 20000))}
cd "$(dirname "$0")/.."
pids=()
for ((i = 0; i < N; i++)); do
  XLA_FLAGS="--xla_force_host_platform_device_count=$D" JAX_PLATFORMS=cpu \
    "${PYTHON:-python}" -m experiments.train_ppo --config="${CONFIG:-configs/ppo_tiny.py}" \
      --workdir="$WORKDIR" --distributed --coordinator_address="127.0.0.1:$PORT" \
      --num_processes="$N" --process_id="$i" "$@" > "${WORKDIR%/}.proc$i.log" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
echo "logs: ${WORKDIR%/}.proc*.log; exit status $status"
exit $status
