//! End-to-end tests: a real Linux guest under QEMU (TCG) uses a disk served
//! by `ringblk serve` over vhost-user. The guest's `/init`
//! (`tests/guest/init.sh`) runs the checks and reports them on the serial
//! console; the host side checks the image file afterwards. What these
//! tests share with the other guest tests, and the environment variables
//! that steer them all, is in the kit's `vm`.
//!
//! One more variable here:
//! `RINGBLK_GUEST_EXTRA="--flag value ..."`: `rw_extra_from_env` boots the
//! read-write guest with these daemon flags (otherwise it does nothing).

use std::fs::{self, File};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use ringblk_testkit::vm;
use ringblk_testkit::vm::{
    Assets, BOOT_CHECKS, Backend, DaemonSpec, Guard, IMAGE_SIZE, QSD, QemuSpec, RW_CHECKS, backend,
    check_guest_pattern, daemon_command, guest_timeout, kill_with_requests_in_flight, new_nonce,
    parse_console, qemu_command, qemu_unusable, read_at, read_log, resubmitted_in, run_problems,
    threads_of, verbose, wait_for_socket, write_host_pattern,
};

/// Checks every read-only boot must pass after `vm::BOOT_CHECKS`.
const RO_CHECKS: &[&str] = &["ro-write", "ro-read"];

/// One guest boot against one daemon configuration.
struct Scenario {
    readonly: bool,
    queues: u16,
    vcpus: u16,
    /// Pass `--queues` to the daemon (otherwise its default, 1, is expected).
    queues_flag: bool,
    /// Extra `ringblk serve` arguments.
    extra: Vec<String>,
    /// Guests booted one after the other against the same daemon.
    boots: u32,
    /// Kill and restart the daemon while the guest does I/O.
    restart: Option<Restart>,
    /// Leave `num-queues` to QEMU, whose default is one queue per vCPU.
    qemu_default_queues: bool,
}

/// How the daemon is restarted under a running guest (QEMU reconnects).
#[derive(Clone, Copy)]
struct Restart {
    /// SIGKILL: a crash; SIGTERM: an upgrade.
    signal: i32,
    times: u32,
}

impl Scenario {
    fn rw(extra: &[&str]) -> Self {
        Scenario {
            readonly: false,
            queues: 2,
            vcpus: 2,
            queues_flag: true,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            boots: 1,
            restart: None,
            qemu_default_queues: false,
        }
    }
}

#[test]
fn rw_two_queues() {
    run(Scenario::rw(&[]));
}

#[test]
fn rw_two_queues_poll() {
    run(Scenario::rw(&["--poll-us", "50"]));
}

#[test]
fn rw_two_queues_signal_late() {
    run(Scenario::rw(&["--signal", "late"]));
}

#[test]
fn rw_one_queue_defaults() {
    run(Scenario {
        queues: 1,
        vcpus: 1,
        queues_flag: false,
        ..Scenario::rw(&[])
    });
}

/// A VM of 8 vCPUs with QEMU's default `num-queues` (one per vCPU, so 8),
/// and the daemon's seccomp filter enforced (its default): the fifth
/// queue's thread once killed the daemon at connect. fio runs a job on
/// every CPU, so every queue must complete requests.
#[test]
fn rw_eight_vcpus_qemu_default_queues() {
    run(Scenario {
        queues: 8,
        vcpus: 8,
        qemu_default_queues: true,
        ..Scenario::rw(&["--seccomp", "enforce"])
    });
}

/// The same VM with its 8 queues on 2 daemon threads (4 queues each,
/// taking turns): fio verify passes and every queue raises interrupts.
#[test]
fn rw_eight_queues_on_two_threads() {
    run(Scenario {
        queues: 8,
        vcpus: 8,
        qemu_default_queues: true,
        ..Scenario::rw(&["--threads", "2", "--seccomp", "enforce"])
    });
}

/// Two guests, one after the other, against one daemon: it must take the
/// second front-end (a VM reboot or a QEMU restart) without a restart.
#[test]
fn rw_reconnect() {
    run(Scenario {
        boots: 2,
        ..Scenario::rw(&[])
    });
}

