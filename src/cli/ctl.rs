//! `ringblk ctl --api PATH VERB`: the control API's client. Prints what
//! the daemon answers; an error is one line (the daemon's own message)
//! and exit status 1 (`super::exit`).

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::exit::{Failure, out};
use super::stats::StatsArgs;

#[derive(Debug, Args)]
pub struct CtlArgs {
    /// The daemon's control socket (`serve --api PATH`).
    #[arg(long, value_name = "PATH")]
    pub api: PathBuf,

    #[command(subcommand)]
    pub verb: CtlVerb,
}

#[derive(Debug, Subcommand)]
pub enum CtlVerb {
    /// The daemon and its device (JSON): version, uptime, socket, serial,
    /// image lock (held, waiting, idle, off), image, size, queues,
    /// features, write cache, the front-end connected (its pid), QoS.
    Status,
    /// The API's verbs, as the daemon lists them (GET /api/v1/verbs):
    /// methods, path, what each does.
    Verbs {
        /// Print the daemon's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Resize the disk the guest sees, online. With SIZE (bytes, or with a
    /// K/M/G/T suffix), grow a file image to it; with none, re-read the
    /// image's size (a block device that grew). Shrinking needs --force.
    Resize {
        /// The new size; none: re-read the image's size.
        #[arg(value_parser = ringblk_metrics::parse_size)]
        size: Option<u64>,
        /// Allow shrinking: data past the new end is gone for the guest.
        #[arg(long)]
        force: bool,
    },
    /// Show the QoS limits, or change those given (0 removes a limit; the
    /// others stay), effective within a second. Prints the limits in
    /// force (JSON).
    Qos(crate::qos::QosChanges),
    /// Dirty bitmaps: add, remove, list (changed-block tracking for
    /// incremental backups; docs/backup.md).
    #[command(subcommand)]
    Bitmap(BitmapVerb),
    /// A point-in-time backup served over NBD: start, stop, status
    /// (docs/backup.md).
    #[command(subcommand)]
    Backup(BackupVerb),
    /// Take a live external snapshot of a qcow2 image: create the qcow2
    /// overlay NEW.qcow2, whose backing file is the current top of the
    /// chain, and switch every queue to it while the guest runs. Requests
    /// in flight complete on the old top first; the old top is never
    /// written again (a point-in-time image to copy away). The overlay is
    /// created in the daemon's --snapshot-dir: give a bare name or a path
    /// there. Prints the new chain, top first.
    Snapshot {
        /// The new overlay (a file that does not exist yet).
        #[arg(long, value_name = "NEW.qcow2")]
        overlay: PathBuf,
    },
    /// Start a stream job: copy into the top of the chain the data of
    /// the layers between it and --base (without --base: of every layer
    /// below it), while the guest runs; then point the top's backing file
    /// at --base (or at none), so that those layers drop out of the chain.
    /// The daemon never deletes them: `job status` lists the files no
    /// longer used once it completed. Prints the job (JSON).
    Stream {
        /// The layer that becomes the top's backing file: a path of the
        /// chain (`ctl status` lists it).
        #[arg(long, value_name = "IMG")]
        base: Option<PathBuf>,
        /// Bytes per second copied, at most (K/M/G suffixes); none: as
        /// fast as it goes.
        #[arg(long, value_name = "SIZE", value_parser = ringblk_metrics::parse_size)]
        speed: Option<u64>,
    },
    /// Start a commit job: copy into --base (default: the backing file
    /// of --top) the data of --top and of the layers between them, while
    /// the guest runs; then point the layer above --top at --base, so
    /// that they drop out of the chain. --top is the layer right below
    /// the top of the chain, or the top itself (an active commit: the
    /// guest's writes are copied too until they converge, then --base
    /// becomes the top, with the image lock and the bitmaps). --base is
    /// an overlay in the daemon's --snapshot-dir or the image --image
    /// names. The daemon never deletes the layers dropped. Prints the job
    /// (JSON).
    Commit {
        /// The layer to commit: a path of the chain (`ctl status`).
        #[arg(long, value_name = "IMG")]
        top: PathBuf,
        /// The layer it is committed into (default: its backing file).
        #[arg(long, value_name = "IMG")]
        base: Option<PathBuf>,
        /// Bytes per second copied, at most (K/M/G suffixes).
        #[arg(long, value_name = "SIZE", value_parser = ringblk_metrics::parse_size)]
        speed: Option<u64>,
    },
    /// The block job: status, cancel.
    #[command(subcommand)]
    Job(JobVerb),
    /// The counters, as `ringblk stats` prints them.
    Stats {
        /// Print the raw JSON snapshot instead of a table.
        #[arg(long, conflicts_with = "prometheus")]
        json: bool,
        /// Print the raw Prometheus exposition instead of a table.
        #[arg(long)]
        prometheus: bool,
        /// Print what happened in each interval of this many seconds.
        #[arg(long, value_name = "SECS", value_parser = super::stats::parse_interval)]
        interval: Option<f64>,
        /// With --interval: stop after this many intervals.
        #[arg(long, requires = "interval")]
        count: Option<u64>,
    },
}

#[derive(Debug, Subcommand)]
pub enum JobVerb {
    /// The job running or last run (JSON): kind, state (running,
    /// completed, cancelled, failed), bytes done of total, bytes copied,
    /// speed, the chain, the files no longer used.
    Status,
    /// Cancel the running job; the chain stays as it was. Prints the job.
    Cancel,
}

#[derive(Debug, Subcommand)]
pub enum BitmapVerb {
    /// Add a bitmap that records every write, discard and write-zeroes
    /// from now on; it persists (next to the image, or in the daemon's
    /// --bitmap-dir).
    Add {
        /// 1 to 64 characters of A-Z a-z 0-9 . _ - (not starting with . or -).
        name: String,
        /// Bytes per bit: a power of two from 512 to 2G (K, M, G suffixes).
        #[arg(long, value_name = "SIZE", default_value = "64K", value_parser = ringblk_metrics::parse_size)]
        granularity: u64,
    },
    /// Remove a bitmap and its file.
    Remove { name: String },
    /// Every bitmap: name, granularity, dirty bytes, and whether it is
    /// consistent (an inconsistent one may lack changes: take a full
    /// backup).
    List {
        /// Print the JSON the daemon answers instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum BackupVerb {
    /// Serve the disk as it is at this instant, read-only over NBD on a
    /// Unix socket (mode 0600) in the daemon's --backup-dir, while the
    /// guest goes on writing: `qemu-img convert
    /// nbd+unix:///?socket=SOCKET` or `nbdcopy` copies it.
    Start {
        /// The socket: a name in the daemon's --backup-dir, or a path there.
        #[arg(long, value_name = "SOCKET")]
        nbd: PathBuf,
        /// Also export the changes this bitmap recorded up to this instant,
        /// as the metadata context qemu:dirty-bitmap:NAME; the bitmap keeps
        /// them, and records on, until `backup stop` says the backup
        /// succeeded.
        #[arg(long, value_name = "NAME")]
        bitmap: Option<String>,
    },
    /// End the backup: the export ends, what the view kept is dropped;
    /// the changes it exported leave its bitmap (the backup succeeded).
    Stop {
        /// The backup failed: its bitmap keeps every change, so that the
        /// next backup still copies them.
        #[arg(long)]
        failed: bool,
    },
    /// The running backup (JSON), or null.
    Status,
}

/// Runs one verb against the daemon.
pub fn ctl(args: &CtlArgs) -> Result<(), Failure> {
    // A path without '/' would be taken for HOST:PORT.
    let mut addr = args.api.to_string_lossy().into_owned();
    if !addr.contains('/') {
        addr = format!("./{addr}");
    }
    match &args.verb {
        CtlVerb::Status => out(&call(&addr, "GET", "/api/v1/status", b"")?)?,
        CtlVerb::Verbs { json } => {
            let answer = call(&addr, "GET", "/api/v1/verbs", b"")?;
            if *json {
                out(&answer)?;
            } else {
                let verbs: Vec<serde_json::Value> = serde_json::from_str(&answer)
                    .map_err(|e| format!("{}: bad answer: {e}", args.api.display()))?;
                out(&verbs_table(&verbs))?;
            }
        }
        CtlVerb::Resize { size, force } => {
            let mut body = serde_json::Map::new();
            if let Some(bytes) = size {
                body.insert("size".into(), (*bytes).into());
            }
            body.insert("force".into(), (*force).into());
            let body = serde_json::Value::Object(body).to_string();
            let answer = call(&addr, "PUT", "/api/v1/resize", body.as_bytes())?;
            let r: serde_json::Value = serde_json::from_str(&answer)
                .map_err(|e| format!("{}: bad answer: {e}", args.api.display()))?;
            let notified = match r["guest_notified"].as_bool() {
                Some(true) => "the front-end was told".to_string(),
                Some(false) => format!(
                    "the front-end could NOT be told ({})",
                    r["notify_error"].as_str().unwrap_or("no reason given")
                ),
                None => "no front-end connected".to_string(),
            };
            out(&format!(
                "resized from {} to {} bytes; {notified}\n",
                r["old_size"], r["size"]
            ))?;
        }
        CtlVerb::Qos(changes) => {
            let current = call(&addr, "GET", "/api/v1/qos", b"")?;
            let answer = if changes.is_empty() {
                current
            } else {
                // Checked here first, against the limits in force, so that
                // an error names the flags (the daemon's names its JSON).
                let base = serde_json::from_str(&current)
                    .map_err(|e| format!("{}: bad answer: {e}", args.api.display()))?;
                changes.check(base).map_err(Failure::Usage)?;
                let body = serde_json::to_string(changes)
                    .map_err(|e| format!("encoding the QoS changes: {e}"))?;
                call(&addr, "PUT", "/api/v1/qos", body.as_bytes())?
            };
            out(&answer)?;
        }
        CtlVerb::Bitmap(verb) => bitmap(&addr, &args.api, verb)?,
        CtlVerb::Backup(verb) => backup(&addr, &args.api, verb)?,
        CtlVerb::Snapshot { overlay } => {
            let body = serde_json::json!({ "overlay": overlay_path(overlay) }).to_string();
            let answer = call(&addr, "PUT", "/api/v1/snapshot", body.as_bytes())?;
            let r: serde_json::Value = serde_json::from_str(&answer)
                .map_err(|e| format!("{}: bad answer: {e}", args.api.display()))?;
            let chain: Vec<&str> = r["chain"]
                .as_array()
                .map(|c| c.iter().filter_map(|p| p.as_str()).collect())
                .unwrap_or_default();
            out(&format!(
                "snapshot taken: {} is frozen; the chain, top first: {}\n",
                r["frozen"].as_str().unwrap_or("?"),
                chain.join(", ")
            ))?;
        }
        CtlVerb::Stream { base, speed } => {
            let base = match base {
                Some(b) => Some(in_chain(&addr, &args.api, b)?),
                None => None,
            };
            let body = serde_json::json!({ "base": base, "speed": speed }).to_string();
            out(&call(&addr, "PUT", "/api/v1/stream", body.as_bytes())?)?;
        }
        CtlVerb::Commit { top, base, speed } => {
            let top = in_chain(&addr, &args.api, top)?;
            let base = match base {
                Some(b) => Some(in_chain(&addr, &args.api, b)?),
                None => None,
            };
            let body = serde_json::json!({ "top": top, "base": base, "speed": speed }).to_string();
            out(&call(&addr, "PUT", "/api/v1/commit", body.as_bytes())?)?;
        }
        CtlVerb::Job(JobVerb::Status) => out(&call(&addr, "GET", "/api/v1/job", b"")?)?,
        CtlVerb::Job(JobVerb::Cancel) => out(&call(&addr, "POST", "/api/v1/job/cancel", b"{}")?)?,
        CtlVerb::Stats {
            json,
            prometheus,
            interval,
            count,
        } => super::stats::stats(&StatsArgs {
            metrics: addr,
            json: *json,
            prometheus: *prometheus,
            interval: *interval,
            count: *count,
        })?,
    }
    Ok(())
}

/// The chain's own spelling of `wanted` (`ctl status` lists the chain):
/// the entry that is the same file (compared as real paths here, where
/// the daemon's sandbox would not let it look), else `wanted` as given,
/// for the daemon to refuse with the chain in its message.
fn in_chain(
    addr: &str,
    api: &std::path::Path,
    wanted: &std::path::Path,
) -> Result<String, Failure> {
    let status = parse(api, &call(addr, "GET", "/api/v1/status", b"")?)?;
    let real = |p: &std::path::Path| std::fs::canonicalize(p).ok();
    let want = real(wanted);
    let found = status["chain"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p.as_str())
        .find(|p| {
            std::path::Path::new(p) == wanted
                || (want.is_some() && real(std::path::Path::new(p)) == want)
        });
    Ok(found.map_or_else(|| wanted.display().to_string(), str::to_string))
}

/// `GET|PUT  /api/v1/qos  The QoS limits ...`, one line per verb.
fn verbs_table(verbs: &[serde_json::Value]) -> String {
    let mut table = String::new();
    for v in verbs {
        let methods: Vec<&str> = v["methods"]
            .as_array()
            .map(|m| m.iter().filter_map(|m| m.as_str()).collect())
            .unwrap_or_default();
        table.push_str(&format!(
            "{:<15} {:<18} {}\n",
            methods.join("|"),
            v["path"].as_str().unwrap_or_default(),
            v["doc"].as_str().unwrap_or_default()
        ));
    }
    table
}

fn parse(api: &std::path::Path, answer: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(answer).map_err(|e| format!("{}: bad answer: {e}", api.display()))
}

fn bitmap(addr: &str, api: &std::path::Path, verb: &BitmapVerb) -> Result<(), Failure> {
    match verb {
        BitmapVerb::Add { name, granularity } => {
            let body = serde_json::json!({ "name": name, "granularity": granularity });
            let r = parse(
                api,
                &call(
                    addr,
                    "POST",
                    "/api/v1/bitmaps/add",
                    body.to_string().as_bytes(),
                )?,
            )?;
            out(&format!(
                "bitmap '{name}' added (granularity {}): it records every change from now on\n",
                r["granularity"]
            ))?;
        }
        BitmapVerb::Remove { name } => {
            let body = serde_json::json!({ "name": name });
            call(
                addr,
                "POST",
                "/api/v1/bitmaps/remove",
                body.to_string().as_bytes(),
            )?;
            out(&format!("bitmap '{name}' removed\n"))?;
        }
        BitmapVerb::List { json } => {
            let answer = call(addr, "GET", "/api/v1/bitmaps", b"")?;
            if *json {
                return out(&answer);
            }
            let list: Vec<crate::bitmap::BitmapInfo> = serde_json::from_str(&answer)
                .map_err(|e| format!("{}: bad answer: {e}", api.display()))?;
            out(&bitmap_table(&list))?;
        }
    }
    Ok(())
}

/// `bitmap list`'s table.
fn bitmap_table(list: &[crate::bitmap::BitmapInfo]) -> String {
    let width = list.iter().map(|b| b.name.len()).max().unwrap_or(0).max(4);
    let mut t = format!(
        "{:<width$}  {:>11}  {:>15}  CONSISTENT\n",
        "NAME", "GRANULARITY", "DIRTY BYTES"
    );
    for b in list {
        t.push_str(&format!(
            "{:<width$}  {:>11}  {:>15}  {}\n",
            b.name,
            b.granularity,
            b.dirty_bytes,
            if b.consistent {
                "yes"
            } else {
                "NO: take a full backup"
            }
        ));
    }
    t
}

fn backup(addr: &str, api: &std::path::Path, verb: &BackupVerb) -> Result<(), Failure> {
    match verb {
        BackupVerb::Start { nbd, bitmap } => {
            // A bare name is the daemon's to place (in its --backup-dir);
            // a path is made absolute here, where it was meant.
            let nbd = if nbd.parent().is_some_and(|p| !p.as_os_str().is_empty()) {
                std::path::absolute(nbd).map_err(|e| format!("--nbd {}: {e}", nbd.display()))?
            } else {
                nbd.clone()
            };
            let body = serde_json::json!({ "nbd": nbd, "bitmap": bitmap });
            let r = parse(
                api,
                &call(
                    addr,
                    "POST",
                    "/api/v1/backup/start",
                    body.to_string().as_bytes(),
                )?,
            )?;
            let socket = r["socket"].as_str().unwrap_or_default();
            let mut line = format!(
                "backup started: the disk as it was at this instant ({} bytes), read-only on nbd+unix:///?socket={socket}",
                r["size"]
            );
            if let Some(b) = bitmap {
                line.push_str(&format!(
                    ", with the changes bitmap '{b}' recorded as qemu:dirty-bitmap:{b} (it keeps them until `backup stop`)"
                ));
            }
            out(&format!("{line}\n"))?;
        }
        BackupVerb::Stop { failed } => {
            let body = serde_json::json!({ "failed": failed });
            let r = parse(
                api,
                &call(
                    addr,
                    "POST",
                    "/api/v1/backup/stop",
                    body.to_string().as_bytes(),
                )?,
            )?;
            out(&format!(
                "backup stopped{}: {} cluster(s) were copied before the guest overwrote them\n",
                if *failed {
                    " as failed (its bitmap keeps every change)"
                } else {
                    ""
                },
                r["copied_clusters"]
            ))?;
        }
        BackupVerb::Status => out(&call(addr, "GET", "/api/v1/backup", b"")?)?,
    }
    Ok(())
}

/// What the daemon gets for `--overlay`: a bare name as it is (a name in
/// its snapshot directory); a path with its directory resolved here, where
/// the client's working directory and links mean something (the daemon
/// compares the directory with its snapshot directory's real path).
fn overlay_path(overlay: &std::path::Path) -> PathBuf {
    let (Some(dir), Some(name)) = (overlay.parent(), overlay.file_name()) else {
        return overlay.to_path_buf();
    };
    if dir.as_os_str().is_empty() {
        return overlay.to_path_buf();
    }
    match std::fs::canonicalize(dir) {
        Ok(d) => d.join(name),
        Err(_) => overlay.to_path_buf(),
    }
}

/// The body of a 200 answer; otherwise the daemon's `error`, or the
/// status line.
pub(super) fn call(addr: &str, method: &str, path: &str, body: &[u8]) -> Result<String, String> {
    let (status, line, body) = ringblk_metrics::request(addr, method, path, body)
        .map_err(|e| super::stats::explain(&e, "--api"))?;
    if status == 200 {
        return Ok(body);
    }
    let msg = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or(line);
    Err(msg)
}
