//! Turns command-line arguments into a validated device configuration.

mod rundir;

use std::num::NonZeroUsize;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES;

use super::args::{
    DEFAULT_IMAGE_NAME, DEFAULT_IMAGE_SIZE, DEFAULT_SOCKET_NAME, EngineKind, ServeArgs,
};
use crate::device::{Backing as Resize, Device, DeviceSpec, Serial};
use crate::engine::{Meta, UringConfig};
use crate::format::{Format, Live, SnapshotDir};
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
        /// The default image did not exist and was created.
        created: bool,
        /// How each queue's io_uring engine is set up (`--engine uring`).
        uring: UringConfig,
        /// `--format qcow2`: the image's chain and its metadata thread.
        qcow2: Option<Qcow2Setup>,
    },
    /// A Ceph RBD image (`--image rbd:POOL/IMAGE`).
    #[cfg(feature = "rbd")]
    Rbd(crate::engine::rbd::RbdDisk),
}

/// A qcow2 image as the daemon serves it.
pub struct Qcow2Setup {
    pub live: std::sync::Arc<Live>,
    /// The image's metadata thread (started before the seccomp filter).
    pub meta: Meta,
}

impl Backing {
    /// Size in bytes (the guest's: a qcow2 image's virtual size).
    pub fn size(&self) -> u64 {
        match self {
            Backing::File { qcow2: Some(q), .. } => q.live.size(),
            Backing::File { image, .. } => image.size,
            #[cfg(feature = "rbd")]
            Backing::Rbd(disk) => disk.size,
        }
    }

    /// What to call it in the log.
    pub fn name(&self) -> String {
        match self {
            Backing::File { image, .. } => image.path.display().to_string(),
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
        if let Some(s) = &args.serial {
            if s.len() > VIRTIO_BLK_ID_BYTES as usize {
                return Err(DaemonError::Usage(format!(
                    "--serial is at most 20 bytes, '{s}' has {}",
                    s.len()
                )));
            }
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
            Some(spec) if args.format != Format::Raw || args.snapshot_dir.is_some() => {
                return Err(DaemonError::Usage(format!(
                    "--image {spec}: --format and --snapshot-dir are for image files; an RBD image has snapshots of its own (rbd snap create)"
                )));
            }
            Some(spec) => open_rbd(&args, spec)?,
            None => open_file(&args, path)?,
        };
        let limits = DeviceLimits {
            block_size,
            readonly: args.readonly,
            // Two descriptors of a chain are header and status.
            seg_max: u32::from(args.queue_size - 2).clamp(1, 1024),
            ..DeviceLimits::default()
        };
        let serial_str = args.serial.clone().unwrap_or(default_serial);
        let mut serial: Serial = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        serial[..serial_str.len()].copy_from_slice(serial_str.as_bytes());
        let err = |what: &'static str| {
            move |e: std::io::Error| DaemonError::Config(format!("{what}: {e}"))
        };
        let device = Device::new(DeviceSpec {
            name: backing.name(),
            limits,
            capacity_sectors: backing.size() >> SECTOR_SHIFT,
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
            backing: match &backing {
                Backing::File { qcow2: Some(q), .. } => Resize::Qcow2(q.live.clone()),
                Backing::File { image, .. } => Resize::File {
                    file: image.file.try_clone().map_err(err("image"))?,
                    block_device: image.is_block_device,
                },
                #[cfg(feature = "rbd")]
                Backing::Rbd(disk) => {
                    let shared: std::sync::Arc<dyn crate::device::Resizable> = disk.image().clone();
                    Resize::Shared(std::sync::Arc::downgrade(&shared))
                }
            },
        })
        .map_err(|e| DaemonError::Config(format!("QoS: {e}")))?;
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
        })
    }
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
    if let Some(warning) = crate::format::raw_qcow2_warning(&path, args.format) {
        log::warn!("{warning}");
    }
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
            // The default is ours to pick, and never a link.
            nofollow: args.image.is_none(),
            formatted: args.format != Format::Raw,
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
    let qcow2 = match args.format {
        Format::Raw => None,
        Format::Qcow2 => Some(open_qcow2(args, &image)?),
    };
    let fds = match &qcow2 {
        Some(q) => q.live.current().io_fds(),
        None => vec![image.file.as_raw_fd()],
    };
    let uring = UringConfig {
        image_fd: fds[0],
        backing_fds: fds[1..].to_vec(),
        // Room for a chain as deep as live snapshots may make it.
        file_slots: if qcow2.is_some() {
            crate::format::qcow2::MAX_CHAIN as u32
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
    let (block_size, serial) = (image.block_size, image.default_serial());
    Ok((
        Backing::File {
            image,
            created,
            uring,
            qcow2,
        },
        block_size,
        serial,
    ))
}

/// What `--format` and `--snapshot-dir` need of the other options.
fn check_format(args: &ServeArgs) -> Result<(), DaemonError> {
    if args.format == Format::Raw {
        if args.snapshot_dir.is_some() {
            return Err(DaemonError::Usage(
                "--snapshot-dir is for live snapshots of a qcow2 image (--format qcow2)".into(),
            ));
        }
        return Ok(());
    }
    if args.image.is_none() {
        return Err(DaemonError::Usage(
            "--format qcow2 needs --image (create one with qemu-img create -f qcow2)".into(),
        ));
    }
    if args.iopoll {
        return Err(DaemonError::Usage(
            "--iopoll is for raw images: a qcow2 image's metadata work completes outside the ring"
                .into(),
        ));
    }
    Ok(())
}

/// Opens `image` as qcow2, with its backing chain, and starts its metadata
/// thread.
fn open_qcow2(args: &ServeArgs, image: &Image) -> Result<Qcow2Setup, DaemonError> {
    let snapshots = args
        .snapshot_dir
        .as_deref()
        .map(|d| {
            SnapshotDir::open(d)
                .map_err(|e| DaemonError::Config(format!("--snapshot-dir {}: {e}", d.display())))
        })
        .transpose()?;
    let options = crate::format::OpenOptions {
        writable: !args.readonly,
        ..Default::default()
    };
    let live = Live::open(
        &image.path,
        options,
        args.direct && args.engine == EngineKind::Uring,
        snapshots,
    )
    .map_err(|e| DaemonError::Config(e.to_string()))?;
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
            "qcow2 backing chain, top first: {}",
            chain
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(Qcow2Setup {
        live: std::sync::Arc::new(live),
        meta,
    })
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
