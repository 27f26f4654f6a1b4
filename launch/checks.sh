# shellcheck shell=bash
# What every launcher (local_multiprocess.sh, slurm_gpu.sbatch, tpu_pod.sh) refuses before a
# process starts; sourced by them, not run.

# check_binary NAME: only train_ppo and bench_generation take --distributed; any other binary
# failed in every process on absl's "Unknown command line flag 'distributed'" (under SLURM after
# the allocation, locally after the coordinator had started).
check_binary() {
  case "$1" in
    train_ppo | bench_generation) ;;
    *) echo "BINARY=$1: expected train_ppo or bench_generation (the binaries that run as" \
         "several processes)" >&2
       exit 2;;
  esac
}

# refuse_set_flags WHY ARGS...: exits 2 on an extra flag among ARGS that the launcher sets for
# every process (or jax.distributed detects), naming it, then WHY: a second --config replaced
# CONFIG without a word (or made absl fail every process with "The flag
# 'config.num_iterations' is defined twice", naming neither), and --process_id and the like
# would give every process the same one. absl's every spelling counts: one dash or two, and
# --distributed=false (absl keeps the last value: it turned the launcher's --distributed off,
# and each task ran alone on the same workdir).
refuse_set_flags() {
  local why=$1 arg name
  shift
  for arg in "$@"; do
    [[ "$arg" == -* ]] || continue
    name=${arg#-}; name=${name#-}; name=${name%%=*}
    case "$name" in
      config | workdir | distributed | nodistributed | coordinator_address* | num_processes* | \
      process_id*)
        echo "${arg%%=*}: $why" >&2
        exit 2;;
    esac
  done
}

# default_python: PYTHON, when the caller set it, else the first of python3 and python on PATH.
# `python` alone failed every process with "python: command not found" (exit 127) on Cloud TPU
# VMs and the many clusters whose images have only python3 (PEP 394 leaves `python` optional).
default_python() {
  if [[ -n "${PYTHON:-}" ]]; then return; fi
  if command -v python3 > /dev/null; then PYTHON=python3
  elif command -v python > /dev/null; then PYTHON=python
  else
    echo "neither python3 nor python is on PATH: set PYTHON to the interpreter (e.g." \
      "PYTHON=/path/to/venv/bin/python)" >&2
    exit 2
  fi
}
