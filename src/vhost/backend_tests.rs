//! The backend over real workers: what reaches them, and how queues map
//! onto threads and event ids.

use std::sync::Arc;

use vhost_user_backend::VhostUserBackend;
use virtio_bindings::virtio_blk::VIRTIO_BLK_T_GET_ID;
use virtio_queue::QueueT;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestRegionMmap, MmapRegion};

use super::{BlkBackend, ExitEvents, Listener};
use crate::engine::{Core, NullEngine};
use crate::queue::worker::tests::rig;
use crate::queue::{Event, QueueWorker, Settings, Timer};
use crate::virtio::testing::{HDR, guest_memory, r, w};

/// vhost-user-backend swaps a new memory table into the shared
/// `GuestMemoryAtomic` before the device may refuse it. A refused table
/// (here: a region past the end of its file, which would SIGBUS when
/// touched) must never reach a worker: a request pointing into it is
/// refused as outside guest memory, not served.
#[test]
fn a_refused_memory_table_never_reaches_the_workers() {
    const BAD: u64 = 0x100_0000;
    let mem = guest_memory();
    let rig = rig(&mem);
    let backend = BlkBackend::new(
        rig.device.clone(),
        vec![rig.worker],
        1,
        Arc::new(ExitEvents::new(1).unwrap()),
    );
    backend.update_memory(rig.atomic.clone()).unwrap();
    // One page of file behind a 1 MiB region.
    let short = tempfile::tempfile().unwrap();
    short.set_len(4096).unwrap();
    let region = MmapRegion::from_file(FileOffset::new(short, 0), 1 << 20).unwrap();
    let region = GuestRegionMmap::new(region, GuestAddress(BAD)).unwrap();
    let bad = mem.insert_region(Arc::new(region)).unwrap();
    // What the crate does: the new table is live before the device says no.
    rig.atomic.lock().unwrap().replace(bad);
    let e = backend.update_memory(rig.atomic.clone()).unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");

    // A GET_ID whose buffer and status byte lie past the file's end.
    let mut driver = rig.driver;
    driver.header_at(HDR, VIRTIO_BLK_T_GET_ID, 0);
    driver.post_at(0, &[r(HDR, 16), w(BAD + 0x2000, 20), w(BAD + 0x3000, 1)]);
    backend.with_worker(0, |w| w.handle_event(&rig.vring, Event::Kick));
    assert_eq!(driver.used_idx(), 1, "the request was not answered");
    let used = driver.queue.used_ring() + 4;
    let len: u32 = mem.read_obj(GuestAddress(used + 4)).unwrap();
    assert_eq!(len, 0, "answered without a status byte it could write");
}

/// Five queues on two threads: queue q on thread q % 2, and every
/// listener id is past the crate's and names its local queue and kind.
#[test]
fn queues_map_onto_threads_and_listener_ids_round_trip() {
    let mem = guest_memory();
    let device = rig(&mem).device;
    let workers = (0..5)
        .map(|_| {
            let s = Settings::default();
            QueueWorker::new(
                device.clone(),
                s,
                Arc::default(),
                Core::new(NullEngine::new(4), device.clone()),
                Arc::new(Timer::new().unwrap()),
                None,
            )
        })
        .collect();
    let b = BlkBackend::new(device, workers, 2, Arc::new(ExitEvents::new(2).unwrap()));
    assert_eq!(b.queues_per_thread(), vec![0b10101, 0b01010]);
    assert_eq!(b.thread_queues(1).collect::<Vec<_>>(), vec![1, 3]);
    assert!(b.shares_threads());
    for local in 0..3 {
        for kind in Listener::ALL {
            let id = b.listener_id(local, kind);
            // The crate's ids are 0..=num_queues.
            assert!(id > 5, "{id}");
            assert_eq!(b.listener(id as u16), Some((local, kind)));
        }
    }
    assert_eq!(b.listener(5), None);
}
