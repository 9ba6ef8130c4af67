//! QEMU's persistent dirty bitmaps in a qcow2 image (QEMU's
//! docs/interop/qcow2.txt, "Bitmaps extension"; block/qcow2-bitmap.c):
//! reading and checking the extension, the directory and the bits, and
//! marking the bitmaps in use. [`super::bitmap_write`] writes them back;
//! `crate::disk::qcow2::bitmap_store` makes them the device's bitmaps
//! (docs/backup.md).
//!
//! imago clears the header's autoclear bits when it opens an image
//! writable, as the format asks of a program that does not know a
//! feature; QEMU would then drop the bitmaps ("a program lacking bitmap
//! support modified this file"). Instead imago is shown the field as zero
//! from its open on (so it does not rewrite the header), and once it has
//! opened the image, before the first guest write
//! ([`Bitmaps::mark_in_use`]):
//!
//! 1. every entry of the bitmap directory gets its IN_USE flag, and the
//!    directory is fdatasynced;
//! 2. then the autoclear field is written with bit 0 (the bitmaps
//!    extension is valid) set, bit 62 (the L2 log's mark, ringblk's own:
//!    `super::l2log`) as the file has it, and any other bit cleared
//!    (features this program does not know), and fdatasynced.
//!
//! IN_USE is QEMU's own "this bitmap may be missing changes": until the
//! bitmaps are written back at a clean release, `qemu-img info` lists
//! each with the flag `in-use`, QEMU loads it as inconsistent, and
//! `qemu-img check` finds the image clean. Bit 0 is cleared on disk only
//! with the extension itself (the last bitmap removed, `bitmap_write`): a
//! crash before step 1 leaves the image as it was found, after it the
//! bitmaps in use. imago rereads the header when it drops its caches (every claim
//! and release of the image) and refuses one whose autoclear bits or
//! extensions are not those it found at open, so its reads of them show
//! what it found ([`header_view`], `FileState::show_imago`): the
//! file has the real ones.
//!
//! Everything is read from a file that came from elsewhere, so everything
//! is bounded before it is used ([`parse`]): QEMU's limits on the
//! extension and on each directory entry, offsets inside the file and
//! cluster-aligned, the directory exactly filled by its entries. A bad
//! extension refuses the open with a one-line error, before anything is
//! written, as QEMU refuses it.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// The bitmaps extension's type in the header extension area.
pub const EXT_MAGIC: u32 = 0x2385_2875;
/// Autoclear feature bit 0: the bitmaps extension is consistent with the
/// image.
pub const AUTOCLEAR_BITMAPS: u64 = 1 << 0;
/// At most this many bitmaps (QEMU's `QCOW2_MAX_BITMAPS`).
pub const MAX_BITMAPS: u32 = 65535;
/// The largest bitmap directory (QEMU's `QCOW2_MAX_BITMAP_DIRECTORY_SIZE`).
pub const MAX_DIRECTORY_SIZE: u64 = 1024 * MAX_BITMAPS as u64;
/// The longest name (QEMU's `BME_MAX_NAME_SIZE`).
pub const MAX_NAME_SIZE: usize = 1023;
/// The most entries of one bitmap table (QEMU's `BME_MAX_TABLE_SIZE`).
pub const MAX_TABLE_SIZE: u32 = 0x800_0000;
/// The most bytes of one bitmap's data (QEMU's `BME_MAX_PHYS_SIZE`).
pub const MAX_PHYS_SIZE: u64 = 0x2000_0000;
/// The most bytes of bits all the bitmaps of an image may need in
/// memory: an image needing more is refused (a small hostile image may
/// claim 65535 bitmaps of a huge disk).
pub const MAX_LOADED: u64 = 1 << 30;
/// Directory entry flag: the bitmap is in use by a program that may not
/// have written all of it (inconsistent).
pub const FLAG_IN_USE: u32 = 1 << 0;
pub(super) const FLAG_AUTO: u32 = 1 << 1;
const FLAG_EXTRA_DATA_COMPATIBLE: u32 = 1 << 2;
const RESERVED_FLAGS: u32 = !(FLAG_IN_USE | FLAG_AUTO | FLAG_EXTRA_DATA_COMPATIBLE);
const TYPE_DIRTY_TRACKING: u8 = 1;
const MIN_GRANULARITY_BITS: u8 = 9;
const MAX_GRANULARITY_BITS: u8 = 31;
/// A bitmap table entry: the data cluster's offset, "all ones" (bit 0,
/// with no cluster), and the reserved bits (QEMU's
/// `BME_TABLE_ENTRY_RESERVED_MASK`).
pub(super) const TABLE_OFFSET: u64 = 0x00ff_ffff_ffff_fe00;
pub(super) const TABLE_ALL_ONES: u64 = 1;
const TABLE_RESERVED: u64 = 0xff00_0000_0000_01fe;
/// The fixed part of a directory entry.
const ENTRY_HEADER: usize = 24;
/// Where the autoclear features are in the header.
pub const AUTOCLEAR_OFFSET: u64 = 88;

