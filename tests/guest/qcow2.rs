//! A real guest on a qcow2 overlay (`serve --format qcow2`) over a raw
//! base the host filled, in one boot (`init.sh`, `ringblk.test=qcow2`):
//!
//! - the guest reads the base's data through the overlay (the host's
//!   pattern, a boot check);
//! - fio write+verify in 4 KiB random writes, most of them allocating,
//!   while the host kills the daemon (SIGKILL, with requests in flight)
//!   three times and restarts it; QEMU reconnects (`reconnect=1`);
//! - mkfs.ext4, then a live snapshot (`ctl snapshot`) and a stream
//!   (`ctl stream`: the base and the old top copied up into the new top,
//!   which then stands alone) while fio write+verifies a file of the file
//!   system; fstrim; e2fsck.
//!
//! Afterwards, the daemon stopped: the base is unchanged, `qemu-img
//! check` finds both the old top (the kills' image) and the new chain free
//! of corruption (leaked clusters are printed), and the old top, converted
//! to raw, holds an ext4 file system that `e2fsck -f -n` finds clean once
//! its journal is replayed (the snapshot is crash-consistent: what a crash
//! at that instant would leave, which a mount would replay). The new top
//! has no backing file, and its file system checks clean; so does a
//! `ringblk backup` of it (taken while the daemon serves it, verified and
//! restored by `ringblk backup verify|restore`).

use std::fs::{self, File};
use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use ringblk_testkit::qemu_img::{check_clean, overlay, qemu_img, sha256};
use ringblk_testkit::vm::{
    self, BOOT_CHECKS, Backend, DaemonSpec, Guard, QemuSpec, backend, daemon_command,
    guest_timeout, kill_under_guest, new_nonce, parse_console, qemu_command, read_log,
    resubmitted_in, run_problems, verbose, wait_for_console, wait_for_socket, write_host_pattern,
};
use ringblk_testkit::{MIB, ringblk_bin};

/// The disk: room for the fio region and a file system after it.
const DISK: u64 = 128 * MIB;
/// The allocating fio region, from 0.
const FIO_MB: u64 = 96;
const KILLS: u32 = 3;
const CHECKS: &[&str] = &["fio-alloc", "mkfs", "fs-fio", "fstrim", "e2fsck"];

fn console_says(console: &Path, what: &str) -> bool {
    read_log(console).contains(what)
}

fn ctl(api: &Path, args: &[&str]) -> std::process::Output {
    Command::new(ringblk_bin())
        .arg("ctl")
        .arg("--api")
        .arg(api)
        .args(args)
        .output()
        .expect("running ringblk ctl")
}

fn run_tool(tool: &str, args: &[&str]) -> std::process::Output {
    Command::new(tool)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{tool}: {e}"))
}

