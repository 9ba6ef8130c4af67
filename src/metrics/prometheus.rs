//! Prometheus text exposition format (version 0.0.4), hand-rolled: a few
//! dozen counter lines do not justify a client library and its registry.

use std::fmt::Write;

use super::counters::{QueueSnapshot, REQUEST_TYPES};

/// Content type of the text format, as Prometheus expects it.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// One plain (unlabelled apart from `queue`) counter of [`QueueSnapshot`].
pub struct Counter {
    /// Metric name without the `ringblk_` prefix and `_total` suffix.
    pub name: &'static str,
    pub help: &'static str,
    pub get: Getter,
}

/// The scalar counters, in exposition order. `requests` and `errors_*` are
/// labelled families and handled separately.
pub const COUNTERS: [Counter; 12] = [
    Counter {
        name: "read_bytes",
        help: "Bytes moved by read requests.",
        get: |s| s.read_bytes,
    },
    Counter {
        name: "write_bytes",
        help: "Bytes moved by write requests.",
        get: |s| s.write_bytes,
    },
    Counter {
        name: "kicks",
        help: "Guest kicks received (kick eventfd reads).",
        get: |s| s.kicks,
    },
    Counter {
        name: "notifications",
        help: "Guest notifications sent (call eventfd writes).",
        get: |s| s.notifications,
    },
    Counter {
        name: "notifications_suppressed",
        help: "Used-ring publications that needed no notification (EVENT_IDX/NO_INTERRUPT).",
        get: |s| s.notifications_suppressed,
    },
    Counter {
        name: "submit_calls",
        help: "io_uring_enter calls made to submit.",
        get: |s| s.submit_calls,
    },
    Counter {
        name: "submitted_sqes",
        help: "SQEs submitted to io_uring.",
        get: |s| s.submitted_sqes,
    },
    Counter {
        name: "completion_passes",
        help: "Passes over the completion queue that found at least one CQE.",
        get: |s| s.completion_passes,
    },
    Counter {
        name: "completions",
        help: "CQEs reaped.",
        get: |s| s.completions,
    },
    Counter {
        name: "bounced",
        help: "Requests that went through a bounce buffer (O_DIRECT misalignment).",
        get: |s| s.bounced,
    },
    Counter {
        name: "poll_iterations",
        help: "Busy-poll loop iterations.",
        get: |s| s.poll_iterations,
    },
    Counter {
        name: "poll_hits",
        help: "Busy-poll windows that found work before timing out.",
        get: |s| s.poll_hits,
    },
];

/// Reads one counter out of a snapshot.
pub type Getter = fn(&QueueSnapshot) -> u64;

/// Error statuses of `ringblk_errors_total`, with their counters.
pub const ERROR_STATUSES: [(&str, Getter); 3] = [
    ("ioerr", |s| s.errors_ioerr),
    ("unsupp", |s| s.errors_unsupp),
    ("no_status", |s| s.errors_no_status),
];

/// Renders all queues' counters. Queue N is labelled `queue="N"`.
pub fn encode(queues: &[QueueSnapshot]) -> String {
    let mut out = String::with_capacity(4096);
    // Writing to a String cannot fail; `let _` keeps that explicit.
    let _ = writeln!(out, "# HELP ringblk_queues Number of virtqueues served.");
    let _ = writeln!(out, "# TYPE ringblk_queues gauge");
    let _ = writeln!(out, "ringblk_queues {}", queues.len());

    family(&mut out, "requests", "Requests completed, by request type.");
    for (q, s) in queues.iter().enumerate() {
        for (t, name) in REQUEST_TYPES.iter().enumerate() {
            let _ = writeln!(
                out,
                "ringblk_requests_total{{queue=\"{q}\",type=\"{name}\"}} {}",
                s.requests[t]
            );
        }
    }

    family(
        &mut out,
        "errors",
        "Requests not answered VIRTIO_BLK_S_OK, by status.",
    );
    for (q, s) in queues.iter().enumerate() {
        for (status, get) in ERROR_STATUSES {
            let _ = writeln!(
                out,
                "ringblk_errors_total{{queue=\"{q}\",status=\"{status}\"}} {}",
                get(s)
            );
        }
    }

    for c in &COUNTERS {
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
    out
}

fn family(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP ringblk_{name}_total {help}");
    let _ = writeln!(out, "# TYPE ringblk_{name}_total counter");
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut typed = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE has a kind");
                assert!(kind == "counter" || kind == "gauge", "{line}");
                assert!(typed.insert(name.to_string()), "duplicate TYPE {name}");
                continue;
            }
            if line.starts_with("# HELP ") {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').expect("sample has a value");
            value
                .parse::<u64>()
                .unwrap_or_else(|_| panic!("bad value in {line}"));
            let name = series.split('{').next().unwrap_or_default();
            assert!(typed.contains(name), "sample before TYPE: {line}");
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
                }
            })
            .collect();
        let text = encode(&queues);
        assert_eq!(text, include_str!("exposition.golden.txt"));
        let json = serde_json::to_string(&queues[1]).expect("serializes");
        assert_eq!(
            json,
            r#"{"requests":[101,102,103,104,105,106,107],"read_bytes":108,"write_bytes":109,"errors_ioerr":110,"errors_unsupp":111,"errors_no_status":112,"kicks":113,"notifications":114,"notifications_suppressed":115,"submit_calls":116,"submitted_sqes":117,"completion_passes":118,"completions":119,"bounced":120,"poll_iterations":121,"poll_hits":122}"#
        );
    }
}
