//! Dirty bitmaps: changed-block tracking for incremental backup
//! (docs/backup.md).
//!
//! A [`DirtyBitmap`] has one bit per `granularity` bytes of the disk (64 KiB
//! by default, a power of two of at least 512, as qcow2 allows). Any thread
//! marks a byte range with [`DirtyBitmap::mark`]: one relaxed load per 64
//! bits, and an atomic OR only where a bit is still clear, so a write to an
//! already dirty cluster does not dirty a cache line other queues share.
//!
//! The bits live either on the heap ([`DirtyBitmap::new`]: the frozen copy a
//! backup exports) or in a shared file mapping
//! ([`sidecar`]: the persistent bitmaps of a raw image or block device),
//! where a set bit is in the page cache the moment `mark` returns: a kill -9
//! of the daemon loses nothing it acknowledged. A mapped file that another
//! program truncates does not kill the daemon: [`fault`] contains the
//! SIGBUS, and the bitmap reports itself inconsistent. What survives a host crash
//! is decided by the [`BitmapStore`] that persists them; qcow2's own bitmap
//! directory is behind the same trait (its store is in `crate::disk`, above).
//!
//! This module stands alone: it knows nothing of the worker or the engine.
//! Phase 2 calls `mark` where a write, discard or write-zeroes is admitted,
//! before it is submitted, so that no completion the guest sees can be
//! missing from a bitmap.

pub mod fault;
pub mod sidecar;

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use memmap2::MmapRaw;

pub use sidecar::SidecarStore;

/// The default granularity: 64 KiB, as QEMU's.
pub const DEFAULT_GRANULARITY: u64 = 64 << 10;
/// The smallest granularity: one sector.
pub const MIN_GRANULARITY: u64 = 512;
/// The largest granularity qcow2's bitmap extension allows (2 GiB).
pub const MAX_GRANULARITY: u64 = 1 << 31;
/// The longest bitmap name.
pub const MAX_NAME_LEN: usize = 64;

/// What can go wrong with a bitmap or its store.
#[derive(Debug, thiserror::Error)]
pub enum BitmapError {
    /// A granularity that is not a power of two in 512 B..=2 GiB.
    #[error("granularity {0} is not a power of two between 512 and 2 GiB")]
    Granularity(u64),
    /// A name outside the allowed alphabet or length.
    #[error(
        "bitmap name '{0}' is not 1 to 64 characters of A-Z a-z 0-9 . _ - (not starting with . or -)"
    )]
    Name(String),
    /// `add` of a name that exists.
    #[error("bitmap '{0}' already exists")]
    Exists(String),
    /// `remove` or `open` of a name that does not.
    #[error("no bitmap '{0}'")]
    NotFound(String),
    /// A disk too large for a bitmap held in memory at this granularity.
    #[error(
        "a bitmap of a {size}-byte disk at granularity {granularity} is too large (at most {MAX_BITMAP_BYTES} bytes of bits): choose a larger --granularity"
    )]
    TooLarge { size: u64, granularity: u64 },
    /// Two bitmaps of different geometries where one must become the other.
    #[error("bitmaps of different sizes or granularities")]
    Mismatch,
    /// A stored bitmap that cannot be loaded.
    #[error("{path}: {why}")]
    Corrupt { path: String, why: String },
    /// A stored bitmap's file that exists but cannot be opened or read (a
    /// FIFO, a directory, a symlink, no permission): one line naming the
    /// file and what to do.
    #[error("{0}")]
    Unusable(String),
    /// The store's I/O.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Checks a granularity and returns its log2.
pub fn granularity_shift(granularity: u64) -> Result<u32, BitmapError> {
    if !granularity.is_power_of_two() || !(MIN_GRANULARITY..=MAX_GRANULARITY).contains(&granularity)
    {
        return Err(BitmapError::Granularity(granularity));
    }
    Ok(granularity.trailing_zeros())
}

/// Checks a bitmap name: 1 to 64 bytes of `A-Z a-z 0-9 . _ -`, not starting
/// with `.` or `-`. The name becomes part of a file name (the sidecar) and
/// of an NBD metadata context (`qemu:dirty-bitmap:NAME`), so nothing that
/// could be a path, an option or a separator gets in.
pub fn check_name(name: &str) -> Result<(), BitmapError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(BitmapError::Name(name.escape_debug().to_string()))
    }
}

