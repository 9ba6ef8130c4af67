//! The L2 log: L2 entries held back from the image until the data they
//! point to is durable, kept where a kill -9 cannot take them.
//!
//! An allocating write's L2 entry may reach the image only once the
//! cluster's copy-on-write data is durable: with it first, a power loss
//! could leave the entry pointing at a cluster that reads as zeroes where
//! the backing file had data the guest flushed long ago. Writing the entry
//! at once therefore costs an fdatasync per allocating write (or per group
//! of them); QEMU instead keeps the entry in its L2 cache until the guest's
//! next FLUSH, and a kill -9 of QEMU loses it, with writes the guest was
//! told were done. ringblk holds the L2 tables back too (`ordered`), and
//! appends each change of an entry to this log before the write completes:
//!
//! - **kill -9**: the log, like the page cache, outlives the process. The
//!   next daemon that takes the image lock (`Qcow2Image::adopt_log`) finds
//!   the image marked, reads the log and writes its entries into the L2
//!   tables (after an fdatasync of the data they point to), then clears
//!   the mark. No acknowledged write is lost.
//! - **power loss**: the log names the boot that wrote it. After a reboot
//!   it is not this boot's, and is dropped: the image's own L2 tables are
//!   as the last write-out left them, consistent, and they lose only what
//!   the guest had not flushed.
//! - **FLUSH** (and the write-out when the log or the held tables grow
//!   past a bound, a snapshot, a migration's stop): fdatasync, the held
//!   tables written, the mark cleared, the log emptied.
//!
//! **The mark** is bit 62 of the image's *autoclear* features
//! ([`MARK`]), set while the image's L2 tables lack entries that only the
//! log has. The image file on its own is consistent all the while: the L2
//! tables and the refblocks that only raise refcounts are what the last
//! write-out (a FLUSH at the latest) left, so QEMU reads it (`qemu-img
//! check`, `info`, `convert`) as of the last write-out, plus the writes
//! that went in place into clusters it already had; the clusters the log's
//! entries allocated are free to it. A program that writes the image
//! clears the autoclear bits it does not know first (the qcow2 format
//! asks it of every writer; QEMU does it at every read-write open, `qemu-img
//! check -r` included, and read-only opens write nothing), so a mark still
//! set at the next daemon's start proves that no such program wrote the
//! image since, and the log is written in; a mark gone while the log has
//! entries means one did (it may have allocated the very clusters the log
//! points to), and the log is dropped with a WARN line.
//!
//! Until this version the mark was bit 62 of the *incompatible* features
//! ([`OLD_MARK`]): QEMU refused the image ("Unknown incompatible feature:
//! 4000000000000000") until ringblk ran on it again. An image an older
//! daemon left so is still recovered (no other program could have written
//! it), and both bits are cleared.
//!
//! imago never sees either (reads of the header leave them out); only this
//! module's users in `ordered` set and clear them.
//!
//! **The file** (`IMAGE.ringblk-l2log`, next to the image `--image`
//! names): a 4 KiB header, then records.
//!
//! | offset | size | header field |
//! |--:|--:|---|
//! | 0 | 8 | magic `RBLKL2LG` |
//! | 8 | 4 | version, 1 |
//! | 16 | 8 | generation: records of another one are stale |
//! | 24 | 8 | `st_dev` of the image the records are for |
//! | 32 | 8 | `st_ino` of that image |
//! | 40 | 36 | boot id of the boot that wrote them |
//!
//! A record: generation (u64), entry count (u32), CRC-32 of the
//! generation, the count and the entries (u32), then each entry: the
//! entry's offset in the image (u64) and its new value (u64), all
//! little-endian. One pwrite each; replay stops at the first record that
//! is short, of another generation, or fails its CRC (a write cut off by
//! the kill: its request was not acknowledged).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::host::{BOOT_ID_LEN, boot_id};

/// The image's autoclear-feature bit that says "L2 entries are in the
/// log, and no program that does not know it wrote the image since" (see
/// the module doc). Bit 0 is QEMU's bitmaps bit, bit 1 its raw external
/// data file bit.
pub const MARK: u64 = 1 << 62;

/// The mark as daemons before this version set it: bit 62 of the
/// incompatible features, which QEMU refuses. Read (and cleared), never
/// set.
pub const OLD_MARK: u64 = 1 << 62;

/// Offset of the incompatible-features field in a qcow2 v3 header.
pub const INCOMPAT_OFFSET: u64 = 72;

