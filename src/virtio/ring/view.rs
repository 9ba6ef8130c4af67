//! One queue's three rings, translated once per worker pass.
//!
//! Every access to the descriptor table, the avail ring and the used ring
//! through `GuestMemory` looks the address up among the regions and walks
//! vm-memory's slice layers: about 200 instructions for a 16-byte
//! descriptor, eight such accesses per request. A [`RingView`] takes a
//! [`VolatileSlice`] of each ring when the worker starts a pass (the
//! driver cannot move the rings while they run: SET_VRING_ADDR needs a
//! stopped ring), and each access is then a bounds check and a volatile
//! load or store. Stores go through the slice's bitmap, so the dirty log
//! sees them as it sees any write through vm-memory.
//!
//! A ring that does not lie in one region (the spec only asks it to be
//! contiguous in guest-physical memory) is accessed the slow way, address
//! by address, with the same results.
//!
//! [`ViewChain`] walks a descriptor chain over the view exactly as
//! virtio-queue's `DescriptorChain` does (same limits, same indirect-table
//! rules, same early ends); the parser takes either
//! ([`crate::virtio::request::Chain`]), and the fuzz target checks that
//! both walks give the same result on every input.

use std::sync::atomic::Ordering;

use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::bitmap::BS;
use vm_memory::{
    Address, Bytes, GuestAddress, GuestMemory, Permissions, VolatileMemory, VolatileSlice,
};

use super::RingError;
use crate::virtio::GuestMem;

/// A slice of guest memory with its region's dirty bitmap.
type Slice<'m, M> = VolatileSlice<'m, BS<'m, <M as GuestMemory>::Bitmap>>;

/// `flags` + `idx` in front of both rings.
const RING_HEADER: usize = 4;
const DESC_SIZE: usize = 16;

/// Where a ring, or a descriptor table, is.
enum Area<'m, M: GuestMemory + ?Sized> {
    /// Inside one region: one slice for every access.
    Slice(Slice<'m, M>),
    /// Across regions, or partly outside memory: each access translates
    /// its own address.
    Scattered(GuestAddress),
}

impl<M: GuestMemory + ?Sized> Clone for Area<'_, M> {
    fn clone(&self) -> Self {
        match self {
            Area::Slice(s) => Area::Slice(s.clone()),
            Area::Scattered(a) => Area::Scattered(*a),
        }
    }
}

/// The descriptor table, avail ring and used ring of one queue, in `M`
/// (the daemon's guest memory; tests count accesses through another).
pub struct RingView<'m, M: GuestMemory + ?Sized = GuestMem> {
    mem: &'m M,
    size: u16,
    desc: Area<'m, M>,
    avail: Area<'m, M>,
    used: Area<'m, M>,
}

