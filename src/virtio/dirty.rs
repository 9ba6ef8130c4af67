//! The dirty-page log of guest memory, for live migration.
//!
//! The front-end hands over one log for all of guest memory
//! (SET_LOG_BASE): a bitmap with one bit per 4 KiB page of guest physical
//! address, set atomically, which it reads and clears as it copies pages.
//! [`LogRegion`] maps it. Each memory region's bitmap ([`DirtyLog`]) points
//! at it with the region's guest address: vm-memory marks every page
//! written through the region (used ring, status bytes), and the worker
//! marks what the engines wrote behind vm-memory's back.
//!
//! vhost-user-backend has a log of its own (`BitmapMmapRegion`), which we
//! do not use. It maps the front-end's file at whatever size the message
//! claims, unchecked: a file shorter than that (or one shrunk later) kills
//! the daemon with SIGBUS at the first mark past its end. And it gives a
//! bitmap over the log only to the regions of the memory table of that
//! moment, then forgets the log: a region added later (ADD_MEM_REG, or a
//! new SET_MEM_TABLE: memory hot-plugged during a migration) is created by
//! `NewBitmap::with_len`, which knows neither the log nor the region's
//! address, and logs nothing. So the relay answers SET_LOG_BASE itself
//! (`vhost::relay`), taking only a log that cannot shrink, and the device
//! points every region of every table it accepts at the log
//! (`vhost::backend`), as libvhost-user's one log per device does.
//!
//! A mark costs one relaxed load until a log is attached, and borrows the
//! region's bitmap rather than cloning it.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use vhost_user_backend::bitmap::BitmapReplace;
use vm_memory::bitmap::{Bitmap, RefSlice, WithBitmapSlice};
use vm_memory::mmap::NewBitmap;

/// The log's page size (VHOST_LOG_PAGE), whatever the host's.
pub const LOG_PAGE: u64 = 4096;
/// The largest log taken: one bit per page of 128 TiB of guest memory.
const MAX_LOG: u64 = 4 << 30;

/// The front-end's log, mapped.
#[derive(Debug)]
pub struct LogRegion {
    bits: NonNull<AtomicU8>,
    len: usize,
}

// SAFETY: the mapping belongs to this value alone (made in `map`, unmapped
// in `drop`); every access to it is an atomic operation on an `AtomicU8`
// within `len`, so any thread may make one.
unsafe impl Send for LogRegion {}
// SAFETY: as above: shared access is atomic operations only.
unsafe impl Sync for LogRegion {}

impl LogRegion {
    /// Maps `size` bytes of `file` from `offset` (SET_LOG_BASE). Refuses a
    /// file that could be shorter than that when a mark comes: one not
    /// sealed against shrinking (F_SEAL_SHRINK, as QEMU and
    /// cloud-hypervisor seal theirs), or whose mapping would run past its
    /// end. Either would kill the daemon with SIGBUS at a mark past the
    /// end.
    pub fn from_front_end(file: &File, size: u64, offset: u64) -> io::Result<LogRegion> {
        let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
        if size == 0 || size > MAX_LOG {
            return Err(invalid(format!(
                "a log of {size} bytes (at most {MAX_LOG})"
            )));
        }
        if !offset.is_multiple_of(LOG_PAGE) {
            return Err(invalid(format!("log offset {offset} is not page-aligned")));
        }
        // SAFETY: fcntl on an fd `file` keeps open; no pointers.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(invalid(
                "the log's file is not sealed against shrinking (F_SEAL_SHRINK)".into(),
            ));
        }
        let len = file.metadata()?.len();
        if offset.checked_add(size).is_none_or(|end| end > len) {
            return Err(invalid(format!(
                "a log of {size} bytes at offset {offset} runs past the end of its {len}-byte file"
            )));
        }
        let size = usize::try_from(size).map_err(|e| invalid(e.to_string()))?;
        let offset = libc::off_t::try_from(offset).map_err(|e| invalid(e.to_string()))?;
        // SAFETY: a fresh shared mapping (no MAP_FIXED) of `size` bytes of
        // a file at least `offset + size` long that cannot shrink (both
        // checked above), so every byte of it stays backed.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(LogRegion {
            bits: NonNull::new(p.cast()).ok_or_else(io::Error::last_os_error)?,
            len: size,
        })
    }

    /// Guest physical addresses below this have a bit in the log.
    pub fn covers(&self) -> u64 {
        (self.len as u64).saturating_mul(8 * LOG_PAGE)
    }

    /// The log's byte `i`, if it has one.
    fn byte(&self, i: u64) -> Option<&AtomicU8> {
        let i = usize::try_from(i).ok().filter(|&i| i < self.len)?;
        // SAFETY: `i` is within the mapping, which lives as long as `self`;
        // AtomicU8 has the size and alignment of a byte.
        Some(unsafe { &*self.bits.as_ptr().add(i) })
    }

    /// Marks the pages of `len` bytes at guest address `gpa`. Pages past
    /// the log's end (a front-end's log too short for its memory) are not
    /// marked.
    fn mark(&self, gpa: u64, len: usize) {
        if len == 0 {
            return;
        }
        let first = gpa / LOG_PAGE;
        let last = gpa.saturating_add(len as u64 - 1) / LOG_PAGE;
        for page in first..=last {
            let Some(byte) = self.byte(page / 8) else {
                return;
            };
            byte.fetch_or(1 << (page % 8), Ordering::Relaxed);
        }
    }

    fn dirty_at(&self, gpa: u64) -> bool {
        let page = gpa / LOG_PAGE;
        self.byte(page / 8)
            .is_some_and(|b| b.load(Ordering::Relaxed) & (1 << (page % 8)) != 0)
    }
}