/// The log's file name for the image `named`: `NAMED.ringblk-l2log`.
pub fn path_for(named: &Path) -> PathBuf {
    let mut p = named.as_os_str().to_owned();
    p.push(".ringblk-l2log");
    PathBuf::from(p)
}

const MAGIC: &[u8; 8] = b"RBLKL2LG";
const VERSION: u32 = 1;
const HEADER: u64 = 4096;
const RECORD_HEAD: usize = 16;
/// The most entries one record holds (a whole 2 MiB L2 table's).
const MAX_RECORD_ENTRIES: u32 = 1 << 18;

/// Past this size the held tables are written out and the log emptied.
pub const MAX_LOG: u64 = 8 << 20;

/// Records past this offset are not read: the log never grows beyond
/// [`MAX_LOG`] and one more record (a file from elsewhere may be larger).
const READ_LIMIT: u64 = HEADER + MAX_LOG + RECORD_HEAD as u64 + MAX_RECORD_ENTRIES as u64 * 16;

/// The log of one daemon's writable top.
pub struct L2Log {
    file: File,
    path: PathBuf,
    /// This boot's id, read at open (the sandbox allows no `openat` later).
    boot: [u8; BOOT_ID_LEN],
    state: Mutex<State>,
}

struct State {
    generation: u64,
    /// Where the next record goes.
    end: u64,
}

/// What [`L2Log::entries_for`] found.
#[derive(Debug, Default)]
pub struct Found {
    pub entries: Vec<(u64, u64)>,
    /// Why the log does not apply, if it does not.
    pub stale: Option<String>,
}

/// The log's file at `path`, opened read-write, created (mode 0600) if
/// missing, never truncated, never through a symlink, and a regular file
/// only: something else planted at its name (a FIFO, whose open with
/// O_RDWR does not block but whose header read would; a device) is
/// refused with `InvalidInput`, "not a regular file".
pub fn open_file(path: &Path) -> io::Result<std::fs::File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.file_type().is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    crate::host::clear_nonblock(&file)?;
    Ok(file)
}

