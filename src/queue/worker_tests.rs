//! The worker over a real io_uring and the inflight log, driven through a
//! mock split queue: what a crash leaves behind and what a restart does
//! with it.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vhost_user_backend::VringT;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::device::{Device, DeviceSpec};
use crate::engine::{Completions, Core, Engine, UringConfig, UringEngine};
use crate::queue::Timer;
use crate::queue::inflight::{InflightQueue, InflightRegion};
use crate::virtio::testing::{self, DATA, Driver, HDR, STATUS, guest_memory, limits, r, w};

const QSIZE: u16 = 16;

pub(crate) struct Rig<'a> {
    pub(crate) device: Arc<Device>,
    pub(crate) atomic: GuestMemoryAtomic<GuestMem>,
    pub(crate) driver: Driver<'a>,
    pub(crate) vring: Vring,
    pub(crate) worker: QueueWorker<UringEngine>,
    image: std::fs::File,
    region: Arc<InflightRegion>,
    _call: EventFd,
}

/// A worker over a real io_uring on a 1 GiB temporary image, its ring set
/// up on `mem` by a mock driver.
pub(crate) fn rig(mem: &GuestMem) -> Rig<'_> {
    let image = tempfile::tempfile().unwrap();
    image.set_len(1 << 30).unwrap();
    rig_with(mem, QSIZE, image)
}

/// A rig whose worker is configured for queues of at most `max_queue`
/// (its engine has room for that many requests) over `image`.
fn rig_with(mem: &GuestMem, max_queue: u16, image: std::fs::File) -> Rig<'_> {
    rig_with_lock(mem, max_queue, image, None)
}

