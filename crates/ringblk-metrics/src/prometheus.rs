//! Prometheus text exposition format (version 0.0.4), hand-rolled: a few
//! dozen counter lines and one histogram family do not justify a client
//! library and its registry.

use std::fmt::Write;

use crate::counters::{
    COUNTERS, Counter, ERRORS_HELP, Kind, QueueSnapshot, REQUEST_TYPES, REQUESTS_HELP,
};
use crate::latency::{LATENCY_HELP, PROMETHEUS_POWERS};

/// Content type of the text format, as Prometheus expects it.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Renders all queues' counters. Queue N is labelled `queue="N"`.
pub fn encode(queues: &[QueueSnapshot]) -> String {
    let mut out = String::with_capacity(4096);
    // Writing to a String cannot fail; `let _` keeps that explicit.
    let _ = writeln!(out, "# HELP ringblk_queues Number of virtqueues served.");
    let _ = writeln!(out, "# TYPE ringblk_queues gauge");
    let _ = writeln!(out, "ringblk_queues {}", queues.len());

    family(&mut out, "requests", REQUESTS_HELP);
    for (q, s) in queues.iter().enumerate() {
        for (t, name) in REQUEST_TYPES.iter().enumerate() {
            let _ = writeln!(
                out,
                "ringblk_requests_total{{queue=\"{q}\",type=\"{name}\"}} {}",
                s.requests[t]
            );
        }
    }

    let (errors, own): (Vec<&Counter>, Vec<&Counter>) =
        COUNTERS.iter().partition(|c| c.kind == Kind::Error);
    family(&mut out, "errors", ERRORS_HELP);
    for (q, s) in queues.iter().enumerate() {
        for c in &errors {
            let _ = writeln!(
                out,
                "ringblk_errors_total{{queue=\"{q}\",status=\"{}\"}} {}",
                c.status(),
                (c.get)(s)
            );
        }
    }

    for c in own {
        family(&mut out, c.name, c.help);
        for (q, s) in queues.iter().enumerate() {
            let _ = writeln!(
                out,
                "ringblk_{}_total{{queue=\"{q}\"}} {}",
                c.name,
                (c.get)(s)
            );
        }
    }
    latency(&mut out, queues);
    out
}

/// `ringblk_request_duration_seconds`, a histogram per queue and request
/// type: cumulative counts at each of [`PROMETHEUS_POWERS`] (bucket
/// boundaries of the daemon's finer histogram, so exact), `+Inf`, the sum
/// in seconds and the count.
fn latency(out: &mut String, queues: &[QueueSnapshot]) {
    let name = "ringblk_request_duration_seconds";
    let _ = writeln!(out, "# HELP {name} {LATENCY_HELP}");
    let _ = writeln!(out, "# TYPE {name} histogram");
    for (q, s) in queues.iter().enumerate() {
        for (_, t, op) in s.latency.iter() {
            let labels = format!("queue=\"{q}\",type=\"{t}\"");
            // One pass over the non-empty buckets, shortest first.
            let mut buckets = op.buckets().peekable();
            let mut below = 0;
            for k in PROMETHEUS_POWERS {
                let bound = 1u64 << k;
                while let Some((_, n)) = buckets.next_if(|&(end, _)| end <= bound) {
                    below += n;
                }
                let le = bound as f64 / 1e9;
                let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {below}");
            }
            let count = op.count();
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
            let _ = writeln!(out, "{name}_sum{{{labels}}} {}", op.sum_ns as f64 / 1e9);
            let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
        }
    }
}

