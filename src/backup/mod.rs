//! The point-in-time view a backup exports (docs/backup.md): the disk as
//! it was at one instant, while the guest keeps writing.
//!
//! It is copy-before-write (CBW): before a guest write, discard or
//! write-zeroes reaches a cluster of the disk that was not copied yet, [`CbwStore::before_write`] copies the
//! cluster's old data into a temporary sparse file (unlinked: it goes away
//! with the store). The [`View`] reads a cluster from that file if it was
//! copied, else from the image.
//!
//! A view's read of the image and a guest's CBW copy of the same cluster
//! cannot interleave wrongly. Each cluster has two bits: *claimed* (a
//! copier took it) and *copied* (its old data is in the store). The guest
//! side writes the image only after *copied* is set. The view reads the
//! image, and then checks *copied*: still clear means no guest write to
//! that cluster can have reached the image before the read finished, so
//! the data is the old data; set means the read may have raced one, and it
//! is read again from the store, which by then holds the old data. The
//! guest's path costs a few loads per cluster once a cluster is copied
//! (one per level of [`ClusterBits`]), and takes no lock. The bits'
//! memory follows the clusters copied, not the disk's size.
//!
//! It stands on the small [`Image`] trait, the guest's disk, not on the
//! engine: a raw image or block device is its file ([`FileImage`]); a
//! qcow2 image through its chain, by the disk's one reader
//! ([`Reader`]); a LUKS image's payload decrypted by that reader
//! ([`Decrypted`]), so that the view, and the store, hold the guest's
//! plaintext (docs/backup.md says why the store is not encrypted). The
//! engine core
//! calls `before_write` where a write is admitted, before the format maps
//! it and before it is submitted.

pub mod archive;

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use crate::bitmap::DirtyBitmap;
use crate::disk::reader::{Decrypted, Reader};
use crate::nbd::proto::{STATE_DIRTY, STATE_HOLE, STATE_ZERO};
use crate::nbd::{Export, MetaContext};

/// The default CBW cluster: 64 KiB, as QEMU's backup job.
pub const DEFAULT_CLUSTER: u64 = 64 << 10;

/// The guest's disk under the view, as the view needs it.
pub trait Image: Send + Sync {
    /// Its size in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` from `offset` (inside the image).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// The allocation at `offset`: the length of the run that shares it
    /// (1 to `max_len`) and its `base:allocation` flags (0 when unknown).
    fn allocation(&self, offset: u64, max_len: u64) -> io::Result<(u64, u32)>;
}

/// `lseek(SEEK_DATA/SEEK_HOLE)` status of a file at `offset`, up to
/// `max_len`: a hole reads as zeroes. A file or device that cannot say
/// is all data.
fn seek_allocation(file: &File, offset: u64, max_len: u64) -> io::Result<(u64, u32)> {
    let fd = file.as_raw_fd();
    let seek = |whence| {
        // SAFETY: lseek takes no pointers. The fd's position moves, which
        // nothing here uses: every read is positional.
        let r = unsafe { libc::lseek(fd, offset as libc::off_t, whence) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as u64)
        }
    };
    let unknown = |e: &io::Error| matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP));
    match seek(libc::SEEK_DATA) {
        // No data from here to the end of the file.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok((max_len, STATE_HOLE | STATE_ZERO)),
        Err(e) if unknown(&e) => Ok((max_len, 0)),
        Err(e) => Err(e),
        Ok(data) if data > offset => Ok(((data - offset).min(max_len), STATE_HOLE | STATE_ZERO)),
        Ok(_) => match seek(libc::SEEK_HOLE) {
            Ok(hole) if hole > offset => Ok(((hole - offset).min(max_len), 0)),
            Ok(_) => Ok((max_len, 0)),
            Err(e) if unknown(&e) || e.raw_os_error() == Some(libc::ENXIO) => Ok((max_len, 0)),
            Err(e) => Err(e),
        },
    }
}

/// A raw image file or block device, read with `pread`.
pub struct FileImage {
    file: File,
    size: u64,
}

impl FileImage {
    /// Opens `path` read-only.
    pub fn open(path: &Path) -> io::Result<FileImage> {
        FileImage::new(File::open(path)?)
    }

    /// Wraps an open file or block device of `size` bytes (the device's
    /// size as the daemon knows it; no syscall).
    pub fn with_size(file: File, size: u64) -> FileImage {
        FileImage { file, size }
    }

