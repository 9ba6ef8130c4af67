//! Inflight I/O tracking (VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD), split ring.
//!
//! A shared-memory log, kept by the front-end across back-end restarts, of
//! which descriptor chains the back-end took off the avail ring and has not
//! yet put on the used ring. Layout and protocol are the vhost-user spec's
//! ("Inflight I/O tracking"), per queue:
//!
//! ```text
//! le64 features; le16 version; le16 desc_num; le16 last_batch_head; le16 used_idx;
//! struct { u8 inflight; u8 pad[5]; le16 next; le64 counter; } desc[queue_size];
//! ```
//!
//! - popping head `h`: `desc[h].counter = counter++`, `desc[h].inflight = 1`;
//! - publishing a batch: link its heads through `next` from
//!   `last_batch_head`, store used->idx, clear their `inflight`, then set
//!   `used_idx`;
//! - recovering: if `used_idx` lags used->idx the last batch was published
//!   but not cleared: clear it; then resubmit every `inflight` head in
//!   counter order, and resume the avail ring at used->idx + inflight count.
//!
//! The region's content comes from a previous process or the front-end, so
//! it is read as untrusted: heads are bounds-checked, sizes come from us,
//! a head the ring cannot have is dropped, and counters are renumbered on
//! recovery, so none can overflow or be out of order afterwards.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::ptr::NonNull;
use std::sync::Arc;

const HEADER: usize = 16;
const DESC: usize = 16;
const ALIGN: usize = 64;
const VERSION: u16 = 1;

/// Bytes of one queue's part of the region.
pub fn queue_region_size(queue_size: u16) -> usize {
    (HEADER + DESC * usize::from(queue_size)).div_ceil(ALIGN) * ALIGN
}

/// A mapping of the inflight region shared with the front-end.
#[derive(Debug)]
pub struct InflightRegion {
    ptr: NonNull<u8>,
    size: usize,
    /// Kept so the memfd can be handed out again.
    pub file: File,
    pub num_queues: u16,
    pub queue_size: u16,
}

// SAFETY: the mapping is plain shared memory; all access goes through
// volatile loads/stores at checked offsets, and each queue's part is
// written by only that queue's worker.
unsafe impl Send for InflightRegion {}
// SAFETY: as above.
unsafe impl Sync for InflightRegion {}

impl InflightRegion {
    /// Creates a zeroed, sealed memfd region (GET_INFLIGHT_FD).
    pub fn create(num_queues: u16, queue_size: u16) -> io::Result<InflightRegion> {
        let size = queue_region_size(queue_size) * usize::from(num_queues);
        // SAFETY: the name is a NUL-terminated literal; flags are valid.
        let fd = unsafe {
            libc::memfd_create(
                c"ringblk-inflight".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor we own.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size as u64)?;
        let seals = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on an fd we own, with an int argument.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Self::map(file, size, 0, num_queues, queue_size)
    }

    /// Maps a region handed over by the front-end (SET_INFLIGHT_FD).
    /// Refuses one that could shrink under us (SIGBUS) or is too small.
    pub fn from_front_end(
        file: File,
        mmap_size: u64,
        offset: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> io::Result<InflightRegion> {
        let need = queue_region_size(queue_size) * usize::from(num_queues);
        let invalid = |m: &str| io::Error::new(io::ErrorKind::InvalidInput, m.to_string());
        if num_queues == 0 || !queue_size.is_power_of_two() {
            return Err(invalid("bad queue count or size"));
        }
        if (mmap_size as usize) < need || !offset.is_multiple_of(4096) {
            return Err(invalid("region too small or misaligned"));
        }
        // SAFETY: fcntl on an fd we own.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(invalid("region is not sealed against shrinking"));
        }
        let len = file.metadata()?.len();
        if offset.checked_add(need as u64).is_none_or(|end| end > len) {
            return Err(invalid("region beyond the end of its file"));
        }
        Self::map(file, need, offset, num_queues, queue_size)
    }

    fn map(
        file: File,
        size: usize,
        offset: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> io::Result<InflightRegion> {
        // SAFETY: a fresh shared mapping of `size` bytes of an fd whose
        // length we checked (or set) and that cannot shrink (sealed).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(InflightRegion {
            ptr: NonNull::new(p.cast()).ok_or_else(io::Error::last_os_error)?,
            size,
            file,
            num_queues,
            queue_size,
        })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn load<T: Copy>(&self, off: usize) -> T {
        assert!(off + size_of::<T>() <= self.size && off.is_multiple_of(align_of::<T>()));
        // SAFETY: in bounds and aligned (checked above) within our mapping.
        unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(off).cast::<T>()) }
    }

    fn store<T: Copy>(&self, off: usize, v: T) {
        assert!(off + size_of::<T>() <= self.size && off.is_multiple_of(align_of::<T>()));
        // SAFETY: in bounds and aligned (checked above) within our mapping.
        unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(off).cast::<T>(), v) }
    }
}

