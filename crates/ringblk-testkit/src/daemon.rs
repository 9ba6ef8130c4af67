//! [`Daemon`]: a `ringblk serve` process for one test.

use std::ffi::OsStr;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::{IO_TIMEOUT, MIB, read_file, ringblk_bin, sparse_image, test_dir};

/// How long a daemon may take to accept its first connection, or to log
/// what [`Daemon::wait_for_log`] waits for.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// How long one test may use a daemon before the watchdog kills it. A
/// vhost-user front-end blocks on the socket without a timeout; killing the
/// daemon turns a hang into an error the test reports.
const WATCHDOG: Duration = Duration::from_secs(180);

/// sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
const SUN_PATH_MAX: usize = 107;

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

/// What to start.
pub struct DaemonOptions<'a> {
    /// Size of the sparse image created for the daemon (ignored when
    /// `image` is given).
    pub size: u64,
    /// An existing image to serve instead.
    pub image: Option<PathBuf>,
    /// Extra `serve` arguments.
    pub args: &'a [&'a str],
    /// Pass `--metrics DIR/metrics.sock`.
    pub metrics: bool,
    /// A command (and its arguments) to run the daemon through, e.g.
    /// `["setpriv", "--reuid=65534", ...]`.
    pub wrapper: &'a [&'a str],
    /// Pass neither `--socket` nor `--image`: the daemon picks both (in
    /// the directory that `env` steers it to), and the fixture reads them
    /// back from what the daemon prints. `size` is then `--size`.
    pub default_paths: bool,
    /// Environment variables to set (`Some`) or remove (`None`), after
    /// the fixture's own (`TMPDIR`, `RUST_LOG`).
    pub env: &'a [(&'a str, Option<&'a OsStr>)],
    /// Last changes to the command before it is spawned (a `pre_exec`).
    pub configure: Option<&'a dyn Fn(&mut Command)>,
}

impl Default for DaemonOptions<'_> {
    fn default() -> Self {
        DaemonOptions {
            size: 64 * MIB,
            image: None,
            args: &[],
            metrics: false,
            wrapper: &[],
            default_paths: false,
            env: &[],
            configure: None,
        }
    }
}

