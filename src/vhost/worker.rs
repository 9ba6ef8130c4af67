//! One queue's worker: takes requests off the avail ring, runs them on the
//! engine, and puts completions on the used ring.
//!
//! A pass (`run`) goes, per iteration:
//! 1. with `--signal early`, reap completions and publish + signal them
//!    before anything else (cloud-hypervisor PR 7532);
//! 2. with kicks suppressed, pop up to `--max-batch` chains (as many as the
//!    engine has room for), parse and start them, and submit them with one
//!    io_uring_enter; while more are known to be there, go back to 1;
//! 3. publish what completed inline (errors, GET_ID) and, with
//!    `--signal late`, what the ring completed meanwhile;
//! 4. when the ring is empty: busy-poll for `--poll-us`, else re-enable
//!    kicks, re-check the ring, and only then sleep.
//!
//! Publishing writes all used elements, stores used->idx once (release),
//! decides once whether the guest wants an interrupt and writes the call
//! eventfd at most once (`--notify batched`).
//!
//! Why signalling early is safe: each used element is written before the
//! release store of used->idx that publishes it, and the driver reads
//! used->idx with acquire before it reads the elements, so it never sees an
//! index ahead of its elements, whenever the store happens. Signalling
//! more often than strictly needed only costs the guest an interrupt, which
//! the spec allows (drivers must tolerate spurious notifications).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use slab::Slab;
use vhost_user_backend::{VringMutex, VringState, VringT};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{
    Bytes, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryRegion,
};

use crate::cli::{EngineKind, NotifyMode, SignalMode};
use crate::io::{AlignedBuf, Uring, UringOptions, op};
use crate::metrics::{QueueMetrics, RateLimiter, RequestType};
use crate::virtio::request::{HostBuffers, Rejected};
use crate::virtio::ring::{RingError, RingShadow};
use crate::virtio::{DeviceLimits, GuestMem, Request, RequestKind};
use crate::warn_limited;

use super::inflight::InflightQueue;
use super::poll::AdaptivePoll;
use super::resubmit::replay_queue;

pub type Vring = VringMutex<GuestMemoryAtomic<GuestMem>>;

/// Settings shared by all workers of a device.
#[derive(Debug)]
pub struct WorkerConfig {
    pub limits: DeviceLimits,
    /// GET_ID answer, zero-padded.
    pub serial: [u8; VIRTIO_BLK_ID_BYTES as usize],
    pub engine: EngineKind,
    pub notify: NotifyMode,
    pub signal: SignalMode,
    pub poll_us: u64,
    pub sqpoll: bool,
    pub iopoll: bool,
    /// Register guest memory with io_uring (READ_FIXED/WRITE_FIXED).
    pub fixed_buffers: bool,
    /// Block-device discard through io_uring (BLOCK_URING_CMD_DISCARD) when
    /// the kernel has it; otherwise, or when off, a BLKDISCARD ioctl.
    pub uring_cmd: bool,
    /// Most requests taken off the avail ring per submit (0: all there are).
    pub max_batch: usize,
    /// O_DIRECT: guest buffers must be aligned to `dio_align` or bounced.
    pub direct: bool,
    pub dio_align: usize,
    pub is_block_device: bool,
    pub queue_size: u16,
    /// The guest-visible write cache (config `wce`). When off, every write
    /// is issued with RWF_DSYNC.
    pub writeback: AtomicBool,
    /// Set on shutdown: take no new requests.
    pub stopping: AtomicBool,
}

/// A request the engine is executing.
struct InFlight {
    req: Request,
    /// Keeps the guest memory mapping the iovecs point into alive until the
    /// kernel is done with them, even if the front-end remaps memory.
    mem: Arc<GuestMem>,
    /// For misaligned O_DIRECT requests: the aligned buffer and the one
    /// iovec describing it (heap-allocated, so it does not move).
    bounce: Option<(AlignedBuf, Box<libc::iovec>)>,
    /// A write-zeroes with UNMAP retried as a plain zero-range.
    retried: bool,
}

// SAFETY: the raw pointer in the bounce iovec points into the AlignedBuf
// this struct owns; moving the struct moves ownership, not the memory.
unsafe impl Send for InFlight {}

/// What happened to a request handed to the engine.
enum Started {
    /// Executing; completes through the CQ.
    Submitted,
    /// Done already, with this status.
    Done(Request, u8),
    /// No room in the SQ; try again after completions.
    Busy(Request),
}

