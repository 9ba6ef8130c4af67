//! The filters, compiled and run: each test forks a child that installs
//! both of the daemon's filters (made in the child, for its own pid) and
//! makes the calls in question; the parent reads how the child ended and
//! what it wrote to stderr.

use std::os::fd::AsRawFd;

use super::*;

/// How a child ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// Its test function returned this.
    Returned(bool),
    /// It exited with this status without returning (a trapped syscall
    /// exits with EXIT_BAD_SYSCALL).
    Exited(i32),
    /// A signal killed it.
    Killed(i32),
}

const TRAPPED: Ended = Ended::Exited(EXIT_BAD_SYSCALL);

/// What a child installs: the action for a syscall off the list, the
/// profile, the unlink directories.
struct Under<'a>(SeccompAction, Profile, &'a [i32]);

const FILE: Under<'static> = Under(SeccompAction::Trap, Profile::File, &[]);
const RBD: Under<'static> = Under(SeccompAction::Trap, Profile::Rbd, &[]);

/// Runs `f` in a forked child under `under`; how it ended, and its stderr.
fn run(under: &Under, f: impl FnOnce() -> bool) -> (Ended, String) {
    run_after(|| {}, under, f)
}

/// [`run`], with `before` run in the child before the filters, as the
/// daemon's start-up runs before them.
fn run_after(before: impl FnOnce(), under: &Under, f: impl FnOnce() -> bool) -> (Ended, String) {
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two descriptors pipe(2) returns.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the child compiles the filters (glibc's fork leaves malloc
    // usable in the child), installs them, runs `f` (syscalls on
    // descriptors the parent made, no lock another thread may hold) and
    // leaves with _exit; it never returns into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: fds[1] is the pipe's write end; stderr becomes it.
        unsafe { libc::dup2(fds[1], libc::STDERR_FILENO) };
        before();
        // SAFETY: getpid takes no pointers.
        let me = unsafe { libc::getpid() };
        let Under(action, profile, dirs) = under;
        let installed = install_sigsys_handler().is_ok()
            && [
                compile_no_clone3(),
                compile(action.clone(), *profile, Extras::NONE, dirs, None, me),
            ]
            .iter()
            .all(|p| {
                p.as_ref()
                    .is_ok_and(|p| seccompiler::apply_filter(p).is_ok())
            });
        let code = match (installed, installed && f()) {
            (false, _) => 99,
            (true, true) => 0,
            (true, false) => 1,
        };
        // SAFETY: _exit is async-signal-safe and never returns.
        unsafe { libc::_exit(code) };
    }
    // SAFETY: closing our copy of the write end, which we own.
    unsafe { libc::close(fds[1]) };
    let mut err = Vec::new();
    // SAFETY: fds[0] is the read end, which we own; File takes it over.
    let mut r = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fds[0]) };
    std::io::Read::read_to_end(&mut r, &mut err).unwrap();
    let mut status = 0;
    // SAFETY: pid is our child; status is a valid out-pointer.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    let ended = if libc::WIFSIGNALED(status) {
        Ended::Killed(libc::WTERMSIG(status))
    } else {
        match libc::WEXITSTATUS(status) {
            0 => Ended::Returned(true),
            1 => Ended::Returned(false),
            code => Ended::Exited(code),
        }
    };
    (ended, String::from_utf8_lossy(&err).into_owned())
}

/// [`run`], when only the ending matters.
fn ends(under: &Under, f: impl FnOnce() -> bool) -> Ended {
    run(under, f).0
}

fn need_seccomp() -> bool {
    if kernel_has_seccomp() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "the kernel has no seccomp filter support"
    );
    eprintln!("skipped: the kernel has no seccomp");
    false
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn nrs(profile: Profile) -> Vec<i64> {
    allowed(profile, Extras::NONE, &[3], None, 1)
        .iter()
        .map(|(nr, _)| *nr)
        .collect()
}

