//! The image lock: two daemons on one image, as during a live migration
//! (`tests/guest/migration.rs` hands the lock over through QEMU) or by mistake.
//! Whoever runs rings first writes the image; the other's requests fail
//! with EIO, and it keeps serving, until the first one's rings stop.

use std::thread;
use std::time::{Duration, Instant};

use ringblk_testkit::{
    Client, Daemon, DaemonOptions, MIB, assert_pattern, pattern, sparse_image, test_dir,
};

const EIO: i32 = -libc::EIO;
/// How long the first daemon may take to notice its client left.
const RELEASED_WITHIN: Duration = Duration::from_secs(10);

fn daemon_on(image: &std::path::Path, args: &[&str]) -> Daemon {
    Daemon::start_with(DaemonOptions {
        image: Some(image.to_path_buf()),
        args,
        ..DaemonOptions::default()
    })
}

#[test]
fn the_second_daemon_fails_io_until_the_first_releases_the_image() {
    let dir = test_dir();
    let image = sparse_image(dir.path(), "shared.img", 16 * MIB);
    let mut first = daemon_on(&image, &[]);
    let mut second = daemon_on(&image, &[]);

    let mut a = Client::connect(&first.socket, 64 << 10);
    assert_eq!(a.write(0, &pattern(1, 0, 4096)), 0, "first daemon's write");

    let mut b = Client::connect(&second.socket, 64 << 10);
    assert_eq!(
        b.write(4096, &pattern(2, 4096, 4096)),
        EIO,
        "the second daemon wrote an image the first one serves"
    );
    let read = b.batch(&[ringblk_testkit::Op::Read {
        offset: 0,
        buf_off: 0,
        len: 4096,
    }]);
    assert_eq!(
        read,
        [EIO],
        "reads fail too: the writer may change what they see"
    );
    second.wait_for_log("the image is locked by another process");
    // The first daemon is untouched and goes on writing.
    assert_eq!(a.write(8192, &pattern(1, 8192, 4096)), 0);
    assert_eq!(
        first.read_image(4096, 4096),
        vec![0; 4096],
        "the refused write reached the image"
    );

    // The first client leaves: its daemon drains the rings and releases.
    drop(a);
    let deadline = Instant::now() + RELEASED_WITHIN;
    loop {
        let r = b.write(4096, &pattern(2, 4096, 4096));
        if r == 0 {
            break;
        }
        assert_eq!(r, EIO);
        assert!(
            Instant::now() < deadline,
            "the second daemon still cannot write {RELEASED_WITHIN:?} after the first client left"
        );
        thread::sleep(Duration::from_millis(50));
    }
    assert_pattern("second daemon's read", 1, 0, &b.read(0, 4096));
    assert_pattern("second daemon's read", 2, 4096, &b.read(4096, 4096));

    // Now the first daemon is the one kept off, and says so.
    let mut a = Client::connect(&first.socket, 64 << 10);
    assert_eq!(a.write(0, &pattern(3, 0, 4096)), EIO);
    first.assert_running();
    second.assert_running();
}

#[test]
fn read_only_daemons_share_an_image_and_keep_writers_off() {
    let dir = test_dir();
    let image = sparse_image(dir.path(), "shared.img", 16 * MIB);
    std::fs::write(&image, pattern(7, 0, 4096)).expect("seeding the image");
    std::fs::File::options()
        .write(true)
        .open(&image)
        .and_then(|f| f.set_len(16 * MIB))
        .expect("resizing the image");
    let r1 = daemon_on(&image, &["--readonly"]);
    let r2 = daemon_on(&image, &["--readonly"]);
    let w = daemon_on(&image, &[]);
    let mut c1 = Client::connect_read_only(&r1.socket, 4096);
    let mut c2 = Client::connect_read_only(&r2.socket, 4096);
    assert_pattern("first reader", 7, 0, &c1.read(0, 4096));
    assert_pattern("second reader", 7, 0, &c2.read(0, 4096));
    let mut cw = Client::connect(&w.socket, 4096);
    assert_eq!(
        cw.write(0, &pattern(8, 0, 4096)),
        EIO,
        "a writer got in beside readers"
    );
}

#[test]
fn no_image_lock_lets_two_daemons_write() {
    let dir = test_dir();
    let image = sparse_image(dir.path(), "shared.img", 16 * MIB);
    let first = daemon_on(&image, &["--no-image-lock"]);
    let second = daemon_on(&image, &["--no-image-lock"]);
    let mut a = Client::connect(&first.socket, 4096);
    let mut b = Client::connect(&second.socket, 4096);
    assert_eq!(a.write(0, &pattern(1, 0, 4096)), 0);
    assert_eq!(b.write(4096, &pattern(2, 4096, 4096)), 0);
}

