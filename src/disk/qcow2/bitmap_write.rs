//! Writing QEMU's persistent bitmaps back into a qcow2 image at a clean
//! close, as QEMU's block/qcow2-bitmap.c `qcow2_store_persistent_dirty_bitmaps`
//! does: new data clusters, tables and directory, then the header's
//! extension pointed at them, then the old ones freed.
//!
//! It must run while nothing else uses the file's refcounts: no imago
//! instance open on it, or one flushed and about to drop its caches
//! (`Qcow2Image::invalidate`, where the format layer calls it).
//!
//! An image without the extension gets it with its first bitmaps, and
//! one whose last bitmap goes loses it (QEMU allows no empty directory):
//! the header cluster is rewritten as QEMU's `qcow2_update_header` lays
//! it out (fixed header, extensions, end marker, backing file name), the
//! new bytes in one write at offset 0, refused before anything is
//! written if they do not fit in the cluster. That write replaces step 3
//! below; for a removal steps 1 and 2 are empty. As in QEMU, the header
//! write is the one step that relies on the device writing it whole (the
//! extensions and name of a QEMU image end within its first 4 KiB
//! block). The backing file name moves; the format layer makes imago's
//! header writes carry its new place (`FileState::patch_imago_writes`).
//!
//! The file must be one the format layer opened and checked (its refcount
//! table covering the file, no refblock overlapping other metadata:
//! `FileState::load_shadow`); the refcounts are trusted as QEMU trusts
//! them.
//!
//! The order, each step fdatasynced before the next, so that a crash
//! anywhere leaks clusters at worst (`qemu-img check` counts leaks, never
//! calls them corruption) and never leaves a bitmap QEMU trusts wrongly:
//! 1. the new clusters are allocated past the end of the file: their
//!    refcounts raised (in new refblocks where the refcount table has
//!    none for them; all written before any of them is referenced), the
//!    data, tables and directory written; where the table has no entry
//!    for a new refblock, a larger table after the refblocks (covered by
//!    them), holding the old entries and the new ones;
//! 2. the refcount table's entries for new refblocks, or the header's
//!    refcount table offset and size pointed at the larger table (12
//!    bytes, one write);
//! 3. the extension's 24 bytes point at the new directory (entries with
//!    IN_USE clear unless the bitmap is inconsistent) and the autoclear
//!    bit 0 is set (or the header rewritten with the extension added or
//!    removed, the bit set or cleared);
//! 4. the refcounts of the old directory, tables and data clusters (and
//!    of a refcount table that was replaced) are dropped.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use super::bitmaps::{
    AUTOCLEAR_BITMAPS, AUTOCLEAR_OFFSET, Bitmaps, EXT_MAGIC, FLAG_AUTO, FLAG_IN_USE,
    TABLE_ALL_ONES, TABLE_OFFSET, be32, be64,
};

/// One operation of [`store`] on the file, as a [`Recorder`] keeps it.
#[derive(Clone, Debug)]
pub enum Op {
    Write { offset: u64, data: Vec<u8> },
    SetLen(u64),
    Sync,
}

/// Records every write, truncation and fdatasync [`store`] makes (tests:
/// they rebuild the file as a crash could have left it).
#[derive(Default, Debug)]
pub struct Recorder {
    pub ops: std::sync::Mutex<Vec<Op>>,
}

/// The file as `store` uses it: reads and writes through it, each change
/// also recorded when a recorder is given.
struct Disk<'a> {
    file: &'a File,
    rec: Option<&'a Recorder>,
}

impl Disk<'_> {
    fn note(&self, op: Op) {
        if let Some(r) = self.rec {
            r.ops.lock().unwrap_or_else(|p| p.into_inner()).push(op);
        }
    }

    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(data, offset)?;
        self.note(Op::Write {
            offset,
            data: data.to_vec(),
        });
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)?;
        self.note(Op::SetLen(len));
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()?;
        self.note(Op::Sync);
        Ok(())
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    fn metadata(&self) -> io::Result<std::fs::Metadata> {
        self.file.metadata()
    }
}

