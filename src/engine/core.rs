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
//! - the engine starts it; what it finishes at once waits in `done`;
//! - before a write, discard or write-zeroes goes to the engine, its range
//!   is marked in the device's dirty bitmaps and, during a backup, the old
//!   data it overwrites is copied first ([`Core::before_write`]);
//! - as each request is reaped: whether the image now has changes that are
//!   not flushed (so that a stopping ring flushes only when it must), the
//!   bytes it wrote into the guest's buffers, and those bytes marked in
//!   the dirty log while a migration runs (the engine, the kernel or a
//!   bounce copy wrote them behind vm-memory's back).

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;

use super::format::{Extent, Mapping};
use super::{Completion, Completions, Engine, Format, Full, Io, Raw, Start};
use crate::device::{Device, Targets};
use crate::virtio::{GuestMem, Op, Request, Status};

/// A queue's engine, with the bookkeeping every engine needs (see the
/// module doc). It lives as long as the daemon: connections borrow it.
pub struct Core<E, F = Raw> {
    engine: E,
    format: F,
    device: Arc<Device>,
    completions: Completions,
    /// Finished without going through the engine's reap, not yet reaped
    /// here; with what the engine holds, never more than `capacity`.
    done: VecDeque<(Request, Status)>,
    /// The most requests in flight at once: the engine's room when idle.
    capacity: usize,
    /// A change to the image (write, discard, write-zeroes) completed
    /// since the last flush that completed.
    unflushed: bool,
    /// The bitmaps and backup each change goes through first, and their
    /// number (see [`Core::before_write`]).
    targets: (u64, Arc<Targets>),
}

impl<E: Engine> Core<E> {
    /// A core over `engine` (idle) for a raw image of `device`.
    pub fn new(engine: E, device: Arc<Device>) -> Core<E> {
        Core::with_format(engine, Raw, device)
    }
}

impl<E: Engine, F: Format> Core<E, F> {
    /// A core over `engine` (idle) for an image of `format`.
    pub fn with_format(engine: E, format: F, device: Arc<Device>) -> Core<E, F> {
        let capacity = engine.room();
        Core {
            completions: engine.completions(),
            engine,
            format,
            device,
            done: VecDeque::with_capacity(capacity),
            capacity,
            unflushed: false,
            targets: Default::default(),
        }
    }

    /// Takes `req`; it comes back exactly once from [`Core::reap`]. Gives
    /// it back untouched when there is no room.
    pub fn submit(&mut self, req: Request) -> Result<(), Full> {
        if self.room() == 0 {
            return Err(Full(req));
        }
        let Some(op) = req.kind().class().op else {
            // GET_ID: its buffers are device-writable.
            req.data().fill_from(self.device.serial());
            self.done.push_back((req, Status::Ok));
            return Ok(());
        };
        let range = match op {
            Op::Read | Op::Write if req.data_len() == 0 => {
                self.done.push_back((req, Status::Ok));
                return Ok(());
            }
            Op::Read => Some((req.offset(), u64::from(req.data_len()))),
            Op::Write => {
                let (offset, len) = (req.offset(), u64::from(req.data_len()));
                self.before_write(offset, len);
                Some((offset, len))
            }
            Op::Discard(r) | Op::WriteZeroes(r) => {
                self.before_write(r.offset(), r.len());
                Some((r.offset(), r.len()))
            }
            Op::Flush => None,
        };
        let at = match range.map(|(offset, len)| self.format.map(op, offset, len)) {
            Some(Mapping::Host(at)) => at,
            None => Extent::default(),
        };
        let fua = !self.device.writeback();
        match self.engine.start(Io::new(req, op, at, fua)) {
            Start::Submitted => {}
            Start::Done(io, status) => self.done.push_back((io.into_request(), status)),
            Start::Full(io) => return Err(Full(io.into_request())),
        }
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

    /// Hands everything submitted since the last call to the kernel.
    /// Returns how many operations went.
    pub fn commit(&mut self) -> io::Result<u32> {
        self.engine.commit()
    }

    /// Passes every completion available now to `f`. Returns how many.
    pub fn reap(&mut self, mut f: impl FnMut(Completion)) -> u32 {
        let mut n = 0;
        let (device, unflushed) = (&self.device, &mut self.unflushed);
        while let Some((req, status)) = self.done.pop_front() {
            f(completed(device, unflushed, req, status));
            n += 1;
        }
        n + self.engine.reap(|io, status| {
            f(completed(device, unflushed, io.into_request(), status));
        })
    }

    /// How many more requests `submit` takes now.
    pub fn room(&self) -> usize {
        let free = self.capacity.saturating_sub(self.in_flight());
        self.engine.room().min(free)
    }

    /// Requests taken and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.engine.in_flight() + self.done.len()
    }

    /// Blocks until a completion can be reaped. Returns at once when one
    /// can, or nothing is in flight.
    pub fn wait(&mut self) -> io::Result<()> {
        if !self.done.is_empty() {
            return Ok(());
        }
        self.engine.wait()
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
    use crate::engine::format::Extent;
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
        let mut core = Core::with_format(Recorder::default(), Shifted, dev.clone());
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
