//! The image each row of `--compare` serves: the raw file, or for
//! `--format qcow2` one of the qcow2 images qemu-img makes from it. The
//! allocated qcow2 is made once per comparison; the copy-on-write overlay
//! again before every run, so that no run (and no repetition) measures
//! clusters an earlier one allocated. After a run that wrote, `qemu-img
//! check` says how many clusters the run allocated and whether the image
//! is still sound.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use super::BenchError;
use super::args::{CowBase, FormatName, Qcow2Kind};

/// What a row serves: a column of the tables, and keys of the JSON
/// (`"format": "raw"`, or `"format": "qcow2", "qcow2": "allocated"|"cow"`;
/// no `format` at all, in results from before the format axis: raw).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "ImageJson", into = "ImageJson")]
pub enum Image {
    /// The image file (or device, or RBD image) as it is.
    #[default]
    Raw,
    Qcow2(Qcow2Kind),
}

/// [`Image`] as the JSON has it.
#[derive(Clone, Copy, Serialize, Deserialize)]
struct ImageJson {
    #[serde(default)]
    format: FormatName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    qcow2: Option<Qcow2Kind>,
}

impl From<ImageJson> for Image {
    fn from(j: ImageJson) -> Image {
        match j.format {
            FormatName::Raw => Image::Raw,
            FormatName::Qcow2 => Image::Qcow2(j.qcow2.unwrap_or(Qcow2Kind::Allocated)),
        }
    }
}

impl From<Image> for ImageJson {
    fn from(i: Image) -> ImageJson {
        match i {
            Image::Raw => ImageJson {
                format: FormatName::Raw,
                qcow2: None,
            },
            Image::Qcow2(k) => ImageJson {
                format: FormatName::Qcow2,
                qcow2: Some(k),
            },
        }
    }
}

impl Image {
    /// Every image of `formats` × `kinds` (kinds apply to qcow2 only); an
    /// empty list is the default, raw and allocated.
    pub fn all(formats: &[FormatName], kinds: &[Qcow2Kind]) -> Vec<Image> {
        let formats = if formats.is_empty() {
            &[FormatName::Raw][..]
        } else {
            formats
        };
        let kinds = if kinds.is_empty() {
            &[Qcow2Kind::Allocated][..]
        } else {
            kinds
        };
        let mut out = Vec::new();
        for f in formats {
            let more: Vec<Image> = match f {
                FormatName::Raw => vec![Image::Raw],
                FormatName::Qcow2 => kinds.iter().map(|&k| Image::Qcow2(k)).collect(),
            };
            for i in more {
                if !out.contains(&i) {
                    out.push(i);
                }
            }
        }
        out
    }

    pub fn is_raw(self) -> bool {
        self == Image::Raw
    }

    /// The table's format column.
    pub fn label(self) -> &'static str {
        match self {
            Image::Raw => "raw",
            Image::Qcow2(Qcow2Kind::Allocated) => "qcow2",
            Image::Qcow2(Qcow2Kind::Cow) => "qcow2 overlay",
        }
    }

    /// What file names and progress lines add (nothing for raw, so that
    /// raw rows keep the names they always had).
    pub fn tag(self) -> &'static str {
        match self {
            Image::Raw => "",
            Image::Qcow2(Qcow2Kind::Allocated) => "-qcow2",
            Image::Qcow2(Qcow2Kind::Cow) => "-qcow2-cow",
        }
    }
}

/// A qcow2 image a row serves.
#[derive(Clone, Debug)]
pub struct Qcow2 {
    pub file: PathBuf,
    /// The base of an overlay (opened read-only) and its format.
    pub backing: Option<(PathBuf, CowBase)>,
    /// Its cluster size in bytes.
    pub cluster: u64,
}

/// What `qemu-img check` found after a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    /// Data clusters allocated in the image itself (not in its base).
    pub allocated_clusters: u64,
    pub cluster_bytes: u64,
    pub corruptions: u64,
    /// Clusters allocated but not referenced: wasted space, no harm.
    pub leaks: u64,
    /// Errors that kept qemu-img from checking.
    pub check_errors: u64,
}

impl Check {
    /// "clean", or what is wrong.
    pub fn verdict(&self) -> String {
        if self.corruptions == 0 && self.leaks == 0 && self.check_errors == 0 {
            return "clean".into();
        }
        format!(
            "{} corruptions, {} leaked clusters, {} check errors",
            self.corruptions, self.leaks, self.check_errors
        )
    }
}

