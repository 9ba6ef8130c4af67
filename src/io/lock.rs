//! The image lock: one daemon (or QEMU) at a time writes an image.
//!
//! An open-file-description lock (`F_OFD_SETLK`) on the whole image,
//! exclusive for a read-write export and shared for a read-only one, so
//! two read-only daemons may share an image but no writer may share it
//! with anyone. QEMU's own image locking also takes OFD locks on the file
//! (on bytes of its own), which conflict with ours: with
//! qemu-storage-daemon holding the image read-write, this lock fails
//! (checked by hand, not by a test).
//!
//! The lock is held while the device runs, not while the daemon does: it
//! is taken when a ring starts and released when the last running ring
//! stops (GET_VRING_BASE, a device reset, the end of the connection). A
//! live migration between two daemons on one image therefore hands it
//! over: QEMU stops the source's rings before it starts the
//! destination's. The kernel drops the lock of a process that dies, so a
//! daemon killed with -9 does not keep its successor off the image.
//!
//! The lock is advisory: it stops daemons and QEMUs that ask, not a `dd`.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Mutex;

/// The image lock of one device, shared by its queues.
#[derive(Debug)]
pub struct ImageLock {
    state: Mutex<Holders>,
    exclusive: bool,
}

/// The locked file, and who holds or wants its lock in this process.
#[derive(Debug)]
struct Holders {
    /// A duplicate of the image's fd (its top, for a qcow2 chain: what is
    /// written): the same open file description, whose lock this is.
    /// Locks belong to the description, so the lock goes when the last fd
    /// of it is closed.
    file: File,
    /// How many queues have started and not stopped. The lock is held
    /// while this is above 0.
    users: usize,
    /// How many running queues were refused it (another process holds
    /// it) and try again.
    waiting: usize,
}

/// The image lock's state, as `ctl status` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LockState {
    /// No lock is taken (`--no-image-lock`, an RBD image).
    Off,
    /// Not held, and no ring runs (no front-end, or its rings stopped).
    Idle,
    /// Held: this daemon's rings write the image.
    Held,
    /// A ring runs without it: another process holds it. Requests wait
    /// for it a few seconds after the ring starts, then fail with IOERR
    /// until it is released.
    Waiting,
}

/// Another process holds a conflicting lock.
#[derive(Debug, thiserror::Error)]
#[error("the image is locked by another process (another ringblk or a QEMU using it)")]
pub struct Locked;

impl ImageLock {
    /// A lock on `image`'s open file description; nothing is locked yet.
    /// `exclusive` for a read-write export.
    pub fn new(image: &File, exclusive: bool) -> io::Result<ImageLock> {
        Ok(ImageLock {
            state: Mutex::new(Holders {
                file: image.try_clone()?,
                users: 0,
                waiting: 0,
            }),
            exclusive,
        })
    }

    /// A queue starts: takes the lock if no queue holds it. Each `Ok` is
    /// matched by one [`ImageLock::release`].
    pub fn acquire(&self) -> Result<(), Locked> {
        let mut h = self.holders();
        if h.users == 0 {
            match set(&h.file, self.kind()) {
                Ok(()) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) => {
                    return Err(Locked);
                }
                Err(e) => {
                    // A file system without locks (some FUSE ones): the
                    // lock cannot protect anything there, and refusing
                    // I/O for it would make the image useless.
                    log::warn!("cannot lock the image ({e}); serving it unlocked");
                }
            }
        }
        h.users += 1;
        Ok(())
    }

    /// A queue that acquired the lock stops; the last one releases it.
    pub fn release(&self) {
        let mut h = self.holders();
        h.users = h.users.saturating_sub(1);
        if h.users == 0
            && let Err(e) = set(&h.file, libc::F_UNLCK)
        {
            log::warn!("cannot unlock the image: {e}");
        }
    }

    /// The image's written file is now `file` (a live snapshot's overlay):
    /// while a queue runs, `file` is locked before the old one is let go,
    /// and a conflict fails the move (nothing changes).
    pub fn relock(&self, file: &File) -> io::Result<()> {
        let new = file.try_clone()?;
        let mut h = self.holders();
        if h.users > 0 {
            set(&new, self.kind())?;
            if let Err(e) = set(&h.file, libc::F_UNLCK) {
                log::warn!("cannot unlock the former top of the chain: {e}");
            }
        }
        h.file = new;
        Ok(())
    }

    /// A running queue was refused the lock and will try again (`true`),
    /// or no longer does (`false`: it got it, or stopped). Each `true` is
    /// matched by one `false`.
    pub fn set_waiting(&self, on: bool) {
        let mut h = self.holders();
        if on {
            h.waiting += 1;
        } else {
            h.waiting = h.waiting.saturating_sub(1);
        }
    }

    /// Held, waited for, or neither.
    pub fn state(&self) -> LockState {
        let h = self.holders();
        if h.users > 0 {
            LockState::Held
        } else if h.waiting > 0 {
            LockState::Waiting
        } else {
            LockState::Idle
        }
    }

    fn holders(&self) -> std::sync::MutexGuard<'_, Holders> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn kind(&self) -> libc::c_int {
        if self.exclusive {
            libc::F_WRLCK
        } else {
            libc::F_RDLCK
        }
    }
}

