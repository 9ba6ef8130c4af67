//! A virtio-blk request, parsed from a descriptor chain and validated
//! against the device before any I/O (virtio 1.2, 5.2.6).
//!
//! The chain is walked once. Its data buffers are translated to host
//! addresses here, so a descriptor outside guest memory (or across a hole
//! between two regions) is refused before the engine sees it.

use std::ops::Deref;
use std::sync::Arc;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::DescriptorChain;
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, GuestMemoryBackend};

use super::ring::ViewChain;
use super::{
    DiscardRange, GuestBuffers, GuestMem, RequestError, RequestKind, SECTOR_SHIFT, SpareIovecs,
};

/// Size of `struct virtio_blk_outhdr`: type (le32), reserved (le32), sector (le64).
const HEADER_LEN: u32 = 16;
/// Size of `struct virtio_blk_discard_write_zeroes`.
const RANGE_LEN: u32 = 16;

/// What the device advertises, and so what every request is checked
/// against, the capacity aside: that changes at runtime
/// ([`crate::device::Device::capacity`]) and is passed to each parse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Logical block size in bytes (512 or 4096).
    pub block_size: u32,
    pub readonly: bool,
    /// Maximum data segments per read or write.
    pub seg_max: u32,
    pub max_discard_sectors: u32,
    pub max_write_zeroes_sectors: u32,
}

/// The most data one read or write may carry: a request's bounce buffer
/// (O_DIRECT) is never larger. The `size_max` we advertise keeps
/// `seg_max` segments within it (see [`DeviceLimits::size_max`]); a
/// driver that ignores both is refused.
pub const MAX_DATA_BYTES: u32 = 32 << 20;

impl DeviceLimits {
    /// Largest data segment (`size_max`, VIRTIO_BLK_F_SIZE_MAX): a multiple
    /// of 4 KiB, at most 1 MiB, such that `seg_max` of them fit
    /// [`MAX_DATA_BYTES`].
    pub fn size_max(&self) -> u32 {
        let per_seg = MAX_DATA_BYTES / self.seg_max.max(1);
        (per_seg.min(1 << 20) & !0xfff).max(4096)
    }
}

/// Ranges per discard or write-zeroes request: advertised as
/// `max_discard_seg` and `max_write_zeroes_seg`, and all the parser takes.
pub const MAX_RANGES: u32 = 1;

impl Default for DeviceLimits {
    fn default() -> Self {
        DeviceLimits {
            block_size: 512,
            readonly: false,
            seg_max: 254,
            // 2 GiB per range, a multiple of any block size we offer.
            max_discard_sectors: 1 << 22,
            max_write_zeroes_sectors: 1 << 22,
        }
    }
}

/// A descriptor chain the parser walks: virtio-queue's `DescriptorChain`
/// (tests, resubmission), or a [`ViewChain`] over the rings translated for
/// the pass (the worker). Both walk a chain the same way.
pub trait Chain: Iterator<Item = Descriptor> {
    fn head_index(&self) -> u16;
}

impl<M> Chain for DescriptorChain<M>
where
    M: Deref,
    M::Target: GuestMemory,
{
    fn head_index(&self) -> u16 {
        DescriptorChain::head_index(self)
    }
}

impl<M: GuestMemory + ?Sized> Chain for ViewChain<'_, '_, M> {
    fn head_index(&self) -> u16 {
        ViewChain::head_index(self)
    }
}

/// A validated request, ready for the engine. Only the parser makes one:
/// its buffers were checked against the memory they hold, and its kind,
/// length and status address against the device.
#[derive(Debug)]
pub struct Request {
    /// Head descriptor index: what goes back in the used element.
    head: u16,
    kind: RequestKind,
    /// Data buffers (device-writable for reads and GET_ID, device-readable
    /// for writes; empty for the other kinds), and the memory snapshot
    /// they, and the status byte, are in.
    data: GuestBuffers,
    /// Where the status byte goes.
    status: GuestAddress,
    /// When the queue's worker popped it, on the worker's clock (its
    /// latency is measured from there): see [`Request::set_popped`].
    popped: u64,
}

/// A request refused before any I/O. `status` is `None` when the chain has
/// no usable status byte: it is then returned with used length 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected {
    pub head: u16,
    pub status: Option<GuestAddress>,
    pub error: RequestError,
}

/// One device-readable or device-writable buffer of the chain.
#[derive(Clone, Copy, Debug)]
struct Buf {
    addr: GuestAddress,
    len: u32,
}

