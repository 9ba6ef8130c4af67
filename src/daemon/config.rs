//! Turns command-line arguments into a validated device configuration.

mod rundir;

use std::num::NonZeroUsize;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES;

use super::args::{
    DEFAULT_IMAGE_NAME, DEFAULT_IMAGE_SIZE, DEFAULT_SOCKET_NAME, EngineKind, L2LogMode, ServeArgs,
};
use crate::device::{Device, DeviceSpec, Serial};
use crate::disk::Disk;
use crate::disk::Meta;
use crate::disk::records::Followed;
use crate::disk::{Live, Serving, SnapshotDir};
use crate::engine::UringConfig;
use crate::io::{Image, ImageLock, ImageOptions, RbdSpec};
use crate::qos::QosLimits;
use crate::queue::Settings;
use crate::virtio::{DeviceLimits, SECTOR_SHIFT};

use super::DaemonError;

/// Where the vhost-user socket comes from.
pub enum Listen {
    /// Bind this path: `--socket`, else the default in the private
    /// directory. The daemon removes it on exit.
    Bind(PathBuf),
    /// A listening socket passed in, checked and taken ([`Listen::passed`]);
    /// the daemon does not remove it.
    Fd {
        listener: std::os::unix::net::UnixListener,
        fd: i32,
        from: &'static str,
    },
}

impl Listen {
    /// The socket's path, as logs and `ctl status` show it; `fd N` for a
    /// socket passed in that has none.
    pub fn name(&self) -> String {
        match self {
            Listen::Bind(path) => path.display().to_string(),
            Listen::Fd { listener, fd, .. } => match listener
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(|p| p.display().to_string()))
            {
                Some(p) => p,
                None => format!("fd {fd}"),
            },
        }
    }

    /// The listening socket passed in, taken: `--socket-fd N`, or
    /// systemd's when no socket is named. `serve` calls this first, before
    /// the daemon opens any descriptor of its own, so the number can only
    /// name one it inherited: the daemon's API socket, its image or its
    /// notification socket do not exist yet, and a number they would get
    /// is refused as not open. (Adopted later, `--socket-fd` could name
    /// the API's listener, and the relay would then serve the API's
    /// clients.) It reads and clears LISTEN_PID/LISTEN_FDS, so it runs
    /// while `serve` is the only thread.
    pub fn passed(args: &ServeArgs) -> Result<Option<Listen>, DaemonError> {
        let (fd, from) = match (args.socket_fd, &args.socket) {
            (Some(fd), _) => (fd, "--socket-fd"),
            (None, None) => match super::socket::systemd_fd()? {
                Some(fd) => (fd, "systemd (LISTEN_FDS)"),
                None => return Ok(None),
            },
            (None, Some(_)) => return Ok(None),
        };
        let listener = super::socket::adopt(fd, from)?;
        Ok(Some(Listen::Fd { listener, fd, from }))
    }
}

/// Everything `serve` needs, checked.
pub struct Config {
    pub args: ServeArgs,
    /// Where to listen.
    pub listen: Listen,
    pub backing: Backing,
    /// The device, its runtime state included.
    pub device: Device,
    /// How its queues are served.
    pub settings: Settings,
    /// Worker threads: `--threads`, or its default ([`default_threads`]).
    pub threads: usize,
    /// The directories the daemon creates and removes files in after
    /// start-up: the bitmaps' and the backups', each opened (for
    /// Landlock) with the number of the device's own descriptor of it
    /// (the one its `openat` and `unlinkat` name, for the seccomp filter).
    pub bitmap_dir: Option<(std::fs::File, i32)>,
    pub backup_dir: Option<(std::fs::File, i32)>,
}

/// `--threads`' default: a thread per queue, but no more threads than
/// CPUs to run them on, since two busy threads on one CPU take turns by
/// preemption, which costs more than one thread taking turns between
/// queues. The CPUs are the `--cpus` list, else the daemon's affinity
/// mask, and no more than its cgroup's CPU quota allows
/// (`available_parallelism` reads both: a systemd `CPUQuota=200%` or a
/// container's `--cpus 2` is 2 CPUs whatever the mask says).
pub fn default_threads(queues: usize, cpus: &[usize]) -> usize {
    default_threads_within(queues, cpus, std::thread::available_parallelism().ok())
}

/// [`default_threads`] for a process that may use `available` CPUs
/// (None: not known).
fn default_threads_within(queues: usize, cpus: &[usize], available: Option<NonZeroUsize>) -> usize {
    let available = available.map_or(usize::MAX, NonZeroUsize::get);
    let cpus = match cpus.len() {
        0 => available,
        n => n.min(available),
    };
    queues.min(cpus).max(1)
}

/// What the device's data lives on.
pub enum Backing {
    /// A file or block device, served by io_uring (or the null engine).
    File {
        image: Image,
        /// The image as `--image` named it: the disk's name, which its
        /// status and its dirty bitmaps' sidecars go by. After a live
        /// snapshot and a restart the served top (`image`) is a later
        /// overlay ([`crate::disk::records`]); the disk is the same.
        named: PathBuf,
        /// The default image did not exist and was created.
        created: bool,
        /// How each queue's io_uring engine is set up (`--engine uring`).
        uring: UringConfig,
        /// A format served through its chain (qcow2): the chain and its
        /// metadata thread.
        chain: Option<ChainSetup>,
        /// `--format luks`: the payload and its transform.
        luks: Option<LuksSetup>,
    },
    /// A Ceph RBD image (`--image rbd:POOL/IMAGE`).
    #[cfg(feature = "rbd")]
    Rbd(crate::engine::rbd::RbdDisk),
}