/// The daemon crashes (SIGKILL) three times while the guest's fio
/// write+verify runs, and is restarted each time; QEMU reconnects, the
/// inflight log brings back what was in flight, and fio sees no error.
#[test]
fn rw_survives_daemon_kills() {
    run(Scenario {
        restart: Some(Restart {
            signal: libc::SIGKILL,
            times: 3,
        }),
        // O_DIRECT keeps requests in flight long enough for some kills to
        // catch them (page-cache I/O completes within the submit call).
        ..Scenario::rw(&["--direct"])
    });
}

/// The same with SIGTERM: an upgrade. The old daemon drains and exits 0.
#[test]
fn rw_survives_daemon_upgrades() {
    run(Scenario {
        restart: Some(Restart {
            signal: libc::SIGTERM,
            times: 3,
        }),
        ..Scenario::rw(&[])
    });
}

#[test]
fn rw_two_queues_fixed_buffers() {
    run(Scenario::rw(&["--fixed-buffers"]));
}

#[test]
fn rw_two_queues_sqpoll() {
    run(Scenario::rw(&["--sqpoll"]));
}

#[test]
fn rw_two_queues_direct() {
    run(Scenario::rw(&["--direct"]));
}

/// A real guest's fio, dd and verification under QoS limits well below
/// what the guest would do unthrottled: throttled requests wait and
/// complete, none fails or comes back wrong, and the guest's own I/O
/// timeouts are not reached.
#[test]
fn rw_two_queues_throttled() {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = tempfile::tempdir().expect("temporary directory");
    let metrics = dir.path().join("metrics.sock");
    let m = metrics.to_str().expect("UTF-8 path");
    // The most requests the daemon had throttled, scraped while the guest
    // runs (the daemon is gone once `run` returns).
    let throttled = std::sync::atomic::AtomicU64::new(0);
    let done = AtomicBool::new(false);
    thread::scope(|s| {
        // Whether `run` returns or panics, the scraper stops: a scope waits
        // for its threads, so a scraper left looping after a failed boot
        // would hang the test instead of failing it.
        struct Stop<'a>(&'a AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                thread::sleep(Duration::from_millis(500));
                let Ok(mut c) = std::os::unix::net::UnixStream::connect(&metrics) else {
                    continue;
                };
                let mut text = String::new();
                let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
                if c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").is_err()
                    || c.read_to_string(&mut text).is_err()
                {
                    continue;
                }
                let n: u64 = text
                    .lines()
                    .filter(|l| l.starts_with("ringblk_throttled_requests_total{"))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                    .sum();
                throttled.fetch_max(n, Ordering::Relaxed);
            }
        });
        let _stop = Stop(&done);
        run(Scenario::rw(&[
            "--iops",
            "1500",
            "--bps",
            "16M",
            "--metrics",
            m,
        ]));
    });
    let n = throttled.load(Ordering::Relaxed);
    eprintln!("requests throttled under the guest: {n}");
    assert!(
        n > 0,
        "the guest's I/O was never throttled: the limits did nothing"
    );
}

/// Any daemon flags, for trying them by hand:
/// `RINGBLK_GUEST_EXTRA="--sqpoll --notify per-request" cargo test --test guest rw_extra_from_env`.
/// Without the variable there is nothing to run.
#[test]
fn rw_extra_from_env() {
    let Ok(extra) = std::env::var("RINGBLK_GUEST_EXTRA") else {
        eprintln!("RINGBLK_GUEST_EXTRA is not set: nothing to try");
        return;
    };
    let extra: Vec<&str> = extra.split_whitespace().collect();
    run(Scenario::rw(&extra));
}

#[test]
fn readonly() {
    run(Scenario {
        readonly: true,
        ..Scenario::rw(&[])
    });
}

// ---------------------------------------------------------------------------

