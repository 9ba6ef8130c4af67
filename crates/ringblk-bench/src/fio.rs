//! The host baseline: fio with io_uring directly on the image (with its
//! rbd engine on an RBD image), i.e. the same I/O with no virtqueue, no
//! vhost-user and no second process.
//!
//! fio's own CPU report leaves out io_uring's kernel workers, so CPU time is
//! sampled from /proc/PID/stat of the whole (single, `--thread`) process
//! while it runs, over a window inside its measured phase.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::BenchError;
use super::args::RwMode;
use super::backends::{Target, spawn_logged};
use super::proc::{self, Guard};
use super::report::{Latency, RunResult};

/// How fio is to be run.
pub struct FioJob<'a> {
    pub fio: &'a Path,
    pub target: &'a Target,
    /// The image's size, for the result.
    pub device_bytes: u64,
    pub rw: RwMode,
    pub mix: u8,
    pub bs: u64,
    pub iodepth: u32,
    /// One fio job (thread) per client queue of the other backends.
    pub jobs: u16,
    pub direct: bool,
    pub runtime: Duration,
    pub ramp: Duration,
    pub cpu: Option<usize>,
    pub extra: &'a [String],
    pub json_out: &'a Path,
    pub log: &'a Path,
}

impl FioJob<'_> {
    fn command(&self) -> Command {
        let mut c = match self.cpu {
            Some(cpu) => {
                let mut c = Command::new("taskset");
                c.arg("-c").arg(cpu.to_string()).arg(self.fio);
                c
            }
            None => Command::new(self.fio),
        };
        c.arg("--name=host");
        match self.target {
            Target::File(image) => {
                c.arg(format!("--filename={}", image.display()))
                    .arg("--ioengine=io_uring");
            }
            // The engine reads the configuration named by CEPH_CONF.
            Target::Rbd(r) => {
                c.env("CEPH_CONF", &r.conf).args([
                    "--ioengine=rbd",
                    &format!("--clientname={}", r.id),
                    &format!("--pool={}", r.pool),
                    &format!("--rbdname={}", r.image),
                ]);
            }
        }
        c.args(["--thread", "--group_reporting", "--time_based"])
            .arg(format!("--rw={}", self.rw.name()))
            .arg(format!("--rwmixread={}", self.mix))
            .arg(format!("--bs={}", self.bs))
            .arg(format!("--iodepth={}", self.iodepth))
            .arg(format!("--numjobs={}", self.jobs))
            .arg(format!("--direct={}", u8::from(self.direct)))
            // Keep the page cache: cached runs must read from it, as the
            // vhost-user backends do.
            .arg("--invalidate=0")
            .arg(format!("--runtime={}ms", self.runtime.as_millis()))
            .arg(format!("--ramp_time={}ms", self.ramp.as_millis()))
            .args([
                "--norandommap",
                "--randrepeat=0",
                "--lat_percentiles=1",
                "--output-format=json",
            ])
            .arg(format!("--output={}", self.json_out.display()))
            .args(self.extra);
        c
    }

    /// Runs fio to the end (killing it after `timeout`) and converts its
    /// report.
    pub fn run(&self, timeout: Duration) -> Result<RunResult, BenchError> {
        let _ = std::fs::remove_file(self.json_out);
        let start = Instant::now();
        let mut child = Guard(spawn_logged(&mut self.command(), self.log)?);
        let pid = child.0.id();
        // The CPU window: from just after the ramp (plus fio's start-up)
        // to the planned end of the measured phase.
        let (from, to) = (
            start + self.ramp + Duration::from_millis(300),
            start + self.ramp + self.runtime,
        );
        let mut samples: Vec<(Instant, f64)> = Vec::new();
        let status = loop {
            if let Some(s) = child
                .0
                .try_wait()
                .map_err(BenchError::io("waiting for fio"))?
            {
                break s;
            }
            let now = Instant::now();
            if now - start > timeout {
                return Err(BenchError::Timeout {
                    who: "fio",
                    timeout,
                    log: proc::tail(self.log, 3),
                });
            }
            if now >= from
                && now <= to
                && let Ok(cpu) = proc::cpu_seconds(pid)
            {
                samples.push((now, cpu));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if !status.success() {
            return Err(BenchError::Failed {
                who: "fio",
                status,
                log: proc::tail(self.log, 5),
            });
        }
        let text = std::fs::read_to_string(self.json_out).map_err(BenchError::io(format!(
            "reading {}",
            self.json_out.display()
        )))?;
        let cpu_rate = match (samples.first(), samples.last()) {
            (Some(a), Some(b)) if b.0 > a.0 => Some((b.1 - a.1) / (b.0 - a.0).as_secs_f64()),
            _ => None,
        };
        convert(&text, self, cpu_rate)
    }
}

#[derive(Deserialize)]
struct Report {
    jobs: Vec<Job>,
}

#[derive(Deserialize)]
struct Job {
    error: i64,
    read: Dir,
    write: Dir,
}

#[derive(Deserialize)]
struct Dir {
    iops: f64,
    bw_bytes: u64,
    total_ios: u64,
    runtime: u64,
    lat_ns: Lat,
}

#[derive(Deserialize)]
struct Lat {
    max: f64,
    mean: f64,
    #[serde(default)]
    percentile: std::collections::HashMap<String, f64>,
}

/// fio's JSON (`--group_reporting`, so one job) as a [`RunResult`].
/// `cpu_rate` is fio's CPU seconds per second in the measured phase.
fn convert(text: &str, job: &FioJob<'_>, cpu_rate: Option<f64>) -> Result<RunResult, BenchError> {
    let parse = |msg: &str| BenchError::Parse {
        who: "fio",
        msg: msg.to_string(),
    };
    // fio may print warnings before the JSON document in the same file.
    let json = text
        .find('{')
        .map(|i| &text[i..])
        .ok_or_else(|| parse("no JSON"))?;
    let report: Report = serde_json::from_str(json).map_err(|e| parse(&e.to_string()))?;
    let j = report.jobs.first().ok_or_else(|| parse("no job"))?;
    // Latency of the direction that did most of the I/O.
    let main = if j.write.total_ios > j.read.total_ios {
        &j.write
    } else {
        &j.read
    };
    let pct = |k: &str| main.lat_ns.percentile.get(k).copied().unwrap_or(0.0) / 1000.0;
    let iops = j.read.iops + j.write.iops;
    let ios = j.read.total_ios + j.write.total_ios;
    // runtime is per job in ms, summed over jobs with --group_reporting.
    let secs = main.runtime as f64 / 1000.0 / f64::from(job.jobs.max(1));
    let cpu_per_mio = cpu_rate.filter(|_| iops > 0.0).map(|r| r / iops * 1e6);
    Ok(RunResult {
        rw: job.rw,
        bs: job.bs,
        iodepth: job.iodepth,
        queues: job.jobs,
        poll: false,
        runtime_s: secs,
        ios,
        reads: j.read.total_ios,
        writes: j.write.total_ios,
        iops,
        mib_s: (j.read.bw_bytes + j.write.bw_bytes) as f64 / 1048576.0,
        lat_us: Latency {
            mean: main.lat_ns.mean / 1000.0,
            p50: pct("50.000000"),
            p99: pct("99.000000"),
            p999: pct("99.900000"),
            max: main.lat_ns.max / 1000.0,
        },
        errors: u64::from(j.error != 0),
        first_error: (j.error != 0).then(|| format!("fio error {}", j.error)),
        total_ios: ios,
        total_writes: j.write.total_ios,
        total_errors: u64::from(j.error != 0),
        device_bytes: job.device_bytes,
        backend_cpu_s: cpu_rate.map(|r| r * secs),
        backend_cpu_per_mio: cpu_per_mio,
        client_cpu_per_mio: None,
        counters: None,
        ratios: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_fio_json() {
        let text = r#"fio: some warning
{"jobs":[{"error":0,
 "read":{"iops":1000.0,"bw_bytes":4096000,"total_ios":3000,"runtime":6000,
   "lat_ns":{"min":1,"max":90000.0,"mean":20000.0,"percentile":{"50.000000":15000,"99.000000":50000,"99.900000":80000}}},
 "write":{"iops":0.0,"bw_bytes":0,"total_ios":0,"runtime":0,"lat_ns":{"min":0,"max":0.0,"mean":0.0}}}]}"#;
        let (p, e): (_, [String; 0]) = (Path::new("/nonexistent"), []);
        let job = FioJob {
            fio: p,
            target: &Target::File(p.to_path_buf()),
            device_bytes: 0,
            rw: RwMode::Randread,
            mix: 70,
            bs: 4096,
            iodepth: 16,
            jobs: 2,
            direct: true,
            runtime: Duration::from_secs(3),
            ramp: Duration::ZERO,
            cpu: None,
            extra: &e,
            json_out: p,
            log: p,
        };
        let r = convert(text, &job, Some(0.5)).expect("converts");
        assert_eq!(r.ios, 3000);
        assert_eq!(r.runtime_s, 3.0);
        assert_eq!(r.lat_us.p99, 50.0);
        assert_eq!(r.backend_cpu_per_mio, Some(500.0));
        assert_eq!(r.errors, 0);
    }
}
