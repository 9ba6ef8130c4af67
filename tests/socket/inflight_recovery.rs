//! The inflight region (INFLIGHT_SHMFD) is the front-end's memory: a
//! restarted daemon reads it to learn what to resubmit, and nothing in it
//! may crash the daemon or make it lose a request. Over a real socket, a
//! front-end hands over regions that do not fit the device, and one full
//! of garbage next to a few real requests in flight.

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use ringblk::queue::inflight::queue_region_size;
use ringblk::virtio::chain_writer::{link, readable as r, writable as w};
use ringblk_testkit::frontend::*;
use ringblk_testkit::{Daemon, MIB};

/// The daemon's default maximum queue size.
const MAX_QUEUE_SIZE: u16 = 256;
const RING: u64 = 0x10_0000;
const QUEUE_SIZE: u16 = 64;
const VIRTIO_BLK_T_OUT: u32 = 1;

fn sealed(size: u64) -> std::fs::File {
    let f = memfd(size);
    seal(&f);
    f
}

/// SET_INFLIGHT_FD for queues larger than the device's used to be taken:
/// the region's heads then run past any ring the daemon can have.
#[test]
fn a_region_for_queues_larger_than_the_device_is_refused() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let conn = Conn::connect(&d.socket);
    conn.handshake(0);
    let size = 4 * MAX_QUEUE_SIZE;
    let need = queue_region_size(size) as u64;
    let f = sealed(need);
    let out = conn.ask(
        SET_INFLIGHT_FD,
        &inflight(need, 0, 1, size),
        &[f.as_raw_fd()],
    );
    assert!(
        out.is_refusal(),
        "a region for queues of {size}: {}",
        out.describe()
    );
    // One the device can have is taken.
    let need = queue_region_size(MAX_QUEUE_SIZE) as u64;
    let f = sealed(need);
    conn.ok(
        SET_INFLIGHT_FD,
        &inflight(need, 0, 1, MAX_QUEUE_SIZE),
        &[f.as_raw_fd()],
    );
    drop(conn);
    assert_serves(&mut d, "a region for queues too large", 0, 0);
}

/// A 4 KiB write at `sector` as the chain at table index `first`, with its
/// header and status byte of its own.
fn write_chain(vq: &Vq, g: &Guest, first: u16, sector: u64) {
    let at = 0x20_0000 + 0x1_0000 * u64::from(first);
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&VIRTIO_BLK_T_OUT.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    g.write(at, &h);
    g.write(at + 0x1000, &[first as u8; 4096]);
    g.write(at + 0x3000, &[0xff]);
    vq.write_table(
        g,
        first,
        &link(&[r(at, 16), r(at + 0x1000, 4096), w(at + 0x3000, 1)], first),
    );
}

/// One queue's part of the region, as a previous daemon would have left it
/// with heads 0, 4 and 8 in flight, and garbage around them: a counter of
/// u64::MAX, heads past the ring, random bytes everywhere else.
fn garbage_log(region_queue_size: u16) -> Vec<u8> {
    let mut b = vec![0u8; queue_region_size(region_queue_size)];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for chunk in b.chunks_mut(8) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        chunk.copy_from_slice(&seed.to_le_bytes()[..chunk.len()]);
    }
    b[8..10].copy_from_slice(&1u16.to_le_bytes()); // version
    b[14..16].copy_from_slice(&0u16.to_le_bytes()); // used_idx as on the ring
    for h in 0..region_queue_size {
        b[16 + 16 * usize::from(h)] = 0; // not in flight...
    }
    // ...except these (head, counter); the ring has 64 entries.
    for (h, counter) in [(0u16, u64::MAX), (4, 5), (8, 0), (100, 7), (200, 1)] {
        let d = 16 + 16 * usize::from(h);
        b[d] = 1;
        b[d + 8..d + 16].copy_from_slice(&counter.to_le_bytes());
    }
    b
}

