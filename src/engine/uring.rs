//! The io_uring engine: one restricted ring per queue (see [`super::ring`]),
//! and everything that decides how a request becomes I/O on it.
//!
//! - Reads and writes: readv/writev straight into guest memory, or
//!   READ_FIXED/WRITE_FIXED when a single segment lies in guest memory
//!   registered as fixed buffers (`--fixed-buffers`); with O_DIRECT, guest
//!   buffers that are not aligned go through a bounce buffer (counted).
//! - Flush: fdatasync. Write-zeroes: fallocate ZERO_RANGE, or PUNCH_HOLE
//!   with UNMAP, retried once as ZERO_RANGE where deallocating is refused.
//! - Discard: PUNCH_HOLE on a file; on a block device io_uring's discard
//!   command (Linux 6.12+), else a blocking BLKDISCARD ([`super::sync`]).
//! - An IOPOLL ring takes only reads and writes: flush, discard and
//!   write-zeroes then run as blocking syscalls.
//!
//! In-flight state lives in a slab sized once, keyed by the SQE's
//! user_data. What needs no ring (fallbacks, failures found before
//! submission) is [`Start::Done`] at once; the core queues it.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use io_uring::squeue;
use slab::Slab;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::ring::{EngineError, Ring, UringOptions, op};
use super::{Completions, Engine, Io, Op, Start, sync};
use crate::io::AlignedBuf;
use crate::metrics::{QueueMetrics, RateLimiter};
use crate::virtio::{GuestMem, Status};
use crate::warn_limited;

/// How a queue's ring is set up, and the image it works on.
#[derive(Clone, Debug)]
pub struct UringConfig {
    /// The image, registered as the ring's fixed file 0 (a qcow2 chain's
    /// top).
    pub image_fd: RawFd,
    /// A qcow2 chain's backing files, top down: fixed files 1, 2, ...
    pub backing_fds: Vec<RawFd>,
    /// Fixed-file slots: at least the files above, more for a chain that
    /// live snapshots may deepen (the table can then be replaced, see
    /// [`Engine::set_files`]); 1 for a raw image.
    pub file_slots: u32,
    /// Most requests in flight: the ring's SQ size.
    pub entries: u32,
    pub sqpoll: bool,
    /// IOPOLL (with O_DIRECT on a device with poll queues).
    pub iopoll: bool,
    /// Register guest memory as fixed buffers.
    pub fixed_buffers: bool,
    /// Block-device discard through io_uring when the kernel has it.
    pub uring_cmd: bool,
    /// O_DIRECT: guest buffers must be aligned to `dio_align` or bounced.
    pub direct: bool,
    pub dio_align: usize,
    /// Most bytes of bounce buffers in use at once: a request that would go
    /// past it waits until bounced requests in flight complete.
    pub bounce_limit: usize,
    pub is_block_device: bool,
}

/// io_uring refuses fixed buffers over 1 GiB; larger regions are split.
const FIXED_BUF_MAX: usize = 1 << 30;

/// One request the ring is executing.
struct Slot {
    io: Io,
    /// For a misaligned O_DIRECT read or write: the aligned buffer and the
    /// one iovec describing it, which the SQE points at.
    bounce: Option<(AlignedBuf, libc::iovec)>,
    /// A write-zeroes with UNMAP retried as a plain zero-range.
    retried: bool,
}

pub struct UringEngine {
    ring: Ring,
    /// Requests on the ring. Created with room for `entries` and never
    /// holding more (see `room`), so it never reallocates: a slot does not
    /// move while the kernel holds a pointer into it.
    slots: Slab<Slot>,
    /// Reaped CQEs, reused across calls.
    cqes: Vec<(u64, i32)>,
    cfg: UringConfig,
    metrics: Arc<QueueMetrics>,
    log_limit: RateLimiter,
    /// Block-device discard goes through io_uring; false for files, when
    /// the ring cannot carry the command, or once the kernel refused it.
    async_discard: bool,
    /// Guest memory registered as fixed buffers, and the mapping that keeps
    /// it valid while registered.
    fixed: Vec<(usize, usize)>,
    fixed_mem: Option<Arc<GuestMem>>,
    /// Bytes of bounce buffers held by requests in flight.
    bounce_in_use: usize,
}

