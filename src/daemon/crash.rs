//! How the daemon ends on a bug: a panic in any thread is logged (thread,
//! place, message) and aborts the whole process.
//!
//! Why the whole process: a panic is a bug, and a thread that dies alone
//! leaves the device half-working. A queue worker gone leaves its ring's
//! requests taken and never completed (the guest waits on them forever);
//! the relay or the crate's message thread gone leaves a front-end talking
//! to nothing; the control API's thread gone leaves `ctl` hanging. A daemon
//! that ends instead is restarted by its supervisor (systemd's
//! `Restart=`), the front-end reconnects, and the requests it had in
//! flight are resubmitted from the inflight region. So every panic ends
//! the daemon the same way, at once, without unwinding.
//!
//! The exit status is [`CRASH_SIGNAL`]: the process is killed by SIGABRT
//! (`status=6/ABRT` in systemd, 134 in a shell), as it is by abort(3)
//! anywhere else (an allocation that fails, an assertion in librbd). The
//! seccomp filter allows abort's syscalls for that (`daemon::seccomp`).
//! Where core dumps are on, the dump has the panicking thread's stack,
//! since nothing unwound it. The log line comes first.
//!
//! Core dumps leave guest memory out: the guest's RAM and the inflight
//! region are shared memory (memfds) the front-end handed over, and a dump
//! of them would be as large as the guest and hold its data. The daemon
//! clears bit 1 (anonymous shared memory) of its `coredump_filter`, as
//! QEMU's `dump-guest-core=off` keeps guest RAM out of its own dumps.

use std::io::Write;

/// The signal a panic or an abort ends the daemon with.
#[cfg_attr(not(test), allow(dead_code))] // Named for the docs and the tests.
pub const CRASH_SIGNAL: i32 = libc::SIGABRT;

/// `coredump_filter` bit of anonymous shared memory (core(5)).
const DUMP_ANON_SHARED: u32 = 1 << 1;

/// Installs the panic hook and keeps shared memory out of core dumps.
/// Call early in `serve`, before any thread of the daemon's starts.
pub fn install() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("<unnamed>");
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(no message)");
        let at = info
            .location()
            .map(|l| format!(" at {l}"))
            .unwrap_or_default();
        let line = format!(
            "thread '{name}' panicked{at}: {msg}; aborting (this is a bug in ringblk; please report this line)"
        );
        if log::log_enabled!(log::Level::Error) {
            log::error!("{line}");
        } else {
            let _ = writeln!(std::io::stderr(), "ringblk: {line}");
        }
        std::process::abort();
    }));
    if let Err(e) = keep_shared_memory_out_of_core_dumps() {
        log::warn!("coredump_filter: {e}; a core dump would hold guest memory");
    }
}

fn keep_shared_memory_out_of_core_dumps() -> std::io::Result<()> {
    let path = "/proc/self/coredump_filter";
    let now = std::fs::read_to_string(path)?;
    let bits = u32::from_str_radix(now.trim(), 16)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    if bits & DUMP_ANON_SHARED != 0 {
        std::fs::write(path, format!("{:x}", bits & !DUMP_ANON_SHARED))?;
    }
    Ok(())
}
