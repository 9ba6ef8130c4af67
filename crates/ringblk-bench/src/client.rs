//! The load generator: an independent vhost-user-blk front-end built on
//! libblkio, so it drives ringblk, qemu-storage-daemon or any other backend
//! the same way, with no guest kernel in between.
//!
//! One thread per virtqueue keeps `iodepth` requests in flight: submit all,
//! then repeatedly wait for at least one completion, record its latency
//! (enqueue to completion seen) and resubmit in the same slot. I/O before
//! the end of the ramp and during the final drain is not measured.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, Errno, ReqFlags};
use hdrhistogram::Histogram;

use super::args::RwMode;

/// libblkio's driver for a vhost-user-blk Unix socket.
const DRIVER: &str = "virtio-blk-vhost-user";

/// A wait longer than this for any completion means the backend is stuck.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of the load generator.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// libblkio refused a step of the set-up or an I/O call.
    #[error("libblkio {what}: {msg}")]
    Blkio { what: String, msg: String },
    /// Requests stayed in flight with no completion for [`STALL_TIMEOUT`].
    #[error("queue {queue}: no completion for {}s with {inflight} request(s) in flight (backend stalled?)", STALL_TIMEOUT.as_secs())]
    Stalled { queue: usize, inflight: usize },
    /// The workload does not fit the device.
    #[error("{0}")]
    Invalid(String),
}

