//! `ringblk serve`'s options. Parsing only: validation that needs the
//! file system happens in [`super::config`].

use std::path::PathBuf;

use clap::builder::PossibleValue;
use clap::{Args, ValueEnum};
use ringblk_metrics::parse_size;

pub use crate::queue::{NotifyMode, SignalMode};

/// Where `ringblk serve` listens, and the image it creates, by default:
/// these names in a private directory that [`super::config`] picks and
/// checks.
pub const DEFAULT_SOCKET_NAME: &str = "vhost.sock";
pub const DEFAULT_IMAGE_NAME: &str = "disk.img";
/// Size of the default image when `serve` creates it without `--size`.
pub const DEFAULT_IMAGE_SIZE: u64 = 1 << 30;

/// vhost-user-backend maps queues to threads with a 64-bit mask.
pub const MAX_QUEUES: u16 = 64;
/// The largest split virtqueue (virtio 1.x: 32768 entries).
pub const MAX_QUEUE_SIZE: u16 = 32768;

/// `--notify`: the queue's own enum, named for the command line here.
impl ValueEnum for NotifyMode {
    fn value_variants<'a>() -> &'a [Self] {
        &[NotifyMode::Batched, NotifyMode::PerRequest]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            NotifyMode::Batched => PossibleValue::new("batched")
                .help("Publish used->idx and decide on a notification once per completion pass"),
            NotifyMode::PerRequest => PossibleValue::new("per-request")
                .help("Publish and notify after every request (the naive baseline)"),
        })
    }
}

/// `--signal`: the queue's own enum, named for the command line here.
impl ValueEnum for SignalMode {
    fn value_variants<'a>() -> &'a [Self] {
        &[SignalMode::Early, SignalMode::Late]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            SignalMode::Early => PossibleValue::new("early")
                .help("Reap and signal completions before parsing new avail entries"),
            SignalMode::Late => {
                PossibleValue::new("late").help("Submit new requests first, then reap and signal")
            }
        })
    }
}

/// What executes requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EngineKind {
    /// io_uring against the image.
    Uring,
    /// Complete at once without touching the image (reads return zeroes):
    /// the ceiling of the virtqueue and notification path.
    Null,
}

/// A later occurrence of an option overrides an earlier one, so wrappers
/// (e.g. `bench --compare --ringblk-arg` plus a `--variant`) can append.
#[derive(Clone, Debug, Args)]
#[command(args_override_self = true)]
pub struct ServeArgs {
    /// vhost-user socket to listen on. A stale socket file is replaced; one
    /// held by a live daemon is an error. [default: vhost.sock in a
    /// directory private to the user: $XDG_RUNTIME_DIR/ringblk, else
    /// /run/ringblk for root, else ringblk-UID in $TMPDIR or /tmp; created
    /// 0700, and refused if it is a symlink, someone else's, or writable by
    /// its group or others]
    #[arg(long, value_name = "PATH", conflicts_with = "socket_fd")]
    pub socket: Option<PathBuf>,

    /// Serve an already-listening Unix stream socket passed in as file
    /// descriptor N (like qemu-storage-daemon's addr.type=fd), instead of
    /// binding --socket. Without it, a socket passed by systemd
    /// (LISTEN_FDS/LISTEN_PID) is used. The daemon does not remove a
    /// socket it was given.
    #[arg(long, value_name = "N")]
    pub socket_fd: Option<i32>,

    /// Serve the control API (JSON over HTTP: status, resize, metrics) on
    /// this Unix socket, created with mode 0600.
    #[arg(long, value_name = "PATH")]
    pub api: Option<PathBuf>,

    /// Permissions of the socket file, in octal.
    #[arg(long, default_value = "600", value_parser = parse_octal)]
    pub socket_mode: u32,

    /// Image file or block device to export (see --format), or a Ceph RBD image as
    /// rbd:POOL/IMAGE (a daemon built with `--features rbd`). Without
    /// --image, disk.img in the directory of the default socket, created
    /// (sparse, --size, mode 0600) if it does not exist; a symlink there is
    /// refused.
    #[arg(long)]
    pub image: Option<PathBuf>,

