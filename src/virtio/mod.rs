//! The virtio layer: how we read and write the split ring, and the typed
//! block request parsed from a descriptor chain.
//!
//! Nothing here does I/O on the image. Everything a guest controls is
//! validated here, before the `io` layer sees it.

#[cfg(any(test, feature = "test-utils"))]
pub mod chain_writer;
pub mod config;
mod error;
#[cfg(any(test, feature = "test-utils"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod request;
pub mod ring;
#[cfg(test)]
pub(crate) mod testing;

pub use error::RequestError;
pub use request::{DeviceLimits, DiscardRange, Request, RequestKind};

use vm_memory::GuestMemoryMmap;

/// Guest memory as the daemon maps it (no dirty-page bitmap: no migration).
pub type GuestMem = GuestMemoryMmap<()>;

/// Virtio-blk sectors are always 512 bytes, whatever the block size.
pub const SECTOR_SHIFT: u32 = 9;