// SAFETY: the raw pointers inside (the iovecs of bounce buffers, and the
// SQEs the kernel holds) point into memory the engine owns or holds (each
// slot's request holds its guest memory); the engine is moved to its
// queue's thread once and used only there.
unsafe impl Send for UringEngine {}

impl UringEngine {
    pub fn new(cfg: UringConfig, metrics: Arc<QueueMetrics>) -> Result<UringEngine, EngineError> {
        let mut files = vec![cfg.image_fd];
        files.extend(&cfg.backing_fds);
        let slots = (cfg.file_slots as usize).max(files.len());
        files.resize(slots, -1);
        let ring = Ring::new(
            &files,
            UringOptions {
                entries: cfg.entries,
                sqpoll: cfg.sqpoll,
                iopoll: cfg.iopoll,
                uring_cmd: cfg.uring_cmd && cfg.is_block_device,
                files_update: slots > 1,
            },
        )?;
        let entries = cfg.entries as usize;
        Ok(UringEngine {
            async_discard: ring.uring_cmd,
            ring,
            slots: Slab::with_capacity(entries),
            cqes: Vec::with_capacity(2 * entries),
            cfg,
            metrics,
            log_limit: RateLimiter::new(10, Duration::from_secs(5)),
            fixed: Vec::new(),
            fixed_mem: None,
            bounce_in_use: 0,
        })
    }

    /// Whether the request runs as a blocking syscall rather than on the
    /// ring.
    fn runs_blocking(&self, kind: Op) -> bool {
        match kind {
            // An IOPOLL ring only takes reads and writes.
            Op::Flush | Op::WriteZeroes(_) => self.ring.iopoll,
            Op::Discard(_) => self.ring.iopoll || (self.cfg.is_block_device && !self.async_discard),
            _ => false,
        }
    }

