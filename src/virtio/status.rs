//! How a request ended: the status byte the device writes last (virtio
//! 1.2, 5.2.6).

use std::sync::atomic::Ordering;

use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::GuestMem;

/// A virtio-blk request's status. The device has exactly these three;
/// every way a request can end maps to one of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// VIRTIO_BLK_S_OK: done as asked.
    Ok,
    /// VIRTIO_BLK_S_IOERR: refused as malformed, or the I/O failed.
    IoErr,
    /// VIRTIO_BLK_S_UNSUPP: a request type or flag the device does not do.
    Unsupp,
}

impl Status {
    /// The byte the guest reads. Exhaustive: the one place a status meets
    /// its `VIRTIO_BLK_S_*` value.
    pub fn byte(self) -> u8 {
        let s = match self {
            Status::Ok => VIRTIO_BLK_S_OK,
            Status::IoErr => VIRTIO_BLK_S_IOERR,
            Status::Unsupp => VIRTIO_BLK_S_UNSUPP,
        };
        s as u8
    }

    pub fn is_ok(self) -> bool {
        self == Status::Ok
    }

    /// Writes the status byte at `addr` in `mem`: one region lookup and
    /// one store, marked in the dirty log as any write through vm-memory
    /// is. False when `addr` is not in `mem`.
    pub fn write(self, mem: &GuestMem, addr: GuestAddress) -> bool {
        mem.get_slice(addr, 1)
            .is_ok_and(|s| s.store(self.byte(), 0, Ordering::Relaxed).is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_the_spec_values() {
        assert_eq!(Status::Ok.byte(), 0);
        assert_eq!(Status::IoErr.byte(), 1);
        assert_eq!(Status::Unsupp.byte(), 2);
    }
}
