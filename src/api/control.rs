//! What the control API acts on: the image, the capacity the workers check
//! requests against, and the device of the current connection. Resizing
//! lives here; the HTTP side only parses and answers.

use std::fs::File;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use serde::Serialize;

use crate::daemon::Current;
use crate::io::device_size;
use crate::qos::{QosError, QosLimits};
use crate::vhost::WorkerConfig;
use crate::virtio::SECTOR_SHIFT;

/// Why a resize was refused or failed. One line each.
#[derive(Debug, thiserror::Error)]
pub enum ResizeError {
    #[error("size {size} is not a multiple of the {block_size}-byte block size")]
    NotMultiple { size: u64, block_size: u32 },
    #[error("size must be larger than 0")]
    Zero,
    #[error("size {0} is larger than a file can be")]
    TooLarge(u64),
    #[error(
        "shrinking from {from} to {to} bytes cuts off data under a running guest; to do it anyway, pass --force (ringblk ctl resize --force; \"force\": true in the API)"
    )]
    Shrink { from: u64, to: u64 },
    #[error(
        "{0} is a block device, whose size is its own: grow it (lvextend, rbd resize), then resize with no size to re-read it"
    )]
    BlockDevice(String),
    #[error("the image is exported read-only (--readonly); it cannot be resized, only re-read")]
    ReadOnly,
    #[error("cannot {what} the image: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
}

impl ResizeError {
    /// Whether the daemon, not the request, is at fault.
    pub fn is_internal(&self) -> bool {
        matches!(self, ResizeError::Io { .. })
    }
}

/// What a resize did.
#[derive(Debug, Serialize)]
pub struct Resized {
    pub old_size: u64,
    pub size: u64,
    /// Whether a front-end was told (CONFIG_CHANGE_MSG): null when none is
    /// connected, false when the one connected gave us no back-end channel
    /// or could not be reached.
    pub guest_notified: Option<bool>,
    /// Why the front-end could not be told, if it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub notify_error: Option<String>,
}

/// GET status.
#[derive(Debug, Serialize)]
pub struct Status {
    /// The image's path, or `rbd:POOL/IMAGE`.
    pub image: String,
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
    /// QoS limits (0: none).
    pub qos: QosLimits,
}

/// The image as the control API needs it.
pub struct ControlImage {
    /// The image's path, or `rbd:POOL/IMAGE`.
    pub name: String,
    /// What a resize changes or re-reads.
    pub backing: ControlBacking,
    pub is_block_device: bool,
    pub block_size: u32,
    pub readonly: bool,
}

/// What a resize changes or re-reads.
pub enum ControlBacking {
    /// A duplicate of the daemon's image fd.
    File(File),
    /// The RBD image's handle, the one every queue shares: `rbd_resize`
    /// and `rbd_get_size` on it are synchronous, and run on the API's
    /// thread, never a worker's. Growing it on that handle is what lets
    /// the queues write past the old end at once. Weak: the API must not
    /// keep the image open when SIGTERM closes it (the handle closes when
    /// its last strong holder lets go).
    #[cfg(feature = "rbd")]
    Rbd(std::sync::Weak<crate::engine::rbd::client::Image>),
}

/// The RBD handle, unless the daemon has closed it (it is stopping).
#[cfg(feature = "rbd")]
fn open_image(
    image: &std::sync::Weak<crate::engine::rbd::client::Image>,
) -> io::Result<Arc<crate::engine::rbd::client::Image>> {
    image
        .upgrade()
        .ok_or_else(|| io::Error::other("the image is closed: the daemon is stopping"))
}

impl ControlBacking {
    /// The image's size now.
    fn size(&self, is_block_device: bool) -> io::Result<u64> {
        match self {
            ControlBacking::File(file) => device_size(file, is_block_device),
            #[cfg(feature = "rbd")]
            ControlBacking::Rbd(image) => open_image(image)?.size().map_err(io::Error::other),
        }
    }

    /// Makes the image `size` bytes long.
    fn set_size(&self, size: u64) -> io::Result<()> {
        match self {
            ControlBacking::File(file) => file.set_len(size),
            #[cfg(feature = "rbd")]
            ControlBacking::Rbd(image) => open_image(image)?.resize(size).map_err(io::Error::other),
        }
    }
}

/// The daemon's state the control API reads and changes.
pub struct Control {
    pub image: ControlImage,
    pub worker: Arc<WorkerConfig>,
    pub current: Current,
    pub queues: u16,
    pub queue_size: u16,
    pub features: u64,
    /// One resize at a time.
    resizing: Mutex<()>,
}

