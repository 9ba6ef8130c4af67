//! The inflight region (INFLIGHT_SHMFD) is the front-end's memory: a
//! restarted daemon reads it to learn what to resubmit, and nothing in it
//! may crash the daemon or make it lose a request. Over a real socket, a
//! front-end hands over regions that do not fit the device.

mod common;
mod frontend;

use std::os::fd::AsRawFd;

use common::{Daemon, MIB};
use frontend::*;
use ringblk::vhost::inflight::queue_region_size;

/// The daemon's default maximum queue size.
const MAX_QUEUE_SIZE: u16 = 256;

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
