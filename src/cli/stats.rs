//! `ringblk stats`: the counters of a running daemon as a table, one column
//! per queue, plus the ratios that tell how well the data path batches,
//! and the latency percentiles (p50, p99, p99.9) of each request type.

use std::fmt::Write;
use std::time::Duration;

use ringblk_metrics::{
    COUNTERS, Counter, Kind, MetricsError, QueueSnapshot, REQUEST_TYPES, Ratios, RequestType,
    fetch, get,
};

use super::exit::{Failure, out};

/// `ringblk stats` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct StatsArgs {
    /// Address the daemon's --metrics listens on (a path for a Unix socket,
    /// else HOST:PORT).
    #[arg(long)]
    pub metrics: String,

    /// Print the raw JSON snapshot instead of a table.
    #[arg(long, conflicts_with = "prometheus")]
    pub json: bool,

    /// Print the raw Prometheus exposition instead of a table.
    #[arg(long)]
    pub prometheus: bool,

    /// Print what happened in each interval of this many seconds instead of
    /// the totals since the daemon started.
    #[arg(long, value_name = "SECS", value_parser = parse_interval)]
    pub interval: Option<f64>,

    /// With --interval: stop after this many intervals (default: until
    /// interrupted).
    #[arg(long, requires = "interval")]
    pub count: Option<u64>,
}

/// `--interval`: a positive number of seconds.
pub fn parse_interval(s: &str) -> Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|secs| Duration::try_from_secs_f64(*secs).is_ok_and(|d| !d.is_zero()))
        .ok_or_else(|| "not a positive number of seconds".into())
}

/// An error talking to a daemon's endpoint, in one line; when nothing
/// listens at the address, says so, and how the daemon would have been
/// told to (`flag`: `--api` or `--metrics`).
pub fn explain(e: &MetricsError, flag: &str) -> String {
    use std::io::ErrorKind;
    match e {
        MetricsError::Fetch { addr, what, source }
            if what == "connect"
                && matches!(
                    source.kind(),
                    ErrorKind::NotFound | ErrorKind::ConnectionRefused
                ) =>
        {
            let started = match flag {
                "--api" => format!("--api {addr}"),
                _ => format!("--metrics {addr} or --api {addr}"),
            };
            format!("no daemon is listening on {addr} (is it running? started with {started}?)")
        }
        other => other.to_string(),
    }
}

/// Prints the counters of a running daemon.
pub fn stats(args: &StatsArgs) -> Result<(), Failure> {
    let failed = |e: MetricsError| Failure::Runtime(explain(&e, "--metrics"));
    if args.prometheus {
        return out(&get(&args.metrics, "/metrics").map_err(failed)?);
    }
    let mut prev = fetch(&args.metrics).map_err(failed)?;
    let Some(secs) = args.interval else {
        if args.json {
            let json =
                serde_json::to_string_pretty(&prev).map_err(|e| Failure::Runtime(e.to_string()))?;
            out(&format!("{json}\n"))?;
        } else {
            out(&render(
                &prev.queues,
                &format!("since start ({})", args.metrics),
            ))?;
        }
        return Ok(());
    };
    let interval = Duration::from_secs_f64(secs);
    let mut n = 0;
    while args.count.is_none_or(|c| n < c) {
        std::thread::sleep(interval);
        let now = fetch(&args.metrics).map_err(failed)?;
        let delta: Vec<QueueSnapshot> = now
            .queues
            .iter()
            .zip(&prev.queues)
            .map(|(a, b)| a.since(b))
            .collect();
        if args.json {
            let json =
                serde_json::to_string(&delta).map_err(|e| Failure::Runtime(e.to_string()))?;
            out(&format!("{json}\n"))?;
        } else {
            out(&format!("{}\n", render(&delta, &format!("last {secs} s"))))?;
        }
        prev = now;
        n += 1;
    }
    Ok(())
}

/// The row name of a counter: "errors ioerr", "read MiB", "submit calls".
fn label(c: &Counter) -> String {
    match c.kind {
        Kind::Error => format!("errors {}", c.status()),
        Kind::Bytes => c.name.replace("_bytes", " MiB"),
        Kind::Count => c.name.replace('_', " "),
    }
}

