//! The Ceph RBD engine (`--image rbd:POOL/IMAGE`, cargo feature `rbd`):
//! librbd's asynchronous API, straight from and into guest memory.
//!
//! - Reads and writes: `rbd_aio_readv`/`rbd_aio_writev` on the request's
//!   iovecs (guest memory, kept mapped by the request's `Io::mem` until its
//!   completion is reaped). Flush: `rbd_aio_flush`. Discard:
//!   `rbd_aio_discard`. Write-zeroes: `rbd_aio_write_zeroes`, thick
//!   (allocated) unless the guest set UNMAP.
//! - Completions: librbd writes the engine's eventfd
//!   (`rbd_set_image_notification`) and queues them on the image handle;
//!   the worker watches the eventfd in its own epoll, and `reap` collects
//!   them with `rbd_poll_io_events`. No callback runs our code on librbd's
//!   threads, and no call on the request path waits for the cluster.
//! - One image handle per queue, over one shared cluster connection and
//!   pool: `rbd_poll_io_events` drains everything completed on a handle,
//!   so handles shared between queues would hand one queue's completions
//!   to another. The price: with the exclusive-lock feature, queues
//!   writing at once pass the lock between their handles (a warning at
//!   start says so; use one queue, or images without exclusive-lock).
//! - librbd's client cache is off (`client::Cluster::connect`): an
//!   acknowledged write is on the OSDs, which is what kill -9, migration
//!   and `--writethrough` need; a flush is then cheap.
//! - Room: a fixed number of slots (the queue size), as with io_uring.
//! - No busy-polling ([`Engine::polling_pays`]): librbd completes from its
//!   own threads, tens to hundreds of µs apart, beyond a poll window.

pub mod client;

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use slab::Slab;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::{Completion, Engine, Full, Io, Op};
use crate::io::RbdSpec;
use crate::metrics::RateLimiter;
use crate::virtio::{GuestMem, RequestKind};
use crate::warn_limited;
use client::{Aio, Cluster, Image, Pool, RawCompletion, RbdError};

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

/// A connection to the image's pool, and what the image is: made once at
/// start-up, before the seccomp filter; each queue's engine opens its own
/// handle on it.
#[derive(Debug)]
pub struct RbdDisk {
    pub opts: RbdOptions,
    pool: Arc<Pool>,
    pub size: u64,
    /// The image's id in its pool (the default serial derives from it).
    pub id: String,
    features: u64,
}

impl RbdDisk {
    pub fn open(opts: RbdOptions) -> Result<RbdDisk, RbdError> {
        let cluster = Cluster::connect(&opts.conf, &opts.id, CEPH_TIMEOUT)?;
        let pool = Pool::open(&cluster, &opts.spec.pool)?;
        let image = Image::open(&pool, &opts.spec.image, opts.readonly)?;
        Ok(RbdDisk {
            size: image.size()?,
            id: image.id()?,
            features: image.features()?,
            opts,
            pool,
        })
    }

    /// The serial GET_ID reports: from the image id, so the same on every
    /// host serving the image.
    pub fn default_serial(&self) -> String {
        let mut s = format!("rbd-{}", self.id);
        s.truncate(20);
        s
    }

    /// Whether the image has the exclusive-lock feature.
    pub fn exclusive_lock(&self) -> bool {
        self.features & u64::from(client::RBD_FEATURE_EXCLUSIVE_LOCK) != 0
    }

    /// An engine for one queue, with room for `entries` requests.
    pub fn engine(&self, entries: usize) -> Result<RbdEngine, RbdError> {
        let image = Image::open(&self.pool, &self.opts.spec.image, self.opts.readonly)?;
        let eventfd = EventFd::new(EFD_NONBLOCK).map_err(|e| RbdError::Call {
            what: "creating an eventfd".into(),
            errno: e.raw_os_error().unwrap_or(libc::EIO),
        })?;
        image.notify_eventfd(eventfd.as_raw_fd())?;
        Ok(RbdEngine {
            image,
            eventfd,
            slots: Slab::with_capacity(entries),
            entries,
            done: VecDeque::with_capacity(entries),
            polled: vec![std::ptr::null_mut(); entries.max(1)],
            log_limit: RateLimiter::new(10, Duration::from_secs(5)),
            unflushed: false,
        })
    }
}

