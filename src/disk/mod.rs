//! The disk: everything about the image, and where a guest offset lives.
//!
//! The disk sits between a validated request and the engine's I/O. It
//! decides *where* (a file of the image's chain and an offset in it); the
//! engine does the I/O there, straight from or into guest memory. It does
//! not depend on the engine or the worker.
//!
//! - [`Disk`]: the image behind a device, the one owner of its size.
//! - [`Mapper`] and [`Image`]: what every format implements, in a file
//!   of its own; [`open`] picks one.
//! - [`seam`]: what the engine core asks per request ([`seam::Format`]),
//!   raw's inline identity or a queue's view of a chain ([`queue`]).
//! - [`live`]: the chain a daemon serves (any [`Image`]), across live
//!   snapshots; [`meta`]: its metadata thread.
//! - [`reader`]: the one reader of guest data off the queues' data path.
//! - [`raw`]: the identity on file 0.
//! - [`luks`]: a LUKS1/LUKS2 image: its payload, shifted by the data
//!   offset, and the AES-XTS transform of its bytes.
//! - [`qcow2`]: a qcow2 image and its backing chain (qcow2 or raw), on top
//!   of the `imago` crate's metadata handling; its bitmaps.
//!
//! The contract an engine follows, per request:
//! 1. [`Mapper::map`] for the guest range: cheap, never blocks, never does
//!    I/O. Each [`Piece`] says: data at (file, offset), do the I/O there;
//!    zeroes (a read fills zeroes); or [`Where::Slow`]: metadata work is
//!    needed (a cache miss, an allocation, copy-on-write, a compressed
//!    cluster).
//! 2. For a slow piece, the engine hands the request to the image's
//!    metadata thread ([`meta`]; the tests call it directly),
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
pub mod meta;
pub mod qcow2;
pub mod queue;
pub mod raw;
pub mod reader;
pub mod records;
pub mod seam;
pub mod writer;

#[cfg(feature = "test-utils")]
pub mod fuzzing;
mod handle;

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use handle::{Disk, Resizable};
pub use live::{CommitBase, Live, Served, SnapshotDir, SnapshotError};
pub use meta::Meta;
pub use qcow2::stream::Step;
pub use qcow2::{OpenOptions, Qcow2Image};
pub use raw::RawImage;

/// The image formats `--format` accepts ([`FORMATS`] names them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Format {
    #[default]
    Raw,
    Qcow2,
    /// LUKS1 or LUKS2 on a raw file or block device ([`luks`]).
    Luks,
}

/// How the daemon serves a format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Serving {
    /// The file itself, mapped inline by the engine core (raw).
    Inline,
    /// A part of the file, transformed (a LUKS payload: [`luks`]).
    Payload,
    /// Through the format's [`Image`] ([`open`]): a chain ([`Live`]) with
    /// a metadata thread for what the mapping cannot answer at once.
    Chain,
}

/// Every format: its name on the command line, and how it is served.
/// The one table of them; [`open`] is the one match.
pub const FORMATS: [(&str, Format, Serving); 3] = [
    ("raw", Format::Raw, Serving::Inline),
    ("qcow2", Format::Qcow2, Serving::Chain),
    ("luks", Format::Luks, Serving::Payload),
];

impl Format {
    fn row(self) -> &'static (&'static str, Format, Serving) {
        FORMATS
            .iter()
            .find(|row| row.1 == self)
            .unwrap_or(&FORMATS[0])
    }

    pub fn name(self) -> &'static str {
        self.row().0
    }

    pub fn serving(self) -> Serving {
        self.row().2
    }
}

