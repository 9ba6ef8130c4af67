//! The seccomp filter the daemon runs under once it has started.
//!
//! Installed after everything that opens files or sockets is done (image
//! open, socket bind, signal thread), on every thread at once (TSYNC);
//! threads started later (per-connection vhost-user workers) inherit it.
//!
//! The allow-list was found empirically: `strace -f` of the daemon from the
//! end of start-up through two QEMU guest runs (fio write+verify, discard,
//! write-zeroes, reconnect through the inflight relay), metrics scrapes
//! over TCP and a Unix socket, the control API's verbs (a resize on a verb
//! thread that then exits idle; slow, oversized, over-the-cap and
//! pipelining HTTP clients), SIGTERM shutdown, and `--direct`,
//! `--poll-us`, `--cpus`, `--writethrough`, `--iopoll`, `--fixed-buffers`,
//! `--engine null`, `--readonly`; then each of those again under
//! `--seccomp enforce`. A few entries no trace showed are kept on purpose;
//! each says why. Arguments are checked where that is cheap and
//! meaningful: no executable mappings, affinity of the calling thread
//! only, only the `fcntl`/`prctl`/`ioctl` commands and `fallocate` modes
//! in use, `clone` with the flags of a thread only, `tgkill` of SIGABRT to
//! this process only, `sendto` with no address. `openat` is not allowed at
//! all, and neither are `socket` and `connect` (the file profile; the RBD
//! one allows TCP sockets, see below).
//!
//! Processes and namespaces: `clone3` fails with ENOSYS (a second, tiny
//! filter: [`compile_no_clone3`]), because its flags live in memory the
//! filter cannot read; glibc falls back to `clone`, whose flags are an
//! argument, and only [`THREAD_CLONE_FLAGS`] passes. So the daemon can
//! start threads, and cannot fork, vfork, exec or enter a new namespace
//! (`unshare`, `setns` are not on the list either).
//!
//! Sockets: in the file profile the daemon makes none after start-up and
//! connects to nothing. The one connection it needs per front-end, from
//! the relay to vhost-user-backend's inner listening socket, is made by a
//! separate process forked at start-up (`daemon::connector`) that can do
//! only that, and handed over with SCM_RIGHTS. What remains: the sd_notify
//! socket, a datagram socket connected at start-up, could still be given
//! another address by `sendmsg` (whose address is behind a pointer); in
//! the RBD profile `connect` itself is allowed (for TCP, whose address a
//! filter cannot see either), which could also re-point that socket. Both
//! reach only datagram sockets whose file permissions let the daemon's
//! user write, and Landlock (`daemon::landlock`) takes abstract ones away
//! where the kernel has ABI 6.
//!
//! What the filter cannot see: io_uring operations. They are constrained by
//! the rings themselves (created disabled, restricted to the six opcodes of
//! `engine::ring`, plus the discard command on a block device whose kernel
//! has it, all on the registered image only). `io_uring_setup` is not on
//! the list: every ring the daemon will use is made before the filter,
//! and each connection borrows them.
//!
//! Profiles ([`Profile`]): a file or block device gets the list below; an
//! RBD image (`--image rbd:...`) gets it plus what librbd's threads do
//! after start-up (TCP connections to the cluster, timers), enforced by
//! default like the file one; [`allowed`] says how each entry was found.
//! librbd starts its threads before the filter, which TSYNC puts on them
//! too.
//!
//! Each engine's blocking fallbacks (`engine::sync`: fdatasync, fallocate
//! in the engine's modes, BLKDISCARD) are on the list; a test runs each of
//! them under the filter.
//!
//! Lazy first uses. Some libraries make a syscall the first time a thing
//! happens, which in a long-running daemon can be long after start-up; the
//! filter must not be the first to meet it. Found with `strace -f` of a
//! daemon serving connections of 1, 3, 5, 8, 12 and 16 queues in a row
//! (every syscall after the first `accept4`), and each is covered:
//! - glibc's malloc gives each new thread an arena of its own until there
//!   are 8 per CPU, but it works out that limit once, when the ninth arena
//!   is about to be made, by reading `/sys/devices/system/cpu/online` with
//!   `openat`. A connection of 5 or more queues (a worker thread each, plus
//!   the relay's two) crossed that line and trapped. [`prepare`] sets the
//!   limit itself (`mallopt(M_ARENA_MAX)`, to glibc's own default of 8 per
//!   online CPU, counted before the filter), so glibc never reads it;
//! - glibc's malloc also reads `/proc/sys/vm/overcommit_memory` the first
//!   time it shrinks a thread arena's heap, which large frees in a queue
//!   thread (O_DIRECT bounce buffers) reached now and then: a test of
//!   misaligned O_DIRECT I/O trapped about one run in ten. [`prepare`]
//!   turns heap shrinking off (`M_TRIM_THRESHOLD`); strace had not shown
//!   it, since the trim happens only when the freed top passes the
//!   threshold;
//! - thread start and exit (clone3, answered ENOSYS, then clone;
//!   set_robust_list, rseq, sigaltstack, prctl(PR_SET_NAME),
//!   sched_getaffinity, madvise, munmap, exit), and
//!   HashMap seeds (getrandom): on the list below;
//! - time: log lines are stamped in UTC (no time zone file), clocks come
//!   from the vDSO, with `clock_gettime` allowed for clock sources without
//!   one; no locale, DNS or `/proc/self` access was seen after start-up.
//!
//! Bugs: a panic anywhere is logged (thread, place, message) and aborts
//! the process (`daemon::crash`); abort(3)'s own syscalls are on the list,
//! so a panic or an abort ends the daemon as killed by SIGABRT, with its
//! message in the log, not as a trapped syscall. No backtrace is printed:
//! resolving one reads the binary, which neither the filter nor Landlock
//! allows; a core dump (where they are enabled) has the stack.
//!
//! `--seccomp enforce` traps a syscall outside the list: a SIGSYS handler
//! writes the syscall number to stderr and exits with [`EXIT_BAD_SYSCALL`]
//! (a bare SECCOMP_RET_KILL_PROCESS would leave no trace in our own log).
//! `--seccomp log` lets it through and the kernel logs it (audit, or dmesg
//! without auditd).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

