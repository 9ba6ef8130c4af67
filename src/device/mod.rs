//! The device: what the guest sees (its limits, capacity and write cache)
//! and the state every layer above shares at runtime, in one object.
//!
//! One [`Device`] lives as long as the daemon; connections come and go
//! under it. Each fact about the device is here and only here:
//! - the capacity (resized online by [`Device::resize`]; requests are
//!   checked against it, GET_CONFIG reports it);
//! - the guest-visible write cache (`wce`), which the guest may toggle;
//! - dirty-page logging (the front-end acked LOG_ALL: a migration);
//! - the QoS limits and their token buckets ([`crate::qos::Qos`]);
//! - the image lock ([`crate::io::ImageLock`]), and who uses the image:
//!   the queues whose rings run claim it ([`Device::claim_image`]); the
//!   first takes the lock (and has a qcow2 image's metadata read afresh),
//!   the last lets it go (after a qcow2 image's metadata is made durable
//!   and its caches dropped), so that a migration or a reconnect hands
//!   the image over whole; the first also loads the dirty bitmaps, the
//!   last writes them out;
//! - the dirty bitmaps and the running backup ([`tracking`]), and what
//!   each write does for them before it reaches the image;
//! - stopping (SIGTERM), and the intake: whether the rings take new
//!   requests (not once the front-end's socket has closed, nor while
//!   stopping);
//! - the connection being served, if any ([`Connection`]), and the
//!   process at its other end ([`FrontEnd`]).
//!
//! The configuration space the driver reads is derived from these
//! ([`Device::config`]), never stored beside them.
//!
//! Who reads what: the queue workers read the capacity once per pass, the
//! write cache and logging once per request (relaxed loads); the
//! vhost-user backend changes the write cache and logging as the front-end
//! asks; the control API resizes, reads and changes QoS; the daemon sets
//! the connection and stops. Nothing here does I/O on the request path.

pub mod job;
mod resize;
mod snapshot;
pub mod tracking;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use virtio_bindings::virtio_blk::VIRTIO_BLK_ID_BYTES;

use crate::disk::{Disk, Live};
use crate::io::ImageLock;
use crate::qos::{Qos, QosError, QosLimits};
use crate::virtio::config::{VirtioBlkConfig, device_features};
use crate::virtio::{DeviceLimits, SECTOR_SHIFT};

pub use resize::{ResizeError, Resized};
pub use tracking::{BackupInfo, BackupSpec, Targets, Tracking, TrackingError, Unclaimed};

/// Why a device cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("QoS: {0}")]
    Qos(#[from] QosError),
    #[error("bitmaps: {0}")]
    Bitmap(#[from] crate::bitmap::BitmapError),
}

pub use job::{JobError, JobInfo, JobState};
pub use snapshot::Snapshot;

/// GET_ID's answer: the serial, zero-padded to 20 bytes.
pub type Serial = [u8; VIRTIO_BLK_ID_BYTES as usize];

/// The front-end's process, as the kernel recorded it when it connected
/// to the vhost-user socket (`SO_PEERCRED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FrontEnd {
    /// 0 when it is in a PID namespace the daemon cannot see into.
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
}

/// What the daemon and the control API need of the connection being
/// served, whatever its engine (the vhost-user backend implements it).
pub trait Connection: Send + Sync {
    /// Takes no more requests and completes everything in flight, on every
    /// queue.
    fn drain_all(&self);
    /// Holds every queue: waits for the requests each has in flight to
    /// complete (their completions published), then calls `f` with the
    /// moment the first queue was held, while no queue starts a request;
    /// then lets them go on. Requests taken off a ring but not started
    /// wait until then. Queues of a connection that is over are skipped.
    fn quiesce(&self, f: &mut dyn FnMut(std::time::Instant));
    /// Tells the front-end that the configuration space changed (the
    /// capacity, after a resize). Ok(None): it gave us no back-end channel
    /// (it did not negotiate BACKEND_REQ), so it cannot be told;
    /// Ok(Some(acked)) otherwise.
    fn config_changed(&self) -> io::Result<Option<bool>>;
    /// Takes the engines out of the (drained) workers and drops them, so
    /// that what they hold is released: at shutdown, an RBD image handle
    /// is closed, which gives up its watch and exclusive lock.
    fn close_engines(&self);
}

