//! One io_uring, as [`super::uring`] drives it: setup, submission and
//! completion counting, and the SQE builders.
//!
//! Set up the way the KVM Forum 2020 io_uring talk and Firecracker do it:
//! the ring is created disabled, the image is registered as fixed file 0, an
//! eventfd is registered for completions, the ring is restricted to the few
//! opcodes we issue on that fixed file only, and only then enabled. A guest
//! that somehow steered an SQE could not open, read or write anything else.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use io_uring::register::Restriction;
use io_uring::{IoUring, opcode, squeue, types};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

/// Opcodes the ring may execute; block devices add `UringCmd16` for
/// discard where the kernel has it (see [`build`]).
const ALLOWED_OPS: [u8; 6] = [
    opcode::Readv::CODE,
    opcode::Writev::CODE,
    opcode::ReadFixed::CODE,
    opcode::WriteFixed::CODE,
    opcode::Fsync::CODE,
    opcode::Fallocate::CODE,
];

/// linux/fs.h: `_IO(0x12, 0)`, discard of the byte range in `sqe->addr`
/// (start) and `sqe->addr3` (length) on a block device (Linux 6.12).
const BLOCK_URING_CMD_DISCARD: u32 = 0x12 << 8;

/// Register opcodes from linux/io_uring.h (the crate keeps its bindings private).
const IORING_REGISTER_BUFFERS: u8 = 0;
const IORING_UNREGISTER_BUFFERS: u8 = 1;
const IORING_REGISTER_FILES_UPDATE: u8 = 6;

/// The io_uring_register opcodes used after a ring is enabled: guest
/// memory as fixed buffers follows the front-end's memory table, and a
/// qcow2 chain's files follow its live snapshots. The rings' restrictions
/// allow only these (the files' update only on a ring whose image may
/// have a chain), and so does the seccomp filter.
pub const REGISTER_OPS: [u8; 3] = [
    IORING_REGISTER_BUFFERS,
    IORING_UNREGISTER_BUFFERS,
    IORING_REGISTER_FILES_UPDATE,
];

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("io_uring setup failed: {0}")]
    Setup(io::Error),
    #[error("io_uring {0} registration failed: {1}")]
    Register(&'static str, io::Error),
    #[error("eventfd: {0}")]
    EventFd(io::Error),
}

/// What the ring should be set up with.
#[derive(Clone, Copy, Debug, Default)]
pub struct UringOptions {
    /// Submission queue entries; in-flight requests never exceed this.
    pub entries: u32,
    pub sqpoll: bool,
    pub iopoll: bool,
    /// Allow IORING_OP_URING_CMD on the image (block-device discard), if
    /// the kernel knows the opcode.
    pub uring_cmd: bool,
    /// Allow the fixed files to be replaced after the ring is enabled
    /// ([`Ring::update_files`]).
    pub files_update: bool,
}

/// One io_uring with its registered file and completion eventfd.
pub struct Ring {
    ring: IoUring,
    eventfd: EventFd,
    /// Pushed to the SQ, not yet submitted.
    queued: u32,
    /// Submitted, completion not reaped.
    in_flight: u32,
    capacity: u32,
    /// What the ring really got (a requested mode may have been refused).
    pub iopoll: bool,
    /// The ring may carry IORING_OP_URING_CMD (block-device discard). Off
    /// when the kernel predates it: restricting to an opcode the kernel
    /// does not know would fail the whole ring.
    pub uring_cmd: bool,
}

impl Ring {
    /// Sets up a ring for `files` (fixed files 0, 1, ...; -1 leaves a slot
    /// empty for [`Ring::update_files`]). SQPOLL and IOPOLL fall back,
    /// with a warning, when the kernel refuses them.
    pub fn new(files: &[RawFd], opts: UringOptions) -> Result<Ring, EngineError> {
        let eventfd = EventFd::new(EFD_NONBLOCK).map_err(EngineError::EventFd)?;
        let mut sqpoll = opts.sqpoll;
        let mut iopoll = opts.iopoll;
        let (ring, uring_cmd) = loop {
            match build(files, eventfd.as_raw_fd(), opts, sqpoll, iopoll) {
                Ok(r) => break r,
                Err(EngineError::Setup(e)) if sqpoll || iopoll => {
                    log::warn!(
                        "io_uring refused {}{}({e}); continuing without",
                        if sqpoll { "SQPOLL " } else { "" },
                        if iopoll { "IOPOLL " } else { "" },
                    );
                    sqpoll = false;
                    iopoll = false;
                }
                Err(e) => return Err(e),
            }
        };
        let u = Ring {
            ring,
            eventfd,
            queued: 0,
            in_flight: 0,
            capacity: opts.entries,
            iopoll,
            uring_cmd,
        };
        Ok(u)
    }

