//! The vhost-user socket file has its `--socket-mode` from the moment it
//! exists, whatever the umask, and nothing sets the mode by path after
//! bind(2): a chmod by path would follow a directory swapped for a symlink
//! in between to a file of the swapper's choosing.
//!
//! Deterministic, with no sleeps: the daemon runs under a seccomp filter
//! that stops it in listen(2), the call right after the bind that created
//! the file, and hands each stop to this test (a seccomp user
//! notification). The test looks at the file, or swaps its directory,
//! while the daemon waits, then lets it go on.
//!
//! The same stop checks that a SIGTERM sent the moment the socket exists
//! is a clean stop.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{PermissionsExt, symlink};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use ringblk_testkit::{Daemon, DaemonOptions, test_dir};

/// Stops every listen(2) of the daemon's native ABI in a seccomp user
/// notification; lets every other syscall through.
static FILTER: [libc::sock_filter; 4] = [
    // A = seccomp_data.nr
    bpf(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0, 0, 0),
    bpf(
        libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K,
        0,
        1,
        libc::SYS_listen as u32,
    ),
    bpf(
        libc::BPF_RET | libc::BPF_K,
        0,
        0,
        libc::SECCOMP_RET_USER_NOTIF,
    ),
    bpf(libc::BPF_RET | libc::BPF_K, 0, 0, libc::SECCOMP_RET_ALLOW),
];

const fn bpf(code: u32, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    }
}

/// A seccomp listener in the making: the child installs the filter
/// before exec and sends the listener fd back over a socket pair.
struct ListenTrap {
    ours: OwnedFd,
    theirs: OwnedFd,
}

impl ListenTrap {
    fn new() -> ListenTrap {
        let mut fds = [0; 2];
        // SAFETY: socketpair writes two fds into the array, which has room
        // for two.
        let r = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0, "socketpair: {}", io::Error::last_os_error());
        // SAFETY: both fds were just created and are owned by nobody else.
        let (ours, theirs) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        ListenTrap { ours, theirs }
    }

    /// Makes `cmd` install the filter in its child, before exec.
    fn arm(&self, cmd: &mut Command) {
        let sock = self.theirs.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec. It
        // calls only async-signal-safe syscalls (prctl, seccomp, sendmsg,
        // close) on the static filter and stack memory, and allocates
        // nothing. `sock` stays open in the parent until the spawn is done.
        unsafe { cmd.pre_exec(move || install_filter(sock)) };
    }

    /// After the spawn: runs `at_listen` at each listen(2) of the daemon,
    /// while the daemon waits in it, until the returned guard is dropped.
    fn serve(self, mut at_listen: impl FnMut() + Send + 'static) -> Supervisor {
        drop(self.theirs);
        let listener = recv_fd(&self.ours).expect("the daemon's seccomp listener");
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let mut pfd = libc::pollfd {
                    fd: listener.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one pollfd, a live local.
                if unsafe { libc::poll(&mut pfd, 1, 50) } <= 0 || pfd.revents & libc::POLLIN == 0 {
                    continue;
                }
                // SAFETY: all-zero bytes are a valid seccomp_notif, and
                // NOTIF_RECV wants it zeroed.
                let mut req: libc::seccomp_notif = unsafe { std::mem::zeroed() };
                // SAFETY: NOTIF_RECV writes one seccomp_notif through the
                // pointer, which points to a live local of that type.
                let r = unsafe {
                    libc::ioctl(
                        listener.as_raw_fd(),
                        libc::SECCOMP_IOCTL_NOTIF_RECV,
                        &mut req,
                    )
                };
                if r != 0 {
                    continue; // the daemon died in the call
                }
                at_listen();
                let mut resp = libc::seccomp_notif_resp {
                    id: req.id,
                    val: 0,
                    error: 0,
                    flags: libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE as u32,
                };
                // SAFETY: NOTIF_SEND reads one seccomp_notif_resp through
                // the pointer, which points to a live local of that type.
                unsafe {
                    libc::ioctl(
                        listener.as_raw_fd(),
                        libc::SECCOMP_IOCTL_NOTIF_SEND,
                        &mut resp,
                    )
                };
            }
        });
        Supervisor {
            stop,
            thread: Some(thread),
        }
    }
}

/// Stops serving the daemon's listen(2) calls when dropped.
struct Supervisor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// In the child: installs [`FILTER`] with a user-notification listener
/// and sends the listener to the test over `sock`.
fn install_filter(sock: RawFd) -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let prog = libc::sock_fprog {
        len: FILTER.len() as u16,
        filter: FILTER.as_ptr().cast_mut(),
    };
    // SAFETY: seccomp reads the sock_fprog, a live local, and the filter
    // it points to, a static the kernel copies and never writes.
    let listener = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
            &prog,
        )
    };
    if listener < 0 {
        return Err(io::Error::last_os_error());
    }
    let listener = listener as RawFd;
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u64; 4];
    // SAFETY: all-zero bytes are a valid msghdr.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is arithmetic.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) } as usize;
    // SAFETY: the control buffer (32 bytes, 8-aligned) holds one header
    // and one fd (CMSG_SPACE(4) is 24 bytes), so the header and its data
    // written here lie inside it; sendmsg reads only live locals.
    let sent = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as usize;
        libc::CMSG_DATA(c).cast::<RawFd>().write_unaligned(listener);
        libc::sendmsg(sock, &msg, 0)
    };
    let err = io::Error::last_os_error();
    // SAFETY: the listener is ours; the test has its own copy now.
    unsafe { libc::close(listener) };
    if sent < 0 { Err(err) } else { Ok(()) }
}

/// The fd sent by [`install_filter`], waiting up to 20 s for it.
fn recv_fd(sock: &OwnedFd) -> io::Result<OwnedFd> {
    let mut pfd = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd, a live local.
    if unsafe { libc::poll(&mut pfd, 1, 20_000) } != 1 {
        return Err(io::Error::other("no seccomp listener from the daemon"));
    }
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u64; 4];
    // SAFETY: all-zero bytes are a valid msghdr.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&control);
    // SAFETY: recvmsg writes into the iovec's byte and the control
    // buffer, live locals of the sizes given.
    if unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) } < 1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: recvmsg filled msg_control/msg_controllen; CMSG_FIRSTHDR
    // returns null or a header inside the buffer.
    let c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    // SAFETY: c is null or points into `control`, checked before use; an
    // SCM_RIGHTS header of this length carries one fd, now ours.
    unsafe {
        if c.is_null() || (*c).cmsg_level != libc::SOL_SOCKET || (*c).cmsg_type != libc::SCM_RIGHTS
        {
            return Err(io::Error::other("no fd in the message"));
        }
        Ok(OwnedFd::from_raw_fd(
            libc::CMSG_DATA(c).cast::<RawFd>().read_unaligned(),
        ))
    }
}

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
        let trap = ListenTrap::new();
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

    let trap = ListenTrap::new();
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
    let trap = ListenTrap::new();
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
