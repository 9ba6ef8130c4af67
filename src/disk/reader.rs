//! The one reader of guest data off the queues' data path: a range of the
//! guest's disk read through the chain's tables (data in the top or a
//! backing file, zero and unallocated clusters, compressed clusters), not
//! the top's file, into a buffer. The backup's point-in-time view and its
//! copy-before-write read through [`Reader`]; the metadata thread reads a
//! compressed piece with [`read_piece`], as [`Reader`] does. Bytes that a
//! format must transform on their way from the file are transformed in
//! [`read_piece`], whoever reads them (the engine's data path reads into
//! guest memory itself, and transforms in its completion).
//!
//! A LUKS image's payload is read by [`Decrypted`]: the file's bytes at
//! the data offset, decrypted with the disk's own transform
//! ([`Crypt`], the one the engine core uses), so that the backup view and
//! its copy-before-write see the guest's plaintext.
//!
//! Each read maps its range with the format's slow path (under the
//! image's metadata lock, as a queue's request that missed the cache),
//! then reads the data with `pread` on the chain's own (buffered) files.
//!
//! Why the backup view's read-then-check (see `crate::backup`) holds: a
//! guest write changes a guest cluster's data *or its mapping* only after
//! `before_write` copied it, because the engine core calls `before_write`
//! before the format maps the write (and so before it allocates). A
//! partial write's allocation copies the rest of its qcow2 cluster up
//! from the backing file inside the format's slow path (imago's
//! `ensure_data_mapping`), under the metadata lock this reader's mapping
//! takes too: a read maps either the old place, or the new one with the
//! old data already in it. Besides, the store's cluster is made at least
//! the top's cluster size, so that a copy-up stays inside clusters
//! `before_write` already copied, whatever the format's order. The chain
//! itself does not change during a backup: a live snapshot is refused
//! while one runs (`Device::snapshot`), and so is a resize.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use std::fs::File;

use super::luks::Crypt;
use super::{Dir, Live, Mapper, Piece, Where};
use crate::nbd::proto::{STATE_HOLE, STATE_ZERO};

/// Clusters the first mapping of an `allocation` call takes.
const FIRST_WINDOW: u64 = 2;
/// The most clusters one mapping takes, under the image's metadata lock
/// (which the guest's requests that miss the map cache wait on).
const MAX_WINDOW: u64 = 1024;
/// The most clusters one `allocation` call maps: its answer may be
/// shorter than asked, and the NBD server asks again from where it ends.
pub const MAX_EXAMINED: u64 = 8192;

/// Reads `piece` of `image` (one that [`Mapper::resolve`] made, so data,
/// zeroes or compressed data) into `buf`, its length; `files` are the
/// image's ([`Mapper::files`]). Data in an encrypted file
/// ([`Mapper::crypt`]) is decrypted here, the one place off the data path
/// that does.
pub fn read_piece<M: Mapper + ?Sized>(
    image: &M,
    files: &[&File],
    piece: &Piece,
    buf: &mut [u8],
) -> io::Result<()> {
    read_piece_from(image, files, piece, buf, false)
}

/// [`read_piece`]; with `cached_only`, data only from the page cache: a
/// read that would wait for the device fails with `WouldBlock` (preadv2
/// with RWF_NOWAIT), as compressed data always does then. For a queue's
/// thread, which must not wait on a device.
pub fn read_piece_from<M: Mapper + ?Sized>(
    image: &M,
    files: &[&File],
    piece: &Piece,
    buf: &mut [u8],
    cached_only: bool,
) -> io::Result<()> {
    match piece.at {
        Where::Data { file, offset: host } => {
            let f = files.get(file).ok_or_else(|| {
                io::Error::other(format!("qcow2 mapping names file {file} of the chain"))
            })?;
            if cached_only {
                read_exact_cached(f, buf, host)?;
            } else {
                f.read_exact_at(buf, host)?;
            }
            match image.crypt(file) {
                Some(c) => {
                    let done = c.decrypt(host, buf).map_err(io::Error::other);
                    crate::crypto::key::scrub_after_pass();
                    done
                }
                None => Ok(()),
            }
        }
        Where::Zero => {
            buf.fill(0);
            Ok(())
        }
        Where::Slow if cached_only => Err(io::ErrorKind::WouldBlock.into()),
        Where::Slow => image
            .read_slow(piece.guest, buf)
            .map_err(|e| io::Error::other(e.to_string())),
        Where::Written => Err(io::Error::other("a read resolved to a write's piece")),
    }
}

