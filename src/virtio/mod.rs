//! The virtio layer: how we read and write the split ring, and the typed
//! block request parsed from a descriptor chain.
//!
//! Nothing here does I/O on the image. Everything a guest controls is
//! validated here, before the engine ([`crate::engine`]) sees it.

mod buffers;
#[cfg(any(test, feature = "test-utils"))]
pub mod chain_writer;
pub mod config;
mod dirty;
mod error;
#[cfg(any(test, feature = "test-utils"))]
#[doc(hidden)]
pub mod fuzzing;
mod kind;
pub mod request;
pub mod ring;
mod status;
#[cfg(test)]
pub(crate) mod testing;

pub use buffers::{GuestBuffers, SpareIovecs, slice_iovecs};
pub use dirty::{DirtyLog, LogRegion};
pub use error::RequestError;
pub use kind::{Class, Direction, DiscardRange, Op, RequestKind};
pub use request::{DeviceLimits, Request};
pub use status::Status;

use vm_memory::GuestMemoryMmap;

/// Guest memory as the daemon maps it. Each region carries a dirty-page
/// bitmap ([`DirtyLog`]) that the device points at the front-end's log
/// ([`LogRegion`]) once it sends SET_LOG_BASE (live migration), in every
/// memory table from then on: every write through vm-memory (used ring,
/// status bytes) marks its pages. What the kernel writes into guest memory
/// behind vm-memory's back (io_uring reads) the engine core marks itself
/// (`engine::core`).
pub type GuestMem = GuestMemoryMmap<DirtyLog>;

/// Virtio-blk sectors are always 512 bytes, whatever the block size.
pub const SECTOR_SHIFT: u32 = 9;
