//! Persistent bitmaps of raw images and block devices: one sidecar file per
//! bitmap, `DIR/STEM.bitmap.NAME` (by default the image's directory and
//! file name), its bits mapped MAP_SHARED so that a set bit is in the page
//! cache as soon as [`DirtyBitmap::mark`] returns.
//!
//! The format (docs/backup.md has it for other tools), little-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `RINGBMAP` |
//! | 8 | 4 | version, 1 |
//! | 12 | 4 | flags: bit 0 IN_USE, bit 1 INCONSISTENT; others zero |
//! | 16 | 8 | size in bytes of the disk it covers |
//! | 24 | 4 | log2 of the granularity (9 to 31) |
//! | 28 | 4 | zero |
//! | 32 | 8 | offset of the bits: 4096 |
//! | 40 | 8 | length of the bits in bytes: 8 × ⌈⌈size / granularity⌉ / 64⌉ |
//! | 48 | 36 | boot id (`/proc/sys/kernel/random/boot_id`) of the boot that last set IN_USE |
//! | 84 | 4 | zero |
//! | 88 | 2 | length of the name |
//! | 90 | ≤ 64 | the name (as in the file name) |
//!
//! The bits start at 4096: bit `i` (granule `i`, bytes `i × granularity` on)
//! is bit `i % 8` of byte `i / 8`, as in qcow2's bitmap extension. The file
//! is allocated in full when the bitmap is created (or grown), so that a
//! write to the mapping never needs a block the file system might not have
//! (which would be a SIGBUS, not an error). It may be longer than its bits
//! need (a disk that shrank).
//!
//! Why a bitmap is complete, or marked inconsistent:
//! - [`open`](BitmapStore::open) writes IN_USE and the current boot id and
//!   fsyncs before it returns a bitmap; [`close`](BitmapStore::close)
//!   msyncs the bits, and only then clears IN_USE and fsyncs.
//! - Found IN_USE with the current boot id: the owner died (kill -9, a
//!   crash) but the host did not, and the page cache holds every bit it
//!   set: complete.
//! - Found IN_USE with another boot id: the host stopped while the bitmap
//!   was in use, and bits still in the page cache may be lost: the bitmap
//!   is marked INCONSISTENT (a backup tool then copies everything), and
//!   stays so until it is cleared.
//! - A backup exports a copy of the bits; the mapped bits keep them until
//!   the backup ends well, so a daemon killed during a backup leaves the
//!   bitmap complete (docs/backup.md, "What an interrupted backup
//!   leaves").
//! - A file truncated under its mapping by another program: the SIGBUS of
//!   the next access is contained ([`fault`](super::fault)), the bitmap
//!   says it is inconsistent, and the next `update` or `close` allocates
//!   the file whole again, writes the bits, and marks it INCONSISTENT.
//!
//! What the header says sizes nothing: `peek` reads into a bitmap of the
//! image's size, no more than the file holds; `open` maps the image's
//! size. A sidecar found at start-up that cannot be opened (a FIFO, a
//! directory, a symlink, no permission) stops the start, through `peek`,
//! with one line naming it and the fix: never an image silently
//! untracked.
//!
//! After start-up the daemon opens no file by path (its seccomp filter has
//! no `openat` but the one below): the directory and every sidecar found
//! in it are opened by [`SidecarStore::new`], at start-up; a bitmap added
//! later is created with `openat` on the directory's descriptor, with
//! `O_CREAT | O_EXCL` (it never opens a file that exists); a removal is
//! `unlinkat` on the same descriptor ([`SidecarStore::dir_fd`] and
//! [`CREATE_FLAGS`] are what the filter allows).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use memmap2::MmapOptions;

use super::{
    BitmapError, BitmapInfo, BitmapStore, DirtyBitmap, check_name, geometry, granularity_shift,
};

const MAGIC: &[u8; 8] = b"RINGBMAP";
const VERSION: u32 = 1;
/// Where the bits start; the header's size.
pub const HEADER_SIZE: u64 = 4096;
const FLAG_IN_USE: u32 = 1 << 0;
const FLAG_INCONSISTENT: u32 = 1 << 1;
use crate::host::{BOOT_ID_LEN, open_at, unlink_at};

/// The flags of the only `openat` the daemon makes after start-up: a new
/// sidecar, never an existing file, never through a symlink.
pub const CREATE_FLAGS: i32 =
    libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;

/// The fields of a sidecar header.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Header {
    flags: u32,
    disk_size: u64,
    shift: u32,
    boot_id: [u8; BOOT_ID_LEN],
    name: String,
}

impl Header {
    fn bits_len(&self) -> u64 {
        geometry(self.disk_size, self.shift).1 * 8
    }

    /// The file's length: header, then the bits rounded up to a page (at
    /// least one word, so that the mapping is never empty).
    fn file_len(&self) -> u64 {
        HEADER_SIZE + self.map_len().next_multiple_of(4096)
    }

    /// The length of the mapping of the bits.
    fn map_len(&self) -> u64 {
        self.bits_len().max(8)
    }

