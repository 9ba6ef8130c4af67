#!/usr/bin/env bash
# Where the time goes at depth 1: traces one backend serving a QD1 client
# with the kernel's tracepoints (tracefs: sched, syscalls, io_uring, block,
# irq) and prints the median of each phase of a request, from the client's
# kick to its wake-up (scripts/qd1-trace.py).
#
#   scripts/qd1-trace.sh ringblk [BIN] [-- SERVE ARGS...]   (default target/release/ringblk)
#   scripts/qd1-trace.sh qsd
#
# Environment: IMAGE (default: a 256 MiB file of random data made once in
# target/qd1-trace), DIRECT=on|off (default on), POLL=1 for a polling
# client, SECONDS_TRACED (default 0.3). The backend runs on CPU 0, the
# client on CPU 1, as in `ringblk-bench --compare`. Needs root.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
kind=${1:?ringblk or qsd}
shift
bin=target/release/ringblk
if [ "$kind" = ringblk ] && [ $# -gt 0 ] && [ "$1" != -- ]; then bin=$1; shift; fi
[ "${1:-}" = -- ] && shift
work=target/qd1-trace
mkdir -p "$work"
image=${IMAGE:-$work/img}
[ -f "$image" ] || dd if=/dev/urandom of="$image" bs=1M count=256 status=none
T=/sys/kernel/tracing
[ -e $T/trace ] || mount -t tracefs nodev $T
events="sched/sched_switch sched/sched_wakeup io_uring/io_uring_submit_req io_uring/io_uring_complete block/block_rq_issue block/block_rq_complete raw_syscalls/sys_enter raw_syscalls/sys_exit irq/irq_handler_entry"
sock=$work/$kind.sock
rm -f "$sock"
case $kind in
ringblk)
    direct=(); [ "${DIRECT:-on}" = on ] && direct=(--direct)
    taskset -c 0 "$bin" serve --socket "$sock" --image "$image" "${direct[@]}" --queues 1 --queue-size 256 "$@" >"$work/$kind.log" 2>&1 &
    comm=vring_worker ;;
qsd)
    taskset -c 0 qemu-storage-daemon --blockdev "driver=file,node-name=f,filename=$image,cache.direct=${DIRECT:-on},aio=io_uring" \
        --export "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path=$sock,writable=on,num-queues=1" >"$work/$kind.log" 2>&1 &
    comm=qemu-storage ;;
*) echo "qd1-trace: ringblk or qsd, not $kind" >&2; exit 2 ;;
esac
backend=$!
cleanup() {
    echo 0 >$T/tracing_on
    for e in $events; do echo 0 >$T/events/$e/enable; done
    kill "$backend" 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
echo 0 >$T/tracing_on; echo >$T/trace; echo 20000 >$T/buffer_size_kb
for e in $events; do echo 1 >$T/events/$e/enable; done
bench=$(dirname "$bin")/ringblk-bench
[ -x "$bench" ] || bench=target/release/ringblk-bench
poll=(); [ -n "${POLL:-}" ] && poll=(--poll)
"$bench" --socket "$sock" --rw randread --iodepth 1 --runtime 2s --ramp 500ms --client-cpu 1 --size 256M "${poll[@]}" >"$work/$kind.client" 2>&1 &
client=$!
sleep 1.2
echo 1 >$T/tracing_on; sleep "${SECONDS_TRACED:-0.3}"; echo 0 >$T/tracing_on
wait $client
cat $T/trace >"$work/$kind.trace"
grep -E "IOPS|latency" "$work/$kind.client"
python3 scripts/qd1-trace.py "$work/$kind.trace" "$comm"
