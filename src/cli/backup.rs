//! `ringblk backup`: a full or incremental backup of a running daemon's
//! disk into a directory of qcow2 files, in one command; and `backup
//! verify|restore|prune` on that directory (docs/backup.md). This file
//! decides *when*: which bitmap, full or incremental (and why), the
//! daemon's `backup start`, and how it ends: `backup stop` once the
//! backup is in the manifest, `backup stop --failed` on anything else, so
//! that a bitmap's bits leave it only when a backup is known to be whole.
//! The copying and the directory are [`crate::backup::archive`]'s.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use clap::{Args, Subcommand, ValueEnum};

use super::exit::{Failure, out};
use crate::backup::archive::{self, DirLock, Kind, Manifest, Point, RestoreFormat, Take};

/// The bitmap `ringblk backup` uses unless told otherwise.
pub const DEFAULT_BITMAP: &str = "ringblk-backup";
/// The NBD socket's name in the daemon's --backup-dir: this process's.
const SOCKET_PREFIX: &str = "ringblk-backup-";

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct BackupArgs {
    #[command(subcommand)]
    pub verb: Option<BackupVerb>,
    /// The daemon's control socket (serve --api; the daemon needs
    /// --backup-dir).
    #[arg(long, value_name = "PATH", required = true)]
    pub api: Option<PathBuf>,
    /// The backup directory: NNNN-full.qcow2, NNNN-inc.qcow2, their
    /// checksums and manifest.json (created if missing).
    #[arg(long, value_name = "DIR", required = true)]
    pub to: Option<PathBuf>,
    /// The dirty bitmap that tracks the changes between backups (added
    /// if the daemon has none of that name).
    #[arg(long, value_name = "NAME", default_value = DEFAULT_BITMAP)]
    pub bitmap: String,
    /// A full backup, even where an incremental one would do.
    #[arg(long)]
    pub full: bool,
    /// Print a JSON summary instead of lines.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum BackupVerb {
    /// Check a backup: each file of its chain against its recorded
    /// SHA-256, and the disk it holds against the checksum taken at its
    /// instant. No daemon needed.
    Verify {
        /// The backup directory.
        dir: PathBuf,
        /// The backup to check (its number, NNNN); default the last.
        #[arg(long, value_name = "N")]
        upto: Option<u32>,
        /// Print a JSON summary.
        #[arg(long)]
        json: bool,
    },
    /// Write the disk of a backup into a new image, sparse, checked
    /// against its checksum as it is read. No daemon needed.
    Restore {
        /// The backup directory.
        dir: PathBuf,
        /// The backup to restore (its number, NNNN); default the last.
        #[arg(long, value_name = "N")]
        upto: Option<u32>,
        /// The new image (must not exist).
        #[arg(long, value_name = "IMAGE")]
        to: PathBuf,
        /// Its format.
        #[arg(long, value_enum, default_value = "raw")]
        format: Format,
    },
    /// Keep the newest N restore points: the oldest kept one becomes a
    /// full backup, the older files are removed. No daemon needed.
    Prune {
        /// The backup directory.
        dir: PathBuf,
        /// How many restore points to keep (at least 1).
        #[arg(long, value_name = "N")]
        keep: usize,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    Raw,
    Qcow2,
}

pub fn run(args: &BackupArgs) -> Result<(), Failure> {
    match &args.verb {
        Some(BackupVerb::Verify { dir, upto, json }) => verify(dir, *upto, *json),
        Some(BackupVerb::Restore {
            dir,
            upto,
            to,
            format,
        }) => restore(dir, *upto, to, *format),
        Some(BackupVerb::Prune { dir, keep }) => prune(dir, *keep),
        None => {
            let (Some(api), Some(dir)) = (&args.api, &args.to) else {
                return Err(Failure::Usage("backup needs --api and --to".into()));
            };
            take(args, api, dir)
        }
    }
}

/// The control API's answers, as `ctl` calls it.
struct Api {
    addr: String,
    path: PathBuf,
}

impl Api {
    fn new(path: &Path) -> Api {
        // A path without '/' would be taken for HOST:PORT.
        let mut addr = path.to_string_lossy().into_owned();
        if !addr.contains('/') {
            addr = format!("./{addr}");
        }
        Api {
            addr,
            path: path.to_path_buf(),
        }
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        body: serde_json::Value,
    ) -> Result<serde_json::Value, String> {
        let body = if body.is_null() {
            Vec::new()
        } else {
            body.to_string().into_bytes()
        };
        let answer = super::ctl::call(&self.addr, method, path, &body)?;
        serde_json::from_str(&answer)
            .map_err(|e| format!("{}: bad answer: {e}", self.path.display()))
    }
}

/// Progress on standard error: on a terminal, one line rewritten in
/// place (at most five times a second); else a line per 10%. (Not
/// indicatif's bar: the daemon's binary does not link the benchmark
/// client's stack, scripts/test.sh "daemon dependencies".)
struct Progress {
    terminal: bool,
    started: Instant,
    shown: Option<Instant>,
    last_tenth: u64,
    what: &'static str,
}

impl Progress {
    fn new(what: &'static str) -> Progress {
        Progress {
            terminal: std::io::stderr().is_terminal(),
            started: Instant::now(),
            shown: None,
            last_tenth: 0,
            what,
        }
    }

    fn update(&mut self, done: u64, total: u64) {
        if total == 0 {
            return;
        }
        if self.terminal {
            if self
                .shown
                .is_some_and(|t| t.elapsed().as_millis() < 200 && done < total)
            {
                return;
            }
            self.shown = Some(Instant::now());
            let secs = self.started.elapsed().as_secs_f64().max(1e-3);
            eprint!(
                "\r{}: {:>3}% {} of {}, {}/s   ",
                self.what,
                done * 100 / total,
                human(done),
                human(total),
                human((done as f64 / secs) as u64)
            );
            return;
        }
        let tenth = done * 10 / total;
        if tenth > self.last_tenth {
            self.last_tenth = tenth;
            eprintln!("{}: {}% ({done} of {total} bytes)", self.what, tenth * 10);
        }
    }

    fn done(&self) {
        if self.terminal && self.shown.is_some() {
            eprintln!();
        }
    }
}

/// Takes a backup (see the module doc).
fn take(args: &BackupArgs, api_path: &Path, dir: &Path) -> Result<(), Failure> {
    let api = Api::new(api_path);
    std::fs::create_dir_all(dir).map_err(|e| format!("--to {}: {e}", dir.display()))?;
    let _lock = DirLock::take(dir).map_err(|e| e.to_string())?;
    let manifest = Manifest::load(dir).map_err(|e| e.to_string())?;
    end_stale_backup(&api)?;
    let name = args.bitmap.as_str();
    crate::bitmap::check_name(name).map_err(|e| Failure::Usage(format!("--bitmap: {e}")))?;
    let bitmaps = api.call("GET", "/api/v1/bitmaps", serde_json::Value::Null)?;
    let info = bitmaps
        .as_array()
        .and_then(|l| l.iter().find(|b| b["name"] == name))
        .cloned();
    let last = manifest.points.last();
    let mut why_full = if args.full {
        Some("--full".to_string())
    } else if last.is_none() {
        Some(format!("the first backup in {}", dir.display()))
    } else if info.is_none() {
        Some(format!(
            "the daemon has no bitmap '{name}' (it is added now)"
        ))
    } else if info.as_ref().is_some_and(|i| i["consistent"] != true) {
        Some(format!(
            "bitmap '{name}' is inconsistent (the daemon stopped uncleanly, or it lost changes): it may lack some"
        ))
    } else if last.is_some_and(|p| p.bitmap.as_deref() != Some(name)) {
        Some(format!(
            "the last backup was not taken with bitmap '{name}'"
        ))
    } else {
        None
    };
    if info.is_none() {
        api.call(
            "POST",
            "/api/v1/bitmaps/add",
            serde_json::json!({ "name": name, "granularity": 65536 }),
        )?;
    }
    let socket_name = format!("{SOCKET_PREFIX}{}.sock", std::process::id());
    let at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let started = api.call(
        "POST",
        "/api/v1/backup/start",
        serde_json::json!({ "nbd": socket_name, "bitmap": name }),
    )?;
    let socket = PathBuf::from(started["socket"].as_str().unwrap_or_default());
    let size = started["size"].as_u64().unwrap_or(0);
    if why_full.is_none()
        && let Some(p) = last
        && p.size != size
    {
        why_full = Some(format!(
            "the disk is {size} bytes, and was {} at backup {:04}",
            p.size, p.n
        ));
    }
    let granularity = info
        .as_ref()
        .and_then(|i| i["granularity"].as_u64())
        .unwrap_or(65536);
    if let Some(why) = &why_full
        && !args.json
    {
        eprintln!("ringblk backup: a full backup: {why}");
    }
    let t0 = Instant::now();
    let mut progress = Progress::new("backup");
    let taken = archive::take(
        &Take {
            dir,
            socket: &socket,
            bitmap: Some(name),
            granularity,
            incremental: why_full.is_none(),
            at,
        },
        &manifest,
        &mut |d, t| progress.update(d, t),
    );
    progress.done();
    // In the manifest before the daemon hears it succeeded: its bits
    // leave the bitmap only once the backup is recorded.
    let recorded = taken.and_then(|point| {
        let mut m = manifest.clone();
        m.points.push(point.clone());
        m.save(dir).map(|()| point)
    });
    let point = match recorded {
        Ok(p) => p,
        Err(e) => {
            let stop = api.call(
                "POST",
                "/api/v1/backup/stop",
                serde_json::json!({ "failed": true }),
            );
            let also = match stop {
                Ok(_) => {
                    "; the daemon's bitmap keeps every change (`backup stop --failed`)".to_string()
                }
                Err(s) => format!(
                    "; and the daemon could not be told ({s}): its bitmap keeps every change until it is"
                ),
            };
            return Err(Failure::Runtime(format!("backup failed: {e}{also}")));
        }
    };
    let stopped = api.call(
        "POST",
        "/api/v1/backup/stop",
        serde_json::json!({ "failed": false }),
    );
    let secs = t0.elapsed().as_secs_f64();
    if let Err(e) = &stopped {
        eprintln!(
            "ringblk backup: backup {:04} is whole in {}, but the daemon could not be told it succeeded ({e}): its bitmap keeps the changes, and the next backup copies them again",
            point.n,
            dir.display()
        );
    }
    if args.json {
        let summary = serde_json::json!({
            "point": point,
            "full_because": why_full,
            "seconds": secs,
            "daemon_told": stopped.is_ok(),
        });
        out(&format!("{summary:#}\n"))?;
    } else {
        out(&format!(
            "backup {:04} ({}): {} copied of {} in {secs:.1} s into {}; sha256 of the disk {}\n",
            point.n,
            match point.kind {
                Kind::Full => "full".to_string(),
                Kind::Incremental => format!("incremental over {:04}", point.n - 1),
            },
            human(point.copied),
            human(point.size),
            dir.join(&point.file).display(),
            point.sha256
        ))?;
    }
    Ok(())
}

/// A backup this command started and did not end (it was killed): the
/// daemon still serves it on this command's socket, whose process is
/// gone. It ends as failed (its bitmap keeps every change). Any other
/// running backup refuses this one.
fn end_stale_backup(api: &Api) -> Result<(), Failure> {
    let running = api.call("GET", "/api/v1/backup", serde_json::Value::Null)?;
    if running.is_null() {
        return Ok(());
    }
    let socket = running["socket"].as_str().unwrap_or_default().to_string();
    let pid = Path::new(&socket)
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix(SOCKET_PREFIX))
        .and_then(|n| n.strip_suffix(".sock"))
        .and_then(|n| n.parse::<i32>().ok());
    // Signal 0 sends nothing and asks whether the process exists (EPERM:
    // it does, as another user's).
    let alive = pid.filter(|&p| p > 0).is_some_and(|p| {
        // SAFETY: kill(2) takes no pointers.
        let sent = unsafe { libc::kill(p, 0) };
        sent == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
    });
    match pid {
        Some(_) if !alive => {
            api.call(
                "POST",
                "/api/v1/backup/stop",
                serde_json::json!({ "failed": true }),
            )?;
            eprintln!(
                "ringblk backup: a backup an earlier `ringblk backup` started was left running (NBD on {socket}); ended as failed: its bitmap keeps every change"
            );
            Ok(())
        }
        _ => Err(Failure::Runtime(format!(
            "a backup is running (NBD on {socket}); wait for it, or end it with `ctl backup stop --failed`"
        ))),
    }
}

