//! Test helpers for the virtio layer: guest memory with a hole in it, and a
//! driver (on top of virtio-queue's `MockSplitQueue`) that writes descriptor
//! chains (with `chain_writer`), posts them and reads back the used ring.
//!
//! The used ring is placed here, not where `MockSplitQueue` puts it:
//! virtio-queue 0.18's mock starts it at `avail.end()`, which counts avail
//! entries as bytes, so for any queue size above 2 the used ring overlaps
//! the upper half of the avail ring and `used_event` (rust-vmm/vm-virtio
//! PR #400). Ring tests on that layout read their own writes back.

use std::sync::Arc;

use virtio_queue::desc::split::VirtqUsedElem;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::GuestMem;
pub use super::chain_writer::{Desc, DescTable, indirect, readable as r, writable as w};
use super::request::{DeviceLimits, Rejected, Request};

/// Region A: the ring at 0, then headers, buffers and indirect tables.
pub const A_END: u64 = 0x20_0000;
/// Regions B and C are adjacent; between A and B is a hole.
pub const B: u64 = 0x30_0000;
pub const C: u64 = 0x38_0000;
pub const C_END: u64 = 0x40_0000;

/// The used ring, clear of the mock's descriptor table and avail ring for
/// queues of up to 1024 entries.
pub const USED: u64 = 0x8000;

/// Where the tests put things in region A (above the rings).
pub const HDR: u64 = 0x1_0000;
pub const RANGE: u64 = 0x1_1000;
pub const STATUS: u64 = 0x1_2000;
pub const TABLE: u64 = 0x1_4000;
pub const DATA: u64 = 0x2_0000;

pub fn guest_memory() -> GuestMem {
    GuestMem::from_ranges(&[
        (GuestAddress(0), A_END as usize),
        (GuestAddress(B), (C - B) as usize),
        (GuestAddress(C), (C_END - C) as usize),
    ])
    .unwrap()
}

/// The capacity most tests run against: 1 GiB.
pub const CAPACITY: u64 = 1 << 21;

/// Limits most tests run against: 512-byte blocks, 8 segments.
pub fn limits() -> DeviceLimits {
    DeviceLimits {
        seg_max: 8,
        max_discard_sectors: 1024,
        max_write_zeroes_sectors: 2048,
        ..DeviceLimits::default()
    }
}

/// The usual read/write request tail: a one-byte status descriptor.
pub fn status() -> Desc {
    w(STATUS, 1)
}

/// The driver side of one split queue, plus the device's `Queue`.
pub struct Driver<'a> {
    pub mem: &'a GuestMem,
    /// The same memory as a snapshot requests can hold (its regions are
    /// `mem`'s).
    pub snapshot: Arc<GuestMem>,
    pub mock: MockSplitQueue<'a, GuestMem>,
    pub queue: Queue,
    avail_idx: u16,
}

impl<'a> Driver<'a> {
    pub fn new(mem: &'a GuestMem, size: u16) -> Self {
        let mock = MockSplitQueue::new(mem, size);
        let mut queue = mock.create_queue::<Queue>().unwrap();
        queue.set_used_ring_address(Some(USED as u32), Some(0));
        assert_eq!(queue.used_ring(), USED);
        Driver {
            mem,
            snapshot: Arc::new(mem.clone()),
            mock,
            queue,
            avail_idx: 0,
        }
    }

    pub fn size(&self) -> u16 {
        self.queue.size()
    }

    /// Starts both rings at `idx` (for wrap-around tests).
    pub fn start_at(&mut self, idx: u16) {
        self.avail_idx = idx;
        self.mock.avail().idx().store(idx);
        self.mem.write_obj(idx, GuestAddress(USED + 2)).unwrap();
        self.queue.set_next_avail(idx);
        self.queue.set_next_used(idx);
    }

    /// The queue's descriptor table.
    pub fn table(&self) -> DescTable {
        DescTable(self.mock.desc_table_addr())
    }

    /// Writes `descs` at table indices `first..`, linked with NEXT, and
    /// posts the chain. Returns the head index.
    pub fn post_at(&mut self, first: u16, descs: &[Desc]) -> u16 {
        let head = self.table().write_chain(self.mem, first, descs).unwrap();
        self.post_head(head);
        head
    }

    /// Writes `descs` from table index 0 and posts them.
    pub fn post(&mut self, descs: &[Desc]) -> u16 {
        self.post_at(0, descs)
    }

    /// Writes descriptors exactly as given (flags and next included) at
    /// table indices `head..` and posts `head`.
    pub fn post_raw(&mut self, head: u16, descs: &[Desc]) {
        self.table().write(self.mem, head, descs).unwrap();
        self.post_head(head);
    }

