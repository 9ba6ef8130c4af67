//! Stream: the data of the layers between the top and a base copied up
//! into the top, then the top's backing file pointed at the base (or at
//! none), so that those layers drop out of the chain while the guest runs
//! (QEMU's `block-stream`).
//!
//! **Copying** ([`Qcow2Image::stream_step`]) runs under the image's
//! metadata locks, one stretch at a time, so a guest write to a cluster
//! the top does not have (which needs those locks to allocate it) is
//! either before the stretch (the top has it then: skipped) or after it
//! (it overwrites what was copied). Each cluster is looked up layer by
//! layer from the top: one the top has is skipped; one a layer above the
//! base has is copied up (its bytes as the guest reads them, decrypted
//! from the layer it lies in and encrypted for the top when the top is
//! encrypted; zeroes a layer above the base says are explicit become a
//! zero cluster of the top, where the base would show through); one the
//! base or a layer below it has, or no layer has, is left: the top will
//! read it from there. Each stretch's metadata is committed before the
//! next, as an allocating write's is: a kill -9 or a power loss loses at
//! most what the L2 log can leave, and what was copied reads the same as
//! before through the unchanged chain.
//!
//! **The switch** ([`Qcow2Image::rebase`]) runs with every request kept
//! out (the caller, [`crate::disk::Live::rebase`]): the top's metadata is
//! committed and synced, the new backing file's name is written into a
//! free part of the header cluster and synced, and then the header's
//! first 512 bytes (where the name's offset and length and the backing
//! format are) are written in one write and synced: a power loss leaves
//! the old chain or the new one, never a mix (a 512-byte sector is
//! written whole). The top is then opened again on a new descriptor, with
//! the base below it, and the old handle frozen.

use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use imago::format::Format as ImagoFormat;
use imago::format::drivers::FormatDriverInstance;
use imago::qcow2::Qcow2;
use imago::{FormatAccess, ShallowMapping};

use super::{
    ChainFile, FileState, FormatError, Layer, OpenOptions, Parts, Qcow2Image, bitmaps,
    check_l1_covers, lock, open_err,
};
use crate::disk::Mapper;

/// The qcow2 header extension that names the backing file's format.
const BACKING_FORMAT: u32 = 0xe279_2aca;
/// The longest backing file name QEMU accepts.
const MAX_NAME: usize = 1023;

/// What one [`Qcow2Image::stream_step`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Guest bytes looked at (the step's range).
    pub examined: u64,
    /// Of those, bytes copied up into the top (data or zeroes).
    pub copied: u64,
}

/// Where [`Qcow2Image::walk`] ended.
pub(super) enum Walked<'a> {
    /// At the layer it was to stop at: nothing above it answered.
    Below,
    /// Layer `depth` of the chain (`layer`, at `offset` there) answers,
    /// with `mapping` (not `Indirect`).
    At {
        depth: usize,
        layer: &'a FormatAccess<ChainFile>,
        offset: u64,
        mapping: ShallowMapping<'a, ChainFile>,
    },
}

/// Where the data of a stretch of the guest disk lies, for a stream.
enum Found {
    /// In the top already, or at the base or below it (or nowhere):
    /// nothing to copy.
    Stays,
    /// Data in a layer above the base: copy it up.
    Data,
    /// Explicit zeroes in a layer above the base.
    Zeroes,
}

impl Qcow2Image {
    /// Copies up into the top what `[offset, offset + len)` has in the
    /// layers between the top and file `base` of the chain (`base` =
    /// the chain's length: every layer below the top, the image then
    /// standing alone), as the module doc says. `offset` and `len` are
    /// whole clusters of the top (`len` may end at the disk's end).
    /// Blocks.
    pub fn stream_step(&self, base: usize, offset: u64, len: u64) -> Result<Step, FormatError> {
        if !self.writable {
            return Err(FormatError::ReadOnly);
        }
        if base == 0 || base > self.files.len() {
            return Err(FormatError::Unsupported(format!(
                "no layer {base} in a chain of {}",
                self.files.len()
            )));
        }
        let size = self.size();
        let end = offset.saturating_add(len).min(size);
        let csize = 1u64 << self.cluster_bits;
        let alone = base == self.files.len();
        let _group = lock(&self.commit_lock);
        let _meta = lock(&self.meta);
        let mut step = Step::default();
        let mut pos = offset;
        let mut buf = Vec::new();
        while pos < end {
            let cend = ((pos & !(csize - 1)) + csize).min(end);
            let (found, n) = self.found(pos, cend - pos, base)?;
            let n = n.clamp(1, cend - pos);
            match found {
                Found::Stays => {}
                Found::Zeroes if alone => {}
                Found::Zeroes => {
                    // Whole clusters of the top become zero clusters; a
                    // part of one (a layer below has smaller clusters) is
                    // written as zeroes, the rest of its cluster copied
                    // up as a write's copy-on-write copies it.
                    self.imago_changes();
                    let (zofs, zlen) = self
                        .top
                        .inner()
                        .ensure_zero_mapping(pos, n)
                        .map_err(FormatError::io("zeroing"))?;
                    if zofs != pos || zlen != n {
                        buf.clear();
                        buf.resize(n as usize, 0);
                        self.forget(pos, pos + n);
                        self.write_locked_as(&buf, pos, true)?;
                    }
                    self.dirty.fetch_add(1, Ordering::AcqRel);
                    step.copied += n;
                }
                Found::Data => {
                    buf.clear();
                    buf.resize(n as usize, 0);
                    self.read_locked(pos, &mut buf)?;
                    if alone && buf.iter().all(|&b| b == 0) {
                        // Reads as zeroes without a backing file anyway.
                    } else {
                        self.forget(pos, pos + n);
                        self.write_locked_as(&buf, pos, true)?;
                        self.dirty.fetch_add(1, Ordering::AcqRel);
                        step.copied += n;
                    }
                }
            }
            pos += n;
        }
        self.commit_locked()?;
        step.examined = end.saturating_sub(offset);
        Ok(step)
    }

