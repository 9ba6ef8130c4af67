//! Re-reading descriptor chains by head index, for inflight recovery.
//!
//! `virtio_queue` hands out descriptor chains only through the avail ring
//! (`DescriptorChain::new` is crate-private), and its chain walk is where
//! loops, bad indirect tables and lengths are checked. Rather than copy that
//! walk, recovery builds a throw-away avail ring holding the heads to
//! resubmit, in a page of device memory, and pops them through an ordinary
//! `Queue` that shares the real descriptor table.
//!
//! That page must never be something a request can address: its content
//! is ours, and a descriptor, an indirect table or a data buffer pointing
//! at it would read it or write into it. So the page lives in a memory of
//! its own ([`ReplayMem`]): guest memory plus the page, in a gap of guest
//! physical addresses, visible only while the heads are popped. Chains are
//! walked after that, when the memory is guest memory and nothing else,
//! and requests are parsed against guest memory itself.

use std::cell::Cell;
use std::sync::atomic::Ordering;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{
    Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress,
};

use crate::virtio::GuestMem;

/// A region of guest memory as the daemon maps it.
type Region = <GuestMem as GuestMemoryBackend>::R;

/// Guest memory plus, until [`ReplayMem::hide_ring`], the page holding the
/// replay avail ring (at an address no guest region has).
#[derive(Debug)]
pub struct ReplayMem<'a> {
    guest: &'a GuestMem,
    ring: Region,
    ring_visible: Cell<bool>,
}

impl ReplayMem<'_> {
    /// From now on this is guest memory and nothing else.
    fn hide_ring(&self) {
        self.ring_visible.set(false);
    }

    fn ring(&self) -> Option<&Region> {
        self.ring_visible.get().then_some(&self.ring)
    }
}

impl GuestMemoryBackend for ReplayMem<'_> {
    type R = Region;

    fn num_regions(&self) -> usize {
        self.guest.num_regions() + usize::from(self.ring_visible.get())
    }

    fn find_region(&self, addr: GuestAddress) -> Option<&Region> {
        self.ring()
            .filter(|r| addr >= r.start_addr() && addr <= r.last_addr())
            .or_else(|| self.guest.find_region(addr))
    }

    fn iter(&self) -> impl Iterator<Item = &Region> {
        self.ring().into_iter().chain(self.guest.iter())
    }
}

/// A chain rebuilt for a resubmitted head; it reads descriptors through
/// guest memory only.
pub type ReplayChain<'m, 'a> = DescriptorChain<&'m ReplayMem<'a>>;

/// The replay ring for some heads of a queue.
pub struct Replay<'a> {
    queue: Queue,
    mem: ReplayMem<'a>,
    heads: &'a [u16],
}

/// The lowest page-aligned guest address, above 0, where `len` bytes
/// overlap no region of `mem` (a ring at 0 would read as "not set up").
fn gap(mem: &GuestMem, len: u64) -> Option<GuestAddress> {
    let mut at = 4096u64;
    // Regions come sorted by address.
    for r in mem.iter() {
        if at.checked_add(len)? <= r.start_addr().raw_value() {
            return Some(GuestAddress(at));
        }
        let after = r.last_addr().raw_value().checked_add(1)?;
        at = at.max(after.checked_next_multiple_of(4096)?);
    }
    at.checked_add(len - 1)?;
    Some(GuestAddress(at))
}

impl<'a> Replay<'a> {
    /// A ring listing `heads` (at most `real`'s size of them, each below
    /// it), over `real`'s descriptor table in `mem`. `None` when no page
    /// can be had for it.
    pub fn new(real: &Queue, mem: &'a GuestMem, heads: &'a [u16]) -> Option<Replay<'a>> {
        if heads.len() > usize::from(real.size()) {
            return None;
        }
        let len = (4 + 2 * u64::from(real.size())).next_multiple_of(4096);
        let base = gap(mem, len)?;
        let ring = Region::from_range(base, len as usize, None).ok()?;
        ring.store(0u16, MemoryRegionAddress(0), Ordering::Relaxed)
            .ok()?;
        for (i, h) in heads.iter().enumerate() {
            ring.write_obj(h.to_le(), MemoryRegionAddress(4 + 2 * i as u64))
                .ok()?;
        }
        ring.store(
            (heads.len() as u16).to_le(),
            MemoryRegionAddress(2),
            Ordering::Release,
        )
        .ok()?;

