//! One queue's worker: takes requests off the avail ring, hands them to its
//! engine ([`crate::engine`]), and puts completions on the used ring. The
//! worker decides *when* (batches, publication, notification, the inflight
//! journal); the engine decides *how* the I/O is done.
//!
//! A pass (`run`) goes, per iteration:
//! 1. with `--signal early`, reap completions and publish + signal them
//!    before anything else (cloud-hypervisor PR 7532);
//! 2. with kicks suppressed, pop up to `--max-batch` chains (as many as the
//!    engine has room for), parse them, hand them to the engine and commit
//!    the batch (one io_uring_enter); while more are known to be there, go
//!    back to 1;
//! 3. publish what completed inline (errors, GET_ID) and, with
//!    `--signal late`, what the ring completed meanwhile;
//! 4. when the ring is empty: busy-poll for up to `--poll-us` (a window
//!    for the guest's next request when nothing is in flight, another for
//!    the device while something is: [`super::poll`]; none where the
//!    engine says polling does not pay, [`crate::engine::Completions`]), else
//!    re-enable kicks, re-check the ring, and only then sleep.
//!
//! QoS ([`crate::qos`]) sits between parse and engine: a request the
//! device's token buckets refuse waits at the head of `deferred`, those
//! popped after it wait behind it, and nothing more is popped (kicks stay
//! suppressed) until it is admitted. The pass ends as it does when the
//! engine is full, without busy-polling; the queue's timer wakes it when
//! the tokens should be there (after at most
//! [`crate::qos::MAX_THROTTLE_SLEEP`], so that new limits apply soon).
//! When the ring stops or the connection ends, waiting requests are
//! admitted regardless (and charged): GET_VRING_BASE must answer now, and
//! they cannot be put back on the avail ring.
//!
//! A worker whose thread serves other queues too (`--threads`) takes
//! turns: after a pass has taken [`TURN`] requests with more waiting, it
//! writes its resume eventfd and returns, so the thread's
//! epoll gets round to the other queues' events before it comes back. Such
//! a worker does not busy-poll: spinning on one queue would hold back the
//! others' events (polling all of a thread's queues together is not
//! built).
//!
//! Latency ([`QueueMetrics::latency`]) is measured here, the layer that
//! decides when a request is taken and when it is answered: from the pass
//! that popped it to the pass that completed it, so QoS throttling and
//! image-lock waits count. Where the worker held off popping (throttled,
//! waiting for the lock, engine full), a request is dated from the first
//! pass that saw it on the avail ring instead ([`super::arrivals`]). The
//! clock is read once per pop that took something and once per
//! completion pass that finished something, not per request: each
//! request of a batch gets the batch's time. What that leaves out is the
//! worker's own bookkeeping of the batch (parsing the chains popped with
//! it, writing the used elements of those completed before it), a few
//! hundred nanoseconds at most, well under a bucket's width.
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

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vhost_user_backend::{VringMutex, VringState, VringT};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::eventfd::EventFd;

use crate::device::{Device, Unclaimed};
use crate::engine::{Completion, Core, Engine, Full};
use crate::metrics::{QueueMetrics, RateLimiter, RequestType};
use crate::qos::MAX_THROTTLE_SLEEP;
use crate::virtio::RequestError;
use crate::virtio::request::{Parser, Rejected};
use crate::virtio::ring::{RingError, RingShadow, RingView};
use crate::virtio::{Direction, GuestMem, Request, Status};
use crate::{info_limited, warn_limited};

use super::arrivals::Arrivals;
use super::inflight::InflightQueue;
use super::poll::{AdaptivePoll, CpuClaim, Outcome, PREEMPT_GAP, Wait, yield_cpu};
use super::resubmit::Replay;
use super::timer::Timer;

pub type Vring = VringMutex<GuestMemoryAtomic<GuestMem>>;

/// How long a starting ring waits for the image lock before its requests
/// fail. A daemon killed with -9 keeps its file, and the lock, until the
/// kernel has torn down its io_uring, a moment after the process is gone;
/// its successor waits for that rather than fail the requests it
/// resubmits. Waiting is not sleeping: the requests wait at the head of
/// the queue, like throttled ones, and the queue's timer brings the worker
/// back every [`LOCK_RETRY`] to try again.
const LOCK_WAIT: Duration = Duration::from_secs(3);

/// How often a queue waiting for the image lock tries again.
const LOCK_RETRY: Duration = Duration::from_millis(10);

/// Requests a worker whose thread serves other queues takes in one pass
/// before it lets them have a turn. A queue waits at most this many of each
/// thread-mate's requests; a longer turn raises the others' tail latency,
/// a shorter one costs more syscalls (three per turn). Measured for turns
/// of 8, 16, 32 and 256 in docs/benchmarks.md, "What if there are fewer
/// CPUs than queues?".
pub const TURN: usize = 16;

/// How the used ring is published and the guest notified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotifyMode {
    /// Publish used->idx and decide on a notification once per completion
    /// pass.
    Batched,
    /// Publish and notify after every request (the naive baseline).
    PerRequest,
}

