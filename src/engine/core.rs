//! One queue's engine core: what every engine needs, done once (after
//! cloud-hypervisor's `block/src/io/async_io/completion.rs`,
//! `CompletionCommon`).
//!
//! The worker hands each validated request to [`Core::submit`] and takes
//! completions from [`Core::reap`]; in between:
//! - GET_ID is answered here (the device's serial), and an empty read or
//!   write finishes here: neither is I/O;
//! - the queue's [`Format`] maps the request's range to a place on the
//!   image, and the device's write cache decides whether a write is
//!   write-through ([`Io::fua`]);
//! - before a write, discard or write-zeroes is mapped, its range (the
//!   guest's, whatever places the format splits it into) is marked in the
//!   device's dirty bitmaps and, during a backup, the old data it
//!   overwrites is copied first ([`Core::before_write`]);
//! - one place: the engine starts it; what it finishes at once waits in
//!   `done`;
//! - reads of zeroes finish here; a request in several places (pieces)
//!   or waiting for metadata work (slow) is *tracked*: it waits in a slab
//!   while its pieces go to the engine, each over its part of the
//!   request's buffers (pieces the engine has no room for wait in
//!   `queued`), and completes when the last is back and, for a write that
//!   allocated, its metadata is committed (see [`crate::disk::seam`]);
//! - as each request is reaped: whether the image now has changes that are
//!   not flushed (so that a stopping ring flushes only when it must), the
//!   bytes it wrote into the guest's buffers, and those bytes marked in
//!   the dirty log while a migration runs (the engine, the kernel or a
//!   bounce copy wrote them behind vm-memory's back).
//!
//! An encrypted disk (its format's [`Format::crypts`]: a transform per
//! file of the image's chain, where that file is encrypted): a write to an
//! encrypted file, whole or each piece, is gathered from the guest's
//! buffers into a private buffer of the queue's pool and encrypted there
//! for its place, and the engine writes that (an `Io` over the buffer,
//! `GuestBuffers::private`); the request is tracked, and owns its buffers
//! until they are back (`Tracked::staged`). A write-zeroes becomes a write
//! of encrypted zeroes; a read from an encrypted file is decrypted in
//! place in the guest's buffers as the engine gives it back, piece by
//! piece, before the completion is published. The one place the data
//! path transforms bytes; reads off the data path (the backup view, its
//! copy-before-write, a qcow2 image's copy-on-write) decrypt in the
//! disk's reader (`crate::disk::reader`), with the same [`Crypt`]s.
//!
//! Accounting: `in_flight` counts requests (taken and not yet reaped),
//! whatever number of pieces they became, so the worker's view (room,
//! draining) is in requests; the engine's own room bounds the pieces.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;

use slab::Slab;

use super::bounce::{NoBuf, Pool, Staged};
use super::{Completion, Completions, Engine, Format, Full, ImageFormat, Io, Start};
use crate::device::{Device, Targets};
use crate::disk::Commit;
use crate::disk::luks::Crypt;
use crate::disk::seam::{Extent, Mapping, Piece, Place, Slow};
use crate::metrics::RateLimiter;
use crate::virtio::{GuestBuffers, GuestMem, Op, Request, SpareIovecs, Status};
use crate::warn_limited;

/// A queue's engine, with the bookkeeping every engine needs (see the
/// module doc). It lives as long as the daemon: connections borrow it.
pub struct Core<E, F = ImageFormat> {
    /// Declared first, so dropped first: every engine's drop waits for
    /// its I/O, which must be over before the staged buffers `tracked`
    /// owns go.
    engine: E,
    format: F,
    device: Arc<Device>,
    completions: Completions,
    /// Finished without going through the engine's reap, not yet reaped
    /// here, each with whether the format mapped it (and so must hear of
    /// its end).
    done: VecDeque<(Request, Status, bool)>,
    /// The most requests in flight at once: the engine's room when idle.
    capacity: usize,
    /// Requests taken and not yet reaped.
    in_flight: usize,
    /// Requests in several pieces or waiting for metadata work.
    tracked: Slab<Tracked>,
    /// Pieces of tracked requests the engine had no room for, oldest
    /// first.
    queued: VecDeque<Io>,
    /// Scratch: pieces of a mapping, engine completions of tracked
    /// requests, answers of the format's slow path.
    pieces: Vec<Piece>,
    reaped: Vec<(Io, Status)>,
    answers: Vec<(u32, Slow)>,
    /// Metadata answers were taken in the last [`Core::reap`]: their
    /// requests' data I/O may wait unsubmitted ([`Core::answered`]).
    answered: bool,
    /// A change to the image (write, discard, write-zeroes) completed
    /// since the last flush that completed.
    unflushed: bool,
    log_limit: RateLimiter,
    /// The bitmaps and backup each change goes through first, and their
    /// number (see [`Core::before_write`]).
    targets: (u64, Arc<Targets>),
    /// An encrypted disk's transforms, by file of its chain (see the
    /// module doc; empty: no file is encrypted), and the private buffers
    /// its writes are encrypted into.
    crypts: Vec<Option<Arc<Crypt>>>,
    pool: Pool,
    /// Iovec vectors of pieces that came back, for the next staged
    /// buffers to reuse.
    spare_iovecs: SpareIovecs,
    /// Reused for a read whose buffers split a sector (see
    /// [`decrypt_read`]).
    scratch: Vec<u8>,
}

