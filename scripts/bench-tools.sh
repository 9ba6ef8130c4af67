#!/usr/bin/env bash
# Installs (once) what `ringblk bench --compare` runs beside ringblk, and
# what its tests (crates/ringblk-bench/tests/bench_smoke.rs) need:
# qemu-storage-daemon (Debian qemu-system-common), fio (the host baseline)
# and qemu-img (qemu-utils: makes and checks the qcow2 images of
# --format qcow2; qemu-io, from the same package, writes into one in a
# test). Root or sudo; does nothing when they are there.
#
#   scripts/bench-tools.sh
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { echo "bench-tools: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}
# shellcheck source=lib/packages.sh
. "$repo/scripts/lib/packages.sh"

ensure_packages qemu-system-common qemu-utils fio
for tool in qemu-storage-daemon qemu-img qemu-io fio; do
    command -v "$tool" >/dev/null || die "$tool is missing after the install"
done