#[test]
fn filters_compile_and_list_each_syscall_once() {
    assert!(!compile_no_clone3().unwrap().is_empty());
    for profile in [Profile::File, Profile::Rbd] {
        for action in [SeccompAction::Trap, SeccompAction::Log] {
            let p = compile(action, profile, Extras::NONE, &[3], None, 1).unwrap();
            assert!(!p.is_empty());
        }
        let mut nrs = nrs(profile);
        let n = nrs.len();
        nrs.sort_unstable();
        nrs.dedup();
        assert_eq!(nrs.len(), n, "{profile:?}: a syscall is listed twice");
    }
}

/// The RBD profile adds to the file one and takes nothing away; the
/// file profile makes no socket at all, the RBD one TCP sockets only.
#[test]
fn rbd_profile_is_the_file_profile_plus_librbd() {
    let (file, rbd) = (nrs(Profile::File), nrs(Profile::Rbd));
    assert!(file.iter().all(|nr| rbd.contains(nr)));
    for nr in [
        libc::SYS_poll,
        libc::SYS_getsockname,
        libc::SYS_socket,
        libc::SYS_connect,
    ] {
        assert!(rbd.contains(&nr) && !file.contains(&nr), "syscall {nr}");
    }
    if !need_seccomp() {
        return;
    }
    let socket = |family, kind| {
        move || {
            // SAFETY: socket takes no pointers; the fd is closed at once.
            let fd = unsafe { libc::socket(family, kind | libc::SOCK_CLOEXEC, 0) };
            // SAFETY: closing the fd just made, if any.
            fd >= 0 && unsafe { libc::close(fd) } == 0
        }
    };
    let tcp = socket(libc::AF_INET, libc::SOCK_STREAM);
    let tcp6 = socket(libc::AF_INET6, libc::SOCK_STREAM);
    let udp = socket(libc::AF_INET, libc::SOCK_DGRAM);
    let unix = socket(libc::AF_UNIX, libc::SOCK_STREAM);
    assert_eq!(ends(&FILE, tcp), TRAPPED);
    assert_eq!(ends(&FILE, unix), TRAPPED, "a Unix socket");
    assert_eq!(ends(&RBD, tcp), Ended::Returned(true));
    // A host without IPv6 fails the call (EAFNOSUPPORT); not trapped.
    assert!(matches!(ends(&RBD, tcp6), Ended::Returned(_)));
    assert_eq!(ends(&RBD, udp), TRAPPED, "a UDP socket");
    assert_eq!(ends(&RBD, unix), TRAPPED, "a Unix socket");
}

/// The finding: connect(2) to any Unix socket path was allowed, so a
/// daemon taken over could reach whatever its user may (as root:
/// systemd's, dbus's or another VM's QEMU monitor socket). Now the file
/// profile has neither `socket` nor `connect`: not with a new socket, not
/// with one made before the filter; the RBD profile makes no Unix socket.
#[test]
fn no_unix_connect_under_the_filter() {
    use std::os::unix::net::{UnixListener, UnixStream};
    if !need_seccomp() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("monitor.sock");
    let _listener = UnixListener::bind(&path).unwrap();
    let connect = || UnixStream::connect(&path).is_ok();
    assert_eq!(ends(&FILE, connect), TRAPPED, "connect to a Unix socket");
    assert_eq!(
        ends(&RBD, connect),
        TRAPPED,
        "RBD: connect to a Unix socket"
    );
    // SAFETY: socket takes no pointers; the test owns the new fd.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0);
    let addr = crate::daemon::connector::sockaddr(&path).unwrap();
    let connect_old = || {
        // SAFETY: `addr` is a valid sockaddr_un of the given length.
        unsafe { libc::connect(fd, (&raw const addr.0).cast(), addr.1) == 0 }
    };
    assert_eq!(
        ends(&FILE, connect_old),
        TRAPPED,
        "connect on an old socket"
    );
    // SAFETY: closing the fd made above.
    unsafe { libc::close(fd) };
}