/// The most bits one bitmap may hold, in bytes: 1 GiB, as QEMU's
/// bitmaps in a qcow2 image may hold at most in all (a 4 TiB disk at 512
/// bytes a bit, a 512 PiB one at 64 KiB).
pub const MAX_BITMAP_BYTES: u64 = 1 << 30;

/// Where a bitmap's words live.
enum Words {
    Heap(Box<[AtomicU64]>),
    /// A shared, read-write mapping of at least `len` words of a file,
    /// watched for the file shrinking under it ([`fault`]).
    Mapped {
        /// Declared before `map`: unwatched before it is unmapped.
        watched: fault::Watched,
        map: MmapRaw,
        len: usize,
        /// The file, for the ERROR line.
        path: String,
        /// That line was logged.
        reported: AtomicBool,
    },
}

impl Words {
    fn heap(len: usize) -> Words {
        Words::Heap((0..len).map(|_| AtomicU64::new(0)).collect())
    }

    fn as_slice(&self) -> &[AtomicU64] {
        match self {
            Words::Heap(w) => w,
            // SAFETY: `map` is a live MAP_SHARED read-write mapping of at
            // least `len * 8` bytes (checked where it is made, in
            // sidecar.rs), page-aligned and so aligned for AtomicU64, which
            // has u64's size and layout; it lives as long as `self`, which
            // the slice borrows. The memory is only ever accessed through
            // atomics here; a write to the file by another process is
            // a change of the bits' values, not a data race in this one's
            // terms (the kernel keeps the page cache coherent). A page
            // past the end of a file truncated under us is replaced by a
            // zero page on first access (`fault`), not a dangling one.
            Words::Mapped { map, len, .. } => unsafe {
                std::slice::from_raw_parts(map.as_ptr().cast::<AtomicU64>(), *len)
            },
        }
    }
}

/// One dirty bitmap of a disk: a bit per granule, set by [`mark`](Self::mark)
/// from any thread.
pub struct DirtyBitmap {
    shift: u32,
    disk_size: u64,
    bits: u64,
    words: Words,
    /// False when the bitmap may lack changes (the host stopped while it
    /// was in use): a backup tool must then copy everything.
    consistent: AtomicBool,
    /// How many times [`set_inconsistent`](Self::set_inconsistent) was
    /// called: a backup compares it at its start and its end, to tell
    /// whether the bitmap lost changes while it ran.
    losses: AtomicU64,
}

impl fmt::Debug for DirtyBitmap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DirtyBitmap")
            .field("granularity", &self.granularity())
            .field("disk_size", &self.disk_size)
            .field("consistent", &self.is_consistent())
            .finish_non_exhaustive()
    }
}

/// The number of granules (bits) of a disk, and of u64 words holding them.
fn geometry(disk_size: u64, shift: u32) -> (u64, u64) {
    let bits = disk_size.div_ceil(1 << shift);
    (bits, bits.div_ceil(64))
}

impl DirtyBitmap {
    /// A clean, consistent bitmap of a `disk_size`-byte disk, on the heap.
    pub fn new(disk_size: u64, granularity: u64) -> Result<DirtyBitmap, BitmapError> {
        let shift = granularity_shift(granularity)?;
        let (bits, words) = geometry(disk_size, shift);
        // 1 TiB at 512 B is 256 MiB of bits; refuse what cannot be a
        // sensible allocation rather than abort on it (a running backup
        // holds two more of the same size).
        let words = usize::try_from(words)
            .ok()
            .filter(|&w| w * 8 <= MAX_BITMAP_BYTES as usize)
            .ok_or(BitmapError::TooLarge {
                size: disk_size,
                granularity,
            })?;
        Ok(DirtyBitmap {
            shift,
            disk_size,
            bits,
            words: Words::heap(words),
            consistent: AtomicBool::new(true),
            losses: AtomicU64::new(0),
        })
    }

