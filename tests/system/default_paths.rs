//! `ringblk serve` without `--socket` and `--image` puts both in a
//! directory private to its user, and refuses one that another user could
//! have prepared: a real daemon, steered by `XDG_RUNTIME_DIR` and `TMPDIR`
//! to directories of the test (never the real `/run` or `/tmp`).
//!
//! The tests that switch users (a daemon as `nobody`, a directory of
//! another owner) need root and setpriv (util-linux); they are skipped
//! otherwise, except where `CI` is set: there they fail.

use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, chown, symlink};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use ringblk_testkit::{
    Client, Daemon, DaemonOptions, MIB, assert_pattern, is_root, pattern, ringblk_bin, skip,
    test_dir,
};

const NOBODY: u32 = 65534;
const AS_NOBODY: &[&str] = &[
    "setpriv",
    "--reuid=65534",
    "--regid=65534",
    "--clear-groups",
    "--",
];

fn euid() -> u32 {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() }
}

fn chmod(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

fn mode(path: &Path) -> u32 {
    fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("lstat {}: {e}", path.display()))
        .mode()
        & 0o7777
}

/// A stand-in for the user's runtime directory: ours, 0700.
fn runtime_dir(root: &Path) -> PathBuf {
    let xdg = root.join("xdg");
    fs::create_dir(&xdg).unwrap();
    chmod(&xdg, 0o700);
    xdg
}

/// Whether the tests that switch users can run; says why not otherwise.
fn can_switch_users() -> bool {
    if !is_root() {
        skip("switching to an unprivileged user needs root");
        return false;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        skip("setpriv (util-linux) is not installed");
        return false;
    }
    true
}

