#!/usr/bin/env bash
# Starts a psflow cluster on this machine: NUM_PS ps_server processes and
# NUM_WORKERS worker processes, each told its role through TF_CONFIG exactly
# as Kubeflow's TFJob would. Waits for the workers, then stops the servers.
# Every process it started is stopped when it ends or is interrupted.
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
here=$(cd "$(dirname "$0")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$here/build}
NUM_PS=${NUM_PS:-2}
NUM_WORKERS=${NUM_WORKERS:-2}
LOG_DIR=${LOG_DIR:-$BUILD_DIR/run}
PS_FLAGS=${PS_FLAGS:-}
PS_NETNS=${PS_NETNS:-}
PS_HOST=${PS_HOST:-localhost}
ps_launch=()
[ -z "$PS_NETNS" ] || ps_launch=(ip netns exec "$PS_NETNS")
ps_bin=$BUILD_DIR/ps_server/ps_server
worker_bin=$BUILD_DIR/worker/worker
for b in "$ps_bin" "$worker_bin"; do
  [ -x "$b" ] || { echo "run_cluster: $b is missing; build first (deploy/build.sh)" >&2; exit 1; }
done
mkdir -p "$LOG_DIR"

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
pick_base() {
  local base
  for _ in $(seq 50); do
    base=$(( 20000 + (RANDOM % 2000) * 10 ))
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

# Compute threads per worker: the cores shared among the workers.
cores=$(nproc)
threads=$(( cores / NUM_WORKERS )); [ "$threads" -ge 1 ] || threads=1

pids=()
cleanup() {
  # A second Ctrl-C (or a SIGINT to the whole process group) must not cut the
  # cleanup short and leave processes running.
  trap - EXIT
  trap '' INT TERM
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'echo "run_cluster: interrupted, stopping the cluster" >&2; exit 130' INT TERM

echo "run_cluster: $NUM_PS ps + $NUM_WORKERS workers on localhost:$BASE_PORT.., logs in $LOG_DIR"
for i in $(seq 0 $((NUM_PS - 1))); do
  TF_CONFIG=$(tf_config ps "$i") "${ps_launch[@]}" "$ps_bin" --threads=0 $PS_FLAGS >"$LOG_DIR/ps-$i.log" 2>&1 &
  pids+=($!)
done
# A shard that cannot start (a port in use, a bad flag) ends at once: report
# its log now rather than a worker's connection errors later.
sleep 0.5
for i in $(seq 0 $((NUM_PS - 1))); do
  if ! kill -0 "${pids[$i]}" 2>/dev/null; then
    echo "run_cluster: ps $i exited at start; $LOG_DIR/ps-$i.log says:" >&2
    tail -n 5 "$LOG_DIR/ps-$i.log" >&2
    exit 1
  fi
done
worker_pids=()
for i in $(seq 0 $((NUM_WORKERS - 1))); do
  if [ "$i" = 0 ]; then
    # The chief's progress goes to the terminal; everyone's to the logs.
    # (tee in a process substitution, so that $! is the worker itself and
    # the cleanup's SIGTERM reaches it.)
    TF_CONFIG=$(tf_config worker 0) "$worker_bin" --threads=$threads \
      --summary_json="$LOG_DIR/worker-0.json" "$@" > >(tee "$LOG_DIR/worker-0.log") 2>&1 &
  else
    TF_CONFIG=$(tf_config worker "$i") "$worker_bin" --threads=$threads \
      --summary_json="$LOG_DIR/worker-$i.json" "$@" >"$LOG_DIR/worker-$i.log" 2>&1 &
  fi
  pids+=($!)
  worker_pids+=($!)
done

status=0
for p in "${worker_pids[@]}"; do wait "$p" || status=$?; done
if [ $status -ne 0 ]; then
  echo "run_cluster: a worker failed (exit $status); see $LOG_DIR/worker-*.log" >&2
  for f in "$LOG_DIR"/worker-*.log "$LOG_DIR"/ps-*.log; do
    echo "--- $f" >&2
    tail -n 3 "$f" >&2
  done
  exit $status
fi
for i in $(seq 0 $((NUM_WORKERS - 1))); do
  [ "$i" = 0 ] || tail -n 1 "$LOG_DIR/worker-$i.log"
done
acc=$(sed -n 's/.*"test_accuracy": \([0-9.]*\).*/\1/p' "$LOG_DIR/worker-0.json")
echo "run_cluster: final test accuracy (chief): $acc; summaries in $LOG_DIR/worker-*.json"
