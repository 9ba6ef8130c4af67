//! Changed-block tracking and the running backup (docs/backup.md): the
//! device's dirty bitmaps, the point-in-time view a backup exports over
//! NBD, and what every write must do for them before it reaches the image
//! ([`Targets`]).
//!
//! **The write path.** Each write, discard and write-zeroes is handed to
//! the [`Targets`] of the moment before the engine starts it
//! (`engine::Core::submit`): every live bitmap marks its range, and a
//! running backup copies the old data of the clusters it touches first.
//! The core learns that there is anything to do from one relaxed load of
//! [`Tracking::generation`]: 0 while there is nothing (no bitmap loaded,
//! no backup), else the number of the current targets, which the core
//! fetches under the lock only when the number changed. Marking at
//! submission, not completion, means that a write that reached the image
//! is in the bitmap even if the daemon is killed before it completes.
//!
//! **Switching without a write in flight.** Every change of the targets
//! made while the guest runs (a bitmap added or removed, a backup started
//! or stopped, bitmaps resized) is made with the queues *quiesced*
//! ([`Connection::quiesce`](super::Connection::quiesce)): every queue's
//! worker is held, its requests in flight complete, the change is made,
//! and the queues go on; requests popped but not started wait. So a
//! backup's instant has no write on either side of it: each write was
//! either complete before it, or is submitted after it and copied first.
//! The guest is paused for as long as that takes, nothing more: the
//! socket, the bitmap's durable state and the copy-before-write file are
//! prepared before and torn down after.
//!
//! **Loaded while held.** Bitmaps are loaded from their store when the
//! device first *holds* the image ([`Device::claim_image`]: the first ring
//! starts, or a verb or a backup needs them) and written out when the
//! last holder lets go (the rings stop: a migration's source before the
//! destination starts its own, which then loads what the source wrote).
//! Holding takes the image lock, so a verb that finds the image held by
//! another process (the other side of a migration) is refused. In
//! between, `bitmap list` shows what was last loaded or peeked.
//!
//! A backup holds the image from start to stop: the image lock is not
//! given up under a view that another writer would falsify (a migration
//! while a backup runs waits for the lock; stop the backup first).

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use serde::Serialize;

use super::{Device, ResizeError};
use crate::backup::{CbwStats, CbwStore, DEFAULT_CLUSTER, FileImage, View};
use crate::bitmap::{BitmapError, BitmapInfo, BitmapStore, DEFAULT_GRANULARITY, DirtyBitmap};
use crate::disk::reader::{Decrypted, Reader};
use crate::io::Locked;
use crate::metrics::SharedRateLimiter;
use crate::nbd::{self, ServerStats};

/// What each write, discard and write-zeroes does before it reaches the
/// image, at one moment: see the module doc.
#[derive(Default)]
pub struct Targets {
    bitmaps: Vec<Arc<DirtyBitmap>>,
    cbw: Option<Arc<CbwStore>>,
}

impl Targets {
    /// Marks `[offset, offset + len)` in every live bitmap and, during a
    /// backup, copies the old data of the clusters it touches first.
    /// Returns when the write may go to the image.
    pub fn before_write(&self, offset: u64, len: u64) {
        for b in &self.bitmaps {
            b.mark(offset, len);
        }
        if let Some(cbw) = &self.cbw {
            cbw.before_write(offset, len);
        }
    }

    fn is_empty(&self) -> bool {
        self.bitmaps.is_empty() && self.cbw.is_none()
    }
}

/// Why a bitmap or backup verb was refused or failed. One line each.
#[derive(Debug, thiserror::Error)]
pub enum TrackingError {
    /// This device has no bitmaps, or no backups: why.
    #[error("{0}")]
    Unsupported(String),
    #[error(transparent)]
    Bitmap(#[from] BitmapError),
    #[error("{HELD_ELSEWHERE}: its bitmaps and backups are that process's")]
    Locked,
    #[error("{}", Unclaimed::Unmarked)]
    Unmarked,
    #[error("a backup is running (NBD on {0}); `backup stop` it first")]
    BackupRunning(String),
    #[error("a backup is starting (NBD on {0}); try again once it has started")]
    BackupStarting(String),
    #[error("no backup is running")]
    NoBackup,
    /// A block job is changing the chain the backup would read.
    #[error("{0}")]
    JobRunning(String),
    #[error(
        "bitmap '{0}' is exported by the running backup; `backup stop` (or `backup stop --failed`) first"
    )]
    Exported(String),
    #[error("--nbd {path}: {why}")]
    Socket { path: String, why: String },
    #[error("backup: {0}")]
    Io(String),
}

impl TrackingError {
    /// The HTTP status the API answers with.
    pub fn status(&self) -> u16 {
        match self {
            TrackingError::Bitmap(BitmapError::NotFound(_)) | TrackingError::NoBackup => 404,
            TrackingError::Bitmap(BitmapError::Exists(_))
            | TrackingError::Locked
            | TrackingError::BackupRunning(_)
            | TrackingError::BackupStarting(_)
            | TrackingError::JobRunning(_)
            | TrackingError::Exported(_) => 409,
            TrackingError::Bitmap(BitmapError::Io { .. } | BitmapError::Corrupt { .. })
            | TrackingError::Unmarked
            | TrackingError::Io(_) => 500,
            _ => 400,
        }
    }
}

/// What a verb that needs the image says while another process holds it.
pub(super) const HELD_ELSEWHERE: &str = "the image is held by another process (another ringblk, the other side of a migration, or a QEMU)";