/// One entry of the bitmap directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub granularity_bits: u8,
    pub flags: u32,
    pub table_offset: u64,
    pub table_size: u32,
    /// Where the entry starts in the directory.
    pos: usize,
}

impl Entry {
    /// Whether QEMU trusts the bitmap's bits.
    pub fn in_use(&self) -> bool {
        self.flags & FLAG_IN_USE != 0
    }
}

/// The bitmap directory of an image whose extension is valid (autoclear
/// bit 0 set).
#[derive(Clone, Debug)]
pub struct Bitmaps {
    pub directory_offset: u64,
    pub entries: Vec<Entry>,
    /// The directory as read.
    pub(super) raw: Vec<u8>,
    /// The header's autoclear features as found.
    autoclear: u64,
    pub(super) cluster: u64,
    pub(super) disk_size: u64,
    pub(super) file_len: u64,
    /// Where the extension's 24 bytes are in the header.
    pub(super) ext_at: u64,
}

/// A bitmap as loaded from the image: its bits, or why they cannot be
/// trusted (in use, or a bad table).
#[derive(Clone, Debug)]
pub struct Loaded {
    pub name: String,
    pub granularity_bits: u8,
    /// QEMU's AUTO flag (the bitmap records while QEMU has the image).
    pub auto: bool,
    pub words: Result<Vec<u64>, String>,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

pub(super) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

pub(super) fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks that `[offset, offset + len)` is cluster-aligned at `offset` and
/// inside a file of `file_len` bytes.
fn check_range(
    what: &str,
    offset: u64,
    len: u64,
    cluster: u64,
    file_len: u64,
) -> Result<(), String> {
    if offset == 0 || !offset.is_multiple_of(cluster) {
        return Err(format!(
            "{what} offset {offset:#x} is not a cluster boundary past the header"
        ));
    }
    match offset.checked_add(len) {
        Some(end) if end <= file_len => Ok(()),
        _ => Err(format!(
            "{what} at {offset:#x} ({len} bytes) lies past the end of the file ({file_len} bytes)"
        )),
    }
}

/// Reads and checks the bitmaps extension and directory of a qcow2 file.
/// `read(buf, offset)` reads exactly `buf.len()` bytes at `offset` of a
/// file of `file_len` bytes. Returns `None` when there is no extension, or
/// when the autoclear bit says a program that does not know bitmaps wrote
/// the image since (QEMU then ignores the extension, and so does this).
/// Errors are one line, for "bitmaps extension: ...".
pub fn parse(
    read: &mut dyn FnMut(&mut [u8], u64) -> io::Result<()>,
    file_len: u64,
) -> Result<Option<Bitmaps>, String> {
    let mut h = [0u8; 104];
    // What is wrong with the header itself is imago's to refuse, in its
    // words; only the bitmaps extension is checked here.
    if file_len < h.len() as u64 {
        return Ok(None);
    }
    read(&mut h, 0).map_err(|e| format!("reading the header: {e}"))?;
    if be32(&h, 4) < 3 {
        return Ok(None); // version 2 has no extensions that matter here
    }
    let cluster_bits = be32(&h, 20);
    if !(9..=21).contains(&cluster_bits) {
        return Ok(None);
    }
    let cluster = 1u64 << cluster_bits;
    let disk_size = be64(&h, 24);
    let autoclear = be64(&h, 88);
    let header_len = u64::from(be32(&h, 100));
    // The extension area: the rest of the first cluster.
    let area_len = cluster.min(file_len);
    if header_len < 104 || header_len >= area_len {
        return Ok(None);
    }
    let mut area = vec![0u8; area_len as usize];
    read(&mut area, 0).map_err(|e| format!("reading the header: {e}"))?;
    let mut at = header_len as usize;
    let mut ext = None;
    while at + 8 <= area.len() {
        let (kind, len) = (be32(&area, at), be32(&area, at + 4) as usize);
        if kind == 0 {
            break;
        }
        let data = at + 8;
        if len > area.len() - data {
            return Ok(None);
        }
        if kind == EXT_MAGIC {
            if ext.is_some() {
                return Err("two bitmaps extensions".into());
            }
            ext = Some((data, len));
        }
        at = data + len.next_multiple_of(8);
    }
    let Some((data, len)) = ext else {
        return Ok(None);
    };
    if autoclear & AUTOCLEAR_BITMAPS == 0 {
        // Stale: QEMU ignores it (its clusters are leaks).
        return Ok(None);
    }
    if len != 24 {
        return Err(format!("extension length {len}, not 24"));
    }
    let e = &area[data..data + 24];
    let (nb, reserved, dir_size, dir_offset) = (be32(e, 0), be32(e, 4), be64(e, 8), be64(e, 16));
    if reserved != 0 {
        return Err("reserved field is not zero".into());
    }
    if nb == 0 || nb > MAX_BITMAPS {
        return Err(format!("{nb} bitmaps (1 to {MAX_BITMAPS} allowed)"));
    }
    if dir_size > MAX_DIRECTORY_SIZE || dir_size < ENTRY_HEADER as u64 * u64::from(nb) {
        return Err(format!(
            "directory size {dir_size} out of range for {nb} bitmaps"
        ));
    }
    check_range("directory", dir_offset, dir_size, cluster, file_len)?;
    let mut raw = vec![0u8; dir_size as usize];
    read(&mut raw, dir_offset).map_err(|e| format!("reading the directory: {e}"))?;
    let entries = parse_directory(&raw, nb, cluster, disk_size, file_len)?;
    let memory: u128 = entries
        .iter()
        .map(|e| u128::from(disk_size.div_ceil(1 << e.granularity_bits).div_ceil(8)))
        .sum();
    if memory > u128::from(MAX_LOADED) {
        return Err(format!(
            "its {nb} bitmaps need {memory} bytes of memory, more than {MAX_LOADED}"
        ));
    }
    // The directory must not share a cluster with the header or a table.
    let dir_clusters = dir_offset / cluster..(dir_offset + dir_size).div_ceil(cluster);
    for e in &entries {
        let table_len = u64::from(e.table_size) * 8;
        let t = e.table_offset / cluster..(e.table_offset + table_len).div_ceil(cluster);
        if t.start < dir_clusters.end && dir_clusters.start < t.end {
            return Err(format!(
                "bitmap '{}': its table overlaps the directory",
                e.name
            ));
        }
    }
    Ok(Some(Bitmaps {
        directory_offset: dir_offset,
        entries,
        raw,
        autoclear,
        cluster,
        disk_size,
        file_len,
        ext_at: data as u64,
    }))
}

/// The entries of a directory of `nb` bitmaps, each checked as QEMU's
/// `check_dir_entry` does; they must fill it exactly.
fn parse_directory(
    raw: &[u8],
    nb: u32,
    cluster: u64,
    disk_size: u64,
    file_len: u64,
) -> Result<Vec<Entry>, String> {
    let mut entries: Vec<Entry> = Vec::new();
    let mut pos = 0usize;
    for i in 0..nb {
        if raw.len() - pos < ENTRY_HEADER {
            return Err(format!("entry {i} runs past the directory"));
        }
        let e = &raw[pos..];
        let table_offset = be64(e, 0);
        let table_size = be32(e, 8);
        let flags = be32(e, 12);
        let (kind, granularity_bits) = (e[16], e[17]);
        let name_size = usize::from(be16(e, 18));
        let extra = be32(e, 20) as usize;
        let size = ENTRY_HEADER
            .checked_add(extra)
            .and_then(|s| s.checked_add(name_size))
            .map(|s| s.next_multiple_of(8))
            .filter(|&s| s <= raw.len() - pos)
            .ok_or_else(|| format!("entry {i} runs past the directory"))?;
        let name_at = ENTRY_HEADER + extra;
        let name = std::str::from_utf8(&e[name_at..name_at + name_size])
            .map_err(|_| format!("entry {i}: the name is not UTF-8"))?
            .to_string();
        let what = format!("bitmap '{}'", name.escape_debug());
        if name_size == 0 || name_size > MAX_NAME_SIZE {
            return Err(format!("{what}: name length {name_size}"));
        }
        if kind != TYPE_DIRTY_TRACKING {
            return Err(format!("{what}: type {kind} (only 1, dirty tracking)"));
        }
        if !(MIN_GRANULARITY_BITS..=MAX_GRANULARITY_BITS).contains(&granularity_bits) {
            return Err(format!("{what}: granularity 2^{granularity_bits}"));
        }
        if flags & RESERVED_FLAGS != 0 {
            return Err(format!("{what}: reserved flags {flags:#x}"));
        }
        if table_size == 0 || table_size > MAX_TABLE_SIZE {
            return Err(format!("{what}: table size {table_size}"));
        }
        let phys = u64::from(table_size) * cluster;
        if phys > MAX_PHYS_SIZE {
            return Err(format!("{what}: {phys} bytes of bits"));
        }
        // A bitmap QEMU trusts must cover the disk (one that was not
        // written back after a resize may not: it is in use anyway).
        if flags & FLAG_IN_USE == 0
            && u128::from(disk_size) > (u128::from(phys) * 8) << granularity_bits
        {
            return Err(format!("{what}: its table is too small for the disk"));
        }
        check_range(
            &format!("{what}: table"),
            table_offset,
            u64::from(table_size) * 8,
            cluster,
            file_len,
        )?;
        if entries.iter().any(|o| o.name == name) {
            return Err(format!("{what} is in the directory twice"));
        }
        entries.push(Entry {
            name,
            granularity_bits,
            flags,
            table_offset,
            table_size,
            pos,
        });
        pos += size;
    }
    if pos != raw.len() {
        return Err(format!(
            "the directory is {} bytes, its {nb} entries {pos}",
            raw.len()
        ));
    }
    Ok(entries)
}

impl Bitmaps {
    /// Reads the bitmaps of the qcow2 file `file`.
    pub fn load(file: &File) -> Result<Option<Bitmaps>, String> {
        let len = file.metadata().map_err(|e| e.to_string())?.len();
        parse(&mut |buf, off| file.read_exact_at(buf, off), len)
    }

