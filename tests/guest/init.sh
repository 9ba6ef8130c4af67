#!/bin/sh
# /init of the ringblk test guest (busybox sh, PID 1).
#
# Reads its parameters from the kernel command line:
#   ringblk.test=rw|ro|migrate|resize|qcow2|luks|backup  which checks to run
#   ringblk.new_sectors=N   (resize) the capacity the host resizes to
#   ringblk.migrate=busy|idle   what the guest does while the host migrates it
#                           (migrate only; see "Live migration" below)
#   ringblk.fio_runtime=S   seconds of the busy migration's fio (default 20)
#   ringblk.sectors=N       expected capacity in 512-byte sectors
#   ringblk.serial=S        expected serial (/sys/block/vda/serial)
#   ringblk.queues=N        expected number of hardware queues
#   ringblk.nonce=HEX8      8 hex digits that mark this run's pattern
#   ringblk.fio_mb=N        size of the single-job fio region (default 32)
#   ringblk.fio_loops=N     write+verify passes of that job (default 1)
#   ringblk.step_timeout=S  timeout of each step in seconds (default 60)
#   ringblk.verbose=1       show every step's output, not only failed ones
#
# Prints one line per check, `RINGBLK-PASS <name>` or
# `RINGBLK-FAIL <name> <detail>`, then `RINGBLK-DONE`, and powers off.
#
# Disk layout (MiB offsets; the host test relies on it):
#   [0, fio_mb)                single-job fio write+verify
#   [fio_mb, fio_mb+16)        one fio job per CPU, 16 MiB split between them
#   48 .. 52                   discard, then write-zeroes and read back
#   52 .. 56                   large direct I/O (4 MiB requests, max segments)
#   56 .. 57                   pattern written by the guest (host checks it)
#   60 .. 61                   pattern written by the host (guest checks it)
# In the migrate mode, instead of the rw mode's 32 .. 56:
#   32 .. 56                   12 regions of 2 MiB the host filled
#   57 .. 57 + 4 KiB           their SHA-256s, one line each (the host's)
# In the backup mode, instead of the rw mode's:
#   [0, fio_mb)                pattern A (sequential fio), then B (random
#                              fio with verify) while the host backs it up
#   40 MiB + 4 KiB (4 KiB), 44 MiB - 8 KiB (16 KiB), 50 MiB (1 MiB)
#                              written after B, for the incremental backup
# In the qcow2 mode (a qcow2 overlay over a base the host filled):
#   0 .. fio_mb                fio write+verify, allocating in the overlay
#   then the whole disk        an ext4 file system (see "qcow2" below)
# In the luks mode (an encrypted disk, see "luks" below):
#   0 .. fio_mb                fio write+verify, then the whole disk
#                              an ext4 file system
# In the resize mode, after the identity checks and the host's pattern:
#   old end .. + 1 MiB         the pattern, written once the disk grew
#                              (the host checks it in the image)

export PATH=/usr/sbin:/usr/bin:/sbin:/bin

mount -t devtmpfs devtmpfs /dev 2>/dev/null
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mkdir -p /tmp
mount -t tmpfs tmpfs /tmp

