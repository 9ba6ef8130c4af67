//! The worker over a real io_uring and the inflight log, driven through a
//! mock split queue: what a crash leaves behind and what a restart does
//! with it.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use vhost_user_backend::VringT;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::cli::{EngineKind, NotifyMode, SignalMode};
use crate::vhost::inflight::{InflightQueue, InflightRegion};
use crate::virtio::testing::{DATA, Driver, HDR, STATUS, guest_memory, limits, r, w};

const QSIZE: u16 = 16;

struct Rig<'a> {
    driver: Driver<'a>,
    vring: Vring,
    worker: QueueWorker,
    image: std::fs::File,
    region: Arc<InflightRegion>,
    _call: EventFd,
}

fn rig(mem: &GuestMem) -> Rig<'_> {
    let driver = Driver::new(mem, QSIZE);
    let atomic = GuestMemoryAtomic::new(mem.clone());
    let vring = Vring::new(atomic.clone(), QSIZE).unwrap();
    vring.set_queue_size(QSIZE);
    vring
        .get_mut()
        .set_queue_info(
            driver.mock.desc_table_addr().0,
            driver.mock.avail_addr().0,
            driver.queue.used_ring(),
        )
        .unwrap();
    vring.set_queue_ready(true);
    vring.set_enabled(true);
    let call = EventFd::new(0).unwrap();
    let dup = call.try_clone().unwrap();
    // SAFETY: the fd is a fresh duplicate we own; the File takes it over.
    vring.set_call(Some(unsafe {
        std::fs::File::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(dup))
    }));

    let image = tempfile::tempfile().unwrap();
    image.set_len(1 << 30).unwrap();
    let cfg = Arc::new(WorkerConfig {
        limits: limits(),
        serial: *b"worker-test-serial\0\0",
        engine: EngineKind::Uring,
        notify: NotifyMode::Batched,
        signal: SignalMode::Early,
        poll_us: 0,
        sqpoll: false,
        iopoll: false,
        fixed_buffers: false,
        uring_cmd: true,
        max_batch: 0,
        direct: false,
        dio_align: 512,
        is_block_device: false,
        queue_size: QSIZE,
        writeback: AtomicBool::new(true),
        stopping: AtomicBool::new(false),
    });
    let mut worker = QueueWorker::new(cfg, Arc::default(), image.as_raw_fd(), None).unwrap();
    worker.set_memory(atomic);
    let region = Arc::new(InflightRegion::create(1, QSIZE).unwrap());
    Rig {
        driver,
        vring,
        worker,
        image,
        region,
        _call: call,
    }
}

impl Rig<'_> {
    /// Runs the worker until the used ring reaches `idx`.
    fn complete_until(&mut self, idx: u16) {
        let deadline = Instant::now() + Duration::from_secs(5);
        self.worker.handle_event(&self.vring, true);
        while self.driver.used_idx() != idx {
            assert!(
                Instant::now() < deadline,
                "used->idx stuck at {}",
                self.driver.used_idx()
            );
            std::thread::sleep(Duration::from_millis(1));
            self.worker.handle_event(&self.vring, false);
        }
    }

    /// Posts a one-segment write or read of 4 KiB at `sector` from/into
    /// `data`, using table slots `first..first + 3`.
    fn post_rw(&mut self, first: u16, write: bool, sector: u64, data: u64) -> u16 {
        let hdr = HDR + 0x100 * u64::from(first);
        let status = STATUS + u64::from(first);
        let t = if write {
            VIRTIO_BLK_T_OUT
        } else {
            VIRTIO_BLK_T_IN
        };
        self.driver.header_at(hdr, t, sector);
        let buf = if write { r(data, 4096) } else { w(data, 4096) };
        self.driver.post_at(first, &[r(hdr, 16), buf, w(status, 1)])
    }

    fn status(&self, first: u16) -> u8 {
        self.driver
            .mem
            .read_obj(GuestAddress(STATUS + u64::from(first)))
            .unwrap()
    }

    fn image_at(&self, offset: u64, len: usize) -> Vec<u8> {
        use std::io::{Seek, SeekFrom};
        let mut f = &self.image;
        f.seek(SeekFrom::Start(offset)).unwrap();
        let mut v = vec![0u8; len];
        f.read_exact(&mut v).unwrap();
        v
    }
}