/// A request librbd is executing.
struct Slot {
    io: Io,
    op: Op,
    aio: Aio,
}

pub struct RbdEngine {
    /// Closed (dropped) only after `Drop` has waited for every slot.
    image: Image,
    /// Written by librbd on each completion of `image`.
    eventfd: EventFd,
    /// Requests in librbd, keyed by the tag of their completion. Never
    /// holds more than `entries`.
    slots: Slab<Slot>,
    entries: usize,
    /// Finished without librbd (empty transfers, failures to start), not
    /// yet reaped; never longer than `entries`.
    done: VecDeque<Completion>,
    /// Completions from `rbd_poll_io_events`, reused.
    polled: Vec<RawCompletion>,
    log_limit: RateLimiter,
    /// Something changed on the image since the last completed flush.
    unflushed: bool,
}

// SAFETY: the raw pointers inside (iovecs of requests in flight, librbd
// handles) point into memory each `Io` holds, or at librbd objects that
// may be used from any thread; the engine is moved to its queue's thread
// once and used only there.
unsafe impl Send for RbdEngine {}

impl RbdEngine {
    fn finish_now(&mut self, io: Io, status: u8) {
        self.note_durability(&io, status);
        let written = written(&io, status);
        self.done.push_back(Completion {
            io,
            status,
            written,
        });
    }

    /// Starts `op` in librbd; the result is 0 or -errno.
    fn start(&self, slot: &Slot) -> i32 {
        let req = &slot.io.req;
        let (iov, n) = (req.data.0.as_ptr(), req.data.0.len());
        let Ok(n) = i32::try_from(n) else {
            return -libc::EINVAL;
        };
        match slot.op {
            // SAFETY: the iovecs are the request's own (heap memory of its
            // `HostBuffers`, which does not move) and point into guest
            // memory kept mapped by its `Io::mem`; the slot holding both
            // stays in the slab until librbd has completed the operation
            // (`reap`, or `Drop`, which waits for each). A read's buffers
            // are device-writable (checked by the parser).
            Op::Read => unsafe { self.image.aio_readv(iov, n, req.offset(), &slot.aio) },
            // SAFETY: as for the read; a write's buffers are only read.
            Op::Write => unsafe { self.image.aio_writev(iov, n, req.offset(), &slot.aio) },
            Op::Flush => self.image.aio_flush(&slot.aio),
            Op::Discard(r) => self.image.aio_discard(r.offset(), r.len(), &slot.aio),
            Op::WriteZeroes(r) => {
                self.image
                    .aio_write_zeroes(r.offset(), r.len(), !r.unmap, &slot.aio)
            }
        }
    }

    /// The status of a request librbd finished with `res` (bytes, 0, or
    /// -errno). virtio-blk has three statuses; every errno is an I/O error
    /// except where the operation is a hint.
    fn status(&mut self, op: Op, io: &Io, res: isize) -> u8 {
        let data_len = io.req.data_len as isize;
        let ok = VIRTIO_BLK_S_OK as u8;
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
                    io.req.offset()
                );
                VIRTIO_BLK_S_IOERR as u8
            }
        }
    }

    fn note_durability(&mut self, io: &Io, status: u8) {
        match io.req.kind {
            RequestKind::Flush if u32::from(status) == VIRTIO_BLK_S_OK => self.unflushed = false,
            RequestKind::Write { .. } | RequestKind::Discard(_) | RequestKind::WriteZeroes(_) => {
                self.unflushed = true
            }
            _ => {}
        }
    }
}

impl Engine for RbdEngine {
    fn submit(&mut self, io: Io) -> Result<(), Full> {
        if self.room() == 0 {
            return Err(Full(io));
        }
        let Some(op) = Op::of(io.req.kind) else {
            self.finish_now(io, VIRTIO_BLK_S_UNSUPP as u8);
            return Ok(());
        };
        if matches!(op, Op::Read | Op::Write) && io.req.data_len == 0 {
            self.finish_now(io, VIRTIO_BLK_S_OK as u8);
            return Ok(());
        }
        let entry = self.slots.vacant_entry();
        let aio = match Aio::new(entry.key()) {
            Ok(aio) => aio,
            Err(e) => {
                warn_limited!(self.log_limit, "RBD: {e}");
                self.finish_now(io, VIRTIO_BLK_S_IOERR as u8);
                return Ok(());
            }
        };
        let key = entry.key();
        entry.insert(Slot { io, op, aio });
        let r = self.start(&self.slots[key]);
        if r < 0 {
            // Not started: librbd holds nothing of it.
            let slot = self.slots.remove(key);
            warn_limited!(
                self.log_limit,
                "RBD {op:?} could not start: {}",
                io::Error::from_raw_os_error(-r)
            );
            self.finish_now(slot.io, VIRTIO_BLK_S_IOERR as u8);
        }
        Ok(())
    }

