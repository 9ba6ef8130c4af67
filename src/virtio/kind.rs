//! What a request asks for ([`RequestKind`]), and everything the layers
//! above derive from that, in one mapping ([`RequestKind::class`]): what
//! the engine does, what QoS charges, how the metrics count it, what it
//! does to durability, and what it writes into the guest's buffers.

use ringblk_metrics::RequestType;
use virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES;

use super::SECTOR_SHIFT;

/// One discard or write-zeroes range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiscardRange {
    pub sector: u64,
    pub num_sectors: u32,
    /// Write-zeroes only: the device may deallocate the range.
    pub unmap: bool,
}

impl DiscardRange {
    pub fn offset(&self) -> u64 {
        self.sector << SECTOR_SHIFT
    }
    pub fn len(&self) -> u64 {
        u64::from(self.num_sectors) << SECTOR_SHIFT
    }
    /// A range of no sectors (valid: the device has nothing to do).
    pub fn is_empty(&self) -> bool {
        self.num_sectors == 0
    }
}

/// The operation a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    Read { sector: u64 },
    Write { sector: u64 },
    Flush,
    GetId,
    Discard(DiscardRange),
    WriteZeroes(DiscardRange),
}

/// What an engine does to the image for a request. GET_ID is not I/O, so
/// it has none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    Discard(DiscardRange),
    WriteZeroes(DiscardRange),
}

/// Which way a request's data goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// From the image into the guest's buffers.
    Read,
    /// From the guest (or, for discard and write-zeroes, no data at all)
    /// to the image.
    Write,
}

/// Everything that follows from a request's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Class {
    /// What the engine does; `None`: answered without I/O (GET_ID).
    pub op: Option<Op>,
    /// What QoS charges: the direction it draws on, and whether its data
    /// bytes count. Discard and write-zeroes count as a write with no
    /// bytes (they carry no data, and charging their range would stall the
    /// queue for a whole-disk discard); `None` draws nothing (a flush
    /// still waits its turn behind a throttled request).
    pub qos: Option<(Direction, bool)>,
    /// How the metrics count it.
    pub metric: RequestType,
    /// Which byte counter its data goes to when it succeeds.
    pub bytes: Option<Direction>,
    /// Once done, the image has changed since the last flush.
    pub changes_image: bool,
    /// Once done successfully, every change before it is durable.
    pub flushes: bool,
    /// The most bytes of its buffers the device fills on success.
    pub fills: u32,
}

impl RequestKind {
    /// The one mapping from a kind to what follows from it.
    #[inline]
    pub fn class(self) -> Class {
        let (r, w) = (Direction::Read, Direction::Write);
        let none = Class {
            op: None,
            qos: None,
            metric: RequestType::GetId,
            bytes: None,
            changes_image: false,
            flushes: false,
            fills: 0,
        };
        match self {
            RequestKind::Read { .. } => Class {
                op: Some(Op::Read),
                qos: Some((r, true)),
                metric: RequestType::Read,
                bytes: Some(r),
                fills: u32::MAX,
                ..none
            },
            RequestKind::Write { .. } => Class {
                op: Some(Op::Write),
                qos: Some((w, true)),
                metric: RequestType::Write,
                bytes: Some(w),
                changes_image: true,
                ..none
            },
            RequestKind::Flush => Class {
                op: Some(Op::Flush),
                metric: RequestType::Flush,
                flushes: true,
                ..none
            },
            RequestKind::GetId => Class {
                metric: RequestType::GetId,
                fills: VIRTIO_BLK_ID_BYTES,
                ..none
            },
            RequestKind::Discard(range) => Class {
                op: Some(Op::Discard(range)),
                qos: Some((w, false)),
                metric: RequestType::Discard,
                changes_image: true,
                ..none
            },
            RequestKind::WriteZeroes(range) => Class {
                op: Some(Op::WriteZeroes(range)),
                qos: Some((w, false)),
                metric: RequestType::WriteZeroes,
                changes_image: true,
                ..none
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_maps_to_what_follows_from_it() {
        let range = DiscardRange {
            sector: 0,
            num_sectors: 8,
            unmap: false,
        };
        let (r, w) = (Direction::Read, Direction::Write);
        let read = RequestKind::Read { sector: 0 }.class();
        assert_eq!(
            (read.op, read.qos, read.bytes, read.fills),
            (Some(Op::Read), Some((r, true)), Some(r), u32::MAX)
        );
        let write = RequestKind::Write { sector: 0 }.class();
        assert_eq!(
            (write.qos, write.changes_image, write.fills),
            (Some((w, true)), true, 0)
        );
        let flush = RequestKind::Flush.class();
        assert_eq!(
            (flush.qos, flush.flushes, flush.changes_image),
            (None, true, false)
        );
        let id = RequestKind::GetId.class();
        assert_eq!((id.op, id.fills, id.metric), (None, 20, RequestType::GetId));
        for k in [RequestKind::Discard(range), RequestKind::WriteZeroes(range)] {
            let c = k.class();
            assert_eq!(
                (c.qos, c.bytes, c.changes_image),
                (Some((w, false)), None, true)
            );
        }
    }
}
