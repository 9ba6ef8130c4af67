//! Raw images: guest offset N is file offset N of file 0.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Commit, Dir, FormatError, Image, Mapper, Piece, Where};

pub struct RawImage {
    file: File,
    path: PathBuf,
    size: AtomicU64,
    writable: bool,
}

impl RawImage {
    pub fn open(path: &Path, writable: bool) -> Result<RawImage, FormatError> {
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(|e| FormatError::Open {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
        let size = file.metadata().map_err(FormatError::io("stat"))?.len();
        Ok(RawImage {
            file,
            path: path.to_path_buf(),
            size: AtomicU64::new(size),
            writable,
        })
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub(super) fn check(&self, offset: u64, len: u64, dir: Dir) -> Result<(), FormatError> {
        if dir == Dir::Write && !self.writable {
            return Err(FormatError::ReadOnly);
        }
        let size = self.size();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(FormatError::OutOfRange { offset, len, size }),
        }
    }

    pub(super) fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        self.check(offset, buf.len() as u64, Dir::Read)?;
        self.file
            .read_exact_at(buf, offset)
            .map_err(FormatError::io("read"))
    }
}

impl Image for RawImage {
    fn writable(&self) -> bool {
        self.writable
    }

    fn chain(&self) -> Vec<PathBuf> {
        vec![self.path.clone()]
    }

    /// Allocation is the host file system's: the sector.
    fn cluster_size(&self) -> u64 {
        512
    }

    fn flush(&self) -> Result<(), FormatError> {
        self.file.sync_data().map_err(FormatError::io("fdatasync"))
    }

    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        unmap: bool,
    ) -> Result<Vec<(u64, u64)>, FormatError> {
        self.check(offset, len, Dir::Write)?;
        let mode = if unmap {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        // SAFETY: fallocate(2) on a descriptor this image owns; no memory
        // is passed.
        let rc = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                mode,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if rc == 0 {
            Ok(Vec::new())
        } else {
            // Not supported here: the engine writes the zeroes.
            Ok(vec![(offset, len)])
        }
    }

    fn zero_range(&self, offset: u64, len: u64, unmap: bool) -> Result<(), FormatError> {
        const CHUNK: u64 = 1 << 20;
        for (mut at, n) in self.write_zeroes(offset, len, unmap)? {
            let zeroes = vec![0u8; CHUNK.min(n) as usize];
            let end = at + n;
            while at < end {
                let k = (end - at).min(CHUNK) as usize;
                self.file
                    .write_all_at(&zeroes[..k], at)
                    .map_err(FormatError::io("writing zeroes"))?;
                at += k as u64;
            }
        }
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), FormatError> {
        self.write_zeroes(offset, len, true).map(|_| ())
    }

    fn grow(&self, new_size: u64) -> Result<(), FormatError> {
        if !self.writable {
            return Err(FormatError::ReadOnly);
        }
        if new_size > self.size() {
            self.file
                .set_len(new_size)
                .map_err(FormatError::io("grow"))?;
            self.size.store(new_size, Ordering::Release);
        }
        Ok(())
    }
}

/// The identity: every range is itself in file 0.
impl Mapper for RawImage {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn files(&self) -> Vec<&File> {
        vec![self.file()]
    }

    fn map(&self, offset: u64, len: u64, _dir: Dir, out: &mut Vec<Piece>) {
        out.push(Piece {
            guest: offset,
            len,
            at: Where::Data { file: 0, offset },
        });
    }

    fn resolve(
        &self,
        offset: u64,
        len: u64,
        dir: Dir,
        out: &mut Vec<Piece>,
    ) -> Result<Option<Commit>, FormatError> {
        self.check(offset, len, dir)?;
        self.map(offset, len, dir, out);
        Ok(None)
    }

    fn read_slow(&self, offset: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        self.read_at(offset, buf)
    }
}