TEST=rw
MIGRATE=busy
FIO_RUNTIME=20
SECTORS=
SERIAL=
QUEUES=
NONCE=00000000
NEW_SECTORS=
FIO_MB=32
FIO_LOOPS=1
STEP_TIMEOUT=60
VERBOSE=0
# shellcheck disable=SC2013 # the command line is words
for word in $(cat /proc/cmdline); do
    case "$word" in
        ringblk.test=*) TEST=${word#*=} ;;
        ringblk.migrate=*) MIGRATE=${word#*=} ;;
        ringblk.fio_runtime=*) FIO_RUNTIME=${word#*=} ;;
        ringblk.sectors=*) SECTORS=${word#*=} ;;
        ringblk.serial=*) SERIAL=${word#*=} ;;
        ringblk.queues=*) QUEUES=${word#*=} ;;
        ringblk.nonce=*) NONCE=${word#*=} ;;
        ringblk.new_sectors=*) NEW_SECTORS=${word#*=} ;;
        ringblk.fio_mb=*) FIO_MB=${word#*=} ;;
        ringblk.fio_loops=*) FIO_LOOPS=${word#*=} ;;
        ringblk.step_timeout=*) STEP_TIMEOUT=${word#*=} ;;
        ringblk.verbose=*) VERBOSE=${word#*=} ;;
    esac
done

DEV=/dev/vda
SYS=/sys/block/vda
MIB=1048576
# util-linux, not the busybox applet (which has no -z and wins in PATH lookups).
BLKDISCARD=/usr/sbin/blkdiscard

pass() { echo "RINGBLK-PASS $1"; }
fail() {
    name=$1
    shift
    echo "RINGBLK-FAIL $name $*"
}
# Runs a step: `step NAME CMD ARGS...`, output to /tmp/NAME.log, killed after
# the step timeout. A command stuck in the kernel (an I/O that never
# completes) survives SIGKILL: then the run ends here with the evidence.
step() {
    step_t "$STEP_TIMEOUT" "$@"
}
step_t() {
    step_start "$@"
    step_wait "$1" "$2" "$STEP_PID"
}
# `step_start LIMIT NAME CMD ARGS...` starts a step in the background (its
# pid in STEP_PID); `step_wait LIMIT NAME PID` waits for it as step_t does.
step_start() {
    limit=$1
    name=$2
    shift 2
    timeout -s KILL "$limit" "$@" >"/tmp/$name.log" 2>&1 &
    STEP_PID=$!
}
step_wait() {
    limit=$1
    name=$2
    pid=$3
    ticks=0
    while alive "$pid"; do
        if [ "$ticks" -ge $(((limit + 5) * 20)) ]; then
            stuck "$name" "$pid"
        fi
        sleep 0.05
        ticks=$((ticks + 1))
    done
    wait "$pid"
    rc=$?
    [ "$VERBOSE" = 1 ] && show_log "$name"
    return $rc
}
# Whether a child still runs (a zombie does not).
alive() {
    state=$(grep -s '^State:' "/proc/$1/status")
    case "$state" in
        "" | *Z*) return 1 ;;
        *) return 0 ;;
    esac
}
# Reports a step that SIGKILL could not end, with where it sleeps, and stops.
stuck() {
    fail "$1" "still running ${limit}s+5s after it started, unkillable: blocked in the kernel (I/O never completed?)"
    show_log "$1"
    for task in /proc/"$2"/task/*; do
        echo "---- $1 task ${task##*/}: $(grep '^State:' "$task/status") wchan=$(cat "$task/wchan" 2>/dev/null)"
        sed 's/^/    /' "$task/stack" 2>/dev/null
    done
    echo w >/proc/sysrq-trigger 2>/dev/null
    echo "---- dmesg (tail) ----"
    dmesg | tail -n 60 | sed 's/^/    /'
    power_off
}
# Shows the end of a step's log, indented, after a failure.
show_log() {
    echo "---- $1 log (tail) ----"
    tail -n 25 "/tmp/$1.log" | sed 's/^/    /'
    echo "---- end of $1 log ----"
}
# Flushes (with a timeout), reports the end and powers off.
finish() {
    step_t 20 final-sync sync || fail final-sync "sync failed"
    power_off
}
power_off() {
    echo "RINGBLK-DONE"
    poweroff -f
    sleep 5
    echo o >/proc/sysrq-trigger
}

# The pattern: 1 MiB of 32-byte records "rbpat NONCE%016d\n" numbered from 0.
make_pattern() {
    awk -v n="$NONCE" 'BEGIN { for (k = 0; k < 32768; k++) printf "rbpat %s %016d\n", n, k }' >"$1"
}

# ---- Checks shared by the test modes ----

# Every request queue completed requests: interrupts per virtqueue.
# Lines of /proc/interrupts like "25: 120 3 PCI-MSIX-0000:00:02.0 1-edge virtio0-req.1".
check_queues_used() {
    awk '/virtio[0-9]+-req\.[0-9]+/ {
            n = 0
            for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) n += $i
            print $NF, n
        }' /proc/interrupts >/tmp/queue-irqs
    [ "$VERBOSE" = 1 ] && sed 's/^/    interrupts: /' /tmp/queue-irqs
    used=$(awk '$2 > 0' /tmp/queue-irqs | wc -l)
    if [ "$used" = "$QUEUES" ]; then
        pass queues-used
    else
        fail queues-used "expected interrupts on $QUEUES request queues, got: $(tr '\n' ' ' </tmp/queue-irqs)"
    fi
}

# The guest's pattern at 56 MiB, flushed, read back (the host checks it too).
check_guest_pattern() {
    if step guest-pattern dd if=/tmp/pattern of="$DEV" bs=64k seek=896 count=16 oflag=direct conv=notrunc,fsync &&
        step guest-pattern-sync sync &&
        step guest-pattern-read dd if="$DEV" of=/tmp/guest-pattern bs=64k skip=896 count=16 iflag=direct &&
        cmp /tmp/pattern /tmp/guest-pattern >/tmp/guest-pattern-cmp.log 2>&1; then
        pass guest-pattern
    else
        fail guest-pattern "writing, flushing or reading back 1 MiB at 56 MiB failed"
        show_log guest-pattern
        show_log guest-pattern-read
        cat /tmp/guest-pattern-cmp.log 2>/dev/null
    fi
}