    /// Puts `head` on the avail ring and moves `avail->idx`.
    pub fn post_head(&mut self, head: u16) {
        let slot = self.avail_idx % self.size();
        self.mock
            .avail()
            .ring()
            .ref_at(usize::from(slot))
            .unwrap()
            .store(head);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mock.avail().idx().store(self.avail_idx);
    }

    /// Writes an indirect table at `addr`, its entries linked with NEXT.
    pub fn write_table(&self, addr: u64, descs: &[Desc]) {
        DescTable::at(addr).write_chain(self.mem, 0, descs).unwrap();
    }

    /// Writes a request header (type, reserved, sector) at `addr`.
    pub fn header_at(&self, addr: u64, req_type: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&req_type.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(addr)).unwrap();
    }

    pub fn header(&self, req_type: u32, sector: u64) {
        self.header_at(HDR, req_type, sector);
    }

    /// Writes a discard/write-zeroes range at `addr`.
    pub fn range_at(&self, addr: u64, sector: u64, num_sectors: u32, flags: u32) {
        let mut s = [0u8; 16];
        s[0..8].copy_from_slice(&sector.to_le_bytes());
        s[8..12].copy_from_slice(&num_sectors.to_le_bytes());
        s[12..16].copy_from_slice(&flags.to_le_bytes());
        self.mem.write_slice(&s, GuestAddress(addr)).unwrap();
    }

    /// Pops the next chain (one avail->idx read).
    pub fn pop(&mut self) -> DescriptorChain<&'a GuestMem> {
        use virtio_queue::QueueOwnedT;
        self.queue.iter(self.mem).unwrap().next().unwrap()
    }

    /// Pops the next chain and parses it (the device's capacity is
    /// [`CAPACITY`]).
    pub fn parse(&mut self, limits: &DeviceLimits) -> Result<Request, Rejected> {
        self.parse_at(limits, CAPACITY)
    }

    /// Pops the next chain and parses it for a device of `capacity` sectors.
    pub fn parse_at(&mut self, limits: &DeviceLimits, capacity: u64) -> Result<Request, Rejected> {
        let size = self.size();
        let chain = self.pop();
        Request::parse(chain, &self.snapshot, limits, capacity, size)
    }

    /// Posts `descs` and parses them.
    pub fn parse_chain(
        &mut self,
        limits: &DeviceLimits,
        descs: &[Desc],
    ) -> Result<Request, Rejected> {
        self.post(descs);
        self.parse(limits)
    }

    pub fn used_addr(&self) -> GuestAddress {
        GuestAddress(USED)
    }

    pub fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(USED + 2)).unwrap()
    }

    pub fn used_elem(&self, idx: u16) -> (u32, u32) {
        let slot = u64::from(idx % self.size());
        let e: VirtqUsedElem = self
            .mem
            .read_obj(GuestAddress(USED + 4 + 8 * slot))
            .unwrap();
        (e.id(), e.len())
    }

    /// `used->flags`, as the driver sees it.
    pub fn used_flags(&self) -> u16 {
        self.mem.read_obj(self.used_addr()).unwrap()
    }

    /// `avail->flags`, written by the driver.
    pub fn set_avail_flags(&self, flags: u16) {
        self.mem.write_obj(flags, self.mock.avail_addr()).unwrap();
    }

    pub fn used_event_addr(&self) -> GuestAddress {
        GuestAddress(self.mock.avail_addr().0 + 4 + 2 * u64::from(self.size()))
    }

    pub fn avail_event_addr(&self) -> GuestAddress {
        GuestAddress(USED + 4 + 8 * u64::from(self.size()))
    }

    /// `used_event`, written by the driver (EVENT_IDX).
    pub fn set_used_event(&self, idx: u16) {
        self.mem.write_obj(idx, self.used_event_addr()).unwrap();
    }

    /// `avail_event`, written by the device (EVENT_IDX).
    pub fn avail_event(&self) -> u16 {
        self.mem.read_obj(self.avail_event_addr()).unwrap()
    }
}

/// The host address backing guest address `addr`.
pub fn host(mem: &GuestMem, addr: u64) -> usize {
    mem.get_host_address(GuestAddress(addr)).unwrap() as usize
}

/// Asserts the request's iovecs are exactly `expected` (guest address,
/// length), translated to host addresses.
pub fn assert_iovecs(mem: &GuestMem, req: &Request, expected: &[(u64, usize)]) {
    let got: Vec<(usize, usize)> = req
        .data()
        .iovecs()
        .iter()
        .map(|v| (v.iov_base as usize, v.iov_len))
        .collect();
    let want: Vec<(usize, usize)> = expected.iter().map(|&(a, l)| (host(mem, a), l)).collect();
    assert_eq!(got, want);
    let total: usize = got.iter().map(|v| v.1).sum();
    assert_eq!(total, req.data_len() as usize);
}