fn verify(dir: &Path, upto: Option<u32>, json: bool) -> Result<(), Failure> {
    let _lock = DirLock::take(dir).map_err(|e| e.to_string())?;
    let mut progress = Progress::new("verify");
    let v = archive::verify(dir, upto, &mut |d, t| progress.update(d, t));
    progress.done();
    let v = v.map_err(|e| format!("verify failed: {e}"))?;
    if json {
        out(&format!("{:#}\n", serde_json::json!(v)))
    } else {
        out(&format!(
            "backup {:04} verified: {} match their SHA-256, and the disk reads as at its instant (sha256 {})\n",
            v.n,
            v.files.join(", "),
            v.sha256
        ))
    }
}

fn restore(dir: &Path, upto: Option<u32>, to: &Path, format: Format) -> Result<(), Failure> {
    let _lock = DirLock::take(dir).map_err(|e| e.to_string())?;
    let mut progress = Progress::new("restore");
    let format = match format {
        Format::Raw => RestoreFormat::Raw,
        Format::Qcow2 => RestoreFormat::Qcow2,
    };
    let p: Result<Point, _> =
        archive::restore(dir, upto, to, format, &mut |d, t| progress.update(d, t));
    progress.done();
    let p = p.map_err(|e| format!("restore failed: {e}"))?;
    out(&format!(
        "backup {:04} restored into {} ({} bytes), checked against its checksum\n",
        p.n,
        to.display(),
        p.size
    ))
}

fn prune(dir: &Path, keep: usize) -> Result<(), Failure> {
    if keep == 0 {
        return Err(Failure::Usage(
            "--keep 0 would remove every backup; keep at least 1".into(),
        ));
    }
    let _lock = DirLock::take(dir).map_err(|e| e.to_string())?;
    let mut progress = Progress::new("prune");
    let p = archive::prune(dir, keep, &mut |d, t| progress.update(d, t));
    progress.done();
    let p = p.map_err(|e| format!("prune failed: {e}"))?;
    out(&format!(
        "kept {}; removed {}\n",
        p.kept
            .iter()
            .map(|n| format!("{n:04}"))
            .collect::<Vec<_>>()
            .join(", "),
        if p.removed.is_empty() {
            "nothing".to_string()
        } else {
            p.removed.join(", ")
        }
    ))
}

/// `n` bytes for a person.
fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} bytes")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
