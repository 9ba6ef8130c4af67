//! The connector: a small process of its own, forked at start-up, that
//! makes the one connection the daemon needs per front-end (the relay's
//! stream to vhost-user-backend's inner listening socket) and hands it over
//! with SCM_RIGHTS. The daemon itself then needs neither `socket` nor
//! `connect` after start-up, and the seccomp filter allows neither.
//!
//! Why a process: vhost-user-backend 0.24 takes a connection only from a
//! listener it accepts on (`VhostUserDaemon::start(&mut Listener)`, or
//! `start_client(path)`, which connects itself); it cannot be handed a
//! socketpair end, and a listener gets connections only through
//! `connect(2)`. A filter cannot see the path `connect` is given, so a
//! daemon allowed to connect once per front-end could connect anywhere its
//! user may: as root, to systemd's, dbus's or another VM's QEMU monitor
//! socket. Landlock cannot close that either before ABI 9
//! (`LANDLOCK_ACCESS_FS_RESOLVE_UNIX`). The connector knows one path, fixed
//! before it was forked, and takes no input but a byte that asks for the
//! next connection; a daemon taken over can make it connect there and
//! nowhere else.
//!
//! The connector:
//! - runs nothing but raw syscalls after the fork (no allocation, no
//!   locks), so it would be sound to fork even a daemon with threads (it
//!   is forked early in start-up, before the daemon opens its image);
//! - closes every descriptor but its end of the socketpair, ignores
//!   SIGINT, SIGTERM and SIGHUP, and dies with the thread that forked it
//!   (`PR_SET_PDEATHSIG`), the daemon's main thread, which lives as long as
//!   the daemon;
//! - installs a seccomp filter of its own (made by the daemon before the
//!   fork): `read` and `sendmsg` on its socketpair end, Unix stream
//!   `socket`, `connect`, `close`, exit; anything else kills it;
//! - answers each byte with an errno (4 bytes, 0 on success) and, on
//!   success, the new stream's descriptor; it exits when the daemon's end
//!   closes.
//!
//! It shows up as `ringblk-connect`, a child of the daemon. If it dies,
//! the daemon cannot serve another front-end and exits with an error.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// How long the daemon waits for an answer; the connector answers at
/// once (a connect to a listening Unix socket does not block while its
/// backlog has room, and the crate accepts each before the next).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// The name the connector gives itself (15 bytes at most, as comm).
const NAME: &std::ffi::CStr = c"ringblk-connect";

/// Set once the daemon's seccomp filter is on: from then on the daemon
/// cannot reap the connector (`wait4` is not allowed), and does not try.
static FILTERED: AtomicBool = AtomicBool::new(false);

/// Tells [`Connector`]'s drop that the process is now under the filter.
pub fn filter_installed() {
    FILTERED.store(true, Ordering::Relaxed);
}

/// The daemon's handle on its connector.
pub struct Connector {
    chan: UnixStream,
    pid: libc::pid_t,
}

impl Connector {
    /// Forks the connector for the Unix socket at `path`.
    pub fn spawn(path: &Path) -> io::Result<Connector> {
        let addr = sockaddr(path)?;
        let (ours, theirs) = UnixStream::pair()?;
        ours.set_read_timeout(Some(ANSWER_TIMEOUT))?;
        let chan = theirs.as_raw_fd();
        let filter = filter(chan).map_err(io::Error::other)?;
        let prog = libc::sock_fprog {
            len: u16::try_from(filter.len()).map_err(io::Error::other)?,
            filter: filter.as_ptr().cast_mut().cast(),
        };
        // SAFETY: getpid takes no pointers.
        let parent = unsafe { libc::getpid() };
        // SAFETY: the child runs `serve`, which makes raw syscalls only (no
        // allocation, no lock another thread may have held at the fork) on
        // memory copied at the fork (`addr`, `prog` and the filter it points
        // to), and never returns.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            // SAFETY: in the child just forked, as `serve` requires.
            unsafe { serve(chan, parent, &addr, &prog) }
        }
        drop(theirs);
        Ok(Connector { chan: ours, pid })
    }

    /// A new stream connected to the socket, or why not.
    pub fn connect(&self) -> Result<UnixStream, ConnectError> {
        let gone = |what: String| {
            ConnectError::Gone(format!("the connector process (pid {}) {what}", self.pid))
        };
        let broken = |e: &io::Error| {
            matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::WouldBlock
                    | io::ErrorKind::TimedOut
            )
        };
        if let Err(e) = (&self.chan).write_all(&[1]) {
            return Err(match broken(&e) {
                true => gone(format!("cannot be asked: {e}")),
                false => ConnectError::Failed(e),
            });
        }
        let mut errno = [0u8; 4];
        let mut iov = [libc::iovec {
            iov_base: errno.as_mut_ptr().cast(),
            iov_len: errno.len(),
        }];
        let mut fds = [-1 as RawFd; 1];
        // With a read timeout set, a stop and continue of the daemon
        // (SIGSTOP, a debugger) answers EINTR instead of restarting.
        let got = loop {
            // SAFETY: the iovec points at `errno`, which outlives the call;
            // `fds` has room for the one descriptor asked for.
            match unsafe { self.chan.recv_with_fds(&mut iov, &mut fds) } {
                Err(e) if e.errno() == libc::EINTR => continue,
                r => break r,
            }
        };
        // Out of fds here (EMFILE, or ENOBUFS: the kernel could not pass
        // the descriptor and dropped it) fails this connection only.
        let (n, nfds) = got.map_err(|e| match io::Error::from(e) {
            e if e.kind() == io::ErrorKind::WouldBlock => {
                gone(format!("did not answer within {ANSWER_TIMEOUT:?}"))
            }
            e if broken(&e) => gone(format!("failed: {e}")),
            e => ConnectError::Failed(e),
        })?;
        // SAFETY: the kernel installed `nfds` (at most one) new descriptor
        // that this process now owns.
        let stream = (nfds == 1).then(|| unsafe { UnixStream::from_raw_fd(fds[0]) });
        match (n, stream) {
            (0, _) => Err(gone("exited".into())),
            (4, Some(s)) if errno == [0; 4] => Ok(s),
            (4, None) if errno != [0; 4] => Err(ConnectError::Failed(
                io::Error::from_raw_os_error(i32::from_ne_bytes(errno)),
            )),
            _ => Err(gone("answered out of turn".into())),
        }
    }
}