# The SHA-256 of the fio region as the guest reads it (the host compares it
# with the image file's).
report_fio_region() {
    if step fio-region sh -c "set -o pipefail; dd if=$DEV bs=1M count=$FIO_MB iflag=direct 2>/dev/null | sha256sum >/tmp/fio-region.sum"; then
        echo "RINGBLK-INFO fio-region-sha256 $(cut -d' ' -f1 /tmp/fio-region.sum)"
    else
        fail fio-region "reading the first $FIO_MB MiB failed"
    fi
}

echo "ringblk guest: test=$TEST sectors=$SECTORS serial=$SERIAL queues=$QUEUES nonce=$NONCE"

# Report hung tasks on the console early (the kernel's default is 120 s).
echo 15 >/proc/sys/kernel/hung_task_timeout_secs 2>/dev/null

# Modules, in dependency order (built-ins have no file and are skipped).
# virtio_blk's probe reads the partition table: a device that never
# completes a request hangs it, which step_t reports.
if [ -f /lib/modules/load.order ]; then
    # shellcheck disable=SC2016 # expanded by the inner shell
    step_t 30 modules sh -c '
        while read -r ko; do
            [ -n "$ko" ] || continue
            insmod "/lib/modules/$ko" 2>/tmp/insmod.err ||
                grep -q "File exists" /tmp/insmod.err || echo "insmod $ko: $(cat /tmp/insmod.err)"
        done </lib/modules/load.order' || show_log modules
fi

i=0
while [ ! -b "$DEV" ] && [ "$i" -lt 100 ]; do
    sleep 0.1
    i=$((i + 1))
done
if [ ! -b "$DEV" ]; then
    fail device "no $DEV after the modules loaded and 10 s more"
    ls /sys/block
    dmesg | tail -n 20
    finish
fi
pass device

# ---- Identity and geometry ----
got=$(cat "$SYS/size")
if [ "$got" = "$SECTORS" ]; then pass size; else fail size "expected $SECTORS sectors, got $got"; fi

got=$(cat "$SYS/serial" 2>/dev/null)
if [ "$got" = "$SERIAL" ]; then pass serial; else fail serial "expected '$SERIAL', got '$got'"; fi

# shellcheck disable=SC2012 # the entries are numbers
got=$(ls "$SYS/mq" | wc -l)
if [ "$got" = "$QUEUES" ]; then pass queues; else fail queues "expected $QUEUES hardware queues, got $got"; fi

got=$(cat "$SYS/ro")
if [ "$TEST" = ro ]; then want=1; else want=0; fi
if [ "$got" = "$want" ]; then pass ro-flag; else fail ro-flag "expected ro=$want, got $got"; fi

# ---- The host's pattern at 60 MiB reads back intact ----
make_pattern /tmp/pattern
if step host-pattern dd if="$DEV" of=/tmp/host-pattern bs=64k skip=960 count=16 iflag=direct &&
    cmp /tmp/pattern /tmp/host-pattern >>/tmp/host-pattern.log 2>&1; then
    pass host-pattern
else
    fail host-pattern "the 1 MiB at 60 MiB does not hold the host's pattern"
    show_log host-pattern
    hexdump -C /tmp/host-pattern 2>/dev/null | head -n 4
fi

if [ "$TEST" = ro ]; then
    # ---- Read-only: a direct write must fail, a read must work ----
    if step ro-write dd if=/tmp/pattern of="$DEV" bs=4k count=1 seek=14336 oflag=direct conv=notrunc; then
        fail ro-write "a direct write to a read-only disk succeeded"
        show_log ro-write
    else
        pass ro-write
    fi
    if step ro-read dd if="$DEV" of=/dev/null bs=64k count=256 iflag=direct; then
        pass ro-read
    else
        fail ro-read "reading 16 MiB failed"
        show_log ro-read
    fi
    finish
fi

# ---- Live migration (ringblk.test=migrate) ----
# The guest prints RINGBLK-MIGRATE when the host may migrate it, and goes on
# on the destination; its console continues in the destination's file.
#
# busy: fio random writes with verify_backlog (time-based, FIO_RUNTIME s,
#   one job per queue), a loop re-reading the host's pattern with O_DIRECT
#   and comparing each pass's checksum, and a loop reading the host's
#   regions through the page cache, run from before the marker until fio
#   ends, so all three span the migration. Pages the back-end fills
#   (reads) and fails to mark dirty reach the destination stale. Data
#   read with O_DIRECT is used at once, so only reads that complete while
#   the source stops can show that; the page cache keeps what a read
#   brought in, and the next reads see it: each round of the page-cache
#   loop reads a region not in the cache (one device read into fresh
#   pages) and then the last 4 regions it read again (from the cache, no
#   device I/O), each against the host's checksum. A region filled
#   during the migration is read again on the destination. Regions of
#   2 MiB take most of their pages from the free lists, not from pages
#   the guest has just freed (which the vCPUs wrote, so QEMU sends them
#   anyway); once all are cached the loop drops the cache and goes on.
# idle: no I/O from the marker until the host says the migration is over,
#   with an NMI (inject-nmi on the destination): /proc/interrupts counts it,
#   so waiting for it takes no disk I/O. Then write+verify, the host's
#   pattern again and the guest's pattern, all on the destination.

