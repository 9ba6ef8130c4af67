//! End-to-end tests: a real Linux guest under QEMU (TCG) uses a disk served
//! by `ringblk serve` over vhost-user.
//!
//! The guest is a Debian kernel and an initramfs built by
//! `scripts/guest-assets.sh`; its `/init` (`tests/guest/init.sh`) runs the
//! checks and prints `RINGBLK-PASS <name>` / `RINGBLK-FAIL <name> <detail>`
//! and `RINGBLK-DONE` on the serial console, then powers off. The host side
//! checks the image file afterwards.
//!
//! Environment:
//! - `RINGBLK_GUEST_BACKEND=qsd`: serve the disk with qemu-storage-daemon
//!   instead (to check the harness itself; daemon flags are then ignored);
//! - `RINGBLK_GUEST_TIMEOUT`: seconds a guest may run (default 180);
//! - `RINGBLK_GUEST_DIR`: where the kernel and initramfs are cached;
//! - `RINGBLK_GUEST_VERBOSE=1`: the guest shows every step's output, and the
//!   console is printed even when the test passes (see it with `--nocapture`);
//! - `RINGBLK_GUEST_EXTRA="--flag value ..."`: `rw_extra_from_env` boots the
//!   read-write guest with these daemon flags (otherwise it does nothing).
//!
//! The tests skip (and pass) only when QEMU cannot be run here at all, and
//! never where `CI` is set: there they fail.

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const MIB: u64 = 1 << 20;
/// Size of the exported image.
const IMAGE_SIZE: u64 = 64 * MIB;
/// Where the guest writes its pattern (see the layout in `init.sh`).
const GUEST_PATTERN_AT: u64 = 56 * MIB;
/// Where the host writes the pattern the guest must read.
const HOST_PATTERN_AT: u64 = 60 * MIB;
/// Length of either pattern.
const PATTERN_LEN: usize = MIB as usize;
/// Serial number given to ringblk (at most 20 bytes, no spaces).
const SERIAL: &str = "ringblk-e2e-0001";
/// What qemu-storage-daemon answers to GET_ID.
const QSD_SERIAL: &str = "vhost_user_blk";
const QEMU: &str = "qemu-system-x86_64";
const QSD: &str = "qemu-storage-daemon";

/// Checks every read-write boot must pass (names printed by `init.sh`).
const RW_CHECKS: &[&str] = &[
    "device",
    "size",
    "serial",
    "queues",
    "ro-flag",
    "host-pattern",
    "fio-verify",
    "fio-jobs",
    "queues-used",
    "discard",
    "zeroout",
    "large-io",
    "guest-pattern",
];
/// Checks every read-only boot must pass.
const RO_CHECKS: &[&str] = &[
    "device",
    "size",
    "serial",
    "queues",
    "ro-flag",
    "host-pattern",
    "ro-write",
    "ro-read",
];

/// One guest boot against one daemon configuration.
struct Scenario {
    readonly: bool,
    queues: u16,
    vcpus: u16,
    /// Pass `--queues` to the daemon (otherwise its default, 1, is expected).
    queues_flag: bool,
    /// Extra `ringblk serve` arguments.
    extra: Vec<String>,
    /// Guests booted one after the other against the same daemon.
    boots: u32,
    /// Kill and restart the daemon while the guest does I/O.
    restart: Option<Restart>,
    /// Leave `num-queues` to QEMU, whose default is one queue per vCPU.
    qemu_default_queues: bool,
}

/// How the daemon is restarted under a running guest (QEMU reconnects).
#[derive(Clone, Copy)]
struct Restart {
    /// SIGKILL: a crash; SIGTERM: an upgrade.
    signal: i32,
    times: u32,
}

impl Scenario {
    fn rw(extra: &[&str]) -> Self {
        Scenario {
            readonly: false,
            queues: 2,
            vcpus: 2,
            queues_flag: true,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            boots: 1,
            restart: None,
            qemu_default_queues: false,
        }
    }
}

#[test]
fn rw_two_queues() {
    run(Scenario::rw(&[]));
}

#[test]
fn rw_two_queues_poll() {
    run(Scenario::rw(&["--poll-us", "50"]));
}

