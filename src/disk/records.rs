//! Snapshot records: what a live snapshot leaves in the snapshot directory
//! so that a restarted daemon serves the new top, not the old one.
//!
//! A live snapshot makes an overlay the top of the chain; the image named
//! by `--image` is from then on a point-in-time image, never written
//! again. Nothing on the command line says so: systemd, an upgrade or an
//! operator restarting the daemon with the same command line would serve
//! the old top read-write again, losing every write made since (they are
//! in the overlay) and changing the overlay's backing under it. So each
//! snapshot records the switch, and the daemon follows the records at
//! start-up ([`follow`]).
//!
//! **The record.** One file per snapshot, in the snapshot directory, named
//! after the overlay: `NEW` gets `NEW.ringblk-snapshot`
//! ([`RECORD_SUFFIX`]; overlay names ending so are refused). It holds one
//! line of JSON:
//!
//! ```text
//! {"ringblk_snapshot":1,"superseded":"/abs/path/of/the/old/top","by":"NEW","at":1764118200}
//! ```
//!
//! `superseded` is the old top's absolute path, as the overlay's backing
//! file names it; `by` is the overlay's file name in the directory; `at`
//! the time of the snapshot in seconds since the epoch.
//!
//! **Order.** The overlay is formatted and synced first, then the record
//! is created (`O_CREAT|O_EXCL`: no rename, which the sandbox does not
//! allow, and never an overwrite), written, synced (fdatasync), and the
//! directory synced; only then do requests go to the overlay. A crash before the
//! record is durable leaves the old top served and the overlay unused (a
//! record cut short is not one: it does not parse, and is skipped with a
//! warning); after, the new top is served. The old top is never written
//! under an overlay that was used.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What a record's file name ends with: `NEW` + this.
pub const RECORD_SUFFIX: &str = ".ringblk-snapshot";

/// The version [`Record::ringblk_snapshot`] has.
const VERSION: u32 = 1;

/// One snapshot: `superseded` was the top until the overlay `by` was put
/// above it, at `at`.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Record {
    pub ringblk_snapshot: u32,
    pub superseded: String,
    pub by: String,
    pub at: u64,
}

impl Record {
    pub fn new(superseded: &Path, by: &str) -> Result<Record, String> {
        let superseded = superseded
            .to_str()
            .ok_or_else(|| {
                format!(
                    "{}: a snapshot record names the old top, and this path is not UTF-8",
                    superseded.display()
                )
            })?
            .to_string();
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Record {
            ringblk_snapshot: VERSION,
            superseded,
            by: by.to_string(),
            at,
        })
    }

    /// The file name of the record of the overlay `by`.
    pub fn name_for(by: &str) -> String {
        format!("{by}{RECORD_SUFFIX}")
    }

    /// The line the record's file holds.
    pub fn line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_default();
        s.push('\n');
        s
    }

    /// Writes the record into `file` (just created, empty) and syncs it
    /// (fdatasync: it carries the new size; the seccomp filter allows it,
    /// not fsync).
    pub fn write_to(&self, mut file: &File) -> io::Result<()> {
        file.write_all(self.line().as_bytes())?;
        file.sync_data()
    }
}

/// What a record of layers dropped from the chain is named with: a
/// stream (`ctl stream`) writes one into the snapshot directory before it
/// switches the chain, so that a restart knows that the images the
/// snapshot records name but the chain no longer has were dropped, not
/// swapped (see [`dropped`]).
pub const DROPPED_SUFFIX: &str = ".ringblk-dropped";

/// One chain switch that dropped layers: `dropped` (paths as the chain
/// listed them) are no longer below `top`, since `at`.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Dropped {
    pub ringblk_dropped: u32,
    pub top: String,
    pub dropped: Vec<String>,
    pub at: u64,
}

