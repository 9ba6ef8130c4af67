//! A queue's worker: the *when* of the data path. It takes requests off
//! the avail ring, parses them ([`crate::virtio`]), admits them (the image
//! lock, QoS), hands them to its engine's core ([`crate::engine::Core`])
//! in batches, and publishes completions on the used ring, deciding when to
//! notify the guest and keeping the inflight journal. How a request
//! becomes I/O is the engine's.
//!
//! - [`worker`]: one queue's worker, driven by events (a kick, a
//!   completion, its timer, its turn on a shared thread);
//! - [`poll`]: the adaptive busy-poll window;
//! - [`inflight`]: the inflight journal (VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD),
//!   and [`resubmit`]: replaying what a previous back-end left in flight;
//! - [`timer`]: the queue's wake-up timer;
//! - [`arrivals`]: when requests left on the avail ring were first seen,
//!   for their latency.
//!
//! The vhost-user glue above ([`crate::vhost`]) owns the workers and
//! routes each queue thread's events to them.

pub mod arrivals;
pub mod inflight;
pub mod poll;
pub mod resubmit;
pub mod timer;
pub mod worker;

pub use timer::Timer;
pub use worker::{Event, NotifyMode, QueueWorker, Settings, SignalMode, TURN, Vring};
