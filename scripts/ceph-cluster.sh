#!/usr/bin/env bash
# A throw-away single-node Ceph cluster for the RBD tests and benchmarks:
# one mon, one mgr and one OSD (memstore: the data lives in the OSD's
# memory) on 127.0.0.1, auth none, every pool of size 1, all state in DIR.
# No systemd, no root needed once the packages are installed
# (scripts/ceph-deps.sh).
#
#   scripts/ceph-cluster.sh start DIR [--cephx]
#                                       stop whatever runs from DIR, wipe it,
#                                       start afresh; creates pool `rbd`;
#                                       prints `conf=DIR/ceph.conf` last.
#                                       --cephx: authentication on (cephx),
#                                       keys in DIR/keyring (client.admin's
#                                       among them), which ceph.conf names
#   scripts/ceph-cluster.sh stop DIR    kill the daemons started from DIR
#
# CEPH_MON_PORT picks the monitor's port (default: a free one below the
# kernel's ephemeral range, and another if it is taken before the monitor
# binds it, up to three tries).
# Everything the daemons log is in DIR/log.
set -euo pipefail

log() { echo "ceph-cluster: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

usage() { die "usage: $0 start DIR [--cephx] | stop DIR"; }
args=("$@")
[ $# -ge 2 ] || usage
cmd=$1
mkdir -p "$2"
dir=$(cd "$2" && pwd)
conf=$dir/ceph.conf
keyring=$dir/keyring
auth=none
case "$cmd ${3-}" in
"start --cephx") [ $# -eq 3 ] || usage; auth=cephx ;;
"start " | "stop ") [ $# -eq 2 ] || usage ;;
*) usage ;;
esac

stop() {
    local pidfile pid n
    for pidfile in "$dir"/run/*.pid; do
        [ -e "$pidfile" ] || continue
        pid=$(cat "$pidfile" 2>/dev/null || true)
        rm -f "$pidfile"
        [ -n "$pid" ] || continue
        # Only a process started from this directory: its command line
        # names our ceph.conf.
        if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$conf"; then
            kill -9 "$pid" 2>/dev/null || true
            for n in $(seq 50); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.1
            done
        fi
    done
}

# A port no socket uses, below the kernel's ephemeral range: a port in
# that range can be taken by any outgoing connection (the other test
# clusters' own among them) between the check and the monitor's bind, and
# the monitor then exits "unable to bind" (EADDRINUSE, exit status 1).
free_port() {
    local p lo hi
    read -r lo hi </proc/sys/net/ipv4/ip_local_port_range
    for _ in $(seq 100); do
        if [ "$lo" -gt 12000 ]; then
            p=$((10000 + RANDOM % (lo - 10000)))
        else
            p=$((hi + 1 + RANDOM % (65535 - hi)))
        fi
        if ! ss -Htan "sport = :$p" | grep -q .; then
            echo "$p"
            return
        fi
    done
    die "no free port found"
}

# `ceph` with a deadline: the CLI waits forever for a monitor by default.
c() { timeout 30 ceph -c "$conf" --connect-timeout 20 "$@"; }

start() {
    for tool in ceph-mon ceph-mgr ceph-osd ceph ceph-authtool monmaptool uuidgen ss; do
        command -v "$tool" >/dev/null || die "$tool is missing (scripts/ceph-deps.sh installs it)"
    done
    stop
    rm -rf "${dir:?}"/{mon,mgr,osd,run,log,monmap,ceph.conf,keyring}
    mkdir -p "$dir"/{mon,mgr,osd,run,log}
    local port fsid uuid
    port=${CEPH_MON_PORT:-$(free_port)}
    fsid=$(uuidgen)
    local keyring_line=""
    [ "$auth" = none ] || keyring_line="keyring = $keyring"
    cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$port
public network = 127.0.0.0/8
auth cluster required = $auth
auth service required = $auth
auth client required = $auth
$keyring_line
auth allow insecure global id reclaim = false
osd pool default size = 1
osd pool default min size = 1
# A client killed with -9 holds an image's exclusive lock until the OSD
# times out its watch (default 30 s): the restarted daemon's first writes
# wait that long. The kill tests restart daemons under a running guest, so
# the test cluster notices dead clients sooner.
osd client watch timeout = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon data avail warn = 1
# A monitor refuses to start with less than 5% of its disk free (ENOSPC,
# exit status 28); this one holds a few MiB.
mon data avail crit = 0
osd crush chooseleaf type = 0
ms bind ipv6 = false
ms bind msgr1 = false
run dir = $dir/run
pid file = $dir/run/\$name.pid
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
crash dir = $dir/log
mon data = $dir/mon/\$name
mgr data = $dir/mgr/\$name
osd data = $dir/osd/\$name
osd objectstore = memstore
memstore device bytes = 2147483648
osd max object name len = 256
osd max object namespace len = 64
mgr initial modules =
debug ms = 0
EOF
    monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$port]" "$dir/monmap" >/dev/null
    local mkfs_keyring=()
    if [ "$auth" = cephx ]; then
        # One keyring for every daemon and the admin; the monitor imports
        # all of it into its auth database at --mkfs. The OSD's key is
        # added once its id is known.
        ceph-authtool --create-keyring "$keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
        ceph-authtool "$keyring" --gen-key -n client.admin \
            --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
        ceph-authtool "$keyring" --gen-key -n mgr.x \
            --cap mon 'allow profile mgr' --cap osd 'allow *' --cap mds 'allow *' >/dev/null
        chmod 600 "$keyring"
        mkfs_keyring=(--keyring "$keyring")
    fi
    ceph-mon -c "$conf" -i a --mkfs --monmap "$dir/monmap" "${mkfs_keyring[@]}" >>"$dir/log/setup.log" 2>&1 ||
        die "ceph-mon --mkfs failed (see $dir/log)"
    local status=0
    ceph-mon -c "$conf" -i a >>"$dir/log/setup.log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then
        # Another process took the port after free_port looked: start
        # afresh on another (the monmap and the monitor's store name it).
        local try=${CEPH_CLUSTER_TRY:-1}
        if [ -z "${CEPH_MON_PORT:-}" ] && [ "$try" -lt 3 ] &&
            grep -q "unable to bind monitor" "$dir/log/mon.a.log" 2>/dev/null; then
            log "port $port was taken before the monitor bound it; trying another"
            CEPH_CLUSTER_TRY=$((try + 1)) exec bash "$0" "${args[@]}"
        fi
        die "ceph-mon exited with status $status ($(
            [ "$status" -eq 28 ] && echo "no space left for its data" ||
                echo "$(grep -h -- ' -1 ' "$dir/log/mon.a.log" 2>/dev/null | tail -n 1 | cut -c 1-200); see $dir/log"))"
    fi
    mkdir -p "$dir/mgr/mgr.x"
    ceph-mgr -c "$conf" -i x >>"$dir/log/setup.log" 2>&1 || die "ceph-mgr failed (see $dir/log)"
    uuid=$(uuidgen)
    local id
    id=$(c osd new "$uuid") || die "the monitor does not answer (see $dir/log)"
    mkdir -p "$dir/osd/osd.$id"
    if [ "$auth" = cephx ]; then
        c auth get-or-create "osd.$id" mon 'allow profile osd' mgr 'allow profile osd' \
            osd 'allow *' >>"$keyring" || die "creating the key of osd.$id failed"
    fi
    ceph-osd -c "$conf" -i "$id" --mkfs --osd-uuid "$uuid" >>"$dir/log/setup.log" 2>&1 ||
        die "ceph-osd --mkfs failed (see $dir/log)"
    ceph-osd -c "$conf" -i "$id" >>"$dir/log/setup.log" 2>&1 || die "ceph-osd failed (see $dir/log)"
    c osd pool create rbd 8 8 >/dev/null 2>&1 || die "creating pool rbd failed"
    c osd pool application enable rbd rbd >/dev/null 2>&1 || die "enabling rbd on pool rbd failed"
    # Ready when every placement group is active.
    local n
    for n in $(seq 60); do
        if c pg stat 2>/dev/null | grep -Eq '^([0-9]+) pgs: \1 active\+clean;'; then
            echo "conf=$conf"
            return 0
        fi
        sleep 0.5
    done
    c -s >&2 || true
    die "placement groups did not become active in 30 s (see $dir/log)"
}

case $cmd in
start) start ;;
stop) stop ;;
esac
