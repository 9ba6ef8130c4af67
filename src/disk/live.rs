//! The image a daemon serves through its metadata thread (qcow2, or any
//! format with metadata work: [`super::Image`]), across live snapshots
//! (which need a qcow2 top's format for the overlay): which chain is
//! current, the gate every request passes so that a snapshot can stop
//! them, and the snapshot itself.
//!
//! - [`Live::current`] is the chain requests are mapped against now
//!   ([`Served`]: the image and the files the engine does data I/O on).
//!   A snapshot replaces it and bumps [`Live::generation`]; each queue
//!   notices at its next request and takes the new chain (and registers
//!   its files with its engine).
//! - The gate: each queue has a [`Gate`] counting its requests from the
//!   moment they are mapped until they complete. A request enters
//!   ([`Live::enter`]) unless a snapshot has paused the image; then it
//!   waits at the head of its queue, in order, and the queue is woken
//!   ([`Gate`]'s wake) when the snapshot is over. One uncontended atomic
//!   add and one load per request, on the queue's own cache line.
//! - [`Live::snapshot`]: pause, wait until no request is in flight (so
//!   every write taken before completes on the old top, and none taken
//!   after reaches it), commit and sync the old top and freeze it (it is
//!   never written again, but for its dirty bitmaps, written back once
//!   the overlay's record is durable), create the overlay in the snapshot
//!   directory with the old top as its backing file, move the image lock
//!   to it, switch, resume. The old top is then a point-in-time image of
//!   the disk, consistent as after a power loss at that instant.
//!
//! Files after start-up: the daemon opens nothing by path then (the
//! seccomp filter has no `openat`, Landlock allows nothing new), except
//! overlays, which are created only in the directory given at start-up
//! (`--snapshot-dir`): by `openat` on that directory's descriptor, the
//! one the filter allows `openat` on, under a Landlock rule that lets
//! the daemon create, read, write and remove regular files beneath it.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Qcow2Image;
use super::qcow2::OpenOptions;
use super::qcow2::stream::Step;
use super::records::{DROPPED_SUFFIX, Dropped, JOB_RECORD, JobRecord, RECORD_SUFFIX, Record};
use super::{Format, FormatError, Image, Mapper};

/// How long a snapshot waits for the requests in flight to finish.
pub const QUIESCE_WAIT: Duration = Duration::from_secs(30);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A chain, as requests are mapped against it.
pub struct Served {
    pub image: Box<dyn Image>,
    /// The files the engine does data I/O on, top first (the image's own
    /// files again, or with `--direct` the same files opened O_DIRECT).
    io_files: Vec<File>,
    /// Whether [`Served::io_files`] are open O_DIRECT (`--direct`).
    direct: bool,
    /// Which chain this is (see [`Live::generation`]).
    pub generation: u64,
}

impl Served {
    /// The image as qcow2 ([`Image::as_qcow2`]): its bitmaps, its L2 log.
    pub fn qcow2(&self) -> Option<&super::Qcow2Image> {
        self.image.as_qcow2()
    }

    /// The descriptors of [`Served::io_files`], top first: what an engine
    /// registers, in this order, for a `Where::Data { file }` to index.
    pub fn io_fds(&self) -> Vec<RawFd> {
        self.io_files.iter().map(AsRawFd::as_raw_fd).collect()
    }

    /// The top's O_DIRECT descriptor (`--direct`), the engine's: what the
    /// image writes a cluster it allocates for a write through, with the
    /// write's data ([`Image::resolve_write`]). None on a cached image.
    pub fn direct_top(&self) -> Option<&File> {
        self.io_files.first().filter(|_| self.direct)
    }
}

/// A commit's base, open for writing ([`Live::open_base`]): what
/// [`Live::commit_step`] writes through and [`Live::rebase`] puts in the
/// chain.
pub struct CommitBase(Box<Qcow2Image>);

impl CommitBase {
    /// The base's clusters: what an active commit's dirty bitmap counts in.
    pub fn cluster_size(&self) -> u64 {
        self.0.cluster_size()
    }
}

/// The image `--image` names, kept open for writing ([`Live::keep_named`]).
struct Named {
    path: PathBuf,
    file: File,
    direct: Option<File>,
}

/// One queue's count of requests in flight, and how to wake it.
#[repr(align(64))]
pub struct Gate {
    in_flight: AtomicUsize,
    wake: Box<dyn Fn() + Send + Sync>,
}

/// The directory overlays are created in, opened at start-up.
pub struct SnapshotDir {
    dir: File,
    /// Its canonical path: what an overlay's path is checked against, and
    /// the start of the name its backing file gets.
    path: PathBuf,
}

