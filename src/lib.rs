//! ringblk: a vhost-user-blk backend that does its I/O with io_uring.
//!
//! Layers, bottom to top; each imports only from layers below it
//! (`scripts/layers.py` checks):
//! - [`host`]: facts of the running host (its boot id);
//! - [`crypto`]: encryption at rest (LUKS headers, AES-XTS, keys in
//!   locked memory), below the formats that carry it;
//! - leaves: [`virtio`] (the split ring as we drive it, and the typed,
//!   validated block [`virtio::Request`] with its guest buffers), [`io`]
//!   (the image file: opening, creating, locking it), [`metrics`]
//!   (counters, rate-limited logs), [`unix_socket`], [`bitmap`] (dirty
//!   bitmaps);
//! - [`qos`] (token buckets), [`nbd`] (the NBD server);
//! - [`disk`]: *where*: where a guest offset lives (raw: itself; qcow2: a
//!   host offset in a file of its backing chain), the format seam the
//!   engine core asks ([`disk::seam::Format`]), the metadata thread, the
//!   qcow2 image's bitmaps and the one reader of guest data off the
//!   queues' data path; independent of the engine;
//! - [`backup`] (a bitmap's view, served over NBD), then [`device`]: the
//!   device's runtime state, one object (capacity, write cache, dirty
//!   logging, QoS, the image lock, the connection);
//! - [`engine`]: *how* a request becomes I/O: the engine core every engine
//!   shares and the engines (io_uring, librbd, null);
//! - [`queue`]: *when*: one worker per queue pops, admits, batches,
//!   publishes, notifies and journals;
//! - [`vhost`]: the glue to `vhost-user-backend`, the relay in front of
//!   it, SIGBUS containment;
//! - [`api`]: the HTTP endpoints (`--api`'s control verbs, `--metrics`);
//! - [`daemon`]: `serve`'s options and configuration, the socket, signals,
//!   the seccomp filter, the serve loop;
//! - [`cli`]: the command line: its clients `ctl`, `stats` and `bench`,
//!   `generate` (man pages, completions), how every subcommand ends
//!   (exit status, error lines) and the log's format.

pub mod api;
pub mod backup;
pub mod bitmap;
pub mod cli;
pub mod crypto;
pub mod daemon;
pub mod device;
pub mod disk;
pub mod engine;
pub mod host;
pub mod io;
pub mod metrics;
pub mod nbd;
pub mod qos;
pub mod queue;
pub mod unix_socket;
pub mod vhost;
pub mod virtio;

pub use ringblk_metrics::cpu;
