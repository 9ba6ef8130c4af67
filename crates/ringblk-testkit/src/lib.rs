//! ringblk's test kit: what the integration tests of the daemon
//! (`tests/socket`, `tests/layers`, `tests/system`, `tests/guest`,
//! `tests/rbd`) and of `crates/ringblk-bench` share, compiled once
//! (cloud-hypervisor keeps its `test_infra` crate the same way):
//!
//! - [`Daemon`]: a `ringblk serve` process on a private socket and image,
//!   killed when dropped, with a watchdog;
//! - [`Client`]: a small synchronous vhost-user-blk client on libblkio;
//! - [`frontend`]: a hand-written vhost-user front-end that can send what
//!   libblkio never would;
//! - [`vm`]: real guests under QEMU (kernel, initramfs, console verdict,
//!   QMP), and [`vm::migration`], a guest migrated between two daemons;
//! - [`ceph`]: a single-node Ceph cluster for the RBD tests;
//! - [`nbd`]: the backup's clients (nbdinfo, nbdcopy, qemu-img) and verbs;
//! - [`qemu_img`]: qemu-img as the oracle for image files;
//! - [`luks`]: LUKS images by cryptsetup and qemu-img, and an independent
//!   decrypt of their payload;
//! - the host's side: patterns, images, loop devices, metrics.
//!
//! A dev-dependency only: the daemon itself links none of it
//! (`scripts/test.sh` checks `cargo tree -e normal -p ringblk`).
//!
//! Where it finds things: the daemon is the `ringblk` that Cargo built
//! next to the running test binary ([`ringblk_bin`]); scratch files go
//! under the target directory ([`tmp_dir`]), not `/tmp`, which may be a
//! tmpfs without O_DIRECT; the scripts come from the workspace
//! ([`workspace_root`]).
//!
//! Everything has a deadline: a daemon that does not come up, a request
//! that does not complete, or a test that hangs on the daemon fails instead
//! of hanging.

pub mod ceph;
mod client;
mod ctl;
mod daemon;
pub mod frontend;
pub mod luks;
pub mod nbd;
pub mod qemu_img;
pub mod vm;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tempfile::TempDir;

pub use client::{Client, Op, Sustained, chunked};
pub use ctl::{ctl, ctl_fails, ctl_ok};
pub use daemon::{Daemon, DaemonOptions, serve_refused};

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

/// Any single request or batch of [`Client`], flushes included, and a
/// metrics scrape.
const IO_TIMEOUT: Duration = Duration::from_secs(20);

/// The workspace's root directory (`scripts/`, `tests/`, `fuzz/`): two
/// levels above this crate.
pub fn workspace_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let kit = Path::new(env!("CARGO_MANIFEST_DIR"));
        let root = kit
            .ancestors()
            .nth(2)
            .expect("crates/ringblk-testkit has a grandparent");
        assert!(
            root.join("Cargo.toml").is_file() && root.join("scripts").is_dir(),
            "no workspace at {}",
            root.display()
        );
        root.to_path_buf()
    })
}

/// Where Cargo put the running test binary's profile, e.g. `target/debug`:
/// a test binary runs from its `deps/` (the daemon's and the bench's
/// alike), and the binaries Cargo built sit one level up.
fn profile_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test binary's path");
        let deps = exe.parent().expect("the test binary's directory");
        assert!(
            deps.file_name().is_some_and(|n| n == "deps"),
            "the test binary {} is not in a Cargo target's deps/: run it with `cargo test`",
            exe.display()
        );
        deps.parent().expect("deps/ has a parent").to_path_buf()
    })
}

/// The daemon binary: the `ringblk` Cargo built next to the running test
/// binary. For the daemon's own tests that is `CARGO_BIN_EXE_ringblk`
/// (`tests/socket` checks that they agree); the tests of
/// `crates/ringblk-bench` need it built too, which `cargo test --workspace`
/// does.
pub fn ringblk_bin() -> PathBuf {
    let bin = profile_dir().join("ringblk");
    assert!(
        bin.is_file(),
        "no daemon at {}: run the tests with `cargo test --workspace`, or `cargo build -p ringblk` first",
        bin.display()
    );
    bin
}

/// The kit's scratch directory, `target/tmp` (where `CARGO_TARGET_TMPDIR`
/// points in the tests of a plain `cargo test`): on the file system of the
/// build, not a tmpfs. Created if missing.
pub fn tmp_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let target = profile_dir()
            .parent()
            .expect("the profile directory has a parent");
        let dir = target.join("tmp");
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        dir
    })
}

/// A fresh directory for one test's socket, image and metrics socket.
pub fn test_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("ringblk-")
        .tempdir_in(tmp_dir())
        .unwrap_or_else(|e| {
            panic!(
                "creating a temporary directory in {}: {e}",
                tmp_dir().display()
            )
        })
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

/// Says why a test cannot run on this machine, for the test to return
/// (skip) next. Where `CI` is set, fails the test instead: CI provides
/// what the tests need (root, loop devices, QEMU), so a test that cannot
/// run there is a failure, never a silent pass.
#[track_caller]
pub fn skip(why: &str) {
    assert!(
        std::env::var_os("CI").is_none(),
        "cannot run where CI is set: {why}"
    );
    eprintln!("skipped: {why}");
}

/// The bytes of the test pattern at absolute offset `off`: every 8-byte
/// word holds its own offset xor `seed`, so misplaced data is caught.
pub fn pattern(seed: u64, off: u64, len: usize) -> Vec<u8> {
    assert!(off.is_multiple_of(8) && len.is_multiple_of(8));
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

/// A loop device over a file, detached when dropped.
pub struct LoopDevice(pub PathBuf);

impl LoopDevice {
    /// `losetup --find --show` with `sector_size`-byte logical blocks.
    /// The error is losetup's.
    ///
    /// One attach at a time in this process: `losetup --find` races with
    /// itself, and the tests of one binary run on parallel threads.
    pub fn attach(file: &Path, sector_size: u32) -> Result<LoopDevice, String> {
        static LOSETUP: Mutex<()> = Mutex::new(());
        let _guard = LOSETUP.lock().unwrap_or_else(|p| p.into_inner());
        let out = Command::new("losetup")
            .arg("--find")
            .arg("--show")
            .arg(format!("--sector-size={sector_size}"))
            .arg(file)
            .output()
            .map_err(|e| format!("losetup: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        Ok(LoopDevice(PathBuf::from(
            String::from_utf8_lossy(&out.stdout).trim(),
        )))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}
