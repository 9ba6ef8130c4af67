//! The vhost-user layer: our device behind `vhost-user-backend`, one
//! worker and one io_uring per queue, the workers spread over `--threads`
//! threads.

mod backend;
mod backend_channel;
pub mod hints;
pub mod inflight;
mod poll;
pub mod proxy;
mod resubmit;
pub mod sigbus;
mod worker;

pub use backend::{BlkBackend, Device, ExitEvents, Listener};
pub use backend_channel::BackendChannel;
pub use worker::{Event, QueueWorker, Vring, WorkerConfig};