/// A LUKS image as the daemon serves it: the guest's disk is `offset`
/// on in the file, `size` bytes (None: to its end), encrypted with
/// `crypt`.
pub struct LuksSetup {
    pub crypt: std::sync::Arc<crate::disk::luks::Crypt>,
    pub offset: u64,
    pub size: Option<u64>,
}

/// An image served through its chain (qcow2) as the daemon serves it.
pub struct ChainSetup {
    pub live: std::sync::Arc<Live>,
    /// The image's metadata thread (started before the seccomp filter).
    pub meta: Meta,
}

impl Backing {
    /// What to call it in the log.
    pub fn name(&self) -> String {
        match self {
            Backing::File { named, .. } => named.display().to_string(),
            #[cfg(feature = "rbd")]
            Backing::Rbd(disk) => disk.opts.spec.to_string(),
        }
    }

    /// The file to fdatasync when the daemon stops, if any (an RBD image's
    /// engines flush as their queues drain).
    pub fn file(&self) -> Option<&std::fs::File> {
        match self {
            Backing::File { image, .. } => Some(&image.file),
            #[cfg(feature = "rbd")]
            Backing::Rbd(_) => None,
        }
    }
}

impl Config {
    /// Checks `args`; `passed` is the socket [`Listen::passed`] took, if
    /// any.
    pub fn from_args(args: ServeArgs, passed: Option<Listen>) -> Result<Config, DaemonError> {
        // --queues and --queue-size are checked as they are parsed (cli).
        if let Some(s) = &args.serial
            && s.len() > VIRTIO_BLK_ID_BYTES as usize
        {
            return Err(DaemonError::Usage(format!(
                "--serial is at most 20 bytes, '{s}' has {}",
                s.len()
            )));
        }
        if args.iopoll && !args.direct {
            return Err(DaemonError::Usage("--iopoll needs --direct".into()));
        }
        crate::cpu::check_cpus(&args.cpus).map_err(DaemonError::Usage)?;
        let queues = usize::from(args.queues);
        let threads = match args.threads {
            Some(n) if n == 0 || n > queues => {
                return Err(DaemonError::Usage(format!(
                    "--threads must be between 1 and --queues ({queues}), not {n}"
                )));
            }
            Some(n) => n,
            None => default_threads(queues, &args.cpus),
        };
        let qos = args
            .qos
            .check(QosLimits::default())
            .map_err(DaemonError::Usage)?;
        check_size(&args)?;
        // What is not given goes in a private directory, chosen and checked
        // only when needed.
        let (socket, path) = match (&args.socket, &args.image, &passed) {
            (Some(socket), Some(image), _) => (socket.clone(), image.clone()),
            (_, Some(image), Some(_)) => (PathBuf::new(), image.clone()),
            (socket, image, _) => {
                let dir = rundir::choose(&rundir::Env::from_process())
                    .map_err(|e| DaemonError::Config(e.to_string()))?;
                (
                    socket
                        .clone()
                        .unwrap_or_else(|| dir.join(DEFAULT_SOCKET_NAME)),
                    image
                        .clone()
                        .unwrap_or_else(|| dir.join(DEFAULT_IMAGE_NAME)),
                )
            }
        };
        let listen = passed.unwrap_or(Listen::Bind(socket));
        let rbd = args
            .image
            .as_deref()
            .and_then(RbdSpec::from_image_arg)
            .transpose()
            .map_err(DaemonError::Usage)?;
        let (backing, block_size, default_serial) = match rbd {
            Some(spec)
                if args.format.serving() != Serving::Inline || args.snapshot_dir.is_some() =>
            {
                return Err(DaemonError::Usage(format!(
                    "--image {spec}: --format and --snapshot-dir are for image files; an RBD image has snapshots of its own (rbd snap create)"
                )));
            }
            Some(spec) => open_rbd(&args, spec)?,
            None => open_file(&args, path)?,
        };
        let encrypted = matches!(&backing, Backing::File { luks: Some(_), .. });
        let limits = DeviceLimits {
            block_size,
            readonly: args.readonly,
            // Two descriptors of a chain are header and status.
            seg_max: u32::from(args.queue_size - 2).clamp(1, 1024),
            // An encrypted disk writes a write-zeroes' zeroes, encrypted,
            // from one buffer: 1 MiB at a time.
            max_write_zeroes_sectors: if encrypted {
                MAX_ENCRYPTED_ZEROES_SECTORS
            } else {
                DeviceLimits::default().max_write_zeroes_sectors
            },
            ..DeviceLimits::default()
        };
        let serial_str = args.serial.clone().unwrap_or(default_serial);
        let mut serial: Serial = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        serial[..serial_str.len()].copy_from_slice(serial_str.as_bytes());
        let err = |what: &'static str| {
            move |e: std::io::Error| DaemonError::Config(format!("{what}: {e}"))
        };
        let (bitmaps, bitmap_dir) = bitmap_store(&args, &backing)?;
        let (backups, backup_dir) = backup_spec(&args, &backing)?;
        let disk = match &backing {
            Backing::File { chain: Some(q), .. } => Disk::Chain(q.live.clone()),
            Backing::File {
                image,
                luks: Some(l),
                ..
            } => Disk::Payload {
                file: image.file.try_clone().map_err(err("image"))?,
                block_device: image.is_block_device,
                offset: l.offset,
                size: l.size,
                crypt: l.crypt.clone(),
            },
            Backing::File { image, .. } => Disk::File {
                file: image.file.try_clone().map_err(err("image"))?,
                block_device: image.is_block_device,
            },
            #[cfg(feature = "rbd")]
            Backing::Rbd(disk) => {
                let shared: std::sync::Arc<dyn crate::disk::Resizable> = disk.image().clone();
                Disk::Shared(std::sync::Arc::downgrade(&shared))
            }
        };
        let device = Device::new(DeviceSpec {
            name: backing.name(),
            limits,
            capacity_sectors: disk.size().map_err(err("the image's size"))? >> SECTOR_SHIFT,
            queues: args.queues,
            queue_size: args.queue_size,
            serial,
            writeback: !args.writethrough,
            qos,
            // An RBD image has exclusive-lock of its own (librbd's).
            image_lock: match (args.no_image_lock, backing.file()) {
                (false, Some(file)) => {
                    Some(ImageLock::new(file, !args.readonly).map_err(err("image lock"))?)
                }
                _ => None,
            },
            backing: disk,
            bitmaps,
            backups,
        })
        .map_err(|e| DaemonError::Config(e.to_string()))?;
        // A block job the last daemon was in the middle of.
        if let Some(dir) = device.chain().and_then(|live| live.snapshot_dir()) {
            match crate::disk::records::job(dir.path()) {
                Ok(Some(record)) => device.recover_job(record),
                Ok(None) => {}
                Err(e) => log::warn!("{e}"),
            }
        }
        let settings = Settings {
            notify: args.notify,
            signal: args.signal,
            poll_us: args.poll_us,
            poll_checks: !args.no_poll_checks,
            max_batch: args.max_batch,
        };
        Ok(Config {
            args,
            listen,
            backing,
            device,
            settings,
            threads,
            bitmap_dir,
            backup_dir,
        })
    }
}

