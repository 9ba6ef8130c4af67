//! The I/O layer: the image and the engines that execute requests on it.
//!
//! The engine only sees validated [`crate::virtio::Request`]s and plain
//! iovecs; it knows nothing of rings or guests.

mod bounce;
mod image;
mod uring;

pub use bounce::AlignedBuf;
pub use image::{BLKDISCARD, Image, ImageError, ImageOptions, discard_block_device};
pub use uring::{EngineError, Uring, UringOptions, op};
