//! Dirty-page logging for live migration (VHOST_F_LOG_ALL with
//! VHOST_USER_PROTOCOL_F_LOG_SHMFD), from a hand-written front-end: QEMU
//! hands the daemon a shared bitmap, one bit per 4 KiB guest page, and
//! copies again every page whose bit the daemon sets. A page the daemon
//! writes without setting its bit reaches the destination stale.
//!
//! The pages io_uring reads into are written by the kernel, behind
//! vm-memory's back: the daemon must mark them itself, exactly them, and
//! only while logging is on.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use ringblk::virtio::chain_writer::{readable as r, writable as w};
use ringblk_testkit::frontend;
use ringblk_testkit::frontend::{
    ADD_MEM_REG, Conn, F_LOG_ALL, F_PROTOCOL_FEATURES, F_VERSION_1, FLAG_VERSION, Guest,
    P_LOG_SHMFD, REGION1, REGION1_END, SET_FEATURES, SET_LOG_BASE, Vq, memfd, region, seal,
    single_region, u64_payload,
};
use ringblk_testkit::{Daemon, MIB};

const PAGE: u64 = 4096;
const RING: u64 = 0x1_0000;
const HDR: u64 = 0x2_0000;
const STATUS: u64 = 0x2_0100;

/// The log's bits as page numbers.
fn dirty_pages(log: &mut std::fs::File) -> Vec<u64> {
    let mut bytes = Vec::new();
    log.seek(SeekFrom::Start(0)).unwrap();
    log.read_to_end(&mut bytes).unwrap();
    (0..bytes.len() as u64 * 8)
        .filter(|p| bytes[(p / 8) as usize] & (1 << (p % 8)) != 0)
        .collect()
}

/// Clears the log, as the front-end does each time it has read it.
fn clear(log: &mut std::fs::File) {
    let len = log.metadata().unwrap().len();
    log.seek(SeekFrom::Start(0)).unwrap();
    log.write_all(&vec![0; len as usize]).unwrap();
}

/// Posts a request of `len` bytes at `data` (IN or OUT) and waits for it.
fn io(vq: &mut Vq, g: &Guest, req_type: u32, data: u64, len: u32) {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&req_type.to_le_bytes());
    g.write(HDR, &h);
    let buf = if req_type == 0 {
        w(data, len)
    } else {
        r(data, len)
    };
    vq.post(g, &[r(HDR, 16), buf, w(STATUS, 1)]);
    let (_, used_len) = vq.one_used(g);
    assert_eq!(g.byte(STATUS), 0, "status");
    let want = if req_type == 0 { len + 1 } else { 1 };
    assert_eq!(used_len, want, "used length");
}

#[test]
fn reads_mark_exactly_their_pages_while_logging_is_on() {
    let d = Daemon::start(64 * MIB, &[]);
    let conn = Conn::connect(&d.socket);
    let offered = conn.handshake_with(F_LOG_ALL, P_LOG_SHMFD);
    assert_ne!(offered & F_LOG_ALL, 0, "VHOST_F_LOG_ALL offered");
    let g = Guest::new();
    g.share(&conn);
    // One bit per page of all guest addresses.
    let log_len = (REGION1_END / PAGE / 8).next_multiple_of(PAGE);
    let mut log = memfd(log_len);
    // As QEMU's: a log that could shrink is refused.
    seal(&log);
    let mut base = u64_payload(log_len);
    base.extend_from_slice(&0u64.to_le_bytes()); // mmap_offset
    // With LOG_SHMFD the back-end always replies (QEMU checks only the
    // request code).
    match conn.ask_flags(SET_LOG_BASE, FLAG_VERSION, &base, &[log.as_raw_fd()]) {
        frontend::Outcome::Reply(m) => assert_eq!(m.request, SET_LOG_BASE),
        frontend::Outcome::Closed => panic!("SET_LOG_BASE: the daemon hung up"),
    }
    let mut vq = Vq::new(0, 64, RING);
    vq.setup(&conn, &g);

    // An 8 KiB read into 0x4_1800..0x4_3800: pages 0x41, 0x42 and 0x43.
    io(&mut vq, &g, 0, 0x4_1800, 8192);
    let dirty = dirty_pages(&mut log);
    for p in [0x41, 0x42, 0x43] {
        assert!(
            dirty.contains(&p),
            "page {p:#x} of the read is not marked: {dirty:x?}"
        );
    }
    for p in [0x40, 0x44] {
        assert!(
            !dirty.contains(&p),
            "page {p:#x} next to the read is marked: {dirty:x?}"
        );
    }
    // The status byte and the used ring are marked too.
    assert!(dirty.contains(&(STATUS / PAGE)), "status page: {dirty:x?}");
    assert!(
        dirty
            .iter()
            .any(|p| (RING / PAGE..RING / PAGE + 3).contains(p)),
        "used ring pages: {dirty:x?}"
    );
    // A write only reads guest memory: its pages stay clean.
    io(&mut vq, &g, 1, 0x6_0000, 8192);
    let dirty = dirty_pages(&mut log);
    assert!(
        !dirty.contains(&0x60) && !dirty.contains(&0x61),
        "{dirty:x?}"
    );

    // Logging off (SET_FEATURES without LOG_ALL, as QEMU does once the
    // migration is over): reads mark their pages no more.
    conn.send(
        SET_FEATURES,
        FLAG_VERSION,
        &u64_payload(F_VERSION_1 | F_PROTOCOL_FEATURES),
        &[],
    )
    .expect("SET_FEATURES");
    // A round trip: the daemon has taken SET_FEATURES in when this returns.
    conn.get(frontend::GET_QUEUE_NUM, &[]);
    io(&mut vq, &g, 0, 0x8_0000, 4096);
    let dirty = dirty_pages(&mut log);
    assert!(
        !dirty.contains(&0x80),
        "marked with logging off: {dirty:x?}"
    );
}