    /// The length in bytes of bitmap `i`'s bits, whole words: what
    /// [`read_words`](Self::read_words) allocates.
    pub fn bits_len(&self, i: usize) -> u64 {
        let bits = self
            .disk_size
            .div_ceil(1 << self.entries[i].granularity_bits);
        bits.div_ceil(64) * 8
    }

    /// The bits of bitmap `i` of the directory, as words in the order
    /// [`crate::bitmap`]'s `DirtyBitmap::from_words` takes them (bit `n`
    /// of the bitmap is bit `n % 64` of word `n / 64`: bit `n % 8` of
    /// byte `n / 8`, qcow2's order), one bit per granule of the disk.
    /// `read(buf, offset)` reads the file. A bitmap in use has no bits to
    /// trust and is an error, as is a table entry QEMU would refuse
    /// (reserved bits, an unaligned cluster, a cluster past the end of
    /// the file). Allocates at most the bitmap's own size (bounded by
    /// [`MAX_PHYS_SIZE`] at parse time).
    pub fn read_words(
        &self,
        i: usize,
        read: &mut dyn FnMut(&mut [u8], u64) -> io::Result<()>,
    ) -> Result<Vec<u64>, String> {
        let e = &self.entries[i];
        let what = format!("bitmap '{}'", e.name.escape_debug());
        if e.in_use() {
            return Err(format!("{what} is in use (inconsistent)"));
        }
        let bytes = self.bits_len(i);
        // Checked at parse time: the table covers the disk, and the
        // table's data is at most MAX_PHYS_SIZE.
        let clusters = bytes.div_ceil(self.cluster);
        if clusters > u64::from(e.table_size) || bytes > MAX_PHYS_SIZE {
            return Err(format!("{what}: its table is too small for the disk"));
        }
        let mut table = vec![0u8; clusters as usize * 8];
        read(&mut table, e.table_offset)
            .map_err(|err| format!("{what}: reading its table: {err}"))?;
        let mut data = vec![0u8; bytes as usize];
        for (k, chunk) in data.chunks_mut(self.cluster as usize).enumerate() {
            let entry = be64(&table, k * 8);
            if entry & TABLE_RESERVED != 0 {
                return Err(format!("{what}: table entry {k} has reserved bits set"));
            }
            let offset = entry & TABLE_OFFSET;
            if offset == 0 {
                if entry & TABLE_ALL_ONES != 0 {
                    chunk.fill(0xff);
                }
                continue;
            }
            if entry & TABLE_ALL_ONES != 0 {
                return Err(format!(
                    "{what}: table entry {k} is all ones and has a cluster"
                ));
            }
            check_range(
                &format!("{what}: data"),
                offset,
                self.cluster,
                self.cluster,
                self.file_len,
            )?;
            read(chunk, offset).map_err(|err| format!("{what}: reading its data: {err}"))?;
        }
        Ok(data
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .collect())
    }

