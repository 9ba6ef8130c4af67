//! The files of a qcow2 chain as imago sees them ([`ChainFile`], an
//! `imago::Storage`), and the write ordering that makes the writable top
//! crash-consistent.
//!
//! imago orders its metadata *writes* the way QEMU does (refcount blocks
//! before the L2 tables that need them when allocating, the other way round
//! when freeing), but it never syncs between them, and it writes a new L1
//! entry, refcount-table entry or header field as soon as the table it
//! points to is written, while the refcount of that table is still in its
//! cache. A crash at the wrong instant then leaves an image that
//! `qemu-img check` finds corrupt. Every metadata write of imago passes
//! through [`ChainFile`], so the order is enforced here, where the writes
//! are seen, rather than in a fork of imago:
//!
//! - Each write is classified by where it lands, from a shadow of the
//!   on-disk layout (the header's table offsets, the L1 table's L2
//!   clusters, the refcount table's refblock clusters): header, L1,
//!   refcount table, L2 table, refblock, or other (guest data,
//!   copy-on-write data, the contents of a table nothing points to yet).
//! - **Pointer writes** (header, L1, refcount table) are held back until
//!   the next [`ChainFile::commit_pointers`], which the format layer calls
//!   after imago has written its caches: fdatasync, then each pointer write
//!   followed by fdatasync. Reads see them meanwhile.
//! - **An L2 table** is written only once everything it may point to is
//!   durable: an fdatasync first if copy-on-write data or refblocks were
//!   written since the last one (QEMU: `qcow2_cache_depends_on_flush`,
//!   refcount cache before L2 cache).
//! - **A refblock that lowers a refcount** (a cluster freed) waits for the
//!   L2 tables that dropped the reference: an fdatasync first if L2 tables
//!   were written since the last one; and while pointer writes are held
//!   back it is held back too, and written after them. A refblock that
//!   only raises refcounts is written at once (a crash then leaks at
//!   worst, which `qemu-img check` counts but does not call corruption).
//!
//! So a group of allocations costs one fdatasync (copy-on-write data and
//! refblocks, then the L2 tables); when a new L2 table, refblock or L1
//! table was hooked up, one more before the pointer writes and one after
//! each of them. A group with a write-through write in it takes one more
//! after its L2 tables ([`FileState::sync_if_unsynced`]); with the write
//! cache on, the next FLUSH's fdatasync covers them.
//!
//! With the L2 log adopted, a commit whose only changes are data
//! clusters allocated since the last one does not have imago write its
//! tables at all: [`FileState::log_allocations`] sets their L2 entries and
//! refcounts in the held copies and logs them, the words imago's write
//! would have changed, found through the file's L1 and refcount tables.
//!
//! With a [`Journal`] attached (tests), every pwrite and fdatasync that
//! reaches the file is recorded in order, so a test can rebuild the image
//! as a power loss could have left it.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use imago::Storage;
use imago::io_buffers::{IoVector, IoVectorMut};
use imago::storage::drivers::CommonStorageHelper;

use super::bitmaps::AUTOCLEAR_OFFSET;
use super::l2log::{self, INCOMPAT_OFFSET, L2Log};
use crate::disk::luks::Crypt;

/// The byte of the header that holds [`l2log::MARK`] (autoclear features
/// are big-endian: bit 62 is in their first byte).
const MARK_BYTE: u64 = AUTOCLEAR_OFFSET;
const MARK_BIT: u8 = (l2log::MARK >> 56) as u8;
/// The byte and bit of [`l2log::OLD_MARK`] (incompatible features).
const OLD_MARK_BYTE: u64 = INCOMPAT_OFFSET;
const OLD_MARK_BIT: u8 = (l2log::OLD_MARK >> 56) as u8;

/// Past this many bytes of held L2 tables they are written out.
const MAX_HELD_L2: usize = 64 << 20;

/// One operation that reached an image file, as a [`Journal`] records it.
#[derive(Clone, Debug)]
pub enum JournalOp {
    /// A pwrite of these bytes at this offset.
    Write { offset: u64, data: Vec<u8> },
    /// An fdatasync: everything before it is durable.
    Sync,
}

/// The ordered record of what reached the writable top's file.
#[derive(Default, Debug)]
pub struct Journal {
    ops: Mutex<Vec<JournalOp>>,
}

impl Journal {
    pub fn ops(&self) -> Vec<JournalOp> {
        lock(&self.ops).clone()
    }

    fn push(&self, op: JournalOp) {
        lock(&self.ops).push(op);
    }
}

/// Where a write lands, from the shadow of the on-disk layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Header,
    L1,
    RefTable,
    L2,
    RefBlock,
    Other,
}

const UNSYNCED_OTHER: u8 = 1;
const UNSYNCED_RB: u8 = 2;
const UNSYNCED_L2: u8 = 4;

/// The writable top's ordering state. One mutex: the metadata writes come
/// from one imago operation at a time, and the decision to sync and the
/// write it guards must not be split by another write.
struct Order {
    /// False only in tests that show what imago's own order does.
    enabled: bool,
    /// The shadow is read once imago has opened (and checked) the image;
    /// until then (imago clearing autoclear bits at open) writes go through.
    loaded: bool,
    cluster_bits: u32,
    refcount_order: u32,
    l1_offset: u64,
    l1_len: u64,
    rt_offset: u64,
    rt_len: u64,
    l2_clusters: HashSet<u64>,
    rb_clusters: HashSet<u64>,
    unsynced: u8,
    /// A snapshot made this file a backing file: nothing may write it.
    frozen: bool,
    /// Pointer writes held back until `commit_pointers`, in issue order.
    held: Vec<(u64, Vec<u8>)>,
    /// Refblock writes that free clusters, held back behind `held`.
    held_frees: Vec<(u64, Vec<u8>)>,
    /// The L2 log adopted ([`FileState::adopt_log`]): writes of L2 tables,
    /// and of refblocks that only raise refcounts, are held in `held_l2`
    /// and their changed entries logged, rather than written (the L2
    /// tables after an fdatasync) at once (see [`super::l2log`]).
    l2log: Option<Arc<L2Log>>,
    /// Tables held back, by offset in the file: their newest content.
    held_l2: BTreeMap<u64, Held>,
    held_l2_bytes: usize,
    /// The file has [`l2log::MARK`] set (in the page cache at least).
    marked: bool,
}

/// A table held back from the file.
struct Held {
    refblock: bool,
    data: Vec<u8>,
}

/// What adopting the L2 log found.
#[derive(Debug, Default)]
pub struct Adopted {
    /// Entries of the log written into the image's L2 tables.
    pub replayed: usize,
    /// The image was marked but its log did not apply, or the log had
    /// entries and the mark was gone (another program wrote the image),
    /// and why.
    pub dropped: Option<String>,
}

/// One file of a chain as imago holds it; the format layer keeps another
/// handle on the same [`FileState`].
#[derive(Clone)]
pub struct ChainFile(pub Arc<FileState>);

