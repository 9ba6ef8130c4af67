//! Where a request's bytes are: the seam between a validated request and
//! the engine's I/O, for image formats.
//!
//! The core asks the queue's [`Format`] once per read, write, discard,
//! write-zeroes and flush, with the operation and its guest byte range,
//! before the engine sees the request. A format answers with a
//! [`Mapping`]:
//! - [`Mapping::Host`]: the whole range at one place, in one of the image
//!   chain's files (its index, as the engine registered the files, and
//!   the offset there). A raw image ([`Raw`]) maps every range to itself
//!   in file 0; a qcow2 image a range within one cluster (or clusters
//!   next to each other in the file) whose place its cache knows;
//! - [`Mapping::Zero`]: a read of zeroes (an unallocated cluster with no
//!   backing file, a zero cluster): the core zero-fills the buffers and
//!   finishes the request without I/O;
//! - [`Mapping::Pieces`]: several places ([`Format::pieces`]): the core
//!   starts a piece of I/O for each, over the part of the request's
//!   buffers it covers, and completes the request when the last is back;
//! - [`Mapping::Slow`]: metadata work first (a table not cached, a cluster
//!   to allocate, copy-on-write, a compressed cluster, a discard): the
//!   core hands the request to the format ([`Format::start_slow`]), which
//!   gives it back resolved into pieces ([`Format::reap_slow`]), through a
//!   completion the worker already waits on (the engine's eventfd), or at
//!   the worker's next reap when the format could do the work at once;
//! - [`Mapping::Busy`]: not now (a snapshot is switching the chain): the
//!   request waits at the head of its queue, and the format wakes the
//!   queue when it may go.
//!
//! A write whose allocation the format made hands the core a [`Commit`]
//! ticket with its pieces; after the write's data I/O, and before its
//! completion is published, the core asks the format to commit
//! ([`Format::start_commit`]), so that the metadata the write needs is in
//! the image file when the guest learns the write is done; for a
//! write-through write (the device's write cache off) also on the disk:
//! the commit ends with an fdatasync, as the data went with FUA.
//!
//! Flush maps to file 0 (the chain's writable top) while the format keeps
//! no metadata back from the file (every completed write's was committed
//! before its completion), so an fdatasync of that file covers both. While
//! it holds L2 tables back (their entries in its L2 log), a flush goes to
//! the metadata thread, which writes them out in order and syncs.
//!
//! A raw image's path is [`Mapping::Host`] and nothing else: the default
//! methods below are empty and inline away.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use super::Commit;
use super::luks::Crypt;
use super::meta::Meta;
use super::queue::ChainQueue;
use super::{Live, Where};
use crate::virtio::{GuestBuffers, Op};

/// A place on the image: a file of its chain, and an offset there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extent {
    /// The file's index: 0 is the image itself (the engine's registered
    /// file 0); a format with a backing chain numbers the others.
    pub file: u32,
    /// Byte offset in that file.
    pub offset: u64,
}

/// What a format made of a guest range (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapping {
    /// The whole range lies at this place.
    Host(Extent),
    /// A read of zeroes, all of it.
    Zero,
    /// Several places: [`Format::pieces`].
    Pieces,
    /// Metadata work first: [`Format::start_slow`].
    Slow,
    /// Not now: the request waits, and the format wakes the queue.
    Busy,
}

/// Part of a request: `len` bytes from byte `at` of its data.
#[derive(Debug, PartialEq, Eq)]
pub struct Piece {
    pub at: u32,
    pub len: u32,
    pub place: Place,
}

/// Where a [`Piece`] is.
#[derive(Debug, PartialEq, Eq)]
pub enum Place {
    /// I/O there.
    Host(Extent),
    /// Reads as zeroes.
    Zero,
    /// These bytes, read already (compressed data, decompressed).
    Bytes(Vec<u8>),
    /// A write's part the format wrote already ([`Where::Written`]).
    Done,
}

/// The engine's place for a piece the disk mapped ([`Where`]), the one
/// translation between the two: data at a place in the chain's files, or
/// zeroes; None for [`Where::Slow`], which needs the metadata thread
/// first (and, for compressed data, becomes [`Place::Bytes`] there).
#[inline]
pub fn place(at: Where) -> Option<Place> {
    match at {
        Where::Data { file, offset } => Some(Place::Host(Extent {
            file: file as u32,
            offset,
        })),
        Where::Zero => Some(Place::Zero),
        Where::Written => Some(Place::Done),
        Where::Slow => None,
    }
}

/// A range the format resolved off the queue thread.
#[derive(Debug)]
pub struct Resolved {
    pub pieces: Vec<Piece>,
    /// For a write: what to commit after its data I/O.
    pub ticket: Option<Commit>,
}

