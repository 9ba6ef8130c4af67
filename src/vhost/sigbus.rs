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
//! readv/writev) get EFAULT, which is IOERR. A fault in a mapping of a
//! sidecar bitmap's bits is handed to `bitmap::fault`, which does the same
//! and marks the bitmap inconsistent. Any other SIGBUS goes to the
//! handler that was there before (std's), as if we had never installed ours.
//!
//! The handler is async-signal-safe: it reads (and, for a bitmap, stores)
//! atomics and calls mmap(2) and, for faults that are not ours,
//! sigaction(2), both of which the seccomp filter allows.
//!
//! A range is watched exactly as long as its mapping exists. The table
//! holds a reference to each region it watches, so a region is unmapped
//! only when [`release_unused`] (or the next [`watch`]) finds that nobody
//! else holds it any more, and it leaves the table before that reference
//! is dropped. A region the front-end removed stays mapped, and watched,
//! while a request in flight holds a snapshot that has it (`engine::Io`);
//! a stale range can never cover a later, unrelated mapping at the same
//! address.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use crate::virtio::GuestMem;

/// A region of guest memory as the daemon maps it.
type Region = <GuestMem as GuestMemoryBackend>::R;

/// Memory slots the device advertises (GET_MAX_MEM_SLOTS, with
/// CONFIGURE_MEM_SLOTS): vhost-user-backend 0.24 answers 509 (its
/// handler's `MAX_MEM_SLOTS`), and the relay refuses an ADD_MEM_REG that
/// would take the table past it (`tests/socket/memory_slots.rs` checks both).
pub const MEM_SLOTS: usize = 509;

/// Ranges the handler can watch at once: the advertised slots, and as
/// many again for regions already removed from the table but still held
/// by requests in flight. Memory that needs more is refused ([`watch`]).
pub const SLOTS: usize = 1024;

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
/// What the handler reads: it only ever loads these atomics.
static RANGES: [Range; SLOTS] = [EMPTY; SLOTS];
/// The regions behind the ranges; never touched by the handler.
static HELD: Mutex<Held> = Mutex::new(Held {
    slots: Vec::new(),
    by_start: None,
});
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

/// The region watched in each slot of [`RANGES`] (the same index).
struct Held {
    slots: Vec<Option<Arc<Region>>>,
    /// Slot of each watched region, by the start of its host range.
    by_start: Option<HashMap<usize, usize>>,
}

/// Whether nobody but the table holds `region`, or its mapping: a
/// `GuestRegionMmap` shares its mapping through an `Arc<MmapRegion>`, which
/// vm-memory hands out too (`get_mmap`), and the mapping goes with the last
/// of those. No weak references to either are ever made.
fn only_held_by_the_table(region: &Arc<Region>) -> bool {
    // `get_mmap` adds one: the region's own and this one.
    Arc::strong_count(region) == 1 && Arc::strong_count(&region.get_mmap()) == 2
}

fn held() -> MutexGuard<'static, Held> {
    // The table is consistent between statements: a panic elsewhere
    // while holding the lock leaves nothing half-done that matters.
    HELD.lock().unwrap_or_else(|p| p.into_inner())
}

impl Held {
    /// Forgets every region nobody but the table holds: its range leaves
    /// the table first, then the last reference goes, which unmaps it.
    fn release_unused(&mut self) {
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if !slot.as_ref().is_some_and(only_held_by_the_table) {
                continue;
            }
            let range = &RANGES[i];
            let start = range.start.load(Ordering::Relaxed);
            range.end.store(0, Ordering::SeqCst);
            range.start.store(0, Ordering::SeqCst);
            if let Some(by_start) = self.by_start.as_mut() {
                by_start.remove(&start);
            }
            // Only the table held it, so nothing can be touching it:
            // unmapped here.
            drop(slot.take());
        }
    }

    fn free_slot(&mut self) -> Option<usize> {
        if let Some(i) = self.slots.iter().position(Option::is_none) {
            return Some(i);
        }
        (self.slots.len() < SLOTS).then(|| {
            self.slots.push(None);
            self.slots.len() - 1
        })
    }
}

