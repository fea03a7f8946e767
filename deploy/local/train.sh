#!/usr/bin/env bash
# The main job: builds psflow, then trains the seed model (Conv2D(32,3x3,relu)
# -> Flatten -> Dense(128,relu) -> Dense(10)) on Debian's Fashion-MNIST with
# 2 parameter servers and 2 asynchronous workers on this machine, 3 epochs
# at batch 64 with Adam on the PS, and prints the final test accuracy.
# Arguments go to the workers (e.g. --model=two_conv --epochs=5).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
bash "$here/deploy/build.sh"
exec bash "$here/deploy/local/run_cluster.sh" --dataset=fashion_mnist --model=seed \
  --batch_size=64 --epochs=3 "$@"