/// Why [`Connector::connect`] brought no stream.
#[derive(Debug)]
pub enum ConnectError {
    /// The connector is gone or does not answer: no stream will come
    /// again, and the daemon cannot serve another front-end.
    Gone(String),
    /// This one failed (the daemon out of fds as the stream came, the
    /// connect refused); the next may work.
    Failed(io::Error),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Gone(m) => f.write_str(m),
            ConnectError::Failed(e) => write!(f, "{e}"),
        }
    }
}

impl Drop for Connector {
    fn drop(&mut self) {
        // Closing our end (after this) ends the connector; reap it while
        // wait4 is allowed. Under the filter the daemon is about to exit
        // anyway, and its exit takes the connector with it.
        let _ = self.chan.shutdown(std::net::Shutdown::Both);
        if !FILTERED.load(Ordering::Relaxed) {
            // SAFETY: `pid` is our child; no status is asked for.
            unsafe { libc::waitpid(self.pid, std::ptr::null_mut(), 0) };
        }
    }
}

/// `path` as a `sockaddr_un`, and its length.
pub(super) fn sockaddr(path: &Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: not a usable socket path", path.display()),
        ));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + bytes.len() + 1;
    Ok((addr, len as libc::socklen_t))
}

/// The connector's own filter: what [`serve`] does and nothing else.
fn filter(chan: RawFd) -> Result<BpfProgram, seccompiler::BackendError> {
    use libc::*;
    let on_chan = || -> Result<Vec<SeccompRule>, seccompiler::BackendError> {
        Ok(vec![SeccompRule::new(vec![SeccompCondition::new(
            0,
            Len::Dword,
            Op::Eq,
            chan as u64,
        )?])?])
    };
    let unix_stream = vec![SeccompRule::new(vec![
        SeccompCondition::new(0, Len::Dword, Op::Eq, AF_UNIX as u64)?,
        SeccompCondition::new(1, Len::Dword, Op::Eq, (SOCK_STREAM | SOCK_CLOEXEC) as u64)?,
    ])?];
    let rules = [
        (SYS_read, on_chan()?),
        (SYS_sendmsg, on_chan()?),
        (SYS_socket, unix_stream),
        (SYS_connect, vec![]),
        (SYS_close, vec![]),
        (SYS_exit_group, vec![]),
        (SYS_restart_syscall, vec![]),
    ];
    SeccompFilter::new(
        rules.into_iter().collect(),
        SeccompAction::KillProcess,
        SeccompAction::Allow,
        TargetArch::try_from(std::env::consts::ARCH)?,
    )
    .and_then(BpfProgram::try_from)
}

