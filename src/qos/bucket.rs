//! One token bucket, and the set of them that one device's limits make.
//!
//! A bucket holds up to `capacity` tokens and gains `rate` a second. A
//! request is admitted when every bucket it draws on holds at least zero
//! tokens, and then takes its cost from each, which may leave a bucket in
//! debt: the next request waits until the debt is paid back. This admits
//! a request larger than the bucket (a 4 MiB write under a 1 MiB/s limit)
//! instead of stalling it forever, and keeps the long-run rate exact.
//!
//! Time is passed in, so the arithmetic is tested without sleeping.

use std::time::{Duration, Instant};

use super::QosLimits;
pub use crate::virtio::Direction;

/// The most tokens a bucket holds or owes, as QEMU's THROTTLE_VALUE_MAX:
/// past this f64 would lose whole tokens.
pub const VALUE_MAX: u64 = 1_000_000_000_000_000;

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Bucket {
    /// Tokens a second.
    rate: f64,
    /// The most tokens it holds (the burst).
    capacity: f64,
    /// Tokens now; negative is debt.
    level: f64,
}

impl Bucket {
    /// A full bucket.
    pub(super) fn new(rate: u64, capacity: f64) -> Bucket {
        Bucket {
            rate: rate as f64,
            capacity,
            level: capacity,
        }
    }

    fn refill(&mut self, secs: f64) {
        self.level = (self.level + self.rate * secs).min(self.capacity);
    }

    /// How long until it holds zero tokens again.
    fn wait(&self) -> Duration {
        if self.level >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.level / self.rate)
        }
    }
}

/// The buckets of one device: IOPS total/read/write, then bytes a second
/// total/read/write. `None` is no limit.
#[derive(Debug)]
pub(super) struct Buckets {
    b: [Option<Bucket>; 6],
    last: Instant,
}

const IOPS: usize = 0;
const BPS: usize = 3;

impl Buckets {
    pub(super) fn new(limits: &QosLimits, now: Instant) -> Buckets {
        let length = limits.max_length.max(1) as f64;
        let make = |(avg, max): (u64, u64)| {
            (avg > 0).then(|| {
                // As QEMU: without a burst, the bucket holds a tenth of a
                // second's worth; with one, `max` for `max_length` seconds.
                let capacity = if max > 0 {
                    max as f64 * length
                } else {
                    avg as f64 / 10.0
                };
                Bucket::new(avg, capacity)
            })
        };
        Buckets {
            b: limits.pairs().map(|(_, avg, max)| make((avg, max))),
            last: now,
        }
    }

    /// New limits: a bucket that stays limited keeps its level (cut to its
    /// new capacity), so changing a limit neither forgives a debt nor hands
    /// out a fresh burst; a new one starts full.
    pub(super) fn replace(&mut self, limits: &QosLimits, now: Instant) {
        self.refill(now);
        let mut next = Buckets::new(limits, now);
        for (new, old) in next.b.iter_mut().zip(&self.b) {
            if let (Some(new), Some(old)) = (new.as_mut(), old) {
                new.level = old.level.min(new.capacity);
            }
        }
        *self = next;
    }

    fn refill(&mut self, now: Instant) {
        let secs = now.saturating_duration_since(self.last).as_secs_f64();
        // Another queue's thread may have read the clock later and locked
        // first: time does not go back.
        if now > self.last {
            self.last = now;
        }
        for b in self.b.iter_mut().flatten() {
            b.refill(secs);
        }
    }

