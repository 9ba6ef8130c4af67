//! Backups as files: what `ringblk backup` writes into its directory, and
//! reads back to verify, restore and prune (docs/backup.md). The command
//! (`src/cli/backup.rs`) decides *when* (the bitmap, full or incremental,
//! `backup start` and `stop`); this module does the copying and keeps the
//! directory's one record, the manifest.
//!
//! **The directory.** `NNNN-full.qcow2` (a standalone qcow2 image of the
//! disk at one instant) and `NNNN-inc.qcow2` (a qcow2 overlay of the
//! previous backup's file that holds the granules changed since, a range
//! the guest discarded or zeroed as zero clusters, so that the older data
//! does not show through), each with `NNNN-*.sums` (the SHA-256 of every
//! [`CHUNK`] of the disk at that instant), and `manifest.json`: one
//! [`Point`] per backup, with the SHA-256 of the sums (the disk's content
//! at the instant) and of the file itself.
//!
//! **Order.** A backup is written as `NAME.partial`, flushed, its sums
//! written and synced, then renamed to `NAME` and the directory synced;
//! the caller then adds it to the manifest (written to `manifest.json.tmp`,
//! synced, renamed over the old one, the directory synced) and only then
//! ends the daemon's backup as a success, which clears the bitmap's bits:
//! a crash before the manifest names the file leaves the bits in the
//! bitmap, and the next backup copies them again. Files the manifest does
//! not name are removed by the next `take` (a backup cut short).
//!
//! **Checksums.** The sums are computed while copying: a full backup's
//! from what it reads (zero chunks from the export's allocation map), an
//! incremental's from the previous backup's sums, with the chunks that
//! changed read whole from the export (the point-in-time view: the bytes
//! around the changed granules are the instant's as well). Verifying then
//! needs no second read of the live disk: it reads the backup chain and
//! compares, and compares each file's own SHA-256 (a flipped byte anywhere
//! in a file, data or not, is found).

use std::fs::{self, File, OpenOptions as FsOpen};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::disk::{self, Format, FormatError, Image, OpenOptions, reader, writer};
use crate::nbd::client::{Client, ClientError, MAX_READ};
use crate::nbd::proto::{CONTEXT_ALLOCATION, CONTEXT_BITMAP_PREFIX, STATE_DIRTY, STATE_ZERO};

/// What a checksum covers, and what an incremental copies at least: a
/// chunk of the disk (the last one may be shorter). Also the backup
/// files' cluster size, so that a chunk written is whole clusters.
pub const CHUNK: u64 = 64 << 10;
/// The manifest's name in the directory.
pub const MANIFEST: &str = "manifest.json";
/// The manifest's format version.
const VERSION: u32 = 1;
/// The most bytes a manifest may hold (one line per backup).
const MANIFEST_MAX: usize = 16 << 20;
/// Bytes asked of the export at a time.
const READ: u64 = MAX_READ as u64;

/// Why a backup, a verify, a restore or a prune failed.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error(transparent)]
    Nbd(#[from] ClientError),
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The directory's content is not what the manifest says.
    #[error("{0}")]
    Mismatch(String),
    /// The request cannot be done with this directory.
    #[error("{0}")]
    Invalid(String),
}

type Res<T> = Result<T, ArchiveError>;

fn io_err(path: &Path) -> impl Fn(io::Error) -> ArchiveError + '_ {
    move |source| ArchiveError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A backup's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// The whole disk, standing alone.
    Full,
    /// What changed since the previous point, over its file.
    Incremental,
}

/// One backup (a restore point).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Point {
    /// Its number, from 1.
    pub n: u32,
    /// Its file in the directory.
    pub file: String,
    pub kind: Kind,
    /// The instant (seconds since the epoch): when the export started.
    pub at: u64,
    /// The dirty bitmap it was taken with, if any.
    pub bitmap: Option<String>,
    /// The disk's size at the instant.
    pub size: u64,
    /// The bitmap's granularity (0: none).
    pub granularity: u64,
    /// Bytes written into the file (data and zeroes).
    pub copied: u64,
    /// Its sums file in the directory.
    pub sums: String,
    /// SHA-256 of the sums: the disk's content at the instant.
    pub sha256: String,
    /// SHA-256 of the file.
    pub file_sha256: String,
}

