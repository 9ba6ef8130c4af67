//! Log lines a guest or a front-end can trigger as often as it likes are
//! rate-limited: repeating a message must not fill the host's disk through
//! the daemon's log. Each case sends one kind of message many times, over
//! one connection and over many, then counts the daemon's lines about it.

use std::os::fd::AsRawFd;

use ringblk_testkit::frontend::*;
use ringblk_testkit::{Daemon, MIB};

/// How often each message is sent.
const REPEATS: usize = 100;

/// Most lines a limited message may produce while the test runs: a burst
/// of 10 per 5 s window, and the test takes well under one or two windows.
const MOST_LINES: usize = 20;

/// `struct VhostUserInflight` for one queue of 256, and its region size.
fn inflight_one_queue() -> (Vec<u8>, u64) {
    let need = ringblk::queue::inflight::queue_region_size(256) as u64;
    (inflight(need, 0, 1, 256), need)
}

fn sealed(size: u64) -> std::fs::File {
    let f = memfd(size);
    seal(&f);
    f
}

/// Sends what `send` sends `REPEATS` times: half over one connection, the
/// other half over a fresh connection each time (a limit kept per
/// connection would start over on each), then counts the daemon's lines
/// containing `needle`.
fn lines_after(d: &mut Daemon, needle: &str, send: impl Fn(&Conn)) -> usize {
    let conn = Conn::connect(&d.socket);
    conn.handshake(0);
    for _ in 0..REPEATS / 2 {
        send(&conn);
    }
    drop(conn);
    for _ in 0..REPEATS / 2 {
        let conn = Conn::connect(&d.socket);
        conn.handshake(0);
        send(&conn);
    }
    d.assert_running();
    d.log().lines().filter(|l| l.contains(needle)).count()
}

#[track_caller]
fn assert_limited(what: &str, lines: usize) {
    assert!(lines >= 1, "{what}: not logged at all");
    assert!(
        lines <= MOST_LINES,
        "{what}: {lines} log lines for {REPEATS} messages (at most {MOST_LINES} allowed)"
    );
}

/// The guest toggles its write cache (VIRTIO_BLK_F_CONFIG_WCE): each
/// toggle is a SET_CONFIG the front-end relays.
#[test]
fn write_cache_toggles() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let toggle = std::cell::Cell::new(0u8);
    let n = lines_after(&mut d, "guest set the write cache", |c| {
        toggle.set(toggle.get() ^ 1);
        c.ok(SET_CONFIG, &config(32, 1, &[toggle.get()]), &[]);
    });
    assert_limited("SET_CONFIG wce", n);
}

#[test]
fn refused_get_inflight_fd() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let n = lines_after(&mut d, "GET_INFLIGHT_FD refused", |c| {
        let m = c.get(GET_INFLIGHT_FD, &inflight(0, 0, 0, 256));
        assert!(m.fd.is_none(), "a region for 0 queues");
    });
    assert_limited("GET_INFLIGHT_FD refused", n);
}

#[test]
fn refused_set_inflight_fd() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let (payload, _) = inflight_one_queue();
    let n = lines_after(&mut d, "SET_INFLIGHT_FD refused", |c| {
        // No fd: refused, and the connection goes on.
        let out = c.ask(SET_INFLIGHT_FD, &payload, &[]);
        assert!(out.is_refusal(), "SET_INFLIGHT_FD without an fd");
    });
    assert_limited("SET_INFLIGHT_FD refused", n);
}

/// Accepted inflight messages log at debug level, once per message.
#[test]
fn accepted_inflight_messages() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let (payload, need) = inflight_one_queue();
    let n = lines_after(&mut d, "inflight tracking:", |c| {
        let m = c.get(GET_INFLIGHT_FD, &payload);
        assert!(m.fd.is_some(), "GET_INFLIGHT_FD for one queue of 256");
    });
    assert_limited("GET_INFLIGHT_FD", n);
    let n = lines_after(&mut d, "inflight region installed", |c| {
        let f = sealed(need);
        c.ok(SET_INFLIGHT_FD, &payload, &[f.as_raw_fd()]);
    });
    assert_limited("SET_INFLIGHT_FD", n);
}

/// A front-end that sends an oversized message is disconnected with one
/// line; reconnecting and doing it again must not add a line each time.
#[test]
fn connections_ended_for_malformed_messages() {
    let mut d = Daemon::start(64 * MIB, &[]);
    for _ in 0..REPEATS {
        let conn = Conn::connect(&d.socket);
        let _ = conn.send_raw(&header(GET_FEATURES, FLAG_VERSION, 1 << 20), &[]);
        assert!(conn.recv().is_none(), "not disconnected");
    }
    d.assert_running();
    let n = d
        .log()
        .lines()
        .filter(|l| l.contains("; disconnecting"))
        .count();
    assert_limited("oversized messages", n);
}