    /// A bitmap over a mapping the caller made of the file `path` (the
    /// sidecar store), watched for the file shrinking under it.
    fn mapped(
        disk_size: u64,
        shift: u32,
        map: MmapRaw,
        path: &str,
        consistent: bool,
    ) -> Result<DirtyBitmap, String> {
        let (bits, words) = geometry(disk_size, shift);
        let len = usize::try_from(words).map_err(|_| "too many words".to_string())?;
        if map.len() < len * 8 || map.as_ptr().align_offset(8) != 0 {
            return Err(format!(
                "mapping of {} bytes is short of {} words",
                map.len(),
                len
            ));
        }
        let watched = fault::watch(map.as_ptr() as usize, map.len())?;
        Ok(DirtyBitmap {
            shift,
            disk_size,
            bits,
            words: Words::Mapped {
                watched,
                map,
                len,
                path: path.to_string(),
                reported: AtomicBool::new(false),
            },
            consistent: AtomicBool::new(consistent),
            losses: AtomicU64::new(0),
        })
    }

    /// Whether the file under this bitmap's mapping shrank while mapped
    /// (see [`fault`]): its bits are not all in the file, and what is
    /// marked in a replaced page never reaches it. Said once, in an ERROR
    /// line, when first seen.
    fn mapping_lost(&self) -> bool {
        let Words::Mapped {
            watched,
            path,
            reported,
            ..
        } = &self.words
        else {
            return false;
        };
        if !watched.faulted() {
            return false;
        }
        if !reported.swap(true, Ordering::Relaxed) {
            log::error!(
                "{path}: the bitmap file was truncated while the daemon had it mapped (by another program): its bits are lost, and it is inconsistent from now on (take a full backup); the daemon writes it out whole, marked inconsistent, when it next stores it"
            );
        }
        true
    }

    /// A heap bitmap of a `disk_size`-byte disk from its words (a stored
    /// bitmap read back): missing words are clean, words past the disk's
    /// end and bits past its last granule are dropped.
    pub fn from_words(
        disk_size: u64,
        granularity: u64,
        words: impl IntoIterator<Item = u64>,
        consistent: bool,
    ) -> Result<DirtyBitmap, BitmapError> {
        let b = DirtyBitmap::new(disk_size, granularity)?;
        for (w, v) in b.words.as_slice().iter().zip(words) {
            w.store(v, Ordering::Relaxed);
        }
        b.trim();
        if !consistent {
            b.set_inconsistent();
        }
        Ok(b)
    }

    /// A heap copy of this bitmap for a disk resized to `disk_size` bytes:
    /// the bits of the common part kept, the grown part dirty (it reads as
    /// zeroes now, which no earlier backup has).
    pub fn resized(&self, disk_size: u64) -> Result<DirtyBitmap, BitmapError> {
        let b = DirtyBitmap::from_words(
            disk_size,
            self.granularity(),
            self.words
                .as_slice()
                .iter()
                .map(|w| w.load(Ordering::Relaxed)),
            self.is_consistent(),
        )?;
        b.mark_grown(self.disk_size);
        Ok(b)
    }

    /// Marks what lies past `old_size`, when the disk grew from it.
    fn mark_grown(&self, old_size: u64) {
        if self.disk_size > old_size {
            self.mark(old_size, self.disk_size - old_size);
        }
    }

    /// Clears the bits of the last word that lie past the last granule
    /// (left there by a larger disk), so that nothing counts them.
    fn trim(&self) {
        let words = self.words.as_slice();
        let rem = self.bits % 64;
        if let Some(last) = words.last().filter(|_| rem != 0) {
            last.fetch_and((1u64 << rem) - 1, Ordering::Relaxed);
        }
    }

