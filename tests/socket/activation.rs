//! Socket activation and readiness, without systemd: the test makes the
//! listening socket and passes it in, as `--socket-fd N` and as systemd
//! does (fd 3, LISTEN_FDS, LISTEN_PID), and a blkio client does I/O
//! through it; it binds the notification socket (a path, and an abstract
//! one) and reads READY=1, then STOPPING=1 after SIGTERM. Under the
//! seccomp filter in its default enforcing mode.

use std::os::fd::{AsRawFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram, UnixListener};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use ringblk_testkit::{
    Client, Daemon, DaemonOptions, MIB, pattern, ringblk_bin, sparse_image, test_dir,
};

const SIZE: u64 = 32 * MIB;

/// Puts `fd` at `target` in the child, inheritable (not close-on-exec).
fn pass_fd(cmd: &mut Command, fd: RawFd, target: RawFd) {
    // SAFETY: the closure runs in the child between fork and exec and
    // calls only dup2 and fcntl, which are async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            if fd == target {
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, target) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn expect_notification(sock: &UnixDatagram, want: &str) {
    let mut buf = [0u8; 256];
    let n = sock
        .recv(&mut buf)
        .unwrap_or_else(|e| panic!("no {want} on NOTIFY_SOCKET: {e}"));
    let got = String::from_utf8_lossy(&buf[..n]);
    assert!(
        got.lines().any(|l| l == want),
        "expected {want}, got {got:?}"
    );
}

/// Serves through `listener` (passed as `how`), does I/O, stops with
/// SIGTERM, and checks the notifications on `notify` and that the
/// daemon left the passed socket where it was.
fn serve_passed(
    dir: &Path,
    listener: &UnixListener,
    args: &[&str],
    wrapper: &[&str],
    target: RawFd,
    notify: (&UnixDatagram, &std::ffi::OsStr),
) {
    let image = sparse_image(dir, "passed.img", SIZE);
    let mut all = vec!["--image", image.to_str().unwrap()];
    all.extend_from_slice(args);
    let fd = listener.as_raw_fd();
    let configure = move |cmd: &mut Command| pass_fd(cmd, fd, target);
    let env = [("NOTIFY_SOCKET", Some(notify.1))];
    let mut d = Daemon::start_in(
        dir,
        DaemonOptions {
            args: &all,
            wrapper,
            default_paths: true,
            env: &env,
            configure: Some(&configure),
            ..DaemonOptions::default()
        },
    );
    let path = listener.local_addr().unwrap();
    assert_eq!(Some(d.socket.as_path()), path.as_pathname(), "announced");
    expect_notification(notify.0, "READY=1");
    let mut c = Client::connect(&d.socket, 64 << 10);
    assert_eq!(c.capacity, SIZE);
    let data = pattern(3, 4096, 64 << 10);
    assert_eq!(c.write(4096, &data), 0);
    assert_eq!(c.read(4096, data.len()), data);
    drop(c);
    let status = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(10));
    assert!(status.success(), "{status}");
    expect_notification(notify.0, "STOPPING=1");
    assert!(
        path.as_pathname().unwrap().exists(),
        "a socket passed in is not the daemon's to remove"
    );
    assert_eq!(d.read_image(4096, data.len()), data);
}

#[test]
fn socket_fd_and_a_notify_path() {
    let dir = test_dir();
    let listener = UnixListener::bind(dir.path().join("passed.sock")).unwrap();
    let notify_path = dir.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // Not 3: any number the caller picks.
    serve_passed(
        dir.path(),
        &listener,
        &["--socket-fd", "7"],
        &[],
        7,
        (&notify, notify_path.as_os_str()),
    );
}

#[test]
fn systemd_listen_fds_and_an_abstract_notify_socket() {
    let dir = test_dir();
    let listener = UnixListener::bind(dir.path().join("activated.sock")).unwrap();
    let name = format!("ringblk-test-notify-{}", std::process::id());
    let notify =
        UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let at = format!("@{name}");
    // LISTEN_PID is the daemon's own pid, which only the child knows: the
    // shell sets it and execs the daemon, keeping its pid.
    serve_passed(
        dir.path(),
        &listener,
        &[],
        &[
            "sh",
            "-c",
            "LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=vhost exec \"$0\" \"$@\"",
        ],
        3,
        (&notify, std::ffi::OsStr::new(&at)),
    );
}

/// What is not a listening Unix stream socket is refused with one line.
#[test]
fn a_bad_socket_fd_is_refused_clearly() {
    let dir = test_dir();
    let image = sparse_image(dir.path(), "d.img", SIZE);
    let stream = std::os::unix::net::UnixStream::pair().unwrap().0;
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let cases: [(RawFd, &str); 4] = [
        (0, "not a socket"),
        (stream.as_raw_fd(), "not listening"),
        (udp.as_raw_fd(), "not a Unix socket"),
        (900, "not an open file descriptor"),
    ];
    for (fd, what) in cases {
        let mut cmd = Command::new(ringblk_bin());
        cmd.args(["serve", "--image", image.to_str().unwrap(), "--socket-fd"])
            .arg(fd.to_string())
            .stdin(std::process::Stdio::null());
        if fd > 2 && fd < 900 {
            pass_fd(&mut cmd, fd, fd);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "fd {fd}: {err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.starts_with("ringblk: "), "{err}");
        assert!(last.contains(what), "fd {fd}: '{what}' not in {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // --socket and --socket-fd together: a usage error.
    let out = Command::new(ringblk_bin())
        .args(["serve", "--socket", "x.sock", "--socket-fd", "3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
}

/// `--socket-fd` names a socket the daemon was given, never one it made:
/// the numbers its own descriptors get (the API's listener, the metrics
/// socket, the image, the notification socket) are refused with one line.
/// The fd used to be adopted after the API was bound, so the number of
/// the API's listener was taken, and the relay served the API's clients
/// as vhost-user front-ends.
#[test]
fn socket_fd_cannot_name_a_descriptor_of_the_daemons_own() {
    let dir = test_dir();
    let image = sparse_image(dir.path(), "d.img", SIZE);
    let notify = UnixDatagram::bind(dir.path().join("notify.sock")).unwrap();
    // Every number the daemon's first descriptors could get.
    for fd in 3..24 {
        let api = dir.path().join(format!("api-{fd}.sock"));
        let metrics = dir.path().join(format!("metrics-{fd}.sock"));
        let mut cmd = Command::new(ringblk_bin());
        // What the test's own process left inheritable (cargo's jobserver
        // pipes) is not passed on: the daemon starts with 0-2 only.
        // SAFETY: the closure runs in the child between fork and exec and
        // makes one raw syscall, which is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .args(["serve", "--image", image.to_str().unwrap()])
            .arg("--api")
            .arg(&api)
            .arg("--metrics")
            .arg(&metrics)
            .arg("--socket-fd")
            .arg(fd.to_string())
            .env("NOTIFY_SOCKET", dir.path().join("notify.sock"))
            .env("TMPDIR", dir.path())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "--socket-fd {fd}: the daemon took a descriptor of its own ({}) and served it",
                    if api.exists() {
                        "its API socket is bound"
                    } else {
                        "still running"
                    }
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert_eq!(status.code(), Some(1), "--socket-fd {fd}: {err}");
        assert_eq!(
            err.lines().count(),
            1,
            "--socket-fd {fd}: not one line: {err}"
        );
        assert!(
            err.starts_with("ringblk: ") && err.contains("not an open file descriptor"),
            "--socket-fd {fd}: {err}"
        );
        assert!(!api.exists(), "--socket-fd {fd}: the API was bound first");
    }
    drop(notify);
}
