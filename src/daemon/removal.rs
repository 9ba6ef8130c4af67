//! Files the daemon removes on its way out (its sockets and the relay's
//! private directory), removed relative to a directory fd opened at
//! start-up. The seccomp filter then allows `unlinkat` on those directory
//! fds only, instead of `unlink` and `rmdir` on any path.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;

/// One file or empty directory to remove later.
#[derive(Clone, Debug)]
pub struct Removal {
    /// Its parent directory (O_PATH: no read or write access through it).
    parent: Arc<OwnedFd>,
    name: CString,
    /// `AT_REMOVEDIR` for a directory, 0 for anything else.
    flags: i32,
}

impl Removal {
    /// A file (or socket) at `path`.
    pub fn file(path: &Path) -> io::Result<Removal> {
        Removal::new(path, 0)
    }

    /// An empty directory at `path`.
    pub fn dir(path: &Path) -> io::Result<Removal> {
        Removal::new(path, libc::AT_REMOVEDIR)
    }

    fn new(path: &Path, flags: i32) -> io::Result<Removal> {
        let invalid = || io::Error::new(io::ErrorKind::InvalidInput, "no file name");
        let name = path.file_name().ok_or_else(invalid)?;
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let cpath = CString::new(parent.as_os_str().as_bytes())?;
        // SAFETY: cpath is a valid NUL-terminated string for the call; the
        // returned fd, if any, is new and owned by the OwnedFd below.
        let fd = unsafe {
            libc::open(
                cpath.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Removal {
            // SAFETY: `fd` was just opened and nothing else owns it.
            parent: Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }),
            name: CString::new(name.as_bytes())?,
            flags,
        })
    }

    /// The directory fd the filter must allow `unlinkat` on.
    pub fn dir_fd(&self) -> RawFd {
        self.parent.as_raw_fd()
    }

    /// Its parent directory, where Landlock must allow the removal.
    pub fn parent(&self) -> BorrowedFd<'_> {
        self.parent.as_fd()
    }

    /// Whether it is a directory (else a file or socket).
    pub fn is_dir(&self) -> bool {
        self.flags == libc::AT_REMOVEDIR
    }

    /// Removes it; a file already gone is not an error worth reporting.
    pub fn remove(&self) {
        // SAFETY: the fd is open for as long as `self`; name is a valid
        // NUL-terminated string for the call.
        unsafe { libc::unlinkat(self.parent.as_raw_fd(), self.name.as_ptr(), self.flags) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_files_and_directories_by_directory_fd() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a.sock");
        std::fs::write(&f, b"x").unwrap();
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let (rf, rd) = (Removal::file(&f).unwrap(), Removal::dir(&sub).unwrap());
        assert_eq!(rf.name.as_bytes(), b"a.sock");
        rf.remove();
        rd.remove();
        assert!(!f.exists() && !sub.exists());
        // Twice is harmless.
        rf.remove();
    }
}
