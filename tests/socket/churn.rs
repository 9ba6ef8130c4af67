//! Connection churn and resource exhaustion: the daemon serves one
//! front-end at a time, so whatever one does (connect and say nothing,
//! stop mid-message, come and go a thousand times, run the daemon out of
//! fds) must not keep the next one from being served, nor leave a thread
//! or an fd behind.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use ringblk::virtio::chain_writer::{readable as r, writable as w};
use ringblk_testkit::frontend;
use ringblk_testkit::frontend::{Conn, Guest, Vq, assert_serves, fd_count};
use ringblk_testkit::{Daemon, DaemonOptions, MIB};

/// How long the next client may wait: the daemon's time limits on a
/// front-end's messages (5 s) and some margin.
const NEXT_CLIENT_WITHIN: Duration = Duration::from_secs(9);

/// `assert_serves` from another thread, with a deadline: a daemon stuck on
/// the previous connection never even answers the handshake.
fn served_within(d: &mut Daemon, what: &str, offset: u64, seed: u8, limit: Duration) {
    let (tx, rx) = mpsc::channel();
    let socket = d.socket.clone();
    thread::spawn(move || {
        let c = Conn::connect(&socket);
        c.handshake(0);
        tx.send(()).ok();
    });
    assert!(
        rx.recv_timeout(limit).is_ok(),
        "{what}: the next front-end got no handshake within {limit:?}"
    );
    assert_serves(d, what, offset, seed);
}

#[test]
fn a_silent_client_does_not_hold_the_daemon() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let started = Instant::now();
    let _silent = UnixStream::connect(&d.socket).expect("connect");
    served_within(&mut d, "after a silent client", 0, 1, NEXT_CLIENT_WITHIN);
    assert!(
        started.elapsed() >= Duration::from_secs(4),
        "not even a pause?"
    );
    d.wait_for_log("sent nothing within the first message's time limit");
}

#[test]
fn a_client_that_stops_mid_message_does_not_hold_the_daemon() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let c = Conn::connect(&d.socket);
    c.handshake(0);
    // Five bytes of a 12-byte header, then nothing.
    let mut raw = UnixStream::connect(&d.socket).expect("connect");
    drop(c);
    raw.write_all(&[1, 0, 0, 0, 1]).expect("write");
    served_within(
        &mut d,
        "after a stalled message",
        4096,
        2,
        NEXT_CLIENT_WITHIN,
    );
    d.wait_for_log("stopped in the middle of a message");
}

/// 1,000 front-ends in a row, each connecting, setting up a ring, kicking
/// a request and going away; each one's kick eventfd is written again
/// after it left. Threads and fds come back to where they were.
#[test]
fn a_thousand_connections_leave_no_thread_or_fd_behind() {
    const ROUNDS: u32 = 1000;
    let mut d = Daemon::start(64 * MIB, &["--queues", "2"]);
    let g = Guest::new();
    let round = |i: u32, old_kicks: &mut Vec<vmm_sys_util::eventfd::EventFd>| {
        let conn = Conn::connect(&d.socket);
        conn.handshake(0);
        g.share(&conn);
        let mut vq = Vq::new(0, 64, 0x1_0000);
        vq.setup(&conn, &g);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&1u32.to_le_bytes());
        h[8..16].copy_from_slice(&u64::from(i % 64).to_le_bytes());
        g.write(0x2_0000, &h);
        vq.post(&g, &[r(0x2_0000, 16), r(0x3_0000, 512), w(0x2_1000, 1)]);
        assert_eq!(vq.one_used(&g), (0, 1), "round {i}");
        drop(conn);
        // The old connection's kick, written after it is gone.
        vq.kick.write(1).expect("old kick");
        old_kicks.push(vq.kick);
        if old_kicks.len() > 8 {
            old_kicks.remove(0);
        }
    };
    let mut old = Vec::new();
    round(0, &mut old);
    thread::sleep(Duration::from_millis(200));
    let (fds, threads) = (fd_count(d.pid()), d.threads().len());
    let started = Instant::now();
    for i in 1..ROUNDS {
        round(i, &mut old);
    }
    eprintln!("{ROUNDS} connections in {:.1?}", started.elapsed());
    for k in &old {
        k.write(1).expect("old kick");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = (fd_count(d.pid()), d.threads().len());
        if now.0 <= fds && now.1 <= threads {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after {ROUNDS} connections the daemon holds {} fds and {} threads, {fds} and {threads} after the first",
            now.0,
            now.1
        );
        thread::sleep(Duration::from_millis(50));
    }
    assert_serves(&mut d, "after the churn", 8192, 3);
}

