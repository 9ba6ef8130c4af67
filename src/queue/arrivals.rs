//! When requests the worker has not popped yet were first seen on the
//! avail ring: what makes a request's measured latency start before its
//! pop when the worker held off popping.
//!
//! A worker pops nothing while a request waits for QoS tokens or the
//! image lock, or while its engine is full: the requests behind stay on
//! the avail ring (backpressure), and their wait there is the daemon's
//! doing. At `--iops 100` and 16 in flight, most of a request's 160 ms
//! are spent there, and a latency measured from the pop alone showed a
//! seventh of it. So each pass that does not pop notes the avail index
//! and the time ([`Arrivals::saw`]); a request popped later is dated from
//! the first note that covered its place on the ring, to within the time
//! between two such passes (the QoS timer's, at most
//! [`crate::qos::MAX_THROTTLE_SLEEP`]). When the worker pops freely, no
//! note is taken, and popping costs one emptiness check per batch.
//!
//! The avail index comes from the guest: one that moves it backwards gets
//! odd latencies for its own requests, nothing worse. The notes never
//! outnumber the ring's entries (one per distinct index), and their
//! buffer is allocated once.

use std::collections::VecDeque;

/// Notes of (avail index, time), oldest first. See the module doc.
pub struct Arrivals {
    seen: VecDeque<(u16, u64)>,
}

impl Arrivals {
    /// Room for one note per entry of a ring of `size`.
    pub fn new(size: usize) -> Arrivals {
        Arrivals {
            seen: VecDeque::with_capacity(size),
        }
    }

    /// Whether any note is held: when not, popped requests are dated by
    /// their pop.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    /// A pass did not pop: the avail index was `idx` at `now` (and the
    /// worker's next one to pop is `next`). Nothing new (the index has not
    /// moved since the last note, or nothing waits) takes no note.
    pub fn saw(&mut self, next: u16, idx: u16, now: u64) {
        if idx == next || self.seen.back().is_some_and(|&(last, _)| last == idx) {
            return;
        }
        if self.seen.len() < self.seen.capacity() {
            self.seen.push_back((idx, now));
        }
    }

    /// When the entry `i` places after `next` (the first popped) was first
    /// seen, if a note covers it: the oldest note whose index was past
    /// it. Notes it is past are dropped; call for `i` in increasing order.
    pub fn first_seen(&mut self, next: u16, i: usize) -> Option<u64> {
        while let Some(&(idx, t)) = self.seen.front() {
            if usize::from(idx.wrapping_sub(next)) > i {
                return Some(t);
            }
            self.seen.pop_front();
        }
        None
    }

    /// Forgets every note: the ring started again.
    pub fn clear(&mut self) {
        self.seen.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_dated_by_the_first_note_that_covered_them() {
        let mut a = Arrivals::new(8);
        assert!(a.is_empty());
        // Next to pop is 65534; two entries at t=10, one more at t=20,
        // none new at t=30, two more at t=40 (the index wraps).
        a.saw(65534, 65534, 5);
        assert!(a.is_empty(), "nothing waited");
        a.saw(65534, 0, 10);
        a.saw(65534, 1, 20);
        a.saw(65534, 1, 30);
        a.saw(65534, 3, 40);
        let dates: Vec<Option<u64>> = (0..6).map(|i| a.first_seen(65534, i)).collect();
        assert_eq!(
            dates,
            [Some(10), Some(10), Some(20), Some(40), Some(40), None]
        );
        assert!(a.is_empty());
    }

    #[test]
    fn notes_never_outgrow_the_ring() {
        let mut a = Arrivals::new(4);
        let cap = a.seen.capacity();
        for idx in 1..100u16 {
            a.saw(0, idx, u64::from(idx));
        }
        assert_eq!(a.seen.len(), cap);
        assert_eq!(a.seen.capacity(), cap, "no growth");
        a.clear();
        assert!(a.is_empty());
    }
}