# Writes completed by the disk so far (the 5th field of its stat).
disk_writes() { awk '{ print $5 }' "$SYS/stat"; }
# All I/O the disk completed so far, reads and writes.
disk_ios() { awk '{ print $1 + $5 + $8 + $12 }' "$SYS/stat"; }
# NMIs received, all CPUs together.
nmi_count() {
    awk '$1 == "NMI:" { n = 0; for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) n += $i; print n }' /proc/interrupts
}

# The re-read loop, run by `sh -c` until /tmp/reread.stop exists: reads the
# host's 1 MiB at 60 MiB in 16 KiB O_DIRECT reads (each into the same
# buffer, each block different) and compares the SHA-256 of each pass.
# shellcheck disable=SC2016 # expanded by the inner shell
REREAD='
set -o pipefail
want=$(sha256sum </tmp/pattern | cut -d" " -f1)
passes=0
while [ ! -e /tmp/reread.stop ]; do
    got=$(dd if=/dev/vda bs=16k skip=3840 count=64 iflag=direct 2>/tmp/reread.err | sha256sum | cut -d" " -f1)
    rc=$?
    passes=$((passes + 1))
    echo "$passes" >/tmp/reread.passes
    if [ "$rc" != 0 ] || [ "$got" != "$want" ]; then
        echo "pass $passes: sha256 $got, expected $want (dd: $(tr "\n" " " </tmp/reread.err))" >>/tmp/reread.bad
        echo "RINGBLK-FAIL reread pass $passes read something else than the host wrote" >/dev/console
    fi
done'

# The page-cache loop, run by `sh -c` until /tmp/reread.stop exists.
# /tmp/cache.sums holds the host's checksum of each region. The loop keeps
# the disk open: the kernel drops a block device's cache at its last close.
# shellcheck disable=SC2016 # expanded by the inner shell
CACHE='
set -o pipefail
exec 3</dev/vda
regions=$(wc -l </tmp/cache.sums)
fills=0
since_drop=0
reads=0
# Region R (32 MiB + R * 2 MiB), buffered; WHAT says fill or cached.
check() {
    got=$(dd if=/dev/vda bs=64k skip=$((512 + $1 * 32)) count=32 2>/tmp/cache.err | sha256sum | cut -d" " -f1)
    rc=$?
    want=$(sed -n "$(($1 + 1))p" /tmp/cache.sums)
    reads=$((reads + 1))
    if [ "$rc" != 0 ] || [ "$got" != "$want" ]; then
        echo "region $1 ($2): sha256 $got, expected $want (dd: $(tr "\n" " " </tmp/cache.err))" >>/tmp/cache.bad
        echo "RINGBLK-FAIL page-cache region $1 ($2) read something else than the host wrote" >/dev/console
    fi
}
while [ ! -e /tmp/reread.stop ]; do
    if [ "$since_drop" = "$regions" ]; then
        # All are cached: start again on fresh pages.
        echo 1 >/proc/sys/vm/drop_caches
        since_drop=0
    fi
    check $((fills % regions)) fill
    fills=$((fills + 1))
    since_drop=$((since_drop + 1))
    back=$since_drop
    [ "$back" -gt 4 ] && back=4
    while [ "$back" -gt 0 ]; do
        check $(((fills - back) % regions)) cached
        back=$((back - 1))
    done
    echo "$fills $reads" >/tmp/cache.progress
done'