#[test]
fn a_guest_on_a_qcow2_overlay_survives_kills_and_a_live_snapshot() {
    let Some(assets) = vm::assets_or_skip() else {
        return;
    };
    if backend() == Backend::Qsd {
        eprintln!("not with qemu-storage-daemon: this tests ringblk's qcow2, kills and snapshots");
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("ringblk-qcow2-")
        .tempdir()
        .expect("temporary directory");
    let dir = tmp.path();
    let base = dir.join("base.raw");
    File::create(&base)
        .and_then(|f| f.set_len(DISK))
        .expect("create the base");
    let nonce = new_nonce();
    write_host_pattern(&base, &nonce);
    let base_sum = sha256(&base);
    let top = dir.join("top.qcow2");
    overlay(&base, "raw", &top);
    let snaps = dir.join("snaps");
    fs::create_dir(&snaps).unwrap();
    let backups = dir.join("backups");
    fs::create_dir(&backups).unwrap();
    let socket = dir.join("vhost.sock");
    let api = dir.join("api.sock");
    let daemon_log = dir.join("daemon.log");
    let console = dir.join("console.log");
    let qemu_log = dir.join("qemu.log");
    let _one = vm::one_guest();

    // O_DIRECT keeps requests in flight long enough for the kills to
    // catch some.
    let extra: Vec<String> = [
        "--format",
        "qcow2",
        "--direct",
        "--api",
        api.to_str().unwrap(),
        "--snapshot-dir",
        snaps.to_str().unwrap(),
        "--backup-dir",
        backups.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    let spec = DaemonSpec {
        socket: &socket,
        image: &top,
        readonly: false,
        queues: 2,
        queues_flag: true,
        extra: &extra,
        dir,
    };
    let start_daemon = || {
        let (mut cmd, serial) = daemon_command(&spec, Backend::Ringblk);
        let mut d = Guard::spawn_logged("daemon", &mut cmd, &daemon_log);
        wait_for_socket(&mut d, &socket, &daemon_log);
        (d, serial)
    };
    let (mut daemon, serial) = start_daemon();

    let append = format!(
        "console=ttyS0 quiet panic=-1 ringblk.test=qcow2 ringblk.sectors={} \
         ringblk.serial={serial} ringblk.queues=2 ringblk.nonce={nonce} ringblk.fio_mb={FIO_MB} \
         ringblk.step_timeout=120 ringblk.verbose={}",
        DISK / 512,
        u8::from(verbose()),
    );
    let mut qemu_cmd = qemu_command(&QemuSpec {
        assets,
        memory: "512M",
        vcpus: 2,
        socket: &socket,
        reconnect: true,
        device: "vhost-user-blk-pci,chardev=c0,num-queues=2",
        append: &append,
        console: &console,
    });
    let started = Instant::now();
    let timeout = guest_timeout().max(Duration::from_secs(300));
    let deadline = started + timeout;
    let mut qemu = Guard::spawn_logged("qemu", &mut qemu_cmd, &qemu_log);
    let mut problems = Vec::new();

    // ---- Kills under the allocating fio ----
    let mut kills = 0;
    if wait_for_console(&console, "RINGBLK-PASS host-pattern", deadline) {
        kills = kill_under_guest(&mut daemon, &socket, &console, " fio-alloc", KILLS, || {
            start_daemon().0
        });
    }
    if kills < KILLS {
        problems.push(format!(
            "only {kills} of {KILLS} kills happened before the allocating fio finished"
        ));
    }
    let resubmitted = resubmitted_in(&read_log(&daemon_log));
    if resubmitted == 0 {
        problems.push("no kill caught a request in flight: recovery was not exercised".into());
    }

    // ---- The live snapshot under the file system's fio ----
    let mut snapshot_taken = false;
    if wait_for_console(&console, "RINGBLK-SNAPSHOT", deadline) {
        // fio starts right after the marker (and writes for 2-3 s under
        // TCG): let it begin.
        thread::sleep(Duration::from_millis(500));
        let out = Command::new(ringblk_bin())
            .arg("ctl")
            .arg("--api")
            .arg(&api)
            .args(["snapshot", "--overlay", "s1.qcow2"])
            .output()
            .expect("running ringblk ctl");
        if out.status.success() {
            snapshot_taken = true;
            // Then a stream, with the file system's fio still writing:
            // the base and the old top copied up into the new top, which
            // then stands alone.
            let out = ctl(&api, &["stream"]);
            if !out.status.success() {
                problems.push(format!(
                    "ctl stream failed: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        } else {
            problems.push(format!(
                "ctl snapshot failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        if console_says(&console, " fs-fio") {
            problems.push(
                "the file system's fio ended before the snapshot and the stream started".into(),
            );
        }
    } else {
        problems.push("the guest never asked for the snapshot".into());
    }

    let status = qemu.wait_for(deadline.saturating_duration_since(Instant::now()));
    let console_text = read_log(&console);
    let verdict = parse_console(&console_text);
    problems.extend(run_problems(
        "QEMU",
        status,
        timeout,
        &verdict,
        &[BOOT_CHECKS, CHECKS].concat(),
    ));
    drop(qemu);
    // The stream ends (a SIGTERM would cancel it).
    let job_deadline = Instant::now() + Duration::from_secs(120);
    let job = loop {
        let out = ctl(&api, &["job", "status"]);
        let job: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if job["state"] != "running" || Instant::now() > job_deadline {
            break job;
        }
        thread::sleep(Duration::from_millis(50));
    };
    if snapshot_taken && job["state"] != "completed" {
        problems.push(format!("the stream did not complete: {job}"));
    }
    // `ringblk backup` of the disk the guest left (its file system
    // unmounted), restored: e2fsck below finds it clean.
    let archive = dir.join("archive");
    let restored = dir.join("backup-restored.raw");
    let backed_up = ctl_backup(&api, &archive, &restored);
    if let Err(why) = &backed_up {
        problems.push(why.clone());
    }
    daemon.signal(libc::SIGTERM);
    match daemon.wait_for(Duration::from_secs(20)) {
        Some(s) if s.success() => {}
        other => problems.push(format!("the daemon after SIGTERM: {other:?}")),
    }
    if read_log(&daemon_log).contains("panicked") {
        problems.push("the daemon panicked".into());
    }
    eprintln!(
        "qcow2 guest ran {:.1?}: {} passed, {} failed; {kills} kill(s), {resubmitted} request(s) \
         resubmitted after them",
        started.elapsed(),
        verdict.passed.len(),
        verdict.failed.len()
    );
    if verbose() {
        eprintln!("==== guest console ====\n{console_text}");
    }
    if !problems.is_empty() {
        panic!(
            "{} problem(s):\n  {}\n==== guest console ====\n{console_text}\n==== qemu ====\n{}\n\
             ==== daemon ====\n{}",
            problems.len(),
            problems.join("\n  "),
            read_log(&qemu_log),
            read_log(&daemon_log)
        );
    }

    // ---- The images, as qemu-img sees them ----
    assert_eq!(sha256(&base), base_sum, "the base was written");
    assert!(snapshot_taken);
    let old_leaks = check_clean(&top);
    let s1 = snaps.join("s1.qcow2");
    let new_leaks = check_clean(&s1);
    eprintln!(
        "qemu-img check: the old top (3 kills under allocating writes) clean, {old_leaks} \
         leaked cluster(s); the new top clean, {new_leaks} leaked cluster(s)"
    );
    // The stream left the new top standing alone, and it holds a clean
    // file system (the guest unmounted it after its own e2fsck).
    let info = qemu_img(&["info", "--output=json", s1.to_str().unwrap()]);
    assert!(
        !info.contains("backing-filename"),
        "the new top still has a backing file after the stream: {info}"
    );
    let streamed = dir.join("streamed.raw");
    qemu_img(&[
        "convert",
        "-O",
        "raw",
        s1.to_str().unwrap(),
        streamed.to_str().unwrap(),
    ]);
    let fsck = run_tool("e2fsck", &["-f", "-n", restored.to_str().unwrap()]);
    assert!(
        fsck.status.success(),
        "e2fsck -f -n of the `ringblk backup` restored: {:?}\n{}{}",
        fsck.status,
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    let fsck = run_tool("e2fsck", &["-f", "-n", streamed.to_str().unwrap()]);
    assert!(
        fsck.status.success(),
        "e2fsck -f -n of the streamed top: {:?}\n{}{}",
        fsck.status,
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    // The old top as an ext4 file system: what a crash at the snapshot
    // would have left. Its journal is replayed, as a mount would, then
    // e2fsck must find nothing to fix.
    let raw = dir.join("old-top.raw");
    qemu_img(&[
        "convert",
        "-O",
        "raw",
        top.to_str().unwrap(),
        raw.to_str().unwrap(),
    ]);
    let raw = raw.to_str().unwrap();
    let replay = run_tool("e2fsck", &["-E", "journal_only", "-p", raw]);
    assert!(
        matches!(replay.status.code(), Some(0 | 1)),
        "replaying the old top's journal: {:?}\n{}{}",
        replay.status,
        String::from_utf8_lossy(&replay.stdout),
        String::from_utf8_lossy(&replay.stderr)
    );
    let fsck = run_tool("e2fsck", &["-f", "-n", raw]);
    assert!(
        fsck.status.success(),
        "e2fsck -f -n of the old top: {:?}\n{}{}",
        fsck.status,
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
}

/// `ringblk backup --api API --to DIR` (a full backup), then `backup
/// verify` and `backup restore --to RESTORED`.
fn ctl_backup(api: &Path, dir: &Path, restored: &Path) -> Result<(), String> {
    let run = |args: &[&std::ffi::OsStr]| {
        let out = Command::new(ringblk_bin())
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "ringblk {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    };
    run(&[
        "backup".as_ref(),
        "--api".as_ref(),
        api.as_os_str(),
        "--to".as_ref(),
        dir.as_os_str(),
    ])?;
    run(&["backup".as_ref(), "verify".as_ref(), dir.as_os_str()])?;
    run(&[
        "backup".as_ref(),
        "restore".as_ref(),
        dir.as_os_str(),
        "--to".as_ref(),
        restored.as_os_str(),
    ])
}
