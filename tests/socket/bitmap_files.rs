//! The sidecar files of a raw image's bitmaps (`disk.img.bitmap.NAME`,
//! docs/backup.md) when something else has been at them (issue 29): a
//! file that exists but cannot be opened stops the start with one line
//! naming it (it used to leave the image silently untracked), a file
//! truncated under the daemon does not kill it (SIGBUS), and a header
//! that claims a huge disk costs nothing of its claim (it used to be
//! allocated, or abort the start). The other user of the realistic
//! EACCES case (sidecars made as root) is in `system::unprivileged`.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use ringblk_testkit::nbd::bitmap_state;
use ringblk_testkit::{
    Client, Daemon, DaemonOptions, KIB, MIB, ctl_ok, is_root, pattern, serve_refused, skip,
    sparse_image, test_dir,
};

const SIZE: u64 = 32 * MIB;

/// A daemon with `--api DIR/api.sock` serving `DIR/disk.img` (made when
/// missing).
fn start(dir: &Path) -> Daemon {
    let image = dir.join("disk.img");
    if !image.exists() {
        sparse_image(dir, "disk.img", SIZE);
    }
    let api = dir.join("api.sock");
    Daemon::start_in(
        dir,
        DaemonOptions {
            image: Some(image),
            args: &["--api", api.to_str().unwrap()],
            ..DaemonOptions::default()
        },
    )
}

fn stop(mut d: Daemon) {
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert!(st.success(), "the daemon exited with {st}:\n{}", d.log());
}

/// `DIR/disk.img.bitmap.NAME`, made by a daemon (`bitmap add`) and
/// written out by its clean stop.
fn made_by_a_daemon(dir: &Path, name: &str) -> std::path::PathBuf {
    let d = start(dir);
    ctl_ok(&dir.join("api.sock"), &["bitmap", "add", name]);
    stop(d);
    let path = dir.join(format!("disk.img.bitmap.{name}"));
    assert!(path.is_file());
    path
}

/// Starts `serve` on `DIR/disk.img` (through `wrapper`, if any) and
/// expects a refusal within 20 s (a FIFO opened blocking would hang it;
/// a start without the bitmaps would serve): one line that names `file`
/// and says `fix`.
fn refused(dir: &Path, wrapper: &[&str], file: &str, fix: &str) {
    let image = dir.join("disk.img");
    let line = serve_refused(dir, wrapper, &["--image", image.to_str().unwrap()]);
    assert!(
        line.contains(file) && line.contains(fix),
        "{line:?} does not name {file} and say {fix:?}"
    );
}

/// A FIFO, a directory, a dangling symlink, or an unreadable bitmap
/// (mode 000, the daemon without the capabilities that override it)
/// named as a sidecar: the start stops with one line naming it, at once.
/// Each of them used to start a daemon that tracked nothing and said
/// nothing; the readable bitmap then loaded as consistent, missing every
/// change made meanwhile.
#[test]
fn a_sidecar_that_cannot_be_opened_stops_the_start() {
    let dir = test_dir();
    let d = dir.path();
    sparse_image(d, "disk.img", SIZE);
    let path = d.join("disk.img.bitmap.b");
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    refused(d, &[], "disk.img.bitmap.b", "a FIFO");
    std::fs::remove_file(&path).unwrap();

    std::fs::create_dir(&path).unwrap();
    refused(d, &[], "disk.img.bitmap.b", "a directory");
    std::fs::remove_dir(&path).unwrap();

    std::os::unix::fs::symlink(d.join("gone"), &path).unwrap();
    refused(d, &[], "disk.img.bitmap.b", "a symbolic link");
    std::fs::remove_file(&path).unwrap();

    let path = made_by_a_daemon(d, "locked");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o000)).unwrap();
    // Root reads a file of mode 000 all the same: the daemon runs
    // without the capabilities that let it.
    let wrapper: &[&str] = if is_root() {
        if Command::new("setpriv").arg("--version").output().is_err() {
            skip("setpriv (util-linux) is not installed");
            return;
        }
        &[
            "setpriv",
            "--bounding-set=-dac_override,-dac_read_search",
            "--",
        ]
    } else {
        &[]
    };
    refused(d, wrapper, "disk.img.bitmap.locked", "chmod 0600");
    // Readable again: it loads as it was (consistent: nothing wrote the
    // image while the daemon did not start).
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let daemon = start(d);
    assert_eq!(bitmap_state(&d.join("api.sock"), "locked"), Some((0, true)));
    stop(daemon);
}