impl Dropped {
    pub fn new(top: &Path, dropped: &[PathBuf]) -> Dropped {
        Dropped {
            ringblk_dropped: VERSION,
            top: top.display().to_string(),
            dropped: dropped.iter().map(|p| p.display().to_string()).collect(),
            at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }

    /// A file name for it: the top's name, the time, and `n` to make it
    /// one no file has (records are created, never overwritten).
    pub fn name_for(&self, n: u32) -> String {
        let top = Path::new(&self.top)
            .file_name()
            .map_or_else(|| "top".into(), |n| n.to_string_lossy().into_owned());
        format!("{top}.{}.{n}{DROPPED_SUFFIX}", self.at)
    }

    pub fn line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_default();
        s.push('\n');
        s
    }
}

/// The record of the block job running (one at a time), in the snapshot
/// directory: written when it starts and removed when it ends, so that a
/// daemon restarted after a crash in the middle of one can say so.
pub const JOB_RECORD: &str = "job.ringblk-job";

/// A block job that started: `kind` on the chain whose top was `top`,
/// onto `base` (none: the top to stand alone), dropping `drops`.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct JobRecord {
    pub ringblk_job: u32,
    pub kind: String,
    pub top: String,
    pub base: Option<String>,
    pub drops: Vec<String>,
    pub at: u64,
    /// An active commit: `base` becomes the top at its pivot, and `top`
    /// is among what it drops.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub active: bool,
}

impl JobRecord {
    pub fn new(kind: &str, chain: &[PathBuf], base: usize) -> JobRecord {
        let name = |p: &PathBuf| p.display().to_string();
        JobRecord {
            ringblk_job: VERSION,
            kind: kind.to_string(),
            top: chain.first().map(name).unwrap_or_default(),
            base: chain.get(base).map(name),
            drops: chain
                .get(1..base)
                .unwrap_or_default()
                .iter()
                .map(name)
                .collect(),
            at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            active: false,
        }
    }

    /// A commit of file `top` of `chain` (and the layers down to `base`)
    /// into file `base`.
    pub fn commit(chain: &[PathBuf], top: usize, base: usize) -> JobRecord {
        let mut r = JobRecord::new("commit", chain, base);
        r.drops = chain
            .get(top..base)
            .unwrap_or_default()
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        r
    }

    /// An active commit of `chain`'s top into file `base` of it.
    pub fn active_commit(chain: &[PathBuf], base: usize) -> JobRecord {
        let mut r = JobRecord::new("commit", chain, base);
        r.drops.insert(0, r.top.clone());
        r.active = true;
        r
    }

    pub fn line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_default();
        s.push('\n');
        s
    }
}

/// The job record in `dir`, if there is one (read as the snapshot
/// records are); one that does not parse is skipped with a warning.
pub fn job(dir: &Path) -> Result<Option<JobRecord>, String> {
    for (path, text) in read_suffixed(dir, ".ringblk-job", "job record")? {
        if path.file_name().is_some_and(|n| n == JOB_RECORD) {
            match serde_json::from_str::<JobRecord>(text.trim_end()) {
                Ok(r) if r.ringblk_job == VERSION => return Ok(Some(r)),
                _ => log::warn!(
                    "{}: not a job record this ringblk knows (cut short by a crash?); ignored",
                    path.display()
                ),
            }
        }
    }
    Ok(None)
}

/// Every image the records in `dir` say a chain switch dropped (as
/// [`Dropped`] lists them). Read as the snapshot records are: bounded, no
/// link followed; a record that does not parse (cut short by a crash
/// before its switch) is skipped.
pub fn dropped(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    for (path, text) in read_suffixed(dir, DROPPED_SUFFIX, "record of dropped layers")? {
        match serde_json::from_str::<Dropped>(text.trim_end()) {
            Ok(d) if d.ringblk_dropped == VERSION => {
                out.extend(d.dropped.iter().map(PathBuf::from));
            }
            Ok(d) => {
                return Err(format!(
                    "{}: a record of version {}, which this ringblk does not know (it knows {VERSION})",
                    path.display(),
                    d.ringblk_dropped
                ));
            }
            Err(_) => log::warn!(
                "{}: not a complete record of dropped layers (a switch cut short before it was recorded); ignored",
                path.display()
            ),
        }
    }
    Ok(out)
}

