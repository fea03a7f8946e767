#!/usr/bin/env bash
# An emulated network link on one machine, for the benchmarks: a network
# namespace "psflow_ps" joined to this one by a veth pair, 10.77.0.1 here and
# 10.77.0.2 there, each direction shaped by tc's token bucket to RATE (e.g.
# 10gbit, 1gbit). Processes started with `ip netns exec psflow_ps` sit on the
# far side; push_pull_bench --netns and run_cluster.sh PS_NETNS use it.
# Needs root, iproute2 and the tbf qdisc.
#
#   bench/emulated_link.sh up 10gbit     # make (or re-shape) the link
#   bench/emulated_link.sh down          # remove it
set -euo pipefail
ns=psflow_ps
case ${1:-} in
  up)
    rate=${2:?usage: $0 up RATE (e.g. 10gbit)}
    if ! ip netns list | grep -qw "$ns"; then
      ip netns add "$ns"
      ip link add psflow0 type veth peer name psflow1
      ip link set psflow1 netns "$ns"
      ip addr add 10.77.0.1/24 dev psflow0
      ip link set psflow0 up
      ip netns exec "$ns" ip addr add 10.77.0.2/24 dev psflow1
      ip netns exec "$ns" ip link set psflow1 up
      ip netns exec "$ns" ip link set lo up
    fi
    # The bucket holds 4 ms at RATE (one timer tick at HZ=250, the least tbf
    # needs to reach RATE): a longer burst would let a whole tensor through
    # at memory speed after an idle moment and flatter the link.
    case $rate in
      *gbit) bits=$(( ${rate%gbit} * 1000000000 )) ;;
      *mbit) bits=$(( ${rate%mbit} * 1000000 )) ;;
      *) echo "emulated_link: RATE must be like 10gbit or 500mbit" >&2; exit 2 ;;
    esac
    burst=$(( bits / 8 / 250 ))
    tc qdisc replace dev psflow0 root tbf rate "$rate" burst "$burst" latency 20ms
    ip netns exec "$ns" tc qdisc replace dev psflow1 root tbf rate "$rate" burst "$burst" latency 20ms
    echo "emulated_link: $rate each way between 10.77.0.1 (here) and 10.77.0.2 (netns $ns)"
    ;;
  down)
    ip netns del "$ns" 2>/dev/null || true  # takes the veth pair with it
    ;;
  *)
    echo "usage: $0 up RATE | down" >&2
    exit 2
    ;;
esac
