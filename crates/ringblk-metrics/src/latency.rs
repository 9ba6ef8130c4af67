//! Request latency: per queue, one histogram per operation (read, write,
//! flush, discard, write-zeroes) of the time each request spent in the
//! daemon, from the pass that popped it off the avail ring to the pass
//! that completed it (QoS throttling and image-lock waits included).
//!
//! The histograms are the `histogram` crate's (IOP Systems'; rezolus and
//! pelikan use it): a fixed array of `AtomicU64`, allocated once, one
//! relaxed `fetch_add` per request into a log-linear bucket, no lock. With
//! [`GROUPING_POWER`] 3 a power of two is cut into 8 buckets, so a bucket
//! is at most 12.5% wider than its lower bound; values up to 2^36 ns
//! (68.7 s) have buckets of their own, longer ones count in the last. A
//! sum of nanoseconds per operation goes next to it (Prometheus's `_sum`).
//!
//! The snapshot ([`LatencySnapshot`]) is the same histogram with plain
//! counters; the JSON carries only its non-empty buckets, each by its
//! upper bound in nanoseconds, so that it does not depend on the crate's
//! bucket numbering. Prometheus gets a subset of the bucket boundaries
//! ([`PROMETHEUS_POWERS`]): a classic histogram's series count is paid by
//! every scrape.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use histogram::{AtomicHistogram, Config, Histogram};
use serde::{Deserialize, Serialize};

use crate::counters::{REQUEST_TYPES, RequestType};

/// Buckets per power of two: 2^3.
pub const GROUPING_POWER: u8 = 3;

/// The largest value with a bucket of its own is 2^36 - 1 ns.
pub const MAX_VALUE_POWER: u8 = 36;

/// The longest latency recorded as it is; a longer one counts as this.
pub const MAX_NS: u64 = (1 << MAX_VALUE_POWER) - 1;

const CONFIG: Config = match Config::new(GROUPING_POWER, MAX_VALUE_POWER) {
    Ok(c) => c,
    Err(_) => panic!("bad histogram geometry"),
};

/// The request types measured, in the order of the histograms. GET_ID
/// (no I/O) and refused requests are not.
pub const LATENCY_TYPES: [RequestType; 5] = [
    RequestType::Read,
    RequestType::Write,
    RequestType::Flush,
    RequestType::Discard,
    RequestType::WriteZeroes,
];

/// The `le` boundaries of the Prometheus histogram: 2^k ns for each k,
/// 1.024 µs to 17.2 s, one per power of two, and `+Inf`.
pub const PROMETHEUS_POWERS: std::ops::RangeInclusive<u32> = 10..=34;

/// HELP of `ringblk_request_duration_seconds`.
pub const LATENCY_HELP: &str = "Time requests spent in the daemon, from the pass that popped them off the avail ring to the pass that completed them (QoS throttling and image-lock waits included), by request type.";

/// Which histogram counts requests of type `t`, if any.
#[inline]
fn slot(t: RequestType) -> Option<usize> {
    match t {
        RequestType::Read => Some(0),
        RequestType::Write => Some(1),
        RequestType::Flush => Some(2),
        RequestType::Discard => Some(3),
        RequestType::WriteZeroes => Some(4),
        RequestType::GetId | RequestType::Unsupported => None,
    }
}

/// One operation's histogram and sum, as the data path writes them.
struct OpCells {
    buckets: AtomicHistogram,
    sum_ns: AtomicU64,
}

/// The latency histograms of one queue: written by its worker only,
/// read by the metrics endpoint (relaxed, like the counters).
pub struct Latency {
    ops: [OpCells; LATENCY_TYPES.len()],
}

impl Default for Latency {
    fn default() -> Latency {
        Latency {
            ops: std::array::from_fn(|_| OpCells {
                buckets: AtomicHistogram::with_config(&CONFIG),
                sum_ns: AtomicU64::new(0),
            }),
        }
    }
}

impl std::fmt::Debug for Latency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Latency").finish_non_exhaustive()
    }
}

