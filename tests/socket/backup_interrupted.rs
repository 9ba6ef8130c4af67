//! A backup interrupted (issue 29): whatever happens between `backup
//! start --bitmap B` and `backup stop`, the next start finds in B every
//! change since the last backup that ended well, or finds B marked
//! inconsistent; never consistent with a change missing. One backup start
//! at a time; a socket left by a killed daemon is replaced at its next
//! start.
//!
//! The reference is the test's own record of every write acknowledged
//! since the last `backup stop` that ended well, widened to the
//! granularity; the judge of the bitmap is nbdinfo's map of
//! `qemu:dirty-bitmap:B` (`nbd::dirty`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use ringblk_testkit::nbd::{self, bitmap_state, granules};
use ringblk_testkit::qemu_img::create_qcow2;
use ringblk_testkit::{
    Client, Daemon, DaemonOptions, KIB, MIB, ctl_fails, ctl_ok, pattern, test_dir,
};

const SIZE: u64 = 32 * MIB;
const GRAN: u64 = 64 * KIB;
const BUF: usize = MIB as usize;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// Bitmaps in sidecar files, their bits in the page cache as they are
    /// set: a kill -9 keeps them all, consistent.
    Raw,
    /// QEMU's bitmaps in the image, in memory while it is held: a kill -9
    /// leaves them in use, which every opener takes as inconsistent.
    Qcow2,
}

fn image(dir: &Path, kind: Kind) -> PathBuf {
    match kind {
        Kind::Raw => {
            let p = dir.join("disk.img");
            if !p.exists() {
                ringblk_testkit::sparse_image(dir, "disk.img", SIZE);
            }
            p
        }
        Kind::Qcow2 => {
            let p = dir.join("disk.qcow2");
            if !p.exists() {
                create_qcow2(&p, "cluster_size=65536", None, Some("32M"));
            }
            p
        }
    }
}

/// A daemon on `DIR/disk.img` or `DIR/disk.qcow2` with `--api
/// DIR/api.sock --backup-dir DIR/backups`.
fn start(dir: &Path, kind: Kind) -> Daemon {
    let backups = dir.join("backups");
    std::fs::create_dir_all(&backups).unwrap();
    let api = dir.join("api.sock");
    let mut args = vec![
        "--api",
        api.to_str().unwrap(),
        "--backup-dir",
        backups.to_str().unwrap(),
    ];
    if kind == Kind::Qcow2 {
        args.extend(["--format", "qcow2"]);
    }
    let args: Vec<String> = args.into_iter().map(String::from).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Daemon::start_in(
        dir,
        DaemonOptions {
            image: Some(image(dir, kind)),
            args: &args,
            ..DaemonOptions::default()
        },
    )
}

fn kill_9(mut d: Daemon) {
    let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert!(!st.success(), "killed: {st}");
}

/// Where a round kills the daemon.
#[derive(Clone, Copy, Debug)]
enum Moment {
    /// Right after `backup start`: no copy-before-write yet.
    AfterStart,
    /// While nbdcopy reads the export and the guest overwrites it.
    DuringCopies,
    /// The client has read everything, `backup stop` not sent.
    BeforeStop,
    /// `backup stop` sent and answered: the backup ended well.
    AfterStop,
    /// A SIGTERM instead: the daemon ends the backup as failed.
    Sigterm,
}

/// The writes acknowledged since the last backup that ended well.
struct Expected(Vec<(u64, u64)>);

impl Expected {
    /// A write of `len` bytes at `off`, acknowledged.
    fn write(&mut self, c: &mut Client, seed: u64, off: u64, len: u64) {
        assert_eq!(c.write(off, &pattern(seed, off, len as usize)), 0);
        self.0.push((off, len));
    }
}