/// sendto(2) with an address is refused: it would let a datagram socket
/// made at start-up (sd_notify's) write to any datagram socket path.
/// send(2), sendto with none, still works.
#[test]
fn sendto_only_without_an_address() {
    use std::os::unix::net::UnixDatagram;
    if !need_seccomp() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (ours, theirs) = (dir.path().join("notify"), dir.path().join("journal"));
    let notify = UnixDatagram::bind(&ours).unwrap();
    let _journal = UnixDatagram::bind(&theirs).unwrap();
    let sock = UnixDatagram::unbound().unwrap();
    sock.connect(&ours).unwrap();
    assert_eq!(
        ends(&FILE, || sock.send(b"READY=1").is_ok()),
        Ended::Returned(true)
    );
    let mut buf = [0u8; 16];
    assert_eq!(notify.recv(&mut buf).unwrap(), 7);
    let elsewhere = || sock.send_to(b"forged", &theirs).is_ok();
    assert_eq!(ends(&FILE, elsewhere), TRAPPED);
}

/// The finding: clone3 was allowed with any arguments, so the daemon
/// could fork, or make a process in new namespaces. Now clone3 answers
/// ENOSYS whatever it is asked, threads still start (glibc falls back to
/// clone), and clone, fork and unshare for anything but a thread trap.
#[test]
fn threads_start_but_nothing_forks_or_unshares() {
    if !need_seccomp() {
        return;
    }
    // struct clone_args (linux/sched.h): flags, pidfd, child_tid,
    // parent_tid, exit_signal, stack, stack_size, tls.
    let clone3 = |flags: u64| {
        move || {
            let mut args = [0u64; 8];
            args[0] = flags;
            args[4] = libc::SIGCHLD as u64;
            // SAFETY: `args` is a valid clone_args of the size given; no
            // stack (0) means the child runs on a copy of ours, like fork.
            let r = unsafe { libc::syscall(libc::SYS_clone3, args.as_mut_ptr(), 64usize) };
            if r == 0 {
                // The new process, if the filter let it be made.
                // SAFETY: _exit never returns.
                unsafe { libc::_exit(0) };
            }
            r == -1 && errno() == libc::ENOSYS
        }
    };
    let thread = || {
        std::thread::Builder::new()
            .name("t".into())
            .spawn(|| 7)
            .ok()
            .and_then(|h| h.join().ok())
            == Some(7)
    };
    let fork = || {
        // SAFETY: the new process only calls _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: _exit never returns.
            unsafe { libc::_exit(0) };
        }
        pid > 0
    };
    let clone_newuser = || {
        let flags = (libc::CLONE_NEWUSER | libc::SIGCHLD) as libc::c_ulong;
        // SAFETY: no stack and no pointers: a fork into a new user
        // namespace; the new process only calls _exit.
        let pid = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
        if pid == 0 {
            // SAFETY: _exit never returns.
            unsafe { libc::_exit(0) };
        }
        pid > 0
    };
    // SAFETY: unshare takes no pointers.
    let unshare = || unsafe { libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) } == 0;
    for under in [&FILE, &RBD] {
        let p = under.1;
        assert_eq!(
            ends(under, clone3(0)),
            Ended::Returned(true),
            "{p:?}: clone3 fork"
        );
        assert_eq!(
            ends(
                under,
                clone3((libc::CLONE_NEWUSER | libc::CLONE_NEWNET) as u64)
            ),
            Ended::Returned(true),
            "{p:?}: clone3 into new namespaces"
        );
        assert_eq!(
            ends(under, thread),
            Ended::Returned(true),
            "{p:?}: a thread"
        );
        assert_eq!(ends(under, fork), TRAPPED, "{p:?}: fork");
        assert_eq!(ends(under, clone_newuser), TRAPPED, "{p:?}: clone(NEWUSER)");
        assert_eq!(ends(under, unshare), TRAPPED, "{p:?}: unshare");
    }
    // Under `--seccomp log` clone3 is refused too (glibc falls back).
    let log = Under(SeccompAction::Log, Profile::File, &[]);
    assert_eq!(ends(&log, clone3(0)), Ended::Returned(true));
    assert_eq!(ends(&log, thread), Ended::Returned(true));
}