#[test]
fn rw_two_queues_signal_late() {
    run(Scenario::rw(&["--signal", "late"]));
}

#[test]
fn rw_one_queue_defaults() {
    run(Scenario {
        queues: 1,
        vcpus: 1,
        queues_flag: false,
        ..Scenario::rw(&[])
    });
}

/// A VM of 8 vCPUs with QEMU's default `num-queues` (one per vCPU, so 8),
/// and the daemon's seccomp filter enforced (its default): the fifth
/// queue's thread once killed the daemon at connect. fio runs a job on
/// every CPU, so every queue must complete requests.
#[test]
fn rw_eight_vcpus_qemu_default_queues() {
    run(Scenario {
        queues: 8,
        vcpus: 8,
        qemu_default_queues: true,
        ..Scenario::rw(&["--seccomp", "enforce"])
    });
}

/// Two guests, one after the other, against one daemon: it must take the
/// second front-end (a VM reboot or a QEMU restart) without a restart.
#[test]
fn rw_reconnect() {
    run(Scenario {
        boots: 2,
        ..Scenario::rw(&[])
    });
}

/// The daemon crashes (SIGKILL) three times while the guest's fio
/// write+verify runs, and is restarted each time; QEMU reconnects, the
/// inflight log brings back what was in flight, and fio sees no error.
#[test]
fn rw_survives_daemon_kills() {
    run(Scenario {
        restart: Some(Restart {
            signal: libc::SIGKILL,
            times: 3,
        }),
        // O_DIRECT keeps requests in flight long enough for some kills to
        // catch them (page-cache I/O completes within the submit call).
        ..Scenario::rw(&["--direct"])
    });
}

/// The same with SIGTERM: an upgrade. The old daemon drains and exits 0.
#[test]
fn rw_survives_daemon_upgrades() {
    run(Scenario {
        restart: Some(Restart {
            signal: libc::SIGTERM,
            times: 3,
        }),
        ..Scenario::rw(&[])
    });
}

#[test]
fn rw_two_queues_fixed_buffers() {
    run(Scenario::rw(&["--fixed-buffers"]));
}

#[test]
fn rw_two_queues_sqpoll() {
    run(Scenario::rw(&["--sqpoll"]));
}

#[test]
fn rw_two_queues_direct() {
    run(Scenario::rw(&["--direct"]));
}

/// Any daemon flags, for trying them by hand:
/// `RINGBLK_GUEST_EXTRA="--sqpoll --notify per-request" cargo test --test guest rw_extra_from_env`.
/// Without the variable there is nothing to run.
#[test]
fn rw_extra_from_env() {
    let Ok(extra) = std::env::var("RINGBLK_GUEST_EXTRA") else {
        eprintln!("RINGBLK_GUEST_EXTRA is not set: nothing to try");
        return;
    };
    let extra: Vec<&str> = extra.split_whitespace().collect();
    run(Scenario::rw(&extra));
}

#[test]
fn readonly() {
    run(Scenario {
        readonly: true,
        ..Scenario::rw(&[])
    });
}

// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Ringblk,
    Qsd,
}

fn backend() -> Backend {
    match std::env::var("RINGBLK_GUEST_BACKEND").as_deref() {
        Ok("qsd") => Backend::Qsd,
        Ok("ringblk") | Ok("") | Err(_) => Backend::Ringblk,
        Ok(other) => panic!("RINGBLK_GUEST_BACKEND={other}: expected ringblk or qsd"),
    }
}

