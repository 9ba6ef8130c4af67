//! Dirty bitmaps and point-in-time backups through the daemon (issue 23):
//! a libblkio client writes, `ringblk ctl` drives the verbs, and clients no
//! one here wrote read the export: libnbd's `nbdinfo` and `nbdcopy`, and
//! `qemu-img`, as docs/backup.md's procedure runs them.
//!
//! The reference for "the disk at the instant" is the image file read on
//! the host while no write is in flight (every write acknowledged); the
//! reference for a bitmap is the test's own list of what it wrote,
//! widened to the granularity (`nbd::granules`).
//!
//! The tools come from scripts/nbd-tools.sh (scripts/test.sh runs it; so
//! does the kit when they are missing and it may). Without them a test
//! skips, except where `CI` is set: there it fails.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ringblk_testkit::nbd::{self, backup_start, bitmap_state, dirty, granules, raw};
use ringblk_testkit::qemu_img::create_qcow2;
use ringblk_testkit::{
    Client, Daemon, DaemonOptions, KIB, MIB, ctl_fails, ctl_ok, pattern, read_file, test_dir,
};

const SIZE: u64 = 32 * MIB;
const GRAN: u64 = 64 * KIB;
const BUF: usize = 4 * MIB as usize;

/// A daemon with `--api DIR/api.sock --backup-dir DIR/backups`, serving
/// `DIR/disk.img` (created when missing).
fn start(dir: &Path, extra: &[&str]) -> Daemon {
    let backups = dir.join("backups");
    std::fs::create_dir_all(&backups).unwrap();
    let image = dir.join("disk.img");
    if !image.exists() {
        ringblk_testkit::sparse_image(dir, "disk.img", SIZE);
    }
    let api = dir.join("api.sock");
    let mut args = vec![
        "--api",
        api.to_str().unwrap(),
        "--backup-dir",
        backups.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Daemon::start_in(
        dir,
        DaemonOptions {
            image: Some(image),
            args: &args,
            ..DaemonOptions::default()
        },
    )
}

fn stop(mut d: Daemon) {
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert!(st.success(), "the daemon exited with {st}:\n{}", d.log());
}

/// Writes pattern `seed` over `[off, off + len)` in chunks of `BUF`.
fn write_pattern(c: &mut Client, seed: u64, off: u64, len: u64) {
    let mut at = off;
    while at < off + len {
        let n = (off + len - at).min(BUF as u64) as usize;
        assert_eq!(c.write(at, &pattern(seed, at, n)), 0, "write at {at}");
        at += n as u64;
    }
}

/// The changes of a round: writes, a discard and a write-zeroes, at
/// offsets that straddle granules; `(offset, length)` of each.
fn scattered(c: &mut Client, seed: u64, base: u64) -> Vec<(u64, u64)> {
    let mut done = Vec::new();
    for (i, (off, len)) in [
        (base + 4 * KIB, 4 * KIB),
        (base + 3 * MIB - 4 * KIB, 12 * KIB),
        (base + 7 * MIB + 512, 130 * KIB),
        (base + 9 * MIB, 2 * MIB + 4 * KIB),
    ]
    .into_iter()
    .enumerate()
    {
        let off = off / 512 * 512;
        let len = len.div_ceil(512) * 512;
        assert_eq!(
            c.write(off, &pattern(seed + i as u64, off, len as usize)),
            0
        );
        done.push((off, len));
    }
    assert_eq!(c.discard(base + 12 * MIB, GRAN), 0);
    done.push((base + 12 * MIB, GRAN));
    assert_eq!(c.write_zeroes(base + 14 * MIB + 8 * KIB, 8 * KIB), 0);
    done.push((base + 14 * MIB + 8 * KIB, 8 * KIB));
    done
}

fn bytes(ranges: &[(u64, u64)]) -> u64 {
    ranges.iter().map(|r| r.1).sum()
}

/// `nbdcopy` of the export into `dest`, started in the background.
fn nbdcopy(sock: &Path, dest: &Path) -> std::process::Child {
    Command::new("nbdcopy")
        .arg(nbd::uri(sock))
        .arg(dest)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nbdcopy")
}

fn wait_ok(child: std::process::Child, what: &str) {
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Asserts two files are equal, naming the first differing offset.
#[track_caller]
fn assert_same(what: &str, a: &Path, b: &Path) {
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert_eq!(x.len(), y.len(), "{what}: lengths");
    if let Some(i) = x.iter().zip(&y).position(|(p, q)| p != q) {
        panic!(
            "{what}: {} and {} differ first at byte {i}",
            a.display(),
            b.display()
        );
    }
}

/// add, list (table and JSON), `ctl status`, the marks of writes, discards
/// and write-zeroes at two granularities, remove; refusals are one line.
#[test]
fn bitmaps_are_added_listed_and_removed() {
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let d = start(dir.path(), &[]);
    let api = dir.path().join("api.sock");
    ctl_ok(&api, &["bitmap", "add", "nightly"]);
    ctl_ok(&api, &["bitmap", "add", "weekly", "--granularity", "1M"]);
    assert_eq!(bitmap_state(&api, "nightly"), Some((0, true)));
    assert_eq!(bitmap_state(&api, "weekly"), Some((0, true)));

    let mut c = Client::connect(&d.socket, BUF);
    let changed = scattered(&mut c, 7, 0);
    assert_eq!(
        bitmap_state(&api, "nightly"),
        Some((bytes(&granules(&changed, GRAN, SIZE)), true))
    );
    assert_eq!(
        bitmap_state(&api, "weekly"),
        Some((bytes(&granules(&changed, MIB, SIZE)), true))
    );
    // Reads mark nothing.
    let _ = c.read(20 * MIB, 64 * KIB as usize);
    assert_eq!(
        bitmap_state(&api, "nightly").unwrap().0,
        bytes(&granules(&changed, GRAN, SIZE))
    );

    let table = ctl_ok(&api, &["bitmap", "list"]);
    assert!(
        table.contains("NAME") && table.contains("nightly"),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("weekly") && l.ends_with("yes"))
    );
    let status: serde_json::Value = serde_json::from_str(&ctl_ok(&api, &["status"])).unwrap();
    let names: Vec<&str> = status["bitmaps"]
        .as_array()
        .expect("status lists bitmaps")
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["nightly", "weekly"]);

    ctl_fails(&api, &["bitmap", "add", "nightly"], "already exists");
    ctl_fails(
        &api,
        &["bitmap", "add", "odd", "--granularity", "3000"],
        "power of two",
    );
    ctl_fails(&api, &["bitmap", "remove", "nope"], "no bitmap 'nope'");
    ctl_ok(&api, &["bitmap", "remove", "weekly"]);
    assert_eq!(bitmap_state(&api, "weekly"), None);
    assert!(
        !dir.path().join("disk.img.bitmap.weekly").exists(),
        "the removed bitmap's sidecar stays: {:?}",
        std::fs::read_dir(dir.path()).unwrap().collect::<Vec<_>>()
    );
    drop(c);
    stop(d);
}

