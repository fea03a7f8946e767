#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU (written for one H200, 16
# cores). Runs the gpu-labelled tests (CUDA backend against the reference
# backend), step_bench on cuda and cpu, the main job with --device=cuda (2 PS +
# 2 workers, 3 epochs), the full step on cuda with one PS, and, since such a
# machine has cores to spare, the CPU full-step and push/pull benchmarks with
# the PS on cores of its own. 4-6 minutes on the H200 machine. Exits non-zero when a phase
# fails (the other phases still run).
#
# Two ways to get the binaries:
#   bash bench/gpu_check.sh                  # builds here: needs deploy/setup.sh's packages
#   PREBUILT=.gpubundle bash bench/gpu_check.sh
# The second takes what bench/gpu_bundle.sh packed on a Debian 12 machine
# (binaries, their libraries, Fashion-MNIST), for a GPU machine that has the
# driver and the CUDA libraries (cuDNN, cuBLAS) but cannot install packages.
#
# Per-phase logs go to LOG_DIR (default /tmp/gpu_check); summary.txt (verdicts
# and result lines) and all.log (every phase's log) go to $OUT when it is set,
# else to LOG_DIR. ONLY=REGEX runs just the phases whose names match (plus
# the setup ones), for a short second run:
#   ONLY='push_pull|main_job|full_step' PREBUILT=.gpubundle bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
repo=$(pwd)
LOG_DIR="${LOG_DIR:-/tmp/gpu_check}"
RESULT_DIR="${OUT:-$LOG_DIR}"
BUILD_DIR="${BUILD_DIR:-build-gpu}"
JOBS="${JOBS:-$(nproc)}"
STEPS="${STEPS:-200}"
PREBUILT="${PREBUILT:-}"
mkdir -p "$LOG_DIR" "$RESULT_DIR"
SUMMARY="$RESULT_DIR/summary.txt"
ALL="$RESULT_DIR/all.log"
: >"$SUMMARY"
: >"$ALL"
failures=0
note() { echo "$*" | tee -a "$SUMMARY"; }

# phase NAME TIMEOUT_S CMD...: runs CMD with its output in $LOG_DIR/NAME.log.
phase() {
  local name="$1" limit="$2"
  shift 2
  local start=$SECONDS rc
  case "$name" in nvidia_smi | unpack | libraries | setup | configure | build) ;; *)
    if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then
      : >"$LOG_DIR/$name.log"  # skipped: the result greps find nothing
      return 0
    fi ;;
  esac
  note "=== $name: $*"
  timeout --kill-after=10 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
  rc=$?
  note "    rc=$rc after $((SECONDS - start)) s"
  { echo "===== $name (rc=$rc): $*"; cat "$LOG_DIR/$name.log"; } >>"$ALL"
  if [ "$rc" -ne 0 ]; then
    failures=$((failures + 1))
    tail -n 30 "$LOG_DIR/$name.log" | sed 's/^/    | /' | tee -a "$SUMMARY"
  fi
  return "$rc"
}

command -v nvidia-smi >/dev/null 2>&1 && phase nvidia_smi 60 nvidia-smi
note "=== machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"

if [ -n "$PREBUILT" ]; then
  PREBUILT=$(cd "$PREBUILT" && pwd)
  root=/tmp/psflow_gpu
  rm -rf "$root" && mkdir -p "$root"
  phase unpack 120 tar -C "$root" -xJf "$PREBUILT/psflow-gpu.tar.xz" || exit 1
  BUILD_DIR=$root/build
  DATA_DIR=${DATA_DIR:-$PREBUILT/data}
  # cuDNN and cuBLAS from the machine: the CUDA toolkit's folders, the
  # system's, or the NVIDIA wheels beside the machine's Python.
  libdirs=$root/lib
  for lib in libcudnn.so.9 libcublas.so.13 libcublasLt.so.13; do
    found=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /opt /usr/local/lib \
      -name "$lib" 2>/dev/null | head -n 1)
    if [ -n "$found" ]; then
      note "    $lib: $found"
      libdirs=$libdirs:$(dirname "$found")
    else
      note "    $lib: not found on this machine"
    fi
  done
  export LD_LIBRARY_PATH=$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  if ldd "$BUILD_DIR/worker/worker" "$BUILD_DIR/tests/worker/cuda/cuda_backend_test" 2>&1 \
      | grep -q "GLIBCXX\|CXXABI\|GCC_[0-9]\|libstdc++.so.6 => not found"; then
    note "    the machine's libstdc++ is older than the build's: using the bundled one"
    export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$root/lib-fallback
  fi
  bins="$BUILD_DIR/bench/* $BUILD_DIR/worker/worker $BUILD_DIR/ps_server/ps_server \
    $BUILD_DIR/tests/worker/cuda/cuda_backend_test"
  phase libraries 60 bash -c "ldd $bins 2>&1 | grep -E 'not found|cudnn|cublas|cudart|libstdc' \
    | sort | uniq -c; ! ldd $bins 2>&1 | grep -q 'not found'"
  grep -E "not found|cudnn|cublas" "$LOG_DIR/libraries.log" | sed 's/^/    /' | tee -a "$SUMMARY"