/// Watches the host ranges of `mem`'s regions as guest memory, each until
/// its region is unmapped. Regions already watched are left as they are.
/// Fails when the table has no room for a new one: more regions than
/// [`SLOTS`] mapped at once (the ones that fit are watched).
pub fn watch(mem: &GuestMem) -> io::Result<()> {
    let mut held = held();
    held.release_unused();
    for region in mem.iter() {
        let Ok(host) = region.get_host_address(MemoryRegionAddress(0)) else {
            continue;
        };
        let start = host as usize;
        let Some(end) = start.checked_add(region.len() as usize) else {
            continue;
        };
        let known = held.by_start.as_ref().and_then(|m| m.get(&start)).copied();
        // Two live mappings cannot start at the same address: a region
        // found there is this one, unless the table holds another object
        // for the same mapping, which it never makes.
        if known.is_some_and(|i| {
            held.slots[i]
                .as_ref()
                .is_some_and(|r| std::ptr::eq(&**r, region))
        }) {
            continue;
        }
        // The collection hands out its regions' `Arc`s only this way.
        let Ok((_, arc)) = mem.remove_region(region.start_addr(), region.len()) else {
            continue;
        };
        let Some(i) = held.free_slot() else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("more than {SLOTS} guest memory regions mapped at once"),
            ));
        };
        let slot = &RANGES[i];
        // A handler that reads the slot meanwhile sees end 0: no match.
        slot.end.store(0, Ordering::SeqCst);
        slot.start.store(start, Ordering::SeqCst);
        slot.end.store(end, Ordering::SeqCst);
        held.slots[i] = Some(arc);
        held.by_start
            .get_or_insert_with(HashMap::new)
            .insert(start, i);
    }
    Ok(())
}

