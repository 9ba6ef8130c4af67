#!/usr/bin/env bash
# Builds the Debian package: target/debian/ringblk_VERSION-1_ARCH.deb
# (metadata in Cargo.toml's [package.metadata.deb]; docs/install.md).
#
#   scripts/package.sh                   release build (what to install)
#   RINGBLK_DEB_PROFILE=dev scripts/package.sh
#                                        the debug build the tests already
#                                        made (scripts/test.sh: the package
#                                        test checks packaging, not speed)
#
# Installs what it needs when missing: cargo-deb (from crates.io, pinned)
# and dpkg-dev. Prints `deb=PATH` as its last line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { echo "package: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}
# shellcheck source=lib/packages.sh
. scripts/lib/packages.sh

CARGO_DEB_VERSION=3.8.0
profile=${RINGBLK_DEB_PROFILE:-release}

# dpkg-shlibdeps works out the Depends line (libc6, ...); adduser is what
# the package depends on (its postinst makes the ringblk user), installed
# here so that tests/system/package.rs's `dpkg -i` finds it on a minimal machine.
ensure_packages dpkg-dev adduser
if [ "$(cargo deb --version 2>/dev/null | awk '{ print $NF }')" != "$CARGO_DEB_VERSION" ]; then
    log "installing cargo-deb $CARGO_DEB_VERSION"
    cargo install --locked --quiet cargo-deb --version "$CARGO_DEB_VERSION"
fi

# Both binaries, then the man pages and completions from the daemon's own
# clap definitions (never written by hand).
cargo build --locked --profile "$profile" --workspace --bins
dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
case $profile in
dev) bin=$dir/debug ;;
*) bin=$dir/$profile ;;
esac
rm -rf target/generated
"$bin/ringblk" generate --out target/generated
# ringblk-bench's own page replaces the one of the `ringblk bench`
# pass-through, which only says where its options are.
"$bin/ringblk-bench" --generate-man target/generated/man

out=$(cargo deb --locked --no-build --profile "$profile" -p ringblk 2>&1) || die "cargo deb failed: $out"
deb=$(tail -n1 <<<"$out")
[ -f "$deb" ] || die "cargo deb printed no package path: $out"
log "built $deb"
echo "deb=$deb"
