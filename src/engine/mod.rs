//! How a validated request becomes I/O on the image.
//!
//! A queue's worker ([`crate::queue`], the *when*) hands each request to
//! its queue's [`Core`], and takes completions back from it. Below the
//! core, two seams:
//! - a [`Format`] decides *where* a request's bytes are: a raw image maps
//!   a guest offset to itself in file 0 ([`Raw`]); an image format
//!   (qcow2) maps it to a host offset in one of its chain's files, or
//!   says it reads as zeroes, or that metadata must be read or allocated
//!   first (see [`crate::disk::seam`]);
//! - an [`Engine`] turns an [`Io`] (what, where, how durable) into I/O:
//!   io_uring ([`UringEngine`]), librbd (`rbd::RbdEngine`, feature `rbd`),
//!   or nothing at all ([`NullEngine`], the ceiling of the ring path).
//!
//! What every engine needs is done once, in the core ([`core`], after
//! cloud-hypervisor's `CompletionCommon`): GET_ID's answer, empty
//! transfers, the queue of requests finished without I/O, which completed
//! changes are not yet flushed (so that a stopping ring flushes only when
//! needed), the bytes each request wrote into the guest, and marking
//! those in the dirty log during a migration. What a write, discard or
//! write-zeroes does first for the device's dirty bitmaps and a running
//! backup is there too, before the engine starts it (`Core::before_write`).
//!
//! The contract of an engine ([`Engine`]):
//! - [`Engine::start`] takes an [`Io`]. It is [`Start::Submitted`] and
//!   comes back exactly once from [`Engine::reap`], or is finished already
//!   ([`Start::Done`]: a blocking fallback, a failure found before
//!   submission), or is given back untouched ([`Start::Full`]).
//! - [`Engine::commit`] hands what was started to the kernel (one
//!   io_uring_enter for a batch); the worker calls it once per batch.
//! - [`Engine::completions`] says how completions arrive
//!   ([`Completions`]): through an eventfd to watch (and whether
//!   busy-polling can catch them), only when polled for (IOPOLL), or
//!   always at once.
//! - Everything engine-specific stays behind it: opcodes, fallocate modes,
//!   bounce buffers for O_DIRECT, fixed buffers, IOPOLL's limits, the
//!   blocking fallbacks ([`sync`]) and retries. A fallback or a retry is
//!   the engine's business: it never re-enters the worker.
//!
//! The lifecycle in types: a request ([`Request`]) owns the memory
//! snapshot its buffers point into, from parse until its completion is
//! reaped, so a front-end that remaps or removes memory meanwhile cannot
//! pull it from under the kernel. An engine is never dropped with I/O in
//! flight: each engine's `Drop` waits for the kernel to finish with its
//! buffers.

mod bounce;
pub mod core;
mod null;
#[cfg(feature = "rbd")]
pub mod rbd;
mod ring;
pub mod sync;
mod uring;

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

pub use self::core::Core;
pub use crate::disk::seam::{Completions, Extent, Format, ImageFormat, Raw};
pub use null::NullEngine;
pub use ring::{EngineError, REGISTER_OPS};
pub use uring::{FALLOCATE_MODES, UringConfig, UringEngine};

pub use crate::virtio::Op;
use crate::virtio::{GuestBuffers, GuestMem, Request, Status};

/// A request on its way through an engine: what to do and where, made by
/// the core from a validated request and its format's mapping. Usually a
/// whole request; where a format splits a request across places (clusters
/// of a qcow2 image), each piece is an `Io` of its own, over part of the
/// request's buffers, and the core completes the request when its last
/// piece is back.
#[derive(Debug)]
pub struct Io {
    data: Data,
    op: Op,
    at: Extent,
    fua: bool,
    /// The core's own: which of its requests this is part of (or
    /// [`Io::UNTRACKED`]). Engines pass it back untouched.
    tag: u32,
}

/// What an [`Io`] carries: the request itself, or part of its buffers
/// (the request waits in the core).
#[derive(Debug)]
enum Data {
    Request(Request),
    Part(GuestBuffers),
}

impl Io {
    /// A request the core does not track beyond the engine.
    pub(crate) const UNTRACKED: u32 = u32::MAX;

    pub(crate) fn new(req: Request, op: Op, at: Extent, fua: bool) -> Io {
        Io {
            data: Data::Request(req),
            op,
            at,
            fua,
            tag: Io::UNTRACKED,
        }
    }

