//! qcow2 images and their backing chains, on top of `imago`.
//!
//! imago parses the headers, keeps the L2 and refcount caches, allocates
//! clusters, copies on write (from any layer of the chain, compressed
//! clusters included) and zeroes clusters. Around it:
//! - [`ordered`]: every metadata write of imago's goes through our
//!   `Storage`, which puts the writes in a crash-safe order;
//! - [`map_cache`]: the mappings the queue threads look up without I/O;
//! - this module: opening the chain (paths resolved like QEMU, formats
//!   never probed, depth bounded, loops refused), the slow path (one
//!   metadata operation at a time under `meta`), and group commit.

pub mod bitmap_store;
pub mod bitmap_write;
pub mod bitmaps;
pub mod commit;
pub mod crypt;
pub mod l2log;
pub mod map_cache;
pub mod ordered;
pub mod stream;

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use imago::format::PreallocateMode;
use imago::format::drivers::FormatDriverInstance;
use imago::qcow2::Qcow2;
use imago::raw::Raw;
use imago::{FormatAccess, FormatCreateBuilder, Mapping};

use super::luks::Crypt;
use super::reader::read_piece_from;
use super::{Commit, Dir, FormatError, Image, Mapper, Piece, Where, WriteData};
use crate::crypto::key::Secret;
use crate::io::{AlignedBuf, BOUNCE_ALIGN};
use crate::virtio::slice_iovecs;
use l2log::L2Log;
use map_cache::{Loc, MAX_FILES, MapCache};
pub use ordered::{Adopted, ChainFile, FileState, Journal, JournalOp};

/// One image of a chain as imago holds it; shared, so that a snapshot's
/// overlay can take the old top as its backing file.
type Layer = Arc<FormatAccess<ChainFile>>;

/// How deep a chain may be, the top included. QEMU has no fixed bound; a
/// chain of snapshots this deep is already slow to read through.
pub const MAX_CHAIN: usize = 16;

/// Options for opening a qcow2 image.
#[derive(Clone, Debug)]
pub struct OpenOptions {
    /// Open the top read-write (the backing files are always read-only).
    pub writable: bool,
    /// The chain's depth bound, the top included (at most [`MAX_CHAIN`]...
    /// or less, for tests).
    pub max_chain: usize,
    /// Entries of the queue threads' mapping cache.
    pub map_cache_entries: usize,
    /// Tests only: `false` lets imago's writes through in its own order, to
    /// show what the ordering prevents.
    pub ordered: bool,
    /// Tests only: record every write and fdatasync of the top.
    pub journal: Option<Arc<Journal>>,
    /// The L2 log of a writable top (see [`l2log`]): opened at open,
    /// taken into use by [`Qcow2Image::claim`]. Without one, each group of
    /// allocating writes takes an fdatasync before its L2 entries, and a
    /// marked image (a daemon with a log was killed on it) is refused.
    pub l2_log: Option<PathBuf>,
    /// QEMU's bitmaps of a writable top are read and checked at open, but
    /// marked in use only by [`Qcow2Image::open_qemu_bitmaps`], which the
    /// daemon calls when it claims the image (as QEMU opens an image for
    /// an incoming migration, `BDRV_O_INACTIVE`, and marks its bitmaps
    /// when it activates it): a daemon started on an image that another
    /// one serves writes nothing into it until it holds it. The caller
    /// then calls `open_qemu_bitmaps` before its first write. Without it,
    /// the open marks them in use.
    pub bitmaps_at_claim: bool,
    /// Where the backing files may be (`--backing-dir`, canonical paths):
    /// a file of the chain below the top that resolves, once open,
    /// anywhere else refuses the open. A path here may also name one
    /// file. `None`: anywhere, as QEMU allows.
    pub backing_dirs: Option<Vec<PathBuf>>,
    /// Refuse the top if it is a symlink (O_NOFOLLOW): for a top the
    /// daemon found by name itself (a snapshot record's overlay).
    pub nofollow_top: bool,
    /// The passphrase of the chain's encrypted layers (`crypt`), for the
    /// open only: [`Live`](crate::disk::Live) keeps its options without
    /// it.
    pub passphrase: Option<Arc<Secret>>,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            writable: true,
            max_chain: MAX_CHAIN,
            map_cache_entries: 1 << 16,
            ordered: true,
            journal: None,
            l2_log: None,
            bitmaps_at_claim: false,
            backing_dirs: None,
            nofollow_top: false,
            passphrase: None,
        }
    }
}

pub struct Qcow2Image {
    top: Layer,
    /// The chain's files, top first; `Where::Data::file` indexes them.
    files: Vec<Arc<FileState>>,
    /// imago's layer of each file, in the same order (`layers[0]` is
    /// `top`): what a stream puts below the top.
    layers: Vec<Layer>,
    writable: bool,
    size: AtomicU64,
    /// log2 of the top's cluster size (allocation unit).
    cluster_bits: u32,
    /// log2 of the smallest cluster size of the chain (the cache's unit).
    granule_bits: u32,
    /// Whether the top is v3 (zero clusters); v2 is served read-only.
    v3: bool,
    cache: MapCache,
    /// One imago operation at a time: an allocation and the commit that
    /// writes its metadata must not interleave (see `ordered`).
    meta: Mutex<()>,
    /// Generation of the newest metadata change in memory.
    dirty: AtomicU64,
    /// Generation up to which metadata is in the file.
    committed: AtomicU64,
    /// Held by the committer of a group; waiters find their generation done.
    commit_lock: Mutex<()>,
    /// Mappings resolved while metadata was not yet committed: they enter
    /// the queue threads' cache only once it is (`commit_locked`), so
    /// that a write never takes the fast path to a cluster whose
    /// allocation a kill -9 could still lose. Under `meta`.
    uncommitted: Mutex<Vec<(u64, Loc)>>,
    /// The data clusters allocated since imago's caches were last written
    /// or their changes logged (guest cluster index, host offset), when
    /// nothing else changed there: a commit then logs them itself
    /// ([`FileState::log_allocations`]) rather than have imago write whole
    /// tables. None when imago may have changed anything else (a
    /// write-zeroes, a discard, a resize, an allocation that failed half
    /// way): the next commit writes imago's caches. Under `meta`.
    allocated: Mutex<Option<Vec<(u64, u64)>>>,
    /// The top's L2 log, if it has one (see [`l2log`]).
    l2log: Option<Arc<L2Log>>,
    /// QEMU's persistent bitmaps of the top, if it has any.
    qemu: Option<Mutex<QemuBitmaps>>,
    /// The mappings still to put in the cache after a miss (see
    /// [`Qcow2Image::warm_step`]).
    warm: Mutex<Warm>,
}

/// The ranges of the guest's space whose mappings the metadata thread
/// puts in the cache when it has nothing else to do: after a miss, the
/// rest of what the top's L2 table there covers (512 MiB with 64 KiB
/// clusters), which imago has just read. Without it, each granule's
/// first request goes to the metadata thread (two thread hand-offs and a
/// wake-up, 30 µs or more here): a random reader of a 2 GiB image still
/// missed on half its requests after 3 s, where QEMU's lookups hit its
/// L2 cache from the table's first miss on.
#[derive(Default)]
struct Warm {
    /// `[next, end)` ranges left, oldest first.
    pending: std::collections::VecDeque<(u64, u64)>,
    /// The tables (guest offset >> the coverage's bits) taken already;
    /// emptied with the cache.
    taken: HashSet<u64>,
}

/// Granules one [`Qcow2Image::warm_step`] maps at most: a request that
/// arrives meanwhile waits for no more than this.
const WARM_STEP: u64 = 1024;

/// What differs between the ways a [`Qcow2Image`] is made (an open, a
/// snapshot's overlay, a stream's switch, a commit's base, a pivot); its
/// cache, locks and counters start empty ([`Qcow2Image::from_parts`]).
struct Parts {
    top: Layer,
    files: Vec<Arc<FileState>>,
    layers: Vec<Layer>,
    writable: bool,
    size: u64,
    cluster_bits: u32,
    granule_bits: u32,
    v3: bool,
    l2log: Option<Arc<L2Log>>,
    qemu: Option<QemuBitmaps>,
}

impl Qcow2Image {
    /// An image of `p`, its map cache sized as `options` say.
    fn from_parts(p: Parts, options: &OpenOptions) -> Qcow2Image {
        Qcow2Image {
            top: p.top,
            files: p.files,
            layers: p.layers,
            writable: p.writable,
            size: AtomicU64::new(p.size),
            cluster_bits: p.cluster_bits,
            granule_bits: p.granule_bits,
            v3: p.v3,
            cache: MapCache::new(options.map_cache_entries),
            meta: Mutex::new(()),
            dirty: AtomicU64::new(0),
            committed: AtomicU64::new(0),
            commit_lock: Mutex::new(()),
            uncommitted: Mutex::new(Vec::new()),
            allocated: Mutex::new(None),
            l2log: p.l2log,
            qemu: p.qemu.map(Mutex::new),
            warm: Mutex::new(Warm::default()),
        }
    }

    /// The top's metadata committed and synced, then the top frozen:
    /// written no more (a snapshot's old top, a pivot's).
    fn freeze_top(&self) -> Result<(), FormatError> {
        let _group = lock(&self.commit_lock);
        let _meta = lock(&self.meta);
        self.commit_locked()?;
        self.files[0]
            .sync_now()
            .map_err(FormatError::io("fdatasync"))?;
        self.files[0].freeze();
        Ok(())
    }

    /// This image's QEMU bitmaps, taken for the image that replaces it
    /// (nothing is left here to write).
    fn take_qemu(&self) -> Option<QemuBitmaps> {
        self.qemu
            .as_ref()
            .map(|m| std::mem::replace(&mut *lock(m), QemuBitmaps::none()))
    }
}