    /// Wraps an open file or block device.
    pub fn new(file: File) -> io::Result<FileImage> {
        let meta = file.metadata()?;
        let size = if meta.file_type().is_block_device() {
            // SAFETY: lseek takes no pointers.
            let end = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_END) };
            if end < 0 {
                return Err(io::Error::last_os_error());
            }
            end as u64
        } else {
            meta.len()
        };
        Ok(FileImage { file, size })
    }
}

impl Image for FileImage {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    fn allocation(&self, offset: u64, max_len: u64) -> io::Result<(u64, u32)> {
        seek_allocation(&self.file, offset, max_len)
    }
}

/// An image with a chain (qcow2), read through it by the disk's one
/// reader.
impl Image for Reader {
    fn size(&self) -> u64 {
        Reader::size(self)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        Reader::read_at(self, buf, offset)
    }

    fn allocation(&self, offset: u64, max_len: u64) -> io::Result<(u64, u32)> {
        Reader::allocation(self, offset, max_len)
    }
}

/// A LUKS image's payload, decrypted by the disk's one reader; all of
/// it data for `base:allocation` (see [`Decrypted::allocation`]).
impl Image for Decrypted {
    fn size(&self) -> u64 {
        Decrypted::size(self)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        Decrypted::read_at(self, buf, offset)
    }

    fn allocation(&self, offset: u64, max_len: u64) -> io::Result<(u64, u32)> {
        Decrypted::allocation(self, offset, max_len)
    }
}

/// Bits in one leaf of [`ClusterBits`]: 512 words, 4 KiB.
const LEAF_BITS: u64 = 1 << 15;
/// Children of an inner node of [`ClusterBits`].
const FANOUT_SHIFT: u32 = 9;

/// A node of [`ClusterBits`]; a child is made the first time a bit under
/// it is set, and a child never made reads as all clear.
enum Node {
    Inner(Box<[OnceLock<Node>]>),
    Leaf(Box<[AtomicU64]>),
}

impl Node {
    fn leaf(words: usize) -> Node {
        Node::Leaf((0..words).map(|_| AtomicU64::new(0)).collect())
    }
    fn inner(children: usize) -> Node {
        Node::Inner((0..children).map(|_| OnceLock::new()).collect())
    }
}

/// A bit per cluster, set from any thread, held in a radix tree whose
/// leaves (4 KiB, 32768 clusters) and inner nodes are made on demand: its
/// memory follows the clusters set, not the disk's size (a 2 EiB disk
/// costs nothing until a cluster is copied). A disk of at most 32768
/// clusters (2 GiB at 64 KiB) is one leaf, made at once. Reading a bit
/// is a load per level and takes no lock; setting one may make the nodes
/// on its path (`OnceLock`: one of two racing threads makes each).
struct ClusterBits {
    root: Node,
    /// Levels of inner nodes above the leaves (0: the root is a leaf).
    height: u32,
}

impl ClusterBits {
    fn new(clusters: u64) -> ClusterBits {
        let mut height = 0;
        while LEAF_BITS << (FANOUT_SHIFT * height) < clusters {
            height += 1;
        }
        let root = if height == 0 {
            Node::leaf(clusters.div_ceil(64) as usize)
        } else {
            let child = LEAF_BITS << (FANOUT_SHIFT * (height - 1));
            Node::inner(clusters.div_ceil(child) as usize)
        };
        ClusterBits { root, height }
    }

    /// The word holding bit `c` and the bit's mask; with `make`, the
    /// nodes on its path are made where missing, else `None` when one is.
    fn word(&self, c: u64, make: bool) -> Option<(&AtomicU64, u64)> {
        let mut node = &self.root;
        let mut h = self.height;
        loop {
            match node {
                Node::Leaf(words) => {
                    let i = (c % LEAF_BITS) as usize;
                    return Some((&words[i / 64], 1 << (i % 64)));
                }
                Node::Inner(children) => {
                    h -= 1;
                    let shift = LEAF_BITS.trailing_zeros() + FANOUT_SHIFT * h;
                    let slot = &children[((c >> shift) % (1 << FANOUT_SHIFT)) as usize];
                    node = if make {
                        slot.get_or_init(|| {
                            if h == 0 {
                                Node::leaf((LEAF_BITS / 64) as usize)
                            } else {
                                Node::inner(1 << FANOUT_SHIFT)
                            }
                        })
                    } else {
                        slot.get()?
                    };
                }
            }
        }
    }

    fn get(&self, c: u64) -> bool {
        self.word(c, false)
            .is_some_and(|(w, bit)| w.load(Ordering::SeqCst) & bit != 0)
    }

