//! Opening the exported image: a regular file or a block device.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use vmm_sys_util::ioctl::ioctl_with_mut_ref;
use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr};

ioctl_ior_nr!(BLKGETSIZE64, 0x12, 114, u64);
// Writes an int, the logical block size; `_IO` all the same.
ioctl_io_nr!(BLKSSZGET, 0x12, 104);
// The kernel reads a [start, len] pair of u64s; `_IO` all the same.
ioctl_io_nr!(BLKDISCARD, 0x12, 119);

/// Why an image cannot be served. Each message fits on one line.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image {0} does not exist")]
    Missing(PathBuf),
    #[error("image {0} is a symbolic link; refusing to follow it")]
    Symlink(PathBuf),
    #[error("permission denied opening image {0}")]
    PermissionDenied(PathBuf),
    #[error("image {0} is neither a regular file nor a block device")]
    NotAFileOrDevice(PathBuf),
    #[error("image {path} is empty")]
    Empty { path: PathBuf },
    #[error(
        "--block-size {block_size} is smaller than the {dio_align}-byte blocks that O_DIRECT needs on image {path}"
    )]
    BlockSizeTooSmall {
        path: PathBuf,
        block_size: u32,
        dio_align: u32,
    },
    #[error("image {path} has {size} bytes, not a multiple of the {block_size}-byte block size")]
    NotMultiple {
        path: PathBuf,
        size: u64,
        block_size: u32,
    },
    #[error("cannot {what} image {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// The size of an open image in bytes: BLKGETSIZE64 on a block device,
