//! The virtio-blk configuration space and feature bits we offer.

use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use vm_memory::ByteValued;

use super::request::{DeviceLimits, MAX_RANGES};

/// `struct virtio_blk_config` (virtio 1.2, 5.2.4) up to and including
/// `write_zeroes_may_unmap` and its padding: the fields we fill. Secure
/// erase and zoned fields follow; we offer neither feature, so they read
/// as zero. Every field is little-endian in guest memory: [`VirtioBlkConfig::new`]
/// stores them so.
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VirtioBlkConfig {
    pub capacity: u64,
    pub size_max: u32,
    pub seg_max: u32,
    /// `struct virtio_blk_geometry` (cylinders le16, heads u8, sectors
    /// u8): not offered.
    pub geometry: [u8; 4],
    pub blk_size: u32,
    /// `struct virtio_blk_topology` (physical_block_exp, alignment_offset,
    /// min_io_size le16, opt_io_size le32): not offered.
    pub topology: [u8; 8],
    pub wce: u8,
    pub unused0: u8,
    pub num_queues: u16,
    pub max_discard_sectors: u32,
    pub max_discard_seg: u32,
    pub discard_sector_alignment: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_write_zeroes_seg: u32,
    pub write_zeroes_may_unmap: u8,
    pub unused1: [u8; 3],
}

// SAFETY: repr(C, packed) of integers and byte arrays only: no padding,
// and every bit pattern is a valid value.
unsafe impl ByteValued for VirtioBlkConfig {}

/// Bytes of the configuration space we define.
pub const CONFIG_LEN: usize = std::mem::size_of::<VirtioBlkConfig>();

impl VirtioBlkConfig {
    /// Offset of `wce`, the one field the driver may write
    /// (VIRTIO_BLK_F_CONFIG_WCE).
    pub const WCE_OFFSET: usize = std::mem::offset_of!(VirtioBlkConfig, wce);

    /// The configuration of a device with `limits`, `capacity_sectors`,
    /// `num_queues` queues and the write cache on (`writeback`) or off.
    pub fn new(
        limits: &DeviceLimits,
        capacity_sectors: u64,
        num_queues: u16,
        writeback: bool,
    ) -> VirtioBlkConfig {
        VirtioBlkConfig {
            capacity: capacity_sectors.to_le(),
            size_max: limits.size_max().to_le(),
            seg_max: limits.seg_max.to_le(),
            blk_size: limits.block_size.to_le(),
            wce: u8::from(writeback),
            num_queues: num_queues.to_le(),
            max_discard_sectors: limits.max_discard_sectors.to_le(),
            max_discard_seg: MAX_RANGES.to_le(),
            discard_sector_alignment: (limits.block_size >> super::SECTOR_SHIFT).to_le(),
            max_write_zeroes_sectors: limits.max_write_zeroes_sectors.to_le(),
            max_write_zeroes_seg: MAX_RANGES.to_le(),
            write_zeroes_may_unmap: 1,
            ..VirtioBlkConfig::default()
        }
    }

    /// Answers a GET_CONFIG read of `size` bytes at `offset`: bytes past
    /// what we define read as zero, and an out-of-range request (past the
    /// 4 KiB a configuration space may have) gets nothing.
    pub fn read(&self, offset: u32, size: u32) -> Vec<u8> {
        let space = self.as_slice();
        let (off, len) = (offset as usize, size as usize);
        match off.checked_add(len) {
            Some(end) if end <= 0x1000 => {
                let mut out = vec![0u8; len];
                if off < space.len() {
                    let n = (space.len() - off).min(len);
                    out[..n].copy_from_slice(&space[off..off + n]);
                }
                out
            }
            _ => Vec::new(),
        }
    }
}

/// Virtio feature bits offered to the driver.
pub fn device_features(readonly: bool) -> u64 {
    let mut f = (1u64 << VIRTIO_F_VERSION_1)
        | (1 << VIRTIO_RING_F_EVENT_IDX)
        | (1 << VIRTIO_RING_F_INDIRECT_DESC)
        | (1 << VIRTIO_BLK_F_SEG_MAX)
        | (1 << VIRTIO_BLK_F_SIZE_MAX)
        | (1 << VIRTIO_BLK_F_BLK_SIZE)
        | (1 << VIRTIO_BLK_F_FLUSH)
        | (1 << VIRTIO_BLK_F_CONFIG_WCE)
        | (1 << VIRTIO_BLK_F_MQ);
    if readonly {
        f |= 1 << VIRTIO_BLK_F_RO;
    } else {
        f |= (1 << VIRTIO_BLK_F_DISCARD) | (1 << VIRTIO_BLK_F_WRITE_ZEROES);
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> DeviceLimits {
        DeviceLimits {
            block_size: 4096,
            ..DeviceLimits::default()
        }
    }

    #[test]
    fn layout_matches_the_spec() {
        let l = limits();
        let cfg = VirtioBlkConfig::new(&l, 2048, 2, true);
        let c = cfg.as_slice();
        assert_eq!(c.len(), 60);
        assert_eq!(VirtioBlkConfig::WCE_OFFSET, 32);
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 2048);
        assert_eq!(u32::from_le_bytes(c[8..12].try_into().unwrap()), 128 << 10);
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), l.seg_max);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 4096);
        assert_eq!(c[32], 1);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 2);
        assert_eq!(u32::from_le_bytes(c[44..48].try_into().unwrap()), 8);
        assert_eq!(c[56], 1);
    }

    /// Whatever the queue size, seg_max segments of size_max bytes stay
    /// within what one request may carry.
    #[test]
    fn size_max_bounds_a_request() {
        use crate::virtio::request::MAX_DATA_BYTES;
        for seg_max in [1, 2, 30, 126, 254, 1000, 1024] {
            let l = DeviceLimits {
                seg_max,
                ..limits()
            };
            let size_max = l.size_max();
            assert_eq!(size_max % 4096, 0, "seg_max {seg_max}");
            assert!((4096..=1 << 20).contains(&size_max), "seg_max {seg_max}");
            assert!(
                u64::from(seg_max) * u64::from(size_max) <= u64::from(MAX_DATA_BYTES),
                "seg_max {seg_max}"
            );
        }
    }

    #[test]
    fn reads_past_the_end_are_zero() {
        let c = VirtioBlkConfig::new(&limits(), 2048, 1, false);
        let r = c.read(56, 8);
        assert_eq!(r, vec![1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(c.read(0x1000 - 4, 4), vec![0; 4]);
        assert!(c.read(0x1000 - 4, 5).is_empty());
        assert!(c.read(u32::MAX, 8).is_empty());
    }

    #[test]
    fn readonly_hides_write_features() {
        let f = device_features(true);
        assert_ne!(f & (1 << VIRTIO_BLK_F_RO), 0);
        assert_eq!(f & (1 << VIRTIO_BLK_F_DISCARD), 0);
    }
}
