//! Commit: the data of a layer of the chain (and of the layers between it
//! and a base) copied down into the base, then the layer above it pointed
//! at the base, so that the committed layers drop out of the chain while
//! the guest runs (QEMU's `block-commit`); or, for the top itself, an
//! active commit that ends in a pivot to the base.
//!
//! The base is an overlay the daemon made (in its snapshot directory,
//! where it may open files for writing after start-up) or the image
//! `--image` names (open for writing since start-up):
//! [`crate::disk::Live::open_base`].
//!
//! **Copying** ([`Qcow2Image::commit_extents`]) writes through a handle of
//! the base of its own ([`Qcow2Image::open_base`]), one whole cluster of
//! the base at a time (what the committed layer shows of it, read through
//! the chain below it and decrypted per layer, encrypted for the base),
//! its data durable before any table points to it, each call committed
//! and synced before the next. A crash leaves the base with clusters that
//! read as they did through the layer above (which still hides them):
//! nothing the guest reads changes. A read-only layer's copy needs none of
//! the served image's locks: no request writes the layers it reads, nor
//! the base; a guest read that reaches the base does so only where no
//! layer above it has data, which is where the copy writes nothing. The
//! active layer's tables are read under its metadata lock, and a guest
//! write that lands after a cluster was read is the caller's to copy again
//! (`crate::device::job`: its dirty bitmap has it).
//!
//! **The switch** of a read-only layer's commit is a stream's
//! ([`Qcow2Image::rebase`]): the header of the layer above the committed
//! one (the top, or a read-only layer rewritten through a descriptor of
//! its own) names the base, and the base's new handle (whose tables know
//! the copied clusters) takes its place in the chain. **The pivot** of an
//! active commit ([`Qcow2Image::pivot`]) freezes the top and makes the
//! base's handle the top; the caller's switch on disk is the removal of a
//! snapshot record (`crate::disk::Live::pivot`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use imago::FormatAccess;
use imago::ShallowMapping;
use imago::format::drivers::FormatDriverInstance;

use super::stream::{Step, Walked, open_writable};
use super::{
    FormatError, Layer, OpenOptions, Parts, Qcow2Image, QemuBitmaps, bitmaps, check_l1_covers,
    lock, open_err,
};
use crate::disk::Mapper;

impl Qcow2Image {
    /// A writable handle of file `base` of the chain (a qcow2 layer below
    /// the top), on `file` (the same file, opened for writing): what a
    /// commit writes through. Refused for a raw file. A base with QEMU's
    /// bitmaps is refused for a commit of a layer below the top (they
    /// would not record what the commit writes); an `active` commit's base
    /// becomes the top at its pivot, where the device's bitmaps replace
    /// them: they are marked in use (inconsistent) before anything is
    /// written, as a top's are at a claim.
    pub fn open_base(
        &self,
        base: usize,
        file: File,
        options: &OpenOptions,
        active: bool,
    ) -> Result<Qcow2Image, FormatError> {
        let (Some(old), Some(layer)) = (self.files.get(base), self.layers.get(base)) else {
            return Err(FormatError::Unsupported(format!("no layer {base}")));
        };
        let path = old.path().to_path_buf();
        if base == 0 || !matches!(layer.inner().format(), imago::format::Format::Qcow2) {
            return Err(open_err(
                &path,
                "a commit's base must be a qcow2 layer below the top",
            ));
        }
        let err = |e: std::io::Error| open_err(&path, e);
        let mut found = bitmaps::Bitmaps::load(&file).map_err(|e| open_err(&path, e))?;
        match &mut found {
            Some(_) if !active => {
                return Err(open_err(
                    &path,
                    "has QEMU's persistent bitmaps, which a commit into it would not record; \
                     remove them (qemu-img bitmap --remove), or stream instead",
                ));
            }
            Some(b) => b.mark_in_use(&file).map_err(err)?,
            None => {}
        }
        let (state, mut q, header) =
            open_writable(file, &path, old.crypt_shared(), options).map_err(err)?;
        check_l1_covers(&path, &header, q.size())?;
        let cluster_bits = u32::from_be_bytes([header[20], header[21], header[22], header[23]]);
        q.set_backing(self.layers.get(base + 1).cloned());
        let top: Layer = Arc::new(FormatAccess::new(q));
        let size = top.size();
        Ok(Qcow2Image::from_parts(
            Parts {
                top: Arc::clone(&top),
                files: vec![state],
                layers: vec![top],
                writable: true,
                size,
                cluster_bits,
                granule_bits: cluster_bits,
                v3: true,
                l2log: None,
                // An active commit's base takes the device's bitmaps at the
                // pivot (written over the directory it has, if any).
                qemu: active.then_some(QemuBitmaps {
                    dir: found,
                    loaded: None,
                    staged: None,
                    at_snapshot: None,
                    marked: true,
                }),
            },
            options,
        ))
    }