/// The directory's record of its backups, oldest first.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Manifest {
    pub ringblk_backups: u32,
    pub points: Vec<Point>,
}

impl Manifest {
    /// The manifest of `dir`, or an empty one if it has none yet. Read
    /// without following a symlink, bounded. A file a prune left as
    /// `FILE.partial` whose hash the manifest already records is put in
    /// place (the prune's last step), any other `.partial` removed.
    pub fn load(dir: &Path) -> Res<Manifest> {
        let path = dir.join(MANIFEST);
        let m = match crate::host::open_untrusted(
            &path,
            crate::host::Untrusted {
                nofollow: true,
                ..Default::default()
            },
        ) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Manifest {
                ringblk_backups: VERSION,
                points: Vec::new(),
            },
            Err(e) => return Err(io_err(&path)(e)),
            Ok(f) => {
                let bytes = crate::host::read_capped(&f, MANIFEST_MAX).map_err(io_err(&path))?;
                let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
                    ArchiveError::Invalid(format!("{}: not a manifest: {e}", path.display()))
                })?;
                if m.ringblk_backups != VERSION {
                    return Err(ArchiveError::Invalid(format!(
                        "{}: version {}, which this ringblk does not know",
                        path.display(),
                        m.ringblk_backups
                    )));
                }
                for p in &m.points {
                    check_name(&p.file)?;
                    check_name(&p.sums)?;
                }
                m
            }
        };
        m.finish_prune(dir)?;
        Ok(m)
    }

    /// Writes the manifest into `dir` durably: a temporary file, synced,
    /// renamed over the old one, the directory synced.
    pub fn save(&self, dir: &Path) -> Res<()> {
        let tmp = dir.join(format!("{MANIFEST}.tmp"));
        let mut text =
            serde_json::to_string_pretty(self).map_err(|e| ArchiveError::Invalid(e.to_string()))?;
        text.push('\n');
        write_new(&tmp, text.as_bytes())?;
        fs::rename(&tmp, dir.join(MANIFEST)).map_err(io_err(&tmp))?;
        sync_dir(dir)
    }

    /// The point numbered `n`, or the last one.
    pub fn point(&self, n: Option<u32>) -> Res<&Point> {
        let found = match n {
            Some(n) => self.points.iter().find(|p| p.n == n),
            None => self.points.last(),
        };
        found.ok_or_else(|| {
            ArchiveError::Invalid(match n {
                Some(n) => format!(
                    "no backup {n:04} in the manifest (it has {})",
                    self.numbers()
                ),
                None => "the directory has no backup yet".into(),
            })
        })
    }

    fn numbers(&self) -> String {
        if self.points.is_empty() {
            return "none".into();
        }
        self.points
            .iter()
            .map(|p| format!("{:04}", p.n))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The points whose files `point`'s file is read through, oldest
    /// first: back to the last full one.
    pub fn chain(&self, point: &Point) -> Res<Vec<&Point>> {
        let mut chain = Vec::new();
        let Some(mut i) = self.points.iter().position(|p| p.n == point.n) else {
            return Err(ArchiveError::Invalid(format!("no backup {:04}", point.n)));
        };
        loop {
            let p = &self.points[i];
            chain.insert(0, p);
            if p.kind == Kind::Full {
                return Ok(chain);
            }
            if i == 0 {
                return Err(ArchiveError::Mismatch(format!(
                    "backup {:04} is incremental, and no full backup precedes it",
                    point.n
                )));
            }
            i -= 1;
        }
    }

    /// A `FILE.partial` next to a point's `FILE` is a prune cut short
    /// after it recorded the new file's hash: put in place if its hash is
    /// the manifest's; removed otherwise (cut short before).
    fn finish_prune(&self, dir: &Path) -> Res<()> {
        for p in &self.points {
            let partial = dir.join(format!("{}.partial", p.file));
            if !partial.exists() {
                continue;
            }
            if file_sha256(&partial)? == p.file_sha256 {
                fs::rename(&partial, dir.join(&p.file)).map_err(io_err(&partial))?;
                sync_dir(dir)?;
            } else {
                let _ = fs::remove_file(&partial);
            }
        }
        Ok(())
    }
}

