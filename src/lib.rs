//! ringblk: a vhost-user-blk backend that does its I/O with io_uring.
//!
//! Layers, bottom to top:
//! - [`virtio`]: the split ring as we drive it (shadowed indices, batched
//!   used-ring publication, notification decisions) and the typed, validated
//!   block [`virtio::Request`];
//! - [`io`]: the image (opening, creating, probing it);
//! - [`format`]: where a guest offset lives (raw: itself; qcow2: a host
//!   offset in a file of its backing chain), and the metadata work that
//!   takes; independent of the engine;
//! - [`engine`]: the I/O engines behind one contract (io_uring, null): a
//!   validated request in, a completion out; every engine-specific choice
//!   (opcodes, bounce buffers, fallbacks, retries) stays there;
//! - [`vhost`]: the glue to `vhost-user-backend`: one worker per queue,
//!   which decides when to pop, submit, publish, notify and journal;
//! - [`daemon`]: configuration, the socket, signals, the serve loop;
//! - [`metrics`]: the counters, `ringblk stats`, rate-limited logging;
//! - [`api`]: the HTTP endpoints (`--api`'s control verbs, `--metrics`)
//!   and `ringblk ctl`;
//! - [`bench`](mod@bench): `ringblk bench`, which runs the separate `ringblk-bench`;
//! - [`exit`]: how every subcommand ends (exit status, error lines);
//!   [`logging`]: the log's format (journald's priorities under systemd);
//!   [`generate`]: man pages and shell completions.

pub mod api;
pub mod backup;
pub mod bench;
pub mod bitmap;
pub mod cli;
pub mod daemon;
pub mod engine;
pub mod exit;
pub mod format;
pub mod generate;
pub mod io;
pub mod logging;
pub mod metrics;
pub mod nbd;
pub mod qos;
pub mod unix_socket;
pub mod vhost;
pub mod virtio;

pub use ringblk_metrics::cpu;
