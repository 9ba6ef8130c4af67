//! The backup's parts on their own (issue 23, phase 1): the NBD server
//! serving the copy-before-write view, checked by clients no one here
//! wrote (libnbd's nbdinfo and nbdcopy, qemu-img); hostile NBD clients;
//! and the persistence of dirty bitmaps across a kill -9 and a host stop.
//!
//! The tools come from scripts/nbd-tools.sh (scripts/test.sh runs it; so
//! does this test when they are missing and it may). Without them a test
//! skips, except where `CI` is set: there it fails.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use ringblk::backup::{CbwStore, DEFAULT_CLUSTER, FileImage, Image, View};
use ringblk::bitmap::{BitmapStore, DirtyBitmap, SidecarStore};
use ringblk::nbd::{self, Limits, Server};
use ringblk_testkit::nbd::raw::{closed, go, greet, option, option_reply, request, simple_reply};
use ringblk_testkit::nbd::{have_tools, map, run, uri};
use ringblk_testkit::{KIB, MIB};

fn test_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("ringblk-backup-")
        .tempdir_in(ringblk_testkit::tmp_dir())
        .unwrap()
}

/// Every 8-byte word holds its offset xor `seed`.
fn pattern(seed: u64, off: u64, len: usize) -> Vec<u8> {
    (0..len as u64 / 8)
        .flat_map(|i| ((off + i * 8) ^ seed).to_le_bytes())
        .collect()
}

/// An image with data, a hole, then data; a view of it; a bitmap with
/// marks; the server.
struct Fixture {
    dir: tempfile::TempDir,
    image: PathBuf,
    sock: PathBuf,
    store: Arc<CbwStore>,
    server: Option<Server>,
}

const SIZE: u64 = 16 * MIB + 4 * KIB;

fn fixture(marks: &[(u64, u64)], limits: Limits) -> Fixture {
    let dir = test_dir();
    let image = dir.path().join("disk.img");
    let f = File::create(&image).unwrap();
    f.set_len(SIZE).unwrap();
    f.write_all_at(&pattern(1, 0, (4 * MIB) as usize), 0)
        .unwrap();
    f.write_all_at(&pattern(1, 12 * MIB, (SIZE - 12 * MIB) as usize), 12 * MIB)
        .unwrap();
    f.sync_all().unwrap();
    let img: Arc<dyn Image> = Arc::new(FileImage::open(&image).unwrap());
    let store = Arc::new(CbwStore::new(img, dir.path(), DEFAULT_CLUSTER).unwrap());
    let bitmap = DirtyBitmap::new(SIZE, DEFAULT_CLUSTER).unwrap();
    for &(o, l) in marks {
        bitmap.mark(o, l);
    }
    let view = View::new(
        store.clone(),
        Some(("nightly".into(), Arc::new(bitmap.copy()))),
    );
    let sock = dir.path().join("backup.sock");
    let server = Server::start(nbd::bind(&sock).unwrap(), Arc::new(view), limits).unwrap();
    Fixture {
        dir,
        image,
        sock,
        store,
        server: Some(server),
    }
}

impl Fixture {
    fn stats(&self) -> nbd::ServerStats {
        self.server.as_ref().unwrap().stats()
    }
}