/// Takes (or with F_UNLCK gives up) the lock on the whole of `file`.
fn set(file: &File, kind: libc::c_int) -> io::Result<()> {
    // SAFETY: all-zero is a valid `flock` (l_start 0, l_len 0: the whole
    // file; l_pid must be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: F_OFD_SETLK reads one `flock` through the pointer, which
    // points to a live local; the fd is open for the call.
    let ret = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut fl) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fs::OpenOptions;

    use super::*;

    fn open(path: &std::path::Path) -> File {
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap()
    }

    #[test]
    fn a_writer_excludes_others_until_its_last_queue_stops() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        File::create(&path).unwrap().set_len(4096).unwrap();
        let a = ImageLock::new(&open(&path), true).unwrap();
        let b = ImageLock::new(&open(&path), true).unwrap();
        let reader = ImageLock::new(&open(&path), false).unwrap();
        assert_eq!(a.state(), LockState::Idle);
        a.acquire().unwrap();
        a.acquire().unwrap();
        assert_eq!(a.state(), LockState::Held);
        assert!(b.acquire().is_err());
        b.set_waiting(true);
        assert_eq!(b.state(), LockState::Waiting);
        assert!(reader.acquire().is_err());
        a.release();
        assert!(b.acquire().is_err(), "one of a's queues still runs");
        a.release();
        b.acquire().unwrap();
        b.set_waiting(false);
        assert_eq!(b.state(), LockState::Held);
        assert_eq!(a.state(), LockState::Idle);
        b.release();
        assert_eq!(b.state(), LockState::Idle);
        reader.acquire().unwrap();
    }

    /// A live snapshot moves the lock to the new top while a queue runs;
    /// the old top is then free for a reader (a copy), the new one is not.
    #[test]
    fn relock_moves_the_lock_to_the_new_top() {
        let dir = tempfile::tempdir().unwrap();
        let (old, new) = (dir.path().join("old"), dir.path().join("new"));
        for p in [&old, &new] {
            File::create(p).unwrap().set_len(4096).unwrap();
        }
        let lock = ImageLock::new(&open(&old), true).unwrap();
        lock.acquire().unwrap();
        lock.relock(&open(&new)).unwrap();
        ImageLock::new(&open(&old), false)
            .unwrap()
            .acquire()
            .unwrap();
        assert!(
            ImageLock::new(&open(&new), false)
                .unwrap()
                .acquire()
                .is_err()
        );
        lock.release();
        ImageLock::new(&open(&new), true)
            .unwrap()
            .acquire()
            .unwrap();
    }

    #[test]
    fn readers_share() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        File::create(&path).unwrap().set_len(4096).unwrap();
        let r1 = ImageLock::new(&open(&path), false).unwrap();
        let r2 = ImageLock::new(&open(&path), false).unwrap();
        let w = ImageLock::new(&open(&path), true).unwrap();
        r1.acquire().unwrap();
        r2.acquire().unwrap();
        assert!(w.acquire().is_err());
        r1.release();
        r2.release();
        w.acquire().unwrap();
    }
}
