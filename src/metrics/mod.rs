//! Observability, the daemon's side: the endpoint that serves the counters,
//! `ringblk stats`, and rate-limited logging for guest-triggered events.
//!
//! - [`QueueMetrics`] and the other counter types come from the
//!   `ringblk-metrics` crate, shared with `ringblk-bench`, and are
//!   re-exported here;
//! - the `--metrics ADDR` HTTP endpoint (Prometheus text at `/metrics`,
//!   JSON at `/metrics.json`) is [`crate::api`]'s, read-only;
//! - [`stats`]: `ringblk stats`, a table of a running daemon's counters;
//! - [`RateLimiter`], [`SharedRateLimiter`]: for log lines a guest or a
//!   front-end can trigger.

pub mod ratelimit;
mod stats;

pub use ratelimit::{RateLimiter, SharedRateLimiter};
pub use ringblk_metrics::prometheus::encode as encode_prometheus;
pub use ringblk_metrics::{
    MetricsAddr, MetricsDoc, MetricsError, QueueMetrics, QueueSnapshot, REQUEST_TYPES, Ratios,
    RequestType, fetch, get,
};
pub use stats::{StatsArgs, explain, parse_interval, render as render_table, stats};