else
  DATA_DIR=${DATA_DIR:-}
  if [ -f deploy/setup.sh ]; then phase setup 300 bash deploy/setup.sh; fi
  phase configure 120 cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DPSFLOW_ENABLE_CUDA=ON || exit 1
  grep -E "psflow: CUDA backend" "$LOG_DIR/configure.log" | tee -a "$SUMMARY"
  phase build 360 cmake --build "$BUILD_DIR" -j"$JOBS" --target cuda_backend_test \
    step_bench worker ps_server push_pull_bench
fi
BUILD_DIR=$(cd "$BUILD_DIR" && pwd)
data_flag=()
[ -z "$DATA_DIR" ] || data_flag=(--data_dir="$DATA_DIR")

# The CUDA backend against the reference backend; a failure is rerun with
# synchronous launches so that an asynchronous kernel fault is reported at the
# call that caused it.
test_bin=$BUILD_DIR/tests/worker/cuda/cuda_backend_test
if ! phase gpu_tests 180 "$test_bin"; then
  phase gpu_tests_blocking 120 env CUDA_LAUNCH_BLOCKING=1 "$test_bin" --gtest_brief=1
fi
grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran" "$LOG_DIR/gpu_tests.log" | sed 's/^/    /' \
  | tee -a "$SUMMARY"

# bench NAME ARGS...: one step_bench run, its result lines into the summary.
bench() {
  local name="$1"
  shift
  phase "$name" 90 "$BUILD_DIR/bench/step_bench" "$@"
  grep -E "^(step_bench: device|train|eval|JSON)" "$LOG_DIR/$name.log" | sed 's/^/    /' \
    | tee -a "$SUMMARY"
}
cpu_steps=$((STEPS / 4 > 10 ? STEPS / 4 : 10))
bench step_bench_cuda_seed_b64 --device=cuda --model=seed --batch_size=64 --steps="$STEPS"
# ... with parameters and gradients copied through the staging buffers (as
# before PinHostMemory): the difference is what pinning saves per step.
bench step_bench_cuda_seed_b64_staged --device=cuda --model=seed --batch_size=64 \
  --steps="$STEPS" --pin_host_memory=false
bench step_bench_cuda_seed_b256 --device=cuda --model=seed --batch_size=256 --steps="$STEPS"
bench step_bench_cuda_two_conv_b256 --device=cuda --model=two_conv --batch_size=256 \
  --steps="$STEPS"
bench step_bench_cpu_seed_b64 --device=cpu --threads=8 --model=seed --batch_size=64 \
  --steps="$cpu_steps"

# cluster NAME TIMEOUT_S SCRIPT ENV... -- WORKER_FLAGS...: deploy/local/SCRIPT
# (train.sh: the main job's optimizer settings; run_cluster.sh: the PS's
# defaults) on the binaries of BUILD_DIR, the chief's summary JSON in the
# summary.
cluster() {
  local name="$1" limit="$2" script="$3"
  shift 3
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  phase "$name" "$limit" env "${envs[@]}" BUILD=0 BUILD_DIR="$BUILD_DIR" \
    LOG_DIR="$LOG_DIR/$name" bash "$repo/deploy/local/$script" "${data_flag[@]}" "$@"
  grep -E "run_cluster: final" "$LOG_DIR/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
  if [ -f "$LOG_DIR/$name/worker-0.json" ]; then
    python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); n=s["steps"]; \