use libc::c_int;

use super::DaemonError;
use super::args::SeccompMode;

/// Exit status after a syscall the filter does not allow (128 + SIGSYS,
/// as if the signal had killed the process).
pub const EXIT_BAD_SYSCALL: i32 = 128 + libc::SIGSYS;

/// `si_code` of a SIGSYS sent by seccomp (linux/signal.h).
const SYS_SECCOMP: i32 = 1;

/// What the daemon writes after start-up besides the image, which the
/// filter then allows, and nothing of it otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extras {
    /// The dirty bitmaps' directory (its descriptor): sidecars are
    /// created there (`openat` of that descriptor with
    /// `bitmap::sidecar::CREATE_FLAGS` only), mapped, synced, and their
    /// headers written.
    pub bitmap_dir: Option<i32>,
    /// Backups may run: an NBD server on a Unix socket made at `backup
    /// start`, reads of the image and its allocation, and the
    /// copy-before-write file.
    pub backups: bool,
}

#[cfg(test)]
impl Extras {
    /// Neither bitmaps nor backups.
    pub const NONE: Extras = Extras {
        bitmap_dir: None,
        backups: false,
    };
}

/// Installs the filter for `mode` on all threads of the process. A kernel
/// without seccomp filter support gets a warning, not an error.
/// `unlink_dirs`: the directory fds (see `removal`) in which the daemon
/// removes files (its sockets on the way out, a backup's socket, a
/// bitmap's sidecar); `unlinkat` is allowed on those only.
/// `open_dir`: the directory fd in which the daemon creates files (a qcow2
/// image's snapshot directory); `openat` is allowed on that one only
/// (besides a bitmap directory's, with [`Extras`]).
pub fn install(
    mode: SeccompMode,
    profile: Profile,
    extras: Extras,
    unlink_dirs: &[i32],
    open_dir: Option<i32>,
) -> Result<(), DaemonError> {
    let mismatch = match mode {
        SeccompMode::Off => {
            log::warn!("seccomp filter disabled (--seccomp off)");
            return Ok(());
        }
        SeccompMode::Log => SeccompAction::Log,
        SeccompMode::Enforce => SeccompAction::Trap,
    };
    if !kernel_has_seccomp() {
        log::warn!("the kernel has no seccomp support; running without a syscall filter");
        return Ok(());
    }
    let pid = std::process::id() as i32;
    let program = compile(
        mismatch.clone(),
        profile,
        extras,
        unlink_dirs,
        open_dir,
        pid,
    )?;
    let no_clone3 = compile_no_clone3()?;
    if mismatch == SeccompAction::Trap {
        install_sigsys_handler()?;
    }
    // The ENOSYS one first: until the allow-list is on too, nothing is
    // refused that was allowed before. A kernel that refuses the first
    // (EINVAL: no filter support after all) refuses the second too.
    match seccompiler::apply_filter_all_threads(&no_clone3) {
        Ok(()) => {}
        Err(seccompiler::Error::Seccomp(e)) if e.raw_os_error() == Some(libc::EINVAL) => {
            log::warn!(
                "the kernel refused the seccomp filter ({e}); running without a syscall filter"
            );
            return Ok(());
        }
        Err(e) => return Err(DaemonError::Seccomp(e.to_string())),
    }
    seccompiler::apply_filter_all_threads(&program)
        .map_err(|e| DaemonError::Seccomp(e.to_string()))?;
    log::debug!(
        "seccomp filter installed ({:?} profile, {} syscalls allowed, {})",
        profile,
        allowed(profile, extras, unlink_dirs, open_dir, pid).len(),
        match mode {
            SeccompMode::Log => "others logged",
            _ => "others fatal",
        }
    );
    Ok(())
}

