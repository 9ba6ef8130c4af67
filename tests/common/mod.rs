//! Shared fixtures for the socket-level integration tests: a `ringblk serve`
//! process on a private socket and sparse image, killed when dropped.
//!
//! Everything lives in a temporary directory under Cargo's
//! `CARGO_TARGET_TMPDIR` (inside `target/`), not `/tmp`: `/tmp` may be a
//! tmpfs, which has no O_DIRECT, and the `--direct` tests need a real file
//! system.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tempfile::TempDir;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

/// How long a daemon may take to accept its first connection.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// How long one test may use a daemon before the watchdog kills it. A
/// vhost-user front-end blocks on the socket without a timeout; killing the
/// daemon turns a hang into an error the test reports.
const WATCHDOG: Duration = Duration::from_secs(180);

/// sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
const SUN_PATH_MAX: usize = 107;

/// A fresh directory for one test's socket, image and metrics socket.
pub fn test_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("ringblk-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("creating a temporary directory under CARGO_TARGET_TMPDIR")
}

/// Creates a sparse image of `size` bytes at `dir/name`.
pub fn sparse_image(dir: &Path, name: &str, size: u64) -> PathBuf {
    let path = dir.join(name);
    let f = File::create(&path).expect("creating the image");
    f.set_len(size).expect("sizing the image");
    path
}

/// Output of the daemon, collected by background threads.
type Log = Arc<Mutex<Vec<u8>>>;

fn collect(mut from: impl Read + Send + 'static, log: Log) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut buf = [0u8; 4096];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => log
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend_from_slice(&buf[..n]),
            }
        }
    })
}

/// A running `ringblk serve`. Dropping it kills the process; if the test is
/// panicking, the daemon's output is printed so the failure can be read
/// next to the daemon's side of the story.
pub struct Daemon {
    child: Child,
    pub socket: PathBuf,
    pub image: PathBuf,
    /// `--metrics` socket, when the test asked for one.
    pub metrics: Option<PathBuf>,
    log: Log,
    readers: Vec<JoinHandle<()>>,
    watchdog: Option<(Sender<()>, JoinHandle<()>)>,
    // Last: removed after the process is gone.
    pub dir: TempDir,
}

/// What to start.
pub struct DaemonOptions<'a> {
    /// Size of the sparse image created for the daemon (ignored when
    /// `image` is given).
    pub size: u64,
    /// An existing image in `dir` to serve instead.
    pub image: Option<PathBuf>,
    /// Extra `serve` arguments.
    pub args: &'a [&'a str],
    /// Pass `--metrics DIR/metrics.sock`.
    pub metrics: bool,
}

impl Default for DaemonOptions<'_> {
    fn default() -> Self {
        DaemonOptions {
            size: 64 * MIB,
            image: None,
            args: &[],
            metrics: false,
        }
    }
}

impl Daemon {
    /// Starts a daemon on a fresh sparse image of `size` bytes with `args`
    /// added to `serve --socket S --image I`.
    pub fn start(size: u64, args: &[&str]) -> Daemon {
        Daemon::start_in(
            test_dir(),
            DaemonOptions {
                size,
                args,
                ..DaemonOptions::default()
            },
        )
    }

    /// Starts a daemon in `dir` (which may already hold the image).
    pub fn start_in(dir: TempDir, opts: DaemonOptions<'_>) -> Daemon {
        let socket = dir.path().join("vhost.sock");
        assert!(
            socket.as_os_str().len() <= SUN_PATH_MAX,
            "socket path {} is too long for a Unix socket; use a shorter CARGO_TARGET_DIR",
            socket.display()
        );
        let image = opts
            .image
            .unwrap_or_else(|| sparse_image(dir.path(), "disk.img", opts.size));
        let metrics = opts.metrics.then(|| dir.path().join("metrics.sock"));

        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ringblk"));
        cmd.arg("serve")
            .arg("--socket")
            .arg(&socket)
            .arg("--image")
            .arg(&image)
            .args(opts.args);
        if let Some(m) = &metrics {
            cmd.arg("--metrics").arg(m);
        }
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env(
                "RUST_LOG",
                "debug,virtio_queue=off,vhost=info,vhost_user_backend=info",
            );
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning ringblk serve");
        let log = Log::default();
        let readers = vec![
            collect(child.stdout.take().expect("piped stdout"), log.clone()),
            collect(child.stderr.take().expect("piped stderr"), log.clone()),
        ];
        let watchdog = Some(spawn_watchdog(child.id(), log.clone()));
        let mut daemon = Daemon {
            child,
            socket,
            image,
            metrics,
            log,
            readers,
            watchdog,
            dir,
        };
        daemon.wait_until_accepting();
        daemon
    }