/// Why [`Device::claim_image`] could not claim the image.
#[derive(Debug, thiserror::Error)]
pub enum Unclaimed {
    /// Another process holds the image lock: wait for it.
    #[error(transparent)]
    Locked(#[from] Locked),
    /// The lock was free, but writing QEMU's bitmaps in use failed (the
    /// I/O error is logged where it happened): no write may land while a
    /// bitmap on disk says it is complete.
    #[error(
        "QEMU's bitmaps in the image could not be marked in use (the I/O error is in the daemon's log)"
    )]
    Unmarked,
}

impl From<Unclaimed> for TrackingError {
    fn from(e: Unclaimed) -> TrackingError {
        match e {
            Unclaimed::Locked(_) => TrackingError::Locked,
            Unclaimed::Unmarked => TrackingError::Unmarked,
        }
    }
}

/// What a backup needs, prepared at start-up (the daemon opens no file
/// by path after it): see docs/backup.md, "Where a backup's files go".
pub struct BackupSpec {
    /// The directory where `backup start` creates its NBD socket.
    pub dir: PathBuf,
    /// That directory, opened: the socket is removed through it.
    pub dir_fd: File,
    /// The image, opened again for reading through the page cache (the
    /// engines' descriptor may be O_DIRECT). A raw image's view reads it;
    /// a qcow2 image's reads the chain's own files, through its tables.
    pub image: File,
    /// The copy-before-write store: an unlinked file in `dir`, truncated
    /// to nothing between backups.
    pub store: File,
}

/// What `backup status` shows of the running backup.
#[derive(Clone, Debug, Serialize)]
pub struct BackupInfo {
    /// The NBD export's socket.
    pub socket: String,
    /// The bitmap whose bits it exports as `qemu:dirty-bitmap:NAME`.
    pub bitmap: Option<String>,
    /// The size of the disk at the instant.
    pub size: u64,
    /// Seconds since the instant.
    pub seconds: f64,
    /// How long the guest's queues were held for the switch.
    pub switch_us: u64,
    /// Clusters the guest overwrote and the view copied first, and the
    /// bytes they take in the store.
    pub copied_clusters: u64,
    pub stored_bytes: u64,
    /// A copy failed: the view answers EIO from then on.
    pub failed: bool,
    /// NBD connections served, refused (over the limit), ended by an error.
    pub connections: u64,
    pub refused: u64,
    pub errors: u64,
}

/// One bitmap, loaded or not.
enum Entry {
    /// Not loaded: what was last seen of it.
    Stored(BitmapInfo),
    /// Loaded: marks go to it.
    Live(Arc<DirtyBitmap>),
}

/// The backup being served.
struct Running {
    /// Started once the switch is done.
    server: Option<nbd::Server>,
    cbw: Arc<CbwStore>,
    /// The socket's path, and its name in the backup directory.
    socket: PathBuf,
    name: String,
    /// The bitmap's name and a copy of its bits at the instant: what the
    /// export serves. The bitmap itself keeps them until the backup ends
    /// well (see [`Device::backup_stop`]).
    frozen: Option<(String, Arc<DirtyBitmap>)>,
    /// What the bitmap records from the instant on (every mark reaches it
    /// and the bitmap alike), and how often the bitmap had been marked
    /// inconsistent at the instant: at a stop that ends well, the bitmap
    /// becomes this, and inconsistent if it lost changes meanwhile.
    successor: Option<(Arc<DirtyBitmap>, u64)>,
    size: u64,
    started: Instant,
    switch_us: u64,
}

impl Running {
    fn info(&self) -> BackupInfo {
        let CbwStats {
            copied_clusters,
            stored_bytes,
        } = self.cbw.stats();
        let ServerStats {
            served,
            refused,
            failed,
        } = self
            .server
            .as_ref()
            .map(nbd::Server::stats)
            .unwrap_or_default();
        BackupInfo {
            socket: self.socket.display().to_string(),
            bitmap: self.frozen.as_ref().map(|(n, _)| n.clone()),
            size: self.size,
            seconds: self.started.elapsed().as_secs_f64(),
            switch_us: self.switch_us,
            copied_clusters,
            stored_bytes,
            failed: self.cbw.has_failed(),
            connections: served,
            refused,
            errors: failed,
        }
    }
}

struct Inner {
    /// Holders of the image (running rings, a verb, a backup).
    holders: usize,
    /// Where the bitmaps persist, or why this device has none.
    store: Result<Box<dyn BitmapStore>, String>,
    bitmaps: BTreeMap<String, Entry>,
    /// What backups need, or why this device has none.
    backups: Result<BackupSpec, String>,
    backup: Option<Running>,
    /// A `backup start` is under way (the socket's path): a second one is
    /// refused, decided under this lock, until the first has started or
    /// failed (see [`Starting`]).
    starting: Option<PathBuf>,
    /// The number of the last targets made.
    last: u64,
    /// An active commit's own dirty bitmap ([`Device::mirror_start`]):
    /// marked by every write as the live bitmaps are, never stored.
    mirror: Option<Arc<DirtyBitmap>>,
}

/// The device's bitmaps and backup: see the module doc.
pub struct Tracking {
    /// 0: nothing to do before a write; else the number of `current`.
    generation: AtomicU64,
    /// The targets of the moment, and their number. A lock of its own,
    /// held for a pointer's copy only, so that a queue fetching new
    /// targets never waits for the bitmaps' I/O.
    current: Mutex<(u64, Arc<Targets>)>,
    inner: Mutex<Inner>,
}

