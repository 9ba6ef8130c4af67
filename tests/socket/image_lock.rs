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
