//! The generator behind `parse_one`: reads the fuzz input and lays out
//! requests in guest memory (see the parent module for the layout).

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use vm_memory::{Bytes, GuestAddress};

use super::{A_END, B, C, C_END, DATA, DESC, MAX_SEGS, SMALL, TABLE_SPACING, TABLES};
use crate::virtio::chain_writer::{
    self, DESC_SIZE, Desc, DescTable, INDIRECT, NEXT, WRITE, link, readable, writable,
};
use crate::virtio::request::MAX_DATA_BYTES;
use crate::virtio::{DeviceLimits, GuestMem, SECTOR_SHIFT};

/// The device's limits and its capacity in sectors.
pub(super) fn pick_limits(input: &mut Input) -> (DeviceLimits, u64) {
    let cfg = input.byte();
    let block_size = if cfg & 1 != 0 { 4096 } else { 512 };
    // Whole 4 KiB blocks, from 16 MiB to 2^59 bytes.
    let capacity_sectors = 8u64 << (12 + input.below(36));
    let limits = DeviceLimits {
        block_size,
        readonly: cfg & 14 == 14,
        seg_max: [1, 4, 8, 126, 254][input.below(5) as usize],
        ..DeviceLimits::default()
    };
    (limits, capacity_sectors)
}

/// A chain as the generator meant it.
pub(super) struct Posted {
    pub(super) head: u16,
    pub(super) req_type: u32,
    /// One structural corruption was applied: any chain error may follow.
    pub(super) corrupted: bool,
}

/// A corruption that outlives linking: entry `.0` of the chain gets NEXT
/// and `next` = `.1`, whatever `link` gave it.
type ForcedNext = Option<(usize, u16)>;

pub(super) struct Generator<'a> {
    mem: &'a GuestMem,
    limits: DeviceLimits,
    capacity_sectors: u64,
    next_data: u64,
    free_slot: u16,
    queue_size: u16,
}

impl<'a> Generator<'a> {
    pub(super) fn new(
        mem: &'a GuestMem,
        (limits, capacity_sectors): (DeviceLimits, u64),
        queue_size: u16,
    ) -> Self {
        Generator {
            mem,
            limits,
            capacity_sectors,
            next_data: DATA,
            free_slot: 0,
            queue_size,
        }
    }

    /// Builds chain `k`, or `None` when the descriptor table is full.
    pub(super) fn chain(&mut self, input: &mut Input, k: usize) -> Option<Posted> {
        let base = SMALL + 0x100 * k as u64;
        let (hdr, range, status) = (base, base + 0x40, base + 0x80);
        // Linux puts most multi-segment requests in an indirect table.
        let indirect = input.chance(4);
        let pick = input.below(16);
        let req_type = match pick {
            0..=4 => VIRTIO_BLK_T_IN,
            5..=8 => VIRTIO_BLK_T_OUT,
            9 => VIRTIO_BLK_T_FLUSH,
            10 => VIRTIO_BLK_T_GET_ID,
            11 | 12 => VIRTIO_BLK_T_DISCARD,
            13 | 14 => VIRTIO_BLK_T_WRITE_ZEROES,
            // Anything else: an unsupported type (none of ours has bit 6).
            _ => input.u32() | 0x40,
        };
        let sector = self.sector(input);
        let mut header = [0u8; 16];
        header[0..4].copy_from_slice(&req_type.to_le_bytes());
        if input.chance(4) {
            header[4..8].copy_from_slice(&input.u32().to_le_bytes());
        }
        header[8..16].copy_from_slice(&sector.to_le_bytes());

        let mut descs = Vec::new();
        // The header, sometimes split in two, sometimes followed by the
        // first block of write data in the same buffer (any layout).
        let split = if input.chance(32) {
            1 + input.below(15)
        } else {
            16
        };
        if req_type == VIRTIO_BLK_T_OUT && split == 16 && input.chance(16) {
            let len = 16 + self.limits.block_size;
            let buf = self.alloc(len);
            write_slice(self.mem, &header, GuestAddress(buf));
            descs.push(readable(buf, len));
        } else {
            write_slice(self.mem, &header, GuestAddress(hdr));
            descs.push(readable(hdr, split));
        }
        if split < 16 {
            let rest = hdr + 0x20;
            write_slice(self.mem, &header[split as usize..], GuestAddress(rest));
            descs.push(readable(rest, 16 - split));
        }
        let data_write = match req_type {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_GET_ID => Some(true),
            VIRTIO_BLK_T_OUT => Some(false),
            _ => None,
        };
        if let Some(writable) = data_write {
            let read_or_write = req_type != VIRTIO_BLK_T_GET_ID;
            self.data(input, &mut descs, writable, indirect, read_or_write);
        } else if matches!(req_type, VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES) {
            self.range(input, range, req_type);
            descs.push(readable(range, 16));
        } else if pick == 15 && input.chance(64) {
            self.data(input, &mut descs, true, indirect, false);
        }
        // The status byte: its own descriptor, or the end of the last
        // writable data buffer.
        let last_writable = descs.last().is_some_and(Desc::is_writable);
        if last_writable && input.chance(16) {
            if let Some(d) = descs.last_mut() {
                d.len += 1;
            }
        } else {
            descs.push(writable(status, 1));
        }

        let mut corrupted = false;
        let mut forced_next = None;
        if input.chance(32) {
            corrupted = true;
            forced_next = self.corrupt(input, &mut descs, indirect);
        }
        let head = self.place(input, &descs, forced_next, indirect, k, &mut corrupted)?;
        Some(Posted {
            head,
            req_type,
            corrupted,
        })
    }

