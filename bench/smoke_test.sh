#!/usr/bin/env bash
# ctest's push_pull_bench_smoke: a short run of push_pull_bench against the
# ps_server built beside it, so that the benchmark keeps building and
# running. It checks that the run ends well and prints every row it
# promises (the peer's, zmq_push and zmq_pull, where it was built with
# ZeroMQ), never how fast anything was.
#   bench/smoke_test.sh PUSH_PULL_BENCH PS_SERVER WITH_ZMQ(1|0)
set -uo pipefail
bench=$1 server=$2 with_zmq=$3
out=$("$bench" --ps_server="$server" --iterations=2 --warmup=1 --batch=1 --shards=1 \
  --transports=tcp --small_vars=false 2>&1)
rc=$?
echo "$out"
fail() {
  echo "FAIL: $*"
  exit 1
}
[ "$rc" -eq 0 ] || fail "push_pull_bench exited with status $rc"
rows=(raw raw_opt raw_pipe push pull pushpull)
lines=("push vs raw_opt" "push vs raw_pipe" "push: its CPU" "pull: its CPU")
if [ "$with_zmq" = 1 ]; then
  rows+=(zmq_push zmq_pull)
  lines+=("push vs zmq_push" "pull vs zmq_pull")
fi
for row in "${rows[@]}"; do
  grep -qE "^tcp +1 +$row +[0-9]" <<<"$out" || fail "no '$row' row in the output above"
done
for line in "${lines[@]}"; do
  grep -qF "$line" <<<"$out" || fail "no '$line' line in the output above"
done
echo "push_pull_bench printed its ${#rows[@]} rows and ${#lines[@]} comparisons"