/// One bitmap to store.
#[derive(Clone, Debug)]
pub struct Stored {
    pub name: String,
    pub granularity_bits: u8,
    /// QEMU's AUTO flag: QEMU keeps it enabled when it opens the image.
    pub auto: bool,
    /// False: stored with IN_USE set, as QEMU stores an inconsistent one.
    pub consistent: bool,
    /// The bits, in `DirtyBitmap::words` order, for the image's disk size.
    pub words: Vec<u64>,
}

fn invalid(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.into())
}

/// The largest refcount table a write-back makes (QEMU's
/// `QCOW_MAX_REFTABLE_SIZE`, 8 MiB).
const MAX_REFCOUNT_TABLE: u64 = 8 << 20;

/// The refcount structure of the file, as its header says.
#[derive(Clone)]
struct Refcounts {
    cluster: u64,
    order: u32,
    table_offset: u64,
    table: Vec<u64>,
}

impl Refcounts {
    fn load(file: &Disk<'_>, cluster: u64) -> io::Result<Refcounts> {
        let mut h = [0u8; 104];
        file.read_exact_at(&mut h, 0)?;
        let table_offset = be64(&h, 48);
        let clusters = u64::from(be32(&h, 56));
        let order = be32(&h, 96);
        if order > 6 {
            return Err(invalid(format!("refcount order {order}")));
        }
        // The table is bounded by imago's and QEMU's checks at open; and
        // here by what a Vec of it costs (8 MiB for 1 TiB files at 64 KiB).
        let len = clusters
            .checked_mul(cluster)
            .filter(|&l| l <= 64 << 20)
            .ok_or_else(|| invalid("refcount table too large"))?;
        let mut raw = vec![0u8; len as usize];
        file.read_exact_at(&mut raw, table_offset)?;
        Ok(Refcounts {
            cluster,
            order,
            table_offset,
            table: raw.chunks_exact(8).map(|e| be64(e, 0)).collect(),
        })
    }

    /// Clusters the table takes.
    fn table_clusters(&self) -> u64 {
        (self.table.len() as u64 * 8).div_ceil(self.cluster)
    }

    /// Clusters one refblock covers.
    fn per_block(&self) -> u64 {
        (self.cluster * 8) >> self.order
    }

    /// Where refcount `index` of a refblock lies: byte, and for widths
    /// under 8 bits the shift in it (QEMU: LSB first).
    fn get(&self, block: &[u8], index: u64) -> u64 {
        let bits = 1u64 << self.order;
        if bits < 8 {
            let bit = index * bits;
            (u64::from(block[(bit / 8) as usize]) >> (bit % 8)) & ((1 << bits) - 1)
        } else {
            let w = (bits / 8) as usize;
            let at = index as usize * w;
            block[at..at + w]
                .iter()
                .fold(0u64, |v, &b| (v << 8) | u64::from(b))
        }
    }

    fn set(&self, block: &mut [u8], index: u64, value: u64) {
        let bits = 1u64 << self.order;
        if bits < 8 {
            let bit = index * bits;
            let mask = ((1u64 << bits) - 1) as u8;
            let b = &mut block[(bit / 8) as usize];
            *b = (*b & !(mask << (bit % 8))) | (((value as u8) & mask) << (bit % 8));
        } else {
            let w = (bits / 8) as usize;
            let at = index as usize * w;
            block[at..at + w].copy_from_slice(&value.to_be_bytes()[8 - w..]);
        }
    }

    fn max(&self) -> u64 {
        if self.order == 6 {
            u64::MAX
        } else {
            (1u64 << (1u64 << self.order)) - 1
        }
    }
}

/// The bytes of one directory entry.
fn entry_bytes(table_offset: u64, table_size: u32, flags: u32, s: &Stored) -> Vec<u8> {
    let mut e = Vec::with_capacity(24 + s.name.len() + 7);
    e.extend(table_offset.to_be_bytes());
    e.extend(table_size.to_be_bytes());
    e.extend(flags.to_be_bytes());
    e.push(1);
    e.push(s.granularity_bits);
    e.extend((s.name.len() as u16).to_be_bytes());
    e.extend(0u32.to_be_bytes());
    e.extend(s.name.as_bytes());
    e.resize(e.len().next_multiple_of(8), 0);
    e
}