pub struct QueueWorker {
    cfg: Arc<WorkerConfig>,
    metrics: Arc<QueueMetrics>,
    engine: Option<Uring>,
    running: Slab<InFlight>,
    shadow: RingShadow,
    /// The shadow matches the ring (reset after the ring was stopped).
    started: bool,
    mem: Option<GuestMemoryAtomic<GuestMem>>,
    vring: Option<Vring>,
    poll: AdaptivePoll,
    /// Scratch for reaped CQEs, reused across passes.
    cqes: Vec<(u64, i32)>,
    /// A request popped while the engine was full.
    deferred: Option<Request>,
    log_limit: RateLimiter,
    /// CPU to pin the worker thread to, on its first event.
    pin: Option<usize>,
    /// The image, for the operations an IOPOLL ring cannot do.
    image_fd: i32,
    /// The inflight log, when the front-end negotiated one.
    journal: Option<InflightQueue>,
    /// Heads added to the used ring since the last publish (for the log).
    unpublished_heads: Vec<u16>,
    /// Guest memory registered as io_uring fixed buffers, and the mapping
    /// that keeps it valid while registered.
    fixed: Vec<(usize, usize)>,
    fixed_mem: Option<Arc<GuestMem>>,
    /// Block-device discard goes through io_uring (BLOCK_URING_CMD_DISCARD);
    /// false when the image is a file, the ring cannot carry the command,
    /// or the kernel refused it once: then it is a BLKDISCARD ioctl.
    async_discard: bool,
}

/// io_uring refuses fixed buffers over 1 GiB; larger regions are split.
const FIXED_BUF_MAX: usize = 1 << 30;

impl QueueWorker {
    pub fn new(
        cfg: Arc<WorkerConfig>,
        metrics: Arc<QueueMetrics>,
        image_fd: i32,
        pin: Option<usize>,
    ) -> Result<QueueWorker, crate::io::EngineError> {
        // Room for every descriptor of a full ring, plus the requests the
        // guest may have posted again while others complete.
        let entries = u32::from(cfg.queue_size).next_power_of_two();
        let engine = match cfg.engine {
            EngineKind::Uring => Some(Uring::new(
                image_fd,
                UringOptions {
                    entries,
                    sqpoll: cfg.sqpoll,
                    iopoll: cfg.iopoll && cfg.direct,
                    uring_cmd: cfg.uring_cmd && cfg.is_block_device,
                },
            )?),
            EngineKind::Null => None,
        };
        let poll = AdaptivePoll::new(Duration::from_micros(cfg.poll_us));
        let async_discard = engine.as_ref().is_some_and(|e| e.uring_cmd);
        Ok(QueueWorker {
            cfg,
            metrics,
            engine,
            running: Slab::with_capacity(entries as usize),
            shadow: RingShadow::default(),
            started: false,
            mem: None,
            vring: None,
            poll,
            cqes: Vec::with_capacity(entries as usize),
            deferred: None,
            log_limit: RateLimiter::new(10, Duration::from_secs(5)),
            pin,
            image_fd,
            journal: None,
            unpublished_heads: Vec::new(),
            fixed: Vec::new(),
            fixed_mem: None,
            async_discard,
        })
    }

    /// The completion eventfd, to be watched next to the kick eventfd.
    pub fn completion_fd(&self) -> Option<i32> {
        self.engine.as_ref().map(|e| e.eventfd())
    }

    pub fn set_memory(&mut self, mem: GuestMemoryAtomic<GuestMem>) {
        if self.cfg.fixed_buffers {
            self.register_fixed(mem.memory().into_inner());
        }
        self.mem = Some(mem);
    }

    /// Registers every guest memory region (in chunks of at most 1 GiB) as
    /// io_uring fixed buffers: the kernel then skips pinning and mapping the
    /// pages on each request, the address-translation step the KVM Forum
    /// io_uring talk asked for.
    fn register_fixed(&mut self, mem: Arc<GuestMem>) {
        let Some(engine) = self.engine.as_mut() else {
            return;
        };
        let mut chunks = Vec::new();
        for r in mem.iter() {
            let (base, len) = (r.as_ptr() as usize, r.len() as usize);
            let mut off = 0;
            while off < len {
                let n = (len - off).min(FIXED_BUF_MAX);
                chunks.push((base + off, base + off + n));
                off += n;
            }
        }
        let iovecs: Vec<libc::iovec> = chunks
            .iter()
            .map(|&(a, b)| libc::iovec {
                iov_base: a as *mut libc::c_void,
                iov_len: b - a,
            })
            .collect();
        // SAFETY: the chunks are guest memory mappings owned by `mem`, which
        // `fixed_mem` keeps alive until the next registration replaces it.
        match unsafe { engine.register_buffers(&iovecs) } {
            Ok(()) => {
                self.fixed = chunks;
                self.fixed_mem = Some(mem);
            }
            Err(e) => {
                log::warn!(
                    "cannot register guest memory as fixed buffers ({e}); using readv/writev"
                );
                self.fixed.clear();
                self.fixed_mem = None;
            }
        }
    }

