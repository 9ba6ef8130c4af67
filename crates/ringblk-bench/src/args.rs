//! `ringblk-bench` arguments. The workload flags take comma-separated lists
//! so that `--compare` can be narrowed (`--iodepth 1,16`); a single run
//! takes one value each.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use ringblk_metrics::parse_size;

/// Access pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RwMode {
    Randread,
    Randwrite,
    Read,
    Write,
    /// Random mix of reads and writes, `--mix` percent reads.
    Randrw,
}

impl RwMode {
    /// The same pattern's name for fio's `--rw` (and for humans).
    pub fn name(self) -> &'static str {
        match self {
            RwMode::Randread => "randread",
            RwMode::Randwrite => "randwrite",
            RwMode::Read => "read",
            RwMode::Write => "write",
            RwMode::Randrw => "randrw",
        }
    }

    pub fn is_random(self) -> bool {
        matches!(self, RwMode::Randread | RwMode::Randwrite | RwMode::Randrw)
    }

    /// Percentage of requests that are reads.
    pub fn read_percent(self, mix: u8) -> u8 {
        match self {
            RwMode::Randread | RwMode::Read => 100,
            RwMode::Randwrite | RwMode::Write => 0,
            RwMode::Randrw => mix,
        }
    }
}

/// `on`/`off` for list-valued switches such as `--direct on,off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnOff {
    On,
    Off,
}

impl OnOff {
    pub fn on(self) -> bool {
        self == OnOff::On
    }
}

/// Backends `--compare` knows how to start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum)]
pub enum BackendName {
    /// `ringblk serve` (see --ringblk-bin).
    Ringblk,
    /// qemu-storage-daemon's vhost-user-blk export.
    Qsd,
    /// fio with io_uring directly on the image: no virtio in between.
    Host,
}

/// Image formats `--compare` serves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FormatName {
    /// The image file as it is.
    #[default]
    Raw,
    /// A qcow2 image made from it with qemu-img (which kind: --qcow2).
    Qcow2,
}

/// Which qcow2 images the `--format qcow2` rows serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Qcow2Kind {
    /// Every cluster allocated and holding data: the raw image converted
    /// with `qemu-img convert -O qcow2 -o preallocation=metadata`.
    Allocated,
    /// A fresh, empty overlay over a base with data (`qemu-img create -f
    /// qcow2 -b BASE`), made again before every run: writes allocate
    /// clusters and copy the rest of each from the base.
    Cow,
}

/// The base under the copy-on-write overlays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum)]
pub enum CowBase {
    /// The raw image (`-F raw`).
    Raw,
    /// The allocated qcow2 made from it (`-F qcow2`).
    Qcow2,
}