/// One file of a chain: the writable top (with [`Order`]) or a read-only
/// backing file. `index` is its place in the chain, 0 being the top; the
/// engine gets the same index in a mapping.
pub struct FileState {
    file: File,
    path: PathBuf,
    /// Changes only when a snapshot puts a new top above the chain, while
    /// no request is in flight.
    index: AtomicUsize,
    size: AtomicU64,
    helper: CommonStorageHelper,
    order: Option<Mutex<Order>>,
    journal: Option<Arc<Journal>>,
    /// fdatasyncs of this file so far (ordering and flushes).
    syncs: AtomicU64,
    /// Tables are held back (see `Order::held_l2`): a FLUSH must write
    /// them out, an fdatasync alone does not cover them.
    holding: AtomicBool,
    /// Header bytes imago reads as it left them at open, whatever the
    /// file has (`bitmaps::header_view`): the autoclear field (zero; the
    /// file has the bitmaps bit), the backing file name's offset, and the
    /// extensions and name (the file's bitmaps extension may point at a
    /// directory written since, or have been added or removed, moving the
    /// name). imago refuses a reread header whose autoclear bits,
    /// extensions or backing file name changed (bitmaps.rs).
    imago_view: OnceLock<Vec<(u64, Vec<u8>)>>,
    /// Header bytes the file has that imago's writes of its header must
    /// carry instead of its own: the backing file name's offset, once a
    /// bitmaps extension added or removed moved the name (imago writes
    /// the 72 bytes of the version 2 header whenever it moves the L1 or
    /// the refcount table, or resizes, with the offset it read at open).
    imago_writes: Mutex<Vec<(u64, Vec<u8>)>>,
    /// An encrypted layer's transform (`super::crypt`): its data
    /// clusters hold ciphertext.
    crypt: Option<Arc<Crypt>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks is a bug; the state is still
    // the best there is, so go on with it rather than poison every request.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(a)
}

/// Offset bits of an L1 or refcount-table entry.
const TABLE_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Offset bits of a standard L2 entry.
const L2_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// An L1 or L2 entry's "refcount is exactly one" flag.
const COPIED: u64 = 1 << 63;
/// A standard L2 entry's "reads as zeroes" flag.
const ZERO_FLAG: u64 = 1;

fn host_of(entry: u64) -> u64 {
    entry & L2_OFFSET_MASK
}

/// Sets the refcount at bit `bit` of the 8-byte word `word` (a part of a
/// refblock, its entries `bits` wide, as [`refcount_max`] lays them out)
/// to 1.
fn set_refcount_one(word: &mut [u8; 8], bit: u64, bits: u64) {
    let byte = (bit / 8) as usize;
    if bits >= 8 {
        // Big-endian: the entry's last byte holds its lowest bits.
        word[byte + (bits / 8) as usize - 1] = 1;
    } else {
        word[byte] |= 1 << (bit % 8);
    }
}

impl FileState {
    pub fn new(file: File, path: &Path, index: usize) -> io::Result<Self> {
        let size = file.metadata()?.len();
        Ok(FileState {
            file,
            path: path.to_path_buf(),
            index: AtomicUsize::new(index),
            size: AtomicU64::new(size),
            helper: CommonStorageHelper::default(),
            order: None,
            journal: None,
            syncs: AtomicU64::new(0),
            holding: AtomicBool::new(false),
            imago_view: OnceLock::new(),
            imago_writes: Mutex::new(Vec::new()),
            crypt: None,
        })
    }

    /// The layer is encrypted with `crypt` (before it is shared).
    pub fn set_crypt(&mut self, crypt: Arc<Crypt>) {
        self.crypt = Some(crypt);
    }

    /// An encrypted layer's transform.
    pub fn crypt(&self) -> Option<&Crypt> {
        self.crypt.as_deref()
    }

    /// An encrypted layer's transform, shared.
    pub fn crypt_shared(&self) -> Option<Arc<Crypt>> {
        self.crypt.clone()
    }

    /// The file grew behind imago (bitmaps written past its end).
    pub fn grew(&self) -> io::Result<()> {
        self.len_now().map(|_| ())
    }