/// Unmaps the regions nobody but this table holds any more, after taking
/// their ranges out of it. Called when guest memory changes (after the
/// workers have the new memory) and when a connection's engines come
/// back (`BlkBackend::take_engines`).
pub fn release_unused() {
    held().release_unused();
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
        // SAFETY: the page is in a guest-memory mapping of ours, readable
        // and writable, watched only while it is mapped; nothing but guest
        // memory accessors point into it, and they expect any content.
        if unsafe { crate::host::replace_with_zero_page(at, page) } {
            REPLACED.fetch_add(1, Ordering::Relaxed);
            return;
        }
    }
    // A sidecar bitmap's file truncated under its mapping: the bitmap
    // module replaces the page and marks the bitmap.
    if code == libc::BUS_ADRERR && crate::bitmap::fault::contain(addr) {
        return;
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

    /// The table is one per process: its tests take turns. Other tests
    /// can watch memory meanwhile (`BlkBackend::update_memory`), and map
    /// theirs where ours was, so a test that checks an address is no
    /// longer watched releases and checks under the table's lock, where
    /// nobody can add a range.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Releases what only the table holds; then whether `at` is watched.
    fn watched_after_release(at: usize) -> bool {
        let mut held = held();
        held.release_unused();
        watched(at)
    }

    fn host(mem: &GuestMem) -> usize {
        mem.get_host_address(GuestAddress(0)).unwrap() as usize
    }

    fn anonymous(pages: usize) -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(0), pages * 4096)]).unwrap()
    }

    /// A range leaves the table when its mapping goes, and not before: a
    /// request in flight holding a snapshot keeps it mapped and watched.
    /// Ranges used to stay forever, and could match a later, unrelated
    /// mapping at the same address.
    #[test]
    fn a_range_is_watched_exactly_while_its_region_is_mapped() {
        let _serial = serial();
        let mem = anonymous(4);
        let at = host(&mem);
        watch(&mem).unwrap();
        assert!(watched(at) && watched(at + 4 * 4096 - 1));
        assert!(!watched(at + 4 * 4096));
        // The memory is replaced while a request holds the old snapshot.
        let in_flight = mem.clone();
        drop(mem);
        let next = anonymous(1);
        watch(&next).unwrap();
        assert!(watched(at), "unwatched while a request holds it");
        // The request completes; the next change of memory lets it go.
        drop(in_flight);
        assert!(
            !watched_after_release(at),
            "still watched after it was unmapped"
        );
        assert!(watched(host(&next)));
        drop(next);
        release_unused();
    }

    /// vm-memory shares a region's mapping through its own `Arc`: held
    /// that way alone, the region is still mapped, and still watched.
    #[test]
    fn a_mapping_held_without_its_region_stays_watched() {
        let _serial = serial();
        let mem = anonymous(1);
        let at = host(&mem);
        watch(&mem).unwrap();
        let mapping = mem.iter().next().unwrap().get_mmap();
        drop(mem);
        assert!(
            watched_after_release(at),
            "unwatched while its mapping is held"
        );
        drop(mapping);
        assert!(!watched_after_release(at));
    }

    /// Watching the same memory again takes no new slot.
    #[test]
    fn memory_watched_twice_takes_its_slots_once() {
        let _serial = serial();
        let mem = GuestMem::from_ranges(&[(GuestAddress(0), 4096), (GuestAddress(0x10000), 4096)])
            .unwrap();
        for _ in 0..3 {
            watch(&mem).unwrap();
        }
        let ours = |held: &Held| {
            let slots = held.slots.iter().flatten();
            slots
                .filter(|r| mem.iter().any(|m| std::ptr::eq(&***r, m)))
                .count()
        };
        assert_eq!(ours(&held()), 2);
        drop(mem);
    }

    /// More regions mapped at once than the table holds are refused; the
    /// table used to overwrite its oldest ranges, still mapped.
    #[test]
    fn more_regions_than_the_table_holds_are_refused() {
        let _serial = serial();
        let ranges: Vec<_> = (0..=SLOTS as u64)
            .map(|i| (GuestAddress(i * 0x2000), 4096))
            .collect();
        let mem = GuestMem::from_ranges(&ranges).unwrap();
        let e = watch(&mem).unwrap_err();
        assert!(e.to_string().contains("regions mapped at once"), "{e}");
        // The first region is still watched: nothing was overwritten.
        let at = host(&mem);
        assert!(watched(at));
        drop(mem);
        assert!(!watched_after_release(at));
        let small = anonymous(1);
        watch(&small).expect("room again once the regions are gone");
        drop(small);
        release_unused();
    }

    /// A sidecar bitmap's file truncated to 0 while mapped: the next mark
    /// and the next count do not kill the process (they used to, with
    /// SIGBUS); the bitmap says it is inconsistent from then on, and its
    /// store writes the file out whole, marked so, with what was marked
    /// since. A second bitmap, truncated but not touched before it is
    /// closed, is found short and restored the same way.
    #[test]
    fn a_bitmap_file_truncated_under_its_mapping_is_survived_and_distrusted() {
        use crate::bitmap::{BitmapStore, SidecarStore};
        const G: u64 = 64 << 10;
        const SIZE: u64 = 4096 * G;
        install().expect("installing the handler");
        let dir = tempfile::tempdir().unwrap();
        let mut store = SidecarStore::new(dir.path(), "disk.img").unwrap();
        let b = store.add("t", G, SIZE).unwrap();
        let quiet = store.add("q", G, SIZE).unwrap();
        b.mark(0, G);
        quiet.mark(0, G);
        for name in ["t", "q"] {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(store.path_of(name))
                .unwrap();
            f.set_len(0).unwrap();
        }
        b.mark(3000 * G, G); // a page past the new end: SIGBUS, contained
        assert!(!b.is_consistent(), "consistent after its file shrank");
        assert_eq!(b.dirty_bytes(), G, "the bits since");
        b.clear();
        b.mark(3000 * G, G);
        assert!(!b.is_consistent(), "a clear does not make the file whole");
        store.close("t", &b).unwrap();
        store.close("q", &quiet).unwrap();
        drop((b, quiet, store));

        let mut store = SidecarStore::new(dir.path(), "disk.img").unwrap();
        let info = store.peek(SIZE).unwrap();
        assert!(info.iter().all(|i| !i.consistent), "{info:?}");
        let loaded = store.open(SIZE);
        let (name, b) = (&loaded[1].0, loaded[1].1.as_ref().unwrap());
        assert_eq!(name, "t");
        assert!(!b.is_consistent());
        assert_eq!(b.dirty_extents(), [(3000 * G, G)]);
        assert!(!loaded[0].1.as_ref().unwrap().is_consistent());
    }

    /// A region backed by a file that is then truncated: reads past the
    /// new end return zeroes instead of killing the test process, and
    /// writes land (privately).
    #[test]
    fn truncated_guest_memory_reads_zeroes() {
        let _serial = serial();
        install().expect("installing the handler");
        let file = tempfile::tempfile().unwrap();
        file.set_len(4 * 4096).unwrap();
        let region =
            MmapRegion::from_file(FileOffset::new(file.try_clone().unwrap(), 0), 4 * 4096).unwrap();
        let mem =
            GuestMem::from_regions(vec![GuestRegionMmap::new(region, GuestAddress(0)).unwrap()])
                .unwrap();
        mem.write_obj(0xabu8, GuestAddress(3 * 4096)).unwrap();
        watch(&mem).unwrap();
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
        drop(mem);
        release_unused();
    }
}
