//! `ringblk-bench --compare --image rbd:POOL/IMAGE` against a real
//! single-node Ceph cluster (the test kit's `ceph`, started once for this
//! binary): ringblk's RBD engine, qsd's rbd driver and fio's rbd engine
//! each give a row with I/O and no errors. It checks that the comparison
//! works, never how fast anything is.
//!
//! Needs the `ringblk` next to `ringblk-bench` built with `--features rbd`,
//! hence the `rbd` feature of this crate (scripts/test.sh:
//! `--features ringblk/rbd,ringblk-bench/rbd`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ringblk_testkit::{ceph, test_dir};

/// Longest the comparison may take before the test fails.
const TIMEOUT: Duration = Duration::from_secs(180);

#[test]
fn compare_on_rbd_gives_every_backend_a_row() {
    let cluster = ceph::cluster();
    // Without exclusive-lock: ringblk exits without releasing it, and the
    // next backend's first write would wait for the OSD to drop it.
    let image = format!("rbd/bench-{}", std::process::id());
    cluster.rbd(&[
        "create",
        "--size",
        "32M",
        "--image-feature",
        "layering",
        &image,
    ]);
    let dir = test_dir();
    let out = dir.path().join("cmp");
    let spec = format!("rbd:{image}");
    let args = [
        "--compare",
        "--no-pin",
        "--image",
        &spec,
        "--ceph-conf",
        cluster.conf.to_str().expect("UTF-8 path"),
        "--rw",
        "randread,randwrite",
        "--iodepth",
        "4",
        "--runtime",
        "1s",
        "--ramp",
        "200ms",
        "--backends",
        "ringblk,qsd,host",
        "--out",
        out.to_str().expect("UTF-8 path"),
    ];
    let bench = Path::new(env!("CARGO_BIN_EXE_ringblk-bench"));
    let mut child = Command::new(bench)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting ringblk-bench");
    let deadline = Instant::now() + TIMEOUT;
    while child.try_wait().expect("polling ringblk-bench").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("ringblk-bench {args:?} did not finish within {TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = child.wait_with_output().expect("collecting the output");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "bench --compare on RBD failed:\n{stderr}"
    );

    let json = std::fs::read_to_string(out.join("results.json")).expect("results.json");
    let doc: serde_json::Value = serde_json::from_str(&json).expect("results.json parses");
    assert_eq!(doc["meta"]["image"], spec.as_str());
    assert_eq!(doc["meta"]["image_bytes"], 32 << 20);
    let records = doc["records"].as_array().expect("records");
    assert_eq!(records.len(), 2 * 3, "{stderr}");
    for r in records {
        let result = &r["result"];
        assert!(r["error"].is_null(), "{r}");
        assert!(result["iops"].as_f64().is_some_and(|v| v > 0.0), "{r}");
        assert_eq!(result["errors"].as_u64(), Some(0), "{r}");
        assert!(
            result["backend_cpu_per_mio"]
                .as_f64()
                .is_some_and(|v| v > 0.0),
            "{r}"
        );
        if r["backend"] == "ringblk" {
            assert!(result["ratios"]["kicks_per_io"].is_number(), "{r}");
        }
    }
    for rw in ["randread", "randwrite"] {
        for backend in ["ringblk", "qsd", "host"] {
            assert!(
                records
                    .iter()
                    .any(|r| r["backend"] == backend && r["config"]["rw"] == rw),
                "no {backend} {rw} row: {stderr}"
            );
        }
    }
    let md = std::fs::read_to_string(out.join("results.md")).expect("results.md");
    assert!(md.contains(&spec), "{md}");
}
