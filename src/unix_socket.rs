//! Unix socket files shared by the vhost-user listener and the metrics
//! endpoint: a socket left by a crashed process is replaced, one a live
//! process accepts on never is.

use std::fs;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
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
