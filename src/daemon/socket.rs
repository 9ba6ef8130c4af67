//! The vhost-user listening socket: bound here, or passed in
//! (`--socket-fd`, systemd's socket activation).

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use super::DaemonError;
use crate::device::FrontEnd;

/// The process at the other end of `stream`, as the kernel recorded it
/// when it connected (SO_PEERCRED); None if the kernel does not say.
pub fn peer(stream: &UnixStream) -> Option<FrontEnd> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let size = std::mem::size_of::<libc::ucred>();
    let mut len = size as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes through the pointer,
    // which points to `cred`, a live local of that size; the fd is open
    // while `stream` is borrowed.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if r != 0 || len as usize != size {
        return None;
    }
    Some(FrontEnd {
        pid: u32::try_from(cred.pid).unwrap_or(0),
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// Binds `path`, replacing a stale socket file but never one a live daemon
/// still accepts on. Its directory must exist. The file is born with `mode`: nothing changes it by
/// path afterwards, because a chmod by path after bind follows whatever
/// the path leads to by then (a directory swapped for a symlink sends it to
/// a file of the swapper's choosing), and until then the socket would have
/// the umask's mode, not ours.
pub fn bind(path: &Path, mode: u32) -> Result<UnixListener, DaemonError> {
    let err = |what: String| DaemonError::Socket(format!("{}: {what}", path.display()));
    crate::unix_socket::remove_stale(path).map_err(|e| match e.kind() {
        io::ErrorKind::AddrInUse => err("in use by a running daemon".into()),
        _ => err(e.to_string()),
    })?;
    // The directory must be there: a mistyped path is refused rather than
    // created (the default directory is made, and checked, by
    // `config::rundir`, before this).
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        match fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(err(format!("{} is not a directory", dir.display()))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(err(format!(
                    "the directory {} does not exist (create it first)",
                    dir.display()
                )));
            }
            Err(e) => return Err(err(format!("{}: {e}", dir.display()))),
        }
    }
    crate::unix_socket::bind_with_mode(path, mode).map_err(|e| err(format!("cannot listen: {e}")))
}

/// The first descriptor systemd passes (SD_LISTEN_FDS_START).
const LISTEN_FDS_START: RawFd = 3;

/// The socket systemd passed us, if it did (sd_listen_fds(3)): LISTEN_PID
/// is our pid and LISTEN_FDS at least 1. With several, the one named
/// `vhost` in LISTEN_FDNAMES (`FileDescriptorName=vhost`). The variables
/// are removed, so nothing started later takes them for its own.
pub fn systemd_fd() -> Result<Option<RawFd>, DaemonError> {
    let var = |name| std::env::var(name).ok();
    let (Some(pid), Some(count)) = (var("LISTEN_PID"), var("LISTEN_FDS")) else {
        return Ok(None);
    };
    let names = var("LISTEN_FDNAMES");
    for name in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        // SAFETY: called from `serve` before the daemon starts any thread
        // (`Listen::passed` is its first step), so no other thread reads
        // the environment meanwhile.
        unsafe { std::env::remove_var(name) };
    }
    if pid.trim().parse::<u32>().ok() != Some(std::process::id()) {
        return Ok(None);
    }
    let err = |m: String| DaemonError::Socket(format!("systemd socket activation: {m}"));
    let count: RawFd = count
        .trim()
        .parse()
        .map_err(|_| err(format!("LISTEN_FDS='{count}' is not a number")))?;
    match count {
        0 => Ok(None),
        1 => Ok(Some(LISTEN_FDS_START)),
        n if !(0..=1024).contains(&n) => Err(err(format!("LISTEN_FDS={n} is not a usable count"))),
        n => {
            let i = names
                .as_deref()
                .and_then(|l| l.split(':').position(|name| name == "vhost"))
                .filter(|&i| (i as RawFd) < n)
                .ok_or_else(|| {
                    err(format!(
                        "{n} sockets passed and none named 'vhost' in LISTEN_FDNAMES (FileDescriptorName=vhost)"
                    ))
                })?;
            Ok(Some(LISTEN_FDS_START + i as RawFd))
        }
    }
}