/// else the file's length. Read at start-up and again by an online resize.
pub fn device_size(file: &File, is_block_device: bool) -> io::Result<u64> {
    if !is_block_device {
        return Ok(file.metadata()?.len());
    }
    let mut size = 0u64;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which
    // points to a live local; the fd is open.
    let ret = unsafe { ioctl_with_mut_ref(file, BLKGETSIZE64(), &mut size) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// How to open the image.
#[derive(Clone, Copy, Debug, Default)]
pub struct ImageOptions {
    pub readonly: bool,
    pub direct: bool,
    /// The guest's logical block size; None: the image's own (see
    /// [`Image::block_size`]).
    pub block_size: Option<u32>,
    /// Refuse a symlink instead of following it (O_NOFOLLOW): for a path
    /// the daemon picked itself. One the operator gave may be a link.
    pub nofollow: bool,
    /// The file holds an image format (qcow2), whose own size the guest
    /// sees: the file's size need not be a multiple of the block size.
    pub formatted: bool,
}

/// An open image.
#[derive(Debug)]
pub struct Image {
    pub file: File,
    pub path: PathBuf,
    /// Size in bytes.
    pub size: u64,
    pub is_block_device: bool,
    /// The logical block size to report: the one asked for, else a block
    /// device's own logical block size (a 4Kn disk is 4096), else for an
    /// O_DIRECT file what its file system needs, else 512.
    pub block_size: u32,
    /// What O_DIRECT needs of offsets, lengths and buffers here: the
    /// device's logical block size, or the file's STATX_DIOALIGN (at least
    /// 512). Misaligned guest buffers are bounced.
    pub dio_align: u32,
    /// Device and inode numbers: a stable identity for the default serial.
    pub dev_ino: (u64, u64),
    /// The block device the I/O lands on: the image itself, or the one
    /// holding its file system.
    pub io_dev: u64,
}

impl Image {
    /// Opens `path` and checks its size against the block size.
    pub fn open(path: &Path, opts: ImageOptions) -> Result<Image, ImageError> {
        let mut oo = OpenOptions::new();
        oo.read(true).write(!opts.readonly);
        let direct = if opts.direct { libc::O_DIRECT } else { 0 };
        let nofollow = if opts.nofollow { libc::O_NOFOLLOW } else { 0 };
        // O_NONBLOCK: a FIFO at the path is refused below, not waited on
        // in open(2); cleared once the file is known to be an image.
        oo.custom_flags(direct | nofollow | libc::O_NONBLOCK);
        let file = oo.open(path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => ImageError::Missing(path.to_owned()),
            io::ErrorKind::PermissionDenied => ImageError::PermissionDenied(path.to_owned()),
            _ if opts.nofollow && e.raw_os_error() == Some(libc::ELOOP) => {
                ImageError::Symlink(path.to_owned())
            }
            _ => io_err("open", path, e),
        })?;
        let meta = file.metadata().map_err(|e| io_err("stat", path, e))?;
        let is_block_device = meta.file_type().is_block_device();
        if !is_block_device && !meta.file_type().is_file() {
            return Err(ImageError::NotAFileOrDevice(path.to_owned()));
        }
        crate::host::clear_nonblock(&file).map_err(|e| io_err("open", path, e))?;
        let size = device_size(&file, is_block_device).map_err(|e| io_err("size", path, e))?;
        if size == 0 {
            return Err(ImageError::Empty {
                path: path.to_owned(),
            });
        }
        let dio_align = dio_alignment(&file, is_block_device)
            .map_err(|e| io_err("get the block size of", path, e))?;
        let block_size = opts
            .block_size
            .unwrap_or(if is_block_device || opts.direct {
                dio_align.clamp(512, 4096)
            } else {
                512
            });
        if opts.direct && block_size < dio_align {
            return Err(ImageError::BlockSizeTooSmall {
                path: path.to_owned(),
                block_size,
                dio_align,
            });
        }
        if size % u64::from(block_size) != 0 && !opts.formatted {
            return Err(ImageError::NotMultiple {
                path: path.to_owned(),
                size,
                block_size,
            });
        }
        Ok(Image {
            file,
            path: path.to_owned(),
            size,
            is_block_device,
            block_size,
            dio_align,
            dev_ino: (meta.dev(), meta.ino()),
            io_dev: if is_block_device {
                meta.rdev()
            } else {
                meta.dev()
            },
        })
    }

    /// Creates a sparse image of `size` bytes, readable and writable by
    /// its owner only (0600: it holds a guest's disk), unless something is
    /// already at `path`. What is there, a symlink included, is neither
    /// followed nor replaced (O_CREAT|O_EXCL|O_NOFOLLOW): open it with
    /// [`ImageOptions::nofollow`] to refuse a link. The directory must
    /// exist. Returns whether it created the image.
    pub fn create_if_missing(path: &Path, size: u64) -> Result<bool, ImageError> {
        let created = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path);
        let f = match created {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
            Err(e) => return Err(io_err("create", path, e)),
        };
        if let Err(e) = f.set_len(size) {
            // An empty file left behind would fail the next start as empty.
            let _ = std::fs::remove_file(path);
            return Err(io_err("size", path, e));
        }
        Ok(true)
    }

    /// Whether the block device under the image completes polled I/O
    /// (`queue/io_poll`, true only with poll queues). An IOPOLL ring on a
    /// device without them sets up fine, then fails each request that
    /// reaches the disk with EOPNOTSUPP, so this is checked up front.
    pub fn supports_polled_io(&self) -> bool {
        let (major, minor) = (libc::major(self.io_dev), libc::minor(self.io_dev));
        let dev = format!("/sys/dev/block/{major}:{minor}");
        // A partition's queue attributes are its disk's, one level up.
        [
            format!("{dev}/queue/io_poll"),
            format!("{dev}/../queue/io_poll"),
        ]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .is_some_and(|v| v.trim() == "1")
    }

    /// A serial derived from the image's identity: the same file gives the
    /// same serial across restarts. At most 20 bytes (VIRTIO_BLK_ID_BYTES).
    pub fn default_serial(&self) -> String {
        serial_of(self.dev_ino)
    }
}

/// The default serial of the file with these device and inode numbers
/// (see [`Image::default_serial`]).
pub fn serial_of((dev, ino): (u64, u64)) -> String {
    let mut s = format!("rb{dev:x}-{ino:x}");
    s.truncate(20);
    s
}