/// Whether finished requests are signalled before or after new
/// submissions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalMode {
    /// Reap and signal completions before parsing new avail entries.
    Early,
    /// Submit new requests first, then reap and signal.
    Late,
}

/// How a device's queues are served (`serve`'s flags): the same for
/// every worker.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub notify: NotifyMode,
    pub signal: SignalMode,
    pub poll_us: u64,
    /// Stop polling when it hurts (`--no-poll-checks` turns it off): see
    /// [`super::poll`].
    pub poll_checks: bool,
    /// Most requests taken off the avail ring per submit (0: all there are).
    pub max_batch: usize,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            notify: NotifyMode::Batched,
            signal: SignalMode::Early,
            poll_us: 0,
            poll_checks: true,
            max_batch: 0,
        }
    }
}

/// Whether a request may go to the engine now (`QueueWorker::gate`).
enum Gate {
    Go,
    /// Not yet: it waits at the head of the queue, and the timer is armed.
    Wait,
    /// Never: it fails (the image lock is another process's).
    Refuse,
}

/// What woke a worker up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The guest kicked the queue.
    Kick,
    /// The engine's completion eventfd.
    Completion,
    /// The worker's own resume eventfd: it yielded with work left.
    Resume,
    /// The queue's QoS timer: tokens for its waiting request should be
    /// there.
    Timer,
}

pub struct QueueWorker<E: Engine> {
    device: Arc<Device>,
    cfg: Settings,
    metrics: Arc<QueueMetrics>,
    core: Core<E>,
    shadow: RingShadow,
    /// The shadow matches the ring (reset after the ring was stopped).
    started: bool,
    /// The connection is over (`drain`): no kick is taken any more.
    closed: bool,
    /// This queue counts among the image lock's users (see `try_lock`).
    holds_lock: bool,
    /// Why the last claim failed (see `try_lock`): what requests that
    /// fail for it are logged with.
    unclaimed: Option<Unclaimed>,
    /// This queue counts among those waiting for the image lock: its ring
    /// runs, and another process holds the lock.
    waits_lock: bool,
    /// Until when requests wait for the image lock, rather than fail,
    /// while another process holds it: set when the ring starts without
    /// it.
    lock_deadline: Option<Instant>,
    /// The guest memory this worker uses: the last table the device
    /// accepted. vhost-user-backend swaps a new table into the shared
    /// `GuestMemoryAtomic` before it asks the device, so the worker never
    /// reads that one: a refused table stays unseen.
    mem: Option<Arc<GuestMem>>,
    vring: Option<Vring>,
    poll: AdaptivePoll,
    /// Names this worker's claims on the CPU it polls on.
    poll_token: u64,
    /// Set when the thread serves other queues too: the eventfd this
    /// worker writes to come back after yielding (see the module doc).
    resume: Option<Arc<EventFd>>,
    /// Popped and parsed, but the engine had no room: they go to it first,
    /// oldest first, each with the memory it was parsed against.
    deferred: VecDeque<Request>,
    /// Parses chains with buffers it reuses; finished requests give their
    /// iovec vectors back to it, so the data path allocates nothing once
    /// warm.
    parser: Parser,
    /// Scratch, reused across passes: one pop's parsed chains, one pass's
    /// completions.
    parsed: Vec<Result<Request, Rejected>>,
    reaped: Vec<Completion>,
    log_limit: RateLimiter,
    /// CPU to pin the worker thread to, on its first event.
    pin: Option<usize>,
    /// The inflight log, when the front-end negotiated one.
    journal: Option<InflightQueue>,
    /// Heads added to the used ring since the last publish (for the log).
    unpublished_heads: Vec<u16>,
    /// The queue's wake-up timer, for a request waiting at the head of
    /// `deferred` (QoS tokens, the image lock).
    timer: Arc<Timer>,
    /// The head of `deferred` was admitted by QoS (and charged) already;
    /// only the engine had no room for it.
    front_admitted: bool,
    /// Since when the head of `deferred` waits for QoS tokens.
    throttled_since: Option<Instant>,
    /// The start of the worker's clock (see [`clock`]).
    epoch: Instant,
    /// When requests not popped yet were seen on the ring, while the
    /// worker held off popping.
    arrivals: Arrivals,
}

/// Nanoseconds since `epoch`: one read of CLOCK_MONOTONIC (the vDSO's,
/// ~20-25 ns), what a request's latency is measured with. (A u64 of
/// nanoseconds lasts 584 years.)
#[inline]
fn clock(epoch: Instant) -> u64 {
    epoch.elapsed().as_nanos() as u64
}