/// Where [`follow`] led: the top to serve, and the steps that led there.
#[derive(Debug)]
pub struct Followed {
    /// The current top: the last overlay.
    pub top: PathBuf,
    /// Each image followed, top first, down to the named one: what the
    /// top's backing chain must begin with.
    pub chain: Vec<PathBuf>,
    /// The first snapshot's time (the named image's own supersession).
    pub at: u64,
}

/// Reads the records in `dir` (canonical) and follows them from `image`
/// (canonical). `Ok(None)`: no record names `image`, serve it. An error
/// is one line saying what is inconsistent and what to do.
pub fn follow(dir: &Path, image: &Path) -> Result<Option<Followed>, String> {
    let records = read_all(dir)?;
    let mut by_old: HashMap<&str, &(PathBuf, Record)> = HashMap::new();
    for r in &records {
        if let Some(other) = by_old.insert(r.1.superseded.as_str(), r) {
            return Err(format!(
                "the snapshot records {} and {} both say {} was superseded; remove the one that is wrong",
                other.0.display(),
                r.0.display(),
                r.1.superseded
            ));
        }
    }
    let Some(image_str) = image.to_str() else {
        return Ok(None);
    };
    let mut cur = image_str.to_string();
    let mut chain = vec![image.to_path_buf()];
    let mut at = None;
    while let Some((file, rec)) = by_old.get(cur.as_str()).copied() {
        if chain.len() > super::qcow2::MAX_CHAIN {
            return Err(format!(
                "the snapshot records in {} lead from {} through more than {} images (a loop?); fix or remove the records",
                dir.display(),
                image.display(),
                super::qcow2::MAX_CHAIN
            ));
        }
        let next = dir.join(&rec.by);
        // The overlay is a file the daemon created in the directory: a
        // symlink there would have it serve, read-write, whatever the
        // link names (the top is then opened O_NOFOLLOW too).
        let kind = std::fs::symlink_metadata(&next).map(|m| m.file_type());
        if kind.as_ref().is_ok_and(|k| k.is_symlink()) {
            return Err(format!(
                "{} was superseded by the live snapshot {} (record {}), which is a symbolic link, not an overlay the daemon created; refusing to follow it: remove the link, or the record",
                rec.superseded,
                next.display(),
                file.display(),
            ));
        }
        if rec.by.contains('/') || !kind.is_ok_and(|k| k.is_file()) {
            return Err(format!(
                "{} was superseded by the live snapshot {} (record {}), which is missing; restore it (the writes after the snapshot are there), or, to serve {} as it was at the snapshot, remove the record",
                rec.superseded,
                next.display(),
                file.display(),
                rec.superseded
            ));
        }
        at.get_or_insert(rec.at);
        chain.insert(0, next.clone());
        cur = next.to_string_lossy().into_owned();
    }
    let Some(at) = at else { return Ok(None) };
    Ok(Some(Followed {
        top: chain[0].clone(),
        chain,
        at,
    }))
}

/// The most bytes a record may hold: one line of a few hundred bytes
/// (two paths); more is not a record.
pub const RECORD_MAX: usize = 64 << 10;

/// The text of the record at `path`, read without following a symlink
/// or waiting on a FIFO, and at most [`RECORD_MAX`] bytes of it: the
/// directory may hold what someone else put there.
/// The most records a snapshot directory may hold: each is read (at most
/// [`RECORD_MAX`] bytes) and kept at start-up, so a directory filled by
/// someone else must not cost without bound. Far more than any chain the
/// daemon makes in practice (each live snapshot adds one).
const RECORDS_MAX: usize = 4096;

