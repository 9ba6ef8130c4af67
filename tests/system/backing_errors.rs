//! Errors from the backing store: a write the image's file system cannot
//! take (ENOSPC) fails that request with VIRTIO_BLK_S_IOERR, is logged at
//! a limited rate, is counted (`ringblk_errors_total{status="ioerr"}`),
//! and the daemon goes on serving everything else.
//!
//! The image is a 64 MiB sparse file on a 1 MiB tmpfs, so the guest-visible
//! disk is far larger than the space behind it (a thin-provisioned pool
//! running dry). Needs root for the mount; skipped otherwise, except
//! where `CI` is set: there it fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ringblk_testkit::{
    Client, Daemon, DaemonOptions, KIB, MIB, assert_pattern, is_root, metric, pattern, skip,
    sparse_image, test_dir,
};

/// A tmpfs mounted for the test, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Result<Tmpfs, String> {
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={size},mode=0755"))
            .arg("tmpfs")
            .arg(dir)
            .output()
            .map_err(|e| format!("running mount: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        Ok(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // A dead process's io_uring releases its files asynchronously, so
        // the mount can stay busy for a moment.
        for _ in 0..50 {
            let unmounted = Command::new("umount")
                .arg(&self.0)
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if unmounted {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

const CHUNK: usize = 64 * 1024;
const ALLOCATED: usize = 512 * 1024;
/// How many writes beyond the space the tmpfs has.
const OVERFLOW_WRITES: u64 = 64;

#[test]
fn enospc_fails_the_request_and_the_daemon_goes_on() {
    let dir = test_dir();
    let mnt = dir.path().join("small");
    std::fs::create_dir(&mnt).expect("mount point");
    if !is_root() {
        skip("mounting a tmpfs needs root");
        return;
    }
    let _fs = match Tmpfs::mount(&mnt, "1M") {
        Ok(m) => m,
        Err(e) => {
            skip(&format!("cannot mount a tmpfs ({e})"));
            return;
        }
    };
    let image = sparse_image(&mnt, "disk.img", 64 * MIB);
    // Declared after the mount guard: killed before the unmount.
    let mut d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            image: Some(image),
            metrics: true,
            ..DaemonOptions::default()
        },
    );
    let mut c = Client::connect(&d.socket, ALLOCATED);

    // Half of the tmpfs, allocated while there is room.
    assert_eq!(c.write(0, &pattern(1, 0, ALLOCATED)), 0, "first write");
    assert_eq!(c.flush(), 0, "flush");

    // 4 MiB more, 64 KiB at a time: the first few fit, the rest cannot.
    let mut failed = 0u64;
    for i in 0..OVERFLOW_WRITES {
        let off = MIB + i * CHUNK as u64;
        match c.write(off, &pattern(2, off, CHUNK)) {
            0 => {}
            r if r == -libc::EIO => failed += 1,
            r => panic!("write at {off} completed with {r}, expected 0 or -EIO"),
        }
    }
    assert!(
        failed >= OVERFLOW_WRITES - 16,
        "only {failed} of {OVERFLOW_WRITES} writes beyond the tmpfs failed"
    );
    d.assert_running();
    let ioerr = |d: &Daemon| {
        metric(
            &d.scrape_metrics(),
            "ringblk_errors_total{queue=\"0\",status=\"ioerr\"}",
        )
    };
    assert_eq!(ioerr(&d), failed, "counted I/O errors");

    // Everything else still works: reads, and writes to allocated space.
    assert_pattern("allocated data", 1, 0, &c.read(0, ALLOCATED));
    assert!(
        c.read(32 * MIB, CHUNK).iter().all(|b| *b == 0),
        "hole not zero"
    );
    assert_eq!(c.write(0, &pattern(3, 0, ALLOCATED)), 0, "rewrite");
    assert_pattern("rewritten data", 3, 0, &c.read(0, ALLOCATED));
    assert_eq!(c.flush(), 0, "flush after errors");
    d.assert_running();

    // The failures were logged, but at a limited rate.
    let failures_logged = |log: &str| {
        log.lines()
            .filter(|l| l.contains("Write") && l.contains("failed"))
            .count() as u64
    };
    let log = d.log();
    let logged = failures_logged(&log);
    assert!(
        log.contains("No space left on device") || log.contains("short transfer"),
        "no ENOSPC in the log:\n{log}"
    );
    assert!(
        (1..=20).contains(&logged) && logged < failed,
        "{logged} failure lines for {failed} failures:\n{log}"
    );

    // After the limiter's period, the next failure reports what was dropped.
    std::thread::sleep(Duration::from_millis(5200));
    let off = 40 * MIB + 512 * KIB;
    assert_eq!(c.write(off, &pattern(4, off, CHUNK)), -libc::EIO);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !d.log().contains("similar messages suppressed") {
        assert!(
            std::time::Instant::now() < deadline,
            "no count of suppressed messages:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(ioerr(&d), failed + 1, "counted I/O errors");
    drop(c);
    d.assert_running();
}
