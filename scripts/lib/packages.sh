# Sourced by the scripts that install Debian packages: `ensure_packages
# PKG...` installs those not yet installed (root, or sudo), updating the
# package lists only when an install fails without. Expects log() and die().

as_root() {
    if [ "$(id -u)" = 0 ]; then
        "$@"
    elif command -v sudo >/dev/null; then
        sudo -n "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

apt_updated=
apt_update_once() {
    if [ -z "$apt_updated" ]; then
        log "apt-get update"
        as_root apt-get update -qq -o DPkg::Lock::Timeout=300 >&2
        apt_updated=1
    fi
}

# Installs the packages not yet installed; updates the lists only if needed.
ensure_packages() {
    local missing=() p installed
    installed=$(dpkg-query -W -f='${Package} ${Status}\n' "$@" 2>/dev/null | awk '/install ok installed/ { print $1 }' || true)
    for p in "$@"; do
        grep -qx "$p" <<<"$installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing ${missing[*]}"
    local install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends
        -o DPkg::Lock::Timeout=300)
    if ! as_root "${install[@]}" "${missing[@]}" >&2; then
        apt_update_once
        as_root "${install[@]}" "${missing[@]}" >&2
    fi
}