/// A full backup while the guest overwrites the disk: the copy (nbdcopy
/// and qemu-img both) is the disk at `backup start`, byte for byte; the
/// socket is 0600; `base:allocation` says where the data is.
#[test]
fn a_full_backup_under_writes_is_the_instant() {
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let d = start(dir.path(), &[]);
    let api = dir.path().join("api.sock");
    let mut c = Client::connect(&d.socket, BUF);
    // Pattern A over the first 24 MiB; the rest a hole.
    write_pattern(&mut c, 0xa, 0, 24 * MIB);
    assert_eq!(c.flush(), 0);
    let at_start = dir.path().join("at-start.raw");
    std::fs::copy(&d.image, &at_start).unwrap();

    let sock = backup_start(&api, &dir.path().join("backups"), "full.sock", None);
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the NBD socket's mode");
    ctl_fails(
        &api,
        &["backup", "start", "--nbd", "second.sock"],
        "a backup is running",
    );

    // B over everything while nbdcopy copies; then B again behind it.
    let copy = dir.path().join("copy.raw");
    let running = nbdcopy(&sock, &copy);
    write_pattern(&mut c, 0xb, 0, SIZE);
    wait_ok(running, "nbdcopy");
    write_pattern(&mut c, 0xc, 8 * MIB, 8 * MIB);
    let converted = dir.path().join("copy.qcow2");
    nbd::convert_qcow2(&sock, &converted);
    let restored = dir.path().join("restored.raw");
    nbd::restore(&converted, &restored);

    assert_same("nbdcopy of the export", &copy, &at_start);
    assert_same("qemu-img convert of the export", &restored, &at_start);
    // The guest's disk has B and C: the export did not leak into it.
    assert!(read_file(&d.image, 0, 4096) == pattern(0xb, 0, 4096));
    assert!(read_file(&d.image, 8 * MIB, 4096) == pattern(0xc, 8 * MIB, 4096));

    let info: serde_json::Value =
        serde_json::from_str(&ctl_ok(&api, &["backup", "status"])).unwrap();
    assert!(info["copied_clusters"].as_u64().unwrap() > 0, "{info}");
    let out = ctl_ok(&api, &["backup", "stop"]);
    assert!(out.starts_with("backup stopped"), "{out}");
    assert!(!sock.exists(), "the socket is removed at stop");
    ctl_fails(&api, &["backup", "stop"], "no backup is running");
    drop(c);
    stop(d);
}

/// Full backup, more writes, incremental: the dirty map lists every change
/// and nothing else beyond the granularity; the full backup with the
/// incremental one on top, restored with qemu-img, is the disk at the
/// second `backup start`. The bitmap keeps what a backup exports until
/// `backup stop`, and then only what came after the instant.
#[test]
fn an_incremental_backup_holds_every_change_and_nothing_else() {
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let d = start(dir.path(), &[]);
    let api = dir.path().join("api.sock");
    let backups = dir.path().join("backups");
    ctl_ok(&api, &["bitmap", "add", "inc"]);
    let mut c = Client::connect(&d.socket, BUF);
    write_pattern(&mut c, 1, 0, 16 * MIB);

    // Full: with the bitmap, so that it starts afresh now.
    let sock = backup_start(&api, &backups, "b.sock", Some("inc"));
    assert_eq!(
        dirty(&sock, "inc"),
        granules(&[(0, 16 * MIB)], GRAN, SIZE),
        "the first export's map"
    );
    // The bitmap keeps what it exports until the backup ends well.
    assert_eq!(
        bitmap_state(&api, "inc"),
        Some((16 * MIB, true)),
        "kept while the backup runs"
    );
    let full = dir.path().join("full.qcow2");
    nbd::convert_qcow2(&sock, &full);
    ctl_ok(&api, &["backup", "stop"]);
    assert_eq!(bitmap_state(&api, "inc"), Some((0, true)), "afresh");

    let changed = scattered(&mut c, 100, 2 * MIB);
    assert_eq!(c.flush(), 0);
    let at_second = dir.path().join("at-second.raw");
    std::fs::copy(&d.image, &at_second).unwrap();

    let sock = backup_start(&api, &backups, "b.sock", Some("inc"));
    // Writes after the instant are in the live bitmap, not the export.
    write_pattern(&mut c, 200, 30 * MIB, MIB);
    let want = granules(&changed, GRAN, SIZE);
    assert_eq!(dirty(&sock, "inc"), want, "the incremental map");
    let mut kept = changed.clone();
    kept.push((30 * MIB, MIB));
    assert_eq!(
        bitmap_state(&api, "inc"),
        Some((bytes(&granules(&kept, GRAN, SIZE)), true)),
        "the exported changes and the later writes"
    );
    let top = dir.path().join("inc.qcow2");
    assert_eq!(nbd::incremental(&sock, "inc", &full, &top), want);
    ctl_ok(&api, &["backup", "stop"]);
    assert_eq!(
        bitmap_state(&api, "inc"),
        Some((bytes(&granules(&[(30 * MIB, MIB)], GRAN, SIZE)), true)),
        "after the stop, the writes since the instant only"
    );
    let restored = dir.path().join("restored.raw");
    nbd::restore(&top, &restored);
    assert_same("full + incremental", &restored, &at_second);
    drop(c);
    stop(d);
}