/// Opens the directory `dir`: O_DIRECTORY, so that anything else there
/// (a FIFO would block the open) is refused with ENOTDIR.
fn open_dir(dir: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
}

/// A directory opened again (for Landlock), with the number of the
/// descriptor `fd` the device keeps of it.
fn reopened(dir: &std::path::Path, fd: i32) -> Result<(std::fs::File, i32), DaemonError> {
    let f = open_dir(dir).map_err(|e| DaemonError::Config(format!("{}: {e}", dir.display())))?;
    Ok((f, fd))
}

/// Where the dirty bitmaps persist (or why there are none), and their
/// directory. An explicit `--bitmap-dir` that cannot be used, or a
/// sidecar that cannot be opened or read, stops the start (the latter
/// when the device peeks at its bitmaps); the image's own directory that
/// cannot be opened only leaves the device without bitmaps, with a WARN
/// line (any sidecars there cannot even be seen), and says so again when
/// one is asked for.
#[allow(clippy::type_complexity)]
fn bitmap_store(
    args: &ServeArgs,
    backing: &Backing,
) -> Result<
    (
        Result<Box<dyn crate::bitmap::BitmapStore>, String>,
        Option<(std::fs::File, i32)>,
    ),
    DaemonError,
> {
    let (image, named) = match backing {
        // QEMU's bitmap directory in the image: the bitmaps live there
        // (docs/backup.md); sidecars of the image are not used.
        Backing::File {
            chain: Some(q),
            named,
            ..
        } if !args.readonly
            && q.live
                .current()
                .qcow2()
                .is_some_and(|i| i.has_qemu_bitmaps()) =>
        {
            log::info!(
                "{}: dirty bitmaps in the image's own bitmap directory (QEMU's persistent bitmaps)",
                named.display()
            );
            let left = sidecars_of(named, args.bitmap_dir.as_deref());
            if !left.is_empty() {
                log::warn!(
                    "{}: sidecar bitmaps of an older ringblk are not used for a qcow2 image (its \
                     bitmaps live in the image now): {}; add them again (ctl bitmap add) and \
                     take a full backup, then delete the files",
                    named.display(),
                    left.join(", ")
                );
            }
            return Ok((
                Ok(Box::new(crate::disk::qcow2::bitmap_store::Qcow2Store::new(
                    q.live.clone(),
                ))),
                None,
            ));
        }
        Backing::File { image, named, .. } => (image, named),
        #[cfg(feature = "rbd")]
        Backing::Rbd(_) => {
            return Ok((
                Err("dirty bitmaps are not supported on RBD images (librbd's object map and fast-diff, with rbd diff, track changes there)".into()),
                None,
            ));
        }
    };
    if args.readonly {
        return Ok((
            Err("the image is exported read-only (--readonly): nothing changes it, so there is nothing to track".into()),
            None,
        ));
    }
    if image.is_block_device && args.bitmap_dir.is_none() {
        return Ok((
            Err(format!(
                "{} is a block device: its bitmaps need a directory, given with --bitmap-dir DIR at start-up",
                image.path.display()
            )),
            None,
        ));
    }
    match crate::bitmap::SidecarStore::for_image(named, args.bitmap_dir.as_deref()) {
        Ok(store) => {
            let dir = reopened(store.dir(), store.dir_fd())?;
            Ok((Ok(Box::new(store)), Some(dir)))
        }
        Err(e) if args.bitmap_dir.is_some() => {
            Err(DaemonError::Config(format!("--bitmap-dir: {e}")))
        }
        Err(e) => {
            log::warn!(
                "no dirty bitmaps for this image (its sidecar files cannot be looked for): {e}"
            );
            Ok((
                Err(format!("no dirty bitmaps next to the image: {e}")),
                None,
            ))
        }
    }
}