    /// The fixed buffer holding `iov` entirely, if any.
    fn fixed_index(&self, iov: &libc::iovec) -> Option<u16> {
        let (a, b) = (iov.iov_base as usize, iov.iov_base as usize + iov.iov_len);
        self.fixed
            .iter()
            .position(|&(s, e)| s <= a && b <= e)
            .map(|i| i as u16)
    }

    /// Installs the inflight log (SET_INFLIGHT_FD); recovery runs when the
    /// ring starts.
    pub fn set_inflight(&mut self, log: Option<InflightQueue>) {
        self.journal = log;
        self.started = false;
    }

    /// Called for a kick (`kick` = true) or a completion event.
    pub fn handle_event(&mut self, vring: &Vring, kick: bool) {
        if kick {
            QueueMetrics::add(&self.metrics.kicks, 1);
        } else if let Some(e) = &self.engine {
            e.clear_eventfd();
        }
        if self.vring.is_none() {
            self.vring = Some(vring.clone());
            if let Some(cpu) = self.pin {
                pin_current_thread(cpu);
            }
        }
        self.poll.woke_up();
        if let Err(e) = self.run(vring) {
            warn_limited!(self.log_limit, "queue stopped: {e}");
        }
    }

    fn run(&mut self, vring: &Vring) -> Result<(), RingError> {
        let Some(mem) = self.mem.as_ref().map(|m| m.memory().into_inner()) else {
            return Ok(());
        };
        let mut state = vring.get_mut();
        if !state.get_queue().ready() {
            // Stopped ring: nothing to pop; completions are drained by stop().
            return Ok(());
        }
        if !self.started {
            self.shadow.reset(state.get_queue());
            self.started = true;
            self.recover(&mut state, &mem)?;
        }
        let cfg = self.cfg.clone();
        let stopping = || cfg.stopping.load(Ordering::Relaxed);
        loop {
            if self.cfg.signal == SignalMode::Early {
                self.complete(&mut state, &mem)?;
            }
            let (popped, full) = if stopping() {
                (0, false)
            } else {
                self.shadow.disable_kicks(state.get_queue(), &*mem)?;
                self.pop_and_start(&mut state, &mem)?
            };
            if self.cfg.signal == SignalMode::Late {
                self.complete(&mut state, &mem)?;
            } else {
                self.publish(&mut state, &mem)?;
            }
            if full {
                // Backpressure: resume when completions free room.
                if self.engine.as_ref().is_some_and(|e| e.iopoll) {
                    self.wait_engine(1);
                    continue;
                }
                return Ok(());
            }
            if popped > 0 && self.shadow.more_avail() {
                // Work known to be there: no need to read avail->idx to know.
                continue;
            }
            if self.engine.as_mut().is_some_and(|e| e.has_completions()) {
                // Requests that completed inside the submit call (page-cache
                // hits) are signalled now, not after a trip through epoll
                // for the eventfd they also rang.
                if let Some(e) = &self.engine {
                    e.clear_eventfd();
                }
                self.complete(&mut state, &mem)?;
            }
            if self.poll_for_work(&state, &mem)? {
                continue;
            }
            if stopping() {
                return Ok(());
            }
            if self.shadow.enable_kicks(state.get_queue(), &*mem)? {
                continue;
            }
            if self
                .engine
                .as_ref()
                .is_some_and(|e| e.iopoll && e.outstanding() > 0)
            {
                // IOPOLL posts no completion (and no eventfd) unless polled.
                self.wait_engine(1);
                continue;
            }
            self.poll.sleeping();
            return Ok(());
        }
    }

    /// After a back-end restart: repairs the inflight log, resumes the
    /// avail ring after everything the previous process took, and
    /// resubmits what it had not completed, oldest first.
    fn recover(
        &mut self,
        state: &mut VringState<GuestMemoryAtomic<GuestMem>>,
        mem: &Arc<GuestMem>,
    ) -> Result<(), RingError> {
        let Some(log) = self.journal.as_mut() else {
            return Ok(());
        };
        let queue = state.get_queue_mut();
        // Reading used->idx back is fine here: once per ring start.
        let used = queue.used_idx(&**mem, Ordering::Acquire)?.0;
        let rec = log.recover(used);
        log::debug!(
            "queue start: used->idx {used}, {} request(s) to resubmit",
            rec.resubmit.len()
        );
        if rec.resubmit.is_empty() {
            return Ok(());
        }
        queue.set_next_avail(used.wrapping_add(rec.resubmit.len() as u16));
        log::info!(
            "queue: resubmitting {} request(s) left in flight by the previous back-end",
            rec.resubmit.len()
        );
        let Some((mut replay, ext)) = replay_queue(queue, mem, &rec.resubmit) else {
            warn_limited!(
                self.log_limit,
                "cannot rebuild in-flight requests for resubmission"
            );
            return Ok(());
        };
        let limits = self.cfg.limits;
        let size = queue.size();
        let parsed: Vec<_> = replay
            .iter(&*ext)?
            .map(|c| Request::parse(c, &ext, &limits, size))
            .collect();
        for p in parsed {
            let queue = state.get_queue_mut();
            match p {
                Ok(req) => {
                    if let Some(req) = self.start_one(queue, &ext, req)? {
                        self.deferred = Some(req);
                    }
                }
                Err(rej) => self.reject(queue, &ext, rej)?,
            }
        }
        if let Some(e) = self.engine.as_mut() {
            let _ = e.submit();
        }
        self.publish(state, mem)
    }