/// Does now, before the filter (and before Landlock, which would deny the
/// file it reads), what a library would otherwise do lazily with a
/// syscall the filter does not allow (see the module doc). Nothing for
/// `--seccomp off`.
pub fn prepare(mode: SeccompMode) {
    if mode == SeccompMode::Off || !kernel_has_seccomp() {
        return;
    }
    // What glibc would compute itself (NARENAS_FROM_NCORES: 8 arenas per
    // online CPU on 64-bit), so that it never reads
    // /sys/devices/system/cpu/online after start-up.
    // SAFETY: sysconf takes no pointers.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1);
    let arenas = c_int::try_from(cpus.saturating_mul(8)).unwrap_or(c_int::MAX);
    // SAFETY: mallopt takes no pointers; M_ARENA_MAX only bounds how many
    // arenas later allocations may create.
    if unsafe { libc::mallopt(libc::M_ARENA_MAX, arenas) } != 1 {
        log::warn!("mallopt(M_ARENA_MAX, {arenas}) failed; a connection of many queues may trap");
    }
    // glibc shrinks a thread arena's heap when its free top passes the trim
    // threshold, and the first time it does, it reads
    // /proc/sys/vm/overcommit_memory (check_may_shrink_heap). Large frees
    // in a queue thread (bounce buffers) got there at random. With the
    // threshold at its maximum no heap is ever shrunk (allocations of 128
    // KiB and more are mmap'd and unmapped on free as before; the heaps
    // keep what they grew to).
    // SAFETY: as above; M_TRIM_THRESHOLD only decides when heaps shrink.
    if unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, c_int::MAX) } != 1 {
        log::warn!("mallopt(M_TRIM_THRESHOLD) failed; freeing memory may trap");
    }
}

/// Whether the kernel was built with seccomp (PR_GET_SECCOMP fails with
/// EINVAL otherwise).
fn kernel_has_seccomp() -> bool {
    // SAFETY: PR_GET_SECCOMP takes no pointer arguments.
    unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) >= 0 }
}

fn seccomp_err(e: seccompiler::BackendError) -> DaemonError {
    DaemonError::Seccomp(e.to_string())
}

/// Builds the BPF program: the allow-list, and `mismatch` for the rest.
/// `pid`: the process the filter is for (abort's `tgkill` may signal it
/// only).
fn compile(
    mismatch: SeccompAction,
    profile: Profile,
    extras: Extras,
    unlink_dirs: &[i32],
    open_dir: Option<i32>,
    pid: i32,
) -> Result<BpfProgram, DaemonError> {
    let err = seccomp_err;
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(err)?;
    let rules = allowed(profile, extras, unlink_dirs, open_dir, pid)
        .into_iter()
        .map(|(nr, rules)| rules.map(|r| (nr, r)))
        .collect::<Result<BTreeMap<_, _>, _>>()
        .map_err(err)?;
    SeccompFilter::new(rules, mismatch, SeccompAction::Allow, arch)
        .and_then(BpfProgram::try_from)
        .map_err(err)
}

/// The second filter: `clone3` fails with ENOSYS, everything else passes
/// on to the allow-list. clone3 passes its flags in a struct, which a
/// filter cannot read, so it cannot be told a thread from a fork or a new
/// namespace; on ENOSYS glibc makes the same thread with `clone`, whose
/// flags are an argument the allow-list checks. (A filter has one action
/// for what it matches; the kernel runs both and takes the stricter
/// answer, and ENOSYS is stricter than the allow-list's "allow".)
fn compile_no_clone3() -> Result<BpfProgram, DaemonError> {
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(seccomp_err)?;
    SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, vec![])]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .and_then(BpfProgram::try_from)
    .map_err(seccomp_err)
}

