//! The dirty bitmaps of a qcow2 image served writable: they live in the
//! image's own bitmap directory (QEMU's persistent bitmaps), so QEMU and
//! `qemu-img` see them (docs/backup.md).
//!
//! A [`BitmapStore`] over the format layer's QEMU bitmaps
//! ([`crate::disk::qcow2::bitmaps`], [`crate::disk::qcow2::bitmap_write`]),
//! kept as QEMU keeps them: in memory while the image is held, marked
//! IN_USE on disk; written back when the image is let go.
//! - [`peek`](BitmapStore::peek) (start-up, the image not held yet):
//!   the bitmaps read, nothing written; another process may hold the
//!   image (the other side of a migration), and its bitmaps are its own.
//! - [`open`](BitmapStore::open) (the image is claimed, its lock taken):
//!   the directory and bits read afresh, and every bitmap marked IN_USE
//!   and fdatasynced before the first write; one found IN_USE (its last
//!   holder did not close it: kill -9, a crash, a program that does not
//!   write bitmaps) is inconsistent. (The daemon opens the image with
//!   `bitmaps_at_claim`: its open marks nothing.)
//! - [`close`](BitmapStore::close) of the last bitmap stages them all; the
//!   format layer writes them when the image is released, after imago's
//!   last flush and before its caches are reread (`Qcow2Image::invalidate`):
//!   new clusters, tables and directory, IN_USE clear, old clusters freed.
//! - `add` and `remove` write the new set into the image at once (the
//!   device's requests kept out meanwhile), every bitmap in use, so that
//!   a kill -9 after them finds the set the user made: an added bitmap
//!   comes back inconsistent (QEMU loses a bitmap added and not yet
//!   stored), a removed one stays removed.
//! - An image without the extension has it added by its first bitmap,
//!   and one whose last bitmap is removed has it removed (QEMU allows no
//!   empty directory): the header cluster is rewritten (`bitmap_write`).
//! - QEMU's disabled bitmaps (no AUTO flag) record nothing, as in QEMU:
//!   they are kept aside, written back as loaded, and not listed.
//! - `update` writes nothing: while the image is held every bitmap is
//!   IN_USE on disk, already "possibly incomplete" to whoever finds it.
//! - A live snapshot: the old top keeps the bitmaps as they are at the
//!   snapshot, written back consistent once the overlay is in place and
//!   before requests go on (`top_freezes`: QEMU stores a node's bitmaps
//!   when it becomes read-only); the new top gets the set, in use, and
//!   the bits at the release (`top_moved`).

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;

use crate::bitmap::{
    BitmapError, BitmapInfo, BitmapStore, DirtyBitmap, check_name, granularity_shift,
};
use crate::disk::qcow2::Qcow2Image;
use crate::disk::qcow2::bitmap_write::Stored;
use crate::disk::{Live, Served};
use crate::metrics::SharedRateLimiter;

/// For the errors of loads that claims retry.
static LOAD_ERRORS: SharedRateLimiter =
    SharedRateLimiter::new(3, std::time::Duration::from_secs(60));

/// What the store knows of one bitmap between `open` and `close`.
struct Known {
    granularity_bits: u8,
    auto: bool,
}

impl Known {
    /// The bitmap `name` as the image stores it, with `bitmap`'s bits.
    fn stored(&self, name: &str, bitmap: &DirtyBitmap) -> Stored {
        Stored {
            name: name.to_string(),
            granularity_bits: self.granularity_bits,
            auto: self.auto,
            consistent: bitmap.is_consistent(),
            words: bitmap.words().collect(),
        }
    }
}

/// The bitmaps in a qcow2 image's bitmap directory.
pub struct Qcow2Store {
    live: Arc<Live>,
    /// The bitmaps, by name.
    known: BTreeMap<String, Known>,
    /// Closed so far, since the last staging.
    closed: Vec<Stored>,
    /// QEMU's disabled bitmaps (no AUTO flag): they record nothing while
    /// QEMU has the image, so nothing here either; written back as loaded
    /// (and not listed by `ctl bitmap list`).
    frozen: Vec<Stored>,
    /// The disk's size as last seen (open, add, resize).
    disk_size: u64,
}

impl Qcow2Store {
    /// The store of the image `live` serves, whose top has QEMU bitmaps.
    pub fn new(live: Arc<Live>) -> Qcow2Store {
        Qcow2Store {
            live,
            known: BTreeMap::new(),
            closed: Vec::new(),
            frozen: Vec::new(),
            disk_size: 0,
        }
    }

