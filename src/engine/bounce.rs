//! Aligned bounce buffers for O_DIRECT requests whose guest buffers are not
//! aligned (O_DIRECT needs aligned memory, offsets and lengths).

use crate::io::AlignedBuf;

/// The smallest buffer a [`Pool`] hands out: a page.
const MIN_CLASS_SHIFT: u32 = 12;
/// Size classes, powers of two from a page: up to 2^(12 + 16) bytes, past
/// the most data a request carries.
const CLASSES: usize = 17;

/// Bytes the core prepared in a private, page-aligned buffer for a write
/// (an encrypted disk's ciphertext, see [`super::core`]): what the engine
/// writes instead of the request's guest buffers (an `Io` over
/// `GuestBuffers::private`), owned by the core's tracked request until
/// the write is back. Its bytes are on the heap: moving it moves none.
#[derive(Debug)]
pub struct Staged {
    buf: AlignedBuf,
    len: usize,
    /// Counted in its pool's limit and kept for reuse; a spare
    /// ([`Pool::take_or_spare`]) is neither.
    pooled: bool,
}

impl Staged {
    /// The bytes to write.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf.as_slice()[..self.len]
    }

    /// The bytes to fill.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf.as_mut_slice()[..self.len]
    }

    /// The buffer's size (its pool's size class).
    fn size(&self) -> usize {
        self.buf.as_slice().len()
    }
}

/// A queue's private buffers for bytes transformed on their way to the
/// image (an encrypted disk's writes): page-aligned (so O_DIRECT takes
/// them as they are), a power of two of bytes each, kept for reuse once
/// given back. A buffer is allocated only while the pool holds none free
/// of its size; in steady state, none. At most `limit` bytes are held in
/// all (free or in use): free buffers of other sizes are let go to make
/// room, and a request that would pass the limit waits for buffers in
/// use to come back.
#[derive(Debug)]
pub struct Pool {
    free: [Vec<Staged>; CLASSES],
    /// Bytes of every buffer the pool allocated and has not let go.
    held: usize,
    /// Of those, bytes in the free lists.
    idle: usize,
    limit: usize,
}

/// Why [`Pool::take`] gave no buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum NoBuf {
    /// Not now: buffers in use must come back first.
    Wait,
    /// Never: larger than the limit, or the allocator failed.
    Fail,
}

impl Pool {
    /// An empty pool that holds at most `limit` bytes.
    pub fn new(limit: usize) -> Pool {
        Pool {
            free: Default::default(),
            held: 0,
            idle: 0,
            limit,
        }
    }

    /// A buffer of `len` bytes (its contents are stale).
    pub fn take(&mut self, len: usize) -> Result<Staged, NoBuf> {
        let size = len.max(1 << MIN_CLASS_SHIFT).next_power_of_two();
        let class = (size.trailing_zeros() - MIN_CLASS_SHIFT) as usize;
        if class >= CLASSES || size > self.limit {
            return Err(NoBuf::Fail);
        }
        if let Some(mut staged) = self.free[class].pop() {
            self.idle -= size;
            staged.len = len;
            return Ok(staged);
        }
        if self.held - self.idle + size > self.limit {
            return Err(NoBuf::Wait);
        }
        // Room: let free buffers of other sizes go until it fits.
        for list in &mut self.free {
            while self.held + size > self.limit {
                let Some(staged) = list.pop() else { break };
                let n = staged.size();
                self.held -= n;
                self.idle -= n;
            }
        }
        let buf = AlignedBuf::new(size).ok_or(NoBuf::Fail)?;
        self.held += size;
        Ok(Staged {
            buf,
            len,
            pooled: true,
        })
    }

    /// A buffer of `len` bytes, as [`Pool::take`], but never `Wait`:
    /// past the limit, a spare buffer that the pool does not count or
    /// keep (freed when given back). For a piece of a request whose
    /// other pieces are on their way and cannot be taken back; a queue
    /// holds few such requests (its ring's size), each at most the most
    /// data a request carries.
    pub fn take_or_spare(&mut self, len: usize) -> Result<Staged, NoBuf> {
        match self.take(len) {
            Err(NoBuf::Wait) => {
                let buf = AlignedBuf::new(len.max(1)).ok_or(NoBuf::Fail)?;
                Ok(Staged {
                    buf,
                    len,
                    pooled: false,
                })
            }
            other => other,
        }
    }

    /// Takes back a buffer [`Pool::take`] gave.
    pub fn give(&mut self, staged: Staged) {
        if !staged.pooled {
            return;
        }
        let size = staged.size();
        let class = (size.trailing_zeros().saturating_sub(MIN_CLASS_SHIFT)) as usize;
        if size.is_power_of_two() && class < CLASSES {
            self.idle += size;
            self.free[class].push(staged);
        } else {
            // Not one of ours: let it go.
            debug_assert!(false, "a buffer of {size} bytes given to the pool");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers come back and are reused; the limit holds, and free
    /// buffers of another size make room.
    #[test]
    fn pool_reuses_and_keeps_its_limit() {
        let mut pool = Pool::new(64 << 10);
        let a = pool.take(4096).unwrap();
        let p = a.as_slice().as_ptr();
        pool.give(a);
        let b = pool.take(100).unwrap();
        assert_eq!(b.as_slice().as_ptr(), p, "the free buffer is reused");
        assert_eq!((b.as_slice().len(), b.size()), (100, 4096));
        // 4 KiB in use and 64 KiB more would pass the limit.
        assert_eq!(pool.take(60 << 10).unwrap_err(), NoBuf::Wait);
        pool.give(b);
        // The free 4 KiB buffer is let go to make room for 64 KiB.
        let c = pool.take(60 << 10).unwrap();
        assert_eq!(c.size(), 64 << 10);
        assert_eq!(pool.take(1).unwrap_err(), NoBuf::Wait);
        assert_eq!(pool.take(128 << 10).unwrap_err(), NoBuf::Fail);
        pool.give(c);
        assert_eq!((pool.held, pool.idle), (64 << 10, 64 << 10));
    }
}
