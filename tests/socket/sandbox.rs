//! The daemon's sandbox as a whole (docs/security.md): Landlock on by
//! default next to the seccomp filter, the connector process that makes
//! the relay's inner connection (so the daemon connects to nothing), and
//! the warning when it runs as root. What each filter and the ruleset
//! refuse is tested in `daemon::seccomp` and `daemon::landlock`, in forked
//! children.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use ringblk_testkit::{
    Client, Daemon, DaemonOptions, MIB, assert_pattern, is_root, pattern, test_dir,
};

/// The daemon's child processes: its connector.
fn children(d: &Daemon) -> Vec<u32> {
    let path = format!("/proc/{0}/task/{0}/children", d.pid());
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn proc_field(pid: u32, name: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

/// A process that has exited (and may await its reaping) is gone.
fn gone(pid: u32) -> bool {
    proc_field(pid, "State").is_none_or(|s| s.starts_with('Z'))
}

fn wait_gone(pid: u32, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gone(pid) {
        assert!(Instant::now() < deadline, "{what} (pid {pid}) still runs");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The daemon's private directories (`ringblk-*` in its TMPDIR).
fn private_dirs(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("ringblk-"))
        .collect()
}

/// By default Landlock is on (here, where the kernel has it; CI requires
/// it), the connector runs filtered as the daemon's child, two front-ends
/// in a row are served, and SIGTERM still removes the sockets and the
/// private directory (which Landlock allows) and takes the connector
/// with it.
#[test]
fn landlock_by_default_and_the_daemon_serves_under_it() {
    let dir = test_dir();
    let api = dir.path().join("api.sock");
    let mut d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            args: &["--api", api.to_str().unwrap()],
            ..DaemonOptions::default()
        },
    );
    d.wait_for_log("seccomp filter installed");
    let log = d.log();
    if std::env::var_os("CI").is_some() || !log.contains("Landlock is not available") {
        assert!(
            log.contains("Landlock ABI ") && log.contains(" enforced ("),
            "Landlock is not on:\n{log}"
        );
    }
    let kids = children(&d);
    assert_eq!(kids.len(), 1, "one connector process: {kids:?}");
    let connector = kids[0];
    assert_eq!(
        proc_field(connector, "Name").as_deref(),
        Some("ringblk-connect")
    );
    assert_eq!(
        proc_field(connector, "Seccomp").as_deref(),
        Some("2"),
        "the connector is filtered"
    );
    assert_eq!(private_dirs(dir.path()).len(), 1);

    for seed in [1u64, 2] {
        let mut c = Client::connect(&d.socket, 256 * 1024);
        assert_eq!(c.write(0, &pattern(seed, 0, 256 * 1024)), 0);
        assert_eq!(c.flush(), 0);
        assert_pattern("read back", seed, 0, &c.read(0, 256 * 1024));
    }
    d.assert_running();

    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert_eq!(st.code(), Some(0), "exit after SIGTERM: {st}\n{}", d.log());
    assert!(!d.socket.exists(), "socket left behind");
    assert!(!api.exists(), "API socket left behind");
    assert_eq!(private_dirs(dir.path()), Vec::<String>::new());
    wait_gone(connector, "the connector, after its daemon");
    assert!(!d.log().contains("not allowed"), "{}", d.log());
}

/// The connector dies with its daemon, even one killed with SIGKILL.
#[test]
fn the_connector_dies_with_the_daemon() {
    let mut d = Daemon::start(16 * MIB, &[]);
    d.wait_for_log("seccomp filter installed");
    let connector = *children(&d).first().expect("a connector");
    d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    wait_gone(connector, "the connector, after its daemon's SIGKILL");
}

/// If the connector is gone, no front-end can be served: the daemon says
/// why and exits 1 (for its supervisor to restart it), instead of
/// failing every connection from then on.
#[test]
fn a_dead_connector_ends_the_daemon() {
    let mut d = Daemon::start(16 * MIB, &[]);
    d.wait_for_log("seccomp filter installed");
    let connector = *children(&d).first().expect("a connector");
    // SAFETY: kill takes no pointers; the pid is the daemon's child, which
    // the daemon does not reap, so it cannot have been reused.
    unsafe { libc::kill(connector as i32, libc::SIGKILL) };
    wait_gone(connector, "the connector");
    // The fixture's probe may still be on its way through the daemon, and
    // end it first; else this front-end does.
    if let Ok(mut s) = UnixStream::connect(&d.socket) {
        let _ = s.write_all(&[0; 12]);
    }
    // Signal 0 sends nothing: this only waits for the exit.
    let st = d.signal_and_wait(0, Duration::from_secs(10));
    assert_eq!(st.code(), Some(1), "{st}\n{}", d.log());
    assert!(
        d.log().contains("inner socket") && d.log().contains("connector process"),
        "{}",
        d.log()
    );
}

/// Root gets a warning that says what to do instead; anyone else none
/// (tests/unprivileged.rs runs it as nobody).
#[test]
fn warns_when_run_as_root() {
    let mut d = Daemon::start(16 * MIB, &[]);
    d.wait_for_log("seccomp filter installed");
    let warned = d.log().contains("running as root (effective uid 0)");
    assert_eq!(warned, is_root(), "{}", d.log());
    if warned {
        assert!(
            d.log().contains("DynamicUser=") && d.log().contains("docs/security.md"),
            "{}",
            d.log()
        );
    }
}

/// `--landlock off` says so, and the daemon serves as before.
#[test]
fn landlock_off() {
    let mut d = Daemon::start(16 * MIB, &["--landlock", "off"]);
    d.wait_for_log("seccomp filter installed");
    assert!(d.log().contains("Landlock disabled (--landlock off)"));
    assert!(!d.log().contains("Landlock ABI"));
    let mut c = Client::connect(&d.socket, 64 * 1024);
    assert_eq!(c.write(0, &pattern(3, 0, 64 * 1024)), 0);
    assert_pattern("read back", 3, 0, &c.read(0, 64 * 1024));
}
