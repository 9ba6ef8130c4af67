//! QoS limits (`serve --iops`, `--bps`, `--read-*`, `--write-*`) as a
//! front-end sees them: a closed loop of 16 requests through the libblkio
//! client, measured over a window that starts after the burst allowance
//! is spent. The daemon runs under its (enforcing) seccomp filter, so the
//! throttled path's syscalls (timerfd) are covered too.
//!
//! The limits are small next to what a loaded 2-core machine serves
//! unthrottled (tens of thousands of 4 KiB requests a second), so the
//! measured rate is the limit's doing, not the machine's.
//!
//! Limits change at runtime through the control API (`ringblk ctl qos`),
//! while the client runs.

use std::time::Duration;

use ringblk_testkit::{Client, Daemon, DaemonOptions, KIB, MIB, Op, Sustained, metric};

const DEPTH: usize = 16;
/// Long enough for a burst of a tenth of a second to be long gone.
const WARM_UP: Duration = Duration::from_secs(1);
const RUN: Duration = Duration::from_secs(5);
const IMAGE: u64 = 64 * MIB;

fn daemon(args: &[&str]) -> Daemon {
    Daemon::start_with(DaemonOptions {
        size: IMAGE,
        args,
        metrics: true,
        ..DaemonOptions::default()
    })
}

/// `len`-byte requests at QD16 over the whole image, reads or writes.
fn run(c: &mut Client, write: bool, len: usize) -> Sustained {
    let slots = IMAGE / len as u64;
    let s = c.sustain(DEPTH, len, RUN, |n, _| {
        // A stride that visits every slot of the image.
        let offset = (n * 7919 % slots) * len as u64;
        if write {
            Op::Write {
                offset,
                buf_off: 0,
                len,
            }
        } else {
            Op::Read {
                offset,
                buf_off: 0,
                len,
            }
        }
    });
    assert_eq!(s.errors, 0, "requests failed under throttling");
    s
}

/// Requests a second after the warm-up.
fn measured(s: &Sustained) -> f64 {
    let per_half: Vec<String> = (0..10)
        .map(|i| {
            let a = Duration::from_millis(500 * i);
            format!("{:.0}", s.rate(a, a + Duration::from_millis(500)))
        })
        .collect();
    eprintln!("rate by half second: {}", per_half.join(" "));
    s.rate(WARM_UP, RUN)
}

fn assert_near(what: &str, got: f64, want: f64) {
    let off = (got - want) / want;
    eprintln!(
        "{what}: {got:.0} measured, {want:.0} configured ({:+.1}%)",
        off * 100.0
    );
    assert!(
        off.abs() <= 0.10,
        "{what}: {got:.0} is not within 10% of {want:.0}"
    );
}

/// CPU time (user + system) the process has used so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .expect("comm ends with )")
        .1
        .split_whitespace()
        .collect();
    // utime and stime are fields 14 and 15; 3 is the first after comm.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no memory arguments.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

#[test]
fn an_iops_limit_holds_at_qd16_without_spinning() {
    const N: f64 = 2000.0;
    let d = daemon(&["--iops", "2000"]);
    let mut c = Client::connect(&d.socket, DEPTH * 4096);
    let cpu = cpu_time(d.pid());
    let s = run(&mut c, false, 4096);
    let cpu = cpu_time(d.pid()) - cpu;
    assert_near("IOPS (--iops 2000)", measured(&s), N);
    // Sixteen requests wait for tokens all the time; a queue that spun
    // while they do would use a whole core.
    assert!(
        cpu < RUN / 3,
        "the daemon used {cpu:?} of CPU in {RUN:?} at {N} IOPS"
    );
    let m = d.scrape_metrics();
    assert!(metric(&m, "ringblk_throttled_requests_total") > 1000, "{m}");
    let ns = metric(&m, "ringblk_throttled_ns_total");
    assert!(
        ns > 3_000_000_000,
        "throttled for {ns} ns of a {RUN:?} run at 8x the limit"
    );
}

#[test]
fn a_bandwidth_limit_holds_with_64k_requests() {
    let bs = 64 * KIB as usize;
    let d = daemon(&["--bps", "32M"]);
    let mut c = Client::connect(&d.socket, DEPTH * bs);
    let s = run(&mut c, false, bs);
    assert_near(
        "MiB/s (--bps 32M)",
        measured(&s) * bs as f64 / MIB as f64,
        32.0,
    );
    let s = run(&mut c, true, bs);
    assert_near(
        "MiB/s written (--bps 32M)",
        measured(&s) * bs as f64 / MIB as f64,
        32.0,
    );
}