    /// Copies down into `into` (the base's handle, [`Qcow2Image::open_base`],
    /// file `base` of this chain) the clusters of `[offset, offset + len)`
    /// that a layer from `top` to `base` (excluded) has: each as layer
    /// `top` shows it. Whole clusters of the base; blocks.
    pub fn commit_step(
        &self,
        into: &Qcow2Image,
        top: usize,
        base: usize,
        offset: u64,
        len: u64,
    ) -> Result<Step, FormatError> {
        self.commit_extents(into, top, base, &[(offset, len)])
    }

    /// [`Qcow2Image::commit_step`] over several ranges, committed and
    /// synced once at the end. `top` may be 0, the active layer (an active
    /// commit, `super::super::live`'s mirror): its tables are then read
    /// under its metadata lock, one cluster at a time, and a guest write
    /// that lands in a cluster after it was read is the caller's to copy
    /// again (its dirty bitmap has it).
    pub fn commit_extents(
        &self,
        into: &Qcow2Image,
        top: usize,
        base: usize,
        ranges: &[(u64, u64)],
    ) -> Result<Step, FormatError> {
        if base <= top || base >= self.layers.len() {
            return Err(FormatError::Unsupported(format!(
                "no layers {top}..{base} to commit in a chain of {}",
                self.layers.len()
            )));
        }
        let size = self.size().min(into.size());
        let csize = 1u64 << into.cluster_bits;
        let _group = lock(&into.commit_lock);
        let _meta = lock(&into.meta);
        let mut step = Step::default();
        let mut buf = Vec::new();
        for &(offset, len) in ranges {
            let end = offset.saturating_add(len).min(size);
            let mut pos = offset & !(csize - 1);
            while pos < end {
                let cend = (pos + csize).min(size);
                // The active layer's tables change under the guest's
                // writes: read under its lock (the layers below it are
                // written by nothing).
                let active = (top == 0).then(|| lock(&self.meta));
                if self.held_between(top, base, pos, cend)? {
                    buf.clear();
                    buf.resize((cend - pos) as usize, 0);
                    self.read_view(top, pos, &mut buf)?;
                    drop(active);
                    into.forget(pos, cend);
                    into.write_locked_as(&buf, pos, true)?;
                    into.dirty.fetch_add(1, Ordering::AcqRel);
                    step.copied += cend - pos;
                }
                pos = cend;
            }
            step.examined += end.saturating_sub(offset);
        }
        into.commit_locked()?;
        into.files[0]
            .sync_now()
            .map_err(FormatError::io("fdatasync"))?;
        Ok(step)
    }

    /// Whether a layer from `top` down to `base` (excluded) has data or
    /// explicit zeroes anywhere in `[pos, end)`.
    fn held_between(
        &self,
        top: usize,
        base: usize,
        pos: u64,
        end: u64,
    ) -> Result<bool, FormatError> {
        let mut at = pos;
        while at < end {
            let (walked, n) = self.walk(top, base, at, end - at)?;
            if let Walked::At { mapping, .. } = walked
                && !matches!(
                    mapping,
                    ShallowMapping::Eof { .. }
                        | ShallowMapping::Zero {
                            explicit: false,
                            ..
                        }
                )
            {
                return Ok(true);
            }
            at += n;
        }
        Ok(false)
    }