/// Scattered writes of round `seed` (4 KiB to 128 KiB, straddling
/// granules).
fn load(c: &mut Client, e: &mut Expected, seed: u64, n: u64) {
    for i in 0..n {
        let off = ((seed * 7919 + i * 104_729) * 4096) % (SIZE - 256 * KIB);
        let len = (4 * KIB) << ((seed + i) % 6);
        e.write(c, seed * 100 + i, off, len);
    }
}

/// After a restart: the bitmap is consistent and holds every expected
/// write (a raw image's must be), or is inconsistent (a qcow2 image's may
/// be). Then a backup of it that ends well: the map holds every expected
/// write, and nothing is expected any more.
fn check(dir: &Path, kind: Kind, e: &mut Expected, what: &str) {
    let api = dir.join("api.sock");
    let backups = dir.join("backups");
    let (dirty_bytes, consistent) = bitmap_state(&api, "b").expect("the bitmap is there");
    let want = granules(&e.0, GRAN, SIZE);
    let want_bytes: u64 = want.iter().map(|r| r.1).sum();
    if kind == Kind::Raw {
        assert!(
            consistent,
            "{what}: a raw image's bitmap after the restart is inconsistent"
        );
    }
    if consistent {
        assert!(
            dirty_bytes >= want_bytes,
            "{what}: consistent with {dirty_bytes} dirty bytes, short of the {want_bytes} written since the last backup"
        );
    }
    // The next backup: a name the killed daemon left behind is free again.
    // (The killed daemon's io_uring lets go of its image lock a moment
    // after the process is gone: the kernel tears the ring down
    // asynchronously.)
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let args = ["backup", "start", "--nbd", "b.sock", "--bitmap", "b"];
    loop {
        let out = ringblk_testkit::ctl(&api, &args);
        if out.status.success() {
            break;
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("held by another process") && std::time::Instant::now() < deadline,
            "{what}: backup start: {err}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let sock = backups.join("b.sock");
    if consistent {
        let map = nbd::dirty(&sock, "b");
        for (off, len) in &want {
            assert!(
                map.iter().any(|(o, l)| o <= off && off + len <= o + l),
                "{what}: the dirty map lacks {off}+{len}: {map:?}"
            );
        }
    }
    ctl_ok(&api, &["backup", "stop"]);
    e.0.clear();
}

/// Rounds of: writes, `backup start --bitmap b`, writes, and an
/// interruption at `moment`, then a restart and [`check`].
fn interrupted(kind: Kind, moments: &[Moment]) {
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let dir = dir.path();
    let api = dir.join("api.sock");
    let backups = dir.join("backups");
    let d = start(dir, kind);
    ctl_ok(&api, &["bitmap", "add", "b"]);
    let mut d = Some(d);
    let mut e = Expected(Vec::new());
    for (round, &moment) in moments.iter().enumerate() {
        let what = format!("{kind:?} round {round} ({moment:?})");
        let seed = round as u64 + 1;
        let daemon = d.take().expect("a daemon");
        let mut c = Client::connect(&daemon.socket, BUF);
        load(&mut c, &mut e, seed, 8);
        assert_eq!(c.flush(), 0);
        let sock = nbd::backup_start(&api, &backups, "b.sock", Some("b"));
        match moment {
            Moment::AfterStart => {}
            Moment::DuringCopies => {
                let copy = std::process::Command::new("nbdcopy")
                    .arg(nbd::uri(&sock))
                    .arg("null:")
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .unwrap();
                load(&mut c, &mut e, seed + 1000, 24);
                drop(copy);
            }
            Moment::BeforeStop => {
                nbd::copy_full(&sock, &dir.join("full.raw"));
                load(&mut c, &mut e, seed + 1000, 8);
            }
            Moment::AfterStop => {
                nbd::copy_full(&sock, &dir.join("full.raw"));
                // Ended well: what it exported may leave the bitmap.
                ctl_ok(&api, &["backup", "stop"]);
                e.0.clear();
                load(&mut c, &mut e, seed + 1000, 8);
            }
            Moment::Sigterm => load(&mut c, &mut e, seed + 1000, 8),
        }
        assert_eq!(c.flush(), 0);
        let mut daemon = daemon;
        if let Moment::Sigterm = moment {
            let st = daemon.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
            assert!(st.success(), "{what}: {st}\n{}", daemon.log());
            assert!(!sock.exists(), "{what}: a clean stop removes its socket");
            // Gone before the next one starts in the same directory.
            drop(daemon);
        } else {
            kill_9(daemon);
        }
        drop(c);
        let daemon = start(dir, kind);
        check(dir, kind, &mut e, &what);
        d = Some(daemon);
    }
}

const MOMENTS: [Moment; 10] = [
    Moment::AfterStart,
    Moment::DuringCopies,
    Moment::BeforeStop,
    Moment::AfterStop,
    Moment::Sigterm,
    Moment::DuringCopies,
    Moment::AfterStart,
    Moment::BeforeStop,
    Moment::DuringCopies,
    Moment::AfterStop,
];

#[test]
fn a_raw_bitmap_survives_every_interruption_complete() {
    interrupted(Kind::Raw, &MOMENTS);
}

#[test]
fn a_qcow2_bitmap_is_complete_or_inconsistent_after_every_interruption() {
    interrupted(Kind::Qcow2, &MOMENTS);
}

/// Two `backup start` at once: one starts, the other is refused and
/// leaves nothing behind (no socket, no hold on the image, the bitmap's
/// bits intact); `backup stop --failed` of the one that started keeps
/// every change.
#[test]
fn two_backup_starts_at_once_start_one() {
    if !nbd::have_tools() {
        return;
    }
    let dir = test_dir();
    let dir = dir.path();
    let api = dir.join("api.sock");
    let backups = dir.join("backups");
    let d = start(dir, Kind::Raw);
    ctl_ok(&api, &["bitmap", "add", "b"]);
    let mut c = Client::connect(&d.socket, BUF);
    let mut e = Expected(Vec::new());
    for i in 0..8 {
        e.write(&mut c, 1, i * MIB, MIB);
    }
    assert_eq!(c.flush(), 0);
    drop(c);
    for round in 0..12 {
        let barrier = Arc::new(Barrier::new(2));
        let starts: Vec<_> = ["x.sock", "y.sock"]
            .into_iter()
            .map(|name| {
                let (api, barrier) = (api.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    ringblk_testkit::ctl(&api, &["backup", "start", "--nbd", name, "--bitmap", "b"])
                })
            })
            .collect();
        let outs: Vec<_> = starts.into_iter().map(|t| t.join().unwrap()).collect();
        let ok: Vec<_> = outs.iter().filter(|o| o.status.success()).collect();
        assert_eq!(
            ok.len(),
            1,
            "round {round}: one start of two succeeds: {outs:?}"
        );
        let refused = outs.iter().find(|o| !o.status.success()).unwrap();
        let said = String::from_utf8_lossy(&refused.stderr);
        assert!(
            said.contains("a backup is running") || said.contains("a backup is starting"),
            "round {round}: {said}"
        );
        let names: Vec<_> = std::fs::read_dir(&backups)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 1, "round {round}: one socket: {names:?}");
        let status = ctl_ok(&api, &["backup", "status"]);
        assert!(status.contains(&names[0]), "{status}");
        ctl_ok(&api, &["backup", "stop", "--failed"]);
        assert_eq!(
            std::fs::read_dir(&backups).unwrap().count(),
            0,
            "round {round}: the stop removed the socket"
        );
        assert_eq!(
            bitmap_state(&api, "b"),
            Some((8 * MIB, true)),
            "round {round}: a failed backup keeps the bits"
        );
        // Nothing holds the image: no front-end, no backup.
        let status: serde_json::Value = serde_json::from_str(&ctl_ok(&api, &["status"])).unwrap();
        assert_eq!(status["lock"], "idle", "round {round}: {status}");
    }
    ctl_fails(&api, &["backup", "stop"], "no backup is running");
    drop(d);
}
