//! Why a request is refused, and the virtio status each reason maps to.

use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_UNSUPP};

/// A request the device refuses before any I/O. Every variant is something
/// a guest can cause; none of them stops the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The descriptor chain loops, is longer than the queue, has a bad
    /// indirect table, or puts a device-readable descriptor after a writable one.
    #[error("ill-formed descriptor chain")]
    IllFormedChain,
    /// Fewer than 16 device-readable bytes for the request header.
    #[error("request header missing or short")]
    ShortHeader,
    /// A descriptor points outside guest memory or across a hole in it.
    #[error("descriptor outside guest memory")]
    BadAddress,
    /// Data in the wrong direction for the request type (e.g. a read with
    /// device-readable data buffers).
    #[error("data buffers in the wrong direction")]
    WrongDirection,
    /// Data length not a multiple of 512 (or of the block size).
    #[error("data length not a multiple of the sector or block size")]
    BadLength,
    /// Sector not aligned to the logical block size.
    #[error("sector not aligned to the block size")]
    Misaligned,
    /// The sector range runs past the capacity or overflows.
    #[error("sector range beyond capacity")]
    OutOfRange,
    /// More data segments or discard/write-zeroes ranges than advertised.
    #[error("too many segments")]
    TooManySegments,
    /// A discard or write-zeroes range longer than advertised.
    #[error("range longer than the advertised maximum")]
    RangeTooLong,
    /// A write, discard or write-zeroes on a read-only export.
    #[error("write to a read-only export")]
    ReadOnly,
    /// Flags we do not implement (e.g. UNMAP on a discard, reserved bits).
    #[error("unsupported flags")]
    UnsupportedFlags,
    /// A request type we do not implement.
    #[error("unsupported request type {0}")]
    UnsupportedType(u32),
}

impl RequestError {
    /// The status byte the guest gets. Exhaustive on purpose: a new variant
    /// must decide its status here.
    pub fn status(self) -> u8 {
        let s = match self {
            RequestError::IllFormedChain
            | RequestError::ShortHeader
            | RequestError::BadAddress
            | RequestError::WrongDirection
            | RequestError::BadLength
            | RequestError::Misaligned
            | RequestError::OutOfRange
            | RequestError::TooManySegments
            | RequestError::RangeTooLong
            | RequestError::ReadOnly => VIRTIO_BLK_S_IOERR,
            RequestError::UnsupportedFlags | RequestError::UnsupportedType(_) => {
                VIRTIO_BLK_S_UNSUPP
            }
        };
        s as u8
    }
}
