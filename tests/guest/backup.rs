//! A point-in-time backup of a running guest's disk (issue 23), in one
//! boot (QEMU TCG, `tests/guest/init.sh` in its `backup` mode):
//! - the guest writes pattern A over its first 32 MiB and says so; the
//!   host notes the disk (the image file, with the guest idle), runs
//!   `ctl backup start --bitmap inc`, starts `nbdcopy` of the export and
//!   lets the guest go on (an NMI);
//! - the guest overwrites the region with pattern B (fio random writes,
//!   verified), then writes three ranges elsewhere, and says so;
//! - the host asserts: the nbdcopy copy and a `qemu-img convert` made after
//!   the guest's overwrites both equal the disk at `backup start`, byte for
//!   byte; the export's `qemu:dirty-bitmap:inc` was A's region and nothing
//!   else; then, at a second `backup start`, `nbdinfo --map` lists exactly
//!   the granules the guest wrote since the first, and the full backup with
//!   the incremental on top, restored with qemu-img, equals the disk at the
//!   second start;
//! - `ringblk backup` at both instants too, into a directory of its own
//!   (a full backup, then an incremental one): each point, restored with
//!   `ringblk backup restore`, equals the disk at its instant;
//! - the guest's fio verify saw no error, and the daemon stops cleanly.
//!
//! Shares the guest machinery, its lock and its environment variables
//! with the other guest tests (the kit's `vm`); skips only where QEMU
//! cannot run at all, never where `CI` is set.

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ringblk_testkit::ctl_ok;
use ringblk_testkit::nbd::{self, backup_start, dirty, granules};
use ringblk_testkit::vm;
use ringblk_testkit::vm::qmp::Qmp;
use ringblk_testkit::vm::{
    BOOT_CHECKS, Backend, DaemonSpec, Guard, IMAGE_SIZE, MIB, QemuSpec, daemon_command,
    guest_timeout, new_nonce, parse_console, qemu_command, read_log, run_problems, verbose,
    wait_for_socket, write_host_pattern,
};

/// The guest's checks after `vm::BOOT_CHECKS` (names printed by `init.sh`).
const CHECKS: &[&str] = &["fio-a", "backup-go", "fio-b", "incr-writes", "incr-go"];
/// init.sh's region for A and B (its default `ringblk.fio_mb`).
const FIO: u64 = 32 * MIB;
const GRAN: u64 = 64 * 1024;
/// What init.sh writes after B (its `incr-*` steps).
const AFTER: &[(u64, u64)] = &[
    (40 * MIB + 4096, 4096),
    (44 * MIB - 8192, 16384),
    (50 * MIB, MIB),
];

