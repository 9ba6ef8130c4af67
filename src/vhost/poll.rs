//! Adaptive busy-polling window, after QEMU's `poll-max-ns`: the window
//! grows while sleeping would have been short (polling a little longer
//! would have caught the event) and shrinks when the wait was longer than
//! the maximum (polling was wasted CPU).

use std::time::{Duration, Instant};

const GROW: u32 = 2;
const SHRINK: u32 = 2;
/// The first window after a shrink to zero.
const START: Duration = Duration::from_micros(4);

#[derive(Debug)]
pub struct AdaptivePoll {
    max: Duration,
    cur: Duration,
    slept_at: Option<Instant>,
}

impl AdaptivePoll {
    pub fn new(max: Duration) -> AdaptivePoll {
        AdaptivePoll {
            max,
            cur: max,
            slept_at: None,
        }
    }

    /// The window to poll for now, or None when polling is off or shrunk away.
    pub fn window(&self) -> Option<Duration> {
        (!self.cur.is_zero()).then_some(self.cur)
    }

    /// The worker goes to sleep in epoll.
    pub fn sleeping(&mut self) {
        if !self.max.is_zero() {
            self.slept_at = Some(Instant::now());
        }
    }

    /// The worker woke up: adapt the window to how long it slept.
    pub fn woke_up(&mut self) {
        let Some(t) = self.slept_at.take() else {
            return;
        };
        let slept = t.elapsed();
        if slept <= self.max {
            // A longer window would have caught this event without sleeping.
            if self.cur < slept {
                self.cur = (self.cur * GROW).max(START).min(self.max);
            }
        } else {
            self.cur /= SHRINK;
            if self.cur < START {
                self.cur = Duration::ZERO;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_stays_off() {
        let mut p = AdaptivePoll::new(Duration::ZERO);
        p.sleeping();
        p.woke_up();
        assert_eq!(p.window(), None);
    }

    #[test]
    fn shrinks_after_long_sleeps_and_grows_after_short_ones() {
        let mut p = AdaptivePoll::new(Duration::from_micros(64));
        for _ in 0..8 {
            p.slept_at = Some(Instant::now() - Duration::from_millis(10));
            p.woke_up();
        }
        assert_eq!(p.window(), None);
        p.slept_at = Some(Instant::now() - Duration::from_micros(20));
        p.woke_up();
        assert_eq!(p.window(), Some(START));
        for _ in 0..8 {
            p.slept_at = Some(Instant::now() - Duration::from_micros(60));
            p.woke_up();
        }
        assert_eq!(p.window(), Some(Duration::from_micros(64)));
    }
}