/// Runs `ringblk serve` (through `wrapper`) on its default paths, with
/// `env`, expecting it to refuse to start: returns its stderr once it has
/// exited with status 1. A daemon that starts serving instead fails the
/// test (and leaves its inner socket in `dir`, not in /tmp).
fn refused(dir: &Path, wrapper: &[&str], env: &[(&str, Option<&OsStr>)]) -> String {
    let mut cmd = match wrapper.split_first() {
        Some((program, pre)) => {
            let mut cmd = Command::new(program);
            cmd.args(pre).arg(ringblk_bin());
            cmd
        }
        None => Command::new(ringblk_bin()),
    };
    // What a user sees: the default log filter.
    cmd.args(["serve", "--size", "16M"])
        .env_remove("RUST_LOG")
        .env("TMPDIR", dir);
    for (name, value) in env {
        match value {
            Some(v) => cmd.env(name, v),
            None => cmd.env_remove(name),
        };
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning ringblk serve");
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("polling ringblk").is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("ringblk's output");
            panic!(
                "ringblk serve started instead of refusing; its output:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("ringblk's output");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "not one line:\n{err}");
    assert!(out.stdout.is_empty(), "stdout: {:?}", out.stdout);
    err.trim_end().to_string()
}

/// Writes, flushes and reads back through the daemon's socket.
fn serves_io(d: &Daemon) {
    let mut c = Client::connect(&d.socket, 64 * 1024);
    assert_eq!(c.write(MIB, &pattern(5, MIB, 64 * 1024)), 0, "write");
    assert_eq!(c.flush(), 0, "flush");
    assert_pattern("read back", 5, MIB, &c.read(MIB, 64 * 1024));
}

/// The default socket and image go in `$XDG_RUNTIME_DIR/ringblk`, made
/// 0700; the image is created 0600 and the socket 0600, and the daemon
/// prints the socket's real path in its "Connect QEMU with" line (which
/// the fixture reads the paths from).
#[test]
fn the_defaults_go_in_a_private_directory() {
    let root = test_dir();
    let xdg = runtime_dir(root.path());
    let mut d = Daemon::start_in(
        root.path(),
        DaemonOptions {
            size: 16 * MIB,
            default_paths: true,
            env: &[("XDG_RUNTIME_DIR", Some(xdg.as_os_str()))],
            ..DaemonOptions::default()
        },
    );
    let dir = xdg.join("ringblk");
    assert_eq!(d.socket, dir.join("vhost.sock"), "the announced socket");
    assert_eq!(d.image, dir.join("disk.img"), "the announced image");
    let meta = fs::symlink_metadata(&dir).expect("the private directory");
    assert!(meta.is_dir());
    assert_eq!(meta.uid(), euid(), "directory owner");
    assert_eq!(mode(&dir), 0o700, "directory mode");
    assert_eq!(mode(&d.image), 0o600, "a created image is the owner's only");
    assert_eq!(fs::metadata(&d.image).unwrap().len(), 16 * MIB);
    assert_eq!(mode(&d.socket), 0o600, "socket mode");
    serves_io(&d);
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert_eq!(st.code(), Some(0), "exit after SIGTERM: {st}\n{}", d.log());
    assert!(!d.socket.exists(), "socket left behind");
}

/// A symlink where the default image goes is refused, not followed: its
/// target is neither served, written nor created.
#[test]
fn a_symlink_at_the_default_image_is_refused() {
    let root = test_dir();
    let xdg = runtime_dir(root.path());
    let dir = xdg.join("ringblk");
    fs::create_dir(&dir).unwrap();
    chmod(&dir, 0o700);
    let victim = root.path().join("victim.img");
    fs::write(&victim, vec![0xab; MIB as usize]).unwrap();
    chmod(&victim, 0o640);
    let absent = root.path().join("absent.img");
    let link = dir.join("disk.img");
    for target in [&victim, &absent] {
        let _ = fs::remove_file(&link);
        symlink(target, &link).unwrap();
        let err = refused(
            root.path(),
            &[],
            &[("XDG_RUNTIME_DIR", Some(xdg.as_os_str()))],
        );
        assert_eq!(
            err,
            format!(
                "ringblk: image {} is a symbolic link; refusing to follow it",
                link.display()
            ),
            "link to {}",
            target.display()
        );
    }
    assert_eq!(fs::read(&victim).unwrap(), vec![0xab; MIB as usize]);
    assert_eq!(mode(&victim), 0o640, "the target's mode");
    assert!(!absent.exists(), "created through the link");
    assert!(!dir.join("vhost.sock").exists(), "listened anyway");
}

/// A default directory that is a symlink, or writable by group or
/// others, or (with root) owned by another user, is refused with one
/// line and exit status 1, and nothing is put in it.
#[test]
fn a_default_directory_we_cannot_trust_is_refused() {
    let root = test_dir();
    let xdg = runtime_dir(root.path());
    let env = [("XDG_RUNTIME_DIR", Some(xdg.as_os_str()))];
    let dir = xdg.join("ringblk");
    fs::create_dir(&dir).unwrap();
    let shown = dir.display();
    for (m, who) in [
        (0o770, "its group"),
        (0o703, "others"),
        (0o777, "its group and others"),
    ] {
        chmod(&dir, m);
        assert_eq!(
            refused(root.path(), &[], &env),
            format!("ringblk: {shown}: writable by {who} (mode {m:04o}); refusing to use it")
        );
    }
    if can_switch_users() {
        chmod(&dir, 0o700);
        chown(&dir, Some(NOBODY), Some(NOBODY)).unwrap();
        assert_eq!(
            refused(root.path(), &[], &env),
            format!(
                "ringblk: {shown}: owned by uid {NOBODY}, not by us (uid 0); refusing to use it"
            )
        );
    }
    assert_eq!(
        fs::read_dir(&dir).unwrap().count(),
        0,
        "put something in it"
    );

    fs::remove_dir(&dir).unwrap();
    let elsewhere = root.path().join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    chmod(&elsewhere, 0o700);
    symlink(&elsewhere, &dir).unwrap();
    assert_eq!(
        refused(root.path(), &[], &env),
        format!("ringblk: {shown}: a symbolic link; refusing to use it")
    );
    assert_eq!(fs::read_dir(&elsewhere).unwrap().count(), 0);
}

/// A user with no usable runtime directory (here: XDG_RUNTIME_DIR names a
/// directory of root's) gets `ringblk-UID` in the temporary directory,
/// its own and private.
#[test]
fn without_a_runtime_directory_a_user_gets_one_of_their_own_in_tmp() {
    if !can_switch_users() {
        return;
    }
    let root = test_dir();
    chmod(root.path(), 0o755);
    let tmp = root.path().join("tmp");
    fs::create_dir(&tmp).unwrap();
    chmod(&tmp, 0o1777);
    let roots = runtime_dir(root.path());
    let mut d = Daemon::start_in(
        root.path(),
        DaemonOptions {
            size: 16 * MIB,
            default_paths: true,
            wrapper: AS_NOBODY,
            env: &[
                ("XDG_RUNTIME_DIR", Some(roots.as_os_str())),
                ("TMPDIR", Some(tmp.as_os_str())),
            ],
            ..DaemonOptions::default()
        },
    );
    d.wait_for_log("not using XDG_RUNTIME_DIR");
    let dir = tmp.join(format!("ringblk-{NOBODY}"));
    assert_eq!(d.socket, dir.join("vhost.sock"), "the announced socket");
    assert_eq!(d.image, dir.join("disk.img"), "the announced image");
    for (path, m) in [(&dir, 0o700), (&d.image, 0o600), (&d.socket, 0o600)] {
        let meta = fs::symlink_metadata(path).unwrap();
        assert_eq!(meta.uid(), NOBODY, "owner of {}", path.display());
        assert_eq!(mode(path), m, "mode of {}", path.display());
    }
    assert!(!roots.join("ringblk").exists());
    serves_io(&d);
}

/// The attack on a shared /tmp: another user made our directory first
/// (or a link in its place). The daemon refuses it instead of using it.
#[test]
fn a_directory_another_user_made_in_tmp_is_refused() {
    if !can_switch_users() {
        return;
    }
    let root = test_dir();
    chmod(root.path(), 0o755);
    let tmp = root.path().join("tmp");
    fs::create_dir(&tmp).unwrap();
    chmod(&tmp, 0o1777);
    let env = [("XDG_RUNTIME_DIR", None), ("TMPDIR", Some(tmp.as_os_str()))];
    let planted = tmp.join(format!("ringblk-{NOBODY}"));
    fs::create_dir(&planted).unwrap();
    chmod(&planted, 0o755);
    chown(&planted, Some(1234), Some(1234)).unwrap();
    assert_eq!(
        refused(root.path(), AS_NOBODY, &env),
        format!(
            "ringblk: {}: owned by uid 1234, not by us (uid {NOBODY}); refusing to use it",
            planted.display()
        )
    );
    assert_eq!(fs::read_dir(&planted).unwrap().count(), 0);
    fs::remove_dir(&planted).unwrap();
    let theirs = root.path().join("theirs");
    fs::create_dir(&theirs).unwrap();
    chmod(&theirs, 0o777);
    symlink(&theirs, &planted).unwrap();
    assert_eq!(
        refused(root.path(), AS_NOBODY, &env),
        format!(
            "ringblk: {}: a symbolic link; refusing to use it",
            planted.display()
        )
    );
    assert_eq!(fs::read_dir(&theirs).unwrap().count(), 0);
}
