//! `ringblk bench --compare`: one command, one image, the same client
//! settings; for every configuration of the matrix, each backend in turn
//! (ringblk, its variants, qemu-storage-daemon, fio on the host), so that
//! drift of the machine (write IOPS vary 2x between runs here) hits all
//! backends of a configuration alike and the ratios stay meaningful.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use super::BenchError;
use super::args::{BackendName, BenchArgs, OnOff, RwMode};
use super::backends::{Backend, Config, Env, Kind, Target};
use super::images::{Check, Image, Images};
use super::rbd::{self, Cluster, RbdImage};
use super::{plot, tables};

/// Everything a comparison produced: `results.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CompareDoc {
    pub meta: Meta,
    pub records: Vec<Record>,
}

/// How the comparison was run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Meta {
    pub ringblk_version: String,
    pub kernel: String,
    pub cpus: usize,
    pub image: String,
    pub image_bytes: u64,
    pub bs: u64,
    pub mix: u8,
    pub runtime_s: f64,
    pub ramp_s: f64,
    pub poll_client: bool,
    /// Runs of each backend per configuration (--repeat).
    pub repeat: u32,
    /// CPU the backends were pinned to (None: not pinned).
    pub backend_cpu: Option<usize>,
    /// CPU the clients (and fio) were pinned to.
    pub client_cpu: Option<usize>,
    /// Backend names in run order, with the extra serve arguments of
    /// ringblk variants.
    pub backends: Vec<(String, Vec<String>)>,
    pub ringblk_args: Vec<String>,
    pub fio_args: Vec<String>,
    /// How each image of the format axis was made (absent before it).
    #[serde(default)]
    pub images: Vec<(Image, String)>,
    /// --setup command lines, by backend.
    #[serde(default)]
    pub setup: Vec<(String, String)>,
    pub started_unix: u64,
    pub wall_s: f64,
    /// /proc/loadavg before and after: anything else running on a 2-CPU
    /// machine shows here and in the numbers.
    pub loadavg_before: String,
    pub loadavg_after: String,
}

/// One backend on one configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub config: Config,
    pub backend: String,
    /// Repetition (0-based) with --repeat.
    #[serde(default)]
    pub rep: u32,
    pub result: Option<super::RunResult>,
    /// Why there is no result.
    pub error: Option<String>,
    /// Something odd that did not prevent a result.
    pub note: Option<String>,
    /// `qemu-img check` of the qcow2 image after a run that wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<Check>,
}