#[test]
fn a_killed_daemon_leaves_no_lock_behind() {
    let dir = test_dir();
    let image = sparse_image(dir.path(), "shared.img", 16 * MIB);
    let mut first = daemon_on(&image, &[]);
    let second = daemon_on(&image, &[]);
    let mut a = Client::connect(&first.socket, 4096);
    assert_eq!(a.write(0, &pattern(1, 0, 4096)), 0);
    first.signal_and_wait(libc::SIGKILL, Duration::from_secs(5));
    // The kernel closes a dead process's io_uring, and with it the
    // image's file, a moment after the process is reaped: the second
    // daemon waits for the lock as its ring starts, and no request fails.
    let mut b = Client::connect(&second.socket, 4096);
    assert_eq!(b.write(4096, &pattern(2, 4096, 4096)), 0);
    drop(a);
}

/// Only the daemon that holds the image resizes it. A second daemon on
/// the image (the other side of a live migration, or a mistake) answers
/// `ctl resize` with 409 and leaves the file as it was, raw or qcow2; the
/// holder resizes it. Once the holder's client has left, the second one
/// takes the image and grows it, a qcow2 image from the metadata the
/// first one wrote (read afresh by its hold), and `qemu-img check` finds
/// it clean. On the old code the second daemon grew the file under the
/// first: a qcow2 image from its own stale view of the header and L1
/// table.
#[test]
fn a_daemon_that_does_not_hold_the_image_refuses_to_resize_it() {
    use ringblk_testkit::qemu_img::{check_clean, qemu_img};
    use ringblk_testkit::{ctl, ctl_fails, ctl_ok};

    for format in ["raw", "qcow2"] {
        let dir = test_dir();
        let image = dir.path().join(format!("shared.{format}"));
        qemu_img(&["create", "-q", "-f", format, image.to_str().unwrap(), "16M"]);
        let size = || -> u64 {
            let info = qemu_img(&[
                "info",
                "-U",
                "--output=json",
                "-f",
                format,
                image.to_str().unwrap(),
            ]);
            let info: serde_json::Value = serde_json::from_str(&info).unwrap();
            info["virtual-size"].as_u64().expect("a virtual size")
        };
        let start = |sub: &str| {
            let d = dir.path().join(sub);
            std::fs::create_dir(&d).unwrap();
            let api = d.join("api.sock");
            let daemon = Daemon::start_in(
                &d,
                DaemonOptions {
                    image: Some(image.clone()),
                    args: &["--format", format, "--api", api.to_str().unwrap()],
                    ..DaemonOptions::default()
                },
            );
            (daemon, api)
        };
        let (first, first_api) = start("first");
        let (second, second_api) = start("second");
        let mut a = Client::connect(&first.socket, 4096);
        assert_eq!(a.write(0, &pattern(1, 0, 4096)), 0);

        ctl_fails(
            &second_api,
            &["resize", "32M"],
            "cannot resize: the image is locked by another process",
        );
        assert_eq!(size(), 16 * MIB, "{format}: the second daemon resized it");
        ctl_ok(&first_api, &["resize", "32M"]);
        assert_eq!(size(), 32 * MIB, "{format}: the holder's resize");
        assert_eq!(a.write(24 * MIB, &pattern(3, 24 * MIB, 4096)), 0);
        assert_eq!(a.flush(), 0);

        drop(a);
        let deadline = Instant::now() + RELEASED_WITHIN;
        loop {
            let o = ctl(&second_api, &["resize", "48M"]);
            if o.status.success() {
                break;
            }
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(err.contains("locked by another process"), "{format}: {err}");
            assert!(
                Instant::now() < deadline,
                "{format}: the second daemon still cannot resize {RELEASED_WITHIN:?} after the first client left"
            );
            thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(size(), 48 * MIB, "{format}: the second daemon's resize");
        for mut d in [first, second] {
            let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
            assert!(st.success(), "{format}: the daemon exited with {st}");
        }
        if format == "qcow2" {
            assert_eq!(check_clean(&image), 0);
        }
        // What QEMU reads back.
        let raw = dir.path().join("read.raw");
        qemu_img(&[
            "convert",
            "-f",
            format,
            "-O",
            "raw",
            image.to_str().unwrap(),
            raw.to_str().unwrap(),
        ]);
        let raw = std::fs::File::open(&raw).unwrap();
        let mut got = vec![0u8; 4096];
        let read = |at: u64, buf: &mut [u8]| {
            std::os::unix::fs::FileExt::read_exact_at(&raw, buf, at).unwrap()
        };
        read(0, &mut got);
        assert_pattern(&format!("{format}: first write"), 1, 0, &got);
        read(24 * MIB, &mut got);
        assert_pattern(
            &format!("{format}: write past the old end"),
            3,
            24 * MIB,
            &got,
        );
    }
}
