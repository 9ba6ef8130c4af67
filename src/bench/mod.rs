//! `ringblk bench`: a load generator on libblkio for any vhost-user-blk
//! socket, and `--compare`, which runs it against ringblk,
//! qemu-storage-daemon and fio on the host over a matrix of workloads.
//!
//! - [`args`]: the command line;
//! - [`client`]: the libblkio front-end, one thread per queue;
//! - [`single`]: one run with CPU and counter sampling around the window;
//! - [`compare`]: the matrix, run by [`backends`] one after the other
//!   (fio for the host baseline in [`fio`]);
//! - [`report`], [`tables`], [`plot`]: JSON, text, Markdown and the SVG;
//! - [`proc`]: /proc CPU time, pinning, stopping children.

mod args;
mod backends;
mod client;
mod compare;
mod fio;
mod plot;
mod proc;
mod report;
mod single;
mod tables;

pub use args::{BackendName, BenchArgs, CompareArgs, OnOff, RwMode};
pub use client::ClientError;
pub use report::{Latency, RunResult};

/// Errors of `ringblk bench`.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The load generator failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// Options that do not go together.
    #[error("{0}")]
    Usage(String),
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

/// Runs `ringblk bench`.
pub fn run(args: &BenchArgs) -> Result<(), String> {
    let r = if args.compare {
        compare::run(args)
    } else {
        single::run(args)
    };
    r.map_err(|e| e.to_string())
}