    /// Where the dirty bitmaps of a raw image or a block device live: one
    /// sidecar file per bitmap, STEM.bitmap.NAME, STEM being the image's
    /// file name [default: the image's directory; a block device's
    /// bitmaps need this]. A qcow2 image keeps them in its own bitmap
    /// directory (QEMU's persistent bitmaps, listed by qemu-img info).
    /// See docs/backup.md.
    #[arg(long, value_name = "DIR")]
    pub bitmap_dir: Option<PathBuf>,

    /// Where `ctl backup start --nbd SOCKET` may create its NBD socket, and
    /// where the backup keeps what the guest overwrites while it runs (an
    /// unlinked file, as large as what the guest overwrites). Without it,
    /// backups are refused. See docs/backup.md.
    #[arg(long, value_name = "DIR")]
    pub backup_dir: Option<PathBuf>,

    /// The image's format: raw, qcow2 (version 3 read-write, version 2
    /// with --readonly; its backing chain of qcow2 and raw images read-only,
    /// their names resolved as QEMU does), or luks (LUKS1 or LUKS2,
    /// aes-xts-plain64, on a file or block device; the guest sees the
    /// decrypted payload; needs --key-file or --key-fd; a qcow2 with
    /// encrypted layers needs one too). The format is
    /// never probed: a qcow2 image given without --format qcow2 is served
    /// as raw (with a warning), since a guest can write a qcow2 header into
    /// a raw disk. See docs/encryption.md.
    #[arg(long, value_name = "FORMAT", default_value = "raw", value_parser = parse_format)]
    pub format: crate::disk::Format,

    /// --format luks, or an encrypted qcow2 (encrypt.format=luks; one
    /// passphrase for every encrypted layer of its chain): the file
    /// holding the passphrase (all of its bytes,
    /// a trailing newline included, as cryptsetup --key-file reads it; at
    /// most 64 KiB), read at start-up. A systemd credential:
    /// --key-file ${CREDENTIALS_DIRECTORY}/NAME with LoadCredential=NAME:PATH.
    /// A file readable by group or others gets a warning. Never on the
    /// command line or in the environment.
    #[arg(long, value_name = "PATH", conflicts_with = "key_fd")]
    pub key_file: Option<PathBuf>,

    /// As --key-file: an inherited descriptor to read the passphrase from,
    /// to its end, at start-up (a pipe from a secret store).
    #[arg(long, value_name = "FD")]
    pub key_fd: Option<i32>,

    /// Directory where live snapshots (`ringblk ctl snapshot --overlay`)
    /// create their overlays; opened at start-up, one of the few places the
    /// daemon may create files in afterwards (with --bitmap-dir and
    /// --backup-dir). Without it, snapshots are refused. Each snapshot is
    /// recorded there (NEW.ringblk-snapshot); at start, an --image a record
    /// says was superseded is followed to the current top, which is served.
    #[arg(long, value_name = "DIR")]
    pub snapshot_dir: Option<PathBuf>,

    /// qcow2: a directory the backing files may be in (repeatable). With
    /// it, every file of the chain below the top must resolve (symlinks
    /// and `..` followed) inside one of them, the --snapshot-dir or be the
    /// --image itself, or the start is refused; without it, a backing file
    /// may be any file the daemon can read, as in QEMU. A host that serves
    /// images from elsewhere (tenants' uploads) should give it: an image
    /// names its own backing file, and the guest reads that file.
    #[arg(long, value_name = "DIR")]
    pub backing_dir: Vec<PathBuf>,

    /// qcow2: `on` keeps the L2 entries of allocating writes out of the
    /// image until the guest's next FLUSH, appending them to an L2 log next
    /// to the image (IMAGE.ringblk-l2log, created at start), which a
    /// restart after a kill -9 writes in; `off` writes them at once, after
    /// an fdatasync per group of allocating writes (slower on an empty
    /// overlay). No acknowledged write is lost either way. A log the
    /// daemon cannot create is warned about, and served without as with
    /// `off`. See docs/formats.md.
    #[arg(long, value_enum, default_value_t = L2LogMode::On)]
    pub l2_log: L2LogMode,

    /// Ceph configuration for an rbd: image (monitors, keyring).
    #[arg(long, value_name = "PATH", default_value = "/etc/ceph/ceph.conf")]
    pub ceph_conf: PathBuf,