#[cfg(test)]
impl InflightRegion {
    /// The pop counter logged for `head` of queue `q` (0: never logged).
    pub fn logged_counter(&self, q: u16, head: u16) -> u64 {
        let d =
            queue_region_size(self.queue_size) * usize::from(q) + HEADER + DESC * usize::from(head);
        u64::from_le(self.load(d + 8))
    }
}

impl Drop for InflightRegion {
    fn drop(&mut self) {
        // SAFETY: we mapped exactly this range and unmap it once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.size) };
    }
}

/// One queue's view of the region, owned by that queue's worker.
#[derive(Debug)]
pub struct InflightQueue {
    region: Arc<InflightRegion>,
    base: usize,
    desc_num: u16,
    counter: u64,
}

/// What recovery found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Heads to resubmit, oldest first: each below the ring's size, each
    /// once.
    pub resubmit: Vec<u16>,
    /// Heads marked in flight that the ring cannot have (at or above its
    /// size): garbage, cleared from the log and not resubmitted.
    pub beyond_ring: usize,
}

impl InflightQueue {
    pub fn new(region: Arc<InflightRegion>, index: u16) -> Option<InflightQueue> {
        (index < region.num_queues).then(|| InflightQueue {
            base: queue_region_size(region.queue_size) * usize::from(index),
            desc_num: region.queue_size,
            region,
            counter: 0,
        })
    }

    /// The queue size the region is laid out for.
    pub fn desc_num(&self) -> u16 {
        self.desc_num
    }

    fn desc(&self, head: u16) -> Option<usize> {
        (head < self.desc_num).then(|| self.base + HEADER + DESC * usize::from(head))
    }

