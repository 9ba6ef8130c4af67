//! The virtio-blk configuration space and feature bits we offer.

use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use super::request::{DeviceLimits, MAX_RANGES};

/// Bytes of `struct virtio_blk_config` we fill: everything up to and
/// including `write_zeroes_may_unmap` and its padding. Secure erase and
/// zoned fields follow; we offer neither feature, so they read as zero.
pub const CONFIG_LEN: usize = 60;

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

/// Serializes the configuration space, little-endian, at the offsets of
/// `struct virtio_blk_config` in the virtio 1.2 spec (5.2.4).
pub fn config_space(limits: &DeviceLimits, num_queues: u16, writeback: bool) -> [u8; CONFIG_LEN] {
    let mut c = [0u8; CONFIG_LEN];
    let mut put = |off: usize, bytes: &[u8]| c[off..off + bytes.len()].copy_from_slice(bytes);
    put(0, &limits.capacity_sectors.to_le_bytes()); // capacity
    put(8, &limits.size_max().to_le_bytes()); // size_max
    put(12, &limits.seg_max.to_le_bytes()); // seg_max
    put(20, &limits.block_size.to_le_bytes()); // blk_size
    put(32, &[u8::from(writeback)]); // wce
    put(34, &num_queues.to_le_bytes()); // num_queues
    let align = limits.block_size >> super::SECTOR_SHIFT;
    put(36, &limits.max_discard_sectors.to_le_bytes());
    put(40, &MAX_RANGES.to_le_bytes()); // max_discard_seg
    put(44, &align.to_le_bytes()); // discard_sector_alignment
    put(48, &limits.max_write_zeroes_sectors.to_le_bytes());
    put(52, &MAX_RANGES.to_le_bytes()); // max_write_zeroes_seg
    put(56, &[1]); // write_zeroes_may_unmap
    c
}

/// Answers a GET_CONFIG read of `size` bytes at `offset`: bytes past what
/// we define read as zero, and an out-of-range request gets nothing.
pub fn read_config(space: &[u8], offset: u32, size: u32) -> Vec<u8> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> DeviceLimits {
        DeviceLimits {
            capacity_sectors: 2048,
            block_size: 4096,
            ..DeviceLimits::default()
        }
    }

    #[test]
    fn layout_matches_the_spec() {
        let l = limits();
        let c = config_space(&l, 2, true);
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
        let c = config_space(&limits(), 1, false);
        let r = read_config(&c, 56, 8);
        assert_eq!(r, vec![1, 0, 0, 0, 0, 0, 0, 0]);
        assert!(read_config(&c, u32::MAX, 8).is_empty());
    }

    #[test]
    fn readonly_hides_write_features() {
        let f = device_features(true);
        assert_ne!(f & (1 << VIRTIO_BLK_F_RO), 0);
        assert_eq!(f & (1 << VIRTIO_BLK_F_DISCARD), 0);
    }
}
