#!/usr/bin/env bash
# Installs what psflow builds and runs with, from Debian 12's archive, when
# it is missing (as root, or through sudo). Nothing else is downloaded: the
# data set is Debian's dataset-fashion-mnist package. The CUDA toolkit is
# optional and never installed here: CMake builds the CUDA backend when it
# finds /usr/local/cuda. ocl-icd-opencl-dev is only a Recommends of
# libdnnl-dev, but Debian's dnnl-config.cmake calls find_package(OpenCL
# REQUIRED) (its oneDNN is built with the OpenCL GPU runtime), so without it
# CMake stops at find_package(dnnl). python3-grpcio and python3-protobuf are
# for one test only: a client in Python, written from docs/PROTOCOL.md.
# procps (pgrep, ps) is for the launcher's test; a minimal image lacks it.
# libzmq3-dev is for one benchmark only: bench/push_pull_bench times the
# issue's peer, ps-lite, over ZeroMQ, its transport, as a reference.
set -euo pipefail
packages=(
  build-essential cmake pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libre2-dev
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  libdnnl-dev ocl-icd-opencl-dev zlib1g-dev
  dataset-fashion-mnist
  python3-grpcio python3-protobuf procps
  libzmq3-dev
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all build dependencies are installed"
  exit 0
fi
echo "setup: installing ${missing[*]}"
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
# Through env: sudo drops the caller's environment.
$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  "${missing[@]}"
