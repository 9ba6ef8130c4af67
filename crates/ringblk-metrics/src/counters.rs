//! Per-queue counters: plain atomics, written only by the queue's worker
//! thread with `Relaxed` ordering and read by the metrics endpoint.
//!
//! Relaxed is enough: each counter is independent, a reader only needs to
//! see a recent value, and no other memory is published through them.
//!
//! Every counter is declared once, in the tables below. From them come the
//! atomic struct, its serializable snapshot (field names are the JSON
//! keys), and [`COUNTERS`], which the Prometheus encoder and
//! `ringblk stats` walk.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::latency::{Latency, LatencySnapshot};

/// Declares [`RequestType`] and the label values it indexes.
macro_rules! request_types {
    ($($variant:ident = $label:literal,)*) => {
        /// Index into [`QueueMetrics::requests`].
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum RequestType {
            $($variant,)*
        }

        /// Request types as counted, in the order of
        /// [`QueueMetrics::requests`]: the `type` label of
        /// `ringblk_requests_total`.
        pub const REQUEST_TYPES: [&str; [$($label),*].len()] = [$($label),*];
    };
}

request_types! {
    Read = "read",
    Write = "write",
    Flush = "flush",
    GetId = "get_id",
    Discard = "discard",
    WriteZeroes = "write_zeroes",
    Unsupported = "unsupported",
}

/// HELP of `ringblk_requests_total`, the [`QueueMetrics::requests`] family.
pub const REQUESTS_HELP: &str = "Requests completed, by request type.";

/// HELP of `ringblk_errors_total`, the family of the [`Kind::Error`] rows.
pub const ERRORS_HELP: &str = "Requests not answered VIRTIO_BLK_S_OK, by status.";

/// How a counter of [`COUNTERS`] is exposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A family of its own: `ringblk_<name>_total{queue="N"}`.
    Count,
    /// As [`Kind::Count`], and a number of bytes (`ringblk stats` shows MiB).
    Bytes,
    /// One status of `ringblk_errors_total{queue="N",status="..."}`, whose
    /// label is the name without `errors_`. Its help is the field's doc;
    /// Prometheus shows [`ERRORS_HELP`].
    Error,
}

/// One scalar counter: a field of [`QueueMetrics`] and [`QueueSnapshot`].
pub struct Counter {
    /// Field name and JSON key; the metric name without the `ringblk_`
    /// prefix and `_total` suffix.
    pub name: &'static str,
    /// Prometheus HELP text, also the field's doc.
    pub help: &'static str,
    pub kind: Kind,
    /// Reads it out of a snapshot.
    pub get: fn(&QueueSnapshot) -> u64,
}

impl Counter {
    /// The `status` label of a [`Kind::Error`] counter.
    pub fn status(&self) -> &'static str {
        self.name.strip_prefix("errors_").unwrap_or(self.name)
    }
}