    /// Every bitmap, its bits read where they can be trusted. At most
    /// [`MAX_LOADED`] bytes of bits in all: past it a bitmap comes back
    /// as an error (inconsistent), so that an image claiming 65535 large
    /// bitmaps cannot make the daemon allocate without bound.
    pub fn load_all(&self, file: &File) -> Vec<Loaded> {
        let mut read = |buf: &mut [u8], off: u64| file.read_exact_at(buf, off);
        let mut budget = MAX_LOADED;
        self.entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let len = if e.in_use() { 0 } else { self.bits_len(i) };
                let words = match budget.checked_sub(len) {
                    Some(left) => {
                        budget = left;
                        self.read_words(i, &mut read)
                    }
                    None => Err(format!(
                        "bitmap '{}': the image's bitmaps hold more than {MAX_LOADED} bytes of bits",
                        e.name.escape_debug()
                    )),
                };
                Loaded {
                    name: e.name.clone(),
                    granularity_bits: e.granularity_bits,
                    auto: e.flags & FLAG_AUTO != 0,
                    words,
                }
            })
            .collect()
    }

    /// Whether `other` is the same directory, byte for byte, at the same
    /// place: nobody wrote the bitmaps in between.
    pub fn same_directory(&self, other: &Bitmaps) -> bool {
        self.directory_offset == other.directory_offset && self.raw == other.raw
    }

    /// The clusters of `cluster_size` bytes the directory occupies.
    pub fn directory_clusters(&self, cluster_size: u64) -> std::ops::Range<u64> {
        let end = self.directory_offset + self.raw.len() as u64;
        self.directory_offset / cluster_size..end.div_ceil(cluster_size)
    }

    /// Marks every bitmap in use and the extension valid again, durably,
    /// in that order (module docs). Called once imago has opened the image
    /// writable (and cleared the autoclear bits) and before any guest
    /// write is served; nothing else writes the file meanwhile.
    pub fn mark_in_use(&mut self, file: &File) -> io::Result<()> {
        for e in &mut self.entries {
            e.flags |= FLAG_IN_USE;
            self.raw[e.pos + 12..e.pos + 16].copy_from_slice(&e.flags.to_be_bytes());
        }
        file.write_all_at(&self.raw, self.directory_offset)?;
        file.sync_data()?;
        // Only the bitmaps bit, and the L2 log's mark as the file has it
        // now (ringblk's own: it says the log's entries still apply;
        // `l2log`): imago knows no other autoclear feature, and what it
        // cleared stays cleared.
        let mut now = [0u8; 8];
        file.read_exact_at(&mut now, AUTOCLEAR_OFFSET)?;
        let autoclear =
            (self.autoclear & AUTOCLEAR_BITMAPS) | (u64::from_be_bytes(now) & super::l2log::MARK);
        file.write_all_at(&autoclear.to_be_bytes(), AUTOCLEAR_OFFSET)?;
        file.sync_data()
    }
}

