#!/usr/bin/env bash
# Multi-host TPU pod slice: run the same command on every worker; jax.distributed.initialize()
# auto-detects the topology. The workdir is a path every worker sees (a bucket mounted with
# Cloud Storage FUSE, or NFS): gs:// URIs are refused (runs lock, rename and checkpoint by path).
#
#   gcloud compute tpus tpu-vm ssh NAME --worker=all --command \
#     "cd rlhfuse_jax && nohup bash launch/tpu_pod.sh configs/ppo_llama.py:7b /mnt/bucket/run \
#      > ~/run.log 2>&1 &"
# (nohup: a dropped ssh session does not end the run.) Every worker needs the same checkout and
# config: the run stops at set-up when their git commits or configs differ. Exit 75 (stopped
# by a preemption's SIGTERM after saving): run the same command again to resume. A worker that
# hangs alive keeps the others waiting: add --config.guard.iteration_timeout_s=SECONDS (a few
# times the slowest iteration) and every worker exits 69 with its stacks instead.
# It runs from the repository root: the workdir and the config file are made absolute first; a
# relative path inside an extra flag (--config.plan.file=ps/plan.json, or the value as the next
# argument) is read from the repository root, unless it names nothing there and something where
# the script was started: then it is made absolute (said on stderr; a bare word, no slash or
# dot, is passed as given: --config.reward.kind=model). One that names nothing in either place
# is said too.
# BINARY picks experiments/BINARY.py: train_ppo (default; fused with
# --config.fusion.inter_stage=True) or bench_generation (config: configs/bench_generation.py).
set -euo pipefail
CONFIG=${1:?config}; WORKDIR=${2:?workdir (a path every worker sees: gcsfuse mount or NFS)}; shift 2
# shellcheck source=launch/checks.sh
source "$(dirname "${BASH_SOURCE[0]}")/checks.sh"
default_python
check_binary "${BINARY:-train_ppo}"
refuse_set_flags "this script sets it for every process (the config and workdir are its first two\
 arguments; jax.distributed detects the coordinator, process count and index)" "$@"
# Paths relative to where it was started made absolute, then the repository root (python -m
# experiments.X finds the package there: started elsewhere, every worker failed with "No module
# named 'experiments'"); a config that is not a file here stays as given (configs/X.py[:variant]).
WORKDIR=$(abspath "$WORKDIR")
if [[ -f "${CONFIG%%:*}" ]]; then CONFIG="$(abspath "${CONFIG%%:*}")${CONFIG#"${CONFIG%%:*}"}"; fi
if [[ "${PYTHON:-}" == */* ]]; then PYTHON=$(abspath "$PYTHON"); fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
caller_flag_paths "$ROOT" "$@"
set -- ${FLAG_ARGS[@]+"${FLAG_ARGS[@]}"}
cd "$ROOT"
# exec: the binary takes this shell's pid, so a signal to the launcher (kill of a nohup'd
# start) reaches the run, which saves and exits 75 (a child left running held the workdir).
exec "$PYTHON" -m experiments."${BINARY:-train_ppo}" --config="$CONFIG" \
  --workdir="$WORKDIR" --distributed "$@"
