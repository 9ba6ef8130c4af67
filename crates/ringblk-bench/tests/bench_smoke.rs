//! Smoke test of `ringblk-bench` (directly and through `ringblk bench`)
//! and `ringblk stats` against a started daemon: about a second of I/O per
//! case. It checks that the tools work and agree with the daemon's
//! counters, never how fast anything is.
//!
//! The daemon is the `ringblk` next to `ringblk-bench`, which
//! `cargo test --workspace` builds.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ringblk_bench::RunResult;
use ringblk_metrics::{MetricsDoc, QueueSnapshot};
use ringblk_testkit::{Daemon, DaemonOptions, MIB, ringblk_bin, test_dir};

/// Longest a bench or stats process may take before the test fails.
const TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `ringblk ARGS`, killing it after [`TIMEOUT`].
fn ringblk(args: &[&str]) -> Output {
    run(&ringblk_bin(), args)
}

/// Runs `ringblk-bench ARGS`, killing it after [`TIMEOUT`].
fn ringblk_bench(args: &[&str]) -> Output {
    run(Path::new(env!("CARGO_BIN_EXE_ringblk-bench")), args)
}

fn run(bin: &Path, args: &[&str]) -> Output {
    let mut child = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
    let deadline = Instant::now() + TIMEOUT;
    while child.try_wait().expect("polling the child").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "{} {args:?} did not finish within {TIMEOUT:?}",
                bin.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("collecting the output")
}

fn start_daemon() -> Daemon {
    Daemon::start_with(DaemonOptions {
        size: 64 * MIB,
        metrics: true,
        args: &["--queues", "2", "--queue-size", "256"],
        ..DaemonOptions::default()
    })
}

fn counters(metrics: &Path) -> QueueSnapshot {
    let doc = ringblk_metrics::fetch(metrics.to_str().expect("UTF-8 path"))
        .expect("the daemon serves /metrics.json");
    QueueSnapshot::sum(&doc.queues)
}

/// One bench run measuring for `runtime`; returns its parsed JSON result.
fn bench(d: &Daemon, runtime: &str, extra: &[&str]) -> RunResult {
    let metrics = d.metrics.as_ref().expect("started with --metrics");
    let json = d.dir.join("result.json");
    let pid = d.pid().to_string();
    let mut args = vec![
        "--socket",
        d.socket.to_str().expect("UTF-8 path"),
        "--metrics",
        metrics.to_str().expect("UTF-8 path"),
        "--pid",
        &pid,
        "--runtime",
        runtime,
        "--ramp",
        "200ms",
        // Test machines may have one CPU, and pinning is about speed.
        "--no-pin",
        "--json",
        json.to_str().expect("UTF-8 path"),
    ];
    args.extend_from_slice(extra);
    let out = ringblk_bench(&args);
    assert!(
        out.status.success(),
        "ringblk-bench failed: {}\ndaemon log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log()
    );
    let text = std::fs::read_to_string(&json).expect("bench wrote its JSON result");
    serde_json::from_str(&text).expect("the result parses")
}

#[test]
fn bench_reads_and_writes_and_agrees_with_the_counters() {
    let mut d = start_daemon();
    let metrics = d.metrics.clone().expect("started with --metrics");
    let before = counters(&metrics);

    let r = bench(
        &d,
        "1s",
        &["--rw", "randread", "--iodepth", "4", "--queues", "2"],
    );
    assert!(r.iops > 0.0 && r.ios > 0, "no I/O measured: {r:?}");
    assert_eq!(r.errors, 0, "{:?}", r.first_error);
    assert!(r.lat_us.p50 > 0.0 && r.lat_us.p50 <= r.lat_us.p99 && r.lat_us.p99 <= r.lat_us.max);
    assert!(r.total_ios >= r.ios);
    assert!(
        r.backend_cpu_s.is_some(),
        "the daemon's CPU time was sampled"
    );
    let ratios = r.ratios.expect("counters were sampled around the window");
    assert!(ratios.kicks_per_io.is_some() && ratios.notifications_per_io.is_some());

    let w = bench(
        &d,
        "1s",
        &["--rw", "randrw", "--mix", "50", "--iodepth", "8"],
    );
    assert!(w.reads > 0 && w.writes > 0, "{w:?}");
    assert_eq!(w.errors, 0, "{:?}", w.first_error);

    // Everything the client saw complete, the daemon counted.
    let done = counters(&metrics).since(&before);
    let client_total = r.total_ios + w.total_ios;
    assert!(
        done.data_requests() >= client_total,
        "daemon counted {} reads+writes, clients completed {client_total}",
        done.data_requests()
    );
    assert!(done.completions >= client_total, "{done:?}");
    assert!(done.kicks > 0 && done.notifications > 0, "{done:?}");
    assert!(done.submitted_sqes >= done.submit_calls, "{done:?}");
    assert_eq!(done.total_errors(), 0, "{done:?}");
    d.assert_running();
}