pub fn run(args: &BenchArgs) -> Result<(), BenchError> {
    let started = Instant::now();
    let loadavg_before = loadavg();
    if loadavg_before
        .split_whitespace()
        .next()
        .and_then(|l| l.parse::<f64>().ok())
        .is_some_and(|l| l > 0.5)
    {
        eprintln!(
            "warning: load average {loadavg_before}: something else is running, numbers will be noisy"
        );
    }
    let io = |what: String| move |source| BenchError::Io { what, source };
    let quick = args.cmp.quick;
    let rbd = args.cmp.ceph_cluster.is_some()
        || args
            .cmp
            .image
            .as_deref()
            .and_then(|p| p.to_str())
            .is_some_and(|s| s.starts_with(rbd::RBD_PREFIX));
    if rbd && args.cmp.direct.contains(&OnOff::Off) {
        return Err(BenchError::Usage(
            "--direct off: an RBD image is served without a client cache (librbd's is off in ringblk)".into(),
        ));
    }
    let images_axis = Image::all(&args.cmp.format, &args.cmp.qcow2);
    if rbd && images_axis.iter().any(|i| !i.is_raw()) {
        return Err(BenchError::Usage(
            "--format qcow2: qcow2 images are made from an image file, not an RBD image".into(),
        ));
    }
    if args.cmp.luks_key_file.is_some() && (rbd || images_axis.iter().any(|i| !i.is_raw())) {
        return Err(BenchError::Usage(
            "--luks-key-file: the --image must be a LUKS1 file, served as it is (no --format qcow2, no RBD)".into(),
        ));
    }
    let configs = matrix(args, rbd);
    let backends = backends(args)?;
    let self_exe = std::env::current_exe().map_err(io("finding this executable".into()))?;
    let ringblk_bin = ringblk_bin(args, &self_exe, &backends)?;
    let out = args
        .cmp
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("bench-results").join(timestamp()));
    let logs = out.join("logs");
    std::fs::create_dir_all(&logs).map_err(io(format!("creating {}", logs.display())))?;
    // Sockets go to a short private directory: sun_path holds 108 bytes.
    let run_dir = run_dir().map_err(io("creating a temporary directory".into()))?;

    // An RBD image (`--image rbd:...` or `--ceph-cluster`), else a file.
    let rbd_spec = match args.cmp.image.as_deref().map(|p| p.to_str()) {
        Some(Some(s)) => RbdImage::parse(s).transpose()?,
        _ => None,
    };
    if args.cmp.ceph_cluster.is_some() && args.cmp.image.is_some() && rbd_spec.is_none() {
        return Err(BenchError::Usage(
            "--ceph-cluster creates an RBD image: --image rbd:POOL/IMAGE, or no --image".into(),
        ));
    }
    // Before a cluster is started for nothing.
    if rbd && backends.iter().any(|b| matches!(b.kind, Kind::Ringblk(_))) {
        rbd::check_daemon(&ringblk_bin, run_dir.path())?;
    }
    // Started first, stopped last (on drop), whatever fails in between.
    let cluster = match &args.cmp.ceph_cluster {
        Some(dir) => Some(Cluster::start(dir)?),
        None => None,
    };
    let size = args
        .cmp
        .image_size
        .unwrap_or(if quick { 64 << 20 } else { 1 << 30 });
    let (target, image_bytes, made) = if rbd_spec.is_some() || cluster.is_some() {
        let (pool, image) = rbd_spec.unwrap_or_else(|| ("rbd".into(), "bench".into()));
        let img = RbdImage {
            pool,
            image,
            conf: cluster
                .as_ref()
                .map_or_else(|| args.cmp.ceph_conf.clone(), |c| c.conf.clone()),
            id: args.cmp.ceph_id.clone(),
        };
        if cluster.is_some() {
            eprintln!(
                "creating {} ({} MiB, written once)...",
                img.spec(),
                size >> 20
            );
            img.create_filled(size)?;
        }
        let (bytes, lock) = img.info()?;
        if lock {
            eprintln!("warning: {} {}", img.spec(), rbd::LOCK_WARNING);
        }
        (Target::Rbd(img), bytes, false)
    } else {
        let (image, made) = match &args.cmp.image {
            Some(p) => (p.clone(), false),
            None => {
                let p = out.join("bench.img");
                eprintln!("creating {} ({} MiB of data)...", p.display(), size >> 20);
                make_image(&p, size).map_err(io(format!("creating {}", p.display())))?;
                (p, true)
            }
        };
        let image =
            std::fs::canonicalize(&image).map_err(io(format!("image {}", image.display())))?;
        let bytes = std::fs::metadata(&image).map(|m| m.len()).unwrap_or(0);
        (Target::File(image), bytes, made)
    };
    // The qcow2 images, next to the raw one; removed on drop.
    let images = match &target {
        Target::File(raw) => Some(Images::new(
            &args.cmp.qemu_img_bin,
            raw,
            &out,
            &images_axis,
            args.cmp.cow_base.unwrap_or(super::CowBase::Raw),
        )?),
        Target::Rbd(_) => None,
    };

    let pin = !args.no_pin;
    let env = Env {
        target: target.clone(),
        image_bytes,
        run_dir: run_dir.path().to_path_buf(),
        logs,
        ringblk_bin,
        self_exe,
        qsd_bin: args.cmp.qsd_bin.clone(),
        fio_bin: args.cmp.fio_bin.clone(),
        ringblk_args: args.cmp.ringblk_arg.clone(),
        luks_key_file: args.cmp.luks_key_file.clone(),
        fio_args: args.cmp.fio_arg.clone(),
        bs: args.bs,
        mix: args.mix,
        runtime: args.runtime.unwrap_or(if quick {
            Duration::from_secs(1)
        } else {
            Duration::from_secs(3)
        }),
        ramp: args.ramp.unwrap_or(if quick {
            Duration::from_millis(200)
        } else {
            Duration::from_millis(500)
        }),
        poll: args.poll,
        connect_timeout: args.connect_timeout,
        backend_cpu: pin.then_some(args.backend_cpu),
        client_cpu: pin.then_some(args.client_cpu),
    };

    let repeat = args.cmp.repeat.max(1);
    let total = configs
        .iter()
        .map(|c| backends.iter().filter(|b| b.serves(c.image)).count())
        .sum::<usize>()
        * repeat as usize;
    let per_run = env.runtime + env.ramp + Duration::from_millis(400);
    eprintln!(
        "{} configurations x {} backends{}{} = {total} runs, about {:.0} s; backends on CPU {}, clients on CPU {}",
        configs.len(),
        backends.len(),
        if configs.iter().any(|c| !c.image.is_raw())
            && backends.iter().any(|b| b.kind == Kind::Host)
        {
            " (host on raw rows only)"
        } else {
            ""
        },
        if repeat > 1 {
            format!(" x {repeat} repeats")
        } else {
            String::new()
        },
        per_run.as_secs_f64() * total as f64,
        env.backend_cpu.map_or("any".into(), |c| c.to_string()),
        env.client_cpu.map_or("any".into(), |c| c.to_string()),
    );
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("[{pos:>3}/{len}] {elapsed:>4} eta {eta:>4} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    // Ctrl-C: the children (same process group) get it too and the run in
    // progress fails; then stop, clean up and report what was measured.
    let interrupted = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, interrupted.clone())
            .map_err(io("installing a signal handler".into()))?;
    }
    let mut records = Vec::with_capacity(total);
    'matrix: for cfg in &configs {
        for (rep, b) in (0..repeat).flat_map(|r| backends.iter().map(move |b| (r, b))) {
            if !b.serves(cfg.image) {
                continue;
            }
            if interrupted.load(Ordering::Relaxed) {
                eprintln!("interrupted: reporting the {} runs done", records.len());
                break 'matrix;
            }
            if let (Some(images), false) = (&images, cfg.direct) {
                // Every cached run starts from the same page cache: the
                // image dropped from it and read back in. O_DIRECT writes
                // of earlier rows dropped what they wrote, and what
                // earlier runs left shapes the next: a file read in large
                // chunks sits in large folios, and a 4 KiB buffered write
                // into one costs ext4 several times a write into a small
                // one (cached randwrite at depth 16 ran 34k and 187k IOPS
                // on one daemon, before and after a drop).
                bar.set_message(format!(
                    "{} reading the image into the page cache",
                    cfg.tag()
                ));
                let file = images.data_file(cfg.image);
                let bytes = if cfg.image.is_raw() {
                    env.image_bytes
                } else {
                    u64::MAX
                };
                reset_page_cache(file, bytes).map_err(io(format!(
                    "reading {} into the page cache",
                    file.display()
                )))?;
            }
            bar.set_message(format!("{} {}", cfg.tag(), b.name));
            let rec = run_one(&env, images.as_ref(), cfg, b, rep);
            // A hidden bar (not a terminal) drops println: print directly.
            if bar.is_hidden() {
                eprintln!("{}", tables::one_line(&rec));
            } else {
                bar.println(tables::one_line(&rec));
            }
            records.push(rec);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let image_notes: Vec<(Image, String)> = match &images {
        Some(i) => images_axis.iter().map(|&k| (k, i.describe(k))).collect(),
        None => vec![],
    };
    drop(images);
    if let (true, Target::File(image)) = (made, &target) {
        let _ = std::fs::remove_file(image);
    }

    let doc = CompareDoc {
        meta: Meta {
            ringblk_version: env!("CARGO_PKG_VERSION").into(),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .into(),
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            image: target.describe(),
            image_bytes,
            bs: env.bs,
            mix: env.mix,
            runtime_s: env.runtime.as_secs_f64(),
            ramp_s: env.ramp.as_secs_f64(),
            poll_client: env.poll,
            repeat,
            backend_cpu: env.backend_cpu,
            client_cpu: env.client_cpu,
            backends: backends
                .iter()
                .map(|b| {
                    (
                        b.name.clone(),
                        if let Kind::Ringblk(a) = &b.kind {
                            a.clone()
                        } else {
                            vec![]
                        },
                    )
                })
                .collect(),
            ringblk_args: env.ringblk_args.clone(),
            fio_args: env.fio_args.clone(),
            images: image_notes,
            setup: backends
                .iter()
                .flat_map(|b| {
                    b.setup
                        .iter()
                        .map(|l| (b.name.clone(), format!("ringblk {}", l.join(" "))))
                })
                .collect(),
            started_unix: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
                - started.elapsed().as_secs(),
            wall_s: started.elapsed().as_secs_f64(),
            loadavg_before,
            loadavg_after: loadavg(),
        },
        records,
    };
    let json = serde_json::to_string_pretty(&doc).map_err(|e| BenchError::Usage(e.to_string()))?;
    let json_path = out.join("results.json");
    std::fs::write(&json_path, json).map_err(io(format!("writing {}", json_path.display())))?;
    let (md_path, svg) = write_reports(&doc, &out)?;
    let _ = writeln!(
        std::io::stdout().lock(),
        "wrote {}, {} and {} ({:.0} s)",
        json_path.display(),
        md_path.display(),
        svg.display(),
        doc.meta.wall_s
    );
    let failed = doc.records.iter().filter(|r| r.result.is_none()).count();
    if interrupted.load(Ordering::Relaxed) {
        return Err(BenchError::Usage(format!(
            "interrupted after {} of {total} runs",
            doc.records.len()
        )));
    }
    if failed > 0 {
        return Err(BenchError::Usage(format!(
            "{failed} of {total} runs failed (see the table and {}/logs)",
            out.display()
        )));
    }
    Ok(())
}