impl<'m, M: GuestMemory + ?Sized> RingView<'m, M> {
    /// The rings `queue` is set up with, in `mem`.
    pub fn new(queue: &Queue, mem: &'m M) -> RingView<'m, M> {
        RingView::build(queue, mem, true)
    }

    /// The same, accessed address by address (what a ring that does not
    /// lie in one region gets): for tests that count the accesses.
    #[cfg(test)]
    pub fn scattered(queue: &Queue, mem: &'m M) -> RingView<'m, M> {
        RingView::build(queue, mem, false)
    }

    fn build(queue: &Queue, mem: &'m M, slices: bool) -> RingView<'m, M> {
        let size = usize::from(queue.size());
        let area = |addr: u64, len: usize| match slices {
            true => area(mem, GuestAddress(addr), len),
            false => Area::Scattered(GuestAddress(addr)),
        };
        RingView {
            mem,
            size: queue.size(),
            desc: area(queue.desc_table(), DESC_SIZE * size),
            // flags, idx, ring[size], used_event
            avail: area(queue.avail_ring(), RING_HEADER + 2 * size + 2),
            // flags, idx, ring[size] of 8 bytes, avail_event
            used: area(queue.used_ring(), RING_HEADER + 8 * size + 2),
        }
    }

    /// The memory the rings are in (the snapshot the worker uses).
    pub fn mem(&self) -> &'m M {
        self.mem
    }

    pub fn size(&self) -> u16 {
        self.size
    }

    /// `avail->idx`, with acquire: the entries before it are then visible.
    #[inline]
    pub fn avail_idx(&self) -> Result<u16, RingError> {
        self.load_u16(&self.avail, 2, Ordering::Acquire)
    }

    /// `avail->ring[slot]`: a chain's head.
    #[inline]
    pub fn avail_entry(&self, slot: u16) -> Result<u16, RingError> {
        let off = RING_HEADER + 2 * usize::from(slot);
        self.load_u16(&self.avail, off, Ordering::Acquire)
    }

    /// `avail->flags`.
    #[inline]
    pub fn avail_flags(&self) -> Result<u16, RingError> {
        self.load_u16(&self.avail, 0, Ordering::Relaxed)
    }

    /// `used_event`, the avail ring's trailing field (EVENT_IDX).
    #[inline]
    pub fn used_event(&self) -> Result<u16, RingError> {
        let off = RING_HEADER + 2 * usize::from(self.size);
        self.load_u16(&self.avail, off, Ordering::Relaxed)
    }

    /// Writes `used->ring[slot]`, not yet published.
    #[inline]
    pub fn set_used_elem(&self, slot: u16, head: u16, len: u32) -> Result<(), RingError> {
        // struct virtq_used_elem { le32 id; le32 len; } as one 8-byte store.
        let elem = (u64::from(head) | (u64::from(len) << 32)).to_le();
        let off = RING_HEADER + 8 * usize::from(slot);
        match &self.used {
            Area::Slice(s) => s
                .get_ref::<u64>(off)
                .map(|r| r.store(elem))
                .map_err(|_| RingError::Memory),
            Area::Scattered(base) => self
                .mem
                .write_obj(elem, offset(*base, off)?)
                .map_err(|_| RingError::Memory),
        }
    }

    /// Stores `used->idx` with release: the elements before it are
    /// visible to the driver once it is.
    #[inline]
    pub fn set_used_idx(&self, idx: u16) -> Result<(), RingError> {
        self.store_u16(&self.used, 2, idx, Ordering::Release)
    }

    /// `used->flags`.
    pub fn set_used_flags(&self, flags: u16) -> Result<(), RingError> {
        self.store_u16(&self.used, 0, flags, Ordering::Relaxed)
    }

    /// `avail_event`, the used ring's trailing field (EVENT_IDX).
    pub fn set_avail_event(&self, value: u16) -> Result<(), RingError> {
        let off = RING_HEADER + 8 * usize::from(self.size);
        self.store_u16(&self.used, off, value, Ordering::Relaxed)
    }

    /// The chain whose head is descriptor `head`.
    #[inline]
    pub fn chain(&self, head: u16) -> ViewChain<'_, 'm, M> {
        ViewChain {
            view: self,
            table: self.desc.clone(),
            table_len: self.size,
            head,
            next_index: head,
            ttl: self.size,
            yielded_bytes: 0,
            is_indirect: false,
        }
    }

    #[inline]
    fn load_u16(&self, area: &Area<'m, M>, off: usize, order: Ordering) -> Result<u16, RingError> {
        let v = match area {
            Area::Slice(s) => s.load::<u16>(off, order).map_err(|_| RingError::Memory)?,
            Area::Scattered(base) => self
                .mem
                .load::<u16>(offset(*base, off)?, order)
                .map_err(|_| RingError::Memory)?,
        };
        Ok(u16::from_le(v))
    }

    #[inline]
    fn store_u16(
        &self,
        area: &Area<'m, M>,
        off: usize,
        v: u16,
        order: Ordering,
    ) -> Result<(), RingError> {
        let v = v.to_le();
        match area {
            Area::Slice(s) => s.store(v, off, order).map_err(|_| RingError::Memory),
            Area::Scattered(base) => self
                .mem
                .store(v, offset(*base, off)?, order)
                .map_err(|_| RingError::Memory),
        }
    }

    /// Descriptor `i` of `table`.
    #[inline]
    fn descriptor(&self, table: &Area<'m, M>, i: u16) -> Option<Descriptor> {
        let off = DESC_SIZE * usize::from(i);
        match table {
            Area::Slice(s) => s.get_ref::<Descriptor>(off).ok().map(|r| r.load()),
            Area::Scattered(base) => self.mem.read_obj(offset(*base, off).ok()?).ok(),
        }
    }
}

/// `len` bytes at `addr` as one slice if they lie in one region.
fn area<M: GuestMemory + ?Sized>(mem: &M, addr: GuestAddress, len: usize) -> Area<'_, M> {
    let first = mem
        .get_slices(addr, len, Permissions::ReadWrite)
        .ok()
        .and_then(|mut slices| slices.next())
        .and_then(Result::ok);
    match first {
        Some(s) if s.len() == len && len > 0 => Area::Slice(s),
        _ => Area::Scattered(addr),
    }
}

fn offset(base: GuestAddress, off: usize) -> Result<GuestAddress, RingError> {
    base.checked_add(off as u64).ok_or(RingError::Memory)
}

/// A descriptor chain over a [`RingView`]: the walk of virtio-queue's
/// `DescriptorChain` (0.18), descriptor for descriptor.
pub struct ViewChain<'v, 'm, M: GuestMemory + ?Sized = GuestMem> {
    view: &'v RingView<'m, M>,
    /// The table being walked: the queue's, or the indirect one.
    table: Area<'m, M>,
    table_len: u16,
    head: u16,
    next_index: u16,
    /// Descriptors the walk may still take from this table: a loop ends.
    ttl: u16,
    yielded_bytes: u32,
    is_indirect: bool,
}

impl<M: GuestMemory + ?Sized> ViewChain<'_, '_, M> {
    pub fn head_index(&self) -> u16 {
        self.head
    }