/// The sidecar bitmap files (`NAME.bitmap.*`, as `SidecarStore` names
/// them) of the image `named`, next to it or in `dir`; looked at only, at
/// most 64 named.
fn sidecars_of(named: &std::path::Path, dir: Option<&std::path::Path>) -> Vec<String> {
    let Some(stem) = named.file_name().and_then(|n| n.to_str()) else {
        return Vec::new();
    };
    let dir = match dir {
        Some(d) => d.to_path_buf(),
        None => match named.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => std::path::PathBuf::from("."),
        },
    };
    let prefix = format!("{stem}.bitmap.");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(&prefix))
        .take(64)
        .map(|n| dir.join(n).display().to_string())
        .collect();
    out.sort();
    out
}

/// What backups need (or why there are none): `--backup-dir` opened, the
/// image opened again for reading through the page cache (checked to be
/// the same file), and an unlinked file in the directory for the
/// copy-before-write store. All before the sandbox: the daemon opens no
/// file by path after start-up.
#[allow(clippy::type_complexity)]
fn backup_spec(
    args: &ServeArgs,
    backing: &Backing,
) -> Result<
    (
        Result<crate::device::BackupSpec, String>,
        Option<(std::fs::File, i32)>,
    ),
    DaemonError,
> {
    use std::os::unix::fs::MetadataExt;
    let image = match backing {
        // A qcow2 image's view reads through its chain (the device's
        // `Live`); its top file, opened here too, is not read. A LUKS
        // image's view reads this file, decrypted (`disk::reader`).
        Backing::File { image, .. } => image,
        #[cfg(feature = "rbd")]
        Backing::Rbd(_) => {
            return Ok((
                Err("backups of RBD images are not supported: take an RBD snapshot (rbd snap create) and export it (rbd export, rbd export-diff)".into()),
                None,
            ));
        }
    };
    let Some(dir) = &args.backup_dir else {
        return Ok((
            Err("backups need a directory for their NBD socket and their copy-before-write file: start the daemon with --backup-dir DIR".into()),
            None,
        ));
    };
    let err = |what: &str, e: std::io::Error| {
        DaemonError::Config(format!("--backup-dir {}: {what}: {e}", dir.display()))
    };
    let dir = std::path::absolute(dir).map_err(|e| err("its absolute path", e))?;
    let dir_fd = open_dir(&dir).map_err(|e| err("opening it", e))?;
    if !dir_fd.metadata().map_err(|e| err("stat", e))?.is_dir() {
        return Err(DaemonError::Config(format!(
            "--backup-dir {}: not a directory",
            dir.display()
        )));
    }
    // A backup's socket left by a daemon killed during it: replaced now,
    // while the daemon may still connect to check that nobody listens (the
    // seccomp filter allows no `connect` later).
    crate::unix_socket::remove_stale_in(&dir).map_err(|e| err("its stale sockets", e))?;
    let store = tempfile::tempfile_in(&dir).map_err(|e| err("its copy-before-write file", e))?;
    // Checked against the served image below; a FIFO swapped in since is
    // refused, not waited on.
    let how = crate::host::Untrusted {
        block_device: true,
        ..Default::default()
    };
    let reader = crate::host::open_untrusted(&image.path, how).map_err(|e| {
        DaemonError::Config(format!(
            "{}: opening it for backups: {e}",
            image.path.display()
        ))
    })?;
    let meta = reader
        .metadata()
        .map_err(|e| DaemonError::Config(format!("{}: {e}", image.path.display())))?;
    if (meta.dev(), meta.ino()) != image.dev_ino {
        return Err(DaemonError::Config(format!(
            "{}: replaced while the daemon started",
            image.path.display()
        )));
    }
    let fd = std::os::fd::AsRawFd::as_raw_fd(&dir_fd);
    let landlock = reopened(&dir, fd)?;
    Ok((
        Ok(crate::device::BackupSpec {
            dir,
            dir_fd,
            image: reader,
            store,
        }),
        Some(landlock),
    ))
}

/// `--size` is the size of the default image, which it creates: with
/// `--image` it would be ignored, so it is refused; and it must be a size
/// the image can have, checked before anything is created (a default image
/// of 1000 bytes would fail this start and every later one).
fn check_size(args: &ServeArgs) -> Result<(), DaemonError> {
    let Some(size) = args.size else {
        return Ok(());
    };
    if let Some(image) = &args.image {
        return Err(DaemonError::Usage(format!(
            "--size is for the default image, which serve creates; --image {} is served at its own size (create it with `truncate -s SIZE`, grow it online with `ringblk ctl resize`)",
            image.display()
        )));
    }
    let block = args.block_size.unwrap_or(512);
    if size % u64::from(block) != 0 {
        return Err(DaemonError::Usage(format!(
            "--size {size} is not a multiple of the {block}-byte block size"
        )));
    }
    Ok(())
}