/// `clone` flags of a new thread, exactly as glibc's pthread_create passes
/// them (`create_thread` in nptl; strace of Rust's std::thread, and of
/// glibc's fallback from clone3 to clone, on Debian 12's glibc 2.36).
/// librbd's and librados' threads are pthreads too (std::thread, boost),
/// made the same way. io_uring's workers are made by the kernel, not by a
/// syscall of ours. A fork (no CLONE_VM), a vfork (CLONE_VFORK), a new
/// namespace (CLONE_NEW*) or a thread in another process's group
/// (CLONE_PARENT) is any other value, and is refused.
const THREAD_CLONE_FLAGS: u64 = (libc::CLONE_VM
    | libc::CLONE_FS
    | libc::CLONE_FILES
    | libc::CLONE_SIGHAND
    | libc::CLONE_THREAD
    | libc::CLONE_SYSVSEM
    | libc::CLONE_SETTLS
    | libc::CLONE_PARENT_SETTID
    | libc::CLONE_CHILD_CLEARTID) as u64;

type Rules = Result<Vec<SeccompRule>, seccompiler::BackendError>;

/// Any arguments.
fn any() -> Rules {
    Ok(vec![])
}

/// Argument `arg` (32 bits) equal to one of `values`, which must not be
/// empty (no rule at all would mean any arguments).
fn arg_in(arg: u8, values: &[u64]) -> Rules {
    assert!(!values.is_empty(), "an empty allow-list for argument {arg}");
    values
        .iter()
        .map(|v| SeccompRule::new(vec![SeccompCondition::new(arg, Len::Dword, Op::Eq, *v)?]))
        .collect()
}

/// Every (argument, value) pair holds at once (32-bit arguments).
fn args_eq(pairs: &[(u8, u64)]) -> Rules {
    let conditions = pairs
        .iter()
        .map(|&(arg, v)| SeccompCondition::new(arg, Len::Dword, Op::Eq, v))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(vec![SeccompRule::new(conditions)?])
}

/// Argument `arg` (64 bits) equal to `value`.
fn arg64_eq(arg: u8, value: u64) -> Rules {
    Ok(vec![SeccompRule::new(vec![SeccompCondition::new(
        arg,
        Len::Qword,
        Op::Eq,
        value,
    )?])?])
}

/// Argument `arg` (32 bits) with none of the bits of `mask` set.
fn arg_without(arg: u8, mask: u64) -> Rules {
    Ok(vec![SeccompRule::new(vec![SeccompCondition::new(
        arg,
        Len::Dword,
        Op::MaskedEq(mask),
        0,
    )?])?])
}

/// Which engine's syscalls the filter allows on top of the daemon's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// io_uring on a file or block device (and the null engine).
    File,
    /// Ceph RBD: librbd's threads and their TCP connections to the
    /// cluster (see [`allowed`]).
    Rbd,
}

/// Every rule of each, any one of which allows the call.
fn either(rules: impl IntoIterator<Item = Rules>) -> Rules {
    rules.into_iter().try_fold(Vec::new(), |mut all, r| {
        all.extend(r?);
        Ok(all)
    })
}

