#!/usr/bin/env bash
# Installs (once) the independent NBD clients the backup tests use as their
# oracle: libnbd's nbdinfo and nbdcopy (Debian libnbd-bin), and qemu-img /
# qemu-nbd (qemu-utils). Root or sudo; does nothing when they are there.
#
#   scripts/nbd-tools.sh
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { echo "nbd-tools: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}
# shellcheck source=lib/packages.sh
. "$repo/scripts/lib/packages.sh"

ensure_packages libnbd-bin qemu-utils
for tool in nbdinfo nbdcopy qemu-img qemu-nbd; do
    command -v "$tool" >/dev/null || die "$tool is missing after the install"
done
