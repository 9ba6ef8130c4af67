//! Online resize: the image changes size, the capacity follows, and the
//! front-end is told.

use std::io;
use std::sync::atomic::Ordering;

use serde::Serialize;

use super::Device;
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
    #[error("a qcow2 image only grows online (from {from} to {to} bytes refused)")]
    GrowsOnly { from: u64, to: u64 },
    #[error("cannot {what} the image: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
    /// A block job is running: it copies against the size it started
    /// with (an active commit's base was grown to it, its bitmap sized).
    #[error("{0}")]
    Job(String),
    /// The bitmaps or the running backup refuse it.
    #[error(transparent)]
    Tracking(#[from] super::TrackingError),
    /// A size given, and the image cannot be held: another process (a
    /// migration's other side, a QEMU) may be writing it, and only the
    /// holder changes it.
    #[error("cannot resize: {0}")]
    NotHeld(super::Unclaimed),
}

impl ResizeError {
    /// Whether the daemon, not the request, is at fault.
    pub fn is_internal(&self) -> bool {
        match self {
            ResizeError::Io { .. } | ResizeError::NotHeld(super::Unclaimed::Unmarked) => true,
            ResizeError::Tracking(e) => e.status() >= 500,
            _ => false,
        }
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

impl Device {
    /// Resizes to `size` bytes (a file image: ftruncate; a shared handle:
    /// its own resize, `rbd_resize`), or with `None` re-reads the image's
    /// size (a block device that grew, a file or RBD image grown by
    /// someone else); then tells the front-end. A smaller size needs
    /// `force`.
    ///
    /// Growing: the image grows before the capacity is published, so a
    /// request a worker accepts against the new capacity finds the image
    /// that long. Shrinking: the capacity is published first, so no new
    /// request reaches past the new end; requests already in flight there
    /// complete against the image as they find it.
    ///
    /// The front-end is told after the resize lock is let go: a front-end
    /// that does not read its back-end channel holds this call for the
    /// channel's deadline (`vhost::relay::channel::DEADLINE`), and no
    /// other resize.
    pub fn resize(&self, size: Option<u64>, force: bool) -> Result<Resized, ResizeError> {
        let (old, new) = self.set_size(size, force)?;
        let (guest_notified, notify_error) = match self.connection().map(|c| c.config_changed()) {
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
        if let Some(job) = self.job_running() {
            return Err(ResizeError::Job(job));
        }
        let old = self.size();
        let block_size = self.limits.block_size;
        let io = |what| move |source| ResizeError::Io { what, source };
        let new = match size {
            Some(_) if self.is_block_device() => {
                return Err(ResizeError::BlockDevice(self.name.clone()));
            }
            Some(_) if self.limits.readonly => return Err(ResizeError::ReadOnly),
            Some(s) => s,
            None => self.backing.size().map_err(io("read the size of"))?,
        };
        if new == 0 {
            return Err(ResizeError::Zero);
        }
        if new % u64::from(block_size) != 0 {
            return Err(ResizeError::NotMultiple {
                size: new,
                block_size,
            });
        }
        if i64::try_from(new).is_err() {
            return Err(ResizeError::TooLarge(new));
        }
        if new < old && self.backing.grows_only() {
            return Err(ResizeError::GrowsOnly { from: old, to: new });
        }
        if new < old && !force {
            return Err(ResizeError::Shrink { from: old, to: new });
        }
        let publish = || self.capacity.store(new >> SECTOR_SHIFT, Ordering::Release);
        let change = || {
            if new < old {
                publish();
            }
            if size.is_some() {
                self.backing.set_size(new).map_err(io("resize"))?;
            }
            if new >= old {
                publish();
            }
            Ok(())
        };
        if new == old {
            change()?;
        } else {
            // The image held, and the bitmaps follow the size, in the
            // same switch.
            self.resize_tracked(new, size.is_some(), change)?;
        }
        if new != old {
            log::info!("resized from {old} to {new} bytes");
        }
        Ok((old, new))
    }
}
