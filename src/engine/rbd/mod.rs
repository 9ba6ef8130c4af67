//! The Ceph RBD engine (`--image rbd:POOL/IMAGE`, cargo feature `rbd`):
//! librbd's asynchronous API, straight from and into guest memory.
//!
//! - Reads and writes: `rbd_aio_readv`/`rbd_aio_writev` on the request's
//!   iovecs (guest memory, kept mapped by the request's `Io::mem` until its
//!   completion is reaped). Flush: `rbd_aio_flush`. Discard:
//!   `rbd_aio_discard`. Write-zeroes: `rbd_aio_write_zeroes`, thick
//!   (allocated) unless the guest set UNMAP.
//! - One image handle per device, shared by every queue: one client of
//!   the image, so with the exclusive-lock feature (Ceph's default) one
//!   lock owner, however many queues write at once.
//! - Completions: each operation's completion carries librbd's callback
//!   (`rbd_aio_create_completion`), as in QEMU's and SPDK's rbd drivers.
//!   It runs on a librbd thread and only appends the operation's key to
//!   its queue's [`client::CompletionList`], writing the queue's eventfd
//!   when the list was empty (one wake-up per burst); the worker watches
//!   the eventfd in its own epoll and `reap` takes the list. Completions
//!   of one queue never reach another's thread, and no call on the
//!   request path waits for the cluster.
//! - librbd's client cache is off (`client::Cluster::connect`): an
//!   acknowledged write is on the OSDs, which is what kill -9, migration
//!   and `--writethrough` need; a flush is then cheap.
//! - Room: a fixed number of slots (the queue size), as with io_uring.
//! - No busy-polling ([`Completions::Signalled`]): librbd completes from its
//!   own threads, tens to hundreds of µs apart, beyond a poll window.

pub mod client;

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use slab::Slab;

use super::{Completions, Engine, Io, Op, Start};
use crate::io::RbdSpec;
use crate::metrics::RateLimiter;
use crate::virtio::Status;
use crate::warn_limited;
use client::{Aio, Cluster, CompletionList, Done, Image, Pool, RbdError};

/// How long connecting may take, and every monitor and OSD operation
/// after it: past this a stopped cluster fails I/O (IOERR) rather than
/// hanging the guest's request for ever.
pub const CEPH_TIMEOUT: Duration = Duration::from_secs(10);

/// Where and as whom to connect (`--ceph-conf`, `--ceph-id`).
#[derive(Clone, Debug)]
pub struct RbdOptions {
    pub spec: RbdSpec,
    pub conf: PathBuf,
    pub id: String,
    pub readonly: bool,
}

/// The image, open once at start-up (before the seccomp filter) on one
/// cluster connection; every queue's engine shares its handle.
#[derive(Debug)]
pub struct RbdDisk {
    pub opts: RbdOptions,
    image: Arc<Image>,
    pub size: u64,
    /// The image's id in its pool (the default serial derives from it).
    pub id: String,
}

impl RbdDisk {
    pub fn open(opts: RbdOptions) -> Result<RbdDisk, RbdError> {
        let cluster = Cluster::connect(&opts.conf, &opts.id, CEPH_TIMEOUT)?;
        let pool = Pool::open(&cluster, &opts.spec.pool)?;
        let image = Image::open(&pool, &opts.spec.image, opts.readonly)?;
        Ok(RbdDisk {
            size: image.size()?,
            id: image.id()?,
            opts,
            image: Arc::new(image),
        })
    }

    /// The serial GET_ID reports: from the image id, so the same on every
    /// host serving the image.
    pub fn default_serial(&self) -> String {
        let mut s = format!("rbd-{}", self.id);
        s.truncate(20);
        s
    }

    /// The handle every queue shares (the control API resizes through it).
    pub fn image(&self) -> &Arc<Image> {
        &self.image
    }

