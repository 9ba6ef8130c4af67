//! A seccomp user notification on one syscall of the daemon: the test
//! stops the daemon in each call, acts while it waits there (looks at a
//! file, sends a signal), and lets the call go on or fails it with an
//! errno of its choosing. Deterministic, with no sleeps: the daemon is
//! caught at the call itself, not at a guess of when it gets there.
//!
//! The filter is installed in the daemon's process before exec, below
//! the daemon's own seccomp filter: the kernel runs both, and a user
//! notification takes precedence over the daemon's ALLOW.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};

/// A filter that stops every call of the syscall `nr` (the daemon's
/// native ABI) in a seccomp user notification and lets every other
/// syscall through.
fn filter(nr: libc::c_long) -> [libc::sock_filter; 4] {
    [
        // A = seccomp_data.nr
        bpf(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0, 0, 0),
        bpf(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, 0, 1, nr as u32),
        bpf(
            libc::BPF_RET | libc::BPF_K,
            0,
            0,
            libc::SECCOMP_RET_USER_NOTIF,
        ),
        bpf(libc::BPF_RET | libc::BPF_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

const fn bpf(code: u32, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    }
}

/// What the test answers a stopped call with.
pub enum Answer {
    /// The call goes on as the daemon made it.
    Continue,
    /// The call fails with this errno, not made.
    Fail(i32),
}

/// A seccomp listener in the making for one syscall: the child installs
/// the filter before exec and sends the listener fd back over a socket
/// pair.
pub struct SyscallTrap {
    nr: libc::c_long,
    ours: OwnedFd,
    theirs: OwnedFd,
}

impl SyscallTrap {
    /// A trap for the syscall `nr` (`libc::SYS_listen`, ...).
    pub fn new(nr: libc::c_long) -> SyscallTrap {
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
        SyscallTrap { nr, ours, theirs }
    }

    /// Makes `cmd` install the filter in its child, before exec.
    pub fn arm(&self, cmd: &mut Command) {
        let sock = self.theirs.as_raw_fd();
        let filter = filter(self.nr);
        // SAFETY: the closure runs in the forked child before exec. It
        // calls only async-signal-safe syscalls (prctl, seccomp, sendmsg,
        // close) on the filter, which it owns (a copied array), and on
        // stack memory, and allocates nothing. `sock` stays open in the
        // parent until the spawn is done.
        unsafe { cmd.pre_exec(move || install_filter(sock, &filter)) };
    }

    /// After the spawn: answers each call of the syscall with what
    /// `at_call` says, run while the daemon waits in the call, until the
    /// returned guard is dropped. Calls after that wait for nobody: the
    /// guard's drop closes the listener, and the kernel fails them with
    /// ENOSYS.
    pub fn serve(self, mut at_call: impl FnMut() -> Answer + Send + 'static) -> Supervisor {
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
                let mut resp = libc::seccomp_notif_resp {
                    id: req.id,
                    val: 0,
                    error: 0,
                    flags: 0,
                };
                match at_call() {
                    Answer::Continue => resp.flags = libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE as u32,
                    Answer::Fail(errno) => {
                        resp.val = -1;
                        resp.error = -errno;
                    }
                }
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

/// Stops serving the daemon's calls when dropped.
pub struct Supervisor {
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

/// In the child: installs `filter` with a user-notification listener
/// and sends the listener to the test over `sock`.
fn install_filter(sock: RawFd, filter: &[libc::sock_filter]) -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr().cast_mut(),
    };
    // SAFETY: seccomp reads the sock_fprog, a live local, and the filter
    // it points to, borrowed for the call; the kernel copies it and never
    // writes it.
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
    let mut iov = one_byte(&mut byte);
    let mut control = [0u64; 4];
    let mut msg = fd_message(&mut iov, &mut control);
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

/// An iovec over `byte`: the one byte that carries the fd.
fn one_byte(byte: &mut [u8; 1]) -> libc::iovec {
    libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    }
}

/// A message of `iov` with `control` as its control buffer, whole (what
/// recvmsg may fill; the sender sets the length it uses). Allocates
/// nothing: the child calls it between fork and exec.
fn fd_message(iov: &mut libc::iovec, control: &mut [u64; 4]) -> libc::msghdr {
    // SAFETY: all-zero bytes are a valid msghdr.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(control);
    msg
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
    let mut iov = one_byte(&mut byte);
    let mut control = [0u64; 4];
    let mut msg = fd_message(&mut iov, &mut control);
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