/// The lock if no one holds it now.
fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn open_err(path: &Path, reason: impl ToString) -> FormatError {
    FormatError::Open {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Where QEMU looks for a backing file named `name` in the header of the
/// image at `overlay`: an absolute name as it is, a relative one relative
/// to the overlay's directory (not the current directory). Protocol names
/// (`nbd:`, `json:`, ...) are refused rather than opened as files.
pub fn resolve_backing(overlay: &Path, name: &str) -> Result<PathBuf, String> {
    if name.is_empty() {
        return Err("empty backing file name".into());
    }
    if let Some((proto, _)) = name.split_once(':')
        && !proto.contains('/')
        && proto.chars().all(|c| c.is_ascii_alphanumeric() || c == '+')
    {
        return Err(format!(
            "backing file {name:?} names a protocol; only files are supported"
        ));
    }
    let p = Path::new(name);
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    let dir = overlay.parent().unwrap_or(Path::new(""));
    Ok(dir.join(p))
}

/// What opening one layer found out, for the next one down.
struct Chain {
    files: Vec<Arc<FileState>>,
    /// Each file's layer, by its index in `files` (made bottom first).
    layers: Vec<Option<Layer>>,
    seen: HashSet<(u64, u64)>,
    min_cluster_bits: u32,
    /// The writable top's QEMU bitmaps.
    qemu: Option<QemuBitmaps>,
}

/// QEMU's persistent bitmaps of the writable top (bitmaps.rs,
/// bitmap_write.rs): loaded and marked in use when the image is claimed
/// (or at open, without [`OpenOptions::bitmaps_at_claim`]), written back
/// when it is let go ([`Qcow2Image::invalidate`]).
struct QemuBitmaps {
    /// The directory on disk as this image last read, marked or wrote it;
    /// `None` once the extension is gone.
    dir: Option<bitmaps::Bitmaps>,
    /// The bits loaded at open, before the open marked them in use (none
    /// with [`OpenOptions::bitmaps_at_claim`]): for the first claim, and
    /// for a peek until then.
    loaded: Option<Vec<bitmaps::Loaded>>,
    /// Bitmaps to write at the next quiet moment.
    staged: Option<Vec<bitmap_write::Stored>>,
    /// Bitmaps for the next [`Qcow2Image::snapshot`] to write into this
    /// top once it is frozen ([`Qcow2Image::stage_qemu_bitmaps_for_snapshot`]).
    at_snapshot: Option<Vec<bitmap_write::Stored>>,
    /// False while a bitmap on disk may say it is complete although this
    /// process is about to write the image unrecorded by it: from an open
    /// with [`OpenOptions::bitmaps_at_claim`] until the claim marks them,
    /// and after a claim whose marking failed
    /// ([`Qcow2Image::qemu_bitmaps_marked`]).
    marked: bool,
}

impl QemuBitmaps {
    /// What is left in a handle whose bitmaps moved to another
    /// ([`Qcow2Image::rebase`]): nothing to write.
    fn none() -> QemuBitmaps {
        QemuBitmaps {
            dir: None,
            loaded: None,
            staged: None,
            at_snapshot: None,
            marked: true,
        }
    }
}

impl Qcow2Image {
    pub fn open(path: &Path, options: &OpenOptions) -> Result<Qcow2Image, FormatError> {
        let mut chain = Chain {
            files: Vec::new(),
            layers: Vec::new(),
            seen: HashSet::new(),
            min_cluster_bits: 21,
            qemu: None,
        };
        let max_chain = options.max_chain.clamp(1, MAX_FILES);
        let l2log = match (&options.l2_log, options.writable) {
            (Some(p), true) => Some(Arc::new(L2Log::open(p).map_err(|e| {
                open_err(
                    path,
                    format!(
                        "its L2 log {}: {e} (it is kept next to the image, whose directory the daemon must be able to write; or serve with --l2-log off)",
                        p.display()
                    ),
                )
            })?)),
            _ => None,
        };
        let (top, header) = open_qcow2(path, options, max_chain, &mut chain)?;
        let version = be32(&header[4..8]);
        let cluster_bits = be32(&header[20..24]);
        let size = top.size();
        let layers = chain.layers.into_iter().flatten().collect::<Vec<_>>();
        if layers.len() != chain.files.len() {
            return Err(open_err(path, "the chain's layers do not match its files"));
        }
        Ok(Qcow2Image::from_parts(
            Parts {
                top,
                files: chain.files,
                layers,
                writable: options.writable,
                size,
                cluster_bits,
                granule_bits: chain.min_cluster_bits,
                v3: version >= 3,
                l2log,
                qemu: chain.qemu,
            },
            options,
        ))
    }

    /// Whether the top keeps QEMU's persistent bitmaps: it is served
    /// writable (with the bitmaps extension, or without, and then the first
    /// bitmap written back creates it).
    pub fn has_qemu_bitmaps(&self) -> bool {
        self.qemu.is_some()
    }

    /// QEMU's bitmaps, loaded, and marked in use on disk before this
    /// returns. Called when the image is claimed, before any write. The
    /// directory is always read afresh: another process (a migration's
    /// source) may have written the bitmaps since; the bits an open that
    /// marked them loaded serve only if nobody did (the directory is still
    /// the one that open marked in use).
    pub fn open_qemu_bitmaps(&self) -> Result<Vec<bitmaps::Loaded>, FormatError> {
        let Some(q) = &self.qemu else {
            return Ok(Vec::new());
        };
        let _meta = lock(&self.meta);
        let mut q = lock(q);
        let file = self.files[0].file();
        let at_open = q.loaded.take();
        if let (Some(loaded), Some(dir)) = (at_open, q.dir.as_ref()) {
            let now = bitmaps::Bitmaps::load(file);
            if now
                .as_ref()
                .is_ok_and(|n| n.as_ref().is_some_and(|n| n.same_directory(dir)))
            {
                return Ok(loaded);
            }
        }
        // A directory that cannot be read or trusted (a bad extension
        // written behind this process's back, which QEMU refuses too) is
        // left as it is, and the image goes on serving with no bitmaps:
        // only a marking that fails leaves bitmaps this process knows to
        // say they are complete.
        q.marked = true;
        let Some((mut b, loaded)) = self.read_qemu_bitmaps()? else {
            q.dir = None;
            return Ok(Vec::new());
        };
        if let Err(e) = b.mark_in_use(file) {
            q.marked = false;
            return Err(FormatError::io("marking bitmaps in use")(e));
        }
        q.dir = Some(b);
        Ok(loaded)
    }

    /// Whether the image may be written as far as QEMU's bitmaps go: none
    /// on disk says it is complete while this process writes unrecorded
    /// by it. False from an open with [`OpenOptions::bitmaps_at_claim`]
    /// until [`open_qemu_bitmaps`](Self::open_qemu_bitmaps) marks them, and
    /// after one that failed to mark them (a write or an fdatasync that
    /// failed). The daemon serves no request while it is false.
    pub fn qemu_bitmaps_marked(&self) -> bool {
        self.qemu.as_ref().is_none_or(|q| lock(q).marked)
    }

    /// QEMU's bitmaps as they are, marking nothing and writing nothing:
    /// what a daemon that does not hold the image yet lists. Those an open
    /// that marked them loaded, until the first claim; else read afresh
    /// (one in use comes back as the reason its bits are not trusted).
    pub fn peek_qemu_bitmaps(&self) -> Result<Vec<bitmaps::Loaded>, FormatError> {
        let Some(q) = &self.qemu else {
            return Ok(Vec::new());
        };
        let _meta = lock(&self.meta);
        if let Some(loaded) = &lock(q).loaded {
            return Ok(loaded.clone());
        }
        Ok(self
            .read_qemu_bitmaps()?
            .map(|(_, loaded)| loaded)
            .unwrap_or_default())
    }

    /// The top's bitmap directory and bits, read and checked afresh (none:
    /// no extension). Under `meta`.
    fn read_qemu_bitmaps(
        &self,
    ) -> Result<Option<(bitmaps::Bitmaps, Vec<bitmaps::Loaded>)>, FormatError> {
        let bad = |e: String| FormatError::Io {
            context: "bitmaps extension",
            source: io::Error::new(io::ErrorKind::InvalidData, e),
        };
        let file = self.files[0].file();
        let Some(b) = bitmaps::Bitmaps::load(file).map_err(bad)? else {
            return Ok(None);
        };
        let c = 1u64 << self.cluster_bits;
        if b.directory_clusters(c)
            .any(|c| self.files[0].is_metadata(c))
        {
            return Err(bad("the bitmap directory overlaps other metadata".into()));
        }
        let loaded = b.load_all(file);
        Ok(Some((b, loaded)))
    }

    /// Bitmaps to write back at the next [`invalidate`](Self::invalidate)
    /// (the image is let go), in place of those on disk (none: the
    /// extension, if any, is removed). False when the top keeps no bitmaps
    /// (not writable).
    pub fn stage_qemu_bitmaps(&self, bitmaps: Vec<bitmap_write::Stored>) -> bool {
        match &self.qemu {
            Some(q) => {
                lock(q).staged = Some(bitmaps);
                true
            }
            None => false,
        }
    }

    /// Bitmaps for the next [`snapshot`](Self::snapshot) of this image to
    /// write into it, in place of those on disk, once the overlay is in
    /// place and this top is frozen: QEMU stores a node's persistent
    /// bitmaps when it becomes read-only (block/qcow2-bitmap.c,
    /// `qcow2_reopen_bitmaps_ro`). Staged with every request kept out, just
    /// before the snapshot, so that the bits are final for this top: every
    /// write after the snapshot goes to the overlay. A snapshot that fails
    /// drops them (this image stays the top, its bitmaps in use). False
    /// when the top keeps no bitmaps (not writable).
    pub fn stage_qemu_bitmaps_for_snapshot(&self, bitmaps: Vec<bitmap_write::Stored>) -> bool {
        match &self.qemu {
            Some(q) => {
                lock(q).at_snapshot = Some(bitmaps);
                true
            }
            None => false,
        }
    }

    /// Writes `bitmaps` as the image's bitmaps now, in place of those on
    /// disk, as a release would ([`invalidate`](Self::invalidate): the
    /// metadata made durable, the caches dropped), while the image stays
    /// held. For a set of bitmaps that changed (added, removed), written
    /// in use (inconsistent), so that a kill -9 finds them in the image.
    /// The caller keeps every request out meanwhile (the device's
    /// quiesce).
    pub fn store_qemu_bitmaps_now(
        &self,
        bitmaps: Vec<bitmap_write::Stored>,
    ) -> Result<(), FormatError> {
        let Some(q) = &self.qemu else {
            return Err(FormatError::ReadOnly);
        };
        let mut names: Vec<String> = bitmaps.iter().map(|b| b.name.clone()).collect();
        names.sort();
        lock(q).staged = Some(bitmaps);
        self.invalidate()?;
        let q = lock(q);
        let mut now: Vec<String> = q
            .dir
            .iter()
            .flat_map(|d| d.entries.iter().map(|e| e.name.clone()))
            .collect();
        now.sort();
        if now != names {
            return Err(FormatError::Io {
                context: "writing the bitmap directory",
                source: io::Error::other("not written (see the log)"),
            });
        }
        Ok(())
    }

    /// Writes the staged bitmaps (everything else committed and synced,
    /// under `meta`): a failure leaves them in use, which is safe.
    fn write_qemu_bitmaps(&self) {
        let Some(q) = &self.qemu else {
            return;
        };
        let mut q = lock(q);
        let Some(staged) = q.staged.take() else {
            return;
        };
        let dir = q.dir.as_ref();
        if dir.is_none() && staged.is_empty() {
            return;
        }
        let file = self.files[0].file();
        let path = self.files[0].path().display().to_string();
        // The clusters to free are those of the directory on disk: never
        // free what another writer's directory may no longer own.
        let now = bitmaps::Bitmaps::load(file);
        let unchanged = match (&now, dir) {
            (Ok(Some(n)), Some(d)) => n.same_directory(d),
            (Ok(None), None) => true,
            _ => false,
        };
        if !unchanged {
            // Whatever is there now misses this daemon's writes: in use.
            if let Ok(Some(mut n)) = now {
                let _ = n.mark_in_use(file);
            }
            log::error!(
                "{path}: the bitmap directory changed behind ringblk; QEMU's bitmaps are not \
                 written back (they are marked in use: inconsistent)"
            );
            return;
        }
        let is_metadata = |c: u64| self.files[0].is_metadata(c);
        let c = 1u64 << self.cluster_bits;
        match bitmap_write::store(file, c, dir, &staged, &is_metadata)
            .and_then(|moved| self.files[0].grew().map(|()| moved))
        {
            Ok(moved) => {
                if let Some(backing_at) = moved {
                    log::debug!(
                        "{path}: header rewritten, the backing file name now at {backing_at}"
                    );
                }
                q.dir = match bitmaps::Bitmaps::load(file) {
                    Ok(d) => d,
                    Err(e) => {
                        log::error!("{path}: rereading the bitmaps written: {e}");
                        None
                    }
                };
            }
            Err(e) => log::error!(
                "{path}: writing QEMU's bitmaps back: {e}; they stay in use (inconsistent)"
            ),
        }
    }

    fn check(&self, offset: u64, len: u64, dir: Dir) -> Result<(), FormatError> {
        if dir == Dir::Write && !self.writable {
            return Err(FormatError::ReadOnly);
        }
        let size = self.size();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(FormatError::OutOfRange { offset, len, size }),
        }
    }

    /// [`Self::check`] of a write, and that its buffers cover it.
    fn check_write(&self, offset: u64, len: u64, data: &WriteData<'_>) -> Result<(), FormatError> {
        self.check(offset, len, Dir::Write)?;
        let covered: usize = data.iovecs.iter().map(|v| v.iov_len).sum();
        if covered as u64 != len {
            return Err(FormatError::Io {
                context: "writing",
                source: io::Error::other(format!(
                    "{covered} bytes of buffers for a write of {len}"
                )),
            });
        }
        Ok(())
    }

    /// Checks that a data location taken from the image's metadata is
    /// plausible: a host offset far past the end of its file is a corrupt
    /// (or hostile) table, and the request touching it fails.
    ///
    /// The length known from the writes through it (and the last look)
    /// answers most checks without a syscall; the file is looked at again
    /// only when that would fail.
    fn check_host(&self, file: usize, host: u64, len: u64) -> Result<(), FormatError> {
        const SLACK: u64 = 1 << 30;
        let end = host.saturating_add(len);
        let f = &self.files[file];
        if end <= f.known_len().saturating_add(SLACK) {
            return Ok(());
        }
        let size = f.len_now().unwrap_or(0);
        if end > size.saturating_add(SLACK) {
            return Err(FormatError::Io {
                context: "mapping",
                source: io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{}: data at {host:#x} is past the end of the file ({size} bytes)",
                        self.files[file].path().display()
                    ),
                ),
            });
        }
        Ok(())
    }

    /// Pieces for `[offset, end)` as imago maps them now, caching whole
    /// granules. Called under `meta`.
    fn resolve_read(&self, offset: u64, end: u64, out: &mut Vec<Piece>) -> Result<(), FormatError> {
        let gb = self.granule_bits;
        let gsize = 1u64 << gb;
        let mut pos = offset & !(gsize - 1);
        let aligned_end = end.div_ceil(gsize).saturating_mul(gsize).min(self.size());
        while pos < aligned_end {
            let (mapping, mlen) = self
                .top
                .get_mapping(pos, aligned_end - pos)
                .map_err(FormatError::io("reading metadata"))?;
            if mlen == 0 {
                return Err(FormatError::OutOfRange {
                    offset: pos,
                    len: end - pos,
                    size: self.size(),
                });
            }
            let (at, loc) = match mapping {
                Mapping::Raw {
                    storage,
                    offset: host,
                    writable,
                    ..
                } => {
                    let file = storage.0.index();
                    self.check_host(file, host, mlen)?;
                    // A cluster allocated but not yet committed must not be
                    // written through the cache (see `uncommitted`).
                    let writable = writable && file == 0 && self.writable && self.all_committed();
                    (
                        Where::Data { file, offset: host },
                        Some((file, host, writable)),
                    )
                }
                Mapping::Zero { .. } => (Where::Zero, None),
                Mapping::Special { .. } => (Where::Slow, None),
                _ => {
                    return Err(FormatError::Io {
                        context: "mapping",
                        source: io::Error::other(format!("unexpected mapping at {pos:#x}")),
                    });
                }
            };
            // Cache the whole granules of this run.
            let run_end = pos + mlen;
            let mut g = pos;
            while g + gsize <= run_end || (g < run_end && run_end == self.size()) {
                let loc = match (&at, loc) {
                    (Where::Zero, _) => Some(Loc::Zero),
                    (Where::Data { .. }, Some((file, host, writable))) if (host & 511) == 0 => {
                        Some(Loc::Data {
                            file,
                            offset: host + (g - pos),
                            writable,
                        })
                    }
                    _ => None,
                };
                match loc {
                    Some(l) => self.cache.insert(g >> gb, l),
                    None => self.cache.remove(g >> gb),
                }
                g += gsize;
            }
            // The part of the run the request covers.
            let from = pos.max(offset);
            let to = run_end.min(end);
            if from < to {
                let at = match at {
                    Where::Data { file, offset: host } => Where::Data {
                        file,
                        offset: host + (from - pos),
                    },
                    other => other,
                };
                push_piece(out, from, to - from, at);
            }
            pos = run_end;
        }
        Ok(())
    }

    /// Whether a layer of the chain is encrypted: copy-on-write then
    /// decrypts and encrypts again, here (see [`crypt`]), and never copies
    /// a cluster's bytes as they are.
    fn encrypted(&self) -> bool {
        self.files.iter().any(|f| f.crypt().is_some())
    }

    /// The guest's bytes of `buf.len()` at `offset`, read through the
    /// chain and decrypted (the one reader's [`read_piece`](super::reader::read_piece)). Under `meta`.
    fn read_locked(&self, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        let mut pieces = Vec::new();
        self.resolve_read(offset, offset + buf.len() as u64, &mut pieces)?;
        self.read_resolved(offset, &pieces, buf, false)
    }

    /// Reads `pieces` (resolved for the range at `offset` that `buf`
    /// covers) into `buf`; `cached_only`: from the page cache only
    /// ([`read_piece_from`]). Under `meta`.
    fn read_resolved(
        &self,
        offset: u64,
        pieces: &[Piece],
        buf: &mut [u8],
        cached_only: bool,
    ) -> Result<(), FormatError> {
        let files = self.files();
        for p in pieces {
            let from = (p.guest - offset) as usize;
            let part = &mut buf[from..from + p.len as usize];
            read_piece_from(self, &files, p, part, cached_only)
                .map_err(FormatError::io("copy-on-write"))?;
        }
        Ok(())
    }

    /// Allocates the top's cluster `[cstart, cend)` for a write of
    /// `[pos, wend)`, doing the copy-on-write here rather than in imago:
    /// imago copies nothing (the whole cluster is allocated as
    /// overwritten), and the rest of the cluster (head and tail) is read
    /// through the chain as the guest sees it, decrypted and, when the top
    /// is encrypted, encrypted for its new place, into one [`Cow`] for the
    /// caller to write once the cluster is checked. Where the chain has no
    /// data (unallocated to the bottom, or zero clusters) nothing is read;
    /// and where the new cluster lies past the end of the file, zeroes
    /// (known so, or read so) need no write either, since the file reads
    /// as zeroes there (QEMU skips a copy of zeroes the same way,
    /// `is_zero_cow`). Returns the cluster's host offset. `cached_only`:
    /// head and tail are read from the page cache only, before anything
    /// is allocated ([`read_piece_from`]). Under `meta`.
    fn allocate_cow(
        &self,
        pos: u64,
        wend: u64,
        cstart: u64,
        cend: u64,
        cached_only: bool,
    ) -> Result<(u64, Cow), FormatError> {
        let csize = 1usize << self.cluster_bits;
        let mut buf = AlignedBuf::new(csize).ok_or_else(|| FormatError::Io {
            context: "copy-on-write",
            source: io::ErrorKind::OutOfMemory.into(),
        })?;
        // (cluster offsets, whether they hold data)
        let mut keep = Vec::new();
        for (from, to) in [(cstart, pos), (wend, cend)] {
            if from < to {
                let part = (from - cstart) as usize..(to - cstart) as usize;
                let mut pieces = Vec::new();
                self.resolve_read(from, to, &mut pieces)?;
                if pieces.iter().all(|p| p.at == Where::Zero) {
                    keep.push((part, false));
                    continue;
                }
                let bytes = &mut buf.as_mut_slice()[part.clone()];
                self.read_resolved(from, &pieces, bytes, cached_only)?;
                // A raw base maps everything as data; a sparse one reads
                // zeroes (the scan stops at the first byte that is not).
                let data = bytes.iter().any(|&b| b != 0);
                keep.push((part, data));
            }
        }
        let (_, at, got) = self
            .top
            .ensure_data_mapping(cstart, cend - cstart, true)
            .map_err(FormatError::io("allocating"))?;
        if got < cend - cstart {
            return Err(FormatError::Io {
                context: "allocating",
                source: io::Error::other(format!(
                    "allocated {got} of {} bytes at {cstart:#x}",
                    cend - cstart
                )),
            });
        }
        // Past the end of the file: reads as zeroes already. (Checked
        // before `cover` extends the file; a cluster inside it may be
        // one freed and reused, or a zero cluster's own, and holds old
        // bytes.)
        let past_end = self.files[0]
            .len_now()
            .map_err(FormatError::io("allocating"))?
            <= at;
        let crypt = self.files[0].crypt();
        let mut copies = Vec::new();
        for (part, data) in keep {
            if !data && past_end && crypt.is_none() {
                continue;
            }
            if let Some(c) = crypt {
                let done = c.encrypt(
                    at + part.start as u64,
                    &mut buf.as_mut_slice()[part.clone()],
                );
                crate::crypto::key::scrub_after_pass();
                done.map_err(|e| FormatError::io("copy-on-write")(io::Error::other(e)))?;
            }
            copies.push(part);
        }
        Ok((at, Cow { buf, copies }))
    }

    /// Writes the guest's `data` at `offset` (allocating, with
    /// copy-on-write), encrypted for its place when the top is. For the
    /// zeroes of a write-zeroes in a chain with an encrypted layer. Under
    /// `meta`; the caller commits.
    fn write_locked(&self, data: &[u8], offset: u64) -> Result<(), FormatError> {
        self.write_locked_as(data, offset, false)
    }

    /// [`Qcow2Image::write_locked`]; `copy`: the bytes are not the
    /// guest's new data but what it reads already (a stream's copy up),
    /// which must never be pointed to before it is durable (see
    /// [`FileState::copy_write`]). Under `meta`.
    fn write_locked_as(&self, data: &[u8], offset: u64, copy: bool) -> Result<(), FormatError> {
        let mut pieces = Vec::new();
        // SAFETY: no data.
        unsafe {
            self.resolve_write_locked(offset, offset + data.len() as u64, None, false, &mut pieces)?
        };
        for p in pieces {
            let Where::Data {
                file: 0,
                offset: host,
            } = p.at
            else {
                unreachable!("a write resolves to the top's data");
            };
            let from = (p.guest - offset) as usize;
            let mut bytes = data[from..from + p.len as usize].to_vec();
            if let Some(c) = self.files[0].crypt() {
                let done = c.encrypt(host, &mut bytes);
                crate::crypto::key::scrub_after_pass();
                done.map_err(|e| FormatError::io("writing zeroes")(io::Error::other(e)))?;
            }
            let top = &self.files[0];
            if copy {
                top.copy_write(&bytes, host)
            } else {
                top.data_write(&bytes, host)
            }
            .map_err(FormatError::io("writing zeroes"))?;
        }
        Ok(())
    }

    /// The write side of [`Mapper::resolve`], for `[offset, end)`. Under
    /// `meta`.
    ///
    /// `data`: the write's bytes from `offset` on; for a cluster it
    /// allocates with a copy-on-write, when the top is not encrypted, they
    /// are written here with the copied head and tail, one write, and the
    /// piece is [`Where::Written`]: a pwritev through the page cache, or
    /// with `--direct` one O_DIRECT pwrite of an aligned buffer through
    /// the engine's descriptor. `cached_only`: copy-on-write reads from
    /// the page cache only; where they would wait for the device the
    /// resolve fails with `WouldBlock` ([`Self::allocate_cow`]), having
    /// done (and written) the clusters before in full.
    ///
    /// # Safety
    /// `data`, if given, as [`super::Image::resolve_write`] asks.
    unsafe fn resolve_write_locked(
        &self,
        offset: u64,
        end: u64,
        data: Option<WriteData<'_>>,
        cached_only: bool,
        out: &mut Vec<Piece>,
    ) -> Result<Option<Commit>, FormatError> {
        let cb = self.cluster_bits;
        let csize = 1u64 << cb;
        let mut ticket = None;
        let mut entries = Vec::new();
        let mut pos = offset;
        while pos < end {
            let cstart = pos & !(csize - 1);
            let cend = (cstart + csize).min(self.size());
            let wend = end.min(cend);
            let (mapping, mlen) = self
                .top
                .get_mapping(cstart, cend - cstart)
                .map_err(FormatError::io("reading metadata"))?;
            let mut written = false;
            let (host, fresh, must_commit) = match mapping {
                Mapping::Raw {
                    storage,
                    offset: host,
                    writable: true,
                    ..
                } if storage.0.index() == 0 && mlen >= cend - cstart => {
                    self.check_host(0, host, csize)?;
                    (host, false, false)
                }
                other => {
                    // Replacing a compressed or shared cluster of the top
                    // frees it; it must not be reused before the new mapping
                    // is durable, so commit before anyone allocates again.
                    let frees = match other {
                        Mapping::Special { layer, .. } => std::ptr::eq(layer, &*self.top),
                        Mapping::Raw { storage, .. } => storage.0.index() == 0,
                        _ => false,
                    };
                    // The request's own range is overwritten by its data
                    // write, so only the rest of the cluster is copied (as
                    // QEMU copies head and tail), by `allocate_cow`: the
                    // data write then finds no page of its own range dirty
                    // in the page cache, which an O_DIRECT write would have
                    // to write back and drop first. The L2 entry is in
                    // imago's cache from the allocation on, and a commit
                    // (another request's, or this one's below) may write it
                    // before the data write: the file covers the cluster
                    // first (`cover`), and the copies are written before
                    // any commit can run. The list of allocations a
                    // commit may log itself is None until this one is
                    // made and written (a failure half way leaves imago's
                    // caches to be written whole).
                    let mut allocated = lock(&self.allocated).take();
                    let (host, mut cow) =
                        self.allocate_cow(pos, wend, cstart, cend, cached_only)?;
                    if self.files[0].is_metadata(host >> cb) {
                        return Err(FormatError::Io {
                            context: "allocating",
                            source: io::Error::new(
                                io::ErrorKind::InvalidData,
                                format!(
                                    "cluster {host:#x} was allocated for data but holds metadata: \
                                     the refcounts are corrupt (qemu-img check -r all)"
                                ),
                            ),
                        });
                    }
                    // Through the ordering: the L2 entry waits for an
                    // fdatasync after them. With the guest's data between
                    // head and tail: one write of the cluster's written
                    // part, through the page cache or O_DIRECT as the
                    // engine would have written the data.
                    let top = &self.files[0];
                    let data = data.filter(|d| {
                        top.crypt().is_none()
                            && !cow.copies.is_empty()
                            && (d.direct.is_none() || csize >= BOUNCE_ALIGN as u64)
                    });
                    let wrote = match data {
                        Some(d) => {
                            written = true;
                            let from = (pos - offset) as usize;
                            let guest = (pos - cstart, wend - pos);
                            match d.direct {
                                // SAFETY: `d.iovecs` readable for the call
                                // (our caller's promise).
                                None => unsafe {
                                    write_with_copies(top, host, &cow, d.iovecs, from, guest)
                                },
                                // SAFETY: as above.
                                Some(f) => unsafe {
                                    write_cluster_direct(
                                        top, f, host, &mut cow, d.iovecs, from, guest,
                                    )
                                },
                            }
                        }
                        None => cow
                            .copies
                            .iter()
                            .try_for_each(|r| {
                                top.copy_write(
                                    &cow.buf.as_slice()[r.clone()],
                                    host + r.start as u64,
                                )
                            })
                            .map(|()| cow.copies.last().map_or(0, |r| host + r.end as u64)),
                    };
                    // Inside the file before an L2 entry can point here:
                    // the write did it if it reached the cluster's end.
                    let reaches_end = matches!(wrote, Ok(e) if e >= host + (cend - cstart));
                    if !reaches_end {
                        top.cover(host + csize)
                            .map_err(FormatError::io("allocating"))?;
                    }
                    wrote.map_err(FormatError::io("copy-on-write"))?;
                    if let Some(list) = allocated.as_mut() {
                        list.push((cstart >> cb, host));
                    }
                    *lock(&self.allocated) = allocated;
                    (host, true, frees)
                }
            };
            if fresh {
                let generation = self.dirty.fetch_add(1, Ordering::AcqRel) + 1;
                ticket = Some(Commit(generation));
            }
            // A new L2 table or refblock was hooked up, or a cluster freed:
            // commit now, before anything can reuse a cluster the file still
            // points to (the next allocation, or the engine's data write).
            if must_commit || self.files[0].has_held() {
                self.commit_locked()?;
            }
            // The cluster's granules are writable data of the top: cached
            // now if its metadata is in the file, else once it is.
            let gb = self.granule_bits;
            let mut g = cstart;
            while g < cend {
                entries.push((
                    g >> gb,
                    Loc::Data {
                        file: 0,
                        offset: host + (g - cstart),
                        writable: true,
                    },
                ));
                g += 1 << gb;
            }
            let at = if written {
                Where::Written
            } else {
                Where::Data {
                    file: 0,
                    offset: host + (pos - cstart),
                }
            };
            push_piece(out, pos, wend - pos, at);
            pos = wend;
        }
        let dirty = self.dirty.load(Ordering::Acquire);
        if self.committed.load(Ordering::Acquire) >= dirty {
            for (g, loc) in entries {
                self.cache.insert(g, loc);
            }
        } else {
            // Something is not committed yet, perhaps the allocation of
            // these very clusters by a request still in flight (imago's
            // cache has it, the file may not): this write waits for it too.
            lock(&self.uncommitted).extend(entries);
            ticket = Some(Commit(dirty));
        }
        Ok(ticket)
    }

    /// Whether all metadata changed so far is in the file. Under `meta`.
    fn all_committed(&self) -> bool {
        self.committed.load(Ordering::Acquire) >= self.dirty.load(Ordering::Acquire)
    }

    /// Forgets the cached mappings of the granules `[offset, end)` touches,
    /// also those waiting for a commit. Under `meta`.
    fn forget(&self, offset: u64, end: u64) {
        let gb = self.granule_bits;
        let (first, last) = (offset >> gb, end.div_ceil(1 << gb));
        for g in first..last {
            self.cache.remove(g);
        }
        lock(&self.uncommitted).retain(|(g, _)| *g < first || *g >= last);
    }

    /// Writes imago's dirty metadata, then the pointer writes held back.
    /// Called under `meta`.
    fn commit_locked(&self) -> Result<(), FormatError> {
        let target = self.dirty.load(Ordering::Acquire);
        *lock(&self.allocated) = None;
        self.top
            .flush()
            .map_err(FormatError::io("writing metadata"))?;
        self.files[0]
            .commit_pointers()
            .map_err(FormatError::io("writing metadata"))?;
        // imago's caches are as the file (and the log) has them.
        *lock(&self.allocated) = Some(Vec::new());
        self.committed_up_to(target);
        Ok(())
    }

    /// [`Self::commit_locked`] of a write's ticket: where only data
    /// clusters were allocated since the last commit, their entries and
    /// refcounts go to the L2 log from what the allocations know
    /// ([`FileState::log_allocations`]); imago writes its caches
    /// otherwise. Under `meta`.
    fn commit_allocations_locked(&self) -> Result<(), FormatError> {
        let target = self.dirty.load(Ordering::Acquire);
        let mut allocated = lock(&self.allocated);
        let logged = match allocated.as_mut() {
            Some(list) => {
                let logged = self.files[0]
                    .log_allocations(list)
                    .map_err(FormatError::io("writing metadata"))?;
                if logged {
                    list.clear();
                }
                logged
            }
            None => false,
        };
        drop(allocated);
        if !logged {
            return self.commit_locked();
        }
        self.committed_up_to(target);
        Ok(())
    }

    /// imago is about to change its metadata otherwise than by allocating
    /// a data cluster: the next commit writes its caches. Under `meta`.
    fn imago_changes(&self) {
        *lock(&self.allocated) = None;
    }

    /// Metadata up to generation `target` is in the file: the mappings
    /// waiting for it enter the cache once everything is.
    fn committed_up_to(&self, target: u64) {
        self.committed.fetch_max(target, Ordering::AcqRel);
        if self.committed.load(Ordering::Acquire) >= self.dirty.load(Ordering::Acquire) {
            for (g, loc) in lock(&self.uncommitted).drain(..) {
                self.cache.insert(g, loc);
            }
        }
    }

    /// A live snapshot: formats `file` (empty, open read-write, at `path`)
    /// as a qcow2 overlay of this image (backing file `backing_name`,
    /// format qcow2; as large as this image, with its cluster size), and
    /// opens it with this image's chain below it.
    ///
    /// `record` runs once the overlay is formatted, synced and opened, and
    /// before this image's files move down: it makes the switch durable
    /// (the snapshot record); if it fails, so does the snapshot.
    ///
    /// The caller has stopped the requests to this image. Before the
    /// overlay is made, everything of this image is committed and synced,
    /// and its top is frozen: it is never written again (but for the
    /// bitmaps below, before the caller resumes), a point-in-time
    /// image of the disk. On success this image's files are one further
    /// down the chain (index + 1), and the overlay is file 0; on failure
    /// this image is as it was (thawed, its files where they were).
    ///
    /// Bitmaps staged for the snapshot
    /// ([`stage_qemu_bitmaps_for_snapshot`](Self::stage_qemu_bitmaps_for_snapshot))
    /// are written into this top on success, after the snapshot record
    /// made the switch durable and before the caller lets requests through
    /// again: a crash before that leaves them in use (inconsistent), never
    /// consistent with a write missing, since this top is written no more.
    /// A failure to write them is logged and leaves them in use; the
    /// snapshot stands.
    pub fn snapshot(
        &self,
        file: File,
        path: &Path,
        backing_name: &str,
        options: &OpenOptions,
        record: impl FnOnce() -> Result<(), FormatError>,
    ) -> Result<Qcow2Image, FormatError> {
        // Taken whatever happens: a failed snapshot must not leave them
        // for a later one (they would be stale by then).
        let at_snapshot = self.qemu.as_ref().and_then(|q| lock(q).at_snapshot.take());
        if !self.writable {
            return Err(FormatError::ReadOnly);
        }
        let max_chain = options.max_chain.clamp(1, MAX_FILES);
        if self.files.len() >= max_chain {
            return Err(FormatError::Unsupported(format!(
                "the chain is {} images deep already, the most there may be",
                self.files.len()
            )));
        }
        self.freeze_top()?;
        let made = self.make_overlay(file, path, backing_name, options, record);
        if let (Ok(_), Some(bitmaps)) = (&made, at_snapshot) {
            // Frozen: imago writes nothing more here, and its caches of
            // this top were written and synced above. The bitmaps go
            // straight to the file (`write_qemu_bitmaps`), as at a
            // release.
            let _group = lock(&self.commit_lock);
            let _meta = lock(&self.meta);
            self.stage_qemu_bitmaps(bitmaps);
            self.write_qemu_bitmaps();
        }
        if made.is_err() {
            self.files[0].thaw();
            // The log may name the overlay by now: it is the old top's again.
            if let Some(log) = &self.l2log {
                self.files[0]
                    .adopt_log(Arc::clone(log))
                    .map_err(FormatError::io("taking the L2 log back"))?;
            }
        }
        made
    }

    /// The overlay of [`Qcow2Image::snapshot`], once this image is frozen.
    fn make_overlay(
        &self,
        file: File,
        path: &Path,
        backing_name: &str,
        options: &OpenOptions,
        record: impl FnOnce() -> Result<(), FormatError>,
    ) -> Result<Qcow2Image, FormatError> {
        let err = |e: io::Error| open_err(path, e);
        create(
            &file,
            path,
            self.size(),
            1 << self.cluster_bits,
            Some((backing_name, "qcow2")),
        )
        .map_err(err)?;
        // An encrypted top's overlay is encrypted too, with its LUKS
        // header (so its passphrase and volume key): the guest's writes
        // after the snapshot must not land in clear.
        let crypt = self.files[0].crypt_shared();
        if crypt.is_some() {
            crypt::copy_header(&file, self.files[0].file()).map_err(|r| open_err(path, r))?;
        }
        file.sync_data().map_err(err)?;
        let mut state = FileState::new(file, path, 0).map_err(err)?;
        if let Some(crypt) = crypt {
            state.set_crypt(crypt);
        }
        state.make_ordered(options.ordered, options.journal.clone());
        let state = Arc::new(state);
        let mut q = Qcow2::<ChainFile, Layer>::open_image(ChainFile(Arc::clone(&state)), true)
            .map_err(err)?;
        // The header as imago found it: what it keeps reading once the
        // bitmaps written into this top add the extension.
        state.show_imago(bitmaps::header_view(state.file()).map_err(err)?);
        state.load_shadow().map_err(err)?;
        let mut header = [0u8; 104];
        state.file().read_exact_at(&mut header, 0).map_err(err)?;
        check_l1_covers(path, &header, q.size())?;
        q.set_backing(Some(Arc::clone(&self.top)));
        let top: Layer = Arc::new(FormatAccess::new(q));
        // The log follows the top: the old top's was written out and
        // emptied before it was frozen.
        if let Some(log) = &self.l2log {
            state.adopt_log(Arc::clone(log)).map_err(err)?;
        }
        record()?;
        for f in &self.files {
            f.move_down();
        }
        let mut files = vec![state];
        files.extend(self.files.iter().cloned());
        let mut layers = vec![Arc::clone(&top)];
        layers.extend(self.layers.iter().cloned());
        let size = top.size();
        Ok(Qcow2Image::from_parts(
            Parts {
                top,
                files,
                layers,
                writable: true,
                size,
                cluster_bits: self.cluster_bits,
                granule_bits: self.granule_bits,
                v3: true,
                l2log: self.l2log.clone(),
                // A new overlay has no bitmaps: the device writes its set
                // into it once the snapshot is over, and the bits at the
                // next release (the old top's were written back above, as
                // they were at the snapshot).
                qemu: Some(QemuBitmaps {
                    dir: None,
                    loaded: None,
                    staged: None,
                    at_snapshot: None,
                    marked: true,
                }),
            },
            options,
        ))
    }

    /// Zeroes the whole clusters `[first, last)` (see `write_zeroes`),
    /// commits, and punches out the space with `unmap`. Returns what could
    /// not be zeroed so (for the engine to write). Called under both locks.
    fn zero_locked(
        &self,
        first: u64,
        last: u64,
        unmap: bool,
    ) -> Result<Vec<(u64, u64)>, FormatError> {
        let mut rest = Vec::new();
        self.forget(first, last);
        // The top's own clusters in the range, to punch out afterwards.
        let mut punch = Vec::new();
        if unmap {
            let mut pos = first;
            while pos < last {
                let (mapping, mlen) = self
                    .top
                    .get_mapping(pos, last - pos)
                    .map_err(FormatError::io("reading metadata"))?;
                if let Mapping::Raw {
                    storage,
                    offset: host,
                    writable: true,
                    ..
                } = mapping
                    && storage.0.index() == 0
                {
                    punch.push((host, mlen));
                }
                pos += mlen.max(1);
            }
        }
        let mut pos = first;
        self.imago_changes();
        while pos < last {
            let (zofs, zlen) = self
                .top
                .inner()
                .ensure_zero_mapping(pos, last - pos)
                .map_err(FormatError::io("zeroing"))?;
            if zlen == 0 {
                rest.push((pos, last - pos));
                break;
            }
            if zofs > pos {
                rest.push((pos, zofs - pos));
            }
            pos = zofs + zlen;
        }
        self.dirty.fetch_add(1, Ordering::AcqRel);
        // The zero flags reach the file before the request completes.
        self.commit_locked()?;
        for (host, hlen) in punch {
            punch_hole(self.files[0].file(), host, hlen);
        }
        Ok(rest)
    }

    /// [`Qcow2Image::invalidate`], for a daemon that has just taken the
    /// image lock: then also the L2 log is taken into use (what a daemon
    /// killed on the image left in it written into the image first; see
    /// [`l2log`]). Allocating writes hold their L2 entries back from then
    /// on. Returns what the log had.
    pub fn claim(&self) -> Result<Adopted, FormatError> {
        self.reread(true)
    }

    fn reread(&self, claim: bool) -> Result<Adopted, FormatError> {
        let _group = lock(&self.commit_lock);
        let _meta = lock(&self.meta);
        let mut adopted = Adopted::default();
        if self.writable {
            self.commit_locked()?;
            self.files[0]
                .sync_now()
                .map_err(FormatError::io("fdatasync"))?;
            if let (true, Some(log)) = (claim, &self.l2log) {
                adopted = self.files[0]
                    .adopt_log(Arc::clone(log))
                    .map_err(FormatError::io("applying the L2 log"))?;
            }
            // imago is flushed and about to drop its caches: the moment
            // to allocate behind it.
            self.write_qemu_bitmaps();
            // imago reads the header as it found it at open (its view)
            // and writes its first 72 bytes with the backing file name's
            // offset and size it read then: those writes carry the file's
            // own, which a bitmaps extension added or removed since (by
            // this process, or by a migration's source) may have moved.
            let mut real = vec![0u8; 12];
            self.files[0]
                .file()
                .read_exact_at(&mut real, 8)
                .map_err(FormatError::io("rereading the header"))?;
            self.files[0].patch_imago_writes(vec![(8, real)]);
        }
        self.cache.clear();
        *lock(&self.warm) = Warm::default();
        lock(&self.uncommitted).clear();
        // SAFETY: imago's contract for dropping its caches without writing
        // them is that the on-disk state is consistent: everything was just
        // written and synced above (a read-only image has nothing to
        // write), and `meta` keeps every other metadata operation out.
        unsafe { self.top.invalidate_cache() }.map_err(FormatError::io("rereading metadata"))?;
        self.size.store(self.top.size(), Ordering::Release);
        self.files[0]
            .load_shadow()
            .map_err(FormatError::io("rereading metadata"))?;
        Ok(adopted)
    }

    /// Whether the top has the L2 log's mark set (see [`l2log`]): a daemon
    /// that held it stopped uncleanly (or another holds it now), and its
    /// L2 log has entries the image's tables lack.
    pub fn marked(&self) -> io::Result<bool> {
        self.files[0].file_marked()
    }

    /// Whether taking the L2 log into use ([`Qcow2Image::claim`]) has
    /// something to do: the top is [`marked`](Self::marked), or it is not
    /// and the log still has entries for it (another program wrote the
    /// image after a daemon stopped uncleanly on it: the log is dropped,
    /// with a WARN line).
    pub fn needs_recovery(&self) -> io::Result<bool> {
        if self.marked()? {
            return Ok(true);
        }
        let Some(log) = &self.l2log else {
            return Ok(false);
        };
        let found = log.entries_for(self.files[0].file())?;
        Ok(found.stale.is_none() && !found.entries.is_empty())
    }

    /// The top's L2 log, if it has one.
    pub fn l2_log_path(&self) -> Option<&Path> {
        self.l2log.as_deref().map(L2Log::path)
    }

    /// Bytes of L2 tables held back from the file now (see [`l2log`]).
    pub fn held_l2_bytes(&self) -> usize {
        self.files[0].held_l2_bytes()
    }

    /// Holds the metadata lock, as the metadata thread at work does.
    #[cfg(test)]
    pub fn hold_meta(&self) -> MutexGuard<'_, ()> {
        lock(&self.meta)
    }

    /// fdatasyncs of the top so far: the ordering's cost, for tests and
    /// the report.
    pub fn syncs(&self) -> u64 {
        self.files[0].syncs()
    }

    /// A guest-data write of the test harness (the engine in phase 2): a
    /// pwrite of file 0, recorded in the journal when there is one.
    pub fn data_write(&self, data: &[u8], host: u64) -> io::Result<()> {
        self.files[0].data_write(data, host)
    }

    /// A write-through guest-data write of the harness (tests): the data,
    /// then an fdatasync (what the engine's RWF_DSYNC does), both recorded.
    pub fn data_write_dsync(&self, data: &[u8], host: u64) -> io::Result<()> {
        self.files[0].data_write(data, host)?;
        self.files[0].sync_now()
    }
}