fn family(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP ringblk_{name}_total {help}");
    let _ = writeln!(out, "# TYPE ringblk_{name}_total counter");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LatencySnapshot;

    /// Checks the shape of every line against the text format: comments are
    /// HELP/TYPE for a known family, samples are `name{labels} integer`.
    #[test]
    fn exposition_is_well_formed() {
        let mut a = QueueSnapshot {
            kicks: 7,
            read_bytes: 4096,
            ..Default::default()
        };
        a.requests[0] = 3;
        let b = QueueSnapshot {
            errors_ioerr: 2,
            ..Default::default()
        };
        let text = encode(&[a, b]);
        assert!(text.contains(
            "ringblk_request_duration_seconds_bucket{queue=\"1\",type=\"flush\",le=\"+Inf\"} 0\n"
        ));
        let mut typed = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE has a kind");
                assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
                assert!(typed.insert(name.to_string()), "duplicate TYPE {name}");
                continue;
            }
            if line.starts_with("# HELP ") {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').expect("sample has a value");
            let name = series.split('{').next().unwrap_or_default();
            if name.ends_with("_sum") {
                value
                    .parse::<f64>()
                    .unwrap_or_else(|_| panic!("bad value in {line}"));
            } else {
                value
                    .parse::<u64>()
                    .unwrap_or_else(|_| panic!("bad value in {line}"));
            }
            // A histogram's samples are its family's name and a suffix.
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|x| name.strip_suffix(x).filter(|f| typed.contains(*f)))
                .unwrap_or(name);
            assert!(typed.contains(family), "sample before TYPE: {line}");
            assert!(
                name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{line}"
            );
        }
        assert!(text.contains("ringblk_requests_total{queue=\"0\",type=\"read\"} 3\n"));
        assert!(text.contains("ringblk_kicks_total{queue=\"0\"} 7\n"));
        assert!(text.contains("ringblk_errors_total{queue=\"1\",status=\"ioerr\"} 2\n"));
        assert!(text.contains("ringblk_queues 2\n"));
    }

    /// Every counter with a value of its own, two queues: the exposition
    /// and the JSON must stay byte for byte what scrapers, dashboards and
    /// `ringblk stats` of other versions were built on.
    #[test]
    fn exposition_and_json_match_the_golden_text() {
        let queues: Vec<QueueSnapshot> = (0..2u64)
            .map(|q| {
                let mut v = 100 * q;
                let mut next = || {
                    v += 1;
                    v
                };
                QueueSnapshot {
                    requests: std::array::from_fn(|_| next()),
                    read_bytes: next(),
                    write_bytes: next(),
                    errors_ioerr: next(),
                    errors_unsupp: next(),
                    errors_no_status: next(),
                    kicks: next(),
                    notifications: next(),
                    notifications_suppressed: next(),
                    submit_calls: next(),
                    submitted_sqes: next(),
                    completion_passes: next(),
                    completions: next(),
                    bounced: next(),
                    poll_iterations: next(),
                    poll_hits: next(),
                    throttled_requests: next(),
                    throttled_ns: next(),
                    poll_ns: next(),
                    poll_preempted: next(),
                    poll_cpu_busy: next(),
                    yields: next(),
                    latency: {
                        let mut l = LatencySnapshot::default();
                        for (i, t) in crate::LATENCY_TYPES.iter().enumerate() {
                            let op = l.get_mut(*t).expect("measured");
                            // 1.5 µs, 3 ms, 20 s, at most 3 each.
                            for _ in 0..(next() + i as u64) % 3 + q {
                                op.record(1_500);
                            }
                            op.record(3_000_000 * (i as u64 + 1));
                            if i == 4 {
                                op.record(20_000_000_000);
                            }
                        }
                        l
                    },
                }
            })
            .collect();
        let text = encode(&queues);
        if std::env::var_os("RINGBLK_BLESS").is_some() {
            // An intended change: write the new text, and review its diff.
            let golden = concat!(env!("CARGO_MANIFEST_DIR"), "/src/exposition.golden.txt");
            std::fs::write(golden, &text).expect("writing the golden text");
        }
        assert_eq!(text, include_str!("exposition.golden.txt"));
        let json = serde_json::to_string(&queues[1]).expect("serializes");
        assert_eq!(
            json,
            r#"{"requests":[101,102,103,104,105,106,107],"read_bytes":108,"write_bytes":109,"errors_ioerr":110,"errors_unsupp":111,"errors_no_status":112,"kicks":113,"notifications":114,"notifications_suppressed":115,"submit_calls":116,"submitted_sqes":117,"completion_passes":118,"completions":119,"bounced":120,"poll_iterations":121,"poll_hits":122,"throttled_requests":123,"throttled_ns":124,"poll_ns":125,"poll_preempted":126,"poll_cpu_busy":127,"yields":128,"latency":{"read":{"count":2,"sum_ns":3001500,"buckets":[[1536,1],[3145728,1]]},"write":{"count":4,"sum_ns":6004500,"buckets":[[1536,3],[6291456,1]]},"flush":{"count":3,"sum_ns":9003000,"buckets":[[1536,2],[9437184,1]]},"discard":{"count":2,"sum_ns":12001500,"buckets":[[1536,1],[12582912,1]]},"write_zeroes":{"count":5,"sum_ns":20015004500,"buckets":[[1536,3],[15728640,1],[21474836480,1]]}}}"#
        );
    }

    /// Each histogram's buckets are cumulative, end at its count, and
    /// count what was recorded below each bound.
    #[test]
    fn histogram_buckets_are_cumulative_and_end_at_the_count() {
        let mut s = QueueSnapshot::default();
        let read = s
            .latency
            .get_mut(crate::RequestType::Read)
            .expect("measured");
        for ns in [900, 1_000, 5_000, 1_000_000, 100_000_000_000] {
            read.record(ns);
        }
        let text = encode(&[s]);
        let series = |le: &str| {
            let line = format!(
                "ringblk_request_duration_seconds_bucket{{queue=\"0\",type=\"read\",le=\"{le}\"}} "
            );
            let l = text.lines().find(|l| l.starts_with(&line));
            l.unwrap_or_else(|| panic!("no {line} in\n{text}"))[line.len()..]
                .parse::<u64>()
                .expect("a count")
        };
        assert_eq!(series("0.000001024"), 2);
        assert_eq!(series("0.000002048"), 2);
        assert_eq!(series("0.000008192"), 3);
        assert_eq!(series("0.001048576"), 4, "1 ms is below 2^20 ns");
        assert_eq!(series("17.179869184"), 4);
        assert_eq!(series("+Inf"), 5);
        assert!(
            text.contains("ringblk_request_duration_seconds_count{queue=\"0\",type=\"read\"} 5\n")
        );
        assert!(
            text.contains(
                "ringblk_request_duration_seconds_sum{queue=\"0\",type=\"read\"} 100.0010069\n"
            ),
            "{text}"
        );
        let mut last = 0;
        for l in text
            .lines()
            .filter(|l| l.contains("_bucket{queue=\"0\",type=\"read\""))
        {
            let n: u64 = l.rsplit_once(' ').unwrap().1.parse().unwrap();
            assert!(n >= last, "not cumulative: {l}");
            last = n;
        }
    }

    /// A counter added to the table must reach the JSON and the exposition
    /// with its own value, whatever its kind.
    #[test]
    fn every_counter_of_the_table_is_exposed() {
        let value = |i: usize| 1000 + i as u64;
        let mut json = serde_json::to_value(QueueSnapshot::default()).expect("serializes");
        for (i, c) in COUNTERS.iter().enumerate() {
            assert!(
                json.get(c.name).is_some(),
                "{} missing from the JSON",
                c.name
            );
            json[c.name] = value(i).into();
        }
        let snap: QueueSnapshot = serde_json::from_value(json).expect("deserializes");
        let text = encode(std::slice::from_ref(&snap));
        for (i, c) in COUNTERS.iter().enumerate() {
            assert_eq!((c.get)(&snap), value(i), "{} read back", c.name);
            let sample = match c.kind {
                Kind::Error => format!(
                    "ringblk_errors_total{{queue=\"0\",status=\"{}\"}} {}\n",
                    c.status(),
                    value(i)
                ),
                Kind::Count | Kind::Bytes => {
                    let help = format!("# HELP ringblk_{}_total {}\n", c.name, c.help);
                    assert!(text.contains(&help), "no {help:?} in\n{text}");
                    format!("ringblk_{}_total{{queue=\"0\"}} {}\n", c.name, value(i))
                }
            };
            assert!(text.contains(&sample), "no {sample:?} in\n{text}");
        }
        for t in REQUEST_TYPES {
            let series = format!("ringblk_requests_total{{queue=\"0\",type=\"{t}\"}} 0\n");
            assert!(text.contains(&series), "no {series:?} in\n{text}");
        }
    }
}
