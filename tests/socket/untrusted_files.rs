//! Files the daemon opens by a name it did not choose (issue 29): a
//! backing file an image names, the snapshot records and the overlays
//! they name, the backup's socket in a directory whose path may change.
//! None is followed through a planted symlink where that matters, none is
//! waited on when it is a FIFO, none is read whole whatever its size; and
//! with `--backing-dir` a chain must stay in the directories given.

use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ringblk_testkit::qemu_img::{create_qcow2, overlay, qemu_img};
use ringblk_testkit::{Client, Daemon, DaemonOptions, MIB, ctl_ok, pattern, test_dir};

/// The address space a refused start runs in: a record or a backing file
/// read whole, or what a symlink to /dev/zero gives, cannot fit in it.
const REFUSAL_AS: u64 = 1 << 30;

/// `ringblk serve --socket DIR/refused.sock ARGS` must exit with status 1
/// within 10 s, in an address space of [`REFUSAL_AS`], with one
/// `ringblk:` line that says `what`, and no panic.
fn refused(dir: &Path, args: &[&str], what: &str) {
    let mut cmd = Command::new(ringblk_testkit::ringblk_bin());
    cmd.args(["serve", "--socket"])
        .arg(dir.join("refused.sock"))
        .args(args)
        .env("TMPDIR", dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: the hook runs in the child between fork and exec and calls
    // only setrlimit, which is async-signal-safe, on a local struct.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: REFUSAL_AS,
                rlim_max: REFUSAL_AS,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("running ringblk serve");
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{args:?}: still running after 10 s (blocked, or started) instead of refusing:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{args:?}: {}: {err}",
        out.status
    );
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("ringblk: ")).collect();
    assert_eq!(lines.len(), 1, "not one error line:\n{err}");
    assert!(
        lines[0].contains(what),
        "{args:?}: {:?} does not say {what:?}",
        lines[0]
    );
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stop(mut d: Daemon) {
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert!(st.success(), "the daemon exited with {st}:\n{}", d.log());
}

/// A backing file that is a FIFO, and an image that is one: the start
/// says so at once instead of blocking in open(2) for a writer that never
/// comes.
#[test]
fn a_fifo_in_the_chain_is_refused_not_waited_on() {
    let dir = test_dir();
    let d = dir.path();
    let base = d.join("base.raw");
    std::fs::write(&base, vec![0u8; MIB as usize]).unwrap();
    let top = d.join("top.qcow2");
    overlay(&base, "raw", &top);
    std::fs::remove_file(&base).unwrap();
    mkfifo(&base);
    refused(
        d,
        &["--format", "qcow2", "--image", s(&top)],
        "base.raw: neither a regular file nor a block device",
    );
    let fifo = d.join("image.fifo");
    mkfifo(&fifo);
    refused(
        d,
        &["--image", s(&fifo)],
        "neither a regular file nor a block device",
    );
}

/// A qcow2 image and a snapshot directory, for records planted there.
fn with_snapshot_dir(d: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let top = d.join("top.qcow2");
    create_qcow2(&top, "", None, Some("4M"));
    let snaps = d.join("snaps");
    std::fs::create_dir(&snaps).unwrap();
    (top, snaps)
}

/// Snapshot records that are a FIFO, a symlink (to /dev/zero) or a huge
/// sparse file: the start refuses each with one line naming it, in
/// bounded memory and at once; none is read whole or waited on.
#[test]
fn snapshot_records_are_read_bounded_and_never_through_a_link() {
    let dir = test_dir();
    let d = dir.path();
    let (top, snaps) = with_snapshot_dir(d);
    let args = [
        "--format",
        "qcow2",
        "--image",
        s(&top),
        "--snapshot-dir",
        s(&snaps),
    ];
    let record = snaps.join("s1.qcow2.ringblk-snapshot");
    mkfifo(&record);
    refused(
        d,
        &args,
        "s1.qcow2.ringblk-snapshot: cannot read this snapshot record: not a regular file",
    );
    std::fs::remove_file(&record).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &record).unwrap();
    refused(
        d,
        &args,
        "cannot read this snapshot record: it is a symbolic link",
    );
    std::fs::remove_file(&record).unwrap();
    std::fs::File::create(&record)
        .and_then(|f| f.set_len(512 * MIB))
        .unwrap();
    refused(
        d,
        &args,
        "cannot read this snapshot record: larger than 65536 bytes",
    );
    std::fs::remove_file(&record).unwrap();
    // Nothing planted: the image is served.
    let d2 = Daemon::start_in(
        d,
        DaemonOptions {
            image: Some(top.clone()),
            args: &args[..2]
                .iter()
                .chain(&args[4..])
                .copied()
                .collect::<Vec<_>>(),
            ..DaemonOptions::default()
        },
    );
    stop(d2);
}

