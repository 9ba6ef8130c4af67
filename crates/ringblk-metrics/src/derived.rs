//! Arithmetic on snapshots: totals over queues, differences over a time
//! window, and the per-I/O ratios that say how well the data path batches.
//!
//! Kept apart from `counters.rs` (the contract with the data path) so that
//! the daemon's hot-path file does not grow with reporting code.

use serde::{Deserialize, Serialize};

use crate::counters::{COUNTERS, Kind, QueueSnapshot, RequestType};

impl QueueSnapshot {
    /// Field-by-field sum, e.g. over all queues of a daemon.
    pub fn sum<'a>(snaps: impl IntoIterator<Item = &'a QueueSnapshot>) -> QueueSnapshot {
        snaps.into_iter().fold(QueueSnapshot::default(), |acc, s| {
            acc.zip(s, u64::wrapping_add)
        })
    }

    /// What happened between `earlier` and `self`. Saturates at zero, so a
    /// daemon restarted in between yields zeroes rather than garbage.
    pub fn since(&self, earlier: &QueueSnapshot) -> QueueSnapshot {
        self.zip(earlier, u64::saturating_sub)
    }

    /// Requests of every type completed.
    pub fn total_requests(&self) -> u64 {
        self.requests.iter().sum()
    }

    /// Reads plus writes: the requests a load generator issues.
    pub fn data_requests(&self) -> u64 {
        self.requests[RequestType::Read as usize] + self.requests[RequestType::Write as usize]
    }

    /// Requests that were not answered VIRTIO_BLK_S_OK.
    pub fn total_errors(&self) -> u64 {
        COUNTERS
            .iter()
            .filter(|c| c.kind == Kind::Error)
            .map(|c| (c.get)(self))
            .sum()
    }

    /// Batching ratios, normalised by `ios` (pass the client's own count
    /// when there is one, so the ratio is "per I/O the client saw").
    pub fn ratios(&self, ios: u64) -> Ratios {
        let per = |n: u64, d: u64| {
            if d == 0 {
                None
            } else {
                Some(n as f64 / d as f64)
            }
        };
        Ratios {
            kicks_per_io: per(self.kicks, ios),
            notifications_per_io: per(self.notifications, ios),
            submits_per_io: per(self.submit_calls, ios),
            sqes_per_submit: per(self.submitted_sqes, self.submit_calls),
            cqes_per_pass: per(self.completions, self.completion_passes),
            poll_hit_rate: per(self.poll_hits, self.poll_iterations),
            poll_us_per_io: per(self.poll_ns, ios).map(|ns| ns / 1000.0),
        }
    }
}

/// Derived per-I/O and per-batch figures. `None` when the denominator is 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Ratios {
    /// Guest kicks per I/O: below 1 means the driver batched submissions or
    /// the backend was still polling when they arrived.
    pub kicks_per_io: Option<f64>,
    /// Notifications (interrupts) per I/O: below 1 means completions were
    /// coalesced or suppressed by EVENT_IDX.
    pub notifications_per_io: Option<f64>,
    /// io_uring_enter calls to submit, per I/O.
    pub submits_per_io: Option<f64>,
    /// Submission batch size.
    pub sqes_per_submit: Option<f64>,
    /// Completion batch size.
    pub cqes_per_pass: Option<f64>,
    /// Poll windows that found work, per poll loop iteration.
    pub poll_hit_rate: Option<f64>,
    /// Microseconds of CPU spent busy-polling, per I/O: what polling costs.
    #[serde(default)]
    pub poll_us_per_io: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(reads: u64, kicks: u64, calls: u64, sqes: u64) -> QueueSnapshot {
        let mut s = QueueSnapshot {
            kicks,
            submit_calls: calls,
            submitted_sqes: sqes,
            ..Default::default()
        };
        s.requests[RequestType::Read as usize] = reads;
        s
    }

    #[test]
    fn sum_since_and_ratios() {
        let total = QueueSnapshot::sum(&[snap(10, 5, 2, 10), snap(30, 5, 2, 30)]);
        assert_eq!(total.data_requests(), 40);
        assert_eq!(total.kicks, 10);
        let d = total.since(&snap(20, 2, 0, 0));
        assert_eq!(d.total_requests(), 20);
        assert_eq!(d.kicks, 8);
        let r = d.ratios(20);
        assert_eq!(r.kicks_per_io, Some(0.4));
        assert_eq!(r.sqes_per_submit, Some(10.0));
        assert_eq!(r.cqes_per_pass, None);
        let polled = QueueSnapshot {
            poll_ns: 30_000,
            ..Default::default()
        };
        assert_eq!(polled.ratios(10).poll_us_per_io, Some(3.0));
        // A restarted daemon must not underflow.
        assert_eq!(
            snap(1, 0, 0, 0).since(&snap(5, 0, 0, 0)).total_requests(),
            0
        );
    }
}