/// The finding: abort(3) trapped on its getpid, so every abort (a failed
/// allocation, an assertion in librbd) looked like a bad syscall, exit
/// 159, with no core. Now it ends the process as killed by SIGABRT.
#[test]
fn abort_ends_the_process_with_sigabrt() {
    if !need_seccomp() {
        return;
    }
    for under in [&FILE, &RBD] {
        let (ended, err) = run(under, || std::process::abort());
        assert_eq!(
            ended,
            Ended::Killed(crate::daemon::crash::CRASH_SIGNAL),
            "{:?}: stderr {err:?}",
            under.1
        );
        assert!(!err.contains("not allowed"), "{err:?}");
    }
    // tgkill stays narrow: another signal, or another process, traps.
    // SAFETY: getpid takes no pointers.
    let parent = unsafe { libc::getpid() };
    let kill_parent = || {
        // SAFETY: signal 0 only checks that the target exists.
        unsafe { libc::syscall(libc::SYS_tgkill, parent, parent, 0) == 0 }
    };
    assert_eq!(
        ends(&FILE, kill_parent),
        TRAPPED,
        "tgkill of another process"
    );
    let sigkill_self = || {
        // SAFETY: no pointers; the filter stops it before it is sent.
        unsafe {
            let (pid, tid) = (libc::getpid(), libc::gettid());
            libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGKILL) == 0
        }
    };
    assert_eq!(ends(&FILE, sigkill_self), TRAPPED, "tgkill of SIGKILL");
}

/// A panic in a thread (here a queue worker's name) under the filter: its
/// thread, place and message are logged and the whole process ends killed
/// by SIGABRT. Before, the thread died alone and the process went on.
#[test]
fn a_panic_is_logged_and_ends_the_process() {
    if !need_seccomp() {
        return;
    }
    // The logger and the hook are set up before the filter, as in `serve`.
    let start = || {
        let _ = env_logger::Builder::new()
            .filter_level(log::LevelFilter::Info)
            .try_init();
        crate::daemon::crash::install();
    };
    let (ended, err) = run_after(start, &FILE, || {
        let worker = std::thread::Builder::new()
            .name("queue-3".into())
            .spawn(|| panic!("boom {}", 7))
            .expect("a thread starts under the filter");
        let _ = worker.join();
        // The process must not get here.
        true
    });
    assert_eq!(
        ended,
        Ended::Killed(crate::daemon::crash::CRASH_SIGNAL),
        "stderr {err:?}"
    );
    assert!(
        err.contains("thread 'queue-3' panicked at src/daemon/seccomp/tests.rs:")
            && err.contains(": boom 7; aborting"),
        "stderr {err:?}"
    );
    assert!(!err.contains("not allowed"), "{err:?}");
}

#[test]
fn enforce_traps_a_syscall_outside_the_list_and_log_lets_it_pass() {
    if !need_seccomp() {
        return;
    }
    assert!(!nrs(Profile::File).contains(&libc::SYS_getppid));
    // SAFETY: getppid takes no pointers.
    let getppid = || unsafe { libc::syscall(libc::SYS_getppid) } > 0;
    let (ended, err) = run(&FILE, getppid);
    assert_eq!(ended, TRAPPED, "{err:?}");
    let want = format!("syscall {} is not allowed", libc::SYS_getppid);
    assert!(err.contains(&want), "stderr {err:?} lacks {want:?}");
    let log = Under(SeccompAction::Log, Profile::File, &[]);
    assert_eq!(ends(&log, getppid), Ended::Returned(true));
}