/// `read_exact_at` from the page cache only: `WouldBlock` where the
/// bytes are not all there (or the kernel cannot tell without waiting).
fn read_exact_cached(f: &File, mut buf: &mut [u8], mut at: u64) -> io::Result<()> {
    while !buf.is_empty() {
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: one iovec over `buf`, writable for the call; `f` is open.
        let n =
            unsafe { libc::preadv2(f.as_raw_fd(), &iov, 1, at as libc::off_t, libc::RWF_NOWAIT) };
        if n > 0 {
            buf = &mut buf[n as usize..];
            at += n as u64;
            continue;
        }
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EAGAIN | libc::EOPNOTSUPP) => return Err(io::ErrorKind::WouldBlock.into()),
            _ => return Err(e),
        }
    }
    Ok(())
}

/// Fills `buf` from guest byte `offset` of `image`, through its tables
/// ([`Mapper::resolve`], then [`read_piece`]): the served chain's, or an
/// image opened on its own (the backup client's files).
pub fn read_at<M: Mapper + ?Sized>(image: &M, buf: &mut [u8], offset: u64) -> io::Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    let mut pieces = Vec::new();
    image
        .resolve(offset, buf.len() as u64, Dir::Read, &mut pieces)
        .map_err(|e| io::Error::other(e.to_string()))?;
    let files = image.files();
    let mut done = 0u64;
    for p in pieces {
        if p.guest != offset + done {
            return Err(io::Error::other(format!(
                "qcow2 mapping of {offset:#x}+{:#x} has a gap at {:#x}",
                buf.len(),
                offset + done
            )));
        }
        let part = &mut buf[done as usize..(done + p.len) as usize];
        read_piece(image, &files, &p, part)?;
        done += p.len;
    }
    if done != buf.len() as u64 {
        return Err(io::Error::other(format!(
            "qcow2 mapping of {offset:#x}+{:#x} ended after {done:#x}",
            buf.len()
        )));
    }
    Ok(())
}

/// The guest's disk of an image with a chain, read through it: see the
/// module doc.
pub struct Reader {
    live: Arc<Live>,
    size: u64,
}

impl Reader {
    /// The disk of `live`, whose size is `size` (fixed during a backup).
    pub fn new(live: Arc<Live>, size: u64) -> Reader {
        Reader { live, size }
    }