    /// The largest length the file is known to have had: at the open,
    /// from writes through here, a resize, or the last
    /// [`len_now`](Self::len_now). Never more than the file's length
    /// unless the file shrank behind us.
    pub fn known_len(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    /// The file's length now (a statx), kept as the known one too.
    pub fn len_now(&self) -> io::Result<u64> {
        let len = self.file.metadata()?.len();
        self.size.fetch_max(len, Ordering::Relaxed);
        Ok(len)
    }

    /// From now on imago reads these `(offset, bytes)` of the file as
    /// given (once; a second call changes nothing).
    pub fn show_imago(&self, view: Vec<(u64, Vec<u8>)>) {
        let _ = self.imago_view.set(view);
    }

    /// Whether [`show_imago`](Self::show_imago) was called.
    pub fn imago_viewed(&self) -> bool {
        self.imago_view.get().is_some()
    }

    /// From now on imago's writes that cover these `(offset, bytes)` of
    /// the file carry them instead of imago's (replacing what an earlier
    /// call gave). Only for bytes imago reads through its view
    /// ([`show_imago`](Self::show_imago)), so that it never sees them.
    pub fn patch_imago_writes(&self, patch: Vec<(u64, Vec<u8>)>) {
        *lock(&self.imago_writes) = patch;
    }

    /// Makes this the writable top: its writes are ordered from now on.
    /// `enabled` false passes imago's writes through as they come (tests).
    pub fn make_ordered(&mut self, enabled: bool, journal: Option<Arc<Journal>>) {
        let order = Order {
            enabled,
            loaded: false,
            cluster_bits: 16,
            refcount_order: 4,
            l1_offset: 0,
            l1_len: 0,
            rt_offset: 0,
            rt_len: 0,
            l2_clusters: HashSet::new(),
            rb_clusters: HashSet::new(),
            unsynced: 0,
            frozen: false,
            held: Vec::new(),
            held_frees: Vec::new(),
            l2log: None,
            held_l2: BTreeMap::new(),
            held_l2_bytes: 0,
            marked: false,
        };
        self.order = Some(Mutex::new(order));
        self.journal = journal;
    }

    /// Reads the shadow layout, once imago has opened the image, and
    /// refuses overlapping metadata (QEMU's overlap check, at open): the
    /// header, the L1 table, the refcount table, the L2 tables and the
    /// refblocks must each have clusters of their own.
    pub fn load_shadow(&self) -> io::Result<()> {
        if let Some(order) = &self.order {
            let mut o = lock(order);
            self.reload_shadow(&mut o, true, true, true)?;
            o.loaded = true;
            check_layout(&o)?;
            self.check_refcount_coverage(&o)?;
        }
        Ok(())
    }

    /// Refuses a refcount table with a hole below the end of the file.
    /// QEMU keeps every cluster of the file covered by a refblock; with a
    /// hole, imago's search for a cluster to hold a new refblock recurses
    /// once per missing refblock (a stack overflow for a hostile image, as
    /// the fuzz target found). One missing refblock at the very end, after
    /// others, is taken: a crash while a new refblock was hooked up leaves
    /// it (the refblock written past the last covered cluster, its table
    /// entry not), nothing counts on it, and QEMU opens such an image.
    fn check_refcount_coverage(&self, o: &Order) -> io::Result<()> {
        let file_len = self.file.metadata()?.len();
        let clusters = file_len.div_ceil(1 << o.cluster_bits);
        // Clusters one refblock covers: cluster_size * 8 / refcount_bits.
        let per_rb = (1u64 << (o.cluster_bits + 3)) >> o.refcount_order;
        let needed = clusters.div_ceil(per_rb);
        if needed * 8 > o.rt_len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the refcount table does not cover the file (qemu-img check -r all)",
            ));
        }
        let mut t = vec![0u8; (needed * 8) as usize];
        self.file.read_exact_at(&mut t, o.rt_offset)?;
        // The one missing at the end must not be the first: with no
        // refblock at all imago recurses without end (a fuzz input).
        if let Some(i) = t.chunks_exact(8).position(|e| be64(e, 0) == 0)
            && (i == 0 || i as u64 + 1 < needed)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the refcount table has no refblock for clusters {} to {} of the file (qemu-img check -r all)",
                    i as u64 * per_rb,
                    (i as u64 + 1) * per_rb - 1
                ),
            ));
        }
        Ok(())
    }

    /// Makes the file at least `end` bytes long, never shorter: a data
    /// cluster allocated past the end of the file is inside it before any
    /// L2 entry can point there (imago has the entry in its cache at the
    /// allocation, and a commit of another request, or of this one when
    /// it hooked up a new table, writes or logs it before this request's
    /// data write). An entry past the end is a corruption to QEMU, and a
    /// kill -9 or a power loss in between left one. The last byte of the
    /// cluster, which only its own request writes, is read, and written
    /// back (a zero) only where the file ends before it; the next
    /// fdatasync, before any held L2 table is written, makes the length
    /// durable.
    pub fn cover(&self, end: u64) -> io::Result<()> {
        let Some(order) = &self.order else {
            return Ok(());
        };
        let Some(last) = end.checked_sub(1) else {
            return Ok(());
        };
        let mut o = lock(order);
        let mut b = [0u8; 1];
        if self.file.read_at(&mut b, last)? == 1 {
            return Ok(());
        }
        self.pwrite(&[0], last)?;
        o.unsynced |= UNSYNCED_OTHER;
        Ok(())
    }

    /// Whether host cluster `cluster` holds metadata (header or a table),
    /// as the file has it. A data cluster allocated there means the
    /// refcounts are corrupt: writing it would overwrite metadata.
    pub fn is_metadata(&self, cluster: u64) -> bool {
        let Some(order) = &self.order else {
            return false;
        };
        let o = lock(order);
        Self::classify(&o, cluster << o.cluster_bits) != Class::Other
    }

    pub fn index(&self) -> usize {
        self.index.load(Ordering::Relaxed)
    }

    /// This file is now one further down the chain (a snapshot put a new
    /// top above it).
    pub fn move_down(&self) {
        self.index.fetch_add(1, Ordering::Relaxed);
    }

    /// This file is `by` further up the chain (a stream dropped the
    /// layers above it but the top).
    pub fn move_up(&self, by: usize) {
        self.index.fetch_sub(by, Ordering::Relaxed);
    }

    /// This file is written no more (it was the top until a snapshot):
    /// from now on every write to it fails. Everything imago had to write
    /// was written and synced before.
    pub fn freeze(&self) {
        if let Some(order) = &self.order {
            lock(order).frozen = true;
        }
    }

    /// Undoes [`FileState::freeze`] (a snapshot that failed).
    pub fn thaw(&self) {
        if let Some(order) = &self.order {
            lock(order).frozen = false;
        }
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Rereads the parts of the shadow layout that a write may have changed.
    /// Only called on an image imago opened, so the header's values passed
    /// its checks; the table sizes are bounded again here all the same.
    fn reload_shadow(&self, o: &mut Order, header: bool, l1: bool, rt: bool) -> io::Result<()> {
        if header {
            let mut h = [0u8; 104];
            self.file.read_exact_at(&mut h[..72], 0)?;
            let version = be32(&h, 4);
            o.cluster_bits = be32(&h, 20).clamp(9, 21);
            o.l1_offset = be64(&h, 40);
            o.l1_len = u64::from(be32(&h, 36)) * 8;
            o.rt_offset = be64(&h, 48);
            o.rt_len = u64::from(be32(&h, 56)) << o.cluster_bits;
            o.refcount_order = if version >= 3 {
                self.file.read_exact_at(&mut h[72..104], 72)?;
                be32(&h, 96).min(6)
            } else {
                4
            };
        }
        // 32 MiB is imago's own bound on either table.
        const MAX_TABLE: u64 = 32 << 20;
        if l1 || header {
            let mut t = vec![0u8; o.l1_len.min(MAX_TABLE) as usize];
            self.file.read_exact_at(&mut t, o.l1_offset)?;
            o.l2_clusters = t
                .chunks_exact(8)
                .map(|e| be64(e, 0) & TABLE_OFFSET_MASK)
                .filter(|&off| off != 0)
                .map(|off| off >> o.cluster_bits)
                .collect();
        }
        if rt || header {
            let mut t = vec![0u8; o.rt_len.min(MAX_TABLE) as usize];
            self.file.read_exact_at(&mut t, o.rt_offset)?;
            o.rb_clusters = t
                .chunks_exact(8)
                .map(|e| be64(e, 0) & !((1u64 << o.cluster_bits) - 1))
                .filter(|&off| off != 0)
                .map(|off| off >> o.cluster_bits)
                .collect();
        }
        Ok(())
    }

    fn classify(o: &Order, offset: u64) -> Class {
        let cluster = offset >> o.cluster_bits;
        if cluster == 0 {
            Class::Header
        } else if offset >= o.l1_offset && offset - o.l1_offset < o.l1_len {
            Class::L1
        } else if offset >= o.rt_offset && offset - o.rt_offset < o.rt_len {
            Class::RefTable
        } else if o.l2_clusters.contains(&cluster) {
            Class::L2
        } else if o.rb_clusters.contains(&cluster) {
            Class::RefBlock
        } else {
            Class::Other
        }
    }

    /// Reads at `offset`, with the writes held back laid over what the file has.
    fn read_overlaid(&self, o: Option<&Order>, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64)? {
                0 => {
                    buf[done..].fill(0);
                    break;
                }
                n => done += n,
            }
        }
        if let Some(o) = o {
            // The tables held for the log first: an L2 table written again
            // while a pointer write is held waits in `held`, newer.
            let end = offset + buf.len() as u64;
            let from = offset.saturating_sub((1u64 << o.cluster_bits) - 1);
            for (at, held) in o.held_l2.range(from..end) {
                overlay(buf, offset, &held.data, *at);
            }
            for (at, data) in o.held.iter().chain(o.held_frees.iter()) {
                overlay(buf, offset, data, *at);
            }
        }
        // imago never sees the L2 log's mark, nor the old one (see
        // `l2log`), in the writable top (a version 3 image: the bytes are
        // the header's feature fields; in a backing file they may be an
        // extension, a file name or guest data, and a marked one is
        // refused at open).
        if self.order.is_some() {
            patch_mark(buf, offset, false);
            patch_bit(buf, offset, OLD_MARK_BYTE, OLD_MARK_BIT, false);
        }
        for (at, data) in self.imago_view.get().into_iter().flatten() {
            overlay(buf, offset, data, *at);
        }
        Ok(())
    }

    /// Whether the file has [`l2log::MARK`] (or [`l2log::OLD_MARK`], from
    /// an older daemon) set: a daemon that held it stopped uncleanly, or
    /// holds it now.
    pub fn file_marked(&self) -> io::Result<bool> {
        Ok(self.file_has(MARK_BYTE, MARK_BIT)? || self.file_has(OLD_MARK_BYTE, OLD_MARK_BIT)?)
    }

    fn file_has(&self, byte: u64, bit: u8) -> io::Result<bool> {
        let mut b = [0u8; 1];
        self.file.read_exact_at(&mut b, byte)?;
        Ok(b[0] & bit != 0)
    }

    /// A write of imago's header that covers [`l2log::OLD_MARK`]'s byte
    /// keeps it as the file has it (only `adopt_log` clears it).
    fn keep_old_mark(&self, data: &mut [u8], offset: u64) -> io::Result<()> {
        if offset <= OLD_MARK_BYTE && OLD_MARK_BYTE < offset + data.len() as u64 {
            let on = self.file_has(OLD_MARK_BYTE, OLD_MARK_BIT)?;
            patch_bit(data, offset, OLD_MARK_BYTE, OLD_MARK_BIT, on);
        }
        Ok(())
    }

    /// Sets or clears [`l2log::MARK`] in the file.
    fn set_mark(&self, o: &mut Order, on: bool) -> io::Result<()> {
        let mut b = [0u8; 1];
        self.file.read_exact_at(&mut b, MARK_BYTE)?;
        patch_mark(&mut b, MARK_BYTE, on);
        self.pwrite(&b, MARK_BYTE)?;
        o.unsynced |= UNSYNCED_OTHER;
        o.marked = on;
        Ok(())
    }

    /// Clears [`l2log::OLD_MARK`] in the file, if an older daemon left it.
    fn clear_old_mark(&self, o: &mut Order) -> io::Result<()> {
        if self.file_has(OLD_MARK_BYTE, OLD_MARK_BIT)? {
            let mut b = [0u8; 1];
            self.file.read_exact_at(&mut b, OLD_MARK_BYTE)?;
            b[0] &= !OLD_MARK_BIT;
            self.pwrite(&b, OLD_MARK_BYTE)?;
            o.unsynced |= UNSYNCED_OTHER;
        }
        Ok(())
    }

    /// A table write with the log adopted: the 8-byte words that change
    /// are logged (the mark set first), the table held back. Gives the
    /// write back (and does nothing) for a refblock that lowers a
    /// refcount, or while pointer writes are held: it takes the ordered
    /// path, which frees clusters only after the pointers are durable.
    fn hold(
        &self,
        o: &mut Order,
        data: Vec<u8>,
        offset: u64,
        refblock: bool,
    ) -> io::Result<Option<Vec<u8>>> {
        let Some(log) = o.l2log.clone() else {
            return Ok(Some(data));
        };
        if !data.len().is_multiple_of(8)
            || (refblock && !(o.held.is_empty() && o.held_frees.is_empty()))
        {
            return Ok(Some(data));
        }
        let mut changed = Vec::new();
        {
            let from_file;
            let prev: &[u8] = match o.held_l2.get(&offset) {
                Some(p) if p.data.len() == data.len() => &p.data,
                _ => {
                    let mut b = vec![0u8; data.len()];
                    self.read_overlaid(None, &mut b, offset)?;
                    from_file = b;
                    &from_file
                }
            };
            let bits = 1u32 << o.refcount_order;
            // A commit changes a few words of a 64 KiB table: equal
            // blocks are skipped with one comparison each (a word at a
            // time was 5% of an allocating write's CPU).
            for (b, (new, old)) in data
                .chunks(DIFF_BLOCK)
                .zip(prev.chunks(DIFF_BLOCK))
                .enumerate()
                .filter(|(_, (new, old))| new != old)
            {
                for (i, (new, old)) in new.chunks_exact(8).zip(old.chunks_exact(8)).enumerate() {
                    if new != old {
                        if refblock && refcount_max(old, new, bits) != new {
                            return Ok(Some(data));
                        }
                        let at = b * DIFF_BLOCK + 8 * i;
                        changed.push((offset + at as u64, be64(new, 0)));
                    }
                }
            }
        }
        if changed.is_empty() {
            return Ok(None);
        }
        if !o.marked {
            self.set_mark(o, true)?;
        }
        let log_len = log.append(&changed)?;
        let len = data.len();
        self.holding.store(true, Ordering::Release);
        if let Some(old) = o.held_l2.insert(offset, Held { refblock, data }) {
            o.held_l2_bytes -= old.data.len();
        }
        o.held_l2_bytes += len;
        if log_len > l2log::MAX_LOG || o.held_l2_bytes > MAX_HELD_L2 {
            self.write_out(o)?;
        }
        Ok(None)
    }

    /// Logs the metadata of data clusters imago allocated since its caches
    /// were last written, without imago writing them: each `(index,
    /// host)` (the guest cluster's index; the new cluster's offset in this
    /// file) sets the L2 entry to `host` with COPIED, as imago has it, and
    /// the cluster's refcount to at least 1, in the held copies of their
    /// tables, and appends the changed words to the log: what [`Self::hold`]
    /// would find when imago writes those tables, found from what the
    /// allocation knows rather than by imago serializing a whole L2 table
    /// and refblock per commit (a quarter of an allocating write's CPU).
    /// imago's next write of those tables finds the words held already.
    ///
    /// False, with nothing changed, where that cannot stand for imago's
    /// write: no log adopted, a pointer write held (a table hooked up,
    /// which the L1 or refcount table in the file does not show yet), a
    /// table not where the file's L1 or refcount table says, or an entry
    /// that held something else. The caller then has imago write its
    /// caches.
    pub fn log_allocations(&self, allocations: &[(u64, u64)]) -> io::Result<bool> {
        let Some(order) = &self.order else {
            return Ok(false);
        };
        let mut o = lock(order);
        let Some(log) = o.l2log.clone() else {
            return Ok(false);
        };
        if !o.loaded || !o.enabled || o.frozen || !o.held.is_empty() || !o.held_frees.is_empty() {
            return Ok(false);
        }
        let cb = o.cluster_bits;
        let csize = 1u64 << cb;
        let l2_entries = csize / 8;
        let bits = 1u64 << o.refcount_order;
        let rb_entries = (csize * 8) / bits;
        let word_at = |o: &Order, at: u64| -> io::Result<u64> {
            let mut w = [0u8; 8];
            self.read_overlaid(Some(o), &mut w, at)?;
            Ok(u64::from_be_bytes(w))
        };
        // (table, refblock, offset of the word in the table, new entry
        // for an L2 table / bit of the refcount in the word)
        let mut wanted = Vec::with_capacity(2 * allocations.len());
        for &(index, host) in allocations {
            if host & (csize - 1) != 0 || host & !L2_OFFSET_MASK != 0 {
                return Ok(false);
            }
            let l1_at = (index / l2_entries) * 8;
            if l1_at + 8 > o.l1_len {
                return Ok(false);
            }
            let l1e = word_at(&o, o.l1_offset + l1_at)?;
            let l2 = l1e & TABLE_OFFSET_MASK;
            if l1e & COPIED == 0 || l2 == 0 || !o.l2_clusters.contains(&(l2 >> cb)) {
                return Ok(false);
            }
            wanted.push((l2, false, (index % l2_entries) * 8, host | COPIED));
            let cluster = host >> cb;
            let rt_at = (cluster / rb_entries) * 8;
            if rt_at + 8 > o.rt_len {
                return Ok(false);
            }
            let rb = word_at(&o, o.rt_offset + rt_at)? & !(csize - 1);
            if rb == 0 || !o.rb_clusters.contains(&(rb >> cb)) {
                return Ok(false);
            }
            let bit = (cluster % rb_entries) * bits;
            wanted.push((rb, true, (bit / 64) * 8, bit % 64));
        }
        // Checked before anything changes: an L2 entry that was
        // unallocated or a zero cluster (of this very cluster), or is the
        // new one already.
        for &(table, refblock, at, new) in &wanted {
            if refblock {
                continue;
            }
            let old = word_at(&o, table + at)?;
            let old_host = host_of(old);
            let zero_here = old & ZERO_FLAG != 0 && (old_host == 0 || old_host == host_of(new));
            if !(old == new || old == 0 || zero_here) {
                return Ok(false);
            }
        }
        // The held copies the words go into (read from the file, with what
        // is held over it, where a table is not held yet).
        for &(table, refblock, _, _) in &wanted {
            if !o.held_l2.contains_key(&table) {
                let mut data = vec![0u8; csize as usize];
                self.read_overlaid(Some(&o), &mut data, table)?;
                o.held_l2.insert(table, Held { refblock, data });
                o.held_l2_bytes += csize as usize;
            }
        }
        let mut changed = Vec::with_capacity(wanted.len());
        for (table, refblock, at, new) in wanted {
            let at = at as usize;
            let held = o.held_l2.get_mut(&table).expect("held above");
            let old: [u8; 8] = held.data[at..at + 8].try_into().expect("a word");
            let new = if refblock {
                let mut one = [0u8; 8];
                set_refcount_one(&mut one, new, bits);
                let raised = refcount_max(&old, &one, bits as u32);
                be64(&raised, 0)
            } else {
                new
            };
            if new != u64::from_be_bytes(old) {
                held.data[at..at + 8].copy_from_slice(&new.to_be_bytes());
                changed.push((table + at as u64, new));
            }
        }
        if changed.is_empty() {
            return Ok(true);
        }
        if !o.marked {
            self.set_mark(&mut o, true)?;
        }
        let log_len = log.append(&changed)?;
        self.holding.store(true, Ordering::Release);
        if log_len > l2log::MAX_LOG || o.held_l2_bytes > MAX_HELD_L2 {
            self.write_out(&mut o)?;
        }
        Ok(true)
    }

    /// Writes the held L2 tables into the file, once what they point to is
    /// durable, then clears the mark and empties the log: from here on the
    /// file's own L2 tables have every entry (in the page cache; an
    /// fdatasync makes them durable).
    fn write_out(&self, o: &mut Order) -> io::Result<()> {
        if !o.held_l2.is_empty() {
            let held = std::mem::take(&mut o.held_l2);
            // Refcounts first, durable with the data before any L2 entry
            // that needs them: the copy-on-write data, and the guest's
            // own writes to the clusters, which completed before their
            // entries were held (they need not have gone through here).
            for (offset, h) in held.iter().filter(|(_, h)| h.refblock) {
                self.pwrite(&h.data, *offset)?;
            }
            self.fdatasync(o)?;
            for (offset, h) in held.iter().filter(|(_, h)| !h.refblock) {
                self.pwrite(&h.data, *offset)?;
                o.unsynced |= UNSYNCED_L2;
            }
            o.held_l2_bytes = 0;
            self.holding.store(false, Ordering::Release);
        }
        if o.marked {
            // The log emptied first: a log with entries on an unmarked
            // image means another program cleared the mark (`adopt_log`).
            if let Some(log) = &o.l2log {
                log.reset(&self.file)?;
            }
            self.set_mark(o, false)?;
        }
        Ok(())
    }

    /// Takes `log` as this file's L2 log (the image lock is held: no other
    /// process writes the file). If the file is marked, a daemon holding
    /// it stopped uncleanly: the log's entries are written into the L2
    /// tables first when the log is this boot's and this file's (a kill
    /// -9), else dropped (a host stop: only what the page cache held is
    /// gone), and the mark (the old one too) is cleared either way. If it
    /// is not marked and the log still has entries for it, a program that
    /// clears autoclear bits it does not know (QEMU) wrote the file after
    /// a daemon stopped uncleanly on it: the clusters the entries point to
    /// may be its own now, and the log is dropped. Called with imago's
    /// caches written; the caller has imago reread them afterwards.
    pub fn adopt_log(&self, log: Arc<L2Log>) -> io::Result<Adopted> {
        let Some(order) = &self.order else {
            return Ok(Adopted::default());
        };
        let mut o = lock(order);
        if !o.enabled || o.frozen {
            return Ok(Adopted::default());
        }
        self.write_out(&mut o)?;
        let mut adopted = Adopted::default();
        if self.file_marked()? {
            self.reload_shadow(&mut o, true, true, true)?;
            let found = log.entries_for(&self.file)?;
            let is_rb = |at: u64| o.rb_clusters.contains(&(at >> o.cluster_bits));
            let bad = found.entries.iter().find(|&&(at, _)| {
                at % 8 != 0 || !(o.l2_clusters.contains(&(at >> o.cluster_bits)) || is_rb(at))
            });
            match (found.stale, bad) {
                (Some(why), _) => adopted.dropped = Some(why),
                (None, Some((at, _))) => {
                    adopted.dropped = Some(format!(
                        "its entry at {at:#x} is in no L2 table or refblock of the image"
                    ))
                }
                (None, None) if !found.entries.is_empty() => {
                    // The refcounts durable before the L2 entries, as at a
                    // write-out.
                    let (rbs, l2s): (Vec<_>, Vec<_>) =
                        found.entries.iter().partition(|&&(at, _)| is_rb(at));
                    for (at, value) in rbs {
                        self.pwrite(&value.to_be_bytes(), at)?;
                    }
                    self.fdatasync(&mut o)?;
                    for (at, value) in l2s {
                        self.pwrite(&value.to_be_bytes(), at)?;
                    }
                    adopted.replayed = found.entries.len();
                }
                (None, None) => {}
            }
            self.set_mark(&mut o, false)?;
            self.clear_old_mark(&mut o)?;
            self.fdatasync(&mut o)?;
        } else {
            let found = log.entries_for(&self.file)?;
            if found.stale.is_none() && !found.entries.is_empty() {
                adopted.dropped = Some(format!(
                    "it has {} entries but the image's mark, autoclear feature bit 62, is clear: \
                     another program opened the image for writing since (QEMU clears the \
                     autoclear bits it does not know)",
                    found.entries.len()
                ));
            }
        }
        log.reset(&self.file)?;
        o.l2log = Some(log);
        Ok(adopted)
    }

    /// Whether tables are held back now: a FLUSH must then go through
    /// [`FileState::sync_now`], not an fdatasync of the file alone. Set
    /// before the commit that held them returns, so a FLUSH that follows
    /// a completed write sees it.
    pub fn holding(&self) -> bool {
        self.holding.load(Ordering::Acquire)
    }

    /// Bytes of L2 tables held back now.
    pub fn held_l2_bytes(&self) -> usize {
        self.order.as_ref().map_or(0, |o| lock(o).held_l2_bytes)
    }

    fn pwrite(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(data, offset)?;
        let end = offset + data.len() as u64;
        self.size.fetch_max(end, Ordering::Relaxed);
        if let Some(j) = &self.journal {
            j.push(JournalOp::Write {
                offset,
                data: data.to_vec(),
            });
        }
        Ok(())
    }

    fn fdatasync(&self, o: &mut Order) -> io::Result<()> {
        self.file.sync_data()?;
        self.syncs.fetch_add(1, Ordering::Relaxed);
        o.unsynced = 0;
        if let Some(j) = &self.journal {
            j.push(JournalOp::Sync);
        }
        Ok(())
    }

    /// For a refblock write of `data` at `offset`: the same block with only
    /// the refcounts it raises (each entry the larger of old and new), or
    /// `None` if it lowers none (then `data` itself is that block).
    fn raises_only(&self, o: &Order, data: &[u8], offset: u64) -> io::Result<Option<Vec<u8>>> {
        let mut old = vec![0u8; data.len()];
        self.read_overlaid(Some(o), &mut old, offset)?;
        let merged = refcount_max(&old, data, 1 << o.refcount_order);
        Ok((merged != data).then_some(merged))
    }

    /// A write of imago's, placed in the order described in the module docs.
    fn ordered_write(&self, data: Vec<u8>, offset: u64) -> io::Result<()> {
        let Some(order) = &self.order else {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "write to a read-only file of the chain",
            ));
        };
        let mut o = lock(order);
        if o.frozen {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "write to a former top of the chain (a snapshot froze it)",
            ));
        }
        let mut data = data;
        for (at, real) in lock(&self.imago_writes).iter() {
            overlay(&mut data, offset, real, *at);
        }
        if !o.loaded {
            // imago at open (clearing autoclear bits it sees, when there
            // are others): the marks, which it does not see, stay as the
            // file has them.
            if covers_mark(&data, offset) {
                patch_mark(&mut data, offset, self.file_has(MARK_BYTE, MARK_BIT)?);
            }
            self.keep_old_mark(&mut data, offset)?;
            o.unsynced |= UNSYNCED_OTHER;
            return self.pwrite(&data, offset);
        }
        if !o.enabled {
            patch_mark(&mut data, offset, o.marked);
            self.keep_old_mark(&mut data, offset)?;
            o.unsynced |= UNSYNCED_OTHER;
            self.pwrite(&data, offset)?;
            let class = Self::classify(&o, offset);
            if matches!(class, Class::Header | Class::L1 | Class::RefTable) {
                let header = class == Class::Header;
                self.reload_shadow(&mut o, header, class == Class::L1, class == Class::RefTable)?;
            }
            return Ok(());
        }
        match Self::classify(&o, offset) {
            Class::Header | Class::L1 | Class::RefTable => o.held.push((offset, data)),
            Class::RefBlock => {
                let Some(data) = self.hold(&mut o, data, offset, true)? else {
                    return Ok(());
                };
                // An older version of this block is held: it must not be
                // written over this one later.
                if o.held_l2.contains_key(&offset) {
                    self.write_out(&mut o)?;
                }
                if let Some(raised) = self.raises_only(&o, &data, offset)? {
                    // A cluster freed: the L2 tables that dropped it must
                    // be in the file first.
                    self.write_out(&mut o)?;
                    if !o.held.is_empty() {
                        // The raised refcounts (e.g. of the new table the
                        // held pointers point to) go now; the lowered ones
                        // once the pointers are durable.
                        self.pwrite(&raised, offset)?;
                        o.unsynced |= UNSYNCED_RB;
                        o.held_frees.push((offset, data));
                        return Ok(());
                    }
                    if o.unsynced & UNSYNCED_L2 != 0 {
                        self.fdatasync(&mut o)?;
                    }
                }
                self.pwrite(&data, offset)?;
                o.unsynced |= UNSYNCED_RB;
            }
            Class::L2 if !o.held.is_empty() => {
                // A pointer write is held (a new refblock's refcount
                // table entry, a new L2 table's L1 entry, a moved table in
                // the header), and this table's entries may count on it
                // (a cluster whose refcount is in the new refblock): it
                // waits behind it, in the same order (`commit_pointers`).
                // Neither written nor logged before: after a kill -9 the
                // log's replay would have written entries whose refcounts
                // the file does not reach. An older version held for the
                // log stays held (its entries are logged, and acknowledged
                // writes may count on them): the write-out writes it
                // first, and reads see this one over it.
                o.held.push((offset, data));
            }
            Class::L2 => {
                let Some(data) = self.hold(&mut o, data, offset, false)? else {
                    return Ok(());
                };
                if o.unsynced & (UNSYNCED_OTHER | UNSYNCED_RB) != 0 {
                    self.fdatasync(&mut o)?;
                }
                self.pwrite(&data, offset)?;
                o.unsynced |= UNSYNCED_L2;
            }
            Class::Other => {
                self.pwrite(&data, offset)?;
                o.unsynced |= UNSYNCED_OTHER;
            }
        }
        Ok(())
    }

    /// Writes the pointer writes held back (and the frees behind them), each
    /// after an fdatasync, once imago has written its caches. True if there
    /// were any.
    pub fn commit_pointers(&self) -> io::Result<bool> {
        let Some(order) = &self.order else {
            return Ok(false);
        };
        let mut o = lock(order);
        if o.held.is_empty() && o.held_frees.is_empty() {
            return Ok(false);
        }
        // The L2 tables the new pointers may lead to, first.
        self.write_out(&mut o)?;
        let held = std::mem::take(&mut o.held);
        for (offset, mut data) in held {
            patch_mark(&mut data, offset, o.marked);
            self.keep_old_mark(&mut data, offset)?;
            self.fdatasync(&mut o)?;
            self.pwrite(&data, offset)?;
            let class = Self::classify(&o, offset);
            self.reload_shadow(
                &mut o,
                class == Class::Header,
                class == Class::L1,
                class == Class::RefTable,
            )?;
        }
        self.fdatasync(&mut o)?;
        let frees = std::mem::take(&mut o.held_frees);
        for (offset, data) in frees {
            self.pwrite(&data, offset)?;
            o.unsynced |= UNSYNCED_RB;
        }
        Ok(true)
    }

    /// How many fdatasyncs this file has had.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// Whether pointer writes are held back (a new table was hooked up).
    pub fn has_held(&self) -> bool {
        self.order
            .as_ref()
            .is_some_and(|o| !lock(o).held.is_empty())
    }

    /// Writes out the held L2 tables, then fdatasync: everything written
    /// so far is durable.
    pub fn sync_now(&self) -> io::Result<()> {
        match &self.order {
            Some(order) => {
                let mut o = lock(order);
                self.write_out(&mut o)?;
                self.fdatasync(&mut o)
            }
            None => self.file.sync_data(),
        }
    }

    /// A write of data that metadata written after it will point to (a
    /// stream's copy into the top, a header's new backing file name):
    /// through the ordering, so that the next pointer write waits for an
    /// fdatasync after it, as copy-on-write data does; recorded in the
    /// journal.
    pub fn copy_write(&self, data: &[u8], offset: u64) -> io::Result<()> {
        match &self.order {
            Some(order) => {
                let mut o = lock(order);
                self.pwrite(data, offset)?;
                o.unsynced |= UNSYNCED_OTHER;
                Ok(())
            }
            None => self.file.write_all_at(data, offset),
        }
    }

    /// [`FileState::copy_write`] of the bytes `iovecs` point to, as one
    /// pwritev at `offset` (a cluster's copied head, a write's data from
    /// guest memory, its copied tail); `through`: another descriptor of
    /// this file to write them through (the engine's O_DIRECT one, with
    /// `--direct`; the caller aligns), else this one's.
    ///
    /// # Safety
    /// Every iovec points to memory readable for its length for the whole
    /// call (guest memory: its mapping held by the caller's buffers).
    pub unsafe fn copy_writev(
        &self,
        through: Option<&File>,
        iovecs: &[libc::iovec],
        offset: u64,
    ) -> io::Result<()> {
        let len: usize = iovecs.iter().map(|v| v.iov_len).sum();
        let file = through.unwrap_or(&self.file);
        let Some(order) = &self.order else {
            // SAFETY: as the caller promises.
            return unsafe { pwritev_all(file, iovecs, offset) };
        };
        let mut o = lock(order);
        if o.frozen {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "write to a former top of the chain (a snapshot froze it)",
            ));
        }
        // SAFETY: as the caller promises.
        unsafe { pwritev_all(file, iovecs, offset)? };
        self.size.fetch_max(offset + len as u64, Ordering::Relaxed);
        if let Some(j) = &self.journal {
            let mut data = Vec::with_capacity(len);
            for v in iovecs {
                // SAFETY: as the caller promises: readable for iov_len.
                data.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len)
                });
            }
            j.push(JournalOp::Write { offset, data });
        }
        o.unsynced |= UNSYNCED_OTHER;
        Ok(())
    }

    /// An fdatasync and nothing else (nothing held back is written
    /// first); recorded in the journal.
    pub fn sync_only(&self) -> io::Result<()> {
        match &self.order {
            Some(order) => {
                let mut o = lock(order);
                self.fdatasync(&mut o)
            }
            None => self.file.sync_data(),
        }
    }

    /// fdatasync if anything was pwritten through the ordering since the
    /// last one (a write-through commit: nothing to do when another
    /// commit's fdatasync already covered its metadata).
    pub fn sync_if_unsynced(&self) -> io::Result<()> {
        match &self.order {
            Some(order) => {
                let mut o = lock(order);
                self.write_out(&mut o)?;
                if o.unsynced != 0 {
                    self.fdatasync(&mut o)?;
                }
                Ok(())
            }
            None => self.file.sync_data(),
        }
    }

    /// A guest-data pwrite of the harness or engine, recorded in the journal
    /// when there is one (tests), in order with imago's writes.
    pub fn data_write(&self, data: &[u8], offset: u64) -> io::Result<()> {
        match (&self.order, &self.journal) {
            (Some(order), Some(_)) => {
                let _o = lock(order);
                self.pwrite(data, offset)
            }
            _ => self.file.write_all_at(data, offset),
        }
    }
}