/// Writes `new` as the image's bitmaps in place of those `old` describes
/// (module docs). `file` must be the image `old` was parsed from (`None`:
/// it has no valid bitmaps extension), of `cluster`-byte clusters, with
/// nothing else writing it meanwhile. Returns where the backing file name
/// is now when the header was rewritten (an extension added or removed),
/// if the image has one.
///
/// `is_metadata(cluster)` says which clusters hold the image's own
/// metadata (header, L1, L2, refcount table, refblocks): an old bitmap
/// table or data cluster claimed to be there (a hostile image) is never
/// freed.
pub fn store(
    file: &File,
    cluster: u64,
    old: Option<&Bitmaps>,
    new: &[Stored],
    is_metadata: &dyn Fn(u64) -> bool,
) -> io::Result<Option<u64>> {
    store_recorded(file, cluster, old, new, is_metadata, None)
}

/// [`store`], each change recorded in `rec` (tests).
pub fn store_recorded(
    file: &File,
    cluster: u64,
    old: Option<&Bitmaps>,
    new: &[Stored],
    is_metadata: &dyn Fn(u64) -> bool,
    rec: Option<&Recorder>,
) -> io::Result<Option<u64>> {
    let file = &Disk { file, rec };
    let c = cluster;
    if old.is_some_and(|o| o.cluster != c) {
        return Err(invalid("the bitmaps' cluster size is not the image's"));
    }
    let mut rc = Refcounts::load(file, c)?;
    if new.is_empty() {
        // The last bitmap removed: the extension goes (QEMU allows no
        // empty directory), then its clusters are freed.
        let Some(old) = old else {
            return Ok(None);
        };
        file.sync_data()?;
        let moved = rewrite_header(file, c, None)?;
        file.sync_data()?;
        free_old(file, old, &rc, is_metadata)?;
        return Ok(moved);
    }
    let file_len = file.metadata()?.len();
    let start = file_len.div_ceil(c);

    // Lay out the new clusters: per bitmap its non-zero data clusters and
    // its table, then the directory.
    struct Layout {
        data: Vec<(u64, Vec<u8>)>,
        tables: Vec<(u64, Vec<u8>)>,
        directory: Vec<u8>,
    }
    let mut next = start;
    let mut alloc = |n: u64| {
        let at = next;
        next += n;
        at
    };
    let mut layout = Layout {
        data: Vec::new(),
        tables: Vec::new(),
        directory: Vec::new(),
    };
    for s in new {
        let bytes: Vec<u8> = s.words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut table = Vec::new();
        for chunk in bytes.chunks(c as usize) {
            let entry = if chunk.iter().all(|&b| b == 0) {
                0
            } else if chunk.len() == c as usize && chunk.iter().all(|&b| b == 0xff) {
                TABLE_ALL_ONES
            } else {
                let at = alloc(1) * c;
                let mut data = chunk.to_vec();
                data.resize(c as usize, 0);
                layout.data.push((at, data));
                at
            };
            table.extend(entry.to_be_bytes());
        }
        let table_size = u32::try_from(table.len() / 8)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| invalid(format!("bitmap '{}': bad size", s.name)))?;
        let table_clusters = (table.len() as u64).div_ceil(c);
        let table_at = alloc(table_clusters) * c;
        table.resize((table_clusters * c) as usize, 0);
        let mut flags = if s.auto { FLAG_AUTO } else { 0 };
        if !s.consistent {
            flags |= FLAG_IN_USE;
        }
        layout
            .directory
            .extend(entry_bytes(table_at, table_size, flags, s));
        layout.tables.push((table_at, table));
    }
    let dir_size = layout.directory.len() as u64;
    let dir_at = alloc(dir_size.div_ceil(c)) * c;
    let used_end = next;

    // Refblocks for clusters the refcount table has none for: placed after
    // the rest, covering themselves too; and, when the table has no entry
    // for one of them, a larger table after them (as QEMU's
    // `qcow2_refcount_area` places one), covered too.
    let per = rc.per_block();
    let mut new_blocks: Vec<(usize, u64)> = Vec::new(); // (table index, cluster)
    let mut new_table_clusters = 0u64;
    loop {
        let end = used_end + new_blocks.len() as u64 + new_table_clusters;
        let entries = end.div_ceil(per);
        let missing: Vec<usize> = (start / per..entries)
            .map(|i| i as usize)
            .filter(|&i| rc.table.get(i).is_none_or(|&e| e & TABLE_OFFSET == 0))
            .collect();
        // Twice the entries needed (within QEMU's bound), so that the
        // allocations after this one do not have to grow it again at once.
        let table_clusters = if entries > rc.table.len() as u64 {
            let bytes = (entries * 2 * 8).min(MAX_REFCOUNT_TABLE).max(entries * 8);
            bytes.div_ceil(c).max(new_table_clusters)
        } else {
            0
        };
        if missing.len() == new_blocks.len() && table_clusters == new_table_clusters {
            break;
        }
        new_blocks = missing
            .iter()
            .enumerate()
            .map(|(k, &i)| (i, used_end + k as u64))
            .collect();
        new_table_clusters = table_clusters;
    }
    let table_at = used_end + new_blocks.len() as u64;
    let end = table_at + new_table_clusters;
    if new_table_clusters > 0 {
        let bytes = new_table_clusters * c;
        if bytes > MAX_REFCOUNT_TABLE || u32::try_from(new_table_clusters).is_err() {
            return Err(invalid(format!(
                "the refcount table would grow to {bytes} bytes, past {MAX_REFCOUNT_TABLE}"
            )));
        }
    }

    // Step 1: refcounts of [start, end) to 1, then the contents.
    let mut blocks: std::collections::BTreeMap<usize, (u64, Vec<u8>)> = Default::default();
    for &(i, cl) in &new_blocks {
        blocks.insert(i, (cl * c, vec![0u8; c as usize]));
    }
    for cl in start..end {
        let i = (cl / per) as usize;
        let (_, b) = match blocks.entry(i) {
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                let at = rc.table[i] & TABLE_OFFSET;
                let mut b = vec![0u8; c as usize];
                file.read_exact_at(&mut b, at)?;
                v.insert((at, b))
            }
        };
        if rc.get(b, cl % per) != 0 {
            return Err(invalid(format!(
                "cluster {cl} past the end of the file has a refcount"
            )));
        }
        rc.set(b, cl % per, 1);
    }
    // The file grows to its new end first, so that no write lands past a
    // hole the file system must fill.
    file.set_len(end * c)?;
    for (at, data) in layout.data.iter().chain(layout.tables.iter()) {
        file.write_all_at(data, *at)?;
    }
    file.write_all_at(&layout.directory, dir_at)?;
    for (at, b) in blocks.values() {
        file.write_all_at(b, *at)?;
    }
    // A larger refcount table: the old entries and the new refblocks'.
    // Nothing points at it yet.
    let grown = if new_table_clusters > 0 {
        let mut table = rc.table.clone();
        table.resize((new_table_clusters * c / 8) as usize, 0);
        for &(i, cl) in &new_blocks {
            table[i] = cl * c;
        }
        let raw: Vec<u8> = table.iter().flat_map(|e| e.to_be_bytes()).collect();
        file.write_all_at(&raw, table_at * c)?;
        Some(Refcounts {
            table_offset: table_at * c,
            table,
            ..rc.clone()
        })
    } else {
        None
    };
    file.sync_data()?;

    // Step 2: hook the new refblocks up: into the table, or the header
    // pointed at the larger table (its offset and size: 12 bytes of one
    // sector, one write).
    let old_table = match grown {
        Some(g) => {
            let mut h = Vec::with_capacity(12);
            h.extend(g.table_offset.to_be_bytes());
            h.extend((new_table_clusters as u32).to_be_bytes());
            file.write_all_at(&h, 48)?;
            file.sync_data()?;
            let old_table = rc.table_offset / c..(rc.table_offset / c + rc.table_clusters());
            rc = g;
            Some(old_table)
        }
        None => {
            if !new_blocks.is_empty() {
                for &(i, cl) in &new_blocks {
                    file.write_all_at(&(cl * c).to_be_bytes(), rc.table_offset + i as u64 * 8)?;
                }
                file.sync_data()?;
            }
            None
        }
    };

    // Step 3: the extension points at the new directory; valid.
    let mut ext = Vec::with_capacity(24);
    ext.extend((new.len() as u32).to_be_bytes());
    ext.extend(0u32.to_be_bytes());
    ext.extend(dir_size.to_be_bytes());
    ext.extend(dir_at.to_be_bytes());
    let Some(old) = old else {
        // The image's first bitmaps: the extension is added to the header.
        let moved = rewrite_header(file, c, Some(&ext))?;
        file.sync_data()?;
        if let Some(t) = old_table {
            free_clusters(file, &rc, t.collect())?;
        }
        return Ok(moved);
    };
    file.write_all_at(&ext, old.ext_at)?;
    let mut autoclear = [0u8; 8];
    file.read_exact_at(&mut autoclear, AUTOCLEAR_OFFSET)?;
    let autoclear = u64::from_be_bytes(autoclear) | AUTOCLEAR_BITMAPS;
    file.write_all_at(&autoclear.to_be_bytes(), AUTOCLEAR_OFFSET)?;
    file.sync_data()?;

    // Step 4: free the old clusters (a crash before this leaks them), the
    // old refcount table's too.
    free_old(file, old, &rc, is_metadata)?;
    if let Some(t) = old_table {
        free_clusters(file, &rc, t.collect())?;
    }
    Ok(None)
}