impl Control {
    pub fn new(
        image: ControlImage,
        worker: Arc<WorkerConfig>,
        current: Current,
        queues: u16,
        queue_size: u16,
        features: u64,
    ) -> Control {
        Control {
            image,
            worker,
            current,
            queues,
            queue_size,
            features,
            resizing: Mutex::new(()),
        }
    }

    /// Bytes the guest sees now.
    pub fn size(&self) -> u64 {
        self.worker.capacity.load(Ordering::Acquire) << SECTOR_SHIFT
    }

    pub fn status(&self) -> Status {
        Status {
            image: self.image.name.clone(),
            block_device: self.image.is_block_device,
            size: self.size(),
            capacity_sectors: self.size() >> SECTOR_SHIFT,
            block_size: self.image.block_size,
            readonly: self.image.readonly,
            queues: self.queues,
            queue_size: self.queue_size,
            virtio_features: format!("{:#x}", self.features),
            writeback: self.worker.writeback.load(Ordering::Relaxed),
            connected: self
                .current
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some(),
            qos: self.worker.qos.limits(),
        }
    }

    /// The QoS limits now.
    pub fn qos(&self) -> QosLimits {
        self.worker.qos.limits()
    }

    /// Changes the limits named in `changes` (the others stay; 0 removes
    /// one), effective for the next request every queue takes.
    pub fn set_qos(
        &self,
        changes: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<QosLimits, QosError> {
        let qos = &self.worker.qos;
        let new = qos.limits().with_changes(changes)?;
        qos.set_limits(new)?;
        log::info!("QoS limits changed to {}", serde_json::json!(new));
        Ok(new)
    }

    /// Resizes to `size` bytes (a file image: ftruncate; an RBD image:
    /// `rbd_resize`), or with `None` re-reads the image's size (a block
    /// device that grew, a file or RBD image grown by someone else); then
    /// tells the front-end. A smaller size needs `force`.
    ///
    /// Growing: the image grows before the capacity is published, so a
    /// request a worker accepts against the new capacity finds the image
    /// that long. Shrinking: the capacity is published first, so no new
    /// request reaches past the new end; requests already in flight there
    /// complete against the image as they find it.
    ///
    /// The front-end is told after the resize lock is let go: a front-end
    /// that does not read its back-end channel holds this call for the
    /// channel's deadline (`vhost::backend_channel::DEADLINE`), and no
    /// other request of the API.
    pub fn resize(&self, size: Option<u64>, force: bool) -> Result<Resized, ResizeError> {
        let (old, new) = self.set_size(size, force)?;
        let device = self
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let (guest_notified, notify_error) = match device.map(|d| d.config_changed()) {
            None => (None, None),
            Some(Ok(Some(_))) => (Some(true), None),
            Some(Ok(None)) => (
                Some(false),
                Some("the front-end did not negotiate BACKEND_REQ".to_string()),
            ),
            Some(Err(e)) => {
                log::warn!("telling the front-end about the resize: {e}");
                (Some(false), Some(e.to_string()))
            }
        };
        Ok(Resized {
            old_size: old,
            size: new,
            guest_notified,
            notify_error,
        })
    }

    /// The resize itself, one at a time: returns the old size and the new.
    fn set_size(&self, size: Option<u64>, force: bool) -> Result<(u64, u64), ResizeError> {
        let _one = self.resizing.lock().unwrap_or_else(|p| p.into_inner());
        let img = &self.image;
        let old = self.size();
        let io = |what| move |source| ResizeError::Io { what, source };
        let new = match size {
            Some(_) if img.is_block_device => {
                return Err(ResizeError::BlockDevice(img.name.clone()));
            }
            Some(_) if img.readonly => return Err(ResizeError::ReadOnly),
            Some(s) => s,
            None => img
                .backing
                .size(img.is_block_device)
                .map_err(io("read the size of"))?,
        };
        if new == 0 {
            return Err(ResizeError::Zero);
        }
        if new % u64::from(img.block_size) != 0 {
            return Err(ResizeError::NotMultiple {
                size: new,
                block_size: img.block_size,
            });
        }
        if i64::try_from(new).is_err() {
            return Err(ResizeError::TooLarge(new));
        }
        if new < old && !force {
            return Err(ResizeError::Shrink { from: old, to: new });
        }
        let publish = || {
            self.worker
                .capacity
                .store(new >> SECTOR_SHIFT, Ordering::Release)
        };
        if new < old {
            publish();
        }
        if size.is_some() {
            img.backing.set_size(new).map_err(io("resize"))?;
        }
        if new >= old {
            publish();
        }
        if new != old {
            log::info!("resized from {old} to {new} bytes");
        }
        Ok((old, new))
    }
}