/// pwritev of every byte of `iovecs` at `offset`, short writes continued.
///
/// # Safety
/// Every iovec points to memory readable for its length for the whole
/// call.
unsafe fn pwritev_all(file: &File, iovecs: &[libc::iovec], offset: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut iovecs = iovecs.to_vec();
    let mut first = 0;
    let mut offset = offset;
    while first < iovecs.len() {
        let rest = &iovecs[first..];
        let count = rest.len().min(libc::UIO_MAXIOV as usize) as libc::c_int;
        // SAFETY: `rest` holds `count` iovecs, each readable for its
        // length (the caller's promise, kept by the advancing below,
        // which only shortens them from the front).
        let n = unsafe { libc::pwritev(file.as_raw_fd(), rest.as_ptr(), count, offset as i64) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwritev wrote nothing",
            ));
        }
        let mut n = n as usize;
        offset += n as u64;
        while n > 0 {
            let v = &mut iovecs[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                // SAFETY: moves the base forward inside its own buffer.
                v.iov_base = unsafe { (v.iov_base as *mut u8).add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
        while first < iovecs.len() && iovecs[first].iov_len == 0 {
            first += 1;
        }
    }
    Ok(())
}

/// Refuses a layout whose metadata structures share clusters.
fn check_layout(o: &Order) -> io::Result<()> {
    let cb = o.cluster_bits;
    let range = |off: u64, len: u64| (off >> cb)..(off + len.max(1)).div_ceil(1 << cb);
    let l1 = range(o.l1_offset, o.l1_len);
    let rt = range(o.rt_offset, o.rt_len);
    let bad = |what: &str| {
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("overlapping metadata: {what}"),
        ))
    };
    if l1.contains(&0) || rt.contains(&0) {
        return bad("a table overlaps the header");
    }
    if l1.start < rt.end && rt.start < l1.end {
        return bad("the L1 table overlaps the refcount table");
    }
    for (set, name) in [
        (&o.l2_clusters, "an L2 table"),
        (&o.rb_clusters, "a refblock"),
    ] {
        for &c in set {
            if c == 0 || l1.contains(&c) || rt.contains(&c) {
                return bad(&format!(
                    "{name} at cluster {c} overlaps the header or a top table"
                ));
            }
        }
    }
    if let Some(c) = o.l2_clusters.intersection(&o.rb_clusters).next() {
        return bad(&format!("cluster {c} is both an L2 table and a refblock"));
    }
    Ok(())
}