    /// Waits until the socket accepts a connection. The probe connection
    /// is closed at once, so the daemon also goes through one
    /// connect/disconnect cycle before the test's client arrives.
    fn wait_until_accepting(&mut self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().expect("polling the daemon") {
                self.join_readers();
                panic!(
                    "ringblk serve exited with {status} before accepting; its output:\n{}",
                    self.log()
                );
            }
            if UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "ringblk serve did not accept on {} within {START_TIMEOUT:?}; its output:\n{}",
                self.socket.display(),
                self.log()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the daemon printed so far.
    pub fn log(&self) -> String {
        String::from_utf8_lossy(&self.log.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }

    /// Panics (with the daemon's output) unless the process is still running.
    pub fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().expect("polling the daemon") {
            self.join_readers();
            panic!(
                "ringblk serve exited with {status}; its output:\n{}",
                self.log()
            );
        }
    }

    /// Reads `len` bytes of the image file at `offset`, from the host side.
    pub fn read_image(&self, offset: u64, len: usize) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let f = File::open(&self.image).expect("opening the image");
        let mut buf = vec![0u8; len];
        f.read_exact_at(&mut buf, offset)
            .expect("reading the image");
        buf
    }

    /// Fetches the metrics exposition (`GET /metrics` over the `--metrics`
    /// Unix socket). `None` when the daemon does not serve metrics (yet).
    pub fn scrape_metrics(&self) -> Option<String> {
        let path = self.metrics.as_ref()?;
        let mut s = UnixStream::connect(path).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        // A server that writes the exposition without reading a request
        // may close first; its answer is still readable.
        let _ = s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n");
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let body = match out.split_once("\r\n\r\n") {
            Some((_head, body)) if out.starts_with("HTTP/") => body.to_string(),
            _ => out,
        };
        Some(body)
    }

    fn join_readers(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

/// Sums every sample of the metric families whose name contains `needle`
/// in a Prometheus text exposition (`name{labels} value` lines).
pub fn metric_sum(exposition: &str, needle: &str) -> Option<f64> {
    let mut found = None;
    for line in exposition.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        if !line[..name_end].contains(needle) {
            continue;
        }
        let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// Kills `pid` with SIGKILL unless told to stop within `WATCHDOG`.
fn spawn_watchdog(pid: u32, log: Log) -> (Sender<()>, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let h = thread::spawn(move || {
        if let Err(RecvTimeoutError::Timeout) = rx.recv_timeout(WATCHDOG) {
            log.lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend_from_slice(b"\n[test watchdog: killed the daemon after the timeout]\n");
            let pid = libc::pid_t::try_from(pid).expect("pid fits pid_t");
            // SAFETY: kill() takes no pointers. `pid` is our child, which
            // Drop reaps only after stopping this thread, so the pid cannot
            // have been reused.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    (tx, h)
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some((tx, h)) = self.watchdog.take() {
            let _ = tx.send(());
            let _ = h.join();
        }
        // The daemon never exits on its own while a test uses it (a seccomp
        // kill, a crash or an error exit would show up here).
        let exited = self.child.try_wait().ok().flatten();
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.join_readers();
        let log = self.log();
        if !thread::panicking() {
            if let Some(status) = exited {
                panic!("ringblk serve exited during the test ({status}); its output:\n{log}");
            }
            if log.contains("panicked at") {
                panic!("ringblk serve panicked; its output:\n{log}");
            }
        }
        if thread::panicking() {
            eprintln!(
                "---- ringblk serve output ({}) ----\n{log}---- end of ringblk serve output ----",
                self.socket.display(),
            );
        }
        // Leave nothing behind even if the daemon's own cleanup did not run.
        let _ = fs::remove_file(&self.socket);
    }
}