    /// Busy-polls the avail ring and the CQ for the adaptive window.
    /// Returns true when work showed up.
    fn poll_for_work(
        &mut self,
        state: &VringState<GuestMemoryAtomic<GuestMem>>,
        mem: &GuestMem,
    ) -> Result<bool, RingError> {
        let Some(window) = self.poll.window() else {
            return Ok(false);
        };
        let deadline = Instant::now() + window;
        let mut spins = 0u64;
        let found = loop {
            spins += 1;
            if self.shadow.avail_pending(state.get_queue(), mem)?
                || self.engine.as_mut().is_some_and(|e| e.has_completions())
            {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            std::hint::spin_loop();
        };
        QueueMetrics::add(&self.metrics.poll_iterations, spins);
        if found {
            QueueMetrics::add(&self.metrics.poll_hits, 1);
        }
        Ok(found)
    }

    fn wait_engine(&mut self, n: u32) {
        if let Some(e) = self.engine.as_mut() {
            if let Err(err) = e.wait(n) {
                warn_limited!(self.log_limit, "io_uring wait failed: {err}");
            }
        }
    }

    /// Pops, parses and starts requests while the engine has room, then
    /// submits them all with one io_uring_enter. Returns (popped, engine full).
    fn pop_and_start(
        &mut self,
        state: &mut VringState<GuestMemoryAtomic<GuestMem>>,
        mem: &Arc<GuestMem>,
    ) -> Result<(usize, bool), RingError> {
        let mut full = false;
        if let Some(req) = self.deferred.take() {
            if let Some(req) = self.start_one(state.get_queue_mut(), mem, req)? {
                self.deferred = Some(req);
                return Ok((0, true));
            }
        }
        let limit = match &self.engine {
            Some(e) if !e.has_room() => return Ok((0, true)),
            Some(e) => (e.capacity() - e.outstanding()) as usize,
            None => usize::from(self.cfg.queue_size),
        };
        let limit = match self.cfg.max_batch {
            0 => limit,
            n => limit.min(n),
        };
        let mut parsed = Vec::with_capacity(limit.min(64));
        let queue_size = state.get_queue().size();
        let limits = self.cfg.limits;
        let journal = &mut self.journal;
        let popped = self
            .shadow
            .pop(state.get_queue_mut(), mem.as_ref(), limit, |chain| {
                // Logged before anything is done with it: from here until
                // its used element is published, a crash must resubmit it.
                if let Some(log) = journal.as_mut() {
                    log.mark(chain.head_index());
                }
                parsed.push(Request::parse(chain, mem, &limits, queue_size));
            })?;
        for p in parsed {
            let queue = state.get_queue_mut();
            match p {
                Ok(req) => {
                    if let Some(req) = self.start_one(queue, mem, req)? {
                        // Cannot happen while `limit` counts free SQ slots;
                        // keep the request rather than drop it if it does.
                        self.deferred = Some(req);
                        full = true;
                    }
                }
                Err(rej) => self.reject(queue, mem, rej)?,
            }
            if self.cfg.notify == NotifyMode::PerRequest {
                self.publish(state, mem)?;
            }
        }
        if let Some(e) = self.engine.as_mut() {
            match e.submit() {
                Ok(n) if n > 0 => {
                    QueueMetrics::add(&self.metrics.submit_calls, 1);
                    QueueMetrics::add(&self.metrics.submitted_sqes, u64::from(n));
                }
                Ok(_) => {}
                Err(err) => warn_limited!(self.log_limit, "io_uring submit failed: {err}"),
            }
        }
        full |= self.shadow.more_avail() && self.engine.as_ref().is_some_and(|e| !e.has_room());
        Ok((popped, full))
    }

    /// Starts one request; returns it back if the engine is full.
    fn start_one(
        &mut self,
        queue: &mut Queue,
        mem: &Arc<GuestMem>,
        req: Request,
    ) -> Result<Option<Request>, RingError> {
        match self.start(req, mem) {
            Started::Submitted => Ok(None),
            Started::Busy(req) => Ok(Some(req)),
            Started::Done(req, status) => {
                let _ = mem.write_obj(status, req.status);
                self.add_used(queue, mem, req.head, used_len(&req, status))?;
                Ok(None)
            }
        }
    }

    /// Maps a request to an SQE, or executes it inline when no I/O is needed.
    fn start(&mut self, req: Request, mem: &Arc<GuestMem>) -> Started {
        let kind = req.kind;
        if kind == RequestKind::GetId {
            copy_to_iovecs(&req.data, &self.cfg.serial);
            self.count_done(&req, VIRTIO_BLK_S_OK as u8);
            return Started::Done(req, VIRTIO_BLK_S_OK as u8);
        }
        match &self.engine {
            Some(e) if !e.has_room() => return Started::Busy(req),
            Some(_) => {}
            None => {
                if let RequestKind::Read { .. } = kind {
                    zero_iovecs(&req.data);
                }
                self.count_done(&req, VIRTIO_BLK_S_OK as u8);
                return Started::Done(req, VIRTIO_BLK_S_OK as u8);
            }
        }
        let iopoll = self.engine.as_ref().is_some_and(|e| e.iopoll);
        let sync = match kind {
            // An IOPOLL ring only takes reads and writes.
            RequestKind::Flush | RequestKind::WriteZeroes(_) => iopoll,
            RequestKind::Discard(_) => iopoll || (self.cfg.is_block_device && !self.async_discard),
            _ => false,
        };
        if sync {
            let status = self.run_sync(kind);
            self.count_done(&req, status);
            return Started::Done(req, status);
        }
        if req.data_len == 0 && matches!(kind, RequestKind::Read { .. } | RequestKind::Write { .. })
        {
            self.count_done(&req, VIRTIO_BLK_S_OK as u8);
            return Started::Done(req, VIRTIO_BLK_S_OK as u8);
        }
        let mut inf = InFlight {
            req,
            mem: mem.clone(),
            bounce: None,
            retried: false,
        };
        if self.cfg.direct
            && matches!(kind, RequestKind::Read { .. } | RequestKind::Write { .. })
            && !aligned(&inf.req.data, self.cfg.dio_align)
        {
            let Some(mut buf) = AlignedBuf::new(inf.req.data_len as usize) else {
                self.count_done(&inf.req, VIRTIO_BLK_S_IOERR as u8);
                return Started::Done(inf.req, VIRTIO_BLK_S_IOERR as u8);
            };
            if let RequestKind::Write { .. } = kind {
                gather(&inf.req.data, buf.as_mut_slice());
            }
            let iov = Box::new(libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: inf.req.data_len as usize,
            });
            inf.bounce = Some((buf, iov));
            QueueMetrics::add(&self.metrics.bounced, 1);
        }
        let key = self.running.vacant_key() as u64;
        let entry = self.sqe(&inf, key);
        self.running.insert(inf);
        // SAFETY: the entry points at the request's iovec array (a Vec's heap
        // buffer), or the bounce iovec (a Box), and through them at guest
        // memory kept mapped by `InFlight::mem`, or at the AlignedBuf. All
        // are owned by the slab entry at `key`, which is removed only when
        // this SQE's completion is reaped (or after a drain waited for it).
        let pushed = self
            .engine
            .as_mut()
            .is_some_and(|e| unsafe { e.push(&entry) });
        if !pushed {
            let inf = self.running.remove(key as usize);
            return Started::Busy(inf.req);
        }
        Started::Submitted
    }

