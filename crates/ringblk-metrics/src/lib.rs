//! What ringblk measures, shared by the daemon and its benchmark client.
//!
//! - [`QueueMetrics`]: the per-queue atomics the daemon's data path
//!   increments, each declared once in [`COUNTERS`]'s table, and their
//!   plain [`QueueSnapshot`];
//! - [`Latency`]: the per-queue latency histograms, by request type, and
//!   their [`LatencySnapshot`];
//! - [`derived`](Ratios): totals, differences and per-I/O ratios;
//! - [`prometheus`]: the text exposition; [`MetricsDoc`]: the JSON one;
//! - [`fetch`] and [`get`]: the client of the daemon's `--metrics`
//!   endpoint, used by `ringblk stats` and `ringblk-bench`;
//! - [`MetricsAddr`]: where that endpoint listens.
//!
//! The endpoint itself, and the log rate limiter, are the daemon's.
//!
//! Two small helpers both binaries need live here too, once: [`parse_size`]
//! and [`cpu`] (thread pinning, and the CPUs a `--cpus` list may name).

mod client;
mod counters;
pub mod cpu;
mod derived;
pub mod latency;
pub mod prometheus;
mod size;
pub mod transport;

pub use client::{fetch, get, request};
pub use counters::{
    COUNTERS, Counter, ERRORS_HELP, Kind, QueueMetrics, QueueSnapshot, REQUEST_TYPES,
    REQUESTS_HELP, RequestType,
};
pub use derived::Ratios;
pub use latency::{LATENCY_TYPES, Latency, LatencySnapshot, OpLatency};
pub use size::parse_size;
pub use transport::MetricsAddr;

/// The JSON document served at `/metrics.json`.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct MetricsDoc {
    /// One entry per virtqueue, in queue order.
    pub queues: Vec<QueueSnapshot>,
    /// The block job running or last run, as the control API's `GET
    /// /api/v1/job` answers it (the daemon's own type; kept as JSON here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<serde_json::Value>,
}

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