    /// Where `[pos, pos + len)` (inside one cluster of the top) lies,
    /// and for how many bytes the answer holds. Under `meta`.
    fn found(&self, pos: u64, len: u64, base: usize) -> Result<(Found, u64), FormatError> {
        let (walked, n) = self.walk(0, base, pos, len)?;
        let found = match walked {
            Walked::Below => Found::Stays,
            Walked::At { depth: 0, .. } => Found::Stays,
            Walked::At { mapping, .. } => match mapping {
                ShallowMapping::Eof { .. }
                | ShallowMapping::Zero {
                    explicit: false, ..
                } => Found::Stays,
                ShallowMapping::Zero { .. } => Found::Zeroes,
                _ => Found::Data,
            },
        };
        Ok((found, n))
    }

    /// Follows `[pos, pos + len)` from layer `from` of the chain down
    /// through the layers that leave it to their backing file, to the
    /// first that answers for it (data, zeroes, compressed data, or the
    /// end of the chain), or to layer `stop`: where it ended, and for how
    /// many bytes from `pos` that holds (at least 1).
    pub(super) fn walk(
        &self,
        from: usize,
        stop: usize,
        pos: u64,
        len: u64,
    ) -> Result<(Walked<'_>, u64), FormatError> {
        let Some(mut layer) = self.layers.get(from).map(|l| &**l) else {
            return Ok((Walked::Below, len.max(1)));
        };
        let (mut at, mut len) = (pos, len.max(1));
        let mut depth = from;
        loop {
            if depth >= stop {
                return Ok((Walked::Below, len));
            }
            let (mapping, n) = layer
                .get_shallow_mapping(at, len)
                .map_err(FormatError::io("reading metadata"))?;
            let n = n.clamp(1, len);
            match mapping {
                ShallowMapping::Indirect {
                    layer: below,
                    offset,
                    ..
                } => {
                    layer = below;
                    at = offset;
                    len = n;
                    depth += 1;
                }
                mapping => {
                    return Ok((
                        Walked::At {
                            depth,
                            layer,
                            offset: at,
                            mapping,
                        },
                        n,
                    ));
                }
            }
        }
    }

