//! [`Client`]: a synchronous vhost-user-blk client on libblkio.

use std::mem::MaybeUninit;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

use crate::IO_TIMEOUT;

/// What [`Client::sustain`] saw.
pub struct Sustained {
    pub start: Instant,
    /// When each request completed, in order.
    pub done: Vec<Instant>,
    /// Requests that completed with an error.
    pub errors: u64,
}

impl Sustained {
    /// Completions a second from `from` to `to` after the start.
    pub fn rate(&self, from: Duration, to: Duration) -> f64 {
        let (a, b) = (self.start + from, self.start + to);
        let n = self.done.iter().filter(|t| **t >= a && **t < b).count();
        n as f64 / (to - from).as_secs_f64()
    }
}

/// The value of a libblkio call, or a panic naming the step.
fn ok<T>(what: &str, r: blkio::Result<T>) -> T {
    r.unwrap_or_else(|e| panic!("libblkio {what}: {e}"))
}

/// A vhost-user-blk front-end with one queue and one buffer, issuing one
/// request at a time (or a batch, with [`Client::batch`]).
pub struct Client {
    // Field order is drop order: the queue before the instance. The
    // region is unmapped and freed by libblkio when both are gone.
    queue: Blkioq,
    /// Queues 1.. of [`Client::connect_queues`].
    more: Vec<Blkioq>,
    /// The instance, kept for its queues and mapped region.
    _blkio: Blkio,
    region: MemoryRegion,
    pub capacity: u64,
    /// The device's blk_size, as libblkio reports it.
    pub request_alignment: i32,
}

/// `n` reads or writes of `chunk` bytes from `offset` on, the i-th from
/// the i-th `chunk` of the client's buffer: one batch over a region.
pub fn chunked(write: bool, offset: u64, n: usize, chunk: usize) -> Vec<Op> {
    (0..n)
        .map(|i| {
            let (offset, buf_off) = (offset + (i * chunk) as u64, i * chunk);
            match write {
                true => Op::Write {
                    offset,
                    buf_off,
                    len: chunk,
                },
                false => Op::Read {
                    offset,
                    buf_off,
                    len: chunk,
                },
            }
        })
        .collect()
}

/// One request of a batch.
#[derive(Clone, Copy, Debug)]
pub enum Op {
    /// Write `len` bytes of the buffer at `buf_off` to `offset`.
    Write {
        offset: u64,
        buf_off: usize,
        len: usize,
    },
    Read {
        offset: u64,
        buf_off: usize,
        len: usize,
    },
    Flush,
    Discard {
        offset: u64,
        len: u64,
    },
    WriteZeroes {
        offset: u64,
        len: u64,
    },
}

impl Client {
    /// Connects to `socket` with a buffer of `buf_len` bytes.
    pub fn connect(socket: &Path, buf_len: usize) -> Client {
        Client::connect_with(socket, buf_len, 1, false)
    }

    /// Connects to a read-only export (libblkio refuses to start on one
    /// otherwise).
    pub fn connect_read_only(socket: &Path, buf_len: usize) -> Client {
        Client::connect_with(socket, buf_len, 1, true)
    }

    /// Connects with `queues` virtqueues; the single-request methods use
    /// the first, [`Client::sustain_queues`] all of them.
    pub fn connect_queues(socket: &Path, buf_len: usize, queues: usize) -> Client {
        Client::connect_with(socket, buf_len, queues, false)
    }

    fn connect_with(socket: &Path, buf_len: usize, queues: usize, read_only: bool) -> Client {
        let mut blkio = ok("new", Blkio::new("virtio-blk-vhost-user"));
        let path = socket.to_str().expect("UTF-8 socket path");
        ok("path", blkio.set_str("path", path));
        if read_only {
            ok("read-only", blkio.set_bool("read-only", true));
        }
        ok("connect", blkio.connect());
        ok("num-queues", blkio.set_i32("num-queues", queues as i32));
        let capacity = ok("capacity", blkio.get_u64("capacity"));
        let request_alignment = ok("request-alignment", blkio.get_i32("request-alignment"));
        let mut started = ok("start", blkio.start());
        assert_eq!(started.queues.len(), queues, "queues started");
        let more = started.queues.split_off(1);
        let queue = started.queues.pop().expect("one queue");
        let align = ok(
            "mem-region-alignment",
            blkio.get_u64("mem-region-alignment"),
        )
        .max(1) as usize;
        let len = buf_len.div_ceil(align) * align;
        let region = ok("alloc", blkio.alloc_mem_region(len));
        ok("map", blkio.map_mem_region(&region));
        Client {
            queue,
            more,
            _blkio: blkio,
            region,
            capacity,
            request_alignment,
        }
    }

    /// The shared buffer.
    pub fn buf(&mut self) -> &mut [u8] {
        // SAFETY: libblkio mapped `region.len` writable bytes at
        // `region.addr`; no request is in flight outside `batch`, which
        // takes `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, self.region.len) }
    }