    /// Runs a flush, discard or write-zeroes synchronously (IOPOLL rings
    /// cannot, nor can kernels before 6.12 discard a block device through
    /// io_uring): rare operations, worth a blocking syscall on this queue.
    fn run_sync(&mut self, kind: RequestKind) -> u8 {
        let syscall = |ret: i32| match ret {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        };
        let result = match kind {
            RequestKind::Discard(r) if self.cfg.is_block_device => {
                crate::io::discard_block_device(&self.image_fd, r.offset(), r.len())
            }
            // SAFETY: plain syscalls on the image fd, which outlives the worker.
            RequestKind::Flush => syscall(unsafe { libc::fdatasync(self.image_fd) }),
            // SAFETY: as above; fallocate carries no pointers.
            RequestKind::Discard(r) | RequestKind::WriteZeroes(r) => syscall(unsafe {
                libc::fallocate(
                    self.image_fd,
                    self.fallocate_mode(kind, false),
                    r.offset() as i64,
                    r.len() as i64,
                )
            }),
            _ => Ok(()),
        };
        match result {
            Ok(()) => VIRTIO_BLK_S_OK as u8,
            // Discard is a hint: a device that cannot do it has done it.
            Err(e)
                if matches!(kind, RequestKind::Discard(_))
                    && is_unsupported(-e.raw_os_error().unwrap_or(0)) =>
            {
                VIRTIO_BLK_S_OK as u8
            }
            Err(e) => {
                warn_limited!(self.log_limit, "{kind:?} failed: {e}");
                VIRTIO_BLK_S_IOERR as u8
            }
        }
    }