impl SnapshotDir {
    /// Opens `path` (a directory) for creating overlays in it.
    pub fn open(path: &Path) -> io::Result<SnapshotDir> {
        let path = std::fs::canonicalize(path)?;
        let c = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: `c` is a NUL-terminated path that lives across the call.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let dir = unsafe { File::from_raw_fd(fd) };
        Ok(SnapshotDir { dir, path })
    }

    /// The directory's descriptor: the only one `openat` and `unlinkat`
    /// may name after start-up.
    pub fn fd(&self) -> RawFd {
        self.dir.as_raw_fd()
    }

    /// The directory itself (for Landlock's rule).
    pub fn file(&self) -> &File {
        &self.dir
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file name of `overlay`: a bare name, or a path in this
    /// directory (its parent, as the client resolved it, is this
    /// directory).
    fn name_of(&self, overlay: &Path) -> Result<String, SnapshotError> {
        let bad = |why: &str| SnapshotError::Name(overlay.display().to_string(), why.to_string());
        let name = match overlay.parent() {
            Some(p) if p.as_os_str().is_empty() => overlay,
            Some(p) if p == self.path => Path::new(overlay.file_name().unwrap_or_default()),
            Some(_) => {
                return Err(bad(&format!(
                    "overlays are created in the snapshot directory {}",
                    self.path.display()
                )));
            }
            None => return Err(bad("not a file name")),
        };
        let name = name
            .to_str()
            .ok_or_else(|| bad("the name is not UTF-8"))?
            .to_string();
        if name.is_empty()
            || name == "."
            || name == ".."
            || name.contains('/')
            || name.contains('\0')
        {
            return Err(bad("not a file name"));
        }
        if name.ends_with(RECORD_SUFFIX) {
            return Err(bad(&format!(
                "names ending in {RECORD_SUFFIX} are the snapshot records'"
            )));
        }
        if name.ends_with(DROPPED_SUFFIX) || name == JOB_RECORD {
            return Err(bad(&format!(
                "names ending in {DROPPED_SUFFIX}, and {JOB_RECORD}, are the block jobs' records"
            )));
        }
        Ok(name)
    }

    /// `openat(dir, name, flags)`, never following a symlink.
    fn open_at(&self, name: &str, flags: libc::c_int) -> io::Result<File> {
        crate::host::open_at(&self.dir, name, flags | libc::O_CLOEXEC | libc::O_NOFOLLOW)
    }

    /// Creates the snapshot record `record` (see [`super::records`]):
    /// `O_EXCL`, written, synced, and the directory synced, which makes
    /// the overlay's name durable too. A record cut short is removed.
    fn record(&self, record: &Record) -> Result<(), FormatError> {
        let name = Record::name_for(&record.by);
        let err = |e: io::Error| FormatError::Open {
            path: self.path.join(&name).display().to_string(),
            reason: format!("writing the snapshot record: {e}"),
        };
        let file = self
            .open_at(&name, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL)
            .map_err(err)?;
        if let Err(e) = record.write_to(&file).and_then(|()| self.dir.sync_data()) {
            self.remove(&name);
            return Err(err(e));
        }
        Ok(())
    }

    /// Writes the job record ([`JobRecord`]), replacing one a crash left.
    fn record_job(&self, record: &JobRecord) -> Result<(), FormatError> {
        let err = |e: io::Error| FormatError::Open {
            path: self.path.join(JOB_RECORD).display().to_string(),
            reason: format!("writing the job record: {e}"),
        };
        let _ = crate::host::unlink_at(&self.dir, JOB_RECORD);
        let file = self
            .open_at(JOB_RECORD, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL)
            .map_err(err)?;
        let written = (&file)
            .write_all(record.line().as_bytes())
            .and_then(|()| file.sync_data())
            .and_then(|()| self.dir.sync_data());
        if let Err(e) = written {
            self.remove(JOB_RECORD);
            return Err(err(e));
        }
        Ok(())
    }

    /// Creates a record of layers a switch drops ([`Dropped`]) and makes
    /// it durable, under a name no file has.
    fn record_dropped(&self, record: &Dropped) -> Result<(), FormatError> {
        let mut n = 0;
        let (name, file) = loop {
            let name = record.name_for(n);
            match self.open_at(&name, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL) {
                Ok(f) => break (name, f),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && n < 100 => n += 1,
                Err(e) => {
                    return Err(FormatError::Open {
                        path: self.path.join(&name).display().to_string(),
                        reason: format!("writing the record of the dropped layers: {e}"),
                    });
                }
            }
        };
        let written = (&file)
            .write_all(record.line().as_bytes())
            .and_then(|()| file.sync_data())
            .and_then(|()| self.dir.sync_data());
        if let Err(e) = written {
            self.remove(&name);
            return Err(FormatError::Open {
                path: self.path.join(&name).display().to_string(),
                reason: format!("writing the record of the dropped layers: {e}"),
            });
        }
        Ok(())
    }

    /// Removes `name` (an overlay a failed snapshot created).
    fn remove(&self, name: &str) {
        let _ = crate::host::unlink_at(&self.dir, name);
    }
}

/// Why a snapshot was refused or failed; one line each.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error(
        "live snapshots need a directory to create their overlays in: serve --snapshot-dir DIR"
    )]
    NoDirectory,
    #[error(
        "live snapshots need a qcow2 image (serve --format qcow2); a raw image can be the backing file of one: qemu-img create -f qcow2 -b IMAGE -F raw TOP.qcow2"
    )]
    NotQcow2,
    #[error("{0}: {1}")]
    Name(String, String),
    #[error("the image is read-only")]
    ReadOnly,
    /// The device refuses it now (a backup is running, or another
    /// process holds the image): why.
    #[error("{0}")]
    Refused(String),
    #[error("cannot create {path}: {source}")]
    Create { path: String, source: io::Error },
    #[error("requests in flight did not finish within {0:?}; nothing was changed")]
    Busy(Duration),
    #[error("cannot lock the overlay: {0}")]
    Lock(io::Error),
    #[error(transparent)]
    Format(#[from] FormatError),
}

