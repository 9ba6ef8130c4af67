//! Counts the device's accesses to the ring headers through an instrumented
//! guest memory, to prove what `RingShadow` promises: at most one
//! `avail->idx` read per batch when the ring has work (plus the re-check
//! in `enable_kicks`), one `used->idx` store per publication, and no read
//! of anything only the device writes.
//!
//! vm-memory routes every `Bytes` access of a `GuestMemory` (`load`,
//! `store`, `read_obj`, `write_obj`, slices) through
//! `GuestMemory::get_slices`, with the access mode. `GuestMemory` is
//! blanket-implemented for every `GuestMemoryBackend`, but a type that is not
//! a backend may implement it itself (that is how an IOMMU layer plugs in):
//! `Counting` does, logs each call and forwards it to the real memory.

use std::cell::RefCell;

use virtio_bindings::virtio_blk::VIRTIO_BLK_T_IN;
use virtio_queue::QueueT;
use vm_memory::bitmap::BS;
use vm_memory::guest_memory::GuestMemorySliceIterator;
use vm_memory::{GuestAddress, GuestMemory, GuestMemoryResult, Permissions};

use super::*;
use crate::virtio::testing::*;
use crate::virtio::{GuestMem, Request};

#[derive(Clone, Copy, Debug)]
struct Access {
    addr: u64,
    len: usize,
    write: bool,
}

/// Guest memory that logs every access the device makes.
struct Counting {
    inner: GuestMem,
    log: RefCell<Vec<Access>>,
}

impl GuestMemory for Counting {
    type PhysicalMemory = GuestMem;
    type Bitmap = crate::virtio::DirtyLog;

    fn check_range(&self, addr: GuestAddress, count: usize, access: Permissions) -> bool {
        GuestMemory::check_range(&self.inner, addr, count, access)
    }

    fn get_slices<'a>(
        &'a self,
        addr: GuestAddress,
        count: usize,
        access: Permissions,
    ) -> GuestMemoryResult<impl GuestMemorySliceIterator<'a, BS<'a, crate::virtio::DirtyLog>>> {
        self.log.borrow_mut().push(Access {
            addr: addr.0,
            len: count,
            write: access != Permissions::Read,
        });
        GuestMemory::get_slices(&self.inner, addr, count, access)
    }

    // `physical_memory` stays `None`: no caller can bypass the log.
}

/// What the device did to each part of the ring during one stretch.
#[derive(Debug, Default, PartialEq, Eq)]
struct Tally {
    avail_flags_reads: usize,
    avail_idx_reads: usize,
    avail_entry_reads: usize,
    used_event_reads: usize,
    used_flags_writes: usize,
    used_idx_writes: usize,
    used_elem_writes: usize,
    avail_event_writes: usize,
    /// Reads of anything in the used ring (header, elements, avail_event):
    /// only the device writes there, so it must never read it back.
    used_ring_reads: usize,
    /// Writes to the avail ring: the driver's.
    avail_ring_writes: usize,
}

impl Counting {
    fn new() -> Self {
        Counting {
            inner: guest_memory(),
            log: RefCell::new(Vec::new()),
        }
    }

    /// Classifies and clears the log.
    fn tally(&self, d: &Driver) -> Tally {
        let size = u64::from(d.size());
        let avail = d.mock.avail_addr().0;
        let used = d.used_addr().0;
        let used_event = d.used_event_addr().0;
        let avail_event = d.avail_event_addr().0;
        let mut t = Tally::default();
        for a in self.log.borrow_mut().drain(..) {
            let in_avail = (avail..used_event + 2).contains(&a.addr);
            let in_used = (used..avail_event + 2).contains(&a.addr);
            match (a.write, a.addr) {
                (false, x) if x == avail => t.avail_flags_reads += 1,
                (false, x) if x == avail + 2 => t.avail_idx_reads += 1,
                (false, x) if x == used_event => t.used_event_reads += 1,
                (false, _) if in_avail => t.avail_entry_reads += 1,
                (false, _) if in_used => t.used_ring_reads += 1,
                (true, x) if x == used => t.used_flags_writes += 1,
                (true, x) if x == used + 2 => t.used_idx_writes += 1,
                (true, x) if x == avail_event => t.avail_event_writes += 1,
                (true, x)
                    if x >= used + 4
                        && x < used + 4 + 8 * size
                        && (x - used - 4).is_multiple_of(8) =>
                {
                    assert_eq!(a.len, 8, "one store per used element");
                    t.used_elem_writes += 1
                }
                (true, _) if in_avail => t.avail_ring_writes += 1,
                _ => {}
            }
        }
        t
    }
}

/// Posts `n` reads (header, 4 KiB, status) at table indices 0, 3, 6...
fn post_reads(d: &mut Driver, n: u16) {
    d.header(VIRTIO_BLK_T_IN, 0);
    for k in 0..n {
        let data = DATA + u64::from(k) * 0x1000;
        d.post_at(3 * k, &[r(HDR, 16), w(data, 4096), status()]);
    }
}

/// One worker pass: kicks off, pop and parse a batch, complete it, publish
/// once, decide once, re-enable kicks. Returns (popped, work pending).
fn pass(shadow: &mut RingShadow, d: &mut Driver, mem: &Counting) -> (usize, bool) {
    let size = d.size();
    let view = RingView::scattered(&d.queue, mem);
    shadow.disable_kicks(&d.queue, &view).unwrap();
    let mut reqs = Vec::new();
    let snapshot = d.snapshot.clone();
    let n = shadow
        .pop(&mut d.queue, &view, usize::from(size), |chain| {
            reqs.push(Request::parse(chain, &snapshot, &limits(), CAPACITY, size).unwrap());
        })
        .unwrap();
    for req in &reqs {
        shadow
            .add_used(&mut d.queue, &view, req.head(), req.written_len() + 1)
            .unwrap();
    }
    shadow.publish(&d.queue, &view).unwrap();
    shadow.needs_notification(&d.queue, &view).unwrap();
    let pending = shadow.enable_kicks(&d.queue, &view).unwrap();
    (n, pending)
}

