#!/usr/bin/env bash
# The whole suite, as CI runs it, on a fresh Debian machine or a used one:
# installs what is missing (Debian packages, the guest's kernel and
# initramfs), then formatting, lints, and every test of the workspace (the
# daemon, ringblk-metrics, ringblk-bench), the QEMU guest ones included.
#
#   scripts/test.sh
#   RINGBLK_GUEST_BACKEND=qsd scripts/test.sh   # guests against qemu-storage-daemon
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

section() { printf '\n==== %s ====\n' "$*"; }
started=$SECONDS

section "toolchain"
for tool in cargo rustfmt cargo-clippy; do
    command -v "$tool" >/dev/null || {
        echo "test.sh: $tool is missing (rustup component add rustfmt clippy)" >&2
        exit 1
    }
done
cargo --version
rustc --version

# The guest tests build these too; doing it first installs the Debian packages
# (QEMU, fio, busybox-static, losetup, ...) and shows the cost apart. A failure here is
# not fatal: the guest tests skip when QEMU cannot run at all, and fail loudly
# otherwise.
section "guest assets"
if ! scripts/guest-assets.sh; then
    echo "test.sh: warning: guest-assets.sh failed; the guest tests will tell why" >&2
fi

# librbd/librados for `--features rbd`, and the Ceph daemons of the
# single-node cluster the RBD tests start (scripts/ceph-cluster.sh).
# qemu-img and qemu-io: the oracle of the image-format tests (tests/layers/format.rs);
# cryptsetup: the LUKS tests' (src/crypto/luks/tests.rs).
section "format test tools"
scripts/format-deps.sh

section "ceph packages"
scripts/ceph-deps.sh

# nbdinfo, nbdcopy and qemu-img: the independent clients of the backup
# tests (tests/layers/backup.rs).
section "nbd tools"
scripts/nbd-tools.sh

# qemu-storage-daemon, fio and qemu-img: the peers and the qcow2 images of
# `bench --compare`, whose tests run them (guest-assets.sh, which installs
# the first two as well, may fail without failing the run).
section "bench tools"
scripts/bench-tools.sh

section "cargo fmt"
cargo fmt --all -- --check

# Imports between the crate's modules run one way (src/lib.rs says the
# order); python3 runs the check.
section "layers"
if ! command -v python3 >/dev/null; then
    log() { echo "test.sh: $*" >&2; }
    die() { log "$*"; exit 1; }
    # shellcheck source=scripts/lib/packages.sh
    . scripts/lib/packages.sh
    ensure_packages python3
fi
python3 scripts/layers.py

section "cargo clippy"
# Twice: without the RBD engine (what `cargo run` builds) and with it
# (ringblk-bench/rbd: the bench's RBD comparison test, for that daemon).
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy --workspace --all-targets --locked --features ringblk/rbd,ringblk-bench/rbd -- -D warnings

# The daemon must not link the benchmark client's stack: that is why
# ringblk-bench is a crate of its own. (blkio may stay a dev-dependency.)
section "daemon dependencies"
tree=$(cargo tree --locked -e normal -p ringblk --prefix none)
if grep -E '^(blkio|plotters|indicatif|hdrhistogram) ' <<<"$tree"; then
    echo "test.sh: the daemon depends on the above; they belong to ringblk-bench" >&2
    exit 1
fi

# The Debian package (cargo-deb, installed here if missing), from the
# debug build: tests/system/package.rs installs it, serves a client through its
# unit's command line and removes it. (A release package is
# `scripts/package.sh` alone.)
section "package"
deb=$(RINGBLK_DEB_PROFILE=dev scripts/package.sh | sed -n 's/^deb=//p')
[ -n "$deb" ] || {
    echo "test.sh: scripts/package.sh built no package" >&2
    exit 1
}
export RINGBLK_DEB=$deb

# --workspace: the bench's tests run its binary against the daemon's, and
# need both built. With the RBD engine: its tests (the `rbd` area,
# tests/rbd/, which needs the feature, and the bench's
# crates/ringblk-bench/tests/bench_rbd.rs) start a Ceph cluster of their
# own, one per test binary.
#
# Every test bounds its own waits, but a test that hangs anyway must fail
# the run, with where it hangs, rather than stall it: after
# RINGBLK_TEST_TIMEOUT seconds (default 3600; a run here takes about 17
# minutes) the processes still running and their threads' kernel stacks
# are printed, and they are killed.
section "cargo test"
limit=${RINGBLK_TEST_TIMEOUT:-3600}
# In a session of its own, so that the watchdog can end all of it.
RUST_BACKTRACE=${RUST_BACKTRACE:-1} setsid cargo test --workspace --locked \
    --features ringblk/rbd,ringblk-bench/rbd &
tests=$!
trap 'kill -KILL -- -"$tests" 2>/dev/null' INT TERM
deadline=$((SECONDS + limit))
while kill -0 "$tests" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
        echo "test.sh: cargo test still running after $limit s; what it runs:" >&2
        ps -o pid,etimes,stat,wchan:24,args -s "$tests" >&2 || true
        for pid in $(ps -o pid= -s "$tests"); do
            for t in /proc/"$pid"/task/*; do
                echo "== $t ($(cat "$t/comm" 2>/dev/null)) ==" >&2
                cat "$t/stack" >&2 2>/dev/null || true
            done
        done
        kill -KILL -- -"$tests" 2>/dev/null || true
        break
    fi
    sleep 5
done
status=0
wait "$tests" || status=$?
trap - INT TERM
if ((status != 0)); then
    echo "test.sh: cargo test failed (exit $status)" >&2
    exit "$status"
fi

section "done in $((SECONDS - started)) s"