/// The served image and its chain: see the module doc.
pub struct Live {
    current: Mutex<Arc<Served>>,
    generation: AtomicU64,
    /// A snapshot is switching the chain: requests wait.
    paused: AtomicBool,
    /// Waiters for the end of a pause (a queue draining meanwhile).
    resumed: (Mutex<()>, Condvar),
    gates: Mutex<Vec<Arc<Gate>>>,
    snapshots: Option<SnapshotDir>,
    /// The image `--image` names, open for writing (a commit's base may
    /// be it: [`Live::open_base`]), and with `--direct` open O_DIRECT for
    /// writing too (an active commit's pivot makes it the top).
    named: Option<Named>,
    options: OpenOptions,
    direct: bool,
    /// One snapshot at a time.
    switching: Mutex<()>,
}

impl Live {
    /// Opens the image at `path` as `format` ([`super::open`]), and its
    /// chain. `direct`: the engine does its data I/O with O_DIRECT (on the
    /// same files opened again).
    pub fn open(
        path: &Path,
        format: Format,
        options: OpenOptions,
        direct: bool,
        snapshots: Option<SnapshotDir>,
    ) -> Result<Live, FormatError> {
        // Absolute: an overlay names this file as its backing file.
        let path = std::fs::canonicalize(path).map_err(|e| FormatError::Open {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let mut options = options;
        let image = super::open(&path, format, &options)?;
        // Kept for the overlays of live snapshots, which need no
        // passphrase (an encrypted top's overlay takes a copy of its LUKS
        // header and shares its transform): the passphrase goes (zeroed
        // once the caller's copy goes too).
        options.passphrase = None;
        let io_files = io_files(&*image, direct)?;
        Ok(Live {
            current: Mutex::new(Arc::new(Served {
                image,
                io_files,
                direct,
                generation: 0,
            })),
            generation: AtomicU64::new(0),
            paused: AtomicBool::new(false),
            resumed: (Mutex::new(()), Condvar::new()),
            gates: Mutex::new(Vec::new()),
            snapshots,
            named: None,
            options,
            direct,
            switching: Mutex::new(()),
        })
    }

    /// Keeps `file`, the image `--image` named (`path`, as the chain
    /// lists it), open for writing: a commit into it needs that. With
    /// `--direct`, it is opened O_DIRECT for writing too (now: the sandbox
    /// allows no open by path later), for the engine once an active
    /// commit's pivot makes it the top; if that fails, a WARN, and an
    /// active commit into it is refused.
    pub fn keep_named(&mut self, path: &Path, file: File) {
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let direct = if self.direct {
            let proc = format!("/proc/self/fd/{}", file.as_raw_fd());
            match std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&proc)
            {
                Ok(f) => Some(f),
                Err(e) => {
                    log::warn!(
                        "{}: not opened O_DIRECT for writing ({e}); an active commit into it will be refused",
                        path.display()
                    );
                    None
                }
            }
        } else {
            None
        };
        self.named = Some(Named { path, file, direct });
    }

    /// The chain requests are mapped against now.
    pub fn current(&self) -> Arc<Served> {
        lock(&self.current).clone()
    }

    /// Bumped by each snapshot; a queue that saw another takes
    /// [`Live::current`] again.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The snapshot directory, if any.
    pub fn snapshot_dir(&self) -> Option<&SnapshotDir> {
        self.snapshots.as_ref()
    }

    /// Guest-visible bytes.
    pub fn size(&self) -> u64 {
        self.current().image.size()
    }

    /// The chain's paths, top first.
    pub fn chain(&self) -> Vec<PathBuf> {
        self.current().image.chain()
    }

    /// Grows the image online.
    pub fn grow(&self, size: u64) -> Result<(), FormatError> {
        self.current().image.grow(size)
    }

    /// Makes everything durable and forgets every cached table, so that
    /// the next request reads the metadata from the file: for when another
    /// process may write the image meanwhile, or may have (the rings stop
    /// for a migration, and start again after one).
    pub fn refresh(&self) -> Result<(), FormatError> {
        self.current().image.invalidate()
    }

    /// [`Live::refresh`] for a daemon that has just taken the image lock:
    /// a qcow2 image's L2 log is taken into use too (see
    /// [`super::Qcow2Image::claim`]), and what it had is said in the log.
    pub fn claim(&self) -> Result<(), FormatError> {
        let served = self.current();
        let Some(image) = served.image.as_qcow2() else {
            return served.image.invalidate();
        };
        let adopted = image.claim()?;
        let top = served.image.chain().into_iter().next().unwrap_or_default();
        let log = image
            .l2_log_path()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if adopted.replayed > 0 {
            log::warn!(
                "{}: a daemon stopped uncleanly on it; wrote the {} L2 entries it had left in {log} into the image",
                top.display(),
                adopted.replayed
            );
        }
        if let Some(why) = adopted.dropped {
            log::warn!(
                "{}: a daemon stopped uncleanly on it, and its L2 log {log} does not apply ({why}); \
                 dropped: the image is served as its own L2 tables have it (writes the guest had not flushed may be lost)",
                top.display()
            );
        }
        Ok(())
    }

    /// A queue's gate; `wake` brings its worker back after a pause.
    pub fn gate(&self, wake: Box<dyn Fn() + Send + Sync>) -> Arc<Gate> {
        let g = Arc::new(Gate {
            in_flight: AtomicUsize::new(0),
            wake,
        });
        lock(&self.gates).push(g.clone());
        g
    }

    /// A request of `gate`'s queue is mapped now, unless a snapshot is
    /// switching the chain (false: it waits). SeqCst on both sides: a
    /// snapshot that paused before this count sees it, or this sees the
    /// pause.
    #[inline]
    pub fn enter(&self, gate: &Gate) -> bool {
        gate.in_flight.fetch_add(1, Ordering::SeqCst);
        if self.paused.load(Ordering::SeqCst) {
            self.leave(gate);
            return false;
        }
        true
    }

    /// A request that entered has completed.
    #[inline]
    pub fn leave(&self, gate: &Gate) {
        gate.in_flight.fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether a snapshot is switching the chain.
    pub fn paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    /// Blocks until no snapshot is switching the chain, or `timeout`.
    pub fn wait_resumed(&self, timeout: Duration) {
        let (m, cv) = &self.resumed;
        let guard = lock(m);
        if self.paused() {
            let _ = cv.wait_timeout_while(guard, timeout, |_| self.paused());
        }
    }

    /// A live snapshot to a new overlay `overlay` in the snapshot
    /// directory (see the module doc). `relock` moves the image lock to
    /// the new top (its argument), or back to the old one if the snapshot
    /// fails after it. `freeze` runs with every request kept out (none in
    /// flight), just before the old top is frozen: where the device
    /// stages its bitmaps for the old top to keep
    /// ([`Qcow2Image::stage_qemu_bitmaps_for_snapshot`]). Returns the new
    /// chain, top first.
    pub fn snapshot(
        &self,
        overlay: &Path,
        relock: impl Fn(&File) -> io::Result<()>,
        freeze: impl FnOnce(),
    ) -> Result<Vec<PathBuf>, SnapshotError> {
        let _one = lock(&self.switching);
        let dir = self.snapshots.as_ref().ok_or(SnapshotError::NoDirectory)?;
        let name = dir.name_of(overlay)?;
        let path = dir.path.join(&name);
        let old = self.current();
        if !old.image.writable() {
            return Err(SnapshotError::ReadOnly);
        }
        let create = |source| SnapshotError::Create {
            path: path.display().to_string(),
            source,
        };
        let file = dir
            .open_at(&name, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL)
            .map_err(create)?;
        let made = self.switch(dir, &name, file, &old, &relock, freeze);
        if made.is_err() {
            dir.remove(&name);
        }
        self.resume();
        made
    }

    /// The part of a snapshot that runs paused.
    fn switch(
        &self,
        dir: &SnapshotDir,
        name: &str,
        file: File,
        old: &Served,
        relock: &impl Fn(&File) -> io::Result<()>,
        freeze: impl FnOnce(),
    ) -> Result<Vec<PathBuf>, SnapshotError> {
        // The overlay is a qcow2 file, and the old top's format makes it.
        let Some(top) = old.image.as_qcow2() else {
            return Err(SnapshotError::NotQcow2);
        };
        let path = &dir.path.join(name);
        let direct = if self.direct {
            let f = dir.open_at(name, libc::O_RDWR | libc::O_DIRECT);
            Some(f.map_err(|source| SnapshotError::Create {
                path: path.display().to_string(),
                source,
            })?)
        } else {
            None
        };
        let old_top = old.image.chain()[0].clone();
        let backing = old_top.display().to_string();
        let record =
            Record::new(&old_top, name).map_err(|e| SnapshotError::Name(name.to_string(), e))?;
        let io_top = match direct {
            Some(f) => f,
            None => file.try_clone().map_err(FormatError::io("dup"))?,
        };
        // Before the switch is recorded: nothing may fail after it.
        let io_files = io_files_after_snapshot(io_top, &old.io_files)?;
        self.pause()?;
        relock(&file).map_err(SnapshotError::Lock)?;
        // The record is made durable once the overlay is, and before any
        // request goes to it (see [`super::records`]).
        let write_record = || dir.record(&record);
        // Right before the snapshot, which takes what it stages whether
        // it succeeds or not.
        freeze();
        let image = match top.snapshot(file, path, &backing, &self.options, write_record) {
            Ok(i) => Box::new(i) as Box<dyn Image>,
            Err(e) => {
                if let Some(old_top) = old.io_files.first() {
                    let _ = relock(old_top);
                }
                return Err(e.into());
            }
        };
        Ok(self.install(old, image, io_files))
    }

    /// Makes `image` (on `io_files`) the chain requests are mapped against,
    /// in place of `old`, and bumps the generation: each queue takes it at
    /// its next request. Returns its chain, top first. Called paused.
    fn install(&self, old: &Served, image: Box<dyn Image>, io_files: Vec<File>) -> Vec<PathBuf> {
        let generation = old.generation + 1;
        let chain = image.chain();
        *lock(&self.current) = Arc::new(Served {
            image,
            io_files,
            direct: self.direct,
            generation,
        });
        self.generation.store(generation, Ordering::Release);
        chain
    }

    /// The switch of a stream ([`super::qcow2::stream`]): with every
    /// request kept out, the backing file of layer `above` (the top, 0,
    /// but for a commit of a deeper layer) becomes file `base` of the
    /// chain (none at `base` = the chain's length), and the layers between
    /// them drop out. Returns the new chain, top first. `written`: a
    /// commit's handle of the base ([`Live::open_base`]).
    pub fn rebase(
        &self,
        above: usize,
        base: usize,
        written: Option<&CommitBase>,
    ) -> Result<Vec<PathBuf>, SnapshotError> {
        let _one = lock(&self.switching);
        let old = self.current();
        let Some(top) = old.qcow2() else {
            return Err(SnapshotError::NotQcow2);
        };
        let chain = old.image.chain();
        let name = chain.get(base).map(|p| p.display().to_string());
        let above_file = match above {
            0 => None,
            _ => Some(self.open_rw(&chain, above)?),
        };
        // Recorded first, where the snapshot records are: a restart that
        // follows them then knows the images missing from the chain were
        // dropped here, not swapped (see `records::dropped`).
        if let Some(dir) = &self.snapshots {
            let dropped = chain.get(above + 1..base).unwrap_or_default();
            dir.record_dropped(&Dropped::new(&chain[0], dropped))?;
        }
        let mut io_files = Vec::new();
        for f in old
            .io_files
            .iter()
            .take(above + 1)
            .chain(old.io_files.iter().skip(base))
        {
            io_files.push(f.try_clone().map_err(FormatError::io("dup"))?);
        }
        let made = self.pause().and_then(|()| {
            top.rebase(
                above,
                base,
                name.as_deref(),
                &self.options,
                written.map(|w| &*w.0),
                above_file,
            )
            .map_err(SnapshotError::from)
        });
        let made = made.map(|image| self.install(&old, Box::new(image), io_files));
        self.resume();
        made
    }

    /// File `index` of `chain`, opened for writing: only an overlay in
    /// the snapshot directory, which the daemon may open for writing after
    /// start-up (by the directory's descriptor, never following a link),
    /// or the image `--image` names, kept open for writing since start-up
    /// ([`Live::keep_named`]).
    fn open_rw(&self, chain: &[PathBuf], index: usize) -> Result<File, SnapshotError> {
        let Some(path) = chain.get(index) else {
            return Err(SnapshotError::Refused(format!(
                "no layer {index} in the chain"
            )));
        };
        let opened = match (self.in_snapshot_dir(path), &self.named) {
            (Some((dir, name)), _) => dir.open_at(name, libc::O_RDWR),
            (None, Some(named)) if &named.path == path => named.file.try_clone(),
            _ => {
                return Err(SnapshotError::Refused(format!(
                    "{}: a commit writes into it, and the daemon may write only the image \
                     --image names and the overlays it made in --snapshot-dir; commit into one of \
                     those, or stream instead",
                    path.display()
                )));
            }
        };
        opened.map_err(|source| SnapshotError::Create {
            path: path.display().to_string(),
            source,
        })
    }

    /// `path`'s file name, if it is a file of the snapshot directory (which
    /// the daemon may open by name after start-up), with the directory.
    fn in_snapshot_dir<'a>(&'a self, path: &'a Path) -> Option<(&'a SnapshotDir, &'a str)> {
        let dir = self.snapshots.as_ref()?;
        let name = path.file_name()?.to_str()?;
        (path.parent() == Some(dir.path.as_path())).then_some((dir, name))
    }

    /// Checks that a commit of a deeper layer may rewrite the backing file
    /// of layer `above` (see `Live::open_rw`), before it copies anything.
    pub fn check_writable(&self, above: usize) -> Result<(), SnapshotError> {
        self.open_rw(&self.chain(), above).map(drop)
    }

    /// A handle for writing file `base` of the chain (a commit's base):
    /// only an overlay in the snapshot directory, which the daemon may
    /// open for writing after start-up (by the directory's descriptor,
    /// never following a link), or the image `--image` names, kept open
    /// for writing since start-up ([`Live::keep_named`]).
    /// `active`: for an active commit, whose pivot makes the base the top
    /// (see [`Live::pivot`]).
    pub fn open_base(&self, base: usize, active: bool) -> Result<CommitBase, SnapshotError> {
        let served = self.current();
        let Some(image) = served.qcow2() else {
            return Err(SnapshotError::NotQcow2);
        };
        let chain = served.image.chain();
        let file = self.open_rw(&chain, base)?;
        let path = &chain[base];
        let into = image.open_base(base, file, &self.options, active)?;
        if active {
            // The base becomes the top: as large as the guest's disk (a
            // larger one would grow the disk at the pivot).
            let (have, want) = (into.size(), served.image.size());
            if have > want {
                return Err(SnapshotError::Refused(format!(
                    "{}: it is larger ({have} bytes) than the guest's disk ({want}); an active commit into it would grow the disk",
                    path.display()
                )));
            }
            into.grow(want)?;
            // Its I/O descriptor, and the record a pivot removes: both
            // checked now, before anything is copied.
            self.base_io_file(path, into.files()[0])?;
            self.superseding(&chain, base)?;
        }
        Ok(CommitBase(Box::new(into)))
    }

    /// The descriptor the engine does data I/O on once an active commit's
    /// pivot made `path` (the commit's base, whose handle's file is
    /// `file`) the top: with `--direct`, the base opened O_DIRECT for
    /// writing (by the snapshot directory, or kept since start-up for the
    /// named image); else a duplicate.
    fn base_io_file(&self, path: &Path, file: &File) -> Result<File, SnapshotError> {
        let create = |source| SnapshotError::Create {
            path: path.display().to_string(),
            source,
        };
        if !self.direct {
            return file.try_clone().map_err(create);
        }
        match (self.in_snapshot_dir(path), &self.named) {
            (Some((dir, name)), _) => dir
                .open_at(name, libc::O_RDWR | libc::O_DIRECT)
                .map_err(create),
            (
                None,
                Some(Named {
                    path: p,
                    direct: Some(f),
                    ..
                }),
            ) if p == path => f.try_clone().map_err(create),
            _ => Err(SnapshotError::Refused(format!(
                "{}: not open O_DIRECT for writing (see the start-up log); an active commit cannot make it the top",
                path.display()
            ))),
        }
    }

    /// The snapshot record that says file `base` of `chain` was superseded
    /// (by a layer above it: the records of the layers above it that are
    /// overlays in the snapshot directory are read): its name there. An
    /// active commit's pivot removes it, which is what makes a restart
    /// (following the records) serve the base; without one, an active
    /// commit into `base` is refused.
    fn superseding(&self, chain: &[PathBuf], base: usize) -> Result<String, SnapshotError> {
        let Some(base_path) = chain.get(base) else {
            return Err(SnapshotError::Refused(format!(
                "no layer {base} in the chain"
            )));
        };
        let refuse = |why: &str| {
            SnapshotError::Refused(format!(
                "{}: an active commit makes it the active layer, and a restart with the same command line serves it only once the snapshot record that put an overlay above it is removed; {why}",
                base_path.display()
            ))
        };
        let Some(dir) = &self.snapshots else {
            return Err(refuse("serve with --snapshot-dir"));
        };
        for above in &chain[..base] {
            let Some(name) = above
                .file_name()
                .and_then(|n| n.to_str())
                .filter(|_| above.parent() == Some(dir.path.as_path()))
            else {
                continue;
            };
            let record_name = Record::name_for(name);
            let Ok(file) = dir.open_at(&record_name, libc::O_RDONLY | libc::O_NONBLOCK) else {
                continue;
            };
            let text = crate::host::read_capped(&file, super::records::RECORD_MAX)
                .map_err(|e| refuse(&format!("its record {record_name}: {e}")))?;
            let Ok(record) = serde_json::from_slice::<Record>(&text) else {
                continue;
            };
            if Path::new(&record.superseded) == base_path.as_path() {
                return Ok(record_name);
            }
        }
        Err(refuse(
            "no record of a layer above it in --snapshot-dir names it (it is not a live snapshot's base, or the overlay that was is no longer in the chain); stream into the top instead",
        ))
    }

    /// An active commit's pivot (see [`super::qcow2::commit`]): `into`
    /// (file `base` of the chain, which the commit filled with everything
    /// the layers above it had) becomes the top, the image lock moves to
    /// it (`relock`), and the layers above it drop out. The caller keeps
    /// the guest's requests out (and has copied the last of its writes);
    /// the pause here then waits for nothing. The switch on disk is the
    /// removal of the snapshot record that made the layer above the base
    /// its overlay (`Live::superseding`): before it is durable a restart
    /// serves the old top (the base's new clusters hidden under it), after
    /// it the base. Returns the new chain, top first.
    pub fn pivot(
        &self,
        into: CommitBase,
        base: usize,
        relock: impl Fn(&File) -> io::Result<()>,
    ) -> Result<Vec<PathBuf>, SnapshotError> {
        let _one = lock(&self.switching);
        let old = self.current();
        let Some(top) = old.qcow2() else {
            return Err(SnapshotError::NotQcow2);
        };
        let chain = old.image.chain();
        let Some(dir) = &self.snapshots else {
            return Err(SnapshotError::NoDirectory);
        };
        let record = self.superseding(&chain, base)?;
        let mut io_files = vec![self.base_io_file(&chain[base], into.0.files()[0])?];
        for f in old.io_files.iter().skip(base + 1) {
            io_files.push(f.try_clone().map_err(FormatError::io("dup"))?);
        }
        let base_file = into.0.files()[0];
        let made = self.pause().and_then(|()| {
            relock(base_file).map_err(SnapshotError::Lock)?;
            let switch = || {
                crate::host::unlink_at(&dir.dir, &record).map_err(|e| FormatError::Open {
                    path: dir.path.join(&record).display().to_string(),
                    reason: format!("removing the snapshot record (the pivot's switch): {e}"),
                })?;
                // Removed: the pivot goes on whatever the sync says (a
                // restart after a power loss serves either chain, each
                // whole but for what the guest had not flushed).
                if let Err(e) = dir.dir.sync_data() {
                    log::error!(
                        "{}: syncing after the pivot's switch: {e}",
                        dir.path.display()
                    );
                }
                Ok(())
            };
            top.pivot(&into.0, base, &self.options, switch)
                .map_err(|e| {
                    if let Some(old_top) = old.io_files.first() {
                        let _ = relock(old_top);
                    }
                    SnapshotError::from(e)
                })
        });
        let made = made.map(|image| self.install(&old, Box::new(image), io_files));
        self.resume();
        made
    }

    /// A stream's stretch ([`super::qcow2::stream`]): copies up into the
    /// top what the layers above file `base` have of `[offset, offset +
    /// len)`. Blocks.
    pub fn stream_step(&self, base: usize, offset: u64, len: u64) -> Result<Step, FormatError> {
        let served = self.current();
        let Some(image) = served.qcow2() else {
            return Err(FormatError::Unsupported(
                "the top is not a qcow2 image".into(),
            ));
        };
        image.stream_step(base, offset, len)
    }

    /// A commit's stretch ([`super::qcow2::commit`]): copies down into
    /// `into` (file `base`) what layers `top` to `base` have of `[offset,
    /// offset + len)`. Blocks.
    pub fn commit_step(
        &self,
        into: &CommitBase,
        top: usize,
        base: usize,
        offset: u64,
        len: u64,
    ) -> Result<Step, FormatError> {
        let served = self.current();
        let Some(image) = served.qcow2() else {
            return Err(FormatError::Unsupported(
                "the top is not a qcow2 image".into(),
            ));
        };
        image.commit_step(&into.0, top, base, offset, len)
    }

    /// [`Live::commit_step`] over several ranges, synced once: an active
    /// commit's copy (`top` 0) of what its dirty bitmap found changed.
    pub fn commit_extents(
        &self,
        into: &CommitBase,
        top: usize,
        base: usize,
        ranges: &[(u64, u64)],
    ) -> Result<Step, FormatError> {
        let served = self.current();
        let Some(image) = served.qcow2() else {
            return Err(FormatError::Unsupported(
                "the top is not a qcow2 image".into(),
            ));
        };
        image.commit_extents(&into.0, top, base, ranges)
    }

    /// What a job's stretch is a whole number of: the top's clusters.
    pub fn cluster_size(&self) -> u64 {
        self.current().image.cluster_size()
    }

    /// Records a block job that starts (in the snapshot directory; with
    /// none, nothing is recorded and a restart cannot say a job was cut
    /// short).
    pub fn record_job(&self, record: &JobRecord) -> Result<(), FormatError> {
        match &self.snapshots {
            Some(dir) => dir.record_job(record),
            None => Ok(()),
        }
    }

    /// The job ended: its record goes.
    pub fn clear_job(&self) {
        if let Some(dir) = &self.snapshots {
            dir.remove(JOB_RECORD);
            let _ = dir.dir.sync_data();
        }
    }

    /// Stops new requests and waits for those in flight.
    fn pause(&self) -> Result<(), SnapshotError> {
        self.paused.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + QUIESCE_WAIT;
        let gates = lock(&self.gates).clone();
        while gates.iter().any(|g| g.in_flight.load(Ordering::SeqCst) > 0) {
            if Instant::now() > deadline {
                return Err(SnapshotError::Busy(QUIESCE_WAIT));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    /// Lets requests through again, and wakes every queue (some have
    /// requests waiting).
    fn resume(&self) {
        {
            let _g = lock(&self.resumed.0);
            self.paused.store(false, Ordering::SeqCst);
            self.resumed.1.notify_all();
        }
        for g in lock(&self.gates).iter() {
            (g.wake)();
        }
    }
}

/// The files the engine does data I/O on after a snapshot: the new top's
/// own, `top`, and the old chain's, `below`.
fn io_files_after_snapshot(top: File, below: &[File]) -> Result<Vec<File>, FormatError> {
    let mut files = vec![top];
    for f in below {
        files.push(f.try_clone().map_err(FormatError::io("dup"))?);
    }
    Ok(files)
}

/// The files the engine does data I/O on, for `image`: with `direct`, its
/// files opened again O_DIRECT (by /proc/self/fd, at start-up); else
/// duplicates.
fn io_files(image: &dyn Image, direct: bool) -> Result<Vec<File>, FormatError> {
    image
        .files()
        .into_iter()
        .enumerate()
        .map(|(i, f)| {
            if !direct {
                return f.try_clone().map_err(FormatError::io("dup"));
            }
            let proc = format!("/proc/self/fd/{}", f.as_raw_fd());
            std::fs::OpenOptions::new()
                .read(true)
                .write(i == 0 && image.writable())
                .custom_flags(libc::O_DIRECT)
                .open(&proc)
                .map_err(|e| FormatError::Open {
                    path: image.chain()[i].display().to_string(),
                    reason: format!("opening it O_DIRECT: {e}"),
                })
        })
        .collect()
}