fn punch_hole(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: fallocate(2) on a descriptor the image owns; no memory is
    // passed. Failing only leaves the space allocated (it reads as zeroes
    // through the zero flag either way).
    unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        );
    }
}

/// An iovec over `bytes` (for a write: read only).
fn iovec_of(bytes: &[u8]) -> libc::iovec {
    libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    }
}

/// A cluster's copy-on-write ([`Qcow2Image::allocate_cow`]): the
/// cluster's bytes as the guest reads them, encrypted for the top when it
/// is, in one aligned buffer of the cluster's size (zeroes where nothing
/// was read, and in the write's own range), and the ranges of it to
/// write (cluster offsets: the head before the write's range, the tail
/// after it, each next to it; none where the file reads as them already).
struct Cow {
    buf: AlignedBuf,
    copies: Vec<std::ops::Range<usize>>,
}

/// Writes a cluster's copied head, the guest's `len` bytes from byte
/// `from` of `data` at cluster offset `at`, and its copied tail, as one
/// pwritev through the top's ordering ([`FileState::copy_writev`]).
/// Returns the host offset the write ended at.
///
/// # Safety
/// `data` readable for the call.
unsafe fn write_with_copies(
    top: &FileState,
    host: u64,
    cow: &Cow,
    data: &[libc::iovec],
    from: usize,
    (at, len): (u64, u64),
) -> io::Result<u64> {
    let at = at as usize;
    let copy = |r: &std::ops::Range<usize>| iovec_of(&cow.buf.as_slice()[r.clone()]);
    let mut iovecs = Vec::with_capacity(data.len() + 2);
    let head = cow.copies.iter().find(|r| r.start < at);
    let tail = cow.copies.iter().find(|r| r.start > at);
    iovecs.extend(head.map(copy));
    slice_iovecs(data, from, len as usize, &mut iovecs);
    iovecs.extend(tail.map(copy));
    let start = head.map_or(at, |r| r.start);
    let end = tail.map_or(at + len as usize, |r| r.end);
    // SAFETY: the copies live in `cow` across the call; the rest are
    // inside `data`'s iovecs, readable for the call (our caller's
    // promise).
    unsafe { top.copy_writev(None, &iovecs, host + start as u64)? };
    Ok(host + end as u64)
}