    /// A piece of tracked request `tag`: `data` (part of its buffers) at
    /// `at`, or the whole request with `req`.
    pub(crate) fn tracked(
        req: Option<Request>,
        part: Option<GuestBuffers>,
        op: Op,
        at: Extent,
        fua: bool,
        tag: u32,
    ) -> Io {
        let data = match (req, part) {
            (Some(r), _) => Data::Request(r),
            (None, Some(p)) => Data::Part(p),
            (None, None) => unreachable!("an Io carries a request or part of one"),
        };
        Io {
            data,
            op,
            at,
            fua,
            tag,
        }
    }

    /// The buffers to read into or write from (the memory they point into
    /// is held with them).
    #[inline]
    pub fn data(&self) -> &GuestBuffers {
        match &self.data {
            Data::Request(r) => r.data(),
            Data::Part(p) => p,
        }
    }

    /// The buffers, to transform a read's bytes in place once it is back
    /// (an encrypted disk's, in the core).
    #[inline]
    pub(crate) fn data_mut(&mut self) -> &mut GuestBuffers {
        match &mut self.data {
            Data::Request(r) => r.data_mut(),
            Data::Part(p) => p,
        }
    }

    /// Bytes to transfer.
    #[inline]
    pub fn len(&self) -> u32 {
        self.data().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn op(&self) -> Op {
        self.op
    }

    /// Where the bytes are on the image: which file of its chain, at what
    /// offset. For a discard or write-zeroes, the start of its range; for
    /// a flush, file 0 at 0 (it covers the file the image writes).
    pub fn at(&self) -> Extent {
        self.at
    }

    /// A write is durable when it completes (the guest's write cache is
    /// off): write-through, RWF_DSYNC.
    pub fn fua(&self) -> bool {
        self.fua
    }

    pub(crate) fn tag(&self) -> u32 {
        self.tag
    }

    /// The request if this carries it whole, else the part of its
    /// buffers it carries.
    pub(crate) fn into_inner(self) -> Result<Request, GuestBuffers> {
        match self.data {
            Data::Request(r) => Ok(r),
            Data::Part(p) => Err(p),
        }
    }

    /// The request, if this carries it whole.
    #[inline(always)]
    pub(crate) fn into_request(self) -> Option<Request> {
        match self.data {
            Data::Request(r) => Some(r),
            Data::Part(_) => None,
        }
    }
}

/// What became of an [`Io`] given to [`Engine::start`].
#[derive(Debug)]
pub enum Start {
    /// On its way: it comes back from [`Engine::reap`].
    Submitted,
    /// Finished already, with this status.
    Done(Io, Status),
    /// No room for it now: given back untouched.
    Full(Io),
}

/// A finished request: its status, and the bytes the device wrote into
/// the guest's buffers (not counting the status byte).
#[derive(Debug)]
pub struct Completion {
    pub req: Request,
    pub status: Status,
    pub written: u32,
}

/// A request the core has no room for, given back untouched.
#[derive(Debug)]
pub struct Full(pub Request);

/// What a queue's core needs of an I/O engine: the I/O, nothing else. One
/// engine per queue, used only from that queue's thread.
pub trait Engine: Send {
    /// Starts `io` (see [`Start`]).
    fn start(&mut self, io: Io) -> Start;

    /// Hands everything started since the last call to the kernel.
    /// Returns how many operations went (0 when the engine needs no such
    /// step).
    fn commit(&mut self) -> io::Result<u32>;

    /// Passes every completion available now to `f`, with its status.
    /// Returns how many.
    fn reap(&mut self, f: impl FnMut(Io, Status)) -> u32;

    /// How many more `start` takes now.
    fn room(&self) -> usize;

    /// Started and not yet reaped.
    fn in_flight(&self) -> usize;

    /// Blocks until a completion can be reaped (commits first). Returns at
    /// once when nothing is in flight.
    fn wait(&mut self) -> io::Result<()>;

    /// How completions arrive; the same for the engine's life.
    fn completions(&self) -> Completions;

    /// Guest memory changed (SET_MEM_TABLE and friends). Requests in
    /// flight keep their own snapshot.
    fn set_memory(&mut self, _mem: &Arc<GuestMem>) {}

    /// Makes everything completed so far durable on the image, blocking.
    fn flush(&mut self) -> io::Result<()>;

    /// The image's files changed (a snapshot put a new top above its
    /// chain): `fds`, top first, are what an [`Extent::file`] indexes from
    /// now on, and file 0 is what a flush covers. Called with nothing in
    /// flight.
    fn set_files(&mut self, _fds: &[RawFd]) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this engine serves one file",
        ))
    }

    /// The connection is over and nothing is in flight: drop what belongs
    /// to it (guest memory registered with the kernel), so that the engine
    /// can serve the next one.
    fn reset(&mut self) {}
}