    /// Sets the bit; returns whether it was clear.
    fn set(&self, c: u64) -> bool {
        let (w, bit) = self.word(c, true).expect("made on the way");
        w.fetch_or(bit, Ordering::SeqCst) & bit == 0
    }
}

/// What a store has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CbwStats {
    /// Clusters copied before a guest write.
    pub copied_clusters: u64,
    /// Of those, bytes written to the store (all-zero clusters are not).
    pub stored_bytes: u64,
}

/// The copy-before-write store of one point-in-time view.
pub struct CbwStore {
    image: Arc<dyn Image>,
    /// Old data of copied clusters, at their own offsets; sparse, unlinked.
    store: File,
    size: u64,
    shift: u32,
    claimed: ClusterBits,
    copied: ClusterBits,
    /// Set when a copy failed: the view can no longer be trusted, and its
    /// reads fail. The guest's writes go on regardless.
    failed: AtomicBool,
    waiters: (Mutex<()>, Condvar),
    copied_clusters: AtomicU64,
    stored_bytes: AtomicU64,
}

impl CbwStore {
    /// A view of `image` as it is now, with its store in `store_dir`. From
    /// now on every guest write must call [`before_write`](Self::before_write)
    /// first. `cluster` is a power of two of at least 4 KiB.
    pub fn new(image: Arc<dyn Image>, store_dir: &Path, cluster: u64) -> io::Result<CbwStore> {
        CbwStore::with_file(image, tempfile::tempfile_in(store_dir)?, cluster)
    }