/// How to make a [`Device`]: what it is, fixed for the daemon's life.
/// `Default` is a small test device.
pub struct DeviceSpec {
    /// The image's path, or `rbd:POOL/IMAGE`.
    pub name: String,
    /// What requests are checked against (the capacity aside).
    pub limits: DeviceLimits,
    /// The capacity at start-up, in 512-byte sectors.
    pub capacity_sectors: u64,
    pub queues: u16,
    /// Most descriptors a queue may have (what the front-end may set).
    pub queue_size: u16,
    pub serial: Serial,
    /// The write cache a connection starts with (`--writethrough`: off).
    pub writeback: bool,
    pub qos: QosLimits,
    /// Taken while a ring runs (`--no-image-lock`, RBD: none).
    pub image_lock: Option<ImageLock>,
    /// The image: its size (the one owner), growth, chain.
    pub backing: Disk,
    /// Where the dirty bitmaps persist, or why this device has none.
    pub bitmaps: Result<Box<dyn crate::bitmap::BitmapStore>, String>,
    /// What backups need, or why this device has none.
    pub backups: Result<BackupSpec, String>,
}

impl Default for DeviceSpec {
    fn default() -> DeviceSpec {
        DeviceSpec {
            name: String::new(),
            limits: DeviceLimits::default(),
            capacity_sectors: 1 << 21,
            queues: 1,
            queue_size: 256,
            serial: [0; VIRTIO_BLK_ID_BYTES as usize],
            writeback: true,
            qos: QosLimits::default(),
            image_lock: None,
            backing: Disk::None,
            bitmaps: Err("no bitmaps on this device".into()),
            backups: Err("no backups on this device".into()),
        }
    }
}

/// The device: see the module doc.
pub struct Device {
    name: String,
    limits: DeviceLimits,
    queues: u16,
    queue_size: u16,
    serial: Serial,
    /// The write cache a connection starts with.
    writeback_default: bool,
    /// The capacity now, in 512-byte sectors.
    capacity: AtomicU64,
    /// The guest-visible write cache (config `wce`): when off, every
    /// write is made durable before it completes.
    writeback: AtomicBool,
    /// The front-end acked VHOST_F_LOG_ALL (a migration is under way):
    /// what an engine writes into guest memory is marked in the dirty log.
    logging: AtomicBool,
    /// Set on shutdown (and kept): the daemon is stopping.
    stopping: AtomicBool,
    /// No ring takes a new request: the front-end's socket closed (the
    /// relay sets it first thing when it reads the end of the stream), or
    /// the daemon is stopping. Each pass reads it (relaxed) before each
    /// pop; what was taken before completes. Cleared when the next
    /// connection starts.
    intake_closed: AtomicBool,
    qos: Qos,
    image_lock: Option<ImageLock>,
    /// The connection being served (`None` between connections).
    connection: Mutex<Option<Arc<dyn Connection>>>,
    /// Who is at its other end, if the kernel said.
    front_end: Mutex<Option<FrontEnd>>,
    backing: Disk,
    /// One resize at a time.
    resizing: Mutex<()>,
    /// Held by a live snapshot and by a backup's start: a snapshot sees
    /// a backup that started before it, and refuses (it would change the
    /// chain under the backup's view).
    chain_change: Mutex<()>,
    /// The block job running or last run ([`job`]).
    job: Mutex<Option<Arc<job::Job>>>,
    /// The dirty bitmaps, the running backup, the image's holders.
    tracking: Tracking,
}

impl Device {
    pub fn new(spec: DeviceSpec) -> Result<Device, DeviceError> {
        let size = spec.capacity_sectors << SECTOR_SHIFT;
        Ok(Device {
            tracking: Tracking::new(spec.bitmaps, spec.backups, size)?,
            qos: Qos::new(spec.qos)?,
            name: spec.name,
            limits: spec.limits,
            queues: spec.queues,
            queue_size: spec.queue_size,
            serial: spec.serial,
            writeback_default: spec.writeback,
            capacity: AtomicU64::new(spec.capacity_sectors),
            writeback: AtomicBool::new(spec.writeback),
            logging: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            intake_closed: AtomicBool::new(false),
            image_lock: spec.image_lock,
            connection: Mutex::new(None),
            front_end: Mutex::new(None),
            backing: spec.backing,
            resizing: Mutex::new(()),
            chain_change: Mutex::new(()),
            job: Mutex::new(None),
        })
    }

    /// The image's path, or `rbd:POOL/IMAGE`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What requests are checked against, the capacity aside.
    pub fn limits(&self) -> &DeviceLimits {
        &self.limits
    }

    pub fn queues(&self) -> u16 {
        self.queues
    }

    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    pub fn serial(&self) -> &Serial {
        &self.serial
    }

    /// Whether the image is a block device (whose size is its own).
    pub fn is_block_device(&self) -> bool {
        matches!(
            self.backing,
            Disk::File {
                block_device: true,
                ..
            }
        )
    }

