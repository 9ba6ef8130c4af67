//! Writes through an image's contract off the daemon's data path, with
//! plain buffers: the map, the slow path that allocates, the data at the
//! host offsets, then the commit. What the backup client writes its files
//! with (`crate::backup::archive`), and the layers tests' stand-in for
//! the engine. (The one reader is [`super::reader`].)

use std::os::unix::fs::FileExt;

use super::{Dir, FormatError, Image, Where, WriteData};

/// Writes `data` at guest byte `offset` of `img`; with `fua`, the data
/// with an fdatasync of its own (as RWF_DSYNC) and a durable commit.
pub fn write(img: &dyn Image, offset: u64, data: &[u8], fua: bool) -> Result<(), FormatError> {
    let mut pieces = Vec::new();
    img.map(offset, data.len() as u64, Dir::Write, &mut pieces);
    let mut ticket = None;
    let mut direct = Vec::new();
    let unexpected = |what: &str, w: Where| {
        Err(FormatError::Unsupported(format!(
            "{what} gave {w:?} for a write (only the top's data is written)"
        )))
    };
    for p in pieces {
        match p.at {
            Where::Data { file: 0, offset } => direct.push((p.guest, p.len, offset)),
            Where::Slow => {
                let mut sub = Vec::new();
                let at = (p.guest - offset) as usize;
                let part = &data[at..at + p.len as usize];
                let iovec = libc::iovec {
                    iov_base: part.as_ptr().cast_mut().cast(),
                    iov_len: part.len(),
                };
                // SAFETY: the iovec covers `part`, p.len bytes of `data`,
                // which the caller lends us for the call.
                let t = unsafe {
                    let data = WriteData {
                        iovecs: &[iovec],
                        direct: None,
                    };
                    img.resolve_write(p.guest, p.len, data, &mut sub)?
                };
                ticket = ticket.max(t);
                for s in sub {
                    match s.at {
                        Where::Data { file: 0, offset } => direct.push((s.guest, s.len, offset)),
                        // The format wrote it, with its copy-on-write.
                        Where::Written => {}
                        other => return unexpected("resolve", other),
                    }
                }
            }
            other => return unexpected("map", other),
        }
    }
    for (guest, len, host) in direct {
        let at = (guest - offset) as usize;
        data_write(img, &data[at..at + len as usize], host, fua)?;
    }
    if let Some(t) = ticket {
        img.commit(t, fua)?;
    }
    Ok(())
}

fn data_write(img: &dyn Image, data: &[u8], host: u64, fua: bool) -> Result<(), FormatError> {
    let r = match img.as_qcow2() {
        Some(q) if fua => q.data_write_dsync(data, host),
        Some(q) => q.data_write(data, host),
        None => img.files()[0].write_all_at(data, host),
    };
    r.map_err(FormatError::io("pwrite"))
}

/// Write-zeroes: the format zeroes whole clusters (zero clusters of a
/// qcow2 image, which hide a backing file's data), and what it hands back
/// is written as zeroes.
pub fn write_zeroes(
    img: &dyn Image,
    offset: u64,
    len: u64,
    unmap: bool,
) -> Result<(), FormatError> {
    for (o, l) in img.write_zeroes(offset, len, unmap)? {
        write(img, o, &vec![0u8; l as usize], false)?;
    }
    Ok(())
}

/// Flush: an fdatasync of the data, then the format's metadata.
pub fn flush(img: &dyn Image) -> Result<(), FormatError> {
    img.files()[0]
        .sync_data()
        .map_err(FormatError::io("fdatasync"))?;
    img.flush()
}
