#!/usr/bin/env bash
# Installs (once) what the Ceph RBD engine and its tests need, from
# Debian 12's ceph 16.2 packages:
# - librbd-dev, librados-dev: the headers and libraries `--features rbd`
#   links (crates/rbd-sys);
# - ceph-mon, ceph-osd, ceph-mgr, ceph-common: the single-node test cluster
#   (scripts/ceph-cluster.sh) and the `ceph`/`rbd` tools;
# - qemu-block-extra: qemu-storage-daemon's rbd driver (bench --compare);
# - uuid-runtime (uuidgen), iproute2 (ss): ceph-cluster.sh.
# bindgen is not needed to build: the bindings are committed
# (crates/rbd-sys/regenerate.sh says how to remake them).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

log() { echo "ceph-deps: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}
# shellcheck source=lib/packages.sh
. "$repo/scripts/lib/packages.sh"

ensure_packages librbd-dev librados-dev ceph-mon ceph-osd ceph-mgr ceph-common \
    qemu-block-extra uuid-runtime iproute2