    /// The eventfd the kernel signals when it posts a completion.
    pub fn eventfd(&self) -> RawFd {
        self.eventfd.as_raw_fd()
    }

    /// Consumes the eventfd's count. Call before reaping, so a completion
    /// posted after the reap signals it again.
    pub fn clear_eventfd(&self) {
        let _ = self.eventfd.read();
    }

    /// Whether another request fits: in-flight plus queued stay within the
    /// SQ size, and the CQ (twice that) can never overflow.
    pub fn has_room(&self) -> bool {
        self.queued + self.in_flight < self.capacity
    }

    /// Registers `bufs` as the ring's fixed buffers, replacing any set
    /// before. Requests in flight keep the old registration alive.
    ///
    /// # Safety
    /// The memory each iovec describes must stay mapped while registered:
    /// until the next call or `unregister_buffers`.
    pub unsafe fn register_buffers(&mut self, bufs: &[libc::iovec]) -> io::Result<()> {
        let sub = self.ring.submitter();
        let _ = sub.unregister_buffers();
        if bufs.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller keeps the memory mapped while it is registered.
        unsafe { sub.register_buffers(bufs) }
    }

    /// Replaces the fixed files from slot 0 on with `fds` (a snapshot's
    /// new chain). Requests in flight keep the files they were issued on.
    pub fn update_files(&mut self, fds: &[RawFd]) -> io::Result<()> {
        let n = self.ring.submitter().register_files_update(0, fds)?;
        if n != fds.len() {
            return Err(io::Error::other(format!(
                "{n} of {} fixed files replaced",
                fds.len()
            )));
        }
        Ok(())
    }

    /// Requests submitted or queued and not yet completed.
    #[cfg(test)]
    pub fn outstanding(&self) -> u32 {
        self.queued + self.in_flight
    }

    /// Queues one SQE.
    ///
    /// # Safety
    /// Every buffer and iovec array the entry points to must stay valid and
    /// unmoved until its completion has been reaped.
    pub unsafe fn push(&mut self, entry: &squeue::Entry) -> bool {
        if !self.has_room() {
            return false;
        }
        // SAFETY: the caller guarantees the buffers outlive the operation.
        let ok = unsafe { self.ring.submission().push(entry) }.is_ok();
        if ok {
            self.queued += 1;
        }
        ok
    }