/// Rewrites the header cluster with the bitmaps extension `ext` (its 24
/// bytes) in place of any the header has, or with none (`None`), the
/// autoclear bit 0 set or cleared to match, as QEMU's
/// `qcow2_update_header` lays the cluster out: the fixed header, the
/// extensions, the end marker, the backing file name (moved to follow
/// them; QEMU reads extensions only up to the name). Everything is
/// checked against the cluster before anything is written; the new
/// bytes go in one write at offset 0, covering what the old layout used.
/// Returns the backing file name's new offset, if the image has one.
fn rewrite_header(file: &Disk<'_>, c: u64, ext: Option<&[u8]>) -> io::Result<Option<u64>> {
    let file_len = file.metadata()?.len();
    let area_len = c.min(file_len) as usize;
    if area_len < 104 {
        return Err(invalid("the header is cut short"));
    }
    let mut area = vec![0u8; area_len];
    file.read_exact_at(&mut area, 0)?;
    let header_len = be32(&area, 100) as usize;
    if header_len < 104 || header_len >= area_len {
        return Err(invalid(format!("header length {header_len}")));
    }
    let backing_at = be64(&area, 8);
    let backing_len = be32(&area, 16) as usize;
    let backing = if backing_at == 0 {
        None
    } else {
        let at = usize::try_from(backing_at)
            .ok()
            .filter(|&a| {
                a >= header_len && a.checked_add(backing_len).is_some_and(|e| e <= area_len)
            })
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::Unsupported,
                    "the backing file name lies outside the header cluster",
                )
            })?;
        Some(at)
    };
    // The extensions, as QEMU reads them: up to the backing file name.
    let ext_end = backing.unwrap_or(area_len);
    let mut kept: Vec<(u32, &[u8])> = Vec::new();
    let mut at = header_len;
    while at + 8 <= ext_end {
        let (kind, len) = (be32(&area, at), be32(&area, at + 4) as usize);
        if kind == 0 {
            break;
        }
        let data = at + 8;
        if len > ext_end - data {
            return Err(invalid(format!(
                "header extension {kind:#x} runs past the header"
            )));
        }
        if kind != EXT_MAGIC {
            kept.push((kind, &area[data..data + len]));
        }
        at = data + len.next_multiple_of(8);
    }
    let old_end = (at + 8)
        .max(backing.map_or(0, |b| b + backing_len))
        .min(area_len);

    let mut out = area[..header_len].to_vec();
    for (kind, data) in kept.iter().copied().chain(ext.map(|e| (EXT_MAGIC, e))) {
        out.extend(kind.to_be_bytes());
        out.extend((data.len() as u32).to_be_bytes());
        out.extend(data);
        out.resize(out.len().next_multiple_of(8), 0);
    }
    out.extend([0u8; 8]); // the end marker
    let moved = backing.map(|b| {
        let to = out.len() as u64;
        out.extend_from_slice(&area[b..b + backing_len]);
        to
    });
    if out.len() > c as usize {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the header extensions and backing file name would not fit in the header cluster",
        ));
    }
    if let Some(to) = moved {
        out[8..16].copy_from_slice(&to.to_be_bytes());
    }
    let autoclear = be64(&out, AUTOCLEAR_OFFSET as usize);
    let autoclear = if ext.is_some() {
        autoclear | AUTOCLEAR_BITMAPS
    } else {
        autoclear & !AUTOCLEAR_BITMAPS
    };
    out[AUTOCLEAR_OFFSET as usize..AUTOCLEAR_OFFSET as usize + 8]
        .copy_from_slice(&autoclear.to_be_bytes());
    // What the old layout used beyond the new one is zeroed.
    if out.len() < old_end {
        out.resize(old_end, 0);
    }
    file.write_all_at(&out, 0)?;
    Ok(moved)
}