/// [`write_with_copies`] with `--direct`: the guest's bytes copied into
/// the cluster's buffer between head and tail, and the buffer written
/// O_DIRECT through `direct` (the engine's descriptor of the top) from
/// the first to the last byte to write, widened to [`BOUNCE_ALIGN`] (a
/// multiple of every O_DIRECT alignment the engine accepts; the cluster
/// size is one too, as the caller checks): what it widens over reads as
/// the buffer's zeroes already.
///
/// # Safety
/// `data` readable for the call.
unsafe fn write_cluster_direct(
    top: &FileState,
    direct: &File,
    host: u64,
    cow: &mut Cow,
    data: &[libc::iovec],
    from: usize,
    (at, len): (u64, u64),
) -> io::Result<u64> {
    let at = at as usize;
    let b = cow.buf.as_mut_slice();
    let mut parts = Vec::new();
    slice_iovecs(data, from, len as usize, &mut parts);
    let mut o = at;
    for v in parts {
        // SAFETY: inside `data`'s iovecs, readable for the call (our
        // caller's promise); guest memory the guest may change meanwhile
        // is only copied, as the engine's write would have read it.
        let part = unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) };
        b[o..o + part.len()].copy_from_slice(part);
        o += part.len();
    }
    let lo = cow.copies.iter().map(|r| r.start).fold(at, usize::min);
    let hi = cow.copies.iter().map(|r| r.end).fold(o, usize::max);
    let lo = lo / BOUNCE_ALIGN * BOUNCE_ALIGN;
    let hi = hi.div_ceil(BOUNCE_ALIGN) * BOUNCE_ALIGN;
    let iovec = [iovec_of(&b[lo..hi])];
    // SAFETY: the iovec covers part of `cow.buf`, alive across the call.
    unsafe { top.copy_writev(Some(direct), &iovec, host + lo as u64)? };
    Ok(host + hi as u64)
}