#[test]
fn stats_prints_table_json_and_prometheus() {
    let d = start_daemon();
    let metrics = d.metrics.as_ref().expect("started with --metrics");
    let m = metrics.to_str().expect("UTF-8 path");
    bench(&d, "300ms", &[]);

    let table = ringblk(&["stats", "--metrics", m]);
    assert!(
        table.status.success(),
        "{}",
        String::from_utf8_lossy(&table.stderr)
    );
    let table = String::from_utf8_lossy(&table.stdout);
    for needle in [
        "q0",
        "q1",
        "total",
        "requests read",
        "kicks/IO",
        "SQEs/submit",
    ] {
        assert!(table.contains(needle), "no '{needle}' in:\n{table}");
    }

    let json = ringblk(&["stats", "--metrics", m, "--json"]);
    let doc: MetricsDoc = serde_json::from_slice(&json.stdout).expect("stats --json parses");
    assert_eq!(doc.queues.len(), 2);

    let prom = ringblk(&["stats", "--metrics", m, "--prometheus"]);
    let prom = String::from_utf8_lossy(&prom.stdout);
    assert!(
        prom.contains("# TYPE ringblk_requests_total counter"),
        "{prom}"
    );
    assert!(
        prom.contains("ringblk_requests_total{queue=\"1\",type=\"read\"}"),
        "{prom}"
    );
}

/// Through the launcher, so that this also shows `ringblk bench` passing
/// its arguments on.
#[test]
fn bench_reports_a_missing_backend_instead_of_hanging() {
    let dir = test_dir();
    let sock = dir.path().join("nobody.sock");
    let started = Instant::now();
    let out = ringblk(&[
        "bench",
        "--socket",
        sock.to_str().expect("UTF-8 path"),
        "--connect-timeout",
        "300ms",
        "--runtime",
        "1s",
    ]);
    assert!(!out.status.success());
    assert!(started.elapsed() < Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("connect"), "{err}");
}

