#!/usr/bin/env bash
# What a stream job costs and how fast it goes, against qemu-img offline:
#
#   scripts/bench-jobs.sh [DIR]        (DIR: where the images go; default a
#                                       temporary directory on /var/tmp)
#
# 1. Throughput with no guest load: base.raw (SIZE) <- mid.qcow2 (all of it
#    allocated, other data) <- top.qcow2 (empty). `ctl stream --base
#    base.raw` copies mid's SIZE into top and drops mid; timed from the
#    request to `completed`. Against, on fresh copies of the same chain:
#    `qemu-img rebase -b base.raw -F raw top.qcow2` (the offline way to the
#    same chain: it copies what differs between the old and new backing)
#    and `qemu-img commit mid.qcow2` (the other way round: mid into base).
# 2. The guest's 4k randwrite IOPS (QD16, one queue, `ringblk bench
#    --socket`, over its first 256 MiB, which the top has already) with
#    no job, then while a stream (no speed limit, the default) copies the
#    rest of a LOAD_SIZE chain: the ratio is what the job costs.
#
# 3. An active commit of SIZE with no guest load: chain/mid.qcow2 (empty,
#    over base.raw; the image served) <- snaps/s1.qcow2 (all of it
#    allocated, the top, found through a snapshot record as a live
#    snapshot leaves it). `ctl commit --top s1.qcow2` copies s1 into mid
#    and pivots; timed from the request to `completed`. Then the guest's
#    4k randwrite IOPS during an active commit of a LOAD_SIZE chain.
#
# DIRECT=1 serves with --direct (the guest's I/O O_DIRECT). Prints one
# line per figure. Needs the release build:
#   cargo build --release -p ringblk -p ringblk-bench
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=$PWD/target/release/ringblk
[ -x "$bin" ] || { echo "build first: cargo build --release -p ringblk -p ringblk-bench" >&2; exit 2; }
SIZE=${SIZE:-1G}
# Part 2's chain: large enough that the stream outlasts the measurement.
LOAD_SIZE=${LOAD_SIZE:-4G}
dir=${1:-$(mktemp -d /var/tmp/ringblk-bench-jobs.XXXXXX)}
mkdir -p "$dir"
cd "$dir"
cleanup() {
    [ -n "${daemon:-}" ] && kill "$daemon" 2>/dev/null || true
    wait 2>/dev/null || true
}
trap cleanup EXIT

make_chain() {
    local size=${1:-$SIZE}
    rm -rf chain snaps
    mkdir -p chain snaps
    qemu-img create -q -f raw chain/base.raw "$size"
    # Data everywhere in mid: its clusters all allocated, not zero.
    qemu-img create -q -f qcow2 -b base.raw -F raw chain/mid.qcow2
    # (qemu-io writes at most 2 GiB a request: 512 MiB at a time.)
    local bytes cmds=() at=0
    bytes=$(numfmt --from=iec "$size")
    while [ "$at" -lt "$bytes" ]; do
        cmds+=(-c "write -P 0x5a $at $((512 << 20))")
        at=$((at + (512 << 20)))
    done
    qemu-io -f qcow2 "${cmds[@]}" chain/mid.qcow2 >/dev/null
    qemu-img create -q -f qcow2 -b mid.qcow2 -F qcow2 chain/top.qcow2
    sync
}

# Serves IMAGE (default chain/top.qcow2) with the API and snapshot dir.
serve() {
    rm -f vhost.sock api.sock
    "$bin" serve --image "${1:-chain/top.qcow2}" --format qcow2 --socket vhost.sock \
        --api api.sock --snapshot-dir snaps ${DIRECT:+--direct} 2>daemon.log &
    daemon=$!
    for _ in $(seq 100); do [ -S vhost.sock ] && [ -S api.sock ] && break; sleep 0.1; done
}

stop() {
    kill "$daemon"
    wait "$daemon" || true
    daemon=
}

ms() { date +%s%3N; }

wait_job() {
    while "$bin" ctl --api api.sock job status | grep -Eq '"state": *"running"'; do
        sleep 0.05
    done
    "$bin" ctl --api api.sock job status | grep -Eq '"state": *"completed"' ||
        { echo "the job did not complete:" >&2; "$bin" ctl --api api.sock job status >&2; exit 1; }
}

bytes=$(numfmt --from=iec "$SIZE")
mbps() { echo "scale=0; $bytes / 1048576 * 1000 / $1" | bc; }