/// nbdinfo sees the size, the read-only flag and both contexts; its maps
/// give the holes and the bitmap's marks; nbdcopy and qemu-img copy the
/// export byte for byte. The socket is 0600.
#[test]
fn nbd_clients_see_and_copy_the_export() {
    if !have_tools() {
        return;
    }
    let marks = [(MIB, 1), (13 * MIB + 5, 200 * KIB)];
    let fx = fixture(&marks, Limits::default());
    let mode = fs::metadata(&fx.sock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");

    let json = run(Command::new("nbdinfo").args(["--json", &uri(&fx.sock)]));
    let info: serde_json::Value = serde_json::from_str(&json).unwrap();
    let export = &info["exports"][0];
    assert_eq!(export["export-size"].as_u64(), Some(SIZE), "{json}");
    assert_eq!(export["is_read_only"].as_bool(), Some(true), "{json}");
    assert_eq!(export["can_multi_conn"].as_bool(), Some(true), "{json}");
    let contexts: Vec<&str> = export["contexts"]
        .as_array()
        .unwrap_or_else(|| panic!("no contexts: {json}"))
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(contexts, ["base:allocation", "qemu:dirty-bitmap:nightly"]);

    // base:allocation: data, the hole (zero), data.
    assert_eq!(
        map(&fx.sock, None),
        [
            (0, 4 * MIB, 0),
            (4 * MIB, 8 * MIB, 3),
            (12 * MIB, SIZE - 12 * MIB, 0)
        ]
    );
    // The bitmap: each mark rounded out to its 64 KiB granules.
    let g = DEFAULT_CLUSTER;
    let dirty: Vec<(u64, u64)> = map(&fx.sock, Some("qemu:dirty-bitmap:nightly"))
        .into_iter()
        .filter(|e| e.2 & 1 == 1)
        .map(|e| (e.0, e.1))
        .collect();
    let first = (13 * MIB + 5) / g * g;
    let last = (13 * MIB + 5 + 200 * KIB).div_ceil(g) * g;
    assert_eq!(dirty, [(MIB, g), (first, last - first)]);

    let want = fs::read(&fx.image).unwrap();
    let copy = fx.dir.path().join("nbdcopy.raw");
    run(Command::new("nbdcopy").args([&uri(&fx.sock), copy.to_str().unwrap()]));
    assert!(fs::read(&copy).unwrap() == want, "nbdcopy's copy differs");
    let copy = fx.dir.path().join("qemu-img.raw");
    run(Command::new("qemu-img").args([
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        &uri(&fx.sock),
        copy.to_str().unwrap(),
    ]));
    assert!(fs::read(&copy).unwrap() == want, "qemu-img's copy differs");
    assert_eq!(fx.stats().failed, 0, "{:?}", fx.stats());
}

/// A guest thread overwrites the image (copy-before-write first) while
/// nbdcopy and qemu-img copy the view: both copies equal the image at the
/// instant the view was taken.
#[test]
fn copies_under_writes_are_the_instant() {
    if !have_tools() {
        return;
    }
    let fx = fixture(&[], Limits::default());
    let instant = fs::read(&fx.image).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let guest = {
        let (store, stop, path) = (fx.store.clone(), stop.clone(), fx.image.clone());
        thread::spawn(move || {
            let f = OpenOptions::new().write(true).open(&path).unwrap();
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut writes = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let off = x % (SIZE / 4096) * 4096;
                let len = (4096 * (1 + x % 32)).min(SIZE - off);
                store.before_write(off, len);
                f.write_all_at(&pattern(2, off, len as usize), off).unwrap();
                writes += 1;
                if writes.is_multiple_of(64) {
                    thread::sleep(Duration::from_millis(1));
                }
            }
            writes
        })
    };
    let a = fx.dir.path().join("a.raw");
    let b = fx.dir.path().join("b.raw");
    run(Command::new("nbdcopy").args([&uri(&fx.sock), a.to_str().unwrap()]));
    run(Command::new("qemu-img").args([
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        &uri(&fx.sock),
        b.to_str().unwrap(),
    ]));
    stop.store(true, Ordering::Relaxed);
    let writes = guest.join().unwrap();
    let copied = fx.store.stats().copied_clusters;
    assert!(
        copied > 20,
        "only {copied} clusters copied in {writes} writes"
    );
    assert!(
        fs::read(&fx.image).unwrap() != instant,
        "the guest wrote nothing"
    );
    assert!(
        fs::read(&a).unwrap() == instant,
        "nbdcopy's copy is not the instant"
    );
    assert!(
        fs::read(&b).unwrap() == instant,
        "qemu-img's copy is not the instant"
    );
}

// ---- Hostile clients ----

/// A raw client: reads the server's greeting and sends its flags.
/// The server, and nbdinfo through it, still work.
fn still_serves(fx: &Fixture) {
    let out = run(Command::new("nbdinfo").args(["--size", &uri(&fx.sock)]));
    assert_eq!(out.trim(), SIZE.to_string());
}