/// How metadata work for a request ended.
#[derive(Debug)]
pub enum Slow {
    /// The range, resolved: do its I/O.
    Resolved(Resolved),
    /// Done (a commit, a discard, a write-zeroes): the request completes.
    Done,
    /// Failed (logged): the request completes with IOERR.
    Failed,
}

/// Maps guest ranges to places on the image (see the module doc). The
/// methods past `map` have empty defaults for a format that only ever
/// answers [`Mapping::Host`].
pub trait Format: Send {
    /// Where `len` bytes at guest byte `offset` are, for `op`. Every
    /// answer but [`Mapping::Busy`] is matched by one
    /// [`Format::finished`] when the request completes.
    fn map(&mut self, op: Op, offset: u64, len: u64) -> Mapping;

    /// Moves the pieces of the last [`Mapping::Pieces`] into `out`.
    fn pieces(&mut self, _out: &mut Vec<Piece>) {}

    /// A request the core took (after any answer but Busy) has completed.
    #[inline]
    fn finished(&mut self) {}

    /// The files the engine must register now, top first, if they changed
    /// since the last call (a snapshot put a new top above the chain).
    #[inline]
    fn files_changed(&mut self) -> Option<Vec<RawFd>> {
        None
    }

    /// How the core's completions arrive, given the engine's: a format
    /// whose slow path completes from another thread signals the same
    /// eventfd (or one of its own, for an engine that has none).
    fn completions(&mut self, engine: Completions) -> io::Result<Completions> {
        Ok(engine)
    }

    /// Starts the metadata work of request `tag`, which `map` answered
    /// [`Mapping::Slow`] for; `durable` (write-through): a write-zeroes or
    /// discard is on the disk when it is done. `data`: a write's buffers,
    /// which the format may write from itself ([`Place::Done`]); the
    /// request is in flight, and its buffers valid, until the answer is
    /// reaped.
    fn start_slow(
        &mut self,
        _tag: u32,
        _op: Op,
        _offset: u64,
        _len: u64,
        _durable: bool,
        _data: Option<GuestBuffers>,
    ) {
    }

    /// Starts the commit of `ticket` for request `tag`, whose data I/O is
    /// done; `durable` (a write-through write) makes it an fdatasync too.
    fn start_commit(&mut self, _tag: u32, _ticket: Commit, _durable: bool) {}

    /// Requests with metadata work under way.
    #[inline]
    fn slow_in_flight(&self) -> usize {
        0
    }

    /// Passes each finished piece of metadata work to `f`.
    #[inline]
    fn reap_slow(&mut self, _f: &mut dyn FnMut(u32, Slow)) {}

    /// Blocks until metadata work finishes, or the format lets waiting
    /// requests go, or a short while passes. For a queue draining with
    /// nothing on its engine.
    fn wait(&mut self) {}

    /// How the bytes of each file of the image's chain are transformed
    /// between the guest and the file (a LUKS image, an encrypted qcow2
    /// layer), by the file's index; None for a file whose bytes are the
    /// guest's, and empty when no file is encrypted. Asked when the core
    /// is made and whenever the files change ([`Format::files_changed`]).
    fn crypts(&self) -> Vec<Option<Arc<Crypt>>> {
        Vec::new()
    }
}

/// A raw image: the guest's disk is file 0, byte for byte.
#[derive(Clone, Copy, Debug, Default)]
pub struct Raw;

impl Format for Raw {
    #[inline]
    fn map(&mut self, _op: Op, offset: u64, _len: u64) -> Mapping {
        Mapping::Host(Extent { file: 0, offset })
    }
}

/// The format of the image a queue serves: raw, LUKS, or a chain of any
/// format ([`Live`]) through the per-queue [`ChainQueue`]. One type for
/// the worker, whatever the image;
/// a raw request costs one predictable branch more than [`Raw`] alone.
pub enum ImageFormat {
    Raw,
    Chain(Box<ChainQueue>),
    /// A LUKS image ([`super::luks`]): guest byte `o` is at `offset + o`
    /// in file 0 (`.0`), encrypted with `.1` (boxed: the enum stays as
    /// small as raw's path wants).
    Luks(Box<(u64, Arc<Crypt>)>),
}

impl ImageFormat {
    /// A queue's view of an image with a chain (`live`), whose metadata
    /// thread is `meta`.
    pub fn chain(live: Arc<Live>, meta: Meta) -> ImageFormat {
        ImageFormat::Chain(Box::new(ChainQueue::new(live, meta)))
    }
}