# ---- 1. Throughput ----
make_chain
serve
t0=$(ms)
"$bin" ctl --api api.sock stream --base "$(realpath chain/base.raw)" >/dev/null
wait_job
t1=$(ms)
stop
echo "stream --base base.raw, $SIZE of mid copied up: $((t1 - t0)) ms, $(mbps $((t1 - t0))) MiB/s"

make_chain
t0=$(ms)
qemu-img rebase -f qcow2 -b base.raw -F raw chain/top.qcow2
sync
t1=$(ms)
echo "qemu-img rebase -b base.raw (offline), the same chain: $((t1 - t0)) ms, $(mbps $((t1 - t0))) MiB/s"

make_chain
t0=$(ms)
qemu-img commit -q chain/mid.qcow2
sync
t1=$(ms)
echo "qemu-img commit mid.qcow2 (offline), $SIZE into base.raw: $((t1 - t0)) ms, $(mbps $((t1 - t0))) MiB/s"

# ---- 2. The guest's writes during a stream ----
# (on a LOAD_SIZE chain; the job must still run when the measurement ends)
iops() {
    "$bin" bench --socket vhost.sock --rw randwrite --iodepth 16 --runtime "$1" \
        --size 256M --ramp 500ms --no-pin 2>/dev/null |
        awk '$1 == "IOPS" { iops = $2 } $1 == "latency" { for (i = 1; i < NF; i++) if ($i == "p99") p99 = $(i + 1) } END { print iops, p99 }'
}
make_chain "$LOAD_SIZE"
# The guest writes its first 256 MiB, which the top has already: with the
# job or without, its writes allocate nothing (the job skips them).
qemu-io -f qcow2 -c "write -P 0x33 0 256M" chain/top.qcow2 >/dev/null
serve
read -r alone alone_p99 <<<"$(iops 3s)"
"$bin" ctl --api api.sock stream --base "$(realpath chain/base.raw)" >/dev/null
read -r during during_p99 <<<"$(iops 3s)"
state=$("$bin" ctl --api api.sock job status | sed -n 's/.*"state": *"\([a-z]*\)".*/\1/p')
wait_job
stop
echo "guest 4k randwrite QD16 ($LOAD_SIZE chain): $alone IOPS (p99 $alone_p99 us) alone, $during IOPS (p99 $during_p99 us) during the stream ($(echo "scale=2; $during / $alone" | bc)x; the job $state when the run ended)"

# ---- 3. Active commit ----
# s1 is made offline over mid, with the record a live snapshot leaves, so
# that the daemon serving mid follows it to s1.
make_active() {
    local size=${1:-$SIZE}
    make_chain "$size"
    rm -f chain/top.qcow2
    mv chain/mid.qcow2 snaps/s1.qcow2
    qemu-img rebase -q -u -f qcow2 -b "$(realpath chain)/mid.qcow2" -F qcow2 snaps/s1.qcow2
    qemu-img create -q -f qcow2 -b base.raw -F raw chain/mid.qcow2
    printf '{"ringblk_snapshot":1,"superseded":"%s","by":"s1.qcow2","at":0}\n' \
        "$(realpath chain/mid.qcow2)" >snaps/s1.qcow2.ringblk-snapshot
    sync
}
make_active
serve chain/mid.qcow2
t0=$(ms)
"$bin" ctl --api api.sock commit --top "$(realpath snaps/s1.qcow2)" >/dev/null
wait_job
t1=$(ms)
stop
echo "active commit of s1.qcow2, $SIZE into mid.qcow2: $((t1 - t0)) ms, $(mbps $((t1 - t0))) MiB/s"

make_active "$LOAD_SIZE"
serve chain/mid.qcow2
read -r alone alone_p99 <<<"$(iops 3s)"
"$bin" ctl --api api.sock commit --top "$(realpath snaps/s1.qcow2)" >/dev/null
read -r during during_p99 <<<"$(iops 3s)"
state=$("$bin" ctl --api api.sock job status | sed -n 's/.*"state": *"\([a-z]*\)".*/\1/p')
wait_job
stop
echo "guest 4k randwrite QD16 ($LOAD_SIZE chain): $alone IOPS (p99 $alone_p99 us) alone, $during IOPS (p99 $during_p99 us) during the active commit ($(echo "scale=2; $during / $alone" | bc)x; the job $state when the run ended)"