    /// Moves the walk to the indirect table `desc` describes. None (the
    /// chain ends) for a nested table or a length that is not whole
    /// descriptors or names more than 65535 of them.
    fn switch_to_indirect_table(&mut self, desc: &Descriptor) -> Option<()> {
        if self.is_indirect || !(desc.len() as usize).is_multiple_of(DESC_SIZE) {
            return None;
        }
        let table_len = u16::try_from(desc.len() as usize / DESC_SIZE).ok()?;
        self.table = area(self.view.mem, desc.addr(), desc.len() as usize);
        self.table_len = table_len;
        self.next_index = 0;
        self.ttl = table_len;
        self.is_indirect = true;
        Some(())
    }
}

impl<M: GuestMemory + ?Sized> Iterator for ViewChain<'_, '_, M> {
    type Item = Descriptor;

    // A loop, not a recursion after an indirect table's switch: a
    // recursive function is never inlined into the parser's loop.
    #[inline]
    fn next(&mut self) -> Option<Descriptor> {
        loop {
            if self.ttl == 0 || self.next_index >= self.table_len {
                return None;
            }
            let desc = self.view.descriptor(&self.table, self.next_index)?;
            if desc.refers_to_indirect_table() {
                self.switch_to_indirect_table(&desc)?;
                continue;
            }
            self.yielded_bytes = self.yielded_bytes.checked_add(desc.len())?;
            if desc.has_next() {
                self.next_index = desc.next();
                self.ttl -= 1;
            } else {
                self.ttl = 0;
            }
            return Some(desc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::chain_writer::{INDIRECT, NEXT};
    use crate::virtio::testing::*;

    /// Posts `descs` at table index `first` as given (flags and `next`
    /// untouched), and walks the chain both ways.
    fn both_walks(d: &mut Driver, first: u16, descs: &[Desc]) -> Vec<(u64, u32, u16, u16)> {
        d.post_raw(first, descs);
        let view = RingView::new(&d.queue, d.mem);
        let raw = |x: Descriptor| (x.addr().0, x.len(), x.flags(), x.next());
        let ours: Vec<_> = view.chain(first).take(600).map(raw).collect();
        let theirs: Vec<_> = d.pop().take(600).map(raw).collect();
        assert_eq!(ours, theirs, "{descs:?}");
        ours
    }

    fn desc(addr: u64, len: u32, flags: u16, next: u16) -> Desc {
        Desc {
            addr,
            len,
            flags,
            next,
        }
    }

    #[test]
    fn chains_are_walked_as_virtio_queue_walks_them() {
        let mem = guest_memory();
        let mut d = Driver::new(&mem, 16);
        // Plain, a loop, `next` past the table, a head past the table.
        let got = both_walks(
            &mut d,
            0,
            &[
                desc(HDR, 16, NEXT, 1),
                desc(DATA, 512, WRITE_FLAG | NEXT, 2),
                desc(STATUS, 1, WRITE_FLAG, 0),
            ],
        );
        assert_eq!(got.len(), 3);
        let got = both_walks(&mut d, 3, &[desc(HDR, 16, NEXT, 4), desc(DATA, 8, NEXT, 3)]);
        assert_eq!(got.len(), 16, "a loop ends after a table's worth");
        assert_eq!(both_walks(&mut d, 5, &[desc(HDR, 16, NEXT, 16)]).len(), 1);
        d.post_head(40);
        let view = RingView::new(&d.queue, d.mem);
        assert_eq!(view.chain(40).count(), 0);
        assert_eq!(d.pop().count(), 0);
        // Lengths that overflow 4 GiB end the chain.
        let got = both_walks(
            &mut d,
            6,
            &[desc(HDR, u32::MAX, NEXT, 7), desc(DATA, 2, 0, 0)],
        );
        assert_eq!(got.len(), 1);
    }

    #[test]
    fn indirect_tables_are_walked_as_virtio_queue_walks_them() {
        let mem = guest_memory();
        let mut d = Driver::new(&mem, 16);
        let table = |at: u64, descs: &[Desc]| DescTable::at(at).write(&mem, 0, descs).unwrap();
        let inner = [
            desc(HDR, 16, NEXT, 1),
            desc(DATA, 512, WRITE_FLAG | NEXT, 2),
            desc(STATUS, 1, WRITE_FLAG, 0),
        ];
        table(TABLE, &inner);
        assert_eq!(
            both_walks(&mut d, 0, &[desc(TABLE, 48, INDIRECT, 0)]).len(),
            3
        );
        // Not whole descriptors; empty; running out of memory after its
        // first entry (a zero descriptor there ends it anyway); outside.
        assert_eq!(
            both_walks(&mut d, 1, &[desc(TABLE, 40, INDIRECT, 0)]).len(),
            0
        );
        assert_eq!(
            both_walks(&mut d, 2, &[desc(TABLE, 0, INDIRECT, 0)]).len(),
            0
        );
        assert_eq!(
            both_walks(&mut d, 3, &[desc(C_END - 16, 48, INDIRECT, 0)]).len(),
            1
        );
        assert_eq!(
            both_walks(&mut d, 7, &[desc(C_END, 48, INDIRECT, 0)]).len(),
            0
        );
        // Nested: the walk ends at the inner INDIRECT.
        table(
            TABLE + 0x100,
            &[desc(HDR, 16, NEXT, 1), desc(TABLE, 48, INDIRECT, 0)],
        );
        assert_eq!(
            both_walks(&mut d, 4, &[desc(TABLE + 0x100, 32, INDIRECT, 0)]).len(),
            1
        );
        // Across the boundary of two adjacent regions: not one slice, but
        // the same walk.
        table(C - 16, &inner);
        let view = RingView::new(&d.queue, d.mem);
        assert!(matches!(
            area(view.mem, GuestAddress(C - 16), 48),
            Area::Scattered(_)
        ));
        assert_eq!(
            both_walks(&mut d, 5, &[desc(C - 16, 48, INDIRECT, 0)]).len(),
            3
        );
        // A table descriptor with NEXT: the walk stays in the table.
        assert_eq!(
            both_walks(&mut d, 6, &[desc(TABLE, 48, INDIRECT | NEXT, 9)]).len(),
            3
        );
    }

    const WRITE_FLAG: u16 = crate::virtio::chain_writer::WRITE;
}
