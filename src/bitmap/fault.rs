//! Sidecar mappings whose file shrinks under them.
//!
//! A sidecar's bits are a MAP_SHARED mapping of its file (see
//! [`sidecar`](super::sidecar)). If another program truncates the file
//! while it is mapped (`truncate -s 0`, an editor, a restore over it), the
//! next access of ours to a page past the new end raises SIGBUS
//! (BUS_ADRERR): the next write the guest makes (`mark`), or the next
//! `bitmap list` (`dirty_bytes` reads every word). The default action
//! would kill the daemon, and the guest's disk with it.
//!
//! Instead, every mapping of bits is registered here ([`watch`]) for as
//! long as it exists, and the process's SIGBUS handler
//! (`vhost::sigbus`, which already contains the faults of guest memory)
//! asks [`contain`] about a fault it does not own: a fault inside a
//! watched mapping replaces that page, in our address space only, with an
//! anonymous zero page, flags the mapping, and the access is retried. The
//! bits that were in the truncated pages are gone, and what is marked in
//! the replaced page from then on no longer reaches the file: the bitmap
//! reports itself inconsistent from then on (with one ERROR line), and the
//! store writes the file out whole and marked inconsistent when it next
//! writes the header (`SidecarStore::update`, `close`). It stays
//! inconsistent until it is loaded again and cleared.
//!
//! Why not the alternatives: bits on the heap written with `pwrite` would
//! cost a system call on the write path for every word that gains a bit,
//! and lose the guarantee that a bit is in the page cache when `mark`
//! returns unless the write is made under a lock (two threads setting
//! bits of one word can `pwrite` its values out of order); file seals
//! exist for memfds only, and a lease (`F_SETLEASE`) only delays another
//! program's truncation by the lease-break time, and needs the file's
//! owner or CAP_LEASE.
//!
//! [`contain`] is async-signal-safe: it reads atomics, stores one, and
//! calls mmap(2), which the seccomp filter allows (the same call as for
//! guest memory).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Mappings of bits watched at once: one per loaded sidecar bitmap. A
/// bitmap that finds the table full is refused (its store says so).
pub const SLOTS: usize = 1024;

struct Range {
    start: AtomicUsize,
    /// 0 while the slot is being written or is free: matches nothing.
    end: AtomicUsize,
    /// A page of the range was replaced.
    faulted: AtomicBool,
    /// Taken by a live [`Watched`].
    used: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Range = Range {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
    used: AtomicBool::new(false),
};
/// What the handler reads (and flags).
static RANGES: [Range; SLOTS] = [EMPTY; SLOTS];
/// The page size, read when a range is first watched (never in the
/// handler).
static PAGE: AtomicUsize = AtomicUsize::new(4096);

/// A mapping of bits, watched until this is dropped. Drop it before the
/// mapping is unmapped.
pub(super) struct Watched {
    slot: usize,
}

/// Watches `[start, start + len)`, a shared mapping of a sidecar's file.
/// `Err` when [`SLOTS`] mappings are watched already.
pub(super) fn watch(start: usize, len: usize) -> Result<Watched, String> {
    // SAFETY: sysconf has no memory arguments.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        PAGE.store(page as usize, Ordering::Relaxed);
    }
    let end = start
        .checked_add(len)
        .ok_or_else(|| "a mapping past the address space".to_string())?;
    let slot = RANGES
        .iter()
        .position(|r| {
            r.used
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })
        .ok_or_else(|| format!("more than {SLOTS} bitmap files mapped at once"))?;
    let r = &RANGES[slot];
    r.end.store(0, Ordering::SeqCst);
    r.faulted.store(false, Ordering::SeqCst);
    r.start.store(start, Ordering::SeqCst);
    r.end.store(end, Ordering::SeqCst);
    Ok(Watched { slot })
}

impl Watched {
    /// Whether a page of the mapping was replaced: its file shrank under
    /// it.
    pub(super) fn faulted(&self) -> bool {
        RANGES[self.slot].faulted.load(Ordering::Acquire)
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let r = &RANGES[self.slot];
        r.end.store(0, Ordering::SeqCst);
        r.start.store(0, Ordering::SeqCst);
        r.used.store(false, Ordering::Release);
    }
}

/// For the process's SIGBUS handler: if `addr` lies in a watched mapping
/// of bits, replaces its page with an anonymous zero page, flags the
/// mapping, and returns true (the faulting access is then retried and
/// succeeds). False for any other address, or if the page could not be
/// replaced. Async-signal-safe.
pub fn contain(addr: usize) -> bool {
    let Some(r) = RANGES.iter().find(|r| {
        let start = r.start.load(Ordering::SeqCst);
        addr >= start && addr < r.end.load(Ordering::SeqCst)
    }) else {
        return false;
    };
    let page = PAGE.load(Ordering::Relaxed);
    let at = addr & !(page - 1);
    // SAFETY: the page is in a mapping of bits that this process made and
    // still holds (it is unwatched before it is unmapped), readable and
    // writable; only the bitmap's atomics point into it, and any content
    // (zeroes) is a valid value for them.
    if !unsafe { crate::host::replace_with_zero_page(at, page) } {
        return false;
    }
    r.faulted.store(true, Ordering::Release);
    true
}