/// The allow-list: syscall number and the argument rules (empty: any).
///
/// The RBD profile adds what librbd and librados do after start-up, found
/// with `strace -f` of the daemon through the RBD tests (writes, reads,
/// discard, write-zeroes, flush, two connections, SIGTERM), and through
/// one where the messenger drops its connections at random (`ms inject
/// socket failures`) and reconnects: their threads, already started
/// before the filter (TSYNC filters them too), wait on futexes and epoll,
/// `poll`, talk over TCP (`sendmsg`, `recvmsg`, `recvfrom`, `read`,
/// `write`, `shutdown`, `close`: all in the base list), and open new
/// connections to monitors and OSDs (`socket` of AF_INET or AF_INET6
/// stream sockets, `connect`, `setsockopt(TCP_NODELAY)`,
/// `fcntl(F_SETFL)` for O_NONBLOCK, `getsockname`). A cluster of more
/// than one OSD does that at run time as a matter of course: the first
/// I/O to each OSD connects to it. AF_INET6 is not in the traces (the
/// test cluster is on 127.0.0.1) and is allowed for clusters on IPv6.
/// The client's admin socket is turned off (`engine::rbd::client`), so
/// nothing accepts or unlinks; its log file was opened before the filter.
/// Two queues writing to one image (two handles passing the exclusive
/// lock) added `uname`: the traces above had one queue. A daemon killed
/// and restarted under a guest (`--seccomp log`, then the kernel's audit
/// records) added `timerfd_create`, `timerfd_settime` and
/// `restart_syscall` (now in every profile's list).
///
/// Bitmaps and backups ([`Extras`]) add, only where the device has them:
/// for bitmaps, `openat` of the bitmaps' directory with the flags that
/// create a new file and open no existing one, `fallocate` of a new
/// sidecar (mode 0), `msync` and `fsync`; for backups, a Unix stream
/// socket (`socket`, `fchmod` to 0600 before `bind`, `listen`), `poll` in
/// its accept loop, and `lseek` with SEEK_DATA or SEEK_HOLE
/// (`base:allocation`). (`pread64`/`pwrite64` of the image, the
/// copy-before-write file and a sidecar's header are on every profile:
/// qcow2's metadata thread needs them too.) Found with `strace -f` through
/// the backup tests (`tests/socket/backup.rs`, the guest's in
/// `tests/guest/backup.rs`), then run under `--seccomp enforce`.
fn allowed(
    profile: Profile,
    extras: Extras,
    unlink_dirs: &[i32],
    open_dir: Option<i32>,
    pid: i32,
) -> Vec<(i64, Rules)> {
    use libc::*;
    let rbd = profile == Profile::Rbd;
    let no_exec = || arg_without(2, PROT_EXEC as u64);
    let mut fcntl_cmds = vec![
        F_GETFD as u64,
        F_SETFD as u64,
        F_GETFL as u64,
        F_DUPFD_CLOEXEC as u64,
        // Sealing the inflight memfd, checking a received one.
        F_ADD_SEALS as u64,
        F_GET_SEALS as u64,
        // The image lock (io::ImageLock), taken and released as rings
        // start and stop.
        F_OFD_SETLK as u64,
    ];
    let rcvtimeo = || {
        either(
            [SO_RCVTIMEO, SO_SNDTIMEO]
                .map(|opt| args_eq(&[(1, SOL_SOCKET as u64), (2, opt as u64)])),
        )
    };
    let setsockopt_rules = if rbd {
        // librbd's messenger: O_NONBLOCK on each new connection.
        fcntl_cmds.push(F_SETFL as u64);
        either([
            rcvtimeo(),
            args_eq(&[(1, IPPROTO_TCP as u64), (2, TCP_NODELAY as u64)]),
        ])
    } else {
        rcvtimeo()
    };
    let mut list = vec![
        // vhost-user: the next front-end, its messages and the fds they carry.
        (SYS_accept4, any()),
        (SYS_recvmsg, any()),
        (SYS_sendmsg, any()),
        (SYS_shutdown, any()),
        (SYS_close, any()),
        (SYS_fcntl, arg_in(1, &fcntl_cmds)),
        // FIONBIO: std's set_nonblocking. The HTTP endpoints' listeners
        // are made non-blocking before the filter (their connections are
        // accepted non-blocking, by accept4's flags), but the vhost crate's
        // Listener::set_nonblocking would make the call, so it stays until
        // a trace shows nothing needs it. Discard of a block device whose
        // kernel cannot do it through io_uring.
        (
            SYS_ioctl,
            arg_in(
                1,
                &[
                    FIONBIO,
                    crate::io::BLKDISCARD() as u64,
                    // An online resize re-reads a block device's size.
                    crate::io::BLKGETSIZE64() as u64,
                ],
            ),
        ),
        // No `socket` and no `connect` in the file profile: after start-up
        // the daemon makes no socket of its own and connects to nothing.
        // The relay's stream to vhost-user-backend's inner socket is
        // connected by the connector process (`daemon::connector`) and
        // handed over (recvmsg); sockets the daemon serves come from
        // accept4, the back-end channel from the front-end. (The RBD
        // profile adds TCP sockets to the cluster: see below.)
        // vhost-user-backend checks the back-end channel a front-end hands
        // over (SET_BACKEND_REQ_FD) is a Unix stream socket; the daemon
        // reads who the front-end it accepted is (SO_PEERCRED, for
        // `ctl status`).
        (
            SYS_getsockopt,
            either(
                [SO_DOMAIN, SO_TYPE, SO_PEERCRED]
                    .map(|opt| args_eq(&[(1, SOL_SOCKET as u64), (2, opt as u64)])),
            ),
        ),
        // The relay's read timeouts on a front-end that stalls mid-message,
        // and the back-end channel's deadline for sending and for an answer
        // (the RBD profile adds TCP_NODELAY).
        (SYS_setsockopt, setsockopt_rules),
        // Guest memory, the vrings and io_uring's rings; thread stacks; malloc.
        (SYS_mmap, no_exec()),
        (SYS_mprotect, no_exec()),
        (SYS_munmap, any()),
        (SYS_madvise, any()),
        // realloc of large buffers and the main arena: not in the traces,
        // but glibc may use them for any allocation.
        (SYS_mremap, any()),
        (SYS_brk, any()),
        // The inflight region for reconnects (GET_INFLIGHT_FD).
        (SYS_memfd_create, any()),
        (SYS_ftruncate, any()),
        // Event loops: one epoll and a few eventfds per connection; each
        // HTTP endpoint's runtime waits in epoll_wait (its epoll and
        // eventfd are made before the filter).
        (SYS_epoll_create1, any()),
        (SYS_epoll_ctl, any()),
        (SYS_epoll_wait, any()),
        (SYS_epoll_pwait, any()),
        (SYS_eventfd2, any()),
        // A queue whose head request waits (QoS tokens, the image lock)
        // arms its timerfd (made before the filter; read like the
        // eventfds).
        (SYS_timerfd_settime, any()),
        (SYS_read, any()),
        (SYS_write, any()),
        // The I/O engines' rings, all made before the filter: no
        // io_uring_setup after it, so no unrestricted ring can be made.
        // Registering is for guest memory as fixed buffers, which follows
        // the front-end's memory table (the rings' own restrictions allow
        // only these two register opcodes too).
        (SYS_io_uring_enter, any()),
        (
            SYS_io_uring_register,
            arg_in(1, &crate::engine::REGISTER_OPS.map(u64::from)),
        ),
        // Worker threads, started per connection, and the control API's
        // verb threads (tokio's blocking pool: at most
        // `api::VERB_THREADS`, started when a slow verb comes, gone after
        // 10 s idle); and their exit. clone3 is allowed here and answered
        // ENOSYS by the second filter (`compile_no_clone3`); glibc then
        // calls clone, allowed only with the flags of a new thread.
        (SYS_clone3, any()),
        (SYS_clone, arg64_eq(0, THREAD_CLONE_FLAGS)),
        (SYS_set_robust_list, any()),
        (SYS_rseq, any()),
        (SYS_sigaltstack, any()),
        (SYS_rt_sigprocmask, any()),
        (SYS_prctl, arg_in(0, &[PR_SET_NAME as u64])),
        (SYS_gettid, any()),
        (SYS_sched_getaffinity, any()),
        // Busy-polling claims the CPU it polls on (sched_getcpu, which
        // glibc answers from rseq or the vDSO where it can).
        (SYS_getcpu, any()),
        // ... and stops when its thread was preempted: its own count of
        // involuntary context switches.
        (SYS_getrusage, arg_in(0, &[libc::RUSAGE_THREAD as u64])),
        // --cpus: a worker pins itself (pid 0), nothing else.
        (SYS_sched_setaffinity, arg_in(0, &[0])),
        (SYS_futex, any()),
        (SYS_sched_yield, any()),
        (SYS_exit, any()),
        (SYS_exit_group, any()),
        // HashMap seeds in new threads.
        (SYS_getrandom, any()),
        // Instant::now() falls back to the syscall when the clock source
        // has no vDSO support (common in VMs).
        (SYS_clock_gettime, any()),
        // thread::sleep: a starting ring waiting for the image lock, a
        // drain backing off after an engine error.
        (SYS_clock_nanosleep, any()),
        // The signal-hook self-pipe, and the HTTP endpoints' connections
        // (read with recv; answered with write, since hyper is told not
        // to use writev); returning from signal handlers. (getpeername,
        // which tiny_http made on each connection, is no longer needed:
        // nothing else makes it, librbd and librados included.) send(2)
        // is sendto with no address (argument 4, a pointer, NULL): with
        // one, the sd_notify datagram socket could send to any datagram
        // socket path.
        (SYS_recvfrom, any()),
        (SYS_sendto, arg64_eq(4, 0)),
        (SYS_rt_sigreturn, any()),
        // The kernel's own restart of a timed sleep or wait interrupted
        // by a stop (SIGSTOP and SIGCONT, a cgroup freezer, a debugger or
        // `gcore` attaching): without it such a stop killed the daemon
        // (found by tests/socket/luks_key.rs, whose gcore stopped a
        // thread in its metadata or NBD wait; the RBD profile had it
        // already, for librbd's timer threads).
        (SYS_restart_syscall, any()),
        // Rust's SIGSEGV/SIGBUS handler (stack-overflow detection) resets
        // the signal to its default and returns, so that a real fault kills
        // the process with the right signal instead of tripping the filter
        // (which would report it as a bad syscall). Only for those two
        // signals: the SIGSYS handler itself stays in place.
        (
            SYS_rt_sigaction,
            arg_in(0, &[SIGSEGV as u64, SIGBUS as u64]),
        ),
        // abort(3), and a panic (`daemon::crash`, which logs it and
        // aborts): glibc's raise unblocks SIGABRT and sends it to the
        // calling thread, tgkill(getpid(), gettid(), SIGABRT). Only
        // SIGABRT, and only to this process: the default action ends it
        // as killed by SIGABRT (and dumps core where core dumps are on),
        // instead of the SIGSYS handler reporting getpid as a bad syscall.
        (SYS_getpid, any()),
        (
            SYS_tgkill,
            args_eq(&[(0, pid as u32 as u64), (2, SIGABRT as u64)]),
        ),
        // Shutdown: make the image durable. fdatasync is also the io_uring
        // engine's blocking flush on an IOPOLL ring.
        (SYS_fdatasync, any()),
        // The io_uring engine's blocking discard and write-zeroes on an
        // IOPOLL ring (`engine::sync`), in the modes it uses and no other;
        // a new sidecar is allocated in full (mode 0).
        (SYS_fallocate, {
            let mut modes: Vec<u64> = crate::engine::FALLOCATE_MODES
                .iter()
                .map(|&m| m as u64)
                .collect();
            if extras.bitmap_dir.is_some() {
                modes.push(0);
            }
            arg_in(1, &modes)
        }),
        // File::metadata of a received or created memfd; the size of a
        // qcow2 chain's files (the format checks table entries against it).
        (SYS_statx, any()),
        // A qcow2 image's metadata thread reads and writes tables (and
        // copy-on-write data, compressed clusters) at offsets, through
        // std's FileExt, on files opened at start-up; an allocating
        // write's cluster (copied head, the guest's data, copied tail) as
        // one pwritev.
        (SYS_pread64, any()),
        (SYS_pwrite64, any()),
        (SYS_pwritev, any()),
        // A queue's thread that allocates on a cached qcow2 image reads
        // the copy-on-write's head and tail from the page cache only
        // (`disk::reader::read_piece_from`): preadv2 with RWF_NOWAIT
        // (flags, argument 5), nothing else.
        (SYS_preadv2, args_eq(&[(5, libc::RWF_NOWAIT as u64)])),
    ];
    // Sockets of the daemon's own after start-up: TCP ones to an RBD
    // cluster, a Unix one for a backup's NBD export.
    let stream =
        |family: c_int| args_eq(&[(0, family as u64), (1, (SOCK_STREAM | SOCK_CLOEXEC) as u64)]);
    let mut sockets = Vec::new();
    if rbd {
        sockets.extend([stream(AF_INET), stream(AF_INET6)]);
    }
    if extras.backups {
        sockets.push(stream(AF_UNIX));
    }
    if !sockets.is_empty() {
        list.push((SYS_socket, either(sockets)));
    }
    if rbd || extras.backups {
        // librbd's threads (see below), the RBD engine's wait on its
        // completion eventfd; the NBD server's accept loop.
        list.push((SYS_poll, any()));
    }
    if extras.backups {
        // The NBD socket: made 0600 before it is bound (the address bind
        // is given is behind a pointer: Landlock keeps it in the backup
        // directory), and listened on.
        list.push((SYS_fchmod, arg_in(1, &[0o600])));
        list.push((SYS_bind, any()));
        list.push((SYS_listen, any()));
        // base:allocation: SEEK_DATA and SEEK_HOLE, nothing else.
        list.push((SYS_lseek, arg_in(2, &[SEEK_DATA as u64, SEEK_HOLE as u64])));
    }
    // `openat`: one entry (a second would replace the first), the
    // union of what bitmaps and snapshots need.
    let mut openat = Vec::new();
    if let Some(dir) = extras.bitmap_dir {
        // A new sidecar, in the bitmaps' directory, never a file that
        // exists (O_CREAT | O_EXCL, O_NOFOLLOW).
        openat.push(args_eq(&[
            (0, dir as u32 as u64),
            (2, crate::bitmap::sidecar::CREATE_FLAGS as u32 as u64),
        ]));
        // Its bits made durable before its header says they can be
        // trusted; the header, and the directory after a creation or a
        // removal.
        list.push((SYS_msync, any()));
        list.push((SYS_fsync, any()));
    }
    if rbd {
        // New connections to monitors and OSDs (see above): TCP sockets
        // of either family and nothing else (above), and their connect.
        // The filter cannot see the address connect is given; the only
        // sockets connect could reach anything with are these TCP ones
        // (every Unix socket the daemon holds is listening or connected
        // already, except the sd_notify one: see docs/security.md).
        list.push((SYS_connect, any()));
        list.push((SYS_getsockname, any()));
        // librbd asks for the host name when it takes the exclusive lock
        // from another client (found when each queue had its own handle
        // and two queues wrote at once; now the daemon's one handle does
        // so from another process: a restarted daemon, a migration).
        // librbd's completion callback (`engine::rbd::client`) runs on
        // librbd's threads too; its syscalls are a futex (the list's
        // mutex), a write(2) to the queue's eventfd and, when it drops the
        // last reference to a list, the allocator's.
        list.push((SYS_uname, any()));
        // librbd's asio timers (its io_context_pool thread) after the
        // daemon is restarted on an image a killed one held: found with
        // `--seccomp log` through tests/rbd/guest_rbd.rs's kills.
        // (timerfd_settime is on every profile: the QoS timers.)
        list.push((SYS_timerfd_create, any()));
        // (The same run found librbd's timer threads resuming a timed
        // wait a SIGSTOP interrupted with restart_syscall, which every
        // profile allows now: the file profile's threads do the same.)
    }
    // Shutdown: remove the sockets and the relay's private directory, by
    // the directory fds opened for that at start-up, and nowhere else.
    if !unlink_dirs.is_empty() {
        let dirs: Vec<u64> = unlink_dirs.iter().map(|&fd| fd as u64).collect();
        list.push((SYS_unlinkat, arg_in(0, &dirs)));
    }
    // A live snapshot creates its overlay (and reopens it O_DIRECT) by
    // `openat` on the snapshot directory's descriptor, opened at start-up,
    // and no other; Landlock limits what it may create there to regular
    // files beneath it (`daemon::landlock`).
    if let Some(dir) = open_dir {
        openat.push(arg_in(0, &[dir as u32 as u64]));
    }
    if !openat.is_empty() {
        list.push((SYS_openat, either(openat)));
    }
    list
}