fn guest_timeout() -> Duration {
    let secs = std::env::var("RINGBLK_GUEST_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(180);
    Duration::from_secs(secs)
}

/// The kernel and initramfs the guest boots.
struct Assets {
    kernel: PathBuf,
    initrd: PathBuf,
}

/// Why the guest tests cannot run here; `None` if they can.
fn qemu_unusable(program: &str) -> Option<String> {
    match Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => None,
        Ok(out) => Some(format!(
            "`{program} --version` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Some(format!("cannot run {program}: {e}")),
    }
}

/// Builds (or finds) the guest assets once per test binary. `Err` means the
/// tests must be skipped; a broken build on a machine that can run QEMU panics.
fn assets() -> &'static Result<Assets, String> {
    static ASSETS: OnceLock<Result<Assets, String>> = OnceLock::new();
    ASSETS.get_or_init(|| {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        let script = manifest.join("scripts/guest-assets.sh");
        let mut cmd = Command::new("bash");
        cmd.arg(&script).stdin(Stdio::null());
        if std::env::var_os("RINGBLK_GUEST_DIR").is_none() {
            // target/tmp -> target/guest, wherever the target directory is.
            let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
            let dir = tmp.parent().unwrap_or(tmp).join("guest");
            cmd.env("RINGBLK_GUEST_DIR", dir);
        }
        let started = Instant::now();
        let out = cmd.output();
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                return Err(qemu_unusable(QEMU)
                    .map(|why| format!("{why}; and bash cannot run {}: {e}", script.display()))
                    .unwrap_or_else(|| panic!("cannot run {}: {e}", script.display())));
            }
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            // No QEMU and no way to install it: skip. Anything else is a bug.
            if let Some(why) = qemu_unusable(QEMU) {
                return Err(format!("{why} (guest-assets.sh: {})", stderr.trim()));
            }
            panic!(
                "{} failed ({}):\n{stdout}\n{stderr}",
                script.display(),
                out.status
            );
        }
        if let Some(why) = qemu_unusable(QEMU) {
            return Err(why);
        }
        let find = |key: &str| {
            stdout
                .lines()
                .filter_map(|l| l.strip_prefix(key))
                .next_back()
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    panic!("guest-assets.sh printed no {key}PATH:\n{stdout}\n{stderr}")
                })
        };
        let assets = Assets {
            kernel: find("kernel="),
            initrd: find("initrd="),
        };
        eprintln!(
            "guest assets ready in {:.1?}: {} {}",
            started.elapsed(),
            assets.kernel.display(),
            assets.initrd.display()
        );
        Ok(assets)
    })
}

/// A child process that is killed and reaped when dropped.
struct Guard {
    child: Child,
    name: &'static str,
}

impl Guard {
    fn spawn(name: &'static str, cmd: &mut Command) -> Guard {
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({:?}): {e}", cmd.get_program()));
        Guard { child, name }
    }

    /// Waits up to `limit` for the process to exit on its own.
    fn wait_for(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(50)),
                Ok(None) => return None,
                Err(e) => panic!("waiting for {}: {e}", self.name),
            }
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Guests run one at a time: each keeps both cores busy under TCG.
static ONE_GUEST: Mutex<()> = Mutex::new(());

/// 1 MiB of 32-byte records `rbpat NONCE %016d\n`, as `init.sh` makes it.
fn pattern(nonce: &str) -> Vec<u8> {
    assert_eq!(nonce.len(), 8);
    let mut out = Vec::with_capacity(PATTERN_LEN);
    for k in 0..PATTERN_LEN / 32 {
        writeln!(out, "rbpat {nonce} {k:016}").expect("writing to a Vec");
    }
    assert_eq!(out.len(), PATTERN_LEN);
    out
}

fn read_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut f = File::open(path).expect("open image");
    f.seek(SeekFrom::Start(offset)).expect("seek image");
    let mut buf = vec![0; len];
    f.read_exact(&mut buf).expect("read image");
    buf
}

fn read_log(path: &Path) -> String {
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_else(|e| format!("<cannot read {}: {e}>", path.display()))
}

/// The `-device` argument; a daemon `--queue-size` is QEMU's `queue-size`
/// too (QEMU's default of 128 is refused by a daemon with smaller queues).
fn qemu_device(sc: &Scenario) -> String {
    let mut dev = "vhost-user-blk-pci,chardev=c0".to_string();
    if !sc.qemu_default_queues {
        dev.push_str(&format!(",num-queues={}", sc.queues));
    }
    let mut size = None;
    for (i, arg) in sc.extra.iter().enumerate() {
        if arg == "--queue-size" {
            size = sc.extra.get(i + 1).map(String::as_str);
        } else if let Some(value) = arg.strip_prefix("--queue-size=") {
            size = Some(value);
        }
    }
    if let Some(size) = size {
        dev.push_str(&format!(",queue-size={size}"));
    }
    dev
}

