//! A host block device as the image: a loop device over a sparse file, so
//! that what the daemon does to the device shows in the file behind it.
//! Discard must really discard (the loop driver punches a hole in its
//! file), through io_uring's discard command and through the BLKDISCARD
//! ioctl that kernels before 6.12 need, under the seccomp filter. Needs root
//! and losetup; skipped otherwise, except where `CI` is set: there they
//! fail.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use ringblk_testkit::{
    Client, Daemon, DaemonOptions, LoopDevice, MIB, allocated_blocks, assert_pattern, is_root,
    pattern, read_file, skip, sparse_image, test_dir,
};

const SIZE: u64 = 32 * MIB;
const CHUNK: usize = MIB as usize;

fn zeroes(got: &[u8], what: &str) {
    if let Some(i) = got.iter().position(|b| *b != 0) {
        panic!("{what}: byte {i} is {:#04x}, not zero", got[i]);
    }
}

/// A loop device with `sector_size`-byte logical blocks over a sparse
/// file in a fresh directory; None (the test skips) without root or
/// losetup, except where `CI` is set: CI runs as root, and a test that
/// cannot run there fails.
fn loop_device(sector_size: u32) -> Option<(tempfile::TempDir, PathBuf, LoopDevice)> {
    if !is_root() {
        skip("loop devices need root");
        return None;
    }
    let dir = test_dir();
    let backing = sparse_image(dir.path(), "backing.img", SIZE);
    match LoopDevice::attach(&backing, sector_size) {
        Ok(dev) => Some((dir, backing, dev)),
        Err(why) => {
            skip(&format!("no loop device: {why}"));
            None
        }
    }
}

/// Serves a loop device with `args`; writes, discards and zeroes through a
/// blkio client, and checks each on the loop device's backing file.
fn serve_loop_device(sector_size: u32, args: &[&str]) {
    let Some((dir, backing, dev)) = loop_device(sector_size) else {
        return;
    };
    let mut d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            image: Some(dev.0.clone()),
            args,
            ..DaemonOptions::default()
        },
    );
    d.wait_for_log("seccomp filter");
    let mut c = Client::connect(&d.socket, CHUNK);
    assert_eq!(c.capacity, SIZE, "capacity from BLKGETSIZE64");
    assert_eq!(
        c.request_alignment, sector_size as i32,
        "blk_size: the device's logical block size"
    );

    let (a, b, z) = (4 * MIB, 8 * MIB, 12 * MIB);
    for (seed, off) in [(1, a), (2, b), (3, z), (4, SIZE - MIB)] {
        assert_eq!(
            c.write(off, &pattern(seed, off, CHUNK)),
            0,
            "write at {off}"
        );
    }
    assert_eq!(c.flush(), 0, "flush");
    assert_pattern("read back", 4, SIZE - MIB, &c.read(SIZE - MIB, CHUNK));
    assert_pattern("backing file", 1, a, &read_file(&backing, a, CHUNK));
    let written = allocated_blocks(&backing);
    assert!(written >= 4 * MIB / 512, "{written} blocks after 4 MiB");

    // Discard: the loop driver punches a hole in its file. A discard that
    // is acknowledged but not done (the fallocate mode a block device
    // turns into zeroing, or refuses) leaves the blocks allocated.
    assert_eq!(c.discard(a, MIB), 0, "discard");
    zeroes(&c.read(a, CHUNK), "read after discard");
    let discarded = allocated_blocks(&backing);
    assert!(
        discarded + MIB / 512 <= written,
        "discard of 1 MiB freed too little of the backing file: {written} -> {discarded} blocks"
    );

    // Write-zeroes that may unmap, then plain zero-range through BLKZEROOUT
    // semantics: zeroes either way, on the device and in its file.
    assert_eq!(c.write_zeroes(b, MIB), 0, "write-zeroes");
    zeroes(&c.read(b, CHUNK), "read after write-zeroes");
    zeroes(
        &read_file(&backing, b, CHUNK),
        "backing file after write-zeroes",
    );
    assert_pattern("untouched neighbour", 3, z, &c.read(z, CHUNK));

    // Past the end of the device: an error, and the daemon goes on.
    assert_ne!(c.discard(SIZE, MIB), 0, "discard past the end");
    assert_eq!(c.flush(), 0, "flush after the error");
    drop(c);
    d.assert_running();
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert_eq!(st.code(), Some(0), "exit after SIGTERM: {st}\n{}", d.log());
}

#[test]
fn block_device_discard_through_io_uring() {
    serve_loop_device(512, &[]);
}

#[test]
fn block_device_discard_through_the_ioctl() {
    serve_loop_device(512, &["--no-uring-cmd"]);
}

#[test]
fn block_device_with_direct_io() {
    serve_loop_device(512, &["--direct"]);
}

/// A 4Kn device: the guest is told 4096-byte blocks, so its I/O meets
/// O_DIRECT's alignment on the device.
#[test]
fn block_device_with_4k_sectors() {
    serve_loop_device(4096, &["--direct"]);
}

/// Asking for smaller blocks than O_DIRECT can do on the device is a
/// one-line error at start-up, not an IOERR on every guest request.
#[test]
fn block_size_below_the_device_sector_is_refused_with_direct() {
    let Some((dir, _backing, dev)) = loop_device(4096) else {
        return;
    };
    let out = Command::new(ringblk_testkit::ringblk_bin())
        .arg("serve")
        .arg("--socket")
        .arg(dir.path().join("vhost.sock"))
        .arg("--image")
        .arg(&dev.0)
        .args(["--direct", "--block-size", "512"])
        .output()
        .expect("running ringblk");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("--block-size 512 is smaller than the 4096-byte blocks"),
        "{err}"
    );
}