fn read_record(path: &Path) -> io::Result<String> {
    let how = crate::host::Untrusted {
        nofollow: true,
        ..Default::default()
    };
    let file = crate::host::open_untrusted(path, how).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) => io::Error::other("it is a symbolic link"),
        _ => e,
    })?;
    let bytes = crate::host::read_capped(&file, RECORD_MAX)?;
    // Not UTF-8: not a complete record (skipped below, as one cut short).
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Every record in `dir`: a file named `*`[`RECORD_SUFFIX`] that parses.
/// One that does not (a snapshot cut short before its record was synced)
/// is skipped with a warning.
fn read_all(dir: &Path) -> Result<Vec<(PathBuf, Record)>, String> {
    let mut out = Vec::new();
    for (path, text) in read_suffixed(dir, RECORD_SUFFIX, "snapshot record")? {
        match serde_json::from_str::<Record>(text.trim_end()) {
            Ok(r) if r.ringblk_snapshot == VERSION => out.push((path, r)),
            Ok(r) => {
                return Err(format!(
                    "{}: a snapshot record of version {}, which this ringblk does not know (it knows {VERSION})",
                    path.display(),
                    r.ringblk_snapshot
                ));
            }
            Err(_) => log::warn!(
                "{}: not a complete snapshot record (a snapshot cut short before it was recorded; its overlay was never used); ignored",
                path.display()
            ),
        }
    }
    Ok(out)
}

/// The text of each record in `dir` whose name ends with `suffix` (a
/// `what`, for messages), at most [`RECORDS_MAX`] of them.
fn read_suffixed(dir: &Path, suffix: &str, what: &str) -> Result<Vec<(PathBuf, String)>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.ends_with(suffix) {
            continue;
        }
        if out.len() >= RECORDS_MAX {
            return Err(format!(
                "{}: more than {RECORDS_MAX} {what}s; a chain that long is not one the daemon made, or needs merging (qemu-img commit) first",
                dir.display()
            ));
        }
        let path = entry.path();
        let text = read_record(&path).map_err(|e| {
            format!(
                "{}: cannot read this {what}: {e}; a record is a small regular file the daemon wrote: remove what is there",
                path.display()
            )
        })?;
        out.push((path, text));
    }
    Ok(out)
}

/// `at` (seconds since the epoch) as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc(at: u64) -> String {
    i64::try_from(at)
        .ok()
        .and_then(|s| jiff::Timestamp::from_second(s).ok())
        .map_or_else(|| format!("{at} s after the epoch"), |t| t.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formats_known_instants() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_764_118_200), "2025-11-26T00:50:00Z");
    }

    #[test]
    fn records_are_followed_and_cut_short_ones_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let d = std::fs::canonicalize(dir.path()).unwrap();
        let base = d.join("base.qcow2");
        for n in ["base.qcow2", "s1", "s2"] {
            std::fs::write(d.join(n), b"x").unwrap();
        }
        assert!(follow(&d, &base).unwrap().is_none());
        let r1 = Record::new(&base, "s1").unwrap();
        std::fs::write(d.join(Record::name_for("s1")), r1.line()).unwrap();
        let r2 = Record::new(&d.join("s1"), "s2").unwrap();
        std::fs::write(d.join(Record::name_for("s2")), r2.line()).unwrap();
        std::fs::write(d.join(Record::name_for("s3")), &r2.line()[..20]).unwrap();
        let f = follow(&d, &base).unwrap().unwrap();
        assert_eq!(f.top, d.join("s2"));
        assert_eq!(f.chain, vec![d.join("s2"), d.join("s1"), base.clone()]);
        // From the middle of the chain too.
        assert_eq!(
            follow(&d, &d.join("s1")).unwrap().unwrap().top,
            d.join("s2")
        );
        std::fs::remove_file(d.join("s2")).unwrap();
        let e = follow(&d, &base).unwrap_err();
        assert!(e.contains("which is missing"), "{e}");
    }

    /// A directory filled with more records than a chain the daemon
    /// makes is refused with a line, not read to its end.
    #[test]
    fn too_many_records_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for i in 0..=RECORDS_MAX {
            std::fs::write(d.join(format!("{i}{RECORD_SUFFIX}")), b"{").unwrap();
        }
        let e = read_all(d).unwrap_err();
        assert!(e.contains("more than 4096 snapshot records"), "{e}");
        std::fs::remove_file(d.join(format!("0{RECORD_SUFFIX}"))).unwrap();
        assert!(
            read_all(d).unwrap().is_empty(),
            "4096 cut-short records are skipped"
        );
    }
}
