#!/usr/bin/env bash
# Instructions per request on the ring path, counted by callgrind (exact
# and repeatable where timings are not): `serve --engine null` under
# valgrind, driven at QD16 by `ringblk bench` running natively, counting
# only the queue worker's event handling (BlkBackend::handle_event).
#
#   scripts/callgrind.sh [--format raw|qcow2|luks] [--engine null|uring] [--rw RW] [--bitmap]
#                        [DAEMON_BIN [BENCH_BIN]]
#
# Defaults: raw, the null engine, target/release/ringblk. --format qcow2
# serves a 64 MiB qcow2 image with every cluster allocated (qemu-img
# preallocation=metadata): the format's fast path (map cache lookup, one
# piece per 4 KiB read). --format luks serves a LUKS2 image (cryptsetup,
# AES-256-XTS, 512-byte sectors) with 64 MiB of payload: each read is
# decrypted and each write encrypted (with the null engine, over what the
# guest's buffer holds). The null engine does no I/O; uring does it for
# real (the kernel's side is not counted). --rw is the bench's pattern
# (default randread); --bitmap adds a dirty bitmap before the run (with
# --rw randwrite: what a bitmap costs each write).
#
# Prints requests served, instructions counted, and their ratio. Polling is
# off (--poll-us 0): a spin loop's count would depend on timing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
format=raw
engine=null
rw=randread
bitmap=no
while [ $# -gt 0 ]; do
    case "$1" in
        --format) format=$2; shift 2 ;;
        --engine) engine=$2; shift 2 ;;
        --rw) rw=$2; shift 2 ;;
        --bitmap) bitmap=yes; shift ;;
        *) break ;;
    esac
done
case "$format" in raw | qcow2 | luks) ;; *) echo "--format raw, qcow2 or luks, not $format" >&2; exit 2 ;; esac
case "$engine" in null | uring) ;; *) echo "--engine null or uring, not $engine" >&2; exit 2 ;; esac
bin=${1:-target/release/ringblk}
bench=${2:-$bin}
command -v valgrind >/dev/null || apt-get install -y -qq valgrind >/dev/null
command -v socat >/dev/null || apt-get install -y -qq socat >/dev/null
out=$(mktemp -d)
keyopt=()
trap 'rm -rf "$out"' EXIT
if [ "$format" = qcow2 ]; then
    command -v qemu-img >/dev/null || apt-get install -y -qq qemu-utils >/dev/null
    qemu-img create -q -f qcow2 -o preallocation=metadata "$out/d.img" 64M
elif [ "$format" = luks ]; then
    command -v cryptsetup >/dev/null || apt-get install -y -qq cryptsetup-bin >/dev/null
    printf pass >"$out/key"
    chmod 600 "$out/key"
    truncate -s 80M "$out/d.img"
    cryptsetup luksFormat --batch-mode --type luks2 --pbkdf pbkdf2 --pbkdf-force-iterations 1000 \
        --sector-size 512 --key-file "$out/key" "$out/d.img"
    keyopt=(--key-file "$out/key")
else
    truncate -s 64M "$out/d.img"
fi
valgrind --tool=callgrind --callgrind-out-file="$out/cg.out" \
    --toggle-collect='*BlkBackend*handle_event*' \
    "$bin" serve --image "$out/d.img" --format "$format" --socket "$out/s.sock" --engine "$engine" \
    --seccomp off --poll-us 0 --metrics "$out/m.sock" --api "$out/a.sock" "${keyopt[@]}" >"$out/daemon.log" 2>&1 &
vg=$!
# A failed step (set -e) must not leave the daemon running under valgrind.
trap 'kill "$vg" 2>/dev/null || true; rm -rf "$out"' EXIT
for _ in $(seq 100); do [ -S "$out/s.sock" ] && break; sleep 0.2; done
sleep 1
if [ "$bitmap" = yes ]; then
    for _ in $(seq 100); do [ -S "$out/a.sock" ] && break; sleep 0.2; done
    "$bin" ctl --api "$out/a.sock" bitmap add b >/dev/null
fi
"$bench" bench --socket "$out/s.sock" --rw "$rw" --iodepth 16 --runtime 5s --ramp 500ms --no-pin >"$out/bench.log" 2>&1
requests=$(printf 'GET /metrics HTTP/1.0\r\n\r\n' | timeout 10 socat - "UNIX-CONNECT:$out/m.sock" |
    awk '/^ringblk_requests_total/ { s += $2 } END { print s }')
kill -TERM "$vg"
wait "$vg" || true
ir=$(callgrind_annotate "$out/cg.out" | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }')
echo "format=$format engine=$engine rw=$rw bitmap=$bitmap requests=$requests instructions=$ir per_request=$((ir / requests))"