/// A request the core tracks (see the module doc).
struct Tracked {
    /// The request; `None` while it is on the engine whole (as its only
    /// piece).
    req: Option<Request>,
    op: Op,
    fua: bool,
    /// Pieces on the engine or in `queued`.
    left: u32,
    status: Status,
    /// What to commit once its data I/O is done.
    ticket: Option<Commit>,
    /// An encrypted disk's write: the private buffers its pieces write
    /// from (ciphertext), owned here until the request finishes, so until
    /// every piece over them is back from the engine.
    staged: Vec<Staged>,
}

impl<E: Engine> Core<E> {
    /// A core over `engine` (idle) for a raw image of `device`.
    pub fn new(engine: E, device: Arc<Device>) -> Core<E> {
        Core::with_format(engine, ImageFormat::Raw, device)
            .unwrap_or_else(|_| unreachable!("a raw image takes any engine's completions"))
    }
}

impl<E: Engine, F: Format> Core<E, F> {
    /// A core over `engine` (idle) for an image of `format`. Fails when
    /// the format cannot work with the engine's completions (qcow2 with
    /// IOPOLL), or cannot set up its own.
    pub fn with_format(engine: E, mut format: F, device: Arc<Device>) -> io::Result<Core<E, F>> {
        let capacity = engine.room();
        Ok(Core {
            completions: format.completions(engine.completions())?,
            crypts: format.crypts(),
            pool: Pool::new(crate::virtio::request::MAX_DATA_BYTES as usize),
            spare_iovecs: SpareIovecs::new(SPARE_IOVECS),
            scratch: Vec::new(),
            engine,
            format,
            device,
            done: VecDeque::with_capacity(capacity),
            capacity,
            in_flight: 0,
            tracked: Slab::new(),
            queued: VecDeque::new(),
            pieces: Vec::new(),
            reaped: Vec::new(),
            answers: Vec::new(),
            answered: false,
            unflushed: false,
            log_limit: RateLimiter::new(10, std::time::Duration::from_secs(5)),
            targets: Default::default(),
        })
    }

    /// Takes `req`; it comes back exactly once from [`Core::reap`]. Gives
    /// it back untouched when there is no room (or the format says not
    /// now).
    pub fn submit(&mut self, req: Request) -> Result<(), Full> {
        if self.room() == 0 {
            return Err(Full(req));
        }
        let Some(op) = req.kind().class().op else {
            // GET_ID: its buffers are device-writable.
            req.data().fill_from(self.device.serial());
            self.take_done(req, Status::Ok, false);
            return Ok(());
        };
        let (offset, len) = match op {
            Op::Read | Op::Write if req.data_len() == 0 => {
                self.take_done(req, Status::Ok, false);
                return Ok(());
            }
            Op::Read | Op::Write => (req.offset(), u64::from(req.data_len())),
            Op::Discard(r) | Op::WriteZeroes(r) => (r.offset(), r.len()),
            Op::Flush => (0, 0),
        };
        if matches!(op, Op::Write | Op::Discard(_) | Op::WriteZeroes(_)) {
            // Before the format maps it: the guest's range, once, however
            // many places it becomes. A request given back (Full, Busy)
            // comes again and is marked again, which changes nothing.
            self.before_write(offset, len);
        }
        let mapping = self.format.map(op, offset, len);
        if let Some(fds) = self.format.files_changed() {
            self.files_changed(&fds);
        }
        let fua = !self.device.writeback();
        match mapping {
            Mapping::Host(at) if !self.crypts.is_empty() => {
                return self.submit_encrypted(req, op, at, len, fua);
            }
            Mapping::Host(at) => match self.engine.start(Io::new(req, op, at, fua)) {
                Start::Submitted => {}
                Start::Done(io, status) => {
                    let req = io.into_request().expect("an untracked Io is a request");
                    self.done.push_back((req, status, true));
                }
                Start::Full(io) => {
                    self.format.finished();
                    return Err(Full(
                        io.into_request().expect("an untracked Io is a request"),
                    ));
                }
            },
            Mapping::Zero => {
                // A read: its buffers are device-writable.
                req.data().zero();
                self.done.push_back((req, Status::Ok, true));
            }
            Mapping::Busy => return Err(Full(req)),
            Mapping::Pieces => {
                let tag = self.track(req, op, fua);
                let mut pieces = std::mem::take(&mut self.pieces);
                self.format.pieces(&mut pieces);
                self.start_pieces(tag, &mut pieces);
                self.pieces = pieces;
            }
            Mapping::Slow => self.start_slow(req, op, offset, len, fua),
        }
        self.in_flight += 1;
        Ok(())
    }

    /// `req` needs the format's metadata work first. A write's buffers go
    /// along: the format may write them itself (with the copy-on-write of
    /// a cluster it allocates). Out of line: the submit path stays as it
    /// was for requests that map at once.
    #[cold]
    #[inline(never)]
    fn start_slow(&mut self, req: Request, op: Op, offset: u64, len: u64, fua: bool) {
        let data = (op == Op::Write).then(|| req.data().slice(0, req.data_len()));
        let tag = self.track(req, op, fua);
        self.format.start_slow(tag, op, offset, len, fua, data);
    }

    /// The image's chain changed (a snapshot): the engine registers the
    /// new files, and their transforms are taken anew.
    #[cold]
    #[inline(never)]
    fn files_changed(&mut self, fds: &[std::os::fd::RawFd]) {
        if let Err(e) = self.engine.set_files(fds) {
            // The new chain's data I/O would go to the old files.
            warn_limited!(self.log_limit, "registering the image's files: {e}");
        }
        self.crypts = self.format.crypts();
    }

