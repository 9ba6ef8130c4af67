//! What the control API acts on: the device ([`crate::device::Device`]),
//! whose state it reads and changes (resize, QoS), and what the daemon
//! says about itself ([`Identity`]). The HTTP side only parses and
//! answers.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::bitmap::BitmapInfo;
use crate::device::{BackupInfo, Device, FrontEnd, ResizeError, Resized, TrackingError};
use crate::io::LockState;
use crate::qos::{QosChanges, QosError, QosLimits};
use crate::virtio::SECTOR_SHIFT;

/// GET status.
#[derive(Debug, Serialize)]
pub struct Status {
    /// The daemon's version (its package's).
    pub version: &'static str,
    /// Seconds since the daemon started, to the millisecond.
    pub uptime_s: f64,
    /// The vhost-user socket's path (`fd N` for a socket passed in
    /// without one).
    pub socket: String,
    /// GET_ID's answer: the serial the guest sees (up to 20 bytes).
    pub serial: String,
    /// The image lock: held, waiting (another process holds it), idle (no
    /// ring runs), or off.
    pub lock: LockState,
    /// The image as `--image` named it, or `rbd:POOL/IMAGE`. After a live
    /// snapshot the top written is another file: see `chain`.
    pub image: String,
    /// raw, qcow2 or rbd.
    pub format: &'static str,
    /// A qcow2 image's chain, top first (the top is what is written; after
    /// a live snapshot, not `image`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chain: Option<Vec<String>>,
    pub block_device: bool,
    /// Bytes the guest sees.
    pub size: u64,
    pub capacity_sectors: u64,
    pub block_size: u32,
    pub readonly: bool,
    pub queues: u16,
    pub queue_size: u16,
    /// The virtio feature bits offered, in hex.
    pub virtio_features: String,
    /// The guest's write cache: write-back (true) or write-through.
    pub writeback: bool,
    /// A front-end is connected.
    pub connected: bool,
    /// Its process (pid, uid, gid), as the kernel saw it connect; null
    /// when none is connected.
    pub front_end: Option<FrontEnd>,
    /// QoS limits (0: none).
    pub qos: QosLimits,
    /// The dirty bitmaps.
    pub bitmaps: Vec<BitmapInfo>,
    /// The running backup, if any.
    pub backup: Option<BackupInfo>,
}

/// What the daemon says about itself, beside the device.
#[derive(Clone, Debug)]
pub struct Identity {
    /// The vhost-user socket, as [`Status::socket`] shows it.
    pub socket: String,
    /// When the daemon started.
    pub started: Instant,
}

/// The device, as the control API sees it.
pub struct Control {
    device: Arc<Device>,
    identity: Identity,
}

impl Control {
    pub fn new(device: Arc<Device>, identity: Identity) -> Control {
        Control { device, identity }
    }

    pub fn status(&self) -> Status {
        let d = &self.device;
        let size = d.size();
        let uptime = self.identity.started.elapsed().as_millis() as f64 / 1000.0;
        let serial = d.serial();
        let serial_len = serial.iter().position(|&b| b == 0).unwrap_or(serial.len());
        let chain = d.chain().map(|live| {
            live.chain()
                .iter()
                .map(|p| p.display().to_string())
                .collect()
        });
        Status {
            version: env!("CARGO_PKG_VERSION"),
            uptime_s: uptime,
            socket: self.identity.socket.clone(),
            serial: String::from_utf8_lossy(&serial[..serial_len]).into_owned(),
            lock: d.image_lock().map_or(LockState::Off, |l| l.state()),
            image: d.name().to_string(),
            format: match (&chain, d.name().starts_with("rbd:")) {
                (Some(_), _) => "qcow2",
                (None, true) => "rbd",
                (None, false) => "raw",
            },
            chain,
            block_device: d.is_block_device(),
            size,
            capacity_sectors: size >> SECTOR_SHIFT,
            block_size: d.limits().block_size,
            readonly: d.limits().readonly,
            queues: d.queues(),
            queue_size: d.queue_size(),
            virtio_features: format!("{:#x}", d.features()),
            writeback: d.writeback(),
            connected: d.connection().is_some(),
            front_end: d.front_end(),
            qos: d.qos().limits(),
            bitmaps: d.bitmaps(),
            backup: d.backup(),
        }
    }

    /// The QoS limits now.
    pub fn qos(&self) -> QosLimits {
        self.device.qos().limits()
    }

    /// Changes the limits given in `changes` (the others stay; 0 removes
    /// one), effective for the next request every queue takes.
    pub fn set_qos(&self, changes: &QosChanges) -> Result<QosLimits, QosError> {
        let qos = self.device.qos();
        let new = qos.limits().with(changes);
        qos.set_limits(new)?;
        log::info!("QoS limits changed to {}", serde_json::json!(new));
        Ok(new)
    }

    /// See [`Device::bitmaps`].
    pub fn bitmaps(&self) -> Vec<BitmapInfo> {
        self.device.bitmaps()
    }

    /// See [`Device::bitmap_add`].
    pub fn bitmap_add(&self, name: &str, granularity: u64) -> Result<BitmapInfo, TrackingError> {
        self.device.bitmap_add(name, granularity)
    }

    /// See [`Device::bitmap_remove`].
    pub fn bitmap_remove(&self, name: &str) -> Result<(), TrackingError> {
        self.device.bitmap_remove(name)
    }

    /// See [`Device::backup`].
    pub fn backup(&self) -> Option<BackupInfo> {
        self.device.backup()
    }

    /// See [`Device::backup_start`].
    pub fn backup_start(
        &self,
        socket: &std::path::Path,
        bitmap: Option<&str>,
    ) -> Result<BackupInfo, TrackingError> {
        self.device.backup_start(socket, bitmap)
    }

    /// See [`Device::backup_stop`].
    pub fn backup_stop(&self, failed: bool) -> Result<BackupInfo, TrackingError> {
        self.device.backup_stop(failed)
    }

    /// See [`Device::snapshot`].
    pub fn snapshot(
        &self,
        overlay: &std::path::Path,
    ) -> Result<crate::device::Snapshot, crate::disk::SnapshotError> {
        self.device.snapshot(overlay)
    }

    /// See [`Device::stream`].
    pub fn stream(
        &self,
        base: Option<&std::path::Path>,
        speed: Option<u64>,
    ) -> Result<crate::device::JobInfo, crate::device::JobError> {
        self.device.stream(base, speed)
    }

    /// See [`Device::commit`].
    pub fn commit(
        &self,
        top: &std::path::Path,
        base: Option<&std::path::Path>,
        speed: Option<u64>,
    ) -> Result<crate::device::JobInfo, crate::device::JobError> {
        self.device.commit(top, base, speed)
    }

    /// See [`Device::job`].
    pub fn job(&self) -> Option<crate::device::JobInfo> {
        self.device.job()
    }

    /// See [`Device::job_cancel`].
    pub fn job_cancel(&self) -> Result<crate::device::JobInfo, crate::device::JobError> {
        self.device.job_cancel()
    }

    /// See [`Device::resize`].
    pub fn resize(&self, size: Option<u64>, force: bool) -> Result<Resized, ResizeError> {
        self.device.resize(size, force)
    }
}