/// Bad magic, unknown client flags and options, reads past the end, huge
/// lengths and writes each get their protocol error or a disconnect, and
/// the server serves the next client.
#[test]
fn hostile_input_gets_protocol_errors() {
    if !have_tools() {
        return;
    }
    let fx = fixture(&[], Limits::default());

    // Unknown client flags: closed.
    let mut s = greet(&fx.sock, 1 << 7);
    assert!(closed(&mut s), "unknown client flags not refused");
    // A bad option magic: closed.
    let mut s = greet(&fx.sock, 3);
    s.write_all(b"IHAVEOPX\0\0\0\x07\0\0\0\0").unwrap();
    assert!(closed(&mut s), "bad option magic not refused");
    // A 4 GiB option: closed without reading (or allocating) it.
    let mut s = greet(&fx.sock, 3);
    s.write_all(b"IHAVEOPT\0\0\0\x63\xff\xff\xff\xff").unwrap();
    assert!(closed(&mut s), "huge option not refused");
    // Unknown options get ERR_UNSUP, and the handshake goes on; STARTTLS
    // too; a malformed GO gets ERR_INVALID, another export ERR_UNKNOWN.
    let mut s = greet(&fx.sock, 3);
    for opt in [99u32, 5, 11] {
        option(&mut s, opt, b"junk");
        assert_eq!(
            option_reply(&mut s),
            (opt, 0x8000_0001, option_reply_msg(opt))
        );
    }
    option(&mut s, 7, &[0, 0, 0, 9, b'x']);
    assert_eq!(option_reply(&mut s).1, 0x8000_0003);
    let mut d = 3u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"foo\0\0");
    option(&mut s, 7, &d);
    assert_eq!(option_reply(&mut s).1, 0x8000_0006);
    // Meta contexts before structured replies: ERR_INVALID.
    option(&mut s, 10, &[0; 8]);
    assert_eq!(option_reply(&mut s).1, 0x8000_0003);
    option(&mut s, 2, &[]);
    assert_eq!(option_reply(&mut s).1, 1, "ABORT not acknowledged");
    assert!(closed(&mut s));

    // Transmission, simple replies.
    let mut s = go(&fx.sock);
    request(&mut s, 0, 1, SIZE - 512, 1024); // past the end
    assert_eq!(simple_reply(&mut s), (22, 1));
    request(&mut s, 0, 2, 0, u32::MAX); // a 4 GiB read
    assert_eq!(simple_reply(&mut s), (22, 2));
    request(&mut s, 0, 3, u64::MAX - 10, 512); // offset overflow
    assert_eq!(simple_reply(&mut s), (22, 3));
    request(&mut s, 7, 4, 0, 512); // block status without a context
    assert_eq!(simple_reply(&mut s), (22, 4));
    request(&mut s, 42, 5, 0, 0); // unknown command
    assert_eq!(simple_reply(&mut s), (22, 5));
    request(&mut s, 1, 6, 0, 4096); // a write, with its payload
    s.write_all(&[0xee; 4096]).unwrap();
    assert_eq!(simple_reply(&mut s), (1, 6), "write not refused with EPERM");
    request(&mut s, 4, 7, 0, 4096); // trim
    assert_eq!(simple_reply(&mut s), (1, 7));
    request(&mut s, 3, 8, 0, 0); // flush: nothing to do
    assert_eq!(simple_reply(&mut s), (0, 8));
    request(&mut s, 0, 9, 0, 4096); // a good read still works
    assert_eq!(simple_reply(&mut s), (0, 9));
    let mut data = vec![0u8; 4096];
    s.read_exact(&mut data).unwrap();
    assert!(data == pattern(1, 0, 4096));
    request(&mut s, 1, 10, 0, u32::MAX); // a 4 GiB write: cannot be skipped
    assert!(closed(&mut s), "4 GiB write did not end the connection");
    // A bad request magic: closed.
    let mut s = go(&fx.sock);
    s.write_all(&[0u8; 28]).unwrap();
    assert!(closed(&mut s), "bad request magic not refused");

    still_serves(&fx);
    assert!(fx.stats().failed >= 5, "{:?}", fx.stats());
    // The image was never written.
    let f = fs::read(&fx.image).unwrap();
    assert!(f[..4096] == pattern(1, 0, 4096)[..]);
}

/// The message of an ERR_UNSUP reply, as the server words it.
fn option_reply_msg(opt: u32) -> Vec<u8> {
    format!("option {opt} is not supported").into_bytes()
}

