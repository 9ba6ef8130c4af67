//! The result of one run, as JSON (what `--compare` collects from its client
//! processes) and as text for a person.

use std::fmt::Write;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use super::args::RwMode;
use ringblk_metrics::{QueueSnapshot, Ratios};

/// Latency figures in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl Latency {
    /// From a histogram of nanoseconds.
    pub fn from_ns(h: &Histogram<u64>) -> Latency {
        let us = |ns: u64| ns as f64 / 1000.0;
        if h.is_empty() {
            return Latency::default();
        }
        Latency {
            mean: h.mean() / 1000.0,
            p50: us(h.value_at_quantile(0.50)),
            p99: us(h.value_at_quantile(0.99)),
            p999: us(h.value_at_quantile(0.999)),
            max: us(h.max()),
        }
    }
}

/// One run of one workload against one backend.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResult {
    pub rw: RwMode,
    pub bs: u64,
    pub iodepth: u32,
    pub queues: u16,
    /// The client polled its completion queues.
    pub poll: bool,
    /// Length of the measured window in seconds.
    pub runtime_s: f64,
    /// Successful I/Os completed in the window.
    pub ios: u64,
    pub reads: u64,
    pub writes: u64,
    pub iops: f64,
    pub mib_s: f64,
    /// Enqueue-to-completion latency.
    pub lat_us: Latency,
    /// Failed I/Os in the window.
    pub errors: u64,
    pub first_error: Option<String>,
    /// I/Os over the whole run, ramp and drain included.
    pub total_ios: u64,
    /// Writes among them (absent in results from before it was counted).
    #[serde(default)]
    pub total_writes: u64,
    /// Failed I/Os over the whole run.
    pub total_errors: u64,
    /// Device size the backend reported, in bytes.
    pub device_bytes: u64,
    /// CPU seconds the backend process used in the window (all threads).
    pub backend_cpu_s: Option<f64>,
    /// Backend CPU seconds per million I/Os.
    pub backend_cpu_per_mio: Option<f64>,
    /// The client's own CPU seconds per million I/Os.
    pub client_cpu_per_mio: Option<f64>,
    /// ringblk's counters over the window, summed over queues.
    pub counters: Option<QueueSnapshot>,
    /// Those counters per client I/O.
    pub ratios: Option<Ratios>,
}

/// CPU seconds per million I/Os, if both are known and the run did I/O.
pub fn per_mio(cpu_s: Option<f64>, ios: u64) -> Option<f64> {
    cpu_s.filter(|_| ios > 0).map(|c| c * 1e6 / ios as f64)
}

/// A human-readable report of one run.
pub fn render(r: &RunResult) -> String {
    let mut o = String::new();
    let l = &r.lat_us;
    let _ = writeln!(
        o,
        "{} bs={} iodepth={} queues={}{}: {:.1} s measured",
        r.rw.name(),
        r.bs,
        r.iodepth,
        r.queues,
        if r.poll { " (polling client)" } else { "" },
        r.runtime_s
    );
    let _ = writeln!(
        o,
        "  IOPS      {:>12.0}   ({} reads, {} writes)",
        r.iops, r.reads, r.writes
    );
    let _ = writeln!(o, "  MiB/s     {:>12.1}", r.mib_s);
    let _ = writeln!(
        o,
        "  latency   mean {:.1} us  p50 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}",
        l.mean, l.p50, l.p99, l.p999, l.max
    );
    let _ = writeln!(
        o,
        "  errors    {:>12}{}",
        r.errors,
        r.first_error
            .as_deref()
            .map(|e| format!("   (first: {e})"))
            .unwrap_or_default()
    );
    let cpu = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}"));
    let _ = writeln!(
        o,
        "  CPU-s/M-IO backend {}  client {}",
        cpu(r.backend_cpu_per_mio),
        cpu(r.client_cpu_per_mio)
    );
    if let Some(x) = &r.ratios {
        let f = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.3}"));
        let _ = writeln!(
            o,
            "  per I/O   kicks {}  notifications {}  submits {}   batches: SQEs/submit {}  CQEs/pass {}",
            f(x.kicks_per_io),
            f(x.notifications_per_io),
            f(x.submits_per_io),
            f(x.sqes_per_submit),
            f(x.cqes_per_pass)
        );
    }
    o
}

/// Formats a float with a sensible number of digits for a table cell.
pub fn cell(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if v.abs() >= 1000.0 => format!("{v:.0}"),
        Some(v) if v.abs() >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_from_histogram() {
        let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).expect("hist");
        for ns in 1..=1000u64 {
            h.record(ns * 1000).expect("record");
        }
        let l = Latency::from_ns(&h);
        assert!((l.p50 - 500.0).abs() < 1.0, "{l:?}");
        assert!((l.p99 - 990.0).abs() < 1.0, "{l:?}");
        assert!((l.max - 1000.0).abs() < 1.0, "{l:?}");
        assert_eq!(Latency::from_ns(&Histogram::new(3).expect("hist")).p99, 0.0);
    }

    #[test]
    fn cells_and_per_mio() {
        assert_eq!(cell(Some(123456.7)), "123457");
        assert_eq!(cell(Some(12.345)), "12.3");
        assert_eq!(cell(None), "-");
        assert_eq!(per_mio(Some(2.0), 1_000_000), Some(2.0));
        assert_eq!(per_mio(Some(2.0), 0), None);
    }
}