impl Request {
    /// Parses and validates the chain (see [`Parser::parse`]), with buffers
    /// of its own: for tests and one-off parses.
    pub fn parse(
        chain: impl Chain,
        mem: &Arc<GuestMem>,
        limits: &DeviceLimits,
        capacity_sectors: u64,
        queue_size: u16,
    ) -> Result<Request, Rejected> {
        Parser::default().parse(chain, mem, limits, capacity_sectors, queue_size)
    }
}

/// Most iovec vectors a [`Parser`] keeps for reuse: more than a queue can
/// have in flight.
const POOL_MAX: usize = 1024;

/// Parses chains into requests without allocating once warm: the walk's
/// scratch lists are reused from one chain to the next, and each request's
/// iovec vector comes from a pool that [`Parser::recycle`] refills when
/// the request is done.
#[derive(Debug)]
pub struct Parser {
    readable: Bufs,
    writable: Bufs,
    /// The device-readable buffers after the header.
    out: Bufs,
    pool: SpareIovecs,
}

impl Default for Parser {
    fn default() -> Parser {
        Parser {
            readable: Bufs::default(),
            writable: Bufs::default(),
            out: Bufs::default(),
            pool: SpareIovecs::new(POOL_MAX),
        }
    }
}

impl Parser {
    /// Gives a finished request's iovec vector back for the next one.
    pub fn recycle(&mut self, req: Request) {
        self.pool.give_buffers(req.data);
    }

    /// Parses and validates the chain, for a device of `limits` and (now)
    /// `capacity_sectors`.
    ///
    /// A chain may hold at most `max(queue_size, seg_max + 2)` descriptors.
    /// Direct chains cannot exceed the queue size anyway; an indirect table
    /// may (Linux's virtio_ring allows it), and the front-end's queue size
    /// (QEMU's default is 128) is often below the seg_max we advertise, so
    /// a bound of the queue size alone would refuse legitimate large I/O.
    pub fn parse(
        &mut self,
        chain: impl Chain,
        mem: &Arc<GuestMem>,
        limits: &DeviceLimits,
        capacity_sectors: u64,
        queue_size: u16,
    ) -> Result<Request, Rejected> {
        let head = chain.head_index();
        let max_descs = usize::from(queue_size).max(limits.seg_max as usize + 2);
        let (complete, ordered) =
            split_chain(chain, max_descs, &mut self.readable, &mut self.writable);
        let reject = |status, error| Rejected {
            head,
            status,
            error,
        };

        // The status byte is the last byte of the last descriptor, which
        // must be device-writable.
        let writable = &mut self.writable;
        let status = match writable.last_mut() {
            Some(last) if last.len > 0 => {
                last.len -= 1;
                last.addr.checked_add(u64::from(last.len))
            }
            _ => None,
        };
        let Some(status) = status else {
            return Err(reject(None, RequestError::IllFormedChain));
        };
        // A status byte we cannot write means the guest never learns how
        // the request ended: refuse it before any I/O, not after.
        if !mem.address_in_range(status) {
            return Err(reject(None, RequestError::BadAddress));
        }
        if !(complete && ordered) {
            return Err(reject(Some(status), RequestError::IllFormedChain));
        }
        let reject = |error| Err(reject(Some(status), error));

        // The header: the first 16 device-readable bytes.
        let mut header = [0u8; HEADER_LEN as usize];
        let out = &mut self.out;
        match read_prefix(mem, &self.readable, &mut header, out) {
            Ok(true) => {}
            Ok(false) => return reject(RequestError::ShortHeader),
            Err(e) => return reject(e),
        };
        writable.retain(|b| b.len > 0);
        let (out, writable) = (&*out, &*writable);
        let req_type = u32::from_le_bytes(header[0..4].try_into().unwrap_or_default());
        let sector = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());

