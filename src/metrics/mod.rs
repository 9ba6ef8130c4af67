//! Observability, the daemon's side: the counters and rate-limited logging
//! for guest-triggered events.
//!
//! - [`QueueMetrics`] and the other counter types come from the
//!   `ringblk-metrics` crate, shared with `ringblk-bench`, and are
//!   re-exported here;
//! - the `--metrics ADDR` HTTP endpoint (Prometheus text at `/metrics`,
//!   JSON at `/metrics.json`) is the API's (`crate::api`), read-only, and
//!   `ringblk stats` is a client of it (`crate::cli::stats`);
//! - [`RateLimiter`], [`SharedRateLimiter`]: for log lines a guest or a
//!   front-end can trigger.

pub mod ratelimit;

pub use ratelimit::{RateLimiter, SharedRateLimiter};
pub use ringblk_metrics::prometheus::encode as encode_prometheus;
pub use ringblk_metrics::{
    MetricsAddr, MetricsDoc, MetricsError, QueueMetrics, QueueSnapshot, REQUEST_TYPES, Ratios,
    RequestType, fetch, get,
};
