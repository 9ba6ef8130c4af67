//! What the real-guest tests share (`tests/guest`, `tests/rbd`): the
//! guest's kernel and initramfs, QEMU's command line, the serial console's
//! verdict, daemons that log to a file, the lock that runs one guest at a
//! time, and the patterns of the image's layout.
//!
//! The guest is a Debian kernel and an initramfs built by
//! `scripts/guest-assets.sh`; its `/init` (`tests/guest/init.sh`) runs the
//! checks and prints `RINGBLK-PASS <name>` / `RINGBLK-FAIL <name> <detail>`
//! and `RINGBLK-DONE` on the serial console, then powers off.
//!
//! Environment (all the guest tests):
//! - `RINGBLK_GUEST_BACKEND=qsd`: serve the disk with qemu-storage-daemon
//!   instead (to check the harness itself; daemon flags are then ignored);
//! - `RINGBLK_GUEST_TIMEOUT`: seconds a guest may run (default 180);
//! - `RINGBLK_GUEST_DIR`: where the kernel and initramfs are cached;
//! - `RINGBLK_GUEST_VERBOSE=1`: the guest shows every step's output, and the
//!   console is printed even when the test passes (see it with `--nocapture`).
//!
//! The tests skip (and pass) only when QEMU cannot be run here at all, and
//! never where `CI` is set: there they fail.

pub mod migration;
pub mod qmp;

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::{ringblk_bin, tmp_dir, workspace_root};

pub use crate::MIB;
/// Size of the exported image.
pub const IMAGE_SIZE: u64 = 64 * MIB;
/// Where the guest writes its pattern (see the layout in `init.sh`).
pub const GUEST_PATTERN_AT: u64 = 56 * MIB;
/// Where the host writes the pattern the guest must read.
pub const HOST_PATTERN_AT: u64 = 60 * MIB;
/// Length of either pattern.
pub const PATTERN_LEN: usize = MIB as usize;
/// Serial number given to ringblk (at most 20 bytes, no spaces).
pub const SERIAL: &str = "ringblk-e2e-0001";
/// What qemu-storage-daemon answers to GET_ID.
pub const QSD_SERIAL: &str = "vhost_user_blk";
pub const QEMU: &str = "qemu-system-x86_64";
pub const QSD: &str = "qemu-storage-daemon";

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Ringblk,
    Qsd,
}

pub fn backend() -> Backend {
    match std::env::var("RINGBLK_GUEST_BACKEND").as_deref() {
        Ok("qsd") => Backend::Qsd,
        Ok("ringblk") | Ok("") | Err(_) => Backend::Ringblk,
        Ok(other) => panic!("RINGBLK_GUEST_BACKEND={other}: expected ringblk or qsd"),
    }
}

