//! How ringblk drives a split virtqueue, on top of `virtio_queue::Queue`.
//!
//! `virtio_queue` owns the descriptor-chain walk and `next_avail`/`next_used`
//! (which vhost-user's GET_VRING_BASE reads). What it does per request we
//! do per batch, and what it reads back from shared memory we shadow:
//!
//! - **avail side**: one `avail->idx` load per batch (`Queue::iter`), never
//!   one per request;
//! - **used side**: all used elements of a pass are written, then
//!   `used->idx` is stored once with release ordering;
//! - **notifications**: decided once per pass (EVENT_IDX `used_event`, or
//!   the NO_INTERRUPT flag without it);
//! - **kick suppression**: `used->flags` and `avail_event` are written only
//!   when their value changes, from device-local copies. Nothing only the
//!   device writes is ever read back, so those cachelines move one way (the
//!   device side of Linux's "shadow available ring flags & index").

use std::num::Wrapping;
use std::ops::Deref;
use std::sync::atomic::{Ordering, fence};

use virtio_bindings::virtio_ring::{VRING_AVAIL_F_NO_INTERRUPT, VRING_USED_F_NO_NOTIFY};
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory};

/// `flags` + `idx` in front of both rings.
const RING_HEADER: u64 = 4;
const USED_ELEM: u64 = 8;
const AVAIL_ELEM: u64 = 2;

/// Errors reading or writing the ring itself. The driver set the ring's
/// addresses, so a bad one is the driver's fault; the queue stops being
/// served until it is reset.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("virtqueue: {0}")]
    Queue(#[from] virtio_queue::Error),
    #[error("ring address outside guest memory")]
    Memory,
}

/// Device-local state of one queue beyond what `Queue` keeps.
#[derive(Debug, Default)]
pub struct RingShadow {
    /// The `used->flags` value we last wrote (None: not written yet).
    used_flags: Option<u16>,
    /// The `avail_event` value we last wrote (None: not written yet).
    avail_event: Option<u16>,
    /// With EVENT_IDX: `avail_event` was last put behind `next_avail` by
    /// `disable_kicks`, and stays out of the driver's way until
    /// `enable_kicks` moves it.
    kicks_off: bool,
    /// `next_used` when we last decided about a notification: the
    /// driver wants one if `used_event` lies in (signalled, next_used].
    signalled_used: Wrapping<u16>,
    /// Used elements written but not yet published through `used->idx`.
    unpublished: u16,
    /// Set when the last pop stopped at its limit, not at the avail index:
    /// more work is known to be there without reading the ring.
    more_avail: bool,
}

impl RingShadow {
    /// Forget everything: the ring was (re)configured.
    pub fn reset(&mut self, queue: &Queue) {
        *self = RingShadow {
            signalled_used: Wrapping(queue.next_used()),
            ..RingShadow::default()
        };
    }

    /// Whether the last pop left known work in the ring.
    pub fn more_avail(&self) -> bool {
        self.more_avail
    }

    /// Pops up to `limit` chains, calling `f` on each, with one read of
    /// `avail->idx`. Returns how many were popped.
    pub fn pop<M, F>(
        &mut self,
        queue: &mut Queue,
        mem: M,
        limit: usize,
        mut f: F,
    ) -> Result<usize, RingError>
    where
        M: Clone + Deref,
        M::Target: GuestMemory,
        F: FnMut(DescriptorChain<M>),
    {
        if limit == 0 {
            return Ok(0);
        }
        let mut iter = queue.iter(mem)?;
        let mut n = 0;
        for chain in iter.by_ref().take(limit) {
            f(chain);
            n += 1;
        }
        // `take` stopped at the limit: whatever is left is known without
        // another read. `next()` would pop it, so only peek by count.
        self.more_avail = n == limit;
        Ok(n)
    }

    /// Writes one used element at `next_used` without publishing it.
    pub fn add_used<M>(
        &mut self,
        queue: &mut Queue,
        mem: &M,
        head: u16,
        len: u32,
    ) -> Result<(), RingError>
    where
        M: GuestMemory,
    {
        let size = queue.size();
        let slot = u64::from(queue.next_used() % size);
        let addr = GuestAddress(queue.used_ring())
            .checked_add(RING_HEADER + slot * USED_ELEM)
            .ok_or(RingError::Memory)?;
        // struct virtq_used_elem { le32 id; le32 len; } as one 8-byte store.
        let elem = u64::from(head) | (u64::from(len) << 32);
        mem.write_obj(elem.to_le(), addr)
            .map_err(|_| RingError::Memory)?;
        queue.set_next_used(queue.next_used().wrapping_add(1));
        self.unpublished += 1;
        Ok(())
    }

    /// Publishes every element added since the last call: one release store
    /// of `used->idx`. The release orders the element stores before the
    /// index; the driver's acquire load of `used->idx` (virtio_ring's
    /// `virtio_load_acquire`) then sees the elements. Returns how many were
    /// published.
    pub fn publish<M: GuestMemory>(&mut self, queue: &Queue, mem: &M) -> Result<u16, RingError> {
        let n = std::mem::take(&mut self.unpublished);
        if n > 0 {
            let addr = GuestAddress(queue.used_ring())
                .checked_add(2)
                .ok_or(RingError::Memory)?;
            mem.store(u16::to_le(queue.next_used()), addr, Ordering::Release)
                .map_err(|_| RingError::Memory)?;
        }
        Ok(n)
    }