/// `qemu-img check --output=json`, the fields we read; qemu-img leaves
/// out the ones that are zero.
#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct CheckJson {
    #[serde(default)]
    allocated_clusters: u64,
    #[serde(default)]
    corruptions: u64,
    #[serde(default)]
    leaks: u64,
    #[serde(default)]
    check_errors: u64,
}

/// The qcow2 images of one comparison, made next to the raw image and
/// removed when dropped.
pub struct Images {
    qemu_img: PathBuf,
    raw: PathBuf,
    allocated: Option<Qcow2>,
    cow: Option<Qcow2>,
}

impl Images {
    /// Makes what `images` need from the raw image `raw`, in `dir`: the
    /// allocated qcow2 (also when it is the overlays' base) and the
    /// overlay's first copy (for its cluster size).
    pub fn new(
        qemu_img: &Path,
        raw: &Path,
        dir: &Path,
        images: &[Image],
        cow_base: CowBase,
    ) -> Result<Images, BenchError> {
        let mut me = Images {
            qemu_img: qemu_img.to_path_buf(),
            raw: raw.to_path_buf(),
            allocated: None,
            cow: None,
        };
        let cow = images.contains(&Image::Qcow2(Qcow2Kind::Cow));
        if images.contains(&Image::Qcow2(Qcow2Kind::Allocated))
            || (cow && cow_base == CowBase::Qcow2)
        {
            let file = dir.join("bench.qcow2");
            eprintln!(
                "converting the image to {} (qcow2, every cluster allocated)...",
                file.display()
            );
            // Converted rather than created: the clusters then hold the
            // raw image's data, so reads read the disk as raw's do (a
            // preallocated but unwritten cluster reads as zeroes without
            // touching it). preallocation=metadata lays all L2 tables out
            // first, as `qemu-img create -o preallocation=metadata` does.
            me.qemu_img(&[
                "convert".as_ref(),
                "-f".as_ref(),
                "raw".as_ref(),
                "-O".as_ref(),
                "qcow2".as_ref(),
                "-o".as_ref(),
                "preallocation=metadata".as_ref(),
                raw.as_os_str(),
                file.as_os_str(),
            ])?;
            // qemu-img convert does not flush: O_DIRECT rows must not pay
            // for its writeback.
            std::fs::File::open(&file)
                .and_then(|f| f.sync_all())
                .map_err(BenchError::io(format!("syncing {}", file.display())))?;
            let cluster = me.cluster_size(&file)?;
            me.allocated = Some(Qcow2 {
                file,
                backing: None,
                cluster,
            });
        }
        if cow {
            let base = match (cow_base, &me.allocated) {
                (CowBase::Qcow2, Some(a)) => a.file.clone(),
                _ => raw.to_path_buf(),
            };
            let mut overlay = Qcow2 {
                file: dir.join("bench-overlay.qcow2"),
                backing: Some((base, cow_base)),
                cluster: 0,
            };
            me.make_overlay(&overlay)?;
            overlay.cluster = me.cluster_size(&overlay.file)?;
            me.cow = Some(overlay);
        }
        Ok(me)
    }

    /// What a run of `image` serves: None for raw, else the qcow2 image,
    /// with a fresh, empty overlay made for the copy-on-write kind.
    pub fn prepare(&self, image: Image) -> Result<Option<&Qcow2>, BenchError> {
        let q = match image {
            Image::Raw => return Ok(None),
            Image::Qcow2(Qcow2Kind::Allocated) => self.allocated.as_ref(),
            Image::Qcow2(Qcow2Kind::Cow) => self.cow.as_ref(),
        };
        let q = q.ok_or_else(|| BenchError::Usage(format!("no {} image made", image.label())))?;
        if q.backing.is_some() {
            self.make_overlay(q)?;
        }
        Ok(Some(q))
    }

    /// The file whose pages a cached row reads: for an overlay, its base.
    pub fn data_file(&self, image: Image) -> &Path {
        let q = match image {
            Image::Raw => None,
            Image::Qcow2(Qcow2Kind::Allocated) => self.allocated.as_ref(),
            Image::Qcow2(Qcow2Kind::Cow) => self.cow.as_ref(),
        };
        match q {
            Some(Qcow2 {
                backing: Some((base, _)),
                ..
            }) => base,
            Some(q) => &q.file,
            None => &self.raw,
        }
    }