    /// [`Core::submit`] on an encrypted disk, for a request at one place
    /// `at`: a write's data, or a write-zeroes' zeroes, go encrypted
    /// through a staged buffer when that place's file is encrypted; a
    /// read is decrypted as it comes back ([`decrypt_io`]).
    #[cold]
    #[inline(never)]
    fn submit_encrypted(
        &mut self,
        req: Request,
        op: Op,
        at: Extent,
        len: u64,
        fua: bool,
    ) -> Result<(), Full> {
        let Some(crypt) = crypt_of(&self.crypts, at.file).cloned() else {
            // A file of the chain that is not encrypted.
            return self.start_one(Io::new(req, op, at, fua));
        };
        let sector = crypt.sector_size() as u64;
        let rw = matches!(op, Op::Read | Op::Write | Op::WriteZeroes(_));
        if rw && !len.is_multiple_of(sector) {
            // The parser refuses what is not whole logical blocks, and the
            // logical block is a multiple of the sector: not reached. (An
            // offset off the sector grid is refused by the transform.)
            return self.refuse(req);
        }
        if !matches!(op, Op::Write | Op::WriteZeroes(_)) {
            return self.start_one(Io::new(req, op, at, fua));
        }
        let n = len as usize;
        let mut staged = match self.pool.take(n) {
            Ok(staged) => staged,
            Err(NoBuf::Wait) => {
                self.format.finished();
                return Err(Full(req));
            }
            Err(NoBuf::Fail) => {
                warn_limited!(self.log_limit, "no buffer for a {n}-byte encrypted write");
                return self.refuse(req);
            }
        };
        let bytes = staged.as_mut_slice();
        if op == Op::Write {
            req.data().gather_into(bytes);
        } else {
            // Zeroes the guest reads back: encrypted zeroes (a hole would
            // decrypt to noise).
            bytes.fill(0);
        }
        if let Err(e) = crypt.encrypt(at.offset, bytes) {
            self.pool.give(staged);
            warn_limited!(self.log_limit, "encrypting a write: {e}");
            return self.refuse(req);
        }
        // Tracked: the request owns its staged buffer until the write is
        // back (`Tracked::staged`), and the engine writes that.
        let mem = req.data().mem().clone();
        let tag = self.track(req, Op::Write, fua);
        let part = staged_buffers(&mem, self.spare_iovecs.take(), &staged);
        let t = &mut self.tracked[tag as usize];
        t.staged.push(staged);
        t.left = 1;
        self.start_piece(Io::tracked(None, Some(part), Op::Write, at, fua, tag));
        self.in_flight += 1;
        Ok(())
    }

    /// Starts an untracked `io` on an encrypted disk (a read, or a write to
    /// a file that is not encrypted): what the engine finishes at once is
    /// decrypted now.
    fn start_one(&mut self, io: Io) -> Result<(), Full> {
        match self.engine.start(io) {
            Start::Submitted => {}
            Start::Done(mut io, status) => {
                let status = decrypt_io(&self.crypts, &mut self.scratch, &mut io, status);
                let req = io.into_request().expect("an untracked Io is a request");
                self.done.push_back((req, status, true));
            }
            Start::Full(io) => {
                self.format.finished();
                return Err(Full(
                    io.into_request().expect("an untracked Io is a request"),
                ));
            }
        }
        self.in_flight += 1;
        Ok(())
    }

    /// Finishes a request the format mapped with IOERR, without I/O.
    fn refuse(&mut self, req: Request) -> Result<(), Full> {
        self.take_done(req, Status::IoErr, true);
        Ok(())
    }

    /// What a change to the image does before it reaches it: its range
    /// marked in the dirty bitmaps, and during a backup the old data it
    /// overwrites copied first ([`crate::device::tracking`]). Before the
    /// engine starts it, so that a write that reached the image is in the
    /// bitmaps even if the daemon dies before it completes (and so before
    /// its completion is published). With nothing to do, one relaxed load.
    #[inline]
    fn before_write(&mut self, offset: u64, len: u64) {
        let generation = self.device.tracking().generation();
        if generation != 0 {
            self.before_write_tracked(generation, offset, len);
        }
    }

    #[cold]
    fn before_write_tracked(&mut self, generation: u64, offset: u64, len: u64) {
        if self.targets.0 != generation {
            self.targets = self.device.tracking().targets();
        }
        self.targets.1.before_write(offset, len);
    }

    /// A request finished without I/O, taken now.
    fn take_done(&mut self, req: Request, status: Status, mapped: bool) {
        self.done.push_back((req, status, mapped));
        self.in_flight += 1;
    }

    fn track(&mut self, req: Request, op: Op, fua: bool) -> u32 {
        self.tracked.insert(Tracked {
            req: Some(req),
            op,
            fua,
            left: 0,
            status: Status::Ok,
            ticket: None,
            staged: Vec::new(),
        }) as u32
    }