#[test]
fn one_avail_idx_read_per_batch_and_no_used_header_reads() {
    for event_idx in [true, false] {
        let mem = Counting::new();
        let mut d = Driver::new(&mem.inner, 32);
        d.queue.set_event_idx(event_idx);
        let mut shadow = RingShadow::default();
        shadow.reset(&d.queue);

        post_reads(&mut d, 8);
        mem.log.borrow_mut().clear();
        assert_eq!(pass(&mut shadow, &mut d, &mem), (8, false));
        let t = mem.tally(&d);
        assert_eq!(d.used_idx(), 8);
        let want = Tally {
            // One for the batch, one for enable_kicks' re-check.
            avail_idx_reads: 2,
            avail_entry_reads: 8,
            used_idx_writes: 1,
            used_elem_writes: 8,
            // EVENT_IDX: used_event read, avail_event written twice (off,
            // on); otherwise avail->flags read and used->flags written
            // twice.
            used_event_reads: usize::from(event_idx),
            avail_event_writes: if event_idx { 2 } else { 0 },
            avail_flags_reads: usize::from(!event_idx),
            used_flags_writes: if event_idx { 0 } else { 2 },
            used_ring_reads: 0,
            avail_ring_writes: 0,
        };
        assert_eq!(t, want, "event_idx {event_idx}");
    }
}

#[test]
fn a_full_ring_is_one_read_too() {
    let mem = Counting::new();
    let mut d = Driver::new(&mem.inner, 16);
    d.queue.set_event_idx(true);
    let mut shadow = RingShadow::default();
    shadow.reset(&d.queue);
    // 16 one-descriptor chains fill the ring; the parse result is not the point.
    for k in 0..16 {
        d.post_at(k, &[status()]);
    }
    mem.log.borrow_mut().clear();
    let view = RingView::scattered(&d.queue, &mem);
    let n = shadow.pop(&mut d.queue, &view, 16, |_| {}).unwrap();
    assert_eq!(n, 16);
    let t = mem.tally(&d);
    assert_eq!((t.avail_idx_reads, t.avail_entry_reads), (1, 16));
}

#[test]
fn later_passes_write_nothing_that_did_not_change() {
    for event_idx in [true, false] {
        let mem = Counting::new();
        let mut d = Driver::new(&mem.inner, 32);
        d.queue.set_event_idx(event_idx);
        let mut shadow = RingShadow::default();
        shadow.reset(&d.queue);
        post_reads(&mut d, 4);
        pass(&mut shadow, &mut d, &mem);
        mem.log.borrow_mut().clear();

        // A kick with nothing new: one read to pop, one to re-check; the
        // suppression state goes down and up again (EVENT_IDX too: left
        // where it was, the driver's next request would kick).
        assert_eq!(pass(&mut shadow, &mut d, &mem), (0, false));
        let t = mem.tally(&d);
        assert_eq!(t.avail_idx_reads, 2);
        assert_eq!((t.used_idx_writes, t.used_elem_writes), (0, 0));
        assert_eq!(
            (t.used_event_reads, t.avail_flags_reads),
            (0, 0),
            "nothing to notify"
        );
        assert_eq!(t.avail_event_writes, if event_idx { 2 } else { 0 });
        assert_eq!(t.used_flags_writes, if event_idx { 0 } else { 2 });
        assert_eq!(t.used_ring_reads, 0);

        // Two more chains: one batch, one read.
        post_reads(&mut d, 2);
        assert_eq!(pass(&mut shadow, &mut d, &mem), (2, false));
        let t = mem.tally(&d);
        assert_eq!(
            (t.avail_idx_reads, t.used_idx_writes, t.used_ring_reads),
            (2, 1, 0)
        );
    }
}

#[test]
fn limited_pops_read_the_index_once_each() {
    let mem = Counting::new();
    let mut d = Driver::new(&mem.inner, 32);
    let mut shadow = RingShadow::default();
    shadow.reset(&d.queue);
    post_reads(&mut d, 6);
    mem.log.borrow_mut().clear();
    let view = RingView::scattered(&d.queue, &mem);
    assert_eq!(shadow.pop(&mut d.queue, &view, 4, |_| {}).unwrap(), 4);
    assert!(shadow.more_avail());
    assert_eq!(shadow.pop(&mut d.queue, &view, 4, |_| {}).unwrap(), 2);
    assert_eq!(shadow.pop(&mut d.queue, &view, 0, |_| {}).unwrap(), 0);
    let t = mem.tally(&d);
    assert_eq!((t.avail_idx_reads, t.avail_entry_reads), (2, 6));
}

#[test]
fn the_log_sees_what_the_queue_reads() {
    // Guards the instrument itself: a counter that saw nothing would make
    // every "zero reads" above pass vacuously.
    let mem = Counting::new();
    let d = Driver::new(&mem.inner, 16);
    mem.log.borrow_mut().clear();
    d.queue.avail_idx(&mem, Ordering::Acquire).unwrap();
    d.queue.used_idx(&mem, Ordering::Acquire).unwrap();
    let t = mem.tally(&d);
    assert_eq!((t.avail_idx_reads, t.used_ring_reads), (1, 1));
}
