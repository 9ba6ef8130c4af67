#!/usr/bin/env bash
# Installs what the image-format tests use as their oracle: qemu-img and
# qemu-io (Debian's qemu-utils); for encrypted images, cryptsetup
# (cryptsetup-bin: it makes the LUKS images of src/crypto's tests and dumps
# their volume keys; no device-mapper needed) and Python's `cryptography`
# (AES-XTS, OpenSSL's: the independent decrypt); gdb, whose gcore takes the
# core dump tests/socket/luks_key.rs scans for the key. tests/layers/format.rs and
# src/crypto's tests run it when a tool is missing; scripts/test.sh runs it
# before the tests.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { echo "format-deps: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}
# shellcheck source=lib/packages.sh
. "$repo/scripts/lib/packages.sh"
ensure_packages qemu-utils cryptsetup-bin python3-cryptography gdb
