//! The disk: everything about the image, and where a guest offset lives.
//!
//! The disk sits between a validated request and the engine's I/O. It
//! decides *where* (a file of the image's chain and an offset in it); the
//! engine does the I/O there, straight from or into guest memory. It does
//! not depend on the engine or the worker.
//!
//! - [`Disk`]: the image behind a device, the one owner of its size.
//! - [`seam`]: what the engine core asks per request ([`seam::Format`]),
//!   raw's inline identity or a queue's view of a chain.
//! - [`reader`]: the one reader of guest data off the queues' data path.
//! - [`raw`]: the identity on file 0.
//! - [`luks`]: a LUKS1/LUKS2 image: its payload, shifted by the data
//!   offset, and the AES-XTS transform of its bytes.
//! - [`qcow2`]: a qcow2 image and its backing chain (qcow2 or raw), on top
//!   of the `imago` crate's metadata handling; its metadata thread, a
//!   queue's view of it and its bitmaps.
//!
//! The contract an engine follows, per request:
//! 1. [`Mapper::map`] for the guest range: cheap, never blocks, never does
//!    I/O. Each [`Piece`] says: data at (file, offset), do the I/O there;
//!    zeroes (a read fills zeroes); or [`Where::Slow`]: metadata work is
//!    needed (a cache miss, an allocation, copy-on-write, a compressed
//!    cluster).
//! 2. For a slow piece, the engine hands the request to the image's
//!    metadata thread ([`qcow2::meta`]; the tests call it directly),
//!    which calls [`Mapper::resolve`] (reads and writes) or [`Mapper::read_slow`]
//!    (compressed data, read into the caller's buffer), then completes back
//!    to the queue. Other requests of the queue go on meanwhile.
//! 3. After the data I/O of a write, if `resolve` returned a [`Commit`]
//!    ticket, [`Image::commit`] makes the metadata that write needs reach
//!    the image file before the completion is published (and the disk,
//!    for a write-through write).
//! 4. FLUSH: the engine's fdatasync of every file it wrote, then
//!    [`Image::flush`].
//!
//! **Never probe.** A raw image is served as raw whatever its first bytes
//! are; qcow2 only when asked for (`--format qcow2`). A guest may write a
//! qcow2 header naming any host file as its backing file into its raw disk;
//! probing would then serve that host file to it on the next start.
//! [`looks_like_qcow2`] exists only for the one warning a raw image that
//! starts with a qcow2 header gets.

pub mod live;
pub mod luks;
pub mod qcow2;
pub mod raw;
pub mod reader;
pub mod records;
pub mod seam;

#[cfg(feature = "test-utils")]
pub mod fuzzing;
mod handle;

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::str::FromStr;

pub use handle::{Disk, Resizable};
pub use live::{Live, Served, SnapshotDir, SnapshotError};
pub use qcow2::meta::Meta;
pub use qcow2::{OpenOptions, Qcow2Image};
pub use raw::RawImage;

/// The image formats `--format` accepts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Format {
    #[default]
    Raw,
    Qcow2,
    /// LUKS1 or LUKS2 on a raw file or block device ([`luks`]).
    Luks,
}

impl FromStr for Format {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "raw" => Ok(Format::Raw),
            "qcow2" => Ok(Format::Qcow2),
            "luks" => Ok(Format::Luks),
            other => Err(format!(
                "unknown image format {other:?} (raw, qcow2 or luks)"
            )),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
            Format::Luks => "luks",
        })
    }
}

/// Whether I/O reads or writes a range (a write may need an allocation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

/// Where one piece of a guest range lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Where {
    /// At `offset` in file `file` of [`Mapper::files`]: do the I/O there.
    Data { file: usize, offset: u64 },
    /// Reads as zeroes (a read fills zeroes; [`Mapper::map`] never gives it
    /// for a write).
    Zero,
    /// Needs metadata work first: [`Mapper::resolve`] or, for a compressed
    /// cluster, [`Mapper::read_slow`].
    Slow,
}

/// A piece of a guest range: `len` bytes from `guest`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub guest: u64,
    pub len: u64,
    pub at: Where,
}

