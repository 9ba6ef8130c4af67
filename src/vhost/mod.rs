//! The vhost-user layer: our device behind `vhost-user-backend`, with one
//! queue worker ([`crate::queue`]) per queue, the workers spread over
//! `--threads` threads; the relay in front of the crate, with the
//! vhost-user wire format and the back-end request channel
//! ([`relay`]); the set-up hints it feeds ([`hints`]); SIGBUS containment
//! for guest memory ([`sigbus`]).

mod backend;
pub mod hints;
pub mod relay;
pub mod sigbus;

pub use backend::{BlkBackend, ExitEvents, Listener};
pub use relay::channel::BackendChannel;
