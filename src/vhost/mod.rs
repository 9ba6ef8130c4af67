//! The vhost-user layer: our device behind `vhost-user-backend`, one
//! worker and one io_uring per queue, the workers spread over `--threads`
//! threads.

mod backend;
mod backend_channel;
pub mod inflight;
mod poll;
pub mod proxy;
mod resubmit;
pub mod sigbus;
mod timer;
mod worker;

pub use backend::{BlkBackend, ExitEvents, Listener};
pub use backend_channel::BackendChannel;
pub use timer::Timer;
pub use worker::{Event, QueueWorker, Settings, Vring};
