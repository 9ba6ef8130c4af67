//! The vhost-user layer: our device behind `vhost-user-backend`, one
//! worker thread and one io_uring per queue.

mod backend;
mod backend_channel;
pub mod inflight;
mod poll;
pub mod proxy;
mod resubmit;
pub mod sigbus;
mod worker;

pub use backend::{BlkBackend, Device, ExitEvents};
pub use backend_channel::BackendChannel;
pub use worker::{QueueWorker, Vring, WorkerConfig};