    /// The virtio feature bits offered to the driver.
    pub fn features(&self) -> u64 {
        device_features(self.limits.readonly)
    }

    /// The capacity now, in 512-byte sectors. Acquire: a resize that grew
    /// the image before it published the capacity is seen whole.
    #[inline]
    pub fn capacity(&self) -> u64 {
        self.capacity.load(Ordering::Acquire)
    }

    /// Bytes the guest sees now.
    pub fn size(&self) -> u64 {
        self.capacity() << SECTOR_SHIFT
    }

    /// Whether the guest's write cache is on (write-back).
    #[inline]
    pub fn writeback(&self) -> bool {
        self.writeback.load(Ordering::Relaxed)
    }

    /// The guest set `wce`.
    pub fn set_writeback(&self, on: bool) {
        self.writeback.store(on, Ordering::Relaxed);
    }

    /// Whether what the engines write into guest memory is to be marked in
    /// the dirty log (a migration).
    #[inline]
    pub fn logging(&self) -> bool {
        self.logging.load(Ordering::Relaxed)
    }

    /// LOG_ALL acked on (or off again). Returns whether that changed it.
    /// A migration starting cancels a running block job: the job holds
    /// the image, which the destination must take once the source lets
    /// it go.
    pub fn set_logging(&self, on: bool) -> bool {
        let changed = self.logging.swap(on, Ordering::Relaxed) != on;
        if changed && on {
            self.cancel_job_for_migration();
        }
        changed
    }

    /// A new connection starts from what the device advertises: the guest
    /// may have turned the write cache off, and dirty-page logging is for
    /// the connection that asked for it. Its rings take requests, unless
    /// the daemon is stopping: [`Device::stop`] stores `stopping`, then
    /// closes the intake; all four stores and loads are SeqCst, so if its
    /// close comes before our opening, we see `stopping` after it.
    pub fn new_connection(&self) {
        self.writeback
            .store(self.writeback_default, Ordering::Relaxed);
        self.logging.store(false, Ordering::Relaxed);
        self.intake_closed.store(false, Ordering::SeqCst);
        if self.stopping.load(Ordering::SeqCst) {
            self.intake_closed.store(true, Ordering::SeqCst);
        }
    }

    /// Whether the daemon is stopping.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// SIGTERM: the daemon stops, and no ring takes a new request.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.intake_closed.store(true, Ordering::SeqCst);
    }

    /// The front-end's socket closed: no ring takes a new request (until
    /// the next connection).
    pub fn close_intake(&self) {
        self.intake_closed.store(true, Ordering::SeqCst);
    }

    /// Whether the rings take no new requests (read before each pop).
    #[inline]
    pub fn intake_closed(&self) -> bool {
        self.intake_closed.load(Ordering::Relaxed)
    }

    /// The device's QoS limits, shared by its queues (and changed at
    /// runtime through this handle).
    pub fn qos(&self) -> &Qos {
        &self.qos
    }

    /// The image lock, taken while a ring runs; none with
    /// `--no-image-lock` or on an RBD image (librbd has its own).
    pub fn image_lock(&self) -> Option<&ImageLock> {
        self.image_lock.as_ref()
    }

    /// The chain being served (a qcow2 image), if the image has one.
    pub fn chain(&self) -> Option<&Arc<Live>> {
        self.backing.chain()
    }

    /// Makes everything written durable (the daemon stops): an fdatasync
    /// of the image file; for qcow2, its metadata first.
    pub fn make_durable(&self) -> std::io::Result<()> {
        self.backing.make_durable()
    }

    /// The configuration space as the driver reads it now.
    pub fn config(&self) -> VirtioBlkConfig {
        VirtioBlkConfig::new(&self.limits, self.capacity(), self.queues, self.writeback())
    }

    /// The connection being served, if any.
    pub fn connection(&self) -> Option<Arc<dyn Connection>> {
        self.connection
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A connection starts being served (`Some`) or has ended (`None`).
    pub fn set_connection(&self, c: Option<Arc<dyn Connection>>) {
        *self.connection.lock().unwrap_or_else(|p| p.into_inner()) = c;
    }

    /// The front-end's process, while one is connected.
    pub fn front_end(&self) -> Option<FrontEnd> {
        *self.front_end.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A front-end connected (`Some`), or its connection ended (`None`).
    pub fn set_front_end(&self, f: Option<FrontEnd>) {
        *self.front_end.lock().unwrap_or_else(|p| p.into_inner()) = f;
    }
}
