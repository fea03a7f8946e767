#!/usr/bin/env bash
# The main job: builds psflow, then trains the seed model (Conv2D(32,3x3,relu)
# -> Flatten -> Dense(128,relu) -> Dense(10)) on Debian's Fashion-MNIST with
# 2 parameter servers and 2 asynchronous workers on this machine, 3 epochs
# at batch 64, and prints the final test accuracy.
#
# The PS runs Adam from 0.002 with cosine decay to 0 over the planned
# updates (Keras' CosineDecay; docs/BENCHMARKS.md has the runs that chose it).
# Arguments go to the workers (e.g. --model=two_conv --epochs=8); the decay
# follows --epochs and --batch_size given here. PS_FLAGS replaces the
# optimizer settings (e.g. PS_FLAGS="--learning_rate=0.001" for constant Adam).
# BUILD=0 skips the build and runs the binaries already in BUILD_DIR.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
[ "${BUILD:-1}" = 0 ] || bash "$here/deploy/build.sh"

epochs=3 batch=64 examples=60000 cap=0  # Fashion-MNIST's training set
# The flags that set the decay, in every form the worker takes them:
# --flag=value, --flag value, and the same with one dash.
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  arg=${args[i]}
  [[ $arg == -[!-]* ]] && arg=-$arg
  case $arg in
    --epochs=* | --train_steps=* | --batch_size=* | --dataset=*)
      name=${arg%%=*} value=${arg#*=} ;;
    --epochs | --train_steps | --batch_size | --dataset)
      name=$arg value=${args[i + 1]:-} i=$((i + 1)) ;;
    *) continue ;;
  esac
  case $name in
    --epochs) epochs=$value ;;
    --train_steps) cap=$value ;;
    --batch_size) batch=$value ;;
    --dataset) if [ "$value" = cifar10 ]; then examples=50000; else examples=60000; fi ;;
  esac
done
workers=${NUM_WORKERS:-2}
# The numbers feed the arithmetic below: check them first, so that a typo
# gets a message rather than a bash arithmetic error.
check_count() {  # name value minimum
  if ! [[ $2 =~ ^[0-9]+$ ]] || [ "$((10#$2))" -lt "$3" ]; then
    echo "train.sh: $1 must be an integer >= $3, got \"$2\"" >&2
    exit 2
  fi
}
check_count --epochs "$epochs" 1
check_count --batch_size "$batch" 1
check_count --train_steps "$cap" 0
check_count NUM_WORKERS "$workers" 1
epochs=$((10#$epochs)) batch=$((10#$batch)) cap=$((10#$cap)) workers=$((10#$workers))
export NUM_WORKERS=$workers  # as counted here ("08" is 8)
per_worker=$(( (examples + workers - 1) / workers ))
steps=$(( epochs * ((per_worker + batch - 1) / batch) ))  # per worker
if [ "$cap" -gt 0 ] && [ "$cap" -lt "$steps" ]; then steps=$cap; fi
decay_steps=$(( workers * steps ))
export PS_FLAGS=${PS_FLAGS:---learning_rate=0.002 --learning_rate_schedule=cosine --decay_steps=$decay_steps}

exec bash "$here/deploy/local/run_cluster.sh" --dataset=fashion_mnist --model=seed \
  --batch_size=64 --epochs=3 "$@"