/// Where a guest range of an image lives: the one mapping vocabulary
/// ([`Piece`], [`Where`]) behind one trait, in the shape of imago's
/// `FormatAccess`: [`Mapper::map`] is its `get_mapping` (from what is
/// cached: cheap, never blocks, never does I/O; [`Where::Slow`] where it
/// does not know), [`Mapper::resolve`] its `ensure_data_mapping` (loads
/// tables, and for a write allocates, with copy-on-write; blocks). Each
/// format implements it in its own file ([`RawImage`], [`Qcow2Image`]);
/// the one reader ([`reader`]) reads through it.
pub trait Mapper: Send + Sync {
    /// The guest-visible size in bytes.
    fn size(&self) -> u64;

    /// The open files, top first; a [`Where::Data`] indexes them.
    fn files(&self) -> Vec<&File>;

    /// Appends the pieces of `[offset, offset + len)` to `out`, without
    /// I/O and without blocking. The range is inside the image.
    fn map(&self, offset: u64, len: u64, dir: Dir, out: &mut Vec<Piece>);

    /// The slow path of [`Mapper::map`]: appends pieces that are all
    /// `Data` or `Zero`, except `Slow` for compressed data to read with
    /// [`Mapper::read_slow`]; a write's allocation returns the [`Commit`]
    /// its completion waits for. Blocks.
    fn resolve(
        &self,
        offset: u64,
        len: u64,
        dir: Dir,
        out: &mut Vec<Piece>,
    ) -> Result<Option<Commit>, FormatError>;

    /// Reads guest data that has no plain host location (compressed
    /// clusters) into `buf`. Blocks.
    fn read_slow(&self, offset: u64, buf: &mut [u8]) -> Result<(), FormatError>;

    /// How the bytes of file `file` are encrypted (an encrypted qcow2
    /// layer), or None: they are the guest's. A [`Where::Data`] in that
    /// file holds ciphertext, at its offset there ([`luks::Crypt`] takes
    /// file offsets).
    fn crypt(&self, _file: usize) -> Option<&luks::Crypt> {
        None
    }
}

/// What a write must wait for before its completion is published: the
/// metadata generation its allocation entered; see [`Image::commit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Commit(pub(crate) u64);

/// Errors of the format layer: at open a one-line reason, for a request
/// what failed (the request gets IOERR).
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The image (or a file of its chain) cannot be used; says which and why.
    #[error("{path}: {reason}")]
    Open { path: String, reason: String },
    /// A request outside the image.
    #[error("{len} bytes at {offset} are outside the image ({size} bytes)")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    /// A write to a read-only image.
    #[error("the image is read-only")]
    ReadOnly,
    /// The operation is not possible on this image (e.g. discard on qcow2 v2).
    #[error("{0}")]
    Unsupported(String),
    /// I/O or metadata error while serving a request.
    #[error("{context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: io::Error,
    },
}

impl FormatError {
    pub(crate) fn io(context: &'static str) -> impl FnOnce(io::Error) -> FormatError {
        move |source| FormatError::Io { context, source }
    }
}

/// An open image of either format.
pub enum Image {
    Raw(RawImage),
    Qcow2(Box<Qcow2Image>),
}

impl Image {
    /// Opens `path` as `format`. Raw is the identity: its first bytes are
    /// never looked at.
    pub fn open(path: &Path, format: Format, options: &OpenOptions) -> Result<Image, FormatError> {
        match format {
            Format::Raw => Ok(Image::Raw(RawImage::open(path, options.writable)?)),
            Format::Qcow2 => Ok(Image::Qcow2(Box::new(Qcow2Image::open(path, options)?))),
            Format::Luks => Err(FormatError::Open {
                path: path.display().to_string(),
                reason: "a LUKS image is served by the daemon (its key comes from --key-file), \
                         not opened here"
                    .into(),
            }),
        }
    }

    pub fn writable(&self) -> bool {
        match self {
            Image::Raw(r) => r.writable(),
            Image::Qcow2(q) => q.writable(),
        }
    }