migrate_busy() {
    rm -f /tmp/reread.stop /tmp/reread.bad /tmp/reread.passes /tmp/cache.bad /tmp/cache.progress
    if step cache-sums dd if="$DEV" of=/tmp/cache.raw bs=4k skip=14592 count=1 iflag=direct &&
        grep -E '^[0-9a-f]{64}$' /tmp/cache.raw >/tmp/cache.sums && [ "$(wc -l </tmp/cache.sums)" = 12 ]; then
        pass cache-sums
    else
        fail cache-sums "no 12 checksums at 57 MiB"
        show_log cache-sums
    fi
    step_start $((FIO_RUNTIME + 60)) reread sh -c "$REREAD"
    reread_pid=$STEP_PID
    step_start $((FIO_RUNTIME + 60)) page-cache sh -c "$CACHE"
    cache_pid=$STEP_PID
    jobs=$(nproc)
    [ "$jobs" -gt "$QUEUES" ] && jobs=$QUEUES
    per_job=$((FIO_MB / jobs))
    cpus=
    [ "$jobs" -ge 2 ] && cpus="--cpus_allowed=0-$((jobs - 1)) --cpus_allowed_policy=split"
    writes=$(disk_writes)
    # shellcheck disable=SC2086 # $cpus is two words or none
    step_start $((FIO_RUNTIME + 60)) fio-migrate fio --name=migrate --filename="$DEV" \
        --ioengine=libaio --direct=1 --iodepth=16 --rw=randwrite --bssplit=4k/50:16k/30:64k/20 \
        --numjobs="$jobs" $cpus --offset=0 --offset_increment="${per_job}M" --size="${per_job}M" \
        --time_based --runtime="$FIO_RUNTIME" --verify=crc32c --verify_backlog=64 \
        --verify_fatal=1 --verify_state_save=0 --exitall_on_error=1 --group_reporting
    fio_pid=$STEP_PID
    # Tell the host once fio is writing, not merely starting.
    i=0
    while [ $(($(disk_writes) - writes)) -lt 64 ] && [ "$i" -lt 600 ] && alive "$fio_pid"; do
        sleep 0.05
        i=$((i + 1))
    done
    echo "RINGBLK-MIGRATE"
    if step_wait $((FIO_RUNTIME + 60)) fio-migrate "$fio_pid"; then
        pass fio-migrate
    else
        fail fio-migrate "exit status $? ($jobs jobs, ${FIO_RUNTIME}s)"
        show_log fio-migrate
    fi
    touch /tmp/reread.stop
    step_wait $((FIO_RUNTIME + 60)) reread "$reread_pid"
    passes=$(cat /tmp/reread.passes 2>/dev/null || echo 0)
    echo "RINGBLK-INFO reread-passes $passes"
    if [ -s /tmp/reread.bad ]; then
        fail reread "$(wc -l </tmp/reread.bad) of $passes passes read something else than the host wrote"
        head -n 5 /tmp/reread.bad
    elif [ "$passes" -lt 2 ]; then
        fail reread "only $passes pass(es) while fio ran"
        show_log reread
    else
        pass reread
    fi
    step_wait $((FIO_RUNTIME + 60)) page-cache "$cache_pid"
    read -r fills reads 2>/dev/null </tmp/cache.progress || fills=0 reads=0
    echo "RINGBLK-INFO page-cache-fills $fills"
    echo "RINGBLK-INFO page-cache-reads $reads"
    if [ -s /tmp/cache.bad ]; then
        fail page-cache "$(wc -l </tmp/cache.bad) of $reads reads of the host's regions read something else"
        head -n 5 /tmp/cache.bad
    elif [ "$fills" -lt 2 ]; then
        fail page-cache "only $fills region(s) read while fio ran"
        show_log page-cache
    else
        pass page-cache
    fi
}

migrate_idle() {
    nmis=$(nmi_count)
    ios=$(disk_ios)
    echo "RINGBLK-MIGRATE"
    # Ten minutes at most: the host gives up long before.
    i=0
    while [ "$(nmi_count)" = "$nmis" ] && [ "$i" -lt 3000 ]; do
        sleep 0.2
        i=$((i + 1))
    done
    if [ "$(nmi_count)" = "$nmis" ]; then
        fail idle "no NMI from the host within 10 minutes"
        finish
    fi
    if [ "$(disk_ios)" = "$ios" ]; then
        pass idle
    else
        fail idle "the disk completed $(($(disk_ios) - ios)) I/O(s) while the guest was to be idle"
    fi
    if step fio-verify fio --name=verify --filename="$DEV" --ioengine=libaio --direct=1 \
        --iodepth=16 --rw=randwrite --bssplit=4k/50:16k/30:64k/20 \
        --offset=0 --size="${FIO_MB}M" --verify=crc32c --verify_fatal=1 \
        --verify_state_save=0 --exitall_on_error=1; then
        pass fio-verify
    else
        fail fio-verify "exit status $?"
        show_log fio-verify
    fi
    if step host-pattern-after dd if="$DEV" of=/tmp/host-pattern bs=64k skip=960 count=16 iflag=direct &&
        cmp /tmp/pattern /tmp/host-pattern >>/tmp/host-pattern-after.log 2>&1; then
        pass host-pattern-after
    else
        fail host-pattern-after "the 1 MiB at 60 MiB does not hold the host's pattern any more"
        show_log host-pattern-after
    fi
}