    /// How the report describes `image`.
    pub fn describe(&self, image: Image) -> String {
        let name = |p: &Path| {
            p.file_name().map_or_else(
                || p.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            )
        };
        match (image, &self.allocated, &self.cow) {
            (Image::Raw, ..) => format!("the image file {}", name(&self.raw)),
            (Image::Qcow2(Qcow2Kind::Allocated), Some(a), _) => format!(
                "{}: the raw image converted with `qemu-img convert -O qcow2 -o preallocation=metadata`, every cluster allocated and holding data ({} KiB clusters)",
                name(&a.file),
                a.cluster >> 10
            ),
            (Image::Qcow2(Qcow2Kind::Cow), _, Some(c)) => {
                let (base, fmt) = c.backing.as_ref().map_or(("?".into(), "?"), |(b, f)| {
                    (name(b), if *f == CowBase::Qcow2 { "qcow2" } else { "raw" })
                });
                format!(
                    "{}: a fresh, empty overlay (`qemu-img create -f qcow2 -b {base} -F {fmt}`, {} KiB clusters) made before every run; where the clients write, each request goes to a cluster of its own (`--distinct {}K`), and the measured window ends early when every cluster has had one: each write, ramp included, allocates a cluster and copies the rest of it from the base",
                    name(&c.file),
                    c.cluster >> 10,
                    c.cluster >> 10
                )
            }
            (i, ..) => format!("{} (not made)", i.label()),
        }
    }

    /// `qemu-img check` of what `q` names, after a run.
    pub fn check(&self, q: &Qcow2) -> Result<Check, BenchError> {
        let out = self.run(&[
            "check".as_ref(),
            "--output=json".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            q.file.as_os_str(),
        ])?;
        // Exit status 2 (corruptions) and 3 (leaks) still print the report.
        let text = String::from_utf8_lossy(&out.stdout);
        if !matches!(out.status.code(), Some(0 | 2 | 3)) || text.trim().is_empty() {
            return Err(self.failed(&out));
        }
        let c: CheckJson = serde_json::from_str(&text).map_err(|e| BenchError::Parse {
            who: "qemu-img check",
            msg: e.to_string(),
        })?;
        Ok(Check {
            allocated_clusters: c.allocated_clusters,
            cluster_bytes: q.cluster,
            corruptions: c.corruptions,
            leaks: c.leaks,
            check_errors: c.check_errors,
        })
    }

    /// (Re)creates the overlay `q` over its base.
    fn make_overlay(&self, q: &Qcow2) -> Result<(), BenchError> {
        let Some((base, fmt)) = &q.backing else {
            return Ok(());
        };
        match std::fs::remove_file(&q.file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(BenchError::io(format!("removing {}", q.file.display()))(e));
            }
            _ => {}
        }
        let fmt = if *fmt == CowBase::Qcow2 {
            "qcow2"
        } else {
            "raw"
        };
        self.qemu_img(&[
            "create".as_ref(),
            "-q".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            "-b".as_ref(),
            base.as_os_str(),
            "-F".as_ref(),
            fmt.as_ref(),
            q.file.as_os_str(),
        ])
        .map(drop)
    }

    /// The cluster size `qemu-img info` gives for `file`.
    fn cluster_size(&self, file: &Path) -> Result<u64, BenchError> {
        let text = self.qemu_img(&[
            "info".as_ref(),
            "--output=json".as_ref(),
            "-f".as_ref(),
            "qcow2".as_ref(),
            file.as_os_str(),
        ])?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| BenchError::Parse {
            who: "qemu-img info",
            msg: e.to_string(),
        })?;
        v["cluster-size"].as_u64().ok_or_else(|| BenchError::Parse {
            who: "qemu-img info",
            msg: format!("no cluster-size for {}", file.display()),
        })
    }

    /// Runs qemu-img; its standard output, or its standard error as the
    /// failure.
    fn qemu_img(&self, args: &[&std::ffi::OsStr]) -> Result<String, BenchError> {
        let out = self.run(args)?;
        if !out.status.success() {
            return Err(self.failed(&out));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn run(&self, args: &[&std::ffi::OsStr]) -> Result<std::process::Output, BenchError> {
        Command::new(&self.qemu_img)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|source| BenchError::Spawn {
                program: self.qemu_img.display().to_string(),
                source,
            })
    }

    fn failed(&self, out: &std::process::Output) -> BenchError {
        BenchError::Failed {
            who: "qemu-img",
            status: out.status,
            log: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        }
    }
}