/// Where each thread of a process is, for a hang report: state, kernel
/// wait channel and stack from /proc, and the user stacks if gdb is there.
fn threads_of(pid: u32) -> String {
    let mut out = String::new();
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return format!("<no /proc/{pid}/task>\n");
    };
    let mut tasks: Vec<PathBuf> = tasks.flatten().map(|t| t.path()).collect();
    tasks.sort();
    for task in tasks {
        let read = |name: &str| fs::read_to_string(task.join(name)).unwrap_or_default();
        let status = read("status");
        let state = status
            .lines()
            .find_map(|l| l.strip_prefix("State:"))
            .unwrap_or("?")
            .trim();
        let tid = task.file_name().unwrap_or_default().to_string_lossy();
        out.push_str(&format!(
            "  {tid} {:<16} {state:<14} wchan={}\n",
            read("comm").trim(),
            read("wchan").trim()
        ));
        for line in read("stack").lines().take(12) {
            out.push_str(&format!("      {line}\n"));
        }
    }
    let gdb = Command::new("timeout")
        .args(["30", "gdb", "-p", &pid.to_string(), "-batch", "-nx"])
        .args(["-ex", "thread apply all bt 25"])
        .stdin(Stdio::null())
        .output();
    if let Ok(o) = gdb {
        if o.status.success() {
            let text = String::from_utf8_lossy(&o.stdout);
            out.push_str("  user stacks (gdb):\n");
            for line in text
                .lines()
                .filter(|l| l.starts_with('#') || l.starts_with("Thread"))
            {
                out.push_str(&format!("    {line}\n"));
            }
        }
    }
    out
}

/// What the guest printed.
#[derive(Default)]
struct Verdict {
    passed: Vec<String>,
    failed: Vec<String>,
    done: bool,
}

fn parse_console(console: &str) -> Verdict {
    let mut v = Verdict::default();
    for line in console.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("RINGBLK-PASS ") {
            v.passed.push(name.trim().to_string());
        } else if let Some(rest) = line.strip_prefix("RINGBLK-FAIL ") {
            v.failed.push(rest.trim().to_string());
        } else if line == "RINGBLK-DONE" {
            v.done = true;
        }
    }
    v
}

/// A fresh 8-hex-digit marker for one boot's patterns.
fn new_nonce() -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let n = (t.as_nanos() as u32)
        ^ std::process::id().rotate_left(16)
        ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(8);
    format!("{n:08x}")
}

/// The files of one scenario's run.
struct Paths {
    socket: PathBuf,
    image: PathBuf,
    daemon_log: PathBuf,
    dir: PathBuf,
}