    /// Starts the I/O of tracked request `tag`'s `pieces` (emptied): reads
    /// of zeroes and bytes read already are copied here, the others go to
    /// the engine (or wait for room). Finishes the stage when none is
    /// left.
    fn start_pieces(&mut self, tag: u32, pieces: &mut Vec<Piece>) {
        let t = &mut self.tracked[tag as usize];
        let Some(req) = t.req.take() else {
            unreachable!("a request's pieces start while the core holds it");
        };
        let (op, fua) = (t.op, t.fua);
        let hosts = pieces
            .iter()
            .filter(|p| matches!(p.place, Place::Host(_)))
            .count();
        let data_len = req.data_len();
        let whole = |p: &Piece| p.at == 0 && p.len == data_len;
        let mut ios = Vec::new();
        let mut req = Some(req);
        let mut status = Status::Ok;
        for p in pieces.drain(..) {
            match p.place {
                Place::Host(at) => {
                    let io = if hosts == 1 && whole(&p) {
                        // One piece, all of it: the request itself goes.
                        Io::tracked(req.take(), None, op, at, fua, tag)
                    } else {
                        let Some(r) = &req else { unreachable!() };
                        let part = r.data().slice(p.at, p.len);
                        Io::tracked(None, Some(part), op, at, fua, tag)
                    };
                    let io = match crypt_of(&self.crypts, at.file) {
                        Some(c) if op == Op::Write => match stage(&mut self.pool, c, &io) {
                            Ok(staged) => {
                                // The request, or its part, is not needed
                                // by the write: back to the core.
                                let spare = self.spare_iovecs.take();
                                let part = staged_buffers(io.data().mem(), spare, &staged);
                                if let Some(r) = io.into_request() {
                                    req = Some(r);
                                }
                                self.tracked[tag as usize].staged.push(staged);
                                Io::tracked(None, Some(part), op, at, fua, tag)
                            }
                            Err(e) => {
                                warn_limited!(self.log_limit, "encrypting a write: {e}");
                                if let Some(r) = io.into_request() {
                                    req = Some(r);
                                }
                                status = Status::IoErr;
                                continue;
                            }
                        },
                        _ => io,
                    };
                    ios.push(io);
                }
                Place::Zero => {
                    if let Some(r) = &req {
                        r.data().zero_at(p.at, p.len);
                    }
                }
                Place::Bytes(b) => {
                    if let Some(r) = &req {
                        r.data().fill_at(p.at, &b);
                    }
                }
                Place::Done => {}
            }
        }
        let t = &mut self.tracked[tag as usize];
        t.req = req;
        if !status.is_ok() {
            t.status = status;
        }
        t.left = ios.len() as u32;
        if ios.is_empty() {
            self.after_io(tag);
            return;
        }
        for io in ios {
            self.start_piece(io);
        }
    }

    /// One piece to the engine, or to the back of `queued`.
    fn start_piece(&mut self, io: Io) {
        if !self.queued.is_empty() {
            self.queued.push_back(io);
            return;
        }
        match self.engine.start(io) {
            Start::Submitted => {}
            Start::Done(io, status) => self.piece_done(io, status),
            Start::Full(io) => self.queued.push_back(io),
        }
    }

    /// Starts what waits in `queued` while the engine has room.
    fn start_queued(&mut self) {
        while let Some(io) = self.queued.pop_front() {
            match self.engine.start(io) {
                Start::Submitted => {}
                Start::Done(io, status) => self.piece_done(io, status),
                Start::Full(io) => {
                    self.queued.push_front(io);
                    return;
                }
            }
        }
    }

    /// A piece of a tracked request came back from the engine.
    fn piece_done(&mut self, mut io: Io, status: Status) {
        let tag = io.tag();
        let status = if self.crypts.is_empty() {
            status
        } else {
            decrypt_io(&self.crypts, &mut self.scratch, &mut io, status)
        };
        let req = match io.into_inner() {
            Ok(req) => Some(req),
            Err(part) => {
                self.spare_iovecs.give_buffers(part);
                None
            }
        };
        let Some(t) = self.tracked.get_mut(tag as usize) else {
            warn_limited!(self.log_limit, "a piece of unknown request {tag}");
            return;
        };
        if let Some(req) = req {
            t.req = Some(req);
        }
        if !status.is_ok() {
            t.status = status;
        }
        t.left -= 1;
        if t.left == 0 {
            self.after_io(tag);
        }
    }

    /// Tracked request `tag`'s data I/O is done: commit what its
    /// allocation needs, or finish it.
    fn after_io(&mut self, tag: u32) {
        let t = &mut self.tracked[tag as usize];
        if t.status.is_ok()
            && let Some(ticket) = t.ticket.take()
        {
            self.format.start_commit(tag, ticket, t.fua);
            return;
        }
        self.finish(tag);
    }

    /// Tracked request `tag` is done.
    fn finish(&mut self, tag: u32) {
        let mut t = self.tracked.remove(tag as usize);
        for buf in t.staged.drain(..) {
            self.pool.give(buf);
        }
        let Some(req) = t.req else {
            unreachable!("a tracked request finishes with its pieces back");
        };
        self.done.push_back((req, t.status, true));
    }

    /// The format's metadata work for tracked request `tag` ended.
    fn slow_done(&mut self, tag: u32, answer: Slow) {
        let Some(t) = self.tracked.get_mut(tag as usize) else {
            warn_limited!(self.log_limit, "metadata work for unknown request {tag}");
            return;
        };
        match answer {
            Slow::Resolved(r) => {
                t.ticket = r.ticket;
                let mut pieces = r.pieces;
                self.start_pieces(tag, &mut pieces);
            }
            Slow::Done => self.finish(tag),
            Slow::Failed => {
                t.status = Status::IoErr;
                self.finish(tag);
            }
        }
    }

    /// Hands everything submitted since the last call to the kernel.
    /// Returns how many operations went.
    pub fn commit(&mut self) -> io::Result<u32> {
        if !self.queued.is_empty() {
            self.start_queued();
        }
        self.engine.commit()
    }

    /// Whether the last [`Core::reap`] took metadata answers, whose
    /// requests' data I/O it started: the caller commits before it sleeps
    /// (no eventfd announces it when the format answered on this thread).
    #[inline]
    pub fn answered(&mut self) -> bool {
        std::mem::take(&mut self.answered)
    }

