//! The vhost-user listening socket.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::Path;

use super::DaemonError;

/// Binds `path`, replacing a stale socket file but never one a live daemon
/// still accepts on, and sets the file's mode.
pub fn bind(path: &Path, mode: u32) -> Result<UnixListener, DaemonError> {
    let err = |what: String| DaemonError::Socket(format!("{}: {what}", path.display()));
    crate::unix_socket::remove_stale(path).map_err(|e| match e.kind() {
        io::ErrorKind::AddrInUse => err("in use by a running daemon".into()),
        _ => err(e.to_string()),
    })?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(|e| err(format!("cannot create its directory: {e}")))?;
    }
    let listener = UnixListener::bind(path).map_err(|e| err(format!("cannot listen: {e}")))?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|e| err(format!("cannot set mode: {e}")))?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
