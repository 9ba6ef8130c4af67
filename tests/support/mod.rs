//! Fixtures for the hardening tests (seccomp, durability, backing-store
//! errors, unprivileged user): a `ringblk serve` process that can be run
//! through a wrapper (setpriv) and killed with any signal, and a small
//! synchronous vhost-user-blk client on libblkio.
//!
//! Everything has a deadline: a daemon that does not come up, or a request
//! that does not complete, fails the test instead of hanging it.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::mem::MaybeUninit;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use tempfile::TempDir;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

const START_TIMEOUT: Duration = Duration::from_secs(20);
/// Any single request, flushes included.
const IO_TIMEOUT: Duration = Duration::from_secs(20);
/// sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
const SUN_PATH_MAX: usize = 107;

/// A fresh directory under Cargo's target dir (a real file system: /tmp
/// may be a tmpfs).
pub fn test_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("rbh-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("creating a temporary directory under CARGO_TARGET_TMPDIR")
}

/// Creates a sparse file of `size` bytes.
pub fn sparse_image(path: &Path, size: u64) {
    File::create(path)
        .and_then(|f| f.set_len(size))
        .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
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

/// `GET /metrics` from a `--metrics` Unix socket: the exposition body.
pub fn scrape(metrics_socket: &Path) -> String {
    let mut s = UnixStream::connect(metrics_socket)
        .unwrap_or_else(|e| panic!("connecting to {}: {e}", metrics_socket.display()));
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

/// Sum of the samples whose name and labels start with `prefix`, e.g.
/// `ringblk_errors_total{` or `ringblk_requests_total{queue="0",type="write"}`.
pub fn metric(exposition: &str, prefix: &str) -> u64 {
    exposition
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// How to start the daemon.
#[derive(Default)]
pub struct Spawn<'a> {
    /// Extra `serve` arguments.
    pub args: &'a [&'a str],
    /// A command (and its arguments) to run the daemon through, e.g.
    /// `["setpriv", "--reuid=65534", ...]`.
    pub wrapper: &'a [&'a str],
}

/// A running `ringblk serve`, killed (SIGKILL) when dropped. Its stdout and
/// stderr go to `DIR/daemon.log`.
pub struct Daemon {
    child: Option<Child>,
    pub socket: PathBuf,
    pub image: PathBuf,
    log: PathBuf,
    status: Option<ExitStatus>,
}

impl Daemon {
    /// Starts `ringblk serve --socket DIR/vhost.sock --image IMAGE ARGS`
    /// and waits until the socket accepts connections.
    pub fn start(dir: &Path, image: &Path, spawn: Spawn<'_>) -> Daemon {
        let socket = dir.join("vhost.sock");
        assert!(
            socket.as_os_str().len() <= SUN_PATH_MAX,
            "socket path {} is too long; use a shorter CARGO_TARGET_DIR",
            socket.display()
        );
        let log = dir.join("daemon.log");
        let out = File::create(&log).expect("creating the daemon log");
        let (program, pre): (&str, &[&str]) = match spawn.wrapper.split_first() {
            Some((p, rest)) => (p, rest),
            None => (env!("CARGO_BIN_EXE_ringblk"), &[]),
        };
        let mut cmd = Command::new(program);
        cmd.args(pre);
        if !spawn.wrapper.is_empty() {
            cmd.arg(env!("CARGO_BIN_EXE_ringblk"));
        }
        cmd.arg("serve")
            .arg("--socket")
            .arg(&socket)
            .arg("--image")
            .arg(image)
            .args(spawn.args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("daemon log"))
            .stderr(out);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info,virtio_queue=off");
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {program}: {e}"));
        let mut d = Daemon {
            child: Some(child),
            socket,
            image: image.to_path_buf(),
            log,
            status: None,
        };
        d.wait_until_accepting();
        d
    }