    /// Writes the set of bitmaps as it is now into the image at once, each
    /// in use (inconsistent; zero bits: QEMU loads none of an in-use
    /// bitmap's), QEMU's disabled ones as loaded: after an `add` or a
    /// `remove`, so that a kill -9 finds the set the user made (QEMU loses
    /// a bitmap added and not yet stored). The real bits are written when
    /// the image is let go. Called with every request kept out (the
    /// device's quiesce around `add` and `remove`).
    fn write_set(&self) -> Result<(), BitmapError> {
        let mut all = Vec::new();
        for (name, k) in &self.known {
            let empty = DirtyBitmap::new(self.disk_size, 1u64 << k.granularity_bits)?;
            all.push(Stored {
                name: name.clone(),
                granularity_bits: k.granularity_bits,
                auto: k.auto,
                consistent: false,
                words: empty.words().collect(),
            });
        }
        all.extend(self.frozen.iter().cloned());
        let served = self.live.current();
        self.top(&served)?
            .store_qemu_bitmaps_now(all)
            .map_err(|e| self.err(e.to_string()))
    }

    /// The served top, which a qcow2 image's snapshots keep qcow2.
    fn top<'a>(&self, served: &'a Served) -> Result<&'a Qcow2Image, BitmapError> {
        served
            .qcow2()
            .ok_or_else(|| self.err("the served image is not qcow2"))
    }

    fn err(&self, why: impl Into<String>) -> BitmapError {
        BitmapError::Io {
            path: self.location(),
            source: io::Error::other(why.into()),
        }
    }

    /// Every bitmap of the image, loaded; with `claim` (the image is
    /// held) marked in use too, else nothing is written.
    fn load(
        &mut self,
        disk_size: u64,
        claim: bool,
    ) -> Vec<(String, Result<DirtyBitmap, BitmapError>)> {
        let served = self.live.current();
        let loaded = match self.top(&served).and_then(|image| {
            if claim {
                image.open_qemu_bitmaps()
            } else {
                image.peek_qemu_bitmaps()
            }
            .map_err(|e| self.err(e.to_string()))
        }) {
            Ok(l) => l,
            Err(e) => {
                // A guest's requests retry a claim that failed.
                crate::log_limited!(log::Level::Error, LOAD_ERRORS, "{}: {e}", self.location());
                return Vec::new();
            }
        };
        self.known.clear();
        self.closed.clear();
        self.frozen.clear();
        self.disk_size = disk_size;
        let mut out = Vec::new();
        for l in loaded {
            let g = 1u64 << l.granularity_bits;
            if !l.auto {
                let consistent = l.words.is_ok();
                let words = match l.words {
                    Ok(w) => Some(w),
                    Err(_) => DirtyBitmap::new(disk_size, g)
                        .ok()
                        .map(|b| b.words().collect()),
                };
                if let Some(words) = words {
                    self.frozen.push(Stored {
                        name: l.name,
                        granularity_bits: l.granularity_bits,
                        auto: false,
                        consistent,
                        words,
                    });
                }
                continue;
            }
            let bitmap = match l.words {
                Ok(words) => DirtyBitmap::from_words(disk_size, g, words, true),
                Err(why) => {
                    log::warn!("qcow2 bitmap '{}': {why}", l.name.escape_debug());
                    DirtyBitmap::new(disk_size, g).inspect(|b| b.set_inconsistent())
                }
            };
            self.known.insert(
                l.name.clone(),
                Known {
                    granularity_bits: l.granularity_bits,
                    auto: l.auto,
                },
            );
            out.push((l.name, bitmap));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        if claim && self.known.is_empty() && !self.frozen.is_empty() {
            // No close will come: the disabled ones go back at the next
            // release as they are.
            if let Some(top) = self.live.current().qcow2() {
                top.stage_qemu_bitmaps(self.frozen.clone());
            }
        }
        out
    }
}

impl BitmapStore for Qcow2Store {
    fn location(&self) -> String {
        let chain = self.live.chain();
        let top = chain.first().map(|p| p.display().to_string());
        format!("the bitmap directory of {}", top.unwrap_or_default())
    }