impl Drop for LogRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `from_front_end`, of `len` bytes;
        // nothing borrows from it once its owner is gone.
        unsafe { libc::munmap(self.bits.as_ptr().cast(), self.len) };
    }
}

/// A region's dirty-page bitmap: nothing until the device attaches the
/// front-end's log to it ([`DirtyLog::attach`]).
#[derive(Clone, Debug, Default)]
pub struct DirtyLog(Arc<RegionLog>);

#[derive(Debug, Default)]
struct RegionLog {
    /// Whether `log` holds one: the mark path's one relaxed load.
    set: AtomicBool,
    log: RwLock<Option<Placed>>,
}

/// The log, and where the region is in guest memory.
#[derive(Debug)]
struct Placed {
    log: Arc<LogRegion>,
    gpa: u64,
}

impl DirtyLog {
    fn placed(&self) -> RwLockReadGuard<'_, Option<Placed>> {
        self.0.log.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks of the region, which starts at guest address `gpa`, go to
    /// `log` from now on (`None`: nowhere). A mark under way when this
    /// is called goes where it went before; this returns after it.
    pub fn attach(&self, log: Option<&Arc<LogRegion>>, gpa: u64) {
        let same = match (&*self.placed(), log) {
            (Some(p), Some(l)) => Arc::ptr_eq(&p.log, l) && p.gpa == gpa,
            (None, None) => true,
            _ => false,
        };
        if same {
            return;
        }
        let mut placed = self.0.log.write().unwrap_or_else(|p| p.into_inner());
        *placed = log.map(|l| Placed {
            log: l.clone(),
            gpa,
        });
        self.0.set.store(placed.is_some(), Ordering::Release);
    }
}

impl DirtyLog {
    /// [`Bitmap::mark_dirty`] with a log attached: out of line, so that
    /// the check before it is all that callers inline.
    #[cold]
    #[inline(never)]
    fn mark_attached(&self, offset: usize, len: usize) {
        if let Some(p) = &*self.placed() {
            p.log.mark(p.gpa.saturating_add(offset as u64), len);
        }
    }
}

impl Bitmap for DirtyLog {
    #[inline]
    fn mark_dirty(&self, offset: usize, len: usize) {
        if self.0.set.load(Ordering::Relaxed) {
            self.mark_attached(offset, len);
        }
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.0.set.load(Ordering::Relaxed)
            && self
                .placed()
                .as_ref()
                .is_some_and(|p| p.log.dirty_at(p.gpa.saturating_add(offset as u64)))
    }

    fn slice_at(&self, offset: usize) -> RefSlice<'_, Self> {
        RefSlice::new(self, offset)
    }
}

impl<'a> WithBitmapSlice<'a> for DirtyLog {
    type S = RefSlice<'a, Self>;
}

