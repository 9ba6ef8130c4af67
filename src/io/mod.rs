//! The image: opening and creating it, and what it is (size, block size,
//! O_DIRECT alignment, file or block device). The engines that do I/O on it
//! are [`crate::engine`].

mod aligned;
mod image;
mod lock;

pub use aligned::{AlignedBuf, BOUNCE_ALIGN};
pub use image::{
    BLKDISCARD, BLKGETSIZE64, Image, ImageError, ImageOptions, device_size, serial_of,
};
pub use lock::{ImageLock, LockState, Locked};

mod rbd_spec;

pub use rbd_spec::{RBD_PREFIX, RbdSpec};