/// A file name the manifest may give: a plain name in the directory.
fn check_name(name: &str) -> Res<()> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(ArchiveError::Invalid(format!(
            "the manifest names {name:?}, which is not a file in the directory"
        )));
    }
    Ok(())
}

/// Creates `path` (which must not exist), writes `data` and syncs it.
fn write_new(path: &Path, data: &[u8]) -> Res<()> {
    let _ = fs::remove_file(path);
    let mut f = FsOpen::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io_err(path))?;
    f.write_all(data).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

fn sync_dir(dir: &Path) -> Res<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

/// The SHA-256 of the file at `path`, in hex.
pub fn file_sha256(path: &Path) -> Res<String> {
    let mut f = FsOpen::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(io_err(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The sums of a disk: one SHA-256 per [`CHUNK`].
#[derive(Clone)]
pub struct Sums(Vec<[u8; 32]>);

impl Sums {
    /// A disk of `size` bytes that reads as zeroes.
    fn zeroes(size: u64) -> Sums {
        let whole = Sha256::digest(vec![0u8; CHUNK as usize]).into();
        let mut v = vec![whole; size.div_ceil(CHUNK) as usize];
        if !size.is_multiple_of(CHUNK)
            && let Some(last) = v.last_mut()
        {
            *last = Sha256::digest(vec![0u8; (size % CHUNK) as usize]).into();
        }
        Sums(v)
    }

    /// Chunk `i`'s sum becomes that of `data` (the whole chunk).
    fn set(&mut self, i: usize, data: &[u8]) {
        self.0[i] = Sha256::digest(data).into();
    }

    /// The SHA-256 of the sums: the disk's checksum.
    pub fn root(&self) -> String {
        let mut h = Sha256::new();
        for s in &self.0 {
            h.update(s);
        }
        hex(&h.finalize())
    }

    fn bytes(&self) -> Vec<u8> {
        self.0.concat()
    }

    /// Reads the sums file `name` of `dir`, which must have `chunks` sums
    /// and the root `root`.
    fn load(dir: &Path, name: &str, chunks: usize, root: &str) -> Res<Sums> {
        let path = dir.join(name);
        let f = crate::host::open_untrusted(
            &path,
            crate::host::Untrusted {
                nofollow: true,
                ..Default::default()
            },
        )
        .map_err(io_err(&path))?;
        let bytes = crate::host::read_capped(&f, chunks * 32 + 1).map_err(io_err(&path))?;
        if bytes.len() != chunks * 32 {
            return Err(ArchiveError::Mismatch(format!(
                "{}: {} bytes, not the {} of a disk of {chunks} chunks",
                path.display(),
                bytes.len(),
                chunks * 32
            )));
        }
        let sums = Sums(
            bytes
                .chunks_exact(32)
                .map(|c| c.try_into().unwrap_or([0; 32]))
                .collect(),
        );
        if sums.root() != root {
            return Err(ArchiveError::Mismatch(format!(
                "{}: its checksum is not the manifest's (the file was changed)",
                path.display()
            )));
        }
        Ok(sums)
    }
}

/// What `take` is asked for.
pub struct Take<'a> {
    /// The backup directory.
    pub dir: &'a Path,
    /// The export's socket.
    pub socket: &'a Path,
    /// The bitmap the export offers (`qemu:dirty-bitmap:NAME`).
    pub bitmap: Option<&'a str>,
    /// Its granularity.
    pub granularity: u64,
    /// An incremental over the manifest's last point (else a full one).
    pub incremental: bool,
    /// The instant, seconds since the epoch.
    pub at: u64,
}

/// Copies the export at `t.socket` into a new file of `t.dir` (see the
/// module doc) and returns its point, not yet in the manifest (the caller
/// adds it). `progress` hears of the bytes gone through, out of the
/// total. Files a backup cut short left are removed first.
pub fn take(t: &Take<'_>, manifest: &Manifest, progress: &mut dyn FnMut(u64, u64)) -> Res<Point> {
    remove_strays(t.dir, manifest)?;
    let prev = match (t.incremental, manifest.points.last()) {
        (true, Some(p)) => Some(p),
        (true, None) => {
            return Err(ArchiveError::Invalid(
                "an incremental backup needs a previous one".into(),
            ));
        }
        (false, _) => None,
    };
    let n = manifest.points.last().map_or(1, |p| p.n + 1);
    let kind = if prev.is_some() {
        Kind::Incremental
    } else {
        Kind::Full
    };
    let name = format!(
        "{n:04}-{}.qcow2",
        if kind == Kind::Full { "full" } else { "inc" }
    );
    let bitmap_context = t.bitmap.map(|b| format!("{CONTEXT_BITMAP_PREFIX}{b}"));
    let mut contexts = vec![CONTEXT_ALLOCATION];
    if let (Some(c), Some(_)) = (&bitmap_context, prev) {
        contexts.push(c);
    }
    let mut client = Client::connect(t.socket, &contexts)?;
    let size = client.size();
    let mut sums = match prev {
        Some(p) => {
            if p.size != size {
                return Err(ArchiveError::Invalid(format!(
                    "the disk is {size} bytes, and was {} at backup {:04}: take a full backup",
                    p.size, p.n
                )));
            }
            Sums::load(t.dir, &p.sums, size.div_ceil(CHUNK) as usize, &p.sha256).map_err(
                |e| {
                    ArchiveError::Mismatch(format!(
                        "{e}: an incremental backup over backup {:04} cannot be checked; take a full one (--full)",
                        p.n
                    ))
                },
            )?
        }
        None => Sums::zeroes(size),
    };
    // What to read: a full backup, what is not known to read as zeroes;
    // an incremental, the chunks with a dirty granule.
    let ranges = match (&bitmap_context, prev) {
        (Some(c), Some(_)) => runs(&mut client, size, c, |f| f & STATE_DIRTY != 0)?,
        _ => runs(&mut client, size, CONTEXT_ALLOCATION, |f| {
            f & STATE_ZERO == 0
        })?,
    };
    let ranges = chunked(&ranges, size);
    let partial = t.dir.join(format!("{name}.partial"));
    let copied = (|| {
        let file = FsOpen::new()
            .read(true)
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&partial)
            .map_err(io_err(&partial))?;
        let backing = prev.map(|p| (p.file.as_str(), "qcow2"));
        disk::qcow2::create(&file, &partial, size, CHUNK, backing).map_err(io_err(&partial))?;
        file.sync_all().map_err(io_err(&partial))?;
        drop(file);
        let image = disk::open(
            &partial,
            Format::Qcow2,
            &OpenOptions {
                writable: true,
                ..OpenOptions::default()
            },
        )?;
        let total: u64 = ranges.iter().map(|r| u64::from(r.1)).sum();
        let mut done = 0;
        let mut copied = 0;
        let incremental = prev.is_some();
        client.read_ranges(&ranges, |offset, data| {
            // Runs of chunks of one kind (data, or zeroes), each written
            // with one call: an allocating write's metadata is committed
            // (after an fdatasync of its data) once per call.
            let mut run: Option<(bool, usize)> = None;
            let n = data.len().div_ceil(CHUNK as usize);
            for i in 0..=n {
                let chunk = (i < n).then(|| {
                    let start = i * CHUNK as usize;
                    &data[start..(start + CHUNK as usize).min(data.len())]
                });
                let zero = chunk.map(|c| c.iter().all(|&b| b == 0));
                if let Some(c) = chunk {
                    sums.set(((offset / CHUNK) as usize) + i, c);
                }
                if let Some((kind, first)) = run
                    && zero != Some(kind)
                {
                    let start = first * CHUNK as usize;
                    let end = (i * CHUNK as usize).min(data.len());
                    let at = offset + start as u64;
                    let piece = &data[start..end];
                    let written = match (kind, incremental) {
                        // Nothing to write: a new image reads as zeroes.
                        (true, false) => Ok(()),
                        // The older backup's data must not show through.
                        (true, true) => {
                            writer::write_zeroes(&*image, at, piece.len() as u64, false)
                        }
                        (false, _) => writer::write(&*image, at, piece, false),
                    };
                    written.map_err(|e| {
                        ClientError::Refused(format!("writing {}: {e}", partial.display()))
                    })?;
                    if !kind || incremental {
                        copied += piece.len() as u64;
                    }
                    run = None;
                }
                if let (None, Some(z)) = (run, zero) {
                    run = Some((z, i));
                }
            }
            done += data.len() as u64;
            progress(done, total);
            Ok(())
        })?;
        writer::flush(&*image)?;
        Ok::<u64, ArchiveError>(copied)
    })();
    let copied = match copied {
        Ok(c) => c,
        Err(e) => {
            let _ = fs::remove_file(&partial);
            return Err(e);
        }
    };
    let sums_name = format!(
        "{n:04}-{}.sums",
        if kind == Kind::Full { "full" } else { "inc" }
    );
    let finish = || -> Res<Point> {
        write_new(&t.dir.join(&sums_name), &sums.bytes())?;
        let file_sha256 = file_sha256(&partial)?;
        fs::rename(&partial, t.dir.join(&name)).map_err(io_err(&partial))?;
        sync_dir(t.dir)?;
        Ok(Point {
            n,
            file: name.clone(),
            kind,
            at: t.at,
            bitmap: t.bitmap.map(str::to_string),
            size,
            granularity: t.granularity,
            copied,
            sums: sums_name.clone(),
            sha256: sums.root(),
            file_sha256,
        })
    };
    finish().inspect_err(|_| {
        let _ = fs::remove_file(&partial);
        let _ = fs::remove_file(t.dir.join(&sums_name));
    })
}

/// The runs of `context` over the whole export whose flags `want` says
/// yes to, as `(offset, length)`.
fn runs(
    client: &mut Client,
    size: u64,
    context: &str,
    want: impl Fn(u32) -> bool,
) -> Res<Vec<(u64, u64)>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut at = 0;
    while at < size {
        let len = (size - at).min(1 << 30) as u32;
        let extents = client.block_status(at, len, &[context])?;
        let mut pos = at;
        for &(n, flags) in &extents[0] {
            let n = n.min(size - pos);
            if want(flags) {
                match out.last_mut() {
                    Some(last) if last.0 + last.1 == pos => last.1 += n,
                    _ => out.push((pos, n)),
                }
            }
            pos += n;
            if pos >= size {
                break;
            }
        }
        if pos == at {
            return Err(ArchiveError::Nbd(ClientError::Protocol(
                "block status that covers nothing".into(),
            )));
        }
        at = pos;
    }
    Ok(out)
}

