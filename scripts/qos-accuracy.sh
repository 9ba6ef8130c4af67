#!/usr/bin/env bash
# QoS accuracy: configured limits against what `ringblk bench` measures at
# QD16 per queue (1 s ramp, which spends the burst, then 5 s measured), on a
# 1 GiB sparse image in a temporary directory.
#
#   scripts/qos-accuracy.sh [DAEMON_BIN]   (default target/release/ringblk,
#                                           with ringblk-bench next to it)
set -euo pipefail
bin=${1:-target/release/ringblk}
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
truncate -s 1G "$out/d.img"
run() { # LIMIT-ARGS -- BENCH-ARGS
  local limits=$1 bench=$2
  "$bin" serve --image "$out/d.img" --socket "$out/s.sock" $limits >"$out/log" 2>&1 &
  local pid=$!
  for _ in $(seq 50); do [ -S "$out/s.sock" ] && break; sleep 0.1; done
  local r
  r=$("$bin" bench --socket "$out/s.sock" --iodepth 16 --ramp 1s --runtime 5s --no-pin $bench 2>&1 |
      awk '/^  IOPS/ {i=$2} /^  MiB\/s/ {m=$2} /^  errors/ {e=$2} END {print i, m, e}')
  kill -TERM $pid; wait $pid || true
  echo "$limits | $bench | IOPS MiB/s errors: $r"
}
for n in 500 1000 2000 5000 10000; do run "--iops $n" "--rw randread --bs 4K"; done
for b in 8M 32M 128M; do run "--bps $b" "--rw randread --bs 64K"; done
run "--write-iops 1000" "--rw randwrite --bs 4K"
run "--read-bps 16M --write-bps 8M" "--rw randwrite --bs 64K"
run "--read-bps 16M --write-bps 8M" "--rw randread --bs 64K"
# Two queues share one device limit.
run "--iops 2000 --queues 2" "--queues 2 --rw randread --bs 4K"