/// See [`Image::dio_align`]: BLKSSZGET on a block device; STATX_DIOALIGN
/// (Linux 6.1+, file systems that report it) on a file; else 512.
fn dio_alignment(file: &File, is_block_device: bool) -> io::Result<u32> {
    if is_block_device {
        let mut n: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int through the pointer, which points
        // to a live local; the fd is open.
        if unsafe { ioctl_with_mut_ref(file, BLKSSZGET(), &mut n) } < 0 {
            return Err(io::Error::last_os_error());
        }
        return Ok(u32::try_from(n).unwrap_or(0).max(512));
    }
    let mut stx = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: statx writes one struct statx through the pointer, which
    // points to a local of that type; the empty path with AT_EMPTY_PATH
    // names the open fd itself.
    let ret = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            stx.as_mut_ptr(),
        )
    };
    if ret != 0 {
        return Ok(512);
    }
    // SAFETY: all-zero bytes are a valid statx, and the kernel filled it.
    let stx = unsafe { stx.assume_init() };
    let known = stx.stx_mask & libc::STATX_DIOALIGN != 0;
    Ok(if known {
        stx.stx_dio_offset_align.max(stx.stx_dio_mem_align).max(512)
    } else {
        512
    })
}

fn io_err(what: &'static str, path: &Path, source: io::Error) -> ImageError {
    ImageError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> ImageOptions {
        ImageOptions {
            block_size: Some(512),
            ..ImageOptions::default()
        }
    }

    #[test]
    fn missing_and_misaligned_images_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("nope.img");
        assert!(matches!(
            Image::open(&p, opts()),
            Err(ImageError::Missing(_))
        ));
        std::fs::write(&p, vec![0u8; 1000]).unwrap();
        let e = Image::open(&p, opts()).unwrap_err();
        assert!(
            matches!(e, ImageError::NotMultiple { size: 1000, .. }),
            "{e}"
        );
        assert!(!e.to_string().contains('\n'));
    }

    #[test]
    fn creates_a_sparse_private_default() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("disk.img");
        assert!(Image::create_if_missing(&p, 1 << 30).unwrap());
        assert!(!Image::create_if_missing(&p, 1 << 30).unwrap());
        let img = Image::open(&p, opts()).unwrap();
        assert_eq!(img.size, 1 << 30);
        let meta = img.file.metadata().unwrap();
        assert!(meta.blocks() < 16, "not sparse");
        assert_eq!(meta.mode() & 0o777, 0o600, "{:o}", meta.mode());
        assert!(img.default_serial().len() <= 20);
    }

    /// A symlink where the default image goes is neither replaced nor
    /// followed: not to an existing file, not to a missing one.
    #[test]
    fn a_link_at_the_default_image_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target.img");
        std::fs::write(&target, vec![7u8; 4096]).unwrap();
        let missing = dir.path().join("missing.img");
        for to in [&target, &missing] {
            let link = dir.path().join("disk.img");
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(to, &link).unwrap();
            assert!(!Image::create_if_missing(&link, 1 << 20).unwrap());
            let picked = ImageOptions {
                nofollow: true,
                ..opts()
            };
            let e = Image::open(&link, picked).unwrap_err();
            assert!(matches!(e, ImageError::Symlink(_)), "{e}");
            assert!(e.to_string().contains("symbolic link"), "{e}");
        }
        assert!(!missing.exists(), "created through the link");
        assert_eq!(std::fs::read(&target).unwrap(), vec![7u8; 4096]);
        // A link the operator names is theirs to follow.
        let img = Image::open(&dir.path().join("disk.img"), opts());
        assert!(matches!(img, Err(ImageError::Missing(_))), "{img:?}");
        std::os::unix::fs::symlink(&target, dir.path().join("given.img")).unwrap();
        assert_eq!(
            Image::open(&dir.path().join("given.img"), opts())
                .unwrap()
                .size,
            4096
        );
    }
}
