//! The `VhostUserBackend` implementation: the device as vhost-user-backend
//! sees it. The protocol, memory table and vring setup stay in the crate;
//! we supply features, config space, and one worker per queue, spread
//! over the threads (`queues_per_thread`).
//!
//! Event ids in a thread's epoll: the crate numbers the kicks of the
//! thread's queues 0..k-1 (k local queues, by their position in the
//! thread's mask) and takes `num_queues` for its exit event. Ours follow,
//! one per local queue per kind of fd ([`Listener`]).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    EventConsumer, EventFlag, EventNotifier, new_event_consumer_and_notifier,
};

use crate::device::{Connection, Device};
use crate::engine::{Core, Engine};
use crate::metrics::SharedRateLimiter;
use crate::virtio::config::VirtioBlkConfig;
use crate::virtio::{DirtyLog, GuestMem, LogRegion};

use super::relay::InflightHost;
use super::relay::channel::BackendChannel;
use crate::queue::inflight::{InflightQueue, InflightRegion};
use crate::queue::{Event, QueueWorker, Vring};

/// The queue threads' exit events, one per thread, made once for the
/// daemon's life and handed to every connection.
///
/// vhost-user-backend 0.24 asks for an exit event per queue thread per
/// connection, registers its consumer in the thread's epoll with
/// `into_raw_fd()` and never closes it (`VringEpollHandler::new`). A fresh
/// eventfd each time leaks one fd per queue per connection, until a daemon
/// that front-ends reconnect to often enough (a hostile one in seconds)
/// cannot create the next connection's eventfds and io_urings, and exits.
/// Handing over the same consumer fd every time leaks nothing.
pub struct ExitEvents(Vec<(EventConsumer, EventNotifier)>);

impl ExitEvents {
    pub fn new(threads: usize) -> io::Result<ExitEvents> {
        (0..threads)
            .map(|_| new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC))
            .collect::<io::Result<Vec<_>>>()
            .map(ExitEvents)
    }

    /// Thread `i`'s exit event, cleared of a previous connection's exit
    /// request.
    fn get(&self, i: usize) -> Option<(EventConsumer, EventNotifier)> {
        let (consumer, notifier) = self.0.get(i)?;
        // Nonblocking: fails with EAGAIN when nothing is pending.
        let _ = consumer.consume();
        let notifier = notifier.try_clone().ok()?;
        // SAFETY: the fd stays open as long as `self`, which the daemon
        // keeps for its whole life. The crate's only use of this consumer
        // is `into_raw_fd()` to register it in an epoll; it never closes
        // it, so `self` remains the one owner that closes the fd.
        let consumer = unsafe { EventConsumer::from_raw_fd(consumer.as_raw_fd()) };
        Some((consumer, notifier))
    }
}

/// The fds a worker has watched in its thread's epoll next to its kick,
/// each under its own event id ([`BlkBackend::listener_id`]). A new kind
/// is a new variant, at the end of [`Listener::ALL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listener {
    /// The engine's completion eventfd.
    Completion,
    /// The worker's resume eventfd (threads with several queues).
    Resume,
    /// The queue's timerfd (a request waiting for QoS tokens or the
    /// image lock).
    Timer,
}

impl Listener {
    pub const ALL: [Listener; 3] = [Listener::Completion, Listener::Resume, Listener::Timer];

    fn event(self) -> Event {
        match self {
            Listener::Completion => Event::Completion,
            Listener::Resume => Event::Resume,
            Listener::Timer => Event::Timer,
        }
    }
}

pub struct BlkBackend<E: Engine> {
    device: Arc<Device>,
    /// Worker threads: queue q is served by thread q % threads, where it
    /// is local queue q / threads.
    threads: usize,
    /// One per queue; each is locked only by its own worker thread, except
    /// by the protocol thread when the ring is stopped or reset. `None` once
    /// the connection is over and its engine went back to the daemon.
    workers: Vec<Mutex<Option<QueueWorker<E>>>>,
    exit_events: Arc<ExitEvents>,
    /// The back-end request channel, once the front-end handed one over.
    channel: Mutex<Option<Arc<BackendChannel>>>,
    /// The dirty-page log, once the front-end handed one over.
    dirty: Mutex<DirtyState>,
}

/// The front-end's dirty-page log and the regions of the last memory
/// table the device accepted, each of which points at that log. Either may
/// come first (SET_LOG_BASE, answered by the relay, and a table, applied
/// by the crate, run on different threads); whichever comes second
/// attaches the log to the table under this lock. The regions' bitmaps
/// only, not their memory: what maps guest memory must not outlive the
/// requests and tables that use it (`sigbus::release_unused`).
#[derive(Default)]
struct DirtyState {
    log: Option<Arc<LogRegion>>,
    /// Each region's bitmap, its first guest address and its last.
    regions: Vec<(DirtyLog, u64, u64)>,
}

