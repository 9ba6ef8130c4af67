//! A heap buffer aligned for O_DIRECT: what the engines bounce a
//! misaligned request through, and what the disk's formats write a
//! cluster from with `--direct` (O_DIRECT needs aligned memory, offsets and
//! lengths).

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

/// Memory alignment we guarantee: a page, enough for any device's DMA.
pub const BOUNCE_ALIGN: usize = 4096;

/// A heap buffer aligned to [`BOUNCE_ALIGN`].
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes (len > 0). Returns None if the allocator fails.
    pub fn new(len: usize) -> Option<AlignedBuf> {
        let layout = Layout::from_size_align(len.max(1), BOUNCE_ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(AlignedBuf { ptr, layout })
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for layout.size() initialized (zeroed) bytes,
        // owned by self, and borrowed immutably for the slice's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, with a unique borrow of self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated with exactly this layout and is freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}