fn run(sc: Scenario) {
    let assets = match assets() {
        Ok(a) => a,
        // CI installs QEMU (scripts/test.sh): there, not running is a failure.
        Err(why) if std::env::var_os("CI").is_some() => {
            panic!("CI is set but this machine cannot run the QEMU guest tests: {why}")
        }
        Err(why) => {
            eprintln!("SKIPPED: this machine cannot run the QEMU guest tests: {why}");
            return;
        }
    };
    let backend = backend();
    if backend == Backend::Qsd {
        if let Some(why) = qemu_unusable(QSD) {
            panic!("RINGBLK_GUEST_BACKEND=qsd but {why}");
        }
    }
    let _one = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());

    let tmp = tempfile::Builder::new()
        .prefix("ringblk-guest-")
        .tempdir()
        .expect("temporary directory");
    let paths = Paths {
        socket: tmp.path().join("vhost.sock"),
        image: tmp.path().join("disk.img"),
        daemon_log: tmp.path().join("daemon.log"),
        dir: tmp.path().to_path_buf(),
    };
    File::create(&paths.image)
        .and_then(|f| f.set_len(IMAGE_SIZE))
        .expect("create the image");

    let (mut daemon_cmd, serial) = daemon_command(&sc, backend, &paths);
    let log_file = File::create(&paths.daemon_log).expect("daemon log");
    daemon_cmd
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().expect("daemon log"))
        .stderr(log_file);
    eprintln!("starting {daemon_cmd:?}");
    let mut daemon = Guard::spawn("daemon", &mut daemon_cmd);
    wait_for_socket(&mut daemon, &paths);
    let daemon = Mutex::new(daemon);

    let which = match backend {
        Backend::Ringblk => format!("ringblk serve {}", sc.extra.join(" ")),
        Backend::Qsd => "qemu-storage-daemon".to_string(),
    };
    let mut problems = Vec::new();
    let mut consoles = String::new();
    for n in 1..=sc.boots {
        let pid = daemon.lock().unwrap_or_else(|e| e.into_inner()).child.id();
        let (report, restarts) = thread::scope(|s| {
            let restarter = sc.restart.map(|r| {
                let (sc, paths, daemon) = (&sc, &paths, &daemon);
                s.spawn(move || restart_daemon(r, sc, backend, paths, daemon, n))
            });
            let report = boot(&sc, assets, &paths, serial, n, pid);
            (
                report,
                restarter.map(|t| t.join().expect("restarter thread")),
            )
        });
        let mut report = report;
        if let (Some(r), Some(done)) = (sc.restart, restarts) {
            let log = read_log(&paths.daemon_log);
            let resubmitted: u32 = log
                .lines()
                .filter_map(|l| l.split("resubmitting ").nth(1))
                .filter_map(|r| r.split(' ').next()?.parse::<u32>().ok())
                .sum();
            eprintln!(
                "the daemon was restarted {done} time(s) under the guest; \
                 requests resubmitted after a restart: {resubmitted}"
            );
            if done < r.times {
                report.problems.push(format!(
                    "only {done} of {} daemon restarts happened before the guest finished",
                    r.times
                ));
            }
            // A crash under fio at iodepth 16 leaves requests in flight,
            // which the next daemon must redo; an upgrade drains them first.
            if r.signal == libc::SIGKILL && resubmitted == 0 {
                report
                    .problems
                    .push("no kill caught a request in flight: recovery was not exercised".into());
            }
            if r.signal == libc::SIGTERM && resubmitted != 0 {
                report.problems.push(format!(
                    "{resubmitted} request(s) resubmitted after SIGTERM, which must drain them"
                ));
            }
        }
        eprintln!(
            "guest boot {n}/{} ({}, {} queue(s), {} vCPU(s), {which}) ran {:.1?}: {} passed, {} failed",
            sc.boots,
            if sc.readonly { "ro" } else { "rw" },
            sc.queues,
            sc.vcpus,
            report.elapsed,
            report.passed,
            report.failed
        );
        if verbose() {
            eprintln!("==== guest console, boot {n} ====\n{}", report.console);
        }
        let failed = !report.problems.is_empty();
        problems.extend(
            report
                .problems
                .into_iter()
                .map(|p| format!("boot {n}: {p}")),
        );
        consoles.push_str(&format!(
            "==== guest console, boot {n} ====\n{}\n==== qemu output, boot {n} ====\n{}\n",
            report.console, report.qemu_output
        ));
        if failed {
            break;
        }
        let exited = daemon
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .child
            .try_wait();
        if let Ok(Some(status)) = exited {
            problems.push(format!("the daemon exited after boot {n}: {status}"));
            break;
        }
    }

    // The front-end is gone: give the daemon a moment in case it exits.
    let mut daemon = daemon.into_inner().unwrap_or_else(|e| e.into_inner());
    let daemon_status = daemon.wait_for(Duration::from_secs(1));
    drop(daemon);
    if let Some(status) = daemon_status {
        if status.signal().is_some() || status.code() == Some(101) {
            problems.push(format!("the daemon died: {status}"));
        }
    }
    if !problems.is_empty() {
        panic!(
            "{} problem(s) with {which}:\n  {}\n{consoles}\
             ==== daemon output (exit: {daemon_status:?}) ====\n{}",
            problems.len(),
            problems.join("\n  "),
            read_log(&paths.daemon_log),
        );
    }
}

