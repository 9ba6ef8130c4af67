//! Shared fixtures for the socket-level integration tests: a `ringblk serve`
//! process on a private socket and image, killed when dropped, and a small
//! synchronous vhost-user-blk client on libblkio.
//!
//! Everything lives in a temporary directory under Cargo's
//! `CARGO_TARGET_TMPDIR` (inside `target/`), not `/tmp`: `/tmp` may be a
//! tmpfs, which has no O_DIRECT, and the `--direct` tests need a real file
//! system.
//!
//! Everything has a deadline: a daemon that does not come up, a request
//! that does not complete, or a test that hangs on the daemon fails instead
//! of hanging.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::mem::MaybeUninit;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use tempfile::TempDir;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

/// How long a daemon may take to accept its first connection, or to log
/// what [`Daemon::wait_for_log`] waits for.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Any single request or batch of [`Client`], flushes included, and a
/// metrics scrape.
const IO_TIMEOUT: Duration = Duration::from_secs(20);

/// How long one test may use a daemon before the watchdog kills it. A
/// vhost-user front-end blocks on the socket without a timeout; killing the
/// daemon turns a hang into an error the test reports.
const WATCHDOG: Duration = Duration::from_secs(180);

/// sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
const SUN_PATH_MAX: usize = 107;

/// The daemon binary. Cargo names it to the daemon's own tests; the tests
/// of `crates/ringblk-bench`, which include this file, find it next to
/// `ringblk-bench` in the same target directory.
pub fn ringblk_bin() -> PathBuf {
    let bench = match (
        option_env!("CARGO_BIN_EXE_ringblk"),
        option_env!("CARGO_BIN_EXE_ringblk-bench"),
    ) {
        (Some(bin), _) => return bin.into(),
        (None, Some(bench)) => bench,
        (None, None) => panic!("tests/common serves the ringblk and ringblk-bench packages"),
    };
    let bin = Path::new(bench).with_file_name("ringblk");
    assert!(
        bin.is_file(),
        "no daemon at {}: run the tests with `cargo test --workspace`, or `cargo build -p ringblk` first",
        bin.display()
    );
    bin
}

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
    File::create(&path)
        .and_then(|f| f.set_len(size))
        .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
    path
}

/// `len` bytes of the file at `path` from `off`, read on the host.
pub fn read_file(path: &Path, off: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len];
    File::open(path)
        .and_then(|f| f.read_exact_at(&mut buf, off))
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    buf
}

/// 512-byte blocks allocated to the file at `path`, after an fsync.
pub fn allocated_blocks(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let f = File::open(path).expect("opening the image");
    f.sync_all().expect("fsync of the image");
    f.metadata().expect("stat of the image").blocks()
}

/// Whether the test runs as root (the tmpfs and setpriv tests need it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The bytes of the test pattern at absolute offset `off`: every 8-byte
/// word holds its own offset xor `seed`, so misplaced data is caught.
pub fn pattern(seed: u64, off: u64, len: usize) -> Vec<u8> {
    assert!(off % 8 == 0 && len % 8 == 0);
    (0..len as u64 / 8)
        .flat_map(|i| ((off + i * 8) ^ seed).to_le_bytes())
        .collect()
}

/// Panics with the first differing offset unless `got` is the pattern.
pub fn assert_pattern(what: &str, seed: u64, off: u64, got: &[u8]) {
    let want = pattern(seed, off, got.len());
    if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte at offset {} is {:#04x}, expected {:#04x}",
            off + i as u64,
            got[i],
            want[i]
        );
    }
}

