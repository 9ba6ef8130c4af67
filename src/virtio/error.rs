//! Why a request is refused, and the virtio status each reason maps to.

use super::Status;

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
    /// More data segments than `seg_max`.
    #[error("too many segments")]
    TooManySegments,
    /// More data than `seg_max` segments of `size_max` bytes can carry.
    #[error("more data than one request may carry")]
    TooLarge,
    /// A discard or write-zeroes payload longer than the one range we
    /// advertise (`max_discard_seg` / `max_write_zeroes_seg` = 1).
    #[error("more than one discard or write-zeroes range")]
    TooManyRanges,
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
    ///
    /// The choices follow qemu-storage-daemon's vhost-user-blk export
    /// (`block/export/virtio-blk-handler.c`), so that a driver or a test
    /// written against QEMU sees the same thing:
    /// - UNSUPP: an unknown type, unknown flags, UNMAP on a discard, and a
    ///   discard or write-zeroes payload of more than one range ("Only one
    ///   desc is currently supported");
    /// - IOERR: a range past the capacity or misaligned, a length not a
    ///   multiple of 512, a discard or write-zeroes range over the maximum
    ///   or its payload shorter than one range, and a write of any kind to
    ///   a read-only export.
    ///
    /// Where we differ, on purpose:
    /// - a chain without a usable header or status byte: QEMU drops the
    ///   request without a used element (the export) or marks the whole
    ///   device broken (the device model); we return it with IOERR, or
    ///   with used length 0 when there is no status byte, and go on
    ///   serving, so the guest never waits for it;
    /// - a data length that is a multiple of 512 but not of a 4096-byte
    ///   block size: QEMU checks 512 only, we refuse it (IOERR), since the
    ///   driver must not send it and O_DIRECT could not do it;
    /// - more data segments than `seg_max`, or a descriptor outside guest
    ///   memory: QEMU fails the whole virtqueue (`virtio_error`); we answer
    ///   this request IOERR;
    /// - more data than `seg_max` × `size_max`: QEMU advertises no
    ///   `size_max`, we do (it bounds what one request can make us
    ///   allocate) and answer a request past it IOERR;
    /// - a type with the legacy BARRIER bit: QEMU masks it off; we offer
    ///   VERSION_1 only, where that bit is not defined, so it is UNSUPP;
    /// - both unknown flags and a bad range in one request: QEMU checks the
    ///   range first (IOERR), we the flags (UNSUPP), as the spec's MUST on
    ///   unknown flags reads.
    pub fn status(self) -> Status {
        match self {
            RequestError::IllFormedChain
            | RequestError::ShortHeader
            | RequestError::BadAddress
            | RequestError::WrongDirection
            | RequestError::BadLength
            | RequestError::Misaligned
            | RequestError::OutOfRange
            | RequestError::TooManySegments
            | RequestError::TooLarge
            | RequestError::RangeTooLong
            | RequestError::ReadOnly => Status::IoErr,
            RequestError::TooManyRanges
            | RequestError::UnsupportedFlags
            | RequestError::UnsupportedType(_) => Status::Unsupp,
        }
    }
}