/// The `-device` argument; a daemon `--queue-size` is QEMU's `queue-size`
/// too (QEMU's default of 128 is refused by a daemon with smaller queues).
fn qemu_device(sc: &Scenario) -> String {
    let mut dev = "vhost-user-blk-pci,chardev=c0".to_string();
    if !sc.qemu_default_queues {
        dev.push_str(&format!(",num-queues={}", sc.queues));
    }
    let mut size = None;
    for (i, arg) in sc.extra.iter().enumerate() {
        if arg == "--queue-size" {
            size = sc.extra.get(i + 1).map(String::as_str);
        } else if let Some(value) = arg.strip_prefix("--queue-size=") {
            size = Some(value);
        }
    }
    if let Some(size) = size {
        dev.push_str(&format!(",queue-size={size}"));
    }
    dev
}

/// The files of one scenario's run.
struct Paths {
    socket: PathBuf,
    image: PathBuf,
    daemon_log: PathBuf,
    dir: PathBuf,
}

fn daemon_spec<'a>(sc: &'a Scenario, paths: &'a Paths) -> DaemonSpec<'a> {
    DaemonSpec {
        socket: &paths.socket,
        image: &paths.image,
        readonly: sc.readonly,
        queues: sc.queues,
        queues_flag: sc.queues_flag,
        extra: &sc.extra,
        dir: &paths.dir,
    }
}

fn run(sc: Scenario) {
    let Some(assets) = vm::assets_or_skip() else {
        return;
    };
    let backend = backend();
    if backend == Backend::Qsd
        && let Some(why) = qemu_unusable(QSD)
    {
        panic!("RINGBLK_GUEST_BACKEND=qsd but {why}");
    }
    let _one = vm::one_guest();

    let tmp = tempfile::Builder::new()
        .prefix("ringblk-guest-")
        .tempdir()
        .expect("temporary directory");
    let paths = Paths {
        socket: tmp.path().join("vhost.sock"),
        image: tmp.path().join("disk.img"),
        daemon_log: tmp.path().join("daemon.log"),
        dir: tmp.path().to_path_buf(),
    };
    File::create(&paths.image)
        .and_then(|f| f.set_len(IMAGE_SIZE))
        .expect("create the image");

    let (mut daemon_cmd, serial) = daemon_command(&daemon_spec(&sc, &paths), backend);
    let mut daemon = Guard::spawn_logged("daemon", &mut daemon_cmd, &paths.daemon_log);
    wait_for_socket(&mut daemon, &paths.socket, &paths.daemon_log);
    let daemon = Mutex::new(daemon);

    let which = match backend {
        Backend::Ringblk => format!("ringblk serve {}", sc.extra.join(" ")),
        Backend::Qsd => "qemu-storage-daemon".to_string(),
    };
    let mut problems = Vec::new();
    let mut consoles = String::new();
    for n in 1..=sc.boots {
        let pid = daemon.lock().unwrap_or_else(|e| e.into_inner()).child.id();
        let (report, restarts) = thread::scope(|s| {
            let restarter = sc.restart.map(|r| {
                let (sc, paths, daemon) = (&sc, &paths, &daemon);
                s.spawn(move || restart_daemon(r, sc, backend, paths, daemon, n))
            });
            let report = boot(&sc, assets, &paths, serial, n, pid);
            (
                report,
                restarter.map(|t| t.join().expect("restarter thread")),
            )
        });
        let mut report = report;
        if let (Some(r), Some(done)) = (sc.restart, restarts) {
            let resubmitted = resubmitted_in(&read_log(&paths.daemon_log));
            eprintln!(
                "the daemon was restarted {done} time(s) under the guest; \
                 requests resubmitted after a restart: {resubmitted}"
            );
            if done < r.times {
                report.problems.push(format!(
                    "only {done} of {} daemon restarts happened before the guest finished",
                    r.times
                ));
            }
            // A crash under fio at iodepth 16 leaves requests in flight,
            // which the next daemon must redo; an upgrade drains them first.
            if r.signal == libc::SIGKILL && resubmitted == 0 {
                report
                    .problems
                    .push("no kill caught a request in flight: recovery was not exercised".into());
            }
            if r.signal == libc::SIGTERM && resubmitted != 0 {
                report.problems.push(format!(
                    "{resubmitted} request(s) resubmitted after SIGTERM, which must drain them"
                ));
            }
        }
        eprintln!(
            "guest boot {n}/{} ({}, {} queue(s), {} vCPU(s), {which}) ran {:.1?}: {} passed, {} failed",
            sc.boots,
            if sc.readonly { "ro" } else { "rw" },
            sc.queues,
            sc.vcpus,
            report.elapsed,
            report.passed,
            report.failed
        );
        if verbose() {
            eprintln!("==== guest console, boot {n} ====\n{}", report.console);
        }
        let failed = !report.problems.is_empty();
        problems.extend(
            report
                .problems
                .into_iter()
                .map(|p| format!("boot {n}: {p}")),
        );
        consoles.push_str(&format!(
            "==== guest console, boot {n} ====\n{}\n==== qemu output, boot {n} ====\n{}\n",
            report.console, report.qemu_output
        ));
        if failed {
            break;
        }
        let exited = daemon
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .child
            .try_wait();
        if let Ok(Some(status)) = exited {
            problems.push(format!("the daemon exited after boot {n}: {status}"));
            break;
        }
    }

    // The front-end is gone: give the daemon a moment in case it exits.
    let mut daemon = daemon.into_inner().unwrap_or_else(|e| e.into_inner());
    let daemon_status = daemon.wait_for(Duration::from_secs(1));
    drop(daemon);
    if let Some(status) = daemon_status
        && (status.signal().is_some() || status.code() == Some(101))
    {
        problems.push(format!("the daemon died: {status}"));
    }
    if !problems.is_empty() {
        panic!(
            "{} problem(s) with {which}:\n  {}\n{consoles}\
             ==== daemon output (exit: {daemon_status:?}) ====\n{}",
            problems.len(),
            problems.join("\n  "),
            read_log(&paths.daemon_log),
        );
    }
}

