//! A queue's wake-up timer: a throttled request (QoS) or one waiting for
//! the image lock waits at the head of the queue, and the timer brings
//! the worker back when it should try again. One per queue, made before
//! the seccomp filter (which forbids timerfd_create) and reused by every
//! connection.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// A one-shot monotonic timerfd, non-blocking: watched in a queue thread's
/// epoll to end a wait (for QoS tokens, for the image lock).
#[derive(Debug)]
pub struct Timer(OwnedFd);

impl Timer {
    pub fn new() -> io::Result<Timer> {
        // SAFETY: plain syscall with constant arguments; no memory passed.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned to us by timerfd_create and is
        // owned by nothing else.
        Ok(Timer(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Fires once, `after` from now (at least a microsecond: zero would
    /// disarm it). Re-arming replaces the previous expiry.
    pub fn arm(&self, after: Duration) -> io::Result<()> {
        let after = after.max(Duration::from_micros(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: after.as_secs() as libc::time_t,
                tv_nsec: after.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: `spec` is a valid itimerspec on our stack for the call;
        // the old value is not asked for (null).
        let r = unsafe { libc::timerfd_settime(self.fd(), 0, &spec, std::ptr::null_mut()) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Consumes an expiry, so that the fd stops being readable. Nothing to
    /// consume (EAGAIN) is fine.
    pub fn clear(&self) {
        let mut count = 0u64;
        // SAFETY: reads at most 8 bytes into `count`, which is 8 bytes on
        // our stack; the fd is non-blocking.
        let _ = unsafe { libc::read(self.fd(), (&raw mut count).cast(), 8) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn timer_fires_once_and_clears() {
        let t = Timer::new().unwrap();
        let readable = |ms| {
            let mut p = libc::pollfd {
                fd: t.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd on our stack.
            unsafe { libc::poll(&mut p, 1, ms) == 1 }
        };
        assert!(!readable(0));
        let start = Instant::now();
        t.arm(Duration::from_millis(20)).unwrap();
        assert!(readable(2000));
        assert!(start.elapsed() >= Duration::from_millis(20));
        t.clear();
        assert!(!readable(50), "one-shot: no second expiry");
        t.clear();
    }
}