pub fn guest_timeout() -> Duration {
    let secs = std::env::var("RINGBLK_GUEST_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(180);
    Duration::from_secs(secs)
}

pub fn verbose() -> bool {
    std::env::var("RINGBLK_GUEST_VERBOSE").is_ok_and(|v| v == "1")
}

/// The kernel and initramfs the guest boots.
pub struct Assets {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
}

/// Why the guest tests cannot run here; `None` if they can.
pub fn qemu_unusable(program: &str) -> Option<String> {
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

/// The assets, or `None` when the test must be skipped because QEMU
/// cannot run here at all. Where `CI` is set that is a failure instead.
pub fn assets_or_skip() -> Option<&'static Assets> {
    match assets() {
        Ok(a) => Some(a),
        // CI installs QEMU (scripts/test.sh): there, not running is a failure.
        Err(why) if std::env::var_os("CI").is_some() => {
            panic!("CI is set but this machine cannot run the QEMU guest tests: {why}")
        }
        Err(why) => {
            eprintln!("SKIPPED: this machine cannot run the QEMU guest tests: {why}");
            None
        }
    }
}

/// Builds (or finds) the guest assets once per test binary. `Err` means the
/// tests must be skipped; a broken build on a machine that can run QEMU panics.
fn assets() -> &'static Result<Assets, String> {
    static ASSETS: OnceLock<Result<Assets, String>> = OnceLock::new();
    ASSETS.get_or_init(|| {
        let script = workspace_root().join("scripts/guest-assets.sh");
        let mut cmd = Command::new("bash");
        cmd.arg(&script).stdin(Stdio::null());
        if std::env::var_os("RINGBLK_GUEST_DIR").is_none() {
            // target/tmp -> target/guest, wherever the target directory is.
            let tmp = tmp_dir();
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

/// The guest lock, held as long as this lives: an flock(2) on a file
/// under `target/`, so the threads of one test binary and other test
/// binaries wait alike; the kernel drops it if the holder dies.
pub struct GuestLock {
    _file: File,
}

/// Held while a test runs its guest(s): guests run one at a time, each
/// keeps both cores busy under TCG.
pub fn one_guest() -> GuestLock {
    guest_lock(libc::LOCK_EX)
}

/// Held by a test that must not run beside a guest, in a binary that also
/// runs guests (`tests/rbd`): such tests share it and run in parallel with
/// each other, never with [`one_guest`]'s holder. A guest under TCG takes
/// both cores of a small machine and a migration converges only on an
/// unloaded one, while these tests have deadlines of their own; when each
/// kind had a binary of its own, Cargo ran them one after the other.
pub fn no_guest() -> GuestLock {
    guest_lock(libc::LOCK_SH)
}

fn guest_lock(how: libc::c_int) -> GuestLock {
    let path = tmp_dir().join("one-guest.lock");
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    loop {
        // SAFETY: flock(2) on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), how) } == 0 {
            return GuestLock { _file: file };
        }
        let e = std::io::Error::last_os_error();
        assert_eq!(
            e.kind(),
            std::io::ErrorKind::Interrupted,
            "flock of {}: {e}",
            path.display()
        );
    }
}

/// A child process that is killed and reaped when dropped.
pub struct Guard {
    pub child: Child,
    pub name: &'static str,
}

impl Guard {
    pub fn spawn(name: &'static str, cmd: &mut Command) -> Guard {
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({:?}): {e}", cmd.get_program()));
        Guard { child, name }
    }

    /// Spawns `cmd` with its output appended to `log` (created if missing).
    pub fn spawn_logged(name: &'static str, cmd: &mut Command, log: &Path) -> Guard {
        let out = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap_or_else(|e| panic!("{name} log {}: {e}", log.display()));
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone().expect("log file descriptor"))
            .stderr(out);
        eprintln!("starting {cmd:?}");
        Guard::spawn(name, cmd)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status, if the process has ended.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits up to `limit` for the process to exit on its own.
    pub fn wait_for(&mut self, limit: Duration) -> Option<ExitStatus> {
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

    /// Sends `signal` to the process (not yet reaped, so its pid is still
    /// its own).
    pub fn signal(&mut self, signal: i32) {
        if self.exited().is_none() {
            // SAFETY: kill(2) takes no pointers; our child is not reaped.
            unsafe { libc::kill(self.child.id() as i32, signal) };
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

/// How a disk's back-end is started.
pub struct DaemonSpec<'a> {
    pub socket: &'a Path,
    pub image: &'a Path,
    pub readonly: bool,
    pub queues: u16,
    /// Pass `--queues` to ringblk (otherwise its default, 1, is expected).
    pub queues_flag: bool,
    /// Extra `ringblk serve` arguments.
    pub extra: &'a [String],
    /// Where a killed daemon's private directory goes (`TMPDIR`).
    pub dir: &'a Path,
}

/// The backend's command line, and the serial the guest should see.
pub fn daemon_command(spec: &DaemonSpec<'_>, backend: Backend) -> (Command, &'static str) {
    match backend {
        Backend::Ringblk => {
            let mut c = Command::new(ringblk_bin());
            c.arg("serve")
                .arg("--socket")
                .arg(spec.socket)
                .arg("--image")
                .arg(spec.image);
            if spec.readonly {
                c.arg("--readonly");
            }
            if spec.queues_flag {
                c.arg("--queues").arg(spec.queues.to_string());
            }
            c.arg("--serial").arg(SERIAL).args(spec.extra);
            // Killed daemons leave their private directory in the test's.
            c.env("TMPDIR", spec.dir);
            // The relay's ring starts ("inflight region installed") are
            // DEBUG lines; the migration tests count them.
            if std::env::var_os("RUST_LOG").is_none() {
                c.env(
                    "RUST_LOG",
                    "info,virtio_queue=off,ringblk::vhost::relay=debug",
                );
            }
            (c, SERIAL)
        }
        Backend::Qsd => {
            if !spec.extra.is_empty() {
                eprintln!("note: qemu-storage-daemon ignores {:?}", spec.extra);
            }
            let mut c = Command::new(QSD);
            let ro = if spec.readonly { "on" } else { "off" };
            c.arg("--blockdev").arg(format!(
                "driver=file,node-name=f,filename={},discard=unmap,read-only={ro}",
                spec.image.display()
            ));
            c.arg("--export").arg(format!(
                "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},writable={},num-queues={}",
                spec.socket.display(),
                if spec.readonly { "off" } else { "on" },
                spec.queues
            ));
            (c, QSD_SERIAL)
        }
    }
}

/// Waits until `daemon` has created its socket; panics (with its log) if
/// it exits first or takes more than 15 s.
pub fn wait_for_socket(daemon: &mut Guard, socket: &Path, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if fs::metadata(socket).is_ok_and(|m| m.file_type().is_socket()) {
            return;
        }
        if let Ok(Some(status)) = daemon.child.try_wait() {
            panic!(
                "the daemon exited ({status}) before creating {}:\n{}",
                socket.display(),
                read_log(log)
            );
        }
        if Instant::now() > deadline {
            panic!(
                "the daemon created no socket at {} within 15 s:\n{}",
                socket.display(),
                read_log(log)
            );
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// A guest's QEMU command line, up to what differs between guests.
pub struct QemuSpec<'a> {
    pub assets: &'a Assets,
    /// Guest RAM (`-m`, and the size of its shared memfd).
    pub memory: &'a str,
    pub vcpus: u16,
    /// The vhost-user socket.
    pub socket: &'a Path,
    /// `reconnect=1` on the socket's chardev: QEMU waits for a daemon that
    /// went away and reconnects to the next one.
    pub reconnect: bool,
    /// The `-device` argument.
    pub device: &'a str,
    /// The kernel command line.
    pub append: &'a str,
    /// Where the serial console goes.
    pub console: &'a Path,
}

/// Guest memory as QEMU gets it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum GuestMemory {
    /// A memfd backend with share=on: what vhost-user needs.
    Shared,
    /// The same with share=off: QEMU maps it privately.
    Private,
    /// No memory backend at all: anonymous RAM, no fd to pass.
    Anonymous,
}

/// QEMU under TCG with shared memory (vhost-user maps it), the
/// disk, the guest's kernel and initramfs, the serial console in a file,
/// and nothing else; it exits when the guest powers off.
pub fn qemu_command(spec: &QemuSpec<'_>) -> Command {
    qemu_command_with(spec, GuestMemory::Shared)
}

/// [`qemu_command`] with guest memory as `memory` says.
pub fn qemu_command_with(spec: &QemuSpec<'_>, memory: GuestMemory) -> Command {
    let mut cmd = Command::new(QEMU);
    cmd.args(["-accel", "tcg", "-m", spec.memory, "-smp"])
        .arg(spec.vcpus.to_string())
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-monitor",
            "none",
        ]);
    if memory != GuestMemory::Anonymous {
        let share = if memory == GuestMemory::Shared {
            "on"
        } else {
            "off"
        };
        cmd.arg("-object")
            .arg(format!(
                "memory-backend-memfd,id=mem,size={},share={share}",
                spec.memory
            ))
            .args(["-numa", "node,memdev=mem"]);
    }
    cmd.arg("-chardev")
        .arg(format!(
            "socket,id=c0,path={}{}",
            spec.socket.display(),
            if spec.reconnect { ",reconnect=1" } else { "" }
        ))
        .arg("-device")
        .arg(spec.device)
        .arg("-kernel")
        .arg(&spec.assets.kernel)
        .arg("-initrd")
        .arg(&spec.assets.initrd)
        .arg("-append")
        .arg(spec.append)
        .arg("-serial")
        .arg(format!("file:{}", spec.console.display()))
        .arg("-no-reboot");
    cmd
}

/// 1 MiB of 32-byte records `rbpat NONCE %016d\n`, as `init.sh` makes it.
pub fn pattern(nonce: &str) -> Vec<u8> {
    assert_eq!(nonce.len(), 8);
    let mut out = Vec::with_capacity(PATTERN_LEN);
    for k in 0..PATTERN_LEN / 32 {
        writeln!(out, "rbpat {nonce} {k:016}").expect("writing to a Vec");
    }
    assert_eq!(out.len(), PATTERN_LEN);
    out
}

/// Writes the host's pattern for `nonce` into the image, synced.
pub fn write_host_pattern(image: &Path, nonce: &str) -> Vec<u8> {
    let host_pattern = pattern(nonce);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .open(image)
        .expect("open the image");
    f.seek(SeekFrom::Start(HOST_PATTERN_AT))
        .expect("seek image");
    f.write_all(&host_pattern).expect("write host pattern");
    f.sync_all().expect("sync image");
    host_pattern
}

/// A problem unless the guest's pattern (as `init.sh` writes it at
/// `GUEST_PATTERN_AT`) is in the image file.
pub fn check_guest_pattern(image: &Path, want: &[u8]) -> Option<String> {
    let got = read_at(image, GUEST_PATTERN_AT, PATTERN_LEN);
    let at = got.iter().zip(want).position(|(a, b)| a != b)?;
    let record = at - at % 32;
    Some(format!(
        "host: the guest's pattern is not in the image at {GUEST_PATTERN_AT}: \
         first difference at +{at}: {:?}",
        String::from_utf8_lossy(&got[record..record + 32])
    ))
}

pub fn read_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut f = File::open(path).expect("open image");
    f.seek(SeekFrom::Start(offset)).expect("seek image");
    let mut buf = vec![0; len];
    f.read_exact(&mut buf).expect("read image");
    buf
}

pub fn read_log(path: &Path) -> String {
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_else(|e| format!("<cannot read {}: {e}>", path.display()))
}

/// A fresh 8-hex-digit marker for one boot's patterns.
pub fn new_nonce() -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let n = (t.as_nanos() as u32)
        ^ std::process::id().rotate_left(16)
        ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(8);
    format!("{n:08x}")
}

/// What the guest printed.
#[derive(Default)]
pub struct Verdict {
    pub passed: Vec<String>,
    pub failed: Vec<String>,
    pub done: bool,
}

impl Verdict {
    pub fn passed(&self, name: &str) -> bool {
        self.passed.iter().any(|p| p == name)
    }

    /// A problem for each failed check and each expected one that is
    /// missing (whether the guest finished is the caller's to check).
    pub fn problems(&self, expected: &[&str]) -> Vec<String> {
        let mut problems = Vec::new();
        for f in &self.failed {
            problems.push(format!("guest check failed: {f}"));
        }
        for name in expected {
            let failed = self
                .failed
                .iter()
                .any(|f| f.split(' ').next() == Some(name));
            if !failed && !self.passed(name) {
                problems.push(format!("guest check missing: {name}"));
            }
        }
        problems
    }
}

/// The checks every guest makes at boot, before its own (names printed by
/// `init.sh`).
pub const BOOT_CHECKS: &[&str] = &[
    "device",
    "size",
    "serial",
    "queues",
    "ro-flag",
    "host-pattern",
];

/// Checks every read-write boot (`ringblk.test=rw`) must pass after
/// [`BOOT_CHECKS`].
pub const RW_CHECKS: &[&str] = &[
    "fio-verify",
    "fio-jobs",
    "queues-used",
    "discard",
    "zeroout",
    "large-io",
    "guest-pattern",
];

/// The problems of a guest's run: how its QEMU (`which`) ended, whether
/// the guest finished, and its checks against `expected`.
pub fn run_problems(
    which: &str,
    status: Option<std::process::ExitStatus>,
    timeout: Duration,
    verdict: &Verdict,
    expected: &[&str],
) -> Vec<String> {
    let mut problems = Vec::new();
    match status {
        None => problems.push(format!(
            "{which} did not finish within {timeout:?} (killed)"
        )),
        Some(s) if !s.success() => problems.push(format!("{which} exited with {s}")),
        Some(_) => {}
    }
    if !verdict.done {
        problems.push(format!("the guest never printed RINGBLK-DONE ({which})"));
    }
    problems.extend(verdict.problems(expected));
    problems
}

pub fn parse_console(console: &str) -> Verdict {
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

/// The value of a `RINGBLK-INFO <key> <value>` line of the console.
pub fn console_info<'a>(console: &'a str, key: &str) -> Option<&'a str> {
    console
        .lines()
        .filter_map(|l| l.trim().strip_prefix("RINGBLK-INFO ")?.strip_prefix(key))
        .filter_map(|rest| rest.strip_prefix(' '))
        .map(str::trim)
        .next_back()
}

/// Where each thread of a process is, for a hang report: state, kernel
/// wait channel and stack from /proc, and the user stacks if gdb is there.
pub fn threads_of(pid: u32) -> String {
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
    if let Ok(o) = gdb
        && o.status.success()
    {
        let text = String::from_utf8_lossy(&o.stdout);
        out.push_str("  user stacks (gdb):\n");
        for line in text
            .lines()
            .filter(|l| l.starts_with('#') || l.starts_with("Thread"))
        {
            out.push_str(&format!("    {line}\n"));
        }
    }
    out
}

/// Waits until the guest's console (the file `console`) says `what`;
/// false if the guest finished (`RINGBLK-DONE`) or `deadline` passed
/// first.
pub fn wait_for_console(console: &Path, what: &str, deadline: Instant) -> bool {
    loop {
        let log = read_log(console);
        if log.contains(what) {
            return true;
        }
        if log.contains("RINGBLK-DONE") || Instant::now() > deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// Kills `daemon` (serving `socket`) with requests in flight and starts it
/// again with `restart`, at most `kills` times, until the console says
/// `until` (the guest's step under the kills is over). Each round first
/// waits 1.5 s: long enough for QEMU, which retries once a second, to
/// reconnect and for the guest to write against each new daemon. Returns
/// how many kills happened.
pub fn kill_under_guest(
    daemon: &mut Guard,
    socket: &Path,
    console: &Path,
    until: &str,
    kills: u32,
    mut restart: impl FnMut() -> Guard,
) -> u32 {
    let mut done = 0;
    while done < kills {
        thread::sleep(Duration::from_millis(1500));
        if read_log(console).contains(until) {
            break;
        }
        kill_with_requests_in_flight(daemon.pid() as i32, socket, Duration::from_secs(2));
        daemon.wait_for(Duration::from_secs(20));
        *daemon = restart();
        done += 1;
    }
    done
}

/// SIGKILLs the daemon at a moment when its inflight log shows requests
/// taken off the ring and not completed, so the restart must resubmit
/// them: the daemon is stopped (SIGSTOP), the log read through QEMU's
/// descriptor of it, and the daemon killed if the log is not empty, else
/// let go (SIGCONT) and tried again. After `within` it is killed
/// regardless.
pub fn kill_with_requests_in_flight(pid: i32, socket: &Path, within: Duration) {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        // QEMU makes the region as it starts the device: a QEMU that has
        // not yet (a migration's destination, just resumed) has none, and
        // killing the daemon while the device starts is not this test.
        let Some(path) = inflight_log_of_qemu_using(socket) else {
            thread::sleep(Duration::from_millis(20));
            continue;
        };
        // SAFETY: signals to our own child; waitpid with WUNTRACED reports
        // it stopped without reaping it.
        let stopped = unsafe {
            libc::kill(pid, libc::SIGSTOP);
            let mut status = 0;
            libc::waitpid(pid, &mut status, libc::WUNTRACED) == pid && libc::WIFSTOPPED(status)
        };
        if stopped && fs::read(&path).is_ok_and(|bytes| logged_in_flight(&bytes)) {
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

/// Resubmissions the daemon's log reports after restarts (`resubmitting N`).
pub fn resubmitted_in(log: &str) -> u32 {
    log.lines()
        .filter_map(|l| l.split("resubmitting ").nth(1))
        .filter_map(|r| r.split(' ').next()?.parse::<u32>().ok())
        .sum()
}