/// Appends a piece, merging it into the last one when it continues it.
fn push_piece(out: &mut Vec<Piece>, guest: u64, len: u64, at: Where) {
    if let Some(last) = out.last_mut()
        && last.guest + last.len == guest
    {
        let merged = match (last.at, at) {
            (Where::Zero, Where::Zero)
            | (Where::Slow, Where::Slow)
            | (Where::Written, Where::Written) => true,
            (
                Where::Data {
                    file: f1,
                    offset: o1,
                },
                Where::Data {
                    file: f2,
                    offset: o2,
                },
            ) => f1 == f2 && o1 + last.len == o2,
            _ => false,
        };
        if merged {
            last.len += len;
            return;
        }
    }
    out.push(Piece { guest, len, at });
}

/// Opens the qcow2 image at `path` and, below it, its backing chain.
/// Returns imago's handle and the first bytes of the header.
/// Formats `file` (empty, at `path`) as a qcow2 v3 image of `size` bytes
/// with clusters of `cluster_size`, over the backing file `backing` (its
/// name as the header records it, and its format), or standing alone:
/// imago's writes go straight through (an unloaded ordered file passes
/// them on). Not synced: the caller syncs before anything points at it.
pub fn create(
    file: &File,
    path: &Path,
    size: u64,
    cluster_size: u64,
    backing: Option<(&str, &str)>,
) -> io::Result<()> {
    let mut blank = FileState::new(file.try_clone()?, path, 0)?;
    blank.make_ordered(true, None);
    let mut builder = Qcow2::<ChainFile, Layer>::create_builder(ChainFile(Arc::new(blank)))
        .size(size)
        .cluster_size(cluster_size as usize);
    if let Some((name, format)) = backing {
        builder = builder.backing(name.to_string(), format.to_string());
    }
    builder.create()
}