/// Memory hot-plugged during a migration: a region added after the log
/// was handed over (ADD_MEM_REG), and a whole new memory table
/// (SET_MEM_TABLE, as a front-end without CONFIGURE_MEM_SLOTS sends), are
/// logged too. QEMU grows its log before it adds memory, and sends
/// SET_LOG_BASE again only when the log must grow. vhost-user-backend gave
/// the log only to the regions of the table it had when the log came, so
/// reads into newer regions reached the destination stale.
#[test]
fn regions_added_after_the_log_are_logged_too() {
    let d = Daemon::start(64 * MIB, &[]);
    let conn = Conn::connect(&d.socket);
    conn.handshake_with(F_LOG_ALL, P_LOG_SHMFD);
    let g = Guest::new();
    g.share(&conn);
    // Room for 64 MiB of guest addresses, hot-plugged memory included.
    let log_len = (64 * MIB / PAGE / 8).next_multiple_of(PAGE);
    let mut log = memfd(log_len);
    seal(&log);
    let mut base = u64_payload(log_len);
    base.extend_from_slice(&0u64.to_le_bytes());
    match conn.ask_flags(SET_LOG_BASE, FLAG_VERSION, &base, &[log.as_raw_fd()]) {
        frontend::Outcome::Reply(m) => assert_eq!(m.request, SET_LOG_BASE),
        frontend::Outcome::Closed => panic!("SET_LOG_BASE: the daemon hung up"),
    }
    let mut vq = Vq::new(0, 64, RING);
    vq.setup(&conn, &g);

    // A DIMM plugged in at 32 MiB.
    const DIMM: u64 = 32 * MIB;
    let dimm = memfd(4 * MIB);
    conn.ok(
        ADD_MEM_REG,
        &single_region(&region(DIMM, 4 * MIB, 0x7200_0000_0000, 0)),
        &[dimm.as_raw_fd()],
    );
    io(&mut vq, &g, 0, DIMM + 0x1800, 8192);
    let dirty = dirty_pages(&mut log);
    for p in (DIMM / PAGE + 1)..=(DIMM / PAGE + 3) {
        assert!(
            dirty.contains(&p),
            "page {p:#x} of a read into the added region is not marked: {dirty:x?}"
        );
    }
    assert!(!dirty.contains(&(DIMM / PAGE + 4)), "{dirty:x?}");

    // A new table (the same regions, mapped afresh), and a log the
    // front-end has read and cleared.
    g.share(&conn);
    clear(&mut log);
    io(&mut vq, &g, 0, REGION1 + 0x8000, 4096);
    let dirty = dirty_pages(&mut log);
    assert!(
        dirty.contains(&((REGION1 + 0x8000) / PAGE)),
        "a read into a region of a table sent after the log is not marked: {dirty:x?}"
    );
    assert!(
        dirty.contains(&(STATUS / PAGE)),
        "the status byte, written through the new table: {dirty:x?}"
    );

    // Neither the log nor any table outlives the connection.
    drop(conn);
    for (file, what) in [
        (&log, "the log"),
        (&g.file, "guest memory"),
        (&dimm, "the DIMM"),
    ] {
        let ino = file.metadata().unwrap().ino().to_string();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let maps = std::fs::read_to_string(format!("/proc/{}/maps", d.pid())).unwrap();
            let n = maps
                .lines()
                .filter(|l| l.split_whitespace().nth(4) == Some(ino.as_str()))
                .count();
            if n == 0 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{what} is still mapped {n} times after the connection"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}
