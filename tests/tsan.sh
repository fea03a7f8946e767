#!/usr/bin/env bash
# ThreadSanitizer on the tests whose threads meet in psflow's code: the
# variable store's concurrent pushes, registrations and exactly-once
# ledger, the worker's batcher, and the shard and client under real gRPC
# in one process (the in-process cluster tests). CI runs it after the
# plain and the ASan+UBSan suites.
#
# Debian's Abseil is not built with TSan, so TSan cannot see absl::Mutex
# and reports races that are not. This script fetches Debian's source of
# the installed Abseil (the same version and patches), builds its shared
# libraries with -fsanitize=thread (all of them, so that no inline code of
# Abseil's runs uninstrumented from one of Debian's), and puts them first on
# LD_LIBRARY_PATH (same SONAMEs and ABI). Debian's gRPC stays as it is:
# it hands buffers between its threads through atomics TSan cannot see, so
# TSan is told to ignore what the uninstrumented libraries do
# (ignore_noninstrumented_modules: their mallocs, copies and socket reads
# leave no trace), and tests/tsan.supp names the one kind of report left
# inside gRPC, its own absl::Status objects (docs/ARCHITECTURE.md,
# "Testing"). psflow's code on gRPC's threads is still checked: a counter
# bumped without a lock in the Push handler is reported.
#
# BUILD_DIR (default: build-tsan) keeps the Abseil build between runs.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$here/build-tsan}
JOBS=${JOBS:-$(nproc)}
bash "$here/deploy/setup.sh"
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
if ! command -v dpkg-source >/dev/null; then
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends dpkg-dev
fi

# The source package's version: a binary-only rebuild (+b1) has none of its own.
version=$(dpkg-query -W -f='${source:Version}' libabsl-dev)
absl=$BUILD_DIR/abseil-$version
if [ ! -f "$absl/lib/.built" ]; then
  echo "tsan: building Debian's Abseil $version with -fsanitize=thread"
  rm -rf "$absl"
  mkdir -p "$absl/apt/lists/partial" "$absl/fetch"
  # A private source list and package index, so that the system's apt
  # configuration is left as it is.
  cat >"$absl/apt/sources.list" <<'EOF'
deb-src http://deb.debian.org/debian bookworm main
deb-src http://deb.debian.org/debian bookworm-updates main
deb-src http://deb.debian.org/debian-security bookworm-security main
EOF
  apt_opts=(-o Dir::Etc::SourceList="$absl/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o Dir::State::Lists="$absl/apt/lists" -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -qq
  # The installed version, or, once the archive has moved on to a newer
  # point release of bookworm, that one (the same ABI: security fixes).
  if ! (cd "$absl/fetch" && apt-get "${apt_opts[@]}" source -qq --download-only "abseil=$version"); then
    echo "tsan: abseil $version is no longer in the archive; building bookworm's newest" >&2
    (cd "$absl/fetch" && apt-get "${apt_opts[@]}" source -qq --download-only abseil)
  fi
  dpkg-source -x "$absl"/fetch/abseil_*.dsc "$absl/src" >/dev/null  # applies Debian's patches
  cmake -S "$absl/src" -B "$absl/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON \
    -DCMAKE_CXX_FLAGS=-fsanitize=thread -DCMAKE_C_FLAGS=-fsanitize=thread >/dev/null
  cmake --build "$absl/build" -j"$JOBS"
  mkdir -p "$absl/lib"
  find "$absl/build" -name 'libabsl_*.so*' -exec cp -P {} "$absl/lib/" \;
  touch "$absl/lib/.built"
fi

# The test executables, and the suites of theirs that run (worker_data_test's
# dataset tests stay out).
targets=(variable_store_test worker_data_test tensor_checks_test ps_cluster_test push_model_test
         malformed_request_test training_cluster_test thread_limit_test)
suites=(VariableStoreTest BatcherTest TensorChecksTest
        PsClusterTest PsServerStartTest RawPushTest OneCallAtATimeTest CombineStreamStatusesTest
        PushModelTest MalformedRequestTest
        TrainingClusterTest TrainerStartTest TrainerInputTest TrainerGradientTest
        TrainerPinningTest TrainerClipTest ProgressTest SummaryJsonTest
        ThreadLimitTest ThreadLimitDeadlineTest ThreadLimitBatcherTest ThreadLimitTrainerTest)
cmake -S "$here" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPSFLOW_SANITIZE=thread \
  -DPSFLOW_BUILD_BENCH=OFF -DPSFLOW_ENABLE_CUDA=OFF
cmake --build "$BUILD_DIR" -j"$JOBS" --target "${targets[@]}"

export LD_LIBRARY_PATH="$absl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The run means something only if the tests take the instrumented Mutex.
binary=$(find "$BUILD_DIR/tests" -name variable_store_test -type f | head -1)
# (ldd's output taken whole first: grep -q leaving early would fail the
# pipeline under pipefail.)
libraries=$(ldd "$binary")
if ! grep -qF "=> $absl/lib/libabsl_synchronization.so" <<< "$libraries"; then
  echo "tsan: $binary does not load $absl/lib/libabsl_synchronization.so" >&2
  exit 1
fi
# allocator_may_return_null: a test asks for more memory than exists and
# expects std::bad_alloc, which TSan's allocator would otherwise abort on.
# ignore_noninstrumented_modules: what Debian's gRPC and protobuf do (their
# mallocs, memcpys and socket reads) is not recorded, as their handing over
# between threads cannot be seen either.
export TSAN_OPTIONS="suppressions=$here/tests/tsan.supp:allocator_may_return_null=1:halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1"
# A suite's name is where a test's name begins, or after the instance's
# name and a slash for a parameterized one (ApplyThreads/PushModelTest.x).
# One test measures the shard's resident memory, which under TSan is mostly
# its shadow and its allocator's caches (32-63 MB where the plain and ASan
# passes hold a 24 and a 48 MB bound): left to those passes.
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$JOBS" --timeout 900 --no-tests=error \
  -R "(^|/)($(IFS='|'; echo "${suites[*]}"))\\." -E 'PullOfManyRangesCostsTheShardAboutItsBytes' "$@"
