//! Dirty-page logging for live migration (VHOST_F_LOG_ALL with
//! VHOST_USER_PROTOCOL_F_LOG_SHMFD), from a hand-written front-end: QEMU
//! hands the daemon a shared bitmap, one bit per 4 KiB guest page, and
//! copies again every page whose bit the daemon sets. A page the daemon
//! writes without setting its bit reaches the destination stale.
//!
//! The pages io_uring reads into are written by the kernel, behind
//! vm-memory's back: the daemon must mark them itself, exactly them, and
//! only while logging is on.

use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;

use ringblk::virtio::chain_writer::{readable as r, writable as w};
use ringblk_testkit::frontend;
use ringblk_testkit::frontend::{
    Conn, F_LOG_ALL, F_PROTOCOL_FEATURES, F_VERSION_1, FLAG_VERSION, Guest, P_LOG_SHMFD,
    REGION1_END, SET_FEATURES, SET_LOG_BASE, Vq, memfd, u64_payload,
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