/// [`rig_with`], for a device whose image lock is `image_lock`.
fn rig_with_lock(
    mem: &GuestMem,
    max_queue: u16,
    image: std::fs::File,
    image_lock: Option<crate::io::ImageLock>,
) -> Rig<'_> {
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

    let device = Arc::new(
        Device::new(DeviceSpec {
            limits: limits(),
            capacity_sectors: testing::CAPACITY,
            queue_size: max_queue,
            serial: *b"worker-test-serial\0\0",
            image_lock,
            ..DeviceSpec::default()
        })
        .unwrap(),
    );
    let metrics: Arc<QueueMetrics> = Arc::default();
    let engine = UringEngine::new(
        UringConfig {
            image_fd: image.as_raw_fd(),
            backing_fds: Vec::new(),
            file_slots: 1,
            entries: u32::from(max_queue).next_power_of_two(),
            sqpoll: false,
            iopoll: false,
            fixed_buffers: false,
            uring_cmd: true,
            direct: false,
            dio_align: 512,
            bounce_limit: 1 << 20,
            is_block_device: false,
        },
        metrics.clone(),
    )
    .unwrap();
    let core = Core::new(engine, device.clone());
    let timer = Arc::new(Timer::new().unwrap());
    let mut worker = QueueWorker::new(
        device.clone(),
        Settings::default(),
        metrics,
        core,
        timer,
        None,
    );
    worker.set_memory(Arc::new(mem.clone()));
    let region = Arc::new(InflightRegion::create(1, QSIZE).unwrap());
    Rig {
        device,
        atomic,
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
        self.worker.handle_event(&self.vring, Event::Kick);
        while self.driver.used_idx() != idx {
            assert!(
                Instant::now() < deadline,
                "used->idx stuck at {}",
                self.driver.used_idx()
            );
            std::thread::sleep(Duration::from_millis(1));
            self.worker.handle_event(&self.vring, Event::Completion);
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
    assert_eq!(after.recover(3, QSIZE).resubmit, Vec::<u16>::new());
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
    old.recover(0, QSIZE);
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
    assert_eq!(after.recover(4, QSIZE).resubmit, Vec::<u16>::new());
}

/// Requests a restart must resubmit can outnumber what the engine takes at
/// once. Each one left over waits its turn with the memory it was parsed
/// against, and none is lost (one deferred slot used to keep only the last).
#[test]
fn resubmitted_requests_beyond_the_engine_room_all_complete() {
    let mem = guest_memory();
    let image = tempfile::tempfile().unwrap();
    image.set_len(1 << 30).unwrap();
    // An engine with room for 2; 5 requests to resubmit (3 slots each).
    let mut rig = rig_with(&mem, 2, image);
    let mut old = InflightQueue::new(rig.region.clone(), 0).unwrap();
    old.recover(0, QSIZE);
    let heads: Vec<u16> = (0..5).map(|i| i * 3).collect();
    for (i, &head) in heads.iter().enumerate() {
        let data = DATA + 0x1000 * i as u64;
        mem.write_slice(&[0x20 + i as u8; 4096], GuestAddress(data))
            .unwrap();
        rig.post_rw(head, true, 8 * i as u64, data);
        old.mark(head);
    }
    rig.worker
        .set_inflight(InflightQueue::new(rig.region.clone(), 0));
    rig.complete_until(5);
    for (i, &head) in heads.iter().enumerate() {
        assert_eq!(rig.status(head), 0, "request {i}");
        assert!(
            rig.image_at(8 * 512 * i as u64, 4096) == vec![0x20 + i as u8; 4096],
            "request {i} is not in the image"
        );
    }
}

/// Once the connection is over (`drain` at disconnect), a late kick must
/// not start the ring again: requests it took would still be in flight
/// when the worker is dropped.
#[test]
fn after_the_drain_at_disconnect_a_kick_takes_nothing() {
    let mem = guest_memory();
    let mut rig = rig(&mem);
    rig.post_rw(0, true, 8, DATA);
    rig.complete_until(1);
    rig.worker.drain();
    mem.write_obj(0xffu8, GuestAddress(STATUS + 3)).unwrap();
    rig.post_rw(3, true, 16, DATA);
    rig.worker.handle_event(&rig.vring, Event::Kick);
    std::thread::sleep(Duration::from_millis(50));
    rig.worker.handle_event(&rig.vring, Event::Completion);
    assert_eq!(
        rig.driver.used_idx(),
        1,
        "a request was taken after the drain"
    );
    assert_eq!(rig.status(3), 0xff, "a request was served after the drain");
}

/// A worker dropped while the kernel still owns a request's buffers waits
/// for that request: it must not free the buffers (or close the ring) under
/// io_uring. The image is a pipe, so the read stays in flight until the
/// test writes into it.
#[test]
fn dropping_a_worker_waits_for_its_io_in_flight() {
    let mem = guest_memory();
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two descriptors pipe(2) returns.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: pipe(2) just returned these fds; each File takes one over.
    let (rd, wr) = unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    };
    let mut rig = rig_with(&mem, QSIZE, rd);
    mem.write_slice(&[0u8; 4096], GuestAddress(DATA)).unwrap();
    rig.post_rw(0, false, 0, DATA);
    rig.worker.handle_event(&rig.vring, Event::Kick);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(rig.driver.used_idx(), 0, "the read cannot have completed");
    let worker = rig.worker;
    let dropped = std::thread::spawn(move || drop(worker));
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !dropped.is_finished(),
        "the worker was dropped with a read in flight"
    );
    (&wr).write_all(&[0x77; 4096]).unwrap();
    dropped.join().unwrap();
    let mut got = [0u8; 4096];
    mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert_eq!(got, [0x77; 4096], "the read landed where it was sent");
}

/// Every reaped completion is finished (status byte written, counted) even
/// when the used ring cannot take one of them: a failure on one request
/// used to drop the rest of the batch.
#[test]
fn a_used_ring_failure_does_not_lose_the_other_completions() {
    let mem = guest_memory();
    let mut rig = rig(&mem);
    // A used ring with room for one element before guest memory ends.
    let used = testing::A_END - 4 - 8;
    rig.vring
        .get_mut()
        .set_queue_info(
            rig.driver.mock.desc_table_addr().0,
            rig.driver.mock.avail_addr().0,
            used,
        )
        .unwrap();
    for (i, head) in [0u16, 3, 6].into_iter().enumerate() {
        mem.write_obj(0xffu8, GuestAddress(STATUS + u64::from(head)))
            .unwrap();
        rig.post_rw(head, true, 8 * i as u64, DATA);
    }
    rig.worker.handle_event(&rig.vring, Event::Kick);
    rig.worker.drain();
    for head in [0u16, 3, 6] {
        assert_eq!(rig.status(head), 0, "request {head} never finished");
    }
    let done = rig.worker.metrics.requests[RequestType::Write as usize].load(Ordering::Relaxed);
    assert_eq!(done, 3, "writes counted as done");
}

