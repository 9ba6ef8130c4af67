//! The back-end request channel (VHOST_USER_PROTOCOL_F_BACKEND_REQ): the
//! socket a front-end hands over with SET_BACKEND_REQ_FD, on which the
//! back-end sends requests of its own. We send one:
//! VHOST_USER_BACKEND_CONFIG_CHANGE_MSG, after an online resize, so that
//! the front-end reads the configuration space again and tells its guest
//! (QEMU: GET_CONFIG, then a virtio config interrupt).
//!
//! vhost-user-backend hands the crate's `Backend` to the device, but the
//! `vhost` crate (0.18) has no way to send this message through it; so the
//! relay keeps a duplicate of the fd it passes on, and this module speaks
//! the one message itself. The crate never sends anything on it, so the
//! replies read here are ours.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::Duration;

use vhost::vhost_user::message::{BackendReq, VhostUserHeaderFlag};

/// How long the front-end gets to acknowledge (with REPLY_ACK). QEMU
/// answers from its main loop after reading the configuration again;
/// shorter than the 3 s `ringblk ctl` waits for the API's answer.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(2);

/// The only protocol version, in the flags' low bits.
const VERSION: u32 = 0x1;

/// The channel of one connection.
pub struct BackendChannel {
    sock: Mutex<UnixStream>,
    /// REPLY_ACK was negotiated: every request asks for an answer.
    reply_ack: bool,
}

impl BackendChannel {
    pub fn new(sock: UnixStream, reply_ack: bool) -> BackendChannel {
        BackendChannel {
            sock: Mutex::new(sock),
            reply_ack,
        }
    }

    /// Sends CONFIG_CHANGE_MSG, and with REPLY_ACK waits up to
    /// [`ACK_TIMEOUT`] for the front-end's answer. Ok(true): acknowledged;
    /// Ok(false): sent, with no answer to wait for.
    pub fn config_changed(&self) -> io::Result<bool> {
        let code: u32 = BackendReq::CONFIG_CHANGE_MSG.into();
        let mut flags = VERSION;
        if self.reply_ack {
            flags |= VhostUserHeaderFlag::NEED_REPLY.bits();
        }
        let mut hdr = [0u8; 12];
        hdr[0..4].copy_from_slice(&code.to_le_bytes());
        hdr[4..8].copy_from_slice(&flags.to_le_bytes());
        // A zero-length payload (vhost-user spec).
        let mut sock = self.sock.lock().unwrap_or_else(|p| p.into_inner());
        // An answer that came after we stopped waiting for it must not be
        // taken for the answer to this message.
        discard_pending(&sock);
        sock.write_all(&hdr)?;
        if !self.reply_ack {
            return Ok(false);
        }
        sock.set_read_timeout(Some(ACK_TIMEOUT))?;
        let mut reply = [0u8; 20];
        sock.read_exact(&mut reply).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock => io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer from the front-end within {ACK_TIMEOUT:?}"),
            ),
            _ => e,
        })?;
        let le32 =
            |i: usize| u32::from_le_bytes([reply[i], reply[i + 1], reply[i + 2], reply[i + 3]]);
        let (rcode, rflags, size) = (le32(0), le32(4), le32(8));
        let value = u64::from_le_bytes(reply[12..20].try_into().unwrap_or_default());
        if rcode != code || rflags & VhostUserHeaderFlag::REPLY.bits() == 0 || size != 8 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the front-end's answer is not a reply to CONFIG_CHANGE_MSG",
            ));
        }
        if value != 0 {
            return Err(io::Error::other(format!(
                "the front-end answered CONFIG_CHANGE_MSG with an error ({value})"
            )));
        }
        Ok(true)
    }
}

/// Reads and drops whatever the front-end sent that nobody read (a late
/// answer), without blocking: recv with MSG_DONTWAIT, which is the
/// `recvfrom` the seccomp filter allows.
fn discard_pending(sock: &UnixStream) {
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; 256];
    loop {
        // SAFETY: recv writes at most buf.len() bytes into `buf`, a live
        // local; the fd is the channel's, open as long as `sock`.
        let n = unsafe {
            libc::recv(
                sock.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n <= 0 {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_the_message_and_reads_the_ack() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let ch = BackendChannel::new(ours, true);
        let front = std::thread::spawn(move || {
            let mut hdr = [0u8; 12];
            theirs.read_exact(&mut hdr).unwrap();
            assert_eq!(u32::from_le_bytes(hdr[0..4].try_into().unwrap()), 2);
            let flags = u32::from_le_bytes(hdr[4..8].try_into().unwrap());
            assert_ne!(flags & VhostUserHeaderFlag::NEED_REPLY.bits(), 0);
            assert_eq!(u32::from_le_bytes(hdr[8..12].try_into().unwrap()), 0);
            let mut reply = Vec::new();
            reply.extend_from_slice(&2u32.to_le_bytes());
            reply.extend_from_slice(&(VERSION | VhostUserHeaderFlag::REPLY.bits()).to_le_bytes());
            reply.extend_from_slice(&8u32.to_le_bytes());
            reply.extend_from_slice(&0u64.to_le_bytes());
            theirs.write_all(&reply).unwrap();
            theirs
        });
        assert!(ch.config_changed().unwrap());
        drop(front.join().unwrap());
        // The front-end gone: an error, not a hang or a panic.
        assert!(ch.config_changed().is_err());
    }

    /// A reply that arrives after the wait gave up is not the next
    /// message's answer.
    #[test]
    fn a_late_answer_is_not_taken_for_the_next_one() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let ch = BackendChannel::new(ours, true);
        let reply = |value: u64| {
            let mut r = Vec::new();
            r.extend_from_slice(&2u32.to_le_bytes());
            r.extend_from_slice(&(VERSION | VhostUserHeaderFlag::REPLY.bits()).to_le_bytes());
            r.extend_from_slice(&8u32.to_le_bytes());
            r.extend_from_slice(&value.to_le_bytes());
            r
        };
        // A late success for an earlier message, then this one's failure.
        theirs.write_all(&reply(0)).unwrap();
        let front = std::thread::spawn(move || {
            let mut hdr = [0u8; 12];
            theirs.read_exact(&mut hdr).unwrap();
            theirs.write_all(&reply(1)).unwrap();
            theirs
        });
        let e = ch.config_changed().unwrap_err();
        assert!(e.to_string().contains("with an error"), "{e}");
        drop(front.join().unwrap());
    }

    #[test]
    fn without_reply_ack_nothing_is_awaited() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let ch = BackendChannel::new(ours, false);
        assert!(!ch.config_changed().unwrap());
        let mut hdr = [0u8; 12];
        theirs.read_exact(&mut hdr).unwrap();
        assert_eq!(u32::from_le_bytes(hdr[4..8].try_into().unwrap()), VERSION);
    }
}
