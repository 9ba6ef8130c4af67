//! The image: opening and creating it, and what it is (size, block size,
//! O_DIRECT alignment, file or block device). The engines that do I/O on it
//! are [`crate::engine`].

mod image;

pub use image::{BLKDISCARD, Image, ImageError, ImageOptions};

mod rbd_spec;

pub use rbd_spec::{RBD_PREFIX, RbdSpec};
