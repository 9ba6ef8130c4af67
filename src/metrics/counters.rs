//! Per-queue counters: plain atomics, written only by the queue's worker
//! thread with `Relaxed` ordering and read by the metrics endpoint.
//!
//! Relaxed is enough: each counter is independent, a reader only needs to
//! see a recent value, and no other memory is published through them.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// Request types as counted, in the order of [`QueueMetrics::requests`].
pub const REQUEST_TYPES: [&str; 7] = [
    "read",
    "write",
    "flush",
    "get_id",
    "discard",
    "write_zeroes",
    "unsupported",
];

/// Index into [`QueueMetrics::requests`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestType {
    Read = 0,
    Write = 1,
    Flush = 2,
    GetId = 3,
    Discard = 4,
    WriteZeroes = 5,
    Unsupported = 6,
}

/// Counters of one virtqueue. Field names are the metric names without the
/// `ringblk_` prefix and `_total` suffix.
#[derive(Debug, Default)]
pub struct QueueMetrics {
    /// Requests completed, by [`RequestType`].
    pub requests: [AtomicU64; 7],
    /// Bytes moved by read requests.
    pub read_bytes: AtomicU64,
    /// Bytes moved by write requests.
    pub write_bytes: AtomicU64,
    /// Requests answered VIRTIO_BLK_S_IOERR.
    pub errors_ioerr: AtomicU64,
    /// Requests answered VIRTIO_BLK_S_UNSUPP.
    pub errors_unsupp: AtomicU64,
    /// Chains with no usable status byte, returned with length 0.
    pub errors_no_status: AtomicU64,
    /// Guest kicks received (kick eventfd reads).
    pub kicks: AtomicU64,
    /// Guest notifications sent (call eventfd writes).
    pub notifications: AtomicU64,
    /// Used-ring publications where EVENT_IDX/NO_INTERRUPT said no
    /// notification was needed.
    pub notifications_suppressed: AtomicU64,
    /// io_uring_enter calls made to submit (submit batches).
    pub submit_calls: AtomicU64,
    /// SQEs submitted; divided by `submit_calls` this is the batch size.
    pub submitted_sqes: AtomicU64,
    /// Passes over the completion queue that found at least one CQE.
    pub completion_passes: AtomicU64,
    /// CQEs reaped; divided by `completion_passes` this is the batch size.
    pub completions: AtomicU64,
    /// Requests that went through a bounce buffer (O_DIRECT misalignment).
    pub bounced: AtomicU64,
    /// Busy-poll loop iterations.
    pub poll_iterations: AtomicU64,
    /// Busy-poll windows that found work before timing out.
    pub poll_hits: AtomicU64,
}

impl QueueMetrics {
    /// Adds `n` to `counter`. Only the queue's own worker writes, so a
    /// load/store pair would do, but `fetch_add` keeps it obviously right.
    #[inline]
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts one completed request of type `t`.
    #[inline]
    pub fn count_request(&self, t: RequestType) {
        Self::add(&self.requests[t as usize], 1);
    }

    /// A plain-value copy, for serialization.
    pub fn snapshot(&self) -> QueueSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        QueueSnapshot {
            requests: std::array::from_fn(|i| get(&self.requests[i])),
            read_bytes: get(&self.read_bytes),
            write_bytes: get(&self.write_bytes),
            errors_ioerr: get(&self.errors_ioerr),
            errors_unsupp: get(&self.errors_unsupp),
            errors_no_status: get(&self.errors_no_status),
            kicks: get(&self.kicks),
            notifications: get(&self.notifications),
            notifications_suppressed: get(&self.notifications_suppressed),
            submit_calls: get(&self.submit_calls),
            submitted_sqes: get(&self.submitted_sqes),
            completion_passes: get(&self.completion_passes),
            completions: get(&self.completions),
            bounced: get(&self.bounced),
            poll_iterations: get(&self.poll_iterations),
            poll_hits: get(&self.poll_hits),
        }
    }
}

/// A point-in-time copy of [`QueueMetrics`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    pub requests: [u64; 7],
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors_ioerr: u64,
    pub errors_unsupp: u64,
    pub errors_no_status: u64,
    pub kicks: u64,
    pub notifications: u64,
    pub notifications_suppressed: u64,
    pub submit_calls: u64,
    pub submitted_sqes: u64,
    pub completion_passes: u64,
    pub completions: u64,
    pub bounced: u64,
    pub poll_iterations: u64,
    pub poll_hits: u64,
}