/// `ringblk-bench` arguments.
#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    /// vhost-user-blk socket to drive (any backend). Not with --compare,
    /// which starts its own backends.
    #[arg(
        long,
        required_unless_present_any = ["compare", "report"],
        conflicts_with_all = ["compare", "report"]
    )]
    pub socket: Option<PathBuf>,

    /// Access pattern(s). Default: randread (single run), randread,randwrite
    /// (--compare).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub rw: Vec<RwMode>,

    /// Percentage of reads for --rw randrw.
    #[arg(long, default_value_t = 70, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub mix: u8,

    /// Block size of every request.
    #[arg(long, default_value = "4K", value_parser = parse_size)]
    pub bs: u64,

    /// Requests kept in flight per queue. Default: 1 (single run),
    /// 1,16,64 (--compare).
    #[arg(long, value_delimiter = ',')]
    pub iodepth: Vec<u32>,

    /// Virtqueues, each driven by its own client thread. Default: 1
    /// (single run), 1,2 (--compare on a file), 1 (on an RBD image).
    #[arg(long, value_delimiter = ',')]
    pub queues: Vec<u16>,

    /// Measured time (e.g. 10s, 500ms). Default: 10s (single run), 3s
    /// (--compare), 1s (--quick).
    #[arg(long, value_parser = parse_duration)]
    pub runtime: Option<Duration>,

    /// Warm-up before measuring; I/O runs but is not counted. Default: 2s
    /// (single run), 500ms (--compare), 200ms (--quick).
    #[arg(long, value_parser = parse_duration)]
    pub ramp: Option<Duration>,

    /// Poll for completions (libblkio poll queues) instead of sleeping on
    /// the completion eventfd: removes the client's wake-up cost, burns its CPU.
    #[arg(long)]
    pub poll: bool,

    /// Virtqueue size the client asks for. libblkio puts 3 descriptors per
    /// request on the ring, so the default, max(256, 3 x iodepth rounded up
    /// to a power of two), keeps the iodepth from being capped.
    #[arg(long)]
    pub queue_size: Option<u32>,

    /// Use only the first SIZE bytes of the device (default: all of it).
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,

    /// Random patterns: send every request to a different SIZE-sized
    /// region (at a random bs-aligned offset in it), the regions in a
    /// random order, and end the measured window early once each has had
    /// one. With the qcow2 cluster size, every write to an empty overlay
    /// allocates a cluster (--compare does that on copy-on-write rows).
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub distinct: Option<u64>,

    /// CPU the client threads are pinned to.
    #[arg(long, default_value_t = 1)]
    pub client_cpu: usize,

    /// CPU --compare pins each backend process to (taskset).
    #[arg(long, default_value_t = 0)]
    pub backend_cpu: usize,

    /// Pin nothing. On 2 vCPUs placement decides QD1 latency (same CPU
    /// about 7 us, different CPUs about 40 us), so the default pins.
    #[arg(long)]
    pub no_pin: bool,

    /// Backend process whose CPU time (/proc/PID/stat, all threads incl.
    /// io_uring workers) is reported per million I/Os.
    #[arg(long, conflicts_with = "compare")]
    pub pid: Option<u32>,

    /// ringblk --metrics address: report the daemon's counters per I/O.
    #[arg(long, conflicts_with = "compare")]
    pub metrics: Option<String>,

    /// Write the result as JSON to this file ("-": standard output).
    #[arg(long, conflicts_with = "compare")]
    pub json: Option<PathBuf>,

    /// How long to retry connecting while the backend starts up.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub connect_timeout: Duration,

    /// Start ringblk, qemu-storage-daemon and fio one after the other on the
    /// same image and compare them over a matrix of workloads.
    #[arg(long, conflicts_with = "report")]
    pub compare: bool,

    /// Write the tables and the plot of a finished --compare again from its
    /// results.json (into --out, default: next to the JSON); runs nothing.
    #[arg(long, value_name = "RESULTS_JSON")]
    pub report: Option<PathBuf>,

    #[command(flatten)]
    pub cmp: CompareArgs,
}

/// Options only `--compare` uses.
#[derive(Clone, Debug, Args)]
pub struct CompareArgs {
    /// CI-sized matrix (randread, iodepth 1 and 16, one queue, cached, 1 s
    /// per run): well under a minute.
    #[arg(long, requires = "compare")]
    pub quick: bool,

    /// Image to serve: a file or block device, or rbd:POOL/IMAGE, a Ceph
    /// RBD image (ringblk built with --features rbd, qsd's rbd driver,
    /// fio's rbd engine). Default: a file filled with data is created in
    /// the output directory (unwritten or sparse extents read as zeroes
    /// without touching the disk) and removed afterwards.
    #[arg(long, requires = "compare")]
    pub image: Option<PathBuf>,

    /// The --image file is a LUKS1 image (`cryptsetup luksFormat --type
    /// luks1`; qsd's luks driver reads no LUKS2) whose passphrase is in
    /// PATH: ringblk serves it with `--format luks --key-file PATH`, qsd
    /// with its luks driver over the file (`--object secret,file=PATH`).
    /// fio (host) would read ciphertext: leave it out (--backends).
    #[arg(long, requires = "image", value_name = "PATH")]
    pub luks_key_file: Option<PathBuf>,

    /// Size of the created image (file, or RBD image with --ceph-cluster).
    /// Default: 1G (64M with --quick).
    #[arg(long, requires = "compare", value_parser = parse_size)]
    pub image_size: Option<u64>,

    /// Ceph configuration of the cluster holding an rbd: --image.
    #[arg(long, requires = "compare", default_value = "/etc/ceph/ceph.conf")]
    pub ceph_conf: PathBuf,

    /// Ceph user (client.NAME) for an rbd: --image.
    #[arg(long, requires = "compare", default_value = "admin")]
    pub ceph_id: String,

    /// Start a throw-away single-node Ceph cluster in DIR
    /// (scripts/ceph-cluster.sh, wiping DIR), create the RBD image there
    /// (--image, default rbd:rbd/bench; --image-size), write it once, and
    /// stop the cluster at the end. Replaces --ceph-conf.
    #[arg(long, requires = "compare", value_name = "DIR")]
    pub ceph_cluster: Option<PathBuf>,