    /// Submits `ops` together and waits for all of them. Returns each
    /// request's result (0 or a negative errno), in order.
    pub fn batch(&mut self, ops: &[Op]) -> Vec<i32> {
        let on_first: Vec<(usize, Op)> = ops.iter().map(|&op| (0, op)).collect();
        self.batch_queues(&on_first)
    }

    /// [`Client::batch`] over several queues: each `(queue, op)` goes to
    /// its queue, all submitted before any is waited for.
    pub fn batch_queues(&mut self, ops: &[(usize, Op)]) -> Vec<i32> {
        let base = self.region.addr;
        let cap = self.region.len;
        let mut queues: Vec<&mut Blkioq> = std::iter::once(&mut self.queue)
            .chain(self.more.iter_mut())
            .collect();
        let mut used = vec![false; queues.len()];
        for (i, &(q, op)) in ops.iter().enumerate() {
            let f = ReqFlags::empty();
            used[q] = true;
            let queue = &mut queues[q];
            match op {
                Op::Write {
                    offset,
                    buf_off,
                    len,
                } => {
                    assert!(buf_off + len <= cap);
                    queue.write(offset, (base + buf_off) as *const u8, len, i, f)
                }
                Op::Read {
                    offset,
                    buf_off,
                    len,
                } => {
                    assert!(buf_off + len <= cap);
                    queue.read(offset, (base + buf_off) as *mut u8, len, i, f)
                }
                Op::Flush => queue.flush(i, f),
                Op::Discard { offset, len } => queue.discard(offset, len, i, f),
                Op::WriteZeroes { offset, len } => queue.write_zeroes(offset, len, i, f),
            }
        }
        let mut results = vec![None; ops.len()];
        let mut done = 0;
        let deadline = Instant::now() + IO_TIMEOUT;
        let mut completions: Vec<MaybeUninit<Completion>> =
            (0..ops.len()).map(|_| MaybeUninit::uninit()).collect();
        let one_queue = used.iter().filter(|&&u| u).count() <= 1;
        while done < ops.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "{} of {} requests did not complete within {IO_TIMEOUT:?}",
                ops.len() - done,
                ops.len()
            );
            let mut any = false;
            for (q, queue) in queues.iter_mut().enumerate() {
                if !used[q] {
                    continue;
                }
                // One queue: sleep in do_io. Several: look at each in turn.
                let (min, mut timeout) = if one_queue { (1, left) } else { (0, left) };
                let timeout = (min > 0).then_some(&mut timeout);
                let n = queue
                    .do_io(&mut completions, min, timeout, None)
                    .unwrap_or_else(|e| panic!("libblkio do_io: {e}"));
                any |= n > 0;
                for c in &completions[..n] {
                    // SAFETY: do_io initialized the first n completions.
                    let c = unsafe { c.assume_init_read() };
                    assert!(results[c.user_data].is_none(), "completed twice");
                    results[c.user_data] = Some(c.ret);
                    done += 1;
                }
            }
            if !any && !one_queue {
                thread::sleep(Duration::from_micros(100));
            }
        }
        results.into_iter().map(|r| r.unwrap_or(i32::MIN)).collect()
    }

    fn one(&mut self, op: Op) -> i32 {
        self.batch(&[op])[0]
    }

    /// Writes `data` at `offset` (through the start of the buffer).
    pub fn write(&mut self, offset: u64, data: &[u8]) -> i32 {
        self.buf()[..data.len()].copy_from_slice(data);
        self.one(Op::Write {
            offset,
            buf_off: 0,
            len: data.len(),
        })
    }

    /// Reads `len` bytes at `offset`; panics on an error completion.
    pub fn read(&mut self, offset: u64, len: usize) -> Vec<u8> {
        let ret = self.one(Op::Read {
            offset,
            buf_off: 0,
            len,
        });
        assert_eq!(ret, 0, "read of {len} bytes at {offset} failed");
        self.buf()[..len].to_vec()
    }

    pub fn flush(&mut self) -> i32 {
        self.one(Op::Flush)
    }

    /// A closed loop: keeps `depth` requests in flight for `dur`, each
    /// slot `i` with its own `slot_len`-byte part of the buffer; `op(n, slot)`
    /// is the n-th request issued, on `slot`'s buffer. Returns when each
    /// completed and how many failed; what is still in flight at the end
    /// is waited for and not counted.
    pub fn sustain(
        &mut self,
        depth: usize,
        slot_len: usize,
        dur: Duration,
        mut op: impl FnMut(u64, usize) -> Op,
    ) -> Sustained {
        assert!(depth * slot_len <= self.region.len, "buffer too small");
        let base = self.region.addr;
        let mut issued = 0u64;
        let mut submit = |q: &mut Blkioq, slot: usize| {
            let f = ReqFlags::empty();
            match op(issued, slot) {
                Op::Read { offset, len, .. } => {
                    assert!(len <= slot_len);
                    q.read(offset, (base + slot * slot_len) as *mut u8, len, slot, f)
                }
                Op::Write { offset, len, .. } => {
                    assert!(len <= slot_len);
                    q.write(offset, (base + slot * slot_len) as *const u8, len, slot, f)
                }
                Op::Flush => q.flush(slot, f),
                Op::Discard { offset, len } => q.discard(offset, len, slot, f),
                Op::WriteZeroes { offset, len } => q.write_zeroes(offset, len, slot, f),
            }
            issued += 1;
        };
        for slot in 0..depth {
            submit(&mut self.queue, slot);
        }
        let start = Instant::now();
        let end = start + dur;
        let mut out = Sustained {
            start,
            done: Vec::new(),
            errors: 0,
        };
        let mut in_flight = depth;
        let mut completions: Vec<MaybeUninit<Completion>> =
            (0..depth).map(|_| MaybeUninit::uninit()).collect();
        let mut last_progress = Instant::now();
        while in_flight > 0 {
            assert!(
                last_progress.elapsed() < IO_TIMEOUT,
                "no request completed for {IO_TIMEOUT:?}"
            );
            let mut timeout = Duration::from_millis(100);
            let n = match self
                .queue
                .do_io(&mut completions, 1, Some(&mut timeout), None)
            {
                Ok(n) => n,
                // Nothing within the timeout: look at the clock again.
                Err(e) if e.errno() == blkio::Errno::TIME => 0,
                Err(e) => panic!("libblkio do_io: {e}"),
            };
            let now = Instant::now();
            if n > 0 {
                last_progress = now;
            }
            for c in &completions[..n] {
                // SAFETY: do_io initialized the first n completions.
                let c = unsafe { c.assume_init_read() };
                in_flight -= 1;
                if now >= end {
                    continue;
                }
                if c.ret != 0 {
                    out.errors += 1;
                }
                out.done.push(now);
                submit(&mut self.queue, c.user_data);
                in_flight += 1;
            }
        }
        out
    }

    pub fn discard(&mut self, offset: u64, len: u64) -> i32 {
        self.one(Op::Discard { offset, len })
    }

    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> i32 {
        self.one(Op::WriteZeroes { offset, len })
    }
}

