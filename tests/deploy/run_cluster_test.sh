#!/usr/bin/env bash
# Runs deploy/local/run_cluster.sh as a user would, against the binaries of
# the build directory given as $1:
#  - a short run trains and reports the chief's accuracy;
#  - deploy/local/train.sh sets the decay from the flags however written;
#  - settings it cannot use are refused with a message;
#  - a chief killed early ends the run at once (the other worker used to
#    keep it waiting for the chief's variables, 5 minutes);
#  - the launcher killed with SIGKILL, which runs no cleanup, leaves none
#    of its processes running;
#  - a Ctrl-C (SIGINT to the launcher's process group) stops the shards
#    once, cleanly, and a second launcher on the same LOG_DIR is refused.
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
export BUILD_DIR=${1:?usage: run_cluster_test.sh BUILD_DIR}
run=$here/deploy/local/run_cluster.sh
work=$(mktemp -d)
launched_in_session=  # a launcher in a session of its own, stopped at the end whatever happens
trap '[ -z "$launched_in_session" ] || kill -TERM -- "-$launched_in_session" 2> /dev/null; rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
# expect NAME WANT_RC WANT_TEXT RC OUTPUT_FILE
expect() {
  if [ "$4" != "$2" ]; then fail "$1: exit code $4, expected $2"; cat "$5" >&2; fi
  grep -qF -- "$3" "$5" || { fail "$1: output lacks \"$3\""; cat "$5" >&2; }
}
# waits up to $2 seconds for $1 worker processes whose command line holds
# $3: the worker binary itself, not setpriv about to start it (which may not
# have set its parent-death signal yet)
wait_for_processes() {
  for _ in $(seq $(($2 * 10))); do
    [ "$(pgrep -fc -- "^$BUILD_DIR/worker/worker .*$3")" -ge "$1" ] && return 0
    sleep 0.1
  done
  return 1
}

# A short run.
NUM_PS=1 NUM_WORKERS=2 LOG_DIR=$work/ok timeout 240 bash "$run" --train_steps=3 --epochs=1 \
  > "$work/ok.out" 2>&1
expect "a short run" 0 "run_cluster: final test accuracy (chief): 0." $? "$work/ok.out"

# The main job's script, its flags written with a space: the decay follows
# them (--train_steps 3 for 2 workers: 6 updates; it used to read only
# --flag=value, and kept the 3 epochs' 2814).
BUILD=0 NUM_PS=1 NUM_WORKERS=2 LOG_DIR=$work/train timeout 240 \
  bash "$here/deploy/local/train.sh" --train_steps 3 -epochs 1 > "$work/train.out" 2>&1
expect "train.sh with spaced flags" 0 "run_cluster: final test accuracy (chief): 0." $? \
  "$work/train.out"
grep -qF "schedule=cosine(decay_steps=6," "$work/train/ps-0.log" ||
  { fail "train.sh: the shard's decay is not 6 steps"; cat "$work/train/ps-0.log" >&2; }

# Settings it cannot use.
NUM_WORKERS=08x LOG_DIR=$work/bad timeout 60 bash "$run" > "$work/bad.out" 2>&1
expect "NUM_WORKERS=08x" 2 'NUM_WORKERS must be an integer from 1 to 256, got "08x"' $? \
  "$work/bad.out"
LOG_DIR=$work/bad timeout 60 bash "$run" --summary_json=/tmp/x.json > "$work/bad.out" 2>&1
expect "--summary_json" 2 "set LOG_DIR instead of --summary_json=/tmp/x.json" $? "$work/bad.out"

# The chief killed early: the run ends with its exit code, naming it.
LOG_DIR=$work/chief timeout 240 bash "$run" --train_steps=100000 --epochs=1 \
  > "$work/chief.out" 2>&1 &
