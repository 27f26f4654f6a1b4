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

# abspath PATH: PATH made absolute against where the launcher was started (before it changes to
# the repository root); an absolute path or a URI (gs://...) as given.
abspath() { [[ "$1" == /* || "$1" == *://* ]] && echo "$1" || echo "$PWD/$1"; }

# caller_flag_paths ROOT ARGS...: sets FLAG_ARGS to ARGS, with an extra flag's relative path
# (--config.plan.file=ps/plan.json, p.jsonl) made absolute when it names nothing under ROOT
# (the repository root, where the processes run and read a relative path) and something where
# the launcher was started, and said on stderr: given from the directory that holds ps/, every
# process stopped on "No such file" naming ps/plan.json alone. One that names something under
# ROOT is read there (configs/data/...); one that names nothing in either place is said too,
# naming both directories (the binary's error names the relative path alone). A bare word (no
# slash, no dot) is a name as often as a path: --config.reward.kind=model, started beside a
# model/ folder, became the folder's path and failed validation; it is passed as given, said.
# absl's other form, the value as the next argument (--config.plan.file ps/plan.json), is read
# alike: it was passed as given. A flag followed by another flag (a boolean) has no value.
caller_flag_paths() {
  local root=$1 args i
  shift
  args=("$@")
  FLAG_ARGS=()
  for ((i = 0; i < ${#args[@]}; i++)); do
    if [[ "${args[i]}" == -*=* ]]; then
      caller_flag_path "$root" "${args[i]%%=*}" "${args[i]#*=}" "="
      FLAG_ARGS+=("${args[i]%%=*}=$FLAG_VALUE")
    elif [[ "${args[i]}" =~ ^--?[A-Za-z] && $((i + 1)) -lt ${#args[@]} &&
            "${args[i + 1]}" != -* ]]; then
      caller_flag_path "$root" "${args[i]}" "${args[i + 1]}" " "
      FLAG_ARGS+=("${args[i]}" "$FLAG_VALUE")
      i=$((i + 1))
    else
      FLAG_ARGS+=("${args[i]}")
    fi
  done
}

# caller_flag_path ROOT FLAG VALUE SEP: sets FLAG_VALUE to VALUE as caller_flag_paths passes it
# (SEP: how the caller joined FLAG and VALUE, '=' or ' ', as the messages say it).
caller_flag_path() {
  local root=$1 flag=$2 value=$3 sep=$4
  FLAG_VALUE=$value
  if [[ -z "$value" || "$value" == /* || "$value" == *://* || -e "$root/$value" ]]; then
    return
  fi
  if [[ -e "$value" && "$value" == *[/.]* ]]; then
    FLAG_VALUE=$(abspath "$value")
    echo "$flag$sep$value: not under the repository root ($root), where the processes read a" \
      "relative path; read where the launcher was started: $FLAG_VALUE" >&2
  elif [[ -e "$value" ]]; then
    echo "$flag$sep$value: passed as given (a name, or a path the processes read under the" \
      "repository root, $root); for the one where the launcher was started, give ./$value" >&2
  elif [[ "$value" == */* ]]; then
    echo "$flag$sep$value: a relative path, which the processes read (or write) under the" \
      "repository root ($root); it names nothing there, nor where the launcher was started" \
      "($PWD)" >&2
  fi
}
