//! A request's data buffers: host iovecs into guest memory, held together
//! with the memory snapshot they point into (after cloud-hypervisor's
//! `GuestMemoryTarget`).
//!
//! The iovecs are private and only [`GuestBuffers::translate`] makes them,
//! from guest addresses checked against the snapshot it is given and then
//! holds. So for as long as a `GuestBuffers` lives, every iovec lies
//! inside a region that is mapped: an engine may hand them to the kernel,
//! and the copies below are sound. Safe code cannot make one that points
//! anywhere else.

use std::sync::Arc;

use vm_memory::bitmap::Bitmap;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::{GuestMem, RequestError};

/// Data buffers in guest memory, and the memory they are in.
#[derive(Debug)]
pub struct GuestBuffers {
    /// Each lies inside one region of `mem` (checked by `translate`), or,
    /// for buffers made by [`GuestBuffers::private`], in memory its caller
    /// owns.
    iovecs: Vec<libc::iovec>,
    /// Their total length.
    len: u32,
    /// Keeps every region the iovecs point into mapped.
    mem: Arc<GuestMem>,
}

// SAFETY: the iovecs are plain addresses into `mem`, which is itself Send
// and Sync and travels with them (or into private memory whose owner
// keeps it valid while they live: `GuestBuffers::private`); moving the
// whole to another thread changes neither what they point to nor that it
// stays mapped.
unsafe impl Send for GuestBuffers {}
// SAFETY: shared references only read the addresses; the memory behind
// them is guest memory, shared with the guest in any case (or a private
// buffer, which nothing writes while the buffers live:
// `GuestBuffers::private`).
unsafe impl Sync for GuestBuffers {}

/// Emptied iovec vectors kept for reuse, at most `max`: so that making
/// buffers allocates nothing once warm (the parser's requests, the engine
/// core's staged writes).
#[derive(Debug, Default)]
pub struct SpareIovecs {
    spares: Vec<Vec<libc::iovec>>,
    max: usize,
}

// SAFETY: the vectors kept are empty (`give` clears them): they point to
// nothing.
unsafe impl Send for SpareIovecs {}

impl SpareIovecs {
    /// Keeps at most `max` vectors.
    pub const fn new(max: usize) -> SpareIovecs {
        SpareIovecs {
            spares: Vec::new(),
            max,
        }
    }

    /// A vector to fill (empty; new when none is kept).
    #[inline]
    pub fn take(&mut self) -> Vec<libc::iovec> {
        self.spares.pop().unwrap_or_default()
    }

    /// Keeps `v`, emptied, unless `max` are kept already.
    #[inline]
    pub fn give(&mut self, mut v: Vec<libc::iovec>) {
        if self.spares.len() < self.max {
            v.clear();
            self.spares.push(v);
        }
    }

    /// Keeps the vector of `buffers`, which are done with.
    #[inline]
    pub fn give_buffers(&mut self, buffers: GuestBuffers) {
        if self.spares.len() < self.max {
            self.spares.push(buffers.into_vec());
        }
    }
}

impl GuestBuffers {
    /// Translates the guest ranges `(addr, len)` of `bufs` into host
    /// iovecs, one per contiguous piece of a memory region, in `iovecs`
    /// (cleared first: a recycled vector). Fails on any byte outside guest
    /// memory, giving the vector back.
    pub(super) fn translate(
        mem: &Arc<GuestMem>,
        bufs: impl Iterator<Item = (GuestAddress, u32)>,
        mut iovecs: Vec<libc::iovec>,
    ) -> Result<GuestBuffers, (RequestError, Vec<libc::iovec>)> {
        iovecs.clear();
        let mut len = 0u32;
        for (addr, n) in bufs {
            // Most buffers lie in one region: one lookup.
            if let Some(slice) = (n > 0)
                .then(|| mem.get_slice(addr, n as usize).ok())
                .flatten()
            {
                iovecs.push(libc::iovec {
                    iov_base: slice.ptr_guard_mut().as_ptr().cast(),
                    iov_len: slice.len(),
                });
                len = len.saturating_add(n);
                continue;
            }
            for slice in GuestMemoryBackend::get_slices(&**mem, addr, n as usize) {
                let Ok(slice) = slice else {
                    return Err((RequestError::BadAddress, iovecs));
                };
                iovecs.push(libc::iovec {
                    iov_base: slice.ptr_guard_mut().as_ptr().cast(),
                    iov_len: slice.len(),
                });
            }
            // The parser bounds a request's data far below 4 GiB.
            len = len.saturating_add(n);
        }
        Ok(GuestBuffers {
            iovecs,
            len,
            mem: mem.clone(),
        })
    }

    /// No buffers (flush, discard, ...): the request still holds `mem`,
    /// where its status byte goes.
    pub(super) fn none(mem: &Arc<GuestMem>, iovecs: Vec<libc::iovec>) -> GuestBuffers {
        let mut iovecs = iovecs;
        iovecs.clear();
        GuestBuffers {
            iovecs,
            len: 0,
            mem: mem.clone(),
        }
    }

