//! The vhost-user listening socket.

use std::fs;
use std::io;
use std::os::unix::net::UnixListener;
use std::path::Path;

use super::DaemonError;

/// Binds `path`, replacing a stale socket file but never one a live daemon
/// still accepts on. The file is born with `mode`: nothing changes it by
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
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(|e| err(format!("cannot create its directory: {e}")))?;
    }
    bind_with_mode(path, mode).map_err(|e| err(format!("cannot listen: {e}")))
}

/// `UnixListener::bind`, with the socket file created as `mode` whatever
/// the process umask. Linux creates the file with the mode of the socket's
/// own inode (0777, or what an fchmod of the fd set before bind) minus the
/// umask, so fchmod alone cannot grant what the umask takes away (660
/// under umask 022 would give 640). The umask is set in a thread of its
/// own instead, after unshare(CLONE_FS) has given that thread private
/// file-system attributes: no other thread ever sees it changed.
fn bind_with_mode(path: &Path, mode: u32) -> io::Result<UnixListener> {
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
}