    /// The words, as stored: bit `i` of the bitmap is bit `i % 64` of word
    /// `i / 64` (little-endian in memory, so bit `i % 8` of byte `i / 8`).
    pub fn words(&self) -> impl Iterator<Item = u64> + '_ {
        self.words
            .as_slice()
            .iter()
            .map(|w| w.load(Ordering::Relaxed))
    }

    /// Bytes per bit.
    pub fn granularity(&self) -> u64 {
        1 << self.shift
    }

    /// The size of the disk the bitmap covers.
    pub fn disk_size(&self) -> u64 {
        self.disk_size
    }

    /// Whether every change since the bitmap was added (or last cleared) is
    /// in it. Never again, for a mapped bitmap whose file shrank under it
    /// (until it is loaded afresh).
    pub fn is_consistent(&self) -> bool {
        // The mapping first, so that its ERROR line is never skipped.
        !self.mapping_lost() && self.consistent.load(Ordering::Acquire)
    }

    /// Marks the bitmap as possibly missing changes. It stays so until
    /// [`clear`](Self::clear) (and past it, for a mapping whose file
    /// shrank).
    pub fn set_inconsistent(&self) {
        self.losses.fetch_add(1, Ordering::AcqRel);
        self.consistent.store(false, Ordering::Release);
    }

    /// How many times this bitmap was marked inconsistent since it was
    /// made: a change of it between two reads means changes may have been
    /// lost in between.
    pub fn losses(&self) -> u64 {
        self.losses.load(Ordering::Acquire)
    }

    /// Marks every granule that `[offset, offset + len)` touches. Ranges
    /// past the disk's end are clipped (the request layer refuses them
    /// before this is reached). The hot path: a load per 64 granules, and
    /// an atomic OR only for words that gain a bit.
    #[inline]
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 || offset >= self.disk_size {
            return;
        }
        let end = offset.saturating_add(len).min(self.disk_size);
        let first = offset >> self.shift;
        let last = (end - 1) >> self.shift;
        let words = self.words.as_slice();
        let (mut w, last_w) = ((first / 64) as usize, (last / 64) as usize);
        let mut lo = first % 64;
        while w <= last_w {
            let hi = if w == last_w { last % 64 } else { 63 };
            // Bits lo..=hi.
            let mask = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
            let word = &words[w];
            if word.load(Ordering::Relaxed) & mask != mask {
                word.fetch_or(mask, Ordering::Relaxed);
            }
            lo = 0;
            w += 1;
        }
    }

    /// Whether the granule holding `offset` is dirty.
    pub fn is_dirty(&self, offset: u64) -> bool {
        if offset >= self.disk_size {
            return false;
        }
        let bit = offset >> self.shift;
        self.words.as_slice()[(bit / 64) as usize].load(Ordering::Relaxed) & (1 << (bit % 64)) != 0
    }

    /// Dirty bytes: dirty granules times the granularity, the last granule
    /// counted only up to the disk's end.
    pub fn dirty_bytes(&self) -> u64 {
        let words = self.words.as_slice();
        let count: u64 = words
            .iter()
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum();
        let mut bytes = count << self.shift;
        if let Some(last) = self.bits.checked_sub(1)
            && words[(last / 64) as usize].load(Ordering::Relaxed) & (1 << (last % 64)) != 0
        {
            bytes -= (self.bits << self.shift) - self.disk_size;
        }
        bytes
    }

    /// The run of granules in the same state as the one at `offset`:
    /// `(length, dirty)`, the length at most `max_len` and never past the
    /// disk's end. `offset` must be inside the disk.
    pub fn extent_at(&self, offset: u64, max_len: u64) -> (u64, bool) {
        debug_assert!(offset < self.disk_size);
        let words = self.words.as_slice();
        let limit = offset.saturating_add(max_len).min(self.disk_size);
        let limit_bit = (limit - 1) >> self.shift;
        let mut bit = offset >> self.shift;
        let dirty = words[(bit / 64) as usize].load(Ordering::Relaxed) & (1 << (bit % 64)) != 0;
        // Find the first bit past `bit` whose state differs.
        loop {
            let w = words[(bit / 64) as usize].load(Ordering::Relaxed);
            let w = if dirty { !w } else { w };
            let rest = w >> (bit % 64);
            if rest != 0 {
                bit += u64::from(rest.trailing_zeros());
                break;
            }
            bit = (bit / 64 + 1) * 64;
            if bit > limit_bit {
                break;
            }
        }
        let end = (bit << self.shift).min(limit);
        (end - offset, dirty)
    }

    /// Dirty extents of the whole disk, in order: `(offset, length)`.
    pub fn dirty_extents(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut off = 0;
        while off < self.disk_size {
            let (len, dirty) = self.extent_at(off, u64::MAX);
            if dirty {
                out.push((off, len));
            }
            off += len;
        }
        out
    }

    /// Clears every bit and makes the bitmap consistent: it records
    /// afresh from now on.
    pub fn clear(&self) {
        for w in self.words.as_slice() {
            w.store(0, Ordering::Relaxed);
        }
        self.consistent.store(true, Ordering::Release);
    }

    /// A heap copy of the bits as they are now, with this bitmap's
    /// consistency. This is what a backup exports (`qemu:dirty-bitmap:`)
    /// while this bitmap keeps every bit it had and goes on recording: its
    /// bits leave it only when the backup is known to have ended well
    /// ([`replace_with`](Self::replace_with)). Taken with no mark in
    /// flight, it is exact.
    pub fn copy(&self) -> DirtyBitmap {
        DirtyBitmap {
            shift: self.shift,
            disk_size: self.disk_size,
            bits: self.bits,
            words: Words::Heap(
                self.words
                    .as_slice()
                    .iter()
                    .map(|w| AtomicU64::new(w.load(Ordering::Relaxed)))
                    .collect(),
            ),
            consistent: AtomicBool::new(self.is_consistent()),
            losses: AtomicU64::new(0),
        }
    }

    /// Makes this bitmap's bits `other`'s, and the bitmap consistent if
    /// `other` is: a backup that ended well leaves its bitmap with what
    /// was recorded since its instant (`other`, which every later mark
    /// reached too) and nothing of what it exported. Call it with no mark
    /// in flight. Word by word: a crash half-way leaves each word with its
    /// old bits (a superset, since every mark since the instant reached
    /// both) or its new ones, never fewer.
    pub fn replace_with(&self, other: &DirtyBitmap) -> Result<(), BitmapError> {
        if other.shift != self.shift || other.disk_size != self.disk_size {
            return Err(BitmapError::Mismatch);
        }
        for (w, o) in self.words.as_slice().iter().zip(other.words.as_slice()) {
            let bits = o.load(Ordering::Relaxed);
            if w.load(Ordering::Relaxed) != bits {
                w.store(bits, Ordering::Relaxed);
            }
        }
        self.consistent
            .store(other.is_consistent(), Ordering::Release);
        Ok(())
    }

    /// Writes a mapped bitmap's bits to its file (msync); nothing for one
    /// on the heap.
    pub fn sync(&self) -> std::io::Result<()> {
        match &self.words {
            Words::Heap(_) => Ok(()),
            Words::Mapped { map, .. } => map.flush(),
        }
    }
}