    /// Admits a request of `bytes` going `dir` (`bytes` 0 draws only on
    /// the IOPS buckets), or says how long until it could be. `force`
    /// admits it regardless, charging it all the same.
    pub(super) fn admit(
        &mut self,
        dir: Direction,
        bytes: u64,
        now: Instant,
        force: bool,
    ) -> Result<(), Duration> {
        self.refill(now);
        let d = match dir {
            Direction::Read => 1,
            Direction::Write => 2,
        };
        let mut drawn = [(IOPS, 1.0), (IOPS + d, 1.0), (BPS, 0.0), (BPS + d, 0.0)];
        let n = if bytes > 0 {
            drawn[2].1 = bytes as f64;
            drawn[3].1 = bytes as f64;
            4
        } else {
            2
        };
        let drawn = &drawn[..n];
        if !force {
            let wait = drawn
                .iter()
                .filter_map(|&(i, _)| self.b[i].as_ref())
                .map(Bucket::wait)
                .max()
                .unwrap_or(Duration::ZERO);
            if !wait.is_zero() {
                return Err(wait);
            }
        }
        for &(i, cost) in drawn {
            if let Some(b) = self.b[i].as_mut() {
                // Bounded, so that a forced drain of many large requests
                // cannot push it past what f64 counts exactly.
                b.level = (b.level - cost).max(-(VALUE_MAX as f64));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(f: impl FnOnce(&mut QosLimits)) -> QosLimits {
        let mut l = QosLimits::default();
        f(&mut l);
        l
    }

    /// Admits requests at `now` until one is refused; returns how many went
    /// and the wait of the refused one.
    fn drain(b: &mut Buckets, dir: Direction, bytes: u64, now: Instant) -> (u32, Duration) {
        let mut n = 0;
        loop {
            match b.admit(dir, bytes, now, false) {
                Ok(()) => n += 1,
                Err(w) => return (n, w),
            }
            assert!(n < 1_000_000, "never refused");
        }
    }

    #[test]
    fn no_limits_admit_everything() {
        let t = Instant::now();
        let mut b = Buckets::new(&QosLimits::default(), t);
        for _ in 0..10_000 {
            assert_eq!(b.admit(Direction::Write, 1 << 20, t, false), Ok(()));
        }
    }

    #[test]
    fn iops_burst_is_a_tenth_of_a_second_then_the_rate_holds() {
        let t = Instant::now();
        let mut b = Buckets::new(&limits(|l| l.iops_total = 1000), t);
        // 100 tokens: 100 admitted at 0, 99 to 0 and one more into debt.
        let (n, wait) = drain(&mut b, Direction::Read, 4096, t);
        assert_eq!(n, 101);
        assert_eq!(wait, Duration::from_millis(1));
        // Over the next 10 s, one every millisecond.
        let mut admitted = 0;
        for ms in 1..=10_000u64 {
            let (k, _) = drain(
                &mut b,
                Direction::Write,
                4096,
                t + Duration::from_millis(ms),
            );
            admitted += k;
        }
        // (Float rounding may shift the last one past the end.)
        assert!((9_999..=10_000).contains(&admitted), "{admitted}");
    }

    #[test]
    fn bandwidth_counts_bytes_and_a_large_request_goes_into_debt() {
        let t = Instant::now();
        let mut b = Buckets::new(&limits(|l| l.bps_total = 1 << 20), t);
        // A 4 MiB write against a 102.4 KiB bucket: admitted, then 4 s of
        // debt (less the bucket).
        assert_eq!(b.admit(Direction::Write, 4 << 20, t, false), Ok(()));
        let err = b.admit(Direction::Write, 4096, t, false).unwrap_err();
        let expect = (4.0 * 1048576.0 - 104857.6) / 1048576.0;
        assert!((err.as_secs_f64() - expect).abs() < 1e-6, "{err:?}");
        // Requests with no data (discard, write-zeroes) draw on no
        // bandwidth bucket, so they do not wait for one.
        assert_eq!(b.admit(Direction::Write, 0, t, false), Ok(()));
        assert!(
            b.admit(Direction::Read, 512, t + Duration::from_secs(3), false)
                .is_err()
        );
        assert_eq!(
            b.admit(Direction::Read, 512, t + Duration::from_secs(4), false),
            Ok(())
        );
    }

    #[test]
    fn directions_draw_on_their_own_buckets_and_the_total() {
        let t = Instant::now();
        let mut b = Buckets::new(
            &limits(|l| {
                l.iops_read = 100;
                l.iops_write = 200;
            }),
            t,
        );
        let (r, _) = drain(&mut b, Direction::Read, 512, t);
        let (w, _) = drain(&mut b, Direction::Write, 512, t);
        assert_eq!((r, w), (11, 21));
        // One second later: 100 reads and 200 writes.
        let t1 = t + Duration::from_secs(1);
        let (r, _) = drain(&mut b, Direction::Read, 512, t1);
        let (w, _) = drain(&mut b, Direction::Write, 512, t1);
        assert_eq!((r, w), (11, 21), "capped by the bucket, not the second");
        let mut b = Buckets::new(
            &limits(|l| {
                l.iops_total = 100;
                l.iops_write = 1000;
            }),
            t,
        );
        let (r, _) = drain(&mut b, Direction::Read, 512, t);
        let (w, _) = drain(&mut b, Direction::Write, 512, t);
        assert_eq!((r, w), (11, 0), "the total bucket is shared");
    }

    #[test]
    fn max_and_max_length_set_the_burst() {
        let t = Instant::now();
        let mut b = Buckets::new(
            &limits(|l| {
                l.iops_total = 100;
                l.iops_total_max = 500;
                l.max_length = 3;
            }),
            t,
        );
        assert_eq!(drain(&mut b, Direction::Read, 0, t).0, 1501);
    }

    #[test]
    fn force_admits_and_charges() {
        let t = Instant::now();
        let mut b = Buckets::new(&limits(|l| l.iops_total = 10), t);
        for _ in 0..11 {
            assert_eq!(b.admit(Direction::Read, 0, t, true), Ok(()));
        }
        // One token in the bucket, eleven taken: ten in debt, a second.
        let wait = b.admit(Direction::Read, 0, t, false).unwrap_err();
        assert!((wait.as_secs_f64() - 1.0).abs() < 1e-9, "{wait:?}");
    }

    #[test]
    fn replacing_limits_keeps_debt_and_does_not_refill() {
        let t = Instant::now();
        let l = limits(|l| l.iops_total = 100);
        let mut b = Buckets::new(&l, t);
        drain(&mut b, Direction::Read, 0, t);
        let doubled = limits(|l| l.iops_total = 200);
        b.replace(&doubled, t);
        // The debt (one token) is paid at the new rate: within 5 ms.
        let (n, _) = drain(&mut b, Direction::Read, 0, t + Duration::from_millis(6));
        assert_eq!(n, 1);
        // A new limit starts full; a removed one stops counting.
        b.replace(&limits(|l| l.iops_write = 10), t);
        assert_eq!(b.admit(Direction::Read, 0, t, false), Ok(()));
        assert_eq!(drain(&mut b, Direction::Write, 0, t).0, 2);
    }

    #[test]
    fn time_going_back_between_threads_is_ignored() {
        let t = Instant::now() + Duration::from_secs(1);
        let mut b = Buckets::new(&limits(|l| l.iops_total = 10), t);
        drain(&mut b, Direction::Read, 0, t);
        assert!(
            b.admit(Direction::Read, 0, t - Duration::from_millis(500), false)
                .is_err()
        );
        assert!(
            b.admit(Direction::Read, 0, t + Duration::from_millis(100), false)
                .is_ok()
        );
    }
}