impl FromStr for Format {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        FORMATS
            .iter()
            .find(|row| row.0 == s)
            .map(|row| row.1)
            .ok_or_else(|| {
                let names: Vec<_> = FORMATS.iter().map(|row| row.0).collect();
                format!("unknown image format {s:?} ({})", names.join(", "))
            })
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
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
    /// A write's data the format wrote itself, with its cluster's
    /// copy-on-write ([`Image::resolve_write`]): nothing left to do.
    Written,
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

/// A write's bytes, lent to [`Image::resolve_write`].
#[derive(Clone, Copy)]
pub struct WriteData<'a> {
    /// The request's buffers, from the write's offset on.
    pub iovecs: &'a [libc::iovec],
    /// The top's descriptor the engine writes through when it is O_DIRECT
    /// (`--direct`; [`Served::direct_top`]): a format that writes the data
    /// itself writes it through this one too (from an aligned buffer), so
    /// that the data of a disk served O_DIRECT never goes through the
    /// page cache. None: the image's own descriptor.
    pub direct: Option<&'a File>,
}

/// An open image, beyond where its bytes are ([`Mapper`]): what the
/// metadata thread ([`meta`]), a served chain ([`Live`]) and the layer
/// tests ask of any format. Each format implements it in its own file,
/// beside its [`Mapper`]; [`open`] is the one place that picks one.
pub trait Image: Mapper {
    fn writable(&self) -> bool;

    /// The chain's paths, top first (for `ctl status`; one path for a
    /// format without backing files).
    fn chain(&self) -> Vec<PathBuf>;

    /// The format's unit of allocation: what the backup's
    /// copy-before-write copies at a time, at least.
    fn cluster_size(&self) -> u64;

    /// [`Mapper::resolve`] of a write whose bytes are `data`: a format
    /// that copies on write may write the data itself, with the copied
    /// part of the cluster around it (one write, not three), and answers
    /// such a piece [`Where::Written`]. The default leaves the data to the
    /// caller. Blocks.
    ///
    /// # Safety
    /// `data`'s iovecs cover `len` bytes, readable for the whole call
    /// (guest memory whose mapping the caller holds, or its own buffer).
    unsafe fn resolve_write(
        &self,
        offset: u64,
        len: u64,
        _data: WriteData<'_>,
        out: &mut Vec<Piece>,
    ) -> Result<Option<Commit>, FormatError> {
        self.resolve(offset, len, Dir::Write, out)
    }

    /// [`Image::resolve_write`] on the caller's thread, if it can be done
    /// now without waiting: for a cached image whose metadata no one else
    /// is working on (qcow2: its metadata lock is free) and whose
    /// copy-on-write reads find their bytes in the page cache, so that a
    /// queue can allocate without a round trip through the metadata
    /// thread. None
    /// where it cannot (the default): the caller hands the write to the
    /// metadata thread.
    ///
    /// # Safety
    /// As for [`Image::resolve_write`].
    unsafe fn resolve_write_now(
        &self,
        _offset: u64,
        _len: u64,
        _data: WriteData<'_>,
        _out: &mut Vec<Piece>,
    ) -> Option<Result<Option<Commit>, FormatError>> {
        None
    }

    /// [`Image::commit`] of a write-back write's `ticket` on the caller's
    /// thread if no one else is committing or working on the metadata
    /// now; None where not (the default): the caller leaves the commit to
    /// the metadata thread.
    fn commit_now(&self, _ticket: Commit) -> Option<Result<(), FormatError>> {
        None
    }

    /// Returns once the metadata of every allocation up to `ticket` is in
    /// the image file (pwritten; a kill -9 cannot lose it), and with
    /// `durable` (a write-through write: the device's write cache is off)
    /// on the disk too (fdatasync), so that a power loss cannot lose the
    /// completed write either. Concurrent callers share the writes and the
    /// fdatasync (group commit). Blocks. A format that allocates nothing
    /// returns no ticket and has nothing to commit.
    fn commit(&self, _ticket: Commit, _durable: bool) -> Result<(), FormatError> {
        Ok(())
    }

    /// Makes everything written so far durable: metadata in order, then
    /// fdatasync. The engine syncs the data it wrote itself first. Blocks.
    fn flush(&self) -> Result<(), FormatError>;