    /// [`CbwStore::new`] with its store in `store`, a file nobody else
    /// uses (the daemon's: unlinked, opened at start-up), whose contents
    /// are dropped: it is truncated to nothing, then made as long as the
    /// image (sparse).
    pub fn with_file(image: Arc<dyn Image>, store: File, cluster: u64) -> io::Result<CbwStore> {
        if !cluster.is_power_of_two() || !(4096..=(64 << 20)).contains(&cluster) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("cluster size {cluster} is not a power of two in 4 KiB..=64 MiB"),
            ));
        }
        let size = image.size();
        store.set_len(0)?;
        store.set_len(size)?;
        let clusters = size.div_ceil(cluster);
        Ok(CbwStore {
            image,
            store,
            size,
            shift: cluster.trailing_zeros(),
            claimed: ClusterBits::new(clusters),
            copied: ClusterBits::new(clusters),
            failed: AtomicBool::new(false),
            waiters: (Mutex::new(()), Condvar::new()),
            copied_clusters: AtomicU64::new(0),
            stored_bytes: AtomicU64::new(0),
        })
    }

    /// The cluster size.
    pub fn cluster(&self) -> u64 {
        1 << self.shift
    }

    /// The size of the view.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// What the store has done.
    pub fn stats(&self) -> CbwStats {
        CbwStats {
            copied_clusters: self.copied_clusters.load(Ordering::Relaxed),
            stored_bytes: self.stored_bytes.load(Ordering::Relaxed),
        }
    }

    /// Whether a copy failed (the view's reads fail from then on).
    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    fn cluster_range(&self, c: u64) -> (u64, usize) {
        let start = c << self.shift;
        (start, (self.size - start).min(1 << self.shift) as usize)
    }

    /// Before a guest write, discard or write-zeroes of
    /// `[offset, offset + len)` reaches the image: copies the old data of
    /// every cluster it touches that was not copied yet, or waits for the
    /// copier that took it. When this returns, the write may go ahead.
    /// A failed copy never fails the guest's write: it fails the view.
    pub fn before_write(&self, offset: u64, len: u64) {
        if len == 0 || offset >= self.size {
            return;
        }
        let end = offset.saturating_add(len).min(self.size);
        let mut buf = Vec::new();
        for c in (offset >> self.shift)..=((end - 1) >> self.shift) {
            if self.copied.get(c) {
                continue;
            }
            if self.claimed.set(c) {
                self.copy(c, &mut buf);
            } else {
                let (lock, cv) = &self.waiters;
                let mut g = lock.lock().unwrap_or_else(|p| p.into_inner());
                while !self.copied.get(c) {
                    g = cv.wait(g).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }

    fn copy(&self, c: u64, buf: &mut Vec<u8>) {
        let (start, n) = self.cluster_range(c);
        buf.resize(n, 0);
        let copied = self.image.read_at(buf, start).and_then(|()| {
            if buf.iter().all(|&b| b == 0) {
                // The store's hole reads as these zeroes.
                Ok(0)
            } else {
                self.store.write_all_at(buf, start).map(|()| n as u64)
            }
        });
        match copied {
            Ok(stored) => {
                self.copied_clusters.fetch_add(1, Ordering::Relaxed);
                self.stored_bytes.fetch_add(stored, Ordering::Relaxed);
            }
            Err(e) => {
                if !self.failed.swap(true, Ordering::AcqRel) {
                    log::error!(
                        "backup: copy-before-write of cluster at {start} failed: {e}; the backup view fails from now on, the guest's writes go on"
                    );
                }
            }
        }
        self.copied.set(c);
        let (lock, cv) = &self.waiters;
        drop(lock.lock().unwrap_or_else(|p| p.into_inner()));
        cv.notify_all();
    }

    fn failed_err() -> io::Error {
        io::Error::other("a copy-before-write failed: this backup view is incomplete")
    }

    /// Reads the view at `offset` (inside it).
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let end = offset + buf.len() as u64;
        let mut pos = offset;
        while pos < end {
            let c = pos >> self.shift;
            let from_store = self.copied.get(c);
            // The run of clusters in the same state, up to `end`.
            let mut run_end = ((c + 1) << self.shift).min(end);
            while run_end < end && self.copied.get(run_end >> self.shift) == from_store {
                run_end = (run_end + self.cluster()).min(end);
            }
            let part = &mut buf[(pos - offset) as usize..(run_end - offset) as usize];
            if from_store {
                if self.has_failed() {
                    return Err(Self::failed_err());
                }
                self.store.read_exact_at(part, pos)?;
            } else {
                self.image.read_at(part, pos)?;
                // A cluster copied meanwhile may have been overwritten
                // while it was read: read it again from the store.
                let mut p = pos;
                while p < run_end {
                    let q = (((p >> self.shift) + 1) << self.shift).min(run_end);
                    if self.copied.get(p >> self.shift) {
                        if self.has_failed() {
                            return Err(Self::failed_err());
                        }
                        let s = &mut part[(p - pos) as usize..(q - pos) as usize];
                        self.store.read_exact_at(s, p)?;
                    }
                    p = q;
                }
            }
            pos = run_end;
        }
        Ok(())
    }

    /// The view's `base:allocation` at `offset`, as [`Image::allocation`].
    /// Its work follows its answer: the image bounds what one call of
    /// its own examines, and only the clusters of that answer are checked.
    pub fn allocation(&self, offset: u64, max_len: u64) -> io::Result<(u64, u32)> {
        let c = offset >> self.shift;
        if self.copied.get(c) {
            let n = (((c + 1) << self.shift) - offset).min(max_len);
            return seek_allocation(&self.store, offset, n);
        }
        // Ask the image, then keep only what was still not copied after
        // the answer (a cluster copied since may have changed under it).
        let limit = offset.saturating_add(max_len).min(self.size);
        let (n, flags) = self.image.allocation(offset, limit - offset)?;
        let n = n.clamp(1, limit - offset);
        let mut p = offset;
        while p < offset + n {
            if self.copied.get(p >> self.shift) {
                return if p == offset {
                    // Copied since the first look: the store answers.
                    self.allocation(offset, max_len)
                } else {
                    Ok((p - offset, flags))
                };
            }
            p = ((p >> self.shift) + 1) << self.shift;
        }
        Ok((n, flags))
    }
}

/// The point-in-time export of a backup: the CBW view, and the bits of a
/// dirty bitmap frozen at the same instant (`qemu:dirty-bitmap:NAME`).
pub struct View {
    store: Arc<CbwStore>,
    bitmap: Option<(String, Arc<DirtyBitmap>)>,
}

impl View {
    pub fn new(store: Arc<CbwStore>, bitmap: Option<(String, Arc<DirtyBitmap>)>) -> View {
        View { store, bitmap }
    }
}

impl Export for View {
    fn size(&self) -> u64 {
        self.store.size()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.store.read(offset, buf)
    }

    fn bitmaps(&self) -> Vec<String> {
        self.bitmap.iter().map(|(n, _)| n.clone()).collect()
    }

    fn block_status(
        &self,
        context: &MetaContext,
        offset: u64,
        max_len: u64,
    ) -> io::Result<(u64, u32)> {
        match (context, &self.bitmap) {
            (MetaContext::Allocation, _) => self.store.allocation(offset, max_len),
            (MetaContext::DirtyBitmap(name), Some((n, b))) if name == n => {
                let (len, dirty) = b.extent_at(offset, max_len);
                Ok((len, if dirty { STATE_DIRTY } else { 0 }))
            }
            _ => Ok((max_len, 0)),
        }
    }

    fn description(&self) -> String {
        "ringblk point-in-time backup view".into()
    }
}

#[cfg(test)]
mod tests;
