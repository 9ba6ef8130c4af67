//! How ringblk drives a split virtqueue, on top of `virtio_queue::Queue`.
//!
//! `virtio_queue`'s `Queue` keeps the ring's setup and `next_avail`/
//! `next_used` (which vhost-user's GET_VRING_BASE reads). We read and write
//! the rings ourselves, through a [`RingView`] translated once per pass,
//! walking each chain as virtio-queue's `DescriptorChain` does
//! ([`ViewChain`]). What virtio-queue does per request we do per batch,
//! and what it reads back from shared memory we shadow:
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

mod view;

use std::num::Wrapping;
use std::sync::atomic::{Ordering, fence};

use virtio_bindings::virtio_ring::{VRING_AVAIL_F_NO_INTERRUPT, VRING_USED_F_NO_NOTIFY};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemory;

pub use view::{RingView, ViewChain};

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
    /// `avail->idx`. Returns how many were popped. As virtio-queue's
    /// `Queue::iter`, refuses an `avail->idx` more than a ring ahead (the
    /// driver would be asking for chains twice).
    pub fn pop<M, F>(
        &mut self,
        queue: &mut Queue,
        view: &RingView<'_, M>,
        limit: usize,
        mut f: F,
    ) -> Result<usize, RingError>
    where
        M: GuestMemory + ?Sized,
        F: FnMut(ViewChain<'_, '_, M>),
    {
        if limit == 0 {
            return Ok(0);
        }
        if !queue.ready() || queue.avail_ring() == 0 {
            return Err(RingError::Queue(virtio_queue::Error::QueueNotReady));
        }
        if view.size() == 0 {
            // virtio-queue never sets a size of 0; refused rather than
            // divided by.
            return Err(RingError::Memory);
        }
        let next = queue.next_avail();
        let waiting = view.avail_idx()?.wrapping_sub(next);
        if waiting > view.size() {
            return Err(RingError::Queue(virtio_queue::Error::InvalidAvailRingIndex));
        }
        let n = usize::from(waiting).min(limit);
        for k in 0..n as u16 {
            let slot = next.wrapping_add(k) % view.size();
            let head = match view.avail_entry(slot) {
                Ok(head) => head,
                Err(e) => {
                    queue.set_next_avail(next.wrapping_add(k));
                    return Err(e);
                }
            };
            f(view.chain(head));
        }
        queue.set_next_avail(next.wrapping_add(n as u16));
        // What is left is known without another read.
        self.more_avail = usize::from(waiting) > n;
        Ok(n)
    }

    /// Writes one used element at `next_used` without publishing it.
    pub fn add_used<M: GuestMemory + ?Sized>(
        &mut self,
        queue: &mut Queue,
        view: &RingView<'_, M>,
        head: u16,
        len: u32,
    ) -> Result<(), RingError> {
        let slot = queue
            .next_used()
            .checked_rem(view.size())
            .ok_or(RingError::Memory)?;
        view.set_used_elem(slot, head, len)?;
        queue.set_next_used(queue.next_used().wrapping_add(1));
        self.unpublished += 1;
        Ok(())
    }

    /// Publishes every element added since the last call: one release store
    /// of `used->idx`. The release orders the element stores before the
    /// index; the driver's acquire load of `used->idx` (virtio_ring's
    /// `virtio_load_acquire`) then sees the elements. Returns how many were
    /// published.
    pub fn publish<M: GuestMemory + ?Sized>(
        &mut self,
        queue: &Queue,
        view: &RingView<'_, M>,
    ) -> Result<u16, RingError> {
        let n = std::mem::take(&mut self.unpublished);
        if n > 0 {
            view.set_used_idx(queue.next_used())?;
        }
        Ok(n)
    }

    /// Decides, once for everything published since the last decision,
    /// whether the driver asked to be interrupted.
    pub fn needs_notification<M: GuestMemory + ?Sized>(
        &mut self,
        queue: &Queue,
        view: &RingView<'_, M>,
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
            // vring_need_event(): notify iff used_event is in [old, new).
            let used_event = Wrapping(view.used_event()?);
            Ok(new - used_event - Wrapping(1) < new - old)
        } else {
            Ok(view.avail_flags()? & VRING_AVAIL_F_NO_INTERRUPT as u16 == 0)
        }
    }

    /// Asks the driver not to kick while we drain the queue. With EVENT_IDX
    /// `avail_event` goes one behind `next_avail`: the driver kicks only
    /// when its index passes `avail_event`, which it cannot do before we
    /// move it (it adds at most a ring's worth past `next_avail`). Left
    /// where `enable_kicks` put it, the driver's next request after each
    /// sleep would kick although we are polling: at depth 1 that is every
    /// request. Written once per drain, like the flag without EVENT_IDX.
    pub fn disable_kicks<M: GuestMemory + ?Sized>(
        &mut self,
        queue: &Queue,
        view: &RingView<'_, M>,
    ) -> Result<(), RingError> {
        if queue.event_idx_enabled() {
            if self.kicks_off {
                // Still behind: popping only moved `next_avail` further on.
                return Ok(());
            }
            self.set_avail_event(view, queue.next_avail().wrapping_sub(1))?;
            self.kicks_off = true;
            Ok(())
        } else {
            self.set_used_flags(view, VRING_USED_F_NO_NOTIFY as u16)
        }
    }

    /// Re-enables kicks before the worker sleeps and re-checks the ring.
    /// Returns true if work arrived meanwhile: the caller must then go on
    /// draining instead of sleeping, or that request would wait for a kick
    /// the driver never sends.
    pub fn enable_kicks<M: GuestMemory + ?Sized>(
        &mut self,
        queue: &Queue,
        view: &RingView<'_, M>,
    ) -> Result<bool, RingError> {
        if queue.event_idx_enabled() {
            self.set_avail_event(view, queue.next_avail())?;
            self.kicks_off = false;
        } else {
            self.set_used_flags(view, 0)?;
        }
        // Our write above must be visible before we read avail->idx: the
        // driver writes avail->idx, full barrier, reads our flag/event.
        fence(Ordering::SeqCst);
        self.avail_pending(queue, view)
    }

    /// Writes `avail_event` (the used ring's trailing field) unless it
    /// already holds `value`.
    fn set_avail_event<M: GuestMemory + ?Sized>(
        &mut self,
        view: &RingView<'_, M>,
        value: u16,
    ) -> Result<(), RingError> {
        if self.avail_event != Some(value) {
            view.set_avail_event(value)?;
            self.avail_event = Some(value);
        }
        Ok(())
    }

    /// Reads `avail->idx` (acquire) and tells whether it moved past `next_avail`.
    pub fn avail_pending<M: GuestMemory + ?Sized>(
        &self,
        queue: &Queue,
        view: &RingView<'_, M>,
    ) -> Result<bool, RingError> {
        Ok(view.avail_idx()? != queue.next_avail())
    }

    fn set_used_flags<M: GuestMemory + ?Sized>(
        &mut self,
        view: &RingView<'_, M>,
        flags: u16,
    ) -> Result<(), RingError> {
        if self.used_flags != Some(flags) {
            view.set_used_flags(flags)?;
            self.used_flags = Some(flags);
        }
        Ok(())
    }
}

#[cfg(test)]
mod counting_tests;
#[cfg(test)]
mod tests;
