#!/usr/bin/env bash
# Builds (once) what the guest tests boot: a Debian kernel and an initramfs
# with busybox, fio, blkdiscard, fstrim, mke2fs and e2fsck, the virtio and
# ext4 modules and tests/guest/init.sh.
#
#   scripts/guest-assets.sh            build if missing or stale, print paths
#   RINGBLK_GUEST_DIR=DIR ...          cache somewhere else (default target/guest)
#
# Installs the Debian packages it needs when they are missing (root, or sudo).
# Prints `kernel=PATH` and `initrd=PATH` as its last two lines.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${RINGBLK_GUEST_DIR:-$repo/target/guest}
init_script=$repo/tests/guest/init.sh
# Loaded in this order; dependencies are resolved with modinfo as well.
# crc32c_generic: ext4's metadata checksums ask the crypto API for crc32c,
# which would load it through modprobe (not in the initramfs).
modules=(virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk
    crc32c_generic ext4)

log() { echo "guest-assets: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# ensure_packages, as_root, apt_update_once.
# shellcheck source=lib/packages.sh
. "$repo/scripts/lib/packages.sh"

# One build at a time (cargo may run this from several test binaries).
mkdir -p "$dir"
exec 9>"$dir/.lock"
flock -w 600 9 || die "timed out waiting for $dir/.lock"

ensure_packages qemu-system-x86 qemu-system-common fio busybox-static cpio kmod \
    util-linux mount xz-utils zstd gzip libc-bin e2fsprogs

# ---- Which kernel ----
kernel_pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }' || true)
if [ -z "$kernel_pkg" ]; then
    apt_update_once
    kernel_pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }' || true)
fi
if [ -z "$kernel_pkg" ]; then
    # Offline with a cache: use what is there.
    kernel_pkg=$(cat "$dir/kernel.pkg" 2>/dev/null || true)
    [ -n "$kernel_pkg" ] || die "cannot find the package linux-image-amd64 depends on"
    log "apt knows no linux-image-amd64; using the cached $kernel_pkg"
fi

