#!/usr/bin/env bash
# The test command: installs the build dependencies if needed, builds
# everything from scratch in BUILD_DIR (default: build-tests) and runs the
# whole CTest suite (labels unit, integration, fault; gpu tests skip without
# a GPU). Arguments go to ctest (e.g. -L unit); KEEP_BUILD=1 reuses the
# build directory instead of starting from scratch.
#
# SANITIZE=address,undefined builds the C++ code with those sanitizers
# instead (default BUILD_DIR: build-sanitize; no benchmarks, no CUDA) and
# runs the same tests, any finding failing its test. CI runs the suite both
# ways, then tests/tsan.sh (ThreadSanitizer on the concurrency tests).
# SANITIZE=thread builds everything with TSan; tests/tsan.sh is the way to
# run it, with the options and suppressions that Debian's uninstrumented
# gRPC needs (docs/ARCHITECTURE.md, "Testing").
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
SANITIZE=${SANITIZE:-}
cmake_args=(-DCMAKE_BUILD_TYPE=Release)
if [ -n "$SANITIZE" ]; then
  BUILD_DIR=${BUILD_DIR:-$here/build-sanitize}
  cmake_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DPSFLOW_SANITIZE="$SANITIZE"
              -DPSFLOW_BUILD_BENCH=OFF -DPSFLOW_ENABLE_CUDA=OFF)
fi
BUILD_DIR=${BUILD_DIR:-$here/build-tests}
JOBS=${JOBS:-$(nproc)}
bash "$here/deploy/setup.sh"
[ "${KEEP_BUILD:-0}" = 1 ] || rm -rf "$BUILD_DIR"
cmake -S "$here" -B "$BUILD_DIR" "${cmake_args[@]}"
cmake --build "$BUILD_DIR" -j"$JOBS"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$JOBS" --timeout 900 "$@"