impl<E: Engine> QueueWorker<E> {
    pub fn new(
        device: Arc<Device>,
        cfg: Settings,
        metrics: Arc<QueueMetrics>,
        core: Core<E>,
        timer: Arc<Timer>,
        pin: Option<usize>,
    ) -> QueueWorker<E> {
        // An engine whose completions polling does not catch: never poll.
        let poll_us = if core.completions().polling_pays() {
            cfg.poll_us
        } else {
            0
        };
        let poll = AdaptivePoll::new(Duration::from_micros(poll_us), cfg.poll_checks);
        let size = usize::from(device.queue_size());
        QueueWorker {
            device,
            cfg,
            metrics,
            core,
            shadow: RingShadow::default(),
            started: false,
            closed: false,
            holds_lock: false,
            unclaimed: None,
            waits_lock: false,
            mem: None,
            vring: None,
            poll,
            poll_token: CpuClaim::token(),
            resume: None,
            deferred: VecDeque::with_capacity(size),
            parser: Parser::default(),
            parsed: Vec::with_capacity(size),
            reaped: Vec::with_capacity(size),
            log_limit: RateLimiter::new(10, Duration::from_secs(5)),
            pin,
            journal: None,
            unpublished_heads: Vec::with_capacity(size),
            timer,
            lock_deadline: None,
            front_admitted: false,
            throttled_since: None,
            epoch: Instant::now(),
            arrivals: Arrivals::new(size),
        }
    }

    /// The queue's timer's fd, to be watched next to the kick.
    pub fn timer_fd(&self) -> i32 {
        self.timer.fd()
    }

    fn clear_timer(&self) {
        self.timer.clear();
    }

    /// The worker's thread serves other queues too: it takes turns with
    /// them, coming back through `resume` (cleared of a previous
    /// connection's count here), and does not busy-poll.
    pub fn share_thread(&mut self, resume: Arc<EventFd>) {
        let _ = resume.read();
        self.resume = Some(resume);
    }

    /// The resume eventfd, to be watched next to the kick (see
    /// [`QueueWorker::share_thread`]).
    pub fn resume_fd(&self) -> Option<i32> {
        self.resume.as_deref().map(std::os::fd::AsRawFd::as_raw_fd)
    }

    /// The engine's completion eventfd, to be watched next to the kick.
    pub fn completion_fd(&self) -> Option<i32> {
        self.core.completions().fd()
    }

    /// Guest memory the device accepted (see `mem`).
    pub fn set_memory(&mut self, mem: Arc<GuestMem>) {
        self.core.set_memory(&mem);
        self.mem = Some(mem);
    }

    /// Installs the inflight log (SET_INFLIGHT_FD); recovery runs when the
    /// ring starts.
    pub fn set_inflight(&mut self, log: Option<InflightQueue>) {
        self.journal = log;
        self.started = false;
    }

    /// Called for each event of this queue's.
    pub fn handle_event(&mut self, vring: &Vring, event: Event) {
        if self.closed {
            // A resume count or timer expiry left unread would wake the
            // thread's level-triggered epoll again and again.
            match (event, &self.resume) {
                (Event::Resume, Some(fd)) => {
                    let _ = fd.read();
                }
                (Event::Timer, _) => self.clear_timer(),
                _ => {}
            }
            return;
        }
        match event {
            Event::Kick => QueueMetrics::add(&self.metrics.kicks, 1),
            Event::Completion => self.core.completions().consume(),
            Event::Resume => {
                if let Some(fd) = &self.resume {
                    // Nonblocking: EAGAIN when a pass already consumed it.
                    let _ = fd.read();
                }
            }
            Event::Timer => self.clear_timer(),
        }
        if self.vring.is_none() {
            self.vring = Some(vring.clone());
            if let Some(cpu) = self.pin
                && let Err(e) = crate::cpu::pin_current_thread(cpu)
            {
                log::warn!("cannot pin queue worker to CPU {cpu}: {e}");
            }
        }
        self.poll.woke_up();
        if let Err(e) = self.run(vring) {
            warn_limited!(self.log_limit, "queue stopped: {e}");
        }
    }