impl Format for ImageFormat {
    #[inline]
    fn map(&mut self, op: Op, offset: u64, len: u64) -> Mapping {
        match self {
            ImageFormat::Raw => Raw.map(op, offset, len),
            ImageFormat::Chain(q) => q.map(op, offset, len),
            ImageFormat::Luks(luks) => Mapping::Host(Extent {
                file: 0,
                // The request is inside the payload, which is inside the
                // file: no overflow.
                offset: luks.0 + offset,
            }),
        }
    }

    fn pieces(&mut self, out: &mut Vec<Piece>) {
        if let ImageFormat::Chain(q) = self {
            q.pieces(out);
        }
    }

    #[inline]
    fn finished(&mut self) {
        if let ImageFormat::Chain(q) = self {
            q.finished();
        }
    }

    #[inline]
    fn files_changed(&mut self) -> Option<Vec<RawFd>> {
        match self {
            ImageFormat::Raw | ImageFormat::Luks(_) => None,
            ImageFormat::Chain(q) => q.files_changed(),
        }
    }

    fn completions(&mut self, engine: Completions) -> io::Result<Completions> {
        match self {
            ImageFormat::Raw | ImageFormat::Luks(_) => Ok(engine),
            ImageFormat::Chain(q) => q.completions(engine),
        }
    }

    fn start_slow(
        &mut self,
        tag: u32,
        op: Op,
        offset: u64,
        len: u64,
        durable: bool,
        data: Option<GuestBuffers>,
    ) {
        if let ImageFormat::Chain(q) = self {
            q.start_slow(tag, op, offset, len, durable, data);
        }
    }

    fn start_commit(&mut self, tag: u32, ticket: Commit, durable: bool) {
        if let ImageFormat::Chain(q) = self {
            q.start_commit(tag, ticket, durable);
        }
    }

    #[inline]
    fn slow_in_flight(&self) -> usize {
        match self {
            ImageFormat::Raw | ImageFormat::Luks(_) => 0,
            ImageFormat::Chain(q) => q.slow_in_flight(),
        }
    }

    fn reap_slow(&mut self, f: &mut dyn FnMut(u32, Slow)) {
        if let ImageFormat::Chain(q) = self {
            q.reap_slow(f);
        }
    }

    fn wait(&mut self) {
        if let ImageFormat::Chain(q) = self {
            q.wait();
        }
    }

    fn crypts(&self) -> Vec<Option<Arc<Crypt>>> {
        match self {
            ImageFormat::Raw => Vec::new(),
            ImageFormat::Luks(luks) => vec![Some(luks.1.clone())],
            ImageFormat::Chain(q) => q.crypts(),
        }
    }
}

/// How an engine's completions arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completions {
    /// Each completion writes this eventfd: watch it next to the kick.
    /// `polling_pays`: busy-polling can catch completions before they
    /// would wake the thread (io_uring); not where they come from another
    /// thread's work long after a poll window ends (librbd), so that
    /// spinning only takes CPU from that thread: the worker then never
    /// busy-polls, whatever `--poll-us` says.
    Signalled { fd: RawFd, polling_pays: bool },
    /// Completions appear only when polled for (the engine's
    /// [`wait`](crate::engine::Engine::wait)), never through an eventfd
    /// (io_uring IOPOLL).
    Polled,
    /// Every request is finished inside `start` (the null engine):
    /// nothing to watch or wait for.
    Immediate,
}

impl Completions {
    /// The fd to watch, if any.
    pub fn fd(self) -> Option<RawFd> {
        match self {
            Completions::Signalled { fd, .. } => Some(fd),
            Completions::Polled | Completions::Immediate => None,
        }
    }

    /// Consumes the eventfd's count (nonblocking: nothing to consume is
    /// fine), so that only completions posted after this signal it again.
    pub fn consume(self) {
        if let Completions::Signalled { fd, .. } = self {
            let mut count = 0u64;
            // SAFETY: reads at most 8 bytes into `count`, 8 bytes on our
            // stack; the engine keeps the (nonblocking) eventfd open for
            // as long as its core, which the caller holds.
            let _ = unsafe { libc::read(fd, (&raw mut count).cast(), 8) };
        }
    }

    /// Whether the worker must call the engine's
    /// [`wait`](crate::engine::Engine::wait) while requests are in flight:
    /// nothing else would bring their completions.
    pub fn must_poll(self) -> bool {
        self == Completions::Polled
    }

    /// Whether busy-polling for completions can pay (see
    /// [`Completions::Signalled`]).
    pub fn polling_pays(self) -> bool {
        match self {
            Completions::Signalled { polling_pays, .. } => polling_pays,
            Completions::Polled | Completions::Immediate => true,
        }
    }
}