    /// Passes every completion available now to `f`. Returns how many.
    pub fn reap(&mut self, mut f: impl FnMut(Completion)) -> u32 {
        if self.format.slow_in_flight() > 0 {
            let mut answers = std::mem::take(&mut self.answers);
            self.format
                .reap_slow(&mut |tag, answer| answers.push((tag, answer)));
            self.answered = !answers.is_empty();
            for (tag, answer) in answers.drain(..) {
                self.slow_done(tag, answer);
            }
            self.answers = answers;
        }
        let mut n = 0;
        let (device, unflushed) = (&self.device, &mut self.unflushed);
        let (format, reaped) = (&mut self.format, &mut self.reaped);
        let (crypts, scratch) = (&self.crypts, &mut self.scratch);
        self.engine.reap(|mut io, status| {
            if io.tag() != Io::UNTRACKED {
                reaped.push((io, status));
                return;
            }
            let status = if crypts.is_empty() {
                status
            } else {
                decrypt_io(crypts, scratch, &mut io, status)
            };
            let req = io.into_request().expect("an untracked Io is a request");
            format.finished();
            f(completed(device, unflushed, req, status));
            n += 1;
        });
        if !self.reaped.is_empty() {
            let mut reaped = std::mem::take(&mut self.reaped);
            for (io, status) in reaped.drain(..) {
                self.piece_done(io, status);
            }
            self.reaped = reaped;
            self.start_queued();
        }
        let (device, unflushed) = (&self.device, &mut self.unflushed);
        while let Some((req, status, mapped)) = self.done.pop_front() {
            if mapped {
                self.format.finished();
            }
            f(completed(device, unflushed, req, status));
            n += 1;
        }
        self.in_flight -= n as usize;
        n
    }

    /// Whether the disk is encrypted (its requests go through the
    /// transform, with the key schedule on this thread's stack meanwhile).
    pub fn encrypted(&self) -> bool {
        !self.crypts.is_empty()
    }

    /// How many more requests `submit` takes now.
    pub fn room(&self) -> usize {
        if !self.queued.is_empty() {
            return 0;
        }
        let free = self.capacity.saturating_sub(self.in_flight);
        self.engine.room().min(free)
    }

    /// Requests taken and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Blocks until a completion can be reaped, or (with nothing on the
    /// engine) the format's metadata work finishes or it lets waiting
    /// requests go, or a short while passes. Returns at once when a
    /// completion can be reaped, or nothing is in flight.
    pub fn wait(&mut self) -> io::Result<()> {
        if !self.done.is_empty() {
            return Ok(());
        }
        if self.engine.in_flight() > 0 {
            return self.engine.wait();
        }
        self.format.wait();
        Ok(())
    }

    /// How completions arrive (see [`Completions`]).
    pub fn completions(&self) -> Completions {
        self.completions
    }

    /// Guest memory changed; requests in flight keep their own snapshot.
    pub fn set_memory(&mut self, mem: &Arc<GuestMem>) {
        self.engine.set_memory(mem);
    }

    /// Makes everything completed so far durable on the image (the ring
    /// stops; the next reader may be another process, on another host).
    /// A flush only when a change completed since the last one.
    pub fn make_durable(&mut self) -> io::Result<()> {
        if self.unflushed {
            self.engine.flush()?;
            self.unflushed = false;
        }
        Ok(())
    }

    /// The connection is over and nothing is in flight (see
    /// [`Engine::reset`]). What the targets kept alive goes too.
    pub fn reset(&mut self) {
        self.engine.reset();
        self.targets = Default::default();
    }
}

/// The most iovec vectors the core keeps for reuse: a queue's pieces in
/// flight at once, about.
const SPARE_IOVECS: usize = 256;

/// The transform of file `file` of an encrypted disk's chain, if that
/// file is encrypted.
#[inline]
fn crypt_of(crypts: &[Option<Arc<Crypt>>], file: u32) -> Option<&Arc<Crypt>> {
    crypts.get(file as usize).and_then(Option::as_ref)
}

/// The staged buffer of a write `io` to an encrypted file: its bytes
/// gathered from the guest's buffers into a private buffer of `pool` and
/// encrypted there for its place. A piece of a tracked request may not
/// wait for the pool (its other pieces are on their way): past the pool's
/// limit it gets a buffer of its own.
fn stage(pool: &mut Pool, crypt: &Crypt, io: &Io) -> Result<Staged, String> {
    let n = io.data().len() as usize;
    let Ok(mut staged) = pool.take_or_spare(n) else {
        return Err(format!("no buffer for a {n}-byte encrypted write"));
    };
    let bytes = staged.as_mut_slice();
    io.data().gather_into(bytes);
    if let Err(e) = crypt.encrypt(io.at().offset, bytes) {
        pool.give(staged);
        return Err(e.to_string());
    }
    Ok(staged)
}

/// Buffers over `staged`'s bytes, for the engine to write from: private
/// memory, which the tracked request that holds `staged` keeps until its
/// pieces are back.
fn staged_buffers(mem: &Arc<GuestMem>, iovecs: Vec<libc::iovec>, staged: &Staged) -> GuestBuffers {
    let bytes = staged.as_slice();
    // SAFETY: `staged` is boxed and goes into its request's
    // `Tracked::staged` (the caller's next step), which keeps it, unmoved
    // (a heap buffer) and unwritten, until the request finishes, which is
    // after every piece over these buffers came back from the engine
    // (`piece_done`); a core dropped with pieces in flight drops its
    // engine first (a field declared before `tracked`), and an engine's
    // drop waits for its I/O.
    unsafe { GuestBuffers::private(mem, iovecs, bytes.as_ptr(), bytes.len() as u32) }
}