    /// What layer `from` of the chain shows of `[pos, pos + buf.len())`:
    /// its own data and, where it has none, the layers below it, each
    /// decrypted with its own key.
    fn read_view(&self, from: usize, pos: u64, buf: &mut [u8]) -> Result<(), FormatError> {
        let end = pos + buf.len() as u64;
        let mut at = pos;
        while at < end {
            let (walked, n) = self.walk(from, usize::MAX, at, end - at)?;
            let out = &mut buf[(at - pos) as usize..(at - pos + n) as usize];
            match walked {
                Walked::At {
                    mapping:
                        ShallowMapping::Raw {
                            storage, offset, ..
                        },
                    ..
                } => {
                    let file = &storage.0;
                    file.file()
                        .read_exact_at(out, offset)
                        .map_err(FormatError::io("reading a layer"))?;
                    if let Some(crypt) = file.crypt() {
                        let done = crypt.decrypt(offset, out);
                        crate::crypto::key::scrub_after_pass();
                        done.map_err(|e| {
                            FormatError::io("decrypting a layer")(std::io::Error::other(e))
                        })?;
                    }
                }
                Walked::At {
                    mapping: ShallowMapping::Special { .. },
                    layer,
                    offset,
                    ..
                } => {
                    // Compressed: imago reads and inflates it.
                    layer
                        .read(out, offset)
                        .map_err(FormatError::io("reading compressed data"))?;
                }
                _ => out.fill(0),
            }
            at += n;
        }
        Ok(())
    }
}

impl Qcow2Image {
    /// An active commit's pivot: `into` (file `base` of this chain, the
    /// active commit's handle of it, [`Qcow2Image::open_base`], holding
    /// everything the layers above it had) becomes the top, and the layers
    /// above it drop out. The caller keeps every request out and has
    /// copied the last of the top's changes into `into`. This top's
    /// metadata is committed and synced and the top frozen (written no
    /// more); the L2 log and QEMU's bitmaps go to `into`. `switch` makes
    /// the new chain the one a restart serves: an error from it leaves
    /// this image as it was (thawed, the log its own again).
    pub fn pivot(
        &self,
        into: &Qcow2Image,
        base: usize,
        options: &OpenOptions,
        switch: impl FnOnce() -> Result<(), FormatError>,
    ) -> Result<Qcow2Image, FormatError> {
        if !self.writable {
            return Err(FormatError::ReadOnly);
        }
        if base == 0 || base >= self.files.len() {
            return Err(FormatError::Unsupported(format!(
                "no layer {base} to pivot to in a chain of {}",
                self.files.len()
            )));
        }
        self.freeze_top()?;
        let state = &into.files[0];
        let undo = |e: FormatError| {
            self.files[0].thaw();
            if let Some(log) = &self.l2log
                && let Err(again) = self.files[0].adopt_log(Arc::clone(log))
            {
                log::error!(
                    "{}: taking the L2 log back after a failed pivot: {again}",
                    self.files[0].path().display()
                );
            }
            e
        };
        if let Some(log) = &self.l2log {
            state
                .adopt_log(Arc::clone(log))
                .map_err(|e| undo(open_err(state.path(), e)))?;
        }
        switch().map_err(undo)?;
        // From here on the new chain is the one a restart serves.
        let mut files = vec![Arc::clone(state)];
        for f in self.files.iter().skip(base + 1) {
            f.move_up(base);
            files.push(Arc::clone(f));
        }
        let mut layers = vec![Arc::clone(&into.top)];
        layers.extend(self.layers.iter().skip(base + 1).cloned());
        Ok(Qcow2Image::from_parts(
            Parts {
                top: Arc::clone(&into.top),
                files,
                layers,
                writable: true,
                size: self.size(),
                cluster_bits: into.cluster_bits,
                granule_bits: self.granule_bits.min(into.cluster_bits),
                v3: into.v3,
                l2log: self.l2log.clone(),
                qemu: into.take_qemu(),
            },
            options,
        ))
    }
}