    fn wait_until_accepting(&mut self) {
        let deadline = Instant::now() + START_TIMEOUT;
        while UnixStream::connect(&self.socket).is_err() {
            if let Some(st) = self.try_wait() {
                panic!(
                    "ringblk serve exited with {st} before accepting; its output:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "ringblk serve did not accept within {START_TIMEOUT:?}; its output:\n{}",
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

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Everything the daemon printed so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Some(c) = self.child.as_mut() {
                self.status = c.try_wait().expect("polling the daemon");
            }
        }
        self.status
    }

    /// Panics with the daemon's output unless it is still running.
    pub fn assert_running(&mut self) {
        if let Some(st) = self.try_wait() {
            panic!(
                "ringblk serve exited with {st}; its output:\n{}",
                self.log()
            );
        }
    }

    /// Sends `sig` and waits (up to `timeout`) for the process to end.
    pub fn signal_and_wait(&mut self, sig: i32, timeout: Duration) -> ExitStatus {
        if self.try_wait().is_none() {
            // SAFETY: kill(2) on our own child, which has not been reaped
            // yet, so the pid cannot have been reused.
            unsafe { libc::kill(self.pid(), sig) };
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.try_wait() {
                return st;
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

    /// The `Name:\tvalue` line of /proc/PID/status (or of a thread's, with
    /// `tid`).
    pub fn proc_status(&self, tid: Option<i32>, name: &str) -> Option<String> {
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
    pub fn threads(&self) -> Vec<i32> {
        fs::read_dir(format!("/proc/{}/task", self.pid()))
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if thread::panicking() {
            eprintln!(
                "---- ringblk serve output ----\n{}---- end ----",
                self.log()
            );
        }
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
    blkio: Blkio,
    region: MemoryRegion,
    pub capacity: u64,
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
        let mut blkio = ok("new", Blkio::new("virtio-blk-vhost-user"));
        let path = socket.to_str().expect("UTF-8 socket path");
        ok("path", blkio.set_str("path", path));
        ok("connect", blkio.connect());
        ok("num-queues", blkio.set_i32("num-queues", 1));
        let capacity = ok("capacity", blkio.get_u64("capacity"));
        let mut started = ok("start", blkio.start());
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
            blkio,
            region,
            capacity,
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
        let base = self.region.addr;
        let cap = self.region.len;
        for (i, op) in ops.iter().enumerate() {
            let f = ReqFlags::empty();
            match *op {
                Op::Write {
                    offset,
                    buf_off,
                    len,
                } => {
                    assert!(buf_off + len <= cap);
                    self.queue
                        .write(offset, (base + buf_off) as *const u8, len, i, f)
                }
                Op::Read {
                    offset,
                    buf_off,
                    len,
                } => {
                    assert!(buf_off + len <= cap);
                    self.queue
                        .read(offset, (base + buf_off) as *mut u8, len, i, f)
                }
                Op::Flush => self.queue.flush(i, f),
                Op::Discard { offset, len } => self.queue.discard(offset, len, i, f),
                Op::WriteZeroes { offset, len } => self.queue.write_zeroes(offset, len, i, f),
            }
        }
        let mut results = vec![None; ops.len()];
        let mut done = 0;
        let deadline = Instant::now() + IO_TIMEOUT;
        let mut completions: Vec<MaybeUninit<Completion>> =
            (0..ops.len()).map(|_| MaybeUninit::uninit()).collect();
        while done < ops.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "{} of {} requests did not complete within {IO_TIMEOUT:?}",
                ops.len() - done,
                ops.len()
            );
            let mut timeout = left;
            let n = self
                .queue
                .do_io(&mut completions, 1, Some(&mut timeout), None)
                .unwrap_or_else(|e| panic!("libblkio do_io: {e}"));
            for c in &completions[..n] {
                // SAFETY: do_io initialized the first n completions.
                let c = unsafe { c.assume_init_read() };
                assert!(results[c.user_data].is_none(), "completed twice");
                results[c.user_data] = Some(c.ret);
                done += 1;
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

    pub fn discard(&mut self, offset: u64, len: u64) -> i32 {
        self.one(Op::Discard { offset, len })
    }

    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> i32 {
        self.one(Op::WriteZeroes { offset, len })
    }
}