impl Tracking {
    /// The bitmaps of `store` (peeked, not loaded), and what backups need.
    pub fn new(
        store: Result<Box<dyn BitmapStore>, String>,
        backups: Result<BackupSpec, String>,
        disk_size: u64,
    ) -> Result<Tracking, BitmapError> {
        let mut bitmaps = BTreeMap::new();
        let mut store = store;
        if let Ok(s) = &mut store {
            for info in s.peek(disk_size)? {
                bitmaps.insert(info.name.clone(), Entry::Stored(info));
            }
        }
        Ok(Tracking {
            generation: AtomicU64::new(0),
            current: Mutex::default(),
            inner: Mutex::new(Inner {
                holders: 0,
                store,
                bitmaps,
                backups,
                backup: None,
                starting: None,
                last: 0,
                mirror: None,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// 0 while a write has nothing to do first; else the number of the
    /// targets to fetch with [`Tracking::targets`] when it changed. One
    /// relaxed load: the targets only change while no request of a
    /// holder's is in flight, and a holder's next request comes after a
    /// lock (its worker's, or this one's) that orders the store before it.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// The current targets and their number.
    pub fn targets(&self) -> (u64, Arc<Targets>) {
        let current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        (current.0, current.1.clone())
    }

    /// The descriptors the daemon creates and removes files in after
    /// start-up, for its seccomp filter: the bitmaps' directory (as the
    /// store says) and the backups' directory.
    pub fn backup_dir(&self) -> Option<(PathBuf, RawFd)> {
        let inner = self.lock();
        inner
            .backups
            .as_ref()
            .ok()
            .map(|b| (b.dir.clone(), b.dir_fd.as_raw_fd()))
    }

    /// Whether this device can have bitmaps (else why not).
    pub fn bitmaps_supported(&self) -> Result<(), String> {
        self.lock().store.as_ref().map(|_| ()).map_err(Clone::clone)
    }
}

impl Inner {
    /// Makes new targets from the live bitmaps and the running backup, and
    /// publishes their number (0 when there is nothing to do).
    fn retarget(&mut self, tracking: &Tracking) {
        // The live bitmaps, and what a running backup's bitmap records
        // since its instant.
        let live = self.bitmaps.values().filter_map(|e| match e {
            Entry::Live(b) => Some(b.clone()),
            Entry::Stored(_) => None,
        });
        let successor = self
            .backup
            .as_ref()
            .and_then(|b| b.successor.as_ref())
            .map(|(b, _)| b.clone());
        let targets = Targets {
            bitmaps: live.chain(successor).chain(self.mirror.clone()).collect(),
            cbw: self.backup.as_ref().map(|b| b.cbw.clone()),
        };
        self.last += 1;
        let n = if targets.is_empty() { 0 } else { self.last };
        let mut current = tracking.current.lock().unwrap_or_else(|p| p.into_inner());
        *current = (n, Arc::new(targets));
        tracking.generation.store(n, Ordering::Release);
    }

    fn store(&mut self) -> Result<&mut Box<dyn BitmapStore>, TrackingError> {
        self.store
            .as_mut()
            .map_err(|why| TrackingError::Unsupported(why.clone()))
    }

    /// Loads every bitmap (the image is now held).
    fn activate(&mut self, disk_size: u64, tracking: &Tracking) {
        let Ok(store) = &mut self.store else {
            return;
        };
        for (name, loaded) in store.open(disk_size) {
            let bitmap = loaded.unwrap_or_else(|e| {
                log::error!(
                    "bitmap '{name}' cannot be loaded ({e}); it records from now on, marked inconsistent"
                );
                let b = DirtyBitmap::new(disk_size, granularity_of(&self.bitmaps, &name))
                    .or_else(|_| DirtyBitmap::new(disk_size, DEFAULT_GRANULARITY))
                    .expect("a bitmap at the default granularity");
                b.set_inconsistent();
                b
            });
            self.bitmaps.insert(name, Entry::Live(Arc::new(bitmap)));
        }
        self.retarget(tracking);
    }

    /// Writes every bitmap out (the image is let go).
    fn deactivate(&mut self, tracking: &Tracking) {
        let Ok(store) = &mut self.store else {
            return;
        };
        for (name, entry) in self.bitmaps.iter_mut() {
            if let Entry::Live(b) = entry {
                if let Err(e) = store.close(name, b) {
                    log::error!("writing bitmap '{name}' out: {e}");
                }
                *entry = Entry::Stored(b.info(name));
            }
        }
        self.retarget(tracking);
    }

    /// A backup ended well: its bitmap becomes what it recorded since the
    /// instant (the exported bits leave it), and inconsistent if it was
    /// marked so while the backup ran. Called with no write in flight.
    fn commit_backup(&self, r: &Running) {
        let (Some((n, _)), Some((since, losses))) = (&r.frozen, &r.successor) else {
            return;
        };
        match self.live(n) {
            Ok(live) => {
                let lost = live.losses() != *losses;
                if let Err(e) = live.replace_with(since) {
                    log::error!("bitmap '{n}' after the backup: {e}; marked inconsistent");
                    live.set_inconsistent();
                } else if lost {
                    live.set_inconsistent();
                }
            }
            Err(e) => log::error!("bitmap '{n}' after the backup: {e}"),
        }
    }

    fn live(&self, name: &str) -> Result<Arc<DirtyBitmap>, TrackingError> {
        match self.bitmaps.get(name) {
            Some(Entry::Live(b)) => Ok(b.clone()),
            Some(Entry::Stored(_)) => {
                Err(TrackingError::Io(format!("bitmap '{name}' is not loaded")))
            }
            None => Err(BitmapError::NotFound(name.to_string()).into()),
        }
    }
}

/// The granularity a stored bitmap was last seen with.
fn granularity_of(bitmaps: &BTreeMap<String, Entry>, name: &str) -> u64 {
    match bitmaps.get(name) {
        Some(Entry::Stored(info)) => info.granularity,
        Some(Entry::Live(b)) => b.granularity(),
        None => DEFAULT_GRANULARITY,
    }
}

/// For the claims a guest's requests retry while the image's bitmaps
/// cannot be marked in use.
static UNMARKED: SharedRateLimiter = SharedRateLimiter::new(3, std::time::Duration::from_secs(60));

/// The image held for as long as this lives.
pub(super) struct Hold<'a>(&'a Device);

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        self.0.release_image();
    }
}

/// A `backup start` under way, for as long as this lives (see
/// `Inner::starting`).
struct Starting<'a>(&'a Tracking);

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        self.0.lock().starting = None;
    }
}

