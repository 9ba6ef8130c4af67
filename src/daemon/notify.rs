//! Readiness for a service manager (sd_notify(3)): READY=1 once the daemon
//! accepts connections, STOPPING=1 when it shuts down, on the datagram
//! socket named by NOTIFY_SOCKET (a path, or `@name` for an abstract one).
//!
//! The socket is made and connected at start-up, before the seccomp
//! filter; afterwards a notification is one send(2) (sendto, which the
//! filter allows), so the filter need not allow datagram sockets or a
//! connect.

use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// A connected notification socket, or nothing when not started by a
/// service manager.
pub struct Notifier(Option<UnixDatagram>);

impl Notifier {
    /// Connects to NOTIFY_SOCKET, if set, and removes it from the
    /// environment.
    pub fn from_env() -> Result<Notifier, String> {
        let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
            return Ok(Notifier(None));
        };
        // SAFETY: called from `serve` before the daemon starts any thread,
        // so no other thread reads the environment meanwhile.
        unsafe { std::env::remove_var("NOTIFY_SOCKET") };
        let err = |e: io::Error| format!("NOTIFY_SOCKET {}: {e}", path.to_string_lossy());
        let bytes = path.as_encoded_bytes();
        let addr = match bytes.split_first() {
            Some((b'@', name)) => {
                use std::os::linux::net::SocketAddrExt;
                SocketAddr::from_abstract_name(name).map_err(err)?
            }
            Some((b'/', _)) => SocketAddr::from_pathname(&path).map_err(err)?,
            _ => {
                return Err(format!(
                    "NOTIFY_SOCKET '{}' is neither a path nor @abstract",
                    path.to_string_lossy()
                ));
            }
        };
        let sock = UnixDatagram::unbound().map_err(err)?;
        sock.connect_addr(&addr).map_err(err)?;
        Ok(Notifier(Some(sock)))
    }

    /// Sends `state` (e.g. "READY=1"); a failure is logged, not fatal.
    pub fn notify(&self, state: &str) {
        if let Some(s) = &self.0
            && let Err(e) = s.send(state.as_bytes())
        {
            log::warn!("sd_notify {state}: {e}");
        }
    }

    /// A second handle on the same socket, for the signal handler.
    pub fn try_clone(&self) -> io::Result<Notifier> {
        self.0
            .as_ref()
            .map(UnixDatagram::try_clone)
            .transpose()
            .map(Notifier)
    }
}