/// Every request, however it completes (I/O, inline GET_ID, refused),
/// leaves the inflight log once its used element is published.
#[test]
fn every_completed_request_leaves_the_inflight_log() {
    let mem = guest_memory();
    let mut rig = rig(&mem);
    rig.worker
        .set_inflight(InflightQueue::new(rig.region.clone(), 0));
    mem.write_slice(&[0x5a; 4096], GuestAddress(DATA)).unwrap();
    rig.post_rw(0, true, 8, DATA);
    rig.driver.header_at(HDR + 0x300, VIRTIO_BLK_T_GET_ID, 0);
    rig.driver.post_at(
        3,
        &[r(HDR + 0x300, 16), w(DATA + 0x2000, 20), w(STATUS + 3, 1)],
    );
    rig.driver.header_at(HDR + 0x600, 0x77, 0);
    rig.driver
        .post_at(6, &[r(HDR + 0x600, 16), w(STATUS + 6, 1)]);
    rig.complete_until(3);
    assert_eq!((rig.status(0), rig.status(3), rig.status(6)), (0, 0, 2));
    assert_eq!(rig.image_at(8 * 512, 4096), vec![0x5a; 4096]);
    // Each was logged when popped, in pop order...
    let logged: Vec<u64> = [0, 3, 6].map(|h| rig.region.logged_counter(0, h)).to_vec();
    assert_eq!(logged, vec![1, 2, 3]);
    // ...and none is left for a restart to redo.
    let mut after = InflightQueue::new(rig.region.clone(), 0).unwrap();
    assert_eq!(after.recover(3).resubmit, Vec::<u16>::new());
}

/// A restarted back-end finds requests its predecessor took and did not
/// finish, runs them, and goes on from the right avail index.
#[test]
fn a_restart_resubmits_what_was_in_flight() {
    let mem = guest_memory();
    let mut rig = rig(&mem);
    // The previous back-end: popped three writes (heads 0, 3, 6), in this
    // order, and crashed before any completed. used->idx is still 0, and
    // the front-end hands the ring back with next_avail = used->idx = 0.
    let mut old = InflightQueue::new(rig.region.clone(), 0).unwrap();
    old.recover(0);
    for (i, head) in [0u16, 3, 6].into_iter().enumerate() {
        let data = DATA + 0x1000 * i as u64;
        mem.write_slice(&[0x10 + i as u8; 4096], GuestAddress(data))
            .unwrap();
        assert_eq!(rig.post_rw(head, true, 64 + 8 * i as u64, data), head);
        old.mark(head);
    }
    rig.worker
        .set_inflight(InflightQueue::new(rig.region.clone(), 0));
    rig.complete_until(3);
    for (i, head) in [0u16, 3, 6].into_iter().enumerate() {
        assert_eq!(rig.status(head), 0, "write {i}");
        assert_eq!(
            rig.image_at((64 + 8 * i as u64) * 512, 4096),
            vec![0x10 + i as u8; 4096]
        );
    }
    // The ring resumes after them: a new read is request 4, not a replay.
    rig.post_rw(9, false, 72, DATA + 0x8000);
    rig.complete_until(4);
    assert_eq!(rig.status(9), 0);
    let mut got = [0u8; 4096];
    mem.read_slice(&mut got, GuestAddress(DATA + 0x8000))
        .unwrap();
    assert_eq!(got, [0x11; 4096]);
    assert_eq!(rig.driver.used_idx(), 4, "no request ran twice");
    let mut after = InflightQueue::new(rig.region.clone(), 0).unwrap();
    assert_eq!(after.recover(4).resubmit, Vec::<u16>::new());
}