/// The bytes [`FileState::hold`] compares a table in at a time before
/// it looks for the changed words (a multiple of 8).
const DIFF_BLOCK: usize = 256;

/// Entry by entry, the larger of two refblocks' refcounts (`bits` wide:
/// big-endian from 8 bits on, packed from the low bits of a byte below).
fn refcount_max(a: &[u8], b: &[u8], bits: u32) -> Vec<u8> {
    if bits >= 8 {
        // Big-endian entries of equal width compare as numbers when
        // compared as byte strings. One allocation for the block (a
        // Vec per entry was half the CPU of an allocating write).
        let w = (bits / 8) as usize;
        let mut out = Vec::with_capacity(a.len());
        if w == 2 {
            // The default width (refcount_order 4), as u16s.
            for (x, y) in a.chunks_exact(2).zip(b.chunks_exact(2)) {
                let (x, y) = ([x[0], x[1]], [y[0], y[1]]);
                out.extend_from_slice(
                    &u16::from_be_bytes(x)
                        .max(u16::from_be_bytes(y))
                        .to_be_bytes(),
                );
            }
        } else {
            for (x, y) in a.chunks(w).zip(b.chunks(w)) {
                out.extend_from_slice(if x > y { x } else { y });
            }
        }
        out
    } else {
        let mask = (1u8 << bits) - 1;
        a.iter()
            .zip(b)
            .map(|(&x, &y)| {
                (0..8 / bits).fold(0u8, |acc, i| {
                    let sh = i * bits;
                    acc | (((x >> sh) & mask).max((y >> sh) & mask) << sh)
                })
            })
            .collect()
    }
}

