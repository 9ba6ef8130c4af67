#!/usr/bin/env bash
# Instructions per request on the ring path, counted by callgrind (exact
# and repeatable where timings are not): `serve --engine null` under
# valgrind, driven at QD16 by `ringblk bench` running natively, counting
# only the queue worker's event handling (BlkBackend::handle_event).
#
#   scripts/callgrind.sh [DAEMON_BIN [BENCH_BIN]]   (default target/release/ringblk)
#
# Prints requests served, instructions counted, and their ratio. Polling is
# off (--poll-us 0): a spin loop's count would depend on timing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=${1:-target/release/ringblk}
bench=${2:-$bin}
command -v valgrind >/dev/null || apt-get install -y -qq valgrind >/dev/null
command -v socat >/dev/null || apt-get install -y -qq socat >/dev/null
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
truncate -s 64M "$out/d.img"
valgrind --tool=callgrind --callgrind-out-file="$out/cg.out" \
    --toggle-collect='*BlkBackend*handle_event*' \
    "$bin" serve --image "$out/d.img" --socket "$out/s.sock" --engine null \
    --seccomp off --poll-us 0 --metrics "$out/m.sock" >"$out/daemon.log" 2>&1 &
vg=$!
for _ in $(seq 100); do [ -S "$out/s.sock" ] && break; sleep 0.2; done
sleep 1
"$bench" bench --socket "$out/s.sock" --iodepth 16 --runtime 5s --ramp 500ms --no-pin >"$out/bench.log" 2>&1
requests=$(printf 'GET /metrics HTTP/1.0\r\n\r\n' | timeout 10 socat - "UNIX-CONNECT:$out/m.sock" |
    awk '/^ringblk_requests_total/ { s += $2 } END { print s }')
kill -TERM "$vg"
wait "$vg" || true
ir=$(callgrind_annotate "$out/cg.out" | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }')
echo "requests=$requests instructions=$ir per_request=$((ir / requests))"