launcher=$!
if wait_for_processes 1 60 "--summary_json=$work/chief/worker-0.json"; then
  start=$(date +%s)
  pkill -9 -f -- "--summary_json=$work/chief/worker-0.json"
  wait "$launcher"
  rc=$?
  expect "a chief killed early" 137 "run_cluster: worker 0 failed (exit 137, killed by SIGKILL)" $rc \
    "$work/chief.out"
  # bash's own report of the killed job ("line 167: 2730 Killed ...") is
  # not the launcher's to print.
  ! grep -q "Killed" "$work/chief.out" || { fail "bash's job report in the output"; cat "$work/chief.out" >&2; }
  took=$(($(date +%s) - start))
  [ "$took" -le 60 ] || fail "the run ended ${took} s after its chief was killed"
else
  fail "the chief never started"; cat "$work/chief.out" >&2
  kill "$launcher"; wait "$launcher"
fi

# The launcher killed: its shards and workers follow it.
LOG_DIR=$work/kill bash "$run" --train_steps=100000 --epochs=1 > "$work/kill.out" 2>&1 &
launcher=$!
if wait_for_processes 2 60 "--summary_json=$work/kill/worker-"; then
  children=$(pgrep -P "$launcher" | tr '\n' ' ')
  # (None found would make the check below pass on nothing.)
  [ -n "$children" ] || fail "found none of the launcher's processes to check"
  kill -9 "$launcher"
  wait "$launcher" 2> /dev/null
  left=
  for _ in $(seq 100); do
    left=
    for p in $children; do kill -0 "$p" 2> /dev/null && left+="$p "; done
    [ -z "$left" ] && break
    sleep 0.1
  done
  if [ -n "$left" ]; then
    left=${left% }
    fail "processes left running after the launcher was killed: $(ps -o pid=,args= -p "${left// /,}")"
    kill -9 $left 2> /dev/null
  fi
else
  fail "the workers never started"; cat "$work/kill.out" >&2
  kill "$launcher"; wait "$launcher"
fi

# A Ctrl-C on a terminal: SIGINT to the launcher's whole process group
# (its own session here, with SIGINT as a terminal would leave it, not
# ignored as for a background job). The shards got it too, then the
# cleanup's SIGTERM as a second signal: exit 1 and no "stopped" line.
LOG_DIR=$work/int setsid env --default-signal=INT bash "$run" --train_steps=100000 --epochs=1 \
  > "$work/int.out" 2>&1 &
launcher=$!
launched_in_session=$launcher
if wait_for_processes 2 60 "--summary_json=$work/int/worker-"; then
  # A second run on the same LOG_DIR would write over this one's logs.
  LOG_DIR=$work/int timeout 60 bash "$run" --train_steps=3 > "$work/second.out" 2>&1
  expect "a second run on one LOG_DIR" 1 "uses LOG_DIR=$work/int; wait for it" $? "$work/second.out"
  kill -INT -- "-$launcher"
  # (At most 60 s: a launcher that ignored it would run its 100000 steps.)
  for _ in $(seq 600); do kill -0 "$launcher" 2> /dev/null || break; sleep 0.1; done
  kill -0 "$launcher" 2> /dev/null && { fail "a Ctrl-C did not stop the launcher"; kill -KILL -- "-$launcher"; }
  wait "$launcher"
  expect "a Ctrl-C" 130 "run_cluster: interrupted, stopping the cluster" $? "$work/int.out"
  # Each shard heard one signal, the launcher's SIGTERM (the Ctrl-C's SIGINT
  # reached them too, and the SIGTERM then cut their shutdown short).
  for i in 0 1; do
    grep -q "shard $i received SIGTERM" "$work/int/ps-$i.log" &&
      grep -q "shard $i stopped after" "$work/int/ps-$i.log" &&
      ! grep -q "SIGINT" "$work/int/ps-$i.log" ||
      { fail "a Ctrl-C: ps $i did not stop once, cleanly"; cat "$work/int/ps-$i.log" >&2; }
  done
else
  fail "the workers never started"; cat "$work/int.out" >&2
  kill "$launcher"; wait "$launcher"
fi

[ "$failures" -eq 0 ] && echo "run_cluster_test: all cases passed"
exit $((failures > 0))
