//! A synchronous stand-in for the engine: reads and writes through the
//! format layer's contract (map, resolve, read_slow, commit) with plain
//! buffers, and the qemu-img / qemu-io oracle.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ringblk::disk::{self, Dir, Format, FormatError, Image, OpenOptions, Piece, Where};
pub use ringblk_testkit::qemu_img::{
    check, check_clean, compare_identical, create_qcow2, overlay, qemu_img, run, sha256,
};

pub const MIB: u64 = 1 << 20;

/// A deterministic byte for `offset` of pattern `seed` (0: the base's).
pub fn pattern(seed: u64, offset: u64) -> u8 {
    let x =
        (offset / 8).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    (x >> ((offset % 8) * 8)) as u8 ^ (x >> 56) as u8
}

pub fn fill(seed: u64, offset: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(seed, offset + i as u64);
    }
}

/// A small xorshift generator: tests are reproducible from their seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A directory under target/tmp, emptied first.
pub fn scratch(name: &str) -> PathBuf {
    let dir = ringblk_testkit::tmp_dir().join("format").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A raw base of `size` bytes holding pattern 0.
pub fn raw_base(path: &Path, size: u64) {
    let mut data = vec![0u8; size as usize];
    fill(0, 0, &mut data);
    std::fs::write(path, &data).unwrap();
}

pub fn open(path: &Path, writable: bool) -> Box<dyn Image> {
    let options = OpenOptions {
        writable,
        ..OpenOptions::default()
    };
    disk::open(path, Format::Qcow2, &options).unwrap_or_else(|e| panic!("open: {e}"))
}

/// Opens the qcow2 image at `path` read-write as the daemon does: with its
/// L2 log (`PATH.ringblk-l2log`) taken into use, which writes in what a
/// process killed on the image left in it. Returns the image and how many
/// entries that was.
pub fn open_logged(path: &Path, options: OpenOptions) -> (Box<dyn Image>, usize) {
    let options = OpenOptions {
        writable: true,
        l2_log: Some(ringblk::disk::qcow2::l2log::path_for(path)),
        ..options
    };
    let img = disk::open(path, Format::Qcow2, &options).unwrap_or_else(|e| panic!("open: {e}"));
    let replayed = match img.as_qcow2() {
        Some(q) => q.claim().unwrap_or_else(|e| panic!("claim: {e}")).replayed,
        None => 0,
    };
    (img, replayed)
}

fn pread(img: &dyn Image, file: usize, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
    let files = img.files();
    let f = files[file];
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            // Past the end of the file: an allocated cluster not yet written.
            Ok(0) => {
                buf[done..].fill(0);
                break;
            }
            Ok(n) => done += n,
            Err(e) => {
                return Err(FormatError::Io {
                    context: "pread",
                    source: e,
                });
            }
        }
    }
    Ok(())
}

/// Reads through the contract: fast map, then the slow path for misses.
pub fn read(img: &dyn Image, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
    let mut pieces = Vec::new();
    img.map(offset, buf.len() as u64, Dir::Read, &mut pieces);
    for p in pieces {
        read_piece(img, offset, buf, p, true)?;
    }
    Ok(())
}

fn read_piece(
    img: &dyn Image,
    base: u64,
    buf: &mut [u8],
    p: Piece,
    retry: bool,
) -> Result<(), FormatError> {
    let at = (p.guest - base) as usize;
    let slice = &mut buf[at..at + p.len as usize];
    match p.at {
        Where::Data { file, offset } => pread(img, file, offset, slice),
        Where::Zero => {
            slice.fill(0);
            Ok(())
        }
        Where::Slow if retry => {
            let mut sub = Vec::new();
            img.resolve(p.guest, p.len, Dir::Read, &mut sub)?;
            for s in sub {
                read_piece(img, base, buf, s, false)?;
            }
            Ok(())
        }
        Where::Slow => img.read_slow(p.guest, slice),
        Where::Written => panic!("a read resolved to a write's piece"),
    }
}

/// Writes through the contract: fast map, allocation on the slow path,
/// data straight to the host offsets, then the commit before "completion"
/// (the library's [`disk::writer`], which the backup client writes with).
pub fn write(img: &dyn Image, offset: u64, data: &[u8]) -> Result<(), FormatError> {
    disk::writer::write(img, offset, data, false)
}

/// A write with the device's write cache off (`--writethrough`): the data
/// with FUA (pwrite and fdatasync, as RWF_DSYNC), then a durable commit.
pub fn write_through(img: &dyn Image, offset: u64, data: &[u8]) -> Result<(), FormatError> {
    disk::writer::write(img, offset, data, true)
}

/// Write-zeroes through the contract: the format zeroes whole clusters,
/// the "engine" writes zeroes over what it hands back.
pub fn write_zeroes(
    img: &dyn Image,
    offset: u64,
    len: u64,
    unmap: bool,
) -> Result<(), FormatError> {
    disk::writer::write_zeroes(img, offset, len, unmap)
}

/// Flush: the engine's fdatasync of the data, then the format's.
pub fn flush(img: &dyn Image) -> Result<(), FormatError> {
    disk::writer::flush(img)
}

/// The stored form of the bitmap `b` named `name` (QEMU's AUTO flag set,
/// consistent as `b` is), as the daemon hands it to the write-back.
pub fn stored(
    name: &str,
    b: &ringblk::bitmap::DirtyBitmap,
) -> ringblk::disk::qcow2::bitmap_write::Stored {
    ringblk::disk::qcow2::bitmap_write::Stored {
        name: name.into(),
        granularity_bits: b.granularity().trailing_zeros() as u8,
        auto: true,
        consistent: b.is_consistent(),
        words: b.words().collect(),
    }
}
