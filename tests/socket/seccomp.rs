//! The seccomp filter (`--seccomp`): installed on every thread, and the
//! daemon does all its work under it (two connections with writes, reads,
//! flushes, discards and write-zeroes, then a clean SIGTERM shutdown).
//!
//! What kills the daemon on a syscall outside the list is tested in
//! `daemon::seccomp`'s unit tests (a forked child calls one).

use std::time::Duration;

use ringblk_testkit::{
    Client, Daemon, DaemonOptions, MIB, assert_pattern, chunked, metric, pattern, sparse_image,
    test_dir,
};

const IMAGE_SIZE: u64 = 64 * MIB;
const CHUNK: usize = 256 * 1024;

/// `Seccomp:` of /proc/PID/status: 0 none, 2 filter.
fn seccomp_mode(d: &Daemon, tid: Option<u32>) -> String {
    d.proc_status(tid, "Seccomp")
        .expect("the kernel reports Seccomp in /proc/PID/status")
}

#[test]
fn enforce_filters_every_thread_and_serves_io() {
    let dir = test_dir();
    let image = sparse_image(dir.path(), "disk.img", IMAGE_SIZE);
    let mut d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            image: Some(image),
            args: &["--seccomp", "enforce", "--queues", "2"],
            metrics: true,
            ..DaemonOptions::default()
        },
    );
    d.wait_for_log("seccomp filter installed");

    let seed = 0x5ecc_0000;
    {
        let mut c = Client::connect(&d.socket, 4 * CHUNK);
        // Connection threads now exist: all of them must be filtered.
        let threads = d.threads();
        assert!(threads.len() >= 3, "threads: {threads:?}");
        for t in &threads {
            assert_eq!(
                seccomp_mode(&d, Some(*t)),
                "2",
                "thread {t} is not filtered"
            );
        }

        // 4 MiB written in batches of four 256 KiB requests, then flushed.
        for batch in 0..4u64 {
            let base = batch * 4 * CHUNK as u64;
            let data = pattern(seed, base, 4 * CHUNK);
            c.buf()[..data.len()].copy_from_slice(&data);
            assert_eq!(
                c.batch(&chunked(true, base, 4, CHUNK)),
                vec![0; 4],
                "writes at {base}"
            );
        }
        assert_eq!(c.flush(), 0, "flush");
        for off in (0..4 * MIB).step_by(CHUNK) {
            assert_pattern("read back", seed, off, &c.read(off, CHUNK));
        }
        // Discard and write-zeroes are fallocate on the ring.
        assert_eq!(c.discard(MIB, MIB), 0, "discard");
        assert_eq!(c.write_zeroes(2 * MIB, MIB), 0, "write-zeroes");
        for off in [MIB, 2 * MIB] {
            assert!(
                c.read(off, CHUNK).iter().all(|b| *b == 0),
                "{off} not zero after discard/write-zeroes"
            );
        }
    }
    d.assert_running();
    // The metrics endpoint's thread works under the filter too.
    let writes = metric(
        &d.scrape_metrics(),
        "ringblk_requests_total{queue=\"0\",type=\"write\"}",
    );
    assert_eq!(writes, 16, "writes counted");

    // A second connection builds new rings, eventfds and threads.
    {
        let mut c = Client::connect(&d.socket, CHUNK);
        assert_pattern("second connection", seed, 0, &c.read(0, CHUNK));
        assert_pattern("second connection", seed, 3 * MIB, &c.read(3 * MIB, CHUNK));
        assert_eq!(c.write(3 * MIB, &pattern(seed + 1, 3 * MIB, CHUNK)), 0);
        assert_eq!(c.flush(), 0);
    }
    d.assert_running();

    // Shutdown under the filter: drain, fdatasync, unlink, exit 0.
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert_eq!(st.code(), Some(0), "exit after SIGTERM: {st}\n{}", d.log());
    assert!(!d.socket.exists(), "socket left behind");
    assert!(
        !d.log().contains("not allowed"),
        "a syscall was trapped:\n{}",
        d.log()
    );
}

#[test]
fn modes_log_and_off() {
    for (mode, want) in [("log", "2"), ("off", "0")] {
        let dir = test_dir();
        let image = sparse_image(dir.path(), "disk.img", 8 * MIB);
        let mut d = Daemon::start_in(
            dir.path(),
            DaemonOptions {
                image: Some(image),
                args: &["--seccomp", mode],
                ..DaemonOptions::default()
            },
        );
        d.wait_for_log("seccomp filter");
        assert_eq!(seccomp_mode(&d, None), want, "--seccomp {mode}");
        let mut c = Client::connect(&d.socket, 64 * 1024);
        assert_eq!(c.write(0, &pattern(7, 0, 64 * 1024)), 0);
        assert_pattern(mode, 7, 0, &c.read(0, 64 * 1024));
        drop(c);
        d.assert_running();
    }
}