/// `io` of an encrypted disk as the engine gives it back: a read that
/// succeeded from an encrypted file is decrypted in place in the guest's
/// buffers (IOERR if it cannot be), before its completion is published;
/// anything else is left as it is.
#[inline]
fn decrypt_io(
    crypts: &[Option<Arc<Crypt>>],
    scratch: &mut Vec<u8>,
    io: &mut Io,
    status: Status,
) -> Status {
    if !status.is_ok() || io.op() != Op::Read {
        return status;
    }
    let at = io.at();
    let Some(crypt) = crypt_of(crypts, at.file) else {
        return status;
    };
    match decrypt_buffers(crypt, scratch, at.offset, io.data_mut()) {
        Ok(()) => status,
        Err(_) => Status::IoErr,
    }
}

/// Decrypts a completed read in its guest buffers, read from file byte
/// `at`: each buffer in place where every one holds whole sectors (the
/// usual case: pages), else through `scratch` (a sector split across
/// buffers).
fn decrypt_buffers(
    crypt: &Crypt,
    scratch: &mut Vec<u8>,
    at: u64,
    data: &mut GuestBuffers,
) -> Result<(), crate::crypto::xts::XtsError> {
    let sector = crypt.sector_size();
    if data
        .iovecs()
        .iter()
        .all(|v| v.iov_len.is_multiple_of(sector))
    {
        let mut at = at;
        // SAFETY: the read's I/O into these buffers is over (the engine
        // gave back the Io that carried them: the request, or the part of
        // its buffers one piece covered, whose request the core holds),
        // and no Rust code of this process holds a view of them; each
        // slice is dropped before the next is taken. The bytes are guest
        // memory: the guest may write them while they are decrypted, and
        // so may the kernel, for a request or piece still in flight whose
        // buffers a hostile driver pointed at the same memory. That is outside what
        // a `&mut [u8]` promises, and the daemon relies on it being
        // harmless here as wherever it touches guest memory
        // (`GuestBuffers::fill_from`): `Crypt::decrypt` only computes over
        // the bytes (no address, length, index or branch depends on their
        // values; AES-NI, VAES and the software fallback are
        // constant-time), so a concurrent write can change only what the
        // guest reads back in the sectors it raced on, never which memory
        // this process touches.
        for slice in unsafe { data.slices_mut() } {
            crypt.decrypt(at, slice)?;
            at += slice.len() as u64;
        }
        return Ok(());
    }
    // Copied out and back (`gather_into`, `fill_from`) rather than as
    // overlapping slices: two buffers of one request may be the same
    // memory.
    let len = data.len() as usize;
    if scratch.len() < len {
        scratch.resize(len, 0);
    }
    let buf = &mut scratch[..len];
    data.gather_into(buf);
    crypt.decrypt(at, buf)?;
    data.fill_from(buf);
    Ok(())
}

/// The bookkeeping of a request finished with `status`: durability, the
/// bytes written into the guest, the dirty log.
#[inline]
fn completed(device: &Device, unflushed: &mut bool, req: Request, status: Status) -> Completion {
    let class = req.kind().class();
    if class.flushes && status.is_ok() {
        *unflushed = false;
    }
    *unflushed |= class.changes_image;
    let written = if status.is_ok() { req.written_len() } else { 0 };
    if written > 0 && device.logging() {
        // Written behind vm-memory's back: marked before the worker
        // publishes the completion, so before the guest, or the
        // migration, can see it.
        req.data().mark_written(written);
    }
    Completion {
        req,
        status,
        written,
    }
}

#[cfg(test)]
mod tests {
    use virtio_bindings::virtio_blk::{
        VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    };
    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::device::DeviceSpec;
    use crate::disk::seam::{Extent, Resolved};
    use crate::virtio::testing::{self, DATA, Driver, HDR, guest_memory, limits, r, status, w};

    /// Records what it is asked; completes on `reap`.
    #[derive(Default)]
    struct Recorder {
        started: Vec<(Op, Extent, bool)>,
        held: Vec<Io>,
        flushes: usize,
    }

    impl Engine for Recorder {
        fn start(&mut self, io: Io) -> Start {
            self.started.push((io.op(), io.at(), io.fua()));
            self.held.push(io);
            Start::Submitted
        }
        fn commit(&mut self) -> io::Result<u32> {
            Ok(0)
        }
        fn reap(&mut self, mut f: impl FnMut(Io, Status)) -> u32 {
            let n = self.held.len() as u32;
            self.held.drain(..).for_each(|io| f(io, Status::Ok));
            n
        }
        fn room(&self) -> usize {
            4 - self.held.len()
        }
        fn in_flight(&self) -> usize {
            self.held.len()
        }
        fn wait(&mut self) -> io::Result<()> {
            Ok(())
        }
        fn completions(&self) -> Completions {
            Completions::Immediate
        }
        fn flush(&mut self) -> io::Result<()> {
            self.flushes += 1;
            Ok(())
        }
    }

    /// Puts a format's mapping 1 MiB further into file 1.
    struct Shifted;
    impl Format for Shifted {
        fn map(&mut self, _op: Op, offset: u64, _len: u64) -> Mapping {
            Mapping::Host(Extent {
                file: 1,
                offset: offset + (1 << 20),
            })
        }
    }

    fn device() -> Arc<Device> {
        Arc::new(
            Device::new(DeviceSpec {
                limits: limits(),
                capacity_sectors: testing::CAPACITY,
                serial: *b"core-test-serial\0\0\0\0",
                ..DeviceSpec::default()
            })
            .unwrap(),
        )
    }

    fn request(
        d: &mut Driver,
        req_type: u32,
        sector: u64,
        descs: &[crate::virtio::testing::Desc],
    ) -> Request {
        d.header(req_type, sector);
        d.post(descs);
        d.parse(&limits()).unwrap()
    }