    fn sqe(&self, inf: &InFlight, key: u64) -> io_uring::squeue::Entry {
        let req = &inf.req;
        let (iov, n) = match &inf.bounce {
            Some((_, iov)) => (&**iov as *const libc::iovec, 1),
            None => (req.data.0.as_ptr(), req.data.0.len() as u32),
        };
        let dsync = !self.cfg.writeback.load(Ordering::Relaxed);
        if n == 1 && inf.bounce.is_none() {
            if let Some(idx) = self.fixed_index(&req.data.0[0]) {
                let (buf, len) = (req.data.0[0].iov_base.cast::<u8>(), req.data_len);
                match req.kind {
                    RequestKind::Read { .. } => {
                        return op::read_fixed(buf, len, req.offset(), idx, key);
                    }
                    RequestKind::Write { .. } => {
                        return op::write_fixed(buf, len, req.offset(), idx, dsync, key);
                    }
                    _ => {}
                }
            }
        }
        match req.kind {
            RequestKind::Read { .. } => op::readv(iov, n, req.offset(), key),
            RequestKind::Write { .. } => op::writev(iov, n, req.offset(), dsync, key),
            RequestKind::Flush | RequestKind::GetId => op::flush(key),
            RequestKind::Discard(r) if self.async_discard => {
                op::discard_block(r.offset(), r.len(), key)
            }
            RequestKind::Discard(r) | RequestKind::WriteZeroes(r) => op::fallocate(
                r.offset(),
                r.len(),
                self.fallocate_mode(req.kind, inf.retried),
                key,
            ),
        }
    }

    /// The fallocate(2) mode of a discard or write-zeroes, for the io_uring
    /// path and the synchronous one alike. Every mode keeps the size.
    /// - discard: punch a hole (files only: on block devices the kernel
    ///   zeroes for this mode, so discard is BLKDISCARD, see `run_sync`);
    /// - write-zeroes: ZERO_RANGE (BLKZEROOUT on a block device), or with
    ///   UNMAP a punched hole (BLKZEROOUT with unmap), unless `zero_fallback`
    ///   says deallocating was already refused.
    fn fallocate_mode(&self, kind: RequestKind, zero_fallback: bool) -> i32 {
        let mode = match kind {
            RequestKind::Discard(_) => libc::FALLOC_FL_PUNCH_HOLE,
            RequestKind::WriteZeroes(r) if r.unmap && !zero_fallback => libc::FALLOC_FL_PUNCH_HOLE,
            _ => libc::FALLOC_FL_ZERO_RANGE,
        };
        mode | libc::FALLOC_FL_KEEP_SIZE
    }

    /// Reaps completions, finishes their requests, and publishes.
    fn complete(
        &mut self,
        state: &mut VringState<GuestMemoryAtomic<GuestMem>>,
        mem: &Arc<GuestMem>,
    ) -> Result<(), RingError> {
        let Some(engine) = self.engine.as_mut() else {
            return self.publish(state, mem);
        };
        let mut cqes = std::mem::take(&mut self.cqes);
        let n = engine.reap(|ud, res| cqes.push((ud, res)));
        if n > 0 {
            QueueMetrics::add(&self.metrics.completion_passes, 1);
            QueueMetrics::add(&self.metrics.completions, u64::from(n));
        }
        for (ud, res) in cqes.drain(..) {
            self.finish(state.get_queue_mut(), mem, ud, res)?;
            if self.cfg.notify == NotifyMode::PerRequest {
                self.publish(state, mem)?;
            }
        }
        self.cqes = cqes;
        // A retried write-zeroes was queued while finishing.
        if let Some(e) = self.engine.as_mut() {
            let _ = e.submit();
        }
        self.publish(state, mem)
    }