impl DirtyState {
    /// The table the workers are about to get.
    fn set_table(&mut self, mem: &GuestMem) {
        self.regions = mem
            .iter()
            .map(|region| {
                // The mapping's own bitmap (the trait's `bitmap()` is a
                // slice of it).
                let mapping: &vm_memory::MmapRegion<DirtyLog> = region;
                let bitmap = mapping.bitmap().clone();
                (bitmap, region.start_addr().0, region.last_addr().0)
            })
            .collect();
        self.attach();
    }

    /// Points every region of the table at the log (or at none).
    fn attach(&self) {
        for (bitmap, first, _) in &self.regions {
            bitmap.attach(self.log.as_ref(), *first);
        }
        let last = self.regions.iter().map(|&(_, _, last)| last).max();
        let (Some(log), Some(last)) = (&self.log, last) else {
            return;
        };
        if last >= log.covers() {
            // QEMU sizes its log for all of guest memory, and grows it
            // before it adds memory; a front-end that does not loses the
            // marks of the pages past its log's end, nothing more.
            static SHORT: SharedRateLimiter = SharedRateLimiter::new(10, Duration::from_secs(5));
            crate::warn_limited!(
                SHORT,
                "the dirty-page log covers guest memory up to {:#x}, the memory reaches {last:#x}: pages past its end are not logged",
                log.covers()
            );
        }
    }
}

impl<E: Engine> BlkBackend<E> {
    pub fn new(
        device: Arc<Device>,
        workers: Vec<QueueWorker<E>>,
        threads: usize,
        exit_events: Arc<ExitEvents>,
    ) -> BlkBackend<E> {
        BlkBackend {
            device,
            threads: threads.clamp(1, workers.len().max(1)),
            workers: workers.into_iter().map(|w| Mutex::new(Some(w))).collect(),
            exit_events,
            channel: Mutex::new(None),
            dirty: Mutex::default(),
        }
    }

    /// The queues thread `thread` serves, in the order of its mask (their
    /// local indices).
    pub fn thread_queues(&self, thread: usize) -> impl Iterator<Item = usize> + use<E> {
        (thread..self.workers.len()).step_by(self.threads)
    }

    /// Whether a thread serves more than one queue.
    pub fn shares_threads(&self) -> bool {
        self.threads < self.workers.len()
    }

    /// Event id, in its thread's epoll, of local queue `local`'s fd of
    /// kind `kind`: after the crate's (0..=num_queues).
    pub fn listener_id(&self, local: usize, kind: Listener) -> u64 {
        let kinds = Listener::ALL.len();
        (self.workers.len() + 1 + local * kinds + kind as usize) as u64
    }

    /// Queue `queue`'s fd of kind `kind`, if it has one.
    pub fn listener_fd(&self, queue: usize, kind: Listener) -> Option<std::os::fd::RawFd> {
        self.with_worker(queue, |w| match kind {
            Listener::Completion => w.completion_fd(),
            Listener::Resume => w.resume_fd(),
            Listener::Timer => Some(w.timer_fd()),
        })
        .flatten()
    }

    /// The local queue and kind an event id of [`BlkBackend::listener_id`]
    /// names; None for any other id.
    pub(crate) fn listener(&self, id: u16) -> Option<(usize, Listener)> {
        let off = usize::from(id).checked_sub(self.workers.len() + 1)?;
        let kinds = Listener::ALL.len();
        Some((off / kinds, Listener::ALL[off % kinds]))
    }

    /// Runs `f` on worker `i`, unless the connection is over.
    pub fn with_worker<R>(&self, i: usize, f: impl FnOnce(&mut QueueWorker<E>) -> R) -> Option<R> {
        // A poisoned lock means a worker panicked mid-pass; its state is
        // still the best we have, and the daemon must keep serving.
        let mut w = self
            .workers
            .get(i)?
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        w.as_mut().map(f)
    }

    fn each_worker(&self, mut f: impl FnMut(usize, &mut QueueWorker<E>)) {
        for i in 0..self.workers.len() {
            self.with_worker(i, |w| f(i, w));
        }
    }
}

impl<E: Engine> BlkBackend<E> {
    /// The engines (in their cores) back from a finished connection's
    /// workers (each drained
    /// and reset), for the next one. The workers are gone afterwards: an
    /// event that still reaches this device finds none.
    ///
    /// The daemon calls this once the crate's side of the connection is
    /// gone, so the connection's guest memory is then held by nothing but
    /// the SIGBUS table, which unmaps it here.
    pub fn take_cores(&self) -> Vec<Core<E>> {
        let engines = self
            .workers
            .iter()
            .filter_map(|w| w.lock().unwrap_or_else(|p| p.into_inner()).take())
            .map(QueueWorker::into_core)
            .collect();
        super::sigbus::release_unused();
        engines
    }
}