/// `ranges` widened to whole chunks (the last one ends at `size`), merged,
/// and cut into reads of at most [`READ`] bytes.
fn chunked(ranges: &[(u64, u64)], size: u64) -> Vec<(u64, u32)> {
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for &(o, l) in ranges {
        let start = o - o % CHUNK;
        let end = (o + l).div_ceil(CHUNK).saturating_mul(CHUNK).min(size);
        match merged.last_mut() {
            Some(last) if last.1 >= start => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    let mut out = Vec::new();
    for (mut start, end) in merged {
        while start < end {
            let n = (end - start).min(READ);
            out.push((start, n as u32));
            start += n;
        }
    }
    out
}

/// Removes what a backup cut short left: `NNNN-*.qcow2(.partial)` and
/// `NNNN-*.sums` files the manifest does not name, numbered after its
/// last point.
fn remove_strays(dir: &Path, manifest: &Manifest) -> Res<()> {
    let last = manifest.points.last().map_or(0, |p| p.n);
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some((num, rest)) = name.split_once('-') else {
            continue;
        };
        let Ok(num) = num.parse::<u32>() else {
            continue;
        };
        let ours = [".qcow2", ".qcow2.partial", ".sums"]
            .iter()
            .any(|s| rest.ends_with(s))
            && (rest.starts_with("full") || rest.starts_with("inc"));
        if ours && num > last {
            let _ = fs::remove_file(entry.path());
        }
    }
    Ok(())
}

/// The disk of backup `point`, opened through its chain (read-only).
fn open_point(dir: &Path, point: &Point) -> Res<Box<dyn Image>> {
    let options = OpenOptions {
        writable: false,
        backing_dirs: Some(vec![fs::canonicalize(dir).map_err(io_err(dir))?]),
        ..OpenOptions::default()
    };
    Ok(disk::open(&dir.join(&point.file), Format::Qcow2, &options)?)
}

/// Reads the disk of `image` (`size` bytes) a chunk at a time into `each`
/// (its offset and bytes), and returns its sums.
fn read_disk(
    image: &dyn Image,
    size: u64,
    progress: &mut dyn FnMut(u64, u64),
    each: &mut dyn FnMut(u64, &[u8]) -> Res<()>,
) -> Res<Sums> {
    let mut sums = Sums::zeroes(size);
    let mut buf = vec![0u8; READ as usize];
    let mut at = 0;
    while at < size {
        let n = (size - at).min(READ) as usize;
        reader::read_at(image, &mut buf[..n], at).map_err(|e| ArchiveError::Io {
            path: format!("the backup's disk at byte {at}"),
            source: e,
        })?;
        for (i, chunk) in buf[..n].chunks(CHUNK as usize).enumerate() {
            sums.set((at / CHUNK) as usize + i, chunk);
        }
        each(at, &buf[..n])?;
        at += n as u64;
        progress(at, size);
    }
    Ok(sums)
}

/// What `verify` found.
#[derive(Debug, Serialize)]
pub struct Verified {
    pub n: u32,
    /// The files read, oldest first, each matching its recorded hash.
    pub files: Vec<String>,
    pub sha256: String,
}

/// Checks backup `upto` (the last without): every file of its chain
/// against its recorded SHA-256, then its disk, read through the chain,
/// against the checksum recorded at the instant (the sums file names the
/// first chunk that differs).
pub fn verify(dir: &Path, upto: Option<u32>, progress: &mut dyn FnMut(u64, u64)) -> Res<Verified> {
    let manifest = Manifest::load(dir)?;
    let point = manifest.point(upto)?;
    let chain = manifest.chain(point)?;
    for p in &chain {
        let got = file_sha256(&dir.join(&p.file))?;
        if got != p.file_sha256 {
            return Err(ArchiveError::Mismatch(format!(
                "{}: its SHA-256 is {got}, the manifest says {}: the file was changed or damaged",
                dir.join(&p.file).display(),
                p.file_sha256
            )));
        }
    }
    let image = open_point(dir, point)?;
    if image.size() != point.size {
        return Err(ArchiveError::Mismatch(format!(
            "backup {:04} reads as {} bytes, the manifest says {}",
            point.n,
            image.size(),
            point.size
        )));
    }
    let sums = read_disk(&*image, point.size, progress, &mut |_, _| Ok(()))?;
    if sums.root() != point.sha256 {
        let first = Sums::load(
            dir,
            &point.sums,
            point.size.div_ceil(CHUNK) as usize,
            &point.sha256,
        )
        .ok()
        .and_then(|rec| rec.0.iter().zip(&sums.0).position(|(a, b)| a != b));
        return Err(ArchiveError::Mismatch(format!(
            "backup {:04} does not read as the disk did at its instant{}",
            point.n,
            first.map_or(String::new(), |i| format!(
                " (first at byte {})",
                i as u64 * CHUNK
            ))
        )));
    }
    Ok(Verified {
        n: point.n,
        files: chain.iter().map(|p| p.file.clone()).collect(),
        sha256: sums.root(),
    })
}

/// The format `restore` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreFormat {
    Raw,
    Qcow2,
}