/// One run of backend `b` on `cfg`: the image made ready (a fresh overlay
/// for copy-on-write rows), the run, and for a qcow2 row that wrote (or
/// died trying), `qemu-img check` of the image.
fn run_one(env: &Env, images: Option<&Images>, cfg: &Config, b: &Backend, rep: u32) -> Record {
    let mut rec = Record {
        config: *cfg,
        backend: b.name.clone(),
        rep,
        result: None,
        error: None,
        note: None,
        check: None,
    };
    let qcow2 = match images.map(|i| i.prepare(cfg.image)).transpose() {
        Ok(q) => q.flatten(),
        Err(e) => {
            rec.error = Some(format!("making the image: {e}"));
            return rec;
        }
    };
    // Whether the backend got as far as serving the image.
    let served = match b.run(env, cfg, qcow2) {
        Ok(run) => {
            rec.result = Some(run.result);
            rec.note = run.note;
            true
        }
        Err(e) => {
            rec.error = Some(e.to_string());
            !matches!(
                e,
                BenchError::Spawn { .. }
                    | BenchError::StartupExit { .. }
                    | BenchError::NoSocket { .. }
            )
        }
    };
    if let (Some(images), Some(q), true, true) = (images, qcow2, cfg.writes(), served) {
        match images.check(q) {
            Ok(c) => rec.check = Some(c),
            Err(e) => {
                let n = format!("qemu-img check: {e}");
                rec.note = Some(rec.note.take().map_or(n.clone(), |o| format!("{o}; {n}")));
            }
        }
    }
    rec
}