    fn reap_all<F: Format>(core: &mut Core<Recorder, F>) -> Vec<Completion> {
        let mut out = Vec::new();
        core.reap(|c| out.push(c));
        out
    }

    /// GET_ID never reaches the engine: the core answers it with the
    /// device's serial.
    #[test]
    fn get_id_is_answered_without_the_engine() {
        let mem = guest_memory();
        let mut d = Driver::new(&mem, 16);
        let mut core = Core::new(Recorder::default(), device());
        let req = request(
            &mut d,
            VIRTIO_BLK_T_GET_ID,
            0,
            &[r(HDR, 16), w(DATA, 20), status()],
        );
        core.submit(req).unwrap();
        assert!(core.engine.started.is_empty());
        let done = reap_all(&mut core);
        assert_eq!((done[0].status, done[0].written), (Status::Ok, 20));
        let id: [u8; 20] = mem.read_obj(GuestAddress(DATA)).unwrap();
        assert_eq!(&id, b"core-test-serial\0\0\0\0");
    }

    /// The format decides where the engine does the I/O; the write cache
    /// decides whether a write is write-through.
    #[test]
    fn the_format_maps_and_the_write_cache_sets_fua() {
        let mem = guest_memory();
        let mut d = Driver::new(&mem, 16);
        let dev = device();
        let mut core = Core::with_format(Recorder::default(), Shifted, dev.clone()).unwrap();
        let req = request(
            &mut d,
            VIRTIO_BLK_T_IN,
            8,
            &[r(HDR, 16), w(DATA, 512), status()],
        );
        core.submit(req).unwrap();
        dev.set_writeback(false);
        let req = request(
            &mut d,
            VIRTIO_BLK_T_OUT,
            16,
            &[r(HDR, 16), r(DATA, 512), status()],
        );
        core.submit(req).unwrap();
        let at = |offset| Extent { file: 1, offset };
        assert_eq!(
            core.engine.started,
            vec![
                (Op::Read, at((8 << 9) + (1 << 20)), false),
                (Op::Write, at((16 << 9) + (1 << 20)), true)
            ]
        );
        let done = reap_all(&mut core);
        assert_eq!(
            done.iter().map(|c| c.written).collect::<Vec<_>>(),
            vec![512, 0]
        );
    }

    /// Allocates every write: slow, resolved to file 0 with a ticket, then
    /// committed. Records whether the slow work and the commit were asked
    /// to be durable.
    #[derive(Default)]
    struct Allocating {
        answers: Vec<(u32, Slow)>,
        slow: Vec<bool>,
        commits: Vec<bool>,
    }
    impl Format for Allocating {
        fn map(&mut self, _op: Op, _offset: u64, _len: u64) -> Mapping {
            Mapping::Slow
        }
        fn start_slow(
            &mut self,
            tag: u32,
            _op: Op,
            offset: u64,
            len: u64,
            durable: bool,
            _data: Option<GuestBuffers>,
        ) {
            self.slow.push(durable);
            let pieces = vec![Piece {
                at: 0,
                len: len as u32,
                place: Place::Host(Extent { file: 0, offset }),
            }];
            let ticket = Some(Commit(1));
            self.answers
                .push((tag, Slow::Resolved(Resolved { pieces, ticket })));
        }
        fn start_commit(&mut self, tag: u32, _ticket: Commit, durable: bool) {
            self.commits.push(durable);
            self.answers.push((tag, Slow::Done));
        }
        fn slow_in_flight(&self) -> usize {
            self.answers.len()
        }
        fn reap_slow(&mut self, f: &mut dyn FnMut(u32, Slow)) {
            for (tag, answer) in self.answers.drain(..) {
                f(tag, answer);
            }
        }
    }

    /// With the write cache off, an allocating write's commit (and its
    /// slow work) is asked to be durable: the metadata it needs must be on
    /// the disk when it completes, not only its FUA data.
    #[test]
    fn a_write_through_allocation_commits_durably() {
        let mem = guest_memory();
        let mut d = Driver::new(&mem, 16);
        let dev = device();
        let mut core =
            Core::with_format(Recorder::default(), Allocating::default(), dev.clone()).unwrap();
        let write = &[r(HDR, 16), r(DATA, 512), status()];
        let mut done = Vec::new();
        for writeback in [true, false] {
            dev.set_writeback(writeback);
            core.submit(request(&mut d, VIRTIO_BLK_T_OUT, 8, write))
                .unwrap();
            // Resolve, data I/O, commit: a reap each.
            for _ in 0..3 {
                done.extend(reap_all(&mut core));
            }
        }
        assert_eq!(done.len(), 2, "both writes complete");
        assert!(done.iter().all(|c| c.status == Status::Ok));
        assert_eq!(core.format.slow, vec![false, true]);
        assert_eq!(core.format.commits, vec![false, true]);
        assert_eq!(
            core.engine.started.iter().map(|s| s.2).collect::<Vec<_>>(),
            vec![false, true],
            "the write-through write's data goes with FUA"
        );
    }