    fn encode(&self) -> Vec<u8> {
        let mut h = vec![0u8; HEADER_SIZE as usize];
        h[0..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&self.flags.to_le_bytes());
        h[16..24].copy_from_slice(&self.disk_size.to_le_bytes());
        h[24..28].copy_from_slice(&self.shift.to_le_bytes());
        h[32..40].copy_from_slice(&HEADER_SIZE.to_le_bytes());
        h[40..48].copy_from_slice(&self.bits_len().to_le_bytes());
        h[48..84].copy_from_slice(&self.boot_id);
        h[88..90].copy_from_slice(&(self.name.len() as u16).to_le_bytes());
        h[90..90 + self.name.len()].copy_from_slice(self.name.as_bytes());
        h
    }

    fn decode(h: &[u8]) -> Result<Header, String> {
        if h.len() < HEADER_SIZE as usize || &h[0..8] != MAGIC {
            return Err("not a ringblk bitmap (bad magic)".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap());
        if u32_at(8) != VERSION {
            return Err(format!("version {} (this ringblk reads 1)", u32_at(8)));
        }
        let flags = u32_at(12);
        if flags & !(FLAG_IN_USE | FLAG_INCONSISTENT) != 0 {
            return Err(format!("unknown flags {flags:#x}"));
        }
        let shift = u32_at(24);
        granularity_shift(1u64.checked_shl(shift).unwrap_or(0))
            .map_err(|_| format!("granularity 2^{shift} out of range"))?;
        let name_len = usize::from(u16::from_le_bytes([h[88], h[89]]));
        if name_len > super::MAX_NAME_LEN {
            return Err(format!("name length {name_len}"));
        }
        let name = std::str::from_utf8(&h[90..90 + name_len])
            .map_err(|_| "name is not UTF-8".to_string())?
            .to_string();
        let header = Header {
            flags,
            disk_size: u64_at(16),
            shift,
            boot_id: h[48..84].try_into().unwrap(),
            name,
        };
        if u64_at(32) != HEADER_SIZE || u64_at(40) != header.bits_len() {
            return Err("bits offset or length do not match the size".into());
        }
        Ok(header)
    }
}

/// The bitmaps of one image, each in its sidecar file.
pub struct SidecarStore {
    dir: PathBuf,
    /// The directory, opened at start-up: what later creations and
    /// removals go through.
    dir_fd: File,
    stem: String,
    boot_id: [u8; BOOT_ID_LEN],
    /// Every sidecar of the image by bitmap name, open since start-up or
    /// since its `add`.
    files: BTreeMap<String, File>,
    /// Sidecars found at start-up that cannot be opened or read (not a
    /// regular file, a symlink, no permission): why, in one line naming
    /// the file and the fix. [`peek`](BitmapStore::peek) and
    /// [`open`](BitmapStore::open) fail with it: such a bitmap is never
    /// left out silently, nor found later as if nothing had changed.
    unusable: BTreeMap<String, String>,
}

impl SidecarStore {
    /// The store for `image`: sidecars next to it, or in `dir`. Names them
    /// after the image's file name.
    pub fn for_image(image: &Path, dir: Option<&Path>) -> Result<SidecarStore, BitmapError> {
        let stem =
            image
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| BitmapError::Corrupt {
                    path: image.display().to_string(),
                    why: "the image path has no UTF-8 file name".into(),
                })?;
        let dir = match dir {
            Some(d) => d.to_path_buf(),
            None => match image.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            },
        };
        SidecarStore::new(&dir, stem)
    }

    /// The store of sidecars `dir/stem.bitmap.NAME`: opens the directory
    /// and every sidecar in it (nothing but the magic is read, nothing is
    /// marked yet). Removes what an `add` that did not finish left: a
    /// file with no magic yet, or a temporary `.stem.bitmap.NAME.new` of
    /// an older ringblk. A sidecar that cannot be opened (see
    /// [`open_sidecar`]) is kept as the reason why, which `peek` and
    /// `open` then fail with: `Err` here is about the directory only.
    pub fn new(dir: &Path, stem: &str) -> Result<SidecarStore, BitmapError> {
        let boot_id = crate::host::boot_id().map_err(|source| BitmapError::Io {
            path: "/proc/sys/kernel/random/boot_id".into(),
            source,
        })?;
        let dir_fd = File::open(dir).map_err(Self::io_err(dir))?;
        let mut store = SidecarStore {
            dir: dir.to_path_buf(),
            dir_fd,
            stem: stem.to_string(),
            boot_id,
            files: BTreeMap::new(),
            unusable: BTreeMap::new(),
        };
        let prefix = format!("{stem}.bitmap.");
        let stale = format!(".{prefix}");
        let entries = fs::read_dir(dir).map_err(Self::io_err(dir))?;
        for entry in entries {
            let entry = entry.map_err(Self::io_err(dir))?;
            let Some(file_name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if file_name.starts_with(&stale) && file_name.ends_with(".new") {
                let _ = fs::remove_file(entry.path());
                continue;
            }
            let Some(name) = file_name.strip_prefix(&prefix) else {
                continue;
            };
            if check_name(name).is_err() {
                continue;
            }
            let path = store.path_of(name);
            let file = match open_sidecar(&store.dir_fd, &file_name, &path, &entry) {
                Ok(f) => f,
                Err(why) => {
                    store.unusable.insert(name.to_string(), why);
                    continue;
                }
            };
            let mut magic = [0u8; 8];
            let read = match read_magic(&file, &mut magic) {
                Ok(n) => n,
                Err(e) => {
                    let why = format!(
                        "{}: reading it: {e}; remove it (and take a full backup) to start",
                        path.display()
                    );
                    store.unusable.insert(name.to_string(), why);
                    continue;
                }
            };
            if read == 0 || (read == magic.len() && magic == [0; 8]) {
                // What an `add` leaves before it writes its magic (an empty
                // file, or one allocated with the rest of its header but
                // not the magic); or a bitmap that another program emptied
                // while no daemon had it. Either way there is no bitmap to
                // load: said, so that a backup tool that finds it missing
                // knows why.
                log::warn!(
                    "removing {}: empty, or without its magic: a bitmap whose creation did not finish, or one that another program emptied (then bitmap '{name}' is gone: take a full backup)",
                    path.display()
                );
                if let Err(e) = unlink_at(&store.dir_fd, &file_name) {
                    let why = format!(
                        "{}: removing it (empty, or without its magic): {e}: remove it to start",
                        path.display()
                    );
                    store.unusable.insert(name.to_string(), why);
                }
                continue;
            }
            if read < magic.len() {
                let why = format!(
                    "{}: {read} bytes long, not a bitmap (nor one being created): remove it to start",
                    path.display()
                );
                store.unusable.insert(name.to_string(), why);
                continue;
            }
            store.files.insert(name.to_string(), file);
        }
        Ok(store)
    }

    /// Pretends to run in the boot `boot_id`: how a test simulates the
    /// host stopping and starting again.
    pub fn with_boot_id(mut self, boot_id: &str) -> SidecarStore {
        let mut id = [b'0'; BOOT_ID_LEN];
        let n = boot_id.len().min(BOOT_ID_LEN);
        id[..n].copy_from_slice(&boot_id.as_bytes()[..n]);
        self.boot_id = id;
        self
    }

    /// The directory the sidecars are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The directory's descriptor: the only one the daemon creates
    /// (`openat` with [`CREATE_FLAGS`]) and removes (`unlinkat`) sidecars
    /// in after start-up.
    pub fn dir_fd(&self) -> RawFd {
        self.dir_fd.as_raw_fd()
    }

    /// The sidecar of bitmap `name`.
    pub fn path_of(&self, name: &str) -> PathBuf {
        self.dir.join(self.file_name(name))
    }

    fn file_name(&self, name: &str) -> String {
        format!("{}.bitmap.{name}", self.stem)
    }

    fn io_err(path: &Path) -> impl FnOnce(io::Error) -> BitmapError + '_ {
        move |source| BitmapError::Io {
            path: path.display().to_string(),
            source,
        }
    }

    fn sync_dir(&self) -> Result<(), BitmapError> {
        self.dir_fd.sync_all().map_err(Self::io_err(&self.dir))
    }

    fn write_header(file: &File, path: &Path, header: &Header) -> Result<(), BitmapError> {
        file.write_all_at(&header.encode(), 0)
            .and_then(|()| file.sync_data())
            .map_err(Self::io_err(path))
    }

    fn file(&self, name: &str) -> Result<&File, BitmapError> {
        if let Some(why) = self.unusable.get(name) {
            return Err(BitmapError::Unusable(why.clone()));
        }
        self.files
            .get(name)
            .ok_or_else(|| BitmapError::NotFound(name.to_string()))
    }

    /// Reads and checks a sidecar's header, for a disk of `disk_size`
    /// bytes: nothing is sized by what the header says. A file shorter
    /// than its header needs is refused when the header is of this disk's
    /// size; one of another size is resized (and distrusted) by `open`,
    /// and read only as far as it goes by `peek`.
    fn read_header(&self, name: &str, disk_size: u64) -> Result<(Header, u64), BitmapError> {
        let path = self.path_of(name);
        let corrupt = |why: String| BitmapError::Corrupt {
            path: path.display().to_string(),
            why,
        };
        let file = self.file(name)?;
        let meta = file.metadata().map_err(Self::io_err(&path))?;
        if !meta.is_file() {
            return Err(corrupt("not a regular file".into()));
        }
        let mut raw = vec![0u8; HEADER_SIZE as usize];
        file.read_exact_at(&mut raw, 0)
            .map_err(|e| corrupt(format!("reading the header: {e}")))?;
        let header = Header::decode(&raw).map_err(corrupt)?;
        if header.name != name {
            return Err(corrupt(format!(
                "holds bitmap '{}', not '{name}'",
                header.name.escape_debug()
            )));
        }
        if header.disk_size == disk_size && meta.len() < header.file_len() {
            return Err(corrupt(format!(
                "{} bytes long, short of {}",
                meta.len(),
                header.file_len()
            )));
        }
        Ok((header, meta.len()))
    }

    /// Whether a header found on disk can be trusted: not marked
    /// inconsistent, and not left in use by another boot.
    fn trusted(&self, header: &Header) -> bool {
        let crashed_host = header.flags & FLAG_IN_USE != 0 && header.boot_id != self.boot_id;
        header.flags & FLAG_INCONSISTENT == 0 && !crashed_host
    }

    /// Maps a sidecar's bits and makes the bitmap.
    fn map(
        file: &File,
        path: &Path,
        header: &Header,
        consistent: bool,
    ) -> Result<DirtyBitmap, BitmapError> {
        let map = MmapOptions::new()
            .offset(HEADER_SIZE)
            .len(header.map_len() as usize)
            .map_raw(file)
            .map_err(Self::io_err(path))?;
        let shown = path.display().to_string();
        DirtyBitmap::mapped(header.disk_size, header.shift, map, &shown, consistent)
            .map_err(|why| BitmapError::Corrupt { path: shown, why })
    }

    /// Loads one sidecar and marks it in use: see the module doc.
    fn open_one(&self, name: &str, disk_size: u64) -> Result<DirtyBitmap, BitmapError> {
        let path = self.path_of(name);
        let (mut header, file_len) = self.read_header(name, disk_size)?;
        let file = self.file(name)?;
        let mut consistent = self.trusted(&header);
        if !consistent && header.flags & FLAG_IN_USE != 0 && header.boot_id != self.boot_id {
            log::warn!(
                "bitmap '{name}' ({}) was in use when the host stopped: marked inconsistent",
                path.display()
            );
        }
        let old_size = header.disk_size;
        if old_size != disk_size {
            log::warn!(
                "bitmap '{name}' ({}) covers a disk of {old_size} bytes, this one has {disk_size}: resized, and marked inconsistent (changes made while it was not in use are not in it)",
                path.display()
            );
            consistent = false;
            header.disk_size = disk_size;
            Self::grow_file(file, &path, &header, file_len)?;
        }
        if !consistent {
            header.flags |= FLAG_INCONSISTENT;
        }
        header.flags |= FLAG_IN_USE;
        header.boot_id = self.boot_id;
        Self::write_header(file, &path, &header)?;
        let bitmap = Self::map(file, &path, &header, consistent)?;
        if old_size != disk_size {
            bitmap.trim();
            bitmap.mark_grown(old_size);
        }
        Ok(bitmap)
    }

    /// Makes the file long enough for `header`, allocated. Never shorter:
    /// a mapping of its old length may still be alive.
    fn grow_file(
        file: &File,
        path: &Path,
        header: &Header,
        file_len: u64,
    ) -> Result<(), BitmapError> {
        if file_len < header.file_len() {
            allocate(file, header.file_len()).map_err(Self::io_err(path))?;
        }
        Ok(())
    }

    /// Before a header is written over a bitmap that is loaded: if its
    /// file shrank under the mapping (another program truncated it; see
    /// [`fault`](super::fault)), makes it whole again, writes every bit
    /// the bitmap holds into it, and marks the bitmap inconsistent (bits
    /// were lost). Nothing for a file of its length whose mapping never
    /// faulted. Returns whether it did anything: at every store of a
    /// mapping that faulted, since what is marked in its replaced pages
    /// reaches the file only so.
    fn restore_if_shrunk(
        file: &File,
        path: &Path,
        header: &Header,
        bitmap: &DirtyBitmap,
    ) -> Result<bool, BitmapError> {
        let len = file.metadata().map_err(Self::io_err(path))?.len();
        // Logs its ERROR line the first time it finds a fault.
        let faulted = bitmap.mapping_lost();
        if len >= header.file_len() && !faulted {
            return Ok(false);
        }
        if !faulted {
            log::error!(
                "{}: the bitmap file was truncated to {len} bytes while the daemon had it mapped (by another program): its bits are lost, and it is inconsistent from now on (take a full backup); written out whole again",
                path.display()
            );
        }
        bitmap.set_inconsistent();
        // Allocated first, so that reading the bits below finds the
        // pages that were cut off again (zeroes) rather than a fault.
        allocate(file, header.file_len()).map_err(Self::io_err(path))?;
        let mut buf = Vec::with_capacity(1 << 20);
        let mut at = HEADER_SIZE;
        for w in bitmap.words() {
            buf.extend_from_slice(&w.to_le_bytes());
            if buf.len() == buf.capacity() {
                file.write_all_at(&buf, at).map_err(Self::io_err(path))?;
                at += buf.len() as u64;
                buf.clear();
            }
        }
        file.write_all_at(&buf, at).map_err(Self::io_err(path))?;
        Ok(true)
    }

    fn header_of(
        &self,
        name: &str,
        bitmap: &DirtyBitmap,
        in_use: bool,
        consistent: bool,
    ) -> Header {
        let mut flags = if in_use { FLAG_IN_USE } else { 0 };
        if !consistent {
            flags |= FLAG_INCONSISTENT;
        }
        Header {
            flags,
            disk_size: bitmap.disk_size(),
            shift: bitmap.granularity().trailing_zeros(),
            boot_id: self.boot_id,
            name: name.to_string(),
        }
    }
}