/// `backup stop --failed` keeps the exported changes in the bitmap: the next
/// incremental holds them and what came after.
#[test]
fn a_failed_backup_loses_no_change() {
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let d = start(dir.path(), &[]);
    let api = dir.path().join("api.sock");
    let backups = dir.path().join("backups");
    ctl_ok(&api, &["bitmap", "add", "inc"]);
    let mut c = Client::connect(&d.socket, BUF);
    let first = scattered(&mut c, 1, 0);
    let sock = backup_start(&api, &backups, "b.sock", Some("inc"));
    let second = scattered(&mut c, 2, 16 * MIB);
    let out = ctl_ok(&api, &["backup", "stop", "--failed"]);
    assert!(out.contains("as failed"), "{out}");
    assert!(!sock.exists());
    let mut all = first.clone();
    all.extend(&second);
    let want = granules(&all, GRAN, SIZE);
    assert_eq!(bitmap_state(&api, "inc"), Some((bytes(&want), true)));
    let sock = backup_start(&api, &backups, "b.sock", Some("inc"));
    assert_eq!(dirty(&sock, "inc"), want);
    ctl_ok(&api, &["backup", "stop"]);
    drop(c);
    stop(d);
}

/// A bitmap survives a clean restart whole and consistent; after a
/// kill -9 it is complete (every acknowledged write in it) or marked
/// inconsistent, never silently short.
#[test]
fn bitmaps_persist_across_restart_and_kill_9() {
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let api = dir.path().join("api.sock");
    let backups = dir.path().join("backups");
    let d = start(dir.path(), &[]);
    ctl_ok(&api, &["bitmap", "add", "p"]);
    let mut c = Client::connect(&d.socket, BUF);
    let mut all = scattered(&mut c, 1, 0);
    drop(c);
    stop(d);
    assert!(dir.path().join("disk.img.bitmap.p").exists());

    let d = start(dir.path(), &[]);
    let want = granules(&all, GRAN, SIZE);
    assert_eq!(
        bitmap_state(&api, "p"),
        Some((bytes(&want), true)),
        "after a clean restart"
    );
    let mut c = Client::connect(&d.socket, BUF);
    all.extend(scattered(&mut c, 2, 16 * MIB));
    // Acknowledged, then killed: no clean stop writes anything out.
    let mut d = d;
    let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert!(!st.success());
    drop(c);
    drop(d);

    let d = start(dir.path(), &[]);
    let want = granules(&all, GRAN, SIZE);
    let (dirty_bytes, consistent) = bitmap_state(&api, "p").expect("the bitmap is there");
    if consistent {
        assert_eq!(dirty_bytes, bytes(&want), "complete after kill -9");
        let sock = backup_start(&api, &backups, "b.sock", Some("p"));
        assert_eq!(dirty(&sock, "p"), want);
        ctl_ok(&api, &["backup", "stop"]);
    } else {
        let table = ctl_ok(&api, &["bitmap", "list"]);
        assert!(table.contains("NO: take a full backup"), "{table}");
    }
    stop(d);
}

/// Hostile NBD clients while the guest does I/O: bad magic, unknown
/// options, reads past the end, huge lengths, more connections than the
/// cap, a client that never reads. Each gets its protocol error or is
/// closed; the guest's I/O goes on, verified, and the daemon lives.
#[test]
fn bad_nbd_input_leaves_the_guest_io_alone() {
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let mut d = start(dir.path(), &[]);
    let api = dir.path().join("api.sock");
    let mut c = Client::connect(&d.socket, BUF);
    write_pattern(&mut c, 1, 0, SIZE);
    let sock = backup_start(&api, &dir.path().join("backups"), "b.sock", None);

    // The guest's side: writes and read-backs, on a thread of its own,
    // for as long as the hostile clients take.
    let stop_io = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let io = {
        let (stop_io, socket) = (stop_io.clone(), d.socket.clone());
        drop(c);
        std::thread::spawn(move || {
            let mut c = Client::connect(&socket, BUF);
            let mut rounds = 0u64;
            while !stop_io.load(std::sync::atomic::Ordering::Relaxed) || rounds < 3 {
                let off = (rounds * 256 * KIB) % (SIZE - 256 * KIB);
                let data = pattern(1000 + rounds, off, (256 * KIB) as usize);
                assert_eq!(c.write(off, &data), 0, "guest write {rounds}");
                assert!(c.read(off, data.len()) == data, "guest read {rounds}");
                rounds += 1;
            }
            rounds
        })
    };

    // Bad option magic, unknown client flags, a 4 GiB option: closed.
    let mut s = raw::greet(&sock, 3);
    std::io::Write::write_all(&mut s, b"IHAVEOPX\0\0\0\x07\0\0\0\0").unwrap();
    assert!(raw::closed(&mut s), "bad option magic");
    let mut s = raw::greet(&sock, 1 << 7);
    assert!(raw::closed(&mut s), "unknown client flags");
    let mut s = raw::greet(&sock, 3);
    std::io::Write::write_all(&mut s, b"IHAVEOPT\0\0\0\x63\xff\xff\xff\xff").unwrap();
    assert!(raw::closed(&mut s), "a 4 GiB option");
    // Unknown options: ERR_UNSUP, and the handshake goes on.
    let mut s = raw::greet(&sock, 3);
    for opt in [99u32, 5, 0x7fff] {
        raw::option(&mut s, opt, b"junk");
        assert_eq!(raw::option_reply(&mut s).1, 0x8000_0001, "option {opt}");
    }
    drop(s);
    // Transmission: past the end, 4 GiB, offset overflow, a write.
    let mut s = raw::go(&sock);
    raw::request(&mut s, 0, 1, SIZE - 512, 1024);
    assert_eq!(raw::simple_reply(&mut s), (22, 1), "a read past the end");
    raw::request(&mut s, 0, 2, 0, u32::MAX);
    assert_eq!(raw::simple_reply(&mut s), (22, 2), "a 4 GiB read");
    raw::request(&mut s, 0, 3, u64::MAX - 10, 512);
    assert_eq!(raw::simple_reply(&mut s), (22, 3), "offset overflow");
    raw::request(&mut s, 1, 4, 0, 4096);
    std::io::Write::write_all(&mut s, &[0xee; 4096]).unwrap();
    assert_eq!(raw::simple_reply(&mut s), (1, 4), "a write: EPERM");
    raw::request(&mut s, 1, 5, 0, u32::MAX);
    assert!(raw::closed(&mut s), "a 4 GiB write ends the connection");
    std::thread::sleep(Duration::from_millis(300)); // the slots above free
    // A slow client: asks for 16 MiB, many times, and never reads; and
    // the cap: 8 connections (silent ones), then each one more is closed
    // at once.
    let mut hog = raw::go(&sock);
    for h in 0..8 {
        raw::request(&mut hog, 0, h, 0, 16 << 20);
    }
    let silent: Vec<_> = (0..7)
        .map(|_| std::os::unix::net::UnixStream::connect(&sock).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    for _ in 0..50 {
        let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(raw::closed(&mut s), "past the cap");
    }
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    drop(silent);
    drop(hog);

    stop_io.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = io.join().expect("the guest's I/O failed");
    assert!(rounds >= 3);
    d.assert_running();
    // The export still serves a well-behaved client, once the slots
    // free up, and is still the instant.
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let out = Command::new("nbdinfo")
            .args(["--size", &nbd::uri(&sock)])
            .output()
            .unwrap();
        if out.status.success() {
            assert_eq!(
                String::from_utf8_lossy(&out.stdout).trim(),
                SIZE.to_string()
            );
            break;
        }
        assert!(Instant::now() < deadline, "the export never served again");
        std::thread::sleep(Duration::from_millis(200));
    }
    let copy = dir.path().join("copy.raw");
    nbd::copy_full(&sock, &copy);
    let got = std::fs::read(&copy).unwrap();
    for off in (0..SIZE).step_by(MIB as usize) {
        assert!(
            got[off as usize..off as usize + 4096] == pattern(1, off, 4096)[..],
            "the copy at {off} is not the instant"
        );
    }
    let info: serde_json::Value =
        serde_json::from_str(&ctl_ok(&api, &["backup", "status"])).unwrap();
    assert!(info["refused"].as_u64().unwrap() >= 50, "{info}");
    ctl_ok(&api, &["backup", "stop"]);
    stop(d);
}