/// Opens the image file or block device at `path` (creating the default
/// one if missing). Returns it with its block size and default serial.
fn open_file(args: &ServeArgs, path: PathBuf) -> Result<(Backing, u32, String), DaemonError> {
    check_format(args)?;
    if let Some(warning) = crate::disk::raw_qcow2_warning(&path, args.format) {
        log::warn!("{warning}");
    }
    // After a live snapshot the top is another file (see disk::records).
    let named = path;
    let followed = follow_snapshots(args, &named)?;
    let path = followed
        .as_ref()
        .map_or_else(|| named.clone(), |f| f.top.clone());
    let created = match &args.image {
        Some(_) => false,
        None => Image::create_if_missing(&path, args.size.unwrap_or(DEFAULT_IMAGE_SIZE))?,
    };
    let opened = Image::open(
        &path,
        ImageOptions {
            readonly: args.readonly,
            direct: args.direct,
            block_size: args.block_size,
            // The default is ours to pick, and never a link; nor is an
            // overlay a snapshot record names.
            nofollow: args.image.is_none() || followed.is_some(),
            formatted: args.format.serving() != Serving::Inline,
        },
    );
    let image = match opened {
        Ok(image) => image,
        Err(e) => {
            // An image that cannot be served (--direct needing a larger
            // block size, say) must not stay behind to fail the next start.
            if created {
                let _ = std::fs::remove_file(&path);
            }
            return Err(e.into());
        }
    };
    if let Some(size) = args.size.filter(|&s| !created && s != image.size) {
        log::warn!(
            "--size {size}: {} exists already and is served at its own size, {} bytes; --size applies when it is created (remove it to start afresh, or resize it online with `ringblk ctl resize`)",
            image.path.display(),
            image.size
        );
    }
    let (chain, luks) = match args.format.serving() {
        Serving::Inline => (None, None),
        Serving::Chain => (Some(open_chain(args, &image, followed.as_ref())?), None),
        Serving::Payload => (None, Some(open_luks(args, &image)?)),
    };
    let fds = match &chain {
        Some(q) => q.live.current().io_fds(),
        None => vec![image.file.as_raw_fd()],
    };
    let uring = UringConfig {
        image_fd: fds[0],
        backing_fds: fds[1..].to_vec(),
        // Room for a chain as deep as live snapshots may make it.
        file_slots: if chain.is_some() {
            crate::disk::qcow2::MAX_CHAIN as u32
        } else {
            1
        },
        // Room for every request of a full ring.
        entries: u32::from(args.queue_size).next_power_of_two(),
        sqpoll: args.sqpoll,
        iopoll: args.iopoll
            && {
                let ok = image.supports_polled_io();
                if !ok {
                    log::warn!(
                        "--iopoll: the image's block device has no poll queues (queue/io_poll is not 1); continuing without IOPOLL"
                    );
                }
                ok
            },
        fixed_buffers: args.fixed_buffers,
        uring_cmd: !args.no_uring_cmd,
        direct: args.direct && args.engine == EngineKind::Uring,
        dio_align: image.dio_align as usize,
        // Room for one request of the most data a request may carry.
        bounce_limit: crate::virtio::request::MAX_DATA_BYTES as usize,
        is_block_device: image.is_block_device,
    };
    // The guest keeps the serial it had before the snapshot: the named
    // image's.
    let serial = match &followed {
        Some(_) => std::fs::metadata(&named)
            .map(|m| crate::io::serial_of((m.dev(), m.ino())))
            .map_err(|e| DaemonError::Config(format!("{}: {e}", named.display())))?,
        None => image.default_serial(),
    };
    let block_size = match &luks {
        Some(l) => l.crypt.sector_size() as u32,
        None => image.block_size,
    };
    Ok((
        Backing::File {
            image,
            named,
            created,
            uring,
            chain,
            luks,
        },
        block_size,
        serial,
    ))
}

/// The most a write-zeroes may cover on an encrypted disk (1 MiB): its
/// zeroes are encrypted into one buffer and written.
const MAX_ENCRYPTED_ZEROES_SECTORS: u32 = 2048;

/// Reads the passphrase of an encrypted image (`--key-file` or
/// `--key-fd`), if one was given; warns about a key file others can read.
fn read_passphrase(args: &ServeArgs) -> Result<Option<crate::crypto::key::Secret>, DaemonError> {
    use crate::crypto::key::{MAX_KEY_FILE, read_key_fd, read_key_file};
    let key = match (&args.key_file, args.key_fd) {
        (Some(path), _) => read_key_file(path, MAX_KEY_FILE),
        (None, Some(fd)) => {
            use std::os::fd::{AsFd, FromRawFd, OwnedFd};
            // SAFETY: F_GETFD only asks whether fd is open.
            if fd < 3 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                return Err(DaemonError::Usage(format!(
                    "--key-fd {fd}: not an open descriptor the daemon inherited"
                )));
            }
            // SAFETY: fd is open (checked above), inherited for this and
            // used by nothing else in the daemon: it is ours to read and
            // close, which it is once read.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            read_key_fd(owned.as_fd(), MAX_KEY_FILE)
        }
        (None, None) => return Ok(None),
    }
    .map_err(DaemonError::Config)?;
    if let Some(w) = &key.warning {
        log::warn!("{w}");
    }
    Ok(Some(key.secret))
}

/// Overwrites what deriving and expanding keys left on this thread: its
/// stack and its vector registers. Once the passphrase is dropped.
fn scrub_after_keys() {
    crate::crypto::key::scrub_stack::<{ 64 * 1024 }>();
    crate::crypto::key::scrub_registers();
}

