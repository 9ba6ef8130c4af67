//! Unix socket files shared by the vhost-user listener, the HTTP
//! endpoints and the backup's NBD export: a socket left by a crashed
//! process is replaced, one a live process accepts on never is, and a new
//! one is born with the mode asked for.

use std::fs;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

/// Removes `path` if it is a socket nobody listens on. Nothing there is
/// fine; a live socket is `AddrInUse`; anything else at the path is
/// `AlreadyExists` and left alone.
pub fn remove_stale(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
        Ok(m) if !m.file_type().is_socket() => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "exists and is not a socket",
            ));
        }
        Ok(_) => {}
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "in use by a running process",
        )),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            log::info!("replacing stale socket {}", path.display());
            fs::remove_file(path)
        }
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("cannot check the existing socket: {e}"),
        )),
    }
}

/// `UnixListener::bind`, with the socket file created as `mode` whatever
/// the process umask. Linux creates the file with the mode of the socket's
/// own inode (0777, or what an fchmod of the fd set before bind) minus the
/// umask, so fchmod alone cannot grant what the umask takes away (660
/// under umask 022 would give 640). The umask is set in a thread of its
/// own instead, after unshare(CLONE_FS) has given that thread private
/// file-system attributes: no other thread ever sees it changed.
pub fn bind_with_mode(path: &Path, mode: u32) -> io::Result<UnixListener> {
    std::thread::scope(|s| {
        let bind = std::thread::Builder::new().name("bind".into());
        bind.spawn_scoped(s, || {
            // SAFETY: unshare takes no pointers; CLONE_FS gives this
            // thread its own copy of cwd, root and umask, nothing else.
            if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: umask takes no pointers and cannot fail; after the
            // unshare it is this thread's alone.
            unsafe { libc::umask(!mode & 0o777) };
            UnixListener::bind(path)
        })?
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}
