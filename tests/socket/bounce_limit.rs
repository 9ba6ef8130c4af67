//! With O_DIRECT, a request whose guest buffers are not aligned goes
//! through a bounce buffer as large as the request. A guest decides both
//! the alignment and the size, so without limits it decides how much the
//! daemon allocates: 254 descriptors can all point at one buffer.
//!
//! The daemon advertises `size_max` so that `seg_max` segments carry at
//! most 32 MiB, refuses requests past that, and keeps the bounce memory of
//! a queue under 32 MiB at once (later requests wait their turn). This test
//! posts 16 such misaligned writes of 31.75 MiB at once from a hand-written
//! front-end and checks they all complete, with the right data, while the
//! daemon's peak RSS stays under a stated bound.

use std::time::Duration;

use ringblk::virtio::chain_writer::{indirect as ind, link, readable as r, writable as w};
use ringblk_testkit::frontend::{Conn, F_INDIRECT_DESC, Guest, Vq};
use ringblk_testkit::{Daemon, MIB};

const QUEUE_SIZE: u16 = 256;
const RING: u64 = 0x1_0000;
const HDRS: u64 = 0x2_0000;
const STATUS: u64 = 0x2_1000;
const TABLES: u64 = 0x3_0000;
/// One past a page boundary: misaligned for O_DIRECT.
const DATA: u64 = 0x10_0001;
const REQUESTS: u16 = 16;
/// The peak RSS the daemon may reach: its own few MiB, one queue's 32 MiB
/// of bounce buffers, and room for the allocator; 16 requests bounced at
/// once would take 508 MiB.
const RSS_BOUND_KIB: u64 = 160 << 10;

fn kib(status_value: &str) -> u64 {
    status_value
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("not a kB value: {status_value:?}"))
}

#[test]
fn bounce_memory_stays_bounded_under_large_misaligned_requests() {
    let d = Daemon::start(64 * MIB, &["--direct"]);
    let conn = Conn::connect(&d.socket);
    conn.handshake(F_INDIRECT_DESC);
    let cfg = conn.config(0, 16);
    let advertised = (
        u32::from_le_bytes(cfg[8..12].try_into().unwrap()),
        u32::from_le_bytes(cfg[12..16].try_into().unwrap()),
    );
    // What the driver may send: seg_max segments of size_max bytes.
    let (size_max, seg_max) = (128 << 10, 254);
    let g = Guest::new();
    g.share(&conn);
    let mut vq = Vq::new(0, QUEUE_SIZE, RING);
    vq.setup(&conn, &g);

    let chunk: Vec<u8> = (0..size_max).map(|i| (i % 251) as u8).collect();
    g.write(DATA, &chunk);
    let mut heads = Vec::new();
    for i in 0..REQUESTS {
        let hdr = HDRS + 16 * u64::from(i);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&1u32.to_le_bytes()); // VIRTIO_BLK_T_OUT
        g.write(hdr, &h); // sector 0: every write lands on the same 31.75 MiB
        g.write(STATUS + u64::from(i), &[0xff]);
        let mut chain = vec![r(hdr, 16)];
        chain.extend((0..seg_max).map(|_| r(DATA, size_max)));
        chain.push(w(STATUS + u64::from(i), 1));
        let table = TABLES + 0x1000 * u64::from(i);
        g.write_descs(table, 0, &link(&chain, 0));
        vq.write_table(&g, i, &[ind(table, 16 * chain.len() as u32)]);
        heads.push(i);
    }
    vq.publish(&g, &heads);

    let used = vq.take_used(&g, REQUESTS, Duration::from_secs(120));
    assert_eq!(used.len(), usize::from(REQUESTS), "completions: {used:?}");
    for (head, len) in used {
        assert_eq!(len, 1, "request {head}: used length");
        assert_eq!(
            g.byte(STATUS + u64::from(head)),
            0,
            "request {head}: status"
        );
    }
    let data_len = (seg_max * size_max) as usize;
    let image = d.read_image(0, data_len);
    for (k, seg) in image.chunks(size_max as usize).enumerate() {
        assert!(seg == chunk.as_slice(), "segment {k} in the image");
    }
    let peak = kib(&d.proc_status(None, "VmHWM").expect("VmHWM"));
    assert!(
        peak < RSS_BOUND_KIB,
        "peak RSS {peak} KiB, bound {RSS_BOUND_KIB} KiB"
    );
    eprintln!("peak RSS {peak} KiB for {REQUESTS} misaligned writes of {data_len} bytes");
    assert_eq!(advertised, (size_max, seg_max), "size_max, seg_max");
}

/// Past what one request may carry (seg_max x size_max), a write is refused
/// before anything is allocated for it.
#[test]
fn a_request_past_seg_max_times_size_max_is_refused() {
    let mut d = Daemon::start(64 * MIB, &["--direct"]);
    let conn = Conn::connect(&d.socket);
    conn.handshake(F_INDIRECT_DESC);
    let g = Guest::new();
    g.share(&conn);
    let mut vq = Vq::new(0, QUEUE_SIZE, RING);
    vq.setup(&conn, &g);
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&1u32.to_le_bytes());
    g.write(HDRS, &h);
    g.write(STATUS, &[0xff]);
    // 17 segments of 2 MiB: 34 MiB, within seg_max but past 32 MiB.
    let mut chain = vec![r(HDRS, 16)];
    chain.extend((0..17).map(|_| r(DATA, 2 << 20)));
    chain.push(w(STATUS, 1));
    g.write_descs(TABLES, 0, &link(&chain, 0));
    vq.write_table(&g, 0, &[ind(TABLES, 16 * chain.len() as u32)]);
    vq.publish(&g, &[0]);
    assert_eq!(vq.one_used(&g), (0, 1));
    assert_eq!(g.byte(STATUS), 1, "VIRTIO_BLK_S_IOERR");
    d.assert_running();
}