    /// A stopping ring flushes only when a change completed since the last
    /// flush.
    #[test]
    fn make_durable_flushes_only_unflushed_changes() {
        let mem = guest_memory();
        let mut d = Driver::new(&mem, 16);
        let mut core = Core::new(Recorder::default(), device());
        let read = &[r(HDR, 16), w(DATA, 512), status()];
        core.submit(request(&mut d, VIRTIO_BLK_T_IN, 0, read))
            .unwrap();
        reap_all(&mut core);
        core.make_durable().unwrap();
        assert_eq!(core.engine.flushes, 0, "a read changes nothing");
        let write = &[r(HDR, 16), r(DATA, 512), status()];
        core.submit(request(&mut d, VIRTIO_BLK_T_OUT, 0, write))
            .unwrap();
        reap_all(&mut core);
        core.make_durable().unwrap();
        core.make_durable().unwrap();
        assert_eq!(core.engine.flushes, 1);
        core.submit(request(&mut d, VIRTIO_BLK_T_OUT, 0, write))
            .unwrap();
        core.submit(request(
            &mut d,
            VIRTIO_BLK_T_FLUSH,
            0,
            &[r(HDR, 16), status()],
        ))
        .unwrap();
        reap_all(&mut core);
        core.make_durable().unwrap();
        assert_eq!(
            core.engine.flushes, 1,
            "the guest's flush covered the write"
        );
    }

    /// Encrypts and decrypts with a fixed key; maps every range to itself.
    struct Encrypted(Arc<Crypt>);
    impl Format for Encrypted {
        fn map(&mut self, _op: Op, offset: u64, _len: u64) -> Mapping {
            Mapping::Host(Extent { file: 0, offset })
        }
        fn crypts(&self) -> Vec<Option<Arc<Crypt>>> {
            vec![Some(self.0.clone())]
        }
    }

    fn crypt() -> Arc<Crypt> {
        let key = crate::crypto::key::Secret::from_slice(&[7u8; 64]).unwrap();
        let segment = crate::crypto::luks::Segment {
            offset: 0,
            size: None,
            sector_size: 512,
            iv_tweak: 0,
            key_bytes: 64,
        };
        Arc::new(Crypt::new(&key, &segment, 0).unwrap())
    }

    /// The guest bytes at `addrs` (address, length), one after the other.
    fn gather(mem: &GuestMem, addrs: &[(u64, usize)]) -> Vec<u8> {
        let mut out = Vec::new();
        for &(a, n) in addrs {
            let mut b = vec![0u8; n];
            mem.read_slice(&mut b, GuestAddress(a)).unwrap();
            out.extend(b);
        }
        out
    }

    /// An encrypted disk: the engine writes the staged ciphertext, not the
    /// guest's buffer (which is left as it was); a read is decrypted in
    /// the guest's buffers, also where a sector is split between two of
    /// them.
    #[test]
    fn an_encrypted_disk_writes_ciphertext_and_reads_plaintext() {
        let mem = guest_memory();
        let mut d = Driver::new(&mem, 16);
        let c = crypt();
        let mut core =
            Core::with_format(Recorder::default(), Encrypted(c.clone()), device()).unwrap();
        let plain: Vec<u8> = (0..1024u32).map(|i| (i * 7) as u8).collect();
        mem.write_slice(&plain, GuestAddress(DATA)).unwrap();
        let write = &[r(HDR, 16), r(DATA, 1024), status()];
        core.submit(request(&mut d, VIRTIO_BLK_T_OUT, 8, write))
            .unwrap();
        let mut want = plain.clone();
        c.encrypt(8 << 9, &mut want).unwrap();
        // What the engine writes: the Io's buffers, private memory.
        let written = {
            let data = core.engine.held[0].data();
            let mut b = vec![0u8; data.len() as usize];
            data.gather_into(&mut b);
            b
        };
        assert_eq!(written, want);
        assert_ne!(written, plain);
        assert_eq!(reap_all(&mut core)[0].status, Status::Ok);
        assert_eq!(
            gather(&mem, &[(DATA, 1024)]),
            plain,
            "the guest's buffer is not touched"
        );

        // Reads: the Recorder reads nothing, so the buffers decrypt what
        // they hold. Whole sectors per buffer, then one sector split 100 +
        // 412 across two buffers (through the core's scratch).
        let split = DATA + 0x4000;
        let layouts: [&[(u64, usize)]; 2] = [
            &[(DATA, 512), (DATA + 512, 512)],
            &[(DATA, 100), (split, 412), (DATA + 100, 512)],
        ];
        for layout in layouts {
            let held = gather(&mem, layout);
            let mut descs = vec![r(HDR, 16)];
            descs.extend(layout.iter().map(|&(a, n)| w(a, n as u32)));
            descs.push(status());
            core.submit(request(&mut d, VIRTIO_BLK_T_IN, 16, &descs))
                .unwrap();
            assert_eq!(reap_all(&mut core)[0].status, Status::Ok);
            let mut want = held.clone();
            c.decrypt(16 << 9, &mut want).unwrap();
            assert_eq!(gather(&mem, layout), want, "{} buffers", layout.len());
        }
    }

    /// What the core holds counts against the engine's room.
    #[test]
    fn room_counts_requests_finished_but_not_reaped() {
        let mem = guest_memory();
        let mut d = Driver::new(&mem, 16);
        let mut core = Core::new(Recorder::default(), device());
        for _ in 0..4 {
            let req = request(
                &mut d,
                VIRTIO_BLK_T_GET_ID,
                0,
                &[r(HDR, 16), w(DATA, 20), status()],
            );
            core.submit(req).unwrap();
        }
        assert_eq!((core.room(), core.in_flight()), (0, 4));
        let req = request(
            &mut d,
            VIRTIO_BLK_T_GET_ID,
            0,
            &[r(HDR, 16), w(DATA, 20), status()],
        );
        let Err(Full(back)) = core.submit(req) else {
            panic!("a fifth request fits a core of four");
        };
        assert_eq!(back.kind(), crate::virtio::RequestKind::GetId);
        assert_eq!(reap_all(&mut core).len(), 4);
        assert_eq!(core.room(), 4);
    }
}