fn open_qcow2(
    path: &Path,
    options: &OpenOptions,
    max_chain: usize,
    chain: &mut Chain,
) -> Result<(Layer, Vec<u8>), FormatError> {
    let index = chain.files.len();
    let writable = options.writable && index == 0;
    let (file, header) = open_file(path, writable, options, max_chain, chain)?;
    if header.len() < 104 || header[..4] != super::QCOW2_MAGIC {
        return Err(open_err(path, "not a qcow2 image (no qcow2 magic)"));
    }
    let version = be32(&header[4..8]);
    if writable && version < 3 {
        return Err(open_err(
            path,
            "qcow2 version 2 is served read-only (--readonly), or upgrade it: qemu-img amend -o compat=1.1",
        ));
    }
    // An encrypted image's clusters hold ciphertext, which imago would
    // serve as the guest's bytes (and a write would put plaintext among
    // them): refused, in every layer of the chain, before anything is
    // written.
    match be32(&header[32..36]) {
        0 => {}
        1 => {
            return Err(open_err(
                path,
                "is encrypted with qcow2's legacy AES method (encryption=on), which is not supported; \
                 convert it: qemu-img convert -O qcow2 -o encrypt.format=luks,...",
            ));
        }
        2 => {}
        m => return Err(open_err(path, format!("unknown encryption method {m}"))),
    }
    let crypt = match be32(&header[32..36]) {
        2 => {
            Some(crypt::open(&file, options.passphrase.as_deref()).map_err(|r| open_err(path, r))?)
        }
        _ => None,
    };
    let incompat = u64::from_be_bytes(header[72..80].try_into().unwrap_or([0; 8]));
    let autoclear = u64::from_be_bytes(header[88..96].try_into().unwrap_or([0; 8]));
    // The mark (or an older daemon's): the L2 log has entries the image
    // lacks. Only a writable open with the log may take it (and write them
    // in when it claims the image); any other would serve the image
    // without them, or write it with the mark left set.
    let marked = version >= 3 && (incompat & l2log::OLD_MARK != 0 || autoclear & l2log::MARK != 0);
    if marked && !(writable && options.l2_log.is_some()) {
        return Err(open_err(
            path,
            format!(
                "holds L2 entries in its L2 log ({}) from a daemon that stopped uncleanly (or that serves it now); \
                 serve it read-write once with ringblk (--format qcow2, the L2 log on, as by default), which writes them in",
                l2log::path_for(path).display()
            ),
        ));
    }
    if writable && be32(&header[60..64]) != 0 {
        return Err(open_err(
            path,
            "has internal snapshots; writing to it is not supported (--readonly, or qemu-img snapshot -d)",
        ));
    }
    // QEMU's bitmaps, checked before imago writes anything (bitmaps.rs).
    let qemu_bitmaps = if writable {
        bitmaps::Bitmaps::load(&file)
            .map_err(|e| open_err(path, format!("bitmaps extension: {e}")))?
    } else {
        None
    };
    let mut state = FileState::new(file, path, index).map_err(|e| open_err(path, e))?;
    if let Some(crypt) = crypt {
        state.set_crypt(Arc::new(crypt));
    }
    if writable {
        state.make_ordered(options.ordered, options.journal.clone());
    }
    if qemu_bitmaps.is_some() {
        // imago reads the autoclear field as zero from its open on, so it
        // does not rewrite the whole header to clear it (which, with a
        // migration's source still writing the image, could undo that
        // one's header writes); `mark_in_use` below writes the field.
        let view = bitmaps::header_view(state.file()).map_err(|e| open_err(path, e))?;
        state.show_imago(view);
    }
    let state = Arc::new(state);
    chain.files.push(Arc::clone(&state));
    let mut q = Qcow2::<ChainFile, Layer>::open_image(ChainFile(Arc::clone(&state)), writable)
        .map_err(|e| open_err(path, e))?;
    if writable && !state.imago_viewed() {
        // The header as imago left it at open (autoclear bits cleared):
        // what it keeps reading once a first bitmap adds the extension.
        let view = bitmaps::header_view(state.file()).map_err(|e| open_err(path, e))?;
        state.show_imago(view);
    }
    state.load_shadow().map_err(|e| open_err(path, e))?;
    if q.requires_external_data_file() {
        return Err(open_err(
            path,
            "uses an external data file, which is not supported",
        ));
    }
    let cluster_bits = be32(&header[20..24]);
    chain.min_cluster_bits = chain.min_cluster_bits.min(cluster_bits);
    check_l1_covers(path, &header, q.size())?;
    let backing = match q.implicit_backing_file() {
        None => None,
        Some(name) => {
            let name = name.clone();
            let Some(format) = q.implicit_backing_format().cloned() else {
                return Err(open_err(
                    path,
                    format!(
                        "the format of backing file {name:?} is not recorded and is never probed; \
                         record it: qemu-img rebase -u -b {name} -F raw|qcow2 {}",
                        path.display()
                    ),
                ));
            };
            let bpath = resolve_backing(path, &name).map_err(|e| open_err(path, e))?;
            Some(match format.as_str() {
                "qcow2" => open_qcow2(&bpath, options, max_chain, chain)?.0,
                "raw" => {
                    let (file, _) = open_file(&bpath, false, options, max_chain, chain)?;
                    let st = Arc::new(
                        FileState::new(file, &bpath, chain.files.len())
                            .map_err(|e| open_err(&bpath, e))?,
                    );
                    chain.files.push(Arc::clone(&st));
                    let raw =
                        Raw::open_image(ChainFile(st), false).map_err(|e| open_err(&bpath, e))?;
                    let layer: Layer = Arc::new(FormatAccess::new(raw));
                    chain.set_layer(chain.files.len() - 1, &layer);
                    layer
                }
                other => {
                    return Err(open_err(
                        path,
                        format!(
                            "backing file {name:?} has format {other:?}; only raw and qcow2 are supported"
                        ),
                    ));
                }
            })
        }
    };
    // Last, once nothing else can refuse the open.
    if let Some(mut b) = qemu_bitmaps {
        let cluster_size = 1u64 << be32(&header[20..24]);
        if b.directory_clusters(cluster_size)
            .any(|c| state.is_metadata(c))
        {
            return Err(open_err(
                path,
                "bitmaps extension: the bitmap directory overlaps other metadata",
            ));
        }
        let names: Vec<&str> = b.entries.iter().map(|e| e.name.as_str()).collect();
        let names = names.join(", ");
        let loaded = if options.bitmaps_at_claim {
            // Nothing written: another process may hold the image now.
            log::info!(
                "{}: QEMU's persistent bitmaps {names}, marked in use from when ringblk claims the image",
                path.display()
            );
            None
        } else {
            // The bits as they were, before they are marked in use.
            let loaded = b.load_all(state.file());
            b.mark_in_use(state.file()).map_err(|e| open_err(path, e))?;
            log::info!(
                "{}: QEMU's persistent bitmaps {names} marked in use while ringblk holds the image",
                path.display()
            );
            Some(loaded)
        };
        chain.qemu = Some(QemuBitmaps {
            dir: Some(b),
            loaded,
            staged: None,
            at_snapshot: None,
            marked: !options.bitmaps_at_claim,
        });
    } else if writable {
        // No bitmaps yet: the first one added creates the extension.
        chain.qemu = Some(QemuBitmaps {
            dir: None,
            loaded: None,
            staged: None,
            at_snapshot: None,
            marked: !options.bitmaps_at_claim,
        });
    }
    q.set_backing(backing);
    let layer: Layer = Arc::new(FormatAccess::new(q));
    chain.set_layer(index, &layer);
    Ok((layer, header))
}