    /// An engine for one queue, on the shared handle, with room for
    /// `entries` requests.
    pub fn engine(&self, entries: usize) -> Result<RbdEngine, RbdError> {
        Ok(RbdEngine {
            image: Arc::clone(&self.image),
            completed: CompletionList::new(entries)?,
            taken: Vec::with_capacity(entries),
            slots: Slab::with_capacity(entries),
            entries,
            log_limit: RateLimiter::new(10, Duration::from_secs(5)),
        })
    }
}

/// Resizing goes through the handle the queues share: growing it there
/// lets them write past the old end at once. `rbd_resize` and
/// `rbd_get_size` are synchronous; the control API calls them on its own
/// thread, never a worker's.
impl crate::disk::Resizable for Image {
    fn size(&self) -> io::Result<u64> {
        Image::size(self).map_err(io::Error::other)
    }

    fn set_size(&self, size: u64) -> io::Result<()> {
        self.resize(size).map_err(io::Error::other)
    }
}

/// A request librbd is executing.
struct Slot {
    io: Io,
    aio: Aio,
}

pub struct RbdEngine {
    /// The device's handle, shared with the other queues' engines; closed
    /// when the last of them is dropped, each after waiting for its slots.
    image: Arc<Image>,
    /// This queue's completions, pushed by librbd's callback; each slot's
    /// `Aio` holds an `Arc` of it too.
    completed: Arc<CompletionList>,
    /// What `reap` took from `completed`, reused (swapped with it).
    taken: Vec<Done>,
    /// Requests in librbd, keyed by the tag of their completion. Never
    /// holds more than `entries`.
    slots: Slab<Slot>,
    entries: usize,
    log_limit: RateLimiter,
}

// SAFETY: the raw pointers inside (iovecs of requests in flight, librbd
// completions and their callback tags) point into memory each request holds,
// at librbd objects that may be used from any thread, or at tags only
// librbd's callback reads; the engine is moved to its queue's thread once
// and used only there.
unsafe impl Send for RbdEngine {}

impl RbdEngine {
    /// Starts the slot's operation in librbd; the result is 0 or -errno.
    fn start_slot(&self, slot: &Slot) -> i32 {
        let io = &slot.io;
        let iovecs = io.data().iovecs();
        let (iov, n, offset) = (iovecs.as_ptr(), iovecs.len(), io.at().offset);
        let Ok(n) = i32::try_from(n) else {
            return -libc::EINVAL;
        };
        match io.op() {
            // SAFETY: the iovecs are the request's own (heap memory of its
            // `GuestBuffers`, which does not move) and point into guest
            // memory its buffers keep mapped; the slot holding both stays
            // in the slab until librbd has completed the operation (`reap`,
            // or `Drop`, which waits for each). A read's buffers are
            // device-writable (checked by the parser).
            Op::Read => unsafe { self.image.aio_readv(iov, n, offset, &slot.aio) },
            // SAFETY: as for the read; a write's buffers are only read.
            Op::Write => unsafe { self.image.aio_writev(iov, n, offset, &slot.aio) },
            Op::Flush => self.image.aio_flush(&slot.aio),
            Op::Discard(r) => self.image.aio_discard(offset, r.len(), &slot.aio),
            Op::WriteZeroes(r) => self
                .image
                .aio_write_zeroes(offset, r.len(), !r.unmap, &slot.aio),
        }
    }

    /// The status of a request librbd finished with `res` (bytes, 0, or
    /// -errno). virtio-blk has three statuses; every errno is an I/O error
    /// except where the operation is a hint.
    fn status(&mut self, io: &Io, res: isize) -> Status {
        let (op, data_len) = (io.op(), io.len() as isize);
        let ok = Status::Ok;
        match (op, res) {
            // A read completes with the bytes read; a write with 0 (librbd
            // 16) or, in other versions, the bytes written.
            (Op::Read, r) if r == data_len => ok,
            (Op::Write, r) if r == 0 || r == data_len => ok,
            (Op::Flush | Op::Discard(_) | Op::WriteZeroes(_), r) if r >= 0 => ok,
            // Discard is a hint: an image that cannot do it has done it.
            (Op::Discard(_), r) if r == -(libc::EOPNOTSUPP as isize) => ok,
            (_, r) => {
                let err = if r < 0 {
                    io::Error::from_raw_os_error(-r as i32).to_string()
                } else {
                    format!("short transfer of {r} of {data_len} bytes")
                };
                warn_limited!(
                    self.log_limit,
                    "RBD {op:?} at offset {} failed: {err}",
                    io.at().offset
                );
                Status::IoErr
            }
        }
    }
}

