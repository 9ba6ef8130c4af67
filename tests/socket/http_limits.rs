//! The HTTP endpoints (`--api`, `--metrics`) bound everything a client can
//! make them spend, against a real daemon under its seccomp filter
//! (enforcing, the default): a huge Content-Length, hundreds of idle
//! connections under a low fd limit, a 128 MiB header line, slow and
//! pipelining clients; and the metrics Unix socket is born 0600.
//!
//! The limits themselves are `ringblk::api`'s constants; the numbers here
//! are what a user would see (status codes, threads, fds, RSS, latency).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use ringblk_testkit::{Client, Daemon, DaemonOptions, MIB, pattern, test_dir};

/// What the endpoints give a client to send its request, and to take the
/// answer (`ringblk::api::REQUEST_DEADLINE`, `ANSWER_DEADLINE`), with room
/// for a loaded machine.
const DEADLINE: Duration = Duration::from_secs(5);
const SLACK: Duration = Duration::from_secs(5);

/// A daemon with `--api DIR/api.sock` and a TCP `--metrics` on a free
/// port; `configure` changes the command before it runs (a limit, a
/// umask). Returns the daemon, the API socket and the metrics address.
fn start(dir: &Path, configure: Option<&dyn Fn(&mut Command)>) -> (Daemon, PathBuf, String) {
    let api = dir.join("api.sock");
    let args = [
        "--api",
        api.to_str().expect("UTF-8 path"),
        "--metrics",
        "127.0.0.1:0",
    ];
    let mut d = Daemon::start_in(
        dir,
        DaemonOptions {
            args: &args,
            configure,
            ..DaemonOptions::default()
        },
    );
    d.wait_for_log("metrics on ");
    let log = d.log();
    let rest = &log[log.find("metrics on ").expect("logged") + "metrics on ".len()..];
    let addr = rest
        .split_whitespace()
        .next()
        .expect("an address")
        .to_string();
    (d, api, addr)
}

/// One connection to either endpoint.
enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    fn open(addr: &str) -> std::io::Result<Conn> {
        let c = if addr.contains('/') {
            Conn::Unix(UnixStream::connect(addr)?)
        } else {
            Conn::Tcp(TcpStream::connect(addr)?)
        };
        c.set_timeout(DEADLINE + SLACK);
        Ok(c)
    }

    fn set_timeout(&self, t: Duration) {
        let _ = match self {
            Conn::Tcp(s) => s
                .set_read_timeout(Some(t))
                .and(s.set_write_timeout(Some(t))),
            Conn::Unix(s) => s
                .set_read_timeout(Some(t))
                .and(s.set_write_timeout(Some(t))),
        };
    }

    fn io(&mut self) -> &mut dyn ReadWrite {
        match self {
            Conn::Tcp(s) => s,
            Conn::Unix(s) => s,
        }
    }

    /// Everything the daemon sends until it closes (or an error: a reset
    /// after an answer it sent is not the test's business).
    fn answer(&mut self) -> String {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match self.io().read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Whether the daemon has closed this connection: a read sees the end
    /// (or a reset) within `within`.
    fn closed_within(&mut self, within: Duration) -> bool {
        self.set_timeout(within);
        let mut buf = [0u8; 65536];
        loop {
            match self.io().read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return false;
                }
                Err(_) => return true,
            }
        }
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// The status line's code of a raw HTTP answer.
fn status_of(answer: &str) -> Option<u16> {
    answer.split_whitespace().nth(1)?.parse().ok()
}

/// GET `path` from `addr` with the project's own client; how long the
/// answer took. Panics unless it is a 200.
fn timed_get(addr: &str, path: &str) -> Duration {
    let t = Instant::now();
    let r = ringblk_metrics::get(addr, path);
    let took = t.elapsed();
    if let Err(e) = r {
        panic!("GET {path} from {addr} after {took:?}: {e}");
    }
    took
}

/// `/proc/PID/status`'s `name` in KiB.
fn kib(d: &Daemon, name: &str) -> u64 {
    let v = d.proc_status(None, name).expect("a /proc status line");
    v.trim_end_matches("kB").trim().parse().expect("a number")
}

/// Threads and fds, once a front-end that left has been torn down (the
/// counts stop changing).
fn settled(d: &Daemon) -> (usize, usize) {
    let mut last = (d.threads().len(), fds(d));
    for _ in 0..50 {
        thread::sleep(Duration::from_millis(100));
        let now = (d.threads().len(), fds(d));
        if now == last {
            break;
        }
        last = now;
    }
    last
}