/// A disabled ring (SET_VRING_ENABLE 0) is not processed: a completion
/// event finishes what is in flight but takes nothing new off the ring.
#[test]
fn a_disabled_ring_takes_no_requests() {
    let mem = guest_memory();
    let mut rig = rig(&mem);
    rig.post_rw(0, true, 8, DATA);
    rig.complete_until(1);
    rig.vring.set_enabled(false);
    rig.post_rw(3, true, 16, DATA);
    rig.worker.handle_event(&rig.vring, Event::Completion);
    std::thread::sleep(Duration::from_millis(50));
    rig.worker.handle_event(&rig.vring, Event::Completion);
    assert_eq!(rig.driver.used_idx(), 1, "a disabled ring was processed");
    // Enabled again, the request is served.
    rig.vring.set_enabled(true);
    rig.complete_until(2);
    assert_eq!(rig.status(3), 0);
}

/// Requests resubmitted after a restart are parsed against guest memory
/// only. The replay avail ring that recovery builds used to live in a page
/// mapped right above guest memory, and parsing against that memory let
/// their buffers address it: a write from there put the daemon's own page
/// on the disk. Now that page is in a hole of guest memory, visible only
/// while the heads are popped, and neither address is a buffer.
#[test]
fn resubmitted_requests_cannot_address_the_replay_ring() {
    let mem = guest_memory();
    let mut rig = rig(&mem);
    let mut old = InflightQueue::new(rig.region.clone(), 0).unwrap();
    old.recover(0, QSIZE);
    mem.write_slice(&[0x5a; 4096], GuestAddress(DATA)).unwrap();
    // Data where the ring was (above guest memory), where it is now (the
    // hole after region A), and in guest memory.
    let cases = [(0u16, testing::C_END), (3, testing::A_END), (6, DATA)];
    for (head, data) in cases {
        mem.write_obj(0xffu8, GuestAddress(STATUS + u64::from(head)))
            .unwrap();
        rig.post_rw(head, true, 8 * u64::from(head), data);
        old.mark(head);
    }
    rig.worker
        .set_inflight(InflightQueue::new(rig.region.clone(), 0));
    rig.complete_until(3);
    let statuses = cases.map(|(head, _)| rig.status(head));
    assert_eq!(statuses, [1, 1, 0], "IOERR, IOERR, OK");
    assert_eq!(
        rig.image_at(0, 4096),
        vec![0; 4096],
        "written from the ring"
    );
    assert_eq!(rig.image_at(3 * 8 * 512, 4096), vec![0; 4096]);
    assert_eq!(rig.image_at(6 * 8 * 512, 4096), vec![0x5a; 4096]);
}

/// With guest memory up to the top of the address space there was no
/// room above it for the replay ring: the requests to resubmit were
/// dropped unanswered, after the avail ring had been moved past them.
#[test]
fn resubmission_with_guest_memory_at_the_top_of_the_address_space() {
    use testing::{A_END, B, C, C_END};
    let mem = GuestMem::from_ranges(&[
        (GuestAddress(0), A_END as usize),
        (GuestAddress(B), (C - B) as usize),
        (GuestAddress(C), (C_END - C) as usize),
        (GuestAddress(u64::MAX - 0x1fff), 0x1000),
    ])
    .unwrap();
    let mut rig = rig(&mem);
    let mut old = InflightQueue::new(rig.region.clone(), 0).unwrap();
    old.recover(0, QSIZE);
    for head in [0u16, 3] {
        mem.write_obj(0xffu8, GuestAddress(STATUS + u64::from(head)))
            .unwrap();
        rig.post_rw(head, true, 8 * u64::from(head), DATA);
        old.mark(head);
    }
    rig.worker
        .set_inflight(InflightQueue::new(rig.region.clone(), 0));
    rig.complete_until(2);
    assert_eq!((rig.status(0), rig.status(3)), (0, 0));
}

