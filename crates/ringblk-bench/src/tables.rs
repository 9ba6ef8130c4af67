//! The comparison as Markdown tables: readable in a terminal, pasteable
//! into docs/benchmarks.md.

use std::fmt::Write;

use super::backends::Config;
use super::compare::{CompareDoc, Record};
use super::images::{Check, Image};
use super::report::{RunResult, cell};

/// Backends ratios are taken against.
const REFERENCES: [&str; 2] = ["qsd", "host"];

/// One line per finished run, printed while the comparison goes on.
pub fn one_line(r: &Record) -> String {
    let what = format!("{:<34} {:<12}", r.config.tag(), r.backend);
    match (&r.result, &r.error) {
        (Some(x), _) => format!(
            "{what} {:>9.0} IOPS  p50 {:>8.1} us  p99 {:>8.1} us  err {}{}{}",
            x.iops,
            x.lat_us.p50,
            x.lat_us.p99,
            x.errors,
            r.check
                .map(|c| format!(
                    "  qcow2 {}{}",
                    c.verdict(),
                    allocating(r, &c)
                        .map(|a| format!(", {a:.0}% of writes allocated"))
                        .unwrap_or_default()
                ))
                .unwrap_or_default(),
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
        "Kernel {}, {} CPUs, image {}{} MiB, bs {}, {:.1} s measured after {:.1} s ramp per run, {pin}{}; {:.0} s in all; load average {} before, {} after.\n",
        m.kernel,
        m.cpus,
        // A file's name is the output directory's; an RBD image's says
        // what was measured.
        if m.image.starts_with("rbd:") {
            format!("{} ", m.image)
        } else {
            String::new()
        },
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
    for (name, line) in &m.setup {
        let _ = writeln!(
            o,
            "`{name}`: `{line}` once the daemon is up, before measuring\n"
        );
    }
    let qcow2_rows = doc.records.iter().any(|r| !r.config.image.is_raw());
    if m.images.iter().any(|(i, _)| !i.is_raw()) {
        let _ = writeln!(o, "Formats:\n");
        for (image, how) in &m.images {
            let _ = writeln!(o, "- **{}**: {how}", image.label());
        }
        if m.backends.iter().any(|(b, _)| b == "host") {
            let _ = writeln!(
                o,
                "- host (fio) has no qcow2: it runs on the raw rows only, and IOPS/host is blank on qcow2 rows"
            );
        }
        let _ = writeln!(o);
    }

    let _ = writeln!(
        o,
        "### Summary\n\nRatios are X/qsd and X/host for ringblk and its variants: above 1 is better for IOPS, below 1 is better for p99 latency and CPU per I/O.{}\n",
        if qcow2_rows {
            " IOPS/raw: a backend's IOPS on a qcow2 row over its own on the raw row of the same point, for every backend."
        } else {
            ""
        }
    );
    let picks = by_config(doc);
    let on_raw = |cfg: &Config, backend: &str| {
        picks
            .iter()
            .find(|(c, _)| *c == cfg.on_raw())
            .and_then(|(_, p)| p.iter().find(|p| p.rec.backend == backend))
            .and_then(|p| p.rec.result.as_ref())
    };
    let repeated = picks.iter().flat_map(|(_, p)| p).any(|p| p.runs > 1);
    if repeated {
        let _ = writeln!(
            o,
            "Each figure is from the run with the median IOPS of {} repetitions; IOPS spread is (max - min) / median over them.\n",
            doc.meta.repeat
        );
    }
    let _ = writeln!(
        o,
        "| workload | qd | queues | O_DIRECT | format | backend | IOPS | IOPS/qsd | IOPS/host |{} p99 us | p99/qsd | p99/host | CPU-s/M-IO | CPU/qsd |{}",
        if qcow2_rows { " IOPS/raw |" } else { "" },
        if repeated { " IOPS spread |" } else { "" }
    );
    let _ = writeln!(
        o,
        "|---|--:|--:|---|---|---|--:|--:|--:|{}--:|--:|--:|--:|--:|{}",
        if qcow2_rows { "--:|" } else { "" },
        if repeated { "--:|" } else { "" }
    );
    for (cfg, recs) in &picks {
        let reference = |name: &str| {
            recs.iter()
                .find(|p| p.rec.backend == name)
                .and_then(|p| p.rec.result.as_ref())
        };
        let [qsd, host] = REFERENCES.map(reference);
        for p in recs {
            let r = p.rec;
            let head = config_cells(cfg, &r.backend);
            let spread = match (repeated, p.spread) {
                (false, _) => String::new(),
                (true, Some(s)) => format!(" {}% |", (s * 100.0).round()),
                (true, None) => " - |".into(),
            };
            let Some(x) = &r.result else {
                let blanks = if qcow2_rows { " |" } else { "" };
                let _ = writeln!(o, "{head} FAILED | | | | | | | |{blanks}{spread}");
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
            // Every backend against its own raw figure (the 0.9x).
            let vs_raw = match (qcow2_rows, cfg.image.is_raw()) {
                (false, _) => String::new(),
                (true, true) => " |".into(),
                (true, false) => format!(
                    " {} |",
                    cell(on_raw(cfg, &r.backend).and_then(iops).map(|b| x.iops / b))
                ),
            };
            let _ = writeln!(
                o,
                "{head} {:.0} | {} | {} |{vs_raw} {} | {} | {} | {} | {} |{spread}",
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
        "| workload | qd | queues | O_DIRECT | format | backend | IOPS | MiB/s | p50 | p99 | p99.9 | max | errors | backend CPU-s/M-IO | client CPU-s/M-IO | kicks/IO | notifications/IO | submits/IO | SQEs/submit | CQEs/pass |"
    );
    let _ = writeln!(
        o,
        "|---|--:|--:|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    );
    for r in picks.iter().flat_map(|(_, p)| p).map(|p| p.rec) {
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
    let checked: Vec<(&Record, Check)> = picks
        .iter()
        .flat_map(|(_, p)| p)
        .filter_map(|p| p.rec.check.map(|c| (p.rec, c)))
        .collect();
    if !checked.is_empty() {
        let _ = writeln!(
            o,
            "\n### qcow2 images after the runs\n\n`qemu-img check` after every qcow2 run that wrote. Writes: the client's over the whole run, ramp included. On an overlay each write went to a cluster of its own and the window ended when none was left, so every write should have allocated one (100%); a window shorter than the run time means the overlay ran out (a larger --image-size gives a longer one).\n"
        );
        let _ = writeln!(
            o,
            "| workload | qd | queues | O_DIRECT | format | backend | measured s | writes | clusters allocated | allocating writes | check |\n|---|--:|--:|---|---|---|--:|--:|--:|--:|---|"
        );
        for (r, c) in checked {
            let _ = writeln!(
                o,
                "{} {} | {} | {} | {} | {} |",
                config_cells(&r.config, &r.backend),
                cell(r.result.as_ref().map(|x| x.runtime_s)),
                r.result
                    .as_ref()
                    .map_or("-".into(), |x| x.total_writes.to_string()),
                c.allocated_clusters,
                allocating(r, &c).map_or("-".into(), |a| format!("{a:.0}%")),
                c.verdict()
            );
        }
    }
    // Notes, and every check that was not clean, of any repetition.
    let notes: Vec<(&Record, String)> = doc
        .records
        .iter()
        .flat_map(|r| {
            let check = r
                .check
                .filter(|c| c.verdict() != "clean")
                .map(|c| (r, format!("qemu-img check after the run: {}", c.verdict())));
            r.note.clone().map(|n| (r, n)).into_iter().chain(check)
        })
        .collect();
    if !notes.is_empty() {
        let _ = writeln!(o, "\nNotes:");
        for (r, n) in notes {
            let rep = if doc.meta.repeat > 1 {
                format!(" (repetition {})", r.rep + 1)
            } else {
                String::new()
            };
            let _ = writeln!(o, "- {} {}{rep}: {n}", r.config.tag(), r.backend);
        }
    }
    o
}

/// On a copy-on-write overlay: the percentage of the run's writes that
/// allocated a cluster (each went to a cluster of its own).
fn allocating(r: &Record, c: &Check) -> Option<f64> {
    let writes = r.result.as_ref()?.total_writes;
    (r.config.image == Image::Qcow2(super::Qcow2Kind::Cow) && writes > 0)
        .then(|| c.allocated_clusters as f64 * 100.0 / writes as f64)
}

fn config_cells(c: &Config, backend: &str) -> String {
    format!(
        "| {} | {} | {} | {} | {} | {backend} |",
        c.rw.name(),
        c.iodepth,
        c.queues,
        if c.direct { "on" } else { "off" },
        c.image.label()
    )
}

/// A backend's result for one configuration: with `--repeat`, the run with
/// the median IOPS (a real run, so its latency and counters belong
/// together), and how far apart the repetitions were.
pub struct Pick<'a> {
    pub rec: &'a Record,
    /// Runs of this backend on this configuration.
    pub runs: usize,
    /// (max - min) / median of the IOPS of the successful runs.
    pub spread: Option<f64>,
}

/// A backend's name and its runs on one configuration.
type Runs<'a> = (&'a str, Vec<&'a Record>);

/// One [`Pick`] per backend, grouped by configuration, in run order.
pub fn by_config(doc: &CompareDoc) -> Vec<(Config, Vec<Pick<'_>>)> {
    let mut groups: Vec<(Config, Vec<Runs<'_>>)> = Vec::new();
    for r in &doc.records {
        let i = match groups.iter().position(|(c, _)| *c == r.config) {
            Some(i) => i,
            None => {
                groups.push((r.config, Vec::new()));
                groups.len() - 1
            }
        };
        let backends = &mut groups[i].1;
        match backends.iter_mut().find(|(b, _)| *b == r.backend) {
            Some((_, v)) => v.push(r),
            None => backends.push((r.backend.as_str(), vec![r])),
        }
    }
    groups
        .into_iter()
        .map(|(c, backends)| (c, backends.into_iter().map(|(_, v)| pick(&v)).collect()))
        .collect()
}

fn pick<'a>(runs: &[&'a Record]) -> Pick<'a> {
    let mut ok: Vec<(&Record, f64)> = runs
        .iter()
        .filter_map(|r| r.result.as_ref().map(|x| (*r, x.iops)))
        .collect();
    ok.sort_by(|a, b| a.1.total_cmp(&b.1));
    let Some(&(rec, median)) = ok.get(ok.len() / 2) else {
        return Pick {
            rec: runs[0],
            runs: runs.len(),
            spread: None,
        };
    };
    let spread = (ok.len() > 1 && median > 0.0).then(|| (ok[ok.len() - 1].1 - ok[0].1) / median);
    Pick {
        rec,
        runs: runs.len(),
        spread,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// A comparison of `runs` (backend, IOPS or None for a failure) on
    /// one configuration.
    pub(crate) fn doc(repeat: u32, runs: &[(&str, Option<f64>)]) -> CompareDoc {
        let config = json!({"rw": "randread", "iodepth": 16, "queues": 1, "direct": false});
        let records: Vec<_> = runs
            .iter()
            .map(|(b, iops)| {
                let result = iops.map(|v| {
                    json!({"rw": "randread", "bs": 4096, "iodepth": 16, "queues": 1,
                    "poll": false, "runtime_s": 1.0, "ios": v as u64, "reads": v as u64,
                    "writes": 0, "iops": v, "mib_s": 1.0,
                    "lat_us": {"mean": 1.0, "p50": 1.0, "p99": 100.0 / v, "p999": 1.0, "max": 1.0},
                    "errors": 0, "total_ios": v as u64, "total_errors": 0, "device_bytes": 1})
                });
                json!({"config": config, "backend": b, "result": result,
                "error": if iops.is_none() { json!("boom") } else { json!(null) }})
            })
            .collect();
        serde_json::from_value(json!({
            "meta": {"ringblk_version": "0", "kernel": "k", "cpus": 2, "image": "i",
            "image_bytes": 1, "bs": 4096, "mix": 70, "runtime_s": 1.0, "ramp_s": 0.0,
            "poll_client": false, "repeat": repeat, "backends": [["ringblk", []], ["qsd", []], ["host", []]],
            "ringblk_args": [], "fio_args": [], "started_unix": 0, "wall_s": 1.0,
            "loadavg_before": "0", "loadavg_after": "0"},
            "records": records,
        }))
        .expect("a valid CompareDoc")
    }

    #[test]
    fn ratios_against_qsd_and_host() {
        let d = doc(
            1,
            &[
                ("ringblk", Some(200.0)),
                ("qsd", Some(100.0)),
                ("host", Some(400.0)),
            ],
        );
        let md = markdown(&d);
        let row = md
            .lines()
            .find(|l| l.contains("| ringblk | 200 |"))
            .expect("summary row");
        // IOPS/qsd 2, IOPS/host 0.5, p99 (0.5 us) / qsd (1 us) 0.5.
        assert!(row.contains("| 2.00 | 0.50 | 0.50 |"), "{row}");
        assert!(!md.contains("IOPS spread"));
    }

    #[test]
    fn repeats_pick_the_median_run_and_report_the_spread() {
        let runs = [
            ("ringblk", Some(100.0)),
            ("qsd", Some(50.0)),
            ("ringblk", Some(300.0)),
            ("qsd", None),
            ("ringblk", Some(200.0)),
            ("qsd", Some(60.0)),
        ];
        let d = doc(3, &runs);
        let picks = by_config(&d);
        assert_eq!(picks.len(), 1);
        let ringblk = &picks[0].1[0];
        assert_eq!(ringblk.runs, 3);
        assert_eq!(ringblk.rec.result.as_ref().map(|r| r.iops), Some(200.0));
        assert_eq!(ringblk.spread, Some(1.0));
        let qsd = &picks[0].1[1];
        assert_eq!(
            qsd.rec.result.as_ref().map(|r| r.iops),
            Some(60.0),
            "failures are skipped"
        );
        let md = markdown(&d);
        assert!(md.contains("IOPS spread"), "{md}");
        assert!(md.contains("| 100% |"), "{md}");
    }

    #[test]
    fn failures_are_shown() {
        let d = doc(1, &[("ringblk", None), ("qsd", Some(1.0))]);
        let md = markdown(&d);
        assert!(md.contains("| ringblk | FAILED |"), "{md}");
        assert!(md.contains("FAILED: boom"), "{md}");
    }

    #[test]
    fn qcow2_rows_show_their_format_the_ratio_to_raw_and_the_check() {
        let mut d = doc(
            1,
            &[
                ("ringblk", Some(200.0)),
                ("qsd", Some(100.0)),
                ("host", Some(400.0)),
                ("ringblk", Some(180.0)),
                ("qsd", Some(150.0)),
            ],
        );
        let cow = Image::Qcow2(crate::Qcow2Kind::Cow);
        for r in &mut d.records[3..] {
            r.config.image = cow;
            r.result.as_mut().expect("a result").total_writes = 100;
            r.check = Some(Check {
                allocated_clusters: 90,
                cluster_bytes: 65536,
                ..Check::default()
            });
        }
        d.records[4].check = Some(Check {
            allocated_clusters: 100,
            corruptions: 1,
            ..Check::default()
        });
        d.meta.images = vec![(Image::Raw, "the file".into()), (cow, "an overlay".into())];
        let md = markdown(&d);
        let row = |needle: &str| {
            md.lines()
                .find(|l| l.contains(needle))
                .unwrap_or_else(|| panic!("no row with {needle} in\n{md}"))
        };
        // IOPS/qsd 1.2, no host on qcow2, 0.9 of its own raw figure.
        let r = row("| qcow2 overlay | ringblk | 180 |");
        assert!(r.contains("| 180 | 1.20 | - | 0.90 |"), "{r}");
        // qsd: no ratios to itself, but its own raw figure.
        let q = row("| qcow2 overlay | qsd | 150 |");
        assert!(q.contains("| 150 |  |  | 1.50 |"), "{q}");
        assert!(row("| raw | ringblk | 200 |").contains("| 200 | 2.00 | 0.50 | |"));
        assert!(md.contains("- **qcow2 overlay**: an overlay"), "{md}");
        assert!(md.contains("host (fio) has no qcow2"), "{md}");
        // The allocation table, and the unclean check in the notes.
        assert!(row("| qcow2 overlay | ringblk | 1.00 | 100 |").contains("| 90 | 90% | clean |"));
        assert!(
            row("| qcow2 overlay | qsd | 1.00 | 100 |").contains("| 100% | 1 corruptions"),
            "{md}"
        );
        assert!(
            md.contains("qsd: qemu-img check after the run: 1 corruptions"),
            "{md}"
        );
        // A results.json from before the format axis reads as raw.
        assert!(
            doc(1, &[("ringblk", Some(1.0))]).records[0]
                .config
                .image
                .is_raw()
        );
    }
}