    /// Ceph user (client.NAME) for an rbd: image.
    #[arg(long, value_name = "NAME", default_value = "admin")]
    pub ceph_id: String,

    /// Size of the default image when it has to be created (e.g. 1G, 512M),
    /// a multiple of the block size [default: 1G]. Not with --image, which
    /// is served at its own size; an existing default image keeps its size.
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,

    /// Export read-only: writes, discards and write-zeroes fail.
    #[arg(long)]
    pub readonly: bool,

    /// Open the image with O_DIRECT (bypass the host page cache).
    #[arg(long)]
    pub direct: bool,

    /// Do not lock the image. By default it is locked while the guest's
    /// rings run (an OFD lock: exclusive, shared with --readonly), so that
    /// two daemons, or a daemon and a QEMU, cannot write it at once; a
    /// migration hands the lock over. Only for images whose users
    /// coordinate by other means.
    #[arg(long)]
    pub no_image_lock: bool,

    /// Number of virtqueues, 1 to 64. QEMU's vhost-user-blk-pci asks for
    /// one per vCPU unless given num-queues: serve at least as many.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = parse_queues)]
    pub queues: u16,

    /// Worker threads serving the queues: queue q is served by thread
    /// q % N, which takes turns between its queues [default: the number of
    /// queues, but at most the length of --cpus, or without --cpus the
    /// number of CPUs the daemon may run on, and at most its cgroup's CPU
    /// quota]. A thread with more than one queue does not busy-poll.
    #[arg(long)]
    pub threads: Option<usize>,

    /// Maximum size of each virtqueue (a power of two, 2 to 32768).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = parse_queue_size)]
    pub queue_size: u16,

    /// Serial number reported by GET_ID (at most 20 bytes). Defaults to one
    /// derived from the image's device and inode numbers.
    #[arg(long)]
    pub serial: Option<String>,

    /// Logical block size reported to the guest [default: a block device's
    /// own logical block size; for --direct on a file, what its file system
    /// needs; else 512].
    #[arg(long, value_parser = parse_block_size)]
    pub block_size: Option<u32>,

    /// Report a write-through cache (WCE=0) and make every write durable
    /// before it is acknowledged (each write carries RWF_DSYNC; on qcow2
    /// the metadata of an allocating write is fdatasynced too).
    #[arg(long)]
    pub writethrough: bool,

    /// I/O engine. An rbd: image is served by the RBD engine unless this
    /// is `null`.
    #[arg(long, value_enum, default_value_t = EngineKind::Uring)]
    pub engine: EngineKind,

    /// Serve Prometheus metrics on this address: HOST:PORT for TCP, or a
    /// path for a Unix socket (created with mode 0600). Read-only: the
    /// control verbs are on --api only.
    #[arg(long)]
    pub metrics: Option<String>,

    /// Guest notification strategy.
    #[arg(long, value_enum, default_value_t = NotifyMode::Batched)]
    pub notify: NotifyMode,

    /// Signal finished requests before (early) or after (late) submitting new ones.
    #[arg(long, value_enum, default_value_t = SignalMode::Early)]
    pub signal: SignalMode,

    /// Busy-poll the avail ring and the completion queue for up to this many
    /// microseconds after the last work before sleeping (0: never poll).
    /// Adaptive, like QEMU's iothread poll-max-ns (whose default, 32 us,
    /// this follows): the window grows while short sleeps show polling
    /// would have caught the next event, and shrinks to nothing on an idle
    /// queue, so an idle daemon does not spin.
    #[arg(long, default_value_t = 32)]
    pub poll_us: u64,

    /// Turn off the checks that stop busy-polling when it hurts (the
    /// thread was preempted, another ringblk thread polls on its CPU, the
    /// window keeps expiring empty), and the yield between two looks. For
    /// measuring what they are worth.
    #[arg(long, hide = true)]
    pub no_poll_checks: bool,

    /// Most requests taken off the avail ring per io_uring submit (0: all
    /// that are there). Small batches let the guest see the first
    /// completions, and submit more, while the rest are still being
    /// executed: with early signalling the queue becomes a pipeline.
    #[arg(long, default_value_t = 4)]
    pub max_batch: usize,