/// Writes the disk of backup `upto` (the last without) into a new file
/// `to` (which must not exist), sparse: chunks of zeroes are not written.
/// The disk read is checked against the checksum of its instant; the
/// file is removed if it does not match.
pub fn restore(
    dir: &Path,
    upto: Option<u32>,
    to: &Path,
    format: RestoreFormat,
    progress: &mut dyn FnMut(u64, u64),
) -> Res<Point> {
    let manifest = Manifest::load(dir)?;
    let point = manifest.point(upto)?.clone();
    let image = open_point(dir, &point)?;
    let file = FsOpen::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(to)
        .map_err(io_err(to))?;
    let done = (|| {
        let out: Option<Box<dyn Image>> = match format {
            RestoreFormat::Raw => {
                file.set_len(point.size).map_err(io_err(to))?;
                None
            }
            RestoreFormat::Qcow2 => {
                disk::qcow2::create(&file, to, point.size, CHUNK, None).map_err(io_err(to))?;
                file.sync_all().map_err(io_err(to))?;
                Some(disk::open(
                    to,
                    Format::Qcow2,
                    &OpenOptions {
                        writable: true,
                        ..OpenOptions::default()
                    },
                )?)
            }
        };
        let sums = read_disk(&*image, point.size, progress, &mut |at, data| {
            for (i, chunk) in data.chunks(CHUNK as usize).enumerate() {
                if chunk.iter().all(|&b| b == 0) {
                    continue;
                }
                let pos = at + i as u64 * CHUNK;
                match &out {
                    None => file.write_all_at(chunk, pos).map_err(io_err(to))?,
                    Some(img) => writer::write(&**img, pos, chunk, false)?,
                }
            }
            Ok(())
        })?;
        if let Some(img) = &out {
            writer::flush(&**img)?;
        }
        file.sync_all().map_err(io_err(to))?;
        if sums.root() != point.sha256 {
            return Err(ArchiveError::Mismatch(format!(
                "backup {:04} does not read as the disk did at its instant (verify it)",
                point.n
            )));
        }
        Ok(())
    })();
    if let Err(e) = done {
        let _ = fs::remove_file(to);
        return Err(e);
    }
    Ok(point)
}