/// Formats `queues` as a table with a total column and a ratios section.
pub fn render(queues: &[QueueSnapshot], title: &str) -> String {
    let total = QueueSnapshot::sum(queues);
    let cols: Vec<&QueueSnapshot> = queues.iter().chain(std::iter::once(&total)).collect();
    let mut out = String::new();
    let _ = writeln!(out, "{} queue(s), {title}", queues.len());
    let mut header = format!("{:<26}", "counter");
    for q in 0..queues.len() {
        let _ = write!(header, "{:>14}", format!("q{q}"));
    }
    let _ = writeln!(out, "{header}{:>14}", "total");
    let mut row = |name: &str, get: &dyn Fn(&QueueSnapshot) -> String| {
        let _ = write!(out, "{name:<26}");
        for c in &cols {
            let _ = write!(out, "{:>14}", get(c));
        }
        out.push('\n');
    };
    for (t, name) in REQUEST_TYPES.iter().enumerate() {
        // Reads and writes always; the rare types only when they occurred.
        if t < 2 || total.requests[t] != 0 {
            row(&format!("requests {name}"), &|s| s.requests[t].to_string());
        }
    }
    // Errors next to the requests, as in the exposition.
    let (errors, own): (Vec<&Counter>, Vec<&Counter>) =
        COUNTERS.iter().partition(|c| c.kind == Kind::Error);
    for c in errors.into_iter().chain(own) {
        row(&label(c), &|s| match c.kind {
            Kind::Bytes => format!("{:.1}", (c.get)(s) as f64 / 1048576.0),
            Kind::Count | Kind::Error => (c.get)(s).to_string(),
        });
    }
    out.push('\n');
    let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
    let ratios: Vec<_> = cols.iter().map(|s| s.ratios(s.total_requests())).collect();
    let mut derived = |name: &str, get: &dyn Fn(&Ratios) -> Option<f64>| {
        let _ = write!(out, "{name:<26}");
        for r in &ratios {
            let _ = write!(out, "{:>14}", fmt(get(r)));
        }
        out.push('\n');
    };
    derived("kicks/IO", &|r| r.kicks_per_io);
    derived("notifications/IO", &|r| r.notifications_per_io);
    derived("submits/IO", &|r| r.submits_per_io);
    derived("SQEs/submit", &|r| r.sqes_per_submit);
    derived("CQEs/pass", &|r| r.cqes_per_pass);
    derived("poll hits/iteration", &|r| r.poll_hit_rate);
    derived("poll us/IO", &|r| r.poll_us_per_io);
    out.push('\n');
    latency(&mut out, &cols);
    out
}

/// The percentiles shown for each request type.
pub const PERCENTILES: [(&str, f64); 3] = [("p50", 0.5), ("p99", 0.99), ("p999", 0.999)];

/// The latency rows: for reads and writes always, for the other measured
/// types when some were counted, p50/p99/p99.9 in microseconds (the upper
/// bound of the histogram bucket that holds it: at most 12.5% high).
fn latency(out: &mut String, cols: &[&QueueSnapshot]) {
    let Some(total) = cols.last() else {
        return;
    };
    let _ = writeln!(out, "latency (us, pop to completion)");
    for (t, name, op) in total.latency.iter() {
        if op.count() == 0 && !matches!(t, RequestType::Read | RequestType::Write) {
            continue;
        }
        for (p, q) in PERCENTILES {
            let _ = write!(out, "{:<26}", format!("{name} {p}"));
            for c in cols {
                let v = c.latency.get(t).and_then(|op| op.quantile(q));
                let cell = v.map_or("-".to_string(), |ns| format!("{:.1}", ns as f64 / 1000.0));
                let _ = write!(out, "{cell:>14}");
            }
            out.push('\n');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_every_queue_and_ratio() {
        let mut q = QueueSnapshot {
            kicks: 5,
            notifications: 10,
            submit_calls: 2,
            submitted_sqes: 10,
            ..Default::default()
        };
        q.requests[0] = 10;
        let t = render(&[q.clone(), q], "test");
        assert!(t.contains("q0") && t.contains("q1") && t.contains("total"));
        let kicks = t
            .lines()
            .find(|l| l.starts_with("kicks/IO"))
            .expect("kicks/IO row");
        assert!(kicks.contains("0.500"), "{kicks}");
        assert!(
            t.lines()
                .any(|l| l.starts_with("SQEs/submit") && l.contains("5.000"))
        );
        assert!(!t.contains("requests flush"), "zero rare types are hidden");
        assert!(!t.contains("flush p50"), "zero rare types are hidden: {t}");
        let p50 = t
            .lines()
            .find(|l| l.starts_with("read p50"))
            .expect("read p50 row");
        assert!(p50.ends_with("             -"), "nothing measured: {p50}");
        assert!(t.lines().any(|l| l.starts_with("poll us/IO")), "{t}");
    }

    #[test]
    fn latency_percentiles_per_queue_and_in_total() {
        let mut a = QueueSnapshot::default();
        let mut b = QueueSnapshot::default();
        let (ra, rb) = (
            a.latency.get_mut(RequestType::Read).unwrap(),
            b.latency.get_mut(RequestType::Read).unwrap(),
        );
        // q0: 98 fast reads and 2 slow; q1: 50 slow ones. In total, 98
        // fast of 150.
        for _ in 0..98 {
            ra.record(10_000);
        }
        ra.record(5_000_000);
        ra.record(5_000_000);
        for _ in 0..50 {
            rb.record(5_000_000);
        }
        b.latency
            .get_mut(RequestType::Flush)
            .unwrap()
            .record(1_000_000);
        let t = render(&[a, b], "test");
        let row = |name: &str| -> Vec<String> {
            let l = t.lines().find(|l| l.starts_with(name));
            let l = l.unwrap_or_else(|| panic!("no {name} row in\n{t}"));
            l[26..].split_whitespace().map(str::to_string).collect()
        };
        // 10 us is in [9.728, 10.240) us; 5 ms in [4.718592, 5.242880) ms.
        assert_eq!(row("read p50 "), ["10.2", "5242.9", "10.2"], "{t}");
        assert_eq!(row("read p99 "), ["5242.9", "5242.9", "5242.9"], "{t}");
        assert_eq!(row("flush p999"), ["-", "1048.6", "1048.6"], "{t}");
        assert_eq!(row("write p50"), ["-", "-", "-"], "{t}");
    }

    #[test]
    fn table_has_a_row_per_counter() {
        let t = render(&[QueueSnapshot::default()], "test");
        for c in COUNTERS {
            let label = label(c);
            assert!(
                t.lines().any(|l| l.starts_with(&format!("{label:<26}"))),
                "no row '{label}' in:\n{t}"
            );
        }
    }
}
