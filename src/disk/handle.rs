//! The image a device serves, as the device sees it: [`Disk`], the one
//! owner of the disk's size. The guest's capacity (`Device::capacity`) is
//! what the device last published of it; a resize changes the size here
//! and then publishes it.

use std::fs::File;
use std::io;
use std::sync::{Arc, Weak};

use super::luks::Crypt;
use super::{Live, SnapshotError};
use crate::io::device_size;

/// An image whose size is changed through a handle the engines share
/// (an RBD image: `rbd_resize` on the handle every queue uses is what
/// lets them write past the old end at once).
pub trait Resizable: Send + Sync {
    fn size(&self) -> io::Result<u64>;
    fn set_size(&self, size: u64) -> io::Result<()>;
}

/// The image behind a device: what a resize changes or re-reads, what is
/// made durable when the daemon stops, and the chain a live snapshot
/// changes.
#[derive(Default)]
pub enum Disk {
    /// Nothing: the size cannot change (tests, the null engine's image
    /// aside).
    #[default]
    None,
    /// A file or block device: a duplicate of the daemon's image fd.
    File { file: File, block_device: bool },
    /// Part of a file or block device (an encrypted image's payload):
    /// from `offset`, `size` bytes or (None) to its end, encrypted with
    /// `crypt`.
    Payload {
        file: File,
        block_device: bool,
        offset: u64,
        size: Option<u64>,
        crypt: Arc<Crypt>,
    },
    /// A handle the engines share. Weak: the device must not keep the
    /// image open when SIGTERM closes it (the handle closes when its last
    /// strong holder lets go).
    Shared(Weak<dyn Resizable>),
    /// An image with a backing chain (qcow2; live snapshots change the
    /// chain).
    Chain(Arc<Live>),
}

impl Disk {
    /// The image's size now, in bytes (an image format's: the guest's).
    pub fn size(&self) -> io::Result<u64> {
        match self {
            Disk::None => Err(io::Error::other("the device has no image to resize")),
            Disk::File { file, block_device } => device_size(file, *block_device),
            Disk::Payload {
                file,
                block_device,
                offset,
                size,
                ..
            } => match size {
                Some(size) => Ok(*size),
                None => Ok(device_size(file, *block_device)?.saturating_sub(*offset)),
            },
            Disk::Shared(image) => shared(image)?.size(),
            Disk::Chain(live) => Ok(live.size()),
        }
    }

    /// Makes the image `size` bytes long.
    pub fn set_size(&self, size: u64) -> io::Result<()> {
        match self {
            Disk::None => Err(io::Error::other("the device has no image to resize")),
            Disk::File { file, .. } => file.set_len(size),
            Disk::Payload {
                file,
                offset,
                size: None,
                ..
            } => file.set_len(offset.saturating_add(size)),
            Disk::Payload { .. } => Err(io::Error::other(
                "the LUKS2 data segment has a fixed size (resize it with cryptsetup resize)",
            )),
            Disk::Shared(image) => shared(image)?.set_size(size),
            Disk::Chain(live) => live.grow(size).map_err(io::Error::other),
        }
    }

    /// Whether the image only grows online (an image format's tables).
    pub fn grows_only(&self) -> bool {
        matches!(self, Disk::Chain(_))
    }

    /// The image's chain, if it has one.
    pub fn chain(&self) -> Option<&Arc<Live>> {
        match self {
            Disk::Chain(live) => Some(live),
            _ => None,
        }
    }

    /// An encrypted image's payload: where it starts in the file, and
    /// its transform.
    pub fn encrypted(&self) -> Option<(u64, &Arc<Crypt>)> {
        match self {
            Disk::Payload { offset, crypt, .. } => Some((*offset, crypt)),
            _ => None,
        }
    }

    /// The chain a live snapshot puts a new top above: refused without
    /// one.
    pub fn for_snapshot(&self) -> Result<&Arc<Live>, SnapshotError> {
        self.chain().ok_or(SnapshotError::NotQcow2)
    }

    /// Makes everything written durable (the daemon stops): an fdatasync
    /// of the image file; for an image with a chain, its metadata first.
    pub fn make_durable(&self) -> io::Result<()> {
        match self {
            Disk::File { file, .. } | Disk::Payload { file, .. } => file.sync_data(),
            Disk::Chain(live) => live.refresh().map_err(io::Error::other),
            Disk::None | Disk::Shared(_) => Ok(()),
        }
    }
}

/// The shared handle, unless the daemon has closed it (it is stopping).
fn shared(image: &Weak<dyn Resizable>) -> io::Result<Arc<dyn Resizable>> {
    image
        .upgrade()
        .ok_or_else(|| io::Error::other("the image is closed: the daemon is stopping"))
}
