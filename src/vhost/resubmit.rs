//! Re-reading descriptor chains by head index, for inflight recovery.
//!
//! `virtio_queue` hands out descriptor chains only through the avail ring
//! (`DescriptorChain::new` is crate-private), and its chain walk is where
//! loops, bad indirect tables and lengths are checked. Rather than copy that
//! walk, recovery builds a throw-away avail ring holding the heads to
//! resubmit, in a page of device memory mapped just above guest memory, and
//! pops them through an ordinary `Queue` that shares the real descriptor
//! table. The requests parsed from it point into the real guest regions.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use virtio_queue::{Queue, QueueT};
use vm_memory::{
    Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap,
};

use crate::virtio::GuestMem;

/// A queue whose avail ring lists `heads`, over guest memory plus the page
/// holding that ring. Pop it with `Queue::iter(&mem)`.
pub fn replay_queue(real: &Queue, mem: &GuestMem, heads: &[u16]) -> Option<(Queue, Arc<GuestMem>)> {
    let top = mem.iter().map(|r| r.last_addr().raw_value()).max()?;
    let base = top.checked_add(1)?.checked_next_multiple_of(4096)?;
    let len = (4 + 2 * usize::from(real.size())).next_multiple_of(4096);
    let region = GuestRegionMmap::from_range(GuestAddress(base), len, None).ok()?;
    let ext = mem.insert_region(Arc::new(region)).ok()?;

    let avail = GuestAddress(base);
    ext.store(0u16, avail, Ordering::Relaxed).ok()?;
    for (i, h) in heads.iter().enumerate() {
        ext.write_obj(h.to_le(), avail.checked_add(4 + 2 * i as u64)?)
            .ok()?;
    }
    ext.store(
        (heads.len() as u16).to_le(),
        avail.checked_add(2)?,
        Ordering::Release,
    )
    .ok()?;

    let mut q = Queue::new(real.max_size()).ok()?;
    q.set_size(real.size());
    let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
    let (lo, hi) = split(real.desc_table());
    q.set_desc_table_address(lo, hi);
    let (lo, hi) = split(base);
    q.set_avail_ring_address(lo, hi);
    // Never written: recovered requests complete on the real queue.
    let (lo, hi) = split(real.used_ring());
    q.set_used_ring_address(lo, hi);
    q.set_ready(true);
    Some((q, Arc::new(ext)))
}