        let (kind, data) = match req_type {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let write = req_type == VIRTIO_BLK_T_OUT;
                let (data, other) = if write {
                    (out, writable)
                } else {
                    (writable, out)
                };
                if !other.is_empty() {
                    return reject(RequestError::WrongDirection);
                }
                if write && limits.readonly {
                    return reject(RequestError::ReadOnly);
                }
                if data.len() > limits.seg_max as usize {
                    return reject(RequestError::TooManySegments);
                }
                let len = total_len(data);
                if len > MAX_DATA_BYTES {
                    return reject(RequestError::TooLarge);
                }
                if !len.is_multiple_of(limits.block_size) {
                    return reject(RequestError::BadLength);
                }
                if let Err(e) = check_range(limits, capacity_sectors, sector, len >> SECTOR_SHIFT) {
                    return reject(e);
                }
                let kind = if write {
                    RequestKind::Write { sector }
                } else {
                    RequestKind::Read { sector }
                };
                (kind, data.as_slice())
            }
            VIRTIO_BLK_T_FLUSH => (RequestKind::Flush, &[][..]),
            VIRTIO_BLK_T_GET_ID => {
                if !out.is_empty() {
                    return reject(RequestError::WrongDirection);
                }
                (RequestKind::GetId, writable.as_slice())
            }
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                let zeroes = req_type == VIRTIO_BLK_T_WRITE_ZEROES;
                if !writable.is_empty() {
                    return reject(RequestError::WrongDirection);
                }
                if limits.readonly {
                    return reject(RequestError::ReadOnly);
                }
                let range = match parse_range(mem, out, limits, capacity_sectors, zeroes) {
                    Ok(r) => r,
                    Err(e) => return reject(e),
                };
                let kind = if zeroes {
                    RequestKind::WriteZeroes(range)
                } else {
                    RequestKind::Discard(range)
                };
                (kind, &[][..])
            }
            other => return reject(RequestError::UnsupportedType(other)),
        };

        let iovecs = self.pool.take();
        let data = if data.is_empty() {
            GuestBuffers::none(mem, iovecs)
        } else {
            match GuestBuffers::translate(mem, data.iter().map(|b| (b.addr, b.len)), iovecs) {
                Ok(d) => d,
                Err((e, iovecs)) => {
                    self.pool.give(iovecs);
                    return reject(e);
                }
            }
        };
        Ok(Request {
            head,
            kind,
            data,
            status,
            popped: 0,
        })
    }
}

impl Request {
    /// Head descriptor index: what goes back in the used element.
    pub fn head(&self) -> u16 {
        self.head
    }

    /// Records when the request was taken off the ring, in whatever
    /// unit the caller's clock has (the queue worker's: nanoseconds).
    #[inline]
    pub fn set_popped(&mut self, at: u64) {
        self.popped = at;
    }

    /// What [`Request::set_popped`] recorded (0 if nothing).
    #[inline]
    pub fn popped(&self) -> u64 {
        self.popped
    }

    pub fn kind(&self) -> RequestKind {
        self.kind
    }

    /// The data buffers, and the memory they are in.
    pub fn data(&self) -> &GuestBuffers {
        &self.data
    }

    /// The data buffers, to transform in place ([`GuestBuffers::slices_mut`]).
    pub fn data_mut(&mut self) -> &mut GuestBuffers {
        &mut self.data
    }

    /// Total bytes of data.
    pub fn data_len(&self) -> u32 {
        self.data.len()
    }

    /// Where the status byte goes, in [`Request::mem`].
    pub fn status_addr(&self) -> GuestAddress {
        self.status
    }

    /// The memory snapshot the request was parsed against: its buffers and
    /// status byte are there, and stay mapped while the request lives.
    pub fn mem(&self) -> &Arc<GuestMem> {
        self.data.mem()
    }

    /// Bytes the device writes into the guest's buffers on success, not
    /// counting the status byte.
    pub fn written_len(&self) -> u32 {
        self.data_len().min(self.kind.class().fills)
    }

    /// Byte offset in the image of a read or write.
    pub fn offset(&self) -> u64 {
        match self.kind {
            RequestKind::Read { sector } | RequestKind::Write { sector } => sector << SECTOR_SHIFT,
            RequestKind::Discard(r) | RequestKind::WriteZeroes(r) => r.offset(),
            RequestKind::Flush | RequestKind::GetId => 0,
        }
    }
}

type Bufs = Vec<Buf>;

/// Walks the chain once, splitting device-readable from device-writable
/// buffers into `readable` and `writable`. Returns (complete, ordered):
/// not complete when the chain broke (a loop, an index out of the table, a
/// bad indirect table, more descriptors than allowed); not ordered when a
/// readable descriptor follows a writable one.
fn split_chain(
    chain: impl Chain,
    max_descs: usize,
    readable: &mut Bufs,
    writable: &mut Bufs,
) -> (bool, bool) {
    readable.clear();
    writable.clear();
    let mut ordered = true;
    let mut last: Option<Descriptor> = None;
    let mut count = 0usize;
    // The chain iterator ends early, silently, on loops and bad tables; the
    // `take` bounds how long a guest can keep us walking.
    for desc in chain.take(max_descs + 1) {
        count += 1;
        let buf = Buf {
            addr: desc.addr(),
            len: desc.len(),
        };
        if desc.is_write_only() {
            writable.push(buf);
        } else {
            ordered &= writable.is_empty();
            readable.push(buf);
        }
        last = Some(desc);
    }
    let complete = matches!(last, Some(d) if !d.has_next()) && count <= max_descs;
    (complete, ordered)
}