/// Where backups cannot run, `backup start` says why in one line: no
/// --backup-dir, a socket outside the backup directory. A qcow2 image's
/// bitmaps live in the image, and work; a live snapshot is refused while a
/// backup runs; the bitmap follows a live snapshot (into the new top). (RBD images:
/// tests/rbd/rbd.rs.)
#[test]
fn backups_are_refused_with_a_reason() {
    if !nbd::have_tools() {
        return;
    }
    // No --backup-dir.
    let dir = test_dir();
    let api = dir.path().join("api.sock");
    let d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            args: &["--api", api.to_str().unwrap()],
            ..DaemonOptions::default()
        },
    );
    ctl_fails(
        &api,
        &["backup", "start", "--nbd", "x.sock"],
        "start the daemon with --backup-dir DIR",
    );
    stop(d);

    // A socket elsewhere.
    let dir = test_dir();
    let d = start(dir.path(), &[]);
    let api = dir.path().join("api.sock");
    ctl_fails(
        &api,
        &["backup", "start", "--nbd", "/tmp/elsewhere.sock"],
        "--backup-dir",
    );
    stop(d);

    // qcow2: bitmaps (in the image), backups, and snapshots between them.
    let dir = test_dir();
    let image = dir.path().join("disk.qcow2");
    nbd::run(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&image)
            .arg(SIZE.to_string()),
    );
    let backups = dir.path().join("backups");
    std::fs::create_dir(&backups).unwrap();
    let snaps = dir.path().join("snaps");
    std::fs::create_dir(&snaps).unwrap();
    let api = dir.path().join("api.sock");
    let d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            image: Some(image.clone()),
            args: &[
                "--format",
                "qcow2",
                "--api",
                api.to_str().unwrap(),
                "--backup-dir",
                backups.to_str().unwrap(),
                "--snapshot-dir",
                snaps.to_str().unwrap(),
            ],
            ..DaemonOptions::default()
        },
    );
    // Under the default --seccomp enforce, with a snapshot directory too.
    ctl_ok(&api, &["bitmap", "add", "q"]);
    let mut c = Client::connect(&d.socket, BUF);
    // A write across a cluster boundary of a fresh image: allocations,
    // pieces; the bitmap sees the guest's range.
    let w = (64 * KIB - 4 * KIB, 8 * KIB);
    assert_eq!(c.write(w.0, &pattern(5, w.0, w.1 as usize)), 0);
    assert_eq!(
        bitmap_state(&api, "q"),
        Some((bytes(&granules(&[w], GRAN, SIZE)), true))
    );
    // A backup of a qcow2 image runs; a live snapshot would change the
    // chain under its view, and is refused until it stops.
    let sock = backup_start(&api, &backups, "q.sock", None);
    ctl_fails(
        &api,
        &["snapshot", "--overlay", "s1.qcow2"],
        "a backup is running",
    );
    assert!(!snaps.join("s1.qcow2").exists(), "no overlay was made");
    ctl_ok(&api, &["backup", "stop"]);
    assert!(!sock.exists());
    ctl_ok(&api, &["snapshot", "--overlay", "s1.qcow2"]);
    let w2 = (5 * MIB, 4 * KIB);
    assert_eq!(c.write(w2.0, &pattern(6, w2.0, w2.1 as usize)), 0);
    assert_eq!(
        bitmap_state(&api, "q"),
        Some((bytes(&granules(&[w, w2], GRAN, SIZE)), true)),
        "after a live snapshot"
    );
    drop(c);
    stop(d);
    // In the image, not a sidecar: in the top the snapshot made, where
    // QEMU finds it.
    assert!(!dir.path().join("disk.qcow2.bitmap.q").exists());
    assert_eq!(
        ringblk_testkit::qemu_img::bitmaps(&snaps.join("s1.qcow2")),
        [("q".to_string(), vec!["auto".to_string()])]
    );
    // The old top keeps the bitmap as it was at the snapshot, not in
    // use (QEMU trusts it), as under `--seccomp enforce` it was written.
    assert_eq!(
        ringblk_testkit::qemu_img::bitmaps(&image),
        [("q".to_string(), vec!["auto".to_string()])]
    );
}