/// What vhost-user-backend asks of a bitmap; it would call `replace` on a
/// SET_LOG_BASE only, which the relay answers itself. (Given one, the
/// crate would fail to make its `()` bitmaps and refuse the message.)
impl BitmapReplace for DirtyLog {
    type InnerBitmap = ();

    fn replace(&self, _bitmap: ()) {}
}

impl NewBitmap for DirtyLog {
    fn with_len(_len: usize) -> Self {
        DirtyLog::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(len: u64, sealed: bool) -> File {
        // SAFETY: a NUL-terminated literal and valid flags; no other pointer.
        let fd = unsafe {
            libc::memfd_create(
                c"log-test".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        assert!(fd >= 0);
        // SAFETY: a fresh fd nobody else owns.
        let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.set_len(len).unwrap();
        if sealed {
            // SAFETY: fcntl with an int argument on our fd.
            let r = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
            assert_eq!(r, 0);
        }
        f
    }

    #[test]
    fn only_a_log_that_cannot_shrink_under_us_is_mapped() {
        let e = |f: &File, size, off| LogRegion::from_front_end(f, size, off).unwrap_err();
        assert!(LogRegion::from_front_end(&memfd(8192, true), 8192, 0).is_ok());
        assert!(LogRegion::from_front_end(&memfd(8192, true), 4096, 4096).is_ok());
        let unsealed = e(&memfd(8192, false), 8192, 0).to_string();
        assert!(unsealed.contains("not sealed"), "{unsealed}");
        let short = e(&memfd(4096, true), 8192, 0).to_string();
        assert!(short.contains("past the end"), "{short}");
        assert!(
            e(&memfd(8192, true), 4096, 8192)
                .to_string()
                .contains("past the end")
        );
        assert!(
            e(&memfd(8192, true), 4096, u64::MAX - 4095)
                .to_string()
                .contains("past the end")
        );
        assert!(e(&memfd(8192, true), 0, 0).to_string().contains("0 bytes"));
        assert!(
            e(&memfd(8192, true), 4096, 100)
                .to_string()
                .contains("aligned")
        );
        // A regular file has no seals.
        let f = tempfile::tempfile().unwrap();
        f.set_len(8192).unwrap();
        assert!(e(&f, 8192, 0).to_string().contains("not sealed"));
    }

    #[test]
    fn marks_land_at_the_regions_guest_address_and_stop_at_the_logs_end() {
        let log = Arc::new(LogRegion::from_front_end(&memfd(4096, true), 4096, 0).unwrap());
        assert_eq!(log.covers(), 4096 * 8 * LOG_PAGE);
        let region = DirtyLog::default();
        region.mark_dirty(0, 4096);
        assert!(!region.dirty_at(0), "marked with no log");
        // A region at guest address 1 MiB: its offset 0x1800, 8 KiB long,
        // covers guest pages 0x101..=0x103.
        region.attach(Some(&log), 1 << 20);
        region.mark_dirty(0x1800, 8192);
        for page in 0x101..=0x103u64 {
            assert!(log.dirty_at(page * LOG_PAGE), "page {page:#x}");
        }
        assert!(!log.dirty_at(0x100 * LOG_PAGE) && !log.dirty_at(0x104 * LOG_PAGE));
        assert!(region.dirty_at(0x1800) && !region.dirty_at(0x4000));
        // A slice marks at its own offset within the region.
        region.slice_at(0x10_0000).mark_dirty(0, 1);
        assert!(log.dirty_at((1 << 20) + 0x10_0000));
        // Past the log's end: nothing marked, nothing touched.
        let far = DirtyLog::default();
        far.attach(Some(&log), log.covers() - LOG_PAGE);
        far.mark_dirty(0, 3 * LOG_PAGE as usize);
        assert!(log.dirty_at(log.covers() - LOG_PAGE));
        // Detached: marks go nowhere.
        region.attach(None, 1 << 20);
        region.mark_dirty(0x8000, 1);
        assert!(!log.dirty_at((1 << 20) + 0x8000));
        // Clones share the attachment (vm-memory clones bitmaps freely).
        let clone = region.clone();
        region.attach(Some(&log), 0);
        clone.mark_dirty(0x9000, 1);
        assert!(log.dirty_at(0x9000));
    }
}