impl Chain {
    fn set_layer(&mut self, index: usize, layer: &Layer) {
        if self.layers.len() <= index {
            self.layers.resize(index + 1, None);
        }
        self.layers[index] = Some(Arc::clone(layer));
    }
}

/// Opens one file of the chain, refusing loops and chains past the bound,
/// and reads the first bytes of its header. A file the chain names is
/// the image's word, not the operator's: a FIFO there is refused, not
/// waited on, as is anything but a regular file or a block device; and
/// with [`OpenOptions::backing_dirs`] it must resolve inside one of them.
fn open_file(
    path: &Path,
    writable: bool,
    options: &OpenOptions,
    max_chain: usize,
    chain: &mut Chain,
) -> Result<(File, Vec<u8>), FormatError> {
    if chain.files.len() >= max_chain {
        return Err(open_err(
            path,
            format!("the backing chain is deeper than {max_chain} images"),
        ));
    }
    let top = chain.files.is_empty();
    let how = crate::host::Untrusted {
        write: writable,
        nofollow: top && options.nofollow_top,
        block_device: true,
    };
    let file = crate::host::open_untrusted(path, how).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) if how.nofollow => {
            open_err(path, "is a symbolic link; refusing to follow it")
        }
        _ => open_err(path, e),
    })?;
    if let (false, Some(dirs)) = (top, &options.backing_dirs) {
        let real = crate::host::real_path(&file).map_err(|e| open_err(path, e))?;
        if !dirs.iter().any(|d| real.starts_with(d)) {
            let dirs: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
            return Err(open_err(
                path,
                format!(
                    "backing file resolves to {}, outside every --backing-dir ({}); move it into one, or add its directory with --backing-dir",
                    real.display(),
                    dirs.join(", ")
                ),
            ));
        }
    }
    let meta = file.metadata().map_err(|e| open_err(path, e))?;
    if !chain.seen.insert((meta.dev(), meta.ino())) {
        return Err(open_err(path, "the backing chain loops back to this file"));
    }
    let mut header = vec![0u8; 104.min(meta.len() as usize)];
    file.read_exact_at(&mut header, 0)
        .map_err(|e| open_err(path, e))?;
    Ok((file, header))
}

/// Refuses an L1 table too small for the virtual size (QEMU does too): the
/// image would need its L1 table grown on a write, which is not done at
/// run time.
fn check_l1_covers(path: &Path, header: &[u8], size: u64) -> Result<(), FormatError> {
    let cluster_bits = u64::from(be32(&header[20..24]));
    let l1_size = u64::from(be32(&header[36..40]));
    // Each L1 entry covers cluster_size / 8 clusters.
    let per_l1 = 1u128 << (2 * cluster_bits - 3);
    if u128::from(l1_size) * per_l1 < u128::from(size) {
        return Err(open_err(
            path,
            format!(
                "its L1 table ({l1_size} entries) is too small for its virtual size ({size} bytes)"
            ),
        ));
    }
    Ok(())
}

impl Image for Qcow2Image {
    fn writable(&self) -> bool {
        self.writable
    }

    /// The chain's paths, top first (for `ctl status`).
    fn chain(&self) -> Vec<PathBuf> {
        self.files.iter().map(|f| f.path().to_path_buf()).collect()
    }

    fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// The transform of each file of the chain (see
    /// [`crate::disk::seam::Format::crypts`]): empty when none is
    /// encrypted.
    fn crypts(&self) -> Vec<Option<Arc<Crypt>>> {
        if !self.encrypted() {
            return Vec::new();
        }
        self.files.iter().map(|f| f.crypt_shared()).collect()
    }

    /// See [`super::Image::resolve_write`].
    unsafe fn resolve_write(
        &self,
        offset: u64,
        len: u64,
        data: WriteData<'_>,
        out: &mut Vec<Piece>,
    ) -> Result<Option<Commit>, FormatError> {
        self.check_write(offset, len, &data)?;
        let _meta = lock(&self.meta);
        // SAFETY: as our caller promises.
        unsafe { self.resolve_write_locked(offset, offset + len, Some(data), false, out) }
    }

    /// See [`super::Image::resolve_write_now`]: not with `--direct` (the
    /// cluster's write would wait for the device) nor on an encrypted top
    /// (the engine encrypts the data), nor while the metadata lock is
    /// taken (the metadata thread at work: a commit's fdatasync may take
    /// milliseconds).
    unsafe fn resolve_write_now(
        &self,
        offset: u64,
        len: u64,
        data: WriteData<'_>,
        out: &mut Vec<Piece>,
    ) -> Option<Result<Option<Commit>, FormatError>> {
        if data.direct.is_some() || self.files[0].crypt().is_some() {
            return None;
        }
        if let Err(e) = self.check_write(offset, len, &data) {
            return Some(Err(e));
        }
        let _meta = try_lock(&self.meta)?;
        // SAFETY: as our caller promises.
        match unsafe { self.resolve_write_locked(offset, offset + len, Some(data), true, out) } {
            // Head or tail not in the page cache: the metadata thread
            // does it (again from the start: the clusters done already
            // map as allocated then).
            Err(FormatError::Io { source, .. }) if source.kind() == io::ErrorKind::WouldBlock => {
                out.clear();
                None
            }
            done => Some(done),
        }
    }