/// Opens the sidecar `name` found in `dir` at start-up (`entry`, its
/// directory entry; `path`, for messages): read-write, never through a
/// symlink (`O_NOFOLLOW`), never blocking on a FIFO (`O_NONBLOCK`, which
/// changes nothing for the regular file it must then be: checked with
/// fstat on what was opened). `Err` is one line naming the file and what
/// to do: a bitmap that exists but cannot be opened must stop the start,
/// never leave the image silently untracked.
fn open_sidecar(dir: &File, name: &str, path: &Path, entry: &fs::DirEntry) -> Result<File, String> {
    let shown = path.display();
    let not_a_file = |what: &str| {
        format!(
            "{shown}: {what}, not a bitmap file (ringblk keeps each bitmap in a regular file of its own): remove it, or move it out of the way, to start"
        )
    };
    let flags = libc::O_RDWR | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    let file = match open_at(dir, name, flags) {
        Ok(f) => f,
        Err(e) => {
            // What is there, as the directory says (not following a link).
            let meta = entry.metadata().ok();
            return Err(match e.raw_os_error() {
                Some(libc::ELOOP) => format!(
                    "{shown}: a symbolic link (bitmap files are never followed through links): remove it, or put the file itself there, to start"
                ),
                Some(libc::EISDIR) => not_a_file("a directory"),
                Some(libc::EACCES | libc::EPERM | libc::EROFS) => {
                    use std::os::unix::fs::MetadataExt;
                    // SAFETY: geteuid and getegid take no arguments and
                    // cannot fail.
                    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
                    let owner = meta.map_or(String::new(), |m| {
                        format!(
                            " (owned by uid {} gid {}, mode {:04o})",
                            m.uid(),
                            m.gid(),
                            m.mode() & 0o7777
                        )
                    });
                    format!(
                        "{shown}: {e}{owner}: the daemon (uid {uid} gid {gid}) must read and write its bitmaps: `chown {uid}:{gid} {shown}` and `chmod 0600 {shown}`, or remove it (the bitmap with it) to start"
                    )
                }
                _ => format!("{shown}: {e}: fix or remove it to start"),
            });
        }
    };
    let meta = file
        .metadata()
        .map_err(|e| format!("{shown}: {e}: fix or remove it to start"))?;
    let kind = meta.file_type();
    if kind.is_file() {
        return Ok(file);
    }
    use std::os::unix::fs::FileTypeExt;
    Err(not_a_file(if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_block_device() || kind.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    }))
}