    /// Use a kernel submission-queue polling thread (IORING_SETUP_SQPOLL).
    #[arg(long)]
    pub sqpoll: bool,

    /// Poll for completions (IORING_SETUP_IOPOLL); needs --direct and a
    /// device with poll queues.
    #[arg(long)]
    pub iopoll: bool,

    /// Register guest memory with io_uring and issue single-segment requests
    /// as READ_FIXED/WRITE_FIXED.
    #[arg(long)]
    pub fixed_buffers: bool,

    /// Discard on a block device with a blocking BLKDISCARD ioctl, as on
    /// kernels before 6.12, instead of io_uring's discard command. For
    /// testing that fallback.
    #[arg(long, hide = true)]
    pub no_uring_cmd: bool,

    /// Pin worker thread N to CPU list[N % len]. A CPU list as taskset and
    /// cpusets write it: numbers and ranges, comma-separated (0-3,8,10-11).
    /// Threads, not queues: see --threads.
    #[arg(long, value_name = "LIST", value_parser = CpuList::parse, default_value = "", hide_default_value = true)]
    pub cpus: CpuList,

    /// Seccomp filter on the daemon's threads after start-up: `enforce`
    /// kills the process on a syscall outside the allow-list, `log` only
    /// logs it (to the kernel audit log), `off` installs none.
    #[arg(long, value_enum, default_value_t = SeccompMode::Enforce)]
    pub seccomp: SeccompMode,

    /// Landlock after start-up (where the kernel has it): `on` lets the
    /// daemon touch no path but its image and the sockets it removes at
    /// exit, and make no TCP connection (but to an RBD cluster); `off`
    /// restricts nothing. Independent of --seccomp. See docs/security.md.
    #[arg(long, value_enum, default_value_t = LandlockMode::On)]
    pub landlock: LandlockMode,

    #[command(flatten)]
    pub qos: crate::qos::QosChanges,
}

/// What the seccomp filter does with a syscall it does not allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SeccompMode {
    Enforce,
    Log,
    Off,
}

/// Whether the daemon restricts itself with Landlock after start-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LandlockMode {
    On,
    Off,
}

/// Whether a qcow2 image's allocating writes log their L2 entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum L2LogMode {
    On,
    Off,
}

fn parse_format(s: &str) -> Result<crate::disk::Format, String> {
    s.parse()
}

/// `--queues`: 1 to [`MAX_QUEUES`].
fn parse_queues(s: &str) -> Result<u16, String> {
    s.trim()
        .parse::<u16>()
        .ok()
        .filter(|n| (1..=MAX_QUEUES).contains(n))
        .ok_or_else(|| format!("must be a number from 1 to {MAX_QUEUES}"))
}

/// `--queue-size`: a power of two, 2 to [`MAX_QUEUE_SIZE`].
fn parse_queue_size(s: &str) -> Result<u16, String> {
    s.trim()
        .parse::<u16>()
        .ok()
        .filter(|n| (2..=MAX_QUEUE_SIZE).contains(n) && n.is_power_of_two())
        .ok_or_else(|| format!("must be a power of two from 2 to {MAX_QUEUE_SIZE}"))
}

/// A CPU list as taskset(1) and cpuset(7) write it: `0-3,8,10-11`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuList(pub Vec<usize>);

impl CpuList {
    /// Parses a list; the empty string is the empty list (no pinning).
    pub fn parse(s: &str) -> Result<CpuList, String> {
        crate::cpu::parse_list(s).map(CpuList)
    }
}

impl std::ops::Deref for CpuList {
    type Target = [usize];
    fn deref(&self) -> &[usize] {
        &self.0
    }
}

fn parse_octal(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("'{s}' is not an octal file mode like 600"))
}

fn parse_block_size(s: &str) -> Result<u32, String> {
    match s {
        "512" => Ok(512),
        "4096" => Ok(4096),
        _ => Err(format!("block size must be 512 or 4096, not '{s}'")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes() {
        assert_eq!(parse_octal("600"), Ok(0o600));
        assert!(parse_octal("800").is_err());
        assert_eq!(parse_block_size("4096"), Ok(4096));
        assert!(parse_block_size("1024").is_err());
    }
}
