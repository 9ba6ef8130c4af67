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

/// Removes the sockets in `dir` that nobody listens on ([`remove_stale`],
/// which logs each), at start-up, while the daemon may still
/// connect: a backup's NBD socket left by a daemon killed during the
/// backup, which the next `backup start` of that name would otherwise be
/// refused on. A live socket (another daemon's export) and anything that
/// is not a socket are left alone (a live one's `AddrInUse` is not an
/// error here).
pub fn remove_stale_in(dir: &Path) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        // The entry's own type: a symlink to a socket is not followed.
        if entry.file_type()?.is_socket() {
            let _ = remove_stale(&entry.path());
        }
    }
    Ok(())
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

/// `name` in the directory `dir` (open), by a path that reaches that
/// directory through its descriptor, `/proc/self/fd/N/name`: whatever
/// happened to the directory's own path since it was opened (a symlink
/// in it retargeted, a parent renamed), this is the directory that was
/// opened. Linux has no `bindat`; a socket is bound by this path instead.
pub fn path_in(dir: &fs::File, name: &str) -> std::path::PathBuf {
    use std::os::fd::AsRawFd;
    std::path::PathBuf::from(format!("/proc/self/fd/{}/{name}", dir.as_raw_fd()))
}

/// A listening socket at `path`, for a socket made after start-up (the
/// backup's NBD export), when no thread may change its umask any more
/// (the seccomp filter has no `unshare` or `umask`): the socket's own
/// inode gets mode 0600 with `fchmod` before `bind`, which Linux creates
/// the file with, less the process umask (which leaves 0600 whole unless
/// it takes the owner's own rights). A path that exists is an error
/// (`AddrInUse`): nothing is replaced. A socket made in a directory opened
/// at start-up is bound by [`path_in`] that directory.
pub fn bind_private(path: &Path) -> io::Result<UnixListener> {
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: all-zero is a valid sockaddr_un (AF_UNSPEC, empty path).
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a socket path must be 1 to {} bytes",
                addr.sun_path.len() - 1
            ),
        ));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: socket takes no pointers.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nothing else owns; closed on every path.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    // SAFETY: fchmod takes no pointers; `raw` is open (owned by `fd`).
    if unsafe { libc::fchmod(raw, 0o600) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1) as libc::socklen_t;
    // SAFETY: `addr` is a valid sockaddr_un that outlives the call, `len`
    // covers its family and the NUL-terminated path within it.
    if unsafe { libc::bind(raw, (&raw const addr).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: listen takes no pointers.
    // (A listen that fails, which a fresh socket never does, leaves the
    // file for the caller to remove: it may remove files only by its
    // directory's descriptor.)
    if unsafe { libc::listen(raw, 128) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixListener::from(fd))
}