/// Reads up to the 8 bytes of a sidecar's magic: how many there are.
fn read_magic(file: &File, magic: &mut [u8; 8]) -> io::Result<usize> {
    let mut read = 0;
    while read < magic.len() {
        match file.read_at(&mut magic[read..], read as u64) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(read)
}

/// Allocates the first `len` bytes of `file` (zeroes where nothing was
/// written), so that no later write to its mapping needs a block.
fn allocate(file: &File, len: u64) -> io::Result<()> {
    let l = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: fallocate takes no pointers; the fd is open for writing.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, l) } == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
        return Err(e);
    }
    // A file system without fallocate: write zeroes where the file is not
    // yet that long.
    let start = file.metadata()?.len();
    let zeroes = vec![0u8; 1 << 20];
    let mut off = start;
    while off < len {
        let n = (len - off).min(zeroes.len() as u64) as usize;
        file.write_all_at(&zeroes[..n], off)?;
        off += n as u64;
    }
    Ok(())
}

impl BitmapStore for SidecarStore {
    fn location(&self) -> String {
        format!("sidecar files in {}", self.dir.display())
    }

    /// Reads each bitmap into memory of this disk's size: the words both
    /// the header and this disk have, and the file holds, read a MiB at a
    /// time. What the header claims sizes nothing.
    fn peek(&mut self, disk_size: u64) -> Result<Vec<BitmapInfo>, BitmapError> {
        if let Some(why) = self.unusable.values().next() {
            return Err(BitmapError::Unusable(why.clone()));
        }
        let mut out = Vec::new();
        for name in self.files.keys() {
            let (header, file_len) = self.read_header(name, disk_size)?;
            let path = self.path_of(name);
            let consistent = self.trusted(&header) && header.disk_size == disk_size;
            let b = DirtyBitmap::new(disk_size, 1 << header.shift)?;
            let words = b.words.as_slice();
            let stored = header.bits_len().min(file_len.saturating_sub(HEADER_SIZE)) / 8;
            let n = words
                .len()
                .min(usize::try_from(stored).unwrap_or(usize::MAX));
            let mut raw = vec![0u8; n.min(1 << 17) * 8];
            let file = self.file(name)?;
            for (i, chunk) in words[..n].chunks(1 << 17).enumerate() {
                let raw = &mut raw[..chunk.len() * 8];
                file.read_exact_at(raw, HEADER_SIZE + (i as u64) * (8 << 17))
                    .map_err(Self::io_err(&path))?;
                for (w, v) in chunk.iter().zip(raw.chunks_exact(8)) {
                    w.store(u64::from_le_bytes(v.try_into().unwrap()), Ordering::Relaxed);
                }
            }
            b.trim();
            if !consistent {
                b.set_inconsistent();
            }
            b.mark_grown(header.disk_size);
            out.push(b.info(name));
        }
        Ok(out)
    }

