//! Online resize seen by a real guest (QEMU TCG, `tests/guest/init.sh`
//! in its `resize` mode): the guest says when it is ready, the host grows
//! the image through the control API (`ringblk ctl --api PATH resize`),
//! the daemon sends CONFIG_CHANGE_MSG on the back-end channel QEMU handed
//! over, and the guest sees the new size in /sys/block/vda/size without a
//! reboot or a rescan, then writes and reads back 1 MiB just past the old
//! end; the host finds that pattern in the image. Shares the guest
//! machinery, its lock and its environment variables with the other guest
//! tests (the kit's `vm`); skips only where QEMU cannot run at all, never
//! where `CI` is set.

use std::fs::File;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use ringblk_testkit::vm;
use ringblk_testkit::vm::{
    BOOT_CHECKS, Backend, DaemonSpec, Guard, IMAGE_SIZE, MIB, QemuSpec, daemon_command,
    guest_timeout, new_nonce, parse_console, qemu_command, read_at, read_log, run_problems,
    verbose, wait_for_socket, write_host_pattern,
};

/// What the host resizes the 64 MiB image to.
const NEW_SIZE: u64 = 128 * MIB;
/// The guest's checks after `vm::BOOT_CHECKS` (names printed by `init.sh`).
const CHECKS: &[&str] = &["resize-seen", "past-old-end"];

fn ctl_resize(api: &Path, size: u64) -> std::process::Output {
    Command::new(ringblk_testkit::ringblk_bin())
        .arg("ctl")
        .arg("--api")
        .arg(api)
        .args(["resize", &size.to_string()])
        .output()
        .expect("running ringblk ctl")
}

#[test]
fn a_running_guest_sees_the_disk_grow() {
    let Some(assets) = vm::assets_or_skip() else {
        return;
    };
    let _one = vm::one_guest();
    let tmp = tempfile::Builder::new()
        .prefix("ringblk-resize-")
        .tempdir()
        .expect("temporary directory");
    let dir = tmp.path();
    let (socket, image, api) = (
        dir.join("vhost.sock"),
        dir.join("disk.img"),
        dir.join("api.sock"),
    );
    let (daemon_log, qemu_log, console) = (
        dir.join("daemon.log"),
        dir.join("qemu.log"),
        dir.join("console.log"),
    );
    File::create(&image)
        .and_then(|f| f.set_len(IMAGE_SIZE))
        .expect("create the image");
    let nonce = new_nonce();
    let pattern = write_host_pattern(&image, &nonce);

    let extra = vec!["--api".to_string(), api.display().to_string()];
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

    let append = format!(
        "console=ttyS0 quiet panic=-1 ringblk.test=resize ringblk.sectors={} \
         ringblk.new_sectors={} ringblk.serial={serial} ringblk.queues=1 \
         ringblk.nonce={nonce} ringblk.verbose={}",
        IMAGE_SIZE / 512,
        NEW_SIZE / 512,
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
    let mut qemu = Guard::spawn_logged("qemu", &mut qemu_cmd, &qemu_log);

    let timeout = guest_timeout();
    let started = Instant::now();
    let mut problems = Vec::new();
    // The guest's go.
    loop {
        let text = read_log(&console);
        if text.lines().any(|l| l.trim() == "RINGBLK-RESIZE") {
            break;
        }
        if text.contains("RINGBLK-DONE") || qemu.exited().is_some() || started.elapsed() > timeout {
            panic!(
                "the guest never asked for the resize:\n==== console ====\n{text}\n\
                 ==== qemu ====\n{}\n==== daemon ====\n{}",
                read_log(&qemu_log),
                read_log(&daemon_log)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let asked = Instant::now();
    let out = ctl_resize(&api, NEW_SIZE);
    let took = asked.elapsed();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        problems.push(format!(
            "ctl resize failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    } else if !said.contains("the front-end was told") {
        problems.push(format!("QEMU was not told: {said}"));
    }
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
    assert_eq!(
        std::fs::metadata(&image).expect("image").len(),
        NEW_SIZE,
        "the image file grew"
    );
    if verdict.passed("past-old-end") && read_at(&image, IMAGE_SIZE, pattern.len()) != pattern {
        problems.push("the image does not hold the guest's pattern at the old end".into());
    }
    daemon.signal(libc::SIGTERM);
    let daemon_status = daemon.wait_for(Duration::from_secs(10));
    if !daemon_status.is_some_and(|s| s.success()) {
        problems.push(format!("the daemon's exit: {daemon_status:?}"));
    }
    eprintln!(
        "resize guest: {:.1?} in all; ctl resize took {took:.1?} (QEMU's ack included) and said: {}",
        started.elapsed(),
        said.trim()
    );
    assert!(
        problems.is_empty(),
        "{}\n==== console ====\n{text}\n==== qemu ====\n{}\n==== daemon ====\n{}",
        problems.join("\n"),
        read_log(&qemu_log),
        read_log(&daemon_log)
    );
}
