//! The disconnect window, from a hand-written front-end: once the
//! front-end's socket is closed, no ring takes a new request, although
//! the shared rings stay writable (by a guest, or by anyone else who maps
//! the memory) until the daemon has wound the connection down. Requests
//! taken before the close complete.
//!
//! The daemon winds a connection down one queue after the other, and a
//! queue whose worker is busy-polling is reached only when its window
//! ends: here queue 0 polls for 200 ms after its last request, so the
//! drain reaches queue 1 some 200 ms after the close. The rings used to
//! take requests all that while (of the writes posted and kicked on queue
//! 1 in the 20-140 ms after a close, every one was executed).

use std::time::{Duration, Instant};

use ringblk::virtio::chain_writer::{Desc, link, readable as r, writable as w};
use ringblk_testkit::frontend::{Conn, Guest, Vq, assert_serves};
use ringblk_testkit::{Daemon, MIB};

const SIZE: u64 = 64 * MIB;
/// Rings of each queue: descriptors, avail (+0x1000), used (+0x2000).
const RING0: u64 = 0x1_0000;
const RING1: u64 = 0x2_0000;
const QSIZE: u16 = 256;
/// Request headers (16 bytes each), status bytes, 4 KiB data buffers.
const HDRS: u64 = 0x10_0000;
const STATUSES: u64 = 0x20_0000;
const DATA: u64 = 0x40_0000;
/// Requests of each kind.
const BEFORE: u64 = 16;
const AFTER: u64 = 64;
/// Where in the image each kind writes.
const BEFORE_AT: u64 = 0;
const AFTER_AT: u64 = MIB;
const Q0_AT: u64 = 2 * MIB;

/// A 4 KiB write of `fill` at byte `offset`, as request `n` (its own
/// header, status byte and buffer, and table slots `3n..3n + 3`).
fn write_chain(g: &Guest, n: u64, offset: u64, fill: u8) -> (u16, Vec<Desc>) {
    let hdr = HDRS + 16 * n;
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&1u32.to_le_bytes()); // VIRTIO_BLK_T_OUT
    h[8..16].copy_from_slice(&(offset / 512).to_le_bytes());
    g.write(hdr, &h);
    g.write(STATUSES + n, &[0xff]);
    let data = DATA + 4096 * n;
    g.write(data, &[fill; 4096]);
    let first = u16::try_from(3 * (n % 85)).unwrap();
    let chain = link(&[r(hdr, 16), r(data, 4096), w(STATUSES + n, 1)], first);
    (first, chain)
}

/// Posts request `n` on `vq` and kicks.
fn post_write(vq: &mut Vq, g: &Guest, n: u64, offset: u64, fill: u8) {
    let (first, chain) = write_chain(g, n, offset, fill);
    vq.write_table(g, first, &chain);
    vq.publish(g, &[first]);
}

#[test]
fn requests_posted_after_the_close_are_not_executed() {
    let mut d = Daemon::start(
        SIZE,
        &[
            "--queues",
            "2",
            "--threads",
            "2",
            "--poll-us",
            "200000",
            "--no-poll-checks",
        ],
    );
    let conn = Conn::connect(&d.socket);
    conn.handshake(0);
    let g = Guest::new();
    g.share(&conn);
    let mut q0 = Vq::new(0, QSIZE, RING0);
    let mut q1 = Vq::new(1, QSIZE, RING1);
    q0.setup(&conn, &g);
    q1.setup(&conn, &g);

    // Taken before the close: they complete, whenever the close comes.
    // Published with one store of avail->idx: a worker polling the ring
    // sees none or all of them (one store each let it take the first 12
    // in one pass and be descheduled until after the close, which then,
    // rightly, left the other 4 on the ring).
    let heads: Vec<u16> = (0..BEFORE)
        .map(|i| {
            let (first, chain) = write_chain(&g, i, BEFORE_AT + 4096 * i, 0xa5);
            q1.write_table(&g, first, &chain);
            first
        })
        .collect();
    q1.publish_without_kick(&g, &heads);
    q1.kick.write(1).unwrap();
    // One is done: the worker took all of them in one pass (one pop takes
    // everything published, up to the engine's room).
    let mut before = q1.take_used(&g, 1, Duration::from_secs(10));
    assert!(!before.is_empty(), "queue 1 took nothing");
    // Queue 0 serves one request and then polls for the next one for
    // 200 ms, which delays the drain of the rings.
    let (first, chain) = write_chain(&g, BEFORE, Q0_AT, 0x77);
    q0.write_table(&g, first, &chain);
    q0.publish(&g, &[first]);
    q0.one_used(&g);

    drop(conn);
    let closed = Instant::now();
    // The daemon has read the end of the stream by now.
    std::thread::sleep(Duration::from_millis(20));
    let mut posted = 0;
    while posted < AFTER && closed.elapsed() < Duration::from_millis(140) {
        let n = BEFORE + 1 + posted;
        post_write(&mut q1, &g, n, AFTER_AT + 4096 * posted, 0x5a);
        posted += 1;
        std::thread::sleep(Duration::from_millis(2));
    }
    let window = closed.elapsed();
    // Long past the drain of both queues.
    std::thread::sleep(Duration::from_millis(600));

    before.extend(q1.take_used(&g, (BEFORE - 1) as u16, Duration::from_secs(5)));
    let executed = (0..posted)
        .filter(|i| d.read_image(AFTER_AT + 4096 * i, 1)[0] != 0)
        .count();
    eprintln!(
        "after the close: {executed} of {posted} requests posted and kicked in the {:?}-{window:?} after it were executed",
        Duration::from_millis(20)
    );
    assert_eq!(
        executed, 0,
        "{executed} of {posted} writes posted after the front-end closed its socket reached the image"
    );
    assert_eq!(
        before.len() as u64,
        BEFORE,
        "requests taken before the close did not complete: {before:?}"
    );
    for i in 0..BEFORE {
        assert_eq!(
            d.read_image(BEFORE_AT + 4096 * i, 4096),
            vec![0xa5; 4096],
            "write {i} taken before the close"
        );
    }
    assert_serves(&mut d, "requests posted after a close", 8 * MIB, 4);
}
