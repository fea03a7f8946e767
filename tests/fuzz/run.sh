#!/usr/bin/env bash
# Fuzzes the shard's push/pull decoder with libFuzzer for FUZZ_SECONDS
# (default 600), comparing every input with protobuf's parser, under
# AddressSanitizer and UndefinedBehaviorSanitizer (tests/fuzz/wire_fuzz.cc).
# Needs clang with its libFuzzer runtime (Debian: clang, libclang-rt-14-dev);
# not part of CI, which runs the same comparison on 40,000 random mutations
# (grpc_wire_test). A finding is written as crash-* in BUILD_DIR and is a
# bug: add it to grpc_wire_test. Arguments go to the fuzzer.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$here/build-fuzz}
FUZZ_SECONDS=${FUZZ_SECONDS:-600}
CXX=${CXX_FUZZ:-clang++}
bash "$here/deploy/setup.sh"
mkdir -p "$BUILD_DIR/proto" "$BUILD_DIR/corpus"
protoc --cpp_out="$BUILD_DIR/proto" -I "$here/proto" "$here/proto/psflow.proto"
"$CXX" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -I"$here" -I"$BUILD_DIR/proto" \
  "$here/tests/fuzz/wire_fuzz.cc" "$here/common/grpc_wire.cc" "$BUILD_DIR/proto/psflow.pb.cc" \
  -o "$BUILD_DIR/wire_fuzz" \
  -lgtest -lgrpc++ -lgrpc -lgpr -lprotobuf -labsl_strings -labsl_str_format_internal \
  -labsl_status -labsl_cord -labsl_raw_logging_internal -labsl_throw_delegate -lpthread
cd "$BUILD_DIR"
# New inputs go to corpus/ in BUILD_DIR; the committed seeds are only read.
./wire_fuzz -max_total_time="$FUZZ_SECONDS" -max_len=4096 -use_value_profile=1 \
  -print_final_stats=1 "$@" corpus "$here/tests/fuzz/corpus"
