//! The vhost-user layer: our device behind `vhost-user-backend`, with one
//! queue worker ([`crate::queue`]) per queue, the workers spread over
//! `--threads` threads; the relay in front of the crate; SIGBUS
//! containment for guest memory.

mod backend;
mod backend_channel;
pub mod hints;
pub mod proxy;
pub mod sigbus;

pub use backend::{BlkBackend, ExitEvents, Listener};
pub use backend_channel::BackendChannel;