/// What `bitmap list` shows of one bitmap.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BitmapInfo {
    pub name: String,
    pub granularity: u64,
    /// Dirty granules times the granularity (the last one counted up to
    /// the disk's end).
    pub dirty_bytes: u64,
    /// Every change since it was added (or last cleared) is in it.
    pub consistent: bool,
}

impl DirtyBitmap {
    /// What `bitmap list` shows of this bitmap, called `name`.
    pub fn info(&self, name: &str) -> BitmapInfo {
        BitmapInfo {
            name: name.to_string(),
            granularity: self.granularity(),
            dirty_bytes: self.dirty_bytes(),
            consistent: self.is_consistent(),
        }
    }
}

/// Where a disk's bitmaps persist: a sidecar file per bitmap for raw images,
/// block devices and qcow2 images without QEMU's bitmaps extension
/// ([`SidecarStore`]); the image's own bitmap directory for a qcow2 image
/// with it (its store is in `crate::disk`, a layer above this one).
///
/// A store knows its bitmaps from the start; they are *loaded*
/// ([`open`](Self::open)) while the daemon holds the image (its rings
/// run, or a verb or a backup needs them) and *written out*
/// ([`close`](Self::close)) when it lets go, so that the next holder (a
/// migration's destination) loads what this one wrote.
///
/// The contract that makes "complete, or marked inconsistent" hold:
/// - `open` loads every stored bitmap, and before returning records
///   durably that they are in use; a bitmap found in use (the previous
///   owner did not `close` it) comes back inconsistent unless the store
///   can prove it complete;
/// - every bit [`DirtyBitmap::mark`] sets on a bitmap the store made is
///   found by the next `open` after a kill -9 of this process, or that
///   bitmap is reported inconsistent;
/// - `close` makes the bits durable and only then records that the bitmap
///   is no longer in use.
pub trait BitmapStore: Send {
    /// Where the bitmaps live, for messages: "sidecar files in DIR".
    fn location(&self) -> String;
    /// What `bitmap list` shows of the stored bitmaps of a
    /// `disk_size`-byte disk, read without loading them or marking them in
    /// use. A bitmap found in use after a host stop shows inconsistent, as
    /// `open` will make it.
    fn peek(&mut self, disk_size: u64) -> Result<Vec<BitmapInfo>, BitmapError>;
    /// Loads the stored bitmaps of a `disk_size`-byte disk, sorted by name,
    /// and marks them in use. One that cannot be loaded comes back as its
    /// error, and the others are loaded all the same. A bitmap of another
    /// disk size (the image was resized while no daemon held it) is
    /// resized, and inconsistent.
    fn open(&mut self, disk_size: u64) -> Vec<(String, Result<DirtyBitmap, BitmapError>)>;
    /// Creates a new, clean, consistent bitmap, in use.
    fn add(
        &mut self,
        name: &str,
        granularity: u64,
        disk_size: u64,
    ) -> Result<DirtyBitmap, BitmapError>;
    /// Deletes a bitmap's stored form.
    fn remove(&mut self, name: &str) -> Result<(), BitmapError>;
    /// Records durably whether the stored bitmap can be trusted, its bits
    /// aside: `consistent` false when it lost changes; true again after a
    /// backup that succeeded (the bits, which then lost what the backup
    /// exported, are made durable first).
    fn update(
        &mut self,
        name: &str,
        bitmap: &DirtyBitmap,
        consistent: bool,
    ) -> Result<(), BitmapError>;
    /// The disk was resized: the bitmap covers `disk_size` bytes from now
    /// on, what it had of the common part kept, a grown part dirty. The
    /// old bitmap must not be marked any more.
    fn resize(
        &mut self,
        name: &str,
        bitmap: &DirtyBitmap,
        disk_size: u64,
    ) -> Result<DirtyBitmap, BitmapError>;
    /// Clean stop: the bits durable, then the bitmap no longer in use.
    fn close(&mut self, name: &str, bitmap: &DirtyBitmap) -> Result<(), BitmapError>;
    /// A live snapshot is about to freeze the top while the bitmaps are
    /// open, and put a new one above it (called with every request kept
    /// out and none in flight: `bitmaps`, every open bitmap by name, are
    /// exact for the old top, which is written no more). A store that
    /// keeps the bitmaps in the image has the old top keep them as they
    /// are now, consistent, as QEMU stores the bitmaps of a node that
    /// becomes read-only; sidecars go by the named image and need nothing.
    fn top_freezes(&mut self, bitmaps: &[(&str, &DirtyBitmap)]) -> Result<(), BitmapError> {
        let _ = bitmaps;
        Ok(())
    }
    /// A live snapshot put a new top above the image while the bitmaps
    /// are open (called with every request kept out). A store that keeps
    /// the bitmaps in the image makes the new top hold them; sidecars go
    /// by the named image and need nothing.
    fn top_moved(&mut self) -> Result<(), BitmapError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 64 << 10;

