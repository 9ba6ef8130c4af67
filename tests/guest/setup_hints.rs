//! The two most common set-up mistakes, made with a real QEMU: the
//! daemon's log (at its default level, INFO) says what to change
//! (`ringblk::vhost::hints`, docs/troubleshooting.md).
//!
//! - guest memory not shared: a memfd backend with share=off (QEMU maps it
//!   privately: every ring starts, the guest's requests never show, and
//!   the guest hangs in silence), and no memory backend at all (the
//!   connection fails with "invalid parameters");
//! - QEMU's num-queues larger than --queues (QEMU hangs up after
//!   GET_QUEUE_NUM, four times, and exits).
//!
//! Before the hints the first logged nothing at all, the second only
//! "failed to handle request: invalid parameters", the third only
//! "front-end connected / disconnected", four times.
//!
//! One QEMU at a time (`vm::one_guest`); each runs only until the line
//! appears.

use std::path::Path;
use std::time::{Duration, Instant};

use ringblk_testkit::vm::{
    Backend, DaemonSpec, Guard, GuestMemory, QemuSpec, assets_or_skip, daemon_command, one_guest,
    qemu_command_with, read_log, wait_for_socket,
};

const SHARE_ON: &str = "QEMU's memory backend needs share=on (e.g. -object memory-backend-memfd,id=mem,size=1G,share=on -numa node,memdev=mem)";

/// Starts a daemon serving `--queues queues` (and `--metrics` in its
/// directory) and a QEMU asking for `num_queues` with guest memory as
/// `memory` says, and waits (up to 90 s) until `done(log, metrics
/// socket)`. Returns the daemon's log.
fn run(
    memory: GuestMemory,
    queues: u16,
    num_queues: u16,
    done: &dyn Fn(&str, &Path) -> bool,
) -> Option<String> {
    let assets = assets_or_skip()?;
    let _one = one_guest();
    let dir = tempfile::Builder::new()
        .prefix("hints-")
        .tempdir_in(ringblk_testkit::tmp_dir())
        .unwrap();
    let socket = dir.path().join("v.sock");
    let metrics = dir.path().join("m.sock");
    let image = dir.path().join("disk.img");
    std::fs::File::create(&image)
        .and_then(|f| f.set_len(64 << 20))
        .unwrap();
    let log = dir.path().join("daemon.log");
    let extra = [
        String::from("--queues"),
        queues.to_string(),
        String::from("--metrics"),
        metrics.display().to_string(),
    ];
    let (mut cmd, _) = daemon_command(
        &DaemonSpec {
            socket: &socket,
            image: &image,
            readonly: false,
            queues,
            queues_flag: false,
            extra: &extra,
            dir: dir.path(),
        },
        Backend::Ringblk,
    );
    // What an operator sees: the default level.
    cmd.env("RUST_LOG", "info");
    let mut daemon = Guard::spawn_logged("ringblk", &mut cmd, &log);
    wait_for_socket(&mut daemon, &socket, &log);
    let device = format!("vhost-user-blk-pci,chardev=c0,num-queues={num_queues}");
    let console = dir.path().join("console.log");
    let mut qemu_cmd = qemu_command_with(
        &QemuSpec {
            assets,
            memory: "256M",
            vcpus: 1,
            socket: &socket,
            reconnect: false,
            device: &device,
            append: "console=ttyS0 panic=-1",
            console: &console,
        },
        memory,
    );
    let qemu = Guard::spawn_logged("qemu", &mut qemu_cmd, &dir.path().join("qemu.log"));
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let text = read_log(&log);
        if done(&text, &metrics) {
            drop(qemu);
            return Some(read_log(&log));
        }
        if let Some(st) = daemon.exited() {
            panic!("the daemon exited ({st}):\n{text}");
        }
        if Instant::now() > deadline {
            panic!(
                "not done within 90 s; the daemon's log:\n{text}\nQEMU's:\n{}",
                read_log(&dir.path().join("qemu.log"))
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// [`run`] until `want` is in the log.
fn hint(memory: GuestMemory, queues: u16, num_queues: u16, want: &str) -> Option<String> {
    run(memory, queues, num_queues, &|log, _| log.contains(want))
}

fn one_line_with(log: &str, want: &str) -> String {
    let line = log
        .lines()
        .find(|l| l.contains(want))
        .unwrap_or_else(|| panic!("{want:?} not in:\n{log}"))
        .to_string();
    assert!(line.contains(" WARN "), "not a warning: {line}");
    line
}

#[test]
fn private_guest_memory_is_named() {
    let Some(log) = hint(GuestMemory::Private, 1, 1, "its avail ring stays at") else {
        return;
    };
    let line = one_line_with(&log, "its avail ring stays at");
    assert!(line.ends_with(SHARE_ON), "{line}");
    assert!(
        line.contains("the front-end's guest memory is not shared with it"),
        "{line}"
    );
}

#[test]
fn no_memory_backend_is_named() {
    let want = "without sharing any guest memory";
    let Some(log) = hint(GuestMemory::Anonymous, 1, 1, want) else {
        return;
    };
    let line = one_line_with(&log, want);
    assert!(line.ends_with(SHARE_ON), "{line}");
}

#[test]
fn more_queues_than_served_are_named() {
    let want = "the front-end hung up right after asking how many queues this daemon serves (1): QEMU does that when its num-queues is larger (by default one per vCPU): pass --queues N with N its num-queues, or num-queues=1 on its -device vhost-user-blk-pci";
    let Some(log) = hint(GuestMemory::Shared, 1, 4, want) else {
        return;
    };
    one_line_with(&log, want);
    // Said once, not once per retry.
    assert_eq!(log.matches("hung up right after").count(), 1, "{log}");
}

/// The control: shared memory and matching queues give neither hint, well
/// after the guest's requests (and so its kicks) have been served.
#[test]
fn a_correct_set_up_gets_no_hint() {
    let served = std::cell::Cell::new(None::<Instant>);
    let done = |_: &str, metrics: &Path| {
        let requests = ringblk_metrics::fetch(metrics.to_str().unwrap())
            .map(|m| m.queues.iter().map(|q| q.total_requests()).sum::<u64>())
            .unwrap_or(0);
        if requests > 0 && served.get().is_none() {
            served.set(Some(Instant::now()));
        }
        // The hints look every 500 ms.
        served
            .get()
            .is_some_and(|t| t.elapsed() > Duration::from_secs(3))
    };
    let Some(log) = run(GuestMemory::Shared, 2, 2, &done) else {
        return;
    };
    assert!(!log.contains("needs share=on"), "{log}");
    assert!(!log.contains("this daemon serves"), "{log}");
    // (Running as root, as the tests do, is warned about: not a hint.)
    assert!(
        !log.lines()
            .any(|l| l.contains(" WARN ") && !l.contains("running as root")),
        "{log}"
    );
    // And the normal path is quiet at INFO: the developer's detail (the
    // inflight region's size, the seccomp filter, the thread layout) is
    // DEBUG. It used to log "inflight tracking: 4224 bytes ..." and
    // "inflight region installed" at every ring start.
    for detail in ["inflight", "seccomp filter", "worker thread(s)"] {
        assert!(!log.contains(detail), "{detail:?} at INFO:\n{log}");
    }
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(" INFO ")).collect();
    assert!(
        lines.len() <= 5,
        "more than what it serves, its endpoints and the connection:\n{log}"
    );
}
