//! Guest memory that a front-end truncates under us.
//!
//! Guest memory is the front-end's file (a memfd, a hugetlbfs or tmpfs
//! file) mapped shared. `check_backing` refuses a table whose regions run
//! past their files, but an unsealed file can be shrunk afterwards, and the
//! next access of ours to a page past the new end raises SIGBUS
//! (BUS_ADRERR). The default action would kill the daemon, so one buggy or
//! hostile front-end could take the disk away from itself by crashing
//! ringblk; QEMU seals its memfd memory, libblkio's is not sealed.
//!
//! Instead, a fault at an address inside guest memory we mapped replaces
//! that page, in our address space only, with an anonymous zero page, and
//! the access is retried: the request reads zeroes or writes into a page
//! nobody else sees, and completes. The kernel's own accesses (io_uring's
//! readv/writev) get EFAULT, which is IOERR. Any other SIGBUS goes to the
//! handler that was there before (std's), as if we had never installed ours.
//!
//! The handler is async-signal-safe: it reads atomics and calls mmap(2)
//! and, for faults that are not ours, sigaction(2), both of which the
//! seccomp filter allows.

use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use crate::virtio::GuestMem;

/// Ranges remembered: more than the memory slots a front-end can have at
/// once (we advertise 32 with CONFIGURE_MEM_SLOTS); the oldest is reused.
const SLOTS: usize = 256;

struct Range {
    start: AtomicUsize,
    /// 0 while the slot is being written: matches nothing.
    end: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Range = Range {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
};
static RANGES: [Range; SLOTS] = [EMPTY; SLOTS];
static NEXT: AtomicUsize = AtomicUsize::new(0);
static PAGE: AtomicUsize = AtomicUsize::new(4096);
static REPLACED: AtomicU64 = AtomicU64::new(0);
/// The SIGBUS action before ours (leaked, set once).
static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());

/// Installs the handler (once per process; later calls do nothing).
/// Call before the seccomp filter.
pub fn install() -> std::io::Result<()> {
    static ONCE: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
    let mut done = ONCE.lock().unwrap_or_else(|p| p.into_inner());
    if *done {
        return Ok(());
    }
    // SAFETY: sysconf has no memory arguments.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        PAGE.store(page as usize, Ordering::Relaxed);
    }
    // SAFETY: sigaction is plain data; zeroed is an empty mask and no flags.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = on_sigbus;
    act.sa_sigaction = handler as *const () as libc::sighandler_t;
    // std's handler runs on the alternate stack; so may ours.
    act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    // SAFETY: as above.
    let old = Box::into_raw(Box::new(unsafe { std::mem::zeroed::<libc::sigaction>() }));
    // SAFETY: `act` is a valid sigaction whose handler has the SA_SIGINFO
    // signature; `old` points to writable storage for the previous one.
    if unsafe { libc::sigaction(libc::SIGBUS, &act, old) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    PREVIOUS.store(old, Ordering::Release);
    *done = true;
    Ok(())
}

/// Remembers the host ranges of `mem`'s regions as guest memory.
pub fn watch(mem: &GuestMem) {
    for region in mem.iter() {
        let Ok(host) = region.get_host_address(MemoryRegionAddress(0)) else {
            continue;
        };
        let start = host as usize;
        let Some(end) = start.checked_add(region.len() as usize) else {
            continue;
        };
        let known = RANGES.iter().any(|r| {
            r.start.load(Ordering::Relaxed) == start && r.end.load(Ordering::Relaxed) == end
        });
        if known {
            continue;
        }
        let slot = &RANGES[NEXT.fetch_add(1, Ordering::Relaxed) % SLOTS];
        // A handler that reads the slot meanwhile sees end 0: no match.
        slot.end.store(0, Ordering::SeqCst);
        slot.start.store(start, Ordering::SeqCst);
        slot.end.store(end, Ordering::SeqCst);
    }
}

/// Pages of guest memory replaced by zero pages so far.
pub fn replaced_pages() -> u64 {
    REPLACED.load(Ordering::Relaxed)
}

fn watched(addr: usize) -> bool {
    RANGES.iter().any(|r| {
        let start = r.start.load(Ordering::SeqCst);
        addr >= start && addr < r.end.load(Ordering::SeqCst)
    })
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: with SA_SIGINFO the kernel passes a valid siginfo; si_addr
    // is the faulting address for SIGBUS.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    if code == libc::BUS_ADRERR && watched(addr) {
        let page = PAGE.load(Ordering::Relaxed);
        let at = addr & !(page - 1);
        // SAFETY: replaces one page of a guest-memory mapping of ours with
        // private anonymous memory (no executable rights); nothing but guest
        // memory accessors point into it, and they expect any content.
        let p = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            REPLACED.fetch_add(1, Ordering::Relaxed);
            return;
        }
    }
    // Not ours (or a huge page we cannot split): give the fault back to
    // the previous action, which the retried access then raises.
    let previous = PREVIOUS.load(Ordering::Acquire);
    // SAFETY: `previous` is null or the leaked sigaction saved by install.
    unsafe {
        if previous.is_null() {
            libc::signal(libc::SIGBUS, libc::SIG_DFL);
        } else {
            libc::sigaction(libc::SIGBUS, previous, std::ptr::null_mut());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use vm_memory::{Bytes, FileOffset, GuestAddress, GuestRegionMmap, MmapRegion};

    /// A region backed by a file that is then truncated: reads past the
    /// new end return zeroes instead of killing the test process, and
    /// writes land (privately).
    #[test]
    fn truncated_guest_memory_reads_zeroes() {
        install().expect("installing the handler");
        let file = tempfile::tempfile().unwrap();
        file.set_len(4 * 4096).unwrap();
        let region =
            MmapRegion::from_file(FileOffset::new(file.try_clone().unwrap(), 0), 4 * 4096).unwrap();
        let mem =
            GuestMem::from_regions(vec![GuestRegionMmap::new(region, GuestAddress(0)).unwrap()])
                .unwrap();
        mem.write_obj(0xabu8, GuestAddress(3 * 4096)).unwrap();
        watch(&mem);
        let before = replaced_pages();
        // SAFETY: ftruncate on our own temporary file.
        assert_eq!(unsafe { libc::ftruncate(file.as_raw_fd(), 4096) }, 0);
        let got: u8 = mem.read_obj(GuestAddress(3 * 4096)).unwrap();
        assert_eq!(got, 0, "a truncated page reads as a zero page");
        mem.write_obj(7u8, GuestAddress(2 * 4096 + 1)).unwrap();
        assert_eq!(mem.read_obj::<u8>(GuestAddress(2 * 4096 + 1)).unwrap(), 7);
        assert_eq!(replaced_pages() - before, 2);
        // The page still backed by the file is untouched.
        mem.write_obj(9u8, GuestAddress(0)).unwrap();
        assert_eq!(mem.read_obj::<u8>(GuestAddress(0)).unwrap(), 9);
    }
}
