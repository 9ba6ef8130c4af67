//! Quality of service: per-device IOPS and bandwidth limits, as token
//! buckets shared by all of the device's queues.
//!
//! The convention is qemu-storage-daemon's throttle limits: a rate a
//! second (`iops-total`, `bps-read`, ...), each with an optional burst
//! rate `-max` sustained for `max-length` seconds. See docs/qos.md's QoS
//! section for the semantics and the mapping to Firecracker's
//! `RateLimiter`.
//!
//! The worker decides *when* a request goes to its engine: before it
//! hands one over it asks [`Qos::admit`]; a refused request waits at the
//! head of the queue's deferred list, everything behind it waits too, and
//! the queue's timer wakes the worker when the tokens should be there.
//! [`Qos`] is the device's handle: the control API changes the limits
//! through it at runtime ([`Qos::set_limits`]).

mod bucket;
mod limits;

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bucket::Buckets;
pub use bucket::{Direction, VALUE_MAX};
pub use limits::{QosChanges, QosError, QosLimits};

/// The longest a throttled queue sleeps before it looks again, so that a
/// limit raised or removed at runtime takes effect within this, whatever
/// the old limit made it wait for.
pub const MAX_THROTTLE_SLEEP: Duration = Duration::from_millis(100);

/// A device's limits and token buckets, shared by its queues' workers and
/// by whoever changes the limits. One per device for the daemon's life;
/// connections come and go under it.
#[derive(Debug)]
pub struct Qos {
    /// Some limit is set. Read once per request without the lock: with no
    /// limits, the data path costs one relaxed load.
    active: AtomicBool,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    limits: QosLimits,
    buckets: Buckets,
}

impl Qos {
    /// A device's QoS, with `limits`.
    pub fn new(limits: QosLimits) -> Result<Qos, QosError> {
        limits.validate()?;
        Ok(Qos {
            active: AtomicBool::new(limits.any()),
            state: Mutex::new(State {
                limits,
                buckets: Buckets::new(&limits, Instant::now()),
            }),
        })
    }

    /// Changes the limits now. Requests waiting for tokens see the new
    /// ones within [`MAX_THROTTLE_SLEEP`]; none is dropped. A limit that
    /// stays set keeps its bucket's level (no fresh burst, no forgiven
    /// debt); a new one starts with a full bucket.
    pub fn set_limits(&self, limits: QosLimits) -> Result<(), QosError> {
        limits.validate()?;
        let mut s = self.lock();
        s.buckets.replace(&limits, Instant::now());
        s.limits = limits;
        self.active.store(limits.any(), Ordering::Relaxed);
        Ok(())
    }

    /// The limits in force.
    pub fn limits(&self) -> QosLimits {
        self.lock().limits
    }

    /// Whether any limit is set (cheap: no lock).
    #[inline]
    pub fn active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// Admits a request of `bytes` going `dir` now, or says how long until
    /// it could be. `force` admits it regardless (a queue being drained),
    /// and charges it all the same.
    pub fn admit(&self, dir: Direction, bytes: u64, force: bool) -> Result<(), Duration> {
        // Read the clock under the lock, so that the buckets see time in
        // the order the queues take their tokens.
        let mut s = self.lock();
        s.buckets.admit(dir, bytes, Instant::now(), force)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is a few numbers, consistent after every statement.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_validated_as_qsd_does() {
        let ok = QosLimits {
            iops_total: 100,
            iops_total_max: 200,
            max_length: 5,
            ..QosLimits::default()
        };
        assert!(ok.validate().is_ok());
        let bad = [
            (
                QosLimits {
                    bps_read_max: 10,
                    ..QosLimits::default()
                },
                "bps_read_max needs bps_read set too",
            ),
            (
                QosLimits {
                    iops_write: 100,
                    iops_write_max: 50,
                    ..QosLimits::default()
                },
                "iops_write_max (50) cannot be lower than iops_write (100)",
            ),
            (
                QosLimits {
                    iops_total: 100,
                    max_length: 2,
                    ..QosLimits::default()
                },
                "max_length needs a *_max burst to apply to",
            ),
            (
                QosLimits {
                    bps_total: VALUE_MAX + 1,
                    ..QosLimits::default()
                },
                "bps_total and bps_total_max are at most 1000000000000000",
            ),
        ];
        for (l, msg) in bad {
            assert_eq!(l.validate().unwrap_err().to_string(), msg);
            assert!(Qos::new(l).is_err());
        }
        let qos = Qos::new(QosLimits::default()).unwrap();
        assert!(!qos.active());
        assert!(qos.set_limits(bad_one()).is_err());
        assert_eq!(
            qos.limits(),
            QosLimits::default(),
            "a refused change changes nothing"
        );
        qos.set_limits(ok).unwrap();
        assert!(qos.active());
        assert_eq!(qos.limits(), ok);
        qos.set_limits(QosLimits::default()).unwrap();
        assert!(!qos.active());
    }

    fn bad_one() -> QosLimits {
        QosLimits {
            iops_read_max: 1,
            ..QosLimits::default()
        }
    }

    #[test]
    fn limits_read_partial_json_and_refuse_unknown_keys() {
        let l: QosLimits = serde_json::from_str(r#"{"iops_total": 2000}"#).unwrap();
        assert_eq!(l.iops_total, 2000);
        assert_eq!(l.bps_total, 0);
        assert!(serde_json::from_str::<QosLimits>(r#"{"iops": 1}"#).is_err());
        let back: QosLimits = serde_json::from_str(&serde_json::to_string(&l).unwrap()).unwrap();
        assert_eq!(back, l);
    }
}
