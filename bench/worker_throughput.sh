#!/usr/bin/env bash
# Full training step vs compute alone, seed model at batch 64 on the CPU:
#   1. compute only (forward + backward), bench/step_bench;
#   2. the full step against one ps_server (pull, compute, push with Adam on
#      the PS), the real worker binary, with its time per phase: overlapped
#      with compute (the default), overlapped as one fused PushPull call,
#      and not overlapped.
# Both with THREADS compute threads (default 1); the PS runs beside them on
# the same machine, or, with PS_NETNS and PS_HOST (see
# deploy/local/run_cluster.sh), across an emulated network link.
# WORKER_FLAGS adds flags to every worker (e.g. --ps_streams=4).
# Usage: bench/worker_throughput.sh [BUILD_DIR]   (DATA_DIR: the worker's --data_dir)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${1:-$here/build}
THREADS=${THREADS:-1}
STEPS=${STEPS:-400}
read -r -a worker_flags <<<"${WORKER_FLAGS:-}"
echo "== machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
echo "== compute only: step_bench --threads=$THREADS"
"$BUILD_DIR/bench/step_bench" --device=cpu --model=seed --batch_size=64 --threads="$THREADS" \
  --steps=200 --warmup=20 | tee /tmp/psflow_step_bench.txt
compute=$(sed -n 's/.*"train_images_per_s":\([0-9.]*\).*/\1/p' /tmp/psflow_step_bench.txt)
for mode in "true false" "true true" "false false"; do
  read -r overlap fused <<<"$mode"
  echo "== full step: 1 ps_server + 1 worker, --threads=$THREADS --overlap=$overlap --fused_push_pull=$fused ${WORKER_FLAGS:-}, $STEPS steps"
  LOG_DIR=/tmp/psflow_throughput NUM_PS=1 NUM_WORKERS=1 BUILD_DIR="$BUILD_DIR" \
    bash "$here/deploy/local/run_cluster.sh" --model=seed --batch_size=64 --epochs=1 \
    --train_steps="$STEPS" --threads="$THREADS" --device=cpu --overlap=$overlap \
    --fused_push_pull=$fused ${DATA_DIR:+--data_dir="$DATA_DIR"} ${worker_flags[@]+"${worker_flags[@]}"} \
    >/tmp/psflow_tp.log 2>&1 \
    || { cat /tmp/psflow_tp.log; exit 1; }
  python3 - "$compute" "overlap=$overlap fused=$fused" /tmp/psflow_throughput/worker-0.json <<'PY'
import json, sys
compute, mode, path = float(sys.argv[1]), sys.argv[2], sys.argv[3]
s = json.load(open(path))
p, n = s["phases"], s["steps"]
full = s["examples_per_sec"]
print(f"full step ({mode}): {full:.0f} images/s = {full / compute:.0%} of compute-only {compute:.0f}")
print("  per step ms: " + ", ".join(f"{k[:-2]} {1e3 * v / n:.2f}" for k, v in p.items() if k != "eval_s" and v > 0))
print(f"  resident MB per epoch: {[round(e['resident_bytes'] / 1e6) for e in s['epochs']]}")
PY
done
