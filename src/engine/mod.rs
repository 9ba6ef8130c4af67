//! The I/O engines: a queue's worker decides *when* (pop, parse, batch,
//! publish, notify, journal); an engine decides *how* a validated request
//! becomes I/O on the image, and hands completions back.
//!
//! The contract ([`Engine`]):
//! - [`Engine::submit`] takes an [`Io`] (a request and the guest memory it
//!   was parsed against). It comes back exactly once, through
//!   [`Engine::reap`], as a [`Completion`]; or at once, untouched, in
//!   [`Full`] when the engine has no room for it.
//! - [`Engine::commit`] hands what was submitted to the kernel (one
//!   io_uring_enter for a batch); the worker calls it once per batch.
//! - Everything engine-specific stays behind it: opcodes, fallocate modes,
//!   bounce buffers for O_DIRECT, fixed buffers, IOPOLL's limits, and the
//!   blocking fallbacks ([`sync`]) and retries. A fallback or a retry is the
//!   engine's business: it never re-enters the worker.
//!
//! The lifecycle in types: an [`Io`] owns an `Arc` of the memory snapshot
//! its buffers point into, from parse until its completion is reaped, so a
//! front-end that remaps or removes memory meanwhile cannot pull it from
//! under the kernel. An engine is never dropped with I/O in flight: each
//! engine's `Drop` waits for the kernel to finish with its buffers.
//!
//! Engines: [`UringEngine`] (io_uring on the image), [`NullEngine`] (no
//! I/O: the ceiling of the ring path), and with the `rbd` feature
//! `rbd::RbdEngine` (librbd's asynchronous API on a Ceph RBD image).

mod bounce;
mod null;
#[cfg(feature = "rbd")]
pub mod rbd;
mod ring;
pub mod sync;
mod uring;

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

pub use null::NullEngine;
pub use ring::{EngineError, REGISTER_OPS};
pub use uring::{FALLOCATE_MODES, UringConfig, UringEngine};

pub use crate::virtio::Op;
use crate::virtio::{GuestMem, Request, Status};

/// A validated request on its way through an engine, with the guest
/// memory snapshot its buffers point into. Holding the `Arc` keeps every
/// region of that snapshot mapped until the `Io` is dropped, which is after
/// its completion has been reaped.
#[derive(Debug)]
pub struct Io {
    pub req: Request,
    pub mem: Arc<GuestMem>,
}

/// A finished request: its `status`, and `written` the
/// bytes the device wrote into the guest's buffers (not counting the status
/// byte): the data of a successful read, 0 otherwise.
#[derive(Debug)]
pub struct Completion {
    pub io: Io,
    pub status: Status,
    pub written: u32,
}

/// A request the engine has no room for, given back untouched.
#[derive(Debug)]
pub struct Full(pub Io);

/// What a queue's worker needs of an I/O engine. One engine per queue, used
/// only from that queue's thread.
pub trait Engine: Send {
    /// Takes `io`; it completes through [`Engine::reap`]. Gives it back
    /// when there is no room.
    fn submit(&mut self, io: Io) -> Result<(), Full>;

    /// Hands everything submitted since the last call to the kernel.
    /// Returns how many operations went (0 when the engine needs no such
    /// step).
    fn commit(&mut self) -> io::Result<u32>;

    /// Passes every completion available now to `f`. Returns how many.
    fn reap(&mut self, f: impl FnMut(Completion)) -> u32;

    /// How many more requests `submit` takes now.
    fn room(&self) -> usize;

    /// Requests taken and not yet reaped.
    fn in_flight(&self) -> usize;

    /// Blocks until a completion can be reaped (commits first). Returns at
    /// once when nothing is in flight.
    fn wait(&mut self) -> io::Result<()>;

    /// Whether a completion can be reaped without waiting (cheap: used
    /// while busy-polling).
    fn has_completions(&mut self) -> bool;

    /// An eventfd written when a completion is posted, to watch next to
    /// the kick; `None` when completions are only ever reaped inline.
    fn completion_fd(&self) -> Option<RawFd>;

    /// Consumes the completion eventfd's count, before reaping.
    fn clear_completion_fd(&self);

    /// Completions appear only when polled for ([`Engine::wait`]), never
    /// through the eventfd (io_uring IOPOLL).
    fn must_poll(&self) -> bool;

    /// Whether busy-polling for completions can pay: false where they
    /// come from another thread's work long after a poll window ends
    /// (librbd), so that spinning only takes CPU from that thread. The
    /// worker then never busy-polls, whatever `--poll-us` says.
    fn polling_pays(&self) -> bool {
        true
    }

    /// Guest memory changed (SET_MEM_TABLE and friends). Requests in
    /// flight keep the snapshot in their [`Io`].
    fn set_memory(&mut self, mem: &Arc<GuestMem>);

    /// Makes everything completed so far durable on the image (the ring
    /// stops; the next reader may be another process, on another host).
    fn make_durable(&mut self) -> io::Result<()>;

    /// The connection is over and nothing is in flight: drop what belongs
    /// to it (guest memory registered with the kernel), so that the engine
    /// can serve the next one.
    fn reset(&mut self);
}