/// Every blocking fallback an engine can make after start-up
/// (`engine::sync`), run in a child under the enforcing filter: none
/// may trap. (`--iopoll` once killed the daemon on a guest's
/// write-zeroes: fallocate was not on the list.)
#[test]
fn engine_fallbacks_run_under_the_filter() {
    use crate::engine::{FALLOCATE_MODES, sync};
    if !need_seccomp() {
        return;
    }
    let image = tempfile::tempfile().unwrap();
    image.set_len(1 << 20).unwrap();
    let fd = image.as_raw_fd();
    let ended = ends(&FILE, || {
        let mut ok = sync::flush(fd).is_ok();
        for mode in FALLOCATE_MODES {
            ok &= sync::fallocate(fd, mode, 4096, 4096).is_ok();
        }
        // Not a block device: the ioctl fails (ENOTTY), but it is made.
        ok &= sync::discard_block_device(fd, 0, 4096).is_err();
        ok
    });
    assert_eq!(ended, Ended::Returned(true), "a fallback trapped or failed");
}

/// unlinkat works in the directories the daemon opened for it, and in
/// no other; a new io_uring cannot be made at all.
#[test]
fn removal_only_in_known_directories_and_no_new_rings() {
    if !need_seccomp() {
        return;
    }
    let (ours, other) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for d in [&ours, &other] {
        std::fs::write(d.path().join("f"), b"x").unwrap();
    }
    let open = |p: &std::path::Path| std::fs::File::open(p).unwrap();
    let (ours_fd, other_fd) = (open(ours.path()), open(other.path()));
    let dirs = [ours_fd.as_raw_fd()];
    let under = Under(SeccompAction::Trap, Profile::File, &dirs);
    let unlink = |dir: i32| {
        // SAFETY: a NUL-terminated name and an open directory fd.
        move || unsafe { libc::unlinkat(dir, c"f".as_ptr(), 0) == 0 }
    };
    let (a, b) = (ours_fd.as_raw_fd(), other_fd.as_raw_fd());
    assert_eq!(ends(&under, unlink(a)), Ended::Returned(true));
    assert!(!ours.path().join("f").exists());
    assert_eq!(ends(&under, unlink(b)), TRAPPED);
    assert!(other.path().join("f").exists());
    let new_ring = || {
        // Room for struct io_uring_params (120 bytes), zeroed.
        let mut params = [0u8; 120];
        // SAFETY: params is valid for the 120 bytes the kernel reads and
        // writes.
        unsafe { libc::syscall(libc::SYS_io_uring_setup, 4, params.as_mut_ptr()) >= 0 }
    };
    assert_eq!(ends(&under, new_ring), TRAPPED);
}

#[test]
fn dangerous_syscalls_are_not_allowed() {
    for profile in [Profile::File, Profile::Rbd] {
        let nrs = nrs(profile);
        for nr in [
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_open,
            libc::SYS_openat,
            libc::SYS_ptrace,
            libc::SYS_fork,
            libc::SYS_vfork,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_kill,
            libc::SYS_tkill,
            libc::SYS_bind,
            libc::SYS_listen,
            libc::SYS_mount,
            libc::SYS_chroot,
            libc::SYS_landlock_restrict_self,
            // Rings are all made before the filter.
            libc::SYS_io_uring_setup,
            // Removal goes through unlinkat on known directories only.
            libc::SYS_unlink,
            libc::SYS_rmdir,
        ] {
            assert!(
                !nrs.contains(&nr),
                "{profile:?}: syscall {nr} must not be allowed"
            );
        }
    }
    let file = nrs(Profile::File);
    for nr in [libc::SYS_socket, libc::SYS_connect] {
        assert!(
            !file.contains(&nr),
            "File: syscall {nr} must not be allowed"
        );
    }
}