    /// Decides, once for everything published since the last decision,
    /// whether the driver asked to be interrupted.
    pub fn needs_notification<M: GuestMemory>(
        &mut self,
        queue: &Queue,
        mem: &M,
    ) -> Result<bool, RingError> {
        let new = Wrapping(queue.next_used());
        let old = std::mem::replace(&mut self.signalled_used, new);
        if old == new {
            return Ok(false);
        }
        // The used->idx store must be visible before we read the driver's
        // suppression state, or we could miss its request for an interrupt
        // (the driver does the mirror image: write used_event, full barrier,
        // read used->idx).
        fence(Ordering::SeqCst);
        if queue.event_idx_enabled() {
            let addr = GuestAddress(queue.avail_ring())
                .checked_add(RING_HEADER + AVAIL_ELEM * u64::from(queue.size()))
                .ok_or(RingError::Memory)?;
            let used_event: u16 = mem
                .load(addr, Ordering::Relaxed)
                .map_err(|_| RingError::Memory)?;
            // vring_need_event(): notify iff used_event is in [old, new).
            let used_event = Wrapping(u16::from_le(used_event));
            Ok(new - used_event - Wrapping(1) < new - old)
        } else {
            let flags: u16 = mem
                .load(GuestAddress(queue.avail_ring()), Ordering::Relaxed)
                .map_err(|_| RingError::Memory)?;
            Ok(u16::from_le(flags) & VRING_AVAIL_F_NO_INTERRUPT as u16 == 0)
        }
    }

    /// Asks the driver not to kick while we drain the queue. With EVENT_IDX
    /// `avail_event` goes one behind `next_avail`: the driver kicks only
    /// when its index passes `avail_event`, which it cannot do before we
    /// move it (it adds at most a ring's worth past `next_avail`). Left
    /// where `enable_kicks` put it, the driver's next request after each
    /// sleep would kick although we are polling: at depth 1 that is every
    /// request. Written once per drain, like the flag without EVENT_IDX.
    pub fn disable_kicks<M: GuestMemory>(
        &mut self,
        queue: &Queue,
        mem: &M,
    ) -> Result<(), RingError> {
        if queue.event_idx_enabled() {
            if self.kicks_off {
                // Still behind: popping only moved `next_avail` further on.
                return Ok(());
            }
            self.set_avail_event(queue, mem, queue.next_avail().wrapping_sub(1))?;
            self.kicks_off = true;
            Ok(())
        } else {
            self.set_used_flags(queue, mem, VRING_USED_F_NO_NOTIFY as u16)
        }
    }

    /// Re-enables kicks before the worker sleeps and re-checks the ring.
    /// Returns true if work arrived meanwhile: the caller must then go on
    /// draining instead of sleeping, or that request would wait for a kick
    /// the driver never sends.
    pub fn enable_kicks<M: GuestMemory>(
        &mut self,
        queue: &Queue,
        mem: &M,
    ) -> Result<bool, RingError> {
        if queue.event_idx_enabled() {
            self.set_avail_event(queue, mem, queue.next_avail())?;
            self.kicks_off = false;
        } else {
            self.set_used_flags(queue, mem, 0)?;
        }
        // Our write above must be visible before we read avail->idx: the
        // driver writes avail->idx, full barrier, reads our flag/event.
        fence(Ordering::SeqCst);
        self.avail_pending(queue, mem)
    }

    /// Writes `avail_event` (the used ring's trailing field) unless it
    /// already holds `value`.
    fn set_avail_event<M: GuestMemory>(
        &mut self,
        queue: &Queue,
        mem: &M,
        value: u16,
    ) -> Result<(), RingError> {
        if self.avail_event != Some(value) {
            let addr = GuestAddress(queue.used_ring())
                .checked_add(RING_HEADER + USED_ELEM * u64::from(queue.size()))
                .ok_or(RingError::Memory)?;
            mem.store(u16::to_le(value), addr, Ordering::Relaxed)
                .map_err(|_| RingError::Memory)?;
            self.avail_event = Some(value);
        }
        Ok(())
    }

    /// Reads `avail->idx` (acquire) and tells whether it moved past `next_avail`.
    pub fn avail_pending<M: GuestMemory>(&self, queue: &Queue, mem: &M) -> Result<bool, RingError> {
        Ok(queue.avail_idx(mem, Ordering::Acquire)?.0 != queue.next_avail())
    }

    fn set_used_flags<M: GuestMemory>(
        &mut self,
        queue: &Queue,
        mem: &M,
        flags: u16,
    ) -> Result<(), RingError> {
        if self.used_flags != Some(flags) {
            mem.store(
                u16::to_le(flags),
                GuestAddress(queue.used_ring()),
                Ordering::Relaxed,
            )
            .map_err(|_| RingError::Memory)?;
            self.used_flags = Some(flags);
        }
        Ok(())
    }
}

#[cfg(test)]
mod counting_tests;
#[cfg(test)]
mod tests;