/// Writes results.md and plot.svg for `doc` into `out` and prints the
/// tables. A plot that cannot be drawn is reported, not fatal.
fn write_reports(doc: &CompareDoc, out: &Path) -> Result<(PathBuf, PathBuf), BenchError> {
    let md = tables::markdown(doc);
    let md_path = out.join("results.md");
    std::fs::write(&md_path, &md)
        .map_err(BenchError::io(format!("writing {}", md_path.display())))?;
    let svg = out.join("plot.svg");
    if let Err(e) = plot::draw(doc, &svg) {
        eprintln!("{e}");
    }
    let _ = writeln!(std::io::stdout().lock(), "{md}");
    Ok((md_path, svg))
}

/// `--report results.json`: the tables and the plot again from a finished
/// comparison (after a change to the report code, or to put a run's
/// outputs elsewhere), without running anything.
pub fn report(json: &Path, out: Option<&Path>) -> Result<(), BenchError> {
    let text = std::fs::read_to_string(json)
        .map_err(BenchError::io(format!("reading {}", json.display())))?;
    let doc: CompareDoc = serde_json::from_str(&text).map_err(|e| BenchError::Parse {
        who: "comparison",
        msg: e.to_string(),
    })?;
    let out = out.map_or_else(
        || json.parent().unwrap_or(Path::new(".")).to_path_buf(),
        Path::to_path_buf,
    );
    std::fs::create_dir_all(&out).map_err(BenchError::io(format!("creating {}", out.display())))?;
    let (md, svg) = write_reports(&doc, &out)?;
    eprintln!("wrote {} and {}", md.display(), svg.display());
    Ok(())
}

