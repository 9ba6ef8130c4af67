//! A real guest on an encrypted disk (`serve --format luks`), in one boot
//! (`init.sh`, `ringblk.test=luks`). The image is a LUKS2 file made by
//! `cryptsetup luksFormat` (PBKDF2, 512-byte sectors); the host's pattern
//! is written into it encrypted by Python's `cryptography`, not by
//! ringblk, so the guest's first check reads what another implementation
//! encrypted.
//!
//! - fio write+verify in 4 KiB random writes while the host kills the
//!   daemon (SIGKILL, with requests in flight) up to three times (at least
//!   once while fio runs) and restarts it; QEMU reconnects (`reconnect=1`);
//! - mkfs.ext4, fio write+verify of a file, e2fsck -f -n in the guest,
//!   and the SHA-256 of the whole disk as the guest reads it.
//!
//! Afterwards, the daemon stopped, two oracles decrypt the image without
//! ringblk and must both give what the guest read: cryptsetup's volume
//! key (`luksDump --dump-volume-key`) with Python's AES-XTS, and QEMU's
//! luks driver (`qemu-img convert --object secret`), which reads LUKS1
//! only, so the header is first converted in place by `cryptsetup convert
//! --type luks1` (the data and the volume key stay). e2fsck on the host
//! then finds the file system clean.

use std::fs::File;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use ringblk_testkit::MIB;
use ringblk_testkit::luks::{self, cryptsetup, dump, independent_encrypt, independent_plaintext};
use ringblk_testkit::qemu_img::sha256;
use ringblk_testkit::vm::{
    self, BOOT_CHECKS, Backend, DaemonSpec, Guard, HOST_PATTERN_AT, QemuSpec, backend,
    console_info, daemon_command, guest_timeout, kill_under_guest, new_nonce, parse_console,
    pattern, qemu_command, read_log, resubmitted_in, run_problems, verbose, wait_for_console,
    wait_for_socket,
};

/// The disk the guest sees: the fio region and a file system.
const DISK: u64 = 128 * MIB;
/// The fio region under the kills, from 0: as large as the qcow2 guest
/// test's, so that the kills land while fio writes (with 32 MiB a quiet
/// machine's guest finished after one).
const FIO_MB: u64 = 96;
/// Kills tried while fio runs; at least one must land under its I/O (a
/// fast guest may finish before the last).
const KILLS: u32 = 3;
const CHECKS: &[&str] = &["fio-kills", "mkfs", "fs-fio", "e2fsck"];

fn e2fsck_clean(raw: &Path, what: &str) {
    let out = Command::new("e2fsck")
        .args(["-f", "-n"])
        .arg(raw)
        .output()
        .expect("e2fsck");
    assert!(
        out.status.success(),
        "e2fsck -f -n of {what}: {:?}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_guest_on_a_luks2_disk_survives_kills_and_the_oracles_agree() {
    let Some(assets) = vm::assets_or_skip() else {
        return;
    };
    if backend() == Backend::Qsd {
        eprintln!("not with qemu-storage-daemon: its luks driver reads no LUKS2");
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("ringblk-luks-")
        .tempdir()
        .expect("temporary directory");
    let dir = tmp.path();
    // LUKS2 puts the data at 16 MiB; the segment is dynamic (the file's
    // size less the offset), which is checked below.
    let image = luks::format(
        dir,
        "disk.luks",
        16 * MIB + DISK,
        &[
            "--type",
            "luks2",
            "--sector-size",
            "512",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ],
    );
    let (_, offset) = dump(dir, &image);
    File::options()
        .write(true)
        .open(&image)
        .and_then(|f| f.set_len(offset + DISK))
        .expect("size the image");
    let nonce = new_nonce();
    let host_pattern = pattern(&nonce);
    independent_encrypt(dir, &image, 512, HOST_PATTERN_AT, &host_pattern);
    let key = luks::key_file(dir, luks::PASS);

    let socket = dir.join("vhost.sock");
    let daemon_log = dir.join("daemon.log");
    let console = dir.join("console.log");
    let qemu_log = dir.join("qemu.log");
    let _one = vm::one_guest();

    // O_DIRECT keeps requests in flight long enough for the kills to
    // catch some.
    let extra: Vec<String> = [
        "--format",
        "luks",
        "--key-file",
        key.to_str().unwrap(),
        "--direct",
    ]
    .map(String::from)
    .to_vec();
    let spec = DaemonSpec {
        socket: &socket,
        image: &image,
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
        "console=ttyS0 quiet panic=-1 ringblk.test=luks ringblk.sectors={} \
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

    // ---- Kills under fio ----
    let mut kills = 0;
    if wait_for_console(&console, "RINGBLK-PASS host-pattern", deadline) {
        kills = kill_under_guest(&mut daemon, &socket, &console, " fio-kills", KILLS, || {
            start_daemon().0
        });
    }
    if kills == 0 {
        problems.push(format!(
            "none of {KILLS} kills happened before the guest's fio finished"
        ));
    }
    let resubmitted = resubmitted_in(&read_log(&daemon_log));
    if resubmitted == 0 {
        problems.push("no kill caught a request in flight: recovery was not exercised".into());
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
    let guest_sum = console_info(&console_text, "disk-sha256").map(str::to_string);
    if guest_sum.is_none() {
        problems.push("the guest reported no disk-sha256".into());
    }
    drop(qemu);
    daemon.signal(libc::SIGTERM);
    match daemon.wait_for(Duration::from_secs(20)) {
        Some(s) if s.success() => {}
        other => problems.push(format!("the daemon after SIGTERM: {other:?}")),
    }
    if read_log(&daemon_log).contains("panicked") {
        problems.push("the daemon panicked".into());
    }
    eprintln!(
        "luks guest ran {:.1?}: {} passed, {} failed; {kills} kill(s), {resubmitted} request(s) \
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
    let guest_sum = guest_sum.unwrap();

    // ---- Oracle 1: cryptsetup's volume key, Python's AES-XTS ----
    let py_raw = dir.join("python.raw");
    std::fs::write(&py_raw, independent_plaintext(dir, &image, 512, DISK)).unwrap();
    assert_eq!(
        sha256(&py_raw),
        guest_sum,
        "Python's decryption with cryptsetup's volume key differs from what the guest read"
    );
    e2fsck_clean(&py_raw, "the Python decryption");

    // ---- Oracle 2: QEMU's luks driver, on the header made LUKS1 ----
    cryptsetup(&[
        "convert",
        "--batch-mode",
        "--type",
        "luks1",
        image.to_str().unwrap(),
    ]);
    let (object, opts) = luks::qemu_luks_opts(dir, &image);
    let qemu_raw = dir.join("qemu.raw");
    ringblk_testkit::qemu_img::qemu_img(&[
        "convert",
        "--object",
        &object,
        "--image-opts",
        &opts,
        "-O",
        "raw",
        qemu_raw.to_str().unwrap(),
    ]);
    assert_eq!(
        sha256(&qemu_raw),
        guest_sum,
        "qemu-img's decryption differs from what the guest read"
    );
    e2fsck_clean(&qemu_raw, "qemu-img's decryption");
}