/// Waits for `marker` alone on a line of the console.
fn wait_for_marker(marker: &str, console: &Path, qemu: &mut Guard, started: Instant) {
    loop {
        let text = read_log(console);
        if text.lines().any(|l| l.trim() == marker) {
            return;
        }
        if text.contains("RINGBLK-DONE")
            || qemu.exited().is_some()
            || started.elapsed() > guest_timeout()
        {
            panic!("the guest never printed {marker}:\n==== console ====\n{text}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn first_difference(a: &Path, b: &Path) -> Option<usize> {
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    if x.len() != y.len() {
        return Some(x.len().min(y.len()));
    }
    x.iter().zip(&y).position(|(p, q)| p != q)
}

#[test]
fn a_backup_of_a_running_guest_is_the_instant_and_the_incremental_holds_every_change() {
    let Some(assets) = vm::assets_or_skip() else {
        return;
    };
    if !nbd::have_tools() {
        return;
    }
    let _one = vm::one_guest();
    let tmp = tempfile::Builder::new()
        .prefix("ringblk-backup-")
        .tempdir()
        .expect("temporary directory");
    let dir = tmp.path();
    let (socket, image, api, backups) = (
        dir.join("vhost.sock"),
        dir.join("disk.img"),
        dir.join("api.sock"),
        dir.join("backups"),
    );
    std::fs::create_dir(&backups).unwrap();
    let (daemon_log, qemu_log, console, qmp_sock) = (
        dir.join("daemon.log"),
        dir.join("qemu.log"),
        dir.join("console.log"),
        dir.join("qmp.sock"),
    );
    File::create(&image)
        .and_then(|f| f.set_len(IMAGE_SIZE))
        .expect("create the image");
    let nonce = new_nonce();
    write_host_pattern(&image, &nonce);

    let extra: Vec<String> = [
        "--api",
        api.to_str().unwrap(),
        "--backup-dir",
        backups.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    let (mut cmd, serial) = daemon_command(
        &DaemonSpec {
            socket: &socket,
            image: &image,
            readonly: false,
            queues: 1,
            queues_flag: false,
            extra: &extra,
            dir,
        },
        Backend::Ringblk,
    );
    let mut daemon = Guard::spawn_logged("daemon", &mut cmd, &daemon_log);
    wait_for_socket(&mut daemon, &socket, &daemon_log);
    // Before the guest: it records everything the guest writes.
    ctl_ok(&api, &["bitmap", "add", "inc"]);

    let append = format!(
        "console=ttyS0 quiet panic=-1 ringblk.test=backup ringblk.sectors={} \
         ringblk.serial={serial} ringblk.queues=1 ringblk.nonce={nonce} ringblk.verbose={}",
        IMAGE_SIZE / 512,
        u8::from(verbose()),
    );
    let mut qemu_cmd = qemu_command(&QemuSpec {
        assets,
        memory: "512M",
        vcpus: 1,
        socket: &socket,
        reconnect: false,
        device: "vhost-user-blk-pci,chardev=c0,num-queues=1",
        append: &append,
        console: &console,
    });
    qemu_cmd
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp_sock.display()));
    let mut qemu = Guard::spawn_logged("qemu", &mut qemu_cmd, &qemu_log);
    let started = Instant::now();
    let mut qmp = Qmp::connect("qemu", &qmp_sock, Duration::from_secs(30), || true);
    let mut problems = Vec::new();

    // The full backup.
    wait_for_marker("RINGBLK-BACKUP", &console, &mut qemu, started);
    let at_start = dir.join("at-start.raw");
    std::fs::copy(&image, &at_start).unwrap();
    // `ringblk backup` too, into a directory of its own (its bitmap
    // added by its first run): a full backup now, an incremental one at
    // the second instant.
    let archive = dir.join("archive");
    let first = ringblk_backup(&api, &archive);
    if first["point"]["kind"] != "full" {
        problems.push(format!("the first `ringblk backup`: {first}"));
    }
    let sock = backup_start(&api, &backups, "full.sock", Some("inc"));
    let first_map = dirty(&sock, "inc");
    let copy = dir.join("copy.raw");
    let nbdcopy = Command::new("nbdcopy")
        .arg(nbd::uri(&sock))
        .arg(&copy)
        .stderr(Stdio::piped())
        .spawn()
        .expect("nbdcopy");
    qmp.run("inject-nmi", serde_json::json!({}));
    wait_for_marker("RINGBLK-INCR", &console, &mut qemu, started);
    let out = nbdcopy.wait_with_output().unwrap();
    assert!(out.status.success(), "nbdcopy: {out:?}");
    let full = dir.join("full.qcow2");
    nbd::convert_qcow2(&sock, &full);
    let full_raw = dir.join("full.raw");
    nbd::restore(&full, &full_raw);
    let info = ctl_ok(&api, &["backup", "status"]);
    ctl_ok(&api, &["backup", "stop"]);
    if first_map != granules(&[(0, FIO)], GRAN, IMAGE_SIZE) {
        problems.push(format!("the first export's dirty map: {first_map:?}"));
    }
    if let Some(at) = first_difference(&copy, &at_start) {
        problems.push(format!(
            "the nbdcopy copy differs from the disk at backup start at byte {at}"
        ));
    }
    if let Some(at) = first_difference(&full_raw, &at_start) {
        problems.push(format!(
            "the qemu-img copy (after the guest's overwrites) differs from the disk at backup start at byte {at}"
        ));
    }
    if first_difference(&image, &at_start).is_none() {
        problems.push("the guest's overwrites did not reach the image".into());
    }

    // The incremental one.
    let at_second = dir.join("at-second.raw");
    std::fs::copy(&image, &at_second).unwrap();
    let sock = backup_start(&api, &backups, "inc.sock", Some("inc"));
    let mut written = vec![(0, FIO)];
    written.extend_from_slice(AFTER);
    let want = granules(&written, GRAN, IMAGE_SIZE);
    let top = dir.join("inc.qcow2");
    let got = nbd::incremental(&sock, "inc", &full, &top);
    ctl_ok(&api, &["backup", "stop"]);
    if got != want {
        problems.push(format!(
            "the incremental map: {got:?}, the guest wrote {want:?}"
        ));
    }
    let restored = dir.join("restored.raw");
    nbd::restore(&top, &restored);
    if let Some(at) = first_difference(&restored, &at_second) {
        problems.push(format!(
            "full + incremental differs from the disk at the second backup start at byte {at}"
        ));
    }
    let second = ringblk_backup(&api, &archive);
    if second["point"]["kind"] != "incremental" {
        problems.push(format!("the second `ringblk backup`: {second}"));
    }
    for (n, reference) in [(1, &at_start), (2, &at_second)] {
        let out = dir.join(format!("restored-{n}.raw"));
        let st = Command::new(ringblk_testkit::ringblk_bin())
            .args(["backup", "restore"])
            .arg(&archive)
            .args(["--upto", &n.to_string(), "--to"])
            .arg(&out)
            .status()
            .unwrap();
        if !st.success() {
            problems.push(format!("ringblk backup restore --upto {n}: {st}"));
        } else if let Some(at) = first_difference(&out, reference) {
            problems.push(format!(
                "`ringblk backup` point {n}, restored, differs from the disk at its instant at byte {at}"
            ));
        }
    }
    qmp.run("inject-nmi", serde_json::json!({}));

    let timeout = guest_timeout();
    let status = qemu.wait_for(timeout.saturating_sub(started.elapsed()));
    let text = read_log(&console);
    let verdict = parse_console(&text);
    problems.extend(run_problems(
        "QEMU",
        status,
        timeout,
        &verdict,
        &[BOOT_CHECKS, CHECKS].concat(),
    ));
    daemon.signal(libc::SIGTERM);
    let daemon_status = daemon.wait_for(Duration::from_secs(10));
    if !daemon_status.is_some_and(|s| s.success()) {
        problems.push(format!("the daemon's exit: {daemon_status:?}"));
    }
    eprintln!(
        "backup guest: {:.1?} in all; the full backup's status at its end: {}",
        started.elapsed(),
        info.trim()
    );
    assert!(
        problems.is_empty(),
        "{}\n==== console ====\n{text}\n==== qemu ====\n{}\n==== daemon ====\n{}",
        problems.join("\n"),
        read_log(&qemu_log),
        read_log(&daemon_log)
    );
}

/// `ringblk backup --api API --to DIR --json`, which must succeed: its
/// summary.
fn ringblk_backup(api: &Path, dir: &Path) -> serde_json::Value {
    let out = Command::new(ringblk_testkit::ringblk_bin())
        .arg("backup")
        .arg("--api")
        .arg(api)
        .arg("--to")
        .arg(dir)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ringblk backup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