/// The connector's life, in the child just forked.
///
/// # Safety
/// Must be called only in a child just forked from the daemon, and never
/// returns. It makes raw syscalls only, so the fork of a process with other
/// threads leaves nothing it uses in an inconsistent state.
unsafe fn serve(
    chan: RawFd,
    parent: libc::pid_t,
    (addr, addr_len): &(libc::sockaddr_un, libc::socklen_t),
    prog: &libc::sock_fprog,
) -> ! {
    // SAFETY: raw syscalls on this process's own state, with pointers to
    // locals and to memory copied at the fork, which live until the
    // process exits; `chan` is the connector's end of the socketpair.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() != parent {
            // The daemon died before PR_SET_PDEATHSIG took effect.
            libc::_exit(0);
        }
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::signal(sig, libc::SIG_IGN);
        }
        close_all_but(chan);
        libc::prctl(libc::PR_SET_NAME, NAME.as_ptr());
        // Without seccomp support (the daemon says so in its log) the
        // connector runs unfiltered; it still takes no input but a byte.
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0,
                prog as *const libc::sock_fprog,
            );
        }
        loop {
            let mut byte = 0u8;
            match libc::read(chan, (&raw mut byte).cast(), 1) {
                1 => {}
                n if n < 0 && *libc::__errno_location() == libc::EINTR => continue,
                _ => libc::_exit(0),
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            let errno = if fd < 0
                || libc::connect(fd, (addr as *const libc::sockaddr_un).cast(), *addr_len) < 0
            {
                *libc::__errno_location()
            } else {
                0
            };
            answer(chan, errno, fd);
            if fd >= 0 {
                libc::close(fd);
            }
        }
    }
}

/// Sends `errno` and, when it is 0, `fd` over `chan`.
///
/// # Safety
/// Raw syscalls only (see [`serve`]); `chan` is a connected Unix socket.
unsafe fn answer(chan: RawFd, errno: i32, fd: RawFd) {
    let mut data = errno.to_ne_bytes();
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    // Room for one cmsghdr with one int, aligned as cmsghdr wants.
    let mut cbuf = [0u64; 4];
    // SAFETY: msghdr is plain data; all zeroes is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if errno == 0 {
        // SAFETY: CMSG_SPACE and CMSG_LEN are arithmetic; `cbuf` (32 bytes,
        // 8-aligned) holds CMSG_SPACE(4) = 24 bytes, so CMSG_FIRSTHDR
        // points into it, and CMSG_DATA of that header has room for an int.
        unsafe {
            msg.msg_control = cbuf.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(4) as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(4) as _;
            libc::CMSG_DATA(c).cast::<RawFd>().write_unaligned(fd);
        }
    }
    // SAFETY: `msg` points at `iov`, `data` and `cbuf`, all live for the
    // call. An answer that cannot be sent leaves the daemon waiting until
    // its timeout, which it reports.
    unsafe { libc::sendmsg(chan, &msg, libc::MSG_NOSIGNAL) };
}

/// Closes every descriptor but `keep`.
///
/// # Safety
/// Raw syscalls only (see [`serve`]).
unsafe fn close_all_but(keep: RawFd) {
    let keep = keep as libc::c_uint;
    // SAFETY: close_range takes no pointers; closing descriptors of this
    // process (a copy of the daemon's table) touches nothing in the daemon.
    unsafe {
        if keep > 0 {
            libc::syscall(libc::SYS_close_range, 0, keep - 1, 0);
        }
        if libc::syscall(libc::SYS_close_range, keep + 1, libc::c_uint::MAX, 0) < 0 {
            // Kernels before 5.9: one at a time, up to the limit.
            let mut lim: libc::rlimit = std::mem::zeroed();
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
            for fd in 0..lim.rlim_cur.min(1 << 20) as libc::c_int {
                if fd != keep as libc::c_int {
                    libc::close(fd);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// Connections come back connected to the socket, one per request;
    /// a socket that is gone is an error, not a dead connector; closing
    /// the daemon's end ends the connector.
    #[test]
    fn hands_over_connections_to_its_one_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inner.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let c = Connector::spawn(&path).unwrap();
        for i in 0..3u8 {
            let mut s = c.connect().expect("a connected stream");
            s.write_all(&[i]).unwrap();
            let (mut accepted, _) = listener.accept().unwrap();
            let mut got = [0u8];
            std::io::Read::read_exact(&mut accepted, &mut got).unwrap();
            assert_eq!(got, [i]);
        }
        std::fs::remove_file(&path).unwrap();
        match c.connect() {
            Err(ConnectError::Failed(e)) => assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{e}"),
            other => panic!("no socket there: {other:?}"),
        }
        // Still alive, still serving.
        drop(listener);
        let _l = UnixListener::bind(&path).unwrap();
        c.connect().expect("connects again");
        let pid = c.pid;
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap();
        assert_eq!(comm.trim(), "ringblk-connect");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        assert!(
            status.lines().any(|l| l == "Seccomp:\t2"),
            "the connector is not filtered:\n{status}"
        );
        drop(c);
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "the connector outlived its daemon end"
        );
    }
}