impl Latency {
    /// Records that a request of type `t` took `ns` nanoseconds: one
    /// bucket and the sum, two relaxed `fetch_add`s. A type not measured
    /// is ignored.
    #[inline]
    pub fn record(&self, t: RequestType, ns: u64) {
        let Some(i) = slot(t) else {
            return;
        };
        let op = &self.ops[i];
        // Cannot fail: the value is clamped into the last bucket.
        let _ = op.buckets.increment(ns.min(MAX_NS));
        op.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// A plain-value copy. Buckets are read one by one, so a request
    /// completing meanwhile may be in the copy's buckets but not its sum,
    /// or the other way round.
    pub fn snapshot(&self) -> LatencySnapshot {
        LatencySnapshot {
            ops: std::array::from_fn(|i| OpLatency {
                sum_ns: self.ops[i].sum_ns.load(Ordering::Relaxed),
                histogram: self.ops[i].buckets.load(),
            }),
        }
    }
}

/// One operation's latency distribution at a point in time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpLatency {
    /// Nanoseconds, summed over the requests counted.
    pub sum_ns: u64,
    histogram: Histogram,
}

impl Default for OpLatency {
    fn default() -> OpLatency {
        OpLatency {
            sum_ns: 0,
            histogram: Histogram::with_config(&CONFIG),
        }
    }
}

impl OpLatency {
    /// Requests counted.
    pub fn count(&self) -> u64 {
        self.histogram.as_slice().iter().sum()
    }

    /// Records one request of `ns` nanoseconds (for tests and tools).
    pub fn record(&mut self, ns: u64) {
        let _ = self.histogram.increment(ns.min(MAX_NS));
        self.sum_ns = self.sum_ns.wrapping_add(ns);
    }

    /// The non-empty buckets, shortest first, each as (its bound, count):
    /// the count of requests that took less than the bound (in ns) and at
    /// least the bound of the bucket before.
    pub fn buckets(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.histogram
            .iter()
            .filter(|b| b.count() > 0)
            .map(|b| (b.end().saturating_add(1), b.count()))
    }

    /// How many requests took less than `bound_ns`, which must be a bucket
    /// boundary (a power of two from 16 ns up is one) to be exact.
    pub fn below(&self, bound_ns: u64) -> u64 {
        self.histogram
            .iter()
            .take_while(|b| b.end() < bound_ns)
            .map(|b| b.count())
            .sum()
    }

    /// The `q` quantile (0.5 for the median), in nanoseconds: the upper
    /// bound of the bucket that holds it, so at most 12.5% above the true
    /// value. None when nothing was counted.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        let b = self.histogram.quantile_bucket(q).ok()??;
        Some(b.end().saturating_add(1))
    }

    /// `f(self.x, o.x)` for the sum and every bucket.
    fn zip(&self, o: &OpLatency, f: &impl Fn(u64, u64) -> u64) -> OpLatency {
        let mut out = self.clone();
        out.sum_ns = f(self.sum_ns, o.sum_ns);
        for (x, y) in out
            .histogram
            .as_mut_slice()
            .iter_mut()
            .zip(o.histogram.as_slice())
        {
            *x = f(*x, *y);
        }
        out
    }
}

/// The JSON form of [`OpLatency`]: `count` is there for readers, and
/// ignored when read back (the buckets say it).
#[derive(Serialize, Deserialize)]
struct OpLatencyJson {
    #[serde(default)]
    count: u64,
    #[serde(default)]
    sum_ns: u64,
    /// `[bound_ns, count]`, as [`OpLatency::buckets`].
    #[serde(default)]
    buckets: Vec<(u64, u64)>,
}

impl Serialize for OpLatency {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        OpLatencyJson {
            count: self.count(),
            sum_ns: self.sum_ns,
            buckets: self.buckets().collect(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for OpLatency {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<OpLatency, D::Error> {
        let json = OpLatencyJson::deserialize(d)?;
        let mut op = OpLatency {
            sum_ns: json.sum_ns,
            ..OpLatency::default()
        };
        for (bound, count) in json.buckets {
            // A bound is one past its bucket's last value.
            let _ = op.histogram.add(bound.saturating_sub(1).min(MAX_NS), count);
        }
        Ok(op)
    }
}

/// The latency histograms of one queue at a point in time. In JSON, an
/// object keyed by request type (`"read"`, ...); types with nothing
/// counted are left out, and read back as empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LatencySnapshot {
    ops: [OpLatency; LATENCY_TYPES.len()],
}

impl LatencySnapshot {
    /// The distribution of requests of type `t`; None for a type not
    /// measured (GET_ID, unsupported).
    pub fn get(&self, t: RequestType) -> Option<&OpLatency> {
        slot(t).map(|i| &self.ops[i])
    }