/// Whether a write of `data` at `offset` covers the byte of the mark.
fn covers_mark(data: &[u8], offset: u64) -> bool {
    offset <= MARK_BYTE && MARK_BYTE < offset + data.len() as u64
}

/// Sets (`on`) or clears [`l2log::MARK`] in `buf`, read from or to be
/// written at file offset `offset`, if it covers the mark's byte.
fn patch_mark(buf: &mut [u8], offset: u64, on: bool) {
    patch_bit(buf, offset, MARK_BYTE, MARK_BIT, on);
}

/// Sets (`on`) or clears `bit` of the file's byte `byte` in `buf`, read
/// from or to be written at file offset `offset`, if it covers it.
fn patch_bit(buf: &mut [u8], offset: u64, byte: u64, bit: u8, on: bool) {
    if offset <= byte && byte < offset + buf.len() as u64 {
        let b = &mut buf[(byte - offset) as usize];
        *b = if on { *b | bit } else { *b & !bit };
    }
}

/// Copies the part of `data` (at file offset `at`) that falls within `buf`
/// (at file offset `offset`) into `buf`.
fn overlay(buf: &mut [u8], offset: u64, data: &[u8], at: u64) {
    let start = offset.max(at);
    let end = (offset + buf.len() as u64).min(at + data.len() as u64);
    if start < end {
        let (b, d) = ((start - offset) as usize, (start - at) as usize);
        let n = (end - start) as usize;
        buf[b..b + n].copy_from_slice(&data[d..d + n]);
    }
}

