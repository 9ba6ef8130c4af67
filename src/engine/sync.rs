//! Blocking fallbacks for what an io_uring cannot do on a given image: an
//! IOPOLL ring takes only reads and writes, and a kernel before 6.12 has no
//! discard command for block devices. Each is one syscall on the image;
//! the seccomp filter allows exactly these (its tests run each one under
//! the filter).

use std::io;
use std::os::fd::RawFd;

use vmm_sys_util::ioctl::ioctl_with_ref;

use crate::io::BLKDISCARD;

/// The image's data, durable (fdatasync).
pub fn flush(fd: RawFd) -> io::Result<()> {
    // SAFETY: fdatasync takes no pointers; a bad fd is an error, not UB.
    check(unsafe { libc::fdatasync(fd) })
}

/// fallocate(2) of `len` bytes at `offset` with `mode` (see
/// [`super::uring`] for the modes and why each).
pub fn fallocate(fd: RawFd, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    };
    // SAFETY: fallocate takes no pointers.
    check(unsafe { libc::fallocate(fd, mode, offset, len) })
}

/// Discards `len` bytes at `offset` of the block device `fd` (BLKDISCARD):
/// the fallocate modes that look like discard zero a block device instead.
pub fn discard_block_device(fd: RawFd, offset: u64, len: u64) -> io::Result<()> {
    let range: [u64; 2] = [offset, len];
    // SAFETY: BLKDISCARD reads two u64s through the pointer, which points at
    // `range` for the whole call; it writes nothing. `BorrowedFd` is only
    // needed for the call's duration, while the caller holds the fd open.
    let ret = unsafe {
        ioctl_with_ref(
            &std::os::fd::BorrowedFd::borrow_raw(fd),
            BLKDISCARD(),
            &range,
        )
    };
    check(ret)
}

fn check(ret: i32) -> io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