/// Reports a trapped syscall and exits. Async-signal-safe: formats into a
/// stack buffer and calls only write(2) and _exit(2), both allowed.
extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    let mut msg = [0u8; 96];
    let mut len = 0;
    let mut put = |bytes: &[u8]| {
        let n = bytes.len().min(msg.len() - len);
        msg[len..len + n].copy_from_slice(&bytes[..n]);
        len += n;
    };
    put(b"ringblk: seccomp: syscall ");
    // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO handler.
    let code = unsafe { (*info).si_code };
    if code == SYS_SECCOMP {
        // SAFETY: for SIGSYS with SYS_SECCOMP the union holds `_sigsys`
        // { void *_call_addr; int _syscall; unsigned _arch; } right after the
        // three leading ints and their padding: _syscall is the 7th int.
        let nr = unsafe { *info.cast::<i32>().add(6) };
        let mut digits = [0u8; 12];
        let mut i = digits.len();
        let mut v = nr.unsigned_abs();
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        put(&digits[i..]);
    } else {
        put(b"?");
    }
    put(b" is not allowed; exiting (--seccomp log to find it)\n");
    // SAFETY: write(2) and _exit(2) are async-signal-safe; msg is valid
    // for len bytes.
    unsafe {
        libc::write(libc::STDERR_FILENO, msg.as_ptr().cast(), len);
        libc::_exit(EXIT_BAD_SYSCALL);
    }
}

fn install_sigsys_handler() -> Result<(), DaemonError> {
    // SAFETY: sigaction is plain data; zeroed is an empty mask and no flags.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = on_sigsys;
    act.sa_sigaction = handler as *const () as libc::sighandler_t;
    act.sa_flags = libc::SA_SIGINFO;
    // SAFETY: `act` is a valid sigaction whose handler has the SA_SIGINFO
    // signature; the old action is not needed.
    if unsafe { libc::sigaction(libc::SIGSYS, &act, std::ptr::null_mut()) } != 0 {
        return Err(DaemonError::Seccomp(format!(
            "SIGSYS handler: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