    /// The blocking version of a flush, discard or write-zeroes, on the
    /// image (file 0: the only file a raw image has, the top of a qcow2
    /// chain, whose discards and write-zeroes never come here).
    fn run_blocking(&mut self, io: &Io) -> Status {
        let (fd, kind, offset) = (self.cfg.image_fd, io.op(), io.at().offset);
        let res = match kind {
            Op::Flush => sync::flush(fd),
            Op::Discard(r) if self.cfg.is_block_device => {
                sync::discard_block_device(fd, offset, r.len())
            }
            Op::Discard(r) | Op::WriteZeroes(r) => {
                let res = sync::fallocate(fd, fallocate_mode(kind, false), offset, r.len());
                match res {
                    Err(e) if is_unsupported(&e) && matches!(kind, Op::WriteZeroes(_)) => {
                        sync::fallocate(fd, fallocate_mode(kind, true), offset, r.len())
                    }
                    other => other,
                }
            }
            Op::Read | Op::Write => Ok(()),
        };
        match res {
            Ok(()) => Status::Ok,
            // Discard is a hint: a device that cannot do it has done it.
            Err(e) if is_unsupported(&e) && matches!(kind, Op::Discard(_)) => Status::Ok,
            Err(e) => {
                warn_limited!(self.log_limit, "{kind:?} failed: {e}");
                Status::IoErr
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

    /// The SQE for the request in `slot`, tagged `key`.
    fn sqe(&self, slot: &Slot, key: u64) -> squeue::Entry {
        let io = &slot.io;
        let data = io.data().iovecs();
        let (iov, n) = match &slot.bounce {
            Some((_, iov)) => (iov as *const libc::iovec, 1),
            None => (data.as_ptr(), data.len() as u32),
        };
        let (file, offset, dsync) = (io.at().file, io.at().offset, io.fua());
        if n == 1
            && slot.bounce.is_none()
            && let Some(idx) = self.fixed_index(&data[0])
        {
            let (buf, len) = (data[0].iov_base.cast::<u8>(), io.len());
            match io.op() {
                Op::Read => {
                    return op::read_fixed(file, buf, len, offset, idx, key);
                }
                Op::Write => {
                    return op::write_fixed(file, buf, len, offset, idx, dsync, key);
                }
                _ => {}
            }
        }
        match io.op() {
            Op::Read => op::readv(file, iov, n, offset, key),
            Op::Write => op::writev(file, iov, n, offset, dsync, key),
            Op::Discard(r) if self.async_discard => op::discard_block(file, offset, r.len(), key),
            Op::Discard(r) | Op::WriteZeroes(r) => {
                let mode = fallocate_mode(io.op(), slot.retried);
                op::fallocate(file, offset, r.len(), mode, key)
            }
            Op::Flush => op::flush(file, key),
        }
    }

    /// Puts `slot` on the ring. Gives it back if the SQ has no room.
    #[expect(
        clippy::result_large_err,
        reason = "the slot comes back by value when the SQ is full; boxing it would allocate per request"
    )]
    fn push(&mut self, slot: Slot) -> Result<(), Slot> {
        if self.slots.len() >= self.slots.capacity() {
            return Err(slot);
        }
        // The SQE is built from the slot in its final place: it may point
        // at the slot's own bounce iovec.
        let key = self.slots.insert(slot);
        let entry = self.sqe(&self.slots[key], key as u64);
        // SAFETY: the SQE points at the request's iovec array (heap memory
        // of its `GuestBuffers`, which does not move) and through it at
        // guest memory its buffers keep mapped (or, for an encrypted
        // disk's write, at a staged buffer the core's tracked request owns
        // until this `Io` is reaped: `GuestBuffers::private`), or at the
        // bounce buffer and the iovec in its slot; the slab never
        // reallocates (checked above), so the slot does not move, and it
        // stays in the slab until its CQE is reaped (`reap`, or `Drop`,
        // which waits for every CQE).
        if unsafe { self.ring.push(&entry) } {
            Ok(())
        } else {
            Err(self.slots.remove(key))
        }
    }

    /// What a CQE means for its request: a status, or a retry already on
    /// the ring.
    fn finish(&mut self, mut slot: Slot, res: i32) -> Option<(Io, Status)> {
        let (kind, data_len) = (slot.io.op(), slot.io.len());
        let status = match kind {
            Op::Read | Op::Write if res >= 0 && res as u32 == data_len => {
                if let (Op::Read, Some((buf, _))) = (kind, &slot.bounce) {
                    // The read's buffers are device-writable; the bounce
                    // buffer holds data_len bytes.
                    let data = slot.io.data();
                    data.fill_from(&buf.as_slice()[..data_len as usize]);
                }
                Status::Ok
            }
            Op::WriteZeroes(r) if r.unmap && !slot.retried && is_unsupported_res(res) => {
                // The file system or device cannot deallocate: zero instead.
                slot.retried = true;
                match self.push(slot) {
                    Ok(()) => return None,
                    Err(s) => {
                        slot = s;
                        Status::IoErr
                    }
                }
            }
            Op::Discard(_) if self.async_discard && res == -libc::EOPNOTSUPP => {
                // A kernel before 6.12: no discard command on block devices.
                log::info!("io_uring cannot discard on this block device; using BLKDISCARD");
                self.async_discard = false;
                self.run_blocking(&slot.io)
            }
            // Discard is a hint: a device that cannot do it has done it.
            Op::Discard(_) if is_unsupported_res(res) => Status::Ok,
            Op::Flush | Op::Discard(_) | Op::WriteZeroes(_) if res >= 0 => Status::Ok,
            _ => {
                let err = if res < 0 {
                    io::Error::from_raw_os_error(-res).to_string()
                } else {
                    format!("short transfer of {res} of {data_len} bytes")
                };
                warn_limited!(
                    self.log_limit,
                    "{kind:?} at offset {} failed: {err}",
                    slot.io.at().offset
                );
                Status::IoErr
            }
        };
        if slot.bounce.is_some() {
            self.bounce_in_use -= data_len as usize;
        }
        Some((slot.io, status))
    }
}

impl Engine for UringEngine {
    fn start(&mut self, io: Io) -> Start {
        if self.room() == 0 {
            return Start::Full(io);
        }
        let op = io.op();
        if self.runs_blocking(op) {
            let status = self.run_blocking(&io);
            return Start::Done(io, status);
        }
        let rw = matches!(op, Op::Read | Op::Write);
        let mut bounce = None;
        if self.cfg.direct && rw && !io.data().aligned_to(self.cfg.dio_align) {
            let len = io.len() as usize;
            if self.bounce_in_use + len > self.cfg.bounce_limit {
                if self.bounce_in_use > 0 {
                    // Its turn comes when bounced requests in flight finish.
                    return Start::Full(io);
                }
                // Larger than the limit on its own: the parser refuses
                // requests past MAX_DATA_BYTES, so only a limit set below
                // that gets here.
                warn_limited!(
                    self.log_limit,
                    "a {len}-byte request needs more bounce buffer than the {} allowed",
                    self.cfg.bounce_limit
                );
                return Start::Done(io, Status::IoErr);
            }
            let Some(mut buf) = AlignedBuf::new(len) else {
                warn_limited!(self.log_limit, "no memory for a {len}-byte bounce buffer");
                return Start::Done(io, Status::IoErr);
            };
            if op == Op::Write {
                // buf holds their total length.
                io.data().gather_into(buf.as_mut_slice());
            }
            let iov = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: len,
            };
            bounce = Some((buf, iov));
            self.bounce_in_use += len;
            QueueMetrics::add(&self.metrics.bounced, 1);
        }
        let slot = Slot {
            io,
            bounce,
            retried: false,
        };
        match self.push(slot) {
            Ok(()) => Start::Submitted,
            Err(slot) => {
                if let Some((_, iov)) = &slot.bounce {
                    self.bounce_in_use -= iov.iov_len;
                }
                Start::Full(slot.io)
            }
        }
    }

