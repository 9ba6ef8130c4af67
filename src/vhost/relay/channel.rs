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
//!
//! The front-end is half-trusted: one that never reads the channel, never
//! answers, or writes to it unasked delays a notification by [`DEADLINE`]
//! at most. The control API sends it holding none of its locks.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::BackendReq;

use super::wire::{HEADER_LEN, Header, NEED_REPLY, VERSION};

/// How long one notification may wait for the front-end in all: for the
/// channel (another notification using it), for room in a socket buffer
/// the front-end does not empty, and with REPLY_ACK for its answer. QEMU
/// reads the channel from its main loop and answers after reading the
/// configuration again. Shorter than the 3 s `ringblk ctl` waits for the
/// API's answer, so a front-end that never reads delays a resize by this
/// much and no more.
pub const DEADLINE: Duration = Duration::from_secs(2);

/// The most bytes of late answers dropped before a message is sent; a
/// front-end that writes more than that unasked is not answering us.
const MAX_DISCARD: usize = 4096;

/// The channel of one connection.
pub struct BackendChannel {
    sock: UnixStream,
    /// REPLY_ACK was negotiated: every request asks for an answer.
    reply_ack: bool,
    /// A notification is using the channel; the next waits on `idle`, up
    /// to its deadline.
    busy: Mutex<bool>,
    idle: Condvar,
    /// A message went out in part only (its deadline ran out midway): what
    /// the front-end reads next would not start at a message, so nothing
    /// more is sent.
    broken: AtomicBool,
}

/// One notification's use of the channel; the next may go when dropped.
struct Turn<'a>(&'a BackendChannel);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *lock(&self.0.busy) = false;
        self.0.idle.notify_one();
    }
}

fn lock(m: &Mutex<bool>) -> MutexGuard<'_, bool> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("{what} within {DEADLINE:?}"),
    )
}

impl BackendChannel {
    pub fn new(sock: UnixStream, reply_ack: bool) -> BackendChannel {
        BackendChannel {
            sock,
            reply_ack,
            busy: Mutex::new(false),
            idle: Condvar::new(),
            broken: AtomicBool::new(false),
        }
    }

