//! A daemon can publish a used element and die before it writes the call
//! eventfd. The guest then has a completion on its used ring and no
//! interrupt for it; the next daemon finds nothing in flight. Unless that
//! daemon signals each ring once when the ring starts, the guest waits
//! forever (libvhost-user signals a newly installed call fd "in case of
//! I/O hang after reconnecting" for the same reason).
//!
//! The test front-end (`frontend`) reads used->idx from memory and never
//! looks at the first daemon's call eventfd, which is what a lost interrupt
//! looks like from the guest's side. The second daemon gets the rings as
//! they are, with a fresh call eventfd, and no kick and no new request.

use std::time::{Duration, Instant};

use ringblk::virtio::chain_writer::{readable as r, writable as w};
use ringblk_testkit::frontend::{Conn, Guest, Vq};
use ringblk_testkit::{Daemon, DaemonOptions, MIB, sparse_image, test_dir};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

const RING: u64 = 0x10_0000;
const HDR: u64 = 0x20_0000;
const DATA: u64 = 0x20_1000;
const STATUS: u64 = 0x20_3000;
const VIRTIO_BLK_T_OUT: u32 = 1;
const QUEUE_SIZE: u16 = 64;

/// Whether `call` is written within `within`.
fn fires(call: &EventFd, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if call.read().is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// Posts a 4 KiB write at `sector` on `vq` (head 0).
fn post_write(vq: &mut Vq, g: &Guest, sector: u64) {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&VIRTIO_BLK_T_OUT.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    g.write(HDR, &h);
    g.write(DATA, &[0x5a; 4096]);
    g.write(STATUS, &[0xff]);
    vq.post(g, &[r(HDR, 16), r(DATA, 4096), w(STATUS, 1)]);
}

fn connect(d: &Daemon, g: &Guest) -> Conn {
    let conn = Conn::connect(&d.socket);
    conn.handshake(0);
    g.share(&conn);
    conn
}

#[test]
fn a_completion_whose_interrupt_was_lost_is_signalled_by_the_next_daemon() {
    let dir = test_dir();
    let image = sparse_image(dir.path(), "disk.img", 16 * MIB);
    let start = || {
        Daemon::start_in(
            dir.path(),
            DaemonOptions {
                image: Some(image.clone()),
                ..DaemonOptions::default()
            },
        )
    };
    // QEMU installs the call fd before the kick; other front-ends may not.
    for call_first in [true, false] {
        let what = if call_first {
            "call, kick"
        } else {
            "kick, call"
        };
        let g = Guest::new();
        let mut first = start();
        let conn = connect(&first, &g);
        let mut vq = Vq::new(0, QUEUE_SIZE, RING);
        vq.setup(&conn, &g);
        post_write(&mut vq, &g, 8);
        // The completion is published; its interrupt is never looked at.
        let deadline = Instant::now() + Duration::from_secs(10);
        while vq.used_idx(&g) != 1 {
            assert!(
                Instant::now() < deadline,
                "{what}: the write never completed"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(g.byte(STATUS), 0, "{what}: status of the write");
        first.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
        drop(conn);

        let mut second = start();
        let conn = connect(&second, &g);
        vq.call = EventFd::new(EFD_NONBLOCK).expect("call eventfd");
        vq.attach(&conn, &g, 1, call_first);
        assert!(
            fires(&vq.call, Duration::from_secs(5)),
            "{what}: the restarted daemon never signalled the completion already on the used ring"
        );
        // That completion is the one the guest sees; then service goes on.
        assert_eq!(vq.take_used(&g, 1, Duration::ZERO), vec![(0, 1)], "{what}");
        post_write(&mut vq, &g, 16);
        assert_eq!(vq.one_used(&g), (0, 1), "{what}: a write after the restart");
        assert_eq!(g.byte(STATUS), 0, "{what}: status after the restart");
        second.assert_running();
    }
}