/// Connections past the cap are closed at once; when the slow ones time
/// out (a silent handshake, a reader that never reads its 16 MiB), the
/// server serves again.
#[test]
fn many_and_slow_clients_are_bounded() {
    if !have_tools() {
        return;
    }
    let limits = Limits {
        max_connections: 3,
        handshake: Duration::from_secs(2),
        idle: Duration::from_secs(60),
        io: Duration::from_secs(2),
    };
    let fx = fixture(&[], limits);
    // Three silent clients take the three threads...
    let mut silent: Vec<UnixStream> = (0..2)
        .map(|_| {
            let s = UnixStream::connect(&fx.sock).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s
        })
        .collect();
    // ...the third asks for 16 MiB, many times, and never reads.
    let mut hog = go(&fx.sock);
    for h in 0..8 {
        request(&mut hog, 0, h, 0, 16 << 20);
    }
    thread::sleep(Duration::from_millis(300));
    // Past the cap: closed at once.
    let started = Instant::now();
    for _ in 0..20 {
        let mut s = UnixStream::connect(&fx.sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(closed(&mut s));
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "refusals took {:?}",
        started.elapsed()
    );
    assert!(fx.stats().refused >= 20, "{:?}", fx.stats());
    // The silent ones are dropped at the handshake deadline, the hog at
    // its reply's deadline: then a client is served again.
    for s in &mut silent {
        let t = Instant::now();
        assert!(closed(s));
        assert!(t.elapsed() < Duration::from_secs(5));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while fx.stats().failed < 3 {
        assert!(Instant::now() < deadline, "{:?}", fx.stats());
        thread::sleep(Duration::from_millis(50));
    }
    still_serves(&fx);
    drop(hog);
}

/// Stopping the server ends its connections and frees the socket's clients.
#[test]
fn stop_ends_connections() {
    let mut fx = fixture(&[], Limits::default());
    let mut s = go(&fx.sock);
    fx.server.take().unwrap().stop();
    assert!(closed(&mut s));
    assert!(UnixStream::connect(&fx.sock).is_err());
}

// ---- Bitmap persistence ----

const CHILD_ENV: &str = "RINGBLK_TEST_BITMAP_CHILD";
const BM_SIZE: u64 = 256 * MIB;

fn bitmap_marks() -> Vec<(u64, u64)> {
    (0..200u64)
        .map(|i| (i * 1_234_567 % BM_SIZE, 4096 + i * 512))
        .collect()
}

/// The child of `a_bitmap_survives_kill_9`: adds a bitmap next to an
/// image, marks it, says so, and waits to be killed. A no-op when run as
/// a test of its own.
#[test]
fn bitmap_writer_child() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let mut store = SidecarStore::new(&dir, "disk.img").unwrap();
    let b = store.add("k", DEFAULT_CLUSTER, BM_SIZE).unwrap();
    for (o, l) in bitmap_marks() {
        b.mark(o, l);
    }
    fs::write(dir.join("ready"), b"marked").unwrap();
    loop {
        thread::sleep(Duration::from_secs(1));
    }
}

/// A process marks a bitmap and is killed with SIGKILL before it can
/// close it: reloaded in the same boot, the bitmap is complete. Reloaded
/// as after a host restart (another boot id), it is marked inconsistent.
#[test]
fn a_bitmap_survives_kill_9_and_a_host_stop_marks_it_inconsistent() {
    let dir = test_dir();
    // This binary again, running only the child: its test name is its
    // module's path in the binary (the crate's name left out).
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    let child_test = format!("{module}::bitmap_writer_child");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &child_test, "--nocapture"])
        .env(CHILD_ENV, dir.path())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !dir.path().join("ready").exists() {
        assert!(Instant::now() < deadline, "the child never marked");
        assert!(child.try_wait().unwrap().is_none(), "the child died");
        thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    let expected = DirtyBitmap::new(BM_SIZE, DEFAULT_CLUSTER).unwrap();
    for (o, l) in bitmap_marks() {
        expected.mark(o, l);
    }
    let mut store = SidecarStore::new(dir.path(), "disk.img").unwrap();
    let loaded = open_all(&mut store);
    assert_eq!(loaded.len(), 1);
    let (name, b) = &loaded[0];
    assert_eq!(name, "k");
    assert!(b.is_consistent(), "same boot after kill -9: complete");
    assert_eq!(b.dirty_extents(), expected.dirty_extents());
    drop(loaded);
    drop(store); // in use again, and not closed

    let mut store = SidecarStore::new(dir.path(), "disk.img")
        .unwrap()
        .with_boot_id("00000000-0000-0000-0000-000000000000");
    let loaded = open_all(&mut store);
    assert!(!loaded[0].1.is_consistent(), "another boot: inconsistent");
    // A clean close keeps it inconsistent, in the file.
    store.close("k", &loaded[0].1).unwrap();
    let loaded = open_all(&mut SidecarStore::new(dir.path(), "disk.img").unwrap());
    assert!(!loaded[0].1.is_consistent());
}

/// Every bitmap of `store`, each of which must load.
fn open_all(store: &mut impl BitmapStore) -> Vec<(String, DirtyBitmap)> {
    store
        .open(BM_SIZE)
        .into_iter()
        .map(|(name, b)| {
            let b = b.unwrap_or_else(|e| panic!("bitmap {name}: {e}"));
            (name, b)
        })
        .collect()
}
