#!/usr/bin/env bash
# Installs what the image-format tests use as their oracle: qemu-img and
# qemu-io (Debian's qemu-utils), and cryptsetup (cryptsetup-bin: it makes
# the LUKS images of src/crypto/luks/tests.rs and dumps their volume
# keys; no device-mapper needed). tests/layers/format.rs runs it when
# qemu-img is missing, the LUKS tests when cryptsetup is; scripts/test.sh
# runs it before the tests.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { echo "format-deps: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}
# shellcheck source=lib/packages.sh
. "$repo/scripts/lib/packages.sh"
ensure_packages qemu-utils cryptsetup-bin