    /// O_DIRECT setting(s) of the backends. Default: on,off (off with
    /// --quick); on an RBD image always on (no client cache).
    #[arg(long, value_enum, value_delimiter = ',', requires = "compare")]
    pub direct: Vec<OnOff>,

    /// Image format(s) to serve, each a row of its own: raw is the image
    /// file; qcow2 is made from it with qemu-img (kind: --qcow2). ringblk
    /// gets `serve --format qcow2`, qsd `driver=qcow2`; fio (host) has no
    /// qcow2 and runs on raw rows only. Default: raw.
    #[arg(long, value_enum, value_delimiter = ',', requires = "compare")]
    pub format: Vec<FormatName>,

    /// Which qcow2 image(s) the qcow2 rows serve: allocated (every cluster
    /// holds data) and/or cow (a fresh empty overlay over a base with
    /// data, made again before every run). Default: allocated.
    #[arg(long, value_enum, value_delimiter = ',', requires = "compare")]
    pub qcow2: Vec<Qcow2Kind>,

    /// The base under the copy-on-write overlays: the raw image, or the
    /// allocated qcow2 made from it. Default: raw.
    #[arg(long, value_enum, requires = "compare")]
    pub cow_base: Option<CowBase>,

    /// Which backends to run, in this order per configuration (variants run
    /// right after ringblk).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "ringblk,qsd,host"
    )]
    pub backends: Vec<BackendName>,

    /// Extra argument for every `ringblk serve` (repeatable), e.g.
    /// --ringblk-arg=--notify=per-request.
    #[arg(long, allow_hyphen_values = true, value_name = "ARG")]
    pub ringblk_arg: Vec<String>,

    /// An extra ringblk backend NAME started with extra serve arguments
    /// (split on whitespace), e.g. --variant 'late:--signal late'. Repeatable.
    #[arg(long, allow_hyphen_values = true, value_name = "NAME:ARGS")]
    pub variant: Vec<String>,

    /// Before measuring ringblk backend NAME (ringblk or a variant), run
    /// `ringblk ARGS` (split on whitespace; {api} is replaced by the
    /// daemon's control socket, which NAME then serves with --api), e.g.
    /// --setup 'ringblk:ctl --api {api} qos --iops 5000'. Repeatable; the
    /// commands run in order once the daemon is up, and a failing one
    /// fails the run.
    #[arg(long, allow_hyphen_values = true, value_name = "NAME:ARGS")]
    pub setup: Vec<String>,

    /// Extra argument for fio (repeatable), e.g. --fio-arg=--fixedbufs.
    #[arg(long, allow_hyphen_values = true, value_name = "ARG")]
    pub fio_arg: Vec<String>,

    /// Run every backend this many times per configuration (back to back,
    /// interleaved) and report the run with the median IOPS: on a busy or
    /// jittery machine one run per point is a coin toss.
    #[arg(long, default_value_t = 1, requires = "compare")]
    pub repeat: u32,

    /// Directory for results.json, results.md, plot.svg and backend logs.
    /// Default: bench-results/<date-time>.
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// ringblk binary to serve with. Default: the `ringblk` next to this
    /// executable; `ringblk bench` sets RINGBLK_BIN to itself.
    #[arg(long, env = "RINGBLK_BIN", value_name = "PATH")]
    pub ringblk_bin: Option<PathBuf>,

    /// qemu-storage-daemon binary (the qsd backend).
    #[arg(long, default_value = "qemu-storage-daemon")]
    pub qsd_bin: PathBuf,

    /// fio binary (the host baseline).
    #[arg(long, default_value = "fio")]
    pub fio_bin: PathBuf,

    /// qemu-img binary (makes the qcow2 images, and checks them).
    #[arg(long, default_value = "qemu-img")]
    pub qemu_img_bin: PathBuf,
}

/// Parses 10, 10s, 1.5s, 500ms or 2m.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else {
        (t, 1.0)
    };
    num.trim()
        .parse::<f64>()
        .ok()
        .and_then(|v| Duration::try_from_secs_f64(v * scale).ok())
        .ok_or_else(|| format!("'{s}' is not a duration like 10s, 500ms or 2m"))
}

/// The client's default virtqueue size for `iodepth` (see `--queue-size`).
pub fn default_queue_size(iodepth: u32) -> u32 {
    (iodepth.saturating_mul(3)).next_power_of_two().max(256)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("fast").is_err());
    }

    #[test]
    fn queue_size_fits_three_descriptors_per_request() {
        assert_eq!(default_queue_size(1), 256);
        assert_eq!(default_queue_size(64), 256);
        assert_eq!(default_queue_size(128), 512);
    }
}
