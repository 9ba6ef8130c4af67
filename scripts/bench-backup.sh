#!/usr/bin/env bash
# What `ringblk backup` costs and how fast it goes, against nbdcopy and
# qemu-img reading the same export:
#
#   scripts/bench-backup.sh [DIR]      (DIR: where the images go; default a
#                                       temporary directory on /var/tmp)
#
# 1. A full backup of a SIZE raw image with data in every byte (the
#    daemon serving it, no guest load): `ringblk backup --full`, timed to
#    its end (the copy into qcow2, the checksums, the manifest). Against,
#    on an export of the same disk (`ctl backup start`): `nbdcopy` into a
#    raw file and `qemu-img convert -O qcow2` into a qcow2 file.
# 2. An incremental one after 1% of the disk changed: 64 KiB writes, one
#    in each 6.4 MiB of the disk (`ringblk bench --distinct`), then
#    `ringblk backup`: its time against the full one's.
# 3. The guest's 4k randwrite IOPS and p99 (QD16, one queue, `ringblk
#    bench --socket`) alone, while a full backup runs, and alone again.
#
# Prints one line per figure. Needs the release build and nbdcopy:
#   cargo build --release -p ringblk -p ringblk-bench; scripts/nbd-tools.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=$PWD/target/release/ringblk
[ -x "$bin" ] || { echo "build first: cargo build --release -p ringblk -p ringblk-bench" >&2; exit 2; }
command -v nbdcopy >/dev/null || { echo "nbdcopy is missing: scripts/nbd-tools.sh" >&2; exit 2; }
SIZE=${SIZE:-4G}
dir=${1:-$(mktemp -d /var/tmp/ringblk-bench-backup.XXXXXX)}
mkdir -p "$dir"
cd "$dir"
cleanup() {
    [ -n "${daemon:-}" ] && kill "$daemon" 2>/dev/null || true
    wait 2>/dev/null || true
}
trap cleanup EXIT

ms() { date +%s%3N; }
bytes=$(numfmt --from=iec "$SIZE")
mbps() { echo "scale=0; $1 / 1048576 * 1000 / $2" | bc; }

rm -rf backups out copies vhost.sock api.sock
mkdir -p backups copies
# Data in every byte: an 8-byte pattern, so that nothing reads as zeroes.
{ yes ringblk || true; } | head -c "$bytes" >disk.img
sync
"$bin" serve --image disk.img --socket vhost.sock --api api.sock --backup-dir backups 2>daemon.log &
daemon=$!
for _ in $(seq 100); do [ -S vhost.sock ] && [ -S api.sock ] && break; sleep 0.1; done

# ---- 1. Full backup ----
t0=$(ms)
"$bin" backup --api api.sock --to out --full --json >full.json 2>/dev/null
t1=$(ms)
full=$((t1 - t0))
echo "ringblk backup --full, $SIZE allocated: $full ms, $(mbps "$bytes" "$full") MiB/s"

"$bin" ctl --api api.sock backup start --nbd bench.sock >/dev/null
uri="nbd+unix:///?socket=$PWD/backups/bench.sock"
t0=$(ms)
nbdcopy "$uri" copies/nbdcopy.raw
sync
t1=$(ms)
echo "nbdcopy of the same export into a raw file: $((t1 - t0)) ms, $(mbps "$bytes" $((t1 - t0))) MiB/s"
rm -f copies/nbdcopy.raw
t0=$(ms)
qemu-img convert -O qcow2 "$uri" copies/convert.qcow2
sync
t1=$(ms)
echo "qemu-img convert -O qcow2 of the same export: $((t1 - t0)) ms, $(mbps "$bytes" $((t1 - t0))) MiB/s"
"$bin" ctl --api api.sock backup stop --failed >/dev/null
rm -rf copies

# ---- 2. Incremental after 1% changed ----
"$bin" bench --socket vhost.sock --rw randwrite --bs 64K --iodepth 8 --distinct 6400K \
    --runtime 60s --ramp 0s --no-pin >/dev/null 2>&1
t0=$(ms)
"$bin" backup --api api.sock --to out --json >inc.json 2>/dev/null
t1=$(ms)
copied=$(sed -n 's/.*"copied": *\([0-9]*\).*/\1/p' inc.json | head -1)
echo "ringblk backup after 1% changed: $((t1 - t0)) ms ($(echo "scale=3; $((t1 - t0)) / $full" | bc)x the full one), $copied bytes copied"

# ---- 3. The guest during a full backup ----
iops() {
    "$bin" bench --socket vhost.sock --rw randwrite --iodepth 16 --runtime "$1" \
        --size 256M --ramp 500ms --no-pin 2>/dev/null |
        awk '$1 == "IOPS" { iops = $2 } $1 == "latency" { for (i = 1; i < NF; i++) if ($i == "p99") p99 = $(i + 1) } END { print iops, p99 }'
}
read -r alone alone_p99 <<<"$(iops 3s)"
"$bin" backup --api api.sock --to out --full --json >during.json 2>/dev/null &
backup=$!
sleep 0.5
read -r during during_p99 <<<"$(iops 3s)"
wait "$backup"
# Alone again, after: an order effect shows as a difference of the two.
read -r after after_p99 <<<"$(iops 3s)"
echo "guest 4k randwrite QD16: $alone IOPS (p99 $alone_p99 us) alone, $during IOPS (p99 $during_p99 us) during a full backup, $after IOPS (p99 $after_p99 us) alone after it ($(echo "scale=2; 2 * $during / ($alone + $after)" | bc)x the mean of the two)"