/// Drops the refcounts of `old`'s directory, tables and data clusters.
/// What does not check out (a cluster past the end, a refcount already
/// zero) is left alone: a leak, never a double free.
fn free_old(
    file: &Disk<'_>,
    old: &Bitmaps,
    rc: &Refcounts,
    is_metadata: &dyn Fn(u64) -> bool,
) -> io::Result<()> {
    let c = old.cluster;
    let file_len = file.metadata()?.len();
    let mut clusters = Vec::new();
    let dir = old.directory_clusters(c);
    clusters.extend(dir);
    for e in &old.entries {
        let table_len = u64::from(e.table_size) * 8;
        let mut table = vec![0u8; table_len as usize];
        file.read_exact_at(&mut table, e.table_offset)?;
        clusters.extend(e.table_offset / c..(e.table_offset + table_len).div_ceil(c));
        for t in table.chunks_exact(8) {
            let off = be64(t, 0) & TABLE_OFFSET;
            if off != 0 && off.is_multiple_of(c) && off + c <= file_len {
                clusters.push(off / c);
            }
        }
    }
    clusters.sort_unstable();
    // A cluster named twice (a hostile table) is freed once; one of the
    // image's own metadata never.
    clusters.dedup();
    clusters.retain(|&cl| cl != 0 && !is_metadata(cl));
    free_clusters(file, rc, clusters)
}

