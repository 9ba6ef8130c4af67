//! The vhost-user socket file has its `--socket-mode` from the moment it
//! exists, whatever the umask, and nothing sets the mode by path after
//! bind(2): a chmod by path would follow a directory swapped for a symlink
//! in between to a file of the swapper's choosing.
//!
//! Deterministic, with no sleeps: the daemon runs under a seccomp filter
//! that stops it in listen(2), the call right after the bind that created
//! the file, and hands each stop to this test (a seccomp user
//! notification, [`crate::trap`]). The test looks at the file, or swaps
//! its directory, while the daemon waits, then lets it go on.
//!
//! The same stop checks that a SIGTERM sent the moment the socket exists
//! is a clean stop.

use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ringblk_testkit::{Daemon, DaemonOptions, test_dir};

use crate::trap::{Answer, SyscallTrap};

/// Sets the child's umask before exec.
fn set_umask(cmd: &mut Command, mask: libc::mode_t) {
    // SAFETY: umask is async-signal-safe, takes no pointers and cannot fail.
    unsafe {
        cmd.pre_exec(move || {
            libc::umask(mask);
            Ok(())
        })
    };
}

fn mode_of(path: &Path) -> Option<u32> {
    fs::symlink_metadata(path)
        .ok()
        .map(|m| m.permissions().mode() & 0o777)
}

/// The socket exists with the mode asked for, not the umask's: from its
/// first moment (seen at listen(2), before bind() returns to the daemon)
/// to after start-up. Under umask 000 the old daemon's socket was briefly
/// 0777, connectable by every local user; under umask 077 a 660 socket
/// was briefly 0700.
#[test]
fn the_socket_is_born_with_its_mode() {
    for (umask, mode) in [(0o000, 0o600), (0o077, 0o660), (0o022, 0o666)] {
        let dir = test_dir();
        let socket = dir.path().join("vhost.sock");
        let mode_arg = format!("{mode:o}");
        let trap = SyscallTrap::new(libc::SYS_listen);
        let mut d = Daemon::spawn_in(
            dir.path(),
            DaemonOptions {
                args: &["--socket-mode", &mode_arg],
                configure: Some(&|cmd: &mut Command| {
                    set_umask(cmd, umask);
                    trap.arm(cmd);
                }),
                ..DaemonOptions::default()
            },
        );
        let born = Arc::new(Mutex::new(None));
        let seen = born.clone();
        let path = socket.clone();
        let supervisor = trap.serve(move || {
            let mut seen = seen.lock().unwrap();
            if seen.is_none() {
                *seen = mode_of(&path);
            }
            Answer::Continue
        });
        d.wait_until_ready();
        drop(supervisor);
        let born = born
            .lock()
            .unwrap()
            .expect("the socket existed at listen(2)");
        assert_eq!(
            born, mode,
            "umask {umask:03o}, --socket-mode {mode:03o}: the socket was born {born:03o}"
        );
        assert_eq!(
            mode_of(&socket),
            Some(mode),
            "umask {umask:03o}: after start-up"
        );
    }
}

/// A directory swapped for a symlink between bind(2) and the daemon's
/// next step takes no chmod to the symlink's target. The old daemon did
/// bind, then chmod(path): the test, stopping it in between exactly as a
/// local attacker who owns the socket's directory could race it, got the
/// mode of a file of its choosing set to the socket's.
#[test]
fn the_socket_mode_does_not_follow_a_swapped_directory() {
    let dir = test_dir();
    let sock_dir = dir.path().join("s");
    let moved = dir.path().join("s.moved");
    let victim_dir = dir.path().join("victim");
    fs::create_dir(&sock_dir).unwrap();
    fs::create_dir(&victim_dir).unwrap();
    let victim = victim_dir.join("vhost.sock");
    fs::write(&victim, b"not the daemon's").unwrap();
    fs::set_permissions(&victim, fs::Permissions::from_mode(0o600)).unwrap();
    let socket: PathBuf = sock_dir.join("vhost.sock");
    let socket_arg = socket.to_str().unwrap().to_string();

    let trap = SyscallTrap::new(libc::SYS_listen);
    let mut d = Daemon::spawn_in(
        dir.path(),
        DaemonOptions {
            // Later options win: this --socket replaces the fixture's.
            args: &["--socket", &socket_arg, "--socket-mode", "666"],
            configure: Some(&|cmd: &mut Command| trap.arm(cmd)),
            ..DaemonOptions::default()
        },
    );
    let swapped = Arc::new(AtomicBool::new(false));
    let (done, sock_dir2, moved2, victim_dir2, socket2) = (
        swapped.clone(),
        sock_dir.clone(),
        moved.clone(),
        victim_dir.clone(),
        socket.clone(),
    );
    let supervisor = trap.serve(move || {
        if !done.load(Ordering::Relaxed) && socket2.exists() {
            fs::rename(&sock_dir2, &moved2).unwrap();
            symlink(&victim_dir2, &sock_dir2).unwrap();
            done.store(true, Ordering::Relaxed);
        }
        Answer::Continue
    });
    d.wait_for_log("Connect QEMU with");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !swapped.load(Ordering::Relaxed) {
        assert!(Instant::now() < deadline, "the daemon never listened");
        thread::sleep(Duration::from_millis(10));
    }
    drop(supervisor);
    let victim_mode = mode_of(&victim).expect("the victim file is still there");
    assert_eq!(
        victim_mode,
        0o600,
        "the socket's mode went through the swapped directory: {} is now {victim_mode:03o}",
        victim.display()
    );
    assert_eq!(fs::read(&victim).unwrap(), b"not the daemon's");
    let real = moved.join("vhost.sock");
    assert_eq!(mode_of(&real), Some(0o666), "the daemon's own socket");
    d.assert_running();
}

/// SIGTERM sent the moment the socket exists (a service manager or a
/// script that waits for the file, then stops the daemon) is a clean stop:
/// exit 0, the socket removed. The daemon used to register its handler
/// only after binding, so a SIGTERM in between took the default action and
/// left the socket behind; CI caught it once in a test that stopped a
/// daemon right after its start.
#[test]
fn a_sigterm_at_listen_is_a_clean_stop() {
    let dir = test_dir();
    let socket = dir.path().join("vhost.sock");
    let trap = SyscallTrap::new(libc::SYS_listen);
    let mut d = Daemon::spawn_in(
        dir.path(),
        DaemonOptions {
            configure: Some(&|cmd: &mut Command| trap.arm(cmd)),
            ..DaemonOptions::default()
        },
    );
    let pid = libc::pid_t::try_from(d.pid()).expect("pid fits pid_t");
    let sent = Arc::new(AtomicBool::new(false));
    let (done, path) = (sent.clone(), socket.clone());
    // Only at the vhost-user socket's listen(2): the daemon's inner socket
    // listens earlier, before it has read its arguments.
    let supervisor = trap.serve(move || {
        if !done.load(Ordering::Relaxed) && path.exists() {
            // SAFETY: kill(2) takes no pointers; the daemon is stopped in
            // listen(2), not reaped, so the pid is its own.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            done.store(true, Ordering::Relaxed);
        }
        Answer::Continue
    });
    // Signal 0 sends nothing: the daemon stops on the SIGTERM above.
    let st = d.signal_and_wait(0, Duration::from_secs(20));
    drop(supervisor);
    assert!(sent.load(Ordering::Relaxed), "the daemon never listened");
    assert_eq!(
        st.code(),
        Some(0),
        "SIGTERM at listen(2): {st}\n{}",
        d.log()
    );
    assert!(!socket.exists(), "the socket was left behind");
}