/// The sidecar truncated to 0 while the daemon has it mapped, then a
/// write (which marks the first page of the bits) and a `bitmap list`
/// (which counts every word, the second page too): the daemon lives (a
/// SIGBUS used to kill it at either), says the bitmap is inconsistent,
/// in an ERROR line too, and its clean stop writes the file out whole,
/// so that the next start loads it inconsistent, with the changes made
/// since.
#[test]
fn a_sidecar_truncated_under_the_daemon_is_survived_and_distrusted() {
    // 512-byte granules: the 32 MiB disk's bits are two pages.
    const SMALL: u64 = 512;
    let dir = test_dir();
    let d = dir.path();
    let api = d.join("api.sock");
    let mut daemon = start(d);
    let mut c = Client::connect(&daemon.socket, MIB as usize);
    ctl_ok(&api, &["bitmap", "add", "t", "--granularity", "512"]);
    assert_eq!(c.write(SIZE - 4096, &pattern(1, SIZE - 4096, 4096)), 0);
    let path = d.join("disk.img.bitmap.t");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();

    assert_eq!(c.write(0, &pattern(2, 0, 4096)), 0);
    daemon.assert_running();
    let (dirty, consistent) = bitmap_state(&api, "t").expect("the bitmap is listed");
    assert!(!consistent, "consistent after its file was truncated");
    assert_eq!(dirty, 4096 / SMALL * SMALL, "the change made since");
    assert_eq!(c.write(SIZE - 512, &pattern(3, SIZE - 512, 512)), 0);
    assert_eq!(bitmap_state(&api, "t"), Some((4096 + 512, false)));
    daemon.assert_running();
    let log = daemon.log();
    assert!(
        log.lines().any(|l| l.contains("ERROR")
            && l.contains("disk.img.bitmap.t")
            && l.contains("truncated")),
        "{log}"
    );
    drop(c);
    stop(daemon);
    assert!(
        std::fs::metadata(&path).unwrap().len() >= 4096 + SIZE / SMALL / 8,
        "not written out whole"
    );

    let daemon = start(d);
    assert_eq!(
        bitmap_state(&api, "t"),
        Some((4096 + 512, false)),
        "the next start: inconsistent, with the changes since"
    );
    stop(daemon);
}

/// The peak resident memory of a daemon, in KiB.
fn peak_kib(d: &Daemon) -> u64 {
    let hwm = d.proc_status(None, "VmHWM").expect("VmHWM");
    hwm.trim_end_matches("kB")
        .trim()
        .parse()
        .expect("a number of kB")
}

/// A sidecar whose header claims a huge disk (the bits of 1 GiB, 64 GiB,
/// and a 1 EiB disk, the file as long as the header needs, sparse; and
/// the 1 EiB header in a file of 8 KiB): the start reads no more than
/// this disk's bits, its peak memory stays that of a daemon, and the
/// bitmap is listed inconsistent (resized to this disk). The 1 GiB claim
/// used to cost 1 GiB of memory, the 64 GiB one aborted every start, and
/// the short file was refused.
#[test]
fn a_header_claiming_a_huge_disk_costs_nothing() {
    let dir = test_dir();
    let d = dir.path();
    let api = d.join("api.sock");
    let path = made_by_a_daemon(d, "h");
    let good = std::fs::read(&path).unwrap();
    // Granularity 64 KiB: 2^19 disk bytes per byte of bits.
    for (what, disk, long) in [
        ("1 GiB of bits", 1u64 << 49, true),
        ("64 GiB of bits", 1 << 55, true),
        ("a 1 EiB disk", 1 << 60, true),
        ("a 1 EiB disk in 8 KiB", 1 << 60, false),
    ] {
        let mut raw = good.clone();
        raw[16..24].copy_from_slice(&disk.to_le_bytes());
        let bits = disk / (64 * KIB) / 8;
        raw[40..48].copy_from_slice(&bits.to_le_bytes());
        std::fs::write(&path, &raw).unwrap();
        if long {
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            f.set_len(4096 + bits).unwrap();
        }
        let daemon = start(d);
        let peak = peak_kib(&daemon);
        assert_eq!(
            bitmap_state(&api, "h"),
            Some((0, false)),
            "{what}: resized to this disk, inconsistent"
        );
        // Loaded for a front-end: the file is mapped at this disk's size.
        let c = Client::connect(&daemon.socket, MIB as usize);
        assert_eq!(bitmap_state(&api, "h"), Some((0, false)), "{what}");
        let peak = peak.max(peak_kib(&daemon));
        assert!(peak < 256 * 1024, "{what}: a peak of {peak} KiB");
        assert!(daemon.log().contains("resized"), "{what}: {}", daemon.log());
        drop(c);
        stop(daemon);
    }
}