impl Drop for Images {
    fn drop(&mut self) {
        for q in self.allocated.iter().chain(&self.cow) {
            let _ = std::fs::remove_file(&q.file);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_axis_and_its_json() {
        assert_eq!(Image::all(&[], &[]), [Image::Raw]);
        assert_eq!(
            Image::all(&[FormatName::Qcow2], &[]),
            [Image::Qcow2(Qcow2Kind::Allocated)]
        );
        let all = Image::all(
            &[FormatName::Raw, FormatName::Qcow2, FormatName::Raw],
            &[Qcow2Kind::Allocated, Qcow2Kind::Cow],
        );
        assert_eq!(
            all,
            [
                Image::Raw,
                Image::Qcow2(Qcow2Kind::Allocated),
                Image::Qcow2(Qcow2Kind::Cow)
            ]
        );
        assert_eq!(
            serde_json::to_value(Image::Qcow2(Qcow2Kind::Cow)).expect("serializes"),
            serde_json::json!({"format": "qcow2", "qcow2": "cow"})
        );
        assert_eq!(
            serde_json::to_value(Image::Raw).expect("serializes"),
            serde_json::json!({"format": "raw"})
        );
    }

    #[test]
    fn check_reads_what_qemu_img_prints() {
        let c: CheckJson = serde_json::from_str(
            r#"{"image-end-offset": 262144, "total-clusters": 1024, "check-errors": 0,
            "allocated-clusters": 12, "leaks": 2, "filename": "o.qcow2", "format": "qcow2"}"#,
        )
        .expect("parses");
        assert_eq!((c.allocated_clusters, c.leaks, c.corruptions), (12, 2, 0));
        let clean: CheckJson = serde_json::from_str(r#"{"check-errors": 0}"#).expect("parses");
        assert_eq!(clean.allocated_clusters, 0);
    }

    /// Whether qemu-img and qemu-io run; under CI they must
    /// (scripts/bench-tools.sh installs them).
    fn qemu_tools() -> bool {
        let ok = ["qemu-img", "qemu-io"].iter().all(|t| {
            Command::new(t)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        });
        assert!(
            ok || std::env::var_os("CI").is_none(),
            "CI is set but qemu-img or qemu-io is missing (scripts/bench-tools.sh)"
        );
        ok
    }

    /// Every run gets an empty overlay: what one run wrote into it is gone
    /// for the next, and the allocated qcow2 holds every cluster.
    #[test]
    fn a_fresh_overlay_for_every_run() {
        if !qemu_tools() {
            eprintln!("skipped: qemu-img or qemu-io is missing");
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let raw = dir.path().join("bench.img");
        std::fs::write(&raw, vec![0x5a; 1 << 20]).expect("raw image");
        let cow = Image::Qcow2(Qcow2Kind::Cow);
        let all = [Image::Raw, Image::Qcow2(Qcow2Kind::Allocated), cow];
        let images = Images::new(
            Path::new("qemu-img"),
            &raw,
            dir.path(),
            &all,
            CowBase::Qcow2,
        )
        .expect("images made");
        let alloc = images
            .prepare(Image::Qcow2(Qcow2Kind::Allocated))
            .expect("prepared")
            .expect("a qcow2");
        assert_eq!(images.check(alloc).expect("checked").allocated_clusters, 16);
        let overlay = images
            .prepare(cow)
            .expect("prepared")
            .expect("a qcow2")
            .clone();
        assert_eq!(
            overlay.backing,
            Some((dir.path().join("bench.qcow2"), CowBase::Qcow2))
        );
        assert_eq!(images.data_file(cow), dir.path().join("bench.qcow2"));
        let write = Command::new("qemu-io")
            .args([
                "-f",
                "qcow2",
                "-c",
                "write -P 7 0 4k",
                "-c",
                "write -P 7 512k 4k",
            ])
            .arg(&overlay.file)
            .output()
            .expect("qemu-io runs");
        assert!(write.status.success(), "{write:?}");
        let c = images.check(&overlay).expect("checked");
        assert_eq!((c.allocated_clusters, c.verdict().as_str()), (2, "clean"));
        images.prepare(cow).expect("prepared again");
        assert_eq!(
            images.check(&overlay).expect("checked").allocated_clusters,
            0
        );
        drop(images);
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .expect("readdir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(left, ["bench.img"], "the qcow2 images are removed");
    }
}
