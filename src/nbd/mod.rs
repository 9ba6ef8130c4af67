//! A read-only NBD server with metadata contexts, for backups
//! (docs/backup.md).
//!
//! No well-kept Rust crate serves `NBD_CMD_BLOCK_STATUS` with metadata
//! contexts, so this one is ours, built on NetworkBlockDevice/nbd's
//! doc/proto.md and checked against QEMU's nbd/server.c and libnbd's
//! clients. It speaks:
//! - the fixed newstyle handshake (a non-fixed client may only send
//!   `NBD_OPT_EXPORT_NAME`); options `EXPORT_NAME`, `GO`, `INFO`, `LIST`,
//!   `ABORT`, `STRUCTURED_REPLY`, `LIST_META_CONTEXT`,
//!   `SET_META_CONTEXT`; every other option gets `NBD_REP_ERR_UNSUP`;
//! - one export, the default (name ""), read-only (`NBD_FLAG_READ_ONLY`;
//!   writes, trims and write-zeroes get `EPERM`), shareable across
//!   connections (`NBD_FLAG_CAN_MULTI_CONN`);
//! - `NBD_CMD_READ` (a structured reply when negotiated, simple otherwise),
//!   `NBD_CMD_BLOCK_STATUS` for `base:allocation` and
//!   `qemu:dirty-bitmap:NAME` (QEMU's namespace: bit 0 is dirty),
//!   `NBD_CMD_FLUSH` (nothing to do) and `NBD_CMD_DISC`.
//!
//! What it serves is an [`Export`]: the daemon plugs in the point-in-time
//! view of a backup (`crate::backup::View`).
//!
//! A client is half-trusted. Everything it can make the server hold is
//! bounded ([`Limits`]): a fixed pool of threads, one per connection, and a
//! cap on connections (past it a connection is closed at once); deadlines
//! for the handshake, between requests and for each request and its reply;
//! option and request lengths, and a reply buffer of 1 MiB per connection
//! whatever a read's length. A client that breaks the protocol gets an
//! error reply, or is disconnected where the stream cannot be trusted any
//! more (a bad magic); nothing it sends reaches the guest's I/O.

pub mod client;
#[cfg(any(test, feature = "test-utils"))]
pub mod fuzzing;
pub mod proto;
mod server;
mod session;

use std::io;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::Duration;

pub use server::{Server, ServerStats};
pub use session::{End, Transport, serve_connection};

/// Binds the export's socket at `path`, mode 0600 whatever the umask,
/// replacing a stale socket but never a live one.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    crate::unix_socket::remove_stale(path)?;
    crate::unix_socket::bind_with_mode(path, 0o600)
}

/// A metadata context a client can select.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaContext {
    /// `base:allocation`: [`proto::STATE_HOLE`], [`proto::STATE_ZERO`].
    Allocation,
    /// `qemu:dirty-bitmap:NAME`: [`proto::STATE_DIRTY`].
    DirtyBitmap(String),
}

impl MetaContext {
    /// The context's name on the wire.
    pub fn name(&self) -> String {
        match self {
            MetaContext::Allocation => proto::CONTEXT_ALLOCATION.to_string(),
            MetaContext::DirtyBitmap(n) => format!("{}{n}", proto::CONTEXT_BITMAP_PREFIX),
        }
    }
}

/// What the server exports: a read-only range of bytes and its metadata.
/// Called from several connection threads at once.
pub trait Export: Send + Sync {
    /// The size in bytes.
    fn size(&self) -> u64;

    /// Fills `buf` with the bytes at `offset`. The server only asks for
    /// ranges inside the export, at most 1 MiB at a time.
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;

    /// The names of the dirty bitmaps offered as `qemu:dirty-bitmap:NAME`.
    fn bitmaps(&self) -> Vec<String>;

    /// The status of `context` at `offset` (inside the export): the length
    /// of the run that shares it, at least 1 and at most `max_len`, and its
    /// flags as the context defines them (0 is always safe: allocated, not
    /// known to be zero, clean). The run may stop short of a change of
    /// status: one call must do bounded work, whatever `max_len`.
    fn block_status(
        &self,
        context: &MetaContext,
        offset: u64,
        max_len: u64,
    ) -> io::Result<(u64, u32)>;

    /// A line for `NBD_INFO_DESCRIPTION`.
    fn description(&self) -> String {
        String::new()
    }
}

/// What one server may hold and for how long.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Connections served at once; also the number of threads. Past it a
    /// new connection is closed at once.
    pub max_connections: usize,
    /// From accept to the end of option haggling.
    pub handshake: Duration,
    /// Between two requests.
    pub idle: Duration,
    /// For a request's payload and its whole reply to go through.
    pub io: Duration,
}

impl Default for Limits {
    /// Eight connections (nbdcopy opens four), ten seconds of handshake,
    /// two minutes idle, thirty seconds per request (a 32 MiB read to a
    /// client that reads at 1 MiB/s).
    fn default() -> Limits {
        Limits {
            max_connections: 8,
            handshake: Duration::from_secs(10),
            idle: Duration::from_secs(120),
            io: Duration::from_secs(30),
        }
    }
}

/// The largest read and block-status range, as QEMU's NBD_MAX_BUFFER_SIZE
/// (advertised in `NBD_INFO_BLOCK_SIZE`).
pub const MAX_REQUEST: u32 = 32 << 20;
/// The reply buffer of one connection: reads go out in pieces of this.
pub const READ_PIECE: usize = 1 << 20;
/// The longest option payload taken; a longer one ends the connection.
pub const MAX_OPTION_LEN: u32 = 64 << 10;
/// Options per connection before it is ended.
pub const MAX_OPTIONS: u32 = 1024;
/// Queries in one `*_META_CONTEXT` option.
pub const MAX_QUERIES: u32 = 128;
/// Descriptors per context in one block-status reply; a client asks again
/// from where a reply stopped.
pub const MAX_EXTENTS: usize = 2048;
/// Calls of [`Export::block_status`] per context in one block-status
/// request (neighbours that share a status are merged into one
/// descriptor); with the export's bound on one call, this bounds the work
/// of one request, whatever its length.
pub const MAX_STATUS_CALLS: usize = 4096;