    /// The switch of a stream (see the module doc): the top's backing
    /// file becomes file `base` of the chain (or none, at `base` = the
    /// chain's length), durably, and the image with the layers between
    /// them dropped is returned. `name` is what the header records for
    /// the new backing file (its absolute path). The caller has stopped
    /// the requests; on an error before the header changed, this image
    /// is as it was; after, the error says the image must be served
    /// again (the chain on disk is the new one). `options`: those the
    /// image was opened with (the new handle's ordering and cache).
    /// `written`: the base's handle a commit wrote through
    /// ([`Qcow2Image::open_base`]), which takes the base's place in the
    /// new chain (the old handle's tables do not know what it wrote).
    ///
    /// `above`: the layer whose backing file changes, 0 (the top) but for
    /// a commit of a deeper layer, whose upper layer (read-only in the
    /// chain) is rewritten through `above_file` (that file, opened for
    /// writing); the layers from it up to the top are then opened again
    /// over the base (imago's handles know their backing layer).
    pub fn rebase(
        &self,
        above: usize,
        base: usize,
        name: Option<&str>,
        options: &OpenOptions,
        written: Option<&Qcow2Image>,
        above_file: Option<std::fs::File>,
    ) -> Result<Qcow2Image, FormatError> {
        if !self.writable {
            return Err(FormatError::ReadOnly);
        }
        if base <= above
            || base > self.files.len()
            || name.is_some() != (base < self.files.len())
            || (above > 0) != above_file.is_some()
        {
            return Err(FormatError::Unsupported(format!(
                "no layer {base} to rebase layer {above} onto in a chain of {}",
                self.files.len()
            )));
        }
        let top = &self.files[0];
        let path = top.path().to_path_buf();
        // The layer's own format: a raw file at the bottom, or qcow2.
        let format = self.layers.get(base).map(|l| match l.inner().format() {
            ImagoFormat::Raw => "raw",
            _ => "qcow2",
        });
        let _group = lock(&self.commit_lock);
        let _meta = lock(&self.meta);
        self.commit_locked()?;
        top.sync_now().map_err(FormatError::io("fdatasync"))?;
        match above_file {
            None => {
                let csize = 1u64 << self.cluster_bits;
                rewrite_backing(top, csize, name.zip(format))
                    .map_err(|e| open_err(&path, format!("rewriting the backing file: {e}")))?;
            }
            Some(file) => {
                let upper = self.files[above].path().to_path_buf();
                let err =
                    |e: io::Error| open_err(&upper, format!("rewriting the backing file: {e}"));
                let mut head = [0u8; 24];
                file.read_exact_at(&mut head, 0).map_err(err)?;
                let csize = 1u64 << be32(&head, 20).clamp(9, 21);
                // Not ordered: its writes go straight to the file.
                let state = FileState::new(file, &upper, above).map_err(err)?;
                rewrite_backing(&state, csize, name.zip(format)).map_err(err)?;
            }
        }
        // From here on the chain on disk is the new one.
        let again = |e: io::Error| {
            open_err(
                &path,
                format!(
                    "the chain on disk is the new one, but opening it again failed: {e}; \
                     restart the daemon to serve it"
                ),
            )
        };
        // The base's layer and file: the commit's handle, or as they were.
        let (base_layer, base_file) = match written {
            Some(w) => (Some(Arc::clone(&w.top)), Some(Arc::clone(&w.files[0]))),
            None => (
                self.layers.get(base).cloned(),
                self.files.get(base).cloned(),
            ),
        };
        // The layers between the top and the rewritten one, and that one,
        // opened again (read-only, on their files as they are), bottom up.
        let mut below = base_layer.clone();
        let mut middle = Vec::new();
        for i in (1..=above).rev() {
            let st = &self.files[i];
            let mut q = Qcow2::<ChainFile, Layer>::open_image(ChainFile(Arc::clone(st)), false)
                .map_err(again)?;
            q.set_backing(below);
            let layer: Layer = Arc::new(FormatAccess::new(q));
            below = Some(Arc::clone(&layer));
            middle.insert(0, layer);
        }
        let file = top.file().try_clone().map_err(again)?;
        let (state, mut q, header) =
            open_writable(file, &path, top.crypt_shared(), options).map_err(again)?;
        check_l1_covers(&path, &header, q.size())?;
        q.set_backing(below);
        let new_top: Layer = Arc::new(FormatAccess::new(q));
        // The old handle writes nothing more: everything it had was
        // committed and synced above.
        top.freeze();
        if let Some(log) = &self.l2log {
            state.adopt_log(Arc::clone(log)).map_err(again)?;
        }
        let dropped = base - above - 1;
        let mut files = vec![state];
        let mut layers = vec![Arc::clone(&new_top)];
        files.extend(self.files[1..=above].iter().cloned());
        layers.extend(middle);
        if let (Some(f), Some(l)) = (base_file, base_layer) {
            // The commit's handle of the base is file 0 of its own image:
            // here it is file `above + 1`.
            if written.is_some() {
                for _ in 0..=above {
                    f.move_down();
                }
            } else {
                f.move_up(dropped);
            }
            files.push(f);
            layers.push(l);
        }
        for f in self.files.iter().skip(base + 1) {
            f.move_up(dropped);
            files.push(Arc::clone(f));
        }
        layers.extend(self.layers.iter().skip(base + 1).cloned());
        Ok(Qcow2Image::from_parts(
            Parts {
                top: new_top,
                files,
                layers,
                writable: true,
                size: self.size(),
                cluster_bits: self.cluster_bits,
                granule_bits: self.granule_bits,
                v3: self.v3,
                l2log: self.l2log.clone(),
                // The top's bitmaps stay where they are, in the same file.
                qemu: self.take_qemu(),
            },
            options,
        ))
    }
}

/// imago's handle of a layer opened again ([`open_writable`]).
pub(super) type Reopened = Qcow2<ChainFile, Layer>;