        let mut q = Queue::new(real.max_size()).ok()?;
        q.set_size(real.size());
        let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
        let (lo, hi) = split(real.desc_table());
        q.set_desc_table_address(lo, hi);
        let (lo, hi) = split(base.raw_value());
        q.set_avail_ring_address(lo, hi);
        // Never written: recovered requests complete on the real queue.
        let (lo, hi) = split(real.used_ring());
        q.set_used_ring_address(lo, hi);
        q.set_ready(true);
        Some(Replay {
            queue: q,
            mem: ReplayMem {
                guest: mem,
                ring,
                ring_visible: Cell::new(true),
            },
            heads,
        })
    }

    /// Each head, in order, with its chain, or `None` where it could not be
    /// popped. The ring is hidden before this returns: walking a chain
    /// reads guest memory only.
    pub fn chains(&mut self) -> Vec<(u16, Option<ReplayChain<'_, 'a>>)> {
        let mut out: Vec<_> = self.heads.iter().map(|&h| (h, None)).collect();
        if let Ok(popped) = self.queue.iter(&self.mem) {
            for (slot, chain) in out.iter_mut().zip(popped) {
                if chain.head_index() == slot.0 {
                    slot.1 = Some(chain);
                }
            }
        }
        self.mem.hide_ring();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::testing::{A_END, B, C_END, DATA, Driver, guest_memory, indirect, r, w};

    /// The ring goes in the first gap of guest memory that fits it, never
    /// over guest memory, and not at 0.
    #[test]
    fn the_ring_goes_where_guest_memory_is_not() {
        let mem = guest_memory();
        // Region A starts at 0: the first gap is A's end up to B.
        assert_eq!(gap(&mem, 4096), Some(GuestAddress(A_END)));
        assert_eq!(gap(&mem, B - A_END), Some(GuestAddress(A_END)));
        assert_eq!(gap(&mem, B - A_END + 4096), Some(GuestAddress(C_END)));
        let high = GuestMem::from_ranges(&[(GuestAddress(0x10_0000), 4096)]).unwrap();
        assert_eq!(gap(&high, 4096), Some(GuestAddress(4096)));
        // Memory up to the top of the address space: the gap below it.
        let top = GuestMem::from_ranges(&[
            (GuestAddress(0), 0x1000),
            (GuestAddress(u64::MAX - 0x1fff), 0x1000),
        ])
        .unwrap();
        assert_eq!(gap(&top, 4096), Some(GuestAddress(0x1000)));
    }

    /// Chains pop in the order given, and once popped, nothing can address
    /// the ring's page: a chain whose indirect table points at it ends
    /// there, as a table outside guest memory does.
    #[test]
    fn chains_come_in_order_and_cannot_reach_the_ring() {
        let mem = guest_memory();
        let mut driver = Driver::new(&mem, 16);
        driver.post_at(0, &[r(DATA, 16), w(DATA + 0x100, 1)]);
        driver.post_at(4, &[r(DATA, 16), w(DATA + 0x100, 1)]);
        // Head 8: an indirect table of 2 entries where the replay ring
        // will be. Read from there, its first entry would be a descriptor.
        driver.post_at(8, &[indirect(A_END, 32)]);
        let heads = [4u16, 8, 0];
        let mut replay = Replay::new(&driver.queue, &mem, &heads).unwrap();
        assert_eq!(replay.mem.ring.start_addr(), GuestAddress(A_END));
        let chains = replay.chains();
        let got: Vec<u16> = chains.iter().map(|(h, _)| *h).collect();
        assert_eq!(got, heads);
        let descs: Vec<usize> = chains
            .into_iter()
            .map(|(_, c)| c.expect("popped").count())
            .collect();
        assert_eq!(descs, vec![2, 0, 2], "the indirect table was read");
    }
}