#[test]
fn ringblk_bench_help_is_the_bench_s_own() {
    let out = ringblk(&["bench", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(help.contains("Usage: ringblk-bench"), "{help}");
    assert!(
        help.contains("--compare") && help.contains("--ringblk-bin"),
        "{help}"
    );
}

/// Whether `bin --version` runs.
fn installed(bin: &str) -> bool {
    Command::new(bin)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `--compare --quick` end to end (about 10 s): every backend that is
/// installed (CI installs qemu-storage-daemon and fio, and fails without
/// them), all outputs written.
#[test]
fn compare_quick_runs_every_backend_and_writes_its_outputs() {
    let mut backends = vec!["ringblk"];
    for (name, bin) in [("qsd", "qemu-storage-daemon"), ("host", "fio")] {
        if installed(bin) {
            backends.push(name);
        } else {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI is set but {bin} is missing (scripts/bench-tools.sh installs it)"
            );
            eprintln!("note: {bin} is not installed; --compare runs without {name}");
        }
    }
    let dir = test_dir();
    let out = dir.path().join("cmp");
    let list = backends.join(",");
    // The daemon is the default: `ringblk` next to `ringblk-bench`.
    let o = ringblk_bench(&[
        "--compare",
        "--quick",
        "--no-pin",
        "--image-size",
        "16M",
        "--backends",
        &list,
        "--out",
        out.to_str().expect("UTF-8 path"),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "bench --compare failed:\n{stderr}");

    let json = std::fs::read_to_string(out.join("results.json")).expect("results.json");
    let doc: serde_json::Value = serde_json::from_str(&json).expect("results.json parses");
    let records = doc["records"].as_array().expect("records");
    assert_eq!(records.len(), 2 * backends.len(), "{stderr}");
    for r in records {
        let result = &r["result"];
        assert!(result["iops"].as_f64().is_some_and(|v| v > 0.0), "{r}");
        assert_eq!(result["errors"].as_u64(), Some(0), "{r}");
    }
    let ringblk_run = records
        .iter()
        .find(|r| r["backend"] == "ringblk")
        .expect("a ringblk record");
    assert!(
        ringblk_run["result"]["ratios"]["kicks_per_io"].is_number(),
        "{ringblk_run}"
    );
    let svg = std::fs::read_to_string(out.join("plot.svg")).expect("plot.svg");
    assert!(svg.starts_with("<svg"));
    let md = std::fs::read_to_string(out.join("results.md")).expect("results.md");
    assert!(md.contains("| workload |"), "{md}");
    assert!(
        !out.join("bench.img").exists(),
        "the image it made is removed"
    );
}

/// Whether the tools a qcow2 comparison needs are here; under CI they must
/// be (scripts/bench-tools.sh installs them), elsewhere the test is skipped
/// with a note.
fn qcow2_tools() -> bool {
    let missing: Vec<_> = ["qemu-img", "qemu-storage-daemon"]
        .into_iter()
        .filter(|b| !installed(b))
        .collect();
    if missing.is_empty() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI is set but {missing:?} is missing (scripts/bench-tools.sh installs it)"
    );
    eprintln!("skipped: {missing:?} is missing (scripts/bench-tools.sh)");
    false
}

/// Whether this daemon serves qcow2 (`serve --format`).
fn daemon_serves_qcow2() -> bool {
    let help = ringblk(&["serve", "--help"]);
    String::from_utf8_lossy(&help.stdout).contains("--format")
}

/// The records of a finished --compare in `out`.
fn records(out: &Path) -> Vec<serde_json::Value> {
    let json = std::fs::read_to_string(out.join("results.json")).expect("results.json");
    let doc: serde_json::Value = serde_json::from_str(&json).expect("results.json parses");
    doc["records"].as_array().expect("records").clone()
}

/// The format axis: qsd serves the allocated qcow2 and a fresh overlay for
/// every run, every write on the overlay allocating a cluster of its own
/// and `qemu-img check` clean after each; fio is left out of qcow2 rows;
/// and a ringblk that does not take `--format` yet gives a failed row with
/// its own message, at once, instead of a hang.
#[test]
fn compare_format_axis_serves_qcow2_and_reports_a_refusing_daemon() {
    if !qcow2_tools() {
        return;
    }
    let mut backends = vec!["ringblk", "qsd"];
    if installed("fio") {
        backends.push("host");
    }
    let dir = test_dir();
    let out = dir.path().join("cmp");
    let started = Instant::now();
    // 64 MiB: 1024 clusters of 64 KiB, which the overlay's writes use up
    // in well under the second asked for; the window then ends early.
    let o = ringblk_bench(&[
        "--compare",
        "--quick",
        "--no-pin",
        "--image-size",
        "64M",
        "--format",
        "raw,qcow2",
        "--qcow2",
        "allocated,cow",
        "--rw",
        "randwrite",
        "--iodepth",
        "4",
        "--runtime",
        "1s",
        "--ramp",
        "0ms",
        "--backends",
        &backends.join(","),
        "--out",
        out.to_str().expect("UTF-8 path"),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    let records = records(&out);
    // raw: every backend; each qcow2 image: all but fio.
    let n = backends.len();
    assert_eq!(records.len(), n + 2 * (n - usize::from(n == 3)), "{stderr}");
    let find = |backend: &str, format: &str, kind: Option<&str>| {
        records
            .iter()
            .find(|r| {
                r["backend"] == backend
                    && r["config"]["format"] == format
                    && r["config"]["qcow2"].as_str() == kind
            })
            .unwrap_or_else(|| panic!("no {backend} {format} {kind:?} record: {stderr}"))
    };
    assert!(
        records
            .iter()
            .all(|r| r["backend"] != "host" || r["config"]["format"] == "raw"),
        "fio ran on qcow2: {stderr}"
    );
    let serves = |r: &serde_json::Value| {
        let x = &r["result"];
        assert!(x["iops"].as_f64().is_some_and(|v| v > 0.0), "{r}");
        assert_eq!(x["errors"].as_u64(), Some(0), "{r}");
    };
    let clean = |r: &serde_json::Value| {
        let c = &r["check"];
        assert_eq!(c["corruptions"].as_u64(), Some(0), "{r}");
        assert_eq!(c["leaks"].as_u64(), Some(0), "{r}");
        assert_eq!(c["check_errors"].as_u64(), Some(0), "{r}");
    };
    // Every write to the overlay allocated a cluster: as many clusters
    // as writes, counted by qemu-img, and the overlay was new for the run.
    let allocated_each_write = |r: &serde_json::Value| {
        let writes = r["result"]["total_writes"].as_u64().expect("total_writes");
        assert!(writes > 0, "{r}");
        assert_eq!(
            r["check"]["allocated_clusters"].as_u64(),
            Some(writes),
            "{r}"
        );
    };
    serves(find("ringblk", "raw", None));
    for kind in ["allocated", "cow"] {
        let q = find("qsd", "qcow2", Some(kind));
        serves(q);
        clean(q);
    }
    let cow = find("qsd", "qcow2", Some("cow"));
    allocated_each_write(cow);
    assert!(
        cow["result"]["runtime_s"].as_f64().is_some_and(|s| s < 1.0),
        "1024 clusters last under a second at any speed: {cow}"
    );

    if daemon_serves_qcow2() {
        assert!(o.status.success(), "bench --compare failed:\n{stderr}");
        for kind in ["allocated", "cow"] {
            let r = find("ringblk", "qcow2", Some(kind));
            serves(r);
            clean(r);
        }
        allocated_each_write(find("ringblk", "qcow2", Some("cow")));
    } else {
        // Until the daemon serves qcow2: the two ringblk qcow2 rows fail
        // with the daemon's own line, the rest stands.
        assert!(!o.status.success());
        assert!(stderr.contains("2 of"), "{stderr}");
        for kind in ["allocated", "cow"] {
            let r = find("ringblk", "qcow2", Some(kind));
            let err = r["error"].as_str().unwrap_or_default();
            assert!(
                err.contains("exited at start-up")
                    && err.contains("unexpected argument '--format'"),
                "{err}"
            );
            assert!(r["check"].is_null(), "nothing served, nothing checked: {r}");
        }
        assert!(started.elapsed() < Duration::from_secs(45));
    }
    let md = std::fs::read_to_string(out.join("results.md")).expect("results.md");
    for needle in [
        "| format |",
        "| IOPS/raw |",
        "| qcow2 overlay | qsd |",
        "**qcow2 overlay**: bench-overlay.qcow2: a fresh, empty overlay",
        "### qcow2 images after the runs",
    ] {
        assert!(md.contains(needle), "no '{needle}' in:\n{md}");
    }
    for made in ["bench.img", "bench.qcow2", "bench-overlay.qcow2"] {
        assert!(!out.join(made).exists(), "{made} is removed");
    }
}

/// --setup: a command against the daemon's control API runs before the
/// measured window (a QoS limit set that way caps what is measured), and a
/// command the daemon refuses fails its row with the daemon's answer.
#[test]
fn compare_setup_acts_on_the_daemon_before_measuring() {
    let dir = test_dir();
    let out = dir.path().join("cmp");
    let o = ringblk_bench(&[
        "--compare",
        "--quick",
        "--no-pin",
        "--image-size",
        "16M",
        "--iodepth",
        "8",
        "--backends",
        "ringblk",
        "--variant",
        "capped:",
        "--variant",
        "refused:",
        "--setup",
        "capped:ctl --api {api} qos --iops 200",
        // Shrinking without --force: the daemon says no.
        "--setup",
        "refused:ctl --api {api} resize 1M",
        "--out",
        out.to_str().expect("UTF-8 path"),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "the refused row fails the run: {stderr}"
    );
    let records = records(&out);
    let iops = |name: &str| {
        let r = records
            .iter()
            .find(|r| r["backend"] == name)
            .unwrap_or_else(|| panic!("no {name} record: {stderr}"));
        r["result"]["iops"]
            .as_f64()
            .unwrap_or_else(|| panic!("{name} has no result: {r}"))
    };
    let (free, capped) = (iops("ringblk"), iops("capped"));
    assert!(capped <= 300.0, "capped at 200 IOPS, measured {capped}");
    assert!(free > 3.0 * capped, "ringblk {free}, capped {capped}");
    let refused = records
        .iter()
        .find(|r| r["backend"] == "refused")
        .expect("a refused record");
    let err = refused["error"].as_str().unwrap_or_default();
    assert!(
        err.contains("setup `ringblk ctl --api")
            && err.contains("shrinking from 16777216 to 1048576 bytes"),
        "{refused}"
    );
    let md = std::fs::read_to_string(out.join("results.md")).expect("results.md");
    assert!(
        md.contains("`capped`: `ringblk ctl --api {api} qos --iops 200` once the daemon is up"),
        "{md}"
    );
}
