//! The daemon needs no privileges: run as `nobody` (no capabilities, no
//! supplementary groups) on an image and socket directory that user owns,
//! it serves I/O, under its default seccomp filter and Landlock ruleset,
//! and does not warn about root. Needs root to switch users (with setpriv
//! from util-linux); skipped otherwise, except where `CI` is set: there it
//! fails.

use std::os::unix::fs::{MetadataExt, chown};
use std::process::Command;
use std::time::Duration;

use ringblk_testkit::nbd::bitmap_state;
use ringblk_testkit::{
    Client, Daemon, DaemonOptions, MIB, assert_pattern, ctl_ok, is_root, pattern, serve_refused,
    skip, sparse_image, test_dir,
};

const NOBODY: u32 = 65534;

#[test]
fn serves_io_as_nobody() {
    if !is_root() {
        skip("switching to an unprivileged user needs root");
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        skip("setpriv (util-linux) is not installed");
        return;
    }
    let dir = test_dir();
    let image = sparse_image(dir.path(), "disk.img", 32 * MIB);
    for p in [dir.path(), image.as_path()] {
        chown(p, Some(NOBODY), Some(NOBODY)).expect("chown to nobody");
    }
    let uid = format!("--reuid={NOBODY}");
    let gid = format!("--regid={NOBODY}");
    let mut d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            image: Some(image),
            wrapper: &["setpriv", &uid, &gid, "--clear-groups", "--"],
            ..DaemonOptions::default()
        },
    );
    d.wait_for_log("seccomp filter");
    let log = d.log();
    assert!(!log.contains("running as root"), "{log}");
    if std::env::var_os("CI").is_some() || !log.contains("Landlock is not available") {
        assert!(log.contains("Landlock ABI "), "Landlock is not on:\n{log}");
    }

    let status = |name| d.proc_status(None, name).unwrap_or_default();
    assert!(
        status("Uid").split_whitespace().all(|u| u == "65534"),
        "Uid: {}",
        status("Uid")
    );
    assert!(
        status("Gid").split_whitespace().all(|g| g == "65534"),
        "Gid: {}",
        status("Gid")
    );
    assert_eq!(status("Groups"), "", "supplementary groups");
    assert_eq!(
        status("CapEff"),
        "0000000000000000",
        "effective capabilities"
    );
    assert_eq!(
        std::fs::metadata(&d.socket).expect("socket").uid(),
        NOBODY,
        "socket owner"
    );

    let mut c = Client::connect(&d.socket, 256 * 1024);
    for off in [0, 16 * MIB, 32 * MIB - 256 * 1024] {
        assert_eq!(c.write(off, &pattern(9, off, 256 * 1024)), 0, "write {off}");
    }
    assert_eq!(c.flush(), 0, "flush");
    assert_eq!(c.discard(16 * MIB, MIB), 0, "discard");
    assert_pattern("read back", 9, 0, &c.read(0, 256 * 1024));
    assert!(c.read(16 * MIB, 256 * 1024).iter().all(|b| *b == 0));
    drop(c);
    d.assert_running();

    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert_eq!(st.code(), Some(0), "exit after SIGTERM: {st}\n{}", d.log());
    assert!(!d.socket.exists(), "socket left behind");
}

/// The bitmaps of an image made while the daemon ran as root, then the
/// daemon run as its own user, as docs/security.md advises: the root-owned
/// sidecar cannot be opened (EACCES), and the start stops with one line
/// that names it and says whose it must be. It used to start tracking
/// nothing, without a word, and the bitmap loaded later as consistent,
/// missing every change made meanwhile. Given to the user, it loads.
#[test]
fn bitmaps_made_as_root_stop_the_start_as_another_user() {
    if !is_root() {
        skip("switching to an unprivileged user needs root");
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        skip("setpriv (util-linux) is not installed");
        return;
    }
    let dir = test_dir();
    let image = sparse_image(dir.path(), "disk.img", 32 * MIB);
    let api = dir.path().join("api.sock");
    let args = ["--api", api.to_str().unwrap()];
    let mut d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            image: Some(image.clone()),
            args: &args,
            ..DaemonOptions::default()
        },
    );
    ctl_ok(&api, &["bitmap", "add", "nightly"]);
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert!(st.success(), "{}", d.log());
    let sidecar = dir.path().join("disk.img.bitmap.nightly");
    assert_eq!(std::fs::metadata(&sidecar).unwrap().uid(), 0);

    for p in [dir.path(), image.as_path()] {
        chown(p, Some(NOBODY), Some(NOBODY)).expect("chown to nobody");
    }
    let uid = format!("--reuid={NOBODY}");
    let gid = format!("--regid={NOBODY}");
    let wrapper = ["setpriv", &uid, &gid, "--clear-groups", "--"];
    let line = serve_refused(
        dir.path(),
        &wrapper,
        &[
            "--image",
            image.to_str().unwrap(),
            "--api",
            api.to_str().unwrap(),
        ],
    );
    assert!(
        line.contains("disk.img.bitmap.nightly") && line.contains("chown 65534:65534"),
        "{line}"
    );

    chown(&sidecar, Some(NOBODY), Some(NOBODY)).unwrap();
    let mut d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            image: Some(image),
            args: &args,
            wrapper: &wrapper,
            ..DaemonOptions::default()
        },
    );
    assert_eq!(bitmap_state(&api, "nightly"), Some((0, true)));
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert!(st.success(), "{}", d.log());
}