    /// As [`LatencySnapshot::get`], to change (for tests and tools).
    pub fn get_mut(&mut self, t: RequestType) -> Option<&mut OpLatency> {
        slot(t).map(|i| &mut self.ops[i])
    }

    /// Each measured type with its label (the `type` of
    /// `ringblk_requests_total`) and distribution.
    pub fn iter(&self) -> impl Iterator<Item = (RequestType, &'static str, &OpLatency)> {
        LATENCY_TYPES
            .iter()
            .zip(&self.ops)
            .map(|(&t, op)| (t, REQUEST_TYPES[t as usize], op))
    }

    /// `f(self.x, o.x)` for every sum and bucket.
    pub(crate) fn zip(&self, o: &LatencySnapshot, f: impl Fn(u64, u64) -> u64) -> LatencySnapshot {
        LatencySnapshot {
            ops: std::array::from_fn(|i| self.ops[i].zip(&o.ops[i], &f)),
        }
    }
}

impl Serialize for LatencySnapshot {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        for (_, label, op) in self.iter() {
            if op.sum_ns != 0 || op.count() != 0 {
                map.serialize_entry(label, op)?;
            }
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for LatencySnapshot {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<LatencySnapshot, D::Error> {
        let mut by_label = BTreeMap::<String, OpLatency>::deserialize(d)?;
        let mut snap = LatencySnapshot::default();
        for (i, t) in LATENCY_TYPES.iter().enumerate() {
            if let Some(op) = by_label.remove(REQUEST_TYPES[*t as usize]) {
                snap.ops[i] = op;
            }
        }
        Ok(snap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_log_linear_and_clamped() {
        let l = Latency::default();
        for ns in [100, 1_000, 1_100, 50_000, 1 << 40] {
            l.record(RequestType::Read, ns);
        }
        l.record(RequestType::GetId, 5);
        let s = l.snapshot();
        let read = s.get(RequestType::Read).unwrap();
        assert_eq!(read.count(), 5);
        assert_eq!(read.sum_ns, 100 + 1_000 + 1_100 + 50_000 + (1 << 40));
        assert!(s.get(RequestType::GetId).is_none());
        assert_eq!(s.get(RequestType::Write).unwrap().count(), 0);
        // Eighths of a power of two: 1000 is in [960, 1024), 1100 in
        // [1024, 1152); 2^40 is counted in the last bucket.
        let b: Vec<(u64, u64)> = read.buckets().collect();
        assert_eq!(
            b,
            [(104, 1), (1024, 1), (1152, 1), (53248, 1), (MAX_NS + 1, 1)]
        );
        assert_eq!(read.below(1024), 2);
        assert_eq!(read.below(1 << 20), 4);
        assert_eq!(read.quantile(0.5), Some(1152));
        assert_eq!(read.quantile(1.0), Some(MAX_NS + 1), "clamped");
        assert_eq!(
            s.get(RequestType::Flush).unwrap().quantile(0.5),
            None,
            "empty"
        );
    }

    #[test]
    fn json_round_trips_and_leaves_out_what_is_empty() {
        let l = Latency::default();
        l.record(RequestType::Write, 3_000);
        l.record(RequestType::Write, 3_000);
        l.record(RequestType::Discard, 70_000_000);
        let s = l.snapshot();
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(
            json,
            r#"{"write":{"count":2,"sum_ns":6000,"buckets":[[3072,2]]},"discard":{"count":1,"sum_ns":70000000,"buckets":[[75497472,1]]}}"#
        );
        let back: LatencySnapshot = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
        let old: LatencySnapshot = serde_json::from_str("{}").unwrap();
        assert_eq!(old, LatencySnapshot::default());
    }

    #[test]
    fn difference_and_sum_go_bucket_by_bucket() {
        let l = Latency::default();
        l.record(RequestType::Read, 10_000);
        let before = l.snapshot();
        l.record(RequestType::Read, 2_000_000);
        let d = l.snapshot().zip(&before, u64::saturating_sub);
        let r = d.get(RequestType::Read).unwrap();
        assert_eq!(r.count(), 1);
        assert_eq!(r.sum_ns, 2_000_000);
        assert_eq!(r.quantile(0.5), Some(2_097_152));
        let t = d.zip(&before, u64::wrapping_add);
        assert_eq!(t.get(RequestType::Read).unwrap().count(), 2);
    }
}