/// Runs `ringblk serve --socket DIR/refused.sock ARGS` (through
/// `wrapper`, if any) and expects a refusal: exit status 1 within 20 s,
/// no panic, one `ringblk:` line, which is returned. A daemon that starts
/// instead (or hangs) fails the test.
#[track_caller]
pub fn serve_refused(dir: &Path, wrapper: &[&str], args: &[&str]) -> String {
    let mut cmd = match wrapper.split_first() {
        Some((program, pre)) => {
            let mut cmd = Command::new(program);
            cmd.args(pre).arg(ringblk_bin());
            cmd
        }
        None => Command::new(ringblk_bin()),
    };
    cmd.arg("serve")
        .arg("--socket")
        .arg(dir.join("refused.sock"))
        .args(args)
        .env("TMPDIR", dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    close_inherited_fds(&mut cmd);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawning ringblk serve ({cmd:?}): {e}"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("polling ringblk serve").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("ringblk serve's output");
            panic!(
                "ringblk serve {args:?} did not refuse to start within 20 s:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("ringblk serve's output");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "ringblk serve {args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("ringblk: ")).collect();
    assert_eq!(lines.len(), 1, "not one error line:\n{err}");
    lines[0].to_string()
}

/// A running `ringblk serve`. Dropping it kills the process and fails the
/// test if the daemon exited on its own or panicked; if the test is
/// panicking, the daemon's output is printed so the failure can be read
/// next to the daemon's side of the story.
pub struct Daemon {
    child: Child,
    pub socket: PathBuf,
    pub image: PathBuf,
    /// `--metrics` socket, when the test asked for one.
    pub metrics: Option<PathBuf>,
    /// The directory holding the socket.
    pub dir: PathBuf,
    log: Log,
    readers: Vec<JoinHandle<()>>,
    watchdog: Option<(Sender<()>, JoinHandle<()>)>,
    status: Option<ExitStatus>,
    /// Set by [`Daemon::signal_and_wait`]: the exit was the test's doing.
    stopped: bool,
    /// The daemon picks its socket and image (`DaemonOptions::default_paths`).
    default_paths: bool,
    // Last: removed after the process is gone. None when the test owns
    // the directory.
    _own_dir: Option<TempDir>,
}

impl Daemon {
    /// Starts a daemon in a fresh directory, on a sparse image of `size`
    /// bytes, with `args` added to `serve --socket S --image I`.
    pub fn start(size: u64, args: &[&str]) -> Daemon {
        Daemon::start_with(DaemonOptions {
            size,
            args,
            ..DaemonOptions::default()
        })
    }

    /// Starts a daemon in a fresh directory.
    pub fn start_with(opts: DaemonOptions<'_>) -> Daemon {
        let dir = test_dir();
        let path = dir.path().to_path_buf();
        let mut d = Daemon::launch(path, opts, Some(dir));
        d.wait_until_ready();
        d
    }

    /// Starts a daemon in `dir`, which the test keeps (and removes) itself.
    pub fn start_in(dir: &Path, opts: DaemonOptions<'_>) -> Daemon {
        let mut d = Daemon::launch(dir.to_path_buf(), opts, None);
        d.wait_until_ready();
        d
    }

    /// Starts a daemon in `dir` and returns at once, before it accepts:
    /// for a test that acts on the daemon while it starts.
    pub fn spawn_in(dir: &Path, opts: DaemonOptions<'_>) -> Daemon {
        Daemon::launch(dir.to_path_buf(), opts, None)
    }

    fn launch(dir: PathBuf, opts: DaemonOptions<'_>, own_dir: Option<TempDir>) -> Daemon {
        // With default paths, the real ones come from the daemon's output
        // (`wait_until_ready`).
        let socket = dir.join("vhost.sock");
        assert!(
            socket.as_os_str().len() <= SUN_PATH_MAX,
            "socket path {} is too long for a Unix socket; use a shorter CARGO_TARGET_DIR",
            socket.display()
        );
        let image = match opts.image {
            Some(image) => image,
            None if opts.default_paths => PathBuf::new(),
            None => sparse_image(&dir, "disk.img", opts.size),
        };
        let metrics = opts.metrics.then(|| dir.join("metrics.sock"));

        let ringblk = ringblk_bin();
        let mut cmd = match opts.wrapper.split_first() {
            Some((program, pre)) => {
                let mut cmd = Command::new(program);
                cmd.args(pre).arg(ringblk);
                cmd
            }
            None => Command::new(ringblk),
        };
        cmd.arg("serve");
        if opts.default_paths {
            // --size is for the default image; with an --image of the
            // test's own it would be refused.
            if !opts.args.contains(&"--image") {
                cmd.arg("--size").arg(opts.size.to_string());
            }
        } else {
            cmd.arg("--socket").arg(&socket).arg("--image").arg(&image);
        }
        cmd.args(opts.args);
        if let Some(m) = &metrics {
            cmd.arg("--metrics").arg(m);
        }
        // The daemon's private inner-socket directory goes here, so one
        // killed with SIGKILL leaves nothing in /tmp.
        cmd.env("TMPDIR", &dir);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env(
                "RUST_LOG",
                "debug,virtio_queue=off,vhost=info,vhost_user_backend=info",
            );
        }
        for (name, value) in opts.env {
            match value {
                Some(v) => cmd.env(name, v),
                None => cmd.env_remove(name),
            };
        }
        close_inherited_fds(&mut cmd);
        if let Some(configure) = opts.configure {
            configure(&mut cmd);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning ringblk serve ({cmd:?}): {e}"));
        let log = Log::default();
        let readers = vec![
            collect(child.stdout.take().expect("piped stdout"), log.clone()),
            collect(child.stderr.take().expect("piped stderr"), log.clone()),
        ];
        let watchdog = Some(spawn_watchdog(child.id(), log.clone()));
        Daemon {
            child,
            socket,
            image,
            metrics,
            dir,
            log,
            readers,
            watchdog,
            status: None,
            stopped: false,
            default_paths: opts.default_paths,
            _own_dir: own_dir,
        }
    }

    /// Waits until the daemon accepts; with default paths, first reads
    /// where it serves from what it prints.
    pub fn wait_until_ready(&mut self) {
        if self.default_paths {
            // Two lines, on two streams (stdout, stderr) read by two
            // threads: wait for each, not for one and then the other's.
            self.wait_for_log("Connect QEMU with");
            self.wait_for_log("] serving ");
            let log = self.log();
            let field = |start: &str, end: char| -> PathBuf {
                let rest = &log[log.find(start).expect("announced") + start.len()..];
                PathBuf::from(&rest[..rest.find(end).expect("field ends")])
            };
            self.socket = field("chardev socket,id=rb0,path=", ',');
            self.image = field("] serving ", ' ');
        }
        self.wait_until_accepting();
    }

    /// Waits until the socket accepts a connection. The probe connection
    /// is closed at once, so the daemon also goes through one
    /// connect/disconnect cycle before the test's client arrives.
    fn wait_until_accepting(&mut self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.try_wait() {
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

    /// Waits until the daemon's output contains `needle` (the socket
    /// accepts before start-up has finished).
    pub fn wait_for_log(&mut self, needle: &str) {
        let deadline = Instant::now() + START_TIMEOUT;
        while !self.log().contains(needle) {
            self.assert_running();
            assert!(
                Instant::now() < deadline,
                "no {needle:?} in the daemon's output within {START_TIMEOUT:?}:\n{}",
                self.log()
            );
            thread::sleep(Duration::from_millis(10));
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

    /// The exit status, once the process has ended (and been reaped).
    fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().expect("polling the daemon");
        }
        self.status
    }

    /// Panics (with the daemon's output) unless the process is still running.
    pub fn assert_running(&mut self) {
        if let Some(status) = self.try_wait() {
            self.join_readers();
            panic!(
                "ringblk serve exited with {status}; its output:\n{}",
                self.log()
            );
        }
    }

    /// Sends `sig` and waits (up to `timeout`) for the process to end.
    pub fn signal_and_wait(&mut self, sig: i32, timeout: Duration) -> ExitStatus {
        self.stopped = true;
        self.stop_watchdog();
        if self.try_wait().is_none() {
            let pid = libc::pid_t::try_from(self.pid()).expect("pid fits pid_t");
            // SAFETY: kill(2) takes no pointers; the child has not been
            // reaped yet, so the pid cannot have been reused.
            unsafe { libc::kill(pid, sig) };
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait() {
                self.join_readers();
                return status;
            }
            if Instant::now() >= deadline {
                panic!(
                    "ringblk serve did not exit within {timeout:?} of signal {sig}; its output:\n{}",
                    self.log()
                );
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// The value of the `Name:\tvalue` line of /proc/PID/status (or of a
    /// thread's, with `tid`).
    pub fn proc_status(&self, tid: Option<u32>, name: &str) -> Option<String> {
        let path = match tid {
            Some(t) => format!("/proc/{}/task/{t}/status", self.pid()),
            None => format!("/proc/{}/status", self.pid()),
        };
        let text = fs::read_to_string(path).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    }

    /// Thread ids of the daemon.
    pub fn threads(&self) -> Vec<u32> {
        fs::read_dir(format!("/proc/{}/task", self.pid()))
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Reads `len` bytes of the image file at `offset`, from the host side.
    pub fn read_image(&self, offset: u64, len: usize) -> Vec<u8> {
        read_file(&self.image, offset, len)
    }

    /// `GET /metrics` over the `--metrics` Unix socket: the exposition body.
    /// Panics unless the daemon was started with `metrics` and answers 200.
    pub fn scrape_metrics(&self) -> String {
        let path = self.metrics.as_ref().expect("started with metrics");
        let mut s = UnixStream::connect(path)
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", path.display()));
        s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
            .expect("request");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("response");
        assert!(out.starts_with("HTTP/1.0 200"), "metrics response: {out}");
        out.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default()
    }

    fn stop_watchdog(&mut self) {
        if let Some((tx, h)) = self.watchdog.take() {
            let _ = tx.send(());
            let _ = h.join();
        }
    }

    fn join_readers(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

/// Has the child close, as it execs, every descriptor above stderr that
/// it inherited: the daemon starts with what the test gives it and
/// nothing else. A test binary runs many tests on parallel threads, and
/// not every descriptor they open is close-on-exec (libblkio's memfds,
/// eventfds made without EFD_CLOEXEC): without this, a daemon would hold
/// another test's descriptors, which its fd counts and fd limits would
/// see. A `configure` hook runs after this one, so a descriptor it passes
/// (`dup2`, or clearing FD_CLOEXEC) stays open.
fn close_inherited_fds(cmd: &mut Command) {
    // SAFETY: the closure runs in the child between fork and exec and
    // makes one syscall, close_range(2), which takes no pointers and is
    // async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            let r = libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            );
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
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
            // is reaped deliberately (signal_and_wait, Drop) only after
            // stopping this thread; found dead by a poll, it fails the test
            // at once and Drop stops this thread.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    (tx, h)
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop_watchdog();
        // The daemon never exits on its own while a test uses it (a seccomp
        // kill, a crash or an error exit would show up here).
        let exited = match self.status {
            Some(status) => Some(status),
            None => self.child.try_wait().ok().flatten(),
        };
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.join_readers();
        let log = self.log();
        if !thread::panicking() {
            if let Some(status) = exited.filter(|_| !self.stopped) {
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