/// Drops the refcount of each of `clusters` (sorted, each once) by one,
/// then fdatasyncs. One without a refblock, or whose refcount is zero (or
/// saturated), is left alone.
fn free_clusters(file: &Disk<'_>, rc: &Refcounts, clusters: Vec<u64>) -> io::Result<()> {
    let c = rc.cluster;
    let per = rc.per_block();
    let mut block: Option<(usize, u64, Vec<u8>)> = None;
    for cl in clusters {
        let i = (cl / per) as usize;
        if block.as_ref().is_none_or(|(bi, _, _)| *bi != i) {
            if let Some((_, at, b)) = block.take() {
                file.write_all_at(&b, at)?;
            }
            let Some(at) = rc
                .table
                .get(i)
                .map(|e| e & TABLE_OFFSET)
                .filter(|&a| a != 0)
            else {
                continue;
            };
            let mut b = vec![0u8; c as usize];
            file.read_exact_at(&mut b, at)?;
            block = Some((i, at, b));
        }
        let (_, _, b) = block.as_mut().expect("loaded");
        let v = rc.get(b, cl % per);
        if v > 0 && v < rc.max() {
            rc.set(b, cl % per, v - 1);
        }
    }
    if let Some((_, at, b)) = block {
        file.write_all_at(&b, at)?;
    }
    file.sync_data()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version 3 header of 512-byte clusters: `header_len`, a backing
    /// file name of `name_len` bytes at `name_at` (0: none), and
    /// `exts` (type, length) extensions after the header, each filled
    /// with its length's bytes.
    fn header(header_len: u32, exts: &[(u32, u32)], name_at: u64, name_len: u32) -> Vec<u8> {
        let mut h = vec![0u8; 512];
        h[..4].copy_from_slice(b"QFI\xfb");
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        h[8..16].copy_from_slice(&name_at.to_be_bytes());
        h[16..20].copy_from_slice(&name_len.to_be_bytes());
        h[20..24].copy_from_slice(&9u32.to_be_bytes());
        h[96..100].copy_from_slice(&4u32.to_be_bytes());
        h[100..104].copy_from_slice(&header_len.to_be_bytes());
        let mut at = header_len as usize;
        for &(kind, len) in exts {
            if at + 8 > h.len() {
                break;
            }
            h[at..at + 4].copy_from_slice(&kind.to_be_bytes());
            h[at + 4..at + 8].copy_from_slice(&len.to_be_bytes());
            at += 8 + (len as usize).next_multiple_of(8);
        }
        h
    }

    fn rewrite(bytes: &[u8], ext: Option<&[u8]>) -> (io::Result<Option<u64>>, Vec<u8>) {
        let f = tempfile::tempfile().unwrap();
        f.write_all_at(bytes, 0).unwrap();
        let disk = Disk {
            file: &f,
            rec: None,
        };
        let r = rewrite_header(&disk, 512, ext);
        let mut after = vec![0u8; bytes.len()];
        f.read_exact_at(&mut after, 0).unwrap();
        (r, after)
    }

    /// A header from elsewhere that does not hold together is refused
    /// before anything is written, never a panic: a header length past
    /// the cluster, a backing file name outside it, an extension running
    /// past the name, a result that would not fit in the cluster.
    #[test]
    fn a_bad_or_full_header_is_refused_unwritten() {
        let ext = [0u8; 24];
        let mut bad = Vec::new();
        bad.push(header(600, &[], 0, 0));
        bad.push(header(104, &[], 500, 100));
        bad.push(header(104, &[], u64::MAX - 4, 100));
        bad.push(header(104, &[(0x6803_f857, 200)], 200, 10));
        // 104 + 8 + 320 + 8 (end) + name 72 = 512: full; 32 bytes more
        // for the bitmaps extension do not fit.
        bad.push(header(104, &[(0x6803_f857, 320)], 440, 72));
        for (i, h) in bad.iter().enumerate() {
            let (r, after) = rewrite(h, Some(&ext));
            assert!(r.is_err(), "header {i} was rewritten");
            assert!(after == *h, "header {i} was written");
        }
    }

    /// The extension goes in after the others, the end marker after it,
    /// the backing file name after that (its offset updated), autoclear
    /// bit 0 set; removing it restores the layout and clears the bit.
    #[test]
    fn the_extension_is_added_and_removed_in_place() {
        let mut h = header(104, &[(0xe279_2aca, 6)], 128, 8);
        h[112..118].copy_from_slice(b"qcow2\0");
        h[128..136].copy_from_slice(b"base.img");
        let ext: Vec<u8> = (0..24).collect();
        let (r, added) = rewrite(&h, Some(&ext));
        assert_eq!(r.unwrap(), Some(160));
        assert_eq!(be64(&added, 8), 160);
        assert_eq!(&added[160..168], b"base.img");
        assert_eq!(be32(&added, 120), EXT_MAGIC);
        assert_eq!(be32(&added, 124), 24);
        assert_eq!(&added[128..152], &ext[..]);
        assert_eq!(&added[152..160], &[0u8; 8]);
        assert_eq!(be64(&added, 88) & AUTOCLEAR_BITMAPS, AUTOCLEAR_BITMAPS);
        let (r, removed) = rewrite(&added, None);
        assert_eq!(r.unwrap(), Some(128));
        assert!(removed[..136] == h[..136], "the layout is not the original");
        assert!(removed[136..].iter().all(|&b| b == 0));
    }
}
