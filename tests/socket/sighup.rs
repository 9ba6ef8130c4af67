//! SIGHUP (a closed terminal, or a `kill -HUP` meant as "reload") stops
//! the daemon the way SIGTERM does: the requests in flight finish, the
//! image is made durable, the sockets are removed, and it exits 0. Its
//! default action used to kill the process on the spot: no drain, no
//! fdatasync, and every socket left behind.

use std::time::Duration;

use ringblk_testkit::{Client, Daemon, DaemonOptions, MIB, Op, assert_pattern, pattern, test_dir};

const CHUNK: usize = 64 * 1024;
const BATCH: usize = 16;

#[test]
fn sighup_drains_syncs_and_removes_the_sockets() {
    let dir = test_dir();
    let api = dir.path().join("api.sock");
    let mut d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            size: 64 * MIB,
            args: &["--api", api.to_str().unwrap()],
            metrics: true,
            ..DaemonOptions::default()
        },
    );
    d.wait_for_log("control API on");
    let seed = 0x4855_5000;
    let base = 3 * MIB;
    // A client stays connected; its writes are acknowledged (no FLUSH:
    // the write-back cache is the daemon's to make durable at the stop).
    let mut c = Client::connect(&d.socket, BATCH * CHUNK);
    let data = pattern(seed, base, BATCH * CHUNK);
    c.buf()[..data.len()].copy_from_slice(&data);
    let writes: Vec<Op> = (0..BATCH)
        .map(|i| Op::Write {
            offset: base + (i * CHUNK) as u64,
            buf_off: i * CHUNK,
            len: CHUNK,
        })
        .collect();
    assert_eq!(c.batch(&writes), vec![0; BATCH], "writes");
    let metrics = d.metrics.clone().expect("--metrics socket");
    let st = d.signal_and_wait(libc::SIGHUP, Duration::from_secs(20));
    let log = d.log();
    assert_eq!(st.code(), Some(0), "exit after SIGHUP: {st}\n{log}");
    assert!(
        log.contains("signal 1: finishing in-flight requests"),
        "{log}"
    );
    drop(c);
    for s in [&d.socket, &api, &metrics] {
        assert!(!s.exists(), "{} left behind\n{log}", s.display());
    }
    // Nor the private directory of the relay's inner socket (TMPDIR).
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("ringblk-"))
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert_pattern(
        "image after SIGHUP",
        seed,
        base,
        &d.read_image(base, BATCH * CHUNK),
    );
}