    fn sector(&self, input: &mut Input) -> u64 {
        let cap = self.capacity_sectors;
        let align = u64::from(self.limits.block_size >> SECTOR_SHIFT);
        let s = match input.below(16) {
            0 => 0,
            1 => cap.saturating_sub(u64::from(input.u16())),
            2 => input.u64(),
            3 => cap,
            _ => u64::from(input.u16()),
        };
        if input.chance(16) {
            s
        } else {
            s / align * align
        }
    }

    /// Appends data segments: whole blocks, rarely a ragged length; as many
    /// as `seg_max`, rarely one more. A chain holds up to the queue size in
    /// descriptors, an indirect one up to `seg_max + 2` if that is more
    /// (header, status and, when split, the header's second half: 3).
    ///
    /// For a read or write (`too_large_ok`), a ragged length may instead be
    /// one segment past all a request may carry: the parser refuses that
    /// (TooLarge) before it looks at addresses, which such a segment does
    /// not respect.
    fn data(
        &mut self,
        input: &mut Input,
        descs: &mut Vec<Desc>,
        writable: bool,
        indirect: bool,
        too_large_ok: bool,
    ) {
        let mut room = u64::from(self.queue_size);
        if indirect {
            room = room.max(u64::from(self.limits.seg_max) + 2);
        }
        let room = room - 3;
        let max = u64::from(self.limits.seg_max).min(MAX_SEGS).min(room);
        let n = if input.chance(16) {
            max + 1
        } else {
            input.below(max as u32 + 1).into()
        };
        let n = n.min(room);
        let block = self.limits.block_size;
        for _ in 0..n {
            let len = if input.chance(64) {
                match input.u16() {
                    0xfff0.. if too_large_ok => MAX_DATA_BYTES + block,
                    raw => u32::from(raw),
                }
            } else {
                block * (1 + input.below(4))
            };
            let addr = if input.chance(16) {
                // Across the boundary between regions B and C.
                C - u64::from(input.below(len.clamp(1, (C - B) as u32)))
            } else {
                self.alloc(len)
            };
            descs.push(if writable {
                chain_writer::writable(addr, len)
            } else {
                readable(addr, len)
            });
        }
    }