stamp_of() {
    {
        echo "$kernel_pkg"
        cat "$init_script" "${BASH_SOURCE[0]}" | sha256sum
        dpkg-query -W fio busybox-static util-linux libaio1 e2fsprogs 2>/dev/null || true
    } | sha256sum | cut -d' ' -f1
}
stamp=$(stamp_of)
kernel=$dir/vmlinuz
initrd=$dir/initramfs.cpio.gz
if [ -f "$kernel" ] && [ -f "$initrd" ] && [ "$(cat "$dir/stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "kernel=$kernel"
    echo "initrd=$initrd"
    exit 0
fi

# ---- Kernel package: download (kept) and unpack (for this build only) ----
deb=$dir/deb/$kernel_pkg.deb
if [ ! -f "$deb" ]; then
    log "downloading $kernel_pkg"
    rm -rf "$dir/deb"
    mkdir -p "$dir/deb"
    # apt-get download runs as _apt if it can: give it a directory it may write.
    chmod 0777 "$dir/deb" 2>/dev/null || true
    (cd "$dir/deb" && apt-get download -q "$kernel_pkg" >&2) || {
        apt_update_once
        (cd "$dir/deb" && apt-get download -q "$kernel_pkg" >&2)
    }
    mv "$dir"/deb/"$kernel_pkg"_*.deb "$deb"
fi
kdir=$dir/kernel
rm -rf "$kdir"
trap 'rm -rf "$kdir"' EXIT
dpkg -x "$deb" "$kdir"
echo "$kernel_pkg" >"$dir/kernel.pkg"
vmlinuz=
for f in "$kdir"/boot/vmlinuz-*; do
    [ -f "$f" ] && vmlinuz=$f && break
done
[ -n "$vmlinuz" ] || die "no boot/vmlinuz-* in $kernel_pkg"
kver=${vmlinuz##*/vmlinuz-}
moddir=
for d in "$kdir/lib/modules/$kver" "$kdir/usr/lib/modules/$kver"; do
    [ -d "$d" ] && moddir=$d && break
done
[ -n "$moddir" ] || die "no modules for $kver in $kernel_pkg"

# ---- Initramfs tree ----
root=$dir/root
rm -rf "$root"
mkdir -p "$root"/{usr/bin,usr/sbin,usr/lib,usr/lib64,dev,proc,sys,tmp}
ln -s usr/bin "$root/bin"
ln -s usr/sbin "$root/sbin"
ln -s usr/lib "$root/lib"
ln -s usr/lib64 "$root/lib64"
mkdir -p "$root/lib/modules"

# busybox-static, with a link per applet.
bb=$(dpkg -L busybox-static | grep -E '/bin/busybox$' | head -n 1)
[ -x "$bb" ] || die "busybox-static has no /bin/busybox"
cp "$bb" "$root/usr/bin/busybox"
for applet in $("$bb" --list); do
    [ -e "$root/usr/bin/$applet" ] || ln -s busybox "$root/usr/bin/$applet"
done

# A dynamically linked program and every library it needs, at the same paths.
copy_with_libs() {
    local prog=$1 dest=$2 lib
    cp -L "$prog" "$root$dest"
    for lib in $(ldd "$prog" | awk '/=> \// { print $3 } /^[ \t]*\/[^ ]*ld-linux/ { print $1 }'); do
        [ -e "$root$lib" ] && continue
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
    done
}
copy_with_libs "$(command -v fio)" /usr/bin/fio
copy_with_libs /usr/sbin/blkdiscard /usr/sbin/blkdiscard
copy_with_libs /usr/sbin/fstrim /usr/sbin/fstrim
copy_with_libs /usr/sbin/mke2fs /usr/sbin/mke2fs
ln -s mke2fs "$root/usr/sbin/mkfs.ext4"
copy_with_libs /usr/sbin/e2fsck /usr/sbin/e2fsck
mkdir -p "$root/etc"
cp /etc/mke2fs.conf "$root/etc/mke2fs.conf"
# fio links libaio; make sure it is there even if a build dlopens it.
if [ ! -e "$root/lib/x86_64-linux-gnu/libaio.so.1" ]; then
    aio=$(ldconfig -p | awk '/libaio\.so\.1 .*x86-64/ { print $NF; exit }')
    [ -n "$aio" ] || die "libaio.so.1 not found"
    mkdir -p "$root/lib/x86_64-linux-gnu"
    cp -L "$aio" "$root/lib/x86_64-linux-gnu/libaio.so.1"
fi

# Modules: each wanted one after its dependencies, decompressed for insmod.
declare -A queued=()
order=()
queue_module() {
    local name=$1 file dep
    [ -n "${queued[$name]:-}" ] && return 0
    queued[$name]=1
    file=$(find "$moddir/kernel" -name "$name.ko" -o -name "$name.ko.xz" -o -name "$name.ko.zst" -o -name "$name.ko.gz" | head -n 1)
    if [ -z "$file" ]; then
        grep -qE "/$name\.ko" "$moddir/modules.builtin" 2>/dev/null || log "note: no module $name (assuming built in)"
        return 0
    fi
    for dep in $(modinfo -F depends "$file" | tr ',' ' '); do
        queue_module "$dep"
    done
    case "$file" in
        *.ko.xz) xz -dc "$file" >"$root/lib/modules/$name.ko" ;;
        *.ko.zst) zstd -qdc "$file" >"$root/lib/modules/$name.ko" ;;
        *.ko.gz) gzip -dc "$file" >"$root/lib/modules/$name.ko" ;;
        *) cp "$file" "$root/lib/modules/$name.ko" ;;
    esac
    order+=("$name.ko")
}
for m in "${modules[@]}"; do
    queue_module "$m"
done
printf '%s\n' "${order[@]}" >"$root/lib/modules/load.order"

install -m 0755 "$init_script" "$root/init"

# ---- Pack ----
log "packing $(du -sh "$root" | cut -f1) into the initramfs"
(cd "$root" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) | gzip -1 >"$initrd.tmp"
mv "$initrd.tmp" "$initrd"
cp "$vmlinuz" "$kernel"
echo "$stamp" >"$dir/stamp"
log "kernel $kver, modules: ${order[*]}"
echo "kernel=$kernel"
echo "initrd=$initrd"