    fn commit(&mut self) -> io::Result<u32> {
        self.ring.submit()
    }

    fn reap(&mut self, mut f: impl FnMut(Io, Status)) -> u32 {
        let mut n = 0;
        let mut cqes = std::mem::take(&mut self.cqes);
        self.ring.reap(|ud, res| cqes.push((ud, res)));
        for (ud, res) in cqes.drain(..) {
            let Some(slot) = self.slots.try_remove(ud as usize) else {
                warn_limited!(self.log_limit, "completion for unknown request {ud}");
                continue;
            };
            if let Some((io, status)) = self.finish(slot, res) {
                f(io, status);
                n += 1;
            }
        }
        self.cqes = cqes;
        n
    }

    fn room(&self) -> usize {
        (self.cfg.entries as usize).saturating_sub(self.slots.len())
    }

    fn in_flight(&self) -> usize {
        self.slots.len()
    }

    fn wait(&mut self) -> io::Result<()> {
        if self.slots.is_empty() {
            return Ok(());
        }
        self.ring.wait(1)
    }

    fn completions(&self) -> Completions {
        if self.ring.iopoll {
            Completions::Polled
        } else {
            Completions::Signalled {
                fd: self.ring.eventfd(),
                polling_pays: true,
            }
        }
    }

    /// Registers every guest memory region (in chunks of at most 1 GiB) as
    /// fixed buffers, when asked to: the kernel then skips pinning and
    /// mapping the pages on each request.
    fn set_memory(&mut self, mem: &Arc<GuestMem>) {
        if !self.cfg.fixed_buffers {
            return;
        }
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
        // Requests in flight on the old registration keep it (the kernel
        // holds its own reference to registered pages).
        match unsafe { self.ring.register_buffers(&iovecs) } {
            Ok(()) => {
                self.fixed = chunks;
                self.fixed_mem = Some(mem.clone());
            }
            Err(e) => {
                log::warn!(
                    "cannot register guest memory as fixed buffers ({e}); using readv/writev"
                );
                self.unregister_memory();
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        sync::flush(self.cfg.image_fd)
    }

    fn set_files(&mut self, fds: &[RawFd]) -> io::Result<()> {
        let Some(&top) = fds.first() else {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        };
        if fds.len() > self.cfg.file_slots as usize {
            return Err(io::Error::other(format!(
                "a chain of {} files, more than the {} the ring has room for",
                fds.len(),
                self.cfg.file_slots
            )));
        }
        self.ring.update_files(fds)?;
        self.cfg.image_fd = top;
        self.cfg.backing_fds = fds[1..].to_vec();
        Ok(())
    }

    fn reset(&mut self) {
        self.unregister_memory();
        self.ring.clear_eventfd();
    }
}

impl UringEngine {
    fn unregister_memory(&mut self) {
        if self.fixed_mem.take().is_some() {
            // SAFETY: an empty set registers nothing.
            if let Err(e) = unsafe { self.ring.register_buffers(&[]) } {
                log::warn!("cannot unregister guest memory: {e}");
            }
        }
        self.fixed.clear();
    }
}

impl Drop for UringEngine {
    /// Waits until the kernel has finished with every request on the ring:
    /// their buffers (the slab, bounce buffers, guest memory held by each
    /// `Io`) must outlive the I/O, whatever the reason for the drop.
    fn drop(&mut self) {
        while !self.slots.is_empty() {
            if let Err(e) = self.ring.wait(1) {
                warn_limited!(self.log_limit, "waiting for in-flight I/O: {e}");
                std::thread::sleep(Duration::from_millis(1));
            }
            let slots = &mut self.slots;
            self.ring.reap(|ud, _| {
                slots.try_remove(ud as usize);
            });
        }
    }
}

/// The fallocate(2) mode of a discard or write-zeroes, for the ring and
/// the blocking path alike. Every mode keeps the size.
/// - discard: punch a hole (files only: on block devices the kernel zeroes
///   for this mode, so discard is BLKDISCARD or the discard command);
/// - write-zeroes: ZERO_RANGE (BLKZEROOUT on a block device), or with
///   UNMAP a punched hole (BLKZEROOUT with unmap), unless `zero_fallback`
///   says deallocating was already refused.
fn fallocate_mode(kind: Op, zero_fallback: bool) -> i32 {
    let mode = match kind {
        Op::Discard(_) => libc::FALLOC_FL_PUNCH_HOLE,
        Op::WriteZeroes(r) if r.unmap && !zero_fallback => libc::FALLOC_FL_PUNCH_HOLE,
        _ => libc::FALLOC_FL_ZERO_RANGE,
    };
    mode | libc::FALLOC_FL_KEEP_SIZE
}

/// Every fallocate(2) mode this engine uses (see [`fallocate_mode`]).
pub const FALLOCATE_MODES: [i32; 2] = [
    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
];

fn is_unsupported_res(res: i32) -> bool {
    res == -libc::EOPNOTSUPP || res == -libc::EINVAL
}

fn is_unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::DiscardRange;

    /// The fallocate modes the seccomp filter allows are exactly these.
    #[test]
    fn fallocate_modes_keep_the_size() {
        let r = DiscardRange {
            sector: 0,
            num_sectors: 8,
            unmap: true,
        };
        let keep = libc::FALLOC_FL_KEEP_SIZE;
        assert_eq!(
            fallocate_mode(Op::Discard(r), false),
            libc::FALLOC_FL_PUNCH_HOLE | keep
        );
        assert_eq!(
            fallocate_mode(Op::WriteZeroes(r), false),
            libc::FALLOC_FL_PUNCH_HOLE | keep
        );
        assert_eq!(
            fallocate_mode(Op::WriteZeroes(r), true),
            libc::FALLOC_FL_ZERO_RANGE | keep
        );
        for m in FALLOCATE_MODES {
            assert_ne!(m & keep, 0);
        }
    }
}