/// Opens `file`, the qcow2 file at `path`, again as a writable layer:
/// a new [`FileState`] (with `crypt`, ordered as `options` say), imago's
/// handle of it (its backing file not yet set) and the header's first
/// 104 bytes.
pub(super) fn open_writable(
    file: std::fs::File,
    path: &std::path::Path,
    crypt: Option<Arc<crate::disk::luks::Crypt>>,
    options: &OpenOptions,
) -> io::Result<(Arc<FileState>, Reopened, [u8; 104])> {
    let mut state = FileState::new(file, path, 0)?;
    if let Some(crypt) = crypt {
        state.set_crypt(crypt);
    }
    state.make_ordered(options.ordered, options.journal.clone());
    // imago sees the header with the autoclear bits cleared before it
    // opens it, as at the first open: else its open would clear them in
    // the file (QEMU's bitmaps would read as inconsistent).
    state.show_imago(bitmaps::header_view(state.file())?);
    let state = Arc::new(state);
    let q = Qcow2::<ChainFile, Layer>::open_image(ChainFile(Arc::clone(&state)), true)?;
    state.load_shadow()?;
    let mut header = [0u8; 104];
    state.file().read_exact_at(&mut header, 0)?;
    Ok((state, q, header))
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
}

/// Points the header of the qcow2 file of `top` (clusters of `csize`) at
/// the backing file `new` (its name and format), or at none: the name
/// first, into a part of the header cluster nothing uses (never over the
/// old name), synced; then the first 512 bytes with the name's offset and
/// length and the format, in one write, synced.
pub(super) fn rewrite_backing(
    top: &FileState,
    csize: u64,
    new: Option<(&str, &str)>,
) -> io::Result<()> {
    let file = top.file();
    let bad = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
    let span = csize.min(2 << 20) as usize;
    let mut cluster = vec![0u8; span];
    let got = file.read_at(&mut cluster, 0)?;
    cluster.truncate(got);
    if cluster.len() < 512 {
        return Err(bad("the header is cut short".into()));
    }
    let version = be32(&cluster, 4);
    let ext_start = if version >= 3 {
        be32(&cluster, 100) as usize
    } else {
        72
    };
    // The extensions: where the format's is, and where they end.
    let mut at = ext_start;
    let mut format_ext = None;
    let ext_end = loop {
        if at + 8 > cluster.len() {
            return Err(bad(
                "the header extensions run past the header cluster".into()
            ));
        }
        let (kind, len) = (be32(&cluster, at), be32(&cluster, at + 4) as usize);
        if kind == 0 {
            break at + 8;
        }
        let padded = len.div_ceil(8) * 8;
        if kind == BACKING_FORMAT {
            format_ext = Some((at, padded));
        }
        at += 8 + padded;
    };
    let old = (be64(&cluster, 8) as usize, be32(&cluster, 16) as usize);
    let mut sector = cluster[..512].to_vec();
    match new {
        None => {
            sector[8..16].copy_from_slice(&0u64.to_be_bytes());
            sector[16..20].copy_from_slice(&0u32.to_be_bytes());
        }
        Some((name, format)) => {
            if name.is_empty() || name.len() > MAX_NAME {
                return Err(bad(format!("a backing file name of {} bytes", name.len())));
            }
            // The format goes in its extension, rewritten in place: it
            // must be in the first sector, and the name fit in its room.
            let Some((fat, room)) = format_ext else {
                return Err(bad("the header has no backing format extension".into()));
            };
            if fat + 8 + room > 512 || format.len() > room {
                return Err(bad(
                    "the backing format extension is not where one write can change it \
                     (the header's first 512 bytes)"
                        .into(),
                ));
            }
            // The name's place: after the extensions and after the old
            // name, else right after the extensions if the old name is
            // not in the way.
            let after_old = old.0.saturating_add(old.1);
            let place = [ext_end.max(after_old), ext_end]
                .into_iter()
                .map(|p| p.max(512))
                .find(|&p| {
                    p + name.len() <= cluster.len()
                        && (old.1 == 0 || p >= after_old || p + name.len() <= old.0)
                })
                .ok_or_else(|| {
                    bad("no room for the backing file name in the header cluster".into())
                })?;
            top.copy_write(name.as_bytes(), place as u64)?;
            top.sync_only()?;
            sector[8..16].copy_from_slice(&(place as u64).to_be_bytes());
            sector[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
            sector[fat + 4..fat + 8].copy_from_slice(&(format.len() as u32).to_be_bytes());
            let data = &mut sector[fat + 8..fat + 8 + room];
            data.fill(0);
            data[..format.len()].copy_from_slice(format.as_bytes());
        }
    }
    top.copy_write(&sector, 0)?;
    top.sync_only()
}