    /// Makes `[offset, offset + len)` read as zeroes without writing data
    /// where the format can (whole clusters), giving space back to the host
    /// file when `unmap`. Returns the ranges (the unaligned head and tail)
    /// the engine must still write zeroes to through the data path.
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        unmap: bool,
    ) -> Result<Vec<(u64, u64)>, FormatError>;

    /// Write-zeroes of `[offset, offset + len)`, all of it, the head and
    /// tail written here (the metadata thread's write-zeroes). Blocks.
    fn zero_range(&self, offset: u64, len: u64, unmap: bool) -> Result<(), FormatError>;

    /// Discard of `[offset, offset + len)`: a hint; what it gives back
    /// reads as zeroes. Blocks.
    fn discard(&self, offset: u64, len: u64) -> Result<(), FormatError>;

    /// Grows the image to `new_size` bytes (never shrinks).
    fn grow(&self, new_size: u64) -> Result<(), FormatError>;

    /// Forgets what is cached of the metadata, for when another process
    /// may have written the image (a migration's hand-over).
    fn invalidate(&self) -> Result<(), FormatError> {
        Ok(())
    }

    /// Whether metadata is held back from the file: a FLUSH must then go
    /// through [`Image::flush`], not only the engine's fdatasync.
    fn holds_back(&self) -> bool {
        false
    }

    /// A request at `offset` missed the mapping cache: the format may note
    /// mappings around it to cache ahead of the next requests
    /// ([`Image::warm_step`]). True when it noted something new.
    fn missed(&self, _offset: u64) -> bool {
        false
    }

    /// Caches a step of the mappings [`Image::missed`] noted, for the
    /// metadata thread to call when idle; true while more are left.
    /// Blocks (briefly: one step).
    fn warm_step(&self) -> bool {
        false
    }

    /// The transform of each file of the chain ([`Mapper::crypt`], shared
    /// with the engine: [`seam::Format::crypts`]); empty when none is
    /// encrypted.
    fn crypts(&self) -> Vec<Option<std::sync::Arc<luks::Crypt>>> {
        Vec::new()
    }

    /// The image as qcow2, for what only qcow2 has: live snapshots (the
    /// overlay is a qcow2 file, whatever is below it), QEMU's persistent
    /// bitmaps, the L2 log.
    fn as_qcow2(&self) -> Option<&Qcow2Image> {
        None
    }
}

/// Opens `path` as `format`: the one place that picks a format's
/// [`Image`] (the layer tests' seam, and what [`Live`] serves). Raw is
/// the identity: its first bytes are never looked at.
pub fn open(
    path: &Path,
    format: Format,
    options: &OpenOptions,
) -> Result<Box<dyn Image>, FormatError> {
    match format {
        Format::Raw => Ok(Box::new(RawImage::open(path, options.writable)?)),
        Format::Qcow2 => Ok(Box::new(Qcow2Image::open(path, options)?)),
        Format::Luks => Err(FormatError::Open {
            path: path.display().to_string(),
            reason: "a LUKS image is served by the daemon (its key comes from --key-file), \
                     not opened here"
                .into(),
        }),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each format has one row, found by its name and by its value.
    #[test]
    fn every_format_is_one_row_of_the_table() {
        for (name, format, serving) in FORMATS {
            assert_eq!(name.parse::<Format>(), Ok(format));
            assert_eq!(format.to_string(), name);
            assert_eq!(format.serving(), serving);
            assert_eq!(FORMATS.iter().filter(|r| r.1 == format).count(), 1);
        }
        // Every value of the enum (a new one fails to compile here until
        // it is listed, and then this test until it has its row).
        for format in [Format::Raw, Format::Qcow2, Format::Luks] {
            match format {
                Format::Raw | Format::Qcow2 | Format::Luks => {}
            }
            assert!(FORMATS.iter().any(|r| r.1 == format), "{format:?}");
        }
        let e = "vmdk".parse::<Format>().unwrap_err();
        assert_eq!(e, "unknown image format \"vmdk\" (raw, qcow2, luks)");
    }
}
