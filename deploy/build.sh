#!/usr/bin/env bash
# Builds psflow (Release) into BUILD_DIR (default: build), after making sure
# the Debian packages it needs are installed. Extra arguments go to CMake.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$here/build}
JOBS=${JOBS:-$(nproc)}
bash "$here/deploy/setup.sh"
cmake -S "$here" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$BUILD_DIR" -j"$JOBS"
