//! Facts of the running host, and calls on it, that several leaves need:
//! the bottom layer.

use std::ffi::CString;
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};

/// Length of a boot id as the kernel prints it (a UUID, 36 characters).
pub const BOOT_ID_LEN: usize = 36;

/// The boot id of the running kernel, which changes at every boot: a file
/// written before a host stop and found again names another boot, so
/// what only the page cache held (written, never synced) may be gone.
pub fn boot_id() -> io::Result<[u8; BOOT_ID_LEN]> {
    let s = fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    s.trim()
        .as_bytes()
        .try_into()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "unexpected boot_id format"))
}

/// `openat(dir, name, flags, 0600)`: how the daemon opens or creates a
/// file after start-up, by its directory's descriptor (a name with a NUL
/// in it is `EINVAL`). `flags` are passed as given; callers add
/// `O_CLOEXEC` and `O_NOFOLLOW`.
pub fn open_at(dir: &File, name: &str, flags: libc::c_int) -> io::Result<File> {
    let c = CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `c` is a NUL-terminated string that outlives the call; the
    // directory's descriptor is open (borrowed from `dir`); no other
    // pointer.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags, 0o600 as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openat returned a new descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// `unlinkat(dir, name, 0)`: how the daemon removes a file after start-up,
/// by its directory's descriptor (the only way its seccomp filter allows).
pub fn unlink_at(dir: &File, name: &str) -> io::Result<()> {
    let c = CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `c` is NUL-terminated and outlives the call; the directory's
    // descriptor is open (borrowed from `dir`); no other pointer.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