/// Once the guest's I/O checks have begun (the host pattern was read),
/// stops the daemon with `r.signal` every 2.5 s and starts a new one on the
/// same socket and image, `r.times` times or until the guest is done.
/// Returns how many restarts happened.
fn restart_daemon(
    r: Restart,
    sc: &Scenario,
    backend: Backend,
    paths: &Paths,
    daemon: &Mutex<Guard>,
    boot: u32,
) -> u32 {
    let console = paths.dir.join(format!("console-{boot}.log"));
    let deadline = Instant::now() + guest_timeout();
    let guest_says = |what: &str| read_log(&console).contains(what);
    while !guest_says("RINGBLK-PASS host-pattern") {
        if guest_says("RINGBLK-DONE") || Instant::now() > deadline {
            return 0;
        }
        thread::sleep(Duration::from_millis(100));
    }
    for done in 0..r.times {
        // Long enough for QEMU (which retries once a second) to reconnect
        // and the guest to do I/O against each new daemon.
        thread::sleep(Duration::from_millis(2500));
        if guest_says("RINGBLK-DONE") {
            return done;
        }
        let mut d = daemon.lock().unwrap_or_else(|e| e.into_inner());
        if r.signal == libc::SIGKILL {
            kill_with_requests_in_flight(d.child.id() as i32, &paths.socket);
        } else {
            // SAFETY: kill(2) on our own child's pid, which is not yet reaped.
            unsafe { libc::kill(d.child.id() as i32, r.signal) };
        }
        let status = d.wait_for(Duration::from_secs(20));
        if r.signal == libc::SIGTERM && !status.is_some_and(|s| s.success()) {
            panic!(
                "the daemon did not exit 0 on SIGTERM: {status:?}\n{}",
                read_log(&paths.daemon_log)
            );
        }
        let (mut cmd, _) = daemon_command(sc, backend, paths);
        let log = fs::OpenOptions::new()
            .append(true)
            .open(&paths.daemon_log)
            .expect("daemon log");
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().expect("daemon log"))
            .stderr(log);
        *d = Guard::spawn("daemon", &mut cmd);
        wait_for_socket(&mut d, paths);
    }
    r.times
}

