//! A hostile front-end over a real socket: a raw vhost-user front-end
//! (`frontend`) against `ringblk serve` (`common`). After what it does,
//! the daemon must still serve: it is running, and a fresh blkio client
//! writes 4 KiB and reads the same bytes back (`frontend::assert_serves`).

mod common;
mod frontend;

use std::thread;
use std::time::{Duration, Instant};

use common::{Daemon, MIB};
use frontend::*;

// ---------------------------------------------------------------------------
// Connections come and go

/// Every connection's fds are released when it ends: reconnects (raw
/// front-ends that only negotiate, and blkio clients) leave the daemon
/// with the fds it had. vhost-user-backend used to leak an eventfd per
/// queue per connection (see `ExitEvents` in src/vhost/backend.rs).
#[test]
fn reconnects_release_their_fds() {
    let mut d = Daemon::start(64 * MIB, &["--queues", "2"]);
    assert_serves(&mut d, "the first connection", 0, 0);
    thread::sleep(Duration::from_millis(200));
    let baseline = fd_count(d.pid());
    for i in 0..10u8 {
        let c = Conn::connect(&d.socket);
        c.handshake(0);
        drop(c);
        assert_serves(&mut d, "a reconnect", 8192 * (u64::from(i) + 1), i);
    }
    assert_no_fd_leak(&d, baseline);
}

/// Waits (up to 10 s) until the daemon has no more open fds than
/// `baseline`: every connection's fds are released when it ends.
fn assert_no_fd_leak(d: &Daemon, baseline: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = fd_count(d.pid());
        if n <= baseline {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the daemon holds {n} fds once idle again, {baseline} before: a leak"
        );
        thread::sleep(Duration::from_millis(50));
    }
}
