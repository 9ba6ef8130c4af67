//! The latency histograms (`ringblk_request_duration_seconds`, the JSON's
//! `latency`, `ringblk stats`' percentiles) of a real daemon under a
//! libblkio client: they count every request the counters count, per
//! queue and type, and a QoS-throttled device shows its queueing in them
//! where an unthrottled one does not.

use std::process::Command;
use std::time::Duration;

use ringblk_metrics::{LATENCY_TYPES, MetricsDoc, QueueSnapshot, RequestType};
use ringblk_testkit::{Client, Daemon, DaemonOptions, MIB, Op, metric, ringblk_bin};

const IMAGE: u64 = 64 * MIB;

fn daemon(args: &[&str]) -> Daemon {
    Daemon::start_with(DaemonOptions {
        size: IMAGE,
        args,
        metrics: true,
        ..DaemonOptions::default()
    })
}

fn doc(d: &Daemon) -> MetricsDoc {
    let path = d.metrics.as_ref().expect("started with metrics");
    ringblk_metrics::fetch(path.to_str().expect("UTF-8 path")).expect("/metrics.json")
}

/// Every type of request on each of two queues: each queue's histogram
/// of each type counts exactly what its request counter counts, in the
/// JSON and in the exposition, whose buckets are cumulative and end at
/// the count.
#[test]
fn histograms_add_up_to_the_request_counters() {
    let d = daemon(&["--queues", "2"]);
    let mut c = Client::connect_queues(&d.socket, 64 << 10, 2);
    let mut ops = Vec::new();
    for q in 0..2usize {
        // A different number of each type on each queue.
        let n = 3 + 2 * q as u64;
        for i in 0..n {
            let offset = (q as u64 * 64 + i) * 4096;
            ops.push((
                q,
                Op::Write {
                    offset,
                    buf_off: 0,
                    len: 4096,
                },
            ));
            ops.push((
                q,
                Op::Read {
                    offset,
                    buf_off: 4096,
                    len: 4096,
                },
            ));
            ops.push((
                q,
                Op::Read {
                    offset,
                    buf_off: 8192,
                    len: 512,
                },
            ));
            if i % 2 == 0 {
                ops.push((q, Op::Flush));
                ops.push((
                    q,
                    Op::Discard {
                        offset: MIB + offset,
                        len: 4096,
                    },
                ));
                ops.push((
                    q,
                    Op::WriteZeroes {
                        offset: 2 * MIB + offset,
                        len: 8192,
                    },
                ));
            }
        }
    }
    for chunk in ops.chunks(16) {
        let r = c.batch_queues(chunk);
        assert!(r.iter().all(|&r| r == 0), "a request failed: {r:?}");
    }
    let m = doc(&d);
    let text = d.scrape_metrics();
    assert_eq!(m.queues.len(), 2);
    for (q, s) in m.queues.iter().enumerate() {
        for t in LATENCY_TYPES {
            let label = ringblk_metrics::REQUEST_TYPES[t as usize];
            let counted = s.requests[t as usize];
            assert!(counted > 0, "queue {q}: no {label} request was counted");
            let h = s.latency.get(t).expect("measured");
            assert_eq!(h.count(), counted, "queue {q} {label}: JSON histogram");
            let b: u64 = h.buckets().map(|(_, n)| n).sum();
            assert_eq!(b, counted, "queue {q} {label}: JSON buckets");
            let series = format!("queue=\"{q}\",type=\"{label}\"");
            let requests = metric(&text, &format!("ringblk_requests_total{{{series}}}"));
            assert_eq!(requests, counted);
            let count = metric(
                &text,
                &format!("ringblk_request_duration_seconds_count{{{series}}}"),
            );
            let inf = metric(
                &text,
                &format!("ringblk_request_duration_seconds_bucket{{{series},le=\"+Inf\"}}"),
            );
            assert_eq!(
                (count, inf),
                (counted, counted),
                "queue {q} {label}: exposition"
            );
            let prefix = format!("ringblk_request_duration_seconds_bucket{{{series},le=");
            let cumulative: Vec<u64> = text
                .lines()
                .filter(|l| l.starts_with(&prefix))
                .map(|l| l.rsplit_once(' ').unwrap().1.parse().unwrap())
                .collect();
            assert!(cumulative.len() > 20, "{series}: {cumulative:?}");
            assert!(
                cumulative.windows(2).all(|w| w[0] <= w[1]),
                "{series}: buckets not cumulative: {cumulative:?}"
            );
        }
        assert_eq!(
            s.latency.get(RequestType::GetId),
            None,
            "GET_ID is not measured"
        );
    }
}

/// A closed loop of `depth` 4 KiB reads for `run`; returns the daemon's
/// counters then.
fn read_loop(d: &Daemon, depth: usize, run: Duration) -> QueueSnapshot {
    let mut c = Client::connect(&d.socket, depth * 4096);
    let slots = IMAGE / 4096;
    let s = c.sustain(depth, 4096, run, |n, _| Op::Read {
        offset: (n * 7919 % slots) * 4096,
        buf_off: 0,
        len: 4096,
    });
    assert_eq!(s.errors, 0);
    QueueSnapshot::sum(&doc(d).queues)
}

/// Microseconds of the `q` quantile of reads.
fn read_us(s: &QueueSnapshot, q: f64) -> f64 {
    let h = s.latency.get(RequestType::Read).expect("measured");
    h.quantile(q).expect("reads were measured") as f64 / 1000.0
}

/// At `--iops 100` and 16 requests in flight, a request waits for the
/// tokens of the 15 ahead of it: 150 ms from the guest's submission. The
/// daemon pops no more while one waits, so most of that wait is on the
/// avail ring, and is counted from the first pass that saw it there: the
/// median is of that order (a latency counted from the pop alone showed
/// 21 ms). An unthrottled device at the same depth shows far less.
#[test]
fn a_throttled_device_shows_its_queueing_in_the_histogram() {
    let throttled = daemon(&["--iops", "100"]);
    let t = read_loop(&throttled, 16, Duration::from_secs(4));
    let (p50, p99) = (read_us(&t, 0.5), read_us(&t, 0.99));
    eprintln!("--iops 100, QD16: p50 {p50:.0} us, p99 {p99:.0} us");
    assert!(
        (100_000.0..320_000.0).contains(&p50),
        "p50 {p50} us at 100 IOPS and QD16: 150 ms expected"
    );
    assert!(p99 >= p50, "p99 {p99} us below p50 {p50} us");
    // `ringblk stats` shows the same percentiles.
    let metrics = throttled.metrics.as_ref().expect("metrics");
    let o = Command::new(ringblk_bin())
        .arg("stats")
        .arg("--metrics")
        .arg(metrics)
        .output()
        .expect("ringblk stats");
    let out = String::from_utf8_lossy(&o.stdout);
    let row = out
        .lines()
        .find(|l| l.starts_with("read p50 "))
        .unwrap_or_else(|| panic!("no read p50 row in:\n{out}"));
    let total: f64 = row.split_whitespace().last().unwrap().parse().unwrap();
    assert!((total - p50).abs() < 1.0, "stats says {row}, JSON {p50}");

    let free = daemon(&[]);
    let f = read_loop(&free, 16, Duration::from_secs(1));
    let free_p50 = read_us(&f, 0.5);
    eprintln!("unthrottled, QD16: p50 {free_p50:.0} us");
    assert!(
        free_p50 < 20_000.0,
        "unthrottled p50 {free_p50} us: the throttled one's {p50} us is not the limit's doing"
    );
}