/// `qemu-img ARGS`, which must succeed.
fn qemu_img(args: &[&str]) {
    nbd::run(Command::new("qemu-img").args(args));
}

/// The guest's disk as the guest reads it, into the raw file `dest`: the
/// reference, taken while no write is in flight. (qemu-img cannot open
/// the chain while the daemon holds it, even with -U; each test checks
/// the daemon's reads against qemu-img's once the daemon is gone, and
/// the reference against what was written.)
fn guest_disk(c: &mut Client, dest: &Path) {
    let mut v = Vec::with_capacity(SIZE as usize);
    for at in (0..SIZE).step_by(BUF) {
        v.extend_from_slice(&c.read(at, BUF));
    }
    std::fs::write(dest, v).unwrap();
}

/// The guest's disk of a qcow2 chain as qemu-img reads it, into `dest`.
fn qcow2_disk(top: &Path, dest: &Path) {
    qemu_img(&[
        "convert",
        "-f",
        "qcow2",
        "-O",
        "raw",
        top.to_str().unwrap(),
        dest.to_str().unwrap(),
    ]);
}

/// What [`qcow2_pattern_a`] leaves, at a few places of each kind.
fn assert_pattern_a(disk: &Path) {
    let at = |off: u64| read_file(disk, off, 4096);
    assert!(at(MIB) == pattern(0xa, MIB, 4096), "A in the overlay");
    assert!(at(5 * MIB) == pattern(0xba5e, 5 * MIB, 4096), "the base");
    assert!(at(6 * MIB + 8 * KIB) == vec![0; 4096], "zero clusters");
    assert!(
        at(10 * MIB + 68 * KIB) == pattern(0xa, 0, 4096),
        "a partial"
    );
    assert!(
        at(10 * MIB + 72 * KIB) == pattern(0xba5e, 10 * MIB + 72 * KIB, 4096),
        "the base's rest of a partial cluster"
    );
    assert!(at(24 * MIB) == vec![0; 4096], "unallocated");
}

/// A qcow2 overlay `DIR/disk.qcow2` (clusters of `cluster` bytes) over a
/// compressed qcow2 base holding pattern 0xba5e over its first 20 MiB
/// (the rest unallocated), served with `--format qcow2`, `--api` and
/// `--backup-dir`.
fn start_qcow2(dir: &Path, cluster: u64) -> Daemon {
    let raw_base = dir.join("base.raw");
    std::fs::write(&raw_base, {
        let mut v = pattern(0xba5e, 0, (20 * MIB) as usize);
        v.resize(SIZE as usize, 0);
        v
    })
    .unwrap();
    let base = dir.join("base.qcow2");
    let top = dir.join("disk.qcow2");
    qemu_img(&[
        "convert",
        "-c",
        "-f",
        "raw",
        "-O",
        "qcow2",
        raw_base.to_str().unwrap(),
        base.to_str().unwrap(),
    ]);
    // Its data is all compressed clusters (the pattern compresses).
    let check: serde_json::Value =
        serde_json::from_str(&nbd::run(Command::new("qemu-img").args([
            "check",
            "--output=json",
            base.to_str().unwrap(),
        ])))
        .unwrap();
    assert_eq!(
        check["compressed-clusters"], check["allocated-clusters"],
        "{check}"
    );
    assert!(
        check["compressed-clusters"].as_u64().unwrap() > 0,
        "{check}"
    );
    create_qcow2(
        &top,
        &format!("cluster_size={cluster}"),
        Some((base.to_str().unwrap(), "qcow2")),
        None,
    );
    let backups = dir.join("backups");
    std::fs::create_dir_all(&backups).unwrap();
    let api = dir.join("api.sock");
    Daemon::start_in(
        dir,
        DaemonOptions {
            image: Some(top),
            args: &[
                "--format",
                "qcow2",
                "--api",
                api.to_str().unwrap(),
                "--backup-dir",
                backups.to_str().unwrap(),
            ],
            ..DaemonOptions::default()
        },
    )
}

/// The first guest's writes on a qcow2 overlay: pattern A over
/// [0, 4 MiB) (allocated in the overlay), zeroes over [6, 7) MiB (zero
/// clusters over the base's data), 4 KiB of A inside [10, 11) MiB (a
/// partial cluster: the rest copied up from the base). The rest of
/// [0, 20) MiB is the base's (compressed), [20, 32) MiB unallocated.
fn qcow2_pattern_a(c: &mut Client) {
    write_pattern(c, 0xa, 0, 4 * MIB);
    assert_eq!(c.write_zeroes(6 * MIB, MIB), 0);
    assert_eq!(c.write(10 * MIB + 68 * KIB, &pattern(0xa, 0, 4096)), 0);
    assert_eq!(c.flush(), 0);
}

/// Overwrites, after the instant, every kind of place on the overlay:
/// small writes inside clusters still in the base, in zero clusters and
/// in unallocated ones (each allocation copies the rest of its cluster
/// up), then B over the whole disk.
fn qcow2_overwrite(c: &mut Client, seed: u64) {
    for k in 0..SIZE / MIB {
        let off = k * MIB + 132 * KIB;
        assert_eq!(c.write(off, &pattern(seed + 1, off, 4096)), 0);
    }
    assert_eq!(c.discard(2 * MIB, MIB), 0);
    write_pattern(c, seed, 0, SIZE);
}