impl<E: Engine> Connection for BlkBackend<E> {
    fn drain_all(&self) {
        self.each_worker(|_, w| w.drain());
    }

    fn quiesce(&self, f: &mut dyn FnMut(std::time::Instant)) {
        // Every worker locked, in order (no other thread locks two), then
        // each settled: none takes a kick, starts a request or runs a pass
        // until the guards go.
        let since = std::time::Instant::now();
        let mut held: Vec<_> = self
            .workers
            .iter()
            .map(|w| w.lock().unwrap_or_else(|p| p.into_inner()))
            .collect();
        for w in held.iter_mut().filter_map(|g| g.as_mut()) {
            w.settle();
        }
        f(since);
    }

    fn config_changed(&self) -> io::Result<Option<bool>> {
        // Cloned out: the answer may take a while, and GET_CONFIG (which
        // the front-end sends before it answers) must not wait for us.
        let channel = self
            .channel
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        channel.map(|c| c.config_changed()).transpose()
    }

    fn close_engines(&self) {
        for w in &self.workers {
            drop(w.lock().unwrap_or_else(|p| p.into_inner()).take());
        }
    }
}

impl<E: Engine + 'static> InflightHost for BlkBackend<E> {
    fn limits(&self) -> (u16, u16) {
        (self.workers.len() as u16, self.device.queue_size())
    }

    fn set_inflight(&self, region: Arc<InflightRegion>) {
        self.each_worker(|i, w| w.set_inflight(InflightQueue::new(region.clone(), i as u16)));
    }

    fn set_backend_channel(&self, channel: BackendChannel) {
        *self.channel.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(channel));
    }

    fn close_intake(&self) {
        self.device.close_intake();
    }

    fn set_log(&self, log: LogRegion) {
        let mut dirty = self.dirty.lock().unwrap_or_else(|p| p.into_inner());
        dirty.log = Some(Arc::new(log));
        dirty.attach();
    }
}

/// Refuses guest memory the daemon cannot touch: a region that runs past
/// the end of its file (a memfd smaller than the region the front-end
/// announces, or an mmap_offset past its end). mmap(2) maps it anyway, and
/// the first access to a page past the end raises SIGBUS, which kills the
/// daemon. Only regular files (memfd, tmpfs, hugetlbfs) have a size to
/// check; a device (/dev/dax) is taken as it is.
///
/// A front-end can still shrink an unsealed file after this check, which
/// crashes the daemon serving it; QEMU's memfd backend seals its memory.
fn check_backing(mem: &GuestMem) -> io::Result<()> {
    for region in mem.iter() {
        let Some(fo) = region.file_offset() else {
            continue;
        };
        let meta = fo.file().metadata()?;
        if !meta.file_type().is_file() {
            continue;
        }
        let end = fo.start().checked_add(region.len());
        if end.is_none_or(|end| end > meta.len()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "guest memory at {:#x} ({} bytes at file offset {}) runs past \
                     the end of its {}-byte file",
                    region.start_addr().0,
                    region.len(),
                    fo.start(),
                    meta.len()
                ),
            ));
        }
    }
    Ok(())
}

