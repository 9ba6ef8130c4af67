//! `ringblk-bench` (also run as `ringblk bench`): a load generator on
//! libblkio for any vhost-user-blk socket, and `--compare`, which runs it
//! against ringblk, qemu-storage-daemon and fio on the host over a matrix
//! of workloads.
//!
//! A crate of its own so that the daemon does not link libblkio, the
//! histograms, the progress bar and the plotting; it reads the daemon's
//! counters through `ringblk-metrics`.
//!
//! - [`args`]: the command line;
//! - [`client`]: the libblkio front-end, one thread per queue;
//! - [`single`]: one run with CPU and counter sampling around the window;
//! - [`compare`]: the matrix, run by [`backends`] one after the other
//!   (fio for the host baseline in [`fio`]);
//! - [`report`], [`tables`], [`plot`]: JSON, text, Markdown and the SVG;
//! - [`images`]: the qcow2 images of `--format qcow2`, made and checked
//!   with qemu-img;
//! - [`rbd`]: an RBD image instead of a file, and `--ceph-cluster`;
//! - [`proc`]: /proc CPU time, pinning, stopping children.

mod args;
mod backends;
mod client;
mod compare;
mod fio;
mod images;
mod plot;
mod proc;
mod rbd;
mod report;
mod single;
mod tables;

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

pub use args::{
    BackendName, BenchArgs, CompareArgs, CowBase, FormatName, OnOff, Qcow2Kind, RwMode,
};
pub use client::ClientError;
pub use report::{Latency, RunResult};

/// Errors of `ringblk-bench`.
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
    /// A backend, the client or fio could not be started (not installed?).
    #[error("starting {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    /// The backend exited before its socket appeared.
    #[error("backend exited at start-up ({status}): {log}")]
    StartupExit { status: ExitStatus, log: String },
    /// A --setup command failed.
    #[error("setup `{cmd}` failed: {why}")]
    Setup { cmd: String, why: String },
    /// The backend's socket did not appear in time.
    #[error("no socket {} after {timeout:?}: {log}", socket.display())]
    NoSocket {
        socket: PathBuf,
        timeout: Duration,
        log: String,
    },
    /// The client or fio ran past its deadline and was killed.
    #[error("{who} did not finish in {timeout:?}; backend log: {log}")]
    Timeout {
        who: &'static str,
        timeout: Duration,
        log: String,
    },
    /// The client or fio exited with an error.
    #[error("{who} failed ({status}): {log}")]
    Failed {
        who: &'static str,
        status: ExitStatus,
        log: String,
    },
    /// The backend died while the client ran.
    #[error("backend exited ({status}) during the run: {log}; client: {client}")]
    BackendDied {
        status: ExitStatus,
        log: String,
        client: String,
    },
    /// plotters could not draw the SVG (its errors are generic over the
    /// backend, hence the text).
    #[error("plot {}: {msg}", path.display())]
    Plot { path: PathBuf, msg: String },
    /// A result (the client's JSON, fio's JSON) that cannot be read.
    #[error("{who} result: {msg}")]
    Parse { who: &'static str, msg: String },
}

impl BenchError {
    /// Wraps an I/O error with what was being done.
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BenchError {
        let what = what.into();
        move |source| BenchError::Io { what, source }
    }
}

/// Runs `ringblk-bench` with parsed arguments.
pub fn run(args: &BenchArgs) -> Result<(), String> {
    let r = if let Some(json) = &args.report {
        compare::report(json, args.cmp.out.as_deref())
    } else if args.compare {
        compare::run(args)
    } else {
        single::run(args)
    };
    r.map_err(|e| e.to_string())
}