    fn run(&mut self, vring: &Vring) -> Result<(), RingError> {
        let Some(mem) = self.mem.clone() else {
            return Ok(());
        };
        let mut state = vring.get_mut();
        if !state.get_queue().ready() {
            // Stopped ring: nothing to pop; completions are drained by stop().
            return Ok(());
        }
        // The rings, translated once for this pass (the driver moves them
        // only while the ring is stopped).
        let view = RingView::new(state.get_queue(), &*mem);
        let view = &view;
        if !self.started {
            self.shadow.reset(state.get_queue());
            self.arrivals.clear();
            self.started = true;
            if !self.try_lock() {
                // Requests wait for it (see `gate`), for a while.
                self.lock_deadline = Some(Instant::now() + LOCK_WAIT);
            }
            self.recover(&mut state, &mem, view)?;
        }
        if !state.is_enabled() {
            // SET_VRING_ENABLE 0: take nothing new off the ring. What is in
            // flight still completes (and GET_VRING_BASE waits for it).
            return self.complete(&mut state, view);
        }
        let device = self.device.clone();
        let stopping = || device.intake_closed();
        // Requests taken this pass: a worker that shares its thread yields
        // once it has taken a turn's worth with more waiting.
        let mut taken = 0usize;
        let budget = TURN.min(usize::from(device.queue_size()));
        loop {
            if self.cfg.signal == SignalMode::Early {
                self.complete(&mut state, view)?;
            }
            let (popped, full) = if stopping() {
                (0, false)
            } else {
                self.shadow.disable_kicks(state.get_queue(), view)?;
                self.pop_and_start(&mut state, &mem, view)?
            };
            if self.cfg.signal == SignalMode::Late {
                self.complete(&mut state, view)?;
            } else {
                self.publish(&mut state, view)?;
            }
            if full {
                // Backpressure: resume when completions free room, or when
                // the QoS timer says tokens are there (no polling then:
                // a throttled queue must not spin).
                if self.core.completions().must_poll() && self.core.in_flight() > 0 {
                    self.wait_engine();
                    continue;
                }
                return Ok(());
            }
            taken += popped;
            if popped > 0 && self.shadow.more_avail() {
                // Work known to be there: no need to read avail->idx to know.
                if taken >= budget && self.yield_turn() {
                    return Ok(());
                }
                continue;
            }
            if self.reap() > 0 {
                // Requests that completed inside the submit call (page-cache
                // hits) are signalled now, not after a trip through epoll
                // for the eventfd they also rang. Consumed after this reap
                // and before the next (in `complete`): what completes
                // later rings it again.
                self.core.completions().consume();
                self.complete(&mut state, view)?;
            }
            // Before polling: a poll would find the requests left on the
            // ring and come back here at once, again and again.
            if stopping() {
                return Ok(());
            }
            if self.poll_for_work(&state, view)? {
                continue;
            }
            if self.shadow.enable_kicks(state.get_queue(), view)? {
                if taken >= budget && self.yield_turn() {
                    return Ok(());
                }
                continue;
            }
            if self.core.completions().must_poll() && self.core.in_flight() > 0 {
                // IOPOLL posts no completion (and no eventfd) unless polled.
                self.wait_engine();
                continue;
            }
            if self.core.encrypted() {
                // What the AES calls of this pass left on the stack (round
                // keys, in spilled registers) is not kept while it sleeps,
                // when a core dump would find it.
                crate::crypto::key::scrub_after_pass();
            }
            self.poll.sleeping(self.awaiting());
            return Ok(());
        }
    }

    /// After a back-end restart: repairs the inflight log, resumes the
    /// avail ring after everything the previous process took, and
    /// resubmits what it had not completed, oldest first.
    ///
    /// The log comes from a previous process or the front-end, and may be
    /// garbage. Every head it names that the ring can have is answered
    /// exactly once: resubmitted, or refused with IOERR where its chain
    /// has a status byte, or with used length 0 where its chain cannot be
    /// rebuilt. Chains are parsed against guest memory only.
    fn recover(
        &mut self,
        state: &mut VringState<GuestMemoryAtomic<GuestMem>>,
        mem: &Arc<GuestMem>,
        view: &RingView<'_>,
    ) -> Result<(), RingError> {
        let Some(log) = self.journal.as_mut() else {
            return Ok(());
        };
        let queue = state.get_queue_mut();
        let size = queue.size();
        if log.desc_num() < size {
            // Heads past the region's queue size could not be logged.
            warn_limited!(
                self.log_limit,
                "inflight region laid out for queues of {}, the ring has {size}: \
                 this queue is not tracked",
                log.desc_num()
            );
            self.journal = None;
            return Ok(());
        }
        // Reading used->idx back is fine here: once per ring start.
        let used = queue.used_idx(&**mem, Ordering::Acquire)?.0;
        let rec = log.recover(used, size);
        if rec.beyond_ring > 0 {
            warn_limited!(
                self.log_limit,
                "inflight log: {} head(s) past the ring's {size} ignored",
                rec.beyond_ring
            );
        }
        log::debug!(
            "queue start: used->idx {used}, {} request(s) to resubmit",
            rec.resubmit.len()
        );
        if rec.resubmit.is_empty() {
            return Ok(());
        }
        info_limited!(
            self.log_limit,
            "queue: resubmitting {} request(s) left in flight by the previous back-end",
            rec.resubmit.len()
        );
        let (limits, capacity) = (self.device.limits(), self.device.capacity());
        let mut parsed = std::mem::take(&mut self.parsed);
        let parser = &mut self.parser;
        let unbuilt = |head| {
            Err(Rejected {
                head,
                status: None,
                error: RequestError::IllFormedChain,
            })
        };
        match Replay::new(queue, mem, &rec.resubmit) {
            Some(mut replay) => {
                parsed.extend(
                    replay
                        .chains()
                        .into_iter()
                        .map(|(head, chain)| match chain {
                            Some(c) => parser.parse(c, mem, limits, capacity, size),
                            None => unbuilt(head),
                        }),
                )
            }
            None => {
                warn_limited!(
                    self.log_limit,
                    "cannot rebuild in-flight requests for resubmission"
                );
                parsed.extend(rec.resubmit.iter().map(|&head| unbuilt(head)));
            }
        }
        // The previous back-end took these off the avail ring; each has its
        // answer below.
        let queue = state.get_queue_mut();
        queue.set_next_avail(used.wrapping_add(rec.resubmit.len() as u16));
        let now = clock(self.epoch);
        for p in parsed.drain(..) {
            match p {
                Ok(mut req) => {
                    req.set_popped(now);
                    self.start(state.get_queue_mut(), view, req)
                }
                Err(rej) => self.reject(state.get_queue_mut(), view, rej),
            }
        }
        self.parsed = parsed;
        self.commit();
        self.publish(state, view)
    }