#[test]
fn read_and_write_limits_hold_each_direction() {
    let bs = 64 * KIB as usize;
    let d = daemon(&[
        "--read-iops",
        "1500",
        "--write-iops",
        "600",
        "--write-bps",
        "16M",
    ]);
    let mut c = Client::connect(&d.socket, DEPTH * bs);
    let s = run(&mut c, false, 4096);
    assert_near("read IOPS (--read-iops 1500)", measured(&s), 1500.0);
    let s = run(&mut c, true, 4096);
    assert_near("write IOPS (--write-iops 600)", measured(&s), 600.0);
    // 16 MiB/s of 64 KiB writes is 256 a second: the bandwidth binds.
    let s = run(&mut c, true, bs);
    assert_near(
        "MiB/s written (--write-bps 16M)",
        measured(&s) * bs as f64 / MIB as f64,
        16.0,
    );
    // Reads of 64 KiB have no bandwidth limit: only --read-iops holds them.
    let s = run(&mut c, false, bs);
    assert_near("64 KiB read IOPS (--read-iops 1500)", measured(&s), 1500.0);
}

/// `ringblk ctl qos` doubles an IOPS limit and then a bandwidth limit
/// under load: the rate follows within a second, and no request fails.
#[test]
fn limits_changed_through_the_api_are_followed_within_a_second() {
    let dir = ringblk_testkit::test_dir();
    let api = dir.path().join("api.sock");
    let api_arg = api.to_str().expect("UTF-8 path").to_string();
    let d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            size: IMAGE,
            args: &["--iops", "1000", "--api", &api_arg],
            ..DaemonOptions::default()
        },
    );
    /// When the change is made, from the start of the run.
    const CHANGE_AT: Duration = Duration::from_millis(2500);
    const LONGER: Duration = Duration::from_secs(6);
    let change = |args: &'static [&'static str]| {
        let api = api.clone();
        std::thread::spawn(move || {
            std::thread::sleep(CHANGE_AT);
            let out = std::process::Command::new(ringblk_testkit::ringblk_bin())
                .arg("ctl")
                .arg("--api")
                .arg(&api)
                .arg("qos")
                .args(args)
                .output()
                .expect("runs ringblk ctl");
            assert!(
                out.status.success(),
                "ctl qos {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        })
    };
    let mut c = Client::connect(&d.socket, DEPTH * 64 * KIB as usize);
    let slots = IMAGE / 4096;
    let changer = change(&["--iops", "2000"]);
    let s = c.sustain(DEPTH, 4096, LONGER, |n, _| Op::Read {
        offset: (n * 7919 % slots) * 4096,
        buf_off: 0,
        len: 4096,
    });
    changer.join().expect("the change");
    assert_eq!(s.errors, 0, "requests failed across the change");
    let second = Duration::from_secs(1);
    assert_near(
        "IOPS before (--iops 1000)",
        s.rate(WARM_UP, CHANGE_AT),
        1000.0,
    );
    assert_near(
        "IOPS from a second after `ctl qos --iops 2000`",
        s.rate(CHANGE_AT + second, LONGER),
        2000.0,
    );

    // Bandwidth: 16 MiB/s of 64 KiB reads, doubled.
    let bs = 64 * KIB as usize;
    let changer = change(&["--iops", "0", "--bps", "32M"]);
    std::process::Command::new(ringblk_testkit::ringblk_bin())
        .args([
            "ctl", "--api", &api_arg, "qos", "--iops", "0", "--bps", "16M",
        ])
        .output()
        .expect("runs ringblk ctl");
    let slots = IMAGE / bs as u64;
    let s = c.sustain(DEPTH, bs, LONGER, |n, _| Op::Read {
        offset: (n * 7919 % slots) * bs as u64,
        buf_off: 0,
        len: bs,
    });
    changer.join().expect("the change");
    assert_eq!(s.errors, 0, "requests failed across the change");
    let mibs = |r: f64| r * bs as f64 / MIB as f64;
    assert_near(
        "MiB/s before (--bps 16M)",
        mibs(s.rate(WARM_UP, CHANGE_AT)),
        16.0,
    );
    assert_near(
        "MiB/s from a second after `ctl qos --bps 32M`",
        mibs(s.rate(CHANGE_AT + second, LONGER)),
        32.0,
    );
}

#[test]
fn bad_qos_flags_get_a_one_line_error() {
    let out = std::process::Command::new(ringblk_testkit::ringblk_bin())
        .args(["serve", "--iops", "100", "--iops-max", "50"])
        .output()
        .expect("runs");
    // A usage error (exit status 2) that names the flags, not the JSON.
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("error: --iops-max (50) cannot be lower than --iops (100)\n"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let out = std::process::Command::new(ringblk_testkit::ringblk_bin())
        .args(["serve", "--bps", "lots"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("invalid value 'lots' for '--bps <SIZE>'")
    );
}

/// SIGTERM while requests wait for tokens: the daemon admits them (a stop
/// does not wait behind throttling), completes them, and exits 0 at once;
/// the client sees every request succeed.
#[test]
fn a_stop_does_not_wait_behind_throttling() {
    // All eight are taken off the ring in one pass (--max-batch 0): what a
    // stop leaves on the avail ring is for the next daemon, not answered.
    let mut d = daemon(&["--iops", "1", "--max-batch", "0"]);
    let socket = d.socket.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let client = std::thread::spawn(move || {
        let mut c = Client::connect(&socket, 8 * 4096);
        tx.send(()).expect("main thread waits");
        // One a second: the first goes, the other seven would take 7 s.
        let ops: Vec<Op> = (0..8)
            .map(|i| Op::Read {
                offset: i * 4096,
                buf_off: i as usize * 4096,
                len: 4096,
            })
            .collect();
        c.batch(&ops)
    });
    rx.recv().expect("client connected");
    std::thread::sleep(Duration::from_millis(500));
    let t = std::time::Instant::now();
    let status = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(3));
    assert!(status.success(), "{status:?}\n{}", d.log());
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "stop took {:?}",
        t.elapsed()
    );
    let results = client.join().expect("client thread");
    assert_eq!(results, vec![0; 8], "requests failed or were dropped");
}

/// Discard and write-zeroes count as one write each and draw no bytes; a
/// flush draws nothing (docs/qos.md).
#[test]
fn discards_count_as_writes_without_bytes_and_flushes_are_free() {
    // A bandwidth limit that would hold 64 KiB discards to 16 a second if
    // they drew their range's bytes.
    let d = daemon(&["--write-iops", "800", "--bps", "1M", "--iops", "900"]);
    let mut c = Client::connect(&d.socket, DEPTH * 4096);
    let s = c.sustain(DEPTH, 4096, RUN, |n, _| Op::Discard {
        offset: (n % 1024) * 64 * KIB,
        len: 64 * KIB,
    });
    assert_eq!(s.errors, 0, "discards failed");
    assert_near("discards a second (--write-iops 800)", measured(&s), 800.0);
    let s = c.sustain(DEPTH, 4096, RUN, |n, _| Op::WriteZeroes {
        offset: (n % 1024) * 64 * KIB,
        len: 64 * KIB,
    });
    assert_eq!(s.errors, 0, "write-zeroes failed");
    assert_near(
        "write-zeroes a second (--write-iops 800)",
        measured(&s),
        800.0,
    );
    let s = c.sustain(DEPTH, 4096, Duration::from_secs(2), |_, _| Op::Flush);
    assert_eq!(s.errors, 0, "flushes failed");
    let flushes = s.rate(Duration::ZERO, Duration::from_secs(2));
    assert!(
        flushes > 2.0 * 900.0,
        "{flushes:.0} flushes a second: held by --iops 900"
    );
}

/// Two queues of one device share its limit, about evenly: neither takes
/// the other's tokens for itself.
#[test]
fn queues_share_a_device_limit_fairly() {
    const N: f64 = 2000.0;
    let d = daemon(&["--iops", "2000", "--queues", "2"]);
    let mut c = Client::connect_queues(&d.socket, 2 * DEPTH * 4096, 2);
    let slots = IMAGE / 4096;
    let s = c.sustain_queues(DEPTH, 4096, RUN, |n| (n * 7919 % slots) * 4096);
    let rates: Vec<f64> = s.iter().map(measured).collect();
    assert!(s.iter().all(|s| s.errors == 0), "requests failed");
    assert_near("IOPS of two queues (--iops 2000)", rates.iter().sum(), N);
    for (q, r) in rates.iter().enumerate() {
        assert!(
            *r > 0.35 * N,
            "queue {q} got {r:.0} of {N} IOPS ({rates:?}): not a fair share"
        );
    }
}
