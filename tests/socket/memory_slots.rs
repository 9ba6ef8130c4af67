//! Guest memory regions, as many as the front-end may map, and their
//! protection against a front-end that shrinks a memory file under us
//! (`src/vhost/sigbus.rs`): every mapped region stays protected however
//! many came after it, the daemon refuses more regions than it advertises
//! memory slots, and a region is unmapped (and leaves the protection
//! table) once nothing uses it.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::thread;
use std::time::{Duration, Instant};

use ringblk::virtio::chain_writer::{readable as r, writable as w};
use ringblk_testkit::frontend::*;
use ringblk_testkit::{Daemon, MIB};

/// Where the filler regions go: one page each, a page apart.
const FILLER_GPA: u64 = 0x1_0000_0000;
/// Front-end virtual addresses for regions the test does not map itself
/// (the daemon only uses them to translate ring addresses).
const FILLER_VA: u64 = 0x5000_0000_0000;

fn filler(i: u64) -> Region {
    region(FILLER_GPA + 2 * i * 4096, 4096, FILLER_VA + 2 * i * 4096, 0)
}

/// ADD_MEM_REG of `n` one-page regions backed by `file`, from index
/// `first`; each must succeed.
fn add_fillers(conn: &Conn, file: &File, first: u64, n: u64) {
    for i in first..first + n {
        conn.ok(ADD_MEM_REG, &single_region(&filler(i)), &[file.as_raw_fd()]);
    }
}

/// How many of the daemon's mappings are of `file`.
fn mappings_of(d: &Daemon, file: &File) -> usize {
    let ino = file.metadata().expect("fstat").ino().to_string();
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", d.pid())).expect("maps");
    maps.lines()
        .filter(|l| l.split_whitespace().nth(4) == Some(ino.as_str()))
        .count()
}

/// Waits (up to 10 s) until the daemon maps `file` `n` times.
#[track_caller]
fn wait_mappings(d: &Daemon, file: &File, n: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = mappings_of(d, file);
        if now == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the daemon maps the file {now} times, expected {n}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// The SIGBUS protection used to remember 256 ranges and overwrite the
/// oldest: a region followed by 300 more lost it, still mapped, and a
/// shrunk file under it killed the daemon on the next access.
#[test]
fn the_first_region_stays_protected_after_300_more() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let conn = Conn::connect(&d.socket);
    conn.handshake(0);
    let g = Guest::new();
    g.share(&conn);
    const VICTIM: u64 = 0x400_0000;
    let victim = memfd(MIB);
    conn.ok(
        ADD_MEM_REG,
        &single_region(&region(VICTIM, MIB, 0x4000_0000_0000, 0)),
        &[victim.as_raw_fd()],
    );
    let pages = memfd(4096);
    add_fillers(&conn, &pages, 0, 300);
    let mut q = Vq::new(0, 64, 0);
    q.setup(&conn, &g);
    victim.set_len(0).expect("shrinking the victim's memfd");
    // The header lies in the shrunk region: reading it faults.
    g.write(0x5000, &[0xff]);
    q.post(
        &g,
        &[r(VICTIM + 0x2000, 16), w(0x2_0000, 512), w(0x5000, 1)],
    );
    let used = q.take_used(&g, 1, Duration::from_secs(5));
    thread::sleep(Duration::from_millis(200));
    d.assert_running();
    assert_eq!(used.len(), 1, "the request never completed");
    drop(conn);
    d.wait_for_log("page(s) past the end of their file were replaced with zero pages");
    assert_serves(&mut d, "300 regions and a shrunk one", 8192, 1);
}

/// The daemon advertises as many memory slots as it protects, and refuses
/// (error reply) a region beyond them; it used to take any number.
#[test]
fn regions_beyond_the_advertised_slots_are_refused() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let conn = Conn::connect(&d.socket);
    conn.handshake(0);
    let slots = conn
        .get(GET_MAX_MEM_SLOTS, &[])
        .u64()
        .expect("GET_MAX_MEM_SLOTS");
    assert_eq!(slots, ringblk::vhost::sigbus::MEM_SLOTS as u64);
    let g = Guest::new();
    g.share(&conn);
    let pages = memfd(4096);
    add_fillers(&conn, &pages, 0, slots - 2);
    let out = conn.ask(
        ADD_MEM_REG,
        &single_region(&filler(slots)),
        &[pages.as_raw_fd()],
    );
    assert!(
        out.is_refusal(),
        "region {} of {slots} slots: {}",
        slots + 1,
        out.describe()
    );
    drop(conn);
    // None of those regions outlives the connection.
    wait_mappings(&d, &pages, 0, "after the connection");
    assert_serves(&mut d, "more regions than slots", 8192, 2);
}

/// A removed region is unmapped at once when no request uses it; so is
/// all of a connection's memory when it ends, although the protection
/// table holds a reference to every region.
#[test]
fn regions_are_unmapped_once_nothing_uses_them() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let conn = Conn::connect(&d.socket);
    conn.handshake(0);
    let g = Guest::new();
    g.share(&conn);
    let pages = memfd(4096);
    add_fillers(&conn, &pages, 0, 3);
    wait_mappings(&d, &pages, 3, "three regions added");
    // Requests in flight hold a snapshot of the memory; serve a few.
    let mut q = Vq::new(0, 64, 0);
    q.setup(&conn, &g);
    for sector in [0u64, 8, 16] {
        let mut h = [0u8; 16];
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        g.write(0x1_0000, &h);
        q.post(&g, &[r(0x1_0000, 16), w(0x2_0000, 4096), w(0x5000, 1)]);
        assert_eq!(q.one_used(&g), (0, 4097));
    }
    conn.ok(REM_MEM_REG, &single_region(&filler(1)), &[]);
    wait_mappings(&d, &pages, 2, "a region removed");
    drop(conn);
    wait_mappings(&d, &g.file, 0, "guest memory after the connection");
    wait_mappings(&d, &pages, 0, "added regions after the connection");
    assert_serves(&mut d, "regions removed", 8192, 3);
}