/// The configurations to run, in order: the defaults (or --quick's), each
/// list narrowed by the corresponding flag. On an RBD image (`rbd`) only
/// uncached, and one queue unless asked (the OSD shares the CPUs, and
/// more queues mostly measure it).
fn matrix(args: &BenchArgs, rbd: bool) -> Vec<Config> {
    let quick = args.cmp.quick;
    let rws = pick(
        &args.rw,
        quick,
        &[RwMode::Randread, RwMode::Randwrite],
        &[RwMode::Randread],
    );
    let depths = pick(&args.iodepth, quick, &[1, 16, 64], &[1, 16]);
    let queues = pick(&args.queues, quick || rbd, &[1, 2], &[1]);
    let directs = if rbd {
        vec![OnOff::On]
    } else {
        pick(
            &args.cmp.direct,
            quick,
            &[OnOff::On, OnOff::Off],
            &[OnOff::Off],
        )
    };
    // Formats innermost: raw and qcow2 of one point run back to back, so
    // that the machine's drift does not enter their ratio.
    let images = Image::all(&args.cmp.format, &args.cmp.qcow2);
    let mut out = Vec::new();
    for &direct in &directs {
        for &queues in &queues {
            for &rw in &rws {
                for &iodepth in &depths {
                    for &image in &images {
                        out.push(Config {
                            rw,
                            iodepth,
                            queues,
                            direct: direct.on(),
                            image,
                        });
                    }
                }
            }
        }
    }
    out
}

/// `given` if the user narrowed the list, else the default for the mode.
fn pick<T: Clone>(given: &[T], quick: bool, full: &[T], small: &[T]) -> Vec<T> {
    if !given.is_empty() {
        given.to_vec()
    } else if quick {
        small.to_vec()
    } else {
        full.to_vec()
    }
}