    /// Buffers over `len` bytes of private memory at `ptr` (not the
    /// guest's): an encrypted disk's staged ciphertext, which the engine
    /// writes as it would a guest buffer. `mem` is the request's snapshot
    /// (held, as any buffers hold theirs); `iovecs` a vector to reuse
    /// (its contents are dropped), so that none is allocated.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must stay valid, and not be written, for as long
    /// as these buffers (and any I/O started over them) live; the caller
    /// owns the memory and keeps it until then.
    pub unsafe fn private(
        mem: &Arc<GuestMem>,
        mut iovecs: Vec<libc::iovec>,
        ptr: *const u8,
        len: u32,
    ) -> GuestBuffers {
        iovecs.clear();
        iovecs.push(libc::iovec {
            iov_base: ptr.cast_mut().cast(),
            iov_len: len as usize,
        });
        GuestBuffers {
            iovecs,
            len,
            mem: mem.clone(),
        }
    }

    /// The iovecs, for the kernel (or librbd). They stay valid while
    /// `self` lives.
    pub fn iovecs(&self) -> &[libc::iovec] {
        &self.iovecs
    }

    /// Total bytes.
    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memory snapshot the buffers (and their request's status byte)
    /// are in.
    pub fn mem(&self) -> &Arc<GuestMem> {
        &self.mem
    }

    /// The iovec vector, emptied, for the next request to reuse.
    fn into_vec(self) -> Vec<libc::iovec> {
        let mut v = self.iovecs;
        v.clear();
        v
    }

    /// Copies `src` into the buffers, as far as they reach.
    pub fn fill_from(&self, src: &[u8]) {
        let mut off = 0;
        for v in &self.iovecs {
            if off == src.len() {
                break;
            }
            let n = v.iov_len.min(src.len() - off);
            // SAFETY: `v` lies inside a region of `self.mem`, mapped while
            // `self` holds it (see `translate`); `src` holds at least
            // `off + n` bytes. The guest may touch these bytes at the same
            // time: guest memory is shared with it, as everywhere a device
            // writes into it.
            unsafe {
                std::ptr::copy_nonoverlapping(src[off..].as_ptr(), v.iov_base.cast::<u8>(), n)
            };
            off += n;
        }
    }

    /// Zero-fills the buffers.
    pub fn zero(&self) {
        for v in &self.iovecs {
            // SAFETY: as in `fill_from`, for `iov_len` bytes.
            unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len) };
        }
    }

    /// Copies the buffers, one after the other, into `dst`, as far as it
    /// reaches.
    pub fn gather_into(&self, dst: &mut [u8]) {
        let mut off = 0;
        for v in &self.iovecs {
            if off == dst.len() {
                break;
            }
            let n = v.iov_len.min(dst.len() - off);
            // SAFETY: as in `fill_from`; `dst` has room for `n` more bytes
            // at `off`.
            unsafe {
                std::ptr::copy_nonoverlapping(v.iov_base.cast::<u8>(), dst[off..].as_mut_ptr(), n)
            };
            off += n;
        }
    }

    /// The `len` bytes from byte `from` of the buffers, as buffers of their
    /// own (in the same memory), for I/O on part of a request: a request
    /// whose range an image format splits across places. `from + len` must
    /// not pass [`GuestBuffers::len`]; what would is cut off.
    pub fn slice(&self, from: u32, len: u32) -> GuestBuffers {
        let mut iovecs = Vec::new();
        let got = slice_iovecs(&self.iovecs, from as usize, len as usize, &mut iovecs);
        GuestBuffers {
            iovecs,
            len: got as u32,
            mem: self.mem.clone(),
        }
    }

    /// Copies `src` into the buffers from byte `at` on, as far as they
    /// reach.
    pub fn fill_at(&self, at: u32, src: &[u8]) {
        self.slice(at, src.len() as u32).fill_from(src);
    }

    /// Zero-fills `len` bytes of the buffers from byte `at` on.
    pub fn zero_at(&self, at: u32, len: u32) {
        self.slice(at, len).zero();
    }

    /// Marks the first `len` bytes of the buffers dirty in the memory's
    /// log (for a migration): the pages of each buffer, found by its host
    /// address in the region that maps it.
    pub fn mark_written(&self, mut len: u32) {
        for v in &self.iovecs {
            if len == 0 {
                break;
            }
            let n = v.iov_len.min(len as usize);
            let at = v.iov_base as usize;
            let region = self.mem.iter().find(|r| {
                let base = r.as_ptr() as usize;
                at >= base && at - base < r.len() as usize
            });
            if let Some(r) = region {
                r.bitmap().mark_dirty(at - r.as_ptr() as usize, n);
            }
            len -= n as u32;
        }
    }

    /// The buffers, in order, as byte slices to transform in place what a
    /// read brought into them (an encrypted disk's reads are decrypted
    /// there before the completion is published).
    ///
    /// # Safety
    ///
    /// No Rust code of this process may hold a view of these bytes while a
    /// slice lives (`&mut self` rules out only a second view through
    /// `self`: another [`GuestBuffers::slice`] of them, or another
    /// request's buffers that the driver pointed at the same memory, would
    /// not be seen), and each slice must be dropped before the next is
    /// taken: two iovecs of one request may overlap.
    pub unsafe fn slices_mut(&mut self) -> impl Iterator<Item = &mut [u8]> + '_ {
        self.iovecs.iter().map(|v| {
            // SAFETY: `v` lies inside a region of `self.mem`, mapped while
            // `self` holds it (see `translate`); the caller promises that
            // no other view of it from this process lives meanwhile. The
            // guest may write these bytes at the same time (they are its
            // memory): see the caller's comment on what that can change.
            unsafe { std::slice::from_raw_parts_mut(v.iov_base.cast::<u8>(), v.iov_len) }
        })
    }

    /// Whether every buffer starts and ends on an `align` boundary.
    pub fn aligned_to(&self, align: usize) -> bool {
        self.iovecs
            .iter()
            .all(|v| (v.iov_base as usize).is_multiple_of(align) && v.iov_len % align == 0)
    }
}