/// Generates, from one row per counter (`name: Kind = "help"`, with more
/// doc above it if the help does not say everything), the two structs,
/// what copies and combines them field by field, and [`COUNTERS`].
/// `requests`, one counter per [`RequestType`], comes first in both.
macro_rules! counters {
    ($($(#[doc = $doc:literal])* $name:ident: $kind:ident = $help:literal,)*) => {
        /// Counters of one virtqueue.
        #[derive(Debug, Default)]
        pub struct QueueMetrics {
            /// Requests completed, by [`RequestType`].
            pub requests: [AtomicU64; REQUEST_TYPES.len()],
            $(#[doc = $help] $(#[doc = $doc])* pub $name: AtomicU64,)*
            /// Time from pop to completion, by request type.
            pub latency: Latency,
        }

        /// A point-in-time copy of [`QueueMetrics`]. A counter missing
        /// from a document (one written before the counter existed, such
        /// as a saved `bench --compare` result) reads as 0.
        #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(default)]
        pub struct QueueSnapshot {
            pub requests: [u64; REQUEST_TYPES.len()],
            $(#[doc = $help] pub $name: u64,)*
            pub latency: LatencySnapshot,
        }

        impl QueueMetrics {
            /// A plain-value copy, for serialization.
            pub fn snapshot(&self) -> QueueSnapshot {
                let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
                QueueSnapshot {
                    requests: std::array::from_fn(|i| get(&self.requests[i])),
                    $($name: get(&self.$name),)*
                    latency: self.latency.snapshot(),
                }
            }
        }

        impl QueueSnapshot {
            /// `f(self.x, o.x)` for every counter `x`.
            pub(crate) fn zip(&self, o: &QueueSnapshot, f: impl Fn(u64, u64) -> u64) -> QueueSnapshot {
                QueueSnapshot {
                    requests: std::array::from_fn(|i| f(self.requests[i], o.requests[i])),
                    $($name: f(self.$name, o.$name),)*
                    latency: self.latency.zip(&o.latency, &f),
                }
            }
        }

        /// Every scalar counter, in declaration order.
        pub const COUNTERS: &[Counter] = &[$(Counter {
            name: stringify!($name),
            help: $help,
            kind: Kind::$kind,
            get: |s| s.$name,
        },)*];
    };
}

counters! {
    read_bytes: Bytes = "Bytes moved by read requests.",
    write_bytes: Bytes = "Bytes moved by write requests.",
    errors_ioerr: Error = "Requests answered VIRTIO_BLK_S_IOERR.",
    errors_unsupp: Error = "Requests answered VIRTIO_BLK_S_UNSUPP.",
    errors_no_status: Error = "Chains with no usable status byte, returned with length 0.",
    kicks: Count = "Guest kicks received (kick eventfd reads).",
    notifications: Count = "Guest notifications sent (call eventfd writes).",
    notifications_suppressed: Count = "Used-ring publications that needed no notification (EVENT_IDX/NO_INTERRUPT).",
    /// Submit batches.
    submit_calls: Count = "io_uring_enter calls made to submit.",
    /// Divided by `submit_calls`, this is the batch size.
    submitted_sqes: Count = "SQEs submitted to io_uring.",
    completion_passes: Count = "Passes over the completion queue that found at least one CQE.",
    /// Divided by `completion_passes`, this is the batch size.
    completions: Count = "CQEs reaped.",
    bounced: Count = "Requests that went through a bounce buffer (O_DIRECT misalignment).",
    poll_iterations: Count = "Busy-poll loop iterations.",
    poll_hits: Count = "Busy-poll windows that found work before timing out.",
    /// Each request is counted once, however often it was refused.
    throttled_requests: Count = "Requests that waited for QoS tokens.",
    /// Time, not requests: from the moment the request at the head of the
    /// queue is refused until it is admitted.
    throttled_ns: Count = "Nanoseconds this queue spent waiting for QoS tokens.",
    /// What polling costs: the CPU time of the spin loops, less the gaps
    /// in which the thread was preempted.
    poll_ns: Count = "Nanoseconds spent busy-polling.",
    /// Or not started: the thread was switched out involuntarily since
    /// the last window.
    poll_preempted: Count = "Busy-poll windows ended early because the thread was preempted.",
    poll_cpu_busy: Count = "Busy-poll windows not started because another ringblk thread polled on the CPU.",
    /// Only on threads that serve several queues (`--threads`).
    yields: Count = "Passes that stopped with work left, to let the thread's other queues run.",
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A saved result from before a counter existed still loads: its
    /// missing counters are 0 (`ringblk bench --report` reads old runs).
    #[test]
    fn a_snapshot_without_a_newer_counter_loads() {
        let mut json = serde_json::to_value(QueueSnapshot {
            kicks: 7,
            ..QueueSnapshot::default()
        })
        .unwrap();
        let map = json.as_object_mut().unwrap();
        assert!(map.remove("throttled_requests").is_some());
        let back: QueueSnapshot = serde_json::from_value(json).expect("loads");
        assert_eq!(back.kicks, 7);
        assert_eq!(back.throttled_requests, 0);
    }
}