/// Takes `fd` (passed in by `from`) as the listening socket, after
/// checking that it is one: an open AF_UNIX SOCK_STREAM socket in the
/// listening state. It is made close-on-exec.
pub fn adopt(fd: RawFd, from: &str) -> Result<UnixListener, DaemonError> {
    let err = |m: String| DaemonError::Socket(format!("fd {fd} ({from}): {m}"));
    if fd < 0 {
        return Err(err("not a file descriptor".into()));
    }
    let opt = |name: libc::c_int| -> io::Result<libc::c_int> {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes to `v`, a live
        // c_int, and `len` says how many; an fd that is not a socket gets
        // ENOTSOCK, a closed one EBADF.
        let r =
            unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, name, (&raw mut v).cast(), &mut len) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(v)
        }
    };
    let domain = opt(libc::SO_DOMAIN).map_err(|e| match e.raw_os_error() {
        Some(libc::EBADF) => err("not an open file descriptor".into()),
        Some(libc::ENOTSOCK) => err("not a socket".into()),
        _ => err(e.to_string()),
    })?;
    if domain != libc::AF_UNIX {
        return Err(err(format!("not a Unix socket (address family {domain})")));
    }
    if opt(libc::SO_TYPE).map_err(|e| err(e.to_string()))? != libc::SOCK_STREAM {
        return Err(err("not a stream socket".into()));
    }
    if opt(libc::SO_ACCEPTCONN).map_err(|e| err(e.to_string()))? == 0 {
        return Err(err("not listening (listen(2) was not called on it)".into()));
    }
    // SAFETY: `fd` is an open socket (getsockopt succeeded on it) that was
    // passed to this process to serve; nothing else in the daemon knows of
    // it, so the listener becomes its only owner.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: F_SETFD with FD_CLOEXEC on an fd we own; no pointers.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
        return Err(err(io::Error::last_os_error().to_string()));
    }
    Ok(UnixListener::from(owned))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn live_socket_is_refused_stale_one_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.sock");
        let l = bind(&p, 0o600).unwrap();
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let e = bind(&p, 0o600).err().unwrap().to_string();
        assert!(e.contains("in use"), "{e}");
        // A listener that goes away without unlinking leaves a stale file.
        std::mem::forget(l);
        let raw = std::os::unix::net::UnixListener::bind(dir.path().join("t.sock")).unwrap();
        drop(raw);
        assert!(bind(&dir.path().join("t.sock"), 0o600).is_ok());
        fs::write(dir.path().join("f"), b"x").unwrap();
        assert!(bind(&dir.path().join("f"), 0o600).is_err());
    }

    /// The mode asked for, bits the process umask would take away
    /// included, and the process umask untouched.
    #[test]
    fn the_socket_has_its_mode_whatever_the_umask() {
        // Read, not set: other tests of this process create files meanwhile.
        let umask = || {
            fs::read_to_string("/proc/self/status")
                .unwrap()
                .lines()
                .find_map(|l| l.strip_prefix("Umask:").map(|v| v.trim().to_string()))
                .unwrap()
        };
        let before = umask();
        let dir = tempfile::tempdir().unwrap();
        for (i, mode) in [0o600, 0o660, 0o666, 0o777, 0o000].into_iter().enumerate() {
            let p = dir.path().join(format!("{i}.sock"));
            let _l = bind(&p, mode).unwrap();
            let got = fs::symlink_metadata(&p).unwrap().permissions().mode() & 0o777;
            assert_eq!(got, mode, "--socket-mode {mode:03o} gave {got:03o}");
        }
        assert_eq!(umask(), before, "the process umask changed");
    }

    #[test]
    fn only_a_listening_unix_stream_socket_is_adopted() {
        use std::os::fd::IntoRawFd;
        let dir = tempfile::tempdir().unwrap();
        let l = UnixListener::bind(dir.path().join("l.sock")).unwrap();
        let fd = l.into_raw_fd();
        let adopted = adopt(fd, "test").unwrap();
        assert!(adopted.local_addr().unwrap().as_pathname().is_some());
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let e = adopt(a.into_raw_fd(), "test").unwrap_err().to_string();
        assert!(e.contains("not listening"), "{e}");
        let f = fs::File::open("/dev/null").unwrap();
        let e = adopt(f.into_raw_fd(), "test").unwrap_err().to_string();
        assert!(e.contains("not a socket"), "{e}");
        let u = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let e = adopt(u.into_raw_fd(), "test").unwrap_err().to_string();
        assert!(e.contains("not a Unix socket"), "{e}");
        let e = adopt(1000, "test").unwrap_err().to_string();
        assert!(e.contains("not an open file descriptor"), "{e}");
    }
}