    /// Records that `head` was taken off the avail ring.
    pub fn mark(&mut self, head: u16) {
        if let Some(d) = self.desc(head) {
            // From at most 32768 after recovery, one per request taken:
            // 2^64 is out of reach.
            self.counter += 1;
            self.region.store(d + 8, self.counter.to_le());
            std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::Release);
            self.region.store(d, 1u8);
        }
    }

    /// Before used->idx is stored: remember the batch, so a crash between
    /// the store and the clearing can be repaired.
    pub fn before_publish(&self, heads: &[u16]) {
        let Some(&first) = heads.first() else { return };
        for w in heads.windows(2) {
            if let Some(d) = self.desc(w[0]) {
                self.region.store(d + 6, w[1].to_le());
            }
        }
        std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::Release);
        self.region.store(self.base + 12, first.to_le());
    }

    /// After used->idx was stored as `used_idx`: the batch is done.
    pub fn after_publish(&self, heads: &[u16], used_idx: u16) {
        for &h in heads {
            if let Some(d) = self.desc(h) {
                self.region.store(d, 0u8);
            }
        }
        std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::Release);
        self.region.store(self.base + 14, used_idx.to_le());
    }

    /// Repairs the log against the ring's `used_idx` and returns what must
    /// be resubmitted on a ring of `ring_size` (at most the region's queue
    /// size). A zero version means a fresh region (new VM or device reset):
    /// nothing to recover.
    ///
    /// The heads to resubmit are renumbered 1..=n in their order, and the
    /// next request taken is n + 1, whatever the counters were (u64::MAX
    /// one included). A crash while renumbering keeps the order of a log
    /// this module wrote: its k-th oldest head has a counter of at least k.
    pub fn recover(&mut self, used_idx: u16, ring_size: u16) -> Recovery {
        let r = &self.region;
        if u16::from_le(r.load(self.base + 8)) != VERSION {
            r.store(self.base + 10, self.desc_num.to_le());
            r.store(self.base + 8, VERSION.to_le());
            return Recovery::default();
        }
        let logged: u16 = u16::from_le(r.load(self.base + 14));
        if logged != used_idx {
            // The last batch reached the used ring but was not cleared.
            let mut head = u16::from_le(r.load(self.base + 12));
            for _ in 0..used_idx.wrapping_sub(logged).min(self.desc_num) {
                let Some(d) = self.desc(head) else { break };
                r.store(d, 0u8);
                head = u16::from_le(r.load(d + 6));
            }
            r.store(self.base + 14, used_idx.to_le());
        }
        let mut found: Vec<(u64, u16)> = Vec::new();
        let mut beyond_ring = 0;
        for h in 0..self.desc_num {
            let Some(d) = self.desc(h) else { break };
            if r.load::<u8>(d) != 1 {
                continue;
            }
            if h >= ring_size {
                r.store(d, 0u8);
                beyond_ring += 1;
                continue;
            }
            found.push((u64::from_le(r.load(d + 8)), h));
        }
        // Ties (garbage) go by head, so the order is the same every time.
        found.sort_unstable();
        for (n, &(_, h)) in (1u64..).zip(&found) {
            if let Some(d) = self.desc(h) {
                r.store(d + 8, n.to_le());
            }
        }
        self.counter = found.len() as u64;
        Recovery {
            resubmit: found.into_iter().map(|(_, h)| h).collect(),
            beyond_ring,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> InflightQueue {
        let region = Arc::new(InflightRegion::create(2, 8).unwrap());
        InflightQueue::new(region, 1).unwrap()
    }

    #[test]
    fn fresh_region_recovers_nothing_and_gets_a_version() {
        let mut q = queue();
        assert_eq!(q.recover(0, 8), Recovery::default());
        assert_eq!(u16::from_le(q.region.load(q.base + 8)), VERSION);
        assert_eq!(q.recover(0, 8), Recovery::default());
    }

    #[test]
    fn resubmits_unfinished_heads_in_pop_order() {
        let mut q = queue();
        q.recover(0, 8);
        for h in [5, 2, 7, 0] {
            q.mark(h);
        }
        // 2 and 0 completed in one batch: used->idx went 0 -> 2.
        q.before_publish(&[2, 0]);
        q.after_publish(&[2, 0], 2);
        let mut after_crash = InflightQueue::new(q.region.clone(), 1).unwrap();
        assert_eq!(after_crash.recover(2, 8).resubmit, vec![5, 7]);
        // New marks continue after the old counter.
        after_crash.mark(3);
        assert_eq!(after_crash.recover(2, 8).resubmit, vec![5, 7, 3]);
    }

    #[test]
    fn repairs_a_batch_published_but_not_cleared() {
        let mut q = queue();
        q.recover(0, 8);
        for h in [1, 4, 6] {
            q.mark(h);
        }
        // Crash between the used->idx store (now 2) and the clearing.
        q.before_publish(&[4, 1]);
        let mut after_crash = InflightQueue::new(q.region.clone(), 1).unwrap();
        assert_eq!(after_crash.recover(2, 8).resubmit, vec![6]);
    }

    /// A counter of u64::MAX (from garbage, or a very long-lived log) used
    /// to overflow on the next request taken: a panic in a debug build, a
    /// counter of 0 (oldest) in a release one.
    #[test]
    fn counters_start_over_on_recovery() {
        let mut q = queue();
        q.recover(0, 8);
        q.mark(3);
        q.mark(1);
        let d = q.desc(3).unwrap();
        q.region.store(d + 8, u64::MAX.to_le());
        let mut after_crash = InflightQueue::new(q.region.clone(), 1).unwrap();
        assert_eq!(after_crash.recover(0, 8).resubmit, vec![1, 3]);
        assert_eq!(q.region.logged_counter(1, 1), 1);
        assert_eq!(q.region.logged_counter(1, 3), 2);
        after_crash.mark(5);
        assert_eq!(q.region.logged_counter(1, 5), 3);
        let mut again = InflightQueue::new(q.region.clone(), 1).unwrap();
        assert_eq!(again.recover(0, 8).resubmit, vec![1, 3, 5]);
    }

    /// A head the ring cannot have (the region is laid out for larger
    /// queues than the ring) is not resubmitted, and leaves the log.
    #[test]
    fn heads_beyond_the_ring_are_dropped() {
        let mut q = queue();
        q.recover(0, 8);
        for h in [6, 2, 7, 0] {
            q.mark(h);
        }
        let mut after_crash = InflightQueue::new(q.region.clone(), 1).unwrap();
        let rec = after_crash.recover(0, 4);
        assert_eq!(rec.resubmit, vec![2, 0]);
        assert_eq!(rec.beyond_ring, 2);
        let mut again = InflightQueue::new(q.region.clone(), 1).unwrap();
        assert_eq!(again.recover(0, 8).resubmit, vec![2, 0]);
    }

    /// Whatever the region holds, recovery and the log's use afterwards
    /// neither panic nor name a head twice or one beyond the ring.
    #[test]
    fn garbage_regions_recover_without_panicking() {
        let region = Arc::new(InflightRegion::create(1, 64).unwrap());
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..200 {
            for off in (0..region.size()).step_by(8) {
                region.store(off, next());
            }
            region.store(8, VERSION.to_le());
            // Some heads in flight, some of those with extreme counters.
            for h in 0..64u16 {
                let d = HEADER + DESC * usize::from(h);
                if next() % 3 == 0 {
                    region.store(d, 1u8);
                    let c = match next() % 4 {
                        0 => u64::MAX,
                        1 => 0,
                        _ => next(),
                    };
                    region.store(d + 8, c);
                }
            }
            let ring = [64u16, 32, 1][round % 3];
            let used = next() as u16;
            let mut q = InflightQueue::new(region.clone(), 0).unwrap();
            let rec = q.recover(used, ring);
            let mut seen = rec.resubmit.clone();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), rec.resubmit.len(), "a head twice");
            assert!(rec.resubmit.iter().all(|&h| h < ring));
            for &h in &rec.resubmit {
                q.mark(h);
            }
            q.before_publish(&rec.resubmit);
            q.after_publish(&rec.resubmit, used.wrapping_add(rec.resubmit.len() as u16));
        }
    }

    #[test]
    fn untrusted_front_end_regions_are_checked() {
        let r = InflightRegion::create(1, 8).unwrap();
        let f = r.file.try_clone().unwrap();
        assert!(
            InflightRegion::from_front_end(f.try_clone().unwrap(), r.size() as u64, 0, 1, 8)
                .is_ok()
        );
        assert!(
            InflightRegion::from_front_end(f.try_clone().unwrap(), r.size() as u64, 0, 4, 8)
                .is_err()
        );
        let unsealed = tempfile::tempfile().unwrap();
        unsealed.set_len(4096).unwrap();
        assert!(InflightRegion::from_front_end(unsealed, 4096, 0, 1, 8).is_err());
        assert!(InflightQueue::new(Arc::new(r), 1).is_none());
    }
}