/// Where `--nbd PATH` puts the socket: it must be in the backup
/// directory (Landlock lets the daemon make sockets nowhere else). A bare
/// name is taken in it. Returns the path and the name.
fn socket_in(dir: &Path, given: &Path) -> Result<(PathBuf, String), TrackingError> {
    let bad = |why: String| TrackingError::Socket {
        path: given.display().to_string(),
        why,
    };
    let name = match given.file_name().and_then(|n| n.to_str()) {
        Some(n) if !n.is_empty() => n.to_string(),
        _ => return Err(bad("no file name".into())),
    };
    if given.components().any(|c| c == Component::ParentDir) {
        return Err(bad("no '..' in the path".into()));
    }
    let parent = given.parent().filter(|p| !p.as_os_str().is_empty());
    let in_dir = match parent {
        None => true,
        Some(p) => p.components().eq(dir.components()),
    };
    if !in_dir {
        return Err(bad(format!(
            "backups create their sockets in {} only (the daemon's --backup-dir); give a name there",
            dir.display()
        )));
    }
    Ok((dir.join(&name), name))
}

impl Device {
    /// The device's bitmaps and backup.
    pub fn tracking(&self) -> &Tracking {
        &self.tracking
    }

    /// A queue's ring starts, or a verb or a backup needs the image: it is
    /// used until [`Device::release_image`]. The first user takes the
    /// image lock (`Err` while another process holds it: nothing is
    /// claimed then, and it is never waited for here), has a qcow2 image's
    /// metadata read afresh from the file and loads the bitmaps: another
    /// process (a migration's source, a QEMU) may have written both since
    /// this daemon last used the image. QEMU's bitmaps in a qcow2 image
    /// are marked in use first; if that fails, nothing is claimed either.
    pub fn claim_image(&self) -> Result<(), Unclaimed> {
        let mut inner = self.tracking.lock();
        if inner.holders == 0 {
            if let Some(lock) = &self.image_lock {
                lock.acquire()?;
            }
            if let Some(live) = self.chain()
                && let Err(e) = live.claim()
            {
                log::error!("{}: reading the metadata afresh: {e}", self.name);
            }
            inner.activate(self.size(), &self.tracking);
            if let Some(live) = self.chain()
                && !live
                    .current()
                    .qcow2()
                    .is_none_or(|q| q.qemu_bitmaps_marked())
            {
                // A bitmap on disk still says it is complete: no write
                // may land. Let go as a release does; the next request
                // (or verb) tries again.
                crate::log_limited!(
                    log::Level::Error,
                    UNMARKED,
                    "{}: QEMU's bitmaps in the image could not be marked in use (above); no request is served until they are",
                    self.name
                );
                self.let_go(&mut inner);
                return Err(Unclaimed::Unmarked);
            }
        }
        inner.holders += 1;
        Ok(())
    }

