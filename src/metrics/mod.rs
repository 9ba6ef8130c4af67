//! Observability: per-queue counters, their exposition, and rate-limited
//! logging for guest-triggered events.
//!
//! - [`counters`](QueueMetrics): the atomics the data path increments;
//! - [`spawn_endpoint`]: the opt-in `--metrics ADDR` HTTP endpoint
//!   (Prometheus text at `/metrics`, JSON at `/metrics.json`);
//! - [`fetch`]: its client, used by `ringblk stats` and `ringblk bench`;
//! - [`RateLimiter`]: for log lines a guest can trigger.

mod client;
mod counters;
mod derived;
mod endpoint;
mod prometheus;
pub mod ratelimit;
mod stats;
mod transport;

pub use client::{fetch, get};
pub use counters::{QueueMetrics, QueueSnapshot, REQUEST_TYPES, RequestType};
pub use derived::Ratios;
pub use endpoint::{Endpoint, MetricsDoc, spawn_endpoint};
pub use prometheus::encode as encode_prometheus;
pub use ratelimit::RateLimiter;
pub use stats::{StatsArgs, render as render_table, stats};
pub use transport::MetricsAddr;

/// Errors of the endpoint and its client.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The endpoint could not listen on the address.
    #[error("metrics endpoint {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    /// A request to a running endpoint failed at the transport level.
    #[error("metrics at {addr}: {what}: {source}")]
    Fetch {
        addr: String,
        what: String,
        source: std::io::Error,
    },
    /// The endpoint answered, but not with what we asked for.
    #[error("metrics: {0}")]
    Protocol(String),
}
