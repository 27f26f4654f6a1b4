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
# (default: python3 on PATH, else python), e.g. PYTHON=.venv/bin/python. XLA_FLAGS: the
# caller's, with D devices. The processes run from the repository root: WORKDIR, CONFIG's file
# and PYTHON are made absolute first; a relative path inside an extra flag
# (--config.data.prompts_file=p.jsonl, or the value as the next argument) is read from the
# repository root, unless it names nothing there and something where the launcher was started:
# then it is made absolute (said on stderr; a bare word, no slash or dot, is passed as given:
# --config.reward.kind=model). One that names nothing in either place is said too (the binary's
# "No such file" names the relative path alone). Logs: WORKDIR.proc<i>.log (appended, a header
# line per start); process 0's is shown here as it is written (FOLLOW=0: not; needs GNU tail),
# and the end of each failed process's log as soon as it has ended.
set -euo pipefail
N=${1:?number of processes}; D=${2:?devices per process}; WORKDIR=${3:?workdir}; shift 3
if ! [[ "$N" =~ ^[1-9][0-9]*$ && "$D" =~ ^[1-9][0-9]*$ ]]; then
  echo "N=$N D=$D: expected the number of processes and the devices per process, both >= 1" >&2
  exit 2
fi
# A URI (gs://...) became a path below where the launcher was started (.../gs://bucket/wd):
# folders gs:/bucket made there and the logs written in them before train_ppo refused it.
if [[ "$WORKDIR" == *://* ]]; then
  echo "WORKDIR=$WORKDIR: a URI, but the workdir is a directory on this machine (its logs go" \
    "beside it; runs lock, rename and checkpoint by path): give a filesystem path" >&2
  exit 2
fi
# shellcheck source=launch/checks.sh
source "$(dirname "$0")/checks.sh"
default_python
refuse_set_flags "the launcher sets it for every process: --config from CONFIG=... (e.g.\
 CONFIG=configs/ppo_tiny.py:fused), --workdir from WORKDIR, --coordinator_address from\
 PORT=..., --num_processes from N, and --distributed and --process_id" "$@"
BINARY=${BINARY:-train_ppo}
if [[ "$BINARY" == train_ppo ]]; then DEFAULT_CONFIG=configs/ppo_tiny.py
else DEFAULT_CONFIG="configs/$BINARY.py"; fi
PORT_GIVEN=${PORT:-}
if [[ -n "$PORT_GIVEN" ]] && ! [[ "$PORT_GIVEN" =~ ^[1-9][0-9]{0,4}$ && $PORT_GIVEN -le 65535 ]]
then
  echo "PORT=$PORT_GIVEN: expected a TCP port number, 1-65535 (or leave it unset for a random" \
    "free one)" >&2
  exit 2
fi
PORT=${PORT:-$((20000 + RANDOM % 20000))}
# Paths the caller gave relative to where it runs (the workdir, a config file, an interpreter
# such as .venv/bin/python) made absolute before the cd below; a config that is not a file here
# stays as given (configs/X.py[:variant], read from the repository root).
WORKDIR=$(abspath "$WORKDIR")
if [[ -n "${CONFIG:-}" && -f "${CONFIG%%:*}" ]]; then
  CONFIG="$(abspath "${CONFIG%%:*}")${CONFIG#"${CONFIG%%:*}"}"
fi
if [[ "${PYTHON:-}" == */* ]]; then PYTHON=$(abspath "$PYTHON"); fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
caller_flag_paths "$ROOT" "$@"
set -- ${FLAG_ARGS[@]+"${FLAG_ARGS[@]}"}
cd "$ROOT"
check_binary "$BINARY"
# The caller's XLA flags stay, any device count replaced by D: the binaries' own rule
# (rlhfuse_jax/parallel/host_devices.py, which imports no jax).
FLAGS="$("$PYTHON" -c 'import sys
from rlhfuse_jax.parallel.host_devices import xla_flags_with_host_devices
print(xla_flags_with_host_devices(int(sys.argv[1])))' "$D")"
# jax's own count overrides the flag's: a JAX_NUM_CPU_DEVICES the caller exported is set to D
# too (parallel/host_devices.host_device_env), else every process had the caller's count.
if [[ -n "${JAX_NUM_CPU_DEVICES+set}" ]]; then export JAX_NUM_CPU_DEVICES="$D"; fi
# The coordinator's port, free: a busy one failed process 0 with jax's "Failed to start RPC
# server" (naming no port) while the others waited 5 minutes in jax.distributed.initialize, then
# aborted. A random port is drawn again; a PORT the caller gave is refused at once.
port_free() { "$PYTHON" -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("", int(sys.argv[1])))' "$1" 2>/dev/null; }
for ((try = 0; try < 20; try++)); do
  if port_free "$PORT"; then break; fi
  if [[ -n "$PORT_GIVEN" ]]; then
    echo "PORT=$PORT: the port is in use (another run's coordinator, or another program);" \
      "give another PORT, or leave it unset for a random free one" >&2
    exit 2
  fi
  PORT=$((20000 + RANDOM % 20000))
done
mkdir -p "$(dirname "${WORKDIR%/}")"
# A run on this host holding the workdir (its .lock, flock'd): refused here, before anything is
# appended to that run's logs (the processes would refuse it too, after writing into them). A
# holder on another host goes on to process 0, which waits for it up to config.lock_wait_s
# (a crashed node's lock lasts on a shared filesystem until the server's lease ends).
# Only flock's status for a lock held (1): another failure (65, 71: a filesystem without locks,
# "No locks available") refused every start after the first as "in use", where train_ppo warns
# and runs unlocked (rlhfuse_jax/workdir.WorkdirLock).
locked=0
if [[ -f "${WORKDIR%/}/.lock" ]] && command -v flock > /dev/null; then
  flock -n "${WORKDIR%/}/.lock" true 2> /dev/null || locked=$?
fi
if ((locked == 1)); then
  HOLDER=$(head -n 1 "${WORKDIR%/}/.lock" | head -c 200)
  # (uname -n: the name Python's socket.gethostname() gives, which the run wrote there)
  if ! [[ "$HOLDER" =~ ^pid\ [0-9]+\ on\ ([^ ]+)\ \(start &&
          "${BASH_REMATCH[1]}" != "$(uname -n)" ]]; then
    echo "workdir $WORKDIR is in use by another run ($HOLDER);" \
      "wait for it to finish or stop it, or use another workdir" >&2
    exit 1
  fi
  echo "workdir $WORKDIR is locked by $HOLDER, on another host: process 0 waits for it" \
    "(config.lock_wait_s)" >&2
fi
echo "$N processes x $D CPU devices; logs (appended): ${WORKDIR%/}.proc<i>.log" \
  "(follow: tail -f ${WORKDIR%/}.proc0.log)"
pids=()
offsets=()  # each log's output of this start begins after this byte
for ((i = 0; i < N; i++)); do
  touch "${WORKDIR%/}.proc$i.log"
  offsets+=("$(wc -c < "${WORKDIR%/}.proc$i.log")")
  echo "=== $(date '+%F %T'): process $i of $N" >> "${WORKDIR%/}.proc$i.log"
  XLA_FLAGS="$FLAGS" JAX_PLATFORMS=cpu \
    "$PYTHON" -m "experiments.$BINARY" --config="${CONFIG:-$DEFAULT_CONFIG}" \
      --workdir="$WORKDIR" --distributed --coordinator_address="127.0.0.1:$PORT" \
      --num_processes="$N" --process_id="$i" "$@" >> "${WORKDIR%/}.proc$i.log" 2>&1 &
  pids+=($!)
done
# Process 0's output, shown as it comes, until it ends (GNU tail's --pid; elsewhere, or with
# FOLLOW=0, only the log has it).
follower=""
if [[ "${FOLLOW:-1}" != 0 ]] && tail --pid=$$ -n 0 /dev/null 2>/dev/null; then
  tail --pid="${pids[0]}" -s 0.2 -c +$((offsets[0] + 1)) -f "${WORKDIR%/}.proc0.log" &
  follower=$!
fi
# A Ctrl-C reaches the launcher and every process: they are in the terminal's process group
# too. bash (without job control) starts them with SIGINT ignored, but train_ppo installs a
# SIGINT handler of its own (trainer/hooks.py), which ends that; a binary that keeps the ignore
# (bench_generation) gets no Ctrl-C itself. A SIGTERM (`kill` of the launcher's pid) reaches the
# launcher alone. Either way the launcher passes SIGTERM on (each process saves after its
# iteration and exits 75; in set-up they stop together at the next point all processes reach,
# which can be the end of set-up, tens of seconds later, and exit 75 without a checkpoint;
# train_ppo, stopping on the Ctrl-C already, takes it as the same stop, trainer/hooks.py) and
# keeps waiting; a second signal kills them.
signalled=0
interrupted=0
# shellcheck disable=SC2329  # (called by the trap below)
forward() {
  interrupted=1
  if ((signalled)); then kill -KILL "${pids[@]}" 2>/dev/null || true
  else signalled=1; echo "stopping: SIGTERM to every process (again: kill)" >&2
    kill -TERM "${pids[@]}" 2>/dev/null || true; fi
}
trap forward INT TERM
# A failed process's reason is at the end of its log: shown as soon as it ends, not after the
# others (they may wait for it in a collective until jax.distributed times out). Process 0's
# output is already on screen while it is followed.
causes=()  # each failed process's status and error line without its time and thread
# error_line: the error line of a log's output on stdin ("" if none). The error line first:
# after a runtime abort the log's last lines are a C++ stack dump. The run's own reason for
# exiting ("...; exiting (69)"), else the last fatal (F) line, else the last error (E) line or
# exception; not process 0's note that it exits in N s (experiments/config_files.exit_now),
# which follows its error. (absl's bad command line: "FATAL Flags parsing error: ...")
error_line() {
  local out pattern line=""
  out=$(cat)
  for pattern in '^E[0-9]{4} .*exiting \([0-9]+\)$' '^F[0-9]{4} ' '^E[0-9]{4} |^FATAL |Error: '; do
    line=$(grep -E "$pattern" <<< "$out" | grep -Ev '\] process 0 exits in [0-9.e+-]+ s \(' |
      tail -n 1 || true)
    if [[ -n "$line" ]]; then break; fi
  done
  echo "$line"
}
unstamped() { sed -E 's/^[EF][0-9]{4} [0-9:.]+ +[0-9]+ //' <<< "$1"; }  # no time and thread
show_failure() {  # process index, status[, 1: only note its error (its output is on screen)]
  local log="${WORKDIR%/}.proc$1.log" out cause j
  out=$(tail -c +$((offsets[$1] + 1)) "$log" || true)  # this start's output
  cause=$(error_line <<< "$out")
  causes[$1]="$2 $(unstamped "$cause")"  # status too
  if [[ "${3:-}" == 1 ]]; then return; fi
  for j in "${!causes[@]}"; do  # every process failing on the same bad input: shown once
    if ((j != $1)) && [[ -n "$cause" && "${causes[j]}" == "${causes[$1]}" ]]; then
      echo "--- process $1 exited $2 with process $j's error"
      return
    fi
  done
  # ... and process 0's, followed, which has logged it but still runs: it waits 10 s
  # (RLHFUSE_PEER_GRACE_S) before exiting, so its error was on screen and then shown again in
  # the first other process's log.
  if [[ -n "$follower" && -z "${rcs[0]:-}" && -n "$cause" ]] &&
      [[ "$(unstamped "$(error_line < <(tail -c +$((offsets[0] + 1)) \
            "${WORKDIR%/}.proc0.log"))")" == "$(unstamped "$cause")" ]]; then
    echo "--- process $1 exited $2 with process 0's error (above)"
    return
  fi
  echo "--- process $1 exited $2${cause:+; its last error: $cause}"
  echo "--- the end of $log:"
  tail -n 15 <<< "$out"
}
# Each process's status once it has ended ("" while it runs): bash reaps its children and
# keeps their statuses for `wait`, so `kill -0` fails once a process has ended.
rcs=()
lost=()  # 1: the process ended because jax's coordination service (or gloo) lost another one
LOST_PEER="JAX distributed service detected fatal errors"
LOST_PEER+="|terminate called after throwing an instance of 'gloo::"
running=$N
failed_early=0 first_failure="" ticks_since=0
while ((running > 0)); do
  failed_now=""
  for i in "${!pids[@]}"; do
    if [[ -n "${rcs[i]:-}" ]] || kill -0 "${pids[i]}" 2>/dev/null; then continue; fi
    while :; do  # a trapped signal ends `wait` early (128 + signal): wait again for the status
      interrupted=0
      wait "${pids[i]}" && rc=0 || rc=$?
      ((interrupted && rc > 128)) || break  # <= 128: the process's own status
    done
    rcs[i]=$rc
    running=$((running - 1))
    # jax aborts a process (134) whose peer stopped heartbeating, and gloo (CPU collectives)
    # one whose peer died mid-message ("terminate called after throwing an instance of
    # 'gloo::EnforceNotMet' ... Received data size doesn't match expected size. Is there a
    # distributed collective mismatch in your code?"): consequences, like 69
    # (grep -q on a process substitution: in a pipe, tail's SIGPIPE fails it under pipefail)
    if ((rc != 0 && rc != 75)) && grep -qE "$LOST_PEER" \
        <(tail -c +$((offsets[i] + 1)) "${WORKDIR%/}.proc$i.log"); then lost[i]=1; fi
    if ((rc != 0 && rc != 75)); then
      # (process 0's output is already on screen while it is followed)
      show_failure "$i" "$rc" "$([[ $i == 0 && -n "$follower" ]] && echo 1)"
      failed_now=${failed_now:-"process $i exited $rc"}
    fi
  done
  # Said once the others have had 2 s to end: processes that fail on the same input end a few
  # milliseconds apart, and were said to wait for each other.
  if [[ -n "$failed_now" && -z "$first_failure" ]]; then first_failure=$failed_now; fi
  if [[ -n "$first_failure" ]] && ((running > 0 && !failed_early)); then
    ticks_since=$((ticks_since + 1))
    if ((ticks_since > 10)); then
      failed_early=1
      echo "--- $running process(es) still running 2 s after $first_failure: they may wait for" \
        "it in a collective, or be ending after an error of their own (their logs say; Ctrl-C" \
        "stops them)"
    fi
  fi
  if ((running > 0)); then sleep 0.2 || true; fi  # a Ctrl-C ends the sleep too
done
if [[ -n "$follower" ]]; then wait "$follower" 2>/dev/null || true; fi
# The launcher's status: the first failure in process order that is neither 75 nor a lost
# peer, else 69 or the lost peer's abort (a process saw a peer die or hang:
# rlhfuse_jax/generation/multihost.py, or jax's heartbeat), else 75 when a process stopped on
# SIGTERM (saved; resumable: a caller may requeue), else 0. A failure beside a clean stop must
# not read as "stopped, start again", and the process that failed, not the ones that lost it
# (69, which a requeue rule may retry), gives the status.
status=0
status_rank=0
summary=""
rank() { case $1 in 0) echo 0;; 75) echo 1;; 69) echo 2;; *) echo 3;; esac; }
for i in "${!pids[@]}"; do
  rc=${rcs[i]}
  summary+=" $i:$rc"
  r=$(rank "$rc")
  if [[ -n "${lost[i]:-}" ]]; then r=2; fi
  if ((r > status_rank)); then status=$rc; status_rank=$r; fi
done
echo "logs: ${WORKDIR%/}.proc*.log; exit status per process (process:status):$summary;" \
  "exit status $status"
exit "$status"
