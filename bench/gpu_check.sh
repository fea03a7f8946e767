#!/usr/bin/env bash
# GPU check for a fresh machine with an NVIDIA GPU (written for one H200,
# 16 cores): installs the build dependencies (deploy/setup.sh, when
# present), builds the CUDA backend test and step_bench, runs the gpu-labelled
# tests, then step_bench on cuda (batch 64 and 256) and on cpu (16 threads)
# for comparison. Logs go to ${OUT:-/tmp/gpu_check}; summary.txt has the
# verdicts and the images/s lines. About 5-8 minutes; exits non-zero when a
# phase fails (the other phases still run).
#
#   bash bench/gpu_check.sh            # from the repository root
#   BUILD_DIR=build-gpu JOBS=16 STEPS=200 bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
LOG_DIR="${OUT:-/tmp/gpu_check}"
BUILD_DIR="${BUILD_DIR:-build-gpu}"
JOBS="${JOBS:-16}"
STEPS="${STEPS:-200}"
mkdir -p "$LOG_DIR"
SUMMARY="$LOG_DIR/summary.txt"
: >"$SUMMARY"
failures=0

# phase NAME TIMEOUT_S CMD...: runs CMD with its output in $LOG_DIR/NAME.log.
phase() {
  local name="$1" limit="$2"
  shift 2
  local start=$SECONDS rc
  echo "=== $name: $*" | tee -a "$SUMMARY"
  timeout --kill-after=10 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
  rc=$?
  echo "    rc=$rc after $((SECONDS - start)) s (log: $name.log)" | tee -a "$SUMMARY"
  if [ "$rc" -ne 0 ]; then
    failures=$((failures + 1))
    tail -n 30 "$LOG_DIR/$name.log" | sed 's/^/    | /' | tee -a "$SUMMARY"
  fi
  return "$rc"
}

if [ -f deploy/setup.sh ]; then
  phase setup 300 bash deploy/setup.sh
else
  echo "=== setup: deploy/setup.sh not found; assuming the build dependencies are installed" \
    | tee -a "$SUMMARY"
fi

if command -v nvidia-smi >/dev/null 2>&1; then
  phase nvidia_smi 60 nvidia-smi
else
  echo "=== nvidia_smi: not installed" | tee -a "$SUMMARY"
fi

phase configure 120 cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DPSFLOW_ENABLE_CUDA=ON || {
  echo "configure failed; stopping" | tee -a "$SUMMARY"
  exit 1
}
grep -E "psflow: CUDA backend" "$LOG_DIR/configure.log" | tee -a "$SUMMARY"

targets=(cuda_backend_test)
[ -f bench/step_bench.cc ] && targets+=(step_bench)
phase build 360 cmake --build "$BUILD_DIR" -j"$JOBS" --target "${targets[@]}"

# Every gpu-labelled test; a failure is rerun with synchronous launches so
# that an asynchronous kernel fault is reported at the call that caused it.
if phase gpu_tests 180 ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure; then
  :
elif [ -x "$BUILD_DIR/tests/worker/cuda/cuda_backend_test" ]; then
  phase gpu_tests_blocking 180 env CUDA_LAUNCH_BLOCKING=1 \
    "$BUILD_DIR/tests/worker/cuda/cuda_backend_test" --gtest_brief=1
fi
grep -E "tests passed|tests failed|\(Failed\)|Not Run|Timeout" "$LOG_DIR/gpu_tests.log" \
  2>/dev/null | head -n 40 | sed 's/^/    /' | tee -a "$SUMMARY"

# bench NAME ARGS...: one step_bench run, its result lines into the summary.
bench() {
  local name="$1"
  shift
  phase "$name" 120 "$BUILD_DIR/bench/step_bench" "$@"
  grep -E "^(step_bench: device|train|eval|JSON)" "$LOG_DIR/$name.log" | sed 's/^/    /' \
    | tee -a "$SUMMARY"
}

if [ -x "$BUILD_DIR/bench/step_bench" ]; then
  cpu_steps=$((STEPS / 4 > 10 ? STEPS / 4 : 10))
  bench step_bench_cuda_seed_b64 --device=cuda --model=seed --batch_size=64 --steps="$STEPS"
  bench step_bench_cuda_seed_b256 --device=cuda --model=seed --batch_size=256 --steps="$STEPS"
  bench step_bench_cuda_two_conv_b256 --device=cuda --model=two_conv --batch_size=256 \
    --steps="$STEPS"
  bench step_bench_cpu_seed_b64 --device=cpu --threads=16 --model=seed --batch_size=64 \
    --steps="$cpu_steps"
  bench step_bench_cpu_seed_b256 --device=cpu --threads=16 --model=seed --batch_size=256 \
    --steps="$cpu_steps"
else
  echo "=== step_bench: not built (bench/step_bench.cc missing or build failed)" | tee -a "$SUMMARY"
  failures=$((failures + 1))
fi

echo "=== done: $failures failed phase(s); logs in $LOG_DIR" | tee -a "$SUMMARY"
[ "$failures" -eq 0 ]
