#!/usr/bin/env bash
# Starts a psflow cluster on this machine: NUM_PS ps_server processes and
# NUM_WORKERS worker processes, each told its role through TF_CONFIG exactly
# as Kubeflow's TFJob would. Waits for the workers, then stops the servers.
# It ends as soon as a process fails (a shard that exits, a worker that
# exits with an error), naming it and showing the end of its log. Every
# process it started is stopped when it ends, is interrupted, or is killed.
# It then exits with that process's code, as `docker run` does: 128+N for
# one killed by signal N (137: SIGKILL), which the message spells out; 1
# for a shard that exited 0.
#
#   deploy/local/run_cluster.sh [worker flags...]
#
# Environment: BUILD_DIR (default build), NUM_PS (2), NUM_WORKERS (2),
# BASE_PORT (a free range is picked), LOG_DIR (default $BUILD_DIR/run),
# PS_FLAGS (extra ps_server flags, e.g. "--optimizer=adam --learning_rate=0.001"),
# PS_NETNS and PS_HOST (start the ps_server processes inside the network
# namespace PS_NETNS, made with `ip netns add`, where the workers reach them
# at PS_HOST: a network link between workers and servers that tc can shape;
# see docs/BENCHMARKS.md).
set -euo pipefail
# `wait -n -p` (below) came with bash 5.1; without it the loop would spin.
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 501)); then
  echo "run_cluster: needs bash 5.1 or later (this is $BASH_VERSION)" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$here/build}
NUM_PS=${NUM_PS:-2}
NUM_WORKERS=${NUM_WORKERS:-2}
LOG_DIR=${LOG_DIR:-$BUILD_DIR/run}
PS_FLAGS=${PS_FLAGS:-}
PS_NETNS=${PS_NETNS:-}
PS_HOST=${PS_HOST:-localhost}
ps_bin=$BUILD_DIR/ps_server/ps_server
worker_bin=$BUILD_DIR/worker/worker
for b in "$ps_bin" "$worker_bin"; do
  [ -x "$b" ] || { echo "run_cluster: $b is missing; build first (deploy/build.sh)" >&2; exit 1; }
done