    fn finish(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMem,
        ud: u64,
        res: i32,
    ) -> Result<(), RingError> {
        let Some(mut inf) = self.running.try_remove(ud as usize) else {
            warn_limited!(self.log_limit, "completion for unknown request {ud}");
            return Ok(());
        };
        let status = match inf.req.kind {
            RequestKind::Read { .. } | RequestKind::Write { .. }
                if res >= 0 && res as u32 == inf.req.data_len =>
            {
                if let (RequestKind::Read { .. }, Some((buf, _))) = (inf.req.kind, &inf.bounce) {
                    scatter(&inf.req.data, buf.as_slice());
                }
                VIRTIO_BLK_S_OK
            }
            RequestKind::WriteZeroes(r) if r.unmap && !inf.retried && is_unsupported(res) => {
                // The file system or device cannot deallocate: zero instead.
                inf.retried = true;
                let key = self.running.vacant_key() as u64;
                let entry = self.sqe(&inf, key);
                self.running.insert(inf);
                if let Some(e) = self.engine.as_mut() {
                    // SAFETY: fallocate carries no pointers.
                    if unsafe { e.push(&entry) } {
                        return Ok(());
                    }
                }
                inf = self.running.remove(key as usize);
                VIRTIO_BLK_S_IOERR
            }
            RequestKind::Discard(_) if self.async_discard && res == -libc::EOPNOTSUPP => {
                // A kernel before 6.12: no discard command on block devices.
                log::info!("io_uring cannot discard on this block device; using BLKDISCARD");
                self.async_discard = false;
                self.run_sync(inf.req.kind).into()
            }
            // Discard is a hint: a device that cannot do it has done it.
            RequestKind::Discard(_) if is_unsupported(res) => VIRTIO_BLK_S_OK,
            RequestKind::Flush | RequestKind::Discard(_) | RequestKind::WriteZeroes(_)
                if res >= 0 =>
            {
                VIRTIO_BLK_S_OK
            }
            _ => {
                let err = if res < 0 {
                    std::io::Error::from_raw_os_error(-res).to_string()
                } else {
                    format!("short transfer of {res} of {} bytes", inf.req.data_len)
                };
                warn_limited!(
                    self.log_limit,
                    "{:?} at offset {} failed: {err}",
                    inf.req.kind,
                    inf.req.offset()
                );
                VIRTIO_BLK_S_IOERR
            }
        };
        let status = status as u8;
        self.count_done(&inf.req, status);
        let _ = inf.mem.write_obj(status, inf.req.status);
        let len = used_len(&inf.req, status);
        self.add_used(queue, mem, inf.req.head, len)
    }

    /// Answers a refused request: status byte if there is one, used length
    /// 0 if not.
    fn reject(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMem,
        rej: Rejected,
    ) -> Result<(), RingError> {
        let len = match rej.status {
            Some(addr) => {
                let status = rej.error.status();
                if mem.write_obj(status, addr).is_ok() {
                    if u32::from(status) == virtio_bindings::virtio_blk::VIRTIO_BLK_S_UNSUPP {
                        QueueMetrics::add(&self.metrics.errors_unsupp, 1);
                        self.metrics.count_request(RequestType::Unsupported);
                    } else {
                        QueueMetrics::add(&self.metrics.errors_ioerr, 1);
                    }
                    1
                } else {
                    QueueMetrics::add(&self.metrics.errors_no_status, 1);
                    0
                }
            }
            None => {
                QueueMetrics::add(&self.metrics.errors_no_status, 1);
                0
            }
        };
        warn_limited!(
            self.log_limit,
            "request {} refused: {}",
            rej.head,
            rej.error
        );
        self.add_used(queue, mem, rej.head, len)
    }

    /// Writes a used element (not yet visible to the driver).
    fn add_used(
        &mut self,
        queue: &mut Queue,
        mem: &GuestMem,
        head: u16,
        len: u32,
    ) -> Result<(), RingError> {
        if head >= queue.size() {
            // Only a broken or hostile driver puts such a head on the avail
            // ring; its "chain" was empty. A used element naming it would
            // only confuse the driver further (virtio-queue refuses it too).
            warn_limited!(
                self.log_limit,
                "avail ring named descriptor {head} of {}",
                queue.size()
            );
            return Ok(());
        }
        self.shadow.add_used(queue, mem, head, len)?;
        if self.journal.is_some() {
            self.unpublished_heads.push(head);
        }
        Ok(())
    }

    /// Publishes pending used elements and notifies the guest if it asked.
    /// With an inflight log, the batch is linked before used->idx moves and
    /// cleared after, so a crash at any point leaves a repairable log.
    fn publish(
        &mut self,
        state: &mut VringState<GuestMemoryAtomic<GuestMem>>,
        mem: &GuestMem,
    ) -> Result<(), RingError> {
        if let Some(log) = &self.journal {
            log.before_publish(&self.unpublished_heads);
        }
        let n = self.shadow.publish(state.get_queue(), mem)?;
        if let Some(log) = &self.journal {
            log.after_publish(&self.unpublished_heads, state.get_queue().next_used());
            self.unpublished_heads.clear();
        }
        if n == 0 {
            return Ok(());
        }
        if self.shadow.needs_notification(state.get_queue(), mem)? {
            if state.signal_used_queue().is_ok() {
                QueueMetrics::add(&self.metrics.notifications, 1);
            }
        } else {
            QueueMetrics::add(&self.metrics.notifications_suppressed, 1);
        }
        Ok(())
    }