print("    worker 0: %d steps, %.0f images/s, test_accuracy %s, per step ms: %s" % (n, \
s["examples_per_sec"], s.get("test_accuracy"), ", ".join("%s %.2f" % (k[:-2], 1e3*v/n) \
for k, v in s["phases"].items() if v > 0)))' "$LOG_DIR/$name/worker-0.json" | tee -a "$SUMMARY"
    cat "$LOG_DIR/$name"/worker-*.json >>"$ALL"
  fi
}
# The main job on the GPU (deploy/local/train.sh: seed model, Fashion-MNIST,
# 2 PS + 2 workers, 3 epochs, its Adam settings); MAIN_JOB_RUNS times
# (default 1) for its accuracy's spread.
for run in $(seq "${MAIN_JOB_RUNS:-1}"); do
  cluster "main_job_cuda_$run" 240 train.sh NUM_PS=2 NUM_WORKERS=2 -- --device=cuda
done
# The full step on the GPU against one PS: overlapped (default) and fused.
cluster full_step_cuda 90 run_cluster.sh NUM_PS=1 NUM_WORKERS=1 -- --device=cuda \
  --epochs=1 --train_steps=400 --batch_size=64
cluster full_step_cuda_fused 90 run_cluster.sh NUM_PS=1 NUM_WORKERS=1 -- --device=cuda \
  --epochs=1 --train_steps=400 --batch_size=64 --fused_push_pull=true
# ... with each push and pull split over 4 connections to the PS.
cluster full_step_cuda_streams4 90 run_cluster.sh NUM_PS=1 NUM_WORKERS=1 -- --device=cuda \
  --epochs=1 --train_steps=400 --batch_size=64 --ps_streams=4

# CPU: the full step against compute alone with the PS on cores of its own,
# and push/pull against raw TCP with the client and the servers not sharing
# two cores.
for t in 1 8; do
  phase "worker_throughput_t$t" 150 env THREADS=$t STEPS=300 DATA_DIR="$DATA_DIR" \
    bash bench/worker_throughput.sh "$BUILD_DIR"
  grep -E "^(full step|  per step|train)" "$LOG_DIR/worker_throughput_t$t.log" \
    | sed 's/^/    /' | tee -a "$SUMMARY"
done
phase worker_throughput_t8_streams4 150 env THREADS=8 STEPS=300 DATA_DIR="$DATA_DIR" \
  WORKER_FLAGS=--ps_streams=4 bash bench/worker_throughput.sh "$BUILD_DIR"
grep -E "^(full step|  per step|train)" "$LOG_DIR/worker_throughput_t8_streams4.log" \
  | sed 's/^/    /' | tee -a "$SUMMARY"
# Push and pull against raw TCP, each shard's calls over 1, 2 and 4
# connections (1x4: one shard, 4 connections).
phase push_pull_bench 200 "$BUILD_DIR/bench/push_pull_bench" --iterations=30 --transports=tcp \
  --streams=1,2,4
# Two workers pushing and pulling at once to two shards, as in the main job
# (whose workers waited 17-20 ms per step for an 11 MB push on this machine).
phase push_pull_bench_2clients 90 "$BUILD_DIR/bench/push_pull_bench" --iterations=30 \
  --transports=tcp --shards=2 --streams=1,4 --ops=push,pull --small_vars=false --clients=2
{ echo "  2 clients at once, 2 shards:"; grep -E " (raw|raw_opt|push|pull) |by thread|vs raw_opt" \
  "$LOG_DIR/push_pull_bench_2clients.log" | sed 's/^/    /'; } >>"$SUMMARY"
# The one-shard push with the shard's settings varied: no applier threads
# (apply on the reading thread), and one or eight messages of a push applied
# at once (the default is 4).
for variant in --apply_threads=0 --apply_window=1 --apply_window=8; do
  name=push_pull_bench_$(echo "$variant" | tr -c 'a-z0-9\n' '_' | cut -c3-40)
  phase "$name" 90 "$BUILD_DIR/bench/push_pull_bench" --iterations=30 --transports=tcp \
    --shards=1 --streams=1,4 --ops=push --small_vars=false --ps_flags="$variant"
  { echo "  ps_server $variant:"; grep -E " push |vs raw_opt" "$LOG_DIR/$name.log" | sed 's/^/    /'; } \
    >>"$SUMMARY"
done
grep -vE "^\s*$|^JSON" "$LOG_DIR/push_pull_bench.log" | sed 's/^/    /' >>"$SUMMARY"

note "=== done: $failures failed phase(s); logs in $LOG_DIR"
[ "$failures" -eq 0 ]