# The numbers feed the arithmetic below: a typo gets a message, not a bash
# arithmetic error (or "08" read as octal).
check_count() {  # name value minimum maximum
  if ! [[ $2 =~ ^[0-9]+$ ]] || [ "$((10#$2))" -lt "$3" ] || [ "$((10#$2))" -gt "$4" ]; then
    echo "run_cluster: $1 must be an integer from $3 to $4, got \"$2\"" >&2
    exit 2
  fi
}
check_count NUM_PS "$NUM_PS" 1 64
check_count NUM_WORKERS "$NUM_WORKERS" 1 256
NUM_PS=$((10#$NUM_PS)) NUM_WORKERS=$((10#$NUM_WORKERS))
if [ -n "${BASE_PORT:-}" ]; then
  check_count BASE_PORT "$BASE_PORT" 1 $((65535 - NUM_PS - NUM_WORKERS))
  BASE_PORT=$((10#$BASE_PORT))
fi
for arg in "$@"; do
  case $arg in
    --help | -help | --helpfull | --helpshort | --helpmatch=* | --version)
      if [ "$arg" != --version ]; then
        # This script's own usage (its header), then the worker's flags.
        sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
        echo
        echo "Worker flags, passed to every worker:"
      fi
      exec "$worker_bin" "$arg" ;;
    --summary_json | --summary_json=*)
      echo "run_cluster: each worker's summary goes to \$LOG_DIR/worker-<index>.json; set" \
        "LOG_DIR instead of $arg" >&2
      exit 2 ;;
  esac
done
mkdir -p "$LOG_DIR"
if ! [ -w "$LOG_DIR" ] || ! [ -x "$LOG_DIR" ]; then
  echo "run_cluster: LOG_DIR=$LOG_DIR is not writable by this user" >&2
  exit 1
fi
# One run per LOG_DIR: a second wrote over the first's logs and summaries
# without a word. The lock goes with this script's process (fd 9 is closed
# for the processes it starts).
if command -v flock > /dev/null; then
  exec 9>> "$LOG_DIR/.run_cluster.lock"
  if ! flock -n 9; then
    holder=$(cat "$LOG_DIR/.run_cluster.pid" 2> /dev/null || echo "pid unknown")
    echo "run_cluster: another run_cluster.sh ($holder) uses LOG_DIR=$LOG_DIR; wait for" \
      "it, or set LOG_DIR to another directory" >&2
    exit 1
  fi
  echo "pid $$" > "$LOG_DIR/.run_cluster.pid"
fi

# Split on whitespace, never expanded against the current directory.
read -r -a ps_flags <<< "$PS_FLAGS"
# Every process gets SIGTERM if this script dies, even by SIGKILL (which
# runs no cleanup): setpriv, from util-linux, sets the parent-death signal.
# Each in a session of its own (setsid, from util-linux as well): a Ctrl-C
# on the terminal reaches this script alone, which then stops every process
# once. (It reached the shards too, whose shutdown the cleanup's SIGTERM
# then cut short as a second signal: exit code 1, no "stopped" line.)
launch=()
if command -v setpriv > /dev/null; then launch=(setpriv --pdeathsig TERM); fi
if command -v setsid > /dev/null; then launch+=(setsid); fi
ps_launch=("${launch[@]}")
[ -z "$PS_NETNS" ] || ps_launch+=(ip netns exec "$PS_NETNS")

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# A range from 20000 up to the kernel's ephemeral ports (32768 by default),
# which it hands to outgoing connections and to servers asking for any free
# port (as tests do): a port taken from there after the check below would
# keep a shard from listening, or put another program's server on it.
pick_base() {
  local base eph_lo first=20000
  read -r eph_lo _ < /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || eph_lo=32768
  local slots=$(( (eph_lo - NUM_PS - NUM_WORKERS - first) / 10 ))
  [ "$slots" -ge 10 ] || slots=2000  # an odd range: take the old chances
  for _ in $(seq 50); do
    base=$(( first + (RANDOM % slots) * 10 ))
    local ok=1
    for i in $(seq 0 $((NUM_PS + NUM_WORKERS))); do port_free $((base + i)) || { ok=0; break; }; done
    [ $ok = 1 ] && { echo $base; return; }
  done
  echo "run_cluster: no free port range found" >&2; exit 1
}
BASE_PORT=${BASE_PORT:-$(pick_base)}

ps_list=() worker_list=()
for i in $(seq 0 $((NUM_PS - 1))); do ps_list+=("\"$PS_HOST:$((BASE_PORT + i))\""); done
for i in $(seq 0 $((NUM_WORKERS - 1))); do worker_list+=("\"localhost:$((BASE_PORT + NUM_PS + i))\""); done
join() { local IFS=,; echo "$*"; }
cluster="{\"ps\": [$(join "${ps_list[@]}")], \"worker\": [$(join "${worker_list[@]}")]}"
tf_config() { echo "{\"cluster\": $cluster, \"task\": {\"type\": \"$1\", \"index\": $2}, \"environment\": \"cloud\"}"; }

pids=()     # every process started, in order
running=()  # those not reaped yet: a reaped one's pid may belong to another process now
declare -A role  # pid -> "ps 0", "worker 1", ...
cleanup() {
  # A second Ctrl-C (or a SIGINT to the whole process group) must not cut the
  # cleanup short and leave processes running.
  trap - EXIT
  trap '' INT TERM
  for p in "${running[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'echo "run_cluster: interrupted, stopping the cluster" >&2; exit 130' INT
trap 'echo "run_cluster: terminated, stopping the cluster" >&2; exit 143' TERM
trap 'echo "run_cluster: hung up, stopping the cluster" >&2; exit 129' HUP

# The end of a process's log, for a failure's message.
show_log() {  # role ("ps 0", "worker 1")
  local log="$LOG_DIR/${1/ /-}.log"
  echo "--- $log" >&2
  tail -n 5 "$log" >&2 || true
}

plural() { [ "$1" = 1 ] && echo "$1 $2" || echo "$1 ${2}s"; }  # 1 worker, 2 workers
echo "run_cluster: $NUM_PS ps + $(plural "$NUM_WORKERS" worker) on localhost:$BASE_PORT..," \
  "logs in $LOG_DIR"
for i in $(seq 0 $((NUM_PS - 1))); do
  TF_CONFIG=$(tf_config ps "$i") "${ps_launch[@]}" "$ps_bin" --threads=0 "${ps_flags[@]}" \
    >"$LOG_DIR/ps-$i.log" 2>&1 9>&- &
  pids+=($!) running+=($!)
  role[$!]="ps $i"
done
# A shard that cannot start (a port in use, a bad flag) ends at once: report
# its log now rather than a worker's connection errors later.
sleep 0.5
for i in $(seq 0 $((NUM_PS - 1))); do
  if ! kill -0 "${pids[$i]}" 2>/dev/null; then
    echo "run_cluster: ps $i exited at start:" >&2
    show_log "ps $i"
    exit 1
  fi
done
# The workers' compute threads are their default: the cores they may use
# (affinity, a container's CPU limit) shared among the workers of this
# machine, NUM_WORKERS here.
for i in $(seq 0 $((NUM_WORKERS - 1))); do
  if [ "$i" = 0 ]; then
    # The chief's progress goes to the terminal; everyone's to the logs.
    # (tee in a process substitution, so that $! is the worker itself and
    # the cleanup's SIGTERM reaches it.)
    TF_CONFIG=$(tf_config worker 0) "${launch[@]}" "$worker_bin" \
      --summary_json="$LOG_DIR/worker-0.json" "$@" \
      > >(tee "$LOG_DIR/worker-0.log" 9>&-) 2>&1 9>&- &
  else
    TF_CONFIG=$(tf_config worker "$i") "${launch[@]}" "$worker_bin" \
      --summary_json="$LOG_DIR/worker-$i.json" "$@" >"$LOG_DIR/worker-$i.log" 2>&1 9>&- &
  fi
  pids+=($!) running+=($!)
  role[$!]="worker $i"
done

# Until every worker has finished, the first process to fail ends the run:
# the others would wait for it (the workers for a chief that never
# registered the model, the chief for a shard that is gone).
workers_left=$NUM_WORKERS
while [ "$workers_left" -gt 0 ]; do
  done_pid=
  status=0
  # (Its stderr away: bash said "line 167: 2730 Killed  TF_CONFIG=... " of a
  # process killed by a signal, before the message below.)
  wait -n -p done_pid "${running[@]}" 2> /dev/null || status=$?
  [ -n "$done_pid" ] || continue
  still=()
  for p in "${running[@]}"; do [ "$p" = "$done_pid" ] || still+=("$p"); done
  running=("${still[@]}")
  who=${role[$done_pid]}
  if [[ $who == worker* ]] && [ "$status" -eq 0 ]; then
    workers_left=$((workers_left - 1))
    continue
  fi
  # "(exit 137, killed by SIGKILL)": a code over 128 is the launcher's
  # report of a signal, not the launcher being killed.
  how="exit $status"
  if [ "$status" -gt 128 ] && sig=$(kill -l $((status - 128)) 2>/dev/null); then
    how="$how, killed by SIG$sig"
  fi
  if [[ $who == ps* ]]; then
    echo "run_cluster: $who exited ($how) while the workers ran:" >&2
  else
    echo "run_cluster: $who failed ($how):" >&2
  fi
  show_log "$who"
  echo "run_cluster: stopping the others; every log is in $LOG_DIR" >&2
  exit $(( status == 0 ? 1 : status ))
done
for i in $(seq 0 $((NUM_WORKERS - 1))); do
  [ "$i" = 0 ] || tail -n 1 "$LOG_DIR/worker-$i.log"
done
acc=$(sed -n 's/.*"test_accuracy": \([0-9.]*\).*/\1/p' "$LOG_DIR/worker-0.json")
echo "run_cluster: final test accuracy (chief): $acc; summaries in $LOG_DIR/worker-*.json"