    /// See [`super::Image::commit_now`].
    fn commit_now(&self, ticket: Commit) -> Option<Result<(), FormatError>> {
        if self.committed.load(Ordering::Acquire) >= ticket.0 {
            return Some(Ok(()));
        }
        let _group = try_lock(&self.commit_lock)?;
        let _meta = try_lock(&self.meta)?;
        if self.committed.load(Ordering::Acquire) < ticket.0 {
            return Some(self.commit_allocations_locked());
        }
        Some(Ok(()))
    }

    /// See [`super::Image::commit`].
    fn commit(&self, ticket: Commit, durable: bool) -> Result<(), FormatError> {
        if !durable && self.committed.load(Ordering::Acquire) >= ticket.0 {
            return Ok(());
        }
        let _group = lock(&self.commit_lock);
        if self.committed.load(Ordering::Acquire) < ticket.0 {
            let _meta = lock(&self.meta);
            self.commit_allocations_locked()?;
        }
        if durable {
            // The L2 entries (and anything else) pwritten since the last
            // fdatasync, this ticket's among them, whoever committed them.
            // The write's own data went with FUA (RWF_DSYNC).
            self.files[0]
                .sync_if_unsynced()
                .map_err(FormatError::io("fdatasync"))?;
        }
        Ok(())
    }

    /// See [`super::Image::flush`].
    fn flush(&self) -> Result<(), FormatError> {
        if !self.writable {
            return Ok(());
        }
        let _group = lock(&self.commit_lock);
        let _meta = lock(&self.meta);
        self.commit_locked()?;
        self.files[0]
            .sync_now()
            .map_err(FormatError::io("fdatasync"))
    }

    /// See [`super::Image::write_zeroes`]: whole clusters become zero
    /// clusters, keeping their allocation (so a cluster is never freed and
    /// reused while a request may still be in flight to it); with `unmap`
    /// their space is punched out of the file.
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        unmap: bool,
    ) -> Result<Vec<(u64, u64)>, FormatError> {
        self.check(offset, len, Dir::Write)?;
        if !self.v3 {
            return Ok(vec![(offset, len)]);
        }
        let csize = self.cluster_size();
        let end = offset + len;
        let first = offset.div_ceil(csize) * csize;
        // The last cluster may be partial: it is whole if the range ends at
        // the image's end.
        let last = if end == self.size() {
            end
        } else {
            end & !(csize - 1)
        };
        if first >= last {
            return Ok(vec![(offset, len)]);
        }
        let mut rest = Vec::new();
        if offset < first {
            rest.push((offset, first - offset));
        }
        if last < end {
            rest.push((last, end - last));
        }
        let _group = lock(&self.commit_lock);
        let _meta = lock(&self.meta);
        rest.extend(self.zero_locked(first, last, unmap)?);
        Ok(rest)
    }

    /// Write-zeroes of `[offset, offset + len)`, all of it: the whole
    /// clusters as zero clusters (see [`Qcow2Image::write_zeroes`]), the
    /// unaligned head and tail as data (through imago, which allocates and
    /// copies on write where needed), everything committed before this
    /// returns. Blocks.
    fn zero_range(&self, offset: u64, len: u64, unmap: bool) -> Result<(), FormatError> {
        let rest = self.write_zeroes(offset, len, unmap)?;
        if rest.is_empty() {
            return Ok(());
        }
        let _group = lock(&self.commit_lock);
        let _meta = lock(&self.meta);
        const CHUNK: u64 = 1 << 20;
        let zeroes = vec![0u8; CHUNK.min(len) as usize];
        let encrypted = self.encrypted();
        for (mut at, n) in rest {
            let end = at + n;
            self.forget(at, end);
            while at < end {
                let k = (end - at).min(CHUNK);
                if encrypted {
                    // Zeroes the guest reads back: encrypted zeroes.
                    self.write_locked(&zeroes[..k as usize], at)?;
                } else {
                    self.imago_changes();
                    self.top
                        .write(&zeroes[..k as usize], at)
                        .map_err(FormatError::io("writing zeroes"))?;
                }
                at += k;
            }
        }
        self.dirty.fetch_add(1, Ordering::AcqRel);
        self.commit_locked()
    }

    /// Discard of `[offset, offset + len)`: its whole clusters read as
    /// zeroes and their space is given back to the host file; the rest is
    /// left as it is (a discard is a hint). Blocks.
    fn discard(&self, offset: u64, len: u64) -> Result<(), FormatError> {
        self.write_zeroes(offset, len, true).map(|_| ())
    }

    /// Grows the image to `new_size` (see [`super::Image::grow`]); the new
    /// area reads as zeroes even where a backing file is longer.
    fn grow(&self, new_size: u64) -> Result<(), FormatError> {
        if !self.writable {
            return Err(FormatError::ReadOnly);
        }
        let _group = lock(&self.commit_lock);
        let _meta = lock(&self.meta);
        if new_size <= self.size() {
            return Ok(());
        }
        self.commit_locked()?;
        let old_size = self.size();
        // No preallocation inside imago's grow: it would allocate L2 tables
        // in the same operation that frees the old L1 table, and could
        // reuse that table's cluster while the header on disk still points
        // to it.
        self.imago_changes();
        self.top
            .resize_grow(new_size, PreallocateMode::None)
            .map_err(FormatError::io("growing"))?;
        self.dirty.fetch_add(1, Ordering::AcqRel);
        self.commit_locked()?;
        self.files[0]
            .sync_now()
            .map_err(FormatError::io("fdatasync"))?;
        self.size.store(new_size, Ordering::Release);
        // Where a backing file is longer than the image was, its data must
        // not show through the new area (QEMU zeroes it too): zero clusters.
        let longest = self.files[1..]
            .iter()
            .filter_map(|f| f.file().metadata().ok().map(|m| m.len()))
            .max()
            .unwrap_or(0);
        if longest > old_size {
            let csize = self.cluster_size();
            let first = old_size.div_ceil(csize) * csize;
            if first > old_size {
                // The rest of the old last cluster: zeroes as data.
                let head = (first.min(new_size) - old_size) as usize;
                self.imago_changes();
                self.top
                    .write(&vec![0u8; head][..], old_size)
                    .map_err(FormatError::io("zeroing"))?;
            }
            let last = longest.min(new_size).div_ceil(csize) * csize;
            if first < last.min(new_size) {
                let rest = self.zero_locked(first, last.min(new_size), false)?;
                if !rest.is_empty() {
                    return Err(FormatError::Unsupported(format!(
                        "cannot zero {rest:?} after growing"
                    )));
                }
            }
            self.commit_locked()?;
        }
        self.size.store(new_size, Ordering::Release);
        Ok(())
    }

    /// Makes everything durable, then forgets every cached mapping and
    /// table, so that the next request reads the metadata fresh from the
    /// file: for when another process may have written the image meanwhile
    /// (the source of a migration before it stops, and the side that gets
    /// the image back).
    fn invalidate(&self) -> Result<(), FormatError> {
        self.reread(false).map(|_| ())
    }

    /// Whether metadata is held back from the file (see [`l2log`]): a
    /// FLUSH must then go through [`Image::flush`].
    #[inline]
    fn holds_back(&self) -> bool {
        self.files[0].holding()
    }

    fn missed(&self, offset: u64) -> bool {
        // What one L2 table of the top maps: cluster_size / 8 clusters.
        let cover_bits = (2 * self.cluster_bits - 3).min(63);
        let table = offset >> cover_bits;
        let mut w = lock(&self.warm);
        if !w.taken.insert(table) {
            return false;
        }
        let start = table << cover_bits;
        let end = start.saturating_add(1 << cover_bits).min(self.size());
        w.pending.push_back((start, end));
        true
    }

    fn warm_step(&self) -> bool {
        let Some((next, end)) = lock(&self.warm).pending.pop_front() else {
            return false;
        };
        // Never past half the cache: it would push out what requests
        // found there.
        if self.cache.entries() >= self.cache.capacity() / 2 {
            lock(&self.warm).pending.clear();
            return false;
        }
        let gb = self.granule_bits;
        let to = next.saturating_add(WARM_STEP << gb).min(end);
        let mut scratch = Vec::new();
        let done = {
            let _meta = lock(&self.meta);
            self.resolve_read(next, to, &mut scratch)
        };
        let mut w = lock(&self.warm);
        if done.is_ok() && to < end {
            w.pending.push_front((to, end));
        }
        !w.pending.is_empty()
    }

    fn as_qcow2(&self) -> Option<&Qcow2Image> {
        Some(self)
    }
}

/// A qcow2 image's mapping through its chain.
impl Mapper for Qcow2Image {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn files(&self) -> Vec<&File> {
        self.files.iter().map(|f| f.file()).collect()
    }

    /// The fast path: see [`Mapper::map`].
    fn map(&self, offset: u64, len: u64, dir: Dir, out: &mut Vec<Piece>) {
        let gb = self.granule_bits;
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let granule = pos >> gb;
            let next = ((granule + 1) << gb).min(end);
            let within = pos - (granule << gb);
            let at = match (self.cache.get(granule), dir) {
                (Some(Loc::Data { file, offset, .. }), Dir::Read) => Where::Data {
                    file,
                    offset: offset + within,
                },
                (
                    Some(Loc::Data {
                        file: 0,
                        offset,
                        writable: true,
                    }),
                    Dir::Write,
                ) => Where::Data {
                    file: 0,
                    offset: offset + within,
                },
                (Some(Loc::Zero), Dir::Read) => Where::Zero,
                _ => Where::Slow,
            };
            push_piece(out, pos, next - pos, at);
            pos = next;
        }
    }

    /// The slow path: see [`Mapper::resolve`].
    fn resolve(
        &self,
        offset: u64,
        len: u64,
        dir: Dir,
        out: &mut Vec<Piece>,
    ) -> Result<Option<Commit>, FormatError> {
        self.check(offset, len, dir)?;
        let end = offset + len;
        let _meta = lock(&self.meta);
        if dir == Dir::Read {
            self.resolve_read(offset, end, out)?;
            return Ok(None);
        }
        // SAFETY: no data.
        unsafe { self.resolve_write_locked(offset, end, None, false, out) }
    }

    fn crypt(&self, file: usize) -> Option<&Crypt> {
        self.files.get(file)?.crypt()
    }

    /// Reads `buf` at guest `offset` through imago (compressed clusters).
    fn read_slow(&self, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        self.check(offset, buf.len() as u64, Dir::Read)?;
        self.top
            .read(buf, offset)
            .map_err(FormatError::io("reading compressed data"))
    }
}
