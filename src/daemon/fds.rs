//! The daemon's file descriptors: the limit, and the share of it that the
//! vhost-user side can count on.
//!
//! The soft `RLIMIT_NOFILE` is raised to the hard limit at start-up
//! (systemd starts services at 1024 soft, 524288 hard): the daemon never
//! uses select(2), the one reason to stay under 1024.
//!
//! The reserve: the HTTP endpoints hold at most [`ENDPOINT_FDS`] each (a
//! fixed cap on connections, one fd each, plus the listener and the
//! runtime's own; `api::server`), and what else the daemon holds is open
//! before the filter (image, sockets, rings, eventfds). So whatever the
//! limit leaves beyond what is open at start-up and what the endpoints can
//! take is the vhost-user side's, and no HTTP client can take it: idle
//! connections past the cap are closed at once, not accepted into a
//! thread. [`check_reserve`] warns at start-up when that share is smaller
//! than what one front-end may need ([`FRONT_END_FDS`]).

use std::io;

use crate::api::ENDPOINT_FDS;

/// What one front-end can make the daemon hold open at once, rounded up:
/// a file per memory region (509 slots, `vhost::sigbus::MEM_SLOTS`), the
/// kick, call and error eventfds of each of 64 queues, the inflight and
/// log memfds, the back-end channel, the connection and the relay's
/// sockets, and the queue threads' epolls and eventfds.
pub const FRONT_END_FDS: u64 = 1024;

fn get() -> io::Result<libc::rlimit> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit to the valid pointer given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(l)
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit.
pub fn raise_limit() -> io::Result<()> {
    let mut l = get()?;
    if l.rlim_cur < l.rlim_max {
        let old = l.rlim_cur;
        l.rlim_cur = l.rlim_max;
        // SAFETY: setrlimit reads one rlimit from the valid pointer given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) } != 0 {
            return Err(io::Error::last_os_error());
        }
        log::debug!("fd limit raised from {old} to {}", l.rlim_cur);
    }
    Ok(())
}

/// Warns when the fd limit leaves a front-end fewer than
/// [`FRONT_END_FDS`], once the fds open now and those `endpoints` HTTP
/// endpoints may take are counted. Called when start-up has opened
/// everything (before the seccomp filter, which forbids reading
/// /proc/self/fd).
pub fn check_reserve(endpoints: usize) {
    let limit = match get() {
        Ok(l) => l.rlim_cur,
        Err(e) => {
            log::debug!("cannot read the fd limit: {e}");
            return;
        }
    };
    let open = match std::fs::read_dir("/proc/self/fd") {
        // Less the directory's own fd.
        Ok(d) => (d.count() as u64).saturating_sub(1),
        Err(e) => {
            log::debug!("cannot count the open fds: {e}");
            return;
        }
    };
    let http = (endpoints * ENDPOINT_FDS) as u64;
    let left = limit.saturating_sub(open + http);
    if left < FRONT_END_FDS {
        log::warn!(
            "the fd limit is {limit}: with {open} open and {http} for the HTTP endpoints, a front-end has {left}, fewer than one with many queues and memory regions may need ({FRONT_END_FDS}); raise it (LimitNOFILE=, ulimit -Hn)"
        );
    } else {
        log::debug!(
            "fds: limit {limit}, {open} open, {http} for the HTTP endpoints, {left} for the front-end"
        );
    }
}