# ---- Online resize: the host grows the disk while the guest runs ----
# Prints RINGBLK-RESIZE for the host to resize, waits for the new size in
# /sys/block/vda/size (no reboot, no rescan), then writes the pattern just
# past the old end with O_DIRECT and reads it back.
resize_online() {
    old=$(cat "$SYS/size")
    echo "RINGBLK-RESIZE"
    i=0
    while [ "$(cat "$SYS/size")" = "$old" ] && [ "$i" -lt 1200 ]; do
        sleep 0.05
        i=$((i + 1))
    done
    got=$(cat "$SYS/size")
    if [ "$got" = "$NEW_SECTORS" ]; then
        pass resize-seen
    else
        fail resize-seen "expected $NEW_SECTORS sectors within 60 s of the resize, got $got (was $old)"
        dmesg | tail -n 10
        finish
    fi
    echo "RINGBLK-INFO resize-dmesg $(dmesg | grep -m1 -o 'capacity change.*')"
    # 64 KiB blocks from the old end.
    at=$((old * 512 / 65536))
    if step past-old-end dd if=/tmp/pattern of="$DEV" bs=64k seek="$at" count=16 oflag=direct conv=notrunc,fsync &&
        step past-old-end-read dd if="$DEV" of=/tmp/past-old-end bs=64k skip="$at" count=16 iflag=direct &&
        cmp /tmp/pattern /tmp/past-old-end >/tmp/past-old-end-cmp.log 2>&1; then
        pass past-old-end
    else
        fail past-old-end "writing or reading back 1 MiB at the old end failed"
        show_log past-old-end
        show_log past-old-end-read
        cat /tmp/past-old-end-cmp.log 2>/dev/null
    fi
}

if [ "$TEST" = resize ]; then
    resize_online
    finish
fi

# ---- Backup (ringblk.test=backup): the host backs the disk up while the
# guest overwrites it ----
# Pattern A over [0, FIO_MB), flushed; RINGBLK-BACKUP, and the guest waits
# for an NMI (the host has noted the disk and started the backup); then
# fio random writes with verify over the same region (pattern B) while the
# host copies the export, and three writes elsewhere at known offsets (the
# host's incremental must list them); RINGBLK-INCR, and a second NMI once
# the host has taken the incremental.
# Waits up to 10 minutes for an NMI after the count $1; NAME $2.
wait_nmi() {
    i=0
    while [ "$(nmi_count)" = "$1" ] && [ "$i" -lt 3000 ]; do
        sleep 0.2
        i=$((i + 1))
    done
    if [ "$(nmi_count)" = "$1" ]; then
        fail "$2" "no NMI from the host within 10 minutes"
        finish
    fi
    pass "$2"
}
backup_mode() {
    if step fio-a fio --name=a --filename="$DEV" --ioengine=libaio --direct=1 \
        --iodepth=16 --rw=write --bs=64k --offset=0 --size="${FIO_MB}M" \
        --verify=crc32c --verify_fatal=1 --verify_state_save=0 --exitall_on_error=1; then
        pass fio-a
    else
        fail fio-a "exit status $?"
        show_log fio-a
    fi
    step backup-sync sync
    nmis=$(nmi_count)
    echo "RINGBLK-BACKUP"
    wait_nmi "$nmis" backup-go
    if step fio-b fio --name=b --filename="$DEV" --ioengine=libaio --direct=1 \
        --iodepth=16 --rw=randwrite --bssplit=4k/50:16k/30:64k/20 --randseed=23 \
        --offset=0 --size="${FIO_MB}M" --verify=crc32c --verify_fatal=1 \
        --verify_state_save=0 --exitall_on_error=1; then
        pass fio-b
    else
        fail fio-b "exit status $?"
        show_log fio-b
    fi
    if step incr-1 dd if=/tmp/pattern of="$DEV" bs=4k seek=10241 count=1 oflag=direct conv=notrunc &&
        step incr-2 dd if=/tmp/pattern of="$DEV" bs=4k seek=11262 count=4 oflag=direct conv=notrunc &&
        step incr-3 dd if=/tmp/pattern of="$DEV" bs=64k seek=800 count=16 oflag=direct conv=notrunc &&
        step incr-sync sync; then
        pass incr-writes
    else
        fail incr-writes "the writes after the backup failed"
    fi
    nmis=$(nmi_count)
    echo "RINGBLK-INCR"
    wait_nmi "$nmis" incr-go
}

if [ "$TEST" = backup ]; then
    backup_mode
    finish
fi