    fn peek(&mut self, disk_size: u64) -> Result<Vec<BitmapInfo>, BitmapError> {
        let peeked = self.load(disk_size, false);
        let mut out = Vec::new();
        for (name, b) in &peeked {
            match b {
                Ok(b) => out.push(b.info(name)),
                Err(e) => return Err(self.err(format!("bitmap '{name}': {e}"))),
            }
        }
        Ok(out)
    }

    fn open(&mut self, disk_size: u64) -> Vec<(String, Result<DirtyBitmap, BitmapError>)> {
        // Read afresh and marked in use now: what start-up peeked may be
        // stale (a migration's source lets the image go after this daemon
        // started: its bitmaps are on disk now).
        self.load(disk_size, true)
    }

    fn add(
        &mut self,
        name: &str,
        granularity: u64,
        disk_size: u64,
    ) -> Result<DirtyBitmap, BitmapError> {
        check_name(name)?;
        let shift = granularity_shift(granularity)?;
        if self.known.contains_key(name) || self.frozen.iter().any(|f| f.name == name) {
            return Err(BitmapError::Exists(name.to_string()));
        }
        let b = DirtyBitmap::new(disk_size, granularity)?;
        self.disk_size = disk_size;
        self.known.insert(
            name.to_string(),
            Known {
                granularity_bits: shift as u8,
                auto: true,
            },
        );
        if let Err(e) = self.write_set() {
            self.known.remove(name);
            return Err(e);
        }
        Ok(b)
    }

    fn remove(&mut self, name: &str) -> Result<(), BitmapError> {
        if !self.known.contains_key(name) {
            return Err(BitmapError::NotFound(name.to_string()));
        }
        let Some(k) = self.known.remove(name) else {
            return Err(BitmapError::NotFound(name.to_string()));
        };
        if let Err(e) = self.write_set() {
            self.known.insert(name.to_string(), k);
            return Err(e);
        }
        self.closed.retain(|s| s.name != name);
        Ok(())
    }

    fn update(
        &mut self,
        _name: &str,
        _bitmap: &DirtyBitmap,
        _consistent: bool,
    ) -> Result<(), BitmapError> {
        Ok(())
    }

    fn resize(
        &mut self,
        _name: &str,
        bitmap: &DirtyBitmap,
        disk_size: u64,
    ) -> Result<DirtyBitmap, BitmapError> {
        self.disk_size = disk_size;
        bitmap.resized(disk_size)
    }

    fn top_freezes(&mut self, bitmaps: &[(&str, &DirtyBitmap)]) -> Result<(), BitmapError> {
        if self.known.is_empty() && self.frozen.is_empty() {
            // Nothing to keep (and an empty set would remove the
            // extension, whatever a bad directory still holds).
            return Ok(());
        }
        let mut all = Vec::new();
        for (name, bitmap) in bitmaps {
            let Some(k) = self.known.get(*name) else {
                continue;
            };
            all.push(k.stored(name, bitmap));
        }
        if all.len() != self.known.len() {
            return Err(self.err("not every bitmap is loaded"));
        }
        all.extend(self.frozen.iter().cloned());
        let served = self.live.current();
        if !self.top(&served)?.stage_qemu_bitmaps_for_snapshot(all) {
            return Err(self.err("the top keeps no bitmaps (not writable)"));
        }
        Ok(())
    }

    fn top_moved(&mut self) -> Result<(), BitmapError> {
        // The new top has no bitmaps yet: the set goes into it now (in
        // use), the bits at the release. The old top kept its own, as
        // they were at the snapshot (`top_freezes`).
        self.closed.clear();
        if self.known.is_empty() && self.frozen.is_empty() {
            return Ok(());
        }
        self.write_set()
    }

    fn close(&mut self, name: &str, bitmap: &DirtyBitmap) -> Result<(), BitmapError> {
        let Some(k) = self.known.get(name) else {
            return Err(BitmapError::NotFound(name.to_string()));
        };
        let stored = k.stored(name, bitmap);
        self.closed.retain(|s| s.name != name);
        self.closed.push(stored);
        if self.closed.len() == self.known.len() {
            let mut all = std::mem::take(&mut self.closed);
            all.extend(self.frozen.iter().cloned());
            let served = self.live.current();
            if !self.top(&served)?.stage_qemu_bitmaps(all) {
                return Err(self.err(
                    "the image no longer has a bitmap directory to write to (a live snapshot \
                     moved the top, or the extension is gone); the bitmaps stay in use",
                ));
            }
        }
        Ok(())
    }
}