    /// Submits everything queued with one io_uring_enter (none with SQPOLL
    /// while its thread is awake). Returns the number of SQEs submitted.
    pub fn submit(&mut self) -> io::Result<u32> {
        if self.queued == 0 {
            return Ok(0);
        }
        loop {
            match self.ring.submit() {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // EBUSY/EAGAIN: completions must be reaped first; the caller
                // reaps and the SQEs stay queued for the next submit.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN)) => {
                    return Ok(0);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(self.mark_submitted())
    }

    /// After a successful enter, every queued SQE is the kernel's: either
    /// consumed by the call, or (SQPOLL) left in the SQ for the kernel's
    /// poller thread, which will consume it without another syscall. A
    /// failed SQE is consumed too and completes with an error CQE. So all
    /// of them will complete.
    fn mark_submitted(&mut self) -> u32 {
        let n = std::mem::take(&mut self.queued);
        self.in_flight += n;
        n
    }

    /// Blocks until at least `want` completions are available (drain and
    /// IOPOLL), submitting anything queued.
    pub fn wait(&mut self, want: u32) -> io::Result<()> {
        let want = want.min(self.queued + self.in_flight) as usize;
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
        }
        self.mark_submitted();
        Ok(())
    }

    /// Calls `f(user_data, result)` for every completion posted. Returns
    /// how many there were.
    pub fn reap(&mut self, mut f: impl FnMut(u64, i32)) -> u32 {
        let mut n = 0;
        let mut cq = self.ring.completion();
        cq.sync();
        for cqe in &mut cq {
            f(cqe.user_data(), cqe.result());
            n += 1;
        }
        self.in_flight = self.in_flight.saturating_sub(n);
        n
    }
}

fn build(
    files: &[RawFd],
    eventfd: RawFd,
    opts: UringOptions,
    sqpoll: bool,
    iopoll: bool,
) -> Result<(IoUring, bool), EngineError> {
    let entries = opts.entries;
    let mut b = IoUring::builder();
    b.setup_r_disabled().setup_cqsize(entries * 2);
    if sqpoll {
        b.setup_sqpoll(1000);
    }
    if iopoll {
        b.setup_iopoll();
    }
    let ring = b.build(entries).map_err(EngineError::Setup)?;
    let sub = ring.submitter();
    sub.register_files(files)
        .map_err(|e| EngineError::Register("file", e))?;
    sub.register_eventfd(eventfd)
        .map_err(|e| EngineError::Register("eventfd", e))?;
    let mut probe = io_uring::Probe::new();
    let uring_cmd = opts.uring_cmd
        && sub.register_probe(&mut probe).is_ok()
        && probe.is_supported(opcode::UringCmd16::CODE)
        // An IOPOLL ring would need the device to poll commands too.
        && !iopoll;
    let mut res: Vec<Restriction> = ALLOWED_OPS
        .iter()
        .chain(uring_cmd.then_some(&opcode::UringCmd16::CODE))
        .map(|op| Restriction::sqe_op(*op))
        .collect();
    res.push(Restriction::sqe_flags_required(
        squeue::Flags::FIXED_FILE.bits(),
    ));
    // Fixed buffers follow guest memory, which the front-end may change
    // while the ring runs.
    res.extend(
        REGISTER_OPS
            .iter()
            .filter(|&&op| opts.files_update || op != IORING_REGISTER_FILES_UPDATE)
            .map(|&op| Restriction::register_op(op)),
    );
    sub.register_restrictions(&mut res)
        .map_err(|e| EngineError::Register("restrictions", e))?;
    sub.register_enable_rings()
        .map_err(|e| EngineError::Register("enable", e))?;
    Ok((ring, uring_cmd))
}

/// SQE builders for the operations a request maps to, on fixed file
/// `file` (0: the image, or a qcow2 chain's top; its backing files next). The entries carry raw
/// pointers: see [`Ring::push`] for who keeps them alive.
pub mod op {
    use super::*;

    pub fn readv(
        file: u32,
        iov: *const libc::iovec,
        n: u32,
        offset: u64,
        user_data: u64,
    ) -> squeue::Entry {
        opcode::Readv::new(types::Fixed(file), iov, n)
            .offset(offset)
            .build()
            .user_data(user_data)
    }

    /// `dsync`: the write is durable when it completes (write-through).
    pub fn writev(
        file: u32,
        iov: *const libc::iovec,
        n: u32,
        offset: u64,
        dsync: bool,
        user_data: u64,
    ) -> squeue::Entry {
        opcode::Writev::new(types::Fixed(file), iov, n)
            .offset(offset)
            .rw_flags(if dsync { libc::RWF_DSYNC } else { 0 })
            .build()
            .user_data(user_data)
    }

    /// Read into registered buffer `index` (one contiguous segment).
    pub fn read_fixed(
        file: u32,
        buf: *mut u8,
        len: u32,
        offset: u64,
        index: u16,
        user_data: u64,
    ) -> squeue::Entry {
        opcode::ReadFixed::new(types::Fixed(file), buf, len, index)
            .offset(offset)
            .build()
            .user_data(user_data)
    }

    /// Write from registered buffer `index` (one contiguous segment).
    pub fn write_fixed(
        file: u32,
        buf: *const u8,
        len: u32,
        offset: u64,
        index: u16,
        dsync: bool,
        user_data: u64,
    ) -> squeue::Entry {
        opcode::WriteFixed::new(types::Fixed(file), buf, len, index)
            .offset(offset)
            .rw_flags(if dsync { libc::RWF_DSYNC } else { 0 })
            .build()
            .user_data(user_data)
    }