# ---- qcow2 (ringblk.test=qcow2): the disk is a qcow2 overlay ----
# The host's pattern, read above, came from the base through the overlay.
# 1. fio write+verify of [0, FIO_MB) in 4 KiB random writes, most of them
#    allocating (copy-on-write from the base); the host kills the daemon
#    (SIGKILL) under it and restarts it, QEMU reconnects.
# 2. mkfs.ext4 over the whole disk (it discards it first), mount, and
#    RINGBLK-SNAPSHOT: the host takes a live snapshot while fio
#    write+verifies a file of the file system.
# 3. fstrim, umount, e2fsck -f -n.
# util-linux's and e2fsprogs' programs by path: busybox's applets win
# PATH lookups.
qcow2_checks() {
    if step fio-alloc fio --name=alloc --filename="$DEV" --ioengine=libaio --direct=1 \
        --iodepth=16 --rw=randwrite --bs=4k --offset=0 --size="${FIO_MB}M" \
        --io_size=$((FIO_MB / 2))M --verify=crc32c --verify_fatal=1 --verify_state_save=0 \
        --exitall_on_error=1; then
        pass fio-alloc
    else
        fail fio-alloc "exit status $?"
        show_log fio-alloc
    fi
    if step mkfs /usr/sbin/mke2fs -q -F -t ext4 "$DEV"; then
        pass mkfs
    else
        fail mkfs "mke2fs -t ext4 failed"
        show_log mkfs
        finish
    fi
    mkdir -p /mnt
    if ! step mount mount -t ext4 "$DEV" /mnt; then
        fail fs-fio "mount failed"
        show_log mount
        dmesg | tail -n 10
        finish
    fi
    echo "RINGBLK-SNAPSHOT"
    if step fs-fio fio --name=fs --filename=/mnt/fio.data --ioengine=libaio --direct=1 \
        --iodepth=16 --rw=randwrite --bssplit=4k/50:64k/50 --size=16M --loops=2 \
        --verify=crc32c --verify_fatal=1 --verify_state_save=0 --exitall_on_error=1; then
        pass fs-fio
    else
        fail fs-fio "exit status $?"
        show_log fs-fio
    fi
    if step fstrim /usr/sbin/fstrim -v /mnt; then
        pass fstrim
        echo "RINGBLK-INFO fstrim $(cat /tmp/fstrim.log)"
    else
        fail fstrim "fstrim failed"
        show_log fstrim
    fi
    if step umount umount /mnt && step e2fsck /usr/sbin/e2fsck -f -n "$DEV"; then
        pass e2fsck
    else
        fail e2fsck "umount or e2fsck -f -n failed"
        show_log umount
        show_log e2fsck
    fi
}

# ---- luks (ringblk.test=luks): the disk is a LUKS image ringblk decrypts ----
# 1. fio write+verify of [0, FIO_MB) in 4 KiB random writes; the host kills
#    the daemon (SIGKILL) under it and restarts it, QEMU reconnects.
# 2. mkfs.ext4 over the whole disk, mount, fio write+verify of a file.
# 3. umount, e2fsck -f -n, then the SHA-256 of the whole disk as the guest
#    reads it (RINGBLK-INFO disk-sha256): the host compares it with its
#    own decryption of the image.
luks_checks() {
    if step fio-kills fio --name=kills --filename="$DEV" --ioengine=libaio --direct=1 \
        --iodepth=16 --rw=randwrite --bs=4k --offset=0 --size="${FIO_MB}M" \
        --io_size=$((FIO_MB / 2))M --verify=crc32c --verify_fatal=1 --verify_state_save=0 \
        --exitall_on_error=1; then
        pass fio-kills
    else
        fail fio-kills "exit status $?"
        show_log fio-kills
    fi
    if step mkfs /usr/sbin/mke2fs -q -F -t ext4 "$DEV"; then
        pass mkfs
    else
        fail mkfs "mke2fs -t ext4 failed"
        show_log mkfs
        finish
    fi
    mkdir -p /mnt
    if ! step mount mount -t ext4 "$DEV" /mnt; then
        fail fs-fio "mount failed"
        show_log mount
        finish
    fi
    if step fs-fio fio --name=fs --filename=/mnt/fio.data --ioengine=libaio --direct=1 \
        --iodepth=16 --rw=randwrite --bssplit=4k/50:64k/50 --size=16M \
        --verify=crc32c --verify_fatal=1 --verify_state_save=0 --exitall_on_error=1; then
        pass fs-fio
    else
        fail fs-fio "exit status $?"
        show_log fs-fio
    fi
    if step umount umount /mnt && step e2fsck /usr/sbin/e2fsck -f -n "$DEV"; then
        pass e2fsck
    else
        fail e2fsck "umount or e2fsck -f -n failed"
        show_log umount
        show_log e2fsck
    fi
    if step disk-sum sh -c "set -o pipefail; dd if=$DEV bs=1M iflag=direct 2>/dev/null | sha256sum >/tmp/disk.sum"; then
        echo "RINGBLK-INFO disk-sha256 $(cut -d' ' -f1 /tmp/disk.sum)"
    else
        fail disk-sum "reading the whole disk failed"
    fi
}