fn fds(d: &Daemon) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", d.pid()))
        .expect("/proc/PID/fd")
        .count()
}

/// The daemon serves a fresh vhost-user front-end: a write and its read.
fn serves_io(d: &Daemon, seed: u64) {
    let mut c = Client::connect(&d.socket, 64 << 10);
    let data = pattern(seed, 0, 64 << 10);
    assert_eq!(c.write(0, &data), 0, "a write");
    assert_eq!(c.read(0, data.len()), data, "its read");
}

/// `Content-Length: 1099511627776` (1 TiB) on the TCP `--metrics` and on
/// `--api`: 413 at once, nothing read or allocated, and the daemon goes on
/// serving I/O and both endpoints. (tiny_http drained the body into
/// `vec![0; n]` as the refused request was dropped: the allocation failed
/// and the daemon died.)
#[test]
fn a_huge_content_length_is_refused_and_the_daemon_lives() {
    let dir = test_dir();
    let (mut d, api, metrics) = start(dir.path(), None);
    let api = api.to_str().expect("UTF-8").to_string();
    for (addr, request) in [
        (&metrics, "POST /metrics HTTP/1.1\r\nHost: x\r\n"),
        (&api, "PUT /api/v1/resize HTTP/1.1\r\nHost: x\r\n"),
        (&api, "PUT /api/v1/qos HTTP/1.0\r\n"),
    ] {
        let mut c = Conn::open(addr).expect("connect");
        let head = format!("{request}Content-Length: 1099511627776\r\n\r\n");
        c.io().write_all(head.as_bytes()).expect("send");
        let t = Instant::now();
        let answer = c.answer();
        assert_eq!(status_of(&answer), Some(413), "{addr}: {answer:?}");
        assert!(t.elapsed() < DEADLINE, "answered after {:?}", t.elapsed());
        thread::sleep(Duration::from_millis(200));
        d.assert_running();
        serves_io(&d, 1);
    }
    timed_get(&metrics, "/metrics");
    timed_get(&api, "/api/v1/status");
    assert_eq!(
        std::fs::metadata(&d.image).expect("image").len(),
        64 * MIB,
        "nothing was resized"
    );
    d.assert_running();
}