/// A daemon that runs out of fds: a front-end hands over more memory
/// regions (one fd each) than the daemon may hold. Its connection fails;
/// the daemon goes on, frees them all, and serves the next front-end.
#[test]
fn running_out_of_fds_ends_a_connection_not_the_daemon() {
    let mut d = Daemon::start_with(DaemonOptions {
        size: 64 * MIB,
        args: &[],
        wrapper: &["prlimit", "--nofile=128:128", "--"],
        ..DaemonOptions::default()
    });
    assert_serves(&mut d, "before", 0, 4);
    thread::sleep(Duration::from_millis(200));
    let baseline = fd_count(d.pid());
    let conn = Conn::connect(&d.socket);
    conn.handshake(0);
    let g = Guest::new();
    g.share(&conn);
    // One region per message, each with its own fd, until the daemon
    // refuses or hangs up.
    let mut refused = false;
    for i in 0..200u64 {
        let file = frontend::memfd(4096);
        let region = frontend::region(0x1_0000_0000 + i * 4096, 4096, 0x7000_0000 + i * 4096, 0);
        let out = conn.ask(
            frontend::ADD_MEM_REG,
            &frontend::single_region(&region),
            &[std::os::fd::AsRawFd::as_raw_fd(&file)],
        );
        if out.is_refusal() {
            refused = true;
            break;
        }
    }
    assert!(
        refused,
        "200 regions of one fd each, all accepted under 128 fds"
    );
    drop(conn);
    assert_serves(&mut d, "after running out of fds", 8192, 5);
    let deadline = Instant::now() + Duration::from_secs(10);
    while fd_count(d.pid()) > baseline {
        assert!(
            Instant::now() < deadline,
            "the daemon holds {} fds, {baseline} before",
            fd_count(d.pid())
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// Setting up a connection runs out of fds (64 queues on a thread each
/// need hundreds; the default of a thread per CPU needs far fewer; the
/// limit is lowered under the running daemon): that connection fails, the
/// daemon does not exit, and once fds are there again it serves. (Lowered
/// after start-up: the daemon raises its soft limit to the hard one as it
/// starts.)
#[test]
fn a_connection_that_cannot_be_set_up_does_not_end_the_daemon() {
    let mut d = Daemon::start_with(DaemonOptions {
        size: 64 * MIB,
        args: &["--queues", "64", "--threads", "64"],
        wrapper: &["prlimit", "--nofile=4096:4096", "--"],
        ..DaemonOptions::default()
    });
    let lowered = std::process::Command::new("prlimit")
        .args(["--pid", &d.pid().to_string(), "--nofile=400:4096"])
        .status()
        .expect("prlimit");
    assert!(lowered.success());
    let mut s = UnixStream::connect(&d.socket).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    // GET_FEATURES; the daemon hangs up instead of answering.
    s.write_all(&frontend::header(1, 1, 0)).expect("write");
    let mut buf = [0u8; 64];
    let n = std::io::Read::read(&mut s, &mut buf).unwrap_or(0);
    assert_eq!(n, 0, "a connection of 64 queues was set up under 400 fds");
    d.wait_for_log("connection failed");
    d.assert_running();
    let raised = std::process::Command::new("prlimit")
        .args(["--pid", &d.pid().to_string(), "--nofile=4096:4096"])
        .status()
        .expect("prlimit");
    assert!(raised.success());
    assert_serves(&mut d, "once fds are there again", 0, 6);
}

/// A daemon stopped and continued (SIGSTOP and SIGCONT: a debugger, the
/// cgroup freezer, an operator's `kill -STOP`) keeps its front-end. The
/// relay reads with a time limit while it watches newly started rings, and
/// a read with a time limit answers EINTR, rather than restarting, when
/// the process is stopped under it: that used to end the connection (seen
/// in the migration tests, whose harness stops the daemon).
#[test]
fn a_stopped_and_continued_daemon_keeps_its_front_end() {
    let mut d = Daemon::start(4 * MIB, &[]);
    let mut c = ringblk_testkit::Client::connect(&d.socket, 4096);
    let data = ringblk_testkit::pattern(7, 0, 4096);
    assert_eq!(c.write(0, &data), 0, "write before the stops");
    let pid = d.pid() as i32;
    for _ in 0..50 {
        // SAFETY: kill only sends a signal to the daemon's process.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        thread::sleep(Duration::from_millis(5));
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        thread::sleep(Duration::from_millis(15));
    }
    d.assert_running();
    assert_eq!(c.write(4096, &data), 0, "write after the stops");
    assert_eq!(c.read(0, 4096), data, "read after the stops");
    let log = d.log();
    assert!(
        !log.contains("disconnecting"),
        "the daemon dropped its front-end:\n{log}"
    );
}