/// SIGKILLs the daemon at a moment when its inflight log shows requests
/// taken off the ring and not completed, so the restart must resubmit
/// them: the daemon is stopped (SIGSTOP), the log read through QEMU's
/// descriptor of it, and the daemon killed if the log is not empty, else
/// let go (SIGCONT) and tried again. After 2 s it is killed regardless.
fn kill_with_requests_in_flight(pid: i32, socket: &Path) {
    let log = inflight_log_of_qemu_using(socket);
    let deadline = Instant::now() + Duration::from_secs(2);
    while let Some(path) = log.as_ref().filter(|_| Instant::now() < deadline) {
        // SAFETY: signals to our own child; waitpid with WUNTRACED reports
        // it stopped without reaping it.
        let stopped = unsafe {
            libc::kill(pid, libc::SIGSTOP);
            let mut status = 0;
            libc::waitpid(pid, &mut status, libc::WUNTRACED) == pid && libc::WIFSTOPPED(status)
        };
        if stopped && fs::read(path).is_ok_and(|bytes| logged_in_flight(&bytes)) {
            break;
        }
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        thread::sleep(Duration::from_millis(3));
    }
    // SAFETY: as above. SIGKILL also ends a stopped process.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

/// Whether a split-ring inflight region (vhost-user spec layout, QEMU's
/// 128-entry queues) has a descriptor marked in flight.
fn logged_in_flight(region: &[u8]) -> bool {
    const QUEUE_SIZE: usize = 128;
    let per_queue = (16 + 16 * QUEUE_SIZE).div_ceil(64) * 64;
    region
        .chunks(per_queue)
        .any(|q| (0..QUEUE_SIZE).any(|h| q.get(16 + 16 * h).is_some_and(|b| *b == 1)))
}

/// `/proc/PID/fd/N` of the inflight memfd held by the QEMU using `socket`.
fn inflight_log_of_qemu_using(socket: &Path) -> Option<PathBuf> {
    let want = socket.to_string_lossy().into_owned();
    fs::read_dir("/proc").ok()?.flatten().find_map(|p| {
        let cmdline = fs::read(p.path().join("cmdline")).ok()?;
        let cmdline = String::from_utf8_lossy(&cmdline);
        if !cmdline.starts_with("qemu-system") || !cmdline.contains(&want) {
            return None;
        }
        fs::read_dir(p.path().join("fd"))
            .ok()?
            .flatten()
            .find_map(|fd| {
                let target = fs::read_link(fd.path()).ok()?;
                target
                    .to_string_lossy()
                    .contains("ringblk-inflight")
                    .then(|| fd.path())
            })
    })
}

/// The backend's command line, and the serial the guest should see.
fn daemon_command(sc: &Scenario, backend: Backend, paths: &Paths) -> (Command, &'static str) {
    match backend {
        Backend::Ringblk => {
            let mut c = Command::new(env!("CARGO_BIN_EXE_ringblk"));
            c.arg("serve")
                .arg("--socket")
                .arg(&paths.socket)
                .arg("--image")
                .arg(&paths.image);
            if sc.readonly {
                c.arg("--readonly");
            }
            if sc.queues_flag {
                c.arg("--queues").arg(sc.queues.to_string());
            }
            c.arg("--serial").arg(SERIAL).args(&sc.extra);
            // Killed daemons leave their private directory in the test's.
            c.env("TMPDIR", &paths.dir);
            (c, SERIAL)
        }
        Backend::Qsd => {
            if !sc.extra.is_empty() {
                eprintln!("note: qemu-storage-daemon ignores {:?}", sc.extra);
            }
            let mut c = Command::new(QSD);
            let ro = if sc.readonly { "on" } else { "off" };
            c.arg("--blockdev").arg(format!(
                "driver=file,node-name=f,filename={},discard=unmap,read-only={ro}",
                paths.image.display()
            ));
            c.arg("--export").arg(format!(
                "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},writable={},num-queues={}",
                paths.socket.display(),
                if sc.readonly { "off" } else { "on" },
                sc.queues
            ));
            (c, QSD_SERIAL)
        }
    }
}

fn wait_for_socket(daemon: &mut Guard, paths: &Paths) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if fs::metadata(&paths.socket).is_ok_and(|m| m.file_type().is_socket()) {
            return;
        }
        if let Ok(Some(status)) = daemon.child.try_wait() {
            panic!(
                "the daemon exited ({status}) before creating {}:\n{}",
                paths.socket.display(),
                read_log(&paths.daemon_log)
            );
        }
        if Instant::now() > deadline {
            panic!(
                "the daemon created no socket at {} within 15 s:\n{}",
                paths.socket.display(),
                read_log(&paths.daemon_log)
            );
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn verbose() -> bool {
    std::env::var("RINGBLK_GUEST_VERBOSE").is_ok_and(|v| v == "1")
}

/// What one boot showed.
struct BootReport {
    problems: Vec<String>,
    console: String,
    qemu_output: String,
    elapsed: Duration,
    passed: usize,
    failed: usize,
}

/// Boots the guest once against the running daemon and checks the image
/// afterwards. Boot `n` > 1 tests that the daemon takes a new front-end.
fn boot(
    sc: &Scenario,
    assets: &Assets,
    paths: &Paths,
    serial: &str,
    n: u32,
    daemon_pid: u32,
) -> BootReport {
    let console_path = paths.dir.join(format!("console-{n}.log"));
    let qemu_log = paths.dir.join(format!("qemu-{n}.log"));
    let mut problems = Vec::new();

    // A fresh host pattern, so that each boot must read what is there now.
    let nonce = new_nonce();
    let host_pattern = pattern(&nonce);
    {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .open(&paths.image)
            .expect("open the image");
        f.seek(SeekFrom::Start(HOST_PATTERN_AT))
            .expect("seek image");
        f.write_all(&host_pattern).expect("write host pattern");
        f.sync_all().expect("sync image");
    }
    let before = read_at(&paths.image, 0, IMAGE_SIZE as usize);

    let mode = if sc.readonly { "ro" } else { "rw" };
    let append = format!(
        "console=ttyS0 quiet panic=-1 ringblk.test={mode} ringblk.sectors={} \
         ringblk.serial={serial} ringblk.queues={} ringblk.nonce={nonce} ringblk.verbose={} \
         ringblk.fio_loops={}",
        IMAGE_SIZE / 512,
        sc.queues,
        u8::from(verbose()),
        // Restarts need I/O long enough to land in: several passes.
        if sc.restart.is_some() { 6 } else { 1 }
    );
    let timeout = guest_timeout();
    let started = Instant::now();
    // After a disconnect the daemon may need a moment before it accepts
    // again: retry while QEMU fails to connect, for up to 5 s.
    let mut hang_report = String::new();
    let qemu_status = loop {
        let qemu_out = File::create(&qemu_log).expect("qemu log");
        let mut qemu_cmd = Command::new(QEMU);
        qemu_cmd
            .args(["-accel", "tcg", "-m", "512M", "-smp"])
            .arg(sc.vcpus.to_string())
            .args([
                "-nodefaults",
                "-no-user-config",
                "-display",
                "none",
                "-monitor",
                "none",
            ])
            .args(["-object", "memory-backend-memfd,id=mem,size=512M,share=on"])
            .args(["-numa", "node,memdev=mem"])
            .arg("-chardev")
            .arg(format!(
                "socket,id=c0,path={}{}",
                paths.socket.display(),
                if sc.restart.is_some() {
                    ",reconnect=1"
                } else {
                    ""
                }
            ))
            .arg("-device")
            .arg(qemu_device(sc))
            .arg("-kernel")
            .arg(&assets.kernel)
            .arg("-initrd")
            .arg(&assets.initrd)
            .arg("-append")
            .arg(&append)
            .arg("-serial")
            .arg(format!("file:{}", console_path.display()))
            .arg("-no-reboot")
            .stdin(Stdio::null())
            .stdout(qemu_out.try_clone().expect("qemu log"))
            .stderr(qemu_out);
        eprintln!("starting {qemu_cmd:?}");
        let mut qemu = Guard::spawn("qemu", &mut qemu_cmd);
        let status = qemu.wait_for(timeout);
        if status.is_none() {
            hang_report = format!(
                "==== where the daemon's threads are (pid {daemon_pid}) ====\n{}\
                 ==== where QEMU's threads are ====\n{}",
                threads_of(daemon_pid),
                threads_of(qemu.child.id())
            );
        }
        let refused = status.is_some_and(|s| !s.success())
            && read_log(&qemu_log).contains("Connection refused");
        if refused && n > 1 && started.elapsed() < Duration::from_secs(5) {
            thread::sleep(Duration::from_millis(200));
            continue;
        }
        break status;
    };
    let elapsed = started.elapsed();

    let console = read_log(&console_path);
    let verdict = parse_console(&console);
    match qemu_status {
        None => problems.push(format!("QEMU did not finish within {timeout:?} (killed)")),
        Some(s) if !s.success() => problems.push(format!("QEMU exited with {s}")),
        Some(_) => {}
    }
    if !verdict.done {
        problems.push("the guest never printed RINGBLK-DONE".to_string());
    }
    for f in &verdict.failed {
        problems.push(format!("guest check failed: {f}"));
    }
    let expected = if sc.readonly { RO_CHECKS } else { RW_CHECKS };
    for name in expected {
        let failed = verdict
            .failed
            .iter()
            .any(|f| f.split(' ').next() == Some(name));
        if !failed && !verdict.passed.iter().any(|p| p == name) {
            problems.push(format!("guest check missing: {name}"));
        }
    }

    // ---- The image, as the host sees it ----
    let len = fs::metadata(&paths.image).map(|m| m.len()).unwrap_or(0);
    if len != IMAGE_SIZE {
        problems.push(format!("the image is {len} bytes, expected {IMAGE_SIZE}"));
    } else if sc.readonly {
        let after = read_at(&paths.image, 0, IMAGE_SIZE as usize);
        if let Some(at) = after.iter().zip(&before).position(|(a, b)| a != b) {
            problems.push(format!(
                "host: a read-only image changed, first at byte {at}"
            ));
        }
    } else if verdict.passed.iter().any(|p| p == "guest-pattern") {
        let got = read_at(&paths.image, GUEST_PATTERN_AT, PATTERN_LEN);
        if let Some(at) = got.iter().zip(&host_pattern).position(|(a, b)| a != b) {
            let record = at - at % 32;
            problems.push(format!(
                "host: the guest's pattern is not in the image at {GUEST_PATTERN_AT}: \
                 first difference at +{at}: {:?}",
                String::from_utf8_lossy(&got[record..record + 32])
            ));
        }
    }

    BootReport {
        problems,
        console,
        qemu_output: read_log(&qemu_log) + &hang_report,
        elapsed,
        passed: verdict.passed.len(),
        failed: verdict.failed.len(),
    }
}
