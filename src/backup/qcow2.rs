//! The guest's disk of a qcow2 image, as the point-in-time view reads it:
//! through the chain's tables (data in the top or a backing file, zero and
//! unallocated clusters, compressed clusters), not the top's file.
//!
//! Each read maps its range with the format's slow path (under the
//! image's metadata lock, as a queue's request that missed the cache),
//! then reads the data with `pread` on the chain's own (buffered) files.
//!
//! Why the view's read-then-check (see the parent module) still holds: a
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
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::Image;
use crate::format::{Dir, Live, Piece, Where};
use crate::nbd::proto::{STATE_HOLE, STATE_ZERO};

/// The most one `allocation` call maps: its answer may be shorter.
const MAX_EXTENT: u64 = 64 << 20;

/// A qcow2 image's guest disk: see the module doc.
pub struct Qcow2Disk {
    live: Arc<Live>,
    size: u64,
}

impl Qcow2Disk {
    /// The disk of `live`, whose size is `size` (fixed during a backup).
    pub fn new(live: Arc<Live>, size: u64) -> Qcow2Disk {
        Qcow2Disk { live, size }
    }

    /// The store's cluster for a view of `live`: at least `min`, and at
    /// least the top's cluster (see the module doc).
    pub fn cluster(live: &Live, min: u64) -> u64 {
        live.current().image.cluster_size().max(min)
    }

    fn pieces(&self, offset: u64, len: u64) -> io::Result<Vec<Piece>> {
        let mut out = Vec::new();
        self.live
            .current()
            .image
            .resolve(offset, len, Dir::Read, &mut out)
            .map_err(|e| io::Error::other(e.to_string()))?;
        Ok(out)
    }
}

impl Image for Qcow2Disk {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let served = self.live.current();
        let image = &served.image;
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
            match p.at {
                Where::Data { file, offset: host } => {
                    let f = files.get(file).ok_or_else(|| {
                        io::Error::other(format!("qcow2 mapping names file {file} of the chain"))
                    })?;
                    f.read_exact_at(part, host)?;
                }
                Where::Zero => part.fill(0),
                Where::Slow => image
                    .read_slow(p.guest, part)
                    .map_err(|e| io::Error::other(e.to_string()))?,
            }
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

    fn allocation(&self, offset: u64, max_len: u64) -> io::Result<(u64, u32)> {
        let len = max_len
            .min(MAX_EXTENT)
            .min(self.size.saturating_sub(offset));
        if len == 0 {
            return Ok((max_len.max(1), 0));
        }
        let pieces = self.pieces(offset, len)?;
        let zero = |p: &Piece| p.at == Where::Zero;
        let Some(first) = pieces.first() else {
            return Ok((len, 0));
        };
        // The run of pieces that read as zeroes, or of those that do not.
        let run: u64 = pieces
            .iter()
            .take_while(|p| zero(p) == zero(first))
            .map(|p| p.len)
            .sum();
        let flags = if zero(first) {
            STATE_HOLE | STATE_ZERO
        } else {
            0
        };
        Ok((run.max(1), flags))
    }
}