/// A front-end handing daemon `d` the inflight region `log` (one queue's
/// part) and sharing guest memory that holds three 4 KiB writes, heads 0,
/// 4 and 8 to sectors 0, 8 and 16, on an empty ring not yet attached.
fn restarted_with(d: &Daemon, log: &[u8]) -> (Conn, Guest, Vq) {
    let conn = Conn::connect(&d.socket);
    conn.handshake(0);
    let f = memfd(log.len() as u64);
    f.write_all_at(log, 0).expect("writing the region");
    seal(&f);
    conn.ok(
        SET_INFLIGHT_FD,
        &inflight(log.len() as u64, 0, 1, MAX_QUEUE_SIZE),
        &[f.as_raw_fd()],
    );
    let g = Guest::new();
    g.share(&conn);
    let vq = Vq::new(0, QUEUE_SIZE, RING);
    g.write(vq.desc, &vec![0u8; 16 * usize::from(QUEUE_SIZE)]);
    g.write(vq.avail, &vec![0u8; 6 + 2 * usize::from(QUEUE_SIZE)]);
    g.write(vq.used, &vec![0u8; 6 + 8 * usize::from(QUEUE_SIZE)]);
    for (first, sector) in [(0u16, 0u64), (4, 8), (8, 16)] {
        write_chain(&vq, &g, first, sector);
    }
    (conn, g, vq)
}

/// A restarted daemon handed a region full of garbage around three real
/// requests in flight resubmits those three, each answered once, in
/// counter order, ignores the heads its ring cannot have, and goes on
/// taking the guest's requests. It used to resume the ring two requests
/// too far (for the heads past the ring) and to overflow the u64::MAX
/// counter on the next request (a panic in a debug build).
#[test]
fn garbage_in_the_inflight_region() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let (conn, g, mut vq) = restarted_with(&d, &garbage_log(MAX_QUEUE_SIZE));
    // The rings as the guest left them: heads 0, 4, 8 made available and
    // taken by the previous daemon, nothing used yet.
    vq.publish(&g, &[0, 4, 8]);
    vq.attach(&conn, &g, 0, true);
    let used = vq.take_used(&g, 3, Duration::from_secs(10));
    assert_eq!(used, vec![(8, 1), (4, 1), (0, 1)], "oldest counter first");
    for first in [0u16, 4, 8] {
        let at = 0x20_0000 + 0x1_0000 * u64::from(first);
        assert_eq!(g.byte(at + 0x3000), 0, "status of head {first}");
    }
    // The guest's next request (avail entry 3) is taken, and answered once.
    write_chain(&vq, &g, 12, 24);
    vq.publish(&g, &[12]);
    assert_eq!(vq.one_used(&g), (12, 1), "the request after recovery");
    assert_eq!(vq.take_used(&g, 1, Duration::from_millis(200)), vec![]);
    assert_eq!(d.read_image(24 * 512, 4096), vec![12u8; 4096]);
    d.assert_running();
    drop(conn);
    assert_serves(&mut d, "a garbage inflight region", 8192, 1);
}

/// A daemon killed while draining leaves kicks off in guest memory
/// (`avail_event` behind, or NO_NOTIFY), so the guest adds requests
/// without kicking, and QEMU does not kick a ring it hands to the next
/// daemon. That daemon must still resubmit what the region names and take
/// what was added meanwhile, with no kick at all: here two requests in
/// flight and one added after the kill. (vhost-user-backend runs each ring
/// once when SET_VRING_ENABLE enables it; this holds us to it.)
#[test]
fn a_restarted_daemon_does_not_wait_for_a_kick() {
    let mut d = Daemon::start(64 * MIB, &[]);
    let mut log = vec![0u8; queue_region_size(MAX_QUEUE_SIZE)];
    log[8..10].copy_from_slice(&1u16.to_le_bytes()); // version
    for (h, counter) in [(0u16, 1u64), (4, 2)] {
        let at = 16 + 16 * usize::from(h);
        log[at] = 1;
        log[at + 8..at + 16].copy_from_slice(&counter.to_le_bytes());
    }
    let (conn, g, mut vq) = restarted_with(&d, &log);
    // Heads 0 and 4 were taken by the killed daemon; 8 came after.
    vq.publish_without_kick(&g, &[0, 4, 8]);
    vq.attach(&conn, &g, 2, true);
    let mut used = vq.take_used(&g, 3, Duration::from_secs(10));
    used.sort_unstable();
    assert_eq!(
        used,
        vec![(0, 1), (4, 1), (8, 1)],
        "every request answered once"
    );
    for (first, sector) in [(0u16, 0u64), (4, 8), (8, 16)] {
        let at = 0x20_0000 + 0x1_0000 * u64::from(first);
        assert_eq!(g.byte(at + 0x3000), 0, "status of head {first}");
        assert_eq!(d.read_image(sector * 512, 4096), vec![first as u8; 4096]);
    }
    d.assert_running();
    drop(conn);
    assert_serves(&mut d, "a ring started without a kick", 8192, 1);
}