impl<E: Engine + 'static> VhostUserBackend for BlkBackend<E> {
    type Bitmap = crate::virtio::DirtyLog;
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.workers.len()
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.device.queue_size())
    }

    fn features(&self) -> u64 {
        self.device.features()
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            | VhostUserVirtioFeatures::LOG_ALL.bits()
    }

    /// LOG_ALL on (a migration) or off again: from now on the workers also
    /// mark what the engines write into guest memory.
    fn acked_features(&self, features: u64) {
        let on = features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0;
        if self.device.set_logging(on) {
            // A front-end can toggle it at will.
            static LOGGING: SharedRateLimiter = SharedRateLimiter::new(10, Duration::from_secs(5));
            crate::info_limited!(
                LOGGING,
                "dirty-page logging {}",
                if on { "on (migration)" } else { "off" }
            );
        }
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            | VhostUserProtocolFeatures::LOG_SHMFD
            | VhostUserProtocolFeatures::BACKEND_REQ
    }

    fn set_event_idx(&self, _enabled: bool) {
        // The crate sets it on each Queue; the worker reads it from there.
    }

    fn reset_device(&self) {
        self.each_worker(|_, w| w.stop());
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        // As it is now: a resize may have changed the capacity, the guest
        // the write cache.
        self.device.config().read(offset, size)
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        // Only `wce` is writable (VIRTIO_BLK_F_CONFIG_WCE).
        if offset as usize != VirtioBlkConfig::WCE_OFFSET || buf.len() != 1 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let wce = buf[0] != 0;
        self.device.set_writeback(wce);
        // The guest can toggle it as often as it likes.
        static TOGGLES: SharedRateLimiter = SharedRateLimiter::new(10, Duration::from_secs(5));
        crate::info_limited!(
            TOGGLES,
            "guest set the write cache to {}",
            if wce { "write-back" } else { "write-through" }
        );
        Ok(())
    }

    /// vhost-user-backend has already swapped `mem` into the shared atomic
    /// when it calls this; the workers only ever see the snapshot handed to
    /// them here, so a table refused here never reaches them.
    fn update_memory(&self, mem: GuestMemoryAtomic<GuestMem>) -> io::Result<()> {
        let snapshot = mem.memory().into_inner();
        let accepted = check_backing(&snapshot).and_then(|()| super::sigbus::watch(&snapshot));
        if let Err(e) = accepted {
            log::warn!("memory table refused: {e}");
            return Err(e);
        }
        {
            // Before the workers see the table: what they write into it is
            // logged from their first request on. The crate gives new
            // regions bitmaps of their own, pointing nowhere.
            let mut dirty = self.dirty.lock().unwrap_or_else(|p| p.into_inner());
            dirty.set_table(&snapshot);
        }
        self.each_worker(|_, w| w.set_memory(snapshot.clone()));
        // Regions of the previous memory that no request holds any more.
        super::sigbus::release_unused();
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        // Queue q on thread q % threads; each queue keeps its own worker,
        // lock, ring and io_uring.
        (0..self.threads)
            .map(|t| self.thread_queues(t).fold(0u64, |m, q| m | 1 << q))
            .collect()
    }

    fn exit_event(&self, thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        self.exit_events.get(thread_index)
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        // GET_VRING_BASE: everything we took off the ring must be on the
        // used ring before the front-end reads our next_avail.
        self.with_worker(queue_index as usize, QueueWorker::stop);
        Ok(())
    }

    // Out of line: scripts/callgrind.sh counts from its entry (once per
    // wake-up, not per request).
    #[inline(never)]
    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        // An error here would end the queue's thread (the crate stops its
        // epoll loop); eventfds only ever report IN, so anything else is
        // ignored rather than fatal.
        if !evset.contains(EventSet::IN) {
            return Ok(());
        }
        let (local, event) = if usize::from(device_event) < vrings.len() {
            (usize::from(device_event), Event::Kick)
        } else {
            match self.listener(device_event) {
                Some((local, kind)) => (local, kind.event()),
                None => return Ok(()),
            }
        };
        let Some(vring) = vrings.get(local) else {
            return Ok(());
        };
        if event == Event::Kick && !vring.get_ref().is_enabled() {
            return Ok(());
        }
        let queue = local * self.threads + thread_id;
        self.with_worker(queue, |w| w.handle_event(vring, event));
        Ok(())
    }
}

#[cfg(test)]
#[path = "backend_tests.rs"]
mod worker_tests;

#[cfg(test)]
mod tests {
    use std::fs::File;

    use vm_memory::{FileOffset, GuestAddress, GuestRegionMmap, MmapRegion};

    use super::*;

    fn file_of(len: u64) -> File {
        let f = tempfile::tempfile().unwrap();
        f.set_len(len).unwrap();
        f
    }

    /// Guest memory of one region: `size` bytes of `file` from `offset`.
    fn mem(file: File, offset: u64, size: usize) -> GuestMem {
        let region = MmapRegion::from_file(FileOffset::new(file, offset), size).unwrap();
        GuestMem::from_regions(vec![GuestRegionMmap::new(region, GuestAddress(0)).unwrap()])
            .unwrap()
    }

    #[test]
    fn memory_must_lie_within_its_file() {
        assert!(check_backing(&mem(file_of(1 << 20), 0, 1 << 20)).is_ok());
        assert!(check_backing(&mem(file_of(2 << 20), 1 << 20, 1 << 20)).is_ok());
        // mmap(2) accepts both; touching their last page would SIGBUS.
        let e = check_backing(&mem(file_of(4096), 0, 1 << 20)).unwrap_err();
        assert!(e.to_string().contains("past the end"), "{e}");
        assert!(check_backing(&mem(file_of(1 << 20), 1 << 20, 4096)).is_err());
        // Anonymous memory has no file to check.
        assert!(check_backing(&GuestMem::from_ranges(&[(GuestAddress(0), 4096)]).unwrap()).is_ok());
    }
}