    /// At start-up: a qcow2 image marked by a daemon that stopped
    /// uncleanly (or whose L2 log has entries that another program's
    /// write of the image made stale) is claimed and let go at once, so
    /// that its L2 log is written in (or dropped) and the mark cleared
    /// now, not when a guest first connects. An operator who starts the daemon and stops it
    /// again (docs/troubleshooting.md) then has an image QEMU opens.
    /// Nothing is done while another process holds the image lock (a
    /// migration's source that still serves it: the log is its own), nor
    /// without an image lock, which is the only proof of that.
    pub fn recover_image(&self) {
        let Some(live) = self.chain() else {
            return;
        };
        if self.image_lock.is_none() || !live.current().image.writable() {
            return;
        }
        let served = live.current();
        let Some(image) = served.qcow2() else {
            return;
        };
        match image.needs_recovery() {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                log::warn!("{}: reading the header: {e}", self.name);
                return;
            }
        }
        match self.claim_image() {
            Ok(()) => self.release_image(),
            Err(_) => log::info!(
                "{}: marked, and not taken now (another process holds it, or see above); \
                 its L2 log is written in when the first queue takes it",
                self.name
            ),
        }
    }

    /// A user of the image lets go (a queue's I/O completed and is
    /// durable). The last one writes the bitmaps out, makes a qcow2
    /// image's metadata durable and drops its caches, then lets the lock
    /// go: the next process may write the image.
    pub fn release_image(&self) {
        let mut inner = self.tracking.lock();
        inner.holders = inner.holders.saturating_sub(1);
        if inner.holders == 0 {
            self.let_go(&mut inner);
        }
    }

    /// The image no longer held: the bitmaps written out, a qcow2 image's
    /// metadata made durable and its caches dropped, the lock let go.
    fn let_go(&self, inner: &mut Inner) {
        inner.deactivate(&self.tracking);
        if let Some(live) = self.chain()
            && let Err(e) = live.refresh()
        {
            log::error!("{}: making the metadata durable: {e}", self.name);
        }
        if let Some(lock) = &self.image_lock {
            lock.release();
        }
    }

    pub(super) fn hold_guard(&self) -> Result<Hold<'_>, Unclaimed> {
        self.claim_image()?;
        Ok(Hold(self))
    }

    /// Runs `f` with no request of the guest's in flight and none started
    /// (see the module doc); at once when no front-end is connected.
    /// Returns `f`'s answer and how long the queues were held.
    fn quiesced<R>(&self, f: impl FnOnce() -> R) -> (R, u64) {
        let Some(c) = self.connection() else {
            return (f(), 0);
        };
        let mut f = Some(f);
        let mut out = None;
        let mut held = 0;
        c.quiesce(&mut |since: Instant| {
            if let Some(f) = f.take() {
                out = Some(f());
            }
            held = since.elapsed().as_micros() as u64;
        });
        // A connection whose workers are gone runs nothing: run it here.
        let out = match (out, f) {
            (Some(r), _) => r,
            (None, Some(f)) => f(),
            (None, None) => unreachable!("f ran or is still here"),
        };
        (out, held)
    }

    /// An active commit starts tracking the guest's writes in a bitmap of
    /// its own (at `granularity`, the base's clusters): from the return
    /// on, every write, discard and write-zeroes marks it before it
    /// reaches the image, as the live bitmaps are marked (switched with
    /// the queues quiesced: a write in flight before is complete).
    pub(super) fn mirror_start(&self, granularity: u64) -> Result<(), TrackingError> {
        let bitmap = Arc::new(DirtyBitmap::new(self.size(), granularity)?);
        self.quiesced(|| {
            let mut inner = self.tracking.lock();
            inner.mirror = Some(bitmap);
            inner.retarget(&self.tracking);
        });
        Ok(())
    }

    /// The active commit's bitmap so far, replaced by an empty one with
    /// the queues quiesced: every write it has marked is complete, and
    /// every later one marks the new one. `None` when no commit tracks.
    pub(super) fn mirror_swap(&self) -> Option<Arc<DirtyBitmap>> {
        let (old, _) = self.quiesced(|| {
            let mut inner = self.tracking.lock();
            let old = inner.mirror.take()?;
            let fresh = DirtyBitmap::new(old.disk_size(), old.granularity()).ok()?;
            inner.mirror = Some(Arc::new(fresh));
            inner.retarget(&self.tracking);
            Some(old)
        });
        old
    }

    /// Bytes the active commit's bitmap has marked since the last swap.
    pub(super) fn mirror_dirty(&self) -> u64 {
        self.tracking
            .lock()
            .mirror
            .as_ref()
            .map_or(0, |b| b.dirty_bytes())
    }

    /// The active commit's end: `f` runs with the queues quiesced (no
    /// write in flight, none started until it returns) and the bitmap's
    /// last marks, and the bitmap goes.
    pub(super) fn mirror_end<R>(&self, f: impl FnOnce(Option<&DirtyBitmap>) -> R) -> R {
        let (out, held) = self.quiesced(|| {
            let mut inner = self.tracking.lock();
            let last = inner.mirror.take();
            inner.retarget(&self.tracking);
            drop(inner);
            f(last.as_deref())
        });
        log::debug!("{}: the active commit held the queues {held} µs", self.name);
        out
    }

    /// Every bitmap: name, granularity, dirty bytes, consistency.
    pub fn bitmaps(&self) -> Vec<BitmapInfo> {
        let inner = self.tracking.lock();
        inner
            .bitmaps
            .iter()
            .map(|(name, e)| match e {
                Entry::Stored(info) => info.clone(),
                Entry::Live(b) => b.info(name),
            })
            .collect()
    }

    /// Adds a bitmap that records every change from now on.
    pub fn bitmap_add(&self, name: &str, granularity: u64) -> Result<BitmapInfo, TrackingError> {
        self.tracking
            .bitmaps_supported()
            .map_err(TrackingError::Unsupported)?;
        crate::bitmap::check_name(name)?;
        crate::bitmap::granularity_shift(granularity)?;
        let _hold = self.hold_guard()?;
        let size = self.size();
        let (made, _) = self.quiesced(|| {
            let mut inner = self.tracking.lock();
            if inner.bitmaps.contains_key(name) {
                return Err(BitmapError::Exists(name.to_string()).into());
            }
            let b = Arc::new(inner.store()?.add(name, granularity, size)?);
            let info = b.info(name);
            inner.bitmaps.insert(name.to_string(), Entry::Live(b));
            inner.retarget(&self.tracking);
            Ok(info)
        });
        if made.is_ok() {
            log::info!("bitmap '{name}' added (granularity {granularity})");
        }
        made
    }

    /// A live snapshot is about to freeze the top, every request kept out
    /// by it and none in flight: the bitmaps that are open are exact for
    /// that top now, and it keeps them (see [`BitmapStore::top_freezes`]).
    /// Called by the snapshot itself, inside its pause; a failure is
    /// logged and leaves the old top's bitmaps in use (inconsistent),
    /// which is safe.
    pub(super) fn bitmaps_freeze_with_top(&self) {
        let mut guard = self.tracking.lock();
        let inner = &mut *guard;
        if inner.holders == 0 {
            // Not held: the bitmaps were written back at the release.
            return;
        }
        let bits: Vec<(&str, &DirtyBitmap)> = inner
            .bitmaps
            .iter()
            .filter_map(|(name, e)| match e {
                Entry::Live(b) => Some((name.as_str(), b.as_ref())),
                Entry::Stored(_) => None,
            })
            .collect();
        let frozen = match &mut inner.store {
            Ok(store) => store.top_freezes(&bits),
            Err(_) => Ok(()),
        };
        if let Err(e) = frozen {
            log::error!(
                "{}: the old top's bitmaps at the live snapshot: {e}; they stay in use there (inconsistent)",
                self.name
            );
        }
    }

    /// A live snapshot put a new top above the image: the bitmaps that
    /// are open follow it into their store (see
    /// [`BitmapStore::top_moved`]).
    pub fn bitmaps_follow_snapshot(&self) {
        let (moved, _) = self.quiesced(|| {
            let mut inner = self.tracking.lock();
            if inner.holders == 0 {
                return Ok(());
            }
            match &mut inner.store {
                Ok(store) => store.top_moved(),
                Err(_) => Ok(()),
            }
        });
        if let Err(e) = moved {
            log::error!(
                "{}: the bitmaps after the live snapshot: {e}; they are written at the next release",
                self.name
            );
        }
    }

    /// Removes a bitmap and its stored form.
    pub fn bitmap_remove(&self, name: &str) -> Result<(), TrackingError> {
        self.tracking
            .bitmaps_supported()
            .map_err(TrackingError::Unsupported)?;
        let _hold = self.hold_guard()?;
        let (done, _) = self.quiesced(|| {
            let mut inner = self.tracking.lock();
            if !inner.bitmaps.contains_key(name) {
                return Err(BitmapError::NotFound(name.to_string()).into());
            }
            if let Some(r) = &inner.backup
                && r.frozen.as_ref().is_some_and(|(n, _)| n == name)
            {
                return Err(TrackingError::Exported(name.to_string()));
            }
            if let Some(p) = &inner.starting {
                // It may be about to export this one.
                return Err(TrackingError::BackupStarting(p.display().to_string()));
            }
            inner.store()?.remove(name)?;
            inner.bitmaps.remove(name);
            inner.retarget(&self.tracking);
            Ok(())
        });
        if done.is_ok() {
            log::info!("bitmap '{name}' removed");
        }
        done
    }

    /// The running backup, if any.
    pub fn backup(&self) -> Option<BackupInfo> {
        self.tracking.lock().backup.as_ref().map(Running::info)
    }

    /// Starts a backup: serves the disk as it is now, read-only over NBD
    /// on `socket` (in the backup directory), while the guest goes on
    /// writing; with `bitmap`, also the changes that bitmap recorded up to
    /// now (`qemu:dirty-bitmap:NAME`). The bitmap keeps those bits, and
    /// records on, until the backup ends well ([`Device::backup_stop`]).
    /// One start at a time: a second one is refused, decided under the
    /// lock that the running backup is set under, and leaves nothing
    /// behind.
    pub fn backup_start(
        &self,
        socket: &Path,
        bitmap: Option<&str>,
    ) -> Result<BackupInfo, TrackingError> {
        let (path, name, image, store, _starting) = {
            let mut inner = self.tracking.lock();
            if let Some(r) = &inner.backup {
                return Err(TrackingError::BackupRunning(r.socket.display().to_string()));
            }
            if let Some(p) = &inner.starting {
                return Err(TrackingError::BackupStarting(p.display().to_string()));
            }
            let spec = inner
                .backups
                .as_ref()
                .map_err(|why| TrackingError::Unsupported(why.clone()))?;
            let (path, name) = socket_in(&spec.dir, socket)?;
            let dup = |f: &File| f.try_clone().map_err(|e| TrackingError::Io(e.to_string()));
            let (image, store) = (dup(&spec.image)?, dup(&spec.store)?);
            if bitmap.is_some()
                && let Err(why) = &inner.store
            {
                return Err(TrackingError::Unsupported(why.clone()));
            }
            inner.starting = Some(path.clone());
            (path, name, image, store, Starting(&self.tracking))
        };
        // A live snapshot waits for this start, then sees the backup.
        let _chain = self.chain_change.lock().unwrap_or_else(|e| e.into_inner());
        // A job changes the chain the backup's view would read.
        if let Some(job) = self.job_running() {
            return Err(TrackingError::JobRunning(job));
        }
        // The image is held until `backup stop`; the bitmaps are loaded.
        self.claim_image()?;
        let started = self.start_holding(&path, &name, bitmap, image, store);
        if started.is_err() {
            self.release_image();
        }
        started
    }

    /// `backup_start` once the image is held.
    fn start_holding(
        &self,
        path: &Path,
        name: &str,
        bitmap: Option<&str>,
        image: File,
        store: File,
    ) -> Result<BackupInfo, TrackingError> {
        // What the bitmap records from the instant on, made while the
        // guest runs (the copy of its bits is made at the instant).
        let live = match bitmap {
            Some(n) => {
                let b = self.tracking.lock().live(n)?;
                let since = DirtyBitmap::new(b.disk_size(), b.granularity())?;
                Some((n.to_string(), b, Arc::new(since)))
            }
            None => None,
        };
        // Before the instant, while the guest runs: the socket, so that a
        // bad path fails here with nothing else done.
        let listener = self.bind_backup_socket(name).map_err(|e| {
            let why = match e.kind() {
                io::ErrorKind::AddrInUse => "exists (a process listens there, or it was made after this daemon started: remove it, or choose another name)".to_string(),
                _ => e.to_string(),
            };
            TrackingError::Socket {
                path: path.display().to_string(),
                why,
            }
        })?;
        let size = self.size();
        // The guest's disk: a raw image's file, a qcow2 image's chain
        // (the store's cluster then covers the top's, see disk::reader),
        // or a LUKS image's payload, decrypted by the disk's reader.
        let (image, cluster): (Arc<dyn crate::backup::Image>, u64) =
            match (self.chain(), self.backing.encrypted()) {
                (Some(live), _) => (
                    Arc::new(Reader::new(live.clone(), size)),
                    Reader::cluster(live, DEFAULT_CLUSTER),
                ),
                (None, Some((offset, crypt))) => (
                    Arc::new(Decrypted::new(image, offset, size, crypt.clone())),
                    DEFAULT_CLUSTER,
                ),
                (None, None) => (Arc::new(FileImage::with_size(image, size)), DEFAULT_CLUSTER),
            };
        let (switched, switch_us) = self.quiesced(|| {
            let cbw = Arc::new(CbwStore::with_file(image, store, cluster)?);
            // The instant: no write in flight. The export gets a copy of
            // the bits; the bitmap keeps them.
            let (frozen, successor) = match &live {
                Some((n, b, since)) => (
                    Some((n.clone(), Arc::new(b.copy()))),
                    Some((since.clone(), b.losses())),
                ),
                None => (None, None),
            };
            let mut inner = self.tracking.lock();
            inner.backup = Some(Running {
                server: None,
                cbw: cbw.clone(),
                socket: path.to_path_buf(),
                name: name.to_string(),
                frozen: frozen.clone(),
                successor,
                size,
                started: Instant::now(),
                switch_us: 0,
            });
            inner.retarget(&self.tracking);
            Ok::<_, io::Error>((cbw, frozen))
        });
        let (cbw, frozen) = match switched {
            Ok(v) => v,
            Err(e) => {
                self.remove_backup_socket(name);
                return Err(TrackingError::Io(format!(
                    "the copy-before-write store: {e}"
                )));
            }
        };
        let view = Arc::new(View::new(cbw, frozen));
        let server = nbd::Server::start(listener, view, nbd::Limits::default());
        let mut inner = self.tracking.lock();
        match server {
            Ok(server) => {
                let r = inner.backup.as_mut().expect("set in the switch");
                r.server = Some(server);
                r.switch_us = switch_us;
                let info = r.info();
                drop(inner);
                log::info!(
                    "backup started: NBD on {}{}, the guest held for {switch_us} us",
                    path.display(),
                    bitmap
                        .map(|n| format!(" with bitmap '{n}'"))
                        .unwrap_or_default()
                );
                Ok(info)
            }
            Err(e) => {
                drop(inner);
                // Undo as a failed backup: the bitmap keeps its bits. The
                // image's hold is the caller's to release.
                let _ = self.end_backup(true);
                Err(TrackingError::Io(format!("starting the NBD server: {e}")))
            }
        }
    }

    /// Binds the backup's socket `name` in the backup directory by its
    /// descriptor (see [`crate::unix_socket::path_in`]), not by its path:
    /// a symlink on the way retargeted since start-up does not move it.
    fn bind_backup_socket(&self, name: &str) -> io::Result<std::os::unix::net::UnixListener> {
        let inner = self.tracking.lock();
        match &inner.backups {
            Ok(spec) => {
                crate::unix_socket::bind_private(&crate::unix_socket::path_in(&spec.dir_fd, name))
            }
            Err(why) => Err(io::Error::other(why.clone())),
        }
    }

    fn remove_backup_socket(&self, name: &str) {
        let inner = self.tracking.lock();
        if let Ok(spec) = &inner.backups
            && let Err(e) = crate::host::unlink_at(&spec.dir_fd, name)
        {
            log::warn!("removing the backup's socket {name}: {e}");
        }
    }

    /// Ends the running backup: the export ends, the view's copies are
    /// dropped. A backup that ended well (not `failed`) takes the bits it
    /// exported out of its bitmap, which keeps what was recorded since
    /// the instant; a failed one leaves the bitmap as it is, every change
    /// still in it. Refused while a start is under way.
    pub fn backup_stop(&self, failed: bool) -> Result<BackupInfo, TrackingError> {
        if let Some(p) = &self.tracking.lock().starting {
            return Err(TrackingError::BackupStarting(p.display().to_string()));
        }
        let info = self.stop_backup(failed)?;
        log::info!(
            "backup stopped{}: {} cluster(s) were copied before the guest overwrote them",
            if failed {
                " as failed (its bitmap keeps every change)"
            } else {
                ""
            },
            info.copied_clusters
        );
        Ok(info)
    }

    /// Ends the running backup and lets go of the image it held.
    fn stop_backup(&self, failed: bool) -> Result<BackupInfo, TrackingError> {
        let info = self.end_backup(failed)?;
        self.release_image();
        Ok(info)
    }

    /// Ends the running backup, the image still held (by the backup's
    /// claim, which the caller releases).
    fn end_backup(&self, failed: bool) -> Result<BackupInfo, TrackingError> {
        // Out of the targets, with no write in flight (so the bitmap and
        // its successor hold the same marks since the instant); then torn
        // down while the guest runs.
        let (taken, _) = self.quiesced(|| {
            let mut inner = self.tracking.lock();
            let r = inner.backup.take();
            if let Some(r) = r.as_ref().filter(|_| !failed) {
                inner.commit_backup(r);
            }
            inner.retarget(&self.tracking);
            r
        });
        let r = taken.ok_or(TrackingError::NoBackup)?;
        let info = r.info();
        let Running {
            server,
            cbw,
            name,
            frozen,
            ..
        } = r;
        if let Some(server) = server {
            server.stop();
        }
        self.remove_backup_socket(&name);
        drop(cbw);
        {
            let mut inner = self.tracking.lock();
            if let Ok(spec) = &inner.backups {
                // Frees what the view kept.
                if let Err(e) = spec.store.set_len(0) {
                    log::warn!("emptying the copy-before-write store: {e}");
                }
            }
            if let Some((n, _)) = frozen.filter(|_| !failed) {
                // The bitmap's new state made durable where its store
                // keeps it durable while in use (a sidecar's mapping).
                match inner.live(&n) {
                    Ok(live) => {
                        let consistent = live.is_consistent();
                        if let Ok(store) = inner.store()
                            && let Err(e) = store.update(&n, &live, consistent)
                        {
                            log::error!("bitmap '{n}': {e}");
                        }
                    }
                    Err(e) => log::error!("bitmap '{n}' after the backup: {e}"),
                }
            }
        }
        Ok(info)
    }

    /// The daemon stops: a backup still running ends as failed (its
    /// bitmap keeps every change, and is then written out consistent).
    pub fn stop_tracking(&self) {
        if self.tracking.lock().backup.is_some() {
            log::warn!("the daemon stops during a backup: the backup ends as failed");
            let _ = self.stop_backup(true);
        }
    }

    /// The disk is resized to `new` bytes (`writes`: `publish` changes
    /// the image, else it takes a size the image already has): the bitmaps
    /// follow, with no write in flight, and `publish` (which makes the new
    /// size the capacity) runs in the same switch. Refused while a backup
    /// runs. The image is held meanwhile (not for a re-read with no
    /// bitmaps, which changes nothing); a change is refused while it
    /// cannot be (another process holds it). A re-read goes on then, and
    /// the bitmaps, not loaded, are left: they are found of another size,
    /// and distrusted, when next loaded.
    pub(super) fn resize_tracked(
        &self,
        new: u64,
        writes: bool,
        publish: impl FnOnce() -> Result<(), ResizeError>,
    ) -> Result<(), ResizeError> {
        let bitmaps = {
            let inner = self.tracking.lock();
            if let Some(r) = &inner.backup {
                return Err(TrackingError::BackupRunning(r.socket.display().to_string()).into());
            }
            if let Some(p) = &inner.starting {
                return Err(TrackingError::BackupStarting(p.display().to_string()).into());
            }
            !inner.bitmaps.is_empty()
        };
        if !writes && !bitmaps {
            // A size the image already has, and nothing to follow it.
            return publish();
        }
        // Only the process that holds the image changes it: another one
        // may be writing it, and the claim has a qcow2 image's metadata
        // read afresh before it is grown.
        let hold = match self.hold_guard() {
            Ok(hold) => Some(hold),
            Err(e) if writes => return Err(ResizeError::NotHeld(e)),
            Err(e) => {
                log::warn!(
                    "re-reading the size while the image is not held ({e}): the bitmaps are left at the old size (they will be found inconsistent)"
                );
                None
            }
        };
        if !bitmaps {
            return publish();
        }
        let (done, _) = self.quiesced(|| {
            publish()?;
            let mut inner = self.tracking.lock();
            let names: Vec<String> = inner.bitmaps.keys().cloned().collect();
            for name in names {
                let Some(Entry::Live(b)) = inner.bitmaps.get(&name) else {
                    continue;
                };
                let b = b.clone();
                let store = inner.store().map_err(ResizeError::from)?;
                let resized = store.resize(&name, &b, new).unwrap_or_else(|e| {
                    log::error!("resizing bitmap '{name}': {e}; it is inconsistent from now on");
                    let r = b.resized(new).expect("a bitmap its size allowed before");
                    r.set_inconsistent();
                    r
                });
                inner.bitmaps.insert(name, Entry::Live(Arc::new(resized)));
            }
            inner.retarget(&self.tracking);
            Ok(())
        });
        drop(hold);
        done
    }
}

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockets_go_in_the_backup_directory() {
        let dir = Path::new("/run/ringblk/backups");
        let ok = |p: &str| socket_in(dir, Path::new(p)).unwrap();
        assert_eq!(ok("vm1.nbd").0, dir.join("vm1.nbd"));
        assert_eq!(ok("/run/ringblk/backups/vm1.nbd").1, "vm1.nbd");
        assert_eq!(ok("/run/ringblk/backups/./vm1.nbd").1, "vm1.nbd");
        for bad in [
            "/tmp/x.nbd",
            "../x",
            "/run/ringblk/backups/../x",
            "/",
            "sub/x.nbd",
        ] {
            assert!(socket_in(dir, Path::new(bad)).is_err(), "{bad} accepted");
        }
    }
}
