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

/// How [`open_untrusted`] opens a file whose name the daemon did not
/// choose (a backing file an image names, a snapshot record).
#[derive(Clone, Copy, Debug, Default)]
pub struct Untrusted {
    pub write: bool,
    /// Refuse a symlink as the last component (O_NOFOLLOW, `ELOOP`).
    pub nofollow: bool,
    /// Accept a block device too, not only a regular file.
    pub block_device: bool,
}

/// Opens `path` so that what is there cannot stall or trick the caller:
/// with O_NONBLOCK, so that a FIFO planted there does not block the open
/// (it is then refused, as is anything but a regular file, or a block
/// device when `how.block_device`: `InvalidInput`, "neither a regular
/// file nor a block device"); O_NONBLOCK is cleared again before the
/// file is returned (io_uring would otherwise complete a read that must
/// wait with `EAGAIN`).
pub fn open_untrusted(path: &std::path::Path, how: Untrusted) -> io::Result<File> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let nofollow = if how.nofollow { libc::O_NOFOLLOW } else { 0 };
    let file = fs::OpenOptions::new()
        .read(true)
        .write(how.write)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | nofollow)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if !(kind.is_file() || how.block_device && kind.is_block_device()) {
        let what = if how.block_device {
            "neither a regular file nor a block device"
        } else {
            "not a regular file"
        };
        return Err(io::Error::new(io::ErrorKind::InvalidInput, what));
    }
    clear_nonblock(&file)?;
    Ok(file)
}

/// Clears O_NONBLOCK on `file`'s open file description.
pub fn clear_nonblock(file: &File) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: fcntl(F_GETFL) takes no pointer; `fd` is open (borrowed).
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above, F_SETFL with an int argument.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The whole of `file` if it holds at most `cap` bytes; `InvalidData`
/// ("larger than CAP bytes") if it holds more, found without reading
/// more than `cap + 1` bytes (its size as stat says is not trusted: it
/// may grow, or be a file whose size says nothing).
pub fn read_capped(file: &File, cap: usize) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    file.take(cap as u64 + 1).read_to_end(&mut out)?;
    if out.len() > cap {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than {cap} bytes"),
        ));
    }
    Ok(out)
}

/// The path `file` resolves to now, every symlink and `..` followed (the
/// kernel's name of the open file, /proc/self/fd/N): where the file
/// really is, whatever name opened it.
pub fn real_path(file: &File) -> io::Result<std::path::PathBuf> {
    fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// Replaces the page of `page` bytes at `at` (page-aligned) with private
/// anonymous memory, zero-filled and readable and writable, in place
/// (`MAP_FIXED`); false if mmap failed. Async-signal-safe: a SIGBUS
/// handler calls it so that the faulting access is retried on the new page
/// (a file truncated under its mapping).
///
/// # Safety
///
/// The page must lie in a mapping this process made and still holds,
/// readable and writable, that nothing else unmaps meanwhile, and every
/// pointer into it must accept any content (the zeroes replace what the
/// file held).
pub unsafe fn replace_with_zero_page(at: usize, page: usize) -> bool {
    // SAFETY: the caller vouches for the page (see above); MAP_FIXED over
    // it replaces only that range, with no executable rights.
    let p = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    p != libc::MAP_FAILED
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO is refused at once (no writer would ever come); a regular
    /// file comes back blocking again, and a symlink is refused with
    /// `nofollow`.
    #[test]
    fn untrusted_opens_refuse_fifos_and_links_and_clear_o_nonblock() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open_untrusted(&fifo, Untrusted::default()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        let file = dir.path().join("file");
        fs::write(&file, b"abc").unwrap();
        let f = open_untrusted(&file, Untrusted::default()).unwrap();
        // SAFETY: F_GETFL takes no pointer; the fd is open.
        let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
        assert_eq!(flags & libc::O_NONBLOCK, 0);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let how = Untrusted {
            nofollow: true,
            ..Untrusted::default()
        };
        let e = open_untrusted(&link, how).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
        assert_eq!(
            real_path(&open_untrusted(&link, Untrusted::default()).unwrap()).unwrap(),
            fs::canonicalize(&file).unwrap()
        );
    }

    #[test]
    fn capped_reads_stop_one_byte_past_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        fs::write(&p, vec![1u8; 100]).unwrap();
        let f = File::open(&p).unwrap();
        assert_eq!(read_capped(&f, 100).unwrap().len(), 100);
        let zero = File::open("/dev/zero").unwrap();
        let e = read_capped(&zero, 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }
}
