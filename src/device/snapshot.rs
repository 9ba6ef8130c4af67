//! Live external snapshots: a new qcow2 overlay becomes the top of the
//! chain while the guest runs (see [`crate::disk::live`] for how).

use std::path::Path;

use serde::Serialize;

use super::tracking::HELD_ELSEWHERE;
use super::{Device, Unclaimed};
use crate::disk::SnapshotError;

/// What a snapshot did.
#[derive(Debug, Serialize)]
pub struct Snapshot {
    /// The new top: the overlay, written from now on.
    pub top: String,
    /// The image that was the top until now: never written again, a
    /// point-in-time image of the disk that can be copied away.
    pub frozen: String,
    /// The chain now, top first.
    pub chain: Vec<String>,
}

impl Device {
    /// Puts a new qcow2 overlay, `overlay`, above the chain: requests in
    /// flight complete on the old top, those after go to the new one, and
    /// the image lock moves with the top. Refused while a backup runs, or
    /// while another process holds the image.
    pub fn snapshot(&self, overlay: &Path) -> Result<Snapshot, SnapshotError> {
        let live = self.backing.for_snapshot()?;
        if self.limits.readonly {
            return Err(SnapshotError::ReadOnly);
        }
        // A backup's view reads the guest's disk through this chain: it
        // must not change under it.
        let _chain = self.chain_change.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(job) = self.job_running() {
            return Err(SnapshotError::Refused(job));
        }
        if let Some(b) = self.backup() {
            return Err(SnapshotError::Refused(format!(
                "a backup is running (NBD on {}); a live snapshot would change the chain under its view: `backup stop` it first",
                b.socket
            )));
        }
        // The image held for the snapshot, also with no front-end
        // connected: its lock taken (no other process writes the image
        // under the switch) and its bitmaps open, so that they move to the
        // new top as they do while a guest runs; the release after it
        // writes their bits there. Before, with no front-end, the new top
        // got none.
        let _hold = self.hold_guard().map_err(|e| {
            SnapshotError::Refused(match e {
                Unclaimed::Locked(_) => {
                    format!("{HELD_ELSEWHERE}: a live snapshot needs the image lock")
                }
                Unclaimed::Unmarked => e.to_string(),
            })
        })?;
        let relock = |file: &std::fs::File| match &self.image_lock {
            Some(l) => l.relock(file),
            None => Ok(()),
        };
        let chain = live.snapshot(overlay, relock, || self.bitmaps_freeze_with_top())?;
        self.bitmaps_follow_snapshot();
        let chain: Vec<String> = chain.iter().map(|p| p.display().to_string()).collect();
        log::info!(
            "live snapshot: the chain is now, top first, {}",
            chain.join(", ")
        );
        Ok(Snapshot {
            top: chain[0].clone(),
            frozen: chain[1].clone(),
            chain,
        })
    }
}