/// Backends in run order: ringblk, then its variants, then the others as
/// listed in --backends.
fn backends(args: &BenchArgs) -> Result<Vec<Backend>, BenchError> {
    let mut out = Vec::new();
    let mut seen = Vec::new();
    for which in &args.cmp.backends {
        if seen.contains(which) {
            continue;
        }
        seen.push(*which);
        let (name, kind) = match which {
            BackendName::Ringblk => ("ringblk", Kind::Ringblk(vec![])),
            BackendName::Qsd => ("qsd", Kind::Qsd),
            BackendName::Host => ("host", Kind::Host),
        };
        out.push(Backend {
            name: name.into(),
            kind: kind.clone(),
            setup: vec![],
        });
        if kind == Kind::Ringblk(vec![]) {
            for v in &args.cmp.variant {
                out.push(parse_variant(v)?);
            }
        }
    }
    if !args.cmp.backends.contains(&BackendName::Ringblk) {
        for v in &args.cmp.variant {
            out.insert(0, parse_variant(v)?);
        }
    }
    let mut names: Vec<&str> = out.iter().map(|b| b.name.as_str()).collect();
    names.sort_unstable();
    if names.windows(2).any(|w| w[0] == w[1]) {
        return Err(BenchError::Usage(
            "backend and variant names must be unique".into(),
        ));
    }
    for line in &args.cmp.setup {
        let (name, rest) = line.split_once(':').unwrap_or((line, ""));
        let words: Vec<String> = rest.split_whitespace().map(String::from).collect();
        let b = out
            .iter_mut()
            .find(|b| b.name == name.trim() && matches!(b.kind, Kind::Ringblk(_)));
        match b {
            Some(b) if !words.is_empty() => b.setup.push(words),
            _ => {
                return Err(BenchError::Usage(format!(
                    "--setup '{line}': want NAME:ARGS, NAME ringblk or a --variant that runs, ARGS a ringblk command line"
                )));
            }
        }
    }
    Ok(out)
}

/// The daemon to serve with: --ringblk-bin (or RINGBLK_BIN), else the
/// `ringblk` next to this executable, where `cargo build --workspace` puts
/// it. The default is checked before anything runs; a given name may be
/// one for PATH.
fn ringblk_bin(
    args: &BenchArgs,
    self_exe: &Path,
    backends: &[Backend],
) -> Result<PathBuf, BenchError> {
    if let Some(bin) = &args.cmp.ringblk_bin {
        return Ok(bin.clone());
    }
    let bin = self_exe.with_file_name("ringblk");
    if !bin.is_file() && backends.iter().any(|b| matches!(b.kind, Kind::Ringblk(_))) {
        return Err(BenchError::Usage(format!(
            "no ringblk next to this executable, at {} (cargo build --release -p ringblk, or --ringblk-bin PATH)",
            bin.display()
        )));
    }
    Ok(bin)
}

/// `NAME:ARGS` with ARGS split on whitespace.
fn parse_variant(v: &str) -> Result<Backend, BenchError> {
    let (name, rest) = v.split_once(':').unwrap_or((v, ""));
    let name = name.trim();
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.+=".contains(c))
    {
        return Err(BenchError::Usage(format!(
            "--variant '{v}': want NAME:ARGS with a plain NAME"
        )));
    }
    Ok(Backend {
        name: name.into(),
        kind: Kind::Ringblk(rest.split_whitespace().map(String::from).collect()),
        setup: vec![],
    })
}

/// Writes `size` bytes of non-zero data and syncs: reads of holes or
/// unwritten extents would not touch the disk at all. Leaves the data in
/// the page cache, which the cached runs want.
fn make_image(path: &Path, size: u64) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    let mut block = vec![0u8; 1 << 20];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut left = size;
    while left > 0 {
        for chunk in block.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
        }
        let n = left.min(block.len() as u64) as usize;
        f.write_all(&block[..n])?;
        left -= n as u64;
    }
    f.sync_all()
}

/// Drops `path` from the page cache (written back first: only clean
/// pages can be dropped), then reads its first `bytes` back in, 1 MiB at a
/// time.
fn reset_page_cache(path: &Path, bytes: u64) -> std::io::Result<()> {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path)?;
    f.sync_data()?;
    // SAFETY: an advice on an open descriptor; no memory is passed.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    let mut f = f.take(bytes);
    let mut buf = vec![0u8; 1 << 20];
    while f.read(&mut buf)? > 0 {}
    Ok(())
}

/// The three load averages of /proc/loadavg.
fn loadavg() -> String {
    let s = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    s.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

/// A private directory (mkdtemp, mode 0700) for sockets and client
/// results, removed on drop.
fn run_dir() -> std::io::Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .prefix("ringblk-bench-")
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir()
}