/// Appends to `out` the iovecs over `len` bytes of `iovecs` from byte
/// `from` on (inside the same memory); returns how many bytes they cover
/// (fewer where `iovecs` end first).
pub fn slice_iovecs(
    iovecs: &[libc::iovec],
    from: usize,
    len: usize,
    out: &mut Vec<libc::iovec>,
) -> usize {
    let (mut skip, mut left) = (from, len);
    for v in iovecs {
        if left == 0 {
            break;
        }
        if skip >= v.iov_len {
            skip -= v.iov_len;
            continue;
        }
        let n = (v.iov_len - skip).min(left);
        out.push(libc::iovec {
            // Inside `v`.
            iov_base: v.iov_base.cast::<u8>().wrapping_add(skip).cast(),
            iov_len: n,
        });
        left -= n;
        skip = 0;
    }
    len - left
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};

    fn mem() -> Arc<GuestMem> {
        Arc::new(
            GuestMem::from_ranges(&[(GuestAddress(0), 0x2000), (GuestAddress(0x2000), 0x2000)])
                .unwrap(),
        )
    }

    /// A range across two regions becomes two iovecs; one past the end
    /// of memory is refused.
    #[test]
    fn translation_follows_the_regions_and_stops_at_their_end() {
        let mem = mem();
        let b = GuestBuffers::translate(&mem, [(GuestAddress(0x1f00), 0x200)].into_iter(), vec![])
            .unwrap();
        assert_eq!(b.iovecs().len(), 2);
        assert_eq!(b.len(), 0x200);
        let (e, _) =
            GuestBuffers::translate(&mem, [(GuestAddress(0x3f00), 0x200)].into_iter(), vec![])
                .unwrap_err();
        assert_eq!(e, RequestError::BadAddress);
    }

    /// A slice covers exactly its bytes, across iovec boundaries.
    #[test]
    fn slices_cover_their_bytes_only() {
        let mem = mem();
        let bufs = [(GuestAddress(0x100), 4), (GuestAddress(0x1ffe), 4)];
        let b = GuestBuffers::translate(&mem, bufs.into_iter(), vec![]).unwrap();
        let s = b.slice(3, 4);
        assert_eq!(s.len(), 4);
        s.fill_from(&[9, 9, 9, 9]);
        let mut back = [0u8; 8];
        b.gather_into(&mut back);
        assert_eq!(back, [0, 0, 0, 9, 9, 9, 9, 0]);
        b.zero_at(4, 2);
        b.fill_at(0, &[1]);
        b.gather_into(&mut back);
        assert_eq!(back, [1, 0, 0, 9, 0, 0, 9, 0]);
        assert_eq!(b.slice(6, 10).len(), 2, "cut off at the end");
    }

    #[test]
    fn copies_stay_within_the_buffers() {
        let mem = mem();
        let bufs = [(GuestAddress(0x100), 4), (GuestAddress(0x1ffe), 4)];
        let b = GuestBuffers::translate(&mem, bufs.into_iter(), vec![]).unwrap();
        b.fill_from(&[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(
            mem.read_obj::<[u8; 5]>(GuestAddress(0xff)).unwrap(),
            [0, 1, 2, 3, 4]
        );
        assert_eq!(
            mem.read_obj::<[u8; 6]>(GuestAddress(0x1ffd)).unwrap(),
            [0, 5, 6, 7, 8, 0]
        );
        let mut back = [0u8; 10];
        b.gather_into(&mut back);
        assert_eq!(back, [1, 2, 3, 4, 5, 6, 7, 8, 0, 0]);
        b.zero();
        b.gather_into(&mut back);
        assert_eq!(back, [0; 10]);
    }
}
