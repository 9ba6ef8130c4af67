//! Writing split-ring descriptor chains into guest memory, as a driver
//! does: the one writer the unit tests, the integration tests, the
//! benchmarks and the fuzzer share. Built only for tests and with the
//! `test-utils` feature (like virtio-queue's `mock`); the daemon does not
//! link it.
//!
//! It writes what it is given. Nothing checks that a chain ends, that a
//! `next` stays inside its table, that an index is below the queue size or
//! that an indirect table's length is a multiple of 16: the hostile
//! front-end and the fuzzer write such chains on purpose. The one failure
//! is a write outside guest memory, returned as the memory's error.
//!
//! ```
//! use ringblk::virtio::chain_writer::{DescTable, indirect, readable, writable};
//! use vm_memory::{GuestAddress, GuestMemoryMmap};
//!
//! let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
//! // A read of one block: header, data, status at table indices 3, 4, 5.
//! let queue = DescTable::at(0);
//! let chain = [readable(0x1000, 16), writable(0x2000, 512), writable(0x3000, 1)];
//! assert_eq!(queue.write_chain(&mem, 3, &chain).unwrap(), 3);
//! // The same chain in an indirect table, named by descriptor 0.
//! DescTable::at(0x4000).write_chain(&mem, 0, &chain).unwrap();
//! queue.write(&mem, 0, &[indirect(0x4000, 3 * 16)]).unwrap();
//! ```

use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress};

/// `VRING_DESC_F_NEXT`: the chain goes on at `next`.
pub const NEXT: u16 = VRING_DESC_F_NEXT as u16;
/// `VRING_DESC_F_WRITE`: the device writes the buffer.
pub const WRITE: u16 = VRING_DESC_F_WRITE as u16;
/// `VRING_DESC_F_INDIRECT`: the buffer is a table of descriptors.
pub const INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;

/// Bytes of one descriptor, in a queue's table as in an indirect one.
pub const DESC_SIZE: u64 = 16;

/// One split-ring descriptor, field for field (virtio 1.2, 2.7.5). Any
/// value of any field can be written, flags the spec does not define
/// included.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    /// Table index of the next descriptor; read only with `NEXT`.
    pub next: u16,
}

/// A device-readable buffer.
pub fn readable(addr: u64, len: u32) -> Desc {
    Desc {
        addr,
        len,
        flags: 0,
        next: 0,
    }
}

/// A device-writable buffer.
pub fn writable(addr: u64, len: u32) -> Desc {
    Desc {
        flags: WRITE,
        ..readable(addr, len)
    }
}

/// A descriptor naming an indirect table at `table` of `len` bytes:
/// `DESC_SIZE` per entry for a well-formed one, anything for one that is
/// not.
pub fn indirect(table: u64, len: u32) -> Desc {
    Desc {
        flags: INDIRECT,
        ..readable(table, len)
    }
}

impl Desc {
    /// This descriptor with `NEXT` set, chaining to table index `to`
    /// (which may be anywhere: itself, an earlier entry, past the table).
    pub fn with_next(self, to: u16) -> Desc {
        Desc {
            flags: self.flags | NEXT,
            next: to,
            ..self
        }
    }

    pub fn is_writable(&self) -> bool {
        self.flags & WRITE != 0
    }

    /// The 16 bytes of this descriptor as they lie in a table (the ring is
    /// little-endian).
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..14].copy_from_slice(&self.flags.to_le_bytes());
        b[14..16].copy_from_slice(&self.next.to_le_bytes());
        b
    }
}

impl From<Desc> for Descriptor {
    fn from(d: Desc) -> Descriptor {
        Descriptor::new(d.addr, d.len, d.flags, d.next)
    }
}

/// `descs` as one chain whose first entry sits at table index `first`:
/// every entry but the last gets `NEXT` and the index after its own
/// (wrapping at 2^16, as the field does). The last keeps its flags and
/// `next` as given, so a test can make it point anywhere
/// (`with_next`); from `readable`/`writable` it ends the chain.
pub fn link(descs: &[Desc], first: u16) -> Vec<Desc> {
    let n = descs.len();
    descs
        .iter()
        .enumerate()
        .map(|(k, &d)| {
            if k + 1 < n {
                // Truncation is the point: indices wrap like the u16 field.
                d.with_next(first.wrapping_add(k as u16).wrapping_add(1))
            } else {
                d
            }
        })
        .collect()
}

/// A descriptor table in guest memory: a queue's, or an indirect table
/// (which is written from index 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DescTable(pub GuestAddress);