/// A log naming a head the ring cannot have (the region is laid out for
/// larger queues, and holds garbage): it used to count towards the
/// requests the previous back-end took, so the ring resumed one too far
/// and the guest's next request was never taken. Now that head is
/// ignored, and every other one is answered exactly once.
#[test]
fn a_logged_head_beyond_the_ring_is_ignored() {
    let mem = guest_memory();
    let mut rig = rig(&mem);
    let region = Arc::new(InflightRegion::create(1, 4 * QSIZE).unwrap());
    let mut old = InflightQueue::new(region.clone(), 0).unwrap();
    old.recover(0, QSIZE);
    rig.post_rw(3, true, 8, DATA);
    old.mark(3);
    old.mark(3 * QSIZE);
    rig.worker.set_inflight(InflightQueue::new(region, 0));
    rig.complete_until(1);
    assert_eq!(rig.driver.used_elem(0), (3, 1));
    // The guest's next request is taken.
    rig.post_rw(6, false, 8, DATA + 0x4000);
    rig.complete_until(2);
    assert_eq!(rig.driver.used_elem(1), (6, 4097));
}

/// A region laid out for smaller queues than the ring cannot log every
/// head (marks beyond it were silently lost, so a crash lost those
/// requests): the worker does not use it for that ring.
#[test]
fn a_region_smaller_than_the_ring_is_not_used() {
    let mem = guest_memory();
    let mut rig = rig(&mem);
    let region = Arc::new(InflightRegion::create(1, QSIZE / 2).unwrap());
    rig.worker
        .set_inflight(InflightQueue::new(region.clone(), 0));
    rig.post_rw(3, true, 8, DATA);
    rig.complete_until(1);
    assert_eq!(rig.status(3), 0);
    assert_eq!(
        region.logged_counter(0, 3),
        0,
        "logged in a region too small"
    );
}

/// A closed loop of 4 KiB reads, each in its own three table slots, kept
/// `depth` deep on the rig's ring; the worker is driven from its
/// completion and QoS timer fds, as the queue thread's epoll does.
struct ClosedLoop {
    depth: u16,
    seen: u16,
    /// When each request completed.
    done: Vec<Instant>,
    /// Times the worker was woken (kick, completion or timer).
    wakeups: u64,
}

impl ClosedLoop {
    fn start(rig: &mut Rig<'_>, depth: u16) -> ClosedLoop {
        assert!(depth * 3 <= QSIZE);
        for i in 0..depth {
            rig.post_rw(3 * i, false, 8 * u64::from(i), DATA + 0x1000 * u64::from(i));
        }
        rig.worker.handle_event(&rig.vring, Event::Kick);
        ClosedLoop {
            depth,
            seen: 0,
            done: Vec::new(),
            wakeups: 1,
        }
    }