impl fmt::Debug for ChainFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChainFile")
            .field("path", &self.0.path)
            .field("index", &self.0.index())
            .finish()
    }
}

impl fmt::Display for ChainFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.path.display())
    }
}

impl Storage for ChainFile {
    fn size(&self) -> io::Result<u64> {
        Ok(self.0.size.load(Ordering::Relaxed))
    }

    fn get_filename(&self) -> Option<PathBuf> {
        Some(self.0.path.clone())
    }

    unsafe fn pure_readv(&self, bufv: IoVectorMut<'_>, mut offset: u64) -> io::Result<()> {
        // A table or cluster that starts past the end of the file is a
        // corrupt (or hostile) pointer: an error, not zeroes. (A read that
        // only ends past it, e.g. a compressed cluster's rounded length,
        // gets zeroes for the tail.)
        if offset >= self.0.size.load(Ordering::Relaxed) {
            let len = self.0.file.metadata()?.len();
            self.0.size.fetch_max(len, Ordering::Relaxed);
            if offset >= len && !bufv.is_empty() {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "{}: read at {offset:#x} is past the end of the file ({len} bytes)",
                        self.0.path.display()
                    ),
                ));
            }
        }
        let guard = self.0.order.as_ref().map(lock);
        for mut slice in bufv.into_inner() {
            let buf: &mut [u8] = &mut slice;
            self.0.read_overlaid(guard.as_deref(), buf, offset)?;
            offset += buf.len() as u64;
        }
        Ok(())
    }

    unsafe fn pure_writev(&self, bufv: IoVector<'_>, offset: u64) -> io::Result<()> {
        let mut data = vec![0u8; bufv.len() as usize];
        bufv.copy_into_slice(&mut data);
        self.0.ordered_write(data, offset)
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.0.sync_now()
    }

    unsafe fn invalidate_cache(&self) -> io::Result<()> {
        Ok(())
    }

    fn get_storage_helper(&self) -> &CommonStorageHelper {
        &self.0.helper
    }

    fn resize(&self, new_size: u64, _prealloc: imago::storage::PreallocateMode) -> io::Result<()> {
        if self.0.order.as_ref().is_none_or(|o| lock(o).frozen) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "resize of a read-only file of the chain",
            ));
        }
        self.0.file.set_len(new_size)?;
        self.0.size.store(new_size, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::refcount_max;

    #[test]
    fn refcount_max_by_width() {
        // 16-bit entries: [1, 0] vs [0, 2] -> [1, 2]
        assert_eq!(
            refcount_max(&[0, 1, 0, 0], &[0, 0, 0, 2], 16),
            vec![0, 1, 0, 2]
        );
        // 8-bit entries compare as numbers, not bytes of the pair.
        assert_eq!(refcount_max(&[5, 0], &[3, 9], 8), vec![5, 9]);
        // 16-bit entries across bytes: 0x0100 > 0x00ff.
        assert_eq!(
            refcount_max(&[1, 0, 0, 0xff], &[0, 0xff, 1, 0], 16),
            vec![1, 0, 1, 0]
        );
        // 32- and 64-bit entries.
        assert_eq!(
            refcount_max(&[0, 0, 1, 0, 0, 0, 0, 9], &[0, 0, 0, 0xff, 0, 0, 1, 0], 32),
            vec![0, 0, 1, 0, 0, 0, 1, 0]
        );
        assert_eq!(
            refcount_max(&[0, 0, 0, 0, 0, 0, 0, 7], &[0, 0, 0, 0, 0, 0, 1, 0], 64),
            vec![0, 0, 0, 0, 0, 0, 1, 0]
        );
        // 1-bit entries, LSB first: 0b0101 vs 0b0011 -> 0b0111
        assert_eq!(refcount_max(&[0b0101], &[0b0011], 1), vec![0b0111]);
        // 4-bit entries: 0x2f vs 0x31 -> 0x3f
        assert_eq!(refcount_max(&[0x2f], &[0x31], 4), vec![0x3f]);
    }
}