    /// The store's cluster for a view of `live`: at least `min`, and at
    /// least the top's cluster (see the module doc).
    pub fn cluster(live: &Live, min: u64) -> u64 {
        live.current().image.cluster_size().max(min)
    }

    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Fills `buf` from guest byte `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        read_at(&*self.live.current().image, buf, offset)
    }

    /// The allocation at `offset`: the length of the run that shares it
    /// (1 to `max_len`) and its `base:allocation` flags (0 when unknown).
    /// Maps from `offset` in windows that double from
    /// `FIRST_WINDOW` clusters to `MAX_WINDOW`, each once, until the
    /// run of pieces that read as zeroes (or of those that do not) ends,
    /// or [`MAX_EXAMINED`] clusters were mapped: the work follows the
    /// answer, and the metadata lock is held for one window at a time.
    pub fn allocation(&self, offset: u64, max_len: u64) -> io::Result<(u64, u32)> {
        let limit = offset.saturating_add(max_len).min(self.size);
        if offset >= limit {
            return Ok((max_len.max(1), 0));
        }
        let served = self.live.current();
        let image = &served.image;
        let cluster = image.cluster_size();
        let first = offset - offset % cluster;
        let cap = limit.min(first.saturating_add(MAX_EXAMINED * cluster));
        let flags = |zero: bool| {
            if zero { STATE_HOLE | STATE_ZERO } else { 0 }
        };
        let mut run: Option<bool> = None;
        let mut pos = offset;
        let mut window = FIRST_WINDOW * cluster;
        let mut pieces = Vec::new();
        while pos < cap {
            let end = (pos - pos % cluster).saturating_add(window).min(cap);
            pieces.clear();
            image
                .resolve(pos, end - pos, Dir::Read, &mut pieces)
                .map_err(|e| io::Error::other(e.to_string()))?;
            let mut next = pos;
            for p in &pieces {
                if p.guest != next {
                    return Err(io::Error::other(format!(
                        "qcow2 mapping of {pos:#x}+{:#x} has a gap at {next:#x}",
                        end - pos
                    )));
                }
                next += p.len;
                let zero = p.at == Where::Zero;
                match run {
                    None => run = Some(zero),
                    Some(z) if z != zero => {
                        let n = p.guest.saturating_sub(offset).clamp(1, limit - offset);
                        return Ok((n, flags(z)));
                    }
                    Some(_) => {}
                }
            }
            if next != end {
                return Err(io::Error::other(format!(
                    "qcow2 mapping of {pos:#x}+{:#x} ended after {:#x}",
                    end - pos,
                    next - pos
                )));
            }
            pos = end;
            window = (window * 2).min(MAX_WINDOW * cluster);
        }
        Ok((pos - offset, run.map_or(0, flags)))
    }
}

/// The guest's disk of a LUKS image (`--format luks`), read as the guest
/// sees it: `size` bytes of `file` from its data `offset`, decrypted with
/// the disk's [`Crypt`]. A read that does not start and end on the LUKS
/// sector is widened to whole sectors (the ciphertext is decrypted a
/// sector at a time) into a buffer of its own, then copied out.
pub struct Decrypted {
    file: File,
    offset: u64,
    size: u64,
    crypt: Arc<Crypt>,
}

impl Decrypted {
    /// The payload of `file`: from byte `offset`, `size` bytes (fixed
    /// during a backup), encrypted with `crypt`.
    pub fn new(file: File, offset: u64, size: u64, crypt: Arc<Crypt>) -> Decrypted {
        Decrypted {
            file,
            offset,
            size,
            crypt,
        }
    }

    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Fills `buf` with the plaintext from guest byte `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&end| end <= self.size)
            .ok_or_else(|| {
                io::Error::other(format!(
                    "{:#x} bytes at {offset:#x} are outside the {:#x}-byte disk",
                    buf.len(),
                    self.size
                ))
            })?;
        let sector = self.crypt.sector_size() as u64;
        // The payload is whole sectors (checked at start-up).
        let (first, last) = (offset - offset % sector, end.div_ceil(sector) * sector);
        let decrypt = |at: u64, bytes: &mut [u8]| {
            let at = self.offset + at;
            self.file.read_exact_at(bytes, at)?;
            let done = self.crypt.decrypt(at, bytes).map_err(io::Error::other);
            crate::crypto::key::scrub_after_pass();
            done
        };
        if (first, last) == (offset, end) {
            return decrypt(offset, buf);
        }
        let mut whole = vec![0u8; (last - first) as usize];
        decrypt(first, &mut whole)?;
        let from = (offset - first) as usize;
        buf.copy_from_slice(&whole[from..from + buf.len()]);
        Ok(())
    }

    /// The allocation at `offset`: all of it data, `max_len` (at least 1)
    /// with no flags. The file's holes say nothing of the guest's zeroes:
    /// a hole in the payload decrypts to noise, and a range the guest
    /// zeroed is encrypted zeroes, data on the file.
    pub fn allocation(&self, _offset: u64, max_len: u64) -> io::Result<(u64, u32)> {
        Ok((max_len.max(1), 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 4096-byte-sector transform with a fixed key, its IVs counted
    /// from file byte `origin`.
    fn crypt(origin: u64) -> Arc<Crypt> {
        let key = crate::crypto::key::Secret::from_slice(&[7u8; 64]).unwrap();
        let segment = crate::crypto::luks::Segment {
            offset: 0,
            size: None,
            sector_size: 4096,
            iv_tweak: 0,
            key_bytes: 64,
        };
        Arc::new(Crypt::new(&key, &segment, origin).unwrap())
    }

    /// Any read, on sectors or not, is the plaintext at its offset; one
    /// past the payload fails.
    #[test]
    fn a_payload_reads_as_its_plaintext_at_any_offset() {
        const HEADER: u64 = 8192;
        let c = crypt(HEADER);
        let plain: Vec<u8> = (0..64 * 1024u32)
            .map(|i| (i * 7 + i / 4096) as u8)
            .collect();
        let mut cipher = plain.clone();
        c.encrypt(HEADER, &mut cipher).unwrap();
        let file = tempfile::tempfile().unwrap();
        file.write_all_at(&cipher, HEADER).unwrap();
        let size = plain.len() as u64;
        let r = Decrypted::new(file, HEADER, size, c);
        for (off, len) in [
            (0, 4096),
            (8192, 16384),
            (1, 1),
            (4095, 2),
            (5000, 9000),
            (size - 3, 3),
        ] {
            let mut buf = vec![0u8; len];
            r.read_at(&mut buf, off).unwrap();
            assert!(buf == plain[off as usize..][..len], "{len} bytes at {off}");
        }
        assert!(r.read_at(&mut [0u8; 2], size - 1).is_err());
        assert_eq!(r.allocation(0, 1 << 20).unwrap(), (1 << 20, 0));
    }
}