impl DescTable {
    /// The table at guest address `addr`.
    pub fn at(addr: u64) -> DescTable {
        DescTable(GuestAddress(addr))
    }

    /// Writes `descs` exactly as given (flags and `next` untouched) at
    /// indices `first`, `first + 1`, ... There is no table size: an index
    /// past the queue's is written like any other.
    ///
    /// # Panics
    /// If an entry's address does not fit in 64 bits.
    pub fn write<M: Bytes<GuestAddress> + ?Sized>(
        &self,
        mem: &M,
        first: u16,
        descs: &[Desc],
    ) -> Result<(), M::E> {
        for (k, d) in descs.iter().enumerate() {
            let index = u64::from(first) + k as u64;
            let at = index
                .checked_mul(DESC_SIZE)
                .and_then(|off| self.0.0.checked_add(off))
                .unwrap_or_else(|| panic!("entry {index} of a table at {:#x}", self.0.0));
            mem.write_obj(Descriptor::from(*d), GuestAddress(at))?;
        }
        Ok(())
    }

    /// Writes `descs` as one chain (`link`) from index `first`; returns its
    /// head, `first`.
    ///
    /// # Panics
    /// As [`DescTable::write`].
    pub fn write_chain<M: Bytes<GuestAddress> + ?Sized>(
        &self,
        mem: &M,
        first: u16,
        descs: &[Desc],
    ) -> Result<u16, M::E> {
        self.write(mem, first, &link(descs, first))?;
        Ok(first)
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::GuestMemoryMmap;

    use super::*;

    fn mem() -> GuestMemoryMmap<()> {
        // Two regions with a hole between them.
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1000), (GuestAddress(0x2000), 0x1000)])
            .unwrap()
    }

    fn read(mem: &GuestMemoryMmap<()>, table: u64, index: u64) -> Descriptor {
        mem.read_obj(GuestAddress(table + DESC_SIZE * index))
            .unwrap()
    }

    #[test]
    fn a_chain_reads_back_as_virtio_queue_sees_it() {
        let mem = mem();
        let chain = [
            readable(0x100, 16),
            writable(0x200, 512),
            writable(0x300, 1),
        ];
        assert_eq!(
            DescTable::at(0x800).write_chain(&mem, 5, &chain).unwrap(),
            5
        );
        let got: Vec<_> = (5..8).map(|i| read(&mem, 0x800, i)).collect();
        assert_eq!(
            got.iter()
                .map(|d| (d.addr().0, d.len(), d.flags(), d.next()))
                .collect::<Vec<_>>(),
            [
                (0x100, 16, NEXT, 6),
                (0x200, 512, WRITE | NEXT, 7),
                (0x300, 1, WRITE, 0)
            ]
        );
        assert!(got[1].is_write_only() && got[1].has_next());
        assert!(!got[2].has_next());
        // The bytes are the descriptor's own.
        let mut b = [0u8; 16];
        mem.read_slice(&mut b, GuestAddress(0x800 + 16 * 6))
            .unwrap();
        assert_eq!(b, link(&chain, 5)[1].to_bytes());
    }

    #[test]
    fn link_wraps_and_keeps_the_last_entry() {
        let looped = [readable(1, 1), writable(2, 2).with_next(0xffff)];
        assert_eq!(
            link(&looped, 0xffff),
            [
                readable(1, 1).with_next(0),
                writable(2, 2).with_next(0xffff)
            ]
        );
        assert_eq!(link(&[], 3), []);
        assert_eq!(
            indirect(0x40, 24),
            Desc {
                addr: 0x40,
                len: 24,
                flags: INDIRECT,
                next: 0
            }
        );
    }

    #[test]
    fn wrong_chains_are_written_as_given() {
        let mem = mem();
        // Past any queue size, a loop onto itself, flags nobody defines.
        let odd = Desc {
            addr: u64::MAX,
            len: u32::MAX,
            flags: 0xfff8 | INDIRECT | WRITE,
            next: 0,
        }
        .with_next(200);
        DescTable::at(0).write(&mem, 200, &[odd]).unwrap();
        assert_eq!(read(&mem, 0, 200).next(), 200);
        assert_eq!(read(&mem, 0, 200).flags(), odd.flags);
    }

    #[test]
    fn only_memory_refuses() {
        let mem = mem();
        let two = [readable(0, 1), readable(0, 1)];
        // The second entry falls into the hole.
        assert!(DescTable::at(0x1000 - 16).write(&mem, 0, &two).is_err());
        assert!(DescTable::at(0x1800).write(&mem, 0, &two).is_err());
        assert!(DescTable::at(0x2000).write(&mem, 0, &two).is_ok());
    }
}