/// 200 idle connections on each endpoint, under an fd limit of 256 that
/// the daemon cannot raise: the endpoints take a bounded number of them
/// (the rest are closed at once), the daemon's threads and fds stay
/// bounded, a new vhost-user front-end connects and is served, and both
/// endpoints answer again once the idle clients are gone. (tiny_http gave
/// each connection a pool thread and two fds with no cap: without a limit
/// 200 idle connections took it from 14 to 98-183 threads and from 22 to
/// 422 fds; under this one the fds ran out, its accept threads ended for
/// good, and a front-end got EMFILE.)
#[test]
fn idle_connections_under_a_low_fd_limit_leave_room_for_a_front_end() {
    const LIMIT: u64 = 256;
    const IDLE: usize = 200;
    let dir = test_dir();
    let limit = |cmd: &mut Command| {
        // SAFETY: setrlimit is async-signal-safe and takes a pointer to a
        // live rlimit; nothing else runs in the child before exec.
        unsafe {
            cmd.pre_exec(|| {
                let l = libc::rlimit {
                    rlim_cur: LIMIT,
                    rlim_max: LIMIT,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    };
    let (mut d, api, metrics) = start(dir.path(), Some(&limit));
    let api = api.to_str().expect("UTF-8").to_string();
    serves_io(&d, 2);
    let (threads0, fds0) = settled(&d);
    eprintln!("before: {threads0} threads, {fds0} fds");

    let (mut idle, mut refused) = (Vec::new(), Vec::new());
    for addr in [&metrics, &api] {
        for i in 0..IDLE {
            match Conn::open(addr) {
                Ok(c) => idle.push(c),
                Err(e) => refused.push(format!("connection {i} to {addr}: {e}")),
            }
        }
    }
    // Let the daemon accept (and refuse) what it will.
    thread::sleep(Duration::from_millis(1000));
    let (threads1, fds1) = (d.threads().len(), fds(&d));
    eprintln!(
        "with {} idle connections: {threads1} threads, {fds1} fds",
        idle.len()
    );
    d.assert_running();
    assert!(
        threads1 <= threads0 + 2,
        "threads went from {threads0} to {threads1} with idle HTTP connections"
    );
    // Each endpoint holds at most its connection cap (64), an fd each.
    assert!(
        fds1 <= fds0 + 2 * 66,
        "fds went from {fds0} to {fds1} with idle HTTP connections"
    );
    // Past its cap an endpoint closes a connection at once; it never
    // stops accepting.
    assert!(refused.is_empty(), "refused: {refused:?}");
    // A new front-end while they are all still connected.
    serves_io(&d, 3);

    // The idle clients leave; both endpoints answer.
    drop(idle);
    let t = Instant::now();
    for addr in [&metrics, &api] {
        let path = if addr.contains('/') {
            "/api/v1/status"
        } else {
            "/metrics"
        };
        loop {
            match ringblk_metrics::get(addr, path) {
                Ok(_) => break,
                Err(e) => {
                    assert!(
                        t.elapsed() < DEADLINE + SLACK,
                        "{addr}{path} still fails {:?} after the idle clients left: {e}",
                        t.elapsed()
                    );
                    thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
    eprintln!(
        "endpoints answer {:?} after the idle clients left",
        t.elapsed()
    );
    serves_io(&d, 4);
    d.assert_running();
}

/// Out of fds while accepting: under a limit of 80 fds, 150 idle
/// connections to the TCP `--metrics` run the daemon out before the
/// endpoint's cap does. accept(2) fails with EMFILE; the endpoint logs it,
/// backs off and goes on, and answers as soon as the clients are gone.
/// (tiny_http's accept thread ended at the first accept error: the
/// endpoint was gone for good.)
#[test]
fn an_accept_error_does_not_end_the_endpoint() {
    const LIMIT: u64 = 80;
    let dir = test_dir();
    let limit = |cmd: &mut Command| {
        // SAFETY: as in the test above.
        unsafe {
            cmd.pre_exec(|| {
                let l = libc::rlimit {
                    rlim_cur: LIMIT,
                    rlim_max: LIMIT,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    };
    let (mut d, _api, metrics) = start(dir.path(), Some(&limit));
    assert!(
        (fds(&d) as u64) < LIMIT - 10,
        "the daemon starts with {} fds; the test needs it well under {LIMIT}",
        fds(&d)
    );
    let idle: Vec<Conn> = (0..150)
        .map(|i| Conn::open(&metrics).unwrap_or_else(|e| panic!("connection {i}: {e}")))
        .collect();
    d.wait_for_log("accept: Too many open files");
    drop(idle);
    let t = Instant::now();
    loop {
        match ringblk_metrics::get(&metrics, "/metrics") {
            Ok(_) => break,
            Err(e) => {
                assert!(
                    t.elapsed() < DEADLINE + SLACK,
                    "the endpoint still fails {:?} after the clients left: {e}",
                    t.elapsed()
                );
                thread::sleep(Duration::from_millis(100));
            }
        }
    }
    eprintln!(
        "the endpoint answers {:?} after the clients left",
        t.elapsed()
    );
    serves_io(&d, 7);
    d.assert_running();
}

/// A 128 MiB header line, on each endpoint: the daemon reads at most its
/// 8 KiB head limit, answers 431 and closes; its RSS stays within a few
/// MiB. (tiny_http read the whole line: RSS went from 9.5 to 141 MB.)
#[test]
fn a_128_mib_header_line_costs_the_daemon_nothing() {
    let dir = test_dir();
    let (mut d, api, metrics) = start(dir.path(), None);
    let api = api.to_str().expect("UTF-8").to_string();
    // Warm up both endpoints, so that what they allocate for any request
    // is in the baseline.
    timed_get(&metrics, "/metrics");
    timed_get(&api, "/api/v1/status");
    for addr in [&metrics, &api] {
        let (rss0, hwm0) = (kib(&d, "VmRSS"), kib(&d, "VmHWM"));
        let mut c = Conn::open(addr).expect("connect");
        c.io()
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Filler: ")
            .expect("head");
        let chunk = vec![b'a'; 1 << 20];
        let mut sent = 0usize;
        for _ in 0..128 {
            match c.io().write_all(&chunk) {
                Ok(()) => sent += chunk.len(),
                // The daemon closed: it read what it would.
                Err(_) => break,
            }
        }
        let answer = c.answer();
        let (rss1, hwm1) = (kib(&d, "VmRSS"), kib(&d, "VmHWM"));
        eprintln!(
            "{addr}: {sent} bytes of header taken; RSS {rss0} -> {rss1} KiB, peak {hwm0} -> {hwm1} KiB; answer {:?}",
            answer.lines().next()
        );
        d.assert_running();
        assert!(
            rss1 < rss0 + 4 * 1024 && hwm1 < hwm0 + 4 * 1024,
            "{addr}: RSS {rss0} -> {rss1} KiB, peak {hwm0} -> {hwm1} KiB for a {sent}-byte header"
        );
        if !answer.is_empty() {
            assert_eq!(status_of(&answer), Some(431), "{answer}");
        }
    }
    timed_get(&metrics, "/metrics");
    timed_get(&api, "/api/v1/status");
    serves_io(&d, 5);
    d.assert_running();
}

/// Clients that never finish, one more at a time on the same daemon: a
/// body that never arrives, a chunked body whose chunks never come (on
/// each endpoint), an empty chunked body on a verb that takes none, a
/// head sent in part, and 5,000 pipelined requests whose answers are never
/// read (on each endpoint). After each, another client's scrape and
/// status are answered at once; in the end the daemon has closed every one
/// of them by its deadline. (tiny_http served one request at a time and
/// read a body of over 1 KiB, or a chunked one, on the endpoint's thread:
/// the first of these stopped the `--api` endpoint for everyone.)
#[test]
fn slow_clients_do_not_stop_the_endpoints() {
    let dir = test_dir();
    let (mut d, api, metrics) = start(dir.path(), None);
    let api = api.to_str().expect("UTF-8").to_string();
    let pipelined_metrics = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(5000);
    let pipelined_status = b"GET /api/v1/status HTTP/1.1\r\nHost: x\r\n\r\n".repeat(5000);
    let cases: [(&str, &str, &[u8]); 7] = [
        (
            "a body that never arrives",
            &api,
            b"PUT /api/v1/qos HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n{",
        ),
        (
            "a chunked body whose chunks never come",
            &api,
            b"PUT /api/v1/qos HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        ),
        (
            "a chunked body whose chunks never come, on a GET",
            &metrics,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        ),
        (
            "an empty chunked body on a GET",
            &metrics,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ),
        ("a head that never ends", &metrics, b"GET /metr"),
        (
            "5,000 pipelined requests, unread",
            &metrics,
            &pipelined_metrics,
        ),
        ("5,000 pipelined requests, unread", &api, &pipelined_status),
    ];
    let mut slow = Vec::new();
    for (what, addr, bytes) in cases {
        let mut c = Conn::open(addr).expect("connect");
        c.io().write_all(bytes).expect("send");
        slow.push((what, c));
        thread::sleep(Duration::from_millis(100));
        // Someone else, meanwhile.
        for (addr, path) in [(&metrics, "/metrics"), (&api, "/api/v1/status")] {
            let took = timed_get(addr, path);
            eprintln!("{addr}{path} answered in {took:?} beside {what}");
            assert!(
                took < Duration::from_secs(1),
                "{addr}{path} took {took:?} beside {what}"
            );
        }
    }
    // Each slow one is closed by its deadline.
    let t = Instant::now();
    for (what, c) in &mut slow {
        let left = (DEADLINE + SLACK).saturating_sub(t.elapsed());
        assert!(
            c.closed_within(left.max(Duration::from_millis(1))),
            "{what}: still open {:?} later",
            t.elapsed()
        );
    }
    d.assert_running();
    serves_io(&d, 6);
}

/// The `--metrics` Unix socket is born 0600, like `--api`, whatever the
/// umask. (It had the umask's mode: 0775 under umask 002.)
#[test]
fn the_metrics_unix_socket_is_private_under_umask_002() {
    let dir = test_dir();
    let umask = |cmd: &mut Command| {
        // SAFETY: umask is async-signal-safe and cannot fail.
        unsafe {
            cmd.pre_exec(|| {
                libc::umask(0o002);
                Ok(())
            });
        }
    };
    let mut d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            metrics: true,
            configure: Some(&umask),
            ..DaemonOptions::default()
        },
    );
    let path = d.metrics.clone().expect("a metrics socket");
    let mode = std::fs::symlink_metadata(&path)
        .expect("metrics socket")
        .permissions()
        .mode();
    assert_eq!(
        mode & 0o777,
        0o600,
        "metrics socket mode {:o}",
        mode & 0o777
    );
    assert!(d.scrape_metrics().contains("ringblk_"));
    d.assert_running();
}