fn total_len(bufs: &[Buf]) -> u32 {
    // The chain iterator stops before 2^32 bytes in total, so this fits.
    bufs.iter().fold(0u32, |a, b| a.saturating_add(b.len))
}

/// Reads `dst.len()` bytes from the front of `bufs` and puts the buffers
/// that remain after them in `rest`. Returns false if `bufs` hold fewer
/// bytes.
fn read_prefix(
    mem: &GuestMem,
    bufs: &[Buf],
    dst: &mut [u8],
    rest: &mut Bufs,
) -> Result<bool, RequestError> {
    let mut done = 0usize;
    rest.clear();
    for b in bufs {
        let take = (dst.len() - done).min(b.len as usize);
        if take > 0 {
            read(mem, &mut dst[done..done + take], b.addr)?;
            done += take;
        }
        if (take as u32) < b.len {
            let addr = b
                .addr
                .checked_add(take as u64)
                .ok_or(RequestError::BadAddress)?;
            rest.push(Buf {
                addr,
                len: b.len - take as u32,
            });
        }
    }
    Ok(done == dst.len())
}

/// Reads `dst.len()` bytes at `addr`: from one slice when they lie in one
/// region (one lookup), else piece by piece.
fn read(mem: &GuestMem, dst: &mut [u8], addr: GuestAddress) -> Result<(), RequestError> {
    let done = match mem.get_slice(addr, dst.len()) {
        Ok(s) => s.copy_to(dst) == dst.len(),
        Err(_) => mem.read_slice(dst, addr).is_ok(),
    };
    done.then_some(()).ok_or(RequestError::BadAddress)
}

/// Checks `sector .. sector + sectors` against the capacity and alignment.
fn check_range(
    limits: &DeviceLimits,
    capacity_sectors: u64,
    sector: u64,
    sectors: u32,
) -> Result<(), RequestError> {
    let align = u64::from(limits.block_size >> SECTOR_SHIFT);
    if !sector.is_multiple_of(align) || u64::from(sectors) % align != 0 {
        return Err(RequestError::Misaligned);
    }
    match sector.checked_add(u64::from(sectors)) {
        Some(end) if end <= capacity_sectors => Ok(()),
        _ => Err(RequestError::OutOfRange),
    }
}

/// Reads and validates the discard/write-zeroes range. We advertise and
/// take one range per request (`max_*_seg` = 1), like QEMU, which answers
/// a longer payload UNSUPP.
fn parse_range(
    mem: &GuestMem,
    out: &[Buf],
    limits: &DeviceLimits,
    capacity_sectors: u64,
    zeroes: bool,
) -> Result<DiscardRange, RequestError> {
    let max_sectors = if zeroes {
        limits.max_write_zeroes_sectors
    } else {
        limits.max_discard_sectors
    };
    let len = total_len(out);
    if len > RANGE_LEN * MAX_RANGES {
        return Err(RequestError::TooManyRanges);
    }
    if len < RANGE_LEN {
        return Err(RequestError::BadLength);
    }
    let mut raw = [0u8; RANGE_LEN as usize];
    // Exactly one range: nothing remains after it (an empty Vec does not
    // allocate).
    if !read_prefix(mem, out, &mut raw, &mut Vec::new())? {
        return Err(RequestError::BadLength);
    }
    let sector = u64::from_le_bytes(raw[0..8].try_into().unwrap_or_default());
    let num_sectors = u32::from_le_bytes(raw[8..12].try_into().unwrap_or_default());
    let flags = u32::from_le_bytes(raw[12..16].try_into().unwrap_or_default());
    let allowed = if zeroes {
        VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
    } else {
        0
    };
    if flags & !allowed != 0 {
        return Err(RequestError::UnsupportedFlags);
    }
    if num_sectors > max_sectors {
        return Err(RequestError::RangeTooLong);
    }
    check_range(limits, capacity_sectors, sector, num_sectors)?;
    Ok(DiscardRange {
        sector,
        num_sectors,
        unmap: flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0,
    })
}

#[cfg(test)]
mod chain_tests;
#[cfg(test)]
mod tests;