    /// Returns once the metadata of every allocation up to `ticket` is in
    /// the image file (pwritten; a kill -9 cannot lose it), and with
    /// `durable` (a write-through write: the device's write cache is off)
    /// on the disk too (fdatasync), so that a power loss cannot lose the
    /// completed write either. Concurrent callers share the writes and the
    /// fdatasync (group commit). Blocks.
    pub fn commit(&self, ticket: Commit, durable: bool) -> Result<(), FormatError> {
        match self {
            Image::Raw(_) => Ok(()),
            Image::Qcow2(q) => q.commit(ticket, durable),
        }
    }

    /// Makes everything written so far durable: metadata in order, then
    /// fdatasync. The engine syncs the data it wrote itself first. Blocks.
    pub fn flush(&self) -> Result<(), FormatError> {
        match self {
            Image::Raw(r) => r.flush(),
            Image::Qcow2(q) => q.flush(),
        }
    }

    /// Makes `[offset, offset + len)` read as zeroes without writing data
    /// where the format can (whole clusters), giving space back to the host
    /// file when `unmap`. Returns the ranges (the unaligned head and tail)
    /// the engine must still write zeroes to through the data path.
    pub fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        unmap: bool,
    ) -> Result<Vec<(u64, u64)>, FormatError> {
        match self {
            Image::Raw(r) => r.write_zeroes(offset, len, unmap),
            Image::Qcow2(q) => q.write_zeroes(offset, len, unmap),
        }
    }

    /// Grows the image to `new_size` bytes (never shrinks).
    pub fn grow(&self, new_size: u64) -> Result<(), FormatError> {
        match self {
            Image::Raw(r) => r.grow(new_size),
            Image::Qcow2(q) => q.grow(new_size),
        }
    }
}

/// The test seam is one more [`Mapper`], by format.
impl Mapper for Image {
    fn size(&self) -> u64 {
        match self {
            Image::Raw(r) => r.size(),
            Image::Qcow2(q) => q.size(),
        }
    }

    fn files(&self) -> Vec<&File> {
        match self {
            Image::Raw(r) => vec![r.file()],
            Image::Qcow2(q) => q.files(),
        }
    }

    fn map(&self, offset: u64, len: u64, dir: Dir, out: &mut Vec<Piece>) {
        match self {
            Image::Raw(r) => r.map(offset, len, dir, out),
            Image::Qcow2(q) => q.map(offset, len, dir, out),
        }
    }

    fn resolve(
        &self,
        offset: u64,
        len: u64,
        dir: Dir,
        out: &mut Vec<Piece>,
    ) -> Result<Option<Commit>, FormatError> {
        match self {
            Image::Raw(r) => r.resolve(offset, len, dir, out),
            Image::Qcow2(q) => q.resolve(offset, len, dir, out),
        }
    }

    fn read_slow(&self, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        match self {
            Image::Raw(r) => r.read_slow(offset, buf),
            Image::Qcow2(q) => q.read_slow(offset, buf),
        }
    }

    fn crypt(&self, file: usize) -> Option<&luks::Crypt> {
        match self {
            Image::Raw(_) => None,
            Image::Qcow2(q) => q.crypt(file),
        }
    }
}

/// The qcow2 magic, "QFI\xfb".
pub const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";

/// Whether the file at `path` starts with a qcow2 header (magic and version
/// 2 or 3). Only for the warning a raw image with such a header gets: the
/// answer never changes how an image is served.
pub fn looks_like_qcow2(path: &Path) -> bool {
    let mut head = [0u8; 8];
    // Not waiting on a FIFO there: the open that serves it refuses it.
    let how = crate::host::Untrusted {
        block_device: true,
        ..Default::default()
    };
    crate::host::open_untrusted(path, how)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok()
        && head[..4] == QCOW2_MAGIC
        && matches!(
            u32::from_be_bytes([head[4], head[5], head[6], head[7]]),
            2 | 3
        )
}

/// The warning for a raw image that starts with a qcow2 header, or `None`.
pub fn raw_qcow2_warning(path: &Path, format: Format) -> Option<String> {
    (format == Format::Raw && looks_like_qcow2(path)).then(|| {
        format!(
            "{} starts with a qcow2 header but is served as raw (formats are never probed); \
             pass --format qcow2 to serve it as qcow2",
            path.display()
        )
    })
}