if [ "$TEST" = luks ]; then
    luks_checks
    finish
fi

if [ "$TEST" = qcow2 ]; then
    qcow2_checks
    finish
fi

if [ "$TEST" = migrate ]; then
    case "$MIGRATE" in
        busy) migrate_busy ;;
        idle) migrate_idle ;;
        *) fail migrate "unknown ringblk.migrate=$MIGRATE" ;;
    esac
    report_fio_region
    check_queues_used
    check_guest_pattern
    finish
fi

# ---- fio: one job, mixed block sizes, write then verify ----
if step fio-verify fio --name=verify --filename="$DEV" --ioengine=libaio --direct=1 \
    --iodepth=16 --rw=randwrite --bssplit=4k/50:16k/30:64k/20 \
    --offset=0 --size="${FIO_MB}M" --loops="$FIO_LOOPS" --verify=crc32c --verify_fatal=1 \
    --verify_state_save=0 --exitall_on_error=1; then
    pass fio-verify
else
    fail fio-verify "exit status $?"
    show_log fio-verify
fi

# ---- fio: one job per CPU (at most one per queue), each on its own part
# of a 16 MiB range, so that every CPU, hence every queue, does I/O ----
jobs=$(nproc)
[ "$jobs" -gt "$QUEUES" ] && jobs=$QUEUES
per_job=$((16 / jobs))
cpus=
[ "$jobs" -ge 2 ] && cpus="--cpus_allowed=0-$((jobs - 1)) --cpus_allowed_policy=split"
# shellcheck disable=SC2086 # $cpus is two words or none
if step fio-jobs fio --name=jobs --filename="$DEV" --ioengine=libaio --direct=1 \
    --iodepth=8 --rw=randwrite --bssplit=4k/60:32k/40 --numjobs="$jobs" $cpus \
    --offset="${FIO_MB}M" --offset_increment="${per_job}M" --size="${per_job}M" \
    --verify=crc32c --verify_fatal=1 --verify_state_save=0 --exitall_on_error=1 \
    --group_reporting; then
    pass fio-jobs
else
    fail fio-jobs "exit status $? ($jobs jobs)"
    show_log fio-jobs
fi

check_queues_used

# ---- Discard, then write-zeroes and read back zeroes (48..52 MiB) ----
step discard-fill dd if=/tmp/pattern of="$DEV" bs=64k seek=768 count=16 oflag=direct conv=notrunc
discard_max=$(cat "$SYS/queue/discard_max_bytes")
if [ "$discard_max" = 0 ]; then
    fail discard "the disk does not offer discard (discard_max_bytes=0)"
elif step discard "$BLKDISCARD" -f -o $((48 * MIB)) -l $((4 * MIB)) "$DEV"; then
    pass discard
else
    fail discard "blkdiscard failed"
    show_log discard
fi
dd if=/dev/zero of=/tmp/zeroes bs=64k count=64 2>/dev/null
if step zeroout "$BLKDISCARD" -f -z -o $((48 * MIB)) -l $((4 * MIB)) "$DEV" &&
    step zeroout-read dd if="$DEV" of=/tmp/zeroout bs=64k skip=768 count=64 iflag=direct &&
    cmp /tmp/zeroes /tmp/zeroout >/tmp/zeroout-cmp.log 2>&1; then
    pass zeroout
else
    fail zeroout "blkdiscard -z of 4 MiB at 48 MiB failed or did not read back as zeroes"
    show_log zeroout
    show_log zeroout-read
    cat /tmp/zeroout-cmp.log 2>/dev/null
fi

# ---- Large direct I/O: 4 MiB requests split at seg_max segments ----
# Each request carries seg_max page-sized segments in one indirect table,
# more descriptors than QEMU's queue (128) holds.
if step large-io dd if=/dev/urandom of=/tmp/large bs=1M count=4 &&
    step large-io-write dd if=/tmp/large of="$DEV" bs=4M seek=13 count=1 oflag=direct conv=notrunc &&
    step large-io-read dd if="$DEV" of=/tmp/large-back bs=4M skip=13 count=1 iflag=direct &&
    cmp /tmp/large /tmp/large-back >/tmp/large-cmp.log 2>&1; then
    pass large-io
else
    fail large-io "4 MiB direct write/read at 52 MiB failed or did not read back"
    show_log large-io-write
    show_log large-io-read
    cat /tmp/large-cmp.log 2>/dev/null
fi

check_guest_pattern

finish