/// What `prune` did.
#[derive(Debug, Serialize)]
pub struct Pruned {
    /// The points kept, oldest first.
    pub kept: Vec<u32>,
    /// The files removed.
    pub removed: Vec<String>,
}

/// Keeps the newest `keep` restore points: the oldest kept one, if it is
/// incremental, becomes a full backup (its chain flattened into a new
/// file that takes its file's name, so the later ones still read through
/// it), and the older points' files go. Offline, on the backup files
/// only. Crash-safe: the new file is written as `FILE.partial` and its
/// hash recorded in the manifest before it is put in place (a load
/// finishes that, [`Manifest::load`]); files go once no manifest names
/// them.
pub fn prune(dir: &Path, keep: usize, progress: &mut dyn FnMut(u64, u64)) -> Res<Pruned> {
    if keep == 0 {
        return Err(ArchiveError::Invalid(
            "--keep 0 would remove every backup".into(),
        ));
    }
    let mut manifest = Manifest::load(dir)?;
    if manifest.points.len() <= keep {
        return Ok(Pruned {
            kept: manifest.points.iter().map(|p| p.n).collect(),
            removed: Vec::new(),
        });
    }
    let first = manifest.points.len() - keep;
    let oldest = manifest.points[first].clone();
    let old = manifest.points[..first].to_vec();
    if oldest.kind == Kind::Incremental {
        let partial = dir.join(format!("{}.partial", oldest.file));
        let _ = fs::remove_file(&partial);
        // The chain flattened, its sums checked as it is read.
        restore(
            dir,
            Some(oldest.n),
            &partial,
            RestoreFormat::Qcow2,
            progress,
        )?;
        let hash = file_sha256(&partial)?;
        let p = &mut manifest.points[first];
        p.kind = Kind::Full;
        p.file_sha256 = hash;
        p.copied = fs::metadata(&partial).map_err(io_err(&partial))?.len();
        manifest.points.drain(..first);
        manifest.save(dir)?;
        // The last step: in place (a load does it after a crash here).
        fs::rename(&partial, dir.join(&oldest.file)).map_err(io_err(&partial))?;
        sync_dir(dir)?;
    } else {
        manifest.points.drain(..first);
        manifest.save(dir)?;
    }
    let mut removed = Vec::new();
    for p in &old {
        for name in [&p.file, &p.sums] {
            if fs::remove_file(dir.join(name)).is_ok() {
                removed.push(name.clone());
            }
        }
    }
    sync_dir(dir)?;
    Ok(Pruned {
        kept: manifest.points.iter().map(|p| p.n).collect(),
        removed,
    })
}

