//! Observability: per-queue counters, their Prometheus exposition, and
//! rate-limited logging for guest-triggered events.

mod counters;
pub mod ratelimit;

pub use counters::{QueueMetrics, QueueSnapshot, REQUEST_TYPES, RequestType};
pub use ratelimit::RateLimiter;

/// `ringblk stats` arguments. (Filled in with the exposition work.)
#[derive(Clone, Debug, clap::Args)]
pub struct StatsArgs {
    /// Address the daemon's --metrics listens on.
    #[arg(long)]
    pub metrics: String,
}

/// Prints the counters of a running daemon.
pub fn stats(_args: &StatsArgs) -> Result<(), String> {
    Err("stats: not implemented yet".into())
}