    /// librbd starts each operation when it is submitted.
    fn commit(&mut self) -> io::Result<u32> {
        Ok(0)
    }

    fn reap(&mut self, mut f: impl FnMut(Completion)) -> u32 {
        let mut n = self.done.len() as u32;
        self.done.drain(..).for_each(&mut f);
        let mut polled = std::mem::take(&mut self.polled);
        loop {
            let got = self.image.poll_events(&mut polled);
            for &raw in &polled[..got] {
                // SAFETY: `raw` was just polled, and every completion of
                // this image is an `Aio` of a slot, released only below
                // (or in `Drop`), after it has been polled or waited for.
                let key = unsafe { client::key_of(raw) };
                let Some(slot) = self
                    .slots
                    .get(key)
                    .is_some_and(|s| s.aio.is(raw))
                    .then(|| self.slots.remove(key))
                else {
                    warn_limited!(self.log_limit, "RBD completion for unknown request {key}");
                    continue;
                };
                let status = self.status(slot.op, &slot.io, slot.aio.result());
                self.note_durability(&slot.io, status);
                let written = written(&slot.io, status);
                // The completion is released here, after librbd is done.
                drop(slot.aio);
                f(Completion {
                    io: slot.io,
                    status,
                    written,
                });
                n += 1;
            }
            if got < polled.len() {
                break;
            }
        }
        self.polled = polled;
        n
    }

    fn room(&self) -> usize {
        self.entries.saturating_sub(self.in_flight())
    }

    fn in_flight(&self) -> usize {
        self.slots.len() + self.done.len()
    }

    /// Sleeps on the eventfd until librbd signals a completion.
    fn wait(&mut self) -> io::Result<()> {
        if !self.done.is_empty() || self.slots.is_empty() {
            return Ok(());
        }
        let mut pfd = libc::pollfd {
            fd: self.eventfd.as_raw_fd(),
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
        // Consumed here: the caller reaps next, and librbd signals again
        // for anything completing after that.
        let _ = self.eventfd.read();
        Ok(())
    }

    fn has_completions(&mut self) -> bool {
        if !self.done.is_empty() {
            return true;
        }
        let mut pfd = libc::pollfd {
            fd: self.eventfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call; no wait.
        unsafe { libc::poll(&mut pfd, 1, 0) > 0 }
    }

    fn completion_fd(&self) -> Option<RawFd> {
        Some(self.eventfd.as_raw_fd())
    }

    fn clear_completion_fd(&self) {
        let _ = self.eventfd.read();
    }

    fn must_poll(&self) -> bool {
        false
    }

    /// librbd completes on its own threads, rarely within a poll window:
    /// polling found work in at most 7 % of its windows and cost IOPS
    /// (docs/BENCHMARKS.md, "Busy-polling does not pay on RBD").
    fn polling_pays(&self) -> bool {
        false
    }

    fn set_memory(&mut self, _mem: &Arc<GuestMem>) {}

    fn make_durable(&mut self) -> io::Result<()> {
        if self.unflushed {
            self.image.flush().map_err(io::Error::other)?;
            self.unflushed = false;
        }
        Ok(())
    }

    fn reset(&mut self) {
        let _ = self.eventfd.read();
    }
}

impl Drop for RbdEngine {
    /// Waits for librbd to finish with every request still in it: their
    /// guest buffers (held by each `Io`) must outlive the I/O.
    fn drop(&mut self) {
        for slot in self.slots.drain() {
            slot.aio.wait();
        }
    }
}

/// Bytes written into the guest's buffers by a request that ended with
/// `status`.
fn written(io: &Io, status: u8) -> u32 {
    match io.req.kind {
        RequestKind::Read { .. } if u32::from(status) == VIRTIO_BLK_S_OK => io.req.data_len,
        _ => 0,
    }
}