    /// fdatasync of fixed file `file`.
    pub fn flush(file: u32, user_data: u64) -> squeue::Entry {
        opcode::Fsync::new(types::Fixed(file))
            .flags(types::FsyncFlags::DATASYNC)
            .build()
            .user_data(user_data)
    }

    /// fallocate(2) with `mode`; on block devices the kernel maps the
    /// zeroing modes we use to BLKZEROOUT (see `uring`).
    pub fn fallocate(file: u32, offset: u64, len: u64, mode: i32, user_data: u64) -> squeue::Entry {
        opcode::Fallocate::new(types::Fixed(file), len)
            .offset(offset)
            .mode(mode)
            .build()
            .user_data(user_data)
    }

    /// BLKDISCARD of a block device, asynchronously (Linux 6.12+; older
    /// kernels answer -EOPNOTSUPP). Needs [`Ring::uring_cmd`].
    pub fn discard_block(file: u32, offset: u64, len: u64, user_data: u64) -> squeue::Entry {
        let mut cmd = [0u8; 16];
        cmd[..8].copy_from_slice(&len.to_ne_bytes()); // sqe->addr3
        opcode::UringCmd16::new(types::Fixed(file), BLOCK_URING_CMD_DISCARD)
            .addr(Some(offset))
            .cmd(cmd)
            .build()
            .user_data(user_data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, SeekFrom, Write};

    #[test]
    fn restricted_ring_reads_and_writes_the_fixed_file() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[0u8; 8192]).unwrap();
        let mut u = Ring::new(
            &[f.as_raw_fd()],
            UringOptions {
                entries: 8,
                ..Default::default()
            },
        )
        .unwrap();
        let mut buf = [0xabu8; 4096];
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: buf and iov outlive the wait below, which reaps the CQE.
        assert!(unsafe { u.push(&op::writev(0, &iov, 1, 4096, false, 7)) });
        assert_eq!(u.submit().unwrap(), 1);
        u.wait(1).unwrap();
        let mut got = vec![];
        u.reap(|ud, res| got.push((ud, res)));
        assert_eq!(got, vec![(7, 4096)]);
        let mut back = vec![0u8; 4096];
        f.seek(SeekFrom::Start(4096)).unwrap();
        f.read_exact(&mut back).unwrap();
        assert!(back.iter().all(|b| *b == 0xab));
        assert_eq!(u.outstanding(), 0);
    }

    /// With SQPOLL the kernel thread may not have taken the SQE yet when
    /// submit returns; it is in flight all the same (a drain used to wait
    /// for it forever).
    #[test]
    fn sqpoll_counts_submitted_entries_as_in_flight() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7u8; 4096]).unwrap();
        let mut u = Ring::new(
            &[f.as_raw_fd()],
            UringOptions {
                entries: 8,
                sqpoll: true,
                ..Default::default()
            },
        )
        .unwrap();
        let mut buf = [0u8; 4096];
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: buf and iov outlive the wait below, which reaps the CQE.
        assert!(unsafe { u.push(&op::readv(0, &iov, 1, 0, 3)) });
        assert_eq!(u.submit().unwrap(), 1);
        assert_eq!(u.outstanding(), 1);
        // Reap by polling the CQ only, as the worker does, with no further
        // io_uring_enter that could fix up the count.
        let mut got = vec![];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while got.is_empty() && std::time::Instant::now() < deadline {
            u.reap(|ud, res| got.push((ud, res)));
        }
        assert_eq!(got, vec![(3, 4096)]);
        assert_eq!(u.outstanding(), 0);
        assert_eq!(buf, [7u8; 4096]);
    }

    #[test]
    fn restrictions_refuse_other_opcodes() {
        let f = tempfile::tempfile().unwrap();
        let mut u = Ring::new(
            &[f.as_raw_fd()],
            UringOptions {
                entries: 4,
                ..Default::default()
            },
        )
        .unwrap();
        let nop = opcode::Nop::new().build().user_data(1);
        // SAFETY: a NOP points to no memory.
        assert!(unsafe { u.push(&nop) });
        u.wait(1).unwrap();
        let mut res = 0;
        u.reap(|_, r| res = r);
        assert_eq!(res, -libc::EACCES);
    }
}
