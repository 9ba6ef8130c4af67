//! A real Linux guest under QEMU (TCG) on a disk that ringblk serves from
//! a Ceph RBD image (`--features rbd`), on the single-node cluster this
//! binary starts itself (the kit's `ceph`). The guest's `/init`
//! (`tests/guest/init.sh`) runs the same read-write checks as in
//! `tests/guest/guest.rs` (fio write+verify, discard, write-zeroes, large I/O,
//! patterns); the host checks the image afterwards through `rbd export`.
//!
//! - `rbd_guest_fio_verify`: one daemon, one boot;
//! - `rbd_guest_survives_daemon_kills`: ringblk is killed (SIGKILL) three
//!   times under fio, with requests in flight, and restarted on the same
//!   image; QEMU reconnects, the inflight log brings back what was in
//!   flight, and fio sees no error.
//!
//! Live migration between two daemons on one RBD image is in
//! `migration.rs`, next to this file.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use ringblk_testkit::ceph;
use ringblk_testkit::vm;
use ringblk_testkit::vm::{
    BOOT_CHECKS, Guard, IMAGE_SIZE, QemuSpec, RW_CHECKS, SERIAL, check_guest_pattern,
    guest_timeout, kill_with_requests_in_flight, new_nonce, parse_console, qemu_command, read_log,
    resubmitted_in, wait_for_socket, write_host_pattern,
};

fn daemon(socket: &Path, spec: &str, conf: &Path, dir: &Path) -> Command {
    let mut c = Command::new(ringblk_testkit::ringblk_bin());
    c.arg("serve")
        .arg("--socket")
        .arg(socket)
        .arg("--image")
        .arg(spec)
        .arg("--ceph-conf")
        .arg(conf)
        .arg("--serial")
        .arg(SERIAL)
        .arg("--queues")
        .arg("2")
        .env("TMPDIR", dir);
    c
}

fn run(kills: u32) {
    let assets = vm::assets_or_skip().expect("QEMU and the guest assets");
    let c = ceph::cluster();
    let _one = vm::one_guest();
    let tmp = tempfile::Builder::new()
        .prefix("ringblk-guest-rbd-")
        .tempdir()
        .expect("temporary directory");
    let dir = tmp.path().to_path_buf();
    let socket = dir.join("vhost.sock");
    let log = dir.join("daemon.log");
    let console = dir.join("console.log");
    let qemu_log = dir.join("qemu.log");

    // The host's pattern goes into a file, which becomes the RBD image.
    let file = dir.join("disk.img");
    File::create(&file)
        .and_then(|f| f.set_len(IMAGE_SIZE))
        .expect("create the image file");
    let nonce = new_nonce();
    let host_pattern = write_host_pattern(&file, &nonce);
    let image = format!("rbd/guest{}-{kills}", std::process::id());
    c.rbd(&[
        "import",
        "--no-progress",
        file.to_str().expect("UTF-8"),
        &image,
    ]);
    let spec = format!("rbd:{image}");

    let mut d = Guard::spawn_logged("daemon", &mut daemon(&socket, &spec, &c.conf, &dir), &log);
    wait_for_socket(&mut d, &socket, &log);
    let d = Mutex::new(d);

    let queues = 2;
    let append = format!(
        "console=ttyS0 quiet panic=-1 ringblk.test=rw ringblk.sectors={} \
         ringblk.serial={SERIAL} ringblk.queues={queues} ringblk.nonce={nonce} ringblk.verbose=0 \
         ringblk.fio_loops={}",
        IMAGE_SIZE / 512,
        if kills > 0 { 6 } else { 1 }
    );
    let device = format!("vhost-user-blk-pci,chardev=c0,num-queues={queues}");
    let started = Instant::now();
    let (status, killed) = thread::scope(|s| {
        let killer = s.spawn(|| {
            let says = |what: &str| read_log(&console).contains(what);
            let deadline = Instant::now() + guest_timeout();
            while kills > 0 && !says("RINGBLK-PASS host-pattern") {
                if says("RINGBLK-DONE") || Instant::now() > deadline {
                    return 0;
                }
                thread::sleep(Duration::from_millis(100));
            }
            for done in 0..kills {
                thread::sleep(Duration::from_millis(2500));
                if says("RINGBLK-DONE") {
                    return done;
                }
                let mut g = d.lock().unwrap_or_else(|e| e.into_inner());
                if let Ok(Some(st)) = g.child.try_wait() {
                    // Reported below ("the daemon exited"), with its log.
                    eprintln!("the daemon exited by itself before kill {}: {st}", done + 1);
                    return done;
                }
                kill_with_requests_in_flight(g.child.id() as i32, &socket, Duration::from_secs(2));
                g.wait_for(Duration::from_secs(20));
                *g =
                    Guard::spawn_logged("daemon", &mut daemon(&socket, &spec, &c.conf, &dir), &log);
                wait_for_socket(&mut g, &socket, &log);
            }
            kills
        });
        File::create(&qemu_log).expect("qemu log");
        let mut qemu = Guard::spawn_logged(
            "qemu",
            &mut qemu_command(&QemuSpec {
                assets,
                memory: "512M",
                vcpus: 2,
                socket: &socket,
                reconnect: kills > 0,
                device: &device,
                append: &append,
                console: &console,
            }),
            &qemu_log,
        );
        let status = qemu.wait_for(guest_timeout());
        (status, killer.join().expect("killer thread"))
    });
    let mut problems = Vec::new();
    match status {
        None => problems.push("QEMU did not finish in time (killed)".to_string()),
        Some(s) if !s.success() => problems.push(format!("QEMU exited with {s}")),
        Some(_) => {}
    }
    let verdict = parse_console(&read_log(&console));
    if !verdict.done {
        problems.push("the guest never printed RINGBLK-DONE".into());
    }
    problems.extend(verdict.problems(&[BOOT_CHECKS, RW_CHECKS].concat()));
    let resubmitted = resubmitted_in(&read_log(&log));
    if kills > 0 {
        if killed < kills {
            problems.push(format!("only {killed} of {kills} kills happened"));
        }
        if resubmitted == 0 {
            problems.push("no kill caught a request in flight".into());
        }
    }
    {
        let mut g = d.lock().unwrap_or_else(|e| e.into_inner());
        if let Ok(Some(st)) = g.child.try_wait() {
            problems.push(format!("the daemon exited: {st}"));
        }
        g.signal(libc::SIGTERM);
        g.wait_for(Duration::from_secs(30));
    }
    // What the guest wrote is in the RBD image.
    if verdict.passed("guest-pattern") {
        let exported: PathBuf = dir.join("export.img");
        c.rbd(&[
            "export",
            "--no-progress",
            &image,
            exported.to_str().expect("UTF-8"),
        ]);
        problems.extend(check_guest_pattern(&exported, &host_pattern));
    }
    eprintln!(
        "RBD guest ({kills} kills, {killed} done, {resubmitted} resubmitted) ran {:.1?}: {} passed, {} failed",
        started.elapsed(),
        verdict.passed.len(),
        verdict.failed.len()
    );
    assert!(
        problems.is_empty(),
        "{} problem(s):\n  {}\n==== console ====\n{}\n==== qemu ====\n{}\n==== daemon ====\n{}",
        problems.len(),
        problems.join("\n  "),
        read_log(&console),
        read_log(&qemu_log),
        read_log(&log)
    );
}

#[test]
fn rbd_guest_fio_verify() {
    run(0);
}

#[test]
fn rbd_guest_survives_daemon_kills() {
    run(3);
}