/// A full backup of a qcow2 overlay whose disk is partly in a compressed
/// base, partly zero clusters, partly unallocated, while the guest
/// overwrites all of it: nbdcopy and qemu-img copies of the export are
/// the guest's disk at `backup start`; `base:allocation` reports the
/// chain's holes; the image checks clean afterwards. Overlay clusters of
/// 64 KiB and of 256 KiB (larger than the default copy-before-write
/// cluster).
#[test]
fn a_qcow2_backup_under_writes_is_the_instant() {
    if !nbd::have_tools() {
        return;
    }
    for cluster in [64 * KIB, 256 * KIB] {
        let dir = test_dir();
        let d = start_qcow2(dir.path(), cluster);
        let api = dir.path().join("api.sock");
        let top = dir.path().join("disk.qcow2");
        let mut c = Client::connect(&d.socket, BUF);
        qcow2_pattern_a(&mut c);
        let at_start = dir.path().join("at-start.raw");
        guest_disk(&mut c, &at_start);
        assert_pattern_a(&at_start);

        let sock = backup_start(&api, &dir.path().join("backups"), "q.sock", None);
        // Data where the chain has it; [20, 32) MiB unallocated: a hole.
        let map = nbd::map(&sock, None);
        let at = |off: u64| {
            map.iter()
                .find(|e| e.0 <= off && off < e.0 + e.1)
                .map(|e| e.2)
                .unwrap_or_else(|| panic!("{off} not in {map:?}"))
        };
        assert_eq!(at(0), 0, "overlay data: {map:?}");
        assert_eq!(at(12 * MIB), 0, "base data: {map:?}");
        assert_eq!(at(24 * MIB), 3, "unallocated: {map:?}");
        assert_eq!(at(6 * MIB), 3, "zero clusters: {map:?}");

        let copy = dir.path().join("copy.raw");
        let running = nbdcopy(&sock, &copy);
        qcow2_overwrite(&mut c, 0xb);
        wait_ok(running, "nbdcopy");
        qcow2_overwrite(&mut c, 0xc);
        let converted = dir.path().join("copy.qcow2");
        nbd::convert_qcow2(&sock, &converted);
        let restored = dir.path().join("restored.raw");
        nbd::restore(&converted, &restored);
        assert_same("nbdcopy of the export", &copy, &at_start);
        assert_same("qemu-img convert of the export", &restored, &at_start);

        let info: serde_json::Value =
            serde_json::from_str(&ctl_ok(&api, &["backup", "status"])).unwrap();
        assert!(info["copied_clusters"].as_u64().unwrap() > 0, "{info}");
        assert_eq!(info["failed"], false, "{info}");
        ctl_ok(&api, &["backup", "stop"]);
        // The guest's disk is C: the export did not leak into it.
        let now = dir.path().join("now.raw");
        guest_disk(&mut c, &now);
        assert!(read_file(&now, 0, 4096) == pattern(0xc, 0, 4096));
        assert!(read_file(&now, 24 * MIB, 4096) == pattern(0xc, 24 * MIB, 4096));
        drop(c);
        stop(d);
        let by_qemu = dir.path().join("by-qemu.raw");
        qcow2_disk(&top, &by_qemu);
        assert_same("qemu-img's read of the overlay", &by_qemu, &now);
        assert_eq!(
            ringblk_testkit::qemu_img::check(&top),
            (0, 0),
            "qemu-img check of the overlay ({cluster}-byte clusters)"
        );
    }
}

/// Full and incremental backups of a qcow2 overlay with `--bitmap`: the
/// dirty map is every change since the full one, and the full backup with
/// the incremental one on top is the guest's disk at the second `backup
/// start`, though the guest overwrote it meanwhile.
#[test]
fn an_incremental_qcow2_backup_holds_every_change() {
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let d = start_qcow2(dir.path(), 64 * KIB);
    let api = dir.path().join("api.sock");
    let backups = dir.path().join("backups");
    let top = dir.path().join("disk.qcow2");
    ctl_ok(&api, &["bitmap", "add", "inc"]);
    let mut c = Client::connect(&d.socket, BUF);
    qcow2_pattern_a(&mut c);
    let at_first = dir.path().join("at-first.raw");
    guest_disk(&mut c, &at_first);
    assert_pattern_a(&at_first);

    let sock = backup_start(&api, &backups, "b.sock", Some("inc"));
    let full = dir.path().join("full.qcow2");
    nbd::convert_qcow2(&sock, &full);
    ctl_ok(&api, &["backup", "stop"]);
    let restored = dir.path().join("full.raw");
    nbd::restore(&full, &restored);
    assert_same("the full backup", &restored, &at_first);

    // Changes in the overlay, in the base's clusters, in unallocated ones.
    let changed = scattered(&mut c, 100, 2 * MIB);
    assert_eq!(c.flush(), 0);
    let at_second = dir.path().join("at-second.raw");
    guest_disk(&mut c, &at_second);

    let sock = backup_start(&api, &backups, "b.sock", Some("inc"));
    // The guest overwrites everything while the incremental is taken.
    qcow2_overwrite(&mut c, 0xd);
    let want = granules(&changed, GRAN, SIZE);
    assert_eq!(dirty(&sock, "inc"), want, "the incremental map");
    let inc = dir.path().join("inc.qcow2");
    assert_eq!(nbd::incremental(&sock, "inc", &full, &inc), want);
    ctl_ok(&api, &["backup", "stop"]);
    let restored = dir.path().join("restored.raw");
    nbd::restore(&inc, &restored);
    assert_same("full + incremental", &restored, &at_second);
    let now = dir.path().join("now.raw");
    guest_disk(&mut c, &now);
    drop(c);
    stop(d);
    let by_qemu = dir.path().join("by-qemu.raw");
    qcow2_disk(&top, &by_qemu);
    assert_same("qemu-img's read of the overlay", &by_qemu, &now);
    assert_eq!(ringblk_testkit::qemu_img::check(&top), (0, 0));
}