    fn count_done(&self, req: &Request, status: u8) {
        let m = &self.metrics;
        let t = match req.kind {
            RequestKind::Read { .. } => RequestType::Read,
            RequestKind::Write { .. } => RequestType::Write,
            RequestKind::Flush => RequestType::Flush,
            RequestKind::GetId => RequestType::GetId,
            RequestKind::Discard(_) => RequestType::Discard,
            RequestKind::WriteZeroes(_) => RequestType::WriteZeroes,
        };
        m.count_request(t);
        if u32::from(status) == VIRTIO_BLK_S_OK {
            match t {
                RequestType::Read => QueueMetrics::add(&m.read_bytes, u64::from(req.data_len)),
                RequestType::Write => QueueMetrics::add(&m.write_bytes, u64::from(req.data_len)),
                _ => {}
            }
        } else {
            QueueMetrics::add(&m.errors_ioerr, 1);
        }
    }

    /// Completes everything in flight and publishes it: the ring is being
    /// stopped (GET_VRING_BASE), reset, or the daemon shuts down.
    pub fn drain(&mut self) {
        let Some(vring) = self.vring.clone() else {
            return;
        };
        let Some(mem) = self.mem.as_ref().map(|m| m.memory().into_inner()) else {
            return;
        };
        let mut state = vring.get_mut();
        while let Some(e) = self.engine.as_mut() {
            let out = e.outstanding();
            if out == 0 {
                break;
            }
            if let Err(err) = e.wait(out) {
                log::warn!("draining queue: {err}");
                break;
            }
            if let Err(err) = self.complete(&mut state, &mem) {
                log::warn!("draining queue: {err}");
                break;
            }
        }
        if let Some(req) = self.deferred.take() {
            // Popped but never started: give it back as failed rather than lose it.
            let _ = mem.write_obj(VIRTIO_BLK_S_IOERR as u8, req.status);
            let _ = self.add_used(state.get_queue_mut(), &mem, req.head, 1);
            let _ = self.publish(&mut state, &mem);
        }
        self.started = false;
    }
}

/// Pins the calling thread (a queue worker) to `cpu`.
fn pin_current_thread(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: CPU_SET writes inside `set`; out-of-range CPUs are ignored by
    // the kernel call below, which then fails and is logged.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pid 0 is the calling thread; set is a valid cpu_set_t.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) } != 0 {
        log::warn!(
            "cannot pin queue worker to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        );
    }
}

fn used_len(req: &Request, status: u8) -> u32 {
    if u32::from(status) == VIRTIO_BLK_S_OK {
        req.written_len() + 1
    } else {
        1
    }
}

fn is_unsupported(res: i32) -> bool {
    res == -libc::EOPNOTSUPP || res == -libc::EINVAL
}

fn aligned(bufs: &HostBuffers, align: usize) -> bool {
    bufs.0
        .iter()
        .all(|v| (v.iov_base as usize) % align == 0 && v.iov_len % align == 0)
}

/// Copies `src` into the iovecs, as far as they reach.
fn copy_to_iovecs(bufs: &HostBuffers, src: &[u8]) {
    let mut off = 0;
    for v in &bufs.0 {
        let n = v.iov_len.min(src.len() - off);
        // SAFETY: each iovec was produced by `Request::parse` from a guest
        // memory slice that is device-writable and still mapped (the caller
        // holds the memory snapshot); src has at least off + n bytes.
        unsafe { std::ptr::copy_nonoverlapping(src[off..].as_ptr(), v.iov_base.cast::<u8>(), n) };
        off += n;
        if off == src.len() {
            break;
        }
    }
}

/// Zero-fills the iovecs (null engine reads).
fn zero_iovecs(bufs: &HostBuffers) {
    for v in &bufs.0 {
        // SAFETY: as in copy_to_iovecs: a mapped, device-writable guest buffer.
        unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len) };
    }
}

/// Gathers the iovecs into `dst` (bounced writes).
fn gather(bufs: &HostBuffers, dst: &mut [u8]) {
    let mut off = 0;
    for v in &bufs.0 {
        // SAFETY: the iovec is a mapped guest buffer of iov_len bytes; dst
        // holds data_len bytes, the sum of all iov_len.
        unsafe {
            std::ptr::copy_nonoverlapping(
                v.iov_base.cast::<u8>(),
                dst[off..].as_mut_ptr(),
                v.iov_len,
            )
        };
        off += v.iov_len;
    }
}

/// Scatters `src` into the iovecs (bounced reads).
fn scatter(bufs: &HostBuffers, src: &[u8]) {
    let mut off = 0;
    for v in &bufs.0 {
        // SAFETY: as in gather, in the other direction.
        unsafe {
            std::ptr::copy_nonoverlapping(src[off..].as_ptr(), v.iov_base.cast::<u8>(), v.iov_len)
        };
        off += v.iov_len;
    }
}

#[cfg(test)]
#[path = "worker_tests.rs"]
mod tests;