impl Client {
    /// [`Client::sustain`] on every queue at once, `depth` deep each, with
    /// `len`-byte reads at `offset(n)`; one thread polls them all.
    pub fn sustain_queues(
        &mut self,
        depth: usize,
        len: usize,
        dur: Duration,
        offset: impl Fn(u64) -> u64,
    ) -> Vec<Sustained> {
        let nq = 1 + self.more.len();
        assert!(nq * depth * len <= self.region.len, "buffer too small");
        let base = self.region.addr;
        let mut queues: Vec<&mut Blkioq> = std::iter::once(&mut self.queue)
            .chain(self.more.iter_mut())
            .collect();
        let mut issued = 0u64;
        let mut submit = |q: &mut Blkioq, qi: usize, slot: usize| {
            let buf = base + (qi * depth + slot) * len;
            q.read(offset(issued), buf as *mut u8, len, slot, ReqFlags::empty());
            issued += 1;
        };
        for (qi, q) in queues.iter_mut().enumerate() {
            for slot in 0..depth {
                submit(q, qi, slot);
            }
        }
        let start = Instant::now();
        let end = start + dur;
        let mut out: Vec<Sustained> = (0..nq)
            .map(|_| Sustained {
                start,
                done: Vec::new(),
                errors: 0,
            })
            .collect();
        let mut in_flight = vec![depth; nq];
        let mut completions: Vec<MaybeUninit<Completion>> =
            (0..depth).map(|_| MaybeUninit::uninit()).collect();
        let mut last_progress = Instant::now();
        while in_flight.iter().any(|&n| n > 0) {
            assert!(
                last_progress.elapsed() < IO_TIMEOUT,
                "no request completed for {IO_TIMEOUT:?}"
            );
            let mut any = false;
            for (qi, q) in queues.iter_mut().enumerate() {
                let n = q
                    .do_io(&mut completions, 0, None, None)
                    .unwrap_or_else(|e| panic!("libblkio do_io: {e}"));
                let now = Instant::now();
                any |= n > 0;
                for c in &completions[..n] {
                    // SAFETY: do_io initialized the first n completions.
                    let c = unsafe { c.assume_init_read() };
                    in_flight[qi] -= 1;
                    if now >= end {
                        continue;
                    }
                    if c.ret != 0 {
                        out[qi].errors += 1;
                    }
                    out[qi].done.push(now);
                    submit(q, qi, c.user_data);
                    in_flight[qi] += 1;
                }
            }
            if any {
                last_progress = Instant::now();
            } else {
                // Nothing yet: a short nap, not a spin that would take a
                // core from the daemon on a small machine.
                thread::sleep(Duration::from_micros(100));
            }
        }
        out
    }
}