/// A qcow2 image `DIR/disk.qcow2` of 64 MiB with 512-byte clusters where
/// every other cluster is allocated (data) and the rest unallocated:
/// 131072 clusters, 65536 extents of each kind. Returns qemu-img's map
/// of it, `(offset, length, type)` as nbdinfo types them (0 data, 3 a
/// hole that reads as zeroes), neighbours merged.
fn fragmented_qcow2(dir: &Path) -> (std::path::PathBuf, Vec<(u64, u64, u64)>) {
    const SIZE: usize = 64 << 20;
    let raw = dir.join("fragmented.raw");
    let mut v = vec![0u8; SIZE];
    for (i, c) in v.chunks_mut(512).enumerate() {
        if i % 2 == 0 {
            c.fill(0xa5);
        }
    }
    std::fs::write(&raw, v).unwrap();
    let top = dir.join("disk.qcow2");
    qemu_img(&[
        "convert",
        "-f",
        "raw",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=512",
        "-S",
        "512",
        raw.to_str().unwrap(),
        top.to_str().unwrap(),
    ]);
    std::fs::remove_file(&raw).unwrap();
    let json = nbd::run(Command::new("qemu-img").args([
        "map",
        "--output=json",
        "-f",
        "qcow2",
        top.to_str().unwrap(),
    ]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let mut map = Vec::new();
    for e in v.as_array().unwrap() {
        let ty = if e["data"].as_bool().unwrap() { 0 } else { 3 };
        merge_extent(
            &mut map,
            (
                e["start"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                ty,
            ),
        );
    }
    assert_eq!(
        map.len(),
        SIZE / 512,
        "qemu-img's map of the fragmented image"
    );
    (top, map)
}

fn merge_extent(map: &mut Vec<(u64, u64, u64)>, e: (u64, u64, u64)) {
    match map.last_mut() {
        Some(l) if l.0 + l.1 == e.0 && l.2 == e.2 => l.1 += e.1,
        _ => map.push(e),
    }
}

/// `start_qcow2`'s daemon, on a qcow2 image that exists.
fn start_on_qcow2(dir: &Path, top: &Path, backups: &Path) -> Daemon {
    std::fs::create_dir_all(backups).unwrap();
    let api = dir.join("api.sock");
    Daemon::start_in(
        dir,
        DaemonOptions {
            image: Some(top.to_path_buf()),
            args: &[
                "--format",
                "qcow2",
                "--api",
                api.to_str().unwrap(),
                "--backup-dir",
                backups.to_str().unwrap(),
            ],
            ..DaemonOptions::default()
        },
    )
}

/// Waits for `child`, which must succeed, failing the test with `what`
/// when it runs past `limit` (it is killed then). Its standard output
/// must not be a pipe nobody reads.
fn wait_within(mut child: std::process::Child, limit: Duration, what: &str) {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_ok(child, what);
}

/// `base:allocation` of a qcow2 image with 512-byte clusters, every other
/// one allocated: `nbdinfo --map` of the whole 64 MiB export is qemu-img's
/// map, in seconds (each block-status call once mapped everything up to
/// the end of the request again: quadratic, minutes), and nbdcopy copies
/// the export in seconds too.
#[test]
fn block_status_of_a_fragmented_qcow2_is_linear() {
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let (top, want) = fragmented_qcow2(dir.path());
    let backups = dir.path().join("backups");
    let d = start_on_qcow2(dir.path(), &top, &backups);
    let api = dir.path().join("api.sock");
    let sock = backup_start(&api, &backups, "f.sock", None);
    let started = Instant::now();
    let map_file = dir.path().join("map.json");
    let child = Command::new("nbdinfo")
        .args(["--map", "--json", &nbd::uri(&sock)])
        .stdout(std::fs::File::create(&map_file).unwrap())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_within(child, Duration::from_secs(20), "nbdinfo --map");
    let took = started.elapsed();
    let json = std::fs::read_to_string(&map_file).unwrap();
    let mut got = Vec::new();
    for e in serde_json::from_str::<serde_json::Value>(&json)
        .unwrap()
        .as_array()
        .unwrap()
    {
        let f = |k: &str| e[k].as_u64().unwrap();
        merge_extent(&mut got, (f("offset"), f("length"), f("type")));
    }
    assert!(got == want, "nbdinfo's map differs from qemu-img's");
    let copy = dir.path().join("copy.raw");
    wait_within(
        nbdcopy(&sock, &copy),
        Duration::from_secs(60),
        "nbdcopy of the export",
    );
    let data = std::fs::read(&copy).unwrap();
    for (i, c) in data.chunks(512).enumerate() {
        let want = if i % 2 == 0 { 0xa5 } else { 0 };
        assert!(c.iter().all(|&b| b == want), "cluster {i} of the copy");
    }
    eprintln!("nbdinfo --map of 131072 clusters: {took:?}");
    ctl_ok(&api, &["backup", "stop"]);
    stop(d);
}

/// In transmission on `sock` with structured replies and `base:allocation`
/// selected.
fn block_status_client(sock: &Path) -> std::os::unix::net::UnixStream {
    let mut s = raw::greet(sock, 3);
    raw::option(&mut s, 8, &[]);
    assert_eq!(raw::option_reply(&mut s).1, 1, "STRUCTURED_REPLY");
    let ctx = b"base:allocation";
    let mut d = 0u32.to_be_bytes().to_vec();
    d.extend_from_slice(&1u32.to_be_bytes());
    d.extend_from_slice(&(ctx.len() as u32).to_be_bytes());
    d.extend_from_slice(ctx);
    raw::option(&mut s, 10, &d);
    assert_eq!(raw::option_reply(&mut s).1, 4, "META_CONTEXT");
    assert_eq!(raw::option_reply(&mut s).1, 1, "SET_META_CONTEXT's ACK");
    let mut d = 0u32.to_be_bytes().to_vec();
    d.extend_from_slice(&0u16.to_be_bytes());
    raw::option(&mut s, 7, &d);
    let mut reply = raw::option_reply(&mut s).1;
    while reply == 3 {
        reply = raw::option_reply(&mut s).1;
    }
    assert_eq!(reply, 1, "GO's ACK");
    s
}

/// Reads one structured reply's chunks up to the one marked done; false
/// when the connection ends first.
fn structured_reply(s: &mut std::os::unix::net::UnixStream) -> bool {
    use std::io::Read;
    loop {
        let mut h = [0u8; 20];
        if s.read_exact(&mut h).is_err() {
            return false;
        }
        assert_eq!(u32::from_be_bytes(h[0..4].try_into().unwrap()), 0x668e33ef);
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut payload = vec![0u8; len as usize];
        if s.read_exact(&mut payload).is_err() {
            return false;
        }
        if u16::from_be_bytes([h[4], h[5]]) & 1 != 0 {
            return true;
        }
    }
}

/// The control API and the guest go on while clients keep an export
/// busy: four connections ask, in a loop, for the block status of the
/// whole fragmented export. Meanwhile 20 allocating guest writes (each
/// takes the image's metadata lock, as does each block-status mapping)
/// complete within 2 s in all, `backup status` answers within a second,
/// and `backup stop` within 1.5 s (it waited for the requests in flight,
/// and each held the lock while it mapped to the end of the request, once
/// per extent: minutes), and the daemon goes on.
#[test]
fn the_api_and_the_guest_go_on_while_block_status_runs() {
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let (top, _) = fragmented_qcow2(dir.path());
    let backups = dir.path().join("backups");
    let mut d = start_on_qcow2(dir.path(), &top, &backups);
    let api = dir.path().join("api.sock");
    let sock = backup_start(&api, &backups, "f.sock", None);
    let hammers: Vec<_> = (0..4u64)
        .map(|i| {
            let mut s = block_status_client(&sock);
            std::thread::spawn(move || {
                // The whole export, from four places: each asks for the rest.
                let off = i * 4 * MIB;
                let mut answered = 0u64;
                loop {
                    // Until `backup stop` closes the connection, which
                    // the next request's write may be the first to see.
                    let len = (64 * MIB - off) as u32;
                    if raw::try_request(&mut s, 7, answered, off, len).is_err()
                        || !structured_reply(&mut s)
                    {
                        return answered;
                    }
                    answered += 1;
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut c = Client::connect(&d.socket, BUF);
    let t = Instant::now();
    for k in 0..20 {
        // 4 KiB over unallocated 512-byte clusters: each allocates.
        let off = k * MIB + 512;
        assert_eq!(c.write(off, &pattern(0x9, off, 4096)), 0);
    }
    eprintln!("20 guest writes under block status: {:?}", t.elapsed());
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "20 guest writes took {:?}",
        t.elapsed()
    );
    let t = Instant::now();
    ctl_ok(&api, &["backup", "status"]);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "backup status took {:?}",
        t.elapsed()
    );
    let t = Instant::now();
    let stop_ctl = Command::new(ringblk_testkit::ringblk_bin())
        .args(["ctl", "--api", api.to_str().unwrap(), "backup", "stop"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_within(stop_ctl, Duration::from_secs(5), "backup stop");
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "backup stop took {:?}",
        t.elapsed()
    );
    assert!(!sock.exists(), "the export's socket is gone");
    for h in hammers {
        assert!(h.join().unwrap() > 0, "a block-status client got no answer");
    }
    d.assert_running();
    assert!(c.read(MIB + 512, 4096) == pattern(0x9, MIB + 512, 4096));
    ctl_ok(&api, &["status"]);
    drop(c);
    stop(d);
}

/// A 2 EiB qcow2 image (2 MiB clusters: 38 MiB of tables on disk) with the
/// backup directory on tmpfs, which takes a 2 EiB sparse file: `backup
/// start` succeeds without sizing anything by the disk (it sized two bit
/// arrays by its clusters, 256 GiB, and the daemon aborted); a guest
/// write near the end is copied before it lands, the export reads the
/// old zeroes there, nbdinfo reads the size, and the daemon's RSS stays
/// small.
#[test]
fn a_backup_of_a_2_eib_qcow2_is_bounded_by_what_it_copies() {
    if !nbd::have_tools() {
        return;
    }
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        ringblk_testkit::skip("no /dev/shm (tmpfs) for the backup directory");
        return;
    }
    let dir = test_dir();
    let backups = tempfile::tempdir_in(shm).unwrap();
    let top = dir.path().join("disk.qcow2");
    create_qcow2(&top, "cluster_size=2M", None, Some("2E"));
    let mut d = start_on_qcow2(dir.path(), &top, backups.path());
    let api = dir.path().join("api.sock");
    let rss = |d: &Daemon| -> u64 {
        let v = d.proc_status(None, "VmRSS").expect("VmRSS");
        v.trim_end_matches(" kB").trim().parse::<u64>().unwrap() * 1024
    };
    let before = rss(&d);
    let sock = backup_start(&api, backups.path(), "big.sock", None);
    d.assert_running();
    let size = 2u64 << 60;
    let out = nbd::run(Command::new("nbdinfo").args(["--size", &nbd::uri(&sock)]));
    assert_eq!(out.trim(), size.to_string(), "nbdinfo --size");
    // Guest writes at both ends and in the middle: each is copied first.
    let mut c = Client::connect(&d.socket, BUF);
    for off in [0, size / 2 + 3 * MIB, size - 4 * MIB] {
        assert_eq!(c.write(off, &pattern(0xe, off, 4096)), 0, "write at {off}");
    }
    assert_eq!(c.flush(), 0);
    let info: serde_json::Value =
        serde_json::from_str(&ctl_ok(&api, &["backup", "status"])).unwrap();
    assert_eq!(info["copied_clusters"], 3, "{info}");
    // The export still reads the zeroes of the instant there.
    let at = format!("{}", size - 4 * MIB);
    let read = nbd::run(Command::new("qemu-io").args([
        "-r",
        "-f",
        "raw",
        "-c",
        &format!("read -P 0 {at} 4096"),
        &nbd::uri(&sock),
    ]));
    assert!(!read.contains("Pattern verification failed"), "{read}");
    let after = rss(&d);
    assert!(
        after < before + 64 * MIB,
        "RSS grew from {before} to {after} bytes"
    );
    ctl_ok(&api, &["backup", "stop"]);
    d.assert_running();
    // A bitmap of this disk would be 4 TiB of bits: refused in one line.
    ctl_fails(&api, &["bitmap", "add", "b"], "too large");
    d.assert_running();
    drop(c);
    stop(d);
}