    /// Sends CONFIG_CHANGE_MSG, and with REPLY_ACK waits for the
    /// front-end's answer; all of it within [`DEADLINE`]. Ok(true):
    /// acknowledged; Ok(false): sent, with no answer to wait for.
    pub fn config_changed(&self) -> io::Result<bool> {
        let deadline = Instant::now() + DEADLINE;
        let _turn = self.turn(deadline)?;
        if self.broken.load(Ordering::Relaxed) {
            return Err(io::Error::other(
                "the back-end channel is out of step since a message to it was cut off",
            ));
        }
        let code: u32 = BackendReq::CONFIG_CHANGE_MSG.into();
        let mut flags = VERSION;
        if self.reply_ack {
            flags |= NEED_REPLY;
        }
        // A zero-length payload (vhost-user spec).
        let hdr = Header::new(code, flags, 0).to_bytes();
        // An answer that came after we stopped waiting for it must not be
        // taken for the answer to this message.
        discard_pending(&self.sock)?;
        self.send(&hdr, deadline)?;
        if !self.reply_ack {
            return Ok(false);
        }
        let mut reply = [0u8; HEADER_LEN + 8];
        read_by(&self.sock, &mut reply, deadline)?;
        let (head, value) = reply.split_at(HEADER_LEN);
        let head = Header::from_bytes(head.try_into().unwrap_or(&[0; HEADER_LEN]));
        let value = u64::from_le_bytes(value.try_into().unwrap_or_default());
        if head.request != code || !head.is_reply() || head.size != 8 {
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

    /// Waits, until `deadline`, for the notification using the channel to
    /// finish.
    fn turn(&self, deadline: Instant) -> io::Result<Turn<'_>> {
        let mut busy = lock(&self.busy);
        while *busy {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timed_out(
                    "an earlier notification still waits for the front-end: not sent",
                ));
            }
            busy = self
                .idle
                .wait_timeout(busy, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *busy = true;
        Ok(Turn(self))
    }

    /// Writes all of `msg` before `deadline` (SO_SNDTIMEO, set to what is
    /// left of it before each write). A message cut off midway breaks the
    /// channel.
    fn send(&self, msg: &[u8], deadline: Instant) -> io::Result<()> {
        let mut sent = 0;
        while sent < msg.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            let result = if left.is_zero() {
                Err(io::ErrorKind::WouldBlock.into())
            } else {
                self.sock
                    .set_write_timeout(Some(left))
                    .and_then(|()| (&self.sock).write(&msg[sent..]))
            };
            match result {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    if sent > 0 {
                        self.broken.store(true, Ordering::Relaxed);
                    }
                    return Err(match e.kind() {
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                            timed_out("the front-end did not read its back-end channel")
                        }
                        _ => e,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Reads all of `buf` before `deadline` (SO_RCVTIMEO, set to what is left
/// of it before each read). An answer cut short is dropped with the next
/// message's late answers ([`discard_pending`]).
fn read_by(sock: &UnixStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        let result = if left.is_zero() {
            Err(io::ErrorKind::WouldBlock.into())
        } else {
            sock.set_read_timeout(Some(left))
                .and_then(|()| (&*sock).read(&mut buf[got..]))
        };
        match result {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                        timed_out("no answer from the front-end")
                    }
                    _ => e,
                });
            }
        }
    }
    Ok(())
}

/// Reads and drops what the front-end sent that nobody read (a late
/// answer), without blocking: recv with MSG_DONTWAIT, which is the
/// `recvfrom` the seccomp filter allows. At most [`MAX_DISCARD`] bytes: a
/// front-end that keeps writing would otherwise keep this loop going.
fn discard_pending(sock: &UnixStream) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; 256];
    let mut dropped = 0;
    while dropped <= MAX_DISCARD {
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
            return Ok(());
        }
        dropped += n as usize;
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        format!("the front-end sent more than {MAX_DISCARD} bytes on the back-end channel unasked"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_the_message_and_reads_the_ack() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let ch = BackendChannel::new(ours, true);
        let front = std::thread::spawn(move || {
            let mut hdr = [0u8; HEADER_LEN];
            theirs.read_exact(&mut hdr).unwrap();
            let hdr = Header::from_bytes(&hdr);
            assert_eq!((hdr.request, hdr.size), (2, 0));
            assert!(hdr.needs_reply());
            let mut reply = Header::reply(2u32, 8).to_bytes().to_vec();
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
            r.extend_from_slice(&Header::reply(2u32, 8).to_bytes());
            r.extend_from_slice(&value.to_le_bytes());
            r
        };
        // A late success for an earlier message, then this one's failure.
        theirs.write_all(&reply(0)).unwrap();
        let front = std::thread::spawn(move || {
            let mut hdr = [0u8; HEADER_LEN];
            theirs.read_exact(&mut hdr).unwrap();
            theirs.write_all(&reply(1)).unwrap();
            theirs
        });
        let e = ch.config_changed().unwrap_err();
        assert!(e.to_string().contains("with an error"), "{e}");
        drop(front.join().unwrap());
    }

    /// Fills `sock`'s send buffer (the peer never reads).
    fn fill(sock: &UnixStream) {
        use std::os::fd::AsRawFd;
        let junk = [0u8; 4096];
        // SAFETY: send reads at most junk.len() bytes from `junk`; the fd
        // is `sock`'s, open for the call.
        while unsafe {
            libc::send(
                sock.as_raw_fd(),
                junk.as_ptr().cast(),
                junk.len(),
                libc::MSG_DONTWAIT,
            )
        } > 0
        {}
    }

    /// A front-end that never reads its channel: the send gives up at the
    /// deadline (it used to block until the front-end closed the socket),
    /// and so does a second notification waiting for the first.
    #[test]
    fn a_front_end_that_never_reads_costs_the_deadline_only() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        fill(&ours);
        let ch = std::sync::Arc::new(BackendChannel::new(ours, true));
        let started = Instant::now();
        let second = {
            let ch = ch.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                let r = ch.config_changed();
                (r, started.elapsed())
            })
        };
        let e = ch.config_changed().unwrap_err();
        let took = started.elapsed();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("did not read"), "{e}");
        assert!(
            took >= DEADLINE && took < DEADLINE + Duration::from_secs(1),
            "{took:?}"
        );
        let (r, took) = second.join().unwrap();
        let e = r.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(took < 2 * DEADLINE + Duration::from_millis(500), "{took:?}");
        // Nothing went out in part: the channel still works once read.
        drop(theirs);
        assert!(!ch.broken.load(Ordering::Relaxed));
    }

    /// Unasked bytes are dropped before a message, but only so many: a
    /// front-end that floods the channel gets an error, not a thread
    /// spinning on its bytes.
    #[test]
    fn a_flood_of_unasked_bytes_is_not_read_forever() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        fill(&theirs);
        let ch = BackendChannel::new(ours, true);
        let e = ch.config_changed().unwrap_err();
        assert!(e.to_string().contains("unasked"), "{e}");
    }

    #[test]
    fn without_reply_ack_nothing_is_awaited() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let ch = BackendChannel::new(ours, false);
        assert!(!ch.config_changed().unwrap());
        let mut hdr = [0u8; HEADER_LEN];
        theirs.read_exact(&mut hdr).unwrap();
        assert_eq!(Header::from_bytes(&hdr).flags, VERSION);
    }
}
