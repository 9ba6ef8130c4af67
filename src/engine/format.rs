//! Where a request's bytes are: the seam between a validated request and
//! the engine's I/O, for image formats.
//!
//! The core asks the queue's [`Format`] once per read, write, discard and
//! write-zeroes, with the operation and its guest byte range, before the
//! engine sees the request. What a format gets and returns:
//! - it gets the [`Op`] and the range (`offset`, `len`, in bytes of the
//!   guest's disk; the parser has checked it against the capacity);
//! - it returns a [`Mapping`]: [`Mapping::Host`], the range's place in one
//!   of the image chain's files (its index, as the engine registered the
//!   files, and the offset there).
//!
//! A raw image ([`Raw`]) maps every range to itself in file 0. An image
//! format adds to [`Mapping`] what it needs, and the core handles each
//! case before or instead of the engine (the next issue's qcow2):
//! - reads as zeroes (an unallocated cluster with no backing file, a zero
//!   cluster): the core zero-fills the buffers and finishes the request
//!   without I/O;
//! - needs metadata work first (an L2 table not cached, a cluster to
//!   allocate for a write, a backing file to look in): the format takes
//!   the request and gives it back, mapped, when the work is done; the
//!   worker waits for it as for the engine;
//! - spans several places (a request across clusters): the format splits
//!   it, and the request completes when its last piece does.
//!
//! Flush maps to nothing: it covers every file of the chain (and, for a
//! format, its metadata caches first).
//!
//! The format layer ([`crate::format`]) answers in these terms already:
//! its `Image::map` gives pieces whose `Where` is `Data { file, offset }`
//! ([`Mapping::Host`]), `Zero` or `Slow` (metadata work). Plugging it in is
//! a `Format` over its `Image`, the two more `Mapping` cases, and a
//! `Core` that handles them; the worker above and the engines below stay
//! as they are.

use crate::virtio::Op;

/// A place on the image: a file of its chain, and an offset there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extent {
    /// The file's index: 0 is the image itself (the engine's registered
    /// file 0); a format with a backing chain numbers the others.
    pub file: u32,
    /// Byte offset in that file.
    pub offset: u64,
}

/// What a format made of a guest range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapping {
    /// The whole range lies at this place.
    Host(Extent),
}

/// Maps guest ranges to places on the image (see the module doc).
pub trait Format: Send {
    /// Where `len` bytes at guest byte `offset` are, for `op`.
    fn map(&mut self, op: Op, offset: u64, len: u64) -> Mapping;
}

/// A raw image: the guest's disk is file 0, byte for byte.
#[derive(Clone, Copy, Debug, Default)]
pub struct Raw;

impl Format for Raw {
    #[inline]
    fn map(&mut self, _op: Op, offset: u64, _len: u64) -> Mapping {
        Mapping::Host(Extent { file: 0, offset })
    }
}