/// Once the guest's I/O checks have begun (the host pattern was read),
/// stops the daemon with `r.signal` every 2.5 s and starts a new one on the
/// same socket and image, `r.times` times or until the guest is done.
/// Returns how many restarts happened.
fn restart_daemon(
    r: Restart,
    sc: &Scenario,
    backend: Backend,
    paths: &Paths,
    daemon: &Mutex<Guard>,
    boot: u32,
) -> u32 {
    let console = paths.dir.join(format!("console-{boot}.log"));
    let deadline = Instant::now() + guest_timeout();
    let guest_says = |what: &str| read_log(&console).contains(what);
    while !guest_says("RINGBLK-PASS host-pattern") {
        if guest_says("RINGBLK-DONE") || Instant::now() > deadline {
            return 0;
        }
        thread::sleep(Duration::from_millis(100));
    }
    for done in 0..r.times {
        // Long enough for QEMU (which retries once a second) to reconnect
        // and the guest to do I/O against each new daemon.
        thread::sleep(Duration::from_millis(2500));
        if guest_says("RINGBLK-DONE") {
            return done;
        }
        let mut d = daemon.lock().unwrap_or_else(|e| e.into_inner());
        if r.signal == libc::SIGKILL {
            kill_with_requests_in_flight(
                d.child.id() as i32,
                &paths.socket,
                Duration::from_secs(2),
            );
        } else {
            d.signal(r.signal);
        }
        let status = d.wait_for(Duration::from_secs(20));
        if r.signal == libc::SIGTERM && !status.is_some_and(|s| s.success()) {
            panic!(
                "the daemon did not exit 0 on SIGTERM: {status:?}\n{}",
                read_log(&paths.daemon_log)
            );
        }
        let (mut cmd, _) = daemon_command(&daemon_spec(sc, paths), backend);
        *d = Guard::spawn_logged("daemon", &mut cmd, &paths.daemon_log);
        wait_for_socket(&mut d, &paths.socket, &paths.daemon_log);
    }
    r.times
}