/// UTC date-time for the default output directory, e.g. 20250101-120000.
fn timestamp() -> String {
    jiff::Timestamp::now().strftime("%Y%m%d-%H%M%S").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> BenchArgs {
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            b: BenchArgs,
        }
        let mut v = vec!["t", "--compare"];
        v.extend_from_slice(extra);
        T::parse_from(v).b
    }

    #[test]
    fn default_and_quick_matrix() {
        assert_eq!(matrix(&args(&[]), false).len(), 24);
        let q = matrix(&args(&["--quick"]), false);
        assert_eq!(q.len(), 2);
        assert!(
            q.iter()
                .all(|c| !c.direct && c.queues == 1 && c.rw == RwMode::Randread)
        );
        assert_eq!(
            matrix(&args(&["--iodepth", "1", "--direct", "on"]), false).len(),
            4
        );
        let r = matrix(&args(&["--image", "rbd:rbd/bench"]), true);
        assert_eq!(r.len(), 6, "{r:?}");
        assert!(r.iter().all(|c| c.direct && c.queues == 1));
    }

    #[test]
    fn variants_follow_ringblk() {
        let b = backends(&args(&[
            "--variant",
            "late:--signal late",
            "--variant=pr:--notify per-request",
        ]))
        .expect("valid");
        let names: Vec<_> = b.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(names, ["ringblk", "late", "pr", "qsd", "host"]);
        assert_eq!(
            b[1].kind,
            Kind::Ringblk(vec!["--signal".into(), "late".into()])
        );
        assert!(backends(&args(&["--variant", "qsd:--x"])).is_err());
        assert!(backends(&args(&["--variant", "bad name:--x"])).is_err());
    }

    #[test]
    fn the_format_axis_runs_innermost() {
        use crate::Qcow2Kind;
        assert!(matrix(&args(&[]), false).iter().all(|c| c.image.is_raw()));
        let m = matrix(
            &args(&[
                "--format",
                "raw,qcow2",
                "--qcow2",
                "allocated,cow",
                "--iodepth",
                "1,16",
                "--direct",
                "on",
                "--queues",
                "1",
                "--rw",
                "randwrite",
            ]),
            false,
        );
        let images: Vec<_> = m.iter().map(|c| (c.iodepth, c.image)).collect();
        assert_eq!(
            images,
            [
                (1, Image::Raw),
                (1, Image::Qcow2(Qcow2Kind::Allocated)),
                (1, Image::Qcow2(Qcow2Kind::Cow)),
                (16, Image::Raw),
                (16, Image::Qcow2(Qcow2Kind::Allocated)),
                (16, Image::Qcow2(Qcow2Kind::Cow)),
            ]
        );
        assert_eq!(m[2].tag(), "randwrite-qd1-q1-direct-qcow2-cow");
        assert_eq!(m[0].tag(), "randwrite-qd1-q1-direct");
        // fio has no qcow2.
        let b = backends(&args(&[])).expect("valid");
        let host = b.iter().find(|b| b.name == "host").expect("host");
        assert!(host.serves(Image::Raw) && !host.serves(m[1].image));
        assert!(b[0].serves(m[1].image));
    }

    #[test]
    fn setup_commands_go_to_ringblk_backends() {
        let b = backends(&args(&[
            "--variant",
            "capped:",
            "--setup",
            "capped:ctl --api {api} qos --iops 500",
            "--setup=capped:ctl --api {api} status",
        ]))
        .expect("valid");
        let capped = b.iter().find(|b| b.name == "capped").expect("the variant");
        assert_eq!(capped.setup.len(), 2);
        assert_eq!(
            capped.setup[0],
            ["ctl", "--api", "{api}", "qos", "--iops", "500"]
        );
        assert!(b[0].setup.is_empty(), "ringblk has none");
        for bad in ["qsd:ctl status", "nobody:ctl status", "ringblk:", "ringblk"] {
            assert!(backends(&args(&["--setup", bad])).is_err(), "{bad}");
        }
    }

    #[test]
    fn timestamp_shape() {
        let t = timestamp();
        assert_eq!(t.len(), 15);
        assert!(t.starts_with("20"));
    }
}