/// Reads the passphrase (`--key-file` or `--key-fd`), opens the LUKS
/// header of `image` with it and drops it (zeroed); checks the payload
/// against the block size. Each failure is one line.
fn open_luks(args: &ServeArgs, image: &Image) -> Result<LuksSetup, DaemonError> {
    let Some(key) = read_passphrase(args)? else {
        return Err(DaemonError::Usage(
            "--format luks needs the passphrase: --key-file PATH (a systemd credential: --key-file ${CREDENTIALS_DIRECTORY}/NAME) or --key-fd N".into(),
        ));
    };
    let opened = without_direct(&image.file, || {
        crate::disk::luks::Luks::open(&image.file, image.size, &key)
    })
    .map_err(|e| DaemonError::Config(format!("{}: {e}", image.path.display())))?;
    // The passphrase's key memory is zeroed now, opened or not, and the
    // copies of the key on this thread's stack and in its vector registers
    // (the key schedules were built there) are overwritten.
    drop(key);
    scrub_after_keys();
    let luks = opened.map_err(|e| DaemonError::Config(format!("{}: {e}", image.path.display())))?;
    let sector = luks.crypt.sector_size() as u32;
    if let Some(b) = args.block_size.filter(|&b| b != sector) {
        return Err(DaemonError::Usage(format!(
            "--block-size {b}: the LUKS image has {sector}-byte sectors, and the guest's block size must be its sector size (leave --block-size out)"
        )));
    }
    if image.block_size > sector {
        return Err(DaemonError::Config(format!(
            "{}: the LUKS image has {sector}-byte sectors, but I/O here needs {}-byte blocks (a 4Kn device, or --direct on this file system)",
            image.path.display(),
            image.block_size
        )));
    }
    let size = luks.payload_size(image.size);
    if size == 0 || !size.is_multiple_of(u64::from(sector)) {
        return Err(DaemonError::Config(format!(
            "{}: the LUKS payload, {size} bytes, is not a positive multiple of its {sector}-byte sectors",
            image.path.display()
        )));
    }
    log::info!(
        "{}: {:?}, keyslot {} opened; payload of {size} bytes at offset {}, {sector}-byte sectors",
        image.path.display(),
        luks.version,
        luks.keyslot,
        luks.offset
    );
    Ok(LuksSetup {
        crypt: std::sync::Arc::new(luks.crypt),
        offset: luks.offset,
        size: luks.size,
    })
}

/// Runs `f` with O_DIRECT off on `file` (`--direct`): the header is read
/// into buffers of any alignment. The daemon is starting: nothing else
/// uses the file yet.
fn without_direct<T>(file: &std::fs::File, f: impl FnOnce() -> T) -> std::io::Result<T> {
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor the image owns; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let direct = flags & libc::O_DIRECT != 0;
    // SAFETY: as above.
    if direct && unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_DIRECT) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let out = f();
    // SAFETY: as above.
    if direct && unsafe { libc::fcntl(fd, libc::F_SETFL, flags) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(out)
}

/// What `--format` and `--snapshot-dir` need of the other options.
fn check_format(args: &ServeArgs) -> Result<(), DaemonError> {
    let format = args.format;
    if format.serving() == Serving::Inline && (args.key_file.is_some() || args.key_fd.is_some()) {
        return Err(DaemonError::Usage(
            "--key-file and --key-fd are for an encrypted image (--format luks, or --format qcow2 with encrypt.format=luks)".into(),
        ));
    }
    if format.serving() == Serving::Payload {
        if args.image.is_none() {
            return Err(DaemonError::Usage(format!(
                "--format {format} needs --image (create one with cryptsetup luksFormat or qemu-img create -f luks)"
            )));
        }
        if args.snapshot_dir.is_some() || !args.backing_dir.is_empty() {
            return Err(DaemonError::Usage(
                "--snapshot-dir and --backing-dir are for qcow2 images (--format qcow2)".into(),
            ));
        }
        return Ok(());
    }
    if format.serving() == Serving::Inline {
        if args.snapshot_dir.is_some() {
            return Err(DaemonError::Usage(
                "--snapshot-dir is for live snapshots of a qcow2 image (--format qcow2)".into(),
            ));
        }
        if !args.backing_dir.is_empty() {
            return Err(DaemonError::Usage(
                "--backing-dir is for a qcow2 image's backing files (--format qcow2); a raw image has none".into(),
            ));
        }
        return Ok(());
    }
    if args.image.is_none() {
        return Err(DaemonError::Usage(format!(
            "--format {format} needs --image (create one with qemu-img create -f {format})"
        )));
    }
    if args.iopoll {
        return Err(DaemonError::Usage(format!(
            "--iopoll is for raw images: a {format} image's metadata work completes outside the ring"
        )));
    }
    Ok(())
}

/// With `--format qcow2 --snapshot-dir DIR`: where the snapshot records
/// in DIR lead from the image `named` (see [`crate::disk::records`]);
/// None: serve `named`.
fn follow_snapshots(args: &ServeArgs, named: &Path) -> Result<Option<Followed>, DaemonError> {
    let (Serving::Chain, Some(dir), Some(_)) =
        (args.format.serving(), &args.snapshot_dir, &args.image)
    else {
        return Ok(None);
    };
    let dir = std::fs::canonicalize(dir)
        .map_err(|e| DaemonError::Config(format!("--snapshot-dir {}: {e}", dir.display())))?;
    // A missing image gets its error from opening it.
    let Ok(named) = std::fs::canonicalize(named) else {
        return Ok(None);
    };
    crate::disk::records::follow(&dir, &named).map_err(DaemonError::Config)
}

