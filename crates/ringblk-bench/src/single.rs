//! One run against a given socket: the plain `ringblk bench`, and what
//! `--compare` runs in a child process per backend and configuration.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use super::BenchError;
use super::args::{BenchArgs, RwMode, default_queue_size};
use super::client::{self, Edge, Workload};
use super::proc;
use super::report::{self, Latency, RunResult};
use ringblk_metrics::{self as metrics, QueueSnapshot};

/// Where to sample the backend's CPU time and counters.
#[derive(Clone, Debug, Default)]
pub struct Probes {
    pub pid: Option<u32>,
    pub metrics: Option<String>,
}

/// `ringblk bench --socket S ...`.
pub fn run(args: &BenchArgs) -> Result<(), BenchError> {
    let one = |n: usize, what: &str| {
        if n > 1 {
            Err(BenchError::Usage(format!(
                "{what} takes one value without --compare"
            )))
        } else {
            Ok(())
        }
    };
    one(args.rw.len(), "--rw")?;
    one(args.iodepth.len(), "--iodepth")?;
    one(args.queues.len(), "--queues")?;
    let iodepth = args.iodepth.first().copied().unwrap_or(1);
    let w = Workload {
        rw: args.rw.first().copied().unwrap_or(RwMode::Randread),
        mix: args.mix,
        bs: args.bs,
        iodepth,
        queues: args.queues.first().copied().unwrap_or(1),
        runtime: args.runtime.unwrap_or(Duration::from_secs(10)),
        ramp: args.ramp.unwrap_or(Duration::from_secs(2)),
        poll: args.poll,
        queue_size: args
            .queue_size
            .unwrap_or_else(|| default_queue_size(iodepth)),
        size: args.size,
        distinct: args.distinct,
        cpu: (!args.no_pin).then_some(args.client_cpu),
    };
    let socket = args
        .socket
        .as_ref()
        .ok_or_else(|| BenchError::Usage("--socket is required".into()))?;
    let probes = Probes {
        pid: args.pid,
        metrics: args.metrics.clone(),
    };
    let result = measure(&socket.to_string_lossy(), &w, &probes, args.connect_timeout)?;
    match args.json.as_deref() {
        Some(p) if p.as_os_str() == "-" => println!("{}", to_json(&result)?),
        Some(p) => {
            eprint!("{}", report::render(&result));
            std::fs::write(p, to_json(&result)?).map_err(|e| BenchError::Io {
                what: format!("writing {}", p.display()),
                source: e,
            })?;
        }
        None => print!("{}", report::render(&result)),
    }
    Ok(())
}

fn to_json(r: &RunResult) -> Result<String, BenchError> {
    serde_json::to_string_pretty(r)
        .map_err(|e| BenchError::Usage(format!("serializing the result: {e}")))
}

/// Ends the process if the run takes longer than any healthy run can.
/// Disarmed when dropped.
struct Watchdog(Option<std::sync::mpsc::Sender<()>>);

impl Watchdog {
    fn start(limit: Duration, socket: &str) -> Watchdog {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let socket = socket.to_string();
        let spawned = std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || {
                if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
                    eprintln!("ringblk-bench: {socket} made no progress for {limit:?}; giving up");
                    std::process::exit(3);
                }
            });
        // Without a watchdog thread the run still works, just unguarded.
        Watchdog(spawned.ok().map(|_| tx))
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// Values sampled at one edge of the window.
#[derive(Default)]
struct Sample {
    backend_cpu: Option<f64>,
    client_cpu: Option<f64>,
    counters: Option<QueueSnapshot>,
}

impl Sample {
    fn take(p: &Probes) -> Sample {
        let counters = p.metrics.as_deref().and_then(|m| match metrics::fetch(m) {
            Ok(doc) => Some(QueueSnapshot::sum(&doc.queues)),
            Err(e) => {
                eprintln!("warning: no counters: {e}");
                None
            }
        });
        Sample {
            backend_cpu: p.pid.and_then(|pid| proc::cpu_seconds(pid).ok()),
            client_cpu: proc::cpu_seconds(std::process::id()).ok(),
            counters,
        }
    }
}

/// Connects to `socket`, runs `w` with a progress line on a terminal, and
/// samples `probes` at the window's edges.
pub fn measure(
    socket: &str,
    w: &Workload,
    probes: &Probes,
    connect_timeout: Duration,
) -> Result<RunResult, BenchError> {
    // libblkio's vhost-user handshake has no timeout: a backend that
    // accepts and never answers would hang us. The per-request stall
    // timeout covers the I/O; this covers everything else.
    let limit =
        connect_timeout + w.ramp + w.runtime + 2 * client::STALL_TIMEOUT + Duration::from_secs(10);
    let _watchdog = Watchdog::start(limit, socket);
    let blkio = client::connect(socket, connect_timeout)?;
    let total = w.ramp + w.runtime;
    // Hidden automatically when standard error is not a terminal (as in the
    // children of --compare), so logs stay clean.
    let bar = ProgressBar::new(total.as_millis() as u64).with_style(
        ProgressStyle::with_template("{prefix:>8} [{bar:30}] {elapsed:>4}/{duration:4} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix("ramp");
    let (mut before, mut after) = (Sample::default(), Sample::default());
    let mut last = (Instant::now(), 0u64);
    let outcome = client::run(
        blkio,
        w,
        &mut |edge| match edge {
            Edge::WindowStart => {
                before = Sample::take(probes);
                bar.set_prefix("measure");
            }
            Edge::WindowEnd => after = Sample::take(probes),
        },
        &mut |elapsed, done| {
            let now = Instant::now();
            let dt = (now - last.0).as_secs_f64();
            if dt > 0.1 {
                bar.set_message(format!("{:.1}k IOPS", (done - last.1) as f64 / dt / 1e3));
                last = (now, done);
            }
            bar.set_position(elapsed.as_millis() as u64);
        },
    );
    bar.finish_and_clear();
    let outcome = outcome?;
    let secs = outcome.window.as_secs_f64();
    let ios = outcome.ios();
    let diff = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| (b - a).max(0.0));
    let backend_cpu = diff(before.backend_cpu, after.backend_cpu);
    let counters = before
        .counters
        .zip(after.counters)
        .map(|(b, a)| a.since(&b));
    Ok(RunResult {
        rw: w.rw,
        bs: w.bs,
        iodepth: w.iodepth,
        queues: w.queues,
        poll: w.poll,
        runtime_s: secs,
        ios,
        reads: outcome.reads,
        writes: outcome.writes,
        iops: ios as f64 / secs,
        mib_s: outcome.bytes as f64 / secs / 1048576.0,
        lat_us: Latency::from_ns(&outcome.hist),
        errors: outcome.errors,
        first_error: outcome.first_error,
        total_ios: outcome.total_ios,
        total_writes: outcome.total_writes,
        total_errors: outcome.total_errors,
        device_bytes: outcome.capacity,
        backend_cpu_s: backend_cpu,
        backend_cpu_per_mio: report::per_mio(backend_cpu, ios),
        client_cpu_per_mio: report::per_mio(diff(before.client_cpu, after.client_cpu), ios),
        ratios: counters.as_ref().map(|c| c.ratios(ios)),
        counters,
    })
}