/// A record whose overlay (`by`) is a symlink to an image outside the
/// snapshot directory: refused, and the image there is not written. The
/// outside image is a true overlay of the named one, so that without the
/// check the daemon would serve it read-write.
#[test]
fn a_record_naming_a_symlink_is_refused() {
    let dir = test_dir();
    let d = dir.path();
    let (top, snaps) = with_snapshot_dir(d);
    let top_c = std::fs::canonicalize(&top).unwrap();
    let outside = d.join("outside.qcow2");
    create_qcow2(&outside, "", Some((s(&top_c), "qcow2")), None);
    let before = ringblk_testkit::qemu_img::sha256(&outside);
    std::os::unix::fs::symlink(&outside, snaps.join("evil.qcow2")).unwrap();
    let line = format!(
        "{{\"ringblk_snapshot\":1,\"superseded\":\"{}\",\"by\":\"evil.qcow2\",\"at\":1764118200}}\n",
        top_c.display()
    );
    std::fs::write(snaps.join("evil.qcow2.ringblk-snapshot"), line).unwrap();
    refused(
        d,
        &[
            "--format",
            "qcow2",
            "--image",
            s(&top),
            "--snapshot-dir",
            s(&snaps),
        ],
        "which is a symbolic link, not an overlay the daemon created",
    );
    assert_eq!(ringblk_testkit::qemu_img::sha256(&outside), before);
}

/// `--backup-dir` names a symlink, retargeted after the start: the
/// backup's socket is made in the directory opened at start, and
/// `backup stop` removes it; nothing appears in the new target.
#[test]
fn the_backup_socket_stays_in_the_directory_opened_at_start() {
    let dir = test_dir();
    let d = dir.path();
    let (first, second) = (d.join("first"), d.join("second"));
    std::fs::create_dir(&first).unwrap();
    std::fs::create_dir(&second).unwrap();
    let link = d.join("backups");
    std::os::unix::fs::symlink(&first, &link).unwrap();
    let api = d.join("api.sock");
    let daemon = Daemon::start_in(
        d,
        DaemonOptions {
            args: &["--api", s(&api), "--backup-dir", s(&link)],
            ..DaemonOptions::default()
        },
    );
    // Retargeted in one step, as an attacker who can write `d` would.
    let tmp = d.join("backups.new");
    std::os::unix::fs::symlink(&second, &tmp).unwrap();
    std::fs::rename(&tmp, &link).unwrap();
    ctl_ok(&api, &["backup", "start", "--nbd", "x.sock"]);
    let made = std::fs::symlink_metadata(first.join("x.sock"));
    assert!(
        made.is_ok_and(|m| m.file_type().is_socket()),
        "no socket in the directory opened at start"
    );
    assert!(
        !second.join("x.sock").exists(),
        "the socket followed the retargeted link"
    );
    ctl_ok(&api, &["backup", "stop"]);
    assert!(
        !first.join("x.sock").exists(),
        "backup stop left its socket"
    );
    stop(daemon);
}

/// `--backing-dir`: a chain inside is served; a backing file outside it,
/// by an absolute name, by `../`, or through a symlink inside that points
/// out, is refused with one line naming where it resolves.
#[test]
fn backing_dir_keeps_the_chain_inside() {
    let dir = test_dir();
    let d = dir.path();
    let images = d.join("images");
    let other = d.join("other");
    std::fs::create_dir(&images).unwrap();
    std::fs::create_dir(&other).unwrap();
    let base = images.join("base.raw");
    std::fs::write(&base, pattern(7, 0, 4 * MIB as usize)).unwrap();
    let top = images.join("top.qcow2");
    overlay(&base, "raw", &top);
    let tenant = d.join("tenant");
    std::fs::create_dir(&tenant).unwrap();
    let served = tenant.join("disk.qcow2");
    create_qcow2(&served, "", Some((s(&top), "qcow2")), None);
    let allowed = ["--format", "qcow2", "--backing-dir", s(&images)];
    let daemon = Daemon::start_in(
        d,
        DaemonOptions {
            image: Some(served.clone()),
            args: &allowed,
            ..DaemonOptions::default()
        },
    );
    let mut client = Client::connect(&daemon.socket, MIB as usize);
    assert_eq!(client.read(MIB, 4096), pattern(7, MIB, 4096));
    drop(client);
    stop(daemon);

    let secret = other.join("secret.raw");
    std::fs::write(&secret, vec![0x5a; MIB as usize]).unwrap();
    let secret_c = std::fs::canonicalize(&secret).unwrap();
    let want = format!(
        "backing file resolves to {}, outside every --backing-dir",
        secret_c.display()
    );
    let check = |name: &str| {
        let img = tenant.join("evil.qcow2");
        let _ = std::fs::remove_file(&img);
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-u",
            "-b",
            name,
            "-F",
            "raw",
            s(&img),
            "1M",
        ]);
        let mut args = vec!["--image", s(&img)];
        args.extend_from_slice(&allowed);
        refused(d, &args, &want);
    };
    check(s(&secret));
    check("../other/secret.raw");
    std::os::unix::fs::symlink(&secret, images.join("link.raw")).unwrap();
    check(s(&images.join("link.raw")));
    // Not a directory: one line, at start.
    let mut args = vec!["--image", s(&served), "--format", "qcow2"];
    args.extend(["--backing-dir", s(&secret)]);
    refused(d, &args, "not a directory");
}