    /// Keeps the loop going until `until`.
    fn run(&mut self, rig: &mut Rig<'_>, until: Instant) {
        let fds = [
            rig.worker.completion_fd().expect("io_uring has an eventfd"),
            rig.worker.timer_fd(),
        ];
        while Instant::now() < until {
            let mut p = fds.map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            });
            // SAFETY: two valid pollfds on our stack.
            let n = unsafe { libc::poll(p.as_mut_ptr(), 2, 10) };
            assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
            if p[1].revents != 0 {
                self.wakeups += 1;
                rig.worker.handle_event(&rig.vring, Event::Timer);
            }
            if p[0].revents != 0 {
                self.wakeups += 1;
                rig.worker.handle_event(&rig.vring, Event::Completion);
            }
            self.repost(rig, until);
        }
    }

    /// Posts a new read in the slots of each one that completed, until
    /// none completes inline any more (page-cache hits complete inside the
    /// submit, and ring no eventfd).
    fn repost(&mut self, rig: &mut Rig<'_>, until: Instant) {
        while Instant::now() < until {
            let used = rig.driver.used_idx();
            if used == self.seen {
                return;
            }
            self.repost_done(rig, used);
        }
    }

    fn repost_done(&mut self, rig: &mut Rig<'_>, used: u16) {
        while self.seen != used {
            let (head, len) = rig.driver.used_elem(self.seen);
            let first = head as u16;
            assert!(
                first.is_multiple_of(3) && first / 3 < self.depth,
                "head {head}"
            );
            assert_eq!(len, 4097, "request {head} failed");
            assert_eq!(rig.status(first), 0, "request {head} status");
            self.done.push(Instant::now());
            rig.post_rw(first, false, 8 * u64::from(first), DATA);
            self.seen = self.seen.wrapping_add(1);
        }
        self.wakeups += 1;
        rig.worker.handle_event(&rig.vring, Event::Kick);
    }

    /// Completions a second in `[from, to)`.
    fn rate(&self, from: Instant, to: Instant) -> f64 {
        let n = self.done.iter().filter(|t| **t >= from && **t < to).count();
        n as f64 / (to - from).as_secs_f64()
    }
}

fn iops(n: u64) -> crate::qos::QosLimits {
    crate::qos::QosLimits {
        iops_total: n,
        ..Default::default()
    }
}

/// Limits changed through the device's handle while requests wait apply
/// within a second, and no request is lost or failed on the way.
#[test]
fn qos_limit_doubled_at_runtime_is_followed_within_a_second() {
    const N: u64 = 200;
    let mem = guest_memory();
    let mut rig = rig(&mem);
    rig.device.qos().set_limits(iops(N)).unwrap();
    let t0 = Instant::now();
    let mut lp = ClosedLoop::start(&mut rig, 4);
    let change = t0 + Duration::from_millis(2000);
    lp.run(&mut rig, change);
    // The burst (a tenth of a second's worth) is in the first 100 ms.
    let before = lp.rate(t0 + Duration::from_millis(500), change);
    rig.device.qos().set_limits(iops(2 * N)).unwrap();
    assert_eq!(rig.device.qos().limits(), iops(2 * N));
    lp.run(&mut rig, change + Duration::from_millis(1000));
    let after = lp.rate(
        change + Duration::from_millis(100),
        change + Duration::from_millis(1000),
    );
    // The test's closed loop runs next to the other unit tests: a late
    // wake-up only lowers a rate, never raises it past the limit. The
    // precise figures are tests/socket/qos.rs's, against a real daemon.
    let n = N as f64;
    assert!(
        before <= 1.1 * n && before >= 0.75 * n,
        "{before:.0} IOPS under a limit of {N}"
    );
    assert!(
        after <= 2.2 * n && after >= 1.5 * n,
        "{after:.0} IOPS in the second after the limit went to {}",
        2 * N
    );
    let m = rig.worker.metrics.snapshot();
    assert!(m.throttled_requests > 0, "{m:?}");
    // Nearly all of the time, some request was waiting for tokens.
    assert!(
        m.throttled_ns > 2_000_000_000,
        "throttled for {} ns of 3 s",
        m.throttled_ns
    );
    // A throttled queue sleeps: a few wake-ups per request, not a spin.
    let requests = lp.done.len() as u64;
    assert!(
        lp.wakeups < 6 * requests + 100,
        "{} wake-ups for {requests} requests",
        lp.wakeups
    );
    // Removing the limit lets the queue run free again.
    rig.device
        .qos()
        .set_limits(crate::qos::QosLimits::default())
        .unwrap();
    let t1 = Instant::now();
    lp.run(&mut rig, t1 + Duration::from_millis(300));
    let free = lp.rate(
        t1 + Duration::from_millis(150),
        t1 + Duration::from_millis(300),
    );
    assert!(
        free > 4.0 * n,
        "{free:.0} IOPS: still throttled after the limits were removed"
    );
}