    fn range(&self, input: &mut Input, at: u64, req_type: u32) {
        let zeroes = req_type == VIRTIO_BLK_T_WRITE_ZEROES;
        let align = u64::from(self.limits.block_size >> SECTOR_SHIFT);
        let max = if zeroes {
            self.limits.max_write_zeroes_sectors
        } else {
            self.limits.max_discard_sectors
        };
        let num = match input.below(8) {
            0 => input.u32(),
            1 => max,
            2 => max + 1,
            _ => (1 + input.below(64)) * align as u32,
        };
        let flags = match input.below(16) {
            0 => input.u32(),
            1..=7 if zeroes => VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
            1 => VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
            _ => 0,
        };
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&self.sector(input).to_le_bytes());
        raw[8..12].copy_from_slice(&num.to_le_bytes());
        raw[12..16].copy_from_slice(&flags.to_le_bytes());
        write_slice(self.mem, &raw, GuestAddress(at));
    }

    fn alloc(&mut self, len: u32) -> u64 {
        // One spare byte: the status may be merged into the last buffer.
        let len = u64::from(len) + 1;
        if self.next_data + len > A_END {
            self.next_data = DATA;
        }
        let addr = self.next_data;
        // Keep buffers 8-byte aligned, like real ones.
        self.next_data += (len + 7) & !7;
        addr
    }

    /// Breaks one thing in the chain; a `next` anywhere is applied when the
    /// chain is linked (`place`).
    fn corrupt(&self, input: &mut Input, descs: &mut Vec<Desc>, indirect: bool) -> ForcedNext {
        let i = input.below(descs.len() as u32) as usize;
        match input.below(8) {
            0 => descs[i].flags ^= WRITE,
            1 => {
                descs[i].addr = match input.below(4) {
                    0 => A_END + u64::from(input.u16()),
                    1 => C_END + u64::from(input.u32()),
                    2 => u64::MAX - u64::from(input.u16()),
                    _ => A_END - u64::from(input.below(descs[i].len.clamp(1, A_END as u32))),
                }
            }
            2 => return Some((i, input.u16() % (self.queue_size + 2))),
            3 => descs[i].len = input.u32(),
            4 => {
                descs.pop();
            }
            5 => {
                if let Some(d) = descs.last_mut() {
                    d.len = 0;
                }
            }
            6 if indirect => descs[i].flags |= INDIRECT,
            _ => descs[i].flags |= NEXT,
        }
        None
    }

    /// Writes the chain to the descriptor table (or an indirect table) and
    /// returns its head, or `None` when the table is full.
    fn place(
        &mut self,
        input: &mut Input,
        descs: &[Desc],
        forced_next: ForcedNext,
        indirect: bool,
        k: usize,
        corrupted: &mut bool,
    ) -> Option<u16> {
        let head = self.free_slot;
        let slots = if indirect { 1 } else { descs.len() as u16 };
        if u32::from(head) + u32::from(slots) > u32::from(self.queue_size) {
            return None;
        }
        self.free_slot += slots;
        let (table, first) = if indirect {
            (TABLES + TABLE_SPACING * k as u64, 0)
        } else {
            (DESC, head)
        };
        let mut linked = link(descs, first);
        if let Some((i, to)) = forced_next {
            linked[i] = linked[i].with_next(to);
        }
        write_descs(self.mem, table, first, &linked);
        if indirect {
            let mut len = (DESC_SIZE * descs.len() as u64) as u32;
            if input.chance(64) {
                *corrupted = true;
                len = input.u32() % 0x800;
            }
            write_descs(self.mem, DESC, head, &[chain_writer::indirect(table, len)]);
        }
        Some(head)
    }
}

/// Writes into guest memory the generator laid out; the addresses are its
/// own constants, so a failure is a bug in the generator.
pub(super) fn write<T: vm_memory::ByteValued>(mem: &GuestMem, val: T, at: GuestAddress) {
    if let Err(e) = mem.write_obj(val, at) {
        panic!("fuzz generator wrote outside guest memory at {at:?}: {e}");
    }
}

fn write_descs(mem: &GuestMem, table: u64, first: u16, descs: &[Desc]) {
    if let Err(e) = DescTable::at(table).write(mem, first, descs) {
        panic!("fuzz generator wrote outside guest memory in the table at {table:#x}: {e}");
    }
}

fn write_slice(mem: &GuestMem, buf: &[u8], at: GuestAddress) {
    if let Err(e) = mem.write_slice(buf, at) {
        panic!("fuzz generator wrote outside guest memory at {at:?}: {e}");
    }
}

/// Reads the fuzz input front to back; past its end, everything is zero
/// (so a short input is still a complete, simple case).
pub(super) struct Input<'a>(pub(super) &'a [u8]);

impl Input<'_> {
    pub(super) fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | (u32::from(self.u16()) << 16)
    }

    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// A value in `0..n` (`n` > 0).
    pub(super) fn below(&mut self, n: u32) -> u32 {
        if n <= 256 {
            u32::from(self.byte()) % n
        } else {
            self.u32() % n
        }
    }

    /// True with probability about 1/`one_in` (a power of two up to 256).
    fn chance(&mut self, one_in: u32) -> bool {
        u32::from(self.byte()) % one_in == one_in - 1
    }
}