/// Opens `image` as its format's [`crate::disk::Image`] (qcow2), with its
/// backing chain, and starts its metadata thread. `followed`: `image` is
/// the top the snapshot records led to, whose chain must go through each
/// image they name.
fn open_chain(
    args: &ServeArgs,
    image: &Image,
    followed: Option<&Followed>,
) -> Result<ChainSetup, DaemonError> {
    let snapshots = args
        .snapshot_dir
        .as_deref()
        .map(|d| {
            SnapshotDir::open(d)
                .map_err(|e| DaemonError::Config(format!("--snapshot-dir {}: {e}", d.display())))
        })
        .transpose()?;
    // The L2 log lives next to the image `--image` names: a restart with
    // the same command line finds it, also after snapshots moved the top.
    let named = followed.map_or(image.path.as_path(), named_of);
    let l2_log = (!args.readonly && args.l2_log == L2LogMode::On)
        .then(|| crate::disk::qcow2::l2log::path_for(named))
        .filter(|p| l2_log_usable(p));
    // The bitmaps are marked in use when the device claims the image
    // (`Device::claim_image`), not at this open: a daemon started while
    // another serves the image (a migration's destination) must not write
    // into it before it holds it.
    // The passphrase of encrypted layers, if given: for this open only.
    let passphrase = read_passphrase(args)?.map(std::sync::Arc::new);
    let keyed = passphrase.is_some();
    let options = crate::disk::OpenOptions {
        writable: !args.readonly,
        l2_log,
        bitmaps_at_claim: true,
        backing_dirs: backing_dirs(args, named, snapshots.as_ref())?,
        nofollow_top: followed.is_some(),
        passphrase,
        ..Default::default()
    };
    let opened = Live::open(
        &image.path,
        args.format,
        options,
        args.direct && args.engine == EngineKind::Uring,
        snapshots,
    );
    if keyed {
        // The passphrase is zeroed now (the open dropped the last copy),
        // and the key schedules' traces on this thread are overwritten.
        scrub_after_keys();
    }
    let live = opened.map_err(|e| match followed {
        Some(f) => DaemonError::Config(format!(
            "{} was superseded by the live snapshot {}, which cannot be served: {e}; restore it, or, to serve {0} as it was at the snapshot, remove the snapshot records in {}",
            named_of(f).display(),
            f.top.display(),
            args.snapshot_dir.as_deref().unwrap_or(Path::new("")).display()
        )),
        None => DaemonError::Config(e.to_string()),
    })?;
    if let Some(f) = followed {
        check_followed(args, &live, f)?;
    }
    let mut live = live;
    if !args.readonly {
        // The image --image names, open for writing from now on: a commit
        // into it, once live snapshots have put it below the top, cannot
        // open it later (the sandbox allows no open by path then).
        let named = followed.map_or(image.path.as_path(), named_of);
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(named)
        {
            Ok(file) => live.keep_named(named, file),
            Err(e) => log::warn!(
                "{}: not opened for writing ({e}); a commit into it will be refused",
                named.display()
            ),
        }
    }
    let size = live.size();
    let block = image.block_size;
    if size == 0 || size % u64::from(block) != 0 {
        return Err(DaemonError::Config(format!(
            "{}: its virtual size, {size} bytes, is not a positive multiple of the {block}-byte block size",
            image.path.display()
        )));
    }
    let meta =
        Meta::spawn().map_err(|e| DaemonError::Config(format!("the metadata thread: {e}")))?;
    let chain = live.chain();
    if chain.len() > 1 {
        log::info!(
            "backing chain, top first: {}",
            chain
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(ChainSetup {
        live: std::sync::Arc::new(live),
        meta,
    })
}

/// Where the chain's backing files may be, as canonical paths: each
/// `--backing-dir`, and with them the `--snapshot-dir` (the overlays of
/// live snapshots become backing files) and the image `named` itself
/// (after a snapshot it is the first overlay's backing file). None
/// without `--backing-dir`: anywhere.
fn backing_dirs(
    args: &ServeArgs,
    named: &Path,
    snapshots: Option<&SnapshotDir>,
) -> Result<Option<Vec<PathBuf>>, DaemonError> {
    if args.backing_dir.is_empty() {
        return Ok(None);
    }
    let mut dirs = Vec::new();
    for d in &args.backing_dir {
        let bad =
            |why: String| DaemonError::Config(format!("--backing-dir {}: {why}", d.display()));
        let c = std::fs::canonicalize(d).map_err(|e| bad(e.to_string()))?;
        if !c.is_dir() {
            return Err(bad("not a directory".into()));
        }
        dirs.push(c);
    }
    dirs.extend(snapshots.map(|s| s.path().to_path_buf()));
    dirs.extend(std::fs::canonicalize(named).ok());
    Ok(Some(dirs))
}

/// Whether the L2 log at `path` can be created or opened for writing.
/// When it cannot (the image's directory is not the daemon's to write),
/// the daemon serves without it, as with `--l2-log off`, and says so once:
/// an upgrade must not stop serving an image an older daemon served. A
/// marked image still needs its log, and is refused when opened.
fn l2_log_usable(path: &Path) -> bool {
    match crate::disk::qcow2::l2log::open_file(path) {
        Ok(_) => true,
        Err(e) => {
            log::warn!(
                "cannot make the L2 log {}: {e}; serving without it, so each group of allocating \
                 writes takes an fdatasync (slower on a fresh overlay; docs/formats.md, \"The L2 log\"). \
                 Let the daemon write the image's directory, or pass --l2-log off to choose this",
                path.display()
            );
            false
        }
    }
}

/// The image `--image` named, which the records in `f` lead from.
fn named_of(f: &Followed) -> &Path {
    f.chain.last().map_or(Path::new(""), |p| p.as_path())
}

/// Checks that the top the snapshot records led to has, below it, each
/// image they name, in order (the records and the files agree); then says
/// at WARN what is served.
fn check_followed(args: &ServeArgs, live: &Live, f: &Followed) -> Result<(), DaemonError> {
    let named = named_of(f);
    let chain: Vec<PathBuf> = live
        .chain()
        .iter()
        .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
        .collect();
    let dir = args.snapshot_dir.as_deref().unwrap_or(Path::new(""));
    // Images a stream dropped from the chain (its records say which):
    // the records still name them, the chain no longer has them.
    let dropped: Vec<PathBuf> = crate::disk::records::dropped(dir)
        .map_err(DaemonError::Config)?
        .iter()
        .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
        .collect();
    // The chain begins with the images the records name, in order, but
    // those dropped.
    let expected: Vec<&PathBuf> = f.chain.iter().filter(|p| !dropped.contains(p)).collect();
    for i in 1..expected.len() {
        let want = expected[i];
        if chain.get(i) != Some(want) {
            let over = expected[i - 1];
            return Err(DaemonError::Config(format!(
                "the snapshot records in {} say {} was superseded by {}, but the backing file of {2} is {}, not {1}: the records and the images disagree; serve the intended top with --image, or remove the wrong record",
                dir.display(),
                want.display(),
                over.display(),
                chain
                    .get(i)
                    .map_or("none".to_string(), |p| p.display().to_string())
            )));
        }
    }
    let first = &f.chain[f.chain.len() - 2];
    let later = if f.chain.len() > 2 {
        format!(" (and {} later ones)", f.chain.len() - 2)
    } else {
        String::new()
    };
    log::warn!(
        "{} was superseded by live snapshot {} at {}{later}; serving {}",
        named.display(),
        first.display(),
        crate::disk::records::utc(f.at),
        f.top.display()
    );
    Ok(())
}

/// Connects to the cluster and opens the RBD image: a missing pool or
/// image, a cluster that does not answer, or one that refuses us ends the
/// daemon here, with one line saying which.
#[cfg(feature = "rbd")]
fn open_rbd(args: &ServeArgs, spec: RbdSpec) -> Result<(Backing, u32, String), DaemonError> {
    for (set, flag) in [
        (args.direct, "--direct"),
        (args.sqpoll, "--sqpoll"),
        (args.iopoll, "--iopoll"),
        (args.fixed_buffers, "--fixed-buffers"),
    ] {
        if set {
            return Err(DaemonError::Usage(format!(
                "{flag} is for io_uring on a file or block device, not an rbd: image"
            )));
        }
    }
    let name = spec.to_string();
    let disk = crate::engine::rbd::RbdDisk::open(crate::engine::rbd::RbdOptions {
        spec,
        conf: args.ceph_conf.clone(),
        id: args.ceph_id.clone(),
        readonly: args.readonly,
    })
    .map_err(|e| DaemonError::Config(format!("{name}: {e}")))?;
    if disk.size < 1 << SECTOR_SHIFT {
        return Err(DaemonError::Config(format!(
            "{name}: the image is {} bytes, less than one sector",
            disk.size
        )));
    }
    let serial = disk.default_serial();
    Ok((Backing::Rbd(disk), args.block_size.unwrap_or(512), serial))
}

#[cfg(not(feature = "rbd"))]
fn open_rbd(_args: &ServeArgs, spec: RbdSpec) -> Result<(Backing, u32, String), DaemonError> {
    Err(DaemonError::Config(format!(
        "--image {spec}: this ringblk was built without Ceph RBD support; rebuild it with `cargo build --release --features rbd` (needs librbd-dev and librados-dev: scripts/ceph-deps.sh)"
    )))
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    use super::{default_threads, default_threads_within};

    #[test]
    fn default_threads_are_bounded_by_queues_and_cpus() {
        let four = NonZeroUsize::new(4);
        assert_eq!(default_threads_within(8, &[0, 1, 2], four), 3);
        assert_eq!(default_threads_within(2, &[0, 1, 2], four), 2);
        assert_eq!(default_threads_within(1, &[0], four), 1);
        assert_eq!(default_threads_within(64, &[], four), 4);
        assert_eq!(default_threads_within(1, &[], four), 1);
        assert_eq!(default_threads_within(8, &[], None), 8);
    }

    #[test]
    fn a_cpu_quota_below_the_cpus_listed_bounds_the_threads() {
        let one = NonZeroUsize::new(1);
        assert_eq!(default_threads_within(8, &[0, 1, 2], one), 1);
        assert_eq!(default_threads_within(8, &[], one), 1);
    }

    #[test]
    fn the_default_follows_available_parallelism() {
        let available = std::thread::available_parallelism().unwrap().get();
        assert_eq!(default_threads(64, &[]), available.min(64));
    }
}