/// GET_VRING_BASE (`stop`) must not wait behind throttling: requests the
/// worker took and QoS holds are admitted and completed at once, and the
/// inflight journal is empty afterwards.
#[test]
fn qos_stopping_the_ring_completes_throttled_requests_at_once() {
    let mem = guest_memory();
    let mut rig = rig(&mem);
    rig.worker
        .set_inflight(InflightQueue::new(rig.region.clone(), 0));
    // One request a minute: the first goes (the debt model), the rest wait.
    rig.device.qos().set_limits(iops(1)).unwrap();
    for i in 0..4u16 {
        rig.post_rw(3 * i, true, 8 * u64::from(i), DATA);
    }
    rig.worker.handle_event(&rig.vring, Event::Kick);
    let deadline = Instant::now() + Duration::from_secs(5);
    while rig.driver.used_idx() < 1 {
        assert!(
            Instant::now() < deadline,
            "the first request never completed"
        );
        std::thread::sleep(Duration::from_millis(1));
        rig.worker.handle_event(&rig.vring, Event::Completion);
    }
    std::thread::sleep(Duration::from_millis(50));
    rig.worker.handle_event(&rig.vring, Event::Completion);
    assert_eq!(rig.driver.used_idx(), 1, "throttled requests went through");
    // Waiting ones are in the journal: a crash now would resubmit them.
    let logged: Vec<u64> = [3, 6, 9].map(|h| rig.region.logged_counter(0, h)).to_vec();
    assert_eq!(logged, vec![2, 3, 4]);
    let t = Instant::now();
    rig.worker.stop();
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "stop waited {:?} behind throttling",
        t.elapsed()
    );
    assert_eq!(rig.driver.used_idx(), 4, "stop left requests behind");
    for i in 0..4u16 {
        assert_eq!(rig.status(3 * i), 0, "request {i}");
    }
    let mut after = InflightQueue::new(rig.region.clone(), 0).unwrap();
    assert_eq!(
        after.recover(4, QSIZE).resubmit,
        Vec::<u16>::new(),
        "the journal still holds requests"
    );
    let m = rig.worker.metrics.snapshot();
    assert_eq!(m.throttled_requests, 1, "{m:?}");
    // Their latency runs from the pop, so it holds the wait for tokens;
    // the first one's does not.
    let w = m.latency.get(RequestType::Write).expect("measured");
    assert_eq!(w.count(), 4);
    assert_eq!(w.count(), m.requests[RequestType::Write as usize]);
    assert!(w.quantile(1.0).unwrap() >= 50_000_000, "{w:?}");
    assert!(w.quantile(0.25).unwrap() < 50_000_000, "{w:?}");
}

/// An engine that says busy-polling does not pay (RBD) gets no poll
/// window whatever `--poll-us` says; one that does not say so gets it.
#[test]
fn no_busy_polling_for_an_engine_where_it_does_not_pay() {
    use crate::engine::NullEngine;

    struct NoPoll(NullEngine);
    impl Engine for NoPoll {
        fn start(&mut self, io: crate::engine::Io) -> crate::engine::Start {
            self.0.start(io)
        }
        fn commit(&mut self) -> std::io::Result<u32> {
            self.0.commit()
        }
        fn reap(&mut self, f: impl FnMut(crate::engine::Io, Status)) -> u32 {
            self.0.reap(f)
        }
        fn room(&self) -> usize {
            self.0.room()
        }
        fn in_flight(&self) -> usize {
            self.0.in_flight()
        }
        fn wait(&mut self) -> std::io::Result<()> {
            self.0.wait()
        }
        fn completions(&self) -> Completions {
            Completions::Signalled {
                fd: -1,
                polling_pays: false,
            }
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.0.flush()
        }
    }

    let mem = guest_memory();
    let device = rig(&mem).device;
    let s = Settings {
        poll_us: 32,
        ..Settings::default()
    };
    let mut polls = QueueWorker::new(
        device.clone(),
        s,
        Arc::default(),
        Core::new(NullEngine::new(4), device.clone()),
        Arc::new(Timer::new().unwrap()),
        None,
    );
    for wait in [Wait::Guest, Wait::Device] {
        assert_eq!(polls.poll.window(wait), Some(Duration::from_micros(32)));
    }
    let mut never = QueueWorker::new(
        device.clone(),
        s,
        Arc::default(),
        Core::new(NoPoll(NullEngine::new(4)), device),
        Arc::new(Timer::new().unwrap()),
        None,
    );
    for wait in [Wait::Guest, Wait::Device] {
        assert_eq!(never.poll.window(wait), None);
    }
    // Not even a probe, however long it slept without a window.
    for _ in 0..2 * crate::queue::poll::PROBE_EVERY {
        never.poll.sleeping(Wait::Guest);
        never.poll.woke_up();
    }
    assert_eq!(never.poll.window(Wait::Guest), None);
}

