#!/usr/bin/env bash
# RBD rows for docs/BENCHMARKS.md: 4k randread and randwrite at QD 1, 16
# and 64 on an RBD image of a single-node cluster (scripts/ceph-cluster.sh),
# served by
#   ringblk  `ringblk serve --image rbd:rbd/bench` (built with --features rbd)
#   qsd      qemu-storage-daemon --blockdev driver=rbd (qemu-block-extra)
# and driven by ringblk-bench with the backend's CPU time per I/O; and
#   fio-rbd  fio's rbd engine on the same image: the host reference (no
#            virtio, no second process), CPU not comparable (in fio itself).
#
#   scripts/bench-rbd.sh [OUTDIR]      default target/bench-rbd
#   RUNTIME=5s scripts/bench-rbd.sh    measured time per point
#   BACKENDS="ringblk" QDS="64" RINGBLK_ARGS="--poll-us 0" scripts/bench-rbd.sh
#                                      a subset (fio-rbd is a backend too)
#
# Nothing is pinned: the cluster's OSD runs on the same two cores and
# needs them. Prints a Markdown table; raw JSON in OUTDIR.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$repo/target/bench-rbd}
runtime=${RUNTIME:-5s}
backends=${BACKENDS:-fio-rbd qsd ringblk}
qds=${QDS:-1 16 64}
read -r -a ringblk_args <<<"${RINGBLK_ARGS:-}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
bin=$repo/target/release
[ -x "$bin/ringblk" ] && [ -x "$bin/ringblk-bench" ] || {
    echo "bench-rbd: build first: cargo build --release --features rbd -p ringblk -p ringblk-bench" >&2
    exit 1
}

"$repo/scripts/ceph-cluster.sh" start "$out/cluster" >/dev/null
trap '"$repo/scripts/ceph-cluster.sh" stop "$out/cluster"' EXIT
conf=$out/cluster/ceph.conf
rbd -c "$conf" create --size 1G rbd/bench
# Written once, so that reads read data, not absent objects.
rbd -c "$conf" bench --io-type write --io-pattern seq --io-size 4M \
    --io-total 1G rbd/bench >/dev/null

sock=$out/vhost.sock
start_backend() {
    rm -f "$sock"
    case $1 in
    ringblk)
        RUST_LOG=warn "$bin/ringblk" serve --socket "$sock" --image rbd:rbd/bench \
            --ceph-conf "$conf" --queue-size 256 "${ringblk_args[@]}" >"$out/ringblk.log" 2>&1 &
        ;;
    qsd)
        qemu-storage-daemon \
            --blockdev "driver=rbd,node-name=r,pool=rbd,image=bench,conf=$conf,cache.direct=on" \
            --export "type=vhost-user-blk,id=e,node-name=r,addr.type=unix,addr.path=$sock,writable=on" \
            >"$out/qsd.log" 2>&1 &
        ;;
    esac
    pid=$!
    for _ in $(seq 100); do
        [ -S "$sock" ] && return 0
        sleep 0.1
    done
    echo "bench-rbd: $1 did not start" >&2
    cat "$out/$1.log" >&2
    exit 1
}

echo "| backend | rw | QD | IOPS | mean lat (us) | backend CPU us/IO |"
echo "| --- | --- | --- | --- | --- | --- |"
# ringblk last: on SIGTERM it exits without closing the image, so its
# exclusive lock stays until the OSD drops its watch (about 30 s), and
# the next writer would wait for it.
for rw in randread randwrite; do
    [[ " $backends " == *" fio-rbd "* ]] || break
    for qd in $qds; do
        CEPH_CONF=$conf fio --name=rbd --ioengine=rbd --clientname=admin --pool=rbd --rbdname=bench \
            --rw=$rw --bs=4k --iodepth=$qd --time_based --runtime="$runtime" --ramp_time=1s \
            --output-format=json --output="$out/fio-$rw-$qd.json" >/dev/null 2>&1 \
            --direct=1 </dev/null || { echo "| fio-rbd | $rw | $qd | failed | | |"; continue; }
        python3 - "$out/fio-$rw-$qd.json" $rw $qd <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
side = j["read"] if sys.argv[2] == "randread" else j["write"]
print(f"| fio-rbd | {sys.argv[2]} | {sys.argv[3]} | {side['iops']:,.0f} | {side['lat_ns']['mean']/1000:.0f} | - |")
EOF
    done
done
for backend in qsd ringblk; do
    [[ " $backends " == *" $backend "* ]] || continue
    start_backend $backend
    for rw in randread randwrite; do
        for qd in $qds; do
            json=$out/$backend-$rw-$qd.json
            "$bin/ringblk-bench" --socket "$sock" --rw $rw --bs 4k --iodepth $qd \
                --runtime "$runtime" --ramp 1s --no-pin --pid $pid --json "$json" >/dev/null
            python3 - "$json" "$backend" $rw $qd <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
iops = r["iops"]
lat = r["lat_us"]["mean"]
# CPU seconds per million I/Os is CPU microseconds per I/O.
cpu = r.get("backend_cpu_per_mio")
cpu = f"{cpu:.1f}" if cpu is not None else "-"
if r["errors"]:
    iops_note = f" ({r['errors']} errors: {r['first_error']})"
    print(f"| {sys.argv[2]} | {sys.argv[3]} | {sys.argv[4]} | errors{iops_note} | | |")
    sys.exit(0)
print(f"| {sys.argv[2]} | {sys.argv[3]} | {sys.argv[4]} | {iops:,.0f} | {lat:.0f} | {cpu} |")
EOF
        done
    done
    kill $pid
    wait $pid 2>/dev/null || true
done