impl L2Log {
    /// Opens (creates, 0600) the log at `path`, without reading or
    /// changing it: another daemon may hold the image and write it (a
    /// migration's source) until this one takes the image lock.
    pub fn open(path: &Path) -> io::Result<L2Log> {
        let file = open_file(path)?;
        Ok(L2Log {
            file,
            path: path.to_path_buf(),
            boot: boot_id()?,
            state: Mutex::new(State {
                generation: 0,
                end: HEADER,
            }),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The entries the log holds for the image `image` (this boot's, that
    /// image's, this generation's), in the order they were written.
    pub fn entries_for(&self, image: &File) -> io::Result<Found> {
        let meta = image.metadata()?;
        let mut h = [0u8; 76];
        let n = read_full(&self.file, &mut h, 0)?;
        let stale = |why: &str| {
            Ok(Found {
                entries: Vec::new(),
                stale: Some(why.to_string()),
            })
        };
        if n < h.len() || &h[..8] != MAGIC {
            return stale("it is empty or not an L2 log");
        }
        if le32(&h, 8) != VERSION {
            return stale("it is of another version");
        }
        if le64(&h, 24) != meta.dev() || le64(&h, 32) != meta.ino() {
            return stale("it is another image's");
        }
        if h[40..76] != self.boot {
            return stale("it was written before the host restarted");
        }
        let generation = le64(&h, 16);
        let mut entries = Vec::new();
        let mut at = HEADER;
        while at < READ_LIMIT {
            let mut head = [0u8; RECORD_HEAD];
            if read_full(&self.file, &mut head, at)? < RECORD_HEAD {
                break;
            }
            let count = le32(&head, 8);
            let end = at + RECORD_HEAD as u64 + u64::from(count) * 16;
            if le64(&head, 0) != generation
                || count == 0
                || count > MAX_RECORD_ENTRIES
                || end > READ_LIMIT
            {
                break;
            }
            let mut body = vec![0u8; count as usize * 16];
            if read_full(&self.file, &mut body, at + RECORD_HEAD as u64)? < body.len() {
                break;
            }
            if crc(&head[..12], &body) != le32(&head, 12) {
                break;
            }
            entries.extend(body.chunks_exact(16).map(|e| (le64(e, 0), le64(e, 8))));
            at += (RECORD_HEAD + body.len()) as u64;
        }
        Ok(Found {
            entries,
            stale: None,
        })
    }

    /// Empties the log, for the image `image`: a new generation, so that
    /// no record written before counts.
    pub fn reset(&self, image: &File) -> io::Result<()> {
        let meta = image.metadata()?;
        let mut st = lock(&self.state);
        st.generation = st.generation.max(self.stored_generation()).wrapping_add(1);
        let mut h = vec![0u8; HEADER as usize];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[16..24].copy_from_slice(&st.generation.to_le_bytes());
        h[24..32].copy_from_slice(&meta.dev().to_le_bytes());
        h[32..40].copy_from_slice(&meta.ino().to_le_bytes());
        h[40..40 + BOOT_ID_LEN].copy_from_slice(&self.boot);
        self.file.write_all_at(&h, 0)?;
        st.end = HEADER;
        Ok(())
    }

    fn stored_generation(&self) -> u64 {
        let mut g = [0u8; 8];
        match read_full(&self.file, &mut g, 16) {
            Ok(8) => u64::from_le_bytes(g),
            _ => 0,
        }
    }

    /// Appends one record: `entries` are (offset in the image, new value)
    /// of L2 entries. Returns the log's length after it.
    pub fn append(&self, entries: &[(u64, u64)]) -> io::Result<u64> {
        let mut st = lock(&self.state);
        let mut rec = Vec::with_capacity(RECORD_HEAD + entries.len() * 16);
        for chunk in entries.chunks(MAX_RECORD_ENTRIES as usize) {
            let start = rec.len();
            rec.extend_from_slice(&st.generation.to_le_bytes());
            rec.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
            rec.extend_from_slice(&[0; 4]);
            for &(offset, value) in chunk {
                rec.extend_from_slice(&offset.to_le_bytes());
                rec.extend_from_slice(&value.to_le_bytes());
            }
            let sum = crc(&rec[start..start + 12], &rec[start + RECORD_HEAD..]);
            rec[start + 12..start + 16].copy_from_slice(&sum.to_le_bytes());
        }
        self.file.write_all_at(&rec, st.end)?;
        st.end += rec.len() as u64;
        Ok(st.end)
    }
}

fn crc(head: &[u8], body: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(head);
    h.update(body);
    h.finalize()
}

fn read_full(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64)? {
            0 => break,
            n => done += n,
        }
    }
    Ok(done)
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or([0; 4]))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO, a directory or a symlink planted at the log's name is
    /// refused at once (a FIFO's header read would block the start).
    #[test]
    fn only_a_regular_file_is_a_log() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open_file(&fifo).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        std::os::unix::fs::symlink("/etc/hostname", dir.path().join("link")).unwrap();
        assert!(open_file(&dir.path().join("link")).is_err());
        assert!(open_file(dir.path()).is_err());
        assert!(open_file(&dir.path().join("new")).is_ok());
    }

    #[test]
    fn records_of_this_generation_replay_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let image = File::create(dir.path().join("img")).unwrap();
        let other = File::create(dir.path().join("other")).unwrap();
        let log = L2Log::open(&dir.path().join("img.ringblk-l2log")).unwrap();
        // Never written: stale, nothing to replay.
        assert!(log.entries_for(&image).unwrap().stale.is_some());
        log.reset(&image).unwrap();
        log.append(&[(0x10008, 0x8000_0000_0003_0000)]).unwrap();
        log.append(&[(0x10010, 1), (0x10008, 2)]).unwrap();
        let found = log.entries_for(&image).unwrap();
        assert_eq!(found.stale, None);
        assert_eq!(
            found.entries,
            vec![(0x10008, 0x8000_0000_0003_0000), (0x10010, 1), (0x10008, 2)]
        );
        // Another image's log does not apply to this one.
        assert!(log.entries_for(&other).unwrap().stale.is_some());
        // A reset forgets the records; a record cut short ends the replay.
        log.reset(&image).unwrap();
        assert!(log.entries_for(&image).unwrap().entries.is_empty());
        let end = log.append(&[(8, 9), (16, 17)]).unwrap();
        log.file.set_len(end - 3).unwrap();
        assert!(log.entries_for(&image).unwrap().entries.is_empty());
        // A record of an older generation after a reset does not count.
        log.reset(&image).unwrap();
        log.append(&[(24, 25)]).unwrap();
        assert_eq!(log.entries_for(&image).unwrap().entries, vec![(24, 25)]);
    }
}