    fn open(&mut self, disk_size: u64) -> Vec<(String, Result<DirtyBitmap, BitmapError>)> {
        let unusable = self
            .unusable
            .iter()
            .map(|(name, why)| (name.clone(), Err(BitmapError::Unusable(why.clone()))));
        let loaded: Vec<_> = self
            .files
            .keys()
            .map(|name| (name.clone(), self.open_one(name, disk_size)))
            .collect();
        let mut all: Vec<_> = unusable.chain(loaded).collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    fn add(
        &mut self,
        name: &str,
        granularity: u64,
        disk_size: u64,
    ) -> Result<DirtyBitmap, BitmapError> {
        check_name(name)?;
        let shift = granularity_shift(granularity)?;
        if self.files.contains_key(name) {
            return Err(BitmapError::Exists(name.to_string()));
        }
        let header = Header {
            flags: FLAG_IN_USE,
            disk_size,
            shift,
            boot_id: self.boot_id,
            name: name.to_string(),
        };
        let path = self.path_of(name);
        let file = match open_at(&self.dir_fd, &self.file_name(name), CREATE_FLAGS) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(BitmapError::Corrupt {
                    path: path.display().to_string(),
                    why: "exists, and is not a bitmap of this image's (remove it first)".into(),
                });
            }
            Err(e) => return Err(Self::io_err(&path)(e)),
        };
        // The magic last: a crash before it leaves a file that the next
        // start removes, never one that passes for a bitmap.
        let mut encoded = header.encode();
        encoded[0..8].fill(0);
        let made = allocate(&file, header.file_len())
            .and_then(|()| file.write_all_at(&encoded, 0))
            .and_then(|()| file.sync_all())
            .and_then(|()| file.write_all_at(MAGIC, 0))
            .and_then(|()| file.sync_data());
        if let Err(e) = made {
            let _ = unlink_at(&self.dir_fd, &self.file_name(name));
            return Err(Self::io_err(&path)(e));
        }
        self.sync_dir()?;
        let bitmap = Self::map(&file, &path, &header, true)?;
        self.files.insert(name.to_string(), file);
        Ok(bitmap)
    }

    fn remove(&mut self, name: &str) -> Result<(), BitmapError> {
        check_name(name)?;
        if !self.files.contains_key(name) {
            return Err(BitmapError::NotFound(name.to_string()));
        }
        let path = self.path_of(name);
        match unlink_at(&self.dir_fd, &self.file_name(name)) {
            Ok(()) => {}
            // Removed behind our back: gone all the same.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Self::io_err(&path)(e)),
        }
        self.files.remove(name);
        self.sync_dir()
    }

    fn update(
        &mut self,
        name: &str,
        bitmap: &DirtyBitmap,
        consistent: bool,
    ) -> Result<(), BitmapError> {
        let path = self.path_of(name);
        let file = self.file(name)?;
        let header = self.header_of(name, bitmap, true, consistent);
        let lost = Self::restore_if_shrunk(file, &path, &header, bitmap)?;
        let consistent = consistent && !lost;
        if consistent {
            // The bits must be on disk before the header says they can
            // be trusted.
            bitmap.sync().map_err(Self::io_err(&path))?;
        }
        let header = self.header_of(name, bitmap, true, consistent);
        Self::write_header(file, &path, &header)
    }

    fn resize(
        &mut self,
        name: &str,
        bitmap: &DirtyBitmap,
        disk_size: u64,
    ) -> Result<DirtyBitmap, BitmapError> {
        let path = self.path_of(name);
        // Inconsistent on disk until the new size and bits are: a crash in
        // between leaves a bitmap the next open resizes and distrusts.
        self.update(name, bitmap, false)?;
        let file = self.file(name)?;
        let file_len = file.metadata().map_err(Self::io_err(&path))?.len();
        let mut header = self.header_of(name, bitmap, true, false);
        header.disk_size = disk_size;
        Self::grow_file(file, &path, &header, file_len)?;
        let resized = Self::map(file, &path, &header, bitmap.is_consistent())?;
        resized.trim();
        resized.mark_grown(bitmap.disk_size());
        let consistent = resized.is_consistent();
        self.update(name, &resized, consistent)?;
        Ok(resized)
    }

    fn close(&mut self, name: &str, bitmap: &DirtyBitmap) -> Result<(), BitmapError> {
        let path = self.path_of(name);
        let file = self.file(name)?;
        let header = self.header_of(name, bitmap, false, false);
        let lost = Self::restore_if_shrunk(file, &path, &header, bitmap)?;
        bitmap.sync().map_err(Self::io_err(&path))?;
        let header = self.header_of(name, bitmap, false, bitmap.is_consistent() && !lost);
        Self::write_header(file, &path, &header)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 64 << 10;
    const SIZE: u64 = 1000 * G + 4096;

    fn store(dir: &Path) -> SidecarStore {
        SidecarStore::new(dir, "disk.img").unwrap()
    }

    /// `open`, every bitmap loaded.
    fn load(s: &mut SidecarStore, size: u64) -> Vec<(String, DirtyBitmap)> {
        s.open(size)
            .into_iter()
            .map(|(n, b)| (n, b.unwrap()))
            .collect()
    }

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = Header {
            flags: FLAG_IN_USE,
            disk_size: SIZE,
            shift: 16,
            boot_id: *b"0f4ab3c9-b975-43b8-9f11-06ed0dc3a861",
            name: "nightly".into(),
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[0] = b'X';
        assert!(Header::decode(&bad).is_err());
        let mut bad = h.encode();
        bad[12] = 0x80;
        assert!(Header::decode(&bad).is_err(), "unknown flag accepted");
        let mut bad = h.encode();
        bad[24] = 8; // 256-byte granularity
        assert!(Header::decode(&bad).is_err());
        let mut bad = h.encode();
        bad[40] ^= 8; // bits length off by a word
        assert!(Header::decode(&bad).is_err());
        let mut bad = h.encode();
        bad[88] = 200; // name too long
        assert!(Header::decode(&bad).is_err());
        assert!(Header::decode(&[0u8; 100]).is_err());
    }

    #[test]
    fn clean_close_and_reopen_keeps_bits() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        let b = s.add("nightly", G, SIZE).unwrap();
        b.mark(3 * G, 1);
        b.mark(999 * G, 2 * G); // includes the partial last granule
        assert!(matches!(
            s.add("nightly", G, SIZE),
            Err(BitmapError::Exists(_))
        ));
        s.close("nightly", &b).unwrap();
        drop(b);

        let mut s = store(dir.path());
        let peeked = s.peek(SIZE).unwrap();
        assert_eq!(
            peeked,
            [BitmapInfo {
                name: "nightly".into(),
                granularity: G,
                dirty_bytes: 2 * G + 4096,
                consistent: true
            }]
        );
        let loaded = load(&mut s, SIZE);
        assert_eq!(loaded.len(), 1);
        let (name, b) = &loaded[0];
        assert_eq!(name, "nightly");
        assert!(b.is_consistent());
        assert_eq!(b.dirty_extents(), [(3 * G, G), (999 * G, G + 4096)]);
    }

    /// In use, same boot (the process died): complete. In use, another
    /// boot (the host died): inconsistent, and it stays so across a clean
    /// close until cleared.
    #[test]
    fn in_use_is_complete_in_the_same_boot_and_inconsistent_after_another() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        let b = s.add("a", G, SIZE).unwrap();
        b.mark(0, G);
        drop(b);
        drop(s); // no close: as after kill -9

        let mut s = store(dir.path());
        let loaded = load(&mut s, SIZE);
        assert!(loaded[0].1.is_consistent(), "same boot: complete");
        assert_eq!(loaded[0].1.dirty_bytes(), G);
        drop(loaded);
        drop(s); // again no close

        let mut s = store(dir.path()).with_boot_id("another-boot");
        assert!(!s.peek(SIZE).unwrap()[0].consistent, "peek says so too");
        let loaded = load(&mut s, SIZE);
        let (name, b) = &loaded[0];
        assert!(!b.is_consistent(), "another boot: inconsistent");
        s.close(name, b).unwrap();
        let mut s = store(dir.path());
        let loaded = load(&mut s, SIZE);
        let (name, b) = &loaded[0];
        assert!(!b.is_consistent(), "inconsistency is sticky");
        b.clear();
        s.update(name, b, true).unwrap();
        s.close(name, b).unwrap();
        let loaded = load(&mut store(dir.path()).with_boot_id("third"), SIZE);
        assert!(
            loaded[0].1.is_consistent(),
            "a cleared bitmap, closed cleanly"
        );
    }

    /// What `update` stores while a backup holds bits taken out of the
    /// bitmap: found so after a kill -9, the bitmap is inconsistent.
    #[test]
    fn a_bitmap_left_inconsistent_on_disk_is_found_inconsistent() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        let b = s.add("a", G, SIZE).unwrap();
        b.mark(0, G);
        s.update("a", &b, false).unwrap();
        assert!(b.is_consistent(), "in memory it stays as it was");
        drop(s); // kill -9
        let loaded = load(&mut store(dir.path()), SIZE);
        assert!(!loaded[0].1.is_consistent());
    }

    #[test]
    fn remove_and_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        let b = s.add("x", 512, 1 << 20).unwrap();
        s.close("x", &b).unwrap();
        s.remove("x").unwrap();
        assert!(matches!(s.remove("x"), Err(BitmapError::NotFound(_))));
        assert!(matches!(s.add("../x", G, SIZE), Err(BitmapError::Name(_))));
        assert!(s.open(1 << 20).is_empty());

        // A stale temporary file and an unfinished add are removed, a
        // foreign file is refused with its name.
        fs::write(dir.path().join(".disk.img.bitmap.y.new"), b"junk").unwrap();
        fs::write(dir.path().join("disk.img.bitmap.u"), vec![0u8; 8192]).unwrap();
        fs::write(dir.path().join("disk.img.bitmap.z"), vec![1u8; 8192]).unwrap();
        let mut s = store(dir.path());
        assert!(!dir.path().join(".disk.img.bitmap.y.new").exists());
        assert!(!dir.path().join("disk.img.bitmap.u").exists());
        let e = s.peek(1 << 20).unwrap_err().to_string();
        assert!(
            e.contains("disk.img.bitmap.z") && e.contains("bad magic"),
            "{e}"
        );
        let opened = s.open(1 << 20);
        assert!(opened[0].1.is_err(), "a foreign file is never mapped");
        // A file in the way of an add is not taken over.
        let e = s.add("z", G, SIZE).unwrap_err().to_string();
        assert!(e.contains("exists"), "{e}");
        fs::remove_file(dir.path().join("disk.img.bitmap.z")).unwrap();

        let mut s = store(dir.path());
        let b = s.add("w", G, SIZE).unwrap();
        s.close("w", &b).unwrap();
        // Truncated: refused, never mapped short.
        let f = fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("disk.img.bitmap.w"))
            .unwrap();
        f.set_len(HEADER_SIZE + 100).unwrap();
        let e = store(dir.path()).open(SIZE).remove(0).1.unwrap_err();
        assert!(e.to_string().contains("short of"), "{e}");
    }

    /// A sidecar that exists but cannot be opened (a FIFO, a directory,
    /// a dangling symlink, a file of a few bytes) makes `peek` and `open`
    /// fail with one line naming it and the fix; the FIFO is not waited
    /// on. They used to make `new` fail, which left the image untracked.
    #[test]
    fn files_that_cannot_be_opened_are_refused_by_name() {
        for kind in ["fifo", "dir", "symlink", "short"] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("disk.img.bitmap.b");
            match kind {
                "fifo" => {
                    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
                    // SAFETY: a NUL-terminated path that outlives the call.
                    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
                }
                "dir" => fs::create_dir(&path).unwrap(),
                "symlink" => std::os::unix::fs::symlink("nowhere", &path).unwrap(),
                _ => fs::write(&path, b"RING").unwrap(),
            }
            let mut s = SidecarStore::new(dir.path(), "disk.img").expect(kind);
            let e = s.peek(SIZE).unwrap_err().to_string();
            assert!(
                e.contains("disk.img.bitmap.b") && e.contains("remove it") && !e.contains('\n'),
                "{kind}: {e}"
            );
            let opened = s.open(SIZE);
            assert_eq!(opened.len(), 1, "{kind}");
            assert!(opened[0].1.is_err(), "{kind}: loaded");
            assert!(fs::symlink_metadata(&path).is_ok(), "{kind}: removed");
        }
    }

    /// A header that claims a huge disk costs nothing of its claim: `peek`
    /// reads no more than this disk's bits, and no more than the file
    /// has; the bitmap is resized and inconsistent.
    #[test]
    fn a_header_claiming_a_huge_disk_costs_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        let b = s.add("h", G, SIZE).unwrap();
        b.mark(0, G);
        s.close("h", &b).unwrap();
        drop((b, s));
        let path = dir.path().join("disk.img.bitmap.h");
        let mut raw = fs::read(&path).unwrap();
        let header = Header {
            flags: 0,
            disk_size: 1 << 60,
            shift: 16,
            boot_id: [b'0'; BOOT_ID_LEN],
            name: "h".into(),
        };
        raw[..HEADER_SIZE as usize].copy_from_slice(&header.encode());
        // 2 TiB of bits claimed, 8 KiB there.
        fs::write(&path, &raw).unwrap();
        let mut s = store(dir.path());
        let info = s.peek(SIZE).unwrap();
        assert!(!info[0].consistent);
        assert_eq!(info[0].dirty_bytes, G, "the bits the file has");
        let loaded = load(&mut s, SIZE);
        assert!(!loaded[0].1.is_consistent());
        assert!(loaded[0].1.is_dirty(0));
        assert_eq!(loaded[0].1.disk_size(), SIZE);
    }

    /// A file truncated under its mapping, found short by the next
    /// `update` (a backup's start stores "inconsistent"): it is made
    /// whole again, so that after a kill -9 the next start loads it
    /// inconsistent instead of refusing a short file. Nothing touched the
    /// cut-off page meanwhile, so no fault is needed here.
    #[test]
    fn a_file_truncated_under_its_mapping_is_restored_at_the_next_update() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        let b = s.add("u", G, SIZE).unwrap();
        fs::OpenOptions::new()
            .write(true)
            .open(s.path_of("u"))
            .unwrap()
            .set_len(0)
            .unwrap();
        s.update("u", &b, false).unwrap();
        assert!(!b.is_consistent());
        b.mark(7 * G, 1);
        drop((b, s)); // kill -9
        let loaded = load(&mut store(dir.path()), SIZE);
        assert!(!loaded[0].1.is_consistent());
        assert_eq!(loaded[0].1.dirty_extents(), [(7 * G, G)]);
    }

    /// A bitmap of another disk size (the image was resized while no
    /// daemon held it) is resized and distrusted; one resized while in use
    /// keeps its bits and its trust, the grown part dirty.
    #[test]
    fn resizes() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        let b = s.add("r", G, SIZE).unwrap();
        b.mark(5 * G, 1);
        let b = s.resize("r", &b, 2 * SIZE).unwrap();
        assert!(b.is_consistent());
        assert_eq!(b.disk_size(), 2 * SIZE);
        assert_eq!(b.dirty_extents(), [(5 * G, G), (1000 * G, SIZE + 4096)]);
        let b = s.resize("r", &b, 10 * G + 512).unwrap();
        assert_eq!(b.dirty_extents(), [(5 * G, G)]);
        s.close("r", &b).unwrap();
        drop((b, s));
        let mut s = store(dir.path());
        let loaded = load(&mut s, 10 * G + 512);
        assert!(loaded[0].1.is_consistent());
        assert_eq!(loaded[0].1.dirty_extents(), [(5 * G, G)]);
        s.close("r", &loaded[0].1).unwrap();
        drop((loaded, s));
        let mut s = store(dir.path());
        assert!(!s.peek(20 * G).unwrap()[0].consistent);
        let loaded = load(&mut s, 20 * G);
        let b = &loaded[0].1;
        assert!(!b.is_consistent(), "resized while not in use");
        assert_eq!(b.dirty_extents(), [(5 * G, G), (10 * G, 10 * G)]);
    }

    #[test]
    fn sidecars_are_fully_allocated_and_private() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        let _b = s.add("big", 512, 1 << 30).unwrap();
        let meta = fs::metadata(s.path_of("big")).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        // 2^21 bits: 256 KiB of bits, all allocated.
        assert!(meta.blocks() * 512 >= HEADER_SIZE + (256 << 10), "{meta:?}");
    }
}