/// What imago must keep reading of a writable top's header, whatever
/// the file has (`FileState::show_imago`), taken from the file as imago
/// found it: the backing file name's offset and size (adding or removing
/// the bitmaps extension moves the name), the autoclear field as zero
/// (imago clears it at open; the file has the bitmaps bit), and the rest
/// of the first cluster after the fixed header (the extensions and the
/// backing file name). imago refuses a reread header whose extensions,
/// backing file name or autoclear bits changed. Empty for a header that
/// is not a version 3 one imago could have opened.
pub fn header_view(file: &File) -> io::Result<Vec<(u64, Vec<u8>)>> {
    let file_len = file.metadata()?.len();
    let mut h = [0u8; 104];
    if file_len < h.len() as u64 {
        return Ok(Vec::new());
    }
    file.read_exact_at(&mut h, 0)?;
    let cluster_bits = be32(&h, 20);
    if be32(&h, 4) < 3 || !(9..=21).contains(&cluster_bits) {
        return Ok(Vec::new());
    }
    let area_len = (1u64 << cluster_bits).min(file_len);
    let header_len = u64::from(be32(&h, 100));
    if header_len < 104 || header_len >= area_len {
        return Ok(Vec::new());
    }
    let mut rest = vec![0u8; (area_len - header_len) as usize];
    file.read_exact_at(&mut rest, header_len)?;
    Ok(vec![
        (8, h[8..20].to_vec()),
        (AUTOCLEAR_OFFSET, vec![0; 8]),
        (header_len, rest),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: u64 = 65536;

    /// A v3 image of `size` bytes, 64 KiB clusters, with a bitmaps
    /// extension pointing at `dir` (at cluster 3) and tables at cluster 4 on.
    fn image(size: u64, autoclear: u64, ext: &[u8], dir: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; 8 * C as usize];
        f[0..4].copy_from_slice(b"QFI\xfb");
        f[4..8].copy_from_slice(&3u32.to_be_bytes());
        f[20..24].copy_from_slice(&16u32.to_be_bytes());
        f[24..32].copy_from_slice(&size.to_be_bytes());
        f[88..96].copy_from_slice(&autoclear.to_be_bytes());
        f[100..104].copy_from_slice(&112u32.to_be_bytes());
        f[112..116].copy_from_slice(&EXT_MAGIC.to_be_bytes());
        f[116..120].copy_from_slice(&(ext.len() as u32).to_be_bytes());
        f[120..120 + ext.len()].copy_from_slice(ext);
        f[3 * C as usize..3 * C as usize + dir.len()].copy_from_slice(dir);
        f
    }

    fn ext(nb: u32, dir_size: u64, dir_offset: u64) -> Vec<u8> {
        let mut e = Vec::new();
        e.extend(nb.to_be_bytes());
        e.extend(0u32.to_be_bytes());
        e.extend(dir_size.to_be_bytes());
        e.extend(dir_offset.to_be_bytes());
        e
    }

    fn entry(name: &str, table: u64, flags: u32, gbits: u8) -> Vec<u8> {
        let mut e = Vec::new();
        e.extend(table.to_be_bytes());
        e.extend(1u32.to_be_bytes());
        e.extend(flags.to_be_bytes());
        e.push(1);
        e.push(gbits);
        e.extend((name.len() as u16).to_be_bytes());
        e.extend(0u32.to_be_bytes());
        e.extend(name.as_bytes());
        e.resize(e.len().next_multiple_of(8), 0);
        e
    }

    fn run(f: &[u8]) -> Result<Option<Bitmaps>, String> {
        parse(
            &mut |buf, off| {
                let s = usize::try_from(off).unwrap();
                buf.copy_from_slice(&f[s..s + buf.len()]);
                Ok(())
            },
            f.len() as u64,
        )
    }

    #[test]
    fn reads_a_good_directory() {
        let mut dir = entry("a", 4 * C, FLAG_AUTO, 16);
        dir.extend(entry("bee", 5 * C, FLAG_IN_USE, 9));
        let f = image(1 << 20, 1, &ext(2, dir.len() as u64, 3 * C), &dir);
        let b = run(&f).unwrap().unwrap();
        let names: Vec<_> = b
            .entries
            .iter()
            .map(|e| (e.name.as_str(), e.in_use()))
            .collect();
        assert_eq!(names, [("a", false), ("bee", true)]);
        // Autoclear clear: stale, ignored as QEMU does.
        let f = image(1 << 20, 0, &ext(2, dir.len() as u64, 3 * C), &dir);
        assert!(run(&f).unwrap().is_none());
    }

    /// Bits through the table: a data cluster, an all-ones entry, an
    /// empty one; bad entries refused.
    #[test]
    fn reads_bits_through_the_table() {
        // 512 B granules of a 2^25-byte disk: 2^16 bits, 8 KiB, one
        // cluster. 2^30 bytes: 2^21 bits, 256 KiB, four clusters.
        let size = 1u64 << 30;
        let d = {
            let mut e = entry("a", 4 * C, 0, 9);
            e[8..12].copy_from_slice(&4u32.to_be_bytes());
            e
        };
        let mut f = image(size, 1, &ext(1, d.len() as u64, 3 * C), &d);
        let table = 4 * C as usize;
        f[table..table + 8].copy_from_slice(&(5 * C).to_be_bytes());
        f[table + 8..table + 16].copy_from_slice(&1u64.to_be_bytes());
        f[5 * C as usize] = 0b1000_0001; // granules 0 and 7
        let words = |f: &[u8]| {
            let b = run(f).unwrap().unwrap();
            b.read_words(0, &mut |buf, off| {
                let s = off as usize;
                buf.copy_from_slice(&f[s..s + buf.len()]);
                Ok(())
            })
        };
        let w = words(&f).unwrap();
        assert_eq!(w.len(), (1 << 21) / 64);
        assert_eq!(w[0], 0x81);
        assert!(w[1..1024].iter().all(|&x| x == 0));
        assert!(w[8192..16384].iter().all(|&x| x == u64::MAX), "all ones");
        assert!(w[16384..].iter().all(|&x| x == 0));
        for (bad, want) in [
            ((5 * C) | (1 << 60), "reserved"),
            ((5 * C) | 2, "reserved"),
            ((5 * C) | 1, "all ones and has a cluster"),
            (5 * C + 512, "cluster boundary"),
            (100 * C, "past the end"),
        ] {
            let mut g = f.clone();
            g[table..table + 8].copy_from_slice(&bad.to_be_bytes());
            let err = words(&g).unwrap_err();
            assert!(err.contains(want), "{bad:#x}: {err}");
        }
    }

    #[test]
    fn refuses_bad_extensions_in_one_line() {
        let good = entry("a", 4 * C, 0, 16);
        let n = good.len() as u64;
        let cases: Vec<(Vec<u8>, Vec<u8>, &str)> = vec![
            (ext(0, n, 3 * C), good.clone(), "0 bitmaps"),
            (ext(65536, n, 3 * C), good.clone(), "65536 bitmaps"),
            (
                ext(1, MAX_DIRECTORY_SIZE + 8, 3 * C),
                good.clone(),
                "directory size",
            ),
            (ext(1, n, 3 * C + 8), good.clone(), "not a cluster boundary"),
            (ext(1, n, 100 * C), good.clone(), "past the end"),
            (ext(1, n, u64::MAX - 65535), good.clone(), "past the end"),
            (ext(2, n, 3 * C), good.clone(), "out of range for 2 bitmaps"),
            (ext(1, n + 8, 3 * C), good.clone(), "its 1 entries"),
            (
                ext(1, n, 3 * C),
                entry("a", 3 * C, 0, 16),
                "overlaps the directory",
            ),
            (
                ext(1, n, 3 * C),
                entry("a", 4 * C, 1 << 7, 16),
                "reserved flags",
            ),
            (ext(1, n, 3 * C), entry("a", 4 * C, 0, 8), "granularity"),
            (
                ext(1, n, 3 * C),
                entry("a", 4 * C + 1, 0, 16),
                "cluster boundary",
            ),
            (ext(1, n, 3 * C), entry("a", 90 * C, 0, 16), "past the end"),
            (ext(1, n, 3 * C), entry("", 4 * C, 0, 16), "name length 0"),
        ];
        for (e, d, want) in cases {
            let f = image(1 << 20, 1, &e, &d);
            let err = run(&f).unwrap_err();
            assert!(err.contains(want) && !err.contains('\n'), "{want}: {err}");
        }
        // A table too small for the disk is refused unless in use.
        let d = entry("a", 4 * C, 0, 9); // 1 cluster of bits = 2^19 granules of 512 B
        let f = image(1 << 40, 1, &ext(1, d.len() as u64, 3 * C), &d);
        assert!(run(&f).unwrap_err().contains("too small"));
        let d = entry("a", 4 * C, FLAG_IN_USE, 9);
        let f = image(1 << 40, 1, &ext(1, d.len() as u64, 3 * C), &d);
        assert!(run(&f).unwrap().is_some());
        // Too much memory in all: 2^40 bytes at 512 B granules are 256 MiB
        // of bits per bitmap; five of them.
        let mut d = Vec::new();
        for n in ["a", "b", "c", "d", "e"] {
            let mut e = entry(n, 4 * C, FLAG_IN_USE, 9);
            e[8..12].copy_from_slice(&1u32.to_be_bytes());
            d.extend(e);
        }
        let f = image(1 << 40, 1, &ext(5, d.len() as u64, 3 * C), &d);
        assert!(run(&f).unwrap_err().contains("bytes of memory"));
        // A name length past the directory.
        let mut d = entry("a", 4 * C, 0, 16);
        d[18..20].copy_from_slice(&1000u16.to_be_bytes());
        let f = image(1 << 20, 1, &ext(1, d.len() as u64, 3 * C), &d);
        assert!(run(&f).unwrap_err().contains("runs past"));
        // A truncated file: imago's to refuse.
        assert!(run(&[0u8; 50]).unwrap().is_none());
    }
}
