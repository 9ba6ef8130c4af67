//! The dirty-page bitmap of guest memory regions, for live migration.
//!
//! vhost-user-backend's `BitmapMmapRegion` maps the front-end's log when
//! it sends SET_LOG_BASE; from then on, vm-memory marks every page written
//! through it. Used as the regions' bitmap directly, it costs the data path
//! even while no migration runs: a lock on every mark, and an `Arc` clone
//! for every slice of guest memory (each request translates several). A
//! [`DirtyLog`] wraps it: marks are one relaxed load until a log is set,
//! and slices borrow the region's bitmap instead of cloning it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use vhost_user_backend::bitmap::{BitmapMmapRegion, BitmapReplace};
use vm_memory::bitmap::{Bitmap, RefSlice, WithBitmapSlice};
use vm_memory::mmap::NewBitmap;

/// A region's dirty-page bitmap: nothing until the front-end sets a log.
#[derive(Clone, Debug, Default)]
pub struct DirtyLog {
    log: BitmapMmapRegion,
    /// Whether `log` has a log behind it. Shared by every clone, as `log`'s
    /// inner state is.
    set: Arc<AtomicBool>,
}

impl Bitmap for DirtyLog {
    fn mark_dirty(&self, offset: usize, len: usize) {
        if self.set.load(Ordering::Relaxed) {
            self.log.mark_dirty(offset, len);
        }
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.set.load(Ordering::Relaxed) && self.log.dirty_at(offset)
    }

    fn slice_at(&self, offset: usize) -> RefSlice<'_, Self> {
        RefSlice::new(self, offset)
    }
}

impl<'a> WithBitmapSlice<'a> for DirtyLog {
    type S = RefSlice<'a, Self>;
}

impl BitmapReplace for DirtyLog {
    type InnerBitmap = <BitmapMmapRegion as BitmapReplace>::InnerBitmap;

    /// SET_LOG_BASE: marks go to the front-end's log from now on.
    fn replace(&self, bitmap: Self::InnerBitmap) {
        self.log.replace(bitmap);
        self.set.store(true, Ordering::Release);
    }
}

impl NewBitmap for DirtyLog {
    fn with_len(_len: usize) -> Self {
        DirtyLog::default()
    }
}