/// Sum of the samples whose name and labels start with `prefix`, e.g.
/// `ringblk_bounced_total{` or
/// `ringblk_requests_total{queue="0",type="write"}`, in a Prometheus text
/// exposition. Panics if no sample matches.
pub fn metric(exposition: &str, prefix: &str) -> u64 {
    let values: Vec<u64> = exposition
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .collect();
    assert!(
        !values.is_empty(),
        "no {prefix:?} sample in the metrics:\n{exposition}"
    );
    values.iter().sum()
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

impl Client {
    /// [`Client::sustain`] on every queue at once, `depth` deep each, with
    /// `len`-byte reads at `offset(n)`; one thread polls them all.
    pub fn sustain_queues(
        &mut self,
        depth: usize,
        len: usize,
        dur: Duration,
        offset: impl Fn(u64) -> u64,
    ) -> Vec<Sustained> {
        let nq = 1 + self.more.len();
        assert!(nq * depth * len <= self.region.len, "buffer too small");
        let base = self.region.addr;
        let mut queues: Vec<&mut Blkioq> = std::iter::once(&mut self.queue)
            .chain(self.more.iter_mut())
            .collect();
        let mut issued = 0u64;
        let mut submit = |q: &mut Blkioq, qi: usize, slot: usize| {
            let buf = base + (qi * depth + slot) * len;
            q.read(offset(issued), buf as *mut u8, len, slot, ReqFlags::empty());
            issued += 1;
        };
        for (qi, q) in queues.iter_mut().enumerate() {
            for slot in 0..depth {
                submit(q, qi, slot);
            }
        }
        let start = Instant::now();
        let end = start + dur;
        let mut out: Vec<Sustained> = (0..nq)
            .map(|_| Sustained {
                start,
                done: Vec::new(),
                errors: 0,
            })
            .collect();
        let mut in_flight = vec![depth; nq];
        let mut completions: Vec<MaybeUninit<Completion>> =
            (0..depth).map(|_| MaybeUninit::uninit()).collect();
        let mut last_progress = Instant::now();
        while in_flight.iter().any(|&n| n > 0) {
            assert!(
                last_progress.elapsed() < IO_TIMEOUT,
                "no request completed for {IO_TIMEOUT:?}"
            );
            let mut any = false;
            for (qi, q) in queues.iter_mut().enumerate() {
                let n = q
                    .do_io(&mut completions, 0, None, None)
                    .unwrap_or_else(|e| panic!("libblkio do_io: {e}"));
                let now = Instant::now();
                any |= n > 0;
                for c in &completions[..n] {
                    // SAFETY: do_io initialized the first n completions.
                    let c = unsafe { c.assume_init_read() };
                    in_flight[qi] -= 1;
                    if now >= end {
                        continue;
                    }
                    if c.ret != 0 {
                        out[qi].errors += 1;
                    }
                    out[qi].done.push(now);
                    submit(q, qi, c.user_data);
                    in_flight[qi] += 1;
                }
            }
            if any {
                last_progress = Instant::now();
            } else {
                // Nothing yet: a short nap, not a spin that would take a
                // core from the daemon on a small machine.
                thread::sleep(Duration::from_micros(100));
            }
        }
        out
    }
}

/// What [`Client::sustain`] saw.
pub struct Sustained {
    pub start: Instant,
    /// When each request completed, in order.
    pub done: Vec<Instant>,
    /// Requests that completed with an error.
    pub errors: u64,
}

impl Sustained {
    /// Completions a second from `from` to `to` after the start.
    pub fn rate(&self, from: Duration, to: Duration) -> f64 {
        let (a, b) = (self.start + from, self.start + to);
        let n = self.done.iter().filter(|t| **t >= a && **t < b).count();
        n as f64 / (to - from).as_secs_f64()
    }
}

/// The value of a libblkio call, or a panic naming the step.
fn ok<T>(what: &str, r: blkio::Result<T>) -> T {
    r.unwrap_or_else(|e| panic!("libblkio {what}: {e}"))
}

/// A vhost-user-blk front-end with one queue and one buffer, issuing one
/// request at a time (or a batch, with [`Client::batch`]).
pub struct Client {
    // Field order is drop order: the queue before the instance. The
    // region is unmapped and freed by libblkio when both are gone.
    queue: Blkioq,
    /// Queues 1.. of [`Client::connect_queues`].
    more: Vec<Blkioq>,
    blkio: Blkio,
    region: MemoryRegion,
    pub capacity: u64,
    /// The device's blk_size, as libblkio reports it.
    pub request_alignment: i32,
}

/// `n` reads or writes of `chunk` bytes from `offset` on, the i-th from
/// the i-th `chunk` of the client's buffer: one batch over a region.
pub fn chunked(write: bool, offset: u64, n: usize, chunk: usize) -> Vec<Op> {
    (0..n)
        .map(|i| {
            let (offset, buf_off) = (offset + (i * chunk) as u64, i * chunk);
            match write {
                true => Op::Write {
                    offset,
                    buf_off,
                    len: chunk,
                },
                false => Op::Read {
                    offset,
                    buf_off,
                    len: chunk,
                },
            }
        })
        .collect()
}

/// One request of a batch.
#[derive(Clone, Copy, Debug)]
pub enum Op {
    /// Write `len` bytes of the buffer at `buf_off` to `offset`.
    Write {
        offset: u64,
        buf_off: usize,
        len: usize,
    },
    Read {
        offset: u64,
        buf_off: usize,
        len: usize,
    },
    Flush,
    Discard {
        offset: u64,
        len: u64,
    },
    WriteZeroes {
        offset: u64,
        len: u64,
    },
}

impl Client {
    /// Connects to `socket` with a buffer of `buf_len` bytes.
    pub fn connect(socket: &Path, buf_len: usize) -> Client {
        Client::connect_with(socket, buf_len, 1, false)
    }

    /// Connects to a read-only export (libblkio refuses to start on one
    /// otherwise).
    pub fn connect_read_only(socket: &Path, buf_len: usize) -> Client {
        Client::connect_with(socket, buf_len, 1, true)
    }

    /// Connects with `queues` virtqueues; the single-request methods use
    /// the first, [`Client::sustain_queues`] all of them.
    pub fn connect_queues(socket: &Path, buf_len: usize, queues: usize) -> Client {
        Client::connect_with(socket, buf_len, queues, false)
    }

    fn connect_with(socket: &Path, buf_len: usize, queues: usize, read_only: bool) -> Client {
        let mut blkio = ok("new", Blkio::new("virtio-blk-vhost-user"));
        let path = socket.to_str().expect("UTF-8 socket path");
        ok("path", blkio.set_str("path", path));
        if read_only {
            ok("read-only", blkio.set_bool("read-only", true));
        }
        ok("connect", blkio.connect());
        ok("num-queues", blkio.set_i32("num-queues", queues as i32));
        let capacity = ok("capacity", blkio.get_u64("capacity"));
        let request_alignment = ok("request-alignment", blkio.get_i32("request-alignment"));
        let mut started = ok("start", blkio.start());
        assert_eq!(started.queues.len(), queues, "queues started");
        let more = started.queues.split_off(1);
        let queue = started.queues.pop().expect("one queue");
        let align = ok(
            "mem-region-alignment",
            blkio.get_u64("mem-region-alignment"),
        )
        .max(1) as usize;
        let len = buf_len.div_ceil(align) * align;
        let region = ok("alloc", blkio.alloc_mem_region(len));
        ok("map", blkio.map_mem_region(&region));
        Client {
            queue,
            more,
            blkio,
            region,
            capacity,
            request_alignment,
        }
    }

    /// The shared buffer.
    pub fn buf(&mut self) -> &mut [u8] {
        // SAFETY: libblkio mapped `region.len` writable bytes at
        // `region.addr`; no request is in flight outside `batch`, which
        // takes `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, self.region.len) }
    }

    /// Submits `ops` together and waits for all of them. Returns each
    /// request's result (0 or a negative errno), in order.
    pub fn batch(&mut self, ops: &[Op]) -> Vec<i32> {
        let on_first: Vec<(usize, Op)> = ops.iter().map(|&op| (0, op)).collect();
        self.batch_queues(&on_first)
    }

    /// [`Client::batch`] over several queues: each `(queue, op)` goes to
    /// its queue, all submitted before any is waited for.
    pub fn batch_queues(&mut self, ops: &[(usize, Op)]) -> Vec<i32> {
        let base = self.region.addr;
        let cap = self.region.len;
        let mut queues: Vec<&mut Blkioq> = std::iter::once(&mut self.queue)
            .chain(self.more.iter_mut())
            .collect();
        let mut used = vec![false; queues.len()];
        for (i, &(q, op)) in ops.iter().enumerate() {
            let f = ReqFlags::empty();
            used[q] = true;
            let queue = &mut queues[q];
            match op {
                Op::Write {
                    offset,
                    buf_off,
                    len,
                } => {
                    assert!(buf_off + len <= cap);
                    queue.write(offset, (base + buf_off) as *const u8, len, i, f)
                }
                Op::Read {
                    offset,
                    buf_off,
                    len,
                } => {
                    assert!(buf_off + len <= cap);
                    queue.read(offset, (base + buf_off) as *mut u8, len, i, f)
                }
                Op::Flush => queue.flush(i, f),
                Op::Discard { offset, len } => queue.discard(offset, len, i, f),
                Op::WriteZeroes { offset, len } => queue.write_zeroes(offset, len, i, f),
            }
        }
        let mut results = vec![None; ops.len()];
        let mut done = 0;
        let deadline = Instant::now() + IO_TIMEOUT;
        let mut completions: Vec<MaybeUninit<Completion>> =
            (0..ops.len()).map(|_| MaybeUninit::uninit()).collect();
        let one_queue = used.iter().filter(|&&u| u).count() <= 1;
        while done < ops.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "{} of {} requests did not complete within {IO_TIMEOUT:?}",
                ops.len() - done,
                ops.len()
            );
            let mut any = false;
            for (q, queue) in queues.iter_mut().enumerate() {
                if !used[q] {
                    continue;
                }
                // One queue: sleep in do_io. Several: look at each in turn.
                let (min, mut timeout) = if one_queue { (1, left) } else { (0, left) };
                let timeout = (min > 0).then_some(&mut timeout);
                let n = queue
                    .do_io(&mut completions, min, timeout, None)
                    .unwrap_or_else(|e| panic!("libblkio do_io: {e}"));
                any |= n > 0;
                for c in &completions[..n] {
                    // SAFETY: do_io initialized the first n completions.
                    let c = unsafe { c.assume_init_read() };
                    assert!(results[c.user_data].is_none(), "completed twice");
                    results[c.user_data] = Some(c.ret);
                    done += 1;
                }
            }
            if !any && !one_queue {
                thread::sleep(Duration::from_micros(100));
            }
        }
        results.into_iter().map(|r| r.unwrap_or(i32::MIN)).collect()
    }

    fn one(&mut self, op: Op) -> i32 {
        self.batch(&[op])[0]
    }

    /// Writes `data` at `offset` (through the start of the buffer).
    pub fn write(&mut self, offset: u64, data: &[u8]) -> i32 {
        self.buf()[..data.len()].copy_from_slice(data);
        self.one(Op::Write {
            offset,
            buf_off: 0,
            len: data.len(),
        })
    }

    /// Reads `len` bytes at `offset`; panics on an error completion.
    pub fn read(&mut self, offset: u64, len: usize) -> Vec<u8> {
        let ret = self.one(Op::Read {
            offset,
            buf_off: 0,
            len,
        });
        assert_eq!(ret, 0, "read of {len} bytes at {offset} failed");
        self.buf()[..len].to_vec()
    }

    pub fn flush(&mut self) -> i32 {
        self.one(Op::Flush)
    }

    /// A closed loop: keeps `depth` requests in flight for `dur`, each
    /// slot `i` with its own `slot_len`-byte part of the buffer; `op(n, slot)`
    /// is the n-th request issued, on `slot`'s buffer. Returns when each
    /// completed and how many failed; what is still in flight at the end
    /// is waited for and not counted.
    pub fn sustain(
        &mut self,
        depth: usize,
        slot_len: usize,
        dur: Duration,
        mut op: impl FnMut(u64, usize) -> Op,
    ) -> Sustained {
        assert!(depth * slot_len <= self.region.len, "buffer too small");
        let base = self.region.addr;
        let mut issued = 0u64;
        let mut submit = |q: &mut Blkioq, slot: usize| {
            let f = ReqFlags::empty();
            match op(issued, slot) {
                Op::Read { offset, len, .. } => {
                    assert!(len <= slot_len);
                    q.read(offset, (base + slot * slot_len) as *mut u8, len, slot, f)
                }
                Op::Write { offset, len, .. } => {
                    assert!(len <= slot_len);
                    q.write(offset, (base + slot * slot_len) as *const u8, len, slot, f)
                }
                Op::Flush => q.flush(slot, f),
                Op::Discard { offset, len } => q.discard(offset, len, slot, f),
                Op::WriteZeroes { offset, len } => q.write_zeroes(offset, len, slot, f),
            }
            issued += 1;
        };
        for slot in 0..depth {
            submit(&mut self.queue, slot);
        }
        let start = Instant::now();
        let end = start + dur;
        let mut out = Sustained {
            start,
            done: Vec::new(),
            errors: 0,
        };
        let mut in_flight = depth;
        let mut completions: Vec<MaybeUninit<Completion>> =
            (0..depth).map(|_| MaybeUninit::uninit()).collect();
        let mut last_progress = Instant::now();
        while in_flight > 0 {
            assert!(
                last_progress.elapsed() < IO_TIMEOUT,
                "no request completed for {IO_TIMEOUT:?}"
            );
            let mut timeout = Duration::from_millis(100);
            let n = match self
                .queue
                .do_io(&mut completions, 1, Some(&mut timeout), None)
            {
                Ok(n) => n,
                // Nothing within the timeout: look at the clock again.
                Err(e) if e.errno() == blkio::Errno::TIME => 0,
                Err(e) => panic!("libblkio do_io: {e}"),
            };
            let now = Instant::now();
            if n > 0 {
                last_progress = now;
            }
            for c in &completions[..n] {
                // SAFETY: do_io initialized the first n completions.
                let c = unsafe { c.assume_init_read() };
                in_flight -= 1;
                if now >= end {
                    continue;
                }
                if c.ret != 0 {
                    out.errors += 1;
                }
                out.done.push(now);
                submit(&mut self.queue, c.user_data);
                in_flight += 1;
            }
        }
        out
    }

    pub fn discard(&mut self, offset: u64, len: u64) -> i32 {
        self.one(Op::Discard { offset, len })
    }

    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> i32 {
        self.one(Op::WriteZeroes { offset, len })
    }
}