    #[test]
    fn granularity_and_names_are_checked() {
        assert!(granularity_shift(512).is_ok());
        assert!(granularity_shift(G).is_ok());
        assert!(granularity_shift(256).is_err());
        assert!(granularity_shift(3 << 10).is_err());
        assert!(granularity_shift(1 << 32).is_err());
        for ok in ["a", "nightly", "backup-vda.1", "A_b-c.d", &"x".repeat(64)] {
            check_name(ok).unwrap();
        }
        for bad in [
            "",
            ".hidden",
            "-opt",
            "a/b",
            "a b",
            "ä",
            "a:b",
            &"x".repeat(65),
        ] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn marks_cover_every_touched_granule() {
        let size = 10 * G + 512; // a partial last granule
        let b = DirtyBitmap::new(size, G).unwrap();
        b.mark(G - 1, 2); // straddles granules 0 and 1
        b.mark(5 * G, G); // exactly granule 5
        b.mark(10 * G + 100, 1 << 40); // clipped at the end
        b.mark(size, 4096); // past the end: nothing
        b.mark(3 * G, 0); // empty: nothing
        let dirty: Vec<u64> = (0..11).filter(|i| b.is_dirty(i * G)).collect();
        assert_eq!(dirty, [0, 1, 5, 10]);
        assert_eq!(b.dirty_bytes(), 3 * G + 512);
        assert_eq!(b.dirty_extents(), [(0, 2 * G), (5 * G, G), (10 * G, 512)]);
    }

    #[test]
    fn marks_across_words() {
        let b = DirtyBitmap::new(300 * G, G).unwrap();
        b.mark(60 * G, 140 * G); // bits 60..=199, over four words
        assert_eq!(b.dirty_extents(), [(60 * G, 140 * G)]);
        assert_eq!(b.dirty_bytes(), 140 * G);
        assert_eq!(b.extent_at(0, u64::MAX), (60 * G, false));
        assert_eq!(b.extent_at(61 * G + 7, 10 * G), (10 * G, true));
        assert_eq!(b.extent_at(199 * G, u64::MAX), (G, true));
        assert_eq!(b.extent_at(200 * G, u64::MAX), (100 * G, false));
    }

    #[test]
    fn a_copy_keeps_the_bits_and_replace_with_ends_the_backup() {
        let b = DirtyBitmap::new(100 * G, G).unwrap();
        b.mark(0, G);
        b.mark(70 * G, 3 * G);
        let frozen = b.copy();
        let since = DirtyBitmap::new(100 * G, G).unwrap();
        // The bitmap keeps its bits while the backup runs; a later write
        // marks both it and the record since the instant.
        assert_eq!(b.dirty_extents(), [(0, G), (70 * G, 3 * G)]);
        assert_eq!(frozen.dirty_extents(), [(0, G), (70 * G, 3 * G)]);
        b.mark(10 * G, G);
        since.mark(10 * G, G);
        assert_eq!(b.dirty_extents(), [(0, G), (10 * G, G), (70 * G, 3 * G)]);
        assert_eq!(frozen.dirty_bytes(), 4 * G, "the copy is frozen");
        // The backup ended well: what it exported leaves the bitmap.
        b.replace_with(&since).unwrap();
        assert_eq!(b.dirty_extents(), [(10 * G, G)]);
        let other = DirtyBitmap::new(100 * G, 2 * G).unwrap();
        assert!(matches!(b.replace_with(&other), Err(BitmapError::Mismatch)));
        // A loss is counted, and a consistent successor makes the bitmap
        // consistent again (a full backup of an inconsistent bitmap).
        let before = b.losses();
        b.set_inconsistent();
        assert_eq!(b.losses(), before + 1);
        assert!(!b.is_consistent());
        b.replace_with(&since).unwrap();
        assert!(b.is_consistent());
        b.set_inconsistent();
        b.clear();
        assert!(b.is_consistent());
        assert_eq!(b.dirty_bytes(), 0);
    }

    /// Marks from several threads at once, on shared words: none is lost.
    #[test]
    fn concurrent_marks_are_not_lost() {
        let b = std::sync::Arc::new(DirtyBitmap::new(4096 * 512, 512).unwrap());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let b = b.clone();
                std::thread::spawn(move || {
                    for i in (t..4096).step_by(4) {
                        b.mark(i * 512, 512);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(b.dirty_bytes(), 4096 * 512);
    }

    #[test]
    fn a_huge_disk_at_a_tiny_granularity_is_refused() {
        assert!(matches!(
            DirtyBitmap::new(u64::MAX, 512),
            Err(BitmapError::TooLarge { .. })
        ));
        // Just over 1 GiB of bits: refused, with the way out.
        let e = DirtyBitmap::new((4 << 40) + 512, 512).unwrap_err();
        assert!(
            e.to_string().contains("choose a larger --granularity"),
            "{e}"
        );
    }
}