    /// Ends this turn with work left, on a thread shared with other
    /// queues: the resume eventfd brings the worker back after the
    /// thread's other pending events. False (go on) when the thread is
    /// not shared, or the eventfd cannot be written.
    fn yield_turn(&mut self) -> bool {
        let Some(fd) = &self.resume else {
            return false;
        };
        if fd.write(1).is_err() {
            return false;
        }
        QueueMetrics::add(&self.metrics.yields, 1);
        true
    }

    /// Busy-polls the avail ring and the engine for the adaptive window.
    /// Returns true when work showed up. Not on a thread that serves other
    /// queues, nor (with the poll checks) on a CPU another worker polls on;
    /// the window ends early when the thread is preempted.
    fn poll_for_work(
        &mut self,
        state: &VringState<GuestMemoryAtomic<GuestMem>>,
        view: &RingView<'_>,
    ) -> Result<bool, RingError> {
        if self.resume.is_some() {
            return Ok(false);
        }
        let wait = self.awaiting();
        let Some(window) = self.poll.window(wait) else {
            return Ok(false);
        };
        let checks = self.poll.checks();
        if checks && self.poll.preempted_since() {
            QueueMetrics::add(&self.metrics.poll_preempted, 1);
            self.poll.ended(wait, Outcome::Preempted);
            return Ok(false);
        }
        let _claim = if checks {
            match CpuClaim::take(self.poll_token) {
                Some(c) => Some(c),
                None => {
                    QueueMetrics::add(&self.metrics.poll_cpu_busy, 1);
                    return Ok(false);
                }
            }
        } else {
            None
        };
        let start = Instant::now();
        let deadline = start + window;
        let mut last = start;
        // Time preempted, not spent polling.
        let mut lost = Duration::ZERO;
        let mut spins = 0u64;
        let outcome = loop {
            spins += 1;
            if self.shadow.avail_pending(state.get_queue(), view)? || self.reap() > 0 {
                break Outcome::Found;
            }
            let now = Instant::now();
            let gap = now - last;
            if gap >= PREEMPT_GAP {
                lost += gap;
                if checks {
                    last = now;
                    break Outcome::Preempted;
                }
            }
            last = now;
            if now >= deadline {
                break Outcome::Expired;
            }
            if checks {
                yield_cpu();
            } else {
                std::hint::spin_loop();
            }
        };
        let spent = last.saturating_duration_since(start).saturating_sub(lost);
        QueueMetrics::add(
            &self.metrics.poll_ns,
            u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX),
        );
        QueueMetrics::add(&self.metrics.poll_iterations, spins);
        match outcome {
            Outcome::Found => QueueMetrics::add(&self.metrics.poll_hits, 1),
            Outcome::Preempted => QueueMetrics::add(&self.metrics.poll_preempted, 1),
            Outcome::Expired => {}
        }
        self.poll.ended(wait, outcome);
        Ok(outcome == Outcome::Found)
    }

    /// What this worker would poll or sleep for now.
    fn awaiting(&self) -> Wait {
        if self.core.in_flight() > 0 {
            Wait::Device
        } else {
            Wait::Guest
        }
    }

    fn wait_engine(&mut self) {
        if let Err(err) = self.core.wait() {
            warn_limited!(self.log_limit, "waiting for I/O failed: {err}");
        }
    }

    /// Hands the batch to the kernel.
    fn commit(&mut self) {
        match self.core.commit() {
            Ok(0) => {}
            Ok(n) => {
                QueueMetrics::add(&self.metrics.submit_calls, 1);
                QueueMetrics::add(&self.metrics.submitted_sqes, u64::from(n));
            }
            Err(err) => warn_limited!(self.log_limit, "submitting I/O failed: {err}"),
        }
    }

    /// Gives deferred requests to the engine, oldest first, while they
    /// pass the gate (all of them, with `force`, but for those the image
    /// lock refuses) and the engine has room. Returns whether all of them
    /// went.
    fn start_deferred(&mut self, queue: &mut Queue, view: &RingView<'_>, force: bool) -> bool {
        while let Some(req) = self.deferred.pop_front() {
            if !self.front_admitted {
                match self.gate(&req, force) {
                    Gate::Go => {}
                    Gate::Wait => {
                        self.deferred.push_front(req);
                        return false;
                    }
                    Gate::Refuse => {
                        self.fail(queue, view, req);
                        continue;
                    }
                }
            }
            self.front_admitted = true;
            if let Err(Full(req)) = self.core.submit(req) {
                self.deferred.push_front(req);
                return false;
            }
            self.front_admitted = false;
        }
        true
    }

    /// Whether `req` may go to the engine now: the image lock is held (or
    /// the request does no I/O on the image), and QoS admits it. A request
    /// that must wait arms the queue's timer.
    #[inline]
    fn gate(&mut self, req: &Request, force: bool) -> Gate {
        if !self.holds_lock && req.kind().class().op.is_some() && !self.try_lock() {
            return self.lock_wait(force);
        }
        if self.admit(req, force) {
            Gate::Go
        } else {
            Gate::Wait
        }
    }

    /// Another process holds the image lock: wait for it while the ring's
    /// start allows (never when stopping: `force`), else refuse.
    #[cold]
    fn lock_wait(&mut self, force: bool) -> Gate {
        if !force && self.lock_deadline.is_some_and(|d| Instant::now() < d) {
            if let Err(e) = self.timer.arm(LOCK_RETRY) {
                warn_limited!(
                    self.log_limit,
                    "queue timer: {e}; not waiting for the image lock"
                );
                return Gate::Refuse;
            }
            return Gate::Wait;
        }
        if self.lock_deadline.take().is_some() {
            match &self.unclaimed {
                Some(e @ Unclaimed::Unmarked) => {
                    warn_limited!(self.log_limit, "{e}: requests fail until they are")
                }
                _ => warn_limited!(
                    self.log_limit,
                    "{}: requests fail until it is released",
                    crate::io::Locked
                ),
            }
        }
        Gate::Refuse
    }

    /// Answers a request that cannot go to the engine: IOERR. (Another
    /// process writes the image: failing is all this device can do
    /// without corrupting it.)
    fn fail(&mut self, queue: &mut Queue, view: &RingView<'_>, req: Request) {
        let c = Completion {
            req,
            status: Status::IoErr,
            written: 0,
        };
        let now = clock(self.epoch);
        self.finish(queue, view, c, now);
    }

    /// Asks QoS whether `req` may go to the engine now. With no limits
    /// set (and no request waiting), that is one relaxed load.
    #[inline]
    fn admit(&mut self, req: &Request, force: bool) -> bool {
        if !self.device.qos().active() && self.throttled_since.is_none() {
            return true;
        }
        self.admit_limited(req, force)
    }

    /// Reads and writes draw their bytes; discard and write-zeroes count
    /// as a write with no bytes (they carry no data, and charging their
    /// range would stall the queue for a whole-disk discard); a flush
    /// draws nothing, but waits its turn behind a throttled request.
    /// (GET_ID never gets here: `start` answers it at once.) A refused
    /// request arms the queue's timer.
    #[cold]
    fn admit_limited(&mut self, req: &Request, force: bool) -> bool {
        let verdict = match req.kind().class().qos {
            Some((dir, counts_bytes)) => {
                let bytes = if counts_bytes { req.data_len() } else { 0 };
                self.device.qos().admit(dir, u64::from(bytes), force)
            }
            None => Ok(()),
        };
        match verdict {
            Ok(()) => {
                if let Some(since) = self.throttled_since.take() {
                    let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    QueueMetrics::add(&self.metrics.throttled_ns, ns);
                }
                true
            }
            Err(wait) => {
                if self.throttled_since.is_none() {
                    self.throttled_since = Some(Instant::now());
                    QueueMetrics::add(&self.metrics.throttled_requests, 1);
                }
                if let Err(e) = self.timer.arm(wait.min(MAX_THROTTLE_SLEEP)) {
                    // Nothing would wake the queue: let the request go.
                    warn_limited!(self.log_limit, "QoS timer: {e}; request not throttled");
                    return true;
                }
                false
            }
        }
    }

    /// Pops and parses requests while the engine has room, hands them to it
    /// and commits them with one io_uring_enter. Returns (popped, engine
    /// full).
    fn pop_and_start(
        &mut self,
        state: &mut VringState<GuestMemoryAtomic<GuestMem>>,
        mem: &Arc<GuestMem>,
        view: &RingView<'_>,
    ) -> Result<(usize, bool), RingError> {
        if !self.start_deferred(state.get_queue_mut(), view, false) || self.core.room() == 0 {
            self.commit();
            // What waits on the ring meanwhile is dated from now.
            let queue = state.get_queue();
            if let Ok(idx) = view.avail_idx() {
                self.arrivals
                    .saw(queue.next_avail(), idx, clock(self.epoch));
            }
            return Ok((0, true));
        }
        let limit = match self.cfg.max_batch {
            0 => self.core.room(),
            n => self.core.room().min(n),
        };
        let mut parsed = std::mem::take(&mut self.parsed);
        let queue_size = state.get_queue().size();
        let (limits, capacity) = (self.device.limits(), self.device.capacity());
        let journal = &mut self.journal;
        let parser = &mut self.parser;
        let next = state.get_queue().next_avail();
        let popped = self
            .shadow
            .pop(state.get_queue_mut(), view, limit, |chain| {
                // Logged before anything is done with it: from here until
                // its used element is published, a crash must resubmit it.
                if let Some(log) = journal.as_mut() {
                    log.mark(chain.head_index());
                }
                parsed.push(parser.parse(chain, mem, limits, capacity, queue_size));
            });
        // The batch's time, for each of its requests, unless one was seen
        // waiting before.
        let now = if parsed.is_empty() {
            0
        } else {
            clock(self.epoch)
        };
        let seen = !self.arrivals.is_empty();
        for (i, p) in parsed.drain(..).enumerate() {
            match p {
                Ok(mut req) => {
                    let at = match seen {
                        true => self.arrivals.first_seen(next, i).unwrap_or(now),
                        false => now,
                    };
                    req.set_popped(at.min(now));
                    self.start(state.get_queue_mut(), view, req)
                }
                Err(rej) => self.reject(state.get_queue_mut(), view, rej),
            }
            if self.cfg.notify == NotifyMode::PerRequest {
                self.publish(state, view)?;
            }
        }
        self.parsed = parsed;
        let popped = popped?;
        self.commit();
        let full = !self.deferred.is_empty() || (self.shadow.more_avail() && self.core.room() == 0);
        Ok((popped, full))
    }

    /// Hands `req` to the engine, or behind the deferred ones.
    fn start(&mut self, queue: &mut Queue, view: &RingView<'_>, req: Request) {
        if !self.deferred.is_empty() {
            self.deferred.push_back(req);
            return;
        }
        match self.gate(&req, false) {
            Gate::Go => {
                if let Err(Full(req)) = self.core.submit(req) {
                    self.deferred.push_back(req);
                    self.front_admitted = true;
                }
            }
            Gate::Wait => self.deferred.push_back(req),
            Gate::Refuse => self.fail(queue, view, req),
        }
    }

    /// Takes the completions available now into `reaped`, where
    /// `complete` finishes them, and submits the I/O that metadata answers
    /// reaped with them started. Returns how many.
    fn reap(&mut self) -> u32 {
        let reaped = &mut self.reaped;
        let n = self.core.reap(|c| reaped.push(c));
        // Metadata work answered in the reap (the format's, done on this
        // thread or the metadata thread's) may have started its request's
        // data I/O: to the kernel now, before the pass can sleep.
        if self.core.answered() {
            self.commit();
        }
        if n > 0 {
            QueueMetrics::add(&self.metrics.completion_passes, 1);
            QueueMetrics::add(&self.metrics.completions, u64::from(n));
        }
        n
    }

    /// Reaps the engine's completions, finishes their requests (and those
    /// reaped before), and publishes.
    fn complete(
        &mut self,
        state: &mut VringState<GuestMemoryAtomic<GuestMem>>,
        view: &RingView<'_>,
    ) -> Result<(), RingError> {
        self.reap();
        let mut reaped = std::mem::take(&mut self.reaped);
        // The pass's time, for each request it finishes.
        let now = if reaped.is_empty() {
            0
        } else {
            clock(self.epoch)
        };
        // Every reaped request is finished, whatever happens to the others.
        let mut published = Ok(());
        for c in reaped.drain(..) {
            self.finish(state.get_queue_mut(), view, c, now);
            if self.cfg.notify == NotifyMode::PerRequest && published.is_ok() {
                published = self.publish(state, view);
            }
        }
        self.reaped = reaped;
        // A retry the engine queued while reaping goes to the kernel now.
        self.commit();
        published?;
        self.publish(state, view)
    }

    /// Writes a finished request's status byte and used element, and
    /// counts it as done at `now` (the worker's [`clock`]). Its own
    /// memory snapshot takes the status; the used ring is in `mem`, the
    /// current one. A ring that cannot take the element is logged: the
    /// request is done either way.
    fn finish(&mut self, queue: &mut Queue, view: &RingView<'_>, c: Completion, now: u64) {
        let Completion {
            req,
            status,
            written,
        } = c;
        self.count_done(&req, status, now);
        status.write(req.mem(), req.status_addr());
        let len = if status.is_ok() { written + 1 } else { 1 };
        let head = req.head();
        if let Err(e) = self.add_used(queue, view, head, len) {
            warn_limited!(self.log_limit, "request {head}: used ring: {e}");
        }
        self.parser.recycle(req);
    }

    /// Answers a refused request: status byte if there is one, used length
    /// 0 if not.
    fn reject(&mut self, queue: &mut Queue, view: &RingView<'_>, rej: Rejected) {
        let len = match rej.status {
            Some(addr) => {
                let status = rej.error.status();
                if status.write(view.mem(), addr) {
                    if status == Status::Unsupp {
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
        if let Err(e) = self.add_used(queue, view, rej.head, len) {
            warn_limited!(self.log_limit, "request {}: used ring: {e}", rej.head);
        }
    }

    /// Writes a used element (not yet visible to the driver).
    fn add_used(
        &mut self,
        queue: &mut Queue,
        view: &RingView<'_>,
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
        self.shadow.add_used(queue, view, head, len)?;
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
        view: &RingView<'_>,
    ) -> Result<(), RingError> {
        if let Some(log) = &self.journal {
            log.before_publish(&self.unpublished_heads);
        }
        let n = self.shadow.publish(state.get_queue(), view)?;
        if let Some(log) = &self.journal {
            log.after_publish(&self.unpublished_heads, state.get_queue().next_used());
            self.unpublished_heads.clear();
        }
        if n == 0 {
            return Ok(());
        }
        if self.shadow.needs_notification(state.get_queue(), view)? {
            if state.signal_used_queue().is_ok() {
                QueueMetrics::add(&self.metrics.notifications, 1);
            }
        } else {
            QueueMetrics::add(&self.metrics.notifications_suppressed, 1);
        }
        Ok(())
    }

    /// Counts a request finished at `now`: by type, its bytes or its
    /// error, and its latency (next to its count, so that the histograms
    /// add up to the request counters).
    #[inline]
    fn count_done(&self, req: &Request, status: Status, now: u64) {
        let m = &self.metrics;
        let class = req.kind().class();
        m.count_request(class.metric);
        m.latency
            .record(class.metric, now.saturating_sub(req.popped()));
        if status.is_ok() {
            let bytes = u64::from(req.data_len());
            match class.bytes {
                Some(Direction::Read) => QueueMetrics::add(&m.read_bytes, bytes),
                Some(Direction::Write) => QueueMetrics::add(&m.write_bytes, bytes),
                None => {}
            }
        } else {
            QueueMetrics::add(&m.errors_ioerr, 1);
        }
    }

    /// The ring is being stopped (GET_VRING_BASE) or the device reset:
    /// everything taken off it completes and is published, and what it
    /// wrote is durable, before this returns: the next reader of the image
    /// may be another daemon (the destination of a migration). The ring may
    /// start again afterwards.
    pub fn stop(&mut self) {
        self.finish_all();
        if let Err(e) = self.core.make_durable() {
            log::error!("making the image durable as the ring stops: {e}");
        }
        self.started = false;
        self.unlock_image();
    }

    /// The connection is over (or the daemon stops): from now on no kick is
    /// taken, and everything taken before completes and is published before
    /// this returns.
    pub fn drain(&mut self) {
        self.closed = true;
        self.finish_all();
        self.started = false;
        self.unlock_image();
    }

    /// Counts this queue among the image's users
    /// ([`Device::claim_image`]: the first takes the image lock and loads
    /// the dirty bitmaps); false while another process holds the lock, or
    /// QEMU's bitmaps in the image could not be marked in use. Tried when
    /// the ring starts, and for each request until it succeeds; never
    /// waits.
    fn try_lock(&mut self) -> bool {
        if self.holds_lock {
            return true;
        }
        let claimed = self.device.claim_image();
        self.holds_lock = claimed.is_ok();
        if self.holds_lock {
            self.lock_deadline = None;
        }
        // Only another process's lock is waited for as such (`ctl status`
        // shows it); bitmaps that could not be marked are retried all the
        // same, and logged apart.
        let waits = matches!(claimed, Err(Unclaimed::Locked(_)));
        self.unclaimed = claimed.err();
        if self.waits_lock != waits {
            self.waits_lock = waits;
            if let Some(lock) = self.device.image_lock() {
                lock.set_waiting(waits);
            }
        }
        self.holds_lock
    }

    /// The ring stopped: after its I/O completed and was made durable, the
    /// next daemon may take the image (the last holder writes the bitmaps
    /// out and gives up the lock).
    fn unlock_image(&mut self) {
        self.lock_deadline = None;
        if std::mem::take(&mut self.holds_lock) {
            self.device.release_image();
        }
        if std::mem::take(&mut self.waits_lock)
            && let Some(lock) = self.device.image_lock()
        {
            lock.set_waiting(false);
        }
    }

    /// Holds still for a switch of what writes do first (a backup's
    /// instant, a bitmap added: [`crate::device::tracking`]): completes
    /// and publishes every request in flight, and starts none; those
    /// popped and waiting stay waiting. Called with the worker locked,
    /// which keeps it from taking anything more until it is let go.
    pub fn settle(&mut self) {
        if self.core.in_flight() == 0 {
            return;
        }
        let (Some(vring), Some(mem)) = (self.vring.clone(), self.mem.clone()) else {
            return;
        };
        let mut state = vring.get_mut();
        let view = RingView::new(state.get_queue(), &*mem);
        while self.core.in_flight() > 0 {
            if let Err(e) = self.core.wait() {
                warn_limited!(self.log_limit, "settling queue: {e}");
                std::thread::sleep(Duration::from_millis(1));
            }
            if let Err(e) = self.complete(&mut state, &view) {
                warn_limited!(self.log_limit, "settling queue: {e}");
            }
        }
    }

    /// The engine's core, drained and reset, for the next connection's
    /// worker.
    pub fn into_core(mut self) -> Core<E> {
        self.drain();
        self.core.reset();
        self.core
    }

    /// Runs every request taken off the ring to completion: deferred ones
    /// go to the engine as it frees room, admitted by QoS regardless of
    /// its limits (and charged), and an error on one request (or on the
    /// ring) does not stop the others from finishing.
    fn finish_all(&mut self) {
        if self.core.in_flight() == 0 && self.deferred.is_empty() {
            return;
        }
        // Requests are only taken in `run`, which records both first.
        let (Some(vring), Some(mem)) = (self.vring.clone(), self.mem.clone()) else {
            return;
        };
        let mut state = vring.get_mut();
        loop {
            let view = RingView::new(state.get_queue(), &*mem);
            self.start_deferred(state.get_queue_mut(), &view, true);
            self.commit();
            if self.core.in_flight() == 0 && self.deferred.is_empty() {
                break;
            }
            if let Err(e) = self.core.wait() {
                warn_limited!(self.log_limit, "draining queue: {e}");
                std::thread::sleep(Duration::from_millis(1));
            }
            if let Err(e) = self.complete(&mut state, &view) {
                warn_limited!(self.log_limit, "draining queue: {e}");
            }
        }
    }
}

#[cfg(test)]
#[path = "worker_tests.rs"]
pub(crate) mod tests;