/// What one boot showed.
struct BootReport {
    problems: Vec<String>,
    console: String,
    qemu_output: String,
    elapsed: Duration,
    passed: usize,
    failed: usize,
}

/// Boots the guest once against the running daemon and checks the image
/// afterwards. Boot `n` > 1 tests that the daemon takes a new front-end.
fn boot(
    sc: &Scenario,
    assets: &Assets,
    paths: &Paths,
    serial: &str,
    n: u32,
    daemon_pid: u32,
) -> BootReport {
    let console_path = paths.dir.join(format!("console-{n}.log"));
    let qemu_log = paths.dir.join(format!("qemu-{n}.log"));
    let mut problems = Vec::new();

    // A fresh host pattern, so that each boot must read what is there now.
    let nonce = new_nonce();
    let host_pattern = write_host_pattern(&paths.image, &nonce);
    let before = read_at(&paths.image, 0, IMAGE_SIZE as usize);

    let mode = if sc.readonly { "ro" } else { "rw" };
    let append = format!(
        "console=ttyS0 quiet panic=-1 ringblk.test={mode} ringblk.sectors={} \
         ringblk.serial={serial} ringblk.queues={} ringblk.nonce={nonce} ringblk.verbose={} \
         ringblk.fio_loops={}",
        IMAGE_SIZE / 512,
        sc.queues,
        u8::from(verbose()),
        // Restarts need I/O long enough to land in: several passes.
        if sc.restart.is_some() { 6 } else { 1 }
    );
    let timeout = guest_timeout();
    let started = Instant::now();
    // After a disconnect the daemon may need a moment before it accepts
    // again: retry while QEMU fails to connect, for up to 5 s.
    let mut hang_report = String::new();
    let qemu_status = loop {
        // A fresh log for each try.
        File::create(&qemu_log).expect("qemu log");
        let device = qemu_device(sc);
        let mut qemu_cmd = qemu_command(&QemuSpec {
            assets,
            memory: "512M",
            vcpus: sc.vcpus,
            socket: &paths.socket,
            reconnect: sc.restart.is_some(),
            device: &device,
            append: &append,
            console: &console_path,
        });
        let mut qemu = Guard::spawn_logged("qemu", &mut qemu_cmd, &qemu_log);
        let status = qemu.wait_for(timeout);
        if status.is_none() {
            hang_report = format!(
                "==== where the daemon's threads are (pid {daemon_pid}) ====\n{}\
                 ==== where QEMU's threads are ====\n{}",
                threads_of(daemon_pid),
                threads_of(qemu.child.id())
            );
        }
        let refused = status.is_some_and(|s| !s.success())
            && read_log(&qemu_log).contains("Connection refused");
        if refused && n > 1 && started.elapsed() < Duration::from_secs(5) {
            thread::sleep(Duration::from_millis(200));
            continue;
        }
        break status;
    };
    let elapsed = started.elapsed();

    let console = read_log(&console_path);
    let verdict = parse_console(&console);
    let expected = if sc.readonly { RO_CHECKS } else { RW_CHECKS };
    problems.extend(run_problems(
        "QEMU",
        qemu_status,
        timeout,
        &verdict,
        &[BOOT_CHECKS, expected].concat(),
    ));

    // ---- The image, as the host sees it ----
    let len = fs::metadata(&paths.image).map(|m| m.len()).unwrap_or(0);
    if len != IMAGE_SIZE {
        problems.push(format!("the image is {len} bytes, expected {IMAGE_SIZE}"));
    } else if sc.readonly {
        let after = read_at(&paths.image, 0, IMAGE_SIZE as usize);
        if let Some(at) = after.iter().zip(&before).position(|(a, b)| a != b) {
            problems.push(format!(
                "host: a read-only image changed, first at byte {at}"
            ));
        }
    } else if verdict.passed("guest-pattern") {
        problems.extend(check_guest_pattern(&paths.image, &host_pattern));
    }

    BootReport {
        problems,
        console,
        qemu_output: read_log(&qemu_log) + &hang_report,
        elapsed,
        passed: verdict.passed.len(),
        failed: verdict.failed.len(),
    }
}