/// While another process holds the image lock, a starting ring's requests
/// wait for it at the head of the queue, on the queue's timer: the queue's
/// thread never sleeps (it serves other queues' events too), and the
/// requests run once the lock is free. (The worker used to sleep on the
/// thread for up to three seconds, then fail them.)
#[test]
fn waiting_for_the_image_lock_does_not_sleep_on_the_queue_thread() {
    use crate::io::ImageLock;

    let mem = guest_memory();
    let image = tempfile::tempfile().unwrap();
    image.set_len(1 << 30).unwrap();
    // Another open file description of the same file: its OFD lock is
    // another owner's, as another process's would be.
    let path = format!("/proc/self/fd/{}", image.as_raw_fd());
    let other = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let holder = ImageLock::new(&other, true).unwrap();
    holder.acquire().unwrap();
    let ours = ImageLock::new(&image, true).unwrap();
    let mut rig = rig_with_lock(&mem, QSIZE, image, Some(ours));
    mem.write_slice(&[0x77; 4096], GuestAddress(DATA)).unwrap();
    rig.post_rw(0, true, 8, DATA);

    let t = Instant::now();
    rig.worker.handle_event(&rig.vring, Event::Kick);
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "slept {:?}",
        t.elapsed()
    );
    assert_eq!(rig.driver.used_idx(), 0, "the write waits for the lock");
    let state = || rig.device.image_lock().expect("a lock").state();
    assert_eq!(state(), crate::io::LockState::Waiting);

    holder.release();
    let mut p = libc::pollfd {
        fd: rig.worker.timer_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd on our stack.
    assert_eq!(unsafe { libc::poll(&mut p, 1, 2000) }, 1, "the timer fires");
    rig.worker.handle_event(&rig.vring, Event::Timer);
    rig.complete_until(1);
    assert_eq!(rig.status(0), 0);
    assert_eq!(rig.image_at(8 * 512, 4096), vec![0x77; 4096]);
    let state = || rig.device.image_lock().expect("a lock").state();
    assert_eq!(state(), crate::io::LockState::Held);
    rig.worker.stop();
    assert_eq!(state(), crate::io::LockState::Idle);
}

/// Once the intake is closed (the front-end's socket closed), a kick takes
/// nothing more off the ring, and what was taken before completes.
#[test]
fn a_closed_intake_takes_nothing_new_and_completes_what_it_took() {
    let mem = guest_memory();
    let mut rig = rig(&mem);
    mem.write_slice(&[0x11; 4096], GuestAddress(DATA)).unwrap();
    mem.write_slice(&[0x22; 4096], GuestAddress(DATA + 0x1000))
        .unwrap();
    rig.post_rw(0, true, 8, DATA);
    rig.worker.handle_event(&rig.vring, Event::Kick);
    rig.device.close_intake();
    rig.post_rw(3, true, 16, DATA + 0x1000);
    rig.complete_until(1);
    for _ in 0..20 {
        rig.worker.handle_event(&rig.vring, Event::Kick);
        std::thread::sleep(Duration::from_millis(1));
    }
    rig.worker.drain();
    assert_eq!(rig.driver.used_idx(), 1, "a request posted after the close");
    assert_eq!(rig.status(0), 0);
    assert_eq!(rig.image_at(8 * 512, 4096), vec![0x11; 4096]);
    assert_eq!(rig.image_at(16 * 512, 4096), vec![0; 4096]);
}