fn blkio_err(what: impl Into<String>) -> impl FnOnce(blkio::Error) -> ClientError {
    let what = what.into();
    move |e| ClientError::Blkio {
        what,
        msg: e.to_string(),
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Workload {
    pub rw: RwMode,
    /// Percent reads for [`RwMode::Randrw`].
    pub mix: u8,
    pub bs: u64,
    pub iodepth: u32,
    pub queues: u16,
    pub runtime: Duration,
    pub ramp: Duration,
    pub poll: bool,
    pub queue_size: u32,
    /// Use only the first `size` bytes of the device.
    pub size: Option<u64>,
    /// Random patterns: one request per region of this many bytes, the
    /// regions in a random order; the window ends when a queue has none
    /// left.
    pub distinct: Option<u64>,
    /// Pin every client thread to this CPU.
    pub cpu: Option<usize>,
}

/// The two instants around the measured window, reported to the caller so
/// it can sample CPU time and counters exactly there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Edge {
    WindowStart,
    WindowEnd,
}

/// What the client measured.
pub struct LoadOutcome {
    /// Latency in nanoseconds of every request completed in the window.
    pub hist: Histogram<u64>,
    pub reads: u64,
    pub writes: u64,
    pub bytes: u64,
    pub errors: u64,
    /// I/Os completed over the whole run, ramp and drain included.
    pub total_ios: u64,
    /// Writes among them.
    pub total_writes: u64,
    pub total_errors: u64,
    pub first_error: Option<String>,
    /// Actual length of the measured window.
    pub window: Duration,
    /// Device size reported by the backend.
    pub capacity: u64,
}

impl LoadOutcome {
    pub fn ios(&self) -> u64 {
        self.reads + self.writes
    }
}

/// Connects to `socket`, retrying while it does not exist or refuses
/// connections (the backend is still starting) for up to `connect_timeout`.
pub fn connect(socket: &str, connect_timeout: Duration) -> Result<Blkio, ClientError> {
    let deadline = Instant::now() + connect_timeout;
    loop {
        let mut b = Blkio::new(DRIVER).map_err(blkio_err("new"))?;
        b.set_str("path", socket).map_err(blkio_err("path"))?;
        match b.connect() {
            Ok(()) => return Ok(b),
            Err(e)
                if Instant::now() < deadline
                    && [Errno::NOENT, Errno::CONNREFUSED].contains(&e.errno()) =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(blkio_err(format!("connect {socket}"))(e)),
        }
    }
}

/// Runs `w` on a connected `blkio`, calling `on_edge` at the start and the
/// end of the measured window and `on_tick` about 4 times a second with the
/// time elapsed and the I/Os completed so far.
pub fn run(
    mut blkio: Blkio,
    w: &Workload,
    on_edge: &mut dyn FnMut(Edge),
    on_tick: &mut dyn FnMut(Duration, u64),
) -> Result<LoadOutcome, ClientError> {
    let capacity = blkio.get_u64("capacity").map_err(blkio_err("capacity"))?;
    let region = w.size.map_or(capacity, |s| s.min(capacity));
    if w.bs == 0 || !w.bs.is_multiple_of(512) || region < w.bs || w.iodepth == 0 || w.queues == 0 {
        return Err(ClientError::Invalid(format!(
            "bs {} (a multiple of 512), iodepth {}, queues {} do not fit a {region}-byte device",
            w.bs, w.iodepth, w.queues
        )));
    }
    if let Some(d) = w.distinct
        && (!w.rw.is_random() || d < w.bs || d % w.bs != 0 || d > region / u64::from(w.queues))
    {
        return Err(ClientError::Invalid(format!(
            "--distinct {d}: for random patterns, a multiple of bs {} that fits {} times in the {region}-byte device",
            w.bs, w.queues
        )));
    }
    let (n_queues, n_poll) = if w.poll { (0, w.queues) } else { (w.queues, 0) };
    blkio
        .set_i32("num-queues", n_queues.into())
        .map_err(blkio_err("num-queues"))?;
    blkio
        .set_i32("num-poll-queues", n_poll.into())
        .map_err(blkio_err("num-poll-queues"))?;
    let qsize = i32::try_from(w.queue_size).unwrap_or(i32::MAX);
    blkio
        .set_i32("queue-size", qsize)
        .map_err(blkio_err(format!("queue-size {}", w.queue_size)))?;
    let started = blkio.start().map_err(blkio_err("start"))?;
    let queues = if w.poll {
        started.poll_queues
    } else {
        started.queues
    };

    // One shared memory region (vhost-user backends can only reach memory
    // the front-end has mapped for them): iodepth buffers per queue.
    let align = blkio
        .get_u64("mem-region-alignment")
        .map_err(blkio_err("mem-region-alignment"))?
        .max(1);
    let per_queue = w.bs * u64::from(w.iodepth);
    let len = (per_queue * u64::from(w.queues)).div_ceil(align) * align;
    let len = usize::try_from(len).map_err(|_| ClientError::Invalid("buffers too large".into()))?;
    let mem = blkio
        .alloc_mem_region(len)
        .map_err(blkio_err("alloc_mem_region"))?;
    blkio
        .map_mem_region(&mem)
        .map_err(blkio_err("map_mem_region"))?;
    // SAFETY: libblkio just mapped `mem.len` writable bytes at `mem.addr`
    // for us, and no request uses them yet.
    fill_pattern(unsafe { std::slice::from_raw_parts_mut(mem.addr as *mut u8, mem.len) });

    let start = Instant::now();
    let window = start + w.ramp;
    let end = window + w.runtime;
    let done = AtomicU64::new(0);
    let early = EarlyEnd::new(start);
    let outcome = std::thread::scope(|s| {
        let workers: Vec<_> = queues
            .into_iter()
            .enumerate()
            .map(|(i, q)| {
                let base = mem.addr + i * per_queue as usize;
                let ctx = Worker {
                    index: i,
                    w,
                    region,
                    base,
                    window,
                    end,
                    early: &early,
                    done: &done,
                };
                s.spawn(move || ctx.run(q))
            })
            .collect();
        // An early end must be seen at once: it is the window's edge.
        let tick = if w.distinct.is_some() {
            Duration::from_millis(5)
        } else {
            Duration::from_millis(250)
        };
        drive(window, end, &early, tick, &done, on_edge, on_tick);
        let mut total = WorkerStats::new();
        let mut first_err = None;
        for h in workers {
            match h.join() {
                Ok(Ok(st)) => total.merge(st),
                Ok(Err(e)) => first_err = first_err.or(Some(e)),
                Err(_) => {
                    first_err =
                        first_err.or(Some(ClientError::Invalid("client thread panicked".into())))
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(total),
        }
    })?;
    blkio.unmap_mem_region(&mem);
    let measured = early.get().map_or(end, |e| e.min(end));
    if measured <= window {
        return Err(ClientError::Invalid(format!(
            "--distinct: every {}-byte region had its request during the ramp; nothing was measured (a larger device or a shorter ramp)",
            w.distinct.unwrap_or(0)
        )));
    }
    Ok(LoadOutcome {
        hist: outcome.hist,
        reads: outcome.reads,
        writes: outcome.writes,
        bytes: outcome.bytes,
        errors: outcome.errors,
        total_ios: outcome.total_ios,
        total_writes: outcome.total_writes,
        total_errors: outcome.total_errors,
        first_error: outcome.first_error,
        window: measured - window,
        capacity,
    })
}

/// The main thread's part: wake at the window edges (the end may come
/// early, see [`EarlyEnd`]) and tick the progress every `tick` at most.
fn drive(
    window: Instant,
    end: Instant,
    early: &EarlyEnd,
    tick: Duration,
    done: &AtomicU64,
    on_edge: &mut dyn FnMut(Edge),
    on_tick: &mut dyn FnMut(Duration, u64),
) {
    let start = Instant::now();
    let mut edge_sent = false;
    loop {
        let now = Instant::now();
        let end = early.get().map_or(end, |e| e.min(end));
        if !edge_sent && now >= window && now < end {
            on_edge(Edge::WindowStart);
            edge_sent = true;
        }
        if now >= end {
            on_edge(Edge::WindowEnd);
            return;
        }
        on_tick(now - start, done.load(Ordering::Relaxed));
        let next = if edge_sent { end } else { window };
        std::thread::sleep((next - now).min(tick));
    }
}

/// The instant a queue ran out of `--distinct` regions, which ends the
/// window for every queue: after it, a request would go to a region that
/// already had one (on an overlay, to a cluster already allocated).
struct EarlyEnd {
    start: Instant,
    /// Nanoseconds after `start`; u64::MAX while the run goes on.
    at_ns: AtomicU64,
}

impl EarlyEnd {
    fn new(start: Instant) -> EarlyEnd {
        EarlyEnd {
            start,
            at_ns: AtomicU64::new(u64::MAX),
        }
    }

    /// Ends the window at `now`, unless it already ended.
    fn set(&self, now: Instant) {
        let ns = u64::try_from((now - self.start).as_nanos()).unwrap_or(u64::MAX - 1);
        let _ = self
            .at_ns
            .compare_exchange(u64::MAX, ns, Ordering::AcqRel, Ordering::Acquire);
    }

    fn get(&self) -> Option<Instant> {
        match self.at_ns.load(Ordering::Acquire) {
            u64::MAX => None,
            ns => Some(self.start + Duration::from_nanos(ns)),
        }
    }
}

/// Fills write buffers with non-repeating bytes so no layer can shortcut
/// zeroes or compress them.
fn fill_pattern(buf: &mut [u8]) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for chunk in buf.chunks_mut(8) {
        let v = rng.next().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// xorshift64*: fast and good enough to spread offsets; not for secrets.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// The indices 0..n in an order that looks random, each once per pass:
/// a bijection of the next power of two (odd multiplications and
/// xor-shifts, each invertible), skipping what falls outside 0..n (under
/// half of the draws). No table, so a terabyte device costs nothing.
struct Permutation {
    n: u64,
    /// Bits of the power of two at or above `n`.
    bits: u32,
    seed: u64,
    next: u64,
}

impl Permutation {
    fn new(n: u64, seed: u64) -> Permutation {
        Permutation {
            n,
            bits: n.next_power_of_two().trailing_zeros(),
            seed,
            next: 0,
        }
    }

    /// The next index; after n of them the same order starts over.
    fn next(&mut self) -> u64 {
        if self.n <= 1 {
            return 0;
        }
        let mask = (1u64 << self.bits) - 1;
        let shift = self.bits / 2 + 1;
        loop {
            let mut x = (self.next ^ self.seed) & mask;
            self.next = (self.next + 1) & mask;
            x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15) & mask;
            x ^= x >> shift;
            x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9) & mask;
            x ^= x >> shift;
            if x < self.n {
                return x;
            }
        }
    }
}

/// Where a queue's requests go.
enum Offsets {
    /// Any block of the region, drawn independently.
    Random { blocks: u64 },
    /// One block at a random place in each `len`-byte region of this
    /// queue's share, the regions in a random order, `left` of them still
    /// to go.
    Distinct {
        first: u64,
        len: u64,
        order: Permutation,
        left: u64,
    },
    /// The next block after the last one, from this queue's own stretch.
    Sequential { blocks: u64, next: u64 },
}

impl Offsets {
    fn new(w: &Workload, region: u64, queue: usize) -> Offsets {
        let blocks = region / w.bs;
        let queues = u64::from(w.queues);
        match w.distinct {
            _ if !w.rw.is_random() => Offsets::Sequential {
                blocks,
                // Each queue starts on its own stretch.
                next: blocks / queues * queue as u64,
            },
            None => Offsets::Random { blocks },
            Some(len) => {
                // Each queue permutes its own share of the regions, so
                // no two queues hit the same one.
                let share = region / len / queues;
                Offsets::Distinct {
                    first: share * queue as u64,
                    len,
                    order: Permutation::new(share, 0x5851_F42D_4C95_7F2D ^ queue as u64),
                    left: share,
                }
            }
        }
    }

    /// The byte offset of the next request of `bs` bytes; None once every
    /// distinct region has had its request.
    fn next(&mut self, bs: u64, rng: &mut Rng) -> Option<u64> {
        Some(match self {
            Offsets::Random { blocks } => rng.next() % *blocks * bs,
            Offsets::Distinct {
                first,
                len,
                order,
                left,
            } => {
                *left = left.checked_sub(1)?;
                (*first + order.next()) * *len + rng.next() % (*len / bs) * bs
            }
            Offsets::Sequential { blocks, next } => {
                *next = (*next + 1) % *blocks;
                *next * bs
            }
        })
    }
}

/// Counts of one thread, merged at the end.
struct WorkerStats {
    hist: Histogram<u64>,
    reads: u64,
    writes: u64,
    bytes: u64,
    errors: u64,
    total_ios: u64,
    total_writes: u64,
    total_errors: u64,
    first_error: Option<String>,
}

impl WorkerStats {
    fn new() -> WorkerStats {
        WorkerStats {
            // 1 ns .. 1 h at 3 significant digits; larger values saturate.
            hist: Histogram::new_with_bounds(1, 3_600_000_000_000, 3)
                .expect("valid histogram bounds"),
            reads: 0,
            writes: 0,
            bytes: 0,
            errors: 0,
            total_ios: 0,
            total_writes: 0,
            total_errors: 0,
            first_error: None,
        }
    }

    fn merge(&mut self, o: WorkerStats) {
        // Same bounds on both sides, so adding cannot fail.
        let _ = self.hist.add(&o.hist);
        self.reads += o.reads;
        self.writes += o.writes;
        self.bytes += o.bytes;
        self.errors += o.errors;
        self.total_ios += o.total_ios;
        self.total_writes += o.total_writes;
        self.total_errors += o.total_errors;
        self.first_error = self.first_error.take().or(o.first_error);
    }
}

/// One client thread's fixed context.
struct Worker<'a> {
    index: usize,
    w: &'a Workload,
    /// Bytes of the device in use.
    region: u64,
    /// Address of this queue's first buffer in the mapped region.
    base: usize,
    window: Instant,
    end: Instant,
    early: &'a EarlyEnd,
    done: &'a AtomicU64,
}

/// A request in flight in one slot.
#[derive(Clone, Copy)]
struct Slot {
    at: Instant,
    read: bool,
}

impl Worker<'_> {
    fn run(self, mut q: Blkioq) -> Result<WorkerStats, ClientError> {
        if let Some(cpu) = self.w.cpu {
            ringblk_metrics::cpu::pin_current_thread(cpu).map_err(|e| {
                ClientError::Invalid(format!("pinning client thread to CPU {cpu}: {e}"))
            })?;
        }
        let depth = self.w.iodepth as usize;
        let mut rng = Rng(0x243F_6A88_85A3_08D3 ^ ((self.index as u64 + 1) << 32));
        let mut offsets = Offsets::new(self.w, self.region, self.index);
        let read_pct = u64::from(self.w.rw.read_percent(self.w.mix));
        let mut st = WorkerStats::new();
        let now = Instant::now();
        let mut slots = vec![
            Slot {
                at: now,
                read: true
            };
            depth
        ];
        // Whether a request went out; none once the regions ran out.
        let mut submit = |q: &mut Blkioq, slots: &mut [Slot], slot: usize, at: Instant| {
            let Some(off) = offsets.next(self.w.bs, &mut rng) else {
                self.early.set(at);
                return false;
            };
            let read = read_pct == 100 || (read_pct > 0 && rng.next() % 100 < read_pct);
            let buf = self.base + slot * self.w.bs as usize;
            let len = self.w.bs as usize;
            // libblkio only records the pointer; the buffer lies in the
            // region mapped in `run` that outlives every request (the
            // thread drains its queue before returning).
            if read {
                q.read(off, buf as *mut u8, len, slot, ReqFlags::empty());
            } else {
                q.write(off, buf as *const u8, len, slot, ReqFlags::empty());
            }
            slots[slot] = Slot { at, read };
            true
        };
        let mut inflight = 0;
        for slot in 0..depth {
            inflight += usize::from(submit(&mut q, &mut slots, slot, now));
        }
        let mut comps: Vec<MaybeUninit<Completion>> =
            (0..depth).map(|_| MaybeUninit::uninit()).collect();
        while inflight > 0 {
            let mut timeout = STALL_TIMEOUT;
            let n = match q.do_io(&mut comps, 1, Some(&mut timeout), None) {
                Ok(n) => n,
                Err(e) if e.errno() == Errno::TIME => {
                    return Err(ClientError::Stalled {
                        queue: self.index,
                        inflight,
                    });
                }
                Err(e) if e.errno() == Errno::INTR => continue,
                Err(e) => return Err(blkio_err("do_io")(e)),
            };
            let now = Instant::now();
            let end = self.early.get().map_or(self.end, |e| e.min(self.end));
            let measuring = now >= self.window && now < end;
            let draining = now >= end;
            for c in &comps[..n] {
                // SAFETY: do_io initialised the first `n` entries.
                let c = unsafe { c.assume_init_ref() };
                let slot = c.user_data;
                let Some(&Slot { at, read }) = slots.get(slot) else {
                    continue;
                };
                st.total_ios += 1;
                st.total_writes += u64::from(!read);
                if c.ret < 0 {
                    st.total_errors += 1;
                    if st.first_error.is_none() {
                        st.first_error = Some(format!(
                            "{} failed: {}",
                            if read { "read" } else { "write" },
                            Errno::from_raw_os_error(-c.ret)
                        ));
                    }
                }
                if measuring {
                    if c.ret < 0 {
                        st.errors += 1;
                    } else if read {
                        st.reads += 1;
                    } else {
                        st.writes += 1;
                    }
                    if c.ret >= 0 {
                        st.bytes += self.w.bs;
                    }
                    st.hist
                        .saturating_record((now - at).as_nanos().max(1) as u64);
                }
                if draining || !submit(&mut q, &mut slots, slot, now) {
                    inflight -= 1;
                }
            }
            self.done.fetch_add(n as u64, Ordering::Relaxed);
        }
        Ok(st)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_spreads() {
        let mut r = Rng(1);
        let mut seen = [0u32; 16];
        for _ in 0..16_000 {
            seen[(r.next() % 16) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 800), "{seen:?}");
    }

    #[test]
    fn permutation_visits_each_index_once_per_pass() {
        for n in [1u64, 2, 3, 5, 16, 17, 1000, 16384] {
            let mut p = Permutation::new(n, 42);
            for _pass in 0..2 {
                let mut seen: Vec<u64> = (0..n).map(|_| p.next()).collect();
                seen.sort_unstable();
                assert!(seen.iter().copied().eq(0..n), "n={n}");
            }
        }
        // Not the identity, nor nearly sequential.
        let mut p = Permutation::new(1024, 7);
        let v: Vec<u64> = (0..64).map(|_| p.next()).collect();
        let steps_of_one = v.windows(2).filter(|w| w[1] == w[0] + 1).count();
        assert!(steps_of_one < 4, "{v:?}");
    }

    #[test]
    fn distinct_offsets_never_share_a_region_across_queues() {
        let w = Workload {
            rw: RwMode::Randwrite,
            mix: 0,
            bs: 4096,
            iodepth: 1,
            queues: 2,
            runtime: Duration::ZERO,
            ramp: Duration::ZERO,
            poll: false,
            queue_size: 256,
            size: None,
            distinct: Some(65536),
            cpu: None,
        };
        let region = 64 * 65536;
        let mut rng = Rng(1);
        let mut regions = Vec::new();
        for q in 0..2 {
            let mut o = Offsets::new(&w, region, q);
            for _ in 0..32 {
                let off = o.next(w.bs, &mut rng).expect("a region left");
                assert_eq!(off % w.bs, 0);
                assert!(off + w.bs <= region);
                regions.push(off / 65536);
            }
            assert_eq!(o.next(w.bs, &mut rng), None, "one pass, then no more");
        }
        regions.sort_unstable();
        assert!(regions.iter().copied().eq(0..64), "{regions:?}");
    }

    #[test]
    fn pattern_is_not_zero() {
        let mut b = vec![0u8; 4099];
        fill_pattern(&mut b);
        assert!(b.iter().filter(|&&x| x == 0).count() < 100);
    }
}
