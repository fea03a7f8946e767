#!/usr/bin/env bash
# Builds, on this machine, what bench/gpu_check.sh runs on a GPU machine that
# has the NVIDIA driver and CUDA runtime libraries but none of Debian's
# packages (no gRPC, Abseil, oneDNN, GoogleTest, and no network to install
# them): the binaries with CUDA for Hopper (sm_90), the shared libraries they
# need apart from glibc and the CUDA libraries the GPU machine brings
# (cuDNN, cuBLAS), and the Fashion-MNIST files, packed into one archive.
#
#   bash bench/gpu_bundle.sh [DIR]     # default: .gpubundle
#   PREBUILT=.gpubundle bash bench/gpu_check.sh   # there
#
# DIR then holds psflow-gpu.tar.xz (binaries and libraries) and data/.
#
# libstdc++ and libgcc_s go in lib-fallback/: gpu_check.sh uses them only when
# the GPU machine's own are older than what the binaries need.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=${1:-$here/.gpubundle}
ARCHIVE=$OUT_DIR/psflow-gpu.tar.xz
BUILD_DIR=${BUILD_DIR:-$here/build-gpu}
JOBS=${JOBS:-$(nproc)}
DATA_DIR=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
bash "$here/deploy/setup.sh"
cmake -S "$here" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DPSFLOW_ENABLE_CUDA=ON >/dev/null
# Binaries, at the same paths as in a build tree, so that the scripts that
# take a BUILD_DIR (run_cluster.sh, worker_throughput.sh) run them as they are.
bins=(tests/worker/cuda/cuda_backend_test bench/step_bench worker/worker ps_server/ps_server
  bench/push_pull_bench bench/optimizer_bench)
targets=()
for b in "${bins[@]}"; do targets+=("$(basename "$b")"); done
cmake --build "$BUILD_DIR" -j"$JOBS" --target "${targets[@]}"
[ -x "$BUILD_DIR/tests/worker/cuda/cuda_backend_test" ] || {
  echo "gpu_bundle: cuda_backend_test was not built: CMake did not find CUDA and cuDNN" >&2
  exit 1
}

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/build" "$stage/lib" "$stage/lib-fallback"
for b in "${bins[@]}"; do
  mkdir -p "$stage/build/$(dirname "$b")"
  cp "$BUILD_DIR/$b" "$stage/build/$b"
done
# Every library a binary loads, but glibc's own and the big CUDA libraries
# (cuDNN and cuBLAS come with the GPU machine; cudart is small and is taken).
for b in "${bins[@]}"; do ldd "$BUILD_DIR/$b"; done | awk '/=>/ && $3 ~ /^\// {print $3}' | sort -u |
  while read -r lib; do
    name=$(basename "$lib")
    case "$name" in
      libc.so.* | libm.so.* | libdl.so.* | librt.so.* | libpthread.so.* | ld-linux*) ;;
      libcudnn*.so* | libcublas*.so* | libcuda.so*) ;;
      libstdc++.so.* | libgcc_s.so.*) cp -L "$lib" "$stage/lib-fallback/$name" ;;
      *) cp -L "$lib" "$stage/lib/$name" ;;
    esac
  done
rm -rf "$OUT_DIR/data"
mkdir -p "$OUT_DIR/data"
cp "$DATA_DIR"/*-ubyte.gz "$OUT_DIR/data/"
tar -C "$stage" -cf - . | xz -T"$JOBS" -6 >"$ARCHIVE"
echo "gpu_bundle: $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1)): ${#bins[@]} binaries," \
  "$(ls "$stage/lib" | wc -l) libraries; data in $OUT_DIR/data"
