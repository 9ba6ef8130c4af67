//! The comparison as Markdown tables: readable in a terminal, pasteable
//! into docs/BENCHMARKS.md.

use std::fmt::Write;

use super::backends::Config;
use super::compare::{CompareDoc, Record};
use super::report::{RunResult, cell};

/// Backends ratios are taken against.
const REFERENCES: [&str; 2] = ["qsd", "host"];

/// One line per finished run, printed while the comparison goes on.
pub fn one_line(r: &Record) -> String {
    let what = format!("{:<30} {:<12}", r.config.tag(), r.backend);
    match (&r.result, &r.error) {
        (Some(x), _) => format!(
            "{what} {:>9.0} IOPS  p50 {:>8.1} us  p99 {:>8.1} us  err {}{}",
            x.iops,
            x.lat_us.p50,
            x.lat_us.p99,
            x.errors,
            r.note
                .as_deref()
                .map(|n| format!("  ({n})"))
                .unwrap_or_default()
        ),
        (None, e) => format!("{what} FAILED: {}", e.as_deref().unwrap_or("?")),
    }
}

/// Summary with ratios, then all the numbers.
pub fn markdown(doc: &CompareDoc) -> String {
    let m = &doc.meta;
    let mut o = String::new();
    let pin = match (m.backend_cpu, m.client_cpu) {
        (Some(b), Some(c)) => format!("backend on CPU {b}, client (and fio) on CPU {c}"),
        _ => "not pinned".into(),
    };
    let _ = writeln!(
        o,
        "Kernel {}, {} CPUs, image {} MiB, bs {}, {:.1} s measured after {:.1} s ramp per run, {pin}{}; {:.0} s in all; load average {} before, {} after.\n",
        m.kernel,
        m.cpus,
        m.image_bytes >> 20,
        m.bs,
        m.runtime_s,
        m.ramp_s,
        if m.poll_client {
            ", polling client"
        } else {
            ""
        },
        m.wall_s,
        m.loadavg_before,
        m.loadavg_after,
    );
    if !m.ringblk_args.is_empty() {
        let _ = writeln!(
            o,
            "ringblk serve extra arguments: `{}`\n",
            m.ringblk_args.join(" ")
        );
    }
    for (name, args) in m.backends.iter().filter(|(_, a)| !a.is_empty()) {
        let _ = writeln!(o, "Variant `{name}`: ringblk serve `{}`\n", args.join(" "));
    }

    let _ = writeln!(
        o,
        "### Summary\n\nRatios are X/qsd and X/host for ringblk and its variants: above 1 is better for IOPS, below 1 is better for p99 latency and CPU per I/O.\n"
    );
    let _ = writeln!(
        o,
        "| workload | qd | queues | O_DIRECT | backend | IOPS | IOPS/qsd | IOPS/host | p99 us | p99/qsd | p99/host | CPU-s/M-IO | CPU/qsd |"
    );
    let _ = writeln!(o, "|---|--:|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|");
    for (cfg, recs) in by_config(doc) {
        let reference = |name: &str| {
            recs.iter()
                .find(|r| r.backend == name)
                .and_then(|r| r.result.as_ref())
        };
        let [qsd, host] = REFERENCES.map(reference);
        for r in &recs {
            let head = config_cells(&cfg, &r.backend);
            let Some(x) = &r.result else {
                let _ = writeln!(o, "{head} FAILED | | | | | | | |");
                continue;
            };
            let is_ref = REFERENCES.contains(&r.backend.as_str());
            let ratio = |f: fn(&RunResult) -> Option<f64>, base: Option<&RunResult>| {
                if is_ref {
                    String::new()
                } else {
                    cell(base.and_then(f).zip(f(x)).map(|(b, v)| v / b))
                }
            };
            let iops = |r: &RunResult| Some(r.iops).filter(|v| *v > 0.0);
            let p99 = |r: &RunResult| Some(r.lat_us.p99).filter(|v| *v > 0.0);
            let cpu = |r: &RunResult| r.backend_cpu_per_mio.filter(|v| *v > 0.0);
            let _ = writeln!(
                o,
                "{head} {:.0} | {} | {} | {} | {} | {} | {} | {} |",
                x.iops,
                ratio(iops, qsd),
                ratio(iops, host),
                cell(Some(x.lat_us.p99)),
                ratio(p99, qsd),
                ratio(p99, host),
                cell(x.backend_cpu_per_mio),
                ratio(cpu, qsd),
            );
        }
    }

    let _ = writeln!(
        o,
        "\n### Details\n\nLatency in microseconds, enqueue to completion as the client sees it. CPU-s/M-IO: CPU seconds per million I/Os of the backend process (all threads, io_uring workers included; for host, fio's whole process, which is client and backend at once) and of the client. Counters (ringblk only) are per I/O the client completed, batches are SQEs per io_uring submit and CQEs per completion pass.\n"
    );
    let _ = writeln!(
        o,
        "| workload | qd | queues | O_DIRECT | backend | IOPS | MiB/s | p50 | p99 | p99.9 | max | errors | backend CPU-s/M-IO | client CPU-s/M-IO | kicks/IO | notifications/IO | submits/IO | SQEs/submit | CQEs/pass |"
    );
    let _ = writeln!(
        o,
        "|---|--:|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    );
    for r in &doc.records {
        let head = config_cells(&r.config, &r.backend);
        let Some(x) = &r.result else {
            let _ = writeln!(
                o,
                "{head} FAILED: {} |",
                r.error
                    .as_deref()
                    .unwrap_or("?")
                    .replace('|', "/")
                    .replace('\n', " ")
            );
            continue;
        };
        let q = x.ratios.unwrap_or_default();
        let _ = writeln!(
            o,
            "{head} {:.0} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            x.iops,
            x.mib_s,
            cell(Some(x.lat_us.p50)),
            cell(Some(x.lat_us.p99)),
            cell(Some(x.lat_us.p999)),
            cell(Some(x.lat_us.max)),
            x.errors,
            cell(x.backend_cpu_per_mio),
            cell(x.client_cpu_per_mio),
            cell(q.kicks_per_io),
            cell(q.notifications_per_io),
            cell(q.submits_per_io),
            cell(q.sqes_per_submit),
            cell(q.cqes_per_pass),
        );
    }
    let notes: Vec<_> = doc
        .records
        .iter()
        .filter_map(|r| r.note.as_ref().map(|n| (r, n)))
        .collect();
    if !notes.is_empty() {
        let _ = writeln!(o, "\nNotes:");
        for (r, n) in notes {
            let _ = writeln!(o, "- {} {}: {n}", r.config.tag(), r.backend);
        }
    }
    o
}

fn config_cells(c: &Config, backend: &str) -> String {
    format!(
        "| {} | {} | {} | {} | {backend} |",
        c.rw.name(),
        c.iodepth,
        c.queues,
        if c.direct { "on" } else { "off" }
    )
}

/// Records grouped by configuration, in run order.
pub fn by_config(doc: &CompareDoc) -> Vec<(Config, Vec<&Record>)> {
    let mut out: Vec<(Config, Vec<&Record>)> = Vec::new();
    for r in &doc.records {
        match out.iter_mut().find(|(c, _)| *c == r.config) {
            Some((_, v)) => v.push(r),
            None => out.push((r.config, vec![r])),
        }
    }
    out
}