/// The directory's lock, held by a `ringblk backup` command for its run:
/// one at a time per directory.
pub struct DirLock(#[allow(dead_code)] File);

impl DirLock {
    /// Takes `DIR/.lock` (created if missing), or says who may hold it.
    pub fn take(dir: &Path) -> Res<DirLock> {
        let path = dir.join(".lock");
        let f = FsOpen::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io_err(&path))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe {
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&f),
                libc::LOCK_EX | libc::LOCK_NB,
            )
        } != 0
        {
            return Err(ArchiveError::Invalid(format!(
                "{}: another `ringblk backup` works in this directory",
                dir.display()
            )));
        }
        Ok(DirLock(f))
    }
}

/// `dir`'s backup files, for a message: the point numbers and kinds.
pub fn describe(manifest: &Manifest) -> String {
    manifest
        .points
        .iter()
        .map(|p| {
            format!(
                "{:04} {}",
                p.n,
                if p.kind == Kind::Full { "full" } else { "inc" }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The directory's path made absolute, for the files it names.
pub fn absolute(dir: &Path) -> Res<PathBuf> {
    fs::canonicalize(dir).map_err(io_err(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_widen_to_chunks_merge_and_split_into_reads() {
        let size = 20 * READ + 100;
        // Two granules in one chunk, one in the next: one read.
        assert_eq!(
            chunked(&[(4096, 4096), (CHUNK - 512, 1024)], size),
            [(0, 2 * CHUNK as u32)]
        );
        // A run longer than a read is cut; the disk's end is the end.
        let got = chunked(&[(1, 2 * READ)], size);
        assert_eq!(
            got,
            [
                (0, READ as u32),
                (READ, READ as u32),
                (2 * READ, CHUNK as u32)
            ]
        );
        assert_eq!(chunked(&[(size - 10, 10)], size), [(size - 100, 100)]);
    }

    #[test]
    fn the_sums_of_zeroes_are_those_of_zero_chunks() {
        let size = 3 * CHUNK + 512;
        let mut sums = Sums::zeroes(size);
        let zero = sums.root();
        sums.set(3, &[0u8; 512]);
        assert_eq!(sums.root(), zero, "the short last chunk");
        sums.set(1, &[1u8; CHUNK as usize]);
        assert_ne!(sums.root(), zero);
        sums.set(1, &[0u8; CHUNK as usize]);
        assert_eq!(sums.root(), zero);
    }

    #[test]
    fn a_manifest_naming_a_path_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut m = Manifest {
            ringblk_backups: VERSION,
            points: Vec::new(),
        };
        m.points.push(Point {
            n: 1,
            file: "../../etc/passwd".into(),
            kind: Kind::Full,
            at: 0,
            bitmap: None,
            size: 0,
            granularity: 0,
            copied: 0,
            sums: "0001-full.sums".into(),
            sha256: String::new(),
            file_sha256: String::new(),
        });
        m.save(dir.path()).unwrap();
        let err = Manifest::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("not a file in the directory"), "{err}");
    }
}