impl Engine for RbdEngine {
    fn start(&mut self, io: Io) -> Start {
        if self.room() == 0 {
            return Start::Full(io);
        }
        let entry = self.slots.vacant_entry();
        let aio = match Aio::new(entry.key(), &self.completed) {
            Ok(aio) => aio,
            Err(e) => {
                warn_limited!(self.log_limit, "RBD: {e}");
                return Start::Done(io, Status::IoErr);
            }
        };
        let key = entry.key();
        entry.insert(Slot { io, aio });
        let r = self.start_slot(&self.slots[key]);
        if r < 0 {
            // Not started: librbd holds nothing of it.
            let slot = self.slots.remove(key);
            warn_limited!(
                self.log_limit,
                "RBD {:?} could not start: {}",
                slot.io.op(),
                io::Error::from_raw_os_error(-r)
            );
            return Start::Done(slot.io, Status::IoErr);
        }
        Start::Submitted
    }

    /// librbd starts each operation when it is submitted.
    fn commit(&mut self) -> io::Result<u32> {
        Ok(0)
    }

    fn reap(&mut self, mut f: impl FnMut(Io, Status)) -> u32 {
        let mut n = 0;
        let mut taken = std::mem::take(&mut self.taken);
        self.completed.take(&mut taken);
        for d in taken.drain(..) {
            let Some(slot) = self
                .slots
                .get(d.key)
                .is_some_and(|s| s.aio.is(&d))
                .then(|| self.slots.remove(d.key))
            else {
                warn_limited!(
                    self.log_limit,
                    "RBD completion for unknown request {}",
                    d.key
                );
                continue;
            };
            let status = self.status(&slot.io, slot.aio.result());
            // The completion is released here, after librbd is done.
            drop(slot.aio);
            f(slot.io, status);
            n += 1;
        }
        self.taken = taken;
        n
    }

    fn room(&self) -> usize {
        self.entries.saturating_sub(self.in_flight())
    }

    fn in_flight(&self) -> usize {
        self.slots.len()
    }

    /// Sleeps on the eventfd until librbd's callback signals a completion.
    fn wait(&mut self) -> io::Result<()> {
        if self.slots.is_empty() || !self.completed.is_empty() {
            return Ok(());
        }
        // Anything pushed from here on finds the list empty and writes
        // the eventfd.
        let mut pfd = libc::pollfd {
            fd: self.completed.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        // Consumed here: the caller reaps next, and the callback signals
        // again for anything completing after that.
        self.completed.clear_fd();
        Ok(())
    }

    /// librbd completes on its own threads, rarely within a poll window,
    /// so polling does not pay here (measured in docs/benchmarks.md,
    /// "Busy-polling does not pay on RBD").
    fn completions(&self) -> Completions {
        Completions::Signalled {
            fd: self.completed.fd(),
            polling_pays: false,
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        self.image.flush().map_err(io::Error::other)
    }

    fn reset(&mut self) {
        self.completed.clear_fd();
    }
}

impl Drop for RbdEngine {
    /// Waits for librbd to finish with every request still in it: their
    /// guest buffers (held by each `Io`) must outlive the I/O, and each
    /// `Aio`'s tag its callback. (The completion list outlives both: every
    /// tag, and the callback itself, holds an `Arc` of it.)
    fn drop(&mut self) {
        for slot in self.slots.drain() {
            slot.aio.wait();
        }
    }
}
